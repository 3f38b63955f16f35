"""Two-server secure sum of sparse row updates with distributed point functions.

**Parties.** ``n`` clients, each holding a table update that is nonzero on at most ``P`` of its
``N`` rows (``d`` words per row, fixed point in Z_2^64); two servers, **A** (party 0, the
*receiver*, which learns the sum) and **B** (party 1).

**Adversary.** Each server alone is honest-but-curious: it follows the protocol and records
everything it receives. The two servers do **not** collude. Clients may be malicious: a client may
send any bytes, any keys, different keys to A and B.

**Promise.**

* A learns the exact Z_2^64 sum of the updates of the *survivors*: the clients whose keys both
  servers received and verified. Dropouts cost nothing: there is no unmasking round, a client
  whose key reached only one server is simply not counted (by either).
* Each server's view of a client (its key set, :mod:`secagg.dpf`) is independent of the client's
  rows and values (computationally, under the PRG): it learns neither which rows were touched nor
  how many (always ``m`` trees). B's view of the round is its keys, the ids A received, the challenge
  and A's digests: nothing about the inputs. A's view adds B's share, which with its own gives the
  sum and nothing more.
* A client adds to at most ``m`` rows (``m``: the layout's buckets): every key set is verified to be
  ``m`` point functions (the VDPF check of :mod:`secagg.dpf`, a challenge drawn by A after the keys
  arrived, digests compared, failures removed from both sums).
* The sum is released only over at least ``max(floor)`` survivors, each client's ``floor`` (its own
  ``min_survivors``, carried in its upload) enforced by **both** servers: the one that does not
  learn the sum (B) withholds its share below it, so a receiver that deviates cannot get a sum
  over fewer clients than a survivor asked for. B answers once per instance and round.

**Limits** (each shown by a test in ``tests/secagg/test_dpf_sum.py``):

* A and B together evaluate both keys of a client and read its update: non-collusion is the
  whole assumption.
* A malicious client can touch up to ``m`` rows, not ``P`` (``m = buckets_for(P)``, 230 for
  ``P = 100``): the check bounds the number of point functions, not which buckets hold a real
  point. Values are not range-checked: a malicious client adds any Z_2^64 value to its rows (as
  with SecAgg, where a client can send any vector).
* The cuckoo placement fails for a client with probability below ``2^-40``
  (:func:`secagg.cuckoo.buckets_for`); such a client sits the round out.

**Stages** (messages are :class:`secagg.messages.Message` kinds 80-84)::

    client i --DpfUpload(key_0)--> A          client i --DpfUpload(key_1)--> B      (1 upload each)
    A --DpfIds(received)--> B,  B --DpfIds(received)--> A                           survivors = both
    A --DpfChallenge(16 random bytes)--> B                                          after uploads close
    A, B: sum every survivor's full-domain evaluation; per client a 48-byte digest
    A --DpfDigests--> B,  B --DpfDigests--> A                                       mismatches removed
    B --DpfShare(survivors, B's share)--> A                                          if >= every floor
    A: sum = share_A + share_B  (decode with secagg.encoding.FixedPoint)
"""

from __future__ import annotations

import enum
import hmac
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from secagg.cuckoo import CuckooError, CuckooLayout
from secagg.dpf import Accumulator, DpfError, Forest, KeySet, gen
from secagg.errors import AbortError, MessageError
from secagg.messages import INSTANCE_BYTES, SERVER, Message, Reader, Writer, decode, register

__all__ = [
    "SERVER_A",
    "SERVER_B",
    "DpfChallenge",
    "DpfDigests",
    "DpfIds",
    "DpfShare",
    "DpfSpec",
    "DpfSumClient",
    "DpfSumConfig",
    "DpfSumResult",
    "DpfSumServer",
    "DpfUpload",
    "run_dpf",
]

SERVER_A = SERVER  #: party id of server A (the receiver) in message headers
SERVER_B = SERVER - 1  #: party id of server B
_DIGEST = 48
_MAX_CLIENTS = 2**24


class Stage(enum.IntEnum):
    """Message stages (= kinds) of the two-server sum."""

    UPLOAD = 80
    IDS = 81
    CHALLENGE = 82
    DIGESTS = 83
    SHARE = 84


