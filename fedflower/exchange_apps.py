"""Protocols whose round is named exchanges (:mod:`protocols.exchange`) on Flower.

The server half's generator (``device_round``) runs unchanged in the ServerApp; every
:class:`protocols.exchange.Exchange` it yields becomes Flower ``train`` messages to the cohort's
nodes, and what comes back becomes the :class:`protocols.exchange.Replies` it is sent:

* **plaintext exchange**: one message per member, content ``run`` (protocol, config, seed, round),
  ``exchange`` (the step's ``kind`` and its index in the round), ``broadcast`` (the arrays every
  member receives) and ``own`` (the member's per-user arrays, if any). The node builds the
  protocol's client half on its own partition (:func:`fedflower.adapter.build_client_trainer`),
  restores its own state, runs ``device_step`` for its user, keeps its new state and answers
  with one ArrayRecord ``reply``. The server checks the reply's records and keys, then the
  exchange's own ``validate`` (:meth:`protocols.exchange.Exchange.check_reply`); a silent, late,
  failed, duplicated or refused reply drops that client from the exchange with the reason;
* **secure exchange** (``Exchange.secure``): the same content rides on the ``masked_input``
  stage of our SecAgg/SecAgg+ (:meth:`fedflower.secagg_workflow.SecAggWorkflow.aggregate_vectors`);
  the node's step answers with its ``vector``, which :func:`fedflower.secagg_mod.secagg_mod`
  encodes, masks and removes, so the server only learns the decoded sum over the survivors. One
  workflow per distinct encoding (``frac_bits``, ``value_clip``, protocol, dropout, corrupt), all
  sharing one table of pinned identity keys for the run.

Before any step the node admits it through its own guard (:mod:`protocols.guard`, the same
rules as in process and on simulated devices): rounds only move forward, a secure step is
answered once per round, a once-per-instance step once, no plaintext where the configuration
promises a sum (or, with ``require-secagg=true``, anywhere), and the protocol's own refusals
(``device_check``, e.g. FedFast's own-cluster rule, FedCL's one embedding upload per round); a
local-DP upload is charged to the node's own count, refused beyond its ``ldp-epsilon-budget``; a
secure step's request that arrives outside the ``masked_input`` stage is refused too. The guard's record is written to the node's
``Context.state`` (and, with a ``state-dir``, to its disk) *before* the step runs, so neither a
crash nor a resumed run lets the node answer a step twice. The node's state (``device_state``)
lives in its ``Context.state`` between steps and, with a ``state-dir``, in one file per round on
its own disk, so a resumed run continues from the state after the last round the server
completed (:func:`load_device_state`).

A grouped secure exchange (:attr:`protocols.exchange.Exchange.groups`) runs one SecAgg instance per
group; a group too small for SecAgg+'s targets runs as SecAgg (:func:`protocols.secure_sum.small_cohort_protocol`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from protocols.exchange import Exchange, Replies, admit_step, group_members, merge_groups
from protocols.guard import DevicePolicy, RefusedStep, StepGuard, device_guard, set_device_policy
from protocols.secure_sum import small_cohort_protocol
from protocols.transport import client
from secagg.bonawitz_wire import MaskedInput
from secagg.encoding import FixedPoint

__all__ = ["EXCHANGE_KEY", "answer_exchange", "client_exchange", "load_device_state", "save_device_state"]

#: The config record that marks a ``train`` message as one step of an exchange protocol.
EXCHANGE_KEY = "exchange"
_CTX_STATE = "fedflower.device_state"
_CTX_ROUND = "fedflower.device_state_round"
_CTX_GUARD = "fedflower.step_guard"


def _np(a: np.ndarray):
    from flwr.app import Array

    return Array(np.array(a, copy=True, order="C"))


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


# -- the node's own state -------------------------------------------------------------------------
def _node_dir(directory: str | Path, partition_id: int) -> Path:
    return Path(directory) / f"node-{int(partition_id):07d}.exchange"


def load_device_state(directory: str | Path, partition_id: int, before_round: int) -> dict[str, np.ndarray] | None:
    """The client's state after its latest round ``< before_round`` (``None``: it never took part).

    Entries of rounds at or after ``before_round`` belong to rounds the server never completed
    (a run killed mid-round and resumed from its checkpoint) and are ignored.
    """
    d = _node_dir(directory, partition_id)
    if not d.is_dir():
        return None
    rounds = sorted(int(p.stem[1:]) for p in d.glob("r*.npz") if p.stem[1:].isdigit())
    ok = [r for r in rounds if r < int(before_round)]
    if not ok:
        return None
    with np.load(d / f"r{ok[-1]:07d}.npz", allow_pickle=False) as z:
        return {k: z[k].copy() for k in z.files}


def save_device_state(directory: str | Path, partition_id: int, round_: int, state: dict[str, np.ndarray]) -> None:
    """Record the client's state after a step of ``round_`` (atomically; later rounds' entries dropped)."""
    d = _node_dir(directory, partition_id)
    d.mkdir(parents=True, exist_ok=True)
    for p in d.glob("r*.npz"):
        if p.stem[1:].isdigit() and int(p.stem[1:]) > int(round_):
            p.unlink()
    tmp = d / f"r{int(round_):07d}.tmp.npz"
    np.savez(tmp, **{k: np.asarray(v) for k, v in state.items()})
    tmp.replace(d / f"r{int(round_):07d}.npz")


def _guard_file(directory: str | Path, partition_id: int) -> Path:
    return _node_dir(directory, partition_id) / "guard.npz"


def load_guard(context: Context, store: str | None, pid: int) -> dict[str, np.ndarray] | None:
    """The node's step-guard record (:class:`protocols.guard.StepGuard`): from its disk when it keeps
    one (it survives restarts and resumed runs), else from its Flower context."""
    if store is not None:
        f = _guard_file(store, pid)
        if not f.is_file():
            return None
        with np.load(f, allow_pickle=False) as z:
            return {k: z[k].copy() for k in z.files}
    rec = context.state.array_records.get(_CTX_GUARD)
    return None if rec is None else _arrays(rec)


def save_guard(context: Context, store: str | None, pid: int, state: dict[str, np.ndarray]) -> None:
    """Write the node's step-guard record (atomically on disk), before the step it admits runs."""
    context.state[_CTX_GUARD] = ArrayRecord({k: _np(np.asarray(v)) for k, v in state.items()})
    if store is not None:
        d = _node_dir(store, pid)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "guard.tmp.npz"
        np.savez(tmp, **{k: np.asarray(v) for k, v in state.items()})
        tmp.replace(_guard_file(store, pid))


