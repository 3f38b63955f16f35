"""The circular share chain: promise, recoveries, message validation and the stated limits."""

from __future__ import annotations

import os
import struct
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from secagg.chain import (
    _MASK_LABEL,
    _PAD_LABEL,
    CLIENT_ACCEPTS,
    ChainBundle,
    ChainClient,
    ChainConfig,
    ChainDelivery,
    ChainRing,
    ChainUpload,
    ClientStage,
    Kind,
    _mask,
    effective_successors,
    message_size,
)
from secagg.chain_server import SERVER_ACCEPTS, ChainServer, ServerStage
from secagg.chain_sim import Dropout, simulate
from secagg.encoding import FixedPoint
from secagg.errors import AbortError, AuthenticationError, MessageError
from secagg.keys import KeyPair
from secagg.messages import HEADER_BYTES, SERVER
from secagg.prg import expand

U64 = np.uint64


def cfg(dim: int = 6, s: int = 1, **kw) -> ChainConfig:
    return ChainConfig(instance=os.urandom(16), round=kw.pop("round", 7), dim=dim, successors=s, **kw)


def rand_inputs(n: int, dim: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)  # CSPRNG-OK: test inputs, not secrets
    return {10 + i: rng.integers(0, 2**64, dim, dtype=U64) for i in range(n)}


def oracle_sum(inputs: dict[int, np.ndarray], members) -> list[int]:
    """Independent oracle: Python big-int sums reduced mod 2^64."""
    dim = len(next(iter(inputs.values())))
    return [sum(int(inputs[c][j]) for c in members) % 2**64 for j in range(dim)]


def final_uploads(run) -> dict[int, np.ndarray]:
    last = run.server.attempt
    return {
        sender: ChainUpload.from_bytes(data).vector
        for kind, sender, attempt, data in run.server_view
        if kind is Kind.UPLOAD and attempt == last
    }


# --------------------------------------------------------------------------- the promise


@pytest.mark.parametrize("n,s", [(2, 1), (2, 5), (3, 2), (7, 1), (9, 3), (16, 15)])
def test_sum_is_exact_in_the_ring(n, s):
    config = cfg(dim=9, s=s)
    inputs = rand_inputs(n, 9, seed=n * 31 + s)
    run = simulate(config, inputs)
    assert run.abort is None
    assert run.survivors == frozenset(inputs)
    assert run.result.tolist() == oracle_sum(inputs, inputs)
    assert run.server.successors == effective_successors(s, n)


def test_decoded_real_sum_within_quantisation_error():
    fp = FixedPoint(frac_bits=20, clip=4.0)
    rng = np.random.default_rng(1)  # CSPRNG-OK: test inputs
    reals = {i: rng.uniform(-4, 4, 50) for i in range(12)}
    inputs = {i: fp.encode(x, rounding="nearest") for i, x in reals.items()}
    run = simulate(cfg(dim=50, s=2), inputs)
    expected = np.sum(list(reals.values()), axis=0)
    assert np.max(np.abs(fp.decode(run.result) - expected)) <= 12 * 2.0**-21 + 1e-12


def test_mask_known_answer():
    x = np.arange(5, dtype=U64)
    a, b, c = bytes(range(32)), bytes(range(1, 33)), bytes(range(2, 34))
    y = _mask(x, [a, b], [c])
    expected = [
        (int(x[j]) - int(expand(a, 5, label=_MASK_LABEL)[j]) - int(expand(b, 5, label=_MASK_LABEL)[j])
         + int(expand(c, 5, label=_MASK_LABEL)[j])) % 2**64
        for j in range(5)
    ]
    assert y.tolist() == expected
    assert _MASK_LABEL == b"chain/mask" and _PAD_LABEL == b"chain/pad"
    p = bytes(range(3, 35))
    padded = _mask(x, [a, b], [c], pad=p)
    assert padded.tolist() == [(e + int(expand(p, 5, label=_PAD_LABEL)[j])) % 2**64 for j, e in enumerate(expected)]


def test_fresh_randomness_every_run_and_fresh_ring():
    inputs = rand_inputs(12, 4)
    config = cfg(dim=4)
    r1, r2 = simulate(config, inputs), simulate(config, inputs)
    assert r1.result.tolist() == r2.result.tolist()
    u1, u2 = final_uploads(r1), final_uploads(r2)
    assert all(not np.array_equal(u1[c], u2[c]) for c in inputs)
    rings = {simulate(config, inputs).server.ring for _ in range(5)}
    assert len(rings) > 1  # 12! orders: five identical rings would mean a fixed ring


