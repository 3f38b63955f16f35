"""FedCL's LDP budget, counted on the client (issue 23, item 7).

The attack: a deviating server half asks the same client for its LDP embedding again and again (in
one round, and across rounds past the configured ``user_budget``) and averages the noisy uploads:
the error against the client's true (clipped) embedding shrinks like ``1/sqrt(k)``, the client has
spent ``k epsilon``, and the ledger holds only what the server chose to record. The defence lives in
the client half: every upload is charged to the client's own guard before it is computed, a second
upload in one round and an upload beyond ``upload_every``, ``user_budget`` or the operator's
``ldp_epsilon_budget`` are refused, and the count survives a resumed run (the trainer's state).

The same attack on Flower is in ``tests/fedflower/test_fedcl_budget_flower.py``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dp.clipping import clip_rows_l1
from dp.rng import DeterministicTestSource
from protocols.base import RoundStats
from protocols.exchange import Exchange, admit_step, census, run_on_devices
from protocols.fedcl import FedCL, FedCLConfig
from protocols.guard import DevicePolicy, RefusedStep, device_guard, set_device_policy
from protocols.state import state_from_bytes, state_to_bytes
from protocols.transport import InProcessTransport, Transcript
from recmodels.data import Interactions, subset
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(dim=8, max_len=8, clients_per_round=6, clusters=3, semi_hard=5, local_pool=15, local_negatives=3,
             secure_aggregation="none")
N_USERS, N_ITEMS = 16, 50
VICTIMS = (2, 5, 11)


@functools.lru_cache(maxsize=1)
def _data():
    split = leave_one_out(generate_synthetic(n_users=N_USERS, n_items=N_ITEMS, mean_interactions=10, seed=0), seed=0)
    users, tr = split.test_users, split.train
    exclude = Interactions(users=users, items=split.test_items[users], ratings=np.ones(len(users), np.float32),
                           timestamps=np.zeros(len(users), np.int64), user_ids=tr.user_ids, item_ids=tr.item_ids)
    return tr, exclude


def _sources(users) -> dict:
    """TEST-ONLY LDP noise, one reproducible stream per user."""
    return {int(u): DeterministicTestSource(7000 + int(u)) for u in users}


class Repeater(FedCL):
    """A deviating server half: in one round it asks ``VICTIMS`` for their embedding ``K`` times, keeps
    every reply, trains nothing and records no release (it chooses what the ledger holds)."""

    K = 32

    def device_round(self):
        t, model = self.round, self.device_model()
        self.collected: dict[int, list[np.ndarray]] = {v: [] for v in VICTIMS}
        self.refusals: dict[int, list[str]] = {v: [] for v in VICTIMS}
        for _ in range(self.K):
            got = yield Exchange("embedding", np.array(VICTIMS), broadcast=model, reply_keys=frozenset({"embedding"}),
                                 validate=self._check_embedding)
            for u, e in got.values.items():
                self.collected[u].append(e)
            for u, why in got.dropped.items():
                self.refusals[u].append(why)
        self.round += 1
        return RoundStats(round=t, loss=0.0)


class Asker(FedCL):
    """A deviating server half: every round it asks ``VICTIMS`` for their embedding whatever its own
    upload policy (``_due``) says, and records one ledger entry per accepted upload."""

    def device_round(self):
        t = self.round
        got = yield Exchange("embedding", np.array(VICTIMS), broadcast=self.device_model(),
                             reply_keys=frozenset({"embedding"}), validate=self._check_embedding)
        self.accepted = getattr(self, "accepted", {v: [] for v in VICTIMS})
        self.refusals = getattr(self, "refusals", {v: [] for v in VICTIMS})
        for u in got.values:
            self.accepted[u].append(t)
        for u, why in got.dropped.items():
            self.refusals[u].append(why)
        self.round += 1
        return RoundStats(round=t, loss=0.0, releases=tuple(self._upload_release(u) for u in got.values))


def _runtime(kind: type, cfg: dict, where: str, policy: DevicePolicy | None = None):
    """``(server, play)``: the deviating server half and one round of it, ``where`` in one process
    (the trainer plays every client) or on simulated devices (each client on its own rows)."""
    train, exclude = _data()
    c = FedCLConfig(**{**SMALL, **cfg})
    users = np.flatnonzero(np.bincount(train.users, minlength=train.n_users) > 0)
    if where == "in-process":
        server = kind(train, c, seed=3, transport=InProcessTransport(Transcript(False)), exclude=exclude,
                      _test_source=_sources(users))
        if policy is not None:
            set_device_policy(server, policy)
        return server, server, server.run_round
    server = kind(census(users, train.n_users, train.n_items, train.user_ids, train.item_ids), c, seed=3,
                  transport=InProcessTransport(Transcript(False)))
    clients = {int(u): FedCL(subset(train, np.flatnonzero(train.users == u)), c, seed=3,
                             exclude=subset(exclude, np.flatnonzero(exclude.users == u)), _test_source=_sources([u]))
               for u in users}
    for cl in clients.values():
        if policy is not None:
            set_device_policy(cl, policy)
    return server, clients, lambda: run_on_devices(server, clients)


def _spent(clients, user: int) -> float:
    """The epsilon ``user``'s client counted on its own device."""
    return device_guard(clients[user] if isinstance(clients, dict) else clients).ldp_spent(user)