def _restore(context: Context, store: str | None, pid: int, round_: int) -> dict[str, np.ndarray] | None:
    """The state to start a step of ``round_`` from: an earlier step of the same round (this run's
    context), else the node's store (after the last round before ``round_``), else the context."""
    rec = context.state.array_records.get(_CTX_STATE)
    at = context.state.config_records.get(_CTX_ROUND)
    if rec is not None and at is not None and int(at["round"]) == int(round_):
        return _arrays(rec)
    if store is not None:
        return load_device_state(store, pid, round_)
    return None if rec is None else _arrays(rec)


def _keep(context: Context, store: str | None, pid: int, round_: int, state: dict[str, np.ndarray]) -> None:
    context.state[_CTX_STATE] = ArrayRecord({k: _np(np.asarray(v)) for k, v in state.items()})
    context.state[_CTX_ROUND] = ConfigRecord({"round": int(round_)})
    if store is not None:
        save_device_state(store, pid, round_, state)


# -- the client half ------------------------------------------------------------------------------
def client_exchange(msg: Message, context: Context, trainer: Any, part: Any, run: ConfigRecord, *, secure: bool,
                    require_secure: bool, store: str | None, vector_key: str,
                    policy: DevicePolicy | None = None) -> RecordDict:
    """Run the step a ``train`` message asks for on this node's own data; the reply's content.

    The step is admitted first by the node's guard (``policy``: its operator's
    :class:`protocols.guard.DevicePolicy`; ``require_secure`` forces its ``require_secure``), whose
    record is persisted before the step runs."""
    head = msg.content[EXCHANGE_KEY]
    kind, round_, user = str(head["kind"]), int(run["round"]), int(part.user)
    policy = policy or DevicePolicy()
    if require_secure and not policy.require_secure:
        policy = DevicePolicy(**{**policy.__dict__, "require_secure": True})
    set_device_policy(trainer, policy)
    guard: StepGuard = device_guard(trainer)
    kept = load_guard(context, store, part.partition_id)
    if kept is not None:
        guard.load_state(user, kept)
    state = _restore(context, store, part.partition_id, round_)
    if state is not None:
        trainer.load_device_state(user, state)
    broadcast = _arrays(msg.content["broadcast"])
    own = _arrays(msg.content["own"]) if "own" in msg.content.array_records else None
    try:
        admit_step(trainer, kind, round_, user, broadcast, own or {}, secure=secure)
    except RefusedStep as exc:
        raise ValueError(f"refused: {exc}") from None
    save_guard(context, store, part.partition_id, guard.state(user))
    out = trainer.device_step(kind, round_, np.array([user], np.int64), broadcast, {} if own is None else {user: own})
    if user not in out:
        raise ValueError(f"step {kind!r} produced no reply for this client")
    reply = {k: np.asarray(v) for k, v in out[user].items()}
    _keep(context, store, part.partition_id, round_, trainer.device_state(user))
    if secure:
        if set(reply) != {"vector"}:
            raise ValueError(f"a secure step must reply with exactly 'vector'; step {kind!r} gave {sorted(reply)}")
        return RecordDict({vector_key: ArrayRecord({"vector": _np(np.asarray(reply["vector"], np.float64))})})
    return RecordDict({"reply": ArrayRecord({k: _np(v) for k, v in reply.items()})})


