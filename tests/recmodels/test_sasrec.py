"""The SASRec-style encoder: shapes, causality (the state at position t is independent of the items
after t, a property test), the last valid state beyond a row's length, per-row weights giving each
row's own gradient, dropout only with a generator; and the logQ / full-softmax options of Eq. (1)
against a direct per-positive computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recmodels.sasrec import SelfAttnEncoder
from recmodels.seqrec import contrastive_loss


def _enc(seed: int, n_items: int = 11, dim: int = 8, max_len: int = 7, heads: int = 2) -> SelfAttnEncoder:
    return SelfAttnEncoder(n_items, dim, max_len, blocks=2, heads=heads,
                           generator=torch.Generator().manual_seed(seed)).double()


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 4), length=st.integers(1, 7), t=st.integers(0, 6), seed=st.integers(0, 2**31 - 1))
def test_state_at_t_is_independent_of_the_items_after_t(b, length, t, seed):
    t = min(t, length - 1)
    rng = np.random.default_rng(seed)
    enc = _enc(seed % 97)
    seqs = torch.as_tensor(rng.integers(0, 11, (b, length)))
    lengths = torch.full((b,), length)
    other = seqs.clone()
    other[:, t + 1 :] = torch.as_tensor(rng.integers(0, 11, (b, length - t - 1)))
    a, c = enc.states(seqs, lengths), enc.states(other, lengths)
    assert a.shape == (b, length, 8)
    torch.testing.assert_close(a[:, : t + 1], c[:, : t + 1], rtol=0, atol=1e-12)
    if t + 1 < length and not torch.equal(seqs, other):  # the items after t do matter after t
        assert not torch.allclose(a[:, t + 1 :], c[:, t + 1 :])


@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 7), seed=st.integers(0, 2**31 - 1))
def test_padding_repeats_the_last_valid_state_and_encode_matches_the_unpadded_run(length, seed):
    rng = np.random.default_rng(seed)
    enc = _enc(seed % 89)
    n = int(rng.integers(1, length + 1))
    seqs = torch.as_tensor(rng.integers(0, 11, (1, length)))
    st_pad = enc.states(seqs, torch.tensor([n]))
    st_cut = enc.states(seqs[:, :n], torch.tensor([n]))
    torch.testing.assert_close(st_pad[:, :n], st_cut)
    for j in range(n, length):
        torch.testing.assert_close(st_pad[:, j], st_cut[:, -1])
    torch.testing.assert_close(enc.encode(seqs, torch.tensor([n])), st_cut[:, -1])


def test_per_row_weights_give_each_rows_gradient():
    enc = _enc(3)
    rng = np.random.default_rng(0)
    seqs, lengths = torch.as_tensor(rng.integers(0, 11, (3, 6))), torch.tensor([6, 4, 1])
    names = tuple(enc.shared_weights())
    w = enc.per_row_weights(3, names)
    enc.states(seqs, lengths, w).pow(2).sum(dim=(1, 2)).sum().backward()
    for r in range(3):
        enc.zero_grad()
        enc.states(seqs[r : r + 1], lengths[r : r + 1]).pow(2).sum().backward()
        for n, p in enc.named_parameters():
            torch.testing.assert_close(w[n].grad[r], p.grad, msg=n)


def test_dropout_needs_a_generator_and_is_reproducible_from_its_seed():
    enc = _enc(1)
    seqs, lengths = torch.as_tensor([[1, 2, 3, 4]]), torch.tensor([4])
    plain = enc.states(seqs, lengths)
    torch.testing.assert_close(enc.states(seqs, lengths, dropout=0.5), plain)  # no generator: no dropout
    a = enc.states(seqs, lengths, dropout=0.5, generator=torch.Generator().manual_seed(5))
    b = enc.states(seqs, lengths, dropout=0.5, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, plain)


def test_bad_sizes_name_the_values():
    with pytest.raises(ValueError, match="heads=3"):
        SelfAttnEncoder(5, 8, 4, heads=3)
    with pytest.raises(ValueError, match="exceeds the encoder's max_len 4"):
        SelfAttnEncoder(5, 8, 4).states(torch.zeros(1, 6, dtype=torch.long), torch.tensor([6]))


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 3), p=st.integers(1, 4), k=st.integers(1, 3), t=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_logq_and_full_softmax_match_a_per_positive_loop(m, p, k, t, seed):
    rng = np.random.default_rng(seed)
    n_items, d = 9, 3
    item = torch.as_tensor(rng.normal(size=(n_items, d)))
    u = torch.as_tensor(rng.normal(size=(m, p, d)))
    pos = torch.as_tensor(rng.integers(0, n_items, (m, p)))
    mask = torch.as_tensor(rng.random((m, p)) < 0.8)
    local = torch.as_tensor(rng.integers(0, n_items, (m, p, k)))
    hard = torch.as_tensor(rng.integers(0, n_items, (m, t)))
    lq, hq = math.log(k / n_items), math.log(t / 4)
    got = contrastive_loss(u, pos, mask, item, local_neg=local, hard_neg=hard, in_batch=False,
                           local_log_q=lq, hard_log_q=hq)
    full = contrastive_loss(u, pos, mask, item, local_neg=local, hard_neg=hard, full_softmax=True)
    for c in range(m):
        terms, terms_full = [], []
        for j in range(p):
            if not mask[c, j]:
                continue
            s0 = float(u[c, j] @ item[pos[c, j]])
            s = [s0] + [float(u[c, j] @ item[i]) - lq for i in local[c, j]] + [float(u[c, j] @ item[i]) - hq for i in hard[c]]
            terms.append(np.log(np.sum(np.exp(s))) - s0)
            terms_full.append(np.log(np.sum(np.exp([float(u[c, j] @ item[i]) for i in range(n_items)]))) - s0)
        assert float(got[c]) == pytest.approx(np.mean(terms) if terms else 0.0, rel=1e-9, abs=1e-9)
        assert float(full[c]) == pytest.approx(np.mean(terms_full) if terms_full else 0.0, rel=1e-9, abs=1e-9)