def test_per_client_cost_is_independent_of_n():
    small = simulate(cfg(dim=32, s=2), rand_inputs(5, 32))
    large = simulate(cfg(dim=32, s=2), rand_inputs(40, 32))
    per_client = {
        message_size(Kind.ADVERT) + message_size(Kind.BUNDLE, s=2) + message_size(Kind.UPLOAD, dim=32)
        + message_size(Kind.UNLOCK)
    }
    assert set(small.bytes_sent.values()) == per_client == set(large.bytes_sent.values())
    assert set(small.bytes_received.values()) == set(large.bytes_received.values())
    # a seed travels instead of a share vector: the bundle is independent of dim
    assert message_size(Kind.BUNDLE, s=2, dim=10) == message_size(Kind.BUNDLE, s=2, dim=10**6)
    assert message_size(Kind.UPLOAD, dim=1000) == HEADER_BYTES + 8 + 28 + 8000


# --------------------------------------------------------------------------- dropouts


@pytest.mark.parametrize("stage", ["advertise", "share", "receive", "upload", "unlock"])
@pytest.mark.parametrize("s", [1, 2])
def test_dropout_at_each_stage_gives_the_survivors_sum(stage, s):
    inputs = rand_inputs(8, 5, seed=3)
    dropped = {11: Dropout(stage), 15: Dropout(stage)}
    run = simulate(cfg(dim=5, s=s), inputs, dropouts=dropped)
    assert run.abort is None
    assert run.survivors == frozenset(inputs) - {11, 15}
    assert run.result.tolist() == oracle_sum(inputs, run.survivors)
    # recovery is a re-run among survivors: one abandoned attempt unless the drop was before the ring
    expected_attempts = 1 if stage == "advertise" else 2
    assert run.server.attempt == expected_attempts
    if stage == "unlock":  # the one re-run over exactly the unlockers keeps the ring order
        first, second = run.server.history[0].ring, run.server.history[1].ring
        assert second == tuple(c for c in first if c not in (11, 15))
        assert run.server.fixed == run.survivors


def test_dropouts_in_the_rerun_are_survived_too():
    inputs = rand_inputs(9, 3, seed=4)
    dropped = {10: Dropout("upload", 1), 12: Dropout("receive", 2), 13: Dropout("share", 3)}
    run = simulate(cfg(dim=3, s=2), inputs, dropouts=dropped)
    assert run.survivors == frozenset(inputs) - {10, 12, 13}
    assert run.result.tolist() == oracle_sum(inputs, run.survivors)
    assert [h.outcome.split(" from")[0] for h in run.server.history] == [
        "no upload", "no upload", "no seeds", "complete"
    ]


def test_abort_below_min_survivors_and_after_max_attempts():
    inputs = rand_inputs(4, 3)
    run = simulate(cfg(dim=3), inputs, dropouts={c: Dropout("share") for c in [10, 11, 12]})
    assert run.result is None and isinstance(run.abort, AbortError)
    assert "min_survivors=2" in str(run.abort)
    assert run.server.stage is ServerStage.ABORTED
    with pytest.raises(AbortError):
        run.server.result()
    run = simulate(cfg(dim=3, max_attempts=2), rand_inputs(6, 3),
                   dropouts={10: Dropout("upload", 1), 11: Dropout("upload", 2)})
    assert run.result is None and "max_attempts=2" in str(run.abort)
    with pytest.raises(ValueError, match="invite more clients"):
        simulate(cfg(dim=3, min_survivors=5), inputs)  # 4 invited < 5: refused up front
    run = simulate(cfg(dim=3, min_survivors=4), inputs, dropouts={10: Dropout("advertise")})
    assert "fewer than min_survivors=4" in str(run.abort)


def test_abandoned_attempt_reveals_nothing_and_server_never_sees_a_seed():
    """What the recovery reveals: nothing. The abandoned attempt's uploads stay masked (their sum is
    not the survivors' sum and looks uniform), and no seed ever reaches the server in the clear."""
    n, dim = 6, 4000
    inputs = {10 + i: np.zeros(dim, dtype=U64) for i in range(n)}  # worst case: all inputs 0
    run = simulate(cfg(dim=dim, s=1), inputs, dropouts={12: Dropout("upload")})
    first = [ChainUpload.from_bytes(d).vector for k, _, a, d in run.server_view if k is Kind.UPLOAD and a == 1]
    assert len(first) == n - 1
    partial = np.sum(first, axis=0, dtype=U64)  # wrap-around sum of the abandoned uploads
    assert not np.all(partial == 0)
    assert stats.chisquare(np.bincount((partial >> U64(56)).astype(int), minlength=256)).pvalue > 1e-6
    assert run.result.tolist() == [0] * dim
    seeds = {seed for c in run.clients.values() for seed in c.known_seeds().values()}
    view = b"".join(d for *_, d in run.server_view)
    assert seeds and not any(seed in view for seed in seeds)


