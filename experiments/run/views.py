"""Recorded adversary views in a run directory: what each server role saw, round by round.

With ``[run] record_views = true`` (``secagg run --record-views``) the run keeps, for every
recorded round (round ``r`` with ``r % record_every == 0``, and the run's last round) and every
adversary role of its protocol (:attr:`protocols.registry.ProtocolSpec.adversaries`: ``"server"``;
STTFedRec's ``"rs"`` and ``"sas"``), every transcript record that role received or sent, payloads as
the transport recorded them, plus the protocol's ``public_info()``. Never a client's private state:
only what crossed the wire to (or from) that role. Layout::

    RUN_DIR/views/
      index.json                  format, protocol, roles, record_every, and per round: file,
                                  SHA-256, bytes, records per role, seconds spent recording
      round-000000.safetensors    one round (protocols.viewcodec: arrays + a typed JSON skeleton)

Crash safety, as the other run files: a round file is written to a temporary name and renamed,
then the index (also renamed into place) names it with its hash; a kill between the two leaves a
file the index does not name, which the next resume deletes. ``--resume`` cuts the index back to
the checkpoint's round (the rounds after it are trained, and recorded, again) and appends.
:func:`load_views` checks every file against the index's SHA-256 before decoding it.

Only the rounds recorded pay: in the other rounds the recorder's filter is false, so the
protocols skip their payload copies as in a run that records nothing.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.errors import UserError
from experiments.run.rundir import RunDir, atomic_write_bytes
from protocols.transport import Record

__all__ = ["INDEX", "INDEX_FORMAT", "VIEWS_DIR", "RecordedViews", "RoleFilter", "ViewRecorder", "has_views",
           "load_views", "views_summary"]

VIEWS_DIR = "views"
INDEX = "index.json"
INDEX_FORMAT = "secagg-fedrec-views-index/1"


class RoleFilter:
    """The transcript's ``keep_payloads`` while recording: true only in a recorded round, and then
    for the records an adversary role received or sent.

    Protocols test ``if keep_payloads:`` before copying a payload, so the rounds not recorded cost
    what they cost without recording.
    """

    def __init__(self, roles: Iterable[str]):
        self.roles = frozenset(roles)
        self.active = False

    def __bool__(self) -> bool:
        return self.active

    def __call__(self, record: Record) -> bool:
        return self.active and (record.receiver in self.roles or record.sender in self.roles)


def _file_name(round: int) -> str:
    return f"round-{round:06d}.safetensors"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ViewRecorder:
    """Writes the views of a run's recorded rounds into ``RUN_DIR/views`` (see the module docstring).

    Args:
        rd: the run directory.
        protocol: the run's protocol name (written in the index).
        roles: the adversary roles recorded.
        every: record round ``r`` when ``r % every == 0``.
        last_round: the run's last round (0-based), recorded too.
    """

    def __init__(self, rd: RunDir, protocol: str, roles: Sequence[str], every: int, last_round: int):
        if every < 1:
            raise ValueError(f"run.record_every must be >= 1; found {every}")
        self.rd, self.protocol, self.roles, self.every, self.last_round = rd, protocol, tuple(roles), every, last_round
        self.dir = rd.file(VIEWS_DIR)
        self.filter = RoleFilter(self.roles)
        self.index: dict[str, Any] = {"format": INDEX_FORMAT, "protocol": protocol, "roles": list(self.roles),
                                      "record_every": every, "rounds": []}

    # -- lifecycle ------------------------------------------------------------------------------
    def open(self, done_rounds: int) -> None:
        """Create ``views/`` or, on resume, cut the index back to the ``done_rounds`` rounds the
        checkpoint holds and delete every file the index no longer names."""
        self.dir.mkdir(exist_ok=True)
        path = self.dir / INDEX
        if path.exists():
            old = _read_index(self.dir)
            if old["protocol"] != self.protocol or old["roles"] != list(self.roles):
                raise UserError(f"{path} records protocol {old['protocol']!r} roles {old['roles']}; this run is "
                                f"{self.protocol!r} roles {list(self.roles)}")
            self.index["rounds"] = [e for e in old["rounds"] if e["round"] < done_rounds]
            self._write_index()
        named = {e["file"] for e in self.index["rounds"]}
        for f in self.dir.iterdir():
            if f.name != INDEX and f.name not in named:
                f.unlink()  # a round after the checkpoint, or a file written before a kill reached the index

    def wants(self, round: int) -> bool:
        return round % self.every == 0 or round == self.last_round

    def begin(self, round: int) -> None:
        """Before ``trainer.run_round()`` of ``round``: keep payloads if the round is recorded."""
        self.filter.active = self.wants(round)

    def end(self, round: int, records: Iterable[Record], public: dict[str, Any]) -> None:
        """After the round: write its views (if recorded) and stop keeping payloads."""
        if not self.filter.active:
            return
        self.filter.active = False
        from protocols.viewcodec import views_to_bytes

        t0 = time.perf_counter()
        mine = [r for r in records if r.round == round and (r.receiver in self.filter.roles or r.sender in self.filter.roles)]
        roles = {role: [i for i, r in enumerate(mine) if role in (r.receiver, r.sender)] for role in self.roles}
        data = views_to_bytes(mine, roles, round=round, public=public)
        name = _file_name(round)
        atomic_write_bytes(self.dir / name, data)
        entry = {"round": round, "file": name, "sha256": _sha256(data), "bytes": len(data),
                 "records": {role: len(idx) for role, idx in roles.items()},
                 "payloads": sum(r.payload is not None for r in mine),
                 "seconds": float(f"{time.perf_counter() - t0:.6f}")}
        self.index["rounds"] = [e for e in self.index["rounds"] if e["round"] != round] + [entry]
        self._write_index()

    def _write_index(self) -> None:
        from experiments import jsonio

        atomic_write_bytes(self.dir / INDEX, (jsonio.dumps(self.index, indent=1, sort_keys=True) + "\n").encode())

    def summary(self) -> dict[str, Any]:
        return views_summary(self.index)


def views_summary(index: dict[str, Any]) -> dict[str, Any]:
    """``{"dir", "rounds", "bytes", "seconds", "roles", "record_every"}`` of an index."""
    rounds = index["rounds"]
    return {"dir": VIEWS_DIR, "rounds": len(rounds), "bytes": int(sum(e["bytes"] for e in rounds)),
            "seconds": round(float(sum(e.get("seconds", 0.0) for e in rounds)), 3), "roles": list(index["roles"]),
            "record_every": index["record_every"]}


def _read_index(folder: Path) -> dict[str, Any]:
    from protocols.state import loads_json

    path = folder / INDEX
    try:
        index = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    ok = (isinstance(index, dict) and index.get("format") == INDEX_FORMAT and isinstance(index.get("protocol"), str)
          and isinstance(index.get("roles"), list) and all(isinstance(r, str) for r in index["roles"])
          and type(index.get("record_every")) is int and isinstance(index.get("rounds"), list))
    if not ok:
        raise UserError(f"{path} is not a {INDEX_FORMAT} index (edited or damaged)")
    seen = set()
    for e in index["rounds"]:
        good = (isinstance(e, dict) and type(e.get("round")) is int and e["round"] >= 0
                and e.get("file") == _file_name(e["round"]) and isinstance(e.get("sha256"), str)
                and type(e.get("bytes")) is int and e["round"] not in seen)
        if not good:
            raise UserError(f"{path}: a round entry is malformed ({str(e)[:80]}); the index was edited or damaged")
        seen.add(e["round"])
    return index


@dataclass
class RecordedViews:
    """The decoded views of a run directory.

    Attributes:
        protocol: the run's protocol.
        roles: the adversary roles recorded.
        record_every: the round sampling.
        rounds: the recorded rounds, ascending.
        views: role -> every record of that role's view over the recorded rounds, in order.
        public: ``public_info()`` after each recorded round, by round.
        index: the index as read.
    """

    protocol: str
    roles: tuple[str, ...]
    record_every: int
    rounds: list[int]
    views: dict[str, list[Record]] = field(default_factory=dict)
    public: dict[int, dict[str, Any]] = field(default_factory=dict)
    index: dict[str, Any] = field(default_factory=dict)

    def view(self, role: str, rounds: Iterable[int] | None = None) -> list[Record]:
        """``role``'s records, of ``rounds`` only if given."""
        recs = self.views.get(role, [])
        if rounds is None:
            return list(recs)
        keep = set(rounds)
        return [r for r in recs if r.round in keep]

    def last_public(self) -> dict[str, Any]:
        return self.public[self.rounds[-1]]


