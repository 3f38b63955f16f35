"""Tests of recmodels.splitfiles: the authors' split files (NCF's .rating/.negative, LightFR's CSVs),
written in those formats into tmp_path, read exactly; malformed files refused with path:line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recmodels.loaders import DataFileNotFoundError, DataFormatError
from recmodels.metrics import evaluate_sampled_by_rule
from recmodels.splitfiles import (
    find_split_files,
    load_split,
    read_lightfr_csv,
    read_ncf_negative,
    read_ncf_rating,
    split_files,
)

# --------------------------------------------------------------------------- writers of the formats


def write_ncf(folder: Path, prefix: str = "toy", *, train=None, test=None, negatives=None, valid=None,
              valid_negatives=None) -> Path:
    """NCF's layout: raw user/item ids, tab-separated, one held-out line per user."""
    folder.mkdir(parents=True, exist_ok=True)
    train = train if train is not None else [(0, 10, 4, 100), (0, 11, 3, 101), (1, 10, 5, 100), (1, 12, 2, 102),
                                             (2, 13, 1, 103), (2, 11, 4, 104)]
    test = test if test is not None else [(0, 12, 5, 200), (1, 13, 4, 201), (2, 10, 3, 202)]
    negatives = negatives if negatives is not None else {(0, 12): [13, 14], (1, 13): [11, 14], (2, 10): [12, 14]}
    (folder / f"{prefix}.train.rating").write_text("".join("\t".join(map(str, r)) + "\n" for r in train))
    (folder / f"{prefix}.test.rating").write_text("".join("\t".join(map(str, r)) + "\n" for r in test))
    if negatives:
        (folder / f"{prefix}.test.negative").write_text(
            "".join(f"({u},{i})\t" + "\t".join(map(str, n)) + "\n" for (u, i), n in negatives.items()))
    if valid is not None:
        (folder / f"{prefix}.valid.rating").write_text("".join("\t".join(map(str, r)) + "\n" for r in valid))
    if valid_negatives is not None:
        (folder / f"{prefix}.valid.negative").write_text(
            "".join(f"({u},{i})\t" + "\t".join(map(str, n)) + "\n" for (u, i), n in valid_negatives.items()))
    return folder


def write_lightfr(folder: Path, prefix: str = "filmtrust", *, train=None, test=None, val=None) -> Path:
    """LightFR's CSVs: header user_id,item_id,ratings; test/val blocks = positive then 0-rated negatives."""
    folder.mkdir(parents=True, exist_ok=True)
    head = "user_id,item_id,ratings\n"
    train = train if train is not None else [(5, 1, 0.867), (5, 2, 0.153), (7, 1, 1.01), (7, 3, 0.581),
                                             (9, 2, 0.724)]
    test = test if test is not None else [(5, 3, 3.5), (5, 4, 0), (5, 1, 0), (7, 2, 2.0), (7, 4, 0), (7, 4, 0),
                                          (9, 4, 4.0), (9, 1, 0), (9, 3, 0)]
    (folder / f"{prefix}_train.csv").write_text(head + "".join(f"{u},{i},{r}\n" for u, i, r in train))
    (folder / f"{prefix}_test.csv").write_text(head + "".join(f"{u},{i},{r}\n" for u, i, r in test))
    if val is not None:
        (folder / f"{prefix}_val.csv").write_text(head + "".join(f"{u},{i},{r}\n" for u, i, r in val))
    return folder


# --------------------------------------------------------------------------- NCF


