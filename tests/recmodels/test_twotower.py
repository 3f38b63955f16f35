"""Letter-trigram hashing, the user-feature rule, DSSM/CLSM towers, the sampled-softmax loss and FedAdam."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recmodels.data import Interactions
from recmodels.trigram import TrigramVocab, first_click_features, letter_trigrams, words
from recmodels.twotower import CLSMTower, DSSMTower, FedAdam, make_tower, sampled_softmax_loss


def test_letter_trigrams_of_a_word():
    assert letter_trigrams("cat") == ["#ca", "cat", "at#"]
    assert letter_trigrams("a") == ["#a#"]
    assert words("Toy Story (1995) Animation|Children's") == ["toy", "story", "1995", "animation", "children", "s"]


def test_vocab_keeps_the_most_frequent_trigrams_and_maps_the_rest_to_oov():
    vocab = TrigramVocab.build(["cat cat cat", "dog"], hash_dim=4)
    assert vocab.trigrams == ("#ca", "at#", "cat")  # frequency 3 each, ties by text; dog's do not fit
    bag = vocab.bag(["cat", "dog", "zebra cat"]).toarray()
    assert bag[0].tolist() == [1, 1, 1, 0]
    assert bag[1].tolist() == [0, 0, 0, 3]  # every trigram of "dog" is out of vocabulary
    assert bag[2].tolist() == [1, 1, 1, 5]
    with pytest.raises(ValueError, match="hash_dim"):
        TrigramVocab.build(["x"], hash_dim=1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(alphabet="abc xyz", max_size=20), min_size=1, max_size=6), st.integers(2, 30))
def test_bag_counts_every_trigram_once(texts, hash_dim):
    vocab = TrigramVocab.build(texts, hash_dim)
    bag = vocab.bag(texts)
    for r, text in enumerate(texts):
        assert bag[r].sum() == sum(len(letter_trigrams(w)) for w in words(text))
    per_word, lengths = vocab.words(texts, max_words=3)
    for r, text in enumerate(texts):
        assert lengths[r] == min(3, len(words(text)))
        for j in range(3):  # the per-word rows are the bags of the words
            expect = vocab.bag([words(text)[j]]).toarray() if j < lengths[r] else np.zeros((1, hash_dim))
            assert np.array_equal(per_word[r * 3 + j].toarray(), expect)


def _train() -> Interactions:
    users = np.array([0, 0, 0, 1, 1, 2])
    items = np.array([3, 1, 2, 0, 2, 1])
    ts = np.array([30, 10, 20, 5, 6, 1])
    return Interactions(users=users, items=items, ratings=np.ones(6), timestamps=ts,
                        user_ids=np.arange(3), item_ids=np.arange(4))


def test_first_clicks_become_the_feature_and_leave_the_positives():
    texts, rest, pairs = first_click_features(_train(), ["a0", "a1", "a2", "a3"], n_clicks=2)
    # user 0: clicks 1 (t=10) and 2 (t=20) are the feature, 3 stays a positive; user 1 keeps one
    # positive so only its first click (0) is used; user 2 has a single click: no feature.
    assert texts == ["a1 a2", "a0", ""]
    assert sorted(map(tuple, pairs.tolist())) == [(0, 1), (0, 2), (1, 0)]
    kept = set(zip(rest.users.tolist(), rest.items.tolist()))
    assert kept == {(0, 3), (1, 2), (2, 1)}
    assert not kept & set(map(tuple, pairs.tolist()))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_dssm_shapes_init_and_dropout_masks():
    tower = DSSMTower(32, dropout=0.2, init_std=0.1, generator=_gen())
    assert [tuple(layer.weight.shape) for layer in tower.layers] == [(256, 32), (128, 256), (128, 128)]
    assert abs(float(tower.layers[0].weight.detach().std()) - 0.1) < 0.01
    x = torch.rand(5, 32)
    masks = tower.masks(5, _gen(1))
    assert [tuple(m.shape) for m in masks] == [(5, 256), (5, 128)]
    assert set(torch.unique(masks[0]).tolist()) <= {0.0, 1 / 0.8}
    out = tower(x, masks)
    assert out.shape == (5, 128) and float(out.abs().max()) <= 1.0
    # unbatched rows give the batched result (what vmap relies on)
    assert torch.allclose(tower(x[2], [m[2] for m in masks]), out[2], atol=1e-6)
    assert not torch.allclose(tower(x, None), out)  # the masks are applied


def test_clsm_ignores_padding_and_pools_over_words():
    tower = CLSMTower(16, dropout=0.0, init_std=0.1, generator=_gen())
    x = torch.rand(2, 4, 16)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    out = tower(x, mask)
    assert out.shape == (2, 128)
    x2 = x.clone()
    x2[0, 3] = 5.0  # a padded word changes nothing ...
    assert torch.allclose(tower(x2, mask)[0], out[0])
    x2[0, 0] = 5.0  # ... a real word does
    assert not torch.allclose(tower(x2, mask)[0], out[0])
    empty = tower(torch.zeros(1, 4, 16), torch.zeros(1, 4, dtype=torch.bool))
    assert torch.isfinite(empty).all()
    with pytest.raises(ValueError, match="tower"):
        make_tower("rnn", 16, dropout=0.0, init_std=0.1, generator=_gen())


def test_sampled_softmax_loss_is_eq8_over_cosines():
    u = torch.tensor([1.0, 0.0])
    items = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0]])
    labels = torch.tensor([1.0, 0.0, 0.0])
    cos = torch.tensor([1.0, 0.0, -1.0])
    expect = -torch.log_softmax(cos / 0.5, 0)[0] / 3
    assert torch.allclose(sampled_softmax_loss(u, items, labels, temperature=0.5), expect)


def test_fedadam_descends_with_the_gradient_sign():
    """Notes G2: the paper's '+' would climb; ours must lower a quadratic and match the formula."""
    p = {"w": torch.tensor([3.0, -2.0])}
    opt = FedAdam(p, lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    g = 2 * p["w"].clone()
    opt.step(p, {"w": g})
    m, v = 0.1 * g, 0.01 * g * g
    assert torch.allclose(p["w"], torch.tensor([3.0, -2.0]) - 0.1 * m / (v.sqrt() + 1e-3))
    for _ in range(50):
        opt.step(p, {"w": 2 * p["w"]})
    assert float((p["w"] ** 2).sum()) < 1.0
