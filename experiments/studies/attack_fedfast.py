"""``secagg attack fedfast``: train FedFast, infer interactions from the server's view of ``I_k``.

``secagg attack fedfast --defense none|secagg [--data PATH] [--rounds N] [--clients-per-round M]
[--clusters P] [--json]``

Default data: synthetic, 100 users x 200 items. ``--defense secagg`` runs the ``fedfast-secagg``
variant (SecAgg+). ``--json`` prints one object (last line of stdout) with ``"attack"``: ``f1``,
``precision``, ``recall``, ``random_f1``, ``random_precision``, ``random_recall``, ``status``,
``users``, ``changed_set_f1`` (guessing all of ``I_k``; ``null`` when the view has no plaintext) and
``magnitude_f1`` (the same attack ranking rows by ``|delta|`` instead of direction).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from experiments import jsonio
from experiments.studies.attack_data import add_data_arguments, load_attack_data
from experiments.errors import UserError

__all__ = ["register", "run_attack"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg attack fedfast``."""
    p = subparsers.add_parser(
        "fedfast",
        help="interaction inference from the changed item rows I_k against FedFast",
        description="Train FedFast (plaintext or through SecAgg+), infer each sampled client's training "
        "positives from the server's view of its changed item rows and their magnitudes, and score them "
        "against the truth beside random guessing.",
    )
    p.add_argument("--defense", choices=("none", "secagg"), default="none",
                   help="none: plaintext FedFast; secagg: fedfast-secagg (SecAgg+)")
    add_data_arguments(p, users=100, items=200)
    p.add_argument("--rounds", type=int, default=3, help="training rounds attacked (default 3)")
    p.add_argument("--clients-per-round", type=int, default=20, help="delegates per round (default 20)")
    p.add_argument("--clusters", type=int, default=5, help="k-means clusters p (default 5)")
    p.add_argument("--dim", type=int, default=10, help="embedding size (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def _load(args: argparse.Namespace) -> Any:
    return load_attack_data(args, min_users=4, min_items=10, items_per_interaction=8)


def run_attack(args: argparse.Namespace, data: Any) -> dict[str, Any]:
    """Train FedFast for ``args.rounds`` rounds and attack every round of the server's view."""
    from attacks.fedfast import changed_set_score, ik_attack, score, server_view
    from protocols.fedfast import FedFastConfig, FedFastGMF
    from protocols.transport import SERVER, InProcessTransport, Transcript

    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1; found {args.rounds}.")
    if args.clients_per_round < 1:
        raise UserError(f"--clients-per-round must be >= 1; found {args.clients_per_round}.")
    try:
        cfg = FedFastConfig(
            dim=args.dim, clients_per_round=args.clients_per_round, clusters=args.clusters,
            secure_aggregation="secagg+" if args.defense == "secagg" else "none",
        )
    except ValueError as exc:  # e.g. fedfast.clusters: name the flag
        raise UserError(str(exc).replace("fedfast.", "--").replace("_", "-")) from exc
    keep = lambda r: r.receiver == SERVER and r.kind == "update"  # noqa: E731
    model = FedFastGMF(data, cfg, seed=args.seed, transport=InProcessTransport(Transcript(keep_payloads=keep)))
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        model.run_round()
    train_s = time.perf_counter() - t0
    pub = model.public_info()
    inferred = ik_attack(server_view(model.transport.transcript), pub)
    truth = {int(u): data.items[data.users == u] for u in inferred}
    sc = score(inferred, truth, data.n_items).to_dict()
    cs = changed_set_score(inferred, truth, data.n_items)
    magnitude = score(ik_attack(server_view(model.transport.transcript), pub, method="magnitude"), truth, data.n_items)
    sc.update(status=inferred.status, changed_set_f1=None if cs is None else cs.f1,
              changed_set_precision=None if cs is None else cs.precision, magnitude_f1=magnitude.f1)
    return {
        "defense": args.defense, "protocol": "fedfast" if args.defense == "none" else "fedfast-secagg",
        "attack_name": "fedfast-ik", "attack": sc, "data": data.source, "users": int(data.n_users),
        "items": int(data.n_items), "rounds": args.rounds, "clients_per_round": cfg.clients_per_round,
        "train_negatives": cfg.train_negatives, "train_seconds": train_s,
    }


def _main(args: argparse.Namespace) -> int:
    out = run_attack(args, _load(args))
    a = out["attack"]
    print(f"FedFast / {out['defense']}: attack {out['attack_name']} on {a['users']} sampled clients: {a['status']}")
    print(f"  F1 {a['f1']:.3f} (random {a['random_f1']:.3f})  precision {a['precision']:.3f}  recall {a['recall']:.3f}")
    print(f"  ranking by |delta| instead: F1 {a['magnitude_f1']:.3f}")
    if a["changed_set_f1"] is not None:
        print(f"  guessing all of I_k: F1 {a['changed_set_f1']:.3f}")
    if args.json:
        print(jsonio.dumps(out, default=str))
    return 0
