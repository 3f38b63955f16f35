"""Tests of recmodels.loaders on tiny fixture files and on the real ml-latest-small."""

from __future__ import annotations

import time

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

from recmodels.loaders import (
    DataFileNotFoundError,
    DataFormatError,
    infer_format,
    load_interactions,
    resolve_data_path,
)

U_DATA = "196\t242\t3\t881250949\n186\t302\t3\t891717742\n\n22\t377\t1\t878887116\n196\t302\t5\t881250950\n"
ML1M = "1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n"
ML_CSV = "userId,movieId,rating,timestamp\n1,1,4.0,964982703\n1,3,4.5,964981247\n2,1,0.5,964982224\n"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_ml100k(tmp_path):
    d = load_interactions(write(tmp_path, "u.data", U_DATA))
    assert (d.n_users, d.n_items, len(d)) == (3, 3, 4)
    assert list(d.user_ids) == [22, 186, 196] and list(d.item_ids) == [242, 302, 377]
    row = int(np.flatnonzero((d.user_ids[d.users] == 196) & (d.item_ids[d.items] == 302))[0])
    assert d.ratings[row] == 5 and d.timestamps[row] == 881250950
    assert "[ml-100k]" in d.source


def test_ml1m_and_mlcsv(tmp_path):
    d = load_interactions(write(tmp_path, "ratings.dat", ML1M))
    assert (d.n_users, d.n_items, len(d)) == (2, 2, 3)
    assert sorted(d.ratings.tolist()) == [3, 4, 5]
    sub = tmp_path / "s"
    sub.mkdir()
    c = load_interactions(write(sub, "ratings.csv", ML_CSV))
    assert (c.n_users, c.n_items, len(c)) == (2, 2, 3)
    assert sorted(c.ratings.tolist()) == [0.5, 4.0, 4.5]


def test_directory_and_subdirectory_resolution(tmp_path):
    folder = tmp_path / "ml-100k"
    folder.mkdir()
    write(folder, "u.data", U_DATA)
    assert resolve_data_path(folder) == folder / "u.data"
    assert resolve_data_path(tmp_path) == folder / "u.data"  # one level down
    write(tmp_path, "ratings.csv", ML_CSV)
    assert resolve_data_path(tmp_path) == tmp_path / "ratings.csv"  # direct hit wins
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataFileNotFoundError, match="holds no u.data"):
        load_interactions(empty)
    two = tmp_path / "two"
    two.mkdir()
    write(two, "u.data", U_DATA)
    write(two, "ratings.dat", ML1M)
    with pytest.raises(DataFormatError, match="several"):
        load_interactions(two)


def test_generic_csv_with_mapping_string_ids_and_defaults(tmp_path):
    text = "who;what;stars;when\nalice;x;5;10\nbob;y;3;20\nalice;y;4;30\nalice;x;2;40\n"
    path = write(tmp_path, "log.txt", text)
    d = load_interactions(
        path, fmt="csv", sep=";", columns={"user": "who", "item": "what", "rating": "stars", "timestamp": "when"}
    )
    assert list(d.user_ids) == ["alice", "bob"] and list(d.item_ids) == ["x", "y"]
    assert len(d) == 3 and "1 repeated" in d.source  # (alice, x) merged, latest (t=40) kept
    row = int(np.flatnonzero((d.users == 0) & (d.items == 0))[0])
    assert d.ratings[row] == 2 and d.timestamps[row] == 40
    # Implicit log with recognised header names, no rating, no timestamp.
    imp = load_interactions(write(tmp_path, "clicks.csv", "user_id,item_id\n5,7\n5,8\n6,7\n"), fmt="csv")
    assert np.all(imp.ratings == 1.0) and list(imp.timestamps) == [0, 1, 2]
    assert imp.user_ids.dtype == np.int64
    # Integer column indices.
    idx = load_interactions(write(tmp_path, "c2.csv", "a,b\n1,2\n3,4\n"), fmt="csv", columns={"user": 1, "item": 0})
    assert list(idx.user_ids) == [2, 4]


def test_format_inference_errors(tmp_path):
    path = write(tmp_path, "mydata.tsv", U_DATA)  # any name loads now: the layout is sniffed
    assert len(load_interactions(path)) == 4
    with pytest.raises(DataFormatError, match="cannot infer the format from the file name"):
        infer_format(path)
    assert infer_format("x/u.data") == "ml-100k"
    with pytest.raises(DataFormatError, match="unknown format 'parquet'"):
        load_interactions(path, fmt="parquet")
    with pytest.raises(DataFormatError, match="fmt='csv' only"):
        load_interactions(write(tmp_path, "u.data", U_DATA), fmt="ml-100k", columns={"user": "a"})
    with pytest.raises(DataFormatError, match="not in a file without a header"):
        load_interactions(tmp_path / "u.data", columns={"user": "a", "item": 1})


def test_missing_file(tmp_path):
    with pytest.raises(DataFileNotFoundError, match="no such file") as info:
        load_interactions(tmp_path / "nope" / "u.data")
    assert "secagg data download" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


