"""NVFP4 weights as ModelOpt writes them: quantizer, checkpoint-semantics dequantization, nibbles.

Tensors of one linear layer (docs/FORMATS.md, "NVFP4, as ModelOpt writes it"), N = output
features, K = input features:

    weight_packed   uint8   [N, K/2]   byte j of row n: k=2j in the LOW nibble, k=2j+1 in the HIGH
    weight_scale    uint8   [N, K/16]  e4m3 bit patterns, one block scale per 16 consecutive k
    weight_scale_2  float32 ()         global multiplier g = amax(|W|) / 2688   (2688 = 6 * 448)

    byte j of row n:   bit 7 6 5 4 | 3 2 1 0
                           code k=2j+1 | code k=2j

Numerics policy
- Quantizer (`nvfp4_quantize`) = ModelOpt's `NVFP4QTensor.quantize` bit for bit: every step is a
  float32 operation rounded once (RN32), in ModelOpt's order; block scales are cast to e4m3 by
  round-to-nearest-even (RNE) after clamping to [2^-9, 448]; elements are cast to e2m1 by RNE on
  the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6, saturating at 6.
- Signed zero: ModelOpt sets the e2m1 sign bit only for x < 0, so a scaled value of -0.0 gets
  code 0 (+0). `encode_e2m1` follows np.signbit (the format's own view, as ml_dtypes does), so
  the quantizer maps -0.0 to +0.0 before encoding. Negative values that round to 0 keep the sign
  (code 8) in both conventions.
- Dequantization (`nvfp4_dequantize`) is the qpn numerics contract (docs/DESIGN.md, "NVFP4 weight"):
  W16[n,k] = RN16(RN32(e2m1(code) * RN32(e4m3(scale[n,k/16]) * g(n)))); code 8 gives -0.0
  (fp16 bits 0x8000). `nvfp4_dequantize_fp32` stops before RN16 (ModelOpt's fp32 result).
  The formula is evaluated once per global scale on all 256 scale bytes x 16 codes
  (`nvfp4_value_table`), and each weight byte is then looked up with its block's scale byte:
  the same roundings on the same inputs, 3.5 instead of 26 ns per weight (fp32 decode, multiply, cast).
- NaN: NaN/inf weights are rejected by the quantizer; NaN scale bytes (0x7F/0xFF) are rejected
  by the dequantizers. e2m1 has no NaN.
- Overflow: a block whose largest possible weight RN16(RN32(6 * RN32(|e4m3| * g))) is inf is
  rejected (`nvfp4_block_overflows`); the rule reads scales only, never the codes, so GPU kernels
  can apply the same check at prepack time.
- Subnormals: e4m3 subnormal scales (down to 2^-9) and fp32/fp16 subnormal results are kept
  (no flush to zero anywhere).
- All-zero weight: ModelOpt's torch quantizer computes 0/0 there and writes NaN scale bytes and
  code 7 (6.0) everywhere, a checkpoint qpn must reject. qpn follows ModelOpt's ONNX exporter
  (modelopt/onnx/quantization/quant_utils.py, `get_weights_scaling_factor_2`), which maps a zero
  global scale to 1.0: weight_scale_2 = 1.0, every block scale 1.0 (0x38), every code 0.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import pairwise
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from .checks import require_array, require_multiple, require_no_nan_e4m3, require_shape, require_weight_to_quantize
from .codecs import E2M1_MAX, E4M3_MAX, decode_e2m1, decode_e4m3
from .float_classes import e2m1_table, e4m3_table, lookup_classes
from .geometry import GROUP_K
from .global_scale import global_scale_per_row

NVFP4_BLOCK = GROUP_K  # 16 consecutive k share one e4m3 block scale
NVFP4_GLOBAL_DIVISOR = np.float32(E2M1_MAX * E4M3_MAX)  # 2688 = 6 * 448, exact in fp32
E4M3_MIN_SUBNORMAL = np.float32(2.0**-9)  # smallest positive e4m3 value (0x01)
# RN16(v) is inf exactly when |v| >= 65520: fp16's largest finite value is 65504 (0x7BFF, odd
# mantissa) and its spacing there is 32, so the midpoint 65520 rounds to the even 65536 = inf.
FP16_OVERFLOW_THRESHOLD = np.float32(65520.0)

_LOW_NIBBLE = 0x0F  # 0000_1111
# A packed byte holds two weights, so the decode looks up (scale byte << 8 | weight byte) -> both
# values at once, as one unit of two fp16 (uint32) or two fp32 (uint64): 64 K entries, 256/512 KiB.
_PAIR_UNIT: dict[np.dtype, np.dtype] = {np.dtype(np.float16): np.dtype(np.uint32),
                                        np.dtype(np.float32): np.dtype(np.uint64)}
# Rows per lookup call: the uint16 index of 64 rows of K = 4096 is 256 KiB, so it stays in L2
# between being built and being read (whole-layer indexes measured 1.5x slower).
_ROWS_PER_LOOKUP = 64
_ALL_BYTES = np.arange(256, dtype=np.uint8)
_ALL_CODES = np.arange(16, dtype=np.uint8)


class NVFP4Weight(NamedTuple):
    """One NVFP4 linear weight in ModelOpt's checkpoint layout (see the module docstring).

    A NamedTuple, so `nvfp4_dequantize(*nvfp4_quantize(w))` works.
    """

    weight_packed: np.ndarray  # uint8 [N, K/2], element 2j -> low nibble, 2j+1 -> high nibble
    weight_scale: np.ndarray  # uint8 [N, K/16], e4m3 bit patterns
    weight_scale_2: np.ndarray  # float32, shape ()


# ----------------------------------------------------------------------------- nibbles


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 4-bit codes [..., K] -> uint8 bytes [..., K/2]; element 2j -> LOW nibble, 2j+1 -> HIGH.

    K must be even. Exact inverse: `unpack_nibbles`.
    """
    codes = require_array("codes", codes, np.uint8)
    if codes.ndim < 1 or codes.shape[-1] % 2 != 0:
        raise ValueError(
            f"codes must have an even last dimension (two 4-bit codes per byte), got shape {codes.shape}; "
            "NVFP4 rows hold K % 16 == 0 elements"
        )
    if codes.size and codes.max() > _LOW_NIBBLE:
        raise ValueError(
            f"codes must be 4-bit values 0..15, got a value {int(codes.max())}; "
            "encode with encode_e2m1 first"
        )
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 bytes [..., K/2] -> uint8 4-bit codes [..., K]; LOW nibble -> element 2j, HIGH -> 2j+1.

    Exact inverse of `pack_nibbles`.
    """
    packed = require_array("packed", packed, np.uint8)
    if packed.ndim < 1:
        raise ValueError(f"packed must have at least one dimension, got shape {packed.shape}")
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    codes[..., 0::2] = packed & _LOW_NIBBLE
    codes[..., 1::2] = packed >> 4
    return codes


# ----------------------------------------------------------------------------- quantize


def nvfp4_quantize(w: np.ndarray, weight_scale_2: float | np.floating | None = None,
                   weight_scale: np.ndarray | None = None) -> NVFP4Weight:
    """float32/float16 weight [N, K] (K % 16 == 0) -> NVFP4Weight, ModelOpt's bytes bit for bit.

    weight_scale_2 (fp32, > 0), when given, replaces step 1 (ModelOpt's `weights_scaling_factor_2`
    argument: its exporter passes q/k/v's shared one); weight_scale (uint8 e4m3 bytes [N, K/16], each
    a positive finite scale), when given, replaces step 2 (a scale search, ref/scale_search.py).

    float16 input is converted to float32 exactly first (ModelOpt's arithmetic then runs in fp32
    for fp16/bf16 weights too). Steps, each rounded once in fp32 (docs/FORMATS.md, "ModelOpt's quantizer"):
      1. weight_scale_2 = amax(|W|) / 2688
      2. block_scale = block_amax / RN32(6 * weight_scale_2); 0 -> 1.0; clamp [2^-9, 448]; e4m3 RNE
      3. scaled = W / RN32(e4m3(block_scale) * weight_scale_2)
      4. code = (sign bit iff scaled < 0) | e2m1 RNE magnitude of |scaled|, saturating at 6
      5. pack, element 2j in the low nibble.
    Rejects NaN/inf (ValueError). An all-zero W gives weight_scale_2 = 1.0 (module docstring).
    """
    w32 = _validate_weight_to_quantize(w)  # a float32 copy of its own: the steps below work in place
    n, k = w32.shape
    blocks = w32.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    # float32 [N, K/16], exact; not needed when both scales are given (a scale search's candidates)
    block_amax = np.abs(blocks).max(axis=-1) if weight_scale_2 is None or weight_scale is None else None

    if weight_scale_2 is not None:
        weight_scale_2 = np.float32(weight_scale_2)
        if not (np.isfinite(weight_scale_2) and weight_scale_2 > 0):
            raise ValueError(f"weight_scale_2 must be a finite fp32 value > 0, got {float(weight_scale_2)!r}; "
                             "leave it out to take ModelOpt's amax / 2688")
    else:
        assert block_amax is not None
        weight_scale_2 = nvfp4_global_scale(block_amax.max())

    if weight_scale is None:  # step 2 (the divisor 6 * weight_scale_2 is its own fp32 product, as in ModelOpt)
        assert block_amax is not None
        block_scale = block_amax / (np.float32(6.0) * weight_scale_2)
        block_scale[block_scale == 0] = np.float32(1.0)
        block_scale = np.clip(block_scale, E4M3_MIN_SUBNORMAL, np.float32(E4M3_MAX))
        weight_scale = lookup_classes(block_scale, e4m3_table())  # = encode_e4m3(block_scale)
    else:
        weight_scale = require_array("weight_scale", weight_scale, np.uint8, ndim=2)
        require_shape("weight_scale", weight_scale, (n, k // NVFP4_BLOCK))
        if not (decode_e4m3(weight_scale) > 0).all():  # NaN bytes compare False too
            raise ValueError("weight_scale must hold positive finite e4m3 scales (bytes 0x01..0x7E); "
                             "a zero, negative or NaN block scale cannot divide the block")

    # step 3
    block_multiplier = decode_e4m3(weight_scale) * weight_scale_2  # RN32, float32 [N, K/16]
    if np.any(block_multiplier == 0):  # only for amax deep in fp32's subnormals (below ~1e-36)
        raise ValueError(
            f"w has amax(|w|) = {float(np.abs(w32).max()):.3e}, so e4m3 block scale * weight_scale_2 underflows "
            "to 0 in fp32 and the weights would divide by zero; rescale the weight (multiply by a power of two)"
        )
    scaled = np.divide(blocks, block_multiplier[..., None], out=blocks).reshape(n, k)

    # step 4: ModelOpt's sign is (x < 0); -0.0 must therefore encode as +0 (code 0), see docstring.
    # x + (+0.0) is x for every x but -0.0, which becomes +0.0 (IEEE 754 round-to-nearest; numpy never flushes
    # subnormals), so this one in-place pass is np.where(scaled == 0, 0.0, scaled).
    scaled += np.float32(0.0)
    codes = lookup_classes(scaled, e2m1_table())  # = encode_e2m1(scaled) (ref/float_classes.py)

    return NVFP4Weight(
        weight_packed=pack_nibbles(codes),
        weight_scale=weight_scale,
        weight_scale_2=np.array(weight_scale_2, dtype=np.float32),
    )


def nvfp4_global_scale(amax: float | np.floating) -> np.float32:
    """Step 1 of `nvfp4_quantize` for a weight with amax(|W|) = amax (finite, >= 0): RN32(amax / 2688), or
    1.0 for an all-zero weight (module docstring); ValueError where the division underflows to 0."""
    amax = np.float32(amax)
    if amax == 0:
        return np.float32(1.0)  # ModelOpt ONNX exporter's rule; its torch path gives NaN
    weight_scale_2 = amax / NVFP4_GLOBAL_DIVISOR  # step 1: one fp32 division
    if weight_scale_2 == 0:
        raise ValueError(
            f"w has amax(|w|) = {float(amax):.3e}, so weight_scale_2 = amax/2688 underflows to 0 in fp32 "
            "and every block scale would divide by zero; rescale the weight (multiply by a power of two)"
        )
    return np.float32(weight_scale_2)


def _validate_weight_to_quantize(w: np.ndarray) -> np.ndarray:
    w32 = require_weight_to_quantize(w)
    require_multiple("K", w32.shape[1], NVFP4_BLOCK, "NVFP4 (one e4m3 scale per 16 consecutive k)",
                     "pad the input features")
    return w32


# ----------------------------------------------------------------------------- dequantize


def nvfp4_block_overflows(weight_scale: np.ndarray, g_rows: np.ndarray) -> np.ndarray:
    """bool [N, K/16]: True where the block's largest possible fp16 weight is inf.

    weight_scale: uint8 e4m3 bits [N, K/16]; g_rows: float32 [N], one global scale per row (see
    `global_scale_per_row`). The largest |W16| a block can produce is
    RN16(RN32(6 * RN32(|e4m3| * g))) (6 = largest e2m1 magnitude; every rounding is monotone), and
    it is inf exactly when RN32(6 * RN32(|e4m3| * g)) >= 65520. Depends on scales only, not codes.
    NaN scale bytes are not judged here (they compare False); callers reject them first.
    """
    weight_scale = require_array("weight_scale", weight_scale, np.uint8, ndim=2)
    g_rows = require_array("g_rows", g_rows, np.float32, ndim=1)
    require_shape("g_rows", g_rows, (weight_scale.shape[0],))
    with np.errstate(over="ignore"):  # an fp32 inf here is an answer (overflow), not an error
        block_multiplier = np.abs(decode_e4m3(weight_scale)) * g_rows[:, None]  # RN32
        largest = np.float32(E2M1_MAX) * block_multiplier  # RN32
    return largest >= FP16_OVERFLOW_THRESHOLD


def require_nvfp4_fits_fp16(weight_scale: np.ndarray, g_rows: np.ndarray, name: str = "weight_scale") -> None:
    """ValueError naming the first block whose largest fp16 weight would be inf (`nvfp4_block_overflows`)."""
    over = nvfp4_block_overflows(weight_scale, g_rows)
    if over.any():
        row, block = (int(i) for i in np.argwhere(over)[0])
        scale = float(decode_e4m3(weight_scale[row, block]))
        g = float(g_rows[row])
        raise ValueError(
            f"{name}[{row}, {block}] = 0x{int(weight_scale[row, block]):02X} (e4m3 {scale:g}) with global scale "
            f"g[{row}] = {g:g} lets the block reach 6 * {scale:g} * {g:g} = {6 * scale * g:.6g}, beyond fp16's "
            f"65504 ({int(over.sum())} blocks overflow); the fp16 contract cannot represent this layer: keep it "
            "in higher precision (nvfp4_dequantize_fp32) or re-quantize the weight at a smaller scale"
        )


def nvfp4_dequantize(weight_packed: np.ndarray, weight_scale: np.ndarray, global_scale: float | np.ndarray
                     ) -> np.ndarray:
    """NVFP4 checkpoint tensors -> float16 [N, K], W16 = RN16(RN32(e2m1 * RN32(e4m3 * g(n)))).

    weight_packed: uint8 [N, K/2] (element 2j in the low nibble); weight_scale: uint8 e4m3 bits
    [N, K/16]; global_scale: float32 scalar or one value per 32-row output tile
    (`global_scale_per_row`). K = 2 * weight_packed.shape[1] must be a multiple of 16.
    Code 8 gives -0.0 (0x8000). Rejects NaN scale bytes and blocks that would overflow fp16.
    """
    g_rows = _validate_dequantize_inputs(weight_packed, weight_scale, global_scale)
    require_nvfp4_fits_fp16(weight_scale, g_rows)
    return _dequantize_by_table(weight_packed, weight_scale, g_rows, np.float16)


def nvfp4_dequantize_fp32(weight_packed: np.ndarray, weight_scale: np.ndarray, global_scale: float | np.ndarray
                          ) -> np.ndarray:
    """NVFP4 checkpoint tensors -> float32 [N, K] = RN32(e2m1 * RN32(e4m3 * g(n))).

    ModelOpt's own fp32 dequantization (before its final cast); for notebooks comparing variants.
    Same inputs and validation as `nvfp4_dequantize`, except that no fp16 overflow rule applies
    (a product beyond fp32's range is inf, as in ModelOpt). Code 8 gives -0.0.
    """
    g_rows = _validate_dequantize_inputs(weight_packed, weight_scale, global_scale)
    return _dequantize_by_table(weight_packed, weight_scale, g_rows, np.float32)


def nvfp4_value_table(g: float | np.floating, dtype: npt.DTypeLike = np.float16) -> np.ndarray:
    """[256 scale bytes, 16 codes] of `dtype`: RN(RN32(e2m1(code) * RN32(e4m3(scale) * g))).

    The dequantization formula evaluated on every input for one fp32 global scale g (RN = RN16
    for float16, nothing more for float32). Rows of NaN scale bytes are NaN, and rows that
    overflow are inf: the dequantizers reject such scales before looking anything up.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN rows belong to rejected scale bytes
        block_multiplier = decode_e4m3(_ALL_BYTES) * np.float32(g)  # RN32, [256]
        return (block_multiplier[:, None] * decode_e2m1(_ALL_CODES)[None, :]).astype(dtype)  # RN32, then RN


def _pair_table(values: np.ndarray) -> np.ndarray:
    """[256, 16] values -> [65536] pair units: (scale << 8 | byte) -> (value of the low nibble, of the high)."""
    pairs = np.stack([values[:, _ALL_BYTES & _LOW_NIBBLE], values[:, _ALL_BYTES >> 4]], axis=-1)  # [256, 256, 2]
    return np.ascontiguousarray(pairs).view(_PAIR_UNIT[values.dtype]).reshape(-1)


@lru_cache(maxsize=8)
def _pair_table_of(g_bits: int, dtype: str) -> np.ndarray:
    """The pair table of the fp32 global scale with bits g_bits (built once: a weight's row slices and a scale
    search's candidates decode with one g). Read only."""
    table = _pair_table(nvfp4_value_table(np.uint32(g_bits).view(np.float32), dtype))
    table.flags.writeable = False
    return table


def _dequantize_by_table(weight_packed: np.ndarray, weight_scale: np.ndarray, g_rows: np.ndarray,
                         dtype: npt.DTypeLike) -> np.ndarray:
    """W[n, 2j], W[n, 2j+1] = pair table of g(n) [scale[n, j/8] << 8 | weight_packed[n, j]] (validated inputs)."""
    dtype = np.dtype(dtype)
    n, half_k = weight_packed.shape
    out = np.empty((n, half_k), _PAIR_UNIT[dtype])
    byte_blocks = weight_packed.reshape(n, -1, NVFP4_BLOCK // 2)  # [N, K/16, 8]: block b's 8 bytes
    scale_index = weight_scale.astype(np.uint16)[..., None] << 8  # [N, K/16, 1]
    g_bits = g_rows.view(np.uint32)
    # slices of at most _ROWS_PER_LOOKUP rows that never straddle a change of g (g is per 32-row tile)
    g_changes = (np.flatnonzero(g_bits[1:] != g_bits[:-1]) + 1).tolist()
    edges = sorted(set(range(0, n, _ROWS_PER_LOOKUP)) | set(g_changes) | {n})
    for start, stop in pairwise(edges):
        table = _pair_table_of(int(g_bits[start]), dtype.str)
        index = (scale_index[start:stop] | byte_blocks[start:stop]).reshape(stop - start, half_k)
        np.take(table, index, out=out[start:stop], mode="clip")  # every index < 65536 by construction
    return out.view(dtype).reshape(n, 2 * half_k)


def _validate_dequantize_inputs(weight_packed: np.ndarray, weight_scale: np.ndarray,
                                global_scale: float | np.ndarray) -> np.ndarray:
    weight_packed = require_array("weight_packed", weight_packed, np.uint8, ndim=2)
    weight_scale = require_array("weight_scale", weight_scale, np.uint8, ndim=2)
    n, half_k = weight_packed.shape
    k = 2 * half_k
    if n == 0:
        raise ValueError(f"weight_packed must have at least one row (N >= 1), got shape {weight_packed.shape}")
    require_multiple(
        "K",
        k,
        NVFP4_BLOCK,
        "NVFP4 (K = 2 * weight_packed.shape[1]; one e4m3 scale per 16 consecutive k)",
        "pad the input features to a multiple of 16",
    )
    require_shape("weight_scale", weight_scale, (n, k // NVFP4_BLOCK))
    require_no_nan_e4m3("weight_scale", weight_scale)
    return global_scale_per_row(global_scale, n)
