"""STTFedRec on separate devices (protocols/exchange.py): the server half (RS and SAS) on a census,
each client on its own rows, against the in-process run; drops, refusals and what cannot be separated.

Equality is to float rounding, not bit for bit: a client alone runs its user tower through
``vmap`` over a batch of one, the in-process run over the cohort, and the batched matrix
products round differently in the last float32 bit (the secure sums themselves are exact).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.exchange import census, run_exchanges, run_on_devices
from protocols.registry import get_protocol
from protocols.secure_sum import SecureSumAborted
from protocols.sttfedrec import STTFedRec, check_devices
from protocols.transport import InProcessTransport, Transcript
from protocols.twotower_data import TwoTowerConfig
from recmodels.data import Interactions, binarize, pair_keys
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic

SMALL = dict(hash_dim=32, clients_per_round=4, max_words=4, dim=8)
SEED = 5


@pytest.fixture(scope="module")
def train():
    raw = generate_synthetic(n_users=16, n_items=40, seed=1, dim=8, mean_interactions=8)
    return leave_one_out(binarize(raw), seed=0).train


def _own(train: Interactions, u: int) -> Interactions:
    keep = train.users == u
    return Interactions(users=train.users[keep], items=train.items[keep], ratings=train.ratings[keep],
                        timestamps=train.timestamps[keep], user_ids=train.user_ids, item_ids=train.item_ids)


def _cfg(**kw) -> TwoTowerConfig:
    return TwoTowerConfig(**{**SMALL, **kw})


def _local(train, mode="split", **kw) -> STTFedRec:
    return STTFedRec(train, _cfg(**kw), seed=SEED, mode=mode,
                     transport=InProcessTransport(Transcript(keep_payloads=False)))


def _devices(train, mode="split", **kw):
    """The server half on a census (its client data then removed: reading any of it would fail) and
    one client half per participating user on that user's rows only."""
    users = np.flatnonzero(np.bincount(train.users, minlength=train.n_users) > 0)
    server = STTFedRec(census(users, train.n_users, train.n_items, train.user_ids, train.item_ids), _cfg(**kw),
                       seed=SEED, mode=mode, transport=InProcessTransport(Transcript(keep_payloads=True)))
    server.pos_items = server.pos_start = server._forbidden = None
    server.data.user_x = server.data.user_count = server.data.click_bag = None
    server.data.train = server.data.never_negative = None
    clients = {int(u): STTFedRec(_own(train, int(u)), _cfg(**kw), seed=SEED, mode=mode) for u in users}
    return server, clients


def _params(tr) -> dict[str, torch.Tensor]:
    return {**{f"u.{k}": v for k, v in tr.user_params.items()}, **{f"v.{k}": v for k, v in tr.item_params.items()}}


def _gap(a, b) -> float:
    pa, pb = _params(a), _params(b)
    assert set(pa) == set(pb)
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)


