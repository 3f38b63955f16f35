"""Strict JSON for everything the ``secagg`` command writes: NaN and the infinities become ``null``.

Python's :func:`json.dumps` writes a non-finite float as the bare token ``NaN``, ``Infinity`` or
``-Infinity``, which is not JSON: strict parsers (JavaScript's ``JSON.parse``, ``jq``, Go, Rust's
serde, ``json.loads(..., parse_constant=...)``) reject the whole file. A diverged loss, an
unbounded epsilon or an unset threshold is ordinary in this framework, so every JSON the command
writes goes through :func:`dumps`: ``metrics.jsonl``, ``costs.jsonl``, ``summary.json``,
``run.json`` and every ``--json`` line. A ``null`` there means "no finite value" (the text output
and the field's documentation say which: diverged, infinite epsilon, undefined statistic).

Readers stay lenient: files written before this (with bare ``NaN``) still load, through
:func:`protocols.state.loads_json` (Python's parser accepts the tokens), and the readers treat
``null`` and ``NaN`` alike.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "strict"]


def strict(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``None`` (tuples become lists, numpy scalars and
    arrays plain values); dict keys are kept."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    tolist = getattr(obj, "tolist", None)  # numpy scalars and arrays, torch tensors
    if callable(tolist):
        return strict(tolist())
    return obj  # json.dumps decides (its ``default``, or a TypeError naming the type)


def dumps(obj: Any, **kwargs: Any) -> str:
    """:func:`json.dumps` of :func:`strict` ``(obj)``; never writes ``NaN`` or ``Infinity``."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)
