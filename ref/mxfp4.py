"""MXFP4 (OCP Microscaling Formats v1.0; gpt-oss ships its experts in it): the quantizer, the exact
dequantization, the W16 rule of qpn's kernels and the QPNMX layout (docs/QPNMX.md).

Encoding. Blocks of MX_BLOCK = 32 consecutive values along K share one e8m0 scale 2^(s - 127) (byte
0xFF: NaN; ref/codecs.py); each value is an e2m1 code. gpt-oss stores a weight [..., N, K] as

    blocks  uint8 [..., N, K/32, 16]   byte j of block b: element 32b + 2j (low nibble), 32b + 2j + 1 (high)
    scales  uint8 [..., N, K/32]       e8m0

so a row of blocks read flat is K/2 bytes in the nibble order of ModelOpt's NVFP4 weight_packed.
value = e2m1(code) * 2^(s - 127): exact in float64, and in float32 except {2, 3, 4, 6} * 2^127 (scale
byte 0xFE), which exceed float32 (inf there).

Quantizer (OCP v1.0, 6.3): per block, X = floor(log2(amax)) - 2 (2: e2m1's largest exponent) clamped to
e8m0's [-127, 127]; an all-zero block takes X = -127 (byte 0); codes = e2m1 round-half-even of w / 2^X,
saturating at +-6 (a block's amax / 2^X lies in [4, 8): the spec's clamp to the largest normal). -0.0
keeps its sign (code 8), as ml_dtypes' casts do.

W16 (what the kernels multiply; docs/DESIGN.md, "MXFP4 weight"). fp16 cannot hold e8m0's range (2^-127 ..
2^127), so each 32-row tile t factors out one power of two 2^T(t), applied in fp32 to the tile's sums
before the output's one RN16:

    T(t)     = max over the tile's scale bytes s of (s - 127) - W16_TOP_EXP       W16_TOP_EXP = 13
    W16[n,k] = RN16(value / 2^T(t)) = RN16(e2m1(code) * 2^F),  F = s - 127 - T(t) <= 13
    y[m,n]   = RN16(2^T(t) * sum_k x[m,k] * W16[n,k])

No overflow ever: |W16| <= 6 * 2^13 = 49152 < 65504 (and 6 * 2^14 would not fit). Exact, 2^T * W16 =
value, wherever F >= -23 (0.5 * 2^F and 1.5 * 2^F are then fp16 numbers): every block whose scale is
within 36 binades of its tile's largest. Below, one correct rounding into fp16's subnormals: a weight
moves by at most 2^T * 2^-25. The kernels get these bits from QPN2's decode with the block constant
{X, Y} = {2^F, 0} (fma(e, 2^F, 0) rounds once) where F >= -24, and QPN2's exact fp32 path below (2^F is
no fp16 there). NaN scale bytes have no W16 (ValueError). `mxfp4_linear` is the reference linear over
(W16, 2^T).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from .checks import require_array, require_no_nan_e8m0, require_shape
from .codecs import E8M0_BIAS, E8M0_NAN, decode_e2m1, encode_e2m1
from .dtypes import FP16
from .float_classes import e2m1_table, lookup_classes
from .formats import MX_BLOCK, QPNMX
from .geometry import TILE_N
from .linear import FP32_TRUNCATING_UNIT_ROUNDOFF, linear, linear_bounds
from .nvfp4 import pack_nibbles, unpack_nibbles
from .qpn2 import _lanes_to_rows, _require_buffer, _rows_to_lanes, qpn2_prepack, qpn2_unpack

E2M1_EMAX = 2  # e2m1's largest exponent: 6 = 1.5 * 2^2
E8M0_MIN_EXP, E8M0_MAX_EXP = -E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS  # -127 .. 127
W16_TOP_EXP = 13  # the largest F with 6 * 2^F <= 65504 (fp16's max)
W16_EXACT_EXP = -23  # the smallest F with 0.5 * 2^F and 1.5 * 2^F fp16 numbers (2^-24 is fp16's least)
W16_EXACT_SPAN = W16_TOP_EXP - W16_EXACT_EXP  # 36 binades below the tile's largest scale stay exact


class MXFP4Weight(NamedTuple):
    """One MXFP4 tensor in gpt-oss's layout."""

    blocks: np.ndarray  # uint8 [..., K/32, 16], two e2m1 codes a byte, the earlier element in the low nibble
    scales: np.ndarray  # uint8 [..., K/32], e8m0


