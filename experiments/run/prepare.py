"""Load, preprocess and split a run's data, and fingerprint the files it came from."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.run.config import RunConfig
from recmodels.data import Interactions, align_interactions, binarize, filter_min_interactions, subset
from recmodels.loaders import load_with_format, resolve_data_path
from recmodels.public_data import public_file, public_format_of
from recmodels.sampling import EvalCandidates, sample_eval_candidates
from recmodels.splitfiles import SPLIT_FORMATS, SplitFiles, find_split_files, load_split, split_files
from recmodels.splits import leave_one_out, ratio_split
from recmodels.synthetic import generate_synthetic

__all__ = ["Prepared", "SIDE_FILES", "data_fingerprint", "prepare_data", "run_data_files", "split_files_of"]

#: Files beside the interactions that protocols may read (item titles/genres, demographics);
#: they are fingerprinted with the interactions so that --resume notices a changed one.
SIDE_FILES = ("movies.csv", "movies.dat", "u.item", "u.user", "users.dat", "u.genre", "u.occupation")

#: Held-out fraction of each rating protocol's ratio split.
RATING_TEST_RATIO = 0.2


@dataclass
class Prepared:
    """Data after preprocessing, the split and (ranking only) the evaluation candidates: sampled, or
    the lists a paper's candidate file gives (``candidates.source`` is then the file)."""

    data: Interactions
    split: Any  # Split (ranking) or RatioSplit (rating)
    candidates: EvalCandidates | None
    description: dict[str, Any]
    #: pairs the user rated below ``data.threshold`` (so not positives), on ``data``'s id maps:
    #: never drawn as a training negative (a rated item is not an unseen one). ``None`` when
    #: every rating is a positive.
    exclude: Interactions | None = None
    #: the validation items' candidates: sampled like ``candidates`` (other draws), or a split file's lists;
    #: ``None`` without validation items or sampled negatives (validation then ranks among all items).
    valid_candidates: EvalCandidates | None = None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_fingerprint(source: str, fmt: str = "") -> dict[str, str]:
    """``{absolute path: sha256}`` of the interaction file and the side files beside it.

    Synthetic data has no files (it is a function of the configuration and the seed). ``fmt`` is
    ``data.format`` (a public format's file is found by its published name).
    """
    if source == "synthetic":
        return {}
    public = public_format_of(source, fmt or None)
    main = (public_file(source, public) if public is not None else resolve_data_path(source)).resolve()
    out = {str(main): _sha256(main)}
    for name in SIDE_FILES:
        side = main.parent / name
        if side.is_file() and side.resolve() != main:
            out[str(side.resolve())] = _sha256(side)
    return out


def split_files_of(config: RunConfig) -> SplitFiles | None:
    """The explicit split files of ``config`` (``[data] train/valid/test``, ``[eval] candidates``, or a
    split folder as ``data.source``), or ``None`` for a leave-one-out run on ``data.source``.

    Raises:
        ValueError: ``[eval] candidates`` without an explicit split, a split format named in
            ``data.format`` with no split files at ``data.source``, an interaction format named beside
            ``[data] train``.
        DataFileNotFoundError: a named file does not exist.
    """
    d, e = config.data, config.eval
    fmt = d.format if d.format in SPLIT_FORMATS else None
    if d.train:
        if d.format and fmt is None:
            raise ValueError(f"data.format = {d.format!r} reads one interaction file; explicit split files "
                             f"([data] train/test) are in one of {', '.join(SPLIT_FORMATS)} (or leave data.format empty)")
        base = None if d.source == "synthetic" else d.source
        return split_files(base, train=d.train, test=d.test, valid=d.valid, candidates=e.candidates,
                           valid_candidates=e.valid_candidates, fmt=fmt)
    if e.candidates or e.valid_candidates:
        raise ValueError("eval.candidates lists the candidates of a fixed test split: set [data] train and test "
                         "(or point data.source at the split's folder) with it")
    if d.source == "synthetic" or (d.format and fmt is None):
        return None
    found = find_split_files(d.source, fmt)
    if found is None and fmt is not None:
        raise ValueError(f"data.format = {fmt!r} but {d.source} holds no {fmt} split ("
                         + ("X.train.rating + X.test.rating" if fmt == "ncf" else "X_train.csv + X_test.csv")
                         + "); point data.source at the folder or prefix, or set [data] train and test")
    return found


