"""``secagg run --canaries K`` and ``secagg audit RUN_DIR`` (docs/audit.md) end to end on small synthetic data:
a DP run's bound stays below its ledger's epsilon, a mechanism that adds less noise than its ledger records is
caught, a run without DP reaches the largest bound its canaries allow, and the scores read only the views."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dp.audit import max_detectable
from experiments.cli import main
from experiments.run.canaries import CANARIES_JSON, SECRET_FILE, load_public, load_secret
from experiments.run.views import VIEWS_DIR

ROOT = Path(__file__).resolve().parents[2]
SMALL = """
[data]
synthetic_users = 30
synthetic_items = 40
synthetic_mean_interactions = 8
[eval]
negatives = 10
[audit]
canary_items = 2
"""
K = 32


def _run(tmp_path: Path, preset: str, name: str, *extra: str) -> Path:
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    out = tmp_path / name
    assert main(["run", preset, "--config", str(cfg), "--rounds", "1", "--canaries", str(K), "--out", str(out),
                 "--quiet", *extra]) == 0
    return out


def _audit(run_dir: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["audit", str(run_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((run_dir / "audit.json").read_text()) == out
    return out


def test_canaries_are_secret_fresh_and_drawn_half_in(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path, "fedmf-ldp", "ldp")
    pub, sec = load_public(run), load_secret(run)
    assert pub.included is None and len(pub.users) == K
    items = np.concatenate([pub.items_a.ravel(), pub.items_b.ravel()])
    assert len(np.unique(items)) == len(items)  # every canary item is its own
    assert 3 <= sec.included.sum() <= K - 3  # a fair coin per canary (fails with probability < 1e-6)
    assert (run / SECRET_FILE).stat().st_mode & 0o077 == 0
    assert "included" not in (run / CANARIES_JSON).read_text()
    (run / SECRET_FILE).write_text((run / SECRET_FILE).read_text().replace('"canaries_sha256": "', '"canaries_sha256": "0'))
    capsys.readouterr()
    assert main(["audit", str(run)]) == 2
    assert "belongs to another canaries.json" in capsys.readouterr().err


def test_a_dp_run_audits_below_its_ledger_epsilon(tmp_path: Path, capsys) -> None:
    out = _audit(_run(tmp_path, "fedmf-ldp", "ldp"), capsys)
    assert out["accounted"]["compared_epsilon"] == pytest.approx(1.0, rel=1e-3)  # one round of epsilon-1 LDP
    assert out["consistent"] and out["bound"]["epsilon"] <= 1.0 and out["verdict"].endswith(": consistent")
    assert out["bound"]["scored"] == K  # every canary uploaded a readable (noisy) update
    capsys.readouterr()
    assert main(["privacy", "report", str(tmp_path / "ldp"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["audit"]["consistent"] is True and report["audit"]["canaries"] == K


def test_a_mechanism_adding_less_noise_than_its_ledger_records_is_caught(tmp_path: Path, capsys, monkeypatch) -> None:
    """The broken-accountant fixture: FedMF's LDP noise 10^4 times smaller than the epsilon its ledger records."""
    import protocols.fedmf as fedmf

    real = fedmf.ldp_laplace
    monkeypatch.setattr(fedmf, "ldp_laplace", lambda v, *, clip_bound, epsilon, **kw: real(
        v, clip_bound=clip_bound, epsilon=epsilon * 1e4, **kw))
    out = _audit(_run(tmp_path, "fedmf-ldp", "broken"), capsys)
    assert out["accounted"]["compared_epsilon"] == pytest.approx(1.0, rel=1e-3)  # the ledger still says epsilon 1
    assert not out["consistent"] and out["bound"]["epsilon"] > 1.3
    assert "INCONSISTENT: the accountant under-reports" in out["verdict"]


