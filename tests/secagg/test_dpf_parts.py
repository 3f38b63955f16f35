"""Several key sets per client (``max_parts``): the sum stays exact, dropouts of any part leave the client
out, padding makes every client send the same count, and the servers refuse inconsistent parts."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg.cuckoo import CuckooLayout
from secagg.dpf_run import DpfSpec, run_dpf_rows
from secagg.dpf_sum import DpfDense, DpfSumClient, DpfSumConfig, DpfSumServer, DpfUpload
from secagg.errors import MessageError


def _updates(rng, n, rows, width, most):
    out = []
    for _ in range(n):
        k = int(rng.integers(0, most + 1))
        r = np.sort(rng.choice(rows, k, replace=False)).astype(np.int64)
        out.append((r, rng.integers(0, 2**64, (k, width), dtype=np.uint64)))
    return out


@settings(max_examples=12, deadline=None)
@given(n=st.integers(2, 7), rows=st.integers(8, 60), width=st.integers(1, 3), points=st.integers(1, 6),
       parts=st.integers(1, 5), pad=st.booleans(), lost=st.sets(st.integers(0, 6), max_size=3),
       seed=st.integers(0, 2**31))
def test_parts_sum_exactly_over_the_clients_both_servers_received(n, rows, width, points, parts, pad, lost, seed):
    rng = np.random.default_rng(seed)  # CSPRNG-OK: simulated inputs only
    points = min(points, rows)
    ups = _updates(rng, n, rows, width, min(rows, points * parts))
    lost = {i for i in lost if i < n}
    res = run_dpf_rows(ups, DpfSpec(rows, width, points, max_parts=parts, pad_parts=pad,
                                    dropouts={"B": frozenset(lost)}))
    survivors = set(range(n)) - lost
    assert res.refused == {}
    if len(survivors) < 2:
        assert res.total is None
        return
    assert res.survivors == frozenset(survivors)
    want = np.zeros((rows, width), np.uint64)
    for i in survivors:
        want[ups[i][0]] += ups[i][1]
    assert np.array_equal(res.total.reshape(rows, width), want)
    expect = [parts if pad else max(1, -(-len(u[0]) // points)) for u in ups]
    assert list(res.parts) == expect
    sizes = {len(b) for s, to, st_, b in res.records if st_ == "upload"}
    assert len(sizes) == 1  # every key set the same size, whatever its rows


def _cfg(parts=3, pad=False, n=3):
    return DpfSumConfig(n, CuckooLayout.for_points(40, 4, seed=bytes(32)), 2, 4, os.urandom(16), max_parts=parts,
                        pad_parts=pad)


def test_a_client_missing_one_part_is_not_counted():
    cfg = _cfg()
    servers = (DpfSumServer(cfg, 0), DpfSumServer(cfg, 1))
    for i in range(3):
        sent = DpfSumClient(cfg, i).upload_parts(np.arange(10) + i, np.ones((10, 2), np.uint64))
        assert len(sent) == 3
        for p, (a, b) in enumerate(sent):
            servers[0].receive(a)
            if not (i == 1 and p == 2):
                servers[1].receive(b)
    ids = [s.received() for s in servers]
    assert servers[0].agree(ids[1]) == [0, 2]


def test_servers_refuse_inconsistent_or_excess_parts():
    cfg = _cfg(parts=2)
    server = DpfSumServer(cfg, 0)
    (a0, _), (a1, _) = DpfSumClient(cfg, 0).upload_parts(np.arange(8), np.ones((8, 2), np.uint64))
    server.receive(a0)
    with pytest.raises(MessageError, match="replayed"):
        server.receive(a0)
    m = DpfUpload.from_bytes(a1)
    odd = DpfUpload(m.instance, m.round, m.sender, m.receiver, floor=m.floor + 1, key=m.key, part=1, parts=2)
    with pytest.raises(MessageError, match="disagree"):
        server.receive(odd.to_bytes())
    three = DpfUpload(m.instance, m.round, 1, m.receiver, floor=m.floor, key=m.key, part=0, parts=3)
    with pytest.raises(MessageError, match="at most 2"):
        server.receive(three.to_bytes())
    padded = DpfSumServer(_cfg(parts=2, pad=True), 0)
    one = DpfUpload(padded.cfg.instance, 0, 1, m.receiver, floor=2, key=m.key, part=0, parts=1)
    with pytest.raises(MessageError, match="exactly 2"):
        padded.receive(one.to_bytes())
    with pytest.raises(MessageError):  # part beyond the count: a decode error, not a crash
        DpfUpload.from_bytes(DpfUpload(m.instance, 0, 1, m.receiver, floor=2, key=m.key, part=2, parts=2).to_bytes())
    with pytest.raises(ValueError, match="max_parts x points"):
        DpfSumClient(cfg, 2).upload_parts(np.arange(9), np.ones((9, 2), np.uint64))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(2, 6), rows=st.integers(8, 40), width=st.integers(1, 3), points=st.integers(1, 4),
       dense_above=st.integers(1, 3), lost=st.sets(st.integers(0, 5), max_size=2), seed=st.integers(0, 2**31))
def test_dense_shares_and_key_sets_sum_exactly_together(n, rows, width, points, dense_above, lost, seed):
    """A client above ``dense_above`` key sets sends a dense two-server share; the sum stays exact over
    the clients both servers received, whatever mix of dense and sparse clients and dropouts."""
    rng = np.random.default_rng(seed)  # CSPRNG-OK: simulated inputs only
    ups = _updates(rng, n, rows, width, rows)
    lost = {i for i in lost if i < n}
    res = run_dpf_rows(ups, DpfSpec(rows, width, points, max_parts=64, dense_above=dense_above,
                                    dropouts={"A": frozenset(lost)}))
    survivors = set(range(n)) - lost
    assert res.refused == {}
    if len(survivors) < 2:
        assert res.total is None
        return
    want = np.zeros((rows, width), np.uint64)
    for i in survivors:
        want[ups[i][0]] += ups[i][1]
    assert np.array_equal(res.total.reshape(rows, width), want)
    dense = [-(-len(r) // points) > dense_above for r, _ in ups]
    for i in range(n):
        assert (res.parts[i] == 0) == dense[i]
    # the clients' priced work: every dense client expanded its seed (a lost upload too), the others their keys
    assert res.client_dense_bytes == 8 * res_domain(rows, points) * width * sum(dense)


def res_domain(rows: int, points: int) -> int:
    return CuckooLayout.for_points(rows, points, seed=bytes(32)).domain


def test_a_dense_share_alone_is_uniform_or_a_seed_and_malformed_ones_are_refused():
    cfg = DpfSumConfig(3, CuckooLayout.for_points(40, 4, seed=bytes(32)), 2, 4, os.urandom(16), max_parts=4,
                       dense_above=1)
    (to_a, to_b), = DpfSumClient(cfg, 0).upload_parts(np.arange(10), np.ones((10, 2), np.uint64))
    a, b = DpfDense.from_bytes(to_a), DpfDense.from_bytes(to_b)
    assert a.seed == b"" and a.share.size == 80 and len(b.seed) == 32 and b.share.size == 0
    top = (a.share >> np.uint64(63)).astype(float)  # A's share: uniform words, no trace of the ones
    assert 0.2 < top.mean() < 0.8 and not np.any(a.share == 1)
    server_a, server_b = DpfSumServer(cfg, 0), DpfSumServer(cfg, 1)
    with pytest.raises(MessageError, match="not this server"):
        server_a.receive(to_b)  # B's seed message routed to A
    with pytest.raises(MessageError, match="expects 32 and 0"):
        server_b.receive(DpfDense(b.instance, b.round, 1, b.receiver, floor=2, share=a.share).to_bytes())
    server_a.receive(to_a)
    with pytest.raises(MessageError, match="replayed"):
        server_a.receive(to_a)
    plain = DpfSumServer(_cfg(), 0)
    with pytest.raises(MessageError, match="dense_above = 0"):
        plain.receive(DpfDense(plain.cfg.instance, 0, 1, a.receiver, floor=2, share=a.share).to_bytes())
    with pytest.raises(MessageError):
        DpfDense.from_bytes(to_b[:-5])  # truncated: a typed error, nothing else
    with pytest.raises(ValueError, match="dense_above"):
        DpfSumConfig(3, cfg.layout, 2, 4, os.urandom(16), max_parts=4, pad_parts=True, dense_above=1)
