"""A client's safety settings on Flower are its node's configuration, never a field of a server message.

Issue 23, item 4: the setup record once carried ``unsafe_threshold`` and ``secagg_mod`` honoured it,
so a deviating server could announce ``t = 2`` of 5 holders with the flag set, show two disjoint
groups of holders different survivor sets, and rebuild a victim's input from the shares both
groups reveal. The attack below is played through the real ``secagg_mod`` over the loopback grid
(every message and context through Flower's protobuf); the deviating server is written out by hand.
"""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MessageType, RecordDict
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat

from fedflower.chain_flower import CHAIN_STATE_KEY, ChainWorkflow, chain_mod
from fedflower.client_state import node_policy
from fedflower.loopback import LoopbackGrid
from fedflower.records import RECORD_KEY, STAGES, STATE_KEY, SetupConfig, make_record
from fedflower.secagg_mod import VECTOR_KEY, encode_update, secagg_mod
from fedflower.secagg_workflow import SecAggWorkflow
from secagg import prg, shamir
from secagg.bonawitz import ClientPolicy, MaskingConfig, MaskingServer, SurvivorList, UnmaskRequest
from secagg.encoding import FixedPoint
from secagg.graph import complete_graph
from secagg.keys import KEY_BYTES, KeyPair
from secagg.messages import SERVER, decode
from secagg.params import DEFAULT_DROPOUT

from .conftest import SHAPES, examples_of, secure_app, update_of

logging.getLogger("flwr").setLevel(logging.ERROR)

N = 5
NODES = [3000 + 13 * i for i in range(N)]
VICTIM = 0  # client index of the victim; groups A and B are disjoint pairs of its holders
GROUP_A, GROUP_B = (1, 2), (3, 4)
DIM = 1 + sum(int(np.prod(s)) for s in SHAPES)
FRAC_BITS, CLIP, MAX_WEIGHT = 24, 8.0, 1000.0


def _setup(cfg: MaskingConfig, i: int, *, declare_unsafe: bool) -> RecordDict:
    """Client ``i``'s setup record; ``declare_unsafe`` adds the old wire field ``unsafe_threshold``."""
    rec = SetupConfig("secagg", cfg.n, cfg.dim, cfg.t, cfg.round, cfg.instance, i, tuple(cfg.graph[i]), FRAC_BITS, CLIP,
                      MAX_WEIGHT, "nearest").to_record()
    if declare_unsafe:
        rec["unsafe_threshold"] = True
    elif "unsafe_threshold" in rec:  # (a SetupConfig that still writes the field: leave the flag off)
        rec["unsafe_threshold"] = False
    return RecordDict({RECORD_KEY: rec})


def _send(grid: LoopbackGrid, out: dict[int, RecordDict], rnd: int) -> dict[int, Message]:
    msgs = [Message(content=c, dst_node_id=NODES[i], message_type=MessageType.TRAIN, group_id=str(rnd))
            for i, c in out.items()]
    return {NODES.index(r.metadata.src_node_id): r for r in grid.send_and_receive(msgs)}


def _msg(reply: Message) -> bytes:
    return reply.content.config_records[RECORD_KEY]["msg"]


