"""The wire format of SecAgg/SecAgg+ (:mod:`secagg.bonawitz`): sizes, stages and messages.

Every message is a :class:`secagg.messages.Message` with a fixed header (instance, round,
sender, receiver, stage) and a body of fixed-size records, decoded with explicit limits so that
a malformed, truncated or oversized message raises :class:`~secagg.errors.MessageError` before
anything is allocated for it. The state machines that send and check them are in
:mod:`secagg.bonawitz`; this module only says what crosses the wire.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import numpy as np

from secagg import shamir
from secagg.errors import MessageError
from secagg.keys import KEY_BYTES
from secagg.messages import Message, Reader, Writer, register

__all__ = [
    "CLIENT_TRANSITIONS",
    "COMMIT_BYTES",
    "CT_BYTES",
    "SEED_BYTES",
    "SERVER_TRANSITIONS",
    "SHARE_BYTES",
    "SIG_BYTES",
    "AdvertiseKeys",
    "ClientStage",
    "ConsistencySignature",
    "EncryptedShares",
    "ForwardedShares",
    "KeyBroadcast",
    "MaskedInput",
    "ServerStage",
    "SurvivorList",
    "UnmaskRequest",
    "UnmaskResponse",
]

SEED_BYTES = 32
SIG_BYTES = 64
SHARE_BYTES = shamir.share_size(SEED_BYTES)  # one Shamir share of a 32-byte secret
_SHARE_PT = struct.Struct(f">II{SHARE_BYTES}s{SHARE_BYTES}s")
CT_BYTES = _SHARE_PT.size + 28  # AES-GCM nonce + tag
COMMIT_BYTES = 32
_KIND_B, _KIND_S = 0, 1


class ClientStage(enum.IntEnum):
    """Client states; each client method is allowed in exactly one of them."""

    INIT = 0
    ADVERTISED = 1
    SHARED = 2
    MASKED = 3
    SIGNED = 4
    DONE = 5


class ServerStage(enum.IntEnum):
    """Server states = the stage whose client messages it currently accepts."""

    ADVERTISE = 0
    SHARE_KEYS = 1
    MASKED_INPUT = 2
    CONSISTENCY = 3
    UNMASK = 4
    DONE = 5


#: client method -> (required stage, stage after it)
CLIENT_TRANSITIONS: dict[str, tuple[ClientStage, ClientStage]] = {
    "advertise": (ClientStage.INIT, ClientStage.ADVERTISED),
    "share_keys": (ClientStage.ADVERTISED, ClientStage.SHARED),
    "mask_input": (ClientStage.SHARED, ClientStage.MASKED),
    "sign_survivors": (ClientStage.MASKED, ClientStage.SIGNED),
    "unmask": (ClientStage.SIGNED, ClientStage.DONE),
}
#: server method -> (required stage, stage after it); ``receive`` is allowed in every stage but DONE
SERVER_TRANSITIONS: dict[str, tuple[ServerStage, ServerStage]] = {
    "broadcast_keys": (ServerStage.ADVERTISE, ServerStage.SHARE_KEYS),
    "forward_shares": (ServerStage.SHARE_KEYS, ServerStage.MASKED_INPUT),
    "request_consistency": (ServerStage.MASKED_INPUT, ServerStage.CONSISTENCY),
    "request_unmask": (ServerStage.CONSISTENCY, ServerStage.UNMASK),
    "finish": (ServerStage.UNMASK, ServerStage.DONE),
}


# ----------------------------------------------------------------------------------------------
# messages
# ----------------------------------------------------------------------------------------------
def _fixed_records(r: Reader, size: int, max_count: int) -> list[tuple[int, bytes]]:
    """``count`` then ``count`` records of (u32 id, ``size`` bytes), parsed in one C loop."""
    count = r.u32()
    if count > max_count:
        raise MessageError(f"{r._what}: {count} records exceed the limit {max_count}")
    return list(struct.iter_unpack(f">I{size}s", r.raw(count * (4 + size))))


@register
@dataclass(frozen=True)
class AdvertiseKeys(Message):
    """Client -> server: two X25519 public keys, signed with the client's identity key."""

    KIND = 16
    STAGE = ServerStage.ADVERTISE
    c_pk: bytes = b""
    s_pk: bytes = b""
    sig: bytes = b""

    def _write_body(self, w: Writer) -> None:
        w.raw(self.c_pk).raw(self.s_pk).raw(self.sig)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> AdvertiseKeys:
        return cls(**head, c_pk=r.raw(KEY_BYTES), s_pk=r.raw(KEY_BYTES), sig=r.raw(SIG_BYTES))


_ADVERT_RECORD = 2 * KEY_BYTES + SIG_BYTES
_REC_ADVERT = struct.Struct(f">I{_ADVERT_RECORD}s")
_REC_CT = struct.Struct(f">I{CT_BYTES}s")
_REC_SIG = struct.Struct(f">I{SIG_BYTES}s")
_REC_SHARE = struct.Struct(f">IB{SHARE_BYTES}s")


