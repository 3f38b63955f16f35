"""Why DP-FedAvg FEL leaves sit at chance on small data: one leaf round's clipped sum against its noise.

``python -m experiments.studies.fel_dp_snr --data PATH [--setting C,DIM,CLIENTS,CLIP ...] [--epsilon E ...]
[--rounds R] [--json]``

For each setting (``CLIENTS = 0``: the whole cluster every round) it runs one round of leaf 0 with
DP-FedAvg clipping but no noise (``noise_multiplier = 0``, so the clipped sum is exact), and reports
``||clipped sum||`` beside the norm of the noise the ``epsilon`` calibration over ``R`` unamplified
rounds would add, ``z clip sqrt(width)``, their ratio (SNR), and the fraction of item rows whose
summed change exceeds that row's noise norm ``z clip sqrt(dim)``. Figures: docs/fel.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import numpy as np

from experiments import jsonio

__all__ = ["leaf_snr", "main"]

DEFAULT_SETTINGS = ("1,16,30,0.5", "4,16,30,0.5", "4,16,0,0.5", "2,16,0,0.5", "1,16,0,0.5", "1,4,0,0.5", "2,4,0,0.5")


def leaf_snr(train: Any, exclude: Any, *, clusters: int, dim: int, clients: int, clip: float,
             epsilons: tuple[float, ...], rounds: int, seed: int = 0) -> list[dict[str, Any]]:
    """One row per epsilon for leaf 0 of a FEL run with these settings (see the module docstring)."""
    from protocols.fel import FelConfig, FelTrainer, _calibrate
    from protocols.transport import InProcessTransport

    cfg = FelConfig(n_clusters=clusters, dim=dim, combiner="mean", opt_in_fraction=0.1 if clusters == 1 else 0.0,
                    dp="central", calibration="noise", noise_multiplier=0.0, clip=clip, clients_per_round=clients,
                    client_fraction=1.0, min_clients=2)
    leaf = FelTrainer(train, cfg, seed=seed, transport=InProcessTransport(), exclude=exclude).leaves[0]
    captured: dict[str, np.ndarray] = {}
    noisy_sum = leaf._noisy_sum

    def capture(t: int, sampled: np.ndarray, clipped: np.ndarray):  # noqa: ANN202
        captured["sum"], captured["norms"] = clipped.sum(0), np.linalg.norm(clipped, axis=1)
        return noisy_sum(t, sampled, clipped)

    leaf._noisy_sum = capture
    leaf.run_round()
    total, n_items = captured["sum"], train.n_items
    row_norm = np.linalg.norm(total[: n_items * dim].reshape(n_items, dim), axis=1)
    out = []
    for eps in epsilons:
        z = _calibrate(dataclasses.replace(cfg, calibration="epsilon", target_epsilon=eps, dp_rounds=rounds), 1.0)
        noise = z * clip * math.sqrt(leaf.width)
        out.append({"clusters": clusters, "dim": dim, "clients": int(leaf.expected), "clip": clip, "epsilon": eps,
                    "z": z, "width": int(leaf.width), "mean_client_norm": float(np.mean(captured["norms"])),
                    "clipped_sum_norm": float(np.linalg.norm(total)), "noise_norm": noise,
                    "snr": float(np.linalg.norm(total) / noise),
                    "rows_signal_above_noise": float(np.mean(row_norm > z * clip * math.sqrt(dim)))})
    return out


def main(argv: list[str] | None = None) -> int:
    """Print one line per (setting, epsilon); ``--json``: one JSON list as the last line."""
    from experiments.run.config import load_preset, merge
    from experiments.run.prepare import prepare_data

    p = argparse.ArgumentParser(prog="python -m experiments.studies.fel_dp_snr", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="synthetic", help="ratings file (default: synthetic)")
    p.add_argument("--setting", action="append", default=None, metavar="C,DIM,CLIENTS,CLIP")
    p.add_argument("--epsilon", type=float, action="append", default=None, help="default: 4 and 1.5")
    p.add_argument("--rounds", type=int, default=5, help="rounds the calibration plans for (default 5)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    prep = prepare_data(merge(load_preset("fl-baseline"), {"data": {"source": args.data}}))
    rows = []
    for setting in args.setting or DEFAULT_SETTINGS:
        c, d, m, clip = setting.split(",")
        for row in leaf_snr(prep.split.train, prep.exclude, clusters=int(c), dim=int(d), clients=int(m),
                            clip=float(clip), epsilons=tuple(args.epsilon or (4.0, 1.5)), rounds=args.rounds):
            rows.append(row)
            print(f"C={row['clusters']} dim={row['dim']} clients={row['clients']} eps={row['epsilon']:g} "
                  f"z={row['z']:.3f}: |sum| {row['clipped_sum_norm']:.2f} vs |noise| {row['noise_norm']:.1f}, "
                  f"SNR {row['snr']:.4f}, rows above noise {row['rows_signal_above_noise']:.4f}", flush=True)
    if args.json:
        print(jsonio.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
