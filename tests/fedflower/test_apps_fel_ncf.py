"""FEL with NCF leaves (``fel.leaf_model = "ncf"``) as Flower apps over the protobuf loopback grid.

The promise is the GMF leaves' (tests/fedflower/test_apps_fel.py): each leaf is a unit; the server
runs FEL's own round, each cohort reached through the grid, each client trains only its own leaf.
An NCF leaf's global model is GMF's ``item, h, b`` plus its MLP ``W, c`` (the unit's
``global_arrays()``), and its upload GMF's fields plus the MLP's change ``W_delta, c_delta`` (its
``upload_fields()``), validated at the boundary like the rest. With the same seed the leaves (MLP
included), losses, releases, transcript and ensemble scores are the in-process ``FelTrainer``'s,
to float32 rounding, in plaintext, through per-leaf SecAgg/SecAgg+ and under DP. A bad reply (an
MLP field missing, of the wrong shape or dtype, or not finite) drops only its sender; a client
that drops out of a secure leaf's round is out of that leaf's sum.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedflower.adapter import UPDATE_KEYS, BadReply, decode_update, encode_update
from protocols.fedavg import LocalRound
from protocols.fel import FelConfig

from .test_apps_fel import BASE, aggregate_without, fel_grid, in_process, releases, round_with_a_bad_first_reply, view
from .test_apps_loopback import make_data

logging.getLogger("flwr").setLevel(logging.ERROR)

NCF = {**BASE, "leaf_model": "ncf"}
NAMES = ("item", "h", "b", "W", "c")


def assert_leaves_close(a_leaves, b_leaves, *, atol: float = 1e-6) -> None:  # noqa: ANN001
    for a, b in zip(a_leaves, b_leaves, strict=True):
        for name in NAMES:
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=atol)


@pytest.mark.parametrize("seed, over", [
    (31, dict()),
    pytest.param(32, dict(combiner="max", item_aggregation="mean", local_epochs=2, local_batch_size=6),
                 marks=pytest.mark.slow),
    (33, dict(n_clusters=2, secure_aggregation="secagg+")),
    pytest.param(34, dict(n_clusters=2, secure_aggregation="secagg", item_aggregation="touched"),
                 marks=pytest.mark.slow),
    (35, dict(dp="central", clip=0.5, noise_multiplier=0.0, server_lr=5.0)),  # the server clips in plaintext
    (36, dict(n_clusters=2, dp="distributed", secure_aggregation="secagg+", noise_multiplier=0.0, clip=0.5,
              server_lr=2.0, frac_bits=20, value_clip=64.0)),  # each device clips its own update (MLP included)
])
def test_flower_ncf_leaves_give_the_in_process_leaves_and_ensemble(tmp_path, seed, over):
    train, exclude = make_data(24, 30, seed, low_ratings=True)
    cfg = FelConfig(**{**NCF, **over})
    ref = in_process(train, exclude, cfg, seed)
    gt, _ = fel_grid(tmp_path, train, exclude, cfg, seed)
    secure = cfg.secure_aggregation != "none"
    before = [leaf.W.clone() for leaf in gt.server.leaves]
    for _ in range(2):
        want, got = ref.run_round(), gt.run_round()
        assert got.clients == want.clients and got.extra["dropped"] == 0
        assert got.extra["leaf_clients"] == want.extra["leaf_clients"]
        if cfg.dp == "none" or not secure:
            assert got.loss == pytest.approx(want.loss, rel=1e-5 if secure else 1e-6, abs=1e-6)
        assert releases(got) == releases(want)
    assert_leaves_close(gt.server.leaves, ref.leaves)
    assert all(not torch.equal(w, leaf.W) for w, leaf in zip(before, gt.server.leaves))  # the MLP was trained
    if not secure:
        assert view(gt.server.transport) == view(ref.transport) and len(view(ref.transport)) > 0
    users = np.array(gt.meta.users)
    items = np.tile(np.arange(6), (len(users), 1))
    np.testing.assert_allclose(gt.score(users, items), ref.score(users, items), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gt.score_all(users), ref.score_all(users), rtol=1e-5, atol=1e-6)


def test_an_ncf_leaf_sends_its_mlp_and_receives_its_change(tmp_path):
    """The wire: the model record holds the leaf's MLP, the reply its change (and GMF's fields)."""
    train, exclude = make_data(24, 30, 37)
    cfg = FelConfig(**NCF)
    gt, grid = fel_grid(tmp_path, train, exclude, cfg, 37)
    leaf = gt.units[0]
    d = cfg.dim
    rec = gt._model_record(leaf)
    assert list(rec.keys()) == ["item", "h", "b", "W", "c"]
    assert rec["W"].numpy().shape == (d * 2 * d,) and rec["c"].numpy().shape == (d,)
    assert len(gt._all_units_record().keys()) == len(NAMES) * cfg.n_clusters
    seen: list[set] = []

    def spy(stage, nid, reply):  # noqa: ANN001
        if not reply.has_error():
            seen.append(set(reply.content["update"].keys()))
        return reply

    grid.tamper = spy
    gt.run_round()
    assert seen and all(keys == UPDATE_KEYS | {"W_delta", "c_delta"} for keys in seen)


#: Attacks on an NCF leaf's own fields; the first two run through the grid, all through the decoder.
ATTACKS = [
    (lambda a: a.pop("W_delta"), "missing \\['W_delta'\\]"),
    (lambda a: a["W_delta"].__setitem__(0, np.nan), "non-finite"),
    (lambda a: a.update(c_delta=a["c_delta"][:-1]), "'c_delta' is float32 of shape"),
    (lambda a: a.update(W_delta=a["W_delta"].astype(np.float64)), "'W_delta' is float64"),
    (lambda a: a.update(extra=np.zeros(1, np.float32)), "extra \\['extra'\\]"),
]


def test_the_decoder_refuses_every_bad_ncf_field():
    d, n_items = 3, 30
    fields = {"W_delta": torch.ones(1, d * 2 * d), "c_delta": torch.ones(1, d)}
    lr = LocalRound(P=torch.zeros(1, d), pair_slot=np.zeros(2, np.int64), pair_item=np.array([1, 4]),
                    dQ=torch.ones(2, d), dH=torch.ones(1, d), dB=torch.ones(1), weight=torch.ones(1), loss=1.0,
                    examples=2)
    schema = {"W_delta": (d * 2 * d,), "c_delta": (d,)}
    decode_update(encode_update(lr, fields), n_items=n_items, dim=d, fields=schema)
    for attack, reason in ATTACKS:
        arrays = encode_update(lr, fields)
        attack(arrays)
        with pytest.raises(BadReply, match=reason):
            decode_update(arrays, n_items=n_items, dim=d, fields=schema)


@pytest.mark.parametrize("attack, reason", ATTACKS[:2])
def test_a_bad_ncf_reply_drops_only_its_sender_from_its_leaf(tmp_path, attack, reason):
    train, exclude = make_data(24, 30, 38)
    cfg = FelConfig(**NCF)
    # Oracle: in-process; leaf 0 aggregates over its cohort without the victim (MLP changes included).
    gt, stats, ref, _ = round_with_a_bad_first_reply(tmp_path, train, exclude, cfg, 38, attack)
    assert stats.extra["dropped"] == 1 and re.search(f"unit 0: user .*{reason}", stats.extra["drop_reasons"][0])
    assert_leaves_close(gt.server.leaves, ref.leaves)
    assert not torch.allclose(gt.server.leaves[0].W, in_process(train, exclude, cfg, 38).leaves[0].W)


def test_a_secure_ncf_leaf_sums_its_survivors(tmp_path):
    train, _ = make_data(24, 30, 39)
    cfg = FelConfig(**{**NCF, "n_clusters": 2, "secure_aggregation": "secagg"})
    gone: set[int] = set()
    gt, _ = fel_grid(tmp_path, train, None, cfg, 39, drop=lambda stage, nid: stage == 2 and nid in gone)
    ref = in_process(train, None, replace(cfg, secure_aggregation="none"), 39)
    sampled = ref.leaves[0]._sample_clients()
    victim = int(sampled[0])
    gone.add(gt.node_of[victim])
    stats = gt.run_round()
    assert stats.extra["dropped"] == 1 and stats.extra["leaf_clients"][0] == len(sampled) - 1
    # Oracle: the plaintext in-process leaf over the survivors (the secure sum is exact up to the encoding).
    leaf0 = ref.leaves[0]
    aggregate_without(leaf0, sampled, victim)
    ref.leaves[1].run_round()
    assert_leaves_close(gt.server.leaves, ref.leaves, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 5), dim=st.integers(1, 4), n_items=st.integers(1, 12), seed=st.integers(0, 2**31),
       names=st.lists(st.sampled_from(["W_delta", "c_delta", "z"]), unique=True))
def test_an_upload_with_a_units_own_fields_round_trips_and_its_schema_is_enforced(n, dim, n_items, seed, names):
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(n_items, size=min(n, n_items), replace=False)).astype(np.int64)
    schema = {k: (int(rng.integers(1, 6)),) for k in names}
    fields = {k: torch.as_tensor(rng.normal(size=(1, *s)).astype(np.float32)) for k, s in schema.items()}
    lr = LocalRound(P=torch.zeros(1, dim), pair_slot=np.zeros(len(rows), np.int64), pair_item=rows,
                    dQ=torch.as_tensor(rng.normal(size=(len(rows), dim)).astype(np.float32)),
                    dH=torch.as_tensor(rng.normal(size=(1, dim)).astype(np.float32)), dB=torch.ones(1),
                    weight=torch.full((1,), 3.0), loss=1.5, examples=3)
    arrays = encode_update(lr, fields)
    assert set(arrays) == UPDATE_KEYS | set(schema)
    got = decode_update(arrays, n_items=n_items, dim=dim, fields=schema)
    for k in schema:
        np.testing.assert_array_equal(got.fields[k], fields[k][0].numpy())
    np.testing.assert_array_equal(got.item_delta, lr.dQ.numpy())
    if schema:  # a reply without the unit's fields, or checked against no schema, is refused
        with pytest.raises(BadReply, match="missing"):
            decode_update({k: v for k, v in arrays.items() if k in UPDATE_KEYS}, n_items=n_items, dim=dim,
                          fields=schema)
        with pytest.raises(BadReply, match="extra"):
            decode_update(arrays, n_items=n_items, dim=dim)
        k = sorted(schema)[0]
        with pytest.raises(BadReply, match=f"'{k}'"):
            decode_update({**arrays, k: np.append(arrays[k], np.float32(0))}, n_items=n_items, dim=dim, fields=schema)
    else:  # FedAvg-GMF's reply: exactly its keys, as before
        assert set(arrays) == UPDATE_KEYS


def test_fedavg_gmf_and_gmf_leaves_keep_their_wire_format(tmp_path):
    """A GMF leaf's model record and upload are FedAvg-GMF's, key for key (no fields of their own)."""
    train, exclude = make_data(24, 30, 40)
    gt, _ = fel_grid(tmp_path, train, exclude, FelConfig(**BASE), 40)
    assert [list(gt._model_record(u).keys()) for u in gt.units] == [["item", "h", "b"]] * len(gt.units)
    assert all(u.upload_fields() == {} and u.local_fields() == {} for u in gt.units)
    json.dumps(gt.run_round().extra["drop_reasons"])  # (a clean round)
