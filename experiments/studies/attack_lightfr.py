"""``secagg attack lightfr``: train LightFR one round, attack the server's view of it, report both.

``secagg attack lightfr --defense none|para|secagg|dpf [--data PATH] [--bits F] [--json]``

``none``: the paper's plaintext Agg_grad upload; ``para``: plaintext Agg_para (sign-vote codes);
``secagg``: Agg_grad uploads through SecAgg+ (the rated union, then its rows); ``dpf``: Agg_grad
rows through two non-colluding servers' DPF sum (docs/dpf.md), attacked on the first server's view
(the key sets it received). Default data: synthetic,
100 users x 200 items. ``--json`` prints one object (last line of stdout) with the same
``attack`` shape as ``secagg attack fedmf`` (``f1``, ``precision``, ``recall``, ``rating_rmse``,
``exact_match``, ``random_*``, ``status``) plus ``code_agreement`` and ``random_code_agreement``.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from experiments import jsonio
from experiments.studies.attack_data import add_data_arguments, load_attack_data
from experiments.errors import UserError

if TYPE_CHECKING:  # numpy is imported where used, so that --help stays fast
    import numpy as np

__all__ = ["register", "run_attack"]

DEFENSES = {"none": ("grad", "none"), "para": ("para", "none"), "secagg": ("grad", "secagg+"),
            "dpf": ("grad", "dpf")}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lightfr",
        help="one-upload rating leak against LightFR under a defense",
        description="Train LightFR for one round, invert the uploads the server received (notes §1.3), "
        "score code, rated set and ratings beside random guessing.",
    )
    p.add_argument("--defense", choices=tuple(DEFENSES), default="none")
    add_data_arguments(p, users=100, items=200)
    p.add_argument("--bits", type=int, default=64, help="code length f (default 64)")
    p.add_argument("--fraction", type=float, default=0.6, help="clients per round p (default 0.6)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def _load(args: argparse.Namespace) -> Any:
    return load_attack_data(args)


def run_attack(args: argparse.Namespace, data: Any, defense: str) -> dict[str, Any]:
    """Train one round under ``defense`` and attack it; a JSON-ready dict."""
    import numpy as np

    from attacks.lightfr import code_agreement, exact_up_to_reflection, one_upload_attack, score, server_view
    from protocols.lightfr import LightFR, LightFRConfig
    from protocols.transport import SERVER, InProcessTransport, Transcript

    if not 1 <= args.bits <= 4096:
        raise UserError(f"--bits must be in 1..4096; found {args.bits}.")
    if not 0 < args.fraction <= 1:
        raise UserError(f"--fraction must be in (0, 1]; found {args.fraction}.")
    server, secure = DEFENSES[defense]
    cfg = LightFRConfig(bits=args.bits, server=server, secure_aggregation=secure, client_fraction=args.fraction)
    keep = lambda r: r.round == 0 and (r.receiver == SERVER or r.sender == SERVER)  # noqa: E731
    model = LightFR(data, cfg, seed=args.seed, transport=InProcessTransport(Transcript(keep_payloads=keep)))
    t0 = time.perf_counter()
    model.run_round()
    train_s = time.perf_counter() - t0
    pub = model.public_info()
    result, codes = one_upload_attack(server_view(model.transport.transcript), pub, round=0)
    attacked = {inf.user for inf in result.users}
    truth_items, truth_ratings = [], []
    for u in range(model.n_users):
        idx = np.flatnonzero(model.users == u) if u in attacked else np.zeros(0, dtype=np.int64)
        truth_items.append(model.items[idx])
        truth_ratings.append(model.raw[idx])
    sc = score(result, truth_items, truth_ratings, model.n_items, pub["rating_scale"])
    rng = np.random.default_rng([args.seed, 99])
    rand_codes = {u: bc_random(rng, model.f) for u in attacked}
    return {
        "defense": defense, "server": server, "secure_aggregation": secure,
        "attack": {**sc.to_dict(), "exact_match_up_to_reflection": exact_up_to_reflection(
                       result, truth_items, truth_ratings, pub["rating_scale"]),
                   "code_agreement": code_agreement(codes, model.b),
                   "random_code_agreement": code_agreement(rand_codes, model.b)},
        "data": data.source, "users": model.n_users, "items": model.n_items, "bits": model.f,
        "attacked_users": len(attacked), "train_seconds": train_s,
    }


def bc_random(rng: np.random.Generator, f: int) -> np.ndarray:
    import numpy as np

    return np.where(rng.random(f) < 0.5, -1.0, 1.0)


def _main(args: argparse.Namespace) -> int:
    out = run_attack(args, _load(args), args.defense)
    a = out["attack"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"LightFR {out['server']} / {out['secure_aggregation']}: attacked {out['attacked_users']} uploads of round 0")
    print(f"attack lightfr-one-upload: {a['status']}")
    print(f"  rated-set F1 {a['f1']:.3f} (random {a['random_f1']:.3f})")
    print(f"  ratings exact {fmt(a['exact_match'])} (random {a['random_exact_match']:.3f}), "
          f"RMSE {fmt(a['rating_rmse'])} (random {a['random_rating_rmse']:.3f}); "
          f"exact up to the r <-> 1-r reflection {fmt(a['exact_match_up_to_reflection'])}")
    print(f"  code bits up to sign {fmt(a['code_agreement'])} (random {fmt(a['random_code_agreement'])})")
    if args.json:
        print(jsonio.dumps(out))
    return 0
