"""A registered protocol as Flower parties: the server's and each client's halves of a round.

The protocols in :mod:`protocols` simulate every party in one process. The ones whose round is
*server samples a cohort -> each client trains locally -> server aggregates* expose that split as
three hooks (FedAvg-GMF, :class:`protocols.fedavg.FedAvgGMF`, and the protocols built on it):

* ``_sample_clients() -> users`` (the server's seeded choice),
* ``_local_round(sampled) -> LocalRound`` (the clients' local training; batched in-process,
  one client here),
* ``_aggregate(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight)`` (the server's update).

A protocol whose round is several such sub-rounds (*units*: FEL's leaves, one per cluster) says so
through the registry (:class:`protocols.registry.DeviceSplit`): its trainer lists its units
(``round_units()``) and each user's public unit (``unit_of_users()``), and it builds a client's
half on the client's own data (``split.build_client``). The server then runs the protocol's own
``run_round`` with every unit's client-facing hooks (``_sample_clients``, ``_local_round``, and
``_secure_sums`` for a secure unit, ``_dp_secure_sum`` for a DP unit through secure aggregation,
whose clients run the unit's own DP step on their devices: :func:`client_secure_vector`) bound to Flower (:class:`fedflower.apps.GridTrainer`); the unit
aggregates with its own ``_aggregate``, so whatever the protocol does around its units (FEL: labelling each leaf's releases, recording the
leaf models, combining the round's statistics) is the in-process code; each client trains only its
own unit. The partition files and the census then carry each client's public unit and nothing else
about the others.

What travels is declared by each unit (no names are fixed here): its global model
(``global_arrays()``, installed on a client with ``load_global_arrays()``; FedAvg-GMF's ``item``,
``h``, ``b``, FEL's NCF leaves add their MLP ``W``, ``c``), and its upload: FedAvg's fields
(:data:`UPDATE_KEYS`) plus the unit's own per-client float32 arrays (``upload_fields()``:
``{name: shape}``; an NCF leaf's ``W_delta``, ``c_delta``), read after a local round with
``local_fields()`` and installed on the server for the cohort with ``load_local_fields()``; the
secure-aggregation input is the unit's ``_client_vectors`` row (``client_vector_width()`` long).

This module drives those hooks over Flower messages without any Flower code in the protocol:

* **each client** builds the protocol through the registry on *its own user's data only* (a
  partition file, :func:`write_partitions` / :func:`load_partition`), installs the global model it
  received and its own user state (kept in the node's Flower ``Context.state``, never sent), and
  runs ``_local_round`` for itself; the reply carries its upload (the protocol's
  :class:`protocols.fedavg.ClientUpdate` fields), validated by :func:`decode_update`;
* **the server** builds the protocol on a *census*: one placeholder row per participating user
  (who takes part is public; what they hold is not), samples with ``_sample_clients``, sends the
  global model, stacks the validated replies in cohort order and calls ``_aggregate``, which
  records the uploads in the server's transcript and updates the model exactly as in-process.

Equality with the in-process run: client sampling comes from the server's seeded generator, and
every client's negatives and shuffles from its own keyed stream (:mod:`recmodels.streams`), so
a client training alone draws what it draws in the batched simulation; local training is
row-wise, and the server sums the uploads in the same order. The Flower run therefore gives the
same cohorts, examples, transcript and model; the parameters are equal up to float32 rounding,
not guaranteed bit-identical: torch chooses its reduction kernels by tensor shape, so a client's
dot products computed alone may round differently (by an ulp) from the same rows inside the batch
(most runs are bit-identical; tests/fedflower/test_apps_loopback.py checks ``rtol=1e-5, atol=1e-6``
after three rounds).

Adversary and promise: those of the protocol (plaintext FedAvg: the server sees every upload;
with ``secure_aggregation`` see docs/flower.md). A reply that fails validation (missing or extra
keys, wrong dtype or shape, rows out of range, non-finite values) raises :class:`BadReply`; the
server drops that client from the round (the aggregate is over the others) and never crashes.
Nothing received is unpickled (Flower's arrays are ``np.load(allow_pickle=False)``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from protocols.exchange import census
from protocols.fedavg import LocalRound
from protocols.registry import BuildContext, ProtocolSpec
from protocols.transport import InProcessTransport
from recmodels.data import Interactions

__all__ = [
    "SUPPORTED",
    "BadReply",
    "ClientUpdateArrays",
    "Partition",
    "PartitionMeta",
    "build_client_trainer",
    "build_server_trainer",
    "check_runs_on_flower",
    "client_local_round",
    "client_secure_vector",
    "decode_update",
    "dp_unit",
    "encode_update",
    "install_global_state",
    "load_node_state",
    "load_partition",
    "partition_meta",
    "public_units",
    "save_node_state",
    "secure_width",
    "stack_fields",
    "survivor_floor",
    "stack_updates",
    "write_partitions",
]

PARTITION_FORMAT = 1
#: Registered protocols whose trainer is itself one unit with :meth:`FedAvgGMF._aggregate`'s hooks
#: (tested end to end on Flower); protocols with a :class:`protocols.registry.DeviceSplit` run too.
SUPPORTED = ("fedavg",)
_PART_NAME = "client-{:07d}.npz"
_CATALOGUE = "catalogue.npz"
#: FedAvg-GMF's global model (what its server broadcasts each round). A unit declares its own:
#: ``global_arrays()`` / ``load_global_arrays()`` (:meth:`protocols.fedavg.FedAvgGMF.global_arrays`;
#: FEL's NCF leaves add their MLP ``W``, ``c``).
GLOBAL_STATE = ("item", "h", "b")
#: The per-client state that never leaves the client (a row of the protocol's ``user`` table).
CLIENT_STATE = "user"
#: The keys of every unit's plaintext reply (FedAvg's upload, loss and example count); a unit's own
#: ``upload_fields()`` (``{name: shape}``, float32; FEL's NCF leaves: ``W_delta``, ``c_delta``) add theirs.
UPDATE_KEYS = frozenset({"rows", "item_delta", "h_delta", "b_delta", "weight", "loss", "examples"})


class BadReply(ValueError):
    """A client's reply does not have the shape the protocol promises; the client is dropped."""


