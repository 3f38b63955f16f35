"""CKKS through TenSEAL: key model (server cannot decrypt), sums within the stated error bound,
validation of parameters, values and received bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import tenseal as ts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg.he import (
    CiphertextError,
    HEError,
    KeyMismatchError,
    NoSecretKeyError,
    PlaintextOverflowError,
    ShapeMismatchError,
)
from secagg.he.ckks import (
    CKKSCiphertext,
    CKKSContext,
    CKKSParams,
    decrypt_vector,
    encrypt_vector,
    sum_error_bound,
    sum_vectors,
)

FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@pytest.fixture(scope="module")
def client_ctx() -> CKKSContext:
    return CKKSContext.generate()


@pytest.fixture(scope="module")
def server_ctx(client_ctx: CKKSContext) -> CKKSContext:
    """What the server receives: the serialized context with the default save_secret_key=False."""
    return CKKSContext.from_bytes(client_ctx.serialize())


@pytest.fixture(scope="module")
def other_ctx() -> CKKSContext:
    return CKKSContext.generate()


# -- parameters ---------------------------------------------------------------------------------------


def test_default_parameters_are_documented_values() -> None:
    p = CKKSParams()
    assert (p.poly_modulus_degree, p.coeff_mod_bit_sizes, p.scale_bits) == (8192, (60, 40, 40, 60), 40)
    assert p.slots == 4096
    assert p.max_abs_value == 2.0**19


@pytest.mark.parametrize(
    "kwargs",
    [
        {"poly_modulus_degree": 5000},
        {"coeff_mod_bit_sizes": (60, 60, 60, 60)},  # 240 > 218 bits: below 128-bit security
        {"coeff_mod_bit_sizes": (60,)},
        {"coeff_mod_bit_sizes": (61, 40, 60)},
        {"scale_bits": 60},
        {"scale_bits": 10},
        {"poly_modulus_degree": 4096, "coeff_mod_bit_sizes": (60, 40, 40, 60)},
    ],
)
def test_insecure_or_invalid_parameters_are_refused(kwargs) -> None:
    with pytest.raises(HEError):
        CKKSParams(**kwargs)


def test_error_bound_is_linear_and_not_vacuous() -> None:
    one = sum_error_bound(1)
    assert sum_error_bound(10) == pytest.approx(10 * one)
    assert 1e-8 < one < 1e-5
    with pytest.raises(HEError):
        sum_error_bound(0)


# -- the key model ------------------------------------------------------------------------------------


def test_server_context_has_no_secret_key_and_cannot_decrypt(client_ctx, server_ctx) -> None:
    assert client_ctx.is_private and not server_ctx.is_private
    assert server_ctx.fingerprint == client_ctx.fingerprint
    upload = encrypt_vector([1.0, 2.0, 3.0], client_ctx)
    received = CKKSCiphertext.from_bytes(upload.to_bytes(), server_ctx)
    with pytest.raises(NoSecretKeyError, match="cannot decrypt"):
        decrypt_vector(received, server_ctx)
    # Not just our wrapper: TenSEAL itself has no key to decrypt with on the server side.
    with pytest.raises(ValueError, match="secret_key"):
        received.chunks[0].decrypt()
    assert not server_ctx._ctx.has_secret_key()
    with pytest.raises(NoSecretKeyError):
        server_ctx.serialize(save_secret_key=True)


def test_serialization_omits_secret_key_by_default(client_ctx) -> None:
    public_blob = client_ctx.serialize()
    assert not CKKSContext.from_bytes(public_blob).is_private
    secret_blob = client_ctx.serialize(save_secret_key=True)
    restored = CKKSContext.from_bytes(secret_blob)
    assert restored.is_private and restored.fingerprint == client_ctx.fingerprint
    assert np.allclose(decrypt_vector(encrypt_vector([0.5], client_ctx), restored), [0.5], atol=1e-6)


def test_server_can_encrypt_and_add_with_public_context(client_ctx, server_ctx) -> None:
    a = encrypt_vector([1.0, -1.0], server_ctx)
    b = encrypt_vector([2.0, 0.25], client_ctx)
    total = CKKSCiphertext.from_bytes(sum_vectors([a, CKKSCiphertext.from_bytes(b.to_bytes(), server_ctx)], server_ctx).to_bytes(), client_ctx)
    np.testing.assert_allclose(decrypt_vector(total, client_ctx), [3.0, -0.75], atol=total.error_bound(client_ctx.params))


def test_limit_shared_key_lets_any_client_decrypt_any_upload(client_ctx) -> None:
    client_b = CKKSContext.from_bytes(client_ctx.serialize(save_secret_key=True))
    upload_of_a = encrypt_vector([4.2, -7.0], client_ctx)
    np.testing.assert_allclose(decrypt_vector(upload_of_a, client_b), [4.2, -7.0], atol=1e-6)


def test_limit_malleability_server_shift_is_undetected(client_ctx, server_ctx) -> None:
    upload = encrypt_vector([1.0, 1.0], client_ctx)
    shifted = sum_vectors([upload, encrypt_vector([0.0, 100.0], server_ctx)], server_ctx)
    np.testing.assert_allclose(decrypt_vector(shifted, client_ctx), [1.0, 101.0], atol=1e-5)


# -- the promise: sums within the bound ---------------------------------------------------------------


@settings(max_examples=10, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    length=st.integers(0, 9000),
    summands=st.integers(1, 12),
    scale=st.sampled_from([1e-3, 1.0, 100.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_sum_of_n_vectors_within_error_bound(client_ctx, server_ctx, length, summands, scale, seed) -> None:
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test data, not secrets
    xs = [rng.uniform(-scale, scale, size=length) for _ in range(summands)]
    uploads = [CKKSCiphertext.from_bytes(encrypt_vector(x, client_ctx).to_bytes(), server_ctx) for x in xs]
    total = sum_vectors(uploads, server_ctx)
    assert total.summands == summands and total.length == length
    assert len(total.chunks) == -(-length // 4096)
    got = decrypt_vector(CKKSCiphertext.from_bytes(total.to_bytes(), client_ctx), client_ctx)
    expected = np.sum(xs, axis=0) if length else np.zeros(0)
    bound = sum_error_bound(summands, client_ctx.params)
    assert got.shape == (length,)
    if length:
        assert np.max(np.abs(got - expected)) <= bound


def test_bound_holds_for_one_hundred_summands_at_extreme_values(client_ctx, server_ctx) -> None:
    rng = np.random.default_rng(5)  # CSPRNG-OK: test data
    limit = client_ctx.params.max_abs_value
    xs = [rng.choice([-limit, limit], size=256) for _ in range(100)]
    total = sum_vectors([encrypt_vector(x, client_ctx) for x in xs], server_ctx)
    err = np.max(np.abs(decrypt_vector(total, client_ctx) - np.sum(xs, axis=0)))
    # The bound is absolute: at |x| = 2^19 double-precision encoding adds only ~2^19 * 2^-53.
    assert err <= sum_error_bound(100)


def test_smaller_ring_parameters_work_and_bound_holds() -> None:
    params = CKKSParams(poly_modulus_degree=4096, coeff_mod_bit_sizes=(40, 20, 40), scale_bits=21)
    ctx = CKKSContext.generate(params)
    x = np.linspace(-1, 1, 3000)
    total = sum_vectors([encrypt_vector(x, ctx), encrypt_vector(-2 * x, ctx)], ctx.public())
    assert len(total.chunks) == 2
    assert np.max(np.abs(decrypt_vector(total, ctx) + x)) <= sum_error_bound(2, params)


# -- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, 2.0**19 + 1, -1e9])
def test_out_of_range_values_are_refused_before_encryption(client_ctx, bad) -> None:
    with pytest.raises(PlaintextOverflowError):
        encrypt_vector([0.0, bad], client_ctx)


def test_other_key_and_length_mismatch_are_refused(client_ctx, server_ctx, other_ctx) -> None:
    ours = encrypt_vector([1.0, 2.0], client_ctx)
    theirs = encrypt_vector([1.0, 2.0], other_ctx)
    with pytest.raises(KeyMismatchError):
        sum_vectors([ours, theirs], server_ctx)
    with pytest.raises(KeyMismatchError):
        decrypt_vector(theirs, client_ctx)
    with pytest.raises(KeyMismatchError):
        CKKSCiphertext.from_bytes(theirs.to_bytes(), server_ctx)
    with pytest.raises(ShapeMismatchError, match="lengths 2 and 3"):
        sum_vectors([ours, encrypt_vector([1.0, 2.0, 3.0], client_ctx)], server_ctx)
    with pytest.raises(ShapeMismatchError, match="expected 5"):
        CKKSCiphertext.from_bytes(ours.to_bytes(), server_ctx, length=5)
    with pytest.raises(HEError):
        sum_vectors([], server_ctx)


def _mutations(blob: bytes) -> dict[str, bytes]:
    out = {"truncated": blob[:-7], "padded": blob + b"\x00", "empty": b"", "magic": b"XXXX" + blob[4:]}
    m = bytearray(blob)
    m[20:24] = (9000).to_bytes(4, "big")  # length disagrees with the chunk count
    out["length"] = bytes(m)
    m = bytearray(blob)
    m[24:28] = (0).to_bytes(4, "big")  # zero summands
    out["summands"] = bytes(m)
    m = bytearray(blob)
    m[40:44] = b"\xff\xff\xff\xff"  # corrupt the first chunk's serialized stream
    out["chunk"] = bytes(m)
    return out


@pytest.mark.parametrize("mutation", ["truncated", "padded", "empty", "magic", "length", "summands", "chunk"])
def test_malformed_vector_bytes_are_refused(client_ctx, server_ctx, mutation) -> None:
    blob = encrypt_vector(np.arange(10.0), client_ctx).to_bytes()
    with pytest.raises((CiphertextError, ShapeMismatchError)):
        CKKSCiphertext.from_bytes(_mutations(blob)[mutation], server_ctx)


def test_chunk_with_wrong_size_is_refused(client_ctx, server_ctx) -> None:
    ct = encrypt_vector(np.arange(10.0), client_ctx)
    forged = CKKSCiphertext(ct.fingerprint, 11, 1, ct.chunks)
    with pytest.raises(ShapeMismatchError, match="holds 10 values; expected 11"):
        CKKSCiphertext.from_bytes(forged.to_bytes(), server_ctx)


def test_context_bytes_malformed_are_refused(client_ctx) -> None:
    blob = client_ctx.serialize()
    for bad in (b"", b"CKC1", b"XXXX" + blob[4:], blob[:13] + b"garbage"):
        with pytest.raises(CiphertextError):
            CKKSContext.from_bytes(bad)


def test_tenseal_raw_context_fingerprint_is_stable(client_ctx, server_ctx) -> None:
    raw = ts.context_from(client_ctx._ctx.serialize(save_secret_key=False))
    assert CKKSContext(client_ctx.params, raw).fingerprint == client_ctx.fingerprint == server_ctx.fingerprint


def test_summing_never_mutates_the_inputs(client_ctx, server_ctx) -> None:
    a, b, c = (encrypt_vector([v, 2 * v], client_ctx) for v in (1.0, 10.0, 100.0))
    total = sum_vectors([a, b, c], server_ctx)
    again = sum_vectors([a, b, c], server_ctx)
    for ct, expected in ((a, [1.0, 2.0]), (b, [10.0, 20.0]), (c, [100.0, 200.0])):
        np.testing.assert_allclose(decrypt_vector(ct, client_ctx), expected, atol=1e-5)
    np.testing.assert_allclose(decrypt_vector(total, client_ctx), [111.0, 222.0], atol=1e-5)
    np.testing.assert_allclose(decrypt_vector(again, client_ctx), [111.0, 222.0], atol=1e-5)
    single = sum_vectors([a], server_ctx)
    assert single.summands == 1
    np.testing.assert_allclose(decrypt_vector(single, client_ctx), [1.0, 2.0], atol=1e-5)


def test_in_memory_vector_with_missing_chunks_is_refused(client_ctx, server_ctx) -> None:
    a = encrypt_vector(np.zeros(5000), client_ctx)
    short = CKKSCiphertext(a.fingerprint, a.length, 1, a.chunks[:1])
    with pytest.raises(ShapeMismatchError, match="holds 1 chunks; expected 2"):
        sum_vectors([a, short], server_ctx)
    with pytest.raises(ShapeMismatchError):
        decrypt_vector(short, client_ctx)


def test_client_decrypts_objects_parsed_under_the_server_context(client_ctx, server_ctx) -> None:
    """In-process simulations pass objects around: a vector linked to the public context still
    decrypts with the client's context."""
    on_server = CKKSCiphertext.from_bytes(encrypt_vector([1.5, -2.5], client_ctx).to_bytes(), server_ctx)
    total = sum_vectors([on_server, on_server], server_ctx)
    np.testing.assert_allclose(decrypt_vector(total, client_ctx), [3.0, -5.0], atol=sum_error_bound(2))


