"""``secagg attack run-dir``: run a registered attack on the view of a run directory's protocol.

``secagg attack run-dir RUN_DIR [--attack NAME] [--rounds K] [--plugin MODULE] [--json]``

Any protocol, a plugin's included, with an attack that registers a ``score``
(:class:`attacks.registry.AttackSpec`): the run's configuration and data (checked against
``run.json`` as ``--resume`` checks them; its plugin modules imported again), the protocol rebuilt
from them with a transcript that keeps payloads, its first ``K`` rounds (default 1) replayed from the
run's seed, the adversary's view (what the attack's party received) handed to the attack with the
protocol's ``public_info()``, and the inferences scored against the run's training data beside the
random-guess baseline. Nothing in RUN_DIR is written.

Why replayed and not read back: a run directory keeps the bytes of each message
(``transcript.csv``), never the payloads. Without DP noise a run is reproducible from its seed, so
the replay is the view the run's server had (``replay_matches_run`` compares the replayed bytes per
party with ``transcript.csv``); with DP noise the replay draws fresh noise of the same distribution.
``--json`` prints one object (last line of stdout) with the common ``attack`` shape (``f1``,
``precision``, ``recall``, ``random_f1``, ``status``) and the attack's own keys.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError

__all__ = ["attack_run_dir", "register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg attack run-dir``."""
    from experiments.cmd_run import add_plugin_argument

    p = subparsers.add_parser(
        "run-dir",
        help="any registered attack (a plugin's too) on the view of a run directory's protocol",
        description="Rebuild the protocol of RUN_DIR from its configuration and data, replay its first rounds "
        "from its seed keeping the messages, run a registered attack on its adversary's view and score it "
        "against the run's training data beside random guessing. Works for every protocol with an attack that "
        "registers a scorer, including those of plugins (docs/plugins.md). Nothing in RUN_DIR is written.",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--attack", metavar="NAME", help="the attack (default: the protocol's only scored attack)")
    p.add_argument("--rounds", type=int, default=1, metavar="K", help="rounds replayed for the view (default 1)")
    add_plugin_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def _choose(protocol: str, name: str | None) -> Any:
    from attacks.registry import attacks_for, get_attack

    if name is not None:
        spec = get_attack(protocol, name)
        if spec.score is None:
            raise UserError(f"attack {name!r} on {protocol!r} registers no scorer, so it cannot run on a run directory; "
                            f"its own study is secagg attack {protocol} (secagg attack --help)")
        return spec
    scored = [a for a in attacks_for(protocol) if a.score is not None]
    if len(scored) == 1:
        return scored[0]
    if not scored:
        others = ", ".join(a.name for a in attacks_for(protocol)) or "none"
        raise UserError(f"no attack with a scorer is registered for protocol {protocol!r} (registered: {others}); "
                        "a plugin can add one (docs/plugins.md)")
    raise UserError(f"protocol {protocol!r} has several scored attacks: {', '.join(a.name for a in scored)}; "
                    "pick one with --attack")


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


def attack_run_dir(run_dir: Path, attack: str | None = None, rounds: int = 1) -> dict[str, Any]:
    """Attack the view of ``run_dir``'s protocol (see the module docstring); a JSON-ready dict."""
    from experiments import config as cfgmod
    from experiments.cmd_run import _import_run_plugins
    from experiments.prepare import prepare_data
    from experiments.rundir import RunDir
    from experiments.training import verify_resume
    from protocols.guard import set_device_policy
    from protocols.registry import BuildContext
    from protocols.transport import InProcessTransport, Transcript

    if rounds < 1:
        raise UserError(f"--rounds must be >= 1; found {rounds}")
    rd = RunDir.open_existing(run_dir)
    _import_run_plugins(rd)
    config = cfgmod.load_config_file(rd.file("config.toml"))
    spec = config.spec
    if not spec.federated:
        raise UserError(f"{run_dir} ran {spec.name!r}, which has no parties and so no adversary's view")
    chosen = _choose(spec.name, attack)
    verify_resume(rd, config)  # the same configuration and data files as the run, or a refusal in words
    prep = prepare_data(config)
    transport = InProcessTransport(Transcript(keep_payloads=True))
    trainer = spec.build(BuildContext(split=prep.split, config=config.protocol_config, seed=config.run.seed,
                                      source=config.data.source, transport=transport,
                                      data_options=config.to_dict()["data"], exclude=prep.exclude))
    set_device_policy(trainer, config.clients.policy())
    for _ in range(rounds):
        trainer.run_round()
    public = trainer.public_info()
    view = transport.transcript.view(chosen.view)
    inferences = chosen.run(view, public)
    score = dict(chosen.score(inferences, prep.split.train, public))
    missing = [k for k in ("f1", "precision", "recall", "random_f1", "status") if k not in score]
    if missing:
        raise UserError(f"attack {chosen.name!r}'s scorer returned no {', '.join(missing)}; it must return the common "
                        "keys f1, precision, recall, random_f1 and status (docs/plugins.md)")
    return {"run_dir": str(run_dir), "protocol": spec.name, "attack_name": chosen.name, "view": chosen.view,
            "summary": chosen.summary, "rounds_replayed": rounds, "messages_in_view": len(view),
            "replay_matches_run": _replay_matches(rd, transport.transcript, rounds), "attack": score}


def _main(args: argparse.Namespace) -> int:
    out = attack_run_dir(args.run_dir, args.attack, args.rounds)
    a = out["attack"]
    match = {True: "the run's own view (the replay sent the bytes transcript.csv recorded)",
             False: "a replay whose bytes differ from transcript.csv (DP noise or a changed protocol)",
             None: "a replay (no transcript.csv to compare)"}[out["replay_matches_run"]]
    print(f"{out['protocol']} / attack {out['attack_name']} on the {out['view']}'s view of {out['rounds_replayed']} "
          f"round(s), {out['messages_in_view']} messages; {match}: {a['status']}")
    print(f"  F1 {a['f1']:.3f} (random {a['random_f1']:.3f})  precision {a['precision']:.3f}  recall {a['recall']:.3f}")
    if args.json:
        print(jsonio.dumps(out, default=str))
    return 0
