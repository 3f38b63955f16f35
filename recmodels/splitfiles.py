"""Explicit train/validation/test files and the candidate lists a paper's authors evaluated on.

Most federated-recommendation papers did not re-split their data: they evaluated on files they
released. This module reads those files into a :class:`~recmodels.splits.Split` (the same type
leave-one-out produces, so every protocol trains on it unchanged) plus the exact candidate lists
(:class:`~recmodels.sampling.EvalCandidates`), with nothing re-sampled.

Formats (``fmt``):

``"ncf"``: He et al.'s NCF repository (``Data/ml-1m.*``, ``Data/pinterest-20.*``), which most
FedRec papers reuse, FedFast among them.

* ``PREFIX.train.rating``: ``user<TAB>item<TAB>rating<TAB>timestamp`` per line, no header; ids are
  non-negative integers, the rating a number, the timestamp an integer (a file of 3 fields has no
  timestamp: row order is the time). Every line of a file has the same number of fields.
* ``PREFIX.test.rating``: the same layout, exactly one line (the held-out item) per test user.
* ``PREFIX.test.negative``: one line per test line, ``(user,item)<TAB>neg<TAB>neg...``; the pair
  names the test line it belongs to (matched by the pair, so the order may differ); the negatives
  are item ids (NCF: 99 per user). Optional: without it the negatives are sampled as usual
  (``eval.negatives``).
* ``PREFIX.valid.rating`` / ``PREFIX.valid.negative``: the same for a validation split (optional; NCF
  ships none).

``"lightfr-csv"``: the CSVs of Zhang et al.'s LightFR repository (``data/filmtrust/``).

* ``PREFIX_train.csv``: header ``user_id,item_id,ratings``, then ``user,item,rating`` rows. The
  ratings are kept as written: the authors' FilmTrust file holds them already min-max scaled,
  ``(stars - 0.5) / 3.5 + 0.01``, so 0.01..1.01 (a ``[data] threshold`` compares with these values).
  There is no timestamp: row order is the time.
* ``PREFIX_val.csv`` (optional) and ``PREFIX_test.csv``: the same header; per user one contiguous
  block: first the held-out positive (its rating, in stars, greater than 0), then its negatives,
  each with rating 0 (the authors' blocks hold 49). The candidate lists are these blocks; the
  format has no separate candidate file.

Conventions (both formats; decided from the authors' files and documented in ``docs/data.md``):

* **Ids** are the files' integers. Users and items get dense indices in increasing raw-id order,
  shared by every file: raw user 7 is the same dense user in train, validation, test and candidates.
* **Users** that hold out an item (test or validation) must have a training row: a user unseen in
  training is refused, naming the file and line (the papers evaluate their clients only).
* **Items** form the union of every file's items, as the authors' code sizes its item matrix:
  an item met only among the candidates (FilmTrust: 26 of 2,042) is part of the catalogue and is
  scored from the model's initial state. ``report["items_without_training_rows"]`` counts them.
* **Negatives are kept as listed**: a duplicate inside one list stays a second competitor (the
  LightFR file draws with replacement: 616 duplicates in the FilmTrust validation blocks), and a
  negative the user rated in training stays (779 there). Both are counted in the report.
* **A listed negative equal to the user's own positive** (the FilmTrust validation file has two)
  is not a competitor: it would tie with the positive by construction. It is masked out
  (``EvalCandidates.valid``) and counted (``negatives_equal_to_positive``). Under the authors'
  optimistic rule this changes nothing; under the pessimistic one it would cost the user one rank.
* **Repeated (user, item) pairs in a training file** are merged keeping the later row, as the
  generic loaders do; the report counts them.
* Blank lines are skipped; text is decoded strictly (:func:`recmodels.loaders.read_text`).

Every problem raises :class:`~recmodels.loaders.DataFormatError` (``path:line: ...``) or
:class:`~recmodels.loaders.DataFileNotFoundError`.

Finding the files: :func:`find_split_files` recognises a folder (or a path prefix such as
``Data/ml-1m``) holding one of the layouts above; :func:`split_files` takes explicit paths
(``[data] train/valid/test``, ``[eval] candidates/valid_candidates``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recmodels.data import Interactions, deduplicate
from recmodels.datafiles import nonblank_lines
from recmodels.sampling import EvalCandidates
from recmodels.splits import Split

__all__ = [
    "LIGHTFR_HEADER",
    "SPLIT_FORMATS",
    "ExplicitSplit",
    "SplitFiles",
    "find_split_files",
    "load_split",
    "read_lightfr_csv",
    "read_ncf_negative",
    "read_ncf_rating",
    "split_files",
]

#: The formats of split folders (``[data] format``); the interaction-file formats are in
#: :data:`recmodels.loaders.FORMATS`.
SPLIT_FORMATS: tuple[str, ...] = ("ncf", "lightfr-csv")
#: The header of every LightFR CSV.
LIGHTFR_HEADER: tuple[str, ...] = ("user_id", "item_id", "ratings")

_NCF_NAMES = {"train": ".train.rating", "test": ".test.rating", "candidates": ".test.negative",
              "valid": ".valid.rating", "valid_candidates": ".valid.negative"}
_LIGHTFR_NAMES = {"train": "_train.csv", "test": "_test.csv", "valid": "_val.csv"}
_INT = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_PAIR = re.compile(r"\(([0-9]+),([0-9]+)\)")


def _error(path: Path, line: int | None, message: str) -> Exception:
    from recmodels.loaders import DataFormatError

    return DataFormatError(path, line, message)


# --------------------------------------------------------------------------- locating the files


@dataclass(frozen=True)
class SplitFiles:
    """Where a split's files are (``None``: the file is absent).

    Attributes:
        fmt: one of :data:`SPLIT_FORMATS`.
        train, test: the training file and the test file (required).
        valid: the validation file.
        candidates: NCF's ``.test.negative`` (LightFR's test CSV holds its own candidates: ``None``).
        valid_candidates: NCF's ``.valid.negative``.
    """

    fmt: str
    train: Path
    test: Path
    valid: Path | None = None
    candidates: Path | None = None
    valid_candidates: Path | None = None

    def paths(self) -> list[Path]:
        """Every file of the split (the ones a run fingerprints)."""
        return [p for p in (self.train, self.valid, self.test, self.candidates, self.valid_candidates) if p is not None]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the format and each file's path (``None`` when absent)."""
        return {"format": self.fmt, "train": str(self.train), "valid": _str(self.valid), "test": str(self.test),
                "candidates": _str(self.candidates), "valid_candidates": _str(self.valid_candidates)}

    def describe(self) -> str:
        """One line for people: the format and the file names."""
        parts = [f"train {self.train.name}", f"test {self.test.name}"]
        if self.fmt == "lightfr-csv":
            parts[-1] += " (its candidate blocks)"
        elif self.candidates is not None:
            parts.append(f"candidates {self.candidates.name}")
        else:
            parts.append("no candidate file (negatives sampled)")
        if self.valid is not None:
            parts.append(f"validation {self.valid.name}"
                         + (f" + {self.valid_candidates.name}" if self.valid_candidates is not None else ""))
        return f"{self.fmt} split files in {self.train.parent}: " + ", ".join(parts)


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _layouts(folder: Path, prefix: str | None) -> list[SplitFiles]:
    """The split layouts in ``folder`` (only those of ``prefix`` when given)."""
    found: list[SplitFiles] = []
    for fmt, names in (("ncf", _NCF_NAMES), ("lightfr-csv", _LIGHTFR_NAMES)):
        suffix = names["train"]
        for train in sorted(folder.glob(f"*{suffix}")):
            stem = train.name[: -len(suffix)]
            if not stem or (prefix is not None and stem != prefix) or not train.is_file():
                continue
            test = folder / f"{stem}{names['test']}"
            if not test.is_file():
                continue

            def opt(role: str, stem: str = stem, names: dict[str, str] = names) -> Path | None:
                path = folder / f"{stem}{names[role]}" if role in names else None
                return path if path is not None and path.is_file() else None

            valid = opt("valid")
            found.append(SplitFiles(fmt, train, test, valid, opt("candidates"),
                                    opt("valid_candidates") if valid is not None else None))
    return found