@settings(max_examples=20, deadline=None, suppress_health_check=FIXTURE_OK)
@given(position=st.integers(0, 10**9), flip=st.integers(1, 255))
def test_random_byte_flip_is_refused_or_decrypts_within_reach(client_ctx, server_ctx, position, flip) -> None:
    """A flipped byte is refused with a typed error, or (CKKS is unauthenticated) yields a value;
    it never raises anything but a SecAggError."""
    from secagg.errors import SecAggError

    x = np.linspace(-1, 1, 100)
    blob = bytearray(encrypt_vector(x, client_ctx).to_bytes())
    blob[position % len(blob)] ^= flip
    try:
        got = decrypt_vector(CKKSCiphertext.from_bytes(bytes(blob), server_ctx), client_ctx)
    except SecAggError:
        return
    assert got.shape == x.shape


def test_limit_ckks_ciphertexts_are_unauthenticated(client_ctx, server_ctx) -> None:
    """Stated limit: some byte flips in a CKKS ciphertext parse and decrypt to garbage, silently
    (about half of them, measured); uploads must travel over the authenticated channel."""
    x = np.linspace(-1, 1, 100)
    blob = encrypt_vector(x, client_ctx).to_bytes()
    silent = 0
    for pos in range(100, len(blob), len(blob) // 40):
        tampered = bytearray(blob)
        tampered[pos] ^= 0x5A
        try:
            got = decrypt_vector(CKKSCiphertext.from_bytes(bytes(tampered), server_ctx), client_ctx)
        except CiphertextError:
            continue
        silent += int(np.max(np.abs(got - x)) > 1e-3)
    assert silent >= 1


def test_a_context_that_crashes_tenseal_is_refused_not_fatal() -> None:
    """Found by fuzzing: these 92 bytes parse, then SIGSEGV TenSEAL in process (see secagg.he.isolate).

    Without the child-process probe this test kills the pytest worker instead of failing.
    """
    crasher = (Path(__file__).parent / "data" / "ckks_context_segv.bin").read_bytes()
    with pytest.raises(CiphertextError, match="crashes TenSEAL's parser"):
        CKKSContext.from_bytes(crasher)


def test_the_probe_caches_good_contexts_and_reports_rejections(client_ctx) -> None:
    from secagg.he import isolate

    body = client_ctx._ctx.serialize(save_secret_key=False)
    isolate.probe_context(body, 20)
    assert hashlib.sha256((20).to_bytes(4, "big") + body).digest() in isolate._ok
    with pytest.raises(CiphertextError):
        isolate.probe_context(b"\x0a\x01garbage", 20)
