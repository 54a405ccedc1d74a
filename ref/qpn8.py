"""QPN8: the FP8 (e4m3) decode layout (docs/QPN8.md), its exact inverse and its weight semantics.

Layout (N output features, K input features, T = N/32 tiles, G = K/16 groups; geometry = QPN2's):

    codes         uint8 [N, K]   flat ((t*G + g)*32 + lane)*16 + p holds the e4m3 byte
                                 W[32t + col(lane)][16g + KORDER[p]]
    group_scales  float16        channel / tensor: [1, N],         S16[0, n]  = RN16(256 * s[n])
                                 128x128 block:    [K/128, N/32],  S16[kb, t] = RN16(256 * s[t // 4, kb])
                                 group g of column n uses S16[0, n] (channel) or S16[g // 8, n // 32] (block)

    one lane's 16 bytes of one group:  p  0  1  2  3  4  5  6  7 | 8  9 10 11 12 13 14 15
                                       k  0  2  4  6  1  3  5  7 | 8 10 12 14  9 11 13 15
    bytes (i, 4+i) of each 8-byte half are the consecutive pair (2i, 2i+1): one half2.

Alignment: channel / tensor scales need N % 32 == 0 and K % 16 == 0; 128x128 block scales need
N % 128 == 0 and K % 128 == 0. The code permutation is the QPN2 one with 1-byte elements (16-byte
units gathered by the tile transpose, then two in-place delta swaps inside every 8 bytes).

Scale input (`qpn8_prepack`'s weight_scale, float32), the granularity read from the shape
(ref/fp8.py, `fp8_scale_granularity`, the one rule of qpn):
- size 1 ((), (1,), (1, 1)): per tensor, broadcast to every channel -> [1, N] layout;
- (N,) or (N, 1): per channel -> [1, N];
- (N/128, K/128) (or ModelOpt's (N/128, 1, K/128, 1)): 128x128 block -> [K/128, N/32].
`granularity=` ("tensor" | "channel" | "block") may always be given; the shape must then fit it.
A single 128x128 block (a one-value scale of a 128x128 weight) is numerically a per-tensor scale:
it reads as per tensor unless `granularity="block"` states it, and a stated block stays a block
(the [K/128, N/32] layout, the same S16 in every cell), whatever its size-1 shape.

Numerics policy
- S16 = RN16(256 * s): 256 * s is exact in float64, then one RNE cast to fp16 (subnormal S16
  kept: s < 2^-22 loses precision, s < 2^-33 gives 0, which only an all-zero channel survives).
- Contract weight (`qpn8_dequantize`): W16 = RN16(e4m3 * 2^-8 * S16), one rounding. The product
  is exact in float32 (at most 4 + 11 = 15 significant bits; |product| between 2^-41 and 2^17,
  inside fp32's normal range), then one RNE cast to fp16; evaluated once per S16 on all 256
  codes and looked up per weight (ref/lookup.py). The kernels' bit trick gives
  e4m3 * 2^-8 exactly as an fp16 (byte b -> bits ((b & 0x80) << 8) | ((b & 0x7F) << 7)), so one
  fp16 multiply by S16 reproduces this value.
- The checkpoint semantics RN16(RN32(e4m3 * s)) (`fp8_dequantize`) differ from the contract by
  at most one fp16 ulp, and only where RN16(256 * s) != 256 * s.
- NaN: e4m3 NaN bytes (0x7F / 0xFF) in the weight are rejected; so are non-finite and
  non-positive scales.
- Overflow (a rule on scales only, so a GPU prepack applies the same): rejected when S16 is inf
  (256 * s >= 65520) or when the largest weight RN16(448 * 2^-8 * S16) = RN16(1.75 * S16) is inf
  (S16 >= 37440, i.e. s >= 146.1875). Nothing saturates.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .checks import require_array, require_no_nan_e4m3, require_positive_scale
from .codecs import E4M3_MAX, decode_e4m3
from .formats import FP8_BLOCK, QPN8, QPN8_BLOCK, WeightFormat, weight_format
from .fp8 import _ALL_CODES, fp8_block_grid, fp8_scale_granularity
from .geometry import GROUP_K, TILE_N
from .lookup import lookup_blocks
from .qpn2 import _korder_shuffle, _korder_unshuffle, _lanes_to_rows, _require_buffer, _rows_to_lanes

QPN8_SCALE_FACTOR = 256.0  # S16 = RN16(256 * s) undoes the bit trick's 2^-8
QPN8_MAX_WEIGHT_FACTOR = E4M3_MAX / QPN8_SCALE_FACTOR  # 448 * 2^-8 = 1.75, exact

_UNIT = np.dtype("V16")  # one lane's 16 bytes of one group, moved as raw bytes
_U64 = np.dtype("<u8")


def qpn8_scale_granularity(weight_scale: npt.ArrayLike, n: int, k: int, granularity: str | None = None) -> str:
    """The granularity QPN8 reads from a float32 scale of an [n, k] weight (module docstring).

    `fp8_scale_granularity`'s rule, single-value scales included (per tensor unless `granularity`
    states another granularity that has one cell, e.g. "block" for a one-block weight), plus the
    QPN8 alignment rules (channel / tensor: N % 32, K % 16; block: N % 128, K % 128).
    """
    granularity = fp8_scale_granularity(weight_scale, n, k, granularity)
    weight_format(QPN8.format, granularity).require_dims(n, k)
    return granularity


def _s16_of_scale(scale: np.ndarray) -> np.ndarray:
    """fp32 scales (validated finite, > 0) -> S16 = RN16(256 * s) (256 * s exact in float64)."""
    with np.errstate(over="ignore"):  # inf is judged by _require_s16_fits_fp16
        return (scale.astype(np.float64) * QPN8_SCALE_FACTOR).astype(np.float16)


def _largest_weight(s16: np.ndarray) -> np.ndarray:
    """RN16(448 * 2^-8 * S16): the largest |W16| a group can produce (1.75 * S16 exact in float64)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (s16.astype(np.float64) * QPN8_MAX_WEIGHT_FACTOR).astype(np.float16)


