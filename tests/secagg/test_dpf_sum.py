"""The two-server DPF sum (secagg/dpf_sum.py): its promise, its adversary, and each stated limit."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency

from secagg import dpf
from secagg.cuckoo import CuckooLayout
from secagg.dpf import Forest, KeySet
from secagg.dpf_run import DpfSpec, run_dpf
from secagg.dpf_sum import (
    SERVER_A,
    SERVER_B,
    DpfSumClient,
    DpfSumConfig,
    DpfSumServer,
    DpfUpload,
)
from secagg.errors import AbortError, MessageError

N, D, P = 120, 3, 4


def _inputs(n: int, seed: int = 0, rows_per_client: int = P) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.zeros((n, N, D), np.uint64)
    for i in range(n):
        rows = rng.choice(N, rows_per_client, replace=False)
        x[i, rows] = rng.integers(1, 2**64, (rows_per_client, D), dtype=np.uint64)
    return x.reshape(n, -1)


def test_the_receiver_gets_the_exact_sum_and_nothing_is_refused():
    x = _inputs(6)
    res = run_dpf(x, DpfSpec(N, D, P))
    assert res.abort is None and res.refused == {} and res.survivors == frozenset(range(6))
    assert np.array_equal(res.total, x.sum(axis=0))
    # every upload has the same size, whatever the rows
    assert len(set(res.bytes_up.ravel().tolist())) == 1


def test_dropouts_cost_nothing_a_key_that_reached_one_server_is_simply_left_out():
    x = _inputs(6, seed=1)
    res = run_dpf(x, DpfSpec(N, D, P, dropouts={"A": frozenset({1}), "B": frozenset({4}), "upload": frozenset({2})}))
    assert sorted(res.survivors) == [0, 3, 5] and res.abort is None
    assert np.array_equal(res.total, x[[0, 3, 5]].sum(axis=0))
    stages = [r[2] for r in res.records]
    assert "unmask" not in stages and stages.count("share") == 1  # no extra round for the dropouts


def test_a_client_with_more_rows_than_declared_is_refused_before_sending():
    x = _inputs(3, rows_per_client=P + 1)
    res = run_dpf(x, DpfSpec(N, D, P, min_survivors=2))
    assert set(res.refused) == {0, 1, 2} and all("above the declared" in r for r in res.refused.values())
    assert res.total is None and "below the clients' floor" in res.abort
    assert not any(r[2] == "upload" for r in res.records)


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.integers(-3, N + 3), min_size=1, max_size=P), ordered=st.booleans())
def test_a_clients_rows_are_refused_exactly_when_repeated_or_outside_the_table(rows, ordered):
    """The client's own row check (one pass when its rows increase, a sort otherwise) against the plain
    definition: refused exactly when a row repeats or lies outside ``[0, N)``, in the same words."""
    r = np.array(sorted(rows) if ordered else rows, np.int64)
    cfg = DpfSumConfig(3, CuckooLayout.for_points(N, P), D, P, os.urandom(16), 0, True)
    bad = len(set(rows)) != len(rows) or min(rows) < 0 or max(rows) >= N
    try:
        DpfSumClient(cfg, 0).plan(r, np.ones((r.size, D), np.uint64))
    except ValueError as exc:
        assert bad and "distinct and in" in str(exc)
    else:
        assert not bad


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.integers(0, 40), max_size=12), ordered=st.booleans(), domain=st.integers(1, 45),
       dtype=st.sampled_from([np.int64, np.uint64, np.int32]), shift=st.integers(-3, 0))
def test_distinct_in_is_its_definition_for_any_integer_rows(rows, ordered, domain, dtype, shift):
    """secagg.dpf_sum.distinct_in, which the clients and the protocols' reply checks use, against the plain
    definition: every row distinct and in [0, domain); signed rows may be negative, unsigned never."""
    from secagg.dpf_sum import distinct_in
    vals = [v + shift for v in (sorted(rows) if ordered else rows)]
    if np.dtype(dtype).kind == "u":
        vals = [abs(v) for v in vals]
    want = len(set(vals)) == len(vals) and all(0 <= v < domain for v in vals)
    assert distinct_in(np.array(vals, dtype=dtype), domain) == want


def _upload_bytes(x: np.ndarray, n_runs: int) -> tuple[np.ndarray, np.ndarray]:
    """The key bytes server B received for client 0 over ``n_runs`` runs (header stripped)."""
    out = []
    for _ in range(n_runs):
        res = run_dpf(x, DpfSpec(N, D, P))
        blob = next(b for s, r, stage, b in res.records if s == 0 and r == "B" and stage == "upload")
        out.append(np.frombuffer(DpfUpload.from_bytes(blob).key[20:], np.uint8))
    return np.stack(out)


def test_one_servers_view_is_independent_of_the_inputs():
    """Server B's upload from a client touching rows 0..3 with small values and from one touching
    rows 100..103 with huge values: same size, byte histograms indistinguishable."""
    a = np.zeros((2, N, D), np.uint64)
    a[0, :P] = 1
    a[1, 50] = 1
    b = np.zeros((2, N, D), np.uint64)
    b[0, 100:100 + P] = np.uint64(2**63 + 12345)
    b[1, 50] = 1
    va, vb = _upload_bytes(a.reshape(2, -1), 40), _upload_bytes(b.reshape(2, -1), 40)
    assert va.shape == vb.shape
    hist = np.stack([np.bincount(va.ravel(), minlength=256), np.bincount(vb.ravel(), minlength=256)])
    assert chi2_contingency(hist)[1] > 1e-6


def test_limit_both_servers_together_reconstruct_every_clients_update():
    """The stated limit: A's and B's keys of a client, evaluated and added, are that client's update."""
    x = _inputs(4, seed=3)
    res = run_dpf(x, DpfSpec(N, D, P))
    layout = CuckooLayout.for_points(N, P, seed=bytes(32))
    forest = Forest(layout.sizes, layout.depth)
    for i in range(4):
        keys = {r: KeySet.from_bytes(DpfUpload.from_bytes(b).key) for s, r, st, b in res.records
                if s == i and st == "upload"}
        both = dpf.eval_full(keys["A"], forest) + dpf.eval_full(keys["B"], forest)
        assert np.array_equal(layout.to_domain(both).reshape(-1), x[i])


