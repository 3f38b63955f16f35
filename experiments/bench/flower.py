"""``secagg bench flower``: Flower's own SecAgg+ against ours, both inside Flower, one run.

Both run in this process over the same in-process Grid (:class:`fedflower.loopback.LoopbackGrid`:
every message and every node's Context goes through Flower's protobuf, as over the network), with
Flower's client manager, ``FedAvg`` strategy and ``ClientApp``; only the workflow and the mod differ:

* **flower**: ``flwr.server.workflow.SecAggPlusWorkflow(num_shares=k + 1, reconstruction_threshold=t)``
  and ``flwr.client.mod.secaggplus_mod`` (Flower's defaults otherwise: clip 8, 2^22 quantisation
  levels, masks mod 2^32, max_weight 1000);
* **ours**: :class:`fedflower.secagg_workflow.SecAggWorkflow` (SecAgg+, same ``k`` and ``t``, 32
  fractional bits in Z_2^64, deterministic rounding so the sum can be checked exactly) and
  :func:`fedflower.secagg_mod.secagg_mod`.

The same ``--clients`` nodes hold the same updates (uniform in [-1, 1], float32, ``--dim`` values,
one example each); a ``--dropout`` fraction, the same nodes for both, stops answering after key
sharing, before its masked input (the expensive case: the server must rebuild their pairwise
masks). Without ``--k``/``--t``, both come from :func:`secagg.params.choose` for ``n``,
``--plan-dropout`` (default: ``--dropout``, at least 0.1, the workflow's default plan; Flower needs
``t < k + 1``, which a plan for no dropout at all does not give) and ``--corrupt``. Our nodes are
configured as an operator would (node config ``max-dropout`` = the plan, ``unsafe-threshold`` =
``--unsafe-threshold``): a ``--dropout`` above ``--plan-dropout`` makes them refuse to sign the
survivor set, and our side aborts. Reported per side:

* ``server_s``: wall seconds of the workflow minus the seconds inside the ClientApps and the
  (de)serialisation of messages and contexts (the transport);
* ``client_s``: mean seconds inside the ClientApp (mod + fit) of a node that finished the round;
* ``bytes_per_client``: serialised Flower messages, both directions, per sampled node;
* ``correct``: the aggregate equals the plaintext mean of the survivors' updates (Flower: within
  its quantisation error, 5e-3; ours: the exact Z_2^64 sum of the survivors' encodings and the
  mean within 1e-5); ``max_err``;
* ``ratio_server``/``ratio_client``: Flower's seconds over ours.

Times are wall-clock; on a shared machine rerun to check noise.

``--flower-floor`` adds a lower bound on Flower's side without running it, for cells where the full
run takes hours (dropout 0.3 at n >= 500: Flower's pure-Python GF(2^128) Shamir costs O(t (k + 1))
per split and O(t^2) per reconstruction). It times Flower's own primitives one call at a time, at
the cell's ``k``, ``t`` and ``d`` (``create_shares`` of the 32-byte seed and of the serialised
private key, ``combine_shares`` of each from ``t`` shares, one pairwise mask = key agreement +
``pseudo_rand_gen`` + ``parameters_addition``, one private mask), and multiplies by the counts
Flower's code performs (``SecAggPlusWorkflow.unmask_stage`` and ``secaggplus_mod``, Flower 1.x):

* server: every survivor's seed rebuilt and its private mask removed, every dropped node's key
  rebuilt and its ``k`` pairwise masks regenerated (Flower regenerates all ``k``, also those with
  other dropped nodes, which cancel);
* client: every node splits its two secrets into ``k + 1`` shares; a survivor adds ``k`` pairwise
  masks and its private mask.

Everything else Flower does (key generation, share encryption, quantisation, messages, FedAvg) is
left out, so ``flower_server_floor_s`` and ``flower_client_floor_s`` (mean per surviving node)
are lower bounds on ``flower_server_s`` and ``flower_client_s`` measured under the same load; with
``--only ours`` the result adds ``ratio_server_floor`` (a lower bound on Flower / ours).
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from typing import TYPE_CHECKING

from experiments import jsonio
from experiments.bench.aggregation import _fraction, _guarantees, _positive_int
from secagg.defaults import DEFAULT_CORRUPT, DEFAULT_DROPOUT

if TYPE_CHECKING:  # numpy is imported where used, so that --help stays fast
    import numpy as np

__all__ = ["bench_flower", "register"]

#: stage number (LoopbackGrid's count) at which dropped nodes go silent, for both workflows:
#: Flower's and ours both send the masked-input request as their third message.
_DROP_STAGE = 3


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``flower`` to ``secagg bench``."""
    p = bench_subparsers.add_parser(
        "flower",
        help="Flower's SecAgg+ vs ours, both inside Flower (server/client seconds, bytes, correct)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--clients", type=_positive_int, default=100, help="number of clients n (default 100)")
    p.add_argument("--dim", type=_positive_int, default=10_000, help="vector length d (default 10000)")
    p.add_argument("--dropout", type=_fraction, default=0.0, help="fraction dropping before the masked input")
    p.add_argument("--plan-dropout", type=_fraction, default=None,
                   help=f"dropout fraction k and t are chosen for (default: max(--dropout, {DEFAULT_DROPOUT}))")
    p.add_argument("--corrupt", type=_fraction, default=DEFAULT_CORRUPT,
                   help=f"colluding fraction k and t must tolerate (default {DEFAULT_CORRUPT})")
    p.add_argument("--k", type=int, default=None, help="neighbours per client (Flower's num_shares - 1)")
    p.add_argument("--t", type=int, default=None, help="Shamir threshold (Flower's reconstruction_threshold)")
    p.add_argument("--unsafe-threshold", action="store_true",
                   help="let ours accept a t at or below half of a client's holders (demonstrations only)")
    p.add_argument("--only", choices=("both", "flower", "ours"), default="both", help="run one side only")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated updates and dropout set")
    p.add_argument("--flower-floor", action="store_true",
                   help="add a lower bound on Flower's server and client seconds from its own primitives, timed "
                        "one call at a time (for cells too slow to run; see the description)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def _update(seed: int, nid: int, dim: int) -> np.ndarray:
    import numpy as np

    return np.random.default_rng([seed, nid]).uniform(-1.0, 1.0, dim).astype(np.float32)  # CSPRNG-OK: data


def _run_side(side: str, n: int, dim: int, k: int, t: int, dropped: set[int], seed: int, unsafe: bool,
              plan: float) -> dict:
    import numpy as np

    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.server.workflow import SecAggPlusWorkflow

    from fedflower.loopback import LoopbackGrid, fit_round, global_parameters
    from fedflower.records import SetupConfig
    from fedflower.secagg_mod import encode_update, secagg_mod
    from fedflower.secagg_workflow import SecAggWorkflow

    nodes = list(range(1, n + 1))

    class Client(NumPyClient):
        def __init__(self, nid: int) -> None:
            self.nid = nid

        def fit(self, parameters, config):  # noqa: ANN001, ANN201
            return [_update(seed, self.nid, dim)], 1, {}

    mod = secaggplus_mod if side == "flower" else secagg_mod
    app = ClientApp(client_fn=lambda ctx: Client(ctx.node_id).to_client(), mods=[mod])
    # our nodes' own settings (node config, never the server's): the planned dropout, the unsafe opt-in
    node_config = {"max-dropout": plan, "unsafe-threshold": unsafe} if side == "ours" else None
    grid = LoopbackGrid(app, nodes, drop=lambda s, nid: s == _DROP_STAGE and nid in dropped,
                        node_config=None if node_config is None else lambda nid: node_config)
    wf = (SecAggPlusWorkflow(num_shares=k + 1, reconstruction_threshold=t) if side == "flower"
          else SecAggWorkflow(num_shares=k + 1, reconstruction_threshold=t, rounding="nearest",
                              unsafe_threshold=unsafe))
    print(f"running {side}: n={n} d={dim} k={k} t={t} dropped={len(dropped)}", file=sys.stderr)
    t0 = time.perf_counter()
    ctx = fit_round(wf, grid, [np.zeros(dim, np.float32)])
    wall = time.perf_counter() - t0
    got = global_parameters(ctx)[0].astype(np.float64)
    alive = [nid for nid in nodes if nid not in dropped]
    want = np.zeros(dim)
    for nid in alive:
        want += _update(seed, nid, dim)
    want /= max(len(alive), 1)
    max_err = float(np.max(np.abs(got - want)))
    exact = None
    if side == "ours":
        rep = wf.last_report
        assert rep is not None
        exact = False
        if rep.total is not None and sorted(rep.survivors) == alive:
            setup = SetupConfig("secagg+", n, dim + 1, t, 1, bytes(16), 0, (), wf.frac_bits, wf.clip, wf.max_weight,
                                "nearest")
            acc = np.zeros(dim + 1, dtype=np.uint64)
            for nid in alive:
                np.add(acc, encode_update(setup, [_update(seed, nid, dim)], 1), out=acc)
            exact = bool(np.array_equal(acc, rep.total))
        correct = bool(exact and max_err <= 1e-5)
    else:
        correct = bool(max_err < 5e-3)  # Flower's quantisation error at its defaults (see bench_aggregation)
    client = [grid.stats.client_s[nid] for nid in alive]
    out = {
        "server_s": wall - sum(grid.stats.client_s.values()) - grid.stats.transport_s,
        "client_s": float(np.mean(client)) if client else 0.0,
        "bytes_per_client": (grid.stats.bytes_down + grid.stats.bytes_up) / n,
        "bytes_up_per_client": grid.stats.bytes_up / n,
        "transport_s": grid.stats.transport_s,
        "correct": correct,
        "max_err": max_err,
    }
    if exact is not None:
        out["exact"] = exact
    del ctx, grid, wf, got
    gc.collect()
    return out


def flower_floor(n: int, dim: int, k: int, t: int, dropped: int, *, reps: int = 3) -> dict:
    """Lower bounds on Flower's SecAgg+ server and client seconds (see the module docstring).

    Returns the unit timings (best of ``reps``), the operation counts and the two floors.
    """
    import os

    import numpy as np
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.common.secure_aggregation.ndarrays_arithmetic import parameters_addition
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import (
        bytes_to_private_key,
        bytes_to_public_key,
        generate_key_pairs,
        private_key_to_bytes,
        public_key_to_bytes,
    )

    from secagg.costmodel import best_of

    mod_range = 1 << 32  # SecAggPlusWorkflow's default modulus_range
    sk, _ = generate_key_pairs()
    _, pk = generate_key_pairs()
    sk_bytes, pk_bytes = private_key_to_bytes(sk), public_key_to_bytes(pk)
    seed = os.urandom(32)  # the size of secaggplus_mod's rd_seed
    vec = [np.zeros(dim, np.int64)]

    def pairwise() -> None:
        key = generate_shared_key(bytes_to_private_key(sk_bytes), bytes_to_public_key(pk_bytes))
        parameters_addition(vec, pseudo_rand_gen(key, mod_range, [(dim,)]))

    def private() -> None:
        parameters_addition(vec, pseudo_rand_gen(seed, mod_range, [(dim,)]))

    seed_shares = create_shares(seed, t, k + 1)
    sk_shares = create_shares(sk_bytes, t, k + 1)
    unit = {
        "split_seed_s": best_of(lambda: create_shares(seed, t, k + 1), reps),
        "split_key_s": best_of(lambda: create_shares(sk_bytes, t, k + 1), reps),
        "combine_seed_s": best_of(lambda: combine_shares(seed_shares[:t]), reps),
        "combine_key_s": best_of(lambda: combine_shares(sk_shares[:t]), reps),
        "pairwise_mask_s": best_of(pairwise, reps),
        "private_mask_s": best_of(private, reps),
    }
    survivors = n - dropped
    counts = {"seed_rebuilds": survivors, "key_rebuilds": dropped, "server_pairwise_masks": dropped * k,
              "server_private_masks": survivors, "client_splits": 2 * n, "client_pairwise_masks": survivors * k}
    server = (survivors * (unit["combine_seed_s"] + unit["private_mask_s"])
              + dropped * (unit["combine_key_s"] + k * unit["pairwise_mask_s"]))
    client_total = (n * (unit["split_seed_s"] + unit["split_key_s"])
                    + survivors * (k * unit["pairwise_mask_s"] + unit["private_mask_s"]))
    return {"unit": unit, "counts": counts, "server_floor_s": server,
            "client_floor_s": client_total / max(survivors, 1)}


def bench_flower(
    n: int, dim: int, dropout: float, *, k: int | None = None, t: int | None = None, seed: int = 0,
    corrupt: float = DEFAULT_CORRUPT, unsafe_threshold: bool = False, only: str = "both",
    plan_dropout: float | None = None, floor: bool = False,
) -> dict:
    """Run the side-by-side benchmark and return the JSON-able result (see the module docstring)."""
    import numpy as np

    try:
        import flwr
    except ImportError as exc:
        raise ValueError("secagg bench flower needs Flower: pip install -e '.[flower]'") from exc
    if n < 3:
        raise ValueError(f"--clients must be at least 3 (Flower's SecAgg+ needs num_shares > 2); found {n}.")
    plan = max(dropout, DEFAULT_DROPOUT) if plan_dropout is None else plan_dropout
    g = _guarantees("secagg+", n, plan, corrupt, k, t)
    if g is not None:
        print(f"secagg+ parameters: {g.summary()}", file=sys.stderr)
        k, t = g.k, g.t
    if k is None or t is None:
        raise ValueError("give both --k and --t, or neither (they are then chosen for --clients and --dropout).")
    if not 2 <= k or not 1 <= t <= k:
        raise ValueError(f"need k >= 2 and 1 <= t <= k (Flower requires t < num_shares = k + 1); found k={k}, "
                         f"t={t}: pass --k/--t or a higher --plan-dropout.")
    rng = np.random.default_rng(seed)  # CSPRNG-OK: dropout choice only
    dropped = {int(i) + 1 for i in rng.permutation(n)[: int(round(dropout * n))]}
    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.getLogger("fedflower").setLevel(logging.ERROR)
    out: dict = {"clients": n, "dim": dim, "dropout": dropout, "plan_dropout": plan, "dropped": len(dropped), "k": k,
                 "t": t,
                 "seed": seed, "flower_version": flwr.__version__,
                 "guarantees": None if g is None else g.summary()}
    for side in ("flower", "ours"):
        if only in ("both", side):
            for key, val in _run_side(side, n, dim, k, t, dropped, seed, unsafe_threshold, plan).items():
                out[f"{side}_{key}"] = val
    if floor:
        print(f"timing Flower's primitives for the floor: k={k} t={t} d={dim}", file=sys.stderr)
        fl = flower_floor(n, dim, k, t, len(dropped))
        out["flower_server_floor_s"] = fl["server_floor_s"]
        out["flower_client_floor_s"] = fl["client_floor_s"]
        out["flower_floor_unit"] = fl["unit"]
        out["flower_floor_counts"] = fl["counts"]
        if "ours_server_s" in out and out["ours_server_s"] > 0:
            out["ratio_server_floor"] = fl["server_floor_s"] / out["ours_server_s"]
    if only == "both":
        out["ratio_server"] = out["flower_server_s"] / out["ours_server_s"] if out["ours_server_s"] > 0 else None
        out["ratio_client"] = out["flower_client_s"] / out["ours_client_s"] if out["ours_client_s"] > 0 else None
        out["ratio_bytes"] = out["flower_bytes_per_client"] / out["ours_bytes_per_client"]
    return out


def _main(args: argparse.Namespace) -> int:
    out = bench_flower(args.clients, args.dim, args.dropout, k=args.k, t=args.t, seed=args.seed,
                       corrupt=args.corrupt, unsafe_threshold=args.unsafe_threshold, only=args.only,
                       plan_dropout=args.plan_dropout, floor=args.flower_floor)
    width = max(len(key) for key in out)
    for key, val in out.items():
        print(f"{key:<{width}}  {f'{val:.6g}' if isinstance(val, float) else val}")
    if args.json:
        print(jsonio.dumps(out))
    return 0 if all(out.get(f"{s}_correct", True) for s in ("flower", "ours")) else 1
