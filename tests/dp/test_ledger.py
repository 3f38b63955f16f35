"""The durable privacy ledger: atomic rounds, kill-and-resume, budget enforcement."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dp.accountant import RdpAccountant
from dp.errors import BudgetExceededError, LedgerError
from dp.events import Composed, Gaussian, Laplace, ParallelComposed, PoissonSampled, SelfComposed
from dp.ledger import PrivacyLedger

REPO = Path(__file__).resolve().parents[2]
EV = PoissonSampled(0.05, Gaussian(1.0))
LEAF = PoissonSampled(0.1, Gaussian(2.0))

CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    from dp.ledger import PrivacyLedger
    from dp.events import Gaussian, PoissonSampled
    path, last, stop_mid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ev, leaf = PoissonSampled(0.05, Gaussian(1.0)), PoissonSampled(0.1, Gaussian(2.0))
    ledger = PrivacyLedger(path)
    for r in range(ledger.next_round(), last + 1):
        ledger.begin_round(r)
        ledger.record(ev, who="server", what="global aggregate")
        ledger.record(leaf, who="server", what="leaf a", cohort="a")
        if r == stop_mid:
            print("MIDROUND", flush=True)
            time.sleep(600)
        ledger.record(leaf, who="server", what="leaf b", cohort="b")
        ledger.commit_round(r)
        print("COMMITTED", r, flush=True)
    """
)


def _expected_rdp_eps(rounds: int, delta: float = 1e-5) -> float:
    acc = RdpAccountant().compose(Composed((SelfComposed(EV, rounds), ParallelComposed((SelfComposed(LEAF, rounds),) * 2))))
    return acc.get_epsilon(delta)


def _child(tmp_path: Path) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    return script