def _truth(server: FedCL, user: int) -> np.ndarray:
    """``clip_L1(u, clip)``: the client's embedding under the model the server broadcast (what every
    upload of the round is a noisy copy of)."""
    train, exclude = _data()
    own = FedCL(train, server.config, seed=3, exclude=exclude)
    own.load_device_model(server.device_model())
    with torch.no_grad():
        e = own.user_embeddings(np.array([user])).double().numpy()
    return clip_rows_l1(e, server.config.clip)[0][0]


@pytest.mark.parametrize("where", ["in-process", "devices"])
def test_a_server_asking_for_the_embedding_k_times_in_one_round_gets_one_upload(where):
    """Before the fix each victim answered all 32 requests: the average of its uploads was within
    ~1/sqrt(32) of the noise of one upload from its true embedding (measured: error 0.35 against
    2.0 for one upload, dim 8, epsilon 4), it had spent 32 x 4 = 128 epsilon, its own count said 0
    and the ledger held nothing. Now it answers once; the other 31 requests are refused in words."""
    server, clients, play = _runtime(Repeater, {}, where)
    play()
    eps = server.config.epsilon
    for v in VICTIMS:
        got, refused = server.collected[v], server.refusals[v]
        assert len(got) == 1, f"victim {v} uploaded {len(got)} times in one round"
        assert len(refused) == Repeater.K - 1
        assert all("refused" in why and "already uploaded its embedding in round 0" in why for why in refused)
        assert _spent(clients, v) == pytest.approx(eps)  # what the client spent, whatever the ledger says
        b = server.config.laplace_scale
        err = np.linalg.norm(np.mean(got, 0) - _truth(server, v))
        assert err > 0.2 * math.sqrt(2 * server.config.dim) * b  # one upload's noise: nothing averaged away


@pytest.mark.parametrize("where", ["in-process", "devices"])
@pytest.mark.parametrize("cfg, policy, rounds", [
    pytest.param({"user_budget": 8.0}, None, [0, 1], id="user_budget-8"),
    pytest.param({"upload_every": 3}, None, [0, 3], id="upload_every-3"),
    pytest.param({"user_budget": 12.0}, DevicePolicy(ldp_epsilon_budget=6.0), [0], id="operator-budget-6"),
    pytest.param({}, DevicePolicy(ldp_epsilon_budget=8.0), [0, 1], id="no-config-budget-operator-8"),
])
def test_a_server_ignoring_the_upload_policy_across_rounds_is_refused_beyond_it(where, cfg, policy, rounds):
    """Asked in each of five rounds, a client uploads only as its configuration (``upload_every``,
    ``user_budget``) and its operator's budget allow: the smaller bound holds. Before the fix it
    uploaded in all five rounds."""
    server, clients, play = _runtime(Asker, cfg, where, policy)
    for _ in range(5):
        play()
    why = "user_budget" if "user_budget" in cfg and policy is None else \
        "upload_every" if "upload_every" in cfg else "operator's budget"
    for v in VICTIMS:
        assert server.accepted[v] == rounds
        assert len(server.refusals[v]) == 5 - len(rounds) and all(why in r for r in server.refusals[v])
        assert _spent(clients, v) == pytest.approx(len(rounds) * server.config.epsilon)


def test_a_client_of_a_configuration_without_uploads_refuses_the_embedding_step():
    """``semi_hard = 0`` (the Fed baseline) uploads no embedding: a server that asks anyway is refused."""
    server, clients, play = _runtime(Repeater, {"semi_hard": 0, "in_batch": False}, "devices")
    play()
    assert all(not server.collected[v] for v in VICTIMS)
    assert all("uploads no embedding" in why for v in VICTIMS for why in server.refusals[v])
    assert all(_spent(clients, v) == 0 for v in VICTIMS)


