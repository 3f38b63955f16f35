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

**Construction** (Boyle, Gilboa, Ishai 2016, "Function Secret Sharing: Improvements and
Extensions", Fig. 1, with the value conversion of Sec. 3.2): a binary tree of depth ``D``; each
party's root holds a 128-bit seed (least significant bit cleared) and a control bit
(``t = party``). A node's seed expands into two child seeds and two control bits; on the path to
``alpha`` the seeds of the two parties differ and their control bits differ; off the path they are
equal. One correction word per level (a seed and two bits, common to both keys) keeps it so; at
the leaves ``y_b(x) = (-1)^b (G(s_x) + t_x CW)`` with ``CW = (-1)^t1 (beta - G(s_0) + G(s_1))`` at
``alpha``. Trees are truncated to their ``n_j`` positions: a server expands only the nodes whose
subtree meets ``[0, n_j)``, so a forest costs ``sum_j n_j`` leaves (``3 N`` for a cuckoo layout).

**PRG** (fixed-key AES as a public random permutation, Guo, Katz, Wang, Yu 2020, the instantiation
of Google's ``distributed_point_functions``): ``H_k(x) = AES_k(sigma(x)) XOR sigma(x)`` with
``sigma(x_L || x_R) = (x_L XOR x_R) || x_L`` (a correlation-robust hash), one public AES-128 key per
use (the tree, each 128-bit block of the value, each block of the check hash), derived from
SHA-256 of its name; the two children of a seed ``s`` are ``H(s)`` and ``H(s XOR c)`` for a public
constant ``c`` (correlation robustness at known offsets, Guo et al. 2020). A whole tree level, or a chunk of leaves, is one ``cryptography``
ECB call into a preallocated buffer. Seeds are 127 bits (the low bit carries the control bit).

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

**Why not a library.** ``sycret`` 0.2.8 (2021, "not production-ready") shares a scalar in Z_2^32
at a point it draws itself, over a 32-bit domain, with no full-domain evaluation (1M single-point
evaluations take ~7.5 s here). ``fss-crypto`` 0.2.0 needs a CUDA build of torch to compile (our
pinned torch is the CPU build), shares 128-bit values only, and would bring torch into ``secagg``.
Neither fits d-vectors in Z_2^64, so this module writes the construction; neither can serve as a
test oracle (``sycret`` cannot take a chosen point or value), so the tests check the definition
directly (sums equal the point function, one key alone looks the same for any point).

Key encoding (:meth:`KeySet.to_bytes`, strict :meth:`KeySet.from_bytes`, errors: :class:`DpfError`)::

    "SDPF" | version u8 | party u8 | depth u8 | flags u8 | width u32 | points u32 | 0 u32 |
    roots [points, 16] | seed CWs [points, depth, 16] | control-bit CWs, packed, 2 per level |
    check CWs [points, 64] (flag 1) | value CWs [points, width, 8] (flag 2)

(big-endian header, little-endian ``uint64`` words). Seeds must have their low bit clear and the
padding bits of the packed control bits must be zero, so every key has exactly one encoding.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from secagg.errors import MessageError

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

VERSION = 1
MAGIC = b"SDPF"
CHECK_BLOCKS = 4  #: 4 x 128-bit leaf proofs (VDPF's 4 lambda)
MAX_DEPTH = 48
MAX_WIDTH = 1 << 16
MAX_POINTS = 1 << 20
_FLAG_CHECK = 1
_FLAG_VALUE = 2
_HEADER = struct.Struct(">4sBBBBIII")
_LOW = np.uint64(1)
_CLEAR = np.uint64(0xFFFFFFFFFFFFFFFE)
_GROUP = 8  #: keys whose deferred corrections share one subset-sum table
_GROUP_LEAVES = 1 << 16  #: leaves per group of trees expanded together (cache-sized levels)
_FLUSH_ITEMS = 1 << 18  #: 16-byte items gathered at once when the deferred corrections are applied


class DpfError(MessageError):
    """A malformed or mismatched DPF key (every decoder failure raises exactly this)."""


# -- fixed-key AES ---------------------------------------------------------------------------------

_LOCAL = threading.local()


def _encryptor(name: bytes):  # noqa: ANN202 - cryptography's private context type
    """The ECB encryptor of the public fixed key named ``name`` (one per thread, reused)."""
    cache = getattr(_LOCAL, "enc", None)
    if cache is None:
        cache = _LOCAL.enc = {}
    enc = cache.get(name)
    if enc is None:
        key = hashlib.sha256(b"secagg/dpf/v1/" + name).digest()[:16]
        enc = cache[name] = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return enc


def _sigma(x: np.ndarray) -> np.ndarray:
    """``sigma(x_L || x_R) = (x_L XOR x_R) || x_L`` on ``uint64 [n, 2]`` blocks (word 0 = x_L)."""
    out = np.empty_like(x)
    np.bitwise_xor(x[:, 0], x[:, 1], out=out[:, 0])
    out[:, 1] = x[:, 0]
    return out


def _aes(enc, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:  # noqa: ANN001
    """``AES(x)`` for ``uint64 [n, 2]`` blocks, into ``out`` (``[n + 1, 2]`` scratch) if given."""
    n = x.shape[0]
    if out is None or out.shape[0] < n + 1:
        out = np.empty((n + 1, 2), np.uint64)
    enc.update_into(memoryview(np.ascontiguousarray(x)).cast("B"), memoryview(out).cast("B"))
    return out[:n]


def _mmo(enc, sig: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:  # noqa: ANN001
    """``AES(sig) XOR sig``: the MMO hash of an already sigma-ed input."""
    y = _aes(enc, sig, out)
    np.bitwise_xor(y, sig, out=y)
    return y


_RIGHT = np.uint64(0x5DEECE66D)  #: the right child's tweak: H(s) and H(s XOR (tweak, 0)), sigma-ed


def _children(seeds: np.ndarray) -> np.ndarray:
    """Both children of every seed, interleaved (left, right): ``uint64 [2n, 2]`` before correction.

    One fixed-key MMO call over ``sigma(s)`` and ``sigma(s) XOR (tweak, 0)`` (a correlation-robust
    hash at two known offsets); the caller reads each child's control bit from its low bit.
    """
    n = seeds.shape[0]
    inp = np.empty((2 * n, 2), np.uint64)
    c = inp.view(np.complex128).reshape(-1)
    sig = _rows(_sigma(seeds))
    c[0::2] = sig
    c[1::2] = sig
    inp[1::2, 0] ^= _RIGHT
    out = _aes(_encryptor(b"tree"), inp)
    np.bitwise_xor(out, inp, out=out)
    return out


def _expand(seeds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Children of ``seeds`` (``uint64 [n, 2]``): ``(left, t_left, right, t_right)`` (low bits cleared)."""
    both = _children(seeds)
    t = (both[:, 0] & _LOW).astype(np.uint8)
    both[:, 0] &= _CLEAR
    return both[0::2], t[0::2], both[1::2], t[1::2]


def _rows(a: np.ndarray) -> np.ndarray:
    """A ``uint64 [n, 2]`` array as ``complex128 [n]`` (one 16-byte item per row: fast gathers)."""
    return np.ascontiguousarray(a).view(np.complex128).reshape(-1)


def _blocks(c: np.ndarray) -> np.ndarray:
    return c.view(np.uint64).reshape(-1, 2)


def _value(seeds: np.ndarray, width: int) -> np.ndarray:
    """``G(s)``: ``uint64 [n, width]``, word ``2i + h`` from block ``i`` of the value hash."""
    sig = _sigma(seeds)
    blocks = -(-width // 2)
    out = np.empty((seeds.shape[0], 2 * blocks), np.uint64)
    for i in range(blocks):
        out[:, 2 * i:2 * i + 2] = _mmo(_encryptor(b"value/%d" % i), sig)
    return out[:, :width]


def _tweaks(trees: np.ndarray, positions: np.ndarray) -> list[np.ndarray]:
    """The public per-position tweaks ``T_c(j, x)`` of the check hash, one ``[n, 2]`` array per block."""
    enc = np.stack([positions.astype(np.uint64), trees.astype(np.uint64)], axis=1)
    return [_aes(_encryptor(b"tweak/%d" % c), enc).copy() for c in range(CHECK_BLOCKS)]


def _check_hash(seeds: np.ndarray, tweaks: list[np.ndarray]) -> np.ndarray:
    """``H'(x, s)``: ``uint64 [n, CHECK_BLOCKS, 2]``."""
    sig = _sigma(seeds)
    out = np.empty((seeds.shape[0], CHECK_BLOCKS, 2), np.uint64)
    for c in range(CHECK_BLOCKS):
        out[:, c] = _mmo(_encryptor(b"check/%d" % c), sig ^ tweaks[c])
    return out


# -- keys ------------------------------------------------------------------------------------------

def _words(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<u8").tobytes()


@dataclass(frozen=True, eq=False)
class KeySet:
    """One party's keys for a forest of point functions (see the module docstring for the layout).

    Attributes:
        party: 0 or 1.
        depth: ``D``, the depth of every tree (positions ``< 2^D``).
        roots: ``uint64 [m, 2]``, the party's root seed per tree (low bit clear).
        seed_cw: ``uint64 [m, D, 2]``, the seed correction word per tree and level (low bit clear).
        t_cw: ``uint8 [m, D, 2]``, the left and right control-bit corrections (0 or 1).
        check_cw: ``uint64 [m, 4, 2]`` (verifiable keys) or ``None``.
        value_cw: ``uint64 [m, width]`` (keys with values) or ``None`` (PIR-only trees).
    """

    party: int
    depth: int
    roots: np.ndarray
    seed_cw: np.ndarray
    t_cw: np.ndarray
    check_cw: np.ndarray | None = None
    value_cw: np.ndarray | None = None

    @property
    def points(self) -> int:
        """``m``: the number of trees (point functions)."""
        return int(self.roots.shape[0])

    @property
    def width(self) -> int:
        """``d``: words per value (0: no values)."""
        return 0 if self.value_cw is None else int(self.value_cw.shape[1])

    def _flags(self) -> int:
        return (_FLAG_CHECK if self.check_cw is not None else 0) | (_FLAG_VALUE if self.value_cw is not None else 0)

    def _public_parts(self) -> list[bytes]:
        parts = [_words(self.seed_cw), np.packbits(self.t_cw.ravel(), bitorder="little").tobytes()]
        if self.check_cw is not None:
            parts.append(_words(self.check_cw))
        if self.value_cw is not None:
            parts.append(_words(self.value_cw))
        return parts

    def public_bytes(self) -> bytes:
        """Everything both parties' keys must share: depth, flags, shapes and correction words."""
        head = struct.pack(">BBII", self.depth, self._flags(), self.width, self.points)
        return b"".join([head, *self._public_parts()])

    def public_digest(self) -> bytes:
        """SHA-256 of :meth:`public_bytes` (the servers compare it: one client, one function)."""
        return hashlib.sha256(b"secagg/dpf/public/v1" + self.public_bytes()).digest()

    def to_bytes(self) -> bytes:
        head = _HEADER.pack(MAGIC, VERSION, self.party, self.depth, self._flags(), self.width, self.points, 0)
        return b"".join([head, _words(self.roots), *self._public_parts()])

    @staticmethod
    def size(*, depth: int, points: int, width: int, check: bool = True) -> int:
        """Bytes of an encoded key set (the same for every point and value)."""
        return (_HEADER.size + 16 * points * (1 + depth) + -(-2 * points * depth // 8)
                + (16 * CHECK_BLOCKS * points if check else 0) + 8 * width * points)

    @classmethod
    def from_bytes(cls, data: bytes, *, party: int | None = None, depth: int | None = None,
                   points: int | None = None, width: int | None = None, check: bool | None = None) -> KeySet:
        """Parse and validate an encoded key set; raise :class:`DpfError` on any malformed input.

        The keyword arguments, when given, are what the receiver expects (its party, its layout's
        depth and number of trees, the value width, whether keys must be verifiable); a key set that
        differs is refused.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DpfError(f"DPF key: expected bytes; found {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEADER.size:
            raise DpfError(f"DPF key: truncated header ({len(data)} of {_HEADER.size} bytes)")
        magic, version, p, d, flags, w, m, reserved = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise DpfError(f"DPF key: bad magic {magic!r}")
        if version != VERSION:
            raise DpfError(f"DPF key: unsupported version {version} (this build reads {VERSION})")
        if p not in (0, 1):
            raise DpfError(f"DPF key: party must be 0 or 1; found {p}")
        if not 1 <= d <= MAX_DEPTH:
            raise DpfError(f"DPF key: depth must be in [1, {MAX_DEPTH}]; found {d}")
        if flags & ~(_FLAG_CHECK | _FLAG_VALUE):
            raise DpfError(f"DPF key: unknown flags {flags:#x}")
        has_value = bool(flags & _FLAG_VALUE)
        if has_value != (w > 0) or w > MAX_WIDTH:
            raise DpfError(f"DPF key: width {w} does not match the flags or exceeds {MAX_WIDTH}")
        if not 1 <= m <= MAX_POINTS:
            raise DpfError(f"DPF key: points must be in [1, {MAX_POINTS}]; found {m}")
        if reserved:
            raise DpfError("DPF key: reserved header field must be 0")
        for name, want, got in (("party", party, p), ("depth", depth, d), ("points", points, m), ("width", width, w),
                                ("check", check, bool(flags & _FLAG_CHECK))):
            if want is not None and want != got:
                raise DpfError(f"DPF key: {name} is {got}; this receiver expects {want}")
        need = cls.size(depth=d, points=m, width=w, check=bool(flags & _FLAG_CHECK))
        if len(data) != need:
            raise DpfError(f"DPF key: {len(data)} bytes; a key of this header has {need}")
        pos = _HEADER.size

        def take(nwords: int) -> np.ndarray:
            nonlocal pos
            arr = np.frombuffer(data, dtype="<u8", count=nwords, offset=pos).astype(np.uint64)
            pos += 8 * nwords
            return arr

        roots = take(2 * m).reshape(m, 2)
        seed_cw = take(2 * m * d).reshape(m, d, 2)
        if (roots[:, 0] & _LOW).any() or (seed_cw[..., 0] & _LOW).any():
            raise DpfError("DPF key: a seed has its low bit set (not a canonical key)")
        nbits = 2 * m * d
        packed = np.frombuffer(data, dtype=np.uint8, count=-(-nbits // 8), offset=pos)
        pos += packed.size
        bits = np.unpackbits(packed, bitorder="little")
        if bits[nbits:].any():
            raise DpfError("DPF key: nonzero padding bits")
        t_cw = bits[:nbits].reshape(m, d, 2).copy()
        check_cw = take(2 * CHECK_BLOCKS * m).reshape(m, CHECK_BLOCKS, 2) if flags & _FLAG_CHECK else None
        value_cw = take(w * m).reshape(m, w) if has_value else None
        return cls(p, d, roots, seed_cw, t_cw, check_cw, value_cw)


@dataclass(frozen=True, eq=False)
class LeafSecret:
    """What the client keeps to attach values to trees it already sent (PIR first, sum later).

    Attributes:
        seeds: ``uint64 [2, m, 2]``, both parties' leaf seeds at ``alpha``.
        t1: ``uint8 [m]``, party 1's control bit at ``alpha``.
    """

    seeds: np.ndarray
    t1: np.ndarray


def _check_points(alphas: np.ndarray, depth: int) -> np.ndarray:
    if type(depth) is not int or not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"depth must be an int in [1, {MAX_DEPTH}]; found {depth!r}")
    a = np.asarray(alphas)
    if a.ndim != 1 or a.dtype.kind not in "iu" or not 1 <= a.size <= MAX_POINTS:
        raise ValueError(f"alphas must be a 1-D integer array of 1..{MAX_POINTS} points; found {a.dtype} {a.shape}")
    a = a.astype(np.int64)
    if a.min() < 0 or a.max() >= 2**depth:
        raise ValueError(f"alphas must lie in [0, 2^{depth})")
    return a


def _random_roots(m: int) -> np.ndarray:
    roots = np.frombuffer(os.urandom(32 * m), dtype="<u8").astype(np.uint64).reshape(2, m, 2)
    roots[..., 0] &= _CLEAR
    return roots


def gen(alphas: np.ndarray, depth: int, betas: np.ndarray | None = None, *, check: bool = True
        ) -> tuple[KeySet, KeySet, LeafSecret]:
    """Key sets for the point functions ``alpha_j -> beta_j`` (root seeds from the OS CSPRNG).

    Args:
        alphas: ``int [m]``, the point of each tree, in ``[0, 2^depth)``.
        depth: tree depth ``D``.
        betas: ``uint64 [m, d]`` values, or ``None`` for trees without values (PIR; attach values
            later with :func:`attach_values`).
        check: add the verification correction words (:class:`Accumulator` checks them).

    Returns:
        ``(key for party 0, key for party 1, the client's LeafSecret)``.
    """
    a = _check_points(alphas, depth)
    return _gen(a, depth, betas, _random_roots(a.size), check=check)


def _gen(alphas: np.ndarray, depth: int, betas: np.ndarray | None, roots: np.ndarray, *, check: bool
         ) -> tuple[KeySet, KeySet, LeafSecret]:
    """Known-answer core of :func:`gen`: the root seeds (``uint64 [2, m, 2]``, low bits clear) given."""
    m = alphas.size
    s = [roots[0].copy(), roots[1].copy()]
    t = [np.zeros(m, np.uint8), np.ones(m, np.uint8)]
    seed_cw = np.empty((m, depth, 2), np.uint64)
    t_cw = np.empty((m, depth, 2), np.uint8)
    for level in range(depth):
        bit = ((alphas >> (depth - 1 - level)) & 1).astype(np.uint8)
        right = bit.astype(bool)[:, None]
        kids = [_expand(s[0]), _expand(s[1])]
        lose = [np.where(right, k[0], k[2]) for k in kids]
        keep = [np.where(right, k[2], k[0]) for k in kids]
        t_keep = [np.where(bit == 1, k[3], k[1]) for k in kids]
        seed_cw[:, level] = lose[0] ^ lose[1]
        t_cw[:, level, 0] = kids[0][1] ^ kids[1][1] ^ bit ^ 1
        t_cw[:, level, 1] = kids[0][3] ^ kids[1][3] ^ bit
        t_keep_cw = np.where(bit == 1, t_cw[:, level, 1], t_cw[:, level, 0])
        for b in (0, 1):
            on = t[b].astype(bool)[:, None]
            s[b] = np.where(on, keep[b] ^ seed_cw[:, level], keep[b])
            t[b] = t_keep[b] ^ (t[b] & t_keep_cw)
    check_cw = None
    if check:
        tw = _tweaks(np.arange(m), alphas)
        check_cw = _check_hash(s[0], tw) ^ _check_hash(s[1], tw)
    secret = LeafSecret(np.stack(s), t[1].copy())
    keys = [KeySet(b, depth, roots[b].copy(), seed_cw, t_cw, check_cw, None) for b in (0, 1)]
    if betas is not None:
        return (*attach_values(keys[0], keys[1], secret, betas), secret)
    return keys[0], keys[1], secret


def attach_values(k0: KeySet, k1: KeySet, secret: LeafSecret, betas: np.ndarray) -> tuple[KeySet, KeySet]:
    """The same trees with values: ``CW_j = (-1)^t1 (beta_j - G(s_0) + G(s_1))`` per tree."""
    betas = np.asarray(betas)
    m = k0.points
    if betas.dtype != np.uint64 or betas.ndim != 2 or betas.shape[0] != m or not 1 <= betas.shape[1] <= MAX_WIDTH:
        raise ValueError(f"betas must be uint64 [{m}, d] with 1 <= d <= {MAX_WIDTH}; found {betas.dtype} {betas.shape}")
    d = betas.shape[1]
    cw = betas - _value(secret.seeds[0], d) + _value(secret.seeds[1], d)
    neg = secret.t1.astype(bool)
    cw[neg] = np.uint64(0) - cw[neg]
    return (KeySet(0, k0.depth, k0.roots, k0.seed_cw, k0.t_cw, k0.check_cw, cw),
            KeySet(1, k1.depth, k1.roots, k1.seed_cw, k1.t_cw, k1.check_cw, cw))


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