# --------------------------------------------------------------------------- uniform view


def test_every_upload_is_uniform_and_independent_of_the_input():
    dim = 3000
    zeros = {i: np.zeros(dim, dtype=U64) for i in range(4)}
    const = {i: np.full(dim, 2**63 + 12345, dtype=U64) for i in range(4)}
    ups0 = np.concatenate(list(final_uploads(simulate(cfg(dim=dim, s=1), zeros)).values()))
    ups1 = np.concatenate(list(final_uploads(simulate(cfg(dim=dim, s=1), const)).values()))
    for ups in (ups0, ups1):
        for shift in (56, 0):  # top byte and low byte
            counts = np.bincount(((ups >> U64(shift)) & U64(255)).astype(int), minlength=256)
            assert stats.chisquare(counts).pvalue > 1e-6
    assert stats.ks_2samp(ups0.astype(float), ups1.astype(float)).pvalue > 1e-6
    # the test can fail: unmasked uploads are all zeros
    assert stats.chisquare(np.bincount((zeros[0] >> U64(56)).astype(int), minlength=256)).pvalue < 1e-6


# --------------------------------------------------------------------------- the stated limits


def recover(run, target: int, colluders: set[int]) -> np.ndarray:
    """The server's attempt at x_target from its view plus the colluders' private seeds."""
    a = run.server.attempt
    seeds = {}
    for c in colluders:
        seeds.update(run.clients[c].known_seeds())
    y = final_uploads(run)[target].copy()
    y -= expand(run.server.revealed[(a, target)], y.size, label=_PAD_LABEL)  # opened at UNLOCK
    for (att, snd, rcv), seed in seeds.items():
        if att != a:
            continue
        if snd == target:
            y += expand(seed, y.size, label=_MASK_LABEL)
        elif rcv == target:
            y -= expand(seed, y.size, label=_MASK_LABEL)
    return y


@pytest.mark.parametrize("s", [1, 2, 3])
def test_server_plus_all_2s_ring_neighbours_recover_an_input(s):
    inputs = rand_inputs(10, 16, seed=s)
    run = simulate(cfg(dim=16, s=s), inputs)
    ring = run.server.ring
    for pos in (0, 4):
        target = ring[pos]
        neighbours = {ring[(pos + j) % 10] for j in range(1, s + 1)} | {ring[(pos - j) % 10] for j in range(1, s + 1)}
        assert np.array_equal(recover(run, target, neighbours), inputs[target])
        for missing in neighbours:  # any single honest neighbour protects the input
            guess = recover(run, target, neighbours - {missing})
            assert not np.array_equal(guess, inputs[target])
            assert np.count_nonzero(guess == inputs[target]) <= 1


def test_with_s1_the_server_plus_both_ring_neighbours_recover_after_a_rerun():
    inputs = rand_inputs(7, 8, seed=9)
    run = simulate(cfg(dim=8, s=1), inputs, dropouts={13: Dropout("upload")})
    ring = run.server.ring
    target = ring[2]
    assert np.array_equal(recover(run, target, {ring[1], ring[3]}), inputs[target])


def test_late_upload_of_an_abandoned_attempt_is_refused_and_useless_anyway():
    inputs = rand_inputs(5, 6, seed=5)
    late: dict[int, bytes] = {}

    def hold_back(kind, sender, receiver, data):
        if kind is Kind.UPLOAD and sender == 12 and 12 not in late:
            late[12] = data  # the network delays it past the deadline
            return None
        return data

    run = simulate(cfg(dim=6), inputs, tamper=hold_back)
    assert run.survivors == frozenset(inputs) - {12}
    assert run.result.tolist() == oracle_sum(inputs, run.survivors)
    with pytest.raises(MessageError, match="round is over"):
        run.server.receive(late[12])
    # A server that kept it holds attempt 1's uploads complete, but their pads were never
    # revealed (the attempt never reached UNLOCK): the difference of the sums is not x_12.
    first = [ChainUpload.from_bytes(d).vector for k, _, a, d in run.server_view if k is Kind.UPLOAD and a == 1]
    full = np.sum(first + [ChainUpload.from_bytes(late[12]).vector], axis=0, dtype=U64)
    assert np.count_nonzero((full - run.result) == inputs[12]) <= 1
    assert not any(att == 1 for att, _ in run.server.revealed)


