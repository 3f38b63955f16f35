"""The durable privacy ledger: every application of a mechanism, committed per round (SQLite).

Usage by a federated runner (the contract)::

    ledger = PrivacyLedger(run_dir / "privacy_ledger.sqlite", budget=(8.0, 1e-5))
    start = ledger.next_round()                  # resume point: last committed round + 1
    for r in range(start, rounds):
        ledger.check_budget([planned_event])     # raises BudgetExceededError: the round does not run
        with ledger.round(r) as rnd:             # begin_round(r) ... commit_round(r)
            noisy = mechanism(...)
            rnd.record(event, who="server", what="leaf 3 aggregate", params={...}, cohort="leaf:3")
        release(noisy)                           # only AFTER the round is committed
    print(ledger.spent(1e-5).epsilon)

Rules that make a kill at any point safe:

* Entries of a round are buffered and written in ONE SQLite transaction together with the round
  row at :meth:`PrivacyLedger.commit_round` (``synchronous=FULL``). A process killed before the
  commit leaves no trace of that round; one killed after it leaves the whole round. There is never
  a partial round, so a resumed run neither loses nor double-counts a committed round.
* A runner must release (send, persist, publish) a round's outputs only after the commit. Then an
  uncommitted round released nothing and re-running it spends budget exactly once.
* Round numbers strictly increase: :meth:`begin_round` refuses a round at or below the last
  committed one (re-running a committed round would be a second release), with an error that
  names the resume point.
* Budget: :meth:`check_budget` (also run by ``begin_round(r, planned=...)``) refuses a round whose
  planned events would push epsilon past the budget, before it runs; :meth:`commit_round` always
  re-checks the events actually recorded, INSIDE the write transaction (``BEGIN IMMEDIATE``), and
  discards the round (nothing committed) if they exceed it. Both raise
  :class:`~dp.errors.BudgetExceededError` saying what the epsilon would have been. Because the
  commit-time check reads the committed rounds while holding SQLite's write lock, several handles
  on one ledger (threads or processes) can never together commit past the budget: the second
  committer waits for the lock (up to 30 s, then :class:`~dp.errors.LedgerError`) and is then
  checked against everything the first committed. The same transaction refuses a round at or
  below the last committed one. A planned check alone is advisory: another handle may commit in
  between.

Composition: entries without a ``cohort`` compose sequentially; entries with a cohort label are
parallel over cohorts (users in disjoint cohorts, e.g. FEL clusters, fixed for the whole run):
``total(alpha) = sum(common) + max_c sum(cohort c)``. Epsilon is the tightest of RDP, pure DP and
(for reports and at the budget edge) dp-accounting's PLD.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dp.accountant import PldAccountant, PrivacyReport, RdpAccountant, pure_epsilon
from dp.errors import BudgetExceededError, LedgerError, UnsupportedEventError
from dp.events import Composed, DpEvent, ParallelComposed, SelfComposed, event_from_dict, event_to_dict

__all__ = ["LedgerEntry", "PrivacyLedger", "RoundHandle"]

_SCHEMA_VERSION = "1"
#: Columns of each table and the SQLite storage types a valid row may hold in them.
_COLUMNS: dict[str, dict[str, tuple[str, ...]]] = {
    "meta": {"key": ("text",), "value": ("text",)},
    "rounds": {"round": ("integer",), "n_entries": ("integer",), "committed_at": ("real", "integer")},
    "entries": {"id": ("integer",), "round": ("integer",), "seq": ("integer",), "who": ("text",),
                "what": ("text",), "cohort": ("text", "null"), "event": ("text",), "params": ("text",),
                "recorded_at": ("real", "integer")},
}
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER PRIMARY KEY, n_entries INTEGER NOT NULL, committed_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    round INTEGER NOT NULL REFERENCES rounds(round),
    seq INTEGER NOT NULL,
    who TEXT NOT NULL, what TEXT NOT NULL, cohort TEXT,
    event TEXT NOT NULL, params TEXT NOT NULL, recorded_at REAL NOT NULL,
    UNIQUE (round, seq));
"""

#: Deepest JSON nesting a ledger row may hold (events nest 2 to 4 levels, params 1 or 2). Deeper
#: text is refused before parsing: Python's json recurses once per level, so 100,000 nested
#: lists in an edited row would escape as RecursionError.
_MAX_JSON_DEPTH = 64
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')  # strings (skipped whole) and brackets


