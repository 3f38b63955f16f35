"""The server's full-domain evaluation with each chunk's passes fused into compiled loops (numba).

:class:`secagg.dpf.Accumulator` evaluates a batch of key sets a chunk of leaves at a time; per value
block and per check block one ``cryptography`` AES-128-ECB call does the PRG work (AES stays there,
AES-NI through OpenSSL). What numpy then needs several passes for, over ``keys x leaves`` 16-byte
blocks per AES call, is one loop here (:func:`add_batch`):

* per tree level (:func:`_level`): each kept child's feed-forward ``AES(x) XOR x``, its parent's
  corrections (a mask from the parent's control bit, no branch), the dropping of the children
  outside their tree, and the next level's input (``sigma`` and the right child's tweak), or at the
  leaves ``sigma(s)``, the value hash's input;
* per value block (:func:`_values`): the MMO feed-forward ``AES(sigma(s)) XOR sigma(s)`` summed over
  the batch's keys straight into (or out of) the round's sum, key by key over contiguous words, then
  the control-bit corrections ``t_x CW_j`` per run of leaves of one tree from a table of the subset
  sums of the keys' corrections, indexed by the leaf's control bits;
* per check block ``c`` (:func:`_check`): the feed-forward, ``t_x cs`` and the CBC-MAC chaining XOR
  into the MAC's input, and the next block's input ``sigma(s) XOR T_{c+1}``; the last MAC state is
  XOR-folded per key (:func:`_fold`).

Every word is the one the numpy path (``Accumulator(..., fused=False)``) computes, in the same
order of Z_2^64 additions (exact: additions mod 2^64 commute), and the digests are bit for bit the
same (``tests/secagg/test_dpf_fused.py`` against the numpy path and the reference evaluation).
The loops take whole arrays and offsets, never slices, so each has one compiled signature; they are
compiled on first use and cached on disk (``cache=True``): a machine compiles them once, a process
loads them once (:meth:`secagg.dpf.Forest.warm` does, at setup).
"""

from __future__ import annotations

import numba
import numpy as np

from secagg.dpf_keys import _CLEAR, _LOW, _RIGHT, CHECK_BLOCKS, KeySet, _encryptor, _words

__all__ = ["add_batch", "child", "value_corrections"]

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_ZERO = np.uint64(0)


@_jit
def _roots(nodes, inp, bits):  # noqa: ANN001, ANN202
    """The first tree level's AES input from the roots (``nodes [K, n, 2]``, control bit in the low
    bit): per node ``sigma(s)`` and ``sigma(s) XOR (tweak, 0)`` (``inp [K, n, 4]``), and its bit."""
    for q in range(nodes.shape[0]):
        for p in range(nodes.shape[1]):
            w0 = nodes[q, p, 0]
            bits[q, p] = np.uint8(w0 & _LOW)
            s0 = w0 & _CLEAR
            left = s0 ^ nodes[q, p, 1]
            inp[q, p, 0] = left
            inp[q, p, 1] = s0
            inp[q, p, 2] = left ^ _RIGHT
            inp[q, p, 3] = s0


@numba.njit(inline="always", cache=True, nogil=True, boundscheck=False)
def child(nxt, nbits, q, c, w0, w1, width):  # noqa: ANN001, ANN202, PLR0913
    """Write kept child ``c`` of key ``q`` from its corrected seed words ``w0, w1`` (control bit in
    ``w0``'s low bit): its bit into ``nbits[q, c]`` and ``sigma`` of its seed into ``nxt[q]`` (with the
    right child's tweak when ``width`` is 4: the next level's input; 2 at the leaves)."""
    nbits[q, c] = np.uint8(w0 & _LOW)
    s0 = w0 & _CLEAR
    v = width * c
    nxt[q, v] = s0 ^ w1
    nxt[q, v + 1] = s0
    if width == 4:
        nxt[q, v + 2] = s0 ^ w1 ^ _RIGHT
        nxt[q, v + 3] = s0


