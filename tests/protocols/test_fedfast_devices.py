"""FedFast on separate devices (protocols/exchange.py): the server half built on a census and one
client half per user, each on its own rows, give the in-process run's model, partition, user
embeddings, losses and scores; silent and malformed clients are dropped with a reason and the round
finishes with the others (checked against the ActvAGG oracle over the uploads that arrived)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.base import RoundStats
from protocols.exchange import Exchange, census, run_on_devices
from protocols.fedfast import FedFastConfig, FedFastGMF, check_devices
from protocols.registry import BuildContext, get_protocol
from protocols.transport import SERVER, InProcessTransport, Transcript
from recmodels.data import Interactions
from recmodels.synthetic import generate_synthetic

VARIANTS = {
    "fedfast": {},
    "aggregation-only": {"sampling": "uniform"},
    "sampling-only": {"aggregation": "fedavg"},
    "literal-average": {"sampling": "uniform", "aggregation": "fedavg", "user_update": "average"},
    "average-mirror": {"aggregation": "fedavg", "user_update": "average", "item_aggregation": "touched"},
    "row-random": {"item_weighting": "row", "without_replacement": True, "initial_features": "random"},
    "secagg": {"secure_aggregation": "secagg", "kmeans_init_iters": 1},
    "secagg+-row": {"secure_aggregation": "secagg+", "item_weighting": "row", "kmeans_init_iters": 1},
    "secagg-literal-average": {"secure_aggregation": "secagg", "sampling": "uniform", "aggregation": "fedavg",
                               "user_update": "average"},
    "secagg-random-every2": {"secure_aggregation": "secagg", "initial_features": "random", "kmeans_every": 2},
}


def data(users: int = 16, items: int = 30, seed: int = 1) -> Interactions:
    return generate_synthetic(n_users=users, n_items=items, dim=6, mean_interactions=6, seed=seed)


def config(**kw) -> FedFastConfig:
    base = dict(dim=6, clients_per_round=5, clusters=3, local_batch_size=16)
    base.update(kw)
    return FedFastConfig(**base)


def own(train: Interactions, u: int) -> Interactions:
    keep = train.users == u
    return Interactions(users=train.users[keep], items=train.items[keep], ratings=train.ratings[keep],
                        timestamps=train.timestamps[keep], user_ids=train.user_ids, item_ids=train.item_ids)


def devices(train: Interactions, cfg: FedFastConfig, seed: int):
    """The registry's halves: the server on a census, each client on its own rows."""
    spec = get_protocol("fedfast")
    users = np.flatnonzero(np.bincount(train.users, minlength=train.n_users) > 0)

    def ctx(rows):
        return BuildContext(split=SimpleNamespace(train=rows), config=cfg, seed=seed, source="synthetic",
                            transport=InProcessTransport(Transcript(keep_payloads=True)), data_options={})

    server = spec.build(ctx(census(users, train.n_users, train.n_items)))
    return server, {int(u): spec.exchanges.build_client(ctx(own(train, int(u)))) for u in users}


def user_state(server, clients, u: int) -> dict:
    """Where user ``u``'s state lives: the server's mirror in the plaintext variant with clusters,
    the client's device otherwise."""
    state = server.device_state_from_server(u)
    assert (state is not None) == server._mirror
    return clients[u].device_state(u) if state is None else state


