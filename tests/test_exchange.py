"""The exchange interface (protocols/exchange.py) on a toy protocol whose answers are known.

The toy: user ``u`` privately holds ``x_u`` (its number of training rows). Each round the server
broadcasts ``w`` (the round index) and asks every user for ``x_u + w`` in plaintext, then asks
for ``[x_u, 1]`` summed through secure aggregation. Every client counts the steps it ran in its
own state. The tests check that one process, simulated separate devices and the plaintext oracle
agree, and that a silent or malformed client is dropped without touching the others.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.base import RoundStats
from protocols.exchange import Exchange, Replies, SecureSum, census, run_exchanges, run_on_devices
from protocols.transport import SERVER, InProcessTransport, Transcript, client
from recmodels.data import Interactions


class Toy:
    """A two-exchange protocol over ``train`` (see the module docstring)."""

    def __init__(self, train: Interactions, *, secure: str = "secagg") -> None:
        self.train, self.secure, self.round = train, secure, 0
        self.x = np.bincount(train.users, minlength=train.n_users).astype(np.float64)
        self.steps = np.zeros(train.n_users, np.int64)
        self.transport = InProcessTransport(Transcript(keep_payloads=False))
        self.users = np.flatnonzero(self.x > 0)
        self.history: list[dict] = []

    # -- the server half --
    def device_round(self):
        t = self.round
        for u in self.users:
            self.transport.send(SERVER, client(int(u)), t, "w", None, 8)

        def check(u: int, reply: dict) -> float:
            y = reply["y"]
            if y.shape != () or not np.isfinite(y):
                raise ValueError(f"y must be one finite number; found {y!r}")
            return float(y)

        got: Replies = yield Exchange("echo", self.users, broadcast={"w": np.array(float(t))},
                                      reply_keys=frozenset({"y"}), validate=check)
        total: Replies = yield Exchange("count", np.array(sorted(got.values), np.int64),
                                        secure=SecureSum(self.secure, width=2, frac_bits=8, value_clip=1e4))
        self.history.append({"echo": dict(got.values), "sum": None if total.total is None else total.total.tolist(),
                             "survivors": total.survivors.tolist(), "dropped": {**got.dropped, **total.dropped}})
        self.round += 1
        return RoundStats(round=t, loss=float(sum(got.values.values())), clients=len(total.survivors))

    # -- the client half --
    def device_step(self, kind, round_, users, broadcast, per_user):
        self.steps[users] += 1
        if kind == "echo":
            w = float(broadcast["w"])
            return {int(u): {"y": np.array(self.x[u] + w)} for u in users}
        return {int(u): {"vector": np.array([self.x[u], 1.0])} for u in users}

    def device_requires_secure(self, kind):
        return kind == "count"

    def device_state(self, user):
        return {"steps": np.array(self.steps[user])}

    def load_device_state(self, user, state):
        self.steps[user] = int(state["steps"])

    def run_round(self) -> RoundStats:
        return run_exchanges(self, self.device_step)


def _data(counts: list[int]) -> Interactions:
    users = np.repeat(np.arange(len(counts)), counts)
    items = np.concatenate([np.arange(c) for c in counts]) if counts else np.zeros(0, np.int64)
    return Interactions(users=users.astype(np.int64), items=items.astype(np.int64),
                        ratings=np.ones(len(users), np.float32), timestamps=np.zeros(len(users), np.int64),
                        user_ids=np.arange(len(counts)), item_ids=np.arange(max(counts) + 1))


def _own(data: Interactions, u: int) -> Interactions:
    keep = data.users == u
    return Interactions(users=data.users[keep], items=data.items[keep], ratings=data.ratings[keep],
                        timestamps=data.timestamps[keep], user_ids=data.user_ids, item_ids=data.item_ids)


def _devices(data: Interactions, **kw):
    users = np.flatnonzero(np.bincount(data.users, minlength=data.n_users) > 0)
    server = Toy(census(users, data.n_users, data.n_items), **kw)
    return server, {int(u): Toy(_own(data, int(u)), **kw) for u in users}


def test_one_process_and_separate_devices_agree_with_the_plaintext_oracle():
    data = _data([3, 1, 4, 1, 5])
    local = Toy(data)
    server, clients = _devices(data)
    for t in range(2):
        a, b = local.run_round(), run_on_devices(server, clients)
        assert a.loss == b.loss == sum(data_x + t for data_x in (3, 1, 4, 1, 5))
    assert local.history == server.history
    assert server.history[-1]["sum"] == [14.0, 5.0]  # the oracle: sum of x, and the number of clients
    assert [clients[u].steps[u] for u in clients] == [4] * 5  # two steps a round, each on its own device
    assert server.steps.sum() == 0  # the server half never ran a client step


def test_the_server_half_built_on_a_census_never_sees_the_counts():
    data = _data([3, 1, 4])
    server, _ = _devices(data)
    assert server.x.tolist() == [1.0, 1.0, 1.0]  # one placeholder row per participant, nothing else


@pytest.mark.parametrize("bad", [
    {"y": np.array(np.nan)},
    {"y": np.array([1.0, 2.0])},
    {"y": np.array(1.0), "extra": np.array(0.0)},
    {},
    {"y": 1.0},
])
def test_a_malformed_reply_drops_only_that_client(bad):
    data = _data([3, 1, 4, 1])
    server, clients = _devices(data)
    stats = run_on_devices(server, clients, tamper=lambda ex, u, r: bad if (ex.kind, u) == ("echo", 2) else r)
    h = server.history[-1]
    assert 2 in h["dropped"] and set(h["echo"]) == {0, 1, 3}
    assert h["sum"] == [5.0, 3.0] and stats.clients == 3


def test_a_wrong_width_secure_vector_is_refused_before_summing():
    data = _data([2, 2, 2])
    server, clients = _devices(data)
    run_on_devices(server, clients, tamper=lambda ex, u, r: {"vector": np.zeros(3)} if ex.kind == "count" and u == 0 else r)
    h = server.history[-1]
    assert "float64 vector of 2" in h["dropped"][0]
    assert h["sum"] == [4.0, 2.0]


@settings(max_examples=15, deadline=None)
@given(counts=st.lists(st.integers(1, 9), min_size=3, max_size=9), data=st.data())
def test_secure_sum_equals_the_plaintext_sum_over_whoever_answered(counts, data):
    silent = data.draw(st.sets(st.integers(0, len(counts) - 1), max_size=len(counts) - 3))
    protocol = data.draw(st.sampled_from(["secagg", "secagg+"]))
    train = _data(counts)
    server, clients = _devices(train, secure=protocol)
    run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "echo" and u in silent)
    h = server.history[-1]
    alive = [u for u in range(len(counts)) if u not in silent]
    assert sorted(h["echo"]) == alive and h["survivors"] == alive
    assert h["sum"] == [float(sum(counts[u] for u in alive)), float(len(alive))]


def test_a_client_refuses_to_answer_a_secure_step_in_plaintext():
    class Greedy(Toy):  # a server that asks for the count without secure aggregation
        def device_round(self):
            got = yield Exchange("count", self.users, reply_keys=frozenset({"vector"}))
            self.history.append(got)
            self.round += 1
            return RoundStats(round=0, loss=0.0)

    data = _data([2, 3])
    users = np.array([0, 1])
    server = Greedy(census(users, 2, data.n_items))
    clients = {u: Toy(_own(data, u)) for u in (0, 1)}
    run_on_devices(server, clients)
    got = server.history[-1]
    assert not got.values and all("only through secure aggregation" in why for why in got.dropped.values())


def test_a_secure_exchange_of_one_client_aborts_instead_of_releasing_its_vector():
    data = _data([2, 3, 4])
    server, clients = _devices(data)
    run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "echo" and u > 0)
    h = server.history[-1]
    assert h["sum"] is None and h["survivors"] == []


def test_an_exchange_refuses_a_bad_cohort_or_a_missing_reply_schema():
    with pytest.raises(ValueError, match="distinct"):
        Exchange("x", np.array([1, 1]), reply_keys=frozenset({"y"}))
    with pytest.raises(ValueError, match="outside the cohort"):
        Exchange("x", np.array([1, 2]), per_user={3: {}}, reply_keys=frozenset({"y"}))
    with pytest.raises(ValueError, match="reply keys"):
        Exchange("x", np.array([1, 2]))
    with pytest.raises(ValueError, match="clash"):
        Exchange("x", np.array([1]), broadcast={"a": np.zeros(1)}, per_user={1: {"a": np.zeros(1)}},
                 reply_keys=frozenset({"y"})).message_for(1)
    with pytest.raises(ValueError, match="width"):
        SecureSum("secagg", width=0, frac_bits=8, value_clip=1.0)


def test_a_round_generator_that_yields_something_else_is_a_programming_error():
    class Broken(Toy):
        def device_round(self):
            yield {"kind": "echo"}

    with pytest.raises(TypeError, match="not an Exchange"):
        Broken(_data([1, 1])).run_round()