def run_data_files(config: RunConfig) -> dict[str, str]:
    """``{absolute path: sha256}`` of every file the run reads: the split files when the run has them
    (:func:`split_files_of`), else the interaction file and its side files (:func:`data_fingerprint`).
    ``run.json`` records it; ``--resume`` refuses a changed file."""
    files = split_files_of(config)
    if files is None:
        return data_fingerprint(config.data.source, config.data.format)
    return {str(p.resolve()): _sha256(p) for p in files.paths()}


def prepare_data(config: RunConfig) -> Prepared:
    """Load (or generate), preprocess, split and sample evaluation candidates, all seeded.

    Ranking protocols get binarised interactions (every rating a positive, or those at or above
    ``data.threshold``), a leave-one-out split and sampled candidates (none when
    ``eval.negatives = 0``). Protocols that train on explicit ratings (``keeps_ratings``) keep
    them; rating protocols (task ``"rating"``) get a seeded 80/20 ratio split instead.
    """
    d, seed, spec = config.data, config.run.seed, config.spec
    files = split_files_of(config)
    if files is not None:
        return _prepare_explicit(config, files)
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
    candidates = valid_candidates = None
    if spec.task == "rating":
        split = ratio_split(data, test_ratio=RATING_TEST_RATIO, seed=seed)
    else:
        split = leave_one_out(data, seed=seed, validation=config.split.validation)
        if config.eval.negatives:
            candidates = sample_eval_candidates(
                split, n_negatives=config.eval.negatives, rng=np.random.default_rng([seed, 1]), exclude=rated
            )
            if split.valid_items is not None:  # model selection ranks the validation items the same way
                valid_candidates = sample_eval_candidates(
                    split, n_negatives=config.eval.negatives, rng=np.random.default_rng([seed, 2]), exclude=rated,
                    target="valid",
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
    return Prepared(data, split, candidates, description, exclude, valid_candidates)


def _at_least(data: Interactions, threshold: float) -> Interactions:
    """The interactions rated at least ``threshold``, explicit ratings kept."""
    return subset(data, np.flatnonzero(data.ratings >= np.float32(threshold)))


def _prepare_explicit(config: RunConfig, files: SplitFiles) -> Prepared:
    """:func:`prepare_data` on a paper's split files: read as they are (no re-split, no filter), the
    training rows binarised (or kept rated) at ``data.threshold``, the candidate lists as given (or
    ``eval.negatives`` sampled when the files list none)."""
    d, seed, spec = config.data, config.run.seed, config.spec
    if spec.task == "rating":
        raise ValueError(f"{config.run.protocol} predicts ratings on a ratio split; explicit split files "
                         f"({files.describe()}) hold one held-out item per user for ranking protocols")
    if config.split.validation and files.valid is None:
        raise ValueError(f"split.validation = true but the split has no validation file ({files.describe()}); "
                         "set [data] valid or turn split.validation off")
    ex = load_split(files)
    raw = ex.split.train
    threshold = None if math.isnan(d.threshold) else d.threshold
    if spec.keeps_ratings:
        train = raw if threshold is None else _at_least(raw, threshold)
    else:
        train = binarize(raw, threshold=threshold)
    exclude = None
    if threshold is not None and not spec.keeps_ratings:
        exclude = subset(raw, np.flatnonzero(raw.ratings < np.float32(threshold)))
    split = dataclasses.replace(ex.split, train=train)
    candidates, valid_candidates = ex.candidates, ex.valid_candidates
    if candidates is None and config.eval.negatives:
        candidates = sample_eval_candidates(split, n_negatives=config.eval.negatives,
                                            rng=np.random.default_rng([seed, 1]), exclude=raw)
    if valid_candidates is None and split.valid_items is not None and config.eval.negatives:
        valid_candidates = sample_eval_candidates(split, n_negatives=config.eval.negatives,
                                                  rng=np.random.default_rng([seed, 2]), exclude=raw, target="valid")
    description = {
        "source": files.describe(),
        "split_files": files.as_dict(),
        "files_report": ex.report,
        "raw": raw.describe(),
        "layout": None,
        "preprocessed": train.describe(),
        "positives": ("explicit ratings kept" if spec.keeps_ratings else "every rating")
        if threshold is None else f"rating >= {threshold}",
        "min_user_interactions": "not applied (the split files fix the users)",
        "min_item_interactions": "not applied (the split files fix the items)",
    }
    return Prepared(train, split, candidates, description, exclude, valid_candidates)
