"""The fused evaluation (secagg/dpf_fused.py, numba) against the numpy path and the reference: the
same sums word for word, the same digests, on random forests (empty trees, chunks and groups of
trees that cut across trees), batches, widths, parties, signs, with and without the check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import aesni, dpf, dpf_fused  # numba is a dependency (pyproject.toml): a missing one fails here
from secagg.dpf import Accumulator, Forest

#: the evaluation paths: numpy; compiled loops around cryptography's AES; AES inside the loops (where the CPU has AES-NI)
MODES = {"numpy": (False, False), "fused": (True, False)} | ({"aesni": (True, True)} if aesni.available() else {})
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    sizes = draw(st.lists(st.integers(0, 70), min_size=1, max_size=7).filter(lambda s: sum(s) > 0))
    forest = Forest.of(np.array(sizes, np.int64))
    return {
        "forest": forest,
        "width": draw(st.integers(1, 5)),
        "keys": draw(st.integers(1, 11)),
        "batch": draw(st.integers(1, 8)),
        "chunk": draw(st.integers(1, 90)),
        "group": draw(st.sampled_from([1, 5, 40, 1 << 16])),  # leaves per group of trees (cuts trees apart when small)
        "check": draw(st.booleans()),
        "removed": draw(st.integers(0, 11)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@PROPS
@given(cases())
def test_the_fused_evaluation_equals_the_numpy_path_and_the_reference(case):
    forest, width = case["forest"], case["width"]
    rng = np.random.default_rng(case["seed"])  # CSPRNG-OK: test points and values only
    pairs, points, live = [], [], forest.sizes > 0
    for _ in range(case["keys"]):
        alphas = np.array([rng.integers(0, max(1, s)) for s in forest.sizes])
        vals = rng.integers(0, 2**64, (forest.points, width), dtype=np.uint64)
        pairs.append(dpf.gen(alphas, forest.depth, vals, check=case["check"])[:2])
        point = np.zeros((forest.leaves, width), np.uint64)
        point[forest.offsets[:-1][live] + alphas[live]] = vals[live]
        points.append(point)
    challenge = bytes(rng.integers(0, 256, 16, dtype=np.uint8)) if case["check"] else None
    removed = pairs[:case["removed"]]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dpf, "_GROUP_LEAVES", case["group"])
        accs = {mode: [Accumulator(forest, width, b, challenge=challenge, chunk=case["chunk"], batch=case["batch"],
                                   fused=fused, aesni=ni) for b in (0, 1)] for mode, (fused, ni) in MODES.items()}
        digests = {mode: [accs[mode][b].add_many([p[b] for p in pairs]) for b in (0, 1)] for mode in accs}
        for mode in accs:
            for b in (0, 1):
                accs[mode][b].add_many([p[b] for p in removed], sign=-1)
    assert all(acc.fused and not acc.aesni for acc in accs["fused"]) and not any(acc.fused for acc in accs["numpy"])
    assert all(acc.aesni for acc in accs.get("aesni", []))
    reference = [sum((dpf.eval_full(p[b], forest) for p in pairs[len(removed):]), np.zeros_like(points[0])) for b in (0, 1)]
    want = sum(points[len(removed):], np.zeros_like(points[0]))  # the point functions of the keys left in
    for mode in accs:
        assert digests[mode] == digests["numpy"], mode
        assert digests[mode][0] == digests[mode][1]  # honest keys pass the check
        for b in (0, 1):
            assert np.array_equal(accs[mode][b].total(), reference[b]), mode
            assert accs[mode][b].count == len(pairs) - len(removed)
        assert np.array_equal(accs[mode][0].total() + accs[mode][1].total(), want)


@PROPS
@given(cases())
def test_the_fused_tree_expansion_gives_sigma_of_the_numpy_paths_leaf_seeds_and_the_same_bits(case):
    forest = case["forest"]
    rng = np.random.default_rng(case["seed"])  # CSPRNG-OK: test points only
    keys = [dpf.gen(np.array([rng.integers(0, max(1, s)) for s in forest.sizes]), forest.depth)[case["seed"] % 2]
            for _ in range(min(case["keys"], 8))]
    for j0, j1, sub in forest.groups(case["group"]):
        seeds, t = dpf._expand_many(keys, j0, j1, sub)
        sig, bits = dpf_fused._expand(keys, j0, j1, sub)
        assert np.array_equal(bits, t)
        assert np.array_equal(sig[..., 0], seeds[..., 0] ^ seeds[..., 1])
        assert np.array_equal(sig[..., 1], seeds[..., 0])


def test_the_fused_path_is_the_default_where_numba_imports_and_a_tampered_key_still_fails_the_check():
    forest = Forest.of(np.array([9, 0, 30, 17]))
    betas = np.arange(12, dtype=np.uint64).reshape(4, 3)
    k0, k1, _ = dpf.gen(np.array([3, 0, 29, 16]), forest.depth, betas)
    bad = np.array(k1.seed_cw)
    bad[2, 1, 1] ^= np.uint64(1 << 40)
    forged = dpf.KeySet(k1.party, k1.depth, k1.roots, bad, k1.t_cw, k1.check_cw, k1.value_cw)
    accs = [Accumulator(forest, 3, b, challenge=b"f" * 16) for b in (0, 1)]
    assert all(acc.fused for acc in accs)
    assert accs[0].add(k0) == accs[1].add(k1)
    assert accs[0].add(k0) != accs[1].add(forged)

