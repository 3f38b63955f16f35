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
``--sweep DATA``: ``lightfr-grad`` at each code length f in ``--sweep-bits`` (p = 0.6) and each
client fraction p in ``--sweep-fractions`` (f = 64), HR@10/NDCG@10 under random and optimistic ties
(the paper's Figs. 4 and 6); ``--png FILE`` plots them.
``--vs-fedmf``: LightFR (plaintext Agg_grad and its SecAgg+ upload) against FedMF (plaintext, Paillier,
CKKS; full variant) on one small synthetic data set: bytes per client per round, client and server
seconds per round, HR@10/NDCG@10 on the same candidates. The secure forms compute the plaintext
model (LightFR: bit for bit, checked here; FedMF: up to the fixed-point/CKKS error), so their cost
is measured over ``--cost-rounds`` rounds and their accuracy is the plaintext run's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any

from experiments import jsonio
from experiments.errors import UserError

if TYPE_CHECKING:  # numpy is imported where used, so that --help stays fast
    import numpy as np

__all__ = ["ABLATION", "ablation", "bench", "collapse", "register", "sweep", "vs_fedmf"]

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
    p.add_argument("--sweep", default=None, metavar="DATA",
                   help="also sweep the code length f and the client fraction p of lightfr-grad on DATA")
    p.add_argument("--sweep-bits", type=int, nargs="+", default=[8, 16, 32, 64], metavar="F")
    p.add_argument("--sweep-fractions", type=float, nargs="+", default=[0.2, 0.4, 0.6, 0.8, 1.0], metavar="P")
    p.add_argument("--png", default=None, metavar="FILE", help="write the sweep's plot to this PNG")
    p.add_argument("--vs-fedmf", action="store_true",
                   help="also compare LightFR (plain, SecAgg+) with FedMF (plain, Paillier, CKKS) on small synthetic data")
    p.add_argument("--users", type=int, default=50, help="--vs-fedmf: synthetic users (default 50)")
    p.add_argument("--fedmf-items", type=int, default=100, help="--vs-fedmf: synthetic items (default 100)")
    p.add_argument("--cost-rounds", type=int, default=2, help="--vs-fedmf: rounds timed for the secure forms (default 2)")
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
    import numpy as np

    s = q @ p
    part = np.argpartition(-s, k - 1)[:k]
    return part[np.argsort(-s[part])]


def bench(items: int, bits: int, rated: int, repeats: int, seed: int) -> dict[str, Any]:
    """Storage, per-client bytes and top-10 inference seconds (see the module docstring)."""
    import numpy as np

    from recmodels import binary_codes as bc

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
    import numpy as np

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
    from experiments.run import config as cfgmod
    from experiments.run.prepare import prepare_data
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


def _prepared(data: str, seed: int, extra: dict[str, Any] | None = None) -> tuple[Any, Any]:
    from experiments.run import config as cfgmod
    from experiments.run.prepare import prepare_data

    over = {"data": {"source": data, **(extra or {})}, "run": {"seed": seed}}
    config = cfgmod.merge(cfgmod.load_preset("lightfr-grad"), over)
    return config, prepare_data(config)


def sweep(data: str, rounds: int, seed: int, bits: list[int], fractions: list[float],
          data_overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``lightfr-grad`` at each f (p = 0.6) and each p (f = 64) on ``data``; sampled HR/NDCG."""
    import dataclasses

    from protocols.lightfr import LightFR, rank_metrics

    config, prep = _prepared(data, seed, data_overrides)
    base = config.protocol_config
    cand = prep.candidates
    rows = []
    for name, values in (("bits", bits), ("client_fraction", fractions)):
        for v in values:
            over = {name: v} if name == "bits" else {name: v, "bits": 64}
            model = LightFR(prep.split.train, dataclasses.replace(base, **over), seed=seed)
            t = time.perf_counter()
            for _ in range(rounds):
                model.run_round()
            rows.append({"vary": name, "bits": model.f, "client_fraction": model.config.client_fraction,
                         "rounds": rounds, "train_seconds": time.perf_counter() - t,
                         **rank_metrics(model.raw_scores(cand.users, cand.items), k=10)})
    return rows


def _plot_sweep(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, vary, label in ((axes[0], "bits", "code length f (p = 0.6)"),
                            (axes[1], "client_fraction", "client fraction p (f = 64)")):
        pts = [r for r in rows if r["vary"] == vary]
        x = [r[vary] for r in pts]
        for key, style in (("HR@10", "o-"), ("HR@10_optimistic", "o--"), ("NDCG@10", "s-"), ("NDCG@10_optimistic", "s--")):
            ax.plot(x, [r[key] for r in pts], style, label=key.replace("_", " "))
        if vary == "bits":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("sampled metric (1 held-out + 49 negatives)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def vs_fedmf(users: int, items: int, rounds: int, cost_rounds: int, seed: int) -> list[dict[str, Any]]:
    """LightFR (plain, SecAgg+) against FedMF (plain, Paillier, CKKS) on one synthetic data set."""
    import dataclasses

    import numpy as np

    from protocols.fedmf import FedMF, FedMFConfig
    from protocols.lightfr import LightFR, rank_metrics

    config, prep = _prepared("synthetic", seed, {"synthetic_users": users, "synthetic_items": items})
    train, cand = prep.split.train, prep.candidates
    lf_cfg = config.protocol_config
    rows: list[dict[str, Any]] = []

    def run(model: Any, n: int) -> dict[str, Any]:
        stats = [model.run_round() for _ in range(n)]
        return {"rounds": n, "bytes_per_client_per_round": float(np.mean([s.bytes_per_client for s in stats])),
                "client_seconds_per_round": float(np.mean([s.seconds["client"] for s in stats])),
                "server_seconds_per_round": float(np.mean([s.seconds["server"] for s in stats]))}

    plain = LightFR(train, lf_cfg, seed=seed)
    first = run(plain, cost_rounds)
    codes = plain.d.copy()
    for _ in range(rounds - cost_rounds):
        plain.run_round()
    acc = rank_metrics(plain.raw_scores(cand.users, cand.items), k=10)
    rows.append({"model": "LightFR Agg_grad, plaintext", "bits": plain.f, **first, "accuracy_rounds": rounds,
                 **{k: v for k, v in acc.items() if "pessimistic" not in k}})
    secure = LightFR(train, dataclasses.replace(lf_cfg, secure_aggregation="secagg+"), seed=seed)
    cost = run(secure, cost_rounds)
    rows.append({"model": "LightFR Agg_grad, SecAgg+ (union rows)", "bits": secure.f, **cost,
                 "accuracy_rounds": rounds, "same_codes_as_plaintext": bool(np.array_equal(secure.d, codes)),
                 **{k: v for k, v in acc.items() if "pessimistic" not in k}})
    fm_plain = FedMF(train, FedMFConfig(), seed=seed)
    cost = run(fm_plain, rounds)
    scores = fm_plain.score(cand.users, cand.items)
    fm_acc = rank_metrics(scores, k=10)
    keep = {k: v for k, v in fm_acc.items() if "_" not in k}
    rows.append({"model": "FedMF full, plaintext", "dim": fm_plain.dim, **cost, "accuracy_rounds": rounds, **keep})
    for defense in ("paillier", "ckks"):
        fm = FedMF(train, FedMFConfig(defense=defense), seed=seed)
        cost = run(fm, cost_rounds)
        err = float(np.abs(fm.item_matrix - _fedmf_after(train, seed, cost_rounds)).max())
        rows.append({"model": f"FedMF full, {defense}", "dim": fm.dim, **cost, "accuracy_rounds": rounds,
                     "max_abs_item_diff_vs_plaintext": err, **keep})
    return rows


def _fedmf_after(train: Any, seed: int, rounds: int) -> np.ndarray:
    from protocols.fedmf import FedMF, FedMFConfig

    m = FedMF(train, FedMFConfig(), seed=seed)
    for _ in range(rounds):
        m.run_round()
    return m.item_matrix


def _main(args: argparse.Namespace) -> int:
    if args.items < 1 or not 1 <= args.bits <= 4096 or args.repeats < 1 or args.rated < 0:
        raise UserError(f"--items, --repeats must be >= 1 and --bits in 1..4096; found {args.items}, {args.repeats}, {args.bits}.")
    if args.vs_fedmf and not 1 <= args.cost_rounds <= args.rounds:
        raise UserError(f"--cost-rounds must be in 1..--rounds ({args.rounds}); found {args.cost_rounds}.")
    if args.vs_fedmf and (args.users < 4 or args.fedmf_items < 4):
        raise UserError(f"--users and --fedmf-items must be >= 4; found {args.users}, {args.fedmf_items}.")
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
    if args.sweep:
        out["sweep"] = sweep(args.sweep, args.rounds, args.seed, args.sweep_bits, args.sweep_fractions)
        for r in out["sweep"]:
            print(f"f {r['bits']} p {r['client_fraction']}: HR@10 {r['HR@10']:.4f} (optimistic {r['HR@10_optimistic']:.4f}), "
                  f"NDCG@10 {r['NDCG@10']:.4f} (optimistic {r['NDCG@10_optimistic']:.4f})")
        if args.png:
            _plot_sweep(out["sweep"], args.png)
            print(f"plot: {args.png}")
    if args.vs_fedmf:
        out["vs_fedmf"] = vs_fedmf(args.users, args.fedmf_items, args.rounds, args.cost_rounds, args.seed)
        for r in out["vs_fedmf"]:
            print(f"{r['model']}: {r['bytes_per_client_per_round']:.0f} B/client/round, client "
                  f"{r['client_seconds_per_round']:.4f} s, server {r['server_seconds_per_round']:.4f} s, "
                  f"HR@10 {r['HR@10']:.4f} NDCG@10 {r['NDCG@10']:.4f} (after {r['accuracy_rounds']} plaintext rounds)")
    if args.json:
        print(jsonio.dumps(out))
    return 0
