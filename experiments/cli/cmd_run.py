"""``secagg run``: train and evaluate one configuration into a run directory.

With no arguments it runs the ``fedavg-gmf`` preset on the embedded synthetic data.

Building the parser imports neither torch nor any protocol (``secagg run --help`` and every user
error answer at once): the presets are listed from their files (each one's first comment sentence),
the protocols from :data:`protocols.registry.BUILTIN_PROTOCOLS`; the run itself imports the rest.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

from experiments.run import config as cfgmod
from experiments import jsonio
from experiments.errors import UserError

__all__ = ["add_plugin_argument", "presets_epilog", "register", "run"]

DEFAULT_PRESET = "fedavg-gmf"


def presets_epilog(width: int | None = None) -> str:
    """The presets, one per line with its description (from the preset file), wrapped to ``width``."""
    width = width or min(shutil.get_terminal_size().columns, 120) - 2
    names = cfgmod.preset_descriptions()
    col = max(map(len, names)) + 4
    lines = ["presets (secagg run PRESET; each is a TOML file in experiments/presets/):"]
    for name, text in names.items():
        lines += textwrap.wrap(text or "(no description)", width=max(width, col + 30), initial_indent=f"  {name:<{col - 2}}",
                               subsequent_indent=" " * col)
    return "\n".join(lines)


def add_plugin_argument(p: argparse.ArgumentParser) -> None:
    """``--plugin MODULE`` (repeatable) on a sub-command that looks protocols or attacks up."""
    p.add_argument("--plugin", action="append", default=None, metavar="MODULE", dest="plugins",
                   help="import MODULE first: it registers protocols or attacks (repeatable; installed "
                   "packages register theirs through entry points; docs/plugins.md)")


def register(subparsers: argparse._SubParsersAction) -> None:
    from protocols.registry import BUILTIN_PROTOCOLS

    fill = lambda text: textwrap.fill(text, width=min(shutil.get_terminal_size().columns, 120) - 2)  # noqa: E731
    p = subparsers.add_parser(
        "run",
        help="train and evaluate a preset or config into a run directory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=fill(
            f"Train and evaluate one configuration. With no preset it runs '{DEFAULT_PRESET}' on the embedded "
            f"synthetic data. Protocols (run.protocol in a --config file): {', '.join(BUILTIN_PROTOCOLS)}, and "
            "those of plugins. Writes run.json, config.toml, metrics.jsonl, costs.jsonl, "
            "transcript.csv, privacy_ledger.sqlite, checkpoint.safetensors, summary.json and metrics.png "
            "into the run directory (and views/ with --record-views: what each server saw, for "
            "'secagg attack RUN_DIR')."
        ),
        epilog=presets_epilog(),
    )
    p.add_argument("preset", nargs="?", help=f"preset name (default {DEFAULT_PRESET}; listed below)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file overriding the preset's keys")
    p.add_argument("--data", metavar="PATH", help="MovieLens u.data / ratings.dat / ratings.csv (file or folder) or CSV")
    p.add_argument("--format", metavar="FMT", help="data format when it cannot be inferred: ml-100k, ml-1m, ml-csv, csv; filmtrust, ciao, yelp, "
                   "douban, recbole (published formats); ncf, lightfr-csv (a paper's split folder)")
    p.add_argument("--columns", metavar="SPEC",
                   help="a CSV's columns, user=NAME,item=NAME[,rating=NAME][,timestamp=NAME] (header names or "
                   "0-based indices; 'none' for absent); default: inferred from the header ([data.columns])")
    p.add_argument("--sep", metavar="S", help="a CSV's delimiter, one character or '::' (default: inferred)")
    p.add_argument("--rounds", type=int, metavar="N", help="rounds (federated) or epochs (centralised)")
    p.add_argument("--seed", type=int, metavar="S", help="seed of every simulation choice")
    p.add_argument("--eval-every", type=int, metavar="N",
                   help="evaluate every N rounds (run.eval_every; default: the preset's, 5 unless it says; 0: "
                   "only at the end); the last round is always evaluated")
    p.add_argument("--eval-negatives", type=int, metavar="N",
                   help="sampled negatives per held-out item (default 99; 0: full ranking only)")
    p.add_argument("--record-views", action="store_true",
                   help="keep what every server received (payloads included) and public_info() in RUN_DIR/views, for "
                   "'secagg attack RUN_DIR' (run.record_views)")
    p.add_argument("--record-every", type=int, metavar="N",
                   help="with --record-views: record every N-th round and the last (run.record_every; default 1)")
    p.add_argument("--canaries", type=int, metavar="K",
                   help="add K canary users for 'secagg audit RUN_DIR', each holding one of two fresh item sets by a "
                   "secret coin (audit.canaries; implies --record-views; docs/audit.md)")
    p.add_argument("--out", metavar="DIR", help="run directory (default runs/<preset>-<UTC timestamp>)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue an interrupted run from its last checkpoint (its plugins are imported again)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads (default 1: the simulation's many small ops lose more to thread "
        "hand-offs than they gain; measured 0.47 vs 3.7 CPU-s per FedAvg round on a loaded 2-core machine)",
    )
    add_plugin_argument(p)
    p.set_defaults(func=_main)


def _flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The command line's overrides, each checked before any preset or protocol loads (so a bad flag is
    refused at once; the sections validate the values again when they are merged)."""
    overrides: dict[str, dict[str, Any]] = {}
    if args.data:
        overrides.setdefault("data", {})["source"] = args.data
    if args.format:
        overrides.setdefault("data", {})["format"] = args.format
    if args.sep is not None:
        from recmodels.sniff import parse_sep

        overrides.setdefault("data", {})["sep"] = parse_sep(args.sep)
    if args.columns is not None:
        from recmodels.sniff import parse_columns

        try:
            given = parse_columns(args.columns)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        overrides.setdefault("data", {})["columns"] = {
            role: ("none" if value is None else str(value)) for role, value in given.items()
        }
    if args.rounds is not None:
        if args.rounds < 0:
            raise UserError(f"--rounds must be >= 0; found {args.rounds}")
        overrides.setdefault("run", {})["rounds"] = args.rounds
    if args.seed is not None:
        if not 0 <= args.seed < 2**63:
            raise UserError(f"--seed must be an integer in 0..2^63-1; found {args.seed}")
        overrides.setdefault("run", {})["seed"] = args.seed
    if args.eval_negatives is not None:
        if args.eval_negatives < 0:
            raise UserError(f"--eval-negatives must be >= 0 (0: full ranking only); found {args.eval_negatives}")
        overrides.setdefault("eval", {})["negatives"] = args.eval_negatives
    if getattr(args, "record_views", False):
        overrides.setdefault("run", {})["record_views"] = True
    if getattr(args, "record_every", None) is not None:
        if args.record_every < 1:
            raise UserError(f"--record-every must be >= 1; found {args.record_every}")
        overrides.setdefault("run", {})["record_every"] = args.record_every
    if getattr(args, "canaries", None) is not None:
        if args.canaries < 0 or args.canaries == 1:
            raise UserError(f"--canaries must be 0 or >= 2 (a guess needs two canaries); found {args.canaries}")
        overrides.setdefault("audit", {})["canaries"] = args.canaries
        if args.canaries:
            overrides.setdefault("run", {})["record_views"] = True  # the audit reads what the servers saw
    if getattr(args, "eval_every", None) is not None:
        if args.eval_every < 0:
            raise UserError(f"--eval-every must be >= 0 (0: only at the end); found {args.eval_every}")
        overrides.setdefault("run", {})["eval_every"] = args.eval_every
    return overrides


