"""The cohorts of one reused key setup must nest: ``ReuseSession.check_cohort`` refuses, in words, a later
instance with a client outside the previous instance's survivors, one that leaves out more of the
setup's clients than they accept, and any instance after an aborted one; over random cohorts it accepts
exactly the nesting ones within the budget, and those sum exactly (docs/secagg.md, "One setup per round")."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg.reuse_sim import ReuseSession, SetupCohortError
from secagg.runspec import RunSpec

U64 = np.uint64


def _rows(rng: np.random.Generator, m: int, dim: int = 5) -> np.ndarray:
    return rng.integers(0, 2**64, (m, dim), dtype=U64, endpoint=False)


def test_the_first_instance_fixes_the_clients_and_a_later_one_must_nest():
    rng = np.random.default_rng(0)
    names = [f"c{i}" for i in range(6)]
    s = ReuseSession("secagg")
    s.check_cohort(["anyone"])  # nothing to nest in before the first instance
    xs = _rows(rng, 6)
    res = s.run(xs, RunSpec(dropouts={"masked_input": frozenset({2})}, dropout=0.4), names=names)
    assert res.total is not None and sorted(res.survivors) == [0, 1, 3, 4, 5]
    assert s.survivors == frozenset(names) - {"c2"}
    with pytest.raises(SetupCohortError, match=r"1 of the 6 clients of this sum \(\['c2'\]\) are not among the 5 "
                                               r"survivors of instance 0 of its key setup: the cohorts of one setup must nest"):
        s.check_cohort(names)
    with pytest.raises(SetupCohortError, match="are not among"):
        s.check_cohort(["c0", "c1", "stranger"])
    later = [n for n in names if n != "c2"]
    s.check_cohort(later)
    ys = _rows(rng, 5)
    res = s.run(ys, RunSpec(dropout=0.4), names=later)
    assert np.array_equal(res.total, ys.sum(0, dtype=U64)) and not s.last_ran_setup


def test_what_the_check_spares_a_non_survivor_run_anyway_is_left_out_of_the_sum_silently():
    rng = np.random.default_rng(3)
    names = [f"c{i}" for i in range(6)]
    s = ReuseSession("secagg")
    s.run(_rows(rng, 6), RunSpec(dropouts={"masked_input": frozenset({4})}, dropout=0.4), names=names)
    with pytest.raises(SetupCohortError):
        s.check_cohort(names)
    xs = _rows(rng, 6)
    res = s.run(xs, RunSpec(dropout=0.4), names=names)  # the session itself does not refuse it
    assert res.total is not None and 4 not in res.survivors
    assert np.array_equal(res.total, xs[[0, 1, 2, 3, 5]].sum(0, dtype=U64))  # c4's input silently missing


def test_a_cohort_shrunk_beyond_the_clients_dropout_budget_is_refused_before_it_runs():
    rng = np.random.default_rng(1)
    names = [f"c{i}" for i in range(10)]
    s = ReuseSession("secagg")
    s.run(_rows(rng, 10), RunSpec(dropout=0.3), names=names)
    allowed = math.ceil(0.3 * 10)
    s.check_cohort(names[allowed:])  # exactly the budget: the clients would sign it
    with pytest.raises(SetupCohortError, match=rf"leave out {allowed + 1} of the key setup's n = 10, more than the "
                                               rf"{allowed} its clients accept"):
        s.check_cohort(names[allowed + 1:])
    # what the check spares: run anyway, the instance aborts (too few holders, or the clients refuse to sign)
    res = s.run(_rows(rng, 10 - allowed - 1), RunSpec(dropout=0.3), names=names[allowed + 1:])
    assert res.total is None and ("fewer than t" in res.abort or "more than the" in res.abort), res.abort


def test_no_instance_runs_on_a_setup_after_an_aborted_one():
    rng = np.random.default_rng(2)
    names = [f"c{i}" for i in range(5)]
    s = ReuseSession("secagg")
    res = s.run(_rows(rng, 5), RunSpec(dropouts={"masked_input": frozenset({0, 1, 2})}, dropout=0.4), names=names)
    assert res.total is None
    with pytest.raises(SetupCohortError, match="instance 0 of this key setup did not complete"):
        s.check_cohort(names[3:])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_over_random_cohorts_the_check_accepts_exactly_the_nesting_ones_within_budget(data):
    n = data.draw(st.integers(3, 9), label="n")
    dropout = data.draw(st.sampled_from([0.2, 0.34, 0.5]), label="dropout")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    names = [f"c{i}" for i in range(n)]
    s = ReuseSession("secagg")
    cohort = names
    for inst in range(data.draw(st.integers(2, 4), label="instances")):
        if inst:
            # any cohort over the setup's clients (and perhaps a stranger), nesting or not
            cohort = data.draw(st.lists(st.sampled_from(names + ["stranger"]), min_size=2, max_size=n + 1,
                                        unique=True), label="cohort")
            nests = set(cohort) <= s.survivors and n - len(cohort) <= math.ceil(dropout * n - 1e-9)
            if not nests:
                with pytest.raises(SetupCohortError):
                    s.check_cohort(cohort)
                return
            s.check_cohort(cohort)
        m = len(cohort)
        drop = {j for j in data.draw(st.sets(st.integers(0, m - 1), max_size=1), label="drop") if j < m}
        xs = _rows(rng, m, data.draw(st.integers(1, 9), label="dim"))
        res = s.run(xs, RunSpec(dropouts={"masked_input": frozenset(drop)}, dropout=dropout), names=cohort)
        if res.total is None:  # a dropout beyond the budget (or below t): nothing later may run on it
            with pytest.raises(SetupCohortError, match="did not complete"):
                s.check_cohort(cohort)
            return
        surv = sorted(res.survivors)
        assert np.array_equal(res.total, xs[surv].sum(0, dtype=U64))
        assert s.survivors == {cohort[j] for j in surv}


# -- pricing the setups: what one setup per round could spare ----------------------------------------
def test_the_setup_price_is_what_a_reused_setup_pays_once():
    from secagg.costmodel import UnitCosts, instance_cost, setup_client_s

    units = UnitCosts(aes_ctr_bps=1e9, gcm_bps=1e9, add_wps=1e9, sha256_bps=1e9, keygen_s=3.0, agree_s=5.0,
                      sign_s=7.0, verify_s=11.0, prf_s=13.0)
    for k, t in ((1, 2), (12, 8), (74, 50)):
        kw = dict(n=k + 1, dim=9, k=k, t=t, survivors=k + 1, masks_expanded=0, key_agreements=0,
                  signatures_verified=0, units=units, reuse=True)
        once = instance_cost("secagg+", setup=True, **kw).client_s - instance_cost("secagg+", setup=False, **kw).client_s
        assert setup_client_s(k, units) == pytest.approx(once)
        assert setup_client_s(k, units) == 2 * 3.0 + 2 * k * 5.0 + 7.0 + (k + 1) * 11.0


def test_the_ceilings_count_only_setups_a_reuse_could_spare():
    from secagg.costmodel import nesting_setups, reusable_setup_s

    assert reusable_setup_s({"a": [5.0, 2.0, 1.0], "b": [4.0], "c": []}) == 3.0  # all but each client's dearest

    def inst(senders, surv=None, dropout=0.25, setup=True, aborted=False, protocol="secagg+"):
        return {"protocol": protocol, "senders": senders, "survivor_senders": senders if surv is None else surv,
                "n": len(senders), "dropout": dropout, "setup": setup, "aborted": aborted}

    abcd = list("abcd")
    seen = [inst(abcd, surv=list("abc")),        # 0: its survivors a, b, c (d dropped)
            inst(list("abc")),                    # 1: nests in 0, one of its 4 left out (budget ceil(0.25 x 4) = 1)
            inst(list("ab")),                     # 2: two of 0's 4 left out, but one of 1's 3 (ceil(0.75) = 1)
            inst(list("abd")),                    # 3: d did not survive 0 and is in no other earlier sum
            inst(["a"] + list("xyz")),            # 4: strangers
            inst(list("ab"), setup=False),        # 5: already an instance of a reused setup: nothing to spare
            inst(list("xyz"), aborted=True),      # 6: nests in 4 (a left out); aborted, so no later sum nests in it
            inst(list("xy"))]                     # 7: two of 4's 4 left out: beyond the budget
    assert nesting_setups(seen) == [1, 2, 6]
    assert nesting_setups([inst(abcd, protocol="dpf"), inst(list("abc"))]) == []