# -- partitions: each client's own data ----------------------------------------------------------
@dataclass(frozen=True)
class PartitionMeta:
    """The public facts about a partitioned dataset (``meta.json``)."""

    n_users: int
    n_items: int
    clients: int
    users: tuple[int, ...]  # partition id -> dense user index (public: the server addresses them)
    units: tuple[int, ...] | None = None  # partition id -> its public unit (FEL: leaf; -1 none), split protocols


@dataclass(frozen=True)
class Partition:
    """One client's own data: its positives and the pairs it must never draw as negatives."""

    partition_id: int
    user: int
    n_users: int
    n_items: int
    items: np.ndarray
    excluded: np.ndarray
    unit: int | None = None  # the client's public unit (split protocols), else None
    ratings: np.ndarray | None = None  # its ratings, aligned with ``items`` (None: every row a positive, 1.0)
    timestamps: np.ndarray | None = None  # its timestamps, aligned with ``items`` (None: all 0)
    item_ids: np.ndarray | None = None  # the public catalogue's raw item ids (None: 0..n_items-1)

    def train(self) -> Interactions:
        """The client's training interactions on the global id space (only its own rows)."""
        n = len(self.items)
        return Interactions(
            users=np.full(n, self.user, np.int64), items=self.items.astype(np.int64),
            ratings=np.ones(n, np.float32) if self.ratings is None else self.ratings.astype(np.float32),
            timestamps=np.zeros(n, np.int64) if self.timestamps is None else self.timestamps.astype(np.int64),
            user_ids=np.arange(self.n_users), item_ids=self._item_ids(),
        )

    def _item_ids(self) -> np.ndarray:
        return np.arange(self.n_items) if self.item_ids is None else self.item_ids

    def exclude(self) -> Interactions | None:
        if not len(self.excluded):
            return None
        n = len(self.excluded)
        return Interactions(
            users=np.full(n, self.user, np.int64), items=self.excluded.astype(np.int64),
            ratings=np.zeros(n, np.float32), timestamps=np.zeros(n, np.int64),
            user_ids=np.arange(self.n_users), item_ids=self._item_ids(),
        )


