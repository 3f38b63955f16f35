"""FedCL on separate devices (protocols.exchange): the server half built on a census and every
client on its own rows give the in-process run's model, losses, cache, transcript and scores; a
silent or malformed client is dropped with a reason and the round finishes with the others (the
aggregate then equals the other clients' gradients, computed in an untouched run); each client's
keyed draws are the same alone and in a cohort (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dp.rng import DeterministicTestSource
from protocols.exchange import census, run_on_devices
from protocols.fedcl import FedCL, FedCLConfig
from protocols.registry import get_protocol
from protocols.transport import InProcessTransport, Transcript
from recmodels.data import Interactions, subset
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic

SMALL = dict(dim=8, max_len=8, clients_per_round=6, clusters=3, semi_hard=5, local_pool=15, local_negatives=3,
             secure_aggregation="none")
N_USERS, N_ITEMS = 16, 50


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _data(seed: int = 0):
    split = leave_one_out(generate_synthetic(n_users=N_USERS, n_items=N_ITEMS, mean_interactions=10, seed=seed), seed=0)
    users = split.test_users
    tr = split.train
    exclude = Interactions(users=users, items=split.test_items[users], ratings=np.ones(len(users), np.float32),
                           timestamps=np.zeros(len(users), np.int64), user_ids=tr.user_ids, item_ids=tr.item_ids)
    return tr, exclude


def _sources(users) -> dict:
    """TEST-ONLY LDP noise, one reproducible stream per user (so a client alone draws the same noise)."""
    return {int(u): DeterministicTestSource(1000 + int(u)) for u in users}


def _transport(keep) -> InProcessTransport:
    return InProcessTransport(Transcript(keep_payloads=keep))


def _setup(cfg: dict, *, keep=True, seed: int = 3):
    train, exclude = _data()
    c = FedCLConfig(**{**SMALL, **cfg})
    users = np.flatnonzero(np.bincount(train.users, minlength=train.n_users) > 0)
    local = FedCL(train, c, seed=seed, transport=_transport(keep), exclude=exclude, _test_source=_sources(users))
    server = FedCL(census(users, train.n_users, train.n_items, train.user_ids, train.item_ids), c, seed=seed,
                   transport=_transport(keep))
    clients = {int(u): FedCL(subset(train, np.flatnonzero(train.users == u)), c, seed=seed, transport=_transport(False),
                             exclude=subset(exclude, np.flatnonzero(exclude.users == u)), _test_source=_sources([u]))
               for u in users}
    return local, server, clients


def _records(fc: FedCL):
    return [(r.sender, r.receiver, r.round, r.kind, r.nbytes) for r in fc.transport.transcript.view()]


def _client_scores(server: FedCL, clients: dict, users) -> np.ndarray:
    """Each user's scores on its own device: the server's model plus the state kept on the device."""
    out = []
    for u in users:
        cl = clients[int(u)]
        cl.load_device_model(server.device_model())
        cl.load_device_state(int(u), cl.device_state(int(u)))
        out.append(cl.score_all(np.array([u]))[0])
    return np.stack(out)


VARIANTS = [
    pytest.param({}, id="gru-plaintext"),
    pytest.param({"secure_aggregation": "secagg+"}, id="gru-secagg+"),
    pytest.param({"secure_aggregation": "secagg", "logq": True, "clustering": "kmeans"}, id="gru-secagg-logq-kmeans"),
    pytest.param({"encoder": "id", "upload_every": 2}, id="id-plaintext"),
    pytest.param({"encoder": "id", "secure_aggregation": "secagg+"}, id="id-secagg+"),
    pytest.param({"encoder": "sasrec", "dropout": 0.2, "blocks": 1, "heads": 2}, id="sasrec-dropout"),
    pytest.param({"semi_hard": 0, "in_batch": False}, id="fed-baseline"),
    pytest.param({"full_softmax": True, "semi_hard_mode": "hardest", "clustering": "none"}, id="full-softmax-hardest"),
]


@pytest.mark.parametrize("cfg", VARIANTS)
def test_separate_devices_equal_the_in_process_run(cfg):
    """Exact: the counts, releases, transcript and uploads. To float32 rounding: the aggregates, the
    model, the cache and the scores (the cohort's batched per-client gradients round differently from
    one client's alone, about 1e-9; through SecAgg that is at most one fixed-point step, 2^-24 / m)."""
    local, server, clients = _setup(cfg)
    for _ in range(2):
        a, b = local.run_round(), run_on_devices(server, clients)
        assert (a.round, a.clients, a.extra, a.bytes_per_client) == (b.round, b.clients, b.extra, b.bytes_per_client)
        assert a.loss == pytest.approx(b.loss, rel=1e-6) and np.isfinite(a.loss)
        assert [(r.who, r.cohort, r.params) for r in a.releases] == [(r.who, r.cohort, r.params) for r in b.releases]
        np.testing.assert_allclose(local.last_aggregate, server.last_aggregate, rtol=0, atol=2.0**-24 + 1e-8)
        assert np.abs(local.last_aggregate).max() > 1e-4  # a real gradient
    for k, v in local.device_model().items():
        np.testing.assert_allclose(v, server.device_model()[k], rtol=0, atol=1e-6)
    np.testing.assert_allclose(local.cache, server.cache, rtol=0, atol=1e-6)  # the same noise, per user
    np.testing.assert_array_equal(local.uploads, server.uploads)
    assert _records(local) == _records(server)
    users = np.array(sorted(clients))[:6]
    np.testing.assert_allclose(_client_scores(server, clients, users), local.score_all(users), rtol=0, atol=1e-6)
    if cfg.get("encoder") == "id":  # the private rows moved, on the devices only
        moved = [u for u in clients if clients[u].user_steps[u] > 0]
        assert moved and all(torch.allclose(clients[u].user[u], local.user[u], rtol=0, atol=1e-6) for u in moved)
        assert server.user_steps.sum() == 0


def test_the_in_process_fast_path_equals_the_devices_to_float32_rounding():
    """Plaintext without kept payloads: in process the cohort takes the gradient of its summed losses."""
    local, server, clients = _setup({}, keep=False)
    for _ in range(3):
        a, b = local.run_round(), run_on_devices(server, clients)
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
        np.testing.assert_allclose(local.last_aggregate, server.last_aggregate, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(local.score_all(np.arange(5)), _client_scores(server, clients, np.arange(5)),
                               rtol=1e-3, atol=1e-5)


def _capture(cfg: dict):
    """An untouched device run of one round, recording every client's train reply."""
    _, server, clients = _setup(cfg)
    seen = {}

    def tap(ex, u, reply):
        if ex.kind == "train":
            seen[u] = {k: v.copy() for k, v in reply.items()}
        return reply

    stats = run_on_devices(server, clients, tamper=tap)
    return stats, seen, server


@pytest.mark.parametrize("secure", ["none", "secagg+"])
def test_a_silent_client_is_dropped_and_the_round_is_the_others(secure):
    cfg = {"secure_aggregation": secure}
    full, seen, _ = _capture(cfg)
    quiet = sorted(seen)[2]
    _, server, clients = _setup(cfg)
    stats = run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "train" and u == quiet)
    assert server.last_dropped == {quiet: "silent"} and stats.clients == full.clients - 1
    others = [u for u in sorted(seen) if u != quiet]
    n = server._n_params()
    if secure == "none":
        want = np.stack([seen[u]["gradient"] for u in others]).sum(0) / len(others)
        np.testing.assert_array_equal(server.last_aggregate, want)
        assert stats.loss == pytest.approx(np.mean([float(seen[u]["loss"]) for u in others]), rel=1e-12)
    else:
        want = np.stack([seen[u]["vector"] for u in others]).sum(0) / len(others)
        assert np.abs(server.last_aggregate - want[:n]).max() <= 2.0**-24
        assert stats.loss == pytest.approx(want[n], abs=2.0**-20)
        assert stats.extra["semi_hard_dropped"] == round(want[n + 1] * len(others))


def test_a_round_where_every_client_is_silent_changes_no_model():
    _, server, clients = _setup({})
    before = server.device_model()
    stats = run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "train")
    assert stats.clients == 0 and np.isnan(stats.loss) and server.adam_step == 0 and server.round == 1
    assert all(np.array_equal(v, server.device_model()[k]) for k, v in before.items())
    assert len(server.last_dropped) == SMALL["clients_per_round"]


