"""ChainWorkflow + chain_mod inside Flower: the circular chain's sum, exactly, over Flower messages.

The same loopback grid, client manager, FedAvg strategy and ClientApp as the SecAgg tests, with the
chain's workflow and mod. Oracle: each survivor's update recomputed in plaintext and its encoding
summed in Z_2^64. Attacks on the promise: a dropout at every stage (the chain's re-run rule must
leave the dropped client out, never give a wrong sum), a node impersonating another, tampered and
malformed records, a plaintext training request.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.client import ClientApp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedflower.chain_flower import CHAIN_KEY, CHAIN_STATE_KEY, ChainWorkflow, chain_mod
from fedflower.loopback import LoopbackGrid, fit_round, global_parameters
from fedflower.records import SetupConfig
from fedflower.secagg_mod import encode_update

from .conftest import SHAPES, _Client, examples_of, update_of

logging.getLogger("flwr").setLevel(logging.ERROR)


def chain_app(shapes=SHAPES) -> ClientApp:  # noqa: ANN001
    return ClientApp(client_fn=lambda ctx: _Client(ctx.node_id, shapes).to_client(), mods=[chain_mod])


def run_chain(n: int, *, drop=None, tamper=None, **kw):  # noqa: ANN001, ANN201
    kw.setdefault("rounding", "nearest")
    nodes = [2000 + 11 * i for i in range(n)]
    wf = ChainWorkflow(**kw)
    grid = LoopbackGrid(chain_app(), nodes, drop=drop, tamper=tamper)
    ctx = fit_round(wf, grid, [np.zeros(s, np.float32) for s in SHAPES])
    return wf, grid, wf.last_report, global_parameters(ctx), nodes


def oracle_total(wf: ChainWorkflow, dim: int, survivors: list[int]) -> np.ndarray:
    setup = SetupConfig("secagg", 2, dim, 1, 0, bytes(16), 0, (), wf.frac_bits, wf.clip, wf.max_weight, "nearest")
    acc = np.zeros(dim, dtype=np.uint64)
    for nid in survivors:
        np.add(acc, encode_update(setup, update_of(nid), examples_of(nid)), out=acc)
    return acc


def oracle_mean(survivors: list[int]) -> list[np.ndarray]:
    w = np.array([examples_of(nid) for nid in survivors], dtype=np.float64)
    ups = [update_of(nid) for nid in survivors]
    return [sum(w[i] * ups[i][j].astype(np.float64) for i in range(len(ups))) / w.sum() for j in range(len(SHAPES))]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(3, 9), s=st.integers(1, 3))
def test_the_chain_inside_flower_gives_the_exact_sum(n, s):
    wf, grid, rep, params, nodes = run_chain(n, successors=s)
    assert rep.abort is None and rep.survivors == nodes and rep.attempts == 1
    assert np.array_equal(rep.total, oracle_total(wf, rep.dim, nodes))
    assert not np.array_equal(rep.total, oracle_total(wf, rep.dim, nodes[1:]))  # the oracle can fail
    for got, want in zip(params, oracle_mean(nodes), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # Each node keeps its round state (a re-run RING may still come after its UNLOCK) on the node only.
    assert all(CHAIN_STATE_KEY in grid.context(nid).state.config_records for nid in nodes)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(victim=st.integers(0, 5), stage=st.integers(1, 6))
def test_a_dropout_at_any_stage_is_left_out_or_aborts_never_a_wrong_sum(victim, stage):
    """Stages on the grid: 1 setup (advertise), 2 ring -> bundle, 3 delivery -> upload, 4 unlock, and
    later numbers for the re-run's messages. A node silent from ``stage`` on."""
    nodes = [2000 + 11 * i for i in range(6)]
    gone = nodes[victim]
    wf, grid, rep, params, _ = run_chain(6, successors=1, drop=lambda st_, nid: st_ >= stage and nid == gone)
    if rep.abort is not None:  # the chain's rule 2 (a dropout at UNLOCK) may abort: never a wrong sum
        assert rep.total is None and stage >= 4
        assert all(np.all(p == 0) for p in params)  # the model is unchanged
        return
    if stage >= 5:  # the round has four stages without a re-run: this node never went silent
        assert rep.survivors == nodes and rep.attempts == 1
        assert np.array_equal(rep.total, oracle_total(wf, rep.dim, nodes))
        return
    assert gone not in rep.survivors and gone in rep.dropped
    assert rep.survivors == [nid for nid in nodes if nid != gone] and rep.attempts >= (2 if stage >= 2 else 1)
    assert np.array_equal(rep.total, oracle_total(wf, rep.dim, rep.survivors))
    for got, want in zip(params, oracle_mean(rep.survivors), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)



