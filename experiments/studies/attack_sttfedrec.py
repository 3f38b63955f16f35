"""``secagg attack sttfedrec``: a STTFedRec run attacked from its directory; chain collusion and sweeps.

``secagg attack sttfedrec --attack request-intersection|item-gradient|chain-collusion --defense DEFENSE
[--rounds R] [--rho P] [--clients K] [--data PATH] [--successors S] [--colluders C] [--json] [--sweep OUT_DIR]``

Defenses: ``request-intersection``: ``none`` (fresh decoys, the paper), ``fixed-pool`` (a
per-user popularity-matched decoy pool drawn once) or ``download-all`` (every sampled client
receives all ``M`` embeddings and sends no item id; its gradients are summed over all ``M`` ids);
``item-gradient``: ``none`` (each client's per-id rows in plaintext, the naive fix of notes G1),
``secagg`` (the per-id sum through SecAgg+, the protocol's default) or ``download-all``; both:
``dpf`` (RS and SAS as two non-colluding servers: the request by two-server PIR, the gradients by the
DPF sum, docs/dpf.md), attacked on RS's view and on SAS's view (``attack_sas``). The truth
a client is scored against is its clicks among the items it trained on (its request, or under
``download-all`` the ``T`` items it picked on the device), in the rounds it took part in. ``--json`` prints one object on the last line:
``attack.{f1, precision, recall, random_f1, status}`` plus ``requested_f1`` (guessing every
requested id) and the model's sampled HR@10 under the defense.

``request-intersection`` and ``item-gradient`` (no ``--sweep``) are a thin wrapper
(:mod:`experiments.studies.attack_wrap`): ``secagg run`` of the ``sttfedrec`` preset under the attack
matrix's cell, ``secagg+`` (the preset's SecAgg+ item sum, fresh decoys) or ``dpf`` (the
``sttfedrec-dpf`` preset), with ``--defense none`` for ``item-gradient`` -> ``[sttfedrec]
item_aggregation = "none"``, ``fixed-pool``/``download-all`` -> ``decoys``, and ``--rounds`` -> ``[run]
rounds``, ``--clients`` -> ``clients_per_round``, ``--rho`` -> ``rho``, ``--request-size`` ->
``request_size``, ``--users``/``--items`` -> the synthetic size, and the earlier command's small towers
(``hash_dim`` 256, ``dim`` 32; the preset's other keys as they are); views recorded, then ``secagg attack
RUN_DIR``, which runs both registered RS attacks. ``--json`` prints ``findings`` in the common schema
(precision of the inferred clicks against the client's training items, beside a random and a public
guess), ``attack`` (the ``--attack`` finding, ``null`` when its view holds nothing it reads: it is then
under ``skipped``) and ``bytes_per_client_per_round``. What the earlier command also printed and a
run directory does not give: ``requested_f1`` (guessing every requested id), the model's HR@10 (the
run does not evaluate) and ``attack_sas`` (no registered attack reads SAS's view); its truth was the
clicks among the items a client trained on in its rounds, the run attack's is its training items.

``chain-collusion`` keeps its own training: it needs the colluding clients' seeds, which no server
receives, so no recorded view holds it. ``--sweep`` keeps its own training too: it attacks the first
``r`` rounds of one training for several ``r`` and reports HR@10 beside each point.

``chain-collusion`` (SAS plus ring neighbours of a victim, on step 4's chain): trains ``R`` rounds
with ``chain_successors = S`` and attacks the last round's user-tower gradients. The chain runner
inside ``protocols.secure_sum`` keeps no view, so the CLI runs that round's chain aggregation
again on the same gradient vectors (the same encoding and ``secagg.chain`` code, a fresh ring),
this time keeping SAS's view, and checks that its sum equals the plaintext sum. The victim is the
round's first sampled client; the coalition is its ``C`` nearest ring neighbours (default ``2S``,
all of them). Gradient recovery is not a set inference, so the result shape is
``attack.{exact, coords_exact, max_abs_error, rel_error, baseline_rel_error, status}``:
``exact`` is true when every value of the victim's gradient and loss is recovered to the fixed
point (``|error| <= 2^-frac_bits``), ``rel_error`` is ``|guess - g| / |g|``, and the baseline is
what SAS learns without colluders, the survivors' mean (``|mean - g| / |g|``); ``by_colluders``
repeats it for every coalition size ``0 .. 2S``. ``--sweep OUT_DIR`` runs the
request-intersection attack over rho and rounds, with and without the defense, and writes
``sweep.csv`` and ``sweep.png``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError
from experiments.studies.attack_wrap import add_run_arguments, print_result, run_and_attack

__all__ = ["register", "run", "run_chain_collusion"]

ATTACKS = ("request-intersection", "item-gradient", "chain-collusion")
SWEEP_RHOS = (0.5, 0.9)
SWEEP_ROUNDS = (5, 10, 20)
DEFENSES = {"request-intersection": ("none", "fixed-pool", "download-all", "dpf"),
            "item-gradient": ("none", "secagg", "download-all", "dpf"),
            "chain-collusion": ("none",)}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sttfedrec", help="attacks on what STTFedRec's recommendation server sees",
        description="Train STTFedRec under a defense, run an attack on RS's view, report it beside random guessing.")
    p.add_argument("--attack", choices=ATTACKS, default="request-intersection")
    p.add_argument("--defense", default="none",
                   help="request-intersection: none|fixed-pool|download-all|dpf; item-gradient: none|secagg|download-all|dpf; "
                        "chain-collusion: none (raise --successors instead)")
    p.add_argument("--rounds", type=int, default=20, help="[run] rounds (default 20)")
    p.add_argument("--rho", type=float, default=0.9,
                   help="[sttfedrec] rho: fraction of non-clicked ids per request (default 0.9)")
    p.add_argument("--request-size", type=int, default=10,
                   help="[sttfedrec] request_size: T, ids per request (default 10)")
    p.add_argument("--clients", type=int, default=20,
                   help="[sttfedrec] clients_per_round: clients per round (default 20)")
    add_run_arguments(p, users=100, items=400)
    p.add_argument("--successors", type=int, default=1,
                   help="chain-collusion: s, ring successors each client shares with (default 1, the paper's chain)")
    p.add_argument("--colluders", type=int, default=None,
                   help="chain-collusion: how many of the victim's nearest ring neighbours collude with SAS (default 2s)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--sweep", type=Path, default=None, metavar="OUT_DIR",
                   help="sweep rho and rounds for request-intersection with and without the defense")
    p.set_defaults(func=_main)


def _split(args: argparse.Namespace):
    from recmodels.data import binarize, filter_min_interactions
    from recmodels.splits import leave_one_out
    from recmodels.synthetic import generate_synthetic

    if args.data is None:
        if args.users < 4 or args.items < 2 * args.request_size:
            raise UserError(f"--users {args.users} / --items {args.items} too small for --request-size {args.request_size}")
        raw = generate_synthetic(n_users=args.users, n_items=args.items, seed=args.seed, dim=8,
                                 mean_interactions=max(5, args.items // 20))
        source = "synthetic"
    else:
        from recmodels.loaders import load_interactions

        raw, source = load_interactions(args.data), str(Path(args.data).resolve())
    data = filter_min_interactions(binarize(raw), min_user=3)
    return leave_one_out(data, seed=args.seed), source


def run(args: argparse.Namespace, *, defense: str, rho: float, rounds: int) -> dict[str, Any]:
    """Train, attack RS's view, score; a JSON-ready dict."""
    return run_many(args, defense=defense, rho=rho, rounds=(rounds,))[0]