def _require_s16_fits_fp16(name: str, s16: np.ndarray, scale: np.ndarray | None = None) -> None:
    largest = _largest_weight(s16)
    bad = ~np.isfinite(largest)  # also catches S16 = inf
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        what = f"{name}{list(first)} = {float(scale[first]):g} gives S16 = RN16(256 * s) = {float(s16[first]):g}" \
            if scale is not None else f"{name}{list(first)} = {float(s16[first]):g}"
        raise ValueError(
            f"{what}, and the largest weight RN16(448 * 2^-8 * S16) is inf in fp16 ({int(bad.sum())} scales "
            "overflow; s must stay below 146.1875); the fp16 contract cannot represent this layer: keep it in "
            "higher precision or re-quantize it with a smaller scale"
        )


def require_qpn8_fits_fp16(weight_scale: np.ndarray, name: str = "weight_scale") -> None:
    """ValueError when a float32 FP8 scale gives S16 = RN16(256 * s), or a weight, beyond fp16.

    The scale-only overflow rule of `qpn8_prepack` (codes never matter), for callers that check
    layers before packing them (`qpn inspect`, `qpn pack`).
    """
    scale = require_array(name, np.asarray(weight_scale), np.float32)
    _require_s16_fits_fp16(name, _s16_of_scale(scale), scale)


# ----------------------------------------------------------------------------- layout


