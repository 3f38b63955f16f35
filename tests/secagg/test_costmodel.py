"""The cost model counts exactly the cryptographic operations the SecAgg/SecAgg+ code performs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg import bonawitz, bonawitz_common, keys, prg, shamir
from secagg.costmodel import UnitCosts, instance_cost
from secagg.runner import RunSpec, run_secagg, run_secagg_plus

ONE = UnitCosts(aes_ctr_bps=1.0, gcm_bps=1.0, add_wps=1.0, sha256_bps=1.0, keygen_s=1.0, agree_s=1.0, sign_s=1.0,
                verify_s=1.0, prf_s=1.0)


def _counting(monkeypatch) -> Counter:
    """Count every key generation, agreement, signature, verification, Shamir split and mask the
    protocol code performs (clients and server together)."""
    seen: Counter = Counter()
    gen, agree, sign, verify, split, acc = (keys.KeyPair.generate, keys.KeyPair.agree, bonawitz.SigningKey.sign,
                                            bonawitz_common._verify, shamir.split_many, prg.accumulate)

    def counted(name, fn, masks=False):  # noqa: ANN001, ANN202
        def wrapper(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            seen[name] += 1
            if masks:
                seen["masks"] += len(a[1])
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(keys.KeyPair, "generate", classmethod(lambda cls: (seen.update(["keygen"]), gen())[1]))
    monkeypatch.setattr(keys.KeyPair, "agree", counted("agree", agree))
    monkeypatch.setattr(bonawitz.SigningKey, "sign", counted("sign", sign))
    monkeypatch.setattr(bonawitz_common, "_verify", counted("verify", verify))  # every check of both ends
    monkeypatch.setattr(bonawitz.shamir, "split_many", counted("split", split))
    monkeypatch.setattr(bonawitz.prg, "accumulate", counted("accumulate", acc, masks=True))
    return seen


@settings(max_examples=6, deadline=None)
@given(n=st.integers(4, 12), dim=st.integers(1, 40), plus=st.booleans())
def test_the_counts_match_what_the_code_does_without_dropouts(n, dim, plus) -> None:
    inputs = np.arange(n * dim, dtype=np.uint64).reshape(n, dim)
    with pytest.MonkeyPatch.context() as mp:
        seen = _counting(mp)
        res = (run_secagg_plus if plus else run_secagg)(inputs, RunSpec(dropout=0.0, corrupt=0.0))
    assert res.ok
    assert np.array_equal(res.total, inputs.sum(axis=0, dtype=np.uint64))
    k, t = res.k, res.t
    cost = instance_cost("secagg+" if plus else "secagg", n=n, dim=dim, k=k, t=t, survivors=len(res.survivors),
                         masks_expanded=res.masks_expanded, key_agreements=res.key_agreements,
                         signatures_verified=res.signatures_verified, units=ONE)
    # with every unit cost 1, a part of the bound is its operation count
    c, s = cost.client_parts, cost.server_parts
    assert seen["keygen"] == n * 2
    assert seen["agree"] == n * 2 * k + res.key_agreements
    assert c["public_key"] == 2 + 2 * k and s["public_key"] == res.key_agreements == 0
    assert seen["sign"] == n * 3
    assert seen["verify"] == n * (k + 1 + t) + res.signatures_verified
    assert c["signatures"] == 3 + (k + 1 + t) and s["signatures"] == res.signatures_verified
    assert seen["split"] == n
    assert seen["accumulate"] == n + 1
    assert seen["masks"] == n * (k + 1) + res.masks_expanded
    assert c["prg"] == (k + 1) * 8 * dim and s["prg"] == res.masks_expanded * 8 * dim


def test_the_server_prices_the_masks_of_dropped_clients() -> None:
    n, dim = 10, 16
    inputs = np.ones((n, dim), dtype=np.uint64)
    res = run_secagg(inputs, RunSpec(dropouts={"masked_input": frozenset({3, 7})}, dropout=0.2, corrupt=0.0))
    assert res.ok and len(res.survivors) == 8 and res.key_agreements == 2 * 8
    cost = instance_cost("secagg", n=n, dim=dim, k=res.k, t=res.t, survivors=8, masks_expanded=res.masks_expanded,
                         key_agreements=res.key_agreements, signatures_verified=res.signatures_verified, units=ONE)
    assert cost.server_parts["public_key"] == 16 and cost.server_parts["prg"] == (8 + 16) * 8 * dim


def test_unit_costs_are_measured_and_positive() -> None:
    u = UnitCosts.measure(buffer_mb=1, repeats=2)
    assert all(v > 0 for v in u.as_dict().values())
    assert u.shamir_split_s(5, 3) > 0 and u.shamir_combine_s(10, 3) > 0 and u.shamir_combine_s(0, 3) == 0


def test_an_unknown_protocol_has_no_cost_model() -> None:
    with pytest.raises(ValueError, match="no cost model"):
        instance_cost("pir", n=2, dim=1, k=None, t=None, survivors=2, masks_expanded=0, key_agreements=0,
                      signatures_verified=0, units=ONE)


def test_a_dpf_instance_costs_its_servers_aes_bytes() -> None:
    """The DPF's bound: evaluation bytes at the AES-128-ECB unit, dense seeds at the AES-256-CTR unit,
    nothing on the clients (their key generation is not priced: a floor)."""
    from dataclasses import replace

    units = replace(ONE, aes_ecb_bps=2.0, aes_ctr_bps=4.0)
    c = instance_cost("dpf", n=3, dim=10, k=None, t=None, survivors=3, masks_expanded=0, key_agreements=0,
                      signatures_verified=0, units=units, prg_bytes=6, dense_bytes=8, hashed_bytes=5)
    assert c.client_s == 0 and c.server_s == pytest.approx(6 / 2 + 8 / 4 + 5 / 1)


@settings(max_examples=5, deadline=None)
@given(n=st.integers(4, 10), dims=st.lists(st.integers(1, 30), min_size=2, max_size=3), plus=st.booleans())
def test_a_reused_setup_is_priced_once_and_its_instances_by_what_the_code_does(n, dims, plus) -> None:
    from secagg import reuse
    from secagg.reuse_sim import ReuseSession

    session = ReuseSession("secagg+" if plus else "secagg")
    with pytest.MonkeyPatch.context() as mp:
        seen = _counting(mp)
        seeds = reuse.pair_seed
        mp.setattr(reuse, "pair_seed", lambda *a: (seen.update(["prf"]), seeds(*a))[1])
        before = Counter()
        for i, dim in enumerate(dims):
            inputs = np.arange(n * dim, dtype=np.uint64).reshape(n, dim) + np.uint64(i)
            res = session.run(inputs, RunSpec(dropout=0.0, corrupt=0.0))
            assert res.ok and np.array_equal(res.total, inputs.sum(axis=0, dtype=np.uint64))
            k, t = res.k, res.t
            done = seen - before  # (before pricing: a first price measures a Shamir split)
            cost = instance_cost(res.protocol, n=n, dim=dim, k=k, t=t, survivors=len(res.survivors),
                                 masks_expanded=res.masks_expanded, key_agreements=res.key_agreements,
                                 signatures_verified=res.signatures_verified, units=ONE, reuse=True, setup=i == 0)
            c, s = cost.client_parts, cost.server_parts
            before = Counter(seen)
            assert done["keygen"] == (2 * n if i == 0 else 0) and done["agree"] == (2 * n * k if i == 0 else 0)
            assert c["public_key"] == (2 + 2 * k if i == 0 else 0) and s["public_key"] == 0
            assert done["sign"] == n * (3 if i == 0 else 2)
            assert done["verify"] == n * ((k + 1 if i == 0 else 0) + t) + res.signatures_verified
            assert c["signatures"] == (1 + k + 1 if i == 0 else 0) + 2 + t and s["signatures"] == res.signatures_verified
            assert done["split"] == n and done["prf"] == n * k and c["pair_seeds"] == k
            assert done["masks"] == n * (k + 1) + res.masks_expanded and c["prg"] == (k + 1) * 8 * dim
