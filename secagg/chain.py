"""The circular share chain (STTFedRec, section 3.3, generalised to ``s`` successors).

Parties:
    ``n`` clients, each holding a ``uint64`` vector of length ``dim`` (a fixed-point encoding,
    see :mod:`secagg.encoding`), and one aggregation server that relays every message (clients
    never talk to each other directly).

Adversary:
    an honest-but-curious server that follows the protocol (including its deadlines: a message
    that arrives after its stage closed is rejected unread, and the re-run rule below) and
    records everything it receives, colluding with any set of clients, which may deviate (drop at
    the worst moment, send bad seeds, hand the server every seed and pad they know); a network
    or server that tampers with, replays, truncates or reorders messages is detected (typed
    errors) but may force a client out of the round (no robustness against denial of service).

Promise:
    the server learns only ``sum(x_u for u in survivors)`` mod 2^64, where ``survivors`` is the
    set of clients that completed the final attempt, with at least ``min_survivors`` of them.
    Every upload the server sees is uniform on Z_(2^64)^dim subject to that sum (computationally:
    masks are AES-256-CTR expansions of 32-byte seeds from the OS CSPRNG). Across all the
    attempts of a round, the server never learns sums over two client sets that differ in an
    honest client: with a coalition of fewer than ``2s`` colluders, everything it can compute
    from all attempts together is one sum over the honest survivors (besides the colluders' own
    inputs), or, in a round that aborts after an unlock-stage dropout, possibly the sum over
    the clients that unlocked, the sum a completed re-run would have given it
    (``tests/secagg/test_chain_rerun.py`` checks this against a linear-algebra oracle over random
    dropout and collusion schedules).

Re-run rule (why the promise survives dropouts):
    every upload carries, besides the ring masks, a fresh per-attempt *pad* ``PRG(p_u)`` whose
    seed only its owner knows. The pads are revealed (stage ``UNLOCK``) only after every ring
    member's upload of that attempt has arrived; the server then strips them from the sum.

    1. a ring member missing at ``SHARE`` or ``UPLOAD`` abandons the attempt, and attempt
       ``a + 1`` starts with a fresh random ring, fresh seeds and fresh pads over the clients
       that completed that stage. The abandoned uploads are padded by seeds nobody ever
       reveals, so they are useless even to a server holding every colluder's seeds (the attack
       of issue 8, item 1: a colluder drops after receiving its seeds, the server keeps the
       others' uploads and would learn their sum; a later attempt without an honest client
       would then give that client's input as the difference). Such re-runs cost nothing in
       privacy and are allowed up to ``max_attempts``.
    2. a ring member missing at ``UNLOCK`` (the others already revealed their pads) leaves the
       server with the unpadded uploads of the unlockers ``U``: with colluders it may learn
       sums over parts of ``U``. The round then gets **one** more attempt, over exactly ``U``,
       on the same ring order with the missing members removed (so its neighbourhoods only
       merge the failed attempt's), and it must complete with all of ``U``: any further
       dropout, at any stage, aborts the round (:class:`~secagg.errors.AbortError`). So every
       sum the server learns is over ``U`` (or, with ``2s`` or more colluders, over the parts
       of one ring, the stated limit below). An unlock that arrived but was refused (tampered,
       truncated) with no valid one following aborts at once: its bytes may carry the pad.

Limits (each demonstrated by a test in ``tests/secagg/test_chain*.py``):
    * the server together with the ``s`` ring predecessors and the ``s`` ring successors of a
      client recovers that client's input (with ``s = 1``: the server plus both ring
      neighbours, as in the paper). More generally a coalition of the server and a set ``C`` of
      clients learns the sum of the inputs of every connected component of the ring graph
      (edges ``u -> u+1 .. u+s``) with ``C`` removed, for one ring per round (the completed
      one, or the one whose unlock stage failed); with fewer than ``2s`` colluders no honest
      client is isolated;
    * with ``n = 2`` survivors each client can subtract its own input from the published sum;
      this is inherent to any sum and is why ``min_survivors`` defaults to 2, not 1;
    * the server picks the ring (CSPRNG), hands out the neighbours' public keys and decides when
      every upload has arrived: a *malicious* server could place colluders next to a victim,
      run a man-in-the-middle on the keys, or ask for the pads of an attempt whose uploads are
      incomplete (and then run the attack above). The design is honest-but-curious only, like
      the paper's;
    * a late ``UNLOCK`` must stay refused: a server that kept one would hold the pads of more
      clients than the re-run's survivors, and two sums over different sets (a test shows it);
    * the rule is per round: a caller that aggregates the *same* inputs again in a new round
      after an abort, over a different client set, gives the server two sums. Use fresh inputs
      (the next training round's), or the same client set.

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
       share only has to be pseudo-random, and saves ``8 * dim - 60`` bytes per share). It also
       draws its pad seed ``p_u``.
    4. the server delivers to each client the ``s`` sealed seeds of its predecessors.
    5. ``UPLOAD``: client ``u`` uploads
       ``y_u = x_u - sum_{v succ} PRG(seed_{u->v}) + sum_{w pred} PRG(seed_{w->u}) + PRG(p_u)``,
       authenticated with a GCM tag under ``HKDF(X25519(u, server))``.
    6. ``UNLOCK``: once every ring member's upload arrived, the server asks each for its pad; the
       client sends ``p_u`` sealed to the server. With every pad in, the server returns
       ``sum_u y_u - sum_u PRG(p_u) = sum_u x_u`` (every seed enters once with ``+`` and once
       with ``-``).

Dropouts (a client may vanish before advertising, after the ring is sent, after sending its
seeds, after receiving its seeds, before uploading, or before unlocking; a client whose sealed
seed fails to open leaves the attempt the same way): dropping before step 1 only removes the
client from the ring; later, the re-run rule above applies. Nothing is ever revealed to repair
an attempt. After ``max_attempts`` attempts, or when fewer than ``min_survivors`` clients
remain, the round aborts and no sum is produced. Pairwise keys are reused across attempts of a
round (the associated data binds the attempt); seeds and pads never are.

Messages (:mod:`secagg.chain_wire`) are constant-size for a given ``(s, dim)``, carry a fixed
header ``magic | kind | instance | round | attempt | sender | receiver`` and are validated
(kind, instance, round, attempt, stage, sender, duplicates, exact length) before they touch
any state; a rejected message raises :class:`~secagg.errors.MessageError` and leaves the
receiver's state unchanged. The server is :class:`secagg.chain_server.ChainServer`.
"""

