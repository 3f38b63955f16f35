"""Privacy events: immutable descriptions of what was released; accountants interpret them.

Each event is a frozen dataclass whose docstring states its math completely; an event's meaning
never changes (a new class is added instead). Noise parameters are *noise multipliers*: the noise
scale divided by the sensitivity of the released quantity under the accountant's neighbouring
relation (add/remove one user for Poisson sampling, replace one user for fixed-size sampling
without replacement and for local DP).

Events serialise to plain JSON-able dicts (:func:`event_to_dict` / :func:`event_from_dict`) so the
privacy ledger can store them; the dict carries the class name and every field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = [
    "Composed",
    "DpEvent",
    "FelTotal",
    "Gaussian",
    "Laplace",
    "NoOp",
    "NonPrivate",
    "ParallelComposed",
    "PoissonSampled",
    "SampledWithoutReplacement",
    "SelfComposed",
    "event_from_dict",
    "event_to_dict",
]


def _positive(name: str, value: float, *, allow_zero: bool = False, allow_inf: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number. Found {type(value).__name__} {value!r}.")
    if math.isnan(value) or (math.isinf(value) and not allow_inf) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}. Found {value}.")


def _count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int. Found {value!r}.")


class DpEvent:
    """Base class of all privacy events."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class NoOp(DpEvent):
    """Nothing private was released (e.g. an over-arch trained only on opt-in users)."""


@dataclass(frozen=True, slots=True)
class NonPrivate(DpEvent):
    """Data derived from private inputs was released without any DP mechanism.

    Epsilon is infinite at every order and for every delta < 1: a plaintext model update, or a
    secure-aggregation sum without noise (secure aggregation hides the individual inputs from
    the server, but the released sum itself carries no differential-privacy guarantee).
    """


@dataclass(frozen=True, slots=True)
class Gaussian(DpEvent):
    """One application of the Gaussian mechanism.

    For a query ``f`` with L2 sensitivity ``Delta`` the mechanism releases ``f(D) + N(0, s^2 I)``;
    ``noise_multiplier = s / Delta``. RDP: ``eps(alpha) = alpha / (2 noise_multiplier^2)``
    (Mironov 2017). The discrete Gaussian with the same parameter on an integer grid with integer
    sensitivity is never worse (Canonne, Kamath, Steinke 2020) and is accounted as this event.
    """

    noise_multiplier: float

    def __post_init__(self) -> None:
        _positive("Gaussian.noise_multiplier", self.noise_multiplier, allow_zero=True)


@dataclass(frozen=True, slots=True)
class Laplace(DpEvent):
    """One application of the Laplace mechanism.

    For a query with L1 sensitivity ``Delta`` the mechanism releases ``f(D) + Lap(b)^d``;
    ``noise_multiplier = b / Delta``. Pure ``eps0 = 1 / noise_multiplier``; RDP (Mironov 2017,
    exact): ``eps(alpha) = log(alpha/(2alpha-1) e^{(alpha-1)/m} + (alpha-1)/(2alpha-1) e^{-alpha/m})
    / (alpha-1)`` with ``m = noise_multiplier``.
    """

    noise_multiplier: float

    def __post_init__(self) -> None:
        _positive("Laplace.noise_multiplier", self.noise_multiplier)

    @classmethod
    def from_epsilon(cls, epsilon0: float) -> "Laplace":
        """The Laplace event that is ``epsilon0``-DP (noise multiplier ``1/epsilon0``)."""
        _positive("epsilon0", epsilon0)
        return cls(1.0 / epsilon0)

    @property
    def epsilon0(self) -> float:
        """The pure-DP epsilon of one application."""
        return 1.0 / self.noise_multiplier


@dataclass(frozen=True, slots=True)
class PoissonSampled(DpEvent):
    """``event`` applied to a Poisson subsample: each user is included independently w.p. ``q``.

    Neighbouring relation: add/remove one user. For a Gaussian inner event this is the Sampled
    Gaussian Mechanism (Mironov, Talwar, Zhang 2019), accounted exactly at every order.
    """

    sampling_probability: float
    event: DpEvent

    def __post_init__(self) -> None:
        q = self.sampling_probability
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 1:
            raise ValueError(f"sampling_probability must be in [0, 1]. Found {q!r}.")
        if not isinstance(self.event, DpEvent):
            raise TypeError(f"PoissonSampled.event must be a DpEvent. Found {type(self.event).__name__}.")


@dataclass(frozen=True, slots=True)
class SampledWithoutReplacement(DpEvent):
    """``event`` applied to a uniformly random subset of exactly ``sample_size`` of
    ``source_dataset_size`` users (fixed-size sampling without replacement).

    Neighbouring relation: replace one user (the dataset size is public). Accounted by
    delegating to dp-accounting's bound (Wang, Balle, Kasiviswanathan 2019).
    """

    source_dataset_size: int
    sample_size: int
    event: DpEvent

    def __post_init__(self) -> None:
        _count("source_dataset_size", self.source_dataset_size)
        _count("sample_size", self.sample_size)
        if self.source_dataset_size < 1 or self.sample_size > self.source_dataset_size:
            raise ValueError(
                "need 1 <= source_dataset_size and sample_size <= source_dataset_size. "
                f"Found {self.sample_size} of {self.source_dataset_size}."
            )
        if not isinstance(self.event, DpEvent):
            raise TypeError("SampledWithoutReplacement.event must be a DpEvent.")


