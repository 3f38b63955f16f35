"""Our SecAggWorkflow + secagg_mod in Flower's own simulation engine (Ray backend), end to end.

Slow (Ray starts in ~30-60 s on two loaded cores): run with ``-m slow``. The default run covers the
same code over fedflower.loopback's in-process Grid (tests/fedflower/test_secagg_workflow.py).
"""

from __future__ import annotations

import numpy as np
import pytest

SHAPES = [(3, 4), (5,)]


def _update(nid: int) -> list[np.ndarray]:
    rng = np.random.default_rng(nid % 2**32)  # CSPRNG-OK: simulated client data
    return [rng.uniform(-1, 1, s).astype(np.float32) for s in SHAPES]


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["secagg", "secagg+"])
def test_secure_fedavg_round_in_flower_simulation(protocol):
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerApp, ServerConfig
    from flwr.server.compat import LegacyContext
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow
    from flwr.simulation import run_simulation

    from fedflower.loopback import global_parameters
    from fedflower.records import SetupConfig
    from fedflower.secagg_mod import encode_update, secagg_mod
    from fedflower.secagg_workflow import SecAggWorkflow

    class Client(NumPyClient):
        def __init__(self, nid: int) -> None:
            self.nid = nid

        def fit(self, parameters, config):  # noqa: ANN001, ANN201
            return _update(self.nid), 10 + self.nid % 5, {}

    n = 5
    client_app = ClientApp(client_fn=lambda ctx: Client(ctx.node_id).to_client(), mods=[secagg_mod])
    wf = SecAggWorkflow(protocol=protocol, rounding="nearest")
    seen: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):  # noqa: ANN001, ANN202
        strategy = FedAvg(fraction_fit=1.0, min_fit_clients=n, min_available_clients=n, fraction_evaluate=0.0,
                          initial_parameters=ndarrays_to_parameters([np.zeros(s, np.float32) for s in SHAPES]))
        ctx = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        DefaultWorkflow(fit_workflow=wf)(grid, ctx)
        seen["params"] = global_parameters(ctx)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 1}})
    rep = wf.last_report
    assert rep is not None and rep.abort is None and rep.dropped == {} and len(rep.survivors) == n
    setup = SetupConfig(protocol, n, rep.dim, rep.t, 1, bytes(16), 0, (), wf.frac_bits, wf.clip, wf.max_weight,
                        "nearest")
    acc = np.zeros(rep.dim, dtype=np.uint64)
    for nid in rep.survivors:
        np.add(acc, encode_update(setup, _update(nid), 10 + nid % 5), out=acc)
    assert np.array_equal(rep.total, acc)
    w = np.array([10 + nid % 5 for nid in rep.survivors], dtype=np.float64)
    for j, got in enumerate(seen["params"]):
        want = sum(w[i] * _update(nid)[j] for i, nid in enumerate(rep.survivors)) / w.sum()
        np.testing.assert_allclose(got, want, atol=1e-6)
