"""``secagg bench aggregation``: cost and correctness of one secure aggregation.

Runs one protocol from :data:`secagg.runner.PROTOCOLS` in-process on ``--clients`` clients with
``--dim``-long vectors (uniform reals in [-1, 1], fixed point with 24 fractional bits). A fraction
``--dropout`` of the clients (chosen at random) drops after key sharing and before sending its
masked input, the expensive case for the server. For SecAgg+ without ``--k``/``--t``, ``--dropout``
and ``--corrupt`` also choose ``k`` and ``t`` (:func:`secagg.params.choose`: abort probability
<= 2^-20 with that many dropouts, security failure <= 2^-40 with that fraction of clients
colluding with the server); the chosen ``k`` and ``t`` and their guarantees are printed first, and
combinations that cannot meet both targets are refused with an error naming the fix. ``t`` at or
below half of a client's holders is refused unless ``--unsafe-threshold`` is given. Reported:

* ``client_s``: mean seconds per surviving client (all its stages), ``client_s_max`` over all;
* ``server_s``: server seconds (all stages, including summing the uploads);
* ``bytes_per_client`` (mean sent by a surviving client), ``bytes_server`` (received),
  ``bytes_server_sent``;
* ``abort_bound``, ``abort_bound_independent``, ``security_bound``, ``guarantees`` (secagg and
  secagg+): the bounds of :func:`secagg.params.evaluate` for the ``k`` and ``t`` used;
* ``correct``: the decoded sum equals the plaintext sum of the survivors' encodings exactly in
  Z_(2^64) and the real sum within quantisation error (false after an abort);
* ``plain_s``: server seconds of the ``plain`` protocol on the same inputs and survivors;
* ``prg_bound_s``: seconds to expand, with AES-256-CTR, as many ``dim``-long masks as the server
  expanded (``masks``), measured in the same run: the throughput bound of any pairwise-mask server;
  ``kex_bound_s``: seconds for the server's ``key_agreements`` X25519+HKDF evaluations (one per
  mask shared between a dropped client and a survivor); ``sig_bound_s``: seconds for its
  ``signatures_verified`` Ed25519 checks; ``ratio_crypto_bound`` compares ``server_s`` with
  ``prg_bound_s + kex_bound_s + sig_bound_s + plain_s``;
* with ``--flower``: Flower's SecAgg+ workflow run in-process on the same n, d, dropout, k and t
  (``num_shares = k + 1``, since Flower counts the client itself), in a separate interpreter
  (``--flower-python``, default ``$SECAGG_FLOWER_PYTHON``, else this interpreter when the
  ``flower`` extra is installed, else ``/tmp/flwr-venv/bin/python``); ``flower_server_s`` and
  ``flower_ratio``. ``secagg bench flower`` compares Flower's SecAgg+ with ours *inside* Flower.
  Flower's default threshold (11 of 31 shares) is below half the holders: comparing at its
  parameters needs ``--k 30 --t 11 --unsafe-threshold``.

Times are wall-clock on a shared machine: rerun to check noise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments import jsonio
from secagg.defaults import DEFAULT_CORRUPT

__all__ = ["FLOWER_HARNESS", "bench", "bench_client_masking", "register"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; found {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1); found {text}")
    return value


#: :data:`secagg.runner.PROTOCOLS` (and ``chain``), named here so that ``--help`` need not import the
#: runner (tests/experiments/test_cli_fast.py checks that they agree).
BENCH_PROTOCOLS = ("chain", "plain", "secagg", "secagg+")


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``aggregation`` to ``secagg bench``."""
    p = bench_subparsers.add_parser(
        "aggregation",
        help="time one secure aggregation (client/server seconds, bytes, PRG bound, Flower)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--protocol", choices=BENCH_PROTOCOLS, default="secagg+")
    p.add_argument("--clients", type=_positive_int, default=100, help="number of clients n (default 100)")
    p.add_argument("--dim", type=_positive_int, default=10_000, help="vector length d (default 10000)")
    p.add_argument("--dropout", type=_fraction, default=0.0,
                   help="fraction dropping before the masked input; secagg+ chooses k and t for it")
    p.add_argument("--corrupt", type=_fraction, default=DEFAULT_CORRUPT,
                   help=f"fraction of clients colluding with the server that secagg+'s k and t must tolerate "
                   f"(default {DEFAULT_CORRUPT})")
    p.add_argument("--k", type=int, default=None,
                   help="neighbours per client (secagg+; default: chosen from --clients, --dropout, --corrupt)")
    p.add_argument("--t", type=int, default=None, help="Shamir threshold (protocol default or choice if omitted)")
    p.add_argument("--unsafe-threshold", action="store_true",
                   help="accept a t at or below half of a client's holders (voids the consistency check; "
                   "attack demonstrations only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated inputs and dropout set")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument(
        "--client-masking-only",
        action="store_true",
        help="secagg/secagg+: run the key stages for all clients, then time only the masking "
        "stage of a few clients (--sample) on a --dim vector (no n x dim input matrix is built)",
    )
    p.add_argument("--sample", type=_positive_int, default=5, help="clients timed by --client-masking-only")
    p.add_argument("--flower", action="store_true", help="also run Flower's SecAgg+ on the same parameters")
    p.add_argument(
        "--flower-python",
        default=os.environ.get("SECAGG_FLOWER_PYTHON") or _default_flower_python(),
        help="interpreter with flwr installed (default $SECAGG_FLOWER_PYTHON, else this interpreter when the "
        "flower extra is installed, else /tmp/flwr-venv/bin/python); `secagg bench flower` runs both in-process",
    )
    p.set_defaults(func=_main)


