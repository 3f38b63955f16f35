"""FedFast and one key setup per round (issue 27 item 3; docs/fedfast.md, "Secure sums and key setups").

A reused setup serves a later sum only over a cohort that nests in the previous instance's survivors and
loses at most the clients' planned dropout (``secagg.reuse_sim.ReuseSession.check_cohort``). No two
secure sums of a FedFast round meet that: each pays its own setup, the same model with or without
``setup_reuse``; and a FedFast whose per-cluster sums named one setup per cluster is refused in words
(without the check the later sums would run short of their clients: tests/secagg/test_reuse_cohort.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocols.exchange import setup_reuse
from protocols.fedfast import FedFastConfig, FedFastGMF
from protocols.secure_sum import observe
from recmodels.synthetic import generate_synthetic
from secagg.costmodel import nesting_setups
from secagg.reuse_sim import SetupCohortError


def _data(users: int = 24, items: int = 30, seed: int = 0):
    return generate_synthetic(n_users=users, n_items=items, dim=6, mean_interactions=8, seed=seed)


def _cfg(**kw) -> FedFastConfig:
    base = dict(dim=6, clients_per_round=6, clusters=3, local_batch_size=16, secure_aggregation="secagg+",
                kmeans_init_iters=1)
    base.update(kw)
    return FedFastConfig(**base)


def _model(m: FedFastGMF) -> dict[str, torch.Tensor]:
    return {"user": m.user.clone(), "item": m.item.clone(), "h": m.h.clone(), "b": m.b.clone()}


class _OneSetupPerCluster(FedFastGMF):
    """FedFast with every per-cluster sum naming one key setup per cluster (the wiring docs/fedfast.md
    rejects: the clusters of successive sums are different partitions and the delegates are few)."""

    def _spec(self, width, kind):  # noqa: ANN001, ANN202
        spec = super()._spec(width, kind)
        return dataclasses.replace(spec, setup="fedfast-cluster") if kind in self.GROUPED_STEPS else spec


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**4), st.sampled_from(["secagg", "secagg+"]))
def test_a_later_sum_nests_in_an_earlier_one_only_when_a_whole_cluster_is_delegates(seed, protocol):
    """Every secure sum pays its own setup; the only sums that could have run in an earlier sum's setup
    (nesting in its survivors within the planned dropout) are delegates-only sums: a cluster whose
    members were all sampled, which the toy's 3 clusters of 24 users allow and the preset's 20 of 943
    with 40 delegates do not (docs/fedfast.md). The model is the plaintext one."""
    train = _data(seed=seed % 5)
    m = FedFastGMF(train, _cfg(secure_aggregation=protocol), seed=seed)
    plain = FedFastGMF(train, _cfg(secure_aggregation="none"), seed=seed)
    for _ in range(2):
        seen: list[dict] = []
        with observe(seen.append):
            m.run_round()
        plain.run_round()
        assert seen and all(i["setup"] and not i["reuse"] for i in seen)  # one key setup per secure sum
        delegates = {name for i in seen if i["dim"] == m._update_width for name in i["senders"]}
        for j in nesting_setups(seen):
            event("a delegates-only sum nests")
            assert set(seen[j]["senders"]) <= delegates
    for k, v in _model(plain).items():
        np.testing.assert_allclose(_model(m)[k].numpy(), v.numpy(), atol=2e-5, err_msg=k)


def test_the_round_is_the_same_with_and_without_setup_reuse():
    train = _data(seed=2)
    runs = []
    for reuse in (True, False):
        m = FedFastGMF(train, _cfg(), seed=7)
        seen: list[dict] = []
        with setup_reuse(reuse), observe(seen.append):
            m.run_round(), m.run_round()
        runs.append((m, len(seen), sum(i["setup"] for i in seen)))
    (a, n_a, s_a), (b, n_b, s_b) = runs
    assert n_a == n_b == s_a == s_b  # as many key setups as secure sums either way
    np.testing.assert_array_equal(a.assign, b.assign)
    for k, v in _model(a).items():
        np.testing.assert_allclose(_model(b)[k].numpy(), v.numpy(), atol=0, err_msg=k)


def test_one_setup_per_cluster_is_refused_in_words_not_run_short_of_its_clients():
    train = _data(seed=1)
    m = _OneSetupPerCluster(train, _cfg(), seed=3)
    with pytest.raises(SetupCohortError, match="must nest|leave out"):
        m.run_round()
    # with the reuse off every sum pays its own setup: the model of FedFast itself
    ref, off = FedFastGMF(train, _cfg(), seed=3), _OneSetupPerCluster(train, _cfg(), seed=3)
    with setup_reuse(False):
        ref.run_round(), off.run_round()
    for k, v in _model(ref).items():
        np.testing.assert_allclose(_model(off)[k].numpy(), v.numpy(), atol=0, err_msg=k)
