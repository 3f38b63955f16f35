"""The protocol registry: one name per protocol, its TOML section, and a builder.

A protocol module registers itself when imported::

    register(ProtocolSpec(
        name="fedavg",                       # the value of run.protocol
        summary="FedAvg over GMF; user embeddings stay on the clients",
        section="fedavg", config_cls=FedAvgConfig,   # the [fedavg] table it owns
        build=lambda ctx: FedAvgGMF(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport, exclude=ctx.exclude),
    ))

and its module path is listed in :data:`PROTOCOL_MODULES` (explicit, no import-time discovery).
``secagg run``, ``--resume``, the reports and the attacks look protocols up here; nothing in
``experiments/`` dispatches on a protocol's name.

Plugins (docs/plugins.md): a module outside this package registers its protocols the same way.
It is imported either because ``secagg --plugin MODULE`` names it (:func:`import_plugin`) or because
an installed distribution declares it as an entry point of the group :data:`PROTOCOL_ENTRY_POINTS`
(``secagg_fedrec.protocols``), which the first lookup imports after :data:`PROTOCOL_MODULES`. The
registry remembers which plugin module registered each protocol (:func:`plugin_of`), so that a run
directory can name the module ``--resume`` must import again.

Importing this module is cheap (no torch, numpy or protocol module): ``secagg --help`` lists
:data:`BUILTIN_PROTOCOLS` without importing them.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing them would load numpy for every help text
    from protocols.transport import InProcessTransport
    from recmodels.data import Interactions
    from recmodels.splits import Split

__all__ = [
    "BUILTIN_PROTOCOLS",
    "PROTOCOL_ENTRY_POINTS",
    "PROTOCOL_MODULES",
    "BuildContext",
    "DeviceSplit",
    "Exchanges",
    "PluginError",
    "ProtocolSpec",
    "all_protocols",
    "did_you_mean",
    "get_protocol",
    "import_plugin",
    "load_entry_points",
    "plugin_of",
    "protocol_names",
    "register",
    "register_with_rank",
    "sections",
]

#: Modules that register protocols, imported (in this order) on the first lookup.
PROTOCOL_MODULES: tuple[str, ...] = (
    "protocols.baselines",
    "protocols.fedavg",
    "protocols.fedmf",
    "protocols.lightfr",
    "protocols.fedcl",
    "protocols.fel",
    "protocols.sttfedrec",
    "protocols.fedfast",
    "protocols.central_rating",
    "protocols.ncf_fed",
    "protocols.fcf",
    "protocols.fedrec",
    "protocols.metamf",
)

#: The names the modules of :data:`PROTOCOL_MODULES` register, in registration order, for help texts
#: that must not import them (tests/experiments/test_plugins.py checks it against the registry).
BUILTIN_PROTOCOLS: tuple[str, ...] = (
    "itempop", "random", "centralized", "fedavg", "fedmf", "lightfr", "fedcl", "fedcl-central", "fel",
    "sttfedrec", "fl-twotower", "centralized-twotower", "fedfast",
    "pmf", "pmf-rank", "svdpp", "svdpp-rank", "ncf-central", "ncf-fed", "fcf", "fedrec", "fedrec-rank",
    "metamf", "metamf-rank",
)

#: Entry-point group of installed plugins that register protocols (each entry point names a module).
PROTOCOL_ENTRY_POINTS = "secagg_fedrec.protocols"

TASKS = ("ranking", "rating")


class PluginError(ValueError):
    """A plugin module could not be imported; the message names it and where it came from."""


@dataclass(frozen=True)
class BuildContext:
    """Everything a builder gets.

    Attributes:
        split: the preprocessed data split (leave-one-out for ranking protocols, a ratio split
            with ``.train``/``.test`` for rating protocols).
        config: the instance of the protocol's ``config_cls`` (its TOML section), or ``None``.
        seed: the run's seed; seeds every simulation choice (never keys, masks or noise).
        source: ``"synthetic"`` or the absolute path of the data file or folder (protocols that
            need side files, e.g. item titles in ``movies.csv``, look beside it).
        transport: the recording transport the protocol must send every message through.
        data_options: the run's ``[data]`` section as a dict (synthetic sizes, threshold, ...).
        exclude: pairs rated below the positive threshold (on ``train``'s id maps), which a
            protocol that samples negatives must never draw (pass it to
            :func:`recmodels.sampling.sample_train_negatives`); ``None`` if every rating is a positive.
    """

    split: Split | Any
    config: Any
    seed: int
    source: str
    transport: InProcessTransport
    data_options: Mapping[str, Any]
    exclude: Interactions | None = None

    @property
    def train(self) -> Interactions:
        return self.split.train


@dataclass(frozen=True)
class DeviceSplit:
    """How a protocol made of FedAvg-like sub-rounds splits into parties on separate devices.

    For a protocol whose round is one or more *units*, each a ``_sample_clients -> _local_round ->
    _aggregate`` sub-round over its own client pool (FEL: one unit per leaf), the trainer
    :attr:`ProtocolSpec.build` returns exposes ``round_units()`` (the units, in round order) and
    ``unit_of_users()`` (per dense user, the unit it trains in, ``-1`` for none; public). A runtime
    that places every client on its own device (``fedflower``) builds the server's half with
    :attr:`ProtocolSpec.build` and each client's half with :attr:`build_client`.

    Attributes:
        build_client: ``(ctx, unit, unit_clients=None) -> trainer``: the client's half on its own
            data only (``ctx.train`` holds one user's rows); ``unit`` is the client's public unit
            (``-1``: it trains in none), ``unit_clients`` the public size of that unit's client
            pool when the server sends it (a client-side step may depend on it: FEL's noise
            share). The result exposes ``round_units()`` (the client's unit trains only that
            client) and ``score``/``score_all`` for that client once every unit's global state and
            its own state are installed.
        check: ``config -> None``; raises ``ValueError`` (in words) for a configuration whose
            parties cannot be separated this way (e.g. a server-side step that needs data the
            server does not hold).
    """

    build_client: Callable[..., Any]
    check: Callable[[Any], None] = lambda config: None


@dataclass(frozen=True)
class Exchanges:
    """How a protocol whose round is named exchanges splits into parties on separate devices.

    The trainer :attr:`ProtocolSpec.build` returns implements :mod:`protocols.exchange`'s
    interface (``device_round``, ``device_step``, ``device_state``/``load_device_state``,
    ``device_model``/``load_device_model``). A runtime that places every client on its own device
    builds the server's half with :attr:`ProtocolSpec.build` on a census
    (:func:`protocols.exchange.census`) and each client's half with :attr:`build_client` on the
    client's own data.

    Attributes:
        check: ``config -> None``; raises ``ValueError`` (in words) for a configuration whose
            parties cannot be separated (e.g. a server-side step on data the server lacks).
        build_client: ``ctx -> trainer`` for a client's half (``ctx.train`` holds one user's
            rows); ``None``: :attr:`ProtocolSpec.build`.
        build_server: ``ctx -> trainer`` for the server's half on the census, when it differs
            from the in-process trainer that plays every party (FedMF under HE: the server half
            loads only the public key); ``None``: :attr:`ProtocolSpec.build`.
    """

    check: Callable[[Any], None] = lambda config: None
    build_client: Callable[[BuildContext], Any] | None = None
    build_server: Callable[[BuildContext], Any] | None = None


@dataclass(frozen=True)
class ProtocolSpec:
    """A registered protocol or baseline.

    Attributes:
        name: the value of ``run.protocol``.
        summary: one line for ``--help`` and reports.
        build: ``BuildContext -> Trainer`` (:class:`protocols.base.Trainer`).
        section: the TOML section the protocol owns (``None``: no options).
        config_cls: the frozen dataclass behind ``section``; its fields are the allowed keys and
            its ``__post_init__`` validates them.
        federated: ``False`` for centralised trainers and fixed baselines (no parties, no
            transcript).
        task: ``"ranking"`` (leave-one-out, sampled and full ranking) or ``"rating"`` (ratio
            split, RMSE/MAE).
        keeps_ratings: ``True`` if the protocol trains on explicit ratings: the data keeps them
            instead of binarising (``data.threshold`` still filters).
        trains: ``False`` for fixed baselines (ItemPop, random) that have no rounds.
        privacy_report: optional ``(ledger, delta) -> dict`` adding protocol-specific keys to
            ``secagg privacy report RUN_DIR --json`` (e.g. FEL's ``per_leaf``, FedCL's
            ``per_user``), computed from the run's :class:`dp.ledger.PrivacyLedger` only.
        split: optional :class:`DeviceSplit` (a protocol of FedAvg-like units that runs with its
            clients on separate devices, e.g. on Flower).
        exchanges: optional :class:`Exchanges` (a protocol whose round is named exchanges,
            :mod:`protocols.exchange`, that runs with its clients on separate devices).
        adversaries: the parties whose views a run records (``[run] record_views``): each
            server of the protocol (``"server"``; STTFedRec's ``"rs"`` and ``"sas"``). A role's view
            is every record of the transcript it received or sent.
    """

    name: str
    summary: str
    build: Callable[[BuildContext], Any]
    section: str | None = None
    config_cls: type | None = None
    federated: bool = True
    task: str = "ranking"
    keeps_ratings: bool = False
    trains: bool = True
    privacy_report: Callable[[Any, float], dict[str, Any]] | None = None
    split: DeviceSplit | None = None
    exchanges: Exchanges | None = None
    adversaries: tuple[str, ...] = ("server",)

    def __post_init__(self) -> None:
        if not self.adversaries or not all(isinstance(a, str) and a and not a.startswith("client:")
                                           for a in self.adversaries):
            raise ValueError(f"protocol {self.name!r}: adversaries must name server parties; found {self.adversaries!r}")
        if self.task not in TASKS:
            raise ValueError(f"ProtocolSpec.task must be one of {TASKS}; found {self.task!r}")
        if (self.section is None) != (self.config_cls is None):
            raise ValueError(f"protocol {self.name!r}: give both section and config_cls, or neither")
        if self.split is not None and self.exchanges is not None:
            raise ValueError(f"protocol {self.name!r}: a device split is units or exchanges, not both")


_REGISTRY: dict[str, ProtocolSpec] = {}
_loaded = False
#: protocol name -> the plugin module whose import registered it (absent: a built-in protocol).
_ORIGIN: dict[str, str] = {}
#: The plugin module being imported (register() attributes what it registers to it).
_importing: list[str] = []
#: Plugin modules already imported, in order.
_PLUGINS: list[str] = []


def register(spec: ProtocolSpec) -> ProtocolSpec:
    """Add ``spec``; a second protocol with the same name or section is a programming error."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"protocol {spec.name!r} is registered twice")
    for other in _REGISTRY.values():
        if spec.section is not None and other.section == spec.section and other.name != spec.name:
            if other.config_cls is not spec.config_cls:
                raise ValueError(f"section [{spec.section}] is owned by {other.name!r} with another config class")
    _REGISTRY[spec.name] = spec
    if _importing:
        _ORIGIN.setdefault(spec.name, _importing[0])
    return spec


def register_with_rank(spec: ProtocolSpec, rank_summary: str) -> tuple[ProtocolSpec, ProtocolSpec]:
    """Register a rating-task protocol and its ``<name>-rank`` twin: the same model and section, trained on
    the explicit ratings and evaluated by ranking (leave-one-out, LightFR's protocol)."""
    if spec.task != "rating" or not spec.keeps_ratings:
        raise ValueError(f"register_with_rank: {spec.name!r} must be a rating-task protocol that keeps ratings")
    return register(spec), register(replace(spec, name=f"{spec.name}-rank", summary=rank_summary, task="ranking"))


def import_plugin(module: str, *, source: str = "--plugin") -> None:
    """Import the plugin ``module`` (it registers protocols and/or attacks when imported).

    Args:
        module: a dotted module name importable from ``sys.path``.
        source: where the name came from, for the error message (``--plugin``, an entry point, a
            run directory).

    Raises:
        PluginError: the module cannot be imported (the message names it, the cause and ``source``).
    """
    if module in _PLUGINS:
        return
    _load()  # built-ins first: a plugin that reuses a built-in name is refused, not silently shadowed
    _importing.append(module)
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise PluginError(f"plugin module {module!r} ({source}) cannot be imported: {exc}; install the package "
                          "that provides it or put it on PYTHONPATH (docs/plugins.md)") from exc
    finally:
        _importing.pop()
    _PLUGINS.append(module)


def load_entry_points(group: str) -> list[str]:
    """Import the module of every installed entry point of ``group``; returns the modules, in order.

    Raises:
        PluginError: an entry point's module cannot be imported (named with its distribution).
    """
    from importlib import metadata

    modules = []
    for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
        module = ep.value.split(":")[0].strip()
        dist = getattr(ep, "dist", None)
        where = f"entry point {ep.name!r} of group {group}" + (f" in distribution {dist.name}" if dist else "")
        import_plugin(module, source=where)
        modules.append(module)
    return modules


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in PROTOCOL_MODULES:
            importlib.import_module(module)
        _loaded = True
        load_entry_points(PROTOCOL_ENTRY_POINTS)


def all_protocols() -> dict[str, ProtocolSpec]:
    """Every registered protocol by name: the built-ins in :data:`BUILTIN_PROTOCOLS` order, then
    plugins in registration order. The order does not depend on which modules a process happened to
    import first (a test or a plugin may import ``protocols.fedmf`` before the registry loads)."""
    _load()
    ordered = {n: _REGISTRY[n] for n in BUILTIN_PROTOCOLS if n in _REGISTRY}
    ordered.update((n, s) for n, s in _REGISTRY.items() if n not in ordered)
    return ordered


def protocol_names() -> tuple[str, ...]:
    """The protocol names known without importing any protocol module: the built-ins, then whatever
    is registered already (plugins imported so far)."""
    return BUILTIN_PROTOCOLS + tuple(n for n in _REGISTRY if n not in BUILTIN_PROTOCOLS)


def plugin_of(name: str) -> str | None:
    """The plugin module that registered protocol ``name`` (``None`` for a built-in one)."""
    return _ORIGIN.get(name)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` (difflib), or ``""`` if none is close."""
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def get_protocol(name: str) -> ProtocolSpec:
    """The spec registered as ``name``; an unknown name lists the known ones."""
    protocols = all_protocols()
    if name not in protocols:
        raise ValueError(f"unknown protocol {name!r}{did_you_mean(name, protocols)}; registered protocols: "
                         f"{', '.join(protocols)} (a plugin's: secagg --plugin MODULE, docs/plugins.md)")
    return protocols[name]


def sections() -> dict[str, type]:
    """Every protocol-owned TOML section and its config class (several protocols may share one)."""
    out: dict[str, type] = {}
    for spec in all_protocols().values():
        if spec.section is not None:
            out[spec.section] = spec.config_cls  # type: ignore[assignment]
    return out
