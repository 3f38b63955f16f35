"""FedAvg-GMF with ``secure_aggregation = "dpf"``: two non-colluding servers sum the clients' sparse rows.

Parties: the clients, ``server`` (A: holds the model, learns the sums) and ``server2`` (B). Adversary:
each server honest-but-curious, the two not colluding. Promise (tested here): the same model as in
plaintext up to fixed point; each server's view (its key sets) is independent of which rows a
client touched; a client sends only key sets of its touched rows. Limits (tested here): the two
servers together read every client's update; without padding, each server sees how many key
sets a client sent (its update's size class).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.fedavg import SERVER2, FedAvgConfig, FedAvgGMF
from protocols.transport import SERVER, InProcessTransport, Transcript, client
from secagg.dpf import Forest, KeySet, eval_full
from secagg.cuckoo import CuckooLayout
from secagg.dpf_sum import DpfUpload
from secagg.encoding import FixedPoint
from tests.protocols.test_fedavg import make_train


def _pair(aggregation: str, seed: int, n_users: int, **dpf):
    per_user = list(np.random.default_rng(seed).integers(2, 7, size=n_users))
    train = make_train(n_users, 17, per_user, seed)
    base = dict(dim=3, item_aggregation=aggregation, lr=0.05, init_std=0.3)
    plain = FedAvgGMF(train, FedAvgConfig(**base), seed=seed)
    transcript = Transcript(keep_payloads=True)
    secure = FedAvgGMF(train, FedAvgConfig(**base, secure_aggregation="dpf", **dpf), seed=seed,
                       transport=InProcessTransport(transcript))
    return plain, secure, transcript


@settings(max_examples=8, deadline=None)
@given(
    aggregation=st.sampled_from(["sum", "mean", "touched"]),
    n_users=st.integers(2, 8),
    points=st.integers(2, 40),
    pad=st.booleans(),
    dense=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_dpf_gives_the_plaintext_model(aggregation, n_users, points, pad, dense, seed):
    """The servers see key sets (and, above ``dpf_dense_above`` key sets, dense two-server shares) only,
    yet A computes the plaintext aggregate (up to the fixed-point encoding's rounding per value).

    Compared round by round, each round from the same model: the secure model is set to the plaintext one
    after each comparison. Across rounds the encoding's rounding (~1e-7 here) is not bounded: local training
    amplifies it (a stored example, seed 2868, drifted to 6.8e-5 in ``h`` after two rounds while each round's
    sum was exact to 7.5e-8), so a two-round comparison tested the training's sensitivity, not the sum."""
    plain, secure, transcript = _pair(aggregation, seed, n_users, dpf_points=points, dpf_max_parts=40,
                                      dpf_pad_parts=pad, dpf_dense_above=0 if pad else dense)
    for _ in range(2):
        plain.run_round()
        secure.run_round()
        for name in ("item", "h", "b", "user"):
            torch.testing.assert_close(getattr(secure, name), getattr(plain, name), atol=1e-5, rtol=0)
            setattr(secure, name, getattr(plain, name).clone())  # the next round starts from the same model
    for server in (SERVER, SERVER2):  # every client's key sets reached both servers, and nothing in plaintext
        ups = transcript.view(server, round=1, kind="update")
        assert {r.sender for r in ups} == {client(u) for u in range(n_users)}
        assert all(isinstance(r.payload, bytes) for r in ups)
        if pad:
            assert len(ups) == 40 * n_users
        if server == SERVER2 and dense and not pad:  # a dense client's share at B is a 32-byte seed
            from secagg.dpf_sum import DpfDense
            from secagg.messages import decode
            assert all(len(decode(r.payload).seed) == 32 for r in ups if isinstance(decode(r.payload), DpfDense))


def test_the_dpf_sum_is_exact_against_a_plaintext_computation_of_the_same_rows():
    """One round's decoded table equals the plaintext sums of the same encoded rows, exactly."""
    _, secure, _ = _pair("touched", 3, 5, dpf_points=4)
    seen = {}
    real = secure._sums_from_table

    def spy(total):
        seen["total"] = total
        return real(total)

    secure._sums_from_table = spy
    got_rows = {}
    real_rows = secure._dpf_rows

    def spy_rows(*args):
        got_rows["rv"] = real_rows(*args)
        return got_rows["rv"]

    secure._dpf_rows = spy_rows
    secure.run_round()
    rows, values = got_rows["rv"]
    width, _, n_rows = secure.dpf_layout()
    codec = FixedPoint(secure.config.frac_bits, secure.config.value_clip)
    want = np.zeros((n_rows, width), np.uint64)
    for r, v in zip(rows, values):
        want[r] += codec.encode(v, rounding="nearest")
    assert np.array_equal(seen["total"].reshape(n_rows, width), codec.decode(want.reshape(-1)).reshape(n_rows, width))


def _keys(transcript, server, user):
    return [KeySet.from_bytes(DpfUpload.from_bytes(r.payload).key)
            for r in transcript.view(server, kind="update") if r.sender == client(user)]


def test_one_servers_key_is_the_same_size_and_spread_whatever_the_rows_and_both_together_read_the_update():
    """Promise: a key set's size and bytes do not depend on the rows (the statistical indistinguishability
    is tests/secagg/test_dpf.py's). Limit: A's and B's keys of a client, evaluated and added, are its rows."""
    _, secure, transcript = _pair("sum", 11, 4, dpf_points=64)
    secure.run_round()
    sizes = {len(DpfUpload.from_bytes(r.payload).key) for s in (SERVER, SERVER2)
             for r in transcript.view(s, kind="update")}
    assert len(sizes) == 1  # one key-set size for every client, whatever it touched
    width, _, n_rows = secure.dpf_layout()
    lay = CuckooLayout.for_points(n_rows, min(64, n_rows), seed=bytes(32))
    forest = Forest(lay.sizes, lay.depth)
    user = 0
    (ka,), (kb,) = _keys(transcript, SERVER, user), _keys(transcript, SERVER2, user)
    both = eval_full(ka, forest) + eval_full(kb, forest)
    table = np.zeros((n_rows, width), np.uint64)
    np.add.at(table, lay.elements, both)
    touched = set(np.flatnonzero(table.any(axis=1)).tolist())
    alone = set(np.flatnonzero(eval_full(ka, forest).any(axis=1)).tolist())
    assert touched and touched <= set(range(n_rows)) and len(alone) > 0.9 * forest.leaves  # one key: every leaf nonzero
    assert n_rows - 1 in touched  # the tail row (n_k dh, n_k db, n_k) of every client


def test_without_padding_each_server_sees_how_many_key_sets_a_client_sent_and_padding_hides_it():
    """The stated leak of the unpadded mode, and padding closing it."""
    train = make_train(3, 30, [2, 12, 5], seed=2)
    counts = {}
    for pad in (False, True):
        transcript = Transcript(keep_payloads=True)
        fa = FedAvgGMF(train, FedAvgConfig(dim=2, secure_aggregation="dpf", dpf_points=8, dpf_max_parts=12,
                                           dpf_pad_parts=pad), seed=2, transport=InProcessTransport(transcript))
        fa.run_round()
        counts[pad] = [sum(r.sender == client(u) for r in transcript.view(SERVER2, kind="update")) for u in range(3)]
    assert len(set(counts[False])) > 1 and counts[False][1] > counts[False][0]  # more rows, more key sets
    assert counts[True] == [12, 12, 12]


def test_dpf_config_is_checked_and_too_many_rows_stop_the_round_in_words():
    with pytest.raises(ValueError, match="dpf_points"):
        FedAvgConfig(secure_aggregation="dpf", dpf_points=0)
    with pytest.raises(ValueError, match="dpf_max_parts"):
        FedAvgConfig(secure_aggregation="dpf", dpf_max_parts=0)
    train = make_train(3, 30, [2, 12, 5], seed=2)
    fa = FedAvgGMF(train, FedAvgConfig(dim=2, secure_aggregation="dpf", dpf_points=4, dpf_max_parts=2), seed=2)
    with pytest.raises(ValueError, match="points x max_parts"):
        fa.run_round()


def test_dpf_is_fedavg_gmfs_own_option():
    from protocols.fedfast import FedFastConfig

    with pytest.raises(ValueError, match="secure_aggregation"):
        FedFastConfig(secure_aggregation="dpf")
    assert dataclasses.replace(FedAvgConfig(), secure_aggregation="dpf").secure_aggregation == "dpf"


def test_a_tampered_key_is_rejected_with_a_clear_error_and_the_round_goes_on_without_it(monkeypatch):
    """A client whose key set is not point functions is left out of both sums (the VDPF check)."""
    import secagg.dpf_run as ds

    real = ds.run_dpf_rows

    def with_tamper(updates, spec):
        def forge(ka, kb):
            cw = kb.seed_cw.copy()
            cw[0, 0, 0] ^= np.uint64(1 << 9)
            return ka, dataclasses.replace(kb, seed_cw=cw)
        return real(updates, dataclasses.replace(spec, tamper={0: forge}))

    monkeypatch.setattr("protocols.secure_sum.run_dpf_rows", with_tamper)
    _, secure, transcript = _pair("sum", 5, 4, dpf_points=64)
    secure.run_round()
    ids = [r for r in transcript.view(SERVER, kind="dpf:share")]
    assert ids  # the sum was released over the three honest clients
    from secagg.dpf_sum import DpfShare
    assert DpfShare.from_bytes(ids[0].payload).survivors == (1, 2, 3)


def test_a_checkpoint_written_before_the_dpf_keys_still_resumes():
    train = make_train(3, 10, [2, 3, 2], seed=1)
    fa = FedAvgGMF(train, FedAvgConfig(dim=2), seed=1)
    fa.run_round()
    state = fa.state_dict()
    state["config"] = {k: v for k, v in state["config"].items() if not k.startswith("dpf_")}
    again = FedAvgGMF(train, FedAvgConfig(dim=2), seed=1)
    again.load_state_dict(state)
    assert again.round == 1
    other = FedAvgGMF(train, FedAvgConfig(dim=2, dpf_points=7), seed=1)
    with pytest.raises(ValueError, match="different fedavg configuration"):
        other.load_state_dict(state)


def test_with_dense_above_each_server_sees_one_bit_sparse_or_dense():
    """The stated leak of ``dpf_dense_above = 1``: one message per client and server, a key set or a dense
    share (at A a uniform vector of the whole table, at B a seed), so the servers learn only whether the
    client touched more than ``dpf_points`` rows."""
    from secagg.dpf_sum import DpfDense, DpfUpload
    from secagg.messages import decode

    train = make_train(3, 30, [2, 12, 5], seed=2)
    transcript = Transcript(keep_payloads=True)
    fa = FedAvgGMF(train, FedAvgConfig(dim=2, secure_aggregation="dpf", dpf_points=20, dpf_dense_above=1), seed=2,
                   transport=InProcessTransport(transcript))
    fa.run_round()
    kinds = {}
    for server in (SERVER, SERVER2):
        for r in transcript.view(server, kind="update"):
            kinds.setdefault(r.sender, []).append(type(decode(r.payload)))
    assert all(len(v) == 2 for v in kinds.values())  # one message per server
    assert kinds[client(1)] == [DpfDense, DpfDense]  # 12 positives and their negatives: more than 20 rows
    assert kinds[client(0)] == [DpfUpload, DpfUpload]
    with pytest.raises(ValueError, match="dpf_dense_above"):
        FedAvgConfig(secure_aggregation="dpf", dpf_pad_parts=True, dpf_dense_above=1)
