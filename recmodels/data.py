"""The interaction dataset type and the filters applied before splitting.

An :class:`Interactions` holds one row per (user, item) event with dense integer indices
``0..n_users-1`` / ``0..n_items-1`` and the raw ids they came from. Everything downstream
(splits, samplers, models, federated protocols) works on the dense indices.

Defaults of the data pipeline (documented in ``docs/data.md`` and printed with every result):

* every rating counts as a positive interaction (:func:`binarize` with ``threshold=None``);
* users need at least 2 interactions (:func:`filter_min_interactions` with ``min_user=2``);
* no item filter (``min_item=0``).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Any

import numpy as np

__all__ = [
    "Interactions",
    "align_interactions",
    "binarize",
    "deduplicate",
    "filter_min_interactions",
    "interaction_stats",
    "pair_keys",
    "subset",
]


def pair_keys(users: np.ndarray, items: np.ndarray, n_items: int) -> np.ndarray:
    """Encode (user, item) pairs as one int64 key ``user * n_items + item`` (order-preserving)."""
    return np.asarray(users, dtype=np.int64) * np.int64(max(n_items, 1)) + np.asarray(
        items, dtype=np.int64
    )


def _as_index_array(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"Interactions.{name} must be 1-D; found shape {arr.shape}.")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(
            f"Interactions.{name} must hold integers (dense indices); found dtype {arr.dtype}. "
            "Build datasets with recmodels.loaders.load_interactions, which re-indexes raw ids."
        )
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True, eq=False)
class Interactions:
    """User-item interactions with dense indices and the raw ids behind them.

    Attributes:
        users: int64 ``[n]``, dense user index ``0..n_users-1`` of each interaction.
        items: int64 ``[n]``, dense item index ``0..n_items-1``.
        ratings: float32 ``[n]``, the explicit rating (1.0 for implicit data).
        timestamps: int64 ``[n]``, seconds; synthetic data uses increasing fake times.
        user_ids: raw id of each dense user index (length ``n_users``).
        item_ids: raw id of each dense item index (length ``n_items``).
        source: human-readable provenance (a path, or ``"synthetic(seed=0,...)"``).

    Arrays are converted to the dtypes above on construction and must not be mutated
    afterwards. Construction validates lengths, dtypes, index ranges and finite ratings, and
    that no (user, item) pair occurs twice (use :func:`deduplicate`), raising ``ValueError``
    that names the fix.
    """

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    timestamps: np.ndarray
    user_ids: np.ndarray
    item_ids: np.ndarray
    source: str = ""
    check_duplicates: InitVar[bool] = True

    def __post_init__(self, check_duplicates: bool) -> None:
        users = _as_index_array("users", self.users)
        items = _as_index_array("items", self.items)
        timestamps = _as_index_array("timestamps", self.timestamps)
        ratings = np.asarray(self.ratings)
        if ratings.ndim != 1 or (ratings.size and ratings.dtype.kind not in "iuf"):
            raise ValueError(
                f"Interactions.ratings must be a 1-D numeric array; found dtype {ratings.dtype}, "
                f"shape {ratings.shape}."
            )
        ratings = ratings.astype(np.float32, copy=False)
        user_ids = np.asarray(self.user_ids)
        item_ids = np.asarray(self.item_ids)
        if user_ids.ndim != 1 or item_ids.ndim != 1:
            raise ValueError("Interactions.user_ids and item_ids must be 1-D arrays of raw ids.")
        n = len(users)
        lengths = {"items": len(items), "ratings": len(ratings), "timestamps": len(timestamps)}
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise ValueError(
                f"Interactions arrays must have equal length: users has {n}, but {bad}. "
                "Pass one entry per interaction in every array."
            )
        for name, arr, bound in (("users", users, len(user_ids)), ("items", items, len(item_ids))):
            if n and (arr.min() < 0 or arr.max() >= bound):
                raise ValueError(
                    f"Interactions.{name} must lie in 0..{bound - 1} (len({name[:-1]}_ids)={bound}); "
                    f"found range {arr.min()}..{arr.max()}. Re-index densely or extend "
                    f"{name[:-1]}_ids."
                )
        if n and not np.all(np.isfinite(ratings)):
            row = int(np.flatnonzero(~np.isfinite(ratings))[0])
            raise ValueError(
                f"Interactions.ratings must be finite; found {ratings[row]} at row {row}. "
                "Drop or fix non-finite ratings before building the dataset."
            )
        if check_duplicates and n:
            keys = np.sort(pair_keys(users, items, len(item_ids)))
            dup = np.flatnonzero(keys[1:] == keys[:-1])
            if dup.size:
                k = int(keys[dup[0]])
                u, i = divmod(k, max(len(item_ids), 1))
                raise ValueError(
                    f"Interactions has {dup.size} duplicate (user, item) pairs, e.g. user "
                    f"{user_ids[u].item()!r} and item {item_ids[i].item()!r}; merge them with "
                    "recmodels.data.deduplicate(data) (keeps the latest)."
                )
        object.__setattr__(self, "users", users)
        object.__setattr__(self, "items", items)
        object.__setattr__(self, "ratings", ratings)
        object.__setattr__(self, "timestamps", timestamps)
        object.__setattr__(self, "user_ids", user_ids)
        object.__setattr__(self, "item_ids", item_ids)

    @property
    def n_users(self) -> int:
        """Number of dense user indices (``len(user_ids)``)."""
        return int(len(self.user_ids))

    @property
    def n_items(self) -> int:
        """Number of dense item indices (``len(item_ids)``)."""
        return int(len(self.item_ids))

    def __len__(self) -> int:
        return int(len(self.users))

    @property
    def density(self) -> float:
        """``len(self) / (n_users * n_items)`` (0.0 for an empty shape)."""
        cells = self.n_users * self.n_items
        return float(len(self) / cells) if cells else 0.0

    def describe(self) -> str:
        """One line: source, users, items, interactions, density."""
        return (
            f"{self.source or '<unnamed>'}: {self.n_users} users, {self.n_items} items, "
            f"{len(self)} interactions, density {self.density:.4%}"
        )

    def __repr__(self) -> str:
        return f"Interactions({self.describe()})"


def _replace(data: Interactions, mask: np.ndarray | None = None, **changes: Any) -> Interactions:
    """Copy of ``data`` restricted to ``mask`` rows with ``changes`` applied (no re-index)."""
    fields = {
        "users": data.users,
        "items": data.items,
        "ratings": data.ratings,
        "timestamps": data.timestamps,
    }
    if mask is not None:
        fields = {k: v[mask] for k, v in fields.items()}
    fields.update(
        {"user_ids": data.user_ids, "item_ids": data.item_ids, "source": data.source}
    )
    fields.update(changes)
    return Interactions(**fields, check_duplicates=False)


def subset(data: Interactions, rows: np.ndarray) -> Interactions:
    """Interactions restricted to ``rows`` (bool mask or indices), keeping the id maps.

    Args:
        data: the dataset.
        rows: boolean mask of length ``len(data)`` or integer row indices (no repeats).

    Returns:
        A dataset with the same ``n_users``, ``n_items`` and id maps.
    """
    rows = np.asarray(rows)
    if rows.dtype == bool and rows.shape != (len(data),):
        raise ValueError(f"subset mask must have shape ({len(data)},); found {rows.shape}.")
    return _replace(data, rows)


def _reindex(data: Interactions, source: str) -> Interactions:
    """Drop users/items without interactions and renumber densely (order of raw ids kept)."""
    user_present = np.bincount(data.users, minlength=data.n_users) > 0
    item_present = np.bincount(data.items, minlength=data.n_items) > 0
    user_map = np.cumsum(user_present) - 1
    item_map = np.cumsum(item_present) - 1
    return Interactions(
        users=user_map[data.users],
        items=item_map[data.items],
        ratings=data.ratings,
        timestamps=data.timestamps,
        user_ids=data.user_ids[user_present],
        item_ids=data.item_ids[item_present],
        source=source,
        check_duplicates=False,
    )


def _positions(ids: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each ``wanted`` raw id in ``ids`` and whether it is there (``ids`` need not be sorted)."""
    if ids.size == 0:
        return np.zeros(wanted.shape, np.int64), np.zeros(wanted.shape, bool)
    if ids.dtype.kind != wanted.dtype.kind and not (ids.dtype.kind in "iu" and wanted.dtype.kind in "iu"):
        return np.zeros(wanted.shape, np.int64), np.zeros(wanted.shape, bool)  # int ids never equal str ids
    order = np.argsort(ids, kind="stable")
    pos = np.minimum(np.searchsorted(ids[order], wanted), ids.size - 1)
    found = ids[order][pos] == wanted
    return order[pos].astype(np.int64), found


