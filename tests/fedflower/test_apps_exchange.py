"""A protocol of named exchanges (protocols/exchange.py) on Flower, over the loopback grid.

A toy protocol registered for these tests only: user ``u`` privately holds ``x_u`` (its number
of rows) and a running total ``s_u`` in its own state. A round broadcasts ``w`` and a per-user
offset, asks each user for ``x_u + w + offset_u`` in plaintext, then for ``[x_u, s_u, 1]``
summed through secure aggregation; the server's "model" is the running sum of the totals. The
tests check that Flower, the simulated devices and one process agree, that the server learns only
the sum in the secure step, and that bad input at the boundary drops only its sender.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from fedflower.adapter import build_server_trainer, load_partition, write_partitions
from fedflower.apps import GridTrainer, make_client_app
from fedflower.exchange_apps import load_device_state
from fedflower.loopback import LoopbackGrid
from protocols import registry
from protocols.base import RoundStats
from protocols.exchange import Exchange, SecureSum, census, run_exchanges, run_on_devices
from protocols.registry import Exchanges, ProtocolSpec, get_protocol
from protocols.transport import SERVER, InProcessTransport, Transcript, client
from recmodels.data import Interactions

logging.getLogger("flwr").setLevel(logging.ERROR)

NAME = "toy-exchange"


@dataclass(frozen=True)
class ToyConfig:
    secure_aggregation: str = "secagg+"
    frac_bits: int = 16
    value_clip: float = 1e4

    def __post_init__(self) -> None:
        if self.secure_aggregation not in ("secagg", "secagg+", "chain"):
            raise ValueError(f"toy.secure_aggregation must be secagg, secagg+ or chain; found {self.secure_aggregation!r}")


class Toy:
    def __init__(self, train: Interactions, config: ToyConfig, *, transport: InProcessTransport | None = None) -> None:
        self.train, self.config, self.round = train, config, 0
        self.transport = transport or InProcessTransport(Transcript(keep_payloads=True))
        self.x = np.bincount(train.users, minlength=train.n_users).astype(np.float64)
        self.s = np.zeros(train.n_users)
        self.users = np.flatnonzero(self.x > 0)
        self.model = np.zeros(3)
        self.log: list = []

    def device_round(self):
        t = self.round
        for u in self.users:
            self.transport.send(SERVER, client(int(u)), t, "w", None, 16)

        def check(u, reply):
            y = reply["y"]
            if y.shape != () or y.dtype != np.float64 or not np.isfinite(y):
                raise ValueError(f"y must be one finite float64; found {y.dtype} {y.shape}")
            return float(y)

        got = yield Exchange("echo", self.users, broadcast={"w": np.array(float(t))},
                             per_user={int(u): {"offset": np.array([float(u)])} for u in self.users},
                             reply_keys=frozenset({"y"}), validate=check)
        cfg = self.config
        total = yield Exchange("count", np.array(sorted(got.values), np.int64),
                               broadcast={"model": self.model.copy()},
                               secure=SecureSum(cfg.secure_aggregation, width=3, frac_bits=cfg.frac_bits,
                                                value_clip=cfg.value_clip))
        if total.total is not None:
            self.model = self.model + total.total
        self.log.append({"echo": dict(got.values), "survivors": total.survivors.tolist(),
                         "dropped": {**got.dropped, **total.dropped}, "aborted": total.aborted})
        self.round += 1
        return RoundStats(round=t, loss=float(sum(got.values.values())), clients=len(total.survivors))

    def device_step(self, kind, round_, users, broadcast, per_user):
        if kind == "echo":
            return {int(u): {"y": np.array(self.x[u] + float(broadcast["w"]) + float(per_user[int(u)]["offset"][0]))}
                    for u in users}
        out = {int(u): {"vector": np.array([self.x[u], self.s[u], 1.0])} for u in users}
        self.s[users] += self.x[users]
        return out

    def device_requires_secure(self, kind):
        return kind == "count"

    def device_state(self, user):
        return {"s": np.array(self.s[user])}

    def load_device_state(self, user, state):
        self.s[user] = float(state["s"])

    def device_model(self):
        return {"model": self.model.copy()}

    def load_device_model(self, model):
        self.model = np.asarray(model["model"], np.float64).copy()

    def score(self, users, items):
        return np.asarray(items, np.float64) * self.s[np.asarray(users)][:, None] + self.model[0]

    def score_all(self, users):
        return self.score(users, np.tile(np.arange(self.train.n_items), (len(users), 1)))

    def run_round(self):
        return run_exchanges(self, self.device_step)

    def public_info(self):
        return {}


@pytest.fixture
def toy_protocol():
    spec = ProtocolSpec(name=NAME, summary="test-only exchange protocol",
                        build=lambda ctx: Toy(ctx.train, ctx.config, transport=ctx.transport),
                        section="toyexchange", config_cls=ToyConfig, exchanges=Exchanges())
    registry.all_protocols()
    registry.register(spec)
    try:
        yield spec
    finally:
        registry._REGISTRY.pop(NAME, None)


def _data(counts):
    users = np.repeat(np.arange(len(counts)), counts).astype(np.int64)
    items = np.concatenate([np.arange(c) for c in counts]).astype(np.int64)
    return Interactions(users=users, items=items, ratings=np.ones(len(users), np.float32),
                        timestamps=np.zeros(len(users), np.int64), user_ids=np.arange(len(counts)),
                        item_ids=np.arange(max(counts) + 1))


def _flower(tmp: Path, train, cfg, *, drop=None, tamper=None, state_dir=None, node_config=None):
    meta = write_partitions(train, None, tmp / "parts")
    nodes = [9000 + 7 * i for i in range(meta.clients)]
    grid = LoopbackGrid(make_client_app(tmp / "parts", state_dir=state_dir), nodes, drop=drop, tamper=tamper,
                        node_config=node_config)
    server = build_server_trainer(get_protocol(NAME), cfg, 0, meta, transport=InProcessTransport(Transcript(True)))
    return GridTrainer(grid, server, protocol=NAME, seed=0, meta=meta, timeout=30, assign=True), grid


@pytest.mark.parametrize("protocol", ["secagg", "secagg+", "chain"])
def test_flower_equals_the_devices_and_one_process(toy_protocol, tmp_path, protocol):
    counts = [3, 1, 4, 1, 5, 9]
    train, cfg = _data(counts), ToyConfig(secure_aggregation=protocol)
    local = Toy(train, cfg)
    server = Toy(census(np.arange(6), 6, train.n_items), cfg)
    devices = {u: Toy(load_partition(tmp_path / "p", u).train(), cfg) for u in range(6)} \
        if write_partitions(train, None, tmp_path / "p") else None
    gt, _ = _flower(tmp_path, train, cfg)
    for t in range(3):
        a, b, c = local.run_round(), run_on_devices(server, devices), gt.run_round()
        assert a.loss == b.loss == c.loss == sum(x + t + u for u, x in enumerate(counts))
        assert a.clients == b.clients == c.clients == 6
    x = np.array(counts, float)
    want = np.array([3 * x.sum(), (0 + 1 + 2) * x.sum(), 18.0])  # sum over rounds of [x, s_before, 1]
    np.testing.assert_allclose(local.model, want)
    np.testing.assert_allclose(gt.server.model, want, atol=1e-4)
    np.testing.assert_allclose(server.model, want, atol=1e-4)
    # scoring runs on each node with its own state s_u = 3 x_u and the server's model
    np.testing.assert_allclose(gt.score(np.array([4]), np.array([[0, 2]])), [[want[0], want[0] + 2 * 15]], rtol=1e-6)
    # the server's view of the secure step: masked uploads only, never a client's x_u or s_u
    ups = [r for r in gt.server.transport.transcript.view(SERVER, kind="update")]
    assert len(ups) == 18
    for r in ups if protocol != "chain" else []:  # (the chain's uploads are recorded by size)
        y = np.asarray(r.payload)
        assert y.dtype == np.uint64 and not np.isin(y[:1].astype(np.float64) / 2**16, x).all()


def test_a_silent_or_malformed_client_is_dropped_and_the_round_goes_on(toy_protocol, tmp_path):
    train, cfg = _data([2, 2, 2, 2, 2]), ToyConfig(secure_aggregation="secagg")

    def tamper(stage, nid, reply):
        if stage == 1 and nid == 9000 + 7 * 1:  # user 1: an extra key
            rec = reply.content["reply"]
            rec["extra"] = Array(np.zeros(1))
        if stage == 1 and nid == 9000 + 7 * 2:  # user 2: wrong dtype
            reply.content["reply"] = ArrayRecord({"y": Array(np.array(1, np.int64))})
        return reply

    gt, _ = _flower(tmp_path, train, cfg, drop=lambda stage, nid: stage == 1 and nid == 9000 + 7 * 3, tamper=tamper)
    stats = gt.run_round()
    log = gt.server.log[-1]
    assert sorted(log["echo"]) == [0, 4] and stats.clients == 2
    assert set(log["dropped"]) == {1, 2, 3} and stats.extra["dropped"] == 3
    assert "reply keys" in log["dropped"][1] and "float64" in log["dropped"][2] and "timeout" in log["dropped"][3]
    np.testing.assert_allclose(gt.server.model, [4.0, 0.0, 2.0], atol=1e-4)


def test_a_secure_step_asked_in_plaintext_is_refused_by_the_client(toy_protocol, tmp_path):
    class Greedy(Toy):
        def device_round(self):
            got = yield Exchange("count", self.users, reply_keys=frozenset({"vector"}))
            self.log.append(got)
            self.round += 1
            return RoundStats(round=0, loss=0.0)

    train, cfg = _data([2, 3, 4]), ToyConfig()
    gt, _ = _flower(tmp_path, train, cfg)
    gt.server.__class__ = Greedy
    gt.run_round()
    got = gt.server.log[-1]
    assert not got.values and all("only through secure aggregation" in why for why in got.dropped.values())


def test_a_node_requiring_secure_aggregation_refuses_every_plaintext_step(toy_protocol, tmp_path):
    train, cfg = _data([2, 3, 4]), ToyConfig()
    gt, _ = _flower(tmp_path, train, cfg, node_config=lambda nid: {"require-secagg": "true"})
    gt.run_round()
    log = gt.server.log[-1]
    assert not log["echo"] and log["aborted"] is not None
    assert all("node setting" in why for why in log["dropped"].values())


def test_the_node_store_resumes_from_the_last_completed_round(toy_protocol, tmp_path):
    train, cfg = _data([3, 1, 4]), ToyConfig()
    gt, _ = _flower(tmp_path, train, cfg, state_dir=tmp_path / "nodes")
    for _ in range(2):
        gt.run_round()
    pid = 2  # user 2 (x = 4): s after rounds 0 and 1
    assert float(load_device_state(tmp_path / "nodes", pid, 1)["s"]) == 4.0
    assert float(load_device_state(tmp_path / "nodes", pid, 2)["s"]) == 8.0
    assert load_device_state(tmp_path / "nodes", pid, 0) is None
    # a fresh grid (a new run: empty contexts) continues from the store, as a resumed run does
    state = gt.server.model.copy()
    gt2, _ = _flower(tmp_path, train, cfg, state_dir=tmp_path / "nodes")
    gt2.server.model, gt2.server.round = state, 2
    gt2.run_round()
    local = Toy(train, cfg)
    for _ in range(3):
        local.run_round()
    np.testing.assert_allclose(gt2.server.model, local.model, atol=1e-4)


def test_a_secure_step_left_with_too_few_clients_aborts_cleanly_and_a_pair_runs_as_secagg(toy_protocol, tmp_path):
    train, cfg = _data([2, 2, 2, 2]), ToyConfig(secure_aggregation="secagg+")
    gt, _ = _flower(tmp_path, train, cfg, drop=lambda stage, nid: stage == 1 and nid != 9000)  # one answers
    stats = gt.run_round()
    log = gt.server.log[-1]
    assert log["aborted"] and stats.clients == 0 and gt.server.model.tolist() == [0.0, 0.0, 0.0]
    train, cfg = _data([2, 2, 2, 2, 2]), ToyConfig(secure_aggregation="secagg+")
    gt, _ = _flower(tmp_path / "b", train, cfg, drop=lambda stage, nid: stage == 1 and nid in (9000, 9007, 9014))
    stats = gt.run_round()  # two left: SecAgg+ has no parameters meeting its abort target for n = 2,
    # so the pair is summed by SecAgg (the complete graph, the same security; it tolerates no dropout)
    assert gt.server.log[-1]["aborted"] is None and stats.clients == 2
    assert any(r.kind == "secagg:server" for r in gt.server.transport.transcript.records)


def test_a_chain_exchange_survives_a_client_that_drops_mid_chain(toy_protocol, tmp_path):
    train, cfg = _data([1, 2, 3, 4, 5]), ToyConfig(secure_aggregation="chain")
    # stage 1 is the plaintext echo; stage 2 the chain's setup; user 4 goes silent from the first relay on
    gt, _ = _flower(tmp_path, train, cfg, drop=lambda stage, nid: stage >= 3 and nid == 9000 + 7 * 4)
    stats = gt.run_round()
    log = gt.server.log[-1]
    assert log["survivors"] == [0, 1, 2, 3] and 4 in log["dropped"] and stats.clients == 4
    np.testing.assert_allclose(gt.server.model, [10.0, 0.0, 4.0], atol=1e-4)  # the sum over the survivors only


# -- issue 23: a server that deviates through the real secagg_mod ----------------------------------------
def _count_spec(cfg):
    return SecureSum(cfg.secure_aggregation, width=3, frac_bits=cfg.frac_bits, value_clip=cfg.value_clip)


@pytest.mark.parametrize("protocol", ["secagg", "secagg+"])
def test_the_same_secure_step_twice_in_a_round_gives_no_difference_through_flower(toy_protocol, tmp_path, protocol):
    """The server asks the secure step ``count`` over every node, then again over every node but the
    victim's (secagg_mod accepts a new setup at any time): the difference would be the victim's
    ``[x, s, 1]``. Each node's guard, persisted in its own context, refuses the second answer."""
    victim = 2

    class Differencer(Toy):
        def device_round(self):
            cfg = self.config
            a = yield Exchange("count", self.users, secure=_count_spec(cfg))
            b = yield Exchange("count", self.users[self.users != victim], secure=_count_spec(cfg))
            self.log.append({"a": a.total, "b": b.total, "dropped": b.dropped, "aborted": b.aborted})
            self.round += 1
            return RoundStats(round=0, loss=0.0)

    train, cfg = _data([3, 1, 4, 1, 5]), ToyConfig(secure_aggregation=protocol)
    gt, _ = _flower(tmp_path, train, cfg)
    gt.server.__class__ = Differencer
    gt.run_round()
    log = gt.server.log[-1]
    np.testing.assert_allclose(log["a"], [14.0, 0.0, 5.0], atol=1e-3)  # the first sum is the protocol's
    assert log["b"] is None and log["aborted"]
    assert all("already answered" in why for why in log["dropped"].values() if "refused" in why)


