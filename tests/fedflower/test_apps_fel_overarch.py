"""FEL's FL over-arch (``fel.over_arch_training = "fl"``, preset ``fel-fl``) as Flower apps over an in-process Grid.

The promise: after the leaves' round, every over-arch FedSGD step samples its cohort on the server
(the in-process seeded choice); each sampled client computes its features on its own node (every
leaf's model from the server, its own leaf vector, the other leaves folded in from its positives, its
negatives from its own keyed stream) and uploads one plaintext gradient with its loss sum and example
count; the server sums, divides by the examples and steps Adam. With the same seed the over-arch,
its Adam state, the leaves, the releases, the losses, the transcript and the ensemble's scores are
the in-process ``FelTrainer``'s (to float32 rounding: the gradient travels as float32). A malformed
over-arch reply drops only its sender from its step; the oracle is the in-process step without it.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, RecordDict

from fedflower.adapter import check_runs_on_flower, partition_meta
from fedflower.apps import STEP_UPDATE_KEY, RoundFailed
from protocols.fel import FelConfig

from .test_apps_fel import BASE, SPEC, fel_grid, in_process, releases, view
from .test_apps_loopback import _forged, make_data

logging.getLogger("flwr").setLevel(logging.ERROR)

FL = dict(BASE, combiner="over-arch", over_arch_training="fl", over_arch_clients=5, over_arch_steps=2,
          over_arch_hidden=4, over_arch_negatives=2, over_arch_lr=0.05)


def assert_same_over_arch(a, b) -> None:  # noqa: ANN001
    for (na, pa), (nb, pb) in zip(a.over_arch.named_parameters(), b.over_arch.named_parameters()):
        assert na == nb
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert a._adam.t == b._adam.t > 0


@pytest.mark.parametrize("seed, over", [
    (1, dict()),  # sequential: the leaves' own clients
    (2, dict(over_arch_composition="parallel", over_arch_holdout=0.25, over_arch_steps=1)),  # held-out users
    (3, dict(n_clusters=2, over_arch_negatives=0, leaf_model="ncf")),  # NCF leaves, positives only
])
def test_flower_fl_over_arch_gives_the_in_process_over_arch_leaves_and_scores(tmp_path, seed, over):
    train, exclude = make_data(24, 30, seed, low_ratings=True)
    cfg = FelConfig(**{**FL, **over})
    ref = in_process(train, exclude, cfg, seed)
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, seed)
    for _ in range(2):
        want, got = ref.run_round(), gt.run_round()
        assert got.extra["dropped"] == 0 and got.extra["leaf_clients"] == want.extra["leaf_clients"]
        assert got.loss == pytest.approx(want.loss, rel=1e-6, abs=1e-7)
        assert got.extra["over_arch_loss"] == pytest.approx(want.extra["over_arch_loss"], rel=1e-5, abs=1e-6)
        assert releases(got) == releases(want)  # the leaves' and the over-arch's (NonPrivate, step, clients)
        assert sum("over-arch" in r[0] for r in releases(got)) == cfg.over_arch_steps
    assert_same_over_arch(gt.server, ref)
    for a, b in zip(gt.server.leaves, ref.leaves):
        for name in ("item", "h", "b"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)
    assert view(gt.server.transport) == view(ref.transport)
    assert sum(r[3] == "over-arch-update" for r in view(ref.transport)) == 2 * cfg.over_arch_steps * min(
        cfg.over_arch_clients, len(ref.over_arch_population))
    # The ensemble through the over-arch, scored on each user's node (the server sends it with every leaf's model).
    users = np.array(partition_meta(tmp_path / "parts").users)
    items = np.tile(np.arange(6), (len(users), 1))
    np.testing.assert_allclose(gt.score(users, items), ref.score(users, items), rtol=1e-4, atol=1e-5)


def test_a_client_alone_uploads_its_row_of_the_batch():
    """Each client's upload depends on its own data and stream only (what makes the device step possible)."""
    train, exclude = make_data(24, 30, 4, low_ratings=True)
    ref = in_process(train, exclude, FelConfig(**FL), 4)
    ref.run_round()
    cohort = np.sort(ref.over_arch_population[:6])
    rows, loss, counts = ref.over_arch_upload(cohort, 1, 0, ref.over_arch)
    assert counts.min() > 0 and np.abs(rows).sum(1).min() > 0
    for i, u in enumerate(cohort):
        r, lo, n = ref.over_arch_upload(np.array([u]), 1, 0, ref.over_arch)
        np.testing.assert_allclose(r[0], rows[i], rtol=1e-6, atol=1e-8)  # (float32 features)
        assert n[0] == counts[i] and lo[0] == pytest.approx(loss[i], rel=1e-6)
    other, _, _ = ref.over_arch_upload(cohort, 1, 1, ref.over_arch)  # another step: other negatives
    assert not np.allclose(other, rows)