def _loads(text: str) -> Any:
    """``json.loads`` after a depth scan (``dp`` imports nothing above it, so this is a twin of
    ``protocols.state.loads_json``). Raises ValueError when nested too deeply or not JSON."""
    if text.count("[") + text.count("{") > _MAX_JSON_DEPTH:
        depth = 0
        for match in _JSON_TOKENS.finditer(text):
            token = match.group()
            if token == "[" or token == "{":
                depth += 1
                if depth > _MAX_JSON_DEPTH:
                    raise ValueError(f"JSON nested deeper than {_MAX_JSON_DEPTH} levels")
            elif token == "]" or token == "}":
                depth -= 1
    return json.loads(text)


@dataclass(frozen=True)
class LedgerEntry:
    """One application of a mechanism (immutable; its meaning never changes)."""

    round: int
    seq: int
    who: str
    what: str
    cohort: str | None
    event: DpEvent
    params: dict[str, Any]
    recorded_at: float


def _check_budget_arg(budget: object) -> tuple[float, float] | None:
    if budget is None:
        return None
    if not isinstance(budget, (tuple, list)) or len(budget) != 2:
        raise ValueError(f"budget must be (epsilon, delta) or None. Found {budget!r}.")
    eps, delta = float(budget[0]), float(budget[1])
    if not (eps > 0 and math.isfinite(eps)) or not 0 <= delta < 1:
        raise ValueError(f"budget needs epsilon > 0 finite and 0 <= delta < 1. Found {budget!r}.")
    return eps, delta


def _parse_event(text: str, round_: int | None = None, seq: int | None = None, path: Path | None = None) -> DpEvent:
    """A stored event, or LedgerError (naming ``path`` when given) if the row was tampered with or corrupted."""
    try:
        return event_from_dict(_loads(text))
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        where = f" (round {round_}, seq {seq})" if round_ is not None else ""
        ledger = f"ledger {path}: " if path is not None else ""
        raise LedgerError(f"{ledger}corrupt ledger entry{where}: {exc}. The ledger file was modified outside "
                          "PrivacyLedger.") from exc


def _included(small: dict[str | None, Counter], big: dict[str | None, Counter]) -> bool:
    """Multiset inclusion per cohort (adding events never lowers epsilon)."""
    return all(n <= big.get(c, Counter()).get(ev, 0) for c, cnt in small.items() for ev, n in cnt.items())


def _add(a: dict[str | None, Counter], b: dict[str | None, Counter], m: int) -> dict[str | None, Counter]:
    out = {c: Counter(cnt) for c, cnt in a.items()}
    for c, cnt in b.items():
        for ev, n in cnt.items():
            out.setdefault(c, Counter())[ev] += n * m
    return out


class RoundHandle:
    """What :meth:`PrivacyLedger.round` yields: ``record(...)`` into the open round."""

    def __init__(self, ledger: "PrivacyLedger", round_: int) -> None:
        self._ledger, self.round = ledger, round_

    def record(self, event: DpEvent, *, who: str, what: str = "", params: dict[str, Any] | None = None,
               cohort: str | None = None) -> None:
        """Record one mechanism application in this round (see :meth:`PrivacyLedger.record`)."""
        self._ledger.record(event, who=who, what=what, params=params, cohort=cohort)


