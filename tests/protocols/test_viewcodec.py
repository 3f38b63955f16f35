"""Recorded views as bytes (protocols.viewcodec): round trips, and a strict decoder that refuses the rest."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors.numpy import save

from protocols import viewcodec as vc
from protocols.fedavg import ClientUpdate
from protocols.transport import Record


def _eq(a, b) -> bool:
    """Structural equality with arrays compared by dtype, shape and value (NaN equal to NaN)."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and \
            np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, float):
        return type(b) is float and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_eq(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_eq(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return type(a) is type(b) and a == b


def _round_trip(payloads, public=None):
    recs = [Record("client:1", "server", 3, "update", 10 + i, p) for i, p in enumerate(payloads)]
    data = vc.views_to_bytes(recs, {"server": list(range(len(recs)))}, round=3, public=public or {"n_items": 5})
    return data, vc.views_from_bytes(data)


_dtypes = st.sampled_from(["bool", "int8", "int32", "int64", "uint8", "uint64", "float16", "float32", "float64"])
_arrays = st.builds(lambda dt, shape, seed: np.asarray(np.random.default_rng(seed).standard_normal(shape) * 100).astype(dt),
                    _dtypes, st.lists(st.integers(0, 4), max_size=3).map(tuple), st.integers(0, 2**32 - 1))
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=8), st.binary(max_size=16))
_values = st.recursive(
    st.one_of(_scalars, _arrays),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
                            st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5)), inner, max_size=3)),
    max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(payloads=st.lists(_values, min_size=1, max_size=4))
def test_any_payload_of_supported_values_round_trips(payloads):
    _, rv = _round_trip(payloads)
    got = [r.payload for r in rv.roles["server"]]
    assert len(got) == len(payloads)
    for want, have in zip(payloads, got):
        assert _eq(want, have), (want, have)
    assert [r.nbytes for r in rv.records] == [10 + i for i in range(len(payloads))]


def test_registered_dataclasses_round_trip_and_a_shared_array_is_stored_once():
    model = np.arange(6, dtype=np.float32).reshape(2, 3)
    up = ClientUpdate(user=4, rows=np.array([0, 2]), item_delta=np.ones((2, 3), np.float32),
                      h_delta=np.zeros(3, np.float32), b_delta=0.5, weight=7.0)
    data, rv = _round_trip([up, model, model, {"m": model}])
    assert _eq(rv.records[0].payload, up) and isinstance(rv.records[0].payload, ClientUpdate)
    assert rv.records[1].payload is rv.records[2].payload  # one array, referred to three times
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert len([k for k in header if k != "__metadata__"]) == 4  # model once + the update's three arrays
    assert not rv.records[1].payload.flags.writeable  # shared between records: read-only


def test_every_builtin_payload_type_matches_its_dataclass():
    types = vc.payload_types()
    assert set(vc.BUILTIN_PAYLOAD_TYPES) <= set(types)
    for name in vc.BUILTIN_PAYLOAD_TYPES:
        spec = types[name]
        cls = getattr(importlib.import_module(spec.module), spec.qualname)
        assert dataclasses.is_dataclass(cls)
        assert sorted(f.name for f in dataclasses.fields(cls)) == sorted(spec.fields), name
        # the encoder finds a payload's type by the class's own module: a class moved to another module
        # (re-exported from the old one) would otherwise be recorded as an unreadable Opaque
        assert (cls.__module__, cls.__qualname__) == (spec.module, spec.qualname), name


def test_a_payload_without_an_encoding_is_kept_as_opaque_not_pickled():
    class Secret:
        pass

    _, rv = _round_trip([Secret(), np.array([object()], dtype=object), {(1, 2): 3}])
    got = [r.payload for r in rv.records]
    assert all(isinstance(p, vc.Opaque) for p in got)
    assert got[0].type.endswith("Secret") and "object" in got[1].type


def _file(meta: dict, arrays: dict | None = None) -> bytes:
    return save(arrays or {}, metadata={"format": vc.FORMAT, "view": json.dumps(meta)})


def _meta(payload, roles=None):
    return {"round": 0, "records": [["client:0", "server", 0, "update", 1, payload]],
            "roles": roles or {"server": [0]}, "public": {"$": "d", "k": [], "v": []}}


@pytest.mark.parametrize("data, words", [
    (b"not a view file at all", "not a view file"),
    (save({"a0": np.zeros(2)}, metadata={"format": "other"}), "not a secagg-fedrec-view/1 file"),
    (_file(_meta({"$": "zz"})), "unknown tag"),
    (_file(_meta({"$": "o", "t": "os.system", "ver": 1, "f": {}})), "unknown payload type"),
    (_file(_meta({"$": "o", "t": "fedavg.ClientUpdate", "ver": 2, "f": {}})), "version"),
    (_file(_meta({"$": "o", "t": "fedavg.ClientUpdate", "ver": 1, "f": {"user": 1}})), "fields"),
    (_file(_meta({"$": "nd", "a": "a1"}), {"a0": np.zeros(2)}), "missing"),
    (_file(_meta(None), {"a0": np.zeros(2)}), "nothing refers to"),
    (_file(_meta(None, roles={"server": [3]})), "record indices"),
    (_file({**_meta(None), "round": 1}), "round must be 1"),
    (_file(_meta(json.loads("[" * 200 + "]" * 200))), "deep"),
])
def test_the_decoder_refuses_what_it_did_not_write(data, words):
    with pytest.raises(vc.ViewFormatError, match=words):
        vc.views_from_bytes(data)


def test_a_field_of_the_wrong_kind_is_refused():
    f = {"user": "four", "rows": {"$": "nd", "a": "a0"}, "item_delta": {"$": "nd", "a": "a0"},
         "h_delta": {"$": "nd", "a": "a0"}, "b_delta": 0.5, "weight": 1.0}
    data = _file(_meta({"$": "o", "t": "fedavg.ClientUpdate", "ver": 1, "f": f}), {"a0": np.zeros(2)})
    with pytest.raises(vc.ViewFormatError, match="field 'user' holds a str"):
        vc.views_from_bytes(data)


def test_register_payload_type_checks_the_fields():
    @dataclasses.dataclass(frozen=True)
    class Toy:
        a: int
        b: np.ndarray

    with pytest.raises(ValueError, match="must be the dataclass"):
        vc.register_payload_type(Toy, "test.Toy", 1, {"a": int})
    with pytest.raises(ValueError, match="already registered"):
        vc.register_payload_type(Toy, "fedavg.ClientUpdate", 1, {"a": int, "b": np.ndarray})
