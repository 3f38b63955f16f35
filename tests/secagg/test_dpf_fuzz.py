"""Fuzzing the DPF key decoder (secagg/dpf.py ``KeySet.from_bytes``): random bytes, bit flips,
truncation, extension and overwritten spans raise only :class:`secagg.dpf.DpfError`; whatever is
accepted is canonical (it re-encodes to the same bytes) and evaluates without error."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg import dpf
from secagg.cuckoo import CuckooLayout
from secagg.dpf import DpfError, Forest, KeySet
from secagg.dpf_sum import DpfSumClient, DpfSumConfig, DpfSumServer
from secagg.errors import MessageError

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FOREST = Forest.of(np.array([5, 8, 3]))


def _sample(party: int, *, values: bool = True, check: bool = True) -> bytes:
    betas = np.arange(6, dtype=np.uint64).reshape(3, 2) if values else None
    keys = dpf.gen(np.array([4, 0, 2]), FOREST.depth, betas, check=check)
    return keys[party].to_bytes()


SAMPLES = [_sample(0), _sample(1), _sample(0, values=False), _sample(1, check=False),
           _sample(0, values=False, check=False)]


def _accepted(data: bytes) -> None:
    """Parse; if accepted, the key is canonical and usable."""
    try:
        key = KeySet.from_bytes(data)
    except DpfError:
        return
    assert key.to_bytes() == bytes(data)
    if key.depth == FOREST.depth and key.points == FOREST.points:
        dpf.expand_forest(key, FOREST)


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_raise_only_dpf_error(data):
    _accepted(data)


@FUZZ
@given(st.binary(max_size=300), st.integers(0, 2), st.integers(1, 4), st.integers(0, 3), st.integers(0, 3),
       st.integers(0, 4))
def test_a_plausible_header_with_a_random_body_raises_only_dpf_error(body, party, depth, flags, width, points):
    head = struct.pack(">4sBBBBIII", b"SDPF", 1, party, depth, flags, width, points, 0)
    _accepted(head + body)


@FUZZ
@given(st.data())
def test_mutated_keys_raise_only_dpf_error_or_decode_canonically(data):
    blob = bytearray(data.draw(st.sampled_from(SAMPLES)))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "overwrite", "header"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif how == "extend":
        blob += data.draw(st.binary(min_size=1, max_size=40))
    elif how == "overwrite":
        i = data.draw(st.integers(0, len(blob) - 1))
        junk = data.draw(st.binary(min_size=1, max_size=8))
        blob[i:i + len(junk)] = junk
    else:
        i = data.draw(st.integers(0, 19))
        blob[i] = data.draw(st.integers(0, 255))
    _accepted(bytes(blob))


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
def test_every_truncation_and_every_single_extension_is_refused(sample):
    blob = SAMPLES[sample]
    for cut in range(len(blob)):
        with pytest.raises(DpfError):
            KeySet.from_bytes(blob[:cut])
    with pytest.raises(DpfError, match="bytes; a key of this header has"):
        KeySet.from_bytes(blob + b"\0")


def test_non_canonical_encodings_are_refused_with_a_reason():
    blob = bytearray(SAMPLES[0])
    low = bytearray(blob)
    low[20] |= 1  # a root seed with its low bit set
    with pytest.raises(DpfError, match="low bit"):
        KeySet.from_bytes(bytes(low))
    key = KeySet.from_bytes(bytes(blob))
    for seed in range(key.points * (1 + key.depth)):  # every root and seed correction: word 0's low bit only
        for word, refused in ((0, True), (1, False)):
            flip = bytearray(blob)
            flip[20 + 16 * seed + 8 * word] ^= 1
            if refused:
                with pytest.raises(DpfError, match="low bit"):
                    KeySet.from_bytes(bytes(flip))
            else:
                KeySet.from_bytes(bytes(flip))
    bits_at = 20 + 16 * key.points * (1 + key.depth)
    for bit in range(2 * key.points * key.depth, -(-2 * key.points * key.depth // 8) * 8):  # every padding bit
        pad = bytearray(blob)
        pad[bits_at + bit // 8] |= 1 << (bit % 8)
        with pytest.raises(DpfError, match="padding"):
            KeySet.from_bytes(bytes(pad))
    pad = bytearray(blob)
    pad[bits_at + (2 * key.points * key.depth) // 8] |= 0x80  # a padding bit of the control bits
    with pytest.raises(DpfError, match="padding"):
        KeySet.from_bytes(bytes(pad))
    for at, value, reason in ((4, 2, "version"), (5, 2, "party"), (6, 0, "depth"), (7, 8, "flags"),
                              (19, 1, "reserved")):
        bad = bytearray(blob)
        bad[at] = value
        with pytest.raises(DpfError, match=reason):
            KeySet.from_bytes(bytes(bad))
    with pytest.raises(DpfError, match="magic"):
        KeySet.from_bytes(b"XDPF" + bytes(blob[4:]))
    with pytest.raises(DpfError, match="expected bytes"):
        KeySet.from_bytes("SDPF")  # type: ignore[arg-type]


def test_a_receiver_refuses_keys_of_another_shape():
    blob = SAMPLES[0]
    for kwargs in ({"party": 1}, {"depth": 4}, {"points": 4}, {"width": 3}, {"check": False}):
        with pytest.raises(DpfError, match="expects"):
            KeySet.from_bytes(blob, **kwargs)
    assert KeySet.from_bytes(blob, party=0, depth=FOREST.depth, points=3, width=2, check=True).points == 3


_CFG = DpfSumConfig(2, CuckooLayout.for_points(40, 2, seed=b"u" * 32), 2, 2, b"i" * 16)
_UPLOAD = DpfSumClient(_CFG, 1).upload(np.array([3]), np.ones((1, 2), np.uint64))[1]


@FUZZ
@given(st.data())
def test_a_server_refuses_mutated_uploads_with_message_error_only(data):
    blob = bytearray(_UPLOAD)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= 1 << data.draw(st.integers(0, 7))
    server = DpfSumServer(_CFG, 1)
    try:
        sender = server.receive(bytes(blob))
    except MessageError:
        return
    # accepted: a well-formed key of the right shape, from a valid sender (a flipped sender bit can make
    # client 1's upload client 0's: the message is then simply client 0's, n = 2)
    assert list(server.keys) == [sender] and sender in (0, 1)
    assert server.keys[sender].to_bytes() in bytes(blob)


_DCFG = DpfSumConfig(2, CuckooLayout.for_points(40, 2, seed=b"u" * 32), 2, 2, b"i" * 16, max_parts=4, dense_above=1)
_DENSE = DpfSumClient(_DCFG, 1).upload_parts(np.arange(6), np.ones((6, 2), np.uint64))[0]  # (to A, to B)


@FUZZ
@given(st.data())
def test_a_server_refuses_mutated_dense_shares_and_parts_with_message_error_only(data):
    """The dense share (kind 85) and the part fields of a key-set upload: bit flips, truncation and
    random tails raise only MessageError at the server; what is accepted is a share of the right shape."""
    party = data.draw(st.integers(0, 1))
    blob = bytearray(_DENSE[party])
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(0, len(blob)))
    blob = blob[:cut] + bytearray(data.draw(st.binary(max_size=8)))
    server = DpfSumServer(_DCFG, party)
    try:
        server.receive(bytes(blob))
    except MessageError:
        return
    assert len(server.dense) == 1  # accepted: exactly one dense share, of the shape this server expects
    got = next(iter(server.dense.values()))
    assert (len(got.seed), got.share.size) == ((0, 80) if party == 0 else (32, 0))