def _run_child(script: Path, ledger: Path, last: int, stop_mid: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), str(ledger), str(last), str(stop_mid)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_kill_mid_round_then_resume_neither_loses_nor_double_counts(tmp_path: Path) -> None:
    path = tmp_path / "privacy_ledger.sqlite"
    script = _child(tmp_path)
    proc = _run_child(script, path, last=5, stop_mid=3)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("MIDROUND"):
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    with PrivacyLedger(path) as ledger:
        assert ledger.committed_rounds() == [0, 1, 2]  # round 3 left no trace
        assert len(ledger.entries()) == 9
        assert ledger.spent(1e-5, use_pld=False).epsilon_rdp == pytest.approx(_expected_rdp_eps(3), rel=1e-12)
    proc = _run_child(script, path, last=5, stop_mid=-1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.split()[:2] == ["COMMITTED", "3"]  # resumed exactly at the killed round
    with PrivacyLedger(path) as ledger:
        assert ledger.committed_rounds() == list(range(6))
        entries = ledger.entries()
        assert len(entries) == 18 and {e.cohort for e in entries} == {None, "a", "b"}
        assert ledger.spent(1e-5, use_pld=False).epsilon_rdp == pytest.approx(_expected_rdp_eps(6), rel=1e-12)


def test_kill_at_random_times_never_leaves_a_partial_round(tmp_path: Path) -> None:
    path = tmp_path / "privacy_ledger.sqlite"
    script = _child(tmp_path)
    for delay in (0.05, 0.13, 0.31):
        proc = _run_child(script, path, last=10_000, stop_mid=-1)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child committed at least one round; now kill it at an arbitrary point
        if not line.startswith("COMMITTED"):
            proc.kill()
            pytest.fail(f"child did not commit a round: {line!r} {proc.stderr.read()}")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with PrivacyLedger(path) as ledger:
            rounds = ledger.committed_rounds()
            assert rounds == list(range(len(rounds)))
            assert len(ledger.entries()) == 3 * len(rounds)
    with PrivacyLedger(path) as ledger:
        n = len(ledger.committed_rounds())
        assert n > 0
        assert ledger.spent(1e-5, use_pld=False).epsilon_rdp == pytest.approx(_expected_rdp_eps(n), rel=1e-12)


def test_budget_refuses_round_up_front_and_says_so(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path / "l.sqlite", budget=(1.0, 1e-5))
    r = 0
    with pytest.raises(BudgetExceededError, match="budget exceeded.*not run") as info:
        while True:
            with ledger.round(r, planned=[EV]) as rnd:
                rnd.record(EV, who="server", what="aggregate")
            r += 1
    assert info.value.epsilon_after > 1.0 and info.value.budget == (1.0, 1e-5)
    committed = ledger.committed_rounds()
    assert committed == list(range(r))
    spent = ledger.spent()
    assert spent.epsilon <= 1.0
    # the refused round did not run: nothing recorded, still refused on retry
    with pytest.raises(BudgetExceededError):
        ledger.begin_round(r, planned=[EV])
    assert ledger.committed_rounds() == committed


def test_commit_rechecks_recorded_events(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path / "l.sqlite", budget=(2.0, 1e-5))
    ledger.begin_round(0)  # nothing planned
    ledger.record(Laplace.from_epsilon(5.0), who="client:1", what="ldp upload")
    with pytest.raises(BudgetExceededError, match="epsilon to 5"):
        ledger.commit_round(0)
    assert ledger.committed_rounds() == []
    # the round was discarded; a fresh attempt of round 0 within budget commits
    with ledger.round(0) as rnd:
        rnd.record(Laplace.from_epsilon(1.0), who="client:1", what="ldp upload")
    assert 0.99 < ledger.spent().epsilon <= 1.0


def test_order_and_reopen_errors(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    ledger = PrivacyLedger(path, budget=(5.0, 1e-6))
    with pytest.raises(LedgerError, match="no open round"):
        ledger.record(EV, who="server")
    ledger.begin_round(0)
    with pytest.raises(LedgerError, match="still open"):
        ledger.begin_round(1)
    with pytest.raises(LedgerError, match="open round is 0"):
        ledger.commit_round(1)
    ledger.commit_round(0)
    with pytest.raises(LedgerError, match="resume from round 1"):
        ledger.begin_round(0)
    with pytest.raises(ValueError, match="JSON"):
        ledger.begin_round(1)
        ledger.record(EV, who="server", params={"x": math.nan})
    ledger.close()
    with pytest.raises(LedgerError, match="created with budget"):
        PrivacyLedger(path, budget=(1.0, 1e-6))
    reopened = PrivacyLedger(path)  # stored budget
    assert reopened.budget == (5.0, 1e-6) and reopened.next_round() == 1
    reopened.close()
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(LedgerError, match="not a privacy ledger"):
        PrivacyLedger(junk)


def test_error_inside_round_discards_it(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path / "l.sqlite")
    with pytest.raises(RuntimeError, match="boom"):
        with ledger.round(0) as rnd:
            rnd.record(EV, who="server")
            raise RuntimeError("boom")
    assert ledger.committed_rounds() == [] and ledger.next_round() == 0


def test_history_and_entries(tmp_path: Path) -> None:
    ledger = PrivacyLedger(tmp_path / "l.sqlite")
    for r in range(4):
        with ledger.round(r) as rnd:
            rnd.record(EV, who="server", what="aggregate", params={"clip": 1.0, "round": r})
    hist = ledger.history(1e-5)
    assert [h[0] for h in hist] == [0, 1, 2, 3]
    assert all(a[1] < b[1] for a, b in zip(hist, hist[1:]))
    e = ledger.entries()[2]
    assert (e.round, e.who, e.what, e.event, e.params) == (2, "server", "aggregate", EV, {"clip": 1.0, "round": 2})
    rep = ledger.spent(1e-5)
    assert rep.epsilon <= rep.epsilon_rdp and rep.accountant in {"rdp", "pld"}


def test_tampered_entry_is_rejected_with_a_typed_error(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "l.sqlite"
    with PrivacyLedger(path) as ledger:
        with ledger.round(0) as rnd:
            rnd.record(EV, who="server")
    db = sqlite3.connect(path)
    db.execute("""UPDATE entries SET event='{"type": "Gaussian", "noise_multiplier": "1e9"}'""")
    db.commit()
    db.close()
    with PrivacyLedger(path) as ledger:
        with pytest.raises(LedgerError, match="corrupt ledger entry"):
            ledger.entries()
        with pytest.raises(LedgerError, match="corrupt ledger entry"):
            ledger.spent(1e-5)
