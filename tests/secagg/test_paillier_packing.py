"""Packed Paillier vectors: exact sums, carry headroom, overflow refusal, tamper detection.

Oracles: the plaintext sum of the quantised inputs (exact integers), an independent shift-based
packer, and python-paillier (``phe``) decrypting our packed ciphertexts and summing the same
vectors with its own per-number encryption.
"""

from __future__ import annotations

import math
import warnings

import gmpy2
import numpy as np
import phe
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg.he.packing import SEAL_BITS
from secagg.he import (
    CiphertextError,
    HEError,
    InsecureKeySizeWarning,
    KeyMismatchError,
    PackedCiphertext,
    PackingSpec,
    PaillierKeyPair,
    PlaintextOverflowError,
    ShapeMismatchError,
    decrypt_packed,
    encrypt_packed,
    generate_keypair,
    sum_packed,
)

FIXTURE_OK = [HealthCheck.function_scoped_fixture]


def _keypair(bits: int) -> PaillierKeyPair:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeySizeWarning)
        return generate_keypair(bits)


@pytest.fixture(scope="module")
def kp() -> PaillierKeyPair:
    return _keypair(1024)


@pytest.fixture(scope="module")
def kp2048() -> PaillierKeyPair:
    return _keypair(2048)


@pytest.fixture(scope="module")
def other() -> PaillierKeyPair:
    return _keypair(1024)


def _phe_private(kp: PaillierKeyPair) -> phe.PaillierPrivateKey:
    ppk = phe.PaillierPublicKey(int(kp.public_key.n))
    return phe.PaillierPrivateKey(ppk, int(kp.private_key._p), int(kp.private_key._q))


def _reference_pack(slot_values: list[int], slot_bits: int, slots: int) -> list[int]:
    """Independent packer: Python shifts, slot i at bit i * slot_bits."""
    out = []
    for start in range(0, len(slot_values), slots):
        chunk = slot_values[start : start + slots]
        out.append(sum(int(v) << (i * slot_bits) for i, v in enumerate(chunk)))
    return out


specs = st.builds(
    lambda vb, fb_frac, ms, gb: PackingSpec(vb, int(fb_frac * (vb - 1)), ms, gb),
    st.integers(min_value=4, max_value=48),
    st.floats(min_value=0.0, max_value=1.0),
    st.integers(min_value=1, max_value=2**14),
    st.sampled_from([0, 16, 40]),
)


# -- layout ----------------------------------------------------------------------------------------


def test_default_layout_numbers(kp, kp2048) -> None:
    spec = PackingSpec()
    assert (spec.value_bits, spec.frac_bits, spec.max_summands) == (32, 16, 1024)
    assert spec.headroom_bits == 10 and spec.slot_bits == 42
    assert SEAL_BITS == 91
    assert spec.slots_for(kp.public_key) == (1023 - 40 - 91) // 42 == 21
    assert spec.slots_for(kp2048.public_key) == (2047 - 40 - 91) // 42 == 45


@pytest.mark.parametrize(
    ("ms", "headroom"), [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (1024, 10), (1025, 11)]
)
def test_headroom_is_ceil_log2(ms: int, headroom: int) -> None:
    assert PackingSpec(max_summands=ms).headroom_bits == headroom


@pytest.mark.parametrize(
    "kwargs",
    [
        {"value_bits": 1},
        {"value_bits": 57},
        {"frac_bits": 32},
        {"frac_bits": -1},
        {"max_summands": 0},
        {"value_bits": 56, "max_summands": 2**9},
        {"guard_bits": -1},
        {"value_bits": 32.0},
        {"max_summands": True},
        {"value_bits": 8, "max_summands": 2**32},
    ],
)
def test_bad_specs_are_refused(kwargs) -> None:
    with pytest.raises(HEError):
        PackingSpec(**kwargs)


def test_no_slot_fits_is_refused(kp) -> None:
    with pytest.raises(HEError, match="no .*slot fits"):
        PackingSpec(guard_bits=256, value_bits=56, max_summands=256).slots_for(
            PaillierKeyPairStub(bits=300)
        )


class PaillierKeyPairStub:
    """Only ``bits`` is read by ``slots_for``."""

    def __init__(self, bits: int) -> None:
        self.bits = bits


