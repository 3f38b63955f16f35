"""GMF, ItemPop and the random baseline: scoring contracts and a learning sanity check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recmodels.metrics import evaluate_sampled
from recmodels.models import GMF, ItemPop, RandomScorer, gmf_logits
from recmodels.sampling import sample_eval_candidates
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic
from recmodels.train import CentralConfig, CentralTrainer


@pytest.fixture(scope="module")
def split():
    data = generate_synthetic(n_users=150, n_items=80, seed=3, mean_interactions=15)
    return leave_one_out(data, seed=3)


def test_gmf_candidate_and_full_scores_agree_with_the_formula():
    g = torch.Generator().manual_seed(0)
    model = GMF(5, 7, 3, generator=g)
    with torch.no_grad():
        model.h.copy_(torch.tensor([0.5, -1.0, 2.0]))
        model.b.fill_(0.25)
    users = np.array([0, 4, 2])
    full = model.score_all(users)
    items = np.array([[1, 6], [0, 3], [5, 5]])
    cand = model.score(users, items)
    np.testing.assert_allclose(cand, np.take_along_axis(full, items, 1), rtol=1e-6)
    p, q = model.user.detach().numpy(), model.item.detach().numpy()
    expected = (p[4] * q[3] * np.array([0.5, -1.0, 2.0])).sum() + 0.25
    assert cand[1, 1] == pytest.approx(expected, rel=1e-6)
    assert gmf_logits(torch.ones(2, 3), torch.ones(2, 3), torch.ones(3), torch.zeros(())).tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="n_users=0"):
        GMF(0, 3, 2)


def test_itempop_scores_are_training_counts(split):
    pop = ItemPop(split.train)
    counts = np.bincount(split.train.items, minlength=split.train.n_items)
    np.testing.assert_array_equal(pop.score_all(np.array([0, 1]))[1], counts)
    np.testing.assert_array_equal(pop.score(np.array([0]), np.array([[3, 4]]))[0], counts[[3, 4]])


def test_random_scorer_is_deterministic_consistent_and_uniform():
    a, b, c = RandomScorer(50, 40, seed=1), RandomScorer(50, 40, seed=1), RandomScorer(50, 40, seed=2)
    users = np.arange(50)
    full = a.score_all(users)
    np.testing.assert_array_equal(full, b.score_all(users))
    assert not np.array_equal(full, c.score_all(users))
    items = np.tile(np.arange(40), (50, 1))
    np.testing.assert_array_equal(a.score(users, items), full)
    assert 0 <= full.min() and full.max() < 1
    assert abs(full.mean() - 0.5) < 0.02  # 2,000 uniform draws: sd of the mean ~0.0065


def test_centralised_gmf_learns_beyond_popularity_and_chance(split):
    candidates = sample_eval_candidates(split, n_negatives=30, rng=np.random.default_rng(0))
    trainer = CentralTrainer(split.train, CentralConfig(dim=16, lr=0.01, batch_size=128), seed=0)
    for _ in range(8):
        loss = trainer.run_round()["loss"]
    assert loss < 0.5
    gmf = evaluate_sampled(trainer.score, candidates, ks=(10,))["HR@10"]
    pop = evaluate_sampled(ItemPop(split.train).score, candidates, ks=(10,))["HR@10"]
    rnd = evaluate_sampled(RandomScorer(split.train.n_users, split.train.n_items).score, candidates, ks=(10,))["HR@10"]
    assert gmf > pop + 0.05 and gmf > rnd + 0.15


def test_central_config_refuses_bad_values():
    with pytest.raises(ValueError, match="lr"):
        CentralConfig(lr=-1)
    with pytest.raises(ValueError, match="batch_size"):
        CentralConfig(batch_size=0)


def test_bpr_trains_plain_mf_on_pairwise_differences_and_learns_beyond_popularity(split):
    """``loss = "bpr"``: the loss is -log sigmoid(s_ui - s_uj) over each positive and its sampled
    negative, GMF's output layer stays at ones and its bias at zero (plain MF), and it ranks."""
    candidates = sample_eval_candidates(split, n_negatives=30, rng=np.random.default_rng(0))
    cfg = CentralConfig(dim=16, lr=0.01, batch_size=128, loss="bpr", train_negatives=1)
    trainer = CentralTrainer(split.train, cfg, seed=0)
    model = trainer.model
    # the first epoch's loss starts at log 2 (scores near 0 at N(0, 0.01^2) init): the BPR formula
    first = trainer.run_round()
    assert first["examples"] == len(split.train) and 0.3 < first["loss"] < np.log(2) + 1e-3
    for _ in range(7):
        loss = trainer.run_round()["loss"]
    assert loss < first["loss"] - 0.2
    assert torch.equal(model.h.detach(), torch.ones_like(model.h)) and float(model.b) == 0.0
    bpr = evaluate_sampled(trainer.score, candidates, ks=(10,))["HR@10"]
    pop = evaluate_sampled(ItemPop(split.train).score, candidates, ks=(10,))["HR@10"]
    assert bpr > pop + 0.05
    # the loss is the pairwise formula on one hand-made batch
    u, i, j = torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])
    s = lambda a, b: (model.user[a] * model.item[b]).sum(-1)  # noqa: E731
    expect = -torch.nn.functional.logsigmoid(s(u, i) - s(u, j)).mean()
    got = -torch.nn.functional.logsigmoid(model(u, i) - model(u, j)).mean()
    torch.testing.assert_close(got, expect)


def test_bpr_config_needs_a_negative_and_a_known_loss():
    with pytest.raises(ValueError, match="train_negatives"):
        CentralConfig(loss="bpr", train_negatives=0)
    with pytest.raises(ValueError, match="loss"):
        CentralConfig(loss="hinge")