def write_partitions(train: Interactions, exclude: Interactions | None, directory: str | Path,
                     units: np.ndarray | None = None) -> PartitionMeta:
    """Write one file per user with training data (partition ``i`` is the ``i``-th such user).

    Each ``client-NNNNNNN.npz`` holds only that user's positives (in the training data's order,
    which its local training follows) and excluded items; ``meta.json`` the public sizes and the
    partition -> user map. Files are plain ``.npz`` read with ``allow_pickle=False``.
    ``units`` (per dense user; split protocols, :func:`public_units`): each file also holds its
    user's public unit, and ``meta.json`` every partition's (FEL: the public cluster assignment).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    order = np.argsort(train.users, kind="stable")
    start = np.concatenate([[0], np.cumsum(np.bincount(train.users, minlength=train.n_users))])
    items = train.items[order]
    # explicit ratings go with the items (protocols that train on them: LightFR, FedMF); binarised
    # data (every rating 1) writes none, as before
    ratings = None if np.all(train.ratings == 1) else train.ratings[order].astype(np.float32)
    # and the timestamps (protocols that order a user's clicks: STTFedRec's first-click features, FedCL)
    stamps = None if not np.any(train.timestamps) else train.timestamps[order].astype(np.int64)
    ex_items = ex_start = None
    if exclude is not None and len(exclude):
        ex_order = np.argsort(exclude.users, kind="stable")
        ex_items = exclude.items[ex_order]
        ex_start = np.concatenate([[0], np.cumsum(np.bincount(exclude.users, minlength=train.n_users))])
    users = np.flatnonzero(np.diff(start) > 0)
    if units is not None and np.asarray(units).shape != (train.n_users,):
        raise ValueError(f"units must give each of {train.n_users} users one unit; found shape {np.shape(units)}")
    for pid, u in enumerate(users):
        excluded = np.zeros(0, np.int64) if ex_items is None else ex_items[ex_start[u] : ex_start[u + 1]]
        own = {} if units is None else {"unit": np.int64(units[u])}
        if ratings is not None:
            own["ratings"] = ratings[start[u] : start[u + 1]]
        if stamps is not None:
            own["timestamps"] = stamps[start[u] : start[u + 1]]
        np.savez(out / _PART_NAME.format(pid), user=np.int64(u), n_users=np.int64(train.n_users),
                 n_items=np.int64(train.n_items), items=items[start[u] : start[u + 1]].astype(np.int64),
                 excluded=np.asarray(excluded, np.int64), **own)
    meta = PartitionMeta(n_users=train.n_users, n_items=train.n_items, clients=len(users),
                         users=tuple(int(u) for u in users),
                         units=None if units is None else tuple(int(units[u]) for u in users))
    raw = asdict(meta)
    if meta.units is None:
        raw.pop("units")  # (a FedAvg partition's meta.json is unchanged)
    (out / "meta.json").write_text(json.dumps({"format": PARTITION_FORMAT, **raw}))
    # the public catalogue's raw item ids (a protocol may derive public item features from them:
    # STTFedRec's item texts), one file every client reads
    np.savez(out / _CATALOGUE, item_ids=np.asarray(train.item_ids))
    return meta


def partition_meta(directory: str | Path) -> PartitionMeta:
    """Read ``meta.json`` of a partitioned dataset."""
    path = Path(directory) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: write partitions first (secagg flower partition PRESET --out DIR)")
    raw = json.loads(path.read_text())
    if raw.get("format") != PARTITION_FORMAT:
        raise ValueError(f"{path} has partition format {raw.get('format')!r}; this version reads {PARTITION_FORMAT}")
    units = raw.get("units")
    return PartitionMeta(n_users=int(raw["n_users"]), n_items=int(raw["n_items"]), clients=int(raw["clients"]),
                         users=tuple(int(u) for u in raw["users"]),
                         units=None if units is None else tuple(int(c) for c in units))


def _catalogue(directory: str | Path, n_items: int) -> np.ndarray | None:
    path = Path(directory) / _CATALOGUE
    if not path.is_file():
        return None  # (partitions written before the catalogue file: ids 0..n_items-1)
    with np.load(path, allow_pickle=False) as z:
        ids = z["item_ids"]
    if ids.ndim != 1 or len(ids) != n_items or ids.dtype.kind not in "iuU":
        raise ValueError(f"{path} holds {ids.dtype} {ids.shape}; expected {n_items} item ids")
    return ids.copy()


def load_partition(directory: str | Path, partition_id: int) -> Partition:
    """Load one client's own file (and nothing of any other client)."""
    path = Path(directory) / _PART_NAME.format(int(partition_id))
    if not path.is_file():
        raise FileNotFoundError(f"partition {partition_id} not found at {path} (is partition-id within the partitions written?)")
    with np.load(path, allow_pickle=False) as z:
        return Partition(partition_id=int(partition_id), user=int(z["user"]), n_users=int(z["n_users"]),
                         n_items=int(z["n_items"]), items=z["items"].copy(), excluded=z["excluded"].copy(),
                         unit=int(z["unit"]) if "unit" in z.files else None,
                         ratings=z["ratings"].copy() if "ratings" in z.files else None,
                         timestamps=z["timestamps"].copy() if "timestamps" in z.files else None,
                         item_ids=_catalogue(directory, int(z["n_items"])))


