"""Hypothesis properties of the circular share chain: random n, dim, s, values and dropout sets."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg.chain import _MASK_LABEL, _PAD_LABEL, ChainConfig, ChainUpload, Kind, effective_successors
from secagg.chain_sim import DROP_STAGES, Dropout, simulate
from secagg.prg import expand

U64 = np.uint64
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def expected_outcome(ids, dropouts, *, min_survivors, max_attempts):
    """Independent model of the attempt logic: the survivors, or None for an abort."""
    members = [c for c in ids if not (c in dropouts and dropouts[c].stage == "advertise")]
    attempt, fixed = 1, False

    def leaving(stages):
        return {c for c in members if c in dropouts and dropouts[c].stage in stages
                and dropouts[c].attempt in (None, attempt)}

    while True:
        if len(members) < min_survivors:
            return None
        gone = leaving(("share",)) or leaving(("receive", "upload"))
        unlock_stage = not gone
        if unlock_stage:
            gone = leaving(("unlock",))
        if not gone:
            return frozenset(members)
        if fixed or attempt >= max_attempts:  # after an unlock-stage dropout: one re-run, exact
            return None
        fixed = unlock_stage
        members = [c for c in members if c not in gone]
        attempt += 1


@st.composite
def rounds(draw):
    n = draw(st.integers(2, 64))
    dim = draw(st.integers(1, 6))
    s = draw(st.integers(1, 6))
    max_attempts = draw(st.integers(1, 4))
    ids = draw(st.lists(st.integers(0, 2**32 - 2), min_size=n, max_size=n, unique=True))
    values = draw(st.lists(st.lists(st.integers(0, 2**64 - 1), min_size=dim, max_size=dim), min_size=n, max_size=n))
    dropping = draw(st.lists(st.sampled_from(ids), max_size=max(1, n // 3), unique=True))
    dropouts = {
        c: Dropout(draw(st.sampled_from(DROP_STAGES)), draw(st.none() | st.integers(1, max_attempts)))
        for c in dropping
    }
    return n, dim, s, max_attempts, ids, values, dropouts


@SETTINGS
@given(rounds())
def test_sum_over_survivors_equals_the_plaintext_sum_or_the_round_aborts(case):
    n, dim, s, max_attempts, ids, values, dropouts = case
    config = ChainConfig(instance=os.urandom(16), round=1, dim=dim, successors=s, max_attempts=max_attempts)
    inputs = {c: np.array(v, dtype=U64) for c, v in zip(ids, values)}
    run = simulate(config, inputs, dropouts=dropouts, keep_view=False)
    expected = expected_outcome(ids, dropouts, min_survivors=2, max_attempts=max_attempts)
    if expected is None:
        assert run.result is None and run.abort is not None
        return
    assert run.abort is None and run.survivors == expected
    oracle = [sum(int(inputs[c][j]) for c in expected) % 2**64 for j in range(dim)]
    assert run.result.tolist() == oracle
    assert run.server.successors == effective_successors(s, len(expected)) <= len(expected) - 1
    assert not run.rejected


@SETTINGS
@given(st.integers(2, 40), st.integers(1, 5), st.integers(1, 5), st.data())
def test_server_plus_the_2s_neighbours_recover_any_input_and_fewer_do_not(n, dim, s, data):
    config = ChainConfig(instance=os.urandom(16), round=2, dim=dim, successors=s)
    inputs = {c: np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=dim, max_size=dim)), dtype=U64)
              for c in range(n)}
    run = simulate(config, inputs)
    ring, s_eff = run.server.ring, run.server.successors
    pos = data.draw(st.integers(0, n - 1))
    target = ring[pos]
    neighbours = {ring[(pos + j) % n] for j in range(1, s_eff + 1)} | {ring[(pos - j) % n] for j in range(1, s_eff + 1)}
    upload = next(ChainUpload.from_bytes(d).vector for k, c, _, d in run.server_view if k is Kind.UPLOAD and c == target)

    pad = run.server.revealed[(run.server.attempt, target)]  # opened by the server at UNLOCK

    def guess(colluders):
        y = upload.copy() - expand(pad, dim, label=_PAD_LABEL)
        for c in colluders:
            for (_, snd, rcv), seed in run.clients[c].known_seeds().items():
                if snd == target and rcv in colluders:
                    y += expand(seed, dim, label=_MASK_LABEL)
                elif rcv == target and snd in colluders:
                    y -= expand(seed, dim, label=_MASK_LABEL)
        return y

    assert np.array_equal(guess(neighbours), inputs[target])
    if n > 2:  # with n = 2 the other client is both neighbour and the sum's complement
        missing = data.draw(st.sampled_from(sorted(neighbours)))
        assert not np.array_equal(guess(neighbours - {missing}), inputs[target])


@SETTINGS
@given(st.integers(3, 12), st.integers(1, 3), st.data())
def test_tampering_any_message_never_yields_a_wrong_sum(n, s, data):
    """Flip one byte of one in-flight message (or drop it): the result is the exact sum over the
    reported survivors, or a clean abort. Never a wrong sum, never an unexpected exception."""
    dim = 3
    config = ChainConfig(instance=os.urandom(16), round=3, dim=dim, successors=s)
    inputs = {c: np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=dim, max_size=dim)), dtype=U64)
              for c in range(n)}
    target_index = data.draw(st.integers(0, 4 * n))
    action = data.draw(st.sampled_from(["flip", "drop", "truncate"]))
    position = data.draw(st.integers(0, 10**6))
    counter = {"i": 0}

    def tamper(kind, sender, receiver, blob):
        i = counter["i"]
        counter["i"] += 1
        if i != target_index:
            return blob
        if action == "drop":
            return None
        if action == "truncate":
            return blob[: position % len(blob)]
        b = bytearray(blob)
        b[position % len(b)] ^= 1 << (position % 8)
        return bytes(b)

    run = simulate(config, inputs, tamper=tamper, keep_view=False)
    if run.result is None:
        assert run.abort is not None
        return
    oracle = [sum(int(inputs[c][j]) for c in run.survivors) % 2**64 for j in range(dim)]
    assert run.result.tolist() == oracle
    assert len(run.survivors) >= 2


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 64), st.integers(1, 4), st.sampled_from([0, 2**63 + 5, 2**64 - 1]))
def test_uploads_look_uniform_whatever_the_input(n, s, constant):
    """Every bit of every upload is balanced (6-sigma band), even for constant inputs."""
    dim = 64
    config = ChainConfig(instance=os.urandom(16), round=5, dim=dim, successors=s)
    run = simulate(config, {c: np.full(dim, constant, dtype=U64) for c in range(n)})
    ups = np.concatenate([ChainUpload.from_bytes(d).vector for k, _, _, d in run.server_view if k is Kind.UPLOAD])
    bits = np.unpackbits(ups.view(np.uint8))
    sigma = 0.5 / np.sqrt(bits.size)
    assert abs(bits.mean() - 0.5) < 6 * sigma
    per_position = np.unpackbits(ups.view(np.uint8).reshape(-1, 8), axis=1).mean(axis=0)
    assert np.all(np.abs(per_position - 0.5) < 6 * 0.5 / np.sqrt(ups.size))
