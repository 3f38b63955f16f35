"""Distributed point functions over Z_2^64 d-vectors, verifiable, evaluated a forest at a time.

**Danger: a primitive.** Two servers that collude learn everything; a key set says nothing about
where its points are only as long as the servers keep their keys apart. Use the protocols built on
it (:mod:`secagg.dpf_sum`, :mod:`secagg.dpf_pir`).

**What it shares.** One key pair shares, per tree ``j`` of a *forest* (one tree per cuckoo bucket,
:mod:`secagg.cuckoo`), the point function ``f_j(x) = beta_j`` at ``x = alpha_j`` and ``0`` at every
other position ``x`` of ``[0, n_j)``, with ``beta_j`` in Z_2^64^d. Server ``b`` evaluates its key
on every position and gets ``y_b``; ``y_0 + y_1 = f`` exactly (mod 2^64). The control bits alone
also XOR-share the indicator of ``alpha_j`` (``t_0 XOR t_1 = [x = alpha_j]``): two-server PIR reuses
them, before any value is attached.

**Verification** (de Castro, Polychroniadou 2022, "Lightweight, Maliciously Secure Verifiable
Function Secret Sharing", full-domain VDPF): a key pair may come from a malicious client. Each
leaf gets a 512-bit proof ``pi_b(x) = H'(x, s_b,x) XOR t_b,x cs`` where ``H'`` is four fixed-key
MMO blocks of ``sigma(s) XOR T_c(j, x)`` (``T_c`` a public pseudorandom tweak per position and
block) and ``cs = H'(alpha, s_0) XOR H'(alpha, s_1)`` is a correction word the client includes. For
a valid pair ``pi_0(x) = pi_1(x)`` at every position; two positions where the parties' seeds or
control bits differ would need a collision of ``H'`` (or of the XOR of two of its outputs, a 4-list
problem on 512 bits). The servers compress their proofs with a PRF keyed by a *challenge* that
they draw together after the keys arrived (CBC-MAC with AES-128 over the position and the four
blocks, XOR-ed over the positions) and compare 16 bytes, plus SHA-256 of the public parts of the
keys (so a client cannot give the two servers different correction words). Equal digests: every
tree is a point function (or zero), whatever the client did. The digest of an honest key pair is
the same on both servers, so comparing it tells a server nothing new. Assumption: ``H'`` built from
fixed-key AES behaves as a random oracle (as in VDPF's own implementation); the compression is a
PRF under the challenge, unknown to the client when it made its keys.

The construction, the PRG, the key encoding and key generation are in :mod:`secagg.dpf_keys`
(re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from secagg.dpf_keys import (  # noqa: F401 - re-exported: secagg.dpf is the public face of both modules
    _CLEAR, _LOW, CHECK_BLOCKS, MAX_DEPTH, MAX_POINTS, MAX_WIDTH, VERSION, DpfError, KeySet, LeafSecret,
    _aes, _blocks, _check_hash, _children, _encryptor, _expand, _gen, _rows, _sigma, _tweaks, _value,
    _words, attach_values, gen,
)

__all__ = [
    "CHECK_BLOCKS",
    "MAX_DEPTH",
    "MAX_POINTS",
    "MAX_WIDTH",
    "VERSION",
    "Accumulator",
    "DpfError",
    "Forest",
    "KeySet",
    "LeafSecret",
    "attach_values",
    "eval_full",
    "eval_points",
    "expand_forest",
    "gen",
]


_GROUP = 8  #: keys whose deferred corrections share one subset-sum table
_GROUP_LEAVES = 1 << 16  #: leaves per group of trees expanded together (cache-sized levels)
_FLUSH_ITEMS = 1 << 18  #: 16-byte items gathered at once when the deferred corrections are applied


# -- the forest and its evaluation -----------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Forest:
    """The public shape of a key set: tree ``j`` is evaluated on positions ``[0, sizes[j])``.

    Attributes:
        sizes: ``int64 [m]`` positions per tree (a cuckoo layout's bucket sizes; an empty bucket's
            tree is never evaluated).
        depth: ``D`` with ``2^D >= max(sizes)``.
    """

    sizes: np.ndarray
    depth: int
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        sizes = np.asarray(self.sizes, dtype=np.int64)
        if sizes.ndim != 1 or not 1 <= sizes.size <= MAX_POINTS or sizes.min() < 0 or sizes.sum() < 1:
            raise ValueError(f"sizes must be 1..{MAX_POINTS} ints >= 0, not all 0; found {self.sizes!r}")
        if type(self.depth) is not int or not 1 <= self.depth <= MAX_DEPTH or sizes.max() > 2**self.depth:
            raise ValueError(f"depth {self.depth!r} does not cover the largest tree ({sizes.max()} positions)")
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def of(cls, sizes: np.ndarray) -> Forest:
        """The forest of the smallest depth covering ``sizes``."""
        sizes = np.asarray(sizes, dtype=np.int64)
        return cls(sizes, max(1, int(sizes.max() - 1).bit_length()))

    @property
    def points(self) -> int:
        return int(self.sizes.size)

    @property
    def leaves(self) -> int:
        """Positions evaluated per key set (the sum of the sizes)."""
        return int(self.sizes.sum())

    def _get(self, name: str, make):  # noqa: ANN001, ANN202
        got = self._cache.get(name)
        if got is None:
            got = self._cache[name] = make()
        return got

    @property
    def offsets(self) -> np.ndarray:
        return self._get("offsets", lambda: np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64))

    @property
    def owner(self) -> np.ndarray:
        """``int64 [leaves]``: the tree of each leaf (trees concatenated)."""
        return self._get("owner", lambda: np.repeat(np.arange(self.points), self.sizes))

    @property
    def position(self) -> np.ndarray:
        """``int64 [leaves]``: the position of each leaf in its tree."""
        return self._get("position", lambda: np.arange(self.leaves) - self.offsets[self.owner])

    def level_counts(self, level: int) -> np.ndarray:
        """Nodes kept per tree at ``level`` (0 = root, ``depth`` = leaves)."""
        span = 2 ** (self.depth - level)
        return -(-self.sizes // span)

    def children_kept(self, level: int) -> np.ndarray | None:
        """Indices of the children of ``level``'s nodes (interleaved left, right) that lie inside
        their tree (``None``: all of them)."""
        def make() -> np.ndarray | None:
            odd = self.level_counts(level + 1) % 2 == 1
            if not odd.any():
                return None
            ends = np.cumsum(2 * self.level_counts(level))
            return np.delete(np.arange(int(ends[-1])), (ends - 1)[odd])
        key = f"kept/{level}"
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def groups(self, leaves: int | None = None) -> list[tuple[int, int, Forest]]:
        """Consecutive trees ``(j0, j1, their forest)`` of about ``leaves`` leaves each."""
        leaves = _GROUP_LEAVES if leaves is None else leaves

        def make() -> list[tuple[int, int, Forest]]:
            out, j0, acc = [], 0, 0
            for j in range(self.points):
                acc += int(self.sizes[j])
                if acc >= leaves or j == self.points - 1:
                    if self.sizes[j0:j + 1].sum():
                        out.append((j0, j + 1, Forest(self.sizes[j0:j + 1], self.depth)))
                    j0, acc = j + 1, 0
            return out
        return self._get(f"groups/{leaves}", make)

    def tweaks(self) -> list[np.ndarray]:
        """The check hash's per-leaf tweaks (public; computed once per forest)."""
        return self._get("tweaks", lambda: _tweaks(self.owner, self.position))