BAD_CASES = [
    # (file name, fmt, content, expected line, message fragment)
    ("u.data", None, "", None, "no interactions"),
    ("u.data", None, "\n\n", None, "no interactions"),
    ("u.data", None, "1\t2\t3\t4\n1\tabc\t3\t5\n", 2, "item id 'abc'"),
    ("u.data", None, "1\t2\t3\t4\n\nx1\t2\t3\t5\n", 3, "user id 'x1'"),
    ("u.data", None, "1\t2\t3\t4\n1\t3\t3\n", 2, "found 3 fields"),
    ("u.data", None, "1\t2\t3\t4\n1\t3\tnan\t5\n", 2, "NaN"),
    ("u.data", None, "1\t2\t3\t4\n1\t3\t7\t5\n", 2, "outside the scale 1..5"),
    ("u.data", None, "1\t2\t3\t4\n1\t3\t2.5\t5\n", 2, "steps of 1"),
    ("u.data", None, "1\t2\t3\t4\n1\t3\t2\t1.5e9\n", 2, "timestamp '1.5e9'"),
    ("ratings.dat", None, "1::2::3::4\n1::2:3::4\n", 2, "found 3 fields"),
    ("ratings.csv", None, "userId,movieId,rating,timestamp\n", None, "no interactions"),
    ("ratings.csv", "ml-csv", "user,movie,rating,timestamp\n1,2,3,4\n", 1, "expected the header"),
    ("ratings.csv", None, "userId,movieId,rating,timestamp\n1,2,3.0,4\n1,3,5.5,6\n", 3, "outside the scale 0.5..5"),
    ("ratings.csv", None, "userId,movieId,rating,timestamp\n1,2,3.0,4\n1,3,-inf,6\n", 3, "outside the scale"),
    ("ratings.csv", None, "userId,movieId,rating,timestamp\n1,2,3.0,4\n1,3,0.0,6\n", 3, "outside the scale"),
    ("g.csv", "csv", "", None, "no interactions"),
    ("g.csv", "csv", "user,item,rating\n", None, "no interactions"),
    ("g.csv", "csv", "user,item,rating\na,b,3\nc,,4\n", 3, "empty item id"),
    ("g.csv", "csv", "user,item,rating\na,b,3\nc,d,NaN\n", 3, "NaN"),
    ("g.csv", "csv", "user,item,rating\na,b,3\nc,d,good\n", 3, "rating 'good'"),
    ("g.csv", "csv", "user,item,rating\na,b,3\nc,d\n", 3, "found 2 fields"),
    ("g.csv", "csv", "foo,bar\n1,2\n", 1, "no user column"),
]


@pytest.mark.parametrize("name, fmt, content, line, fragment", BAD_CASES)
def test_bad_input_names_file_and_line(tmp_path, name, fmt, content, line, fragment):
    path = write(tmp_path, name, content)
    with pytest.raises(DataFormatError) as info:
        load_interactions(path, fmt=fmt)
    err = info.value
    assert isinstance(err, ValueError)
    assert fragment in str(err), str(err)
    assert str(path) in str(err)
    assert err.line == line, str(err)
    if line is not None:
        assert f"{path}:{line}:" in str(err)


def test_generic_rating_range(tmp_path):
    path = write(tmp_path, "g.csv", "user,item,rating\na,b,3\nc,d,11\n")
    assert len(load_interactions(path, fmt="csv")) == 2
    with pytest.raises(DataFormatError, match="rating_range") as info:
        load_interactions(path, fmt="csv", rating_range=(1, 10))
    assert info.value.line == 3


@pytest.mark.realdata
def test_real_ml_latest_small(ml_latest_small):
    start = time.perf_counter()
    d = load_interactions(ml_latest_small)
    elapsed = time.perf_counter() - start
    assert (d.n_users, d.n_items, len(d)) == (610, 9724, 100836)
    assert d.ratings.min() == 0.5 and d.ratings.max() == 5.0
    assert np.bincount(d.users).min() >= 20
    # Spot-check the first line of the file: 1,1,4.0,964982703.
    row = int(np.flatnonzero((d.user_ids[d.users] == 1) & (d.item_ids[d.items] == 1))[0])
    assert d.ratings[row] == 4.0 and d.timestamps[row] == 964982703
    # Same folder via directory resolution; timing is informational only (no wall-time assert).
    assert len(load_interactions(ml_latest_small.parent)) == 100836
    print(f"loaded ml-latest-small in {elapsed:.3f}s")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(
        st.tuples(st.integers(1, 10**6), st.integers(1, 10**6), st.integers(2, 10), st.integers(0, 2**31)),
        min_size=1, max_size=40, unique_by=lambda r: (r[0], r[1]),
    ),
    fmt=st.sampled_from(["ml-100k", "ml-1m", "ml-csv", "csv"]),
)
def test_round_trip_property(tmp_path_factory, rows, fmt):
    """Writing interactions in any format and loading them back gives the same set of events."""
    folder = tmp_path_factory.mktemp("rt")
    name, header, line = {
        "ml-100k": ("u.data", "", "{}\t{}\t{}\t{}"),
        "ml-1m": ("ratings.dat", "", "{}::{}::{}::{}"),
        "ml-csv": ("ratings.csv", "userId,movieId,rating,timestamp\n", "{},{},{},{}"),
        "csv": ("x.csv", "user,item,rating,timestamp\n", "{},{},{},{}"),
    }[fmt]
    ratings = [r[2] / 2 if fmt in ("ml-csv", "csv") else r[2] // 2 for r in rows]
    text = header + "".join(line.format(u, i, rt, t) + "\n" for (u, i, _, t), rt in zip(rows, ratings))
    path = folder / name
    path.write_text(text)
    d = load_interactions(path, fmt="csv" if fmt == "csv" else None)
    got = set(zip(d.user_ids[d.users].tolist(), d.item_ids[d.items].tolist(), d.ratings.tolist(), d.timestamps.tolist()))
    want = {(u, i, float(rt), t) for (u, i, _, t), rt in zip(rows, ratings)}
    assert got == want
    assert np.all(np.diff(d.user_ids.astype(np.int64)) > 0)  # dense indices follow raw-id order
