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
import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from secagg.cuckoo import CuckooLayout
from secagg.dpf import Accumulator, DpfError, Forest, KeySet, gen
from secagg.errors import AbortError, MessageError
from secagg.messages import INSTANCE_BYTES, SERVER, Message, Reader, Writer, decode, register
from secagg.prg import SEED_BYTES, expand, expand_into

__all__ = [
    "SERVER_A",
    "SERVER_B",
    "DpfChallenge",
    "DpfDense",
    "DpfDigests",
    "DpfIds",
    "DpfShare",
    "DpfSumClient",
    "DpfSumConfig",
    "DpfSumServer",
    "DpfUpload",
    "distinct_in",
]

SERVER_A = SERVER  #: party id of server A (the receiver) in message headers
SERVER_B = SERVER - 1  #: party id of server B
_DIGEST = 48
_MAX_CLIENTS = 2**24
_MAX_PARTS = 1 << 12  #: key sets one client may send in one sum (``DpfSumConfig.max_parts``)
_DENSE_LABEL = b"secagg/dpf/dense"  #: domain separation of the dense share's expansion
_DENSE_DIGEST = b"dense".ljust(_DIGEST, b"\0")  #: a dense client's digest (nothing to check: any vector is valid)


class Stage(enum.IntEnum):
    """Message stages (= kinds) of the two-server sum."""

    UPLOAD = 80
    IDS = 81
    CHALLENGE = 82
    DIGESTS = 83
    SHARE = 84
    DENSE = 85


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
        max_parts: the most key sets one client may send (each of at most ``points`` rows): a
            client with more rows splits them over ``ceil(rows / points)`` key sets, and **the
            servers see how many** (``pad_parts``: every client sends exactly ``max_parts``, so
            they see nothing). 1 (default): one key set per client.
        pad_parts: every client pads its upload to ``max_parts`` key sets (zero-valued ones), so
            the number of key sets says nothing about its rows; the servers refuse any other count.
        dense_above: a client whose rows need more than this many key sets sends a **dense
            two-server share** instead (:class:`DpfDense`: a 32-byte CSPRNG seed to B, its whole
            ``N x d`` update minus the seed's AES-CTR expansion to A), which costs each server one
            vector add or expansion instead of full-domain evaluations; each alone still sees
            nothing of the update (A a uniform vector, B a random seed), but both see that the
            client is dense (its size class, as the key-set count). 0 (default): never.
    """

    n: int
    layout: CuckooLayout
    width: int
    points: int
    instance: bytes
    round: int = 0
    check: bool = True
    max_parts: int = 1
    pad_parts: bool = False
    dense_above: int = 0
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
        if type(self.max_parts) is not int or not 1 <= self.max_parts <= _MAX_PARTS:
            raise ValueError(f"max_parts must be an int in [1, {_MAX_PARTS}]; found {self.max_parts!r}")
        if type(self.dense_above) is not int or self.dense_above < 0 or (self.dense_above and self.pad_parts):
            raise ValueError(f"dense_above must be an int >= 0, and 0 with pad_parts; found {self.dense_above!r}")
        object.__setattr__(self, "forest", Forest(self.layout.sizes, self.layout.depth))

    def key_bytes(self) -> int:
        """Bytes of one key set (the same for every client, point and value)."""
        return KeySet.size(depth=self.layout.depth, points=self.layout.buckets, width=self.width, check=self.check)


# -- messages ----------------------------------------------------------------------------------------

_UPLOAD_HEAD = struct.Struct(">IIII")  #: an upload's floor, part, parts and key length (the Writer's u32s)


@register
@dataclass(frozen=True)
class DpfUpload(Message):
    """Client -> one server: the client's survivor floor and key set ``part`` of its ``parts`` for
    that server (one message per key set; a client's sum counts only when every part arrived)."""

    KIND = int(Stage.UPLOAD)
    STAGE = int(Stage.UPLOAD)
    floor: int = 2
    key: bytes = b""
    part: int = 0
    parts: int = 1

    def _write_body(self, w: Writer) -> None:
        w.u32(self.floor).u32(self.part).u32(self.parts).u32(len(self.key)).raw(self.key)

    @classmethod
    def wire(cls, instance: bytes, round: int, sender: int, receiver: int, *, floor: int, key: KeySet, part: int,  # noqa: A002
             parts: int, public: list[bytes | memoryview] | None = None) -> bytes:
        """``DpfUpload(..., key=key.to_bytes()).to_bytes()``, the key's arrays copied once (into the message);
        ``public``: as :meth:`KeySet.to_parts`."""
        msg = cls(instance, round, sender, receiver, floor=floor, part=part, parts=parts)
        size = KeySet.size(depth=key.depth, points=key.points, width=key.width, check=key.check_cw is not None)
        return msg._joined([_UPLOAD_HEAD.pack(floor, part, parts, size), *key.to_parts(public)], _UPLOAD_HEAD.size + size)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> DpfUpload:
        floor, part, parts = r.u32(), r.u32(), r.u32()
        if not 1 <= parts <= _MAX_PARTS or part >= parts:
            raise MessageError(f"DpfUpload: part {part} of {parts} (at most {_MAX_PARTS} parts)")
        # the key stays a view of the message (no copy); KeySet.from_bytes parses it in place
        return cls(**head, floor=floor, key=r.view(r.u32()), part=part, parts=parts)


@register
@dataclass(frozen=True)
class DpfDense(Message):
    """Client -> one server: a dense two-server share of its whole update (``dense_above``): to A
    ``share`` (``N x d`` words, row-major) and no seed, to B the 32-byte ``seed`` and no share."""

    KIND = int(Stage.DENSE)
    STAGE = int(Stage.UPLOAD)
    floor: int = 2
    seed: bytes = b""
    share: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))

    def _write_body(self, w: Writer) -> None:
        w.u32(self.floor).u32(len(self.seed)).raw(self.seed).u64_vector(self.share)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> DpfDense:
        floor, n = r.u32(), r.u32()
        if n not in (0, SEED_BYTES):
            raise MessageError(f"DpfDense: a seed of {n} bytes (0 or {SEED_BYTES})")
        return cls(**head, floor=floor, seed=r.raw(n), share=r.u64_vector())


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
        if self.cfg.pad_parts and self.cfg.max_parts != 1:
            raise ValueError("pad_parts: send every key set with upload_parts")
        alpha, beta = self.cfg.layout.spread(rows, values)
        return self.encode([gen(alpha, self.cfg.layout.depth, beta, check=self.cfg.check)[:2]])[0]

    def upload_parts(self, rows: np.ndarray, values: np.ndarray) -> list[tuple[bytes, bytes]]:
        """The uploads (to A, to B) of every key set of an update with ``values[i]`` at row ``rows[i]``:
        ``ceil(len(rows) / points)`` key sets (at least one), or exactly ``max_parts`` with
        ``pad_parts``. One call per instance and round.

        Raises:
            ValueError: more rows than ``max_parts x points``, repeated or out-of-range rows, a bad value
                array (in words, naming the configuration to change).
            CuckooError: some part's rows admit no placement (the client sits out).
            MessageError: called twice.
        """
        plan = self.plan(rows, values)
        if plan is None:
            self.sent = True
            return [self._dense(rows, values)]
        return self.encode([gen(alpha, self.cfg.layout.depth, beta, check=self.cfg.check)[:2] for alpha, beta in plan])

    def plan(self, rows: np.ndarray, values: np.ndarray, *, words: Callable[[int], np.ndarray] | None = None
             ) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """:meth:`upload_parts` up to the key generation: the update checked and placed, per key set
        its points and values (:meth:`secagg.cuckoo.CuckooLayout.spread`, decoys from the OS CSPRNG, or
        from ``words`` as ``spread`` takes them); ``None``: the client sends a dense share
        (``dense_above``). Raises as :meth:`upload_parts`."""
        if self.sent:
            raise MessageError(f"client {self.id}: already uploaded in round {self.cfg.round}")
        c = self.cfg
        rows = np.asarray(rows, dtype=np.int64)
        values = np.asarray(values)
        cap = c.max_parts * c.points
        if rows.ndim != 1 or rows.size > cap:
            raise ValueError(f"client {self.id}: {rows.size} rows, above the declared max_parts x points = "
                             f"{c.max_parts} x {c.points}; raise one of them")
        if values.dtype != np.uint64 or values.shape != (rows.size, c.width):
            raise ValueError(f"values must be uint64 [{rows.size}, {c.width}]; found {values.dtype} {values.shape}")
        if not distinct_in(rows, c.layout.domain):
            raise ValueError(f"client {self.id}: rows must be distinct and in [0, {c.layout.domain})")
        count = c.max_parts if c.pad_parts else max(1, -(-rows.size // c.points))
        if c.dense_above and count > c.dense_above:
            return None
        return [c.layout.spread(rows[i * c.points:(i + 1) * c.points], values[i * c.points:(i + 1) * c.points],
                                checked=True, words=words) for i in range(count)]  # rows checked above: distinct, in the domain

    def encode(self, keys: list[tuple[KeySet, KeySet]]) -> list[tuple[bytes, bytes]]:
        """The uploads (to A, to B) of the key sets (A's, B's) generated for :meth:`plan`'s parts."""
        if self.sent:
            raise MessageError(f"client {self.id}: already uploaded in round {self.cfg.round}")
        c = self.cfg
        out = []
        for part, (k0, k1) in enumerate(keys):
            public = k0._public_parts() if k0.shares_public(k1) else None  # one encoding of the common corrections
            out.append(tuple(DpfUpload.wire(c.instance, c.round, self.id, to, floor=self.floor, key=k, part=part,
                                            parts=len(keys), public=public)
                             for to, k in ((SERVER_A, k0), (SERVER_B, k1))))
        self.sent = True
        return out  # type: ignore[return-value]

    def _dense(self, rows: np.ndarray, values: np.ndarray) -> tuple[bytes, bytes]:
        """The dense two-server share: ``x - PRG(seed)`` to A, ``seed`` (OS CSPRNG) to B."""
        c = self.cfg
        seed = os.urandom(SEED_BYTES)
        share = expand(seed, c.layout.domain * c.width, label=_DENSE_LABEL)
        np.subtract(np.uint64(0), share, out=share)  # -PRG(seed), in place
        table = share.reshape(c.layout.domain, c.width)
        table[np.asarray(rows, dtype=np.int64)] += values
        return (DpfDense(c.instance, c.round, self.id, SERVER_A, floor=self.floor, share=share).to_bytes(),
                DpfDense(c.instance, c.round, self.id, SERVER_B, floor=self.floor, seed=seed).to_bytes())


def distinct_in(rows: np.ndarray, domain: int) -> bool:
    """Whether ``rows`` (integers, 1-D) are distinct and in ``[0, domain)`` (``True`` for none): one
    comparison pass when they are increasing (as a protocol's rows usually are), a sort otherwise."""
    if rows.size == 0:
        return True
    ordered = rows if bool((rows[1:] > rows[:-1]).all()) else np.unique(rows)
    return ordered.size == rows.size and int(ordered[0]) >= 0 and int(ordered[-1]) < domain


class DpfSumServer:
    """Server A (``party = 0``, the receiver) or B (``party = 1``); see the module docstring."""

    def __init__(self, cfg: DpfSumConfig, party: int) -> None:
        if party not in (0, 1):
            raise ValueError(f"party must be 0 or 1; found {party!r}")
        self.cfg, self.party = cfg, party
        self.me, self.peer = (SERVER_A, SERVER_B) if party == 0 else (SERVER_B, SERVER_A)
        self.parts: dict[int, dict[int, KeySet]] = {}  # client -> part -> key set
        self.declared: dict[int, int] = {}  # client -> the number of parts it declared
        self.floors: dict[int, int] = {}
        self.dense: dict[int, DpfDense] = {}  # client -> its dense share (dense_above)
        self.survivors: list[int] | None = None
        self.challenge: bytes | None = None
        self.digests: dict[int, bytes] = {}
        self.acc: Accumulator | None = None
        self._sum: Accumulator | None = None  # allocated (and its pages touched) once the challenge is known
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
        if isinstance(msg, DpfDense):
            return self._receive_dense(msg)
        if not isinstance(msg, DpfUpload):
            raise MessageError(f"stage UPLOAD: unexpected {type(msg).__name__}")
        self._check_head(msg, Stage.UPLOAD, False)
        if not 0 <= msg.sender < self.cfg.n:
            raise MessageError(f"stage UPLOAD: bad sender {msg.sender}")
        if msg.sender in self.dense:
            raise MessageError(f"stage UPLOAD: client {msg.sender} already sent a dense share")
        if msg.part in self.parts.get(msg.sender, {}):
            raise MessageError(f"stage UPLOAD: replayed upload from client {msg.sender} (already received)")
        if not 2 <= msg.floor <= self.cfg.n:
            raise MessageError(f"stage UPLOAD: client {msg.sender}'s floor {msg.floor} is not in [2, n]")
        c = self.cfg
        if msg.parts > c.max_parts or (c.pad_parts and msg.parts != c.max_parts):
            raise MessageError(f"stage UPLOAD: client {msg.sender} declares {msg.parts} key sets; "
                               f"{'exactly' if c.pad_parts else 'at most'} {c.max_parts} allowed")
        if msg.sender in self.declared and (self.declared[msg.sender], self.floors[msg.sender]) != (msg.parts, msg.floor):
            raise MessageError(f"stage UPLOAD: client {msg.sender}'s parts disagree on their count or floor")
        lay = self.cfg.layout
        try:
            key = KeySet.from_bytes(msg.key, party=self.party, depth=lay.depth, points=lay.buckets,
                                    width=self.cfg.width, check=self.cfg.check)
        except DpfError as exc:
            raise MessageError(f"stage UPLOAD: client {msg.sender}: {exc}") from None
        self.parts.setdefault(msg.sender, {})[msg.part] = key
        self.declared[msg.sender] = msg.parts
        self.floors[msg.sender] = msg.floor
        return msg.sender

    def _receive_dense(self, msg: DpfDense) -> int:
        c = self.cfg
        self._check_head(msg, Stage.UPLOAD, False)
        if not c.dense_above:
            raise MessageError("stage UPLOAD: a dense share, but this sum takes key sets only (dense_above = 0)")
        if not 0 <= msg.sender < c.n:
            raise MessageError(f"stage UPLOAD: bad sender {msg.sender}")
        if msg.sender in self.dense or msg.sender in self.parts:
            raise MessageError(f"stage UPLOAD: replayed upload from client {msg.sender} (already received)")
        if not 2 <= msg.floor <= c.n:
            raise MessageError(f"stage UPLOAD: client {msg.sender}'s floor {msg.floor} is not in [2, n]")
        want = (0, c.layout.domain * c.width) if self.party == 0 else (SEED_BYTES, 0)
        if (len(msg.seed), msg.share.size) != want:
            raise MessageError(f"stage UPLOAD: client {msg.sender}'s dense share has a {len(msg.seed)}-byte seed and "
                               f"{msg.share.size} words; server {'AB'[self.party]} expects {want[0]} and {want[1]}")
        self.dense[msg.sender] = msg
        self.floors[msg.sender] = msg.floor
        return msg.sender

    def _dense_sum(self, clients: list[int]) -> np.ndarray | None:
        """This server's share of the dense clients' sum, ``uint64 [N, d]`` (A: their vectors; B: the seeds'
        expansions); ``None`` when none of ``clients`` sent a dense share."""
        c = self.cfg
        if not any(cid in self.dense for cid in clients):
            return None
        out = np.zeros(c.layout.domain * c.width, np.uint64)
        for cid in clients:
            if cid in self.dense:
                msg = self.dense[cid]
                if self.party == 0:
                    out += msg.share
                else:  # streamed into the sum, no vector-sized temporary
                    expand_into(msg.seed, out, label=_DENSE_LABEL, add=True)
        return out.reshape(c.layout.domain, c.width)

    @property
    def keys(self) -> dict[int, KeySet]:
        """Client -> its first key set, for every client whose every part arrived."""
        return {c: p[0] for c, p in self.parts.items() if len(p) == self.declared[c]}

    def _complete(self) -> list[int]:
        return sorted([c for c, p in self.parts.items() if len(p) == self.declared[c]] + list(self.dense))

    def received(self) -> bytes:
        """Close the uploads; the ids received (every part), for the other server."""
        self.stage = Stage.IDS
        return DpfIds(self.cfg.instance, self.cfg.round, self.me, self.peer, ids=tuple(self._complete())).to_bytes()

    def agree(self, blob: bytes) -> list[int]:
        """The other server's ids: the survivors are the clients both received."""
        if self.stage != Stage.IDS:
            raise MessageError(f"stage {self.stage.name}: not expecting the other server's ids")
        msg = decode(blob)
        if not isinstance(msg, DpfIds):
            raise MessageError(f"stage IDS: unexpected {type(msg).__name__}")
        self._check_head(msg, Stage.IDS, True)
        self.survivors = sorted(set(self._complete()) & set(msg.ids))
        self.stage = Stage.CHALLENGE
        return self.survivors

    def draw_challenge(self) -> bytes:
        """A only: draw the check's key (OS CSPRNG) after the uploads closed; the message for B."""
        if self.party != 0 or self.stage != Stage.CHALLENGE:
            raise MessageError("only server A draws the challenge, once, after agreeing on the survivors")
        self.challenge = os.urandom(16) if self.cfg.check else bytes(16)
        self.stage = Stage.DIGESTS
        self._prepare()
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
        self._prepare()

    def _prepare(self) -> None:
        """Allocate the round's sum (``3N x d`` words, every page touched: once per round, not per client)."""
        self._sum = Accumulator(self.cfg.forest, self.cfg.width, self.party,
                                challenge=self.challenge if self.cfg.check else None)

    def evaluate(self) -> bytes:
        """Sum every survivor's full-domain evaluation; the digests for the other server."""
        if self.stage != Stage.DIGESTS or self.survivors is None or self.acc is not None:
            raise MessageError(f"stage {self.stage.name}: evaluate needs the survivors and the challenge, once")
        if self._sum is None:
            self._prepare()
        self.acc, self._sum = self._sum, None
        order = [(cid, p) for cid in self.survivors if cid not in self.dense for p in range(self.declared[cid])]
        digests = dict(zip(order, self.acc.add_many([self.parts[cid][p] for cid, p in order])))  # 8 at a time
        for cid in self.survivors:
            if cid in self.dense:  # nothing to verify: any vector is a valid dense update
                self.digests[cid] = _DENSE_DIGEST
                continue
            got = [digests[cid, p] for p in range(self.declared[cid])]
            if got[0] is None:
                continue
            if len(got) == 1:  # one key set: its digest as it is
                self.digests[cid] = got[0]
                continue
            # one digest per client: the MACs XOR-ed, the public parts hashed together
            mac = np.bitwise_xor.reduce(np.stack([np.frombuffer(g[:16], np.uint8) for g in got]), axis=0)
            self.digests[cid] = mac.tobytes() + hashlib.sha256(b"".join(g[16:] for g in got)).digest()
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
        self.acc.add_many([self.parts[c][p] for c in bad for p in range(self.declared.get(c, 0))], sign=-1)
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
        dense = self._dense_sum(self.survivors or [])
        if dense is not None:
            share += dense
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
        dense = self._dense_sum(self.survivors or [])
        if dense is not None:
            total += dense
        total += msg.share.reshape(rows, self.cfg.width)
        return total
