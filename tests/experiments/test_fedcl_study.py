"""The FedCL study driver: its per-user ranks against evaluate_full, its paired statistics against
scipy directly, and a two-seed study on tiny synthetic data end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from experiments.studies import fedcl_study as st
from recmodels.data import Interactions
from recmodels.metrics import evaluate_full, metrics_from_ranks
from recmodels.splits import leave_one_out

TINY = {"data": {"synthetic_users": 30, "synthetic_items": 60, "synthetic_mean_interactions": 8}}
SMALL = {"dim": 8, "max_len": 8, "clients_per_round": 8, "clusters": 4, "secure_aggregation": "none"}


def test_parse_variant_types_values_as_toml():
    assert st.parse_variant('a=fedcl:epsilon=1e6,clustering="kmeans",rounds=3') == (
        "a", "fedcl", {"epsilon": 1e6, "clustering": "kmeans", "rounds": 3})
    assert st.parse_variant("pop=itempop") == ("pop", "itempop", {})
    with pytest.raises(ValueError, match="NAME=PRESET"):
        st.parse_variant("fedcl")


def test_full_ranks_give_the_metrics_of_evaluate_full():
    rng = np.random.default_rng(3)
    users = np.repeat(np.arange(30), 6)
    items = rng.integers(0, 25, users.size)
    keep = np.unique(users * 25 + items, return_index=True)[1]
    data = Interactions(users[keep], items[keep], np.ones(keep.size, np.float32),
                        np.arange(keep.size, dtype=np.int64), np.arange(30), np.arange(25))
    split = leave_one_out(data, seed=0, validation=True)
    scores = rng.normal(size=(30, 25)).round(1)  # ties included
    ranks, n = st.full_ranks(lambda u: scores[u], split, batch_users=7)
    assert metrics_from_ranks(ranks, n, (5, 10)) == evaluate_full(lambda u: scores[u], split, ks=(5, 10))


def test_composed_epsilon_is_basic_for_one_upload_and_never_above_it():
    out = st.composed_epsilons(np.array([0, 1, 1, 3, 9]), 4.0)
    assert out["uploads_median"] == 2.0 and out["uploads_max"] == 9
    assert out["eps_median"] == pytest.approx(8.0, rel=1e-3) and out["eps_max"] <= 36.0 + 1e-9
    assert st.composed_epsilons(np.zeros(3, np.int64), 4.0) == {}


def test_summary_paired_tests_equal_scipy():
    rows = []
    rng = np.random.default_rng(0)
    for seed in range(3):
        for name, shift in (("ref", 0), ("new", 1)):
            ranks = rng.integers(1, 20 - 5 * shift, 50)
            m = metrics_from_ranks(ranks, np.full(50, 100), (5, 10))
            rows.append({"variant": name, "seed": seed, "ranks": ranks.tolist(),
                         **{k: m[k] for k in ("HR@5", "HR@10", "NDCG@10")}})
    text, table = st.summarize(rows, "ref")
    a = [r["HR@10"] for r in rows if r["variant"] == "new"]
    b = [r["HR@10"] for r in rows if r["variant"] == "ref"]
    assert table["new"]["p_t"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
    ha = np.concatenate([np.array(r["ranks"]) <= 10 for r in rows if r["variant"] == "new"])
    hb = np.concatenate([np.array(r["ranks"]) <= 10 for r in rows if r["variant"] == "ref"])
    w, lo = int((ha & ~hb).sum()), int((~ha & hb).sum())
    assert (table["new"]["only_here"], table["new"]["only_ref"]) == (w, lo)
    assert table["new"]["p_sign"] == pytest.approx(stats.binomtest(w, w + lo).pvalue)
    assert "| new | 3 |" in text and "p_t" not in table["ref"]


def test_study_runs_variants_on_paired_seeds_and_resumes(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    ov = ",".join(f"{k}={json.dumps(v)}" for k, v in SMALL.items())
    args = ["run", "--data", "synthetic", "--variant", f"fedcl=fedcl:{ov}", "--variant", "pop=itempop",
            "--seeds", "0", "1", "--rounds", "1",
            "--out", str(out)]
    orig = st.run_variant
    st.run_variant = lambda *a, **k: orig(*a, **k, sections=TINY)
    try:
        assert st.main(args) == 0
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted((d["variant"], d["seed"]) for d in lines) == sorted(
            (v, s) for v in ("fedcl", "pop") for s in (0, 1))
        fedcl = [d for d in lines if d["variant"] == "fedcl"]
        assert all(d["privacy"]["uploads_max"] >= 1 and d["privacy"]["eps_median"] >= 3.99 for d in fedcl)
        assert all("privacy" not in d for d in lines if d["variant"] != "fedcl")
        assert all(d["rounds"] == 0 for d in lines if d["variant"] == "pop")
        assert st.main(args) == 0  # a rerun finds every line done and trains nothing
        assert len(out.read_text().splitlines()) == 4
    finally:
        st.run_variant = orig
    capsys.readouterr()
    png = tmp_path / "s.png"
    assert st.main(["summary", str(out), "--reference", "pop", "--png", str(png), "--json"]) == 0
    table = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(table) == {"fedcl", "pop"} and "p_t" in table["fedcl"] and png.stat().st_size > 1000


def test_signal_to_noise_sees_the_ldp_noise_drown_the_user():
    kw = dict(sections=TINY, overrides={**SMALL, "semi_hard": 6, "lr": 0.01})
    clean = st.signal_to_noise("synthetic", 1, overrides={**kw["overrides"], "epsilon": 1e9}, sections=TINY)
    noisy = st.signal_to_noise("synthetic", 1, overrides={**kw["overrides"], "epsilon": 0.5}, sections=TINY)
    assert 0 < clean["signal_l2"] <= 1.0 and 0 < noisy["signal_l2"] <= 1.0  # clipped to L1 1, so L2 <= 1
    assert noisy["noise_l2"] > 10 * max(clean["noise_l2"], 1e-3)  # 2 clip / eps = 4 per coordinate
    assert clean["overlap_own"] >= noisy["overlap_own"] and 0 < noisy["overlap_chance"] < 1


def test_snr_command_passes_its_set_overrides_and_epsilon(monkeypatch, capsys):
    """``snr --set k=v,...`` reaches signal_to_noise as typed [fedcl] overrides; --epsilon wins over --set."""
    got = []
    monkeypatch.setattr(st, "signal_to_noise", lambda data, rounds, overrides: got.append((data, rounds, overrides)) or {})
    st.main(["snr", "--data", "D", "--rounds", "3", "--epsilon", "2", "8",
             "--set", "logq=true,local_negatives=100,epsilon=99.0"])
    assert got == [("D", 3, {"lr": 0.01, "logq": True, "local_negatives": 100, "epsilon": 2.0}),
                   ("D", 3, {"lr": 0.01, "logq": True, "local_negatives": 100, "epsilon": 8.0})]
    st.main(["snr", "--data", "D", "--epsilon", "4"])
    assert got[-1] == ("D", 30, {"lr": 0.01, "epsilon": 4.0})
