"""``secagg attack fel``: label inference on a FEL leaf's released aggregates, advantage beside its bound.

``secagg attack fel --defense none|dp [--epsilon E] [--noise central|distributed] [--trials N]
[--rounds R] [--canary-items K] [--data PATH] [--json]``

The audit (attacks/fel.py): a target user is added to the data with ``K`` positives on one of two
sets of canary items (``S0``, ``S1``: 2K items appended to the catalogue that no other user
rated, the strongest case for the attacker). ``2N`` independent FEL runs (``R`` rounds each, a
fresh seed each, every leaf's whole cluster in every round) alternate the world ``b``: the target
trained on ``S_b``. The attack sees only the server's ``"leaf-model"`` records of the target's
leaf; its threshold is chosen on the first ``N`` runs and its advantage ``TPR - FPR`` measured on the
other ``N``. ``--defense dp``: DP-FedAvg per leaf, calibrated to ``--epsilon`` over ``R`` rounds
(fixed-size cohorts, no amplification).

Default data: synthetic, 40 users x 200 items (about 10 positives each). ``--json`` prints one object (last line of stdout)
with the common ``"attack"`` shape (``f1``, ``precision``, ``recall``, ``random_f1``, ``status``)
plus ``advantage`` (and its 95% interval), ``epsilon`` (the leaf's accounted epsilon, add/zero
one user's update; ``null`` without DP), ``epsilon_label`` (the same rounds for the
replace-one-user's-data neighbours the test distinguishes), ``bound`` =
``(e^eps - 1 + 2 delta) / (e^eps + 1)`` at ``epsilon_label``, ``gdp_bound`` (the Gaussian
mechanism's own tight bound) and ``respects_bound`` (the advantage's lower 95% limit <= bound).

Not a wrapper over ``secagg run`` + ``secagg attack RUN_DIR`` (as ``secagg attack fedfast`` and
``lightfr`` are, :mod:`experiments.studies.attack_wrap`), on purpose: the measurement is a
distinguishing game over ``2N`` runs in two worlds (a planted canary target on ``S0`` or ``S1``) with a
threshold calibrated on half of them, which one run cannot express; ``fel-label`` scores a decision
over many runs, so it registers no per-run ``infer``/``assess`` and ``fel`` has no attack-matrix cell.
A run directory of FEL can still be attacked, by the attacks that apply to it, with
``secagg attack RUN_DIR``; the canary version on a run is issue 24's audit (item 4).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import TYPE_CHECKING, Any

from experiments import jsonio
from experiments.studies.attack_data import add_data_arguments, load_attack_data
from experiments.errors import UserError

if TYPE_CHECKING:  # numpy is imported where used, so that --help stays fast
    import numpy as np

__all__ = ["canary_worlds", "register", "run_attack"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg attack fel``."""
    p = subparsers.add_parser(
        "fel",
        help="label inference on FEL's per-leaf aggregates, with and without DP",
        description="Run many short FEL trainings in two worlds (a target user trained on canary set S0 or "
        "S1), attack the server's view of the target's leaf, and report the attack advantage TPR - FPR with "
        "its 95% interval beside the bound (e^eps - 1 + 2 delta) / (e^eps + 1) that DP imposes.",
    )
    p.add_argument("--defense", choices=("none", "dp"), default="none",
                   help="none: FEL without DP; dp: DP-FedAvg per leaf calibrated to --epsilon")
    p.add_argument("--epsilon", type=float, default=4.0, help="per-leaf target epsilon for --defense dp (default 4)")
    p.add_argument("--delta", type=float, default=1e-5, help="delta of the calibration and the bound (default 1e-5)")
    p.add_argument("--noise", choices=("central", "distributed"), default="central",
                   help="DP noise placement (distributed: discrete Gaussian through SecAgg+; slower)")
    p.add_argument("--clip", type=float, default=0.5, help="per-client L2 clip (default 0.5)")
    p.add_argument("--trials", type=int, default=200,
                   help="runs per half (threshold choice, then measurement); 2x this many trainings (default 200)")
    p.add_argument("--rounds", type=int, default=2, help="FEL rounds per run (default 2)")
    p.add_argument("--canary-items", type=int, default=5, help="K: size of S0 and of S1 (default 5)")
    p.add_argument("--clusters", type=int, default=2, help="FEL leaves (default 2)")
    p.add_argument("--dim", type=int, default=8, help="embedding size (default 8)")
    add_data_arguments(p, users=40, items=200)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_main)


