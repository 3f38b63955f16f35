"""What a client refuses whatever the server asks: the client-enforced invariants of the exchange interface.

Every protocol of exchanges (:mod:`protocols.exchange`) promises that its server learns only sums of
the clients' secure vectors. A server that *follows the script* keeps that promise by construction;
a server that *deviates within the interface* (asks a step twice, shrinks the cohort, rolls a round
back, routes a client into a sum of its own choosing) could otherwise difference two sums and read
one client's vector. The defence must live on the client, in its own state and its operator's
settings, never in a field of a server message. This module is that defence, shared by every
runtime (in process, :func:`protocols.exchange.run_on_devices`, Flower's
:mod:`fedflower.exchange_apps`).

Parties: one client per user (its device), an untrusted server that sends any sequence of
exchanges it likes. The client's **operator** (the node's configuration; in simulation the run's
``[clients]`` section) sets a :class:`DevicePolicy`; the client keeps a :class:`StepGuard` record of
what it has answered (persisted with its device state).

Rules (each refused step raises :class:`RefusedStep`, the runtime drops the client from that
exchange with the reason and nothing is computed or sent):

1. **Rounds only move forward.** A step of a round before the latest round the client answered in
   is refused (a rolled-back round could otherwise be asked again over another cohort).
2. **One answer per secure step per round.** A step answered through secure aggregation is
   answered at most once per round and protocol instance; a second request (over any cohort) is
   refused. Two sums of the same step over cohorts that differ in one client are that client's
   vector.
3. **Once per instance** for steps whose vector is a function of the client's static data only
   (FedFast's item indicator and profile statistics): across rounds they would repeat exactly,
   so they are answered at most once per protocol instance (the protocol lists them in
   ``ONCE_PER_INSTANCE``).
4. **No plaintext where the configuration promises a sum.** A step the client's configuration
   sends only through secure aggregation (``device_requires_secure``), or every plaintext step
   under ``require_secure``, is refused when asked in plaintext.
5. **Minimum sum size** (``min_survivors``): the client takes part only in a secure sum announced
   for at least that many clients and never helps unmask one over fewer survivors
   (:class:`secagg.bonawitz.ClientPolicy`, enforced inside the secure-aggregation protocol).
6. **Local privacy budget** (``ldp_epsilon_budget``): the client counts the epsilon of its own
   local-DP uploads (basic composition) and refuses an upload beyond its operator's budget. A
   step that is a local-DP upload (the trainer's ``device_ldp_epsilon(kind) > 0``) is charged
   when it is admitted, before it is computed (:meth:`StepGuard.spend_ldp`), with the epsilon the
   client's own configuration adds noise for; the record keeps the round of the latest upload
   (:meth:`StepGuard.ldp_round`), so a protocol can refuse a second upload in a round or one
   before its schedule allows (FedCL's ``device_check``). The count is basic composition: ``k``
   uploads of ``epsilon`` are ``k epsilon``, an upper bound on what they leak together.

Protocol-specific rules live in the protocols' client halves and are listed in docs/security.md
(a client computes the slot of its value in a secure vector itself; FedFast's blocks below the
minimum are never summed).

"Protocol instance": the client state that holds the record: the trainer in process (its
checkpoint carries every simulated client's record, :meth:`StepGuard.state_dict`, so ``--resume``
continues the counts), a node's state directory (or, without one, its Flower context) on Flower.
An operator who wipes it starts a new instance (and a new local-DP count). A record is written
before the client's reply leaves, so a crash after answering cannot be used to answer again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from secagg.bonawitz import ClientPolicy
from secagg.params import DEFAULT_DROPOUT

__all__ = ["DevicePolicy", "RefusedStep", "StepGuard", "device_guard", "ldp_counts", "set_device_policy"]


class RefusedStep(ValueError):
    """A client refused a step (the reason names the rule); the runtime drops it from that exchange."""


@dataclass(frozen=True)
class DevicePolicy:
    """A client's own safety settings: its operator's, never a server's.

    Attributes:
        min_survivors: the smallest secure sum the client takes part in (cohort announced and
            survivors unmasked); at least 2 (a sum of one client is its input).
        unsafe_threshold: accept a SecAgg threshold at or below half of the client's holders
            (attack demonstrations only).
        max_dropout: the largest fraction of an aggregation's announced clients the client lets
            drop before it refuses to sign the survivor set (the dropout the deployment's SecAgg+
            parameters were chosen for; in simulation the run's planned dropout).
        require_secure: refuse every plaintext step (a node that only ever sends sums).
        ldp_epsilon_budget: the total local-DP epsilon the client spends on its uploads (basic
            composition over its uploads); ``inf`` (default) counts without the operator's cap (a
            protocol's own configuration may still cap it: FedCL's ``user_budget``; the smaller holds).
    """

    min_survivors: int = 2
    unsafe_threshold: bool = False
    max_dropout: float = DEFAULT_DROPOUT
    require_secure: bool = False
    ldp_epsilon_budget: float = math.inf

    def __post_init__(self) -> None:
        self.secagg()  # validates min_survivors, unsafe_threshold and max_dropout
        if type(self.require_secure) is not bool:
            raise ValueError(f"require_secure must be a bool; found {self.require_secure!r}")
        if not (isinstance(self.ldp_epsilon_budget, int | float) and self.ldp_epsilon_budget > 0
                and not math.isnan(self.ldp_epsilon_budget)):
            raise ValueError(f"ldp_epsilon_budget must be a positive number (inf: no cap); found "
                             f"{self.ldp_epsilon_budget!r}")

    #: node-config key (``flower-supernode --node-config``) -> (field, type)
    NODE_KEYS = {"min-survivors": ("min_survivors", int), "unsafe-threshold": ("unsafe_threshold", bool),
                 "max-dropout": ("max_dropout", float), "require-secagg": ("require_secure", bool),
                 "ldp-epsilon-budget": ("ldp_epsilon_budget", float)}

    @classmethod
    def from_node_config(cls, cfg: Mapping[str, object], *, require_secure: bool = False) -> DevicePolicy:
        """A node's policy from its own configuration (the keys of :attr:`NODE_KEYS`; others are
        ignored, an absent key keeps its default).

        Flower parses ``--node-config "key=value"`` as TOML (``5``, ``true``, ``0.2``); a string
        spelling such a value is accepted too (``require-secagg``, which only adds safety, also as
        ``1``/``0``/``yes``/``no``), and ``inf`` for the budget. Nothing else is guessed: a value of another type is refused in
        words, naming the key. ``require_secure`` (the ClientApp's own setting) can only switch
        plaintext off, never on.
        """
        out: dict[str, object] = {}
        for key, (name, want) in cls.NODE_KEYS.items():
            if key not in cfg:
                continue
            v = cfg[key]
            if isinstance(v, str):
                text = v.strip().lower()
                # booleans spelled true/false; require-secagg (which only ever adds safety) also 1/0/yes/no
                spelled = {"true": True, "false": False}
                if key == "require-secagg":
                    spelled.update({"1": True, "0": False, "yes": True, "no": False})
                try:
                    v = spelled[text] if want is bool else want(text)
                except (KeyError, ValueError):
                    pass
            if not (type(v) is want or (want is float and type(v) is int)):
                raise ValueError(f"node config '{key}' must be {want.__name__}; found {v!r} ({type(v).__name__}). "
                                 f"Set it with flower-supernode --node-config \"{key}=...\"")
            out[name] = float(v) if want is float else v  # type: ignore[arg-type]
        if require_secure:
            out["require_secure"] = True
        try:
            return cls(**out)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"node config: {exc}") from None

    def secagg(self) -> ClientPolicy:
        """The settings the client's secure-aggregation protocol enforces."""
        return ClientPolicy(min_survivors=self.min_survivors, unsafe_threshold=self.unsafe_threshold,
                            max_dropout=self.max_dropout)


_NO_ROUND = -1


@dataclass
class _Record:
    """One client's record: the latest round it answered in, the secure steps it answered in that
    round, the once-per-instance steps it ever answered, the LDP epsilon it spent and the round of
    its latest LDP upload."""

    last_round: int = _NO_ROUND
    this_round: set[str] = field(default_factory=set)
    once: set[str] = field(default_factory=set)
    ldp_spent: float = 0.0
    ldp_round: int = _NO_ROUND


def _pack(kinds: set[str]) -> np.ndarray:
    return np.frombuffer("\n".join(sorted(kinds)).encode(), np.uint8).copy()


def _unpack(a: np.ndarray) -> set[str]:
    a = np.asarray(a)
    if a.dtype != np.uint8 or a.ndim != 1:
        raise ValueError(f"a step guard's record must hold uint8 vectors; found {a.dtype} {a.shape}")
    text = a.tobytes().decode("utf-8")
    return set(text.split("\n")) if text else set()


class StepGuard:
    """The record of what each client answered, and the rules of the module docstring.

    In process one guard plays every client (a record per user); on a device it holds one user's.

    Args:
        policy: the operator's :class:`DevicePolicy`.
        secure_kind: ``kind -> bool``, whether the client's configuration sends the step only
            through secure aggregation (the trainer's ``device_requires_secure``).
        once: the steps answered at most once per protocol instance.
        ldp_cost: ``kind -> epsilon``, the local-DP epsilon one answer of the step spends (the
            trainer's ``device_ldp_epsilon``; 0: not an LDP upload). Such a step is charged when
            it is admitted and refused beyond the budget (rule 6).
    """

    def __init__(self, policy: DevicePolicy, *, secure_kind: Callable[[str], bool],
                 once: frozenset[str] = frozenset(), ldp_cost: Callable[[str], float] | None = None) -> None:
        self.policy = policy
        self._secure_kind = secure_kind
        self._once = frozenset(once)
        self._ldp_cost = ldp_cost
        self._records: dict[int, _Record] = {}

    def _cost(self, kind: str) -> float:
        cost = 0.0 if self._ldp_cost is None else self._ldp_cost(kind)
        if not (isinstance(cost, int | float) and cost >= 0 and math.isfinite(cost)):
            raise RefusedStep(f"step {kind!r}: its local-DP epsilon must be a finite number >= 0; found {cost!r}")
        return float(cost)

    def _record(self, user: int) -> _Record:
        return self._records.setdefault(int(user), _Record())

    def check(self, user: int, kind: str, round_: int, *, secure: bool) -> None:
        """Raise :class:`RefusedStep` if ``user`` must refuse step ``kind`` of ``round_`` (no state change)."""
        if type(round_) is not int and not isinstance(round_, np.integer) or int(round_) < 0:
            raise RefusedStep(f"step {kind!r}: round {round_!r} is not a round number")
        rec = self._records.get(int(user), _Record())
        t = int(round_)
        if t < rec.last_round:
            raise RefusedStep(f"step {kind!r} of round {t}: this client already answered in round {rec.last_round}; "
                              "a rolled-back round is refused")
        if not secure and (self.policy.require_secure or self._secure_kind(kind)):
            why = "node setting require_secure" if self.policy.require_secure else \
                "its configuration sends it only through secure aggregation"
            raise RefusedStep(f"step {kind!r} asked in plaintext: refused ({why})")
        if kind in self._once and kind in rec.once:
            raise RefusedStep(f"step {kind!r} is answered once per protocol instance; this client already did")
        if secure and t == rec.last_round and kind in rec.this_round:
            raise RefusedStep(f"secure step {kind!r} of round {t} was already answered; a second sum of the same "
                              "step is refused")
        cost = self._cost(kind)
        if cost:
            self._check_ldp(rec, cost)

    def admit(self, user: int, kind: str, round_: int, *, secure: bool) -> None:
        """:meth:`check`, then record the answer (before the step runs, so it cannot be answered twice);
        a local-DP step is charged here (:meth:`spend_ldp`), before it is computed."""
        self.check(user, kind, round_, secure=secure)
        cost = self._cost(kind)
        rec = self._record(user)
        t = int(round_)
        if cost:
            self.spend_ldp(user, cost, round_=t)
        if t > rec.last_round:
            rec.last_round, rec.this_round = t, set()
        if secure:
            rec.this_round.add(kind)
        if kind in self._once:
            rec.once.add(kind)

    def _check_ldp(self, rec: _Record, epsilon: float) -> None:
        if not (epsilon > 0 and math.isfinite(epsilon)):
            raise RefusedStep(f"a local-DP upload needs a finite epsilon > 0; found {epsilon!r}")
        budget = self.policy.ldp_epsilon_budget
        if rec.ldp_spent + epsilon > budget * (1 + 1e-12):
            raise RefusedStep(f"a local-DP upload of epsilon {epsilon:g} would bring this client's spent epsilon "
                              f"from {rec.ldp_spent:g} over its operator's budget {budget:g}; refused")

    def spend_ldp(self, user: int, epsilon: float, *, round_: int | None = None) -> None:
        """Count a local-DP upload of ``epsilon`` (in ``round_``, if given: :meth:`ldp_round`); refuse
        it (no state change) beyond the budget."""
        self._check_ldp(self._records.get(int(user), _Record()), epsilon)
        rec = self._record(user)
        rec.ldp_spent += epsilon
        if round_ is not None:
            rec.ldp_round = max(rec.ldp_round, int(round_))

    def ldp_spent(self, user: int) -> float:
        """The local-DP epsilon ``user`` has spent on its uploads (basic composition)."""
        return self._records.get(int(user), _Record()).ldp_spent

    def ldp_round(self, user: int) -> int:
        """The round of ``user``'s latest local-DP upload (-1: none)."""
        return self._records.get(int(user), _Record()).ldp_round

    def users(self) -> list[int]:
        """The users this guard keeps a record of (in process: every client that was ever asked)."""
        return sorted(self._records)

    # -- persistence (a device's record travels with its state: arrays only) --------------------------
    _KEYS = frozenset({"last_round", "this_round", "once", "ldp_spent", "ldp_round"})

    def state(self, user: int) -> dict[str, np.ndarray]:
        """``user``'s record as arrays (kept with the device state, never sent)."""
        rec = self._records.get(int(user), _Record())
        return {"last_round": np.array(rec.last_round, np.int64), "this_round": _pack(rec.this_round),
                "once": _pack(rec.once), "ldp_spent": np.array(rec.ldp_spent, np.float64),
                "ldp_round": np.array(rec.ldp_round, np.int64)}

    def load_state(self, user: int, state: Mapping[str, np.ndarray]) -> None:
        """Restore ``user``'s record from :meth:`state`'s arrays (checked). A record written before
        ``ldp_round`` was kept (no such key) has no upload round (-1)."""
        if set(state) not in (self._KEYS, self._KEYS - {"ldp_round"}):
            raise ValueError(f"a step guard's record holds {sorted(self._KEYS)}; found {sorted(state)}")
        last = _round(state["last_round"], "last_round")
        at = _round(state["ldp_round"], "ldp_round") if "ldp_round" in state else _NO_ROUND
        self._records[int(user)] = _Record(last, _unpack(state["this_round"]), _unpack(state["once"]),
                                           _spent(state["ldp_spent"]), at)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every user's record as a few arrays (one row per user, the step names of all users packed
        into one byte array with offsets): what a trainer that plays every client checkpoints."""
        users = self.users()
        recs = [self._records[u] for u in users]
        out = {"users": np.array(users, np.int64),
               "last_round": np.array([r.last_round for r in recs], np.int64),
               "ldp_spent": np.array([r.ldp_spent for r in recs], np.float64),
               "ldp_round": np.array([r.ldp_round for r in recs], np.int64)}
        for name in ("this_round", "once"):
            packs = [_pack(getattr(r, name)) for r in recs]
            out[name] = np.concatenate(packs) if packs else np.zeros(0, np.uint8)
            out[f"{name}_at"] = np.concatenate([[0], np.cumsum([len(p) for p in packs], dtype=np.int64)]).astype(np.int64)
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace every record by :meth:`state_dict`'s (checked: a malformed one raises ``ValueError``
        and changes nothing)."""
        keys = {"users", "last_round", "ldp_spent", "ldp_round", "this_round", "this_round_at", "once", "once_at"}
        if set(state) != keys:
            raise ValueError(f"a step guard's records hold {sorted(keys)}; found {sorted(state)}")
        users = np.asarray(state["users"])
        n = len(users)
        if users.ndim != 1 or users.dtype.kind not in "iu" or len(np.unique(users)) != n or (n and users.min() < 0):
            raise ValueError(f"a step guard's users must be distinct integers >= 0; found {users.dtype} {users.shape}")
        for name in ("last_round", "ldp_spent", "ldp_round"):
            if np.shape(state[name]) != (n,):
                raise ValueError(f"a step guard's {name} must hold one value per user ({n}); found {np.shape(state[name])}")
        sets = {}
        for name in ("this_round", "once"):
            blob, at = np.asarray(state[name]), np.asarray(state[f"{name}_at"])
            if at.shape != (n + 1,) or at.dtype.kind not in "iu" or (n and (at[0] != 0 or at[-1] != len(blob)
                                                                          or (np.diff(at) < 0).any())):
                raise ValueError(f"a step guard's {name}_at must be {n + 1} increasing offsets into {name}")
            sets[name] = [_unpack(blob[at[i]:at[i + 1]]) for i in range(n)]
        records = {int(u): _Record(_round(state["last_round"][i], "last_round"), sets["this_round"][i],
                                   sets["once"][i], _spent(state["ldp_spent"][i]),
                                   _round(state["ldp_round"][i], "ldp_round"))
                   for i, u in enumerate(users.tolist())}
        self._records = records


