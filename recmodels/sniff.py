"""Detect the layout of an interaction file from its content: format, delimiter, header, columns.

:func:`detect_format` looks at the first 64 KiB of a file and returns a :class:`DataFormat`: the
format (``ml-100k``, ``ml-1m``, ``ml-csv`` or generic ``csv``), the delimiter, whether the first
line is a header, which column holds each role (``user``, ``item``, ``rating``, ``timestamp``)
and which of these were inferred rather than given. :func:`recmodels.loaders.load_interactions`
parses with it, so any CSV/TSV loads without ``--format``; the CLI prints what was inferred.

Rules, in order:

1. **Binary content is refused** (NUL bytes, the magic of a zip/gzip/bzip2/xz/7z/parquet file, or
   more than 10% control or undecodable bytes), with a message that names the file and the reason
   and never echoes the bytes. Text is UTF-8: a byte sequence that is not UTF-8 is refused naming
   its line (here within the sample; :func:`recmodels.loaders.read_text` checks the whole file).
2. **MovieLens by name and content**: ``u.data`` whose first line has 4 tab-separated fields,
   ``ratings.dat`` with 4 ``::``-separated fields, ``ratings.csv`` whose header is exactly
   ``userId,movieId,rating,timestamp`` use the MovieLens formats (fast path, rating scale checked).
   A MovieLens file name with other content is sniffed like any other file.
3. **Delimiter** (unless ``sep`` is given): of ``::``, tab, ``,``, ``;``, ``|``, spaces (in that order
   of preference), the one under which the most sampled lines (at least half) have as many fields
   as the first line, and at least 2 (quotes respected).
4. **Header**: the first line is a header if a field names a role (below), or if a column is
   numeric on every later sampled line but not on the first.
5. **Columns**: an explicit ``columns`` mapping wins for the roles it names (a header name, a
   0-based index, or ``None``/``"none"`` for "no such column"); the other roles come from header
   names, case-, space- and underscore-insensitive: user ``user, user_id, userId, uid, customer,
   customer_id, reviewerID, member, visitor``; item ``item, item_id, itemId, movie, movieId,
   product, product_id, asin, iid, song, book, isbn, track``; rating ``rating, ratings, score,
   stars, value, preference, overall``; timestamp ``timestamp, time, ts, datetime, date,
   unixReviewTime, created_at, when``. Without a header the columns are positional: user, item,
   then rating and timestamp if numeric. A missing rating column means implicit data (1.0); a
   missing timestamp means row order.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from recmodels.datafiles import FORMATS, DataFileNotFoundError, DataFormatError, decode_text, resolve_data_path

__all__ = [
    "parse_sep",
    "ROLES",
    "DataFormat",
    "detect_format",
    "normalize_columns",
    "parse_columns",
]

#: The column roles, in positional order.
ROLES: tuple[str, ...] = ("user", "item", "rating", "timestamp")
SNIFF_BYTES = 1 << 16
_DELIMITERS: tuple[str, ...] = ("::", "\t", ",", ";", "|", " ")
_DELIM_NAMES = {"::": "'::'", "\t": "tab", ",": "comma", ";": "semicolon", "|": "'|'", " ": "spaces"}
_ALIASES: dict[str, tuple[str, ...]] = {
    "user": ("user", "userid", "uid", "u", "customer", "customerid", "reviewerid", "member", "memberid",
             "visitor", "visitorid", "person"),
    "item": ("item", "itemid", "iid", "i", "movie", "movieid", "product", "productid", "asin", "song",
             "songid", "book", "bookid", "isbn", "track", "trackid", "article", "articleid"),
    "rating": ("rating", "ratings", "score", "stars", "value", "preference", "overall", "r"),
    "timestamp": ("timestamp", "time", "ts", "datetime", "date", "unixreviewtime", "createdat", "when"),
}
_ML_BY_NAME = {"u.data": ("ml-100k", "\t"), "ratings.dat": ("ml-1m", "::"), "ratings.csv": ("ml-csv", ",")}
_ML_CSV_HEADER = ("userId", "movieId", "rating", "timestamp")
_MAGIC = {b"PK\x03\x04": "a zip archive (extract it first)", b"\x1f\x8b": "gzip-compressed (decompress it first)",
          b"BZh": "bzip2-compressed (decompress it first)", b"\xfd7zXZ\x00": "xz-compressed (decompress it first)",
          b"7z\xbc\xaf\x27\x1c": "a 7z archive (extract it first)", b"PAR1": "a Parquet file (export it as CSV)",
          b"SQLite format 3\x00": "an SQLite database", b"\x89PNG": "a PNG image", b"%PDF": "a PDF document"}
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _norm(name: str) -> str:
    return re.sub(r"[\s_\-.]", "", name.strip().lstrip("\ufeff")).lower()


@dataclass(frozen=True)
class DataFormat:
    """How an interaction file is laid out (what :func:`detect_format` found or was told).

    Attributes:
        path: the resolved file.
        fmt: ``"ml-100k"``, ``"ml-1m"``, ``"ml-csv"`` or ``"csv"``.
        delimiter: the field separator (``"::"``, ``"\\t"``, ``","``, ``";"``, ``"|"`` or ``" "`` for
            runs of spaces).
        header: the header's field names, or ``None`` when the file has no header line.
        columns: role -> 0-based column index, for the roles present (``user`` and ``item`` always).
        inferred: what was inferred from the file rather than given: a subset of ``format``,
            ``delimiter``, ``header`` and the roles.
    """

    path: Path
    fmt: str
    delimiter: str
    header: tuple[str, ...] | None
    columns: Mapping[str, int]
    inferred: frozenset[str] = field(default_factory=frozenset)

    def column_label(self, role: str) -> str:
        """The header name of ``role``'s column (``column N``, 1-based, without a header)."""
        if role not in self.columns:
            return "none"
        index = self.columns[role]
        return self.header[index] if self.header is not None else f"column {index + 1}"

    def columns_spec(self) -> str:
        """``user=..,item=..,rating=..,timestamp=..`` as ``--columns`` accepts it (indices 0-based)."""
        def value(role: str) -> str:
            if role not in self.columns:
                return "none"
            return self.header[self.columns[role]] if self.header is not None else str(self.columns[role])

        return ",".join(f"{role}={value(role)}" for role in ROLES)

    def describe(self) -> str:
        """One line for people, e.g. ``csv, comma-separated, header; user=userId ... (inferred: ...)``."""
        head = "header line" if self.header is not None else "no header"
        cols = ", ".join(f"{r}={self.column_label(r)}" for r in ROLES)
        notes = []
        if "rating" not in self.columns:
            notes.append("no rating column: implicit data, every rating 1.0")
        if "timestamp" not in self.columns:
            notes.append("no timestamp column: row order is the time")
        inferred = ", ".join(k for k in ("format", "delimiter", "header", *ROLES) if k in self.inferred) or "nothing"
        text = f"{self.fmt}, {_DELIM_NAMES.get(self.delimiter, repr(self.delimiter))}-separated, {head}; {cols}"
        return text + "".join(f"; {n}" for n in notes) + f" (inferred: {inferred})"

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: format, delimiter, header, columns by name, the ``--columns`` string, inferred."""
        return {
            "path": str(self.path),
            "format": self.fmt,
            "delimiter": self.delimiter,
            "header": list(self.header) if self.header is not None else None,
            "columns": {r: self.column_label(r) if r in self.columns else None for r in ROLES},
            "columns_spec": self.columns_spec(),
            "inferred": sorted(self.inferred),
        }

    def load_kwargs(self) -> dict[str, object]:
        """``fmt``/``sep``/``columns`` that make :func:`~recmodels.loaders.load_interactions` parse
        exactly this layout again without sniffing (e.g. to pin it in a run directory)."""
        if self.fmt != "csv":
            return {"fmt": self.fmt}
        names = {r: (self.header[i] if self.header is not None else i) for r, i in self.columns.items()}
        return {"fmt": "csv", "sep": self.delimiter, "columns": {r: names.get(r) for r in ROLES}}


def _error(path: Path, line: int | None, message: str) -> Exception:
    return DataFormatError(path, line, message)


def _binary_reason(head: bytes) -> str | None:
    """Why ``head`` is not text at all, or ``None`` (a text file with a stray NUL or non-UTF-8 byte
    is refused by :func:`recmodels.loaders.decode_text` instead, naming its line)."""
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            return what
    text = head.decode("utf-8", errors="replace")
    if len(head) == SNIFF_BYTES:
        text = text[:-4]  # a multi-byte character may be cut at the end of the sample
    bad = sum(1 for c in text if c == "\ufffd" or (ord(c) < 32 and c not in "\t\r\n\f"))
    if not text or bad <= 0.1 * len(text):
        return None
    nul = head.find(b"\x00")
    if nul >= 0:  # e.g. UTF-16, or a binary format without a known magic
        line = head.count(b"\n", 0, nul) + 1
        return f"it contains NUL bytes (the first on line {line}, at byte {nul} of the file)"
    return f"{bad} of its first {len(text)} characters are control characters or not UTF-8"


def _sample_lines(head: bytes) -> list[tuple[int, str]]:
    """(1-based line number, text) of the non-blank lines of the sample (a cut last line dropped)."""
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    lines = text.splitlines()
    if len(head) == SNIFF_BYTES and lines:
        lines = lines[:-1]
    return [(i, ln) for i, ln in enumerate(lines, 1) if ln.strip()][:500]


def split_line(line: str, delimiter: str) -> list[str]:
    """Fields of one line: quotes respected for one-character delimiters, runs of spaces for ``" "``."""
    if delimiter == " ":
        return line.split()
    if len(delimiter) > 1:
        return line.split(delimiter)
    return next(csv.reader([line], delimiter=delimiter), [])


def _find_delimiter(path: Path, lines: list[tuple[int, str]]) -> str:
    """The delimiter under which most sampled lines have the first line's number (>= 2) of fields.

    Ties go to the earlier of :data:`_DELIMITERS`; at least half the lines must agree, so one bad
    line does not change the delimiter (the parser then names that line).
    """
    best: tuple[float, int, str] | None = None
    for rank, delim in enumerate(_DELIMITERS):
        counts = [len(split_line(text, delim)) for _, text in lines]
        if not counts or counts[0] < 2:
            continue
        agree = sum(c == counts[0] for c in counts) / len(counts)
        if agree >= 0.5 and (best is None or (agree, -rank) > (best[0], best[1])):
            best = (agree, -rank, delim)
    if best is None:
        raise _error(path, None, "cannot find a delimiter: the lines do not split into the same number (2 or more) "
                     "of fields on '::', tab, ',', ';', '|' or spaces; pass --sep (sep=) if the file uses another one.")
    return best[2]


def _is_number(text: str) -> bool:
    return bool(_NUMBER.match(text.strip()))


def _role_of(name: str) -> str | None:
    key = _norm(name)
    for role, aliases in _ALIASES.items():
        if key in aliases:
            return role
    return None


def parse_sep(text: str) -> str:
    """A ``--sep`` value as typed on a command line: ``\\t`` or ``tab`` mean a tab character."""
    return "\t" if text in ("\\t", "tab") else text


def parse_columns(text: str) -> dict[str, str | int | None]:
    """Parse ``--columns user=NAME,item=NAME[,rating=NAME][,timestamp=NAME]``.

    A value of digits is a 0-based column index unless the header has a column of that name;
    ``none`` (or empty) means "no such column". Raises ValueError naming the bad part.
    """
    out: dict[str, str | int | None] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        role, eq, value = part.partition("=")
        role, value = role.strip().lower(), value.strip()
        if not eq or role not in ROLES:
            raise ValueError(f"--columns expects ROLE=NAME pairs with ROLE among {', '.join(ROLES)}; found {part!r}.")
        if role in out:
            raise ValueError(f"--columns names {role!r} twice.")
        out[role] = None if value.lower() in ("", "none", "-") else value
    return normalize_columns(out)


def normalize_columns(columns: Mapping[str, object]) -> dict[str, str | int | None]:
    """Validate a ``columns`` mapping (API or a ``[data] columns`` TOML table): roles among
    :data:`ROLES`; values a header name, a 0-based index, or ``None``/``"none"`` for absent."""
    out: dict[str, str | int | None] = {}
    for role, value in dict(columns).items():
        if role not in ROLES:
            raise ValueError(f"unknown column role {role!r}; use keys among {list(ROLES)}.")
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "-")):
            out[role] = None
        elif isinstance(value, bool) or not isinstance(value, (str, int)) or (isinstance(value, int) and value < 0):
            raise ValueError(f"column for {role!r} must be a header name or a 0-based index; found {value!r}.")
        else:
            out[role] = value.strip() if isinstance(value, str) else value
    for role in ("user", "item"):
        if role in out and out[role] is None:
            raise ValueError(f"the {role} column cannot be 'none': every interaction needs a {role}.")
    return out


def _resolve(path: Path, header: tuple[str, ...] | None, width: int, given: Mapping[str, str | int | None],
             sample: list[list[str]]) -> tuple[dict[str, int], set[str]]:
    cols: dict[str, int] = {}
    inferred: set[str] = set()
    for role, value in given.items():
        if value is None:
            continue
        if header is not None and isinstance(value, str) and value in header:
            cols[role] = header.index(value)
        elif header is not None and isinstance(value, str) and _norm(value) in [_norm(h) for h in header]:
            cols[role] = [_norm(h) for h in header].index(_norm(value))
        elif isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
            index = int(value)
            if not 0 <= index < width:
                raise _error(path, 1, f"column index {index} for {role!r} is out of range 0..{width - 1}.")
            cols[role] = index
        else:
            where = f"the header {list(header)}" if header is not None else "a file without a header (use 0-based indices)"
            raise _error(path, 1, f"column {value!r} for {role!r} is not in {where}; fix the column mapping.")
    free = [i for i in range(width) if i not in cols.values()]
    missing = [r for r in ROLES if r not in given]
    if header is not None:
        for role in missing:
            hit = next((i for i in free if _role_of(header[i]) == role), None)
            if hit is not None:
                cols[role] = hit
                free.remove(hit)
                inferred.add(role)
    elif missing:
        numeric = [all(_is_number(row[i]) for row in sample if i < len(row)) for i in range(width)]
        for role in missing:
            if not free:
                break
            i = free[0]
            if role in ("user", "item") or numeric[i]:
                cols[role] = i
                free.pop(0)
                inferred.add(role)
    for role in ("user", "item"):
        if role not in cols:
            names = list(header) if header is not None else f"{width} unnamed columns"
            raise _error(path, 1, f"no {role} column found in {names}; pass --columns "
                         f"user=NAME,item=NAME[,rating=NAME][,timestamp=NAME] (columns={{'{role}': NAME, ...}}).")
    return cols, inferred


def detect_format(
    path: Path | str,
    *,
    fmt: str | None = None,
    columns: Mapping[str, object] | None = None,
    sep: str | None = None,
) -> DataFormat:
    """The layout of ``path`` (a file, or a folder holding one known file): see the module docstring.

    Args:
        path: the interaction file or folder.
        fmt: force a format (one of ``recmodels.loaders.FORMATS``); ``None`` infers it.
        columns: role -> header name, 0-based index or ``None`` (generic CSV only).
        sep: the delimiter (generic CSV only); ``None`` infers it.

    Raises:
        DataFileNotFoundError: no such file or folder.
        DataFormatError: binary content, no consistent delimiter, no user/item column, or
            ``columns``/``sep`` given with a MovieLens ``fmt``.
    """
    file = resolve_data_path(path)
    given = normalize_columns(columns) if columns is not None else None
    if fmt is not None and fmt not in FORMATS:
        raise _error(file, None, f"unknown format {fmt!r}; use --format (fmt=) one of {', '.join(FORMATS)}.")
    if fmt not in (None, "csv") and (given is not None or sep is not None):
        raise _error(file, None, f"columns/sep apply to fmt='csv' only, not {fmt!r}.")
    if sep is not None and (not isinstance(sep, str) or (len(sep) != 1 and sep != "::") or sep in "\r\n\"'"):
        raise _error(file, None, f"sep must be one character (or '::'), not a quote or newline; found {sep!r}.")
    try:
        with open(file, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as exc:
        raise DataFileNotFoundError(f"{file}: cannot read ({exc.strerror or exc}).") from exc
    reason = _binary_reason(head)
    if reason is not None:
        raise _error(file, None, f"not a text ratings file: {reason}. Pass a CSV/TSV file of user, item "
                     "(rating, timestamp) rows, or u.data / ratings.dat / ratings.csv from MovieLens.")
    decode_text(file, head, partial=len(head) == SNIFF_BYTES)  # bytes that are not UTF-8: refused by line
    lines = _sample_lines(head)
    positional = {r: i for i, r in enumerate(ROLES)}
    if fmt in ("ml-100k", "ml-1m", "ml-csv"):
        delim = {"ml-100k": "\t", "ml-1m": "::", "ml-csv": ","}[fmt]
        return DataFormat(file, fmt, delim, _ML_CSV_HEADER if fmt == "ml-csv" else None, positional)
    if fmt is None and given is None and sep is None and file.name in _ML_BY_NAME:
        ml, delim = _ML_BY_NAME[file.name]
        first = lines[0][1] if lines else ""
        if ml == "ml-csv" and tuple(h.strip() for h in first.split(",")) == _ML_CSV_HEADER:
            return DataFormat(file, ml, delim, _ML_CSV_HEADER, positional, frozenset({"format"}))
        if ml != "ml-csv" and (not lines or len(first.split(delim)) == 4):
            return DataFormat(file, ml, delim, None, positional, frozenset({"format"}))
    inferred = {"format"} if fmt is None else set()
    if not lines:
        raise _error(file, None, "no interactions (the file is empty); check the path.")
    delim = sep if sep is not None else _find_delimiter(file, lines)
    if sep is None:
        inferred.add("delimiter")
    rows = [split_line(text, delim) for _, text in lines]
    width = len(rows[0])
    first = [f.strip().lstrip("\ufeff") for f in rows[0]]
    later = rows[1:]
    named = any(_role_of(f) for f in first) or (given is not None and any(
        isinstance(v, str) and not v.isdigit() and v in first for v in given.values()))
    typed = later and any(
        not _is_number(first[i]) and all(i < len(r) and _is_number(r[i]) for r in later) for i in range(width)
    )
    header = tuple(first) if (named or typed) else None
    inferred.add("header")
    cols, found = _resolve(file, header, width, given or {}, later if header is not None else rows)
    return DataFormat(file, "csv", delim, header, cols, frozenset(inferred | found))
