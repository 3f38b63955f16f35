"""FEL's payload in recmodels: disjoint public clustering, combiners and fold-in against direct numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from recmodels import clusters
from recmodels.ensemble import OverArch, combine, fold_in, train_over_arch
from recmodels.loaders import load_interactions
from recmodels.side import load_user_demographics

U_USER = ("1|24|M|technician|85711\n2|53|F|other|94043\n3|17|M|writer|32067\n4|33|F|writer|10001\n"
          "5|41|M|technician|85000\n6|29|M|other|90210\n")
U_DATA = "".join(f"{u}\t{10 + u % 3}\t5\t{100 + u}\n" for u in range(1, 7))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=60, unique=True), st.integers(1, 9))
def test_hash_clusters_disjoint_and_total(ids: list[int], k: int) -> None:
    a = clusters.hash_clusters(ids, k)
    assert a.shape == (len(ids),) and a.min() >= 0 and a.max() < k
    members = [np.flatnonzero(a == c) for c in range(k)]
    assert sum(len(m) for m in members) == len(ids)  # every user in exactly one cluster
    np.testing.assert_array_equal(clusters.from_members(members, len(ids)), a)
    np.testing.assert_array_equal(clusters.hash_clusters(ids, k), a)  # public and deterministic


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 30), st.integers(1, 5), st.data())
def test_from_members_refuses_overlaps(n: int, k: int, data) -> None:
    a = data.draw(hnp.arrays(np.int64, n, elements=st.integers(0, k - 1)))
    members = [np.flatnonzero(a == c) for c in range(k)]
    victim = data.draw(st.integers(0, n - 1))
    other = (a[victim] + 1) % max(k, 2)
    members += [[]] * (other + 1 - len(members))
    members[other] = np.append(np.asarray(members[other], dtype=np.int64), victim)
    with pytest.raises(ValueError, match="overlap"):
        clusters.from_members(members, n)


def test_attribute_and_kmeans_clusters_from_demographics(tmp_path: Path) -> None:
    (tmp_path / "u.data").write_text(U_DATA)
    (tmp_path / "u.user").write_text(U_USER)
    data = load_interactions(tmp_path)
    demo = load_user_demographics(tmp_path / "u.data", data.user_ids)
    g = clusters.attribute_clusters(demo, "gender", 2)
    assert list(g) == [0 if s == "M" else 1 for s in demo.gender]
    occ = clusters.attribute_clusters(demo, "occupation", 2)  # 3 values into 2: rarest join the last
    assert set(occ) == {0, 1} and occ.shape == (6,)
    km = clusters.kmeans_clusters(clusters.demographic_features(demo), 3, seed=0)
    assert km.shape == (6,) and km.min() >= 0 and km.max() < 3
    np.testing.assert_array_equal(km, clusters.kmeans_clusters(clusters.demographic_features(demo), 3, seed=0))


def test_check_sizes_refuses_small_cluster() -> None:
    a = np.array([0, 0, 0, 1])
    with pytest.raises(ValueError, match="cluster 1 has 1 clients, below fel.min_clients=2"):
        clusters.check_sizes(a, 2, np.arange(4), 2, "fel.min_clients")


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float64, st.tuples(st.integers(1, 7), st.integers(1, 5), st.integers(1, 4)),
                  elements=st.floats(0, 1)))
def test_combiners_equal_direct_numpy(p: np.ndarray) -> None:
    for how in ("mean", "median", "max"):
        want = np.empty(p.shape[1:])
        for idx in np.ndindex(*p.shape[1:]):
            col = sorted(p[(slice(None),) + idx])
            n = len(col)
            want[idx] = {"mean": sum(col) / n, "max": col[-1],
                         "median": col[n // 2] if n % 2 else (col[n // 2 - 1] + col[n // 2]) / 2}[how]
        np.testing.assert_allclose(combine(p, how), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="combiner"):
        combine(p, "vote")


def test_fold_in_solves_the_ridge_system() -> None:
    rng = np.random.default_rng(0)
    v = torch.as_tensor(rng.normal(size=(12, 3)), dtype=torch.float32)
    pos_items = np.array([1, 4, 5, 0, 7, 11, 2])
    pos_start = np.array([0, 3, 3, 7])
    got = fold_in(v, pos_start, pos_items, np.array([0, 1, 2]), reg=0.3, neg_weight=0.05).numpy()
    vv = v.double().numpy()
    for row, u in enumerate([0, 1, 2]):
        pos = pos_items[pos_start[u]:pos_start[u + 1]]
        a = 0.05 * vv.T @ vv + 0.3 * np.eye(3) + 0.95 * vv[pos].T @ vv[pos]
        np.testing.assert_allclose(got[row], np.linalg.solve(a, vv[pos].sum(0)), rtol=1e-5, atol=1e-6)
    assert np.allclose(got[1], 0)  # no positives: the zero vector


def test_over_arch_learns_a_separable_rule() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(400, 6, generator=g)
    y = (z[:, 0] > 0).float()
    model = OverArch(6, 8, seed=1)
    train_over_arch(model, z, y, epochs=30, lr=0.05, batch_size=64, seed=2)
    with torch.no_grad():
        acc = ((model(z) > 0).float() == y).float().mean()
    assert acc > 0.9