def find_split_files(path: Path | str, fmt: str | None = None) -> SplitFiles | None:
    """The split layout at ``path``, or ``None`` if there is none.

    ``path`` is a folder holding exactly one layout (``X.train.rating`` + ``X.test.rating`` [+
    ``X.test.negative``, ``X.valid.rating``, ``X.valid.negative``], or ``X_train.csv`` + ``X_test.csv``
    [+ ``X_val.csv``]), or a prefix naming one layout in its folder (``Data/ml-1m``,
    ``data/filmtrust/filmtrust``).

    Args:
        path: a folder or a prefix.
        fmt: ``None`` (any format) or one of :data:`SPLIT_FORMATS`.

    Raises:
        DataFormatError: the folder holds several layouts (the message lists them and says how to pick one).
    """
    if fmt is not None and fmt not in SPLIT_FORMATS:
        raise ValueError(f"fmt must be one of {SPLIT_FORMATS}; found {fmt!r}.")
    p = Path(path).expanduser()
    if p.is_dir():
        folder, prefix = p, None
    elif not p.exists() and p.parent.is_dir():
        folder, prefix = p.parent, p.name
    else:
        return None
    found = [f for f in _layouts(folder, prefix) if fmt is None or f.fmt == fmt]
    if len(found) > 1:
        stems = [f.train.name[: -len((_NCF_NAMES if f.fmt == "ncf" else _LIGHTFR_NAMES)["train"])] for f in found]
        names = ", ".join(f"{stem} ({f.fmt})" for stem, f in zip(stems, found))
        raise _error(folder, None, f"holds several split layouts ({names}); point --data at one of them by its prefix "
                     f"(e.g. {folder / stems[0]}) or set [data] train and test.")
    return found[0] if found else None