VARIANTS = [
    dict(item_id_embedding=True, click_id_dim=16),  # the presets' options, SecAgg+ rows
    dict(decoys="download-all", item_aggregation="secagg"),
    dict(decoys="pir", item_aggregation="dpf"),  # RS and SAS as two servers: PIR requests, DPF gradients
    dict(user_features="history", item_aggregation="none"),
    dict(mode="fl", item_id_embedding=True),  # fl-twotower: plaintext updates of both towers
    pytest.param(dict(mode="fl", decoys="download-all", item_id_embedding=True), marks=pytest.mark.slow),
    pytest.param(dict(mode="fl", tower="clsm"), marks=pytest.mark.slow),
    pytest.param(dict(tower="clsm", item_aggregation="chain", chain_successors=2), marks=pytest.mark.slow),
    pytest.param(dict(decoys="download-all", item_id_embedding=True, click_id_dim=8, click_id_norm="sqrt"),
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kw", VARIANTS)
def test_separate_devices_equal_one_process(train, kw):
    local = _local(train, **kw)
    server, clients = _devices(train, **kw)
    assert np.array_equal(server._clients, local._clients)  # the census gives the same client pool
    for _ in range(2):
        a, b = local.run_round(), run_on_devices(server, clients)
        assert abs(a.loss - b.loss) < 1e-6 and a.clients == b.clients == 4
        assert a.bytes_per_client == b.bytes_per_client
        assert a.extra.keys() == b.extra.keys()
        for key in a.extra:
            assert a.extra[key] == b.extra[key], key
    assert _gap(local, server) < 1e-6
    assert _gap(local, _local(train, **kw)) > 1e-3  # the model did move
    # every client scores where its state is: the global model loaded beside its own features
    model = server.device_model()
    for u in list(clients)[:3]:
        clients[u].load_device_model(model)
        assert clients[u].device_state(u) == {}  # nothing of the round is left on the device
        assert np.allclose(clients[u].score_all(np.array([u])), local.score_all(np.array([u])), atol=1e-5)
    # the transcript: the same messages (sender, receiver, kind, size) as in process, so RS's and
    # SAS's views stay apart exactly as there
    def msgs(tr):
        return sorted((r.sender, r.receiver, r.round, r.kind, r.nbytes) for r in tr.transport.transcript.records)

    assert msgs(server) == msgs(local)
    if kw.get("mode") != "fl":
        assert {r.receiver for r in server.transport.transcript.records if r.kind == "user-gradient"} == {"sas"}


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_a_cohort_draws_what_each_member_draws_alone(train, data):
    """Requests and dropout masks come from per-user keyed streams: a device with one user's rows
    draws the row that user draws in the batched in-process cohort, and the request has the
    configured composition (clicks from the history, decoys never a forbidden pair)."""
    tr, own = _own_pair(train)
    users = np.array(sorted(data.draw(st.sets(st.sampled_from(tr._clients.tolist()), min_size=1, max_size=6))))
    t = data.draw(st.integers(0, 10_000))
    ids, labels = tr.client_requests(users, t)
    masks = tr.client_masks(users, t)
    cfg = tr.config
    for r, u in enumerate(users):
        alone_ids, alone_labels = own(int(u)).client_requests(np.array([u]), t)
        assert np.array_equal(alone_ids[0], ids[r]) and np.array_equal(alone_labels[0], labels[r])
        assert all(torch.equal(m[r:r + 1], a) for m, a in zip(masks, own(int(u)).client_masks(np.array([u]), t)))
        hist = tr.pos_items[tr.pos_start[u]:tr.pos_start[u + 1]]
        clicks = ids[r][labels[r] == 1]
        assert len(clicks) == min(len(hist), cfg.n_pos) and len(set(clicks.tolist())) == len(clicks)
        assert set(clicks.tolist()) <= set(hist.tolist())
        decoys = ids[r][labels[r] == 0]
        assert not np.isin(pair_keys(np.full(len(decoys), u), decoys, tr.n_items), tr._forbidden).any()
    assert all(set(np.unique(m.numpy()).tolist()) <= {0.0, np.float32(1 / 0.8)} for m in masks)


_PAIRS: dict = {}


def _own_pair(train):
    """One in-process trainer and a cache of one-user trainers (hypothesis reuses them)."""
    if "tr" not in _PAIRS:
        _PAIRS["tr"] = _local(train)
        _PAIRS["own"] = {}

    def own(u):
        if u not in _PAIRS["own"]:
            _PAIRS["own"][u] = STTFedRec(_own(train, u), _cfg(), seed=SEED)
        return _PAIRS["own"][u]

    return _PAIRS["tr"], own


@pytest.fixture(scope="module")
def rows_devices(train):
    """Devices under item_aggregation = "none" (plaintext rows to check) and the initial server state."""
    server, clients = _devices(train, item_aggregation="none", item_id_embedding=True)
    return server, clients, server.state_dict()


def _restart(server, state, clients=None):
    """The server back at ``state``; the devices' step records wiped too (their operators start a new
    protocol instance: a device keeps refusing a round it already answered, by design)."""
    server.load_state_dict(state)
    for c in (clients or {}).values():
        c.__dict__.pop("_device_guard", None)


@pytest.fixture(scope="module")
def request_oracle(train, rows_devices):
    """The round with its first client's request refused: who that is, the in-process round with
    that client silent (the oracle), and the full round's model."""
    server, clients, start = rows_devices
    _restart(server, start, clients)
    run_on_devices(server, clients)
    full = _params(server)
    local = _local(train, item_aggregation="none", item_id_embedding=True)
    victim = []

    def without(kind, round_, users, broadcast, per_user):
        out = local.device_step(kind, round_, users, broadcast, per_user)
        if kind == "request":
            victim.append(int(users[0]))
        return {u: v for u, v in out.items() if not (kind == "request" and u == victim[0])}

    run_exchanges(local, without)
    return victim[0], _params(local), full


@pytest.mark.parametrize("bad", [
    {"ids": np.arange(3)},  # wrong length
    {"ids": np.arange(10, dtype=np.float64)},  # wrong dtype
    {"ids": np.array([40] + [1] * 9)},  # an unknown item id
    {"ids": np.array([-1] + [1] * 9)},
    {"ids": np.arange(10), "extra": np.zeros(1)},  # wrong keys
    {"all": np.array(1)},  # a download-all token where RS serves requests
])
def test_a_refused_request_drops_only_that_client(rows_devices, request_oracle, bad):
    server, clients, start = rows_devices
    victim, oracle, full = request_oracle
    _restart(server, start, clients)
    stats = run_on_devices(server, clients, tamper=lambda ex, u, r: bad if (ex.kind, u) == ("request", victim) else r)
    assert set(server.last_dropped["request"]) == {victim} and stats.clients == 3
    assert stats.extra["requests_refused"] == 1 and stats.extra["survivors_user"] == 3
    got = _params(server)
    assert max(float((got[k] - oracle[k]).abs().max()) for k in got) < 1e-6  # = that round without the client
    assert max(float((got[k] - full[k]).abs().max()) for k in got) > 1e-4  # which differs from the full round


@pytest.fixture(scope="module")
def rows_silent(rows_devices):
    """The round with the first client silent at the item-gradient step (its rows never arrive)."""
    server, clients, start = rows_devices
    _restart(server, start, clients)
    run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "item-gradient" and u == _first(ex))
    return _params(server)


@pytest.mark.parametrize("bad", ["nan", "float64", "shape", "keys"])
def test_malformed_item_rows_drop_only_that_client(rows_devices, rows_silent, bad):
    server, clients, start = rows_devices
    _restart(server, start, clients)

    def tamper(ex, u, reply):
        if ex.kind != "item-gradient" or u != _first(ex):
            return reply
        rows = reply["rows"]
        return {"nan": {"rows": np.where(rows == 0, np.nan, rows).astype(np.float32)},
                "float64": {"rows": rows.astype(np.float64)}, "shape": {"rows": rows[:-1]},
                "keys": {"vector": rows.ravel()}}[bad]

    stats = run_on_devices(server, clients, tamper=tamper)
    (why,) = server.last_dropped["item-gradient"].values()
    assert ("expected" in why) and stats.extra["survivors_item"] == 3 and stats.extra["survivors_user"] == 4
    assert all(torch.equal(v, rows_silent[k]) for k, v in _params(server).items())  # exactly the silent client's round


def _first(ex) -> int:
    return int(ex.users[0])


def test_a_wrong_width_chain_vector_is_refused_and_a_lone_survivor_aborts(train):
    server, clients = _devices(train)
    stats = run_on_devices(server, clients, tamper=lambda ex, u, r: {"vector": r["vector"][:-1]}
                           if ex.kind == "train" and u == _first(ex) else r)
    assert stats.extra["survivors_user"] == 3 and stats.extra["survivors_item"] == 4  # its rows still count
    assert "float64 vector" in next(iter(server.last_dropped["train"].values()))
    before, round_ = _params(server), server.round
    with pytest.raises(SecureSumAborted, match="at least 2"):
        run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "train" and u != _first(ex))
    assert server.round == round_ and all(torch.equal(v, before[k]) for k, v in _params(server).items())
    assert run_on_devices(server, clients).clients == 4  # the round runs again once the clients are back