def test_without_dp_the_bound_is_the_largest_the_canaries_allow(tmp_path: Path, capsys) -> None:
    out = _audit(_run(tmp_path, "fedavg-gmf", "plain"), capsys)
    assert out["accounted"]["compared_epsilon"] is None  # inf: strict JSON null
    assert out["bound"]["correct"] == out["bound"]["guesses"] == out["bound"]["scored"]
    assert out["bound"]["epsilon"] == pytest.approx(max_detectable(K, delta=1e-5), rel=1e-6)
    assert out["bound"]["epsilon"] == pytest.approx(out["max_detectable"]) and out["consistent"]


def _alone(tmp_path: Path) -> tuple[Path, Path]:
    run = _run(tmp_path, "fedavg-gmf", "plain")
    alone = tmp_path / "alone"
    shutil.copytree(run / VIEWS_DIR, alone / VIEWS_DIR)
    shutil.copy(run / CANARIES_JSON, alone / CANARIES_JSON)
    return run, alone


def test_the_scores_need_only_the_views_and_the_public_canary_list(tmp_path: Path) -> None:
    """The scorer runs on a copy holding views/ and canaries.json alone (no secret, data, checkpoint or
    ledger) and gives the audit's scores; its module never names the secret."""
    from attacks.canary import scorers_for
    from experiments.run.views import load_views
    from experiments.studies.audit import audit_run_dir

    run, alone = _alone(tmp_path)
    v = load_views(alone)
    s = scorers_for(v.protocol)[0]
    scores = s.score(v.view(s.view), v.last_public(), load_public(alone))
    assert scores.tolist() == audit_run_dir(run, write=False)["scores"]
    src = (ROOT / "attacks" / "canary.py").read_text()
    assert "audit-secret" not in src and "load_secret" not in src and "inclusion" not in src


@pytest.mark.slow
def test_the_scores_run_with_the_data_and_training_modules_unimportable(tmp_path: Path) -> None:
    """The same in a fresh process with the data and training modules unimportable."""
    run, alone = _alone(tmp_path)
    code = (
        "import sys, json\n"
        "for m in ('experiments.run.prepare', 'experiments.run.training', 'recmodels.loaders', 'recmodels.synthetic'):\n"
        "    sys.modules[m] = None\n"
        "from attacks.canary import scorers_for\n"
        "from experiments.run.canaries import load_public\n"
        "from experiments.run.views import load_views\n"
        f"v = load_views({str(alone)!r})\n"
        "s = scorers_for(v.protocol)[0]\n"
        f"print(json.dumps(s.score(v.view(s.view), v.last_public(), load_public({str(alone)!r})).tolist()))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    from experiments.studies.audit import audit_run_dir

    assert json.loads(res.stdout.strip().splitlines()[-1]) == audit_run_dir(run, write=False)["scores"]


def test_audit_errors_are_one_line(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    run = tmp_path / "nocanary"
    assert main(["run", "fedavg-gmf", "--config", str(cfg), "--rounds", "1", "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["audit", str(run)]) == 2
    err = capsys.readouterr().err
    assert "the run has no audit canaries (run it with --canaries K)" in err and len(err.strip().splitlines()) == 1
    assert main(["audit", str(tmp_path / "nowhere")]) == 2
    assert "is not a run directory (no config.toml)" in capsys.readouterr().err
    assert main(["run", "fedavg-gmf", "--canaries", "1"]) == 2
    assert "--canaries must be 0 or >= 2" in capsys.readouterr().err


def test_a_resumed_run_keeps_its_canaries_and_is_audited(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path, "fedavg-gmf", "plain")
    before = (run / CANARIES_JSON).read_text(), (run / SECRET_FILE).read_text()
    assert main(["run", "--resume", str(run), "--rounds", "2", "--quiet"]) == 0
    assert ((run / CANARIES_JSON).read_text(), (run / SECRET_FILE).read_text()) == before
    out = _audit(run, capsys)
    assert out["rounds"] == [0, 1] and out["bound"]["epsilon"] == pytest.approx(out["max_detectable"])
