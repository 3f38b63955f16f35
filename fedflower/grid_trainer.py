"""The server's half of a Flower run: :class:`GridTrainer` drives a registered protocol's clients through a
Flower ``Grid`` (see :mod:`fedflower.apps` for the whole picture and the ClientApp it talks to).

* :class:`GridTrainer` is a :class:`protocols.base.Trainer`: ``run_round`` samples with the protocol's
  seeded generator, sends the global model to the cohort, validates the replies and aggregates with the
  protocol's own ``_aggregate``, so ``secagg run``'s loop drives a Flower run unchanged; a protocol of named
  exchanges runs its own generator, and a protocol made of units (FEL's leaves) runs its own ``run_round``
  with each unit's client-facing hooks bound to the grid (:class:`_BoundUnit`).
* The record helpers (:func:`_arrays`, :func:`_np_array`), the step record keys and :class:`RoundFailed`
  live here because both halves use them; :mod:`fedflower.apps` re-exports every name.

Split out of :mod:`fedflower.apps` (issue 28: no module over ~800 lines).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedflower.adapter import (
    BadReply,
    PartitionMeta,
    config_to_json,
    decode_update,
    dp_unit,
    secure_width,
    stack_fields,
    stack_updates,
    units_of,
    zero_fields,
)
from fedflower.exchange_apps import answer_exchange, collect, reply_record
from fedflower.secagg_workflow import SecAggWorkflow
from protocols.base import RoundStats
from protocols.exchange import drive
from protocols.fedavg import LocalRound
from protocols.secure_sum import SecureSumAborted
from protocols.transport import SERVER, client
from secagg.bonawitz_wire import MaskedInput
from secagg.encoding import FixedPoint

__all__ = ["MAX_MESSAGE_BYTES", "STEP_MODEL_KEY", "STEP_UPDATE_KEY", "GridTrainer", "RoundFailed"]

#: gRPC's largest message in Flower 1.41 (flwr.common.GRPC_MAX_MESSAGE_LENGTH).
MAX_MESSAGE_BYTES = 536_870_912
#: Record keys of a split protocol's device step: the step's model down, the client's upload up.
STEP_MODEL_KEY, STEP_UPDATE_KEY = "step_model", "step_update"


class RoundFailed(RuntimeError):
    """No client of the cohort answered a round validly."""


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def _np_array(a: np.ndarray):
    from flwr.app import Array

    return Array(np.array(a, copy=True, order="C"))  # (np.ascontiguousarray would turn a 0-d array 1-d)


class GridTrainer:
    """The server's half of a protocol, driving its clients through a Flower ``Grid``.

    Args:
        grid: the ServerApp's grid.
        server: the protocol built on the census (:func:`fedflower.adapter.build_server_trainer`).
        protocol: the registered protocol name the clients build.
        seed: the run's seed (sent to the clients: it keys their streams and initialisation).
        meta: the partitioned dataset's public facts.
        timeout: seconds to wait for a round's replies; missing ones are dropped.
        assign: simulation: assign partition ``i`` to the ``i``-th node instead of a census.
        resumable: every node keeps its user state in a store on its own disk (``state-dir``), so
            the run can be resumed from the server's checkpoint (:meth:`load_state_dict`).
        source: the data's source (``"synthetic"`` or a path), sent to the clients of a protocol of
            exchanges for its public side files (a node's ``data-source`` node config overrides it).
    """

    def __init__(self, grid: Grid, server: Any, *, protocol: str, seed: int, meta: PartitionMeta,
                 timeout: float = 600.0, assign: bool = False, resumable: bool = False, source: str = "flower"):
        self.grid, self.server, self.protocol, self.seed, self.meta = grid, server, protocol, int(seed), meta
        self.source = str(source)
        self.timeout = float(timeout)
        self.resumable = bool(resumable)
        self.config_json = config_to_json(server.config)
        #: the protocol's units (its own sub-rounds: FEL's leaves), or the server itself
        self.units = units_of(server)
        if any(getattr(getattr(u, "config", None), "secure_aggregation", "none") == "dpf" for u in self.units):
            raise ValueError("secure_aggregation = 'dpf' needs a second, non-colluding aggregation server; Flower runs "
                             "one ServerApp, so 'dpf' runs in process only for now (docs/dpf.md, 'Flower')")
        self.split = hasattr(server, "round_units")
        #: a protocol of named exchanges (protocols/exchange.py): its own generator drives the round
        self.exchanges = hasattr(server, "device_round")
        # (an evaluation message of a split protocol carries every unit's model)
        if self.exchanges:
            model_bytes = sum(np.asarray(a).nbytes for a in server.device_model().values())
        else:
            model_bytes = sum(a.numel() * a.element_size() for u in self.units for a in u.global_arrays().values())
        if model_bytes > MAX_MESSAGE_BYTES:
            raise ValueError(f"the global model is {model_bytes:,} bytes, over Flower's {MAX_MESSAGE_BYTES:,}-byte gRPC "
                             "message limit; reduce the catalogue or fedavg.dim")
        #: ``{user: node id}``; with ``assign`` (simulation) the server assigns partition ``i`` to the
        #: ``i``-th node id instead of asking every node (a census) which one it holds
        self.assign = assign
        if assign:
            nodes = sorted(self._wait_for_nodes(600.0))
            if len(nodes) < meta.clients:
                raise ValueError(f"{len(nodes)} nodes for {meta.clients} partitions")
            self.node_of = {u: nodes[i] for i, u in enumerate(meta.users)}
            self.partition_of = {u: i for i, u in enumerate(meta.users)}
        else:
            self.node_store: dict[int, bool] = {}
            self.node_of = self.census()
            # A deployment is resumable when every node said it keeps its user state on disk.
            self.resumable = self.resumable or (bool(self.node_store) and all(self.node_store.values()))
        self.flower_bytes = {"down": 0, "up": 0}
        self._secagg: SecAggWorkflow | None = None
        self._workflows: dict[tuple, SecAggWorkflow] = {}  # exchange protocols: one per encoding
        self._pinned: dict[int, bytes] = {}  # ... sharing the run's pinned identity keys
        if self.split:
            if meta.units is None:
                raise ValueError(f"protocol {protocol!r} runs in units; the partitions carry none (rewrite them)")
            #: ``{user: its public unit}`` (split protocols)
            self.unit_of = {int(u): int(c) for u, c in zip(meta.users, meta.units)}
            self._bound = [_BoundUnit(self, i, unit) for i, unit in enumerate(self.units)]
            if hasattr(server, "step_model") and server.step_model():  # (FEL's FL over-arch) reached on the nodes
                server._device_step = self._device_step_exchange

    # -- plumbing ------------------------------------------------------------------------------
    def _run_record(self, user: int, **extra: Any) -> ConfigRecord:
        if self.split and "all" not in extra:  # a training request names the unit the client trains
            extra.setdefault("unit", self.unit_of[int(user)])
            if 0 <= extra["unit"] < len(self.units):  # and its public pool size (FEL's DP step depends on it)
                extra.setdefault("unit_clients", int(len(self.units[extra["unit"]]._clients)))
        if self.assign:
            extra["partition"] = self.partition_of[int(user)]
        if self.exchanges:  # (the public side files a client half may read, e.g. item titles)
            extra.setdefault("source", self.source)
        return ConfigRecord({"protocol": self.protocol, "config": self.config_json, "seed": self.seed,
                             "round": int(self.server.round), **extra})  # (a unit's exchange gives its own round)

    def _model_record(self, unit: Any = None) -> ArrayRecord:
        """``unit``'s global model: its ``global_arrays()`` (FedAvg-GMF: ``item``, ``h``, ``b``)."""
        unit = self.server if unit is None else unit
        return ArrayRecord({n: _np_array(a.numpy()) for n, a in unit.global_arrays().items()})

    def _all_units_record(self) -> ArrayRecord:
        """Every unit's global state, keys ``"<unit>.<name>"`` (a split protocol's evaluation)."""
        return ArrayRecord({f"{i}.{n}": _np_array(a.numpy())
                            for i, u in enumerate(self.units) for n, a in u.global_arrays().items()})

    def census(self, wait: float = 600.0) -> dict[int, int]:
        """Ask every node which user it holds; returns ``{user: node_id}``.

        Waits up to ``wait`` seconds for all of ``meta.clients`` nodes to connect (a deployment's
        SuperNodes may still be starting).
        """
        nodes = self._wait_for_nodes(wait)
        msgs = [Message(RecordDict({"run": ConfigRecord({"protocol": self.protocol})}), dst_node_id=n,
                        message_type="query.census") for n in nodes]
        out: dict[int, int] = {}
        for reply in self.grid.send_and_receive(msgs, timeout=wait):
            if reply.has_error():
                continue
            user = int(reply.content["census"]["user"])
            if user in out:
                raise ValueError(f"two nodes hold user {user}: give each SuperNode its own partition-id")
            out[user] = reply.metadata.src_node_id
            self.node_store[user] = reply.content["census"].get("store", False) is True
        missing = sorted(set(self.meta.users) - set(out))
        if missing:
            raise ValueError(f"{len(missing)} of {self.meta.clients} partitions have no connected node "
                             f"(e.g. user {missing[0]}); start one SuperNode per partition-id")
        return out

    def _wait_for_nodes(self, wait: float) -> list[int]:
        deadline = time.monotonic() + wait
        while True:
            nodes = list(self.grid.get_node_ids())
            if len(nodes) >= self.meta.clients or time.monotonic() > deadline:
                return nodes
            time.sleep(0.5)

    # -- the Trainer interface -----------------------------------------------------------------
    @property
    def round(self) -> int:
        return int(self.server.round)

    @property
    def transport(self):
        return self.server.transport

    @property
    def config(self):
        return self.server.config

    def run_round(self) -> RoundStats:
        if self.split:
            return self._split_round()
        if self.exchanges:
            return self._exchange_round()
        srv, t = self.server, self.server.round
        t0 = time.perf_counter()
        sampled = srv._sample_clients()
        if srv.config.secure_aggregation != "none":
            return self._secure_round(t, sampled, t0)
        kept, updates, errors = self._plain_exchange(srv, t, sampled)
        t_clients = time.perf_counter()
        if not updates:
            raise RoundFailed(f"round {t}: no client of {len(sampled)} answered validly ({errors[0] if errors else ''})")
        kept_arr = np.asarray(kept, np.int64)
        pair_slot, pair_item, dQ, dH, dB, weight = stack_updates(updates)
        srv._secagg_seconds = 0.0
        upload_bytes, releases, extra = srv._aggregate(t, kept_arr, pair_slot, pair_item, dQ, dH, dB, weight)
        srv.round += 1
        t_end = time.perf_counter()
        loss = sum(u.loss for u in updates)
        examples = sum(u.examples for u in updates)
        return RoundStats(
            round=t, loss=loss / max(examples, 1), clients=len(kept), bytes_per_client=srv.model_bytes + upload_bytes,
            seconds={"round": t_end - t0, "client": (t_clients - t0) / len(sampled), "server": t_end - t_clients},
            extra={"examples": examples, "dropped": len(sampled) - len(kept), "drop_reasons": errors[:5],
                   "flower_bytes_down": self.flower_bytes["down"], "flower_bytes_up": self.flower_bytes["up"], **extra},
            releases=releases,
        )

    def _plain_exchange(self, unit: Any, t: int, sampled: np.ndarray, **record: Any):
        """Send ``unit``'s global model to the ``sampled`` clients and collect their validated updates.

        Returns ``(kept users, their decoded updates, reasons of the dropped)``, in cohort order.
        """
        model = self._model_record(unit)
        msgs = []
        for u in sampled:
            unit.transport.send(SERVER, client(int(u)), t, "model", None, unit.model_bytes)
            msgs.append(Message(RecordDict({"model": model, "run": self._run_record(u, round=int(t), **record)}),
                                dst_node_id=self.node_of[int(u)], message_type="train", group_id=str(t)))
        self.flower_bytes["down"] += len(msgs) * model.count_bytes()
        replies, duplicated = collect(self.grid, msgs, self.timeout)
        kept, updates, errors = [], [], []
        for u in sampled:
            try:
                rec = reply_record(replies.get(self.node_of[int(u)]), self.node_of[int(u)] in duplicated, "update")
                self.flower_bytes["up"] += rec.count_bytes()
                updates.append(decode_update(_arrays(rec), n_items=self.meta.n_items, dim=unit.config.dim,
                                             fields=unit.upload_fields()))
                kept.append(int(u))
            except (BadReply, KeyError, TypeError, ValueError) as exc:
                errors.append(f"user {int(u)}: {exc}")
        return kept, updates, errors

    def _secure_exchange(self, unit: Any, t: int, sampled: np.ndarray, **record: Any):
        """``unit``'s round through our SecAgg/SecAgg+ over the grid; records the server's transcript.

        Returns ``(report, user_of node, vector width, bytes per client)``; ``report.total`` is
        ``None`` after a clean abort.
        """
        cfg = unit.config
        if len(sampled) < 2:
            raise ValueError(f"secure aggregation needs at least 2 clients per round; round {t} samples {len(sampled)}")
        if self._secagg is None:  # one workflow for the run: it pins each node's identity key across rounds
            self._secagg = SecAggWorkflow(protocol=cfg.secure_aggregation, clipping_range=cfg.value_clip,
                                          frac_bits=cfg.frac_bits, timeout=self.timeout, dropout=cfg.secagg_dropout,
                                          corrupt=cfg.secagg_corrupt, rounding="nearest")
        model = self._model_record(unit)
        contents, user_of = {}, {}
        for u in sampled:
            unit.transport.send(SERVER, client(int(u)), t, "model", None, unit.model_bytes)
            nid = self.node_of[int(u)]
            user_of[nid] = int(u)
            contents[nid] = RecordDict({"model": model, "run": self._run_record(u, secure=True, round=int(t), **record)})
        self.flower_bytes["down"] += len(contents) * model.count_bytes()
        width = secure_width(unit)
        keep = bool(unit.transport.transcript.keep_payloads)
        rep, run = self._secagg.aggregate_vectors(self.grid, t, contents, width, keep_masked=keep)
        for stage, idx, nbytes in run.sizes:  # the server's transcript: what it received, as in-process
            u = user_of[rep.node_ids[idx]]
            payload = MaskedInput.from_bytes(run.masked[idx]).y if keep and stage == "masked_input" else None
            unit.transport.send(client(u), SERVER, t, "update" if stage == "masked_input" else f"secagg:{stage}",
                                payload, nbytes)
        for u in sampled:
            unit.transport.send(SERVER, client(int(u)), t, f"{cfg.secure_aggregation}:server", None,
                                rep.bytes_to_clients // len(sampled))
        self.flower_bytes["up"] += rep.bytes_from_clients
        self.flower_bytes["down"] += rep.bytes_to_clients
        per_client = unit.model_bytes + (rep.bytes_from_clients + rep.bytes_to_clients) / len(sampled)
        return rep, user_of, width, per_client

    def _exchange_round(self) -> RoundStats:
        """One round of a protocol of named exchanges: its own generator, every exchange over the grid
        (:func:`fedflower.exchange_apps.answer_exchange`); the dropped clients are counted per exchange."""
        drops: list[str] = []
        steps = iter(range(1 << 30))

        def answer(ex):  # noqa: ANN001, ANN202
            rep = answer_exchange(self, ex, next(steps))
            drops.extend(f"{ex.kind}: user {u}: {why}" for u, why in rep.dropped.items())
            return rep

        stats = drive(self.server.device_round(), answer)
        extra = {**stats.extra, "dropped": len(drops), "drop_reasons": drops[:5],
                 "flower_bytes_down": self.flower_bytes["down"], "flower_bytes_up": self.flower_bytes["up"]}
        return dataclasses.replace(stats, extra=extra)

    def exchange_workflow(self, spec: Any) -> SecAggWorkflow:
        """The SecAgg workflow for a secure exchange's encoding (one per distinct encoding in a run,
        all pinning the nodes' identity keys in one table)."""
        key = (spec.protocol, spec.frac_bits, float(spec.value_clip), spec.dropout, spec.corrupt, spec.k, spec.t)
        if key not in self._workflows:
            extra = {k: v for k, v in (("dropout", spec.dropout), ("corrupt", spec.corrupt), ("k", spec.k),
                                       ("t", spec.t)) if v is not None}
            wf = SecAggWorkflow(protocol=spec.protocol, clipping_range=float(spec.value_clip), frac_bits=spec.frac_bits,
                                timeout=self.timeout, rounding="nearest", **extra)
            wf.pinned = self._pinned
            self._workflows[key] = wf
        return self._workflows[key]

    def _step_model_record(self) -> ArrayRecord | None:
        arrays = self.server.step_model()
        return ArrayRecord({n: _np_array(a.numpy()) for n, a in arrays.items()}) if arrays else None

    def _device_step_exchange(self, t: int, step: int, cohort: np.ndarray):  # noqa: ANN202
        """The server's ``_device_step`` hook of a split protocol (FEL's FL over-arch step) bound to the grid.

        Each client of ``cohort`` gets every unit's global arrays and the step's model (its node
        computes its features from them and its own data) and replies with its upload: the
        gradient (``step_width()`` finite float32 values; under DP of L2 norm within ``step_clip()``,
        which the device applied), its loss sum (finite, >= 0) and its example count (>= 0). A
        missing, late, duplicated or malformed reply drops only its sender (``dropped``, ``drop_reasons``); returns ``(kept, rows, loss sums, counts)`` in cohort order,
        and stops the run with :class:`RoundFailed` when nobody answered validly.
        """
        srv = self.server
        name, width = srv.device_step_name, int(srv.step_width())
        bound = srv.step_clip()  # (under DP every device clips its upload: the server checks, never clips)
        if len(cohort) == 0:  # (nobody to ask)
            return np.zeros(0, np.int64), np.zeros((0, width)), np.zeros(0), np.zeros(0, np.int64)
        model, step_model = self._all_units_record(), self._step_model_record()
        msgs = []
        for u in cohort:
            run = self._run_record(u, round=int(t), step=name, step_index=int(step))
            msgs.append(Message(RecordDict({"model": model, STEP_MODEL_KEY: step_model, "run": run}),
                                dst_node_id=self.node_of[int(u)], message_type="train", group_id=f"{t}.{name}.{step}"))
        self.flower_bytes["down"] += len(msgs) * (model.count_bytes() + step_model.count_bytes())
        replies, duplicated = collect(self.grid, msgs, self.timeout)
        kept, rows, losses, counts, errors = [], [], [], [], []
        for u in cohort:
            try:
                rec = reply_record(replies.get(self.node_of[int(u)]), self.node_of[int(u)] in duplicated,
                                   STEP_UPDATE_KEY)
                self.flower_bytes["up"] += rec.count_bytes()
                got = _arrays(rec)
                if set(got) != {"gradient", "loss", "examples"}:
                    raise BadReply(f"upload fields {sorted(got)}; expected ['examples', 'gradient', 'loss']")
                g, loss, n = got["gradient"], got["loss"], got["examples"]
                if g.dtype != np.float32 or g.shape != (width,) or not np.isfinite(g).all():
                    raise BadReply(f"gradient {g.dtype} {g.shape}; expected {width} finite float32 values")
                if bound is not None and float(np.linalg.norm(g.astype(np.float64))) > bound * (1 + 1e-5):
                    raise BadReply(f"gradient of L2 norm {float(np.linalg.norm(g)):.6g} over its clip {bound:g}")
                if loss.dtype != np.float64 or loss.shape != () or not np.isfinite(loss) or loss < 0:
                    raise BadReply(f"loss {loss.dtype} {loss.shape}; expected one finite float64 >= 0")
                if n.dtype != np.int64 or n.shape != () or n < 0:
                    raise BadReply(f"examples {n.dtype} {n.shape}; expected one int64 >= 0")
                kept.append(int(u))
                rows.append(g.astype(np.float64))
                losses.append(float(loss))
                counts.append(int(n))
            except (BadReply, KeyError, TypeError, ValueError) as exc:
                errors.append(f"user {int(u)}: {exc}")
        self._dropped += len(cohort) - len(kept)
        self._drops += [f"{name} step {step}: {e}" for e in errors]
        if not kept:
            raise RoundFailed(f"round {t}, {name} step {step}: no client of {len(cohort)} answered validly "
                              f"({errors[0] if errors else ''})")
        return (np.asarray(kept, np.int64), np.stack(rows), np.asarray(losses, np.float64),
                np.asarray(counts, np.int64))

    def _split_round(self) -> RoundStats:
        """One round of a protocol made of units: the protocol's own ``run_round``, each unit's
        cohort reached through the grid (:class:`_BoundUnit`)."""
        self._drops: list[str] = []
        self._dropped = 0
        stats = self.server.run_round()
        extra = {**stats.extra, "dropped": self._dropped, "drop_reasons": self._drops[:5],
                 "flower_bytes_down": self.flower_bytes["down"], "flower_bytes_up": self.flower_bytes["up"]}
        return dataclasses.replace(stats, extra=extra)

    def _secure_round(self, t: int, sampled: np.ndarray, t0: float) -> RoundStats:
        """One round whose uploads the server learns only summed (our SecAgg/SecAgg+ over the grid).

        The ``masked_input`` stage carries the global model and the training request; each
        node's :func:`fedflower.secagg_mod.secagg_mod` masks the vector its ``train`` handler lays
        out (:func:`fedflower.adapter.client_secure_vector`). The decoded sum gives the protocol's
        round sums (:meth:`protocols.fedavg.FedAvgGMF._sums_from_total`), applied as in-process.
        A clean abort (fewer than ``t`` survivors) leaves the model unchanged; the round reports
        ``clients = 0``, a NaN loss and the reason, and the run goes on.
        """
        srv, cfg = self.server, self.server.config
        rep, user_of, width, per_client = self._secure_exchange(srv, t, sampled)
        t_clients = time.perf_counter()
        n = len(sampled)
        reasons = [f"user {user_of[nid]}: {stage}: {why}" for nid, (stage, why) in rep.dropped.items()]
        extra = {"dropped": len(rep.dropped), "drop_reasons": reasons[:5], "secagg_k": rep.k,
                 "secagg_t": rep.t, "flower_bytes_down": self.flower_bytes["down"],
                 "flower_bytes_up": self.flower_bytes["up"]}
        srv.round += 1
        if rep.total is None:
            t_end = time.perf_counter()
            return RoundStats(round=t, loss=float("nan"), clients=0, bytes_per_client=per_client,
                              seconds={"round": t_end - t0, "client": rep.wait_s / n, "server": rep.server_s},
                              extra={**extra, "aborted": rep.abort})
        total = FixedPoint(cfg.frac_bits, max(cfg.value_clip, 1.0)).decode(rep.total)
        srv._apply(*srv._sums_from_total(total[: width - 2]))
        loss_sum, examples = float(total[width - 2]), int(round(float(total[width - 1])))
        t_end = time.perf_counter()
        survivors = len(rep.survivors)
        return RoundStats(
            round=t, loss=loss_sum / max(examples, 1), clients=survivors, bytes_per_client=per_client,
            seconds={"round": t_end - t0, "client": rep.wait_s / n, "server": rep.server_s + (t_end - t_clients)},
            extra={"examples": examples, **extra}, releases=(srv._update_release(survivors),),
        )

    def _score_lists(self, users: np.ndarray, items: list[np.ndarray] | None) -> list[np.ndarray]:
        """Ask each user's node to score ``items[c]`` (every item if ``None``) with its own state."""
        if self.exchanges:
            model = ArrayRecord({k: _np_array(np.asarray(v)) for k, v in self.server.device_model().items()})
        else:
            model = self._all_units_record() if self.split else self._model_record()
        step_model = self._step_model_record() if self.split and hasattr(self.server, "step_model") else None
        msgs = []
        for c, u in enumerate(np.asarray(users)):
            content = {"model": model, "run": self._run_record(u, all=items is None)}
            if items is not None:
                content["items"] = ArrayRecord({"items": _np_array(np.asarray(items[c], np.int64))})
            if step_model is not None:
                content[STEP_MODEL_KEY] = step_model
            held = self.server.device_state_from_server(int(u)) if self.exchanges and hasattr(
                self.server, "device_state_from_server") else None
            if held is not None:  # the server holds this user's state (plaintext FedFast): it sends it
                content["state"] = ArrayRecord({k: _np_array(np.asarray(v)) for k, v in held.items()})
            msgs.append(Message(RecordDict(content), dst_node_id=self.node_of[int(u)], message_type="query.score"))
        replies = {m.metadata.src_node_id: m for m in self.grid.send_and_receive(msgs, timeout=self.timeout)}
        out = []
        for c, u in enumerate(np.asarray(users)):
            reply = replies.get(self.node_of[int(u)])
            if reply is None or reply.has_error():
                raise RoundFailed(f"evaluation: user {int(u)} did not return its scores "
                                  f"({'timeout' if reply is None else reply.error.reason})")
            s = reply.content["scores"]["scores"].numpy()
            width = self.meta.n_items if items is None else len(items[c])
            if s.shape != (width,) or s.dtype != np.float32:
                raise RoundFailed(f"evaluation: user {int(u)} returned scores of shape {s.shape} {s.dtype}")
            out.append(s)
        return out

    def _scores(self, users: np.ndarray, items: np.ndarray | None) -> np.ndarray:
        width = self.meta.n_items if items is None else np.asarray(items).shape[1]
        rows = self._score_lists(users, None if items is None else list(np.asarray(items)))
        return np.stack(rows) if rows else np.empty((0, width), np.float32)

    def evaluate(self, test: Any) -> dict[str, float]:
        """Rating protocols: each test user's node predicts its own held-out items (with its own state
        and the model the server sends); the metrics are the protocol's (``metrics_from_predictions``)."""
        metrics = getattr(self.server, "metrics_from_predictions", None)
        if metrics is None:
            raise ValueError(f"protocol {self.protocol!r} rates but has no metrics_from_predictions(test, predictions)")
        users, items = np.asarray(test.users, np.int64), np.asarray(test.items, np.int64)
        order = np.argsort(users, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(users[order])) + 1) if len(order) else []
        pred = np.empty(len(users), np.float64)
        rows = self._score_lists(np.array([users[g[0]] for g in groups], np.int64), [items[g] for g in groups])
        for g, r in zip(groups, rows, strict=True):
            pred[g] = r
        return metrics(test, pred)

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Each user's node scores its candidates with its own user state (evaluation)."""
        return self._scores(users, np.asarray(items))

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return self._scores(users, None)

    def state_dict(self) -> dict[str, Any]:
        """The server's half only: the clients' states live on their nodes (no resume)."""
        return self.server.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the server's half; the clients continue from their own stores (``state-dir``)."""
        if not self.resumable:
            lacking = sum(not v for v in getattr(self, "node_store", {}).values())
            raise ValueError("this Flower run cannot be resumed: its clients kept their user states only in "
                             "their Flower contexts (give every node a state-dir"
                             f"{f'; {lacking} nodes have none' if lacking else ''})")
        self.server.load_state_dict(state)

    def public_info(self) -> dict[str, Any]:
        info = dict(self.server.public_info())
        info.update(runtime="flower", nodes=len(self.node_of))
        return info

    def cost_report(self) -> dict[str, Any]:
        return {"flower_bytes": dict(self.flower_bytes)}


class _BoundUnit:
    """One unit of a split protocol (FEL: a leaf) with its client-facing hooks bound to the grid.

    The unit's own ``run_round`` (and whatever the protocol does around it) runs unchanged on the
    server; only these three hooks reach the clients:

    * ``_sample_clients``: the unit's own seeded choice, then the exchange with that cohort
      (plaintext updates, or our secure aggregation); returns the clients whose replies are valid
      (the survivors), so the protocol aggregates over exactly those. Asked again before the
      cohort's local round (a Poisson-sampled DP leaf draws first, then runs FedAvg's round on
      that draw), it returns the same clients without asking them twice; an empty draw asks nobody;
    * ``_local_round``: their validated uploads stacked in cohort order, the unit's own upload
      fields installed with its ``load_local_fields`` (the clients' user states stay on their
      nodes: the server's placeholder rows are returned unchanged);
    * ``_secure_sums`` (secure units): the round's sums decoded from the survivors' secure sum;
    * ``_dp_secure_sum`` (DP units through secure aggregation, :func:`fedflower.adapter.dp_unit`):
      the survivors' sum of the inputs each device clipped (and noised) itself, and how many
      survived. The cohort stays the sampled one (the unit accounts its survivors' noise and
      releases ``clients = m`` as in-process); the server never clips or noises anything itself
      (placeholder rows only), and does not learn who was clipped. No loss is released (the
      round's loss is NaN: an unnoised sum of losses would be a release DP does not cover).

    A unit round in which no client answers validly, or whose secure aggregation aborts, raises
    :class:`RoundFailed` (as an in-process abort stops the run), except a unit under distributed DP
    noise: its nodes put their own floor beside their vectors (the survivors their noise shares were
    sized for: :func:`fedflower.adapter.survivor_floor`) and refuse to unmask below it; the unit then
    refuses its round itself (``_dp_secure_sum`` raises :class:`protocols.secure_sum.SecureSumAborted`,
    which the leaf turns into a refused round: not applied, nothing released, said in
    ``extra["refused"]``), as in process, and the run goes on.
    """

    def __init__(self, gt: GridTrainer, index: int, unit: Any) -> None:
        self.gt, self.index, self.unit = gt, int(index), unit
        self.sample = unit._sample_clients  # the protocol's own choice (a bound method)
        self.pending: dict[str, Any] | None = None
        unit._sample_clients = self._sample_and_exchange
        unit._local_round = self._local_round
        self.dp = dp_unit(unit)
        if unit.config.secure_aggregation != "none":
            if self.dp:
                unit._dp_secure_sum = self._dp_secure_sum
            else:
                unit._secure_sums = self._secure_sums

    def _sample_and_exchange(self) -> np.ndarray:
        gt, unit, t = self.gt, self.unit, self.unit.round
        sampled = self.sample()
        if self.pending is not None:
            # The unit asks again for the cohort it drew and we already exchanged with (a Poisson-sampled
            # DP leaf draws first to handle an empty cohort, then runs FedAvg's round on that draw): the
            # same clients, asked once.
            if not np.array_equal(np.asarray(sampled, np.int64), self.pending["kept"]):
                raise RuntimeError(f"unit {self.index}: a second cohort drawn before the first one's local round")
            return self.pending["kept"]
        if len(sampled) == 0:  # (an empty Poisson cohort: nobody to ask; the unit releases its noise alone)
            return np.asarray(sampled, np.int64)
        for u in sampled:
            if gt.unit_of.get(int(u)) != self.index:
                raise RoundFailed(f"unit {self.index} sampled user {int(u)}, whose public unit is "
                                  f"{gt.unit_of.get(int(u))}")
        where = f"round {t}, unit {self.index}"
        if unit.config.secure_aggregation == "none":
            kept, updates, errors = gt._plain_exchange(unit, t, sampled)
            gt._dropped += len(sampled) - len(kept)
            gt._drops += [f"unit {self.index}: {e}" for e in errors]
            if not updates:
                raise RoundFailed(f"{where}: no client of {len(sampled)} answered validly ({errors[0] if errors else ''})")
            self.pending = {"kept": np.asarray(kept, np.int64), "updates": updates}
            return self.pending["kept"]
        rep, user_of, width, per_client = gt._secure_exchange(unit, t, sampled)
        gt._dropped += len(rep.dropped)
        gt._drops += [f"unit {self.index}: user {user_of[nid]}: {stage}: {why}" for nid, (stage, why) in rep.dropped.items()]
        if rep.total is None and self.dp and unit.dp.mode == "distributed":
            # the nodes refused to unmask (their floor beside their vectors) or too many dropped: the unit
            # refuses its round itself (_dp_secure_sum), as in process
            early = ("setup", "share_keys", "masked_input")
            stayed = len(sampled) - sum(stage in early for stage, _ in rep.dropped.values())
            self.pending = {"kept": np.asarray(sampled, np.int64), "total": None, "width": width,
                            "per_client": per_client,
                            "abort": f"{stayed} of {len(sampled)} clients stayed until their masked input; secure "
                                     f"aggregation aborted: {rep.abort}"}
            return self.pending["kept"]
        if rep.total is None:
            raise RoundFailed(f"{where}: secure aggregation aborted ({rep.abort}); the unit's model is unchanged")
        cfg = unit.config
        total = FixedPoint(cfg.frac_bits, max(cfg.value_clip, 1.0)).decode(rep.total)
        survivors = np.asarray(sorted(user_of[nid] for nid in rep.survivors), np.int64)
        kept = np.asarray(sampled, np.int64) if self.dp else survivors
        self.pending = {"kept": kept, "total": total, "width": width, "per_client": per_client,
                        "survivors": survivors}
        return kept

    def _local_round(self, sampled: np.ndarray) -> LocalRound:
        pending, self.pending = self.pending, None
        if pending is None or not np.array_equal(pending["kept"], sampled):
            raise RuntimeError(f"unit {self.index}: local round asked for another cohort than the one exchanged")
        unit = self.unit
        placeholder = unit.user[torch.as_tensor(sampled)].clone()  # the clients' states stay on their nodes
        if "updates" in pending:
            ups = pending["updates"]
            pair_slot, pair_item, dQ, dH, dB, weight = stack_updates(ups)
            unit.load_local_fields(stack_fields(ups, unit.upload_fields()))  # (NCF leaves: the MLP's changes)
            return LocalRound(P=placeholder, pair_slot=pair_slot, pair_item=pair_item, dQ=dQ, dH=dH, dB=dB,
                              weight=weight, loss=sum(u.loss for u in ups), examples=sum(u.examples for u in ups))
        total, width, m, d = pending["total"], pending["width"], len(sampled), unit.config.dim
        self._secure = pending
        loss, examples = (float("nan"), 0) if self.dp else (float(total[width - 2]), int(round(float(total[width - 1]))))
        unit.load_local_fields(zero_fields(unit.upload_fields(), m))  # (placeholders: the server holds the sum)
        return LocalRound(P=placeholder, pair_slot=np.zeros(0, np.int64), pair_item=np.zeros(0, np.int64),
                          dQ=torch.zeros(0, d), dH=torch.zeros(m, d), dB=torch.zeros(m), weight=torch.zeros(m),
                          loss=loss, examples=examples)

    def _secure_sums(self, t, sampled, pair_slot, pair_item, dQ, dH, dB, weight):  # noqa: ANN001, ANN202
        pending, self._secure = self._secure, None
        self.unit._secagg_seconds = 0.0  # (the clients' share is inside the exchange's wall time)
        return self.unit._sums_from_total(pending["total"][: pending["width"] - 2]), pending["per_client"] - self.unit.model_bytes

    def _dp_secure_sum(self, t, sampled, clipped, dropped):  # noqa: ANN001, ANN202
        pending, self._secure = self._secure, None
        if len(dropped):  # (check_device_split refuses fel.simulate_dropout: dropouts here are real)
            raise RuntimeError(f"unit {self.index}: simulated dropouts do not run on Flower")
        unit = self.unit
        unit._secagg_seconds = 0.0
        unit._clip_scales = None  # the devices clipped; the server does not know whose update was clipped
        if pending["total"] is None:  # nothing was unmasked: the unit refuses the round
            raise SecureSumAborted(pending["abort"])
        return pending["total"], pending["per_client"] - unit.model_bytes, len(pending["survivors"])
