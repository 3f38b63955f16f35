"""``secagg bench lightfr``: storage, bytes per client, top-10 inference time, and lambda collapse.

Inference: one user's top-10 over ``--items`` items, timed (median of ``--repeats``) as
(a) XOR + popcount on packed ``--bits``-bit codes (:func:`recmodels.binary_codes.top_k`);
(b) float32 MF of dimension ``--bits`` (equal dimension: 32x the storage);
(c) float32 MF of dimension ``--bits / 32`` (matched storage).
Storage: the client's model (user code + item codes) packed, one byte per bit (the paper's
Table 5 counting, notes §9.12) and float32/float64 at equal dimension.
``--collapse``: trains LightFR on synthetic data (300 users, 400 items, 10 rounds) at the paper's
lambda range: Agg_grad with raw lambda (``lambda_scale = "none"``), Agg_grad with ours, and the
exact server DCD with ours, and reports how balanced/collapsed the
item codes are (mean ``|1^T d_i| / f``, distinct codes) and the training loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from experiments.errors import UserError
from recmodels import binary_codes as bc

__all__ = ["ABLATION", "ablation", "bench", "collapse", "register"]

#: The ablation of the paper's Table 6, in its order.
ABLATION = ("lightfr-random", "lightfr-init", "lightfr-para", "lightfr-grad")


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("lightfr", help="LightFR storage, inference time and lambda collapse",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=100_000, help="items m (default 100000)")
    p.add_argument("--bits", type=int, default=64, help="code length f (default 64)")
    p.add_argument("--rated", type=int, default=38, help="|I_u| for the upload sizes (default 38, Ciao's mean)")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions (median; default 20)")
    p.add_argument("--collapse", action="store_true", help="also run the lambda-collapse experiment")
    p.add_argument("--ablation", default=None, metavar="DATA",
                   help="also train the ablation presets (random, init, para, grad) on DATA ('synthetic' or a path) "
                   "and report HR@10/NDCG@10 under random, optimistic and pessimistic ties")
    p.add_argument("--rounds", type=int, default=10, help="rounds of the trained ablation presets (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object on the last line of stdout")
    p.set_defaults(func=_main)


def _time(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _float_topk(p: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    s = q @ p
    part = np.argpartition(-s, k - 1)[:k]
    return part[np.argsort(-s[part])]


def bench(items: int, bits: int, rated: int, repeats: int, seed: int) -> dict[str, Any]:
    """Storage, per-client bytes and top-10 inference seconds (see the module docstring)."""
    rng = np.random.default_rng(seed)
    b, d = bc.random_codes(1, bits, rng), bc.random_codes(items, bits, rng)
    pb, pd = bc.pack(b[0]), bc.pack(d)
    k = min(10, items)
    matched = max(1, bits // 32)
    q_eq = rng.standard_normal((items, bits)).astype(np.float32)
    p_eq = rng.standard_normal(bits).astype(np.float32)
    q_m = rng.standard_normal((items, matched)).astype(np.float32)
    p_m = rng.standard_normal(matched).astype(np.float32)
    t_ham = _time(lambda: bc.top_k(pb, pd, k), repeats)
    t_eq = _time(lambda: _float_topk(p_eq, q_eq, k), repeats)
    t_m = _time(lambda: _float_topk(p_m, q_m, k), repeats)
    w = bc.words(bits) * 8
    m1 = items + 1
    return {
        "items": items, "bits": bits, "rated": rated,
        "storage_bytes": {"packed": m1 * w, "one_byte_per_bit": m1 * bits, "float32_equal_dim": m1 * bits * 4,
                          "float64_equal_dim": m1 * bits * 8, "float32_matched_storage_dim": matched},
        "bytes_per_client_per_round": {
            "download_packed": items * w,
            "upload_grad_plaintext": rated * (bits * 8 + 4),
            "upload_para_plaintext_packed": rated * (w + 4),
            "upload_grad_secure_dense_values": items * (bits + 1) * 8,
        },
        "top10_seconds": {"hamming_packed": t_ham, "float32_equal_dim": t_eq, "float32_matched_storage": t_m},
        "ratio_float32_equal_over_hamming": t_eq / t_ham,
        "note": "measured on this machine, possibly under load; re-run the command to re-measure",
    }


def collapse(lams: tuple[float, ...] = (0.0, 0.2, 0.6, 1.0), rounds: int = 10, seed: int = 0) -> list[dict[str, Any]]:
    """Item-code collapse at the paper's lambda, raw versus scaled (synthetic data, Agg_grad, f = 64)."""
    from protocols.lightfr import LightFR, LightFRConfig
    from recmodels.synthetic import generate_synthetic

    data = generate_synthetic(n_users=300, n_items=400, dim=8, mean_interactions=30, seed=seed)
    rows = []
    for server, scale in (("grad", "none"), ("grad", "count"), ("dcd", "count")):
        for lam in lams:
            cfg = LightFRConfig(bits=64, server=server, lambda_item=lam, lambda_user=lam, lambda_scale=scale)
            m = LightFR(data, cfg, seed=seed)
            for _ in range(rounds):
                m.run_round()
            dsum = np.abs(m.d.astype(int).sum(1)) / m.f
            rows.append({"server": server, "lambda": lam, "lambda_scale": scale, "mean_abs_code_sum_over_f": float(dsum.mean()),
                         "distinct_item_codes": int(len(np.unique(m.d, axis=0))), "items": m.n_items,
                         "train_mse": m.train_loss()})
    return rows


