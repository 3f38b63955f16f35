"""The Flower ClientApp and the server's Grid-driven trainer for a registered protocol.

* :func:`make_client_app` returns a ``ClientApp`` that answers three message types:
  ``query.census`` (which user this node holds: public, the server addresses clients by it),
  ``train`` (one local round: :func:`fedflower.adapter.client_local_round` on the node's own
  partition; the user state stays in the node's ``Context.state``) and ``query.score`` (scores of
  candidate items with the node's own user state, for evaluation). The partition comes from the
  node config (``partition-id``, and ``partition-dir`` in a deployment) or from the factory's
  ``partition_dir`` (simulation).
* :class:`GridTrainer` is the server's half as a :class:`protocols.base.Trainer`: ``run_round``
  samples with the protocol's seeded generator, sends the global model to the cohort through a
  Flower ``Grid``, validates the replies and aggregates with the protocol's own ``_aggregate``,
  so ``secagg run``'s loop (ledger, costs, transcript, metrics, summary) drives a Flower run
  unchanged. For a protocol made of units (:class:`protocols.registry.DeviceSplit`, FEL's
  leaves) it runs the protocol's own ``run_round`` with each unit's client-facing hooks bound to
  the grid (:class:`_BoundUnit`): the unit samples its cohort with its own generator, the cohort's
  nodes train that unit (each its own), and the unit aggregates the validated replies itself.

A client whose reply is missing (timeout, node failure) or malformed is dropped from the round;
the round aggregates the others (``extra["dropped"]`` counts them). A round in which every client
is dropped raises :class:`RoundFailed`. Flower limits: replies wait at most ``timeout`` seconds
(``send_and_receive``); one message must stay under gRPC's 512 MiB limit (the global model is
``4 * (n_items * dim + dim + 1)`` bytes; :class:`GridTrainer` refuses larger models up front).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedflower.adapter import (
    CLIENT_STATE,
    BadReply,
    PartitionMeta,
    build_client_trainer,
    client_local_round,
    client_secure_vector,
    config_from_json,
    config_to_json,
    decode_update,
    dp_unit,
    install_global_state,
    load_node_state,
    load_partition,
    save_node_state,
    secure_width,
    stack_fields,
    stack_updates,
    survivor_floor,
    units_of,
    zero_fields,
)
from fedflower.chain_flower import CHAIN_KEY, chain_mod
from fedflower.exchange_apps import (
    EXCHANGE_KEY,
    answer_exchange,
    client_exchange,
    client_score_setup,
    collect,
    reply_record,
)
from fedflower.records import RECORD_KEY
from fedflower.secagg_mod import VECTOR_KEY, secagg_mod
from fedflower.secagg_workflow import SecAggWorkflow
from protocols.base import RoundStats
from protocols.exchange import drive
from protocols.fedavg import LocalRound
from protocols.guard import DevicePolicy
from protocols.registry import get_protocol
from protocols.secure_sum import SecureSumAborted
from protocols.transport import SERVER, client
from secagg.bonawitz_wire import MaskedInput
from secagg.encoding import FixedPoint

__all__ = ["GridTrainer", "RoundFailed", "client_app", "make_client_app", "secure_client_app"]

#: gRPC's largest message in Flower 1.41 (flwr.common.GRPC_MAX_MESSAGE_LENGTH).
MAX_MESSAGE_BYTES = 536_870_912
_STATE_KEY = "fedflower.user"
_PART_KEY = "fedflower.partition"


class RoundFailed(RuntimeError):
    """No client of the cohort answered a round validly."""


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def _partition_of(context: Context, partition_dir: str | None, msg: Message | None = None) -> tuple[str, int]:
    """The node's partition: its node config's ``partition-id``, or (simulation) the one assigned to it.

    In simulation (``partition_dir`` given) the server assigns partitions to virtual nodes in its
    messages (a census of 10,000 virtual nodes costs Flower's in-memory link state minutes, see
    docs/flower.md); the node keeps the first one it is given and refuses any other.
    """
    cfg = context.node_config
    if partition_dir is not None and msg is not None and "run" in msg.content and "partition" in msg.content["run"]:
        pid = int(msg.content["run"]["partition"])
        held = context.state.config_records.get(_PART_KEY)
        if held is None:
            context.state[_PART_KEY] = ConfigRecord({"partition": pid})
        elif int(held["partition"]) != pid:
            raise ValueError(f"this node holds partition {int(held['partition'])}; refusing partition {pid}")
        return partition_dir, pid
    directory = partition_dir or cfg.get("partition-dir")
    if not directory:
        raise ValueError("this node has no partition: start it with --node-config \"partition-id=I partition-dir='DIR'\"")
    if "partition-id" not in cfg:
        raise ValueError("this node has no partition-id in its node config")
    return str(directory), int(cfg["partition-id"])


def _secure_route(msg: Message, context: Context, call_next) -> Message:  # noqa: ANN001 - Flower's mod signature
    """Hand ``TRAIN`` messages of a secure aggregation (they carry our record) to :func:`secagg_mod`."""
    if msg.metadata.message_type == MessageType.TRAIN and RECORD_KEY in msg.content.config_records:
        return secagg_mod(msg, context, call_next)
    if msg.metadata.message_type == MessageType.TRAIN and CHAIN_KEY in msg.content.config_records:
        return chain_mod(msg, context, call_next)  # (a secure exchange through the circular chain)
    return call_next(msg, context)


def _requires_secure(context: Context, require_secure: bool) -> bool:
    """Whether this node refuses every plaintext round: the ClientApp's setting or its node config's
    ``require-secagg`` (:meth:`protocols.guard.DevicePolicy.from_node_config`)."""
    return DevicePolicy.from_node_config(context.node_config, require_secure=require_secure).require_secure


def _source(context: Context, run: ConfigRecord) -> str:
    """Where the node finds the data's public side files (STTFedRec's item titles in ``movies.csv``):
    its node config's ``data-source``, else the source the server names, else none."""
    return str(context.node_config.get("data-source") or run.get("source") or "flower")


_PIN_KEY = "fedflower.run_pin"