def has_views(run_dir: Path) -> bool:
    return (Path(run_dir) / VIEWS_DIR / INDEX).is_file()


def load_views(run_dir: Path, rounds: Iterable[int] | None = None) -> RecordedViews:
    """Read and verify ``RUN_DIR/views`` (every file against its SHA-256, then the strict decoder).

    Raises:
        UserError: no views recorded, a file missing, changed or not a view file.
    """
    from protocols.viewcodec import ViewFormatError, views_from_bytes

    folder = Path(run_dir) / VIEWS_DIR
    if not (folder / INDEX).is_file():
        raise UserError(f"{run_dir} holds no recorded views (run with --record-views, or [run] record_views = true)")
    index = _read_index(folder)
    want = None if rounds is None else set(rounds)
    out = RecordedViews(index["protocol"], tuple(index["roles"]), index["record_every"], [], index=index)
    for e in sorted(index["rounds"], key=lambda e: e["round"]):
        if want is not None and e["round"] not in want:
            continue
        path = folder / e["file"]
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
        if _sha256(data) != e["sha256"]:
            raise UserError(f"{path} does not match the SHA-256 its index recorded: the file was changed or damaged")
        try:
            rv = views_from_bytes(data)
        except ViewFormatError as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        if rv.round != e["round"]:
            raise UserError(f"{path} holds round {rv.round}, its index says {e['round']}")
        out.rounds.append(rv.round)
        out.public[rv.round] = dict(rv.public)
        for role in out.roles:
            out.views.setdefault(role, []).extend(rv.roles.get(role, ()))
    return out