def test_late_unlock_is_refused_and_would_reveal_the_input():
    """The limit of rule 2: a pad that arrives after UNLOCK closed must stay refused."""
    inputs = rand_inputs(5, 6, seed=6)
    late: dict[int, bytes] = {}

    def hold_back(kind, sender, receiver, data):
        if kind is Kind.UNLOCK and sender == 12 and 12 not in late:
            late[12] = data
            return None
        return data

    run = simulate(cfg(dim=6), inputs, tamper=hold_back)
    assert run.survivors == frozenset(inputs) - {12}
    assert run.result.tolist() == oracle_sum(inputs, run.survivors)
    with pytest.raises(MessageError, match="round is over"):
        run.server.receive(late[12])
    # Why: attempt 1 was complete but for 12's pad; with it the server holds a second sum.
    first = [ChainUpload.from_bytes(d).vector for k, _, a, d in run.server_view if k is Kind.UPLOAD and a == 1]
    full = np.sum(first, axis=0, dtype=U64)
    for (att, _cid), pad in run.server.revealed.items():
        if att == 1:
            full -= expand(pad, 6, label=_PAD_LABEL)
    full -= expand(run.clients[12].known_pads()[1], 6, label=_PAD_LABEL)  # what the late unlock carried
    assert np.array_equal(full - run.result, inputs[12])


def test_a_closed_stage_refuses_late_messages():
    config = cfg(dim=3)
    clients = {i: ChainClient(config, i, np.zeros(3, dtype=U64)) for i in range(3)}
    server = ChainServer(config, clients)
    adverts = {i: c.advertise() for i, c in clients.items()}
    server.receive(adverts[0])
    server.receive(adverts[1])
    step = server.close()
    with pytest.raises(MessageError, match="outside its stage"):
        server.receive_advert(adverts[2])
    assert set(step.messages) == {0, 1}


# --------------------------------------------------------------------------- messages


class Flow:
    """A 4-client round driven by hand, keeping one valid message of each kind."""

    def __init__(self, s: int = 1, n: int = 4, dim: int = 5):
        self.config = cfg(dim=dim, s=s)
        self.inputs = rand_inputs(n, dim, seed=n + s)
        self.clients = {c: ChainClient(self.config, c, x) for c, x in self.inputs.items()}
        self.server = ChainServer(self.config, self.clients)
        self.adverts = {c: cl.advertise() for c, cl in self.clients.items()}

    def advertise(self):
        for m in self.adverts.values():
            self.server.receive(m)
        self.rings = self.server.close().messages
        return self

    def share(self):
        self.bundles = {c: self.clients[c].share(m) for c, m in self.rings.items()}
        for m in self.bundles.values():
            self.server.receive(m)
        self.deliveries = self.server.close().messages
        return self

    def upload(self):
        self.uploads = {c: self.clients[c].upload(m) for c, m in self.deliveries.items()}
        return self

    def finish(self):
        for m in self.uploads.values():
            self.server.receive(m)
        requests = self.server.close().messages
        for c, m in requests.items():
            self.server.receive(self.clients[c].unlock(m))
        self.server.close()
        return self.server.result()


def test_flow_helper_sums():
    f = Flow(s=2).advertise().share().upload()
    assert f.finish().tolist() == oracle_sum(f.inputs, f.inputs)


def flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x01
    return bytes(b)


