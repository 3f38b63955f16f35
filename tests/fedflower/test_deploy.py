"""Deployment over TLS on loopback: a SuperLink and one SuperNode per client as separate processes, `flwr run`
submitting the app, and the model equal to the in-process run with the same seed.

TLS: a throwaway CA and a server certificate for 127.0.0.1 are generated here with `cryptography`; the SuperLink
serves its HTTP APIs over TLS, the SuperNodes and `flwr run` verify it against the CA. (`--insecure` is only for
the quick local path in docs/flower.md, which says so.) Every process runs in its own process group and is killed
with its children (the flwr-serverapp/flwr-clientapp subprocesses) even when the test fails.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def throwaway_ca(directory: Path) -> dict[str, Path]:
    """A CA valid for one hour and a server certificate for 127.0.0.1/localhost signed by it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("secagg test CA")).issuer_name(_name("secagg test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"ca": directory / "ca.crt", "cert": directory / "server.crt", "key": directory / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    paths["key"].chmod(0o600)
    return paths


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Processes:
    """Started processes, each in its own process group; ``close()`` ends every group it started."""

    def __init__(self, env: dict[str, str], logs: Path):
        self.env, self.logs, self.procs = env, logs, []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append((name, p, out))
        return p

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for _, p, _ in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 20
        for _, p, out in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the group: flwr-serverapp/flwr-clientapp children too
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
            out.close()


ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
CONFIG = """[data]
synthetic_users = 3
synthetic_items = 150
synthetic_mean_interactions = 10
[eval]
negatives = 0
[fedavg]
dim = 4
[run]
eval_every = 0
seed = 11
rounds = {rounds}
"""


def _wait(ps: Processes, cond, what: str, timeout: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        for name, p, _ in ps.procs:
            if p.poll() is not None and name != "flwr-run":
                raise AssertionError(f"{name} exited with {p.returncode} while waiting for {what}:\n{ps.log(name)[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}:\n{ps.log('superlink')[-3000:]}")
        time.sleep(1)


def _flwr_run(env: dict, run_cfg: str) -> None:
    tries = []
    for _ in range(3):  # the Control API call can time out on a loaded machine; nothing starts twice
        try:
            done = subprocess.run([str(VENV_BIN / "flwr"), "run", "flower-app", "local-tls", "--run-config", run_cfg],
                                  env=env, capture_output=True, text=True, timeout=150, cwd=ROOT)
        except subprocess.TimeoutExpired as exc:
            tries.append(f"timeout: {exc.stdout!r} {exc.stderr!r}")
            continue
        tries.append(done.stdout + done.stderr)
        if done.returncode == 0 and "Successfully started run" in done.stdout:
            break
    assert "Successfully started run" in tries[-1], "\n".join(tries)


def deploy(tmp: Path, rounds: int, preset: str = "fedavg-gmf-secagg", resume_to: int | None = None,
           config: str = CONFIG) -> tuple[Path, Path]:
    """Partition, start the SuperLink and SuperNodes over TLS, `flwr run` the app; returns (flower, in-process) run dirs.

    With ``resume_to``: every SuperNode keeps a ``state-dir``, and after the first run a second
    `flwr run` resumes it (run config ``resume``) to ``resume_to`` rounds; the in-process reference
    runs ``resume_to`` rounds straight.
    """
    from experiments.cli import main as secagg

    certs = throwaway_ca(tmp / "certs")
    cfg = tmp / "config.toml"
    cfg.write_text(config.format(rounds=rounds))
    assert secagg(["flower", "partition", preset, "--config", str(cfg), "--out", str(tmp / "parts")]) == 0
    n = len(json.loads((tmp / "parts" / "meta.json").read_text())["users"])
    ref_cfg = cfg
    if resume_to is not None:
        ref_cfg = tmp / "reference.toml"
        ref_cfg.write_text(config.format(rounds=resume_to))
    assert secagg(["run", preset, "--config", str(ref_cfg), "--out", str(tmp / "inproc"), "--quiet"]) == 0
    link, *node_ports = free_ports(1 + n)
    home = tmp / "flwr"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local-tls"\n[superlink.local-tls]\naddress = "127.0.0.1:{link}"\n'
        f'root-certificates = "{certs["ca"]}"\n')
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "FLWR_HOME": str(home),
           "OMP_NUM_THREADS": "1"}
    ps = Processes(env, tmp / "logs")
    try:
        ps.start("superlink", [str(VENV_BIN / "flower-superlink"), "--ssl-ca-certfile", str(certs["ca"]),
                               "--ssl-certfile", str(certs["cert"]), "--ssl-keyfile", str(certs["key"]),
                               "--host", "127.0.0.1", "--port", str(link), "--database", ":flwr-in-memory:"])
        for i in range(n):
            ps.start(f"supernode{i}", [str(VENV_BIN / "flower-supernode"), "--root-certificates", str(certs["ca"]),
                                       "--superlink", f"127.0.0.1:{link}", "--port", str(node_ports[i]),
                                       "--node-config", f"partition-id={i} partition-dir='{tmp / 'parts'}'"
                                       + (f" state-dir='{tmp / f'node{i}'}'" if resume_to is not None else "")])
        _wait(ps, lambda: "Uvicorn running on https://" in ps.log("superlink")
              and ps.log("superlink").count("Activated node_id") >= n, "the SuperNodes' TLS connections", 300)
        run_cfg = f"preset='{preset}' config='{cfg}' partition-dir='{tmp / 'parts'}' out='{tmp / 'flower'}' timeout=600.0"
        _flwr_run(env, run_cfg)
        def released() -> bool:  # the ServerApp let go of the run directory's lock (flock)
            import fcntl

            with open(tmp / "flower" / "run.lock", "a") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                fcntl.flock(fh, fcntl.LOCK_UN)
                return True

        def finished(rows: int):  # noqa: ANN202 - the run wrote its summary and released its directory
            return lambda: ((tmp / "flower" / "summary.json").exists() and released()
                            and len((tmp / "flower" / "metrics.jsonl").read_text().splitlines()) >= rows)

        _wait(ps, finished(1), "the run's summary.json", 900)
        if resume_to is not None:  # a second run (fresh Flower contexts on every node) continues the first
            _flwr_run(env, f"resume='{tmp / 'flower'}' rounds={resume_to} partition-dir='{tmp / 'parts'}' timeout=600.0")
            _wait(ps, finished(resume_to), "the resumed run's summary.json", 900)
    finally:
        ps.close()
    leaked = [p.pid for _, p, _ in ps.procs if p.poll() is None]
    assert not leaked, f"processes left running: {leaked}"
    return tmp / "flower", tmp / "inproc"


def _check_same_model(flower_dir: Path, inproc_dir: Path) -> None:
    import torch

    from experiments.run.rundir import RunDir

    a = RunDir.open_existing(flower_dir).load_checkpoint()["trainer"]
    b = RunDir.open_existing(inproc_dir).load_checkpoint()["trainer"]
    assert a["round"] == b["round"] > 0
    for name in ("item", "h", "b"):
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)  # float32 rounding only (adapter docstring)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (flower_dir, inproc_dir))
    assert sa["runtime"]["engine"].startswith("flower deployment") and sa["runtime"]["nodes"] == sa["public_info"]["clients"]
    for k, v in sb["metrics_full"].items():
        assert sa["metrics_full"][k] == pytest.approx(v, abs=1e-9), k
    # The same wire messages: for secure aggregation the client's vector has two more slots (its
    # loss sum and example count, 8 bytes each in Z_2^64), otherwise the bytes are the in-process ones.
    secure = "secagg" in sa["privacy"]["statement"]
    assert [json.loads(x)["bytes_per_client"] for x in (flower_dir / "costs.jsonl").read_text().splitlines()] == \
        [json.loads(x)["bytes_per_client"] + (16 if secure else 0)
         for x in (inproc_dir / "costs.jsonl").read_text().splitlines()]


