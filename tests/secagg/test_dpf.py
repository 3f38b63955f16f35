"""The DPF primitive (secagg/dpf.py): evaluations add up to the point functions, one key alone says
nothing about the point, the check accepts exactly the valid key pairs, the key encoding is strict."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency, ks_2samp

from secagg import dpf
from secagg.dpf import Accumulator, DpfError, Forest, KeySet

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _point_functions(forest: Forest, alphas: np.ndarray, betas: np.ndarray) -> np.ndarray:
    out = np.zeros((forest.leaves, betas.shape[1]), np.uint64)
    out[forest.offsets[:-1] + alphas] = betas
    return out


@st.composite
def forests(draw):
    sizes = np.array(draw(st.lists(st.integers(1, 40), min_size=1, max_size=6)), np.int64)
    forest = Forest.of(sizes)
    alphas = np.array([draw(st.integers(0, int(s) - 1)) for s in sizes], np.int64)
    width = draw(st.integers(1, 5))
    betas = np.array(draw(st.lists(st.lists(st.integers(0, 2**64 - 1), min_size=width, max_size=width),
                                   min_size=len(sizes), max_size=len(sizes))), dtype=np.uint64)
    return forest, alphas, betas


@PROPS
@given(forests())
def test_the_two_full_domain_evaluations_add_up_to_the_point_functions_exactly(case):
    forest, alphas, betas = case
    k0, k1, _ = dpf.gen(alphas, forest.depth, betas)
    total = dpf.eval_full(k0, forest) + dpf.eval_full(k1, forest)
    assert np.array_equal(total, _point_functions(forest, alphas, betas))


@PROPS
@given(forests())
def test_control_bits_xor_to_the_indicator_and_single_point_evaluation_matches_the_full_domain(case):
    forest, alphas, betas = case
    k0, k1, _ = dpf.gen(alphas, forest.depth, betas)
    _, t0 = dpf.expand_forest(k0, forest)
    _, t1 = dpf.expand_forest(k1, forest)
    assert np.array_equal(np.flatnonzero(t0 ^ t1), forest.offsets[:-1] + alphas)
    y0, p0 = dpf.eval_points(k0, forest.owner, forest.position)
    assert np.array_equal(y0, dpf.eval_full(k0, forest)) and np.array_equal(p0, t0)
    # positions beyond a tree's size (inside 2^depth) still evaluate consistently: zero off the point
    y0, _ = dpf.eval_points(k0, np.zeros(1, np.int64), np.array([2**forest.depth - 1]))
    y1, _ = dpf.eval_points(k1, np.zeros(1, np.int64), np.array([2**forest.depth - 1]))
    want = betas[0] if alphas[0] == 2**forest.depth - 1 else np.zeros_like(betas[0])
    assert np.array_equal((y0 + y1)[0], want)


@PROPS
@given(forests(), st.integers(1, 9), st.integers(1, 3))
def test_the_accumulator_sums_many_keys_exactly_and_removing_one_restores_the_rest(case, n_keys, chunk):
    forest, _, betas = case
    rng = np.random.default_rng(n_keys)
    accs = [Accumulator(forest, betas.shape[1], b, challenge=b"c" * 16, chunk=chunk * 7, batch=3) for b in (0, 1)]
    want = np.zeros((forest.leaves, betas.shape[1]), np.uint64)
    pairs = []
    for _ in range(n_keys):
        alphas = np.array([rng.integers(0, s) for s in forest.sizes])
        vals = rng.integers(0, 2**64, betas.shape, dtype=np.uint64)
        pair = dpf.gen(alphas, forest.depth, vals)[:2]
        pairs.append(pair)
        want += _point_functions(forest, alphas, vals)
        digests = [accs[b].add(pair[b]) for b in (0, 1)]
        assert digests[0] == digests[1]
    assert np.array_equal(accs[0].total() + accs[1].total(), want)
    first = pairs[0]
    for b in (0, 1):
        accs[b].add(first[b], sign=-1)
    rest = want - (dpf.eval_full(first[0], forest) + dpf.eval_full(first[1], forest))
    assert np.array_equal(accs[0].total() + accs[1].total(), rest)


def test_values_attached_later_give_the_same_function_as_values_given_at_once():
    forest = Forest.of(np.array([9, 16, 3]))
    alphas = np.array([8, 0, 2])
    betas = np.arange(12, dtype=np.uint64).reshape(3, 4) + np.uint64(2**63)
    k0, k1, secret = dpf.gen(alphas, forest.depth)
    assert k0.value_cw is None and k0.to_bytes() != b""
    v0, v1 = dpf.attach_values(k0, k1, secret, betas)
    assert np.array_equal(v0.roots, k0.roots) and np.array_equal(v0.seed_cw, k0.seed_cw)
    total = dpf.eval_full(v0, forest) + dpf.eval_full(v1, forest)
    assert np.array_equal(total, _point_functions(forest, alphas, betas))


def test_known_answer_with_fixed_root_seeds():
    """The core with explicit roots is deterministic: a golden digest of both keys (our own vector)."""
    roots = np.arange(2 * 3 * 2, dtype=np.uint64).reshape(2, 3, 2) * np.uint64(0x9E3779B97F4A7C16)
    roots[..., 0] &= np.uint64(0xFFFFFFFFFFFFFFFE)
    betas = np.array([[1, 2], [3, 4], [2**64 - 1, 0]], dtype=np.uint64)
    k0, k1, _ = dpf._gen(np.array([5, 0, 7]), 3, betas, roots, check=True)
    digest = hashlib.sha256(k0.to_bytes() + k1.to_bytes()).hexdigest()
    assert digest == GOLDEN_KEYS
    forest = Forest.of(np.array([8, 8, 8]))
    assert np.array_equal(dpf.eval_full(k0, forest) + dpf.eval_full(k1, forest),
                          _point_functions(forest, np.array([5, 0, 7]), betas))


GOLDEN_KEYS = "b89cb23dd27802b27fe85ef6fc61b52d63936ec85f94b249c8d6c0fd6daf9b7f"


# -- one key alone ------------------------------------------------------------------------------------

def _keys_bytes(alpha: int, count: int, depth: int = 10, trees: int = 4) -> tuple[np.ndarray, list[int]]:
    out, sizes = [], []
    betas = np.full((trees, 2), 7, np.uint64)
    for _ in range(count):
        k0, _, _ = dpf.gen(np.full(trees, alpha), depth, betas)
        blob = k0.to_bytes()
        sizes.append(len(blob))
        out.append(np.frombuffer(blob[20:], np.uint8))
    return np.stack(out), sizes


def test_one_key_alone_looks_the_same_for_any_point():
    """Server A's key for point 3 and for point 1000 (same values): byte histograms, the control-bit
    corrections per level, and the 64-bit words are statistically indistinguishable, and the key
    size does not depend on the point."""
    a, sizes_a = _keys_bytes(3, 300)
    b, sizes_b = _keys_bytes(1000, 300)
    assert set(sizes_a) == set(sizes_b) == {KeySet.size(depth=10, points=4, width=2)}
    hist = np.stack([np.bincount(a.ravel(), minlength=256), np.bincount(b.ravel(), minlength=256)])
    assert chi2_contingency(hist)[1] > 1e-6
    words_a = a[:, : 8 * (a.shape[1] // 8)].copy().view("<u8").ravel() / 2.0**64
    words_b = b[:, : 8 * (b.shape[1] // 8)].copy().view("<u8").ravel() / 2.0**64
    assert ks_2samp(words_a, words_b).pvalue > 1e-6
    # the packed control-bit corrections: each bit is 1 half of the time whatever the point
    bits_at = 16 * 4 * (1 + 10)  # the packed bits follow the roots and the seed corrections
    for keys in (a, b):
        bits = np.unpackbits(keys[:, bits_at:bits_at + 10], axis=1, bitorder="little")
        assert np.all(np.abs(bits.mean(axis=0) - 0.5) < 0.15)


def test_the_indistinguishability_test_has_power_both_keys_together_reveal_the_point():
    """The same statistics on what both servers together hold (the XOR of their leaf control bits)
    separate the two points at once: the test above can fail."""
    forest = Forest.of(np.array([1024]))
    rows = []
    for alpha in (3, 1000):
        k0, k1, _ = dpf.gen(np.array([alpha]), 10, np.ones((1, 1), np.uint64))
        rows.append(np.flatnonzero(dpf.expand_forest(k0, forest)[1] ^ dpf.expand_forest(k1, forest)[1]))
    assert rows[0].tolist() == [3] and rows[1].tolist() == [1000]


# -- the check ----------------------------------------------------------------------------------------

def _digests(k0: KeySet, k1: KeySet, forest: Forest, challenge: bytes = b"k" * 16) -> tuple[bytes, bytes]:
    return tuple(Accumulator(forest, k0.width, b, challenge=challenge).add(k) for b, k in ((0, k0), (1, k1)))


def _nonzero_leaves(k0: KeySet, k1: KeySet, forest: Forest) -> int:
    return int((dpf.eval_full(k0, forest) + dpf.eval_full(k1, forest)).any(axis=1).sum())


TAMPERS = {
    "seed correction at the top": lambda k: dict(seed_cw=_flip(k.seed_cw, (1, 0, 1))),
    "seed correction at the leaves": lambda k: dict(seed_cw=_flip(k.seed_cw, (0, -1, 1))),
    "left control bit": lambda k: dict(t_cw=_flip_bit(k.t_cw, (2, 1, 0))),
    "right control bit at the leaves": lambda k: dict(t_cw=_flip_bit(k.t_cw, (0, -1, 1))),
}


def _flip(a: np.ndarray, at: tuple) -> np.ndarray:
    out = a.copy()
    out[at] ^= np.uint64(0x10)
    return out


def _flip_bit(a: np.ndarray, at: tuple) -> np.ndarray:
    out = a.copy()
    out[at] ^= 1
    return out


@pytest.mark.parametrize("how", sorted(TAMPERS))
def test_a_key_pair_that_is_not_a_set_of_point_functions_fails_the_check(how):
    forest = Forest.of(np.array([30, 64, 17]))
    k0, k1, _ = dpf.gen(np.array([4, 40, 9]), forest.depth, np.ones((3, 2), np.uint64))
    change = TAMPERS[how](k0)
    b0, b1 = dataclasses.replace(k0, **change), dataclasses.replace(k1, **change)
    assert _nonzero_leaves(b0, b1, forest) > 3  # the tampered pair adds to more positions...
    d0, d1 = _digests(b0, b1, forest)
    assert d0 != d1  # ...and the servers see it
    h0, h1 = _digests(k0, k1, forest)
    assert h0 == h1 and _nonzero_leaves(k0, k1, forest) == 3


def test_different_correction_words_for_the_two_servers_fail_the_check():
    forest = Forest.of(np.array([30, 64]))
    k0, k1, _ = dpf.gen(np.array([4, 40]), forest.depth, np.ones((2, 2), np.uint64))
    other = dataclasses.replace(k1, value_cw=k1.value_cw + np.uint64(1))
    assert _nonzero_leaves(k0, other, forest) > 2
    d0, d1 = _digests(k0, other, forest)
    assert d0[:16] == d1[:16] and d0[16:] != d1[16:]  # the trees are fine, the public parts differ


def test_a_forged_check_word_does_not_help_a_two_point_key():
    """Two points in one tree (the key of one tree pasted over another's seed corrections below the
    root) cannot be made to pass by recomputing the check word as an honest client would."""
    forest = Forest.of(np.array([64]))
    k0, k1, secret = dpf.gen(np.array([5]), 6, np.ones((1, 1), np.uint64))
    cw = k0.seed_cw.copy()
    cw[0, 3] ^= np.uint64(0xABCDEF00)  # the paths diverge below level 3: many leaves differ
    b0, b1 = dataclasses.replace(k0, seed_cw=cw), dataclasses.replace(k1, seed_cw=cw)
    s0, _ = dpf.expand_forest(b0, forest)
    s1, _ = dpf.expand_forest(b1, forest)
    differing = np.flatnonzero((s0 != s1).any(axis=1))
    assert differing.size > 1
    for x in differing:  # each choice of the check word that fixes one leaf
        tw = dpf._tweaks(np.zeros(1, np.int64), np.array([x]))
        forged = dpf._check_hash(s0[x:x + 1], tw) ^ dpf._check_hash(s1[x:x + 1], tw)
        f0 = dataclasses.replace(b0, check_cw=forged)
        f1 = dataclasses.replace(b1, check_cw=forged)
        d0, d1 = _digests(f0, f1, forest)
        assert d0 != d1


def test_the_digest_depends_on_the_challenge_and_an_honest_pair_agrees_under_every_challenge():
    forest = Forest.of(np.array([10, 10]))
    k0, k1, _ = dpf.gen(np.array([1, 9]), forest.depth, np.ones((2, 1), np.uint64))
    a = _digests(k0, k1, forest, b"a" * 16)
    b = _digests(k0, k1, forest, b"b" * 16)
    assert a[0] == a[1] and b[0] == b[1] and a[0] != b[0]


def test_the_accumulator_refuses_keys_of_another_shape():
    forest = Forest.of(np.array([10, 10]))
    k0, k1, _ = dpf.gen(np.array([1, 9]), forest.depth, np.ones((2, 3), np.uint64))
    with pytest.raises(DpfError, match="party"):
        Accumulator(forest, 3, 0).add(k1)
    with pytest.raises(DpfError, match="width"):
        Accumulator(forest, 2, 0).add(k0)
    with pytest.raises(DpfError, match="do not match the forest"):
        Accumulator(Forest.of(np.array([10, 10, 10])), 3, 0).add(k0)
    unverifiable = dpf.gen(np.array([1, 9]), forest.depth, np.ones((2, 3), np.uint64), check=False)[0]
    with pytest.raises(DpfError, match="not verifiable"):
        Accumulator(forest, 3, 0, challenge=b"x" * 16).add(unverifiable)


@pytest.mark.parametrize("mode", [{"fused": False}, {"fused": True, "aesni": False}, {}])
def test_a_hand_built_key_set_with_a_short_or_mistyped_array_is_refused_before_evaluation(mode):
    """The compiled loops read each key's arrays in place without bounds checks: a key set whose arrays
    do not have the shapes its depth and trees imply (possible only when built by hand: parsing checks
    them) is refused, on every path, and the sum is left untouched."""
    forest = Forest.of(np.array([10, 10]))
    k0 = dpf.gen(np.array([1, 9]), forest.depth, np.ones((2, 3), np.uint64))[0]
    bad = {"seed_cw": k0.seed_cw[:, :-1], "t_cw": k0.t_cw.astype(np.uint64), "check_cw": k0.check_cw[:, :2],
           "value_cw": k0.value_cw[:1]}
    for field, arr in bad.items():
        acc = Accumulator(forest, 3, 0, challenge=b"x" * 16, **mode)
        with pytest.raises(DpfError, match=field):
            acc.add_many([k0, dataclasses.replace(k0, **{field: arr})])
        assert not acc._acc.any() and acc.count == 0
    acc = Accumulator(forest, 3, 0, challenge=b"x" * 16, **mode)
    acc.add(dataclasses.replace(k0, roots=k0.roots.astype(np.int64).astype(np.uint64)))  # same shape and type: taken


def test_key_generation_refuses_bad_points_and_values():
    with pytest.raises(ValueError, match="alphas must lie"):
        dpf.gen(np.array([8]), 3)
    with pytest.raises(ValueError, match="depth"):
        dpf.gen(np.array([0]), 0)
    with pytest.raises(ValueError, match="betas"):
        dpf.gen(np.array([0, 1]), 3, np.ones((2, 2), np.int64))


def test_a_forest_with_empty_trees_skips_them():
    forest = Forest.of(np.array([3, 0, 5, 0]))
    alphas = np.array([2, 0, 4, 0])
    betas = np.arange(8, dtype=np.uint64).reshape(4, 2) + np.uint64(1)
    k0, k1, _ = dpf.gen(alphas, forest.depth, betas)
    assert forest.leaves == 8
    total = dpf.eval_full(k0, forest) + dpf.eval_full(k1, forest)
    want = np.zeros((8, 2), np.uint64)
    want[[2, 3 + 4]] = betas[[0, 2]]
    assert np.array_equal(total, want)
    accs = [Accumulator(forest, 2, b, challenge=b"e" * 16) for b in (0, 1)]
    assert accs[0].add(k0) == accs[1].add(k1)
    assert np.array_equal(accs[0].total() + accs[1].total(), want)


def test_scattering_out_of_bucket_space_equals_mapping_the_total():
    forest = Forest.of(np.array([6, 5, 7]))
    k0, _, _ = dpf.gen(np.array([1, 2, 3]), forest.depth, np.arange(9, dtype=np.uint64).reshape(3, 3))
    acc = Accumulator(forest, 3, 0)
    acc.add(k0)
    rng = np.random.default_rng(2)
    elements = np.concatenate([rng.permutation(10)[:s] for s in forest.sizes])  # distinct within a tree
    want = np.zeros((10, 3), np.uint64)
    np.add.at(want, elements, acc.total())
    assert np.array_equal(acc.scatter(elements, 10), want)
    with pytest.raises(ValueError, match="row indices"):
        acc.scatter(elements, 5)


def test_evaluation_in_many_groups_of_trees_equals_one_group(monkeypatch):
    """Trees are expanded a group at a time; with tiny groups (and empty trees between them) the
    leaves, the sums and the digests are those of one group."""
    forest = Forest.of(np.array([7, 0, 12, 3, 9, 0, 16, 1]))
    rng = np.random.default_rng(5)
    alphas = np.array([rng.integers(0, max(int(s), 1)) for s in forest.sizes])
    betas = rng.integers(0, 2**64, (8, 3), dtype=np.uint64)
    k0, k1, _ = dpf.gen(alphas, forest.depth, betas)
    whole = dpf.expand_forest(k0, forest)
    sums = [Accumulator(forest, 3, b, challenge=b"g" * 16) for b in (0, 1)]
    digests = [sums[b].add(k) for b, k in ((0, k0), (1, k1))]
    monkeypatch.setattr(dpf, "_GROUP_LEAVES", 5)
    small = Forest(forest.sizes, forest.depth)
    assert len(small.groups()) > 3
    parts = dpf.expand_forest(k0, small)
    assert np.array_equal(parts[0], whole[0]) and np.array_equal(parts[1], whole[1])
    split = [Accumulator(small, 3, b, challenge=b"g" * 16) for b in (0, 1)]
    assert [split[b].add(k) for b, k in ((0, k0), (1, k1))] == digests
    assert np.array_equal(split[0].total() + split[1].total(), sums[0].total() + sums[1].total())
    assert np.array_equal(split[0].total() + split[1].total(), dpf.eval_full(k0, forest) + dpf.eval_full(k1, forest))


@PROPS
@given(forests(), st.integers(1, 12), st.integers(1, 8), st.integers(1, 60), st.booleans())
def test_evaluating_many_keys_together_equals_one_at_a_time_and_the_reference(case, n_keys, batch, chunk, check):
    """``add_many`` (``batch`` keys per pass, chunks across keys and trees, the keys' corrections through
    one subset-sum table) gives the sums and digests of one key at a time, and the reference evaluation."""
    forest, _, betas = case
    rng = np.random.default_rng(n_keys * 100 + batch)
    pairs, want = [], np.zeros((forest.leaves, betas.shape[1]), np.uint64)
    for _ in range(n_keys):
        alphas = np.array([rng.integers(0, s) for s in forest.sizes])
        vals = rng.integers(0, 2**64, betas.shape, dtype=np.uint64)
        pairs.append(dpf.gen(alphas, forest.depth, vals, check=check)[:2])
        want += _point_functions(forest, alphas, vals)
    challenge = b"m" * 16 if check else None
    together = [Accumulator(forest, betas.shape[1], b, challenge=challenge, chunk=chunk, batch=batch) for b in (0, 1)]
    alone = [Accumulator(forest, betas.shape[1], b, challenge=challenge, batch=1) for b in (0, 1)]
    got = [together[b].add_many([p[b] for p in pairs]) for b in (0, 1)]
    assert got == [[alone[b].add(p[b]) for p in pairs] for b in (0, 1)]
    assert got[0] == got[1]
    assert np.array_equal(together[0].total() + together[1].total(), want)
    for b in (0, 1):
        assert np.array_equal(together[b].total(), alone[b].total())
        assert np.array_equal(together[b].total(), sum(dpf.eval_full(p[b], forest) for p in pairs))
    # removing some of them together leaves the sum of the others
    for b in (0, 1):
        together[b].add_many([p[b] for p in pairs[1:]], sign=-1)
    assert np.array_equal(together[0].total() + together[1].total(),
                          dpf.eval_full(pairs[0][0], forest) + dpf.eval_full(pairs[0][1], forest))
    with pytest.raises(ValueError, match="batch"):
        Accumulator(forest, betas.shape[1], 0, batch=9)


def test_warming_a_forest_changes_nothing_but_when_its_indices_are_built():
    forest = Forest.of(np.array([7, 0, 12, 3, 9]))
    alphas = np.array([3, 0, 11, 2, 8])
    betas = np.arange(10, dtype=np.uint64).reshape(5, 2)
    k0, k1, _ = dpf.gen(alphas, forest.depth, betas)
    warm = Forest(forest.sizes, forest.depth)
    warm.warm(3)
    assert any(key.startswith("groups/") for key in warm._cache)
    sums = [[Accumulator(f, 2, b, challenge=b"w" * 16, batch=3) for b in (0, 1)] for f in (forest, warm)]
    digests = [[sums[i][b].add(k) for b, k in ((0, k0), (1, k1))] for i in (0, 1)]
    assert digests[0] == digests[1] and digests[0][0] == digests[0][1]
    assert np.array_equal(sums[1][0].total() + sums[1][1].total(),
                          dpf.eval_full(k0, forest) + dpf.eval_full(k1, forest))


def test_the_macs_first_blocks_are_computed_per_round_when_the_accumulator_is_made():
    """They depend on the challenge only: made with the round's sum, not inside the first key's evaluation
    (which made the first server evaluated in a process look slower than the second)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    forest = Forest.of(np.array([5, 0, 9]))
    acc = Accumulator(forest, 2, 0, challenge=b"r" * 16)
    assert acc._mac_pos is not None
    enc = Cipher(algorithms.AES(b"r" * 16), modes.ECB()).encryptor()
    blocks = np.stack([forest.position, forest.owner], axis=1).astype("<u8").tobytes()
    assert acc._mac_pos.astype("<u8").tobytes() == enc.update(blocks)
    assert Accumulator(forest, 2, 0)._mac_pos is None  # no check, nothing to compute