def test_a_node_impersonating_another_is_refused():
    nodes = [2000 + 11 * i for i in range(5)]
    other = {}

    def tamper(stage, nid, reply):  # noqa: ANN001 - node 1 replays node 0's setup reply as its own
        if stage == 1 and nid == nodes[0]:
            other["msg"] = reply.content.config_records[CHAIN_KEY]["msg"]
        if stage == 1 and nid == nodes[1] and "msg" in other:
            reply.content.config_records[CHAIN_KEY] = ConfigRecord({"stage": "setup", "msg": other["msg"]})
        return reply

    wf, grid, rep, params, _ = run_chain(5, tamper=tamper)
    assert rep.abort is None and nodes[1] not in rep.survivors
    assert any(nid == nodes[1] and "sent a message as client 0" in why for nid, why in rep.refused), rep.refused
    assert np.array_equal(rep.total, oracle_total(wf, rep.dim, rep.survivors))


@pytest.mark.parametrize("corrupt, reason", [
    (lambda rec: ConfigRecord({"stage": "relay"}), "record keys differ"),
    (lambda rec: ConfigRecord({**dict(rec), "extra": 1}), "record keys differ"),
    (lambda rec: ConfigRecord({"stage": "setup", "msg": rec["msg"]}), "out-of-order or replayed"),
    (lambda rec: ConfigRecord({"stage": "relay", "msg": rec["msg"][:-3]}), "Error"),
    (lambda rec: ConfigRecord({"stage": "relay", "msg": 7}), "must be bytes"),
])
def test_a_malformed_or_tampered_relay_drops_only_its_sender(corrupt, reason):
    nodes = [2000 + 11 * i for i in range(6)]
    victim = nodes[2]

    def tamper(stage, nid, reply):  # noqa: ANN001 - corrupt the victim's BUNDLE (stage 2)
        if stage == 2 and nid == victim:
            reply.content.config_records[CHAIN_KEY] = corrupt(reply.content.config_records[CHAIN_KEY])
        return reply

    wf, grid, rep, params, _ = run_chain(6, tamper=tamper)
    assert rep.abort is None and victim not in rep.survivors and len(rep.survivors) == 5
    assert any(nid == victim and reason in why for nid, why in rep.refused), rep.refused
    assert np.array_equal(rep.total, oracle_total(wf, rep.dim, rep.survivors))


def test_a_client_with_the_chain_mod_never_trains_in_plaintext():
    app = chain_app()
    grid = LoopbackGrid(app, [5])
    msg = Message(RecordDict({}), dst_node_id=5, message_type=MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and "only trains through the chain" in reply.error.reason
    # a relay without a setup first
    msg = Message(RecordDict({CHAIN_KEY: ConfigRecord({"stage": "relay", "msg": b"x"})}), dst_node_id=5,
                  message_type=MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and "no round in progress" in reply.error.reason


def test_bad_workflow_parameters_are_refused_in_words():
    with pytest.raises(ValueError, match="successors"):
        ChainWorkflow(successors=0)
    with pytest.raises(ValueError, match="min_survivors"):
        ChainWorkflow(min_survivors=1)
    with pytest.raises(ValueError, match="rounding"):
        ChainWorkflow(rounding="up")


def test_a_tampered_sealed_seed_excludes_one_client_and_the_sum_stays_exact():
    """Flip one bit of a sealed seed in a BUNDLE: the server relays it unread (it cannot open it),
    the receiving successor fails to authenticate it and leaves (the chain's rule: no robustness
    against denial of service), the attempt is re-run without it, and the sum is exact."""
    nodes = [2000 + 11 * i for i in range(6)]

    def tamper(stage, nid, reply):  # noqa: ANN001
        if stage == 2 and nid == nodes[2]:
            rec = reply.content.config_records[CHAIN_KEY]
            msg = rec["msg"]
            reply.content.config_records[CHAIN_KEY] = ConfigRecord(
                {"stage": "relay", "msg": msg[:-1] + bytes([msg[-1] ^ 1])})
        return reply

    wf, grid, rep, params, _ = run_chain(6, tamper=tamper)
    assert rep.abort is None and len(rep.survivors) == 5 and rep.attempts == 2
    (out,) = set(nodes) - set(rep.survivors)
    assert "AuthenticationError" in rep.dropped[out] or "did not" in rep.dropped[out], rep.dropped
    assert np.array_equal(rep.total, oracle_total(wf, rep.dim, rep.survivors))