def client_score_setup(trainer: Any, part: Any, model: dict[str, np.ndarray], context: Context, store: str | None,
                       round_: int, sent_state: dict[str, np.ndarray] | None = None) -> None:
    """Install the global arrays the server sent and the client's own state, for scoring.

    ``sent_state``: the user's state as the server holds it, for a protocol whose server keeps the
    user vectors (plaintext FedFast's mirror, ``device_state_from_server``); it replaces the node's.
    """
    trainer.load_device_model(model)
    state = sent_state if sent_state is not None else _restore(context, store, part.partition_id, round_)
    if state is not None:
        trainer.load_device_state(int(part.user), state)


# -- the server half ------------------------------------------------------------------------------
def collect(grid: Any, msgs: list[Message], timeout: float) -> tuple[dict[int, Message], set[int]]:
    """Send ``msgs`` and gather the replies by sender node; a node that answered more than once is
    in the second set (which reply is genuine is unknowable: the caller drops it)."""
    replies: dict[int, Message] = {}
    duplicated: set[int] = set()
    for m in grid.send_and_receive(msgs, timeout=timeout):
        nid = m.metadata.src_node_id
        if nid in replies:
            duplicated.add(nid)
        replies[nid] = m
    return replies, duplicated


def reply_record(reply: Message | None, duplicated: bool, key: str) -> ArrayRecord:
    """The one ArrayRecord ``key`` of a client's reply; ``ValueError`` (the client is dropped, with
    the reason) if it is missing, duplicated, an error, or holds other records."""
    if reply is None:
        raise ValueError("no reply before the timeout")
    if duplicated:
        raise ValueError("more than one reply from its node")
    if reply.has_error():
        raise ValueError(f"client error: {reply.error.reason}")
    if set(reply.content.keys()) != {key} or len(reply.content.array_records) != 1:
        raise ValueError(f"reply records {sorted(reply.content.keys())}; expected ['{key}']")
    return reply.content[key]