def _two_points_in_one_bucket(k0: KeySet, k1: KeySet) -> tuple[KeySet, KeySet]:
    cw = k0.seed_cw.copy()
    cw[0, -2] ^= np.uint64(0x1000)  # the two parties' seeds diverge above the last level of tree 0
    return dataclasses.replace(k0, seed_cw=cw), dataclasses.replace(k1, seed_cw=cw)


def _different_values_for_a_and_b(k0: KeySet, k1: KeySet) -> tuple[KeySet, KeySet]:
    return k0, dataclasses.replace(k1, value_cw=k1.value_cw ^ np.uint64(1))


@pytest.mark.parametrize("attack", [_two_points_in_one_bucket, _different_values_for_a_and_b])
def test_a_malicious_clients_key_that_adds_to_more_rows_is_caught_and_left_out(attack):
    x = _inputs(5, seed=4)
    res = run_dpf(x, DpfSpec(N, D, P, tamper={2: attack}))
    assert 2 in res.refused and "failed the check" in res.refused[2]
    assert sorted(res.survivors) == [0, 1, 3, 4]
    assert np.array_equal(res.total, x[[0, 1, 3, 4]].sum(axis=0))
    # without the check the same client corrupts rows it never declared
    loose = run_dpf(x, DpfSpec(N, D, P, tamper={2: attack}, check=False))
    wrong = (loose.total != x.sum(axis=0)).reshape(N, D).any(axis=1)
    assert 2 in loose.survivors and wrong.sum() >= 1


def test_limit_a_malicious_client_can_fill_every_bucket_m_rows_not_p():
    """The stated gap: the check bounds the number of point functions (one per bucket, m of them),
    not which buckets hold a real point. A client that puts a value in every bucket touches m > P
    rows and is accepted."""
    x = _inputs(3, seed=5)
    layout = CuckooLayout.for_points(N, P, seed=bytes(32))

    def fill_every_bucket(k0: KeySet, k1: KeySet) -> tuple[KeySet, KeySet]:
        alphas = np.zeros(layout.buckets, np.int64)
        betas = np.ones((layout.buckets, D), np.uint64)
        f0, f1, _ = dpf.gen(alphas, layout.depth, betas)
        return f0, f1

    res = run_dpf(x, DpfSpec(N, D, P, tamper={1: fill_every_bucket}))
    assert res.survivors == frozenset({0, 1, 2})
    extra = res.total.reshape(N, D) - x[[0, 2]].sum(axis=0).reshape(N, D)
    touched = int(extra.any(axis=1).sum())
    assert P < touched <= layout.buckets


