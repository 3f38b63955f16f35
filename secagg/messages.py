"""Typed, versioned, strictly validated wire messages shared by every aggregation protocol.

Every message is a frozen dataclass deriving from :class:`Message`. Its wire form is a fixed
40-byte header followed by a body whose layout the subclass defines with :class:`Writer` /
:class:`Reader`::

    magic "SAGG" | version u8 | kind u8 | stage u8 | 0 u8 | instance 16B |
    round u32 | sender u32 | receiver u32 | body length u32 | body

All integers are big-endian except ``uint64`` vectors, which are little-endian ``uint64``.
``from_bytes`` rejects (with :class:`~secagg.errors.MessageError` naming the message and the
reason): a bad magic or version, a nonzero reserved byte, another kind, a header stage that is
not the kind's stage, a
body length that does not match, truncated or trailing bytes, out-of-range fields. Checks that
need protocol state (expected round, instance, sender, replay, vector length) belong to the
receiving party, which raises :class:`MessageError` too and leaves its state unchanged.

Kind codes: 1-15 plain, 16-47 secagg/secagg+, 48-79 chain, 80-127 reserved; register a class
with :func:`register` (duplicate kinds are refused).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import numpy as np

from secagg.errors import MessageError

__all__ = [
    "HEADER_BYTES",
    "INSTANCE_BYTES",
    "SERVER",
    "VERSION",
    "Message",
    "Reader",
    "Writer",
    "decode",
    "kind_of",
    "register",
]

MAGIC = b"SAGG"
VERSION = 1
INSTANCE_BYTES = 16
SERVER = 0xFFFFFFFF  #: the ``sender``/``receiver`` id of the server
_HEADER = struct.Struct(">4sBBBx16sIIII")
HEADER_BYTES = _HEADER.size
_REGISTRY: dict[int, type[Message]] = {}

M = TypeVar("M", bound="Message")


class Writer:
    """Append-only body builder. Large vectors are held as views of their arrays, not copies: the
    message's bytes are assembled in one join (:meth:`getvalue`, :meth:`Message.to_bytes`), the only
    copy of a 5 MB masked input on its way to the wire."""

    def __init__(self) -> None:
        self._parts: list[bytes | memoryview] = []

    @property
    def nbytes(self) -> int:
        """The body's length so far."""
        return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in self._parts)

    def u8(self, v: int) -> Writer:
        self._parts.append(struct.pack(">B", v))
        return self

    def u32(self, v: int) -> Writer:
        self._parts.append(struct.pack(">I", v))
        return self

    def raw(self, b: bytes) -> Writer:
        self._parts.append(bytes(b))
        return self

    def buffers(self, parts: list[bytes | memoryview]) -> Writer:
        """Append ``parts`` without copying them (read by the one join, before the caller returns)."""
        self._parts.extend(p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts)
        return self

    def u32_array(self, values: np.ndarray | list[int]) -> Writer:
        arr = np.asarray(values, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
            raise ValueError("u32_array values must lie in [0, 2^32).")
        self._parts.append(struct.pack(">I", arr.size) + arr.astype(">u4").tobytes())
        return self

    def u64_vector(self, v: np.ndarray) -> Writer:
        arr = np.asarray(v)
        if arr.dtype != np.uint64 or arr.ndim != 1:
            raise ValueError(f"u64_vector expects a 1-D uint64 array; found {arr.dtype} {arr.shape}.")
        words = np.ascontiguousarray(arr.astype("<u8", copy=False))  # a view on little-endian hosts
        self._parts.append(struct.pack(">I", arr.size))
        self._parts.append(memoryview(words).cast("B"))  # read by the one join, before the caller returns
        return self

    def records(self, fmt: struct.Struct, items: list[tuple]) -> Writer:
        """``len(items)`` as u32, then each item packed with ``fmt``."""
        self._parts.append(struct.pack(">I", len(items)))
        pack = fmt.pack
        self._parts.extend(pack(*item) for item in items)
        return self

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class Reader:
    """Strict body parser: every read checks bounds; :meth:`done` refuses trailing bytes."""

    def __init__(self, data: bytes | memoryview, what: str) -> None:
        self._mv = memoryview(data)
        self._pos = 0
        self._what = what

    def _fail(self, reason: str) -> MessageError:
        return MessageError(f"{self._what}: {reason}")

    def _take(self, n: int) -> memoryview:
        if n < 0 or self._pos + n > len(self._mv):
            raise self._fail(f"truncated body (need {n} bytes at offset {self._pos}, have {len(self._mv) - self._pos})")
        out = self._mv[self._pos : self._pos + n]
        self._pos += n
        return out

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return struct.unpack(">I", self._take(4))[0]

    def raw(self, n: int) -> bytes:
        return bytes(self._take(n))

    def view(self, n: int) -> memoryview:
        """The next ``n`` bytes without a copy (read-only when the message is ``bytes``)."""
        return self._take(n)

    def u32_array(self, *, max_len: int) -> np.ndarray:
        n = self.u32()
        if n > max_len:
            raise self._fail(f"array of {n} ids exceeds the limit {max_len}")
        return np.frombuffer(self._take(4 * n), dtype=">u4").astype(np.int64)

    def u64_vector(self, *, max_len: int = 2**31) -> np.ndarray:
        n = self.u32()
        if n > max_len:
            raise self._fail(f"vector of {n} words exceeds the limit {max_len}")
        arr = np.frombuffer(self._take(8 * n), dtype="<u8")
        # zero-copy (read-only) on little-endian hosts: the server adds it into its sum directly
        return arr.view(np.uint64) if arr.dtype == np.dtype(np.uint64) else arr.astype(np.uint64)

    def done(self) -> None:
        if self._pos != len(self._mv):
            raise self._fail(f"{len(self._mv) - self._pos} trailing bytes")


def register(cls: type[M]) -> type[M]:
    """Class decorator: make ``cls`` decodable by :func:`decode` (its ``KIND`` must be unique)."""
    kind = cls.KIND
    if not 1 <= kind <= 255 or (kind in _REGISTRY and _REGISTRY[kind] is not cls):
        raise ValueError(f"message kind {kind} of {cls.__name__} is invalid or already taken by {_REGISTRY.get(kind)}.")
    _REGISTRY[kind] = cls
    return cls


@dataclass(frozen=True)
class Message:
    """Base of all wire messages.

    Attributes:
        instance: 16-byte protocol-instance id (random per aggregation).
        round: round number (u32).
        sender: party id (client index, or :data:`SERVER`).
        receiver: party id (client index, or :data:`SERVER`).

    Subclasses set ``KIND`` (unique u8) and ``STAGE`` (the protocol stage code the message belongs
    to) and implement ``_write_body`` and ``_read_body``.
    """

    KIND: ClassVar[int] = 0
    STAGE: ClassVar[int] = 0

    instance: bytes
    round: int
    sender: int
    receiver: int

    def __post_init__(self) -> None:
        if not isinstance(self.instance, bytes) or len(self.instance) != INSTANCE_BYTES:
            raise MessageError(f"{type(self).__name__}: instance must be {INSTANCE_BYTES} bytes; found {self.instance!r}")
        for name in ("round", "sender", "receiver"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v < 2**32:
                raise MessageError(f"{type(self).__name__}: {name} must be an int in [0, 2^32); found {v!r}")

    def _write_body(self, w: Writer) -> None:
        raise NotImplementedError

    @classmethod
    def _read_body(cls: type[M], r: Reader, head: dict) -> M:
        raise NotImplementedError

    def to_bytes(self) -> bytes:
        """Serialise header and body (one join: a body's vector is copied once)."""
        w = Writer()
        self._write_body(w)
        return self._framed(w)

    def _framed(self, w: Writer) -> bytes:
        """The header and the body ``w`` wrote, joined."""
        return self._joined(w._parts, w.nbytes)

    def _joined(self, parts: list[bytes | memoryview], nbytes: int) -> bytes:
        """The header and a body of ``nbytes`` given as ``parts`` (byte buffers), joined: one copy."""
        head = _HEADER.pack(MAGIC, VERSION, self.KIND, self.STAGE, self.instance, self.round, self.sender, self.receiver,
                            nbytes)
        return b"".join([head, *parts])

    def broadcast(self, receivers: list[int]) -> dict[int, bytes]:
        """Wire bytes of this message for each receiver: the body is encoded once."""
        w = Writer()
        self._write_body(w)
        body = w.getvalue()
        out = {}
        for r in receivers:
            out[r] = _HEADER.pack(MAGIC, VERSION, self.KIND, self.STAGE, self.instance, self.round, self.sender, r, len(body)) + body
        return out

    @classmethod
    def from_bytes(cls: type[M], data: bytes) -> M:
        """Parse and validate; the kind in the header must be this class's kind."""
        msg = decode(data)
        if not isinstance(msg, cls):
            raise MessageError(f"{cls.__name__}: wrong message kind {type(msg).__name__} (kind {msg.KIND}, expected {cls.KIND})")
        return msg


def kind_of(data: bytes) -> int:
    """The kind code in a message's header, without parsing its body (for a party routing its own
    messages; a receiver parses with :func:`decode`)."""
    if len(data) < HEADER_BYTES or data[:4] != MAGIC:
        raise MessageError(f"message: no secagg header ({len(data)} bytes)")
    return data[5]


def decode(data: bytes) -> Message:
    """Parse any registered message from its wire form (strict; see the module docstring)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"message: expected bytes; found {type(data).__name__}")
    data = bytes(data)
    if len(data) < HEADER_BYTES:
        raise MessageError(f"message: truncated header ({len(data)} of {HEADER_BYTES} bytes)")
    magic, version, kind, stage, instance, rnd, sender, receiver, body_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MessageError(f"message: bad magic {magic!r} (not a secagg message)")
    if data[7] != 0:  # the reserved byte: one message has exactly one encoding
        raise MessageError(f"message: reserved header byte is {data[7]}, must be 0")
    if version != VERSION:
        raise MessageError(f"message: unsupported version {version} (this build speaks {VERSION})")
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise MessageError(f"message: unknown kind {kind}")
    what = f"{cls.__name__} (stage {cls.STAGE})"
    if stage != cls.STAGE:
        raise MessageError(f"{what}: header stage {stage} does not match the message kind (expected {cls.STAGE})")
    if len(data) - HEADER_BYTES != body_len:
        reason = "truncated" if len(data) - HEADER_BYTES < body_len else "trailing bytes after"
        raise MessageError(f"{what}: {reason} body (header says {body_len} bytes, found {len(data) - HEADER_BYTES})")
    r = Reader(memoryview(data)[HEADER_BYTES:], what)
    msg = cls._read_body(r, {"instance": instance, "round": rnd, "sender": sender, "receiver": receiver})
    r.done()
    return msg
