"""PMF and SVD++ against scikit-surprise (an independent implementation of the same SGD updates).

Both start from surprise's own initial factors (surprise with 0 epochs, same ``random_state``), walk
the ratings in surprise's order (grouped by user) and must end at surprise's factors.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import surprise  # the dev extra's independent oracle (pip install -e .[dev])
from recmodels.pmf import PMFConfig, RatingModel, pmf_epoch
from recmodels.svdpp import SVDppConfig, SVDppModel, svdpp_epoch, svdpp_order


def _tiny(seed: int, n_users: int, n_items: int, density: float):
    rng = np.random.default_rng(seed)
    mask = rng.random((n_users, n_items)) < density
    mask[np.arange(n_users), rng.integers(0, n_items, n_users)] = True  # every user and every item rated
    mask[rng.integers(0, n_users, n_items), np.arange(n_items)] = True
    u, i = np.nonzero(mask)
    r = rng.integers(1, 6, len(u)).astype(np.float64)
    return u, i, r


def _surprise(u, i, r, algo_cls, epochs, **kw):
    import tempfile
    from pathlib import Path

    from surprise import Dataset, Reader

    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "r.txt"
        f.write_text("".join(f"{a} {b} {c}\n" for a, b, c in zip(u, i, r)))
        data = Dataset.load_from_file(str(f), Reader(line_format="user item rating", sep=" ", rating_scale=(1, 5)))
    ts = data.build_full_trainset()
    start = algo_cls(n_epochs=0, random_state=7, **kw).fit(ts)
    end = algo_cls(n_epochs=epochs, random_state=7, **kw).fit(ts)
    # our dense ids -> surprise's inner ids
    uid = np.array([ts.to_inner_uid(str(x)) for x in range(u.max() + 1)])
    iid = np.array([ts.to_inner_iid(str(x)) for x in range(i.max() + 1)])
    order = np.array([k for uu in range(ts.n_users) for k in np.flatnonzero(uid[u] == uu)])
    return ts, start, end, uid, iid, order


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), epochs=st.integers(1, 3), dim=st.integers(1, 6))
def test_pmf_matches_surprise_unbiased_svd(seed: int, epochs: int, dim: int) -> None:
    u, i, r = _tiny(seed, 7, 9, 0.4)
    kw = dict(n_factors=dim, biased=False, lr_all=0.03, reg_all=0.05, init_std_dev=0.3)
    ts, start, end, uid, iid, order = _surprise(u, i, r, surprise.SVD, epochs, **kw)
    cfg = PMFConfig(dim=dim, lr=0.03, reg_user=0.05, reg_item=0.05, center=False, order="user")
    m = RatingModel(start.pu[uid].copy(), start.qi[iid].copy(), np.zeros(len(uid)), np.zeros(len(iid)), 0.0)
    for _ in range(epochs):
        pmf_epoch(m, u, i, r, order, cfg)
    np.testing.assert_allclose(m.p, end.pu[uid], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(m.q, end.qi[iid], rtol=1e-9, atol=1e-12)
    # and a prediction, through surprise's own estimate
    assert m.predict(u[:1], i[:1])[0] == pytest.approx(end.estimate(uid[u[0]], iid[i[0]]), abs=1e-9)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), epochs=st.integers(1, 3), dim=st.integers(1, 5))
def test_svdpp_matches_surprise(seed: int, epochs: int, dim: int) -> None:
    u, i, r = _tiny(seed, 6, 8, 0.5)
    kw = dict(n_factors=dim, lr_all=0.02, reg_all=0.05, init_std_dev=0.3)
    ts, start, end, uid, iid, order = _surprise(u, i, r, surprise.SVDpp, epochs, **kw)
    m = SVDppModel.init_svdpp(len(uid), len(iid), dim, 0.1, ts.global_mean, u, i, np.random.default_rng(0))
    m.p, m.q, m.y = start.pu[uid].copy(), start.qi[iid].copy(), start.yj[iid].copy()
    cfg = SVDppConfig(dim=dim, lr=0.02, reg=0.05, order="user")
    for _ in range(epochs):
        svdpp_epoch(m, u, i, r, order, cfg)
    for ours, theirs in ((m.p, end.pu[uid]), (m.q, end.qi[iid]), (m.y, end.yj[iid]), (m.bu, end.bu[uid]),
                         (m.bi, end.bi[iid])):
        np.testing.assert_allclose(ours, theirs, rtol=1e-8, atol=1e-10)
    est = surprise.SVDpp.estimate(end, uid[u[0]], iid[i[0]])
    assert m.predict(u[:1], i[:1])[0] == pytest.approx(est, abs=1e-8)


def test_svdpp_lazy_updates_equal_the_per_rating_rule_in_any_order() -> None:
    """The lazy y-updates are exact in a fully shuffled order too (users interleaved)."""
    u, i, r = _tiny(3, 5, 7, 0.6)
    cfg = SVDppConfig(dim=3, lr=0.05, reg=0.1)
    a = SVDppModel.init_svdpp(5, 7, 3, 0.3, 3.0, u, i, np.random.default_rng(1))
    b = SVDppModel.init_svdpp(5, 7, 3, 0.3, 3.0, u, i, np.random.default_rng(1))
    order = np.random.default_rng(2).permutation(len(u))
    svdpp_epoch(a, u, i, r, order, cfg)
    for k in order:  # the textbook rule, one rating at a time
        uu, ii = u[k], i[k]
        nu = b.n_items[b.n_start[uu]:b.n_start[uu + 1]]
        impl = b.y[nu].sum(0) / np.sqrt(len(nu))
        e = r[k] - (b.mu + b.bu[uu] + b.bi[ii] + b.q[ii] @ (b.p[uu] + impl))
        b.bu[uu] += cfg.lr * (e - cfg.reg * b.bu[uu])
        b.bi[ii] += cfg.lr * (e - cfg.reg * b.bi[ii])
        pu, qi = b.p[uu].copy(), b.q[ii].copy()
        b.p[uu] += cfg.lr * (e * qi - cfg.reg * pu)
        b.q[ii] += cfg.lr * (e * (pu + impl) - cfg.reg * qi)
        b.y[nu] += cfg.lr * (e * qi / np.sqrt(len(nu)) - cfg.reg * b.y[nu])
    for x, y in ((a.p, b.p), (a.q, b.q), (a.y, b.y), (a.bu, b.bu)):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)


def test_svdpp_shuffled_order_is_a_grouped_permutation() -> None:
    users = np.random.default_rng(0).integers(0, 9, 60)
    order = svdpp_order(users, "shuffle", np.random.default_rng(1))
    assert sorted(order.tolist()) == list(range(60))
    runs = users[order]
    assert (np.diff(runs) != 0).sum() + 1 == len(np.unique(users))  # each user's rows are contiguous


def test_configs_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="pmf.lr"):
        PMFConfig(lr=0.0)
    with pytest.raises(ValueError, match="svdpp.order"):
        SVDppConfig(order="random")