def test_clients_answer_the_gradients_only_through_secure_aggregation(train):
    tr = _local(train)
    assert tr.device_requires_secure("train") and tr.device_requires_secure("item-gradient")
    assert not tr.device_requires_secure("request")
    plain = _local(train, item_aggregation="none")
    assert plain.device_requires_secure("train") and not plain.device_requires_secure("item-gradient")
    assert not _local(train, "fl").device_requires_secure("train")  # the FL baseline uploads in plaintext


def test_check_refuses_what_cannot_be_separated():
    assert get_protocol("sttfedrec").exchanges is not None and get_protocol("fl-twotower").exchanges is not None
    with pytest.raises(ValueError, match="popularity-matched over every user's training clicks"):
        check_devices(TwoTowerConfig(decoys="fixed-pool"))
    for ok in (TwoTowerConfig(), TwoTowerConfig(decoys="download-all", item_aggregation="none", click_id_dim=64)):
        check_devices(ok)


@pytest.mark.parametrize("bad", ["nan", "shape", "index"])
def test_fl_drops_a_malformed_plaintext_update(train, bad):
    """fl-twotower on devices: an update with a NaN, a wrong shape or (download-all) an unknown id
    row is dropped with the reason; the round averages the others."""
    server, clients = _devices(train, "fl", decoys="download-all", item_id_embedding=True)

    def tamper(ex, u, reply):
        if ex.kind != "train" or u != _first(ex):
            return reply
        if bad == "nan":
            return {**reply, "user": np.full_like(reply["user"], np.nan)}
        if bad == "shape":
            return {**reply, "item": reply["item"][:-1]}
        return {**reply, "id_index": np.full_like(reply["id_index"], train.n_items)}

    stats = run_on_devices(server, clients, tamper=tamper)
    (why,) = server.last_dropped["train"].values()
    assert stats.clients == 3 and ("finite" in why or "shape" in why or "item ids" in why)


def test_a_round_with_fewer_than_two_accepted_requests_aborts_cleanly(train):
    server, clients = _devices(train)
    before, round_ = _params(server), server.round
    with pytest.raises(SecureSumAborted, match="accepted 1 request"):
        run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "request" and u != _first(ex))
    assert server.round == round_ and all(torch.equal(v, before[k]) for k, v in _params(server).items())
    assert server._served == set()  # the round may be run again