@dataclass(frozen=True)
class DpfSumConfig:
    """Public parameters of one aggregation.

    Attributes:
        n: number of clients (ids ``0 .. n-1``).
        layout: the public cuckoo layout (rows ``N``, buckets ``m``, seed).
        width: ``d``, words per row.
        points: ``P``, the rows a client may declare (at most ``m``).
        instance: 16-byte instance id; round: the round number (bound into every message).
        check: verify every key set (the VDPF check); ``False`` only to measure its cost.
    """

    n: int
    layout: CuckooLayout
    width: int
    points: int
    instance: bytes
    round: int = 0
    check: bool = True
    forest: Forest = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.n) is not int or not 1 <= self.n <= _MAX_CLIENTS:
            raise ValueError(f"n must be an int in [1, 2^24]; found {self.n!r}")
        if type(self.width) is not int or self.width < 1:
            raise ValueError(f"width must be a positive int; found {self.width!r}")
        if type(self.points) is not int or not 1 <= self.points <= self.layout.buckets:
            raise ValueError(f"points must be an int in [1, {self.layout.buckets}]; found {self.points!r}")
        if not isinstance(self.instance, bytes) or len(self.instance) != INSTANCE_BYTES:
            raise ValueError(f"instance must be {INSTANCE_BYTES} bytes")
        object.__setattr__(self, "forest", Forest(self.layout.sizes, self.layout.depth))

    def key_bytes(self) -> int:
        """Bytes of one key set (the same for every client, point and value)."""
        return KeySet.size(depth=self.layout.depth, points=self.layout.buckets, width=self.width, check=self.check)


# -- messages ----------------------------------------------------------------------------------------

@register
@dataclass(frozen=True)
class DpfUpload(Message):
    """Client -> one server: the client's survivor floor and its key set for that server."""

    KIND = int(Stage.UPLOAD)
    STAGE = int(Stage.UPLOAD)
    floor: int = 2
    key: bytes = b""

    def _write_body(self, w: Writer) -> None:
        w.u32(self.floor).u32(len(self.key)).raw(self.key)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> DpfUpload:
        floor = r.u32()
        return cls(**head, floor=floor, key=r.raw(r.u32()))


@register
@dataclass(frozen=True)
class DpfIds(Message):
    """Server -> server: the client ids it received (or verified)."""

    KIND = int(Stage.IDS)
    STAGE = int(Stage.IDS)
    ids: tuple[int, ...] = ()

    def _write_body(self, w: Writer) -> None:
        w.u32_array(list(self.ids))

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> DpfIds:
        return cls(**head, ids=tuple(int(i) for i in r.u32_array(max_len=_MAX_CLIENTS)))


@register
@dataclass(frozen=True)
class DpfChallenge(Message):
    """A -> B: the 16 random bytes keying the check, drawn after the uploads closed."""

    KIND = int(Stage.CHALLENGE)
    STAGE = int(Stage.CHALLENGE)
    challenge: bytes = bytes(16)

    def _write_body(self, w: Writer) -> None:
        w.raw(self.challenge)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> DpfChallenge:
        return cls(**head, challenge=r.raw(16))


@register
@dataclass(frozen=True)
class DpfDigests(Message):
    """Server -> server: each survivor's check digest (16-byte MAC, 32-byte public-part hash)."""

    KIND = int(Stage.DIGESTS)
    STAGE = int(Stage.DIGESTS)
    digests: tuple[tuple[int, bytes], ...] = ()

    def _write_body(self, w: Writer) -> None:
        w.u32(len(self.digests))
        for cid, d in self.digests:
            w.u32(cid).raw(d)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> DpfDigests:
        count = r.u32()
        if count > _MAX_CLIENTS:
            raise MessageError(f"DpfDigests: {count} entries exceed the limit")
        return cls(**head, digests=tuple((r.u32(), r.raw(_DIGEST)) for _ in range(count)))


@register
@dataclass(frozen=True)
class DpfShare(Message):
    """B -> A: the survivors B summed and B's share of their sum (``N x d`` words, row-major)."""

    KIND = int(Stage.SHARE)
    STAGE = int(Stage.SHARE)
    survivors: tuple[int, ...] = ()
    share: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))

    def _write_body(self, w: Writer) -> None:
        w.u32_array(list(self.survivors)).u64_vector(self.share)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> DpfShare:
        ids = tuple(int(i) for i in r.u32_array(max_len=_MAX_CLIENTS))
        return cls(**head, survivors=ids, share=r.u64_vector())


