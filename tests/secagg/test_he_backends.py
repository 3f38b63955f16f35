"""The byte-level client/server interface over both schemes: same promise, same refusals."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg.errors import SecAggError
from secagg.he import (
    CiphertextError,
    HEError,
    InsecureKeySizeWarning,
    KeyMismatchError,
    PackingSpec,
    PlaintextOverflowError,
    ShapeMismatchError,
)
from secagg.he.backends import HEClient, HEServer, make_backend
from secagg.he.ckks import sum_error_bound

FIXTURE_OK = [HealthCheck.function_scoped_fixture]
SCHEMES = ("paillier", "ckks")


def _make(scheme: str) -> HEClient:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeySizeWarning)
        return make_backend(scheme, key_bits=1024, spec=PackingSpec(value_bits=40, frac_bits=24, max_summands=64))


@pytest.fixture(scope="module", params=SCHEMES)
def client(request) -> HEClient:
    return _make(request.param)


@pytest.fixture(scope="module")
def foreign() -> dict[str, HEClient]:
    return {s: _make(s) for s in SCHEMES}


def _tolerance(client: HEClient, summands: int) -> float:
    if client.scheme == "paillier":
        return summands * 2.0**-25 * (1 + 1e-9)
    return sum_error_bound(summands)


@settings(max_examples=8, deadline=None, suppress_health_check=FIXTURE_OK)
@given(length=st.integers(0, 300), summands=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_server_sum_decrypts_to_plaintext_sum(client: HEClient, length: int, summands: int, seed: int) -> None:
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test data
    xs = [rng.normal(scale=3.0, size=length) for _ in range(summands)]
    server = client.server()
    total = server.add([client.encrypt(x) for x in xs], length)
    got = client.decrypt(total, length)
    assert got.shape == (length,)
    if length:
        assert np.max(np.abs(got - np.sum(xs, axis=0))) <= _tolerance(client, summands)


def test_server_holds_no_secret_and_cannot_decrypt(client: HEClient) -> None:
    server = client.server()
    assert isinstance(server, HEServer) and not hasattr(server, "decrypt")
    assert client.secret_bytes not in server.public_bytes
    # A "client" built from the server's material alone cannot decrypt.
    impostor = HEClient(client.scheme, client.public_bytes, client.public_bytes)
    blob = client.encrypt([1.0, 2.0])
    with pytest.raises((SecAggError, HEError)):
        impostor.decrypt(blob, 2)


def test_foreign_key_upload_is_refused_and_sum_untouched(client: HEClient, foreign) -> None:
    other = foreign[client.scheme]
    good = client.encrypt([1.0, 2.0])
    bad = other.encrypt([1.0, 2.0])
    with pytest.raises(KeyMismatchError):
        client.server().add([good, bad], 2)
    np.testing.assert_allclose(client.decrypt(client.server().add([good], 2), 2), [1.0, 2.0], atol=1e-5)


@pytest.mark.parametrize("mutation", ["truncate", "extend", "garbage", "empty"])
def test_malformed_upload_is_refused(client: HEClient, mutation: str) -> None:
    blob = client.encrypt(np.arange(5.0))
    bad = {
        "truncate": blob[:-3],
        "extend": blob + b"\x01",
        "garbage": b"\x00" * len(blob),
        "empty": b"",
    }[mutation]
    with pytest.raises(CiphertextError):
        client.server().add([blob, bad], 5)


def test_upload_of_wrong_length_is_refused(client: HEClient) -> None:
    with pytest.raises(ShapeMismatchError):
        client.server().add([client.encrypt(np.ones(5)), client.encrypt(np.ones(6))], 5)
    with pytest.raises(ShapeMismatchError):
        client.decrypt(client.encrypt(np.ones(5)), 6)
    with pytest.raises(HEError):
        client.server().add([], 5)


def test_overflowing_value_is_refused_before_encryption(client: HEClient) -> None:
    with pytest.raises(PlaintextOverflowError):
        client.encrypt([0.0, 1e12])


def test_paillier_headroom_is_enforced_by_the_server(foreign) -> None:
    client = foreign["paillier"]
    blobs = [client.encrypt([1.0]) for _ in range(65)]
    with pytest.raises(PlaintextOverflowError, match="max_summands=64"):
        client.server().add(blobs, 1)
    assert client.decrypt(client.server().add(blobs[:64], 1), 1)[0] == 64.0


def test_unknown_scheme_and_1024_warning() -> None:
    with pytest.raises(HEError, match="unknown HE scheme"):
        make_backend("rsa")  # type: ignore[arg-type]
    with pytest.warns(InsecureKeySizeWarning):
        make_backend("paillier", key_bits=1024)


@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURE_OK)
@given(position=st.integers(0, 10**9), flip=st.integers(1, 255))
def test_any_flipped_byte_fails_only_with_typed_errors(client: HEClient, position: int, flip: int) -> None:
    """Whatever byte of an upload is flipped, the server and the client fail only with SecAggError;
    for packed Paillier a flip never yields a silently wrong sum."""
    x = np.linspace(-1.0, 1.0, 30)
    blob = bytearray(client.encrypt(x))
    blob[position % len(blob)] ^= flip
    try:
        got = client.decrypt(client.server().add([bytes(blob)], 30), 30)
    except SecAggError:
        return
    if client.scheme == "paillier":
        np.testing.assert_allclose(got, x, atol=2.0**-24)


def test_repr_never_shows_key_material(client: HEClient) -> None:
    assert len(repr(client)) < 100 and len(repr(client.server())) < 100
