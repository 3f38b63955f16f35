"""The circular chain in Z_2^32 when the bit budget allows (issue 25 item 5): the ring is chosen from
public parameters, travels in the upload (format 2), a wrong width is refused, and the sum is the
plaintext sum within the fixed-point quantisation, with dropouts."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg.chain import ChainConfig, ChainUpload, ChainUploadV2, Kind, message_size
from secagg.chain_sim import DROP_STAGES, Dropout, run_chain, simulate
from secagg.encoding import FixedPoint, check_budget, choose_ring_bits, sign_extend
from secagg.errors import BudgetError, MessageError
from secagg.messages import HEADER_BYTES
from secagg.runspec import RunSpec

SLOW = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _config(dim: int, ring_bits: int, s: int = 1) -> ChainConfig:
    return ChainConfig(instance=os.urandom(16), round=3, dim=dim, successors=s, ring_bits=ring_bits)


def _fits(n: int, clip: float, frac_bits: int, bits: int) -> bool:
    """Oracle: Python big ints, no shared code with secagg.encoding."""
    return n * math.ceil(clip * 2**frac_bits) < 2 ** (bits - 1)


@given(n=st.integers(1, 10**6), clip=st.floats(1e-3, 1e4), frac_bits=st.integers(0, 40))
def test_the_ring_is_32_bits_exactly_when_the_sum_provably_fits(n, clip, frac_bits):
    if not _fits(n, clip, frac_bits, 64) or clip * 2**frac_bits >= 2**62:
        with pytest.raises(BudgetError):
            choose_ring_bits(n_summands=n, clip=clip, frac_bits=frac_bits)
        return
    bits = choose_ring_bits(n_summands=n, clip=clip, frac_bits=frac_bits)
    assert bits == (32 if _fits(n, clip, frac_bits, 32) else 64)


@SLOW
@given(data=st.data(), n=st.integers(2, 7), dim=st.integers(1, 24), s=st.integers(1, 3),
       frac_bits=st.integers(0, 20), clip=st.sampled_from([0.5, 1.0, 3.0, 64.0]))
def test_32_bit_chain_sum_equals_the_plaintext_sum_with_dropouts(data, n, dim, s, frac_bits, clip):
    bits = choose_ring_bits(n_summands=n, clip=clip, frac_bits=frac_bits)
    fp = FixedPoint(frac_bits, clip)
    # adversarial values too: every input at +clip or -clip (the budget's worst case)
    extreme = data.draw(st.booleans())
    values = {}
    for c in range(n):
        if extreme:
            sign = data.draw(st.sampled_from([-1.0, 1.0]))
            values[c] = np.full(dim, sign * clip)
        else:
            values[c] = np.array(data.draw(st.lists(st.floats(-clip, clip), min_size=dim, max_size=dim)))
    drops = data.draw(st.dictionaries(st.integers(0, n - 1), st.sampled_from(DROP_STAGES), max_size=max(0, n - 2)))
    run = simulate(_config(dim, bits, s), {c: fp.encode(v, rounding="nearest") for c, v in values.items()},
                   dropouts={c: Dropout(stage, None) for c, stage in drops.items()})
    if run.abort is not None:  # an unlock-stage dropout may abort the round; no sum then
        assert run.result is None
        return
    assert not set(drops) & set(run.survivors)
    expected = np.sum([values[c] for c in run.survivors], axis=0)
    got = fp.decode(run.result, ring_bits=bits)
    assert np.max(np.abs(got - expected)) <= len(run.survivors) * 2.0 ** -(frac_bits + 1) + 1e-9
    if bits == 32:
        assert int(run.result.max(initial=0)) < 2**32
        sizes = [len(d) for k, _, _, d in run.server_view if k is Kind.UPLOAD]
        assert sizes and set(sizes) == {message_size(Kind.UPLOAD, dim=dim, ring_bits=32)}


def test_a_budget_that_would_wrap_in_32_bits_falls_back_to_64():
    n, clip, frac_bits = 4, 1.0, 29  # 4 x 2^29 = 2^31: one bit too many for Z_2^32
    assert not _fits(n, clip, frac_bits, 32)
    with pytest.raises(BudgetError):
        check_budget(n_summands=n, clip=clip, frac_bits=frac_bits, ring_bits=32)
    assert choose_ring_bits(n_summands=n, clip=clip, frac_bits=frac_bits) == 64
    fp = FixedPoint(frac_bits, clip)
    inputs = {c: fp.encode(np.full(3, clip), rounding="nearest") for c in range(n)}
    wrapped = simulate(_config(3, 32), inputs)  # forced into 32 bits: the sum wraps to -4.0
    assert np.allclose(fp.decode(wrapped.result, ring_bits=32), -4.0)
    right = simulate(_config(3, 64), inputs)
    assert np.allclose(fp.decode(right.result), 4.0)


def test_bytes_per_value_halve_and_run_chain_sign_extends():
    assert message_size(Kind.UPLOAD, dim=1000) - message_size(Kind.UPLOAD, dim=0) == 8000
    assert message_size(Kind.UPLOAD, dim=1000, ring_bits=32) - message_size(Kind.UPLOAD, dim=0, ring_bits=32) == 4000
    fp = FixedPoint(8, 2.0)
    vals = np.array([[-2.0, 1.5, -0.25], [-2.0, -2.0, 0.5], [1.0, -1.0, 0.0]])
    enc = fp.encode(vals, rounding="nearest")
    spec32, spec64 = RunSpec(ring_bits=32), RunSpec()
    r32, r64 = run_chain(enc, spec32), run_chain(enc, spec64)
    assert np.allclose(fp.decode(r32.total), vals.sum(axis=0)) and np.array_equal(r32.total, r64.total)
    assert r32.bytes_sent.sum() < r64.bytes_sent.sum()
    assert r64.bytes_sent.sum() - r32.bytes_sent.sum() == 3 * (4 * 3 - 1)  # 4 B per value saved, 1 B of width
    assert np.array_equal(sign_extend(np.array([2**32 - 1], dtype=np.uint64), 32), np.array([2**64 - 1], dtype=np.uint64))


def _run_with(tamper, bits=32, n=4, dim=5):
    fp = FixedPoint(10, 1.0)
    inputs = {c: fp.encode(np.full(dim, 0.5), rounding="nearest") for c in range(n)}
    return simulate(_config(dim, bits), inputs, tamper=tamper)


def _victim_upload(edit):
    def tamper(kind, sender, receiver, data):
        return edit(data) if kind is Kind.UPLOAD and sender == 0 and receiver != 0 and _first(sender) else data
    seen: set[int] = set()

    def _first(sender):
        if sender in seen:
            return False
        seen.add(sender)
        return True
    return tamper


@pytest.mark.parametrize("edit,why", [
    (lambda d: d[:HEADER_BYTES + 4] + bytes([64]) + d[HEADER_BYTES + 5:], "truncated"),  # width byte 32 -> 64
    (lambda d: d[:HEADER_BYTES + 4] + bytes([16]) + d[HEADER_BYTES + 5:], "not one of"),
    (lambda d: _as_format1(d), "is in a 64-bit ring, this round's is 32 bits"),
    (lambda d: _as_width64(d), "is in a 64-bit ring, this round's is 32 bits"),  # well-formed, wrong width
])
def test_a_tampered_or_wrong_width_upload_is_refused(edit, why):
    run = _run_with(_victim_upload(edit))
    errors = [str(e) for _, e in run.rejected]
    assert any(why in e for e in errors), errors
    assert run.abort is None and 0 not in run.survivors and run.server.attempt == 2
    assert run.result is not None and len(run.survivors) == 3  # the round re-ran without the victim


def _as_format1(data: bytes) -> bytes:
    """The same vector and tag re-sent as a 64-bit ring's upload (format 1)."""
    msg = ChainUploadV2.from_bytes(data)
    return ChainUpload(msg.instance, msg.round, msg.sender, msg.receiver, attempt=msg.attempt,
                       vector=msg.vector, tag=msg.tag).to_bytes()


