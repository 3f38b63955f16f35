"""``secagg bench secure``: every secure preset's round beside the bound its cryptography must pay.

For each preset (default: every preset whose protocol section sets a secure aggregation other than
``"none"``), the bench prepares the preset's data (``--data``, default the embedded synthetic data),
builds the protocol as ``secagg run`` does, and times ``--rounds`` rounds. Every secure-aggregation
instance a round runs (:func:`protocols.secure_sum.observe`) is priced by :mod:`secagg.costmodel` at
unit costs measured at the start of the same run (AES-CTR into a preallocated buffer, X25519+HKDF,
Ed25519, Shamir, SHA-256, uint64 adds), in process CPU seconds (the least distorted clock on a shared
machine; equal to wall-clock on a quiet one). Per round it reports:

* ``instances``: secure sums run, with their ``n``, ``k``, ``t`` and ``dim`` (``shapes``; ``reused`` marks
  an instance of a key setup shared with the round's earlier sums, :mod:`secagg.reuse`);
* ``device_bound_s``: the largest per-client bound summed over the instances that client took part
  in: what the slowest real device must spend on cryptography in that round;
* ``simulation_bound_s``: every client's bound plus the server's (one process simulates them all);
  ``server_bound_s`` the server's part;
* ``secure_measured_s``: the seconds the instances reported (every client's protocol work plus the
  server's), and ``secure_over_bound`` = measured / simulation bound;
* ``round_s``: the wall-clock round (``round_cpu_s``: the process's CPU seconds in it, the figure a
  loaded machine distorts least; ``round_cpu_over_bound`` beside ``round_over_bound``), and with
  ``--plaintext`` the same preset's plaintext twin (``plain_round_s``; :func:`plain_twin`, named in
  ``plain_twin``: ``secure_aggregation = "none"``, FEL's distributed noise drawn by the server instead,
  STTFedRec's FL-two-tower baseline): ``round_over_bound`` = round / (plaintext round + simulation
  bound), the figure issue 27's 1.5x target is about;
* with ``--per-client-plaintext`` too, ``plain_per_client_round_cpu_s``: the twin with every client
  computing its own gradient (FedCL's in-process plaintext shortcut, one backward pass over the summed
  losses, off; as on devices, and as a secure sum needs every client's vector) and
  ``per_client_round_cpu_over_bound`` against it;
* ``noise_cpu_s``: the CPU seconds of the clients' distributed-DP noise shares (FEL's ``dp =
  "distributed"``, :func:`dp.discrete.discrete_gaussian_noise`), privacy work the bound does not price
  and the central-DP twin does once per leaf; where it is not zero, ``round_cpu_over_bound_ex_noise``
  is the ratio with the shares taken off the round;
* ``first_round_cpu_s`` and, with ``--rounds`` 2 or more, ``steady_*``: the median over the rounds
  after the first (:func:`steady`; the first round also pays one-off warm-up), with
  ``steady_round_cpu_over_bound`` the median of the per-round ratios;
* ``peak_rss_mb``: the process's peak resident memory after the round;
* ``setups``: the instances that ran a key setup of their own; ``setup_bound_s``: their clients' setups
  (:func:`secagg.costmodel.setup_client_s`, part of ``simulation_bound_s``); ``reusable_setup_bound_s``:
  the most one setup per client per round could save (every client's setups but its dearest,
  :func:`secagg.costmodel.reusable_setup_s`), the ceiling of any reuse before the cohorts are checked;
  ``nesting_setups``/``nesting_setup_bound_s``: the setups paid by sums whose clients nest in an earlier
  sum's survivors within its planned dropout (:func:`secagg.costmodel.nesting_setups`), all a reuse that
  respects the nesting rule could spare;
* with ``--no-setup-reuse``, ``noreuse``: the same round with every secure sum paying its own key setup
  (:func:`protocols.exchange.setup_reuse` off; LightFR's two sums then set up twice), with its bound;
* with ``--no-shared-work``, ``unshared_round_s``: the same round with every simulated client doing
  all its own verifications and agreements (:mod:`secagg.simshare` off), the simulation's cost
  before that optimisation. The bounds are per device either way: sharing changes only how long
  the one process simulating every device takes.

``--json`` prints one object on the last line: ``{"units": ..., "presets": {name: {...}}}``.
Timings are only as good as the machine is quiet: run nothing else beside it. torch runs ``--threads``
intra-op threads (default 1, as ``secagg run``): with two on a loaded 2-core machine the second
thread's OpenMP spin-waits counted as process CPU (FedCL's backward pass: 0.2 s of CPU on one thread,
2.2-2.4 s on two).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from experiments import jsonio
from experiments.errors import UserError

__all__ = ["bench", "plain_twin", "register", "secure_presets", "steady"]


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser(
        "secure",
        help="every secure preset's round beside the bound its cryptography must pay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("presets", nargs="*", metavar="PRESET",
                   help="presets to time (default: every preset with a secure aggregation)")
    p.add_argument("--data", default="synthetic", help="dataset path, or 'synthetic' (default)")
    p.add_argument("--users", type=int, help="synthetic data: users (e.g. 943 for ML-100K's shape, 6040 for ML-1M's)")
    p.add_argument("--items", type=int, help="synthetic data: items (e.g. 1682 for ML-100K's shape, 3706 for ML-1M's)")
    p.add_argument("--rounds", type=int, default=1, help="timed rounds per preset (default 1)")
    p.add_argument("--plaintext", action="store_true",
                   help="also time the preset with secure_aggregation = 'none' (the round's non-crypto work)")
    p.add_argument("--per-client-plaintext", action="store_true",
                   help="with --plaintext, also time the twin with every client computing its own gradient (FedCL's "
                   "summed in-process shortcut off): the plaintext round a secure sum's per-client vectors compare with")
    p.add_argument("--no-shared-work", action="store_true",
                   help="also time each preset with every simulated client doing all its own verifications and "
                   "agreements (secagg.simshare off): the simulation's cost before that optimisation")
    p.add_argument("--no-setup-reuse", action="store_true",
                   help="also time each preset with every secure sum paying its own key setup (secagg.reuse off): "
                   "the cost before one setup per round")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1, as secagg run: on a shared machine a second thread's "
                   "OpenMP spin-waits count as process CPU and inflated FedCL's round several-fold)")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line of stdout")
    p.set_defaults(func=_main)


def _secure_key(config) -> tuple[str, str] | None:  # noqa: ANN001 (RunConfig)
    """(section, value) of the active protocol's ``secure_aggregation`` key, if it has one."""
    section = config.spec.section
    proto = config.protocol_config
    value = getattr(proto, "secure_aggregation", None) if proto is not None else None
    return None if section is None or value is None else (section, str(value))


