"""What SAS reads off the summed first-layer gradient of the click-id user input (``click_id_dim``).

``python -m experiments.studies.sttfedrec_click_leak --data PATH [--dim B] [--cohort K] [--cohorts N] [--json]``

The gradient of the user tower's first layer with respect to the click-id column ``b`` is, for
one client, its first-layer error vector (256 values) times its input ``x_b``, which is non-zero
exactly when the client clicked an item of bucket ``b``. The chain gives SAS the sum over the
round's survivors, so column ``b`` of the sum is non-zero exactly when *some* survivor holds
bucket ``b`` (barring an exact cancellation), and when only one survivor holds it the column is
that client's error vector alone (all its sole-held columns are parallel, so SAS can group them).
This script counts both on the real data, no training: for ``N`` random cohorts of ``K`` users
of the framework's leave-one-out training split (seed 0), the fraction of the ``B`` buckets the
cohort's union covers, the mean fraction of a member's buckets held by no other member, and the
fraction of members with at least one sole-held bucket. The hash is
:func:`recmodels.trigram.hashed_ids`, the public salt the default of ``click_id_salt``.
"""

from __future__ import annotations

import argparse

import numpy as np
import scipy.sparse as sp

from experiments import jsonio

__all__ = ["main", "cohort_exposure"]


def cohort_exposure(users: np.ndarray, buckets: np.ndarray, n_users: int, dim: int, cohort: int, cohorts: int,
                    seed: int = 0) -> dict[str, float]:
    """The three fractions of the module docstring for clicks ``(users, buckets)``."""
    bag = sp.csr_matrix((np.ones(len(users)), (users, buckets)), shape=(n_users, dim))
    bag.sum_duplicates()
    bag.data[:] = 1.0
    rng = np.random.default_rng(seed)
    cover, sole, some = [], [], []
    for _ in range(cohorts):
        m = bag[rng.choice(n_users, min(cohort, n_users), replace=False)].toarray()
        holders = m.sum(0)
        mine = m.sum(1)
        alone = (m * (holders == 1)).sum(1)
        cover.append(float((holders > 0).mean()))
        sole.append(float((alone[mine > 0] / mine[mine > 0]).mean()))
        some.append(float((alone >= 1).mean()))
    return {"union_covers": float(np.mean(cover)), "sole_held_fraction": float(np.mean(sole)),
            "members_with_a_sole_bucket": float(np.mean(some))}


def main(argv: list[str] | None = None) -> int:
    from protocols.twotower_data import TwoTowerConfig
    from recmodels.data import binarize
    from recmodels.loaders import load_interactions
    from recmodels.splits import leave_one_out
    from recmodels.trigram import hashed_ids

    ap = argparse.ArgumentParser(prog="python -m experiments.studies.sttfedrec_click_leak", description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--dim", type=int, default=4096, help="click_id_dim B")
    ap.add_argument("--cohort", type=int, default=50, help="clients per round K")
    ap.add_argument("--cohorts", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    train = leave_one_out(binarize(load_interactions(args.data)), seed=0).train
    b = hashed_ids(train.item_ids, args.dim, TwoTowerConfig().click_id_salt)
    out = {"dim": args.dim, "cohort": args.cohort, "cohorts": args.cohorts,
           "items_per_bucket": train.n_items / args.dim,
           **cohort_exposure(train.users, b[train.items], train.n_users, args.dim, args.cohort, args.cohorts)}
    print(jsonio.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