def _infer_fmt(path: Path) -> str:
    if path.name.endswith(".rating"):
        return "ncf"
    if path.name.endswith(".csv"):
        return "lightfr-csv"
    raise _error(path, None, f"cannot tell the split format from the name {path.name!r}; set [data] format to one of "
                 f"{', '.join(SPLIT_FORMATS)}.")


def split_files(
    base: Path | str | None,
    *,
    train: str,
    test: str,
    valid: str = "",
    candidates: str = "",
    valid_candidates: str = "",
    fmt: str | None = None,
) -> SplitFiles:
    """Explicit split files (``[data] train/valid/test``, ``[eval] candidates/valid_candidates``).

    Relative paths are taken inside ``base`` (the data folder; a file's folder when ``base`` is a
    file); ``""`` means absent. For NCF, a test (validation) file ``X.rating`` without an explicit
    candidate file uses ``X.negative`` beside it when that file exists.

    Raises:
        DataFileNotFoundError: a named file does not exist.
        DataFormatError: no train or test file, an unknown format, or a candidate file given with
            LightFR's CSVs (whose test file holds its own candidates).
    """
    from recmodels.loaders import DataFileNotFoundError

    root = None if base is None else Path(base).expanduser()
    if root is not None and root.is_file():
        root = root.parent

    def path_of(role: str, value: str) -> Path | None:
        if not value:
            return None
        p = Path(value).expanduser()
        if not p.is_absolute() and root is not None:
            p = root / p
        if not p.is_file():
            raise DataFileNotFoundError(f"{p}: no such file (the {role} file of the split); fix its path.")
        return p

    if not train or not test:
        missing = " and ".join(r for r, v in (("train", train), ("test", test)) if not v)
        raise _error(Path(root or "."), None, f"an explicit split needs [data] train and test; {missing} missing.")
    t, s = path_of("train", train), path_of("test", test)
    assert t is not None and s is not None
    fmt = fmt or _infer_fmt(t)
    if fmt not in SPLIT_FORMATS:
        raise _error(t, None, f"unknown split format {fmt!r}; use one of {', '.join(SPLIT_FORMATS)}.")
    v = path_of("validation", valid)
    c, vc = path_of("candidates", candidates), path_of("validation candidates", valid_candidates)
    if fmt == "lightfr-csv" and (c is not None or vc is not None):
        raise _error(c or vc, None, "LightFR's test and validation CSVs hold their own candidate blocks; leave "
                     "[eval] candidates and valid_candidates empty.")
    if vc is not None and v is None:
        raise _error(vc, None, "validation candidates need a validation file ([data] valid).")
    if fmt == "ncf":
        def sibling(p: Path | None) -> Path | None:
            if p is None or not p.name.endswith(".rating"):
                return None
            q = p.with_name(p.name[: -len(".rating")] + ".negative")
            return q if q.is_file() else None

        c = c or sibling(s)
        vc = vc or sibling(v)
    return SplitFiles(fmt, t, s, v, c, vc)