def test_an_embedding_step_that_was_not_admitted_is_never_computed():
    """The charge comes first: the client half computes an upload only for a user whose guard admitted
    (and charged) it in this round, so no code path computes an uncounted upload."""
    train, exclude = _data()
    fc = FedCL(train, FedCLConfig(**SMALL), seed=3, exclude=exclude)
    with pytest.raises(ValueError, match="admitted"):
        fc.device_step("embedding", 0, np.array([2]), fc.device_model(), {})
    admit_step(fc, "embedding", 0, 2, {}, {}, secure=False)
    assert set(fc.device_step("embedding", 0, np.array([2]), fc.device_model(), {})) == {2}
    with pytest.raises(ValueError, match="admitted"):
        fc.device_step("embedding", 1, np.array([2]), fc.device_model(), {})


# -- the oracle of the budget --------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _trainer(upload_every: int, user_budget: float, epsilon: float) -> FedCL:
    train, exclude = _data()
    cfg = FedCLConfig(**{**SMALL, "upload_every": upload_every, "user_budget": user_budget, "epsilon": epsilon})
    return FedCL(train, cfg, seed=0, exclude=exclude)


def _expected(rec: dict, kind: str, t: int, cfg: FedCLConfig, budget: float) -> str | None:
    """Why the client must refuse, from its own history (``rec``): the oracle."""
    if t < rec["last"]:
        return "rolled-back"
    if kind != "embedding":
        return None
    if rec["spent"] + cfg.epsilon > budget * (1 + 1e-12):
        return "operator's budget"
    if rec["ldp_round"] == t:
        return "already uploaded"
    if rec["ldp_round"] >= 0 and t - rec["ldp_round"] < cfg.upload_every:
        return "upload_every"
    if cfg.user_budget and rec["spent"] + cfg.epsilon > cfg.user_budget * (1 + 1e-12):
        return "user_budget"
    return None


@settings(max_examples=120, deadline=None)
@given(upload_every=st.integers(1, 3), uploads=st.sampled_from([0, 1, 2, 3]), epsilon=st.sampled_from([0.5, 1.0, 4.0]),
       budget=st.sampled_from([math.inf, 1.0, 2.5, 6.0, 10.0]),
       requests=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["embedding", "embedding", "train"]),
                                   st.integers(0, 7)), max_size=30),
       via_checkpoint=st.booleans())
def test_the_client_admits_exactly_what_the_budget_oracle_admits(upload_every, uploads, epsilon, budget, requests,
                                                                  via_checkpoint):
    """Random request sequences (repeats in a round, rounds out of order, past every bound) against the
    oracle of the rules: the client admits exactly what the oracle admits and its count equals the
    oracle's, after every step's round trip through the device record (Flower) or the trainer's
    checkpoint (in process, ``--resume``)."""
    fc = _trainer(upload_every, uploads * epsilon, epsilon)
    fc._device_guard = None
    set_device_policy(fc, DevicePolicy(ldp_epsilon_budget=budget))
    recs = {u: {"last": -1, "ldp_round": -1, "spent": 0.0} for u in range(3)}
    for user, kind, t in requests:
        rec = recs[user]
        want = _expected(rec, kind, t, fc.config, budget)
        if want is None:
            admit_step(fc, kind, t, user, {}, {}, secure=False)
            rec["last"] = max(rec["last"], t)
            if kind == "embedding":
                rec["ldp_round"], rec["spent"] = t, rec["spent"] + epsilon
        else:
            with pytest.raises(RefusedStep, match=want):
                admit_step(fc, kind, t, user, {}, {}, secure=False)
        if via_checkpoint:
            state = state_from_bytes(state_to_bytes(fc.state_dict()))
            fc._device_guard = None
            fc.load_state_dict(state)
        else:
            guard = device_guard(fc)
            kept = {u: guard.state(u) for u in range(3)}
            fc._device_guard = None
            for u, s in kept.items():
                device_guard(fc).load_state(u, s)
        assert [device_guard(fc).ldp_spent(u) for u in range(3)] == pytest.approx([recs[u]["spent"] for u in range(3)])


def test_the_clients_count_survives_a_checkpoint_so_a_resume_does_not_reset_it():
    """In process the trainer plays every client: its checkpoint carries their counts (tensors plus
    JSON), so a run resumed from it refuses the uploads a client's budget no longer allows."""
    train, exclude = _data()
    cfg = FedCLConfig(**{**SMALL, "clients_per_round": 14, "upload_every": 1})
    policy = DevicePolicy(ldp_epsilon_budget=8.0)  # two uploads at epsilon 4
    fc = FedCL(train, cfg, seed=1, exclude=exclude)
    set_device_policy(fc, policy)
    fc.run_round(), fc.run_round()
    spent = np.array([device_guard(fc).ldp_spent(u) for u in range(N_USERS)])
    assert spent.max() == 8.0 and (spent == 4.0 * fc.uploads).all()
    state = state_from_bytes(state_to_bytes(fc.state_dict()))
    resumed = FedCL(train, cfg, seed=1, exclude=exclude)
    set_device_policy(resumed, policy)
    resumed.load_state_dict(state)
    before = resumed.uploads.copy()
    for _ in range(2):
        resumed.run_round()
    done = before * 4.0 >= 8.0
    assert done.any() and (resumed.uploads[done] == before[done]).all()  # no upload past the budget
    refused = [u for u in resumed.last_dropped if done[u]]
    assert refused and all("operator's budget" in resumed.last_dropped[u] for u in refused)
    assert [device_guard(resumed).ldp_spent(u) for u in range(N_USERS)] == pytest.approx(4.0 * resumed.uploads)


