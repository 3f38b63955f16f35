"""Every protocol of named exchanges, end to end on Flower, against ``secagg run``.

For each preset below: ``secagg run PRESET --config small.toml`` in one process, and the same
configuration through ``secagg run``'s loop with the clients on a loopback Flower grid (every
message through Flower's protobuf; each node reads only its own partition file) give the same
checkpointed model, the same metrics and the same privacy statement. Slow ones (and the Ray
simulation) are marked ``slow``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from experiments.run import config as cfgmod
from experiments.run.flower_run import execute_on_grid, prepare_for_flower, write_run_partitions
from experiments.run.rundir import RunDir
from experiments.run.training import RunRequest
from fedflower.apps import make_client_app
from fedflower.loopback import LoopbackGrid
from protocols.registry import all_protocols

from .conftest import run_in_process_and_simulated

logging.getLogger("flwr").setLevel(logging.ERROR)

SMALL = """
[data]
synthetic_users = 12
synthetic_items = 60
synthetic_mean_interactions = 8
[run]
rounds = 2
eval_every = 1
"""
#: preset -> small configuration (TOML), one entry per protocol of exchanges and variant worth a run.
CASES: dict[str, str] = {
    "lightfr-grad": SMALL + "[eval]\nnegatives = 10\n[lightfr]\nbits = 8\nrating_min = 1.0\nrating_max = 5.0\n",
    "lightfr": SMALL + "[eval]\nnegatives = 10\n[lightfr]\nbits = 8\nrating_min = 1.0\nrating_max = 5.0\n",
    "fedfast": SMALL + "[eval]\nnegatives = 10\n[fedfast]\ndim = 4\nclusters = 3\nclients_per_round = 4\n"
                       "kmeans_init_iters = 2\n",
    "fedfast-secagg": SMALL + "[eval]\nnegatives = 10\n[fedfast]\ndim = 4\nclusters = 3\nclients_per_round = 4\n"
                              "kmeans_init_iters = 1\n",
    # FedCL without semi-hard negatives (the paper's Fed): no LDP upload, so no noise, and the run is
    # reproducible from its seed; with the LDP upload see test_fedcl_with_ldp_runs_on_flower
    "fed-local-negatives": SMALL.replace("[run]", "[split]\nvalidation = false\n[run]")
    + "[eval]\nnegatives = 10\nfull_ranking = false\n[fedcl]\ndim = 8\nmax_len = 5\nclients_per_round = 4\n"
      "local_pool = 10\nlocal_negatives = 2\nsecure_aggregation = \"secagg+\"\n",
    # STTFedRec: RS and SAS in the ServerApp, the user-tower gradient through the chain (on Flower:
    # ChainWorkflow over the grid), the embedding gradients through SecAgg+
    "sttfedrec": SMALL + "[eval]\nnegatives = 10\n[sttfedrec]\nhash_dim = 32\nclients_per_round = 4\ndim = 8\n"
                         "request_size = 6\n",
    "fl-dssm": SMALL + "[eval]\nnegatives = 10\n[sttfedrec]\nhash_dim = 32\nclients_per_round = 4\ndim = 8\n"
                       "request_size = 6\n",
    # FedMF has no preset: fedavg-gmf's [data] and [eval] with run.protocol = "fedmf" (rating split)
    "fedmf": SMALL.replace("[run]", "[run]\nprotocol = \"fedmf\"")
    + "[fedmf]\nrating_scale = [1.0, 5.0]\n[fedmf.mf]\ndim = 4\n",
    "fedmf-secagg": SMALL.replace("[run]", "[run]\nprotocol = \"fedmf\"")
    + "[fedmf]\ndefense = \"secagg\"\nrating_scale = [1.0, 5.0]\n[fedmf.mf]\ndim = 4\n",
}
#: case -> the preset it starts from (default: the case's own name)
PRESET = {"fedmf": "fedavg-gmf", "fedmf-secagg": "fedavg-gmf"}
#: presets without secure aggregation: the Flower run's transcript is the in-process one, byte for byte
PLAINTEXT = {"lightfr-grad", "fedfast", "fl-dssm", "fedmf"}
#: STTFedRec's FedAdam (tau = 1e-6) turns an ulp of difference in a near-zero gradient coordinate (a
#: client's vmap'd batch alone rounds differently from the cohort's) into up to ~1e-5 after two rounds
ATOL = {"sttfedrec": 1e-4, "fl-dssm": 1e-4}
#: checkpoint keys that hold the clients' own state: on Flower it stays on the nodes, and the
#: server's checkpoint keeps only its initial placeholder (the metrics, computed on the nodes, compare)
CLIENT_HELD = {"lightfr": ("b",), "lightfr-grad": ("b",), "fedfast-secagg": ("user",),
               # (STTFedRec's device_seconds and secure_seconds: the clients' own timings, measured on the
               # devices; its train_bytes: the chain's bytes as Flower's records carry them, ~0.06% above its
               # wire form)
               "sttfedrec": ("device_seconds", "secure_seconds", "train_bytes"),
               "fl-dssm": ("device_seconds", "secure_seconds", "train_bytes"),
               "fedmf": ("p",), "fedmf-secagg": ("p",),
               # (FedCL's checkpoint in process carries every simulated client's guard record; on Flower each
               # node keeps its own, in its context and state directory)
               "fed-local-negatives": ("device_guard",)}


def flower_loopback(preset: str, config: Path, out: Path, parts: Path) -> dict:
    """``secagg run``'s loop with the clients on a loopback grid, as ``secagg flower simulate`` runs it."""
    cfg = cfgmod.load_config_file(config, base=cfgmod.load_preset(preset))
    prep = prepare_for_flower(cfg, None)
    meta = write_run_partitions(cfg, prep, parts)
    grid = LoopbackGrid(make_client_app(parts), [5000 + 3 * i for i in range(meta.clients)])
    req = RunRequest(preset=preset, config=cfg, out=out, quiet=True)
    return execute_on_grid(req, prep, meta, grid, timeout=60, assign=True, runtime={"engine": "loopback"})


