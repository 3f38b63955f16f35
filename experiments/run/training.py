"""The run loop behind ``secagg run``: any registered protocol, one round at a time, resumable.

Order of work in every round, chosen so that a kill at any point is safe:

1. ``trainer.run_round()``;
2. the round's privacy releases are committed to ``privacy_ledger.sqlite`` (before anything
   from the round is published; a round re-run after a crash is recorded again, so spent
   budget is never lost, only ever over-counted);
3. ``costs.jsonl``, ``transcript.csv`` and ``metrics.jsonl`` get the round's rows (appended, fsynced);
4. every ``run.checkpoint_every`` rounds, the checkpoint is replaced atomically.

On ``--resume`` the appended files are cut back to the checkpoint's round (and a torn last
line dropped), the configuration is verified against ``run.json`` key by key (only
``run.rounds`` may change), the data files against their SHA-256, and the checkpoint against
the run id; any mismatch is refused with a message that names it.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from dp.errors import BudgetExceededError, NonFiniteInputError
from dp.events import NoOp, NonPrivate
from dp.ledger import PrivacyLedger
from experiments.run import config as cfgmod
from experiments import jsonio
from experiments.errors import RunInterrupted, TrainingDiverged, UserError
from experiments.run.heap import release_heap, settle_heap
from experiments.run.prepare import Prepared, prepare_data, run_data_files
from experiments.run.rundir import CHECKPOINT, RunDir, default_run_dir
from protocols.guard import set_device_policy
from protocols.registry import BuildContext
from protocols.secure_sum import observe as observe_secure
from protocols.state import loads_json
from protocols.transport import InProcessTransport, Transcript
from recmodels.metrics import TIE_RULES, evaluate_full_by_rule, evaluate_sampled, evaluate_sampled_by_rule

__all__ = ["MAX_ROUNDS", "TIE_RULE", "TIE_RULES_TEXT", "VALID_PREFIX", "RunRequest", "best_validation", "build_trainer",
           "execute", "main_metric", "settle_heap"]

#: Prefix of the validation metrics in metrics.jsonl rows (``valid_HR@10``).
VALID_PREFIX = "valid_"
TIE_RULE = "ties count against the held-out item (rank = 1 + #candidates scoring >= it)"
#: What summary.json's ``ties`` holds (every rule of :data:`recmodels.metrics.TIE_RULES`).
TIE_RULES_TEXT = {
    "pessimistic": TIE_RULE + "; the figures of metrics.jsonl and 'metrics'",
    "optimistic": "ties in the held-out item's favour (rank = 1 + #candidates scoring > it), as the authors' code "
                  "ranks with pandas rank(method='first') and the positive listed first",
    "random": "the expectation over a uniformly random order of the tied candidates (exact, not sampled)",
}
#: Upper bound on run.rounds (a typo such as 10^20 is refused in words rather than accepted).
MAX_ROUNDS = 1_000_000
LEDGER = "privacy_ledger.sqlite"
TRANSCRIPT_HEADER = "round,party,sent_bytes,received_bytes"


@dataclass(frozen=True)
class RunRequest:
    """A resolved ``secagg run`` invocation."""

    preset: str
    config: cfgmod.RunConfig
    out: Path | None = None
    resume: Path | None = None
    quiet: bool = False
    plugins: tuple[str, ...] = ()


def main_metric(config: cfgmod.RunConfig) -> tuple[str, ...]:
    """The metrics the progress bar and the plot follow: HR/NDCG at the cut-off nearest 10."""
    if config.spec.task == "rating":
        return ("RMSE", "MAE")
    k = min(config.eval.ks, key=lambda c: (abs(c - 10), c))
    return (f"HR@{k}", f"NDCG@{k}")


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__}
    try:
        out["secagg-fedrec"] = metadata.version("secagg-fedrec")
    except metadata.PackageNotFoundError:  # running from a source tree without installation
        out["secagg-fedrec"] = "source"
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _as_written(config: cfgmod.RunConfig) -> dict[str, Any]:
    """``config`` as run.json holds it (strict JSON: NaN and infinities as ``None``)."""
    return jsonio.strict(config.to_dict())


def verify_resume(rd: RunDir, config: cfgmod.RunConfig) -> dict[str, Any]:
    """Refuse to continue if the configuration or the data differ from the run's creation."""
    ident = rd.read_json("run.json")
    if not isinstance(ident.get("config"), dict) or "run_id" not in ident:
        raise UserError(f"{rd.file('run.json')} does not describe a run (no config or run id); cannot verify a resume")
    if not isinstance(ident.setdefault("data_files", {}), dict):
        raise UserError(f"{rd.file('run.json')}: data_files must be a table of file -> SHA-256; found "
                        f"{_short(ident['data_files'])}")
    # run.json is strict JSON (null for NaN/inf); one written before that holds bare NaN/Infinity: both
    # read the same once strict() maps them to None.
    stored, now = _flatten(jsonio.strict(ident["config"])), _flatten(_as_written(config))
    # A key added to the framework after the run was created is absent from run.json; at its
    # default it changes nothing (the run was made under that default), so it is not a change.
    defaults = _flatten(_as_written(cfgmod.merge(cfgmod.RunConfig(), {"run": {"protocol": config.run.protocol}})))
    for key in sorted(set(stored) | set(now)):
        if key == "run.rounds" or (key not in stored and key in now and key in defaults and _same(now[key], defaults[key])):
            continue
        if key not in stored or key not in now or not _same(stored[key], now[key]):
            raise UserError(
                f"config.toml in {rd.path} changed {key} from {stored.get(key, '(unset)')!r} to "
                f"{now.get(key, '(unset)')!r} since the run was created; only run.rounds may change on --resume"
            )
    files = run_data_files(config)
    for path in sorted(set(files) | set(ident["data_files"])):
        old, new = ident["data_files"].get(path), files.get(path)
        if old != new:
            raise UserError(
                f"data file {path} changed since the run was created (sha256 then {old or 'absent'}, "
                f"now {new or 'absent'}); resuming would train on other data"
            )
    return ident


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _is_number_or_null(value: Any) -> bool:
    """A number, or ``null``: strict JSON's NaN/inf (a diverged loss, an undefined metric)."""
    return value is None or _is_number(value)


