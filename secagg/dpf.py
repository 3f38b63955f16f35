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

import functools
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from secagg.dpf_keys import (  # noqa: F401 - re-exported: secagg.dpf is the public face of both modules
    _CLEAR, _LOW, CHECK_BLOCKS, MAX_DEPTH, MAX_POINTS, MAX_WIDTH, VERSION, DpfError, KeySet, LeafSecret,
    _RIGHT, _aes, _blocks, _check_hash, _children, _encryptor, _expand, _gen, _rows, _sigma, _tweaks, _value,
    _words, attach_values, gen, gen_many,
)

__all__ = [
    "keygen_prg_bytes",
    "prg_bytes_per_key_set",
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
    "gen_many",
]


_GROUP = 8  #: at most this many keys evaluated together (their control bits index one subset-sum table)
_GROUP_LEAVES = 1 << 16  #: leaves per group of trees expanded together (cache-sized levels)
_FUSED_CHUNK = 1 << 14  #: leaves per pass (over a batch's keys) of the fused loops: their buffers stay in L2


@functools.cache
def _ni():  # noqa: ANN202 - the module, or None
    """:mod:`secagg.dpf_ni` (the evaluation with AES inside its loops), or ``None`` without AES-NI."""
    from secagg import aesni
    if not aesni.available() or _fused() is None:
        return None
    from secagg import dpf_ni
    return dpf_ni


@functools.cache
def _fused():  # noqa: ANN202 - the module, or None
    """:mod:`secagg.dpf_fused` (the evaluation's compiled loops), or ``None`` where numba does not import."""
    try:
        from secagg import dpf_fused
    except ImportError:
        return None
    return dpf_fused


_FUSED_WARM = False