def _flat(tree, prefix=""):  # noqa: ANN001, ANN202
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), tree


def compare_runs(flower_dir: Path, inproc_dir: Path, *, rtol: float = 1e-6, atol: float = 1e-6,
                 client_held: tuple[str, ...] = ()) -> None:
    a, b = ({k: v for k, v in _flat(RunDir.open_existing(d).load_checkpoint()["trainer"])
             if k.split(".")[0] not in client_held} for d in (flower_dir, inproc_dir))
    assert a.keys() == b.keys() and len(b) >= 2
    for k in b:
        va, vb = np.asarray(a[k]), np.asarray(b[k])
        if va.dtype.kind in "fc":
            np.testing.assert_allclose(va, vb, rtol=rtol, atol=atol, err_msg=k)
        else:
            assert np.array_equal(va, vb), k
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (flower_dir, inproc_dir))
    for k, v in sb["metrics"].items():
        assert sa["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert sa["privacy"]["statement"] == sb["privacy"]["statement"]


def test_every_protocol_of_exchanges_has_an_end_to_end_case():
    """A protocol that registers exchanges is tested here (at least one of its presets)."""
    presets = {cfgmod.load_config_file(_write(case), base=cfgmod.load_preset(PRESET.get(case, case))).run.protocol
               for case in CASES}
    missing = [name for name, spec in all_protocols().items() if spec.exchanges is not None and name not in presets]
    assert not missing, f"add a CASES entry for {missing}"


def _write(case: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="exchange-case-")) / "small.toml"
    path.write_text(CASES[case])
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_flower_gives_the_in_process_run(tmp_path, case):
    from experiments.cli import main as secagg

    preset = PRESET.get(case, case)
    config = tmp_path / "small.toml"
    config.write_text(CASES[case])
    assert secagg(["run", preset, "--config", str(config), "--out", str(tmp_path / "inproc"), "--quiet"]) == 0
    flower_loopback(preset, config, tmp_path / "flower", tmp_path / "parts")
    compare_runs(tmp_path / "flower", tmp_path / "inproc", client_held=CLIENT_HELD.get(case, ()),
                 atol=ATOL.get(case, 1e-6))
    if case in PLAINTEXT:  # who saw what, message by message (secure steps differ in the protocol's own messages)
        assert (tmp_path / "flower" / "transcript.csv").read_text() == (tmp_path / "inproc" / "transcript.csv").read_text()