# -- a node's own store of its user state (resume) ------------------------------------------------
_NODE_STATE = "node-{:07d}.npz"


def load_node_state(directory: str | Path, partition_id: int, before_round: int) -> np.ndarray | None:
    """The client's user state after its latest round ``< before_round`` (``None``: never trained).

    Entries from rounds at or after ``before_round`` belong to rounds the server never completed
    (a run killed mid-round and resumed from its checkpoint) and are ignored.
    """
    path = Path(directory) / _NODE_STATE.format(int(partition_id))
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        rounds, states = z["rounds"], z["p"]
    if rounds.ndim != 1 or states.ndim != 2 or len(rounds) != len(states):
        raise ValueError(f"{path} is not a node state file (rounds {rounds.shape}, p {states.shape})")
    ok = np.flatnonzero(rounds < int(before_round))
    return None if not len(ok) else states[ok[np.argmax(rounds[ok])]].copy()


def save_node_state(directory: str | Path, partition_id: int, round_: int, state: np.ndarray) -> None:
    """Record the client's user state after training in ``round_`` (atomically; later entries dropped)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / _NODE_STATE.format(int(partition_id))
    rounds, states = np.zeros(0, np.int64), np.zeros((0, len(state)), np.float32)
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            keep = z["rounds"] < int(round_)
            rounds, states = z["rounds"][keep], z["p"][keep]
    rounds = np.append(rounds, np.int64(round_))
    states = np.concatenate([states, np.asarray(state, np.float32)[None, :]])
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, rounds=rounds, p=states)
    tmp.replace(path)


# -- building the two halves through the registry -----------------------------------------------
class _OwnData:
    """The ``split`` a builder sees: only ``train`` (a client's own rows, or the server's census)."""

    def __init__(self, train: Interactions):
        self.train = train


def check_runs_on_flower(spec: ProtocolSpec, config: Any) -> None:
    """Raise ``ValueError`` (in words) if the adapter cannot run ``spec`` with ``config``."""
    if spec.name not in SUPPORTED and spec.split is None and spec.exchanges is None:
        raise ValueError(f"protocol {spec.name!r} does not run on Flower yet: the adapter runs FedAvg-GMF, the "
                         "protocols made of FedAvg-GMF units (FEL with GMF leaves) and the protocols whose round is "
                         "named exchanges (protocols/exchange.py)")
    if spec.split is not None:
        spec.split.check(config)
    if spec.exchanges is not None:
        spec.exchanges.check(config)


def units_of(trainer: Any) -> list[Any]:
    """A trainer's units: ``round_units()`` of a split protocol, else the trainer itself."""
    return list(trainer.round_units()) if hasattr(trainer, "round_units") else [trainer]


#: What a protocol of exchanges implements (protocols/exchange.py).
EXCHANGE_HOOKS = ("device_round", "device_step", "device_state", "load_device_state", "device_model",
                  "load_device_model")


def _check_hooks(spec: ProtocolSpec, trainer: Any) -> None:
    if spec.exchanges is not None:
        missing = [h for h in EXCHANGE_HOOKS if not hasattr(trainer, h)]
        if missing:
            raise ValueError(f"protocol {spec.name!r} registers exchanges but lacks {missing} (protocols/exchange.py)")
        return
    for unit in units_of(trainer):
        for hook in ("_sample_clients", "_local_round", "_aggregate", "global_arrays", "load_global_arrays",
                     "upload_fields", "local_fields", "load_local_fields", "client_vector_width", CLIENT_STATE):
            if not hasattr(unit, hook):
                raise ValueError(
                    f"protocol {spec.name!r} does not expose {hook!r}; the Flower adapter runs protocols whose round "
                    "is sample -> local round -> aggregate (FedAvg-GMF and the protocols built on it)"
                )