def transcript(m) -> Counter:
    return Counter((r.sender, r.receiver, r.kind, r.nbytes) for r in m.transport.transcript.view(SERVER))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_separate_devices_give_the_one_process_run(name):
    train, seed = data(), 3
    cfg = config(**VARIANTS[name])
    local = FedFastGMF(train, cfg, seed=seed, transport=InProcessTransport(Transcript(keep_payloads=True)))
    server, clients = devices(train, cfg, seed)
    assert server.train.n_users == train.n_users and len(server.train) == len(clients)  # one census row each
    for _ in range(3 if "every2" in name else 2):
        a, b = local.run_round(), run_on_devices(server, clients)
        # every client trains alone as in the batch, to float32 rounding (torch picks its kernels by
        # tensor shape, so a client alone can round by an ulp differently); counts exactly
        assert b.loss == pytest.approx(a.loss, rel=1e-6)
        assert (a.clients, a.extra["examples"], a.extra["kmeans_steps"], a.extra["clusters_used"]) == \
               (b.clients, b.extra["examples"], b.extra["kmeans_steps"], b.extra["clusters_used"])
        assert a.bytes_per_client == b.bytes_per_client and b.extra["dropped"] == 0
    for k in ("item", "h", "b"):
        np.testing.assert_allclose(getattr(server, k).numpy(), getattr(local, k).numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    cl = local._clients
    np.testing.assert_array_equal(server.assign[cl], local.assign[cl])
    np.testing.assert_array_equal(server.load, local.load)
    for u in cl.tolist():
        np.testing.assert_allclose(user_state(server, clients, u)["user"], local.user[u].numpy(), rtol=1e-5, atol=1e-6)
        if cfg.secure_aggregation != "none":  # the client knows its own cluster
            assert clients[u].assign[u] == local.assign[u]
    assert transcript(server) == transcript(local)  # same messages, kinds and sizes
    # scoring on a device: the global model from the server, the user's own state
    items = np.arange(train.n_items)
    for u in cl[:4].tolist():
        c = clients[u]
        c.load_device_model(server.device_model())
        c.load_device_state(u, user_state(server, clients, u))
        np.testing.assert_allclose(c.score(np.full(len(items), u), items), local.score(np.full(len(items), u), items),
                                   rtol=1e-5, atol=1e-6)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10**4), m=st.integers(1, 8), p=st.integers(1, 4))
