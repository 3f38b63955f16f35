"""FedCL's measured study: several seeds of several configurations, paired tests, tables and a PNG.

``secagg run`` gives one run per call. The comparisons of docs/fedcl.md need several seeds of
several configurations on the same splits, per-user ranks for a paired test, and each user's
composed epsilon. This module does that, and nothing else:

* ``python -m experiments.studies.fedcl_study run --data PATH --variant NAME=PRESET[:key=value,...] ...
  --seeds 0 1 2 --rounds 150 --out study.jsonl`` trains every variant on every seed (the seed sets
  the split, the init and the client sampling, so variants with the same seed are paired) and
  appends one JSON line per (variant, seed) as soon as it is done. An interrupted study keeps its
  finished lines, and a rerun skips them.
* ``python -m experiments.studies.fedcl_study summary study.jsonl --reference fed [--png out.png]``
  prints a Markdown table: the mean and standard deviation over seeds of full-ranking HR/NDCG@5/10,
  each user's composed epsilon (median and max over users, mean over seeds), and against the
  reference variant a paired t-test over seeds and an exact sign test over (seed, user) pairs
  whose HR@10 hits differ.

Keys after ``PRESET:`` go to the preset's protocol section (``[fedcl]``), typed as TOML values
(``epsilon=1e6``, ``clustering="kmeans"``), except ``rounds=N``, which overrides ``--rounds`` for
that variant (epochs for a centralised preset); a preset with 0 rounds (``itempop``) stays at 0. Full ranking is the rule of
:func:`recmodels.metrics.evaluate_full` (every item the user has not trained on competes, the
validation item does not, ties count against the held-out item).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from dp.events import Laplace
from dp.ldp import ldp_repeated_uploads
from experiments import jsonio
from experiments.run import config as cfgmod
from experiments.run.prepare import prepare_data
from protocols.registry import BuildContext
from protocols.transport import InProcessTransport, Transcript
from recmodels.sampling import user_item_csr
from recmodels.metrics import metrics_from_ranks, rank_of_target

__all__ = ["composed_epsilons", "full_ranks", "main", "parse_variant", "run_variant", "summarize"]

KS = (5, 10)


def parse_variant(text: str) -> tuple[str, str, dict[str, Any]]:
    """``NAME=PRESET[:k=v,...]`` -> ``(name, preset, overrides)``; values are TOML literals."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--variant must be NAME=PRESET[:key=value,...]; found {text!r}")
    preset, _, kv = rest.partition(":")
    overrides = tomllib.loads("\n".join(p.strip() for p in kv.split(",") if p.strip())) if kv else {}
    return name, preset, overrides


