"""The attack registry: (protocol, attack name) -> what view it needs and the function to run.

An attack module registers its attacks when imported and is listed in :data:`ATTACK_MODULES`
(explicit, no import-time discovery)::

    register_attack(AttackSpec(
        protocol="fedmf", name="fedmf-one-round", view="server",
        run=one_round_attack,              # run(view_records, public_info, **options) -> inferences
        summary="closed-form rating recovery from one round of plaintext uploads",
    ))

An attack consumes an adversary's *view* (records of the transcript that party received, see
:meth:`protocols.transport.Transcript.view`) and the protocol's ``public_info()``, never
private client state. Scoring against ground truth happens afterwards
(:mod:`attacks.scoring`), and every score sits beside a random-guess baseline. The common result
shape of ``secagg attack ... --json`` is ``attack.{f1, precision, recall, random_f1, status}``
plus keys of the attack's own.

Plugins (docs/plugins.md) register attacks the same way from their own module, imported by
``secagg --plugin MODULE`` or as an entry point of the group :data:`ATTACK_ENTRY_POINTS`
(``secagg_fedrec.attacks``), which the first lookup imports after :data:`ATTACK_MODULES`. An attack
with ``infer`` + ``assess`` (or a plugin's ``score``) runs on any run directory of its protocol:
``secagg attack RUN_DIR`` (:mod:`experiments.studies.attack_rundir`, on the views recorded by ``--record-views``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ATTACK_ENTRY_POINTS", "ATTACK_MODULES", "AttackSpec", "all_attacks", "attacks_for", "get_attack",
           "register_attack"]

#: Modules that register attacks, imported on the first lookup.
ATTACK_MODULES: tuple[str, ...] = (
    "attacks.fedmf",
    "attacks.lightfr",
    "attacks.fedcl",
    "attacks.sttfedrec",
    "attacks.fedfast",
    "attacks.fel",
)

#: Entry-point group of installed plugins that register attacks (each entry point names a module).
ATTACK_ENTRY_POINTS = "secagg_fedrec.attacks"


@dataclass(frozen=True)
class AttackSpec:
    """A registered attack.

    Attributes:
        protocol: the registered protocol it targets (``protocols.registry``).
        name: unique per protocol.
        view: the adversary whose view it consumes (``"server"``, ``"rs"``, ``"sas"``, ...).
        run: ``run(view, public, **options) -> inferences``.
        summary: one line for help texts and reports.
        score: optional ``score(inferences, train, public) -> dict`` against the ground truth
            ``train`` (the run's training :class:`recmodels.data.Interactions`, dense ids), returning
            at least ``f1``, ``precision``, ``recall``, ``random_f1`` and ``status``; with it the attack
            runs on any run directory of its protocol (``secagg attack RUN_DIR``; ``infer`` + ``assess`` are
            the newer form, in the one schema of :mod:`attacks.findings`).
        infer: optional ``infer(view, public) -> inferences`` on a recorded view (the role's records
            over every recorded round, :mod:`experiments.run.views`) and ``public_info()``: reads nothing else.
        assess: optional ``assess(inferences, truth, public) -> list[Finding]`` scoring them
            (:mod:`attacks.findings`: one schema for every attack); with ``infer`` the attack runs in
            ``secagg attack RUN_DIR`` and the attack matrix.
    """

    protocol: str
    name: str
    view: str
    run: Callable[..., Any]
    summary: str = ""
    score: Callable[..., dict[str, Any]] | None = None
    infer: Callable[..., Any] | None = None
    assess: Callable[..., list[Any]] | None = None


_REGISTRY: dict[tuple[str, str], AttackSpec] = {}
_loaded = False


def register_attack(spec: AttackSpec) -> AttackSpec:
    key = (spec.protocol, spec.name)
    if key in _REGISTRY and _REGISTRY[key] is not spec:
        raise ValueError(f"attack {spec.name!r} on {spec.protocol!r} is registered twice")
    _REGISTRY[key] = spec
    return spec


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in ATTACK_MODULES:
            importlib.import_module(module)
        _loaded = True
        from protocols.registry import load_entry_points

        load_entry_points(ATTACK_ENTRY_POINTS)


def all_attacks() -> list[AttackSpec]:
    """Every registered attack, in registration order."""
    _load()
    return list(_REGISTRY.values())


def attacks_for(protocol: str) -> list[AttackSpec]:
    """The attacks registered against ``protocol``."""
    return [a for a in all_attacks() if a.protocol == protocol]


def get_attack(protocol: str, name: str) -> AttackSpec:
    """The attack ``name`` on ``protocol``; an unknown one lists what exists."""
    _load()
    spec = _REGISTRY.get((protocol, name))
    if spec is None:
        from protocols.registry import did_you_mean

        names = [a.name for a in attacks_for(protocol)]
        raise ValueError(f"unknown attack {name!r} on {protocol!r}{did_you_mean(name, names)}; registered: "
                         f"{', '.join(names) or 'none'}")
    return spec