def _pin_of(run: ConfigRecord) -> str:
    """What a node pins of the server's run record: protocol, configuration, seed and (split
    protocols) the unit's public pool size; a SHA-256 over their canonical JSON."""
    fields = {"protocol": str(run["protocol"]), "config": str(run["config"]), "seed": int(run["seed"])}
    if "unit_clients" in run:
        fields["unit_clients"] = int(run["unit_clients"])
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _operator_config(context: Context, spec: Any) -> Any:
    """The protocol configuration the node's operator pinned (node config ``protocol-config``: a TOML
    file holding the protocol's section, e.g. ``[fedfast]``), or ``None``."""
    path = context.node_config.get("protocol-config")
    if not path:
        return None
    try:
        with open(str(path), "rb") as f:
            table = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"node config protocol-config = {str(path)!r} cannot be read: {exc}") from None
    if spec.section is None or spec.section not in table or not isinstance(table[spec.section], dict):
        raise ValueError(f"node config protocol-config = {str(path)!r} has no [{spec.section}] table for protocol "
                         f"{spec.name!r}; this node runs only the protocol its operator pinned")
    try:
        return spec.config_cls(**table[spec.section])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"node config protocol-config = {str(path)!r}: [{spec.section}] {exc}") from None


def pin_run(context: Context, store: str | None, pid: int, run: ConfigRecord, spec: Any, config: Any) -> None:
    """Refuse a server message whose protocol configuration the node has not agreed to.

    The protocol's configuration (which steps go through secure aggregation, the DP parameters, the
    upload budget) arrives in the server's run record, so a deviating server could switch a node's
    secure steps to plaintext mid-run. The node pins it: to its operator's file when the node config
    names one (``protocol-config``: the server's configuration must equal it), and otherwise to the
    first run record it answered (trust on first use, like the identity keys), kept in its context
    and, with a state directory, on its disk; a later record with another protocol, configuration,
    seed or unit size is refused in words."""
    pinned = _operator_config(context, spec)
    if pinned is not None and pinned != config:
        raise ValueError(f"the server's {spec.name} configuration differs from the one this node's operator pinned "
                         "(node config protocol-config); refusing")
    pin = _pin_of(run)
    file = None if store is None else Path(store) / f"node-{int(pid):07d}.pin"
    rec = context.state.config_records.get(_PIN_KEY)
    held = str(rec["pin"]) if rec is not None else None
    if held is None and file is not None and file.is_file():
        held = file.read_text().strip()
    if held is not None and held != pin:
        raise ValueError("the server's run record (protocol, configuration, seed or unit size) differs from the one "
                         "this node first answered; refusing (a node keeps one protocol instance: wipe its state "
                         "directory to start another)")
    if held is None:
        context.state[_PIN_KEY] = ConfigRecord({"pin": pin})
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_name(file.name + ".tmp")
            tmp.write_text(pin)
            tmp.replace(file)
    elif rec is None:
        context.state[_PIN_KEY] = ConfigRecord({"pin": pin})


def _state_dir(context: Context, state_dir: str | None) -> str | None:
    return state_dir or (str(context.node_config["state-dir"]) if context.node_config.get("state-dir") else None)


def _user_state(context: Context, state_dir: str | None, pid: int, before_round: int) -> np.ndarray | None:
    """The client's user state after its latest round before ``before_round``: from its store on
    disk when it has one (so a resumed run continues from there), else from its Flower context."""
    if state_dir is not None:
        return load_node_state(state_dir, pid, before_round)
    rec = context.state.array_records.get(_STATE_KEY)
    return None if rec is None else rec["p"].numpy()


