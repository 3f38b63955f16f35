"""FEL's DP leaves with Poisson sampling (``fel.sampling = "poisson"``) on Flower.

A Poisson-sampled DP leaf draws its cohort first (each of its clients independently with
probability ``q``, from the leaf's own seeded generator), releases the noise alone when nobody was
drawn, and otherwise runs FedAvg's round on that draw, which asks the leaf for its cohort a second
time. On Flower the cohort is reached once: the grid-bound unit hands back the cohort it already
exchanged with, and an empty cohort sends no message at all. With the same seed the cohorts (their
random sizes included), the releases (``PoissonSampled`` events) and, noise-free, the leaves are
the in-process ``FelTrainer``'s, for GMF and NCF leaves, central DP in plaintext or through SecAgg+
and distributed DP through SecAgg+.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from fedflower.adapter import check_runs_on_flower
from protocols.fel import FelConfig

from .test_apps_fel import BASE, SPEC, fel_grid, in_process, releases
from .test_apps_loopback import make_data

logging.getLogger("flwr").setLevel(logging.ERROR)

POISSON = dict(sampling="poisson", clip=0.5, server_lr=2.0, frac_bits=20, value_clip=64.0, noise_multiplier=0.0)


@pytest.mark.parametrize("seed, over", [
    (41, dict(dp="central")),  # the server clips and noises in plaintext
    (42, dict(dp="central", secure_aggregation="secagg+")),
    (43, dict(dp="distributed", secure_aggregation="secagg+", leaf_model="ncf")),  # devices clip, MLP included
    (44, dict(dp="central", clients_per_round=1)),  # q = 1 / pool: leaf 1's cohort is empty every round
])
def test_poisson_sampled_dp_leaves_ask_each_cohort_once_and_equal_in_process(tmp_path, seed, over):
    train, exclude = make_data(24, 30, seed, low_ratings=True)
    cfg = FelConfig(**{**BASE, **POISSON, **over})
    ref = in_process(train, exclude, cfg, seed)
    gt, grid = fel_grid(tmp_path, train, exclude, cfg, seed)
    asked: Counter = Counter()

    def count(stage, nid, reply):  # noqa: ANN001 - a node's replies (one per message it was sent)
        asked[nid] += 1
        return reply

    grid.tamper = count
    sizes = []
    for _ in range(3):
        asked.clear()
        want, got = ref.run_round(), gt.run_round()
        assert got.extra["leaf_clients"] == want.extra["leaf_clients"] and got.extra["dropped"] == 0
        assert releases(got) == releases(want)  # per leaf: its Poisson cohort's, or "noise only" if empty
        sizes += want.extra["leaf_clients"]
        # every sampled client was asked, and only them; a plaintext round is one message each
        assert len(asked) == sum(want.extra["leaf_clients"])
        if cfg.secure_aggregation == "none":
            assert set(asked.values()) <= {1}
    assert got.releases and all(r.params["sampling"] == "poisson" for r in got.releases)
    assert len(set(sizes)) > 1  # the cohorts' sizes are random
    if seed == 44:
        assert 0 in sizes and any("empty Poisson cohort" in r.what for r in got.releases)
    for a, b in zip(gt.server.leaves, ref.leaves, strict=True):
        assert a.round == b.round == 3
        for name in a.global_arrays():
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)


def test_noisy_poisson_leaves_release_what_the_in_process_leaves_release(tmp_path):
    """With noise (fresh from the CSPRNG, so the models differ) the releases are the in-process ones:
    a Poisson-sampled Gaussian at the leaf's ``q`` per leaf and round."""
    train, exclude = make_data(24, 30, 45, low_ratings=True)
    cfg = FelConfig(**{**BASE, **POISSON, "dp": "central", "noise_multiplier": 1.0})
    ref = in_process(train, exclude, cfg, 45)
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, 45)
    want, got = ref.run_round(), gt.run_round()
    assert releases(got) == releases(want)
    assert [type(r.event).__name__ for r in got.releases] == ["PoissonSampled"] * cfg.n_clusters
    assert [r.event.sampling_probability for r in got.releases] == [leaf.q for leaf in ref.leaves]


def test_poisson_sampling_and_ncf_leaves_pass_the_flower_check():
    for dp in ("central", "distributed"):
        for leaf in ("gmf", "ncf"):
            check_runs_on_flower(SPEC, FelConfig(secure_aggregation="secagg+", combiner="mean", dp=dp,
                                                 sampling="poisson", leaf_model=leaf))
