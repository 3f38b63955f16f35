"""LightFR on separate devices (protocols.exchange): the server half built on a census and every
client built on its own ratings give the in-process run exactly (codes, losses, scores); silent and
malformed clients are dropped with a reason and the round equals the in-process round without them;
what cannot be separated is refused in words."""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.exchange import census, run_on_devices
from protocols.lightfr import STATS, LightFR, LightFRConfig, UpdateError, device_check
from protocols.registry import get_protocol
from recmodels import binary_codes as bc
from recmodels.data import Interactions
from recmodels.synthetic import generate_synthetic

VARIANTS = [  # (server update, secure aggregation, secure rows)
    ("grad", "none", "union"), ("para", "none", "union"), ("dcd", "none", "union"),
    ("grad", "secagg+", "union"), ("para", "secagg", "all"), ("dcd", "secagg+", "union"), ("grad", "secagg+", "all"),
    ("grad", "dpf", "all"),  # two servers (docs/dpf.md): key sets of the rated rows only
]


def _data(seed: int = 0, n: int = 8, m: int = 14) -> Interactions:
    return generate_synthetic(n_users=n, n_items=m, dim=3, mean_interactions=5, seed=seed)  # ratings 1..5


def _cfg(server: str = "grad", secure: str = "none", rows: str = "union", **kw) -> LightFRConfig:
    kw = {"bits": 8, "rating_min": 1.0, "rating_max": 5.0, **kw}
    return LightFRConfig(server=server, secure_aggregation=secure, secure_rows=rows, **kw)


def _without(data: Interactions, drop: set[int]) -> Interactions:
    keep = ~np.isin(data.users, sorted(drop))
    return Interactions(users=data.users[keep], items=data.items[keep], ratings=data.ratings[keep],
                        timestamps=data.timestamps[keep], user_ids=data.user_ids, item_ids=data.item_ids)


def _own(data: Interactions, u: int) -> Interactions:
    return _without(data, set(np.unique(data.users).tolist()) - {u})


def _devices(data: Interactions, cfg: LightFRConfig, seed: int) -> tuple[LightFR, dict[int, LightFR]]:
    users = np.unique(data.users)
    server = LightFR(census(users, data.n_users, data.n_items, data.user_ids, data.item_ids), cfg, seed=seed)
    return server, {int(u): LightFR(_own(data, int(u)), cfg, seed=seed) for u in users}


def _plain_records(m: LightFR) -> list[tuple]:
    """The server's plaintext sends and receives (a secure upload's records come from the runtime)."""
    plain = ("model", "lightfr:union") + (("update",) if m.config.secure_aggregation == "none" else ())
    return [(r.round, r.sender, r.receiver, r.kind, r.nbytes) for r in m.transport.transcript.view("server")
            if r.kind in plain]


@pytest.mark.parametrize("server_update, secure, rows", VARIANTS)
def test_devices_equal_the_in_process_run(server_update, secure, rows):
    data = _data(3)
    cfg = _cfg(server_update, secure, rows, lambda_item=0.05, lambda_user=0.05, client_fraction=0.75)
    local = LightFR(data, cfg, seed=3)
    server, clients = _devices(data, cfg, seed=3)
    for _ in range(2):
        a, b = local.run_round(), run_on_devices(server, clients)
        np.testing.assert_array_equal(server.d, local.d)
        assert a.loss == b.loss and np.isfinite(a.loss)  # exact: the same reports, summed in the same order
        assert (a.clients, a.bytes_per_client) == (b.clients, b.bytes_per_client)
        for key in ("items_moved", "user_sweeps_mean", "users_converged", "clients_answered", "clients_dropped"):
            assert a.extra[key] == b.extra[key], key
    for u, c in clients.items():  # every client's code lives on its device only
        np.testing.assert_array_equal(c.b[u], local.b[u])
    assert _plain_records(server) == _plain_records(local)  # the server's plaintext sends/receives
    # scores on a fresh device from the global model and the client's own state
    items = np.tile(np.arange(data.n_items), (1, 1))
    for u in list(clients)[:3]:
        fresh = LightFR(_own(data, u), cfg, seed=3)
        fresh.load_device_model(server.device_model())
        fresh.load_device_state(u, clients[u].device_state(u))
        np.testing.assert_array_equal(fresh.score(np.array([u]), items), local.score(np.array([u]), items))


