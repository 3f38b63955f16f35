"""Two-server private row retrieval (secagg/dpf_pir.py): exact rows, a server's view independent
of the indices, and the same trees reused for the sum."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from secagg import dpf, dpf_pir
from secagg.cuckoo import CuckooLayout
from secagg.dpf import DpfError, Forest, KeySet

N = 500


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.int64])
def test_the_client_gets_exactly_the_rows_it_asked_for(dtype):
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((N, 6)) * 100).astype(dtype)
    layout = CuckooLayout.for_points(N, 8, seed=b"r" * 32)
    a, b = dpf_pir.PirServer(layout, table, 0), dpf_pir.PirServer(layout, table, 1)
    for _ in range(5):
        rows = rng.choice(N, rng.integers(1, 9), replace=False)
        qa, qb, q = dpf_pir.query(layout, rows)
        got = dpf_pir.recover(a, q, a.answer(qa), b.answer(qb))
        assert got.dtype == table.dtype and np.array_equal(got, table[rows])


def test_one_servers_view_is_independent_of_the_indices():
    layout = CuckooLayout.for_points(N, 8, seed=b"v" * 32)
    views = []
    for rows in (np.arange(8), np.arange(N - 8, N)):
        blobs = [np.frombuffer(dpf_pir.query(layout, rows)[1][20:], np.uint8) for _ in range(60)]
        views.append(np.stack(blobs))
    assert views[0].shape == views[1].shape
    hist = np.stack([np.bincount(v.ravel(), minlength=256) for v in views])
    assert chi2_contingency(hist)[1] > 1e-6


def test_the_answers_differ_only_where_the_point_is_and_a_bad_query_is_refused():
    table = np.arange(N * 2, dtype=np.int64).reshape(N, 2)
    layout = CuckooLayout.for_points(N, 3, seed=b"q" * 32)
    a = dpf_pir.PirServer(layout, table, 0)
    qa, qb, q = dpf_pir.query(layout, np.array([7, 99]))
    with pytest.raises(DpfError, match="party"):
        a.answer(qb)
    with pytest.raises(DpfError):
        a.answer(qa[:-1])


def test_the_same_trees_then_carry_the_values_of_the_sum():
    """PIR first (trees without values), then the values attached to the same trees: the two
    servers' evaluations add up to the update at the rows that were fetched."""
    layout = CuckooLayout.for_points(N, 4, seed=b"s" * 32)
    rows = np.array([3, 250, 499])
    qa, qb, q = dpf_pir.query(layout, rows)
    k0, k1 = KeySet.from_bytes(qa), KeySet.from_bytes(qb)
    betas = np.zeros((layout.buckets, 2), np.uint64)
    betas[q.buckets] = [[1, 2], [3, 4], [5, 6]]
    v0, v1 = dpf.attach_values(k0, k1, q.secret, betas)
    forest = Forest(layout.sizes, layout.depth)
    total = layout.to_domain(dpf.eval_full(v0, forest) + dpf.eval_full(v1, forest))
    want = np.zeros((N, 2), np.uint64)
    want[rows] = [[1, 2], [3, 4], [5, 6]]
    assert np.array_equal(total, want)