def plain_twin(config) -> tuple[dict[str, dict[str, Any]], str] | None:  # noqa: ANN001 (RunConfig)
    """The overrides that turn a secure preset into its plaintext twin, and what the twin is (``None``:
    the preset has none).

    * a protocol section with ``secure_aggregation``: set to ``"none"``; with FEL's ``dp = "distributed"``
      (the clients' noise shares only hide under a secure sum, so FEL refuses it in plaintext) also
      ``dp = "central"``: the same leaves, clipping and privacy target, the noise drawn once by the
      server instead of in shares by the clients;
    * STTFedRec (always secure: the user-tower gradient through the chain, the rows through
      ``item_aggregation``): ``item_aggregation = "none"`` (the same split protocol, the rows sent to RS
      in plaintext); the chain has no plaintext form, so :func:`bench` subtracts the CPU seconds of the
      twin's secure sums (the chain's, ``secure_cpu_s``), which the bound already prices. The FL-two-tower
      baseline (``fl-dssm``) is no twin: its clients download raw item data and run the item tower
      themselves, several times the split round's non-crypto work (0.4x ratios that flatter the split).
    """
    if config.run.protocol == "sttfedrec":
        return ({"sttfedrec": {"item_aggregation": "none"}},
                "sttfedrec.item_aggregation = \"none\", minus its chain's CPU seconds (the chain has no plaintext form)")
    key = _secure_key(config)
    if key is None:
        return None
    over: dict[str, Any] = {"secure_aggregation": "none"}
    what = f"{key[0]}.secure_aggregation = \"none\""
    if getattr(config.protocol_config, "dp", None) == "distributed":
        over["dp"] = "central"
        what += " and dp = \"central\" (the same noise, drawn by the server)"
    return {key[0]: over}, what


