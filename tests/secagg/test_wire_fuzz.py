"""Fuzzing every wire decoder of ``secagg`` (issue 8): random and mutated bytes raise only the
framework's typed errors, and a mutated message is never folded into an aggregate.

Decoders covered: :func:`secagg.messages.decode` and ``from_bytes`` of every registered message
kind (plain, SecAgg/SecAgg+, its reused setup, chain, the two-server DPF sum), :func:`secagg.channel.open_sealed`, and the parties that
consume them (``MaskingServer.receive`` and every ``MaskingClient`` stage, ``ChainServer`` and
``ChainClient`` through the chain simulator, ``PlainServer.receive``). Mutations: bit flips,
truncation, extension, swapped header fields and swapped fixed-size body records.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import messages
from secagg.bonawitz import MaskingClient, MaskingConfig, MaskingServer, make_pki
from secagg.chain import ChainConfig, Kind
from secagg.chain_sim import simulate
from secagg.channel import associated_data, open_sealed, seal
from secagg.errors import AbortError, AuthenticationError, MessageError, SecAggError
from secagg.messages import HEADER_BYTES, decode
from secagg.dpf_run import DpfSpec, run_dpf
from secagg.plain import PlainClient, PlainConfig, PlainServer
from secagg.reuse import ReuseClient, ReuseServer

U64 = np.uint64
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: the framework's message kinds (tests may register probes of their own)
KINDS = {k: c for k, c in messages._REGISTRY.items() if c.__module__.startswith("secagg.")}


# --------------------------------------------------------------------------- valid samples


def _secagg_transcript(n: int = 5, d: int = 4):
    """Every wire message of one SecAgg+ round, by (direction, stage) -> list of bytes."""
    cfg = MaskingConfig.secagg(n, d)
    identities, pki = make_pki(n)
    clients = [MaskingClient(cfg, i, identities[i], pki) for i in range(n)]
    server = MaskingServer(cfg, pki)
    x = np.arange(n * d, dtype=U64).reshape(n, d)
    out: dict[str, list[bytes]] = {}

    def up(stage, blobs):
        out.setdefault(stage, []).extend(blobs)
        for b in blobs:
            server.receive(b)

    up("advertise", [c.advertise().to_bytes() for c in clients])
    inbox = server.broadcast_keys()
    out["broadcast"] = list(inbox.values())
    up("share_keys", [c.share_keys(inbox[c.id]).to_bytes() for c in clients])
    inbox = server.forward_shares()
    out["forward"] = list(inbox.values())
    up("masked_input", [c.mask_input(inbox[c.id], x[c.id]).to_bytes() for c in clients])
    inbox = server.request_consistency()
    out["survivors"] = list(inbox.values())
    up("consistency", [c.sign_survivors(inbox[c.id]).to_bytes() for c in clients])
    inbox = server.request_unmask()
    out["unmask_request"] = list(inbox.values())
    up("unmask", [c.unmask(inbox[c.id]).to_bytes() for c in clients])
    assert server.finish().tolist() == x.sum(axis=0).tolist()
    return out


def _reuse_transcript(n: int = 5, d: int = 4) -> list[bytes]:
    """Every wire message of a reused setup and two instances, one with a dropout (secagg/reuse.py)."""
    cfg = MaskingConfig.secagg(n, 1, t=4)
    identities, pki = make_pki(n)
    clients = [ReuseClient(cfg, i, identities[i], pki) for i in range(n)]
    server = ReuseServer(cfg, pki)
    out: list[bytes] = []

    def up(blobs):
        out.extend(blobs)
        for b in blobs:
            server.receive(b)

    up([c.advertise().to_bytes() for c in clients])
    inbox = server.broadcast_keys()
    out += list(inbox.values())
    for c in clients:
        c.setup(inbox[c.id])
    for index, drop in ((0, {4}), (1, set())):
        server.start(d)
        up([clients[u].share(index, d).to_bytes() for u in sorted(server.live)])
        inbox = server.forward_shares()
        out += list(inbox.values())
        up([clients[u].mask_input(inbox[u], np.full(d, u, dtype=U64)).to_bytes() for u in sorted(inbox) if u not in drop])
        for stage in ("sign_survivors", "unmask"):
            inbox = server.request_consistency() if stage == "sign_survivors" else server.request_unmask()
            out += list(inbox.values())
            up([getattr(clients[u], stage)(inbox[u]).to_bytes() for u in sorted(inbox)])
        assert server.finish().tolist() == [sum(range(4))] * d
    return out


def _samples() -> list[bytes]:
    """At least one valid message of every registered kind."""
    blobs = [b for stage in _secagg_transcript().values() for b in stage]
    blobs += _reuse_transcript()
    chain = simulate(ChainConfig(instance=os.urandom(16), round=1, dim=3, successors=1),
                     {i: np.full(3, i, dtype=U64) for i in range(4)})
    blobs += [d for *_, d in chain.server_view]
    chain32 = simulate(ChainConfig(instance=os.urandom(16), round=1, dim=3, successors=1, ring_bits=32),
                       {i: np.full(3, i, dtype=U64) for i in range(4)})  # the 32-bit ring's upload (format 2)
    blobs += [d for *_, d in chain32.server_view]
    cfg = PlainConfig(3, 2, os.urandom(16), 0)
    blobs.append(PlainClient(cfg, 1).send(np.ones(2, dtype=U64)).to_bytes())
    x = np.zeros((3, 20 * 2), dtype=U64)
    x[:, :2] = 1
    blobs += [blob for *_, blob in run_dpf(x, DpfSpec(20, 2, 2)).records]  # the two-server DPF sum
    x[0, :12] = 1  # six rows: above dense_above = 1 key set of 2 rows, so a dense two-server share
    blobs += [blob for *_, blob in run_dpf(x, DpfSpec(20, 2, 2, max_parts=4, dense_above=1)).records]
    return blobs


SAMPLES = _samples()
SAMPLES += [m for m in _secagg_transcript().get("broadcast", [])]  # (fresh keys: more variety)


def test_the_samples_cover_every_registered_kind():
    kinds = {decode(b).KIND for b in SAMPLES}
    # server -> client chain messages come from a hand-driven round
    from secagg.chain import ChainClient
    from secagg.chain_server import ChainServer

    config = ChainConfig(instance=os.urandom(16), round=1, dim=2)
    clients = {i: ChainClient(config, i, np.zeros(2, dtype=U64)) for i in range(3)}
    server = ChainServer(config, clients)
    for c in clients.values():
        server.receive(c.advertise())
    step = server.close()
    SAMPLES.extend(step.messages.values())
    for i, m in step.messages.items():
        server.receive(clients[i].share(m))
    step = server.close()
    SAMPLES.extend(step.messages.values())
    for i, m in step.messages.items():
        server.receive(clients[i].upload(m))
    step = server.close()
    SAMPLES.extend(step.messages.values())
    kinds |= {decode(b).KIND for b in SAMPLES}
    assert kinds == set(KINDS), sorted(set(KINDS) - kinds)


# --------------------------------------------------------------------------- mutations


def _mutate(data: bytes, draw) -> bytes:
    how = draw(st.sampled_from(["flip", "flip_tail", "truncate", "extend", "swap_header", "swap_records",
                                "overwrite"]))
    b = bytearray(data)
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << draw(st.integers(0, 7))
    elif how == "flip_tail":  # the payload end: vectors, shares, signatures, tags
        i = draw(st.integers(max(0, len(b) - 16), len(b) - 1))
        b[i] ^= 1 << draw(st.integers(0, 7))
    elif how == "truncate":
        b = b[: draw(st.integers(0, len(b) - 1))]
    elif how == "extend":
        b += draw(st.binary(min_size=1, max_size=64))
    elif how == "swap_header":  # swap two 4-byte header fields (round, sender, receiver, length)
        i, j = draw(st.lists(st.sampled_from([24, 28, 32, 36]), min_size=2, max_size=2, unique=True))
        b[i:i + 4], b[j:j + 4] = b[j:j + 4], b[i:i + 4]
    elif how == "swap_records" and len(b) >= HEADER_BYTES + 8:
        size = draw(st.sampled_from([z for z in (4, 8, 32, 36, 64, 68) if HEADER_BYTES + z <= len(b)]))
        i = draw(st.integers(HEADER_BYTES, len(b) - size))
        j = draw(st.integers(HEADER_BYTES, len(b) - size))
        a, c = bytes(b[i:i + size]), bytes(b[j:j + size])
        b[i:i + size], b[j:j + size] = c, a
    else:  # overwrite a random span with random bytes (e.g. a count or a length)
        i = draw(st.integers(0, len(b) - 1))
        junk = draw(st.binary(min_size=1, max_size=8))
        b[i:i + len(junk)] = junk
    return bytes(b)


@FUZZ
@given(st.binary(max_size=300))
def test_decode_of_random_bytes_raises_only_message_error(data):
    try:
        decode(data)
    except MessageError:
        pass


@FUZZ
@given(st.sampled_from(sorted(KINDS)), st.binary(max_size=200), st.integers(0, 2**32 - 1))
def test_decode_of_a_valid_header_with_a_random_body_raises_only_message_error(kind, body, length):
    cls = KINDS[kind]
    head = messages._HEADER.pack(messages.MAGIC, messages.VERSION, kind, cls.STAGE, os.urandom(16), 1, 2, 3,
                                 len(body) if length % 2 else length)
    try:
        msg = decode(head + body)
    except MessageError:
        return
    assert isinstance(msg, cls) and msg.to_bytes() == head + body  # accepted only if it round-trips


@FUZZ
@given(st.data())
def test_every_from_bytes_raises_only_message_error_on_mutated_messages(data):
    blob = data.draw(st.sampled_from(SAMPLES))
    cls = type(decode(blob))
    mutated = _mutate(blob, data.draw)
    for parse in (decode, cls.from_bytes, *(c.from_bytes for c in set(KINDS.values()) - {cls})):
        try:
            msg = parse(mutated)
        except MessageError:
            continue
        assert msg.to_bytes() == mutated  # whatever parses is exactly what was sent


@FUZZ
@given(st.data())
def test_open_sealed_raises_only_authentication_error(data):
    key = bytes(range(32))
    aad = associated_data(instance=bytes(16), round=1, sender=2, receiver=3, kind="fuzz")
    good = seal(key, b"secret share", aad=aad)
    blob = data.draw(st.sampled_from(["random", "mutated"]))
    blob = data.draw(st.binary(max_size=80)) if blob == "random" else _mutate(good, data.draw)
    try:
        out = open_sealed(key, blob, aad=aad)
    except AuthenticationError as exc:
        assert str(exc) == "authenticated decryption failed"  # opaque
        return
    assert blob == good and out == b"secret share"
    with pytest.raises(AuthenticationError):
        open_sealed(key, good, aad=aad + b"x")


# --------------------------------------------------------------------------- parties


CLIENT_STAGES = ("advertise", "share_keys", "masked_input", "consistency", "unmask")
SERVER_MSG = {"share_keys": "broadcast", "masked_input": "forward", "consistency": "survivors", "unmask": "unmask_request"}


@pytest.mark.parametrize(("stage", "to_server"), [(s, True) for s in CLIENT_STAGES] + [(s, False) for s in SERVER_MSG])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_secagg_message_is_refused_or_harmless_and_never_folded(stage, to_server, data):
    """One message of a SecAgg round is mutated in flight (either direction, every stage). Every
    party raises only typed errors; the round ends with the exact sum over the survivors it
    reports, or a clean abort."""
    n, d = 6, 3
    cfg = MaskingConfig.secagg(n, d)
    identities, pki = make_pki(n)
    clients = [MaskingClient(cfg, i, identities[i], pki) for i in range(n)]
    server = MaskingServer(cfg, pki)
    x = np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=n * d, max_size=n * d)), dtype=U64)
    x = x.reshape(n, d)
    victim = data.draw(st.integers(0, n - 1))
    gone: set[int] = set()

    def maybe(s, i, blob):
        return _mutate(blob, data.draw) if (s, i) == (stage, victim) else blob

    def deliver(s, make, who):
        for i in who:
            if i in gone:
                continue
            try:
                blob = make(i)
            except (MessageError, AuthenticationError, AbortError):
                gone.add(i)
                continue
            blob = maybe(s, i, blob) if to_server else blob
            try:
                server.receive(blob)
            except (MessageError, AuthenticationError):
                acc = server.acc.copy()
                gone.add(i)
                assert np.array_equal(server.acc, acc)

    def inbox_for(s, inbox):
        return {i: (maybe(s, i, b) if not to_server else b) for i, b in inbox.items()}

    try:
        deliver("advertise", lambda i: clients[i].advertise().to_bytes(), range(n))
        inbox = inbox_for("share_keys", server.broadcast_keys())
        deliver("share_keys", lambda i: clients[i].share_keys(inbox[i]).to_bytes(), sorted(inbox))
        inbox = inbox_for("masked_input", server.forward_shares())
        before = server.acc.copy()
        deliver("masked_input", lambda i: clients[i].mask_input(inbox[i], x[i]).to_bytes(), sorted(inbox))
        inbox = inbox_for("consistency", server.request_consistency())
        deliver("consistency", lambda i: clients[i].sign_survivors(inbox[i]).to_bytes(), sorted(inbox))
        inbox = inbox_for("unmask", server.request_unmask())
        deliver("unmask", lambda i: clients[i].unmask(inbox[i]).to_bytes(), sorted(inbox))
        total = server.finish()
    except AbortError:
        return
    assert before.tolist() == [0] * d
    assert total.tolist() == x[sorted(server.u3)].sum(axis=0).tolist()


@pytest.mark.parametrize("kind", list(Kind))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 8), s=st.integers(1, 2), data=st.data())
def test_a_mutated_chain_message_is_refused_or_harmless_and_never_folded(kind, n, s, data):
    """One message of the given kind is mutated in flight; the simulator re-raises anything
    that is not a typed error, and the round gives the exact survivors' sum or aborts."""
    dim = 2
    config = ChainConfig(instance=os.urandom(16), round=3, dim=dim, successors=s)
    inputs = {c: np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=dim, max_size=dim)), dtype=U64)
              for c in range(n)}
    target = data.draw(st.integers(0, n - 1))
    counter = {"i": 0}

    def tamper(k, sender, receiver, blob):
        if k is not kind:
            return blob
        i = counter["i"]
        counter["i"] += 1
        return _mutate(blob, data.draw) if i == target else blob

    run = simulate(config, inputs, tamper=tamper, keep_view=False)  # it re-raises anything untyped
    assert all(isinstance(err, (MessageError, AuthenticationError)) for _, err in run.rejected)
    if run.result is None:
        assert isinstance(run.abort, AbortError)
        return
    assert run.result.tolist() == [sum(int(inputs[c][j]) for c in run.survivors) % 2**64 for j in range(dim)]


