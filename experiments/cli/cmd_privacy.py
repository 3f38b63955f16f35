"""``secagg privacy ...``: account, calibrate and report differential privacy.

* ``secagg privacy account --mechanism gaussian --q Q --sigma S --steps T --delta D``
  (``--sampling fixed --population N`` for fixed-size sampling without replacement),
  ``--mechanism laplace --epsilon0 E --count K [--delta D]`` (delta 0 = pure DP), and
  ``--mechanism fel --sigma S --cluster Q,STEPS ... [--over-arch Q,STEPS,SIGMA --over-arch-users
  same|disjoint|opt_in] --delta D`` (FEL: leaves on disjoint clusters, then the over-arch).
* ``secagg privacy calibrate --epsilon E --delta D --q Q --steps T`` (noise multiplier), or
  ``--mechanism laplace --epsilon E --count K [--delta D]`` (per-release epsilon0).
* ``secagg privacy report RUN_DIR`` reads ``RUN_DIR/privacy_ledger.sqlite``, prints epsilon
  against rounds and writes ``RUN_DIR/privacy.png``. For a run with local-DP uploads (ledger
  entries of cohort ``user:<u>``, e.g. FedCL's embeddings) it also states each user's epsilon as
  the ledger composes it and as the clients counted it themselves (``clients_ldp``: median and
  max of each; the clients' counts come from the checkpoint of an in-process run, whose trainer
  plays every client; on Flower they stay on the nodes), and where the two may differ. Every report
  ends with what was spent "in words" (:mod:`experiments.cli.privacy_text`): the releases without DP by
  name, each cohort's (FEL: each leaf's and the over-arch's) epsilon, the per-user local-DP epsilon
  (median and max, basic composition and the protocol's tightest figure) and the overall guarantee.

``--json`` prints one JSON object as the last line of stdout with at least ``epsilon`` (the
tightest available), ``accountant`` (which one gave it), ``epsilon_rdp``, ``order``, ``delta`` and
``private`` (false, with a ``reason`` in words, when no finite epsilon holds).

``--delta`` must lie in (0, 1) (``laplace`` also accepts 0, meaning pure DP): delta 1 promises
nothing, and Gaussian noise has no finite epsilon at delta 0. ``calibrate`` meets the target under
the accountant it then reports (the tightest of RDP and PLD; RDP alone with ``--no-pld``) and says
which.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from experiments import jsonio
from experiments.errors import UserError
from protocols.state import loads_json

__all__ = ["register"]


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if math.isnan(v):
        raise argparse.ArgumentTypeError("NaN is not allowed")
    return v


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _pair(text: str) -> tuple[float, int]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected Q,STEPS (e.g. 0.02,51). Found {text!r}.")
    return _float(parts[0]), _int(parts[1])


def _triple(text: str) -> tuple[float, int, float]:
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected Q,STEPS,SIGMA (e.g. 0.05,10,2.0). Found {text!r}.")
    return _float(parts[0]), _int(parts[1]), _float(parts[2])


def _emit(payload: dict, human: list[str], as_json: bool) -> int:
    for line in human:
        print(line)
    for note in payload.get("notes", []):
        print(f"note: {note}", file=sys.stderr)
    if as_json:
        print(jsonio.dumps(payload, sort_keys=True))
    return 0


def _check_delta(delta: float | None, *, allow_zero: bool) -> None:
    """Refuse a delta outside (0, 1) (or [0, 1) where pure DP is meaningful), in words."""
    if delta is None:
        return
    if delta >= 1 or delta < 0 or math.isinf(delta):
        raise UserError(
            f"--delta must lie in (0, 1); found {delta:g}. delta is the probability that the guarantee "
            "fails: at delta >= 1 it promises nothing (any mechanism has epsilon 0 there). Typical: "
            "1e-5, or below 1/(number of users)."
        )
    if delta == 0 and not allow_zero:
        raise UserError(
            "--delta 0 asks for pure DP, which Gaussian noise never gives (its epsilon is infinite at "
            "delta 0); pass a delta in (0, 1), e.g. 1e-5."
        )


def _non_private_reason(rep, causes: list[str]) -> str | None:  # noqa: ANN001 - PrivacyReport
    """Why no finite epsilon holds, in words (None when the guarantee is finite)."""
    if math.isfinite(rep.epsilon):
        return None
    return "; ".join(causes) if causes else (
        "no accountant finds a finite epsilon for these parameters at this delta"
    )


def _report_lines(rep, reason: str | None = None) -> list[str]:  # noqa: ANN001 - PrivacyReport
    if reason is not None:
        return [
            f"epsilon = inf at delta = {rep.delta:g}: NOT differentially private. {reason}.",
        ]
    order = f" at order {rep.order:g}" if math.isfinite(rep.order) else " (no finite bound at any order)"
    lines = [
        f"epsilon = {rep.epsilon:.6g} at delta = {rep.delta:g} (tightest: {rep.accountant}; "
        f"{rep.neighboring_relation.replace('_', '/')} neighbours)",
        f"  RDP : epsilon {rep.epsilon_rdp:.6g}{order}",
    ]
    lines.append(f"  PLD : epsilon {rep.epsilon_pld:.6g} (dp-accounting)" if rep.epsilon_pld is not None else "  PLD : skipped")
    if math.isfinite(rep.epsilon_pure):
        lines.append(f"  pure: epsilon {rep.epsilon_pure:.6g} (basic composition)")
    return lines


#: The options each mechanism needs (checked before dp and scipy load, so a missing one answers at once).
_ACCOUNT_NEEDS = {"gaussian": ("q", "sigma", "steps", "delta"), "laplace": ("epsilon0", "count"), "fel": ("sigma", "delta")}
_CALIBRATE_NEEDS = {"gaussian": ("epsilon", "delta", "q", "steps"), "laplace": ("epsilon", "count")}


def _account(args: argparse.Namespace) -> int:
    _check_delta(args.delta, allow_zero=args.mechanism == "laplace")
    _need(args, *_ACCOUNT_NEEDS[args.mechanism])
    from dp.accountant import best_epsilon
    from dp.calibration import gaussian_training_event
    from dp.events import FelTotal, Laplace, SelfComposed

    relation = "add_remove"
    params: dict[str, object] = {"mechanism": args.mechanism}
    causes: list[str] = []
    if args.mechanism == "gaussian":
        _need(args, "q", "sigma", "steps", "delta")
        if args.sigma == 0 and args.q > 0 and args.steps > 0:
            causes.append("--sigma 0 adds no noise, so every sampled update is released exactly")
        if args.sampling == "fixed":
            relation = "replace_one"
        event = gaussian_training_event(noise_multiplier=args.sigma, q=args.q, steps=args.steps,
                                        sampling=args.sampling, population=args.population)
        params.update(q=args.q, sigma=args.sigma, steps=args.steps, sampling=args.sampling, population=args.population)
        delta = args.delta
    elif args.mechanism == "laplace":
        _need(args, "epsilon0", "count")
        event = SelfComposed(Laplace.from_epsilon(args.epsilon0), args.count)
        delta = 0.0 if args.delta is None else args.delta
        relation = "replace_one"  # LDP uploads: any two inputs are neighbours
        params.update(epsilon0=args.epsilon0, count=args.count)
    else:  # fel
        _need(args, "sigma", "delta")
        if args.sigma == 0:
            causes.append("--sigma 0 adds no noise to the leaves' updates, so they are released exactly")
        if not args.cluster:
            raise UserError("--mechanism fel needs at least one --cluster Q,STEPS (one per leaf cluster).")
        leaves = tuple(gaussian_training_event(noise_multiplier=args.sigma, q=q, steps=t) for q, t in args.cluster)
        over = None
        if args.over_arch is not None:
            q, t, s = args.over_arch
            if s == 0:
                causes.append("the over-arch's SIGMA 0 adds no noise, so its updates are released exactly")
            over = gaussian_training_event(noise_multiplier=s, q=q, steps=t)
        users = args.over_arch_users or ("same" if over is not None else "opt_in")
        event = FelTotal(leaves, over, users)
        delta = args.delta
        params.update(sigma=args.sigma, clusters=[list(c) for c in args.cluster],
                      over_arch=list(args.over_arch) if args.over_arch else None, over_arch_users=users)
    rep = best_epsilon(event, delta, use_pld=not args.no_pld, neighboring_relation=relation)
    reason = _non_private_reason(rep, causes)
    if reason is not None:
        rep = dataclasses.replace(rep, notes=tuple(n for n in rep.notes if not n.startswith("PLD skipped")))
    payload = rep.to_dict() | {"parameters": params, "private": reason is None, "reason": reason}
    human = _report_lines(rep, reason)
    if rep.epsilon == 0:
        payload["reason"] = "nothing is released: the sampling rate or the number of steps is 0"
        human.append(f"  ({payload['reason']})")
    return _emit(payload, human, args.json)


def _need(args: argparse.Namespace, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None]
    if missing:
        raise UserError(f"--mechanism {args.mechanism} needs {', '.join(missing)}.")


def _calibrate(args: argparse.Namespace) -> int:
    _check_delta(args.delta, allow_zero=args.mechanism == "laplace")
    _need(args, *_CALIBRATE_NEEDS[args.mechanism])
    from dp.accountant import best_epsilon
    from dp.calibration import calibrate_gaussian_noise_multiplier, calibrate_laplace_epsilon0, gaussian_training_event
    from dp.events import Laplace, SelfComposed

    use_pld = not args.no_pld
    if args.mechanism == "gaussian":
        _need(args, "epsilon", "delta", "q", "steps")
        sigma = calibrate_gaussian_noise_multiplier(target_epsilon=args.epsilon, delta=args.delta, q=args.q,
                                                    steps=args.steps, sampling=args.sampling,
                                                    population=args.population, use_pld=use_pld)
        relation = "replace_one" if args.sampling == "fixed" else "add_remove"
        event = gaussian_training_event(noise_multiplier=sigma, q=args.q, steps=args.steps,
                                        sampling=args.sampling, population=args.population)
        rep = best_epsilon(event, args.delta, use_pld=use_pld, neighboring_relation=relation)
        what = f"sigma (noise multiplier) = {sigma:.6g}"
        payload = rep.to_dict() | {"sigma": sigma, "target_epsilon": args.epsilon}
    else:
        _need(args, "epsilon", "count")
        delta = 0.0 if args.delta is None else args.delta
        e0 = calibrate_laplace_epsilon0(target_epsilon=args.epsilon, count=args.count, delta=delta, use_pld=use_pld)
        rep = best_epsilon(SelfComposed(Laplace.from_epsilon(e0), args.count), delta, use_pld=use_pld,
                           neighboring_relation="replace_one")
        what = f"epsilon0 per release = {e0:.6g} for {args.count} releases"
        payload = rep.to_dict() | {"epsilon0": e0, "target_epsilon": args.epsilon}
    against = "the tightest of RDP, PLD and pure DP" if use_pld else "RDP and pure DP (--no-pld)"
    payload["calibrated_against"] = "tightest" if use_pld else "rdp"
    human = [f"{what}: the least noise whose epsilon, by {against}, is within the target {args.epsilon:g} "
             f"(reached: {rep.epsilon:.6g}, by {rep.accountant})"]
    return _emit(payload, human + _report_lines(rep), args.json)


def _report(args: argparse.Namespace) -> int:
    _check_delta(args.delta, allow_zero=True)
    run_dir = Path(args.run_dir)
    path = run_dir / "privacy_ledger.sqlite"
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise FileNotFoundError(
            f"no privacy ledger at {path}: every 'secagg run' writes one, so {run_dir} is not a run directory "
            "or was written by an older version"
        )
    try:
        ident = loads_json((run_dir / "run.json").read_text(encoding="utf-8"))
    except OSError:
        ident = {}
    except ValueError as exc:
        raise UserError(f"cannot read {run_dir / 'run.json'}: {exc}") from None
    delta = args.delta
    if delta is None:
        try:
            delta = ident["config"]["privacy"]["delta"]
        except (KeyError, TypeError):
            delta = None
        if delta is not None and (type(delta) not in (int, float) or not 0 < delta < 1):
            raise UserError(f"{run_dir / 'run.json'}: config.privacy.delta must be a number in (0, 1); "
                            f"found {str(delta)[:40]} (pass --delta to report at another delta)")
    from dp.errors import LedgerError
    from dp.events import NonPrivate
    from dp.ledger import PrivacyLedger
    from experiments.cli.privacy_text import describe_spent

    try:
        ledger = PrivacyLedger(path)
    except LedgerError as exc:
        raise UserError(str(exc)) from exc
    with ledger:
        if delta is None:
            delta = ledger.budget[1] if ledger.budget else 1e-5
        entries = ledger.entries()
        unprotected = sorted({e.what for e in entries if isinstance(e.event, NonPrivate)})
        history = ledger.history(delta)
        rep = ledger.spent(delta, use_pld=not args.no_pld and not unprotected)
        cohorts = ledger.spent_by_cohort(delta)
        extra = _protocol_report(ident.get("protocol") if isinstance(ident, dict) else None, ledger, delta)
        clients_ldp = _clients_ldp(run_dir, entries)
        words = describe_spent(ledger, delta, extra, use_pld=not args.no_pld)
    png = run_dir / "privacy.png"
    _plot(history, rep, delta, png)
    payload = rep.to_dict() | {
        "rounds": [r for r, _ in history],
        "epsilon_by_round": [e if math.isfinite(e) else "inf" for _, e in history],
        "entries": len(entries),
        "budget": list(ledger.budget) if ledger.budget else None,
        "unprotected_releases": unprotected,
        "cohorts": [{"cohort": c, "epsilon": r.to_dict()["epsilon"], "accountant": r.accountant}
                    for c, r in cohorts.items()],
        "composition": "parallel over cohorts" if cohorts else "sequential",
        "png": str(png),
        **extra,
    }
    if clients_ldp is not None:
        payload["clients_ldp"] = clients_ldp
    if not entries:
        human = ["nothing was released: the ledger is empty (no round ran), epsilon = 0"]
        payload["statement"] = human[0]
    elif unprotected:
        human = [f"epsilon = inf: this run released data without differential privacy ({'; '.join(unprotected)})."]
        payload["statement"] = human[0]
    else:
        human = [f"{'round':>6}  {'epsilon (RDP/pure)':>18}"] + [f"{r:>6}  {e:>18.6g}" for r, e in history]
        human += _report_lines(rep)
        payload["statement"] = f"({rep.epsilon:.6g}, {delta:g})-DP ({rep.accountant})"
        if cohorts:
            worst = max(cohorts.items(), key=lambda kv: kv[1].epsilon)
            human.append(f"  {len(cohorts)} disjoint cohorts (parallel composition); worst: {worst[0]} "
                         f"epsilon {worst[1].epsilon:.6g}")
    if entries and extra.get("noise_assumption"):  # (a protocol's stated assumption, e.g. FEL's collusion bound)
        human.append(f"  assumes: {extra['noise_assumption']}")
    if clients_ldp is not None:
        human += _clients_ldp_lines(clients_ldp)
    audit = _audit_block(run_dir)
    if audit is not None:
        payload["audit"] = audit
        human.append(f"audit ({audit['scorer']}, secagg audit): {audit['verdict']}")
    human.append("in words:")
    human += [f"  {part[0].upper()}{part[1:]}." for part in words["parts"]]
    payload["in_words"] = words["parts"]
    human.append(f"wrote {png}")
    return _emit(payload, human, args.json)


def _audit_block(run_dir: Path) -> dict | None:
    """``audit.json`` of ``secagg audit RUN_DIR`` in brief (``None`` if the run was not audited)."""
    path = run_dir / "audit.json"
    if not path.is_file():
        return None
    try:
        audit = loads_json(path.read_text(encoding="utf-8"))
        bound, acc = audit["bound"], audit["accounted"]
        return {"scorer": str(audit["scorer"]), "verdict": str(audit["verdict"]), "consistent": bool(audit["consistent"]),
                "epsilon_lower_bound": float(bound["epsilon"]), "confidence": float(bound["confidence"]),
                "canaries": int(audit["canaries"]), "accounted_epsilon": acc["compared_epsilon"],
                "file": str(path)}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read {path}: {exc} (run 'secagg audit {run_dir}' again)") from None


#: Where the clients' own count and the ledger's may differ (``secagg privacy report``, ``clients_ldp.note``).
CLIENTS_LDP_NOTE = (
    "A client charges a local-DP upload to its own record when it admits the request, before it computes "
    "the upload, and refuses one beyond its budget; the ledger records an upload when the server accepts it. "
    "The client's count is higher when an upload it computed never reached the ledger: a reply the server "
    "dropped (malformed, late, lost) or a server that left it out. In process it can be lower after a "
    "resume: rounds run after the last checkpoint were redone, their uploads are in the ledger, and the "
    "simulated clients' records come from that checkpoint. Both count by basic composition (k uploads of "
    "epsilon: k epsilon); the ledger's per_user.epsilon may be tighter (RDP/PLD)."
)


def _stats(values: list[float]) -> dict[str, float] | None:
    import statistics

    return {"users": len(values), "median": statistics.median(values), "max": max(values)} if values else None


def _clients_ldp(run_dir: Path, entries: list) -> dict | None:  # noqa: ANN001 - ledger entries
    """The ``clients_ldp`` block: each user's local-DP epsilon by the ledger (its ``user:<u>`` Laplace
    entries, basic composition) and by the clients' own records (the checkpoint), or ``None`` for a
    run without local-DP uploads."""
    from dp.events import Laplace
    from experiments.run.rundir import RunDir
    from protocols.guard import ldp_counts

    by_ledger: dict[str, float] = {}
    for e in entries:
        if e.cohort and e.cohort.startswith("user:") and isinstance(e.event, Laplace):
            by_ledger[e.cohort] = by_ledger.get(e.cohort, 0.0) + e.event.epsilon0
    if not by_ledger:
        return None
    counts, where = None, "the run directory holds no checkpoint"
    try:
        state = RunDir.open_existing(run_dir).load_checkpoint()
    except (UserError, OSError, ValueError) as exc:
        state, where = None, f"its checkpoint cannot be read ({exc})"
    trainer = state.get("trainer") if isinstance(state, dict) else None
    if isinstance(trainer, dict):
        try:
            counts = ldp_counts(trainer.get("device_guard"))
        except ValueError as exc:
            where = f"the checkpoint's client records are malformed ({exc})"
        else:
            where = ("the clients' own records are not in this run directory: on Flower each node keeps its count "
                     "in its Flower context and state directory (guard.npz), never sent to the server; a checkpoint "
                     "written before the clients' records were kept has none") if counts is None else \
                "the simulated clients' own records in the run's last checkpoint"
    out = {"ledger": _stats(sorted(by_ledger.values())), "clients": None if counts is None else _stats(
        sorted(counts.values())), "source": where, "composition": "basic", "note": CLIENTS_LDP_NOTE}
    if counts is not None:
        users = {int(c[5:]) for c in by_ledger} | set(counts)
        ledger_of = {int(c[5:]): v for c, v in by_ledger.items()}
        tol = 1e-9
        out["users_counted_more_than_the_ledger"] = sum(counts.get(u, 0.0) > ledger_of.get(u, 0.0) + tol for u in users)
        out["users_counted_less_than_the_ledger"] = sum(counts.get(u, 0.0) < ledger_of.get(u, 0.0) - tol for u in users)
    return out


def _clients_ldp_lines(block: dict) -> list[str]:
    led, cli = block["ledger"], block["clients"]
    lines = [f"local-DP uploads per user (basic composition): the ledger says median epsilon {led['median']:.6g}, "
             f"max {led['max']:.6g} ({led['users']} users)"]
    if cli is None:
        lines.append(f"  the clients' own count: not shown ({block['source']})")
    else:
        lines.append(f"  the clients' own count: median epsilon {cli['median']:.6g}, max {cli['max']:.6g} "
                     f"({cli['users']} users; {block['source']})")
        more, less = block["users_counted_more_than_the_ledger"], block["users_counted_less_than_the_ledger"]
        lines.append(f"  users whose own count is above the ledger's: {more}; below: {less}" if more or less
                     else "  every user's own count equals the ledger's")
    lines.append(f"  where they may differ: {block['note']}")
    return lines


def _protocol_report(protocol: str | None, ledger, delta: float) -> dict:  # noqa: ANN001
    """The registered protocol's own report keys (``ProtocolSpec.privacy_report``), if any."""
    from protocols.registry import all_protocols

    spec = all_protocols().get(protocol) if protocol else None
    if spec is None or spec.privacy_report is None:
        return {}
    return spec.privacy_report(ledger, delta)


