"""A server that deviates within the exchange interface (issue 23, items 1-3), written as the attacks.

Each test plays a server half that yields exchanges an honest server would not (the same secure
step twice over cohorts that differ in one client, a rolled-back round, a client routed alone
into a block of a secure vector) and asserts that it does NOT obtain the victim's vector. Before
the client-side guard (protocols/guard.py) and FedFast's own-block rule, every one of them
recovered the victim's exact vector (run against commit 2b1f058: each assertion below failed).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from protocols.base import RoundStats
from protocols.exchange import Exchange, census, run_exchanges, run_on_devices
from protocols.fedfast import FedFastConfig, FedFastGMF
from protocols.fedmf import FedMFConfig
from protocols.registry import BuildContext, get_protocol
from protocols.transport import InProcessTransport, Transcript
from recmodels.data import Interactions
from recmodels.mf import MFConfig
from recmodels.synthetic import generate_synthetic


def _data(users: int = 12, items: int = 30, seed: int = 3) -> Interactions:
    return generate_synthetic(n_users=users, n_items=items, dim=6, mean_interactions=6, seed=seed)


def _own(train: Interactions, u: int) -> Interactions:
    keep = train.users == u
    return Interactions(users=train.users[keep], items=train.items[keep], ratings=train.ratings[keep],
                        timestamps=train.timestamps[keep], user_ids=train.user_ids, item_ids=train.item_ids)


def _devices(name: str, train: Interactions, cfg, seed: int = 0):
    """The registry's halves: the server on a census, each client on its own rows."""
    spec = get_protocol(name)
    users = np.flatnonzero(np.bincount(train.users, minlength=train.n_users) > 0)

    def ctx(rows):
        return BuildContext(split=SimpleNamespace(train=rows), config=cfg, seed=seed, source="synthetic",
                            transport=InProcessTransport(Transcript(keep_payloads=False)), data_options={})

    server = spec.build(ctx(census(users, train.n_users, train.n_items)))
    build = spec.exchanges.build_client or spec.build
    return server, {int(u): build(ctx(_own(train, int(u)))) for u in users}


def _fedfast(**kw) -> FedFastConfig:
    base = dict(dim=6, clients_per_round=5, clusters=3, local_batch_size=16, secure_aggregation="secagg",
                kmeans_init_iters=1)
    base.update(kw)
    return FedFastConfig(**base)


def _indicator(train: Interactions, u: int) -> np.ndarray:
    out = np.zeros(train.n_items)
    out[train.items[train.users == u]] = 1.0
    return out


class _Deviating:
    """Turns a trainer into a deviating server half: ``device_round`` is the scripted generator
    ``script(trainer)``, which stores what it learnt in ``trainer.loot``."""

    def __init__(self, trainer, script):
        self.trainer, self.script = trainer, script

    def __enter__(self):
        self.trainer.loot = {}
        self.trainer.device_round = lambda: self.script(self.trainer)
        return self.trainer

    def __exit__(self, *exc):
        del self.trainer.device_round
        return False


def _popularity_twice(victim: int):
    def script(server):
        cl = server._clients
        spec = server._spec(server.train.n_items, "fedfast:popularity")
        a = yield Exchange("fedfast:popularity", cl, secure=spec)
        b = yield Exchange("fedfast:popularity", cl[cl != victim], secure=spec)
        server.loot = {"a": a.total, "b": b.total}
        server.round += 1
        return RoundStats(round=server.round - 1, loss=0.0)
    return script


def _stolen(loot: dict) -> np.ndarray | None:
    a, b = loot.get("a"), loot.get("b")
    return None if a is None or b is None else a - b


# ------------------------------------------------------------------------------------------------
# item 1: differencing by repetition
# ------------------------------------------------------------------------------------------------
def test_popularity_asked_twice_in_one_round_in_process_does_not_give_the_victims_items():
    train = _data()
    victim = 4
    m = FedFastGMF(train, _fedfast(), seed=0)
    with _Deviating(m, _popularity_twice(victim)) as server:
        run_exchanges(server, server.device_step)
    stolen = _stolen(server.loot)
    assert server.loot["a"] is not None  # the first sum is answered (a protocol step)
    assert stolen is None or not np.allclose(stolen, _indicator(train, victim))