def test_a_checkpoint_without_the_clients_record_still_loads():
    """A checkpoint written before the clients' record was kept loads with a fresh record (and says
    nothing it cannot know)."""
    train, exclude = _data()
    fc = FedCL(train, FedCLConfig(**SMALL), seed=0, exclude=exclude)
    fc.run_round()
    state = fc.state_dict()
    del state["device_guard"]
    other = FedCL(train, FedCLConfig(**SMALL), seed=0, exclude=exclude)
    other.load_state_dict(state)
    assert other.round == 1 and device_guard(other).ldp_spent(0) == 0.0


# -- the limit: uploads the protocol's schedule allows compose -----------------------------------------
def test_limit_uploads_within_the_schedule_compose_and_average_towards_the_embedding():
    """The stated limit: an honest schedule (``upload_every = 1``, no budget) lets the server average a
    client's k uploads over k rounds. The error against the true embedding shrinks like 1/sqrt(k);
    the ledger, and the client's own count, both say k epsilon (basic composition)."""
    train, exclude = _data()
    cfg = FedCLConfig(**{**SMALL, "dim": 32, "clients_per_round": N_USERS, "lr": 1e-9})  # (the model barely moves)
    users = np.flatnonzero(np.bincount(train.users, minlength=N_USERS) > 0)
    fc = FedCL(train, cfg, seed=2, exclude=exclude, transport=InProcessTransport(Transcript(True)),
               _test_source=_sources(users))
    ups: dict[int, list[np.ndarray]] = {}
    entries: dict[int, int] = {}
    truth = {}
    for _ in range(16):
        model = fc.device_model()
        stats = fc.run_round()
        for r in fc.transport.transcript.view("server", kind="embedding"):
            if r.round == stats.round:
                u = int(r.sender.split(":")[1])
                ups.setdefault(u, []).append(r.payload)
                if u not in truth:
                    own = FedCL(train, cfg, seed=2, exclude=exclude)
                    own.load_device_model(model)
                    with torch.no_grad():
                        truth[u] = clip_rows_l1(own.user_embeddings(np.array([u])).double().numpy(), cfg.clip)[0][0]
        for rel in stats.releases:
            if rel.cohort:
                entries[int(rel.cohort[5:])] = entries.get(int(rel.cohort[5:]), 0) + 1
    b, d = cfg.laplace_scale, cfg.dim
    for k in (1, 4, 16):
        mse = np.mean([np.sum((np.mean(ups[u][:k], 0) - truth[u]) ** 2) for u in ups if len(ups[u]) >= k])
        assert 0.6 < mse * k / (2 * b * b * d) < 1.6, (k, mse)  # E|mean of k - truth|^2 = 2 b^2 d / k
    for u in ups:
        assert entries[u] == len(ups[u]) and _spent(fc, u) == pytest.approx(cfg.epsilon * len(ups[u]))


@pytest.mark.parametrize("where", ["in-process", "devices"])
def test_the_honest_server_meets_a_refusal_gracefully(where):
    """The server half does not know its clients' operators' budgets: a client past its budget is
    dropped from the embedding exchange with the reason, keeps its cached embedding (and so its
    negatives), still trains, and gets no ledger entry for the upload it did not make."""
    server, clients, play = _runtime(FedCL, {"clients_per_round": 10}, where, DevicePolicy(ldp_epsilon_budget=4.0))
    first = play()
    assert first.extra["uploads"] == N_USERS and not server.last_dropped  # round 0: everyone's one upload
    stats = play()
    refused = {u: why for u, why in server.last_dropped.items() if "operator's budget 4" in why}
    assert len(refused) == 10 and set(refused) == set(server.last_dropped)  # the sampled ten, refused in words
    assert stats.extra["uploads"] == 0 and stats.clients == 10 and np.isfinite(stats.loss)
    assert not [r for r in stats.releases if r.cohort]  # no upload, no ledger entry
    assert (server.uploads == 1).all() and server.has_cache.all()
    assert all(_spent(clients, u) == 4.0 for u in range(N_USERS))
