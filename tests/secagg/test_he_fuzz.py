"""Fuzzing the HE decoders: random and mutated bytes raise only the framework's typed errors.

Every parser in :mod:`secagg.he` that reads bytes from another party (packed Paillier vectors,
Paillier keys and ciphertexts, CKKS vectors and contexts, the backends' public bundle) is fed
(a) random bytes and (b) a valid serialisation mutated by a sequence of byte flips, overwrites,
insertions, deletions, truncations and splices. The only acceptable outcomes are a
:class:`~secagg.he.errors.HEError` (a :class:`~secagg.errors.SecAggError`) or, for the packed
Paillier decoder, exactly the true values: never another exception, never a silently wrong sum.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg.he import HEError, InsecureKeySizeWarning, PackedCiphertext, PackingSpec, decrypt_packed, encrypt_packed
from secagg.he import sum_packed
from secagg.he.backends import HEServer, make_backend
from secagg.he.ckks import CKKSCiphertext, CKKSContext, CKKSParams, decrypt_vector, encrypt_vector
from secagg.he.paillier import PaillierCiphertext, PaillierKeyPair, PaillierPrivateKey, PaillierPublicKey, generate_keypair

FIXTURE_OK = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]


def _keypair() -> PaillierKeyPair:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeySizeWarning)
        return generate_keypair(1024)


@pytest.fixture(scope="module")
def kp() -> PaillierKeyPair:
    return _keypair()


@pytest.fixture(scope="module")
def packed(kp) -> tuple[bytes, np.ndarray, PackingSpec]:
    """A sum of 3 packed uploads (3 ciphertexts) and its true integer values."""
    spec = PackingSpec(value_bits=24, frac_bits=8, max_summands=16)
    rng = np.random.default_rng(9)  # CSPRNG-OK: test data
    ints = [rng.integers(-(2**20), 2**20, size=60) for _ in range(3)]
    total = sum_packed([encrypt_packed(v, kp.private_key, spec, integers=True) for v in ints], kp.public_key)
    return total.to_bytes(kp.public_key), np.sum(ints, axis=0), spec


@pytest.fixture(scope="module")
def ckks() -> tuple[CKKSContext, CKKSContext, bytes]:
    params = CKKSParams(poly_modulus_degree=4096, coeff_mod_bit_sizes=(40, 20, 40), scale_bits=20)
    client = CKKSContext.generate(params)
    server = CKKSContext.from_bytes(client.serialize())
    return client, server, encrypt_vector(np.linspace(-1, 1, 50), client).to_bytes()


@st.composite
def mutated(draw: st.DrawFn, blob: bytes) -> bytes:
    """``blob`` after 1-4 random edits (flip, overwrite, insert, delete, truncate, splice)."""
    out = bytearray(blob)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "overwrite", "insert", "delete", "truncate", "splice"]))
        pos = draw(st.integers(0, max(len(out) - 1, 0)))
        if op == "flip" and out:
            out[pos] ^= draw(st.integers(1, 255))
        elif op == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            out[pos : pos + len(chunk)] = chunk
        elif op == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del out[pos : pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del out[pos:]
        elif op == "splice" and out:  # move a block elsewhere (reordered ciphertexts)
            size = draw(st.integers(1, 64))
            block = out[pos : pos + size]
            del out[pos : pos + size]
            at = draw(st.integers(0, len(out)))
            out[at:at] = block
    return bytes(out)


def _bytes_or_mutation(blob: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=600), mutated(blob))


# -- packed Paillier vectors ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_packed_vector_decoder_raises_only_typed_errors_or_decodes_exactly(kp, packed, data) -> None:
    blob, truth, spec = packed
    fuzzed = data.draw(_bytes_or_mutation(blob), label="bytes")
    expect = data.draw(st.booleans(), label="receiver passes spec and length")
    try:
        parsed = PackedCiphertext.from_bytes(fuzzed, kp.public_key, **({"spec": spec, "length": 60} if expect else {}))
        got = decrypt_packed(parsed, kp.private_key, integers=True)
    except HEError:
        return
    np.testing.assert_array_equal(got, truth)  # only an edit that changes nothing may pass


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_server_side_addition_raises_only_typed_errors(kp, packed, data) -> None:
    """The server parses and adds what it receives: a fuzzed upload never crashes it."""
    blob, _, spec = packed
    fuzzed = data.draw(_bytes_or_mutation(blob))
    try:
        sum_packed([PackedCiphertext.from_bytes(blob, kp.public_key), PackedCiphertext.from_bytes(fuzzed, kp.public_key)],
                   kp.public_key)
    except HEError:
        pass


# -- Paillier keys and single ciphertexts --------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_public_key_parser_raises_only_typed_errors(kp, data) -> None:
    fuzzed = data.draw(_bytes_or_mutation(kp.public_key.to_bytes()))
    try:
        key = PaillierPublicKey.from_bytes(fuzzed)
    except HEError:
        return
    assert key.n % 2 == 1 and key.bits >= 1024  # whatever parses is a usable modulus


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_secret_key_parser_raises_only_typed_errors(kp, data) -> None:
    secret = kp.serialize(save_secret_key=True)
    prefix = secret[:12]
    # Also small and degenerate factors behind a well-formed header (p = 0, 1, 2, 4 ...).
    small = st.tuples(st.integers(0, 2**16 - 1), st.integers(0, 2**16 - 1)).map(
        lambda pq: b"".join([prefix[:4], (2).to_bytes(4, "big"), (2).to_bytes(4, "big"),
                             pq[0].to_bytes(2, "big"), pq[1].to_bytes(2, "big")])
    )
    fuzzed = data.draw(st.one_of(_bytes_or_mutation(secret), small))
    try:
        key = PaillierPrivateKey.from_secret_bytes(fuzzed)
    except HEError:
        return
    assert key.public_key.bits >= 1024


@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_single_ciphertext_parser_raises_only_typed_errors(kp, data) -> None:
    blob = kp.public_key.encrypt_int(12345).to_bytes(kp.public_key)
    fuzzed = data.draw(_bytes_or_mutation(blob))
    try:
        ct = PaillierCiphertext.from_bytes(fuzzed, kp.public_key)
    except HEError:
        return
    kp.private_key.decrypt_int(ct)  # any parsed value is a valid ciphertext: decryption succeeds


# -- CKKS ------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_ckks_vector_parser_raises_only_typed_errors(ckks, data) -> None:
    """CKKS ciphertexts are unauthenticated (a stated limit): a mutation may decrypt to garbage,
    but parsing and decryption never raise anything but HEError."""
    client, server, blob = ckks
    fuzzed = data.draw(_bytes_or_mutation(blob))
    try:
        vec = CKKSCiphertext.from_bytes(fuzzed, server)
        out = decrypt_vector(vec, client)
    except HEError:
        return
    assert out.shape == (vec.length,)


@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_ckks_context_parser_raises_only_typed_errors(ckks, data) -> None:
    client, _, _ = ckks
    public = client.serialize()
    fuzzed = data.draw(st.one_of(st.binary(max_size=600), mutated(public[:400]), mutated(public)))
    try:
        ctx = CKKSContext.from_bytes(fuzzed)
    except HEError:
        return
    assert not ctx.is_private


# -- the backends' public bundle -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def paillier_backend():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeySizeWarning)
        return make_backend("paillier", key_bits=1024, spec=PackingSpec(value_bits=24, frac_bits=8, max_summands=8))


@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_server_built_from_fuzzed_public_bytes_raises_only_typed_errors(paillier_backend, data) -> None:
    upload = paillier_backend.encrypt(np.ones(5))
    fuzzed = data.draw(_bytes_or_mutation(paillier_backend.public_bytes))
    try:
        HEServer("paillier", fuzzed).add([upload], 5)
    except HEError:
        pass