# ----------------------------------------------------------------------------- encoding


def mxfp4_quantize(w: npt.ArrayLike) -> MXFP4Weight:
    """float weight [..., K] (K % 32 == 0, finite) -> MXFP4Weight under the OCP rule (module docstring)."""
    blocks = _weight_blocks(w)
    amax = np.abs(blocks).max(axis=-1)
    _, exponent = np.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1, exactly
    x = np.where(amax > 0, exponent.astype(np.int32) - 1 - E2M1_EMAX, E8M0_MIN_EXP)
    return _encode_blocks(blocks, np.clip(x, E8M0_MIN_EXP, E8M0_MAX_EXP))


def mxfp4_quantize_with_scales(w: npt.ArrayLike, scales: np.ndarray) -> MXFP4Weight:
    """float weight [..., K] (as `mxfp4_quantize` takes it) with the given e8m0 scale bytes [..., K/32]
    (0x00..0xFE; a scale search's): codes = e2m1 round-half-even of w / 2^(s - 127), saturating at +-6."""
    blocks = _weight_blocks(w)
    scales = require_array("scales", scales, np.uint8)
    require_shape("scales", scales, blocks.shape[:-1])
    require_no_nan_e8m0("scales", scales)
    return _encode_blocks(blocks, scales.astype(np.int32) - E8M0_BIAS)


def _weight_blocks(w: npt.ArrayLike) -> np.ndarray:
    """A validated weight as [..., K/32, 32] blocks: float32 for float32 / float16 / bfloat16-valued input
    (exact), float64 for wider input."""
    w = np.asarray(w)
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"w must be a floating-point array, got dtype {w.dtype}; MXFP4 quantizes real weights")
    if w.ndim < 1 or w.shape[-1] % MX_BLOCK or w.shape[-1] == 0:
        raise ValueError(f"w must have K % {MX_BLOCK} == 0 in its last dimension (one e8m0 scale per {MX_BLOCK} "
                         f"values), got shape {w.shape}; pad K with zero columns")
    if not np.isfinite(w).all():
        raise ValueError("w contains NaN or inf, which MXFP4 cannot represent; clean the tensor before quantizing")
    work = np.float32 if w.dtype.itemsize <= 4 else np.float64
    return w.astype(work, copy=False).reshape(*w.shape[:-1], -1, MX_BLOCK)


def _encode_blocks(blocks: np.ndarray, x: np.ndarray) -> MXFP4Weight:
    """Blocks [..., K/32, 32] with scale exponents X [..., K/32] (int, -127..127) -> MXFP4Weight."""
    # w / 2^X is exact but where a float32 result falls below 2^-126, far under e2m1's first midpoint 0.25,
    # where any rounding keeps code 0 and the sign (as float64 would); beyond 6 it saturates either way.
    # As a product with 2^-X (a float32 number for X in -127..127; 2^-127 is subnormal but exact): one correct
    # rounding of the same value as ldexp's, 4x faster than ldexp with a broadcast exponent
    scaled = blocks * np.ldexp(np.ones(x.shape, blocks.dtype), -x)[..., None]
    codes = (encode_e2m1(scaled) if scaled.dtype == np.float64
             else lookup_classes(scaled, e2m1_table()))  # = encode_e2m1(scaled) (ref/float_classes.py)
    packed = pack_nibbles(codes.reshape(*codes.shape[:-1], MX_BLOCK))
    return MXFP4Weight(packed, (x + E8M0_BIAS).astype(np.uint8))