def _as_width64(data: bytes) -> bytes:
    msg = ChainUploadV2.from_bytes(data)
    return ChainUploadV2(msg.instance, msg.round, msg.sender, msg.receiver, attempt=msg.attempt,
                         vector=msg.vector, tag=msg.tag, ring_bits=64).to_bytes()


def test_a_64_bit_round_refuses_a_32_bit_upload():
    def edit(data: bytes) -> bytes:
        msg = ChainUpload.from_bytes(data)
        return ChainUploadV2(msg.instance, msg.round, msg.sender, msg.receiver, attempt=msg.attempt,
                             vector=msg.vector & np.uint64(2**32 - 1), tag=msg.tag, ring_bits=32).to_bytes()
    run = _run_with(_victim_upload(edit), bits=64)
    assert any("is in a 32-bit ring, this round's is 64 bits" in str(e) for _, e in run.rejected)
    assert 0 not in run.survivors and run.result is not None


def test_config_and_wire_validate_the_width():
    for bad in (16, 48, 128, "32", 32.0, True):
        with pytest.raises(ValueError):
            ChainConfig(instance=bytes(16), round=0, dim=1, ring_bits=bad)
    with pytest.raises(ValueError):  # a word above the ring
        ChainUploadV2(bytes(16), 0, 1, 2, vector=np.array([2**32], dtype=np.uint64), tag=bytes(28)).to_bytes()
    with pytest.raises(MessageError):  # a length that does not match the width
        data = ChainUploadV2(bytes(16), 0, 1, 2, vector=np.arange(4, dtype=np.uint64), tag=bytes(28)).to_bytes()
        ChainUploadV2.from_bytes(data[:-1])


def test_chain_bench_measures_the_32_bit_ring(capsys):
    import json

    from secagg.chain_bench import bench_one, main

    row = bench_one(6, 16, 0.5, s=2, ring_bits=32)
    assert row["correct"] and row["attempts"] == 2 and row["bytes_per_value"] == 4
    assert row["bytes_per_client"] == 2 * message_size(Kind.UPLOAD, dim=16, ring_bits=32) + message_size(
        Kind.ADVERT) + 2 * message_size(Kind.BUNDLE, s=2) + message_size(Kind.UNLOCK)
    assert main(["--clients", "4", "--dims", "8", "--dropouts", "0", "--ring-bits", "32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["correct"], r["ring_bits"]) for r in out["rows"]] == [(True, 32)]