def test_popularity_asked_twice_in_one_round_on_devices_does_not_give_the_victims_items():
    train = _data()
    victim = 4
    server, clients = _devices("fedfast", train, _fedfast())
    with _Deviating(server, _popularity_twice(victim)):
        run_on_devices(server, clients)
    stolen = _stolen(server.loot)
    assert server.loot["a"] is not None
    assert stolen is None or not np.allclose(stolen, _indicator(train, victim))


def _loss_twice(victim: int):
    """FedMF under SecAgg: the clients train, then the server asks their loss (a secure sum) over
    everyone and again, in the same round, over everyone but the victim."""
    def script(server):
        from protocols.exchange import SecureSum
        from protocols.fedmf import LOSS_CLIP, LOSS_FRAC_BITS, LOSS_SECURE

        users = server.users
        _, down = server._model_message()
        spec = SecureSum(LOSS_SECURE, width=3, frac_bits=LOSS_FRAC_BITS, value_clip=LOSS_CLIP, kind="loss")
        train_spec = SecureSum("secagg", width=server.n_items * server.dim, frac_bits=server.config.frac_bits,
                               value_clip=server.config.value_clip, kind="update")
        yield Exchange("train", users, broadcast=down, secure=train_spec)
        a = yield Exchange("loss", users, broadcast=down, secure=spec)
        b = yield Exchange("loss", users[users != victim], broadcast=down, secure=spec)
        server.loot = {"a": a.total, "b": b.total}
        server.round += 1
        return RoundStats(round=server.round - 1, loss=0.0)
    return script


def _fedmf_data() -> Interactions:
    d = generate_synthetic(n_users=8, n_items=20, dim=4, mean_interactions=6, seed=2)
    ratings = (1 + (d.items * 7 + d.users) % 5).astype(np.float32)  # a 1..5 rating scale
    return Interactions(users=d.users, items=d.items, ratings=ratings, timestamps=d.timestamps,
                        user_ids=d.user_ids, item_ids=d.item_ids)


def test_the_loss_asked_twice_in_one_round_does_not_give_the_victims_loss():
    train = _fedmf_data()
    victim = 3
    server, clients = _devices("fedmf", train, FedMFConfig(mf=MFConfig(dim=3), defense="secagg",
                                                                 rating_scale=[1.0, 5.0]))
    with _Deviating(server, _loss_twice(victim)):
        run_on_devices(server, clients)
    stolen = _stolen(server.loot)
    truth = clients[victim]._loss_step(np.array([victim]), {"q": server.q})[victim]["vector"]
    assert server.loot["a"] is not None
    assert stolen is None or not np.allclose(stolen[1], truth[1])  # not even the victim's rating count


class _Static:
    """A toy protocol whose secure vector never changes: user ``u`` holds ``x_u`` (its number of
    rows) and the one step ``"count"`` sums ``[x_u, 1]``; the server script decides the rounds."""

    def __init__(self, train: Interactions, script=None) -> None:
        self.train, self.round, self.script = train, 0, script
        self.x = np.bincount(train.users, minlength=train.n_users).astype(np.float64)
        self.users = np.flatnonzero(self.x > 0)
        self.transport = InProcessTransport(Transcript(keep_payloads=False))
        self.loot: dict = {}

    def device_round(self):
        return self.script(self)

    def device_step(self, kind, round_, users, broadcast, per_user):
        return {int(u): {"vector": np.array([self.x[u], 1.0])} for u in users}

    def device_requires_secure(self, kind):
        return True

    def device_state(self, user):
        return {}

    def load_device_state(self, user, state):
        pass


def _count(users, spec_protocol: str = "secagg"):
    from protocols.exchange import SecureSum

    return Exchange("count", users, secure=SecureSum(spec_protocol, width=2, frac_bits=8, value_clip=1e4))