def _group_scales_of_s16(s16: np.ndarray, granularity: str, n: int) -> np.ndarray:
    if granularity == "block":
        return np.ascontiguousarray(np.repeat(s16.T, FP8_BLOCK // TILE_N, axis=1))  # [K/128, N/32] = s16[t//4, kb]
    return np.broadcast_to(s16.reshape(-1), (n,)).reshape(1, n).copy()  # [1, N]


def qpn8_group_scales(weight_scale: np.ndarray, n: int, k: int, granularity: str | None = None) -> np.ndarray:
    """The group_scales `qpn8_prepack` returns for this scale, without touching a weight (cheap:
    for checking a packed layer's scales against its fp32 scale). Same rules and errors."""
    if isinstance(weight_scale, np.float32):
        weight_scale = np.asarray(weight_scale)
    scale = require_array("weight_scale", weight_scale, np.float32)
    granularity = qpn8_scale_granularity(scale, n, k, granularity)
    if granularity == "block":
        scale = scale.reshape(fp8_block_grid(n, k))  # ModelOpt's [N/128, 1, K/128, 1]: same values, same order
    require_positive_scale("weight_scale", scale)
    s16 = _s16_of_scale(scale)
    _require_s16_fits_fp16("weight_scale", s16, scale)
    return _group_scales_of_s16(s16, granularity, n)


def qpn8_prepack(weight: np.ndarray, weight_scale: np.ndarray,
                 granularity: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """FP8 checkpoint tensors -> QPN8 (codes, group_scales).

    weight: uint8 e4m3 bits [N, K]; weight_scale: float32, per tensor (size 1), per channel
    ((N,) or (N, 1)) or 128x128 block ((N/128, K/128)); see the module docstring for the shape
    rule and `granularity`. Returns codes uint8 [N, K] in QPN8 byte order and group_scales
    float16 [1, N] (tensor / channel) or [K/128, N/32] (block). Rejects NaN weight bytes,
    non-finite or non-positive scales and scales that overflow fp16 (module docstring).
    Exact inverse of the code permutation: `qpn8_unpack`.
    """
    weight = require_array("weight", weight, np.uint8, ndim=2)
    n, k = weight.shape
    group_scales = qpn8_group_scales(weight_scale, n, k, granularity)  # scale errors before weight errors
    require_no_nan_e4m3("weight", weight)

    units = np.ascontiguousarray(weight).view(_UNIT)  # [N, G]: one lane-group of 16 bytes per unit
    codes = _rows_to_lanes(units).view(np.uint8).reshape(-1)  # a fresh array
    _korder_unshuffle(codes.view(_U64), 8)
    return codes.reshape(n, k), np.ascontiguousarray(group_scales)


def qpn8_group_scales_format(shape: tuple[int, ...], n: int, k: int) -> WeightFormat:
    """Which QPN8 layout fp16 group scales of `shape` are for an [n, k] weight: QPN8 ([1, N], channel /
    tensor scales) or formats.QPN8_BLOCK ([K/128, N/32]). Reads the shape only, so the CuPy wrappers
    ask the same rule. The block layout itself needs only whole tiles (N % 32), not whole blocks."""
    shape = tuple(shape)
    if shape == QPN8.buffer("group_scales").shape(n, k):
        QPN8.require_dims(n, k)
        return QPN8
    block_shape = QPN8_BLOCK.buffer("group_scales").shape(n, k)
    if k % FP8_BLOCK == 0 and n % TILE_N == 0 and shape == block_shape:
        return QPN8_BLOCK
    raise ValueError(
        f"group_scales must be float16 [1, {n}] (channel / tensor) or [K/128, N/32] = "
        f"[{block_shape[0]}, {block_shape[1]}] (128x128 block, needs K % 128 == 0 and N % 32 == 0) for a "
        f"[{n}, {k}] weight, got shape {shape}; pass what qpn8_prepack returned"
    )


def _group_scales_format(group_scales: np.ndarray, n: int, k: int) -> WeightFormat:
    group_scales = require_array("group_scales", group_scales, QPN8.buffer("group_scales").dtype, ndim=2)
    return qpn8_group_scales_format(group_scales.shape, n, k)


def _s16_map(group_scales: np.ndarray, wf: WeightFormat, n: int, k: int) -> np.ndarray:
    groups = k // GROUP_K
    if wf is QPN8:
        return np.repeat(group_scales.reshape(n, 1), groups, axis=1)
    per_tile_block = group_scales.T  # [N/32, K/128]
    rows = np.repeat(per_tile_block, TILE_N, axis=0)  # [N, K/128]
    return np.repeat(rows, FP8_BLOCK // GROUP_K, axis=1)  # [N, G]


def qpn8_unpack(codes: np.ndarray, group_scales: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """QPN8 (codes, group_scales) of an [n, k] weight -> (weight, s16_map).

    codes: uint8 [n, k] or flat [n*k]; group_scales: float16 [1, n] or [k/128, n/32].
    Returns weight uint8 e4m3 bits [n, k] (exact inverse of `qpn8_prepack`'s permutation) and
    s16_map float16 [n, k/16]: the fp16 scale S16 that the kernels apply to group g of row n
    (S16[0, n] for channel scales, S16[g // 8, n // 32] for block scales). No value is judged
    here (`qpn8_dequantize` does that); the original fp32 scales cannot be recovered.
    """
    n, k = QPN8.require_int_dims(n, k)
    codes = _require_buffer(QPN8, "codes", codes, n, k)
    wf = _group_scales_format(group_scales, n, k)

    units = np.ascontiguousarray(codes).reshape(-1).view(_UNIT)
    rows = _lanes_to_rows(units, n, k // GROUP_K).view(np.uint8).reshape(-1)  # a fresh array
    _korder_shuffle(rows.view(_U64), 8)
    return rows.reshape(n, k), _s16_map(group_scales, wf, n, k)


def _require_group_scale_values(s16: np.ndarray) -> None:
    bad = ~(np.isfinite(s16) & ~np.signbit(s16))
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"group_scales must be finite and >= 0, got {s16[first]} at index {list(first)}; "
            "pass what qpn8_prepack returned"
        )
    _require_s16_fits_fp16("group_scales", s16)


def qpn8_dequantize(codes: np.ndarray, group_scales: np.ndarray, n: int, k: int) -> np.ndarray:
    """QPN8 buffers -> float16 [n, k] under the contract W16 = RN16(e4m3 * 2^-8 * S16).

    Rejects NaN code bytes (0x7F / 0xFF), negative or non-finite S16 and S16 whose largest
    weight RN16(1.75 * S16) is inf. The product is exact in float32 (module docstring).
    """
    n, k = QPN8.require_int_dims(n, k)
    codes = _require_buffer(QPN8, "codes", codes, n, k)
    _group_scales_format(group_scales, n, k)
    _require_group_scale_values(group_scales)
    require_no_nan_e4m3("codes", codes)
    weight, _ = qpn8_unpack(codes, group_scales, n, k)
    return _contract_lookup(weight, group_scales, n, k)


def qpn8_dequantize_unpacked(weight: np.ndarray, group_scales: np.ndarray, n: int, k: int) -> np.ndarray:
    """`qpn8_dequantize` of the bytes `qpn8_unpack` gave back, without permuting them again.

    weight: uint8 e4m3 bits [rows, k], rows <= n, row r = the unpacked weight's row r (`qpn verify`
    passes the unpacked layer with its pad rows cropped); group_scales: float16, as for
    `qpn8_dequantize` of an [n, k] weight. Returns float16 [rows, k], byte for byte the first
    rows of `qpn8_dequantize(codes, group_scales, n, k)`; same rejections.
    """
    n, k = QPN8.require_int_dims(n, k)
    weight = require_array("weight", weight, np.uint8, ndim=2)
    if weight.shape[0] > n or weight.shape[1] != k:
        raise ValueError(f"weight must be uint8 [rows <= {n}, {k}] (qpn8_unpack's weight, pad rows cropped or "
                         f"not), got shape {weight.shape}")
    _group_scales_format(group_scales, n, k)
    _require_group_scale_values(group_scales)
    require_no_nan_e4m3("weight", weight)
    return _contract_lookup(weight, group_scales, n, k)


def _contract_lookup(weight: np.ndarray, s16: np.ndarray, n: int, k: int) -> np.ndarray:
    """Row-major e4m3 bytes [rows <= n, k] -> RN16(e4m3 * 2^-8 * S16): one table row per S16 (per
    channel, or per 32-row tile x 128 columns), then a lookup per weight."""
    if _group_scales_format(s16, n, k) is QPN8:
        block_s16, block_rows, block_cols = s16.reshape(n, 1), 1, k
    else:
        block_s16, block_rows, block_cols = s16.T, TILE_N, FP8_BLOCK  # [N/32, K/128]
    scale = block_s16.astype(np.float32) * np.float32(2.0**-8)  # exact: power-of-two scaling, fp32 normal
    tables = (decode_e4m3(_ALL_CODES) * scale[..., None]).astype(np.float16)  # exact fp32 product, one RN16
    return lookup_blocks(weight, tables, block_rows, block_cols)