def secure_presets() -> list[str]:
    """Federated presets whose protocol section sets a secure aggregation other than ``"none"``, plus
    those whose protocol always aggregates securely (STTFedRec's chain)."""
    from experiments.run import config as cfgmod

    out = []
    for name in cfgmod.PRESETS:
        cfg = cfgmod.load_preset(name)
        if not cfg.spec.federated:
            continue
        key = _secure_key(cfg)
        if (key is not None and key[1] not in ("none", "plain")) or cfg.run.protocol == "sttfedrec":
            out.append(name)
    return out


def _config(preset: str, data: str, rounds: int, plaintext: bool, shape: dict[str, int] | None = None):
    from experiments.run import config as cfgmod

    try:
        cfg = cfgmod.load_preset(preset)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    # the bench never evaluates: no sampled candidates (a small synthetic catalogue may hold too few)
    over: dict[str, dict[str, Any]] = {"data": {"source": data, **(shape or {})}, "run": {"rounds": rounds},
                                       "eval": {"negatives": 0}}
    if plaintext:
        twin = plain_twin(cfg)
        if twin is None:
            return None
        for section, values in twin[0].items():
            over[section] = {**over.get(section, {}), **values}
    return cfgmod.merge(cfg, over)


def _build(cfg):  # noqa: ANN001, ANN202
    from experiments.run.prepare import prepare_data
    from experiments.run.training import build_trainer

    return build_trainer(cfg, prepare_data(cfg))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@contextlib.contextmanager