def align_interactions(data: Interactions, like: Interactions) -> Interactions:
    """``data``'s rows re-indexed onto ``like``'s id maps; rows of users or items ``like`` lacks are dropped.

    Typical use: the interactions a sampler must never draw as negatives (``exclude=``) are the
    raw file's, *before* :func:`binarize` dropped the ratings below the threshold and
    :func:`filter_min_interactions` re-indexed: ``exclude = align_interactions(raw, prepared)``.
    Matching is by raw id (``user_ids`` / ``item_ids``).

    Returns:
        A dataset with ``like``'s ``n_users``, ``n_items`` and id maps (ratings and timestamps
        kept), which may contain pairs that ``like`` also holds.
    """
    upos, ufound = _positions(np.asarray(like.user_ids), np.asarray(data.user_ids))
    ipos, ifound = _positions(np.asarray(like.item_ids), np.asarray(data.item_ids))
    keep = ufound[data.users] & ifound[data.items]
    return Interactions(
        users=upos[data.users[keep]],
        items=ipos[data.items[keep]],
        ratings=data.ratings[keep],
        timestamps=data.timestamps[keep],
        user_ids=like.user_ids,
        item_ids=like.item_ids,
        source=f"{data.source} | aligned to {like.n_users} users, {like.n_items} items",
        check_duplicates=False,
    )