@_jit
def _level(out, inp, bits, seed_cw, t_cw, level, parents, children, nxt, nbits):  # noqa: ANN001, ANN202, PLR0913
    """One tree level after its AES call (``out``, of the input ``inp``, both ``[K, 4n]`` words: left
    and right child per parent): each kept child's seed ``AES(x) XOR x``, XOR-ed with its tree's
    correction at ``level`` (``seed_cw [K, T, D, 2 words]``, the keys' seed corrections, low bit clear,
    and ``t_cw [K, T, D, 2 sides]``, the control-bit correction, into word 0's low bit) under a parent
    whose bit (``bits [K, n]``) is 1; per tree, ``parents[tree]`` parents and the
    first ``children[tree]`` children are kept (the nodes whose subtree meets the tree's positions).
    Writes each kept child's control bit (``nbits [K, n']``) and its ``sigma``: ``nxt [K, 4n']`` (with
    the right tweak: the next level's input) or ``[K, 2n']`` (the leaves: the value hash's input).
    Flat word indices: numba vectorizes them better than ``[K, n, 4]``."""
    k = out.shape[0]
    width = nxt.shape[1] // max(1, nbits.shape[1])  # 4 words per child (the next level's input) or 2 (leaves)
    for q in range(k):
        p = 0
        c = 0
        for tree in range(parents.shape[0]):
            kept = children[tree]
            for r in range(parents[tree]):
                mask = _ZERO - np.uint64(bits[q, p])
                for side in range(2):
                    if 2 * r + side < kept:
                        u = 4 * p + 2 * side
                        c0 = seed_cw[q, tree, level, 0] | np.uint64(t_cw[q, tree, level, side])
                        w0 = out[q, u] ^ inp[q, u] ^ (c0 & mask)
                        w1 = out[q, u + 1] ^ inp[q, u + 1] ^ (seed_cw[q, tree, level, 1] & mask)
                        child(nxt, nbits, q, c, w0, w1, width)
                        c += 1
                p += 1