class PrivacyLedger:
    """Durable SQLite privacy ledger (see the module docstring for the contract).

    Args:
        path: the SQLite file (conventionally ``RUN_DIR/privacy_ledger.sqlite``); created if absent.
        budget: ``(epsilon, delta)`` to enforce, or None. Stored on creation; reopening with a
            different budget is refused (pass None to use the stored one).
        neighboring_relation: ``"add_remove"`` or ``"replace_one"`` (stored on creation).
        orders: RDP orders (default :func:`dp.rdp.default_orders`).
    """

    def __init__(self, path: str | Path, *, budget: tuple[float, float] | None = None,
                 neighboring_relation: str = "add_remove", orders: object = None) -> None:
        self.path = Path(path)
        budget = _check_budget_arg(budget)
        if self.path.is_dir():
            raise LedgerError(f"{self.path} is a directory, not a privacy ledger file.")
        self._db: sqlite3.Connection | None = None
        try:
            self._db = sqlite3.connect(str(self.path), isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if tables and not {"meta", "rounds", "entries"} <= tables:
                raise LedgerError(f"{self.path} is an SQLite file but not a privacy ledger (tables {sorted(tables, key=repr)}).")
            fresh = not tables
            self._db.executescript(_SCHEMA)
            if fresh:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("INSERT OR IGNORE INTO meta VALUES (?, ?)", [
                    ("version", _SCHEMA_VERSION),
                    ("budget", json.dumps(budget)),
                    ("neighboring_relation", neighboring_relation),
                ])
                self._db.execute("COMMIT")
            else:
                self._verify_file()
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        except LedgerError:
            self._db.close()
            raise
        except sqlite3.DatabaseError as exc:
            if self._db is not None:
                self._db.close()
            raise LedgerError(f"{self.path} is not a privacy ledger or is damaged (SQLite error: {exc}).") from exc
        if meta.get("version") != _SCHEMA_VERSION:
            self._db.close()
            raise LedgerError(f"ledger {self.path}: schema version {meta.get('version')!r} is not {_SCHEMA_VERSION!r}.")
        try:
            stored = _check_budget_arg(_loads(meta["budget"]))
            if meta["neighboring_relation"] not in ("add_remove", "replace_one"):
                raise ValueError(f"unknown neighbouring relation {meta['neighboring_relation']!r}")
        except (KeyError, ValueError, TypeError) as exc:
            self._db.close()
            raise LedgerError(f"ledger {self.path} has a damaged meta table ({type(exc).__name__}: {exc}); "
                              "it was modified outside PrivacyLedger.") from exc
        if budget is not None and stored != budget:
            raise LedgerError(f"ledger {self.path} was created with budget {stored}; got {budget}. "
                              "Pass budget=None to use the stored one, or start a new run directory.")
        if meta["neighboring_relation"] != neighboring_relation and neighboring_relation != "add_remove":
            raise LedgerError(f"ledger uses {meta['neighboring_relation']!r}; got {neighboring_relation!r}.")
        self.budget: tuple[float, float] | None = stored  # type: ignore[assignment]
        self.neighboring_relation = meta["neighboring_relation"]
        self._orders = orders
        self._rdp_acc = RdpAccountant(orders, neighboring_relation=self.neighboring_relation)
        self._curve_cache: dict[str, np.ndarray] = {}
        self._open: int | None = None
        self._pld_cleared: tuple[dict, float] | None = None
        self._pending: list[tuple[str, str, str | None, str, str, float]] = []

    def _verify_file(self) -> None:
        """Refuse a damaged or inconsistent ledger file before anything reads it.

        SQLite's ``quick_check`` (page-level damage), the exact columns of each table, the storage
        type of every column, and the per-round entry counts (an entry deleted or added outside
        :meth:`commit_round`, or an entry of a round that was never committed).
        """
        assert self._db is not None
        problems = [r[0] for r in self._db.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise LedgerError(f"ledger {self.path} is damaged (SQLite quick_check: {'; '.join(problems[:3])}).")
        for table, cols in _COLUMNS.items():
            found = tuple(r[1] for r in self._db.execute(f"PRAGMA table_info({table})"))
            if found != tuple(cols):
                raise LedgerError(f"ledger {self.path}: table {table} has columns {found}, expected {tuple(cols)}; "
                                  "it was modified outside PrivacyLedger.")
            typed = " OR ".join(f"typeof({c}) NOT IN ({', '.join(repr(t) for t in types)})" for c, types in cols.items())
            bad = self._db.execute(f"SELECT COUNT(*) FROM {table} WHERE {typed}").fetchone()[0]
            if bad:
                raise LedgerError(f"ledger {self.path}: {bad} row(s) of table {table} hold values of the wrong type; "
                                  "it was modified outside PrivacyLedger.")
        mismatch = self._db.execute(
            "SELECT r.round, r.n_entries, COUNT(e.id) FROM rounds r LEFT JOIN entries e ON e.round = r.round "
            "GROUP BY r.round HAVING COUNT(e.id) != r.n_entries LIMIT 1").fetchone()
        if mismatch:
            raise LedgerError(f"ledger {self.path}: round {mismatch[0]} was committed with {mismatch[1]} entries but "
                              f"holds {mismatch[2]}; entries were added or removed outside PrivacyLedger.")
        orphan = self._db.execute("SELECT MIN(round) FROM entries WHERE round NOT IN (SELECT round FROM rounds)").fetchone()[0]
        if orphan is not None:
            raise LedgerError(f"ledger {self.path}: entries of round {orphan}, which was never committed; "
                              "it was modified outside PrivacyLedger.")

    @contextmanager
    def _reading(self, doing: str) -> Iterator[None]:
        """Turn an SQLite error during ``doing`` into a LedgerError naming the file."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            raise LedgerError(f"ledger {self.path} could not be read while {doing} (SQLite error: {exc}); "
                              "the file is damaged or was modified outside PrivacyLedger.") from exc

    # ------------------------------------------------------------------ rounds
    def close(self) -> None:
        """Close the database (an open round is discarded, as after a kill)."""
        self._open, self._pending = None, []
        self._db.close()

    def __enter__(self) -> "PrivacyLedger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def committed_rounds(self) -> list[int]:
        """Round numbers committed so far, ascending."""
        with self._reading("listing rounds"):
            return [r[0] for r in self._db.execute("SELECT round FROM rounds ORDER BY round")]

    def next_round(self) -> int:
        """The round to resume from: last committed round + 1 (0 for a new ledger)."""
        with self._reading("finding the resume point"):
            row = self._db.execute("SELECT MAX(round) FROM rounds").fetchone()
        return 0 if row[0] is None else int(row[0]) + 1

    def begin_round(self, round_: int, *, planned: Sequence[DpEvent] = ()) -> None:
        """Open ``round_``; with ``planned`` events, refuse it up front if they would exceed the budget."""
        if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
            raise LedgerError(f"round must be a non-negative int. Found {round_!r}.")
        if self._open is not None:
            raise LedgerError(f"round {self._open} is still open; commit_round({self._open}) first.")
        nxt = self.next_round()
        if round_ < nxt:
            raise LedgerError(f"round {round_} is at or below the last committed round {nxt - 1}; "
                              f"resume from round {nxt} (a committed round is never re-run).")
        if planned:
            self.check_budget(planned)
        self._open, self._pending = round_, []

    def record(self, event: DpEvent, *, who: str, what: str = "", params: dict[str, Any] | None = None,
               cohort: str | None = None) -> None:
        """Buffer one mechanism application in the open round (durable at :meth:`commit_round`)."""
        if self._open is None:
            raise LedgerError("no open round: call begin_round(r) before record().")
        if not isinstance(event, DpEvent):
            raise TypeError(f"event must be a DpEvent. Found {type(event).__name__}.")
        if not isinstance(who, str) or not who:
            raise ValueError(f"who must be a non-empty string. Found {who!r}.")
        if cohort is not None and (not isinstance(cohort, str) or not cohort):
            raise ValueError(f"cohort must be None or a non-empty string. Found {cohort!r}.")
        ev = json.dumps(event_to_dict(event), sort_keys=True)
        self._curve(ev)  # validates support (and caches the curve) before anything is stored
        try:
            par = json.dumps(params or {}, sort_keys=True, allow_nan=False)
            _loads(par)  # what is stored must read back: nesting within _MAX_JSON_DEPTH
        except (TypeError, ValueError) as exc:
            raise ValueError(f"params must be JSON-serialisable finite values: {exc}.") from exc
        self._pending.append((who, str(what), cohort, ev, par, time.time()))

    def commit_round(self, round_: int) -> None:
        """Write the open round and all its entries in one transaction.

        Inside that transaction (``BEGIN IMMEDIATE``: SQLite's write lock is held from the first
        read), the recorded events are checked against the budget together with every round
        committed so far, by any handle, and the round number against the last committed one.

        Raises:
            BudgetExceededError: the recorded events would exceed the budget (the round is discarded).
            LedgerError: ``round_`` is not the open round, is at or below a round another handle
                committed meanwhile (discarded), or the ledger stayed locked by another writer.
        """
        if self._open is None or round_ != self._open:
            raise LedgerError(f"commit_round({round_}) but the open round is {self._open}.")
        pending = self._pending
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise LedgerError(
                f"cannot lock {self.path} to commit round {round_} ({exc}); another process holds "
                "the ledger's write lock. The round is still open: retry commit_round."
            ) from exc
        try:
            if self.budget is not None and pending:
                self.check_budget([], extra=pending)  # reads the committed rounds under the write lock
            with self._reading(f"committing round {round_}"):
                last = self._db.execute("SELECT MAX(round) FROM rounds").fetchone()[0]
            if last is not None and round_ <= last:
                raise LedgerError(
                    f"round {round_} is at or below round {last}, which another handle on this ledger "
                    f"committed meanwhile; the round was discarded (resume from round {last + 1})."
                )
            with self._reading(f"committing round {round_}"):
                self._db.execute("INSERT INTO rounds VALUES (?, ?, ?)", (round_, len(pending), time.time()))
                self._db.executemany(
                    "INSERT INTO entries (round, seq, who, what, cohort, event, params, recorded_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(round_, i, *p) for i, p in enumerate(pending)],
                )
                self._db.execute("COMMIT")
        except (BudgetExceededError, LedgerError):
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            self._open, self._pending = None, []
            raise
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._open, self._pending = None, []

    @contextmanager
    def round(self, round_: int, *, planned: Sequence[DpEvent] = ()) -> Iterator[RoundHandle]:
        """Context manager: ``begin_round`` on entry, ``commit_round`` on normal exit, discard on error."""
        self.begin_round(round_, planned=planned)
        try:
            yield RoundHandle(self, round_)
        except BaseException:
            self._open, self._pending = None, []
            raise
        self.commit_round(round_)

    # ------------------------------------------------------------------ reading
    def entries(self) -> list[LedgerEntry]:
        """Every committed entry, in order."""
        with self._reading("reading entries"):
            rows = self._db.execute(
                "SELECT round, seq, who, what, cohort, event, params, recorded_at FROM entries ORDER BY round, seq"
            ).fetchall()
        out = []
        for r in rows:
            try:
                params = _loads(r[6])
            except ValueError as exc:
                raise LedgerError(f"ledger {self.path}: entry (round {r[0]}, seq {r[1]}) has corrupt params: {exc}.") from exc
            out.append(LedgerEntry(r[0], r[1], r[2], r[3], r[4], _parse_event(r[5], r[0], r[1], self.path), params, r[7]))
        return out

    def _curve(self, event_json: str) -> np.ndarray:
        curve = self._curve_cache.get(event_json)
        if curve is None:
            curve = self._rdp_acc.rdp_of(_parse_event(event_json, path=self.path))
            self._curve_cache[event_json] = curve
        return curve

    def _groups(self, extra: Sequence[tuple] = (), upto: int | None = None) -> dict[str | None, Counter]:
        q = "SELECT cohort, event, COUNT(*) FROM entries"
        args: tuple = ()
        if upto is not None:
            q += " WHERE round <= ?"
            args = (upto,)
        groups: dict[str | None, Counter] = {}
        with self._reading("summing the spent budget"):
            rows = self._db.execute(q + " GROUP BY cohort, event", args).fetchall()
        for cohort, ev, n in rows:
            groups.setdefault(cohort, Counter())[ev] += n
        for p in extra:
            if isinstance(p, DpEvent):
                cohort, ev = None, json.dumps(event_to_dict(p), sort_keys=True)
            else:
                cohort, ev = p[2], p[3]
            groups.setdefault(cohort, Counter())[ev] += 1
        return groups

    def _total_curve(self, groups: dict[str | None, Counter]) -> np.ndarray:
        total = np.zeros(self._rdp_acc.orders.shape)
        cohort_max = np.zeros(total.shape)
        for cohort, counter in groups.items():
            curve = sum((self._curve(ev) * n for ev, n in counter.items()), np.zeros(total.shape))
            if cohort is None:
                total = total + curve
            else:
                cohort_max = np.maximum(cohort_max, curve)
        return total + cohort_max

    @staticmethod
    def _total_event(groups: dict[str | None, Counter]) -> DpEvent:
        def seq(counter: Counter) -> DpEvent:
            return Composed(tuple(SelfComposed(_parse_event(ev), n) for ev, n in sorted(counter.items())))
        common = [seq(c) for k, c in groups.items() if k is None]
        cohorts = [seq(c) for k, c in sorted((k, c) for k, c in groups.items() if k is not None)]
        parts = common + ([ParallelComposed(tuple(cohorts))] if cohorts else [])
        return Composed(tuple(parts))

    def _report(self, groups: dict[str | None, Counter], delta: float, use_pld: bool) -> PrivacyReport:
        orders = self._rdp_acc.orders
        from dp.rdp import epsilon_from_rdp

        notes: list[str] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eps_rdp, order = epsilon_from_rdp(orders=orders, rdp=self._total_curve(groups), delta=delta)
        notes.extend(str(w.message) for w in caught)
        event = self._total_event(groups)
        eps_pure = pure_epsilon(event)
        eps_pld = None
        if use_pld and delta > 0 and groups:
            try:
                eps_pld = PldAccountant(neighboring_relation=self.neighboring_relation).compose(event).get_epsilon(delta)
            except (UnsupportedEventError, ValueError, OverflowError, MemoryError) as exc:
                notes.append(f"PLD skipped: {exc}")
        cands = [("rdp", eps_rdp), ("pure", eps_pure)] + ([("pld", eps_pld)] if eps_pld is not None else [])
        name, eps = min(cands, key=lambda c: c[1])
        return PrivacyReport(float(eps), float(delta), name, float(eps_rdp), float(order), eps_pld, float(eps_pure),
                             self.neighboring_relation, tuple(notes))

    def spent(self, delta: float | None = None, *, use_pld: bool = True) -> PrivacyReport:
        """The budget spent by committed rounds at ``delta`` (default: the budget's delta)."""
        if delta is None:
            if self.budget is None:
                raise ValueError("spent() needs a delta when the ledger has no budget.")
            delta = self.budget[1]
        return self._report(self._groups(), delta, use_pld)

    def spent_by_cohort(self, delta: float, *, use_pld: bool = False) -> dict[str, PrivacyReport]:
        """Per cohort label: what a user in that cohort spent (its entries plus the common ones).

        The run's total (:meth:`spent`) is the worst of these when there are cohorts.
        """
        groups = self._groups()
        common = groups.get(None, Counter())
        return {
            c: self._report({None: common, c: g}, delta, use_pld)
            for c, g in sorted(groups.items(), key=lambda kv: str(kv[0]))
            if c is not None
        }

    def history(self, delta: float) -> list[tuple[int, float]]:
        """``(round, epsilon after that round)`` for every committed round (RDP and pure DP)."""
        out = []
        for r in self.committed_rounds():
            rep = self._report(self._groups(upto=r), delta, use_pld=False)
            out.append((r, rep.epsilon))
        return out

    def check_budget(self, next_events: Sequence[DpEvent], *, extra: Sequence[tuple] = ()) -> float:
        """Raise :class:`BudgetExceededError` if committed rounds plus ``next_events`` exceed the budget.

        Returns the epsilon after those events (0.0 budget check passes trivially without a budget).
        PLD is consulted only when RDP/pure say the budget would be exceeded.
        """
        for e in next_events:
            if not isinstance(e, DpEvent):
                raise TypeError(f"next_events must be DpEvents. Found {type(e).__name__}.")
        if self.budget is None:
            return 0.0
        eps_budget, delta = self.budget
        groups = self._groups(extra=list(extra) + list(next_events))
        rep = self._report(groups, delta, use_pld=False)
        if rep.epsilon > eps_budget and self._pld_cleared is not None and _included(groups, self._pld_cleared[0]):
            return self._pld_cleared[1]  # a superset of these events already passed PLD (monotone)
        if rep.epsilon > eps_budget:
            rep = self._report(groups, delta, use_pld=True)
            if rep.epsilon <= eps_budget:
                self._pld_cleared = (groups, rep.epsilon)
                # Gallop: clear a few more identical rounds at once so the next rounds skip PLD.
                step = self._groups(extra=list(extra) + list(next_events), upto=-1)
                for m in (64, 16, 4):
                    bigger = _add(groups, step, m)
                    probe = self._report(bigger, delta, use_pld=True)
                    if probe.epsilon <= eps_budget:
                        self._pld_cleared = (bigger, probe.epsilon)
                        break
        if rep.epsilon > eps_budget:
            raise BudgetExceededError(
                f"privacy budget exceeded: this round would bring epsilon to {rep.epsilon:.4g} "
                f"(accountant {rep.accountant}) at delta={delta:g}, above the budget epsilon={eps_budget:g}; "
                f"the round was not run. Spent so far: rounds {self.committed_rounds()[-1:] or 'none'} committed.",
                epsilon_after=rep.epsilon,
                budget=(eps_budget, delta),
            )
        return rep.epsilon