def _check_shape(key: KeySet, forest: Forest) -> None:
    if key.depth != forest.depth or key.points != forest.points:
        raise DpfError(f"DPF key: depth {key.depth} and {key.points} trees do not match the forest "
                       f"(depth {forest.depth}, {forest.points} trees)")


def _expand_trees(key: KeySet, j0: int, j1: int, forest: Forest) -> tuple[np.ndarray, np.ndarray]:
    """Leaf seeds and control bits of trees ``j0 .. j1-1`` of ``key`` (``forest``: their shape).

    Level by level over those trees at once (two AES calls per level); only nodes whose subtree
    meets a tree's positions are expanded.
    """
    live = forest.sizes > 0
    seed_cw, t_cw = key.seed_cw[j0:j1], key.t_cw[j0:j1]
    seeds = key.roots[j0:j1][live]
    t = np.full(int(live.sum()), key.party, np.uint8)
    for level in range(key.depth):
        counts = forest.level_counts(level)
        both = _children(seeds)  # [2n, 2], children interleaved
        bits = (both[:, 0] & _LOW).astype(np.uint8)
        both[:, 0] &= _CLEAR
        # a child whose parent has t = 1 takes the level's corrections (seed, and its side's bit)
        mask = np.repeat(np.uint64(0) - t.astype(np.uint64), 4)
        cw = np.repeat(_rows(seed_cw[:, level]), 2 * counts).view(np.uint64)
        cw &= mask
        both.reshape(-1)[:] ^= cw
        bits ^= np.repeat(t, 2) & np.repeat(np.ascontiguousarray(t_cw[:, level]).view(np.uint16), counts).view(np.uint8)
        keep = forest.children_kept(level)
        if keep is not None:
            both, bits = _blocks(_rows(both)[keep]), bits[keep]
        seeds, t = both, bits
    return seeds, t


