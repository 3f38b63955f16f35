"""The ``plain`` protocol: clients send their encoded vectors in the clear; the baseline.

Parties: ``n`` clients and one server. Adversary: none tolerated: the server sees every input.
Promise: the server obtains the exact Z_(2^64) sum of the inputs it received (and each input).
It exists to measure the cost of protection against it, and as an attack target.

Stages: client INIT --send--> DONE; server COLLECT --finish--> DONE.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from secagg.errors import AbortError, MessageError
from secagg.messages import INSTANCE_BYTES, SERVER, Message, Reader, Writer, decode, register

__all__ = ["PlainClient", "PlainConfig", "PlainInput", "PlainServer", "PlainStage"]


class PlainStage(enum.IntEnum):
    """Stages of the plain protocol."""

    COLLECT = 0
    DONE = 1


@dataclass(frozen=True)
class PlainConfig:
    """Public parameters: ``n`` clients, vector length ``dim``, instance id and round."""

    n: int
    dim: int
    instance: bytes
    round: int = 0

    def __post_init__(self) -> None:
        if type(self.n) is not int or self.n < 1:
            raise ValueError(f"n must be a positive int; found {self.n!r}.")
        if type(self.dim) is not int or not 0 < self.dim < 2**31:
            raise ValueError(f"dim must be an int in [1, 2^31); found {self.dim!r}.")
        if not isinstance(self.instance, bytes) or len(self.instance) != INSTANCE_BYTES:
            raise ValueError(f"instance must be {INSTANCE_BYTES} bytes; found {self.instance!r}.")


@register
@dataclass(frozen=True)
class PlainInput(Message):
    """Client -> server: the encoded input in the clear."""

    KIND = 1
    STAGE = PlainStage.COLLECT
    x: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))

    def _write_body(self, w: Writer) -> None:
        w.u64_vector(self.x)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> PlainInput:
        return cls(**head, x=r.u64_vector())


class PlainClient:
    """A client of the plain protocol."""

    def __init__(self, cfg: PlainConfig, client_id: int) -> None:
        self.cfg, self.id, self.stage = cfg, client_id, PlainStage.COLLECT

    def send(self, x: np.ndarray) -> PlainInput:
        """Send ``x`` (uint64, length ``dim``) in the clear."""
        if self.stage != PlainStage.COLLECT:
            raise MessageError(f"client {self.id}: send is not allowed in stage {self.stage.name}")
        x = np.asarray(x)
        if x.dtype != np.uint64 or x.shape != (self.cfg.dim,):
            raise ValueError(f"input must be a uint64 vector of length {self.cfg.dim}; found {x.dtype} {x.shape}.")
        self.stage = PlainStage.DONE
        return PlainInput(self.cfg.instance, self.cfg.round, self.id, SERVER, x=x)


class PlainServer:
    """Sums what arrives; rejects malformed, replayed, wrong-round and wrong-length inputs."""

    def __init__(self, cfg: PlainConfig) -> None:
        self.cfg, self.stage = cfg, PlainStage.COLLECT
        self.acc = np.zeros(cfg.dim, dtype=np.uint64)
        self.received: set[int] = set()

    def receive(self, blob: bytes) -> int:
        """Validate one input and add it to the running sum; returns the sender."""
        if self.stage != PlainStage.COLLECT:
            raise MessageError(f"stage {self.stage.name}: the server no longer accepts inputs")
        msg = decode(blob)
        if not isinstance(msg, PlainInput):
            raise MessageError(f"stage COLLECT: unexpected {type(msg).__name__}")
        if msg.instance != self.cfg.instance or msg.round != self.cfg.round:
            raise MessageError(f"stage COLLECT: wrong instance or round {msg.round} (expected {self.cfg.round})")
        if msg.receiver != SERVER or not 0 <= msg.sender < self.cfg.n:
            raise MessageError(f"stage COLLECT: bad sender {msg.sender}")
        if msg.sender in self.received:
            raise MessageError(f"stage COLLECT: replayed message from client {msg.sender} (already received)")
        if msg.x.shape != (self.cfg.dim,):
            raise MessageError(f"stage COLLECT: input of length {msg.x.size}, expected {self.cfg.dim}")
        np.add(self.acc, msg.x, out=self.acc)
        self.received.add(msg.sender)
        return msg.sender

    def finish(self) -> np.ndarray:
        """The sum of the received inputs; aborts if none arrived."""
        if self.stage != PlainStage.COLLECT:
            raise MessageError(f"stage {self.stage.name}: finish called twice")
        self.stage = PlainStage.DONE
        if not self.received:
            raise AbortError("stage COLLECT: no input arrived; aggregation aborted")
        return self.acc.copy()