#: The keys of a costs.jsonl row that the summary averages.
_COST_KEYS = ("bytes_per_client", "bytes_up", "bytes_down", "messages", "clients")


def _row_round(line: str, name: str) -> int:
    """The round of one ``metrics.jsonl`` / ``costs.jsonl`` line, after checking that the line holds
    what the run wrote there (the summary and the plot read these rows back).

    Raises:
        ValueError: not a JSON object (or nested too deeply), no integer ``round``, a metrics value
            that is not a number, or cost fields the summary averages that are not numbers.
    """
    row = loads_json(line)
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, found {type(row).__name__}")
    if type(row.get("round")) is not int:
        raise ValueError(f"'round' must be an integer; found {_short(row.get('round'))}")
    if name == "metrics.jsonl":
        bad = next((k for k, v in row.items() if not _is_number_or_null(v)), None)
        if bad is not None:
            raise ValueError(f"{bad!r} must be a number (or null); found {_short(row[bad])}")
        return row["round"]
    bad = next((k for k in _COST_KEYS if k in row and not _is_number_or_null(row[k])), None)
    if bad is not None:
        raise ValueError(f"{bad!r} must be a number (or null); found {_short(row[bad])}")
    seconds = row.get("seconds", {})
    if not isinstance(seconds, dict) or not all(_is_number_or_null(v) for v in seconds.values()):
        raise ValueError(f"'seconds' must be a table of party -> seconds; found {_short(seconds)}")
    return row["round"]