def expand_forest(key: KeySet, forest: Forest) -> tuple[np.ndarray, np.ndarray]:
    """Every leaf's seed and control bit: ``(uint64 [leaves, 2], uint8 [leaves])``, trees concatenated.

    A few trees at a time (:meth:`Forest.groups`, about 64K leaves each), so the working set of a
    level stays in cache.
    """
    _check_shape(key, forest)
    parts = [_expand_trees(key, j0, j1, sub) for j0, j1, sub in forest.groups()]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def eval_full(key: KeySet, forest: Forest) -> np.ndarray:
    """``y_b`` on every position of every tree: ``uint64 [leaves, width]`` (trees concatenated).

    Row-major and unblocked: the reference for :class:`Accumulator` (use that for sums).
    """
    if key.value_cw is None:
        raise DpfError("DPF key: no values attached (a PIR-only key)")
    seeds, t = expand_forest(key, forest)
    y = _value(seeds, key.width)
    on = t.astype(bool)
    y[on] += key.value_cw[forest.owner[on]]
    return np.uint64(0) - y if key.party else y


def eval_points(key: KeySet, trees: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Single-point evaluation: ``(y_b uint64 [n, width] or None, t_b uint8 [n])`` at ``(trees[i],
    positions[i])``, walking one path per query (all queries at once)."""
    trees = np.asarray(trees, np.int64)
    positions = np.asarray(positions, np.int64)
    if trees.shape != positions.shape or trees.ndim != 1:
        raise ValueError("trees and positions must be 1-D arrays of the same length")
    if trees.size and (trees.min() < 0 or trees.max() >= key.points or positions.min() < 0
                       or positions.max() >= 2**key.depth):
        raise ValueError("a query lies outside the key's trees or positions")
    seeds = key.roots[trees].copy()
    t = np.full(trees.size, key.party, np.uint8)
    for level in range(key.depth):
        bit = ((positions >> (key.depth - 1 - level)) & 1).astype(bool)
        left, t_left, right, t_right = _expand(seeds)
        nxt = np.where(bit[:, None], right, left)
        t_next = np.where(bit, t_right, t_left)
        t_cw = np.where(bit, key.t_cw[trees, level, 1], key.t_cw[trees, level, 0])
        on = t.astype(bool)
        nxt[on] ^= key.seed_cw[trees[on], level]
        seeds, t = nxt, t_next ^ (t & t_cw)
    if key.value_cw is None:
        return None, t
    y = _value(seeds, key.width)
    on = t.astype(bool)
    y[on] += key.value_cw[trees[on]]
    return (np.uint64(0) - y if key.party else y), t


# -- a server's running sum ------------------------------------------------------------------------

class Accumulator:
    """A server's sum of full-domain evaluations over many key sets, and their verification.

    Bucket space, block-major (``[blocks, leaves, 2]``: value block ``i`` of every leaf is
    contiguous, so each AES call's output is added as it is), walked in chunks of ``chunk`` leaves
    so the keystream stays in cache. The control-bit corrections ``t_x CW_j`` are deferred: each
    key's control bits are kept packed and applied ``batch`` keys at a time, eight at once through a
    table of subset sums (:meth:`_flush`).

    Args:
        forest: the public shape of every key set.
        width: ``d``, words per value.
        party: this server's party (0 or 1).
        challenge: 16 secret bytes both servers drew after the keys arrived (``None``: no checks).
    """

    def __init__(self, forest: Forest, width: int, party: int, *, challenge: bytes | None = None,
                 chunk: int = 16384, batch: int = 64) -> None:
        if type(width) is not int or not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"width must be an int in [1, {MAX_WIDTH}]; found {width!r}")
        if party not in (0, 1):
            raise ValueError(f"party must be 0 or 1; found {party!r}")
        if challenge is not None and (not isinstance(challenge, bytes) or len(challenge) != 16):
            raise ValueError("challenge must be 16 bytes")
        self.forest, self.width, self.party = forest, width, party
        self.blocks = -(-width // 2)
        self._acc = np.zeros((self.blocks, forest.leaves, 2), np.uint64)
        self._chunk, self._batch = int(chunk), int(batch)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._mac = None if challenge is None else Cipher(algorithms.AES(challenge), modes.ECB()).encryptor()
        self._mac_pos: np.ndarray | None = None
        self.count = 0

    def _expect(self, key: KeySet) -> None:
        if key.party != self.party or key.width != self.width or key.value_cw is None:
            raise DpfError(f"DPF key: party {key.party}, width {key.width}; this accumulator is party "
                           f"{self.party}, width {self.width}")
        if self._mac is not None and key.check_cw is None:
            raise DpfError("DPF key: not verifiable (no check correction words) but checks are on")

    def add(self, key: KeySet, *, sign: int = 1) -> bytes | None:
        """Add (``sign = 1``) or remove (``-1``) one key set's evaluation; return its check digest
        (``None`` without a challenge). Raises :class:`DpfError` for a key of another shape."""
        self._expect(key)
        if sign not in (1, -1):
            raise ValueError(f"sign must be 1 or -1; found {sign!r}")
        _check_shape(key, self.forest)
        negate = (self.party == 1) != (sign == -1)
        op = np.subtract if negate else np.add
        mac = self._mac
        folded = np.zeros((self._chunk, 2), np.uint64)  # XOR of the leaves' MACs, row by row
        buf = np.empty((self._chunk + 1, 2), np.uint64)
        buf2 = np.empty((self._chunk + 1, 2), np.uint64)
        out, out2 = memoryview(buf).cast("B"), memoryview(buf2).cast("B")
        values = [_encryptor(b"value/%d" % i) for i in range(self.blocks)]
        if mac is not None:
            assert key.check_cw is not None
            tweaks, first = self.forest.tweaks(), self._positions()
            checks = [_encryptor(b"check/%d" % c) for c in range(CHECK_BLOCKS)]
        acc = self._acc
        t_all = np.empty(self.forest.leaves, np.uint8)
        offsets, owner = self.forest.offsets, self.forest.owner
        if mac is not None:  # each leaf's tree's check correction, gathered per chunk (16-byte items)
            check_rows = [_rows(np.ascontiguousarray(key.check_cw[:, c])) for c in range(CHECK_BLOCKS)]
        for j0, j1, sub in self.forest.groups():
            seeds, t = _expand_trees(key, j0, j1, sub)
            base = int(offsets[j0])
            t_all[base:base + t.size] = t
            # chunks run across the trees of the group (the leaves of consecutive trees are
            # contiguous), so the Python overhead is per chunk, not per tree
            for lo in range(base, base + t.size, self._chunk):
                hi = min(lo + self._chunk, base + t.size)
                n = hi - lo
                sig = _sigma(seeds[lo - base:hi - base])
                src = memoryview(sig).cast("B")
                y = buf[:n]
                for i, enc in enumerate(values):
                    enc.update_into(src, out)
                    np.bitwise_xor(y, sig, out=y)
                    op(acc[i, lo:hi], y, out=acc[i, lo:hi])
                if mac is not None:
                    mask = np.repeat(np.uint64(0) - t[lo - base:hi - base].astype(np.uint64), 2).reshape(n, 2)
                    ow = owner[lo:hi]
                    state = first[lo:hi]
                    for c, enc in enumerate(checks):
                        x = sig ^ tweaks[c][lo:hi]
                        enc.update_into(memoryview(x).cast("B"), out)
                        np.bitwise_xor(y, x, out=y)
                        cw = _blocks(check_rows[c][ow])
                        cw &= mask
                        y ^= cw
                        np.bitwise_xor(state, y, out=x)
                        mac.update_into(memoryview(x).cast("B"), out2)
                        state = buf2[:n]
                    np.bitwise_xor(folded[:n], state, out=folded[:n])
        t = t_all
        digest = np.bitwise_xor.reduce(folded, axis=0)
        cw = key.value_cw if not negate else np.uint64(0) - key.value_cw
        self._pending.append((np.packbits(t), cw))
        if len(self._pending) >= self._batch:
            self._flush()
        self.count += sign
        return None if mac is None else _words(digest) + key.public_digest()

    def _positions(self) -> np.ndarray:
        """``AES_challenge(position block)`` per leaf: the first block of each leaf's CBC-MAC."""
        if self._mac_pos is None:
            enc = np.stack([self.forest.position.astype(np.uint64), self.forest.owner.astype(np.uint64)], axis=1)
            self._mac_pos = _aes(self._mac, enc)
        return self._mac_pos

    def _flush(self) -> None:
        """Apply the deferred ``t_x CW_j`` of the pending keys, ``g`` keys at a time ("four Russians"):
        per tree, a table of the ``2^g`` subset sums of the ``g`` keys' ``CW_j`` (exact in Z_2^64), and
        per leaf one row of it, picked by the ``g`` keys' control bits there. ``g`` (at most 8) keeps
        the table (``m 2^g`` rows) an eighth of the leaves or less (cache-resident gathers), so small tables with many trees do not
        pay for subset sums they never read; one gather over all trees per chunk of leaves."""
        pending, self._pending = self._pending, []
        n = self.forest.leaves
        m = self.forest.points
        g_max = max(1, min(_GROUP, (n // max(m, 1)).bit_length() - 4))  # 2^g <= leaves / (8 m): measured best
        owner = self.forest.owner
        for g in range(0, len(pending), g_max):
            group = pending[g:g + g_max]
            index = np.zeros(n, np.int64)
            for k, (packed, _) in enumerate(group):
                index |= np.unpackbits(packed, count=n).astype(np.int64) << k
            size = 1 << len(group)
            index += owner * size
            # block-major from the start: [blocks, m, 2^g, 2] words, so no transposed copy of the table
            cws = np.zeros((len(group), m, 2 * self.blocks), np.uint64)
            for k, (_, cw) in enumerate(group):
                cws[k, :, :self.width] = cw
            cws = np.ascontiguousarray(cws.reshape(len(group), m, self.blocks, 2).transpose(0, 2, 1, 3))
            table = np.zeros((self.blocks, m, size, 2), np.uint64)
            for k in range(len(group)):
                half = 1 << k
                np.add(table[:, :, :half], cws[k][:, :, None, :], out=table[:, :, half:2 * half])
            # item (j, subset) of block i at [i, j * 2^g + subset], 16 bytes each
            rows = table.reshape(self.blocks, -1).view(np.complex128)
            step = max(1, _FLUSH_ITEMS // self.blocks)
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                picked = np.take(rows, index[lo:hi], axis=1)  # [blocks, hi - lo] complex
                view = self._acc[:, lo:hi, :]
                np.add(view, picked.view(np.uint64).reshape(self.blocks, hi - lo, 2), out=view)

    def scatter(self, elements: np.ndarray, rows: int) -> np.ndarray:
        """This server's share mapped out of bucket space: ``out[elements[leaf]] += acc[leaf]``,
        ``uint64 [rows, width]`` (``elements``: the row of each leaf, e.g. a cuckoo layout's; distinct
        within a tree). Tree by tree from the block-major sum, so no ``leaves x width`` copy is made."""
        self._flush()
        elements = np.asarray(elements, dtype=np.int64)
        if elements.shape != (self.forest.leaves,) or (elements.size and (elements.min() < 0 or elements.max() >= rows)):
            raise ValueError(f"elements must be {self.forest.leaves} row indices below {rows}")
        out = np.zeros((rows, self.width), np.uint64)
        offsets = self.forest.offsets
        for j in range(self.forest.points):
            lo, hi = int(offsets[j]), int(offsets[j + 1])
            if lo == hi:
                continue
            part = self._acc[:, lo:hi, :].transpose(1, 0, 2).reshape(hi - lo, 2 * self.blocks)[:, :self.width]
            idx = elements[lo:hi]
            out[idx] += part
        return out

    def total(self) -> np.ndarray:
        """This server's share of the sum: ``uint64 [leaves, width]`` in bucket space."""
        self._flush()
        return np.ascontiguousarray(self._acc.transpose(1, 0, 2).reshape(self.forest.leaves, 2 * self.blocks)
                                    [:, :self.width])
