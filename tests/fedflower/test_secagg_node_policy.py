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

import numpy as np
from flwr.app import Message, MessageType, RecordDict
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat

from fedflower.loopback import LoopbackGrid
from fedflower.records import RECORD_KEY, SetupConfig, make_record
from fedflower.secagg_mod import encode_update
from secagg import prg, shamir
from secagg.bonawitz import MaskingConfig, MaskingServer, SurvivorList, UnmaskRequest
from secagg.graph import complete_graph
from secagg.keys import KEY_BYTES, KeyPair
from secagg.messages import SERVER, decode

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
