"""``secagg compare``: the learning curves of several runs in one table and one plot.

``secagg compare RUN_DIR RUN_DIR ... [--metric M] [--better higher|lower] [--target X] [--png FILE] [--json]``
``secagg compare RUN_DIR ... --paired-with BASE_DIR ... [--metric M] [--json]``

For each run (its ``metrics.jsonl``): the best value of the metric and the round it was first
reached, the final value, and the rounds it took to reach the target ``X`` (default: the best value
the first run reached; ``null`` if never). This is how FedFast's claim, the same accuracy in fewer
rounds, is checked (docs/fedfast.md). ``--json`` prints one object as the last line of stdout.

Every metric has a direction (:func:`direction`): ``RMSE``, ``MAE`` and ``loss`` are better lower,
``HR@k``, ``NDCG@k``, ``Precision@k``, ``Recall@k``, ``MRR`` and ``AUC`` higher; "best" is the
minimum or the maximum accordingly and a run reaches the target when it gets at or below it
(lower) or at or above it (higher). ``--better`` names the direction of any other metric. The
default metric follows the runs' task: ``RMSE`` for rating runs (their ``metrics.jsonl`` holds
``RMSE``), else ``HR@10`` (or ``HR@k`` at the cut-off nearest 10 the runs evaluated).

A run that diverged (a ``null``/``NaN``/infinite value of the metric) is reported
as such: its "best" and its rounds to the target count only its finite values before it diverged,
and the table says ``diverged at round r``; a non-finite value never reaches a target. The runs'
``run.json`` are compared before anything is computed: different data (the data files' SHA-256,
the synthetic generator's sizes and seed, the preprocessing) or a different evaluation protocol
(split, sampled negatives, cut-offs) print a warning on stderr (and ``warnings`` in the JSON),
since their curves are then not comparable.

``--paired-with`` compares seeds: the i-th run is paired with the i-th baseline (same seed), the
target of each pair is that baseline's best, and the result gives the mean and sample standard
deviation over the pairs of the rounds to reach it and of the final value, with a two-sided paired
t-test (``scipy.stats.ttest_rel``) and a sign count on each. A run that never reaches its target is
counted at its last evaluated round (censored: the test then understates the difference) and
reported as such.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError
from protocols.state import loads_json

__all__ = ["compare_runs", "data_warnings", "default_metric", "direction", "paired_comparison", "register"]

#: Metrics where a smaller value is better; every other known metric is better larger.
LOWER_IS_BETTER = ("RMSE", "MAE", "loss")
#: Metrics known to be better larger (``@k`` stripped).
HIGHER_IS_BETTER = ("HR", "NDCG", "Precision", "Recall", "MRR", "AUC")
#: Columns of metrics.jsonl that are not metrics.
NOT_METRICS = ("round", "seconds")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare", help="learning curves of several runs: one table, one plot, rounds to reach a target",
        description="Compare the learning curves of several run directories: best, final and rounds to reach a "
        "target value of a metric (default target: the first run's best). Lower is better for RMSE, MAE and "
        "loss, higher for HR@k, NDCG@k, Precision@k, Recall@k, MRR and AUC. Warns when the runs were made on "
        "different data or evaluated differently.",
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("--metric", default=None,
                   help="metric in metrics.jsonl (default: RMSE for rating runs, else HR@10)")
    p.add_argument("--better", choices=("higher", "lower"), default=None,
                   help="direction of --metric when it is not one of the known metrics")
    p.add_argument("--target", type=float, default=None, help="target value (default: the first run's best)")
    p.add_argument("--png", type=Path, default=None, metavar="FILE", help="write the curves to this PNG")
    p.add_argument("--paired-with", nargs="+", type=Path, default=None, metavar="BASE_DIR",
                   help="baseline runs, one per RUN_DIR in the same order (same seeds): paired statistics over seeds")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def direction(metric: str, better: str | None = None) -> str:
    """``"lower"`` or ``"higher"``: which values of ``metric`` are better (``better`` overrides).

    Raises:
        UserError: an unknown metric without ``better``.
    """
    if better is not None:
        return better
    base = metric.split("@", 1)[0]
    if base in LOWER_IS_BETTER:
        return "lower"
    if base in HIGHER_IS_BETTER:
        return "higher"
    raise UserError(f"cannot tell whether a higher or a lower {metric!r} is better; pass --better higher or "
                    "--better lower")


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run}: no metrics.jsonl; give a run directory written by 'secagg run'.")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = loads_json(line)  # accepts the bare NaN of files written before strict JSON
        except ValueError as exc:
            raise UserError(f"{path} line {number}: {exc}") from None
        if not isinstance(row, dict):
            raise UserError(f"{path} line {number}: expected a JSON object, found {type(row).__name__}")
        if isinstance(row.get("round"), int):
            rows.append(row)
    return rows


def _metrics_in(rows: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key not in NOT_METRICS:
                seen.setdefault(key, None)
    return list(seen)


def default_metric(runs: list[Path]) -> str:
    """``RMSE`` if the first run's metrics.jsonl holds it (a rating run), else ``HR@10`` (or the ``HR@k``
    nearest 10 it holds)."""
    present = _metrics_in(_rows(runs[0]))
    if "RMSE" in present:
        return "RMSE"
    ks = [int(m[3:]) for m in present if re.fullmatch(r"HR@\d+", m)]
    if ks and 10 not in ks:
        return f"HR@{min(ks, key=lambda k: (abs(k - 10), k))}"
    return "HR@10"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _curve(run: Path, metric: str) -> tuple[list[tuple[int, float]], int | None]:
    """The run's finite ``(round, value)`` points of ``metric`` before it diverged, and the round it
    diverged at (the first evaluation whose value is null, NaN or infinite; ``None``: it did not).

    The loss alone does not say: a round's loss is ``null`` by design where it is not released (FEL
    under DP through secure aggregation on Flower)."""
    rows = _rows(run)
    points, diverged = [], None
    for row in rows:
        if metric not in row:
            continue
        if not _finite(row[metric]):
            diverged = row["round"]
            break
        points.append((row["round"], float(row[metric])))
    if not points and diverged is None:
        from protocols.registry import did_you_mean

        present = _metrics_in(rows)
        raise UserError(f"{run}: metrics.jsonl has no {metric!r}{did_you_mean(metric, present)}; its metrics: "
                        f"{', '.join(present) or 'none'} (pick one with --metric)")
    return points, diverged


def _best(points: list[tuple[int, float]], lower: bool) -> float | None:
    values = [v for _, v in points]
    return (min(values) if lower else max(values)) if values else None


def _reaches(value: float, goal: float, lower: bool) -> bool:
    return value <= goal if lower else value >= goal


def _identity(run: Path) -> dict[str, Any] | None:
    path = run / "run.json"
    try:
        ident = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return ident if isinstance(ident, dict) and isinstance(ident.get("config"), dict) else None


#: The keys of run.json's config that decide which data a run saw, and how its metrics were measured.
_DATA_KEYS = ("format", "sep", "columns", "threshold", "min_user_interactions", "min_item_interactions")
_SYNTHETIC_KEYS = ("synthetic_users", "synthetic_items", "synthetic_dim", "synthetic_mean_interactions")


def _data_of(ident: dict[str, Any]) -> dict[str, Any]:
    cfg = ident["config"]
    data = cfg.get("data", {}) if isinstance(cfg.get("data"), dict) else {}
    out: dict[str, Any] = {f"data.{k}": data.get(k) for k in _DATA_KEYS}
    if data.get("source") == "synthetic":
        out["data.source"] = "synthetic"
        out.update({f"data.{k}": data.get(k) for k in _SYNTHETIC_KEYS})
        run = cfg.get("run", {}) if isinstance(cfg.get("run"), dict) else {}
        out["run.seed (generates the synthetic data)"] = run.get("seed")
    else:
        files = ident.get("data_files")
        out["data files (SHA-256)"] = sorted(files.values()) if isinstance(files, dict) else None
    return jsonio.strict(out)


def _evaluation_of(ident: dict[str, Any]) -> dict[str, Any]:
    cfg = ident["config"]
    out = {}
    for section in ("split", "eval"):
        values = cfg.get(section, {}) if isinstance(cfg.get(section), dict) else {}
        out.update({f"{section}.{k}": v for k, v in values.items()})
    return jsonio.strict(out)


def _describe(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def data_warnings(runs: list[Path]) -> list[str]:
    """One sentence per way the runs' data or evaluation differ from the first run's (from each
    ``run.json``); a run without a readable run.json is named too."""
    warnings = []
    idents = [(run, _identity(run)) for run in runs]
    missing = [str(run) for run, ident in idents if ident is None]
    if missing:
        warnings.append(f"cannot check which data {', '.join(missing)} used (no readable run.json)")
    known = [(run, ident) for run, ident in idents if ident is not None]
    if len(known) < 2:
        return warnings
    (first, ref), others = known[0], known[1:]
    for what, part in (("different data", _data_of), ("a different evaluation protocol", _evaluation_of)):
        base = part(ref)
        for run, ident in others:
            mine = part(ident)
            diffs = [f"{k} {_describe(base.get(k))} vs {_describe(mine.get(k))}" for k in sorted(set(base) | set(mine))
                     if base.get(k) != mine.get(k)]
            if diffs:
                warnings.append(f"{run} was made on {what} than {first} ({'; '.join(diffs)}): their curves are not "
                                "comparable")
    return warnings


def compare_runs(runs: list[Path], metric: str | None = None, target: float | None = None,
                 better: str | None = None) -> dict[str, Any]:
    """The comparison as a JSON-ready dict (see the module docstring)."""
    metric = metric or default_metric(runs)
    curves, diverged = {}, {}
    for r in runs:  # first: a metric missing from a file is named with the ones it has
        curves[str(r)], diverged[str(r)] = _curve(r, metric)
    lower = direction(metric, better) == "lower"
    first_pts = next(iter(curves.values()))
    goal = _best(first_pts, lower) if target is None else target
    if goal is None:
        raise UserError(f"{runs[0]} diverged before its first evaluation of {metric}; give --target, or put a run "
                        "that learned first")
    rows = []
    for run, pts in curves.items():
        best = _best(pts, lower)
        rows.append({
            "run": run, "best": best,
            "best_round": next((r for r, v in pts if v == best), None),
            "final": pts[-1][1] if pts and diverged[run] is None else None,
            "final_round": pts[-1][0] if pts else None,
            "rounds_to_target": next((r for r, v in pts if _reaches(v, goal, lower)), None),
            "diverged_at": diverged[run],
        })
    return {"metric": metric, "better": "lower" if lower else "higher", "target": goal, "runs": rows,
            "curves": curves, "warnings": data_warnings(runs)}


def _stats(diffs: list[float]) -> dict[str, Any]:
    """Mean/std of paired differences with a two-sided paired t-test (scipy) and sign counts."""
    from scipy import stats

    n = len(diffs)
    mean = sum(diffs) / n
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else float("nan")
    # == ttest_rel on the pairs; undefined (NaN) with one pair or with no spread in the differences
    pvalue = float(stats.ttest_1samp(diffs, 0.0).pvalue) if n > 1 and std > 0 else float("nan")
    return {"mean_diff": mean, "std_diff": std, "t_test_p": pvalue,
            "wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs), "ties": sum(d == 0 for d in diffs)}


def _mean_std(xs: list[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    return mean, (math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else float("nan"))


def paired_comparison(runs: list[Path], baselines: list[Path], metric: str | None = None,
                      better: str | None = None) -> dict[str, Any]:
    """Seed-paired comparison of ``runs[i]`` against ``baselines[i]`` (see the module docstring)."""
    if len(runs) != len(baselines):
        raise UserError(f"--paired-with needs one baseline per run: found {len(runs)} runs and "
                        f"{len(baselines)} baselines; give them in the same (seed) order.")
    metric = metric or default_metric(baselines)
    curves = [(_curve(base, metric), _curve(run, metric)) for run, base in zip(runs, baselines)]
    lower = direction(metric, better) == "lower"
    pairs, warnings = [], []
    for (run, base), ((b, b_div), (r, r_div)) in zip(zip(runs, baselines), curves):
        if not b:
            raise UserError(f"{base} diverged before its first evaluation of {metric}: it sets no target")
        if not r:
            raise UserError(f"{run} diverged before its first evaluation of {metric}; nothing to pair")
        goal = _best(b, lower)
        reach_b = next(k for k, v in b if _reaches(v, goal, lower))
        reach_r = next((k for k, v in r if _reaches(v, goal, lower)), None)
        pairs.append({"run": str(run), "baseline": str(base), "target": goal,
                      "baseline_rounds": reach_b, "rounds": reach_r if reach_r is not None else r[-1][0],
                      "reached": reach_r is not None, "baseline_final": b[-1][1], "final": r[-1][1],
                      "baseline_best": goal, "best": _best(r, lower),
                      "diverged_at": r_div, "baseline_diverged_at": b_div})
        warnings += data_warnings([base, run])
    out: dict[str, Any] = {"metric": metric, "better": "lower" if lower else "higher", "pairs": pairs,
                           "n": len(pairs), "reached": sum(p["reached"] for p in pairs), "warnings": warnings}
    for key in ("rounds", "final", "best"):
        xs, bs = [float(p[key]) for p in pairs], [float(p[f"baseline_{key}"]) for p in pairs]
        out[key] = {"mean": _mean_std(xs)[0], "std": _mean_std(xs)[1],
                    "baseline_mean": _mean_std(bs)[0], "baseline_std": _mean_std(bs)[1],
                    **_stats([x - y for x, y in zip(xs, bs)])}
    out["rounds_ratio"] = {"mean": _mean_std([p["rounds"] / p["baseline_rounds"] for p in pairs])[0],
                           "std": _mean_std([p["rounds"] / p["baseline_rounds"] for p in pairs])[1]}
    return out


def _print_paired(res: dict[str, Any]) -> None:
    m = res["metric"]
    print(f"| pair | target (baseline best {m}, {res['better']} is better) | baseline rounds | rounds | "
          "baseline final | final |")
    print("|---|---|---|---|---|---|")
    for p in res["pairs"]:
        rounds = str(p["rounds"]) if p["reached"] else f">{p['rounds']} (never)"
        if p["diverged_at"] is not None:
            rounds += f", diverged at round {p['diverged_at']}"
        print(f"| {Path(p['run']).name} vs {Path(p['baseline']).name} | {p['target']:.4f} | "
              f"{p['baseline_rounds']} | {rounds} | {p['baseline_final']:.4f} | {p['final']:.4f} |")
    for key, fmt in (("rounds", ".1f"), ("final", ".4f"), ("best", ".4f")):
        s = res[key]
        print(f"{key}: {s['mean']:{fmt}} +- {s['std']:{fmt}} vs baseline {s['baseline_mean']:{fmt}} +- "
              f"{s['baseline_std']:{fmt}}; paired diff {s['mean_diff']:+{fmt}} +- {s['std_diff']:{fmt}}, "
              f"t-test p = {s['t_test_p']:.3g}, {s['wins']} up / {s['losses']} down / {s['ties']} equal "
              f"(n = {res['n']}, target reached in {res['reached']})")


def _marker_style(points: int) -> dict[str, Any]:
    """Markers on every curve, larger where a curve has so few points that a line would not show."""
    return {"marker": "o", "markersize": 7 if points <= 2 else 3}


def _plot_paired(runs: list[Path], baselines: list[Path], metric: str, better: str, path: Path) -> None:
    """Mean +- std over the seeds of each group's curve (rounds every run of the group evaluated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for group, label in ((baselines, f"{Path(baselines[0]).name} ..."), (runs, f"{Path(runs[0]).name} ...")):
        curves = [dict(_curve(r, metric)[0]) for r in group]
        rounds = sorted(set.intersection(*(set(c) for c in curves)))
        stats = [_mean_std([c[r] for c in curves]) for r in rounds]
        mean = [m for m, _ in stats]
        std = [0.0 if math.isnan(s) else s for _, s in stats]
        ax.plot(rounds, mean, label=f"{label} (n = {len(group)})", **_marker_style(len(rounds)))
        ax.fill_between(rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel(f"{metric} (mean +- std over seeds; {better} is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curves_figure(result: dict[str, Any]) -> Any:
    """The matplotlib figure of :func:`compare_runs`' curves: markers on every point (a one-point run
    is a dot, not an empty line), the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, pts in result["curves"].items():
        ax.plot([r for r, _ in pts], [v for _, v in pts], label=Path(run).name, **_marker_style(len(pts)))
    ax.axhline(result["target"], color="grey", ls="--", lw=0.8, label=f"target {result['target']:.3f}")
    ax.set_xlabel("round")
    ax.set_ylabel(f"{result['metric']} ({result['better']} is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = curves_figure(result)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _main(args: argparse.Namespace) -> int:
    if args.paired_with is not None:
        res = paired_comparison(args.runs, args.paired_with, args.metric, args.better)
        for w in res["warnings"]:
            print(f"warning: {w}", file=sys.stderr)
        _print_paired(res)
        if args.png is not None:
            _plot_paired(args.runs, args.paired_with, res["metric"], res["better"], args.png)
            print(f"curves: {args.png}")
        if args.json:
            print(jsonio.dumps(res))
        return 0
    result = compare_runs(args.runs, args.metric, args.target, args.better)
    for w in result["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    m, op = result["metric"], "<=" if result["better"] == "lower" else ">="
    print(f"| run | best {m} ({result['better']} is better) | at round | final {m} | rounds to reach {op} "
          f"{result['target']:.4f} |")
    print("|---|---|---|---|---|")
    for r in result["runs"]:
        reach = "never" if r["rounds_to_target"] is None else str(r["rounds_to_target"])
        final = _fmt(r["final"])
        if r["diverged_at"] is not None:
            final = f"diverged at round {r['diverged_at']}"
            reach += f" (then diverged at round {r['diverged_at']})" if r["rounds_to_target"] is not None else ""
        print(f"| {Path(r['run']).name} | {_fmt(r['best'])} | {r['best_round'] if r['best_round'] is not None else 'n/a'} "
              f"| {final} | {reach} |")
    if args.png is not None:
        _plot(result, args.png)
        print(f"curves: {args.png}")
    if args.json:
        print(jsonio.dumps(result))
    return 0
