"""The server's full-domain evaluation with AES inside its loops (AES-NI, :mod:`secagg.aesni`).

:mod:`secagg.dpf_fused` runs each step of a chunk as a compiled loop around ``cryptography``'s AES
calls: every AES call writes a buffer that the next loop reads back, and Python sits between them.
Here the AES rounds are in the loops themselves (eight independent blocks per :func:`mmo8` or
:func:`aes8` call, states in registers), so per leaf and key:

* the value hash (:func:`_values`): the ``ceil(d / 2)`` MMO blocks ``AES_value/i(sigma(s)) XOR
  sigma(s)``, plus the control-bit correction ``t CW_j`` (a mask, no table), go straight into (or out
  of) the round's sum; the lanes run over (leaf, key, block), so every call is full whatever ``d``;
* the check (:func:`_checks`): the four MMO blocks of ``H'(x, s) = AES_check/c(sigma(s) XOR T_c(x))
  XOR (sigma(s) XOR T_c(x))`` and ``t cs``, then the four CBC-MAC steps ``state = AES_challenge(state
  XOR pi_c)`` over eight chains (leaf, key) at a time, and the XOR fold of the last states per key.

The tree levels (:func:`_level`) run :func:`secagg.dpf_fused._expand`'s steps with the AES inside the
loop as well: a level's input is read once, and no AES output buffer is written. Every loop reads
each key's roots and corrections in place, through a fixed tuple of the batch's arrays
(:func:`_arrays`; a received key set is a read-only view of its message), so no stacked copy of a
batch's key material is made (only an odd width's value corrections are padded into one).
Every word and digest is the one the other two paths compute (``tests/secagg/test_dpf_fused.py``).
Used by :class:`secagg.dpf.Accumulator` wherever :func:`secagg.aesni.available`; import only there.
"""

from __future__ import annotations

import numba
import numpy as np

from secagg import aesni
from secagg.aesni_kernels import LANES, aes8, aes8_c, mmo8, mmo8_c, mmo8_xor, mmo8_xor_c, mmo_blocks_add, mmo_blocks_sub
from secagg.dpf_fused import _buf, child, value_corrections
from secagg.dpf_keys import _CLEAR, _LOW, _RIGHT, CHECK_BLOCKS, KeySet, _fixed_round_keys, _words

__all__ = ["add_batch"]

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_ZERO = np.uint64(0)
_KW = aesni.KEY_WORDS


@_jit
def _roots(roots, j0, live, party, inp, bits):  # noqa: ANN001, ANN202, PLR0913
    """The first tree level's AES input from the roots of the group's live trees (``live``: their
    indices in the group, whose first tree is ``j0``), key by key (``q < K``, ``K = bits.shape[0]``;
    ``roots[q]``: key ``q``'s root seeds ``[m, 2]``, low bit clear, read in place): per tree
    ``sigma(s)`` and ``sigma(s) XOR (tweak, 0)`` (``inp [K, n, 4]``) and the control bit, ``party``."""
    bit = np.uint64(party)
    for q in range(bits.shape[0]):
        r = roots[q]
        for p in range(live.shape[0]):
            j = j0 + live[p]
            w0 = r[j, 0] | bit
            bits[q, p] = np.uint8(w0 & _LOW)
            s0 = w0 & _CLEAR
            left = s0 ^ r[j, 1]
            inp[q, p, 0] = left
            inp[q, p, 1] = s0
            inp[q, p, 2] = left ^ _RIGHT
            inp[q, p, 3] = s0


