"""Scale search (`qpn quantize --method mse`): each group's scale chosen to minimise its squared error.

The formats, the codes' rounding and every decoder stay as they are (ref/nvfp4.py, ref/fp8.py): only
the scale a group is given differs from round-to-nearest's (RTN, the producers' amax rule), so any
reader decodes the result unchanged. The error of a group is sum (w - value)^2 in float64, value the
checkpoint-semantics fp32 decode (NVFP4: RN32(e2m1 * RN32(e4m3 * g)); FP8: RN32(e4m3 * s)).

- NVFP4: the global scale stays ModelOpt's amax / 2688 (or the one given: a fused group's shared
  scale). Each 16-element block tries its RTN e4m3 scale byte and the bytes NVFP4_BYTE_OFFSETS away
  (one byte = one step of e4m3's grid, 1/8 of a binade or less; a smaller scale clips the block's
  largest weight to 6 * scale, a larger one puts its small weights on e2m1's finer steps), within
  0x01..0x7E. A searched block scale is no longer amax / 6, so a reader that assumes it is (none does)
  would be wrong; the global scale is unchanged: e4m3's grid is the same in every binade, so another
  global scale only moves the grid by a fraction of a step (on SmolLM2-135M the best of amax / 2688 *
  2^(j/8), j = 0..8, each with this block search, changed the squared error by < 0.1 %).
- FP8: each group (the tensor, a row, a 128x128 block) tries RTN's scale amax / 448 times
  FP8_SCALE_FACTORS (fp32 products: any fp32 value is a storable scale). A tensor's error is the sum
  of its rows' sums, so a streaming caller judges a weight slice by slice (`fp8_tensor_row_errors`).
- MXFP4: each 32-element block tries its OCP e8m0 scale byte and the bytes MXFP4_EXPONENT_OFFSETS away
  (within 0x00..0xFE); the error is exact (float64 values, `mxfp4_values`).
- Candidates are tried in order, RTN's first, and a block keeps an earlier candidate on a tie, so no
  group's error exceeds RTN's: the search can only win.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np

from .codecs import decode_e2m1, decode_e4m3
from .float_classes import e2m1_table, lookup_classes
from .formats import FP8_BLOCK
from .fp8 import FP8Weight, fp8_block_grid, fp8_quantize, fp8_scale_map
from .mxfp4 import MXFP4Weight, mxfp4_quantize, mxfp4_quantize_with_scales, mxfp4_values
from .nvfp4 import NVFP4_BLOCK, NVFP4Weight, nvfp4_quantize

# RTN's byte first. Measured on random 1024 x 2048 weights (normal; Student-t, 5 dof): among offsets -3..+8,
# blocks chose -1..+1 (about 60 %) and +4 / +5 (about 30 %: the block's largest weight lands near 4 instead of
# 6, which puts the rest on e2m1's finer half); these five reach 0.74 / 0.80 of RTN's squared error, all
# twelve 0.73 / 0.79 at twice the time. On SmolLM2-135M's linears (tests/real_model.py) they reach 0.710 of
# RTN's squared error, and -2..+6 (every byte any block chose among -8..+16: the blocks' exact optimum) 0.700,
# yet the perplexity over tests/data/alice_ch1_2.txt was no better (fp16 24.346, RTN 31.334; these five 29.852,
# -2..+6 29.996, 0..+6 29.849): the weights' squared error stops predicting the model's loss at this level.
NVFP4_BYTE_OFFSETS = (0, -1, 1, 4, 5)
FP8_SCALE_FACTORS = (1.0, 0.96875, 0.9375, 0.90625, 0.875)
# RTN's e8m0 exponent first, then twice it (the OCP rule puts a block's amax in [4, 8) * 2^X, so amax beyond 6
# saturates: +1 stops that) and half it (more saturation, finer steps for the rest)
MXFP4_EXPONENT_OFFSETS = (0, 1, -1)  # 1 - j/32: RTN first, then finer grids that clip
_E4M3_SMALLEST_BYTE, _E4M3_LARGEST_BYTE = 0x01, 0x7E  # positive finite e4m3 scales (0x7F is NaN)
_SEARCH_BLOCKS = 1024  # blocks per chunk of the NVFP4 search: 64 KiB of float32 weights
E8M0_LARGEST_BYTE = 0xFE  # 2^127 (0xFF is NaN)


def _squared_error(w64: np.ndarray, values: np.ndarray) -> np.ndarray:
    """float64 (w - values)^2 elementwise: w64 the fp32 weights in float64, values fp32: the difference exact."""
    diff = w64 - values
    diff *= diff
    return diff


def nvfp4_quantize_mse(w: np.ndarray, weight_scale_2: float | np.floating | None = None) -> NVFP4Weight:
    """float32/float16 weight [N, K] -> NVFP4Weight whose block scales minimise each block's squared error
    (module docstring); weight_scale_2 as `nvfp4_quantize` takes it (None: ModelOpt's amax / 2688)."""
    rtn = nvfp4_quantize(w, weight_scale_2)
    g = np.float32(rtn.weight_scale_2)
    blocks = np.asarray(w, dtype=np.float32).reshape(-1, NVFP4_BLOCK)
    rtn_scale = rtn.weight_scale.reshape(-1)
    best_scale = np.empty_like(rtn_scale)
    # Chunks of _SEARCH_BLOCKS blocks, every candidate on one chunk before the next: its float32 / float64
    # copies and the temporaries stay in L2 (whole 2^18-value slices measured 1.6x slower).
    for start in range(0, len(rtn_scale), _SEARCH_BLOCKS):
        chunk = slice(start, start + _SEARCH_BLOCKS)
        best_scale[chunk] = _nvfp4_best_scales(blocks[chunk], rtn_scale[chunk], g)
    return nvfp4_quantize(w, g, best_scale.reshape(rtn.weight_scale.shape))


def _nvfp4_best_scales(blocks: np.ndarray, rtn_scale: np.ndarray, g: np.float32) -> np.ndarray:
    """uint8 [B]: for float32 blocks [B, 16] and their RTN e4m3 bytes [B], the candidate byte of least squared
    error (NVFP4_BYTE_OFFSETS in order, strict <: RTN's on a tie). Each candidate runs `nvfp4_quantize`'s
    steps 3-4 and the decode RN32(e2m1 * RN32(e4m3 * g)) without packing (the class table gives the e2m1
    value itself); the chosen bytes then go through `nvfp4_quantize` once."""
    blocks64 = blocks.astype(np.float64)
    best_scale, best_error = rtn_scale, None
    for offset in NVFP4_BYTE_OFFSETS:
        candidate = np.clip(rtn_scale.astype(np.int16) + offset, _E4M3_SMALLEST_BYTE,
                            _E4M3_LARGEST_BYTE).astype(np.uint8)
        multiplier = (decode_e4m3(candidate) * g)[:, None]  # RN32, [B, 1]
        scaled = blocks / multiplier
        scaled += np.float32(0.0)  # -0.0 -> +0.0, as nvfp4_quantize's step 4
        values = lookup_classes(scaled, _e2m1_value_table())
        values *= multiplier  # RN32
        error = _squared_error(blocks64, values).sum(axis=-1)
        if best_error is None:
            best_error = error
            continue
        wins = error < best_error  # strict: a tie keeps the earlier candidate (RTN's first)
        best_error = np.where(wins, error, best_error)
        best_scale = np.where(wins, candidate, best_scale)
    return best_scale


@cache
def _e2m1_value_table() -> np.ndarray:
    """float32 [CLASS_COUNT]: the e2m1 value each float32 class encodes to (`e2m1_table`'s codes, decoded; NaN
    for NaN classes, which a finite weight over a positive scale never reaches)."""
    codes = e2m1_table()
    return np.where(codes <= 0xF, decode_e2m1(codes & 0xF), np.float32(np.nan)).astype(np.float32)


def fp8_quantize_mse(w: np.ndarray, granularity: str, quotient_dtype: str | None = None) -> FP8Weight:
    """float32/float16 weight [N, K] -> FP8Weight whose group scales minimise each group's squared error
    (module docstring); granularity and quotient_dtype as `fp8_quantize` takes them."""
    rtn = fp8_quantize(w, granularity, quotient_dtype=quotient_dtype)
    w32 = np.asarray(w, dtype=np.float32)
    n, k = w32.shape
    w64 = w32.astype(np.float64)  # once: every candidate's error takes it
    best, best_error = rtn, None
    for factor, scale in zip(FP8_SCALE_FACTORS, fp8_scale_candidates(rtn.weight_scale), strict=True):
        candidate = rtn if factor == 1.0 else fp8_quantize(w32, granularity, scale, quotient_dtype)
        values = decode_e4m3(candidate.weight) * fp8_scale_map(candidate.weight_scale, n, k)  # RN32
        error = _group_sums(_squared_error(w64, values), granularity)
        if best_error is None:
            best_error = error
            continue
        wins = error < best_error
        best_error = np.where(wins, error, best_error)
        best = FP8Weight(np.where(_group_mask(wins, granularity, n, k), candidate.weight, best.weight),
                         np.where(wins, candidate.weight_scale, best.weight_scale).astype(np.float32))
    return best


def mxfp4_quantize_mse(w: np.ndarray) -> MXFP4Weight:
    """float weight [..., K] -> MXFP4Weight whose e8m0 block scales minimise each block's squared error
    (module docstring); w as `mxfp4_quantize` takes it."""
    rtn = mxfp4_quantize(w)
    w64 = np.asarray(w, dtype=np.float64)
    best, best_error = rtn, None
    for offset in MXFP4_EXPONENT_OFFSETS:
        if offset == 0:
            candidate = rtn
        else:
            shifted = np.clip(rtn.scales.astype(np.int16) + offset, 0, E8M0_LARGEST_BYTE).astype(np.uint8)
            candidate = mxfp4_quantize_with_scales(w, shifted)
        values = mxfp4_values(candidate.blocks, candidate.scales)  # float64, exact
        error = _squared_error(w64, values).reshape(*candidate.scales.shape, -1).sum(axis=-1)
        if best_error is None:
            best_error = error
            continue
        wins = error < best_error  # strict: a tie keeps the earlier candidate (RTN's first)
        best_error = np.where(wins, error, best_error)
        best = MXFP4Weight(np.where(wins[..., None], candidate.blocks, best.blocks),
                           np.where(wins, candidate.scales, best.scales))
    return best


def fp8_scale_candidates(rtn_scale: np.ndarray) -> list[np.ndarray]:
    """The scales `fp8_quantize_mse` tries for groups whose RTN scale is rtn_scale, in order: RN32(scale * f)."""
    return [(rtn_scale * np.float32(factor)).astype(np.float32) for factor in FP8_SCALE_FACTORS]


def fp8_tensor_row_errors(w: np.ndarray, scales: Sequence[np.ndarray], quotient_dtype: str | None = None
                          ) -> np.ndarray:
    """float64 [len(scales), N]: each row's squared error under each per-tensor scale. The tensor's error is
    the sum of its rows' (`_group_sums`), so rows of a weight may be judged slice by slice and their sums
    joined: the first scale whose error is least is `fp8_quantize_mse`'s ("tensor")."""
    w32 = np.asarray(w, dtype=np.float32)
    w64 = w32.astype(np.float64)
    return np.stack([_squared_error(w64, decode_e4m3(fp8_quantize(w32, "tensor", scale, quotient_dtype).weight)
                                    * scale).sum(axis=1) for scale in scales])  # RN32 values, as fp8_scale_map's


def _group_sums(values: np.ndarray, granularity: str) -> np.ndarray:
    """Sums of [N, K] `values` per scale group, in the scale's shape (ragged 128x128 blocks: what is there)."""
    n, k = values.shape
    if granularity == "tensor":
        return values.sum(axis=1).sum()  # the rows' sums, summed (fp8_tensor_row_errors)
    if granularity == "channel":
        return values.sum(axis=1)
    rows, cols = fp8_block_grid(n, k)
    padded = np.zeros((rows * FP8_BLOCK, cols * FP8_BLOCK), values.dtype)  # zeros add nothing
    padded[:n, :k] = values
    return padded.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK).sum(axis=(1, 3))


def _group_mask(wins: np.ndarray, granularity: str, n: int, k: int) -> np.ndarray:
    """bool [N, K]: each element takes its group's `wins` (the inverse layout of `_group_sums`)."""
    if granularity == "tensor":
        return np.broadcast_to(wins, (n, k))
    if granularity == "channel":
        return np.broadcast_to(wins[:, None], (n, k))
    return np.repeat(np.repeat(wins, FP8_BLOCK, axis=0)[:n], FP8_BLOCK, axis=1)[:, :k]


__all__ = ["FP8_SCALE_FACTORS", "MXFP4_EXPONENT_OFFSETS", "NVFP4_BYTE_OFFSETS", "fp8_quantize_mse",
           "fp8_scale_candidates", "fp8_tensor_row_errors", "mxfp4_quantize_mse", "nvfp4_quantize_mse"]
