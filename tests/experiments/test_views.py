"""Recorded adversary views in a run directory (experiments.run.views, ``secagg run --record-views``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments.cli import main
from experiments.errors import UserError
from experiments.run.rundir import RunDir
from experiments.run.views import INDEX, VIEWS_DIR, ViewRecorder, load_views
from protocols.fedavg import ClientUpdate, FedAvgConfig, FedAvgGMF
from protocols.transport import SERVER, InProcessTransport, Transcript
from recmodels.synthetic import generate_synthetic

ROOT = Path(__file__).resolve().parents[2]
DATA = generate_synthetic(n_users=12, n_items=30, dim=4, mean_interactions=6, seed=2)
SMALL = """
[run]
protocol = "fedavg"
eval_every = 0
[data]
synthetic_users = 30
synthetic_items = 40
synthetic_mean_interactions = 8
[eval]
negatives = 10
"""


def _record(tmp_path: Path, rounds: int = 3, every: int = 2) -> tuple[RunDir, Transcript, Transcript]:
    """FedAvg recorded by a ViewRecorder, beside the same run keeping every payload."""
    rd = RunDir.create(tmp_path / "run")
    rec = ViewRecorder(rd, "fedavg", (SERVER,), every, rounds - 1)
    live = Transcript()
    live.keep_payloads = rec.filter
    cfg = FedAvgConfig(dim=4, clients_per_round=5)
    fa = FedAvgGMF(DATA, cfg, seed=1, transport=InProcessTransport(live))
    ref = Transcript(keep_payloads=True)
    fb = FedAvgGMF(DATA, cfg, seed=1, transport=InProcessTransport(ref))
    rec.open(0)
    for r in range(rounds):
        rec.begin(r)
        fa.run_round()
        fb.run_round()
        rec.end(r, live.records, fa.public_info())
    return rd, live, ref


def test_a_recorded_view_is_what_the_server_received(tmp_path: Path) -> None:
    rd, live, ref = _record(tmp_path)
    views = load_views(rd.path)
    assert views.rounds == [0, 2] and views.protocol == "fedavg" and views.roles == (SERVER,)
    for r in (0, 2):
        want = [x for x in ref.records if x.round == r and SERVER in (x.sender, x.receiver)]
        got = views.view(SERVER, [r])
        assert [(x.sender, x.receiver, x.kind, x.nbytes) for x in got] == \
            [(x.sender, x.receiver, x.kind, x.nbytes) for x in want]
        ups = [(a.payload, b.payload) for a, b in zip(want, got) if a.kind == "update"]
        assert ups and all(isinstance(b, ClientUpdate) for _, b in ups)
        for a, b in ups:
            assert a.user == b.user and a.weight == b.weight
            np.testing.assert_array_equal(a.item_delta, b.item_delta)
            np.testing.assert_array_equal(a.rows, b.rows)
        assert views.public[r]["n_items"] == DATA.n_items
    # the round not recorded kept no payload: it cost what a run without recording costs
    assert all(x.payload is None for x in live.records if x.round == 1)
    index = json.loads((rd.path / VIEWS_DIR / INDEX).read_text())
    assert [e["round"] for e in index["rounds"]] == [0, 2]
    assert all(e["bytes"] == (rd.path / VIEWS_DIR / e["file"]).stat().st_size for e in index["rounds"])


def test_a_changed_view_file_is_rejected_with_a_clear_error(tmp_path: Path) -> None:
    rd, _, _ = _record(tmp_path)
    path = rd.path / VIEWS_DIR / "round-000002.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # one bit of one array
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"round-000002.safetensors does not match the SHA-256"):
        load_views(rd.path)
    assert load_views(rd.path, rounds=[0]).rounds == [0]  # the others still read
    path.unlink()
    with pytest.raises(UserError, match="cannot read"):
        load_views(rd.path)


def test_an_edited_index_is_rejected(tmp_path: Path) -> None:
    rd, _, _ = _record(tmp_path)
    path = rd.path / VIEWS_DIR / INDEX
    index = json.loads(path.read_text())
    index["rounds"][0]["file"] = "../checkpoint.safetensors"
    path.write_text(json.dumps(index))
    with pytest.raises(UserError, match="malformed"):
        load_views(rd.path)
    path.write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        load_views(rd.path)
    shutil.rmtree(rd.path / VIEWS_DIR)
    with pytest.raises(UserError, match="--record-views"):
        load_views(rd.path)


def test_resume_cuts_the_rounds_after_the_checkpoint_and_appends(tmp_path: Path) -> None:
    rd, _, _ = _record(tmp_path, rounds=4, every=1)
    folder = rd.path / VIEWS_DIR
    (folder / "round-000009.safetensors").write_bytes(b"written before a kill reached the index")
    again = ViewRecorder(rd, "fedavg", (SERVER,), 1, 3)
    again.open(2)  # the checkpoint holds rounds 0 and 1
    assert sorted(p.name for p in folder.iterdir()) == [INDEX, "round-000000.safetensors", "round-000001.safetensors"]
    assert load_views(rd.path).rounds == [0, 1]
    with pytest.raises(UserError, match="protocol 'fedavg'"):
        ViewRecorder(rd, "fedmf", (SERVER,), 1, 3).open(2)


def test_run_records_views_resumes_and_prints_their_cost(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    out = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--rounds", "2", "--record-views", "--record-every", "3",
                 "--out", str(out), "--quiet", "--json"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed.splitlines()[-1])
    assert summary["views"]["rounds"] == 2 and summary["views"]["roles"] == [SERVER]  # round 0, and the last
    assert summary["views"]["bytes"] == sum(p.stat().st_size for p in (out / VIEWS_DIR).glob("round-*"))
    assert "views     2 round(s) of server recorded:" in printed and " MB, " in printed
    assert main(["run", "--resume", str(out), "--rounds", "4", "--quiet"]) == 0
    assert load_views(out).rounds == [0, 1, 3]  # 1 was the last round before the resume; 3 % 3 == 0
    capsys.readouterr()
    assert main(["run", "--config", str(cfg), "--record-every", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--record-every must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("preset, protocol, ran", [
    (None, "fedavg", ["fedavg-ik"]),
    (None, "fedmf", ["fedmf-one-round"]),
    pytest.param("lightfr-grad", None, ["lightfr-one-upload"], marks=pytest.mark.slow),
    pytest.param("fedfast", None, ["fedfast-ik"], marks=pytest.mark.slow),
])
def test_attack_inference_needs_only_the_views_directory(tmp_path: Path, capsys, preset: str | None,
                                                          protocol: str | None, ran: list[str]) -> None:
    """The attacks' ``infer`` reads the recorded views and public info: copied alone into an empty
    directory, with the data, checkpoint and training modules unimportable, they still run."""
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL.replace('protocol = "fedavg"', f'protocol = "{protocol}"' if protocol else ""))
    out = tmp_path / "run"
    assert main(["run", *([preset] if preset else []), "--config", str(cfg), "--rounds", "1", "--record-views",
                 "--out", str(out), "--quiet"]) == 0
    alone = tmp_path / "alone"
    shutil.copytree(out / VIEWS_DIR, alone / VIEWS_DIR)
    code = (
        "import sys\n"
        "for m in ('experiments.run.prepare', 'experiments.run.training', 'recmodels.loaders', 'recmodels.synthetic'):\n"
        "    sys.modules[m] = None\n"
        "from attacks.findings import NotApplicable\n"
        "from attacks.registry import attacks_for\n"
        "from experiments.run.views import load_views\n"
        f"v = load_views({str(alone)!r})\n"
        "for a in attacks_for(v.protocol):\n"
        "    if a.infer is not None:\n"
        "        try:\n"
        "            res = a.infer(v.view(a.view), v.last_public())\n"
        "            print('ran', a.name, type(res).__name__)\n"
        "        except NotApplicable as exc:\n"
        "            print('not applicable', a.name, exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert sorted(x.split()[1] for x in run.stdout.splitlines() if x.startswith("ran ")) == ran, run.stdout


@pytest.mark.slow
def test_a_flower_simulation_records_the_server_view_and_is_attacked(tmp_path: Path, capsys) -> None:
    """Flower runs the same run loop, so the server's transcript is recorded the same way (plaintext
    uploads as ClientUpdate, SecAgg+ uploads masked)."""
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL.replace("synthetic_users = 30", "synthetic_users = 12"))
    out = tmp_path / "flower"
    assert main(["flower", "simulate", "fedavg-gmf", "--config", str(cfg), "--rounds", "1", "--cpus", "1",
                 "--record-views", "--out", str(out), "--quiet"]) == 0
    views = load_views(out)
    ups = [r for r in views.view(SERVER) if r.kind == "update"]
    assert views.rounds == [0] and ups and all(isinstance(r.payload, ClientUpdate) for r in ups)
    capsys.readouterr()
    assert main(["attack", str(out), "--json"]) == 0
    [f] = json.loads(capsys.readouterr().out.splitlines()[-1])["findings"]
    assert f["attack"] == "fedavg-ik" and f["advantage"] > 0.5