def filter_min_interactions(
    data: Interactions, *, min_user: int = 2, min_item: int = 0
) -> Interactions:
    """Keep users with >= ``min_user`` and items with >= ``min_item`` interactions.

    Removing items can push users below the threshold and vice versa, so the two filters are
    applied alternately until neither removes anything (the "k-core" fixpoint). The result is
    re-indexed densely: users and items left without interactions are dropped, and the
    remaining ones keep the relative order of their raw ids.

    Args:
        data: the dataset.
        min_user: minimum interactions per user (default 2, the project default: leave-one-out
            needs one to hold out and one to train on).
        min_item: minimum interactions per item (default 0: no item filter).

    Returns:
        The filtered, densely re-indexed dataset.

    Raises:
        ValueError: for negative thresholds, or when nothing survives the filter.
    """
    for name, value in (("min_user", min_user), ("min_item", min_item)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative int; found {value!r}.")
    keep = np.ones(len(data), dtype=bool)
    while True:
        users, items = data.users[keep], data.items[keep]
        ucount = np.bincount(users, minlength=data.n_users)
        icount = np.bincount(items, minlength=data.n_items)
        drop = (ucount[data.users] < min_user) | (icount[data.items] < min_item)
        new_keep = keep & ~drop
        if np.array_equal(new_keep, keep):
            break
        keep = new_keep
    if not keep.any():
        raise ValueError(
            f"no interactions left after filter_min_interactions(min_user={min_user}, "
            f"min_item={min_item}) on {data.describe()}; lower the thresholds."
        )
    note = f"min_user={min_user}" + (f",min_item={min_item}" if min_item else "")
    return _reindex(_replace(data, keep), f"{data.source} | filter({note})")


def binarize(data: Interactions, *, threshold: float | None = None) -> Interactions:
    """Turn explicit ratings into implicit positives (rating 1.0).

    Args:
        data: the dataset.
        threshold: ``None`` (the default) makes every rating a positive interaction; a number
            keeps only interactions with ``rating >= threshold``.

    Returns:
        A dataset with ratings all 1.0 and the same id maps (users or items whose ratings all
        fall below the threshold keep their index with no interactions; apply
        :func:`filter_min_interactions` afterwards to drop them).

    Raises:
        ValueError: if ``threshold`` is not a finite number.
    """
    if threshold is None:
        mask = None
        note = "binarize(all positive)"
    else:
        if isinstance(threshold, bool) or not np.isfinite(float(threshold)):
            raise ValueError(f"threshold must be a finite number or None; found {threshold!r}.")
        mask = data.ratings >= np.float32(threshold)
        note = f"binarize(rating>={threshold:g})"
    kept = len(data) if mask is None else int(mask.sum())
    return _replace(
        data,
        mask,
        ratings=np.ones(kept, dtype=np.float32),
        source=f"{data.source} | {note}",
    )


def deduplicate(data: Interactions) -> tuple[Interactions, int]:
    """Merge repeated (user, item) pairs, keeping the latest event (last in row order on ties).

    Args:
        data: a dataset that may contain repeated pairs (built with ``check_duplicates=False``).

    Returns:
        ``(deduplicated dataset, number of rows removed)``.
    """
    n = len(data)
    if n == 0:
        return data, 0
    keys = pair_keys(data.users, data.items, data.n_items)
    order = np.lexsort((np.arange(n), data.timestamps, keys))
    sorted_keys = keys[order]
    last = np.ones(n, dtype=bool)
    last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
    removed = int(n - last.sum())
    if removed == 0:
        return data, 0
    keep_rows = np.sort(order[last])
    return _replace(data, keep_rows), removed


def interaction_stats(data: Interactions) -> dict[str, Any]:
    """JSON-serialisable statistics of a dataset (sizes, per-user/item counts, ratings, times)."""
    ucount = np.bincount(data.users, minlength=data.n_users)
    icount = np.bincount(data.items, minlength=data.n_items)
    n = len(data)

    def _summary(counts: np.ndarray) -> dict[str, float]:
        if counts.size == 0:
            return {"min": 0, "median": 0.0, "mean": 0.0, "max": 0}
        return {
            "min": int(counts.min()),
            "median": float(np.median(counts)),
            "mean": float(counts.mean()),
            "max": int(counts.max()),
        }

    stats: dict[str, Any] = {
        "source": data.source,
        "n_users": data.n_users,
        "n_items": data.n_items,
        "n_interactions": n,
        "density": data.density,
        "interactions_per_user": _summary(ucount),
        "interactions_per_item": _summary(icount),
        "users_with_fewer_than_2": int((ucount < 2).sum()),
    }
    if n:
        values = np.unique(data.ratings)
        stats["ratings"] = {
            "min": float(data.ratings.min()),
            "max": float(data.ratings.max()),
            "mean": float(data.ratings.mean()),
            "distinct_values": [float(v) for v in values[:20]],
            "implicit": bool(values.size == 1 and values[0] == 1.0),
        }
        stats["timestamps"] = {"min": int(data.timestamps.min()), "max": int(data.timestamps.max())}
    return stats