def _warm_fused() -> None:
    """Load the fused loops (compiled and cached on disk the first time on a machine) once per process, by
    evaluating a tiny key set with and without the check: the same array types as any evaluation."""
    global _FUSED_WARM
    if _FUSED_WARM or _fused() is None:
        return
    _FUSED_WARM = True
    forest = Forest.of(np.array([3, 0, 2]))
    key = gen(np.array([1, 0, 0]), forest.depth, np.ones((3, 3), np.uint64))[0]
    for challenge in (None, bytes(16)):  # the path a default Accumulator takes (AES-NI where available)
        Accumulator(forest, 3, 0, challenge=challenge, fused=True).add_many([key, key])


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
        """Nodes kept per tree at ``level`` (0 = root, ``depth`` = leaves); computed once per forest and
        level (every batch's evaluation reads them), read-only."""
        def make() -> np.ndarray:
            counts = -(-self.sizes // 2 ** (self.depth - level))
            counts.flags.writeable = False
            return counts
        return self._get(f"counts/{level}", make)

    @property
    def live(self) -> np.ndarray:
        """``intp [trees with positions]``: the trees that are evaluated (an empty bucket's is not)."""
        def make() -> np.ndarray:
            live = np.flatnonzero(self.sizes > 0)
            live.flags.writeable = False
            return live
        return self._get("live", make)

    def parent_trees(self, level: int) -> np.ndarray:
        """``intp [nodes]``: the tree of each node kept at ``level`` (trees in order)."""
        return self._get(f"parents/{level}", lambda: np.repeat(np.arange(self.points), self.level_counts(level)))

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

    def warm(self, batch: int = _GROUP) -> None:
        """Build the public indices the evaluation of ``batch`` key sets at a time uses (its groups of
        trees and their per-level parents and kept children): once per deployment, so that the first
        client's evaluation does not pay for them; and loads the fused loops (:func:`_warm_fused`)."""
        for _, _, sub in self.groups(max(1, _GROUP_LEAVES // max(1, min(batch, _GROUP)))):
            for level in range(sub.depth):
                sub.parent_trees(level)
                sub.children_kept(level)
        _warm_fused()

    def tweaks(self) -> np.ndarray:
        """The check hash's per-leaf tweaks, ``uint64 [CHECK_BLOCKS, leaves, 2]`` (public; computed once
        per forest)."""
        return self._get("tweaks", lambda: _tweaks(self.owner, self.position))


def _check_shape(key: KeySet, forest: Forest) -> None:
    """The key set fits the forest, and every array has the shape and type its depth and trees imply:
    the compiled evaluation reads each key's arrays in place without bounds checks (a parsed key set
    always passes; a hand-built one with a short or mistyped array is refused here)."""
    if key.depth != forest.depth or key.points != forest.points:
        raise DpfError(f"DPF key: depth {key.depth} and {key.points} trees do not match the forest "
                       f"(depth {forest.depth}, {forest.points} trees)")
    m, d = key.points, key.depth
    want = [("roots", key.roots, (m, 2), np.uint64), ("seed_cw", key.seed_cw, (m, d, 2), np.uint64),
            ("t_cw", key.t_cw, (m, d, 2), np.uint8)]
    if key.check_cw is not None:
        want.append(("check_cw", key.check_cw, (m, CHECK_BLOCKS, 2), np.uint64))
    if key.value_cw is not None:
        want.append(("value_cw", key.value_cw, (m, key.width), np.uint64))
    for name, arr, shape, dtype in want:
        if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != dtype:
            got = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise DpfError(f"DPF key: {name} must be {np.dtype(dtype).name} {shape}; found {got}")


def _expand_many(keys: list[KeySet], j0: int, j1: int, forest: Forest) -> tuple[np.ndarray, np.ndarray]:
    """Leaf seeds and control bits of trees ``j0 .. j1-1`` of every key in ``keys`` (one party's, the
    same shape; ``forest``: those trees): ``(uint64 [K, leaves, 2], uint8 [K, leaves])``.

    Level by level over those trees of all the keys at once: one AES call per level. A node carries
    its control bit in the low bit of its seed until the leaves; each parent's corrections (seed and
    control bit, for both children, 32 bytes) are one gathered row, picked by its key, its tree (a
    public index per level cached in the forest) and its control bit (a zero row when it is 0), and
    XOR-ed into both children; only the nodes whose subtree meets a tree's positions are kept.
    """
    k = len(keys)
    nodes = np.stack([key.roots[j0:j1][forest.live] for key in keys])  # [K, n, 2], control bit in the low bit
    nodes[..., 0] |= np.uint64(keys[0].party)
    # per level, a row per (key, tree, parent's control bit) with both children's corrections (32 bytes):
    # zero under a parent whose bit is 0, else the seed CW with the side's control-bit CW in its low bit
    trees = j1 - j0
    cw = np.zeros((forest.depth, k, trees, 2, 2, 2), np.uint64)  # [D, K, T, parent bit, side, word]
    cw[:, :, :, 1] = np.stack([key.seed_cw[j0:j1] for key in keys]).transpose(2, 0, 1, 3)[:, :, :, None, :]
    cw[:, :, :, 1, :, 0] |= np.stack([key.t_cw[j0:j1] for key in keys]).transpose(2, 0, 1, 3).astype(np.uint64)
    cw = cw.reshape(forest.depth, -1, 4)
    key_rows = (2 * trees * np.arange(k))[:, None]
    enc = _encryptor(b"tree")
    for level in range(forest.depth):
        n = nodes.shape[1]
        # sigma(s) (left child) and sigma(s) XOR (tweak, 0) (right child), interleaved per parent
        inp = np.empty((k, n, 2, 2), np.uint64)
        np.bitwise_and(nodes[..., 0], _CLEAR, out=inp[:, :, 0, 1])
        np.bitwise_xor(inp[:, :, 0, 1], nodes[..., 1], out=inp[:, :, 0, 0])
        inp[:, :, 1, 1] = inp[:, :, 0, 1]
        np.bitwise_xor(inp[:, :, 0, 0], _RIGHT, out=inp[:, :, 1, 0])
        out = np.empty((2 * k * n + 1, 2), np.uint64)
        enc.update_into(memoryview(inp).cast("B"), memoryview(out).cast("B"))
        both = out[:-1].reshape(k, n, 2, 2)
        np.bitwise_xor(both, inp, out=both)
        rows = (nodes[..., 0] & _LOW).astype(np.intp)
        rows += key_rows + 2 * forest.parent_trees(level)
        both.reshape(k, n, 4)[...] ^= np.take(cw[level], rows, axis=0, mode="clip")  # rows in range by construction
        nodes = both.reshape(k, 2 * n, 2)
        keep = forest.children_kept(level)
        if keep is not None:
            nodes = np.take(nodes.reshape(k, -1).view(np.complex128), keep, axis=1).view(np.uint64).reshape(k, -1, 2)
    t = (nodes[..., 0] & _LOW).astype(np.uint8)
    nodes[..., 0] &= _CLEAR
    return nodes, t


def _expand_trees(key: KeySet, j0: int, j1: int, forest: Forest) -> tuple[np.ndarray, np.ndarray]:
    """Leaf seeds and control bits of trees ``j0 .. j1-1`` of ``key`` (``forest``: their shape)."""
    seeds, t = _expand_many([key], j0, j1, forest)
    return seeds[0], t[0]


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
    contiguous). :meth:`add_many` evaluates ``batch`` key sets (at most 8) together, a group of trees
    at a time and then a chunk of about ``chunk`` leaves (over all the batch's keys) at a time, so
    that every AES call covers the whole batch, the keys' outputs are summed in cache and the sum is
    read and written once per batch, not once per key. The control-bit corrections ``t_x CW_j`` of a
    batch go in with one gather per chunk and part of ``g`` keys ("four Russians"): per tree, a table
    of the ``2^g`` subset sums of the part's ``CW_j`` (exact in Z_2^64; ``2^g <= leaves / (8 m)``, at
    most 256 rows), and per leaf the row its ``g`` control bits pick. The round's sum is allocated and
    its pages touched here, and the check's first MAC block per leaf (it depends on the challenge
    only) computed, so those costs are per round, not in the first key's evaluation. With numba the
    same evaluation runs in the fused loops of :mod:`secagg.dpf_fused` (``fused``).

    Args:
        forest: the public shape of every key set.
        width: ``d``, words per value.
        party: this server's party (0 or 1).
        challenge: 16 secret bytes both servers drew after the keys arrived (``None``: no checks).
        chunk: leaves per pass, over all the keys of a batch (default 16K with the fused loops, whose
            buffers then stay in L2; 64K for the numpy path).
        batch: key sets evaluated together (1 to 8).
        fused: evaluate with the compiled loops of :mod:`secagg.dpf_fused` (``None``: wherever numba
            imports; ``False``: the numpy path below, the same words and digests).
        aesni: with ``fused``, run AES inside those loops (:mod:`secagg.dpf_ni`; ``None``: wherever
            :func:`secagg.aesni.available`; ``False``: ``cryptography``'s AES between them). The same
            words and digests on every path.
    """

    def __init__(self, forest: Forest, width: int, party: int, *, challenge: bytes | None = None,
                 chunk: int | None = None, batch: int = _GROUP, fused: bool | None = None,
                 aesni: bool | None = None) -> None:
        if type(width) is not int or not 1 <= width <= MAX_WIDTH:
            raise ValueError(f"width must be an int in [1, {MAX_WIDTH}]; found {width!r}")
        if party not in (0, 1):
            raise ValueError(f"party must be 0 or 1; found {party!r}")
        if challenge is not None and (not isinstance(challenge, bytes) or len(challenge) != 16):
            raise ValueError("challenge must be 16 bytes")
        if fused is None:
            fused = _fused() is not None
        elif fused and _fused() is None:
            raise ValueError("fused=True needs numba (a dependency of this package; not importable here)")
        if aesni is None:
            aesni = bool(fused) and _ni() is not None
        elif aesni and (not fused or _ni() is None):
            raise ValueError("aesni=True needs the fused loops and a CPU with AES-NI (secagg.aesni.available)")
        chunk = (_FUSED_CHUNK if fused else 65536) if chunk is None else chunk
        if type(chunk) is not int or chunk < 1 or type(batch) is not int or not 1 <= batch <= _GROUP:
            raise ValueError(f"chunk must be a positive int and batch an int in [1, {_GROUP}]; found {chunk!r}, {batch!r}")
        self.forest, self.width, self.party = forest, width, party
        self.blocks = -(-width // 2)
        self._acc = np.empty((self.blocks, forest.leaves, 2), np.uint64)
        self._acc.fill(0)  # touch every page now (once per sum), not inside the first key's evaluation
        self._chunk, self._batch, self.fused, self.aesni = chunk, batch, bool(fused), bool(aesni)
        self._scratch: dict[str, np.ndarray] = {}  # the fused loops' buffers, reused by the batches of one add_many
        self._mac = None if challenge is None else Cipher(algorithms.AES(challenge), modes.ECB()).encryptor()
        self._challenge, self._mac_keys = challenge, None
        self._mac_pos: np.ndarray | None = None
        if self._mac is not None:
            self._positions()  # depends on the round's challenge only: computed once here, not per key
        self.count = 0

    def _expect(self, key: KeySet) -> None:
        if not isinstance(key, KeySet):
            raise DpfError(f"DPF key: expected a KeySet; found {type(key).__name__}")
        if key.party != self.party or key.width != self.width or key.value_cw is None:
            raise DpfError(f"DPF key: party {key.party}, width {key.width}; this accumulator is party "
                           f"{self.party}, width {self.width}")
        if self._mac is not None and key.check_cw is None:
            raise DpfError("DPF key: not verifiable (no check correction words) but checks are on")

    def add(self, key: KeySet, *, sign: int = 1) -> bytes | None:
        """Add (``sign = 1``) or remove (``-1``) one key set's evaluation; return its check digest
        (``None`` without a challenge). Raises :class:`DpfError` for a key of another shape."""
        return self.add_many([key], sign=sign)[0]

    def add_many(self, keys: list[KeySet], *, sign: int = 1) -> list[bytes | None]:
        """:meth:`add` for every key set of ``keys``, ``batch`` at a time; their digests, in order.
        Every key is checked before any is added."""
        keys = list(keys)
        if sign not in (1, -1):
            raise ValueError(f"sign must be 1 or -1; found {sign!r}")
        for key in keys:
            self._expect(key)
            _check_shape(key, self.forest)
        out: list[bytes | None] = []
        for b0 in range(0, len(keys), self._batch):
            out += self._add_batch(keys[b0:b0 + self._batch], sign)
        self._scratch.clear()  # the batches of one call share their buffers; nothing is held after it
        return out

    def _add_batch(self, keys: list[KeySet], sign: int) -> list[bytes | None]:
        if self.fused:
            self.count += sign * len(keys)
            if self.aesni:
                return _ni().add_batch(self, keys, sign, _GROUP_LEAVES)
            return _fused().add_batch(self, keys, sign, self._chunk, _GROUP_LEAVES)
        k, blocks, forest, acc, mac = len(keys), self.blocks, self.forest, self._acc, self._mac
        negate = (self.party == 1) != (sign == -1)
        op = np.subtract if negate else np.add
        offsets, owner = forest.offsets, forest.owner
        values = [_encryptor(b"value/%d" % i) for i in range(blocks)]
        # the keys' value corrections, [K, blocks, m, 2], negated when this server subtracts
        vc = np.zeros((k, forest.points, 2 * blocks), np.uint64)
        for q, key in enumerate(keys):
            vc[q, :, :self.width] = key.value_cw
        if negate:
            np.subtract(np.uint64(0), vc, out=vc)
        vc = np.ascontiguousarray(vc.reshape(k, forest.points, blocks, 2).transpose(0, 2, 1, 3))
        per = max(1, self._chunk // k)  # leaves per key per pass
        buf = np.empty((k * per + 1, 2), np.uint64)  # AES output (one row of slack for update_into)
        out = memoryview(buf).cast("B")
        tmp = np.empty((per, 2), np.uint64)
        sigbuf = np.empty((k * per, 2), np.uint64)
        pickbuf = np.empty(blocks * per, np.complex128)  # the chunk's rows of the subset-sum table
        if mac is not None:
            tweaks, first = forest.tweaks(), self._positions()
            checks = [_encryptor(b"check/%d" % c) for c in range(CHECK_BLOCKS)]
            # per check block, the items (key, tree, t) -> t cs: zero or the tree's check correction
            cs = np.zeros((CHECK_BLOCKS, k, forest.points, 2, 2), np.uint64)
            for q, key in enumerate(keys):
                cs[:, q, :, 1] = key.check_cw.transpose(1, 0, 2)
            cs = cs.reshape(CHECK_BLOCKS, -1).view(np.complex128)  # [CHECK_BLOCKS, K * m * 2]
            key_base = (2 * forest.points * np.arange(k))[:, None]
            xbuf = np.empty((k * per, 2), np.uint64)
            gbuf = np.empty(k * per, np.complex128)  # t cs per leaf and key
            buf2 = np.empty((k * per + 1, 2), np.uint64)
            out2 = memoryview(buf2).cast("B")
            folded = np.zeros((k, 2), np.uint64)  # per key: the XOR of its leaves' MACs
        # keys per subset-sum table: 2^g <= leaves / (8 m), so that small tables with many trees do not
        # build subset sums they never read (g = 8 at 10^6 rows and 230 trees, 3 at 9,724 rows)
        g = max(1, min(k, (forest.leaves // forest.points).bit_length() - 4))
        parts = [(q0, min(q0 + g, k)) for q0 in range(0, k, g)]
        weights = (1 << np.arange(g)).astype(np.uint8)
        for j0, j1, sub in forest.groups(max(1, _GROUP_LEAVES // k)):
            seeds, t = _expand_many(keys, j0, j1, sub)
            # subset sums of each part's value corrections, per tree of the group: [blocks, T, 2^g, 2]
            tables = []
            for q0, q1 in parts:
                table = np.zeros((blocks, j1 - j0, 1 << (q1 - q0), 2), np.uint64)
                for q in range(q0, q1):
                    half = 1 << (q - q0)
                    np.add(table[:, :, :half], vc[q, :, j0:j1, None, :], out=table[:, :, half:2 * half])
                tables.append(table.reshape(blocks, -1).view(np.complex128))  # item (tree, subset) of block i
            # chunks run across the trees of the group (the leaves of consecutive trees are contiguous)
            base, count = int(offsets[j0]), t.shape[1]
            for lo in range(0, count, per):
                hi = min(lo + per, count)
                n, a, b = hi - lo, base + lo, base + hi
                s = seeds[:, lo:hi]
                sig = sigbuf[:k * n].reshape(k, n, 2)
                np.bitwise_xor(s[..., 0], s[..., 1], out=sig[..., 0])
                sig[..., 1] = s[..., 0]
                src = memoryview(sig).cast("B")
                y = buf[:k * n].reshape(k, n, 2)
                for i, enc in enumerate(values):  # G(s): the MMO of sigma(s) under key value/i
                    enc.update_into(src, out)
                    np.bitwise_xor(y, sig, out=y)
                    part = y[0] if k == 1 else np.add.reduce(y, axis=0, out=tmp[:n])
                    view = acc[i, a:b]
                    op(view, part, out=view)
                view = acc[:, a:b]
                for (q0, q1), table in zip(parts, tables):
                    index = (weights[:q1 - q0] @ t[q0:q1, lo:hi]).astype(np.intp)  # the part's control bits, a byte
                    index += (owner[a:b] - j0) << (q1 - q0)
                    picked = pickbuf[:blocks * n].reshape(blocks, n)
                    np.take(table, index, axis=1, out=picked, mode="clip")  # indices are in range by construction
                    np.add(view, picked.view(np.uint64).reshape(blocks, n, 2), out=view)
                if mac is not None:
                    pick = t[:, lo:hi] + (key_base + 2 * owner[a:b])  # [K, n] rows of cs
                    g = gbuf[:k * n].reshape(k, n)
                    state = np.broadcast_to(first[a:b], (k, n, 2))
                    x = xbuf[:k * n].reshape(k, n, 2)
                    for c, enc in enumerate(checks):  # pi(x) = H'(x, s) XOR t cs, then one CBC step
                        np.bitwise_xor(sig, tweaks[c][a:b], out=x)
                        enc.update_into(memoryview(x).cast("B"), out)
                        np.bitwise_xor(y, x, out=y)
                        np.take(cs[c], pick, out=g, mode="clip")
                        y ^= g.view(np.uint64).reshape(k, n, 2)
                        np.bitwise_xor(state, y, out=x)
                        mac.update_into(memoryview(x).cast("B"), out2)
                        state = buf2[:k * n].reshape(k, n, 2)
                    folded ^= np.bitwise_xor.reduce(state, axis=1)
        self.count += sign * k
        if mac is None:
            return [None] * k
        return [_words(folded[q]) + key.public_digest() for q, key in enumerate(keys)]

    def _challenge_keys(self) -> np.ndarray:
        """The challenge's AES-128 round keys (:func:`secagg.aesni.round_keys`), expanded once."""
        if self._mac_keys is None:
            from secagg import aesni
            self._mac_keys = aesni.round_keys(self._challenge)
        return self._mac_keys

    def _positions(self) -> np.ndarray:
        """``AES_challenge(position block)`` per leaf: the first block of each leaf's CBC-MAC."""
        if self._mac_pos is None:
            enc = np.empty((self.forest.leaves, 2), np.uint64)
            enc[:, 0], enc[:, 1] = self.forest.position, self.forest.owner
            self._mac_pos = _aes(self._mac, enc)
        return self._mac_pos

    def scatter(self, elements: np.ndarray, rows: int) -> np.ndarray:
        """This server's share mapped out of bucket space: ``out[elements[leaf]] += acc[leaf]``,
        ``uint64 [rows, width]`` (``elements``: the row of each leaf, e.g. a cuckoo layout's; distinct
        within a tree). Tree by tree from the block-major sum, so no ``leaves x width`` copy is made."""
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
        return np.ascontiguousarray(self._acc.transpose(1, 0, 2).reshape(self.forest.leaves, 2 * self.blocks)
                                    [:, :self.width])


def keygen_prg_bytes(*, depth: int, points: int, width: int, check: bool) -> int:
    """The AES output bytes a client computes to generate one key set (:func:`gen`): per tree and
    level both parties' two children (four blocks), per tree both parties' ``ceil(width / 2)`` value
    blocks and, with the check, both parties' ``CHECK_BLOCKS`` check-hash blocks and the
    ``CHECK_BLOCKS`` public tweaks (``tests/secagg/test_dpf_batch.py`` counts them)."""
    blocks = 4 * points * depth + 2 * points * (-(-width // 2)) + (3 * CHECK_BLOCKS * points if check else 0)
    return 16 * blocks


def prg_bytes_per_key_set(forest: Forest, width: int, check: bool) -> int:
    """The AES output bytes one server expands to evaluate one key set over the whole domain: two
    blocks per tree node above the leaves, ``ceil(width / 2)`` value blocks per leaf and, with the
    check, eight MAC blocks per leaf (the DPF's cryptographic work; ``secagg bench dpf`` and
    ``secagg bench secure`` price it at the measured AES-128-ECB throughput)."""
    tree = sum(int(forest.level_counts(level).sum()) for level in range(forest.depth))
    blocks = 2 * tree + forest.leaves * (-(-width // 2)) + (8 * forest.leaves if check else 0)
    return 16 * blocks