def _plot(history: list[tuple[int, float]], rep, delta: float, png: Path) -> None:  # noqa: ANN001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    finite = [(r, e) for r, e in history if math.isfinite(e)]
    if finite:
        ax.plot([r for r, _ in finite], [e for _, e in finite], marker=".", label="RDP / pure, per round")
        if math.isfinite(rep.epsilon):
            ax.scatter([history[-1][0]], [rep.epsilon], color="red", zorder=3, label=f"final ({rep.accountant})")
        ax.legend()
    else:
        msg = "epsilon = inf: releases without DP" if history else "nothing released"
        ax.text(0.5, 0.5, msg, ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("round")
    ax.set_ylabel(f"epsilon at delta={delta:g}")
    ax.set_title("Privacy spent")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _median_ms(fn, repeat: int) -> float:  # noqa: ANN001
    import statistics
    import time

    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _bench(args: argparse.Namespace) -> int:
    import warnings

    from dp import discrete, mechanisms
    from dp.accountant import PldAccountant, RdpAccountant
    from dp.events import Gaussian, PoissonSampled, SelfComposed
    from dp.rdp import default_orders

    q, z, steps, delta = args.q, args.sigma, args.steps, args.delta
    event = SelfComposed(PoissonSampled(q, Gaussian(z)), steps)
    warnings.simplefilter("ignore")
    res: dict[str, object] = {"q": q, "sigma": z, "steps": steps, "delta": delta, "orders": int(default_orders().size),
                              "note": "median wall time in ms on a shared machine (measured under load)"}
    res["rdp_epsilon_ms"] = _median_ms(lambda: RdpAccountant().compose(event).get_epsilon(delta), args.repeat)
    try:
        from opacus.accountants.analysis import rdp as opacus_rdp

        orders = list(default_orders())

        def opacus_query() -> None:
            r = opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=orders)
            opacus_rdp.get_privacy_spent(orders=orders, rdp=r, delta=delta)

        res["opacus_epsilon_ms"] = _median_ms(opacus_query, max(1, args.repeat // 5))
        res["speedup_vs_opacus"] = res["opacus_epsilon_ms"] / res["rdp_epsilon_ms"]  # type: ignore[operator]
    except ImportError:
        res["opacus_epsilon_ms"] = None
    res["pld_epsilon_ms"] = _median_ms(lambda: PldAccountant().compose(event).get_epsilon(delta), 1)
    n = args.dim
    res["dim"] = n
    res["float_gaussian_ms"] = _median_ms(lambda: mechanisms.gaussian_noise(n, 1.0), 3)
    res["float_laplace_ms"] = _median_ms(lambda: mechanisms.laplace_noise(n, 1.0), 3)
    res["discrete_gaussian_grid16_ms"] = _median_ms(lambda: discrete.discrete_gaussian_noise(n, 1.0, 16), 3)
    res["discrete_laplace_grid16_ms"] = _median_ms(lambda: discrete.discrete_laplace_noise(n, 1.0, 16), 3)
    res["discrete_gaussian_sigma3_ms"] = _median_ms(lambda: discrete.discrete_gaussian(n, 3.0), 3)
    human = [f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in res.items()]
    return _emit(res, human, args.json)


def _validate(args: argparse.Namespace) -> int:
    import warnings

    import mpmath
    import numpy as np

    from dp.accountant import best_epsilon
    from dp.events import Gaussian, PoissonSampled, SelfComposed
    from dp.rdp import rdp_sampled_gaussian

    try:
        from opacus.accountants.analysis import rdp as opacus_rdp
    except ImportError as exc:
        raise UserError("validate needs opacus (pip install -e '.[dev]').") from exc
    warnings.simplefilter("ignore")
    gen = np.random.default_rng(args.seed)  # simulation choice of test points, not noise
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    worst_opacus = (0.0, None)
    for _ in range(args.samples):
        q = float(10 ** gen.uniform(-3, math.log10(0.99)))
        z = float(gen.uniform(0.5, 10.0))
        ours = rdp_sampled_gaussian(q=q, noise_multiplier=z, orders=orders)
        theirs = np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=orders))
        ok = np.isfinite(theirs) & (theirs > 0)
        rel = np.abs(ours[ok] - theirs[ok]) / theirs[ok]
        i = int(np.argmax(rel))
        if rel[i] > worst_opacus[0]:
            worst_opacus = (float(rel[i]), {"q": q, "sigma": z, "order": float(np.asarray(orders)[ok][i])})
    worst_mp = (0.0, None)
    below = 0
    for _ in range(args.mp_samples):
        q = float(10 ** gen.uniform(-4, math.log10(0.99)))
        z = float(gen.uniform(0.4, 20.0))
        a = float(gen.choice([1.1, 1.5, 2.3, 4.7, 7.5, 9.9]))
        with mpmath.workdps(40):
            qq, zz, aa = mpmath.mpf(q), mpmath.mpf(z), mpmath.mpf(a)
            z0 = zz * zz * mpmath.log(1 / qq - 1) + mpmath.mpf(1) / 2
            f = lambda t: mpmath.npdf(t, 0, zz) * (1 - qq + qq * mpmath.exp((2 * t - 1) / (2 * zz * zz))) ** aa  # noqa: E731
            exact = float(mpmath.log(mpmath.quad(f, sorted({-mpmath.inf, mpmath.mpf(0), z0, aa, mpmath.inf}))) / (aa - 1))
        ours = float(rdp_sampled_gaussian(q=q, noise_multiplier=z, orders=[a])[0])
        below += ours < exact
        rel = abs(ours - exact) / exact
        if rel > worst_mp[0]:
            worst_mp = (rel, {"q": q, "sigma": z, "order": a})
    gaps = []
    settings_list = [] if args.no_gaps else [(0.01, 1.0, 100), (0.01, 1.0, 1000), (0.001, 1.0, 10000), (0.02, 0.8, 500),
                        (0.1, 2.0, 50), (0.004, 0.7, 251), (1.0, 5.0, 10)]
    for q, z, steps in settings_list:
        rep = best_epsilon(SelfComposed(PoissonSampled(q, Gaussian(z)), steps), args.delta)
        gaps.append({"q": q, "sigma": z, "steps": steps, "epsilon_rdp": rep.epsilon_rdp, "epsilon_pld": rep.epsilon_pld,
                     "rdp_over_pld": rep.epsilon_rdp / rep.epsilon_pld if rep.epsilon_pld else None})
    res = {"max_rel_dev_opacus": worst_opacus[0], "at_opacus": worst_opacus[1],
           "max_rel_dev_mpmath": worst_mp[0], "at_mpmath": worst_mp[1], "below_mpmath": int(below),
           "samples": args.samples, "mp_samples": args.mp_samples, "delta": args.delta, "pld_vs_rdp": gaps}
    human = [f"max relative deviation from Opacus: {worst_opacus[0]:.3g} at {worst_opacus[1]}",
             f"max relative deviation from mpmath: {worst_mp[0]:.3g} at {worst_mp[1]} (below exact: {below})"]
    human += [f"q={g['q']:g} sigma={g['sigma']:g} steps={g['steps']}: RDP {g['epsilon_rdp']:.4g}, "
              f"PLD {g['epsilon_pld']:.4g}" for g in gaps]
    return _emit(res, human, args.json)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg privacy`` with ``account``, ``calibrate`` and ``report``."""
    parser = subparsers.add_parser("privacy", help="differential privacy: account, calibrate, report",
                                   description="Differential privacy accounting (RDP, PLD via dp-accounting, pure DP).")
    sub = parser.add_subparsers(dest="privacy_command", metavar="ACTION")
    parser.set_defaults(func=lambda args: (parser.print_help(sys.stderr), 2)[1])

    acc = sub.add_parser("account", help="epsilon of a mechanism and its composition",
                         description="Epsilon of a mechanism: the tightest of RDP, PLD and pure-DP accounting.")
    acc.add_argument("--mechanism", choices=("gaussian", "laplace", "fel"), default="gaussian",
                     help="gaussian (DP-FedAvg/DP-SGD), laplace (LDP uploads), fel (leaves + over-arch)")
    acc.add_argument("--q", type=_float, help="sampling rate per step (Poisson unless --sampling fixed)")
    acc.add_argument("--sigma", type=_float, help="noise multiplier (noise std / sensitivity)")
    acc.add_argument("--steps", type=_int, help="number of steps/rounds")
    acc.add_argument("--delta", type=_float, help="target delta in (0, 1) (laplace: default 0 = pure DP)")
    acc.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson",
                     help="poisson (add/remove neighbours) or fixed-size without replacement (replace-one)")
    acc.add_argument("--population", type=_int, help="population size for --sampling fixed")
    acc.add_argument("--epsilon0", type=_float, help="laplace: pure epsilon per release")
    acc.add_argument("--count", type=_int, help="laplace: number of releases by the same user")
    acc.add_argument("--cluster", type=_pair, action="append", metavar="Q,STEPS",
                     help="fel: one leaf cluster's sampling rate and rounds (repeat per cluster)")
    acc.add_argument("--over-arch", type=_triple, metavar="Q,STEPS,SIGMA", help="fel: over-arch training")
    acc.add_argument("--over-arch-users", choices=("same", "disjoint", "opt_in"),
                     help="fel: who trains the over-arch (default same if --over-arch else opt_in)")
    acc.add_argument("--no-pld", action="store_true", help="skip the (slower) PLD accountant")
    acc.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    acc.set_defaults(func=_account)

    cal = sub.add_parser("calibrate", help="noise for a target epsilon",
                         description="Smallest noise meeting a target (epsilon, delta) under the accountant it "
                         "reports (the tightest of RDP and PLD; RDP with --no-pld); never overshoots.")
    cal.add_argument("--mechanism", choices=("gaussian", "laplace"), default="gaussian")
    cal.add_argument("--epsilon", type=_float, help="target epsilon")
    cal.add_argument("--delta", type=_float, help="target delta")
    cal.add_argument("--q", type=_float, help="gaussian: sampling rate")
    cal.add_argument("--steps", type=_int, help="gaussian: number of steps")
    cal.add_argument("--sampling", choices=("poisson", "fixed"), default="poisson")
    cal.add_argument("--population", type=_int, help="population size for --sampling fixed")
    cal.add_argument("--count", type=_int, help="laplace: number of releases")
    cal.add_argument("--no-pld", action="store_true",
                     help="calibrate against RDP alone (faster; more noise where PLD is tighter)")
    cal.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    cal.set_defaults(func=_calibrate)

    rep = sub.add_parser("report", help="epsilon against rounds from a run's privacy ledger",
                         description="Read RUN_DIR/privacy_ledger.sqlite, print epsilon per round, write RUN_DIR/privacy.png.")
    rep.add_argument("run_dir", metavar="RUN_DIR")
    rep.add_argument("--delta", type=_float, help="delta (default: the ledger budget's, else 1e-5)")
    rep.add_argument("--no-pld", action="store_true", help="skip the PLD accountant for the final value")
    rep.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    rep.set_defaults(func=_report)

    ben = sub.add_parser("bench", help="time the accountants (vs Opacus) and the samplers",
                         description="Median wall times; the machine is shared, so read them as ratios.")
    ben.add_argument("--q", type=_float, default=0.01)
    ben.add_argument("--sigma", type=_float, default=1.0)
    ben.add_argument("--steps", type=_int, default=100_000)
    ben.add_argument("--delta", type=_float, default=1e-5)
    ben.add_argument("--repeat", type=_int, default=20, help="repetitions of the RDP query")
    ben.add_argument("--dim", type=_int, default=100_000, help="vector length for the samplers")
    ben.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ben.set_defaults(func=_bench)

    val = sub.add_parser("validate", help="deviation from Opacus and from an mpmath integral; PLD-vs-RDP gaps",
                         description="Random points over the property tests' ranges (needs opacus).")
    val.add_argument("--samples", type=_int, default=300, help="points compared with Opacus")
    val.add_argument("--mp-samples", type=_int, default=60, help="points compared with mpmath (slow)")
    val.add_argument("--seed", type=_int, default=0)
    val.add_argument("--delta", type=_float, default=1e-5)
    val.add_argument("--no-gaps", action="store_true", help="skip the PLD-vs-RDP table (slow)")
    val.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    val.set_defaults(func=_validate)
