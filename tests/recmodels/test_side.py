"""Side files: item titles/genres and user demographics in the MovieLens formats, aligned by raw id."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recmodels.loaders import DataFormatError, load_interactions
from recmodels.side import AGE_BANDS, load_item_meta, load_user_demographics

U_DATA = "1\t10\t5\t100\n1\t20\t3\t101\n2\t10\t4\t102\n3\t30\t1\t103\n"
U_ITEM = (
    "10|Toy Story (1995)|01-Jan-1995||http://x|0|0|0|1|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0\n"
    "20|GoldenEye (1995)|01-Jan-1995||http://y|0|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0|1|0|0\n"
    "30|Caf\xe9 (1995)|01-Jan-1995||http://z|1|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0\n"
)
U_USER = "1|24|M|technician|85711\n2|53|F|other|94043\n3|17|M|writer|32067\n"
RATINGS_DAT = "1::10::5::100\n1::20::3::101\n2::10::4::102\n3::30::1::103\n"
MOVIES_DAT = "10::Toy Story (1995)::Animation|Children's|Comedy\n20::GoldenEye (1995)::Action|Adventure|Thriller\n"
USERS_DAT = "1::M::18::17::85711\n2::F::50::0::94043\n3::M::1::20::32067\n"


def _folder(tmp_path: Path, files: dict[str, str | bytes]) -> Path:
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode("latin-1"))
    return tmp_path


def test_ml100k_items_and_users(tmp_path):
    folder = _folder(tmp_path, {"u.data": U_DATA, "u.item": U_ITEM, "u.user": U_USER})
    data = load_interactions(folder)
    items = load_item_meta(folder, data.item_ids)
    assert items.titles == ["Toy Story (1995)", "GoldenEye (1995)", "Caf\xe9 (1995)"]
    assert items.genres[0] == ("Animation", "Children's", "Comedy") and items.genres[2] == ("unknown",)
    assert items.genres[1] == ("Action", "Adventure", "Thriller") and items.known.all()
    users = load_user_demographics(folder / "u.data", data.user_ids)
    assert users.age.tolist() == [24, 53, 17] and users.gender == ["M", "F", "M"]
    assert users.occupation == ["technician", "other", "writer"] and users.zip_region() == ["8", "9", "3"]
    assert users.age_band().tolist() == [1, 5, 0]


def test_ml1m_items_and_users_map_codes_to_names(tmp_path):
    folder = _folder(tmp_path, {"ratings.dat": RATINGS_DAT, "movies.dat": MOVIES_DAT, "users.dat": USERS_DAT})
    data = load_interactions(folder)
    items = load_item_meta(folder, data.item_ids)
    assert items.known.tolist() == [True, True, False] and items.titles[2] == "" and items.genres[2] == ()
    users = load_user_demographics(folder, data.user_ids)
    assert users.occupation == ["technician/engineer", "other", "writer"]
    assert users.age.tolist() == [18, 50, 1] and users.age_band().tolist() == [1, 5, 0]


def test_u_genre_names_the_flags(tmp_path):
    names = "|".join(f"g{i}" for i in range(19))
    genre = "\n".join(f"g{i}|{i}" for i in range(19)) + "\n"
    folder = _folder(tmp_path, {"u.data": U_DATA, "u.item": U_ITEM, "u.genre": genre})
    items = load_item_meta(folder, load_interactions(folder).item_ids)
    assert items.genres[1] == ("g1", "g2", "g16") and names.startswith("g0")


def test_no_side_files_gives_none(tmp_path):
    folder = _folder(tmp_path, {"u.data": U_DATA})
    data = load_interactions(folder)
    assert load_item_meta(folder, data.item_ids) is None and load_user_demographics(folder, data.user_ids) is None
    assert load_item_meta("synthetic", data.item_ids) is None


@pytest.mark.parametrize(
    ("files", "loader", "match"),
    [
        ({"u.item": "10|Toy|x||u|0|1\n"}, load_item_meta, r"u.item:1: expected id\|title"),
        ({"u.user": "1|24|M|technician|85711\n2|old|F|other|9\n"}, load_user_demographics, r"u.user:2: age"),
        ({"u.user": "1|24|X|technician|85711\n"}, load_user_demographics, r"u.user:1: gender"),
        ({"users.dat": "1::M::18::99::85711\n"}, load_user_demographics, r"users.dat:1: occupation"),
        ({"movies.dat": "10::Toy Story\n"}, load_item_meta, r"movies.dat:1: expected MovieID"),
    ],
)
def test_malformed_side_files_name_the_file_and_line(tmp_path, files, loader, match):
    folder = _folder(tmp_path, {"u.data": U_DATA, **files})
    data = load_interactions(folder)
    ids = data.item_ids if loader is load_item_meta else data.user_ids
    with pytest.raises(DataFormatError, match=match):
        loader(folder, ids)


@settings(max_examples=40, deadline=None)
@given(
    present=st.lists(st.integers(1, 10_000), min_size=1, max_size=30, unique=True),
    asked=st.lists(st.integers(1, 10_000), min_size=1, max_size=30, unique=True),
)
def test_alignment_by_raw_id(tmp_path_factory, present, asked):
    """Rows follow the asked ids, whatever order the file has; absent ids are unknown."""
    folder = tmp_path_factory.mktemp("side")
    lines = "".join(f"{u}::{'MF'[u % 2]}::{AGE_BANDS[u % 7]}::{u % 21}::{u:05d}\n" for u in present)
    (folder / "users.dat").write_text(lines)
    (folder / "ratings.dat").write_text("1::1::5::1\n")
    users = load_user_demographics(folder, np.array(asked))
    for i, u in enumerate(asked):
        assert users.known[i] == (u in present)
        assert users.zip[i] == (f"{u:05d}" if u in present else "")
        assert users.age[i] == (AGE_BANDS[u % 7] if u in present else -1)


def test_ml_latest_small_movies(ml_latest_small):
    data = load_interactions(ml_latest_small)
    items = load_item_meta(ml_latest_small, data.item_ids)
    assert items.known.all()  # every rated movie has a title
    toy = int(np.flatnonzero(data.item_ids == 1)[0])
    assert items.titles[toy] == "Toy Story (1995)" and "Animation" in items.genres[toy]
    assert len(items.genre_names) == 19  # the 19 genres in ml-latest-small ("(no genres listed)" is none)
    assert load_user_demographics(ml_latest_small, data.user_ids) is None
