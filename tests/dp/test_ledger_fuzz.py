"""Fuzzing the ledger file: a corrupted privacy_ledger.sqlite raises LedgerError, nothing else.

The ledger sits in a run directory that a user (or a crash, or a disk) can damage. Opening it and
every read a run or ``secagg privacy report`` makes (resume point, entries, spent budget,
history) and the next commit must either work on an intact ledger or raise
:class:`~dp.errors.LedgerError` naming the file, never an ``sqlite3`` error, ``KeyError`` or
``json`` error. Inputs: random bytes, a real ledger with flipped bytes, truncated or extended,
and a well-formed SQLite file whose tables or rows were edited with SQL.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dp.errors import BudgetExceededError, LedgerError
from dp.events import Gaussian, Laplace, PoissonSampled
from dp.ledger import PrivacyLedger

FIXTURE_OK = [HealthCheck.function_scoped_fixture]
EV = PoissonSampled(0.1, Gaussian(1.5))
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def good_ledger(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("ledger") / "privacy_ledger.sqlite"
    with PrivacyLedger(path, budget=(50.0, 1e-5)) as ledger:
        for r in range(6):
            with ledger.round(r) as rnd:
                rnd.record(EV, who="server", what="aggregate", params={"clip": 1.0})
                rnd.record(Laplace(4.0), who="client 3", what="upload", cohort="c1")
    return path.read_bytes()


def _use(path: Path) -> None:
    """Everything a run and a report do with a ledger; LedgerError is the only allowed failure."""
    try:
        with PrivacyLedger(path) as ledger:
            nxt = ledger.next_round()
            ledger.committed_rounds()
            ledger.entries()
            delta = ledger.budget[1] if ledger.budget else 1e-5
            ledger.history(delta)
            ledger.spent(delta, use_pld=False)
            try:
                with ledger.round(nxt) as rnd:
                    rnd.record(EV, who="server")
            except BudgetExceededError:
                pass
    except LedgerError as exc:
        assert str(path) in str(exc) or "ledger" in str(exc).lower(), exc


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(content=st.binary(max_size=4096))
def test_random_bytes_raise_ledger_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "privacy_ledger.sqlite"
    path.write_bytes(content)
    _use(path)


@settings(max_examples=120, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data())
def test_corrupted_ledger_file_raises_only_ledger_error(tmp_path: Path, good_ledger: bytes, data) -> None:
    blob = bytearray(good_ledger)
    for _ in range(data.draw(st.integers(1, 6), label="edits")):
        op = data.draw(st.sampled_from(["flip", "zero-page", "truncate", "extend"]), label="op")
        pos = data.draw(st.integers(0, len(blob) - 1), label="pos")
        if op == "flip":
            blob[pos] ^= data.draw(st.integers(1, 255), label="mask")
        elif op == "zero-page":
            start = pos - pos % 4096
            blob[start : start + 4096] = bytes(len(blob[start : start + 4096]))
        elif op == "truncate":
            del blob[max(pos, 1) :]
        else:
            blob += data.draw(st.binary(min_size=1, max_size=5000), label="tail")
    path = tmp_path / "privacy_ledger.sqlite"
    path.write_bytes(bytes(blob))
    _use(path)


SQL_EDITS = {
    "meta-budget-deleted": "DELETE FROM meta WHERE key = 'budget'",
    "meta-budget-garbage": "UPDATE meta SET value = '{not json' WHERE key = 'budget'",
    "meta-budget-wrong-shape": "UPDATE meta SET value = '[1, 2, 3]' WHERE key = 'budget'",
    "meta-budget-strings": "UPDATE meta SET value = '[\"a\", \"b\"]' WHERE key = 'budget'",
    "meta-budget-negative": "UPDATE meta SET value = '[-1.0, 2.0]' WHERE key = 'budget'",
    "meta-relation-deleted": "DELETE FROM meta WHERE key = 'neighboring_relation'",
    "meta-relation-unknown": "UPDATE meta SET value = 'sideways' WHERE key = 'neighboring_relation'",
    "meta-version": "UPDATE meta SET value = '99' WHERE key = 'version'",
    "event-garbage": "UPDATE entries SET event = 'xx' WHERE seq = 0",
    "event-unknown-type": "UPDATE entries SET event = '{\"type\": \"Nope\"}' WHERE seq = 0",
    "event-bad-param": "UPDATE entries SET event = '{\"type\": \"Gaussian\", \"noise_multiplier\": -1}' WHERE seq = 0",
    "params-garbage": "UPDATE entries SET params = '{' WHERE seq = 0",
    "n-entries-text": "UPDATE rounds SET n_entries = 'two' WHERE round = 2",
    "entry-round-text": "UPDATE entries SET round = 'seven' WHERE seq = 0 AND round = 1",
    "entry-deleted": "DELETE FROM entries WHERE round = 3 AND seq = 1",
    "entries-dropped": "DROP TABLE entries",
    "entries-renamed-column": "ALTER TABLE entries RENAME COLUMN event TO evnt",
    "rounds-dropped": "DROP TABLE rounds",
    "meta-dropped": "DROP TABLE meta",
    "orphan-entry": "INSERT INTO entries (round, seq, who, what, cohort, event, params, recorded_at) "
                    "VALUES (99, 0, 'x', '', NULL, '{\"type\": \"NoOp\"}', '{}', 0)",
    "rounds-future": "INSERT INTO rounds VALUES (1000000000000, 0, 0)",
    "recorded-at-text": "UPDATE entries SET recorded_at = 'yesterday' WHERE seq = 0",
    # JSON nested past any event's depth (issue 23, item 9: these raised RecursionError)
    "params-deep": f"UPDATE entries SET params = '{DEEP}' WHERE seq = 0",
    "event-deep": f"UPDATE entries SET event = '{DEEP}' WHERE seq = 0",
    "event-deep-self-composed": "UPDATE entries SET event = '" + '{"type": "SelfComposed", "count": 2, "event": ' * 995
                                + '{"type": "Laplace", "noise_multiplier": 1.0}' + "}" * 995 + "' WHERE seq = 0",
    "meta-budget-deep": f"UPDATE meta SET value = '{DEEP}' WHERE key = 'budget'",
}


@pytest.mark.parametrize("edit", sorted(SQL_EDITS))
def test_edited_tables_raise_only_ledger_error(tmp_path: Path, good_ledger: bytes, edit: str) -> None:
    path = tmp_path / "privacy_ledger.sqlite"
    path.write_bytes(good_ledger)
    db = sqlite3.connect(path)
    db.execute(SQL_EDITS[edit])
    db.commit()
    db.close()
    _use(path)


def test_a_directory_in_place_of_the_file_raises_ledger_error(tmp_path: Path) -> None:
    path = tmp_path / "privacy_ledger.sqlite"
    path.mkdir()
    with pytest.raises(LedgerError):
        PrivacyLedger(path)


def test_intact_copy_still_works(tmp_path: Path, good_ledger: bytes) -> None:
    """The baseline of the fuzzing: the unmodified file opens and resumes at round 6."""
    path = tmp_path / "privacy_ledger.sqlite"
    path.write_bytes(good_ledger)
    with PrivacyLedger(path) as ledger:
        assert ledger.next_round() == 6 and len(ledger.entries()) == 12
    shutil.copy(path, tmp_path / "copy.sqlite")


@pytest.mark.parametrize(
    ("edit", "match"),
    [("entry-deleted", "committed with 2 entries but holds 1"), ("orphan-entry", "never committed"),
     ("n-entries-text", "wrong type"), ("meta-budget-deleted", "damaged meta"),
     ("entries-renamed-column", "has columns")],
)
def test_edits_that_would_change_the_spent_budget_are_detected_at_open(
    tmp_path: Path, good_ledger: bytes, edit: str, match: str
) -> None:
    """Deleting an entry used to lower the reported epsilon silently; deleting the budget made the
    ledger unusable with a KeyError. Both are now refused when the file is opened."""
    path = tmp_path / "privacy_ledger.sqlite"
    path.write_bytes(good_ledger)
    db = sqlite3.connect(path)
    db.execute(SQL_EDITS[edit])
    db.commit()
    db.close()
    with pytest.raises(LedgerError, match=match):
        PrivacyLedger(path)


def test_limit_deleting_a_whole_round_is_not_detected(tmp_path: Path, good_ledger: bytes) -> None:
    """Stated limit: the ledger has no signature. Removing a round's row and all its entries
    leaves a consistent file, and the reported epsilon drops; only who can write decides."""
    path = tmp_path / "privacy_ledger.sqlite"
    path.write_bytes(good_ledger)
    with PrivacyLedger(path) as ledger:
        before = ledger.spent(1e-5, use_pld=False).epsilon
    db = sqlite3.connect(path)
    db.execute("DELETE FROM entries WHERE round = 2")
    db.execute("DELETE FROM rounds WHERE round = 2")
    db.commit()
    db.close()
    with PrivacyLedger(path) as ledger:
        assert ledger.committed_rounds() == [0, 1, 3, 4, 5]
        assert ledger.spent(1e-5, use_pld=False).epsilon < before
