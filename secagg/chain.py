"""The circular share chain (STTFedRec, section 3.3, generalised to ``s`` successors).

Parties:
    ``n`` clients, each holding a ``uint64`` vector of length ``dim`` (a fixed-point encoding,
    see :mod:`secagg.encoding`), and one aggregation server that relays every message (clients
    never talk to each other directly).

Adversary:
    an honest-but-curious server that follows the protocol (including its deadlines: a message
    that arrives after its stage closed is rejected unread) and records everything it receives,
    optionally colluding with some clients; a network or server that tampers with, replays,
    truncates or reorders messages is detected (typed errors) but may force a client out of the
    round (no robustness against denial of service).

Promise:
    the server learns only ``sum(x_u for u in survivors)`` mod 2^64, where ``survivors`` is the
    set of clients that completed the final attempt, with at least ``min_survivors`` of them.
    Every upload the server sees is uniform on Z_(2^64)^dim subject to that sum (computationally:
    masks are AES-256-CTR expansions of 32-byte seeds from the OS CSPRNG). Every attempt that
    failed (see *Dropouts*) leaks nothing: its uploads are jointly uniform and never unmasked.

Limits (each demonstrated by a test in ``tests/secagg/test_chain*.py``):
    * the server together with the ``s`` ring predecessors and the ``s`` ring successors of a
      client recovers that client's input (with ``s = 1``: the server plus both ring
      neighbours, as in the paper). More generally a coalition of the server and a set ``C`` of
      clients learns the sum of the inputs of every connected component of the ring graph
      (edges ``u -> u+1 .. u+s``) with ``C`` removed; with fewer than ``2s`` colluders no honest
      client is isolated;
    * with ``n = 2`` survivors each client can subtract its own input from the published sum;
      this is inherent to any sum and is why ``min_survivors`` defaults to 2, not 1;
    * the server picks the ring (CSPRNG) and hands out the neighbours' public keys: a
      *malicious* server could place colluders next to a victim or run a man-in-the-middle on the
      keys. The design is honest-but-curious only, like the paper's;
    * an attempt abandoned because of a dropout must stay abandoned: a server that kept a
      dropped client's late upload of attempt ``a`` and then completed attempt ``a + 1`` would
      hold two sums over different client sets; their difference is the late clients' inputs
      (a test shows it). The server state machine rejects late uploads for that reason, and it
      aborts (rather than re-runs) when a ring member's upload of the current attempt arrived
      but was refused (tampered or malformed) with no valid one following, since those bytes
      may carry the member's masked vector.

Protocol, one round (instance and round are bound into every message and ciphertext):
    1. ``ADVERTISE``: each client sends a fresh X25519 public key.
    2. the server draws a uniformly random ring over the advertisers (``secrets.SystemRandom``)
       and sends each client only its ``s`` successors' and ``s`` predecessors' ids and public
       keys (``s`` is capped at ``m - 1`` for a ring of ``m`` clients), so per-client cost is
       ``O(s * dim)``, independent of ``n``.
    3. ``SHARE``: client ``u`` draws one 32-byte seed per successor ``v`` and sends it, sealed
       with AES-256-GCM under ``HKDF(X25519(u, v))`` and associated data binding instance,
       round, attempt, sender and receiver, through the server. A seed stands for the share
       vector ``PRG(seed)`` (sending a seed instead of the ``dim``-long share is sound because the
       share only has to be pseudo-random, and saves ``8 * dim - 60`` bytes per share).
    4. the server delivers to each client the ``s`` sealed seeds of its predecessors.
    5. ``UPLOAD``: client ``u`` uploads
       ``y_u = x_u - sum_{v succ} PRG(seed_{u->v}) + sum_{w pred} PRG(seed_{w->u})``.
       Every seed enters once with ``+`` and once with ``-``, so ``sum_u y_u = sum_u x_u``.

Dropouts (a client may vanish before advertising, after the ring is sent, after sending its
seeds, after receiving its seeds, or before uploading; a client whose sealed seed fails to open
leaves the attempt the same way): dropping before step 1 only removes the client from the ring.
If a ring member's seeds or upload are missing when a stage closes, the attempt is abandoned and
the server starts attempt ``a + 1`` with a fresh random ring over the clients that did complete
that stage (the "re-run among survivors" recovery). Nothing is ever revealed to repair an
attempt: an abandoned attempt's uploads are masked by at least one edge whose seed only a
dropped client and one neighbour know, so they are jointly uniform (the rows of a connected
graph's incidence matrix, minus at least one vertex, are linearly independent). The price is one
extra SHARE + UPLOAD exchange per attempt; after ``max_attempts`` attempts, or when fewer than
``min_survivors`` clients remain, the round aborts (:class:`~secagg.errors.AbortError`) and no
sum is produced. Pairwise keys are reused across attempts of a round (the associated data binds
the attempt); seeds never are.

Messages are constant-size for a given ``(s, dim)``, carry a fixed header
``magic | kind | instance | round | attempt | sender | receiver`` and are validated (kind,
instance, round, attempt, stage, sender, duplicates, exact length) before they touch any
state; a rejected message raises :class:`~secagg.errors.MessageError` and leaves the receiver's
state unchanged.
"""

from __future__ import annotations

import enum
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from secagg.channel import OVERHEAD, associated_data, open_sealed, seal
from secagg.errors import AbortError, AuthenticationError, MessageError
from secagg.keys import KEY_BYTES, KeyPair, hkdf_sha256
from secagg.messages import _HEADER as _WIRE_HEADER
from secagg.messages import HEADER_BYTES, SERVER, Message, Reader, Writer, decode, register
from secagg.prg import SEED_BYTES, accumulate

