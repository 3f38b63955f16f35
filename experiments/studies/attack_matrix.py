"""``secagg attack matrix``: every protocol x defense x applicable attack, on one data set, in one table.

``secagg attack matrix [--data D] [--protocols P ...] [--defenses D ...] [--rounds N] [--seed S]
[--out DIR] [--json]``

Each cell is a run (``secagg run`` of the protocol's preset under the defense, views recorded, in
``DIR/cells/<protocol>-<defense>``) attacked from its directory (``secagg attack RUN_DIR``,
:mod:`experiments.studies.attack_rundir`). ``DIR/matrix.json`` holds every finding of every cell,
``DIR/matrix.md`` the table and ``DIR/matrix.png`` the heatmap of the best advantage per cell.

Default data: the embedded synthetic generator at a CI size (:data:`SMALL_DATA`). Each defense
carries an expectation (:data:`EXPECT`): on ``none`` an attack must succeed (the best advantage of
the cell at least :data:`LEAK_MIN`), under a secure sum or encryption it must not (every advantage at
most :data:`HOLD_MAX`); LDP cells are reported, not checked. A failed expectation is listed under
``failed`` and the command exits 1: the matrix is a test of the defenses as much as a table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError

__all__ = ["CELLS", "EXPECT", "HOLD_MAX", "LEAK_MIN", "cell_config", "check_cell", "register", "run_matrix"]

#: protocol -> (base preset or None for the protocol's defaults, config section, defense -> overrides;
#: an override ``"_preset"`` takes another preset as the cell's base, e.g. a two-server DPF preset).
CELLS: dict[str, tuple[str | None, str, dict[str, dict[str, Any]]]] = {
    "fedavg": ("fedavg-gmf", "fedavg", {
        "none": {"secure_aggregation": "none"},
        "secagg": {"secure_aggregation": "secagg"},
        "secagg+": {"secure_aggregation": "secagg+"},
        "dpf": {"_preset": "fedavg-gmf-dpf"},
    }),
    "fedfast": ("fedfast", "fedfast", {
        "none": {"secure_aggregation": "none"},
        "secagg+": {"secure_aggregation": "secagg+"},
    }),
    "fedmf": (None, "fedmf", {
        "none": {"defense": "none"},
        "secagg": {"defense": "secagg"},
        "paillier": {"defense": "paillier", "key_bits": 1024},
        "ckks": {"defense": "ckks"},
        "ldp-eps1": {"defense": "ldp", "epsilon": 1.0},
        "ldp-eps1000": {"defense": "ldp", "epsilon": 1000.0},
    }),
    "lightfr": ("lightfr-grad", "lightfr", {
        "none": {"secure_aggregation": "none"},
        "secagg+": {"secure_aggregation": "secagg+"},
        "dpf": {"_preset": "lightfr-dpf"},
    }),
    "fedcl": ("fedcl", "fedcl", {
        "ldp-eps4": {"epsilon": 4.0},
        "ldp-eps1000": {"epsilon": 1000.0},
    }),
    "sttfedrec": ("sttfedrec", "sttfedrec", {
        "secagg+": {"item_aggregation": "secagg+"},
        "dpf": {"_preset": "sttfedrec-dpf"},
    }),
}
#: What a defense must do: "leaks" (an attack must succeed), "holds" (none may), None (reported only).
EXPECT: dict[str, str | None] = {"none": "leaks", "secagg": "holds", "secagg+": "holds", "chain": "holds",
                                 "paillier": "holds", "ckks": "holds", "dpf": "holds"}
#: Cells whose defense does not cover every attack on them: STTFedRec's SecAgg+ sums the item
#: gradients, while its requests stay in the clear (their obfuscation is the defense), so the
#: request attack is reported there, not checked.
CELL_EXPECT: dict[tuple[str, str], str | None] = {("sttfedrec", "secagg+"): None}
#: A cell expected to leak must reach this advantage (its best finding).
LEAK_MIN = 0.5
#: A cell expected to hold must keep every finding's advantage at or below this.
HOLD_MAX = 0.05
#: The default data: small enough for CI (seconds per cell).
SMALL_DATA = {"synthetic_users": 40, "synthetic_items": 60, "synthetic_mean_interactions": 8}
#: The default cells: fast ones; ``--protocols``/``--defenses`` add the others.
DEFAULT_PROTOCOLS = ("fedavg", "fedfast", "fedmf", "lightfr")
DEFAULT_DEFENSES = ("none", "secagg", "secagg+", "dpf", "ldp-eps1", "ldp-eps1000")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg attack matrix``."""
    p = subparsers.add_parser(
        "matrix", help="every protocol x defense x attack on one data set: matrix.json, matrix.md, matrix.png",
        description="Run each protocol under each defense with its views recorded, attack every run from its "
        "directory, and write matrix.json, matrix.md and a heatmap. Exits 1 if a defense expected to hold "
        f"(secure sums, encryption) lets an attack above advantage {HOLD_MAX}, or an attack expected to succeed "
        f"on 'none' stays below {LEAK_MIN} (docs/attacks.md).")
    p.add_argument("--data", metavar="PATH", help="interaction data (default: the embedded synthetic data, CI size)")
    p.add_argument("--protocols", nargs="+", metavar="P", default=list(DEFAULT_PROTOCOLS),
                   help=f"protocols (default {' '.join(DEFAULT_PROTOCOLS)}; known: {' '.join(CELLS)})")
    p.add_argument("--defenses", nargs="+", metavar="D", default=list(DEFAULT_DEFENSES),
                   help="defenses, each where the protocol defines it (default "
                   f"{' '.join(DEFAULT_DEFENSES)}; known: {' '.join(sorted({d for c in CELLS.values() for d in c[2]}))})")
    p.add_argument("--rounds", type=int, default=2, metavar="N", help="rounds per cell (default 2)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of every cell (default 0)")
    p.add_argument("--out", type=Path, default=Path("runs/attack-matrix"), metavar="DIR",
                   help="output folder (default runs/attack-matrix; its cells/ are replaced)")
    p.add_argument("--json", action="store_true", help="print matrix.json as one object on the last line")
    p.set_defaults(func=_main)


