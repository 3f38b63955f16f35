"""Batched key generation and the copy-free key paths of the DPF sum (secagg/dpf_keys.py ``gen_many``,
secagg/dpf_run.py ``upload_many``, ``DpfUpload.wire``, in-place parsing).

A simulation generates many clients' key sets in one pass; each must be exactly the key set that client's
own generation makes from the same root seeds, or the batch would change what a device sends."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import aesni, dpf_keys
from secagg.cuckoo import CuckooLayout
from secagg.dpf import KeySet, eval_full, Forest, gen_many
from secagg.dpf_run import DpfSpec, Draws, run_dpf_rows, upload_many
from secagg.dpf_sum import DpfSumClient, DpfSumConfig, DpfUpload
from secagg.messages import decode

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    depth = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    return {
        "depth": depth,
        "sizes": sizes,
        "width": draw(st.integers(1, 5)),
        "check": draw(st.booleans()),
        "chunk": draw(st.sampled_from([1, 7, 33, 4096])),  # trees per pass: key sets alone, several, all
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@PROPS
@given(batches())
def test_a_batch_of_key_sets_is_byte_for_byte_what_each_key_set_alone_gives_from_the_same_roots(case):
    rng = np.random.default_rng(case["seed"])  # CSPRNG-OK: test points, values and known-answer roots only
    depth, sizes, width = case["depth"], case["sizes"], case["width"]
    alphas = [rng.integers(0, 2**depth, m) for m in sizes]
    betas = [rng.integers(0, 2**64, (m, width), dtype=np.uint64) for m in sizes]
    roots = rng.integers(0, 2**64, (2, sum(sizes), 2), dtype=np.uint64)
    roots[..., 0] &= dpf_keys._CLEAR
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dpf_keys, "_GEN_CHUNK", case["chunk"])
        many = dpf_keys._gen_many(alphas, depth, betas, roots, check=case["check"])
    assert len(many) == len(sizes)
    at = 0
    for (k0, k1), a, b, m in zip(many, alphas, betas, sizes):
        alone = dpf_keys._gen(a, depth, b, roots[:, at:at + m].copy(), check=case["check"])
        at += m
        assert k0.to_bytes() == alone[0].to_bytes() and k1.to_bytes() == alone[1].to_bytes()


def test_gen_many_draws_fresh_roots_and_its_keys_are_the_point_functions():
    forest = Forest.of(np.array([5, 3, 8]))
    alphas = [np.array([4, 0, 7]), np.array([1, 2, 0])]
    betas = [np.array([[1, 2], [3, 4], [5, 6]], np.uint64), np.array([[7, 8], [9, 10], [11, 12]], np.uint64)]
    first, second = gen_many(alphas, forest.depth, betas), gen_many(alphas, forest.depth, betas)
    assert not np.array_equal(first[0][0].roots, second[0][0].roots)  # OS CSPRNG roots, fresh per call
    for (k0, k1), a, b in zip(first, alphas, betas):
        total = eval_full(k0, forest) + eval_full(k1, forest)
        expect = np.zeros((forest.leaves, 2), np.uint64)
        expect[forest.offsets[:-1] + a] = b
        assert np.array_equal(total, expect)
    with pytest.raises(ValueError, match="alphas"):
        gen_many([np.array([9])], 3, [np.ones((1, 2), np.uint64)])  # 9 >= 2^3
    with pytest.raises(ValueError, match="betas"):
        gen_many([np.array([1, 2])], 3, [np.ones((2, 2), np.int64)])


def _cfg(n: int, *, points: int = 4, max_parts: int = 2, dense_above: int = 0) -> DpfSumConfig:
    layout = CuckooLayout.for_points(60, points, seed=bytes(32))
    return DpfSumConfig(n, layout, 3, points, bytes(16), 0, True, max_parts=max_parts, dense_above=dense_above)


def test_upload_many_refuses_exactly_whom_each_clients_own_call_refuses_in_the_same_words():
    cfg = _cfg(5, dense_above=1)
    ok = (np.array([1, 5, 9]), np.ones((3, 3), np.uint64))
    updates = [
        ok,
        (np.array([1, 1]), np.ones((2, 3), np.uint64)),  # repeated rows
        (np.arange(9), np.ones((9, 3), np.uint64)),  # above max_parts x points
        (np.array([70]), np.ones((1, 3), np.uint64)),  # out of range
        (np.arange(6), np.ones((6, 3), np.uint64)),  # two key sets: above dense_above, so a dense share
    ]
    made = list(upload_many(cfg, range(5), updates, floor=2))
    for i, ((sent, seconds), (rows, values)) in enumerate(zip(made, updates)):
        try:
            own = DpfSumClient(cfg, i).upload_parts(rows, values)
        except ValueError as exc:
            assert isinstance(sent, ValueError) and str(sent) == str(exc)
            continue
        assert not isinstance(sent, Exception) and seconds > 0
        assert [type(decode(b[0])) for b in sent] == [type(decode(b[0])) for b in own]
        assert [len(b[0]) for b in sent] == [len(b[0]) for b in own]  # same sizes: key sets or a dense share
    assert [isinstance(s, Exception) for s, _ in made] == [False, True, True, True, False]


@PROPS
@given(st.integers(2, 30), st.integers(0, 2**32 - 1), st.sampled_from([1, 3000, 2 << 20]))
def test_batched_uploads_sum_to_the_plaintext_sum_whatever_the_batch_size(n, seed, batch_bytes):
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test inputs only
    rows, width, points = 50, 2, 3
    updates = []
    for _ in range(n):
        k = int(rng.integers(0, 7))  # up to two key sets
        updates.append((np.sort(rng.choice(rows, k, replace=False)), rng.integers(0, 2**64, (k, width), dtype=np.uint64)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("secagg.dpf_run._BATCH_BYTES", batch_bytes)
        res = run_dpf_rows(updates, DpfSpec(rows, width, points, max_parts=3))
    expect = np.zeros((rows, width), np.uint64)
    for r, v in updates:
        expect[r] += v
    assert not res.refused and res.survivors == frozenset(range(n))
    assert np.array_equal(res.total.reshape(rows, width), expect)
    assert (res.client_s > 0).all()


def test_the_one_copy_wire_form_is_the_messages_own_encoding_and_the_server_parses_it_in_place():
    cfg = _cfg(2)
    k0, k1, _ = dpf_keys.gen(np.array([1] * cfg.layout.buckets) % np.maximum(cfg.layout.sizes, 1), cfg.layout.depth,
                             np.ones((cfg.layout.buckets, 3), np.uint64))
    for k, to in ((k0, 0), (k1, 1)):
        wire = DpfUpload.wire(cfg.instance, 0, 1, to, floor=3, key=k, part=0, parts=1)
        assert wire == DpfUpload(cfg.instance, 0, 1, to, floor=3, key=k.to_bytes(), part=0, parts=1).to_bytes()
        parsed = KeySet.from_bytes(decode(wire).key)
        assert parsed.to_bytes() == k.to_bytes()
        blob = np.frombuffer(wire, np.uint8)
        assert np.shares_memory(parsed.value_cw, blob) and not parsed.value_cw.flags.writeable  # a view, read-only
        mutable = bytearray(wire)  # a writable buffer is copied: changing it later cannot change the key
        copy = KeySet.from_bytes(decode(bytes(mutable)).key)
        from_mutable = KeySet.from_bytes(memoryview(mutable)[len(wire) - len(k.to_bytes()):])
        mutable[-1] ^= 0xFF
        assert from_mutable.to_bytes() == copy.to_bytes() == k.to_bytes()


#: key generation's paths: numpy; compiled loops around cryptography's AES; AES inside the loops (AES-NI, where the CPU has it)
GEN_MODES = ["numpy", "fused"] + (["aesni"] if aesni.available() else [])


def _gen_mode(mp: pytest.MonkeyPatch, mode: str) -> None:
    mp.setattr(dpf_keys, "_FUSED", mode != "numpy")
    if mode == "fused":
        mp.setattr(dpf_keys, "_gen_ni", lambda: None)


@pytest.mark.parametrize("mode", GEN_MODES)
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("width", [1, 4, 5])
def test_the_clients_priced_key_generation_bytes_are_the_aes_bytes_gen_computes(mode, check, width, monkeypatch):
    from secagg.dpf import keygen_prg_bytes

    counted = [0]
    real = dpf_keys._encryptor

    class Counting:  # every AES call through cryptography goes through an encryptor's update_into
        def __init__(self, enc):  # noqa: ANN001
            self.enc = enc

        def update_into(self, src, dst):  # noqa: ANN001, ANN202
            counted[0] += memoryview(src).nbytes
            return self.enc.update_into(src, dst)

    class CountingNi:  # and every one on AES-NI through dpf_gen_ni's two entry points
        def __init__(self, ni):  # noqa: ANN001
            self.ni = ni

        def ecb_into(self, rk, inp, out):  # noqa: ANN001, ANN202
            counted[0] += inp.nbytes
            return self.ni.ecb_into(rk, inp, out)

        def value_cw(self, sig, rkv, t1, betas, out):  # noqa: ANN001, ANN202 - one MMO block per party, tree and value key
            counted[0] += sig.nbytes * rkv.shape[0]
            return self.ni.value_cw(sig, rkv, t1, betas, out)

    monkeypatch.setattr(dpf_keys, "_encryptor", lambda name: Counting(real(name)))
    _gen_mode(monkeypatch, mode)
    if mode == "aesni":
        ni = dpf_keys._gen_ni()
        assert ni is not None
        monkeypatch.setattr(dpf_keys, "_gen_ni", lambda: CountingNi(ni))
    depth, m = 5, 7
    dpf_keys.gen(np.arange(m) * 3 % 32, depth, np.ones((m, width), np.uint64), check=check)
    assert counted[0] == keygen_prg_bytes(depth=depth, points=m, width=width, check=check)


@PROPS
@given(batches())
def test_the_compiled_key_generation_is_the_numpy_one_word_for_word(case):
    """secagg/dpf_gen_fused.py (numba) against the numpy levels and values, from the same roots."""
    from secagg import dpf_gen_fused  # noqa: F401 - numba is a dependency: a missing one fails here

    rng = np.random.default_rng(case["seed"])  # CSPRNG-OK: test points, values and known-answer roots only
    depth, m, width = case["depth"], sum(case["sizes"]), case["width"]
    alphas = rng.integers(0, 2**depth, m)
    betas = rng.integers(0, 2**64, (m, width), dtype=np.uint64)
    roots = rng.integers(0, 2**64, (2, m, 2), dtype=np.uint64)
    roots[..., 0] &= dpf_keys._CLEAR
    out = {}
    for mode in GEN_MODES:
        with pytest.MonkeyPatch.context() as mp:
            _gen_mode(mp, mode)
            k0, k1, secret = dpf_keys._gen(alphas, depth, betas, roots.copy(), check=case["check"])
        out[mode] = (k0.to_bytes(), k1.to_bytes(), secret.seeds.tobytes(), secret.t1.tobytes())
    assert all(out[mode] == out["numpy"] for mode in GEN_MODES)


def test_a_batchs_decoy_words_are_one_fresh_keystream_handed_out_once_each():
    """``Draws`` slices one CSPRNG draw (``random_words``) client by client: consecutive requests are
    disjoint, consecutive slices of the draw, a request beyond what is left starts a fresh draw (the rest
    is dropped, never reused), and two batches' draws differ."""
    seen: list[np.ndarray] = []
    words = Draws(100)
    for k in (30, 30, 30, 30, 250, 5):
        out = words(k)
        assert out.dtype == np.uint64 and out.shape == (k,) and out.flags.c_contiguous
        seen.append(out)
    base = seen[0].base
    assert all(s.base is base for s in seen[1:3])  # the first draw, sliced ...
    assert not any(np.shares_memory(a, b) for i, a in enumerate(seen) for b in seen[i + 1:])  # ... never twice
    assert seen[3].base is not base and seen[4].base is not seen[3].base  # 30 more than 10 left; 250 > 100
    flat = np.concatenate(seen)
    assert np.unique(flat).size == flat.size  # 375 fresh 64-bit words: distinct but with chance 2^-50
    assert not np.array_equal(Draws(8)(8), Draws(8)(8))


def test_clients_of_one_batch_get_their_own_decoys():
    """Simulated clients of one batch place their decoys from disjoint slices of the batch's keystream:
    two clients with the same rows send different positions in their decoy buckets, and the layout
    refuses nothing (every drawn position within its bucket)."""
    cfg = _cfg(6)
    rows, values = np.array([2, 40]), np.ones((2, 3), np.uint64)
    plans = []
    words = Draws(4 * cfg.layout.buckets)
    for i in range(4):
        plans.append(DpfSumClient(cfg, i).plan(rows, values, words=words))
    alphas = [p[0][0] for p in plans]
    sizes = np.asarray(cfg.layout.sizes)
    for a in alphas:
        assert ((a >= 0) & ((a < sizes) | (sizes == 0))).all()
    assert len({a.tobytes() for a in alphas}) == 4
    with pytest.raises(ValueError, match="contiguous uint64 words"):
        DpfSumClient(cfg, 5).plan(rows, values, words=lambda k: np.zeros(k + 1, np.uint64))
