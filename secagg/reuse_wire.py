"""The wire format of one key setup reused across a round's instances (:mod:`secagg.reuse`).

The setup speaks SecAgg's :class:`~secagg.bonawitz_wire.AdvertiseKeys` and
:class:`~secagg.bonawitz_wire.KeyBroadcast` (signed under their own domain, so a SecAgg advert does
not verify here); each instance speaks :class:`~secagg.bonawitz_wire.MaskedInput`,
:class:`~secagg.bonawitz_wire.SurvivorList`, :class:`~secagg.bonawitz_wire.ConsistencySignature`
and :class:`~secagg.bonawitz_wire.UnmaskRequest` under the instance's own 16-byte id, plus the three
messages below, which carry only the per-instance self-mask shares and, at the unmask, the
per-instance pairwise seeds (never a share of a long-term key). Every record has a fixed size and
every count an explicit limit, as in :mod:`secagg.bonawitz_wire`.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from secagg.bonawitz_wire import COMMIT_BYTES, SEED_BYTES, SHARE_BYTES, _fixed_records
from secagg.channel import OVERHEAD
from secagg.messages import Message, Writer, register

__all__ = ["B_CT_BYTES", "B_SHARE_PT", "REUSE_CLIENT_TRANSITIONS", "REUSE_SERVER_TRANSITIONS", "ForwardedInstanceShares",
           "InstanceShares", "ReuseClientStage", "ReuseStage", "UnmaskReveal"]

#: plaintext of one sealed self-mask share: owner, holder, the share of ``b_u^(i)``
B_SHARE_PT = struct.Struct(f">II{SHARE_BYTES}s")
B_CT_BYTES = B_SHARE_PT.size + OVERHEAD
_REC_BCT = struct.Struct(f">I{B_CT_BYTES}s")
_REC_SHARE = struct.Struct(f">I{SHARE_BYTES}s")
_REC_SEED = struct.Struct(f">I{SEED_BYTES}s")
_LIMIT = 2**24


class ReuseStage(enum.IntEnum):
    """Server stages (= the stage whose client messages it accepts). READY: the setup is done and
    the next instance may start; every instance goes SHARE -> MASKED_INPUT -> CONSISTENCY -> UNMASK
    -> READY. Codes 2-4 equal SecAgg's, so its messages of those stages are reused as they are."""

    ADVERTISE = 0
    SHARE = 1
    MASKED_INPUT = 2
    CONSISTENCY = 3
    UNMASK = 4
    READY = 5


class ReuseClientStage(enum.IntEnum):
    """Client stages: INIT -advertise-> ADVERTISED -setup-> READY, then per instance
    READY -share-> SHARED -mask_input-> MASKED -sign_survivors-> SIGNED -unmask-> READY.
    A client whose instance did not reach its unmask stays where it stopped: it takes no part in
    the setup's later instances."""

    INIT = 0
    ADVERTISED = 1
    READY = 2
    SHARED = 3
    MASKED = 4
    SIGNED = 5


#: client method -> (required stage, stage after it)
REUSE_CLIENT_TRANSITIONS: dict[str, tuple[ReuseClientStage, ReuseClientStage]] = {
    "advertise": (ReuseClientStage.INIT, ReuseClientStage.ADVERTISED),
    "setup": (ReuseClientStage.ADVERTISED, ReuseClientStage.READY),
    "share": (ReuseClientStage.READY, ReuseClientStage.SHARED),
    "mask_input": (ReuseClientStage.SHARED, ReuseClientStage.MASKED),
    "sign_survivors": (ReuseClientStage.MASKED, ReuseClientStage.SIGNED),
    "unmask": (ReuseClientStage.SIGNED, ReuseClientStage.READY),
}
#: server method -> (required stage, stage after it)
REUSE_SERVER_TRANSITIONS: dict[str, tuple[ReuseStage, ReuseStage]] = {
    "broadcast_keys": (ReuseStage.ADVERTISE, ReuseStage.READY),
    "start": (ReuseStage.READY, ReuseStage.SHARE),
    "forward_shares": (ReuseStage.SHARE, ReuseStage.MASKED_INPUT),
    "request_consistency": (ReuseStage.MASKED_INPUT, ReuseStage.CONSISTENCY),
    "request_unmask": (ReuseStage.CONSISTENCY, ReuseStage.UNMASK),
    "finish": (ReuseStage.UNMASK, ReuseStage.READY),
}


@register
@dataclass(frozen=True)
class InstanceShares(Message):
    """Client -> server, per instance: a commitment to the instance's self-mask seed ``b_u^(i)`` and
    one sealed share of it per live neighbour (AES-256-GCM under the setup's channel key, the AAD
    binding the instance id, round, sender and receiver)."""

    KIND = 25
    STAGE = ReuseStage.SHARE
    b_commit: bytes = b""
    shares: tuple[tuple[int, bytes], ...] = ()  # (receiver, ciphertext)

    def _write_body(self, w: Writer) -> None:
        w.raw(self.b_commit).records(_REC_BCT, list(self.shares))

    @classmethod
    def _read_body(cls, r, head: dict) -> InstanceShares:  # noqa: ANN001
        commit = r.raw(COMMIT_BYTES)
        return cls(**head, b_commit=commit, shares=tuple(_fixed_records(r, B_CT_BYTES, _LIMIT)))


@register
@dataclass(frozen=True)
class ForwardedInstanceShares(Message):
    """Server -> client, per instance: the sealed self-mask shares addressed to it, by sender
    (defines the instance's U2 for the client)."""

    KIND = 26
    STAGE = ReuseStage.MASKED_INPUT
    shares: tuple[tuple[int, bytes], ...] = ()  # (sender, ciphertext)

    def _write_body(self, w: Writer) -> None:
        w.records(_REC_BCT, list(self.shares))

    @classmethod
    def _read_body(cls, r, head: dict) -> ForwardedInstanceShares:  # noqa: ANN001
        return cls(**head, shares=tuple(_fixed_records(r, B_CT_BYTES, _LIMIT)))


@register
@dataclass(frozen=True)
class UnmaskReveal(Message):
    """Client -> server, per instance: the share of ``b_v^(i)`` of every neighbour ``v`` in U3 (and its
    own), and its own per-instance pairwise seed ``s_uv^(i)`` with every neighbour in U2 but not U3."""

    KIND = 27
    STAGE = ReuseStage.UNMASK
    b_shares: tuple[tuple[int, bytes], ...] = ()  # (owner, share)
    seeds: tuple[tuple[int, bytes], ...] = ()  # (dropped neighbour, 32-byte per-instance seed)

    def _write_body(self, w: Writer) -> None:
        w.records(_REC_SHARE, list(self.b_shares)).records(_REC_SEED, list(self.seeds))

    @classmethod
    def _read_body(cls, r, head: dict) -> UnmaskReveal:  # noqa: ANN001
        shares = tuple(_fixed_records(r, SHARE_BYTES, _LIMIT))
        return cls(**head, b_shares=shares, seeds=tuple(_fixed_records(r, SEED_BYTES, _LIMIT)))
