"""Paillier core: key generation, encryption paths, CRT decryption, key binding, validation.

Oracle: python-paillier (``phe``), which uses the same ``g = n + 1`` scheme, so ciphertexts
interoperate exactly when built from the same ``(p, q)`` and the same ``r``.
"""

from __future__ import annotations

import warnings

import gmpy2
import numpy as np
import phe
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg.errors import BudgetError, MessageError, SecAggError
from secagg.he import (
    CiphertextError,
    HEError,
    InsecureKeySizeWarning,
    KeyMismatchError,
    PaillierCiphertext,
    PaillierKeyPair,
    PaillierPrivateKey,
    PaillierPublicKey,
    PlaintextOverflowError,
    generate_keypair,
)
from secagg.he.paillier import _generate_keypair_from


def _keypair(bits: int) -> PaillierKeyPair:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeySizeWarning)
        return generate_keypair(bits)


@pytest.fixture(scope="module")
def kp1024() -> PaillierKeyPair:
    return _keypair(1024)


@pytest.fixture(scope="module")
def kp2048() -> PaillierKeyPair:
    return _keypair(2048)


@pytest.fixture(scope="module")
def other1024() -> PaillierKeyPair:
    return _keypair(1024)


def _phe_keys(kp: PaillierKeyPair) -> tuple[phe.PaillierPublicKey, phe.PaillierPrivateKey]:
    ppk = phe.PaillierPublicKey(int(kp.public_key.n))
    return ppk, phe.PaillierPrivateKey(ppk, int(kp.private_key._p), int(kp.private_key._q))


# -- key generation --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1024, 2048])
def test_keygen_exact_size_and_prime_factors(bits: int, kp1024, kp2048) -> None:
    kp = kp1024 if bits == 1024 else kp2048
    n = kp.public_key.n
    p, q = kp.private_key._p, kp.private_key._q
    assert n.bit_length() == bits
    assert p * q == n and p != q
    assert p.bit_length() == q.bit_length() == bits // 2
    assert gmpy2.is_prime(p, 50) and gmpy2.is_prime(q, 50)
    assert gmpy2.gcd(n, (p - 1) * (q - 1)) == 1


