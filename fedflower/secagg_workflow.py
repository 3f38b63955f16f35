"""``SecAggWorkflow``: the server side of our SecAgg/SecAgg+ as a Flower workflow.

A drop-in replacement for ``flwr.server.workflow.SecAggPlusWorkflow`` in the fit stage of a
ServerApp's ``DefaultWorkflow``, paired with :func:`fedflower.secagg_mod.secagg_mod` on the
clients::

    from flwr.server.workflow import DefaultWorkflow
    from fedflower.secagg_workflow import SecAggWorkflow

    workflow = DefaultWorkflow(fit_workflow=SecAggWorkflow(num_shares=21, reconstruction_threshold=15))
    workflow(grid, context)   # inside @app.main() of a flwr.server.ServerApp

It runs :class:`secagg.bonawitz.MaskingServer` over Flower messages (five ``TRAIN`` round trips:
setup + advertise, share keys, masked input + training, consistency, unmask; see
:mod:`fedflower.secagg_mod`), then hands the survivors' weighted mean to the strategy's
``aggregate_fit`` exactly as Flower's workflow does (every survivor's FitRes carries the mean).

Parties, adversary, promise: those of :mod:`secagg.bonawitz`, with the Flower SuperLink and the
ServerApp together in the role of the server. The server learns the sum over U3 of
``[w_i, w_i * clip(parameters_i)]`` (``w_i = num_examples_i / max_weight``) and nothing else about
an individual update, unless ``t`` of that client's holders collude with it. Identity keys
(Ed25519) are pinned per Flower node id on first use (or given as ``pki``); see
docs/flower-secagg.md for what this does and does not protect against.

Dropouts and bad input: a node that does not answer within ``timeout``, answers with a Flower
error, or answers with anything our checks refuse (:mod:`fedflower.records`: missing or extra
keys, wrong types or lengths, wrong stage; our decoders: wrong round, instance, sender, replay,
bad signature) is dropped from the round with the reason in :attr:`SecAggWorkflow.last_report`;
the round goes on with the others and ends with the survivors' sum, or aborts cleanly (the model
is left unchanged) when fewer than ``t`` remain. Nothing a client sends can crash the server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp.grid import Grid

from fedflower.records import (
    RECORD_KEY,
    RecordError,
    SetupConfig,
    make_record,
    read_record,
)
from secagg import params
from secagg.bonawitz import MaskingConfig, MaskingServer
from secagg.encoding import FixedPoint, check_budget
from secagg.errors import AbortError, SecAggError
from secagg.messages import decode

__all__ = ["ClientFailed", "FitRound", "SecAggReport", "SecAggWorkflow", "begin_fit", "finish_fit"]

log = logging.getLogger(__name__)


class ClientFailed(SecAggError):
    """A node answered with a Flower error (its ClientApp or our mod raised); it is dropped."""


@dataclass
class SecAggReport:
    """What one secure aggregation did (``SecAggWorkflow.last_report``).

    Attributes:
        round: the Flower round.
        protocol, n, dim, k, t: the parameters used (``dim`` counts the weight slot).
        node_ids: the sampled Flower node ids, in client-index order.
        survivors: node ids whose inputs are in the sum (U3; empty after an abort).
        dropped: node id -> (stage, reason) for every node left out, with the typed error's text.
        refused: (node id, stage, reason) of every reply refused, including those that did not drop
            their sender (a duplicate of an accepted reply, a reply from a node not asked).
        abort: the abort reason, or ``None``.
        total: the ``uint64`` sum over U3 of the encoded ``[w, w * parameters]`` (``None`` after an abort).
        server_s: seconds spent in the workflow outside ``grid.send_and_receive``.
        wait_s: seconds spent inside ``grid.send_and_receive`` (the clients' work and the network).
        bytes_to_clients, bytes_from_clients: bytes of our wire messages (the ``"msg"`` values).
    """

    round: int
    protocol: str
    n: int
    dim: int
    k: int
    t: int
    node_ids: list[int]
    survivors: list[int] = field(default_factory=list)
    dropped: dict[int, tuple[str, str]] = field(default_factory=dict)
    refused: list[tuple[int, str, str]] = field(default_factory=list)
    abort: str | None = None
    total: np.ndarray | None = None
    server_s: float = 0.0
    wait_s: float = 0.0
    bytes_to_clients: int = 0
    bytes_from_clients: int = 0


@dataclass
class FitRound:
    """What a fit workflow needs from Flower's strategy before its round (:func:`begin_fit`)."""

    round: int
    template: list[np.ndarray]  #: the global parameters (shapes and dtypes of the mean)
    fitins: dict[int, RecordDict]  #: node id -> its FitIns content
    proxies: dict  #: node id -> its client proxy
    dim: int  #: ``1 + number of parameters`` (the weight slot first)


def begin_fit(context: Context) -> FitRound | None:
    """The strategy's ``configure_fit`` for this round (``None``: no client was selected)."""
    if not isinstance(context, LegacyContext):
        raise TypeError(f"Expect a LegacyContext, but get {type(context).__name__}.")
    cfg = context.state.config_records[MAIN_CONFIGS_RECORD]
    rnd = cast(int, cfg[WorkflowKey.CURRENT_ROUND])
    parameters = compat.arrayrecord_to_parameters(context.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
    proxy_fitins = context.strategy.configure_fit(rnd, parameters, context.client_manager)
    if not proxy_fitins:
        log.info("configure_fit: no clients selected, cancel")
        return None
    template = parameters_to_ndarrays(parameters)
    return FitRound(rnd, template, {p.node_id: compat.fitins_to_recorddict(f, True) for p, f in proxy_fitins},
                    {p.node_id: p for p, _ in proxy_fitins}, 1 + sum(int(np.asarray(a).size) for a in template))


def finish_fit(context: Context, fit: FitRound, vec: np.ndarray, results: list, failures: list) -> bool:
    """Hand the survivors' weighted mean to the strategy, as Flower's workflow does.

    ``vec`` is the decoded sum of ``[w, w * parameters]``; every survivor's FitRes (``results``:
    ``(proxy, FitRes)``) carries the mean. Returns ``False`` (nothing changed) when the weights sum
    to zero.
    """
    wsum = float(vec[0])
    if not wsum > 0:
        return False
    mean = vec[1:] / wsum
    arrays, pos = [], 0
    for a in fit.template:
        a = np.asarray(a)
        arrays.append(mean[pos : pos + a.size].reshape(a.shape).astype(a.dtype, copy=False))
        pos += a.size
    agg = ndarrays_to_parameters(arrays)
    for _, fitres in results:
        fitres.parameters = agg
    params_agg, metrics = context.strategy.aggregate_fit(fit.round, results, failures)  # type: ignore[arg-type]
    if params_agg:
        context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(params_agg, True)
        context.history.add_metrics_distributed_fit(server_round=fit.round, metrics=metrics)
    return True


class SecAggWorkflow:
    """Our SecAgg/SecAgg+ as a Flower fit workflow (see the module docstring).

    Args:
        num_shares: holders per client, the client included (Flower's meaning; ``k + 1``); ``None``
            chooses ``k`` and ``t`` with :func:`secagg.params.choose` for the sampled ``n``,
            ``dropout`` and ``corrupt``. Ignored for ``protocol="secagg"`` (complete graph).
        reconstruction_threshold: Shamir threshold ``t`` (``None``: chosen, or ``floor(2n/3) + 1``
            for SecAgg). ``t`` at or below half of a client's holders is refused unless
            ``unsafe_threshold`` (and each node refuses it unless its own node config opts in).
        k, t: our names for ``num_shares - 1`` and ``reconstruction_threshold`` (give one name each).
        protocol: ``"secagg+"`` (random k-regular graph) or ``"secagg"`` (complete graph).
        max_weight: ``num_examples`` is divided by it; a client with more examples is refused.
        clipping_range: ``w * parameters`` are clipped to ``[-clipping_range, clipping_range]``.
        frac_bits: fractional bits of the fixed-point encoding in Z_(2^64) (replaces Flower's
            ``quantization_range``/``modulus_range``); the bit budget ``n * max(clip, 1) * 2^frac_bits
            < 2^63`` is checked when ``n`` is known.
        timeout: seconds to wait for the replies of each stage (``None``: until all arrive); nodes
            that have not answered are dropped.
        dropout, corrupt: planned dropout and colluding fractions for the choice of ``k``/``t``.
            The nodes do not learn ``dropout`` from the server: each refuses to sign a survivor
            set missing more than its own node config's ``max-dropout`` allows (default 0.1,
            :func:`fedflower.client_state.node_policy`), so deploy them with the same value.
        rounding: ``"stochastic"`` (unbiased, default) or ``"nearest"`` (deterministic).
        unsafe_threshold: the server's own opt-in to a ``t`` at or below half of the holders
            (demonstrations only). It is not sent: each node accepts such a ``t`` only if its own
            node config sets ``unsafe-threshold = true``.
        pki: optional Flower node id -> Ed25519 public key (32 bytes) set up out of band; nodes
            not in it are pinned on first use.
    """

    def __init__(
        self,
        num_shares: int | None = None,
        reconstruction_threshold: int | None = None,
        *,
        k: int | None = None,
        t: int | None = None,
        protocol: str = "secagg+",
        max_weight: float = 1000.0,
        clipping_range: float = 8.0,
        frac_bits: int = 32,
        timeout: float | None = None,
        dropout: float = params.DEFAULT_DROPOUT,
        corrupt: float = params.DEFAULT_CORRUPT,
        rounding: str = "stochastic",
        unsafe_threshold: bool = False,
        pki: Mapping[int, bytes] | None = None,
    ) -> None:
        if num_shares is not None and k is not None:
            raise ValueError("give num_shares (Flower's k + 1) or k, not both")
        if reconstruction_threshold is not None and t is not None:
            raise ValueError("give reconstruction_threshold or t, not both")
        if num_shares is not None:
            if type(num_shares) is not int or num_shares < 2:
                raise ValueError(f"num_shares must be an int >= 2 (k + 1 holders); found {num_shares!r}")
            k = num_shares - 1
        self.k = k
        self.t = reconstruction_threshold if reconstruction_threshold is not None else t
        if protocol not in ("secagg", "secagg+"):
            raise ValueError(f"protocol must be 'secagg' or 'secagg+'; found {protocol!r}")
        if not (isinstance(max_weight, int | float) and max_weight > 0):
            raise ValueError(f"max_weight must be positive; found {max_weight!r}")
        if not (isinstance(clipping_range, int | float) and clipping_range > 0):
            raise ValueError(f"clipping_range must be positive; found {clipping_range!r}")
        FixedPoint(frac_bits, max(float(clipping_range), 1.0))  # range check of frac_bits and clip
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding must be 'stochastic' or 'nearest'; found {rounding!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive seconds or None; found {timeout!r}")
        self.protocol, self.max_weight, self.clip = protocol, float(max_weight), float(clipping_range)
        self.frac_bits, self.timeout, self.rounding = frac_bits, timeout, rounding
        self.dropout, self.corrupt, self.unsafe_threshold = dropout, corrupt, unsafe_threshold
        self.pinned: dict[int, bytes] = dict(pki or {})  #: node id -> identity key (given or first seen)
        self.last_report: SecAggReport | None = None

    # ------------------------------------------------------------------------------------------
    def _config(self, n: int, dim: int, rnd: int) -> MaskingConfig:
        check_budget(n_summands=n, clip=max(self.clip, 1.0), frac_bits=self.frac_bits)
        if self.protocol == "secagg":
            return MaskingConfig.secagg(n, dim, t=self.t, round=rnd, unsafe_threshold=self.unsafe_threshold)
        k = self.k if self.k is None or self.k < n - 1 else n - 1
        return MaskingConfig.secagg_plus(n, dim, k=k, t=self.t, round=rnd, dropout=self.dropout,
                                         corrupt=self.corrupt, unsafe_threshold=self.unsafe_threshold)

    def __call__(self, grid: Grid, context: Context) -> None:
        """Run one secure aggregation round (the fit stage of ``DefaultWorkflow``)."""
        fit = begin_fit(context)
        if fit is None:
            return
        node_ids = sorted(fit.fitins)
        n = len(node_ids)
        if n < 2:
            log.error("secure aggregation needs at least 2 sampled clients; found %d", n)
            return
        t0 = time.perf_counter()
        mcfg = self._config(n, fit.dim, fit.round)
        rep = SecAggReport(fit.round, self.protocol, n, fit.dim, mcfg.k, mcfg.t, node_ids)
        self.last_report = rep
        run = _Round(self, grid, rep, mcfg, node_ids, fit.fitins, fit.proxies)
        rep.server_s += time.perf_counter() - t0
        total = run.run()
        if total is None:
            log.warning("secure aggregation aborted in round %d: %s", fit.round, rep.abort)
            return
        t0 = time.perf_counter()
        vec = FixedPoint(self.frac_bits, max(self.clip, 1.0)).decode(total)
        if not finish_fit(context, fit, vec, run.results, run.failures):
            rep.abort, rep.total, rep.survivors = "the survivors' weights sum to zero; nothing to average", None, []
            log.warning("secure aggregation in round %d: %s", fit.round, rep.abort)
        rep.server_s += time.perf_counter() - t0

    def aggregate_vectors(self, grid: Grid, rnd: int, contents: Mapping[int, RecordDict], dim: int, *,
                          keep_masked: bool = False) -> tuple[SecAggReport, _Round]:
        """Securely sum one raw vector per node, outside Flower's strategy (no weight slot).

        For a server that drives its clients itself (:class:`fedflower.apps.GridTrainer`):
        ``contents[node_id]`` is the content of that node's ``masked_input`` message (what its
        ClientApp needs to compute its input); the node's ClientApp, under :func:`secagg_mod`,
        answers with an ArrayRecord :data:`fedflower.secagg_mod.VECTOR_KEY` holding ``dim``
        float64 values with ``|value| <= clipping_range``, which the mod encodes, masks and strips.

        Returns the report (``total`` is the ``uint64`` sum over the survivors, ``None`` after a
        clean abort) and the round (its ``results``: ``(node id, reply content)`` of each survivor,
        with the vector removed; ``sizes`` and ``masked`` for the caller's transcript).
        """
        node_ids = sorted(contents)
        n = len(node_ids)
        if n < 2:
            raise ValueError(f"secure aggregation needs at least 2 clients; found {n}")
        t0 = time.perf_counter()
        mcfg = self._config(n, int(dim), int(rnd))
        rep = SecAggReport(int(rnd), self.protocol, n, int(dim), mcfg.k, mcfg.t, node_ids)
        self.last_report = rep
        run = _Round(self, grid, rep, mcfg, node_ids, dict(contents), None, keep_masked=keep_masked)
        rep.server_s += time.perf_counter() - t0
        run.run()
        return rep, run


class _Round:
    """One aggregation: the MaskingServer and the Flower messages around it.

    With ``proxies`` (the strategy path) each survivor's masked-input reply becomes a legacy
    ``FitRes`` in :attr:`results`; without (:meth:`SecAggWorkflow.aggregate_vectors`) the reply's
    content itself, keyed by node id. :attr:`sizes` lists ``(stage, client index, bytes)`` of every
    accepted client message; :attr:`masked` the accepted masked inputs when ``keep_masked``.
    """

    def __init__(self, wf: SecAggWorkflow, grid: Grid, rep: SecAggReport, mcfg: MaskingConfig,
                 node_ids: list[int], fitins: dict[int, RecordDict], proxies: dict | None,
                 keep_masked: bool = False) -> None:
        self.wf, self.grid, self.rep, self.cfg = wf, grid, rep, mcfg
        self.node_of = node_ids
        self.index_of = {nid: i for i, nid in enumerate(node_ids)}
        self.fitins, self.proxies = fitins, proxies
        self.pki: dict[int, bytes] = {}  # client index -> identity key (filled in setup)
        self.server = MaskingServer(mcfg, self.pki)
        self.results: list = []
        self.failures: list[BaseException] = []
        self.sizes: list[tuple[str, int, int]] = []
        self.keep_masked = keep_masked
        self.masked: dict[int, bytes] = {}

    def drop(self, nid: int, stage: str, exc: BaseException) -> None:
        self.rep.dropped.setdefault(nid, (stage, f"{type(exc).__name__}: {exc}"))
        self.failures.append(exc)
        log.info("secure aggregation: node %s dropped in stage %s: %s", nid, stage, exc)

    def exchange(self, stage: str, out: dict[int, RecordDict], handle: Callable[[int, int, dict, Message], None]) -> None:
        """Send ``out`` (client index -> content), then validate and hand each reply to ``handle``."""
        rnd = self.rep.round
        msgs = []
        for i, content in out.items():
            self.rep.bytes_to_clients += len(content.config_records[RECORD_KEY].get("msg", b""))  # type: ignore[arg-type]
            msgs.append(Message(content=content, dst_node_id=self.node_of[i], message_type=MessageType.TRAIN,
                                group_id=str(rnd)))
        expected = {self.node_of[i] for i in out}
        t_wait = time.perf_counter()
        replies = list(self.grid.send_and_receive(msgs, timeout=self.wf.timeout))
        self.rep.wait_s += time.perf_counter() - t_wait
        seen: set[int] = set()
        for r in replies:
            nid = r.metadata.src_node_id
            first = nid in expected and nid not in seen
            try:
                if nid not in expected:
                    raise RecordError(f"stage {stage.upper()}: reply from node {nid}, which was not asked in this stage")
                if nid in seen:
                    raise RecordError(f"stage {stage.upper()}: second reply from node {nid} (replayed); refused")
                seen.add(nid)
                if r.has_error():
                    raise ClientFailed(f"stage {stage.upper()}: node {nid} answered with error {r.error.code}: "
                                       f"{(r.error.reason or '')[-300:]}")
                vals = read_record(r.content, stage=stage, direction="to_server", where=f"node {nid}")
                blob = cast(bytes, vals["msg"])
                self.rep.bytes_from_clients += len(blob)
                idx = self.index_of[nid]
                head = decode(blob)
                if head.sender != idx:
                    raise RecordError(f"stage {stage.upper()}: node {nid} (client {idx}) sent a message as "
                                      f"client {head.sender}; refused")
                handle(nid, idx, vals, r)
            except Exception as exc:  # noqa: BLE001 - nothing a client sends may crash the server
                if not isinstance(exc, SecAggError):
                    log.warning("secure aggregation: unexpected %s on node %s's reply", type(exc).__name__, nid,
                                exc_info=True)
                self.rep.refused.append((nid, stage, f"{type(exc).__name__}: {exc}"))
                if first:
                    self.drop(nid, stage, exc)
                else:
                    self.failures.append(exc)
        for nid in sorted(expected - seen):
            self.drop(nid, stage, ClientFailed(f"stage {stage.upper()}: node {nid} did not answer"
                                               f"{'' if self.wf.timeout is None else f' within {self.wf.timeout} s'}"))

    def _timed(self, fn: Callable[[], dict[int, bytes]]) -> dict[int, bytes]:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.rep.server_s += time.perf_counter() - t0

    def run(self) -> np.ndarray | None:
        """All five stages; returns the uint64 sum or ``None`` after a clean abort."""
        wf, cfg, srv = self.wf, self.cfg, self.server
        out: dict[int, RecordDict] = {}
        for i in range(cfg.n):
            setup = SetupConfig(wf.protocol, cfg.n, cfg.dim, cfg.t, cfg.round, cfg.instance, i, tuple(cfg.graph[i]),
                                wf.frac_bits, wf.clip, wf.max_weight, wf.rounding)
            out[i] = RecordDict({RECORD_KEY: setup.to_record()})
        try:
            self.exchange("setup", out, self._on_setup)
            inbox = self._timed(srv.broadcast_keys)
            self.exchange("share_keys", {u: RecordDict({RECORD_KEY: make_record({
                "stage": "share_keys", "msg": blob,
                "pki_ids": [v for v in cfg.holders(u) if v in srv.u1],
                "pki_keys": [self.pki[v] for v in cfg.holders(u) if v in srv.u1]})}) for u, blob in inbox.items()},
                self._receive)
            inbox = self._timed(srv.forward_shares)
            out = {}
            for u, blob in inbox.items():
                content = self.fitins[self.node_of[u]]
                content.config_records[RECORD_KEY] = make_record({"stage": "masked_input", "msg": blob})
                out[u] = content
            self.exchange("masked_input", out, self._on_masked)
            for stage, close in (("consistency", srv.request_consistency), ("unmask", srv.request_unmask)):
                inbox = self._timed(close)
                self.exchange(stage, {u: RecordDict({RECORD_KEY: make_record({"stage": stage, "msg": b})})
                                      for u, b in inbox.items()}, self._receive)
            total = self._timed(srv.finish)
        except SecAggError as exc:  # AbortError, or a check that failed while unmasking: abort cleanly
            self.rep.abort = str(exc) if isinstance(exc, AbortError) else f"{type(exc).__name__}: {exc}"
            return None
        self.rep.total = total
        self.rep.survivors = [self.node_of[u] for u in sorted(srv.u3)]
        alive = set(self.rep.survivors)
        self.results = [r for r in self.results if (r[0] if self.proxies is None else r[0].node_id) in alive]
        return total

    def _receive(self, nid: int, idx: int, vals: dict, r: Message) -> None:
        blob = cast(bytes, vals["msg"])
        t0 = time.perf_counter()
        try:
            self.server.receive(blob)
        finally:
            self.rep.server_s += time.perf_counter() - t0
        stage = cast(str, vals["stage"])
        self.sizes.append((stage, idx, len(blob)))
        if stage == "masked_input" and self.keep_masked:
            self.masked[idx] = blob

    def _on_setup(self, nid: int, idx: int, vals: dict, r: Message) -> None:
        ident = cast(bytes, vals["identity"])
        pinned = self.wf.pinned.get(nid)
        if pinned is not None and pinned != ident:
            raise RecordError(f"stage SETUP: node {nid} presented an identity key other than the one pinned for it")
        if ident in self.pki.values():
            raise RecordError(f"stage SETUP: node {nid} presented another node's identity key; refused")
        self.pki[idx] = ident
        try:
            self._receive(nid, idx, vals, r)
        except SecAggError:
            del self.pki[idx]
            raise
        self.wf.pinned[nid] = ident

    def _on_masked(self, nid: int, idx: int, vals: dict, r: Message) -> None:
        if self.proxies is None:
            self._receive(nid, idx, vals, r)
            self.results.append((nid, r.content))
            return
        try:
            fitres = compat.recorddict_to_fitres(r.content, keep_input=True)
        except Exception as exc:  # noqa: BLE001 - any malformed FitRes is the client's fault
            raise RecordError(f"stage MASKED_INPUT: node {nid} sent a malformed FitRes ({type(exc).__name__}: {exc})") from exc
        self._receive(nid, idx, vals, r)
        self.results.append((self.proxies[nid], fitres))


