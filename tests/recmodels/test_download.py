"""Tests of recmodels.download against an HTTP server on 127.0.0.1 (no internet needed)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import socket
import threading
import zipfile
from pathlib import Path

import pytest

from recmodels.download import (
    PINNED_MD5,
    PINNED_SHA256,
    ChecksumError,
    DownloadError,
    default_data_dir,
    download_dataset,
)
from recmodels.loaders import load_interactions

RATINGS_CSV = "userId,movieId,rating,timestamp\n1,10,4.0,100\n1,20,3.5,200\n2,10,5.0,150\n2,30,1.0,160\n"


def build_zip(name: str, members: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for member, text in members.items():
            zf.writestr(member, text)
    return buf.getvalue()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # keep test output clean
        pass


@pytest.fixture()
def server(tmp_path):
    """Serve tmp_path/www on 127.0.0.1 in a thread; yields (base_url, www dir)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(_Quiet, directory=str(www))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", www
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def publish(www: Path, name: str, payload: bytes, md5: str | None = None) -> None:
    (www / f"{name}.zip").write_bytes(payload)
    digest = md5 if md5 is not None else hashlib.md5(payload).hexdigest()
    (www / f"{name}.zip.md5").write_text(f"MD5 ({name}.zip) = {digest}\n")


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_download_verify_extract_and_load(server, tmp_path):
    base, www = server
    payload = build_zip("ml-latest-small", {"ml-latest-small/ratings.csv": RATINGS_CSV,
                                            "ml-latest-small/README.txt": "x"})
    publish(www, "ml-latest-small", payload)
    root = tmp_path / "data"
    result = download_dataset("ml-latest-small", data_dir=root, base_url=base)
    assert not result.skipped
    assert result.sha256 == hashlib.sha256(payload).hexdigest()
    assert result.verified_with.startswith("published md5")
    assert result.files == ("README.txt", "ratings.csv")
    assert leftovers(root) == ["ml-latest-small"]  # no temp files left behind
    data = load_interactions(result.ratings)
    assert (data.n_users, data.n_items, len(data)) == (2, 3, 4)
    # Loading the data dir itself finds the extracted file.
    assert len(load_interactions(root)) == 4
    again = download_dataset("ml-latest-small", data_dir=root, base_url=base)
    assert again.skipped


def test_published_sha256_file_is_accepted(server, tmp_path):
    base, www = server
    payload = build_zip("ml-latest-small", {"ml-latest-small/ratings.csv": RATINGS_CSV})
    (www / "ml-latest-small.zip").write_bytes(payload)
    (www / "ml-latest-small.zip.md5").write_text(hashlib.sha256(payload).hexdigest() + "  ml-latest-small.zip\n")
    result = download_dataset("ml-latest-small", data_dir=tmp_path / "d", base_url=base)
    assert result.verified_with.startswith("published sha256")


def test_checksum_mismatch_writes_nothing(server, tmp_path):
    base, www = server
    payload = build_zip("ml-latest-small", {"ml-latest-small/ratings.csv": RATINGS_CSV})
    publish(www, "ml-latest-small", payload, md5="0" * 32)
    root = tmp_path / "data"
    with pytest.raises(ChecksumError, match="md5 mismatch"):
        download_dataset("ml-latest-small", data_dir=root, base_url=base)
    assert leftovers(root) == []


def test_pinned_checksum_rejects_a_different_archive(server, tmp_path):
    base, www = server
    payload = build_zip("ml-100k", {"ml-100k/u.data": "1\t2\t3\t4\n"})
    (www / "ml-100k.zip").write_bytes(payload)  # no .md5 needed: the checksum is pinned
    root = tmp_path / "data"
    with pytest.raises(ChecksumError, match=PINNED_SHA256["ml-100k"]):
        download_dataset("ml-100k", data_dir=root, base_url=base)
    assert leftovers(root) == []
    # With the digest given explicitly (mirror of a re-packed archive) the same bytes pass.
    ok = download_dataset(
        "ml-100k", data_dir=root, base_url=base, expected_sha256=hashlib.sha256(payload).hexdigest()
    )
    assert ok.ratings.read_text() == "1\t2\t3\t4\n"


def test_force_replaces_existing_folder_atomically(server, tmp_path):
    base, www = server
    root = tmp_path / "data"
    publish(www, "ml-latest-small", build_zip("ml-latest-small", {"ml-latest-small/ratings.csv": RATINGS_CSV}))
    download_dataset("ml-latest-small", data_dir=root, base_url=base)
    (root / "ml-latest-small" / "stale.txt").write_text("old")
    download_dataset("ml-latest-small", data_dir=root, base_url=base, force=True)
    assert not (root / "ml-latest-small" / "stale.txt").exists()
    assert leftovers(root) == ["ml-latest-small"]


def test_zip_slip_and_wrong_layout_rejected(server, tmp_path):
    base, www = server
    root = tmp_path / "data"
    publish(www, "ml-latest-small", build_zip("x", {"../evil.txt": "x", "ml-latest-small/ratings.csv": RATINGS_CSV}))
    with pytest.raises(DownloadError, match="outside"):
        download_dataset("ml-latest-small", data_dir=root, base_url=base)
    assert not (tmp_path / "evil.txt").exists() and leftovers(root) == []
    publish(www, "ml-latest-small", build_zip("x", {"ml-latest-small/other.csv": "a"}))
    with pytest.raises(DownloadError, match="ratings.csv"):
        download_dataset("ml-latest-small", data_dir=root, base_url=base)
    assert leftovers(root) == []
    publish(www, "ml-latest-small", b"not a zip at all")
    with pytest.raises(DownloadError, match="not a valid zip"):
        download_dataset("ml-latest-small", data_dir=root, base_url=base)
    assert leftovers(root) == []


def test_missing_file_on_server(server, tmp_path):
    base, _ = server
    with pytest.raises(DownloadError, match="HTTP 404"):
        download_dataset("ml-latest-small", data_dir=tmp_path / "d", base_url=base)


def test_unreachable_port_explains_offline_placement(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    root = tmp_path / "data"
    with pytest.raises(DownloadError) as info:
        download_dataset("ml-1m", data_dir=root, base_url=f"http://127.0.0.1:{port}", timeout=5)
    message = str(info.value)
    assert "could not reach" in message
    assert str(root / "ml-1m" / "ratings.dat") in message
    assert "--data" in message
    assert leftovers(root) == []


def test_unknown_name_and_default_dir(monkeypatch, tmp_path):
    with pytest.raises(DownloadError, match="ml-100k"):
        download_dataset("ml-42m", data_dir=tmp_path)
    monkeypatch.setenv("SECAGG_DATA_DIR", str(tmp_path / "cache"))
    assert default_data_dir() == tmp_path / "cache"
    monkeypatch.delenv("SECAGG_DATA_DIR")
    assert default_data_dir() == Path.home() / ".cache" / "secagg" / "datasets"


def test_pins_are_well_formed():
    assert set(PINNED_SHA256) == set(PINNED_MD5) == {"ml-100k", "ml-1m"}
    for digest in PINNED_SHA256.values():
        assert len(digest) == 64 and int(digest, 16) >= 0
    for digest in PINNED_MD5.values():
        assert len(digest) == 32 and int(digest, 16) >= 0