def test_1024_warns_2048_does_not() -> None:
    with pytest.warns(InsecureKeySizeWarning, match="1024-bit"):
        generate_keypair(1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate_keypair(2048)


@pytest.mark.parametrize("bits", [512, 1000, 1023, 0, -2048, True, 2048.0, "2048"])
def test_keygen_refuses_bad_sizes(bits) -> None:
    with pytest.raises(HEError, match="at least 1024"):
        generate_keypair(bits)


def test_keygen_core_is_deterministic_in_its_bit_source() -> None:
    def source(seed: int):
        rng = np.random.default_rng(seed)  # CSPRNG-OK: test-only reproducible bit source
        return lambda k: int.from_bytes(rng.bytes((k + 7) // 8), "big") >> (-k % 8)

    a = _generate_keypair_from(1024, source(7))
    b = _generate_keypair_from(1024, source(7))
    c = _generate_keypair_from(1024, source(8))
    assert a.public_key == b.public_key
    assert a.public_key != c.public_key


def test_two_keys_differ_and_have_distinct_fingerprints(kp1024, other1024) -> None:
    assert kp1024.public_key.n != other1024.public_key.n
    assert kp1024.public_key.fingerprint != other1024.public_key.fingerprint
    assert len(kp1024.public_key.fingerprint) == 16


def test_public_key_refuses_small_or_even_modulus() -> None:
    with pytest.raises(HEError, match="at least 1024"):
        PaillierPublicKey(gmpy2.mpz(3 * 5))
    with pytest.raises(HEError, match="even"):
        PaillierPublicKey(gmpy2.mpz(1) << 1100)


def test_private_key_refuses_wrong_factors(kp1024, other1024) -> None:
    with pytest.raises(HEError, match="do not match"):
        PaillierPrivateKey(kp1024.public_key, other1024.private_key._p, kp1024.private_key._q)


# -- known answers against phe ---------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(m=st.integers(min_value=0), data=st.data())
def test_encryption_cores_match_phe_raw_encrypt(kp1024, m: int, data) -> None:
    pk, sk = kp1024.public_key, kp1024.private_key
    m = m % int(pk.n)
    r = data.draw(st.integers(min_value=1, max_value=int(pk.n) - 1))
    if gmpy2.gcd(r, pk.n) != 1:  # pragma: no cover - probability ~2^-511
        return
    ppk, _ = _phe_keys(kp1024)
    expected = ppk.raw_encrypt(m, r_value=r)
    assert int(pk._encrypt_int_with_r(m, r)) == expected
    assert int(sk._encrypt_int_with_r(m, r)) == expected


@settings(max_examples=25, deadline=None)
@given(m=st.integers(min_value=0))
def test_phe_decrypts_ours_and_we_decrypt_phe(kp1024, m: int) -> None:
    pk, sk = kp1024.public_key, kp1024.private_key
    m = m % int(pk.n)
    ppk, psk = _phe_keys(kp1024)
    assert psk.raw_decrypt(int(pk.encrypt_int(m).value)) == m
    assert psk.raw_decrypt(int(sk.encrypt_int(m).value)) == m
    theirs = PaillierCiphertext(pk.fingerprint, gmpy2.mpz(ppk.raw_encrypt(m)))
    assert sk.decrypt_int(theirs) == m


@settings(max_examples=20, deadline=None)
@given(a=st.integers(min_value=0), b=st.integers(min_value=0))
def test_homomorphic_add_matches_phe_and_plaintext(kp1024, a: int, b: int) -> None:
    pk, sk = kp1024.public_key, kp1024.private_key
    n = int(pk.n)
    a, b = a % n, b % n
    ca, cb = sk.encrypt_int(a), pk.encrypt_int(b)
    total = pk.add(ca, cb)
    assert sk.decrypt_int(total) == (a + b) % n
    ppk, _ = _phe_keys(kp1024)
    phe_sum = phe.EncryptedNumber(ppk, int(ca.value)) + phe.EncryptedNumber(ppk, int(cb.value))
    assert phe_sum.ciphertext(be_secure=False) == int(total.value)


def test_crt_obfuscator_is_an_encryption_of_zero(kp1024) -> None:
    sk = kp1024.private_key
    _, psk = _phe_keys(kp1024)
    for _ in range(5):
        x = sk._obfuscator_from_parts(*sk.random_parts())
        assert psk.raw_decrypt(int(x)) == 0


def test_encryption_is_randomised(kp1024) -> None:
    pk, sk = kp1024.public_key, kp1024.private_key
    values = {int(pk.encrypt_int(42).value) for _ in range(4)} | {int(sk.encrypt_int(42).value) for _ in range(4)}
    assert len(values) == 8
    assert all(sk.decrypt_int(PaillierCiphertext(pk.fingerprint, gmpy2.mpz(v))) == 42 for v in values)


def test_2048_round_trip_both_paths(kp2048) -> None:
    pk, sk = kp2048.public_key, kp2048.private_key
    m = int(pk.n) - 1
    assert sk.decrypt_int(pk.encrypt_int(m)) == m
    assert sk.decrypt_int(pk.add(sk.encrypt_int(5), pk.encrypt_int(7))) == 12
    _, psk = _phe_keys(kp2048)
    assert psk.raw_decrypt(int(sk.encrypt_int(123456789).value)) == 123456789


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [-1, "n", "n+1"])
def test_plaintext_out_of_range_is_refused(kp1024, m) -> None:
    pk = kp1024.public_key
    value = {"n": int(pk.n), "n+1": int(pk.n) + 1}.get(m, m)
    for key in (pk, kp1024.private_key):
        with pytest.raises(PlaintextOverflowError, match=r"\[0, n\)"):
            key.encrypt_int(value)


def test_non_int_plaintext_is_refused(kp1024) -> None:
    with pytest.raises(TypeError, match="int"):
        kp1024.public_key.encrypt_int(1.5)
    with pytest.raises(TypeError, match="int"):
        kp1024.public_key.encrypt_int(True)


def test_ciphertext_from_another_key_is_refused(kp1024, other1024) -> None:
    ct = other1024.public_key.encrypt_int(5)
    with pytest.raises(KeyMismatchError, match="another"):
        kp1024.private_key.decrypt_int(ct)
    with pytest.raises(KeyMismatchError):
        kp1024.public_key.add(kp1024.public_key.encrypt_int(1), ct)
    blob = ct.to_bytes(other1024.public_key)
    with pytest.raises(KeyMismatchError):
        PaillierCiphertext.from_bytes(blob, kp1024.public_key)


def test_ciphertext_relabelled_with_our_fingerprint_is_caught_by_range_or_garbage(kp1024, other1024) -> None:
    """Forging the fingerprint does not make a foreign ciphertext decrypt to its plaintext."""
    foreign = other1024.public_key.encrypt_int(5)
    forged = PaillierCiphertext(kp1024.public_key.fingerprint, foreign.value)
    try:
        assert kp1024.private_key.decrypt_int(forged) != 5
    except CiphertextError:
        pass


@pytest.mark.parametrize("which", ["zero", "nsquare", "above", "multiple_of_p"])
def test_invalid_ciphertext_values_are_refused(kp1024, which: str) -> None:
    pk, sk = kp1024.public_key, kp1024.private_key
    value = {
        "zero": gmpy2.mpz(0),
        "nsquare": pk.nsquare,
        "above": pk.nsquare + 12345,
        "multiple_of_p": sk._p * 7,
    }[which]
    with pytest.raises(CiphertextError):
        sk.decrypt_int(PaillierCiphertext(pk.fingerprint, value))
    with pytest.raises(CiphertextError):
        pk.validate_value(value)


def test_errors_are_secagg_errors_of_the_right_kind() -> None:
    assert issubclass(CiphertextError, MessageError)
    assert issubclass(KeyMismatchError, MessageError)
    assert issubclass(PlaintextOverflowError, BudgetError)
    assert issubclass(PlaintextOverflowError, ValueError)
    assert issubclass(HEError, SecAggError)


def test_ciphertext_bytes_round_trip_constant_size(kp1024) -> None:
    pk, sk = kp1024.public_key, kp1024.private_key
    blobs = [pk.encrypt_int(m).to_bytes(pk) for m in (0, 1, int(pk.n) - 1)]
    assert len({len(b) for b in blobs}) == 1
    assert len(blobs[0]) == 4 + 16 + 256
    assert [sk.decrypt_int(PaillierCiphertext.from_bytes(b, pk)) for b in blobs] == [0, 1, int(pk.n) - 1]


@pytest.mark.parametrize("mutation", ["truncate", "extend", "magic", "value_zero", "value_over"])
def test_malformed_ciphertext_bytes_are_refused(kp1024, mutation: str) -> None:
    pk = kp1024.public_key
    blob = bytearray(pk.encrypt_int(9).to_bytes(pk))
    if mutation == "truncate":
        blob = blob[:-1]
    elif mutation == "extend":
        blob += b"\x00"
    elif mutation == "magic":
        blob[0] ^= 1
    elif mutation == "value_zero":
        blob[20:] = bytes(len(blob) - 20)
    else:
        blob[20:] = b"\xff" * (len(blob) - 20)
    with pytest.raises(CiphertextError):
        PaillierCiphertext.from_bytes(bytes(blob), pk)


# -- key serialization and the key model -------------------------------------------------------------


def test_serialization_omits_the_secret_key_by_default(kp1024) -> None:
    blob = kp1024.serialize()
    assert blob == kp1024.public_key.to_bytes()
    for factor in (kp1024.private_key._p, kp1024.private_key._q):
        assert int(factor).to_bytes(64, "big") not in blob
    assert PaillierPublicKey.from_bytes(blob) == kp1024.public_key
    assert "secret" in repr(kp1024.private_key) and str(int(kp1024.private_key._p)) not in repr(kp1024)


def test_secret_key_serializes_only_when_asked(kp1024) -> None:
    blob = kp1024.serialize(save_secret_key=True)
    restored = PaillierPrivateKey.from_secret_bytes(blob)
    assert restored.public_key == kp1024.public_key
    assert restored.decrypt_int(kp1024.public_key.encrypt_int(77)) == 77


@pytest.mark.parametrize("cut", [0, 3, 8, -1])
def test_public_key_bytes_malformed(kp1024, cut: int) -> None:
    blob = kp1024.public_key.to_bytes()
    with pytest.raises(CiphertextError):
        PaillierPublicKey.from_bytes(blob[:cut] if cut else b"XXXX" + blob[4:])


def test_limit_shared_key_lets_any_client_decrypt_any_upload(kp1024) -> None:
    """Stated limit: FedMF's clients share one key pair, so client B reads client A's upload."""
    client_a_key = kp1024.private_key
    client_b_key = PaillierPrivateKey.from_secret_bytes(kp1024.serialize(save_secret_key=True))
    upload_of_a = client_a_key.encrypt_int(31337)
    assert client_b_key.decrypt_int(upload_of_a) == 31337


def test_limit_malleability_server_adds_undetected_offset(kp1024) -> None:
    """Stated limit: the public-key holder can shift a plaintext and decryption cannot tell."""
    pk, sk = kp1024.public_key, kp1024.private_key
    upload = sk.encrypt_int(1000)
    tampered = pk.add(upload, pk.encrypt_int(5))
    assert sk.decrypt_int(tampered) == 1005


# -- offline/online encryption ---------------------------------------------------------------------


@pytest.mark.parametrize("holder", ["private", "public"])
def test_pool_entries_are_distinct_single_use_encryptions_of_zero(kp1024, holder: str) -> None:
    from secagg.he import ObfuscatorPool

    key = kp1024.private_key if holder == "private" else kp1024.public_key
    pool = ObfuscatorPool(key)
    pool.refill(6)
    assert len(pool) == 6
    _, psk = _phe_keys(kp1024)
    entries = [pool.take() for _ in range(6)]
    assert len(pool) == 0 and len({int(e) for e in entries}) == 6
    assert all(psk.raw_decrypt(int(e)) == 0 for e in entries)
    # Empty pool: fresh randomness on the spot, still correct and still fresh.
    a, b = pool.encrypt_int(99), pool.encrypt_int(99)
    assert a.value != b.value
    assert kp1024.private_key.decrypt_int(a) == kp1024.private_key.decrypt_int(b) == 99


def test_pool_online_encryption_matches_plaintext_and_phe(kp1024) -> None:
    from secagg.he import ObfuscatorPool, PackingSpec, decrypt_packed, encrypt_packed

    pool = ObfuscatorPool(kp1024.private_key)
    pool.refill(3)
    x = np.linspace(-2.0, 2.0, 60)
    ct = encrypt_packed(x, kp1024.public_key, PackingSpec(), pool=pool)
    assert len(pool) == 0  # 60 values / 23 slots = 3 ciphertexts, each entry used once
    np.testing.assert_allclose(decrypt_packed(ct, kp1024.private_key), x, atol=2.0**-17)
    _, psk = _phe_keys(kp1024)
    assert all(0 <= psk.raw_decrypt(int(v)) < 2 ** (23 * 42) for v in ct.values)


def test_pool_for_another_key_is_refused(kp1024, other1024) -> None:
    from secagg.he import ObfuscatorPool, encrypt_packed

    pool = ObfuscatorPool(other1024.private_key)
    with pytest.raises(KeyMismatchError, match="another key"):
        encrypt_packed([1.0], kp1024.public_key, pool=pool)
    with pytest.raises(HEError, match="non-negative"):
        pool.refill(-1)
