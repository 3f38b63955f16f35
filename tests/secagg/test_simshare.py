"""Shared simulation work (secagg.simshare) gives exactly what each device's own code path gives."""

from __future__ import annotations

import os

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg import simshare
from secagg.bonawitz import _verify
from secagg.errors import MessageError
from secagg.keys import KeyPair
from secagg.runner import RunSpec, run_secagg, run_secagg_plus

# a low-order X25519 point (the all-zero u-coordinate): every exchange with it is refused
LOW_ORDER = bytes(32)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(3, 14), dim=st.integers(1, 30), plus=st.booleans(), data=st.data())
def test_a_run_with_shared_work_equals_one_where_every_client_works_alone(n, dim, plus, data) -> None:
    inputs = np.frombuffer(os.urandom(8 * n * dim), dtype=np.uint64).reshape(n, dim)
    drop = frozenset(data.draw(st.sets(st.integers(0, n - 1), max_size=max(0, (n - 3) // 3))))
    runner = run_secagg_plus if plus else run_secagg
    spec = dict(dropouts={"masked_input": drop} if drop else {}, dropout=len(drop) / n + 0.01, corrupt=0.0)
    alone = runner(inputs, RunSpec(shared_work=False, **spec))
    shared = runner(inputs, RunSpec(shared_work=True, **spec))
    assert alone.ok == shared.ok
    if alone.ok:
        keep = sorted(set(range(n)) - drop)
        expect = inputs[keep].sum(axis=0, dtype=np.uint64)
        assert np.array_equal(alone.total, expect) and np.array_equal(shared.total, expect)
        assert shared.survivors == alone.survivors
        # the server's own work is never shared (SecAgg+ draws a fresh graph per run, so only the
        # complete graph fixes which neighbours of the dropped clients survive)
        assert shared.signatures_verified == alone.signatures_verified
        if not plus:
            assert shared.key_agreements == alone.key_agreements


def test_every_pair_agrees_once_and_every_broadcast_is_verified_once() -> None:
    n = 12
    inputs = np.ones((n, 5), dtype=np.uint64)
    seen = {}
    real = simshare.shared_work

    def spy(enabled=True):  # noqa: ANN001, ANN202
        ctx = real(enabled)
        memo = ctx.__enter__()
        seen["memo"] = memo

        class Wrap:
            def __enter__(self):  # noqa: ANN204
                return memo

            def __exit__(self, *exc):  # noqa: ANN002, ANN204
                seen.update(agree_hits=memo.agree_hits, verify_hits=memo.verify_hits)
                return ctx.__exit__(*exc)
        return Wrap()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(simshare, "shared_work", spy)
        res = run_secagg(inputs, RunSpec(dropout=0.0, corrupt=0.0))
    assert res.ok
    k = n - 1
    # both ends of each of the n k / 2 pairs, for two keys each: the second end hits
    assert seen["agree_hits"] == n * k
    # every client checks k + 1 adverts and t consistency signatures that the server checked first
    assert seen["verify_hits"] == n * (k + 1 + res.t)


@settings(max_examples=30, deadline=None)
@given(msg=st.binary(min_size=1, max_size=64), flip=st.integers(0, 63 * 8), part=st.sampled_from(["sig", "msg", "key"]))
def test_a_memoised_verification_never_accepts_a_tampered_triple(msg, flip, part) -> None:
    sk = Ed25519PrivateKey.generate()
    other = Ed25519PrivateKey.generate()
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    pki = {0: sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
           1: other.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)}
    sig = sk.sign(msg)
    with simshare.shared_work() as memo:
        assert _verify(pki, 0, sig, msg)  # cached as valid
        if part == "sig":
            bad = bytearray(sig)
            bad[(flip // 8) % len(bad)] ^= 1 << (flip % 8)
            args = (0, bytes(bad), msg)
        elif part == "msg":
            bad = bytearray(msg)
            bad[(flip // 8) % len(bad)] ^= 1 << (flip % 8)
            args = (0, sig, bytes(bad))
        else:
            args = (1, sig, msg)  # someone else's key
        fresh = _verify(pki, *args)
        assert fresh is False
        assert _verify(pki, *args) is False and memo.verify_hits == 1  # the repeat of the bad triple hits
        assert _verify(pki, 0, sig, msg) and _verify(pki, 7, sig, msg) is False


def test_both_ends_get_the_key_their_own_computation_gives_and_a_bad_key_is_never_stored() -> None:
    a, b, c = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    own = a.agree(b.public_bytes, info=b"x")
    assert own == b.agree(a.public_bytes, info=b"x")
    with simshare.shared_work() as memo:
        assert a.agree(b.public_bytes, info=b"x") == own
        assert b.agree(a.public_bytes, info=b"x") == own and memo.agree_hits == 1
        assert a.agree(b.public_bytes, info=b"y") != own  # the label is part of the key
        assert c.agree(b.public_bytes, info=b"x") != own  # a third party never reads the pair's key
        for _ in range(2):
            with pytest.raises(MessageError, match="low-order"):
                a.agree(LOW_ORDER, info=b"x")
        assert not any(LOW_ORDER in key for key in memo.agreed)
        # the server's own agreements never read the memo
        hits = memo.agree_hits
        assert a.agree(b.public_bytes, info=b"x", shared=False) == own and memo.agree_hits == hits
    assert simshare.active() is None and not memo.agreed and not memo.verified


def test_disabled_turns_every_shared_block_off() -> None:
    with simshare.disabled():
        with simshare.shared_work() as memo:
            assert memo is None and simshare.active() is None
    with simshare.shared_work() as memo:
        assert memo is not None and simshare.active() is memo
