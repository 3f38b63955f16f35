"""What every protocol (and baseline) built by the registry provides, and what a round reports.

The interface (docs/architecture.md, "Protocols: the registry and the trainer interface") is one small structural type,
:class:`Trainer`; ``secagg run``, ``--resume``, the privacy report, the attacks and the Flower
adapter use nothing else:

* ``round``: rounds completed so far;
* ``run_round() -> RoundStats``: one federated round (an epoch for centralised baselines);
* ``score(users, items)`` / ``score_all(users)``: what ranking evaluation ranks, as the party
  that ranks would compute it (on-device or server-side; the protocol's docstring says which);
* ``state_dict()`` / ``load_state_dict(state)``: everything needed to continue exactly, as
  nested dicts/lists of ``torch.Tensor``, ``numpy.ndarray`` and JSON values
  (:mod:`protocols.state` stores them as safetensors plus JSON; nothing is ever unpickled);
* ``public_info() -> dict``: what every party, and so every adversary, knows (sizes,
  hyper-parameters, public conventions); attacks get this beside their view;
* ``transport``: the recording transport whose transcript is the source of every view and of
  the cost report (``None`` for centralised baselines, which have no parties).

Rating-prediction protocols (FedMF) also provide ``evaluate(test) -> {"rmse", "mae"}``.

A round's privacy releases travel in :attr:`RoundStats.releases` so that the runner writes them
to the run's ledger *before* it publishes anything from the round (dp/ledger.py's contract).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dp.events import DpEvent

__all__ = ["Release", "RoundStats", "Trainer", "RatingTrainer"]


@dataclass(frozen=True)
class Release:
    """One release of data derived from private inputs, as the privacy ledger records it.

    Attributes:
        event: the mechanism that protected it (:mod:`dp.events`); :class:`dp.events.NonPrivate`
            for an unprotected release (plaintext updates: epsilon is infinite, and the report
            says so).
        who: the releasing party (``"clients"``, ``"client:<u>"``, ``"server"``).
        what: a short description (``"item-row updates"``, ``"leaf 3 aggregate"``).
        cohort: ``None`` composes sequentially with every other release; a label (``"leaf:3"``,
            ``"user:17"``) composes in parallel with other labels (disjoint users).
        params: JSON-able parameters worth keeping (clip, sigma, epsilon per upload, ...).
    """

    event: DpEvent
    who: str
    what: str
    cohort: str | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundStats:
    """What one round reports to the runner.

    Attributes:
        round: the round index (0-based).
        loss: mean training loss over the round's examples.
        clients: clients that took part.
        bytes_per_client: mean bytes sent plus received per participating client.
        seconds: wall seconds per party kind, e.g. ``{"client": mean per client, "server": ...}``.
        extra: further JSON-able numbers the protocol reports (examples, dropouts, ...).
        releases: the round's privacy releases (written to the ledger by the runner).
    """

    round: int
    loss: float
    clients: int = 0
    bytes_per_client: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    releases: tuple[Release, ...] = ()


@runtime_checkable
class Trainer(Protocol):
    """The interface every registered protocol's builder returns (see the module docstring)."""

    round: int
    transport: Any

    def run_round(self) -> RoundStats: ...

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray: ...

    def score_all(self, users: np.ndarray) -> np.ndarray: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def public_info(self) -> dict[str, Any]: ...


@runtime_checkable
class RatingTrainer(Protocol):
    """A rating-prediction protocol (task ``"rating"``): evaluated by RMSE/MAE, not ranking."""

    round: int
    transport: Any

    def run_round(self) -> RoundStats: ...

    def evaluate(self, test: Any) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def public_info(self) -> dict[str, Any]: ...
