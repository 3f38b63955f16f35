"""Accountants: interpret :mod:`dp.events` into (epsilon, delta) guarantees.

* :class:`RdpAccountant` - our own RDP accountant over :mod:`dp.rdp` (exact sampled Gaussian at
  integer and fractional orders, exact Laplace, parallel composition as a per-order max).
* :class:`PldAccountant` - privacy-loss-distribution accounting delegated to Google's
  dp-accounting (pessimistic discretisation, so still an upper bound); parallel composition
  over disjoint cohorts is the worst cohort path.
* :func:`pure_epsilon` - basic composition of pure-DP events (Laplace; amplified by sampling).
* :func:`best_epsilon` - runs all that apply and reports the smallest epsilon with the name of the
  accountant that gave it, so the framework never prints a looser bound than it can compute.

Neighbouring relations: ``"add_remove"`` (one user added or removed; Poisson sampling) and
``"replace_one"`` (one user's data replaced; fixed-size sampling without replacement, local DP).
An accountant refuses events whose sampling does not match its relation.

Every accountant dry-runs an event (computes its full contribution) before changing state:
an unsupported nested event raises :class:`~dp.errors.UnsupportedEventError` naming it and the
accountant is left unchanged.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np

from dp.errors import UnsupportedEventError
from dp.events import (
    Composed,
    DpEvent,
    FelTotal,
    Gaussian,
    Laplace,
    NoOp,
    NonPrivate,
    ParallelComposed,
    PoissonSampled,
    SampledWithoutReplacement,
    SelfComposed,
)
from dp.rdp import (
    default_orders,
    delta_from_rdp,
    epsilon_from_rdp,
    rdp_gaussian,
    rdp_laplace,
    rdp_sampled_gaussian,
)

__all__ = [
    "NeighboringRelation",
    "PldAccountant",
    "PrivacyReport",
    "RdpAccountant",
    "best_epsilon",
    "pure_epsilon",
]

NeighboringRelation = Literal["add_remove", "replace_one"]
_MAX_PATHS = 256


def _check_relation(rel: str) -> None:
    if rel not in ("add_remove", "replace_one"):
        raise ValueError(f"neighboring_relation must be 'add_remove' or 'replace_one'. Found {rel!r}.")


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative int. Found {count!r}.")


class RdpAccountant:
    """Renyi-DP accountant.

    Args:
        orders: RDP orders (> 1); default :func:`dp.rdp.default_orders` (345 orders, 1.1..1024).
        neighboring_relation: ``"add_remove"`` (default) or ``"replace_one"``.

    Example:
        >>> from dp.events import Gaussian, PoissonSampled, SelfComposed
        >>> acc = RdpAccountant().compose(SelfComposed(PoissonSampled(0.01, Gaussian(1.1)), 1000))
        >>> round(acc.get_epsilon(1e-5), 2)
        1.71
    """

    def __init__(self, orders: object = None, *, neighboring_relation: NeighboringRelation = "add_remove") -> None:
        _check_relation(neighboring_relation)
        self._orders = default_orders() if orders is None else np.atleast_1d(np.asarray(orders, dtype=np.float64))
        if self._orders.ndim != 1 or self._orders.size == 0 or np.any(~(self._orders > 1)):
            raise ValueError(f"orders must be a non-empty list of numbers > 1. Found {orders!r}.")
        self._relation = neighboring_relation
        self._rdp = np.zeros(self._orders.shape)

    @property
    def orders(self) -> np.ndarray:
        """The RDP orders (a copy)."""
        return self._orders.copy()

    @property
    def rdp(self) -> np.ndarray:
        """The accumulated RDP curve (a copy)."""
        return self._rdp.copy()

    @property
    def neighboring_relation(self) -> str:
        """The neighbouring relation the guarantees refer to."""
        return self._relation

    def rdp_of(self, event: DpEvent) -> np.ndarray:
        """RDP curve of ``event`` at this accountant's orders (does not change state)."""
        o = self._orders
        if isinstance(event, NoOp):
            return np.zeros(o.shape)
        if isinstance(event, NonPrivate):
            return np.full(o.shape, np.inf)
        if isinstance(event, Gaussian):
            return rdp_gaussian(noise_multiplier=event.noise_multiplier, orders=o)
        if isinstance(event, Laplace):
            return rdp_laplace(noise_multiplier=event.noise_multiplier, orders=o)
        if isinstance(event, PoissonSampled):
            if self._relation != "add_remove":
                raise UnsupportedEventError(
                    f"PoissonSampled needs neighboring_relation='add_remove'; this accountant uses {self._relation!r}."
                )
            if event.sampling_probability == 0:
                return np.zeros(o.shape)
            if isinstance(event.event, Gaussian):
                return rdp_sampled_gaussian(
                    q=event.sampling_probability, noise_multiplier=event.event.noise_multiplier, orders=o
                )
            if event.sampling_probability == 1:
                return self.rdp_of(event.event)
            raise UnsupportedEventError(
                f"PoissonSampled RDP is implemented for a Gaussian inner event only. Found {event.event!r}."
            )
        if isinstance(event, SampledWithoutReplacement):
            return self._wor(event)
        if isinstance(event, SelfComposed):
            inner = self.rdp_of(event.event)
            return inner * event.count if event.count else np.zeros(o.shape)
        if isinstance(event, Composed):
            total = np.zeros(o.shape)
            for e in event.events:
                total = total + self.rdp_of(e)
            return total
        if isinstance(event, ParallelComposed):
            return np.max(np.stack([self.rdp_of(e) for e in event.events]), axis=0)
        if isinstance(event, FelTotal):
            return self.rdp_of(event.expand())
        raise UnsupportedEventError(f"RdpAccountant does not support {type(event).__name__}: {event!r}.")

    def _wor(self, event: SampledWithoutReplacement) -> np.ndarray:
        if self._relation != "replace_one":
            raise UnsupportedEventError(
                "SampledWithoutReplacement is accounted under neighboring_relation='replace_one'; "
                f"this accountant uses {self._relation!r}."
            )
        if not isinstance(event.event, Gaussian):
            raise UnsupportedEventError(f"SampledWithoutReplacement needs a Gaussian inner event. Found {event.event!r}.")
        import dp_accounting  # delegated: Wang, Balle, Kasiviswanathan 2019 bound

        acc = dp_accounting.rdp.RdpAccountant(
            orders=[float(x) for x in self._orders],
            neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
        )
        acc.compose(
            dp_accounting.SampledWithoutReplacementDpEvent(
                event.source_dataset_size, event.sample_size, dp_accounting.GaussianDpEvent(event.event.noise_multiplier)
            )
        )
        out = np.asarray(acc.rdp, dtype=np.float64)
        return np.where(np.isnan(out), np.inf, out)

    def compose(self, event: DpEvent, count: int = 1) -> "RdpAccountant":
        """Add ``count`` applications of ``event`` (dry-run first; state unchanged on error)."""
        _check_count(count)
        curve = self.rdp_of(event)
        if count:
            self._rdp = self._rdp + curve * count
        return self

    def get_epsilon_and_order(self, delta: float, *, warn: bool = True) -> tuple[float, float]:
        """``(epsilon, optimal order)`` for ``delta`` (Balle et al. 2020 conversion)."""
        return epsilon_from_rdp(orders=self._orders, rdp=self._rdp, delta=delta, warn=warn)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon for ``delta``."""
        return self.get_epsilon_and_order(delta)[0]

    def get_delta(self, epsilon: float) -> float:
        """Delta for ``epsilon`` (inverse conversion)."""
        return delta_from_rdp(orders=self._orders, rdp=self._rdp, epsilon=epsilon)[0]


def pure_epsilon(event: DpEvent) -> float:
    """Pure-DP epsilon of ``event`` by basic composition (inf if any part is not pure DP).

    Laplace: ``1/b``; sampling with rate ``p`` (Poisson, or ``m/n`` without replacement):
    ``log(1 + p (e^eps - 1))``; sequential: sum; parallel: max.
    """
    if isinstance(event, NoOp):
        return 0.0
    if isinstance(event, NonPrivate):
        return math.inf
    if isinstance(event, Laplace):
        return event.epsilon0
    if isinstance(event, Gaussian):
        return math.inf
    if isinstance(event, (PoissonSampled, SampledWithoutReplacement)):
        p = (
            event.sampling_probability
            if isinstance(event, PoissonSampled)
            else event.sample_size / event.source_dataset_size
        )
        inner = pure_epsilon(event.event)
        if p == 0:
            return 0.0
        return inner if math.isinf(inner) else math.log1p(p * math.expm1(inner))
    if isinstance(event, SelfComposed):
        return event.count * pure_epsilon(event.event) if event.count else 0.0
    if isinstance(event, Composed):
        return float(sum(pure_epsilon(e) for e in event.events))
    if isinstance(event, ParallelComposed):
        return max(pure_epsilon(e) for e in event.events)
    if isinstance(event, FelTotal):
        return pure_epsilon(event.expand())
    raise UnsupportedEventError(f"pure_epsilon does not support {type(event).__name__}.")


def _to_dpa_paths(event: DpEvent) -> list:
    """dp-accounting events, one per cohort path (parallel composition = alternatives)."""
    import dp_accounting as dpa

    if isinstance(event, NoOp):
        return [dpa.NoOpDpEvent()]
    if isinstance(event, NonPrivate):
        return [dpa.NonPrivateDpEvent()]
    if isinstance(event, Gaussian):
        if event.noise_multiplier == 0:
            return [dpa.NonPrivateDpEvent()]
        return [dpa.GaussianDpEvent(event.noise_multiplier)]
    if isinstance(event, Laplace):
        return [dpa.LaplaceDpEvent(event.noise_multiplier)]
    if isinstance(event, PoissonSampled):
        return [dpa.PoissonSampledDpEvent(event.sampling_probability, p) for p in _to_dpa_paths(event.event)]
    if isinstance(event, SampledWithoutReplacement):
        return [
            dpa.SampledWithoutReplacementDpEvent(event.source_dataset_size, event.sample_size, p)
            for p in _to_dpa_paths(event.event)
        ]
    if isinstance(event, SelfComposed):
        return [dpa.SelfComposedDpEvent(p, event.count) for p in _to_dpa_paths(event.event)]
    if isinstance(event, Composed):
        paths: list[list] = [[]]
        for e in event.events:
            sub = _to_dpa_paths(e)
            paths = [p + [s] for p in paths for s in sub]
            if len(paths) > _MAX_PATHS:
                raise UnsupportedEventError(f"more than {_MAX_PATHS} cohort paths; PLD skipped.")
        return [dpa.ComposedDpEvent(p) for p in paths]
    if isinstance(event, ParallelComposed):
        out = [p for e in event.events for p in _to_dpa_paths(e)]
        if len(out) > _MAX_PATHS:
            raise UnsupportedEventError(f"more than {_MAX_PATHS} cohort paths; PLD skipped.")
        return out
    if isinstance(event, FelTotal):
        return _to_dpa_paths(event.expand())
    raise UnsupportedEventError(f"PldAccountant does not support {type(event).__name__}.")


def _has_sampling(event: DpEvent) -> bool:
    if isinstance(event, (PoissonSampled, SampledWithoutReplacement)):
        return True
    if isinstance(event, SelfComposed):
        return _has_sampling(event.event)
    if isinstance(event, (Composed, ParallelComposed)):
        return any(_has_sampling(e) for e in event.events)
    if isinstance(event, FelTotal):
        return _has_sampling(event.expand())
    return False


def _max_laplace_epsilon(event: DpEvent) -> float:
    """The largest per-release epsilon of any Laplace event inside ``event`` (0 if none)."""
    if isinstance(event, Laplace):
        return event.epsilon0
    if isinstance(event, (PoissonSampled, SampledWithoutReplacement, SelfComposed)):
        return _max_laplace_epsilon(event.event)
    if isinstance(event, (Composed, ParallelComposed)):
        return max((_max_laplace_epsilon(e) for e in event.events), default=0.0)
    if isinstance(event, FelTotal):
        return _max_laplace_epsilon(event.expand())
    return 0.0


#: The discretisation interval never falls below this fraction of the largest Laplace epsilon0.
_RELATIVE_INTERVAL = 1e-5


class PldAccountant:
    """PLD accountant delegating to dp-accounting's ``PLDAccountant``.

    Parallel composition over disjoint cohorts is evaluated path by path: one PLD per choice of
    cohort in every :class:`ParallelComposed` (cohort assignment fixed across the composition), and
    the worst path is reported.

    The privacy-loss grid has ``epsilon0 / interval`` points for a Laplace event, so at large
    epsilon0 a fixed interval costs without bound (about a minute for two releases at
    epsilon0 = 1000, which then reported inf). The interval used is therefore
    ``max(value_discretization_interval, 1e-5 * largest Laplace epsilon0)``: unchanged up to
    epsilon0 = 10, and relative beyond. The discretisation is pessimistic either way, so the result
    stays an upper bound (looser by at most about ``count * interval``).

    Args:
        neighboring_relation: ``"add_remove"`` or ``"replace_one"``.
        value_discretization_interval: dp-accounting's discretisation (pessimistic rounding).
    """

    def __init__(
        self,
        *,
        neighboring_relation: NeighboringRelation = "add_remove",
        value_discretization_interval: float = 1e-4,
    ) -> None:
        _check_relation(neighboring_relation)
        self._relation = neighboring_relation
        self._interval = value_discretization_interval
        self._events: list[DpEvent] = []

    def compose(self, event: DpEvent, count: int = 1) -> "PldAccountant":
        """Add ``count`` applications of ``event`` (validated before state changes)."""
        _check_count(count)
        _to_dpa_paths(event)  # dry run
        if count:
            self._events.append(event if count == 1 else SelfComposed(event, count))
        return self

    def _accountants(self) -> list:
        import dp_accounting as dpa
        from dp_accounting.pld import pld_privacy_accountant

        # Without sampling the relation only enters through the sensitivity, which the noise
        # multiplier already contains, so the add/remove PLD of the same multiplier is exact.
        sampled = any(_has_sampling(e) for e in self._events)
        rel = (
            dpa.NeighboringRelation.REPLACE_ONE
            if self._relation == "replace_one" and sampled
            else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        )
        out = []
        total = Composed(tuple(self._events))
        interval = max(self._interval, _RELATIVE_INTERVAL * _max_laplace_epsilon(total))
        for path in _to_dpa_paths(total):
            acc = pld_privacy_accountant.PLDAccountant(rel, value_discretization_interval=interval)
            if not acc.supports(path):
                raise UnsupportedEventError(f"dp-accounting's PLD does not support {path!r}.")
            acc.compose(path)
            out.append(acc)
        return out

    def get_epsilon(self, delta: float) -> float:
        """Epsilon for ``delta``: the worst cohort path."""
        return max(float(a.get_epsilon(delta)) for a in self._accountants())

    def get_delta(self, epsilon: float) -> float:
        """Delta for ``epsilon``: the worst cohort path."""
        return max(float(a.get_delta(epsilon)) for a in self._accountants())


@dataclass(frozen=True)
class PrivacyReport:
    """The tightest available guarantee and what every accountant said.

    Attributes:
        epsilon: the smallest sound epsilon found.
        delta: the delta it refers to.
        accountant: ``"rdp"``, ``"pld"`` or ``"pure"`` (which one gave ``epsilon``).
        epsilon_rdp: the RDP accountant's epsilon.
        order: the RDP accountant's optimal order.
        epsilon_pld: dp-accounting's PLD epsilon (None if skipped or unsupported).
        epsilon_pure: basic composition of pure DP (inf if not pure).
        neighboring_relation: the relation the guarantee refers to.
        notes: why an accountant was skipped, edge-of-orders warnings.
    """

    epsilon: float
    delta: float
    accountant: str
    epsilon_rdp: float
    order: float
    epsilon_pld: float | None
    epsilon_pure: float
    neighboring_relation: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """JSON-able dict (inf/nan become strings)."""

        def clean(v: object) -> object:
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            return v

        return {
            "epsilon": clean(self.epsilon),
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon_rdp": clean(self.epsilon_rdp),
            "order": clean(self.order),
            "epsilon_pld": clean(self.epsilon_pld) if self.epsilon_pld is not None else None,
            "epsilon_pure": clean(self.epsilon_pure),
            "neighboring_relation": self.neighboring_relation,
            "notes": list(self.notes),
        }


def best_epsilon(
    event: DpEvent,
    delta: float,
    *,
    orders: object = None,
    use_pld: bool = True,
    neighboring_relation: NeighboringRelation = "add_remove",
) -> PrivacyReport:
    """The tightest epsilon of ``event`` at ``delta`` over RDP, PLD and pure-DP accounting.

    Args:
        event: what was released.
        delta: target delta in [0, 1]; 0 asks for pure DP (only pure events give a finite epsilon).
        orders: RDP orders (default :func:`dp.rdp.default_orders`).
        use_pld: also run dp-accounting's PLD accountant (slower; often tighter for few steps).
        neighboring_relation: ``"add_remove"`` or ``"replace_one"``.
    """
    notes: list[str] = []
    rdp_acc = RdpAccountant(orders, neighboring_relation=neighboring_relation).compose(event)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eps_rdp, order = rdp_acc.get_epsilon_and_order(delta)
    notes.extend(str(w.message) for w in caught)
    try:
        eps_pure = pure_epsilon(event)
    except UnsupportedEventError as exc:  # pragma: no cover - same support as RDP
        eps_pure, _ = math.inf, notes.append(str(exc))
    eps_pld: float | None = None
    if use_pld and delta > 0:
        try:
            eps_pld = PldAccountant(neighboring_relation=neighboring_relation).compose(event).get_epsilon(delta)
        except (UnsupportedEventError, ValueError, OverflowError, MemoryError) as exc:
            notes.append(f"PLD skipped: {exc}")
    candidates = [("rdp", eps_rdp), ("pure", eps_pure)]
    if eps_pld is not None and math.isfinite(eps_pld):
        candidates.append(("pld", eps_pld))
    name, eps = min(candidates, key=lambda c: c[1])
    return PrivacyReport(
        epsilon=float(eps),
        delta=float(delta),
        accountant=name,
        epsilon_rdp=float(eps_rdp),
        order=float(order),
        epsilon_pld=eps_pld,
        epsilon_pure=float(eps_pure),
        neighboring_relation=neighboring_relation,
        notes=tuple(notes),
    )
