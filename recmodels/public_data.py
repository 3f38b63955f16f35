"""Loaders for the public rating datasets the papers use beside MovieLens, in their published formats.

Each reader is strict: a line (or MATLAB row) that does not fit the published layout is refused with
:class:`~recmodels.loaders.DataFormatError` naming the file and the 1-based line (row), and text is
decoded strictly (:func:`recmodels.loaders.read_text`). Nothing is unpickled: JSON is parsed by
:mod:`json`, MATLAB files by :func:`scipy.io.loadmat` (MATLAB 5 format only; object arrays refused).
Ids become dense indices in raw-id order (string ids in sorted order), as the MovieLens loaders do;
repeated (user, item) pairs are merged keeping the later row.

Formats (``[data] format`` / ``--format``):

``filmtrust``
    Guo et al. 2013 (the LibRec distribution, used by LightFR): ``ratings.txt``, one rating per
    line, ``user item rating`` separated by single spaces, no header, no timestamp (row order is
    the time). Ratings 0.5..4.0 in steps of 0.5. (The same folder's ``trust.txt`` is not read.)

``ciao``
    Tang et al. 2012 (the Ciao crawl of May 2011, used by LightFR): ``rating.mat`` with the
    variable ``rating``, rows ``[user, product, category, rating, helpfulness]``, or
    ``rating_with_timestamp.mat`` with ``rating`` rows ``[user, product, category, rating,
    helpfulness, timestamp]``. Ids are positive integers, ratings 1..5 integers, the timestamp
    integer seconds (absent: row order is the time).

``yelp``
    The Yelp Open Dataset: ``yelp_academic_dataset_review.json``, one JSON object per line with
    at least ``user_id`` and ``business_id`` (non-empty strings), ``stars`` (1..5) and ``date``
    (``YYYY-MM-DD HH:MM:SS``, taken as UTC). Other keys (``text``, ``useful``, ...) are ignored.

``recbole``
    RecBole's atomic ``.inter`` files, the form its converted Douban, Ciao, Yelp and FilmTrust sets
    take (``douban.inter``...): tab-separated, a header of ``name:type`` fields
    (``user_id:token``, ``item_id:token``, ``rating:float``, ``timestamp:float``; the rating and
    timestamp columns are optional, any other column is ignored). Tokens are strings (sorted for
    the dense indices); the timestamp a number of seconds.

``douban``
    Douban-Movie as RecBole publishes it (``douban.inter``); the ``recbole`` reader with ratings
    required and checked against Douban's 1..5 star scale.

Finding the file: a path to the file, or a folder holding the format's file name
(:data:`FILE_NAMES`) directly or one level down.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recmodels.data import Interactions, deduplicate
from recmodels.datafiles import DataFileNotFoundError, DataFormatError, nonblank_lines

__all__ = ["FILE_NAMES", "PUBLIC_FORMATS", "PublicLayout", "infer_public_format", "load_public", "public_format_of",
           "public_file"]

#: The public formats this module reads (see the module docstring).
PUBLIC_FORMATS: tuple[str, ...] = ("filmtrust", "ciao", "yelp", "douban", "recbole")

#: The file names each format is published under (searched in a folder, in this order).
FILE_NAMES: dict[str, tuple[str, ...]] = {
    "filmtrust": ("ratings.txt",),
    "ciao": ("rating_with_timestamp.mat", "rating.mat"),
    "yelp": ("yelp_academic_dataset_review.json",),
    "douban": ("douban.inter",),
    "recbole": (),
}

_INT = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_YELP_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}")


def _error(path: Path, line: int | None, message: str) -> Exception:
    return DataFormatError(path, line, message)


def infer_public_format(path: Path | str) -> str | None:
    """The public format a file name gives away (``None``: none does). ``ratings.txt`` is too common a
    name to imply FilmTrust: that format must be named."""
    name = Path(path).name
    if name in ("rating.mat", "rating_with_timestamp.mat"):
        return "ciao"
    if name == "yelp_academic_dataset_review.json":
        return "yelp"
    if name == "douban.inter":
        return "douban"
    if name.endswith(".inter"):
        return "recbole"
    return None


def public_format_of(path: Path | str, fmt: str | None) -> str | None:
    """The public format to read ``path`` with: ``fmt`` when it is one, else the one a file name (or,
    for a folder, the one distinctive file it holds directly) gives away; ``None`` otherwise."""
    if fmt:
        return fmt if fmt in PUBLIC_FORMATS else None
    p = Path(path).expanduser()
    if p.is_file():
        return infer_public_format(p)
    if p.is_dir():
        found = [f for f in (infer_public_format(c) for c in p.iterdir() if c.is_file()) if f is not None]
        return found[0] if len(set(found)) == 1 and (found[0] != "recbole" or len(found) == 1) else None
    return None


@dataclass(frozen=True)
class PublicLayout:
    """How a public file was read (the :class:`~recmodels.sniff.DataFormat` of the public formats)."""

    path: Path
    fmt: str
    inferred: bool

    def describe(self) -> str:
        """One line for people: the format and its published layout."""
        how = {"filmtrust": "space-separated 'user item rating', no header, no timestamp (row order is the time)",
               "ciao": "MATLAB matrix 'rating' [user, product, category, rating, helpfulness(, timestamp)]",
               "yelp": "JSON lines: user_id, business_id, stars, date",
               "douban": "RecBole atomic .inter (user_id, item_id, rating, timestamp)",
               "recbole": "RecBole atomic .inter (user_id, item_id[, rating][, timestamp])"}[self.fmt]
        return f"{self.fmt}: {how} (format {'inferred from the file name' if self.inferred else 'given'})"

    def as_dict(self) -> dict[str, object]:
        """JSON-ready."""
        return {"path": str(self.path), "format": self.fmt, "inferred": ["format"] if self.inferred else []}

    def load_kwargs(self) -> dict[str, object]:
        """The ``fmt`` that reads the file the same way again."""
        return {"fmt": self.fmt}


def public_file(path: Path | str, fmt: str) -> Path:
    """The file of format ``fmt`` at ``path`` (the file, or a folder holding one of its names).

    Raises:
        DataFileNotFoundError: nothing at ``path``, or a folder without the format's file.
        DataFormatError: a folder holding several candidate files.
    """
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if not p.is_dir():
        raise DataFileNotFoundError(f"{p}: no such file or folder (the {fmt} data); fix the path.")
    names = FILE_NAMES[fmt]
    for pattern in ("{}", "*/{}"):
        found = sorted({c for n in names for c in p.glob(pattern.format(n)) if c.is_file()})
        if fmt == "recbole":
            found = sorted(c for c in p.glob(pattern.format("*.inter")) if c.is_file())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            if fmt == "ciao" and len({c.parent for c in found}) == 1:
                return found[0]  # rating_with_timestamp.mat first: it has the time
            raise _error(p, None, f"holds several {fmt} files ({', '.join(str(c) for c in found)}); pass one of them.")
    wanted = ", ".join(names) if names else "*.inter"
    raise DataFileNotFoundError(f"{p}: no {fmt} file ({wanted}) in this folder or one level down.")


def load_public(path: Path | str, fmt: str) -> Interactions:
    """Read a public dataset in its published format (module docstring).

    Raises:
        DataFileNotFoundError: see :func:`public_file`.
        DataFormatError: any line or row that does not fit the format, no rows, an unknown ``fmt``.
    """
    if fmt not in PUBLIC_FORMATS:
        raise _error(Path(path), None, f"unknown public format {fmt!r}; use one of {', '.join(PUBLIC_FORMATS)}.")
    file = public_file(path, fmt)
    reader = {"filmtrust": _filmtrust, "ciao": _ciao, "yelp": _yelp, "douban": _douban, "recbole": _recbole}[fmt]
    users, items, ratings, stamps = reader(file)
    if len(users) == 0:
        raise _error(file, None, "no ratings (the file is empty); check the path.")
    return _build(file, fmt, users, items, ratings, stamps)


# --------------------------------------------------------------------------- readers


def _int(path: Path, line: int, value: str, what: str) -> int:
    if not _INT.fullmatch(value):
        raise _error(path, line, f"{what} {value[:40]!r} is not a non-negative integer.")
    out = int(value)
    if out >= 2**63:
        raise _error(path, line, f"{what} {value[:40]!r} is too large (at most 2^63 - 1).")
    return out


def _number(path: Path, line: int, value: str, what: str) -> float:
    if not _NUMBER.fullmatch(value):
        raise _error(path, line, f"{what} {value[:40]!r} is not a number.")
    out = float(value)
    if not math.isfinite(out):
        raise _error(path, line, f"{what} {value[:40]!r} is not a finite number.")
    return out


def _on_scale(path: Path, line: int | None, value: float, lo: float, hi: float, step: float, name: str) -> None:
    if not (lo <= value <= hi and abs(round(value / step) * step - value) < 1e-9):
        raise _error(path, line, f"rating {value:g} is outside {name}'s scale {lo:g}..{hi:g} in steps of {step:g}.")


def _filmtrust(path: Path) -> tuple[list, list, list, list]:
    users, items, ratings = [], [], []
    for number, line in nonblank_lines(path):
        parts = line.strip().split()
        if len(parts) != 3 or line.strip() != " ".join(parts):
            raise _error(path, number, f"expected 'user item rating' separated by single spaces (FilmTrust's "
                         f"ratings.txt); found {len(line.split())} fields in {line[:60]!r}.")
        users.append(_int(path, number, parts[0], "user id"))
        items.append(_int(path, number, parts[1], "item id"))
        r = _number(path, number, parts[2], "rating")
        _on_scale(path, number, r, 0.5, 4.0, 0.5, "FilmTrust")
        ratings.append(r)
    return users, items, ratings, list(range(len(users)))


def _ciao(path: Path) -> tuple[list, list, list, list]:
    import scipy.io

    with open(path, "rb") as fh:
        head = fh.read(128)
    if head.startswith(b"\x89HDF"):
        raise _error(path, None, "is a MATLAB 7.3 (HDF5) file; save it as MATLAB 5 (-v7) or use the published rating.mat.")
    if not head.startswith(b"MATLAB 5.0 MAT-file"):
        raise _error(path, None, "is not a MATLAB 5 .mat file (Tang et al.'s Ciao rating.mat is one).")
    try:
        mat = scipy.io.loadmat(str(path), variable_names=["rating"], squeeze_me=False, mat_dtype=False)
    except Exception as exc:  # noqa: BLE001 - scipy raises many types for a damaged file
        raise _error(path, None, f"cannot read the MATLAB file: {exc}") from None
    if "rating" not in mat:
        raise _error(path, None, "holds no variable 'rating' (Tang et al.'s Ciao files name the matrix 'rating').")
    table = mat["rating"]
    if not isinstance(table, np.ndarray) or table.dtype.kind not in "iuf" or table.ndim != 2 or table.shape[1] not in (5, 6):
        raise _error(path, None, f"'rating' must be a numeric matrix with 5 columns [user, product, category, rating, "
                     f"helpfulness] or 6 (+ timestamp); found {getattr(table, 'dtype', type(table))} "
                     f"{getattr(table, 'shape', '')}.")
    t = table.astype(np.float64)
    bad = ~np.isfinite(t).all(axis=1)
    whole = np.all(t == np.round(t), axis=1)
    for name, mask in (("a non-finite value", bad), ("a non-integer value", ~bad & ~whole),
                       ("an id below 1", ~bad & whole & ((t[:, 0] < 1) | (t[:, 1] < 1)))):
        if mask.any():
            row = int(np.flatnonzero(mask)[0])
            raise _error(path, row + 1, f"row {row + 1} of 'rating' holds {name}: {t[row].tolist()}.")
    off = (t[:, 3] < 1) | (t[:, 3] > 5)
    if off.any():
        row = int(np.flatnonzero(off)[0])
        raise _error(path, row + 1, f"row {row + 1} of 'rating' has rating {t[row, 3]:g}; Ciao's scale is 1..5.")
    stamps = t[:, 5].astype(np.int64) if t.shape[1] == 6 else np.arange(len(t), dtype=np.int64)
    return t[:, 0].astype(np.int64), t[:, 1].astype(np.int64), t[:, 3], stamps


def _yelp(path: Path) -> tuple[list, list, list, list]:
    users, items, ratings, stamps = [], [], [], []
    for number, line in nonblank_lines(path):
        try:
            row = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"{c} is not JSON")))
        except (ValueError, RecursionError) as exc:
            raise _error(path, number, f"is not one JSON object ({str(exc)[:80]}); the Yelp review file holds one per line.") from None
        if not isinstance(row, dict):
            raise _error(path, number, f"holds a JSON {type(row).__name__}, not an object (one review per line).")
        for key in ("user_id", "business_id"):
            v = row.get(key)
            if not isinstance(v, str) or not v:
                raise _error(path, number, f"{key!r} must be a non-empty string; found {str(v)[:40]!r}.")
        stars = row.get("stars")
        if type(stars) not in (int, float) or not math.isfinite(stars):
            raise _error(path, number, f"'stars' must be a number; found {str(stars)[:40]!r}.")
        _on_scale(path, number, float(stars), 1.0, 5.0, 0.5, "Yelp")
        date = row.get("date")
        if not isinstance(date, str) or not _YELP_DATE.fullmatch(date):
            raise _error(path, number, f"'date' must read 'YYYY-MM-DD HH:MM:SS'; found {str(date)[:40]!r}.")
        try:
            when = _dt.datetime.strptime(date, "%Y-%m-%d %H:%M:%S").replace(tzinfo=_dt.timezone.utc)
        except ValueError:
            raise _error(path, number, f"'date' {date!r} is not a calendar date and time.") from None
        users.append(row["user_id"])
        items.append(row["business_id"])
        ratings.append(float(stars))
        stamps.append(int(when.timestamp()))
    return users, items, ratings, stamps


def _recbole(path: Path, need_rating: bool = False) -> tuple[list, list, list, list]:
    numbered = nonblank_lines(path)
    if not numbered:
        return [], [], [], []
    head_line, head = numbered[0]
    fields = head.split("\t")
    names = {}
    for j, f in enumerate(fields):
        name, sep, kind = f.strip().partition(":")
        if not sep or kind not in ("token", "float", "token_seq", "float_seq"):
            raise _error(path, head_line, f"header field {f[:40]!r} is not 'name:type' with a RecBole type (token, float, "
                         "token_seq, float_seq); RecBole's .inter files start with such a header.")
        names[name] = (j, kind)
    for role in ("user_id", "item_id"):
        if role not in names or names[role][1] != "token":
            raise _error(path, head_line, f"the header has no '{role}:token' field; found {head[:80]!r}.")
    for role in ("rating", "timestamp"):
        if role in names and names[role][1] != "float":
            raise _error(path, head_line, f"'{role}' must be a float field; found '{role}:{names[role][1]}'.")
    if need_rating and "rating" not in names:
        raise _error(path, head_line, "the header has no 'rating:float' field; Douban's ratings are required.")
    ju, ji = names["user_id"][0], names["item_id"][0]
    jr = names["rating"][0] if "rating" in names else None
    jt = names["timestamp"][0] if "timestamp" in names else None
    users, items, ratings, stamps = [], [], [], []
    for number, line in numbered[1:]:
        parts = line.split("\t")
        if len(parts) != len(fields):
            raise _error(path, number, f"found {len(parts)} tab-separated fields; the header has {len(fields)}.")
        u, i = parts[ju].strip(), parts[ji].strip()
        if not u or not i:
            raise _error(path, number, "an empty user_id or item_id token.")
        users.append(u)
        items.append(i)
        ratings.append(1.0 if jr is None else _number(path, number, parts[jr].strip(), "rating"))
        if need_rating:
            _on_scale(path, number, ratings[-1], 1.0, 5.0, 1.0, "Douban")
        if jt is None:
            stamps.append(len(stamps))
        else:
            t = _number(path, number, parts[jt].strip(), "timestamp")
            if abs(t) >= 2**62:
                raise _error(path, number, f"timestamp {t:g} is out of range.")
            stamps.append(int(t))
    return users, items, ratings, stamps


def _douban(path: Path) -> tuple[list, list, list, list]:
    return _recbole(path, need_rating=True)


def _build(file: Path, fmt: str, users, items, ratings, stamps) -> Interactions:
    raw_u, raw_i = np.asarray(users), np.asarray(items)
    user_ids, u = np.unique(raw_u, return_inverse=True)
    item_ids, i = np.unique(raw_i, return_inverse=True)
    data = Interactions(users=u.reshape(-1), items=i.reshape(-1), ratings=np.asarray(ratings, dtype=np.float64),
                        timestamps=np.asarray(stamps, dtype=np.int64), user_ids=user_ids, item_ids=item_ids,
                        source=f"{file} [{fmt}]", check_duplicates=False)
    data, removed = deduplicate(data)
    if removed:
        data = Interactions(users=data.users, items=data.items, ratings=data.ratings, timestamps=data.timestamps,
                            user_ids=data.user_ids, item_ids=data.item_ids, check_duplicates=False,
                            source=f"{data.source} ({removed} repeated user-item pairs merged, latest kept)")
    return data