def _replace_step(reply: Message, fn) -> Message:  # noqa: ANN001
    arrays = {k: v.numpy() for k, v in reply.content[STEP_UPDATE_KEY].items()}
    fn(arrays)
    return _forged(RecordDict({STEP_UPDATE_KEY: ArrayRecord({k: Array(v) for k, v in arrays.items()})}), reply)


@pytest.mark.parametrize("attack, reason", [
    (lambda r: _replace_step(r, lambda a: a.update(gradient=np.full_like(a["gradient"], np.nan))), "finite"),
    (lambda r: _replace_step(r, lambda a: a.update(gradient=a["gradient"][:-1])), "gradient float32"),
    (lambda r: _replace_step(r, lambda a: a.pop("examples")), "upload fields"),
    (lambda r: _replace_step(r, lambda a: a.update(loss=np.asarray(a["loss"], np.float32))), "loss float32"),
    (lambda r: [r, r], "more than one reply"),
])
def test_a_malformed_over_arch_reply_drops_only_its_sender(tmp_path, attack, reason):
    train, exclude = make_data(24, 30, 5, low_ratings=True)
    cfg = FelConfig(**{**FL, "over_arch_steps": 1})
    victim: dict[str, int] = {}

    def tamper(stage, nid, reply):  # noqa: ANN001 - the first node answering the over-arch step
        if STEP_UPDATE_KEY not in reply.content.keys():
            return reply
        victim.setdefault("nid", nid)
        return attack(reply) if nid == victim["nid"] else reply

    gt, _ = fel_grid(tmp_path, train, exclude, cfg, 5, tamper=tamper)
    stats = gt.run_round()
    assert stats.extra["dropped"] == 1 and reason in stats.extra["drop_reasons"][0]
    assert stats.extra["drop_reasons"][0].startswith("over-arch step 0: user ")
    victim_user = next(u for u, n in gt.node_of.items() if n == victim["nid"])
    # Oracle: the in-process step over the cohort without the victim.
    ref = in_process(train, exclude, cfg, 5)
    inner = ref._device_step

    def without_victim(t, step, cohort):  # noqa: ANN001, ANN202
        kept, rows, loss, counts = inner(t, step, cohort)
        keep = kept != victim_user
        assert (~keep).sum() == 1
        return kept[keep], rows[keep], loss[keep], counts[keep]

    ref._device_step = without_victim
    want = ref.run_round()
    assert releases(stats) == releases(want)
    assert_same_over_arch(gt.server, ref)
    untouched = in_process(train, exclude, cfg, 5)
    untouched.run_round()
    assert not torch.allclose(untouched.over_arch.l1.weight, gt.server.over_arch.l1.weight)


def test_an_over_arch_step_nobody_answers_stops_the_run_in_words(tmp_path):
    train, exclude = make_data(24, 30, 6, low_ratings=True)

    def tamper(stage, nid, reply):  # noqa: ANN001
        return _replace_step(reply, lambda a: a.pop("loss")) if STEP_UPDATE_KEY in reply.content.keys() else reply

    gt, _ = fel_grid(tmp_path, train, exclude, FelConfig(**FL), 6, tamper=tamper)
    with pytest.raises(RoundFailed, match="over-arch step 0: no client of 5 answered validly"):
        gt.run_round()