def test_fedcl_with_ldp_runs_on_flower(tmp_path, capsys):
    """FedCL's embedding upload is Laplace-noised on the device from the OS CSPRNG, so two runs differ;
    on Flower the run completes with the in-process cohorts, bytes and privacy accounting."""
    from experiments.cli import main as secagg

    config = tmp_path / "small.toml"
    config.write_text(CASES["fed-local-negatives"].replace("local_negatives = 2\n", "local_negatives = 2\nsemi_hard = 3\n"
                                                           "clusters = 2\n"))
    assert secagg(["run", "fedcl", "--config", str(config), "--out", str(tmp_path / "inproc"), "--quiet"]) == 0
    flower_loopback("fedcl", config, tmp_path / "flower", tmp_path / "parts")
    rows = [[json.loads(x) for x in (tmp_path / d / "costs.jsonl").read_text().splitlines()] for d in ("flower", "inproc")]
    assert [(r["clients"], r["bytes_per_client"]) for r in rows[0]] == [(r["clients"], r["bytes_per_client"]) for r in rows[1]]
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("flower", "inproc"))
    assert sa["privacy"] == sb["privacy"] and "epsilon" in json.dumps(sa["privacy"])
    # the clients' own LDP counts: in process in the checkpoint (the trainer plays every client); on
    # Flower they stay on the nodes, and the report says so instead of inventing them
    reports = []
    for d in ("flower", "inproc"):
        capsys.readouterr()
        assert secagg(["privacy", "report", str(tmp_path / d), "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    flower, inproc = (r["clients_ldp"] for r in reports)
    assert flower["clients"] is None and "on Flower each node keeps its count" in flower["source"]
    assert flower["ledger"] == inproc["ledger"] and inproc["clients"] == inproc["ledger"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["lightfr", "sttfedrec"])
def test_simulation_through_ray_gives_the_in_process_run(tmp_path, preset):
    """`secagg flower simulate PRESET` through Flower's simulation engine (Ray): ``secagg run``'s model."""
    run_in_process_and_simulated(tmp_path, preset, CASES[preset])
    compare_runs(tmp_path / "sim", tmp_path / "inproc", client_held=CLIENT_HELD.get(preset, ()),
                 atol=ATOL.get(preset, 1e-6))
    assert json.loads((tmp_path / "sim" / "summary.json").read_text())["runtime"]["engine"] == "flower simulation (ray)"


def test_fedmf_with_paillier_on_flower_gives_the_in_process_metrics(tmp_path):
    """FedMF under Paillier: the clients share one secret key from key files (the server half reads
    only the public one), the server adds ciphertexts and checkpoints Enc(Q); the metrics each node
    computes after decrypting equal `secagg run`'s with the same keys."""
    from experiments.cli import main as secagg
    from protocols.fedmf import write_he_keys

    config = tmp_path / "small.toml"
    config.write_text(CASES["fedmf"].replace("rating_scale", f'defense = "paillier"\nkey_bits = 1024\n'
                                                             f'he_keys = "{tmp_path / "keys"}"\nrating_scale'))
    cfg = cfgmod.load_config_file(config, base=cfgmod.load_preset("fedavg-gmf"))
    write_he_keys(tmp_path / "keys", cfg.protocol_config, cfg.data.synthetic_users)
    assert secagg(["run", "fedavg-gmf", "--config", str(config), "--out", str(tmp_path / "inproc"), "--quiet"]) == 0
    flower_loopback("fedavg-gmf", config, tmp_path / "flower", tmp_path / "parts")
    state = RunDir.open_existing(tmp_path / "flower").load_checkpoint()["trainer"]
    assert "q" not in state and np.asarray(state["enc_q"]["ct"]).dtype == np.uint8  # the server holds Enc(Q) only
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("flower", "inproc"))
    for k, v in sb["metrics"].items():
        assert sa["metrics"][k] == pytest.approx(v, rel=1e-6), k  # (the nodes return float32 predictions)