def _static_devices(counts: list[int], script):
    users = np.repeat(np.arange(len(counts)), counts).astype(np.int64)
    items = np.concatenate([np.arange(c) for c in counts]).astype(np.int64)
    data = Interactions(users=users, items=items, ratings=np.ones(len(users), np.float32),
                        timestamps=np.zeros(len(users), np.int64), user_ids=np.arange(len(counts)),
                        item_ids=np.arange(max(counts)))
    server = _Static(census(np.arange(len(counts)), len(counts), max(counts)), script)
    return server, {u: _Static(_own(data, u)) for u in range(len(counts))}


def test_a_rolled_back_round_is_refused():
    """Round 1 sums everyone's static vector; round 2 runs; then the server claims round 1 again and
    asks everyone but the victim: the difference would be the victim's vector."""
    victim = 2

    def script(server):
        everyone = server.users
        calls = server.loot.setdefault("calls", 0)
        server.loot["calls"] += 1
        if calls < 2:  # rounds 1 and 2, honestly
            got = yield _count(everyone)
            server.loot.setdefault("a", got.total)
        else:  # the replayed round 1
            got = yield _count(everyone[everyone != victim])
            server.loot["b"] = got.total
        return RoundStats(round=server.round, loss=0.0)

    server, clients = _static_devices([3, 1, 4, 1, 5], script)
    for t in (1, 2, 1):
        server.round = t
        run_on_devices(server, clients)
    stolen = _stolen(server.loot)
    assert server.loot["a"] is not None
    assert stolen is None or stolen.tolist() != [4.0, 1.0]


def test_a_secure_step_asked_twice_in_one_round_is_refused_by_the_clients_that_already_answered():
    victim = 2

    def script(server):
        everyone = server.users
        a = yield _count(everyone)
        b = yield _count(everyone[everyone != victim])
        server.loot = {"a": a.total, "b": b.total, "dropped": b.dropped, "aborted": b.aborted}
        return RoundStats(round=server.round, loss=0.0)

    server, clients = _static_devices([3, 1, 4, 1, 5], script)
    run_on_devices(server, clients)
    assert server.loot["a"].tolist() == [14.0, 5.0]
    assert server.loot["b"] is None and server.loot["aborted"]
    assert all("already answered" in why for why in server.loot["dropped"].values())


# ------------------------------------------------------------------------------------------------
# item 2: the server chooses which slot of a secure vector holds a client's value
# ------------------------------------------------------------------------------------------------
def _alone_in_block_zero(victim: int):
    """A k-means sum where the server tells the victim it is in cluster 0 and everyone else that
    they are in cluster 1: block 0 of the sum would be the victim's embedding."""
    def script(server):
        cl = server._clients
        p, d = server.config.clusters, server.config.dim
        per_user = {int(u): {"cluster": np.array(0 if u == victim else 1, np.int64),
                             "group": np.array(0 if u == victim else 1, np.int64)} for u in cl}
        got = yield Exchange("fedfast:kmeans", cl, broadcast={"feature": np.array(1)}, per_user=per_user,
                             secure=server._spec(p * (d + 1), "fedfast:kmeans"))
        server.loot = {"total": got.total}
        server.round += 1
        return RoundStats(round=server.round - 1, loss=0.0)
    return script


