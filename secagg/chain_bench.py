"""Cost of the circular chain against plaintext summation and the machine's PRG throughput.

Run ``python -m secagg.chain_bench --help``. For every ``(n, dim, dropout)`` it runs the chain
through :func:`secagg.runner.run` (dropped clients leave after the key/seed exchange and before
sending their masked input, the runner's ``masked_input`` stage, i.e. the expensive case that
forces a re-run among survivors), runs ``plain`` on the same inputs, and measures in the same
process the PRG bound of a client: the time to AES-CTR-expand the ``2 s + 1`` masks per attempt a
surviving client needs (``s`` sent, ``s`` received, its pad), and the server's: expanding the ``m``
pads it strips from the final sum (``prg_bound_server_s``; it expands no ring mask).
``client_s`` is the median over surviving clients (all their
attempts), ``server_s`` the server's total. Prints a table on stderr and one JSON object (``{"rows": [...]}``)
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
from secagg.chain_wire import Kind, message_size
from secagg.encoding import sign_extend
from secagg.runner import INPUT_STAGE, RunSpec, run

__all__ = ["bench_one", "breakdown", "main", "prg_seconds"]


def prg_seconds(dim: int, count: int, *, repeat: int = 5) -> float:
    """Median over ``repeat`` trials of the seconds to AES-CTR-expand ``count`` fresh seeds into
    ``dim`` words, accumulated into one warm buffer (the throughput bound: no allocation)."""
    if count == 0:
        return 0.0
    seeds = [os.urandom(32) for _ in range(count)]
    out = np.zeros(dim, dtype=np.uint64)
    trials = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for seed in seeds:
            prg.expand_into(seed, out, label=b"bench")
        trials.append(time.perf_counter() - t0)
    return float(np.median(trials))


def bench_one(n: int, dim: int, dropout: float, *, s: int = 1, seed: int = 0, ring_bits: int = 64) -> dict:
    """Measure one configuration (in ``Z_2^ring_bits``); returns a JSON-able row."""
    rng = np.random.default_rng(seed)  # CSPRNG-OK: benchmark inputs and dropout choice (simulation)
    inputs = rng.integers(0, 2**64, (n, dim), dtype=np.uint64)
    dropped = frozenset(rng.choice(n, size=int(round(dropout * n)), replace=False).tolist())
    spec = RunSpec(k=s, dropouts={INPUT_STAGE: dropped} if dropped else {}, ring_bits=ring_bits)
    res = run("chain", inputs, spec)
    survivors = sorted(res.survivors)
    expected = sign_extend(inputs[survivors].sum(axis=0, dtype=np.uint64) & np.uint64(2**ring_bits - 1), ring_bits)
    correct = res.total is not None and np.array_equal(res.total, expected)
    plain = run("plain", inputs, RunSpec(k=s, dropouts=spec.dropouts))
    attempts = 2 if dropped else 1
    s_eff = min(s, n - 1)
    bound = prg_seconds(dim, (2 * s_eff + 1) * attempts)
    server_bound = prg_seconds(dim, res.masks_expanded, repeat=3)
    # median over surviving clients: robust to preemption by other processes on a shared machine
    client_med = float(np.median(res.client_s[survivors])) if survivors else float("nan")
    return {
        "protocol": "chain",
        "clients": n,
        "dim": dim,
        "dropout": dropout,
        "k": s_eff,
        "t": None,
        "attempts": attempts,
        "ring_bits": ring_bits,
        "upload_bytes": message_size(Kind.UPLOAD, dim=dim, ring_bits=ring_bits),
        "bytes_per_value": ring_bits // 8,
        "client_s": client_med,
        "client_s_mean": float(np.mean(res.client_s[survivors])) if survivors else float("nan"),
        "server_s": res.server_s,
        "bytes_per_client": float(np.mean(res.bytes_sent[survivors])) if survivors else 0.0,
        "bytes_server": res.bytes_server_received,
        "bytes_server_sent": res.bytes_server_sent,
        "plain_client_s": float(np.median(plain.client_s[sorted(plain.survivors)])),
        "plain_server_s": plain.server_s,
        "plain_bytes_per_client": float(np.mean(plain.bytes_sent[sorted(plain.survivors)])),
        "prg_bound_client_s": bound,
        "client_over_prg_bound": client_med / bound if bound else None,
        "prg_bound_server_s": server_bound,
        "server_over_prg_and_plain": res.server_s / (server_bound + plain.server_s)
        if server_bound + plain.server_s else None,
        "server_over_plain": res.server_s / plain.server_s if plain.server_s else None,
        "correct": bool(correct),
        "abort": res.abort,
    }


def breakdown(dim: int, *, n: int = 30, s: int = 1, repeats: int = 3) -> dict[str, float]:
    """Median milliseconds per client of each stage method (client and server), no dropouts."""
    from secagg.chain import ChainClient, ChainConfig
    from secagg.chain_server import ChainServer

    rng = np.random.default_rng(0)  # CSPRNG-OK: benchmark inputs
    x = rng.integers(0, 2**64, (n, dim), dtype=np.uint64)
    acc: dict[str, list[float]] = {}

    def timed(name, fn, *a):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = fn(*a)
        acc.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    for _ in range(repeats):
        config = ChainConfig(instance=os.urandom(16), round=0, dim=dim, successors=min(s, n - 1))
        clients = {i: ChainClient(config, i, x[i]) for i in range(n)}
        server = ChainServer(config, clients)
        for c in clients.values():
            timed("server.receive_advert", server.receive, timed("client.advertise", c.advertise))
        step = timed("server.close_advertise", server.close)
        for i, m in step.messages.items():
            timed("server.receive_bundle", server.receive, timed("client.share", clients[i].share, m))
        step = timed("server.close_share", server.close)
        for i, m in step.messages.items():
            timed("server.receive_upload", server.receive, timed("client.upload", clients[i].upload, m))
        step = timed("server.close_upload", server.close)
        for i, m in step.messages.items():
            timed("server.receive_unlock", server.receive, timed("client.unlock", clients[i].unlock, m))
        timed("server.close_unlock", server.close)
    out = {k: float(np.median(v)) * 1e3 / (n if k.startswith("server.close") else 1) for k, v in acc.items()}
    out["prg_bound_client"] = prg_seconds(dim, 2 * min(s, n - 1) + 1) * 1e3
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m secagg.chain_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--dims", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.3])
    parser.add_argument("--successors", type=int, default=1, help="s (default 1, the paper's chain)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated inputs and dropout choice")
    parser.add_argument("--ring-bits", type=int, choices=(32, 64), default=64,
                        help="the ring: 64 (default) or 32 (4 bytes per value; secagg.encoding.choose_ring_bits "
                             "says when a real sum fits)")
    parser.add_argument("--breakdown", type=int, metavar="DIM", default=None,
                        help="instead: median ms per client of every stage method at this dim (30 clients)")
    args = parser.parse_args(argv)
    if args.breakdown is not None:
        if args.breakdown < 1:
            print(f"chain_bench: error: --breakdown must be positive; found {args.breakdown}", file=sys.stderr)
            return 2
        parts = breakdown(args.breakdown, s=args.successors)
        for k, v in parts.items():
            print(f"{k:>24} {v:8.3f} ms", file=sys.stderr)
        print(json.dumps({"dim": args.breakdown, "successors": args.successors, "ms_per_client": parts}))
        return 0
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
                r = bench_one(n, dim, f, s=args.successors, seed=args.seed, ring_bits=args.ring_bits)
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
