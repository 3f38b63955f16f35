"""``secure_aggregation = "dpf"`` through protocols/secure_sum.py and the exchange interface: the
decoded sum, the transcript of what each of the two servers received, and the exchange invariants
(one answer per step and round, the clients' minimum cohort) applied to a two-server sum."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.base import RoundStats
from protocols.exchange import Exchange, Replies, SecureSum, census, run_exchanges, run_on_devices
from protocols.guard import DevicePolicy, set_device_policy
from protocols.secure_sum import SecureSumAborted, secure_sum
from protocols.transport import SERVER, InProcessTransport, Transcript, client
from recmodels.data import Interactions
from secagg.dpf import KeySet
from secagg.dpf_sum import DpfUpload

ROWS, WIDTH = 40, 2


def _updates(n: int, seed: int = 0, touched: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.zeros((n, ROWS, WIDTH))
    for i in range(n):
        x[i, rng.choice(ROWS, touched, replace=False)] = rng.uniform(-1, 1, (touched, WIDTH))
    return x.reshape(n, -1)


def test_the_dpf_sum_decodes_to_the_sum_and_each_server_receives_one_key_set_per_client():
    x = _updates(5)
    tr = InProcessTransport(Transcript(keep_payloads=True))
    senders = [client(u) for u in range(5)]
    res = secure_sum(x, protocol="dpf", frac_bits=20, value_clip=2.0, round=3, transport=tr, senders=senders,
                     row_width=WIDTH, points=4, receiver2="server2")
    assert np.allclose(res.total, x.sum(axis=0), atol=5 * 2.0**-20)
    assert res.survivors.tolist() == [0, 1, 2, 3, 4] and len(set(res.bytes_sent.tolist())) == 1
    for party, name in ((0, SERVER), (1, "server2")):
        ups = tr.transcript.view(name, round=3, kind="update")
        assert sorted(r.sender for r in ups) == sorted(senders)
        assert all(KeySet.from_bytes(DpfUpload.from_bytes(r.payload).key).party == party for r in ups)
    between = {(r.sender, r.receiver, r.kind) for r in tr.transcript if r.kind.startswith("dpf:")}
    assert between == {(SERVER, "server2", "dpf:ids"), ("server2", SERVER, "dpf:ids"),
                       (SERVER, "server2", "dpf:challenge"), (SERVER, "server2", "dpf:digests"),
                       ("server2", SERVER, "dpf:digests"), ("server2", SERVER, "dpf:share")}
    # the second server receives nothing derived from the inputs but keys and A's bookkeeping
    assert not any(r.kind == "dpf:share" for r in tr.transcript.view("server2"))


def test_dropouts_cost_nothing_and_a_client_with_too_many_rows_is_told_which_key_to_raise():
    x = _updates(4, seed=1)
    tr = InProcessTransport(Transcript())
    res = secure_sum(x, protocol="dpf", frac_bits=16, value_clip=2.0, round=0, transport=tr,
                     senders=[client(u) for u in range(4)], row_width=WIDTH, points=3,
                     dropouts={"B": frozenset({2})})
    assert res.survivors.tolist() == [0, 1, 3]
    assert np.allclose(res.total, x[[0, 1, 3]].sum(axis=0), atol=4 * 2.0**-16)
    with pytest.raises(ValueError, match="touches 3 rows, above points=2; raise points"):
        secure_sum(x, protocol="dpf", frac_bits=16, value_clip=2.0, round=0, transport=tr,
                   senders=[client(u) for u in range(4)], row_width=WIDTH, points=2)
    with pytest.raises(ValueError, match="row_width"):
        secure_sum(x, protocol="dpf", frac_bits=16, value_clip=2.0, round=0, transport=tr,
                   senders=[client(u) for u in range(4)], row_width=3, points=3)
    with pytest.raises(SecureSumAborted, match="below the clients' floor 4"):
        secure_sum(x, protocol="dpf", frac_bits=16, value_clip=2.0, round=0, transport=tr,
                   senders=[client(u) for u in range(4)], row_width=WIDTH, points=3, min_survivors=4,
                   dropouts={"A": frozenset({0})})


class RowToy:
    """One secure exchange a round: user ``u`` adds ``u + 1`` to row ``u`` (a sparse table update)."""

    def __init__(self, train: Interactions) -> None:
        self.train, self.round = train, 0
        self.users = np.unique(train.users)
        self.transport = InProcessTransport(Transcript(keep_payloads=False))
        self.sums: list[Replies] = []
        self.ask_twice = False

    def device_round(self):
        spec = SecureSum("dpf", width=ROWS * WIDTH, frac_bits=10, value_clip=100.0, row_width=WIDTH, points=2)
        got = yield Exchange("rows", self.users, secure=spec)
        self.sums.append(got)
        if self.ask_twice:  # a deviating server asks the same step again over a smaller cohort
            again = yield Exchange("rows", self.users[1:], secure=spec)
            self.sums.append(again)
        self.round += 1
        return RoundStats(round=self.round - 1, loss=0.0, clients=len(got.survivors))

    def device_step(self, kind, round_, users, broadcast, per_user):
        out = {}
        for u in users:
            v = np.zeros((ROWS, WIDTH))
            v[int(u) % ROWS] = float(u) + 1.0
            out[int(u)] = {"vector": v.reshape(-1)}
        return out

    def device_requires_secure(self, kind):
        return True

    def run_round(self) -> RoundStats:
        return run_exchanges(self, self.device_step)


def _data(users: list[int]) -> Interactions:
    u = np.array(users, np.int64)
    return Interactions(users=u, items=np.zeros(len(u), np.int64), ratings=np.ones(len(u), np.float32),
                        timestamps=np.zeros(len(u), np.int64), user_ids=np.arange(max(users) + 1),
                        item_ids=np.arange(1))


def _want(users) -> np.ndarray:
    v = np.zeros((ROWS, WIDTH))
    for u in users:
        v[u % ROWS] += u + 1.0
    return v.reshape(-1)


def test_a_dpf_exchange_sums_in_process_and_on_devices_alike():
    data = _data([0, 1, 2, 3])
    local = RowToy(data)
    local.run_round()
    assert np.allclose(local.sums[0].total, _want([0, 1, 2, 3]))
    server = RowToy(census(np.arange(4), 4, 1))
    clients = {u: RowToy(_data([u])) for u in range(4)}
    run_on_devices(server, clients)
    assert np.allclose(server.sums[0].total, _want([0, 1, 2, 3]))
    uploads = server.transport.transcript.view("server2", kind="update")
    assert sorted(r.sender for r in uploads) == [client(u) for u in range(4)]


def test_a_second_dpf_sum_of_the_same_step_in_a_round_is_refused_by_every_client():
    data = _data([0, 1, 2, 3])
    toy = RowToy(data)
    toy.ask_twice = True
    toy.run_round()
    first, second = toy.sums
    assert np.allclose(first.total, _want([0, 1, 2, 3]))
    assert second.total is None and all("already answered" in r for r in second.dropped.values())


def test_a_dpf_sum_below_the_clients_minimum_is_never_computed():
    data = _data([0, 1, 2])
    toy = RowToy(data)
    set_device_policy(toy, DevicePolicy(min_survivors=4))
    toy.run_round()
    assert toy.sums[0].total is None and "min_survivors" in toy.sums[0].aborted
    server = RowToy(census(np.arange(3), 3, 1))
    clients = {u: RowToy(_data([u])) for u in range(3)}
    set_device_policy(clients[1], DevicePolicy(min_survivors=4))  # one device's operator is stricter
    run_on_devices(server, clients)
    assert server.sums[0].total is None and "min_survivors" in server.sums[0].aborted
    assert not server.transport.transcript.view("server2", kind="update")  # nothing was sent at all


def test_a_dpf_secure_sum_spec_needs_its_row_structure():
    with pytest.raises(ValueError, match="row_width dividing"):
        SecureSum("dpf", width=10, frac_bits=8, value_clip=1.0, row_width=3, points=2)
    with pytest.raises(ValueError, match="row_width dividing"):
        SecureSum("dpf", width=10, frac_bits=8, value_clip=1.0)
    assert SecureSum("secagg", width=10, frac_bits=8, value_clip=1.0).two_server() == {}


class RowReplies(RowToy):
    """RowToy whose clients reply with their touched row only (``rows``/``row_values``)."""

    def device_step(self, kind, round_, users, broadcast, per_user):
        return {int(u): {"rows": np.array([int(u) % ROWS]), "row_values": np.full((1, WIDTH), float(u) + 1.0)}
                for u in users}


@pytest.mark.parametrize("bad, why", [
    (lambda r: {**r, "rows": np.array([1, 1]), "row_values": np.zeros((2, WIDTH))}, "distinct"),
    (lambda r: {**r, "rows": np.array([ROWS])}, "distinct and in"),
    (lambda r: {**r, "row_values": r["row_values"].astype(np.float32)}, "float64 row_values"),
    (lambda r: {**r, "row_values": np.zeros((1, WIDTH + 1))}, "float64 row_values"),
    (lambda r: {**r, "row_values": np.full((1, WIDTH), np.nan)}, "non-finite"),
    (lambda r: {**r, "vector": np.zeros(ROWS * WIDTH)}, "reply keys"),
])
def test_a_dpf_exchange_takes_touched_rows_and_drops_a_malformed_one_on_devices(bad, why):
    local = RowReplies(_data([0, 1, 2, 3]))
    local.run_round()
    assert np.allclose(local.sums[0].total, _want([0, 1, 2, 3]))
    server = RowReplies(census(np.arange(4), 4, 1))
    clients = {u: RowReplies(_data([u])) for u in range(4)}
    run_on_devices(server, clients, tamper=lambda ex, u, r: bad(r) if u == 2 else r)
    got = server.sums[0]
    assert np.allclose(got.total, _want([0, 1, 3])) and set(got.dropped) == {2}
    assert why in got.dropped[2], got.dropped[2]


def _row_sum(rows, values, **kw):  # noqa: ANN001, ANN003, ANN202
    from protocols.secure_sum import secure_row_sum

    tr = InProcessTransport(Transcript())
    args = {"n_rows": ROWS, "frac_bits": 16, "value_clip": 2.0, "round": 0, "transport": tr,
            "senders": [client(u) for u in range(len(rows))], "points": 4, "where": "toy.value_clip"}
    return secure_row_sum(rows, values, **{**args, **kw})


def test_the_row_sum_encodes_every_sender_at_once_and_decodes_to_the_plaintext_sum():
    """``secure_row_sum`` checks and encodes all senders' values in one pass and hands each sender its own
    slice: the decoded table is the plaintext sum of the rows (an oracle that sums them directly), whatever
    the senders' row counts (0 to ``points``), so no sender's slice is another's."""
    rng = np.random.default_rng(3)
    counts = [0, 1, 4, 2, 3]
    rows = [np.sort(rng.choice(ROWS, c, replace=False)) for c in counts]
    values = [rng.uniform(-2, 2, (c, WIDTH)) for c in counts]
    res = _row_sum(rows, values)
    plain = np.zeros((ROWS, WIDTH))
    for r, v in zip(rows, values):
        plain[r] += v
    assert np.allclose(res.total.reshape(ROWS, WIDTH), plain, atol=len(rows) * 2.0**-16)
    assert res.survivors.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("bad", "match"), [
    (np.nan, "non-finite value"), (np.inf, "non-finite value"), (2.5, r"holds 2\.5, above toy\.value_clip=2"),
    (-3.0, r"holds 3, above toy\.value_clip=2"),
])
def test_the_row_sum_names_the_check_a_senders_value_fails_and_aggregates_nothing(bad, match):
    """One pass checks every sender's values; when it fails, the error still says which check (a non-finite
    value, or the largest magnitude against the clip, under the caller's setting name), wherever the bad value
    sits, and no message is sent."""
    rows = [np.array([1, 5]), np.array([2]), np.array([0, 3, 7])]
    values = [np.zeros((2, WIDTH)), np.ones((1, WIDTH)), np.full((3, WIDTH), 0.5)]
    values[2][1, 1] = bad
    tr = InProcessTransport(Transcript())
    with pytest.raises(ValueError, match=match):
        _row_sum(rows, values, transport=tr)
    assert len(tr.transcript) == 0
    with pytest.raises(ValueError, match="touches 3 rows, above points x max_parts = 2 x 1"):
        _row_sum(rows, [np.zeros((r.size, WIDTH)) for r in rows], points=2)
    with pytest.raises(ValueError, match="distinct"):
        _row_sum([np.array([1, 1])], [np.zeros((2, WIDTH))])
