"""``secagg compare``: the learning curves of several runs in one table and one plot.

``secagg compare RUN_DIR RUN_DIR ... [--metric HR@10] [--target X] [--png FILE] [--json]``
``secagg compare RUN_DIR ... --paired-with BASE_DIR ... [--metric HR@10] [--json]``

For each run (its ``metrics.jsonl``): the best value of the metric and the round it was first
reached, the final value, and the rounds it took to reach the target ``X`` (default: the best value
the first run reached; ``null`` if never). This is how FedFast's claim, the same accuracy in fewer
rounds, is checked (docs/fedfast.md). ``--json`` prints one object as the last line of stdout.

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
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError
from protocols.state import loads_json

__all__ = ["compare_runs", "paired_comparison", "register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare", help="learning curves of several runs: one table, one plot, rounds to reach a target",
        description="Compare the learning curves of several run directories: best, final and rounds to reach a "
        "target value of a metric (default target: the first run's best).",
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("--metric", default="HR@10", help="metric in metrics.jsonl (default HR@10)")
    p.add_argument("--target", type=float, default=None, help="target value (default: the first run's best)")
    p.add_argument("--png", type=Path, default=None, metavar="FILE", help="write the curves to this PNG")
    p.add_argument("--paired-with", nargs="+", type=Path, default=None, metavar="BASE_DIR",
                   help="baseline runs, one per RUN_DIR in the same order (same seeds): paired statistics over seeds")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def _curve(run: Path, metric: str) -> list[tuple[int, float]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run}: no metrics.jsonl; give a run directory written by 'secagg run'.")
    points = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, start=1):
        try:
            row = loads_json(line) if line.strip() else {}
        except ValueError as exc:
            raise UserError(f"{path} line {number}: {exc}") from None
        if not isinstance(row, dict):
            raise UserError(f"{path} line {number}: expected a JSON object, found {type(row).__name__}")
        value = row.get(metric)
        if isinstance(value, (int, float)) and isinstance(row.get("round"), int) and math.isfinite(value):
            points.append((row["round"], float(value)))
    if not points:
        raise UserError(f"{run}: metrics.jsonl has no {metric!r}; pick another --metric (e.g. HR@10, NDCG@10).")
    return points


def compare_runs(runs: list[Path], metric: str = "HR@10", target: float | None = None) -> dict[str, Any]:
    """The comparison as a JSON-ready dict (see the module docstring)."""
    curves = {str(r): _curve(r, metric) for r in runs}
    first = next(iter(curves.values()))
    goal = max(v for _, v in first) if target is None else target
    rows = []
    for run, pts in curves.items():
        best = max(v for _, v in pts)
        rows.append({
            "run": run, "best": best, "best_round": next(r for r, v in pts if v == best), "final": pts[-1][1],
            "final_round": pts[-1][0], "rounds_to_target": next((r for r, v in pts if v >= goal), None),
        })
    return {"metric": metric, "target": goal, "runs": rows, "curves": curves}


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


def paired_comparison(runs: list[Path], baselines: list[Path], metric: str = "HR@10") -> dict[str, Any]:
    """Seed-paired comparison of ``runs[i]`` against ``baselines[i]`` (see the module docstring)."""
    if len(runs) != len(baselines):
        raise UserError(f"--paired-with needs one baseline per run: found {len(runs)} runs and "
                        f"{len(baselines)} baselines; give them in the same (seed) order.")
    pairs = []
    for run, base in zip(runs, baselines):
        b, r = _curve(base, metric), _curve(run, metric)
        goal = max(v for _, v in b)
        reach_b = next(k for k, v in b if v >= goal)
        reach_r = next((k for k, v in r if v >= goal), None)
        pairs.append({"run": str(run), "baseline": str(base), "target": goal,
                      "baseline_rounds": reach_b, "rounds": reach_r if reach_r is not None else r[-1][0],
                      "reached": reach_r is not None, "baseline_final": b[-1][1], "final": r[-1][1],
                      "baseline_best": goal, "best": max(v for _, v in r)})
    out: dict[str, Any] = {"metric": metric, "pairs": pairs, "n": len(pairs),
                           "reached": sum(p["reached"] for p in pairs)}
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
    print(f"| pair | target (baseline best {m}) | baseline rounds | rounds | baseline final | final |")
    print("|---|---|---|---|---|---|")
    for p in res["pairs"]:
        rounds = str(p["rounds"]) if p["reached"] else f">{p['rounds']} (never)"
        print(f"| {Path(p['run']).name} vs {Path(p['baseline']).name} | {p['target']:.4f} | "
              f"{p['baseline_rounds']} | {rounds} | {p['baseline_final']:.4f} | {p['final']:.4f} |")
    for key, fmt in (("rounds", ".1f"), ("final", ".4f"), ("best", ".4f")):
        s = res[key]
        print(f"{key}: {s['mean']:{fmt}} +- {s['std']:{fmt}} vs baseline {s['baseline_mean']:{fmt}} +- "
              f"{s['baseline_std']:{fmt}}; paired diff {s['mean_diff']:+{fmt}} +- {s['std_diff']:{fmt}}, "
              f"t-test p = {s['t_test_p']:.3g}, {s['wins']} up / {s['losses']} down / {s['ties']} equal "
              f"(n = {res['n']}, target reached in {res['reached']})")


def _plot_paired(runs: list[Path], baselines: list[Path], metric: str, path: Path) -> None:
    """Mean +- std over the seeds of each group's curve (rounds every run of the group evaluated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for group, label in ((baselines, f"{Path(baselines[0]).name} ..."), (runs, f"{Path(runs[0]).name} ...")):
        curves = [dict(_curve(r, metric)) for r in group]
        rounds = sorted(set.intersection(*(set(c) for c in curves)))
        stats = [_mean_std([c[r] for c in curves]) for r in rounds]
        mean = [m for m, _ in stats]
        std = [0.0 if math.isnan(s) else s for _, s in stats]
        ax.plot(rounds, mean, label=f"{label} (n = {len(group)})")
        ax.fill_between(rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel(f"{metric} (mean +- std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, pts in result["curves"].items():
        ax.plot([r for r, _ in pts], [v for _, v in pts], label=Path(run).name)
    ax.axhline(result["target"], color="grey", ls="--", lw=0.8, label=f"target {result['target']:.3f}")
    ax.set_xlabel("round")
    ax.set_ylabel(result["metric"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _main(args: argparse.Namespace) -> int:
    if args.paired_with is not None:
        res = paired_comparison(args.runs, args.paired_with, args.metric)
        _print_paired(res)
        if args.png is not None:
            _plot_paired(args.runs, args.paired_with, args.metric, args.png)
            print(f"curves: {args.png}")
        if args.json:
            print(jsonio.dumps(res))
        return 0
    result = compare_runs(args.runs, args.metric, args.target)
    m = result["metric"]
    print(f"| run | best {m} | at round | final {m} | rounds to reach {result['target']:.4f} |")
    print("|---|---|---|---|---|")
    for r in result["runs"]:
        reach = "never" if r["rounds_to_target"] is None else str(r["rounds_to_target"])
        print(f"| {Path(r['run']).name} | {r['best']:.4f} | {r['best_round']} | {r['final']:.4f} | {reach} |")
    if args.png is not None:
        _plot(result, args.png)
        print(f"curves: {args.png}")
    if args.json:
        print(jsonio.dumps(result))
    return 0
