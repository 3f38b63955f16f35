"""Recorded adversary views as bytes: a typed, versioned encoding with a strict decoder.

A run that records views (``[run] record_views``) keeps, per recorded round, the transcript
records an adversary role received or sent, payloads included, plus ``public_info()``. Payloads
are whatever the protocols send: numpy arrays, ``bytes`` (ciphertexts), tuples and lists of them,
and a few frozen dataclasses (FedAvg's ``ClientUpdate``, LightFR's and FedMF's ``Upload``, FEL's
``LeafModel``, ...). None of it is ever pickled: :func:`views_to_bytes` splits a round into

* the arrays, stored with ``safetensors`` (named, typed, shaped buffers and nothing else), each
  distinct array object once (a broadcast sent to every client is stored once), and
* a JSON skeleton in the file's metadata, in which every value carries an explicit tag.

The skeleton's tags (format :data:`FORMAT`)::

    null, true, 1, "text"          JSON scalars (ints of any size)
    {"$": "f", "v": "nan"}         a non-finite float ("nan", "inf", "-inf")
    {"$": "nd", "a": "a3"}         a numpy array, key into the safetensors arrays
    {"$": "b", "a": "a4"}          bytes (a uint8 array)
    {"$": "t", "v": [...]}         a tuple
    [...]                          a list
    {"$": "d", "k": [...], "v": [...]}   a dict with str or int keys (pairs, order kept)
    {"$": "o", "t": NAME, "ver": 1, "f": {field: value}}   a registered payload type
    {"$": "x", "t": "module.Class"}       a payload of a type with no encoding (:class:`Opaque`)

A payload type is registered by name and version with the kind of every field
(:func:`register_payload_type`); the decoder rebuilds it only if the name, version, field set and
every field's kind match, and imports the class from the module the registration names (never a
module named by the file). Everything else is refused with :class:`ViewFormatError`: unknown
tags, names or versions, a field of the wrong kind, arrays that nothing refers to or that are
missing, a dtype outside :data:`DTYPES`, JSON nested deeper than :data:`MAX_DEPTH` levels, a file
that is not a view file. A payload of an unregistered type is written as :class:`Opaque` (its
type name only): an attack sees it as a message it cannot read, like a ciphertext.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocols.state import loads_json
from protocols.transport import Record

__all__ = [
    "BUILTIN_PAYLOAD_TYPES",
    "DTYPES",
    "FORMAT",
    "MAX_DEPTH",
    "Opaque",
    "PayloadType",
    "RoundViews",
    "ViewFormatError",
    "decode_value",
    "encode_value",
    "payload_types",
    "register_payload_type",
    "views_from_bytes",
    "views_to_bytes",
]

#: Format name written in every view file (the version is part of the name).
FORMAT = "secagg-fedrec-view/1"
#: Deepest nesting of a payload (lists, tuples, dicts, registered objects): real payloads use 3.
MAX_DEPTH = 32
#: The array dtypes a view file may hold.
DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                   "float32", "float64"})
#: The skeleton's JSON nests at most this deep (each payload level takes at most three JSON levels).
_MAX_JSON_DEPTH = 3 * MAX_DEPTH + 8
#: The safetensors header: name -> {dtype, shape, data_offsets}, plus the metadata strings.
_MAX_HEADER_DEPTH = 4


class ViewFormatError(ValueError):
    """A view file (or an encoded value) could not be read; the message says what was wrong."""


@dataclass(frozen=True)
class Opaque:
    """A payload whose type has no registered encoding: the view keeps that it was there, not its content.

    Attributes:
        type: ``module.Class`` of the payload as the receiver saw it.
    """

    type: str


#: A field kind: a Python type, or a tuple of them; ``object`` means any encodable value.
_Kind = type | tuple[type, ...]


@dataclass(frozen=True)
class PayloadType:
    """A registered payload dataclass.

    Attributes:
        name: stable name written in files (``"fedavg.ClientUpdate"``).
        version: bumped when the fields change; a file of another version is refused.
        module, qualname: where the class lives (imported on decode, from here only).
        fields: field name -> kind(s) (``int``, ``float``, ``str``, ``bool``, ``bytes``,
            ``np.ndarray``, ``type(None)``, ``tuple``, ``list``, or ``object`` for anything).
    """

    name: str
    version: int
    module: str
    qualname: str
    fields: Mapping[str, _Kind]

    def cls(self) -> type:
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


_BY_NAME: dict[str, PayloadType] = {}
_BY_CLASS: dict[tuple[str, str], PayloadType] = {}


def register_payload_type(cls: type, name: str, version: int, fields: Mapping[str, _Kind]) -> PayloadType:
    """Register the frozen dataclass ``cls`` under ``name``/``version``, every field with its kind.

    Raises:
        ValueError: ``cls`` is not a dataclass, the fields named are not exactly its fields, or
            the name is taken by another class.
    """
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"payload type {name!r}: {cls!r} is not a dataclass")
    declared = [f.name for f in dataclasses.fields(cls)]
    if sorted(declared) != sorted(fields):
        raise ValueError(f"payload type {name!r}: fields {sorted(fields)} must be the dataclass's {sorted(declared)}")
    if type(version) is not int or version < 1:
        raise ValueError(f"payload type {name!r}: version must be an integer >= 1; found {version!r}")
    spec = PayloadType(name, version, cls.__module__, cls.__qualname__, dict(fields))
    old = _BY_NAME.get(name)
    if old is not None and (old.module, old.qualname) != (spec.module, spec.qualname):
        raise ValueError(f"payload type name {name!r} is already registered for {old.module}.{old.qualname}")
    _BY_NAME[name] = spec
    _BY_CLASS[(spec.module, spec.qualname)] = spec
    return spec


def payload_types() -> dict[str, PayloadType]:
    """Every registered payload type, by name (the built-in ones registered on first use)."""
    _builtins()
    return dict(_BY_NAME)


_loaded = False


def _builtins() -> None:
    """Register the built-in protocols' payload dataclasses by module and name, without importing
    them (a decoder imports a class's module only when a file holds one;
    tests/protocols/test_viewcodec.py checks each entry against its dataclass)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    nd, none = np.ndarray, type(None)
    update = {"user": int, "rows": nd, "item_delta": nd, "h_delta": nd, "b_delta": float, "weight": float}
    for name, module, qualname, fields in (
        ("fedavg.ClientUpdate", "protocols.fedavg", "ClientUpdate", update),
        ("fedfast.FedFastUpload", "protocols.fedfast", "FedFastUpload", {**update, "user_embedding": (nd, none)}),
        ("fedmf.Upload", "protocols.fedmf", "Upload", {"user": int, "round": int, "items": (nd, none), "body": object}),
        ("lightfr.Upload", "protocols.lightfr_config", "Upload",
         {"user": int, "round": int, "items": nd, "body": nd, "stats": (nd, none)}),
        ("fel.LeafModel", "protocols.fel_leaf", "LeafModel", {"leaf": int, "round": int, "before": nd, "after": nd}),
        ("ncf_fed.NCFUpdate", "protocols.ncf_fed", "NCFUpdate", {"user": int, "delta": object, "weight": float}),
        ("fcf.FCFUpdate", "protocols.fcf", "FCFUpdate", {"user": int, "gradient": nd, "cost": float}),
        ("fedrec.FedRecUpload", "protocols.fedrec", "FedRecUpload", {"user": int, "items": nd, "gradients": nd}),
        ("metamf.MetaMFUpload", "protocols.metamf", "MetaMFUpload",
         {"user": int, "items": nd, "item_rows": nd, "dense": nd, "loss": float}),
    ):
        spec = PayloadType(name, 1, module, qualname, fields)
        _BY_NAME.setdefault(name, spec)
        _BY_CLASS.setdefault((module, qualname), spec)