def answer_exchange(gt: Any, ex: Exchange, step: int) -> Replies:
    """One exchange over the grid of :class:`fedflower.apps.GridTrainer` ``gt``."""
    t = int(gt.server.round)
    users = [int(u) for u in ex.users.tolist()]
    unknown = [u for u in users if u not in gt.node_of]
    dropped = {u: "no node holds this user" for u in unknown}
    users = [u for u in users if u not in dropped]
    bcast = ArrayRecord({k: _np(np.asarray(v)) for k, v in ex.broadcast.items()})
    head = ConfigRecord({"kind": ex.kind, "step": int(step)})
    contents: dict[int, RecordDict] = {}
    for u in users:
        rd = RecordDict({"run": gt._run_record(u, round=t, secure=ex.secure is not None), EXCHANGE_KEY: head,
                         "broadcast": bcast})
        if u in ex.per_user:
            own = ArrayRecord({k: _np(np.asarray(v)) for k, v in ex.per_user[u].items()})
            rd["own"] = own
            gt.flower_bytes["down"] += own.count_bytes()
        contents[u] = rd
    gt.flower_bytes["down"] += len(users) * bcast.count_bytes()
    if ex.secure is not None:
        return _secure(gt, ex, t, contents, dropped)
    msgs = [Message(c, dst_node_id=gt.node_of[u], message_type="train", group_id=f"{t}.{step}")
            for u, c in contents.items()]
    replies, duplicated = collect(gt.grid, msgs, gt.timeout)
    values: dict[int, Any] = {}
    for u in users:
        nid = gt.node_of[u]
        try:
            rec = reply_record(replies.get(nid), nid in duplicated, "reply")
            gt.flower_bytes["up"] += rec.count_bytes()
            values[u] = ex.check_reply(u, _arrays(rec))
        except (ValueError, TypeError, KeyError) as exc:
            dropped[u] = str(exc)
    return Replies(values=values, dropped=dropped)


def _secure(gt: Any, ex: Exchange, t: int, contents: dict[int, RecordDict], dropped: dict[int, str]) -> Replies:
    """A secure exchange: one secure aggregation over the reachable members, or one per group."""
    if ex.groups is None:
        return _secure_one(gt, ex, t, contents, dropped)
    parts = {g: _secure_one(gt, ex, t, {u: contents[u] for u in members}, {})
             for g, members in group_members(ex, [u for u in ex.users.tolist() if u in contents]).items()}
    return merge_groups(parts, dropped)


