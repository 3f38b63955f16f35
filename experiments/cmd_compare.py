"""``secagg compare``: the learning curves of several runs in one table and one plot.

``secagg compare RUN_DIR RUN_DIR ... [--metric HR@10] [--target X] [--png FILE] [--json]``

For each run (its ``metrics.jsonl``): the best value of the metric and the round it was first
reached, the final value, and the rounds it took to reach the target ``X`` (default: the best value
the first run reached; ``null`` if never). This is how FedFast's claim, the same accuracy in fewer
rounds, is checked (docs/fedfast.md). ``--json`` prints one object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from experiments.errors import UserError

__all__ = ["compare_runs", "register"]


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
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def _curve(run: Path, metric: str) -> list[tuple[int, float]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run}: no metrics.jsonl; give a run directory written by 'secagg run'.")
    points = []
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
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
        print(json.dumps(result))
    return 0