def test_server_rejects_malformed_uploads_and_the_round_continues():
    f = Flow().advertise().share().upload()
    first = next(iter(f.uploads))
    good = f.uploads[first]
    # header: magic 0-3, version 4, kind 5, stage 6, pad 7, instance 8-23, round 24-27,
    # sender 28-31, receiver 32-35, body length 36-39
    assert HEADER_BYTES == 40
    bad = {
        "truncated": (good[:-8], "truncated body"),
        "padded": (good + b"\x00" * 8, "trailing bytes"),
        "bad magic": (flip(good, 0), "bad magic"),
        "wrong round": (good[:24] + struct.pack(">I", f.config.round + 1) + good[28:], "wrong round"),
        "wrong instance": (flip(good, 10), "protocol instance"),
        "wrong sender": (good[:28] + struct.pack(">I", 999) + good[32:], "not in this attempt's ring"),
        "not for server": (good[:32] + struct.pack(">I", 3) + good[36:], "not the server"),
        "wrong attempt": (good[:HEADER_BYTES] + struct.pack(">I", 2) + good[HEADER_BYTES + 4 :], "attempt 2"),
        "wrong kind": (good[:5] + bytes([Kind.BUNDLE]) + good[6:], "header stage"),
        "garbage": (os.urandom(len(good)), "magic"),
        "empty": (b"", "truncated header"),
    }
    for name, (data, reason) in bad.items():
        with pytest.raises(MessageError, match=reason):
            f.server.receive(data)
    short = ChainUpload(f.config.instance, f.config.round, first, SERVER, attempt=1,
                        vector=np.zeros(f.config.dim - 1, dtype=U64)).to_bytes()
    with pytest.raises(MessageError, match="expected dim=5"):
        f.server.receive(short)
    f.server.receive(good)
    with pytest.raises(MessageError, match="replayed message from client"):
        f.server.receive(good)
    for c, m in f.uploads.items():
        if c != first:
            f.server.receive(m)
    for c, m in f.server.close().messages.items():
        f.server.receive(f.clients[c].unlock(m))
    f.server.close()
    assert f.server.result().tolist() == oracle_sum(f.inputs, f.inputs)


def test_messages_from_another_round_or_instance_are_rejected():
    f = Flow().advertise()
    next_round = ChainConfig(instance=f.config.instance, round=f.config.round + 1, dim=f.config.dim)
    stale = ChainClient(next_round, 10, f.inputs[10]).advertise()
    with pytest.raises(MessageError, match="wrong round"):
        ChainServer(f.config, f.clients).receive(stale)
    other = Flow()
    with pytest.raises(MessageError, match="protocol instance"):
        ChainServer(f.config, f.clients).receive(other.adverts[10])
    stranger = ChainClient(other.config, 10, f.inputs[10])
    stranger.advertise()
    with pytest.raises(MessageError, match="protocol instance"):
        stranger.share(f.rings[10])


def test_tampered_upload_fails_authentication_and_is_re_run_without_it():
    f = Flow().advertise().share().upload()
    first = next(iter(f.uploads))
    good = f.uploads[first]
    with pytest.raises(AuthenticationError):
        f.server.receive(flip(good, len(good) - 1))  # last vector byte
    with pytest.raises(AuthenticationError):
        f.server.receive(flip(good, HEADER_BYTES + 6))  # inside the tag
    other = [c for c in f.uploads if c != first][0]
    msg = ChainUpload.from_bytes(f.uploads[other])
    stolen = ChainUpload(msg.instance, msg.round, first, SERVER, attempt=1, vector=msg.vector, tag=msg.tag)
    with pytest.raises(AuthenticationError):
        f.server.receive(stolen.to_bytes())  # another client's upload claimed as first's
    f.server.receive(good)  # the server's state was not touched by the rejections
    for c, m in f.uploads.items():
        if c != first:
            f.server.receive(m)
    for c, m in f.server.close().messages.items():
        f.server.receive(f.clients[c].unlock(m))
    f.server.close()
    assert f.server.result().tolist() == oracle_sum(f.inputs, f.inputs)

    # a refused upload is padded by a seed its sender never reveals (its attempt cannot reach
    # UNLOCK): the round simply re-runs without it, like an upload lost in transit
    def tamper(kind, sender, receiver, data):
        return flip(data, len(data) - 1) if kind is Kind.UPLOAD and sender == 11 else data

    inputs = rand_inputs(5, 4, seed=2)
    for t in (tamper, lambda k, s_, r, d: None if k is Kind.UPLOAD and s_ == 11 else d):
        run = simulate(cfg(dim=4), inputs, tamper=t)
        assert run.survivors == frozenset(inputs) - {11}
        assert run.result.tolist() == oracle_sum(inputs, run.survivors)
    run = simulate(cfg(dim=4), inputs, tamper=tamper)
    assert any(isinstance(err, AuthenticationError) for _, err in run.rejected)


