"""LightFR payload: packed codes against an unpacked numpy oracle, and DCD's exact-minimiser property."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from recmodels import binary_codes as bc


def _codes(rng, n, f):
    return bc.random_codes(n, f, rng)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 5), m=st.integers(1, 30), f=st.integers(1, 200))
def test_pack_roundtrip_and_eq4_identity(seed, n, m, f):
    rng = np.random.default_rng(seed)
    b, d = _codes(rng, n, f), _codes(rng, m, f)
    pb, pd = bc.pack(b), bc.pack(d)
    assert pb.dtype == np.uint64 and pb.shape == (n, bc.words(f))
    np.testing.assert_array_equal(bc.unpack(pb, f), b)
    # oracle on unpacked codes: sim = mean(b == d) = 1/2 + b.d/(2f) = 1 - H/f (Eq. 4)
    eq = (b[:, None, :] == d[None, :, :]).mean(axis=-1)
    dot = b.astype(np.int64) @ d.astype(np.int64).T
    h = bc.hamming(pb, pd)
    np.testing.assert_array_equal(h, (b[:, None, :] != d[None, :, :]).sum(-1))
    np.testing.assert_array_equal(bc.inner(pb, pd, f), dot)
    np.testing.assert_allclose(eq, 0.5 + dot / (2 * f), rtol=0, atol=1e-12)
    np.testing.assert_allclose(eq, 1 - h / f, rtol=0, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), m=st.integers(1, 60), f=st.sampled_from([8, 63, 64, 65, 128]), k=st.integers(1, 10))
def test_top_k_matches_sorting_the_unpacked_scores(seed, m, f, k):
    rng = np.random.default_rng(seed)
    b, d = _codes(rng, 1, f), _codes(rng, m, f)
    got = bc.top_k(bc.pack(b[0]), bc.pack(d), k)
    dot = d.astype(np.int64) @ b[0].astype(np.int64)
    want = np.argsort(-dot, kind="stable")[: min(k, m)]
    np.testing.assert_array_equal(dot[got], dot[want])  # same scores (ties may order differently)
    assert len(set(got.tolist())) == len(got)


def test_bad_codes_are_refused():
    with pytest.raises(bc.CodeError, match="only -1 and \\+1"):
        bc.pack(np.array([[1, 0, -1]]))
    with pytest.raises(bc.CodeError, match="only -1 and \\+1"):
        bc.check_codes(np.array([1.0, 0.5]))
    with pytest.raises(bc.CodeError, match="4 bits"):
        bc.check_codes(np.ones((2, 3)), f=4)
    with pytest.raises(bc.CodeError, match="beyond f=3"):
        bc.unpack(np.array([[np.uint64(0xFF)]], dtype=np.uint64), 3)
    with pytest.raises(bc.CodeError, match="uint64"):
        bc.unpack(np.zeros((1, 2), dtype=np.uint64), 3)


def _problem(seed, n, m, f, density=0.4):
    rng = np.random.default_rng(seed)
    b, d = _codes(rng, n, f), _codes(rng, m, f)
    mask = rng.random((n, m)) < density
    mask[np.arange(n), rng.integers(0, m, n)] = True
    users, items = np.nonzero(mask)
    r = rng.random(len(users))
    return rng, b, d, users, items, r


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), f=st.integers(2, 24), lam=st.sampled_from([0.0, 0.01, 0.3]))
def test_dcd_bit_choice_is_the_exact_coordinate_minimiser(seed, f, lam):
    """L(b_k=+1) - L(b_k=-1) = -2 b*_k, so sign(b*_k) is the best value of bit k (notes §8 claim 2)."""
    _, b, d, users, items, r = _problem(seed, 4, 12, f)
    for k in range(f):
        # one sweep restricted to bit k: compare the chosen value's loss with the other value's
        plus, minus = b.copy(), b.copy()
        plus[:, k], minus[:, k] = 1, -1
        lp = bc.user_loss(plus, d, users, items, r, lam)
        lm = bc.user_loss(minus, d, users, items, r, lam)
        out = bc.dcd_users(b, d, users, items, r, lam=lam, max_sweeps=1, active=None)
        # the first bit of the first sweep sees exactly b: check it for k = 0 only via the result
        if k == 0:
            chosen = out.codes[:, 0]
            best = np.where(lp < lm, 1, np.where(lm < lp, -1, b[:, 0]))
            decided = np.abs(lp - lm) > 1e-12
            np.testing.assert_array_equal(chosen[decided], best[decided])
    # the closed form of the difference, for every bit of every user
    f_ = b.shape[1]
    bb = b.astype(np.float64)
    s = (bb[users] * d[items]).sum(1)
    for k in range(f_):
        plus, minus = b.copy(), b.copy()
        plus[:, k], minus[:, k] = 1, -1
        diff = bc.user_loss(plus, d, users, items, r, lam) - bc.user_loss(minus, d, users, items, r, lam)
        resid = r - 0.5 - (s - bb[users, k] * d[items, k]) / (2 * f_)
        star = np.bincount(users, weights=resid * d[items, k], minlength=4) / f_ - 2 * lam * (bb.sum(1) - bb[:, k])
        np.testing.assert_allclose(diff, -2 * star, rtol=0, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), f=st.integers(2, 32), lam=st.sampled_from([0.0, 0.02, 0.5]),
       sweeps=st.integers(1, 6))
def test_user_sweep_never_increases_the_loss_and_stops(seed, f, lam, sweeps):
    _, b, d, users, items, r = _problem(seed, 6, 15, f)
    before = bc.user_loss(b, d, users, items, r, lam)
    out = bc.dcd_users(b, d, users, items, r, lam=lam, max_sweeps=sweeps)
    after = bc.user_loss(out.codes, d, users, items, r, lam)
    assert np.all(after <= before + 1e-12)
    full = bc.dcd_users(b, d, users, items, r, lam=lam, max_sweeps=10_000)
    assert full.converged.all()  # every flip strictly lowers the loss: the sweep terminates
    again = bc.dcd_users(full.codes, d, users, items, r, lam=lam, max_sweeps=3)
    np.testing.assert_array_equal(again.codes, full.codes)  # a fixed point: no bit moves
    assert (again.sweeps == 1).all()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), f=st.integers(2, 16), lam=st.sampled_from([0.0, 0.05]))
def test_item_dcd_from_statistics_is_exact_and_monotone(seed, f, lam):
    _, b, d, users, items, r = _problem(seed, 7, 9, f)
    a, g, cnt = bc.item_sufficient_stats(b, users, items, r, 9)
    before = bc.item_loss(d, b, users, items, r, lam)
    out = bc.item_dcd(d, a, g, cnt, lam=lam, max_sweeps=1000)
    after = bc.item_loss(out.codes, b, users, items, r, lam)
    assert np.all(after <= before + 1e-12) and out.converged.all()
    # every bit of a rated item's result is a coordinate minimum of its loss; unrated items stay
    rated = cnt > 0
    np.testing.assert_array_equal(out.codes[~rated], d[~rated])
    for k in range(f):
        flip = out.codes.copy()
        flip[:, k] *= -1
        assert np.all(bc.item_loss(flip, b, users, items, r, lam)[rated] >= after[rated] - 1e-12)
    # Agg_grad's summed upload is the same statistic seen at the old codes (Jacobi step)
    grads = bc.item_gradients(b, d, users, items, r)
    tot = np.zeros((9, f))
    np.add.at(tot, items, grads)
    gd = np.einsum("mkj,mj->mk", g, d.astype(np.float64))
    np.testing.assert_allclose(tot / f, a / f - (gd - cnt[:, None] * d) / (2 * f * f), atol=1e-10)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), f=st.integers(1, 40))
def test_upload_closed_form_is_residual_times_code_plus_half_bit(seed, f):
    """Delta d = (r - sim) b_k + d_ik/(2f): the rank-1 structure the one-upload attack uses (notes §1.3)."""
    _, b, d, users, items, r = _problem(seed, 3, 7, f)
    grads = bc.item_gradients(b, d, users, items, r)
    sim = 0.5 + (b[users].astype(float) * d[items]).sum(1) / (2 * f)
    np.testing.assert_allclose(grads, (r - sim)[:, None] * b[users] + d[items] / (2 * f), atol=1e-12)


def test_median_quantise_and_scaling():
    x = np.array([[1.0, 5.0], [2.0, 4.0], [3.0, 3.0], [4.0, 2.0]])
    np.testing.assert_array_equal(bc.median_quantise(x), [[-1, 1], [-1, 1], [1, -1], [1, -1]])
    np.testing.assert_allclose(bc.scale_ratings(np.array([0.5, 5.0, 2.75]), 0.5, 5.0), [0, 1, 0.5])
    with pytest.raises(ValueError, match="hi >= lo"):
        bc.scale_ratings(np.array([1.0]), 3.0, 1.0)


def test_local_item_codes_only_move_towards_the_raters_preference():
    rng = np.random.default_rng(0)
    b, d = _codes(rng, 1, 16), _codes(rng, 3, 16)
    users, items, r = np.zeros(3, dtype=np.int64), np.arange(3), np.array([1.0, 0.0, 0.5])
    out = bc.local_item_codes(b, d, users, items, r, lam=0.0)
    assert (out[0] == b[0]).all()  # loved: becomes the user's code
    assert (out[1] == -b[0]).all()  # hated: the opposite code