# --------------------------------------------------------------------------- parsing


def _check_all(path: Path, values: list[str], lines: list[int], pattern: re.Pattern[str], what: str) -> None:
    """Refuse the first value that does not match ``pattern``, naming its line."""
    if not values or re.fullmatch(rf"(?:{pattern.pattern})(?:\n(?:{pattern.pattern}))*", "\n".join(values)):
        return
    for value, line in zip(values, lines):
        if not pattern.fullmatch(value):
            raise _error(path, line, f"{what} {value[:40]!r} is not {'a non-negative integer' if pattern is _INT else 'a number'}.")
    raise AssertionError("unreachable: a value failed the joined match but none alone")  # pragma: no cover


def _ints(path: Path, values: list[str], lines: list[int], what: str) -> np.ndarray:
    _check_all(path, values, lines, _INT, what)
    try:
        return np.array(values, dtype=np.int64) if values else np.zeros(0, np.int64)
    except OverflowError:
        for value, line in zip(values, lines):
            if int(value) >= 2**63:
                raise _error(path, line, f"{what} {value[:40]!r} is too large (at most 2^63 - 1).") from None
        raise


def _floats(path: Path, values: list[str], lines: list[int], what: str) -> np.ndarray:
    _check_all(path, values, lines, _NUMBER, what)
    out = np.array(values, dtype=np.float64) if values else np.zeros(0)
    bad = ~np.isfinite(out)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise _error(path, lines[row], f"{what} {values[row][:40]!r} is not a finite number.")
    return out


@dataclass(frozen=True, eq=False)
class _Rows:
    """Parsed rows of one file: raw ids, ratings, timestamps and 1-based line numbers."""

    path: Path
    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    timestamps: np.ndarray
    lines: np.ndarray


def read_ncf_rating(path: Path | str) -> _Rows:
    """Rows of an NCF ``.rating`` file (see the module docstring).

    Raises:
        DataFormatError: a line with another number of fields than the first (3 or 4), a header,
            an id that is not a non-negative integer, a rating that is not a finite number, a
            timestamp that is not an integer, or an empty file.
    """
    path = Path(path)
    numbered = nonblank_lines(path)
    if not numbered:
        raise _error(path, None, "no rows (the file is empty); check the path.")
    fields = [line.split("\t") for _, line in numbered]
    lines = [n for n, _ in numbered]
    width = len(fields[0])
    layout = "NCF's layout is user<TAB>item<TAB>rating<TAB>timestamp"
    if width not in (3, 4):
        raise _error(path, lines[0], f"found {width} tab-separated fields; {layout} (3 fields: no timestamp).")
    for row, line in zip(fields, lines):
        if len(row) != width:
            raise _error(path, line, f"found {len(row)} tab-separated fields, the first line has {width}; {layout}.")
    cols = list(zip(*fields))
    users = _ints(path, list(cols[0]), lines, "user id")
    items = _ints(path, list(cols[1]), lines, "item id")
    ratings = _floats(path, list(cols[2]), lines, "rating")
    stamps = _ints(path, list(cols[3]), lines, "timestamp") if width == 4 else np.arange(len(lines), dtype=np.int64)
    return _Rows(path, users, items, ratings, stamps, np.asarray(lines))


def read_ncf_negative(path: Path | str) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], np.ndarray]:
    """An NCF ``.negative`` file: ``(users, positives, negatives per line, line numbers)``.

    Raises:
        DataFormatError: a line that does not start with ``(user,item)``, that lists no negative,
            or whose negatives are not non-negative integers; an empty file.
    """
    path = Path(path)
    numbered = nonblank_lines(path)
    if not numbered:
        raise _error(path, None, "no rows (the file is empty); check the path.")
    users, positives, negatives, lines = [], [], [], []
    flat, flat_lines = [], []
    for number, line in numbered:
        parts = line.rstrip(" \t").split("\t")
        m = _PAIR.fullmatch(parts[0])
        if m is None:
            raise _error(path, number, f"expected '(user,item)' then tab-separated negative item ids; found "
                         f"{parts[0][:40]!r} first (NCF's .negative layout).")
        if len(parts) < 2:
            raise _error(path, number, "lists no negative item after the (user,item) pair.")
        users.append(m.group(1))
        positives.append(m.group(2))
        lines.append(number)
        flat.extend(parts[1:])
        flat_lines.extend([number] * (len(parts) - 1))
        negatives.append(len(parts) - 1)
    items = _ints(path, flat, flat_lines, "negative item id")
    bounds = np.cumsum([0, *negatives])
    per_line = [items[bounds[j]: bounds[j + 1]] for j in range(len(negatives))]
    return (_ints(path, users, lines, "user id"), _ints(path, positives, lines, "item id"), per_line,
            np.asarray(lines))


