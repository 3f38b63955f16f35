"""Loaders for MovieLens files and generic CSV interaction logs.

Formats (``fmt``):

* ``"ml-100k"``: MovieLens 100K ``u.data``: tab-separated ``user item rating timestamp``,
  integer ratings 1..5, no header.
* ``"ml-1m"``: MovieLens 1M ``ratings.dat``: ``UserID::MovieID::Rating::Timestamp``, integer
  ratings 1..5, no header.
* ``"ml-csv"``: ``ratings.csv`` of ml-latest-small / ml-25m style: header
  ``userId,movieId,rating,timestamp``, ratings 0.5..5.0 in steps of 0.5.
* ``"csv"``: a generic delimited file with a header row; ``columns`` maps the roles
  ``"user"``, ``"item"`` (required), ``"rating"``, ``"timestamp"`` (optional) to column names.
  Without ``columns`` common names are recognised (``user``/``user_id``/``userId``,
  ``item``/``item_id``/``itemId``/``movieId``, ``rating``, ``timestamp``/``time``). Ids may be
  any non-empty strings; a missing rating column means implicit data (rating 1.0); a missing
  timestamp column uses the row order (0, 1, 2, ...) as time.

The format is inferred from the file name (``u.data``, ``ratings.dat``, ``ratings.csv``) or
from a directory holding exactly one of them; otherwise pass ``fmt`` (``--format`` on the
command line). Raw ids are re-indexed densely in increasing raw-id order. A (user, item) pair
that occurs more than once is merged, keeping the latest event (noted in ``source``).

Every input error raises :class:`DataFormatError` (a ``ValueError``) or
:class:`DataFileNotFoundError` (a ``FileNotFoundError``) whose message names the file and the
1-based line number.
"""

from __future__ import annotations

import csv
import io
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recmodels.data import Interactions, deduplicate

__all__ = [
    "FORMATS",
    "DataFileNotFoundError",
    "DataFormatError",
    "infer_format",
    "load_interactions",
    "resolve_data_path",
]

#: Supported values of ``fmt``.
FORMATS: tuple[str, ...] = ("ml-100k", "ml-1m", "ml-csv", "csv")

_FILE_NAMES: dict[str, str] = {"u.data": "ml-100k", "ratings.dat": "ml-1m", "ratings.csv": "ml-csv"}

_ALIASES: dict[str, tuple[str, ...]] = {
    "user": ("user", "user_id", "userid", "uid", "u"),
    "item": ("item", "item_id", "itemid", "movieid", "movie_id", "iid", "i"),
    "rating": ("rating", "ratings", "score", "value"),
    "timestamp": ("timestamp", "time", "ts", "date_ts"),
}


class DataFormatError(ValueError):
    """A data file could not be parsed; the message names the file and the 1-based line.

    Attributes:
        path: the offending file.
        line: 1-based line number, or ``None`` when the problem is not tied to a line.
    """

    def __init__(self, path: Path | str, line: int | None, message: str) -> None:
        self.path = Path(path)
        self.line = line
        where = f"{self.path}:{line}" if line is not None else f"{self.path}"
        super().__init__(f"{where}: {message}")


class DataFileNotFoundError(FileNotFoundError):
    """The data file or folder does not exist (message says how to get it)."""


@dataclass(frozen=True)
class _MLSpec:
    sep: str
    header: tuple[str, ...] | None
    rating_min: float
    rating_max: float
    rating_step: float


_ML_SPECS: dict[str, _MLSpec] = {
    "ml-100k": _MLSpec("\t", None, 1.0, 5.0, 1.0),
    "ml-1m": _MLSpec("::", None, 1.0, 5.0, 1.0),
    "ml-csv": _MLSpec(",", ("userId", "movieId", "rating", "timestamp"), 0.5, 5.0, 0.5),
}

_FIELDS = ("user", "item", "rating", "timestamp")


def infer_format(path: Path | str) -> str:
    """Format name for a file path from its name (``u.data``, ``ratings.dat``, ``ratings.csv``).

    Raises:
        DataFormatError: when the name is not one of them (pass ``fmt`` / ``--format``).
    """
    name = Path(path).name
    if name in _FILE_NAMES:
        return _FILE_NAMES[name]
    raise DataFormatError(
        path,
        None,
        f"cannot infer the format from the file name {name!r} (known: "
        f"{', '.join(sorted(_FILE_NAMES))}); pass --format (fmt=) one of {', '.join(FORMATS)}, "
        "and for 'csv' a column mapping if the header names are unusual.",
    )


