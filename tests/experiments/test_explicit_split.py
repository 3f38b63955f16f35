"""``[data] train/valid/test`` and ``[eval] candidates``: a run on a paper's split files (NCF and
LightFR's CSVs, written here in those formats) evaluates on exactly their candidates and reports
every tie rule; bad combinations are refused in words."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments.cli import main
from experiments.run.config import RunConfig, load_config_file, merge
from experiments.run.prepare import prepare_data, run_data_files, split_files_of
from recmodels.loaders import DataFileNotFoundError, DataFormatError
from recmodels.metrics import TIE_RULES


def toy_lists(n_users=24, n_items=40, seed=0, negatives=9):
    rng = np.random.default_rng(seed)
    train, test, negs = [], [], {}
    for u in range(n_users):
        items = rng.choice(n_items, size=6, replace=False)
        for t, i in enumerate(items[:-1]):
            train.append((u, int(i), int(rng.integers(1, 6)), 1000 + t))
        test.append((u, int(items[-1]), 5, 2000))
        pool = np.setdiff1d(np.arange(n_items), items)
        negs[(u, int(items[-1]))] = rng.choice(pool, size=negatives, replace=False).tolist()
    return train, test, negs


def write_ncf(folder: Path, prefix="ml-toy", **kw) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    train, test, negs = toy_lists(**kw)
    (folder / f"{prefix}.train.rating").write_text("".join("\t".join(map(str, r)) + "\n" for r in train))
    (folder / f"{prefix}.test.rating").write_text("".join("\t".join(map(str, r)) + "\n" for r in test))
    (folder / f"{prefix}.test.negative").write_text(
        "".join(f"({u},{i})\t" + "\t".join(map(str, n)) + "\n" for (u, i), n in negs.items()))
    return folder


def write_lightfr(folder: Path, prefix="filmtrust", with_val=True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    train, test, negs = toy_lists(seed=1, negatives=7)
    head = "user_id,item_id,ratings\n"
    (folder / f"{prefix}_train.csv").write_text(
        head + "".join(f"{u},{i},{(r - 0.5) / 4.5 + 0.01:.4f}\n" for u, i, r, _ in train))
    (folder / f"{prefix}_test.csv").write_text(
        head + "".join(f"{u},{i},3.5\n" + "".join(f"{u},{n},0\n" for n in negs[(u, i)]) for u, i, _, _ in test))
    if with_val:
        # validation: the test item's first negative as positive, the rest as its negatives
        (folder / f"{prefix}_val.csv").write_text(
            head + "".join(f"{u},{negs[(u, i)][0]},2\n" + "".join(f"{u},{n},0\n" for n in negs[(u, i)][1:])
                           for u, i, _, _ in test))
    return folder


def cfg(**sections) -> RunConfig:
    return merge(RunConfig(), sections)


def test_ncf_folder_as_source_uses_its_candidate_file(tmp_path):
    folder = write_ncf(tmp_path / "ncf")
    prep = prepare_data(cfg(run={"protocol": "itempop", "rounds": 0}, data={"source": str(folder)}))
    assert prep.candidates.source.endswith("ml-toy.test.negative")
    assert prep.candidates.items.shape == (24, 10)
    _, test, negs = toy_lists()
    ids = prep.split.train.item_ids
    for row, (u, i, _, _) in enumerate(test):
        assert [int(ids[j]) for j in prep.candidates.items[row]] == [i, *negs[(u, i)]]
    assert prep.description["files_report"]["candidates"]["candidates_per_user"] == [10, 10]
    assert "not applied" in prep.description["min_user_interactions"]


def test_explicit_keys_relative_to_source_and_files_fingerprinted(tmp_path):
    folder = write_ncf(tmp_path / "ncf")
    (folder / "mine.negative").write_text((folder / "ml-toy.test.negative").read_text())
    c = cfg(run={"protocol": "itempop", "rounds": 0},
            data={"source": str(folder), "train": "ml-toy.train.rating", "test": "ml-toy.test.rating"},
            eval={"candidates": "mine.negative"})
    files = split_files_of(c)
    assert files.candidates == folder / "mine.negative"
    prints = run_data_files(c)
    assert set(prints) == {str((folder / n).resolve()) for n in ("ml-toy.train.rating", "ml-toy.test.rating", "mine.negative")}


def test_a_run_on_ncf_files_reports_every_tie_rule(tmp_path, capsys):
    folder = write_ncf(tmp_path / "ncf")
    out = tmp_path / "run"
    code = main(["run", "itempop", "--data", str(folder), "--out", str(out), "--json", "--quiet"])
    stdout, _ = capsys.readouterr()
    assert code == 0
    s = json.loads(stdout.strip().splitlines()[-1])
    assert "ml-toy.test.negative" in s["evaluation"]["sampled"] and "nothing sampled" in s["evaluation"]["sampled"]
    assert set(s["ties"]) == {"sampled", "full"}
    for kind in ("sampled", "full"):
        assert set(s["ties"][kind]) == set(TIE_RULES)
        p, r, o = (s["ties"][kind][rule]["HR@10"] for rule in ("pessimistic", "random", "optimistic"))
        assert p <= r + 1e-12 <= o + 2e-12
    assert s["ties"]["sampled"]["pessimistic"] == s["metrics"]
    assert set(s["evaluation"]["tie_rules"]) == set(TIE_RULES)
    assert "ties    (sampled) HR@10" in stdout
    # the run directory fingerprints the split files: a changed one stops --resume
    ident = json.loads((out / "run.json").read_text())
    assert str((folder / "ml-toy.test.negative").resolve()) in ident["data_files"]


def test_resume_refuses_a_changed_candidate_file(tmp_path, capsys):
    folder = write_ncf(tmp_path / "ncf")
    out = tmp_path / "run"
    toml = tmp_path / "c.toml"
    toml.write_text(f'[run]\nrounds = 2\neval_every = 1\n[data]\nsource = "{folder}"\n[fedavg]\ndim = 4\n')
    assert main(["run", "--config", str(toml), "--out", str(out), "--quiet"]) == 0
    neg = folder / "ml-toy.test.negative"
    neg.write_text(neg.read_text().replace("\t", "\t1\t", 1))
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--rounds", "3", "--quiet"]) != 0
    _, err = capsys.readouterr()
    assert "ml-toy.test.negative changed since the run was created" in err


def test_lightfr_folder_by_explicit_keys(tmp_path):
    folder = write_lightfr(tmp_path / "ft")
    c = cfg(run={"protocol": "itempop", "rounds": 0}, split={"validation": True},
            data={"source": str(folder), "train": "filmtrust_train.csv", "valid": "filmtrust_val.csv",
                  "test": "filmtrust_test.csv", "threshold": 0.5})
    prep = prepare_data(c)
    assert prep.candidates.items.shape == (24, 8) and prep.valid_candidates.items.shape == (24, 7)
    assert prep.split.valid_items is not None and (prep.split.valid_items >= 0).all()
    # threshold keeps the training rows rated >= 0.5 (the authors' code drops the low ones)
    assert prep.description["positives"] == "rating >= 0.5" and len(prep.split.train) < 24 * 5
    assert prep.exclude is not None and len(prep.exclude) + len(prep.split.train) == 24 * 5


def test_lightfr_folder_autodetected_and_run(tmp_path, capsys):
    folder = write_lightfr(tmp_path / "ft", with_val=False)
    code = main(["run", "itempop", "--data", str(folder), "--out", str(tmp_path / "r"), "--json", "--quiet"])
    stdout, _ = capsys.readouterr()
    assert code == 0
    s = json.loads(stdout.strip().splitlines()[-1])
    assert "filmtrust_test.csv" in s["evaluation"]["sampled"]
    assert s["evaluation"]["users_evaluated"] == 24


@pytest.mark.parametrize(
    ("sections", "error", "words"),
    [
        ({"eval": {"candidates": "x.negative"}}, ValueError, "set [data] train and test"),
        ({"data": {"source": "{folder}", "format": "lightfr-csv"}}, ValueError, "holds no lightfr-csv split"),
        ({"data": {"source": "{folder}", "train": "ml-toy.train.rating", "test": "ml-toy.test.rating",
                   "format": "ml-csv"}}, ValueError, "explicit split files"),
        ({"data": {"source": "{folder}", "train": "ml-toy.train.rating", "test": "nope.rating"}},
         DataFileNotFoundError, "nope.rating: no such file (the test file"),
        ({"data": {"source": "{folder}"}, "split": {"validation": True}}, ValueError, "no validation file"),
        ({"data": {"source": "{folder}"}, "run": {"protocol": "fedmf"}}, ValueError, "ranking protocols"),
    ],
)
def test_bad_combinations_are_refused(tmp_path, sections, error, words):
    folder = write_ncf(tmp_path / "ncf")
    sections = json.loads(json.dumps(sections).replace("{folder}", str(folder)))
    with pytest.raises(error) as err:
        prepare_data(cfg(**sections))
    assert words in str(err.value)


def test_config_keys_go_together(tmp_path):
    with pytest.raises(ValueError, match="data.train and data.test go together"):
        cfg(data={"train": "a.train.rating"})
    with pytest.raises(ValueError, match="data.valid needs"):
        cfg(data={"valid": "a.valid.rating"})
    path = tmp_path / "c.toml"
    path.write_text('[data]\ntrain = "a"\ntest = "b"\n[eval]\ncandidates = "c"\n')
    c = load_config_file(path)
    assert (c.data.train, c.data.test, c.eval.candidates) == ("a", "b", "c")


def test_malformed_split_file_stops_the_run_before_anything_is_written(tmp_path, capsys):
    folder = write_ncf(tmp_path / "ncf")
    (folder / "ml-toy.test.negative").write_text("(0,1)\tx\n")
    out = tmp_path / "run"
    assert main(["run", "itempop", "--data", str(folder), "--out", str(out), "--quiet"]) != 0
    _, err = capsys.readouterr()
    assert "ml-toy.test.negative:1" in err and "not a non-negative integer" in err
    assert not out.exists()
    assert isinstance(DataFormatError(folder, 1, "x"), ValueError)