def test_a_client_silent_at_upload_gets_no_negatives_and_no_ledger_entry():
    train, _ = _data()
    _, server, clients = _setup({})
    first = run_on_devices(server, {u: c for u, c in clients.items()}, silent=lambda ex, u: ex.kind == "embedding" and u == 0)
    assert server.last_dropped == {0: "silent"} and not server.has_cache[0] and server.uploads[0] == 0
    assert "user:0" not in {r.cohort for r in first.releases}
    assert first.extra["uploads"] == len(clients) - 1
    sent_to_0 = server.transport.transcript.view("client:0", kind="negatives")
    assert all(r.nbytes == 0 for r in sent_to_0)  # sampled or not, never any semi-hard negatives


def _set(reply: dict, key: str, value) -> dict:
    return {**reply, key: value}


BAD_TRAIN = [
    pytest.param(lambda r: _set(r, "gradient", r["gradient"][:-1]), "finite float64", id="short-gradient"),
    pytest.param(lambda r: _set(r, "gradient", r["gradient"].astype(np.float32)), "finite float64", id="float32"),
    pytest.param(lambda r: _set(r, "gradient", np.full_like(r["gradient"], np.nan)), "finite float64", id="nan"),
    pytest.param(lambda r: _set(r, "loss", np.array(np.inf)), "loss", id="inf-loss"),
    pytest.param(lambda r: _set(r, "loss", np.array([1.0, 2.0])), "loss", id="loss-vector"),
    pytest.param(lambda r: _set(r, "semi_hard_dropped", np.array(99)), "semi_hard_dropped", id="count-out-of-range"),
    pytest.param(lambda r: _set(r, "semi_hard_dropped", np.array(-1)), "semi_hard_dropped", id="negative-count"),
    pytest.param(lambda r: {"gradient": r["gradient"]}, "reply keys", id="missing-keys"),
    pytest.param(lambda r: _set(r, "extra", np.zeros(1)), "reply keys", id="extra-key"),
    pytest.param(lambda r: _set(r, "loss", 1.0), "not an array", id="not-an-array"),
]