__all__ = [
    "ChainAdvert",
    "ChainBundle",
    "ChainClient",
    "ChainConfig",
    "ChainDelivery",
    "ChainRing",
    "ChainServer",
    "ChainUpload",
    "ClientStage",
    "Kind",
    "ServerStage",
    "ServerStep",
    "effective_successors",
    "message_size",
]

_CT_BYTES = SEED_BYTES + OVERHEAD  # one sealed seed: nonce || seed || tag
_MAX_ENTRIES = 2**15
_KA_INFO = b"secagg/chain/v1/ka"
_MASK_LABEL = b"chain/mask"


class Kind(enum.IntEnum):
    """Message kinds of the chain (codes 48-79 are the chain's in :mod:`secagg.messages`)."""

    ADVERT = 48  #: client -> server: fresh X25519 public key
    RING = 49  #: server -> client: ring size, successors and predecessors with their public keys
    BUNDLE = 50  #: client -> server: one sealed seed per successor
    DELIVERY = 51  #: server -> client: one sealed seed per predecessor
    UPLOAD = 52  #: client -> server: the masked vector


class ClientStage(enum.Enum):
    """Client states; :data:`CLIENT_ACCEPTS` lists which message each state accepts."""

    NEW = "new"
    ADVERTISED = "advertised"
    SHARED = "shared"
    UPLOADED = "uploaded"
    FAILED = "failed"


class ServerStage(enum.Enum):
    """Server states: collect adverts, then per attempt collect bundles and uploads."""

    ADVERTISE = "advertise"
    SHARE = "share"
    UPLOAD = "upload"
    DONE = "done"
    ABORTED = "aborted"


#: Which incoming message kind a client accepts in each state (anything else is refused).
CLIENT_ACCEPTS: dict[ClientStage, frozenset[Kind]] = {
    ClientStage.NEW: frozenset(),
    ClientStage.ADVERTISED: frozenset({Kind.RING}),
    ClientStage.SHARED: frozenset({Kind.RING, Kind.DELIVERY}),  # RING: the attempt was restarted
    ClientStage.UPLOADED: frozenset({Kind.RING}),  # RING: re-run among survivors
    ClientStage.FAILED: frozenset(),
}

#: Which client message kind the server accepts in each state.
SERVER_ACCEPTS: dict[ServerStage, frozenset[Kind]] = {
    ServerStage.ADVERTISE: frozenset({Kind.ADVERT}),
    ServerStage.SHARE: frozenset({Kind.BUNDLE}),
    ServerStage.UPLOAD: frozenset({Kind.UPLOAD}),
    ServerStage.DONE: frozenset(),
    ServerStage.ABORTED: frozenset(),
}


@dataclass(frozen=True)
class ChainConfig:
    """Public parameters of one round of the chain.

    Attributes:
        instance: 16-byte protocol-instance id (bound into every message and ciphertext).
        round: round number, an int in ``[0, 2^32)``.
        dim: vector length (``uint64`` ring elements per client), ``>= 1``.
        successors: ``s``, the number of successors each client shares with (the collusion
            threshold: the server needs all ``2s`` ring neighbours of a client); capped at
            ``m - 1`` for a ring of ``m`` clients.
        min_survivors: the round aborts rather than publish a sum over fewer clients (``>= 2``).
        max_attempts: the round aborts after this many abandoned attempts (``>= 1``).
    """

    instance: bytes
    round: int
    dim: int
    successors: int = 1
    min_survivors: int = 2
    max_attempts: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.instance, bytes) or len(self.instance) != 16:
            raise ValueError(
                f"instance must be 16 bytes (e.g. os.urandom(16)); found {self.instance!r}."
            )
        checks = (
            ("round", self.round, 0, 2**32 - 1),
            ("dim", self.dim, 1, 2**31),
            ("successors", self.successors, 1, _MAX_ENTRIES),
            ("min_survivors", self.min_survivors, 2, 2**32 - 2),
            ("max_attempts", self.max_attempts, 1, 2**16),
        )
        for name, value, low, high in checks:
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}]; found {value!r}.")


def effective_successors(successors: int, ring_size: int) -> int:
    """``s`` capped at ``ring_size - 1`` (a client never shares with itself)."""
    return max(1, min(int(successors), int(ring_size) - 1))


# --------------------------------------------------------------------------- wire format


def _write_entries(w: Writer, entries: Sequence[tuple[int, bytes]], width: int) -> None:
    w.u32(len(entries))
    for pid, blob in entries:
        if len(blob) != width:
            raise ValueError(f"entry for {pid} is {len(blob)} bytes; expected {width}.")
        w.u32(pid).raw(blob)


def _read_entries(r: Reader, width: int) -> tuple[tuple[int, bytes], ...]:
    count = r.u32()
    if count > _MAX_ENTRIES:
        raise MessageError(f"chain message: {count} entries exceed the limit {_MAX_ENTRIES}.")
    return tuple((r.u32(), r.raw(width)) for _ in range(count))


@register
@dataclass(frozen=True)
class ChainAdvert(Message):
    """Client -> server: a fresh X25519 public key (stage ADVERTISE)."""

    KIND: ClassVar[int] = int(Kind.ADVERT)
    STAGE: ClassVar[int] = int(Kind.ADVERT)
    public_key: bytes = b""

    def _write_body(self, w: Writer) -> None:
        w.raw(self.public_key)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ChainAdvert:
        return cls(**head, public_key=r.raw(KEY_BYTES))