def full_ranks(score_all: Any, split: Any, batch_users: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Per-user ``(ranks, n_candidates)`` under :func:`recmodels.metrics.evaluate_full`'s rule."""
    csr = user_item_csr(split.train)
    users_all = split.test_users.astype(np.int64)
    ranks = np.empty(users_all.size, np.int64)
    n_cand = np.empty(users_all.size, np.int64)
    for start in range(0, users_all.size, batch_users):
        users = users_all[start : start + batch_users]
        rows = np.arange(users.size)
        valid = ~csr[users].toarray()
        if split.valid_items is not None:
            vi = split.valid_items[users]
            valid[rows[vi >= 0], vi[vi >= 0]] = False
        target = split.test_items[users]
        valid[rows, target] = True
        ranks[start : start + users.size] = rank_of_target(np.asarray(score_all(users)), target, valid)
        n_cand[start : start + users.size] = valid.sum(axis=1)
    return ranks, n_cand


def composed_epsilons(uploads: np.ndarray, epsilon: float, delta: float = 1e-5) -> dict[str, float]:
    """Median and max over uploading users of their composed epsilon (tightest of pure/RDP/PLD)."""
    k = np.asarray(uploads, np.int64)
    k = k[k > 0]
    if not k.size:
        return {}
    eps = {int(n): min(n * epsilon, ldp_repeated_uploads(Laplace(1.0 / epsilon), int(n), delta=delta).epsilon)
           for n in np.unique(k)}
    per_user = np.array([eps[int(n)] for n in k])
    return {"uploads_median": float(np.median(k)), "uploads_max": int(k.max()),
            "eps_median": float(np.median(per_user)), "eps_max": float(per_user.max())}


def run_variant(data: str, preset: str, overrides: dict[str, Any], seed: int, rounds: int,
                sections: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train one configuration on one seed and return its full-ranking metrics and per-user ranks.

    ``sections`` overrides other TOML sections (e.g. ``{"data": {"synthetic_users": 40}}``).
    """
    base = cfgmod.load_preset(preset)
    section = base.spec.section
    overrides = dict(overrides)
    rounds = int(overrides.pop("rounds", rounds)) if base.run.rounds else 0  # a 0-round preset (itempop) stays 0
    extra = {k: dict(v) for k, v in (sections or {}).items()}
    cfg = cfgmod.merge(base, {**extra, "data": {**extra.get("data", {}), "source": data},
                              "run": {**extra.get("run", {}), "seed": seed, "rounds": rounds},
                              "eval": {"negatives": 0},  # full ranking only: no sampled candidates
                              **({section: overrides} if overrides else {})})
    prep = prepare_data(cfg)
    transport = InProcessTransport(Transcript(keep_payloads=False)) if cfg.spec.federated else None
    trainer = cfg.spec.build(BuildContext(
        split=prep.split, config=cfg.protocol_config, seed=seed, source=data, transport=transport,
        data_options=cfg.to_dict()["data"], exclude=prep.exclude))
    t0 = time.perf_counter()
    for _ in range(cfg.run.rounds):
        trainer.run_round()
    seconds = time.perf_counter() - t0
    ranks, n_cand = full_ranks(trainer.score_all, prep.split)
    m = metrics_from_ranks(ranks, n_cand, KS)
    out = {"seed": seed, "preset": preset, "overrides": overrides, "rounds": cfg.run.rounds,
           "seconds_train": round(seconds, 1), **{k: m[k] for k in ("HR@5", "HR@10", "NDCG@5", "NDCG@10")},
           "users": int(ranks.size), "ranks": ranks.tolist()}
    pc = cfg.protocol_config
    if hasattr(trainer, "uploads") and getattr(pc, "semi_hard", 0):
        out["privacy"] = composed_epsilons(trainer.uploads, pc.epsilon)
    return out


def _sign_test(a: np.ndarray, b: np.ndarray) -> tuple[int, int, float]:
    """Exact two-sided sign test on paired 0/1 outcomes: ``(a only, b only, p)``."""
    wins, losses = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    p = stats.binomtest(wins, wins + losses).pvalue if wins + losses else 1.0
    return wins, losses, float(p)


def summarize(rows: list[dict[str, Any]], reference: str | None, k: int = 10) -> tuple[str, dict[str, Any]]:
    """Markdown table (mean ± std over seeds) and the per-variant numbers behind it."""
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    ref = by.get(reference or "", {})
    lines = ["| variant | seeds | full HR@5 | full HR@10 | full NDCG@10 | composed eps per user (median / max) "
             f"| HR@{k} - reference (paired t, p) | NDCG@{k} - reference (paired t, p) "
             "| users hit only here / only by reference (sign test p) |",
             "|---|---|---|---|---|---|---|---|---|"]
    table: dict[str, Any] = {}
    for name, seeds in by.items():
        s = sorted(seeds)
        col = {m: np.array([seeds[x][m] for x in s]) for m in ("HR@5", "HR@10", "NDCG@10")}
        priv = [seeds[x]["privacy"] for x in s if seeds[x].get("privacy")]
        eps = (f"{np.mean([p['eps_median'] for p in priv]):.1f} / {np.mean([p['eps_max'] for p in priv]):.1f}"
               if priv else "-")
        if priv and np.mean([p["eps_median"] for p in priv]) > 1e6:
            eps = "no noise (eps 1e9)"
        cmp, cmp_n, sign = "-", "-", "-"
        rec: dict[str, Any] = {"seeds": s, **{m: (float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0)
                                              for m, v in col.items()}}
        both = [x for x in s if x in ref]
        if ref and name != reference and both:
            a = np.array([seeds[x][f"HR@{k}"] for x in both])
            b = np.array([ref[x][f"HR@{k}"] for x in both])
            p_t = float(stats.ttest_rel(a, b).pvalue) if len(both) > 1 and np.any(a != b) else float("nan")
            pf = lambda v: "n/a, 1 seed" if math.isnan(v) else f"{v:.2g}"  # noqa: E731
            cmp = f"{(a - b).mean():+.4f} (p {pf(p_t)})"
            an = np.array([seeds[x][f"NDCG@{k}"] for x in both])
            bn = np.array([ref[x][f"NDCG@{k}"] for x in both])
            p_n = float(stats.ttest_rel(an, bn).pvalue) if len(both) > 1 and np.any(an != bn) else float("nan")
            cmp_n = f"{(an - bn).mean():+.4f} (p {pf(p_n)})"
            ha = np.concatenate([np.array(seeds[x]["ranks"]) <= k for x in both]).astype(int)
            hb = np.concatenate([np.array(ref[x]["ranks"]) <= k for x in both]).astype(int)
            w, lo, p_s = _sign_test(ha, hb)
            sign = f"{w} / {lo} (p {p_s:.2g})"
            rec.update(diff=float((a - b).mean()), p_t=p_t, diff_ndcg=float((an - bn).mean()), p_t_ndcg=p_n,
                       only_here=w, only_ref=lo, p_sign=p_s)
        fmt = {m: f"{v.mean():.4f} ± {v.std(ddof=1):.4f}" if len(v) > 1 else f"{v.mean():.4f}" for m, v in col.items()}
        lines.append(f"| {name} | {len(s)} | {fmt['HR@5']} | {fmt['HR@10']} | {fmt['NDCG@10']} | {eps} | {cmp} | {cmp_n} | {sign} |")
        table[name] = rec
    return "\n".join(lines), table


def _plot(table: dict[str, Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(names) + 2), 3.6))
    mean = [table[n]["HR@10"][0] for n in names]
    std = [table[n]["HR@10"][1] for n in names]
    ax.bar(range(len(names)), mean, yerr=std, capsize=4, color="tab:blue")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("full HR@10\n(mean ± std over seeds)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # (the long rotated names and the label stay inside)
    plt.close(fig)


def plot_epsilon_sweep(table: dict[str, Any], eps_of: dict[str, float], lines: list[str], path: str,
                       privacy: dict[str, float] | None = None) -> None:
    """HR@10 (mean ± std over seeds) against epsilon per upload; ``lines`` variants as horizontal
    references; ``privacy`` (variant -> median composed epsilon) annotates each point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted((n for n in eps_of if n in table), key=lambda n: eps_of[n])  # variants not run yet: skipped
    lines = [n for n in lines if n in table]
    finite = [eps_of[n] for n in names if math.isfinite(eps_of[n])]
    inf_x = max(finite) * 4 if finite else 1.0
    xs = [eps_of[n] if math.isfinite(eps_of[n]) else inf_x for n in names]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.errorbar(xs, [table[n]["HR@10"][0] for n in names], yerr=[table[n]["HR@10"][1] for n in names], fmt="o-",
                capsize=4, label="FedCL (GRU)")
    for n, x in zip(names, xs):
        if privacy and n in privacy and math.isfinite(eps_of[n]):
            ax.annotate(f"median user {privacy[n]:.0f}", (x, table[n]["HR@10"][0]), textcoords="offset points",
                        xytext=(4, -12), fontsize=7)
    for i, n in enumerate(lines):
        ax.axhline(table[n]["HR@10"][0], ls=("--", ":", "-.")[i % 3], color="k", lw=1, label=n)
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{eps_of[n]:g}" if math.isfinite(eps_of[n]) else "no noise" for n in names])
    ax.set_xlabel("epsilon per upload (annotation: the median user's composed epsilon)")
    ax.set_ylabel("full-ranking HR@10")
    ax.set_title("FedCL on ml-latest-small: accuracy against LDP epsilon")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cluster_cost(n: int, method: str, dim: int = 64, clusters: int = 25, seed: int = 0) -> dict[str, Any]:
    """Seconds and peak memory of one :func:`protocols.fedcl_server.cluster_centroids` call on ``n``
    Laplace embeddings, in a fresh subprocess: ``traced_peak_mb`` is the peak of the memory numpy and
    scipy allocated during the call (tracemalloc; the time then includes tracemalloc's overhead),
    ``peak_rss_mb`` the process's peak resident size."""
    import subprocess

    code = (
        "import json, resource, time, tracemalloc, numpy as np\n"
        "from protocols.fedcl_server import cluster_centroids\n"
        f"rng = np.random.default_rng({seed}); x = rng.laplace(scale=0.5, size=({n}, {dim}))\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "tracemalloc.start()\n"
        f"t = time.perf_counter(); cluster_centroids(x, {clusters}, {method!r}, rng); s = time.perf_counter() - t\n"
        "traced = tracemalloc.get_traced_memory()[1]; tracemalloc.stop()\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'seconds': s, 'peak_rss_mb': peak / 1024, 'traced_peak_mb': traced / 2**20}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode:
        return {"n": n, "method": method, "error": proc.stderr.strip().splitlines()[-1]}
    return {"n": n, "method": method, "condensed_mb": n * (n - 1) / 2 * 8 / 2**20,
            **json.loads(proc.stdout.strip().splitlines()[-1])}


def signal_to_noise(data: str, rounds: int, seed: int = 0, overrides: dict[str, Any] | None = None,
                    sections: dict[str, dict[str, Any]] | None = None) -> dict[str, float]:
    """How much of a user survives in FedCL's cached embeddings after ``rounds`` rounds of ``fedcl``.

    Returns the median L2 norms of the clipped (noise-free) embedding and of the noise in the cache,
    the same for the Ward centroid (its members' mean clean embedding against the rest), and how
    much the top-R% candidate set of a client's noisy centroid overlaps its own noise-free top-R%
    set, against a random other user's set and against the noise-free Ward centroid's set. The
    cache holds each client's latest upload, made with the model of that round; the noise is
    measured against the current model's embedding, so the drift of older uploads counts as noise.
    """
    from protocols.fedcl_server import cluster_centroids, hard_candidates

    cfg = cfgmod.merge(cfgmod.load_preset("fedcl"), {**(sections or {}), "data": {"source": data},
                                                      "run": {"seed": seed}, "eval": {"negatives": 0}})
    prep = prepare_data(cfg)
    pc = cfg.protocol_config.__class__(**{**cfg.protocol_config.__dict__, "secure_aggregation": "none",
                                          **(overrides or {})})
    from protocols.fedcl import FedCL

    tr = FedCL(prep.split.train, pc, seed=seed, exclude=prep.exclude)
    for _ in range(rounds):
        tr.run_round()
    users = np.flatnonzero(tr.has_cache)
    with torch.no_grad():
        u = tr.user_embeddings(users).double().numpy()
    clean = u * np.minimum(1.0, pc.clip / np.abs(u).sum(1, keepdims=True))
    noisy = tr.cache[users]
    rng = np.random.default_rng(seed)
    cent, lab = cluster_centroids(noisy, pc.clusters, pc.clustering, rng)
    k = lab.max() + 1
    sig = (np.stack([clean[lab == c].mean(0) for c in range(k)]))[lab]
    item = tr.model.item.detach().double().numpy()

    def overlap(a: np.ndarray, b: np.ndarray) -> float:
        ca, cb = hard_candidates(a, item, pc.hard_percent), hard_candidates(b, item, pc.hard_percent)
        return float(np.mean([np.intersect1d(x, y).size / x.size for x, y in zip(ca, cb)]))

    med = lambda a: float(np.median(np.linalg.norm(a, axis=1)))  # noqa: E731
    return {"rounds": rounds, "epsilon": pc.epsilon, "signal_l2": med(clean), "noise_l2": med(noisy - clean),
            "centroid_signal_l2": med(sig), "centroid_noise_l2": med(cent - sig),
            "overlap_own": overlap(cent, clean), "overlap_random_user": overlap(cent, clean[rng.permutation(len(clean))]),
            "overlap_noise_free_ward": overlap(cluster_centroids(clean, pc.clusters, pc.clustering, rng)[0], clean),
            "overlap_chance": pc.hard_percent / 100.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.fedcl_study", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train variants x seeds, append JSON lines")
    r.add_argument("--data", required=True, help="dataset path, or 'synthetic'")
    r.add_argument("--variant", action="append", required=True, metavar="NAME=PRESET[:k=v,...]")
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--rounds", type=int, required=True)
    r.add_argument("--out", required=True, metavar="FILE.jsonl")
    r.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    s = sub.add_parser("summary", help="tables, paired tests and a PNG from study JSON lines")
    s.add_argument("files", nargs="+")
    s.add_argument("--reference", help="variant the others are compared with")
    s.add_argument("--png")
    s.add_argument("--title", default="FedCL on ml-latest-small")
    s.add_argument("--json", action="store_true")
    s.add_argument("--eps", nargs="*", default=[], metavar="VARIANT=EPS",
                   help="with --eps-png: the FedCL variants of an epsilon sweep and their epsilon (inf: no noise)")
    s.add_argument("--lines", nargs="*", default=[], metavar="VARIANT", help="with --eps-png: reference variants")
    s.add_argument("--eps-png")
    c = sub.add_parser("cluster-cost", help="seconds and peak memory of Ward / k-means against the cache size")
    c.add_argument("--sizes", type=int, nargs="+", default=[610, 2000, 4000, 8000])
    c.add_argument("--methods", nargs="+", default=["ward", "kmeans"])
    n = sub.add_parser("snr", help="signal against LDP noise in the cache and its centroids, candidate-set overlap")
    n.add_argument("--data", required=True)
    n.add_argument("--rounds", type=int, default=30)
    n.add_argument("--epsilon", type=float, nargs="+", default=[4.0])
    n.add_argument("--set", default="", metavar="k=v,...",
                   help="more [fedcl] overrides, TOML values (e.g. logq=true,local_negatives=100,local_pool=1000)")
    args = p.parse_args(argv)
    if args.cmd == "snr":
        extra = parse_variant(f"snr=fedcl:{args.set}")[2]
        for eps in args.epsilon:
            ov = {"lr": 0.01, **extra, "epsilon": eps}
            print(jsonio.dumps(signal_to_noise(args.data, args.rounds, overrides=ov)), flush=True)
        return 0
    if args.cmd == "cluster-cost":
        print("| cached embeddings | method | seconds (with tracemalloc) | peak memory of the call (MB) "
              "| process peak RSS (MB) | Ward condensed matrix (MB) |")
        print("|---|---|---|---|---|---|")
        for n in args.sizes:
            for m in args.methods:
                r = cluster_cost(n, m)
                if "error" in r:
                    print(f"| {n} | {m} | refused: {r['error']} | | | |", flush=True)
                else:
                    print(f"| {n} | {m} | {r['seconds']:.2f} | {r['traced_peak_mb']:.0f} | {r['peak_rss_mb']:.0f} "
                          f"| {r['condensed_mb']:.0f} |", flush=True)
        return 0
    if args.cmd == "run":
        torch.set_num_threads(args.threads)
        variants = [parse_variant(v) for v in args.variant]
        out = Path(args.out)
        done = set()
        if out.exists():
            done = {(d["variant"], d["seed"]) for d in map(json.loads, out.read_text().splitlines()) if d}
        for seed in args.seeds:
            for name, preset, ov in variants:
                if (name, seed) in done:
                    continue
                row = {"variant": name, **run_variant(args.data, preset, ov, seed, args.rounds)}
                with out.open("a") as f:
                    f.write(jsonio.dumps(row) + "\n")
                print(f"{name} seed {seed}: HR@10 {row['HR@10']:.4f} NDCG@10 {row['NDCG@10']:.4f} "
                      f"({row['seconds_train']} s) {row.get('privacy', '')}", flush=True)
        return 0
    rows = [json.loads(line) for f in args.files for line in Path(f).read_text().splitlines() if line]
    text, table = summarize(rows, args.reference)
    print(text)
    if args.png:
        _plot(table, args.png, args.title)
    if args.eps_png:
        eps_of = {k: float(v) for k, v in (e.split("=", 1) for e in args.eps)}
        priv = {}
        for name in eps_of:
            ps = [r["privacy"]["eps_median"] for r in rows if r["variant"] == name and r.get("privacy")]
            if ps:
                priv[name] = float(np.mean(ps))
        plot_epsilon_sweep(table, eps_of, args.lines, args.eps_png, priv)
    if args.json:
        print(jsonio.dumps({n: {k: v for k, v in t.items()} for n, t in table.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
