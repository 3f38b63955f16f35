"""FedMF protocol: the aggregate is the sum of the client updates under every defense; bad input is refused."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from protocols.fedmf import FedMF, FedMFConfig, Upload, UpdateError
from recmodels.mf import MFConfig, local_updates
from recmodels.synthetic import generate_synthetic
from secagg.errors import SecAggError
from secagg.he.backends import make_backend
from secagg.he.errors import KeyMismatchError, PlaintextOverflowError

DATA = generate_synthetic(n_users=6, n_items=12, dim=3, mean_interactions=4, seed=1)


def _model(defense="none", variant="full", data=DATA, **kw) -> FedMF:
    cfg = FedMFConfig(mf=MFConfig(dim=3), defense=defense, variant=variant, rounds=2, **kw)
    return FedMF(data, cfg, seed=0)


def _plain_next_q(m: FedMF) -> np.ndarray:
    """Oracle: plaintext Q + sum of every client's update."""
    _, delta = local_updates(m.p, m.item_matrix, m.lists, m.config.mf)
    q = m.item_matrix.copy()
    for u in range(m.n_users):
        k = m.lists.counts[u]
        q[m.lists.items[u, :k]] += delta[u, :k]
    return q


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), n_users=st.integers(2, 6), n_items=st.integers(6, 14),
       variant=st.sampled_from(["full", "part"]), mode=st.sampled_from(["sequential", "batch"]))
def test_plaintext_aggregate_is_the_sum_of_client_updates(seed, n_users, n_items, variant, mode):
    data = generate_synthetic(n_users=n_users, n_items=n_items, dim=3, mean_interactions=3, seed=seed)
    m = FedMF(data, FedMFConfig(mf=MFConfig(dim=3, user_update=mode), variant=variant), seed=seed)
    expected = _plain_next_q(m)
    m.run_round()
    np.testing.assert_allclose(m.item_matrix, expected, rtol=0, atol=1e-12)


# Stated error of each defense on one round: Paillier and secagg are exact on the 2^-24 grid
# (one rounding per upload), CKKS within its sum bound (< 1e-6 per value here).
TOL = {"paillier": 6 * 2.0**-24, "secagg": 6 * 2.0**-24, "ckks": 1e-5}


@settings(max_examples=4, deadline=None)
@given(defense=st.sampled_from(["paillier", "ckks", "secagg"]), variant=st.sampled_from(["full", "part"]),
       seed=st.integers(0, 100))
def test_defended_update_equals_plaintext_within_the_defense_error(defense, variant, seed):
    data = generate_synthetic(n_users=3, n_items=8, dim=3, mean_interactions=3, seed=seed)
    m = FedMF(data, FedMFConfig(mf=MFConfig(dim=3), defense=defense, variant=variant), seed=seed)
    expected = _plain_next_q(m)
    m.run_round()
    np.testing.assert_allclose(m.item_matrix, expected, rtol=0, atol=TOL[defense])


def test_ldp_adds_noise_but_keeps_shapes():
    m = _model("ldp", epsilon=1.0)
    expected = _plain_next_q(m)
    m.run_round()
    assert np.abs(m.item_matrix - expected).max() > 1e-3


def test_part_variant_reveals_rated_ids_even_under_paillier():
    m = _model("paillier", "part")
    m.run_round()
    ups = [r.payload for r in m.transport.transcript.view("server", kind="update")]
    assert all(isinstance(u.body, tuple) and all(isinstance(b, bytes) for b in u.body) for u in ups)
    for up in ups:
        np.testing.assert_array_equal(up.items, m.lists.items[up.user, : m.lists.counts[up.user]])


def _uploads(m: FedMF) -> list[Upload]:
    _, delta = local_updates(m.p, m.item_matrix, m.lists, m.config.mf)
    return [m._client_upload(u, delta[u]) for u in range(m.n_users)]


