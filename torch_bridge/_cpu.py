"""CPU backend of the qpn ops: numba kernels that read the QPN2 / QPN8 layouts directly.

Two jitted kernels and one inlined helper (`_rn16`), nothing else: numba compile time counts
against CI (measured cold: about 4 s for both kernels on the 2-core CI machine), and
`cache=True` keeps the machine code in __pycache__ between runs. The arguments always have
the same types (C-contiguous uint8 / float32 arrays), so each kernel compiles exactly once.

- `qpn2_w16_into(codes, scales, g_tiles, out)`: QPN2 buffers -> out[n, k] = W16 as float32,
  W16 = RN16(RN32(e2m1 * RN32(e4m3 * g(n)))) (DESIGN.md, NVFP4 weight).
- `qpn8_w16_into(codes, group_scales, out)`: QPN8 buffers -> out[n, k] = W16 as float32,
  W16 = RN16(e4m3 * 2^-8 * S16) (the product is exact in fp32, see ref/qpn8.py).

Why one path for every M (no fused small-M loop): measured on the 2-core CI machine, a fused
numba dequantize-and-dot kernel beats "dequantize, then torch's fp32 matmul" only at M = 1
(4096 x 4096: 24 ms vs 36 ms; 384 x 384: 0.19 vs 0.29 ms) and loses from M = 8 on
(4096 x 4096, M = 8: 77 vs 45 ms; M = 32: 272 vs 53 ms). The CPU backend exists for CI and for
running the same code without a GPU, so it keeps one clear path and two kernels.

Both write W16 *as float32 values* (every fp16 value is exact in fp32): the linear ops feed
that array straight into an fp32 matmul (fp32 accumulation, one RN16 at the end), and the
dequantize ops cast it to float16, which is exact because every value already is an fp16 value.
numba has no float16 type on the CPU, so RN16 is done here with integer operations on the fp32
bit pattern (`_rn16`); the tests compare the result byte for byte with `qpn.ref`.

Numerics policy (identical to qpn.ref and to the CUDA kernels):
- every product is one IEEE fp32 multiply (numba never contracts or reorders: fastmath is off);
- RN16 is round-to-nearest-even with fp16 subnormals kept and |v| >= 65520 -> +-inf; the
  ops' callers reject scales that overflow (ref's rules) before this point, so inf never
  appears for validated inputs;
- code 8 (e2m1 -0) gives -0.0 (0x8000): the sign bit survives the multiply and RN16;
- e4m3 NaN bytes (0x7F / 0xFF) are rejected at prepack. If one reached this code anyway it
  decodes as +-480, the value the kernels' bit trick ((b & 0x7F) << 7 as fp16 bits, times 256)
  gives, so the CPU and GPU backends agree even on unvalidated bytes.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from qpn.ref import decode_e2m1, decode_e4m3
from qpn.ref.geometry import GROUP_K, KORDER, LANE_OF_COLUMN, TILE_N

# 16-entry e2m1 table (code 8 -> -0.0) and 256-entry e4m3 table with the NaN bytes replaced by
# the bit-trick value (module docstring). All values exact in float32.
_E2M1 = decode_e2m1(np.arange(16, dtype=np.uint8)).astype(np.float32)
_E4M3 = decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float32)
_E4M3[0x7F] = np.float32(480.0)  # 0x7F = 0111_1111 -> fp16 bits 0x3F80 = 1.875, times 256
_E4M3[0xFF] = np.float32(-480.0)
_E4M3_OVER_256 = (_E4M3 * np.float32(2.0**-8)).astype(np.float32)  # exact: power-of-two scaling
_LANE = LANE_OF_COLUMN.astype(np.int64)  # column inside a 32-column tile -> the lane that owns it
_KORDER = KORDER.astype(np.int64)  # position p inside a group -> k
_QPN2_BYTES = GROUP_K // 2  # code bytes per lane and group in QPN2 (two nibbles each)
_QPN8_GROUPS_PER_BLOCK = 128 // GROUP_K  # 8 groups share one 128x128 block scale


@intrinsic
def _f32_bits(typingctx, value):
    """float32 -> its IEEE bit pattern, zero-extended to int64 (a bitcast, no rounding)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