def _context(config: Any, seed: int, train: Interactions, exclude: Interactions | None,
             transport: InProcessTransport | None, source: str) -> BuildContext:
    return BuildContext(split=_OwnData(train), config=config, seed=seed, source=source,
                        transport=transport or InProcessTransport(), data_options={}, exclude=exclude)


def _build(spec: ProtocolSpec, config: Any, seed: int, train: Interactions, exclude: Interactions | None,
           transport: InProcessTransport | None = None, source: str = "flower") -> Any:
    trainer = spec.build(_context(config, seed, train, exclude, transport, source))
    _check_hooks(spec, trainer)
    return trainer


def _census(users: np.ndarray, n_users: int, n_items: int, user_ids: np.ndarray | None,
            item_ids: np.ndarray | None = None) -> Interactions:
    return census(users, n_users, n_items, user_ids, item_ids)


def public_units(spec: ProtocolSpec, config: Any, seed: int, train: Interactions, source: str = "flower") -> np.ndarray | None:
    """Each dense user's public unit (split protocols; ``None`` otherwise), from the server's census.

    The census is who takes part and their public identifiers (FEL hashes the raw user id, or
    reads public demographics beside the data at ``source``); no one's interactions.
    """
    if spec.split is None:
        return None
    users = np.flatnonzero(np.bincount(train.users, minlength=train.n_users) > 0)
    server = _build(spec, config, seed, _census(users, train.n_users, train.n_items, train.user_ids), None, None, source)
    return np.asarray(server.unit_of_users(), np.int64)


def build_server_trainer(spec: ProtocolSpec, config: Any, seed: int, meta: PartitionMeta,
                         transport: InProcessTransport | None = None, *, user_ids: np.ndarray | None = None,
                         item_ids: np.ndarray | None = None,
                         source: str = "flower") -> Any:
    """The server's half: the protocol built on a census (one placeholder row per client).

    The census tells the protocol who takes part (its client pool, hence the cohort size and the
    secure-aggregation budget); the server never trains on it and never sees a client's data.
    ``user_ids`` (the users' public raw identifiers) and ``source`` matter to protocols that
    derive public facts from them (FEL's clusters); a split protocol's units must then be the
    ones the partitions were written with (``meta.units``), else ``ValueError``.
    """
    check_runs_on_flower(spec, config)
    census = _census(np.asarray(meta.users, np.int64), meta.n_users, meta.n_items, user_ids, item_ids)
    if spec.exchanges is not None and spec.exchanges.build_server is not None:
        server = spec.exchanges.build_server(_context(config, seed, census, None, transport, source))
        _check_hooks(spec, server)
    else:
        server = _build(spec, config, seed, census, None, transport, source)
    if spec.split is not None:
        units = tuple(int(c) for c in np.asarray(server.unit_of_users())[np.asarray(meta.users, np.int64)])
        if meta.units is None or units != tuple(meta.units):
            raise ValueError(f"protocol {spec.name!r} assigns its clients to units other than the partitions were "
                             "written with (meta.json units); rewrite them with secagg flower partition")
    return server


def build_client_trainer(spec: ProtocolSpec, config: Any, seed: int, part: Partition,
                         unit_clients: int | None = None, source: str = "flower") -> Any:
    """A client's half: the protocol built on this client's own data only.

    Built without ``secure_aggregation``: the client's trainer only trains (its half of the secure
    sum is :func:`fedflower.secagg_mod.secagg_mod`), and the protocol's checks of a round's SecAgg+
    parameters concern the server's cohort, not this one-user view. A split protocol's half is
    built by its ``split.build_client`` for the unit written in the client's partition (which
    builds its units without secure aggregation itself: its config may need it, e.g. FEL's
    distributed DP), with ``unit_clients``, the unit's public pool size the server sent.
    """
    if spec.exchanges is not None:  # the client half on its own rows; secure sums are the runtime's
        build = spec.exchanges.build_client or spec.build
        trainer = build(_context(config, seed, part.train(), part.exclude(), None, source))
        _check_hooks(spec, trainer)
        return trainer
    if spec.split is None:
        if getattr(config, "secure_aggregation", "none") != "none":
            config = dataclasses.replace(config, secure_aggregation="none")
        return _build(spec, config, seed, part.train(), part.exclude())
    if part.unit is None:
        raise ValueError(f"partition {part.partition_id} holds no unit; protocol {spec.name!r} needs partitions "
                         "written for it (secagg flower partition PRESET)")
    trainer = spec.split.build_client(_context(config, seed, part.train(), part.exclude(), None, "flower"), part.unit,
                                      unit_clients)
    _check_hooks(spec, trainer)
    return trainer