@pytest.mark.parametrize("where", ["process", "devices"])
def test_a_server_chosen_block_does_not_give_the_victims_embedding(where):
    train = _data()
    victim = 5
    if where == "process":
        server = FedFastGMF(train, _fedfast(), seed=0)
        clients = None
    else:
        server, clients = _devices("fedfast", train, _fedfast())
    with _Deviating(server, _alone_in_block_zero(victim)):
        if clients is None:
            run_exchanges(server, server.device_step)
        else:
            run_on_devices(server, clients)
    truth = (server if clients is None else clients[victim]).user[victim].numpy().astype(np.float64)
    total = server.loot["total"]
    d = server.config.dim
    assert total is None or not np.allclose(total[:d], truth, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# item 3: singleton blocks under an honest server
# ------------------------------------------------------------------------------------------------
class _Recording(FedFastGMF):
    """The honest secure FedFast, keeping every Replies the server half received."""

    def _note(self, kind, got):
        self.seen = [*getattr(self, "seen", []), (kind, got)]
        return super()._note(kind, got)


@pytest.mark.parametrize("protocol", ["secagg", "secagg+"])
def test_no_released_cluster_sum_is_one_clients_point_or_change(protocol):
    """With many clusters over few users, start clusters and k-means clusters of one member occur
    (and clusters with one delegate): such a cluster is never summed, so every per-cluster sum the
    server receives counts at least two clients, and a cluster's published mean change is zero
    unless two delegates made it."""
    train = _data(users=16, items=30, seed=5)
    m = _Recording(train, _fedfast(secure_aggregation=protocol, clusters=6, clients_per_round=8), seed=2)
    below = 0
    for _ in range(4):
        below += sum(m.run_round().extra["clusters_below_min"].values())
    assert below > 0  # the data does produce clusters of one (the test has power)
    grouped = [(kind, g, part) for kind, got in m.seen for g, part in got.groups.items()]
    assert {kind for kind, _, _ in grouped} == {"fedfast:kmeans-profile", "fedfast:kmeans", "fedfast:delegate-change"}
    for kind, g, part in grouped:
        if part.total is not None:
            assert len(part.survivors) >= 2 and round(float(part.total[-1])) == len(part.survivors), (kind, g)


def test_the_plaintext_server_applies_the_same_minimum_so_both_give_one_model():
    """The rule is FedFast's (min_cluster), not only its secure variant's: plaintext and secure runs
    agree on data with clusters of one."""
    train = _data(users=16, items=30, seed=5)
    cfg = dict(clusters=6, clients_per_round=8)
    plain = FedFastGMF(train, _fedfast(secure_aggregation="none", **cfg), seed=2)
    secure = FedFastGMF(train, _fedfast(**cfg), seed=2)
    for _ in range(3):
        plain.run_round(), secure.run_round()
        np.testing.assert_array_equal(plain.assign, secure.assign)
    np.testing.assert_allclose(secure.item.numpy(), plain.item.numpy(), atol=2e-5)
    np.testing.assert_allclose(secure.user.numpy(), plain.user.numpy(), atol=2e-5)


# ------------------------------------------------------------------------------------------------
# across rounds: what the guard stops, and the stated limits it does not
# ------------------------------------------------------------------------------------------------
def _lightfr():
    from protocols.lightfr import LightFRConfig

    data = generate_synthetic(n_users=8, n_items=14, dim=3, mean_interactions=5, seed=0)  # ratings 1..5
    cfg = LightFRConfig(server="grad", secure_aggregation="secagg+", secure_rows="union", bits=8, rating_min=1.0,
                        rating_max=5.0)
    return data, cfg


def _lightfr_rated_rounds(victim: int):
    """LightFR's union phase in two rounds, over everyone and then over everyone but the victim."""
    def script(server):
        cl = np.unique(np.concatenate([np.arange(server.n_users)]))
        down = {"d": server.packed_items}
        cohort = cl if server.round == 0 else cl[cl != victim]
        got = yield Exchange("train_rated", cohort, broadcast=down, secure=server._secure(server.n_items, "lightfr:rated"))
        server.loot["a" if server.round == 0 else "b"] = got.total
        server.round += 1
        return RoundStats(round=server.round - 1, loss=0.0)
    return script


def test_lightfrs_union_phase_in_two_rounds_does_not_give_the_victims_rated_items():
    """The union phase's vectors were the rated indicators, the same in every round: two rounds'
    sums over cohorts that differ in the victim were its rated set. Now each is fresh random weights
    (rated_weights): the difference is noise on the items someone else rated too."""
    data, cfg = _lightfr()
    victim = 3
    server, clients = _devices("lightfr", data, cfg)
    server.loot = {}
    server.device_round = lambda: _lightfr_rated_rounds(victim)(server)
    for _ in range(2):
        run_on_devices(server, clients)
    stolen = _stolen(server.loot)
    assert server.loot["a"] is not None and stolen is not None
    assert not np.allclose(stolen, _indicator(data, victim))


def test_limit_lightfrs_rater_counts_across_rounds_give_a_clients_rated_items_it_shares():
    """Stated limit (docs/security.md): LightFR's second phase sums each client's rated indicator over
    the published union (the server needs the exact rater counts, lambda_i depends on them). A rated
    set does not change between rounds, so the counts of two rounds over cohorts that differ in one
    client are that client's indicator, on the items of both unions: honest random cohorts reach the
    same by linear algebra over enough rounds (disaggregation). Only DP noise (or hiding which rows a
    client touched) would stop it."""
    data, cfg = _lightfr()
    victim = 3
    server, clients = _devices("lightfr", data, cfg)
    counts = {}
    everyone = np.arange(data.n_users)
    for t, cohort in enumerate((everyone, everyone[everyone != victim])):
        def script(server, cohort=cohort, t=t):
            down = {"d": server.packed_items}
            rated = yield Exchange("train_rated", cohort, broadcast=down,
                                   secure=server._secure(server.n_items, "lightfr:rated"))
            rows = np.flatnonzero(rated.total > 0)
            w = server._width()
            from protocols.lightfr import STATS

            k = len(STATS)
            got = yield Exchange("union_update", rated.survivors, broadcast={"union": rows},
                                 secure=server._secure(k + len(rows) * (w + 1), "update"))
            cnt = np.zeros(server.n_items)
            cnt[rows] = np.round(got.total[k + len(rows) * w:])
            counts[t] = cnt
            server.round += 1
            return RoundStats(round=t, loss=0.0)

        server.device_round = lambda: script(server)
        run_on_devices(server, clients)
    both = (counts[0] > 0) & (counts[1] > 0)  # the items of both unions
    truth = _indicator(data, victim)
    assert both.sum() > 0 and np.array_equal((counts[0] - counts[1])[both], truth[both])


def test_limit_fedfast_points_held_still_across_rounds_give_a_clients_point():
    """Stated limit (docs/security.md, docs/fedfast.md): a client's k-means point does not change
    unless it trains or moves. A server that runs no training and no propagation between two rounds'
    k-means steps, and claims the victim dropped from its cluster's second sum, reads the victim's
    embedding as the difference. The guard cannot see it (each step is answered once per round);
    FedFast's sums are exact, so only DP noise would stop it."""
    from protocols.exchange import SecureSum

    train = _data()
    server, clients = _devices("fedfast", train, _fedfast(clusters=2))
    run_on_devices(server, clients)  # an honest round 0: the clusters exist, reported to the server
    cl = server._clients
    victim = int(cl[0])
    g = int(server.assign[victim])
    members = cl[server.assign[cl] == g]
    assert len(members) >= 3  # the victim's cluster has two others (the second sum is then released)
    sums = []
    for t, drop in ((1, frozenset()), (2, frozenset({int(np.flatnonzero(members == victim)[0])}))):
        server.round = t
        route = {int(u): g for u in members}

        def script(server, drop=drop, route=route):
            spec = SecureSum("secagg", width=server.config.dim + 1, frac_bits=32, value_clip=2.0**20,
                             kind="fedfast:kmeans", dropouts={"masked_input": drop} if drop else None)
            got = yield Exchange("fedfast:kmeans", members, broadcast={"feature": np.array(1)},
                                 per_user={u: {"group": np.array(g, np.int64)} for u in route}, secure=spec,
                                 groups=route)
            sums.append(got.groups[g].total)
            server.round += 1
            return RoundStats(round=server.round - 1, loss=0.0)

        server.device_round = lambda: script(server)
        run_on_devices(server, clients)
    truth = clients[victim].user[victim].numpy().astype(np.float64)
    np.testing.assert_allclose((sums[0] - sums[1])[:-1], truth, atol=1e-6)  # the attack succeeds: a stated limit