def test_ncf_folder_is_read_exactly(tmp_path):
    files = find_split_files(write_ncf(tmp_path / "d"))
    assert files is not None and files.fmt == "ncf" and files.candidates is not None and files.valid is None
    ex = load_split(files)
    split, cands = ex.split, ex.candidates
    # users 0,1,2 and items 10..14 in raw-id order
    assert split.train.user_ids.tolist() == [0, 1, 2]
    assert split.train.item_ids.tolist() == [10, 11, 12, 13, 14]
    assert len(split.train) == 6 and split.valid_items is None
    assert split.test_items.tolist() == [2, 3, 0]  # raw 12, 13, 10
    assert cands.users.tolist() == [0, 1, 2]
    assert cands.items.tolist() == [[2, 3, 4], [3, 1, 4], [0, 2, 4]]
    assert cands.source == str(files.candidates)
    assert ex.report["items_without_training_rows"] == 1  # item 14 only among the candidates
    assert ex.report["candidates"]["candidates_per_user"] == [3, 3]
    assert split.protocol["kind"] == "explicit files"
    assert "toy.test.negative" in files.describe()


def test_ncf_evaluation_uses_exactly_the_listed_candidates(tmp_path):
    ex = load_split(find_split_files(write_ncf(tmp_path / "d")))
    seen = []

    def score(users, items):
        seen.append(items.copy())
        return -items.astype(float)  # lower dense index scores higher

    by = evaluate_sampled_by_rule(score, ex.candidates, ks=(1,))
    assert np.concatenate(seen).tolist() == ex.candidates.items.tolist()
    # user 0: target 2 vs 3,4 -> rank 1; user 1: target 3 vs 1,4 -> rank 2; user 2: target 0 -> rank 1
    assert by["pessimistic"]["HR@1"] == pytest.approx(2 / 3)


def test_ncf_negative_lines_may_come_in_any_order_and_unequal_lengths(tmp_path):
    negs = {(2, 10): [12], (0, 12): [13, 14, 11], (1, 13): [11, 14]}
    ex = load_split(find_split_files(write_ncf(tmp_path / "d", negatives=negs)))
    c = ex.candidates
    assert c.n_candidates().tolist() == [4, 3, 2]
    assert c.items[2, :2].tolist() == [0, 2] and c.valid[2].tolist() == [True, True, False, False]
    assert ex.report["candidates"]["negatives_rated_in_train"] == 1  # (0, 11) is in user 0's training rows


def test_ncf_without_negative_file_has_no_candidates(tmp_path):
    ex = load_split(find_split_files(write_ncf(tmp_path / "d", negatives={})))
    assert ex.candidates is None and ex.split.test_items.tolist() == [2, 3, 0]


def test_ncf_validation_files(tmp_path):
    folder = write_ncf(tmp_path / "d", valid=[(0, 13, 1, 150), (2, 12, 2, 151)],
                       valid_negatives={(0, 13): [14], (2, 12): [14, 13]})
    ex = load_split(find_split_files(folder))
    assert ex.split.valid_items.tolist() == [3, -1, 2]
    assert ex.valid_candidates.users.tolist() == [0, 2]
    assert ex.report["valid_users"] == 2


def test_ncf_three_field_files_use_row_order_as_time(tmp_path):
    folder = write_ncf(tmp_path / "d", train=[(0, 10, 4), (1, 11, 3)], test=[(0, 11, 1), (1, 10, 2)],
                       negatives={(0, 11): [12], (1, 10): [12]})
    ex = load_split(find_split_files(folder))
    assert ex.split.train.timestamps.tolist() == [0, 1]


