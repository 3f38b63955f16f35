"""The wire-message base: strict header/body validation."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg.errors import MessageError
from secagg.messages import HEADER_BYTES, Message, Reader, Writer, decode, register


@register
@dataclass(frozen=True)
class _Probe(Message):
    KIND = 250
    STAGE = 7
    ids: tuple[int, ...] = ()
    vec: np.ndarray = None  # type: ignore[assignment]

    def _write_body(self, w: Writer) -> None:
        w.u32_array(list(self.ids)).u64_vector(self.vec)

    @classmethod
    def _read_body(cls, r: Reader, head: dict) -> _Probe:
        ids = tuple(int(i) for i in r.u32_array(max_len=100))
        return cls(**head, ids=ids, vec=r.u64_vector(max_len=1000))


def _probe(**kw):
    base = dict(instance=b"i" * 16, round=1, sender=2, receiver=3, ids=(1, 2), vec=np.arange(3, dtype=np.uint64))
    base.update(kw)
    return _Probe(**base)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=50), st.lists(st.integers(0, 2**64 - 1), max_size=50), st.integers(0, 2**32 - 1))
def test_roundtrip(ids, vec, rnd):
    m = _probe(ids=tuple(ids), vec=np.array(vec, dtype=np.uint64), round=rnd)
    back = _Probe.from_bytes(m.to_bytes())
    assert back.ids == m.ids and back.vec.tolist() == vec and back.round == rnd and back.instance == m.instance


def test_every_truncation_and_extension_rejected():
    blob = _probe().to_bytes()
    for cut in range(len(blob)):
        with pytest.raises(MessageError, match="truncated"):
            decode(blob[:cut])
    with pytest.raises(MessageError, match="trailing"):
        decode(blob + b"\x00")


def test_header_fields_validated():
    blob = bytearray(_probe().to_bytes())
    with pytest.raises(MessageError, match="magic"):
        decode(b"XXXX" + bytes(blob[4:]))
    bad = bytearray(blob); bad[4] = 9
    with pytest.raises(MessageError, match="version 9"):
        decode(bytes(bad))
    bad = bytearray(blob); bad[5] = 251
    with pytest.raises(MessageError, match="unknown kind 251"):
        decode(bytes(bad))
    bad = bytearray(blob); bad[6] = 3
    with pytest.raises(MessageError, match="header stage 3"):
        decode(bytes(bad))
    # a lying inner length: the u32 array claims 5 ids, body length fixed up to match
    body = bytearray(blob[HEADER_BYTES:]); body[0:4] = struct.pack(">I", 5)
    with pytest.raises(MessageError, match=r"_Probe \(stage 7\): vector of \d+ words exceeds"):
        decode(bytes(blob[:HEADER_BYTES]) + bytes(body))
    with pytest.raises(MessageError, match="instance"):
        _probe(instance=b"short")
    with pytest.raises(MessageError, match="round"):
        _probe(round=-1)
    with pytest.raises(MessageError, match="round"):
        _probe(round=True)


def test_duplicate_kind_refused():
    @dataclass(frozen=True)
    class Other(Message):
        KIND = 250

    with pytest.raises(ValueError, match="already taken"):
        register(Other)


def test_kind_of_reads_the_headers_kind_without_the_body_and_refuses_what_is_no_message():
    from secagg.dpf_sum import DpfDense, DpfUpload
    from secagg.messages import kind_of

    dense = DpfDense(bytes(16), 0, 1, 2, floor=2, seed=bytes(32)).to_bytes()
    assert kind_of(dense) == DpfDense.KIND != DpfUpload.KIND
    assert kind_of(dense[:HEADER_BYTES]) == DpfDense.KIND  # the body is not read
    for bad in (dense[:HEADER_BYTES - 1], b"XXXX" + dense[4:], b""):
        with pytest.raises(MessageError, match="no secagg header"):
            kind_of(bad)
