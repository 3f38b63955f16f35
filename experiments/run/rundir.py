"""The run directory: everything one ``secagg run`` produces, and how it survives crashes.

Layout::

    RUN_DIR/
      run.json                 identity: preset, run id, the resolved configuration and the data
                               files' SHA-256, as created (what --resume verifies against)
      config.toml              resolved configuration (what --resume reads back; only run.rounds
                               may differ from run.json)
      run.lock                 held (flock) by the process writing the directory; names its pid
      metrics.jsonl            one JSON object per round (loss, seconds; metrics at evaluations)
      costs.jsonl              one JSON object per round (messages, bytes, seconds per party)
      transcript.csv           bytes sent and received by every party in every round
      privacy_ledger.sqlite    every release of the run, committed before anything is published
      checkpoint.safetensors   latest model state: tensors plus JSON, never a pickle
      summary.json             final metrics, privacy, costs, versions, seed
      metrics.png              metrics against rounds

Per-round files are appended (and fsynced) once per round, so a long run costs the same per
round at round 10 as at round 10,000; whole files (config, run.json, checkpoint, summary, plot)
are written to a temporary name and renamed into place. A crash can leave the appended files
ahead of the checkpoint or with a torn last line: :meth:`RunDir.truncate_after` repairs both on
resume, so the files always match the checkpoint they continue from.

Every JSON file is strict JSON (:mod:`experiments.jsonio`: ``null`` where a value is NaN or
infinite); files written before that, with bare ``NaN``, are still read.

Everything read back is user-editable, so it is parsed as hostile: JSON nested deeper than
:data:`protocols.state.MAX_DEPTH` (64) levels is refused before parsing, and a file or line the run
never wrote stops ``--resume`` with a :class:`~experiments.errors.UserError` that names it.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments import jsonio
from experiments.errors import UserError
from protocols.state import StateError, loads_json, state_from_bytes, state_to_bytes

__all__ = ["CHECKPOINT", "RunDir", "atomic_write_bytes", "atomic_write_text", "default_run_dir"]

CHECKPOINT = "checkpoint.safetensors"
_LEGACY_CHECKPOINT = "checkpoint.pt"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and an atomic rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def default_run_dir(preset: str) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path("runs") / f"{preset}-{stamp}"


class RunDir:
    """A run directory being written (``create``) or resumed (``open_existing``)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock_fd: int | None = None

    @classmethod
    def create(cls, path: Path) -> RunDir:
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise UserError(
                f"run directory {path} already exists and is not empty; choose another --out, "
                f"or continue it with --resume {path}"
            )
        path.mkdir(parents=True, exist_ok=True)
        return cls(path)

    @classmethod
    def open_existing(cls, path: Path) -> RunDir:
        path = Path(path)
        if not (path / "config.toml").is_file():
            raise UserError(f"cannot resume {path}: no config.toml there (is it a run directory?)")
        if not (path / "run.json").is_file():
            raise UserError(f"cannot resume {path}: run.json is missing, so nothing can be verified")
        return cls(path)

    def file(self, name: str) -> Path:
        return self.path / name

    # -- the lock ------------------------------------------------------------------------------
    def lock(self) -> None:
        """Hold an exclusive lock on ``run.lock`` for the life of the process.

        The kernel releases an ``flock`` when its process dies, so a crashed run never leaves
        the directory locked. A second process gets a :class:`UserError` naming the holder.
        """
        path = self.file("run.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            holder = path.read_text().strip() or "unknown"
            raise UserError(
                f"run directory {self.path} is in use by another process (pid {holder}); "
                "wait for it to finish or stop it before resuming"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- whole files ---------------------------------------------------------------------------
    def write_text(self, name: str, text: str) -> None:
        atomic_write_text(self.file(name), text)

    def write_json(self, name: str, obj: Any) -> None:
        self.write_text(name, jsonio.dumps(obj, indent=2, sort_keys=True) + "\n")

    def read_json(self, name: str) -> dict[str, Any]:
        """The JSON object in ``name``; anything else (not JSON, not an object, nested deeper than
        :data:`protocols.state.MAX_DEPTH` levels) is a :class:`UserError` naming the file."""
        try:
            obj = loads_json(self.file(name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {self.file(name)}: {exc}") from None
        if not isinstance(obj, dict):
            raise UserError(f"cannot read {self.file(name)}: expected a JSON object, found {type(obj).__name__}")
        return obj

    # -- appended per-round files -------------------------------------------------------------
    def append(self, name: str, text: str) -> None:
        """Append ``text`` (whole lines) to ``name`` and fsync it."""
        with open(self.file(name), "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    def append_jsonl(self, name: str, row: dict[str, Any]) -> None:
        self.append(name, jsonio.dumps(row, sort_keys=True) + "\n")

    def read_jsonl(self, name: str) -> list[dict[str, Any]]:
        """The complete rows of ``name`` (a torn last line is ignored; see :meth:`truncate_after`)."""
        path = self.file(name)
        if not path.exists():
            return []
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        rows = []
        for line in text.split("\n"):
            try:
                row = loads_json(line)
            except ValueError:
                continue  # the empty tail or a torn line (resume refuses other bad lines: truncate_after)
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def truncate_after(self, name: str, keep: Callable[[str], bool], header: str | None = None) -> int:
        """Keep the complete lines of ``name`` for which ``keep(line)`` holds; returns how many.

        Drops a torn last line (no newline) and every line past the checkpoint the run
        continues from, so a resumed run appends exactly where the checkpoint left off. A
        ``ValueError`` from ``keep`` (a line the run never wrote) becomes a :class:`UserError`
        naming the file and the 1-based line, and the file is left as it was.
        """
        path = self.file(name)
        if not path.exists():
            return 0
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        lines = text.split("\n")[:-1]  # the part after the last newline is torn or empty
        skip = 1 if header is not None and lines and lines[0] == header else 0
        kept = []
        for number, ln in enumerate(lines[skip:], start=skip + 1):
            try:
                if ln and keep(ln):
                    kept.append(ln)
            except ValueError as exc:
                raise UserError(f"{path} line {number}: {exc}; the file was edited or damaged, so the run cannot "
                                "be continued") from None
        out = ([header] if header is not None else []) + kept
        new = "".join(ln + "\n" for ln in out)
        if new != text:
            atomic_write_text(path, new)
        return len(kept)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, state: dict[str, Any]) -> None:
        atomic_write_bytes(self.file(CHECKPOINT), state_to_bytes(state))

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The saved state, or ``None`` if there is none. Never unpickles anything."""
        path = self.file(CHECKPOINT)
        if not path.exists():
            if self.file(_LEGACY_CHECKPOINT).exists():
                raise UserError(
                    f"{self.path} holds a pickled {_LEGACY_CHECKPOINT} from an older version; pickles are never "
                    "loaded (a tampered file would run code). Start a new run directory."
                )
            return None
        try:
            return state_from_bytes(path.read_bytes())
        except StateError as exc:
            raise UserError(f"cannot read checkpoint {path}: {exc}") from None
