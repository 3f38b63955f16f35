"""AES-128 rounds as numba intrinsics (LLVM's ``llvm.x86.aesni.*``); see :mod:`secagg.aesni`.

Import only where :func:`secagg.aesni.available` (LLVM cannot lower these intrinsics for a CPU
without AES-NI). Every array given to an intrinsic is C-contiguous ``uint64`` (offsets ``int64``),
addressed by flat word offsets; the intrinsics do no bounds checks, so their callers keep every
offset in range (each caller's loops derive them from the shapes they were given).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

__all__ = ["LANES", "WIDE", "aes8", "aes8_c", "ecb", "ecb8", "expand_key", "mmo8", "mmo8_c", "mmo8_xor", "mmo8_xor_c",
           "mmo_blocks_add", "mmo_blocks_sub", "subword"]


def _vaes() -> bool:
    """Whether the CPU runs AES on 256-bit registers (VAES with AVX2: two blocks per instruction, at the
    rate of one). Compiled code is cached per CPU model and features, so this is fixed per machine."""
    import llvmlite.binding as ll
    features = ll.get_host_cpu_features()
    return bool(features.get("vaes", False) and features.get("avx2", False))


WIDE = _vaes()  #: two blocks per AES instruction (VAES) in every intrinsic
#: blocks per intrinsic call: eight registers in flight (AES's latency over its issue interval, 4 x 2 on
#: Zen 3), each of one block (AES-NI) or two (VAES)
LANES = 16 if WIDE else 8

_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_VEC = ir.VectorType(_I64, 2)
_PER = 2 if WIDE else 1  #: blocks per register
_REG = ir.VectorType(_I64, 2 * _PER)
_jit = numba.njit(cache=True, nogil=True, boundscheck=False)


def _round(builder: ir.IRBuilder, name: str, reg: ir.VectorType = _REG) -> ir.Function:
    suffix = ".256" if reg.count == 4 else ""
    return builder.module.declare_intrinsic(f"llvm.x86.aesni.{name}{suffix}", fnty=ir.FunctionType(reg, [reg, reg]))


def _words(ty: types.Type, dtype: types.Type) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == dtype and ty.layout == "C"


def _shuffle(builder: ir.IRBuilder, a, b, order: list[int]):  # noqa: ANN001, ANN202
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(order)), order))


def _at(builder: ir.IRBuilder, base, offset, vty: ir.Type):  # noqa: ANN001, ANN202 - a typed pointer to base[offset]
    return builder.bitcast(builder.gep(base, [offset]), vty.as_pointer())


def _word(builder: ir.IRBuilder, base, lane: int):  # noqa: ANN001, ANN202 - the word base[lane]
    return builder.load(builder.gep(base, [ir.Constant(_I64, lane)]))


def _rounds(builder: ir.IRBuilder, xs: list, p_rk, kbase, reg: ir.VectorType) -> list:  # noqa: ANN001
    """AES-128's whitening and ten rounds of the registers ``xs`` under the round keys at word ``kbase``
    of ``p_rk`` (each 128-bit key loaded once and, with VAES, repeated in both halves of a register)."""
    enc, last = _round(builder, "aesenc", reg), _round(builder, "aesenclast", reg)

    def round_key(r: int):  # noqa: ANN202
        key = builder.load(_at(builder, p_rk, builder.add(kbase, ir.Constant(_I64, 2 * r)), _VEC), align=8)
        return key if reg.count == 2 else _shuffle(builder, key, key, [0, 1, 0, 1])

    key = round_key(0)
    states = [builder.xor(x, key) for x in xs]
    for r in range(1, 11):
        key = round_key(r)
        states = [builder.call(enc if r < 10 else last, [state, key]) for state in states]
    return states


def _lanes_intrinsic(feed_forward: bool, correct: bool, *, contiguous: bool = False,  # noqa: ANN202
                     tweak: bool = True, per: int = _PER):
    """``8 per`` AES-128 blocks (:data:`LANES` by default) under one key, with what the DPF does next fused in, as one intrinsic:

    ``fn(src, sbase, soff, tw, tbase, toff, rk, kbase, cw, cbase, coff, masks, dst, dbase, doff)``
    computes, for each lane ``l`` (a 16-byte block is two words at a flat word offset):

    * ``x = src[sbase + soff[l]] XOR tw[tbase + toff[l]]``;
    * ``y = AES_k(x)``, ``XOR x`` with ``feed_forward`` (``k``: the round keys at ``rk[kbase .. +22]``,
      shared by the lanes: each round key is loaded once per call);
    * with ``correct``, ``y = y XOR c`` with ``c = cw[cbase + coff[l]] AND masks[l]`` (a control bit's
      all-ones or zero mask);
    * ``dst[dbase + doff[l]] = y``.

    (Adding into a sum is :func:`_blocks_intrinsic`'s, which runs every value key of a leaf group.)

    Eight registers of states (one block each, or two with VAES) stay in registers through the ten
    rounds and every source is read before any destination is written (``dst`` may be ``src`` or
    ``tw``). ``cw`` and ``masks`` are read only with ``correct``; ``tw`` only with ``tweak``. With
    ``contiguous`` the lanes are consecutive blocks: ``soff[l]``, ``toff[l]`` and ``doff[l]`` are taken
    as ``2 l`` (those arrays are not read), which saves a load and an address per lane and operand
    (the hot loops' full groups) and, with VAES, loads and stores two blocks at once. ``per``: blocks per
    register, 1 (AES-NI) or 2 (VAES, where :data:`WIDE`)."""
    if per not in (1, 2):
        raise ValueError("per is 1 (AES-NI) or 2 (VAES)")
    lanes, reg = 8 * per, ir.VectorType(_I64, 2 * per)

    def typer(typingctx, src, sbase, soff, tw, tbase, toff, rk, kbase, cw, cbase, coff, masks, dst, dbase, doff):  # noqa: ANN001, ANN202, ARG001, PLR0913
        for name, ty, dtype in (("src", src, types.uint64), ("tw", tw, types.uint64), ("rk", rk, types.uint64),
                                ("cw", cw, types.uint64), ("masks", masks, types.uint64), ("dst", dst, types.uint64),
                                ("soff", soff, types.int64), ("toff", toff, types.int64), ("coff", coff, types.int64),
                                ("doff", doff, types.int64)):
            if not _words(ty, dtype):
                raise TypingError(f"{name} must be a C-contiguous {dtype} array; found {ty}")
        ip = types.intp
        sig = types.void(src, ip, soff, tw, ip, toff, rk, ip, cw, ip, coff, masks, dst, ip, doff)

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, PLR0915
            ty = signature.args
            ptr = [context.make_array(ty[i])(context, builder, args[i]).data if isinstance(ty[i], types.Array) else None
                   for i in range(len(args))]
            p_src, p_soff, p_tw, p_toff, p_rk, p_cw, p_coff, p_masks, p_dst, p_doff = (
                ptr[0], ptr[2], ptr[3], ptr[5], ptr[6], ptr[8], ptr[10], ptr[11], ptr[12], ptr[14])
            sbase, tbase, kbase, cbase, dbase = args[1], args[4], args[7], args[9], args[13]
            regs = lanes // per
            at, word = functools.partial(_at, builder), functools.partial(_word, builder)

            def offset(base_v, offs, lane: int):  # noqa: ANN001, ANN202
                return builder.add(base_v, ir.Constant(_I64, 2 * lane) if contiguous else word(offs, lane))

            def gather(base, base_v, offs, j: int):  # noqa: ANN001, ANN202 - register j's blocks
                if contiguous or per == 1:
                    return builder.load(at(base, offset(base_v, offs, per * j), reg), align=8)
                lo = builder.load(at(base, offset(base_v, offs, 2 * j), _VEC), align=8)
                hi = builder.load(at(base, offset(base_v, offs, 2 * j + 1), _VEC), align=8)
                return _shuffle(builder, lo, hi, [0, 1, 2, 3])

            def splat(values: list):  # noqa: ANN202 - one word per block of the register, each in both its words
                vec = ir.Constant(reg, ir.Undefined)
                for i in range(2 * per):
                    vec = builder.insert_element(vec, values[i // 2], ir.Constant(_I32, i))
                return vec

            xs = []
            for j in range(regs):
                x = gather(p_src, sbase, p_soff, j)
                xs.append(builder.xor(x, gather(p_tw, tbase, p_toff, j)) if tweak else x)

            states = _rounds(builder, xs, p_rk, kbase, reg)
            for j in range(regs):
                y = builder.xor(states[j], xs[j]) if feed_forward else states[j]
                if correct:
                    c = gather(p_cw, cbase, p_coff, j) if not contiguous else None
                    if contiguous:  # the corrections are per lane, never consecutive
                        parts = [builder.load(at(p_cw, builder.add(cbase, word(p_coff, per * j + i)), _VEC), align=8)
                                 for i in range(per)]
                        c = parts[0] if per == 1 else _shuffle(builder, parts[0], parts[1], [0, 1, 2, 3])
                    c = builder.and_(c, splat([word(p_masks, per * j + i) for i in range(per)]))
                    y = builder.xor(y, c)
                if contiguous or per == 1:
                    builder.store(y, at(p_dst, offset(dbase, p_doff, per * j), reg), align=8)
                    continue
                for i in range(per):  # each lane's block to its own offset
                    half = _shuffle(builder, y, y, [2 * i, 2 * i + 1])
                    builder.store(half, at(p_dst, offset(dbase, p_doff, per * j + i), _VEC), align=8)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


aes8 = _lanes_intrinsic(False, False)  #: ``dst = AES(x)``
mmo8 = _lanes_intrinsic(True, False)  #: ``dst = AES(x) XOR x``
mmo8_xor = _lanes_intrinsic(True, True)  #: ``dst = AES(x) XOR x XOR (cw AND mask)``
aes8_c = _lanes_intrinsic(False, False, contiguous=True)  #: :data:`aes8` on consecutive blocks
ecb8 = _lanes_intrinsic(False, False, contiguous=True, tweak=False)  #: ``dst = AES(src)``, consecutive blocks
mmo8_c = _lanes_intrinsic(True, False, contiguous=True, tweak=False)  #: :data:`mmo8` on consecutive blocks
mmo8_xor_c = _lanes_intrinsic(True, True, contiguous=True)  #: :data:`mmo8_xor` on consecutive blocks


def _blocks_intrinsic(out: str, *, per: int = _PER):  # noqa: ANN202
    """A DPF leaf group's whole value hash as one intrinsic: ``8 per`` consecutive blocks ``x`` (:data:`LANES`
    by default), each under ``blocks`` keys, with the feed-forward, the control-bit correction and the
    accumulation fused in:

    ``fn(src, sbase, rk, cw, coff, masks, dst, dbase, stride, blocks)`` computes, for each lane ``l``
    (``x = src[sbase + 2 l]``) and each ``i < blocks``,
    ``dst[dbase + i stride + 2 l] += (AES_i(x) XOR x) + (cw[coff[l] + 2 i] AND masks[l])`` (per 64-bit
    word; ``-=`` with ``out = "sub"``), ``AES_i`` under the round keys ``rk[22 i .. 22 i + 22]``.

    Unlike :func:`_lanes_intrinsic` (one key per call), the inputs, the masks and the lanes'
    correction addresses are loaded once for all ``blocks`` keys and stay in registers (a loop inside
    the intrinsic): the server's value pass spends its time in AES, not in reloading them per block
    (10-20% of that pass, measured on the captured rounds). ``dst`` must not overlap ``src``, ``cw``,
    ``coff`` or ``masks``."""
    if per not in (1, 2):
        raise ValueError("per is 1 (AES-NI) or 2 (VAES)")
    if out not in ("add", "sub"):
        raise ValueError("out is 'add' or 'sub'")
    lanes, reg = 8 * per, ir.VectorType(_I64, 2 * per)

    def typer(typingctx, src, sbase, rk, cw, coff, masks, dst, dbase, stride, blocks):  # noqa: ANN001, ANN202, ARG001, PLR0913
        for name, ty, dtype in (("src", src, types.uint64), ("rk", rk, types.uint64), ("cw", cw, types.uint64),
                                ("coff", coff, types.int64), ("masks", masks, types.uint64), ("dst", dst, types.uint64)):
            if not _words(ty, dtype):
                raise TypingError(f"{name} must be a C-contiguous {dtype} array; found {ty}")
        ip = types.intp
        sig = types.void(src, ip, rk, cw, coff, masks, dst, ip, ip, ip)

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            ty = signature.args
            p_src, p_rk, p_cw, p_coff, p_masks, p_dst = (context.make_array(ty[i])(context, builder, args[i]).data
                                                         for i in (0, 2, 3, 4, 5, 6))
            sbase, dbase, stride, blocks = args[1], args[7], args[8], args[9]
            regs = lanes // per
            at, word = functools.partial(_at, builder), functools.partial(_word, builder)
            xs = [builder.load(at(p_src, builder.add(sbase, ir.Constant(_I64, 2 * per * j)), reg), align=8)
                  for j in range(regs)]
            masks = []
            for j in range(regs):  # one mask word per block, in both its words
                vec = ir.Constant(reg, ir.Undefined)
                for i in range(2 * per):
                    vec = builder.insert_element(vec, word(p_masks, per * j + i // 2), ir.Constant(_I32, i))
                masks.append(vec)
            corr = [builder.gep(p_cw, [word(p_coff, lane)]) for lane in range(lanes)]  # each lane's correction row
            entry = builder.block
            loop, done = builder.append_basic_block("blocks"), builder.append_basic_block("blocks_done")
            builder.cbranch(builder.icmp_signed(">", blocks, ir.Constant(_I64, 0)), loop, done)
            builder.position_at_end(loop)
            blk = builder.phi(_I64)
            blk.add_incoming(ir.Constant(_I64, 0), entry)
            states = _rounds(builder, xs, p_rk, builder.mul(blk, ir.Constant(_I64, 22)), reg)
            cbase = builder.mul(blk, ir.Constant(_I64, 2))
            row = builder.add(dbase, builder.mul(blk, stride))
            for j in range(regs):
                parts = [builder.load(builder.bitcast(builder.gep(corr[per * j + i], [cbase]), _VEC.as_pointer()), align=8)
                         for i in range(per)]
                c = parts[0] if per == 1 else _shuffle(builder, parts[0], parts[1], [0, 1, 2, 3])
                y = builder.add(builder.xor(states[j], xs[j]), builder.and_(c, masks[j]))
                target = at(p_dst, builder.add(row, ir.Constant(_I64, 2 * per * j)), reg)
                old = builder.load(target, align=8)
                builder.store(builder.add(old, y) if out == "add" else builder.sub(old, y), target, align=8)
            nxt = builder.add(blk, ir.Constant(_I64, 1))
            blk.add_incoming(nxt, builder.block)
            builder.cbranch(builder.icmp_signed("<", nxt, blocks), loop, done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


#: ``dst[i] += (AES_i(x) XOR x) + (cw AND mask)`` for every key ``i`` of a group's consecutive blocks
mmo_blocks_add = _blocks_intrinsic("add")
#: ``dst[i] -= (AES_i(x) XOR x) + (cw AND mask)`` likewise
mmo_blocks_sub = _blocks_intrinsic("sub")


@intrinsic
def subword(typingctx, w):  # noqa: ANN001, ANN202, ARG001
    """FIPS-197's ``SubWord`` of a 32-bit word (in the low 32 bits of a uint64; byte 0 is the low
    byte): ``aesenclast`` with a zero round key of the word in all four columns (``ShiftRows`` moves
    bytes between columns only, so on four equal columns it is the identity): no table lookups."""
    if w != types.uint64:
        raise TypingError(f"subword takes a uint64; found {w}")

    def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202, ARG001
        (word,) = args
        low = builder.and_(word, ir.Constant(_I64, 0xFFFFFFFF))
        both = builder.or_(low, builder.shl(low, ir.Constant(_I64, 32)))
        vec = builder.insert_element(ir.Constant(_VEC, ir.Undefined), both, ir.Constant(ir.IntType(32), 0))
        vec = builder.insert_element(vec, both, ir.Constant(ir.IntType(32), 1))
        out = builder.call(_round(builder, "aesenclast", _VEC), [vec, ir.Constant(_VEC, [ir.Constant(_I64, 0)] * 2)])
        first = builder.extract_element(out, ir.Constant(ir.IntType(32), 0))
        return builder.and_(first, ir.Constant(_I64, 0xFFFFFFFF))

    return types.uint64(w), codegen


_MASK32 = np.uint64(0xFFFFFFFF)


@_jit
def expand_key(key, out):  # noqa: ANN001, ANN202
    """FIPS-197 key expansion of AES-128: ``key`` (``uint64 [2]``, the key's bytes in memory order)
    into ``out`` (``uint64 [22]``, the 11 round keys likewise). Words are little-endian, so
    ``RotWord`` is a rotation right by 8 bits and ``Rcon`` XORs the low byte."""
    w = np.empty(44, np.uint64)
    w[0] = key[0] & _MASK32
    w[1] = key[0] >> np.uint64(32)
    w[2] = key[1] & _MASK32
    w[3] = key[1] >> np.uint64(32)
    rcon = np.uint64(1)
    for i in range(4, 44):
        t = w[i - 1]
        if i % 4 == 0:
            t = ((t >> np.uint64(8)) | (t << np.uint64(24))) & _MASK32
            t = subword(t) ^ rcon
            rcon = ((rcon << np.uint64(1)) ^ (np.uint64(0x11B) if rcon & np.uint64(0x80) else np.uint64(0))) & np.uint64(0xFF)
        w[i] = w[i - 4] ^ t
    for r in range(22):
        out[r] = w[2 * r] | (w[2 * r + 1] << np.uint64(32))


@_jit
def ecb(x, rk, out, mmo):  # noqa: ANN001, ANN202
    """``out = AES(x)`` (``AES(x) XOR x`` with ``mmo``) over flat ``uint64 [2n]`` blocks, ``LANES`` at a
    time; the last partial group through a padded copy (no read or write past the arrays)."""
    n = x.size // 2
    none = np.zeros(LANES, np.int64)
    zero = np.zeros(2, np.uint64)
    full = n - n % LANES
    for i in range(0, full, LANES):
        if mmo:
            mmo8_c(x, 2 * i, none, zero, 0, none, rk, 0, zero, 0, none, zero, out, 2 * i, none)
        else:
            ecb8(x, 2 * i, none, zero, 0, none, rk, 0, zero, 0, none, zero, out, 2 * i, none)
    if full < n:
        pad = np.zeros(2 * LANES, np.uint64)
        res = np.empty(2 * LANES, np.uint64)
        pad[:2 * (n - full)] = x[2 * full:]
        if mmo:
            mmo8_c(pad, 0, none, zero, 0, none, rk, 0, zero, 0, none, zero, res, 0, none)
        else:
            ecb8(pad, 0, none, zero, 0, none, rk, 0, zero, 0, none, zero, res, 0, none)
        out[2 * full:] = res[:2 * (n - full)]
