"""prepare_data: ratings below the positive threshold are never negatives (issue 9, item 10)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.run.config import RunConfig, merge, parse_sections
from experiments.run.prepare import prepare_data
from protocols.fedavg import FedAvgConfig, FedAvgGMF
from recmodels.data import pair_keys
from recmodels.train import CentralConfig, CentralTrainer


def _ratings_file(tmp_path: Path) -> Path:
    """30 users x 40 items; each user likes 6 items (rating 5) and dislikes 24 (rating 1).

    Only 10 items per user are unrated, so a sampler that ignored the dislikes would draw one
    for nearly every negative.
    """
    rng = np.random.default_rng(0)
    lines = ["userId,movieId,rating,timestamp"]
    for u in range(30):
        items = rng.permutation(40)
        for j, i in enumerate(items[:30]):
            lines.append(f"{u + 1},{i + 100},{5.0 if j < 6 else 1.0},{1000 + j}")
    path = tmp_path / "ratings.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _config(path: Path, protocol: str) -> RunConfig:
    raw = {
        "run": {"protocol": protocol},
        "data": {"source": str(path), "threshold": 4.0, "min_user_interactions": 2, "min_item_interactions": 1},
        "eval": {"negatives": 5},
    }
    return merge(RunConfig(), parse_sections(raw, "test"))


def _disliked(prep) -> np.ndarray:
    ex = prep.exclude
    return pair_keys(ex.users, ex.items, prep.data.n_items)


def test_disliked_items_are_excluded_from_eval_and_training_negatives(tmp_path, monkeypatch):
    prep = prepare_data(_config(_ratings_file(tmp_path), "fedavg"))
    assert prep.exclude is not None and len(prep.exclude) > 0
    assert np.all(prep.exclude.ratings < 4.0)
    disliked = _disliked(prep)
    # Evaluation candidates: the negatives (columns 1..) are neither liked nor disliked.
    cand = prep.candidates
    users = np.repeat(cand.users, cand.items.shape[1] - 1)
    keys = pair_keys(users, cand.items[:, 1:].ravel(), prep.data.n_items)
    assert not np.isin(keys, disliked).any()
    # FedAvg's and the centralised trainer's training negatives.
    import protocols.fedavg as fedavg_mod
    import recmodels.train as train_mod

    n_items = prep.data.n_items
    for mod, name, make, keys_of in [
        (fedavg_mod, "sample_negatives_keyed",  # each client's own stream (recmodels.streams)
         lambda: FedAvgGMF(prep.split.train, FedAvgConfig(dim=2, train_negatives=4), seed=0, exclude=prep.exclude),
         lambda args, kw, out: pair_keys(args[0], out, n_items)),
        (train_mod, "sample_train_negatives",
         lambda: CentralTrainer(prep.split.train, CentralConfig(dim=2), seed=0, exclude=prep.exclude),
         lambda args, kw, out: pair_keys(out[0], out[1], n_items)),
    ]:
        seen = []
        real = getattr(mod, name)

        def spy(*args, real=real, seen=seen, keys_of=keys_of, **kw):
            out = real(*args, **kw)
            seen.append(keys_of(args, kw, out))
            return out

        monkeypatch.setattr(mod, name, spy)
        make().run_round()
        drawn = np.concatenate(seen)
        assert len(drawn) > 100 and not np.isin(drawn, disliked).any(), mod.__name__


def test_without_exclude_the_sampler_does_draw_disliked_items(tmp_path):
    """The control: the same draw without ``exclude`` hits the dislikes (so the test above can fail)."""
    from recmodels.sampling import sample_train_negatives

    prep = prepare_data(_config(_ratings_file(tmp_path), "fedavg"))
    _, items = sample_train_negatives(prep.split.train, n_neg=4, rng=np.random.default_rng(0))
    keys = pair_keys(np.repeat(prep.split.train.users, 4), items, prep.data.n_items)
    assert np.isin(keys, _disliked(prep)).mean() > 0.5


def test_every_rating_a_positive_needs_no_exclude(tmp_path):
    raw = {
        "data": {"source": str(_ratings_file(tmp_path)), "min_user_interactions": 2, "min_item_interactions": 1},
        "eval": {"negatives": 5},
    }
    assert prepare_data(merge(RunConfig(), parse_sections(raw, "test"))).exclude is None


def _odd_csv(tmp_path: Path) -> Path:
    """Columns no header name gives away: the timestamp first, then two id columns, then a score."""
    rng = np.random.default_rng(1)
    lines = ["when;a;b;c"]
    for u in range(40):
        for i in rng.choice(60, size=10, replace=False):
            lines.append(f"{1000 + i};{u};{i};{rng.integers(1, 6)}")
    path = tmp_path / "odd.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_run_reads_a_csv_through_columns_and_sep_and_records_the_layout(tmp_path, capsys):
    """Issue 9, item 8: ``--columns``/``--sep`` and ``[data.columns]`` reach ``secagg run``; the
    layout used is printed and kept in the run directory so a resume reads the file the same way."""
    import json

    from experiments.cli import main

    path = _odd_csv(tmp_path)
    base = ["run", "--data", str(path), "--rounds", "1", "--eval-negatives", "5", "--quiet", "--json"]
    assert main(base + ["--out", str(tmp_path / "bad")]) == 2  # no header names a user column
    assert "user" in capsys.readouterr().err
    spec = "user=a,item=b,rating=c,timestamp=when"
    assert main(base + ["--columns", spec, "--sep", ";", "--out", str(tmp_path / "r1")]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "r1" / "summary.json").read_text())
    layout = summary["data"]["layout"]
    assert layout["delimiter"] == ";" and "user=a" in layout["read_as"]
    assert 'user = "a"' in (tmp_path / "r1" / "config.toml").read_text()
    # The same through a config file's [data.columns] table, and --resume reads it back.
    toml = tmp_path / "cols.toml"
    toml.write_text('[data.columns]\nuser = "1"\nitem = "2"\nrating = "c"\ntimestamp = "none"\n')
    assert main(base + ["--config", str(toml), "--out", str(tmp_path / "r2")]) == 0
    assert main(["run", "--resume", str(tmp_path / "r2"), "--rounds", "2", "--quiet"]) == 0
    r2 = json.loads((tmp_path / "r2" / "summary.json").read_text())
    assert r2["data"]["layout"]["columns"].keys() >= {"user", "item", "rating"}
    assert r2["data"]["preprocessed"] == summary["data"]["preprocessed"]
    # A malformed spec is refused in words.
    assert main(base + ["--columns", "person=a", "--out", str(tmp_path / "r3")]) == 2
    assert "--columns expects ROLE=NAME" in capsys.readouterr().err


def test_the_full_ranking_advice_for_a_one_user_file_is_true(tmp_path, capsys):
    """Issue 9, item 9: the error suggests full ranking, and full ranking then works."""
    from experiments.cli import main

    path = tmp_path / "one.csv"
    path.write_text("userId,movieId,rating,timestamp\n1,1,5,1\n1,2,4,2\n1,3,3,3\n")
    base = ["run", "--data", str(path), "--rounds", "1", "--quiet"]
    assert main(base + ["--out", str(tmp_path / "a")]) == 2
    assert "use full ranking" in capsys.readouterr().err
    assert main(base + ["--eval-negatives", "0", "--out", str(tmp_path / "b")]) == 0
    assert "HR@10 1.0000" in capsys.readouterr().out
