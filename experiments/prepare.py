"""Load, preprocess and split a run's data, and fingerprint the files it came from."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.config import RunConfig
from recmodels.data import Interactions, align_interactions, binarize, filter_min_interactions, subset
from recmodels.loaders import load_with_format, resolve_data_path
from recmodels.sampling import EvalCandidates, sample_eval_candidates
from recmodels.splits import leave_one_out, ratio_split
from recmodels.synthetic import generate_synthetic

__all__ = ["Prepared", "SIDE_FILES", "data_fingerprint", "prepare_data"]

#: Files beside the interactions that protocols may read (item titles/genres, demographics);
#: they are fingerprinted with the interactions so that --resume notices a changed one.
SIDE_FILES = ("movies.csv", "movies.dat", "u.item", "u.user", "users.dat", "u.genre", "u.occupation")

#: Held-out fraction of each rating protocol's ratio split.
RATING_TEST_RATIO = 0.2


@dataclass
class Prepared:
    """Data after preprocessing, the split and (ranking only) the sampled evaluation candidates."""

    data: Interactions
    split: Any  # Split (ranking) or RatioSplit (rating)
    candidates: EvalCandidates | None
    description: dict[str, Any]
    #: pairs the user rated below ``data.threshold`` (so not positives), on ``data``'s id maps:
    #: never drawn as a training negative (a rated item is not an unseen one). ``None`` when
    #: every rating is a positive.
    exclude: Interactions | None = None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_fingerprint(source: str) -> dict[str, str]:
    """``{absolute path: sha256}`` of the interaction file and the side files beside it.

    Synthetic data has no files (it is a function of the configuration and the seed).
    """
    if source == "synthetic":
        return {}
    main = resolve_data_path(source).resolve()
    out = {str(main): _sha256(main)}
    for name in SIDE_FILES:
        side = main.parent / name
        if side.is_file() and side.resolve() != main:
            out[str(side.resolve())] = _sha256(side)
    return out


def prepare_data(config: RunConfig) -> Prepared:
    """Load (or generate), preprocess, split and sample evaluation candidates, all seeded.

    Ranking protocols get binarised interactions (every rating a positive, or those at or above
    ``data.threshold``), a leave-one-out split and sampled candidates (none when
    ``eval.negatives = 0``). Protocols that train on explicit ratings (``keeps_ratings``) keep
    them; rating protocols (task ``"rating"``) get a seeded 80/20 ratio split instead.
    """
    d, seed, spec = config.data, config.run.seed, config.spec
    layout = None
    if d.source == "synthetic":
        raw = generate_synthetic(
            n_users=d.synthetic_users,
            n_items=d.synthetic_items,
            seed=seed,
            dim=d.synthetic_dim,
            mean_interactions=d.synthetic_mean_interactions,
        )
    else:
        raw, layout = load_with_format(d.source, **d.load_kwargs())
    threshold = None if math.isnan(d.threshold) else d.threshold
    if spec.keeps_ratings:
        data = raw if threshold is None else _at_least(raw, threshold)
    else:
        data = binarize(raw, threshold=threshold)
    data = filter_min_interactions(data, min_user=d.min_user_interactions, min_item=d.min_item_interactions)
    if len(data) == 0 or data.n_users == 0:
        raise ValueError(
            f"no interactions left in {raw.source} after preprocessing (threshold={threshold}, "
            f"min_user_interactions={d.min_user_interactions}, min_item_interactions={d.min_item_interactions})"
        )
    rated = align_interactions(raw, data)  # every rating in the file, on the prepared id maps
    exclude = None
    if threshold is not None and not spec.keeps_ratings:
        exclude = subset(rated, np.flatnonzero(rated.ratings < np.float32(threshold)))
    candidates = None
    if spec.task == "rating":
        split = ratio_split(data, test_ratio=RATING_TEST_RATIO, seed=seed)
    else:
        split = leave_one_out(data, seed=seed, validation=config.split.validation)
        if config.eval.negatives:
            candidates = sample_eval_candidates(
                split, n_negatives=config.eval.negatives, rng=np.random.default_rng([seed, 1]), exclude=rated
            )
    description = {
        "source": raw.source,
        "raw": raw.describe(),
        # how the file was read (format, delimiter, header, columns; inferred or given)
        "layout": None if layout is None else {"read_as": layout.describe(), **layout.as_dict()},
        "preprocessed": data.describe(),
        "positives": ("explicit ratings kept" if spec.keeps_ratings else "every rating")
        if threshold is None
        else f"rating >= {threshold}",
        "min_user_interactions": d.min_user_interactions,
        "min_item_interactions": d.min_item_interactions,
    }
    return Prepared(data, split, candidates, description, exclude)


def _at_least(data: Interactions, threshold: float) -> Interactions:
    """The interactions rated at least ``threshold``, explicit ratings kept."""
    return subset(data, np.flatnonzero(data.ratings >= np.float32(threshold)))
