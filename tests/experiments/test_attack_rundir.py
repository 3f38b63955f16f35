"""``secagg attack RUN_DIR``: every applicable attack on a run's recorded views (or a replay), one schema."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from attacks.findings import STATUS_PUBLIC
from experiments.cli import main
from experiments.run.views import VIEWS_DIR

SMALL = """
[run]
eval_every = 0
[data]
synthetic_users = 30
synthetic_items = 40
synthetic_mean_interactions = 8
[eval]
negatives = 10
"""
FIELDS = {"attack", "role", "target", "metric", "higher_is_better", "value", "random", "public", "advantage",
          "interval", "advantage_interval", "rounds", "status", "users", "extra"}


def _run(tmp_path: Path, preset: str, *extra: str, name: str = "run") -> Path:
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    out = tmp_path / name
    assert main(["run", preset, "--config", str(cfg), "--out", str(out), "--quiet", *extra]) == 0
    return out


def _attack(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["attack", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])


def test_plaintext_fedavg_leaks_and_the_same_run_through_secagg_does_not(tmp_path: Path, capsys) -> None:
    plain = _run(tmp_path, "fedavg-gmf", "--rounds", "2", "--record-views", name="plain")
    out = _attack(capsys, str(plain))
    assert out["source"] == "recorded views" and out["rounds"] == [0, 1] and out["protocol"] == "fedavg"
    [f] = out["findings"]
    assert set(f) == FIELDS and f["attack"] == "fedavg-ik" and f["role"] == "server" and f["metric"] == "f1"
    assert f["advantage"] > 0.5 and f["advantage_interval"][0] > 0.3, f  # the server reads the positives
    assert f["value"] > max(f["random"], f["public"]) and f["interval"][0] <= f["value"] <= f["interval"][1]
    assert json.loads((plain / "attacks.json").read_text()) == out

    masked = _run(tmp_path, "fedavg-gmf-secagg", "--rounds", "2", "--record-views", name="masked")
    [g] = _attack(capsys, str(masked))["findings"]
    assert g["status"].startswith(STATUS_PUBLIC)
    assert g["advantage"] == 0.0 and g["value"] == max(g["random"], g["public"])  # never below the baselines


def test_a_replay_gives_the_findings_of_the_recorded_views(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path, "fedavg-gmf", "--rounds", "1", "--record-views")
    recorded = _attack(capsys, str(run))
    shutil.rmtree(run / VIEWS_DIR)
    replayed = _attack(capsys, "run-dir", str(run))  # the explicit sub-command is the same command
    assert replayed["source"] == "replay of 1 round(s)" and replayed["replay_matches_run"] is True
    assert replayed["findings"] == recorded["findings"]


def test_a_changed_view_stops_the_attack_in_words(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path, "fedavg-gmf", "--rounds", "1", "--record-views")
    path = run / VIEWS_DIR / "round-000000.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["attack", str(run)]) == 2
    err = capsys.readouterr().err
    assert "round-000000.safetensors does not match the SHA-256" in err and "Traceback" not in err
    assert not (run / "attacks.json").exists()


@pytest.mark.parametrize("argv, words", [
    (["--attack", "nope"], "unknown attack 'nope'"),
    (["--rounds", "2"], "every recorded round is read"),
])
def test_bad_requests_are_refused(tmp_path: Path, capsys, argv: list[str], words: str) -> None:
    run = _run(tmp_path, "fedavg-gmf", "--rounds", "1", "--record-views")
    capsys.readouterr()
    assert main(["attack", str(run), *argv]) == 2
    assert words in capsys.readouterr().err


def test_an_attack_that_does_not_apply_is_skipped_with_its_reason(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "fedmf.toml"
    cfg.write_text(SMALL.replace("[run]\n", '[run]\nprotocol = "fedmf"\n'))
    out = tmp_path / "fedmf"
    assert main(["run", "--config", str(cfg), "--out", str(out), "--rounds", "1", "--record-views", "--quiet"]) == 0
    res = _attack(capsys, str(out))
    assert [s["attack"] for s in res["skipped"]] == ["fedmf-two-round"]
    assert "batch user update" in res["skipped"][0]["reason"]
    by_target = {f["target"]: f for f in res["findings"]}
    assert by_target["rated items"]["advantage"] == pytest.approx(1.0)  # plaintext FedMF: every rating leaks
    assert by_target["ratings"]["metric"] == "rmse" and by_target["ratings"]["value"] < 0.05


@pytest.mark.parametrize("preset, ran, skipped", [
    ("fel", [], ["fel-label"]),
    pytest.param("fedcl", ["fedcl-embedding-topk"], [], marks=pytest.mark.slow),
    pytest.param("sttfedrec", ["request-intersection", "item-gradient"], ["chain-collusion"], marks=pytest.mark.slow),
])
def test_every_protocol_s_registered_attacks_run_or_say_why_not(tmp_path: Path, capsys, preset: str, ran: list[str],
                                                              skipped: list[str]) -> None:
    run = _run(tmp_path, preset, "--rounds", "2", "--record-views")
    out = _attack(capsys, str(run))
    assert sorted({f["attack"] for f in out["findings"]}) == sorted(ran)
    assert [s["attack"] for s in out["skipped"]] == skipped and all(s["reason"] for s in out["skipped"])
    for f in out["findings"]:
        assert set(f) == FIELDS and f["rounds"] == [0, 1] and f["value"] is not None
        if f["status"].startswith(STATUS_PUBLIC):
            assert f["advantage"] == 0.0


def test_a_run_dir_named_like_a_target_is_reached_with_a_path() -> None:
    from experiments import cli

    parser = cli.build_parser()
    assert cli._attack_run_dir_alias(parser, ["attack", "fedmf", "--json"]) == ["attack", "fedmf", "--json"]
    assert cli._attack_run_dir_alias(parser, ["attack", "./fedmf"]) == ["attack", "run-dir", "./fedmf"]
    assert cli._attack_run_dir_alias(parser, ["--plugin", "m", "attack", "runs/x", "--json"]) == \
        ["--plugin", "m", "attack", "run-dir", "runs/x", "--json"]
    assert cli._attack_run_dir_alias(parser, ["run", "runs/x"]) == ["run", "runs/x"]


def test_a_two_server_dpf_run_records_both_servers_and_scores_zero(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path, "fedavg-gmf-dpf", "--rounds", "1", "--record-views")
    index = json.loads((run / VIEWS_DIR / "index.json").read_text())
    assert index["roles"] == ["server", "server2"]  # the DPF sum's second server is an adversary too
    assert all(e["records"]["server2"] > 0 for e in index["rounds"])
    [f] = _attack(capsys, str(run))["findings"]
    assert f["attack"] == "fedavg-ik" and f["status"].startswith(STATUS_PUBLIC) and f["advantage"] == 0.0