def test_the_reported_loss_is_the_answering_clients_error_after_their_local_dcd():
    """Oracle: each client's squared error on its own ratings against the D it received."""
    data = _data(5)
    m = LightFR(data, _cfg(client_fraction=0.5), seed=5)
    d0, state = m.d.copy(), copy.deepcopy(m.rng.bit_generator.state)
    sel = m.sample_clients()
    m.rng.bit_generator.state = state
    stats = m.run_round()
    keep = np.isin(m.users, sel)
    sim = 0.5 + np.einsum("pf,pf->p", m.b[m.users[keep]].astype(float), d0[m.items[keep]].astype(float)) / (2 * m.f)
    want = float(np.mean((m.r[keep] - sim) ** 2))
    assert stats.loss == pytest.approx(want, abs=len(sel) * m.report_scales()[0] * 2.0**-m.config.frac_bits)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), lam=st.sampled_from([0.0, 0.1]), frac=st.sampled_from([0.4, 1.0]),
       server_update=st.sampled_from(["grad", "para", "dcd"]))
def test_devices_equal_the_in_process_run_for_any_seed(seed, lam, frac, server_update):
    data = _data(seed, n=7, m=11)
    cfg = _cfg(server_update, lambda_user=lam, lambda_item=lam, client_fraction=frac)
    local, (server, clients) = LightFR(data, cfg, seed=seed), _devices(data, cfg, seed)
    for _ in range(2):
        assert local.run_round().loss == run_on_devices(server, clients).loss
    np.testing.assert_array_equal(server.d, local.d)
    assert all((c.b[u] == local.b[u]).all() for u, c in clients.items())


def test_the_public_rating_scale_defaults_to_the_training_range_in_process():
    data = _data(2)
    a = LightFR(data, dataclasses.replace(_cfg(), rating_min=float("nan"), rating_max=float("nan")), seed=2)
    b = LightFR(data, _cfg(), seed=2)  # 1..5 is this data's range
    assert (a.lo, a.hi) == (b.lo, b.hi) == (1.0, 5.0)
    a.run_round(), b.run_round()
    np.testing.assert_array_equal(a.d, b.d)
    c = LightFR(data, _cfg(rating_min=0.0, rating_max=4.0), seed=2)  # a rating above the scale is clipped
    assert c.r.max() == 1.0 and c.r.min() == 0.25


@pytest.mark.parametrize("secure, rows, kind", [
    ("none", "union", "train"), ("secagg+", "union", "train_rated"), ("secagg+", "union", "union_update"),
    ("secagg", "all", "train_dense"),
])
def test_a_silent_client_is_left_out_and_the_round_equals_the_round_without_it(secure, rows, kind):
    data = _data(4)
    cfg = _cfg("grad", secure, rows, client_fraction=1.0)
    gone = 2
    ref = LightFR(_without(data, {gone}), cfg, seed=4)  # the same draws; client 2 has nothing to send
    server, clients = _devices(data, cfg, seed=4)
    a = ref.run_round()
    b = run_on_devices(server, clients, silent=lambda ex, u: ex.kind == kind and u == gone)
    assert server.dropped[gone] == "silent" or "dropped" in server.dropped[gone]
    np.testing.assert_array_equal(server.d, ref.d)
    assert a.loss == b.loss and b.extra["clients_answered"] == data.n_users - 1
    for u, c in clients.items():
        if u != gone:
            np.testing.assert_array_equal(c.b[u], ref.b[u])


def _swap(key, value):
    return lambda r: {**r, key: value(r[key])}


