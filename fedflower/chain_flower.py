"""The circular share chain (:mod:`secagg.chain`) inside Flower: ``ChainWorkflow`` and ``chain_mod``.

A drop-in pair like :class:`fedflower.secagg_workflow.SecAggWorkflow` /
:func:`fedflower.secagg_mod.secagg_mod`, for the fit stage of a ServerApp's ``DefaultWorkflow``::

    workflow = DefaultWorkflow(fit_workflow=ChainWorkflow(successors=2))
    app = ClientApp(client_fn=client_fn, mods=[chain_mod])

Parties, adversary, promise and limits: those of :mod:`secagg.chain`, with the SuperLink and the
ServerApp together in the role of the relaying server (honest but curious: it follows the
protocol and relays every message; a tampered, replayed, truncated or misrouted message is
refused by our decoders). The server learns ``sum(w_i * [1, clip(parameters_i)])`` over the
clients that completed the round's final attempt (``w_i = num_examples_i / max_weight``), and
nothing else about one client unless it colludes with that client's ``s`` ring predecessors and
``s`` ring successors (the stated limit of the chain).

Messages: one Flower ``TRAIN`` round trip per chain stage, each carrying one ConfigRecord under
:data:`CHAIN_KEY` whose keys are checked exactly (:func:`_read`):

* ``setup`` (server -> client): the round's public parameters (instance, round, dim, ``s``,
  ``min_survivors``, ``max_attempts``), the client's id in the chain and the encoding, plus the
  FitIns. The mod runs the ClientApp (training), encodes ``[w, w * parameters]`` in fixed point
  (:func:`fedflower.secagg_mod.encode_update`), keeps the encoding in the node's own state and
  answers with the chain's ADVERT (the FitRes goes back with its arrays emptied). The server's
  ``min_survivors`` is only a request: the client refuses every ring smaller than the largest of
  it, its node's own ``min-survivors`` (:func:`fedflower.client_state.node_policy`) and, for a raw
  vector, the ClientApp's ``"min_survivors"`` beside it (:func:`fedflower.secagg_mod.vector_floor`),
  and keeps that floor in its state, so a server can raise it but never lower it;
* ``relay`` (both directions, repeated): one :mod:`secagg.chain_wire` message in its wire form
  (RING, BUNDLE, DELIVERY, UPLOAD, UNLOCK_REQUEST, UNLOCK). The chain's re-run rule may restart an
  attempt after a dropout, so the number of relays per round is not fixed; the server stops when
  :class:`secagg.chain_server.ChainServer` is done or aborts.

A node that does not answer within ``timeout``, answers with an error, or sends a record or wire
message our checks refuse is treated as a dropout (the chain's own rules decide whether the
attempt restarts or the round aborts); nothing a client sends crashes the server. An aborted round
leaves the model unchanged (:attr:`ChainWorkflow.last_report`).

Client state between messages lives in the node's ``Context.state`` (:data:`CHAIN_STATE_KEY`:
its X25519 key, the seeds it sent, its pad, the encoded input; typed values, never pickled). It is
deleted when the client fails, and replaced by the next round's setup: a client cannot know that a
round is over (after its UNLOCK the chain's rule 2 may still send it a re-run's RING), so unlike
SecAgg's it outlives the round's last message on the node (never leaving it). The collusion logs of :class:`secagg.chain.ChainClient`
(``known_seeds``/``known_pads``, for attack demonstrations) are not kept across Flower messages.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import cast

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common import parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.serverapp.grid import Grid

from fedflower.client_state import node_policy
from fedflower.records import RecordError, check_record, make_record
from fedflower.secagg_mod import VECTOR_KEY, encode_update, encode_vector, vector_floor
from fedflower.secagg_workflow import begin_fit, finish_fit
from secagg.chain import ChainClient, ChainConfig, ClientStage
from secagg.chain_server import ChainServer
from secagg.encoding import FixedPoint, check_budget
from secagg.errors import AbortError, SecAggError
from secagg.keys import KeyPair
from secagg.messages import INSTANCE_BYTES, decode

__all__ = ["CHAIN_KEY", "CHAIN_STATE_KEY", "ChainReport", "ChainWorkflow", "chain_mod"]

log = logging.getLogger(__name__)

#: Key of the chain's ConfigRecord in every Flower message of the protocol.
CHAIN_KEY = "secagg-fedrec.chain"
#: Key of the client's chain state in ``Context.state.config_records`` (node-local).
CHAIN_STATE_KEY = "secagg-fedrec.chain.state"
ROUNDINGS = ("stochastic", "nearest")

_SETUP = {"stage": str, "instance": bytes, "round": int, "dim": int, "successors": int, "min_survivors": int,
          "max_attempts": int, "client": int, "frac_bits": int, "clip": float, "max_weight": float, "rounding": str}
_TO_CLIENT = {"setup": _SETUP, "relay": {"stage": str, "msg": bytes}}
_TO_SERVER = {"setup": {"stage": str, "msg": bytes}, "relay": {"stage": str, "msg": bytes}}


def _read(content: RecordDict, stage: str, direction: str, where: str) -> dict[str, object]:
    """Our record of ``stage`` with exactly its keys and types; raises :class:`RecordError`."""
    spec = (_TO_CLIENT if direction == "to_client" else _TO_SERVER)[stage]
    return check_record(content, CHAIN_KEY, spec, stage, f"chain stage {stage.upper()} at {where}")


@dataclass(frozen=True)
class _Encoding:
    """What :func:`fedflower.secagg_mod.encode_update` reads from a setup."""

    dim: int
    clip: float
    frac_bits: int
    max_weight: float
    rounding: str


def _setup_client(vals: dict[str, object]) -> tuple[ChainConfig, int, _Encoding]:
    head = "chain stage SETUP"
    inst = cast(bytes, vals["instance"])
    if len(inst) != INSTANCE_BYTES:
        raise RecordError(f"{head}: instance must be {INSTANCE_BYTES} bytes; found {len(inst)}")
    if vals["rounding"] not in ROUNDINGS:
        raise RecordError(f"{head}: unknown rounding {vals['rounding']!r}; expected one of {ROUNDINGS}")
    try:
        cfg = ChainConfig(instance=bytes(inst), round=cast(int, vals["round"]), dim=cast(int, vals["dim"]),
                          successors=cast(int, vals["successors"]), min_survivors=cast(int, vals["min_survivors"]),
                          max_attempts=cast(int, vals["max_attempts"]))
        enc = _Encoding(cfg.dim, cast(float, vals["clip"]), cast(int, vals["frac_bits"]), cast(float, vals["max_weight"]),
                        cast(str, vals["rounding"]))
        FixedPoint(enc.frac_bits, max(enc.clip, 1.0))
    except ValueError as exc:
        raise RecordError(f"{head}: {exc}") from None
    cid = cast(int, vals["client"])
    if not 0 <= cid < 2**31:
        raise RecordError(f"{head}: client id {cid} out of range")
    return cfg, cid, enc


# -- the client's state in Context.state -------------------------------------------------------
def _dump(client: ChainClient, ring_msg: bytes) -> ConfigRecord:
    c = client.config
    keys = client._keys  # noqa: SLF001 - the node's own state, serialised for its next message
    sent = client._sent  # noqa: SLF001
    return make_record({
        "instance": c.instance, "round": c.round, "dim": c.dim, "successors": c.successors,
        "min_survivors": c.min_survivors, "max_attempts": c.max_attempts, "client": client.client_id,
        "stage": client.stage.value, "attempt": client.attempt,
        "sk": b"" if keys is None else keys.private.private_bytes_raw(), "ring": ring_msg,
        "sent_ids": list(sent), "sent_seeds": list(sent.values()), "pad": client._pad,  # noqa: SLF001
        "unlock_key": client._unlock_key, "value": client._value.tobytes(),  # noqa: SLF001
    })


def _load(rec: ConfigRecord) -> tuple[ChainClient, bytes]:
    cfg = ChainConfig(instance=cast(bytes, rec["instance"]), round=cast(int, rec["round"]), dim=cast(int, rec["dim"]),
                      successors=cast(int, rec["successors"]), min_survivors=cast(int, rec["min_survivors"]),
                      max_attempts=cast(int, rec["max_attempts"]))
    value = np.frombuffer(cast(bytes, rec["value"]), dtype=np.uint64).copy()
    client = ChainClient(cfg, cast(int, rec["client"]), value)
    client.stage = ClientStage(cast(str, rec["stage"]))
    sk = cast(bytes, rec["sk"])
    client._keys = KeyPair.from_private_bytes(sk) if sk else None  # noqa: SLF001
    client._attempt = cast(int, rec["attempt"])  # noqa: SLF001
    ring = cast(bytes, rec["ring"])
    if ring:
        client._ring = decode(ring)  # type: ignore[assignment]  # noqa: SLF001 - checked when it arrived
    client._sent = dict(zip(cast(list, rec["sent_ids"]), cast(list, rec["sent_seeds"]), strict=True))  # noqa: SLF001
    client._pad = cast(bytes, rec["pad"])  # noqa: SLF001
    client._unlock_key = cast(bytes, rec["unlock_key"])  # noqa: SLF001
    return client, ring


def chain_mod(msg: Message, ctxt: Context, call_next) -> Message:  # noqa: ANN001 - Flower's ClientAppCallable
    """Run one message of the chain for a ``TRAIN`` message; other messages pass through."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    records = ctxt.state.config_records
    where = f"node {msg.metadata.dst_node_id}"
    try:
        rec = msg.content.config_records.get(CHAIN_KEY)
        if rec is None:
            raise RecordError(f"a TRAIN message without the '{CHAIN_KEY}' record: this client only trains through "
                              "the chain (use ChainWorkflow on the server)")
        if rec.get("stage") == "setup":
            records.pop(CHAIN_STATE_KEY, None)  # a new round replaces whatever was in progress
            cfg, cid, enc = _setup_client(_read(msg.content, "setup", "to_client", where))
            floor = max(cfg.min_survivors, node_policy(ctxt.node_config).min_survivors)  # never below the node's
            out = call_next(msg, ctxt)
            if out.has_error():
                raise RecordError(f"chain stage SETUP at {where}: the ClientApp failed: {out.error.reason}")
            content = out.content
            raw = content.array_records.get(VECTOR_KEY)
            if raw is not None:  # a raw vector (ChainWorkflow.aggregate_vectors): encoded, never clipped
                floor = max(floor, vector_floor(raw, f"chain stage SETUP at {where}") or 2)
                x = encode_vector(enc, raw["vector"].numpy())  # type: ignore[arg-type]
                del content[VECTOR_KEY]  # the plaintext input never leaves the client
            else:
                fitres = compat.recorddict_to_fitres(content, keep_input=True)
                x = encode_update(enc, parameters_to_ndarrays(fitres.parameters), fitres.num_examples)  # type: ignore[arg-type]
            client = ChainClient(replace(cfg, min_survivors=floor), cid, x)
            reply = client.advertise()
            for arr in content.array_records.values():
                arr.clear()
            content.config_records[CHAIN_KEY] = make_record({"stage": "setup", "msg": reply})
            records[CHAIN_STATE_KEY] = _dump(client, b"")
            return Message(content, reply_to=msg)
        state = records.get(CHAIN_STATE_KEY)
        if state is None:
            raise RecordError(f"chain stage RELAY at {where}: no round in progress (setup missing)")
        vals = _read(msg.content, "relay", "to_client", where)
        client, ring = _load(state)
        blob = cast(bytes, vals["msg"])
        reply = client.handle(blob)
        if client.stage in (ClientStage.SHARED,):  # a RING was just accepted: keep it for the next messages
            ring = blob
        records[CHAIN_STATE_KEY] = _dump(client, ring)
        return Message(RecordDict({CHAIN_KEY: make_record({"stage": "relay", "msg": reply})}), reply_to=msg)
    except Exception:
        records.pop(CHAIN_STATE_KEY, None)  # this client is out of the round: forget its secrets
        raise


