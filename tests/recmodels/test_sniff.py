"""Any CSV/TSV loads without ``--format``: the layout is sniffed from the content (issue 9, item 8).

Oracles: the events written into each fixture (and, in the property test, into files generated
with a random delimiter, header spelling, column order and optional columns), compared with what
:func:`recmodels.loaders.load_with_format` reads back, and the layout it reports.
"""

from __future__ import annotations

import gzip
import io
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recmodels.loaders import DataFormatError, load_interactions, load_with_format
from recmodels.sniff import SNIFF_BYTES, detect_format, normalize_columns, parse_columns


def _events(d) -> set[tuple]:  # noqa: ANN001 - Interactions
    return set(zip(d.user_ids[d.users].tolist(), d.item_ids[d.items].tolist(), d.ratings.tolist(),
                   d.timestamps.tolist()))


CASES = [
    # name, content, delimiter, header, {role: label}, events (user, item, rating, timestamp)
    ("data.csv", "userId,movieId,rating,timestamp\n1,10,4.0,100\n2,10,3.5,200\n",
     ",", True, {"user": "userId", "item": "movieId", "rating": "rating", "timestamp": "timestamp"},
     {(1, 10, 4.0, 100), (2, 10, 3.5, 200)}),
    ("log.tsv", "user_id\titem_id\tscore\tdate\nu1\tbook A\t4\t2024-05-01\nu2\tbook B\t5\t2024-05-02T10:00:00\n",
     "\t", True, {"user": "user_id", "item": "item_id", "rating": "score", "timestamp": "date"},
     {("u1", "book A", 4.0, 1714521600), ("u2", "book B", 5.0, 1714644000)}),
    ("ml1m_copy.txt", "1::1193::5::978300760\n2::661::3::978302109\n", "::", False,
     {"user": "column 1", "item": "column 2", "rating": "column 3", "timestamp": "column 4"},
     {(1, 1193, 5.0, 978300760), (2, 661, 3.0, 978302109)}),
    ("semi.csv", "User;Item;Rating\n7;8;2.5\n9;8;1\n", ";", True,
     {"user": "User", "item": "Item", "rating": "Rating", "timestamp": "none"},
     {(7, 8, 2.5, 0), (9, 8, 1.0, 1)}),
    ("pipe.txt", "customer_id|product_id|stars|unixReviewTime\nA|x|5|10\nB|y|4|20\n", "|", True,
     {"user": "customer_id", "item": "product_id", "rating": "stars", "timestamp": "unixReviewTime"},
     {("A", "x", 5.0, 10), ("B", "y", 4.0, 20)}),
    ("spaces.dat", "uid  iid   rating\n1 2 3\n4   5 1\n", " ", True,
     {"user": "uid", "item": "iid", "rating": "rating", "timestamp": "none"}, {(1, 2, 3.0, 0), (4, 5, 1.0, 1)}),
    ("clicks", "5,7\n5,8\n6,7\n", ",", False,
     {"user": "column 1", "item": "column 2", "rating": "none", "timestamp": "none"},
     {(5, 7, 1.0, 0), (5, 8, 1.0, 1), (6, 7, 1.0, 2)}),
    ("quoted.csv", 'user,item,rating\n"smith, j","The Movie, Part 2",4\n"doe","X",3\n', ",", True,
     {"user": "user", "item": "item", "rating": "rating", "timestamp": "none"},
     {("smith, j", "The Movie, Part 2", 4.0, 0), ("doe", "X", 3.0, 1)}),
    ("bom_crlf.csv", "\ufeffUserID,ItemID,Rating,Time\r\n1,2,5,9\r\n3,2,4,8\r\n", ",", True,
     {"user": "UserID", "item": "ItemID", "rating": "Rating", "timestamp": "Time"},
     {(1, 2, 5.0, 9), (3, 2, 4.0, 8)}),
]


@pytest.mark.parametrize(("name", "content", "delim", "header", "labels", "events"), CASES,
                         ids=[c[0] for c in CASES])
def test_any_layout_loads_without_a_format_and_says_what_it_inferred(
    tmp_path: Path, name: str, content: str, delim: str, header: bool, labels: dict, events: set
) -> None:
    path = tmp_path / name
    path.write_text(content, newline="")
    data, layout = load_with_format(path)
    assert layout.fmt == "csv" and layout.delimiter == delim and (layout.header is not None) == header
    assert {r: layout.column_label(r) for r in labels} == labels
    assert "format" in layout.inferred and "delimiter" in layout.inferred
    assert _events(data) == events
    assert layout.as_dict()["columns"]["user"] == labels["user"]
    # What was inferred, given back explicitly, reads the file the same way (e.g. to pin a run).
    assert _events(load_interactions(path, **layout.load_kwargs())) == events


def test_movielens_names_keep_their_fast_strict_formats(tmp_path: Path) -> None:
    (tmp_path / "u.data").write_text("196\t242\t3\t881250949\n186\t302\t3\t891717742\n")
    assert detect_format(tmp_path / "u.data").fmt == "ml-100k"
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,1,4.0,9\n")
    layout = detect_format(tmp_path / "ratings.csv")
    assert layout.fmt == "ml-csv" and layout.inferred == {"format"}
    # A MovieLens file name with other content is sniffed like any file.
    (tmp_path / "ratings.csv").write_text("user,movie,stars\n1,1,4\n")
    layout = detect_format(tmp_path / "ratings.csv")
    assert layout.fmt == "csv" and layout.column_label("item") == "movie"