class _Run:
    """One execution of the loop (state shared by the helpers below)."""

    def __init__(self, req: RunRequest, rd: RunDir, prep: Prepared, trainer: Any, run_id: str):
        self.req, self.rd, self.prep, self.trainer, self.run_id = req, rd, prep, trainer, run_id
        self.config = req.config
        self.spec = req.config.spec
        self.ks = tuple(self.config.eval.ks)
        self.rounds = self.config.run.rounds if self.spec.trains else 0
        p = self.config.section("privacy")
        self.delta = p.delta
        self.ledger = PrivacyLedger(rd.file(LEDGER), budget=None if math.isinf(p.budget_epsilon) else (p.budget_epsilon, p.delta))
        self.ledger.entries()  # an edited row (LedgerError) stops a resume now, not after it trained a round
        self.views = None
        if self.config.run.record_views and self.spec.federated and trainer.transport is not None:
            from experiments.run.views import ViewRecorder
            from protocols.secure_sum import SERVER2

            roles = tuple(self.spec.adversaries)
            if getattr(self.config.protocol_config, "secure_aggregation", None) == "dpf" and SERVER2 not in roles:
                roles += (SERVER2,)  # the DPF sum's second server (secure_sum's receiver2) is an adversary too
            self.views = ViewRecorder(rd, self.spec.name, roles, self.config.run.record_every,
                                      self.rounds - 1)
            trainer.transport.transcript.keep_payloads = self.views.filter

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The metrics recorded at evaluation points: sampled (or full if there are no negatives)."""
        if self.spec.task == "rating":
            m = self.trainer.evaluate(self.prep.split.test)
            return {"RMSE": float(m["rmse"]), "MAE": float(m["mae"])}
        if self.prep.candidates is not None:
            out = evaluate_sampled(self.trainer.score, self.prep.candidates, ks=self.ks)
        else:
            out = evaluate_full_by_rule(self.trainer.score_all, self.prep.split, ks=self.ks)["pessimistic"]
        return {**out, **self.evaluate_valid()}

    def evaluate_valid(self) -> dict[str, float]:
        """The validation items' metrics, keys prefixed ``valid_`` (empty without validation items): on
        their candidates, or among all items when the test metrics are full-ranking ones."""
        split = self.prep.split
        if getattr(split, "valid_items", None) is None:
            return {}
        if self.prep.candidates is not None and self.prep.valid_candidates is not None:
            m = evaluate_sampled(self.trainer.score, self.prep.valid_candidates, ks=self.ks)
        else:
            m = evaluate_full_by_rule(self.trainer.score_all, split, ks=self.ks, target="valid")["pessimistic"]
        return {f"{VALID_PREFIX}{k}": v for k, v in m.items()}

    def evaluate_ties(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{"sampled"|"full": {rule: metrics}}``: the final evaluation under every tie rule (ranking only;
        ``full`` when ``eval.full_ranking``, ``sampled`` when there are candidates)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        if self.prep.candidates is not None:
            out["sampled"] = evaluate_sampled_by_rule(self.trainer.score, self.prep.candidates, ks=self.ks)
        if self.config.eval.full_ranking or self.prep.candidates is None:
            out["full"] = evaluate_full_by_rule(self.trainer.score_all, self.prep.split, ks=self.ks)
        return out

    # -- one round -------------------------------------------------------------------------------
    def round(self, r: int, t0: float) -> dict[str, Any]:
        # With a budget, a round whose releases would exceed it is undone: nothing from it is kept.
        snapshot = self.trainer.state_dict() if self.ledger.budget is not None else None
        if self.views is not None:
            self.views.begin(r)
        secure: dict[str, float] = {}  # each client's secure-aggregation seconds this round

        def count_secure(info: dict) -> None:
            if info["protocol"] == "plain":  # an unmasked sum: no secure step to count
                return
            for name, sec in zip(info["senders"], info["client_seconds"]):
                secure[name] = secure.get(name, 0.0) + float(sec)

        try:
            with observe_secure(count_secure):
                stats = self.trainer.run_round()
        except (ValueError, ArithmeticError) as exc:  # a mechanism refused a non-finite value (FedMF's LDP clip)
            if self.views is not None:
                self.views.filter.active = False  # the round did not finish: nothing of it is recorded
            if not (isinstance(exc, NonFiniteInputError) or _has_non_finite(self.trainer.state_dict())):
                raise
            self.rd.append_jsonl("metrics.jsonl", {"round": r + 1, "loss": None,
                                                   "seconds": round(time.perf_counter() - t0, 3)})
            raise self._diverged_error(r + 1, math.nan, f"a value of the round was not finite ({exc})") from exc
        try:
            with self.ledger.round(self.ledger.next_round()) as rnd:
                for rel in stats.releases:
                    rnd.record(rel.event, who=rel.who, what=rel.what, cohort=rel.cohort,
                               params={**rel.params, "protocol_round": r})
        except BudgetExceededError:
            if snapshot is not None:
                self.trainer.load_state_dict(snapshot)
            if self.views is not None:
                self.views.filter.active = False  # the round is undone: nothing of it is recorded
            raise
        transport = self.trainer.transport
        cost: dict[str, Any] = {"round": r}
        if transport is not None:
            transcript = transport.transcript
            if self.views is not None:  # after the ledger, before anything else of the round is published
                self.views.end(r, transcript.records, self.trainer.public_info())
            cost.update(transcript.round_summary(r))
            self.rd.append("transcript.csv", "".join(
                f"{r},{party},{b['sent']},{b['received']}\n" for party, b in sorted(transcript.bytes_by_party(r).items())
            ))
            transcript.drop_before(r + 1)
        seconds = device_seconds(stats.seconds, secure, self.trainer)
        cost["seconds"] = {k: round(float(v), 6) for k, v in seconds.items()}
        if secure:
            per = np.array(list(secure.values()))
            cost["client_secure_seconds"] = {"mean": round(float(per.mean()), 6), "max": round(float(per.max()), 6),
                                             "clients": int(per.size)}
        cost.update({k: v for k, v in stats.extra.items() if k not in cost})
        self.rd.append_jsonl("costs.jsonl", cost)
        row: dict[str, Any] = {"round": r + 1, "loss": round(float(stats.loss), 6)}
        if self.diverged(stats.loss):
            row["seconds"] = round(time.perf_counter() - t0, 3)
            self.rd.append_jsonl("metrics.jsonl", jsonio.strict(row))
            raise self._diverged_error(r + 1, stats.loss, f"the training loss is {stats.loss} and the model holds "
                                       "non-finite values")
        every = self.config.run.eval_every
        if r + 1 == self.rounds or (every and (r + 1) % every == 0):
            row.update(self.evaluate())
        row["seconds"] = round(time.perf_counter() - t0, 3)
        self.rd.append_jsonl("metrics.jsonl", row)
        if (r + 1) % self.config.run.checkpoint_every == 0 or r + 1 == self.rounds:
            self.checkpoint(time.perf_counter() - t0)
        return row

    def diverged(self, loss: float) -> bool:
        """Whether a round's loss says training diverged: an infinite loss, or NaN with a non-finite
        number in the model state (a NaN loss alone can mean "no client reported one")."""
        if math.isinf(loss):
            return True
        return math.isnan(loss) and _has_non_finite(self.trainer.state_dict())

    def _diverged_error(self, rnd: int, loss: float, what: str) -> TrainingDiverged:
        state = self.rd.load_checkpoint()
        ck = int(state["trainer"].get("round", 0)) if isinstance(state, dict) and isinstance(state.get("trainer"), dict) else 0
        section = self.spec.section or "run"  # the protocol's own keys
        kept = (f"the checkpoint holds round {ck}: `secagg run --resume {self.rd.path} --rounds {ck}` finishes "
                "there with a summary" if ck else "no round was checkpointed: start a new run")
        message = (f"round {rnd}: {what}, so training "
                   f"diverged; the run stopped. {self.rd.path} stays valid ({kept}; metrics.jsonl records the "
                   f"round's loss as null). Lower the learning rate ("
                   + ("fedmf.mf.lr: the fedmf presets use 0.0005, docs/fedmf.md" if self.spec.name == "fedmf"
                      else f"the lr key of [{section}]")
                   + ") or pick a preset that converges on this data.")
        self.rd.write_json("summary.json", jsonio.strict({
            "preset": self.req.preset, "protocol": self.config.run.protocol, "rounds": ck, "seed": self.config.run.seed,
            "metrics": None, "metrics_full": None, "ties": None,
            "stopped": message, "diverged": {"round": rnd, "loss": loss, "checkpoint_round": ck},
            "versions": _versions(), "run_dir": str(self.rd.path), "run_id": self.run_id,
        }))
        self.ledger.close()
        return TrainingDiverged(message, self.rd.path, rnd, ck)

    def checkpoint(self, elapsed: float) -> None:
        self.rd.save_checkpoint({"run_id": self.run_id, "seconds": elapsed, "trainer": self.trainer.state_dict()})

    # -- privacy ---------------------------------------------------------------------------------
    def privacy(self) -> dict[str, Any]:
        """The summary's ``privacy`` block; ``statement`` says in words what every release spent
        (:func:`experiments.cli.privacy_text.describe_spent`)."""
        from experiments.cli.privacy_text import describe_spent

        entries = self.ledger.entries()
        noisy = [e for e in entries if not isinstance(e.event, (NoOp, NonPrivate))]
        spec = self.spec
        # The protocol's own report keys (FEL: each leaf and the over-arch), cheap ones only: FedCL's
        # per-user PLD figure is left to `secagg privacy report` (one PLD per upload pattern).
        extra = {}
        if entries and spec.privacy_report is not None and not any((e.cohort or "").startswith("user:") for e in entries):
            extra = spec.privacy_report(self.ledger, self.delta)
        words = describe_spent(self.ledger, self.delta, extra)
        out: dict[str, Any] = {
            "ledger": LEDGER,
            "releases": len(entries),
            "dp_noise": bool(noisy),
            "reproducible_from_seed": not noisy,
            "delta": self.delta,
            "epsilon": words["epsilon"],
            "statement": words["statement"],
            "parts": words["parts"],
        }
        if words["unprotected"]:
            out["unprotected"] = True
        if words["accountant"] is not None:
            out["accountant"] = words["accountant"]
        return out


def _has_non_finite(obj: Any) -> bool:
    """Whether a state (nested dicts/lists of arrays, tensors and numbers) holds a NaN or infinity."""
    if isinstance(obj, dict):
        return any(_has_non_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_non_finite(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return bool(obj.is_floating_point() and not torch.isfinite(obj).all())
    if isinstance(obj, np.ndarray):
        return bool(obj.dtype.kind in "fc" and not np.isfinite(obj).all())
    if isinstance(obj, float):
        return not math.isfinite(obj)
    return False


def run_plugins(req: RunRequest) -> list[str]:
    """The plugin modules run.json records, for ``--resume`` (and ``secagg attack run-dir``) to import
    again: every ``--plugin`` module, and the entry-point module that registered the run's protocol."""
    from protocols.registry import plugin_of

    origin = plugin_of(req.config.run.protocol)
    return list(dict.fromkeys([*req.plugins, *([origin] if origin else [])]))