def _require_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    blocks = require_array("blocks", blocks, np.uint8)
    scales = require_array("scales", scales, np.uint8)
    if blocks.ndim < 2 or blocks.shape[-1] != MX_BLOCK // 2:
        raise ValueError(f"blocks must be uint8 [..., K/32, 16] (gpt-oss's *_blocks), got shape {blocks.shape}")
    require_shape("scales", scales, blocks.shape[:-1])
    return blocks, scales


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [..., K]: every value exactly (NaN where the scale byte is 0xFF)."""
    blocks, scales = _require_mxfp4(blocks, scales)
    e2m1 = decode_e2m1(unpack_nibbles(blocks)).astype(np.float64)  # [..., K/32, 32]
    values = np.ldexp(e2m1, scales.astype(np.int64)[..., None] - E8M0_BIAS)
    values[scales == E8M0_NAN] = np.nan
    return values.reshape(*blocks.shape[:-2], -1)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray, nan: str = "nan") -> np.ndarray:
    """gpt-oss's (blocks, scales) -> float32 [..., K], every value exact (module docstring: the float32 range
    aside). Scale byte 0xFF: NaN values (nan="nan", as ml_dtypes' e8m0) or a ValueError (nan="raise")."""
    if nan not in ("nan", "raise"):
        raise ValueError(f"nan must be 'nan' or 'raise', got {nan!r}")
    values = mxfp4_values(blocks, scales)
    if nan == "raise":
        require_no_nan_e8m0("scales", np.asarray(scales))
    with np.errstate(over="ignore"):  # {2, 3, 4, 6} * 2^127 are inf in float32, as in any float32 decode
        return values.astype(np.float32)


# ----------------------------------------------------------------------------- W16


def mxfp4_tile_exponents(scales: np.ndarray) -> np.ndarray:
    """int64 [..., N/32]: T(t) = the tile's largest (s - 127) - W16_TOP_EXP, over scales [..., N, K/32]
    (N % 32 == 0; NaN bytes rejected)."""
    scales = require_array("scales", scales, np.uint8)
    if scales.ndim < 2 or scales.shape[-2] % TILE_N:
        raise ValueError(f"scales must be [..., N, K/32] with N % {TILE_N} == 0, got shape {scales.shape}; "
                         "pad the output features to whole 32-row tiles")
    require_no_nan_e8m0("scales", scales)
    tiles = scales.reshape(*scales.shape[:-2], -1, TILE_N * scales.shape[-1])
    return tiles.max(axis=-1).astype(np.int64) - E8M0_BIAS - W16_TOP_EXP


def mxfp4_w16(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss's (blocks [..., N, K/32, 16], scales [..., N, K/32]) -> (W16 float16 [..., N, K], tile_scale
    float32 [..., N/32] = 2^T): the contract's weight (module docstring). N % 32 == 0; NaN bytes rejected."""
    blocks, scales = _require_mxfp4(blocks, scales)
    t = mxfp4_tile_exponents(scales)
    f = scales.astype(np.int64) - E8M0_BIAS - np.repeat(t, TILE_N, axis=-1)[..., None]  # [..., N, K/32], >= -241
    e2m1 = decode_e2m1(unpack_nibbles(blocks)).astype(np.float64)
    w16 = np.ldexp(e2m1, f[..., None]).astype(np.float16)  # exact in float64, then one RN16
    return w16.reshape(*blocks.shape[:-2], -1), _tile_scale(t)


def _tile_scale(t: np.ndarray) -> np.ndarray:
    """float32 2^T (exact: T >= -140 is a float32 power of two, a subnormal below -126)."""
    return np.ldexp(np.float32(1.0), t).astype(np.float32)


def mxfp4_linear(x: np.ndarray, w16: np.ndarray, tile_scale: np.ndarray, *, dtype: str = FP16) -> np.ndarray:
    """The contract's linear for MXFP4: y = RN16(2^T(t) * sum_k x W16) (ref.linear with the tiles' 2^T as
    its column scale); x float16 [M, K], W16 [N, K], tile_scale float32 [N/32]. dtype: as ref.linear."""
    return linear(x, w16, column_scale=_column_scale(w16, tile_scale), dtype=dtype)


def mxfp4_linear_bounds(x: np.ndarray, w16: np.ndarray, tile_scale: np.ndarray,
                        unit_roundoff: float = FP32_TRUNCATING_UNIT_ROUNDOFF, *,
                        dtype: str = FP16) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi), float16 [M, N]: every fp32 accumulation of x @ w16.T in any order, times the tile's 2^T
    (exact), rounded once to fp16, lies in [lo, hi]: ref.linear_bounds with the tiles' 2^T. dtype: as there."""
    return linear_bounds(x, w16, unit_roundoff, column_scale=_column_scale(w16, tile_scale), dtype=dtype)