@pytest.mark.parametrize("tamper, reason", [
    (lambda r: {k: v for k, v in r.items() if k != "stats"}, "reply keys"),
    (lambda r: {**r, "extra": np.zeros(1)}, "reply keys"),
    (_swap("body", lambda b: b[:, :-1]), "shape"),
    (_swap("body", lambda b: b.astype(np.float32)), "float64"),
    (_swap("body", lambda b: np.where(np.arange(b.size).reshape(b.shape) == 0, np.nan, b)), "finite"),
    (_swap("body", lambda b: b + 9.0), "exceeds"),
    (_swap("items", lambda i: i + 100), "unknown item"),
    (_swap("items", lambda i: -i - 1), "unknown item"),
    (_swap("items", lambda i: i.astype(np.float64)), "int array"),
    (_swap("items", lambda i: i[::-1].copy() if len(i) > 1 else np.array([i[0], i[0]])), "ascending|shape"),
    (_swap("stats", lambda s: s + 2.0), "report"),
    (_swap("stats", lambda s: np.full(s.shape, np.nan)), "report"),
    (_swap("stats", lambda s: s[:2]), "report"),
    (_swap("body", lambda b: [list(x) for x in b]), "not an array"),
])
def test_a_malformed_plaintext_reply_is_dropped_with_its_reason(tamper, reason):
    data = _data(6)
    cfg = _cfg("grad", client_fraction=1.0)
    bad = 3
    ref = LightFR(_without(data, {bad}), cfg, seed=6)
    server, clients = _devices(data, cfg, seed=6)
    a = ref.run_round()
    b = run_on_devices(server, clients, tamper=lambda ex, u, r: tamper(r) if u == bad else r)
    assert set(server.dropped) == {bad}
    assert re.search(reason, server.dropped[bad]), server.dropped[bad]
    np.testing.assert_array_equal(server.d, ref.d)
    assert a.loss == b.loss and b.extra["clients_dropped"] == 1


@pytest.mark.parametrize("kind", ["train_rated", "union_update"])
@pytest.mark.parametrize("tamper", [
    lambda r: {"vector": r["vector"][:-1]},
    lambda r: {"vector": r["vector"].astype(np.float32)},
    lambda r: {"vector": r["vector"], "items": np.zeros(1)},
])
def test_a_malformed_secure_vector_is_dropped_before_the_sum(kind, tamper):
    data = _data(8)
    cfg = _cfg("para", "secagg+", "union", client_fraction=1.0)
    bad = 1
    ref = LightFR(_without(data, {bad}), cfg, seed=8)
    server, clients = _devices(data, cfg, seed=8)
    a = ref.run_round()
    b = run_on_devices(server, clients, tamper=lambda ex, u, r: tamper(r) if (ex.kind, u) == (kind, bad) else r)
    assert set(server.dropped) == {bad}
    np.testing.assert_array_equal(server.d, ref.d)
    assert a.loss == b.loss


def test_a_client_refuses_a_malformed_broadcast_before_changing_its_code():
    data = _data(1)
    m = LightFR(data, _cfg(), seed=1)
    u = int(data.users[0])
    b0 = m.b.copy()
    good = m.device_model()
    for bad in ({"d": good["d"][:-1]}, {"d": good["d"].astype(np.int64)}, {},
                {"d": good["d"] | np.uint64(1 << 40)}):  # bits beyond f = 8
        with pytest.raises(UpdateError, match="item codes"):
            m.device_step("train", 0, np.array([u]), bad, {})
    np.testing.assert_array_equal(m.b, b0)
    secure = LightFR(data, _cfg(secure="secagg+"), seed=1)
    secure.device_step("train_rated", 0, np.array([u]), good, {})
    own = np.unique(data.items[data.users == u])
    with pytest.raises(UpdateError, match="outside the published union"):
        secure.device_step("union_update", 0, np.array([u]), {"union": own[1:]}, {})
    with pytest.raises(UpdateError, match="ascending"):
        secure.device_step("union_update", 0, np.array([u]), {"union": own[::-1].copy()}, {})
    with pytest.raises(ValueError, match="no client step"):
        m.device_step("aggregate", 0, np.array([u]), good, {})


def test_a_secure_client_refuses_a_plaintext_request_for_its_upload():
    """A server that asks a SecAgg+-configured client for a plaintext "train" gets nothing from it."""
    data = _data(2)
    cfg = _cfg("grad", "secagg+", client_fraction=1.0)
    server, clients = _devices(data, cfg, seed=2)
    assert all(c.device_requires_secure(k) for c in clients.values() for k in ("train", "train_rated", "union_update"))
    assert not LightFR(data, _cfg(), seed=2).device_requires_secure("train")
    plain = LightFR(census(np.unique(data.users), data.n_users, data.n_items), _cfg(client_fraction=1.0), seed=2)
    d0 = plain.d.copy()
    stats = run_on_devices(plain, clients)  # a (malicious) plaintext server half against secure clients
    assert set(plain.dropped) == set(clients) and all("refused" in why for why in plain.dropped.values())
    assert stats.extra["clients_answered"] == 0 and np.isnan(stats.loss)
    np.testing.assert_array_equal(plain.d, d0)