def _build(req: RunRequest, prep: Prepared):
    return build_trainer(req.config, prep)


def build_trainer(cfg: cfgmod.RunConfig, prep: Prepared):  # noqa: ANN201 (the protocol's trainer)
    """The trainer ``secagg run`` builds for ``cfg`` on the prepared data: the in-process transport for a
    federated protocol, and the simulated clients' own policy (``[clients]``), never the server's."""
    transport = InProcessTransport(Transcript()) if cfg.spec.federated else None
    ctx = BuildContext(
        split=prep.split, config=cfg.protocol_config, seed=cfg.run.seed, source=cfg.data.source,
        transport=transport, data_options=cfg.to_dict()["data"], exclude=prep.exclude,
    )
    trainer = cfg.spec.build(ctx)
    if cfg.spec.federated:  # the simulated clients' own settings ([clients]); never the server's
        set_device_policy(trainer, cfg.clients.policy())
    return trainer


def _open(req: RunRequest, prep: Prepared, trainer: Any) -> tuple[RunDir, str, float]:
    """Create or reopen the run directory; returns it, the run id and the seconds already spent."""
    cfg = req.config
    if req.resume is None:
        rd = RunDir.create(req.out or default_run_dir(req.preset))
        rd.lock()
        run_id = uuid.uuid4().hex
        rd.write_json("run.json", {
            "preset": req.preset, "run_id": run_id, "protocol": cfg.run.protocol,
            "config": cfg.to_dict(), "data_files": run_data_files(cfg), "versions": _versions(),
            "plugins": run_plugins(req),
        })
        rd.write_text("config.toml", cfgmod.to_toml(cfg))
        return rd, run_id, 0.0
    rd = RunDir.open_existing(req.resume)
    rd.lock()
    ident = verify_resume(rd, cfg)
    run_id = ident["run_id"]
    state = rd.load_checkpoint()
    done_rows = len(rd.read_jsonl("costs.jsonl")) + len(rd.read_jsonl("metrics.jsonl"))
    elapsed, start = 0.0, 0
    if state is None:
        if done_rows and req.config.spec.trains:
            raise UserError(
                f"{rd.file(CHECKPOINT)} is missing but {rd.path} records completed rounds; it cannot be "
                "continued (start a new run directory)"
            )
    else:
        if state.get("run_id") != run_id:
            raise UserError(
                f"{rd.file(CHECKPOINT)} belongs to another run (run id {state.get('run_id')!r}, this run is "
                f"{run_id!r}); it was replaced, so the run cannot be continued"
            )
        seconds = state.get("seconds", 0.0)
        if not _is_number(seconds) or not 0 <= seconds < math.inf:
            raise UserError(f"checkpoint {rd.file(CHECKPOINT)}: 'seconds' must be a number >= 0; found {_short(seconds)}")
        try:
            trainer.load_state_dict(state["trainer"])
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise UserError(f"checkpoint {rd.file(CHECKPOINT)} does not fit this run: {exc}") from None
        elapsed, start = float(seconds), int(trainer.round)
    if start > cfg.run.rounds:  # checked before config.toml is rewritten
        raise UserError(
            f"{rd.path} already completed {start} rounds; --rounds {cfg.run.rounds} would not undo them "
            f"(resume with --rounds >= {start})"
        )
    # Cut the appended files back to the checkpoint (a crash may have left rows past it).
    rd.truncate_after("metrics.jsonl", lambda ln: _row_round(ln, "metrics.jsonl") <= start)
    rd.truncate_after("costs.jsonl", lambda ln: _row_round(ln, "costs.jsonl") < start)
    rd.truncate_after("transcript.csv", lambda ln: int(ln.split(",", 1)[0]) < start, header=TRANSCRIPT_HEADER)
    rd.write_text("config.toml", cfgmod.to_toml(cfg))
    return rd, run_id, elapsed