def canary_worlds(base: Any, k: int) -> tuple[Any, Any, int, np.ndarray, np.ndarray]:
    """``(train0, train1, target, S0, S1)``: ``base`` plus 2k canary items and a target user on ``S_b``."""
    import numpy as np

    from recmodels.data import Interactions

    n_users, n_items = base.n_users, base.n_items
    s0, s1 = np.arange(n_items, n_items + k), np.arange(n_items + k, n_items + 2 * k)
    kind = np.asarray(base.item_ids).dtype.kind
    new_items = (np.arange(2 * k) + (int(np.max(base.item_ids)) + 1 if kind in "iu" else 0)) if kind in "iu" \
        else np.array([f"canary-{j}" for j in range(2 * k)])
    ukind = np.asarray(base.user_ids).dtype.kind
    new_user = int(np.max(base.user_ids)) + 1 if ukind in "iu" else "canary-target"
    worlds = []
    for s in (s0, s1):
        worlds.append(Interactions(
            users=np.concatenate([base.users, np.full(k, n_users)]).astype(np.int64),
            items=np.concatenate([base.items, s]).astype(np.int64),
            ratings=np.concatenate([base.ratings, np.ones(k, np.float32)]).astype(np.float32),
            timestamps=np.concatenate([base.timestamps, np.full(k, int(np.max(base.timestamps, initial=0)) + 1)]),
            user_ids=np.concatenate([np.asarray(base.user_ids, dtype=object if ukind not in "iu" else None),
                                     np.asarray([new_user])]),
            item_ids=np.concatenate([np.asarray(base.item_ids), new_items]),
            source=f"{base.source} + canary target", check_duplicates=False))
    return worlds[0], worlds[1], n_users, s0, s1


def _check(args: argparse.Namespace) -> None:
    for name, low in (("trials", 4), ("rounds", 1), ("canary_items", 2), ("clusters", 1), ("dim", 1)):
        if getattr(args, name) < low:
            raise UserError(f"--{name.replace('_', '-')} must be >= {low}; found {getattr(args, name)}.")
    if not (args.epsilon > 0 and math.isfinite(args.epsilon)):
        raise UserError(f"--epsilon must be positive and finite; found {args.epsilon}.")
    if not (0 < args.delta < 1):
        raise UserError(f"--delta must be in (0, 1); found {args.delta}.")
    if not (args.clip > 0 and math.isfinite(args.clip)):
        raise UserError(f"--clip must be positive; found {args.clip}.")