@pytest.mark.parametrize(
    ("name", "text", "line", "words"),
    [
        ("toy.train.rating", "0\t10\t4\t100\n0\t11\n", 2, "2 tab-separated fields"),
        ("toy.train.rating", "0\t10\n", 1, "found 2 tab-separated fields"),
        ("toy.train.rating", "0\tx\t4\t100\n", 1, "item id 'x' is not a non-negative integer"),
        ("toy.train.rating", "-1\t10\t4\t100\n", 1, "user id '-1'"),
        ("toy.train.rating", "0\t10\tnan\t100\n", 1, "not a number"),
        ("toy.train.rating", "0\t10\t1e999\t100\n", 1, "not a finite number"),
        ("toy.train.rating", "0\t10\t4\t1.5\n", 1, "timestamp"),
        ("toy.train.rating", "0\t99999999999999999999\t4\t1\n", 1, "too large"),
        ("toy.train.rating", "\n\n", None, "empty"),
        ("toy.test.negative", "0,12\t13\n", 1, "(user,item)"),
        ("toy.test.negative", "(0,12)\n", 1, "no negative"),
        ("toy.test.negative", "(0,12)\t13\tbad\n", 1, "negative item id 'bad'"),
        ("toy.test.negative", "(0,12)\t13\n(0,12)\t14\n", 2, "second time"),
        ("toy.test.negative", "(0,99)\t13\n", 1, "no line of toy.test.rating"),
        ("toy.test.rating", "0\t12\t5\t200\n0\t13\t4\t201\n", 2, "second test item"),
    ],
)
def test_malformed_ncf_files_are_refused_with_path_and_line(tmp_path, name, text, line, words):
    folder = write_ncf(tmp_path / "d")
    (folder / name).write_text(text)
    with pytest.raises(DataFormatError) as err:
        load_split(find_split_files(folder))
    assert words in str(err.value)
    assert err.value.line == line
    assert err.value.path.name == name


def test_a_held_out_user_without_training_rows_is_refused(tmp_path):
    folder = write_ncf(tmp_path / "d", test=[(0, 12, 5, 200), (7, 13, 4, 201)],
                       negatives={(0, 12): [13], (7, 13): [10]})
    with pytest.raises(DataFormatError, match=r"toy.test.rating:2: user 7 has no row in toy.train.rating"):
        load_split(find_split_files(folder))


def test_ncf_test_pair_without_candidate_line_is_refused(tmp_path):
    folder = write_ncf(tmp_path / "d", negatives={(0, 12): [13], (1, 13): [11]})
    with pytest.raises(DataFormatError, match=r"toy.test.rating:3: \(2,10\) has no candidate line"):
        load_split(find_split_files(folder))


def test_undecodable_and_nul_bytes_are_refused(tmp_path):
    folder = write_ncf(tmp_path / "d")
    (folder / "toy.train.rating").write_bytes(b"0\t10\t4\t100\n0\t\xff\t4\t1\n")
    with pytest.raises(DataFormatError, match=":2"):
        load_split(find_split_files(folder))
    (folder / "toy.train.rating").write_bytes(b"0\t10\t4\x00\t100\n")
    with pytest.raises(DataFormatError, match="NUL"):
        load_split(find_split_files(folder))


def test_unicode_digits_are_not_ids(tmp_path):
    path = tmp_path / "x.train.rating"
    path.write_text("\u0661\t10\t4\t100\n")  # ARABIC-INDIC DIGIT ONE
    with pytest.raises(DataFormatError, match="user id"):
        read_ncf_rating(path)


# --------------------------------------------------------------------------- LightFR


def test_lightfr_folder_is_read_exactly(tmp_path):
    files = find_split_files(write_lightfr(tmp_path / "ft"))
    assert files.fmt == "lightfr-csv" and files.candidates is None
    ex = load_split(files)
    split, c = ex.split, ex.candidates
    assert split.train.user_ids.tolist() == [5, 7, 9] and split.train.item_ids.tolist() == [1, 2, 3, 4]
    assert split.train.ratings.tolist() == pytest.approx([0.867, 0.153, 1.01, 0.581, 0.724])  # as written
    assert split.test_items.tolist() == [2, 1, 3]
    assert c.items.tolist() == [[2, 3, 0], [1, 3, 3], [3, 0, 2]]
    assert c.valid.all()  # duplicates are kept as competitors (the authors draw with replacement)
    assert ex.report["candidates"]["duplicate_negatives"] == 1
    assert ex.report["candidates"]["negatives_rated_in_train"] == 1  # (5,1)
    assert "its candidate blocks" in files.describe()


