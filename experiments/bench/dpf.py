"""``secagg bench dpf``: the two-server DPF sum (secagg/dpf_sum.py) at a given scale, beside dense SecAgg+.

Each of ``--clients`` clients updates ``--points`` random rows (of ``--dim`` words, random values in
Z_2^64) of an ``--items``-row table and sends one key set to each server; A and B receive, agree
on the survivors, draw the challenge, evaluate and verify every key set (``--no-check`` skips the
verification), and B's share is added to A's. The clients' rows never form a dense matrix. Reported:

* ``upload_bytes_per_client_per_server``: one client's upload to one server (key set and message
  header), the same for every client and every choice of rows; ``key_bytes`` without the header;
* ``client_s``: mean seconds per client (cuckoo placement, key generation, encoding), after the
  process loaded their compiled loops (in ``setup_s``, once per process);
* ``server_s_per_client``: each server's seconds (everything after the uploads: parsing, the
  full-domain evaluations, the check, the digests, B's share and A's sum back in the domain)
  divided by the clients, for A and B, and the larger of the two (``max``: the servers run in
  parallel on their own machines);
* ``evaluate_s_per_client``: the part of it that grows with the clients (each key set's
  full-domain evaluation and check), per client, and ``evaluate_cpu_s_per_client`` (process CPU
  seconds, less sensitive to other load on the machine); ``round_fixed_s``: the rest, once per
  round (allocating the sum, agreeing, mapping the sum out of bucket space, B's ``N x d`` share);
* ``setup_s``: the public layout, its per-position tweaks and the evaluation's per-level indices
  (:meth:`secagg.dpf.Forest.warm`), built once per deployment (not per client or round);
* ``exact``: the sum equals the clients' updates added in Z_2^64;
* ``fused``: the servers evaluated with the compiled loops of :mod:`secagg.dpf_fused` (numba), not
  the numpy path (the fallback where numba does not import);
* ``aes128_ecb_gbps``: fixed-key AES-128 throughput through ``cryptography`` into a preallocated
  buffer, measured in the same run; ``prg_bytes_per_client_per_server``: the AES output one
  server's evaluation of one key set needs (tree: two blocks per expanded node; values:
  ``ceil(dim/2)`` blocks per leaf; check: eight blocks per leaf); ``prg_bound_s_per_client``: the
  two divided, the floor of any implementation of this construction on this machine at this
  throughput; ``server_over_prg_bound``; the same in CPU time (``aes128_ecb_gbps_cpu``,
  ``prg_bound_cpu_s_per_client``, ``evaluate_cpu_over_prg_bound_cpu``: the ratio to quote when other
  jobs share the machine, since both sides are then measured on the same clock);
* ``secagg_plus``: dense SecAgg+ at the same ``n``, items and dim: the ``k`` (and ``t``) its
  parameter choice gives (the complete graph when no ``k`` meets the targets at this ``n``), the
  masked vector a client uploads (``items x dim x 8`` bytes), the mask bytes per neighbour (the
  same), the PRG bytes a client expands (``k + 1`` masks) and their AES-256-CTR bound, and a run of
  the real protocol at ``--secagg-dim`` words (default ``min(items x dim, 2^17)``) scaled linearly
  to the full vector (``scaled_from_dim``: the figures are estimates, say so when quoting them);
* ``targets``: the issue's targets (150 KB per client per server, 0.5 s of server time per client)
  beside the measured figures.

Times are wall-clock on a shared machine: report them as measured under load unless the machine
was idle, and rerun to check noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

__all__ = ["aes_throughput", "bench", "register"]

TARGET_UPLOAD_BYTES = 150_000
TARGET_SERVER_S = 0.5


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; found {text}")
    return value


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``dpf`` to ``secagg bench``."""
    p = bench_subparsers.add_parser(
        "dpf", help="time the two-server DPF sum (bytes, client and server seconds, PRG bound) beside SecAgg+",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=_positive_int, default=100_000, help="table rows N (default 100000)")
    p.add_argument("--dim", type=_positive_int, default=32, help="words per row d (default 32)")
    p.add_argument("--points", type=_positive_int, default=100, help="rows per client P (default 100)")
    p.add_argument("--clients", type=_positive_int, default=8, help="clients n (default 8)")
    p.add_argument("--no-check", action="store_true", help="skip the verification of the key sets")
    p.add_argument("--secagg-dim", type=_positive_int, default=None,
                   help="vector length of the SecAgg+ run that is scaled up (default min(items x dim, 2^17))")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated rows and values")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def aes_throughput(seconds: float = 0.3, *, ctr: bool = False, cpu: bool = False) -> float:
    """Bytes per second of AES through ``cryptography`` into a preallocated 1 MiB buffer (AES-128-ECB,
    the DPF's fixed-key PRG; or AES-256-CTR, SecAgg's mask PRG); per second of process CPU time with
    ``cpu`` (what a loaded machine leaves of the wall clock does not count)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = os.urandom(32 if ctr else 16)
    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16)) if ctr else modes.ECB()).encryptor()
    src = memoryview(bytearray(1 << 20))
    dst = memoryview(bytearray((1 << 20) + 16))
    clock = time.process_time if cpu else time.perf_counter
    done, t0 = 0, clock()
    while clock() - t0 < seconds:
        enc.update_into(src, dst)
        done += 1 << 20
    return done / (clock() - t0)


def bench(items: int, dim: int, points: int, clients: int, *, check: bool = True, seed: int = 0,
          secagg_dim: int | None = None) -> dict:
    """Run the benchmark; the JSON-able result (see the module docstring). Heavy imports happen here,
    not at module import, so ``secagg bench dpf --help`` stays cheap."""
    import numpy as np

    from secagg.cuckoo import CuckooLayout
    from secagg.dpf import gen, prg_bytes_per_key_set
    from secagg.dpf_sum import DpfSumClient, DpfSumConfig, DpfSumServer

    if points > items:
        raise ValueError(f"--points ({points}) cannot exceed --items ({items})")
    if clients < 2:
        raise ValueError(f"--clients must be at least 2 (a sum of one client is its input); found {clients}")
    rng = np.random.default_rng(seed)  # CSPRNG-OK: simulated rows and values only
    t0 = time.perf_counter()
    layout = CuckooLayout.for_points(items, points, seed=bytes(32))
    cfg = DpfSumConfig(clients, layout, dim, points, os.urandom(16), 0, check)
    if check:
        cfg.forest.tweaks()
    cfg.forest.warm(clients)  # the evaluation's public per-level indices, once per deployment
    # a device loads key generation's and placement's compiled loops once per process, not per round
    gen(layout.decoys(), layout.depth, np.zeros((layout.buckets, dim), np.uint64), check=check)
    layout.assign(rng.choice(items, min(points, layout.buckets), replace=False))
    setup_s = time.perf_counter() - t0
    print(f"dpf: N={items} d={dim} P={points} n={clients}: {layout.buckets} buckets, depth {layout.depth}, "
          f"{layout.leaves} leaves per key set; setup {setup_s:.2f} s", file=sys.stderr)
    servers = (DpfSumServer(cfg, 0), DpfSumServer(cfg, 1))
    want = np.zeros((items, dim), np.uint64)
    client_s, upload = [], set()
    for i in range(clients):
        rows = rng.choice(items, points, replace=False)
        vals = rng.integers(0, 2**64, (points, dim), dtype=np.uint64)
        np.add.at(want, rows, vals)
        t0 = time.perf_counter()
        blobs = DpfSumClient(cfg, i).upload(rows, vals)
        client_s.append(time.perf_counter() - t0)
        upload.update(len(b) for b in blobs)
        for b in (0, 1):
            servers[b].receive(blobs[b])
    timers, cpu, evaluate_s, evaluate_cpu = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]

    def timed(b: int, fn, *args):  # noqa: ANN001, ANN202
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn(*args)
        timers[b] += time.perf_counter() - start
        cpu[b] += time.process_time() - start_cpu
        return out

    ids = [timed(b, servers[b].received) for b in (0, 1)]
    timed(0, servers[0].agree, ids[1])
    timed(1, servers[1].agree, ids[0])
    timed(1, servers[1].take_challenge, timed(0, servers[0].draw_challenge))
    digests = []
    for b in (0, 1):
        print(f"dpf: server {'AB'[b]} evaluates {clients} key sets", file=sys.stderr)
        wall, proc = timers[b], cpu[b]
        digests.append(timed(b, servers[b].evaluate))
        evaluate_s[b], evaluate_cpu[b] = timers[b] - wall, cpu[b] - proc
    refused = [timed(b, servers[b].reconcile, digests[1 - b]) for b in (0, 1)]
    total = timed(0, servers[0].combine, timed(1, servers[1].share))
    exact = bool(np.array_equal(total, want)) and refused == [[], []]
    throughput, throughput_cpu = aes_throughput(), aes_throughput(cpu=True)
    prg = prg_bytes_per_key_set(cfg.forest, dim, check)
    per = [timers[0] / clients, timers[1] / clients]
    up = max(upload)
    out = {
        "bench": "dpf", "items": items, "dim": dim, "points": points, "clients": clients, "check": check,
        "buckets": layout.buckets, "depth": layout.depth, "leaves": layout.leaves,
        "upload_bytes_per_client_per_server": up, "key_bytes": cfg.key_bytes(),
        "client_s": float(np.mean(client_s)),
        "server_s_per_client": {"A": per[0], "B": per[1], "max": max(per)},
        "evaluate_s_per_client": {"A": evaluate_s[0] / clients, "B": evaluate_s[1] / clients,
                                  "max": max(evaluate_s) / clients},
        "evaluate_cpu_s_per_client": max(evaluate_cpu) / clients,
        "evaluate_cpu_s_per_client_by_server": {"A": evaluate_cpu[0] / clients, "B": evaluate_cpu[1] / clients},
        "round_fixed_s": {"A": timers[0] - evaluate_s[0], "B": timers[1] - evaluate_s[1]},
        "setup_s": setup_s, "exact": exact, "fused": bool(servers[0].acc.fused),
        "aes128_ecb_gbps": throughput / 1e9, "prg_bytes_per_client_per_server": prg,
        "prg_bound_s_per_client": prg / throughput, "server_over_prg_bound": max(per) / (prg / throughput),
        "evaluate_over_prg_bound": max(evaluate_s) / clients / (prg / throughput),
        "aes128_ecb_gbps_cpu": throughput_cpu / 1e9, "prg_bound_cpu_s_per_client": prg / throughput_cpu,
        "evaluate_cpu_over_prg_bound_cpu": max(evaluate_cpu) / clients / (prg / throughput_cpu),
        "targets": {"upload_bytes": TARGET_UPLOAD_BYTES, "upload_met": up <= TARGET_UPLOAD_BYTES,
                    "server_s_per_client": TARGET_SERVER_S, "server_met": max(per) <= TARGET_SERVER_S,
                    "evaluate_met": max(evaluate_s) / clients <= TARGET_SERVER_S,
                    "evaluate_cpu_met": max(evaluate_cpu) / clients <= TARGET_SERVER_S},
    }
    del servers, total, want
    out["secagg_plus"] = _secagg_plus(clients, items * dim, secagg_dim, seed)
    return out


def _secagg_plus(n: int, words: int, dim: int | None, seed: int) -> dict:
    """Dense SecAgg+ at the same n and vector length: bytes exactly, seconds scaled from a smaller run."""
    import numpy as np

    from secagg import params
    from secagg.encoding import FixedPoint
    from secagg.runner import RunSpec, run

    try:
        g = params.choose(n, dropout=params.DEFAULT_DROPOUT, corrupt=params.DEFAULT_CORRUPT)
        k, t, protocol = g.k, g.t, "secagg+"
    except ValueError:
        k, t, protocol = n - 1, params.min_safe_threshold(n), "secagg"  # too few clients: the complete graph
    small = min(words, 1 << 17) if dim is None else min(dim, words)
    rng = np.random.default_rng(seed + 1)  # CSPRNG-OK: simulated inputs only
    enc = FixedPoint(24, 1.0).encode(rng.uniform(-1, 1, (n, small)), rounding="nearest")
    res = run(protocol, enc, RunSpec(k=k, t=t))
    scale = words / small
    ctr = aes_throughput(ctr=True)
    return {
        "protocol": protocol, "k": k, "t": t,
        "masked_upload_bytes_per_client": 8 * words, "mask_bytes_per_neighbour": 8 * words,
        "client_prg_bytes": 8 * words * (k + 1), "aes256_ctr_gbps": ctr / 1e9,
        "client_prg_bound_s": 8 * words * (k + 1) / ctr,
        "scaled_from_dim": small, "exact_at_that_dim": bool(res.ok),
        "client_s_scaled": float(np.mean(res.client_s)) * scale, "server_s_scaled": float(res.server_s) * scale,
        "server_s_per_client_scaled": float(res.server_s) * scale / n,
    }


def _main(args: argparse.Namespace) -> int:
    out = bench(args.items, args.dim, args.points, args.clients, check=not args.no_check, seed=args.seed,
                secagg_dim=args.secagg_dim)
    s = out["server_s_per_client"]
    d = out["secagg_plus"]
    e = out["evaluate_s_per_client"]
    print(f"upload per client per server: {out['upload_bytes_per_client_per_server']:,} B "
          f"(target {TARGET_UPLOAD_BYTES:,}); client {out['client_s']:.3f} s; server per client A {s['A']:.3f} s, "
          f"B {s['B']:.3f} s, of which evaluation A {e['A']:.3f} s, B {e['B']:.3f} s (target {TARGET_SERVER_S}); "
          f"PRG bound {out['prg_bound_s_per_client']:.3f} s at {out['aes128_ecb_gbps']:.1f} GB/s; exact {out['exact']}")
    print(f"dense {d['protocol']} (k={d['k']}): {d['masked_upload_bytes_per_client']:,} B upload, "
          f"{d['mask_bytes_per_neighbour']:,} B of mask per neighbour, client PRG bound {d['client_prg_bound_s']:.2f} s, "
          f"server {d['server_s_per_client_scaled']:.3f} s per client (scaled from d={d['scaled_from_dim']})")
    if args.json:
        print(json.dumps(out))
    return 0 if out["exact"] else 1