@pytest.mark.parametrize("variant", ["full", "part"])
def test_bad_plaintext_updates_are_refused_and_never_folded_in(variant):
    m = _model("none", variant)
    ups = _uploads(m)
    bad = [
        dataclasses.replace(ups[0], round=5),                                  # wrong round
        dataclasses.replace(ups[0], user=99),                                  # unknown client
        dataclasses.replace(ups[0], body=np.full_like(ups[0].body, np.nan)),   # non-finite
        dataclasses.replace(ups[0], body=ups[0].body[:-1]),                    # truncated
    ]
    if variant == "part":
        bad.append(dataclasses.replace(ups[0], items=np.append(ups[0].items[:-1], 12)))  # item not asked about
        bad.append(dataclasses.replace(ups[0], items=ups[0].items[::-1].copy()))
    for b in bad:
        with pytest.raises(UpdateError):
            m.aggregate([b, *ups[1:]])
    with pytest.raises(UpdateError, match="replay"):
        m.aggregate([ups[0], ups[0]])
    q0 = m.item_matrix.copy()
    assert m.round == 0 and np.array_equal(m.item_matrix, q0)


def test_item_not_asked_about_names_it():
    m = _model("none", "part")
    up = _uploads(m)[0]
    with pytest.raises(UpdateError, match="not asked about"):
        m.aggregate([dataclasses.replace(up, items=np.array([3, 40]), body=np.zeros((2, 3)))])


@pytest.mark.parametrize("scheme", ["paillier", "ckks"])
def test_ciphertexts_from_another_key_are_refused(scheme):
    m = _model(scheme)
    ups = _uploads(m)
    other = make_backend(scheme)
    forged = dataclasses.replace(ups[1], body=other.encrypt(np.zeros(m.n_items * m.dim)))
    with pytest.raises(KeyMismatchError):
        m.aggregate([ups[0], forged, *ups[2:]])


def test_modified_paillier_ciphertext_is_refused():
    m = _model("paillier")
    ups = _uploads(m)
    blob = bytearray(ups[1].body)
    blob[len(blob) // 2] ^= 0x5A
    # the server cannot check values it cannot decrypt; the key-holding client that refreshes Enc(Q)
    # decrypts the sum, and the guard bits / slot ranges catch the change before Q is updated
    with pytest.raises(SecAggError):
        total = m.aggregate([ups[0], dataclasses.replace(ups[1], body=bytes(blob)), *ups[2:]])
        m._decrypt_model(total)
    assert m.round == 0


def test_overflowing_packed_plaintext_is_refused_before_encryption():
    m = _model("paillier")
    with pytest.raises(PlaintextOverflowError):
        m.he.encrypt(np.full(m.n_items * m.dim, 1e9))


def test_ckks_server_cannot_decrypt():
    m = _model("ckks")
    server = m.he.server()
    from secagg.he.ckks import CKKSCiphertext, CKKSContext, decrypt_vector

    ctx = CKKSContext.from_bytes(server.public_bytes)
    ct = CKKSCiphertext.from_bytes(m.he.encrypt(np.ones(4)), ctx, length=4)
    from secagg.he.errors import NoSecretKeyError

    with pytest.raises(NoSecretKeyError):
        decrypt_vector(ct, ctx)


def test_secagg_transcript_holds_masked_vectors_only():
    m = _model("secagg")
    m.run_round()
    # the secure sum records each masked vector as the server received it (protocols.secure_sum)
    ups = [r.payload for r in m.transport.transcript.view("server", kind="update")]
    assert len(ups) == m.n_users and all(u.dtype == np.uint64 for u in ups)
    # masked: the zero rows of the plaintext update (unrated items) are not zero on the wire
    assert all(np.count_nonzero(u == 0) < 3 for u in ups)


def test_config_is_validated():
    with pytest.raises(ValueError, match="defense"):
        FedMFConfig(defense="rot13")
    with pytest.raises(ValueError, match="variant"):
        FedMFConfig(variant="half")