#: The built-in payload types (name -> module, class), for tests and documentation.
BUILTIN_PAYLOAD_TYPES = ("fedavg.ClientUpdate", "fedfast.FedFastUpload", "fedmf.Upload", "lightfr.Upload",
                         "fel.LeafModel", "ncf_fed.NCFUpdate", "fcf.FCFUpdate", "fedrec.FedRecUpload",
                         "metamf.MetaMFUpload")


# -- encoding ---------------------------------------------------------------------------------------


class _Arrays:
    """The arrays of one file, each distinct object once (keyed ``a0``, ``a1``, ...)."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self._ids: dict[int, str] = {}
        self._keep: list[Any] = []  # the objects whose id() is a key: alive until the file is written

    def add(self, array: np.ndarray, obj: Any) -> str:
        key = self._ids.get(id(obj))
        if key is None:
            key = f"a{len(self.arrays)}"
            self.arrays[key] = np.asarray(array, order="C")  # not ascontiguousarray: it makes a 0-d array 1-d
            self._ids[id(obj)] = key
            self._keep.append(obj)
        return key


def encode_value(value: Any, arrays: _Arrays, depth: int = 0) -> Any:
    """The tagged JSON skeleton of ``value`` (arrays go to ``arrays``); see the module docstring."""
    if depth > MAX_DEPTH:
        raise ValueError(f"payload nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else {"$": "f", "v": repr(v)}
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        if value.dtype.name not in DTYPES:
            return {"$": "x", "t": f"numpy.ndarray[{value.dtype}]"}
        return {"$": "nd", "a": arrays.add(value, value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$": "b", "a": arrays.add(np.frombuffer(bytes(value), dtype=np.uint8), value)}
    if isinstance(value, tuple):
        return {"$": "t", "v": [encode_value(v, arrays, depth + 1) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, arrays, depth + 1) for v in value]
    if isinstance(value, dict):
        keys = list(value)
        if not all(isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)) for k in keys):
            return {"$": "x", "t": "dict with keys other than str or int"}
        return {"$": "d", "k": keys, "v": [encode_value(value[k], arrays, depth + 1) for k in keys]}
    if isinstance(value, Opaque):
        return {"$": "x", "t": value.type}
    _builtins()
    spec = _BY_CLASS.get((type(value).__module__, type(value).__qualname__))
    if spec is not None:
        return {"$": "o", "t": spec.name, "ver": spec.version,
                "f": {f: encode_value(getattr(value, f), arrays, depth + 1) for f in spec.fields}}
    return {"$": "x", "t": f"{type(value).__module__}.{type(value).__qualname__}"}


# -- decoding ---------------------------------------------------------------------------------------


def _fail(msg: str) -> ViewFormatError:
    return ViewFormatError(msg)


def _exact_keys(node: dict, keys: set[str], what: str) -> None:
    if set(node) != keys:
        raise _fail(f"malformed {what}: keys {sorted(node)[:8]}, expected {sorted(keys)}")


def _kind_ok(value: Any, kind: _Kind) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if k is object:
            return True
        if k is float and type(value) in (float, int):
            return True
        if k is int and type(value) is int:
            return True
        if k not in (int, float) and isinstance(value, k):
            return True
    return False


class _Decoder:
    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = arrays
        self.used: set[str] = set()

    def array(self, key: Any) -> np.ndarray:
        if not isinstance(key, str) or key not in self.arrays:
            raise _fail(f"array {str(key)[:40]!r} is missing")
        self.used.add(key)
        return self.arrays[key]

    def value(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise _fail(f"payload nested deeper than {MAX_DEPTH} levels")
        if node is None or type(node) in (bool, int, float, str):
            return node
        if isinstance(node, list):
            return [self.value(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            raise _fail(f"unexpected JSON value {type(node).__name__}")
        tag = node.get("$")
        if tag == "f":
            _exact_keys(node, {"$", "v"}, "float")
            if node["v"] not in ("nan", "inf", "-inf"):
                raise _fail(f"malformed float {str(node['v'])[:20]!r}")
            return float(node["v"])
        if tag == "nd":
            _exact_keys(node, {"$", "a"}, "array reference")
            return self.array(node["a"])
        if tag == "b":
            _exact_keys(node, {"$", "a"}, "bytes reference")
            a = self.array(node["a"])
            if a.dtype != np.uint8 or a.ndim != 1:
                raise _fail("bytes must be a one-dimensional uint8 array")
            return a.tobytes()
        if tag == "t":
            _exact_keys(node, {"$", "v"}, "tuple")
            if not isinstance(node["v"], list):
                raise _fail("malformed tuple")
            return tuple(self.value(v, depth + 1) for v in node["v"])
        if tag == "d":
            _exact_keys(node, {"$", "k", "v"}, "dict")
            keys, vals = node["k"], node["v"]
            if not isinstance(keys, list) or not isinstance(vals, list) or len(keys) != len(vals):
                raise _fail("malformed dict: keys and values must be two lists of one length")
            if not all(type(k) in (str, int) for k in keys) or len(set(keys)) != len(keys):
                raise _fail("malformed dict: keys must be distinct strings or integers")
            return {k: self.value(v, depth + 1) for k, v in zip(keys, vals)}
        if tag == "x":
            _exact_keys(node, {"$", "t"}, "opaque payload")
            if not isinstance(node["t"], str) or len(node["t"]) > 200:
                raise _fail("malformed opaque payload type")
            return Opaque(node["t"])
        if tag == "o":
            return self.obj(node, depth)
        raise _fail(f"unknown tag {str(tag)[:20]!r}")

    def obj(self, node: dict, depth: int) -> Any:
        _exact_keys(node, {"$", "t", "ver", "f"}, "object")
        name, ver, fields = node["t"], node["ver"], node["f"]
        types = payload_types()
        if not isinstance(name, str) or name not in types:
            raise _fail(f"unknown payload type {str(name)[:60]!r}; known: {', '.join(sorted(types))}")
        spec = types[name]
        if type(ver) is not int or ver != spec.version:
            raise _fail(f"payload type {name!r} version {str(ver)[:10]} is not the supported {spec.version}")
        if not isinstance(fields, dict) or set(fields) != set(spec.fields):
            got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            raise _fail(f"payload type {name!r}: fields {got} are not {sorted(spec.fields)}")
        values = {}
        for f, kind in spec.fields.items():
            v = self.value(fields[f], depth + 1)
            if not _kind_ok(v, kind):
                raise _fail(f"payload type {name!r}: field {f!r} holds a {type(v).__name__}")
            values[f] = float(v) if kind is float else v
        try:
            return spec.cls()(**values)
        except (TypeError, ValueError) as exc:
            raise _fail(f"payload type {name!r} refused its fields: {exc}") from None


def decode_value(node: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """Decode one skeleton value against ``arrays`` (every array it names must exist)."""
    return _Decoder(arrays).value(node)


# -- files ------------------------------------------------------------------------------------------


def views_to_bytes(records: list[Record], roles: Mapping[str, list[int]], *, round: int,
                   public: Mapping[str, Any]) -> bytes:
    """One recorded round as safetensors bytes.

    Args:
        records: the round's records (each stored once).
        roles: role -> indices into ``records`` of what that role received or sent.
        round: the protocol round.
        public: the protocol's ``public_info()`` after the round.
    """
    from safetensors.numpy import save

    arrays = _Arrays()
    rows = [[r.sender, r.receiver, int(r.round), r.kind, int(r.nbytes), encode_value(r.payload, arrays)]
            for r in records]
    for role, idx in roles.items():
        if not all(type(i) is int and 0 <= i < len(records) for i in idx):
            raise ValueError(f"role {role!r}: record indices out of range")
    meta = {"round": int(round), "records": rows, "roles": {k: list(v) for k, v in roles.items()},
            "public": encode_value(dict(public), arrays)}
    return save(arrays.arrays, metadata={"format": FORMAT, "view": json.dumps(meta, allow_nan=False)})


@dataclass(frozen=True)
class RoundViews:
    """One decoded round: its records, each role's view (records, in order) and the public info."""

    round: int
    records: tuple[Record, ...]
    roles: Mapping[str, tuple[Record, ...]]
    public: Mapping[str, Any]