@_jit
def _level(inp, bits, seed_cw, t_cw, j0, level, parents, children, nxt, nbits, rk):  # noqa: ANN001, ANN202, PLR0913
    """:func:`secagg.dpf_fused._level` with the level's AES inside: per key, ``LANES / 2`` parents at a
    time, their two children's inputs (``inp [K, 4n]`` words: left and right block per parent,
    consecutive) through one :func:`mmo8_c` call into registers and a small buffer, then each kept
    child's corrections, control bit and ``sigma`` into ``nxt``. The level's input is read once and no
    ``[K, 4n]`` output is written (a quarter of the memory traffic of AES then loop). ``seed_cw[q]``,
    ``t_cw[q]``: key ``q``'s corrections ``[m, D, 2]``, read in place (the group's tree ``i`` is ``j0 + i``)."""
    k, n = bits.shape
    half = LANES // 2
    width = nxt.shape[1] // max(1, nbits.shape[1])  # 4 words per child (the next level's input) or 2 (leaves)
    none = np.zeros(LANES, np.int64)
    zero = np.zeros(2, np.uint64)
    y = np.empty(2 * LANES, np.uint64)
    pad = np.zeros(2 * LANES, np.uint64)
    for q in range(k):
        sc = seed_cw[q]
        tc = t_cw[q]
        p = 0
        c = 0
        for tree in range(parents.shape[0]):
            kept = children[tree]
            j = j0 + tree
            cw1 = sc[j, level, 1]
            cwl = sc[j, level, 0] | np.uint64(tc[j, level, 0])
            cwr = sc[j, level, 0] | np.uint64(tc[j, level, 1])
            for r in range(parents[tree]):
                at = p % half
                if at == 0:  # the next LANES children: MMO of their inputs
                    if p + half <= n:
                        mmo8_c(inp, 4 * (q * n + p), none, zero, 0, none, rk, 0, zero, 0, none, zero, y, 0, none)
                    else:
                        rest = 4 * (n - p)
                        pad[:rest] = inp[q, 4 * p:4 * n]
                        mmo8_c(pad, 0, none, zero, 0, none, rk, 0, zero, 0, none, zero, y, 0, none)
                mask = _ZERO - np.uint64(bits[q, p])
                for side in range(2):
                    if 2 * r + side < kept:
                        u = 4 * at + 2 * side
                        w0 = y[u] ^ ((cwr if side else cwl) & mask)
                        w1 = y[u + 1] ^ (cw1 & mask)
                        child(nxt, nbits, q, c, w0, w1, width)
                        c += 1
                p += 1


def _expand(keys: tuple, k: int, j0: int, forest, scratch: dict, party: int) -> tuple[np.ndarray, np.ndarray]:  # noqa: ANN001
    """:func:`secagg.dpf_fused._expand` on AES-NI, reading every key's roots and corrections in place
    (``keys``: the batch's :func:`_arrays` tuples, ``k`` real keys; ``forest``: the group's trees from
    ``j0``): ``sigma`` of the leaf seeds and their control bits, ``([k, leaves, 2], [k, leaves])``, in
    ``scratch``."""
    roots, seed_cw, t_cw = keys
    live = forest.live
    inp = _buf(scratch, "inp/0", (k, live.size, 4), np.uint64)
    bits = _buf(scratch, "bits/0", (k, live.size), np.uint8)
    _roots(roots, j0, live, party, inp, bits)
    rk = _fixed_round_keys((b"tree",))[0]
    for level in range(forest.depth):
        parents, counts = forest.level_counts(level), forest.level_counts(level + 1)
        n = int(counts.sum())
        last = level == forest.depth - 1
        nxt = _buf(scratch, f"inp/{(level + 1) % 2}", (k, n, 2 if last else 4), np.uint64)
        nbits = _buf(scratch, f"bits/{(level + 1) % 2}", (k, n), np.uint8)
        _level(inp.reshape(k, -1), bits, seed_cw, t_cw, j0, level, parents, counts, nxt.reshape(k, -1), nbits, rk)
        inp, bits = nxt, nbits
    return inp, bits


def _arrays(arrays: list[np.ndarray]) -> tuple:
    """The batch's per-key arrays as one tuple for the compiled loops, which read them in place (no
    stacked copy): each C-contiguous and read-only (one compiled signature whatever their origin: a
    message's bytes or a generator's arrays), padded to 8 with the first (the loops read ``q < k``)."""
    out = []
    for a in arrays:
        v = np.ascontiguousarray(a).view()
        v.flags.writeable = False
        out.append(v)
    return tuple(out + [out[0]] * (_GROUP - len(out)))


_GROUP = 8  #: keys per batch at most (:data:`secagg.dpf._GROUP`): the tuples' fixed length


@_jit
def _lanes():  # noqa: ANN202
    """Per-lane scratch of the hot loops: two offset arrays and the correction offsets (``int64
    [LANES]``), the masks (``uint64 [LANES]``), the consecutive offsets ``0, 2, 4, ...``, zero
    offsets, and a zero block (the intrinsics' unused operands)."""
    return (np.empty(LANES, np.int64), np.empty(LANES, np.int64), np.empty(LANES, np.int64), np.empty(LANES, np.uint64),
            np.arange(0, 2 * LANES, 2).astype(np.int64), np.zeros(LANES, np.int64), np.zeros(2, np.uint64))