def _default_flower_python() -> str:
    """This interpreter if it has flwr (``pip install -e '.[flower]'``), else the old side venv."""
    import importlib.util

    return sys.executable if importlib.util.find_spec("flwr") is not None else "/tmp/flwr-venv/bin/python"


def _prg_bound(masks: int, dim: int) -> float:
    """Seconds to produce ``masks`` AES-256-CTR keystreams of ``dim`` uint64 words."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    zeros = bytes(8 * dim)
    seed = os.urandom(32)
    t0 = time.perf_counter()
    for i in range(masks):
        enc = Cipher(algorithms.AES(seed), modes.CTR(i.to_bytes(16, "big"))).encryptor()
        enc.update(zeros)
    return time.perf_counter() - t0


def _kex_bound(count: int) -> float:
    """Seconds for ``count`` X25519 exchanges + HKDF-SHA256 (the server's unavoidable key work)."""
    from secagg.keys import KeyPair

    a, b = KeyPair.generate(), KeyPair.generate()
    t0 = time.perf_counter()
    for _ in range(count):
        a.agree(b.public_bytes, info=b"bench")
    return time.perf_counter() - t0


def _sig_bound(count: int) -> float:
    """Seconds for ``count`` Ed25519 verifications (the server's robustness checks)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    sk = Ed25519PrivateKey.generate()
    pk, sig = sk.public_key(), sk.sign(b"bench")
    t0 = time.perf_counter()
    for _ in range(count):
        pk.verify(sig, b"bench")
    return time.perf_counter() - t0


def _guarantees(protocol: str, n: int, dropout: float, corrupt: float, k: int | None, t: int | None):
    """The (k, t) a masking protocol will use and their guarantees (None for plain and chain)."""
    from secagg import params

    if protocol == "secagg+" and t is None:
        return params.choose(n, dropout=dropout, corrupt=corrupt) if k is None else params.choose_t(
            n, k, dropout=dropout, corrupt=corrupt)
    if protocol == "secagg+" and k is not None and 1 <= t <= min(k, n - 1) + 1:
        return params.evaluate(n, k, t, dropout=dropout, corrupt=corrupt)
    if protocol == "secagg":
        tt = (2 * n) // 3 + 1 if t is None else t
        return params.evaluate(n, n - 1, tt, dropout=dropout, corrupt=corrupt) if 1 <= tt <= n else None
    return None


def bench(
    protocol: str, n: int, dim: int, dropout: float, *, k: int | None = None, t: int | None = None, seed: int = 0,
    corrupt: float = DEFAULT_CORRUPT, unsafe_threshold: bool = False,
) -> dict:
    """Run the benchmark and return the JSON-able result (see the module docstring)."""
    import numpy as np

    from secagg.encoding import FixedPoint, check_budget
    from secagg.runner import INPUT_STAGE, PROTOCOLS, RunSpec, run

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} is not available in this build; choose one of {sorted(PROTOCOLS)}.")
    if n < 2:
        raise ValueError(f"--clients must be at least 2; found {n}.")
    rng = np.random.default_rng(seed)  # CSPRNG-OK: simulated inputs and dropout choice only
    codec = FixedPoint(24, 1.0)
    check_budget(n_summands=n, clip=codec.clip, frac_bits=codec.frac_bits)
    values = rng.uniform(-1.0, 1.0, size=(n, dim))
    enc = codec.encode(values, rounding="nearest")
    dropped = frozenset(int(i) for i in rng.permutation(n)[: int(round(dropout * n))])
    g = _guarantees(protocol, n, dropout, corrupt, k, t)
    if g is not None:
        print(f"{protocol} parameters: {g.summary()}", file=sys.stderr)
        if protocol == "secagg+":
            k, t = g.k, g.t
    # shared_work=False: every client is timed as its own device (a device verifies and agrees itself)
    spec = RunSpec(k=k, t=t, dropouts={INPUT_STAGE: dropped}, dropout=dropout, corrupt=corrupt,
                   unsafe_threshold=unsafe_threshold, shared_work=False)
    print(f"running {protocol}: n={n} d={dim} dropout={dropout} ({len(dropped)} clients)", file=sys.stderr)
    res = run(protocol, enc, spec)
    survivors = sorted(res.survivors)
    correct = False
    if res.ok:
        exact = enc[survivors].sum(axis=0)
        real_err = np.max(np.abs(codec.decode(res.total) - values[survivors].sum(axis=0))) if survivors else 0.0
        correct = bool(np.array_equal(res.total, exact) and real_err <= len(survivors) * 2.0**-codec.frac_bits)
    print("running plain baseline", file=sys.stderr)
    plain = run("plain", enc, RunSpec(dropouts={INPUT_STAGE: dropped}))
    print(f"measuring PRG bound ({res.masks_expanded} masks)", file=sys.stderr)
    prg_bound = _prg_bound(res.masks_expanded, dim)
    kex_bound = _kex_bound(res.key_agreements)
    sig_bound = _sig_bound(res.signatures_verified)
    # cost of a client that completes the protocol (dropped clients stop early)
    active = np.zeros(n, dtype=bool)
    active[survivors] = True
    if not active.any():
        active = res.bytes_sent > 0
    out = {
        "protocol": protocol,
        "clients": n,
        "dim": dim,
        "dropout": dropout,
        "dropped": len(dropped),
        "k": res.k,
        "t": res.t,
        "corrupt": corrupt,
        "abort_bound": None if g is None else g.abort,
        "abort_bound_independent": None if g is None else g.abort_independent,
        "security_bound": None if g is None else g.security,
        "guarantees": None if g is None else g.summary(),
        "correct": correct,
        "abort": res.abort,
        "survivors": len(survivors),
        "client_s": float(res.client_s[active].mean()) if active.any() else 0.0,
        "client_s_max": float(res.client_s.max()),
        "server_s": res.server_s,
        "bytes_per_client": float(res.bytes_sent[active].mean()) if active.any() else 0.0,
        "bytes_server": int(res.bytes_server_received),
        "bytes_server_sent": int(res.bytes_server_sent),
        "plain_s": plain.server_s,
        "plain_bytes_per_client": float(plain.bytes_sent[plain.bytes_sent > 0].mean()),
        "masks": res.masks_expanded,
        "prg_bound_s": prg_bound,
        "key_agreements": res.key_agreements,
        "kex_bound_s": kex_bound,
        "signatures_verified": res.signatures_verified,
        "sig_bound_s": sig_bound,
        # ratios only for completed runs (an abort stops before the expensive unmasking)
        "ratio_plain": res.server_s / plain.server_s if res.ok and plain.server_s > 0 else None,
        "ratio_prg_bound": res.server_s / prg_bound if res.ok and prg_bound > 0 else None,
        # PRG + key agreements + signature checks + plain summation: the primitives' floor
        "ratio_crypto_bound": res.server_s / (prg_bound + kex_bound + sig_bound + plain.server_s)
        if res.ok and prg_bound + kex_bound + sig_bound + plain.server_s > 0 else None,
    }
    return out


def bench_client_masking(
    protocol: str, n: int, dim: int, *, k: int | None = None, t: int | None = None, sample: int = 5,
    dropout: float = 0.0, corrupt: float = DEFAULT_CORRUPT, unsafe_threshold: bool = False,
) -> dict:
    """Time one client's masking stage (open shares, self mask, k pairwise masks) at full scale."""
    import numpy as np

    from secagg.bonawitz import MaskingClient, MaskingConfig, MaskingServer, make_pki

    if protocol not in ("secagg", "secagg+"):
        raise ValueError(f"--client-masking-only applies to secagg and secagg+; found {protocol!r}.")
    cfg = (
        MaskingConfig.secagg(n, dim, t=t, unsafe_threshold=unsafe_threshold) if protocol == "secagg"
        else MaskingConfig.secagg_plus(n, dim, k=k, t=t, dropout=dropout, corrupt=corrupt,
                                       unsafe_threshold=unsafe_threshold)
    )
    g = _guarantees(protocol, n, dropout, corrupt, cfg.k, cfg.t)
    if g is not None:
        print(f"{protocol} parameters: {g.summary()}", file=sys.stderr)
    identities, pki = make_pki(n)
    clients = [MaskingClient(cfg, i, identities[i], pki) for i in range(n)]
    server = MaskingServer(cfg, pki)
    print(f"key stages for {n} clients", file=sys.stderr)
    key_s = np.zeros(n)
    for c in clients:
        t0 = time.perf_counter()
        blob = c.advertise().to_bytes()
        key_s[c.id] += time.perf_counter() - t0
        server.receive(blob)
    inbox = server.broadcast_keys()
    for c in clients:
        t0 = time.perf_counter()
        blob = c.share_keys(inbox[c.id]).to_bytes()
        key_s[c.id] += time.perf_counter() - t0
        server.receive(blob)
    inbox = server.forward_shares()
    x = np.frombuffer(os.urandom(8 * dim), dtype=np.uint64)
    times = []
    for c in clients[: min(sample, n)]:
        print(f"masking client {c.id}", file=sys.stderr)
        t0 = time.perf_counter()
        blob = c.mask_input(inbox[c.id], x).to_bytes()
        times.append(time.perf_counter() - t0)
        del blob
    return {
        "protocol": protocol, "clients": n, "dim": dim, "k": cfg.k, "t": cfg.t,
        "client_mask_s": float(np.mean(times)), "client_mask_s_max": float(np.max(times)),
        "client_key_stages_s": float(key_s.mean()), "sampled": len(times),
        "prg_bound_s": _prg_bound(cfg.k + 1, dim),
    }


def _run_flower(python: str, n: int, dim: int, dropout: float, k: int, t: int, seed: int) -> dict:
    if not Path(python).exists():
        raise ValueError(
            f"--flower needs an interpreter with flwr at {python}; create it with "
            "`python3.11 -m venv /tmp/flwr-venv && /tmp/flwr-venv/bin/pip install flwr numpy` "
            "or pass --flower-python."
        )
    args = json.dumps({"n": n, "dim": dim, "dropout": dropout, "num_shares": k + 1, "t": t, "seed": seed})
    print(f"running Flower SecAgg+ in {python}", file=sys.stderr)
    proc = subprocess.run(
        [python, "-c", FLOWER_HARNESS, args], capture_output=True, text=True, check=False, timeout=7200
    )
    if proc.returncode != 0:
        raise ValueError(f"the Flower harness failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _main(args: argparse.Namespace) -> int:
    if args.client_masking_only:
        res = bench_client_masking(args.protocol, args.clients, args.dim, k=args.k, t=args.t, sample=args.sample,
                                   dropout=args.dropout, corrupt=args.corrupt,
                                   unsafe_threshold=args.unsafe_threshold)
        for key, val in res.items():
            print(f"{key:<20}  {val:.6g}" if isinstance(val, float) else f"{key:<20}  {val}")
        if args.json:
            print(jsonio.dumps(res))
        return 0
    out = bench(args.protocol, args.clients, args.dim, args.dropout, k=args.k, t=args.t, seed=args.seed,
                corrupt=args.corrupt, unsafe_threshold=args.unsafe_threshold)
    if args.flower:
        if args.protocol != "secagg+":
            raise ValueError("--flower compares against Flower's SecAgg+: use it with --protocol secagg+.")
        fl = _run_flower(args.flower_python, args.clients, args.dim, args.dropout, out["k"], out["t"], args.seed)
        out.update(
            flower_server_s=fl["server_s"],
            flower_client_s=fl["client_s"],
            flower_correct=fl["correct"],
            flower_version=fl["version"],
            flower_ratio=fl["server_s"] / out["server_s"] if out["server_s"] > 0 else None,
        )
    width = max(len(key) for key in out)
    for key, val in out.items():
        shown = f"{val:.6g}" if isinstance(val, float) else str(val)
        print(f"{key:<{width}}  {shown}")
    if args.json:
        print(jsonio.dumps(out))
    return 0 if out["correct"] or out["abort"] else 1


#: Runs Flower's own SecAggPlusWorkflow stages and secaggplus_mod in one process, with an
#: in-memory Grid; prints one JSON line. Executed by the interpreter that has flwr installed.
FLOWER_HARNESS = r'''
import copy, json, sys, time
import numpy as np
import flwr
from flwr.app import Context, Message, RecordDict, ConfigRecord
from flwr.common import FitRes, Status, Code, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.client_manager import SimpleClientManager
from flwr.server.strategy import FedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key as WKey
from flwr.client.mod import secaggplus_mod
from flwr.serverapp.grid import Grid
from flwr.supercore.task_identity import TaskIdentity
import logging
logging.disable(logging.CRITICAL)
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0

cfg = json.loads(sys.argv[1])
n, dim, dropout = cfg["n"], cfg["dim"], cfg["dropout"]
rng = np.random.default_rng(cfg["seed"])
values = rng.uniform(-1.0, 1.0, size=(n, dim)).astype(np.float64)
node_ids = list(range(1, n + 1))
dropped = {node_ids[i] for i in rng.permutation(n)[: int(round(dropout * n))]}
contexts = {nid: Context(run_id=1, node_id=nid, node_config={}, state=RecordDict(), run_config={}) for nid in node_ids}
client_time = {nid: 0.0 for nid in node_ids}
stage_no = {"i": 0}
transport = {"s": 0.0}

def fit(msg, ctxt):
    nid = msg.metadata.dst_node_id
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([values[nid - 1]]), 1, {})
    return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)

class MemGrid(Grid):
    def set_run(self, run): pass
    def run(self): raise NotImplementedError
    def create_message(self, *a, **k): raise NotImplementedError
    def get_node_ids(self): return node_ids
    def push_messages(self, messages): raise NotImplementedError
    def pull_messages(self, ids): raise NotImplementedError
    def send_and_receive(self, messages, *, timeout=None):
        stage_no["i"] += 1
        replies = []
        for m in messages:
            nid = m.metadata.dst_node_id
            if stage_no["i"] >= 3 and nid in dropped:  # drop after key sharing, before the masked input
                continue
            t0 = time.perf_counter()
            m = copy.deepcopy(m)  # the transport: every node gets its own copy (as if deserialised)
            t1 = time.perf_counter()
            r = secaggplus_mod(m, contexts[nid], fit)
            t2 = time.perf_counter()
            client_time[nid] += t2 - t1
            transport["s"] += t1 - t0
            replies.append(r)
        return replies

grid = MemGrid()
manager = SimpleClientManager()
for nid in node_ids:
    manager.register(GridClientProxy(nid, grid, 1))
strategy = FedAvg(fraction_fit=1.0, min_fit_clients=n, min_available_clients=n, fraction_evaluate=0.0)
ctx = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                    strategy=strategy, client_manager=manager)
ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WKey.CURRENT_ROUND: 1})
ctx.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
    ndarrays_to_parameters([np.zeros(dim)]), keep_input=True)
wf = SecAggPlusWorkflow(num_shares=cfg["num_shares"], reconstruction_threshold=cfg["t"])
state = WorkflowState()
t0 = time.perf_counter()
ok = True
for step in (wf.setup_stage, wf.share_keys_stage, wf.collect_masked_vectors_stage, wf.unmask_stage):
    if not step(grid, ctx, state):
        ok = False
        break
total = time.perf_counter() - t0
server_s = total - sum(client_time.values()) - transport["s"]
correct = False
max_err = None
if ok:
    agg = compat.arrayrecord_to_parameters(ctx.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
    from flwr.common import parameters_to_ndarrays
    got = parameters_to_ndarrays(agg)[0]
    alive = [i for i in range(n) if node_ids[i] not in dropped]
    want = values[alive].mean(axis=0)
    # Flower scales by num_examples / max_weight (1e-3) before its 2^22-level quantisation of
    # [-8, 8], so each value carries up to ~16 / 2^22 / 1e-3 = 3.8e-3 of rounding error.
    max_err = float(np.max(np.abs(got - want)))
    correct = bool(max_err < 5e-3)
active = [client_time[nid] for nid in node_ids if nid not in dropped]
print(json.dumps({"server_s": server_s, "client_s": float(np.mean(active)), "correct": correct, "ok": ok, "max_err": max_err,
                  "version": flwr.__version__}))
'''