def views_from_bytes(data: bytes) -> RoundViews:
    """Parse bytes written by :func:`views_to_bytes`; anything else raises :class:`ViewFormatError`."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    if not isinstance(data, (bytes, bytearray)) or len(data) < 8:
        raise _fail("not a view file: too short")
    header_len = int.from_bytes(bytes(data[:8]), "little")
    if header_len > len(data) - 8:
        raise _fail("not a view file: truncated or not a safetensors file")
    try:
        header = loads_json(bytes(data[8 : 8 + header_len]).decode("utf-8"), _MAX_HEADER_DEPTH)
        arrays = load(bytes(data))
    except (SafetensorError, ValueError, UnicodeDecodeError, RuntimeError, OverflowError, TypeError) as exc:
        raise _fail(f"not a view file: {exc}") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("view"), str):
        raise _fail(f"not a {FORMAT} file")
    for key, a in arrays.items():
        if a.dtype.name not in DTYPES:
            raise _fail(f"array {key!r} has dtype {a.dtype}, not one a view file holds")
        a.flags.writeable = False  # shared between every record that refers to it
    try:
        body = loads_json(meta["view"], _MAX_JSON_DEPTH)
    except ValueError as exc:
        raise _fail(f"corrupt view metadata: {exc}") from None
    if not isinstance(body, dict) or set(body) != {"round", "records", "roles", "public"}:
        raise _fail("malformed view metadata: expected round, records, roles and public")
    rnd, rows, roles = body["round"], body["records"], body["roles"]
    if type(rnd) is not int or rnd < 0 or not isinstance(rows, list) or not isinstance(roles, dict):
        raise _fail("malformed view metadata: round, records or roles of the wrong type")
    dec = _Decoder(arrays)
    records = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 6:
            raise _fail(f"record {i}: expected [sender, receiver, round, kind, nbytes, payload]")
        sender, receiver, r, kind, nbytes, payload = row
        if not all(isinstance(s, str) and len(s) <= 200 for s in (sender, receiver, kind)):
            raise _fail(f"record {i}: sender, receiver and kind must be short strings")
        if type(r) is not int or r != rnd or type(nbytes) is not int or nbytes < 0:
            raise _fail(f"record {i}: round must be {rnd} and nbytes a non-negative integer")
        records.append(Record(sender, receiver, r, kind, nbytes, dec.value(payload)))
    out_roles = {}
    for role, idx in roles.items():
        if not isinstance(idx, list) or not all(type(j) is int and 0 <= j < len(records) for j in idx):
            raise _fail(f"role {str(role)[:40]!r}: record indices must be integers into the records")
        out_roles[role] = tuple(records[j] for j in idx)
    public = dec.value(body["public"])
    if not isinstance(public, dict):
        raise _fail("public info must be a table")
    if dec.used != set(arrays):
        raise _fail(f"view file holds arrays nothing refers to: {sorted(set(arrays) - dec.used)[:8]}")
    return RoundViews(rnd, tuple(records), out_roles, public)