def test_what_of_the_over_arch_does_not_run_on_devices_is_refused_in_words():
    check_runs_on_flower(SPEC, FelConfig(**FL))
    check_runs_on_flower(SPEC, FelConfig(**FL, dp="central"))
    for bad, why in ((dict(over_arch_training="opt-in", opt_in_fraction=0.2), "opt-in users. labels"),
                     (dict(dp="distributed", secure_aggregation="secagg+"), "DP-FedSGD"),
                     (dict(dp="central", secure_aggregation="secagg+"), "secure leaves"),
                     (dict(secure_aggregation="secagg+"), "secure leaves")):
        with pytest.raises(ValueError, match=f"cannot run with its clients on separate devices.*{why}"):
            check_runs_on_flower(SPEC, FelConfig(**{**FL, **bad}))


def _without_clipped_fraction(stats) -> list[tuple]:  # noqa: ANN001 - the devices clip: the server cannot know it
    out = []
    for what, cohort, event, params in releases(stats):
        p = json.loads(params)
        p.pop("clipped_fraction", None)
        out.append((what, cohort, event, json.dumps(p, sort_keys=True)))
    return out


@pytest.mark.parametrize("seed, over", [
    (7, dict()),
    (8, dict(sampling="poisson", over_arch_composition="parallel", over_arch_holdout=0.25)),
])
def test_noise_free_central_dp_over_arch_on_flower_equals_in_process(tmp_path, seed, over):
    """Central DP in plaintext, noise off: each device clips the gradient of its mean loss (a clip that
    binds: over_arch_clip 0.05), the server sums over the fixed denominator and steps Adam."""
    train, exclude = make_data(24, 30, seed, low_ratings=True)
    cfg = FelConfig(**{**FL, "dp": "central", "clip": 0.5, "noise_multiplier": 0.0, "server_lr": 5.0,
                       "over_arch_clip": 0.05, "over_arch_noise_multiplier": 0.0, **over})
    ref = in_process(train, exclude, cfg, seed)
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, seed)
    for _ in range(2):
        want, got = ref.run_round(), gt.run_round()
        assert got.extra["dropped"] == 0
        assert _without_clipped_fraction(got) == _without_clipped_fraction(want)
        oa = [r for r in want.releases if r.params.get("over_arch") == "fl"]
        assert oa and all("clipped_fraction" in r.params for r in oa)
        assert not any("clipped_fraction" in r.params for r in got.releases if r.params.get("over_arch") == "fl")
        assert got.extra["over_arch_loss"] == pytest.approx(want.extra["over_arch_loss"], rel=1e-5, abs=1e-6)
    assert max(r.params["clipped_fraction"] for r in oa) > 0  # (the clip binds)
    assert_same_over_arch(gt.server, ref)
    for a, b in zip(gt.server.leaves, ref.leaves):
        for name in ("item", "h", "b"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)


def test_an_over_arch_gradient_over_its_clip_drops_its_sender(tmp_path):
    train, exclude = make_data(24, 30, 9, low_ratings=True)
    cfg = FelConfig(**{**FL, "dp": "central", "noise_multiplier": 0.0, "over_arch_clip": 0.05,
                       "over_arch_noise_multiplier": 0.0, "over_arch_steps": 1})
    victim: dict[str, int] = {}

    def tamper(stage, nid, reply):  # noqa: ANN001 - one device sends its gradient unclipped (x 10)
        if STEP_UPDATE_KEY not in reply.content.keys():
            return reply
        victim.setdefault("nid", nid)
        return _replace_step(reply, lambda a: a.update(gradient=a["gradient"] * 10)) if nid == victim["nid"] else reply

    gt, _ = fel_grid(tmp_path, train, exclude, cfg, 9, tamper=tamper)
    stats = gt.run_round()
    assert stats.extra["dropped"] == 1 and "over its clip 0.05" in stats.extra["drop_reasons"][0]
    (rel,) = [r for r in stats.releases if r.params.get("over_arch") == "fl"]
    assert rel.params["clients"] == cfg.over_arch_clients and rel.params["denominator"] == cfg.over_arch_clients
