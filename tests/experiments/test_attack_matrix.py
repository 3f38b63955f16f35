"""``secagg attack matrix``: a small synthetic matrix that fails when a defense that must hold does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.studies import attack_matrix
from experiments.studies.attack_matrix import HOLD_MAX, LEAK_MIN, check_cell
from experiments.cli import main


def test_the_small_matrix_leaks_without_a_defense_and_holds_with_secure_sums(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m"
    assert main(["attack", "matrix", "--protocols", "fedavg", "fedmf", "--defenses", "none", "secagg",
                 "--out", str(out), "--json"]) == 0
    m = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert m == json.loads((out / "matrix.json").read_text())
    assert [(c["protocol"], c["defense"]) for c in m["cells"]] == [
        ("fedavg", "none"), ("fedavg", "secagg"), ("fedmf", "none"), ("fedmf", "secagg")]
    assert m["failed"] == [] and all(c["failed"] is None for c in m["cells"])
    for c in m["cells"]:
        best = max(f["advantage"] for f in c["findings"])
        assert (best >= LEAK_MIN) if c["defense"] == "none" else (best <= HOLD_MAX), c
        assert c["views"]["bytes"] > 0 and (Path(c["run_dir"]) / "attacks.json").is_file()
    assert "| fedavg | secagg | holds | fedavg-ik |" in (out / "matrix.md").read_text()
    assert (out / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_defense_that_does_not_hold_fails_the_matrix(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(attack_matrix.EXPECT, "none", "holds")  # pretend plaintext FedAvg were a defense
    out = tmp_path / "m"
    assert main(["attack", "matrix", "--protocols", "fedavg", "--defenses", "none", "--out", str(out)]) == 1
    m = json.loads((out / "matrix.json").read_text())
    assert len(m["failed"]) == 1 and "fedavg/none: expected 'none' to hold" in m["failed"][0]
    assert "FAILED" in (out / "matrix.md").read_text()


@pytest.mark.parametrize("defense, advantages, fails", [
    ("none", [0.9, -0.2], False), ("none", [0.3], True), ("none", [], True),
    ("secagg+", [0.0, 0.0], False), ("paillier", [0.2], True), ("ldp-eps1", [0.9], False), ("ldp-eps1", [-1.0], False),
])
def test_check_cell(defense: str, advantages: list[float], fails: bool) -> None:
    assert (check_cell(defense, [{"advantage": a} for a in advantages]) is not None) == fails


def test_unknown_cells_are_refused(tmp_path: Path, capsys) -> None:
    assert main(["attack", "matrix", "--protocols", "nope", "--out", str(tmp_path)]) == 2
    assert "no matrix cells for protocol(s) nope" in capsys.readouterr().err
    assert main(["attack", "matrix", "--defenses", "rot13", "--out", str(tmp_path)]) == 2
    assert "unknown defense(s) rot13" in capsys.readouterr().err
