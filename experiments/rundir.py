"""The run directory: everything one ``secagg run`` produces, written atomically.

Layout::

    RUN_DIR/
      config.toml        resolved configuration (what --resume reads back)
      metrics.jsonl      one JSON object per evaluation (round, sampled metrics, loss, seconds)
      costs.jsonl        one JSON object per round (messages, bytes up/down, bytes per client)
      transcript.csv     bytes sent and received by every party in every round (federated runs)
      checkpoint.pt      latest state (model, optimiser, RNG, history); --resume continues from it
      summary.json       final metrics (sampled and full ranking), protocol, costs, versions, seed
      metrics.png        metrics against rounds

Every file is written to a temporary name in the same directory and renamed into place
(``os.replace``), so a crash never leaves a half-written file, and a checkpoint always matches
the metrics and costs files written with it.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from experiments.errors import UserError

__all__ = ["RunDir", "atomic_write_bytes", "atomic_write_text", "default_run_dir"]


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
        return cls(path)

    def file(self, name: str) -> Path:
        return self.path / name

    def write_text(self, name: str, text: str) -> None:
        atomic_write_text(self.file(name), text)

    def write_json(self, name: str, obj: Any) -> None:
        self.write_text(name, json.dumps(obj, indent=2, sort_keys=True) + "\n")

    def write_jsonl(self, name: str, rows: list[dict[str, Any]]) -> None:
        self.write_text(name, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(self.file("checkpoint.pt"), buf.getvalue())

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.file("checkpoint.pt")
        if not path.exists():
            return None
        try:
            return torch.load(path, weights_only=False)
        except Exception as exc:  # a corrupt checkpoint is a user-facing problem, not a crash
            raise UserError(f"cannot read checkpoint {path}: {exc}") from None
