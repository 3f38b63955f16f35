"""``secagg audit RUN_DIR``: an empirical lower bound on epsilon from a run's canaries (docs/audit.md).

1. **Scores, from the view only.** The protocol's canary scorer (:mod:`attacks.canary`) reads the
   recorded view of its role, ``public_info()`` and the public ``canaries.json``: one score per canary.
2. **Guesses and the bound.** Only then are the secret inclusion bits read
   (``audit-secret/inclusion.json``); the ``k`` highest scores are guessed in and the ``k`` lowest out
   on a fixed grid of ``k``, and :func:`dp.audit.audit_guesses` gives the largest epsilon the
   one-run test (Steinke, Nasr, Jagielski 2023) rejects at ``--confidence`` (Bonferroni over the grid).
3. **Beside the ledger.** The accounted epsilon (the ledger's at the run's delta, or the protocol's
   per-user report for a scorer that reads only those releases; a swap of a canary's data is two
   add/remove steps where the scorer says so: group privacy ``(2 eps, (1 + e^eps) delta)``). A
   lower bound above the accounted epsilon means the accountant (or the mechanism) is wrong.

Writes ``RUN_DIR/audit.json`` (strict JSON; its schema is in docs/audit.md), which
``secagg privacy report RUN_DIR`` prints beside the ledger's epsilon.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError

__all__ = ["AUDIT_JSON", "FORMAT", "audit_run_dir", "register", "verdict_line"]

AUDIT_JSON = "audit.json"
FORMAT = "secagg-fedrec-audit/1"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "audit",
        help="empirical epsilon lower bound from a run's canaries (run it with --canaries K), beside the ledger's",
        description="One-run privacy audit (Steinke, Nasr, Jagielski 2023) of a run made with --canaries K: score "
        "each canary from the recorded views, guess the highest in and the lowest out, and bound epsilon from "
        "below at the given confidence; compare with the epsilon the ledger accounts. Writes RUN_DIR/audit.json "
        "(docs/audit.md). Exit 0 either way; 'consistent' is false when the bound exceeds the accounted epsilon.",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the lower bound (default 0.95)")
    p.add_argument("--guesses", type=int, default=None, metavar="R",
                   help="guess exactly the R canaries of largest |score| (default: the grid 1, 2, 4, ..., all scored "
                   "canaries, Bonferroni-corrected)")
    p.add_argument("--scorer", default=None, metavar="NAME", help="the canary scorer (default: the protocol's first)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    p.set_defaults(func=_main)


def _accounted(rd: Any, config: Any, scorer: Any) -> dict[str, Any]:
    """The epsilon the run's accounting claims for what the scorer reads, and the (epsilon, delta) the
    audit is compared with after the swap's group size."""
    from dp.errors import LedgerError
    from dp.events import NonPrivate
    from dp.ledger import PrivacyLedger

    delta = config.privacy.delta
    path = rd.file("privacy_ledger.sqlite")
    if not path.is_file():
        raise UserError(f"no privacy ledger at {path}: {rd.path} is not a finished run directory")
    try:
        ledger = PrivacyLedger(path)
    except LedgerError as exc:
        raise UserError(str(exc)) from exc
    with ledger:
        entries = ledger.entries()
        if scorer.accounted == "per_user":
            rep = config.spec.privacy_report(ledger, delta) if config.spec.privacy_report else {}
            try:
                eps = float(rep["per_user"]["epsilon"]["max"])
            except (KeyError, TypeError, ValueError):
                raise UserError(f"{config.run.protocol!r} reports no per-user epsilon for scorer {scorer.name!r}") from None
            source = "the protocol's per-user report (max over users) of the releases the scorer reads"
        elif any(isinstance(e.event, NonPrivate) for e in entries):
            eps, source = math.inf, "the ledger: the run released data without DP"
        else:
            eps, source = float(ledger.spent(delta).epsilon), "the ledger, every release"
    steps = scorer.swap_steps
    if steps == 2 and math.isfinite(eps):
        cmp_eps, cmp_delta = 2 * eps, min(1.0, (1 + math.exp(min(eps, 700))) * delta)
    else:
        cmp_eps, cmp_delta = (eps * steps if math.isfinite(eps) else math.inf), delta
    return {"epsilon": eps, "delta": delta, "source": source, "swap_steps": steps,
            "compared_epsilon": cmp_eps, "compared_delta": cmp_delta,
            "group": "one canary's swap is one step (local DP: any two inputs are neighbours)" if steps == 1 else
                     "one canary's swap is two add/remove steps: compared with (2 eps, (1 + e^eps) delta)"}