def test_deployment_over_tls_with_secure_aggregation_gives_the_in_process_model(tmp_path):
    """One round of fedavg-gmf-secagg (our SecAgg+ between the SuperNodes), three SuperNodes: the quick slice."""
    _check_same_model(*deploy(tmp_path, rounds=1))


@pytest.mark.slow
def test_a_deployment_resumes_to_the_in_process_model(tmp_path):
    """One round, then a second `flwr run` with resume to three: the SuperNodes continue from their state-dir."""
    flower, inproc = deploy(tmp_path, rounds=1, preset="fedavg-gmf", resume_to=3)
    _check_same_model(flower, inproc)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fedavg-gmf", "fedavg-gmf-secagg"])
def test_deployment_over_tls_three_rounds(tmp_path, preset):
    _check_same_model(*deploy(tmp_path, rounds=3, preset=preset))


FEL_CONFIG = """[data]
synthetic_users = 6
synthetic_items = 150
synthetic_mean_interactions = 10
[eval]
negatives = 0
[fel]
dim = 4
n_clusters = 2
min_clients = 2
clients_per_round = 2
[run]
eval_every = 0
seed = 11
rounds = {rounds}
"""


@pytest.mark.slow
def test_fel_deployment_over_tls_gives_the_in_process_leaves(tmp_path):
    """`fel-mean` with two leaves on six SuperNodes: each node trains its own leaf; the leaves, the metrics
    (the ensemble scored on the nodes) and the bytes equal `secagg run`'s."""
    import torch

    from experiments.run.rundir import RunDir

    flower, inproc = deploy(tmp_path, rounds=2, preset="fel-mean", config=FEL_CONFIG)
    a = RunDir.open_existing(flower).load_checkpoint()["trainer"]
    b = RunDir.open_existing(inproc).load_checkpoint()["trainer"]
    assert a["round"] == b["round"] == 2 and len(a["leaves"]) == len(b["leaves"]) == 2
    for la, lb in zip(a["leaves"], b["leaves"]):
        for name in ("item", "h", "b"):
            torch.testing.assert_close(la[name], lb[name], rtol=1e-5, atol=1e-6)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (flower, inproc))
    assert sa["runtime"]["engine"].startswith("flower deployment") and sa["runtime"]["nodes"] == 6
    for k, v in sb["metrics_full"].items():
        assert sa["metrics_full"][k] == pytest.approx(v, abs=1e-9), k
    assert [json.loads(x)["bytes_per_client"] for x in (flower / "costs.jsonl").read_text().splitlines()] == \
        [json.loads(x)["bytes_per_client"] for x in (inproc / "costs.jsonl").read_text().splitlines()]