@settings(max_examples=25, deadline=None)
@given(points=st.integers(1, 9), depth=st.integers(1, 4), width=st.integers(1, 5), check=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_a_parsed_key_set_hashes_its_messages_bytes_to_the_digest_of_its_arrays(points, depth, width, check, seed):
    """A key set parsed from bytes keeps its public bytes (one view of the message after the roots) and
    hashes them: the digest equals the one hashed part by part from the arrays (both parties' keys, every
    shape, with and without the check words), and a copy with a changed array (``dataclasses.replace``) does
    not inherit the message's bytes, so it hashes its own arrays."""
    rng = np.random.default_rng(seed)
    alphas = rng.integers(0, 2**depth, points)
    betas = rng.integers(0, 2**63, (points, width), dtype=np.uint64)
    for key in dpf.gen(alphas, depth, betas, check=check)[:2]:
        parsed = KeySet.from_bytes(key.to_bytes())
        assert parsed._encoded is not None and key._encoded is None
        assert parsed.public_digest() == key.public_digest()
        assert bytes(parsed._encoded) == key.public_bytes()[10:]  # after depth, flags, width, points
        changed = dataclasses.replace(parsed, value_cw=parsed.value_cw ^ np.uint64(1))
        assert changed._encoded is None and changed.public_digest() != parsed.public_digest()
