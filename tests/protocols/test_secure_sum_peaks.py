"""Issue 27's peaks: the secure paths that held whole-cohort arrays no longer do.

Each test runs one fixed path on a small shape under tracemalloc (numpy's allocations are traced) and
checks that its peak stays far below the array the old code materialised; on the old code each one
fails (the old allocation alone exceeds the bound, or the interface it checks did not exist). The sums
are checked exactly against the fixed-point sum of the same inputs.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from protocols.secure_sum import RowStack, SparseRows, secure_sum
from protocols.transport import InProcessTransport, Transcript, client
from secagg.dpf_run import _BATCH_BYTES, DpfSpec, run_dpf_rows
from secagg.encoding import FixedPoint


@pytest.fixture(autouse=True, scope="module")
def _numba_imported() -> None:
    """numba's import and its first compiled function (the target context's registries) hold ~45 MB of
    Python objects; a path that loads its compiled loops first within a traced call would count them
    (whichever test an xdist worker runs first): both happen before any peak."""
    import numba

    assert numba.njit(lambda: 1)() == 1


def _peak(fn):  # noqa: ANN001, ANN202
    tracemalloc.start()
    try:
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


def _sparse_updates(n: int, rows: int, width: int, touched: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = np.zeros((n, rows, width))
    for i in range(n):
        x[i, rng.choice(rows, touched, replace=False)] = rng.uniform(-1, 1, (touched, width))
    return x.reshape(n, -1)


def _expect(x: np.ndarray, frac_bits: int, clip: float) -> np.ndarray:
    codec = FixedPoint(frac_bits, clip)
    return codec.decode(codec.encode(x, rounding="nearest").sum(axis=0, dtype=np.uint64))


def _dpf(values, n: int, **kw):  # noqa: ANN001, ANN202
    tr = InProcessTransport(Transcript(keep_payloads=False))
    return secure_sum(values, protocol="dpf", frac_bits=16, value_clip=2.0, round=0, transport=tr,
                      senders=[client(u) for u in range(n)], row_width=16, points=4, **kw)


def test_a_dpf_sum_of_dense_vectors_handles_one_clients_rows_at_a_time() -> None:
    """Before: the float matrix's |x| temporary, its fixed-point copy and the encoder's temporaries, each
    ``n x width`` words (LightFR-dpf's 366 x 632,125 on ml-latest-small: 6.5 GB at the peak)."""
    n, rows, width = 100, 2000, 16
    x = _sparse_updates(n, rows, width, touched=3)  # 26 MB of float64, 3 nonzero rows a client
    _dpf(x[:3], 3)  # warm imports and caches outside the trace
    res, peak = _peak(lambda: _dpf(x, n))
    assert np.array_equal(res.total, _expect(x, 16, 2.0))
    # now ~0.4 x (key sets, the servers' sums, evaluation buffers); before: 2.0 x
    assert peak < x.nbytes / 2, f"peak {peak / 1e6:.1f} MB for {x.nbytes / 1e6:.1f} MB of vectors"
    vectors = list(x)  # the exchange's separate replies, as they are
    res2, peak2 = _peak(lambda: _dpf(SparseRows(vectors, rows * width), n))
    assert np.array_equal(res2.total, res.total) and peak2 < x.nbytes / 2


def test_a_dpf_sum_of_touched_rows_never_builds_a_dense_vector() -> None:
    """A client may hand only its touched rows (any order, zero rows dropped): the sum is the dense one's."""
    n, rows, width = 100, 2000, 16
    x = _sparse_updates(n, rows, width, touched=3, seed=1)
    sparse = []
    for v in x:
        t = v.reshape(rows, width)
        nz = np.flatnonzero(t.any(axis=1))[::-1]  # descending: the sum sorts them
        nz = np.concatenate([nz, [next(r for r in range(rows) if r not in nz)]])  # plus one all-zero row
        sparse.append((nz, t[nz]))
    res, peak = _peak(lambda: _dpf(SparseRows(sparse, rows * width), n))
    assert np.array_equal(res.total, _expect(x, 16, 2.0))
    assert peak < x.nbytes / 2, f"peak {peak / 1e6:.1f} MB; the dense vectors would be {x.nbytes / 1e6:.1f} MB"
    with pytest.raises(ValueError, match="distinct"):
        _dpf(SparseRows([(np.array([1, 1]), np.zeros((2, 16)))] * 2, rows * width), 2)
    with pytest.raises(ValueError, match="non-finite"):
        _dpf(SparseRows([(np.array([1]), np.full((1, 16), np.nan))] * 2, rows * width), 2)


def test_a_chain_sum_encodes_the_rows_into_one_array_without_stacking_them() -> None:
    """Before: the stacked float copy, then ``x * scale``, its rint and the int cast, each ``n x dim``
    words (STTFedRec-CLSM's chain, 50 x 960,429 on ml-latest-small: 2.2 GB at the peak)."""
    n, dim = 12, 100_000  # 9.6 MB of float64 rows
    x = np.random.default_rng(2).uniform(-1, 1, size=(n, dim))
    rows = RowStack(list(x))
    tr = InProcessTransport(Transcript(keep_payloads=False))

    def run(vals, m):  # noqa: ANN001, ANN202
        return secure_sum(vals, protocol="chain", frac_bits=16, value_clip=2.0, round=0, transport=tr,
                          senders=[client(u) for u in range(m)], k=1)

    run(RowStack(list(x[:3, :10])), 3)
    res, peak = _peak(lambda: run(rows, n))
    assert np.array_equal(res.total, _expect(x, 16, 2.0))
    # the encoded inputs (one n x dim array of words, which the simulated clients hold) and the chain's
    # own buffers: ~1.5 x; before: 3.0 x
    assert peak < 2 * x.nbytes, f"peak {peak / 1e6:.1f} MB for {x.nbytes / 1e6:.1f} MB of vectors"


def test_without_kept_messages_the_dpf_record_holds_upload_sizes_and_the_uploads_are_held_once() -> None:
    """Before: every upload's bytes stayed in the record until the sum ended, beside the servers' parsed
    copies (half of LightFR-dpf's key-set memory). Now the servers parse each upload in place (their key
    sets are read-only views of its bytes), so a kept record adds no second copy either, and without
    ``keep_messages`` no upload outlives the sum."""
    n, rows, width = 30, 400, 16
    rng = np.random.default_rng(3)
    updates = [(np.sort(rng.choice(rows, 4, replace=False)), rng.integers(0, 2**20, (4, width), dtype=np.uint64))
               for _ in range(n)]
    run_dpf_rows(updates, DpfSpec(rows, width, 4))  # imports and compiled loops loaded: not counted as either peak
    kept, peak_kept = _peak(lambda: run_dpf_rows(updates, DpfSpec(rows, width, 4)))
    sizes, peak_sizes = _peak(lambda: run_dpf_rows(updates, DpfSpec(rows, width, 4, keep_messages=False)))
    assert np.array_equal(kept.total, sizes.total)
    ups = [r for r in sizes.records if r[2] == "upload"]
    assert all(isinstance(r[3], int) for r in ups) and sum(r[3] for r in ups) == int(sizes.bytes_up.sum())
    # one copy of the uploads either way (before: kept held two, ~0.8 MB more than sizes here)
    assert abs(peak_kept - peak_sizes) < 0.2 * int(kept.bytes_up.sum()), (peak_sizes, peak_kept, int(kept.bytes_up.sum()))


def test_a_lightfr_dpf_round_sends_rows_and_never_holds_the_cohorts_dense_tables() -> None:
    """LightFR-dpf's clients reply with their rated rows and the stats rows (``rows``/``row_values``), not
    an ``(items + tail) x (bits + 1)`` dense vector each (366 of them: 1.9 GB on ml-latest-small); the codes
    are the plaintext ones bit for bit."""
    from protocols.lightfr import LightFR, LightFRConfig
    from recmodels.synthetic import generate_synthetic

    n_users, n_items, bits = 120, 8000, 8
    data = generate_synthetic(n_users=n_users, n_items=n_items, dim=3, mean_interactions=8, seed=4)
    kw = dict(bits=bits, lambda_item=0.05, client_fraction=1.0)
    plain = LightFR(data, LightFRConfig(**kw), seed=4)
    dpf = LightFR(data, LightFRConfig(**kw, secure_aggregation="dpf", dpf_points=16), seed=4,
                  transport=InProcessTransport(Transcript(keep_payloads=False)))  # as the bench runs it
    small = generate_synthetic(n_users=4, n_items=20, dim=3, mean_interactions=4, seed=4)
    LightFR(small, LightFRConfig(**kw, secure_aggregation="dpf", dpf_points=16), seed=4).run_round()  # imports
    plain.run_round()
    _, peak = _peak(dpf.run_round)
    np.testing.assert_array_equal(dpf.d, plain.d)
    np.testing.assert_array_equal(dpf.b, plain.b)
    dense = n_users * (n_items + 1) * (bits + 1) * 8  # 69 MB: the old replies, before their stacked copy
    # now: the key sets, the servers' sums and evaluation buffers (~0.2 x), and the clients' key sets of one
    # batch generated together (secagg.dpf_run._BATCH_BYTES, 16 MB); before: ~4 x
    assert peak < dense / 3 + 2 * _BATCH_BYTES, f"peak {peak / 1e6:.1f} MB against {dense / 1e6:.1f} MB of dense vectors"
    reply = dpf.device_step("train_dense", dpf.round, np.array([0]), {"d": dpf.packed_items}, {})[0]
    assert set(reply) == {"rows", "row_values"} and reply["row_values"].shape == (len(reply["rows"]), bits + 1)
