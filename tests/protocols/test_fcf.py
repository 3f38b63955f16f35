"""FCF: the local ALS step against the closed form, the uploads against the cost's gradient, the server step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.fcf import FCF, FCFConfig, FCFUpdate, client_gradient, solve_user
from protocols.transport import InProcessTransport, Transcript
from recmodels.data import Interactions


def _data(n_users: int, n_items: int, per_user: int, seed: int = 0) -> Interactions:
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(n_users), per_user)
    items = np.concatenate([rng.choice(n_items, per_user, replace=False) for _ in range(n_users)])
    n = len(users)
    return Interactions(users, items, np.ones(n, np.float32), np.arange(n), np.arange(n_users), np.arange(n_items))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n_items=st.integers(2, 30), dim=st.integers(1, 6),
       alpha=st.floats(0, 20), reg=st.floats(0.01, 5))
def test_local_als_step_is_the_closed_form_minimiser(seed: int, n_items: int, dim: int, alpha: float,
                                                     reg: float) -> None:
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(n_items, dim))
    items = np.sort(rng.choice(n_items, rng.integers(1, n_items + 1), replace=False))
    values = rng.uniform(0.5, 5, len(items))
    x = solve_user(y, y.T @ y, items, values, alpha, reg)
    # the textbook normal equations with the full diagonal confidence matrix
    p = np.zeros(n_items)
    p[items] = 1
    c = np.ones(n_items)
    c[items] = 1 + alpha * values
    cu = np.diag(c)
    want = np.linalg.solve(y.T @ cu @ y + reg * np.eye(dim), y.T @ cu @ p)
    np.testing.assert_allclose(x, want, rtol=1e-8, atol=1e-10)
    # ...and it is the minimiser: the gradient of the user's cost vanishes there
    grad_x = -2 * (y.T @ (c * (p - y @ x))) + 2 * reg * x
    np.testing.assert_allclose(grad_x, 0, atol=1e-7 * max(1.0, np.abs(y.T @ cu @ p).max()))


def test_upload_is_minus_half_the_gradient_of_the_clients_cost() -> None:
    rng = np.random.default_rng(1)
    y, x = rng.normal(size=(9, 3)), rng.normal(size=3)
    items, values = np.array([1, 4, 7]), np.array([1.0, 2.0, 1.0])
    f, cost = client_gradient(y, x, items, values, alpha=2.0)

    def j(yy: np.ndarray) -> float:
        return client_gradient(yy, x, items, values, 2.0)[1]

    num = np.zeros_like(y)
    for idx in np.ndindex(*y.shape):
        e = np.zeros_like(y)
        e[idx] = 1e-6
        num[idx] = (j(y + e) - j(y - e)) / 2e-6
    np.testing.assert_allclose(-2 * f, num, rtol=1e-5, atol=1e-6)
    assert cost == pytest.approx(j(y))


def test_a_round_sums_the_uploads_and_steps_the_items() -> None:
    train = _data(6, 15, 3)
    tr = InProcessTransport(Transcript(keep_payloads=True))
    fcf = FCF(train, FCFConfig(dim=3, optimizer="sgd", lr=0.01, reg=0.5), seed=0, transport=tr)
    y0 = fcf.y.copy()
    fcf.run_round()
    ups = [r.payload for r in tr.transcript.records if r.kind == "update"]
    assert len(ups) == 6 and all(isinstance(u, FCFUpdate) and u.gradient.shape == (15, 3) for u in ups)
    grad = -2 * sum(u.gradient for u in ups) + 2 * 0.5 * y0
    np.testing.assert_allclose(fcf.y, y0 - 0.01 * grad, rtol=1e-10)
    assert {r.nbytes for r in tr.transcript.records if r.kind == "model"} == {4 * 15 * 3}


def test_secure_aggregation_gives_the_plaintext_step_and_training_lowers_the_cost() -> None:
    train = _data(5, 12, 3)
    plain = FCF(train, FCFConfig(dim=2), seed=3)
    masked = FCF(train, FCFConfig(dim=2, secure_aggregation="secagg"), seed=3)
    a, b = plain.run_round(), masked.run_round()
    np.testing.assert_allclose(masked.y, plain.y, atol=1e-5)
    assert b.loss == pytest.approx(a.loss, abs=1e-5)
    losses = [plain.run_round().loss for _ in range(15)]
    assert losses[-1] < losses[0]


def test_checkpoint_round_trip() -> None:
    train = _data(5, 12, 3)
    a = FCF(train, FCFConfig(dim=2, client_fraction=0.6), seed=3)
    a.run_round()
    b = FCF(train, FCFConfig(dim=2, client_fraction=0.6), seed=3)
    b.load_state_dict(a.state_dict())
    a.run_round()
    b.run_round()
    np.testing.assert_array_equal(a.y, b.y)
    np.testing.assert_array_equal(a.score_all(np.arange(5)), b.score_all(np.arange(5)))