def cell_config(protocol: str, defense: str, *, data: str | None, rounds: int, seed: int,
                synthetic: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> Any:
    """The run configuration of one cell: the protocol's preset under ``defense`` (:data:`CELLS`), views
    recorded every round, no evaluation. ``data``: a file or folder, or ``None`` for the embedded
    synthetic data at ``synthetic``'s size (default :data:`SMALL_DATA`); ``overrides``: further keys of the
    protocol's section (a per-paper command's options, :mod:`experiments.studies.attack_wrap`)."""
    from experiments.run import config as cfgmod

    preset, section, defenses = CELLS[protocol]
    cell = dict(defenses[defense])
    preset = cell.pop("_preset", preset)
    cell.update(overrides or {})
    base = cfgmod.load_preset(preset) if preset else cfgmod.merge(cfgmod.RunConfig(), {"run": {"protocol": protocol}})
    source: dict[str, Any] = {"source": data} if data else {"source": "synthetic", **(synthetic or SMALL_DATA)}
    over = {"run": {"rounds": rounds, "seed": seed, "eval_every": 0, "record_views": True, "record_every": 1},
            "data": source, "eval": {"negatives": 10 if not data else base.eval.negatives},
            **({section: cell} if cell else {})}
    return cfgmod.merge(base, over)


def _config(protocol: str, defense: str, args: argparse.Namespace) -> Any:
    return cell_config(protocol, defense, data=args.data, rounds=args.rounds, seed=args.seed)


def expectation(protocol: str, defense: str) -> str | None:
    """``"leaks"``, ``"holds"`` or ``None`` (reported only) for a cell."""
    return CELL_EXPECT.get((protocol, defense), EXPECT.get(defense))


def check_cell(defense: str, findings: list[dict[str, Any]], expect: str | None = None) -> str | None:
    """Why the cell fails its expectation (default: the defense's, :data:`EXPECT`), or ``None``."""
    expect = EXPECT.get(defense) if expect is None else expect
    advs = [f["advantage"] for f in findings if f.get("advantage") is not None]
    if expect == "leaks":
        if not advs or max(advs) < LEAK_MIN:
            return f"expected an attack to succeed on {defense!r}; best advantage {max(advs, default=None)}"
    elif expect == "holds":
        if advs and max(advs) > HOLD_MAX:
            return f"expected {defense!r} to hold; an attack reached advantage {max(advs):.3f}"
    return None


def run_matrix(args: argparse.Namespace) -> dict[str, Any]:
    from experiments.studies.attack_rundir import attack_run_dir
    from experiments.run.training import RunRequest, execute

    unknown = [p for p in args.protocols if p not in CELLS]
    if unknown:
        raise UserError(f"no matrix cells for protocol(s) {', '.join(unknown)}; known: {', '.join(CELLS)}")
    known = {d for c in CELLS.values() for d in c[2]}
    bad = [d for d in args.defenses if d not in known]
    if bad:
        raise UserError(f"unknown defense(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1; found {args.rounds}")
    cells_dir = args.out / "cells"
    if cells_dir.exists():
        shutil.rmtree(cells_dir)
    cells, failed = [], []
    for protocol in args.protocols:
        for defense in args.defenses:
            if defense not in CELLS[protocol][2]:
                continue
            run_dir = cells_dir / f"{protocol}-{defense}"
            print(f"matrix: {protocol} / {defense}", file=sys.stderr)
            summary = execute(RunRequest(preset=f"{protocol}-{defense}", config=_config(protocol, defense, args),
                                         out=run_dir, quiet=True))
            res = attack_run_dir(run_dir)
            expect = expectation(protocol, defense)
            why = check_cell(defense, res["findings"], expect) if expect else None
            cell = {"protocol": protocol, "defense": defense, "expect": expect, "run_dir": str(run_dir),
                    "views": summary.get("views"), "findings": res["findings"], "skipped": res["skipped"],
                    "failed": why}
            cells.append(cell)
            if why:
                failed.append(f"{protocol}/{defense}: {why}")
    small = "synthetic, {synthetic_users} users x {synthetic_items} items, {synthetic_mean_interactions} interactions each"
    out = {"data": args.data or small.format(**SMALL_DATA), "rounds": args.rounds, "seed": args.seed,
           "protocols": list(args.protocols), "defenses": list(args.defenses),
           "leak_min": LEAK_MIN, "hold_max": HOLD_MAX, "cells": cells, "failed": failed}
    out = jsonio.strict(out)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matrix.json").write_text(jsonio.dumps(out, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    (args.out / "matrix.md").write_text(_markdown(out), encoding="utf-8")
    _heatmap(out, args.out / "matrix.png")
    return out


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}"


