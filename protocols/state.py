"""Checkpoints as tensors plus JSON: nothing a user can tamper with is ever unpickled.

A protocol's ``state_dict()`` is a tree of dicts (string keys), lists, tuples, ``torch.Tensor``,
``numpy.ndarray`` and JSON scalars (including Python ints of any size, e.g. numpy's PCG64
state). :func:`save_state` splits it into the arrays, stored with ``safetensors`` (a format that
holds only named, typed, shaped buffers), and a JSON skeleton in the file's metadata that says
where each array goes and whether it was a tensor or a numpy array. :func:`load_state` parses
both with strict checks and raises :class:`StateError` for anything it does not recognise:
a truncated or altered file, a pickle, unknown markers, missing arrays or unused ones.

Nesting is bounded: a state tree may hold at most :data:`MAX_DEPTH` (64) levels of dicts, lists
and tuples (the root table is level 1; protocol states use 3 to 6). :func:`state_to_bytes`
refuses a deeper tree with a ``ValueError``, so every checkpoint written can be read back, and
:func:`state_from_bytes` refuses deeper JSON before parsing it (Python's ``json`` recurses once
per level: 100,000 nested lists used to escape as ``RecursionError``). :func:`loads_json` is the
same bounded parser for the other JSON files of a run directory; importing this module loads neither
numpy nor torch (the serialisers import them), so reading those files stays cheap.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: loads_json serves help texts and reports that need neither
    import torch

__all__ = ["MAX_DEPTH", "StateError", "load_state", "loads_json", "state_from_bytes", "state_to_bytes"]

_FORMAT = "secagg-fedrec-state/1"
_ARRAY, _TUPLE = "__array__", "__tuple__"

#: Deepest nesting of a state tree (and of any JSON file of a run directory): the root is level 1,
#: every dict, list or tuple below it adds one.
MAX_DEPTH = 64
#: The JSON skeleton of a state of MAX_DEPTH levels: a tuple takes two JSON levels
#: (``{"__tuple__": [...]}``), an array or float marker one more.
_MAX_SKELETON_DEPTH = 2 * MAX_DEPTH + 1
#: The safetensors header: tensor name -> {dtype, shape, data_offsets}, plus the metadata strings.
_MAX_HEADER_DEPTH = 4
#: JSON strings (skipped whole, so brackets inside them do not count) and brackets.
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_INT_KEY = re.compile(r"-?[0-9]+")


class StateError(ValueError):
    """A checkpoint could not be read as tensors plus JSON."""


def loads_json(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` that refuses arrays and objects nested deeper than ``max_depth`` first.

    The depth is counted by a scan that skips strings, before the recursive parser runs, so
    hostile nesting costs one linear pass and never a ``RecursionError``.

    Raises:
        ValueError: nested too deeply (the message says ``nested deeper than N levels``), or not
            JSON (``json.JSONDecodeError``, a ``ValueError``).
    """
    if text.count("[") + text.count("{") > max_depth:  # else it cannot nest that deep: skip the scan
        depth = 0
        for match in _JSON_TOKENS.finditer(text):
            token = match.group()
            if token == "[" or token == "{":
                depth += 1
                if depth > max_depth:
                    raise ValueError(f"JSON nested deeper than {max_depth} levels (at character {match.start()})")
            elif token == "]" or token == "}":
                depth -= 1
    return json.loads(text)


def _split(node: Any, path: str, arrays: dict[str, torch.Tensor], depth: int = 1) -> Any:
    import numpy as np
    import torch

    if isinstance(node, (dict, list, tuple)) and depth > MAX_DEPTH:
        raise ValueError(
            f"state {path}: nested deeper than {MAX_DEPTH} levels of dicts, lists and tuples; "
            "a checkpoint holds at most that many"
        )
    if isinstance(node, torch.Tensor):
        key = f"t{len(arrays)}"
        arrays[key] = node.detach().cpu().contiguous()
        return {_ARRAY: key, "kind": "torch"}
    if isinstance(node, np.ndarray):
        if node.dtype == object:
            raise TypeError(f"state {path}: object arrays cannot be checkpointed")
        key = f"t{len(arrays)}"
        arrays[key] = torch.from_numpy(np.ascontiguousarray(node).copy())
        return {_ARRAY: key, "kind": "numpy"}
    if isinstance(node, np.generic):
        return _split(node.item(), path, arrays, depth)
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"state {path}: keys must be str or int; found {k!r}")
            if isinstance(k, str) and (k in (_ARRAY, _TUPLE, "__float__") or k.startswith("#int:")):
                raise TypeError(f"state {path}: key {k!r} is reserved")
            out[str(k) if isinstance(k, str) else f"#int:{k}"] = _split(v, f"{path}.{k}", arrays, depth + 1)
        return out
    if isinstance(node, tuple):
        return {_TUPLE: [_split(v, f"{path}[{i}]", arrays, depth + 1) for i, v in enumerate(node)]}
    if isinstance(node, list):
        return [_split(v, f"{path}[{i}]", arrays, depth + 1) for i, v in enumerate(node)]
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if isinstance(node, float):
        return node if math.isfinite(node) else {"__float__": repr(node)}
    raise TypeError(f"state {path}: cannot checkpoint a {type(node).__name__}")


