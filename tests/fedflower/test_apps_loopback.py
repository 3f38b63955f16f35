"""FedAvg-GMF as Flower apps over an in-process Grid (every message through Flower's protobuf).

The promise: the same seed gives the same model as the in-process ``FedAvgGMF`` run: the same
cohorts, the same negatives and shuffles (each client's own stream), the same transcript, and
parameters equal up to float32 rounding (torch picks its reduction kernels by tensor shape, so a
client's dot products over one row can round differently from the same rows inside the batch:
usually bit-identical, at worst ~1 ulp per operation; checked with ``rtol=1e-5, atol=1e-6`` after
three rounds); each node reads only its own partition; a bad reply at the Flower boundary drops
only its sender.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedflower.adapter import (
    BadReply,
    build_server_trainer,
    decode_update,
    load_partition,
    partition_meta,
    write_partitions,
)
from fedflower.apps import GridTrainer, RoundFailed, make_client_app
from fedflower.loopback import LoopbackGrid
from protocols.fedavg import FedAvgConfig, FedAvgGMF
from protocols.registry import get_protocol
from recmodels.data import Interactions

logging.getLogger("flwr").setLevel(logging.ERROR)


def make_data(n_users: int, n_items: int, seed: int, low_ratings: bool = False):
    rng = np.random.default_rng(seed)
    users, items = [], []
    for u in range(n_users):
        chosen = rng.choice(n_items, size=int(rng.integers(1, max(2, n_items // 3))), replace=False)
        users += [u] * len(chosen)
        items += list(chosen)
    users, items = np.array(users, np.int64), np.array(items, np.int64)
    n = len(users)
    ids = dict(user_ids=np.arange(n_users), item_ids=np.arange(n_items))
    train = Interactions(users=users, items=items, ratings=np.ones(n, np.float32), timestamps=np.arange(n, dtype=np.int64), **ids)
    exclude = None
    if low_ratings:  # one rated-below-threshold item per user: never a negative
        ex_items = (items[np.r_[0, np.flatnonzero(np.diff(users)) + 1]] + 1) % n_items
        ex_users = np.unique(users)
        keep = ~np.isin(ex_users * n_items + ex_items, users * n_items + items)
        exclude = Interactions(users=ex_users[keep], items=ex_items[keep], ratings=np.zeros(keep.sum(), np.float32),
                               timestamps=np.zeros(keep.sum(), np.int64), **ids)
    return train, exclude


def flower(tmp: Path, train, exclude, cfg: FedAvgConfig, seed: int, *, drop=None, tamper=None):
    meta = write_partitions(train, exclude, tmp / "parts")
    nodes = [7000 + 13 * i for i in range(meta.clients)]
    grid = LoopbackGrid(make_client_app(tmp / "parts"), nodes, drop=drop, tamper=tamper)
    server = build_server_trainer(get_protocol("fedavg"), cfg, seed, meta)
    return GridTrainer(grid, server, protocol="fedavg", seed=seed, meta=meta, timeout=30, assign=True), grid


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    aggregation=st.sampled_from(["sum", "mean", "touched"]),
    optimizer=st.sampled_from(["adam", "sgd"]),
    epochs=st.integers(1, 2),
    batch=st.integers(1, 8),
    negatives=st.integers(0, 3),
    per_round=st.integers(2, 6),
    low=st.booleans(),
)
def test_flower_rounds_give_the_bit_identical_model(tmp_path_factory, seed, aggregation, optimizer, epochs, batch,
                                                    negatives, per_round, low):
    tmp = tmp_path_factory.mktemp("run")
    train, exclude = make_data(9, 24, seed, low_ratings=low)
    cfg = FedAvgConfig(dim=3, clients_per_round=per_round, item_aggregation=aggregation, optimizer=optimizer,
                       local_epochs=epochs, local_batch_size=batch, train_negatives=negatives, lr=0.05, init_std=0.3)
    ref = FedAvgGMF(train, cfg, seed=seed, exclude=exclude)
    gt, _ = flower(tmp, train, exclude, cfg, seed)
    for _ in range(3):
        want, got = ref.run_round(), gt.run_round()
        assert got.clients == want.clients and got.extra["dropped"] == 0
        assert got.extra["examples"] == want.extra["examples"]
        assert got.loss == pytest.approx(want.loss, rel=1e-6)  # float32 per-step sums over one client vs the batch
    for name in ("item", "h", "b"):
        torch.testing.assert_close(getattr(gt.server, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    users = np.array(partition_meta(tmp / "parts").users)
    items = np.tile(np.arange(5), (len(users), 1))
    np.testing.assert_allclose(gt.score(users, items), ref.score(users, items), rtol=1e-5, atol=1e-6)  # own p_u
    np.testing.assert_allclose(gt.score_all(users), ref.score_all(users), rtol=1e-5, atol=1e-6)
    # The transcript the server recorded is the in-process one (what every adversary's view is built from).
    def view(t):  # noqa: ANN001
        return [(r.sender, r.receiver, r.round, r.kind, r.nbytes) for r in t.transport.transcript.records]

    assert view(gt) == view(ref) and len(view(gt)) > 0


def test_each_partition_holds_only_its_users_data(tmp_path):
    train, exclude = make_data(6, 20, 1, low_ratings=True)
    meta = write_partitions(train, exclude, tmp_path)
    assert meta.clients == 6 and partition_meta(tmp_path) == meta
    for pid, u in enumerate(meta.users):
        part = load_partition(tmp_path, pid)
        assert part.user == u
        np.testing.assert_array_equal(part.items, train.items[train.users == u])  # its rows, in data order
        np.testing.assert_array_equal(part.excluded, exclude.items[exclude.users == u])
        np.testing.assert_array_equal(part.timestamps, train.timestamps[train.users == u])  # its own, aligned
        with np.load(tmp_path / f"client-{pid:07d}.npz", allow_pickle=False) as z:
            assert set(z.files) == {"user", "n_users", "n_items", "items", "excluded", "timestamps"}
    with np.load(tmp_path / "catalogue.npz", allow_pickle=False) as z:  # the public catalogue, nobody's data
        assert z.files == ["item_ids"] and np.array_equal(z["item_ids"], train.item_ids)
    with pytest.raises(FileNotFoundError, match="partition 6 not found"):
        load_partition(tmp_path, 6)


def _good_update(n_items=10, dim=3):
    return {"rows": np.array([1, 4], np.int64), "item_delta": np.ones((2, dim), np.float32),
            "h_delta": np.zeros(dim, np.float32), "b_delta": np.zeros(1, np.float32), "weight": np.ones(1, np.float32),
            "loss": np.ones(1, np.float64), "examples": np.array([5], np.int64)}


@pytest.mark.parametrize("corrupt, message", [
    (lambda u: u.pop("weight"), "missing \\['weight'\\]"),
    (lambda u: u.update(extra=np.zeros(1, np.float32)), "extra \\['extra'\\]"),
    (lambda u: u.update(item_delta=np.ones((3, 3), np.float32)), "expected item_delta \\(2, 3\\)"),
    (lambda u: u.update(h_delta=np.ones(4, np.float32)), "h_delta \\(3,\\)"),
    (lambda u: u.update(rows=np.array([1, 10])), "\\[0, 10\\)"),
    (lambda u: u.update(rows=np.array([4, 1])), "strictly increasing"),
    (lambda u: u.update(rows=np.array([1.0, 4.0])), "'rows' is float64"),
    (lambda u: u["item_delta"].__setitem__((0, 0), np.nan), "non-finite"),
    (lambda u: u.update(weight=np.zeros(1, np.float32)), "weight must be > 0"),
    (lambda u: u.update(b_delta=np.zeros(2, np.float32)), "'b_delta' has shape \\(2,\\)"),
])
def test_a_malformed_upload_is_refused_in_words(corrupt, message):
    upd = _good_update()
    decode_update(upd, n_items=10, dim=3)
    corrupt(upd)
    with pytest.raises(BadReply, match=message):
        decode_update(upd, n_items=10, dim=3)


def _forged(content: RecordDict, reply: Message) -> Message:
    """A reply with ``content`` that appears to come from ``reply``'s node."""
    out = Message(content, reply_to=reply)
    out.metadata.__dict__["_src_node_id"] = reply.metadata.src_node_id
    return out


