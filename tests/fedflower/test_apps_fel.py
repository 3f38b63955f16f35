"""FEL (GMF leaves) as Flower apps over an in-process Grid (every message through Flower's protobuf).

The promise: each leaf is a unit (its own cohort, model and, where configured, secure aggregation);
the server runs FEL's own round with each leaf's cohort reached through the grid and each client
trains only the leaf of its public cluster, on its own partition. With the same seed the leaves'
models, the round losses, the releases and the transcript are the in-process ``FelTrainer``'s (the
parameters to float32 rounding, as FedAvg's: see fedflower/adapter.py), and so are the ensemble's
scores, computed on each user's node from its own vector and its own positives. A bad reply drops
only its sender from its leaf's round. The partition files and the census carry each client's
public leaf and nothing else about anyone.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.run import config as cfgmod
from experiments.errors import UserError
from fedflower.adapter import (
    build_server_trainer,
    check_runs_on_flower,
    load_partition,
    partition_meta,
    public_units,
    write_partitions,
)
from fedflower.apps import GridTrainer, RoundFailed, make_client_app
from fedflower.loopback import LoopbackGrid
from protocols.fel import FelConfig, FelTrainer
from protocols.registry import get_protocol
from protocols.transport import InProcessTransport, Transcript

from .conftest import run_in_process_and_simulated
from .test_apps_loopback import _replace_update, make_data

logging.getLogger("flwr").setLevel(logging.ERROR)

SPEC = get_protocol("fel")
BASE = dict(dim=3, n_clusters=3, combiner="mean", opt_in_fraction=0.0, min_clients=2, clients_per_round=4, lr=0.05,
            init_std=0.3)


def in_process(train, exclude, cfg: FelConfig, seed: int) -> FelTrainer:
    return FelTrainer(train, cfg, seed=seed, transport=InProcessTransport(Transcript()), exclude=exclude,
                      source="synthetic")


def fel_grid(tmp: Path, train, exclude, cfg: FelConfig, seed: int, *, drop=None, tamper=None, node_config=None):
    """``node_config``: every node's own configuration (e.g. its secure-aggregation ``max-dropout``)."""
    meta = write_partitions(train, exclude, tmp / "parts", units=public_units(SPEC, cfg, seed, train, "synthetic"))
    nodes = [7000 + 13 * i for i in range(meta.clients)]
    grid = LoopbackGrid(make_client_app(tmp / "parts"), nodes, drop=drop, tamper=tamper,
                        node_config=None if node_config is None else lambda nid: node_config)
    server = build_server_trainer(SPEC, cfg, seed, meta, transport=InProcessTransport(Transcript()),
                                  user_ids=train.user_ids, source="synthetic")
    return GridTrainer(grid, server, protocol="fel", seed=seed, meta=meta, timeout=30, assign=True), grid


def aggregate_without(leaf, sampled: np.ndarray, victim: int) -> None:  # noqa: ANN001
    """Oracle: ``leaf``'s round 0 in process over its cohort without ``victim`` (an NCF leaf's MLP
    changes too), as a leaf on Flower aggregates once that client is dropped."""
    lr = leaf._local_round(sampled)
    keep = sampled != victim
    assert keep.sum() == len(sampled) - 1
    slots, kt = np.flatnonzero(keep), torch.as_tensor(keep)
    pair_keep = np.isin(lr.pair_slot, slots)
    if getattr(leaf, "_deltas", None) is not None:
        dW, dC = leaf._deltas
        leaf._deltas = (dW[kt], dC[kt])
    leaf._aggregate(0, sampled[keep], np.searchsorted(slots, lr.pair_slot[pair_keep]), lr.pair_item[pair_keep],
                    lr.dQ[torch.as_tensor(pair_keep)], lr.dH[kt], lr.dB[kt], lr.weight[kt])


