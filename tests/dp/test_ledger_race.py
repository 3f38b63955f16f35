"""Two processes spending from one privacy ledger can never commit past its budget.

Issue 8, item 4: the budget check ran before the write transaction (and was skipped at commit
when the round's events had been planned), so two handles on one ledger could both pass it and
both commit. Each test starts two real processes on one SQLite file, holds both at a file
barrier placed where the race window was, and then lets them commit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from dp.events import Gaussian
from dp.ledger import PrivacyLedger

REPO = Path(__file__).resolve().parents[2]
#: One Gaussian(1.0) release costs epsilon ~4.8 at delta 1e-5 and two cost ~6.9: a budget of 6
#: admits exactly one of the two processes' rounds.
BUDGET = (6.0, 1e-5)

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from dp.errors import BudgetExceededError, LedgerError
    from dp.events import Gaussian
    from dp.ledger import PrivacyLedger

    path, me, sync, mode = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]

    def barrier(timeout):
        (sync / f"ready{{me}}").touch()
        end = time.monotonic() + timeout
        while not all((sync / f"ready{{i}}").exists() for i in (0, 1)):
            if time.monotonic() > end:
                return  # the other process is blocked (e.g. waiting for the write lock): go on
            time.sleep(0.01)

    ev = Gaussian(1.0)
    ledger = PrivacyLedger(path)
    if mode == "window":
        # Stop inside every budget check, after it has read the committed rounds: the point
        # where a check outside the write transaction lets the other process slip in.
        original = PrivacyLedger.check_budget
        def held(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            barrier(2.0)
            return out
        PrivacyLedger.check_budget = held
    ledger.begin_round(me, planned=[ev] if mode == "planned" else [])
    ledger.record(ev, who=f"process {{me}}", what="aggregate")
    if mode == "planned":
        barrier(60.0)  # both rounds planned and checked against an empty ledger
    try:
        ledger.commit_round(me)
        outcome = "committed"
    except BudgetExceededError as exc:
        outcome = "budget"
    print(json.dumps({{"outcome": outcome}}), flush=True)
    """
)


def _race(tmp_path: Path, mode: str) -> list[str]:
    path = tmp_path / "privacy_ledger.sqlite"
    PrivacyLedger(path, budget=BUDGET).close()
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [
        subprocess.Popen([sys.executable, str(script), str(path), str(me), str(sync), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for me in (0, 1)
    ]
    outcomes = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1])["outcome"])
    return sorted(outcomes)


def _assert_within_budget(tmp_path: Path) -> None:
    with PrivacyLedger(tmp_path / "privacy_ledger.sqlite") as ledger:
        assert len(ledger.committed_rounds()) == 1, ledger.committed_rounds()
        assert ledger.spent().epsilon <= BUDGET[0]


def test_budget_fits_one_round_but_not_two() -> None:
    """The premise of the race tests, checked with the accountant itself."""
    from dp.accountant import best_epsilon
    from dp.events import SelfComposed

    one = best_epsilon(Gaussian(1.0), BUDGET[1]).epsilon
    two = best_epsilon(SelfComposed(Gaussian(1.0), 2), BUDGET[1]).epsilon
    assert one <= BUDGET[0] < two


def test_two_processes_with_planned_rounds_cannot_both_commit(tmp_path: Path) -> None:
    """Both plan a round against the empty ledger (each fits), then both commit."""
    assert _race(tmp_path, "planned") == ["budget", "committed"]
    _assert_within_budget(tmp_path)


def test_two_processes_racing_the_check_cannot_both_commit(tmp_path: Path) -> None:
    """Both are held just after reading the ledger in their commit-time budget check."""
    assert _race(tmp_path, "window") == ["budget", "committed"]
    _assert_within_budget(tmp_path)


def test_two_handles_committing_the_same_round_get_a_typed_error(tmp_path: Path) -> None:
    """The round-order rule holds across handles too (it raised sqlite3.IntegrityError before)."""
    import pytest

    from dp.errors import LedgerError

    path = tmp_path / "privacy_ledger.sqlite"
    with PrivacyLedger(path, budget=(100.0, 1e-5)) as a, PrivacyLedger(path) as b:
        a.begin_round(0)
        b.begin_round(0)
        a.record(Gaussian(2.0), who="a")
        b.record(Gaussian(2.0), who="b")
        a.commit_round(0)
        with pytest.raises(LedgerError, match=r"another handle .*resume from round 1"):
            b.commit_round(0)
        b.begin_round(1)  # the discarded round left b usable
        b.record(Gaussian(2.0), who="b")
        b.commit_round(1)
        assert a.committed_rounds() == [0, 1] and len(a.entries()) == 2