def test_separate_devices_give_the_one_process_run_over_seeds_and_sizes(seed, m, p):
    train = data(users=12, seed=seed % 5)
    cfg = config(clients_per_round=m, clusters=p)
    local = FedFastGMF(train, cfg, seed=seed)
    server, clients = devices(train, cfg, seed)
    for _ in range(2):
        assert run_on_devices(server, clients).loss == pytest.approx(local.run_round().loss, rel=1e-6)
    np.testing.assert_array_equal(server.assign, local.assign)
    for k in ("item", "h", "b", "user"):  # the plaintext server's mirror holds every p_u
        np.testing.assert_allclose(getattr(server, k).numpy(), getattr(local, k).numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


class Stateless:
    """A client that keeps nothing in memory between steps, as a Flower node: each step builds a
    fresh half on the user's rows, loads the state kept after the last step, runs, keeps the state."""

    def __init__(self, rows: Interactions, cfg: FedFastConfig, seed: int) -> None:
        self.rows, self.cfg, self.seed, self.state = rows, cfg, seed, None

    def fresh(self) -> FedFastGMF:
        half = FedFastGMF.on_device(self.rows, self.cfg, seed=self.seed)
        if self.state is not None:
            half.load_device_state(int(self.rows.users[0]), self.state)
        return half

    def device_requires_secure(self, kind: str) -> bool:
        return self.fresh().device_requires_secure(kind)

    def device_step(self, kind, round_, users, broadcast, per_user):
        half = self.fresh()
        out = half.device_step(kind, round_, users, broadcast, per_user)
        self.state = half.device_state(int(self.rows.users[0]))
        return out


@pytest.mark.parametrize("name", ["fedfast", "secagg-random-every2", "literal-average"])
def test_the_device_state_is_all_a_client_keeps(name):
    train, seed = data(users=12), 6
    cfg = config(**VARIANTS[name])
    local = FedFastGMF(train, cfg, seed=seed)
    server, _ = devices(train, cfg, seed)
    clients = {int(u): Stateless(own(train, int(u)), cfg, seed) for u in np.unique(train.users)}
    for _ in range(3):
        assert run_on_devices(server, clients).loss == pytest.approx(local.run_round().loss, rel=1e-6)
    for k in ("item", "h", "b"):
        np.testing.assert_allclose(getattr(server, k).numpy(), getattr(local, k).numpy(), rtol=1e-5, atol=1e-6)
    items = np.arange(train.n_items)
    for u in list(clients)[:4]:
        scorer = clients[u].fresh()
        scorer.load_device_model(server.device_model())
        if server.device_state_from_server(u) is not None:
            scorer.load_device_state(u, server.device_state_from_server(u))
        np.testing.assert_allclose(scorer.score(np.full(len(items), u), items), local.score(np.full(len(items), u), items),
                                   rtol=1e-5, atol=1e-6)


def test_the_server_half_never_holds_the_clients_data():
    train = data()
    server, clients = devices(train, config(), 0)
    assert (np.diff(server._pos_start)[server._clients] == 1).all() and (server._pos_items == 0).all()
    run_on_devices(server, clients)
    got = [r for r in server.transport.transcript.view(SERVER, round=0, kind="fedfast:popularity") if r.receiver == SERVER]
    assert sorted(int(r.sender.split(":")[-1]) for r in got) == server._clients.tolist()  # popularity: from each client
    for r in got:  # its positives, as they are in its own data
        u = int(r.sender.split(":")[-1])
        np.testing.assert_array_equal(r.payload, np.sort(train.items[train.users == u]))


# -- dropped clients ----------------------------------------------------------------------------------
def _uploads(m, t: int) -> dict:
    return {r.payload.user: r.payload for r in m.transport.transcript.view(SERVER, round=t, kind="update")}


def _actvagg_oracle(item0: np.ndarray, uploads) -> np.ndarray:
    """ActvAGG by a loop over the uploads that arrived (notes Alg. 3, per component)."""
    num, den = np.zeros_like(item0, dtype=np.float64), np.zeros_like(item0, dtype=np.float64)
    for up in uploads:
        for r, row in zip(up.rows, up.item_delta.astype(np.float64)):
            num[r] += np.abs(row) * row
            den[r] += np.abs(row)
    return item0 + np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _round_with(tamper=None, silent=None, secure: str = "none"):
    """Round 1 on devices with clients misbehaving in it (``tamper(victims)``/``silent(victims)`` make
    the callbacks from round 1's delegates, known from the in-process run of the same rounds)."""
    train, seed = data(), 5
    cfg = config(secure_aggregation=secure, kmeans_init_iters=1)
    local = FedFastGMF(train, config(kmeans_init_iters=1), seed=seed,
                       transport=InProcessTransport(Transcript(keep_payloads=True)))
    server, clients = devices(train, cfg, seed)
    local.run_round(), run_on_devices(server, clients)
    item0 = server.item.numpy().copy()
    local.run_round()
    victims = sorted(_uploads(local, 1))
    stats = run_on_devices(server, clients, tamper=tamper and tamper(victims), silent=silent and silent(victims))
    return local, server, item0, stats, victims


@pytest.mark.parametrize("secure", ["none", "secagg+"])
def test_a_silent_delegate_is_dropped_and_the_others_are_aggregated(secure):
    local, server, item0, stats, victims = _round_with(
        silent=lambda v: lambda ex, u: ex.kind == "train" and u == v[1], secure=secure)
    victim = victims[1]
    assert server.dropped == [("train", victim, "silent")] and stats.extra["dropped"] == 1
    others = [up for u, up in _uploads(local, 1).items() if u != victim]
    assert len(others) == stats.clients - 1
    want = _actvagg_oracle(item0, others)  # the in-process uploads of the others: they train the same alone
    if secure == "none":
        ups = _uploads(server, 1)
        assert sorted(ups) == sorted(up.user for up in others)
        for up in others:
            np.testing.assert_allclose(ups[up.user].item_delta, up.item_delta, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(server.item.numpy(), want, atol=1e-6)
    else:
        np.testing.assert_allclose(server.item.numpy(), want, atol=2e-5)
    assert server.round == 2  # the round finished


_BAD_UPDATES = [
    (lambda r: {k: v for k, v in r.items() if k != "loss"}, "reply keys"),
    (lambda r: {**r, "item_delta": r["item_delta"][:, :-1]}, "item_delta must be finite float32"),
    (lambda r: {**r, "h_delta": r["h_delta"].astype(np.float64)}, "h_delta must be finite float32"),
    (lambda r: {**r, "item_delta": np.full_like(r["item_delta"], np.nan)}, "item_delta must be finite"),
    (lambda r: {**r, "rows": r["rows"] + 10_000}, "item ids"),
    (lambda r: {**r, "weight": np.array(-4.0, np.float32)}, "positive whole number"),
    (lambda r: {**r, "user": np.array([np.inf] * 6, np.float32)}, "user must be finite"),
    (lambda r: {**r, "loss": 0.5}, "not an array"),
]


@pytest.mark.parametrize("group", [_BAD_UPDATES[:4], _BAD_UPDATES[4:]])
def test_malformed_updates_are_dropped_with_their_reasons(group):
    """Four of the five delegates send a malformed update each; the fifth is aggregated alone."""
    def tamper(victims):
        bad = dict(zip(victims, group))
        return lambda ex, u, r: bad[u][0](r) if ex.kind == "train" and u in bad else r

    local, server, item0, stats, victims = _round_with(tamper=tamper)
    reasons = {u: why for kind, u, why in server.dropped if kind == "train"}
    assert sorted(reasons) == victims[:4] and stats.extra["dropped"] == 4
    for u, (_, why) in zip(victims, group):
        assert why in reasons[u], (why, reasons[u])
    assert sorted(_uploads(server, 1)) == victims[4:]
    np.testing.assert_allclose(server.item.numpy(), _actvagg_oracle(item0, [_uploads(local, 1)[victims[4]]]), atol=1e-6)


def test_malformed_cluster_reports_keep_the_servers_last_cluster():
    train, seed = data(), 2
    bad = {1: ({"cluster": np.array(7, np.int64)}, "cluster must be one int64 in 0..2"),
           2: ({"cluster": np.array([0], np.int64)}, "cluster must be one int64"),
           4: ({"cluster": np.array(1.0)}, "cluster must be one int64"),
           6: ({"vector": np.zeros(3)}, "reply keys")}
    server, clients = devices(train, config(secure_aggregation="secagg", kmeans_init_iters=1), seed)
    run_on_devices(server, clients)
    before = server.assign.copy()
    stats = run_on_devices(server, clients, tamper=lambda ex, u, r: bad[u][0] if ex.kind == "fedfast:assign" and u in bad else r)
    reasons = {u: why for kind, u, why in server.dropped}
    assert {kind for kind, _, _ in server.dropped} == {"fedfast:assign"} and stats.extra["dropped"] == 4
    for u, (_, why) in bad.items():
        assert why in reasons[u] and server.assign[u] == before[u]
    others = [u for u in server._clients.tolist() if u not in bad]
    np.testing.assert_array_equal(server.assign[others], [clients[u].assign[u] for u in others])


def test_a_silent_and_a_wrong_width_kmeans_client_are_left_out_of_the_centroids():
    train, seed = data(), 4
    cfg = config(secure_aggregation="secagg+", kmeans_init_iters=1, propagate=False)
    server, clients = devices(train, cfg, seed)
    run_on_devices(server, clients)
    prev = {u: int(clients[u].assign[u]) for u in server._clients.tolist()}  # the clusters the step starts from
    stats = run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "fedfast:kmeans" and u == 3,
                           tamper=lambda ex, u, r: {"vector": np.zeros(2)} if ex.kind == "fedfast:kmeans" and u == 5 else r)
    reasons = {(k, u): why for k, u, why in server.dropped}
    assert set(reasons) == {("fedfast:kmeans", 3), ("fedfast:kmeans", 5)} and stats.extra["dropped"] == 2
    assert reasons[("fedfast:kmeans", 3)] == "silent" and "float64 vector of 7" in reasons[("fedfast:kmeans", 5)]
    # oracle: per cluster, the plain mean of the other clients' embeddings (no propagation: as after the round)
    kept = [u for u in prev if u not in (3, 5)]
    x = np.stack([clients[u].user[u].numpy().astype(np.float64) for u in kept])
    c = np.array([prev[u] for u in kept])
    for k in np.unique(c):
        np.testing.assert_allclose(server.centroids[k], x[c == k].mean(0), atol=1e-8)
    for u in prev:  # and every client, the two included, assigned itself by the new centroids
        assert server.assign[u] == clients[u].assign[u]


def test_a_secure_client_refuses_to_send_its_update_or_its_points_in_plaintext():
    class Greedy(FedFastGMF):  # a server that asks for everything in plaintext
        def device_round(self):
            for kind in ("fedfast:popularity", "train", "fedfast:kmeans", "fedfast:delegate-change"):
                got = yield Exchange(kind, self._clients, reply_keys=frozenset({"vector"}))
                self.history.append((kind, got))
            self.round += 1
            return RoundStats(round=0, loss=0.0)

    train = data()
    cfg = config(secure_aggregation="secagg+")
    users = np.unique(train.users)
    server = Greedy(census(users, train.n_users, train.n_items), cfg, seed=0)
    server.history = []
    clients = {int(u): FedFastGMF.on_device(own(train, int(u)), cfg, seed=0) for u in users}
    run_on_devices(server, clients)
    assert len(server.history) == 4
    for kind, got in server.history:
        assert not got.values and all("only through secure aggregation" in why for why in got.dropped.values()), kind
    assert not clients[0].device_requires_secure("fedfast:assign")  # the cluster report is plaintext
    assert not FedFastGMF.on_device(own(train, 0), config(), seed=0).device_requires_secure("train")


# -- configuration and construction --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_separates_onto_devices(name):
    check_devices(config(**VARIANTS[name]))  # no refusal: every step has its exchange (docs/fedfast.md)


def test_check_and_the_client_builder_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="needs a FedFastConfig"):
        get_protocol("fedfast").exchanges.check(object())
    with pytest.raises(ValueError, match="one client's half; its data holds 16 users"):
        FedFastGMF.on_device(data(), config(), seed=0)
    server, clients = devices(data(), config(), 0)
    with pytest.raises(ValueError, match="no data here"):
        clients[0].device_step("train", 0, np.array([1]), server.device_model(), {})
    with pytest.raises(ValueError, match="no client step"):
        clients[0].device_step("fedfast:nothing", 0, np.array([0]), {}, {})
    with pytest.raises(ValueError, match="must be finite float32"):
        clients[0].load_device_model({**server.device_model(), "h": np.zeros(6)})
    with pytest.raises(ValueError, match="device state: keys"):
        clients[0].load_device_state(0, {"user": np.zeros(6, np.float32)})