@FUZZ
@given(st.data())
def test_plain_server_raises_only_typed_errors(data):
    cfg = PlainConfig(3, 2, bytes(16), 0)
    server = PlainServer(cfg)
    good = PlainClient(cfg, 1).send(np.ones(2, dtype=U64)).to_bytes()
    try:
        server.receive(_mutate(good, data.draw))
    except SecAggError as exc:
        assert isinstance(exc, MessageError)


def test_limit_the_plain_baseline_folds_a_flipped_vector_bit():
    """The unprotected baseline has no integrity check (it relies on the transport): a bit
    flipped in an upload's vector changes the sum. Every secure protocol refuses it."""
    cfg = PlainConfig(2, 2, bytes(16), 0)
    server = PlainServer(cfg)
    blob = bytearray(PlainClient(cfg, 0).send(np.zeros(2, dtype=U64)).to_bytes())
    blob[-1] ^= 0x80
    server.receive(bytes(blob))
    server.receive(PlainClient(cfg, 1).send(np.zeros(2, dtype=U64)).to_bytes())
    assert server.finish().tolist() == [0, 2**63]


def test_a_flipped_bit_in_a_masked_input_is_refused_not_summed(start_round):
    """Regression (found by this fuzzing): MaskedInput carried no integrity check, so a bit
    flipped in transit was added into the SecAgg sum. It is now signed by its sender."""
    t = _secagg_transcript()
    n = len(t["advertise"])
    cfg_blob = t["masked_input"][0]
    bad = bytearray(cfg_blob)
    bad[-1] ^= 1
    msg = decode(bytes(bad))
    assert struct.unpack(">I", bytes(bad[28:32]))[0] == msg.sender < n
    # replay the whole round with a fresh server but the mutated input: refused with the opaque error
    cfg = MaskingConfig.secagg(5, 4)
    identities, clients, server, inbox = start_round(cfg)
    blob = bytearray(clients[0].mask_input(inbox[0], np.zeros(4, dtype=U64)).to_bytes())
    blob[-1] ^= 1
    with pytest.raises(AuthenticationError, match="^authenticated decryption failed$"):
        server.receive(bytes(blob))
    assert server.acc.tolist() == [0] * 4


def test_the_reserved_header_byte_must_be_zero():
    """Regression (found by this fuzzing): the header's reserved byte was ignored, so one message
    had 256 encodings."""
    blob = bytearray(SAMPLES[0])
    blob[7] = 1
    with pytest.raises(MessageError, match="reserved header byte"):
        decode(bytes(blob))