def _resolve(args: argparse.Namespace) -> tuple[str, cfgmod.RunConfig]:
    from experiments.run.rundir import RunDir

    overrides = _flag_overrides(args)
    if args.resume:
        if (args.preset or args.config or args.data or args.format or args.columns or args.sep or args.seed is not None
                or args.eval_negatives is not None or args.out or getattr(args, "eval_every", None) is not None
                or getattr(args, "record_views", False) or getattr(args, "record_every", None) is not None
                or getattr(args, "canaries", None) is not None):
            raise UserError("--resume continues a run with its saved config; only --rounds may be changed")
        rd = RunDir.open_existing(Path(args.resume))
        _import_run_plugins(rd)
        config = cfgmod.load_config_file(rd.file("config.toml"))
        preset = rd.read_json("run.json").get("preset", "custom")
        if not isinstance(preset, str):
            raise UserError(f"{rd.file('run.json')}: 'preset' must be a preset name; found {type(preset).__name__}")
    else:
        preset = args.preset or DEFAULT_PRESET
        if args.config and not Path(args.config).is_file():
            raise FileNotFoundError(f"config file not found: {args.config}")
        if preset not in cfgmod.PRESETS:  # before the protocols load: a typo answers at once
            raise UserError(f"unknown preset {preset!r}{_did_you_mean(preset, cfgmod.PRESETS)}; available presets: "
                            f"{', '.join(cfgmod.PRESETS)} (secagg run --help describes each)")
        config = cfgmod.load_preset(preset)
        if args.config:
            config = cfgmod.load_config_file(args.config, base=config)
    config = cfgmod.merge(config, overrides)
    if not args.resume and config.data.source != "synthetic":
        # config.toml must name the data wherever --resume is later run from, not relative to today's cwd
        config = cfgmod.merge(config, {"data": {"source": str(Path(config.data.source).expanduser().resolve())}})
    return preset, config


def _did_you_mean(word: str, choices: Any) -> str:
    from protocols.registry import did_you_mean

    return did_you_mean(word, choices)


