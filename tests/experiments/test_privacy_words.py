"""What a run spent, in words, for every protocol family (issue 28, item 4): the end-of-run statement
(``secagg run``, ``summary.json``) and the text of ``secagg privacy report RUN_DIR`` name every release
without DP, every FEL leaf and the over-arch, and the per-user local-DP epsilon (median and max), and
agree with the report's ``--json`` numbers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from experiments.cli import main

TINY = """
[run]
rounds = 2
[data]
synthetic_users = 30
synthetic_items = 60
synthetic_mean_interactions = 8
[eval]
negatives = 10
"""

FEDMF_LDP = """
[run]
protocol = "fedmf"
rounds = 2
[data]
synthetic_users = 30
synthetic_items = 60
synthetic_mean_interactions = 8
[fedmf]
defense = "ldp"
epsilon = 2.0
"""

FEL_FL_DP = TINY + """
[fel]
n_clusters = 2
over_arch_clients = 10
over_arch_steps = 2
dp = "central"
clip = 0.5
calibration = "epsilon"
target_epsilon = 4.0
dp_rounds = 2
over_arch_target_epsilon = 2.0
"""


def run(tmp_path: Path, capsys, preset: str | None, config: str) -> tuple[Path, dict, str]:
    """``secagg run`` (then ``privacy report --json`` and its text); returns the run dir, the report, the
    run's stdout and the report's text."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(config)
    out = tmp_path / "run"
    assert main(["run", *([preset] if preset else []), "--config", str(cfg), "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert main(["privacy", "report", str(out), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return out, json.loads(lines[-1]), printed, "\n".join(lines[:-1])


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def said(run_dir: Path) -> str:
    """The end-of-run statement's sentences as written (``privacy.parts``), checked against the statement."""
    privacy = summary_of(run_dir)["privacy"]
    assert privacy["statement"] == " ".join(p[0].upper() + p[1:] + "." for p in privacy["parts"])
    return " | ".join(privacy["parts"])


def test_fedavg_names_its_plaintext_release(tmp_path: Path, capsys) -> None:
    out, report, printed, text = run(tmp_path, capsys, "fedavg-gmf", TINY)
    statement = said(out)
    assert "WITHOUT differential privacy" in statement and "item/output-layer updates, each in plaintext" in statement
    assert "epsilon is infinite" in statement
    assert "in words:" in text and "item/output-layer updates, each in plaintext" in text.split("in words:")[1]
    assert [ln[:10] for ln in printed.splitlines()].count("privacy   ") == 1 and "item/output-layer updates" in printed


def test_fedmf_ldp_states_epsilon_per_upload_and_total(tmp_path: Path, capsys) -> None:
    out, report, printed, text = run(tmp_path, capsys, None, FEDMF_LDP)
    statement = said(out)
    assert "[2 releases; epsilon 2 each]" in statement
    assert f"({report['epsilon']:.4g}, 1e-05)-DP" in statement and "WITHOUT" not in statement
    assert "Laplace-noised on the device [2 releases; epsilon 2 each]" in text


def test_fedcl_text_report_states_the_per_user_ldp_epsilon(tmp_path: Path, capsys) -> None:
    out, report, printed, text = run(tmp_path, capsys, "fedcl", TINY)
    per_user = report["per_user"]["epsilon"]
    words = text.split("in words:")[1]
    assert re.search(rf"each user spent epsilon median {per_user['median']:.4g}, max {per_user['max']:.4g}", words)
    assert f"by {report['per_user']['accountant']} (delta 1e-05): median {per_user['median']:.4g}, " \
           f"max {per_user['max']:.4g}" in words
    assert "gradient sum through secagg+ (no DP noise)" in words  # the non-private release, named
    statement = said(out)
    assert "local DP on each user's own uploads (LDP user embedding): epsilon 4 per upload" in statement
    assert "each user spent epsilon median" in statement and "epsilon is infinite" in statement


def test_fel_dp_names_every_leaf(tmp_path: Path, capsys) -> None:
    out, report, printed, text = run(tmp_path, capsys, "fel-dp", TINY)
    leaves = report["per_leaf"]
    assert len(leaves) == 4
    statement = said(out)
    words = text.split("in words:")[1]
    for leaf in leaves:
        expected = f"leaf {leaf['cluster']} ({leaf['clients']} clients) epsilon {leaf['epsilon']:.4g}"
        assert expected in statement and expected in words, expected
    assert "(leaves 0-3)" in statement and "the over-arch: no release of the leaves' users" in statement
    assert f"({summary_of(out)['privacy']['epsilon']:.4g}, 1e-05)-DP" in statement


def test_fel_fl_states_the_over_arch(tmp_path: Path, capsys) -> None:
    out, report, printed, text = run(tmp_path, capsys, "fel-fl", FEL_FL_DP)
    over = report["over_arch"]
    assert over["mode"] == "sequential"
    phrase = (f"the over-arch (trained by FL, sequential composition with the leaves, {over['releases']} releases): "
              f"epsilon {over['epsilon']:.4g}")
    assert phrase in said(out)
    assert phrase[0].upper() + phrase[1:] in text
    assert "leaf 0 (" in text and "leaf 1 (" in text


def test_fel_in_plaintext_names_every_leaf_not_only_the_first(tmp_path: Path, capsys) -> None:
    out, report, printed, text = run(tmp_path, capsys, "fel-fl", TINY)
    statement = said(out)
    assert "item/output-layer updates, each in plaintext (leaves 0-3)" in statement
    assert "over-arch plaintext gradients (FedSGD)" in statement


@pytest.mark.parametrize("preset", ["lightfr", "fedfast-secagg", "sttfedrec"])
def test_secure_sums_without_noise_are_named_as_not_private(tmp_path: Path, capsys, preset: str) -> None:
    out, report, printed, text = run(tmp_path, capsys, preset, TINY)
    privacy = summary_of(out)["privacy"]
    assert privacy["epsilon"] is None and privacy["unprotected"] is True
    assert privacy["parts"][0].startswith("released WITHOUT differential privacy")
    assert "no DP noise" in privacy["parts"][0]  # the release's own words: summed securely, but not DP
    assert privacy["parts"][-1].startswith("overall: epsilon is infinite")


def test_a_protocols_stated_assumption_is_part_of_the_words(tmp_path: Path, capsys) -> None:
    """A protocol's report may state the premise of its accounting (``noise_assumption``, e.g. FEL's
    collusion bound on distributed noise): the words carry it, before the overall figure."""
    from dp.ledger import PrivacyLedger
    from experiments.cli.privacy_text import describe_spent

    out, report, printed, text = run(tmp_path, capsys, "fel-dp", TINY)
    with PrivacyLedger(out / "privacy_ledger.sqlite") as ledger:
        words = describe_spent(ledger, 1e-5, {**report, "noise_assumption": "at most 1 client colludes"})
    assert words["parts"][-2] == "this accounting assumes: at most 1 client colludes"
    assert words["parts"][-1].startswith("overall: (")