# -- ml-latest-small: the presets, every user on its own device (slow) ----------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fedfast", "fedfast-fedavg"])
def test_ml_latest_small_presets_on_devices(ml_latest_small, preset):
    """The preset's first rounds on 610 devices equal the in-process rounds (to float32 rounding);
    prints the seconds of both (``-s``; docs/fedfast.md, "On separate devices"). Not the secure
    preset: one all-client SecAgg+ sum over 610 clients takes minutes (docs/fedfast.md)."""
    import time

    from experiments.run.config import load_preset
    from recmodels.data import binarize
    from recmodels.loaders import load_interactions
    from recmodels.splits import leave_one_out

    train = leave_one_out(binarize(load_interactions(ml_latest_small)), seed=0).train
    cfg, rounds = load_preset(preset).protocol_config, 2
    t0 = time.perf_counter()
    local = FedFastGMF(train, cfg, seed=0)
    a = [local.run_round() for _ in range(rounds)]
    t1 = time.perf_counter()
    server, clients = devices(train, cfg, 0)
    t2 = time.perf_counter()
    b = [run_on_devices(server, clients) for _ in range(rounds)]
    t3 = time.perf_counter()
    print(f"\n{preset}: {len(clients)} clients, in process {t1 - t0:.1f} s for {rounds} rounds; on devices "
          f"{t3 - t2:.1f} s (+{t2 - t1:.1f} s building the halves); losses {[s.loss for s in a]} vs {[s.loss for s in b]}; "
          f"max |item diff| {float((server.item - local.item).abs().max()):.2e}; "
          f"bytes/client {[s.bytes_per_client for s in a]} vs {[s.bytes_per_client for s in b]}")
    for x, y in zip(a, b):
        assert y.loss == pytest.approx(x.loss, rel=1e-6) and y.extra["kmeans_steps"] == x.extra["kmeans_steps"]
    np.testing.assert_array_equal(server.assign, local.assign)
    for k in ("item", "h", "b"):
        np.testing.assert_allclose(getattr(server, k).numpy(), getattr(local, k).numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
