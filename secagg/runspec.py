"""What the in-process runner is asked to simulate (:class:`RunSpec`) and what it returns
(:class:`RunResult`), with the dropout stage names.

They live below :mod:`secagg.runner` and :mod:`secagg.chain_sim` so that the chain's adapter can
return a :class:`RunResult` without importing the runner that imports it (no import cycle);
:mod:`secagg.runner` re-exports every name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from secagg.params import DEFAULT_CORRUPT

__all__ = ["INPUT_STAGE", "MASKING_STAGES", "RunResult", "RunSpec"]

INPUT_STAGE = "masked_input"
#: Dropout stage names of ``secagg`` and ``secagg+`` (``plain`` only has :data:`INPUT_STAGE`).
MASKING_STAGES = ("advertise", "share_keys", "masked_input", "consistency", "unmask")


@dataclass(frozen=True)
class RunSpec:
    """What to simulate (see the module docstring).

    Attributes:
        k, t: protocol parameters (``None``: the protocol's default or choice).
        dropouts: stage name -> clients that drop before sending that stage's message.
        round: round number.
        dropout: planned dropout fraction that SecAgg+'s ``k``/``t`` are chosen for; ``None``
            plans for the fraction of clients listed in ``dropouts``. It is also every simulated
            client's own ``max_dropout`` (:class:`secagg.bonawitz.ClientPolicy`, SecAgg and
            SecAgg+): no client signs a survivor set missing more than ``ceil(dropout * n)`` of the
            ``n`` clients, so a run whose dropouts (listed, or clients that abort) exceed the plan
            aborts instead of unmasking a sum over fewer clients than the parameters were chosen for.
        corrupt: fraction of clients that may collude with the server (SecAgg+'s choice).
        unsafe_threshold: accept ``t`` at or below half of a client's holders (attack demos).
        min_survivors: every simulated client's own minimum (:class:`secagg.bonawitz.ClientPolicy`;
            the chain's ``min_survivors``): a client takes part only in an aggregation of at least
            this many clients and never helps unmask a sum over fewer.
        shared_work: SecAgg/SecAgg+: the simulated clients verify each signed broadcast and compute
            each pair's agreement once between them (:mod:`secagg.simshare`; the server's work stays
            its own). ``False`` times every client as its own device (``secagg bench aggregation``).
        ring_bits: the chain's ring, 64 (default) or 32 (:func:`secagg.encoding.choose_ring_bits`
            from the public encoding parameters; the other protocols ignore it).
    """

    k: int | None = None
    t: int | None = None
    dropouts: Mapping[str, frozenset[int]] = field(default_factory=dict)
    round: int = 0
    dropout: float | None = None
    corrupt: float = DEFAULT_CORRUPT
    unsafe_threshold: bool = False
    min_survivors: int = 2
    shared_work: bool = True
    ring_bits: int = 64

    def planned_dropout(self, n: int) -> float:
        """``dropout``, or the fraction of the ``n`` clients that ``dropouts`` lists."""
        if self.dropout is not None:
            return self.dropout
        listed: set[int] = set()
        for who in self.dropouts.values():
            listed |= set(who)
        return len(listed) / n

    def dropped_before(self, stage: str) -> frozenset[int]:
        """Clients that have dropped by the time ``stage`` is sent (cumulative)."""
        out: set[int] = set()
        for name, who in self.dropouts.items():
            if name not in MASKING_STAGES:
                raise ValueError(f"unknown dropout stage {name!r}; use one of {MASKING_STAGES}.")
            if MASKING_STAGES.index(name) <= MASKING_STAGES.index(stage):
                out |= set(who)
        return frozenset(out)


@dataclass(frozen=True)
class RunResult:
    """Outcome and costs of one simulated aggregation."""

    protocol: str
    total: np.ndarray | None
    survivors: frozenset[int]
    abort: str | None
    client_s: np.ndarray
    server_s: float
    bytes_sent: np.ndarray
    bytes_server_received: int
    bytes_server_sent: int
    masks_expanded: int = 0
    k: int | None = None
    t: int | None = None
    key_agreements: int = 0
    signatures_verified: int = 0

    @property
    def ok(self) -> bool:
        """True if a sum was produced."""
        return self.total is not None