def read_lightfr_csv(path: Path | str) -> _Rows:
    """Rows of a LightFR CSV (header ``user_id,item_id,ratings``; row order is the time).

    Raises:
        DataFormatError: another header, a row without 3 comma-separated fields, an id that is not
            a non-negative integer, a rating that is not a finite number, no rows.
    """
    path = Path(path)
    numbered = nonblank_lines(path)
    if not numbered:
        raise _error(path, None, "no rows (the file is empty); check the path.")
    head_line, head = numbered[0]
    if tuple(f.strip() for f in head.split(",")) != LIGHTFR_HEADER:
        raise _error(path, head_line, f"expected LightFR's header {','.join(LIGHTFR_HEADER)!r}; found {head[:60]!r}.")
    body = numbered[1:]
    if not body:
        raise _error(path, None, "no rows after the header; check the path.")
    fields = [line.split(",") for _, line in body]
    lines = [n for n, _ in body]
    for row, line in zip(fields, lines):
        if len(row) != 3:
            raise _error(path, line, f"found {len(row)} comma-separated fields; LightFR's rows are user_id,item_id,ratings.")
    cols = [[f.strip() for f in col] for col in zip(*fields)]
    return _Rows(path, _ints(path, cols[0], lines, "user id"), _ints(path, cols[1], lines, "item id"),
                 _floats(path, cols[2], lines, "rating"), np.arange(len(lines), dtype=np.int64), np.asarray(lines))


@dataclass(frozen=True, eq=False)
class _Lists:
    """Held-out items of one file and, when the format gives them, their candidate lists (raw ids)."""

    path: Path
    users: np.ndarray  # raw user per held-out item
    positives: np.ndarray  # raw held-out item
    lines: np.ndarray  # line of each held-out item
    negatives: list[np.ndarray] | None  # raw negatives per held-out item (None: none given)
    candidates_path: Path | None


def _one_per_user(path: Path, users: np.ndarray, lines: np.ndarray, what: str) -> None:
    order = np.argsort(users, kind="stable")
    dup = np.flatnonzero(users[order][1:] == users[order][:-1])
    if dup.size:
        a, b = order[dup[0]], order[dup[0] + 1]
        raise _error(path, int(lines[b]), f"user {int(users[b])} holds out a second {what} item (first on line "
                     f"{int(lines[a])}); the file must hold one held-out item per user.")


def _ncf_lists(held: Path, negative: Path | None, what: str) -> _Lists:
    rows = read_ncf_rating(held)
    _one_per_user(held, rows.users, rows.lines, what)
    if negative is None:
        return _Lists(held, rows.users, rows.items, rows.lines, None, None)
    n_users, n_pos, per_line, n_lines = read_ncf_negative(negative)
    key = {(int(u), int(i)): j for j, (u, i) in enumerate(zip(rows.users, rows.items))}
    negatives: list[np.ndarray | None] = [None] * len(rows.users)
    for u, i, negs, line in zip(n_users, n_pos, per_line, n_lines):
        j = key.get((int(u), int(i)))
        if j is None:
            raise _error(negative, int(line), f"names ({int(u)},{int(i)}), which is no line of {held.name}; each line "
                         "of the .negative file belongs to one held-out (user,item) pair.")
        if negatives[j] is not None:
            raise _error(negative, int(line), f"lists ({int(u)},{int(i)}) a second time; one candidate line per pair.")
        negatives[j] = negs
    missing = [j for j, n in enumerate(negatives) if n is None]
    if missing:
        j = missing[0]
        raise _error(held, int(rows.lines[j]), f"({int(rows.users[j])},{int(rows.items[j])}) has no candidate line in "
                     f"{negative.name} ({len(missing)} held-out pairs have none).")
    return _Lists(held, rows.users, rows.items, rows.lines, [n for n in negatives if n is not None], negative)