def round_with_a_bad_first_reply(tmp_path, train, exclude, cfg, seed, attack):  # noqa: ANN001, ANN201
    """Round 0 on the grid with the first node asked (in leaf 0's cohort) answering ``attack(update)``;
    returns ``(grid trainer, its stats, the in-process oracle, leaf 0's cohort)``: the oracle's leaf 0
    aggregated without that client, its other leaves as usual."""
    victim: dict[str, int] = {}

    def tamper(stage, nid, reply):  # noqa: ANN001, ANN202
        victim.setdefault("nid", nid)
        return _replace_update(reply, attack) if nid == victim["nid"] else reply

    gt, _ = fel_grid(tmp_path, train, exclude, cfg, seed, tamper=tamper)
    stats = gt.run_round()
    ref = in_process(train, exclude, cfg, seed)
    sampled = ref.leaves[0]._sample_clients()
    aggregate_without(ref.leaves[0], sampled, next(u for u, n in gt.node_of.items() if n == victim["nid"]))
    for leaf in ref.leaves[1:]:
        leaf.run_round()
    return gt, stats, ref, sampled


def view(transport) -> list[tuple]:  # noqa: ANN001 - what every adversary's view is built from
    return [(r.sender, r.receiver, r.round, r.kind, r.nbytes) for r in transport.transcript.records]


def releases(stats) -> list[tuple]:  # noqa: ANN001
    return [(r.what, r.cohort, type(r.event).__name__, json.dumps(r.params, sort_keys=True, default=str))
            for r in stats.releases]


@pytest.mark.parametrize("seed, over", [
    (1, dict(combiner="mean")),
    (2, dict(combiner="median", local_epochs=2, local_batch_size=6)),
    (3, dict(combiner="max", item_aggregation="mean", optimizer="sgd")),
    (4, dict(n_clusters=1, opt_in_fraction=0.2)),  # fl-baseline: one leaf, opt-in users train nothing
    (5, dict(n_clusters=2, secure_aggregation="secagg+")),
    (6, dict(n_clusters=2, secure_aggregation="secagg", item_aggregation="touched")),
    (7, dict(dp="central", clip=0.5, noise_multiplier=0.0, server_lr=5.0)),  # central DP's clip, no noise
])
def test_flower_fel_rounds_give_the_in_process_model_and_ensemble(tmp_path, seed, over):
    train, exclude = make_data(24, 30, seed, low_ratings=True)
    cfg = FelConfig(**{**BASE, **over})
    ref = in_process(train, exclude, cfg, seed)
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, seed)
    secure = cfg.secure_aggregation != "none"
    for _ in range(3):
        want, got = ref.run_round(), gt.run_round()
        assert got.clients == want.clients and got.extra["dropped"] == 0
        assert got.extra["leaf_clients"] == want.extra["leaf_clients"]
        assert got.loss == pytest.approx(want.loss, rel=1e-5 if secure else 1e-6, abs=1e-6)
        assert releases(got) == releases(want)  # per leaf, labelled leaf:<c>, same parameters
    assert gt.server.round == ref.round == 3
    for a, b in zip(gt.server.leaves, ref.leaves):
        assert a.round == b.round == 3
        for name in ("item", "h", "b"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)
    if not secure:  # (a secure round's transcript records the SecAgg stages as Flower carried them)
        assert view(gt.server.transport) == view(ref.transport) and len(view(ref.transport)) > 0
    # The ensemble, scored on each user's node: its own leaf's vector, the others folded in from its positives.
    users = np.array(partition_meta(tmp_path / "parts").users)
    items = np.tile(np.arange(6), (len(users), 1))
    np.testing.assert_allclose(gt.score(users, items), ref.score(users, items), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gt.score_all(users), ref.score_all(users), rtol=1e-5, atol=1e-6)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), combiner=st.sampled_from(["mean", "median", "max"]), n_clusters=st.integers(1, 3),
       per_round=st.integers(1, 5), aggregation=st.sampled_from(["sum", "mean", "touched"]),
       negatives=st.integers(0, 3), opt_in=st.sampled_from([0.0, 0.2]))