def test_lightfr_negative_equal_to_positive_is_masked_and_counted(tmp_path):
    test = [(5, 3, 3.5), (5, 3, 0), (5, 4, 0), (7, 2, 2.0), (7, 4, 0), (9, 4, 4.0), (9, 1, 0)]
    ex = load_split(find_split_files(write_lightfr(tmp_path / "ft", test=test)))
    assert ex.candidates.valid[0].tolist() == [True, False, True]
    assert ex.report["candidates"]["negatives_equal_to_positive"] == 1
    # the masked copy would tie with the positive; masked, all three rules agree on a constant scorer
    by = evaluate_sampled_by_rule(lambda u, i: np.zeros(i.shape), ex.candidates, ks=(1,))
    assert by["optimistic"]["HR@1"] == 1.0
    assert by["random"]["HR@1"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 2) / 3)


def test_lightfr_validation_file(tmp_path):
    val = [(5, 4, 1.0), (5, 2, 0), (7, 3, 2.5), (7, 2, 0), (9, 3, 0.5), (9, 1, 0)]
    ex = load_split(find_split_files(write_lightfr(tmp_path / "ft", val=val)))
    assert ex.split.valid_items.tolist() == [3, 2, 2]
    assert ex.valid_candidates.items[:, 0].tolist() == [3, 2, 2]


@pytest.mark.parametrize(
    ("which", "rows", "line", "words"),
    [
        ("test", "user,item,rating\n5,3,1\n", 1, "expected LightFR's header"),
        ("test", "user_id,item_id,ratings\n", None, "no rows after the header"),
        ("test", "user_id,item_id,ratings\n5,3\n", 2, "2 comma-separated fields"),
        ("test", "user_id,item_id,ratings\n5,3,0\n5,4,0\n7,2,2\n9,4,4\n", 2, "block starts with rating 0"),
        ("test", "user_id,item_id,ratings\n5,3,1\n5,4,2\n7,2,2\n9,4,4\n", 3, "second positive"),
        ("test", "user_id,item_id,ratings\n5,3,1\n7,2,2\n5,4,0\n9,4,4\n", 4, "not contiguous"),
        ("test", "user_id,item_id,ratings\n5,3,1\n5,4,-1\n7,2,2\n9,4,4\n", 3, "negative"),
        ("test", "user_id,item_id,ratings\n5,3,inf\n", 2, "rating 'inf' is not a number"),
        ("train", "user_id,item_id,ratings\n5,1.5,1\n", 2, "item id '1.5'"),
        ("train", "", None, "empty"),
    ],
)
def test_malformed_lightfr_files_are_refused_with_path_and_line(tmp_path, which, rows, line, words):
    folder = write_lightfr(tmp_path / "ft")
    (folder / f"filmtrust_{which}.csv").write_text(rows)
    with pytest.raises(DataFormatError) as err:
        load_split(find_split_files(folder))
    assert words in str(err.value) and err.value.line == line
    assert f"filmtrust_{which}.csv" in str(err.value)


def test_lightfr_reader_accepts_bom_crlf_and_spaces(tmp_path):
    path = tmp_path / "a_train.csv"
    path.write_bytes(b"\xef\xbb\xbfuser_id, item_id, ratings\r\n1, 2, 0.5\r\n\r\n3,4,1\r\n")
    rows = read_lightfr_csv(path)
    assert rows.users.tolist() == [1, 3] and rows.items.tolist() == [2, 4] and rows.lines.tolist() == [2, 4]


# --------------------------------------------------------------------------- locating files


def test_find_split_files_by_folder_and_prefix(tmp_path):
    folder = tmp_path / "d"
    write_ncf(folder, "a")
    write_ncf(folder, "b", negatives={})
    with pytest.raises(DataFormatError, match="several split layouts"):
        find_split_files(folder)
    b = find_split_files(folder / "b")
    assert b.train.name == "b.train.rating" and b.candidates is None
    assert find_split_files(tmp_path / "nothing") is None
    assert find_split_files(folder, fmt="lightfr-csv") is None
    with pytest.raises(ValueError, match="fmt"):
        find_split_files(folder, fmt="csv")