def split_view_through_the_mod(*, declare_unsafe: bool, node_config: dict | None = None):
    """The deviating server of item 4 against five nodes running ``secagg_mod``.

    Returns ``(rebuilt, actual)``, the victim's encoded input as the server rebuilt it and as the
    victim encoded it, or ``(None, errors)`` with each node's error text when the nodes refuse the
    setup (the server then holds nothing of anyone's).
    """
    grid = LoopbackGrid(secure_app(), NODES, node_config=(lambda nid: node_config) if node_config else None)
    rnd = 1
    cfg = MaskingConfig(N, DIM, 2, complete_graph(N), os.urandom(16), rnd, unsafe_threshold=True)
    pki: dict[int, bytes] = {}
    server = MaskingServer(cfg, pki)
    replies = _send(grid, {i: _setup(cfg, i, declare_unsafe=declare_unsafe) for i in range(N)}, rnd)
    errors = {i: r.error.reason for i, r in replies.items() if r.has_error()}
    if errors:
        return None, errors
    for i, r in replies.items():
        pki[i] = r.content.config_records[RECORD_KEY]["identity"]
        server.receive(_msg(r))
    inbox = server.broadcast_keys()
    replies = _send(grid, {u: RecordDict({RECORD_KEY: make_record({
        "stage": "share_keys", "msg": blob, "pki_ids": list(cfg.holders(u)),
        "pki_keys": [pki[v] for v in cfg.holders(u)]})}) for u, blob in inbox.items()}, rnd)
    for r in replies.values():
        server.receive(_msg(r))
    inbox = server.forward_shares()
    fitins = FitIns(ndarrays_to_parameters([np.zeros(s, np.float32) for s in SHAPES]), {})
    out = {}
    for u, blob in inbox.items():
        content = compat.fitins_to_recorddict(fitins, True)
        content.config_records[RECORD_KEY] = make_record({"stage": "masked_input", "msg": blob})
        out[u] = content
    replies = _send(grid, out, rnd)
    ys = {u: decode(_msg(r)).y for u, r in replies.items()}
    # the split view: group A is told everyone survived, group B that the victim did not
    everyone = tuple(range(N))
    views = {u: everyone for u in GROUP_A} | {u: tuple(v for v in everyone if v != VICTIM) for u in GROUP_B}
    replies = _send(grid, {u: RecordDict({RECORD_KEY: make_record({"stage": "consistency", "msg": SurvivorList(
        cfg.instance, cfg.round, SERVER, u, survivors=views[u]).to_bytes()})}) for u in views}, rnd)
    sigs = {u: decode(_msg(r)).sig for u, r in replies.items()}
    replies = _send(grid, {u: RecordDict({RECORD_KEY: make_record({"stage": "unmask", "msg": UnmaskRequest(
        cfg.instance, cfg.round, SERVER, u, signatures=tuple((v, sigs[v]) for v in sorted(views)
                                                             if views[v] == views[u])).to_bytes()})})
                        for u in views}, rnd)
    b_shares, s_shares = [], []
    for u, r in sorted(replies.items()):
        for owner, kind, share in decode(_msg(r)).shares:
            if owner == VICTIM:
                (b_shares if kind == 0 else s_shares).append((u + 1, share))
    b = shamir.combine(b_shares[: cfg.t], t=cfg.t)
    s_key = KeyPair.from_private_bytes(shamir.combine(s_shares[: cfg.t], t=cfg.t))
    y = ys[VICTIM].copy()
    prg.expand_into(b, y, label=b"self", negate=True)
    for v in cfg.graph[VICTIM]:
        seed = s_key.agree(server.adverts[v][KEY_BYTES: 2 * KEY_BYTES], info=cfg.info(b"secagg/mask"))
        prg.expand_into(seed, y, label=b"pair", negate=VICTIM < v)
    enc = SetupConfig("secagg", N, DIM, 2, rnd, cfg.instance, VICTIM, (), FRAC_BITS, CLIP, MAX_WEIGHT, "nearest")
    return y, encode_update(enc, update_of(NODES[VICTIM]), examples_of(NODES[VICTIM]))


def test_a_server_cannot_switch_on_the_unsafe_threshold_through_the_setup_record():
    """The attack of item 4: the server's setup record says ``unsafe_threshold = true`` with
    ``t = 2`` of 5 holders. Before the fix every node honoured it and the victim's input came out;
    now no node whose operator did not opt in takes part (each answers the setup with an error),
    so the server holds nothing to split."""
    rebuilt, errors = split_view_through_the_mod(declare_unsafe=True)
    assert rebuilt is None, "the nodes took part: the server rebuilt the victim's input"
    assert sorted(errors) == list(range(N))


def test_only_the_nodes_own_opt_in_exposes_the_victim():
    """The stated limit, with its switch where it belongs: nodes whose operators set
    ``unsafe-threshold = true`` in their node config accept ``t = 2`` of 5 from a setup record
    that says nothing about it, and the same split view rebuilds the victim's input exactly."""
    rebuilt, actual = split_view_through_the_mod(declare_unsafe=False, node_config={"unsafe-threshold": True})
    assert rebuilt is not None and rebuilt.tolist() == actual.tolist()