def _lightfr_lists(path: Path, what: str) -> _Lists:
    rows = read_lightfr_csv(path)
    u, r = rows.users, rows.ratings
    starts = np.concatenate(([0], np.flatnonzero(u[1:] != u[:-1]) + 1))
    ends = np.concatenate((starts[1:], [len(u)]))
    block_users = u[starts]
    order = np.argsort(block_users, kind="stable")
    dup = np.flatnonzero(block_users[order][1:] == block_users[order][:-1])
    if dup.size:
        a, b = starts[order[dup[0]]], starts[order[dup[0] + 1]]
        raise _error(path, int(rows.lines[b]), f"user {int(u[b])}'s rows are not contiguous (an earlier block starts on line "
                     f"{int(rows.lines[a])}); each user holds one block: its positive, then its negatives.")
    if np.any(r < 0):
        row = int(np.flatnonzero(r < 0)[0])
        raise _error(path, int(rows.lines[row]), f"rating {r[row]:g} is negative; positives have their rating, negatives 0.")
    first = r[starts]
    if np.any(first == 0):
        b = int(np.flatnonzero(first == 0)[0])
        raise _error(path, int(rows.lines[starts[b]]), f"user {int(u[starts[b]])}'s block starts with rating 0; the first "
                     f"row of each block is the held-out {what} positive (its rating > 0), the negatives follow with rating 0.")
    rest = np.ones(len(u), dtype=bool)
    rest[starts] = False
    second = np.flatnonzero(rest & (r != 0))
    if second.size:
        row = int(second[0])
        raise _error(path, int(rows.lines[row]), f"user {int(u[row])} has a second positive (rating {r[row]:g}); a block holds "
                     "one positive (its first row) and negatives with rating 0.")
    negatives = [rows.items[s + 1: e] for s, e in zip(starts, ends)]
    return _Lists(path, block_users, rows.items[starts], rows.lines[starts], negatives, path)


# --------------------------------------------------------------------------- assembly


@dataclass(frozen=True, eq=False)
class ExplicitSplit:
    """A split read from files.

    Attributes:
        split: train interactions (every file's items in the catalogue), ``test_items``,
            ``valid_items`` (``None`` without a validation file) and ``protocol``.
        candidates: the test candidate lists (``None``: no candidate file; sample negatives).
        valid_candidates: the validation candidate lists, likewise.
        report: JSON-ready counts of what the files hold and what was merged or masked.
    """

    split: Split
    candidates: EvalCandidates | None
    valid_candidates: EvalCandidates | None
    report: dict[str, Any] = field(default_factory=dict)