def test_device_state_round_trips_and_refuses_a_bad_code():
    data = _data(1)
    m = LightFR(data, _cfg(secure="secagg+"), seed=1)
    u = int(data.users[0])
    m.device_step("train_rated", 0, np.array([u]), m.device_model(), {})
    state = m.device_state(u)
    assert {"b", "pending_items", "pending_body", "pending_stats", "pending_round"} == set(state)
    other = LightFR(_own(data, u), _cfg(secure="secagg+"), seed=1)
    other.load_device_state(u, state)
    union = {"union": np.arange(data.n_items)}
    np.testing.assert_array_equal(other.device_step("union_update", 0, np.array([u]), union, {})[u]["vector"],
                                  m.device_step("union_update", 0, np.array([u]), union, {})[u]["vector"])
    assert len(m.device_state(u)) == 1  # the upload left the device
    with pytest.raises(bc.CodeError, match="only -1 and \\+1"):
        other.load_device_state(u, {"b": np.zeros(m.f, np.int8)})
    with pytest.raises(ValueError, match="must hold"):
        other.load_device_state(u, {"b": state["b"], "x": np.zeros(1)})


def test_the_secure_vector_starts_with_the_report_and_ends_with_the_indicator():
    data = _data(2)
    m = LightFR(data, _cfg(secure="secagg", rows="all"), seed=2)
    u = int(data.users[0])
    vec = m.device_step("train_dense", 0, np.array([u]), m.device_model(), {})[u]["vector"]
    k, w, n = len(STATS), m._width(), m.n_items
    own = np.unique(data.items[data.users == u])
    assert vec.shape == (k + n * (w + 1),) and np.all((0 <= vec[:k]) & (vec[:k] <= 1))
    np.testing.assert_array_equal(np.flatnonzero(vec[-n:]), own)  # the indicator is last (attacks read it there)
    assert vec[2] in (0.0, 1.0)


@pytest.mark.parametrize("change, words", [
    ({"init": "mf"}, "pre-trains a real-valued MF centrally"),
    ({"server": "none"}, "trains nothing"),
    ({"rating_min": float("nan"), "rating_max": float("nan")}, "rating_min and lightfr.rating_max"),
])
def test_check_refuses_what_cannot_be_separated_in_words(change, words):
    spec = get_protocol("lightfr")
    assert spec.exchanges is not None
    spec.exchanges.check(_cfg())  # the default, with a public rating scale, is fine
    spec.exchanges.check(_cfg("dcd", "secagg+", "all"))
    with pytest.raises(ValueError, match=words):
        device_check(dataclasses.replace(_cfg(), **change))


@pytest.mark.parametrize("kwargs", [{"rating_min": 1.0}, {"rating_min": 5.0, "rating_max": 1.0},
                                    {"rating_min": float("inf"), "rating_max": float("inf")}])
def test_a_half_or_empty_rating_scale_is_refused(kwargs):
    with pytest.raises(ValueError, match="lightfr.rating_m"):
        LightFRConfig(**kwargs)


@pytest.mark.parametrize("server_update, secure, sampling", [("grad", "none", "with-replacement"),
                                                             ("dcd", "secagg+", "without-replacement")])
def test_devices_equal_the_in_process_run_with_the_authors_options(server_update, secure, sampling):
    """The authors' code's options (stickiness, add-back per sampled client, sweeps to a fixed point, sampling
    with replacement in plaintext, early stop) need nothing on the server beyond the replies and the sums."""
    data = _data(4)
    cfg = _cfg(server_update, secure, user_stickiness=0.6, item_add_back="sampled", sweeps="fixed-point",
               client_sampling=sampling, early_stop="authors", client_fraction=0.75)
    local = LightFR(data, cfg, seed=1)
    server, clients = _devices(data, cfg, seed=1)
    for _ in range(3):
        a, b = local.run_round(), run_on_devices(server, clients)
        np.testing.assert_array_equal(server.d, local.d)
        assert a.loss == b.loss and a.clients == b.clients
        assert a.extra.get("early_stopped") == b.extra.get("early_stopped")
    for u, c in clients.items():
        np.testing.assert_array_equal(c.b[u], local.b[u])
