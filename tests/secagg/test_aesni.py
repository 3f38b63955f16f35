"""AES-128 on AES-NI inside compiled loops (secagg/aesni.py, secagg/aesni_kernels.py) against
``cryptography`` (OpenSSL) as the oracle: FIPS-197's key-expansion vector, random keys and blocks,
and every fused variant the DPF evaluation uses (tweaks, corrections, accumulation, offsets and
consecutive lanes). On a CPU without AES-NI the module must say so and the DPF must not use it."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import aesni, dpf

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HERE = aesni.available()


def _oracle(key: bytes, blocks: np.ndarray) -> np.ndarray:
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return np.frombuffer(enc.update(np.ascontiguousarray(blocks).tobytes()), np.uint64).reshape(-1, 2)


def test_availability_follows_the_cpu_and_the_switch(monkeypatch):
    import llvmlite.binding as ll
    import platform
    want = platform.machine().lower() in ("x86_64", "amd64") and bool(ll.get_host_cpu_features().get("aes", False))
    assert HERE == want
    aesni.available.cache_clear()
    aesni.kernels.cache_clear()
    monkeypatch.setenv("SECAGG_AESNI", "0")
    try:
        assert not aesni.available()
        with pytest.raises(RuntimeError, match="not available"):
            aesni.round_keys(bytes(16))
    finally:
        monkeypatch.delenv("SECAGG_AESNI")
        aesni.available.cache_clear()
        aesni.kernels.cache_clear()
    assert aesni.available() == HERE


def test_the_accumulator_uses_aesni_exactly_where_it_is_available_and_refuses_it_elsewhere(monkeypatch):
    forest = dpf.Forest.of(np.array([3, 2]))
    assert dpf.Accumulator(forest, 2, 0).aesni == HERE
    assert not dpf.Accumulator(forest, 2, 0, fused=False).aesni
    monkeypatch.setattr(dpf, "_ni", lambda: None)
    assert not dpf.Accumulator(forest, 2, 0).aesni
    with pytest.raises(ValueError, match="AES-NI"):
        dpf.Accumulator(forest, 2, 0, aesni=True)
    with pytest.raises(ValueError, match="AES-NI"):
        dpf.Accumulator(forest, 2, 0, fused=False, aesni=True)


def test_round_keys_reject_keys_that_are_not_16_bytes():
    if not HERE:
        assert not aesni.available()
        return
    for bad in (b"", bytes(15), bytes(17), bytes(32), "0" * 16):
        with pytest.raises(ValueError, match="16 bytes"):
            aesni.round_keys(bad)


def test_the_key_schedule_gives_fips_197s_round_keys():
    if not HERE:
        return
    rk = aesni.round_keys(bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c"))  # FIPS-197 Appendix A.1
    raw = rk.view(np.uint8).tobytes()
    assert raw[:16].hex() == "2b7e151628aed2a6abf7158809cf4f3c"
    assert raw[16:32].hex() == "a0fafe1788542cb123a339392a6c7605"  # w[4..7]
    assert raw[-16:].hex() == "d014f9a8c9ee2589e13f0cc8b6630ca6"  # w[40..43]
    # FIPS-197 Appendix B: the cipher example
    x = np.frombuffer(bytes.fromhex("3243f6a8885a308d313198a2e0370734"), np.uint64).reshape(1, 2)
    assert aesni.ecb(x, rk).tobytes().hex() == "3925841d02dc09fbdc118597196a0b32"


@PROPS
@given(key=st.binary(min_size=16, max_size=16), n=st.integers(0, 70), seed=st.binary(min_size=8, max_size=8))
def test_ecb_and_mmo_equal_openssl_on_random_keys_and_blocks(key, n, seed):
    if not HERE:
        return
    x = np.frombuffer((seed * (2 * n + 1))[:16 * n], np.uint64).reshape(n, 2) ^ np.arange(2 * n, dtype=np.uint64).reshape(n, 2)
    rk = aesni.round_keys(key)
    want = _oracle(key, x)
    assert np.array_equal(aesni.ecb(x, rk), want)
    assert np.array_equal(aesni.ecb(x, rk, mmo=True), want ^ x)
    with pytest.raises(ValueError):
        aesni.ecb(x.reshape(-1), rk)
    with pytest.raises(ValueError):
        aesni.ecb(x, rk[:20])


@functools.cache
def _harness(kind: int, per: int):  # noqa: ANN202 - an njit harness of one variant (compiled only where AES-NI is, once)
    import numba

    from secagg import aesni_kernels as ak

    ff, correct, out, contiguous, tweak = KINDS[kind]
    fn = ak._lanes_intrinsic(ff, correct == "xor", contiguous=contiguous, tweak=tweak, per=per)

    @numba.njit
    def run(src, sbase, soff, tw, tbase, toff, rk, kbase, cw, cbase, coff, masks, dst, dbase, doff):  # noqa: ANN001, ANN202, PLR0913
        fn(src, sbase, soff, tw, tbase, toff, rk, kbase, cw, cbase, coff, masks, dst, dbase, doff)

    return run


def test_the_module_intrinsics_are_the_variants_the_harness_checks():
    if not HERE:
        return
    from secagg import aesni_kernels as ak
    assert ak.LANES == (16 if ak.WIDE else 8)
    with pytest.raises(ValueError, match="per is 1"):
        ak._lanes_intrinsic(True, False, per=4)


#: kind -> (feed-forward, correction, output, consecutive lanes, tweak)
#: (adding into a sum is the group intrinsic's: test_the_group_value_intrinsic_equals_openssl_block_by_block)
KINDS = {0: (False, None, "store", False, True), 1: (True, None, "store", False, True), 2: (True, "xor", "store", False, True),
         3: (False, None, "store", True, True), 4: (True, "xor", "store", True, True),
         7: (False, None, "store", True, False), 8: (True, None, "store", True, False)}


@PROPS
@given(kind=st.sampled_from(sorted(KINDS)), seed=st.integers(0, 2**32 - 1), shared=st.booleans(), wide=st.booleans())
def test_every_fused_intrinsic_equals_openssl_and_its_numpy_definition(kind, seed, shared, wide):
    """Each lane: x = src XOR tw (tweak), y = AES(x) (XOR x), XOR-corrected by cw AND mask, stored into
    dst; offsets per lane or consecutive. 8 lanes (AES-NI) and, where the CPU has VAES, 16 (two blocks
    per register)."""
    if not HERE:
        return
    from secagg.aesni_kernels import WIDE
    per = 2 if wide and WIDE else 1
    LANES = 8 * per  # noqa: N806
    ff, correct, out, contiguous, tweak = KINDS[kind]
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test data only
    words = lambda n: rng.integers(0, 2**64, n, dtype=np.uint64)  # noqa: E731
    keys = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(3)]
    rk = np.concatenate([aesni.round_keys(k) for k in keys])
    which = int(rng.integers(0, 3))
    room = 2 * LANES + 16  # words of each array beyond its base
    src, tw, cw, dst = words(room + 16), words(room + 16), words(room + 4), words(room + 12)
    pick = lambda: (2 * rng.integers(0, room // 2, LANES)).astype(np.int64)  # noqa: E731
    soff, toff, coff = pick(), pick(), pick()
    doff = (np.zeros(LANES, np.int64) if shared and out != "store"
            else (2 * rng.permutation(room // 2)[:LANES]).astype(np.int64))
    sbase, tbase, cbase, dbase = 2 * int(rng.integers(0, 8)), 2 * int(rng.integers(0, 8)), int(rng.integers(0, 3)), 2 * int(rng.integers(0, 6))
    if contiguous:
        soff = toff = doff = np.arange(0, 2 * LANES, 2, dtype=np.int64)
    masks = np.where(rng.integers(0, 2, LANES).astype(bool), np.uint64(2**64 - 1), np.uint64(0))
    want = dst.copy()
    for lane in range(LANES):
        x = src[sbase + soff[lane]:sbase + soff[lane] + 2].copy()
        if tweak:
            x ^= tw[tbase + toff[lane]:tbase + toff[lane] + 2]
        y = _oracle(keys[which], x.reshape(1, 2))[0]
        if ff:
            y = y ^ x
        if correct is not None:
            c = cw[cbase + coff[lane]:cbase + coff[lane] + 2] & masks[lane]
            y = y ^ c if correct == "xor" else y + c
        at = slice(dbase + doff[lane], dbase + doff[lane] + 2)
        want[at] = y if out == "store" else (want[at] + y if out == "add" else want[at] - y)
    got = dst.copy()
    _harness(kind, per)(src, sbase, soff, tw, tbase, toff, rk, 22 * which, cw, cbase, coff, masks, got, dbase, doff)
    assert np.array_equal(got, want)


@functools.cache
def _blocks_harness(out: str, per: int):  # noqa: ANN202 - an njit harness of the group intrinsic
    import numba

    from secagg import aesni_kernels as ak

    fn = ak._blocks_intrinsic(out, per=per)

    @numba.njit
    def run(src, sbase, rk, cw, coff, masks, dst, dbase, stride, blocks):  # noqa: ANN001, ANN202, PLR0913
        fn(src, sbase, rk, cw, coff, masks, dst, dbase, stride, blocks)

    return run


@PROPS
@given(blocks=st.integers(0, 5), seed=st.integers(0, 2**32 - 1), sub=st.booleans(), wide=st.booleans())
def test_the_group_value_intrinsic_equals_openssl_block_by_block(blocks, seed, sub, wide):
    """``dst[dbase + i stride + 2l] +=`` (or ``-=``) ``(AES_i(x_l) XOR x_l) + (cw[coff[l] + 2i] AND
    mask_l)`` for every key ``i < blocks`` and lane ``l``; nothing else of ``dst`` changes (0 blocks:
    nothing at all). Keys, corrections, offsets and masks random; the oracle is OpenSSL."""
    if not HERE:
        return
    from secagg.aesni_kernels import WIDE
    per = 2 if wide and WIDE else 1
    LANES = 8 * per  # noqa: N806
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test data only
    words = lambda n: rng.integers(0, 2**64, n, dtype=np.uint64)  # noqa: E731
    keys = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(blocks)]
    rk = np.concatenate([aesni.round_keys(k) for k in keys]) if blocks else np.zeros(22, np.uint64)
    sbase, dbase = 2 * int(rng.integers(0, 5)), 2 * int(rng.integers(0, 5))
    stride = 2 * LANES + 2 * int(rng.integers(0, 4))
    src, cw = words(sbase + 2 * LANES + 6), words(2 * max(blocks, 1) + 40)
    coff = rng.integers(0, 40, LANES).astype(np.int64)
    masks = np.where(rng.integers(0, 2, LANES).astype(bool), np.uint64(2**64 - 1), np.uint64(0))
    dst = words(dbase + stride * max(blocks, 1) + 2 * LANES + 4)
    want = dst.copy()
    x = src[sbase:sbase + 2 * LANES].reshape(LANES, 2)
    for i, key in enumerate(keys):
        y = _oracle(key, x) ^ x
        for lane in range(LANES):
            c = cw[coff[lane] + 2 * i:coff[lane] + 2 * i + 2] & masks[lane]
            at = slice(dbase + i * stride + 2 * lane, dbase + i * stride + 2 * lane + 2)
            want[at] = want[at] - (y[lane] + c) if sub else want[at] + (y[lane] + c)
    got = dst.copy()
    _blocks_harness("sub" if sub else "add", per)(src, sbase, rk, cw, coff, masks, got, dbase, stride, blocks)
    assert np.array_equal(got, want)


def test_the_group_intrinsic_refuses_other_widths_and_outputs():
    if not HERE:
        return
    from secagg import aesni_kernels as ak
    with pytest.raises(ValueError, match="per is 1"):
        ak._blocks_intrinsic("add", per=4)
    with pytest.raises(ValueError, match="out is"):
        ak._blocks_intrinsic("store")


def test_the_key_schedule_has_no_secret_dependent_table():
    """SubWord runs on aesenclast (the challenge is a secret key): the module holds no S-box."""
    import secagg.aesni_kernels as ak
    text = open(ak.__file__).read()
    assert "0x63" not in text and "sbox" not in text.lower()
    if HERE:
        key = os.urandom(16)
        rk = aesni.round_keys(key)
        x = np.frombuffer(os.urandom(16 * 9), np.uint64).reshape(9, 2)
        assert np.array_equal(aesni.ecb(x, rk), _oracle(key, x))


def test_the_evaluations_key_tuples_hold_a_whole_batch():
    """The AES-NI evaluation reads a batch's keys through fixed 8-tuples (one compiled signature): as
    long as the accumulator's batch limit; read-only views whatever the arrays' origin."""
    if not HERE:
        return
    from secagg import dpf_ni
    assert dpf_ni._GROUP == dpf._GROUP
    a = np.arange(6, dtype=np.uint64).reshape(3, 2)
    got = dpf_ni._arrays([a, a[::-1]])
    assert len(got) == dpf._GROUP and all(not v.flags.writeable and v.flags.c_contiguous for v in got)
    assert a.flags.writeable and np.array_equal(got[1], a[::-1]) and got[2] is got[0]