@register
@dataclass(frozen=True)
class ChainRing(Message):
    """Server -> client: the client's place in attempt ``attempt``'s ring."""

    KIND: ClassVar[int] = int(Kind.RING)
    STAGE: ClassVar[int] = int(Kind.RING)
    attempt: int = 0
    ring_size: int = 0
    server_key: bytes = bytes(KEY_BYTES)
    successors: tuple[tuple[int, bytes], ...] = ()
    predecessors: tuple[tuple[int, bytes], ...] = ()

    def _write_body(self, w: Writer) -> None:
        if len(self.server_key) != KEY_BYTES:
            raise ValueError(f"server_key must be {KEY_BYTES} bytes; found {len(self.server_key)}.")
        w.u32(self.attempt).u32(self.ring_size).raw(self.server_key)
        _write_entries(w, self.successors, KEY_BYTES)
        _write_entries(w, self.predecessors, KEY_BYTES)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ChainRing:
        attempt, ring_size, server_key = r.u32(), r.u32(), r.raw(KEY_BYTES)
        return cls(**head, attempt=attempt, ring_size=ring_size, server_key=server_key,
                   successors=_read_entries(r, KEY_BYTES), predecessors=_read_entries(r, KEY_BYTES))


@register
@dataclass(frozen=True)
class ChainBundle(Message):
    """Client -> server: one sealed seed per successor, ``(receiver, blob)``."""

    KIND: ClassVar[int] = int(Kind.BUNDLE)
    STAGE: ClassVar[int] = int(Kind.BUNDLE)
    attempt: int = 0
    seeds: tuple[tuple[int, bytes], ...] = ()

    def _write_body(self, w: Writer) -> None:
        w.u32(self.attempt)
        _write_entries(w, self.seeds, _CT_BYTES)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ChainBundle:
        attempt = r.u32()
        return cls(**head, attempt=attempt, seeds=_read_entries(r, _CT_BYTES))


@register
@dataclass(frozen=True)
class ChainDelivery(Message):
    """Server -> client: one sealed seed per predecessor, ``(sender, blob)``."""

    KIND: ClassVar[int] = int(Kind.DELIVERY)
    STAGE: ClassVar[int] = int(Kind.DELIVERY)
    attempt: int = 0
    seeds: tuple[tuple[int, bytes], ...] = ()

    def _write_body(self, w: Writer) -> None:
        w.u32(self.attempt)
        _write_entries(w, self.seeds, _CT_BYTES)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ChainDelivery:
        attempt = r.u32()
        return cls(**head, attempt=attempt, seeds=_read_entries(r, _CT_BYTES))


@register
@dataclass(frozen=True, eq=False)
class ChainUpload(Message):
    """Client -> server: the masked vector ``y_u`` (little-endian ``uint64``) and its tag.

    ``tag`` is an AES-GCM tag (``nonce || tag``, 28 bytes, empty plaintext) over the header
    fields and the vector under ``HKDF(X25519(client, server))``: a tampered or misattributed
    upload is refused instead of silently corrupting the sum.
    """

    KIND: ClassVar[int] = int(Kind.UPLOAD)
    STAGE: ClassVar[int] = int(Kind.UPLOAD)
    attempt: int = 0
    vector: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    tag: bytes = bytes(OVERHEAD)

    def _write_body(self, w: Writer) -> None:
        if len(self.tag) != OVERHEAD:
            raise ValueError(f"tag must be {OVERHEAD} bytes; found {len(self.tag)}.")
        w.u32(self.attempt).raw(self.tag).u64_vector(self.vector)

    def to_bytes(self) -> bytes:
        """Same bytes as :meth:`Message.to_bytes`, with one copy of the vector instead of three."""
        vec = np.ascontiguousarray(self.vector, dtype="<u8")
        if vec.ndim != 1:
            raise ValueError(f"vector must be 1-D; found shape {vec.shape}.")
        prefix = ChainUpload(self.instance, self.round, self.sender, self.receiver, attempt=self.attempt,
                             vector=vec[:0], tag=self.tag)._generic_bytes()
        head, body = prefix[:HEADER_BYTES], prefix[HEADER_BYTES:-4]
        length = len(body) + 4 + vec.nbytes
        head = head[:-4] + length.to_bytes(4, "big")
        return b"".join((head, body, vec.size.to_bytes(4, "big"), memoryview(vec).cast("B")))

    def _generic_bytes(self) -> bytes:
        """The generic serialisation (used for the header and short vectors)."""
        return Message.to_bytes(self)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ChainUpload:
        attempt, tag = r.u32(), r.raw(OVERHEAD)
        return cls(**head, attempt=attempt, tag=tag, vector=r.u64_vector())


_CLASSES: dict[Kind, type[Message]] = {
    Kind.ADVERT: ChainAdvert, Kind.RING: ChainRing, Kind.BUNDLE: ChainBundle,
    Kind.DELIVERY: ChainDelivery, Kind.UPLOAD: ChainUpload,
}


def message_size(kind: Kind, *, s: int = 1, dim: int = 1) -> int:
    """Exact wire size in bytes of a chain message of ``kind`` for ``s`` successors and ``dim``."""
    body = {
        Kind.ADVERT: KEY_BYTES,
        Kind.RING: 16 + KEY_BYTES + 2 * s * (4 + KEY_BYTES),
        Kind.BUNDLE: 8 + s * (4 + _CT_BYTES),
        Kind.DELIVERY: 8 + s * (4 + _CT_BYTES),
        Kind.UPLOAD: 8 + OVERHEAD + 8 * dim,
    }[Kind(kind)]
    return HEADER_BYTES + body