def test_split_files_explicit_paths(tmp_path):
    folder = write_ncf(tmp_path / "d")
    f = split_files(folder, train="toy.train.rating", test="toy.test.rating")
    assert f.fmt == "ncf" and f.candidates == folder / "toy.test.negative"  # sibling found
    (folder / "other.negative").write_text("(0,12)\t14\n(1,13)\t14\n(2,10)\t14\n")
    g = split_files(folder, train="toy.train.rating", test="toy.test.rating", candidates="other.negative")
    assert load_split(g).candidates.items[:, 1].tolist() == [4, 4, 4]
    with pytest.raises(DataFileNotFoundError, match="candidates"):
        split_files(folder, train="toy.train.rating", test="toy.test.rating", candidates="missing.negative")
    with pytest.raises(DataFormatError, match="test missing"):
        split_files(folder, train="toy.train.rating", test="")
    with pytest.raises(DataFormatError, match="cannot tell the split format"):
        split_files(folder, train="toy.test.negative", test="toy.test.rating")
    with pytest.raises(DataFormatError, match="validation file"):
        split_files(folder, train="toy.train.rating", test="toy.test.rating", valid_candidates="other.negative")
    ft = write_lightfr(tmp_path / "ft")
    with pytest.raises(DataFormatError, match="own candidate blocks"):
        split_files(ft, train="filmtrust_train.csv", test="filmtrust_test.csv", candidates=str(folder / "other.negative"))
    assert split_files(None, train=str(ft / "filmtrust_train.csv"), test=str(ft / "filmtrust_test.csv")).fmt == "lightfr-csv"


# --------------------------------------------------------------------------- fuzz

_TEXT = st.text(alphabet=st.sampled_from(list("0123456789\t,()-.eE+ \nx\r\u0661")), max_size=80)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT)
def test_fuzz_readers_parse_or_refuse_clearly(tmp_path, text):
    path = tmp_path / "f.train.rating"
    path.write_text(text, encoding="utf-8")
    for reader in (read_ncf_rating, read_ncf_negative, read_lightfr_csv):
        try:
            out = reader(path)
        except DataFormatError as err:
            assert str(err).startswith(str(path))
            assert err.line is None or 1 <= err.line <= text.count("\n") + 1
        else:
            arrays = [out.users, out.items] if hasattr(out, "users") else [out[0], out[1]]
            for a in arrays:
                assert a.dtype == np.int64 and (a >= 0).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.dictionaries(st.integers(0, 40), st.lists(st.integers(0, 30), min_size=2, max_size=6, unique=True),
                         min_size=1, max_size=6),
    k=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_fuzz_ncf_round_trip(tmp_path, data, k, seed):
    # users with >= 2 items: the last is the test item, the rest train; k random negatives from 100..
    rng = np.random.default_rng(seed)
    train = [(u, i, 1 + j % 5, 10 * j) for u, items in data.items() for j, i in enumerate(items[:-1])]
    test = [(u, items[-1], 3, 999) for u, items in data.items()]
    negs = {(u, items[-1]): rng.integers(100, 110, size=k).tolist() for u, items in data.items()}
    folder = write_ncf(tmp_path / f"r{seed}_{k}_{len(data)}", train=train, test=test, negatives=negs)
    ex = load_split(find_split_files(folder))
    uid, iid = ex.split.train.user_ids, ex.split.train.item_ids
    got_train = {(int(uid[u]), int(iid[i])) for u, i in zip(ex.split.train.users, ex.split.train.items)}
    assert got_train == {(u, i) for u, i, _, _ in train}
    for row, u in enumerate(ex.candidates.users):
        raw_u = int(uid[u])
        assert int(iid[ex.candidates.items[row, 0]]) == data[raw_u][-1]
        listed = [int(iid[i]) for i, ok in zip(ex.candidates.items[row, 1:], ex.candidates.valid[row, 1:]) if ok]
        assert listed == negs[(raw_u, data[raw_u][-1])]
