"""Strict decoding of every text file a user supplies (issue 23, item 10).

The loaders decoded with ``errors="replace"``: ids that differed only in bytes that are not UTF-8
became the same string and merged into one user or item, and a NUL byte was refused only inside
the first 64 KiB that :func:`recmodels.sniff.detect_format` samples (numpy's strings drop
trailing NULs, so ``u7\\x00`` merged with ``u7``). Now a byte sequence that is not valid in the
file's encoding, or a NUL byte anywhere, raises :class:`DataFormatError` naming the file and the
1-based line, without echoing the bytes. ``movies.dat`` and ``u.item`` are Latin-1 (MovieLens
says so); Latin-1 cannot fail, so only NULs are refused there, and distinct bytes stay distinct.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recmodels.loaders import DataFormatError, load_interactions
from recmodels.side import load_item_meta, load_user_demographics
from recmodels.sniff import SNIFF_BYTES

FIXTURE_OK = [HealthCheck.function_scoped_fixture]

#: Byte sequences that are not UTF-8: a lone continuation byte, overlong forms, bytes never used,
#: a surrogate, a code point past U+10FFFF, a lead byte cut short by the next character.
INVALID_UTF8 = [b"\x80", b"\xbf", b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                b"\xf5", b"\xfe", b"\xff", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc3"]

#: (file name, header, row template, fmt) per interaction format.
FORMATS = {
    "ml-100k": ("u.data", "", "{u}\t{i}\t{r}\t{t}", None),
    "ml-1m": ("ratings.dat", "", "{u}::{i}::{r}::{t}", None),
    "ml-csv": ("ratings.csv", "userId,movieId,rating,timestamp\n", "{u},{i},{r}.0,{t}", None),
    "csv": ("log.csv", "user_id,item_id,score,ts\n", "u{u},i{i},{r},{t}", None),
    "tsv": ("log.tsv", "", "u{u}\ti{i}\t{r}", None),
    "semicolon": ("log.txt", "user;item\n", "u{u};i{i}", None),
    "spaces": ("log.txt", "", "u{u}  i{i}  {r}", "csv"),
}


def _rows(fmt: str, n: int) -> tuple[bytes, list[bytes]]:
    _, header, template, _ = FORMATS[fmt]
    rows = [template.format(u=k % 97 + 1, i=k % 89 + 1, r=k % 5 + 1, t=10_000 + k).encode() for k in range(n)]
    return header.encode(), rows


def _assert_names_line_without_echo(exc: DataFormatError, path: Path, line: int, injected: bytes) -> None:
    message = str(exc)
    assert exc.line == line and message.startswith(f"{path}:{line}:"), message
    assert message.isprintable() and "\ufffd" not in message
    assert not any(chr(b) in message for b in injected if b >= 0x80 or b == 0)  # no raw byte, as any decoding


def test_ids_that_differ_only_in_invalid_bytes_no_longer_merge(tmp_path: Path) -> None:
    """The attack: two users 'a\\xffb' and 'a\\xfeb' used to load as one user 'a\\ufffdb'."""
    path = tmp_path / "log.csv"
    path.write_bytes(b"user,item\n" + b"".join(b"u%d,i%d\n" % (k, k % 7) for k in range(40))
                     + b"a\xffb,i1\na\xfeb,i2\n")
    with pytest.raises(DataFormatError, match="not valid UTF-8") as info:
        load_interactions(path)
    _assert_names_line_without_echo(info.value, path, 42, b"\xff")


def test_a_nul_beyond_the_sniffed_sample_is_refused_naming_its_line(tmp_path: Path) -> None:
    """The attack: 'u7\\x00' past the first 64 KiB used to merge with 'u7' (numpy drops trailing NULs)."""
    rows = [b"u%d,i%d" % (k, k % 50) for k in range(SNIFF_BYTES // 8)]
    rows.append(b"u7\x00,i3")
    path = tmp_path / "log.csv"
    path.write_bytes(b"user,item\n" + b"\n".join(rows) + b"\n")
    assert len(b"user,item\n" + b"\n".join(rows[:-1])) > SNIFF_BYTES
    with pytest.raises(DataFormatError, match="NUL byte") as info:
        load_interactions(path)
    _assert_names_line_without_echo(info.value, path, len(rows) + 1, b"\x00")


@st.composite
def damaged_file(draw: st.DrawFn) -> tuple[str, bytes, int, bytes]:
    """A valid interaction file of any format with one invalid UTF-8 sequence or NUL byte put at a
    random byte of a random line, sometimes past the first 64 KiB; the 1-based line it is on."""
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    n = draw(st.sampled_from([30, 200, 8000]))
    header, rows = _rows(fmt, n)
    index = draw(st.integers(0, n - 1) if n < 8000 else st.integers(n - 50, n - 1))
    bad = draw(st.sampled_from(INVALID_UTF8 + [b"\x00"]))
    row = rows[index]
    pos = draw(st.integers(0, len(row)))
    rows[index] = row[:pos] + bad + row[pos:]
    line = index + 1 + (1 if header else 0)
    return fmt, header + b"\n".join(rows) + b"\n", line, bad


@settings(max_examples=120, deadline=None, suppress_health_check=FIXTURE_OK)
@given(case=damaged_file())
def test_any_invalid_byte_or_nul_anywhere_is_refused_naming_its_line(tmp_path: Path, case) -> None:
    fmt, content, line, bad = case
    name, _, _, force = FORMATS[fmt]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataFormatError) as info:
        load_interactions(path, fmt=force)
    _assert_names_line_without_echo(info.value, path, line, bad)


# -- side files ----------------------------------------------------------------------------------------

U_DATA = b"".join(b"%d\t%d\t3\t%d\n" % (u, i, 100 + u) for u in (1, 2, 3) for i in (10, 20))
U_ITEM_ROW = b"|01-Jan-1995||http://x|0|0|0|1|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0\n"


@pytest.mark.parametrize("name, content, line", [
    ("movies.csv", b"movieId,title,genres\n10,Toy Story (1995),Comedy\n20,Caf\xe9 (1995),Drama\n", 3),
    ("u.user", b"1|24|M|technician|85711\n2|53|F|other|9\xff043\n", 2),
    ("users.dat", b"1::M::18::17::85711\n2::F::50::0::94\xc3\n", 2),
])
def test_utf8_side_files_are_decoded_strictly(tmp_path: Path, name: str, content: bytes, line: int) -> None:
    """movies.csv (ml-latest), u.user and users.dat are UTF-8 (ASCII in MovieLens): a byte that is
    not UTF-8 is refused naming the line (it used to become U+FFFD)."""
    (tmp_path / "u.data").write_bytes(U_DATA)
    (tmp_path / name).write_bytes(content)
    data = load_interactions(tmp_path / "u.data")
    load = load_item_meta if name == "movies.csv" else load_user_demographics
    with pytest.raises(DataFormatError, match="not valid UTF-8") as info:
        load(tmp_path, data.item_ids if name == "movies.csv" else data.user_ids)
    _assert_names_line_without_echo(info.value, tmp_path / name, line, content)


@pytest.mark.parametrize("name", ["u.item", "movies.dat", "u.user", "users.dat", "movies.csv", "u.genre"])
def test_a_nul_in_any_side_file_is_refused_naming_its_line(tmp_path: Path, name: str) -> None:
    files = {
        "u.item": b"10|Toy Story (1995)" + U_ITEM_ROW + b"20|Golden\x00Eye (1995)" + U_ITEM_ROW,
        "movies.dat": b"10::Toy Story (1995)::Comedy\n20::Golden\x00Eye (1995)::Action\n",
        "u.user": b"1|24|M|technician|85711\n2|53|F|other|94\x00043\n",
        "users.dat": b"1::M::18::17::85711\n2::F::50::0::94\x00043\n",
        "movies.csv": b"movieId,title,genres\n10,Toy Story (1995),Comedy\n20,Golden\x00Eye (1995),Action\n",
        "u.genre": b"unknown|0\nAction|1\x00\n",
    }
    (tmp_path / "u.data").write_bytes(U_DATA)
    (tmp_path / name).write_bytes(files[name])
    if name == "u.genre":
        (tmp_path / "u.item").write_bytes(b"10|Toy Story (1995)" + U_ITEM_ROW)
    data = load_interactions(tmp_path / "u.data")
    users = name in ("u.user", "users.dat")
    with pytest.raises(DataFormatError, match="NUL byte") as info:
        (load_user_demographics if users else load_item_meta)(tmp_path, data.user_ids if users else data.item_ids)
    _assert_names_line_without_echo(info.value, tmp_path / name, 3 if name == "movies.csv" else 2, b"\x00")


_TITLE_BYTES = st.binary(min_size=1, max_size=3).filter(lambda b: not set(b) & set(b"\x00\n|:"))


@settings(max_examples=60, deadline=None)
@given(a=_TITLE_BYTES, b=_TITLE_BYTES, name=st.sampled_from(["u.item", "movies.dat"]))
def test_latin1_titles_keep_every_byte_distinct(tmp_path_factory, a: bytes, b: bytes, name: str) -> None:
    """u.item and movies.dat are Latin-1 (ISO-8859-1): every byte but NUL is a character, lines end
    at "\n" only (0x85, NEL in Latin-1, is Windows-1252's ellipsis in real titles; splitlines() used
    to cut the line there), and titles that differ in any byte but surrounding blanks stay apart."""
    tmp_path = tmp_path_factory.mktemp("side")
    (tmp_path / "u.data").write_bytes(U_DATA)
    if name == "u.item":
        content = b"10|T" + a + U_ITEM_ROW + b"20|T" + b + U_ITEM_ROW
    else:
        content = b"10::T" + a + b"::Comedy\n20::T" + b + b"::Drama\n"
    (tmp_path / name).write_bytes(content)
    items = load_item_meta(tmp_path, load_interactions(tmp_path / "u.data").item_ids)
    expected = [("T" + a.decode("latin-1")).strip(), ("T" + b.decode("latin-1")).strip()]
    assert items.titles == expected and items.known.all()