def execute(req: RunRequest) -> dict[str, Any]:
    """Run (or resume) ``req`` to completion; returns the summary also written to summary.json."""
    cfg = req.config
    if cfg.run.rounds > MAX_ROUNDS:
        raise UserError(f"--rounds {cfg.run.rounds} is more than the {MAX_ROUNDS:,} rounds a run may have")
    prep = prepare_data(cfg)  # bad input fails here, before anything is written
    layout = prep.description.get("layout")
    if layout and not req.quiet:  # say how the file was read (the format and columns may be inferred)
        print(f"data: {layout['read_as']}", file=sys.stderr)
    from experiments.run.canaries import for_run, write as write_canaries

    prep, canaries = for_run(prep, cfg, req.resume)  # audit canaries: bits from the OS CSPRNG (a new run)
    trainer = _build(req, prep)
    rd, run_id, elapsed = _open(req, prep, trainer)
    if canaries is not None and req.resume is None:
        write_canaries(rd, canaries)
    try:
        return _loop(req, rd, prep, trainer, run_id, elapsed)
    finally:
        rd.unlock()


def _loop(req: RunRequest, rd: RunDir, prep: Prepared, trainer: Any, run_id: str, elapsed: float) -> dict[str, Any]:
    """Run the rounds and write the summary; Ctrl-C becomes :class:`RunInterrupted` naming ``rd``."""
    try:
        return _rounds(req, rd, prep, trainer, run_id, elapsed)
    except RunInterrupted:
        raise
    except KeyboardInterrupt:
        raise RunInterrupted(rd.path) from None


