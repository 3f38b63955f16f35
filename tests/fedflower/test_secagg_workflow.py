"""SecAggWorkflow + secagg_mod inside Flower: the aggregate is the survivors' plaintext sum, exactly.

Each round runs Flower's own client manager, FedAvg strategy and ClientApp (with our mod) over an
in-process Grid that serialises every message and context to protobuf (fedflower.loopback). The
oracle recomputes each survivor's update in plaintext and sums its encoding in Z_2^64.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedflower.records import IDENTITY_KEY, STAGES, STATE_KEY

# Stage numbers as LoopbackGrid counts them (one send_and_receive per stage).
STAGE_NO = {name: i + 1 for i, name in enumerate(STAGES)}


def _check_mean(res, survivors, tol=1e-6):  # noqa: ANN001, ANN202
    for got, want in zip(res.params, res.oracle_mean(survivors), strict=True):
        np.testing.assert_allclose(got, want, atol=tol)


@pytest.mark.parametrize("protocol", ["secagg+", "secagg"])
def test_aggregate_equals_plaintext_sum(secagg_round, protocol):
    res = secagg_round(7, protocol=protocol)
    rep = res.report
    assert rep.abort is None and rep.dropped == {}
    assert rep.survivors == res.nodes
    assert np.array_equal(rep.total, res.oracle_total(res.nodes))
    _check_mean(res, res.nodes)
    # every parameter moved away from the zero initialisation: the strategy got the mean
    assert all(np.any(p != 0) for p in res.params)


def test_wrong_oracle_would_fail(secagg_round):
    """The equality check can fail: leaving one survivor out of the oracle changes the sum."""
    res = secagg_round(5)
    assert not np.array_equal(res.report.total, res.oracle_total(res.nodes[1:]))


def test_secagg_plus_uses_a_sparse_graph_and_stochastic_rounding_is_close(secagg_round):
    res = secagg_round(12, num_shares=5, reconstruction_threshold=4, rounding="stochastic")
    rep = res.report
    assert (rep.k, rep.t) == (4, 4)
    assert rep.abort is None
    _check_mean(res, res.nodes)


@pytest.mark.parametrize("stage", STAGES)
def test_a_dropout_at_each_stage(secagg_round, stage):
    """A node silent from ``stage`` on: before its masked input it is left out of the sum; after
    it, its input stays in (it arrived) and the round still completes."""
    res = secagg_round(8, protocol="secagg", drop=lambda s, nid: s == STAGE_NO[stage] and nid == 1000 + 17 * 3)
    rep = res.report
    gone = 1000 + 17 * 3
    assert rep.abort is None
    assert gone in rep.dropped and rep.dropped[gone][0] == stage
    in_sum = STAGE_NO[stage] > STAGE_NO["masked_input"]
    assert (gone in rep.survivors) is in_sum
    assert np.array_equal(rep.total, res.oracle_total(rep.survivors))
    _check_mean(res, rep.survivors)


def test_too_many_dropouts_abort_cleanly_and_leave_the_model_unchanged(secagg_round):
    res = secagg_round(6, protocol="secagg", drop=lambda s, nid: s == STAGE_NO["masked_input"] and nid % 2 == 0)
    rep = res.report
    assert rep.abort is not None and "fewer than t" in rep.abort
    assert rep.total is None and rep.survivors == []
    assert all(np.all(p == 0) for p in res.params)


def test_client_state_is_node_local_and_deleted_after_the_round(secagg_round):
    res = secagg_round(4, protocol="secagg")
    for nid in res.nodes:
        records = res.grid.context(nid).state.config_records
        assert STATE_KEY not in records  # keys and shares are gone
        assert IDENTITY_KEY in records  # the long-term identity stays (pinned by the server)
    assert res.wf.pinned.keys() == set(res.nodes)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_dropout_sets_per_stage(secagg_round, data):
    """Random nodes drop at random stages: the result is the survivors' exact sum or a clean abort."""
    n = 8
    nodes = [1000 + 17 * i for i in range(n)]
    when = {nid: data.draw(st.sampled_from([None, *range(1, 6)]), label=f"drop stage of {nid}") for nid in nodes}
    res = secagg_round(n, protocol=data.draw(st.sampled_from(["secagg", "secagg+"])),
                       drop=lambda s, nid: when[nid] == s)
    rep = res.report
    sent_input = {nid for nid in nodes if when[nid] is None or when[nid] > STAGE_NO["masked_input"]}
    if rep.abort is None:
        assert set(rep.survivors) == sent_input
        assert np.array_equal(rep.total, res.oracle_total(rep.survivors))
        assert {nid for nid in nodes if when[nid] is not None} == set(rep.dropped)
    else:
        assert rep.total is None and all(np.all(p == 0) for p in res.params)