@pytest.mark.parametrize("bad, reason", BAD_TRAIN)
def test_a_malformed_train_reply_is_dropped_with_its_reason(bad, reason):
    full, seen, _ = _capture({})
    victim = sorted(seen)[0]
    _, server, clients = _setup({})
    stats = run_on_devices(server, clients, tamper=lambda ex, u, r: bad(r) if (ex.kind, u) == ("train", victim) else r)
    assert list(server.last_dropped) == [victim] and reason in server.last_dropped[victim]
    others = [u for u in sorted(seen) if u != victim]
    np.testing.assert_array_equal(server.last_aggregate, np.stack([seen[u]["gradient"] for u in others]).sum(0) / len(others))
    assert stats.clients == full.clients - 1


@pytest.mark.parametrize("bad, reason", [
    pytest.param(lambda r: {"embedding": r["embedding"][:3]}, "finite float64", id="short"),
    pytest.param(lambda r: {"embedding": np.full_like(r["embedding"], np.nan)}, "finite float64", id="nan"),
    pytest.param(lambda r: {"embedding": r["embedding"].astype(np.int64)}, "finite float64", id="int"),
    pytest.param(lambda r: {"vector": r["embedding"]}, "reply keys", id="wrong-key"),
])
def test_a_malformed_embedding_is_dropped_before_the_cache_changes(bad, reason):
    _, server, clients = _setup({})
    run_on_devices(server, clients, tamper=lambda ex, u, r: bad(r) if (ex.kind, u) == ("embedding", 5) else r)
    assert reason in server.last_dropped[5] and not server.has_cache[5] and (server.cache[5] == 0).all()
    assert server.has_cache.sum() == len(clients) - 1


