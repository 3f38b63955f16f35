"""``secagg attack RUN_DIR``: every registered attack on what a run's servers saw, in one schema.

``secagg attack RUN_DIR [--attack NAME] [--rounds K] [--plugin MODULE] [--json]``
(``secagg attack run-dir RUN_DIR ...`` is the same command.)

The view each attack reads:

* **recorded** (the run was made with ``--record-views``, :mod:`experiments.run.views`): the files of
  ``RUN_DIR/views``, each verified against its SHA-256, every recorded round;
* **replayed** (no views recorded): the protocol rebuilt from the run's configuration and data
  (checked against ``run.json`` as ``--resume`` checks them; its plugin modules imported again),
  its first ``K`` rounds (default 1) replayed from the run's seed with every payload kept.
  Without DP noise the replay is the run's own view (``replay_matches_run`` compares the replayed
  bytes per party with ``transcript.csv``); with DP noise it draws fresh noise of the same law.

Every attack registered for the run's protocol runs on its role's view and ``public_info()``
(:class:`attacks.registry.AttackSpec`: ``infer`` + ``assess``, or a plugin's older ``run`` +
``score``); an attack whose ``infer`` finds the view cannot hold what it needs is listed under
``skipped`` with the reason. Only then is the run's training data loaded, to score the
inferences (:mod:`attacks.findings`: ``value``, the ``random`` and ``public`` baselines, the
``advantage`` between the stronger baseline, 0, and a perfect inference, 1, and an ``interval``).

Writes ``RUN_DIR/attacks.json`` (``{"protocol", "source", "rounds", "findings": [...], "skipped":
[...]}``); ``--json`` prints the same object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError

__all__ = ["ATTACKS_JSON", "attack_run_dir", "register"]

ATTACKS_JSON = "attacks.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg attack run-dir`` (``secagg attack RUN_DIR`` is rewritten to it by the CLI)."""
    from experiments.cli.cmd_run import add_plugin_argument

    p = subparsers.add_parser(
        "run-dir",
        help="every registered attack on a run directory's recorded views (or a replay); "
        "also 'secagg attack RUN_DIR'",
        description="Run every registered attack that applies to RUN_DIR's protocol (a plugin's too) on what its "
        "servers saw: the views recorded by 'secagg run --record-views', or, without them, the first rounds "
        "replayed from the run's configuration, data and seed. Each attack is scored against the run's training "
        "data beside a random and a public guess (advantage 0 = the stronger baseline, 1 = perfect), with a 95% "
        "interval. Writes RUN_DIR/attacks.json (docs/attacks.md).",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--attack", metavar="NAME", help="only this attack (default: every one that applies)")
    p.add_argument("--rounds", type=int, default=None, metavar="K",
                   help="without recorded views: rounds replayed for the view (default 1)")
    add_plugin_argument(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    p.set_defaults(func=_main)


def _usable(a: Any) -> bool:
    return (a.infer is not None and a.assess is not None) or a.score is not None


def _choose(protocol: str, name: str | None) -> tuple[list[Any], list[dict[str, str]]]:
    """The attacks to run, and those registered for the protocol that cannot run on a run directory."""
    from attacks.registry import attacks_for, get_attack

    if name is not None:
        try:
            spec = get_attack(protocol, name)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if not _usable(spec):
            raise UserError(f"attack {name!r} on {protocol!r} registers no infer/assess (nor score), so it cannot run "
                            f"on a run directory yet; its own study is secagg attack {protocol} (secagg attack --help)")
        return [spec], []
    registered = attacks_for(protocol)
    if not registered:
        raise UserError(f"no attack is registered for protocol {protocol!r}; a plugin can add one (docs/plugins.md)")
    not_yet = [{"attack": a.name, "role": a.view, "reason": "registers no infer/assess for a run directory yet; its "
                f"own study: secagg attack {protocol}"} for a in registered if not _usable(a)]
    return [a for a in registered if _usable(a)], not_yet


def _replay_matches(rd: Any, transcript: Any, rounds: int) -> bool | None:
    """Whether the replayed rounds sent the bytes transcript.csv recorded (``None``: nothing to compare)."""
    path = rd.file("transcript.csv")
    if not path.is_file():
        return None
    recorded: dict[tuple[int, str], tuple[int, int]] = {}
    for line in path.read_text(encoding="utf-8").splitlines()[1:]:
        parts = line.split(",")
        if len(parts) == 4 and parts[0].isdigit() and int(parts[0]) < rounds:
            recorded[(int(parts[0]), parts[1])] = (int(parts[2]), int(parts[3]))
    if not recorded:
        return None
    replayed = {(r, party): (b["sent"], b["received"]) for r in range(rounds)
                for party, b in transcript.bytes_by_party(r).items()}
    return replayed == recorded


def _replay(rd: Any, config: Any, rounds: int) -> tuple[Any, bool | None]:
    """The first ``rounds`` rounds replayed with every payload kept, as :class:`RecordedViews`."""
    from experiments.run.prepare import prepare_data
    from experiments.run.views import RecordedViews
    from protocols.guard import set_device_policy
    from protocols.registry import BuildContext
    from protocols.transport import InProcessTransport, Transcript

    spec = config.spec
    from experiments.run.canaries import for_run

    prep = for_run(prepare_data(config), config, rd.path)[0]  # the run's canaries (their recorded coins), if any
    transport = InProcessTransport(Transcript(keep_payloads=True))
    trainer = spec.build(BuildContext(split=prep.split, config=config.protocol_config, seed=config.run.seed,
                                      source=config.data.source, transport=transport,
                                      data_options=config.to_dict()["data"], exclude=prep.exclude))
    set_device_policy(trainer, config.clients.policy())
    for _ in range(rounds):
        trainer.run_round()
    out = RecordedViews(spec.name, tuple(spec.adversaries), 1, list(range(rounds)))
    for role in out.roles:
        out.views[role] = [r for r in transport.transcript.records if role in (r.sender, r.receiver)]
    public = dict(trainer.public_info())
    out.public = {r: public for r in out.rounds}
    return out, _replay_matches(rd, transport.transcript, rounds)


def _legacy_finding(spec: Any, score: dict[str, Any], rounds: list[int]) -> Any:
    """A plugin's ``score`` dict (f1 beside random_f1) as a finding: no public baseline, no interval."""
    from attacks.findings import Finding, normalised_advantage

    missing = [k for k in ("f1", "precision", "recall", "random_f1", "status") if k not in score]
    if missing:
        raise UserError(f"attack {spec.name!r}'s scorer returned no {', '.join(missing)}; it must return the common "
                        "keys f1, precision, recall, random_f1 and status (docs/plugins.md)")
    value, rnd = float(score["f1"]), float(score["random_f1"])
    adv = normalised_advantage(value, rnd, rnd, higher_is_better=True)
    extra = {k: v for k, v in score.items() if k not in ("f1", "random_f1", "status")}
    return Finding(spec.name, spec.view, "rated items", "f1", True, value, rnd, None, adv, None, None, tuple(rounds),
                   str(score["status"]), int(score.get("users", 0) or 0), extra)


def attack_run_dir(run_dir: Path, attack: str | None = None, rounds: int | None = None, *,
                   write: bool = True) -> dict[str, Any]:
    """Attack ``run_dir`` (see the module docstring); the JSON-ready result, also written to attacks.json."""
    from attacks.findings import NotApplicable, Truth
    from experiments.run import config as cfgmod
    from experiments.cli.cmd_run import _import_run_plugins
    from experiments.run.rundir import RunDir, atomic_write_text
    from experiments.run.training import verify_resume
    from experiments.run.views import has_views, load_views

    if rounds is not None and rounds < 1:
        raise UserError(f"--rounds must be >= 1; found {rounds}")
    rd = RunDir.open_existing(run_dir)
    _import_run_plugins(rd)
    config = cfgmod.load_config_file(rd.file("config.toml"))
    spec = config.spec
    if not spec.federated:
        raise UserError(f"{run_dir} ran {spec.name!r}, which has no parties and so no adversary's view")
    chosen, skipped = _choose(spec.name, attack)
    verify_resume(rd, config)  # the same configuration and data files as the run, or a refusal in words
    recorded = has_views(rd.path)
    if recorded:
        if rounds is not None:
            raise UserError("--rounds sets the replayed rounds; this run recorded its views, and every recorded round "
                            "is read")
        views, matches = load_views(rd.path), None
        if views.protocol != spec.name:
            raise UserError(f"{rd.path}/views records protocol {views.protocol!r}; the run is {spec.name!r}")
        if not views.rounds:
            raise UserError(f"{rd.path}/views holds no recorded round (the run stopped before its first round ended)")
    else:
        views, matches = _replay(rd, config, rounds or 1)
    public = views.last_public()

    # 1. inference: views and public info only
    inferred: list[tuple[Any, Any]] = []
    for a in chosen:
        view = views.view(a.view)
        try:
            if a.infer is not None and a.assess is not None:
                inferred.append((a, a.infer(view, public)))
            else:  # a plugin's run + score: the records its party received, as before
                inferred.append((a, a.run([r for r in view if r.receiver == a.view], public)))
        except NotApplicable as exc:
            skipped.append({"attack": a.name, "role": a.view, "reason": str(exc)})

    # 2. scoring against the run's training data
    findings: list[dict[str, Any]] = []
    if inferred:
        from experiments.run.prepare import prepare_data

        from experiments.run.canaries import for_run

        train = for_run(prepare_data(config), config, rd.path)[0].split.train  # (with the run's canaries, if any)
        truth = Truth.from_interactions(train)
        for a, inf in inferred:
            if a.infer is not None and a.assess is not None:
                rows = a.assess(inf, truth, public)
            else:
                rows = [_legacy_finding(a, dict(a.score(inf, train, public)), views.rounds)]
            # an attack that reads every round of its view leaves rounds empty: they are the view's
            findings += [(f if f.rounds else replace(f, rounds=tuple(views.rounds))).to_dict() for f in rows]
    out = {"run_dir": str(run_dir), "protocol": spec.name,
           "source": "recorded views" if recorded else f"replay of {len(views.rounds)} round(s)",
           "rounds": list(views.rounds), "replay_matches_run": matches,
           "findings": findings, "skipped": skipped}
    out = jsonio.strict(out)
    if write:
        atomic_write_text(rd.file(ATTACKS_JSON), jsonio.dumps(out, indent=1, sort_keys=True) + "\n")
    return out


def _fmt(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _main(args: argparse.Namespace) -> int:
    out = attack_run_dir(args.run_dir, args.attack, args.rounds)
    source = out["source"]
    if out["replay_matches_run"] is True:
        source += " (the run's own view: the replay sent the bytes transcript.csv recorded)"
    elif out["replay_matches_run"] is False:
        source += " (its bytes differ from transcript.csv: DP noise or a changed protocol)"
    print(f"{out['protocol']}: {len(out['findings'])} finding(s) from {source}, rounds {out['rounds']}")
    print(f"{'attack':<22}{'role':<8}{'target':<20}{'metric':<10}{'value':>8}{'random':>8}{'public':>8}"
          f"{'advantage':>11}  95% interval of the advantage")
    for f in out["findings"]:
        iv = f["advantage_interval"]
        print(f"{f['attack']:<22}{f['role']:<8}{f['target']:<20}{f['metric']:<10}{_fmt(f['value']):>8}"
              f"{_fmt(f['random']):>8}{_fmt(f['public']):>8}{_fmt(f['advantage']):>11}  "
              f"{'-' if iv is None else f'[{iv[0]:.3f}, {iv[1]:.3f}]'}  {f['status']}")
    for s in out["skipped"]:
        print(f"skipped {s['attack']}: {s['reason']}")
    print(f"wrote {Path(args.run_dir) / ATTACKS_JSON}")
    if args.json:
        print(jsonio.dumps(out, sort_keys=True))
    return 0