def resolve_data_path(path: Path | str) -> Path:
    """The interaction file for ``path``: the file itself, or the one known file in a folder.

    A folder is searched for ``u.data``, ``ratings.dat`` and ``ratings.csv``, first directly
    and then in its immediate sub-folders (so a download folder holding ``ml-100k/`` works).

    Raises:
        DataFileNotFoundError: if nothing exists at ``path`` or the folder holds no known file.
        DataFormatError: if a folder holds more than one candidate.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DataFileNotFoundError(
            f"{p}: no such file or folder. Point --data at u.data, ratings.dat, ratings.csv or a "
            "folder holding one, or fetch one with `secagg data download ml-latest-small`."
        )
    if p.is_file():
        return p
    for pattern in ("{}", "*/{}"):
        found = sorted(c for name in _FILE_NAMES for c in p.glob(pattern.format(name)) if c.is_file())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            listing = ", ".join(str(c) for c in found)
            raise DataFormatError(
                p, None, f"folder holds several interaction files ({listing}); pass one of them."
            )
    raise DataFileNotFoundError(
        f"{p}: folder holds no u.data, ratings.dat or ratings.csv (nor does any sub-folder); "
        "pass the file itself with --format."
    )


def load_interactions(
    path: Path | str,
    *,
    fmt: str | None = None,
    columns: Mapping[str, str | int] | None = None,
    sep: str | None = None,
    rating_range: tuple[float, float] | None = None,
) -> Interactions:
    """Load an interaction file into :class:`~recmodels.data.Interactions`.

    Args:
        path: a file, or a folder holding ``u.data``, ``ratings.dat`` or ``ratings.csv``.
        fmt: one of :data:`FORMATS`; ``None`` infers it from the file name.
        columns: for ``fmt="csv"``, ``{"user": col, "item": col, "rating": col?,
            "timestamp": col?}`` with column names from the header (or 0-based ints).
        sep: for ``fmt="csv"``, the delimiter (default ``","``).
        rating_range: for ``fmt="csv"``, inclusive ``(min, max)`` allowed ratings (default:
            any finite value). MovieLens formats always check their published scale.

    Returns:
        The dataset, densely indexed, with ``source`` set to the file path.

    Raises:
        DataFileNotFoundError: missing file or folder.
        DataFormatError: unknown format, empty file, unparsable ids or fields, NaN or
            out-of-range ratings (the message names the file and line).
    """
    file = resolve_data_path(path)
    if fmt is None:
        fmt = infer_format(file)
    if fmt not in FORMATS:
        raise DataFormatError(
            file, None, f"unknown format {fmt!r}; use --format (fmt=) one of {', '.join(FORMATS)}."
        )
    if fmt != "csv" and (columns is not None or sep is not None or rating_range is not None):
        raise DataFormatError(
            file, None, f"columns/sep/rating_range apply to fmt='csv' only, not {fmt!r}."
        )
    try:
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataFileNotFoundError(f"{file}: cannot read ({exc.strerror or exc}).") from exc
    if fmt == "csv":
        raw = _parse_generic(file, text, columns, sep or ",", rating_range)
    else:
        raw = _parse_movielens(file, text, _ML_SPECS[fmt])
    return _build(file, fmt, *raw)


# --------------------------------------------------------------------------- MovieLens


def _data_lines(text: str, skip: int) -> list[tuple[int, str]]:
    """(1-based line number, content) of non-blank lines after ``skip`` header lines."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if number <= skip or not line.strip():
            continue
        out.append((number, line))
    return out


