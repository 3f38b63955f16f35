"""Side information beside an interaction file: item titles and genres, user demographics.

MovieLens ships them in the same folder as the ratings; protocols that need them (STTFedRec's
item and user towers, FEL's clustering on public attributes) read them with:

* :func:`load_item_meta` -- titles and genres from ``movies.csv`` (ml-latest, ml-25m ...; UTF-8),
  ``movies.dat`` (ml-1m, ``::``-separated, Latin-1) or ``u.item`` (ml-100k, ``|``-separated,
  Latin-1, 19 genre flags named by ``u.genre`` when present);
* :func:`load_user_demographics` -- age, gender, occupation and zip code from ``u.user``
  (ml-100k: exact ages, occupation names) or ``users.dat`` (ml-1m: age bands, occupation codes,
  mapped to the names of ml-1m's README).

Encodings: ``movies.dat`` and ``u.item`` are Latin-1 (ISO-8859-1), as MovieLens documents; every
other file is UTF-8 and decoded strictly (:func:`recmodels.loaders.read_text`): a byte sequence
that is not UTF-8, or a NUL byte in any file, raises ``DataFormatError`` naming the line. Lines end
at ``\n`` only.

Both align the rows to a dataset's raw ids (``Interactions.item_ids`` / ``user_ids``, matched by
their text so integer and string ids both work): an id the side file lacks gets an empty title
or unknown demographics and ``known[i] = False``. Both return ``None`` when no such file lies
beside the data (ml-latest-small has no demographics); a file that exists but cannot be parsed
raises :class:`~recmodels.loaders.DataFormatError` naming the file and line.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recmodels.loaders import DataFormatError, read_text, resolve_data_path

__all__ = [
    "AGE_BANDS",
    "ITEM_FILES",
    "LATIN1_FILES",
    "ML1M_OCCUPATIONS",
    "ML100K_GENRES",
    "USER_FILES",
    "ItemMeta",
    "UserDemographics",
    "find_side_file",
    "load_item_meta",
    "load_user_demographics",
]

ITEM_FILES = ("movies.csv", "movies.dat", "u.item")
USER_FILES = ("u.user", "users.dat")

#: Files MovieLens documents as Latin-1 (ISO-8859-1); the others are read as UTF-8.
LATIN1_FILES = ("movies.dat", "u.item")

#: ml-100k's genre flags, in file order (used when ``u.genre`` is absent).
ML100K_GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)

#: ml-1m's occupation codes 0..20 (its README), so both datasets name occupations the same way.
ML1M_OCCUPATIONS = (
    "other", "academic/educator", "artist", "clerical/admin", "college/grad student", "customer service",
    "doctor/health care", "executive/managerial", "farmer", "homemaker", "K-12 student", "lawyer", "programmer",
    "retired", "sales/marketing", "scientist", "self-employed", "technician/engineer", "tradesman/craftsman",
    "unemployed", "writer",
)

#: ml-1m's age bands (lower bounds: under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+); ml-100k's
#: exact ages are mapped onto the same bands by :meth:`UserDemographics.age_band`.
AGE_BANDS = (1, 18, 25, 35, 45, 50, 56)


@dataclass(frozen=True)
class ItemMeta:
    """Titles and genres aligned to a dataset's items.

    Attributes:
        titles: one per item (``""`` when unknown).
        genres: one tuple of genre names per item (``()`` when unknown or none listed).
        known: bool ``[n_items]``, whether the side file has the item.
        source: the file read.
    """

    titles: list[str]
    genres: list[tuple[str, ...]]
    known: np.ndarray
    source: str

    @property
    def genre_names(self) -> list[str]:
        """Every genre that occurs, sorted."""
        return sorted({g for gs in self.genres for g in gs})


@dataclass(frozen=True)
class UserDemographics:
    """Demographics aligned to a dataset's users.

    Attributes:
        age: int ``[n_users]``: the age (ml-100k) or the band's lower bound (ml-1m); -1 unknown.
        gender: ``"M"``, ``"F"`` or ``""`` (unknown) per user.
        occupation: the occupation name per user (``""`` unknown).
        zip: the zip code as written (``""`` unknown).
        known: bool ``[n_users]``, whether the side file has the user.
        source: the file read.
    """

    age: np.ndarray
    gender: list[str]
    occupation: list[str]
    zip: list[str]
    known: np.ndarray
    source: str

    def age_band(self) -> np.ndarray:
        """Index into :data:`AGE_BANDS` per user (-1 unknown)."""
        band = np.searchsorted(np.asarray(AGE_BANDS), self.age, side="right") - 1
        return np.where(self.age < 0, -1, np.maximum(band, 0))

    def zip_region(self) -> list[str]:
        """The first character of the zip code (the US postal region), ``""`` unknown."""
        return [z[:1] for z in self.zip]


def find_side_file(source: str | Path, names: Sequence[str]) -> Path | None:
    """The first of ``names`` that lies beside the interaction file ``source`` resolves to."""
    if str(source) == "synthetic":
        return None
    folder = resolve_data_path(source).parent
    for name in names:
        if (folder / name).is_file():
            return folder / name
    return None


def _positions(ids: np.ndarray) -> dict[str, int]:
    return {str(x): i for i, x in enumerate(np.asarray(ids).tolist())}


def _text(path: Path) -> str:
    return read_text(path, "latin-1" if path.name in LATIN1_FILES else "utf-8").lstrip("\ufeff")


def _lines(path: Path) -> list[tuple[int, str]]:
    """(1-based line number, content) of the non-blank lines, ended by ``\n`` only: Latin-1's 0x85
    (NEL; an ellipsis in Windows-1252 titles) and 0x0b, 0x0c, 0x1c-0x1e are characters, not line
    breaks as :meth:`str.splitlines` would have them."""
    return [(n, line.removesuffix("\r")) for n, line in enumerate(_text(path).split("\n"), start=1) if line.strip()]


def load_item_meta(source: str | Path, item_ids: np.ndarray) -> ItemMeta | None:
    """Titles and genres for ``item_ids`` from the item file beside ``source`` (``None``: none there)."""
    path = find_side_file(source, ITEM_FILES)
    if path is None:
        return None
    where = _positions(item_ids)
    n = len(where)
    titles, genres, known = [""] * n, [()] * n, np.zeros(n, dtype=bool)

    def put(line: int, raw_id: str, title: str, gs: tuple[str, ...]) -> None:
        raw_id = raw_id.strip()
        if not raw_id:
            raise DataFormatError(path, line, "empty item id")
        i = where.get(raw_id)
        if i is not None:
            titles[i], genres[i], known[i] = title.strip(), gs, True

    if path.name == "movies.csv":
        reader = csv.reader(io.StringIO(_text(path)))
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:3]] != ["movieId", "title", "genres"]:
            raise DataFormatError(path, 1, f"expected the header 'movieId,title,genres'; found {header!r}")
        for row in reader:
            if not row:
                continue
            if len(row) != 3:
                raise DataFormatError(path, reader.line_num, f"expected 3 fields (movieId,title,genres); found {len(row)}")
            gs = () if row[2].strip() in ("", "(no genres listed)") else tuple(row[2].strip().split("|"))
            put(reader.line_num, row[0], row[1], gs)
    elif path.name == "movies.dat":
        for line, content in _lines(path):
            parts = content.split("::")
            if len(parts) != 3:
                raise DataFormatError(path, line, f"expected MovieID::Title::Genres; found {len(parts)} fields")
            put(line, parts[0], parts[1], tuple(g for g in parts[2].strip().split("|") if g))
    else:  # u.item
        names = list(ML100K_GENRES)
        genre_file = path.parent / "u.genre"
        if genre_file.is_file():
            pairs = [c.split("|") for _, c in _lines(genre_file)]
            if all(len(p) == 2 and p[1].strip().isdigit() for p in pairs):
                names = [name for name, _ in sorted(pairs, key=lambda p: int(p[1]))]
        for line, content in _lines(path):
            parts = content.split("|")
            flags = parts[5:]
            if len(parts) < 6 or len(flags) != len(names) or any(f.strip() not in ("0", "1") for f in flags):
                raise DataFormatError(
                    path, line, f"expected id|title|release|video release|url and {len(names)} genre flags"
                )
            put(line, parts[0], parts[1], tuple(g for g, f in zip(names, flags) if f.strip() == "1"))
    return ItemMeta(titles=titles, genres=genres, known=known, source=str(path))


def load_user_demographics(source: str | Path, user_ids: np.ndarray) -> UserDemographics | None:
    """Demographics for ``user_ids`` from ``u.user``/``users.dat`` beside ``source`` (``None``: none there)."""
    path = find_side_file(source, USER_FILES)
    if path is None:
        return None
    where = _positions(user_ids)
    n = len(where)
    age = np.full(n, -1, dtype=np.int64)
    gender, occupation, zips = [""] * n, [""] * n, [""] * n
    known = np.zeros(n, dtype=bool)
    sep, order = ("|", "age gender occupation zip") if path.name == "u.user" else ("::", "gender age occupation zip")
    for line, content in _lines(path):
        parts = [p.strip() for p in content.split(sep)]
        if len(parts) != 5:
            raise DataFormatError(path, line, f"expected 5 {sep!r}-separated fields (id {order}); found {len(parts)}")
        values = dict(zip(order.split(), parts[1:]))
        if not values["age"].isdigit():
            raise DataFormatError(path, line, f"age must be a non-negative integer; found {values['age']!r}")
        if values["gender"] not in ("M", "F"):
            raise DataFormatError(path, line, f"gender must be M or F; found {values['gender']!r}")
        occ = values["occupation"]
        if path.name == "users.dat":
            if not occ.isdigit() or int(occ) >= len(ML1M_OCCUPATIONS):
                raise DataFormatError(path, line, f"occupation must be a code 0..20; found {occ!r}")
            occ = ML1M_OCCUPATIONS[int(occ)]
        i = where.get(parts[0])
        if i is not None:
            age[i], gender[i], occupation[i], zips[i], known[i] = int(values["age"]), values["gender"], occ, values["zip"], True
    return UserDemographics(age=age, gender=gender, occupation=occupation, zip=zips, known=known, source=str(path))