def _replace_update(reply: Message, fn) -> Message:  # noqa: ANN001
    arrays = {k: v.numpy() for k, v in reply.content["update"].items()}
    fn(arrays)
    return _forged(RecordDict({"update": ArrayRecord({k: Array(v) for k, v in arrays.items()})}), reply)


@pytest.mark.parametrize("attack, reason", [
    (lambda r: _replace_update(r, lambda a: a.pop("loss")), "missing"),
    (lambda r: _replace_update(r, lambda a: a.update(item_delta=a["item_delta"][:-1])), "expected item_delta"),
    (lambda r: _replace_update(r, lambda a: a.update(rows=a["rows"] + 1000)), "item indices"),
    (lambda r: [r, r], "more than one reply"),
    (lambda r: _forged(RecordDict({"update": r.content["update"], "x": ArrayRecord({})}), r), "expected \\['update'\\]"),
])
def test_a_bad_reply_drops_only_its_sender_and_the_round_aggregates_the_others(tmp_path, attack, reason):
    train, _ = make_data(6, 20, 3)
    cfg = FedAvgConfig(dim=3, clients_per_round=4, lr=0.05, init_std=0.3)
    victim = {}

    def tamper(stage, nid, reply):  # noqa: ANN001
        victim.setdefault("nid", nid)  # the first node asked in round 0
        return attack(reply) if nid == victim["nid"] else reply

    gt, grid = flower(tmp_path, train, None, cfg, seed=5, tamper=tamper)
    stats = gt.run_round()
    assert stats.extra["dropped"] == 1 and stats.clients == 3
    assert any(__import__("re").search(reason, r) for r in stats.extra["drop_reasons"]), stats.extra["drop_reasons"]
    # Oracle: the in-process round, aggregated over the three other clients only.
    ref = FedAvgGMF(train, cfg, seed=5)
    sampled = ref._sample_clients()
    lr = ref._local_round(sampled)
    dropped_user = next(u for u, n in gt.node_of.items() if n == victim["nid"])
    keep = sampled != dropped_user
    slots = np.flatnonzero(keep)
    pair_keep = np.isin(lr.pair_slot, slots)
    new_slot = np.searchsorted(slots, lr.pair_slot[pair_keep])
    ref._aggregate(0, sampled[keep], new_slot, lr.pair_item[pair_keep], lr.dQ[torch.as_tensor(pair_keep)],
                   lr.dH[torch.as_tensor(keep)], lr.dB[torch.as_tensor(keep)], lr.weight[torch.as_tensor(keep)])
    torch.testing.assert_close(gt.server.item, ref.item, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gt.server.h, ref.h, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(gt.server.item, FedAvgGMF(train, cfg, seed=5).item)  # the round did move the model


def test_a_round_with_no_valid_reply_fails_cleanly_and_a_node_keeps_its_partition(tmp_path):
    train, _ = make_data(4, 16, 2)
    cfg = FedAvgConfig(dim=2, clients_per_round=2)
    gt, grid = flower(tmp_path, train, None, cfg, seed=1, drop=lambda stage, nid: True)
    with pytest.raises(RoundFailed, match="no client of 2 answered validly"):
        gt.run_round()
    # A node assigned partition 0 refuses to train anyone else's partition later (one node, one client).
    gt2, grid2 = flower(tmp_path / "b", train, None, FedAvgConfig(dim=2, clients_per_round=4), seed=1)
    gt2.run_round()  # every node now holds its partition
    u0, u1 = gt2.meta.users[0], gt2.meta.users[1]
    gt2.node_of[u1] = gt2.node_of[u0]  # a server that sends user 1's round to user 0's node
    gt2.server._sample_clients = lambda: np.array([u1])
    with pytest.raises(RoundFailed, match="refusing partition 1"):
        gt2.run_round()


@pytest.mark.parametrize("secure", ["none", "secagg+"])
def test_a_resumed_flower_run_equals_the_uninterrupted_one(tmp_path, secure):
    """Run 4 rounds; or run 2, lose every node's Flower context (a new grid, as after a crash: the
    nodes come back with nothing but their own disk) and resume the server from its checkpoint for
    2 more. Each node continues from its store (``state-dir``), ignoring what it trained in a round
    the server never completed."""
    from fedflower.adapter import load_node_state, save_node_state

    train, exclude = make_data(8, 20, 4)
    cfg = FedAvgConfig(dim=3, clients_per_round=4, lr=0.05, init_std=0.3, secure_aggregation=secure)
    meta = write_partitions(train, exclude, tmp_path / "parts")
    nodes = [7000 + 13 * i for i in range(meta.clients)]

    def trainer(state_dir, **kw):  # noqa: ANN001, ANN202
        grid = LoopbackGrid(make_client_app(tmp_path / "parts", state_dir=state_dir), nodes, **kw)
        server = build_server_trainer(get_protocol("fedavg"), cfg, 4, meta)
        return GridTrainer(grid, server, protocol="fedavg", seed=4, meta=meta, timeout=30, assign=True, resumable=True)

    straight = trainer(tmp_path / "a")
    for _ in range(4):
        straight.run_round()
    first = trainer(tmp_path / "b")
    for _ in range(2):
        first.run_round()
    checkpoint = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in first.state_dict().items()}
    first.run_round()  # a third round the server never checkpointed: the nodes' stores hold it, it is ignored
    stale = 0
    for pid in range(meta.clients):  # (make its entries absurd: using one would show)
        after, before = load_node_state(tmp_path / "b", pid, 3), load_node_state(tmp_path / "b", pid, 2)
        if after is not None and (before is None or not np.array_equal(after, before)):
            save_node_state(tmp_path / "b", pid, 2, after + 100.0)
            stale += 1
    assert stale == 4  # the four clients of round 2 stored it
    resumed = trainer(tmp_path / "b")
    resumed.load_state_dict(checkpoint)
    assert resumed.round == 2
    for _ in range(2):
        resumed.run_round()
    for name in ("item", "h", "b"):
        torch.testing.assert_close(getattr(resumed.server, name), getattr(straight.server, name), rtol=1e-5, atol=1e-6)
    users = np.array(meta.users)
    np.testing.assert_allclose(resumed.score_all(users), straight.score_all(users), rtol=1e-5, atol=1e-5)
    # Without node stores a resume is refused in words.
    plain = GridTrainer(LoopbackGrid(make_client_app(tmp_path / "parts"), nodes),
                        build_server_trainer(get_protocol("fedavg"), cfg, 4, meta), protocol="fedavg", seed=4,
                        meta=meta, timeout=30, assign=True)
    with pytest.raises(ValueError, match="give every node a state-dir"):
        plain.load_state_dict(checkpoint)