def _dense(raw: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return np.searchsorted(ids, raw).astype(np.int64)


def _candidates(lists: _Lists, user_ids: np.ndarray, item_ids: np.ndarray,
                train_keys: np.ndarray, n_items: int) -> tuple[EvalCandidates, dict[str, Any]]:
    assert lists.negatives is not None
    users = _dense(lists.users, user_ids)
    pos = _dense(lists.positives, item_ids)
    order = np.argsort(users, kind="stable")
    width = 1 + max((len(n) for n in lists.negatives), default=0)
    items = np.repeat(pos[order][:, None], width, axis=1)
    valid = np.zeros(items.shape, dtype=bool)
    valid[:, 0] = True
    duplicates = in_train = 0
    for row, j in enumerate(order):
        negs = _dense(lists.negatives[j], item_ids)
        items[row, 1: 1 + len(negs)] = negs
        valid[row, 1: 1 + len(negs)] = True
        duplicates += len(negs) - len(np.unique(negs))
        in_train += int(np.isin(users[j] * n_items + negs, train_keys).sum())
    same = valid & (items == items[:, :1])
    same[:, 0] = False
    valid &= ~same
    counts = valid.sum(axis=1)
    report = {
        "file": str(lists.candidates_path),
        "users": int(len(users)),
        "candidates_per_user": [int(counts.min()), int(counts.max())] if len(counts) else [0, 0],
        "negatives_equal_to_positive": int(same.sum()),
        "duplicate_negatives": int(duplicates),
        "negatives_rated_in_train": int(in_train),
    }
    return EvalCandidates(users[order], items, valid, source=str(lists.candidates_path)), report


def load_split(files: SplitFiles) -> ExplicitSplit:
    """Read a split's files into a :class:`~recmodels.splits.Split` and its candidate lists.

    Raises:
        DataFormatError: any malformed file (see the readers), a held-out user without training
            rows, several held-out items for one user.
        DataFileNotFoundError: a file cannot be read.
    """
    if files.fmt == "ncf":
        train = read_ncf_rating(files.train)
        test = _ncf_lists(files.test, files.candidates, "test")
        valid = None if files.valid is None else _ncf_lists(files.valid, files.valid_candidates, "validation")
    elif files.fmt == "lightfr-csv":
        train = read_lightfr_csv(files.train)
        test = _lightfr_lists(files.test, "test")
        valid = None if files.valid is None else _lightfr_lists(files.valid, "validation")
    else:
        raise _error(files.train, None, f"unknown split format {files.fmt!r}; use one of {', '.join(SPLIT_FORMATS)}.")
    held = [x for x in (test, valid) if x is not None]
    user_ids = np.unique(train.users)
    for lists in held:
        unseen = ~np.isin(lists.users, user_ids)
        if unseen.any():
            j = int(np.flatnonzero(unseen)[0])
            raise _error(lists.path, int(lists.lines[j]), f"user {int(lists.users[j])} has no row in {files.train.name}; "
                         f"every user who holds out an item must train ({int(unseen.sum())} such users in this file).")
    item_parts = [train.items] + [x.positives for x in held] + [n for x in held for n in (x.negatives or [])]
    item_ids = np.unique(np.concatenate(item_parts))
    n_items = len(item_ids)
    data = Interactions(
        users=_dense(train.users, user_ids), items=_dense(train.items, item_ids), ratings=train.ratings,
        timestamps=train.timestamps, user_ids=user_ids, item_ids=item_ids,
        source=f"{files.train} [{files.fmt} train]", check_duplicates=False,
    )
    data, merged = deduplicate(data)
    if merged:
        data = Interactions(users=data.users, items=data.items, ratings=data.ratings, timestamps=data.timestamps,
                            user_ids=data.user_ids, item_ids=data.item_ids, check_duplicates=False,
                            source=f"{data.source} ({merged} repeated user-item pairs merged, latest kept)")
    train_keys = np.unique(data.users * n_items + data.items)

    def targets(lists: _Lists | None) -> np.ndarray | None:
        if lists is None:
            return None
        out = np.full(len(user_ids), -1, dtype=np.int64)
        out[_dense(lists.users, user_ids)] = _dense(lists.positives, item_ids)
        return out

    test_items, valid_items = targets(test), targets(valid)
    report: dict[str, Any] = {
        "format": files.fmt,
        "train_rows": int(len(train.users)),
        "train_pairs_merged": int(merged),
        "users": int(len(user_ids)),
        "items": n_items,
        "items_without_training_rows": int(n_items - len(np.unique(data.items))),
        "test_users": int(len(test.users)),
        "users_without_test_item": int(len(user_ids) - len(test.users)),
        "test_positives_in_train": int(np.isin(_dense(test.users, user_ids) * n_items + _dense(test.positives, item_ids),
                                               train_keys).sum()),
    }
    if valid is not None:
        report["valid_users"] = int(len(valid.users))
        report["valid_positives_in_train"] = int(np.isin(
            _dense(valid.users, user_ids) * n_items + _dense(valid.positives, item_ids), train_keys).sum())
    candidates = valid_candidates = None
    if test.negatives is not None:
        candidates, report["candidates"] = _candidates(test, user_ids, item_ids, train_keys, n_items)
    if valid is not None and valid.negatives is not None:
        valid_candidates, report["valid_candidates"] = _candidates(valid, user_ids, item_ids, train_keys, n_items)
    protocol = {
        "kind": "explicit files",
        "format": files.fmt,
        "held_out": "as the files give them: one test item per user"
                    + (", one validation item per user" if valid is not None else ""),
        **{k: v for k, v in files.as_dict().items() if k != "format"},
        "validation": valid is not None,
        "n_test_users": int((test_items >= 0).sum()),
        "n_train": int(len(data)),
        "source": data.source,
    }
    return ExplicitSplit(Split(train=data, test_items=test_items, valid_items=valid_items, protocol=protocol),
                         candidates, valid_candidates, report)
