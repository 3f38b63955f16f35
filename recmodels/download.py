"""Download and verify the official GroupLens MovieLens archives.

Checksum policy:

* ``ml-100k`` and ``ml-1m`` are frozen benchmark archives: their SHA-256 is pinned in
  :data:`PINNED_SHA256` (values published by several independent projects that pin the same
  official archives; they also match the MD5s GroupLens publishes beside each archive,
  :data:`PINNED_MD5`, which are checked too).
* ``ml-latest-small`` is re-issued by GroupLens from time to time, so it is verified against
  the checksum file GroupLens publishes beside it (``<url>.md5``, format
  ``MD5 (ml-latest-small.zip) = <hex>``; a 64-hex SHA-256 file is accepted as well). MD5 only
  detects corruption and mirror mistakes, not a malicious server: the published checksum comes
  from the same host as the archive.

The archive is streamed to a temporary file inside the data directory while its digests are
computed, verified, extracted into a temporary folder next to the target (member paths are
checked against zip-slip), and moved into place with one atomic rename. Any failure removes
the temporary files: nothing partial is ever left under ``DATA_DIR/<name>``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "DATASETS",
    "DEFAULT_BASE_URL",
    "PINNED_MD5",
    "PINNED_SHA256",
    "ChecksumError",
    "DownloadError",
    "DownloadResult",
    "default_data_dir",
    "download_dataset",
]

#: Official GroupLens location of the archives.
DEFAULT_BASE_URL = "https://files.grouplens.org/datasets/movielens"

#: Dataset name -> the interaction file inside the extracted folder.
DATASETS: dict[str, str] = {
    "ml-100k": "u.data",
    "ml-1m": "ratings.dat",
    "ml-latest-small": "ratings.csv",
}

#: SHA-256 of the frozen archives.
PINNED_SHA256: dict[str, str] = {
    "ml-100k": "50d2a982c66986937beb9ffb3aa76efe955bf3d5c6b761f4e3a7cd717c6a3229",
    "ml-1m": "a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20",
}

#: MD5 of the frozen archives as GroupLens publishes it in ``<url>.md5``.
PINNED_MD5: dict[str, str] = {
    "ml-100k": "0e33842e24a9c977be4e0107933c0723",
    "ml-1m": "c4d9eecfca2ab87c1945afe126590906",
}

_CHUNK = 1 << 16
_MAX_ARCHIVE_BYTES = 2 << 30
_MAX_CHECKSUM_BYTES = 4096


class DownloadError(RuntimeError):
    """The archive could not be fetched, verified or extracted (message says what to do)."""


class ChecksumError(DownloadError):
    """The downloaded archive does not match its pinned or published checksum."""


@dataclass(frozen=True)
class DownloadResult:
    """Outcome of :func:`download_dataset`.

    Attributes:
        name: dataset name.
        path: the extracted folder ``DATA_DIR/<name>``.
        ratings: the interaction file inside it.
        url: the archive URL.
        sha256: SHA-256 of the archive ("" when skipped because already present).
        verified_with: how the archive was verified (e.g. ``"pinned sha256+md5"``).
        skipped: True when the folder already existed and nothing was fetched.
        files: extracted file names relative to ``path``.
    """

    name: str
    path: Path
    ratings: Path
    url: str
    sha256: str
    verified_with: str
    skipped: bool
    files: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {
            "name": self.name,
            "path": str(self.path),
            "ratings": str(self.ratings),
            "url": self.url,
            "sha256": self.sha256,
            "verified_with": self.verified_with,
            "skipped": self.skipped,
            "files": list(self.files),
        }

    def message(self) -> str:
        """One human-readable line."""
        if self.skipped:
            return f"{self.name}: already present at {self.path} (use --force to re-download)"
        return (
            f"{self.name}: downloaded {self.url}, verified ({self.verified_with}), "
            f"extracted to {self.path}; use --data {self.ratings}"
        )


def default_data_dir() -> Path:
    """``$SECAGG_DATA_DIR`` if set, else ``~/.cache/secagg/datasets``."""
    env = os.environ.get("SECAGG_DATA_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "secagg" / "datasets"


def _offline_message(url: str, reason: object, name: str, target: Path) -> str:
    return (
        f"could not reach {url} ({reason}). To work offline, download {name}.zip elsewhere and "
        f"unzip it so that {target / DATASETS[name]} exists (the archive's top folder is "
        f"'{name}/'), or pass any local copy to `secagg run --data PATH`."
    )


def _open(url: str, timeout: float, name: str, target: Path) -> Any:
    try:
        return urllib.request.urlopen(url, timeout=timeout)  # noqa: S310 (https or test mirror)
    except urllib.error.HTTPError as exc:
        raise DownloadError(
            _offline_message(url, f"HTTP {exc.code} {exc.reason}; check --base-url", name, target)
        ) from exc
    except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DownloadError(_offline_message(url, reason, name, target)) from exc


def _fetch_published_checksum(url: str, timeout: float, name: str, target: Path) -> tuple[str, str]:
    """(algorithm, hex digest) from the checksum file GroupLens publishes beside the archive."""
    with _open(url + ".md5", timeout, name, target) as response:
        text = response.read(_MAX_CHECKSUM_BYTES).decode("ascii", errors="replace")
    match = re.search(r"\b([0-9a-fA-F]{64}|[0-9a-fA-F]{32})\b", text)
    if match is None:
        raise ChecksumError(
            f"{url}.md5 holds no MD5/SHA-256 digest (found {text[:80]!r}); cannot verify the archive."
        )
    digest = match.group(1).lower()
    return ("sha256" if len(digest) == 64 else "md5"), digest


def _stream(
    response: Any, out: IO[bytes], progress: IO[str] | None, label: str
) -> tuple[str, str, int]:
    sha256 = hashlib.sha256()
    md5 = hashlib.md5(usedforsecurity=False)
    total = 0
    length = response.headers.get("Content-Length")
    bar = None
    if progress is not None:
        from tqdm import tqdm

        bar = tqdm(
            total=int(length) if length and length.isdigit() else None,
            unit="B",
            unit_scale=True,
            desc=label,
            file=progress,
            leave=False,
        )
    try:
        while True:
            chunk = response.read(_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            if total > _MAX_ARCHIVE_BYTES:
                raise DownloadError(f"{label}: archive exceeds {_MAX_ARCHIVE_BYTES} bytes; refusing.")
            sha256.update(chunk)
            md5.update(chunk)
            out.write(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return sha256.hexdigest(), md5.hexdigest(), total


def _safe_extract(archive: Path, into: Path, name: str) -> tuple[str, ...]:
    """Extract ``archive`` into ``into`` after checking every member stays under ``name/``."""
    try:
        with zipfile.ZipFile(archive) as zf:
            members = zf.infolist()
            for info in members:
                parts = Path(info.filename).parts
                if (
                    info.filename.startswith(("/", "\\"))
                    or ".." in parts
                    or not parts
                    or parts[0] != name
                    or ":" in parts[0]
                ):
                    raise DownloadError(
                        f"archive member {info.filename!r} is outside '{name}/'; refusing to extract."
                    )
            zf.extractall(into)
            return tuple(
                sorted(str(Path(i.filename).relative_to(name)) for i in members if not i.is_dir())
            )
    except zipfile.BadZipFile as exc:
        raise DownloadError(f"{archive.name} is not a valid zip archive ({exc}).") from exc


def download_dataset(
    name: str,
    *,
    data_dir: Path | str | None = None,
    base_url: str | None = None,
    force: bool = False,
    progress: IO[str] | None = None,
    timeout: float = 30.0,
    expected_sha256: str | None = None,
) -> DownloadResult:
    """Fetch, verify and extract a MovieLens archive into ``data_dir/<name>``.

    Args:
        name: ``"ml-100k"``, ``"ml-1m"`` or ``"ml-latest-small"``.
        data_dir: target folder (default :func:`default_data_dir`).
        base_url: mirror serving ``<name>.zip`` (and ``<name>.zip.md5``); default GroupLens.
        force: re-download even if ``data_dir/<name>`` already holds the interaction file.
        progress: stream for a progress bar (e.g. ``sys.stderr``), or None for silence.
        timeout: socket timeout in seconds.
        expected_sha256: override of the pinned SHA-256 (for mirrors of re-packed archives
            and for tests); when given, it is the only check.

    Returns:
        A :class:`DownloadResult`.

    Raises:
        DownloadError: unknown name, unreachable URL (the message says where to place the files
            by hand), bad archive. :class:`ChecksumError` on a checksum mismatch.
    """
    if name not in DATASETS:
        raise DownloadError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}.")
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    target = root / name
    ratings = target / DATASETS[name]
    url = f"{(base_url or DEFAULT_BASE_URL).rstrip('/')}/{name}.zip"
    if ratings.is_file() and not force:
        return DownloadResult(name, target, ratings, url, "", "already present", True)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(f"cannot create the data directory {root} ({exc}); pass --data-dir.") from exc

    if expected_sha256 is not None:
        checks = {"sha256": expected_sha256.lower()}
        verified_with = "given sha256"
    elif name in PINNED_SHA256:
        checks = {"sha256": PINNED_SHA256[name], "md5": PINNED_MD5[name]}
        verified_with = "pinned sha256+md5"
    else:
        algorithm, digest = _fetch_published_checksum(url, timeout, name, target)
        checks = {algorithm: digest}
        verified_with = f"published {algorithm} ({url}.md5)"

    tmp_zip = None
    tmp_dir = None
    try:
        with _open(url, timeout, name, target) as response:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{name}-", suffix=".zip.part", dir=root)
            tmp_zip = Path(tmp_name)
            with os.fdopen(fd, "wb") as out:
                try:
                    sha256, md5, size = _stream(response, out, progress, f"{name}.zip")
                except (OSError, socket.timeout) as exc:
                    raise DownloadError(
                        _offline_message(url, f"connection lost: {exc}", name, target)
                    ) from exc
        found = {"sha256": sha256, "md5": md5}
        for algorithm, expected in checks.items():
            if found[algorithm] != expected:
                raise ChecksumError(
                    f"{url}: {algorithm} mismatch (expected {expected}, got {found[algorithm]}, "
                    f"{size} bytes); the download is corrupt or the mirror serves a different "
                    "archive. Nothing was written; retry, or check --base-url."
                )
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{name}-extract-", dir=root))
        files = _safe_extract(tmp_zip, tmp_dir, name)
        if DATASETS[name] not in files:
            raise DownloadError(f"{url} holds no {name}/{DATASETS[name]}; wrong archive.")
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{name}-old-", dir=root))
            os.replace(target, old / name)
            os.replace(tmp_dir / name, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp_dir / name, target)
        return DownloadResult(name, target, ratings, url, sha256, verified_with, False, files)
    finally:
        if tmp_zip is not None:
            tmp_zip.unlink(missing_ok=True)
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)