@register
@dataclass(frozen=True)
class KeyBroadcast(Message):
    """Server -> client: the advertised keys of the client's neighbours in U1 (and its own)."""

    KIND = 17
    STAGE = ServerStage.SHARE_KEYS
    entries: tuple[tuple[int, bytes], ...] = ()  # (client id, c_pk || s_pk || sig)

    def _write_body(self, w: Writer) -> None:
        w.records(_REC_ADVERT, list(self.entries))

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> KeyBroadcast:
        return cls(**head, entries=tuple(_fixed_records(r, _ADVERT_RECORD, 2**20)))


@register
@dataclass(frozen=True)
class EncryptedShares(Message):
    """Client -> server: a commitment to the self-mask seed and one sealed pair of shares per
    neighbour (constant size each). The commitment lets the server refuse a seed rebuilt from a
    wrong share instead of returning a wrong sum."""

    KIND = 18
    STAGE = ServerStage.SHARE_KEYS
    b_commit: bytes = b""
    shares: tuple[tuple[int, bytes], ...] = ()  # (receiver, ciphertext)

    def _write_body(self, w: Writer) -> None:
        w.raw(self.b_commit).records(_REC_CT, list(self.shares))

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> EncryptedShares:
        commit = r.raw(COMMIT_BYTES)
        return cls(**head, b_commit=commit, shares=tuple(_fixed_records(r, CT_BYTES, 2**20)))


@register
@dataclass(frozen=True)
class ForwardedShares(Message):
    """Server -> client: the sealed shares addressed to it, by sender (defines U2 for the client)."""

    KIND = 19
    STAGE = ServerStage.MASKED_INPUT
    shares: tuple[tuple[int, bytes], ...] = ()  # (sender, ciphertext)

    def _write_body(self, w: Writer) -> None:
        w.records(_REC_CT, list(self.shares))

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ForwardedShares:
        return cls(**head, shares=tuple(_fixed_records(r, CT_BYTES, 2**20)))


@register
@dataclass(frozen=True)
class MaskedInput(Message):
    """Client -> server: the masked vector ``y`` (uniform in Z_(2^64)^dim), signed with the
    client's identity key over (instance, round, sender, SHA-256(y)): a vector altered in transit
    is refused instead of being added into the sum."""

    KIND = 20
    STAGE = ServerStage.MASKED_INPUT
    y: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    sig: bytes = bytes(SIG_BYTES)

    def _write_body(self, w: Writer) -> None:
        if len(self.sig) != SIG_BYTES:
            raise ValueError(f"sig must be {SIG_BYTES} bytes; found {len(self.sig)}.")
        w.raw(self.sig).u64_vector(self.y)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> MaskedInput:
        sig = r.raw(SIG_BYTES)
        return cls(**head, sig=sig, y=r.u64_vector())


@register
@dataclass(frozen=True)
class SurvivorList(Message):
    """Server -> client: U3, the clients whose masked input arrived."""

    KIND = 21
    STAGE = ServerStage.CONSISTENCY
    survivors: tuple[int, ...] = ()

    def _write_body(self, w: Writer) -> None:
        w.u32_array(list(self.survivors))

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> SurvivorList:
        return cls(**head, survivors=tuple(int(v) for v in r.u32_array(max_len=2**24)))


@register
@dataclass(frozen=True)
class ConsistencySignature(Message):
    """Client -> server: Ed25519 signature over (instance, round, U3)."""

    KIND = 22
    STAGE = ServerStage.CONSISTENCY
    sig: bytes = b""

    def _write_body(self, w: Writer) -> None:
        w.raw(self.sig)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> ConsistencySignature:
        return cls(**head, sig=r.raw(SIG_BYTES))


@register
@dataclass(frozen=True)
class UnmaskRequest(Message):
    """Server -> client: the consistency signatures of the client's holders."""

    KIND = 23
    STAGE = ServerStage.UNMASK
    signatures: tuple[tuple[int, bytes], ...] = ()

    def _write_body(self, w: Writer) -> None:
        w.records(_REC_SIG, list(self.signatures))

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> UnmaskRequest:
        return cls(**head, signatures=tuple(_fixed_records(r, SIG_BYTES, 2**24)))


@register
@dataclass(frozen=True)
class UnmaskResponse(Message):
    """Client -> server: one share per neighbour in U2 (and its own): ``b`` share or ``s`` share."""

    KIND = 24
    STAGE = ServerStage.UNMASK
    shares: tuple[tuple[int, int, bytes], ...] = ()  # (owner, kind 0=b/1=s, share)

    def _write_body(self, w: Writer) -> None:
        w.records(_REC_SHARE, list(self.shares))

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> UnmaskResponse:
        count = r.u32()
        if count > 2**24:
            raise MessageError(f"{r._what}: {count} shares exceed the limit")
        out = list(struct.iter_unpack(f">IB{SHARE_BYTES}s", r.raw(count * (5 + SHARE_BYTES))))
        if any(kind not in (_KIND_B, _KIND_S) for _, kind, _ in out):
            raise MessageError(f"{r._what}: unknown share kind")
        return cls(**head, shares=tuple(out))