@settings(max_examples=40, deadline=None)
@given(spec=specs, length=st.integers(0, 120), slots=st.integers(1, 20), data=st.data())
def test_pack_unpack_match_independent_packer(spec: PackingSpec, length: int, slots: int, data) -> None:
    hi = (1 << spec.slot_bits) - 1
    vals = data.draw(st.lists(st.integers(0, hi), min_size=length, max_size=length))
    arr = np.array(vals, dtype=np.uint64)
    packed = spec.pack(arr, slots)
    assert [int(x) for x in packed] == _reference_pack(vals, spec.slot_bits, slots)
    unpacked = spec.unpack(packed, slots)
    assert unpacked[:length].tolist() == vals
    assert not np.any(unpacked[length:])


# -- the promise: exact sums -------------------------------------------------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=FIXTURE_OK)
@given(spec=specs, length=st.integers(0, 150), summands=st.integers(1, 6), data=st.data())
def test_sum_of_packed_vectors_is_exact(kp, spec: PackingSpec, length: int, summands: int, data) -> None:
    summands = min(summands, spec.max_summands)
    lim = spec.max_abs_int
    ints = [
        np.array(data.draw(st.lists(st.integers(-lim, lim), min_size=length, max_size=length)), dtype=np.int64)
        for _ in range(summands)
    ]
    use_private = data.draw(st.booleans())
    key = kp.private_key if use_private else kp.public_key
    cts = [encrypt_packed(v, key, spec, integers=True) for v in ints]
    total = sum_packed(cts, kp.public_key)
    assert total.summands == summands
    got = decrypt_packed(total, kp.private_key, integers=True)
    np.testing.assert_array_equal(got, np.sum(ints, axis=0) if length else np.zeros(0, np.int64))


@settings(max_examples=15, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    length=st.integers(1, 200),
    summands=st.integers(1, 10),
    scale=st.floats(min_value=1e-3, max_value=1e3),
    seed=st.integers(0, 2**32 - 1),
)
def test_real_sums_within_rounding_bound(kp, length: int, summands: int, scale: float, seed: int) -> None:
    spec = PackingSpec(value_bits=48, frac_bits=24, max_summands=16)
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test data, not secrets
    xs = [np.clip(rng.normal(scale=scale, size=length), -spec.max_abs_value, spec.max_abs_value) for _ in range(summands)]
    total = sum_packed([encrypt_packed(x, kp.private_key, spec) for x in xs], kp.public_key)
    got = decrypt_packed(total, kp.private_key)
    bound = summands * 2.0 ** -(spec.frac_bits + 1)
    assert np.max(np.abs(got - np.sum(xs, axis=0))) <= bound * (1 + 1e-9)


def test_full_headroom_with_extreme_values_never_carries(kp) -> None:
    spec = PackingSpec(value_bits=8, frac_bits=0, max_summands=5, guard_bits=40)
    hi, lo = np.full(60, 127), np.full(60, -127)
    alt = np.where(np.arange(60) % 2 == 0, 127, -127)
    for vec in (hi, lo, alt):
        cts = [encrypt_packed(vec, kp.private_key, spec, integers=True) for _ in range(5)]
        got = decrypt_packed(sum_packed(cts, kp.public_key), kp.private_key, integers=True)
        np.testing.assert_array_equal(got, 5 * vec)