def _buf(scratch: dict, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A scratch array of ``shape`` kept in ``scratch`` (the accumulator's) and reused by the next batch:
    fresh multi-MB arrays per batch cost their page faults every time (a quarter of a small domain's
    evaluation). Contents are arbitrary."""
    need = _size(shape)
    got = scratch.get(name)
    if got is None or got.size < need or got.dtype != dtype:
        got = scratch[name] = np.empty(need, dtype)
    return got[:need].reshape(shape)


def _stack(scratch: dict, name: str, arrays: list[np.ndarray]) -> np.ndarray:
    """``np.stack(arrays)`` into a reused scratch array."""
    return np.stack(arrays, out=_buf(scratch, name, (len(arrays), *arrays[0].shape), arrays[0].dtype))


def _openssl_level(inp, bits, seed_cw, t_cw, level, parents, children, nxt, nbits, scratch) -> None:  # noqa: ANN001, PLR0913
    """One tree level: its AES call through ``cryptography`` (into a scratch buffer with the row of slack
    ``update_into`` wants), then :func:`_level`."""
    k = inp.shape[0]
    out = _buf(scratch, "out", (inp.size // 4 + 1, 4), np.uint64)
    _encryptor(b"tree").update_into(memoryview(inp).cast("B"), memoryview(out).cast("B"))
    _level(out[:-1].reshape(k, -1), inp.reshape(k, -1), bits, seed_cw, t_cw, level, parents, children,
           nxt.reshape(k, -1), nbits)


def _size(shape: tuple[int, ...]) -> int:
    need = 1
    for n in shape:
        need *= n
    return need


def _expand(keys: list[KeySet], j0: int, j1: int, forest, scratch: dict | None = None  # noqa: ANN001
            ) -> tuple[np.ndarray, np.ndarray]:
    """``sigma`` of the leaf seeds and the control bits of trees ``j0 .. j1-1`` of every key
    (``forest``: those trees): ``(uint64 [K, leaves, 2], uint8 [K, leaves])``; the leaves' seeds are
    those of :func:`secagg.dpf._expand_many`, one AES call and one loop per level
    (:func:`_openssl_level`; :mod:`secagg.dpf_ni` has its own, AES inside the loop, reading the keys in
    place). ``scratch``: where the buffers are kept between calls (the results are scratch too: read
    them before the next call)."""
    k = len(keys)
    scratch = {} if scratch is None else scratch
    nodes = _stack(scratch, "nodes", [key.roots[j0:j1][forest.live] for key in keys])
    nodes[..., 0] |= np.uint64(keys[0].party)
    seed_cw = _stack(scratch, "seed_cw", [key.seed_cw[j0:j1] for key in keys])  # [K, T, D, word]
    t_cw = _stack(scratch, "t_cw", [key.t_cw[j0:j1] for key in keys])  # [K, T, D, side]
    n = nodes.shape[1]
    inp = _buf(scratch, "inp/0", (k, n, 4), np.uint64)
    bits = _buf(scratch, "bits/0", (k, n), np.uint8)
    _roots(nodes, inp, bits)
    for level in range(forest.depth):
        counts = forest.level_counts(level + 1)
        n = int(counts.sum())
        last = level == forest.depth - 1
        nxt = _buf(scratch, f"inp/{(level + 1) % 2}", (k, n, 2 if last else 4), np.uint64)
        nbits = _buf(scratch, f"bits/{(level + 1) % 2}", (k, n), np.uint8)
        _openssl_level(inp, bits, seed_cw, t_cw, level, forest.level_counts(level), counts, nxt, nbits, scratch)
        inp, bits = nxt, nbits
    return inp, bits


@_jit
def _gather(sigs, lo, sig):  # noqa: ANN001, ANN202
    """``sig[q, j] = sigs[q, lo + j]`` (the chunk's AES input, contiguous)."""
    for q in range(sig.shape[0]):
        for j in range(sig.shape[1]):
            sig[q, j, 0] = sigs[q, lo + j, 0]
            sig[q, j, 1] = sigs[q, lo + j, 1]


@_jit
def _gather_tweaked(sigs, lo, sig, tweak, x):  # noqa: ANN001, ANN202
    """:func:`_gather` and ``x[q, j] = sig[q, j] XOR tweak[j]`` (the first check block's input)."""
    for q in range(sig.shape[0]):
        for j in range(sig.shape[1]):
            s0 = sigs[q, lo + j, 0]
            s1 = sigs[q, lo + j, 1]
            sig[q, j, 0] = s0
            sig[q, j, 1] = s1
            x[q, j, 0] = s0 ^ tweak[j, 0]
            x[q, j, 1] = s1 ^ tweak[j, 1]


@_jit
def _subsets(t, lo, n, out):  # noqa: ANN001, ANN202
    """``out[j] = sum_q t[q, lo + j] 2^q`` for ``j < n``: the keys' control bits at a leaf as one subset index."""
    for j in range(n):
        b = 0
        for q in range(t.shape[0]):
            b |= np.int64(t[q, lo + j]) << q
        out[j] = b


@_jit
def _values(y, sig, subset, vc, blk, owner, offsets, a, acc, negate, table):  # noqa: ANN001, ANN202, PLR0913
    """``acc[j] +=`` (``-=`` with ``negate``) ``sum_q (y[q, j] XOR sig[q, j]) + t[q, j] vc[q, owner[j]]``.

    ``y``, ``sig``: value block ``blk``'s AES output and input, ``[K, 2n]`` words; ``acc``: that block's
    slice of the sum (leaves ``a .. a+n-1``), ``[2n]`` words; ``vc``: the keys' value corrections,
    ``[K, m, 2 blocks]`` (words ``2 blk, 2 blk + 1`` are this block's); ``subset``: :func:`_subsets` of the chunk. The feed-forward sums run
    key by key over contiguous words (vectorized); the corrections per run of leaves of one tree,
    from a table of the ``2^K`` subset sums of its corrections (``table``: ``[2^K, 2]`` scratch) for a
    run of at least ``2^K`` leaves, from two tables of 16 (keys 0-3 and 4-7, for ``K > 4``) for a
    shorter one, or, for a run of fewer than ``min(64, 2^K) / K`` leaves (the small trees of a small
    domain, where any table cost more than the run), each leaf's ``K`` corrections masked by its
    control bits."""
    k, words = y.shape[0], y.shape[1]
    for q in range(k):
        if negate:
            for w in range(words):
                acc[w] -= y[q, w] ^ sig[q, w]
        else:
            for w in range(words):
                acc[w] += y[q, w] ^ sig[q, w]
    n = words // 2
    v0 = 2 * blk
    j = 0
    while j < n:
        tree = owner[j]
        end = min(n, offsets[tree + 1] - a)
        run = end - j
        if run * k < min(64, 1 << k):  # a short run (small trees): each leaf's K masked corrections directly
            for i in range(j, end):
                row = subset[i]
                c0 = _ZERO
                c1 = _ZERO
                for q in range(k):
                    mask = _ZERO - np.uint64((row >> q) & 1)
                    c0 += vc[q, tree, v0] & mask
                    c1 += vc[q, tree, v0 + 1] & mask
                if negate:
                    acc[2 * i] -= c0
                    acc[2 * i + 1] -= c1
                else:
                    acc[2 * i] += c0
                    acc[2 * i + 1] += c1
            j = end
            continue
        if k > 4 and run < (1 << k):  # a middle run: two tables of 16 subset sums (keys 0-3, 4-7), two lookups a leaf
            for g in range(2):
                base = 16 * g
                table[base, 0] = _ZERO
                table[base, 1] = _ZERO
                for q in range(4 * g, min(k, 4 * g + 4)):
                    half = 1 << (q - 4 * g)
                    for r in range(half):
                        table[base + half + r, 0] = table[base + r, 0] + vc[q, tree, v0]
                        table[base + half + r, 1] = table[base + r, 1] + vc[q, tree, v0 + 1]
            for i in range(j, end):
                row = subset[i]
                lo = row & 15
                hi = 16 + (row >> 4)
                c0 = table[lo, 0] + table[hi, 0]
                c1 = table[lo, 1] + table[hi, 1]
                if negate:
                    acc[2 * i] -= c0
                    acc[2 * i + 1] -= c1
                else:
                    acc[2 * i] += c0
                    acc[2 * i + 1] += c1
            j = end
            continue
        table[0, 0] = _ZERO
        table[0, 1] = _ZERO
        for q in range(k):
            half = 1 << q
            for r in range(half):
                table[half + r, 0] = table[r, 0] + vc[q, tree, v0]
                table[half + r, 1] = table[r, 1] + vc[q, tree, v0 + 1]
        if negate:
            for r in range(1 << k):
                table[r, 0] = _ZERO - table[r, 0]
                table[r, 1] = _ZERO - table[r, 1]
        for i in range(j, end):
            row = subset[i]
            acc[2 * i] += table[row, 0]
            acc[2 * i + 1] += table[row, 1]
        j = end


@_jit
def _check(x, y, t, lo, cs, c, owner, state, first, use_first, sig, tweak_next, has_next, mac_in):  # noqa: ANN001, ANN202, PLR0913
    """One check block ``c``: ``mac_in = state XOR pi_c`` with ``pi_c = AES_c(x) XOR x XOR t[:, lo:] cs_c``
    (``y = AES_c(x)``; ``state`` is ``first``, the MAC's first block, when ``use_first``), then
    ``x = sig XOR tweak_next`` (the next block's input) when ``has_next``.

    ``x``, ``y``, ``state``, ``sig``, ``mac_in``: ``[K, 2n]`` words (leaf ``i`` is words ``2i, 2i+1``;
    flat indices vectorize better than ``[K, n, 2]``); ``first``, ``tweak_next``: ``[2n]``; ``cs``:
    ``[K, m, CHECK_BLOCKS, 2]``, the keys' check corrections (block ``c`` is used)."""
    k, n = x.shape[0], x.shape[1] // 2
    for q in range(k):
        for i in range(n):
            mask = _ZERO - np.uint64(t[q, lo + i])
            tree = owner[i]
            w = 2 * i
            if use_first:
                st0 = first[w]
                st1 = first[w + 1]
            else:
                st0 = state[q, w]
                st1 = state[q, w + 1]
            mac_in[q, w] = x[q, w] ^ y[q, w] ^ (cs[q, tree, c, 0] & mask) ^ st0
            mac_in[q, w + 1] = x[q, w + 1] ^ y[q, w + 1] ^ (cs[q, tree, c, 1] & mask) ^ st1
            if has_next:
                x[q, w] = sig[q, w] ^ tweak_next[w]
                x[q, w + 1] = sig[q, w + 1] ^ tweak_next[w + 1]


@_jit
def _fold(state, folded):  # noqa: ANN001, ANN202
    """``folded[q] ^= XOR_j state[q, j]``."""
    for q in range(state.shape[0]):
        f0 = folded[q, 0]
        f1 = folded[q, 1]
        for j in range(state.shape[1]):
            f0 ^= state[q, j, 0]
            f1 ^= state[q, j, 1]
        folded[q, 0] = f0
        folded[q, 1] = f1


def value_corrections(acc, keys: list[KeySet]) -> np.ndarray:  # noqa: ANN001
    """The keys' value corrections ``[K, m, 2 blocks]`` (zero-padded to whole blocks) in ``acc``'s scratch."""
    blocks, scratch = acc.blocks, acc._scratch
    if acc.width == 2 * blocks:
        return _stack(scratch, "vc", [key.value_cw for key in keys])
    vc = _buf(scratch, "vc", (len(keys), acc.forest.points, 2 * blocks), np.uint64)
    vc[:, :, acc.width:] = 0
    for q, key in enumerate(keys):
        vc[q, :, :acc.width] = key.value_cw
    return vc


def add_batch(acc, keys: list[KeySet], sign: int, chunk: int, group: int) -> list[bytes | None]:  # noqa: ANN001
    """:meth:`secagg.dpf.Accumulator._add_batch` with fused loops: add (``sign = 1``) or subtract the
    evaluations of ``keys`` (at most 8, already checked against ``acc``) into ``acc``'s sum; their
    digests (``None`` without a challenge). ``chunk``: leaves per pass over all the keys; ``group``:
    leaves per group of trees expanded together, over all the keys."""
    k, blocks, forest, total, mac = len(keys), acc.blocks, acc.forest, acc._acc, acc._mac
    negate = (acc.party == 1) != (sign == -1)
    offsets, owner = forest.offsets, forest.owner
    values = [_encryptor(b"value/%d" % i) for i in range(blocks)]
    scratch = acc._scratch
    vc = value_corrections(acc, keys)
    per = max(1, chunk // k)  # leaves per key per pass
    sigbuf = _buf(scratch, "sig", (k * per, 2), np.uint64)
    buf = _buf(scratch, "y", (k * per + 1, 2), np.uint64)  # AES output (one row of slack for update_into)
    out = memoryview(buf).cast("B")
    subset = np.empty(per, np.int64)
    table = np.empty((1 << k, 2), np.uint64)
    if mac is not None:
        tweaks, first = forest.tweaks(), acc._positions()
        checks = [_encryptor(b"check/%d" % c) for c in range(CHECK_BLOCKS)]
        cs = _stack(scratch, "cs", [key.check_cw for key in keys])  # [K, m, C, 2]
        xbuf = _buf(scratch, "x", (k * per, 2), np.uint64)
        mbuf = _buf(scratch, "m", (k * per, 2), np.uint64)
        sbuf = _buf(scratch, "state", (k * per + 1, 2), np.uint64)  # the MAC's state (its AES output)
        sout = memoryview(sbuf).cast("B")
        folded = np.zeros((k, 2), np.uint64)
    for j0, j1, sub in forest.groups(max(1, group // k)):
        sigs, t = _expand(keys, j0, j1, sub, scratch)
        base, count = int(offsets[j0]), t.shape[1]
        for lo in range(0, count, per):
            hi = min(lo + per, count)
            n, a, b = hi - lo, base + lo, base + hi
            sig = sigbuf[:k * n].reshape(k, n, 2)
            if mac is None:
                _gather(sigs, lo, sig)
            else:
                x = xbuf[:k * n].reshape(k, n, 2)
                _gather_tweaked(sigs, lo, sig, tweaks[0][a:b], x)
            src = memoryview(sig).cast("B")
            y = buf[:k * n].reshape(k, n, 2)
            own = owner[a:b]
            _subsets(t, lo, n, subset)
            flat_y, flat_sig = y.reshape(k, 2 * n), sig.reshape(k, 2 * n)
            for i, enc in enumerate(values):  # G(s): the MMO of sigma(s) under key value/i
                enc.update_into(src, out)
                _values(flat_y, flat_sig, subset, vc, i, own, offsets, a, total[i, a:b].reshape(-1), negate, table)
            if mac is not None:
                m = mbuf[:k * n].reshape(k, n, 2)
                state = sbuf[:k * n].reshape(k, n, 2)
                flat_x, flat_m, flat_state = x.reshape(k, 2 * n), m.reshape(k, 2 * n), state.reshape(k, 2 * n)
                for c, enc in enumerate(checks):  # pi(x) = H'(x, s) XOR t cs, then one CBC step
                    enc.update_into(memoryview(x).cast("B"), out)
                    last = c == CHECK_BLOCKS - 1
                    _check(flat_x, flat_y, t, lo, cs, c, own, flat_state, first[a:b].reshape(-1), c == 0, flat_sig,
                           tweaks[c if last else c + 1][a:b].reshape(-1), not last, flat_m)
                    mac.update_into(memoryview(m).cast("B"), sout)
                _fold(state, folded)
    if mac is None:
        return [None] * k
    return [_words(folded[q]) + key.public_digest() for q, key in enumerate(keys)]