# -- parties -----------------------------------------------------------------------------------------

class DpfSumClient:
    """One client: places its rows in the layout's buckets and sends one key set to each server.

    Args:
        cfg: the public parameters.
        client_id: its id in ``[0, n)``.
        floor: its own ``min_survivors`` (at least 2): the servers release no sum over fewer.
    """

    def __init__(self, cfg: DpfSumConfig, client_id: int, *, floor: int = 2) -> None:
        if type(floor) is not int or floor < 2:
            raise ValueError(f"floor (min_survivors) must be an int >= 2; found {floor!r}")
        self.cfg, self.id, self.floor, self.sent = cfg, client_id, floor, False

    def upload(self, rows: np.ndarray, values: np.ndarray) -> tuple[bytes, bytes]:
        """The two uploads (to A, to B) for an update with ``values[i]`` at row ``rows[i]``.

        Raises:
            ValueError: more rows than declared, repeated or out-of-range rows, a bad value array.
            CuckooError: the rows admit no placement in this layout (the client sits out).
            MessageError: called twice (one upload per instance and round).
        """
        if self.sent:
            raise MessageError(f"client {self.id}: already uploaded in round {self.cfg.round}")
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or rows.size > self.cfg.points:
            raise ValueError(f"client {self.id}: {rows.size} rows, above the declared {self.cfg.points}")
        values = np.asarray(values)
        if values.dtype != np.uint64 or values.shape != (rows.size, self.cfg.width):
            raise ValueError(f"values must be uint64 [{rows.size}, {self.cfg.width}]; found {values.dtype} {values.shape}")
        alpha, beta = self.cfg.layout.spread(rows, values)
        k0, k1, _ = gen(alpha, self.cfg.layout.depth, beta, check=self.cfg.check)
        self.sent = True
        c = self.cfg
        return tuple(DpfUpload(c.instance, c.round, self.id, to, floor=self.floor, key=k.to_bytes()).to_bytes()
                     for to, k in ((SERVER_A, k0), (SERVER_B, k1)))  # type: ignore[return-value]


