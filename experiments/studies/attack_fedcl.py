"""``secagg attack fedcl``: train FedCL at an LDP epsilon, attack the server's embedding uploads.

``secagg attack fedcl --epsilon E [--uploads K] [--k 10] [--data PATH] [--rounds R] [--json]
[--sweep OUT_DIR]``

Every client takes part in every round (``clients_per_round`` = all users, ``upload_every`` 1), so
after ``R >= K`` rounds each user has uploaded ``R`` noisy embeddings. The attack
(:mod:`attacks.fedcl`) averages each user's last ``K`` uploads, ranks all items against the
server's final item table and guesses the top ``k``; it is scored as precision@k against the
user's training items, beside a random guess and beside the same ranking from the noise-free
embedding of the final model. ``--json`` prints one object (last line of stdout) with
``attack.{precision_at_k, precision, recall, f1, random_precision, random_f1, noise_free_precision,
status}`` and ``privacy`` (the composed epsilon of the K uploads used and of all R uploads, basic
and the tightest of pure/RDP/PLD at delta 1e-5). ``--sweep OUT_DIR`` runs epsilon in
:data:`SWEEP_EPSILONS` (one training each, K in :data:`SWEEP_UPLOADS` from the same transcript)
and writes ``sweep.csv``, ``sweep.md`` and ``sweep.png``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.studies.attack_data import add_data_arguments, load_attack_data
from experiments.errors import UserError

__all__ = ["SWEEP_EPSILONS", "SWEEP_UPLOADS", "register", "run_fedcl_attack"]

SWEEP_EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
SWEEP_UPLOADS = (1, 4, 16)
LDP_DELTA = 1e-5


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``secagg attack fedcl``."""
    p = sub.add_parser(
        "fedcl", help="infer users' items from FedCL's LDP embedding uploads",
        description="Train FedCL at an LDP epsilon; the server ranks items against each user's averaged noisy "
        "embeddings; report precision@k beside random and the noise-free embedding, with the composed epsilon.",
    )
    p.add_argument("--epsilon", type=float, default=4.0, help="LDP epsilon per upload (default 4, the paper's)")
    p.add_argument("--uploads", type=int, default=1, help="uploads per user the attack averages (default 1)")
    p.add_argument("--k", type=int, default=10, help="items guessed per user (default 10)")
    p.add_argument("--rounds", type=int, default=16, help="training rounds, every client in every round (default 16)")
    p.add_argument("--encoder", choices=("gru", "id"), default="gru")
    add_data_arguments(p, users=150, items=200)
    p.add_argument("--dim", type=int, default=32, help="embedding size (default 32)")
    p.add_argument("--lr", type=float, default=0.02, help="server Adam learning rate (default 0.02)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--sweep", type=Path, default=None, metavar="OUT_DIR", help="epsilon x uploads sweep; CSV, Markdown, PNG")
    p.set_defaults(func=_main)


def _split(args: argparse.Namespace) -> Any:
    from recmodels.splits import leave_one_out

    return leave_one_out(load_attack_data(args, items_per_interaction=8), seed=args.seed)