# -- one client's local round ---------------------------------------------------------------------
@dataclass(frozen=True)
class ClientUpdateArrays:
    """A decoded, validated upload (one client), plus its loss sum and example count; ``fields``
    holds the unit's own upload fields (``upload_fields()``; none for FedAvg-GMF)."""

    rows: np.ndarray
    item_delta: np.ndarray
    h_delta: np.ndarray
    b_delta: float
    weight: float
    loss: float
    examples: int
    fields: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def client_local_round(trainer: Any, user: int, round_: int, model: dict[str, np.ndarray],
                       state: np.ndarray | None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Install ``model`` and the client's ``state``, train locally; returns (upload, new state).

    ``state`` is the client's row of the protocol's user table from its previous round (``None``
    the first time: the protocol's own seeded initialisation, identical to the in-process one).
    """
    lr = _train_one(trainer, user, round_, model, state)
    return encode_update(lr, trainer.local_fields()), lr.P[0].numpy().copy()


def dp_unit(trainer: Any) -> bool:
    """Whether ``trainer`` (a unit) aggregates under DP-FedAvg (FEL's DP leaves: ``dp`` settings and
    :meth:`protocols.fel_leaf.FelLeaf.device_inputs`); its secure input is then the clipped
    (and noised) update alone."""
    return getattr(trainer, "dp", None) is not None and hasattr(trainer, "device_inputs")


def survivor_floor(trainer: Any) -> int | None:
    """The fewest survivors a DP unit's client helps unmask (:func:`dp_unit`; FEL's leaves:
    :meth:`protocols.fel_leaf.FelLeaf.survivor_floor`, computed by the client from its own
    configuration and its leaf's public size), or ``None`` for a unit without one. The ClientApp puts
    it beside its vector (``"min_survivors"``, :func:`fedflower.secagg_mod.vector_floor`), so that its
    node refuses to sign a survivor set below it."""
    if not dp_unit(trainer) or not hasattr(trainer, "survivor_floor"):
        return None
    return int(trainer.survivor_floor())


def secure_width(trainer: Any) -> int:
    """Length of a client's secure-aggregation input: the protocol's vector (its
    ``client_vector_width()``), then loss and examples (a DP unit: its clipped update alone,
    ``trainer.width``; the loss and example count would be sums released without noise, so they
    are not sent)."""
    if dp_unit(trainer):
        return int(trainer.width)
    return int(trainer.client_vector_width()) + 2


def client_secure_vector(trainer: Any, user: int, round_: int, model: dict[str, np.ndarray],
                         state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Train locally and lay the upload out for secure aggregation; returns (vector, new state).

    The vector is the protocol's own (:meth:`protocols.fedavg.FedAvgGMF._client_vectors`, whose
    sum over clients is the round's sums) followed by the client's loss sum (capped at
    ``value_clip``) and example count, so that the server learns those only summed, too.

    A DP unit's vector (:func:`dp_unit`) is instead its own DP-FedAvg step on its own update, on
    the device before masking: the unit's :meth:`~protocols.fel_leaf.FelLeaf.device_inputs`
    (clipped to ``clip``; under distributed noise plus this client's discrete Gaussian share),
    without the loss and example count.

    Raises:
        ValueError: a value beyond ``fedavg.value_clip`` (the client cannot be encoded).
    """
    lr = _train_one(trainer, user, round_, model, state)
    clip = float(trainer.config.value_clip)
    if dp_unit(trainer):
        out = trainer.device_inputs(trainer.client_vectors(np.zeros(1, np.int64), lr.pair_slot, lr.pair_item,
                                                           lr.dQ, lr.dH, lr.dB))[0].astype(np.float64)
        what, hint = "clipped and noised update", "fel.value_clip = {clip:g}; raise fel.value_clip"
    else:
        vec = trainer._client_vectors(np.zeros(1, np.int64), lr.pair_slot, lr.pair_item, lr.dQ, lr.dH, lr.dB,
                                      lr.weight)[0]
        out = np.concatenate([vec, [min(float(lr.loss), clip), float(lr.examples)]]).astype(np.float64)
        what, hint = "update", ("fedavg.value_clip = {clip:g}; raise fedavg.value_clip (and check the bit budget) or "
                                "lower the learning rate")
    big = float(np.abs(out).max(initial=0.0))
    if not np.isfinite(big) or big > clip:
        raise ValueError(f"round {round_}: this client's {what} holds {big:.4g}, beyond " + hint.format(clip=clip))
    return out, lr.P[0].numpy().copy()


def global_names(unit: Any) -> tuple[str, ...]:
    """The names of ``unit``'s global arrays (its ``global_arrays()``, in order)."""
    return tuple(unit.global_arrays())


def install_global_state(unit: Any, model: dict[str, np.ndarray], prefix: str = "",
                         error: type[ValueError] = BadReply) -> None:
    """Set ``unit``'s global state (its ``global_arrays()``) from ``model[prefix + name]``, every
    array checked against the unit's own shape and dtype before any is installed (``error`` names
    the mismatch)."""
    values = {}
    for name, ref in unit.global_arrays().items():
        if prefix + name not in model:
            raise error(f"global {prefix + name!r} is missing; the protocol expects {sorted(unit.global_arrays())}")
        value = torch.as_tensor(np.asarray(model[prefix + name]))
        if tuple(value.shape) != tuple(ref.shape) or value.dtype != ref.dtype:
            raise error(f"global {prefix + name!r} has shape {tuple(value.shape)} {value.dtype}; the protocol "
                        f"expects {tuple(ref.shape)} {ref.dtype}")
        values[name] = value
    with torch.no_grad():
        unit.load_global_arrays(values)


def _train_one(trainer: Any, user: int, round_: int, model: dict[str, np.ndarray], state: np.ndarray | None) -> LocalRound:
    install_global_state(trainer, model)
    with torch.no_grad():
        if state is not None:
            getattr(trainer, CLIENT_STATE)[user] = torch.as_tensor(np.asarray(state))
    trainer.round = int(round_)
    return trainer._local_round(np.array([user], np.int64))


def encode_update(lr: LocalRound, fields: dict[str, torch.Tensor] | None = None) -> dict[str, np.ndarray]:
    """A one-client :class:`LocalRound` (and its unit's ``local_fields()``) as the arrays of its reply."""
    own = {name: np.asarray(t[0].numpy(), np.float32) for name, t in (fields or {}).items()}
    return {
        "rows": np.asarray(lr.pair_item, np.int64),
        "item_delta": lr.dQ.numpy().astype(np.float32, copy=False),
        "h_delta": lr.dH[0].numpy().astype(np.float32, copy=False),
        "b_delta": np.asarray([float(lr.dB[0])], np.float32),
        "weight": np.asarray([float(lr.weight[0])], np.float32),
        "loss": np.asarray([lr.loss], np.float64),
        "examples": np.asarray([lr.examples], np.int64),
        **own,
    }


def decode_update(arrays: dict[str, np.ndarray], *, n_items: int, dim: int,
                  fields: dict[str, tuple[int, ...]] | None = None) -> ClientUpdateArrays:
    """Validate one reply's arrays (exact keys, dtypes, shapes, ranges, finiteness).

    ``fields``: the unit's own upload fields (``upload_fields()``: ``{name: shape}``, each a
    float32 array of exactly that shape), which the reply must carry besides :data:`UPDATE_KEYS`.
    """
    fields = dict(fields or {})
    want_keys = UPDATE_KEYS | set(fields)
    keys = set(arrays)
    if keys != want_keys:
        raise BadReply(f"reply keys {sorted(keys)}; expected exactly {sorted(want_keys)} "
                       f"(missing {sorted(want_keys - keys)}, extra {sorted(keys - want_keys)})")
    for k, shape in fields.items():
        a = arrays[k]
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != tuple(shape):
            raise BadReply(f"reply array {k!r} is {getattr(a, 'dtype', type(a).__name__)} of shape "
                           f"{getattr(a, 'shape', '?')}; expected float32 of shape {tuple(shape)}")
    want = {"rows": (np.int64, 1), "item_delta": (np.float32, 2), "h_delta": (np.float32, 1), "b_delta": (np.float32, 1),
            "weight": (np.float32, 1), "loss": (np.float64, 1), "examples": (np.int64, 1)}
    for k, (dtype, ndim) in want.items():
        a = arrays[k]
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != ndim:
            raise BadReply(f"reply array {k!r} is {getattr(a, 'dtype', type(a).__name__)} with "
                           f"{getattr(a, 'ndim', '?')} dims; expected {np.dtype(dtype)} with {ndim}")
    rows, dq = arrays["rows"], arrays["item_delta"]
    if dq.shape != (len(rows), dim) or arrays["h_delta"].shape != (dim,):
        raise BadReply(f"reply shapes rows {rows.shape}, item_delta {dq.shape}, h_delta {arrays['h_delta'].shape}; "
                       f"expected item_delta ({len(rows)}, {dim}) and h_delta ({dim},)")
    for k in ("b_delta", "weight", "loss", "examples"):
        if arrays[k].shape != (1,):
            raise BadReply(f"reply array {k!r} has shape {arrays[k].shape}; expected (1,)")
    if len(rows) and (rows.min() < 0 or rows.max() >= n_items or np.any(np.diff(rows) <= 0)):
        raise BadReply(f"reply rows must be strictly increasing item indices in [0, {n_items}); found "
                       f"min {rows.min()}, max {rows.max()}")
    floats = (dq, arrays["h_delta"], arrays["b_delta"], arrays["weight"], arrays["loss"], *(arrays[k] for k in fields))
    if not all(np.isfinite(a).all() for a in floats):
        raise BadReply("reply holds a non-finite value (NaN or infinity)")
    weight, examples = float(arrays["weight"][0]), int(arrays["examples"][0])
    if weight <= 0 or examples < 0:
        raise BadReply(f"reply weight must be > 0 and examples >= 0; found {weight}, {examples}")
    return ClientUpdateArrays(rows=rows, item_delta=dq, h_delta=arrays["h_delta"], b_delta=float(arrays["b_delta"][0]),
                              weight=weight, loss=float(arrays["loss"][0]), examples=examples,
                              fields={k: arrays[k] for k in fields})


def stack_updates(updates: list[ClientUpdateArrays]) -> tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor,
                                                              torch.Tensor, torch.Tensor]:
    """The cohort's uploads in the layout of the batched ``_local_round`` (slot ``c`` = ``updates[c]``).

    Returns ``(pair_slot, pair_item, dQ, dH, dB, weight)`` as :meth:`FedAvgGMF._aggregate` takes them.
    """
    counts = [len(u.rows) for u in updates]
    pair_slot = np.repeat(np.arange(len(updates)), counts).astype(np.int64)
    pair_item = np.concatenate([u.rows for u in updates]) if updates else np.zeros(0, np.int64)
    dim = updates[0].h_delta.shape[0] if updates else 0
    dQ = torch.as_tensor(np.concatenate([u.item_delta for u in updates]) if updates else np.zeros((0, dim), np.float32))
    dH = torch.as_tensor(np.stack([u.h_delta for u in updates]))
    dB = torch.tensor([u.b_delta for u in updates], dtype=torch.float32)
    weight = torch.tensor([u.weight for u in updates], dtype=torch.float32)
    return pair_slot, pair_item, dQ, dH, dB, weight


def stack_fields(updates: list[ClientUpdateArrays], fields: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The cohort's own upload fields, each ``[m, *shape]`` in cohort order (a unit's ``load_local_fields``)."""
    return {k: torch.as_tensor(np.stack([u.fields[k] for u in updates]) if updates
                               else np.zeros((0, *shape), np.float32)) for k, shape in fields.items()}


def zero_fields(fields: dict[str, tuple[int, ...]], m: int) -> dict[str, torch.Tensor]:
    """Placeholder fields of ``m`` clients (a secure round: the server holds only the sum)."""
    return {k: torch.zeros((m, *shape)) for k, shape in fields.items()}


def config_to_json(config: Any) -> str:
    """A protocol's (flat, frozen) config dataclass as JSON, for the message that carries it."""
    return json.dumps(asdict(config), sort_keys=True)


def config_from_json(spec: ProtocolSpec, text: str) -> Any:
    """Rebuild (and validate, through its ``__post_init__``) a protocol config sent by the server."""
    if spec.config_cls is None:
        return None
    raw = json.loads(text)
    if not isinstance(raw, dict) or not all(isinstance(k, str) and re.fullmatch(r"[a-z_][a-z0-9_]*", k) for k in raw):
        raise BadReply(f"protocol config must be a JSON object of keys; found {text[:80]!r}")
    try:
        return spec.config_cls(**raw)
    except TypeError as exc:
        raise BadReply(f"protocol config does not fit [{spec.section}]: {exc}") from None
