"""The data-file basics every reader shares: the format names, the errors, strict text decoding and
finding the interaction file in a folder.

:mod:`recmodels.loaders` (parsing) and :mod:`recmodels.sniff` (layout detection) both build on
these; keeping them here, below both, is what lets the two import each other's names without an
import cycle. :mod:`recmodels.loaders` re-exports every name.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FORMATS", "DataFileNotFoundError", "DataFormatError", "decode_text", "infer_format", "nonblank_lines",
           "read_text", "resolve_data_path"]

#: Supported values of ``fmt``.
FORMATS: tuple[str, ...] = ("ml-100k", "ml-1m", "ml-csv", "csv")

_FILE_NAMES: dict[str, str] = {"u.data": "ml-100k", "ratings.dat": "ml-1m", "ratings.csv": "ml-csv"}


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


def _position(data: bytes, index: int) -> tuple[int, int]:
    """1-based line and byte column of ``data[index]``."""
    return data.count(b"\n", 0, index) + 1, index - (data.rfind(b"\n", 0, index) + 1) + 1


def decode_text(path: Path, data: bytes, encoding: str = "utf-8", *, partial: bool = False) -> str:
    """``data`` (the content of ``path``) decoded strictly; see :func:`read_text`.

    With ``partial`` (``data`` is the first bytes of the file) a multi-byte character cut at the
    end is dropped rather than refused.
    """
    nul = data.find(b"\x00")
    if nul >= 0:
        line, column = _position(data, nul)
        raise DataFormatError(path, line, f"NUL byte at column {column} (a byte count); a text file holds none. Is the "
                              "file binary, or UTF-16 (save it as UTF-8)?")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        if partial and exc.end == len(data) and exc.reason == "unexpected end of data":
            return data[: exc.start].decode(encoding)
        line, column = _position(data, exc.start)
        raise DataFormatError(
            path, line, f"byte 0x{data[exc.start]:02x} at column {column} (a byte count) is not valid "
            f"{'UTF-8' if encoding == 'utf-8' else encoding} ({exc.reason}); save the file as UTF-8."
        ) from None


def read_text(path: Path | str, encoding: str = "utf-8") -> str:
    """The text of a user-supplied file, decoded strictly.

    Raises:
        DataFileNotFoundError: the file cannot be read.
        DataFormatError: a NUL byte anywhere (checked in every encoding, Latin-1 included, which
            cannot fail otherwise) or a byte sequence that is not valid in ``encoding``; the message
            names the file, the 1-based line and the byte's column, and never echoes the bytes.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataFileNotFoundError(f"{path}: cannot read ({exc.strerror or exc}).") from exc
    return decode_text(path, data, encoding)


def nonblank_lines(path: Path | str) -> list[tuple[int, str]]:
    """(1-based line number, text without the line end) of the non-blank lines of ``path``, decoded
    strictly (:func:`read_text`), a leading byte-order mark dropped."""
    out = []
    for number, line in enumerate(read_text(path).split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            out.append((number, line))
    if out and out[0][1].startswith("\ufeff"):
        out[0] = (out[0][0], out[0][1][1:])
    return out


def infer_format(path: Path | str) -> str:
    """MovieLens format name for a file path from its name alone (``u.data``, ``ratings.dat``,
    ``ratings.csv``). :func:`load_interactions` does not need it: it sniffs the content
    (:func:`~recmodels.sniff.detect_format`).

    Raises:
        DataFormatError: when the name is not one of them.
    """
    name = Path(path).name
    if name in _FILE_NAMES:
        return _FILE_NAMES[name]
    raise DataFormatError(
        path,
        None,
        f"cannot infer the format from the file name {name!r} (known: "
        f"{', '.join(sorted(_FILE_NAMES))}); detect_format(path) reads the layout from the content.",
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
        "pass the file itself (any CSV/TSV of user, item[, rating, timestamp] rows)."
    )
