"""``secagg reproduce PAPER --data D``: a paper's comparison with paired seeds, its published figures beside ours,
the floors, a confidence interval on every number and a verdict per claim (docs/reproduce.md)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from experiments import jsonio
from experiments.errors import UserError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    from experiments.studies.reproduce_claims import PAPERS

    p = subparsers.add_parser(
        "reproduce",
        help="run a paper's comparison (paired seeds, floors, CIs) and judge each of its claims",
        description="Run every preset a paper's claims compare, and ItemPop and random, on the same seeds; print "
        "the paper's published figures beside ours with a 95 percent t interval over seeds on every number and a "
        "one-line verdict per claim (holds / does not hold / not testable here, and why). Writes reproduce.md, "
        "reproduce.json, reproduce.png and every run directory (OUT/runs/<preset>-s<seed>) into --out; run again "
        "with the same --out to continue an interrupted reproduction. docs/reproduce.md.",
    )
    p.add_argument("paper", choices=list(PAPERS), help="the paper")
    p.add_argument("--data", required=True, metavar="PATH",
                   help="MovieLens (ml-100k, ml-1m, ml-latest-small), any CSV, a paper's split folder (LightFR's "
                   "filmtrust_train.csv/_val.csv/_test.csv) or 'synthetic'")
    p.add_argument("--seeds", type=int, default=3, metavar="N", help="seeds 0..N-1 for every preset (default 3)")
    p.add_argument("--rounds-scale", type=float, default=1.0, metavar="F",
                   help="multiply every preset's rounds (and evaluation interval) by F (default 1: the paper's)")
    p.add_argument("--out", metavar="DIR", help="output folder (default runs/reproduce-<paper>-<UTC timestamp>)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: judge from the runs already finished in --out (an interrupted reproduction)")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="torch intra-op threads (default 1)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.threads < 1:
        raise UserError(f"--threads must be >= 1; found {args.threads}")
    out = Path(args.out) if args.out else Path("runs") / f"reproduce-{args.paper}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    import torch

    from experiments.studies.reproduce import reproduce

    torch.set_num_threads(args.threads)
    if args.report_only and not (out / "runs").is_dir():
        raise UserError(f"--report-only reads the runs in {out}/runs, which does not exist")
    result = reproduce(args.paper, args.data, args.seeds, args.rounds_scale, out, report_only=args.report_only)
    sys.stdout.write(Path(result["files"]["markdown"]).read_text())
    if args.json:
        print(jsonio.dumps(result, sort_keys=True))
    return 0