FEL_DP_CONFIG = """[data]
synthetic_users = 8
synthetic_items = 150
synthetic_mean_interactions = 10
[eval]
negatives = 0
[fel]
combiner = "mean"
dim = 4
n_clusters = 2
min_clients = 3
clients_per_round = 3
frac_bits = 20
[run]
eval_every = 0
seed = 11
rounds = {rounds}
"""


@pytest.mark.slow
def test_fel_dp_deployment_over_tls_gives_the_in_process_privacy_report(tmp_path):
    """`fel-dp` (distributed noise through SecAgg+, a fixed combiner) on eight SuperNodes: each node clips
    its update and adds its noise share before masking; the noise is the CSPRNG's, so the leaves differ
    from `secagg run`'s, but the releases, the privacy report and the bytes are the same."""
    from dp.ledger import PrivacyLedger

    flower, inproc = deploy(tmp_path, rounds=2, preset="fel-dp", config=FEL_DP_CONFIG)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (flower, inproc))
    assert sa["runtime"]["engine"].startswith("flower deployment") and sa["runtime"]["nodes"] == 8
    assert sa["privacy"] == sb["privacy"] and sa["privacy"]["dp_noise"] is True
    entries = [[(e.cohort, type(e.event).__name__, json.dumps(e.params, sort_keys=True, default=str))
                for e in PrivacyLedger(d / "privacy_ledger.sqlite").entries()] for d in (flower, inproc)]
    assert entries[0] == entries[1] and {c for c, _, _ in entries[0]} == {"leaf:0", "leaf:1"}
    assert [json.loads(x)["bytes_per_client"] for x in (flower / "costs.jsonl").read_text().splitlines()] == \
        [json.loads(x)["bytes_per_client"] for x in (inproc / "costs.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sttfedrec_deployment_over_tls_gives_the_in_process_model(tmp_path):
    """A protocol of named exchanges on real SuperNodes over TLS: STTFedRec's RS and SAS in the
    ServerApp, each client's request in plaintext, its user-tower gradient through the circular chain
    and its embedding gradients through SecAgg+; the model and metrics equal `secagg run`'s."""
    from .test_exchange_protocols import ATOL, CASES, CLIENT_HELD, compare_runs

    config = CASES["sttfedrec"].replace("rounds = 2", "rounds = {rounds}")
    flower, inproc = deploy(tmp_path, rounds=2, preset="sttfedrec", config=config)
    compare_runs(flower, inproc, client_held=CLIENT_HELD["sttfedrec"], atol=ATOL["sttfedrec"])
    summary = json.loads((flower / "summary.json").read_text())
    assert summary["runtime"]["engine"].startswith("flower deployment")
