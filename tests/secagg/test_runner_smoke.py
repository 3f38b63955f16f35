"""Smoke test: every registered protocol sums correctly with and without input-stage dropouts."""

from __future__ import annotations

import numpy as np
import pytest

from secagg.runner import INPUT_STAGE, PROTOCOLS, RunSpec, run


@pytest.mark.parametrize("protocol", sorted(p for p in PROTOCOLS if p != "chain"))
@pytest.mark.parametrize("n", [2, 5, 17])
def test_sum_of_survivors(protocol, n):
    x = np.frombuffer(np.random.default_rng(n).bytes(8 * n * 9), dtype=np.uint64).reshape(n, 9)  # CSPRNG-OK: test data
    drop = frozenset({n - 1}) if n >= 5 else frozenset()
    res = run(protocol, x, RunSpec(dropouts={INPUT_STAGE: drop}))
    assert res.ok, res.abort
    assert res.survivors == frozenset(range(n)) - drop
    assert res.total.tolist() == x[sorted(res.survivors)].sum(axis=0).tolist()