def test_server_rejects_bad_bundles():
    f = Flow(s=2, n=5).advertise()
    bundles = {c: f.clients[c].share(m) for c, m in f.rings.items()}
    c0 = next(iter(bundles))
    msg = ChainBundle.from_bytes(bundles[c0])
    wrong_order = ChainBundle(msg.instance, msg.round, msg.sender, SERVER, attempt=1, seeds=msg.seeds[::-1])
    too_few = ChainBundle(msg.instance, msg.round, msg.sender, SERVER, attempt=1, seeds=msg.seeds[:1])
    for data in (wrong_order.to_bytes(), too_few.to_bytes(), bundles[c0][:-1]):
        with pytest.raises(MessageError):
            f.server.receive(data)
    uninvited = ChainBundle(msg.instance, msg.round, 4242, SERVER, attempt=1, seeds=msg.seeds)
    with pytest.raises(MessageError, match="not in this attempt's ring"):
        f.server.receive(uninvited.to_bytes())
    for m in bundles.values():
        f.server.receive(m)
    with pytest.raises(MessageError, match="replayed"):
        f.server.receive(bundles[c0])
    step = f.server.close()
    assert step.kind is Kind.DELIVERY


def test_tampered_sealed_seed_is_detected_and_the_round_still_sums_the_others():
    def tamper(kind, sender, receiver, data):
        if kind is Kind.DELIVERY and receiver == 12:
            return flip(data, len(data) - 3)  # inside the last sealed seed's tag
        return data

    inputs = rand_inputs(6, 4, seed=8)
    run = simulate(cfg(dim=4, s=2), inputs, tamper=tamper)
    assert any(party == 12 and isinstance(err, AuthenticationError) for party, err in run.rejected)
    assert run.clients[12].stage is ClientStage.FAILED
    assert run.survivors == frozenset(inputs) - {12}
    assert run.result.tolist() == oracle_sum(inputs, run.survivors)


def test_sealed_seed_replayed_into_the_next_attempt_fails_authentication():
    f = Flow(s=1, n=4).advertise().share()
    old = f.deliveries
    # attempt 1 fails: one client never uploads; the others are put on a new ring
    f.upload()
    quitter = next(iter(f.uploads))
    for c, m in f.uploads.items():
        if c != quitter:
            f.server.receive(m)
    rings = f.server.close().messages
    bundles = {c: f.clients[c].share(m) for c, m in rings.items()}
    for m in bundles.values():
        f.server.receive(m)
    fresh = f.server.close().messages
    victim = next(iter(fresh))
    # splice an attempt-1 ciphertext into the attempt-2 delivery
    d_new = ChainDelivery.from_bytes(fresh[victim])
    d_old = ChainDelivery.from_bytes(old[victim])
    forged = ChainDelivery(d_new.instance, d_new.round, SERVER, victim, attempt=d_new.attempt,
                           seeds=((d_new.seeds[0][0], d_old.seeds[0][1]),))
    with pytest.raises(AuthenticationError):
        f.clients[victim].upload(forged.to_bytes())
    # a replayed (old-attempt) delivery and ring are refused before any decryption
    other = [c for c in fresh if c != victim][0]
    with pytest.raises(MessageError, match="attempt"):
        f.clients[other].upload(old[other])
    with pytest.raises(MessageError, match="already"):
        f.clients[other].share(rings[other])


def test_client_rejects_inconsistent_rings():
    f = Flow(s=1, n=4).advertise()
    c = next(iter(f.rings))
    ring = ChainRing.from_bytes(f.rings[c])
    pk = KeyPair.generate().public_bytes
    bad = {
        "below min_survivors": replace(ring, ring_size=1),
        "self or server": replace(ring, successors=((c, pk),)),
        "successors and 1 predecessors": replace(ring, successors=ring.successors + ring.predecessors),
        "exceeds max_attempts": replace(ring, attempt=9),
        "message routed": replace(ring, receiver=c + 1),
        "low-order": replace(ring, successors=((ring.successors[0][0], bytes(32)),)),
        "invalid server key": replace(ring, server_key=bytes(32)),
        "two different public keys": replace(ring, predecessors=((ring.successors[0][0], pk),)),
    }
    for reason, m in bad.items():
        with pytest.raises(MessageError, match=reason):
            f.clients[c].share(m.to_bytes())
        assert f.clients[c].stage is ClientStage.ADVERTISED  # unchanged
    f.clients[c].share(f.rings[c])


