"""``secagg reproduce PAPER --data D``: run a paper's comparison with paired seeds and judge each claim.

For every preset a paper's claims name (:mod:`experiments.studies.reproduce_claims`), plus the floors
(ItemPop, random), and for every seed ``0 .. seeds-1`` (the same seeds for every preset: paired), one run of
the ordinary run loop (:func:`experiments.run.training.execute`) into ``OUT/runs/<preset>-s<seed>``; a run
directory already complete with the same configuration is read back instead of re-run, and an interrupted one
is resumed, so a killed ``reproduce`` continues where it stopped. Every run of a paper gets the paper's core
overrides (the evaluation protocol, the split, the data filter), so the floors are measured exactly as the
presets they sit beside.

Statistics: every number is the mean over seeds with a 95% Student-t interval over seeds (``mean +- t_{n-1}
s / sqrt(n)``; none with one seed); a difference is the paired one (per seed ``a - b``, then the same t
interval). With two seeds ``t_1 = 12.7``: the intervals are wide by construction, and a claim whose interval
still excludes 0 is a strong result.

Verdicts: ``holds``, ``does not hold`` (with the measured difference and why) or ``not testable here`` (a
preset that does not exist, a figure on a dataset we were not given, a protocol option we lack, too few seeds
for an interval). Writes ``reproduce.md``, ``reproduce.json`` and ``reproduce.png`` into ``OUT``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from experiments import jsonio
from experiments.errors import UserError
from experiments.run import config as cfgmod
from experiments.studies.reproduce_claims import FLOORS, KINDS, PAPERS, Claim, Paper

__all__ = ["CI_TEXT", "dataset_name", "judge", "metric_value", "paper_config", "render_markdown", "reproduce",
           "t_interval"]

CI_TEXT = ("95% Student-t interval over seeds (mean +- t_{n-1, 0.975} s / sqrt(n)); differences paired by seed "
           "(the same seeds for every preset)")
HOLDS, FAILS, UNTESTABLE = "holds", "does not hold", "not testable here"


# -- data -----------------------------------------------------------------------------------------------------
def dataset_name(source: str) -> str:
    """What dataset ``source`` is, as the claims name them: ``filmtrust-authors`` (LightFR's split folder),
    ``ml-100k``, ``ml-1m``, ``ml-latest-small``, ``synthetic``, else the file or folder name."""
    if source == "synthetic":
        return "synthetic"
    path = Path(source)
    names = {p.name for p in path.iterdir()} if path.is_dir() else {path.name}
    if any(n.lower().startswith("filmtrust") and n.endswith(("_train.csv", "_test.csv")) for n in names):
        return "filmtrust-authors"
    if "u.data" in names:
        return "ml-100k"
    if "ratings.dat" in names:
        return "ml-1m"
    if "ml-latest-small" in str(path.resolve()):
        return "ml-latest-small"
    return path.name


def _family(dataset: str) -> str:
    return "movielens" if dataset.startswith("ml-") else dataset


def paper_config(paper: Paper, preset: str, seed: int, source: str, rounds_scale: float) -> cfgmod.RunConfig:
    """The configuration of one run: the preset, the paper's overrides, the data, the seed and the scaled rounds."""
    cfg = cfgmod.load_preset(preset)
    cfg = cfgmod.merge(cfg, paper.common)
    dataset = dataset_name(source)
    extra = paper.per_dataset.get(_family(dataset))
    if extra:
        cfg = cfgmod.merge(cfg, extra)
    rounds, every = cfg.run.rounds, cfg.run.eval_every
    if rounds:
        rounds = max(1, round(rounds * rounds_scale))
        every = max(1, min(rounds, round(every * rounds_scale))) if every else 0
    data = {"source": source if source == "synthetic" else str(Path(source).expanduser().resolve())}
    return cfgmod.merge(cfg, {"run": {"seed": seed, "rounds": rounds, "eval_every": every}, "data": data})


# -- statistics -----------------------------------------------------------------------------------------------
def t_interval(values: list[float]) -> dict[str, Any]:
    """``{"mean", "lo", "hi", "n", "values"}``: the mean and its 95% t interval over ``values`` (lo/hi ``None``
    with fewer than two values; every field ``None`` with none; an infinite value gives an infinite mean and no
    interval)."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    out: dict[str, Any] = {"mean": None, "lo": None, "hi": None, "n": len(vals), "values": vals}
    if not vals:
        return out
    mean = float(np.mean(vals))
    out["mean"] = mean
    if len(vals) < 2 or not math.isfinite(mean):
        return out
    from scipy.special import stdtrit  # the t quantile (scipy.stats costs seconds to import)

    half = float(stdtrit(len(vals) - 1, 0.975) * np.std(vals, ddof=1) / math.sqrt(len(vals)))
    out["lo"], out["hi"] = mean - half, mean + half
    return out


# -- metrics of one run ---------------------------------------------------------------------------------------
def _load_spread(run_dir: Path) -> dict[str, float] | None:
    """FedFast's sampler load from the run's checkpoint: how often each client was drawn."""
    from experiments.run.rundir import RunDir

    state = RunDir.open_existing(run_dir).load_checkpoint()
    load = ((state or {}).get("trainer") or {}).get("clusters", {}).get("load") if state else None
    if load is None:
        return None
    load = np.asarray(load, np.float64)
    load = load[load >= 0]
    if not load.size or load.sum() == 0:
        return None
    top = np.sort(load)[::-1][: max(1, int(math.ceil(0.01 * load.size)))]
    return {"load_cv": float(load.std() / load.mean()), "load_top1pct": float(top.sum() / load.sum()),
            "load_max_over_mean": float(load.max() / load.mean())}


def metric_value(summary: dict[str, Any], metric: str, run_dir: Path | None = None) -> float | None:
    """One metric of a run (the prefixes of :mod:`experiments.studies.reproduce_claims`); ``None`` if the run
    does not have it."""
    if metric == "bytes":
        v = summary.get("bytes_per_client_per_round")
        return float(v) if v else None
    if metric.startswith("load_"):
        spread = _load_spread(run_dir) if run_dir is not None else None
        return None if spread is None else spread.get(metric)
    if metric.startswith("opt:"):
        ties = summary.get("ties") or {}
        block = ties.get("sampled") or ties.get("full") or {}
        v = (block.get("optimistic") or {}).get(metric[4:])
    elif metric.startswith("full:"):
        v = (summary.get("metrics_full") or {}).get(metric[5:])
    elif metric.startswith("best:"):
        v = ((summary.get("best_validation") or {}).get("metrics") or {}).get(metric[5:])
    else:
        v = (summary.get("metrics") or summary.get("metrics_full") or {}).get(metric)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def rounds_ratio(hist_a: list[dict[str, Any]], hist_b: list[dict[str, Any]], key: str) -> float | None:
    """Rounds ``a`` needs to first reach ``b``'s best ``key`` over rounds ``b`` needs to first reach it (``inf`` if
    ``a`` never does; ``None`` without ``b`` values). Round 0 (before training) counts as one round."""
    pts_b = [(h["round"], h[key]) for h in hist_b if isinstance(h.get(key), (int, float))]
    pts_a = [(h["round"], h[key]) for h in hist_a if isinstance(h.get(key), (int, float))]
    if not pts_b or not pts_a:
        return None
    best = max(v for _, v in pts_b)
    rb = min(r for r, v in pts_b if v >= best)
    ra = next((r for r, v in sorted(pts_a) if v >= best), None)
    return math.inf if ra is None else max(ra, 1) / max(rb, 1)


# -- verdicts -------------------------------------------------------------------------------------------------
def _fmt(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if math.isinf(v):
        return "inf"
    return f"{v:.{digits}f}"


def _ci(s: dict[str, Any] | None) -> str:
    if not s or s.get("mean") is None:
        return "n/a"
    if s.get("lo") is None:
        return _fmt(s["mean"])
    return f"{_fmt(s['mean'])} [{_fmt(s['lo'])}, {_fmt(s['hi'])}]"


def judge(claim: Claim, a: list[float | None], b: list[float | None] | None, dataset: str,
          missing: tuple[str, ...] = ()) -> dict[str, Any]:
    """The verdict on ``claim`` from per-seed values of its presets (paired by position; ``None`` where a seed has
    no value). Returns ``{"verdict", "reason", "a", "b", "diff"}`` (the last three :func:`t_interval` dicts)."""
    out: dict[str, Any] = {"a": None, "b": None, "diff": None}

    def done(verdict: str, reason: str) -> dict[str, Any]:
        out.update(verdict=verdict, reason=reason)
        return out

    if claim.needs:
        return done(UNTESTABLE, claim.needs)
    if missing:
        return done(UNTESTABLE, f"preset{'s' * (len(missing) > 1)} {', '.join(missing)} not available")
    if claim.kind == "value" and dataset not in claim.datasets:
        return done(UNTESTABLE, f"the paper's figure is on {claim.paper_dataset}; this data is {dataset} (pass "
                                f"--data with {' or '.join(claim.datasets)})")
    out["a"] = sa = t_interval(a)
    if sa["mean"] is None:
        return done(UNTESTABLE, f"no value of {claim.metric} in the runs of {claim.a}")
    if claim.kind == "value":
        gap = sa["mean"] - claim.paper_a
        inside = sa["lo"] is not None and sa["lo"] <= claim.paper_a <= sa["hi"]
        ok = abs(gap) <= claim.margin or inside
        return done(HOLDS if ok else FAILS, f"ours {_ci(sa)} vs the paper's {_fmt(claim.paper_a)}: {gap:+.4f} "
                    f"({'within' if ok else 'beyond'} the tolerance {claim.margin:g}"
                    f"{' / inside our interval' if inside else ''})")
    if claim.kind == "faster":
        vals = [v for v in a if v is not None]
        never = sum(1 for v in vals if math.isinf(v))
        if never:
            return done(FAILS, f"{claim.a} never reached {claim.b}'s best in {never} of {len(vals)} seeds")
        if sa["lo"] is None:
            return done(UNTESTABLE, f"ratio {_fmt(sa['mean'], 3)} from one seed; an interval needs --seeds >= 2")
        ok = sa["hi"] < 1
        return done(HOLDS if ok else FAILS, f"rounds ratio {_ci(sa)} (the paper: {_fmt(claim.paper_a, 2)}); "
                    + ("faster with the interval below 1" if ok else "the interval reaches 1 or above: not faster"))
    out["b"] = sb = t_interval(b or [])
    if sb["mean"] is None:
        return done(UNTESTABLE, f"no value of {claim.metric} in the runs of {claim.b}")
    if claim.kind == "ratio":
        ratios = [y / x for x, y in zip(a, b or []) if x and y]
        out["diff"] = sr = t_interval(ratios)
        want = claim.margin * (claim.paper_b / claim.paper_a)
        ok = sr["mean"] is not None and sr["mean"] >= want
        return done(HOLDS if ok else FAILS, f"{claim.b} / {claim.a} = {_ci(sr)} (the paper: "
                    f"{claim.paper_b / claim.paper_a:.2f}; holds from {want:.2f})")
    sign = 1.0 if claim.higher else -1.0
    diffs = [sign * (x - y) for x, y in zip(a, b or []) if x is not None and y is not None]
    out["diff"] = sd = t_interval(diffs)
    if sd["lo"] is None:
        return done(UNTESTABLE, f"difference {_fmt(sd['mean'])} from {sd['n']} paired seed(s); an interval needs "
                                "--seeds >= 2")
    if abs(sd["hi"] - sd["lo"]) < 1e-12 and sd["n"] < 5:  # identical paired differences (discrete metrics, few seeds)
        return done(UNTESTABLE, f"difference {_fmt(sd['mean'])} identical in all {sd['n']} paired seeds: a "
                                "zero-width interval is no evidence with so few seeds; run more --seeds")
    better = "higher" if claim.higher else "lower"
    text = f"{claim.a} - {claim.b} ({better} is better, signed so + favours {claim.a}) = {_ci(sd)}"
    if claim.kind == "better":
        if sd["lo"] > 0:
            return done(HOLDS, text)
        why = "reversed: the interval is below 0" if sd["hi"] < 0 else "the interval includes 0"
        return done(FAILS, f"{text}; {why}")
    if claim.kind == "similar":
        ok = -claim.margin <= sd["lo"] and sd["hi"] <= claim.margin
        return done(HOLDS if ok else FAILS, f"{text}; {'within' if ok else 'not within'} +-{claim.margin:g}")
    if claim.kind == "no-worse":
        ok = sd["lo"] >= -claim.margin
        return done(HOLDS if ok else FAILS, f"{text}; {'not worse' if ok else 'worse'} by more than {claim.margin:g}")
    raise ValueError(f"unknown claim kind {claim.kind!r}; known: {', '.join(KINDS)}")


# -- running --------------------------------------------------------------------------------------------------
def _run(preset: str, config: cfgmod.RunConfig, run_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """One run into ``run_dir``: read back when complete with this configuration, resumed when interrupted."""
    from experiments.run.rundir import RunDir
    from experiments.run.training import RunRequest, execute

    if (run_dir / "summary.json").exists():
        rd = RunDir.open_existing(run_dir)
        if jsonio.strict(rd.read_json("run.json").get("config")) != jsonio.strict(config.to_dict()):
            raise UserError(f"{run_dir} holds a run of another configuration (other data, rounds or preset "
                            "version); pass another --out")
        return rd.read_json("summary.json")
    resume = run_dir if (run_dir / "run.json").exists() else None
    if resume:
        say(f"  resuming {run_dir}")
    return execute(RunRequest(preset=preset, config=config, out=None if resume else run_dir, resume=resume,
                              quiet=True))


def reproduce(paper_name: str, source: str, seeds: int, rounds_scale: float, out: Path,
              say: Callable[[str], None] = lambda s: print(s, file=sys.stderr), report_only: bool = False) -> dict[str, Any]:
    """Run ``paper_name``'s comparison on ``source`` and judge its claims; writes the three reports into ``out``
    and returns the JSON object. ``report_only``: run nothing, judge from the runs already complete in ``out``
    (a claim pairs only the seeds both its presets finished; a preset with no finished run is "not run")."""
    if paper_name not in PAPERS:
        raise UserError(f"unknown paper {paper_name!r}; known: {', '.join(PAPERS)}")
    if seeds < 1:
        raise UserError(f"--seeds must be >= 1; found {seeds}")
    if not (rounds_scale > 0 and math.isfinite(rounds_scale)):
        raise UserError(f"--rounds-scale must be a positive number; found {rounds_scale}")
    if source != "synthetic" and not Path(source).expanduser().exists():
        raise FileNotFoundError(f"--data {source}: no such file or folder")
    paper = PAPERS[paper_name]
    dataset = dataset_name(source)
    available, missing = _presets(paper)
    configs = {(p, s): paper_config(paper, p, s, source, rounds_scale) for p in available for s in range(seeds)}
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in available}
    total, k = len(configs), 0
    refused: dict[str, str] = {}  # presets that cannot run on this data (e.g. a rating baseline on ranking splits)
    for s in range(seeds):  # seed-major: one complete seed first
        for p in available:
            k += 1
            run_dir = out / "runs" / f"{p}-s{s}"
            if p in refused or (report_only and not (run_dir / "summary.json").exists()):
                continue
            t0 = time.perf_counter()
            try:
                summary = _run(p, configs[(p, s)], run_dir, say)
            except (UserError, ValueError) as exc:  # this preset on this data; the other claims still run
                refused[p] = str(exc)
                say(f"[{k}/{total}] {p} seed {s}: cannot run on this data: {exc}")
                continue
            main = paper.metrics[0]
            say(f"[{k}/{total}] {p} seed {s}: {main} {_fmt(metric_value(summary, main, run_dir))} "
                f"({time.perf_counter() - t0:.0f} s, {summary.get('rounds', 0)} rounds) {run_dir}")
            runs[p][s] = {"summary": summary, "dir": run_dir}
    unfinished = [p for p in available if not runs[p] and p not in refused]
    runs = {p: r for p, r in runs.items() if r}
    return _report(paper, source, dataset, seeds, rounds_scale, out, runs, missing, unfinished, refused)


def _presets(paper: Paper) -> tuple[list[str], list[str]]:
    """The presets to run (the floors, the extras, and the presets of every claim whose presets all exist) and
    those missing here (looked up now: a baseline that lands later is picked up without an edit)."""
    missing = [p for p in paper.presets() if p not in cfgmod.PRESETS]
    live = {p for c in paper.claims if not c.needs and not set(c.presets()) & set(missing) for p in c.presets()}
    run = [p for p in paper.presets() if p not in missing and (p in live or p in paper.extra or p in FLOORS)]
    return run, missing


def _values(runs: dict[str, dict[int, dict[str, Any]]], preset: str, metric: str, seeds: int) -> list[float | None]:
    by_seed = runs[preset]
    return [metric_value(by_seed[s]["summary"], metric, by_seed[s]["dir"]) if s in by_seed else None
            for s in range(seeds)]


def _claim_values(claim: Claim, runs: dict, seeds: int) -> tuple[list[float | None], list[float | None] | None]:
    if claim.metric.startswith("rounds_ratio:"):
        key = claim.metric.split(":", 1)[1]
        hist = lambda p, s: _history(runs[p][s]["dir"])  # noqa: E731
        return [rounds_ratio(hist(claim.a, s), hist(claim.b, s), key) if s in runs[claim.a] and s in runs[claim.b]
                else None for s in range(seeds)], None
    a = _values(runs, claim.a, claim.metric, seeds)
    return a, (_values(runs, claim.b, claim.metric, seeds) if claim.b else None)


def _history(run_dir: Path) -> list[dict[str, Any]]:
    from experiments.run.rundir import RunDir

    return RunDir.open_existing(run_dir).read_jsonl("metrics.jsonl")


def _report(paper: Paper, source: str, dataset: str, seeds: int, rounds_scale: float, out: Path,
            runs: dict, missing: list[str], unfinished: list[str] = (),
            refused: dict[str, str] | None = None) -> dict[str, Any]:
    refused = dict(refused or {})
    presets: dict[str, Any] = {}
    for p, by_seed in runs.items():
        metrics = sorted({*paper.metrics, *(c.metric for c in paper.claims if c.metric.split(":")[0] != "rounds_ratio"
                                             and (p in c.presets() or p in FLOORS))})
        presets[p] = {
            "available": True, "rounds": next(iter(by_seed.values()))["summary"].get("rounds", 0),
            "runs": {str(s): str(r["dir"]) for s, r in by_seed.items()},
            "metrics": {m: t_interval(_values(runs, p, m, seeds)) for m in metrics},
        }
    for p in missing:
        presets[p] = {"available": False}
    for p in unfinished:
        presets[p] = {"available": False, "unfinished": True}
    for p, why in refused.items():
        presets[p] = {"available": False, "refused": why}
    claims = []
    for c in paper.claims:
        gone = tuple(p for p in c.presets() if p in missing)
        late = tuple(p for p in c.presets() if p in unfinished)
        cannot = tuple(p for p in c.presets() if p in refused)
        a, b = _claim_values(c, runs, seeds) if not gone and not late and not cannot and not c.needs else ([], None)
        verdict = judge(c, a, b, dataset, gone)
        if cannot and not gone and not c.needs:
            verdict.update(verdict=UNTESTABLE, reason="; ".join(f"{p} cannot run on this data: {refused[p]}"
                                                                for p in cannot))
        elif late and not gone and not c.needs:
            verdict.update(verdict=UNTESTABLE, reason=f"no finished run of {', '.join(late)} (--report-only)")
        floors = {f: (presets[f]["metrics"].get(c.metric) if f in runs and c.metric in presets[f]["metrics"]
                      else None) for f in FLOORS}
        claims.append({
            "id": c.id, "text": c.text, "where": c.where, "kind": c.kind, "condition": KINDS[c.kind],
            "a": c.a, "b": c.b or None, "metric": c.metric, "higher_is_better": c.higher, "margin": c.margin,
            "paper": {"a": c.paper_a, "b": c.paper_b, "dataset": c.paper_dataset},
            "ours": {"a": verdict["a"], "b": verdict["b"], "diff": verdict["diff"]},
            "floors": floors, "verdict": verdict["verdict"], "reason": verdict["reason"],
        })
    counts = {v: sum(1 for c in claims if c["verdict"] == v) for v in (HOLDS, FAILS, UNTESTABLE)}
    result = {
        "paper": paper.name, "title": paper.title, "data": source, "dataset": dataset, "seeds": list(range(seeds)),
        "rounds_scale": rounds_scale, "ci": CI_TEXT,
        "overrides": {"common": paper.common, "dataset": paper.per_dataset.get(_family(dataset)) or {}},
        "presets": presets, "claims": claims, "verdicts": counts,
        "files": {"markdown": str(out / "reproduce.md"), "json": str(out / "reproduce.json"),
                  "png": str(out / "reproduce.png")},
    }
    result = jsonio.strict(result)
    from experiments.run.rundir import atomic_write_text

    atomic_write_text(out / "reproduce.md", render_markdown(result))
    atomic_write_text(out / "reproduce.json", jsonio.dumps(result, indent=1) + "\n")
    _plot(result, paper, out / "reproduce.png")
    return result


# -- reports --------------------------------------------------------------------------------------------------
def render_markdown(result: dict[str, Any]) -> str:
    """The report: the runs table, the claims table (paper / ours / floors / verdict), one verdict line per claim."""
    seeds = len(result["seeds"])
    lines = [f"# Reproducing {result['title']} on {result['dataset']}", "",
             f"`secagg reproduce {result['paper']} --data {result['data']} --seeds {seeds} --rounds-scale "
             f"{result['rounds_scale']:g}`", "",
             f"Seeds {', '.join(map(str, result['seeds']))} for every preset (paired). Every number: {result['ci']}. "
             f"Rounds: each preset's rounds x {result['rounds_scale']:g}"
             + (" (reduced from the paper's)." if result["rounds_scale"] < 1 else "."), ""]
    over = {**result["overrides"]["common"], **result["overrides"]["dataset"]}
    if over:
        lines += [f"Every run (floors included) also gets: `{jsonio.dumps(over)}`.", ""]
    avail = {p: v for p, v in result["presets"].items() if v.get("available")}
    metrics = sorted({m for v in avail.values() for m in v["metrics"]})
    lines += ["## Runs", "", "| preset | rounds | " + " | ".join(metrics) + " |",
              "|---|---|" + "---|" * len(metrics)]
    for p, v in avail.items():
        lines.append(f"| `{p}` | {v['rounds']} | " + " | ".join(_ci(v["metrics"].get(m)) for m in metrics) + " |")
    gone = [p for p, v in result["presets"].items()
            if not v.get("available") and not v.get("unfinished") and not v.get("refused")]
    cannot = {p: v["refused"] for p, v in result["presets"].items() if v.get("refused")}
    if cannot:
        lines += ["", "Cannot run on this data: " + "; ".join(f"`{p}` ({why})" for p, why in cannot.items()) + "."]
    late = [p for p, v in result["presets"].items() if v.get("unfinished")]
    if late:
        lines += ["", "Not finished when this report was written (`--report-only`): " + ", ".join(f"`{p}`" for p in late) + "."]
    if gone:
        lines += ["", "Not available here (no such preset yet): " + ", ".join(f"`{p}`" for p in gone) + "."]
    lines += ["", "## Claims", "",
              "| claim | where | metric | paper (dataset) | ours: a | ours: b | paired difference | ItemPop | random "
              "| verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["claims"]:
        pa, pb = c["paper"]["a"], c["paper"]["b"]
        paper = " vs ".join(_fmt(x) for x in (pa, pb) if x is not None) or "-"
        names = f"`{c['a']}`" + (f" vs `{c['b']}`" if c["b"] else "")
        lines.append(f"| {c['id']}: {c['text']} ({names}) | {c['where']} | {c['metric']} | {paper} "
                     f"({c['paper']['dataset'] or '-'}) | {_ci(c['ours']['a'])} | {_ci(c['ours']['b'])} | "
                     f"{_ci(c['ours']['diff'])} | {_ci(c['floors'].get('itempop'))} | {_ci(c['floors'].get('random'))} "
                     f"| {c['verdict']} |")
    lines += ["", "## Verdicts", ""]
    for c in result["claims"]:
        lines.append(f"- **{c['id']}** {c['verdict']}: {c['reason']}.")
    n = result["verdicts"]
    lines += ["", f"{n.get(HOLDS, 0)} hold, {n.get(FAILS, 0)} do not hold, {n.get(UNTESTABLE, 0)} not testable here. "
              "Conditions: " + "; ".join(f"`{k}`: {v}" for k, v in KINDS.items()) + ".", ""]
    return "\n".join(lines)


def _plot(result: dict[str, Any], paper: Paper, path: Path) -> None:
    """Each available preset's main metric (mean and interval), the floors in grey, the paper's figures as marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = paper.metrics[0]
    rows = [(p, v["metrics"].get(main)) for p, v in result["presets"].items() if v.get("available")]
    rows = [(p, s) for p, s in rows if s and s.get("mean") is not None and math.isfinite(s["mean"])]
    published: dict[str, float] = {}
    for c in paper.claims:
        if c.metric.split(":")[-1] == main.split(":")[-1]:
            for p, v in ((c.a, c.paper_a), (c.b, c.paper_b)):
                if p and v is not None and c.kind != "faster":
                    published.setdefault(p, v)
    fig, ax = plt.subplots(figsize=(7, 0.45 * max(len(rows), 3) + 1.2))
    for y, (p, s) in enumerate(rows):
        lo = s["mean"] - s["lo"] if s.get("lo") is not None else 0
        ax.barh(y, s["mean"], color="0.7" if p in FLOORS else "tab:blue",
                xerr=[[lo], [lo]] if s.get("lo") is not None else None, capsize=3)
        if p in published:
            ax.plot(published[p], y, marker="D", color="tab:red", linestyle="none",
                    label="paper (its dataset)" if "paper (its dataset)" not in ax.get_legend_handles_labels()[1] else None)
    ax.set_yticks(range(len(rows)), [p for p, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"{main} on {result['dataset']} (mean, 95% t interval over {len(result['seeds'])} seed(s))")
    ax.set_title(f"{result['title']}: ours beside the paper")
    if published:
        ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name("." + path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    tmp.replace(path)