@intrinsic
def _f32_of_bits(typingctx, bits):
    """int64 holding a 32-bit pattern -> that float32 (truncate, bitcast)."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

    return types.float32(types.int64), codegen


_SIGN = 0x80000000  # fp32 sign bit
_MAGNITUDE = 0x7FFFFFFF
_FP32_INF = 0x7F800000
_FP16_INF_THRESHOLD = 0x477FF000  # 65520.0f: the midpoint of 65504 and 2^16, ties to the even 2^16 = inf
_FP16_MIN_NORMAL = 0x38800000  # 2^-14.0f
_FP16_DROPPED_HALF = 0xFFF  # half of the 13 dropped mantissa bits, minus one: 0_1111_1111_1111
_FP16_KEPT = 0xFFFFE000  # sign, exponent and the 10 mantissa bits fp16 keeps


@njit(cache=True, inline="always")
def _rn16(v):
    """RN16 of a float32, returned as float32 (exact): round-to-nearest-even, subnormals kept."""
    u = _f32_bits(v)
    sign = u & _SIGN
    a = u & _MAGNITUDE
    if a >= _FP16_INF_THRESHOLD:
        if a > _FP32_INF:
            return v  # NaN stays NaN
        return _f32_of_bits(sign | _FP32_INF)
    if a < _FP16_MIN_NORMAL:
        # fp16 subnormal grid 2^-24: scaling by 2^24 is exact, rint rounds half to even.
        r = np.float32(np.rint(abs(v) * np.float32(16777216.0)) * np.float32(2.0**-24))
        return _f32_of_bits(sign | _f32_bits(r))
    # normal: drop 13 of fp32's 23 mantissa bits, half to even (a carry may bump the exponent)
    a = (a + _FP16_DROPPED_HALF + ((a >> 13) & 1)) & _FP16_KEPT
    return _f32_of_bits(sign | a)


@njit(parallel=True, cache=True)
def qpn2_w16_into(codes, scales, g_tiles, out):
    """QPN2 -> out float32 [N, K] holding W16. codes uint8 [N*K/2], scales uint8 [N*K/16] (flat,
    QPN2 order), g_tiles float32 [N/32] (one global scale per tile; a scalar is repeated).

    One output row per iteration, so the stores stream through memory in order; the row's
    8-byte lane slots sit 256 bytes apart, inside its tile's codes (K*16 bytes, L2-resident
    while the tile's 32 rows are done). Measured on the 2-core CI machine, 4096 x 4096:
    34 ms row-major vs 57 ms tile-major (whose stores touch 32 rows per group).
    """
    n, k = out.shape
    groups = k // GROUP_K
    for row in prange(n):
        t = row // TILE_N
        lane = _LANE[row % TILE_N]
        g_tile = g_tiles[t]
        for g in range(groups):
            slot = (t * groups + g) * TILE_N + lane
            block = _E4M3[scales[slot]] * g_tile  # RN32(e4m3 * g)
            base = slot * _QPN2_BYTES
            for b in range(_QPN2_BYTES):
                byte = codes[base + b]
                out[row, GROUP_K * g + _KORDER[2 * b]] = _rn16(_E2M1[byte & 0xF] * block)  # low nibble
                out[row, GROUP_K * g + _KORDER[2 * b + 1]] = _rn16(_E2M1[byte >> 4] * block)  # high nibble


@njit(parallel=True, cache=True)
def qpn8_w16_into(codes, group_scales, out):
    """QPN8 -> out float32 [N, K] holding W16. codes uint8 [N*K] (flat, QPN8 order),
    group_scales float32 [1, N] (channel) or [K/128, N/32] (128x128 block), values of S16.
    Row-major like qpn2_w16_into (4096 x 4096: 51 ms vs 83 ms tile-major)."""
    n, k = out.shape
    groups = k // GROUP_K
    channel = group_scales.shape[1] == n
    for row in prange(n):
        t = row // TILE_N
        lane = _LANE[row % TILE_N]
        for g in range(groups):
            if channel:
                s16 = group_scales[0, row]
            else:
                s16 = group_scales[g // _QPN8_GROUPS_PER_BLOCK, t]
            base = ((t * groups + g) * TILE_N + lane) * GROUP_K
            for p in range(GROUP_K):
                # e4m3 * 2^-8 (exact) times S16: at most 15 significant bits, exact in fp32
                out[row, GROUP_K * g + _KORDER[p]] = _rn16(_E4M3_OVER_256[codes[base + p]] * s16)
