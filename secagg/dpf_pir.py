"""Private row retrieval from two servers (two-server PIR) with the keys of :mod:`secagg.dpf`.

**Parties.** A client that needs ``P`` rows of an ``N``-row table; two servers, A and B, that both
hold the table (e.g. an item-embedding table). **Adversary:** each server honest-but-curious,
the two not colluding. **Promise:** the client gets exactly the rows it asked for; each server's
view (one key set) is independent of which rows (and of how many, up to ``m``). **Limit:** the two
servers together read the indices (they evaluate both keys).

**How.** The client places its rows in the public cuckoo layout (:mod:`secagg.cuckoo`) and sends
each server a key set *without values* (a DPF tree per bucket, the point at its row's position).
Server ``b`` expands its key over every position and answers, per bucket ``j``, the XOR of the
table rows (as raw bytes, in bucket order) at the positions where its control bit is 1: the inner
product over GF(2) of its full-domain evaluation with the table. The control bits of the two
servers differ exactly at the point, so ``answer_A[j] XOR answer_B[j]`` is the row at the point of
bucket ``j``. Rows are retrieved bit for bit (floats included), no fixed point needed.

The same trees serve the two-server sum: :func:`secagg.dpf.attach_values` adds the value
correction words to keys already sent (a client fetches its item rows first, then sends its
gradients for the same rows with a few hundred more bytes per bucket).

Costs per query and server: one tree expansion over ``3 N`` positions (two AES blocks each) and
one pass over the bucket-ordered table (``3 N`` rows); the answer is ``m`` rows.
"""

from __future__ import annotations

import numpy as np

from secagg.cuckoo import CuckooLayout
from secagg.dpf import DpfError, Forest, KeySet, LeafSecret, expand_forest, gen

__all__ = ["PirQuery", "PirServer", "answer", "query", "recover"]


class PirQuery:
    """What the client keeps between its query and the answers: where each requested row sits."""

    def __init__(self, rows: np.ndarray, buckets: np.ndarray, secret: LeafSecret) -> None:
        self.rows, self.buckets, self.secret = rows, buckets, secret


def query(layout: CuckooLayout, rows: np.ndarray) -> tuple[bytes, bytes, PirQuery]:
    """The two queries (key sets for A and B, encoded) for ``rows`` (distinct, at most ``m``).

    Raises:
        CuckooError: the rows admit no placement (probability below the layout's target).
        ValueError: repeated or out-of-range rows.
    """
    rows = np.asarray(rows, dtype=np.int64)
    bucket, position = layout.assign(rows)
    alpha = layout.decoys()
    alpha[bucket] = position
    k0, k1, secret = gen(alpha, layout.depth, None, check=False)
    return k0.to_bytes(), k1.to_bytes(), PirQuery(rows, bucket, secret)


class PirServer:
    """One server's copy of the table, in bucket order (built once per table and layout).

    Args:
        layout: the public cuckoo layout.
        table: ``[N, ...]`` rows of any fixed-size dtype (answered as raw bytes).
        party: 0 (A) or 1 (B).
    """

    def __init__(self, layout: CuckooLayout, table: np.ndarray, party: int) -> None:
        table = np.ascontiguousarray(table)
        if table.shape[:1] != (layout.domain,) or table.ndim < 1:
            raise ValueError(f"the table must have {layout.domain} rows; found {table.shape}")
        if party not in (0, 1):
            raise ValueError(f"party must be 0 or 1; found {party!r}")
        self.layout, self.party = layout, party
        self.row_shape, self.dtype = table.shape[1:], table.dtype
        raw = table.reshape(layout.domain, -1).view(np.uint8)
        if raw.shape[1] % 8 == 0:
            raw = raw.view(np.uint64)
        self._rows = layout.from_domain(raw)
        self.forest = Forest(layout.sizes, layout.depth)

    def answer(self, blob: bytes) -> np.ndarray:
        """The answer to one encoded query: per bucket, the XOR of the rows where this server's
        control bit is 1 (``[m, row words]``). Raises :class:`secagg.dpf.DpfError` on a bad query."""
        key = KeySet.from_bytes(blob, party=self.party, depth=self.layout.depth, points=self.layout.buckets)
        return answer(key, self.forest, self._rows)


def answer(key: KeySet, forest: Forest, rows: np.ndarray) -> np.ndarray:
    """The GF(2) inner product of ``key``'s control bits with ``rows`` (bucket order), per tree."""
    if rows.shape[0] != forest.leaves:
        raise DpfError(f"PIR: the table has {rows.shape[0]} bucket rows; the forest {forest.leaves}")
    _, t = expand_forest(key, forest)
    picked = np.flatnonzero(t)
    out = np.zeros((forest.points, *rows.shape[1:]), rows.dtype)
    if picked.size:
        owner = forest.owner[picked]
        starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        out[owner[starts]] = np.bitwise_xor.reduceat(np.take(rows, picked, axis=0), starts, axis=0)
    return out


def recover(server: PirServer, q: PirQuery, answer_a: np.ndarray, answer_b: np.ndarray) -> np.ndarray:
    """The requested rows, in the order asked, from the two answers (``[P, *row shape]``)."""
    both = np.bitwise_xor(answer_a, answer_b)[q.buckets]
    return np.ascontiguousarray(both).view(np.uint8).view(server.dtype).reshape(len(q.rows), *server.row_shape)
