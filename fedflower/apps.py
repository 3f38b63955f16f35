"""The Flower ClientApp and the server's Grid-driven trainer for a registered protocol.

* :func:`make_client_app` returns a ``ClientApp`` that answers three message types:
  ``query.census`` (which user this node holds: public, the server addresses clients by it),
  ``train`` (one local round: :func:`fedflower.adapter.client_local_round` on the node's own
  partition; the user state stays in the node's ``Context.state``) and ``query.score`` (scores of
  candidate items with the node's own user state, for evaluation). The partition comes from the
  node config (``partition-id``, and ``partition-dir`` in a deployment) or from the factory's
  ``partition_dir`` (simulation).
* :class:`GridTrainer` (in :mod:`fedflower.grid_trainer`, re-exported here) is the server's half
  as a :class:`protocols.base.Trainer`: ``run_round`` samples with the protocol's seeded generator, sends the global model to the cohort through a
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

import hashlib
import json
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

from fedflower.adapter import (
    CLIENT_STATE,
    build_client_trainer,
    client_local_round,
    client_secure_vector,
    config_from_json,
    dp_unit,
    install_global_state,
    load_node_state,
    load_partition,
    save_node_state,
    survivor_floor,
    units_of,
)
from fedflower.chain_flower import CHAIN_KEY, chain_mod
from fedflower.exchange_apps import EXCHANGE_KEY, client_exchange, client_score_setup
from fedflower.grid_trainer import (  # (re-exported: the server's half was defined here)
    MAX_MESSAGE_BYTES,
    STEP_MODEL_KEY,
    STEP_UPDATE_KEY,
    GridTrainer,
    RoundFailed,
    _arrays,
    _BoundUnit,
    _np_array,
)
from fedflower.records import RECORD_KEY
from fedflower.secagg_mod import VECTOR_KEY, secagg_mod
from protocols.guard import DevicePolicy
from protocols.registry import get_protocol

__all__ = ["GridTrainer", "RoundFailed", "client_app", "make_client_app", "secure_client_app"]

_STATE_KEY = "fedflower.user"
_PART_KEY = "fedflower.partition"


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


#: The deployment ClientApp (``fedflower.apps:client_app``): partition from the node config.
client_app = make_client_app()
#: The same, refusing every plaintext round (``fedflower.apps:secure_client_app``).
secure_client_app = make_client_app(require_secure=True)


