"""secure_sum holds no clients x dim array of its own: rows are encoded when each client masks its own."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.secure_sum import secure_sum
from protocols.transport import InProcessTransport, Transcript
from secagg.encoding import FixedPoint


def _sum(values: np.ndarray, protocol: str, keep: bool = False):  # noqa: ANN202
    transport = InProcessTransport(Transcript(keep_payloads=keep))
    senders = [f"client:{i}" for i in range(values.shape[0])]
    return secure_sum(values, protocol=protocol, frac_bits=16, value_clip=4.0, round=0, transport=transport,
                      senders=senders, dropout=0.0, corrupt=0.0), transport


@settings(max_examples=10, deadline=None)
@given(n=st.integers(2, 12), dim=st.integers(1, 50), plus=st.booleans(), seed=st.integers(0, 2**31))
def test_the_sum_is_the_fixed_point_sum_of_the_clients_rows(n, dim, plus, seed) -> None:
    values = np.random.default_rng(seed).uniform(-4, 4, size=(n, dim))
    res, _ = _sum(values, "secagg+" if plus else "secagg")
    codec = FixedPoint(16, 4.0)
    expect = codec.decode(codec.encode(values, rounding="nearest").sum(axis=0, dtype=np.uint64))
    assert np.array_equal(res.total, expect)


def test_an_instance_allocates_far_less_than_the_clients_vectors() -> None:
    n, dim = 40, 60_000  # 19 MB of float64 vectors
    values = np.random.default_rng(0).uniform(-1, 1, size=(n, dim))
    _sum(values[:3, :10], "secagg+")  # warm imports and caches outside the trace
    tracemalloc.start()
    try:
        res, transport = _sum(values, "secagg+")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.allclose(res.total, values.sum(axis=0), atol=n * 2.0**-16)
    # before: the encoded copy (n x dim words), the encoder's temporaries and every masked input kept
    # in the record, each n x dim x 8 bytes; now a few dim-long rows at a time
    assert peak < values.nbytes / 4, f"peak {peak / 1e6:.1f} MB for {values.nbytes / 1e6:.1f} MB of vectors"


def test_a_transcript_that_keeps_payloads_still_gets_every_masked_input() -> None:
    values = np.random.default_rng(1).uniform(-1, 1, size=(5, 7))
    _, transport = _sum(values, "secagg", keep=True)
    ups = [r for r in transport.transcript.records if r.kind == "update"]
    assert len(ups) == 5 and all(r.payload is not None and r.payload.shape == (7,) for r in ups)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_anywhere_is_refused(bad) -> None:
    values = np.zeros((130, 3))
    values = np.zeros((130, 3 << 14))
    values[129, 2] = bad  # in the last block of the blockwise check
    with pytest.raises(ValueError, match="non-finite"):
        _sum(values, "secagg")


@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 8), dim=st.integers(1, 30), protocol=st.sampled_from(["secagg", "secagg+", "plain"]),
       seed=st.integers(0, 2**31))
def test_rows_given_separately_sum_exactly_like_the_stacked_matrix(n, dim, protocol, seed) -> None:
    """RowStack (the exchange's vectors as they are, no stacked copy) gives the matrix's fixed-point sum."""
    from protocols.secure_sum import RowStack

    values = np.random.default_rng(seed).uniform(-4, 4, size=(n, dim))
    res, _ = _sum(RowStack(list(values)), protocol)
    codec = FixedPoint(16, 4.0)
    expect = codec.decode(codec.encode(values, rounding="nearest").sum(axis=0, dtype=np.uint64))
    assert np.array_equal(res.total, expect)
    with pytest.raises(ValueError, match="one length"):
        RowStack([np.zeros(2), np.zeros(3)])


def test_lazy_rows_are_built_when_asked_and_checked() -> None:
    from protocols.secure_sum import RowStack

    asked: list[int] = []

    def row(i: int) -> np.ndarray:
        asked.append(i)
        return np.full(4, float(i))

    rows = RowStack.lazy(3, 4, row)
    assert rows.shape == (3, 4) and asked == []
    assert np.array_equal(rows[-1], np.full(4, 2.0)) and np.array_equal(rows[0:2], [[0.0] * 4, [1.0] * 4])
    with pytest.raises(IndexError):
        rows[3]
    bad = RowStack.lazy(2, 5, row)
    with pytest.raises(ValueError, match="shape"):
        bad[0]
    res, _ = _sum(RowStack.lazy(3, 4, row), "secagg+")
    assert np.allclose(res.total, [3.0] * 4)


def test_a_secure_fedavg_round_never_holds_the_cohorts_dense_updates() -> None:
    """FedAvg-GMF's secure sum builds each client's dense update when that client masks it: the round's
    peak stays far below the ``clients x (items x dim)`` float64 matrix it used to stack (1.5 GB on
    ml-latest-small), and the model is the plaintext one."""
    import torch

    from protocols.fedavg import FedAvgConfig, FedAvgGMF
    from tests.protocols.test_fedavg import make_train

    n_users, n_items, dim = 40, 6000, 8
    train = make_train(n_users, n_items, [5] * n_users, seed=3)
    dense = n_users * (n_items * dim + dim + 2) * 8  # 15 MB
    base = dict(dim=dim, lr=0.05, init_std=0.3)
    plain = FedAvgGMF(train, FedAvgConfig(**base), seed=3)
    secure = FedAvgGMF(train, FedAvgConfig(**base, secure_aggregation="secagg+"), seed=3)
    plain.run_round()
    tracemalloc.start()
    try:
        secure.run_round()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    torch.testing.assert_close(secure.item, plain.item, atol=1e-5, rtol=0)
    assert peak < dense / 3, f"peak {peak / 1e6:.1f} MB against {dense / 1e6:.1f} MB of dense updates"
