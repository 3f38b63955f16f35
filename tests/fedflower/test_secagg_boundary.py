"""Attacks at the Flower boundary: bad records are refused with a typed error, the sender is dropped,
the round goes on, the server never crashes, and the aggregate is never wrong.

Each test is the attack that would succeed if the promise failed: the tampered reply would be
accepted (the node would stay among the survivors, or the sum would differ from the oracle).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from flwr.app import Error, Message, MessageType, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedflower.records import RECORD_KEY, STAGES, RecordError, read_record
from fedflower.secagg_mod import secagg_mod

STAGE_NO = {name: i + 1 for i, name in enumerate(STAGES)}
N = 7
NODES = [1000 + 17 * i for i in range(N)]
VICTIM = NODES[2]


def _rec(reply: Message):  # noqa: ANN202
    return reply.content.config_records[RECORD_KEY]


def _attack(stage: str, fn, who: int = VICTIM):  # noqa: ANN001, ANN202
    """A tamper hook applying ``fn(record, reply)`` to ``who``'s reply of ``stage``."""

    def tamper(s: int, nid: int, reply: Message):  # noqa: ANN202
        if s == STAGE_NO[stage] and nid == who:
            out = fn(_rec(reply), reply)
            return reply if out is None else out
        return reply

    return tamper


def _assert_dropped_and_correct(res, stage: str, error: str, reason: str = "") -> None:  # noqa: ANN001
    rep = res.report
    assert rep.abort is None, rep.abort
    assert VICTIM in rep.dropped, rep.dropped
    got_stage, why = rep.dropped[VICTIM]
    assert got_stage == stage and why.startswith(error + ":"), why
    assert reason in why
    in_sum = STAGE_NO[stage] > STAGE_NO["masked_input"]
    assert (VICTIM in rep.survivors) is in_sum
    assert set(rep.survivors) == set(NODES) - ({VICTIM} if not in_sum else set())
    assert np.array_equal(rep.total, res.oracle_total(rep.survivors))


def _truncate(rec, _r):  # noqa: ANN001, ANN202
    rec["msg"] = rec["msg"][:-1]


def _append(rec, _r):  # noqa: ANN001, ANN202
    rec["msg"] = rec["msg"] + b"\0"


def _drop_key(rec, _r):  # noqa: ANN001, ANN202
    del rec["msg"]


def _extra_key(rec, _r):  # noqa: ANN001, ANN202
    rec["note"] = b"x"


def _wrong_type(rec, _r):  # noqa: ANN001, ANN202
    rec["msg"] = [1, 2, 3]


def _wrong_stage_label(rec, _r):  # noqa: ANN001, ANN202
    rec["stage"] = "unmask" if rec["stage"] != "unmask" else "setup"


def _flip_last_byte(rec, _r):  # noqa: ANN001, ANN202
    m = bytearray(rec["msg"])
    m[-1] ^= 0x01
    rec["msg"] = bytes(m)


ATTACKS = [
    (_truncate, "MessageError", "truncated body"),
    (_append, "MessageError", "trailing bytes"),
    (_drop_key, "RecordError", "missing ['msg']"),
    (_extra_key, "RecordError", "unexpected ['note']"),
    (_wrong_type, "RecordError", "'msg' must be bytes"),
    (_wrong_stage_label, "RecordError", "out-of-order or replayed"),
]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("attack", "error", "reason"), ATTACKS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_malformed_record_drops_the_sender_only(secagg_round, stage, attack, error, reason):
    res = secagg_round(N, protocol="secagg", tamper=_attack(stage, attack))
    _assert_dropped_and_correct(res, stage, error, reason)


@pytest.mark.parametrize("stage", ["setup", "masked_input", "consistency"])
def test_tampered_signed_message_is_refused(secagg_round, stage):
    """A flipped bit in a signed message (advert, masked input, consistency signature)."""
    res = secagg_round(N, protocol="secagg", tamper=_attack(stage, _flip_last_byte))
    _assert_dropped_and_correct(res, stage, "AuthenticationError")


def test_message_of_another_stage_is_refused(secagg_round):
    """The node replays its setup-stage advert (relabelled) as its share-keys reply."""
    kept = {}

    def tamper(s, nid, reply):  # noqa: ANN001, ANN202
        if nid == VICTIM and s == 1:
            kept["advert"] = _rec(reply)["msg"]
        if nid == VICTIM and s == 2:
            _rec(reply)["msg"] = kept["advert"]
        return reply

    res = secagg_round(N, protocol="secagg", tamper=tamper)
    _assert_dropped_and_correct(res, "share_keys", "MessageError", "belongs to stage ADVERTISE")