def _markdown(m: dict[str, Any]) -> str:
    lines = [f"# Attack matrix: {m['data']}, {m['rounds']} round(s), seed {m['seed']}", "",
             f"Advantage: 0 = the stronger of a random and a public guess, 1 = perfect. Expected: on `none` an attack "
             f"reaches {m['leak_min']}; under a secure sum or encryption none exceeds {m['hold_max']}.", "",
             "| protocol | defense | expected | attack | target | metric | value | random | public | advantage [95%] | check |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in m["cells"]:
        check = "ok" if c["failed"] is None else f"FAILED: {c['failed']}"
        for f in c["findings"]:
            iv = f["advantage_interval"]
            ivs = "" if iv is None else f" [{iv[0]:.3f}, {iv[1]:.3f}]"
            lines.append(f"| {c['protocol']} | {c['defense']} | {c['expect'] or '-'} | {f['attack']} | {f['target']} | "
                         f"{f['metric']} | {_f(f['value'])} | {_f(f['random'])} | {_f(f['public'])} | "
                         f"{_f(f['advantage'])}{ivs} | {check} |")
        for s in c["skipped"]:
            lines.append(f"| {c['protocol']} | {c['defense']} | {c['expect'] or '-'} | {s['attack']} | skipped: "
                         f"{s['reason']} | | | | | | |")
    lines += ["", f"Failed: {len(m['failed'])}" + "".join(f"\n- {x}" for x in m["failed"]), ""]
    return "\n".join(lines)


def _heatmap(m: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = sorted({(c["protocol"], f["attack"], f["target"]) for c in m["cells"] for f in c["findings"]},
                  key=lambda r: (r[0], r[1], r[2]))
    present = {c["defense"] for c in m["cells"]}
    cols = [d for d in m.get("defenses", sorted(present)) if d in present]
    if not rows or not cols:
        return
    grid = np.full((len(rows), len(cols)), np.nan)
    holds = np.zeros(grid.shape, bool)
    for c in m["cells"]:
        for f in c["findings"]:
            i, j = rows.index((c["protocol"], f["attack"], f["target"])), cols.index(c["defense"])
            if f["advantage"] is not None:
                grid[i, j] = f["advantage"]
            holds[i, j] = c["expect"] == "holds"
    fig, ax = plt.subplots(figsize=(1.4 * len(cols) + 4, 0.45 * len(rows) + 1.6))
    im = ax.imshow(np.clip(grid, -0.2, 1.0), cmap="magma_r", vmin=-0.2, vmax=1.0, aspect="auto")
    for i in range(len(rows)):
        for j in range(len(cols)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if grid[i, j] > 0.5 else "black")
            if holds[i, j]:  # where the defense must hold
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="tab:green", lw=1.5))
    ax.set_xticks(range(len(cols)), cols, fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{p}: {a} / {t}" for p, a, t in rows], fontsize=8)
    ax.set_title(f"attack advantage over the stronger baseline (green: the defense must hold)\n{m['data']}",
                 fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _main(args: argparse.Namespace) -> int:
    out = run_matrix(args)
    print(_markdown(out))
    print(f"wrote {args.out / 'matrix.json'}, {args.out / 'matrix.md'}, {args.out / 'matrix.png'}")
    if args.json:
        print(jsonio.dumps(out, sort_keys=True))
    return 1 if out["failed"] else 0
