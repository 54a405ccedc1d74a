"""FP8 (e4m3fn) weights: the ModelOpt / DeepSeek quantizer and checkpoint-semantics dequantization.

Tensors (docs/FORMATS.md, "FP8 weights"), N = output features, K = input features:

    weight        uint8   [N, K]   e4m3fn bit patterns
    weight_scale  float32 ()                              granularity "tensor"
                          [N]   (or [N, 1] on input)      granularity "channel"
                          [ceil(N/128), ceil(K/128)]      granularity "block": scale (i, j) covers
                          rows 128i..128i+127 and columns 128j..128j+127, cropped at ragged edges
                          (ModelOpt 0.47's FP8_PB_WO export stores the same grid as
                          [ceil(N/128), 1, ceil(K/128), 1]; accepted as input, returned 2-D)
    value = e4m3(weight[n, k]) * scale(n, k)   (DeepSeek's `weight_scale_inv` is this multiplier)

Numerics policy
- Quantizer (`fp8_quantize`): per group (whole tensor, one row, one 128x128 block) the scale is
  RN32(amax(|w|) / 448), one fp32 division (ModelOpt's `amax / maxbound`, DeepSeek's `amax / 448`);
  codes = encode_e4m3(RN32(w / scale)): one fp32 division, then round-to-nearest-even to e4m3,
  saturating at +-448 (the quotient can exceed 448 by rounding). float16 input is converted to
  float32 exactly first.
- All-zero group: amax = 0 would make ModelOpt and DeepSeek divide 0/0 (NaN codes); qpn gives that
  group the scale 1.0, so its codes are 0x00 and it dequantizes to exact zeros.
- Signed zero: -0.0 quantizes to 0x80 (the sign follows np.signbit, as torch's cast does) and
  dequantizes to -0.0.
- Dequantization (`fp8_dequantize`): the checkpoint semantics W16 = RN16(RN32(e4m3 * s)), evaluated
  once per scale on all 256 codes and looked up per weight (ref/lookup.py). (QPN8's kernel
  contract RN16(e4m3 * 2^-8 * RN16(256 * s)) lives in ref/qpn8.py.)
- NaN: NaN/inf weights are rejected by the quantizer; e4m3 NaN bytes (0x7F/0xFF) in `weight` and
  non-finite or non-positive scales are rejected by the dequantizer.
- Overflow: a group whose largest possible weight RN16(RN32(448 * s)) is inf, i.e.
  RN32(448 * s) >= 65520, is rejected (a rule on scales only, as for NVFP4).
- Subnormals: e4m3 subnormal codes and fp32/fp16 subnormal results are kept (no flush to zero).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from .checks import require_array, require_no_nan_e4m3, require_positive_scale, require_weight_to_quantize
from .codecs import E4M3_MAX, decode_e4m3
from .dtypes import BF16, FP16, require_dtype, round_to
from .float_classes import e4m3_table, lookup_classes
from .formats import FP8_BLOCK, FP8_GRANULARITIES
from .lookup import lookup_blocks

FP8_SCALE_DIVISOR = np.float32(E4M3_MAX)  # 448
# RN16(v) is inf exactly when |v| >= 65520 (midpoint of 65504 and 2^16, ties to the even 2^16).
FP16_OVERFLOW_THRESHOLD = np.float32(65520.0)
_ALL_CODES = np.arange(256, dtype=np.uint8)



class FP8Weight(NamedTuple):
    """One FP8 linear weight (see the module docstring). `fp8_dequantize(*fp8_quantize(w, g))` works."""

    weight: np.ndarray  # uint8 [N, K], e4m3 bit patterns
    weight_scale: np.ndarray  # float32: () tensor, [N] channel, [ceil(N/128), ceil(K/128)] block


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- quantize


def fp8_quantize(w: np.ndarray, granularity: str, weight_scale: np.ndarray | None = None,
                 quotient_dtype: str | None = None) -> FP8Weight:
    """float32/float16 weight [N, K] -> FP8Weight with scale RN32(amax/448) per group.

    granularity: "tensor" (scale shape ()), "channel" (one per row, [N]) or "block" (one per
    128x128 block, [ceil(N/128), ceil(K/128)], ragged edge blocks cover what is there).
    codes = encode_e4m3(RN32(w / scale)), RNE, saturating. An all-zero group gets scale 1.0.
    weight_scale (float32, finite > 0, the granularity's shape), when given, replaces the amax rule
    (a shared or searched scale). quotient_dtype ("float16" / "bfloat16") rounds the quotient to
    that dtype before the e4m3 cast: ModelOpt 0.47's per-tensor export of a bf16 / fp16 model does
    (torch divides the weight by a 0-d fp32 scale in the weight's dtype; a per-channel or block
    scale tensor promotes the division to fp32), measured on tests/fixtures/modelopt/fp8_tensor.
    """
    if granularity not in FP8_GRANULARITIES:
        raise ValueError(
            f"granularity must be one of {FP8_GRANULARITIES}, got {granularity!r}; "
            "pick the checkpoint's scale layout"
        )
    w32 = require_weight_to_quantize(w)
    n, k = w32.shape
    if weight_scale is not None:
        given = _as_float32_scale(weight_scale)
        scale = given.reshape(_scale_shape(granularity, n, k))  # ValueError on a wrong size
        require_positive_scale("weight_scale", scale)
        return _encode(w32, scale, granularity, quotient_dtype)
    abs_w = np.abs(w32)

    if granularity == "tensor":
        group_amax = abs_w.max()[()]
    elif granularity == "channel":
        group_amax = abs_w.max(axis=1)
    else:
        nb, kb = _ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK)
        padded = np.zeros((nb * FP8_BLOCK, kb * FP8_BLOCK), dtype=np.float32)  # zeros never raise amax
        padded[:n, :k] = abs_w
        group_amax = padded.reshape(nb, FP8_BLOCK, kb, FP8_BLOCK).max(axis=(1, 3))
    del abs_w
    return _encode(w32, fp8_scale(group_amax, granularity), granularity, quotient_dtype)


def fp8_scale(group_amax: npt.ArrayLike, granularity: str) -> np.ndarray:
    """`fp8_quantize`'s scale of groups with these amax(|w|) (finite, >= 0): RN32(amax / 448), 1.0 for an
    all-zero group; ValueError where the division underflows to 0. float32, group_amax's shape."""
    group_amax = np.asarray(group_amax, dtype=np.float32)
    scale = group_amax / FP8_SCALE_DIVISOR  # one fp32 division per group
    if np.any((scale == 0) & (group_amax > 0)):
        tiny = float(group_amax[(scale == 0) & (group_amax > 0)].max())
        raise ValueError(
            f"w has a {granularity} group with amax(|w|) = {tiny:.3e}, so amax/448 underflows to 0 in fp32; "
            "rescale the weight (multiply by a power of two) before quantizing"
        )
    return np.where(group_amax == 0, np.float32(1.0), scale).astype(np.float32)


def _scale_shape(granularity: str, n: int, k: int) -> tuple[int, ...]:
    return {"tensor": (), "channel": (n,), "block": fp8_block_grid(n, k)}[granularity]


def _encode(w32: np.ndarray, scale: np.ndarray, granularity: str, quotient_dtype: str | None) -> FP8Weight:
    """codes = encode_e4m3(RN32(w / scale)) (rounded to quotient_dtype first if given); w32 is the caller's
    own float32 copy and is overwritten by the quotient."""
    n, k = w32.shape
    if quotient_dtype is not None:
        require_dtype(quotient_dtype)
    if granularity == "block" and n % FP8_BLOCK == 0 and k % FP8_BLOCK == 0:  # whole blocks: a broadcast view
        blocks = w32.reshape(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
        np.divide(blocks, scale[:, None, :, None], out=blocks)  # RN32, the same division per element
    else:
        divisor = {"tensor": lambda: scale.reshape(()), "channel": lambda: scale.reshape(n, 1),
                   "block": lambda: _expand_scale(scale, granularity, n, k)}[granularity]()
        np.divide(w32, divisor, out=w32)  # RN32
    if quotient_dtype == FP16:
        w32 = round_to(FP16, w32).astype(np.float32)  # exact widening: e4m3 of the fp16 value
    # = encode_e4m3(quotient), after round_to(BF16, .) for a bf16 quotient (ref/float_classes.py)
    return FP8Weight(weight=lookup_classes(w32, e4m3_table(quotient_dtype == BF16)), weight_scale=scale)


# ----------------------------------------------------------------------------- scales


def fp8_block_grid(n: int, k: int) -> tuple[int, int]:
    """Shape of the 128x128 block-scale grid of an [n, k] weight: (ceil(n/128), ceil(k/128))."""
    return (_ceil_div(n, FP8_BLOCK), _ceil_div(k, FP8_BLOCK))


def fp8_block_grid_4d(n: int, k: int) -> tuple[int, int, int, int]:
    """The same grid as ModelOpt 0.47 stores it (FP8_PB_WO): (ceil(n/128), 1, ceil(k/128), 1), same order."""
    rows, cols = fp8_block_grid(n, k)
    return (rows, 1, cols, 1)


def _size_one(shape: tuple[int, ...], n: int, k: int) -> bool:
    """A one-value scale shape: (), (1,), (1, 1), or ModelOpt's 4-D grid of a one-block weight."""
    return shape in ((), (1,), (1, 1)) or shape == fp8_block_grid_4d(n, k) == (1, 1, 1, 1)


def fp8_scale_granularity(weight_scale: npt.ArrayLike, n: int, k: int, granularity: str | None = None) -> str:
    """Granularity of an fp32 FP8 scale for an [n, k] weight: `granularity` when given (the shape
    must fit it, else ValueError), otherwise read from the shape.

    Shapes: () or (1,) -> "tensor"; (n,) or (n, 1) -> "channel"; (ceil(n/128), ceil(k/128)) or
    ModelOpt's (ceil(n/128), 1, ceil(k/128), 1) -> "block".

    The single-value rule, the one rule of qpn for a scale that holds ONE value ((), (1,), (1, 1),
    and (1, 1, 1, 1) for a one-block weight): it is the same weights at every granularity whose grid
    has one cell - per tensor always, per channel when n == 1, 128x128 block when the weight is one
    block (n <= 128, k <= 128). Unstated, it reads as "tensor" (the layout with the loosest
    alignment). Stated, the statement wins: a layer a checkpoint config (FP8_PB_WO) or a caller
    (`convert(..., fp8_granularity="block")`) calls block is block, in `qpn pack`, `pack_fp8`,
    `QPNLinear.from_linear` and `qpn8_prepack` alike (QPN8's block layout: N padded to 128, K % 128).
    """
    if granularity is not None and granularity not in FP8_GRANULARITIES:
        raise ValueError(f"granularity must be None or one of {FP8_GRANULARITIES}, got {granularity!r}")
    shape = tuple(np.shape(weight_scale))  # the shape only: any array type (numpy, CuPy) will do
    block_shape = fp8_block_grid(n, k)
    one_cell = {"tensor": True, "channel": n == 1, "block": block_shape == (1, 1)}
    if _size_one(shape, n, k):
        inferred = "tensor"
        fits = granularity is None or one_cell[granularity]
    elif shape in ((n,), (n, 1)):
        inferred, fits = "channel", granularity in (None, "channel")
    elif shape in (block_shape, fp8_block_grid_4d(n, k)):
        inferred, fits = "block", granularity in (None, "block")
    else:
        raise ValueError(
            f"weight_scale has shape {shape}, which fits no FP8 granularity for a [{n}, {k}] weight; "
            f"expected () / (1,) / (1, 1) for tensor, ({n},) or ({n}, 1) for channel, or {block_shape} for 128x128 "
            "block scales (ceil(N/128), ceil(K/128)); check that the weight is stored [N, K], not transposed"
        )
    if not fits:
        raise ValueError(
            f"weight_scale has shape {shape}, which does not fit granularity {granularity!r} for a [{n}, {k}] "
            f"weight (it reads as {inferred!r}); expected () / (1,) / (1, 1) for tensor, ({n},) or ({n}, 1) for "
            f"channel, or {block_shape} for 128x128 block scales"
        )
    return granularity or inferred


def fp8_scale_map(weight_scale: np.ndarray, n: int, k: int) -> np.ndarray:
    """float32 FP8 scale (any granularity, see `fp8_scale_granularity`) -> float32 [n, k], one per element.

    Validates the shape and that every scale is finite and > 0. Values are copied, never rounded.
    """
    granularity, scale = _validated_scale(weight_scale, n, k)
    return _expand_scale(scale, granularity, n, k)


def _validated_scale(weight_scale: np.ndarray, n: int, k: int) -> tuple[str, np.ndarray]:
    granularity = fp8_scale_granularity(weight_scale, n, k)
    scale = _as_float32_scale(weight_scale)
    require_positive_scale("weight_scale", scale)
    if granularity == "channel":
        scale = scale.reshape(n)
    elif granularity == "block":
        scale = scale.reshape(fp8_block_grid(n, k))  # ModelOpt's 4-D grid holds the values in the same order
    return granularity, scale


def _as_float32_scale(weight_scale: np.ndarray) -> np.ndarray:
    if isinstance(weight_scale, np.float32):
        weight_scale = np.asarray(weight_scale)
    return require_array("weight_scale", weight_scale, np.float32)


def _expand_scale(scale: np.ndarray, granularity: str, n: int, k: int) -> np.ndarray:
    if granularity == "tensor":
        return np.full((n, k), scale.reshape(()), dtype=np.float32)
    if granularity == "channel":
        return np.repeat(scale.reshape(n, 1), k, axis=1)
    rows = np.repeat(scale, FP8_BLOCK, axis=0)[:n]
    return np.repeat(rows, FP8_BLOCK, axis=1)[:, :k]


# ----------------------------------------------------------------------------- dequantize


def fp8_dequantize(weight: np.ndarray, weight_scale: np.ndarray) -> np.ndarray:
    """FP8 checkpoint tensors -> float16 [N, K] = RN16(RN32(e4m3(weight) * scale)).

    weight: uint8 e4m3 bits [N, K]; weight_scale: float32, granularity inferred from its shape
    (`fp8_scale_granularity`). Rejects e4m3 NaN bytes in weight, non-finite or non-positive
    scales, and scales whose largest weight RN16(RN32(448 * s)) would be inf.
    """
    weight = require_array("weight", weight, np.uint8, ndim=2)
    n, k = weight.shape
    if n == 0 or k == 0:
        raise ValueError(f"weight must have N, K >= 1, got shape {weight.shape}")
    granularity, scale = _validated_scale(weight_scale, n, k)
    require_no_nan_e4m3("weight", weight)
    with np.errstate(over="ignore"):  # an fp32 inf here is an answer (overflow), not an error
        over = np.float32(E4M3_MAX) * scale >= FP16_OVERFLOW_THRESHOLD  # RN32(448 * s) vs RN16's inf
    if over.any():
        first = tuple(int(i) for i in np.argwhere(over)[0])
        s = float(scale[first])
        raise ValueError(
            f"weight_scale{list(first)} = {s:g} ({granularity} scale; {int(over.sum())} of {scale.size} overflow) "
            f"lets a weight reach 448 * {s:g} = {448 * s:.6g}, beyond fp16's 65504; the fp16 contract cannot "
            "represent this layer: keep it in higher precision or re-quantize it with a smaller scale"
        )
    # every (scale, code) pair's RN16(RN32(e4m3 * s)), then one lookup per weight (ref/lookup.py)
    block_scales, block_rows, block_cols = _scale_blocks(scale, granularity, n, k)
    tables = (decode_e4m3(_ALL_CODES) * block_scales[..., None]).astype(np.float16)  # RN32, RN16
    return lookup_blocks(weight, tables, block_rows, block_cols)


def _scale_blocks(scale: np.ndarray, granularity: str, n: int, k: int) -> tuple[np.ndarray, int, int]:
    """(scales as a 2-D grid, rows and columns of the weight block each covers)."""
    if granularity == "tensor":
        return scale.reshape(1, 1), n, k
    if granularity == "channel":
        return scale.reshape(n, 1), 1, k
    return scale, FP8_BLOCK, FP8_BLOCK
