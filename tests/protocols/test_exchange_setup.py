"""Exchanges that name one key setup (``SecureSum(setup=...)``, docs/secagg.md "One setup per round"): a
later sum runs as the next instance only over a cohort nesting in the previous one's survivors within
the dropout budget, else it is refused in words; the chunks of one sum never mix two cohorts."""

from __future__ import annotations

import types

import numpy as np
import pytest

import protocols.exchange as exchange
from protocols.exchange import Exchange, SecureSum, _answer, setup_reuse
from protocols.secure_sum import observe
from protocols.transport import InProcessTransport
from secagg.reuse_sim import SetupCohortError


def _server():
    return types.SimpleNamespace(transport=InProcessTransport())


def _sum(server, users, vectors, round_=0, **kw):
    spec = SecureSum("secagg", width=len(next(iter(vectors.values()))), frac_bits=16, value_clip=100.0,
                     setup="round", dropout=0.3, **kw)
    ex = Exchange("x", np.asarray(users), secure=spec)
    return _answer(server, ex, round_, {u: {"vector": vectors[u]} for u in users}, {})


def _vectors(rng, users, width=5):
    return {u: rng.normal(size=width) for u in users}


def test_a_nesting_later_sum_runs_in_the_same_setup_and_sums_exactly():
    rng = np.random.default_rng(0)
    server, seen = _server(), []
    with observe(seen.append):
        first = _sum(server, range(8), _vectors(rng, range(8)))
        later = list(range(1, 8))  # one left out: within ceil(0.3 x 8) = 3
        vec = _vectors(rng, later, width=3)
        got = _sum(server, later, vec)
    assert first.total is not None and got.total is not None
    np.testing.assert_allclose(got.total, sum(vec.values()), atol=1e-3)
    assert [(i["reuse"], i["setup"]) for i in seen] == [(True, True), (True, False)]
    # a new round sets up anew, over any cohort
    fresh = _sum(server, [0, 8, 9], _vectors(rng, [0, 8, 9]), round_=1)
    assert fresh.total is not None


@pytest.mark.parametrize("later, words", [
    ([0, 1, 2, 3, 4, 5, 6, 7, 8], "are not among the 8 survivors of instance 0"),  # a client new to the setup
    ([0, 1, 2, 3], "leave out 4 of the key setup's n = 8, more than the 3"),
])
def test_a_later_sum_that_does_not_nest_is_refused_in_words(later, words):
    rng = np.random.default_rng(1)
    server = _server()
    _sum(server, range(8), _vectors(rng, range(8)))
    with pytest.raises(SetupCohortError, match=words):
        _sum(server, later, _vectors(rng, later))
    with setup_reuse(False):  # the same sum with its own setup is fine
        vec = _vectors(rng, later)
        np.testing.assert_allclose(_sum(server, later, vec).total, sum(vec.values()), atol=1e-3)


def test_a_client_dropped_from_the_previous_sum_is_refused_in_the_next():
    rng = np.random.default_rng(2)
    server = _server()
    got = _sum(server, range(8), _vectors(rng, range(8)), dropouts={"masked_input": frozenset({3})})
    assert 3 not in got.survivors.tolist()
    with pytest.raises(SetupCohortError, match=r"\[.client:3.\]"):
        _sum(server, range(8), _vectors(rng, range(8)))
    vec = _vectors(rng, got.survivors.tolist())
    np.testing.assert_allclose(_sum(server, got.survivors.tolist(), vec).total, sum(vec.values()), atol=1e-3)


def test_the_chunks_of_one_sum_never_mix_two_cohorts(monkeypatch):
    """A client silent at the first chunk's unmask is in that chunk's sum but gone from the setup's next
    instance: the chunks would sum different cohorts, so the sum aborts in words (before, its first
    chunk was silently the sum of one client more)."""
    monkeypatch.setattr(exchange, "SECURE_CHUNK", 8 * 4)  # 8 clients: 4 columns a chunk
    rng = np.random.default_rng(3)
    vec = _vectors(rng, range(8), width=12)
    got = _sum(_server(), range(8), vec, dropouts={"unmask": frozenset({1})})
    assert got.total is None and "different survivors" in got.aborted
    with setup_reuse(False):  # independent chunks: each with the same survivors
        got = _sum(_server(), range(8), vec, dropouts={"unmask": frozenset({1})})
    np.testing.assert_allclose(got.total, sum(vec.values()), atol=1e-3)  # silent at the unmask, still summed
