"""FedCL's LDP budget on Flower (issue 23, item 7): a deviating ServerApp that asks a node for its
embedding again and again, over the loopback grid (every message through Flower's protobuf, each
node on its own partition). The node charges every upload to its own guard, kept in its Flower
context and, with a ``state-dir``, on its disk before the upload is computed; the budget is its
operator's node config (``ldp-epsilon-budget``), never a field of a server message. The in-process
and simulated-device versions are in ``tests/protocols/test_fedcl_budget.py``."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from fedflower.adapter import build_server_trainer, write_partitions
from fedflower.apps import GridTrainer, make_client_app
from fedflower.exchange_apps import load_guard
from fedflower.loopback import LoopbackGrid
from protocols.base import RoundStats
from protocols.exchange import Exchange
from protocols.fedcl import FedCL, FedCLConfig
from protocols.registry import get_protocol
from protocols.transport import InProcessTransport, Transcript
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic

logging.getLogger("flwr").setLevel(logging.ERROR)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(dim=8, max_len=8, clients_per_round=4, clusters=2, semi_hard=3, local_pool=10, local_negatives=2,
             secure_aggregation="none")
VICTIMS = (1, 4)
K = 6


class Repeater(FedCL):
    """A deviating server half: asks ``VICTIMS`` for their embedding ``K`` times in one round."""

    def device_round(self):
        t, model = self.round, self.device_model()
        self.collected = {v: [] for v in VICTIMS}
        self.refusals = {v: [] for v in VICTIMS}
        for _ in range(K):
            got = yield Exchange("embedding", np.array(VICTIMS), broadcast=model, reply_keys=frozenset({"embedding"}),
                                 validate=self._check_embedding)
            for u, e in got.values.items():
                self.collected[u].append(e)
            for u, why in got.dropped.items():
                self.refusals[u].append(why)
        self.round += 1
        return RoundStats(round=t, loss=0.0)


class Asker(FedCL):
    """A deviating server half: asks ``VICTIMS`` for their embedding in every round, whatever ``_due`` says."""

    def device_round(self):
        t = self.round
        got = yield Exchange("embedding", np.array(VICTIMS), broadcast=self.device_model(),
                             reply_keys=frozenset({"embedding"}), validate=self._check_embedding)
        self.log = getattr(self, "log", [])
        self.log.append((t, sorted(got.values), dict(got.dropped)))
        self.round += 1
        return RoundStats(round=t, loss=0.0)


def _grid(tmp: Path, cfg: dict, kind: type, *, node_config=None, state_dir=None, parts: Path | None = None):
    split = leave_one_out(generate_synthetic(n_users=8, n_items=40, mean_interactions=8, seed=0), seed=0)
    parts = parts or tmp / "parts"
    meta = write_partitions(split.train, None, parts)
    nodes = [7000 + 5 * i for i in range(meta.clients)]
    grid = LoopbackGrid(make_client_app(parts, state_dir=state_dir), nodes, node_config=node_config)
    c = FedCLConfig(**{**SMALL, **cfg})
    server = build_server_trainer(get_protocol("fedcl"), c, 0, meta, transport=InProcessTransport(Transcript(False)))
    gt = GridTrainer(grid, server, protocol="fedcl", seed=0, meta=meta, timeout=30, assign=True)
    gt.server.__class__ = kind
    return gt, grid, meta


def test_a_server_asking_for_the_embedding_k_times_in_one_round_gets_one_upload_on_flower(tmp_path):
    """Before the fix every node answered all K requests of the round (K noisy copies of its
    embedding, K x epsilon spent, nothing counted on the node). Now the node's guard, kept in its
    context, admits the first and refuses the others; its record says one upload's epsilon."""
    gt, grid, meta = _grid(tmp_path, {}, Repeater)
    gt.run_round()
    for v in VICTIMS:
        assert len(gt.server.collected[v]) == 1, f"victim {v} uploaded {len(gt.server.collected[v])} times"
        assert len(gt.server.refusals[v]) == K - 1
        assert all("refused" in why and "already uploaded its embedding in round 0" in why
                   for why in gt.server.refusals[v])
        pid = meta.users.index(v)
        rec = load_guard(grid.context(gt.node_of[v]), None, pid)
        assert rec is not None and float(rec["ldp_spent"]) == pytest.approx(SMALL.get("epsilon", 4.0))


def test_the_node_budget_caps_uploads_across_rounds_and_survives_a_restart(tmp_path):
    """Nodes with ``ldp-epsilon-budget = 8`` (two uploads at epsilon 4) asked in every round upload in
    rounds 0 and 1 only; a new grid (fresh Flower contexts, as after a restart) reads the count back
    from the nodes' state directories and is refused too. A node without the setting still keeps to
    its configuration's ``user_budget``."""
    store = tmp_path / "nodes"
    gt, _, _ = _grid(tmp_path, {}, Asker, node_config=lambda nid: {"ldp-epsilon-budget": "8"}, state_dir=store)
    for _ in range(3):
        gt.run_round()
    assert [(t, ok) for t, ok, _ in gt.server.log] == [(0, list(VICTIMS)), (1, list(VICTIMS)), (2, [])]
    assert all("operator's budget 8" in why for why in gt.server.log[2][2].values())
    gt2, _, _ = _grid(tmp_path, {}, Asker, node_config=lambda nid: {"ldp-epsilon-budget": "8"}, state_dir=store,
                      parts=tmp_path / "parts")
    gt2.server.round = 5
    gt2.run_round()
    t, ok, dropped = gt2.server.log[-1]
    assert ok == [] and set(dropped) == set(VICTIMS) and all("operator's budget" in w for w in dropped.values())
    gt3, _, _ = _grid(tmp_path / "b", {"user_budget": 4.0}, Asker)
    for _ in range(2):
        gt3.run_round()
    assert [ok for _, ok, _ in gt3.server.log] == [list(VICTIMS), []]
    assert all("user_budget" in why for why in gt3.server.log[1][2].values())