def test_a_replayed_round_is_refused_by_nodes_that_keep_their_record_on_disk(toy_protocol, tmp_path):
    """Round 0 runs; a new grid (fresh Flower contexts, as after a server restart) claims round 0 again
    over fewer nodes: the nodes' guards, read back from their state directories, refuse it."""
    train, cfg = _data([3, 1, 4, 1, 5]), ToyConfig()
    gt, _ = _flower(tmp_path, train, cfg, state_dir=tmp_path / "nodes")
    gt.run_round()
    gt2, _ = _flower(tmp_path, train, cfg, state_dir=tmp_path / "nodes")
    gt2.server.round = 0
    gt2.run_round()
    log = gt2.server.log[-1]
    assert log["aborted"] and not log["survivors"]
    assert any("a rolled-back round is refused" in why or "already answered" in why for why in log["dropped"].values())



def test_a_node_pinned_minimum_refuses_a_small_secure_sum(toy_protocol, tmp_path):
    """Nodes configured with ``min-survivors = 4`` refuse a secure sum announced for three (their
    SecAgg client refuses at setup); with the default minimum the same round completes."""
    train, cfg = _data([3, 1, 4]), ToyConfig(secure_aggregation="secagg")
    gt, _ = _flower(tmp_path, train, cfg, node_config=lambda nid: {"min-survivors": 4})
    stats = gt.run_round()
    assert gt.server.log[-1]["aborted"] and stats.clients == 0
    gt, _ = _flower(tmp_path / "b", train, cfg)
    assert gt.run_round().clients == 3