def test_explicit_columns_win_and_the_rest_is_inferred(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("a,b,rating,when\n1,2,5,10\n3,4,2,20\n")
    data, layout = load_with_format(path, columns={"user": "b", "item": "a"})
    assert _events(data) == {(2, 1, 5.0, 10), (4, 3, 2.0, 20)}
    assert layout.inferred >= {"rating", "timestamp"} and "user" not in layout.inferred
    implicit = load_interactions(path, columns=parse_columns("user=b,item=a,rating=none"))
    assert set(implicit.ratings.tolist()) == {1.0}
    by_index = load_interactions(path, columns={"user": 1, "item": 0, "rating": 2, "timestamp": None})
    assert sorted(by_index.timestamps.tolist()) == [0, 1]


def test_parse_columns_and_its_errors() -> None:
    assert parse_columns("user=userId, item=movieId,rating=none") == {"user": "userId", "item": "movieId", "rating": None}
    assert parse_columns("user=0,item=3") == {"user": "0", "item": "3"}  # digits: an index unless a header name
    for bad, fragment in [("usr=a,item=b", "ROLE=NAME"), ("user=a,user=b", "twice"), ("user", "ROLE=NAME"),
                          ("user=none,item=b", "cannot be 'none'")]:
        with pytest.raises(ValueError, match=fragment):
            parse_columns(bad)
    with pytest.raises(ValueError, match="0-based index"):
        normalize_columns({"user": -1, "item": 0})
    with pytest.raises(ValueError, match="unknown column role"):
        normalize_columns({"person": "a"})


def _binary_files() -> dict[str, bytes]:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ratings.csv", "userId,movieId\n1,2\n")
    noise = bytes((i * 97 + 13) % 256 for i in range(4000))
    return {
        "nul.csv": b"user,item\n1,2\n\x00\x01SECRETMARKER\x00" + noise,
        "ratings.zip.csv": buf.getvalue(),
        "gz.csv": gzip.compress(b"user,item\n1,2\nSECRETMARKER\n"),
        "noise.csv": b"SECRETMARKER" + noise.replace(b"\x00", b"\x01"),
    }


@pytest.mark.parametrize("name", sorted(_binary_files()))
def test_binary_files_are_refused_without_echoing_their_bytes(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(_binary_files()[name])
    with pytest.raises(DataFormatError, match="not a text ratings file") as info:
        load_interactions(path)
    message = str(info.value)
    assert "SECRETMARKER" not in message and "user,item" not in message
    assert message.isprintable() and str(path) in message


def test_an_error_beyond_the_sniffed_sample_names_its_line(tmp_path: Path) -> None:
    rows = [f"{u},{u % 97},3,{u}" for u in range(SNIFF_BYTES // 8)]
    bad = len(rows) - 5  # far beyond the first 64 KiB that are sniffed
    rows.insert(bad, "1,2")
    path = tmp_path / "big.csv"
    path.write_text("user,item,rating,timestamp\n" + "\n".join(rows) + "\n")
    with pytest.raises(DataFormatError, match="found 2 fields, the header has 4") as info:
        load_interactions(path)
    assert info.value.line == bad + 2  # 1-based, after the header


def test_no_user_column_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("foo,bar\n1,2\n")  # a header (numbers below names), but no role names
    with pytest.raises(DataFormatError, match="--columns user=NAME,item=NAME"):
        load_interactions(path)


ALIASES = {
    "user": ["user", "userId", "user_id", "UserID", "uid", "customer_id", "reviewerID"],
    "item": ["item", "movieId", "item_id", "ItemId", "product_id", "asin", "movie"],
    "rating": ["rating", "Rating", "score", "stars"],
    "timestamp": ["timestamp", "time", "ts", "Timestamp"],
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.tuples(st.integers(1, 500), st.integers(1, 500), st.integers(1, 10), st.integers(0, 2**31)),
                  min_size=2, max_size=30, unique_by=lambda r: (r[0], r[1])),
    delim=st.sampled_from([",", "\t", ";", "|"]),
    names=st.fixed_dictionaries({r: st.sampled_from(a) for r, a in ALIASES.items()}),
    roles=st.sampled_from([("user", "item"), ("user", "item", "rating"), ("item", "user", "rating", "timestamp"),
                           ("rating", "user", "timestamp", "item"), ("user", "item", "rating", "timestamp")]),
    header=st.booleans(),
    string_ids=st.booleans(),
)
def test_round_trip_of_random_layouts(tmp_path: Path, rows, delim, names, roles, header, string_ids) -> None:
    """Whatever the delimiter, header spelling and column order, the events come back exactly.
    Without a header only the positional order user, item[, rating, timestamp] is inferable."""
    if not header:
        roles = tuple(r for r in ("user", "item", "rating", "timestamp") if r in roles)
    if not header and string_ids:
        string_ids = False  # unnamed columns of strings: the positional rule still applies, keep it numeric
    value = {
        "user": lambda r: f"u{r[0]}" if string_ids else str(r[0]),
        "item": lambda r: f"i{r[1]}" if string_ids else str(r[1]),
        "rating": lambda r: str(r[2] / 2),
        "timestamp": lambda r: str(r[3]),
    }
    lines = [delim.join(names[r] for r in roles)] if header else []
    lines += [delim.join(value[r](row) for r in roles) for row in rows]
    path = tmp_path / "f.txt"
    path.write_text("\n".join(lines) + "\n")
    data, layout = load_with_format(path)
    assert layout.delimiter == delim and set(layout.columns) == set(roles)
    want = set()
    for i, row in enumerate(rows):
        user = f"u{row[0]}" if string_ids else row[0]
        item = f"i{row[1]}" if string_ids else row[1]
        want.add((user, item, row[2] / 2 if "rating" in roles else 1.0, row[3] if "timestamp" in roles else i))
    assert _events(data) == want