def test_duplicate_reply_is_refused_and_the_first_counts(secagg_round):
    res = secagg_round(N, protocol="secagg", tamper=_attack("masked_input", lambda rec, r: [r, r]))
    rep = res.report
    assert rep.abort is None and VICTIM in rep.survivors and VICTIM not in rep.dropped
    assert any(nid == VICTIM and "replayed" in why for nid, _, why in rep.refused)
    assert np.array_equal(rep.total, res.oracle_total(NODES))  # counted once


def test_reply_from_a_node_not_asked_is_refused(secagg_round):
    def inject(rec, r):  # noqa: ANN001, ANN202
        fake = Message(r.content, reply_to=r)  # same content, but claims another source
        fake.metadata.__dict__["_src_node_id"] = 424242
        return [r, fake]

    res = secagg_round(N, protocol="secagg", tamper=_attack("masked_input", inject))
    rep = res.report
    assert rep.abort is None and 424242 not in rep.survivors
    assert any(nid == 424242 and "not asked" in why for nid, _, why in rep.refused)
    assert np.array_equal(rep.total, res.oracle_total(NODES))


def test_impersonating_another_client_is_refused(secagg_round):
    """The victim's share-keys reply re-addressed as client 0's (EncryptedShares are not signed)."""

    def as_client0(rec, r):  # noqa: ANN001, ANN202
        m = bytearray(rec["msg"])
        struct.pack_into(">I", m, 28, 0)  # the header's sender field
        rec["msg"] = bytes(m)

    res = secagg_round(N, protocol="secagg", tamper=_attack("share_keys", as_client0))
    _assert_dropped_and_correct(res, "share_keys", "RecordError", "as client 0")


def _error_reply(rec, r):  # noqa: ANN001, ANN202
    err = Message(Error(7, "boom"), reply_to=r)
    err.metadata.__dict__["_src_node_id"] = r.metadata.src_node_id
    return err


def test_error_reply_drops_the_node(secagg_round):
    res = secagg_round(N, protocol="secagg", tamper=_attack("consistency", _error_reply))
    _assert_dropped_and_correct(res, "consistency", "ClientFailed", "boom")


def test_identity_key_of_wrong_length_or_of_another_node(secagg_round):
    res = secagg_round(N, protocol="secagg", tamper=_attack("setup", lambda rec, r: rec.__setitem__("identity", b"\1" * 31)))
    _assert_dropped_and_correct(res, "setup", "RecordError", "32-byte")
    stolen = {}

    def steal(s, nid, reply):  # noqa: ANN001, ANN202
        if s == 1 and nid == NODES[0]:
            stolen["id"] = _rec(reply)["identity"]
        if s == 1 and nid == VICTIM:
            _rec(reply)["identity"] = stolen["id"]
        return reply

    res = secagg_round(N, protocol="secagg", tamper=steal)
    _assert_dropped_and_correct(res, "setup", "RecordError", "another node's identity")


def test_replay_from_an_earlier_round_and_a_changed_identity_are_refused(secagg_round):
    """Round 2 reuses the workflow (identities pinned in round 1) and the nodes' contexts."""
    from fedflower.loopback import fit_round

    res = secagg_round(N, protocol="secagg")
    kept = {}
    res.grid.tamper = lambda s, nid, r: kept.setdefault((s, nid), r)
    # capture a second aggregation, then replay its masked input in the third
    init = [np.zeros(s, np.float32) for s in res.shapes]
    fit_round(res.wf, res.grid, init, server_round=2)
    end2 = res.grid.stage_no  # stages are numbered across rounds: round 2 ended here
    old = kept[(end2 - 2, VICTIM)]  # round 2's masked-input reply of the victim

    def replay(s, nid, r):  # noqa: ANN001, ANN202
        if nid == VICTIM and s == end2 + STAGE_NO["masked_input"]:
            _rec(r)["msg"] = _rec(old)["msg"]
        return r

    res.grid.tamper = replay
    fit_round(res.wf, res.grid, init, server_round=3)
    rep = res.wf.last_report
    assert rep.abort is None and VICTIM in rep.dropped and VICTIM not in rep.survivors
    assert rep.dropped[VICTIM][0] == "masked_input"
    assert "another protocol instance" in rep.dropped[VICTIM][1] or "wrong round" in rep.dropped[VICTIM][1]

    res.grid.tamper = lambda s, nid, r: (_rec(r).__setitem__("identity", bytes(32)) or r) if nid == VICTIM and _rec(
        r).get("stage") == "setup" else r
    fit_round(res.wf, res.grid, init, server_round=4)
    rep = res.wf.last_report
    assert rep.dropped[VICTIM][0] == "setup" and "pinned" in rep.dropped[VICTIM][1]


