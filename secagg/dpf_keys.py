"""Distributed point functions over Z_2^64 d-vectors: the PRG, the keys, their encoding, key generation.

The evaluation (the forest, full-domain and single-point evaluation, a server's running sum and
its verification) is in :mod:`secagg.dpf`, which re-exports everything public here.

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

import functools
import hashlib
import struct
import threading
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from secagg.errors import MessageError
from secagg.prg import random_words
__all__ = [
    "CHECK_BLOCKS",
    "MAX_DEPTH",
    "MAX_POINTS",
    "MAX_WIDTH",
    "VERSION",
    "DpfError",
    "KeySet",
    "LeafSecret",
    "attach_values",
    "gen",
    "gen_many",
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
_PUBLIC_DOMAIN = b"secagg/dpf/public/v1"
_GEN_CHUNK = 8192  #: trees per pass of :func:`gen_many` (a level's arrays stay in L2-L3; 4096 left each pass's fixed cost on four ML-100K-shaped key sets)
_LOW = np.uint64(1)
_CLEAR = np.uint64(0xFFFFFFFFFFFFFFFE)



class DpfError(MessageError):
    """A malformed or mismatched DPF key (every decoder failure raises exactly this)."""


# -- fixed-key AES ---------------------------------------------------------------------------------

_LOCAL = threading.local()


def _fixed_key(name: bytes) -> bytes:
    """The public fixed AES-128 key named ``name`` (``tree``, ``value/i``, ``check/c``, ``tweak/c``)."""
    return hashlib.sha256(b"secagg/dpf/v1/" + name).digest()[:16]


@functools.cache
def _fixed_round_keys(names: tuple[bytes, ...]) -> np.ndarray:
    """The AES-NI round keys of the fixed keys ``names`` (:func:`secagg.aesni.round_keys`), ``uint64
    [len(names), 22]``, read-only and computed once per process."""
    from secagg import aesni
    out = np.stack([aesni.round_keys(_fixed_key(name)) for name in names])
    out.flags.writeable = False
    return out


@functools.cache
def _gen_ni():  # noqa: ANN202 - the module, or None
    """:mod:`secagg.dpf_gen_ni` (key generation's AES inside its loops), or ``None`` without AES-NI."""
    from secagg import aesni
    if not aesni.available() or _gen_module() is None:
        return None
    from secagg import dpf_gen_ni
    return dpf_gen_ni


def _aes_into(name: bytes, inp: np.ndarray, out: np.ndarray) -> None:
    """``out[:n] = AES_name(inp)`` (``out``: a row longer than ``inp``'s ``n`` blocks): on AES-NI where the
    compiled loops run (:func:`_gen_ni`), else through ``cryptography``. The same bytes."""
    ni = _gen_ni() if _FUSED else None
    if ni is None:
        _encryptor(name).update_into(memoryview(inp).cast("B"), memoryview(out).cast("B"))
    else:
        ni.ecb_into(_fixed_round_keys((name,))[0], inp, out)


def _encryptor(name: bytes):  # noqa: ANN202 - cryptography's private context type
    """The ECB encryptor of the public fixed key named ``name`` (one per thread, reused)."""
    cache = getattr(_LOCAL, "enc", None)
    if cache is None:
        cache = _LOCAL.enc = {}
    enc = cache.get(name)
    if enc is None:
        enc = cache[name] = Cipher(algorithms.AES(_fixed_key(name)), modes.ECB()).encryptor()
    return enc


_FUSED = True  #: key generation runs its passes in the compiled loops wherever numba imports (False: numpy)


@functools.cache
def _gen_module():  # noqa: ANN202 - the module, or None
    """:mod:`secagg.dpf_gen_fused` (key generation's compiled loops), or ``None`` where numba does not import;
    imported on the first key set generated (not at import: a process that never generates one does not
    load numba)."""
    try:
        from secagg import dpf_gen_fused
    except ImportError:
        return None
    return dpf_gen_fused


def _gen_loops():  # noqa: ANN202 - the module, or None
    """The compiled loops to use: :func:`_gen_module`, or ``None`` with :data:`_FUSED` off (the numpy reference)."""
    return _gen_module() if _FUSED else None


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


def _items(a: np.ndarray) -> np.ndarray:
    """A ``uint64 [n, 2]`` array whose rows are contiguous (any row stride) as ``complex128 [n]`` without a copy."""
    return a.view(np.complex128).reshape(-1)


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


def _value_cw(s0: np.ndarray, s1: np.ndarray, t1: np.ndarray, betas: np.ndarray) -> np.ndarray:
    """``(-1)^t1 (beta - G(s0) + G(s1))`` per row (``uint64 [n, d]``): :func:`_value` of both seeds
    and the combination, block by block (no ``n x d`` temporaries; the negation is ``(x XOR m) - m``
    with ``m`` all ones where ``t1``)."""
    n, d = betas.shape
    blocks = -(-d // 2)
    loops = _gen_loops()
    if loops is not None:  # per block one AES call over both parties' seeds, then one compiled pass
        sig = np.empty((2, n, 2), np.uint64)
        sig[0], sig[1] = _sigma(s0), _sigma(s1)
        ni = _gen_ni()
        if ni is not None:  # AES inside the loop: no [blocks, 2, n] buffer
            out = np.empty((n, d), np.uint64)
            ni.value_cw(sig, _fixed_round_keys(tuple(b"value/%d" % i for i in range(blocks))), t1.astype(np.uint8),
                        np.ascontiguousarray(betas), out)
            return out
        y = np.empty((2 * n * blocks + 1, 2), np.uint64)  # one row of slack for update_into
        src = memoryview(sig).cast("B")
        for i in range(blocks):
            _encryptor(b"value/%d" % i).update_into(src, memoryview(y[2 * n * i:2 * n * (i + 1) + 1]).cast("B"))
        out = np.empty((n, d), np.uint64)
        loops.value_cw(y[:-1].reshape(blocks, 2, n, 2), sig, t1.astype(np.uint8), np.ascontiguousarray(betas), out)
        return out
    padded = np.zeros((n, 2 * blocks), np.uint64) if d % 2 else np.ascontiguousarray(betas)
    if d % 2:
        padded[:, :d] = betas
    major = padded.view(np.complex128).T.copy().view(np.uint64).reshape(blocks, n, 2)  # block i of every row contiguous
    sig0, sig1 = _sigma(s0), _sigma(s1)
    neg = np.repeat(np.uint64(0) - t1.astype(np.uint64), 2).reshape(n, 2)
    y0, y1 = np.empty((n + 1, 2), np.uint64), np.empty((n + 1, 2), np.uint64)
    for i in range(blocks):
        enc = _encryptor(b"value/%d" % i)
        g0, g1 = _mmo(enc, sig0, y0), _mmo(enc, sig1, y1)
        view = major[i]
        view -= g0
        view += g1
        view ^= neg
        view -= neg
    return major.view(np.complex128).reshape(blocks, n).T.copy().view(np.uint64).reshape(n, 2 * blocks)[:, :d]


def _tweaks(trees: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The public per-position tweaks ``T_c(j, x)`` of the check hash: ``uint64 [CHECK_BLOCKS, n, 2]``
    (block ``c``'s are ``[c]``), written in place (at 10^6 items they are 192 MB: no second copy)."""
    enc = np.stack([positions.astype(np.uint64), trees.astype(np.uint64)], axis=1)
    n = enc.shape[0]
    out = np.empty((CHECK_BLOCKS * n + 1, 2), np.uint64)  # one row of slack for update_into
    for c in range(CHECK_BLOCKS):
        _encryptor(b"tweak/%d" % c).update_into(memoryview(enc).cast("B"), memoryview(out[c * n:(c + 1) * n + 1]).cast("B"))
    return out[:-1].reshape(CHECK_BLOCKS, n, 2)


def _check_hash(seeds: np.ndarray, tweaks: np.ndarray) -> np.ndarray:
    """``H'(x, s)``: ``uint64 [n, CHECK_BLOCKS, 2]``."""
    sig = _sigma(seeds)
    out = np.empty((seeds.shape[0], CHECK_BLOCKS, 2), np.uint64)
    for c in range(CHECK_BLOCKS):
        out[:, c] = _mmo(_encryptor(b"check/%d" % c), sig ^ tweaks[c])
    return out


# -- keys ------------------------------------------------------------------------------------------

def _words(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<u8").tobytes()


def _view(a: np.ndarray) -> memoryview:
    """The words of ``a`` little-endian, as a buffer (no copy when ``a`` is already contiguous ``<u8``): for joins."""
    return memoryview(np.ascontiguousarray(a, dtype="<u8")).cast("B")


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

    A key set parsed by :meth:`from_bytes` also keeps its encoding's public bytes (everything after the
    roots: the corrections as :meth:`public_bytes` lays them out, one contiguous read-only view of the
    message), which :meth:`public_digest` hashes in one call instead of re-encoding the arrays. The
    field is not an ``__init__`` argument, so a key set built from arrays, or copied with
    :func:`dataclasses.replace`, hashes its arrays.
    """

    party: int
    depth: int
    roots: np.ndarray
    seed_cw: np.ndarray
    t_cw: np.ndarray
    check_cw: np.ndarray | None = None
    value_cw: np.ndarray | None = None
    _encoded: memoryview | None = field(default=None, init=False, repr=False)

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

    def _public_parts(self) -> list[bytes | memoryview]:
        parts: list[bytes | memoryview] = [_view(self.seed_cw), np.packbits(self.t_cw.ravel(), bitorder="little").tobytes()]
        if self.check_cw is not None:
            parts.append(_view(self.check_cw))
        if self.value_cw is not None:
            parts.append(_view(self.value_cw))
        return parts

    def _public_head(self) -> bytes:
        return struct.pack(">BBII", self.depth, self._flags(), self.width, self.points)

    def public_bytes(self) -> bytes:
        """Everything both parties' keys must share: depth, flags, shapes and correction words."""
        return b"".join([self._public_head(), *self._public_parts()])

    def public_digest(self) -> bytes:
        """SHA-256 of :meth:`public_bytes` (the servers compare it: one client, one function)."""
        h = hashlib.sha256(_PUBLIC_DOMAIN + self._public_head())
        if self._encoded is not None:  # parsed: the message's own bytes of the parts, already canonical
            h.update(self._encoded)
            return h.digest()
        for part in self._public_parts():  # part by part: no joined copy
            h.update(part)
        return h.digest()

    @staticmethod
    def public_size(*, depth: int, points: int, width: int, check: bool = True) -> int:
        """Bytes :meth:`public_digest` hashes for a key set of this shape (domain label included)."""
        return (len(_PUBLIC_DOMAIN) + struct.calcsize(">BBII") + 16 * points * depth + -(-2 * points * depth // 8)
                + (16 * CHECK_BLOCKS * points if check else 0) + 8 * width * points)

    def to_bytes(self) -> bytes:
        return b"".join(self.to_parts())

    def to_parts(self, public: list[bytes | memoryview] | None = None) -> list[bytes | memoryview]:
        """:meth:`to_bytes` as the buffers it joins (views of the arrays): a message copies them once.
        ``public``: :meth:`_public_parts` already made for a key set sharing every correction array with
        this one (the other party's, from :func:`gen`; :meth:`shares_public` says when)."""
        head = _HEADER.pack(MAGIC, VERSION, self.party, self.depth, self._flags(), self.width, self.points, 0)
        return [head, _view(self.roots), *(self._public_parts() if public is None else public)]

    def shares_public(self, other: KeySet) -> bool:
        """Whether ``other`` holds the very correction arrays of this key set (both parties' keys from
        one :func:`gen`), so their public parts are encoded once."""
        return (self.depth == other.depth and self.seed_cw is other.seed_cw and self.t_cw is other.t_cw
                and self.check_cw is other.check_cw and self.value_cw is other.value_cw)

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
        if not (isinstance(data, memoryview) and data.readonly and data.contiguous):
            data = bytes(data)  # immutable bytes (a read-only view of a message's bytes is parsed in place)
        if isinstance(data, memoryview):
            data = data.cast("B")
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
            # read-only views of the immutable input (no copy on little-endian hosts)
            arr = np.frombuffer(data, dtype="<u8", count=nwords, offset=pos).astype(np.uint64, copy=False)
            pos += 8 * nwords
            return arr

        seeds = take(2 * m * (1 + d))  # the roots, then the seed corrections: word 0 of each seed has its low bit clear
        if np.bitwise_or.reduce(seeds[::2]) & _LOW:
            raise DpfError("DPF key: a seed has its low bit set (not a canonical key)")
        roots, seed_cw = seeds[:2 * m].reshape(m, 2), seeds[2 * m:].reshape(m, d, 2)
        nbits = 2 * m * d
        packed = np.frombuffer(data, dtype=np.uint8, count=-(-nbits // 8), offset=pos)
        pos += packed.size
        if nbits % 8 and packed[-1] >> (nbits % 8):
            raise DpfError("DPF key: nonzero padding bits")
        t_cw = np.unpackbits(packed, count=nbits, bitorder="little").reshape(m, d, 2)
        check_cw = take(2 * CHECK_BLOCKS * m).reshape(m, CHECK_BLOCKS, 2) if flags & _FLAG_CHECK else None
        value_cw = take(w * m).reshape(m, w) if has_value else None
        key = cls(p, d, roots, seed_cw, t_cw, check_cw, value_cw)
        # the corrections' bytes as public_bytes lays them out (everything after the roots): strictly
        # checked above, so they are the canonical encoding of these arrays
        object.__setattr__(key, "_encoded", memoryview(data)[_HEADER.size + 16 * m:])
        return key


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
    """Both parties' root seeds of ``m`` trees (low bits clear), from the CSPRNG
    (:func:`secagg.prg.random_words`: AES-256-CTR under a fresh ``os.urandom`` key for a large batch)."""
    roots = random_words(4 * m, label=b"secagg/dpf/roots").reshape(2, m, 2)
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


def gen_many(alphas: list[np.ndarray], depth: int, betas: list[np.ndarray], *, check: bool = True
             ) -> list[tuple[KeySet, KeySet]]:
    """:func:`gen` for many key sets at once (with values): whole key sets of about :data:`_GEN_CHUNK`
    trees per pass.

    Every tree's generation is independent of the others' (its own root seeds, from the CSPRNG:
    :func:`secagg.prg.random_words`, the AES-256-CTR keystream of a fresh ``os.urandom`` key beyond 128 trees;
    its own correction words; only the check's tweak names its index within its key set), so the key
    sets are exactly those :func:`gen` makes from the same root seeds: a simulation generates many
    clients' key sets in a few array passes instead of one pass per client
    (``tests/secagg/test_dpf_batch.py`` checks it byte for byte). Each key set's arrays are views of
    its pass's.

    Args:
        alphas: per key set, ``int [m_i]`` points in ``[0, 2^depth)``.
        depth: tree depth ``D`` (every key set's).
        betas: per key set, ``uint64 [m_i, d]`` values (one ``d`` for all).
        check: add the verification correction words.

    Returns:
        per key set, ``(key for party 0, key for party 1)``.
    """
    if len(alphas) != len(betas) or not alphas:
        raise ValueError(f"gen_many needs as many value arrays as point arrays, at least one; found {len(alphas)}, {len(betas)}")
    a = [_check_points(x, depth) for x in alphas]
    return _gen_many(a, depth, betas, _random_roots(sum(x.size for x in a)), check=check)


def _gen_many(alphas: list[np.ndarray], depth: int, betas: list[np.ndarray], roots: np.ndarray, *, check: bool
              ) -> list[tuple[KeySet, KeySet]]:
    """Known-answer core of :func:`gen_many`: the root seeds of every tree, key sets concatenated, given.
    Whole key sets of about :data:`_GEN_CHUNK` trees go through :func:`_gen` together, so every array
    of a level stays in cache and each key set is a view of its pass's arrays (no copy)."""
    sizes = [x.size for x in alphas]
    bs = [np.asarray(b) for b in betas]
    if any(b.dtype != np.uint64 or b.ndim != 2 or b.shape != (m, bs[0].shape[1]) for b, m in zip(bs, sizes)):
        raise ValueError(f"betas must be uint64 [m_i, d] with one d; found {[(b.dtype, b.shape) for b in bs][:4]}")
    out: list[tuple[KeySet, KeySet]] = []
    first, at = 0, 0
    while first < len(sizes):
        last, trees = first + 1, sizes[first]
        while last < len(sizes) and trees + sizes[last] <= _GEN_CHUNK:
            trees += sizes[last]
            last += 1
        ends = np.cumsum(sizes[first:last])
        index = np.arange(trees) - np.repeat(ends - sizes[first:last], sizes[first:last])  # tree index in its key set
        both = _gen(np.concatenate(alphas[first:last]), depth, np.concatenate(bs[first:last]), roots[:, at:at + trees],
                    check=check, trees=index)[:2]
        for lo, hi in zip(ends - sizes[first:last], ends):
            k0, k1 = (KeySet(k.party, depth, k.roots[lo:hi], k.seed_cw[lo:hi], k.t_cw[lo:hi],
                             None if k.check_cw is None else k.check_cw[lo:hi], k.value_cw[lo:hi]) for k in both)
            out.append((k0, k1))
        first, at = last, at + trees
    return out


def _gen(alphas: np.ndarray, depth: int, betas: np.ndarray | None, roots: np.ndarray, *, check: bool,
         trees: np.ndarray | None = None) -> tuple[KeySet, KeySet, LeafSecret]:
    """Known-answer core of :func:`gen`: the root seeds (``uint64 [2, m, 2]``, low bits clear) given;
    ``trees``: each point's tree index within its key set (default ``0 .. m-1``: one key set)."""
    m = alphas.size
    seed_cw = np.empty((m, depth, 2), np.uint64)
    t_cw = np.empty((m, depth, 2), np.uint8)
    loops = _gen_loops()
    if loops is not None:  # per level one AES call over both parties' children, then one compiled pass
        both, bits = np.array(roots, dtype=np.uint64), np.zeros((2, m), np.uint8)
        bits[1] = 1
        inp = np.empty((2, m, 2, 2), np.uint64)
        out = np.empty((4 * m + 1, 2), np.uint64)  # one row of slack for update_into
        for level in range(depth):
            loops.tree_input(both, _RIGHT, inp)
            _aes_into(b"tree", inp, out)
            loops.tree_level(out[:-1].reshape(2, m, 2, 2), inp, alphas, depth - 1 - level, both, bits, seed_cw, t_cw,
                             level)
        s, t = [both[0], both[1]], [bits[0], bits[1]]
    else:
        s, t = _levels(alphas, depth, roots, seed_cw, t_cw)
    return _finish(alphas, depth, betas, roots, s, t, seed_cw, t_cw, check=check, trees=trees)


def _levels(alphas: np.ndarray, depth: int, roots: np.ndarray, seed_cw: np.ndarray, t_cw: np.ndarray
            ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The tree levels of :func:`_gen` with numpy (filling ``seed_cw``, ``t_cw``): both parties' leaf
    seeds and control bits."""
    m = alphas.size
    s = [roots[0].copy(), roots[1].copy()]
    t = [np.zeros(m, np.uint8), np.ones(m, np.uint8)]
    for level in range(depth):
        bit = ((alphas >> (depth - 1 - level)) & 1).astype(np.uint8)
        right = bit.astype(bool)
        # seeds as one 16-byte item per row (complex128 views): the selections run over [m], not [m, 2]
        kids = [_expand(s[0]), _expand(s[1])]
        items = [(_items(k[0]), _items(k[2])) for k in kids]
        lose = [np.where(right, left, r).view(np.uint64).reshape(m, 2) for left, r in items]
        keep = [np.where(right, r, left).view(np.uint64).reshape(m, 2) for left, r in items]
        t_keep = [np.where(right, k[3], k[1]) for k in kids]
        cw = lose[0] ^ lose[1]
        seed_cw[:, level] = cw
        t_cw[:, level, 0] = kids[0][1] ^ kids[1][1] ^ bit ^ 1
        t_cw[:, level, 1] = kids[0][3] ^ kids[1][3] ^ bit
        t_keep_cw = np.where(right, t_cw[:, level, 1], t_cw[:, level, 0])
        for b in (0, 1):
            fixed = (keep[b] ^ cw).view(np.complex128).reshape(m)
            s[b] = np.where(t[b].astype(bool), fixed, keep[b].view(np.complex128).reshape(m)).view(np.uint64).reshape(m, 2)
            t[b] = t_keep[b] ^ (t[b] & t_keep_cw)
    return s, t


def _finish(alphas: np.ndarray, depth: int, betas: np.ndarray | None, roots: np.ndarray, s: list[np.ndarray],
            t: list[np.ndarray], seed_cw: np.ndarray, t_cw: np.ndarray, *, check: bool, trees: np.ndarray | None
            ) -> tuple[KeySet, KeySet, LeafSecret]:
    """:func:`_gen` after the levels: the check's and the values' correction words from the leaf seeds."""
    m = alphas.size
    check_cw = None
    if check:
        tw = _tweaks(np.arange(m) if trees is None else trees, alphas)
        loops = _gen_loops()
        if loops is not None:  # per check block one AES call over both parties' inputs, then one compiled pass
            inp = np.empty((CHECK_BLOCKS, 2, m, 2), np.uint64)
            loops.check_input(np.stack(s), tw, inp)
            y = np.empty((CHECK_BLOCKS * 2 * m + 1, 2), np.uint64)  # one row of slack for update_into
            for c in range(CHECK_BLOCKS):
                _aes_into(b"check/%d" % c, inp[c], y[2 * m * c:2 * m * (c + 1) + 1])
            check_cw = np.empty((m, CHECK_BLOCKS, 2), np.uint64)
            loops.check_cw(y[:-1].reshape(CHECK_BLOCKS, 2, m, 2), inp, check_cw)
        else:
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
    cw = _value_cw(secret.seeds[0], secret.seeds[1], secret.t1, betas)
    return (KeySet(0, k0.depth, k0.roots, k0.seed_cw, k0.t_cw, k0.check_cw, cw),
            KeySet(1, k1.depth, k1.roots, k1.seed_cw, k1.t_cw, k1.check_cw, cw))
