"""FedRec: the filled items hide the rated ones in every upload, the step is the stated one, secure sums agree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp.rng import DeterministicTestSource
from protocols.fedrec import FedRec, FedRecConfig, FedRecUpload, draw_filled
from protocols.transport import InProcessTransport, Transcript
from recmodels.data import Interactions


def _data(n_users: int, n_items: int, per_user: int, seed: int = 0) -> Interactions:
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(n_users), per_user)
    items = np.concatenate([rng.choice(n_items, per_user, replace=False) for _ in range(n_users)])
    n = len(users)
    ratings = rng.integers(1, 6, n).astype(np.float32)
    return Interactions(users, items, ratings, np.arange(n), np.arange(n_users), np.arange(n_items))


def _uploads(tr: InProcessTransport, rnd: int) -> dict[int, FedRecUpload]:
    return {r.payload.user: r.payload for r in tr.transcript.records if r.kind == "update" and r.round == rnd}


@settings(max_examples=15, deadline=None)
@given(per_user=st.integers(1, 8), rho=st.sampled_from([0.5, 1.0, 2.0]), seed=st.integers(0, 1000))
def test_uploads_mix_rated_and_filled_rows_that_count_cannot_separate(per_user: int, rho: float, seed: int) -> None:
    train = _data(4, 40, per_user, seed)
    tr = InProcessTransport(Transcript(keep_payloads=True))
    fed = FedRec(train, FedRecConfig(dim=3, rho=rho), seed=seed, transport=tr,
                 _test_source=DeterministicTestSource(bytes([seed % 256]) * 32))
    for _ in range(3):
        fed.run_round()
    for u in range(4):
        rated = np.sort(train.items[train.users == u])
        filled = fed.filled(u)
        assert len(filled) == min(round(rho * per_user), 40 - per_user)
        assert not set(filled) & set(rated)
        ups = [_uploads(tr, r)[u] for r in range(3)]
        for up in ups:
            # one row per rated and filled item, sorted by id (no position or count tells them apart), all nonzero
            np.testing.assert_array_equal(up.items, np.union1d(rated, filled))
            assert (np.abs(up.gradients).sum(1) > 0).all()
            assert up.nbytes == 4 * len(up.items) * (1 + 3)
        # the filled set is the same every round: intersecting rounds reveals nothing more
        assert all(np.array_equal(ups[0].items, up.items) for up in ups)


def test_filled_sets_come_from_the_csprng_and_are_uniform() -> None:
    rated = np.array([0, 1, 2])
    src = DeterministicTestSource(b"\x01" * 32)
    hits = np.zeros(10)
    for _ in range(2000):
        hits[draw_filled(rated, 10, 2, src)] += 1
    assert hits[:3].sum() == 0
    assert np.allclose(hits[3:] / 2000, 2 / 7, atol=0.04)  # each unrated item is chosen with probability 2/7
    # two fresh systems draw different sets: the server cannot recompute them from the run's seed
    train = _data(3, 200, 5)
    a, b = FedRec(train, FedRecConfig(), seed=0), FedRec(train, FedRecConfig(), seed=0)
    assert not np.array_equal(a.fi, b.fi)


def test_a_round_is_the_stated_step() -> None:
    train = _data(3, 12, 4)
    tr = InProcessTransport(Transcript(keep_payloads=True))
    cfg = FedRecConfig(dim=2, lr=0.05, reg=0.1, filling="average")
    fed = FedRec(train, cfg, seed=1, transport=tr)
    p0, q0 = fed.p.copy(), fed.q.copy()
    fed.run_round()
    grad_q, uploads = np.zeros_like(q0), np.zeros(12)
    for u in range(3):
        rows = train.users == u
        items, ratings = train.items[rows], train.ratings[rows].astype(float)
        filled = fed.filled(u)
        gp = np.zeros(2)
        for i, r in zip(items, ratings):
            e = r - p0[u] @ q0[i]
            gp = gp - e * q0[i] / len(items)
            grad_q[i] += -e * p0[u] + 0.1 * q0[i]
            uploads[i] += 1
        for i in filled:
            e = ratings.mean() - p0[u] @ q0[i]
            grad_q[i] += -e * p0[u] + 0.1 * q0[i]
            uploads[i] += 1
        np.testing.assert_allclose(fed.p[u], p0[u] - 0.05 * (gp + 0.1 * p0[u]), rtol=1e-10)
    np.testing.assert_allclose(fed.q, q0 - 0.05 * grad_q / np.maximum(uploads, 1)[:, None], rtol=1e-10)


def test_secure_aggregation_gives_the_plaintext_step_and_hides_the_rows() -> None:
    train = _data(4, 15, 3)
    src = bytes(range(32))
    plain = FedRec(train, FedRecConfig(dim=2), seed=2, _test_source=DeterministicTestSource(src))
    tr = InProcessTransport(Transcript(keep_payloads=True))
    masked = FedRec(train, FedRecConfig(dim=2, secure_aggregation="secagg"), seed=2, transport=tr,
                    _test_source=DeterministicTestSource(src))
    a, b = plain.run_round(), masked.run_round()
    np.testing.assert_allclose(masked.q, plain.q, atol=1e-5)
    assert b.loss == pytest.approx(a.loss, abs=1e-5)
    ups = [r.payload for r in tr.transcript.records if r.kind == "update"]
    assert len(ups) == 4 and all(u.dtype == np.uint64 and u.size == 15 * 2 + 15 + 2 for u in ups)


def test_training_lowers_the_error_and_checkpoints_continue_exactly() -> None:
    train = _data(8, 20, 6)
    fed = FedRec(train, FedRecConfig(dim=3, lr=0.02), seed=0)
    first = fed.run_round().loss
    for _ in range(30):
        last = fed.run_round().loss
    assert last < first
    other = FedRec(train, FedRecConfig(dim=3, lr=0.02), seed=0)
    other.load_state_dict(fed.state_dict())
    fed.run_round()
    other.run_round()
    np.testing.assert_array_equal(fed.q, other.q)
    assert set(fed.evaluate(train)) == {"rmse", "mae"}
