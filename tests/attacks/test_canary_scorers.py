"""Canary scorers (attacks/canary.py): centred (swapping a canary's two sets negates its score), abstaining
where the view holds nothing readable, and FEL's opt-in canaries abstained on."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attacks.canary import score_fedmf_uploads, score_fel_leaves, score_update_rows
from experiments.run.canaries import Canaries
from protocols.fedavg import ClientUpdate
from protocols.fedmf import Upload
from protocols.fel_leaf import LeafModel
from protocols.transport import SERVER, Record

N_ITEMS, DIM = 20, 3
CAN = Canaries(users=np.array([5, 6, 7]), items_a=np.array([[10, 11], [12, 13], [14, 15]]),
               items_b=np.array([[16, 17], [18, 19], [0, 1]]), included=None)
SWAPPED = Canaries(CAN.users, CAN.items_b, CAN.items_a, None)


def _update(u: int, rows: list[int], rng: np.random.Generator) -> Record:
    delta = rng.normal(size=(len(rows), DIM)).astype(np.float32)
    up = ClientUpdate(user=u, rows=np.array(rows, np.int64), item_delta=delta, h_delta=np.zeros(DIM, np.float32),
                      b_delta=0.0, weight=1.0)
    return Record(f"client:{u}", SERVER, 0, "update", 0, up)


def test_update_rows_score_the_set_a_canary_has_and_abstain_on_unreadable_views() -> None:
    rng = np.random.default_rng(0)
    view = [_update(5, [10, 11, 2], rng),  # canary 0 touched set A
            _update(6, [18, 19], rng),  # canary 1 touched set B
            Record("client:7", SERVER, 0, "update", 0, np.arange(9, dtype=np.uint64)),  # masked: unreadable
            _update(3, [14, 15], rng)]  # not a canary: ignored
    s = score_update_rows(view, {}, CAN)
    assert s[0] > 0 and s[1] < 0 and np.isnan(s[2])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_scores_are_centred_swapping_the_sets_negates_them(seed: int) -> None:
    rng = np.random.default_rng(seed)
    view = [_update(int(u), sorted(rng.choice(N_ITEMS, 6, replace=False).tolist()), rng) for u in CAN.users]
    np.testing.assert_allclose(score_update_rows(view, {}, SWAPPED), -score_update_rows(view, {}, CAN))
    mf = [Record(f"client:{u}", SERVER, 0, "update", 0, Upload(int(u), 0, None, rng.laplace(size=(N_ITEMS, DIM))))
          for u in CAN.users]
    np.testing.assert_allclose(score_fedmf_uploads(mf, {}, SWAPPED), -score_fedmf_uploads(mf, {}, CAN))


def test_fel_reads_each_canary_s_leaf_and_abstains_on_opt_in_canaries() -> None:
    before = np.zeros(N_ITEMS * DIM + DIM + 1, np.float32)
    after = before.copy()
    after[10 * DIM:12 * DIM] = 1.0  # leaf 0 moved canary 0's set A
    after[18 * DIM:20 * DIM] = 1.0  # and canary 1's set B
    view = [Record(SERVER, "leaf:0", 0, "leaf-model", 0, LeafModel(0, 0, before, after))]
    public = {"n_items": N_ITEMS, "config": {"dim": DIM}, "assignment": [0] * 8, "opt_in": [7], "held_out": []}
    s = score_fel_leaves(view, public, CAN)
    assert s[0] > 0 and s[1] < 0 and np.isnan(s[2])