class DpfSumServer:
    """Server A (``party = 0``, the receiver) or B (``party = 1``); see the module docstring."""

    def __init__(self, cfg: DpfSumConfig, party: int) -> None:
        if party not in (0, 1):
            raise ValueError(f"party must be 0 or 1; found {party!r}")
        self.cfg, self.party = cfg, party
        self.me, self.peer = (SERVER_A, SERVER_B) if party == 0 else (SERVER_B, SERVER_A)
        self.keys: dict[int, KeySet] = {}
        self.floors: dict[int, int] = {}
        self.survivors: list[int] | None = None
        self.challenge: bytes | None = None
        self.digests: dict[int, bytes] = {}
        self.acc: Accumulator | None = None
        self.shared = False
        self.stage = Stage.UPLOAD

    def _check_head(self, msg: Message, stage: Stage, sender_is_peer: bool) -> None:
        c = self.cfg
        if msg.instance != c.instance or msg.round != c.round:
            raise MessageError(f"stage {stage.name}: wrong instance or round {msg.round} (expected {c.round})")
        if msg.receiver != self.me:
            raise MessageError(f"stage {stage.name}: addressed to {msg.receiver:#x}, not this server")
        if sender_is_peer and msg.sender != self.peer:
            raise MessageError(f"stage {stage.name}: sender {msg.sender:#x} is not the other server")

    def receive(self, blob: bytes) -> int:
        """Accept one client upload (validated; the key parsed strictly); returns the sender."""
        if self.stage != Stage.UPLOAD:
            raise MessageError(f"stage {self.stage.name}: uploads are closed")
        msg = decode(blob)
        if not isinstance(msg, DpfUpload):
            raise MessageError(f"stage UPLOAD: unexpected {type(msg).__name__}")
        self._check_head(msg, Stage.UPLOAD, False)
        if not 0 <= msg.sender < self.cfg.n:
            raise MessageError(f"stage UPLOAD: bad sender {msg.sender}")
        if msg.sender in self.keys:
            raise MessageError(f"stage UPLOAD: replayed upload from client {msg.sender} (already received)")
        if not 2 <= msg.floor <= self.cfg.n:
            raise MessageError(f"stage UPLOAD: client {msg.sender}'s floor {msg.floor} is not in [2, n]")
        lay = self.cfg.layout
        try:
            key = KeySet.from_bytes(msg.key, party=self.party, depth=lay.depth, points=lay.buckets,
                                    width=self.cfg.width, check=self.cfg.check)
        except DpfError as exc:
            raise MessageError(f"stage UPLOAD: client {msg.sender}: {exc}") from None
        self.keys[msg.sender] = key
        self.floors[msg.sender] = msg.floor
        return msg.sender

    def received(self) -> bytes:
        """Close the uploads; the ids received, for the other server."""
        self.stage = Stage.IDS
        return DpfIds(self.cfg.instance, self.cfg.round, self.me, self.peer, ids=tuple(sorted(self.keys))).to_bytes()

    def agree(self, blob: bytes) -> list[int]:
        """The other server's ids: the survivors are the clients both received."""
        if self.stage != Stage.IDS:
            raise MessageError(f"stage {self.stage.name}: not expecting the other server's ids")
        msg = decode(blob)
        if not isinstance(msg, DpfIds):
            raise MessageError(f"stage IDS: unexpected {type(msg).__name__}")
        self._check_head(msg, Stage.IDS, True)
        self.survivors = sorted(set(self.keys) & set(msg.ids))
        self.stage = Stage.CHALLENGE
        return self.survivors

    def draw_challenge(self) -> bytes:
        """A only: draw the check's key (OS CSPRNG) after the uploads closed; the message for B."""
        if self.party != 0 or self.stage != Stage.CHALLENGE:
            raise MessageError("only server A draws the challenge, once, after agreeing on the survivors")
        self.challenge = os.urandom(16) if self.cfg.check else bytes(16)
        self.stage = Stage.DIGESTS
        return DpfChallenge(self.cfg.instance, self.cfg.round, self.me, self.peer, challenge=self.challenge).to_bytes()

    def take_challenge(self, blob: bytes) -> None:
        """B only: the challenge A drew."""
        if self.party != 1 or self.stage != Stage.CHALLENGE:
            raise MessageError("only server B takes the challenge, once, after agreeing on the survivors")
        msg = decode(blob)
        if not isinstance(msg, DpfChallenge):
            raise MessageError(f"stage CHALLENGE: unexpected {type(msg).__name__}")
        self._check_head(msg, Stage.CHALLENGE, True)
        self.challenge = msg.challenge
        self.stage = Stage.DIGESTS

    def evaluate(self) -> bytes:
        """Sum every survivor's full-domain evaluation; the digests for the other server."""
        if self.stage != Stage.DIGESTS or self.survivors is None or self.acc is not None:
            raise MessageError(f"stage {self.stage.name}: evaluate needs the survivors and the challenge, once")
        self.acc = Accumulator(self.cfg.forest, self.cfg.width, self.party,
                               challenge=self.challenge if self.cfg.check else None)
        for cid in self.survivors:
            d = self.acc.add(self.keys[cid])
            if d is not None:
                self.digests[cid] = d
        return DpfDigests(self.cfg.instance, self.cfg.round, self.me, self.peer,
                          digests=tuple(sorted(self.digests.items()))).to_bytes()

    def reconcile(self, blob: bytes) -> list[int]:
        """Compare digests; remove every survivor whose digests differ (or are missing). Returns the
        clients removed."""
        if self.stage != Stage.DIGESTS or self.acc is None:
            raise MessageError(f"stage {self.stage.name}: reconcile needs this server's own evaluation first")
        msg = decode(blob)
        if not isinstance(msg, DpfDigests):
            raise MessageError(f"stage DIGESTS: unexpected {type(msg).__name__}")
        self._check_head(msg, Stage.DIGESTS, True)
        theirs = dict(msg.digests)
        bad = [] if not self.cfg.check else [
            c for c in self.survivors or [] if not hmac.compare_digest(self.digests[c], theirs.get(c, b""))]
        for c in bad:
            self.acc.add(self.keys[c], sign=-1)
        self.survivors = [c for c in self.survivors or [] if c not in set(bad)]
        self.stage = Stage.SHARE
        return bad

    def _release_ok(self) -> None:
        s = self.survivors or []
        floor = max([self.floors[c] for c in s], default=2)
        if len(s) < floor:
            raise AbortError(f"stage SHARE: {len(s)} verified survivors, below the clients' floor {floor}; "
                             "no share released")

    def share(self) -> bytes:
        """B only: its share over the verified survivors (once; refused below the clients' floor)."""
        if self.party != 1 or self.stage != Stage.SHARE or self.shared:
            raise MessageError("only server B sends its share, once per instance and round, after the check")
        self._release_ok()
        self.shared = True
        assert self.acc is not None
        share = self.acc.scatter(self.cfg.layout.elements, self.cfg.layout.domain)  # public map: N rows, not 3N
        return DpfShare(self.cfg.instance, self.cfg.round, self.me, self.peer, survivors=tuple(self.survivors or ()),
                        share=share.reshape(-1)).to_bytes()

    def combine(self, blob: bytes) -> np.ndarray:
        """A only: its share plus B's: the sum over the survivors, ``uint64 [N, d]``."""
        if self.party != 0 or self.stage != Stage.SHARE or self.shared:
            raise MessageError("only server A combines, once, after the check")
        msg = decode(blob)
        if not isinstance(msg, DpfShare):
            raise MessageError(f"stage SHARE: unexpected {type(msg).__name__}")
        self._check_head(msg, Stage.SHARE, True)
        if list(msg.survivors) != list(self.survivors or []):
            raise AbortError("stage SHARE: the servers' survivor sets differ; no sum")
        self._release_ok()
        assert self.acc is not None
        rows = self.cfg.layout.domain
        if msg.share.shape != (rows * self.cfg.width,):
            raise MessageError(f"stage SHARE: a share of {msg.share.size} words; expected {rows * self.cfg.width}")
        self.shared = True
        total = self.acc.scatter(self.cfg.layout.elements, self.cfg.layout.domain)
        total += msg.share.reshape(rows, self.cfg.width)
        return total