from __future__ import annotations

import enum
import secrets
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from secagg.chain_wire import (
    MESSAGE_CLASSES,
    ChainAdvert,
    ChainBundle,
    ChainDelivery,
    ChainRing,
    ChainUnlock,
    ChainUnlockRequest,
    ChainUpload,
    ChainUploadV2,
    Kind,
    RING_BITS,
    message_size,
)
from secagg.channel import associated_data, open_sealed, seal
from secagg.errors import AuthenticationError, MessageError
from secagg.keys import KeyPair, hkdf_sha256
from secagg.messages import SERVER, Message, decode
from secagg.prg import SEED_BYTES, accumulate

__all__ = [
    "CLIENT_ACCEPTS",
    "ChainAdvert",
    "ChainBundle",
    "ChainClient",
    "ChainConfig",
    "ChainDelivery",
    "ChainRing",
    "ChainUnlock",
    "ChainUnlockRequest",
    "ChainUpload",
    "ChainUploadV2",
    "ClientStage",
    "Kind",
    "effective_successors",
    "message_size",
    "remove_masks",
]

_MAX_ENTRIES = 2**15
_KA_INFO = b"secagg/chain/v1/ka"
_MASK_LABEL = b"chain/mask"
_PAD_LABEL = b"chain/pad"


class ClientStage(enum.Enum):
    """Client states; :data:`CLIENT_ACCEPTS` lists which message each state accepts."""

    NEW = "new"
    ADVERTISED = "advertised"
    SHARED = "shared"
    UPLOADED = "uploaded"
    UNLOCKED = "unlocked"
    FAILED = "failed"