def test_flower_fel_rounds_match_in_process_for_any_plaintext_config(tmp_path_factory, seed, combiner, n_clusters,
                                                                      per_round, aggregation, negatives, opt_in):
    train, exclude = make_data(24, 30, seed, low_ratings=True)
    cfg = FelConfig(**{**BASE, "combiner": combiner, "n_clusters": n_clusters, "clients_per_round": per_round,
                       "item_aggregation": aggregation, "train_negatives": negatives, "opt_in_fraction": opt_in})
    try:
        ref = in_process(train, exclude, cfg, seed)
    except ValueError as exc:  # a hash clustering that leaves a cluster below min_clients: refused alike
        assert "min_clients" in str(exc)
        with pytest.raises(ValueError, match="min_clients"):
            public_units(SPEC, cfg, seed, train, "synthetic")
        return
    gt, _ = fel_grid(tmp_path_factory.mktemp("run"), train, exclude, cfg, seed)
    for _ in range(2):
        want, got = ref.run_round(), gt.run_round()
        assert got.extra["leaf_clients"] == want.extra["leaf_clients"] and got.extra["dropped"] == 0
        assert got.loss == pytest.approx(want.loss, rel=1e-6, abs=1e-7)
    for a, b in zip(gt.server.leaves, ref.leaves):
        for name in ("item", "h", "b"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)
    assert view(gt.server.transport) == view(ref.transport)
    users = np.array(gt.meta.users)
    np.testing.assert_allclose(gt.score_all(users), ref.score_all(users), rtol=1e-5, atol=1e-6)


def test_central_dp_noise_is_added_by_the_server_and_released_per_leaf(tmp_path):
    train, exclude = make_data(24, 30, 8)
    cfg = FelConfig(**{**BASE, "dp": "central", "clip": 0.5, "noise_multiplier": 1.0, "server_lr": 5.0})
    ref = in_process(train, exclude, cfg, 8)
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, 8)
    before = [leaf.flat_model() for leaf in gt.server.leaves]
    want, got = ref.run_round(), gt.run_round()
    assert releases(got) == releases(want) and len(got.releases) == cfg.n_clusters
    assert all(r.cohort == f"leaf:{c}" and r.params["noise_multiplier"] == 1.0 for c, r in enumerate(got.releases))
    # The noise is fresh (CSPRNG) in each run, so the models differ, each by the clipped mean plus noise
    # of standard deviation server_lr * z * clip / m per coordinate.
    for leaf, b, other in zip(gt.server.leaves, before, ref.leaves):
        step = leaf.flat_model() - b
        sd = cfg.server_lr * cfg.noise_multiplier * cfg.clip / leaf.expected
        assert 0.5 * sd < np.std(step) < 2.0 * sd
        assert not np.allclose(leaf.flat_model(), other.flat_model())


