"""Work that simulated clients in one process repeat on the same public data, done once and shared.

A simulation runs every client of an instance in one process, so it repeats work a real deployment
spreads over devices: each of a client's ``k`` neighbours verifies the same signed key advert and
the same consistency signature, and both ends of a pair compute the same X25519 agreement. Inside
:func:`shared_work` (the runner's simulations, :mod:`secagg.runner`) that work is done once per
process and the result reused:

* an Ed25519 verification is memoised by the exact ``(public key, signature, message)`` triple, so
  any change to any of the three (a forged, replayed or relayed-wrong signature) is a new triple
  and is verified in full; verification is deterministic, so a hit returns exactly what the
  device's own check returns;
* an X25519+HKDF agreement is memoised by the unordered pair of public keys and the ``info``
  label: X25519 is symmetric, so the second end gets exactly the key its own computation would
  give. Only a party that holds one of the two private keys can ask (the lookup runs inside
  :meth:`secagg.keys.KeyPair.agree` on its own key pair), and a peer key is validated by whoever
  computes the pair first: a low-order or malformed key raises and is never stored. The server's
  agreements (rebuilding a dropped client's masks) never read the memo: its cost stays its own.

Outside :func:`shared_work` (a real device, a Flower node, ``secagg bench aggregation``, which
times a device's own cost) nothing is memoised. What a device pays per round is priced by
:mod:`secagg.costmodel`, which counts every verification and agreement as the device's own; the
memo changes the simulation's seconds, never the bound the docs report. The memo holds derived
keys of simulated parties only, lives for one instance and is cleared when the block ends.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["SharedWork", "active", "disabled", "shared_work"]


@dataclass
class SharedWork:
    """The memo of one :func:`shared_work` block, with hit counts (tests and benchmarks read them)."""

    verified: dict[tuple[bytes, bytes, bytes], bool] = field(default_factory=dict)
    agreed: dict[tuple[bytes, bytes, bytes], bytes] = field(default_factory=dict)
    verify_hits: int = 0
    agree_hits: int = 0

    def verify(self, public: bytes, sig: bytes, data: bytes, check: Callable[[], bool]) -> bool:
        key = (bytes(public), bytes(sig), bytes(data))
        hit = self.verified.get(key)
        if hit is not None:
            self.verify_hits += 1
            return hit
        ok = check()
        self.verified[key] = ok
        return ok

    def agree(self, own: bytes, peer: bytes, info: bytes, compute: Callable[[], bytes]) -> bytes:
        a, b = bytes(own), bytes(peer)
        key = (min(a, b), max(a, b), bytes(info))
        hit = self.agreed.get(key)
        if hit is not None:
            self.agree_hits += 1
            return hit
        value = compute()  # validates the peer key; raises before anything is stored
        self.agreed[key] = value
        return value


_ACTIVE: contextvars.ContextVar[SharedWork | None] = contextvars.ContextVar("secagg_shared_work", default=None)
_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("secagg_shared_work_disabled", default=False)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block every :func:`shared_work` is a no-op: each simulated client does all its own
    work (``secagg bench secure --no-shared-work`` times the simulation both ways)."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def active() -> SharedWork | None:
    """The memo of the enclosing :func:`shared_work` block, or ``None``."""
    return _ACTIVE.get()


@contextlib.contextmanager
def shared_work(enabled: bool = True) -> Iterator[SharedWork | None]:
    """Memoise verifications and agreements inside the block (``enabled=False``: a no-op block)."""
    if not enabled or _DISABLED.get():
        yield None
        return
    memo = SharedWork()
    token = _ACTIVE.set(memo)
    try:
        yield memo
    finally:
        _ACTIVE.reset(token)
        memo.verified.clear()
        memo.agreed.clear()
