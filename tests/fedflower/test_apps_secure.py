"""FedAvg-GMF through our SecAgg/SecAgg+ as Flower apps (``fedavg-gmf-secagg`` on Flower).

The promise: the server learns only the survivors' sum of the clients' vectors (the protocol's
round sums, their loss sum and example count); with the same seed the model equals the
in-process secure run (the same fixed-point encoding, nearest rounding); a client never sends its
vector unmasked (not to a server that asks for a plaintext round, nor outside the masked-input
stage); a dropout is dropped, the round sums the others; too many dropouts abort the round
cleanly (model unchanged) and the run goes on.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedflower.adapter import build_server_trainer, secure_width, write_partitions
from fedflower.apps import GridTrainer, RoundFailed, make_client_app
from fedflower.loopback import LoopbackGrid
from fedflower.secagg_mod import VECTOR_KEY
from protocols.fedavg import FedAvgConfig, FedAvgGMF
from protocols.registry import get_protocol
from protocols.transport import InProcessTransport, Transcript
from secagg.encoding import FixedPoint

from .test_apps_loopback import make_data

logging.getLogger("flwr").setLevel(logging.ERROR)

#: the stage numbers of one secure round on the loopback grid (send_and_receive calls)
SETUP, SHARE_KEYS, MASKED_INPUT, CONSISTENCY, UNMASK = 1, 2, 3, 4, 5


def secure_grid(tmp: Path, train, exclude, cfg: FedAvgConfig, seed: int, *, drop=None, tamper=None,
                require_secure: bool = False, keep_payloads: bool = False):
    meta = write_partitions(train, exclude, tmp / "parts")
    nodes = [9000 + 7 * i for i in range(meta.clients)]
    grid = LoopbackGrid(make_client_app(tmp / "parts", require_secure=require_secure), nodes, drop=drop, tamper=tamper)
    server = build_server_trainer(get_protocol("fedavg"), cfg, seed, meta,
                                  transport=InProcessTransport(Transcript(keep_payloads=keep_payloads)))
    return GridTrainer(grid, server, protocol="fedavg", seed=seed, meta=meta, timeout=30, assign=True), grid


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), protocol=st.sampled_from(["secagg", "secagg+"]),
       aggregation=st.sampled_from(["sum", "mean", "touched"]), per_round=st.integers(3, 7))
def test_secure_flower_rounds_give_the_in_process_secure_model(tmp_path_factory, seed, protocol, aggregation, per_round):
    train, exclude = make_data(9, 24, seed, low_ratings=True)
    cfg = FedAvgConfig(dim=3, clients_per_round=per_round, item_aggregation=aggregation, lr=0.05, init_std=0.3,
                       secure_aggregation=protocol)
    ref = FedAvgGMF(train, cfg, seed=seed, exclude=exclude)
    gt, _ = secure_grid(tmp_path_factory.mktemp("run"), train, exclude, cfg, seed)
    for _ in range(2):
        want, got = ref.run_round(), gt.run_round()
        assert got.clients == want.clients and got.extra["dropped"] == 0
        assert got.extra["examples"] == want.extra["examples"]
        assert got.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-6)  # summed in fixed point
        assert [r.params for r in got.releases] == [r.params for r in want.releases]
        assert got.releases[0].what == want.releases[0].what
    for name in ("item", "h", "b"):  # the same nearest-rounded encodings, summed exactly in Z_2^64
        torch.testing.assert_close(getattr(gt.server, name), getattr(ref, name), rtol=1e-5, atol=1e-6)


def test_the_server_sees_only_masked_inputs_whose_sum_is_the_plaintext_sum(tmp_path):
    train, _ = make_data(8, 20, 11)
    cfg = FedAvgConfig(dim=3, clients_per_round=5, lr=0.05, init_std=0.3, secure_aggregation="secagg+")
    replies: list[Message] = []

    def spy(stage, nid, reply):  # noqa: ANN001 - everything the server receives
        replies.append(reply)
        return reply

    gt, _ = secure_grid(tmp_path, train, None, cfg, 11, tamper=spy, keep_payloads=True)
    plain = FedAvgGMF(train, FedAvgConfig(**{**cfg.__dict__, "secure_aggregation": "none"}), seed=11)
    sampled = plain._sample_clients()
    lr = plain._local_round(sampled)
    vectors = plain._client_vectors(sampled, lr.pair_slot, lr.pair_item, lr.dQ, lr.dH, lr.dB, lr.weight)
    gt.run_round()
    # No reply of any stage carries a plaintext vector or update.
    assert replies and all(VECTOR_KEY not in r.content and "update" not in r.content for r in replies)
    assert all(len(a) == 0 for r in replies for rec in r.content.array_records.values() for a in [rec])
    # The masked inputs the server recorded are not the encodings of the clients' vectors ...
    codec = FixedPoint(cfg.frac_bits, cfg.value_clip)
    masked = [r.payload for r in gt.server.transport.transcript.records if r.kind == "update"]
    assert len(masked) == len(sampled)
    encoded = codec.encode(vectors, rounding="nearest")
    for y in masked:
        assert not any(np.array_equal(y[: vectors.shape[1]], e) for e in encoded)
    # ... yet the model moved by exactly the plaintext sum of the vectors (up to the encoding).
    expect = FedAvgGMF(train, FedAvgConfig(**{**cfg.__dict__, "secure_aggregation": "none"}), seed=11)
    expect.run_round()
    torch.testing.assert_close(gt.server.item, expect.item, rtol=1e-5, atol=1e-6)
    assert secure_width(gt.server) == vectors.shape[1] + 2


def _oracle_over(train, cfg, seed, survivors_users):
    """The in-process plaintext round aggregated over ``survivors_users`` only."""
    ref = FedAvgGMF(train, FedAvgConfig(**{**cfg.__dict__, "secure_aggregation": "none"}), seed=seed)
    sampled = ref._sample_clients()
    lr = ref._local_round(sampled)
    keep = np.isin(sampled, survivors_users)
    slots = np.flatnonzero(keep)
    pair_keep = np.isin(lr.pair_slot, slots)
    new_slot = np.searchsorted(slots, lr.pair_slot[pair_keep])
    ref._aggregate(0, sampled[keep], new_slot, lr.pair_item[pair_keep], lr.dQ[torch.as_tensor(pair_keep)],
                   lr.dH[torch.as_tensor(keep)], lr.dB[torch.as_tensor(keep)], lr.weight[torch.as_tensor(keep)])
    return ref


NODES = [9000 + 7 * i for i in range(8)]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1000), drops=st.dictionaries(st.integers(0, 7), st.sampled_from(
    [SETUP, SHARE_KEYS, MASKED_INPUT, CONSISTENCY, UNMASK]), max_size=3))
def test_dropouts_at_any_stage_give_the_survivors_sum_or_a_clean_abort(tmp_path_factory, seed, drops):
    train, _ = make_data(8, 20, seed)  # every user has data: 8 clients, all sampled
    cfg = FedAvgConfig(dim=2, clients_per_round=8, lr=0.05, init_std=0.3, secure_aggregation="secagg")

    def drop(stage, nid):  # noqa: ANN001 - client i (node-id order) is silent from stage drops[i] on
        i = NODES.index(nid)
        return i in drops and stage >= drops[i]

    gt, grid = secure_grid(tmp_path_factory.mktemp("run"), train, None, cfg, seed, drop=drop)
    before = gt.server.item.clone()
    stats = gt.run_round()
    rep = gt._secagg.last_report
    if rep.abort is not None:
        assert stats.clients == 0 and math.isnan(stats.loss) and stats.extra["aborted"] == rep.abort
        assert torch.equal(gt.server.item, before) and not stats.releases  # nothing applied, nothing released
        return
    # A client silent before its masked input is out of the sum; one silent afterwards is in it.
    in_sum = [n for i, n in enumerate(NODES) if not (i in drops and drops[i] <= MASKED_INPUT)]
    assert sorted(rep.survivors) == in_sum and stats.clients == len(in_sum)
    assert stats.extra["dropped"] == len(drops)
    survivors = [u for u, n in gt.node_of.items() if n in set(in_sum)]
    ref = _oracle_over(train, cfg, seed, survivors)
    torch.testing.assert_close(gt.server.item, ref.item, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gt.server.h, ref.h, rtol=1e-5, atol=1e-5)


def test_too_many_dropouts_abort_the_round_and_the_next_round_runs(tmp_path):
    train, _ = make_data(6, 16, 4)
    cfg = FedAvgConfig(dim=2, clients_per_round=6, lr=0.05, init_std=0.3, secure_aggregation="secagg")
    silent = set(NODES[:4])  # four of six go silent before their masked input (SecAgg's t is 5)

    gt, grid = secure_grid(tmp_path, train, None, cfg, 4, drop=lambda stage, nid: stage == SHARE_KEYS and nid in silent)
    before = gt.server.item.clone()
    stats = gt.run_round()
    assert stats.clients == 0 and math.isnan(stats.loss) and stats.extra["aborted"]
    assert stats.extra["dropped"] == 4 and not stats.releases
    assert torch.equal(gt.server.item, before) and gt.server.round == 1  # model unchanged, round counted
    grid.gone.clear()  # the silent nodes come back: the run goes on
    nxt = gt.run_round()
    assert nxt.clients == 6 and nxt.extra["dropped"] == 0 and not torch.equal(gt.server.item, before)


def test_a_client_refuses_to_send_its_update_in_plaintext(tmp_path):
    train, _ = make_data(5, 14, 2)
    # A node that requires secure aggregation refuses a plaintext round: every client is dropped.
    plain = FedAvgConfig(dim=2, clients_per_round=3)
    gt, _ = secure_grid(tmp_path, train, None, plain, 2, require_secure=True)
    with pytest.raises(RoundFailed, match="only through secure aggregation"):
        gt.run_round()
    # A protocol config that asks for secure aggregation, sent with a plaintext training request.
    secure = FedAvgConfig(dim=2, clients_per_round=3, secure_aggregation="secagg+")
    gt2, grid2 = secure_grid(tmp_path / "b", train, None, secure, 2)
    msgs = [Message(RecordDict({"model": gt2._model_record(), "run": gt2._run_record(u)}), dst_node_id=gt2.node_of[u],
                    message_type=MessageType.TRAIN) for u in gt2.meta.users[:2]]
    replies = list(grid2.send_and_receive(msgs, timeout=10))
    assert all(r.has_error() and "config asks for it" in r.error.reason for r in replies)
    # A "secure" training request outside secure aggregation (no masked-input stage around it).
    msgs = [Message(RecordDict({"model": gt2._model_record(), "run": gt2._run_record(u, secure=True)}),
                    dst_node_id=gt2.node_of[u], message_type=MessageType.TRAIN) for u in gt2.meta.users[:2]]
    replies = list(grid2.send_and_receive(msgs, timeout=10))
    assert all(r.has_error() for r in replies)
    # (a TRAIN message without our record reaches the train handler, which refuses it)
    assert all(re.search("outside secure aggregation|config asks for it", r.error.reason) for r in replies)


def test_a_value_beyond_value_clip_drops_the_client_in_words(tmp_path):
    train, _ = make_data(6, 16, 8)
    # value_clip below every client's example count: each client refuses to encode its vector.
    cfg = FedAvgConfig(dim=2, clients_per_round=4, secure_aggregation="secagg", value_clip=1.0)
    gt, _ = secure_grid(tmp_path, train, None, cfg, 8)
    stats = gt.run_round()
    assert stats.clients == 0 and stats.extra["aborted"]
    assert any("fedavg.value_clip" in why for why in stats.extra["drop_reasons"]), stats.extra["drop_reasons"]
