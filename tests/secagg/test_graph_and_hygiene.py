"""SecAgg+ graphs and abort probability; layering and randomness hygiene of the secagg core."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mpmath
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg.graph import (
    abort_probability,
    complete_graph,
    default_k,
    default_t,
    random_regular_graph,
    simulate_abort_rate,
)

ROOT = Path(__file__).resolve().parents[2]
CORE = ["additive", "bonawitz", "channel", "encoding", "errors", "graph", "keys", "messages", "plain", "prg",
        "runner", "shamir"]


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 80), st.data())
def test_random_regular_graph_is_k_regular_symmetric_and_loop_free(n, data):
    k = data.draw(st.sampled_from(list(range(2, n - 1, 2)) or [n - 1]))
    g = random_regular_graph(n, k)
    assert len(g) == n
    for u, nbrs in enumerate(g):
        assert len(nbrs) == min(k, n - 1) and u not in nbrs and len(set(nbrs)) == len(nbrs)
        assert all(u in g[v] for v in nbrs)


def test_graph_defaults_and_errors():
    assert [default_k(n) for n in (2, 3, 100, 500, 1000)] == [1, 2, 14, 18, 20]
    assert [default_t(k) for k in (14, 18, 20, 30)] == [8, 10, 11, 16]
    assert random_regular_graph(5, 4) == complete_graph(5)
    with pytest.raises(ValueError, match="even"):
        random_regular_graph(10, 3)
    # the graph is random (CSPRNG-shuffled), not a fixed ring
    assert len({random_regular_graph(30, 4) for _ in range(5)}) > 1


@pytest.mark.parametrize(("n", "k", "t", "p"), [(100, 14, 8, 0.1), (500, 30, 11, 0.3), (1000, 20, 11, 0.05)])
def test_abort_probability_matches_an_mpmath_binomial_oracle(n, k, t, p):
    q = mpmath.mpf(1) - mpmath.mpf(p)

    def cdf(x):
        return mpmath.fsum(mpmath.binomial(k, j) * q**j * (1 - q) ** (k - j) for j in range(0, x + 1))

    per_client = q * cdf(t - 2) + (1 - q) * cdf(t - 1)
    assert abort_probability(n, k, t, p) == pytest.approx(float(min(1, n * per_client)), rel=1e-9)


def test_simulated_abort_rate_is_within_the_union_bound():
    for n, k, t, p in [(100, 14, 8, 0.3), (100, 14, 8, 0.1), (200, 8, 5, 0.2)]:
        bound = abort_probability(n, k, t, p)
        rate = simulate_abort_rate(n, k, t, p, trials=300, seed=1)
        assert rate <= bound + 3 * (bound * (1 - bound) / 300) ** 0.5 + 0.01
    assert simulate_abort_rate(100, 14, 8, 0.3, trials=200) > 0.3  # defaults are fragile at 30%
    assert simulate_abort_rate(100, 30, 11, 0.3, trials=200) < 0.05  # Flower's k=30, t=11 are not


def test_core_imports_no_torch_and_nothing_above_secagg():
    code = (
        "import sys\n"
        + "".join(f"import secagg.{m}\n" for m in CORE)
        + "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'dp', 'recmodels', 'protocols', "
        "'attacks', 'experiments')]\nprint(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_no_non_cryptographic_randomness_without_justification():
    for m in CORE:
        for i, line in enumerate((ROOT / "secagg" / f"{m}.py").read_text().splitlines(), 1):
            if re.search(r"np\.random|default_rng|random\.(random|randint|shuffle|choice)\(", line):
                assert "CSPRNG-OK" in line or "SystemRandom" in line, f"secagg/{m}.py:{i}: {line.strip()}"
            if re.match(r"\s*import random\b", line):
                text = (ROOT / "secagg" / f"{m}.py").read_text()
                assert "random.SystemRandom()" in text and not re.search(r"random\.(random|randint|choice)\(", text)
