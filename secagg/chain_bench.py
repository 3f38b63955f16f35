"""Cost of the circular chain against plaintext summation and the machine's PRG throughput.

Run ``python -m secagg.chain_bench --help``. For every ``(n, dim, dropout)`` it runs the chain
through :func:`secagg.runner.run` (dropped clients leave after the key/seed exchange and before
sending their masked input, the runner's ``masked_input`` stage, i.e. the expensive case that
forces a re-run among survivors), runs ``plain`` on the same inputs, and measures in the same
process the PRG bound of a client: the time to AES-CTR-expand the ``2 s`` masks per attempt a
surviving client needs (``s`` sent, ``s`` received). The chain's server expands no mask, so its
bound is plaintext summation. Prints a table on stderr and one JSON object (``{"rows": [...]}``)
as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from secagg import prg
from secagg.runner import INPUT_STAGE, RunSpec, run

__all__ = ["bench_one", "main", "prg_seconds"]


def prg_seconds(dim: int, count: int, *, repeat: int = 3) -> float:
    """Best-of-``repeat`` seconds to expand ``count`` fresh seeds into ``dim`` words (accumulated)."""
    if count == 0:
        return 0.0
    seeds = [os.urandom(32) for _ in range(count)]
    out = np.zeros(dim, dtype=np.uint64)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for seed in seeds:
            prg.expand_into(seed, out, label=b"bench")
        best = min(best, time.perf_counter() - t0)
    return best


def bench_one(n: int, dim: int, dropout: float, *, s: int = 1, seed: int = 0) -> dict:
    """Measure one configuration; returns a JSON-able row."""
    rng = np.random.default_rng(seed)  # CSPRNG-OK: benchmark inputs and dropout choice (simulation)
    inputs = rng.integers(0, 2**64, (n, dim), dtype=np.uint64)
    dropped = frozenset(rng.choice(n, size=int(round(dropout * n)), replace=False).tolist())
    spec = RunSpec(k=s, dropouts={INPUT_STAGE: dropped} if dropped else {})
    res = run("chain", inputs, spec)
    survivors = sorted(res.survivors)
    correct = res.total is not None and np.array_equal(res.total, inputs[survivors].sum(axis=0, dtype=np.uint64))
    plain = run("plain", inputs, spec)
    attempts = 2 if dropped else 1
    s_eff = min(s, n - 1)
    bound = prg_seconds(dim, 2 * s_eff * attempts)
    client_mean = float(np.mean(res.client_s[survivors])) if survivors else float("nan")
    return {
        "protocol": "chain",
        "clients": n,
        "dim": dim,
        "dropout": dropout,
        "k": s_eff,
        "t": None,
        "attempts": attempts,
        "client_s": client_mean,
        "server_s": res.server_s,
        "bytes_per_client": float(np.mean(res.bytes_sent[survivors])) if survivors else 0.0,
        "bytes_server": res.bytes_server_received,
        "bytes_server_sent": res.bytes_server_sent,
        "plain_client_s": float(np.mean(plain.client_s[sorted(plain.survivors)])),
        "plain_server_s": plain.server_s,
        "plain_bytes_per_client": float(np.mean(plain.bytes_sent[sorted(plain.survivors)])),
        "prg_bound_client_s": bound,
        "client_over_prg_bound": client_mean / bound if bound else None,
        "server_over_plain": res.server_s / plain.server_s if plain.server_s else None,
        "correct": bool(correct),
        "abort": res.abort,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m secagg.chain_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--dims", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.3])
    parser.add_argument("--successors", type=int, default=1, help="s (default 1, the paper's chain)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated inputs and dropout choice")
    args = parser.parse_args(argv)
    for name in ("clients", "dims"):
        if any(v < 1 for v in getattr(args, name)):
            print(f"chain_bench: error: --{name} must be positive; found {getattr(args, name)}", file=sys.stderr)
            return 2
    if any(not 0 <= f < 1 for f in args.dropouts):
        print(f"chain_bench: error: --dropouts must lie in [0, 1); found {args.dropouts}", file=sys.stderr)
        return 2
    rows = []
    head = f"{'n':>5} {'dim':>7} {'drop':>4} {'client_s':>9} {'prg_s':>8} {'x':>5} {'server_s':>8} {'plain_s':>8} {'x':>5} {'B/client':>9} ok"
    print(head, file=sys.stderr)
    for n in args.clients:
        for dim in args.dims:
            for f in args.dropouts:
                r = bench_one(n, dim, f, s=args.successors, seed=args.seed)
                rows.append(r)
                print(
                    f"{n:>5} {dim:>7} {f:>4.1f} {r['client_s']:>9.5f} {r['prg_bound_client_s']:>8.5f} "
                    f"{r['client_over_prg_bound']:>5.2f} {r['server_s']:>8.4f} {r['plain_server_s']:>8.4f} "
                    f"{r['server_over_plain']:>5.2f} {r['bytes_per_client']:>9.0f} {r['correct']}",
                    file=sys.stderr,
                )
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