#: Which incoming message kind a client accepts in each state (anything else is refused).
CLIENT_ACCEPTS: dict[ClientStage, frozenset[Kind]] = {
    ClientStage.NEW: frozenset(),
    ClientStage.ADVERTISED: frozenset({Kind.RING}),
    ClientStage.SHARED: frozenset({Kind.RING, Kind.DELIVERY}),  # RING: the attempt was restarted
    ClientStage.UPLOADED: frozenset({Kind.RING, Kind.UNLOCK_REQUEST}),  # RING: re-run among survivors
    ClientStage.UNLOCKED: frozenset({Kind.RING}),  # RING: the one re-run after an unlock-stage dropout
    ClientStage.FAILED: frozenset(),
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
        ring_bits: the ring, ``Z_2^64`` (default; uploads :class:`ChainUpload`, 8 bytes per
            value) or ``Z_2^32`` (uploads :class:`ChainUploadV2`, 4 bytes per value). Public: every
            party derives it from the public encoding parameters with
            :func:`secagg.encoding.choose_ring_bits` (32 only when the sum provably fits), so
            clients and server agree without negotiating; an upload of another width is refused.
            Inputs stay ``uint64`` encodings (their value mod ``2^ring_bits`` is what is summed)
            and :meth:`ChainServer.result` is the sum mod ``2^ring_bits``.
    """

    instance: bytes
    round: int
    dim: int
    successors: int = 1
    min_survivors: int = 2
    max_attempts: int = 4
    ring_bits: int = 64

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
        if type(self.ring_bits) is not int or self.ring_bits not in RING_BITS:
            raise ValueError(f"ring_bits must be one of {RING_BITS}; found {self.ring_bits!r}.")

    @property
    def ring_mask(self) -> np.uint64:
        """``2^ring_bits - 1`` as ``uint64`` (reduces a ``uint64`` word into the ring)."""
        return np.uint64(2**self.ring_bits - 1)


def effective_successors(successors: int, ring_size: int) -> int:
    """``s`` capped at ``ring_size - 1`` (a client never shares with itself)."""
    return max(1, min(int(successors), int(ring_size) - 1))



# --------------------------------------------------------------------------- helpers


def _receive(data: bytes, kind: Kind, *, where: str, config: ChainConfig) -> Message:
    """Decode ``data`` strictly and check kind, instance and round (state unchanged on error)."""
    msg = decode(data)
    if not isinstance(msg, MESSAGE_CLASSES[kind]):
        raise MessageError(f"{where}: expected a {MESSAGE_CLASSES[kind].__name__}; found {type(msg).__name__}.")
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
    width = "" if config.ring_bits == 64 else f"ring={config.ring_bits}/"  # format 1 unchanged
    context = associated_data(
        instance=config.instance, round=config.round, sender=sender, receiver=SERVER,
        kind=f"chain/upload/{width}attempt={attempt}",
    )
    one_time = hkdf_sha256(key, info=context)
    word = f"<u{config.ring_bits // 8}"
    data = memoryview(np.ascontiguousarray(vector, dtype=word)).cast("B")
    if tag is None:
        return seal(one_time, b"", aad=data)  # type: ignore[arg-type]
    open_sealed(one_time, tag, aad=data)  # type: ignore[arg-type]
    return tag


def _ka_info(config: ChainConfig, purpose: bytes) -> bytes:
    return _KA_INFO + purpose + config.instance + config.round.to_bytes(4, "big")


def _mask(
    x: np.ndarray, sent: Iterable[bytes], received: Iterable[bytes], *, pad: bytes | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Known-answer core of the upload: ``x - sum PRG(sent) + sum PRG(received) + PRG(pad)`` mod 2^64.

    Written into ``out`` (a uint64 array of ``x``'s shape) if given, else into a fresh array.
    """
    if out is None:
        y = np.array(x, dtype=np.uint64, copy=True)
    else:
        y = out
        np.copyto(y, x, casting="unsafe")
    # one cache-blocked pass over y for all 2s masks and the pad (same sum mod 2^64 as one pass each)
    masks = [(seed, _MASK_LABEL, True) for seed in sent]
    masks += [(seed, _MASK_LABEL, False) for seed in received]
    if pad is not None:
        masks.append((pad, _PAD_LABEL, False))
    accumulate(y, masks)
    return y


def remove_masks(
    upload: np.ndarray, *, sent: Iterable[bytes] = (), received: Iterable[bytes] = (), pad: bytes | None = None,
) -> np.ndarray:
    """The inverse of :func:`_mask` for the seeds given: ``upload + sum PRG(sent) - sum PRG(received) - PRG(pad)``.

    What a server holding a client's upload, that client's opened pad and the ring seeds a
    coalition hands over (the seeds the client sent to, and received from, colluding ring
    neighbours; :meth:`ChainClient.known_seeds`) can compute about the client's input: with all
    ``2s`` neighbours' seeds it is the input exactly (the stated limit); with any one missing it
    is the input plus a uniform ``PRG`` mask (attacks/sttfedrec.py, ``chain-collusion``).
    """
    y = np.array(upload, dtype=np.uint64, copy=True)
    masks = [(seed, _MASK_LABEL, False) for seed in sent]
    masks += [(seed, _MASK_LABEL, True) for seed in received]
    if pad is not None:
        masks.append((pad, _PAD_LABEL, True))
    accumulate(y, masks)
    return y


def _server_channel_keys(keys: KeyPair, peer_public: bytes, config: ChainConfig) -> tuple[bytes, bytes]:
    """The client-server keys ``(upload tag key, pad sealing key)`` from one X25519 exchange."""
    shared = keys.exchange(peer_public)
    return (hkdf_sha256(shared, info=_ka_info(config, b"/upload")),
            hkdf_sha256(shared, info=_ka_info(config, b"/unlock")))


def _unlock_aad(config: ChainConfig, attempt: int, sender: int) -> bytes:
    return associated_data(
        instance=config.instance, round=config.round, sender=sender, receiver=SERVER,
        kind=f"chain/unlock/attempt={attempt}",
    )


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
        self._pad = b""
        self._unlock_key = b""
        self._seed_log: dict[tuple[int, int, int], bytes] = {}
        self._pad_log: dict[int, bytes] = {}

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
        """Stage SHARE: read the RING assignment, seal one fresh seed per successor and draw a
        fresh pad seed (CSPRNG).

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
        pad = bytes(draw_seed())
        if len(pad) != SEED_BYTES:
            raise ValueError(f"seed source must give {SEED_BYTES} bytes; found {len(pad)}.")
        for _, wpk in ring.predecessors:  # agree now: a low-order key is refused before any state change
            self._pair_key(wpk)
        self._attempt, self._ring, self._sent, self._pad = ring.attempt, ring, sent, pad
        for vid, seed in sent.items():
            self._seed_log[(ring.attempt, self.client_id, vid)] = seed
        self._pad_log[ring.attempt] = pad
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
        y = _mask(self._value, self._sent.values(), received.values(), pad=self._pad,
                  out=_upload_scratch(self.config.dim))
        key, self._unlock_key = _server_channel_keys(self._keys, self._ring.server_key, self.config)  # type: ignore[arg-type]
        if self.config.ring_bits != 64:  # Z_2^32: the low word of each Z_2^64 value (2^32 divides 2^64)
            y = y & self.config.ring_mask
            tag = _upload_tag(key, self.config, self._attempt, self.client_id, y)
            self.stage = ClientStage.UPLOADED
            return ChainUploadV2(self.config.instance, self.config.round, self.client_id, SERVER,
                                 attempt=self._attempt, vector=y, tag=tag, ring_bits=self.config.ring_bits).to_bytes()
        tag = _upload_tag(key, self.config, self._attempt, self.client_id, y)
        self.stage = ClientStage.UPLOADED
        return ChainUpload(self.config.instance, self.config.round, self.client_id, SERVER,
                           attempt=self._attempt, vector=y, tag=tag).to_bytes()

    def unlock(self, request_message: bytes) -> bytes:
        """Stage UNLOCK: every ring member's upload arrived; reveal this attempt's pad seed.

        The pad is sealed to the server (AES-GCM under ``HKDF(X25519(client, server))``, the
        associated data binding instance, round, attempt and sender), once per attempt.

        Raises:
            MessageError: malformed, wrong-stage, wrong-attempt or misrouted request (state
                unchanged).
        """
        where = f"client {self.client_id} stage {self.stage.name} (attempt {self._attempt})"
        msg = _receive(request_message, Kind.UNLOCK_REQUEST, where=where, config=self.config)
        self._check_routing(msg, Kind.UNLOCK_REQUEST, where)
        assert isinstance(msg, ChainUnlockRequest) and self._ring is not None and self._keys is not None
        if msg.attempt != self._attempt:
            raise MessageError(f"{where}: unlock request for attempt {msg.attempt}, expected {self._attempt} "
                               "(stale or replayed); the pad of another attempt is never revealed.")
        sealed = seal(self._unlock_key, self._pad, aad=_unlock_aad(self.config, self._attempt, self.client_id))
        self.stage = ClientStage.UNLOCKED
        return ChainUnlock(self.config.instance, self.config.round, self.client_id, SERVER,
                           attempt=self._attempt, sealed_pad=sealed).to_bytes()

    def handle(self, message: bytes) -> bytes:
        """Dispatch a server message (RING, DELIVERY or UNLOCK_REQUEST) to its stage method."""
        msg = decode(message)
        if isinstance(msg, ChainRing):
            return self.share(message)
        if isinstance(msg, ChainDelivery):
            return self.upload(message)
        if isinstance(msg, ChainUnlockRequest):
            return self.unlock(message)
        raise MessageError(f"client {self.client_id}: clients do not accept {type(msg).__name__} messages.")

    # -- what a colluding client can hand over -------------------------------------------

    def known_seeds(self) -> dict[tuple[int, int, int], bytes]:
        """Every seed this client sent or received, keyed ``(attempt, sender, receiver)``.

        This is the client's private view: a colluding client hands it to the server (the
        collusion tests use it); an honest client never reveals it.
        """
        return dict(self._seed_log)

    def known_pads(self) -> dict[int, bytes]:
        """This client's pad seed of every attempt it shared in, keyed by attempt (its private
        view, like :meth:`known_seeds`)."""
        return dict(self._pad_log)

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

