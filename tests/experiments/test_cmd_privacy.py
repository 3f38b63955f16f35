"""``secagg privacy``: account, calibrate, report (JSON last line, exit 2 on user errors)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dp.accountant import RdpAccountant
from dp.events import Gaussian, PoissonSampled, SelfComposed
from dp.ledger import PrivacyLedger
from experiments.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict | None, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    payload = json.loads(lines[-1]) if "--json" in argv and code == 0 else None
    return code, payload, out, err


def test_account_gaussian_json(capsys) -> None:
    code, p, _, _ = _run(capsys, "privacy", "account", "--mechanism", "gaussian", "--q", "0.01", "--sigma", "1.1",
                         "--steps", "1000", "--delta", "1e-5", "--json")
    assert code == 0
    assert {"epsilon", "accountant", "epsilon_rdp", "order", "delta"} <= set(p)
    assert p["delta"] == 1e-5 and p["accountant"] in {"rdp", "pld"}
    rdp = RdpAccountant().compose(SelfComposed(PoissonSampled(0.01, Gaussian(1.1)), 1000))
    assert p["epsilon_rdp"] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-12)
    assert p["epsilon"] == min(p["epsilon_rdp"], p["epsilon_pld"])


def test_account_gaussian_fixed_sampling(capsys) -> None:
    code, p, _, _ = _run(capsys, "privacy", "account", "--q", "0.01", "--sigma", "1.0", "--steps", "50",
                         "--delta", "1e-5", "--sampling", "fixed", "--population", "1000", "--no-pld", "--json")
    assert code == 0 and p["neighboring_relation"] == "replace_one" and math.isfinite(p["epsilon"])


def test_account_laplace_pure_by_default(capsys) -> None:
    code, p, out, _ = _run(capsys, "privacy", "account", "--mechanism", "laplace", "--epsilon0", "0.5",
                           "--count", "4", "--json")
    assert code == 0 and p["epsilon"] == pytest.approx(2.0) and p["accountant"] == "pure" and p["delta"] == 0
    code, p, _, _ = _run(capsys, "privacy", "account", "--mechanism", "laplace", "--epsilon0", "1", "--count", "100",
                         "--delta", "1e-5", "--json")
    assert p["epsilon"] == pytest.approx(68.25, abs=0.01) and p["epsilon_rdp"] == pytest.approx(70.78, abs=0.01)


def test_account_fel_forms(capsys) -> None:
    base = ["privacy", "account", "--mechanism", "fel", "--sigma", "1.0", "--cluster", "0.02,51", "--cluster",
            "0.01,100", "--delta", "1e-6", "--no-pld", "--json"]
    _, leaves_only, _, _ = _run(capsys, *base)
    _, same, _, _ = _run(capsys, *base, "--over-arch", "0.05,10,2.0", "--over-arch-users", "same")
    _, disjoint, _, _ = _run(capsys, *base, "--over-arch", "0.05,10,2.0", "--over-arch-users", "disjoint")
    assert leaves_only["epsilon"] <= disjoint["epsilon"] < same["epsilon"]
    assert leaves_only["parameters"]["over_arch_users"] == "opt_in"


def test_calibrate_gaussian_and_laplace(capsys) -> None:
    code, p, _, _ = _run(capsys, "privacy", "calibrate", "--epsilon", "1.0", "--delta", "1e-5", "--q", "0.01",
                         "--steps", "1000", "--no-pld", "--json")
    assert code == 0 and p["epsilon_rdp"] <= 1.0 and 1.4 < p["sigma"] < 1.7
    code, p, _, _ = _run(capsys, "privacy", "calibrate", "--mechanism", "laplace", "--epsilon", "5", "--count", "10",
                         "--json")
    assert code == 0 and p["epsilon0"] == pytest.approx(0.5) and p["epsilon"] == pytest.approx(5.0)


def test_report_reads_ledger_and_writes_png(tmp_path: Path, capsys) -> None:
    ev = PoissonSampled(0.05, Gaussian(1.0))
    with PrivacyLedger(tmp_path / "privacy_ledger.sqlite", budget=(5.0, 1e-5)) as ledger:
        for r in range(5):
            with ledger.round(r) as rnd:
                rnd.record(ev, who="server", what="aggregate")
    code, p, out, _ = _run(capsys, "privacy", "report", str(tmp_path), "--json")
    assert code == 0
    assert p["rounds"] == [0, 1, 2, 3, 4] and p["entries"] == 5 and p["budget"] == [5.0, 1e-5]
    assert p["epsilon_by_round"] == sorted(p["epsilon_by_round"])
    png = tmp_path / "privacy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round" in out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["privacy", "account", "--q", "2", "--sigma", "1", "--steps", "3", "--delta", "1e-5"], "sampling_probability"),
        (["privacy", "account", "--mechanism", "laplace", "--count", "3"], "needs --epsilon0"),
        (["privacy", "account", "--mechanism", "fel", "--sigma", "1", "--delta", "1e-5"], "--cluster"),
        (["privacy", "calibrate", "--epsilon", "-1", "--delta", "1e-5", "--q", "0.1", "--steps", "3"], "target_epsilon"),
    ],
)
def test_user_errors_exit_2_without_traceback(capsys, argv: list[str], match: str) -> None:
    code, _, _, err = _run(capsys, *argv)
    assert code == 2 and match in err and "Traceback" not in err


def test_report_missing_or_bad_ledger(tmp_path: Path, capsys) -> None:
    code, _, _, err = _run(capsys, "privacy", "report", str(tmp_path))
    assert code == 2 and "no privacy ledger" in err
    (tmp_path / "privacy_ledger.sqlite").write_bytes(b"not sqlite at all" * 100)
    code, _, _, err = _run(capsys, "privacy", "report", str(tmp_path))
    assert code == 2 and "not a privacy ledger" in err


@pytest.mark.parametrize("sub", [[], ["account"], ["calibrate"], ["report"]])
def test_help_works(capsys, sub: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["privacy", *sub, "--help"])
    assert info.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_bench_and_validate_small(capsys) -> None:
    code, p, _, _ = _run(capsys, "privacy", "bench", "--steps", "1000", "--dim", "2000", "--repeat", "2", "--json")
    assert code == 0 and p["rdp_epsilon_ms"] > 0 and p["orders"] == 345
    code, p, _, _ = _run(capsys, "privacy", "validate", "--samples", "3", "--mp-samples", "2", "--no-gaps", "--json")
    assert code == 0 and p["below_mpmath"] == 0 and p["max_rel_dev_mpmath"] < 1e-6 and p["max_rel_dev_opacus"] < 1e-5


# -- issue 9, items 4 and 5 -------------------------------------------------------------------------


def test_calibrate_meets_the_target_under_the_reported_accountant_and_says_which(capsys) -> None:
    argv = ["privacy", "calibrate", "--epsilon", "2", "--delta", "1e-5", "--q", "0.01", "--steps", "1000", "--json"]
    code, p, out, _ = _run(capsys, *argv)
    assert code == 0 and p["calibrated_against"] == "tightest" and p["accountant"] == "pld"
    assert 1.99 <= p["epsilon"] <= 2.0  # was 1.747: RDP-calibrated noise, PLD-reported epsilon
    assert "tightest of RDP, PLD and pure DP" in out
    code, q, out, _ = _run(capsys, *argv, "--no-pld")
    assert code == 0 and q["calibrated_against"] == "rdp" and 1.99 <= q["epsilon_rdp"] <= 2.0
    assert q["sigma"] > p["sigma"] and "(--no-pld)" in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--q", "0.01", "--sigma", "1", "--steps", "100", "--delta", "1"], "must lie in (0, 1); found 1"),
        (["--q", "0.01", "--sigma", "1", "--steps", "100", "--delta", "1.5"], "must lie in (0, 1); found 1.5"),
        (["--q", "0.01", "--sigma", "1", "--steps", "100", "--delta", "-0.1"], "must lie in (0, 1)"),
        (["--q", "0.01", "--sigma", "1", "--steps", "100", "--delta", "0"], "pure DP, which Gaussian noise never gives"),
        (["--mechanism", "laplace", "--epsilon0", "1", "--count", "3", "--delta", "1"], "must lie in (0, 1)"),
        (["--mechanism", "fel", "--sigma", "1", "--cluster", "0.1,5", "--delta", "0"], "pure DP"),
    ],
)
def test_account_refuses_a_delta_outside_the_open_unit_interval(capsys, argv: list[str], match: str) -> None:
    code, _, out, err = _run(capsys, "privacy", "account", *argv)
    assert code == 2 and match in err and "Traceback" not in err and out == ""


def test_calibrate_and_report_refuse_delta_one(capsys, tmp_path: Path) -> None:
    code, _, _, err = _run(capsys, "privacy", "calibrate", "--epsilon", "1", "--delta", "1", "--q", "0.1", "--steps", "3")
    assert code == 2 and "must lie in (0, 1)" in err
    code, _, _, err = _run(capsys, "privacy", "report", str(tmp_path), "--delta", "1")
    assert code == 2 and "must lie in (0, 1)" in err


def test_laplace_delta_zero_is_pure_dp_and_accepted(capsys) -> None:
    code, p, _, _ = _run(capsys, "privacy", "account", "--mechanism", "laplace", "--epsilon0", "0.5", "--count", "4",
                         "--delta", "0", "--json")
    assert code == 0 and p["epsilon"] == pytest.approx(2.0) and p["private"] is True


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--q", "0.01", "--sigma", "0", "--steps", "100", "--delta", "1e-5"], "--sigma 0 adds no noise"),
        (["--mechanism", "fel", "--sigma", "0", "--cluster", "0.1,5", "--delta", "1e-5"], "--sigma 0 adds no noise"),
        (["--mechanism", "fel", "--sigma", "1", "--cluster", "0.1,5", "--over-arch", "0.1,5,0", "--delta", "1e-5"],
         "SIGMA 0 adds no noise"),
    ],
)
def test_non_private_settings_are_reported_in_words(capsys, argv: list[str], words: str) -> None:
    code, p, out, err = _run(capsys, "privacy", "account", *argv, "--json")
    assert code == 0 and p["private"] is False and words in p["reason"] and p["epsilon"] == "inf"
    assert "NOT differentially private" in out and words in out
    assert "nan" not in out.splitlines()[0] and "order nan" not in out + err


def test_nothing_released_is_epsilon_zero_in_words(capsys) -> None:
    code, p, out, _ = _run(capsys, "privacy", "account", "--q", "0", "--sigma", "1", "--steps", "10", "--delta",
                           "1e-5", "--json")
    assert code == 0 and p["epsilon"] == 0 and p["private"] is True and "nothing is released" in out
