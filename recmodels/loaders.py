"""Loaders for MovieLens files and any delimited interaction log (CSV, TSV, ...).

Formats (``fmt``):

* ``"ml-100k"``: MovieLens 100K ``u.data``: tab-separated ``user item rating timestamp``,
  integer ratings 1..5, no header.
* ``"ml-1m"``: MovieLens 1M ``ratings.dat``: ``UserID::MovieID::Rating::Timestamp``, integer
  ratings 1..5, no header.
* ``"ml-csv"``: ``ratings.csv`` of ml-latest-small / ml-25m style: header
  ``userId,movieId,rating,timestamp``, ratings 0.5..5.0 in steps of 0.5.
* ``"csv"``: any delimited file (``,``, tab, ``;``, ``|``, ``::`` or spaces), with or without a
  header; ``columns`` maps the roles ``"user"``, ``"item"`` (required), ``"rating"``,
  ``"timestamp"`` (optional) to header names or 0-based indices. Ids may be any non-empty strings;
  a missing rating column means implicit data (rating 1.0); a missing timestamp column uses the
  row order (0, 1, 2, ...) as time; timestamps are numbers of seconds or ISO-8601 dates.

Nothing has to be named: :func:`recmodels.sniff.detect_format` infers the format, the delimiter,
the header and the columns from the content (MovieLens files by name and content), and
:func:`load_with_format` returns what it inferred beside the data so that callers can print it.
Raw ids are re-indexed densely in increasing raw-id order. A (user, item) pair that occurs more
than once is merged, keeping the latest event (noted in ``source``).

Every input error raises :class:`DataFormatError` (a ``ValueError``) or
:class:`DataFileNotFoundError` (a ``FileNotFoundError``) whose message names the file and the
1-based line number. A binary file is refused without echoing its bytes.

Text is decoded strictly (:func:`read_text`): interaction files are UTF-8, and a byte sequence
that is not UTF-8, or a NUL byte anywhere in the file, is refused naming the line and the byte's
column (never the bytes themselves), so ids that differ only in such bytes can never become one
user or item. Lines are what ``\n`` ends (a ``\r`` before it is dropped), the same lines that
NumPy and the ``csv`` module count.
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
from recmodels.datafiles import (
    FORMATS,
    DataFileNotFoundError,
    DataFormatError,
    decode_text,
    infer_format,
    read_text,
    resolve_data_path,
)
from recmodels.sniff import DataFormat, detect_format, split_line

__all__ = [
    "FORMATS",
    "DataFileNotFoundError",
    "DataFormat",
    "DataFormatError",
    "decode_text",
    "detect_format",
    "infer_format",
    "load_interactions",
    "load_with_format",
    "read_text",
    "resolve_data_path",
]

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


def load_interactions(
    path: Path | str,
    *,
    fmt: str | None = None,
    columns: Mapping[str, str | int | None] | None = None,
    sep: str | None = None,
    rating_range: tuple[float, float] | None = None,
) -> Interactions:
    """Load an interaction file into :class:`~recmodels.data.Interactions` (see :func:`load_with_format`)."""
    return load_with_format(path, fmt=fmt, columns=columns, sep=sep, rating_range=rating_range)[0]


def load_with_format(
    path: Path | str,
    *,
    fmt: str | None = None,
    columns: Mapping[str, str | int | None] | None = None,
    sep: str | None = None,
    rating_range: tuple[float, float] | None = None,
) -> tuple[Interactions, DataFormat]:
    """Load an interaction file and say how it was read.

    Args:
        path: a file, or a folder holding ``u.data``, ``ratings.dat`` or ``ratings.csv``.
        fmt: one of :data:`FORMATS`; ``None`` infers it from the name and the content.
        columns: for ``csv``: ``{"user": col, "item": col, "rating": col?, "timestamp": col?}`` with
            header names or 0-based indices (``None``: no such column); roles left out are inferred
            from the header names. Implies ``fmt="csv"`` when ``fmt`` is None.
        sep: for ``csv``, the delimiter (one character or ``"::"``); ``None`` infers it.
        rating_range: for ``csv``, inclusive ``(min, max)`` allowed ratings (default: any finite
            value). MovieLens formats always check their published scale.

    Returns:
        ``(data, layout)``: the dataset, densely indexed, with ``source`` set to the file path; and
        the :class:`~recmodels.sniff.DataFormat` used (``layout.describe()`` for people,
        ``layout.as_dict()`` for JSON, ``layout.load_kwargs()`` to parse the same way again).

    Raises:
        DataFileNotFoundError: missing file or folder.
        DataFormatError: unknown format, binary or empty file, no consistent delimiter, no user or
            item column, unparsable ids or fields, NaN or out-of-range ratings (the message names
            the file and line).
    """
    from recmodels.public_data import PublicLayout, load_public, public_file, public_format_of

    public = public_format_of(path, fmt)
    if public is not None and (columns is not None or sep is not None or rating_range is not None):
        raise DataFormatError(path, None, f"columns, sep and rating_range apply to fmt='csv' only; the {public} format "
                              "has a fixed published layout.")
    if public is not None:  # FilmTrust, Ciao, Yelp, Douban/RecBole in their published formats
        return load_public(path, public), PublicLayout(public_file(path, public), public, inferred=fmt is None)
    if fmt is None and rating_range is not None:
        fmt = "csv"
    if fmt not in (None, "csv") and rating_range is not None:
        raise DataFormatError(path, None, f"rating_range applies to fmt='csv' only, not {fmt!r}.")
    layout = detect_format(path, fmt=fmt, columns=columns, sep=sep)
    file = layout.path
    text = read_text(file)
    if layout.fmt == "csv":
        raw = _parse_generic(file, text, layout, rating_range)
    else:
        raw = _parse_movielens(file, text, _ML_SPECS[layout.fmt])
    return _build(file, layout.fmt, *raw), layout


# --------------------------------------------------------------------------- MovieLens


def _data_lines(text: str, skip: int) -> list[tuple[int, str]]:
    """(1-based line number, content) of non-blank lines after ``skip`` header lines."""
    out = []
    for number, line in enumerate(text.split("\n"), start=1):
        if number <= skip or not line.strip():
            continue
        out.append((number, line.removesuffix("\r")))
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


def _generic_rows(file: Path, text: str, delimiter: str) -> tuple[list[list[str]], list[int]]:
    """Non-blank rows split on ``delimiter`` (quotes respected) with their 1-based line numbers."""
    text = text.lstrip("\ufeff")
    if len(delimiter) == 1 and delimiter != " ":
        reader = csv.reader(io.StringIO(text), delimiter=delimiter)
        rows, lines = [], []
        try:
            for row in reader:
                if row and any(c.strip() for c in row):
                    rows.append(row)
                    lines.append(reader.line_num)
        except csv.Error as exc:
            raise DataFormatError(file, reader.line_num, f"cannot split the line: {exc}.") from None
        return rows, lines
    numbered = [(i, ln.removesuffix("\r")) for i, ln in enumerate(text.split("\n"), 1) if ln.strip()]
    return [split_line(ln, delimiter) for _, ln in numbered], [i for i, _ in numbered]


def _parse_generic(
    file: Path,
    text: str,
    layout: DataFormat,
    rating_range: tuple[float, float] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rows, lines = _generic_rows(file, text, layout.delimiter)
    if layout.header is not None:
        rows, lines = rows[1:], lines[1:]
    if not rows:
        raise DataFormatError(
            file, None, "no interactions (the file is empty or has only a header); check the path."
        )
    width = len(layout.header) if layout.header is not None else len(rows[0])
    delim = repr(layout.delimiter) if layout.delimiter != " " else "spaces"
    for row, line in zip(rows, lines):
        if len(row) != width:
            what = "the header has" if layout.header is not None else "the first line has"
            raise DataFormatError(file, line, f"found {len(row)} fields, {what} {width} (delimiter {delim}).")
    cols = layout.columns
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
        timestamps = _timestamps(file, column("timestamp"), line_arr)
    else:
        timestamps = np.arange(len(rows), dtype=np.int64)
    return (
        _ids_array(ids["user"]),
        _ids_array(ids["item"]),
        ratings,
        timestamps,
    )


def _timestamps(file: Path, values: list[str], lines: np.ndarray) -> np.ndarray:
    """Seconds as int64: numbers of seconds, or ISO-8601 dates/times (``2024-05-01``, ``...T12:00:00``)."""
    try:
        seconds = np.array(values, dtype=np.float64)
    except ValueError:
        try:
            return np.array(values, dtype="datetime64[s]").astype(np.int64)
        except ValueError:
            for value, line in zip(values, lines):
                try:
                    float(value)
                except ValueError:
                    try:
                        np.datetime64(value, "s")
                    except ValueError:
                        raise DataFormatError(
                            file, int(line), f"cannot parse timestamp {value!r} as seconds or an ISO-8601 date."
                        ) from None
            raise
    if not np.all(np.isfinite(seconds)) or np.any(np.abs(seconds) >= 2.0**62):
        row = int(np.flatnonzero(~np.isfinite(seconds) | (np.abs(seconds) >= 2.0**62))[0])
        raise DataFormatError(file, int(lines[row]), "timestamp must be a finite number of seconds.")
    return seconds.astype(np.int64)


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