def test_a_bad_reply_drops_only_its_sender_from_its_leaf(tmp_path):
    train, exclude = make_data(24, 30, 9)
    cfg = FelConfig(**BASE)
    gt, stats, ref, sampled = round_with_a_bad_first_reply(tmp_path, train, exclude, cfg, 9, lambda a: a.pop("loss"))
    assert stats.extra["dropped"] == 1 and re.search("unit 0: user .*missing", stats.extra["drop_reasons"][0])
    assert stats.extra["leaf_clients"] == [len(sampled) - 1] + [cfg.clients_in_round(len(leaf._clients))
                                                                for leaf in ref.leaves[1:]]
    for a, b in zip(gt.server.leaves, ref.leaves):
        for name in ("item", "h", "b"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(gt.server.leaves[0].item, in_process(train, exclude, cfg, 9).leaves[0].item)


def test_a_secure_leaf_sums_its_survivors_and_an_abort_stops_the_run_in_words(tmp_path):
    train, _ = make_data(24, 30, 10)
    cfg = FelConfig(**{**BASE, "n_clusters": 2, "secure_aggregation": "secagg"})
    gone: set[int] = set()

    def drop(stage, nid):  # noqa: ANN001 - leaf 0's secure round is stages 1-5: one of its nodes leaves at stage 2
        return stage == 2 and nid in gone

    gt, grid = fel_grid(tmp_path, train, None, cfg, 10, drop=drop)
    ref = in_process(train, None, replace(cfg, secure_aggregation="none"), 10)
    sampled = ref.leaves[0]._sample_clients()  # leaf 0's round-0 cohort (the same seeded choice on the server)
    victim = int(sampled[0])
    gone.add(gt.node_of[victim])
    stats = gt.run_round()
    assert stats.extra["dropped"] == 1 and stats.extra["leaf_clients"][0] == len(sampled) - 1
    # Oracle: the plaintext in-process leaf over the survivors (the secure sum is exact up to the encoding).
    lr = ref.leaves[0]._local_round(sampled)
    keep = sampled != victim
    slots = np.flatnonzero(keep)
    pair_keep = np.isin(lr.pair_slot, slots)
    ref.leaves[0]._aggregate(0, sampled[keep], np.searchsorted(slots, lr.pair_slot[pair_keep]), lr.pair_item[pair_keep],
                             lr.dQ[torch.as_tensor(pair_keep)], lr.dH[torch.as_tensor(keep)],
                             lr.dB[torch.as_tensor(keep)], lr.weight[torch.as_tensor(keep)])
    torch.testing.assert_close(gt.server.leaves[0].item, ref.leaves[0].item, rtol=1e-5, atol=1e-5)
    # Three of leaf 0's four go silent before their masked input: below SecAgg's threshold, the round stops.
    cohort = gt.server.leaves[0]
    rng_state = cohort.rng.bit_generator.state
    nxt = gt._bound[0].sample()  # (peek at round 1's cohort with the leaf's own choice, then restore it)
    cohort.rng.bit_generator.state = rng_state
    grid.gone.clear()
    gone.clear()
    gone.update(gt.node_of[int(u)] for u in nxt[:3])
    grid.drop = lambda stage, nid: nid in gone
    with pytest.raises(RoundFailed, match="unit 0: secure aggregation aborted"):
        gt.run_round()


def test_partitions_and_census_carry_only_each_clients_public_leaf(tmp_path):
    train, exclude = make_data(24, 30, 11, low_ratings=True)
    cfg = FelConfig(**{**BASE, "opt_in_fraction": 0.2})
    ref = in_process(train, exclude, cfg, 11)
    units = public_units(SPEC, cfg, 11, train, "synthetic")
    meta = write_partitions(train, exclude, tmp_path, units=units)
    assert set(json.loads((tmp_path / "meta.json").read_text())) == {"format", "n_users", "n_items", "clients", "users",
                                                                      "units"}
    for pid, u in enumerate(meta.users):
        part = load_partition(tmp_path, pid)
        want = int(ref.assignment[u]) if u not in set(ref.opt_in.tolist()) else -1  # opt-in users train no leaf
        assert part.unit == meta.units[pid] == want
        np.testing.assert_array_equal(part.items, train.items[train.users == u])  # only its own rows
        with np.load(tmp_path / f"client-{pid:07d}.npz", allow_pickle=False) as z:
            assert set(z.files) == {"user", "n_users", "n_items", "items", "excluded", "unit", "timestamps"}
    assert sum(c == -1 for c in meta.units) == len(ref.opt_in) > 0
    # The server's census: who takes part, one placeholder row each, no one's items.
    server = build_server_trainer(SPEC, cfg, 11, meta, user_ids=train.user_ids, source="synthetic")
    assert len(server.train) == meta.clients and not server.train.items.any()
    np.testing.assert_array_equal(server.opt_in, ref.opt_in)
    # Partitions written for another clustering are refused before anything runs.
    wrong = replace(meta, units=tuple((c + 1) % 3 if c >= 0 else c for c in meta.units))
    with pytest.raises(ValueError, match="other than the partitions were written with"):
        build_server_trainer(SPEC, cfg, 11, wrong, user_ids=train.user_ids, source="synthetic")


def test_a_client_trains_only_its_own_leaf(tmp_path):
    train, exclude = make_data(24, 30, 12)
    cfg = FelConfig(**{**BASE, "n_clusters": 2, "opt_in_fraction": 0.2})
    gt, grid = fel_grid(tmp_path, train, exclude, cfg, 12)
    member = next(u for u in gt.meta.users if gt.unit_of[u] == 0)
    opt_in = next(u for u in gt.meta.users if gt.unit_of[u] == -1)
    asks = [(member, 1), (opt_in, 0)]  # another leaf's request; a request to a client that trains no leaf
    msgs = [Message(RecordDict({"model": gt._model_record(gt.units[c]),
                                "run": gt._run_record(u, unit=c)}), dst_node_id=gt.node_of[u],
                    message_type=MessageType.TRAIN) for u, c in asks]
    replies = list(grid.send_and_receive(msgs, timeout=10))
    assert len(replies) == 2 and all(r.has_error() for r in replies)
    assert all(re.search(r"refusing a request to train unit", r.error.reason) for r in replies)


def test_a_deployment_census_runs_fel_to_the_in_process_model(tmp_path):
    """Deployment mode: each node holds the partition its node config names, the server asks (a census)."""
    train, exclude = make_data(20, 24, 13)
    cfg = FelConfig(**{**BASE, "n_clusters": 2})
    meta = write_partitions(train, exclude, tmp_path / "parts", units=public_units(SPEC, cfg, 13, train, "synthetic"))
    nodes = [8000 + 3 * i for i in range(meta.clients)]
    grid = LoopbackGrid(make_client_app(), nodes, node_config=lambda nid: {
        "partition-id": nodes.index(nid), "partition-dir": str(tmp_path / "parts")})
    server = build_server_trainer(SPEC, cfg, 13, meta, user_ids=train.user_ids, source="synthetic")
    gt = GridTrainer(grid, server, protocol="fel", seed=13, meta=meta, timeout=30)
    ref = in_process(train, exclude, cfg, 13)
    for _ in range(2):
        ref.run_round()
        gt.run_round()
    for a, b in zip(gt.server.leaves, ref.leaves):
        torch.testing.assert_close(a.item, b.item, rtol=1e-5, atol=1e-6)
    users = np.array(meta.users)
    np.testing.assert_allclose(gt.score_all(users), ref.score_all(users), rtol=1e-5, atol=1e-6)


def test_a_resumed_fel_run_equals_the_uninterrupted_one(tmp_path):
    """Two rounds; or one, every node's Flower context lost (a new grid), the server resumed from its
    checkpoint and each node from its own store (``state-dir``) for one more."""
    train, exclude = make_data(20, 24, 14)
    cfg = FelConfig(**{**BASE, "n_clusters": 2, "clients_per_round": 5})
    meta = write_partitions(train, exclude, tmp_path / "parts", units=public_units(SPEC, cfg, 14, train, "synthetic"))
    nodes = [7000 + 13 * i for i in range(meta.clients)]

    def trainer(state_dir):  # noqa: ANN001, ANN202
        grid = LoopbackGrid(make_client_app(tmp_path / "parts", state_dir=state_dir), nodes)
        server = build_server_trainer(SPEC, cfg, 14, meta, user_ids=train.user_ids, source="synthetic")
        return GridTrainer(grid, server, protocol="fel", seed=14, meta=meta, timeout=30, assign=True, resumable=True)

    straight = trainer(tmp_path / "a")
    for _ in range(2):
        straight.run_round()
    first = trainer(tmp_path / "b")
    first.run_round()
    checkpoint = first.state_dict()
    resumed = trainer(tmp_path / "b")
    resumed.load_state_dict(checkpoint)
    assert resumed.round == 1 and all(leaf.round == 1 for leaf in resumed.server.leaves)
    resumed.run_round()
    for a, b in zip(resumed.server.leaves, straight.server.leaves):
        for name in ("item", "h", "b"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)
    users = np.array(meta.users)
    np.testing.assert_allclose(resumed.score_all(users), straight.score_all(users), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset, reason", [
    ("fel", "over-arch"),
    ("fel-dp", "over-arch"),  # (its leaves' distributed DP runs on Flower: with a fixed combiner, below)
])
def test_fel_configurations_that_need_more_than_units_are_refused_in_words(preset, reason):
    from experiments.run.flower_run import check_protocol

    config = cfgmod.load_preset(preset)
    with pytest.raises(UserError, match=reason):
        check_protocol(config)
    for bad, why in ((dict(dp="distributed", simulate_dropout=0.2, secagg_dropout=0.2), "simulate_dropout"),):
        with pytest.raises(ValueError, match=f"cannot run with its clients on separate devices.*{why}"):
            check_runs_on_flower(SPEC, FelConfig(secure_aggregation="secagg+", combiner="mean", **bad))
    for fine in (dict(dp="central"), dict(dp="distributed"), dict(dp="central", sampling="poisson")):  # (device step)
        check_runs_on_flower(SPEC, FelConfig(secure_aggregation="secagg+", combiner="mean", **fine))
    for ok in ("fel-mean", "fel-median", "fel-max", "fl-baseline", "fel-ncf", "fel-fl"):
        check_protocol(cfgmod.load_preset(ok))
    check_protocol(cfgmod.load_preset("fedfast"))  # not units: named exchanges (docs/fedfast.md)