@dataclass(frozen=True, slots=True)
class SelfComposed(DpEvent):
    """``event`` applied ``count`` times to the same users (sequential composition).

    RDP: ``count * eps_event(alpha)`` at every order.
    """

    event: DpEvent
    count: int

    def __post_init__(self) -> None:
        _count("SelfComposed.count", self.count)
        if not isinstance(self.event, DpEvent):
            raise TypeError("SelfComposed.event must be a DpEvent.")


@dataclass(frozen=True, slots=True)
class Composed(DpEvent):
    """Every event in ``events`` applied to the same users (sequential composition).

    RDP: ``sum_i eps_i(alpha)`` (FEL Theorem 1).
    """

    events: tuple[DpEvent, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        for e in self.events:
            if not isinstance(e, DpEvent):
                raise TypeError(f"Composed.events must be DpEvents. Found {type(e).__name__}.")


@dataclass(frozen=True, slots=True)
class ParallelComposed(DpEvent):
    """Each event in ``events`` applied to a *disjoint* cohort of users (parallel composition).

    A user belongs to at most one cohort, so only one event touches them. RDP:
    ``max_i eps_i(alpha)`` per order (FEL Theorem 2); PLD: the worst cohort. The promise holds only
    if the cohorts really are disjoint (e.g. clusters from public features); the caller asserts
    that by using this event.
    """

    events: tuple[DpEvent, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        if not self.events:
            raise ValueError("ParallelComposed needs at least one cohort event. Found none.")
        for e in self.events:
            if not isinstance(e, DpEvent):
                raise TypeError(f"ParallelComposed.events must be DpEvents. Found {type(e).__name__}.")


OverArchUsers = Literal["same", "disjoint", "opt_in"]


@dataclass(frozen=True, slots=True)
class FelTotal(DpEvent):
    """FEL's total cost (FEL section 3.2): leaf models on disjoint clusters, then the over-arch.

    ``eps_leaf(alpha) = max_c eps_c(alpha)`` (parallel over clusters). With the over-arch cost
    ``eps_oa``: ``over_arch_users="same"`` gives ``eps_leaf + eps_oa`` (sequential);
    ``"disjoint"`` gives ``max(eps_leaf, eps_oa)`` (parallel); ``"opt_in"`` gives ``eps_leaf``
    (opt-in users' data is not protected, so ``over_arch`` must be ``None`` or is ignored).
    """

    leaves: tuple[DpEvent, ...]
    over_arch: DpEvent | None = None
    over_arch_users: OverArchUsers = "opt_in"

    def __post_init__(self) -> None:
        object.__setattr__(self, "leaves", tuple(self.leaves))
        if not self.leaves:
            raise ValueError("FelTotal needs at least one leaf event. Found none.")
        if self.over_arch_users not in ("same", "disjoint", "opt_in"):
            raise ValueError(
                f"over_arch_users must be 'same', 'disjoint' or 'opt_in'. Found {self.over_arch_users!r}."
            )
        if self.over_arch is None and self.over_arch_users != "opt_in":
            raise ValueError(f"over_arch_users={self.over_arch_users!r} needs an over_arch event.")

    def expand(self) -> DpEvent:
        """The equivalent event built from :class:`Composed` and :class:`ParallelComposed`."""
        leaf = ParallelComposed(self.leaves)
        if self.over_arch_users == "opt_in" or self.over_arch is None:
            return leaf
        if self.over_arch_users == "same":
            return Composed((leaf, self.over_arch))
        return ParallelComposed((*self.leaves, self.over_arch))


_CLASSES: dict[str, type[DpEvent]] = {
    c.__name__: c
    for c in (NoOp, NonPrivate, Gaussian, Laplace, PoissonSampled, SampledWithoutReplacement, SelfComposed,
              Composed, ParallelComposed, FelTotal)
}


def event_to_dict(event: DpEvent) -> dict[str, Any]:
    """A JSON-able dict ``{"type": ClassName, field: value, ...}`` (nested events recursively)."""
    if type(event).__name__ not in _CLASSES:
        raise TypeError(f"not a dp event: {type(event).__name__}")
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in fields(event):  # type: ignore[arg-type]
        v = getattr(event, f.name)
        if isinstance(v, DpEvent):
            v = event_to_dict(v)
        elif isinstance(v, tuple):
            v = [event_to_dict(e) for e in v]
        out[f.name] = v
    return out


def event_from_dict(data: dict[str, Any]) -> DpEvent:
    """Inverse of :func:`event_to_dict`; rejects unknown types and fields."""
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"an event dict needs a 'type' key. Found {data!r}.")
    cls = _CLASSES.get(data["type"])
    if cls is None:
        raise ValueError(f"unknown event type {data['type']!r}; known: {sorted(_CLASSES)}.")
    kwargs: dict[str, Any] = {}
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    extra = set(data) - names - {"type"}
    if extra:
        raise ValueError(f"unknown fields {sorted(extra)} for event {data['type']}.")
    for name in names:
        if name not in data:
            continue
        v = data[name]
        if isinstance(v, dict) and "type" in v:
            v = event_from_dict(v)
        elif isinstance(v, list):
            v = tuple(event_from_dict(e) for e in v)
        kwargs[name] = v
    return cls(**kwargs)