def test_a_node_state_file_keeps_the_latest_round_before_the_asked_one(tmp_path):
    from fedflower.adapter import load_node_state, save_node_state

    assert load_node_state(tmp_path, 3, 5) is None
    for r in (0, 2, 4):
        save_node_state(tmp_path, 3, r, np.full(2, float(r)))
    assert load_node_state(tmp_path, 3, 0) is None
    assert load_node_state(tmp_path, 3, 3).tolist() == [2.0, 2.0]
    assert load_node_state(tmp_path, 3, 99).tolist() == [4.0, 4.0]
    save_node_state(tmp_path, 3, 2, np.full(2, 7.0))  # a round trained again after a resume replaces the later ones
    assert load_node_state(tmp_path, 3, 99).tolist() == [7.0, 7.0]


def test_a_deployment_resumes_when_every_node_keeps_a_store(tmp_path):
    """Deployment mode (a census, partitions from each node's config): the server learns from the census
    whether every node keeps its state on disk (``state-dir``); only then may it resume."""
    train, exclude = make_data(6, 18, 9)
    cfg = FedAvgConfig(dim=3, clients_per_round=3, lr=0.05, init_std=0.3)
    meta = write_partitions(train, exclude, tmp_path / "parts")
    nodes = [8000 + 3 * i for i in range(meta.clients)]

    def node_config(with_store, nid):  # noqa: ANN001, ANN202 - what flower-supernode --node-config sets
        i = nodes.index(nid)
        conf = {"partition-id": i, "partition-dir": str(tmp_path / "parts")}
        if with_store(i):
            conf["state-dir"] = str(tmp_path / f"node{i}")
        return conf

    def trainer(with_store):  # noqa: ANN001, ANN202
        grid = LoopbackGrid(make_client_app(), nodes, node_config=lambda nid: node_config(with_store, nid))
        return GridTrainer(grid, build_server_trainer(get_protocol("fedavg"), cfg, 9, meta), protocol="fedavg",
                           seed=9, meta=meta, timeout=30)

    straight = trainer(lambda i: False)
    for _ in range(3):
        straight.run_round()
    first = trainer(lambda i: True)
    assert first.resumable and all(first.node_store.values())
    first.run_round()
    checkpoint = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in first.state_dict().items()}
    again = trainer(lambda i: True)  # the SuperNodes restarted: fresh contexts, their disks kept
    again.load_state_dict(checkpoint)
    for _ in range(2):
        again.run_round()
    for name in ("item", "h", "b"):
        torch.testing.assert_close(getattr(again.server, name), getattr(straight.server, name), rtol=1e-5, atol=1e-6)
    partial = trainer(lambda i: i != 2)  # one node without a store: refused in words
    assert not partial.resumable
    with pytest.raises(ValueError, match="1 nodes have none"):
        partial.load_state_dict(checkpoint)