def verdict_line(audit: dict[str, Any]) -> str:
    """One line: the bound beside the accounted epsilon, and whether they agree."""
    b, acc = audit["bound"], audit["accounted"]
    conf = f"{100 * b['confidence']:g}%"
    cmp_eps = acc["compared_epsilon"]
    accounted = "inf (no DP)" if cmp_eps is None else f"{cmp_eps:.3g}"
    head = (f"audited lower bound {b['epsilon']:.3g} at {conf} ({b['correct']}/{b['guesses']} guesses right, "
            f"{b['canaries']} canaries, at most {audit['max_detectable']:.3g} detectable) vs accounted {accounted}")
    if audit["consistent"]:
        return f"{head}: consistent"
    return f"{head}: INCONSISTENT: the accountant under-reports (or the mechanism adds less noise than it records)"


def audit_run_dir(run_dir: Path, *, confidence: float = 0.95, guesses: int | None = None, scorer: str | None = None,
                  write: bool = True) -> dict[str, Any]:
    """Audit ``run_dir`` (module docstring); the JSON-ready result, also written to audit.json."""
    import numpy as np

    from attacks.canary import scorers_for
    from attacks.findings import NotApplicable
    from attacks.registry import all_attacks
    from dp.audit import audit_guesses, max_detectable
    from experiments.cli.cmd_run import _import_run_plugins
    from experiments.run import config as cfgmod
    from experiments.run.canaries import load_public, load_secret
    from experiments.run.rundir import RunDir, atomic_write_text
    from experiments.run.views import has_views, load_views

    if not 0 < confidence < 1:
        raise UserError(f"--confidence must be in (0, 1); found {confidence}")
    if not (Path(run_dir) / "config.toml").is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.toml); audit the directory a 'secagg run "
                        "--canaries K' wrote")
    rd = RunDir.open_existing(run_dir)
    _import_run_plugins(rd)
    all_attacks()  # plugins' attack modules may register canary scorers
    config = cfgmod.load_config_file(rd.file("config.toml"))
    protocol = config.spec.name
    public_canaries = load_public(rd.path)
    if not has_views(rd.path):
        raise UserError(f"{rd.path} recorded no views; a run with --canaries records them (was views/ deleted?)")
    choices = scorers_for(protocol)
    if scorer is not None:
        choices = [s for s in choices if s.name == scorer]
    if not choices:
        names = ", ".join(s.name for s in scorers_for(protocol)) or "none"
        raise UserError(f"no canary scorer {scorer + ' ' if scorer else ''}for protocol {protocol!r} (registered: "
                        f"{names}); docs/audit.md says how to add one")
    spec = choices[0]
    views = load_views(rd.path)
    # 1. scores: the view, public info and the public canary list only
    try:
        scores = np.asarray(spec.score(views.view(spec.view), views.last_public(), public_canaries), np.float64)
    except NotApplicable as exc:
        raise UserError(f"canary scorer {spec.name!r} cannot score this run: {exc}") from None
    if scores.shape != (len(public_canaries.users),):
        raise UserError(f"canary scorer {spec.name!r} returned {scores.shape} scores for {len(public_canaries.users)} "
                        "canaries")
    # 2. the secret bits, guesses and the bound
    bits = load_secret(rd.path).included
    accounted = _accounted(rd, config, spec)
    try:
        bound = audit_guesses(scores, bits, delta=accounted["compared_delta"], confidence=confidence, guesses=guesses)
    except ValueError as exc:
        raise UserError(f"--guesses: {exc}") from None
    cap = max_detectable(len(bits), delta=accounted["compared_delta"], confidence=confidence,
                         corrected=guesses is None)
    consistent = bool(bound.epsilon <= accounted["compared_epsilon"] * (1 + 1e-9))
    out = {
        "format": FORMAT, "run_dir": str(run_dir), "protocol": protocol, "scorer": spec.name, "role": spec.view,
        "reads": spec.reads, "rounds": list(views.rounds), "canaries": len(bits),
        "canary_items": int(public_canaries.items_a.shape[1]),
        "bound": bound.to_dict(), "max_detectable": cap, "accounted": accounted, "consistent": consistent,
        "scores": [None if math.isnan(s) else float(s) for s in scores],
    }
    out["verdict"] = verdict_line(jsonio.strict(out))
    out = jsonio.strict(out)
    if write:
        atomic_write_text(rd.file(AUDIT_JSON), jsonio.dumps(out, indent=1, sort_keys=True) + "\n")
    return out


def _main(args: argparse.Namespace) -> int:
    out = audit_run_dir(args.run_dir, confidence=args.confidence, guesses=args.guesses, scorer=args.scorer)
    b = out["bound"]
    print(f"{out['protocol']}: {out['canaries']} canaries, scorer {out['scorer']} ({out['reads']}), "
          f"rounds {out['rounds']}")
    print(f"guesses: {b['guesses']} of {b['scored']} scored canaries ({b['guessed_in']} in, {b['guessed_out']} out; grid "
          f"{b['grid']}), {b['correct']} right; {b['correction']}")
    print(f"accounted: {out['accounted']['source']}; {out['accounted']['group']}")
    print(out["verdict"])
    print(f"wrote {Path(args.run_dir) / AUDIT_JSON}")
    if args.json:
        print(jsonio.dumps(out, sort_keys=True))
    return 0
