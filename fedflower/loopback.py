"""An in-process Flower ``Grid`` for tests and benchmarks: every node's ClientApp in this process.

:class:`LoopbackGrid` delivers each message to its node's ClientApp (or any callable
``(Message, Context) -> Message``) as it would cross the network: serialised to Flower's protobuf
and parsed back in both directions (so the byte counts are the wire sizes and nothing is shared by
reference), and the node's ``Context`` goes through protobuf between messages too (as a SuperNode
hands it to a fresh ClientApp process). A ClientApp that raises answers with a Flower error reply,
as Flower's runtime does.

Hooks let tests play the network and the nodes: ``drop(stage_no, node_id)`` makes a node silent
from that stage on (a dropout or a timeout), ``tamper(stage_no, node_id, reply) -> reply | list``
replaces, corrupts, duplicates or injects replies. Stage numbers count ``send_and_receive`` calls
from 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flwr.app import Context, Error, Message, RecordDict
from flwr.common import serde
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.serverapp.grid import Grid

__all__ = ["LoopbackGrid", "WireStats", "fit_round", "global_parameters"]

ClientCall = Callable[[Message, Context], Message]


@dataclass
class WireStats:
    """What crossed the loopback: bytes and seconds."""

    bytes_down: int = 0  #: server -> nodes, serialised Flower messages
    bytes_up: int = 0  #: nodes -> server
    client_s: dict[int, float] = field(default_factory=dict)  #: node id -> seconds inside its ClientApp
    transport_s: float = 0.0  #: seconds spent (de)serialising messages and contexts


def _wire(msg: Message) -> tuple[bytes, Message]:
    raw = serde.message_to_proto(msg).SerializeToString()
    back = ProtoMessage()
    back.ParseFromString(raw)
    return raw, serde.message_from_proto(back)


class LoopbackGrid(Grid):
    """See the module docstring.

    Args:
        app: the ClientApp (or a ``(Message, Context) -> Message`` callable) every node runs.
        node_ids: the nodes' Flower ids.
        drop: ``(stage_no, node_id) -> bool``: the node is silent from this stage on.
        tamper: ``(stage_no, node_id, reply) -> reply or list of replies`` (test attacks).
        run_id: the run id in every context.
        node_config: ``node_id -> node config`` (what ``flower-supernode --node-config`` sets).
    """

    def __init__(
        self,
        app: ClientCall,
        node_ids: Iterable[int],
        *,
        drop: Callable[[int, int], bool] | None = None,
        tamper: Callable[[int, int, Message], Message | list[Message]] | None = None,
        run_id: int = 1,
        node_config: Callable[[int], dict] | None = None,
    ) -> None:
        self.app = app
        self.node_ids = list(node_ids)
        self.drop, self.tamper = drop, tamper
        self._contexts = {
            nid: serde.context_to_proto(Context(run_id=run_id, node_id=nid,
                                                node_config=dict(node_config(nid)) if node_config else {},
                                                state=RecordDict(), run_config={})).SerializeToString()
            for nid in self.node_ids
        }
        self.gone: set[int] = set()
        self.stage_no = 0
        self.stats = WireStats(client_s={nid: 0.0 for nid in self.node_ids})
        self._next_id = 0
        # What a ServerApp process's runtime sets before the workflow creates messages.
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 0

    # -- the Grid interface used by workflows ----------------------------------------------------
    def set_run(self, run_id: int) -> None:  # noqa: D102
        pass

    @property
    def run(self):  # noqa: ANN201, D102
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201, D102
        raise NotImplementedError

    def get_node_ids(self) -> list[int]:  # noqa: D102
        return [nid for nid in self.node_ids if nid not in self.gone]

    def push_messages(self, messages):  # noqa: ANN001, ANN201, D102
        raise NotImplementedError

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201, D102
        raise NotImplementedError

    def context(self, node_id: int) -> Context:
        """The node's current Context (a parsed copy)."""
        proto = ProtoContext()
        proto.ParseFromString(self._contexts[node_id])
        return serde.context_from_proto(proto)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Deliver every message to its node; return the replies of the nodes that answered."""
        self.stage_no += 1
        replies: list[Message] = []
        for m in messages:
            self._next_id += 1
            m.metadata.__dict__["_message_id"] = f"{self._next_id:032x}"
            m.metadata.__dict__["_src_node_id"] = 0
            nid = m.metadata.dst_node_id
            if nid in self.gone or (self.drop is not None and self.drop(self.stage_no, nid)):
                self.gone.add(nid)
                continue
            t0 = time.perf_counter()
            raw, copy = _wire(m)
            ctx = self.context(nid)
            t1 = time.perf_counter()
            try:
                reply = self.app(copy, ctx)
            except Exception as exc:  # noqa: BLE001 - Flower's runtime turns this into an error reply
                reply = Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=copy)
            t2 = time.perf_counter()
            self._contexts[nid] = serde.context_to_proto(ctx).SerializeToString()
            raw_up, reply = _wire(reply)
            t3 = time.perf_counter()
            self.stats.client_s[nid] += t2 - t1
            self.stats.transport_s += (t1 - t0) + (t3 - t2)
            self.stats.bytes_down += len(raw)
            self.stats.bytes_up += len(raw_up)
            out = [reply] if self.tamper is None else self.tamper(self.stage_no, nid, reply)
            replies.extend(out if isinstance(out, list) else [out])
        return replies


def fit_round(workflow: Callable, grid: LoopbackGrid, initial: list, *, server_round: int = 1,
              strategy: object | None = None):  # noqa: ANN201
    """Run ``workflow`` (a fit workflow such as SecAggWorkflow) for one round over ``grid``.

    Builds what ``DefaultWorkflow`` builds before its fit stage (a client manager with one proxy per
    node, a ``LegacyContext`` holding ``initial`` as the global parameters and the round number)
    and returns the ``LegacyContext`` afterwards (the new parameters are in its state).
    """
    from flwr.app import ConfigRecord
    from flwr.common import ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WKey

    n = len(grid.node_ids)
    manager = SimpleClientManager()
    for nid in grid.node_ids:
        manager.register(GridClientProxy(nid, grid, 1))
    strategy = strategy or FedAvg(fraction_fit=1.0, min_fit_clients=n, min_available_clients=n, fraction_evaluate=0.0)
    ctx = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                        strategy=strategy, client_manager=manager)
    ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WKey.CURRENT_ROUND: server_round})
    ctx.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters(list(initial)), keep_input=True)
    workflow(grid, ctx)
    return ctx


def global_parameters(ctx) -> list:  # noqa: ANN001
    """The global parameters in a ``LegacyContext`` (after :func:`fit_round`)."""
    from flwr.common import parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

    return parameters_to_ndarrays(compat.arrayrecord_to_parameters(ctx.state.array_records[MAIN_PARAMS_RECORD],
                                                                    keep_input=True))
