"""``"dpf"`` needs a second aggregation server, which Flower's one ServerApp is not: refused in words."""

from __future__ import annotations

import pytest

from protocols.fedavg import FedAvgConfig, FedAvgGMF
from tests.protocols.test_fedavg import make_train


def test_flower_refuses_dpf_in_words():
    from fedflower.apps import GridTrainer

    server = FedAvgGMF(make_train(3, 10, [2, 2, 2]), FedAvgConfig(dim=2, secure_aggregation="dpf"), seed=0)
    with pytest.raises(ValueError, match="second, non-colluding aggregation server"):
        GridTrainer(None, server, protocol="fedavg", seed=0, meta=None)