#: A first round slower than this (seconds) prints the time the remaining rounds will take.
SLOW_ROUND_SECONDS = 30.0


def pace_note(round_seconds: float, done: int, rounds: int, now: float | None = None) -> str | None:
    """The line printed after the first round of this process when it took more than
    :data:`SLOW_ROUND_SECONDS`: its time, and the remaining rounds' time at that pace (``None`` if it was
    faster or no round remains).

    Why measured and not predicted: a round's cost depends on the protocol (how many secure sums,
    over how many clients, how wide, with which neighbourhood k), the runtime (in process or Flower)
    and the machine's load; only the protocol knows the first two, so a cost model in the run loop
    would be wrong for most of them. The first round is measured under the real conditions, and the
    progress bar keeps the estimate current from there.
    """
    left = rounds - done
    if round_seconds <= SLOW_ROUND_SECONDS or left <= 0:
        return None
    import datetime as _dt

    now = time.time() if now is None else now
    eta = _dt.datetime.fromtimestamp(now + left * round_seconds, _dt.timezone.utc).strftime("%H:%M UTC")
    return (f"round {done} took {_duration(round_seconds)}; the {left} remaining round{'s' * (left != 1)} will take "
            f"about {_duration(left * round_seconds)} at that pace (until about {eta}). Ctrl-C stops safely; "
            "--resume continues.")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _rounds(req: RunRequest, rd: RunDir, prep: Prepared, trainer: Any, run_id: str, elapsed: float) -> dict[str, Any]:
    run = _Run(req, rd, prep, trainer, run_id)
    cfg, rounds = req.config, run.rounds
    if trainer.transport is not None and not rd.file("transcript.csv").exists():
        rd.append("transcript.csv", TRANSCRIPT_HEADER + "\n")
    start = int(getattr(trainer, "round", 0))
    if run.views is not None:
        run.views.open(start)
    follow = main_metric(cfg)
    t0 = time.perf_counter() - elapsed
    bar = tqdm(total=rounds, initial=start, desc=req.preset, unit="round", file=sys.stderr,
               disable=req.quiet or rounds == 0)
    stopped = None
    try:
        for r in range(start, rounds):
            tr = time.perf_counter()
            try:
                row = run.round(r, t0)
            except BudgetExceededError as exc:
                stopped = f"stopped before round {r + 1}: {exc}"
                break
            bar.set_postfix({k: f"{v:.3f}" for k, v in row.items() if k in ("loss", *follow) and v is not None})
            bar.update(1)
            note = pace_note(time.perf_counter() - tr, r + 1, rounds) if r == start else None
            if note is not None:
                bar.write(f"note: {note}", file=sys.stderr)
            if r == start:
                settle_heap()
    finally:
        bar.close()
        release_heap()  # what follows (evaluation, the report) may free the frozen objects: collectable again
    train_seconds = time.perf_counter() - t0
    done = int(getattr(trainer, "round", 0))
    if stopped:
        run.checkpoint(train_seconds)
    history = rd.read_jsonl("metrics.jsonl")
    last = history[-1] if history else {}
    te = time.perf_counter()
    if last.get("round") == done and follow[0] in last and done:
        metrics = {k: v for k, v in last.items() if k not in ("round", "loss", "seconds")}
    else:
        metrics = run.evaluate()
        rd.append_jsonl("metrics.jsonl", {"round": done, **metrics, "seconds": round(train_seconds, 3)})
        history.append({"round": done, **metrics})
    metrics_valid = {k[len(VALID_PREFIX):]: v for k, v in metrics.items() if k.startswith(VALID_PREFIX)} or None
    metrics = {k: v for k, v in metrics.items() if not k.startswith(VALID_PREFIX)}
    eval_s = time.perf_counter() - te
    metrics_full, full_s, ties = None, 0.0, None
    if cfg.spec.task == "ranking":
        te = time.perf_counter()
        ties = run.evaluate_ties()
        if cfg.eval.full_ranking:
            metrics_full = ties["full"]["pessimistic"]
        full_s = time.perf_counter() - te
    costs = rd.read_jsonl("costs.jsonl")
    summary = {
        "preset": req.preset,
        "protocol": cfg.run.protocol,
        "rounds": done,
        "seed": cfg.run.seed,
        "metrics": metrics if (cfg.spec.task == "rating" or run.prep.candidates is not None) else None,
        "metrics_full": metrics_full,
        "metrics_valid": metrics_valid,
        "best_validation": best_validation(history, follow[0]) if metrics_valid else None,
        "ties": ties,
        "evaluation": _evaluation_protocol(cfg, prep),
        "data": prep.description,
        "bytes_per_client_per_round": float(np.mean([c.get("bytes_per_client", 0) for c in costs])) if costs and "bytes_per_client" in costs[0] else 0.0,
        "costs": _cost_summary(costs, trainer),
        "seconds": round(train_seconds + eval_s + full_s, 3),
        "seconds_per_round": round(train_seconds / max(done, 1), 4) if done else 0.0,
        "eval_seconds": {"main": round(eval_s, 3), "full": round(full_s, 3)},
        "privacy": run.privacy(),
        "public_info": _jsonable(trainer.public_info()),
        **({"views": run.views.summary()} if run.views is not None else {}),
        "stopped": stopped,
        "versions": _versions(),
        "run_dir": str(rd.path),
        "run_id": run_id,
    }
    run.ledger.close()
    rd.write_json("summary.json", summary)
    _plot(rd, history, req.preset, follow)
    return summary