def _receive(data: bytes, kind: Kind, *, where: str, config: ChainConfig) -> Message:
    """Decode ``data`` strictly and check kind, instance and round (state unchanged on error)."""
    msg = decode(data)
    if not isinstance(msg, _CLASSES[kind]):
        raise MessageError(f"{where}: expected a {_CLASSES[kind].__name__}; found {type(msg).__name__}.")
    if msg.instance != config.instance:
        raise MessageError(
            f"{where}: message for protocol instance {msg.instance.hex()}, expected {config.instance.hex()}."
        )
    if msg.round != config.round:
        raise MessageError(f"{where}: wrong round {msg.round}, expected {config.round} (replayed or stale message).")
    return msg


def _seed_aad(config: ChainConfig, attempt: int, sender: int, receiver: int) -> bytes:
    return associated_data(
        instance=config.instance, round=config.round, sender=sender, receiver=receiver,
        kind=f"chain/seed/attempt={attempt}",
    )


def _upload_tag(key: bytes, config: ChainConfig, attempt: int, sender: int, vector: np.ndarray,
                tag: bytes | None = None) -> bytes:
    """Seal (``tag=None``) or verify the AES-GCM tag of an upload (empty plaintext).

    The header context (instance, round, attempt, sender) is bound through a one-upload key
    ``HKDF(key, info=context)``; the vector's bytes are the associated data, read in place
    (no copy of the ``8 * dim`` bytes).
    """
    context = associated_data(
        instance=config.instance, round=config.round, sender=sender, receiver=SERVER,
        kind=f"chain/upload/attempt={attempt}",
    )
    one_time = hkdf_sha256(key, info=context)
    data = memoryview(np.ascontiguousarray(vector, dtype="<u8")).cast("B")
    if tag is None:
        return seal(one_time, b"", aad=data)  # type: ignore[arg-type]
    open_sealed(one_time, tag, aad=data)  # type: ignore[arg-type]
    return tag


def _ka_info(config: ChainConfig, purpose: bytes) -> bytes:
    return _KA_INFO + purpose + config.instance + config.round.to_bytes(4, "big")


def _mask(
    x: np.ndarray, sent: Iterable[bytes], received: Iterable[bytes], *, out: np.ndarray | None = None
) -> np.ndarray:
    """Known-answer core of the upload: ``x - sum PRG(sent) + sum PRG(received)`` mod 2^64.

    Written into ``out`` (a uint64 array of ``x``'s shape) if given, else into a fresh array.
    """
    if out is None:
        y = np.array(x, dtype=np.uint64, copy=True)
    else:
        y = out
        np.copyto(y, x, casting="unsafe")
    # one cache-blocked pass over y for all 2s masks (same sum mod 2^64 as one pass per mask)
    masks = [(seed, _MASK_LABEL, True) for seed in sent]
    masks += [(seed, _MASK_LABEL, False) for seed in received]
    accumulate(y, masks)
    return y


_LOCAL = threading.local()


def _upload_scratch(dim: int) -> np.ndarray:
    """A per-thread reusable ``uint64`` buffer of ``dim`` words for the masked upload.

    :meth:`ChainClient.upload` serialises the masked vector at once (``to_bytes`` copies it into
    the message), so the buffer can be reused by the next upload instead of allocating and
    page-faulting in ``8 * dim`` fresh bytes per client.
    """
    buf = getattr(_LOCAL, "upload", None)
    if buf is None or buf.size < dim:
        buf = _LOCAL.upload = np.empty(dim, dtype=np.uint64)
    return buf[:dim]


# --------------------------------------------------------------------------- client


