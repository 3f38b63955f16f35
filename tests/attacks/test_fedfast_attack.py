"""The I_k attack on FedFast: near-perfect on the plaintext server's view, random-level on the
secure variant's (the promise of protocols/fedfast.py attacked), scored beside random guessing."""

from __future__ import annotations

import numpy as np
import pytest

from attacks.fedfast import STATUS_MASKED, STATUS_OK, changed_set_score, ik_attack, score, server_view
from attacks.registry import get_attack
from protocols.fedfast import FedFastConfig, FedFastGMF
from protocols.transport import SERVER, InProcessTransport, Transcript
from recmodels.synthetic import generate_synthetic


def trained(rounds: int, **kw):
    data = generate_synthetic(n_users=40, n_items=80, dim=6, mean_interactions=10, seed=3)
    cfg = FedFastConfig(**{"dim": 6, "clients_per_round": 10, "clusters": 3, "kmeans_init_iters": 1, **kw})
    keep = lambda r: r.receiver == SERVER and r.kind == "update"  # noqa: E731
    m = FedFastGMF(data, cfg, seed=1, transport=InProcessTransport(Transcript(keep_payloads=keep)))
    for _ in range(rounds):
        m.run_round()
    truth = {u: data.items[data.users == u] for u in range(data.n_users)}
    return m, data, truth


@pytest.mark.parametrize("kw", [{}, {"sampling": "uniform", "aggregation": "fedavg"}])
def test_plaintext_view_reveals_the_positives(kw):
    m, data, truth = trained(2, **kw)
    inferred = get_attack("fedfast", "fedfast-ik").run(server_view(m.transport.transcript), m.public_info())
    assert inferred.status == STATUS_OK and len(inferred) >= 10
    sc = score(inferred, truth, data.n_items)
    whole = changed_set_score(inferred, truth, data.n_items)
    assert sc.f1 > 0.9 and sc.f1 > whole.f1 + 0.3 and sc.f1 > 3 * sc.random_f1
    for u, items in inferred.changed.items():  # I_k holds every positive of the client
        assert set(truth[u].tolist()) <= set(items.tolist())


def test_magnitude_ranking_is_a_valid_weaker_method():
    m, data, truth = trained(1)
    view = server_view(m.transport.transcript)
    mag = score(ik_attack(view, m.public_info(), method="magnitude"), truth, data.n_items)
    assert 0 <= mag.f1 <= 1
    with pytest.raises(ValueError, match="method"):
        ik_attack(view, m.public_info(), method="guess")


def test_secure_view_is_at_random_level():
    m, data, truth = trained(1, secure_aggregation="secagg+")
    inferred = ik_attack(server_view(m.transport.transcript), m.public_info())
    assert inferred.status == STATUS_MASKED and len(inferred) == 10 and not inferred.changed
    sc = score(inferred, truth, data.n_items)
    assert sc.f1 < sc.random_f1 + 0.15, sc


def test_empty_view_infers_nothing():
    m, _, _ = trained(0)
    out = ik_attack([], m.public_info())
    assert len(out) == 0 and "no client upload" in out.status