def _secure_one(gt: Any, ex: Exchange, t: int, contents: dict[int, RecordDict], dropped: dict[int, str]) -> Replies:
    spec = ex.secure
    assert spec is not None
    transport = gt.server.transport
    if len(contents) < 2:
        return Replies(dropped={**dropped, **{u: "secure aggregation aborted" for u in contents}},
                       aborted=f"secure aggregation needs at least 2 clients; {len(contents)} can be reached")
    if spec.protocol not in ("secagg", "secagg+", "chain"):
        raise ValueError(f"secure aggregation {spec.protocol!r} does not run on Flower; use secagg, secagg+ or chain")
    if spec.dropouts:
        raise ValueError("simulated dropouts do not run on Flower (its dropouts are real); unset them")
    if spec.protocol == "chain":
        return _chain(gt, ex, t, contents, dropped)
    run_as = small_cohort_protocol(spec.protocol, len(contents), dropout=spec.dropout, corrupt=spec.corrupt,
                                   k=spec.k, t=spec.t)
    wf = gt.exchange_workflow(spec if run_as == spec.protocol else dataclasses.replace(spec, protocol=run_as))
    user_of = {gt.node_of[u]: u for u in contents}
    keep = bool(transport.transcript.keep_payloads)
    try:
        rep, run = wf.aggregate_vectors(gt.grid, t, {gt.node_of[u]: c for u, c in contents.items()}, spec.width,
                                        keep_masked=keep)
    except ValueError as exc:  # no SecAgg(+) parameters for this many clients (or over the bit budget)
        return Replies(dropped={**dropped, **{u: "secure aggregation aborted" for u in contents}},
                       aborted=f"secure aggregation refused to start with {len(contents)} clients: {exc}")
    for stage, idx, nbytes in run.sizes:  # the server's transcript, as secure_sum records it in process
        u = user_of[rep.node_ids[idx]]
        payload = MaskedInput.from_bytes(run.masked[idx]).y if keep and stage == "masked_input" else None
        transport.send(client(u), spec.receiver, t, spec.kind if stage == "masked_input" else f"secagg:{stage}",
                       payload, nbytes)
    n = len(contents)
    for u in contents:
        transport.send(spec.receiver, client(u), t, f"{run_as}:server", None, rep.bytes_to_clients // n)
    for nid, (stage, why) in rep.dropped.items():
        dropped[user_of[nid]] = f"{stage}: {why}"
    return _replies(gt, spec, rep, user_of, dropped, n)


def _chain(gt: Any, ex: Exchange, t: int, contents: dict[int, RecordDict], dropped: dict[int, str]) -> Replies:
    """A secure exchange through the circular chain (:class:`fedflower.chain_flower.ChainWorkflow`)."""
    from fedflower.chain_flower import ChainWorkflow

    spec = ex.secure
    assert spec is not None
    wf = ChainWorkflow(successors=spec.k or 1, clipping_range=float(spec.value_clip), frac_bits=spec.frac_bits,
                       rounding="nearest", timeout=gt.timeout)
    user_of = {gt.node_of[u]: u for u in contents}
    try:
        rep = wf.aggregate_vectors(gt.grid, t, {gt.node_of[u]: c for u, c in contents.items()}, spec.width)
    except ValueError as exc:  # over the bit budget for this many clients
        return Replies(dropped={**dropped, **{u: "secure aggregation aborted" for u in contents}},
                       aborted=f"the chain refused to start with {len(contents)} clients: {exc}")
    n = len(contents)
    for u in contents:  # the chain's sizes, per client (its relays are many small messages)
        gt.server.transport.send(client(u), spec.receiver, t, spec.kind, None, rep.bytes_from_clients // n)
        gt.server.transport.send(spec.receiver, client(u), t, "chain:server", None, rep.bytes_to_clients // n)
    for nid, why in rep.dropped.items():
        dropped[user_of[nid]] = why
    return _replies(gt, spec, rep, user_of, dropped, n)


def _replies(gt: Any, spec: Any, rep: Any, user_of: dict[int, int], dropped: dict[int, str], n: int) -> Replies:
    """What a secure exchange returns (SecAgg's or the chain's report): the decoded sum over the
    survivors, or the abort; its bytes counted in the run's Flower totals."""
    gt.flower_bytes["up"] += rep.bytes_from_clients
    gt.flower_bytes["down"] += rep.bytes_to_clients
    common = {"bytes_per_client": (rep.bytes_from_clients + rep.bytes_to_clients) / n,
              "client_seconds": rep.wait_s / n, "server_seconds": rep.server_s}
    if rep.total is None:
        return Replies(dropped=dropped, aborted=str(rep.abort), **common)
    total = FixedPoint(spec.frac_bits, max(spec.value_clip, 1.0)).decode(rep.total)
    survivors = np.asarray(sorted(user_of[nid] for nid in rep.survivors), np.int64)
    return Replies(total=np.asarray(total, np.float64), survivors=survivors, dropped=dropped, **common)