# -- the server --------------------------------------------------------------------------------
@dataclass
class ChainReport:
    """What one chain aggregation did (``ChainWorkflow.last_report``).

    Attributes mirror :class:`fedflower.secagg_workflow.SecAggReport`: ``survivors`` are the node
    ids in the sum, ``dropped`` node id -> reason of every node left out of it, ``attempts`` the
    chain's attempts (re-runs after dropouts), ``total`` the ``uint64`` sum or ``None``.
    """

    round: int
    n: int
    dim: int
    successors: int
    node_ids: list[int]
    survivors: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    refused: list[tuple[int, str]] = field(default_factory=list)
    attempts: int = 0
    relays: int = 0
    abort: str | None = None
    total: np.ndarray | None = None
    server_s: float = 0.0
    wait_s: float = 0.0
    bytes_to_clients: int = 0
    bytes_from_clients: int = 0


class ChainWorkflow:
    """The chain as a Flower fit workflow (see the module docstring).

    Args:
        successors: ``s``, the ring neighbours each client shares seeds with on each side (the
            collusion threshold is ``2s`` ring neighbours plus the server).
        min_survivors: the round aborts rather than publish a sum over fewer clients (>= 2). Each
            node also refuses any ring below its own node config's ``min-survivors``: the larger wins.
        max_attempts: the round aborts after this many abandoned attempts.
        max_weight, clipping_range, frac_bits, rounding: the encoding, as for ``SecAggWorkflow``.
        timeout: seconds to wait for each stage's replies (``None``: until all arrive).
    """

    def __init__(self, successors: int = 1, *, min_survivors: int = 2, max_attempts: int = 4,
                 max_weight: float = 1000.0, clipping_range: float = 8.0, frac_bits: int = 32,
                 rounding: str = "stochastic", timeout: float | None = None) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}; found {rounding!r}")
        if not (isinstance(max_weight, int | float) and max_weight > 0):
            raise ValueError(f"max_weight must be positive; found {max_weight!r}")
        if not (isinstance(clipping_range, int | float) and clipping_range > 0):
            raise ValueError(f"clipping_range must be positive; found {clipping_range!r}")
        FixedPoint(frac_bits, max(float(clipping_range), 1.0))
        ChainConfig(instance=bytes(INSTANCE_BYTES), round=0, dim=1, successors=successors,
                    min_survivors=min_survivors, max_attempts=max_attempts)  # range checks
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive seconds or None; found {timeout!r}")
        self.successors, self.min_survivors, self.max_attempts = successors, min_survivors, max_attempts
        self.max_weight, self.clip, self.frac_bits = float(max_weight), float(clipping_range), frac_bits
        self.rounding, self.timeout = rounding, timeout
        self.last_report: ChainReport | None = None

    def __call__(self, grid: Grid, context: Context) -> None:
        """Run one round of the chain (the fit stage of ``DefaultWorkflow``)."""
        fit = begin_fit(context)
        if fit is None:
            return
        node_ids = sorted(fit.fitins)
        if len(node_ids) < self.min_survivors:
            log.error("the chain needs at least min_survivors = %d sampled clients; found %d", self.min_survivors,
                      len(node_ids))
            return
        results = self._aggregate(grid, fit.round, node_ids, fit.fitins, fit.dim)
        rep = self.last_report
        assert rep is not None
        if rep.total is None:
            log.warning("chain aggregation aborted in round %d: %s", fit.round, rep.abort)
            return
        t0 = time.perf_counter()
        vec = FixedPoint(self.frac_bits, max(self.clip, 1.0)).decode(rep.total)
        fit_results = [(fit.proxies[nid], compat.recorddict_to_fitres(content, keep_input=True))
                       for nid, content in results]
        failures = [RuntimeError(f"node {nid}: {why}") for nid, why in rep.dropped.items()]
        if not finish_fit(context, fit, vec, fit_results, failures):
            rep.abort, rep.total = "the survivors' weights sum to zero; nothing to average", None
        rep.server_s += time.perf_counter() - t0

    def aggregate_vectors(self, grid: Grid, rnd: int, contents: dict[int, RecordDict], dim: int) -> ChainReport:
        """Sum one raw vector per node through the chain, outside Flower's strategy (no weight slot).

        As :meth:`fedflower.secagg_workflow.SecAggWorkflow.aggregate_vectors`: ``contents[node_id]``
        is the content of that node's setup message (what its ClientApp needs to compute its input);
        the ClientApp answers with an ArrayRecord :data:`fedflower.secagg_mod.VECTOR_KEY` holding
        ``dim`` float64 values with ``|value| <= clipping_range``, which :func:`chain_mod` encodes
        and strips. Returns the report (``total`` the ``uint64`` sum over the survivors, ``None``
        after an abort).
        """
        node_ids = sorted(contents)
        if len(node_ids) < self.min_survivors:
            raise ValueError(f"the chain needs at least min_survivors = {self.min_survivors} clients; found "
                             f"{len(node_ids)}")
        self._aggregate(grid, rnd, node_ids, dict(contents), int(dim))
        assert self.last_report is not None
        return self.last_report

    def _aggregate(self, grid: Grid, rnd: int, node_ids: list[int], fitins: dict[int, RecordDict],
                   dim: int) -> list[tuple[int, RecordDict]]:
        """Setup (training) then relays until the chain finishes; returns the survivors' FitRes contents."""
        n = len(node_ids)
        t0 = time.perf_counter()
        check_budget(n_summands=n, clip=max(self.clip, 1.0), frac_bits=self.frac_bits)
        ccfg = ChainConfig(instance=os.urandom(INSTANCE_BYTES), round=int(rnd) % 2**32, dim=dim,
                           successors=self.successors, min_survivors=self.min_survivors, max_attempts=self.max_attempts)
        rep = ChainReport(int(rnd), n, dim, self.successors, node_ids)
        self.last_report = rep
        server = ChainServer(ccfg, range(n))
        index_of = {nid: i for i, nid in enumerate(node_ids)}
        out: dict[int, RecordDict] = {}
        for i, nid in enumerate(node_ids):
            content = fitins[nid]
            content.config_records[CHAIN_KEY] = make_record({
                "stage": "setup", "instance": ccfg.instance, "round": ccfg.round, "dim": dim,
                "successors": ccfg.successors, "min_survivors": ccfg.min_survivors, "max_attempts": ccfg.max_attempts,
                "client": i, "frac_bits": self.frac_bits, "clip": self.clip, "max_weight": self.max_weight,
                "rounding": self.rounding})
            out[i] = content
        rep.server_s += time.perf_counter() - t0
        fitres: dict[int, RecordDict] = {}
        stage = "setup"
        try:
            while True:
                replies = self._exchange(grid, rep, stage, out, node_ids)
                t0 = time.perf_counter()
                for nid, r in replies:
                    try:
                        vals = _read(r.content, stage, "to_server", f"node {nid}")
                        blob = cast(bytes, vals["msg"])
                        head = decode(blob)
                        if head.sender != index_of[nid]:
                            raise RecordError(f"node {nid} (client {index_of[nid]}) sent a message as client "
                                              f"{head.sender}; refused")
                        server.receive(blob)
                        if stage == "setup":
                            fitres[nid] = r.content
                    except Exception as exc:  # noqa: BLE001 - nothing a client sends may crash the server
                        rep.refused.append((nid, f"{type(exc).__name__}: {exc}"))
                        rep.dropped.setdefault(nid, f"{stage}: {type(exc).__name__}: {exc}")
                step = server.close()
                rep.server_s += time.perf_counter() - t0
                if step.kind is None:
                    break
                stage = "relay"
                rep.relays += 1
                out = {cid: RecordDict({CHAIN_KEY: make_record({"stage": "relay", "msg": blob})})
                       for cid, blob in step.messages.items()}
            total = server.result()
        except SecAggError as exc:
            rep.abort = str(exc) if isinstance(exc, AbortError) else f"{type(exc).__name__}: {exc}"
            rep.attempts = server.attempt
            return []
        rep.attempts = server.attempt
        rep.total = total
        rep.survivors = [node_ids[c] for c in sorted(server.survivors)]
        for nid in node_ids:
            if nid not in set(rep.survivors):
                rep.dropped.setdefault(nid, "not in the final attempt")
        return [(nid, fitres[nid]) for nid in rep.survivors if nid in fitres]

    def _exchange(self, grid: Grid, rep: ChainReport, stage: str, out: dict[int, RecordDict],
                  node_ids: list[int]) -> list[tuple[int, Message]]:
        msgs = [Message(content=c, dst_node_id=node_ids[i], message_type=MessageType.TRAIN, group_id=str(rep.round))
                for i, c in out.items()]
        expected = {node_ids[i] for i in out}
        rep.bytes_to_clients += sum(_nbytes(c) for c in out.values())
        t0 = time.perf_counter()
        got = list(grid.send_and_receive(msgs, timeout=self.timeout))
        rep.wait_s += time.perf_counter() - t0
        rep.bytes_from_clients += sum(_nbytes(r.content) for r in got if not r.has_error())
        seen: set[int] = set()
        kept = []
        for r in got:
            nid = r.metadata.src_node_id
            if nid not in expected or nid in seen:
                rep.refused.append((nid, f"{stage}: reply from a node not asked, or a second reply; refused"))
                continue
            seen.add(nid)
            if r.has_error():
                rep.dropped.setdefault(nid, f"{stage}: error {r.error.code}: {(r.error.reason or '')[-300:]}")
                continue
            kept.append((nid, r))
        for nid in sorted(expected - seen):
            rep.dropped.setdefault(nid, f"{stage}: did not answer")
        return kept



def _nbytes(content: RecordDict) -> int:
    """The chain record's bytes in a message (what the chain itself costs on the wire)."""
    rec = content.config_records.get(CHAIN_KEY)
    return 0 if rec is None else int(rec.count_bytes())