def test_transition_tables_are_exhaustive():
    f = Flow().advertise().share().upload()
    c = next(iter(f.clients))
    for m in f.uploads.values():
        f.server.receive(m)
    requests = f.server.close().messages
    unlock = f.clients[c].unlock(requests[c])
    by_kind = {Kind.ADVERT: f.adverts[c], Kind.BUNDLE: f.bundles[c], Kind.UPLOAD: f.uploads[c], Kind.UNLOCK: unlock}
    # server: every (stage, kind) outside the table is refused unread
    for stage in ServerStage:
        for kind, data in by_kind.items():
            if kind in SERVER_ACCEPTS[stage]:
                continue
            server = ChainServer(f.config, f.clients)
            server.stage = stage
            with pytest.raises(MessageError):
                {Kind.ADVERT: server.receive_advert, Kind.BUNDLE: server.receive_bundle,
                 Kind.UPLOAD: server.receive_upload, Kind.UNLOCK: server.receive_unlock}[kind](data)
    # client: nothing is accepted in NEW or FAILED; DELIVERY only in SHARED
    assert CLIENT_ACCEPTS[ClientStage.NEW] == CLIENT_ACCEPTS[ClientStage.FAILED] == frozenset()
    fresh = ChainClient(f.config, c, f.inputs[c])
    for data in (f.rings[c], f.deliveries[c]):
        with pytest.raises(MessageError):
            fresh.handle(data)
    with pytest.raises(MessageError):
        f.clients[c].upload(f.deliveries[c])  # already UNLOCKED
    with pytest.raises(MessageError):
        f.clients[c].unlock(requests[c])  # a pad is revealed once per attempt
    with pytest.raises(MessageError):
        fresh.handle(requests[c])
    with pytest.raises(MessageError, match="do not accept"):
        fresh.handle(f.uploads[c])
    with pytest.raises(MessageError, match="expected NEW"):
        f.clients[c].advertise()