def test_limit_values_are_not_range_checked():
    """A malicious client adds any Z_2^64 value to a declared row (as with SecAgg): accepted."""
    x = _inputs(3, seed=6)
    x[1] = 0
    x[1, :D] = np.uint64(2**63)  # far beyond any fixed-point clip
    res = run_dpf(x, DpfSpec(N, D, P))
    assert res.survivors == frozenset({0, 1, 2}) and np.array_equal(res.total, x.sum(axis=0))


def test_b_withholds_its_share_below_any_survivors_floor_and_answers_once():
    cfg = DpfSumConfig(3, CuckooLayout.for_points(N, P), D, P, os.urandom(16))
    a, b = DpfSumServer(cfg, 0), DpfSumServer(cfg, 1)
    x = _inputs(3, seed=7).reshape(3, N, D)
    for i in range(3):
        rows = np.flatnonzero(x[i].any(axis=1))
        blobs = DpfSumClient(cfg, i, floor=3).upload(rows, x[i][rows])
        if i != 2:
            b.receive(blobs[1])
        a.receive(blobs[0])
    ra, rb = a.received(), b.received()
    a.agree(rb)
    b.agree(ra)
    b.take_challenge(a.draw_challenge())
    da, db = a.evaluate(), b.evaluate()
    a.reconcile(db)
    b.reconcile(da)
    with pytest.raises(AbortError, match="below the clients' floor 3"):
        b.share()
    assert not b.shared


def test_misrouted_replayed_and_foreign_messages_are_refused():
    cfg = DpfSumConfig(2, CuckooLayout.for_points(N, P), D, P, os.urandom(16))
    other = DpfSumConfig(2, cfg.layout, D, P, os.urandom(16))
    a, b = DpfSumServer(cfg, 0), DpfSumServer(cfg, 1)
    rows = np.array([5])
    to_a, to_b = DpfSumClient(cfg, 0).upload(rows, np.ones((1, D), np.uint64))
    with pytest.raises(MessageError, match="not this server"):
        a.receive(to_b)
    a.receive(to_a)
    with pytest.raises(MessageError, match="replayed"):
        a.receive(to_a)
    foreign = DpfSumClient(other, 1).upload(rows, np.ones((1, D), np.uint64))[0]
    with pytest.raises(MessageError, match="wrong instance"):
        a.receive(foreign)
    client = DpfSumClient(cfg, 1)
    client.upload(rows, np.ones((1, D), np.uint64))
    with pytest.raises(MessageError, match="already uploaded"):
        client.upload(rows, np.ones((1, D), np.uint64))
    wrong_width = DpfSumConfig(2, cfg.layout, D + 1, P, cfg.instance)
    blob = DpfSumClient(wrong_width, 1).upload(rows, np.ones((1, D + 1), np.uint64))[1]
    with pytest.raises(MessageError, match="width"):
        b.receive(blob)
    with pytest.raises(MessageError, match="only server A draws"):
        b.draw_challenge()
    assert SERVER_A != SERVER_B


def test_a_clients_two_uploads_encode_the_common_corrections_once_and_equal_the_plain_encoding():
    """``encode`` makes the public parts of a key pair from one ``gen`` once for both servers' messages; the
    bytes equal ``DpfUpload(key=key.to_bytes())`` message by message, and a pair that does not share its
    arrays (a tampered or rebuilt key) is encoded each on its own, to the same bytes as well."""
    cfg = DpfSumConfig(3, CuckooLayout.for_points(N, P), D, P, os.urandom(16), 7, True)
    rows, vals = np.array([3, 50, 117]), np.arange(9, dtype=np.uint64).reshape(3, D)
    alpha, beta = cfg.layout.spread(rows, vals)
    k0, k1, _ = dpf.gen(alpha, cfg.layout.depth, beta)
    assert k0.shares_public(k1)
    apart = dataclasses.replace(k1, value_cw=k1.value_cw.copy())
    assert not k0.shares_public(apart)
    for pair in ((k0, k1), (k0, apart)):
        sent = DpfSumClient(cfg, 1, floor=3).encode([pair])
        want = tuple(DpfUpload(cfg.instance, 7, 1, to, floor=3, key=k.to_bytes(), part=0, parts=1).to_bytes()
                     for to, k in ((SERVER_A, pair[0]), (SERVER_B, pair[1])))
        assert sent == [want]