def make_client_app(partition_dir: str | Path | None = None, *, require_secure: bool = False,
                    state_dir: str | Path | None = None) -> ClientApp:
    """The ClientApp of every protocol the adapter runs (see the module docstring).

    ``train`` answers a plaintext round with the update itself, and a round of secure aggregation
    (run by :func:`fedflower.secagg_mod.secagg_mod`, to which every ``TRAIN`` message carrying our
    record is routed) with its input vector, which the mod masks and removes. The node refuses to
    train in plaintext when ``require_secure`` or its node config has ``require-secagg=true``, and
    always when the protocol config it was sent asks for secure aggregation.
    """
    app = ClientApp(mods=[_secure_route])
    pdir = None if partition_dir is None else str(partition_dir)
    sdir = None if state_dir is None else str(state_dir)

    @app.query("census")
    def census(msg: Message, context: Context) -> Message:
        part = load_partition(*_partition_of(context, pdir))
        store = _state_dir(context, sdir) is not None  # whether this node keeps its state on disk (resume)
        return Message(RecordDict({"census": ConfigRecord({"user": part.user, "partition": part.partition_id,
                                                           "store": store})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        part = load_partition(*_partition_of(context, pdir, msg))
        run = msg.content["run"]
        spec = get_protocol(str(run["protocol"]))
        config = config_from_json(spec, str(run["config"]))
        pin_run(context, _state_dir(context, sdir), part.partition_id, run, spec, config)
        secure = bool(run.get("secure", False))
        # routed through secagg_mod (masked_input) or chain_mod (setup)
        in_secagg = RECORD_KEY in msg.content.config_records or CHAIN_KEY in msg.content.config_records
        if secure and not in_secagg:
            raise ValueError("a secure round's training request arrived outside secure aggregation; this client "
                             "never sends its update unmasked")
        if EXCHANGE_KEY in msg.content.config_records:  # one step of a protocol of exchanges
            trainer = build_client_trainer(spec, config, int(run["seed"]), part, source=_source(context, run))
            reply = client_exchange(msg, context, trainer, part, run, secure=secure,
                                    require_secure=_requires_secure(context, require_secure),
                                    store=_state_dir(context, sdir), vector_key=VECTOR_KEY,
                                    policy=DevicePolicy.from_node_config(context.node_config,
                                                                         require_secure=require_secure))
            return Message(reply, reply_to=msg)
        if spec.exchanges is not None:
            raise ValueError(f"protocol {spec.name!r} runs in exchanges; a training request must name its step")
        if "step" in run:  # a split protocol's step besides its units' rounds (FEL's FL over-arch)
            if secure or _requires_secure(context, require_secure):
                raise ValueError(f"step {str(run['step'])!r} uploads in plaintext; this client trains only "
                                 "through secure aggregation: refusing")
            return Message(_device_step(spec, config, part, run, msg, context, _state_dir(context, sdir)),
                           reply_to=msg)
        wants_secure = getattr(config, "secure_aggregation", "none") != "none"
        if not secure and (wants_secure or _requires_secure(context, require_secure)):
            raise ValueError("this client trains only through secure aggregation "
                             f"({'the protocol config asks for it' if wants_secure else 'node setting'}); "
                             "refusing a plaintext round")
        unit_clients = int(run["unit_clients"]) if "unit_clients" in run else None
        trainer = _own_unit(build_client_trainer(spec, config, int(run["seed"]), part, unit_clients), part, run)
        if secure and getattr(config, "dp", "none") != "none" and not dp_unit(trainer):
            raise ValueError("a DP round through secure aggregation needs this client's own DP step, sized by its "
                             "leaf's public size (unit_clients), which the request does not carry; refusing")
        store = _state_dir(context, sdir)
        prev = _user_state(context, store, part.partition_id, int(run["round"]))
        model = _arrays(msg.content["model"])
        if secure:
            vector, new_state = client_secure_vector(trainer, part.user, int(run["round"]), model, prev)
            record = {"vector": _np_array(vector)}
            floor = survivor_floor(trainer)  # (a DP unit's own: the survivors its noise share was sized for)
            if floor is not None:
                record["min_survivors"] = _np_array(np.array(floor, dtype=np.int64))
            reply = RecordDict({VECTOR_KEY: ArrayRecord(record)})
        else:
            upload, new_state = client_local_round(trainer, part.user, int(run["round"]), model, prev)
            reply = RecordDict({"update": ArrayRecord({k: _np_array(v) for k, v in upload.items()})})
        context.state[_STATE_KEY] = ArrayRecord({"p": _np_array(new_state)})
        if store is not None:
            save_node_state(store, part.partition_id, int(run["round"]), new_state)
        return Message(reply, reply_to=msg)

    @app.query("score")
    def score(msg: Message, context: Context) -> Message:
        part = load_partition(*_partition_of(context, pdir, msg))
        run = msg.content["run"]
        spec = get_protocol(str(run["protocol"]))
        trainer = build_client_trainer(spec, config_from_json(spec, str(run["config"])), int(run["seed"]), part,
                                       source=_source(context, run))
        model = _arrays(msg.content["model"])
        store = _state_dir(context, sdir)
        if spec.exchanges is not None:  # the protocol's own global arrays and this client's own state
            sent = _arrays(msg.content["state"]) if "state" in msg.content.array_records else None
            client_score_setup(trainer, part, model, context, store, int(run["round"]), sent)
        elif spec.split is not None:
            _install_units(trainer, part, model, _user_state(context, store, part.partition_id, int(run["round"])))
            if STEP_MODEL_KEY in msg.content.array_records:  # (FEL's FL over-arch: the ensemble's combiner)
                trainer.install_step_model(_arrays(msg.content[STEP_MODEL_KEY]))
        else:
            state = _user_state(context, store, part.partition_id, int(run["round"]))
            install_global_state(trainer, model, error=ValueError)
            with torch.no_grad():
                if state is not None:
                    getattr(trainer, CLIENT_STATE)[part.user] = torch.as_tensor(state)
        users = np.array([part.user])
        if bool(run["all"]):
            scores = trainer.score_all(users)[0]
        else:
            scores = trainer.score(users, msg.content["items"]["items"].numpy()[None, :])[0]
        return Message(RecordDict({"scores": ArrayRecord({"scores": _np_array(np.asarray(scores, np.float32))})}),
                       reply_to=msg)

    return app


def _own_unit(trainer: Any, part, run: ConfigRecord) -> Any:  # noqa: ANN001
    """The unit this client trains: the trainer itself, or (a split protocol) the unit its
    partition names, which must be the one the server asked for."""
    if not hasattr(trainer, "round_units"):
        return trainer
    asked = int(run["unit"]) if "unit" in run else None
    if part.unit is None or part.unit < 0 or asked != part.unit:
        raise ValueError(f"this client trains in unit {part.unit}; refusing a request to train unit {asked}")
    return units_of(trainer)[part.unit]


def _install_units(trainer: Any, part, model: dict[str, np.ndarray], state: np.ndarray | None) -> None:  # noqa: ANN001
    """Install every unit's global state (record keys ``"<unit>.<name>"`` for the names of its
    ``global_arrays()``) and the client's own state in its unit, checking each array's shape and
    dtype against the unit's."""
    units = units_of(trainer)
    want = {f"{i}.{n}" for i, u in enumerate(units) for n in u.global_arrays()}
    if set(model) != want:
        raise ValueError(f"model record keys {sorted(model)[:6]}...; expected the {len(want)} keys '<unit>.<name>'")
    for i, unit in enumerate(units):
        install_global_state(unit, model, prefix=f"{i}.", error=ValueError)
    with torch.no_grad():
        if state is not None and part.unit is not None and part.unit >= 0:
            getattr(units[part.unit], CLIENT_STATE)[part.user] = torch.as_tensor(state)


#: Record keys of a split protocol's device step: the step's model down, the client's upload up.
STEP_MODEL_KEY, STEP_UPDATE_KEY = "step_model", "step_update"


def _device_step(spec, config, part, run: ConfigRecord, msg: Message, context: Context,  # noqa: ANN001
                 store: str | None) -> RecordDict:
    """A client's half of a split protocol's device step (FEL: one FL over-arch step): every unit's
    global arrays and the step's model installed, its own unit state loaded, the trainer's
    ``device_step_upload`` computed on its own data only; the reply is the upload."""
    if spec.split is None:
        raise ValueError(f"protocol {spec.name!r} has no device steps; refusing step {str(run['step'])!r}")
    trainer = build_client_trainer(spec, config, int(run["seed"]), part, None)
    name = getattr(trainer, "device_step_name", None)
    if name is None or str(run["step"]) != name:
        raise ValueError(f"protocol {spec.name!r} runs no step {str(run['step'])!r}")
    if set(msg.content.array_records) != {"model", STEP_MODEL_KEY}:
        raise ValueError(f"a {name} request carries {sorted(msg.content.array_records)}; expected "
                         f"['model', '{STEP_MODEL_KEY}']")
    t = int(run["round"])
    # the client's own unit state after its latest round up to this one (the step runs after the units')
    _install_units(trainer, part, _arrays(msg.content["model"]), _user_state(context, store, part.partition_id, t + 1))
    row, loss, examples = trainer.device_step_upload(part.user, t, int(run["step_index"]),
                                                     _arrays(msg.content[STEP_MODEL_KEY]))
    return RecordDict({STEP_UPDATE_KEY: ArrayRecord({"gradient": _np_array(np.asarray(row, np.float32)),
                                                     "loss": _np_array(np.asarray(loss, np.float64)),
                                                     "examples": _np_array(np.asarray(examples, np.int64))})})


def _np_array(a: np.ndarray):
    from flwr.app import Array

    return Array(np.array(a, copy=True, order="C"))  # (np.ascontiguousarray would turn a 0-d array 1-d)


#: The deployment ClientApp (``fedflower.apps:client_app``): partition from the node config.
client_app = make_client_app()
#: The same, refusing every plaintext round (``fedflower.apps:secure_client_app``).
secure_client_app = make_client_app(require_secure=True)


class GridTrainer:
    """The server's half of a protocol, driving its clients through a Flower ``Grid``.

    Args:
        grid: the ServerApp's grid.
        server: the protocol built on the census (:func:`fedflower.adapter.build_server_trainer`).
        protocol: the registered protocol name the clients build.
        seed: the run's seed (sent to the clients: it keys their streams and initialisation).
        meta: the partitioned dataset's public facts.
        timeout: seconds to wait for a round's replies; missing ones are dropped.
        assign: simulation: assign partition ``i`` to the ``i``-th node instead of a census.
        resumable: every node keeps its user state in a store on its own disk (``state-dir``), so
            the run can be resumed from the server's checkpoint (:meth:`load_state_dict`).
        source: the data's source (``"synthetic"`` or a path), sent to the clients of a protocol of
            exchanges for its public side files (a node's ``data-source`` node config overrides it).
    """

    def __init__(self, grid: Grid, server: Any, *, protocol: str, seed: int, meta: PartitionMeta,
                 timeout: float = 600.0, assign: bool = False, resumable: bool = False, source: str = "flower"):
        self.grid, self.server, self.protocol, self.seed, self.meta = grid, server, protocol, int(seed), meta
        self.source = str(source)
        self.timeout = float(timeout)
        self.resumable = bool(resumable)
        self.config_json = config_to_json(server.config)
        #: the protocol's units (its own sub-rounds: FEL's leaves), or the server itself
        self.units = units_of(server)
        if any(getattr(getattr(u, "config", None), "secure_aggregation", "none") == "dpf" for u in self.units):
            raise ValueError("secure_aggregation = 'dpf' needs a second, non-colluding aggregation server; Flower runs "
                             "one ServerApp, so 'dpf' runs in process only for now (docs/dpf.md, 'Flower')")
        self.split = hasattr(server, "round_units")
        #: a protocol of named exchanges (protocols/exchange.py): its own generator drives the round
        self.exchanges = hasattr(server, "device_round")
        # (an evaluation message of a split protocol carries every unit's model)
        if self.exchanges:
            model_bytes = sum(np.asarray(a).nbytes for a in server.device_model().values())
        else:
            model_bytes = sum(a.numel() * a.element_size() for u in self.units for a in u.global_arrays().values())
        if model_bytes > MAX_MESSAGE_BYTES:
            raise ValueError(f"the global model is {model_bytes:,} bytes, over Flower's {MAX_MESSAGE_BYTES:,}-byte gRPC "
                             "message limit; reduce the catalogue or fedavg.dim")
        #: ``{user: node id}``; with ``assign`` (simulation) the server assigns partition ``i`` to the
        #: ``i``-th node id instead of asking every node (a census) which one it holds
        self.assign = assign
        if assign:
            nodes = sorted(self._wait_for_nodes(600.0))
            if len(nodes) < meta.clients:
                raise ValueError(f"{len(nodes)} nodes for {meta.clients} partitions")
            self.node_of = {u: nodes[i] for i, u in enumerate(meta.users)}
            self.partition_of = {u: i for i, u in enumerate(meta.users)}
        else:
            self.node_store: dict[int, bool] = {}
            self.node_of = self.census()
            # A deployment is resumable when every node said it keeps its user state on disk.
            self.resumable = self.resumable or (bool(self.node_store) and all(self.node_store.values()))
        self.flower_bytes = {"down": 0, "up": 0}
        self._secagg: SecAggWorkflow | None = None
        self._workflows: dict[tuple, SecAggWorkflow] = {}  # exchange protocols: one per encoding
        self._pinned: dict[int, bytes] = {}  # ... sharing the run's pinned identity keys
        if self.split:
            if meta.units is None:
                raise ValueError(f"protocol {protocol!r} runs in units; the partitions carry none (rewrite them)")
            #: ``{user: its public unit}`` (split protocols)
            self.unit_of = {int(u): int(c) for u, c in zip(meta.users, meta.units)}
            self._bound = [_BoundUnit(self, i, unit) for i, unit in enumerate(self.units)]
            if hasattr(server, "step_model") and server.step_model():  # (FEL's FL over-arch) reached on the nodes
                server._device_step = self._device_step_exchange

    # -- plumbing ------------------------------------------------------------------------------
    def _run_record(self, user: int, **extra: Any) -> ConfigRecord:
        if self.split and "all" not in extra:  # a training request names the unit the client trains
            extra.setdefault("unit", self.unit_of[int(user)])
            if 0 <= extra["unit"] < len(self.units):  # and its public pool size (FEL's DP step depends on it)
                extra.setdefault("unit_clients", int(len(self.units[extra["unit"]]._clients)))
        if self.assign:
            extra["partition"] = self.partition_of[int(user)]
        if self.exchanges:  # (the public side files a client half may read, e.g. item titles)
            extra.setdefault("source", self.source)
        return ConfigRecord({"protocol": self.protocol, "config": self.config_json, "seed": self.seed,
                             "round": int(self.server.round), **extra})  # (a unit's exchange gives its own round)

    def _model_record(self, unit: Any = None) -> ArrayRecord:
        """``unit``'s global model: its ``global_arrays()`` (FedAvg-GMF: ``item``, ``h``, ``b``)."""
        unit = self.server if unit is None else unit
        return ArrayRecord({n: _np_array(a.numpy()) for n, a in unit.global_arrays().items()})

    def _all_units_record(self) -> ArrayRecord:
        """Every unit's global state, keys ``"<unit>.<name>"`` (a split protocol's evaluation)."""
        return ArrayRecord({f"{i}.{n}": _np_array(a.numpy())
                            for i, u in enumerate(self.units) for n, a in u.global_arrays().items()})

    def census(self, wait: float = 600.0) -> dict[int, int]:
        """Ask every node which user it holds; returns ``{user: node_id}``.

        Waits up to ``wait`` seconds for all of ``meta.clients`` nodes to connect (a deployment's
        SuperNodes may still be starting).
        """
        nodes = self._wait_for_nodes(wait)
        msgs = [Message(RecordDict({"run": ConfigRecord({"protocol": self.protocol})}), dst_node_id=n,
                        message_type="query.census") for n in nodes]
        out: dict[int, int] = {}
        for reply in self.grid.send_and_receive(msgs, timeout=wait):
            if reply.has_error():
                continue
            user = int(reply.content["census"]["user"])
            if user in out:
                raise ValueError(f"two nodes hold user {user}: give each SuperNode its own partition-id")
            out[user] = reply.metadata.src_node_id
            self.node_store[user] = reply.content["census"].get("store", False) is True
        missing = sorted(set(self.meta.users) - set(out))
        if missing:
            raise ValueError(f"{len(missing)} of {self.meta.clients} partitions have no connected node "
                             f"(e.g. user {missing[0]}); start one SuperNode per partition-id")
        return out

    def _wait_for_nodes(self, wait: float) -> list[int]:
        deadline = time.monotonic() + wait
        while True:
            nodes = list(self.grid.get_node_ids())
            if len(nodes) >= self.meta.clients or time.monotonic() > deadline:
                return nodes
            time.sleep(0.5)

    # -- the Trainer interface -----------------------------------------------------------------
    @property
    def round(self) -> int:
        return int(self.server.round)

    @property
    def transport(self):
        return self.server.transport

    @property
    def config(self):
        return self.server.config

    def run_round(self) -> RoundStats:
        if self.split:
            return self._split_round()
        if self.exchanges:
            return self._exchange_round()
        srv, t = self.server, self.server.round
        t0 = time.perf_counter()
        sampled = srv._sample_clients()
        if srv.config.secure_aggregation != "none":
            return self._secure_round(t, sampled, t0)
        kept, updates, errors = self._plain_exchange(srv, t, sampled)
        t_clients = time.perf_counter()
        if not updates:
            raise RoundFailed(f"round {t}: no client of {len(sampled)} answered validly ({errors[0] if errors else ''})")
        kept_arr = np.asarray(kept, np.int64)
        pair_slot, pair_item, dQ, dH, dB, weight = stack_updates(updates)
        srv._secagg_seconds = 0.0
        upload_bytes, releases, extra = srv._aggregate(t, kept_arr, pair_slot, pair_item, dQ, dH, dB, weight)
        srv.round += 1
        t_end = time.perf_counter()
        loss = sum(u.loss for u in updates)
        examples = sum(u.examples for u in updates)
        return RoundStats(
            round=t, loss=loss / max(examples, 1), clients=len(kept), bytes_per_client=srv.model_bytes + upload_bytes,
            seconds={"round": t_end - t0, "client": (t_clients - t0) / len(sampled), "server": t_end - t_clients},
            extra={"examples": examples, "dropped": len(sampled) - len(kept), "drop_reasons": errors[:5],
                   "flower_bytes_down": self.flower_bytes["down"], "flower_bytes_up": self.flower_bytes["up"], **extra},
            releases=releases,
        )

    def _plain_exchange(self, unit: Any, t: int, sampled: np.ndarray, **record: Any):
        """Send ``unit``'s global model to the ``sampled`` clients and collect their validated updates.

        Returns ``(kept users, their decoded updates, reasons of the dropped)``, in cohort order.
        """
        model = self._model_record(unit)
        msgs = []
        for u in sampled:
            unit.transport.send(SERVER, client(int(u)), t, "model", None, unit.model_bytes)
            msgs.append(Message(RecordDict({"model": model, "run": self._run_record(u, round=int(t), **record)}),
                                dst_node_id=self.node_of[int(u)], message_type="train", group_id=str(t)))
        self.flower_bytes["down"] += len(msgs) * model.count_bytes()
        replies, duplicated = collect(self.grid, msgs, self.timeout)
        kept, updates, errors = [], [], []
        for u in sampled:
            try:
                rec = reply_record(replies.get(self.node_of[int(u)]), self.node_of[int(u)] in duplicated, "update")
                self.flower_bytes["up"] += rec.count_bytes()
                updates.append(decode_update(_arrays(rec), n_items=self.meta.n_items, dim=unit.config.dim,
                                             fields=unit.upload_fields()))
                kept.append(int(u))
            except (BadReply, KeyError, TypeError, ValueError) as exc:
                errors.append(f"user {int(u)}: {exc}")
        return kept, updates, errors

    def _secure_exchange(self, unit: Any, t: int, sampled: np.ndarray, **record: Any):
        """``unit``'s round through our SecAgg/SecAgg+ over the grid; records the server's transcript.

        Returns ``(report, user_of node, vector width, bytes per client)``; ``report.total`` is
        ``None`` after a clean abort.
        """
        cfg = unit.config
        if len(sampled) < 2:
            raise ValueError(f"secure aggregation needs at least 2 clients per round; round {t} samples {len(sampled)}")
        if self._secagg is None:  # one workflow for the run: it pins each node's identity key across rounds
            self._secagg = SecAggWorkflow(protocol=cfg.secure_aggregation, clipping_range=cfg.value_clip,
                                          frac_bits=cfg.frac_bits, timeout=self.timeout, dropout=cfg.secagg_dropout,
                                          corrupt=cfg.secagg_corrupt, rounding="nearest")
        model = self._model_record(unit)
        contents, user_of = {}, {}
        for u in sampled:
            unit.transport.send(SERVER, client(int(u)), t, "model", None, unit.model_bytes)
            nid = self.node_of[int(u)]
            user_of[nid] = int(u)
            contents[nid] = RecordDict({"model": model, "run": self._run_record(u, secure=True, round=int(t), **record)})
        self.flower_bytes["down"] += len(contents) * model.count_bytes()
        width = secure_width(unit)
        keep = bool(unit.transport.transcript.keep_payloads)
        rep, run = self._secagg.aggregate_vectors(self.grid, t, contents, width, keep_masked=keep)
        for stage, idx, nbytes in run.sizes:  # the server's transcript: what it received, as in-process
            u = user_of[rep.node_ids[idx]]
            payload = MaskedInput.from_bytes(run.masked[idx]).y if keep and stage == "masked_input" else None
            unit.transport.send(client(u), SERVER, t, "update" if stage == "masked_input" else f"secagg:{stage}",
                                payload, nbytes)
        for u in sampled:
            unit.transport.send(SERVER, client(int(u)), t, f"{cfg.secure_aggregation}:server", None,
                                rep.bytes_to_clients // len(sampled))
        self.flower_bytes["up"] += rep.bytes_from_clients
        self.flower_bytes["down"] += rep.bytes_to_clients
        per_client = unit.model_bytes + (rep.bytes_from_clients + rep.bytes_to_clients) / len(sampled)
        return rep, user_of, width, per_client

    def _exchange_round(self) -> RoundStats:
        """One round of a protocol of named exchanges: its own generator, every exchange over the grid
        (:func:`fedflower.exchange_apps.answer_exchange`); the dropped clients are counted per exchange."""
        drops: list[str] = []
        steps = iter(range(1 << 30))

        def answer(ex):  # noqa: ANN001, ANN202
            rep = answer_exchange(self, ex, next(steps))
            drops.extend(f"{ex.kind}: user {u}: {why}" for u, why in rep.dropped.items())
            return rep

        stats = drive(self.server.device_round(), answer)
        extra = {**stats.extra, "dropped": len(drops), "drop_reasons": drops[:5],
                 "flower_bytes_down": self.flower_bytes["down"], "flower_bytes_up": self.flower_bytes["up"]}
        return dataclasses.replace(stats, extra=extra)

    def exchange_workflow(self, spec: Any) -> SecAggWorkflow:
        """The SecAgg workflow for a secure exchange's encoding (one per distinct encoding in a run,
        all pinning the nodes' identity keys in one table)."""
        key = (spec.protocol, spec.frac_bits, float(spec.value_clip), spec.dropout, spec.corrupt, spec.k, spec.t)
        if key not in self._workflows:
            extra = {k: v for k, v in (("dropout", spec.dropout), ("corrupt", spec.corrupt), ("k", spec.k),
                                       ("t", spec.t)) if v is not None}
            wf = SecAggWorkflow(protocol=spec.protocol, clipping_range=float(spec.value_clip), frac_bits=spec.frac_bits,
                                timeout=self.timeout, rounding="nearest", **extra)
            wf.pinned = self._pinned
            self._workflows[key] = wf
        return self._workflows[key]

    def _step_model_record(self) -> ArrayRecord | None:
        arrays = self.server.step_model()
        return ArrayRecord({n: _np_array(a.numpy()) for n, a in arrays.items()}) if arrays else None

    def _device_step_exchange(self, t: int, step: int, cohort: np.ndarray):  # noqa: ANN202
        """The server's ``_device_step`` hook of a split protocol (FEL's FL over-arch step) bound to the grid.

        Each client of ``cohort`` gets every unit's global arrays and the step's model (its node
        computes its features from them and its own data) and replies with its upload: the
        gradient (``step_width()`` finite float32 values; under DP of L2 norm within ``step_clip()``,
        which the device applied), its loss sum (finite, >= 0) and its example count (>= 0). A
        missing, late, duplicated or malformed reply drops only its sender (``dropped``, ``drop_reasons``); returns ``(kept, rows, loss sums, counts)`` in cohort order,
        and stops the run with :class:`RoundFailed` when nobody answered validly.
        """
        srv = self.server
        name, width = srv.device_step_name, int(srv.step_width())
        bound = srv.step_clip()  # (under DP every device clips its upload: the server checks, never clips)
        if len(cohort) == 0:  # (nobody to ask)
            return np.zeros(0, np.int64), np.zeros((0, width)), np.zeros(0), np.zeros(0, np.int64)
        model, step_model = self._all_units_record(), self._step_model_record()
        msgs = []
        for u in cohort:
            run = self._run_record(u, round=int(t), step=name, step_index=int(step))
            msgs.append(Message(RecordDict({"model": model, STEP_MODEL_KEY: step_model, "run": run}),
                                dst_node_id=self.node_of[int(u)], message_type="train", group_id=f"{t}.{name}.{step}"))
        self.flower_bytes["down"] += len(msgs) * (model.count_bytes() + step_model.count_bytes())
        replies, duplicated = collect(self.grid, msgs, self.timeout)
        kept, rows, losses, counts, errors = [], [], [], [], []
        for u in cohort:
            try:
                rec = reply_record(replies.get(self.node_of[int(u)]), self.node_of[int(u)] in duplicated,
                                   STEP_UPDATE_KEY)
                self.flower_bytes["up"] += rec.count_bytes()
                got = _arrays(rec)
                if set(got) != {"gradient", "loss", "examples"}:
                    raise BadReply(f"upload fields {sorted(got)}; expected ['examples', 'gradient', 'loss']")
                g, loss, n = got["gradient"], got["loss"], got["examples"]
                if g.dtype != np.float32 or g.shape != (width,) or not np.isfinite(g).all():
                    raise BadReply(f"gradient {g.dtype} {g.shape}; expected {width} finite float32 values")
                if bound is not None and float(np.linalg.norm(g.astype(np.float64))) > bound * (1 + 1e-5):
                    raise BadReply(f"gradient of L2 norm {float(np.linalg.norm(g)):.6g} over its clip {bound:g}")
                if loss.dtype != np.float64 or loss.shape != () or not np.isfinite(loss) or loss < 0:
                    raise BadReply(f"loss {loss.dtype} {loss.shape}; expected one finite float64 >= 0")
                if n.dtype != np.int64 or n.shape != () or n < 0:
                    raise BadReply(f"examples {n.dtype} {n.shape}; expected one int64 >= 0")
                kept.append(int(u))
                rows.append(g.astype(np.float64))
                losses.append(float(loss))
                counts.append(int(n))
            except (BadReply, KeyError, TypeError, ValueError) as exc:
                errors.append(f"user {int(u)}: {exc}")
        self._dropped += len(cohort) - len(kept)
        self._drops += [f"{name} step {step}: {e}" for e in errors]
        if not kept:
            raise RoundFailed(f"round {t}, {name} step {step}: no client of {len(cohort)} answered validly "
                              f"({errors[0] if errors else ''})")
        return (np.asarray(kept, np.int64), np.stack(rows), np.asarray(losses, np.float64),
                np.asarray(counts, np.int64))

    def _split_round(self) -> RoundStats:
        """One round of a protocol made of units: the protocol's own ``run_round``, each unit's
        cohort reached through the grid (:class:`_BoundUnit`)."""
        self._drops: list[str] = []
        self._dropped = 0
        stats = self.server.run_round()
        extra = {**stats.extra, "dropped": self._dropped, "drop_reasons": self._drops[:5],
                 "flower_bytes_down": self.flower_bytes["down"], "flower_bytes_up": self.flower_bytes["up"]}
        return dataclasses.replace(stats, extra=extra)

    def _secure_round(self, t: int, sampled: np.ndarray, t0: float) -> RoundStats:
        """One round whose uploads the server learns only summed (our SecAgg/SecAgg+ over the grid).

        The ``masked_input`` stage carries the global model and the training request; each
        node's :func:`fedflower.secagg_mod.secagg_mod` masks the vector its ``train`` handler lays
        out (:func:`fedflower.adapter.client_secure_vector`). The decoded sum gives the protocol's
        round sums (:meth:`protocols.fedavg.FedAvgGMF._sums_from_total`), applied as in-process.
        A clean abort (fewer than ``t`` survivors) leaves the model unchanged; the round reports
        ``clients = 0``, a NaN loss and the reason, and the run goes on.
        """
        srv, cfg = self.server, self.server.config
        rep, user_of, width, per_client = self._secure_exchange(srv, t, sampled)
        t_clients = time.perf_counter()
        n = len(sampled)
        reasons = [f"user {user_of[nid]}: {stage}: {why}" for nid, (stage, why) in rep.dropped.items()]
        extra = {"dropped": len(rep.dropped), "drop_reasons": reasons[:5], "secagg_k": rep.k,
                 "secagg_t": rep.t, "flower_bytes_down": self.flower_bytes["down"],
                 "flower_bytes_up": self.flower_bytes["up"]}
        srv.round += 1
        if rep.total is None:
            t_end = time.perf_counter()
            return RoundStats(round=t, loss=float("nan"), clients=0, bytes_per_client=per_client,
                              seconds={"round": t_end - t0, "client": rep.wait_s / n, "server": rep.server_s},
                              extra={**extra, "aborted": rep.abort})
        total = FixedPoint(cfg.frac_bits, max(cfg.value_clip, 1.0)).decode(rep.total)
        srv._apply(*srv._sums_from_total(total[: width - 2]))
        loss_sum, examples = float(total[width - 2]), int(round(float(total[width - 1])))
        t_end = time.perf_counter()
        survivors = len(rep.survivors)
        return RoundStats(
            round=t, loss=loss_sum / max(examples, 1), clients=survivors, bytes_per_client=per_client,
            seconds={"round": t_end - t0, "client": rep.wait_s / n, "server": rep.server_s + (t_end - t_clients)},
            extra={"examples": examples, **extra}, releases=(srv._update_release(survivors),),
        )

    def _score_lists(self, users: np.ndarray, items: list[np.ndarray] | None) -> list[np.ndarray]:
        """Ask each user's node to score ``items[c]`` (every item if ``None``) with its own state."""
        if self.exchanges:
            model = ArrayRecord({k: _np_array(np.asarray(v)) for k, v in self.server.device_model().items()})
        else:
            model = self._all_units_record() if self.split else self._model_record()
        step_model = self._step_model_record() if self.split and hasattr(self.server, "step_model") else None
        msgs = []
        for c, u in enumerate(np.asarray(users)):
            content = {"model": model, "run": self._run_record(u, all=items is None)}
            if items is not None:
                content["items"] = ArrayRecord({"items": _np_array(np.asarray(items[c], np.int64))})
            if step_model is not None:
                content[STEP_MODEL_KEY] = step_model
            held = self.server.device_state_from_server(int(u)) if self.exchanges and hasattr(
                self.server, "device_state_from_server") else None
            if held is not None:  # the server holds this user's state (plaintext FedFast): it sends it
                content["state"] = ArrayRecord({k: _np_array(np.asarray(v)) for k, v in held.items()})
            msgs.append(Message(RecordDict(content), dst_node_id=self.node_of[int(u)], message_type="query.score"))
        replies = {m.metadata.src_node_id: m for m in self.grid.send_and_receive(msgs, timeout=self.timeout)}
        out = []
        for c, u in enumerate(np.asarray(users)):
            reply = replies.get(self.node_of[int(u)])
            if reply is None or reply.has_error():
                raise RoundFailed(f"evaluation: user {int(u)} did not return its scores "
                                  f"({'timeout' if reply is None else reply.error.reason})")
            s = reply.content["scores"]["scores"].numpy()
            width = self.meta.n_items if items is None else len(items[c])
            if s.shape != (width,) or s.dtype != np.float32:
                raise RoundFailed(f"evaluation: user {int(u)} returned scores of shape {s.shape} {s.dtype}")
            out.append(s)
        return out

    def _scores(self, users: np.ndarray, items: np.ndarray | None) -> np.ndarray:
        width = self.meta.n_items if items is None else np.asarray(items).shape[1]
        rows = self._score_lists(users, None if items is None else list(np.asarray(items)))
        return np.stack(rows) if rows else np.empty((0, width), np.float32)

    def evaluate(self, test: Any) -> dict[str, float]:
        """Rating protocols: each test user's node predicts its own held-out items (with its own state
        and the model the server sends); the metrics are the protocol's (``metrics_from_predictions``)."""
        metrics = getattr(self.server, "metrics_from_predictions", None)
        if metrics is None:
            raise ValueError(f"protocol {self.protocol!r} rates but has no metrics_from_predictions(test, predictions)")
        users, items = np.asarray(test.users, np.int64), np.asarray(test.items, np.int64)
        order = np.argsort(users, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(users[order])) + 1) if len(order) else []
        pred = np.empty(len(users), np.float64)
        rows = self._score_lists(np.array([users[g[0]] for g in groups], np.int64), [items[g] for g in groups])
        for g, r in zip(groups, rows, strict=True):
            pred[g] = r
        return metrics(test, pred)

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Each user's node scores its candidates with its own user state (evaluation)."""
        return self._scores(users, np.asarray(items))

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return self._scores(users, None)

    def state_dict(self) -> dict[str, Any]:
        """The server's half only: the clients' states live on their nodes (no resume)."""
        return self.server.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the server's half; the clients continue from their own stores (``state-dir``)."""
        if not self.resumable:
            lacking = sum(not v for v in getattr(self, "node_store", {}).values())
            raise ValueError("this Flower run cannot be resumed: its clients kept their user states only in "
                             "their Flower contexts (give every node a state-dir"
                             f"{f'; {lacking} nodes have none' if lacking else ''})")
        self.server.load_state_dict(state)

    def public_info(self) -> dict[str, Any]:
        info = dict(self.server.public_info())
        info.update(runtime="flower", nodes=len(self.node_of))
        return info

    def cost_report(self) -> dict[str, Any]:
        return {"flower_bytes": dict(self.flower_bytes)}


class _BoundUnit:
    """One unit of a split protocol (FEL: a leaf) with its client-facing hooks bound to the grid.

    The unit's own ``run_round`` (and whatever the protocol does around it) runs unchanged on the
    server; only these three hooks reach the clients:

    * ``_sample_clients``: the unit's own seeded choice, then the exchange with that cohort
      (plaintext updates, or our secure aggregation); returns the clients whose replies are valid
      (the survivors), so the protocol aggregates over exactly those. Asked again before the
      cohort's local round (a Poisson-sampled DP leaf draws first, then runs FedAvg's round on
      that draw), it returns the same clients without asking them twice; an empty draw asks nobody;
    * ``_local_round``: their validated uploads stacked in cohort order, the unit's own upload
      fields installed with its ``load_local_fields`` (the clients' user states stay on their
      nodes: the server's placeholder rows are returned unchanged);
    * ``_secure_sums`` (secure units): the round's sums decoded from the survivors' secure sum;
    * ``_dp_secure_sum`` (DP units through secure aggregation, :func:`fedflower.adapter.dp_unit`):
      the survivors' sum of the inputs each device clipped (and noised) itself, and how many
      survived. The cohort stays the sampled one (the unit accounts its survivors' noise and
      releases ``clients = m`` as in-process); the server never clips or noises anything itself
      (placeholder rows only), and does not learn who was clipped. No loss is released (the
      round's loss is NaN: an unnoised sum of losses would be a release DP does not cover).

    A unit round in which no client answers validly, or whose secure aggregation aborts, raises
    :class:`RoundFailed` (as an in-process abort stops the run), except a unit under distributed DP
    noise: its nodes put their own floor beside their vectors (the survivors their noise shares were
    sized for: :func:`fedflower.adapter.survivor_floor`) and refuse to unmask below it; the unit then
    refuses its round itself (``_dp_secure_sum`` raises :class:`protocols.secure_sum.SecureSumAborted`,
    which the leaf turns into a refused round: not applied, nothing released, said in
    ``extra["refused"]``), as in process, and the run goes on.
    """

    def __init__(self, gt: GridTrainer, index: int, unit: Any) -> None:
        self.gt, self.index, self.unit = gt, int(index), unit
        self.sample = unit._sample_clients  # the protocol's own choice (a bound method)
        self.pending: dict[str, Any] | None = None
        unit._sample_clients = self._sample_and_exchange
        unit._local_round = self._local_round
        self.dp = dp_unit(unit)
        if unit.config.secure_aggregation != "none":
            if self.dp:
                unit._dp_secure_sum = self._dp_secure_sum
            else:
                unit._secure_sums = self._secure_sums

    def _sample_and_exchange(self) -> np.ndarray:
        gt, unit, t = self.gt, self.unit, self.unit.round
        sampled = self.sample()
        if self.pending is not None:
            # The unit asks again for the cohort it drew and we already exchanged with (a Poisson-sampled
            # DP leaf draws first to handle an empty cohort, then runs FedAvg's round on that draw): the
            # same clients, asked once.
            if not np.array_equal(np.asarray(sampled, np.int64), self.pending["kept"]):
                raise RuntimeError(f"unit {self.index}: a second cohort drawn before the first one's local round")
            return self.pending["kept"]
        if len(sampled) == 0:  # (an empty Poisson cohort: nobody to ask; the unit releases its noise alone)
            return np.asarray(sampled, np.int64)
        for u in sampled:
            if gt.unit_of.get(int(u)) != self.index:
                raise RoundFailed(f"unit {self.index} sampled user {int(u)}, whose public unit is "
                                  f"{gt.unit_of.get(int(u))}")
        where = f"round {t}, unit {self.index}"
        if unit.config.secure_aggregation == "none":
            kept, updates, errors = gt._plain_exchange(unit, t, sampled)
            gt._dropped += len(sampled) - len(kept)
            gt._drops += [f"unit {self.index}: {e}" for e in errors]
            if not updates:
                raise RoundFailed(f"{where}: no client of {len(sampled)} answered validly ({errors[0] if errors else ''})")
            self.pending = {"kept": np.asarray(kept, np.int64), "updates": updates}
            return self.pending["kept"]
        rep, user_of, width, per_client = gt._secure_exchange(unit, t, sampled)
        gt._dropped += len(rep.dropped)
        gt._drops += [f"unit {self.index}: user {user_of[nid]}: {stage}: {why}" for nid, (stage, why) in rep.dropped.items()]
        if rep.total is None and self.dp and unit.dp.mode == "distributed":
            # the nodes refused to unmask (their floor beside their vectors) or too many dropped: the unit
            # refuses its round itself (_dp_secure_sum), as in process
            early = ("setup", "share_keys", "masked_input")
            stayed = len(sampled) - sum(stage in early for stage, _ in rep.dropped.values())
            self.pending = {"kept": np.asarray(sampled, np.int64), "total": None, "width": width,
                            "per_client": per_client,
                            "abort": f"{stayed} of {len(sampled)} clients stayed until their masked input; secure "
                                     f"aggregation aborted: {rep.abort}"}
            return self.pending["kept"]
        if rep.total is None:
            raise RoundFailed(f"{where}: secure aggregation aborted ({rep.abort}); the unit's model is unchanged")
        cfg = unit.config
        total = FixedPoint(cfg.frac_bits, max(cfg.value_clip, 1.0)).decode(rep.total)
        survivors = np.asarray(sorted(user_of[nid] for nid in rep.survivors), np.int64)
        kept = np.asarray(sampled, np.int64) if self.dp else survivors
        self.pending = {"kept": kept, "total": total, "width": width, "per_client": per_client,
                        "survivors": survivors}
        return kept

    def _local_round(self, sampled: np.ndarray) -> LocalRound:
        pending, self.pending = self.pending, None
        if pending is None or not np.array_equal(pending["kept"], sampled):
            raise RuntimeError(f"unit {self.index}: local round asked for another cohort than the one exchanged")
        unit = self.unit
        placeholder = unit.user[torch.as_tensor(sampled)].clone()  # the clients' states stay on their nodes
        if "updates" in pending:
            ups = pending["updates"]
            pair_slot, pair_item, dQ, dH, dB, weight = stack_updates(ups)
            unit.load_local_fields(stack_fields(ups, unit.upload_fields()))  # (NCF leaves: the MLP's changes)
            return LocalRound(P=placeholder, pair_slot=pair_slot, pair_item=pair_item, dQ=dQ, dH=dH, dB=dB,
                              weight=weight, loss=sum(u.loss for u in ups), examples=sum(u.examples for u in ups))
        total, width, m, d = pending["total"], pending["width"], len(sampled), unit.config.dim
        self._secure = pending
        loss, examples = (float("nan"), 0) if self.dp else (float(total[width - 2]), int(round(float(total[width - 1]))))
        unit.load_local_fields(zero_fields(unit.upload_fields(), m))  # (placeholders: the server holds the sum)
        return LocalRound(P=placeholder, pair_slot=np.zeros(0, np.int64), pair_item=np.zeros(0, np.int64),
                          dQ=torch.zeros(0, d), dH=torch.zeros(m, d), dB=torch.zeros(m), weight=torch.zeros(m),
                          loss=loss, examples=examples)

    def _secure_sums(self, t, sampled, pair_slot, pair_item, dQ, dH, dB, weight):  # noqa: ANN001, ANN202
        pending, self._secure = self._secure, None
        self.unit._secagg_seconds = 0.0  # (the clients' share is inside the exchange's wall time)
        return self.unit._sums_from_total(pending["total"][: pending["width"] - 2]), pending["per_client"] - self.unit.model_bytes

    def _dp_secure_sum(self, t, sampled, clipped, dropped):  # noqa: ANN001, ANN202
        pending, self._secure = self._secure, None
        if len(dropped):  # (check_device_split refuses fel.simulate_dropout: dropouts here are real)
            raise RuntimeError(f"unit {self.index}: simulated dropouts do not run on Flower")
        unit = self.unit
        unit._secagg_seconds = 0.0
        unit._clip_scales = None  # the devices clipped; the server does not know whose update was clipped
        if pending["total"] is None:  # nothing was unmasked: the unit refuses the round
            raise SecureSumAborted(pending["abort"])
        return pending["total"], pending["per_client"] - unit.model_bytes, len(pending["survivors"])