def _timed_calls(module_name: str, attr: str, spent: list[float]) -> Iterator[None]:
    """Add to ``spent`` the process CPU seconds (``[0]``) and wall-clock seconds (``[1]``) spent inside
    ``module_name.attr``: every loaded module that holds that function under that name has it timed
    while the block runs; only the outermost call of a nest is counted."""
    module = importlib.import_module(module_name)
    inner = getattr(module, attr)
    depth = [0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            depth[0] -= 1
            if not depth[0]:
                spent[0] += time.process_time() - c0
                spent[1] += time.perf_counter() - t0

    patched = [m for m in list(sys.modules.values()) if getattr(m, attr, None) is inner]
    for m in patched:
        setattr(m, attr, timed)
    try:
        yield
    finally:
        for m in patched:
            setattr(m, attr, inner)


def _secure_cpu(spent: list[float]) -> contextlib.AbstractContextManager[None]:
    """Time every in-process secure sum (:func:`protocols.secure_sum.secure_sum`: the exchanges', FEL's
    leaves') into ``spent``, as :func:`_timed_calls`."""
    return _timed_calls("protocols.secure_sum", "secure_sum", spent)


def _noise_cpu(spent: list[float]) -> contextlib.AbstractContextManager[None]:
    """Time the clients' distributed-DP noise shares (:func:`dp.discrete.discrete_gaussian_noise`, drawn
    by every client of FEL's ``dp = "distributed"``) into ``spent``: privacy work that the cryptographic
    bound does not price and the central-DP twin does once per leaf."""
    return _timed_calls("dp.discrete", "discrete_gaussian_noise", spent)


def _time_rounds(cfg, rounds: int, units, label: str, shared: bool = True,  # noqa: ANN001
                 reuse: bool = True, per_client: bool = False) -> list[dict[str, Any]]:
    from experiments.run.training import release_heap, settle_heap

    trainer = _build(cfg)
    if per_client and hasattr(trainer, "_sum_only"):
        # FedCL's in-process plaintext shortcut (one backward pass over the summed losses) off: every client
        # computes its own gradient, as on devices and as the secure sum needs
        trainer._sum_only = lambda: False
    rows = []
    try:
        for r in range(rounds):
            rows.append(_time_round(trainer, r, units, label, rounds, shared, reuse))
            if r == 0:  # as `secagg run` does after its first round: the long-lived heap out of the GC's scans
                settle_heap()
    finally:
        release_heap()  # the next preset's run must be able to reclaim this one's objects
    return rows


def _time_round(trainer, r: int, units, label: str, rounds: int, shared: bool, reuse: bool) -> dict[str, Any]:  # noqa: ANN001
    from protocols.exchange import setup_reuse
    from protocols.secure_sum import observe
    from secagg import simshare
    from secagg.costmodel import instance_cost, nesting_setups, reusable_setup_s, setup_client_s

    seen: list[dict] = []
    spent, noise = [0.0, 0.0], [0.0, 0.0]
    t0, c0 = time.perf_counter(), time.process_time()
    with observe(seen.append), (contextlib.nullcontext() if shared else simshare.disabled()), setup_reuse(reuse), \
            _secure_cpu(spent), _noise_cpu(noise):
        trainer.run_round()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    per_client: dict[str, float] = defaultdict(float)
    server_bound = measured = 0.0
    dpf_bytes = 0
    parts: dict[str, float] = defaultdict(float)
    shapes: dict[str, int] = defaultdict(int)
    setups: dict[str, list[float]] = defaultdict(list)  # client -> its setups' bound in this round
    for inst in seen:
        cost = instance_cost(inst["protocol"], n=inst["n"], dim=inst["dim"], k=inst["k"], t=inst["t"],
                             survivors=inst["survivors"], masks_expanded=inst["masks_expanded"],
                             key_agreements=inst["key_agreements"],
                             signatures_verified=inst["signatures_verified"], units=units,
                             reuse=inst.get("reuse", False), setup=inst.get("setup", True),
                             prg_bytes=inst.get("prg_bytes", 0), dense_bytes=inst.get("dense_bytes", 0),
                             hashed_bytes=inst.get("hashed_bytes", 0),
                             client_prg_bytes=inst.get("client_prg_bytes", 0),
                             client_dense_bytes=inst.get("client_dense_bytes", 0))
        for name in inst["senders"]:
            per_client[name] += cost.client_s
        if inst["protocol"] in ("secagg", "secagg+") and inst.get("setup", True):
            own = setup_client_s(inst["n"] - 1 if inst["k"] is None else inst["k"], units)
            for name in inst["senders"]:
                setups[name].append(own)
        server_bound += cost.server_s
        for part, sec in cost.client_parts.items():
            parts[f"clients_{part}"] += sec * inst["n"]
        for part, sec in cost.server_parts.items():
            parts[f"server_{part}"] += sec
        measured += sum(inst["client_seconds"]) + inst["server_seconds"]
        reused = " reused" if inst.get("reuse") and not inst.get("setup", True) else ""
        if inst["protocol"] == "dpf":
            shapes[f"dpf n={inst['n']} d={inst['dim']}"] += 1
            dpf_bytes += inst.get("prg_bytes", 0)
        else:
            shapes[f"{inst['protocol']} n={inst['n']} k={inst['k']} t={inst['t']} d={inst['dim']}{reused}"] += 1
    sim_bound = sum(per_client.values()) + server_bound
    row = {
        "round": r, "round_s": wall, "round_cpu_s": cpu, "secure_cpu_s": spent[0], "secure_wall_s": spent[1],
        "noise_cpu_s": noise[0], "dpf_prg_bytes": dpf_bytes, "instances": len(seen),
        "shapes": dict(shapes),
        "device_bound_s": max(per_client.values(), default=0.0),
        "server_bound_s": server_bound, "simulation_bound_s": sim_bound,
        "secure_measured_s": measured,
        "secure_over_bound": measured / sim_bound if sim_bound > 0 else None,
        "bound_parts_s": dict(parts), "peak_rss_mb": _peak_rss_mb(),
        "setups": sum(1 for i in seen if i["protocol"] in ("secagg", "secagg+") and i.get("setup", True)),
        "setup_bound_s": float(sum(sum(c) for c in setups.values())),
        "reusable_setup_bound_s": reusable_setup_s(setups),
    }
    nesting = nesting_setups(seen)
    row["nesting_setups"] = len(nesting)
    row["nesting_setup_bound_s"] = float(sum(
        seen[j]["n"] * setup_client_s(seen[j]["n"] - 1 if seen[j]["k"] is None else seen[j]["k"], units)
        for j in nesting))
    print(f"{label} round {r + 1}/{rounds}: {wall:.2f} s ({cpu:.2f} s CPU), {len(seen)} secure sums, bound "
          f"{sim_bound:.2f} s (device {row['device_bound_s']:.3f} s), measured {measured:.2f} s; {row['setups']} key "
          f"setups ({row['setup_bound_s']:.2f} s of the bound; nesting sums could spare "
          f"{row['nesting_setup_bound_s']:.2f} s, one setup per client at most {row['reusable_setup_bound_s']:.2f} s)",
          file=sys.stderr)
    return row


def bench(presets: list[str], data: str, rounds: int, plaintext: bool, *, users: int | None = None,
          items: int | None = None, unshared: bool = False, no_reuse: bool = False, threads: int = 1,
          per_client: bool = False) -> dict[str, Any]:
    """Time ``presets`` (see the module docstring) with ``threads`` torch threads (restored after)."""
    import torch

    if threads < 1:
        raise UserError(f"--threads must be >= 1; found {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _bench(presets, data, rounds, plaintext, users=users, items=items, unshared=unshared, no_reuse=no_reuse,
                     per_client=per_client)
    finally:
        torch.set_num_threads(before)
    out["threads"] = threads
    return out


def _bench(presets: list[str], data: str, rounds: int, plaintext: bool, *, users: int | None,
           items: int | None, unshared: bool, no_reuse: bool, per_client: bool) -> dict[str, Any]:
    from secagg.costmodel import UnitCosts

    if rounds < 1:
        raise UserError(f"--rounds must be >= 1; found {rounds}")
    shape = {}
    for key, value in (("synthetic_users", users), ("synthetic_items", items)):
        if value is not None:
            if data != "synthetic":
                raise UserError("--users and --items size the synthetic data; drop them with --data PATH")
            if value < 2:
                raise UserError(f"--{key.split('_')[1]} must be >= 2; found {value}")
            shape[key] = value
    names = presets or secure_presets()
    configs = {name: _config(name, data, rounds, False, shape) for name in names}  # unknown presets fail first
    print("measuring unit costs", file=sys.stderr)
    units = UnitCosts.measure(cpu=True)  # CPU seconds: the machine may be shared
    out: dict[str, Any] = {"units": units.as_dict(), "units_clock": "process CPU", "data": data, "shape": shape, "rounds": rounds, "presets": {}}
    for name in names:
        rows = _time_rounds(configs[name], rounds, units, name)
        res: dict[str, Any] = {"rounds": rows}
        last = rows[-1]
        res.update({k: last[k] for k in ("round_s", "round_cpu_s", "simulation_bound_s", "device_bound_s", "secure_measured_s",
                                          "secure_over_bound", "peak_rss_mb", "instances", "setups", "setup_bound_s",
                                          "reusable_setup_bound_s", "nesting_setups", "nesting_setup_bound_s")})
        if plaintext:
            twin = None
            try:
                twin = _config(name, data, rounds, True, shape)
                res["plain_twin"] = plain_twin(configs[name])[1] if twin is not None else None
                plain = None if twin is None else _time_rounds(twin, rounds, units, f"{name} (plaintext)")
            except ValueError as exc:  # e.g. fel-dp: distributed noise is refused without secure aggregation
                res["plain_error"] = str(exc)
                print(f"{name}: no plaintext twin ({exc})", file=sys.stderr)
                plain = None
            if plain is not None:
                for p in plain:  # a twin still running secure sums (STTFedRec's chain): the bound prices them
                    p["round_cpu_s"] -= p["secure_cpu_s"]
                    p["round_s"] -= p["secure_wall_s"]
                res["plain_round_s"] = plain[-1]["round_s"]
                res["plain_round_cpu_s"] = plain[-1]["round_cpu_s"]
                denom = res["plain_round_s"] + last["simulation_bound_s"]
                res["round_over_bound"] = last["round_s"] / denom if denom > 0 else None
                denom = res["plain_round_cpu_s"] + last["simulation_bound_s"]
                res["round_cpu_over_bound"] = last["round_cpu_s"] / denom if denom > 0 else None
                for r, p in zip(rows, plain):
                    p_denom = p["round_cpu_s"] + r["simulation_bound_s"]
                    r["plain_round_cpu_s"] = p["round_cpu_s"]
                    r["round_cpu_over_bound"] = r["round_cpu_s"] / p_denom if p_denom > 0 else None
                    if r["noise_cpu_s"] > 0:  # both sides without their DP noise draws (fel-dp: the clients' shares)
                        p_denom -= p["noise_cpu_s"]
                        r["round_cpu_over_bound_ex_noise"] = (r["round_cpu_s"] - r["noise_cpu_s"]) / p_denom if p_denom > 0 else None
            if per_client and plain is not None:
                each = _time_rounds(twin, rounds, units, f"{name} (plaintext, per-client gradients)", per_client=True)
                for r, p in zip(rows, each):
                    p_denom = p["round_cpu_s"] - p["secure_cpu_s"] + r["simulation_bound_s"]
                    r["plain_per_client_round_cpu_s"] = p["round_cpu_s"] - p["secure_cpu_s"]
                    r["per_client_round_cpu_over_bound"] = r["round_cpu_s"] / p_denom if p_denom > 0 else None
        res.update(steady(rows))
        if unshared:
            alone = _time_rounds(configs[name], rounds, units, f"{name} (no shared work)", shared=False)
            res["unshared_round_s"] = alone[-1]["round_s"]
            res["unshared_secure_measured_s"] = alone[-1]["secure_measured_s"]
        if no_reuse:
            alone = _time_rounds(configs[name], rounds, units, f"{name} (no setup reuse)", reuse=False)
            res["noreuse"] = {k: alone[-1][k] for k in ("round_s", "round_cpu_s", "simulation_bound_s", "device_bound_s",
                                                        "secure_measured_s", "instances", "peak_rss_mb", "setups",
                                                        "setup_bound_s", "reusable_setup_bound_s", "nesting_setups",
                                                        "nesting_setup_bound_s")}
            if "plain_round_cpu_s" in res:
                denom = res["plain_round_cpu_s"] + alone[-1]["simulation_bound_s"]
                res["noreuse"]["round_cpu_over_bound"] = alone[-1]["round_cpu_s"] / denom if denom > 0 else None
        out["presets"][name] = res
    return out


def steady(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first round beside the steady state: with two rounds or more, the median over the rounds after
    the first of the round's CPU seconds, its plaintext twin's, the bounds and the per-round ratio
    round CPU / (plaintext CPU + simulation bound) (round ``r`` of the twin samples the same clients).
    The first round also pays one-off costs (lazy imports, first allocations, caches); each later round
    pays everything a round costs, so the median hides no per-round work."""
    import statistics

    out: dict[str, Any] = {"first_round_cpu_s": rows[0]["round_cpu_s"]}
    if "round_cpu_over_bound" in rows[0]:
        out["first_round_cpu_over_bound"] = rows[0]["round_cpu_over_bound"]
    later = rows[1:]
    if not later:
        return out
    for key in ("round_cpu_s", "plain_round_cpu_s", "simulation_bound_s", "device_bound_s", "round_cpu_over_bound",
                "plain_per_client_round_cpu_s", "per_client_round_cpu_over_bound", "noise_cpu_s",
                "round_cpu_over_bound_ex_noise"):
        vals = [r[key] for r in later if r.get(key) is not None]
        if vals:
            out[f"steady_{key}"] = statistics.median(vals)
    return out


def _main(args: argparse.Namespace) -> int:
    out = bench(list(args.presets), args.data, args.rounds, args.plaintext, users=args.users, items=args.items,
                unshared=args.no_shared_work, no_reuse=args.no_setup_reuse, threads=args.threads,
                per_client=args.per_client_plaintext)
    u = out["units"]
    print(f"units: AES-256-CTR {u['aes256_ctr_gbps']:.2f} GB/s, X25519+HKDF {u['x25519_hkdf_agree_us']:.0f} us, "
          f"Ed25519 sign {u['ed25519_sign_us']:.0f} us / verify {u['ed25519_verify_us']:.0f} us")
    print(f"{'preset':<26}{'round s':>9}{'CPU s':>9}{'unshared':>9}{'plain s':>9}{'bound s':>9}{'device s':>10}{'secure s':>10}"
          f"{'sec/bnd':>9}{'rnd/bnd':>9}{'steady':>9}{'RSS MB':>8}")
    for name, r in out["presets"].items():
        def f(x: Any, spec: str) -> str:
            return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))
        print(f"{name:<26}{f(r['round_s'], '9.2f')}{f(r.get('round_cpu_s'), '9.2f')}{f(r.get('unshared_round_s'), '9.2f')}"
              f"{f(r.get('plain_round_s'), '9.2f')}"
              f"{f(r['simulation_bound_s'], '9.2f')}{f(r['device_bound_s'], '10.3f')}"
              f"{f(r['secure_measured_s'], '10.2f')}{f(r['secure_over_bound'], '9.2f')}"
              f"{f(r.get('round_over_bound'), '9.2f')}{f(r.get('steady_round_cpu_over_bound'), '9.2f')}"
              f"{f(r['peak_rss_mb'], '8.0f')}")
    if args.json:
        print(jsonio.dumps(out, sort_keys=True))
    return 0