def test_a_wrong_width_secure_vector_is_refused_before_summing():
    _, seen, _ = _capture({"secure_aggregation": "secagg+"})
    victim = sorted(seen)[1]
    _, server, clients = _setup({"secure_aggregation": "secagg+"})
    run_on_devices(server, clients, tamper=lambda ex, u, r: {"vector": r["vector"][:-1]}
                   if (ex.kind, u) == ("train", victim) else r)
    assert "float64 vector" in server.last_dropped[victim]
    others = [u for u in sorted(seen) if u != victim]
    want = np.stack([seen[u]["vector"] for u in others]).sum(0)[: server._n_params()] / len(others)
    assert np.abs(server.last_aggregate - want).max() <= 2.0**-24


def test_a_client_refuses_negatives_that_are_not_item_ids():
    _, _, clients = _setup({})
    cl = clients[0]
    for bad in (np.array([0, N_ITEMS]), np.array([-1, 2]), np.array([1.5, 2.0]), np.zeros((2, 2), np.int64)):
        with pytest.raises(ValueError, match="semi-hard negatives"):
            cl._client_negatives(np.array([0]), {0: {"negatives": bad}})
    with pytest.raises(ValueError, match="fedcl model"):
        cl.load_device_model({"item": np.zeros((N_ITEMS, 8), np.float32)})  # the GRU weights are missing


def test_the_server_half_on_a_census_holds_no_client_data():
    train, _ = _data()
    _, server, _ = _setup({})
    seqs, lengths = server._seq
    assert set(np.unique(seqs[seqs >= 0]).tolist()) <= {0} and lengths.max() == 1  # one placeholder each
    assert len(server._clients) == len(np.unique(train.users))


def test_check_accepts_every_configuration_and_names_the_wrong_type():
    spec = get_protocol("fedcl")
    assert spec.exchanges is not None and spec.exchanges.build_client is None
    for cfg in VARIANTS:
        spec.exchanges.check(FedCLConfig(**{**SMALL, **cfg.values[0]}))
    with pytest.raises(ValueError, match="needs a FedCLConfig"):
        spec.exchanges.check({"encoder": "gru"})
    assert get_protocol("fedcl-central").exchanges is None  # centralised: no parties to separate


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), t=st.integers(0, 1000), cohort=st.sets(st.integers(0, N_USERS - 1), min_size=1, max_size=8))
def test_keyed_client_draws_are_the_same_alone_and_in_a_cohort(seed, t, cohort):
    train, _ = _data()
    users = np.array(sorted(cohort))
    c = FedCLConfig(**{**SMALL, "dropout": 0.3})
    fc = FedCL(train, c, seed=seed)
    picks = fc._local_picks(users, t, c.max_len)
    gens = fc._dropout_generators(users, t)
    for i, u in enumerate(users):
        alone = FedCL(subset(train, np.flatnonzero(train.users == u)), c, seed=seed)
        np.testing.assert_array_equal(alone._pool[u], fc._pool[u])
        np.testing.assert_array_equal(alone._local_picks(np.array([u]), t, c.max_len)[0], picks[i])
        assert torch.equal(torch.rand(5, generator=alone._dropout_generators(np.array([u]), t)[0]),
                           torch.rand(5, generator=gens[i]))
        own = set(train.items[train.users == u].tolist())
        assert not own & set(fc._pool[u].tolist())  # never one of its own items
    assert not np.array_equal(FedCL(train, c, seed=seed + 1)._pool, fc._pool)
