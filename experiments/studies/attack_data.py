"""The data an attack command trains on: ``--data PATH``, or a small synthetic set.

Every ``secagg attack <protocol>`` accepts the same data options; this module adds them and
loads the data, so that the sizes are checked, and the file read, in one way.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from experiments.errors import UserError

__all__ = ["add_data_arguments", "load_attack_data"]


def add_data_arguments(p: argparse.ArgumentParser, *, users: int = 100, items: int = 200) -> None:
    """Add ``--data``, ``--users``, ``--items`` and ``--seed`` to an attack's parser."""
    p.add_argument("--data", type=Path, default=None, help="ratings file or folder (default: synthetic)")
    p.add_argument("--users", type=int, default=users, help=f"synthetic users (default {users})")
    p.add_argument("--items", type=int, default=items, help=f"synthetic items (default {items})")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of every simulation choice")


def load_attack_data(
    args: argparse.Namespace, *, min_users: int = 2, min_items: int = 6, dim: int = 8, items_per_interaction: int = 4
) -> Any:
    """The interactions of ``args.data`` (users with at least 2 kept), or a synthetic set.

    Synthetic data has ``args.users`` x ``args.items`` with about
    ``clip(items // items_per_interaction, 3, 20)`` interactions per user, generated from
    ``args.seed`` with ``dim`` latent factors; sizes below ``min_users``/``min_items`` are refused.
    """
    if args.data is None:
        if args.users < min_users or args.items < min_items:
            raise UserError(
                f"--users must be >= {min_users} and --items >= {min_items}; found {args.users}, {args.items}."
            )
        from recmodels.synthetic import generate_synthetic

        return generate_synthetic(n_users=args.users, n_items=args.items, dim=dim, seed=args.seed,
                                  mean_interactions=max(3, min(20, args.items // items_per_interaction)))
    from recmodels.data import filter_min_interactions
    from recmodels.loaders import load_interactions

    return filter_min_interactions(load_interactions(args.data), min_user=2)