class ChainClient:
    """One client of the chain: one method per stage, each returning the message to send.

    Args:
        config: the round's public parameters.
        client_id: this client's id, an int in ``[0, 2^32 - 1)``.
        value: the client's input, a ``uint64`` array of shape ``(config.dim,)`` (encode reals
            with :class:`secagg.encoding.FixedPoint` first). It is referenced, not copied.
    """

    def __init__(self, config: ChainConfig, client_id: int, value: np.ndarray) -> None:
        if type(client_id) is not int or not 0 <= client_id < SERVER:
            raise ValueError(f"client_id must be an int in [0, 2^32 - 1); found {client_id!r}.")
        arr = np.asarray(value)
        if arr.dtype != np.uint64 or arr.shape != (config.dim,):
            raise ValueError(
                f"value must be a uint64 array of shape ({config.dim},); found {arr.dtype} {arr.shape}. "
                "Encode reals with secagg.encoding.FixedPoint first."
            )
        self.config = config
        self.client_id = client_id
        self._value = arr  # not copied (n * dim * 8 bytes in simulations): do not mutate it mid-round
        self.stage = ClientStage.NEW
        self._keys: KeyPair | None = None
        self._pair_keys: dict[bytes, bytes] = {}
        self._attempt = 0
        self._ring: ChainRing | None = None
        self._sent: dict[int, bytes] = {}
        self._seed_log: dict[tuple[int, int, int], bytes] = {}

    @property
    def attempt(self) -> int:
        """The attempt this client is currently in (0 before the first ring)."""
        return self._attempt

    # -- stages -------------------------------------------------------------------------

    def advertise(self) -> bytes:
        """Stage ADVERTISE: a fresh X25519 key pair (OS CSPRNG); returns the ADVERT message."""
        return self._advertise_with(KeyPair.generate())

    def _advertise_with(self, keys: KeyPair) -> bytes:
        """Known-answer core of :meth:`advertise` (explicit key pair)."""
        if self.stage is not ClientStage.NEW:
            raise MessageError(f"client {self.client_id}: advertise called in stage {self.stage.name}, expected NEW.")
        self._keys = keys
        self.stage = ClientStage.ADVERTISED
        return ChainAdvert(self.config.instance, self.config.round, self.client_id, SERVER,
                           public_key=keys.public_bytes).to_bytes()

    def share(self, ring_message: bytes) -> bytes:
        """Stage SHARE: read the RING assignment, seal one fresh seed per successor (CSPRNG).

        Returns:
            The BUNDLE message for the server.

        Raises:
            MessageError: malformed, stale (attempt not newer than the last one), wrong-stage or
                inconsistent assignment; the client's state is unchanged.
        """
        return self._share_with(ring_message, lambda: secrets.token_bytes(SEED_BYTES))

    def _share_with(self, ring_message: bytes, draw_seed: Callable[[], bytes]) -> bytes:
        """Known-answer core of :meth:`share` (explicit seed source)."""
        ring = self._check_ring(ring_message)
        seeds: list[tuple[int, bytes]] = []
        sent: dict[int, bytes] = {}
        for vid, vpk in ring.successors:
            seed = bytes(draw_seed())
            if len(seed) != SEED_BYTES:
                raise ValueError(f"seed source must give {SEED_BYTES} bytes; found {len(seed)}.")
            blob = seal(self._pair_key(vpk), seed, aad=_seed_aad(self.config, ring.attempt, self.client_id, vid))
            seeds.append((vid, blob))
            sent[vid] = seed
        for _, wpk in ring.predecessors:  # agree now: a low-order key is refused before any state change
            self._pair_key(wpk)
        self._attempt, self._ring, self._sent = ring.attempt, ring, sent
        for vid, seed in sent.items():
            self._seed_log[(ring.attempt, self.client_id, vid)] = seed
        self.stage = ClientStage.SHARED
        return ChainBundle(self.config.instance, self.config.round, self.client_id, SERVER,
                           attempt=ring.attempt, seeds=tuple(seeds)).to_bytes()

    def upload(self, delivery_message: bytes) -> bytes:
        """Stage UPLOAD: open the predecessors' sealed seeds and return the masked UPLOAD.

        Raises:
            MessageError: malformed, wrong-stage, wrong-attempt or inconsistent delivery (state
                unchanged).
            AuthenticationError: a sealed seed failed to open (tampered, replayed from another
                attempt/round/instance, or misrouted); the client leaves the round
                (stage ``FAILED``), which the server handles as a dropout.
        """
        where = f"client {self.client_id} stage {self.stage.name} (attempt {self._attempt})"
        msg = _receive(delivery_message, Kind.DELIVERY, where=where, config=self.config)
        self._check_routing(msg, Kind.DELIVERY, where)
        assert isinstance(msg, ChainDelivery) and self._ring is not None
        if msg.attempt != self._attempt:
            raise MessageError(f"{where}: delivery for attempt {msg.attempt}, expected {self._attempt} (stale or replayed).")
        expected = sorted(pid for pid, _ in self._ring.predecessors)
        found = sorted(pid for pid, _ in msg.seeds)
        if found != expected:
            raise MessageError(f"{where}: delivery from senders {found}, expected the predecessors {expected}.")
        keys = dict(self._ring.predecessors)
        received: dict[int, bytes] = {}
        try:
            for pid, blob in msg.seeds:
                aad = _seed_aad(self.config, self._attempt, pid, self.client_id)
                received[pid] = open_sealed(self._pair_key(keys[pid]), blob, aad=aad)
        except AuthenticationError:
            self.stage = ClientStage.FAILED
            raise
        for pid, seed in received.items():
            self._seed_log[(self._attempt, pid, self.client_id)] = seed
        # masked into a reused per-thread buffer: the only fresh 8*dim bytes are the wire message
        y = _mask(self._value, self._sent.values(), received.values(), out=_upload_scratch(self.config.dim))
        key = self._keys.agree(self._ring.server_key, info=_ka_info(self.config, b"/upload"))  # type: ignore[union-attr]
        tag = _upload_tag(key, self.config, self._attempt, self.client_id, y)
        self.stage = ClientStage.UPLOADED
        return ChainUpload(self.config.instance, self.config.round, self.client_id, SERVER,
                           attempt=self._attempt, vector=y, tag=tag).to_bytes()

    def handle(self, message: bytes) -> bytes:
        """Dispatch a server message (RING or DELIVERY) to :meth:`share` or :meth:`upload`."""
        msg = decode(message)
        if isinstance(msg, ChainRing):
            return self.share(message)
        if isinstance(msg, ChainDelivery):
            return self.upload(message)
        raise MessageError(f"client {self.client_id}: clients do not accept {type(msg).__name__} messages.")

    # -- what a colluding client can hand over -------------------------------------------

    def known_seeds(self) -> dict[tuple[int, int, int], bytes]:
        """Every seed this client sent or received, keyed ``(attempt, sender, receiver)``.

        This is the client's private view: a colluding client hands it to the server (the
        collusion tests use it); an honest client never reveals it.
        """
        return dict(self._seed_log)

    # -- helpers -------------------------------------------------------------------------

    def _check_routing(self, msg: Message, kind: Kind, where: str) -> None:
        if kind not in CLIENT_ACCEPTS[self.stage]:
            raise MessageError(f"{where}: a {kind.name} message is not accepted in stage {self.stage.name}.")
        if msg.sender != SERVER or msg.receiver != self.client_id:
            raise MessageError(
                f"{where}: message routed {msg.sender}->{msg.receiver}, expected server->{self.client_id}."
            )

    def _check_ring(self, data: bytes) -> ChainRing:
        where = f"client {self.client_id} stage {self.stage.name} (attempt {self._attempt})"
        ring = _receive(data, Kind.RING, where=where, config=self.config)
        self._check_routing(ring, Kind.RING, where)
        assert isinstance(ring, ChainRing)
        if ring.attempt <= self._attempt:
            raise MessageError(
                f"{where}: ring for attempt {ring.attempt}, but attempt {self._attempt} already "
                "started (replayed or stale assignment)."
            )
        if ring.attempt > self.config.max_attempts:
            raise MessageError(f"{where}: attempt {ring.attempt} exceeds max_attempts={self.config.max_attempts}.")
        if ring.ring_size < self.config.min_survivors:
            raise MessageError(
                f"{where}: a ring of {ring.ring_size} clients is below min_survivors={self.config.min_survivors}; refused."
            )
        s = effective_successors(self.config.successors, ring.ring_size)
        if len(ring.successors) != s or len(ring.predecessors) != s:
            raise MessageError(
                f"{where}: {len(ring.successors)} successors and {len(ring.predecessors)} predecessors "
                f"for a ring of {ring.ring_size}, expected {s} each."
            )
        for group, name in ((ring.successors, "successors"), (ring.predecessors, "predecessors")):
            ids = [pid for pid, _ in group]
            if len(set(ids)) != len(ids) or self.client_id in ids or SERVER in ids:
                raise MessageError(f"{where}: invalid {name} {ids} (duplicates, self or server).")
        if self._ring is not None and ring.server_key != self._ring.server_key:
            raise MessageError(f"{where}: the server's key changed between attempts; refused.")
        try:
            self._keys.exchange(ring.server_key)  # type: ignore[union-attr]
        except MessageError as exc:
            raise MessageError(f"{where}: invalid server key ({exc}).") from None
        keys = dict(ring.successors)
        for pid, pk in ring.predecessors:  # a neighbour on both sides must carry one key
            if keys.setdefault(pid, pk) != pk:
                raise MessageError(f"{where}: client {pid} appears with two different public keys.")
        if len(keys) > ring.ring_size - 1:
            raise MessageError(f"{where}: {len(keys)} distinct neighbours in a ring of {ring.ring_size}.")
        return ring

    def _pair_key(self, peer_public: bytes) -> bytes:
        key = self._pair_keys.get(peer_public)
        if key is None:
            assert self._keys is not None
            key = self._keys.agree(peer_public, info=_ka_info(self.config, b"/pair"))
            self._pair_keys[peer_public] = key
        return key