def ablation(data: str, rounds: int, seed: int) -> list[dict[str, Any]]:
    """Train each preset of :data:`ABLATION` and score the sampled protocol under three tie rules."""
    from experiments import config as cfgmod
    from experiments.prepare import prepare_data
    from protocols.lightfr import LightFR, rank_metrics

    rows = []
    for preset in ABLATION:
        config = cfgmod.merge(cfgmod.load_preset(preset), {"data": {"source": data}, "run": {"seed": seed}})
        prep = prepare_data(config)
        model = LightFR(prep.split.train, config.protocol_config, seed=seed)
        n = rounds if config.protocol_config.server != "none" else 0
        t = time.perf_counter()
        for _ in range(n):
            model.run_round()
        cand = prep.candidates
        metrics = rank_metrics(model.raw_scores(cand.users, cand.items), k=10)
        rows.append({"preset": preset, "rounds": n, "train_seconds": time.perf_counter() - t, **metrics})
    return rows


def _main(args: argparse.Namespace) -> int:
    if args.items < 1 or not 1 <= args.bits <= 4096 or args.repeats < 1 or args.rated < 0:
        raise UserError(f"--items, --repeats must be >= 1 and --bits in 1..4096; found {args.items}, {args.repeats}, {args.bits}.")
    out = bench(args.items, args.bits, args.rated, args.repeats, args.seed)
    t = out["top10_seconds"]
    print(f"top-10 over {args.items} items: Hamming {t['hamming_packed'] * 1e3:.3f} ms, float32 dim {args.bits} "
          f"{t['float32_equal_dim'] * 1e3:.3f} ms (x{out['ratio_float32_equal_over_hamming']:.2f}), float32 matched "
          f"storage {t['float32_matched_storage'] * 1e3:.3f} ms")
    print("storage bytes: " + ", ".join(f"{k} {v}" for k, v in out["storage_bytes"].items()))
    if args.collapse:
        out["collapse"] = collapse(seed=args.seed)
        for r in out["collapse"]:
            print(f"{r['server']} lambda {r['lambda']} ({r['lambda_scale']}): mean |1^T d|/f {r['mean_abs_code_sum_over_f']:.3f}, "
                  f"distinct codes {r['distinct_item_codes']}/{r['items']}, train MSE {r['train_mse']:.4f}")
    if args.ablation:
        out["ablation"] = ablation(args.ablation, args.rounds, args.seed)
        for r in out["ablation"]:
            print(f"{r['preset']}: HR@10 {r['HR@10']:.4f} (optimistic {r['HR@10_optimistic']:.4f}), "
                  f"NDCG@10 {r['NDCG@10']:.4f} (optimistic {r['NDCG@10_optimistic']:.4f})")
    if args.json:
        print(json.dumps(out))
    return 0
