"""NCF: one ncf-fed client equals centralised NCF; FedAvg's mean; plaintext vs secure aggregation; checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocols.ncf_fed import NCFCentral, NCFFed, NCFFedConfig, NCFUpdate
from protocols.transport import InProcessTransport, Transcript
from recmodels.data import Interactions
from recmodels.neumf import NCFConfig


def _data(n_users: int, n_items: int, per_user: int, seed: int = 0) -> Interactions:
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(n_users), per_user)
    items = np.concatenate([rng.choice(n_items, per_user, replace=False) for _ in range(n_users)])
    n = len(users)
    return Interactions(users, items, np.ones(n, np.float32), np.arange(n), np.arange(n_users), np.arange(n_items))


def test_one_client_round_equals_one_central_epoch() -> None:
    train = _data(1, 40, 12)
    base = dict(dim=4, layers=[6, 3], lr=0.01, batch_size=5, train_negatives=3, weight_decay=1e-4)
    central = NCFCentral(train, NCFConfig(**base), seed=3)
    fed = NCFFed(train, NCFFedConfig(**base, client_fraction=1.0), seed=3)
    central.run_round()
    fed.run_round()
    for k, v in fed.shared.items():
        torch.testing.assert_close(v, central.params[k].detach(), rtol=1e-5, atol=1e-6)
    for k, v in fed.users.items():
        torch.testing.assert_close(v, central.params[k].detach(), rtol=1e-5, atol=1e-6)
    items = np.arange(40)[None, :]
    np.testing.assert_allclose(fed.score(np.array([0]), items), central.score(np.array([0]), items), rtol=1e-5, atol=1e-6)


def test_server_applies_the_weighted_mean_of_the_uploads() -> None:
    train = _data(5, 300, 4)
    tr = InProcessTransport(Transcript(keep_payloads=True))
    fed = NCFFed(train, NCFFedConfig(dim=3, layers=[4], client_fraction=1.0, lr=0.05), seed=1, transport=tr)
    before = {k: v.clone() for k, v in fed.shared.items()}
    fed.run_round()
    ups = [r.payload for r in tr.transcript.records if r.kind == "update"]
    assert len(ups) == 5 and all(isinstance(u, NCFUpdate) for u in ups)
    w = np.array([u.weight for u in ups])
    assert (w == 4 * (1 + 4)).all()  # positives and 4 negatives each
    for k, v in fed.shared.items():
        mean = sum(u.weight * u.delta[k] for u in ups) / w.sum()
        np.testing.assert_allclose(v.numpy(), before[k].numpy() + mean, rtol=1e-5, atol=1e-6)
    # an item row no client trained on did not move
    touched = set()
    for u in ups:
        touched |= set(np.flatnonzero(np.abs(u.delta["item_gmf"]).sum(1)).tolist())
    untouched = sorted(set(range(300)) - touched)
    assert untouched and torch.equal(fed.shared["item_gmf"][untouched], before["item_gmf"][untouched])
    sent = sum(r.nbytes for r in tr.transcript.records)
    assert sent == 5 * (2 * fed.model_bytes + 4)


def test_secure_aggregation_gives_the_plaintext_step() -> None:
    train = _data(4, 20, 3)
    plain = NCFFed(train, NCFFedConfig(dim=2, layers=[3], client_fraction=1.0), seed=2)
    tr = InProcessTransport(Transcript(keep_payloads=True))
    masked = NCFFed(train, NCFFedConfig(dim=2, layers=[3], client_fraction=1.0, secure_aggregation="secagg"), seed=2,
                    transport=tr)
    plain.run_round()
    masked.run_round()
    for k in plain.shared:
        np.testing.assert_allclose(masked.shared[k].numpy(), plain.shared[k].numpy(), atol=1e-5)
    ups = [r for r in tr.transcript.records if r.kind == "update"]
    assert len(ups) == 4 and all(r.payload.dtype == np.uint64 for r in ups)  # the server saw masked vectors only


def test_checkpoint_round_trip_continues_exactly() -> None:
    train = _data(6, 25, 3)
    cfg = NCFFedConfig(dim=3, layers=[4], client_fraction=0.5)
    a = NCFFed(train, cfg, seed=4)
    a.run_round()
    b = NCFFed(train, cfg, seed=4)
    b.load_state_dict(a.state_dict())
    a.run_round()
    b.run_round()
    for k in a.shared:
        assert torch.equal(a.shared[k], b.shared[k])
    with pytest.raises(ValueError, match="different ncf-fed"):
        NCFFed(train, NCFFedConfig(dim=3, layers=[5]), seed=4).load_state_dict(a.state_dict())


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="layers"):
        NCFConfig(layers=[])
    with pytest.raises(ValueError, match="ncffed.secure_aggregation"):
        NCFFedConfig(secure_aggregation="dpf")