def _round(a: np.ndarray, name: str) -> int:
    a = np.asarray(a)
    if a.shape != () or a.dtype.kind not in "iu" or int(a) < _NO_ROUND:
        raise ValueError(f"a step guard's {name} must be an integer >= {_NO_ROUND}; found {a!r}")
    return int(a)


def _spent(a: np.ndarray) -> float:
    a = np.asarray(a)
    if a.shape != () or a.dtype.kind != "f" or not (float(a) >= 0 and math.isfinite(float(a))):
        raise ValueError(f"a step guard's ldp_spent must be a finite float >= 0; found {a!r}")
    return float(a)


def device_guard(trainer: object) -> StepGuard:
    """The trainer's client-side guard, created on first use from its ``device_policy`` (default
    :class:`DevicePolicy`), ``device_requires_secure``, ``ONCE_PER_INSTANCE`` and (optional)
    ``device_ldp_epsilon``."""
    guard = getattr(trainer, "_device_guard", None)
    if guard is None:
        policy = getattr(trainer, "device_policy", None) or DevicePolicy()
        guard = StepGuard(policy, secure_kind=trainer.device_requires_secure,  # type: ignore[attr-defined]
                          once=frozenset(getattr(trainer, "ONCE_PER_INSTANCE", frozenset())),
                          ldp_cost=getattr(trainer, "device_ldp_epsilon", None))
        trainer._device_guard = guard  # type: ignore[attr-defined]
    return guard


def ldp_counts(records: Mapping[str, np.ndarray] | None) -> dict[int, float] | None:
    """``user -> local-DP epsilon spent`` as the clients counted it, from a :meth:`StepGuard.state_dict`
    kept in a checkpoint (the users that spent any); ``None`` when there are no records (a server
    half on Flower plays no client: each node keeps its own). A malformed record raises ``ValueError``."""
    if records is None:
        return None
    guard = StepGuard(DevicePolicy(), secure_kind=lambda kind: False)
    guard.load_state_dict({k: np.asarray(v) for k, v in records.items()})
    if not guard.users():
        return None
    return {u: guard.ldp_spent(u) for u in guard.users() if guard.ldp_spent(u) > 0}


def set_device_policy(trainer: object, policy: DevicePolicy) -> None:
    """Give the trainer's clients their operator's ``policy`` (before any step: a record already
    kept is never reset by a new policy)."""
    if not isinstance(policy, DevicePolicy):
        raise TypeError(f"a device policy is a DevicePolicy; found {type(policy).__name__}")
    guard = getattr(trainer, "_device_guard", None)
    trainer.device_policy = policy  # type: ignore[attr-defined]
    if guard is not None:
        guard.policy = policy
