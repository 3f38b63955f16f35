"""``secagg attack fedcl``: a FedCL run at an LDP epsilon, attacked from its directory; or a sweep.

``secagg attack fedcl --epsilon E [--data PATH] [--rounds R] [--encoder gru|id] [--dim D] [--lr L]
[--out DIR] [--json]`` / ``secagg attack fedcl --sweep OUT_DIR [--uploads K] [--k 10] ...``

Single point: a thin wrapper (:mod:`experiments.studies.attack_wrap`). ``secagg run`` of the
``fedcl`` preset under the attack matrix's LDP cell (``ldp-eps4``) with ``[fedcl] epsilon = E``, every
client in every round (``clients_per_round`` = all users, ``upload_every`` 1, ``initial_upload``),
``max_len`` 20, ``clusters`` ``min(25, max(2, users // 8))``, ``--encoder``/``--dim``/``--lr`` ->
``encoder``/``dim``/``lr``, ``--rounds`` -> ``[run] rounds`` (default 16), ``--users``/``--items`` ->
the synthetic size (default 150 x 200); views recorded, then ``secagg attack RUN_DIR``: the
``fedcl-embedding-topk`` attack averages each user's uploads (one per round, so ``R``), ranks all
items against the item table the server last sent and guesses the top 10, scored as precision@10
against the user's training items beside a random and a public guess. ``--json`` prints one
object (last line of stdout): ``findings`` (common schema), ``attack`` (that finding; ``extra``:
``uploads_per_user``) and ``privacy`` (the composed epsilon of those uploads, basic and the
tightest of pure/RDP/PLD at delta 1e-5). ``--uploads`` and ``--k`` have no configuration key: the
attack on a run averages every upload and guesses 10 items, so in a single point they are ignored
with a deprecation line (averaging ``K`` uploads is ``--rounds K``).

``--sweep OUT_DIR`` keeps its own training (one per epsilon in :data:`SWEEP_EPSILONS`), because it
measures what a run directory cannot express: the attack on the last ``K`` uploads for each ``K`` in
:data:`SWEEP_UPLOADS` from one transcript, beside the same ranking from the model's noise-free
user embeddings (private client state, never in a view). It writes ``sweep.csv``, ``sweep.md`` and
``sweep.png``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.studies.attack_data import load_attack_data
from experiments.errors import UserError
from experiments.studies.attack_wrap import add_run_arguments, print_result, run_and_attack

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
    p.add_argument("--uploads", type=int, default=None,
                   help="--sweep only: uploads per user the attack averages (default 1; deprecated in a single "
                   "point, where the attack averages all --rounds uploads)")
    p.add_argument("--k", type=int, default=None,
                   help="--sweep only: items guessed per user (default 10; deprecated in a single point: 10)")
    p.add_argument("--rounds", type=int, default=16,
                   help="[run] rounds, every client in every round, one upload each (default 16)")
    p.add_argument("--encoder", choices=("gru", "id"), default="gru", help="[fedcl] encoder (default gru)")
    add_run_arguments(p, users=150, items=200)
    p.add_argument("--dim", type=int, default=32, help="[fedcl] dim: embedding size (default 32)")
    p.add_argument("--lr", type=float, default=0.02, help="[fedcl] lr: server Adam learning rate (default 0.02)")
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


def run_attack(args: argparse.Namespace) -> dict[str, Any]:
    """One FedCL run at ``args.epsilon``, attacked from its run directory; a JSON-ready dict."""
    users = args.users if args.data is None else 10**6  # every client in every round (capped at the users)
    over = {"epsilon": args.epsilon, "encoder": args.encoder, "dim": args.dim, "lr": args.lr, "max_len": 20,
            "clients_per_round": users, "clusters": min(25, max(2, users // 8)), "upload_every": 1,
            "initial_upload": True, "secure_aggregation": "none"}
    args.defense = f"ldp-eps{args.epsilon:g}"  # names the run folder; the cell is the matrix's LDP cell
    out = run_and_attack(args, paper="fedcl", protocol="fedcl", cell="ldp-eps4", attack="fedcl-embedding-topk",
                         overrides=over, items_per_interaction=8)
    out["epsilon"] = args.epsilon
    out["privacy"] = {"attacked_uploads": _privacy(args.epsilon, args.rounds), "delta": LDP_DELTA}
    return out


def _main(args: argparse.Namespace) -> int:
    if args.sweep is None:
        for name in ("uploads", "k"):
            if getattr(args, name) is not None:
                print(f"secagg attack fedcl: --{name} is deprecated without --sweep and ignored: the attack on a "
                      "run averages every upload (one per round: --rounds) and guesses 10 items", file=sys.stderr)
    args.uploads = 1 if args.uploads is None else args.uploads
    args.k = 10 if args.k is None else args.k
    _check(args)
    if args.sweep is not None:
        return _sweep(args, _split(args))
    out = run_attack(args)
    print_result(out, f"FedCL ({args.encoder}) at epsilon {args.epsilon:g} per upload")
    pv = out["privacy"]["attacked_uploads"]
    print(f"composed epsilon of the {args.rounds} upload(s) per user: {pv['epsilon']:.3f} ({pv['accountant']}, "
          f"delta {LDP_DELTA:g}); basic {pv['epsilon_basic']:g}")
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
