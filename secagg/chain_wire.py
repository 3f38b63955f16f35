"""Wire messages of the circular share chain (:mod:`secagg.chain`): kinds 48-79.

Every message is a :class:`secagg.messages.Message` (fixed 40-byte header, strict parser) with a
constant-size body for a given ``(s, dim)``. Parsing checks only what needs no protocol state
(kind, stage, lengths, entry counts); the parties check instance, round, attempt, routing,
membership and replays (:mod:`secagg.chain`, :mod:`secagg.chain_server`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from secagg.channel import OVERHEAD
from secagg.errors import MessageError
from secagg.keys import KEY_BYTES
from secagg.messages import HEADER_BYTES, Message, Reader, Writer, register
from secagg.prg import SEED_BYTES

__all__ = [
    "CT_BYTES",
    "MESSAGE_CLASSES",
    "ChainAdvert",
    "ChainBundle",
    "ChainDelivery",
    "ChainRing",
    "ChainUnlock",
    "ChainUnlockRequest",
    "ChainUpload",
    "ChainUploadV2",
    "Kind",
    "RING_BITS",
    "message_size",
]

CT_BYTES = SEED_BYTES + OVERHEAD  #: one sealed 32-byte secret: nonce || secret || tag
RING_BITS = (32, 64)  #: the rings a chain round may run in: Z_2^32 or Z_2^64
_MAX_ENTRIES = 2**15


class Kind(enum.IntEnum):
    """Message kinds of the chain (codes 48-79 are the chain's in :mod:`secagg.messages`)."""

    ADVERT = 48  #: client -> server: fresh X25519 public key
    RING = 49  #: server -> client: ring size, successors and predecessors with their public keys
    BUNDLE = 50  #: client -> server: one sealed seed per successor
    DELIVERY = 51  #: server -> client: one sealed seed per predecessor
    UPLOAD = 52  #: client -> server: the masked (and padded) vector
    UNLOCK_REQUEST = 53  #: server -> client: every ring member's upload arrived, reveal the pad
    UNLOCK = 54  #: client -> server: the attempt's pad seed, sealed to the server
    UPLOAD_V2 = 55  #: client -> server: the masked vector with its ring width (format 2: 32-bit rings)



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


@dataclass(frozen=True)
class _SealedSeeds(Message):
    """A message carrying one sealed seed per peer, ``(peer, blob)``, for one attempt."""

    attempt: int = 0
    seeds: tuple[tuple[int, bytes], ...] = ()

    def _write_body(self, w: Writer) -> None:
        w.u32(self.attempt)
        _write_entries(w, self.seeds, CT_BYTES)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> _SealedSeeds:
        attempt = r.u32()
        return cls(**head, attempt=attempt, seeds=_read_entries(r, CT_BYTES))


@register
@dataclass(frozen=True)
class ChainBundle(_SealedSeeds):
    """Client -> server: one sealed seed per successor, ``(receiver, blob)``."""

    KIND: ClassVar[int] = int(Kind.BUNDLE)
    STAGE: ClassVar[int] = int(Kind.BUNDLE)


@register
@dataclass(frozen=True)
class ChainDelivery(_SealedSeeds):
    """Server -> client: one sealed seed per predecessor, ``(sender, blob)``."""

    KIND: ClassVar[int] = int(Kind.DELIVERY)
    STAGE: ClassVar[int] = int(Kind.DELIVERY)


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

@register
@dataclass(frozen=True, eq=False)
class ChainUploadV2(ChainUpload):
    """Client -> server, format 2 of the upload: the ring width travels with the vector.

    Body: ``attempt u32 | ring_bits u8 | tag | count u32 | count words of ring_bits / 8 bytes``
    (little-endian). A round in ``Z_2^32`` sends this message (4 bytes per value); a round in
    ``Z_2^64`` sends :class:`ChainUpload` (format 1, implicitly 64 bits, unchanged). The parser
    refuses a width outside :data:`RING_BITS` and a length that does not match the width; the
    server refuses a width other than its round's (``ChainConfig.ring_bits``), and the tag binds
    the width (it is in the one-upload key's context), so neither can be changed in transit.
    ``vector`` holds the words as ``uint64`` (each below ``2^ring_bits``).
    """

    KIND: ClassVar[int] = int(Kind.UPLOAD_V2)
    STAGE: ClassVar[int] = int(Kind.UPLOAD_V2)
    ring_bits: int = 32

    def _write_body(self, w: Writer) -> None:
        if len(self.tag) != OVERHEAD:
            raise ValueError(f"tag must be {OVERHEAD} bytes; found {len(self.tag)}.")
        if self.ring_bits not in RING_BITS:
            raise ValueError(f"ring_bits must be one of {RING_BITS}; found {self.ring_bits!r}.")
        vec = np.asarray(self.vector)
        if vec.ndim != 1 or vec.dtype != np.uint64:
            raise ValueError(f"vector must be a 1-D uint64 array; found {vec.dtype} {vec.shape}.")
        if self.ring_bits < 64 and vec.size and int(vec.max()) >> self.ring_bits:
            raise ValueError(f"vector words must lie in [0, 2^{self.ring_bits}).")
        word = f"<u{self.ring_bits // 8}"
        w.u32(self.attempt).u8(self.ring_bits).raw(self.tag).u32(vec.size).raw(vec.astype(word).tobytes())

    def to_bytes(self) -> bytes:
        return Message.to_bytes(self)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ChainUploadV2:
        attempt, bits = r.u32(), r.u8()
        if bits not in RING_BITS:
            raise MessageError(f"chain upload: ring width {bits} bits is not one of {RING_BITS}.")
        tag, count = r.raw(OVERHEAD), r.u32()
        if count > 2**31:
            raise MessageError(f"chain upload: vector of {count} words exceeds the limit 2^31.")
        data = r.raw(count * bits // 8)
        vector = np.frombuffer(data, dtype=f"<u{bits // 8}").astype(np.uint64)
        return cls(**head, attempt=attempt, tag=tag, vector=vector, ring_bits=bits)


@register
@dataclass(frozen=True)
class ChainUnlockRequest(Message):
    """Server -> client: every ring member's upload of ``attempt`` arrived; reveal your pad."""

    KIND: ClassVar[int] = int(Kind.UNLOCK_REQUEST)
    STAGE: ClassVar[int] = int(Kind.UNLOCK_REQUEST)
    attempt: int = 0

    def _write_body(self, w: Writer) -> None:
        w.u32(self.attempt)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ChainUnlockRequest:
        return cls(**head, attempt=r.u32())


@register
@dataclass(frozen=True)
class ChainUnlock(Message):
    """Client -> server: the pad seed of ``attempt``, sealed (AES-GCM) to the server."""

    KIND: ClassVar[int] = int(Kind.UNLOCK)
    STAGE: ClassVar[int] = int(Kind.UNLOCK)
    attempt: int = 0
    sealed_pad: bytes = bytes(CT_BYTES)

    def _write_body(self, w: Writer) -> None:
        if len(self.sealed_pad) != CT_BYTES:
            raise ValueError(f"sealed_pad must be {CT_BYTES} bytes; found {len(self.sealed_pad)}.")
        w.u32(self.attempt).raw(self.sealed_pad)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ChainUnlock:
        attempt = r.u32()
        return cls(**head, attempt=attempt, sealed_pad=r.raw(CT_BYTES))


MESSAGE_CLASSES: dict[Kind, type[Message]] = {
    Kind.ADVERT: ChainAdvert, Kind.RING: ChainRing, Kind.BUNDLE: ChainBundle,
    Kind.DELIVERY: ChainDelivery, Kind.UPLOAD: ChainUpload, Kind.UNLOCK_REQUEST: ChainUnlockRequest,
    Kind.UNLOCK: ChainUnlock, Kind.UPLOAD_V2: ChainUploadV2,
}
"""Message class of each kind."""


def message_size(kind: Kind, *, s: int = 1, dim: int = 1, ring_bits: int = 64) -> int:
    """Exact wire size in bytes of a chain message of ``kind`` for ``s`` successors and ``dim``.

    ``ring_bits`` matters only for the upload: ``Kind.UPLOAD`` with ``ring_bits = 32`` (or
    ``Kind.UPLOAD_V2``) is the size of a 32-bit round's :class:`ChainUploadV2`."""
    if ring_bits not in RING_BITS:
        raise ValueError(f"ring_bits must be one of {RING_BITS}; found {ring_bits!r}.")
    if Kind(kind) is Kind.UPLOAD_V2 or (Kind(kind) is Kind.UPLOAD and ring_bits != 64):
        return HEADER_BYTES + 9 + OVERHEAD + ring_bits // 8 * dim
    body = {
        Kind.ADVERT: KEY_BYTES,
        Kind.RING: 16 + KEY_BYTES + 2 * s * (4 + KEY_BYTES),
        Kind.BUNDLE: 8 + s * (4 + CT_BYTES),
        Kind.DELIVERY: 8 + s * (4 + CT_BYTES),
        Kind.UPLOAD: 8 + OVERHEAD + 8 * dim,
        Kind.UNLOCK_REQUEST: 4,
        Kind.UNLOCK: 4 + CT_BYTES,
    }[Kind(kind)]
    return HEADER_BYTES + body

