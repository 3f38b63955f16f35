"""Fixtures for the Flower tests: one secure-aggregation round over an in-process Grid.

(Created by the secure-aggregation half of issue 15; the apps half keeps its fixtures in its own
test modules.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from flwr.client import ClientApp, NumPyClient

from fedflower.loopback import LoopbackGrid, fit_round, global_parameters
from fedflower.records import SetupConfig
from fedflower.secagg_mod import encode_update, secagg_mod
from fedflower.secagg_workflow import SecAggReport, SecAggWorkflow

SHAPES = [(3, 4), (5,)]


def update_of(nid: int, shapes=SHAPES) -> list[np.ndarray]:  # noqa: ANN001
    """Node ``nid``'s deterministic local update (the plaintext oracle recomputes it)."""
    rng = np.random.default_rng(nid)  # CSPRNG-OK: simulated client data
    return [rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]


def examples_of(nid: int) -> int:
    return 10 + nid % 7


class _Client(NumPyClient):
    def __init__(self, nid: int, shapes) -> None:  # noqa: ANN001
        self.nid, self.shapes = nid, shapes

    def fit(self, parameters, config):  # noqa: ANN001, ANN201
        return update_of(self.nid, self.shapes), examples_of(self.nid), {"node": self.nid}


def secure_app(shapes=SHAPES) -> ClientApp:  # noqa: ANN001
    """A ClientApp with our mod whose nodes return :func:`update_of`."""
    return ClientApp(client_fn=lambda ctx: _Client(ctx.node_id, shapes).to_client(), mods=[secagg_mod])


@dataclass
class RoundResult:
    wf: SecAggWorkflow
    grid: LoopbackGrid
    report: SecAggReport
    params: list[np.ndarray]
    nodes: list[int]
    shapes: list

    def oracle_total(self, survivors: list[int]) -> np.ndarray:
        """Exact Z_2^64 sum of the survivors' encodings (nearest rounding is deterministic)."""
        rep = self.report
        setup = SetupConfig(rep.protocol, rep.n, rep.dim, rep.t, rep.round, bytes(16), 0, (), self.wf.frac_bits,
                            self.wf.clip, self.wf.max_weight, "nearest")
        acc = np.zeros(rep.dim, dtype=np.uint64)
        for nid in survivors:
            np.add(acc, encode_update(setup, update_of(nid, self.shapes), examples_of(nid)), out=acc)
        return acc

    def oracle_mean(self, survivors: list[int]) -> list[np.ndarray]:
        w = np.array([examples_of(nid) for nid in survivors], dtype=np.float64)
        ups = [update_of(nid, self.shapes) for nid in survivors]
        return [sum(w[i] * ups[i][j].astype(np.float64) for i in range(len(ups))) / w.sum()
                for j in range(len(self.shapes))]


@pytest.fixture
def secagg_round() -> Callable[..., RoundResult]:
    """``secagg_round(n, drop=..., tamper=..., wrap_app=..., node_config=..., **workflow kwargs)`` ->
    :class:`RoundResult`; ``node_config`` is every node's own configuration (a dict)."""
    logging.getLogger("flwr").setLevel(logging.ERROR)

    def run(n: int, *, drop=None, tamper=None, wrap_app=None, shapes=SHAPES, nodes=None, node_config=None,  # noqa: ANN001
            **kw) -> RoundResult:
        kw.setdefault("rounding", "nearest")
        nodes = nodes or [1000 + 17 * i for i in range(n)]
        wf = SecAggWorkflow(**kw)
        app = secure_app(shapes)
        grid = LoopbackGrid(app if wrap_app is None else wrap_app(app), nodes, drop=drop, tamper=tamper,
                            node_config=None if node_config is None else lambda nid: node_config)
        init = [np.zeros(s, np.float32) for s in shapes]
        ctx = fit_round(wf, grid, init)
        assert wf.last_report is not None
        return RoundResult(wf, grid, wf.last_report, global_parameters(ctx), nodes, shapes)

    return run


def run_in_process_and_simulated(tmp_path, preset: str, config_text: str):  # noqa: ANN001, ANN201
    """``secagg run PRESET`` and ``secagg flower simulate PRESET`` (Ray, one CPU) on the same small
    config; returns the two run directories ``(simulated, in_process)``."""
    from experiments.cli import main as secagg

    cfg = tmp_path / "c.toml"
    cfg.write_text(config_text)
    assert secagg(["run", preset, "--config", str(cfg), "--out", str(tmp_path / "inproc"), "--quiet"]) == 0
    assert secagg(["flower", "simulate", preset, "--config", str(cfg), "--cpus", "1", "--out", str(tmp_path / "sim"),
                   "--quiet"]) == 0
    return tmp_path / "sim", tmp_path / "inproc"