def run_many(args: argparse.Namespace, *, defense: str, rho: float, rounds: tuple[int, ...]) -> list[dict[str, Any]]:
    """Train once to ``max(rounds)`` and attack RS's view of the first ``r`` rounds for each ``r``."""
    import numpy as np

    from attacks.registry import get_attack
    from attacks.sttfedrec import requests_by_client
    from attacks.scoring import score_sets
    from protocols.sttfedrec import RS, SAS, STTFedRec
    from protocols.transport import InProcessTransport, Transcript
    from protocols.twotower_data import TwoTowerConfig
    from recmodels.metrics import evaluate_sampled
    from recmodels.sampling import sample_eval_candidates

    if defense not in DEFENSES[args.attack]:
        raise UserError(f"--defense {defense!r} does not apply to --attack {args.attack}; use one of {DEFENSES[args.attack]}")
    if min(rounds) < 1:
        raise UserError(f"--rounds must be >= 1; found {min(rounds)}")
    split, source = _split(args)
    try:
        cfg = TwoTowerConfig(hash_dim=256, dim=32, clients_per_round=args.clients, request_size=args.request_size,
                             rho=rho, temperature=0.1,
                             decoys=("pir" if defense == "dpf" else
                                     defense if defense in ("fixed-pool", "download-all") else "fresh"),
                             item_aggregation=("dpf" if defense == "dpf" else
                                               "none" if args.attack == "item-gradient" and defense == "none" else "secagg+"))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    servers = (RS, SAS) if defense == "dpf" else (RS,)  # dpf: SAS is the second server, attack its view too
    keep = lambda r: r.receiver in servers  # noqa: E731  (the attacked servers' views only)
    model = STTFedRec(split.train, cfg, seed=args.seed, source=source,
                      transport=InProcessTransport(Transcript(keep_payloads=keep)))
    cands = sample_eval_candidates(split, n_negatives=min(99, model.n_items // 2), rng=np.random.default_rng([args.seed, 1]))
    spec = get_attack("sttfedrec", args.attack)
    out, t0 = [], time.perf_counter()
    trained: dict[int, list[np.ndarray]] = {}  # ground truth: each client's clicks among the items it trained on
    for r in range(max(rounds)):
        model.run_round()
        users, ids, labels = model.last_batches
        for u, row, lab in zip(users.tolist(), ids, labels):
            trained.setdefault(u, []).append(row[lab > 0])
        if r + 1 not in rounds:
            continue
        truth = {u: np.unique(np.concatenate(q)) for u, q in trained.items()}
        results = {}
        for server in servers:
            view = [x for x in model.transport.transcript.view(server) if x.round <= r]
            inferred = spec.run(view, model.public_info())
            requested = {u: np.unique(np.concatenate(q)) for u, q in requests_by_client(view).items()}
            sc = score_sets(inferred, truth, n_candidates=model.n_items)
            everything = score_sets(requested, truth, n_candidates=model.n_items)
            status = "ok" if sc.f1 > max(sc.random_f1, everything.f1) + 0.05 else "no better than guessing"
            if not requested and not any(inferred.values()):
                status = f"no per-client item ids in {server.upper()}'s view (nothing to attack)"
            results[server] = {**sc.to_dict(), "requested_f1": everything.f1, "status": status}
        out.append({
            "attack_name": args.attack, "defense": defense, "rho": rho, "rounds": r + 1, "clients": args.clients,
            "request_size": args.request_size, "data": source, "users": model.n_users, "items": model.n_items,
            "attack": results[RS], **({"attack_sas": results[SAS]} if SAS in results else {}),
            "HR@10": evaluate_sampled(model.score, cands, ks=(10,))["HR@10"],
            "train_seconds": time.perf_counter() - t0,
            "train_bytes_per_client_per_round": model.cost_report()["train_bytes_per_client_per_round"],
        })
    return out


def run_chain_collusion(args: argparse.Namespace) -> dict[str, Any]:
    """Train, re-run the last round's chain keeping SAS's view, attack the victim; a JSON-ready dict."""
    import os

    import numpy as np

    from attacks.sttfedrec import ChainView, chain_collusion_attack, ring_neighbours
    from protocols.sttfedrec import STTFedRec
    from protocols.twotower_data import TwoTowerConfig
    from secagg.chain import ChainConfig, Kind, effective_successors
    from secagg.chain_sim import simulate
    from secagg.chain_wire import ChainUpload
    from secagg.encoding import FixedPoint
    from secagg.messages import INSTANCE_BYTES

    if args.defense != "none":
        raise UserError(f"--defense {args.defense!r} does not apply to --attack chain-collusion; raise --successors")
    if args.rounds < 1 or args.successors < 1:
        raise UserError(f"--rounds and --successors must be >= 1; found {args.rounds} and {args.successors}")
    split, source = _split(args)
    try:
        cfg = TwoTowerConfig(hash_dim=256, dim=32, clients_per_round=args.clients, request_size=args.request_size,
                             rho=args.rho, temperature=0.1, chain_successors=args.successors)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    model = STTFedRec(split.train, cfg, seed=args.seed, source=source)
    model.record_chain_inputs = True
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        model.run_round()
    names, vec = model.last_chain_inputs
    users = [int(n.split(":", 1)[1]) for n in names]
    n, dim = vec.shape
    s = effective_successors(args.successors, n)
    want = 2 * s if args.colluders is None else args.colluders
    if not 0 <= want <= n - 1:
        raise UserError(f"--colluders must be in 0..{n - 1} (the other clients of the round); found {want}")
    codec = FixedPoint(cfg.frac_bits, cfg.value_clip)
    enc = codec.encode(vec, rounding="nearest")  # exactly what protocols.secure_sum hands the chain
    config = ChainConfig(instance=os.urandom(INSTANCE_BYTES), round=model.round - 1, dim=dim, successors=s)
    run = simulate(config, {u: enc[i] for i, u in enumerate(users)})
    if run.result is None:
        raise UserError(f"the chain aborted: {run.abort}")
    att = run.server.attempt
    uploads = {c: ChainUpload.from_bytes(d).vector for k, c, a, d in run.server_view if k is Kind.UPLOAD and a == att}
    pads = {c: run.server.revealed[(att, c)] for c in uploads}
    target, row = users[0], 0
    truth = vec[row]
    neighbours = ring_neighbours(run.server.ring, target, s)
    others = [c for c in run.server.ring if c != target and c not in neighbours]
    order = neighbours + others  # nearest neighbours first, then the rest of the ring
    mean = codec.decode(run.result) / len(run.survivors)
    norm = float(np.linalg.norm(truth)) or 1.0
    tol = 2.0 ** -cfg.frac_bits

    def attack(coalition: list[int]) -> dict[str, Any]:
        seeds: dict = {}
        for c in coalition:
            seeds.update(run.clients[c].known_seeds())
        view = ChainView(uploads, pads, run.server.ring, s, att, seeds)
        guess = codec.decode(chain_collusion_attack(view, model.public_info(), target=target, colluders=coalition))
        err = np.abs(guess - truth)
        exact = bool(err.max() <= tol)
        return {"colluders": len(coalition), "exact": exact, "coords_exact": float(np.mean(err <= tol)),
                "max_abs_error": float(err.max()), "rel_error": float(np.linalg.norm(guess - truth) / norm),
                "status": "recovered exactly" if exact else "not recovered (a uniform mask remains)"}

    main = attack(order[:want])
    by = [attack(order[:c]) for c in range(0, min(2 * s, n - 1) + 1)]
    return {
        "attack_name": "chain-collusion", "defense": "none", "successors": s, "rounds": args.rounds,
        "clients": n, "dim": dim, "frac_bits": cfg.frac_bits, "data": source, "target": target,
        "colluders": order[:want], "needed": min(2 * s, n - 1),
        "attack": {**{k: v for k, v in main.items() if k != "colluders"},
                   "baseline_rel_error": float(np.linalg.norm(mean - truth) / norm)},
        "by_colluders": by,
        "chain_sum_matches_plaintext": bool(np.max(np.abs(codec.decode(run.result) - vec.sum(0))) <= n * tol),
        "train_seconds": time.perf_counter() - t0,
    }


def run_attack(args: argparse.Namespace) -> dict[str, Any]:
    """``request-intersection``/``item-gradient`` on a run of the matrix's cell (module docstring)."""
    if args.defense not in DEFENSES[args.attack]:
        raise UserError(f"--defense {args.defense!r} does not apply to --attack {args.attack}; "
                        f"use one of {DEFENSES[args.attack]}")
    if args.users < 4 or args.items < 2 * args.request_size:
        raise UserError(f"--users {args.users} / --items {args.items} too small for --request-size {args.request_size}")
    cell = "dpf" if args.defense == "dpf" else "secagg+"
    # hash_dim and dim: the earlier command's small towers (k = 32), which its figures were measured with
    over: dict[str, Any] = {"clients_per_round": args.clients, "rho": args.rho, "request_size": args.request_size,
                            "hash_dim": 256, "dim": 32}
    if args.defense in ("fixed-pool", "download-all"):
        over["decoys"] = args.defense
    if args.attack == "item-gradient" and args.defense == "none":
        over["item_aggregation"] = "none"  # each client's per-id rows in plaintext (the naive fix of notes G1)
    return run_and_attack(args, paper="sttfedrec", protocol="sttfedrec", cell=cell, attack=args.attack,
                          overrides=over, items_per_interaction=20, min_users=4)


def _main(args: argparse.Namespace) -> int:
    if args.sweep is not None:
        return _sweep(args)
    if args.attack == "chain-collusion":
        out = run_chain_collusion(args)
        a = out["attack"]
        print(f"STTFedRec chain-collusion (s = {out['successors']}, {out['clients']} clients, {out['dim']} values): "
              f"SAS + {len(out['colluders'])} of the victim's ring neighbours: {a['status']}")
        print(f"  relative error {a['rel_error']:.3g} (SAS alone, the survivors' mean: {a['baseline_rel_error']:.3g}); "
              f"{out['needed']} colluders needed")
        for r in out["by_colluders"]:
            print(f"    {r['colluders']} colluders: exact {r['exact']}, {r['coords_exact']:.3f} of values exact, "
                  f"relative error {r['rel_error']:.3g}")
        if args.json:
            print(jsonio.dumps(out))
        return 0
    out = run_attack(args)
    print_result(out, f"STTFedRec {args.attack} / defense {args.defense} (rho {args.rho})")
    print(f"  {out['bytes_per_client_per_round']:,.0f} bytes per client per round")
    if args.json:
        print(jsonio.dumps(out))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    if args.attack != "request-intersection":
        raise UserError("--sweep runs the request-intersection attack; drop --attack item-gradient")
    args.sweep.mkdir(parents=True, exist_ok=True)
    rows = []
    for defense in ("none", "fixed-pool"):
        for rho in SWEEP_RHOS:
            for out in run_many(args, defense=defense, rho=rho, rounds=SWEEP_ROUNDS):
                rows.append({"defense": defense, "rho": rho, "rounds": out["rounds"], **{
                    k: round(out["attack"][k], 4) for k in ("f1", "precision", "recall", "random_f1", "requested_f1")},
                    "HR@10": round(out["HR@10"], 4),
                    "train_bytes_per_client_per_round": round(out["train_bytes_per_client_per_round"])})
                print(jsonio.dumps(rows[-1]), file=sys.stderr)
    with open(args.sweep / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for defense, style in (("none", "-"), ("fixed-pool", "--")):
        for rho in SWEEP_RHOS:
            sel = [r for r in rows if r["defense"] == defense and r["rho"] == rho]
            ax.plot([r["rounds"] for r in sel], [r["f1"] for r in sel], style, marker="o", label=f"{defense}, rho {rho}")
    ax.plot([r["rounds"] for r in rows if r["defense"] == "none" and r["rho"] == 0.9],
            [r["requested_f1"] for r in rows if r["defense"] == "none" and r["rho"] == 0.9], ":", color="grey",
            label="guess every requested id (rho 0.9)")
    ax.set_xlabel("training rounds")
    ax.set_ylabel("F1 of the inferred clicks")
    ax.set_title("STTFedRec: RS request-intersection attack")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.sweep / "sweep.png", dpi=100)
    plt.close(fig)
    print(f"wrote {args.sweep / 'sweep.csv'} and sweep.png")
    if args.json:
        print(jsonio.dumps({"rows": rows}))
    return 0