RAY_CONFIG = """[data]
synthetic_users = 30
synthetic_items = 150
synthetic_mean_interactions = 10
[eval]
negatives = 20
[fel]
dim = 4
n_clusters = 3
min_clients = 3
clients_per_round = 3
[run]
seed = 2
rounds = 2
eval_every = 0
"""


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fel-mean", "fl-baseline", "fel-fl", "fel-ncf"])
def test_fel_simulation_through_ray_gives_the_in_process_run(tmp_path, preset):
    """`secagg flower simulate PRESET` through Ray: the leaves (an NCF leaf's MLP included), the FL
    over-arch, metrics and transcript of `secagg run`."""
    from experiments.run.rundir import RunDir

    run_in_process_and_simulated(tmp_path, preset, RAY_CONFIG if preset != "fl-baseline"
                                 else RAY_CONFIG.replace("n_clusters = 3", "n_clusters = 1"))
    a = RunDir.open_existing(tmp_path / "sim").load_checkpoint()["trainer"]
    b = RunDir.open_existing(tmp_path / "inproc").load_checkpoint()["trainer"]
    assert len(a["leaves"]) == len(b["leaves"]) == (1 if preset == "fl-baseline" else 3)
    if preset == "fel-fl":  # (the FL over-arch: each sampled node computed its gradient)
        for k, v in b["over_arch"].items():
            torch.testing.assert_close(a["over_arch"][k], v, rtol=1e-5, atol=1e-6)
    names = ("item", "h", "b", "ncf_W", "ncf_c") if preset == "fel-ncf" else ("item", "h", "b")
    for la, lb in zip(a["leaves"], b["leaves"], strict=True):
        for name in names:
            torch.testing.assert_close(la[name], lb[name], rtol=1e-5, atol=1e-6)
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("sim", "inproc"))
    assert sa["runtime"]["engine"] == "flower simulation (ray)"
    for k, v in sb["metrics"].items():
        assert sa["metrics"][k] == pytest.approx(v, abs=1e-6), k
    assert sa["privacy"]["statement"] == sb["privacy"]["statement"]
    assert (tmp_path / "sim" / "transcript.csv").read_text() == (tmp_path / "inproc" / "transcript.csv").read_text()
