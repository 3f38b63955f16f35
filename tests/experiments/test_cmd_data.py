"""Tests of `secagg data download` and `secagg data info` (through the real CLI entry point)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import threading
import zipfile

import pytest

from experiments.cli import main

CSV = "userId,movieId,rating,timestamp\n1,10,4.0,100\n1,20,3.5,200\n2,10,5.0,150\n"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def mirror(tmp_path):
    www = tmp_path / "www"
    www.mkdir()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ml-latest-small/ratings.csv", CSV)
    payload = buf.getvalue()
    (www / "ml-latest-small.zip").write_bytes(payload)
    (www / "ml-latest-small.zip.md5").write_text(f"MD5 (ml-latest-small.zip) = {hashlib.md5(payload).hexdigest()}\n")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_download_then_info_json(mirror, tmp_path, capsys):
    root = tmp_path / "data"
    assert main(["data", "download", "ml-latest-small", "--data-dir", str(root), "--base-url", mirror, "--json"]) == 0
    out = last_json(capsys.readouterr().out)
    assert out["name"] == "ml-latest-small" and out["skipped"] is False
    assert out["ratings"] == str(root / "ml-latest-small" / "ratings.csv")
    assert main(["data", "info", str(root / "ml-latest-small"), "--json"]) == 0
    info = last_json(capsys.readouterr().out)
    assert (info["n_users"], info["n_items"], info["n_interactions"]) == (2, 2, 3)


def test_default_data_dir_from_env(mirror, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SECAGG_DATA_DIR", str(tmp_path / "cache"))
    assert main(["data", "download", "ml-latest-small", "--base-url", mirror]) == 0
    assert (tmp_path / "cache" / "ml-latest-small" / "ratings.csv").is_file()
    assert "verified" in capsys.readouterr().out


def test_info_text(tmp_path, capsys):
    path = tmp_path / "ratings.csv"
    path.write_text(CSV)
    assert main(["data", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 users, 2 items, 3 interactions" in out and "interactions_per_user" in out


def test_user_errors_exit_2_without_traceback(tmp_path, capsys):
    bad = tmp_path / "u.data"
    bad.write_text("1\t2\t3\t4\n1\tx\t3\t4\n")
    assert main(["data", "info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2:" in err and "Traceback" not in err
    assert main(["data", "info", str(tmp_path / "missing.csv")]) == 2
    assert "no such file" in capsys.readouterr().err
    # Unreachable mirror: the message says where to put the files by hand.
    assert main(["data", "download", "ml-100k", "--data-dir", str(tmp_path / "d"), "--base-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "could not reach" in err and str(tmp_path / "d" / "ml-100k" / "u.data") in err


def test_help(capsys):
    for argv in (["data", "--help"], ["data", "download", "--help"], ["data", "info", "--help"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 0
    assert "--format" in capsys.readouterr().out


def test_bench_json(tmp_path, capsys):
    path = tmp_path / "u.data"
    path.write_text("".join(f"{u}\t{i}\t{1 + (u + i) % 5}\t{u * 100 + i}\n" for u in range(1, 30) for i in range(1, 400, u % 4 + 3)))
    assert main(["data", "bench", "--data", str(path), "--json"]) == 0
    out = last_json(capsys.readouterr().out)
    assert out["protocol"]["kind"] == "leave-one-out"
    assert 0 <= out["itempop_sampled"]["HR@10"] <= 1
    assert set(out["seconds"]) >= {"load", "full_ranking_6000x4000", "eval_candidates_99"}


# -- issue 9, item 8: any CSV/TSV loads, and info says how it was read ----------------------------------


def test_info_sniffs_a_tsv_and_prints_what_it_inferred(tmp_path, capsys):
    path = tmp_path / "log.tsv"
    path.write_text("user_id\titem_id\tscore\tts\nu1\ti1\t4\t10\nu2\ti1\t5\t20\nu1\ti2\t3\t30\n")
    assert main(["data", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 users, 2 items, 3 interactions" in out
    assert "read as: csv, tab-separated, header line; user=user_id, item=item_id, rating=score, timestamp=ts" in out
    assert "--columns user=user_id,item=item_id,rating=score,timestamp=ts" in out
    assert main(["data", "info", str(path), "--json"]) == 0
    fmt = last_json(capsys.readouterr().out)["format"]
    assert fmt["format"] == "csv" and fmt["delimiter"] == "\t" and fmt["columns"]["rating"] == "score"
    assert set(fmt["inferred"]) >= {"format", "delimiter", "user", "item"}


def test_info_accepts_columns(tmp_path, capsys):
    path = tmp_path / "x.csv"
    path.write_text("a,b,c\n1,2,5\n3,2,4\n")
    assert main(["data", "info", str(path), "--columns", "user=b,item=a,rating=c", "--json"]) == 0
    info = last_json(capsys.readouterr().out)
    assert (info["n_users"], info["n_items"]) == (1, 2) and info["format"]["columns"]["user"] == "b"
    assert main(["data", "info", str(path), "--columns", "user=b,item=zz"]) == 2
    err = capsys.readouterr().err
    assert "'zz'" in err and "Traceback" not in err
    assert main(["data", "info", str(path), "--columns", "person=a"]) == 2
    assert "ROLE=NAME" in capsys.readouterr().err


def test_info_refuses_a_binary_file_without_echoing_it(tmp_path, capsys):
    path = tmp_path / "ratings.csv"
    path.write_bytes(b"\x89PNG\r\n\x1a\nSECRETMARKER\x00\x00")
    assert main(["data", "info", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a text ratings file" in err and "SECRETMARKER" not in err and err.count("\n") == 1