def test_a_setup_record_still_declaring_unsafe_threshold_is_refused():
    """The field is gone from the wire: a record carrying it is refused as malformed, even by a node
    that opted in (the server has no say), and without opting in the node refuses the unsafe ``t``."""
    rebuilt, errors = split_view_through_the_mod(declare_unsafe=True, node_config={"unsafe-threshold": True})
    assert rebuilt is None and sorted(errors) == list(range(N))
    assert all("unexpected ['unsafe_threshold']" in why for why in errors.values()), errors
    rebuilt, errors = split_view_through_the_mod(declare_unsafe=False)
    assert rebuilt is None and sorted(errors) == list(range(N))
    assert all("at or below half of this client's 5 holders" in why for why in errors.values()), errors


# -- the node's settings: read from its config, checked, kept between stages --------------------
def test_node_policy_reads_typed_and_spelled_values_and_refuses_the_rest():
    assert node_policy({}) == ClientPolicy(min_survivors=2, unsafe_threshold=False, max_dropout=DEFAULT_DROPOUT)
    want = ClientPolicy(min_survivors=5, unsafe_threshold=True, max_dropout=0.25)
    assert node_policy({"min-survivors": 5, "unsafe-threshold": True, "max-dropout": 0.25}) == want
    assert node_policy({"min-survivors": "5", "unsafe-threshold": "TRUE", "max-dropout": "0.25"}) == want
    assert node_policy({"max-dropout": 0}).max_dropout == 0.0  # an int where a float is wanted
    for cfg, why in [({"min-survivors": 1}, "min_survivors must be an int >= 2"),
                     ({"min-survivors": 2.5}, "'min-survivors' must be int"),
                     ({"min-survivors": True}, "'min-survivors' must be int"),
                     ({"unsafe-threshold": 1}, "'unsafe-threshold' must be bool"),
                     ({"unsafe-threshold": "yes"}, "'unsafe-threshold' must be bool"),
                     ({"max-dropout": 1.0}, "max_dropout must be a fraction in"),
                     ({"max-dropout": "lots"}, "'max-dropout' must be float")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            node_policy(cfg)


def _drop_at_masked_input(*who: int):  # noqa: ANN202
    return lambda stage, nid: stage == STAGES.index("masked_input") + 1 and nid in who


def test_min_survivors_and_max_dropout_come_from_the_node_config(secagg_round):
    """Two of eight nodes go silent before their masked input. Nodes at the default max-dropout 0.1
    (one of eight) refuse to sign the survivor set and nothing is unmasked; nodes configured for
    0.25 sign and the server gets the six survivors' exact sum; nodes whose min-survivors is 7
    refuse the six. (The server plans for 0.25 in every case: what it plans does not reach the
    nodes.) A cohort of six is refused at setup by nodes whose min-survivors is 7."""
    nodes = [1000 + 17 * i for i in range(8)]
    drop = _drop_at_masked_input(nodes[2], nodes[5])
    survivors = [n for n in nodes if n not in (nodes[2], nodes[5])]
    for node_config, refusal in [(None, "more than the 1 this client's max_dropout = 0.1 allows"),
                                 ({"max-dropout": 0.25}, None),
                                 ({"max-dropout": 0.25, "min-survivors": 7}, "below this client's min_survivors = 7")]:
        res = secagg_round(8, protocol="secagg+", dropout=0.25, drop=drop, node_config=node_config)
        rep = res.report
        if refusal is None:
            assert rep.abort is None and rep.survivors == survivors
            assert np.array_equal(rep.total, res.oracle_total(rep.survivors))
        else:
            assert rep.abort is not None and "signed the survivor set" in rep.abort and rep.total is None
            refused = {nid for nid, (stage, why) in rep.dropped.items() if stage == "consistency" and refusal in why}
            assert refused == set(survivors), rep.dropped
            assert all(np.all(p == 0) for p in res.params)  # the model is unchanged
    res = secagg_round(6, protocol="secagg", node_config={"min-survivors": 7})
    assert res.report.abort is not None and {s for s, _ in res.report.dropped.values()} == {"setup"}
    assert all("below this client's min_survivors = 7" in why for _, why in res.report.dropped.values())


def test_the_node_state_keeps_the_policy_of_the_setup(secagg_round):
    """The policy is read once, at setup, and travels in the node's own state: a node config that
    changes mid-round (here to max-dropout 0.9 after the setup) changes nothing, and the record
    holds the policy's fields."""
    nodes = [1000 + 17 * i for i in range(8)]
    seen = []

    def later_looser(app):  # noqa: ANN001, ANN202
        def call(msg, ctx):  # noqa: ANN001, ANN202
            if msg.content.config_records[RECORD_KEY]["stage"] != "setup":
                ctx.node_config["max-dropout"] = 0.9
            out = app(msg, ctx)
            state = ctx.state.config_records.get(STATE_KEY)
            if state is not None:
                seen.append((state["policy_min_survivors"], state["policy_unsafe_threshold"],
                             state["policy_max_dropout"]))
            return out

        return call

    res = secagg_round(8, protocol="secagg+", dropout=0.25, drop=_drop_at_masked_input(nodes[2], nodes[5]),
                       wrap_app=later_looser, node_config={"min-survivors": 3})
    assert res.report.abort is not None and res.report.total is None
    assert any("max_dropout = 0.1 allows" in why for _, why in res.report.dropped.values())
    assert seen and set(seen) == {(3, False, DEFAULT_DROPOUT)}


# -- a ClientApp's own floor for one aggregation (the hook for FEL's distributed-DP noise) -------
VEC_DIM = 4


def _vector_of(nid: int) -> np.ndarray:
    return np.linspace(-1, 1, VEC_DIM) * (nid % 7 + 1) / 8


def _floor_app(floor, seen: list | None = None):  # noqa: ANN001, ANN202
    """A node whose ClientApp answers with a raw vector and, beside it, ``floor`` as its
    ``min_survivors`` (an array as given, or nothing for ``None``)."""

    def inner(msg, ctx):  # noqa: ANN001, ANN202
        rec = {"vector": Array(_vector_of(ctx.node_id))}
        if floor is not None:
            rec["min_survivors"] = Array(np.asarray(floor))
        return Message(RecordDict({VECTOR_KEY: ArrayRecord(rec)}), reply_to=msg)

    def app(msg, ctx):  # noqa: ANN001, ANN202
        out = secagg_mod(msg, ctx, inner)
        state = ctx.state.config_records.get(STATE_KEY)
        if seen is not None and state is not None:
            seen.append((msg.content.config_records[RECORD_KEY]["stage"], state["policy_min_survivors"]))
        return out

    return app


def _vector_round(floor, *, silent: tuple[int, ...] = (), seen: list | None = None):  # noqa: ANN001, ANN202
    nodes = [4000 + 7 * i for i in range(6)]
    grid = LoopbackGrid(_floor_app(floor, seen), nodes,
                        drop=lambda stage, nid: stage == STAGES.index("masked_input") + 1 and nid in silent)
    wf = SecAggWorkflow(protocol="secagg", rounding="nearest")
    rep, _ = wf.aggregate_vectors(grid, 1, {nid: RecordDict() for nid in nodes}, VEC_DIM)
    return nodes, wf, rep


def test_a_client_app_raises_the_survivor_floor_for_one_aggregation():
    """The ClientApp answers ``masked_input`` with its vector and ``min_survivors = 6`` beside it:
    with one of six nodes silent (within the node's default max-dropout), no node signs the five
    survivors and nothing is unmasked; with ``min_survivors = 5`` the five survivors' exact sum
    comes out and the node's state held the raised floor (5) from the masked input on, its node
    config's floor (2) before. A floor above the announced ``n`` is refused before masking."""
    nodes, _, rep = _vector_round(np.int64(6), silent=(4007,))
    assert rep.abort is not None and rep.total is None
    refused = {nid for nid, (stage, why) in rep.dropped.items()
               if stage == "consistency" and "5 survivors, below this client's min_survivors = 6" in why}
    assert refused == set(nodes) - {4007}
    seen: list = []
    nodes, wf, rep = _vector_round(np.int64(5), silent=(4007,), seen=seen)
    assert rep.abort is None and rep.survivors == [n for n in nodes if n != 4007]
    got = FixedPoint(wf.frac_bits, wf.clip).decode(rep.total)
    np.testing.assert_allclose(got, sum(_vector_of(n) for n in rep.survivors), atol=1e-8)
    assert {(stage, floor) for stage, floor in seen} == {("setup", 2), ("share_keys", 2), ("masked_input", 5),
                                                         ("consistency", 5)}
    nodes, _, rep = _vector_round(np.int64(7))
    assert rep.abort is not None and {s for s, _ in rep.dropped.values()} == {"masked_input"}
    assert all("n = 6 clients is below this input's min_survivors = 7" in why for _, why in rep.dropped.values())


@pytest.mark.parametrize(("floor", "why"), [
    (np.float64(5), "must be an int64 scalar >= 2; found float64"),
    (np.array([5], dtype=np.int64), "found int64 of shape (1,)"),
    (np.int64(1), "found int64 of shape () = 1"),
])
def test_a_malformed_floor_is_refused_and_the_node_dropped(floor, why):
    nodes, _, rep = _vector_round(floor)
    assert rep.abort is not None  # every node refused its own ClientApp's answer: nothing was masked
    assert {s for s, _ in rep.dropped.values()} == {"masked_input"}
    assert all(why in reason for _, reason in rep.dropped.values()), rep.dropped


# -- the circular chain on Flower: the server's min_survivors is a request, the node's a floor ---
def _chain_round(n: int, *, server_min: int = 2, node_config: dict | None = None, floor=None, seen=None):  # noqa: ANN001, ANN202
    nodes = [5000 + 11 * i for i in range(n)]

    def inner(msg, ctx):  # noqa: ANN001, ANN202
        rec = {"vector": Array(_vector_of(ctx.node_id))}
        if floor is not None:
            rec["min_survivors"] = Array(np.array(floor, dtype=np.int64))
        return Message(RecordDict({VECTOR_KEY: ArrayRecord(rec)}), reply_to=msg)

    def app(msg, ctx):  # noqa: ANN001, ANN202
        out = chain_mod(msg, ctx, inner)
        state = ctx.state.config_records.get(CHAIN_STATE_KEY)
        if seen is not None and state is not None:
            seen.add(state["min_survivors"])
        return out

    grid = LoopbackGrid(app, nodes, node_config=None if node_config is None else lambda nid: node_config)
    wf = ChainWorkflow(successors=1, min_survivors=server_min, rounding="nearest")
    return nodes, wf, wf.aggregate_vectors(grid, 1, {nid: RecordDict() for nid in nodes}, VEC_DIM)


def test_the_chain_client_takes_the_largest_floor_never_the_servers_alone():
    """Five nodes, a server asking for ``min_survivors = 2``: nodes whose node config says 6 refuse
    every ring of five (the round aborts, nothing is summed); nodes saying 5, or a ClientApp giving
    5 beside its vector, take part, and the node's chain state keeps the larger floor."""
    nodes, _, rep = _chain_round(5, node_config={"min-survivors": 6})
    assert rep.total is None and rep.abort is not None
    assert all("below min_survivors=6" in why for why in rep.dropped.values()), rep.dropped
    nodes, _, rep = _chain_round(5, floor=6)
    assert rep.total is None and all("below min_survivors=6" in why for why in rep.dropped.values())
    for kw in ({"node_config": {"min-survivors": 5}}, {"floor": 5}):
        seen: set = set()
        nodes, wf, rep = _chain_round(5, seen=seen, **kw)
        assert rep.abort is None and rep.survivors == nodes and seen == {5}
        got = FixedPoint(wf.frac_bits, wf.clip).decode(rep.total)
        np.testing.assert_allclose(got, sum(_vector_of(n) for n in nodes), atol=1e-8)
    seen = set()
    _chain_round(5, server_min=4, node_config={"min-survivors": 3}, seen=seen)
    assert seen == {4}  # the server may raise it