_TILE = 64  #: leaves per tile: a tile's rows of the sum (blocks x 64 x 16 bytes) stay in L1 while every key of the batch adds to them


@_jit
def _values(sigs, t, rkv, vcs, owner, base, accf, leaves, negate):  # noqa: ANN001, ANN202, PLR0913
    """``acc[i, base + x] +=`` (``-=`` with ``negate``) ``sum_q (AES_i(sigma_q,x) XOR sigma_q,x) + t_q,x
    vc_q[owner[base + x], 2i .. 2i+1]`` for every leaf ``x`` of the group and value block ``i``.

    ``sigs``: ``uint64 [K, n, 2]``, the leaves' ``sigma(s)`` per key; ``t``: ``uint8 [K, n]``, their
    control bits; ``rkv``: ``[blocks, 22]``, the value keys' round keys; ``vcs[q]``: key ``q``'s value
    corrections ``[trees, 2 blocks]``, flat; ``accf``: the round's sum ``[blocks, leaves, 2]``, flat.
    Leaves go a tile at a time and within a tile key by key, ``LANES`` leaves (8, or 16 with VAES) per
    :func:`mmo_blocks_add` (every block's key, the feed-forward, the correction and the addition in one
    intrinsic, the leaves' inputs and masks loaded once); a group of fewer (a key's last) goes through
    :func:`mmo8` and the same sums in a loop."""
    k, n = t.shape
    blocks = rkv.shape[0]
    soff, doff, coff, masks, step, none, zero = _lanes()
    y = np.empty(2 * LANES, np.uint64)
    stride = 2 * leaves
    for x0 in range(0, n, _TILE):
        x1 = min(n, x0 + _TILE)
        for q in range(k):
            vcf = vcs[q]
            for g in range(x0, x1, LANES):
                m = min(LANES, x1 - g)
                for lane in range(LANES):
                    x = g + lane if lane < m else g  # padding (a partial group): recompute leaf g, not added
                    soff[lane] = 2 * (q * n + x)
                    doff[lane] = 2 * (base + x)
                    coff[lane] = 2 * blocks * owner[base + x]
                    masks[lane] = _ZERO - np.uint64(t[q, x])
                if m == LANES:
                    if negate:
                        mmo_blocks_sub(sigs, soff[0], rkv, vcf, coff, masks, accf, doff[0], stride, blocks)
                    else:
                        mmo_blocks_add(sigs, soff[0], rkv, vcf, coff, masks, accf, doff[0], stride, blocks)
                    continue
                for blk in range(blocks):
                    mmo8(sigs, 0, soff, zero, 0, none, rkv, _KW * blk, zero, 0, none, zero, y, 0, step)
                    for lane in range(m):
                        w = blk * stride + doff[lane]
                        c = coff[lane] + 2 * blk
                        y0 = y[2 * lane] + (vcf[c] & masks[lane])
                        y1 = y[2 * lane + 1] + (vcf[c + 1] & masks[lane])
                        if negate:
                            accf[w] -= y0
                            accf[w + 1] -= y1
                        else:
                            accf[w] += y0
                            accf[w + 1] += y1