def _parse_movielens(
    file: Path, text: str, spec: _MLSpec
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    skip = 0
    if spec.header is not None:
        first = text.split("\n", 1)[0].strip().lstrip("\ufeff")
        found = tuple(h.strip() for h in first.split(spec.sep))
        if found != spec.header:
            raise DataFormatError(
                file,
                1,
                f"expected the header {spec.sep.join(spec.header)!r}, found {first[:80]!r}; for "
                "other layouts use --format csv (with a column mapping).",
            )
        skip = 1
    body = text.replace(spec.sep, "\t") if len(spec.sep) > 1 else text
    delimiter = "\t" if len(spec.sep) > 1 else spec.sep
    dtype = [("user", "i8"), ("item", "i8"), ("rating", "f8"), ("timestamp", "i8")]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data": handled below
            table = np.loadtxt(
                io.StringIO(body), delimiter=delimiter, skiprows=skip, dtype=dtype, ndmin=1, comments=None
            )
    except ValueError as exc:
        _scan_movielens(file, text, spec, skip)
        raise DataFormatError(file, None, f"cannot parse: {exc}") from exc
    if table.size == 0:
        raise DataFormatError(
            file, None, "no interactions (the file is empty after the header); check the path."
        )
    ratings = table["rating"]
    ok = np.isfinite(ratings) & (ratings >= spec.rating_min) & (ratings <= spec.rating_max)
    ok &= np.isclose(np.round(ratings / spec.rating_step) * spec.rating_step, ratings)
    if not ok.all():
        row = int(np.flatnonzero(~ok)[0])
        line = _data_lines(text, skip)[row][0]
        raise DataFormatError(file, line, _bad_rating_message(ratings[row], spec))
    return table["user"], table["item"], ratings, table["timestamp"]


def _bad_rating_message(value: float, spec: _MLSpec) -> str:
    if math.isnan(value):
        return "rating is NaN; every rating must be a number."
    return (
        f"rating {value:g} is outside the scale {spec.rating_min:g}..{spec.rating_max:g} "
        f"in steps of {spec.rating_step:g}; fix the line or load it with --format csv."
    )


def _scan_movielens(file: Path, text: str, spec: _MLSpec, skip: int) -> None:
    """Find the first malformed line and raise a precise :class:`DataFormatError`."""
    layout = f"expected 4 fields separated by {spec.sep!r}: user item rating timestamp"
    for number, line in _data_lines(text, skip):
        parts = line.strip("\r\n").split(spec.sep)
        if len(parts) != 4:
            raise DataFormatError(file, number, f"found {len(parts)} fields; {layout}.")
        for field, value in zip(_FIELDS, parts):
            value = value.strip()
            try:
                if field == "rating":
                    float(value)
                else:
                    int(value)
            except ValueError:
                kind = "a number" if field == "rating" else "an integer"
                what = f"{field} id" if field in ("user", "item") else field
                raise DataFormatError(
                    file, number, f"cannot parse {what} {value!r} as {kind}; {layout}."
                ) from None


# --------------------------------------------------------------------------- generic CSV


def _resolve_columns(
    file: Path, header: list[str], columns: Mapping[str, str | int] | None
) -> dict[str, int]:
    names = [h.strip().lstrip("\ufeff") for h in header]
    lowered = {n.lower(): i for i, n in enumerate(names)}
    out: dict[str, int] = {}
    if columns is None:
        for role, aliases in _ALIASES.items():
            for alias in aliases:
                if alias in lowered:
                    out[role] = lowered[alias]
                    break
    else:
        unknown = set(columns) - set(_FIELDS)
        if unknown:
            raise DataFormatError(
                file, None,
                f"unknown column role(s) {sorted(unknown)}; use keys among {list(_FIELDS)}.",
            )
        for role, col in columns.items():
            if isinstance(col, int) and not isinstance(col, bool):
                if not 0 <= col < len(names):
                    raise DataFormatError(
                        file, 1, f"column index {col} for {role!r} is out of range 0..{len(names) - 1}."
                    )
                out[role] = col
            elif col in names:
                out[role] = names.index(col)
            else:
                raise DataFormatError(
                    file, 1, f"column {col!r} for {role!r} is not in the header {names}; fix the "
                    "column mapping.",
                )
    for role in ("user", "item"):
        if role not in out:
            raise DataFormatError(
                file,
                1,
                f"no {role} column found in the header {names}; pass columns={{'{role}': NAME, ...}}.",
            )
    return out


def _parse_generic(
    file: Path,
    text: str,
    columns: Mapping[str, str | int] | None,
    sep: str,
    rating_range: tuple[float, float] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if len(sep) != 1:
        raise DataFormatError(file, None, f"sep must be one character for --format csv; found {sep!r}.")
    reader = csv.reader(io.StringIO(text), delimiter=sep)
    rows: list[list[str]] = []
    lines: list[int] = []
    header: list[str] | None = None
    for row in reader:
        if not row or all(not c.strip() for c in row):
            continue
        if header is None:
            header = row
            continue
        rows.append(row)
        lines.append(reader.line_num)
    if header is None or not rows:
        raise DataFormatError(
            file, None, "no interactions (the file is empty or has only a header); check the path."
        )
    cols = _resolve_columns(file, header, columns)
    width = len(header)
    for row, line in zip(rows, lines):
        if len(row) != width:
            raise DataFormatError(
                file, line, f"found {len(row)} fields, the header has {width} (delimiter {sep!r})."
            )
    line_arr = np.asarray(lines)

    def column(role: str) -> list[str]:
        index = cols[role]
        return [r[index].strip() for r in rows]

    ids = {}
    for role in ("user", "item"):
        values = column(role)
        empty = [i for i, v in enumerate(values) if not v]
        if empty:
            raise DataFormatError(file, lines[empty[0]], f"empty {role} id; every row needs one.")
        ids[role] = values
    if "rating" in cols:
        ratings = _numbers(file, column("rating"), line_arr, "rating")
        bad = ~np.isfinite(ratings)
        if rating_range is not None:
            lo, hi = rating_range
            bad |= (ratings < lo) | (ratings > hi)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            value = ratings[row]
            msg = (
                "rating is NaN; every rating must be a number."
                if math.isnan(value)
                else f"rating {value:g} is not finite or outside rating_range={rating_range}."
            )
            raise DataFormatError(file, lines[row], msg)
    else:
        ratings = np.ones(len(rows))
    if "timestamp" in cols:
        ts_float = _numbers(file, column("timestamp"), line_arr, "timestamp")
        if not np.all(np.isfinite(ts_float)):
            row = int(np.flatnonzero(~np.isfinite(ts_float))[0])
            raise DataFormatError(file, lines[row], "timestamp must be a finite number of seconds.")
        timestamps = ts_float.astype(np.int64)
    else:
        timestamps = np.arange(len(rows), dtype=np.int64)
    return (
        _ids_array(ids["user"]),
        _ids_array(ids["item"]),
        ratings,
        timestamps,
    )


def _numbers(file: Path, values: list[str], lines: np.ndarray, what: str) -> np.ndarray:
    try:
        return np.array(values, dtype=np.float64)
    except ValueError:
        for value, line in zip(values, lines):
            try:
                float(value)
            except ValueError:
                raise DataFormatError(
                    file, int(line), f"cannot parse {what} {value!r} as a number."
                ) from None
        raise


def _ids_array(values: list[str]) -> np.ndarray:
    """Raw ids as int64 when every one is an integer literal, else as strings."""
    try:
        return np.array(values, dtype=np.int64)
    except (ValueError, OverflowError):
        return np.array(values, dtype=np.str_)


# --------------------------------------------------------------------------- assembly


def _build(
    file: Path,
    fmt: str,
    raw_users: np.ndarray,
    raw_items: np.ndarray,
    ratings: np.ndarray,
    timestamps: np.ndarray,
) -> Interactions:
    user_ids, users = np.unique(raw_users, return_inverse=True)
    item_ids, items = np.unique(raw_items, return_inverse=True)
    data = Interactions(
        users=users.reshape(-1),
        items=items.reshape(-1),
        ratings=ratings,
        timestamps=timestamps,
        user_ids=user_ids,
        item_ids=item_ids,
        source=f"{file} [{fmt}]",
        check_duplicates=False,
    )
    data, removed = deduplicate(data)
    if removed:
        data = Interactions(
            users=data.users,
            items=data.items,
            ratings=data.ratings,
            timestamps=data.timestamps,
            user_ids=data.user_ids,
            item_ids=data.item_ids,
            source=f"{data.source} ({removed} repeated user-item pairs merged, latest kept)",
            check_duplicates=False,
        )
    return data
