"""Known-answer vectors and properties of the secagg primitives."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg import prg, shamir
from secagg.additive import _additive_shares_from_seeds, additive_shares, reconstruct
from secagg.channel import _seal_with_nonce, associated_data, open_sealed, seal
from secagg.errors import AuthenticationError, MessageError
from secagg.keys import KeyPair, hkdf_sha256

H = bytes.fromhex


# --- PRG: NIST SP 800-38A F.5.5 CTR-AES256.Encrypt -------------------------------------------
NIST_KEY = H("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
NIST_CTR = H("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff")
NIST_PT = H(
    "6bc1bee22e409f96e93d7e117393172a" "ae2d8a571e03ac9c9eb76fac45af8e51"
    "30c81c46a35ce411e5fbc1191a0a52ef" "f69f2445df4f9b17ad2b417be66c3710"
)
NIST_CT = H(
    "601ec313775789a5b7a7f504bbf3d228" "f443e3ca4d62b59aca84e990cacaf5c5"
    "2b0930daa23de94ce87017ba2d84988d" "dfc9c58db67aada613c2dd08457941a6"
)


def test_prg_keystream_matches_nist_sp800_38a():
    ks = prg._keystream(NIST_KEY, NIST_CTR, 64)
    assert bytes(a ^ b for a, b in zip(ks, NIST_PT)) == NIST_CT


def test_prg_expand_is_keystream_as_le_uint64():
    out = prg.expand(NIST_KEY, 8, label=b"x")
    ks = prg._keystream(NIST_KEY, prg._counter_block(b"x"), 64)
    assert out.tolist() == np.frombuffer(ks, dtype="<u8").tolist()


def test_prg_labels_and_seeds_separate_streams_and_expand_into_adds():
    a, b = os.urandom(32), os.urandom(32)
    assert not np.array_equal(prg.expand(a, 16), prg.expand(a, 16, label=b"l"))
    assert not np.array_equal(prg.expand(a, 16), prg.expand(b, 16))
    acc = np.arange(1000, dtype=np.uint64)
    prg.expand_into(a, acc)
    prg.expand_into(a, acc, negate=True)
    assert acc.tolist() == list(range(1000))
    with pytest.raises(ValueError, match="32 bytes"):
        prg.expand(b"short", 3)


def test_prg_bits_are_balanced():
    words = prg.expand(os.urandom(32), 20000)
    bits = np.unpackbits(words.view(np.uint8))
    # 1.28M fair bits: mean 0.5 +- 5 sigma (sigma = 0.5/sqrt(N) ~ 4.4e-4)
    assert abs(bits.mean() - 0.5) < 5 * 0.5 / np.sqrt(bits.size)


# --- HKDF: RFC 5869 test case 1; X25519: RFC 7748 section 6.1 --------------------------------
def test_hkdf_rfc5869_case1():
    okm = hkdf_sha256(H("0b" * 22), salt=H("000102030405060708090a0b0c"), info=H("f0f1f2f3f4f5f6f7f8f9"), length=42)
    assert okm == H("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")


def test_x25519_rfc7748_and_agreement_symmetry():
    alice = KeyPair.from_private_bytes(H("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"))
    bob = KeyPair.from_private_bytes(H("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb"))
    assert alice.public_bytes == H("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    assert bob.public_bytes == H("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
    shared = H("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")
    assert alice.exchange(bob.public_bytes) == shared == bob.exchange(alice.public_bytes)
    assert alice.agree(bob.public_bytes, info=b"i") == bob.agree(alice.public_bytes, info=b"i")
    assert alice.agree(bob.public_bytes, info=b"i") == hkdf_sha256(shared, info=b"secagg/ka/v1i")
    assert alice.agree(bob.public_bytes, info=b"i") != alice.agree(bob.public_bytes, info=b"j")
    with pytest.raises(MessageError, match="low-order"):
        alice.exchange(bytes(32))
    with pytest.raises(MessageError, match="32 bytes"):
        alice.exchange(b"abc")
    a, b = KeyPair.generate(), KeyPair.generate()
    assert a.agree(b.public_bytes, info=b"") == b.agree(a.public_bytes, info=b"")


# --- AES-256-GCM: McGrew & Viega test cases 13, 14, 16 ---------------------------------------
@pytest.mark.parametrize(
    ("key", "iv", "pt", "aad", "ct_tag"),
    [
        ("00" * 32, "00" * 12, "", "", "530f8afbc74536b9a963b4f1c4cb738b"),
        ("00" * 32, "00" * 12, "00" * 16, "", "cea7403d4d606b6e074ec5d3baf39d18d0d1c8a799996bf0265b98b5d48ab919"),
        (
            "feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308",
            "cafebabefacedbaddecaf888",
            "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a721c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b39",
            "feedfacedeadbeeffeedfacedeadbeefabaddad2",
            "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662"
            "76fc6ece0f4e1768cddf8853bb2d551b",
        ),
    ],
)
def test_aes_gcm_known_answers(key, iv, pt, aad, ct_tag):
    blob = _seal_with_nonce(H(key), H(iv), H(pt), aad=H(aad))
    assert blob == H(iv) + H(ct_tag)
    assert open_sealed(H(key), blob, aad=H(aad)) == H(pt)


def test_channel_rejects_tamper_truncation_wrong_context():
    key = os.urandom(32)
    aad = associated_data(instance=b"I" * 16, round=3, sender=1, receiver=2, kind="share")
    blob = seal(key, b"hello", aad=aad)
    assert len(blob) == 5 + 28 and open_sealed(key, blob, aad=aad) == b"hello"
    bad = [
        (key, blob[:-1], aad),
        (key, blob[:10], aad),
        (key, bytes([blob[0] ^ 1]) + blob[1:], aad),
        (key, blob[:20] + bytes([blob[20] ^ 0x80]) + blob[21:], aad),
        (os.urandom(32), blob, aad),
        (key, blob, associated_data(instance=b"I" * 16, round=4, sender=1, receiver=2, kind="share")),
        (key, blob, associated_data(instance=b"I" * 16, round=3, sender=2, receiver=1, kind="share")),
        (key, blob, associated_data(instance=b"J" * 16, round=3, sender=1, receiver=2, kind="share")),
        (key, blob, associated_data(instance=b"I" * 16, round=3, sender=1, receiver=2, kind="other")),
    ]
    for k, b, a in bad:
        with pytest.raises(AuthenticationError, match="^authenticated decryption failed$"):
            open_sealed(k, b, aad=a)
    assert seal(key, b"x", aad=aad) != seal(key, b"x", aad=aad)  # fresh nonces


# --- additive sharing -----------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=20), st.integers(1, 8))
def test_additive_shares_sum_to_secret(values, n):
    x = np.array(values, dtype=np.uint64)
    shares = additive_shares(x, n)
    assert len(shares) == n
    assert reconstruct(shares).tolist() == x.tolist()


def test_additive_known_answer_and_hiding():
    seeds = [bytes([i]) * 32 for i in range(2)]
    x = np.array([5, 7], dtype=np.uint64)
    s = _additive_shares_from_seeds(x, seeds, 3)
    assert s[0].tolist() == prg.expand(seeds[0], 2, label=b"additive").tolist()
    assert reconstruct(s).tolist() == [5, 7]
    with pytest.raises(ValueError, match="uint64"):
        additive_shares(np.array([1.5]), 2)


# --- Shamir ------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=40), st.data())
def test_shamir_any_t_shares_reconstruct(secret, data):
    n = data.draw(st.integers(1, 20))
    t = data.draw(st.integers(1, n))
    shares = shamir.split_secret(secret, t=t, n=n)
    subset = data.draw(st.permutations(shares)).copy()[: data.draw(st.integers(t, n))]
    assert shamir.combine(subset, t=t) == secret
    if t > 1:
        with pytest.raises(ValueError, match="at least t"):
            shamir.combine(subset[: t - 1], t=t)


def test_shamir_t_minus_1_shares_are_uniform_and_independent_of_secret():
    # With t = 3, the pair of shares (x=1, x=2) of a fixed secret is uniform: check the limb mean.
    vals = shamir.split_many([bytes(32)] * 2000, t=3, xs=[1, 2, 3])[:2]  # (2, 2000, 11)
    u = vals.astype(np.float64) / shamir.PRIME
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.std() - np.sqrt(1 / 12)) < 0.01
    corr = np.corrcoef(u[0].ravel(), u[1].ravel())[0, 1]
    assert abs(corr) < 5 / np.sqrt(u[0].size)  # 5 standard errors of a null correlation (0.034 here)


def test_shamir_known_answer_core_and_batch():
    limbs = np.array([[7, 11]], dtype=np.uint64)
    coeffs = np.array([[[2, 3]]], dtype=np.uint64)  # f(x) = limb + c x
    vals = shamir._split_with_coefficients(limbs, coeffs, t=2, xs=[1, 2, 5])
    assert vals[:, 0, :].tolist() == [[9, 14], [11, 17], [17, 26]]
    rec = shamir.combine_batch(np.array([[2, 5], [1, 5]]), np.array([[[11, 17], [17, 26]], [[9, 14], [17, 26]]]))
    assert rec.tolist() == [[7, 11], [7, 11]]


def test_shamir_rejects_bad_input():
    with pytest.raises(ValueError, match="exceeds the number of shares"):
        shamir.split_secret(b"k", t=4, n=3)
    shares = shamir.split_secret(b"secret!", t=2, n=3)
    with pytest.raises(ValueError, match="bytes; found"):
        shamir.combine([(1, shares[0][1][:-1]), shares[1]], t=2)
    with pytest.raises(ValueError, match="share point"):
        shamir.combine([(0, shares[0][1]), shares[1]], t=2)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 300), st.integers(0, 6), st.sampled_from([2, 7, 64, 16384]))
def test_prg_accumulate_equals_sequential_expand_into(n, masks, block):
    items = [(os.urandom(32), b"self" if i % 2 else b"pair", bool(i % 3 == 0)) for i in range(masks)]
    a = np.arange(n, dtype=np.uint64)
    b = a.copy()
    for seed, label, neg in items:
        prg.expand_into(seed, a, label=label, negate=neg)
    prg.accumulate(b, items, block_words=block)
    assert a.tolist() == b.tolist()


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=80), st.binary(max_size=40), st.one_of(st.none(), st.binary(min_size=1, max_size=80)),
       st.integers(1, 200))
def test_hkdf_matches_cryptography_hkdf(ikm, info, salt, length):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    ref = HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)
    assert hkdf_sha256(ikm, info=info, salt=salt, length=length) == ref