def _import_run_plugins(rd: Any) -> None:
    """Import the plugin modules a run directory's ``run.json`` records (``--resume``, ``secagg attack
    run-dir``); refuse in words when one is missing here."""
    from protocols.registry import PluginError, import_plugin

    plugins = rd.read_json("run.json").get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(m, str) for m in plugins):
        raise UserError(f"{rd.file('run.json')}: 'plugins' must be a list of module names; found {str(plugins)[:60]}")
    for module in plugins:
        try:
            import_plugin(module, source=f"recorded in {rd.file('run.json')}")
        except PluginError as exc:
            raise UserError(f"cannot continue {rd.path}: it was made with a protocol or attack from plugin module "
                            f"{module!r}, which cannot be imported here ({exc.__cause__}). Install the package that "
                            "provides it (or put it on PYTHONPATH) and run the command again.") from None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Execute ``secagg run`` and return the summary (also written to summary.json)."""
    if args.threads < 1:
        raise UserError(f"--threads must be >= 1; found {args.threads}")
    preset, config = _resolve(args)  # a mistyped preset or flag is refused before torch loads
    import torch

    from experiments.run.training import RunRequest, execute

    torch.set_num_threads(args.threads)
    return execute(RunRequest(
        preset=preset, config=config, out=Path(args.out) if args.out else None,
        resume=Path(args.resume) if args.resume else None, quiet=args.quiet,
        plugins=tuple(getattr(args, "plugins", None) or ()),
    ))


def _format_metrics(name: str, m: dict[str, float] | None) -> str:
    if not m:
        return ""
    keys = [k for k in m if k.startswith(("HR@", "NDCG@")) or k in ("MRR", "AUC", "RMSE", "MAE")]
    return f"{name:<8}" + "  ".join(f"{k} {m[k]:.4f}" if m[k] is not None else f"{k} n/a" for k in keys)


def _num(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "n/a"


def main_metric_names(summary: dict[str, Any]) -> tuple[str, ...]:
    """The HR and NDCG cut-off nearest 10 among the summary's sampled or full metrics."""
    m = summary.get("metrics") or summary.get("metrics_full") or {}
    ks = sorted({int(k.split("@")[1]) for k in m if k.startswith("HR@")}, key=lambda c: (abs(c - 10), c))
    return (f"HR@{ks[0]}", f"NDCG@{ks[0]}") if ks else ()


def _format_ties(ties: dict[str, dict[str, dict[str, float]]] | None, names: tuple[str, ...]) -> list[str]:
    """One line per evaluation: the main metrics under each tie rule (pessimistic is the recorded figure)."""
    lines = []
    for kind, by_rule in (ties or {}).items():
        parts = [f"{k} " + " / ".join(f"{by_rule[r][k]:.4f} {r}" for r in ("pessimistic", "random", "optimistic"))
                 for k in names if k in by_rule.get("pessimistic", {})]
        if parts:
            lines.append(f"{'ties':<8}({kind}) " + "; ".join(parts))
    return lines


def _main(args: argparse.Namespace) -> int:
    summary = run(args)
    ev = summary["evaluation"]
    print(f"data      {summary['data']['preprocessed']} (positives: {summary['data']['positives']})", file=sys.stderr)
    print(f"protocol  {ev['split'].get('kind', ev['split'])}; "
          + "; ".join(str(ev[k]) for k in ("sampled", "ties", "metrics") if k in ev), file=sys.stderr)
    if summary["stopped"]:
        print(f"note      {summary['stopped']}", file=sys.stderr)
    if summary["metrics"]:
        print(_format_metrics("rating" if "RMSE" in summary["metrics"] else "sampled", summary["metrics"]))
    if summary["metrics_full"]:
        print(_format_metrics("full", summary["metrics_full"]))
    for line in _format_ties(summary.get("ties"), main_metric_names(summary)):
        print(line)
    best = summary.get("best_validation")
    if best:
        names = main_metric_names(summary)
        print(f"{'best':<8}round {best['round']} by validation ("
              + ", ".join(f"valid {k} {_num(best['valid'][k])}" for k in names if k in best["valid"]) + "): test "
              + "  ".join(f"{k} {_num(best['metrics'][k])}" for k in names if k in best["metrics"]))
    for i, part in enumerate(summary["privacy"].get("parts") or [summary["privacy"]["statement"]]):
        print(f"{'privacy' if i == 0 else '':<10}{part}")
    print(f"seconds {summary['seconds']:.1f}  bytes/client/round {summary['bytes_per_client_per_round']:.0f}  run dir {summary['run_dir']}")
    views = summary.get("views")
    if views:
        print(f"views     {views['rounds']} round(s) of {', '.join(views['roles'])} recorded: "
              f"{views['bytes'] / 1e6:.2f} MB, {views['seconds']:.2f} s, in {summary['run_dir']}/{views['dir']} "
              "(secagg attack RUN_DIR reads them)")
    if args.json:
        print(jsonio.dumps(summary, sort_keys=True))
    return 0
