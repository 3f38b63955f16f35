"""Train/test splits: leave-one-out by latest timestamp, and a per-user ratio split by time.

Both order each user's interactions by timestamp; interactions with the same timestamp are
ordered by a seeded random shuffle (``numpy.random.default_rng(seed)``), so a split is
reproducible from its seed and never depends on file order. The ``protocol`` dict of each
split is JSON-serialisable and is printed with every result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from recmodels.data import Interactions, subset

__all__ = ["RatioSplit", "Split", "leave_one_out", "ratio_split", "user_time_order"]


@dataclass(frozen=True, eq=False)
class Split:
    """A leave-one-out split.

    Attributes:
        train: training interactions (same ``n_users``, ``n_items`` and id maps as the input).
        test_items: int64 ``[n_users]``, the held-out item of each user (-1 if the user has no
            interactions).
        valid_items: int64 ``[n_users]`` (the validation item, -1 if none) or ``None``.
        protocol: JSON-serialisable description (kind, seed, tie-break, ...).
    """

    train: Interactions
    test_items: np.ndarray
    valid_items: np.ndarray | None
    protocol: dict[str, Any]

    @property
    def test_users(self) -> np.ndarray:
        """Dense indices of the users with a held-out item."""
        return np.flatnonzero(self.test_items >= 0)


@dataclass(frozen=True, eq=False)
class RatioSplit:
    """A per-user ratio split by time.

    Attributes:
        train: the earlier interactions of every user.
        test: the later interactions (same id maps as ``train``).
        protocol: JSON-serialisable description.
    """

    train: Interactions
    test: Interactions
    protocol: dict[str, Any]


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; found {seed!r}.")
    return int(seed)


def user_time_order(data: Interactions, seed: int) -> np.ndarray:
    """Row order grouping users (ascending) and, within a user, timestamps ascending.

    Same-timestamp rows are ordered by a seeded random shuffle.

    Args:
        data: the dataset.
        seed: seed of the tie-breaking shuffle.

    Returns:
        int64 row indices of ``data`` in (user, time, shuffled tie) order.
    """
    rng = np.random.default_rng(_check_seed(seed))
    tie = rng.permutation(len(data))
    return np.lexsort((tie, data.timestamps, data.users))


def leave_one_out(data: Interactions, *, seed: int, validation: bool = False) -> Split:
    """Hold out each user's latest interaction (and the one before it for validation).

    Args:
        data: the dataset (typically binarised and filtered with ``min_user=2``).
        seed: seed of the shuffle that breaks same-timestamp ties.
        validation: also hold out the second-latest interaction as the validation item.

    Returns:
        A :class:`Split`. Users without interactions get ``-1``.

    Raises:
        ValueError: if a user has 1 interaction (or fewer than 3 with ``validation``); the
            message names ``filter_min_interactions``.
    """
    need = 3 if validation else 2
    counts = np.bincount(data.users, minlength=data.n_users)
    short = np.flatnonzero((counts > 0) & (counts < need))
    if short.size:
        u = int(short[0])
        raise ValueError(
            f"leave_one_out(validation={validation}) needs >= {need} interactions per user; "
            f"{short.size} users have fewer (e.g. user {data.user_ids[u].item()!r} has {counts[u]}). "
            f"Apply recmodels.data.filter_min_interactions(data, min_user={need}) first."
        )
    order = user_time_order(data, seed)
    sorted_users = data.users[order]
    is_last = np.ones(len(order), dtype=bool)
    is_last[:-1] = sorted_users[1:] != sorted_users[:-1]
    test_rows = order[is_last]
    test_items = np.full(data.n_users, -1, dtype=np.int64)
    test_items[data.users[test_rows]] = data.items[test_rows]
    keep = np.ones(len(data), dtype=bool)
    keep[test_rows] = False
    valid_items = None
    if validation:
        is_second = np.zeros(len(order), dtype=bool)
        is_second[:-1] = is_last[1:]
        valid_rows = order[is_second]
        valid_items = np.full(data.n_users, -1, dtype=np.int64)
        valid_items[data.users[valid_rows]] = data.items[valid_rows]
        keep[valid_rows] = False
    protocol = {
        "kind": "leave-one-out",
        "held_out": "latest timestamp per user" + (" (test), second-latest (validation)" if validation else ""),
        "tie_break": "seeded shuffle",
        "seed": int(seed),
        "validation": bool(validation),
        "n_test_users": int((test_items >= 0).sum()),
        "n_train": int(keep.sum()),
        "source": data.source,
    }
    train = subset(data, keep)
    return Split(train=train, test_items=test_items, valid_items=valid_items, protocol=protocol)


def ratio_split(data: Interactions, *, test_ratio: float = 0.2, seed: int) -> RatioSplit:
    """Per user, hold out the latest ``test_ratio`` share of interactions.

    A user with ``n`` interactions contributes ``clip(round(test_ratio * n), 1, n - 1)`` test
    interactions (``round`` halves up), so every user keeps at least one training and one test
    interaction.

    Args:
        data: the dataset.
        test_ratio: share of each user's interactions held out, in (0, 1).
        seed: seed of the shuffle that breaks same-timestamp ties.

    Returns:
        A :class:`RatioSplit`.

    Raises:
        ValueError: for ``test_ratio`` outside (0, 1) or users with a single interaction.
    """
    if not 0.0 < float(test_ratio) < 1.0:
        raise ValueError(f"test_ratio must lie in (0, 1); found {test_ratio!r}.")
    counts = np.bincount(data.users, minlength=data.n_users)
    short = np.flatnonzero(counts == 1)
    if short.size:
        raise ValueError(
            f"ratio_split needs >= 2 interactions per user; {short.size} users have 1 (e.g. user "
            f"{data.user_ids[int(short[0])].item()!r}). Apply "
            "recmodels.data.filter_min_interactions(data, min_user=2) first."
        )
    order = user_time_order(data, seed)
    sorted_users = data.users[order]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    position = np.arange(len(order)) - starts[sorted_users]
    n_test = np.clip(np.floor(test_ratio * counts + 0.5), 1, np.maximum(counts - 1, 1)).astype(np.int64)
    is_test_sorted = position >= (counts - n_test)[sorted_users]
    is_test = np.zeros(len(data), dtype=bool)
    is_test[order] = is_test_sorted
    protocol = {
        "kind": "ratio",
        "test_ratio": float(test_ratio),
        "held_out": "latest share per user, clip(round(ratio*n), 1, n-1)",
        "tie_break": "seeded shuffle",
        "seed": int(seed),
        "n_train": int((~is_test).sum()),
        "n_test": int(is_test.sum()),
        "source": data.source,
    }
    return RatioSplit(train=subset(data, ~is_test), test=subset(data, is_test), protocol=protocol)