# --------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ServerStep:
    """What the server sends when a stage closes.

    Attributes:
        kind: :attr:`Kind.RING` (an attempt starts), :attr:`Kind.DELIVERY` (seeds to relay) or
            ``None`` when the round is finished (``messages`` is then empty).
        attempt: the attempt the messages belong to.
        messages: serialised message per receiving client id.
    """

    kind: Kind | None
    attempt: int
    messages: Mapping[int, bytes]


@dataclass(frozen=True)
class AttemptRecord:
    """How one attempt ended: its ring, the clients that completed it, and why it ended."""

    attempt: int
    ring: tuple[int, ...]
    completed: frozenset[int]
    outcome: str


class ChainServer:
    """The aggregation server: validates, relays, sums, and restarts attempts after dropouts.

    Args:
        config: the round's public parameters.
        clients: ids of the clients invited to the round.
    """

    def __init__(self, config: ChainConfig, clients: Iterable[int]) -> None:
        ids = list(clients)
        for cid in ids:
            if type(cid) is not int or not 0 <= cid < SERVER:
                raise ValueError(f"client ids must be ints in [0, 2^32 - 1); found {cid!r}.")
        if len(set(ids)) != len(ids):
            raise ValueError("client ids must be distinct; found duplicates.")
        if len(ids) < config.min_survivors:
            raise ValueError(
                f"{len(ids)} clients invited but min_survivors={config.min_survivors}; invite more clients."
            )
        self.config = config
        self.invited = frozenset(ids)
        self.stage = ServerStage.ADVERTISE
        self.attempt = 0
        self.ring: tuple[int, ...] = ()
        self.survivors: frozenset[int] = frozenset()
        self.history: list[AttemptRecord] = []
        self._public: dict[int, bytes] = {}
        self._position: dict[int, int] = {}
        self._s = 0
        self._bundles: dict[int, tuple[tuple[int, bytes], ...]] = {}
        self._uploaded: set[int] = set()
        self._spoiled: set[int] = set()
        self._sum: np.ndarray | None = None
        self._shuffle = secrets.SystemRandom().shuffle  # OS CSPRNG
        self._keys = KeyPair.generate()  # authenticates uploads (client -> server, not relayed)
        self._upload_keys: dict[int, bytes] = {}

    @property
    def successors(self) -> int:
        """The effective ``s`` of the current attempt."""
        return self._s

    # -- stage ADVERTISE -----------------------------------------------------------------

    def receive_advert(self, message: bytes) -> None:
        """Accept one ADVERT (raises :class:`MessageError` and changes nothing if invalid)."""
        msg = self._accept(message, Kind.ADVERT)
        assert isinstance(msg, ChainAdvert)
        if msg.sender not in self.invited:
            raise MessageError(f"server stage ADVERTISE: client {msg.sender} was not invited to this round.")
        if msg.sender in self._public:
            raise MessageError(f"server stage ADVERTISE: replayed message from client {msg.sender} (already received).")
        self._public[msg.sender] = msg.public_key

    def close_advertise(self) -> ServerStep:
        """Close ADVERTISE: draw the ring over the advertisers and return their RING messages.

        Raises:
            AbortError: fewer than ``min_survivors`` clients advertised.
        """
        self._require(ServerStage.ADVERTISE, "close_advertise")
        return self._new_attempt(sorted(self._public), reason="advertised")

    # -- stage SHARE ---------------------------------------------------------------------

    def receive_bundle(self, message: bytes) -> None:
        """Accept one BUNDLE of sealed seeds (validated: exactly the sender's successors)."""
        msg = self._accept(message, Kind.BUNDLE)
        assert isinstance(msg, ChainBundle)
        where = f"server stage SHARE (attempt {self.attempt})"
        if msg.sender in self._bundles:
            raise MessageError(f"{where}: replayed message from client {msg.sender} (already received).")
        expected = self._successors_of(msg.sender)
        found = [pid for pid, _ in msg.seeds]
        if found != expected:
            raise MessageError(
                f"{where}: bundle from {msg.sender} addressed to {found}, expected its successors {expected}."
            )
        self._bundles[msg.sender] = msg.seeds

    def close_share(self) -> ServerStep:
        """Close SHARE: relay the seeds, or restart the attempt if a ring member sent none."""
        self._require(ServerStage.SHARE, "close_share")
        if len(self._bundles) != len(self.ring):
            missing = sorted(set(self.ring) - set(self._bundles))
            return self._restart(sorted(self._bundles), reason=f"no seeds from {missing}")
        inbox: dict[int, list[tuple[int, bytes]]] = {cid: [] for cid in self.ring}
        for sender in self.ring:
            for receiver, blob in self._bundles[sender]:
                inbox[receiver].append((sender, blob))
        messages = {
            cid: ChainDelivery(self.config.instance, self.config.round, SERVER, cid,
                               attempt=self.attempt, seeds=tuple(entries)).to_bytes()
            for cid, entries in inbox.items()
        }
        self._bundles = {}
        self._uploaded = set()
        self._sum = np.zeros(self.config.dim, dtype=np.uint64)
        self.stage = ServerStage.UPLOAD
        return ServerStep(Kind.DELIVERY, self.attempt, messages)

    # -- stage UPLOAD --------------------------------------------------------------------

    def receive_upload(self, message: bytes) -> None:
        """Accept one UPLOAD and add it into the running sum (validated and authenticated first).

        Raises:
            MessageError: malformed, replayed, stale or wrong-length upload (state unchanged).
            AuthenticationError: the tag does not verify (tampered vector or header; state
                unchanged; the client counts as dropped unless a valid upload follows).
        """
        try:
            self._receive_upload(message)
        except (MessageError, AuthenticationError):
            self._note_spoiled(message)
            raise

    def _note_spoiled(self, message: bytes) -> None:
        """Remember a ring member whose upload for this attempt arrived but was refused.

        Its bytes may carry that member's masked vector; re-running without the member would let
        a server that kept them subtract two sums, so :meth:`close_upload` aborts instead.
        """
        if self.stage is not ServerStage.UPLOAD or not isinstance(message, (bytes, bytearray, memoryview)):
            return
        data = bytes(message[: HEADER_BYTES + 4])
        if len(data) < HEADER_BYTES + 4:
            return
        _, _, _, _, instance, rnd, sender, _, _ = _WIRE_HEADER.unpack_from(data)
        attempt = int.from_bytes(data[HEADER_BYTES:], "big")
        if (instance, rnd, attempt) == (self.config.instance, self.config.round, self.attempt) and (
            sender in self._position and sender not in self._uploaded
        ):
            self._spoiled.add(sender)

    def _receive_upload(self, message: bytes) -> None:
        msg = self._accept(message, Kind.UPLOAD)
        assert isinstance(msg, ChainUpload) and self._sum is not None
        where = f"server stage UPLOAD (attempt {self.attempt})"
        if msg.sender in self._uploaded:
            raise MessageError(f"{where}: replayed message from client {msg.sender} (already received).")
        if msg.vector.shape != (self.config.dim,):
            raise MessageError(
                f"{where}: upload from {msg.sender} has {msg.vector.size} values, expected dim={self.config.dim}."
            )
        key = self._upload_keys.get(msg.sender)
        if key is None:
            key = self._keys.agree(self._public[msg.sender], info=_ka_info(self.config, b"/upload"))
            self._upload_keys[msg.sender] = key
        _upload_tag(key, self.config, msg.attempt, msg.sender, msg.vector, tag=msg.tag)
        np.add(self._sum, msg.vector, out=self._sum)
        self._uploaded.add(msg.sender)

    def close_upload(self) -> ServerStep:
        """Close UPLOAD: finish if every ring member uploaded, else re-run among the uploaders."""
        self._require(ServerStage.UPLOAD, "close_upload")
        if len(self._uploaded) != len(self.ring):
            missing = sorted(set(self.ring) - self._uploaded)
            spoiled = sorted(self._spoiled - self._uploaded)
            if spoiled:
                self._sum = None
                self.history.append(AttemptRecord(self.attempt, self.ring, frozenset(self._uploaded), "aborted"))
                self.stage = ServerStage.ABORTED
                raise AbortError(
                    f"chain round {self.config.round}, attempt {self.attempt}: uploads from {spoiled} arrived but "
                    "were refused (tampered or malformed) and no valid one followed; re-running without them could "
                    "expose them to a server that kept the refused bytes, so the round aborts. Check the transport."
                )
            self._sum = None  # an abandoned attempt's sum is still masked: discard it
            return self._restart(sorted(self._uploaded), reason=f"no upload from {missing}")
        self.survivors = frozenset(self.ring)
        self.history.append(AttemptRecord(self.attempt, self.ring, self.survivors, "complete"))
        self.stage = ServerStage.DONE
        return ServerStep(None, self.attempt, {})

    # -- generic -------------------------------------------------------------------------

    def receive(self, message: bytes) -> None:
        """Dispatch a client message to the receiver of the current stage."""
        receivers = {
            ServerStage.ADVERTISE: self.receive_advert,
            ServerStage.SHARE: self.receive_bundle,
            ServerStage.UPLOAD: self.receive_upload,
        }
        if self.stage not in receivers:
            raise MessageError(f"server stage {self.stage.name}: the round is over; message refused.")
        receivers[self.stage](message)

    def close(self) -> ServerStep:
        """Close the current stage (its deadline passed)."""
        closers = {
            ServerStage.ADVERTISE: self.close_advertise,
            ServerStage.SHARE: self.close_share,
            ServerStage.UPLOAD: self.close_upload,
        }
        if self.stage not in closers:
            raise MessageError(f"server stage {self.stage.name}: nothing to close.")
        return closers[self.stage]()

    def result(self) -> np.ndarray:
        """The ``uint64`` sum over :attr:`survivors` (only after the round completed)."""
        if self.stage is not ServerStage.DONE or self._sum is None:
            raise AbortError(f"no result: the chain round is in stage {self.stage.name}, not DONE.")
        return self._sum.copy()

    # -- internals -----------------------------------------------------------------------

    def _require(self, stage: ServerStage, action: str) -> None:
        if self.stage is not stage:
            raise MessageError(f"server: {action} called in stage {self.stage.name}, expected {stage.name}.")

    def _accept(self, data: bytes, kind: Kind) -> Message:
        """Decode and check stage, kind, instance, round, routing, attempt and membership."""
        where = f"server stage {self.stage.name} (attempt {self.attempt})"
        msg = _receive(data, kind, where=where, config=self.config)
        if kind not in SERVER_ACCEPTS[self.stage]:
            raise MessageError(
                f"{where}: a {kind.name} message from client {msg.sender} arrived outside its stage "
                "(late or early); refused unread."
            )
        if msg.receiver != SERVER:
            raise MessageError(f"{where}: message addressed to {msg.receiver}, not the server.")
        if kind is not Kind.ADVERT:
            if msg.attempt != self.attempt:  # type: ignore[attr-defined]
                raise MessageError(
                    f"{where}: message from client {msg.sender} for attempt {msg.attempt}, "  # type: ignore[attr-defined]
                    f"expected {self.attempt} (stale or replayed)."
                )
            if msg.sender not in self._position:
                raise MessageError(f"{where}: client {msg.sender} is not in this attempt's ring.")
        return msg

    def _restart(self, members: Sequence[int], *, reason: str) -> ServerStep:
        self.history.append(AttemptRecord(self.attempt, self.ring, frozenset(members), reason))
        if self.attempt >= self.config.max_attempts:
            self.stage = ServerStage.ABORTED
            raise AbortError(
                f"chain round {self.config.round}: attempt {self.attempt} failed ({reason}) and "
                f"max_attempts={self.config.max_attempts} is reached; no sum produced. Raise max_attempts "
                "or lengthen the stage deadlines."
            )
        return self._new_attempt(members, reason=reason)

    def _new_attempt(self, members: Sequence[int], *, reason: str) -> ServerStep:
        if len(members) < self.config.min_survivors:
            self.stage = ServerStage.ABORTED
            raise AbortError(
                f"chain round {self.config.round}, attempt {self.attempt + 1}: only {len(members)} clients left "
                f"({reason}), fewer than min_survivors={self.config.min_survivors}; no sum produced."
            )
        ring = list(members)
        self._shuffle(ring)
        return self._start_ring(tuple(ring))

    def _start_ring(self, ring: tuple[int, ...]) -> ServerStep:
        """Start the next attempt on an explicit ring order (known-answer core; tests fix it)."""
        self.attempt += 1
        self.ring = ring
        self._position = {cid: i for i, cid in enumerate(ring)}
        self._s = effective_successors(self.config.successors, len(ring))
        self._bundles, self._uploaded, self._sum = {}, set(), None
        self._spoiled: set[int] = set()
        self.stage = ServerStage.SHARE
        messages = {}
        for cid in ring:
            succ = tuple((v, self._public[v]) for v in self._successors_of(cid))
            pred = tuple((w, self._public[w]) for w in self._predecessors_of(cid))
            messages[cid] = ChainRing(self.config.instance, self.config.round, SERVER, cid, attempt=self.attempt,
                                      ring_size=len(ring), server_key=self._keys.public_bytes,
                                      successors=succ, predecessors=pred).to_bytes()
        return ServerStep(Kind.RING, self.attempt, messages)

    def _successors_of(self, cid: int) -> list[int]:
        p, m = self._position[cid], len(self.ring)
        return [self.ring[(p + j) % m] for j in range(1, self._s + 1)]

    def _predecessors_of(self, cid: int) -> list[int]:
        p, m = self._position[cid], len(self.ring)
        return [self.ring[(p - j) % m] for j in range(1, self._s + 1)]