# -- in-process runner -------------------------------------------------------------------------------

@dataclass(frozen=True)
class DpfSpec:
    """What :func:`run_dpf` simulates.

    Attributes:
        rows, width: the table shape ``N x d`` (inputs are ``uint64 [n, N * d]``).
        points: ``P``, rows a client may declare (more nonzero rows: that client is refused).
        round: the round number.
        min_survivors: every client's floor.
        dropouts: ``"A"`` / ``"B"`` / ``"upload"`` -> client indices whose upload to that server
            (both, for ``"upload"``) is lost.
        seed: the layout's public seed (``None``: zeros).
        check: verify the keys.
        failure_bits: the cuckoo failure target (buckets from :func:`secagg.cuckoo.buckets_for`).
        tamper: ``client -> (key_A, key_B) -> (key_A, key_B)`` replacing a client's keys (tests of
            malicious clients), applied to the parsed key sets before encoding.
    """

    rows: int
    width: int
    points: int
    round: int = 0
    min_survivors: int = 2
    dropouts: Mapping[str, frozenset[int]] = field(default_factory=dict)
    seed: bytes | None = None
    check: bool = True
    failure_bits: int = 40
    tamper: Mapping[int, object] = field(default_factory=dict)


@dataclass(frozen=True)
class DpfSumResult:
    """Outcome and costs of one simulated two-server sum.

    Attributes:
        total: ``uint64 [N * d]`` sum over ``survivors`` (``None`` after an abort, reason in ``abort``).
        survivors: clients in the sum; refused: ``client -> reason`` (bad rows, placement failure,
            failed check).
        client_s: seconds per client (placement and key generation).
        server_s: seconds at A and at B (everything after the uploads, including the check).
        bytes_up: ``[n, 2]`` bytes each client sent to A and to B.
        records: ``(sender, receiver, stage, blob)`` for every message, in order; parties ``"A"``,
            ``"B"`` or a client index.
    """

    total: np.ndarray | None
    survivors: frozenset[int]
    refused: dict[int, str]
    abort: str | None
    client_s: np.ndarray
    server_s: tuple[float, float]
    bytes_up: np.ndarray
    records: list[tuple[object, object, str, bytes]]
    buckets: int = 0