def test_two_thousand_forty_eight_bit_vector(kp2048) -> None:
    rng = np.random.default_rng(3)  # CSPRNG-OK: test data
    xs = [rng.uniform(-1, 1, size=500) for _ in range(3)]
    spec = PackingSpec()
    total = sum_packed([encrypt_packed(x, kp2048.private_key, spec) for x in xs], kp2048.public_key)
    assert total.num_ciphertexts == -(-500 // 45)
    assert np.max(np.abs(decrypt_packed(total, kp2048.private_key) - sum(xs))) <= 3 * 2.0**-17


def test_pairwise_add_method_and_counts(kp) -> None:
    a = encrypt_packed([1.0, 2.0], kp.public_key)
    b = encrypt_packed([0.5, -4.0], kp.private_key)
    c = a.add(b, kp.public_key).add(a, kp.public_key)
    assert c.summands == 3
    np.testing.assert_allclose(decrypt_packed(c, kp.private_key), [2.5, 0.0])


# -- phe as an oracle ----------------------------------------------------------------------------------


def _reference_seal(spec: PackingSpec, k: int) -> int:
    """The documented seal, computed independently: k * (1 + (L << 32)), L packing the layout."""
    headroom = math.ceil(math.log2(spec.max_summands)) if spec.max_summands > 1 else 0
    code = spec.value_bits + 2**6 * spec.frac_bits + 2**12 * headroom + 2**18 * spec.guard_bits
    return k * (1 + code * 2**32)


def test_phe_decrypts_our_packed_ciphertexts(kp) -> None:
    spec = PackingSpec(value_bits=20, frac_bits=8, max_summands=8)
    ints = np.arange(-50, 50, dtype=np.int64)
    ct = encrypt_packed(ints, kp.private_key, spec, integers=True)
    psk = _phe_private(kp)
    plains = [psk.raw_decrypt(int(v)) for v in ct.values]
    slots = _reference_pack([int(x) + spec.offset for x in ints], spec.slot_bits, ct.slots)
    assert plains == [_reference_seal(spec, 1) + s * 2**91 for s in slots]


def test_same_sums_as_phe_float_encryption(kp) -> None:
    """Our packed sum of 3 uploads equals phe's per-number encrypted sum (up to fixed point)."""
    rng = np.random.default_rng(11)  # CSPRNG-OK: test data
    xs = [rng.normal(size=40) for _ in range(3)]
    ppk = phe.PaillierPublicKey(int(kp.public_key.n))
    psk = _phe_private(kp)
    phe_cts = [[ppk.encrypt(float(v)) for v in x] for x in xs]
    phe_sum = [sum(col[1:], col[0]) for col in zip(*phe_cts)]
    phe_plain = np.array([psk.decrypt(c) for c in phe_sum])
    spec = PackingSpec(value_bits=48, frac_bits=30, max_summands=4)
    ours = decrypt_packed(
        sum_packed([encrypt_packed(x, kp.private_key, spec) for x in xs], kp.public_key), kp.private_key
    )
    np.testing.assert_allclose(ours, phe_plain, atol=3 * 2.0**-31)
    # And phe can add OUR ciphertexts: the packed plaintexts add slot-wise.
    a = encrypt_packed(np.array([3, -2, 7]), kp.public_key, spec, integers=True)
    b = encrypt_packed(np.array([1, 1, -9]), kp.public_key, spec, integers=True)
    phe_total = phe.EncryptedNumber(ppk, int(a.values[0])) + phe.EncryptedNumber(ppk, int(b.values[0]))
    summed = PackedCiphertext(a.fingerprint, spec, a.slots, 3, 2, (gmpy2.mpz(phe_total.ciphertext(False)),))
    np.testing.assert_array_equal(decrypt_packed(summed, kp.private_key, integers=True), [4, -1, -2])


# -- bad input: refused before encryption or addition --------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, 32768.0, -32768.0, 1e30])
def test_overflowing_values_are_refused_before_encryption(kp, bad: float) -> None:
    spec = PackingSpec(value_bits=32, frac_bits=16)
    with pytest.raises(PlaintextOverflowError, match="clip|non-finite"):
        encrypt_packed([0.0, bad, 1.0], kp.public_key, spec)


def test_largest_value_fits_exactly(kp) -> None:
    spec = PackingSpec(value_bits=32, frac_bits=16)
    edge = np.array([spec.max_abs_value, -spec.max_abs_value])
    ct = encrypt_packed(edge, kp.private_key, spec)
    np.testing.assert_array_equal(decrypt_packed(ct, kp.private_key), edge)
    with pytest.raises(PlaintextOverflowError, match="index 0"):
        encrypt_packed([spec.max_abs_value + 2.0**-16], kp.public_key, spec)
    with pytest.raises(PlaintextOverflowError, match="integer 2147483648"):
        encrypt_packed(np.array([2**31]), kp.public_key, spec, integers=True)


def test_summing_beyond_declared_headroom_is_refused(kp) -> None:
    spec = PackingSpec(value_bits=16, frac_bits=4, max_summands=3)
    cts = [encrypt_packed([1.0, 2.0], kp.public_key, spec) for _ in range(4)]
    three = sum_packed(cts[:3], kp.public_key)
    with pytest.raises(PlaintextOverflowError, match="max_summands=3"):
        sum_packed(cts, kp.public_key)
    with pytest.raises(PlaintextOverflowError):
        three.add(cts[3], kp.public_key)


def test_wrong_length_and_layout_are_refused(kp) -> None:
    a = encrypt_packed([1.0, 2.0, 3.0], kp.public_key)
    with pytest.raises(ShapeMismatchError, match="lengths 3 and 2"):
        sum_packed([a, encrypt_packed([1.0, 2.0], kp.public_key)], kp.public_key)
    with pytest.raises(ShapeMismatchError, match="layouts"):
        sum_packed([a, encrypt_packed([1.0, 2.0, 3.0], kp.public_key, PackingSpec(frac_bits=10))], kp.public_key)
    with pytest.raises(HEError, match="at least one"):
        sum_packed([], kp.public_key)


def test_vectors_from_another_key_are_refused(kp, other) -> None:
    ours = encrypt_packed([1.0], kp.public_key)
    theirs = encrypt_packed([1.0], other.public_key)
    with pytest.raises(KeyMismatchError):
        sum_packed([ours, theirs], kp.public_key)
    with pytest.raises(KeyMismatchError):
        sum_packed([theirs], kp.public_key)
    with pytest.raises(KeyMismatchError):
        decrypt_packed(theirs, kp.private_key)
    with pytest.raises(KeyMismatchError):
        PackedCiphertext.from_bytes(theirs.to_bytes(other.public_key), kp.public_key)


def test_bytes_round_trip_and_expected_layout(kp) -> None:
    spec = PackingSpec(value_bits=24, frac_bits=12, max_summands=100)
    x = np.linspace(-3, 3, 77)
    ct = encrypt_packed(x, kp.private_key, spec)
    blob = ct.to_bytes(kp.public_key)
    back = PackedCiphertext.from_bytes(blob, kp.public_key, spec=spec, length=77)
    np.testing.assert_allclose(decrypt_packed(back, kp.private_key), x, atol=2.0**-13)
    assert len(blob) == len(encrypt_packed(np.zeros(77), kp.public_key, spec).to_bytes(kp.public_key))
    with pytest.raises(ShapeMismatchError, match="length 77; expected 78"):
        PackedCiphertext.from_bytes(blob, kp.public_key, length=78)
    with pytest.raises(ShapeMismatchError, match="layout"):
        PackedCiphertext.from_bytes(blob, kp.public_key, spec=PackingSpec())


def _header_mutations(blob: bytes) -> dict[str, bytes]:
    b = bytearray(blob)
    out = {"truncated": bytes(b[:-1]), "padded": bytes(b) + b"\x00", "empty": b"", "short_header": bytes(b[:10])}
    m = bytearray(b)
    m[0] ^= 0xFF
    out["magic"] = bytes(m)
    m = bytearray(b)
    m[20] = 1  # value_bits = 1 -> invalid layout
    out["layout"] = bytes(m)
    m = bytearray(b)
    m[28:30] = (99).to_bytes(2, "big")  # slots
    out["slots"] = bytes(m)
    m = bytearray(b)
    m[34:38] = (0).to_bytes(4, "big")  # summands = 0
    out["summands_zero"] = bytes(m)
    m = bytearray(b)
    m[34:38] = (10**6).to_bytes(4, "big")  # beyond max_summands
    out["summands_big"] = bytes(m)
    m = bytearray(b)
    m[30:34] = (5000).to_bytes(4, "big")  # length disagrees with the body
    out["length"] = bytes(m)
    return out


@pytest.mark.parametrize(
    "mutation",
    ["truncated", "padded", "empty", "short_header", "magic", "layout", "slots", "summands_zero", "summands_big", "length"],
)
def test_malformed_packed_bytes_are_refused(kp, mutation: str) -> None:
    blob = encrypt_packed(np.arange(30.0), kp.public_key).to_bytes(kp.public_key)
    with pytest.raises(CiphertextError):
        PackedCiphertext.from_bytes(_header_mutations(blob)[mutation], kp.public_key)


@settings(max_examples=30, deadline=None, suppress_health_check=FIXTURE_OK)
@given(position=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_random_corruption_of_a_ciphertext_is_detected(kp, position: int, flip: int) -> None:
    """Any byte change in a ciphertext value is refused at parse time or at decryption."""
    ct = encrypt_packed(np.linspace(-1, 1, 50), kp.private_key)
    blob = bytearray(ct.to_bytes(kp.public_key))
    header = 38
    pos = header + position % (len(blob) - header)
    blob[pos] ^= flip
    with pytest.raises(CiphertextError):
        parsed = PackedCiphertext.from_bytes(bytes(blob), kp.public_key)
        decrypt_packed(parsed, kp.private_key)


def test_wrong_summand_count_is_detected(kp) -> None:
    ct = sum_packed([encrypt_packed([0.25, -0.5], kp.public_key) for _ in range(2)], kp.public_key)
    for claimed in (1, 3, 4, 1024):
        lying = PackedCiphertext(ct.fingerprint, ct.spec, ct.slots, ct.length, claimed, ct.values)
        with pytest.raises(CiphertextError, match="claims .* summands but the encrypted seal holds 2"):
            decrypt_packed(lying, kp.private_key)


def test_raising_summands_in_the_header_is_detected(kp) -> None:
    """Issue 8, item 3: a larger ``summands`` in the bytes used to shift every value by offsets.

    The summed values are small, so every slot stays inside the range check for a larger count;
    only the seal inside the plaintext can tell.
    """
    xs = [np.array([0.25, -0.5, 1.0]), np.array([0.5, 0.5, -2.0])]
    total = sum_packed([encrypt_packed(x, kp.public_key) for x in xs], kp.public_key)
    blob = bytearray(total.to_bytes(kp.public_key))
    for claimed in (3, 4, 100, 1024):
        blob[34:38] = claimed.to_bytes(4, "big")
        parsed = PackedCiphertext.from_bytes(bytes(blob), kp.public_key)  # the header itself is well-formed
        with pytest.raises(CiphertextError, match="encrypted seal holds 2"):
            decrypt_packed(parsed, kp.private_key)


def test_mixing_ciphertexts_of_different_sums_is_detected(kp) -> None:
    spec = PackingSpec(value_bits=16, frac_bits=4, max_summands=8)
    x = np.linspace(-1, 1, 100)  # 3 ciphertexts of 44 slots
    two = sum_packed([encrypt_packed(x, kp.public_key, spec) for _ in range(2)], kp.public_key)
    three = sum_packed([encrypt_packed(x, kp.public_key, spec) for _ in range(3)], kp.public_key)
    assert two.num_ciphertexts == 3
    mixed = PackedCiphertext(two.fingerprint, spec, two.slots, two.length, 2, (two.values[0], three.values[1], two.values[2]))
    with pytest.raises(CiphertextError, match="seal holds 3"):
        decrypt_packed(mixed, kp.private_key)


def test_frac_bits_edited_in_the_header_is_detected(kp) -> None:
    """Rescaling by editing frac_bits would halve every value; the sealed layout refuses it."""
    ct = encrypt_packed([1.5, -2.0], kp.public_key)
    blob = bytearray(ct.to_bytes(kp.public_key))
    assert blob[21] == 16
    blob[21] = 17
    parsed = PackedCiphertext.from_bytes(bytes(blob), kp.public_key)
    with pytest.raises(CiphertextError, match="layout"):
        decrypt_packed(parsed, kp.private_key)


_HEADER_FIELDS = [("magic", 0, 4), ("fingerprint", 4, 20), ("value_bits", 20, 21), ("frac_bits", 21, 22),
                  ("max_summands", 22, 26), ("guard_bits", 26, 28), ("slots", 28, 30), ("length", 30, 34),
                  ("summands", 34, 38)]


def test_every_header_byte_flip_is_refused_or_harmless(kp) -> None:
    """Deterministic and exhaustive: each of the 38 header bytes XOR-ed with each of 1..255.

    Every mutated vector (a sum of 3 uploads spanning 3 ciphertexts) is refused with a typed
    error at parse time or at decryption, or it decrypts to exactly the true sum (a change that
    does not alter the meaning, e.g. max_summands 1024 -> 1000, the same headroom). Nothing else.
    """
    spec = PackingSpec()
    rng = np.random.default_rng(5)  # CSPRNG-OK: test data
    ints = [rng.integers(-(2**20), 2**20, size=50) for _ in range(3)]
    total = sum_packed([encrypt_packed(v, kp.private_key, spec, integers=True) for v in ints], kp.public_key)
    truth = np.sum(ints, axis=0)
    blob = total.to_bytes(kp.public_key)
    assert sum(end - start for _, start, end in _HEADER_FIELDS) == 38 == len(blob) - 3 * kp.public_key.ciphertext_bytes
    harmless: dict[str, int] = {}
    refused_at_decryption: dict[str, int] = {}
    for name, start, end in _HEADER_FIELDS:
        for pos in range(start, end):
            for flip in range(1, 256):
                mutated = bytearray(blob)
                mutated[pos] ^= flip
                try:
                    parsed = PackedCiphertext.from_bytes(bytes(mutated), kp.public_key)
                except (CiphertextError, KeyMismatchError, ShapeMismatchError):
                    continue
                try:
                    got = decrypt_packed(parsed, kp.private_key, integers=True)
                except (CiphertextError, ShapeMismatchError):
                    refused_at_decryption[name] = refused_at_decryption.get(name, 0) + 1
                    continue
                np.testing.assert_array_equal(got, truth, err_msg=f"{name} byte {pos} ^ {flip:#04x} decoded wrongly")
                harmless[name] = harmless.get(name, 0) + 1
    # The checks were exercised where they matter: these fields parse and are caught by the seal.
    assert {"frac_bits", "summands"} <= set(refused_at_decryption), refused_at_decryption
    assert set(harmless) <= {"max_summands", "guard_bits"}, harmless


def test_limit_malleability_in_range_shift_is_undetected(kp) -> None:
    """Stated limit: a public-key holder can add a valid small delta to a slot; nothing notices."""
    spec = PackingSpec()
    upload = encrypt_packed([1.0, 2.0, 3.0], kp.private_key, spec)
    delta_plain = 5 << (SEAL_BITS + spec.slot_bits)  # +5 grid units in slot 1, no offset: still in range
    delta = kp.public_key.encrypt_int(delta_plain)
    forged_values = (gmpy2.mul(upload.values[0], delta.value) % kp.public_key.nsquare,)
    forged = PackedCiphertext(upload.fingerprint, spec, upload.slots, 3, 1, forged_values)
    got = decrypt_packed(forged, kp.private_key, integers=True)
    np.testing.assert_array_equal(got, np.array([1, 2, 3]) * 2**16 + np.array([0, 5, 0]))


def test_in_memory_vector_with_missing_ciphertexts_is_refused(kp) -> None:
    a = encrypt_packed(np.arange(50.0), kp.public_key)
    short = PackedCiphertext(a.fingerprint, a.spec, a.slots, a.length, 1, a.values[:-1])
    with pytest.raises(ShapeMismatchError, match="holds 2 ciphertexts; expected 3"):
        sum_packed([a, short], kp.public_key)
    with pytest.raises(ShapeMismatchError):
        decrypt_packed(short, kp.private_key)


def test_limit_a_public_key_holder_can_reseal_a_count(kp) -> None:
    """Stated limit: the seal stops header edits, not homomorphic ones. Adding Enc(seal(1)) to
    every ciphertext and claiming one more summand decodes to values shifted by -offset (what
    adding an encrypted delta to the slots could do anyway: Paillier is malleable)."""
    spec = PackingSpec(value_bits=16, frac_bits=0, max_summands=8)
    up = encrypt_packed(np.array([100, -7]), kp.public_key, spec, integers=True)
    extra = kp.public_key.encrypt_int(spec.seal(1)).value
    forged = PackedCiphertext(up.fingerprint, spec, up.slots, 2, 2,
                              (gmpy2.mul(up.values[0], extra) % kp.public_key.nsquare,))
    got = decrypt_packed(forged, kp.private_key, integers=True)
    np.testing.assert_array_equal(got, np.array([100, -7]) - spec.offset)