def _config(args: argparse.Namespace) -> Any:
    from protocols.fel import FelConfig

    kw: dict[str, Any] = dict(dim=args.dim, n_clusters=args.clusters, min_clients=2, combiner="mean",
                              opt_in_fraction=0.0, client_fraction=1.0)
    if args.defense == "dp":
        kw.update(dp=args.noise, clip=args.clip, calibration="epsilon", target_epsilon=args.epsilon,
                  delta=args.delta, dp_rounds=args.rounds, sampling="fixed")
        if args.noise == "distributed":
            kw.update(secure_aggregation="secagg+", frac_bits=16, value_clip=4096.0)
    try:
        return FelConfig(**kw)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def run_attack(args: argparse.Namespace, data: Any) -> dict[str, Any]:
    """Train ``2 x trials`` short FEL runs in alternating worlds and score the attack; a JSON-ready dict."""
    import numpy as np

    from attacks.fel import (
        advantage, dp_advantage_bound, gdp_advantage_bound, label_change_epsilon, label_inference, server_view,
    )
    from dp.accountant import RdpAccountant
    from protocols.fel import FelTrainer
    from protocols.fel_leaf import LEAF_MODEL_KIND
    from protocols.transport import InProcessTransport, Transcript

    _check(args)
    cfg = _config(args)
    worlds = canary_worlds(data, args.canary_items)
    target, hyp = worlds[2], (worlds[3], worlds[4])
    scores, truth, events, leaf, leaf_size = [], [], None, None, 0
    t0 = time.perf_counter()
    for i in range(2 * args.trials):
        b = i % 2
        keep = lambda r: r.kind == LEAF_MODEL_KIND  # noqa: E731
        try:
            fel = FelTrainer(worlds[b], cfg, seed=args.seed * 1_000_003 + i,
                             transport=InProcessTransport(Transcript(keep_payloads=keep)))
        except ValueError as exc:  # e.g. a cluster below min_clients on tiny data
            raise UserError(str(exc)) from exc
        leaf = int(fel.assignment[target])
        leaf_size = int(fel.public_info()["leaves"][leaf]["clients"])
        rel = []
        for _ in range(args.rounds):
            rel += [r.event for r in fel.run_round().releases if r.cohort == f"leaf:{leaf}"]
        events = rel if events is None else events
        scores.append(label_inference(server_view(fel.transport.transcript), fel.public_info(), target=target,
                                      hypotheses=hyp))
        truth.append(b)
    seconds = time.perf_counter() - t0
    cal = np.arange(2 * args.trials) < args.trials
    adv = advantage(scores, truth, calibration=cal)
    acc = RdpAccountant()
    for e in events:
        acc.compose(e)
    eps = float(acc.get_epsilon(args.delta)) if args.defense == "dp" else math.inf
    eps_label, mu = label_change_epsilon(events, args.delta) if args.defense == "dp" else (math.inf, math.inf)
    bound = dp_advantage_bound(eps_label, args.delta)
    fin = lambda v: v if math.isfinite(v) else None  # noqa: E731  (JSON: null for "no DP")
    respects = adv.advantage_low <= bound + 1e-12
    status = "ok" if respects else "ADVANTAGE ABOVE THE DP BOUND: the promise failed"
    attack = {**adv.to_dict(), "status": status}
    return {
        "defense": args.defense, "protocol": "fel" if args.defense == "none" else f"fel-dp ({args.noise})",
        "attack_name": "fel-label", "attack": attack,
        "advantage": adv.advantage, "advantage_ci": [adv.advantage_low, adv.advantage_high],
        "epsilon": fin(eps), "epsilon_label": fin(eps_label), "delta": args.delta,
        "bound": bound, "bound_kind": "(e^eps - 1 + 2 delta) / (e^eps + 1) at epsilon_label (Kairouz et al. 2015)",
        "gdp_mu": fin(mu), "gdp_bound": gdp_advantage_bound(mu), "respects_bound": bool(respects),
        "noise_multiplier": None if args.defense == "none" else _noise_multiplier(events),
        "target_leaf": leaf, "leaf_clients": leaf_size, "rounds": args.rounds, "trials": 2 * args.trials,
        "canary_items": args.canary_items, "clusters": args.clusters, "data": data.source,
        "users": int(data.n_users) + 1, "items": int(data.n_items) + 2 * args.canary_items,
        "train_seconds": seconds,
    }


def _noise_multiplier(events: list[Any]) -> float | None:
    """The leaf's noise multiplier (the first round's; calibration gives every round the same)."""
    z = getattr(events[0], "noise_multiplier", None) if events else None
    return None if z is None else float(z)


def _main(args: argparse.Namespace) -> int:
    _check(args)  # bad flags are refused before torch and the protocols load
    out = run_attack(args, load_attack_data(args, min_users=8, min_items=10, items_per_interaction=20))
    a = out["attack"]
    eps = "inf" if out["epsilon"] is None else f"{out['epsilon']:.3f}"
    print(f"FEL / {out['protocol']}: label inference on leaf {out['target_leaf']} ({out['leaf_clients']} clients), "
          f"{out['trials']} runs of {out['rounds']} rounds: {a['status']}")
    lo, hi = out["advantage_ci"]
    print(f"  advantage TPR - FPR {out['advantage']:.3f} (95% CI {lo:.3f}..{hi:.3f}); TPR {a['tpr']:.3f} FPR {a['fpr']:.3f}")
    print(f"  leaf epsilon {eps}; bound at the label-change epsilon: {out['bound']:.3f} "
          f"(Gaussian's own: {out['gdp_bound']:.3f})")
    if args.json:
        print(jsonio.dumps(out))
    return 0
