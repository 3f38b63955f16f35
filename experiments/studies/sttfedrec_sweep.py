"""Accuracy sweeps of STTFedRec over rho and clients per round (issue 10), through ``secagg run``.

``python -m experiments.studies.sttfedrec_sweep --data PATH --out DIR [--preset fl-dssm] [--rounds R]
[--rho 0.5 0.7 0.9] [--clients 10 25 50]``

Each point is one ordinary ``secagg run PRESET --config point.toml`` (run directory
``DIR/<name>``, so every point can be inspected or resumed); a point whose ``summary.json`` exists
is not run again. The rho points keep the preset's clients per round, the clients points the
preset's rho. Writes ``DIR/sweep.csv`` (one row per point: sampled HR@10 and NDCG@10, full HR@10,
seconds per round) and ``DIR/sweep.png`` (two panels). The default preset is ``fl-dssm``: the split
protocol computes the same update within fixed point (tests/protocols/test_sttfedrec.py,
``test_split_training_equals_fl_training_within_fixed_point``), so its accuracy is STTFedRec's at
a fraction of the simulation time; pass ``--preset sttfedrec`` to run the split protocol itself.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from experiments import jsonio

__all__ = ["main", "run_point"]


def run_point(preset: str, data: str, out: Path, overrides: dict[str, Any], rounds: int) -> dict[str, Any]:
    """One ``secagg run`` with ``[sttfedrec]`` ``overrides``; its summary (cached in ``out``)."""
    from experiments.cli import main as cli

    summary = out / "summary.json"
    if not summary.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        toml = out.parent / f"{out.name}.toml"
        body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in overrides.items())  # numbers only
        toml.write_text(f"[run]\neval_every = 0\n[sttfedrec]\n{body}\n")
        with redirect_stdout(io.StringIO()):
            code = cli(["run", preset, "--data", data, "--config", str(toml), "--rounds", str(rounds),
                        "--out", str(out), "--quiet"])
        if code != 0:
            raise SystemExit(f"secagg run {preset} for {out.name} failed with exit code {code}")
    return json.loads(summary.read_text())


def _row(kind: str, value: float, s: dict[str, Any]) -> dict[str, Any]:
    m, full = s["metrics"], s.get("metrics_full") or {}
    return {"sweep": kind, "value": value, "rounds": s["rounds"], "HR@10": round(m["HR@10"], 4),
            "NDCG@10": round(m["NDCG@10"], 4), "full_HR@10": round(full.get("HR@10", float("nan")), 4),
            "seconds_per_round": s["seconds_per_round"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.sttfedrec_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", default="fl-dssm")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--rho", type=float, nargs="*", default=[0.5, 0.7, 0.9])
    p.add_argument("--clients", type=int, nargs="*", default=[10, 25, 50])
    args = p.parse_args(argv)
    from experiments.run.config import load_preset

    base = load_preset(args.preset).sections["sttfedrec"]
    rows = []
    for kind, key, values in (("rho", "rho", args.rho), ("clients_per_round", "clients_per_round", args.clients)):
        for v in values:  # the preset's own value is one shared run, "base"
            name = "base" if v == getattr(base, key) else f"{key}-{v}"
            s = run_point(args.preset, args.data, args.out / name, {} if name == "base" else {key: v}, args.rounds)
            rows.append(_row(kind, v, s))
            print(jsonio.dumps(rows[-1]), flush=True)
    with open(args.out / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _plot(rows, args.out / "sweep.png", args.preset, args.rounds)
    print(f"wrote {args.out / 'sweep.csv'} and sweep.png")
    return 0


def _plot(rows: list[dict[str, Any]], path: Path, preset: str, rounds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, kind, label in ((axes[0], "rho", "rho (fraction of non-clicked ids per request)"),
                            (axes[1], "clients_per_round", "clients per round K")):
        sel = sorted((r for r in rows if r["sweep"] == kind), key=lambda r: r["value"])
        for key, style in (("HR@10", "-o"), ("NDCG@10", "--s")):
            ax.plot([r["value"] for r in sel], [r[key] for r in sel], style, label=f"sampled {key}")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("accuracy (99 sampled negatives)")
    fig.suptitle(f"{preset} on ml-latest-small, {rounds} rounds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