def _column_scale(w16: np.ndarray, tile_scale: np.ndarray) -> np.ndarray:
    """The tiles' 2^T, one per output row of w16 [N, K]."""
    tile_scale = require_array("tile_scale", tile_scale, np.float32, ndim=1)
    require_shape("tile_scale", tile_scale, (np.shape(w16)[0] // TILE_N,))
    return np.repeat(tile_scale, TILE_N)


# ----------------------------------------------------------------------------- the QPNMX layout


def qpnmx_prepack(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """gpt-oss's (blocks uint8 [N, K/32, 16], scales uint8 [N, K/32]) of one weight -> QPNMX (codes uint8
    [N, K/2] in QPN2's byte order, scales uint8 [N, K/32] in [tile][block][lane] order, tile_scale float32
    [N/32] = 2^T). N % 32 == 0, K % 64 == 0; NaN scale bytes rejected before any work. The codes and
    scales are byte permutations (exact inverse: `qpnmx_unpack`); tile_scale follows from the scales."""
    blocks = require_array("blocks", blocks, np.uint8, ndim=3)
    scales = require_array("scales", scales, np.uint8, ndim=2)
    _require_mxfp4(blocks, scales)
    n, k = blocks.shape[0], MX_BLOCK * blocks.shape[1]
    QPNMX.require_dims(n, k, f"blocks has shape {blocks.shape}", f"K = 32 * blocks.shape[1] = {k}")
    tile_scale = _tile_scale(mxfp4_tile_exponents(scales))
    # the codes are QPN2's: its prepack permutes nibbles only (its e4m3 scales here are placeholders)
    codes, _ = qpn2_prepack(blocks.reshape(n, k // 2), np.zeros((n, k // 16), np.uint8))
    return codes, _rows_to_lanes(scales).reshape(n, k // MX_BLOCK), tile_scale


def qpnmx_unpack(codes: np.ndarray, scales: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """QPNMX (codes, scales) of an [n, k] weight -> gpt-oss's (blocks [n, k/32, 16], scales [n, k/32]);
    exact inverse of `qpnmx_prepack`'s permutations (tile_scale is not needed: it follows from the scales)."""
    n, k = QPNMX.require_int_dims(n, k)
    codes = _require_buffer(QPNMX, "codes", codes, n, k)
    scales = _require_buffer(QPNMX, "scales", scales, n, k)
    rows, _ = qpn2_unpack(codes, np.zeros(n * k // 16, np.uint8), n, k)
    return (rows.reshape(n, k // MX_BLOCK, MX_BLOCK // 2),
            _lanes_to_rows(np.ascontiguousarray(scales).reshape(-1), n, k // MX_BLOCK))


def qpnmx_dequantize(codes: np.ndarray, scales: np.ndarray, tile_scale: np.ndarray, n: int, k: int) -> np.ndarray:
    """QPNMX buffers -> W16 float16 [n, k] under the contract (= mxfp4_w16 of the originals). tile_scale must
    be the one the scales give (2^T(t)): a buffer that disagrees is rejected, not reinterpreted."""
    blocks, raw_scales = qpnmx_unpack(codes, scales, n, k)
    tile_scale = require_array("tile_scale", tile_scale, np.float32, ndim=1)
    require_shape("tile_scale", tile_scale, QPNMX.buffer("tile_scale").shape(n, k))
    w16, want = mxfp4_w16(blocks, raw_scales)
    bad = np.flatnonzero(tile_scale.reshape(-1) != want)
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"tile_scale[{t}] = {float(tile_scale.reshape(-1)[t])!r} but the tile's scales give "
                         f"2^T = {float(want[t])!r} (T = largest e8m0 exponent - {W16_TOP_EXP}); re-run "
                         "qpnmx_prepack on the checkpoint's tensors")
    return w16