def _key(key: str) -> str | int:
    if not key.startswith("#int:"):
        return key
    digits = key[5:]
    try:
        if not _INT_KEY.fullmatch(digits):
            raise ValueError
        return int(digits)
    except ValueError:  # also more digits than int() converts
        raise StateError(f"malformed int key {key[:40]!r}") from None


def _join(node: Any, arrays: dict[str, torch.Tensor], used: set[str], depth: int = 1) -> Any:
    if isinstance(node, dict):
        if _ARRAY in node:
            if set(node) != {_ARRAY, "kind"} or node["kind"] not in ("torch", "numpy"):
                raise StateError(f"malformed array reference {node!r}")
            key = node[_ARRAY]
            if not isinstance(key, str) or key not in arrays or key in used:
                raise StateError(f"array {key!r} is missing or referenced twice")
            used.add(key)
            t = arrays[key]
            return t.clone() if node["kind"] == "torch" else t.numpy().copy()
        if "__float__" in node:
            if set(node) != {"__float__"} or node["__float__"] not in ("nan", "inf", "-inf"):
                raise StateError("malformed float marker")
            return float(node["__float__"])
    if isinstance(node, (dict, list)) and depth > MAX_DEPTH:
        raise StateError(f"state nested deeper than {MAX_DEPTH} levels of dicts, lists and tuples")
    if isinstance(node, dict):
        if _TUPLE in node:
            if set(node) != {_TUPLE} or not isinstance(node[_TUPLE], list):
                raise StateError("malformed tuple marker")
            return tuple(_join(v, arrays, used, depth + 1) for v in node[_TUPLE])
        return {_key(k): _join(v, arrays, used, depth + 1) for k, v in node.items()}
    if isinstance(node, list):
        return [_join(v, arrays, used, depth + 1) for v in node]
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise StateError(f"unexpected JSON value {type(node).__name__}")


def state_to_bytes(state: dict[str, Any]) -> bytes:
    """Serialise a state tree (see the module docstring) to safetensors bytes."""
    from safetensors.torch import save

    arrays: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "state", arrays)
    return save(arrays, metadata={"format": _FORMAT, "state": json.dumps(skeleton, allow_nan=False)})


def state_from_bytes(data: bytes) -> dict[str, Any]:
    """Parse bytes written by :func:`state_to_bytes`; anything else raises :class:`StateError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not isinstance(data, (bytes, bytearray)) or len(data) < 8:
        raise StateError("not a checkpoint: too short")
    header_len = int.from_bytes(bytes(data[:8]), "little")
    if header_len > len(data) - 8:
        raise StateError("not a checkpoint: truncated or not a safetensors file")
    try:
        header = loads_json(bytes(data[8 : 8 + header_len]).decode("utf-8"), _MAX_HEADER_DEPTH)
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        arrays = load(bytes(data))
    except (SafetensorError, ValueError, UnicodeDecodeError, RuntimeError, OverflowError) as exc:
        raise StateError(f"not a checkpoint: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or not isinstance(meta.get("state"), str):
        raise StateError(f"not a {_FORMAT} checkpoint")
    try:
        skeleton = loads_json(meta["state"], _MAX_SKELETON_DEPTH)
    except ValueError as exc:
        raise StateError(f"corrupt checkpoint metadata: {exc}") from None
    used: set[str] = set()
    state = _join(skeleton, arrays, used)
    if used != set(arrays):
        raise StateError(f"checkpoint holds arrays nothing refers to: {sorted(set(arrays) - used)}")
    if not isinstance(state, dict):
        raise StateError("checkpoint state must be a table")
    return state


def load_state(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint file written from :func:`state_to_bytes`."""
    return state_from_bytes(Path(path).read_bytes())