def _split_rows(x: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    table = x.reshape(-1, width)
    rows = np.flatnonzero(table.any(axis=1))
    return rows, table[rows]


def run_dpf(inputs: np.ndarray, spec: DpfSpec) -> DpfSumResult:
    """Simulate one two-server sum over ``inputs`` (``uint64 [n, N * d]``, client ``i`` in row ``i``).

    A client whose update has more than ``points`` nonzero rows, or whose rows cannot be placed, is
    refused (listed in ``refused``) and sends nothing. Every message crosses as wire bytes.
    """
    x = np.asarray(inputs)
    if x.dtype != np.uint64 or x.ndim != 2 or x.shape[1] != spec.rows * spec.width:
        raise ValueError(f"inputs must be uint64 [n, {spec.rows} x {spec.width}]; found {x.dtype} {x.shape}")
    n = x.shape[0]
    layout = CuckooLayout.for_points(spec.rows, spec.points, seed=spec.seed or bytes(32),
                                     failure_bits=spec.failure_bits)
    cfg = DpfSumConfig(n, layout, spec.width, spec.points, os.urandom(INSTANCE_BYTES), spec.round, spec.check)
    servers = (DpfSumServer(cfg, 0), DpfSumServer(cfg, 1))
    records: list[tuple[object, object, str, bytes]] = []
    refused: dict[int, str] = {}
    client_s = np.zeros(n)
    bytes_up = np.zeros((n, 2), np.int64)
    lost = {name: set(spec.dropouts.get(name, ())) for name in ("A", "B")}
    for name in spec.dropouts:
        if name not in ("A", "B", "upload"):
            raise ValueError(f"unknown dropout stage {name!r}; use 'A', 'B' or 'upload'")
    for i in spec.dropouts.get("upload", ()):
        lost["A"].add(i)
        lost["B"].add(i)
    for i in range(n):
        rows, vals = _split_rows(x[i], spec.width)
        t0 = time.perf_counter()
        try:
            blobs = DpfSumClient(cfg, i, floor=spec.min_survivors).upload(rows, vals)
        except (ValueError, CuckooError) as exc:
            refused[i] = str(exc)
            continue
        if i in spec.tamper:
            blobs = _tampered(cfg, blobs, spec.tamper[i])
        client_s[i] = time.perf_counter() - t0
        for b, name in enumerate(("A", "B")):
            if i in lost[name]:
                continue
            records.append((i, name, "upload", blobs[b]))
            bytes_up[i, b] = len(blobs[b])
            try:
                servers[b].receive(blobs[b])
            except MessageError as exc:
                refused[i] = f"server {name}: {exc}"
    timers = [0.0, 0.0]

    def timed(b: int, fn, *args):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = fn(*args)
        timers[b] += time.perf_counter() - t0
        return out

    ids = [timed(b, servers[b].received) for b in (0, 1)]
    records += [("A", "B", "ids", ids[0]), ("B", "A", "ids", ids[1])]
    timed(0, servers[0].agree, ids[1])
    timed(1, servers[1].agree, ids[0])
    chal = timed(0, servers[0].draw_challenge)
    records.append(("A", "B", "challenge", chal))
    timed(1, servers[1].take_challenge, chal)
    digests = [timed(b, servers[b].evaluate) for b in (0, 1)]
    records += [("A", "B", "digests", digests[0]), ("B", "A", "digests", digests[1])]
    for b in (0, 1):
        for c in timed(b, servers[b].reconcile, digests[1 - b]):
            refused[c] = "its key sets failed the check (not point functions, or different for A and B)"
    total, abort = None, None
    try:
        share = timed(1, servers[1].share)
        records.append(("B", "A", "share", share))
        total = timed(0, servers[0].combine, share).reshape(-1)
    except AbortError as exc:
        abort = str(exc)
    return DpfSumResult(total, frozenset(servers[0].survivors or ()), refused, abort, client_s,
                        (timers[0], timers[1]), bytes_up, records, layout.buckets)


def _tampered(cfg: DpfSumConfig, blobs: tuple[bytes, bytes], fn) -> tuple[bytes, bytes]:  # noqa: ANN001
    """Re-encode a client's uploads after ``fn`` replaced its parsed key sets (malicious-client tests)."""
    msgs = [DpfUpload.from_bytes(b) for b in blobs]
    keys = fn(*(KeySet.from_bytes(m.key) for m in msgs))
    return tuple(DpfUpload(m.instance, m.round, m.sender, m.receiver, floor=m.floor, key=k.to_bytes()).to_bytes()
                 for m, k in zip(msgs, keys))  # type: ignore[return-value]
