"""Loaders of FilmTrust, Ciao, Yelp and Douban (RecBole) in their published formats, on small files
written here in those formats; malformed files refused with the file and line; parsers fuzzed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.io
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments.cli import main
from recmodels.loaders import DataFileNotFoundError, DataFormatError, load_with_format
from recmodels.public_data import PUBLIC_FORMATS, infer_public_format, load_public

# --------------------------------------------------------------------------- FilmTrust


def test_filmtrust_ratings_txt(tmp_path):
    (tmp_path / "ratings.txt").write_text("1 1 2.0\n1 2 4.0\n2 1 3.5\n\n3 7 0.5\n")
    (tmp_path / "trust.txt").write_text("1 2 1\n")
    data, layout = load_with_format(tmp_path, fmt="filmtrust")
    assert data.user_ids.tolist() == [1, 2, 3] and data.item_ids.tolist() == [1, 2, 7]
    assert data.ratings.tolist() == [2.0, 4.0, 3.5, 0.5] and data.timestamps.tolist() == [0, 1, 2, 3]
    assert layout.fmt == "filmtrust" and "no timestamp" in layout.describe()


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("1 1 2.0\n1\t2\t4.0\n", 2, "single spaces"),
        ("1 1 2.0 5\n", 1, "found 4 fields"),
        ("1  1 2.0\n", 1, "single spaces"),
        ("1 1 4.5\n", 1, "outside FilmTrust's scale 0.5..4"),
        ("1 1 0.7\n", 1, "steps of 0.5"),
        ("1 x 2\n", 1, "item id 'x'"),
        ("-1 1 2\n", 1, "user id '-1'"),
        ("\n\n", None, "no ratings"),
    ],
)
def test_filmtrust_malformed(tmp_path, text, line, words):
    path = tmp_path / "ratings.txt"
    path.write_text(text)
    with pytest.raises(DataFormatError) as err:
        load_public(path, "filmtrust")
    assert words in str(err.value) and err.value.line == line and str(path) in str(err.value)


# --------------------------------------------------------------------------- Ciao


def test_ciao_mat_files_with_and_without_timestamps(tmp_path):
    rows = np.array([[1, 10, 3, 5, 4], [1, 11, 3, 2, 2], [2, 10, 1, 4, 0]], dtype=np.float64)
    scipy.io.savemat(tmp_path / "rating.mat", {"rating": rows}, format="5")
    data = load_public(tmp_path / "rating.mat", "ciao")
    assert data.user_ids.tolist() == [1, 2] and data.item_ids.tolist() == [10, 11]
    assert data.ratings.tolist() == [5.0, 2.0, 4.0] and data.timestamps.tolist() == [0, 1, 2]
    stamped = np.c_[rows, [300, 100, 200]]
    folder = tmp_path / "ciao"
    folder.mkdir()
    scipy.io.savemat(folder / "rating_with_timestamp.mat", {"rating": stamped.astype(np.int32)}, format="5")
    data, layout = load_with_format(folder)  # found and inferred by its published name
    assert layout.fmt == "ciao" and layout.inferred and data.timestamps.tolist() == [300, 100, 200]
    assert infer_public_format("rating.mat") == "ciao"


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ({"rating": np.array([[1, 10, 3, 6, 4]])}, "Ciao's scale is 1..5"),
        ({"rating": np.array([[1, 10, 3, 2.5, 4]])}, "non-integer"),
        ({"rating": np.array([[0, 10, 3, 2, 4]])}, "id below 1"),
        ({"rating": np.array([[1, np.nan, 3, 2, 4]])}, "non-finite"),
        ({"rating": np.array([[1, 10, 3, 2]])}, "5 columns"),
        ({"other": np.array([[1, 10, 3, 2, 4]])}, "no variable 'rating'"),
        ({"rating": np.array(["a"])}, "numeric matrix"),
    ],
)
def test_ciao_malformed(tmp_path, content, words):
    path = tmp_path / "rating.mat"
    scipy.io.savemat(path, content, format="5")
    with pytest.raises(DataFormatError, match=words):
        load_public(path, "ciao")


def test_ciao_refuses_hdf5_and_non_mat_files(tmp_path):
    path = tmp_path / "rating.mat"
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 200)
    with pytest.raises(DataFormatError, match="MATLAB 7.3"):
        load_public(path, "ciao")
    path.write_bytes(b"1 2 3\n")
    with pytest.raises(DataFormatError, match="not a MATLAB 5"):
        load_public(path, "ciao")


# --------------------------------------------------------------------------- Yelp


def review(user="u1", business="b1", stars=4.0, date="2018-07-07 22:09:11", **extra):
    return json.dumps({"review_id": "r", "user_id": user, "business_id": business, "stars": stars, "useful": 0,
                       "text": "Good.\nVery", "date": date, **extra})


def test_yelp_reviews(tmp_path):
    path = tmp_path / "yelp_academic_dataset_review.json"
    path.write_text("\n".join([review(), review("zz", "b1", 2, "2012-01-03 15:28:18"), review("u1", "a9", 5)]) + "\n")
    data, layout = load_with_format(tmp_path)
    assert layout.fmt == "yelp"
    assert data.user_ids.tolist() == ["u1", "zz"] and data.item_ids.tolist() == ["a9", "b1"]
    assert data.ratings.tolist() == [4.0, 2.0, 5.0]
    assert data.timestamps[1] == 1325604498  # 2012-01-03 15:28:18 UTC


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", "is not one JSON object"),
        ('{"user_id": "u", "business_id": "b", "stars": NaN, "date": "2018-07-07 22:09:11"}', "is not one JSON object"),
        ("[1, 2]", "JSON list, not an object"),
        (review(user=""), "'user_id' must be a non-empty string"),
        (review(business=3), "'business_id' must be a non-empty string"),
        (review(stars="4"), "'stars' must be a number"),
        (review(stars=True), "'stars' must be a number"),
        (review(stars=6), "outside Yelp's scale"),
        (review(date="2018-07-07"), "YYYY-MM-DD HH:MM:SS"),
        (review(date="2018-02-30 10:00:00"), "not a calendar date"),
    ],
)
def test_yelp_malformed(tmp_path, line, words):
    path = tmp_path / "yelp_academic_dataset_review.json"
    path.write_text(review() + "\n" + line + "\n")
    with pytest.raises(DataFormatError) as err:
        load_public(path, "yelp")
    assert words in str(err.value) and err.value.line == 2


# --------------------------------------------------------------------------- Douban / RecBole


def test_douban_inter(tmp_path):
    path = tmp_path / "douban.inter"
    path.write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\tlabel:token_seq\n"
                    "u7\tm1\t5\t1200000000\tx y\nu2\tm1\t3\t1100000000.0\t\nu7\tm3\t1\t1300000000\tz\n")
    data, layout = load_with_format(path)
    assert layout.fmt == "douban"
    assert data.user_ids.tolist() == ["u2", "u7"] and data.ratings.tolist() == [5.0, 3.0, 1.0]
    assert data.timestamps.tolist() == [1200000000, 1100000000, 1300000000]


def test_recbole_inter_without_rating_or_time(tmp_path):
    path = tmp_path / "ciao.inter"
    path.write_text("item_id:token\tuser_id:token\na\t1\nb\t1\na\t2\n")
    data, layout = load_with_format(tmp_path)
    assert layout.fmt == "recbole"
    assert data.user_ids.tolist() == ["1", "2"] and data.ratings.tolist() == [1.0, 1.0, 1.0]
    assert data.timestamps.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("fmt", "text", "line", "words"),
    [
        ("recbole", "user_id\titem_id\n1\t2\n", 1, "not 'name:type'"),
        ("recbole", "user_id:token\titem:token\n1\t2\n", 1, "no 'item_id:token'"),
        ("recbole", "user_id:token\titem_id:float\n1\t2\n", 1, "no 'item_id:token'"),
        ("recbole", "user_id:token\titem_id:token\trating:token\n1\t2\t3\n", 1, "'rating' must be a float"),
        ("recbole", "user_id:token\titem_id:token\n1\t2\t3\n", 2, "found 3 tab-separated fields"),
        ("recbole", "user_id:token\titem_id:token\n1\t\n", 2, "empty user_id or item_id"),
        ("recbole", "user_id:token\titem_id:token\trating:float\n1\t2\tfive\n", 2, "rating 'five'"),
        ("recbole", "user_id:token\titem_id:token\ttimestamp:float\n1\t2\tinf\n", 2, "not a number"),
        ("douban", "user_id:token\titem_id:token\n1\t2\n", 1, "no 'rating:float'"),
        ("douban", "user_id:token\titem_id:token\trating:float\n1\t2\t6\n", 2, "outside Douban's scale"),
    ],
)
def test_recbole_malformed(tmp_path, fmt, text, line, words):
    path = tmp_path / "x.inter"
    path.write_text(text)
    with pytest.raises(DataFormatError) as err:
        load_public(path, fmt)
    assert words in str(err.value) and err.value.line == line


# --------------------------------------------------------------------------- finding files, runs


def test_finding_files(tmp_path):
    with pytest.raises(DataFileNotFoundError, match="no yelp file"):
        load_public(tmp_path, "yelp")
    with pytest.raises(DataFileNotFoundError, match="no such file"):
        load_public(tmp_path / "nope", "filmtrust")
    with pytest.raises(DataFormatError, match="unknown public format"):
        load_public(tmp_path, "epinions")
    (tmp_path / "a.inter").write_text("user_id:token\titem_id:token\n1\t2\n")
    (tmp_path / "b.inter").write_text("user_id:token\titem_id:token\n1\t2\n")
    with pytest.raises(DataFormatError, match="several recbole files"):
        load_public(tmp_path, "recbole")
    with pytest.raises(DataFormatError, match="fixed published layout"):
        load_with_format(tmp_path / "a.inter", fmt="recbole", sep="\t")
    assert set(PUBLIC_FORMATS) == {"filmtrust", "ciao", "yelp", "douban", "recbole"}


def test_a_run_on_filmtrust(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lines = [f"{u} {i} {rng.integers(1, 9) / 2}" for u in range(1, 21) for i in rng.choice(40, 6, replace=False) + 1]
    (tmp_path / "ft").mkdir()
    (tmp_path / "ft" / "ratings.txt").write_text("\n".join(lines) + "\n")
    code = main(["run", "itempop", "--data", str(tmp_path / "ft"), "--format", "filmtrust", "--out",
                 str(tmp_path / "run"), "--json", "--quiet", "--eval-negatives", "10"])
    out, err = capsys.readouterr()
    assert code == 0, err
    s = json.loads(out.strip().splitlines()[-1])
    assert s["data"]["layout"]["format"] == "filmtrust" and "20 users" in s["data"]["preprocessed"]
    ident = json.loads((tmp_path / "run" / "run.json").read_text())
    assert str((tmp_path / "ft" / "ratings.txt").resolve()) in ident["data_files"]


# --------------------------------------------------------------------------- fuzz

_ALPHABET = st.sampled_from(list("0123456789 \t.:-_{}[]\",x\nabc\u0661e+"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=_ALPHABET, max_size=120), fmt=st.sampled_from(["filmtrust", "yelp", "douban", "recbole"]))
def test_fuzz_text_readers_parse_or_refuse_clearly(tmp_path, text, fmt):
    path = tmp_path / "f.inter"
    path.write_text(text, encoding="utf-8")
    try:
        data = load_public(path, fmt)
    except DataFormatError as err:
        assert str(err).startswith(str(path))
        assert err.line is None or 1 <= err.line <= text.count("\n") + 1
    else:
        assert len(data) >= 1 and np.isfinite(data.ratings).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.integers(1, 50), st.integers(1, 50), st.integers(0, 9), st.integers(1, 5),
                               st.integers(0, 9)), min_size=1, max_size=15))
def test_fuzz_ciao_round_trip(tmp_path, rows):
    path = tmp_path / "rating.mat"
    scipy.io.savemat(path, {"rating": np.array(rows, dtype=np.float64)}, format="5")
    data = load_public(path, "ciao")
    latest = {}
    for u, i, _, r, _ in rows:
        latest[(u, i)] = r
    got = {(int(data.user_ids[u]), int(data.item_ids[i])): float(r) for u, i, r in zip(data.users, data.items, data.ratings)}
    assert got == {k: float(v) for k, v in latest.items()}