@_jit
def _checks(sigs, t, rkc, tweaks, css, owner, base, rkm, first, folded):  # noqa: ANN001, ANN202, PLR0913
    """The check of every leaf ``x`` and key ``q`` of the group, XOR-folded into ``folded[q]``: per
    block ``c``, ``pi_c = MMO_check/c(sigma_q,x XOR T_c(x)) XOR t_q,x cs[q, owner, c]``, and the CBC-MAC
    ``state = AES_challenge(state XOR pi_c)`` from ``state = first[base + x]``.

    ``tweaks``: ``[CHECK_BLOCKS, leaves, 2]``; ``rkc``: ``[CHECK_BLOCKS, 22]``; ``css[q]``: key ``q``'s
    check corrections ``[trees, CHECK_BLOCKS, 2]``, flat; ``rkm``: the challenge's round keys;
    ``first``: ``[leaves, 2]``, the MAC's first block per leaf. ``LANES`` chains (leaves of one key) at a
    time; a partial group's extra lanes recompute its first leaf and are not folded."""
    k, n = t.shape
    leaves = first.shape[0]
    soff, loff, coff, masks, step, none, zero = _lanes()
    pi = np.empty(CHECK_BLOCKS * 2 * LANES, np.uint64)
    state = np.empty(2 * LANES, np.uint64)
    for q in range(k):
        csf = css[q]
        f0 = folded[q, 0]
        f1 = folded[q, 1]
        for g in range(0, n, LANES):
            m = min(LANES, n - g)
            for lane in range(LANES):
                x = g + lane if lane < m else g
                soff[lane] = 2 * (q * n + x)
                loff[lane] = 2 * (base + x)
                coff[lane] = 2 * CHECK_BLOCKS * owner[base + x]
                masks[lane] = _ZERO - np.uint64(t[q, x])
            if m == LANES:  # consecutive leaves: every operand is eight consecutive blocks
                for c in range(CHECK_BLOCKS):
                    mmo8_xor_c(sigs, soff[0], none, tweaks, 2 * c * leaves + loff[0], none, rkc, _KW * c, csf, 2 * c,
                               coff, masks, pi, 2 * LANES * c, none)
                aes8_c(first, loff[0], none, pi, 0, none, rkm, 0, zero, 0, none, zero, state, 0, none)
                for c in range(1, CHECK_BLOCKS):
                    aes8_c(state, 0, none, pi, 2 * LANES * c, none, rkm, 0, zero, 0, none, zero, state, 0, none)
            else:
                for c in range(CHECK_BLOCKS):
                    mmo8_xor(sigs, 0, soff, tweaks, 2 * c * leaves, loff, rkc, _KW * c, csf, 2 * c, coff, masks,
                             pi, 2 * LANES * c, step)
                aes8(first, 0, loff, pi, 0, step, rkm, 0, zero, 0, none, zero, state, 0, step)
                for c in range(1, CHECK_BLOCKS):
                    aes8(state, 0, step, pi, 2 * LANES * c, step, rkm, 0, zero, 0, none, zero, state, 0, step)
            for lane in range(m):
                f0 ^= state[2 * lane]
                f1 ^= state[2 * lane + 1]
        folded[q, 0] = f0
        folded[q, 1] = f1


def add_batch(acc, keys: list[KeySet], sign: int, group: int) -> list[bytes | None]:  # noqa: ANN001
    """:meth:`secagg.dpf.Accumulator._add_batch` on AES-NI: add (``sign = 1``) or subtract the
    evaluations of ``keys`` (at most 8, already checked against ``acc``) into ``acc``'s sum; their
    digests (``None`` without a challenge). ``group``: leaves per group of trees expanded together,
    over all the keys. The loops read each key's arrays in place (a received key set is a view of its
    message): nothing of a key is copied but an odd width's value corrections (padded to whole blocks)."""
    k, blocks, forest, total, challenge = len(keys), acc.blocks, acc.forest, acc._acc, acc._challenge
    negate = (acc.party == 1) != (sign == -1)
    offsets, owner = forest.offsets, forest.owner
    scratch = acc._scratch
    trees = (_arrays([key.roots for key in keys]), _arrays([key.seed_cw for key in keys]),
             _arrays([key.t_cw for key in keys]))
    if acc.width == 2 * blocks:
        vcs = _arrays([key.value_cw.reshape(-1) for key in keys])
    else:
        vc = value_corrections(acc, keys)  # [K, m, 2 blocks], zero-padded
        vcs = _arrays([vc[q].reshape(-1) for q in range(k)])
    rkv = _fixed_round_keys(tuple(b"value/%d" % i for i in range(blocks)))
    if challenge is not None:
        rkc = _fixed_round_keys(tuple(b"check/%d" % c for c in range(CHECK_BLOCKS)))
        rkm = acc._challenge_keys()
        tweaks = forest.tweaks()  # [CHECK_BLOCKS, leaves, 2]
        first = acc._positions()
        css = _arrays([key.check_cw.reshape(-1) for key in keys])
        folded = np.zeros((k, 2), np.uint64)
    for j0, _, sub in forest.groups(max(1, group // k)):
        sigs, t = _expand(trees, k, j0, sub, scratch, acc.party)
        base = int(offsets[j0])
        _values(sigs, t, rkv, vcs, owner, base, total.reshape(-1), forest.leaves, negate)
        if challenge is not None:
            _checks(sigs, t, rkc, tweaks, css, owner, base, rkm, first, folded)
    if challenge is None:
        return [None] * k
    return [_words(folded[q]) + key.public_digest() for q, key in enumerate(keys)]