def test_a_server_that_changes_the_protocol_configuration_mid_run_is_refused(toy_protocol, tmp_path):
    """The protocol configuration (which steps are summed securely, and how) arrives in the server's
    run record: a server could switch a node's secure step to another aggregation, or to plaintext
    for a protocol whose configuration allows it, mid-run. Each node pins the first record it answered."""
    train = _data([3, 1, 4, 1, 5])
    gt, grid = _flower(tmp_path, train, ToyConfig(secure_aggregation="secagg+"))
    assert gt.run_round().clients == 5
    meta = gt.meta
    server = build_server_trainer(get_protocol(NAME), ToyConfig(secure_aggregation="chain"), 0, meta,
                                  transport=InProcessTransport(Transcript(True)))
    gt2 = GridTrainer(grid, server, protocol=NAME, seed=0, meta=meta, timeout=30, assign=True)
    server.round = 1
    stats = gt2.run_round()
    log = gt2.server.log[-1]
    assert stats.clients == 0 and not log["echo"]
    assert all("differs from the one this node first answered" in why for why in log["dropped"].values())


def test_a_node_runs_only_the_configuration_its_operator_pinned(toy_protocol, tmp_path):
    pinned = tmp_path / "pinned.toml"
    pinned.write_text('[toyexchange]\nsecure_aggregation = "secagg"\n')
    train = _data([3, 1, 4])
    gt, _ = _flower(tmp_path / "a", train, ToyConfig(secure_aggregation="secagg+"),
                    node_config=lambda nid: {"protocol-config": str(pinned)})
    stats = gt.run_round()
    assert stats.clients == 0
    assert all("operator pinned" in why for why in gt.server.log[-1]["dropped"].values())
    gt, _ = _flower(tmp_path / "b", train, ToyConfig(secure_aggregation="secagg"),
                    node_config=lambda nid: {"protocol-config": str(pinned)})
    assert gt.run_round().clients == 3