# -- the client side: what the mod refuses --------------------------------------------------------
def _evil_server(app, stage: str, fn):  # noqa: ANN001, ANN202
    """Wrap the ClientApp: the server->client record of ``stage`` is altered by ``fn``."""

    def call(msg, ctx):  # noqa: ANN001, ANN202
        rec = msg.content.config_records.get(RECORD_KEY)
        if rec is not None and rec.get("stage") == stage and msg.metadata.dst_node_id == VICTIM:
            fn(rec)
        return app(msg, ctx)

    return call


@pytest.mark.parametrize(
    ("stage", "fn", "reason"),
    [
        ("setup", lambda rec: rec.__setitem__("extra", 1), "unexpected ['extra']"),
        ("setup", lambda rec: rec.__setitem__("t", 1), "at or below half"),
        ("setup", lambda rec: rec.__setitem__("neighbours", [0, 0]), "sorted, distinct"),
        ("share_keys", lambda rec: rec.__delitem__("pki_keys"), "missing ['pki_keys']"),
        ("share_keys", lambda rec: rec.__setitem__("pki_keys", [bytes(32)] * len(rec["pki_ids"])), "wrong identity"),
        ("masked_input", lambda rec: rec.__setitem__("msg", rec["msg"][:-3]), "truncated"),
        ("consistency", lambda rec: rec.__setitem__("stage", "unmask"), "RecordError"),
    ],
)
def test_client_refuses_bad_server_records(secagg_round, stage, fn, reason):
    """The server (or the network) sends the victim a bad record: the victim's mod raises a typed
    error, Flower returns an error reply, the server drops the victim and finishes without it."""
    res = secagg_round(N, protocol="secagg", wrap_app=lambda app: _evil_server(app, stage, fn))
    _assert_dropped_and_correct(res, stage, "ClientFailed", reason)


def test_train_message_without_our_record_is_refused(monkeypatch):
    """A client with the mod never trains (and uploads) outside secure aggregation."""
    from flwr.app import Context
    from flwr.supercore.task_identity import TaskIdentity

    # what a ServerApp's runtime sets before it creates messages (fedflower.loopback sets it too, so
    # without this the test passed only after another test in the same worker had built a grid)
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)
    msg = Message(RecordDict(), dst_node_id=5, message_type=MessageType.TRAIN)
    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    called = []
    with pytest.raises(RecordError, match="only trains through secure aggregation"):
        secagg_mod(msg, ctx, lambda m, c: called.append(m))
    assert called == []
    # other message types pass through untouched
    ev = Message(RecordDict(), dst_node_id=5, message_type=MessageType.EVALUATE)
    secagg_mod(ev, ctx, lambda m, c: called.append(m))
    assert called == [ev]


def test_read_record_rejects_non_records():
    with pytest.raises(RecordError, match="no 'secagg-fedrec'"):
        read_record(RecordDict(), stage="setup", direction="to_server")
    with pytest.raises(RecordError, match="not a RecordDict"):
        read_record(b"junk", stage="setup", direction="to_server")  # type: ignore[arg-type]


# -- random corruption --------------------------------------------------------------------------
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stage=st.sampled_from(STAGES), kind=st.sampled_from(["flip", "cut", "key", "label"]), pos=st.integers(0, 2**20),
       bit=st.integers(0, 7), protocol=st.sampled_from(["secagg", "secagg+"]))
def test_random_corruption_never_crashes_or_corrupts_the_sum(secagg_round, stage, kind, pos, bit, protocol):
    def corrupt(rec, r):  # noqa: ANN001, ANN202
        m = bytearray(rec["msg"])
        if kind == "flip":
            m[pos % len(m)] ^= 1 << bit
            rec["msg"] = bytes(m)
        elif kind == "cut":
            rec["msg"] = bytes(m[: pos % len(m)])
        elif kind == "key":
            rec[f"k{pos}"] = pos
        else:
            rec["stage"] = STAGES[(STAGES.index(stage) + 1 + pos % 4) % 5]

    res = secagg_round(N, protocol=protocol, tamper=_attack(stage, corrupt))
    rep = res.report
    if rep.total is not None:  # never a wrong sum: the survivors' exact sum, or a clean abort
        assert np.array_equal(rep.total, res.oracle_total(rep.survivors))
    else:
        assert rep.abort and all(np.all(p == 0) for p in res.params)
    # every refusal is a typed error of ours (nothing unexpected slipped through)
    assert all(why.split(":")[0] in {"RecordError", "MessageError", "AuthenticationError", "ClientFailed"}
               for _, _, why in rep.refused)
    if kind != "flip":  # structural corruption is always caught at the boundary
        assert VICTIM in rep.dropped and rep.dropped[VICTIM][0] == stage