def _check(args: argparse.Namespace) -> None:
    if not (args.epsilon > 0 and math.isfinite(args.epsilon)):
        raise UserError(f"--epsilon must be a positive number; found {args.epsilon}.")
    for name in ("uploads", "k", "rounds", "dim"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1; found {getattr(args, name)}.")
    if args.uploads > args.rounds:
        raise UserError(f"--uploads {args.uploads} needs --rounds >= {args.uploads} (one upload per user per round).")


def _privacy(epsilon: float, count: int) -> dict[str, Any]:
    from dp.events import Laplace
    from dp.ldp import ldp_repeated_uploads

    rep = ldp_repeated_uploads(Laplace.from_epsilon(epsilon), count, delta=LDP_DELTA)
    return {"uploads": count, "epsilon_basic": epsilon * count,
            "epsilon": min(rep.epsilon, epsilon * count), "accountant": rep.accountant, "delta": LDP_DELTA}


def _train(args: argparse.Namespace, split: Any, epsilon: float) -> Any:
    import numpy as np
    import torch

    from protocols.fedcl import FedCL, FedCLConfig
    from protocols.transport import SERVER, InProcessTransport, Transcript

    n = int((np.bincount(split.train.users, minlength=split.train.n_users) > 0).sum())
    cfg = FedCLConfig(encoder=args.encoder, dim=args.dim, max_len=20, clients_per_round=n, lr=args.lr, epsilon=epsilon,
                      clusters=min(25, max(2, n // 8)), secure_aggregation="none", initial_upload=True)
    keep = lambda r: r.receiver == SERVER and r.kind == "embedding"  # noqa: E731
    torch.manual_seed(args.seed)
    model = FedCL(split.train, cfg, seed=args.seed, transport=InProcessTransport(Transcript(keep_payloads=keep)))
    for _ in range(args.rounds):
        model.run_round()
    return model


def _attack(model: Any, split: Any, uploads: int, k: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from attacks.fedcl import embedding_topk_attack, score, server_view, topk_items
    from attacks.scoring import score_sets

    train = split.train
    truth = {u: train.items[train.users == u] for u in range(train.n_users)}
    item = model.model.item.detach().double().numpy()
    pub = model.public_info()
    res = embedding_topk_attack(server_view(model.transport.transcript), pub, item_table=item, k=k, uploads=uploads)
    sc = score(res, truth, train.n_items)
    users = np.array(sorted(res.inferred))
    with torch.no_grad():
        clean = model.user_embeddings(users).double().numpy()
    top = topk_items(clean, item, k)
    clean_sc = score_sets({int(u): top[i] for i, u in enumerate(users)}, {int(u): truth[int(u)] for u in users}, train.n_items)
    ratio = sc.precision / max(sc.random_precision, 1e-12)
    status = (f"precision@{k} {sc.precision:.3f} is {ratio:.1f}x random ({sc.random_precision:.3f}); "
              f"noise-free {clean_sc.precision:.3f}")
    return {**sc.to_dict(), "precision_at_k": sc.precision, "k": k, "noise_free_precision": clean_sc.precision,
            "uploads_used": float(np.mean(list(res.uploads_used.values()))), "status": status}


def run_fedcl_attack(args: argparse.Namespace, split: Any, epsilon: float, uploads_list: tuple[int, ...]) -> list[dict[str, Any]]:
    """Train once at ``epsilon`` and attack with each number of uploads; JSON-ready rows."""
    model = _train(args, split, epsilon)
    from recmodels.metrics import evaluate_full

    hr = evaluate_full(model.score_all, split, ks=(10,))["HR@10"]
    return [{"epsilon": epsilon, "uploads": u, "attack": _attack(model, split, u, args.k),
             "privacy": {"attacked_uploads": _privacy(epsilon, u), "all_uploads": _privacy(epsilon, int(model.uploads.max()))},
             "model_hr10_full": hr, "rounds": args.rounds, "users": split.train.n_users, "items": split.train.n_items,
             "data": split.train.source} for u in uploads_list]


def _main(args: argparse.Namespace) -> int:
    _check(args)
    split = _split(args)
    if args.sweep is not None:
        return _sweep(args, split)
    (out,) = run_fedcl_attack(args, split, args.epsilon, (args.uploads,))
    a, pv = out["attack"], out["privacy"]["attacked_uploads"]
    print(f"FedCL ({args.encoder}) at epsilon {args.epsilon:g} per upload; model HR@10 (full ranking) {out['model_hr10_full']:.3f}")
    print(f"attack fedcl-embedding-topk on {args.uploads} upload(s) per user: {a['status']}")
    print(f"  composed epsilon of those uploads: {pv['epsilon']:.3f} ({pv['accountant']}, delta {LDP_DELTA:g}); "
          f"basic {pv['epsilon_basic']:g}")
    if args.json:
        print(jsonio.dumps(out))
    return 0


def _sweep(args: argparse.Namespace, split: Any) -> int:
    out_dir: Path = args.sweep
    out_dir.mkdir(parents=True, exist_ok=True)
    uploads = tuple(u for u in SWEEP_UPLOADS if u <= args.rounds)
    rows = []
    for eps in SWEEP_EPSILONS:
        print(f"sweep: epsilon {eps:g}", file=sys.stderr)
        for r in run_fedcl_attack(args, split, eps, uploads):
            rows.append({"epsilon": eps, "uploads": r["uploads"], "precision_at_k": r["attack"]["precision_at_k"],
                         "random_precision": r["attack"]["random_precision"],
                         "noise_free_precision": r["attack"]["noise_free_precision"],
                         "epsilon_composed": r["privacy"]["attacked_uploads"]["epsilon"],
                         "epsilon_basic": r["privacy"]["attacked_uploads"]["epsilon_basic"],
                         "model_hr10_full": r["model_hr10_full"]})
    with open(out_dir / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [f"| epsilon/upload | uploads | precision@{args.k} | random | noise-free | composed epsilon (delta {LDP_DELTA:g}) "
             "| model HR@10 |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['epsilon']:g} | {r['uploads']} | {r['precision_at_k']:.3f} | {r['random_precision']:.3f} | "
              f"{r['noise_free_precision']:.3f} | {r['epsilon_composed']:.2f} | {r['model_hr10_full']:.3f} |" for r in rows]
    (out_dir / "sweep.md").write_text("\n".join(lines) + "\n")
    _plot(rows, uploads, args.k, out_dir / "sweep.png")
    print("\n".join(lines))
    if args.json:
        print(jsonio.dumps({"rows": rows, "out_dir": str(out_dir)}))
    return 0


def _plot(rows: list[dict[str, Any]], uploads: tuple[int, ...], k: int, path: Path) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for u in uploads:
        sel = [r for r in rows if r["uploads"] == u]
        ax.plot([r["epsilon"] for r in sel], [r["precision_at_k"] for r in sel], "o-", label=f"attack, {u} upload(s)")
    eps = sorted({r["epsilon"] for r in rows})
    ax.plot(eps, [np.mean([r["noise_free_precision"] for r in rows if r["epsilon"] == e]) for e in eps], "k--",
            label="noise-free embedding")
    ax.plot(eps, [rows[0]["random_precision"]] * len(eps), "k:", label="random guess")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon per upload")
    ax.set_ylabel(f"precision@{k} of the user's items")
    ax.set_title("FedCL: what the server infers from LDP user embeddings")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
