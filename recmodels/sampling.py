"""Negative sampling for training and sampled evaluation (vectorised, seeded).

Negative sampling is a simulation choice, so it draws from a seeded ``numpy.random.Generator``
passed in by the caller (reproducible runs); it never produces secrets.

* :func:`sample_train_negatives`: for each training interaction, ``n_neg`` items drawn
  uniformly (with replacement across draws) from the items the user never interacted with in
  training nor in ``exclude`` (e.g. ratings below the positive threshold: rated, hence not
  "never interacted"; build it with :func:`recmodels.data.align_interactions`). Bulk rejection:
  draw everything, redraw the rejected entries, repeat.
* :func:`sample_eval_candidates`: for each evaluated user, the held-out item followed by
  ``n_negatives`` *distinct* items drawn uniformly from the items the user never interacted with
  (training, held-out and validation items, plus ``exclude``). Bulk rejection of
  interacted/duplicate entries; rows that keep failing (users who interacted with most of the
  catalogue) fall back to an exact per-row draw over the allowed items.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from recmodels.data import Interactions, pair_keys
from recmodels.splits import Split

__all__ = [
    "EvalCandidates",
    "sample_eval_candidates",
    "sample_negatives_keyed",
    "sample_train_negatives",
    "user_item_csr",
]

_MAX_BULK_ROUNDS = 30


@dataclass(frozen=True, eq=False)
class EvalCandidates:
    """Candidates of the sampled evaluation protocol, or the ones a paper's files give.

    Attributes:
        users: int64 ``[n_eval_users]``, dense user indices (those with a held-out item).
        items: int64 ``[n_eval_users, 1 + n_negatives]``; column 0 is the held-out item.
        valid: bool ``[n_eval_users, 1 + n_negatives]`` or ``None`` (every entry competes). Lists of
            unequal length (a paper's candidate file) are padded with the held-out item and the
            padding is ``False`` here; so is a listed negative that *is* the held-out item
            (:mod:`recmodels.splitfiles`). Column 0 is always ``True``.
        source: where the candidates come from (``"sampled"`` or a file path), for the protocol text.
    """

    users: np.ndarray
    items: np.ndarray
    valid: np.ndarray | None = None
    source: str = "sampled"

    def __post_init__(self) -> None:
        items = np.asarray(self.items)
        if items.ndim != 2 or items.shape[0] != len(self.users) or items.shape[1] < 1:
            raise ValueError(
                f"EvalCandidates.items must be [n_users, 1 + n_negatives] with one row per user "
                f"({len(self.users)}); found shape {items.shape}."
            )
        if self.valid is not None:
            valid = np.asarray(self.valid, dtype=bool)
            if valid.shape != items.shape:
                raise ValueError(f"EvalCandidates.valid has shape {valid.shape}; items has {items.shape}.")
            if valid.size and not valid[:, 0].all():
                raise ValueError("EvalCandidates.valid must be True in column 0 (the held-out item always competes).")
            object.__setattr__(self, "valid", valid)

    @property
    def n_negatives(self) -> int:
        """Number of negative columns per user (the longest list when lists differ in length)."""
        return int(self.items.shape[1] - 1)

    def n_candidates(self) -> np.ndarray:
        """int64 ``[n_eval_users]``: how many candidates compete for each user (the held-out item included)."""
        if self.valid is None:
            return np.full(len(self.users), self.items.shape[1], dtype=np.int64)
        return self.valid.sum(axis=1, dtype=np.int64)

    def take(self, rows: np.ndarray) -> EvalCandidates:
        """The candidates of the users at ``rows`` (indices into ``users``), mask and source kept."""
        rows = np.asarray(rows)
        valid = None if self.valid is None else self.valid[rows]
        return EvalCandidates(self.users[rows], self.items[rows], valid, self.source)

    def __len__(self) -> int:
        return int(len(self.users))


def user_item_csr(data: Interactions) -> sp.csr_matrix:
    """Boolean ``[n_users, n_items]`` CSR matrix with True where the user interacted."""
    matrix = sp.csr_matrix(
        (np.ones(len(data), dtype=bool), (data.users, data.items)),
        shape=(data.n_users, data.n_items),
        dtype=bool,
    )
    matrix.sum_duplicates()
    matrix.sort_indices()
    return matrix


def _in_sorted(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Membership of ``keys`` in the sorted unique array ``sorted_keys``."""
    if sorted_keys.size == 0:
        return np.zeros(keys.shape, dtype=bool)
    pos = np.searchsorted(sorted_keys, keys)
    pos = np.minimum(pos, sorted_keys.size - 1)
    return sorted_keys[pos] == keys


def _check_rng(rng: object) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise ValueError(
            f"rng must be a numpy.random.Generator (e.g. np.random.default_rng(seed)); found "
            f"{type(rng).__name__}."
        )
    return rng


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int; found {value!r}.")
    return int(value)


def _excluded_keys(train: Interactions, exclude: Interactions | None, what: str) -> np.ndarray | None:
    if exclude is None:
        return None
    if not isinstance(exclude, Interactions):
        raise ValueError(f"exclude must be Interactions (see recmodels.data.align_interactions); found {type(exclude).__name__}.")
    if exclude.n_items != train.n_items or exclude.n_users != train.n_users:
        raise ValueError(
            f"exclude must share the {what}'s id maps ({train.n_users} users, {train.n_items} items); "
            f"found {exclude.n_users} users, {exclude.n_items} items. Build it with "
            "recmodels.data.align_interactions(raw, like=...)."
        )
    return pair_keys(exclude.users, exclude.items, train.n_items)


def sample_train_negatives(
    train: Interactions, *, n_neg: int, rng: np.random.Generator, exclude: Interactions | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``n_neg`` non-interacted items per training interaction.

    Args:
        train: training interactions.
        n_neg: negatives per interaction.
        rng: seeded generator (simulation randomness).
        exclude: further interactions that are never negatives (e.g. every rating in the file,
            including those below the positive threshold), with ``train``'s id maps
            (:func:`recmodels.data.align_interactions`). ``None``: only ``train``'s pairs.

    Returns:
        ``(users, items)``, int64 arrays of length ``len(train) * n_neg``; entries
        ``i * n_neg .. i * n_neg + n_neg - 1`` belong to training interaction ``i`` (its user
        repeated). Items are uniform over the items the user has no pair with in ``train`` or
        ``exclude``, drawn independently (the same item can appear twice).

    Raises:
        ValueError: if a user with training interactions has a pair with every item, or
            ``exclude`` has other id maps.
    """
    n_neg = _check_count("n_neg", n_neg)
    rng = _check_rng(rng)
    n_items = train.n_items
    extra = _excluded_keys(train, exclude, "training data")
    key_parts = [pair_keys(train.users, train.items, n_items)] + ([extra] if extra is not None else [])
    positives = np.unique(np.concatenate(key_parts)) if n_neg > 0 and len(train) else np.zeros(0, np.int64)
    if n_neg > 0 and len(train):
        per_user = np.bincount(positives // max(n_items, 1), minlength=train.n_users)
        full = np.flatnonzero((per_user >= n_items) & (np.bincount(train.users, minlength=train.n_users) > 0))
        if full.size:
            why = " (counting exclude)" if extra is not None else ""
            raise ValueError(
                f"user {train.user_ids[int(full[0])].item()!r} interacted with all {n_items} items{why}, so "
                "no negative exists; drop such users or add items."
            )
    users = np.repeat(train.users, n_neg)
    if users.size == 0:
        return users.astype(np.int64), np.zeros(0, dtype=np.int64)
    items = rng.integers(0, n_items, size=users.size, dtype=np.int64)
    bad = np.flatnonzero(_in_sorted(positives, pair_keys(users, items, n_items)))
    while bad.size:
        items[bad] = rng.integers(0, n_items, size=bad.size, dtype=np.int64)
        still = _in_sorted(positives, pair_keys(users[bad], items[bad], n_items))
        bad = bad[still]
    return users.astype(np.int64), items


def _row_duplicates(items: np.ndarray) -> np.ndarray:
    """Mask of entries equal to an earlier (smaller column) entry of the same row."""
    order = np.argsort(items, axis=1, kind="stable")
    sorted_items = np.take_along_axis(items, order, axis=1)
    dup_sorted = np.zeros_like(items, dtype=bool)
    dup_sorted[:, 1:] = sorted_items[:, 1:] == sorted_items[:, :-1]
    dup = np.zeros_like(dup_sorted)
    np.put_along_axis(dup, order, dup_sorted, axis=1)
    return dup


def sample_eval_candidates(
    split: Split,
    *,
    n_negatives: int = 99,
    rng: np.random.Generator,
    exclude: Interactions | None = None,
    target: str = "test",
) -> EvalCandidates:
    """Held-out item plus ``n_negatives`` distinct never-interacted items per evaluated user.

    Args:
        split: a leave-one-out split; users with ``test_items < 0`` are skipped.
        n_negatives: sampled negatives per user (99 default; 50 FedFast, 49 LightFR presets).
        rng: seeded generator (simulation randomness).
        exclude: further interactions that must never be sampled as negatives (e.g. the
            full dataset before a filter), with the same id maps as ``split.train``.
        target: ``"test"`` (column 0 is each user's test item) or ``"valid"`` (its validation
            item; users without one are skipped). Either way no negative is a training, test or
            validation item of the user.

    Returns:
        :class:`EvalCandidates` with column 0 the held-out item.

    Raises:
        ValueError: if a user has fewer than ``n_negatives`` non-interacted items, or
            ``target="valid"`` on a split without validation items.
    """
    n_negatives = _check_count("n_negatives", n_negatives)
    rng = _check_rng(rng)
    if target not in ("test", "valid"):
        raise ValueError(f"target must be 'test' or 'valid'; found {target!r}.")
    if target == "valid" and split.valid_items is None:
        raise ValueError("target='valid' needs a split with validation items (leave_one_out(..., validation=True)).")
    targets = split.test_items if target == "test" else split.valid_items
    train = split.train
    n_items = train.n_items
    users = np.flatnonzero(targets >= 0).astype(np.int64)
    tu = split.test_users.astype(np.int64)
    key_parts = [pair_keys(train.users, train.items, n_items), pair_keys(tu, split.test_items[tu], n_items)]
    if split.valid_items is not None:
        vu = np.flatnonzero(split.valid_items >= 0)
        key_parts.append(pair_keys(vu, split.valid_items[vu], n_items))
    extra = _excluded_keys(train, exclude, "split")
    if extra is not None:
        key_parts.append(extra)
    positives = np.unique(np.concatenate(key_parts))
    per_user = np.bincount(positives // max(n_items, 1), minlength=train.n_users)
    allowed = n_items - per_user[users]
    short = np.flatnonzero(allowed < n_negatives)
    if short.size:
        u = int(users[short[0]])
        raise ValueError(
            f"user {train.user_ids[u].item()!r} has only {int(allowed[short[0]])} non-interacted items, "
            f"fewer than n_negatives={n_negatives}; lower --eval-negatives or use full ranking."
        )
    shape = (users.size, n_negatives)
    negs = rng.integers(0, n_items, size=shape, dtype=np.int64)
    user_grid = np.broadcast_to(users[:, None], shape)
    pending = np.arange(users.size)
    for _ in range(_MAX_BULK_ROUNDS):
        if pending.size == 0 or n_negatives == 0:
            break
        sub = negs[pending]
        bad = _in_sorted(positives, pair_keys(user_grid[pending], sub, n_items))
        bad |= _row_duplicates(sub)
        rows_bad = bad.any(axis=1)
        if not rows_bad.any():
            break
        sub[bad] = rng.integers(0, n_items, size=int(bad.sum()), dtype=np.int64)
        negs[pending] = sub
        pending = pending[rows_bad]
    else:
        # Exact fallback for the rows that kept colliding: a uniform draw of distinct allowed items.
        sub = negs[pending]
        bad = _in_sorted(positives, pair_keys(user_grid[pending], sub, n_items)) | _row_duplicates(sub)
        for row in pending[bad.any(axis=1)]:
            u = users[row]
            taken = positives[(positives >= u * n_items) & (positives < (u + 1) * n_items)] - u * n_items
            pool = np.setdiff1d(np.arange(n_items), taken, assume_unique=True)
            negs[row] = rng.choice(pool, size=n_negatives, replace=False)
    items = np.concatenate([targets[users][:, None], negs], axis=1)
    return EvalCandidates(users=users, items=items)


def sample_negatives_keyed(
    users: np.ndarray, keys: np.ndarray, index: np.ndarray, *, n_items: int, forbidden: np.ndarray
) -> np.ndarray:
    """One negative per entry, drawn from the entry's own stream (:mod:`recmodels.streams`).

    Entry ``i`` is a negative for ``users[i]``; it draws position ``index[i]`` of stream
    ``keys[i]`` and, while the item is forbidden, the same position of the next attempt. Its
    value therefore depends only on its key and index, never on the other entries: a client
    sampling its negatives alone draws exactly what it draws batched with other clients.

    Args:
        users: int64 ``[n]``, dense user index of each entry.
        keys: uint64 ``[n]``, the stream of each entry (e.g. ``stream_keys(seed, round, epoch, user)``).
        index: int64 ``[n]``, the entry's position in its stream (distinct within a stream, < 2**40).
        n_items: catalogue size.
        forbidden: sorted unique pair keys (:func:`recmodels.data.pair_keys`) never drawn:
            the users' positives and excluded pairs.

    Raises:
        ValueError: if a user of ``users`` has a forbidden pair with every item.
    """
    from recmodels.streams import integers

    users = np.asarray(users, dtype=np.int64)
    if users.size == 0:
        return np.zeros(0, np.int64)
    per_user = np.bincount(forbidden // max(n_items, 1), minlength=int(users.max()) + 1)
    full = np.flatnonzero(per_user[np.unique(users)] >= n_items)
    if full.size:
        raise ValueError(f"user {int(np.unique(users)[full[0]])} interacted with all {n_items} items, so no negative exists")
    index = np.asarray(index, dtype=np.int64)
    items = integers(keys, index, n_items)
    bad = np.flatnonzero(_in_sorted(forbidden, pair_keys(users, items, n_items)))
    attempt = 0
    while bad.size:
        attempt += 1
        items[bad] = integers(keys[bad], index[bad] + (attempt << 40), n_items)
        bad = bad[_in_sorted(forbidden, pair_keys(users[bad], items[bad], n_items))]
    return items
