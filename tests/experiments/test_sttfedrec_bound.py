"""The ItemPop/content/kNN bound driver against independent oracles: the framework's ItemPop and the run itself."""

from __future__ import annotations

import json

from experiments.studies import sttfedrec_bound
from experiments.cli import main as cli

TINY = """
[run]
rounds = 1
eval_every = 0
[data]
synthetic_users = 40
synthetic_items = 80
synthetic_mean_interactions = 10
[eval]
negatives = 20
[sttfedrec]
hash_dim = 64
dim = 16
clients_per_round = 10
request_size = 10
"""


def _run(capsys, *argv):
    code = cli(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_bound_rows_match_itempop_and_the_trained_model(tmp_path, capsys):
    toml = tmp_path / "tiny.toml"
    toml.write_text(TINY)
    pop = _run(capsys, "run", "itempop", "--config", str(toml), "--out", str(tmp_path / "pop"), "--json", "--quiet")
    fl = _run(capsys, "run", "fl-dssm", "--config", str(toml), "--out", str(tmp_path / "fl"), "--json", "--quiet")
    code = sttfedrec_bound.main(["--data", "synthetic", "--config", str(toml), "--run", str(tmp_path / "fl"), "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    content = [r for r in rows if r["scorer"] == "content"]
    assert {r["user_features"] for r in content} == {"clicks", "history"}
    for r in content:
        if r["beta"] == 0:  # log(1 + popularity) ranks exactly as ItemPop
            assert r["HR@10"] == round(pop["metrics"]["HR@10"], 4)
    blend = [r for r in rows if r["scorer"] == "model+click-embedding-mean"]
    assert blend[0]["lambda"] == 0 and blend[0]["HR@10"] == round(fl["metrics"]["HR@10"], 4)  # the model as trained
    knn = [r for r in rows if r["scorer"] == "item-knn"]
    assert len(knn) == 1 and 0 <= knn[0]["HR@10"] <= 1