def best_validation(history: list[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """Model selection: the evaluated round with the best validation ``metric`` (highest; lowest for
    RMSE/MAE; the first such round on ties) and the test metrics recorded at that round, to report
    beside the final round's. ``None`` when no row holds the validation metric."""
    key = VALID_PREFIX + metric
    rows = [h for h in history if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
    if not rows:
        return None
    lower = metric in ("RMSE", "MAE")
    best = min(rows, key=lambda h: (h[key] if lower else -h[key], h["round"]))
    return {
        "round": best["round"],
        "selected_by": f"{key} ({'lowest' if lower else 'highest'}; the first such round on ties), over the "
                       f"{len(rows)} evaluated rounds",
        "valid": {k[len(VALID_PREFIX):]: v for k, v in best.items() if k.startswith(VALID_PREFIX)},
        "metrics": {k: v for k, v in best.items() if k not in ("round", "loss", "seconds") and not k.startswith(VALID_PREFIX)},
    }


def device_seconds(seconds: dict[str, float], secure: dict[str, float], trainer: Any) -> dict[str, float]:
    """A round's seconds per party with the device's secure-aggregation work (issue 25 item 5).

    ``secure`` holds each client's seconds in the masking/chain steps of every secure sum of the round
    (key agreement, PRG expansion, sealing, shares; :func:`protocols.secure_sum.observe`). When a
    round ran any, ``client_secure`` is their mean over the clients, ``client_compute`` the device's
    own training work and ``client`` their sum. A protocol whose ``client`` already includes its
    secure work says so with ``client_seconds_include_secure = True`` (FedAvg, LightFR; FedFast, a
    FedAvg subclass whose ``client`` is its local training alone, sets it back to ``False``); one that
    reports ``client_secure`` itself (STTFedRec) is left as it is. The two-server DPF sums count too:
    a client's secure work there is its key generation.
    """
    if not secure or "client_secure" in seconds:
        return dict(seconds)
    measured = float(np.mean(list(secure.values())))
    client = float(seconds.get("client", 0.0))
    includes = bool(getattr(trainer, "client_seconds_include_secure", False))
    compute = max(0.0, client - measured) if includes else client
    return {**seconds, "client_compute": compute, "client_secure": measured, "client": compute + measured}


def _cost_summary(costs: list[dict[str, Any]], trainer: Any) -> dict[str, Any]:
    """Mean per-round costs from costs.jsonl, plus whatever the protocol reports itself."""
    out: dict[str, Any] = {}
    if costs:
        for key in _COST_KEYS:
            if key in costs[0]:
                out[f"{key}_per_round"] = float(np.mean([c.get(key, 0) for c in costs]))
        parties = sorted({p for c in costs for p in c.get("seconds", {})})
        out["seconds_per_round"] = {p: float(np.mean([c.get("seconds", {}).get(p, 0.0) for c in costs])) for p in parties}
    report = getattr(trainer, "cost_report", None)
    if callable(report):
        out.update(_jsonable(report()))
    return out


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


def _evaluation_protocol(config: cfgmod.RunConfig, prep: Prepared) -> dict[str, Any]:
    if config.spec.task == "rating":
        return {"split": prep.split.protocol, "metrics": "RMSE and MAE of predicted ratings on the held-out 20%"}
    cands = prep.candidates
    if cands is not None and cands.source != "sampled":
        n = cands.n_candidates()
        sampled = (f"held-out item + the candidates listed in {cands.source} ({int(n.min()) - 1}.."
                   f"{int(n.max()) - 1} per user; nothing sampled)")
    elif cands is not None:
        sampled = f"held-out item + {cands.n_negatives} sampled items the user never interacted with"
    else:
        sampled = "off (eval.negatives = 0): full ranking only"
    return {
        "split": prep.split.protocol,
        "sampled": sampled,
        "full": ("held-out item ranked among all items not in the user's training data"
                 + (" (validation item excluded)" if prep.split.valid_items is not None else "")) if config.eval.full_ranking else "off",
        "ks": list(config.eval.ks),
        "ties": TIE_RULE,
        "tie_rules": {rule: TIE_RULES_TEXT[rule] for rule in TIE_RULES},
        "users_evaluated": int(len(cands) if cands is not None else len(prep.split.test_users)),
        "validation": _validation_text(prep),
    }


def _validation_text(prep: Prepared) -> str:
    """How the validation items are ranked and used (``off`` without any)."""
    split = prep.split
    if getattr(split, "valid_items", None) is None:
        return "off (no validation items: split.validation = false, or split files without one)"
    vc = prep.valid_candidates
    if prep.candidates is None or vc is None:
        how = "ranked among all items not in the user's training data (test item excluded)"
    elif vc.source != "sampled":
        how = f"ranked among the candidates listed in {vc.source}"
    else:
        how = f"ranked among {vc.n_negatives} other sampled items (drawn apart from the test negatives)"
    return (f"one validation item per user, {how}; metrics.jsonl holds valid_* beside the test metrics at "
            "every evaluation, and summary.json's best_validation gives the test metrics at the round "
            "with the best validation figure")


def _plot(rd: RunDir, history: list[dict[str, Any]], title: str, keys: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [h for h in history if keys[0] in h]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in keys:
        pts = [(h["round"], h[key]) for h in rows if isinstance(h.get(key), (int, float))]
        ax.plot([r for r, _ in pts], [v for _, v in pts], marker="o", label=key)
    ax.set_xlabel("round")
    ax.set_ylabel("metric")
    ax.set_title(title)
    if not keys[0].startswith("RMSE"):
        ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = rd.file(".metrics.png.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    tmp.replace(rd.file("metrics.png"))