def test_config_and_input_validation_name_the_value():
    with pytest.raises(ValueError, match="instance must be 16 bytes"):
        ChainConfig(instance=b"x", round=0, dim=3)
    with pytest.raises(ValueError, match="successors must be an int"):
        ChainConfig(instance=bytes(16), round=0, dim=3, successors=0)
    with pytest.raises(ValueError, match="min_survivors"):
        ChainConfig(instance=bytes(16), round=0, dim=3, min_survivors=1)
    with pytest.raises(ValueError, match="dim must be an int"):
        ChainConfig(instance=bytes(16), round=0, dim=True)
    config = cfg(dim=3)
    with pytest.raises(ValueError, match="Encode reals"):
        ChainClient(config, 1, np.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        ChainClient(config, 1, np.zeros(4, dtype=U64))
    with pytest.raises(ValueError, match="distinct"):
        ChainServer(config, [1, 1, 2])
    with pytest.raises(ValueError, match="invite more"):
        ChainServer(config, [1])


# --------------------------------------------------------------------------- runner adapter


def test_runner_adapter_maps_stages_and_reports_costs():
    from secagg.chain_sim import run_chain
    from secagg.runner import RunSpec

    rng = np.random.default_rng(5)  # CSPRNG-OK: test inputs
    x = rng.integers(0, 2**64, (12, 7), dtype=U64)
    spec = RunSpec(k=2, dropouts={"advertise": frozenset({0}), "share_keys": frozenset({1}),
                                  "masked_input": frozenset({2, 3}), "unmask": frozenset({4})})
    res = run_chain(x, spec)
    assert res.protocol == "chain" and res.abort is None and res.k == 2 and res.t is None
    assert res.survivors == frozenset(range(12)) - {0, 1, 2, 3, 4}  # 4 left before its unlock: one re-run
    assert res.total.tolist() == [sum(int(x[i, j]) for i in res.survivors) % 2**64 for j in range(7)]
    assert res.bytes_sent[0] == 0 and res.bytes_sent[5] > res.bytes_sent[2] > 0
    assert res.bytes_server_received == int(res.bytes_sent.sum()) and res.masks_expanded == len(res.survivors)
    assert res.client_s[0] == 0 and np.all(res.client_s[5:] > 0) and res.server_s > 0
    with pytest.raises(ValueError, match="unknown dropout stage"):
        run_chain(x, RunSpec(dropouts={"nope": frozenset({1})}))
    aborted = run_chain(x[:3], RunSpec(dropouts={"masked_input": frozenset({0, 1})}))
    assert aborted.total is None and "min_survivors" in aborted.abort


def test_chain_is_registered_in_the_runner():
    from secagg import runner

    x = np.arange(40, dtype=U64).reshape(8, 5)
    res = runner.run("chain", x, runner.RunSpec(dropouts={runner.INPUT_STAGE: frozenset({3})}))
    assert res.survivors == frozenset(range(8)) - {3}
    assert res.total.tolist() == np.delete(x, 3, axis=0).sum(axis=0).tolist()
    fp = FixedPoint(frac_bits=16, clip=1.0)
    vals = np.linspace(-1, 1, 24).reshape(6, 4)
    decoded, _ = runner.run_real("chain", vals, fp, rounding="nearest")
    assert np.allclose(decoded, vals.sum(axis=0), atol=6 * 2.0**-17)


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_fast_upload_serialisation_matches_the_generic_one(n):
    from secagg.messages import Message

    m = ChainUpload(os.urandom(16), 3, 4, SERVER, attempt=2, vector=np.arange(n, dtype=U64) * U64(2**40 + 3),
                    tag=os.urandom(28))
    assert m.to_bytes() == Message.to_bytes(m)
    back = ChainUpload.from_bytes(m.to_bytes())
    assert back.vector.tolist() == m.vector.tolist() and back.tag == m.tag and back.attempt == 2


def test_chain_bench_rows_json_and_errors(capsys):
    import json

    from secagg.chain_bench import bench_one, breakdown, main

    row = bench_one(6, 16, 0.5, s=2)
    assert row["correct"] and row["attempts"] == 2 and row["k"] == 2 and row["abort"] is None
    assert row["bytes_per_client"] == 2 * message_size(Kind.UPLOAD, dim=16) + message_size(Kind.ADVERT) + 2 * message_size(
        Kind.BUNDLE, s=2) + message_size(Kind.UNLOCK)
    assert set(breakdown(8, n=4)) >= {"client.upload", "server.receive_upload", "client.unlock", "prg_bound_client"}
    assert main(["--clients", "5", "--dims", "4", "--dropouts", "0", "0.4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["correct"] for r in out["rows"]] == [True, True]
    assert main(["--dropouts", "1.5"]) == 2 and main(["--clients", "0"]) == 2


def _to_unlock(flow):
    for m in flow.uploads.values():
        flow.server.receive(m)
    return flow.server.close().messages


def test_refused_unlock_without_a_valid_retry_aborts_but_foreign_garbage_does_not():
    f = Flow().advertise().share().upload()
    requests = _to_unlock(f)
    victim, *others = list(requests)
    for c in others:
        f.server.receive(f.clients[c].unlock(requests[c]))
    with pytest.raises(MessageError):
        f.server.receive(f.clients[victim].unlock(requests[victim])[:-5])  # truncated: most of the pad seen
    with pytest.raises(AbortError, match=rf"unlocks from \[{victim}\] arrived but were refused"):
        f.server.close()
    assert f.server.stage is ServerStage.ABORTED

    g = Flow().advertise().share().upload()
    requests = _to_unlock(g)
    victim, *others = list(requests)
    for c in others:
        g.server.receive(g.clients[c].unlock(requests[c]))
    foreign = Flow().advertise().share().upload()  # another instance: not this round's content
    foreign_requests = _to_unlock(foreign)
    with pytest.raises(MessageError, match="protocol instance"):
        g.server.receive(foreign.clients[victim].unlock(foreign_requests[victim]))
    with pytest.raises(MessageError):
        g.server.receive(os.urandom(100))
    step = g.server.close()  # the victim simply never unlocked: one re-run among the others
    assert step.kind is Kind.RING and set(step.messages) == set(others)
    assert g.server.fixed == frozenset(others)


def test_unlock_validation_and_a_pad_is_revealed_once_per_attempt():
    f = Flow().advertise().share().upload()
    requests = _to_unlock(f)
    c = next(iter(requests))
    unlock = f.clients[c].unlock(requests[c])
    with pytest.raises(MessageError, match="replayed"):
        f.server.receive(unlock) or f.server.receive(unlock)
    from secagg.chain import ChainUnlockRequest

    other = next(iter(set(requests) - {c}))
    stale = replace(ChainUnlockRequest.from_bytes(requests[other]), attempt=5).to_bytes()
    with pytest.raises(MessageError, match="attempt 5"):
        f.clients[other].unlock(stale)
    assert f.clients[other].stage is ClientStage.UPLOADED
    with pytest.raises(AuthenticationError):
        f.server.receive(flip(f.clients[other].unlock(requests[other]), len(requests[other]) + 30))
