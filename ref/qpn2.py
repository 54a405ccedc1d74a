"""QPN2: the NVFP4 decode layout (docs/QPN2.md), its exact inverse and its weight semantics.

Layout (N output features, K input features, T = N/32 tiles, G = K/16 groups):

    codes   uint8 [N, K/2]   bytes in QPN2 order; only the byte order matters. Flat byte
                             ((t*G + g)*32 + lane)*8 + b holds, for n = 32t + col(lane),
                                 low nibble  = code(n, 16g + KORDER[2b])
                                 high nibble = code(n, 16g + KORDER[2b+1])
    scales  uint8 [N, K/16]  raw e4m3 bytes in [tile][group][lane] order:
                             flat (t*G + g)*32 + lane holds weight_scale[32t + col(lane), g]

    one lane's 8 bytes of one group (k = index inside the group, low nibble first):

        byte     0      1      2      3      4       5       6       7
        low     k0     k4     k1     k5     k8      k12     k9      k13
        high    k2     k6     k3     k7     k10     k14     k11     k15

    so nibble i and nibble i+4 of each little-endian 32-bit word hold the pair (k, k+1).

Alignment: N % 32 == 0 (QPNLinear pads N and crops the output) and K % 64 == 0 (pad K with
zero columns). Everything here is a byte permutation: no rounding anywhere in the layout.

How the permutation is computed (no loops, uint64 and uint8 only):
- a ModelOpt row holds group g of row n as 8 contiguous bytes = one little-endian uint64 whose
  nibble j is k = j. Writing col = 8*c_hi + 4*c_mid + c_lo, the lane is 16*c_mid + 4*c_hi + c_lo,
  so the tile gather `lane <- col(lane)` is the axis transpose [T, c_hi, c_mid, c_lo, G] ->
  [T, G, c_mid, c_hi, c_lo] (one contiguous copy of 8-byte units; scales use the same transpose
  on 1-byte units).
- inside each uint64, KORDER (nibble j <- k_of_position(j)) is a perfect unshuffle of the 8
  nibbles of each 32-bit half, done in place with two delta swaps (swap nibbles 1<->2 of every
  16 bits, then bytes 1<->2 of every 32 bits). The inverse applies the two swaps in reverse.
Both factorizations are checked against `geometry` when this module is imported.

Weight semantics
- `qpn2_dequantize` is the contract, and by construction the same function as the checkpoint
  path: nvfp4_dequantize(*qpn2_unpack(...), global_scale), i.e.
  W16 = RN16(RN32(e2m1 * RN32(e4m3 * g(n)))), code 8 -> -0.0, NaN scale bytes and blocks that
  would overflow fp16 rejected (see ref/nvfp4.py).
- `qpn2_dequantize_variant_p` and `qpn2_dequantize_variant_e` reproduce upstream's two decode
  roundings for measurement only (docs/QPN2.md, "How upstream's decode kernels round"). They keep
  overflow visible as inf (and 0 * inf as NaN, as an fp16 multiply does) instead of rejecting it.
  NaN scale bytes are still rejected (those are corrupt input, not an overflow).
- Subnormals: kept everywhere (no flush to zero); numpy's float64 -> float16 cast is one
  correctly rounded RNE step, used only on exact float64 values.
"""

from __future__ import annotations

import numpy as np

from .checks import require_array, require_buffer_shape, require_multiple, require_no_nan_e4m3, require_shape
from .codecs import decode_e2m1, decode_e4m3
from .formats import QPN2, WeightFormat
from .geometry import COLUMN_OF_LANE, GROUP_K, KORDER, TILE_N
from .global_scale import global_scale_per_row
from .nvfp4 import nvfp4_dequantize, unpack_nibbles

QPN2_BYTES_PER_LANE_GROUP = GROUP_K // 2  # 8 bytes = 16 nibbles = one uint64

_U64 = np.dtype("<u8")  # explicit little-endian: byte 0 of a group is the low byte everywhere

# Tile gather as an axis transpose: a row-major [T, 32 columns, ...] array reshaped to
# [T, c_hi 4, c_mid 2, c_lo 4, G, ...] (col = 8*c_hi + 4*c_mid + c_lo) and transposed to
# [T, G, c_mid, c_hi, c_lo, ...] puts column col(lane) at lane = 16*c_mid + 4*c_hi + c_lo.
_TILE_SPLIT = (4, 2, 4)
_ROWS_TO_LANES = (0, 4, 2, 1, 3)
_LANES_TO_ROWS = tuple(int(i) for i in np.argsort(_ROWS_TO_LANES))  # (0, 3, 2, 4, 1)

if not np.array_equal(np.arange(TILE_N).reshape(_TILE_SPLIT).transpose(1, 0, 2).ravel(), COLUMN_OF_LANE):
    raise AssertionError("QPN2 tile transpose disagrees with geometry.COLUMN_OF_LANE")


# ----------------------------------------------------------------------------- shared helpers
# (qpn8.py uses these too: QPN8 has the same geometry with 1-byte elements.)


def _rows_to_lanes(a: np.ndarray) -> np.ndarray:
    """[N, G, *unit] -> contiguous [N/32, G, 32, *unit] with [t, g, lane] = a[32t + col(lane), g]."""
    n, g = a.shape[:2]
    unit = a.shape[2:]
    split = a.reshape((n // TILE_N, *_TILE_SPLIT, g, *unit))
    axes = _ROWS_TO_LANES + tuple(range(5, 5 + len(unit)))
    return np.ascontiguousarray(split.transpose(axes)).reshape((n // TILE_N, g, TILE_N, *unit))


def _lanes_to_rows(b: np.ndarray, n: int, g: int) -> np.ndarray:
    """Inverse of `_rows_to_lanes`: [N/32 * G * 32, *unit] (any leading shape) -> contiguous [N, G, *unit]."""
    unit = b.shape[1:] if b.ndim > 1 else ()
    split = b.reshape((n // TILE_N, g, 2, 4, 4, *unit))
    axes = _LANES_TO_ROWS + tuple(range(5, 5 + len(unit)))
    return np.ascontiguousarray(split.transpose(axes)).reshape((n, g, *unit))


def _delta_swap(words: np.ndarray, shift: int, mask: int) -> None:
    """In place: swap the bit fields `mask` and `mask << shift` of every uint64 (an involution)."""
    s, m = np.uint64(shift), np.uint64(mask)
    t = words >> s
    t ^= words
    t &= m
    words ^= t
    t <<= s
    words ^= t


def _replicate(pattern: int, period_bits: int) -> int:
    return sum(pattern << (i * period_bits) for i in range(64 // period_bits))


def _korder_masks(element_bits: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Delta swaps that unshuffle the 8 elements of every 8-element word inside a uint64.

    Elements [0..7] -> [0,2,4,6,1,3,5,7]: first swap elements 1<->2 of every 4, then the
    element pairs (2,3)<->(4,5) of every 8. element_bits = 4 (QPN2 nibbles) or 8 (QPN8 bytes):
      nibbles: shift 4, mask 0x00F000F000F000F0 (nibble 1 of every 16 bits);
               shift 8, mask 0x0000FF000000FF00 (byte 1 of every 32 bits)
      bytes:   shift 8, mask 0x0000FF000000FF00;  shift 16, mask 0x00000000FFFF0000
    """
    e = element_bits
    first = (e, _replicate(((1 << e) - 1) << e, 4 * e))
    second = (2 * e, _replicate(((1 << 2 * e) - 1) << 2 * e, 8 * e))
    return first, second


def _korder_unshuffle(words: np.ndarray, element_bits: int) -> None:
    """In place: element j of each 16-element group (within uint64 words) <- element KORDER[j]."""
    for shift, mask in _korder_masks(element_bits):
        _delta_swap(words, shift, mask)


def _korder_shuffle(words: np.ndarray, element_bits: int) -> None:
    """In place: exact inverse of `_korder_unshuffle` (the same swaps in reverse order)."""
    for shift, mask in reversed(_korder_masks(element_bits)):
        _delta_swap(words, shift, mask)


def _check_korder_swaps() -> None:
    # Element j of a word holds j: after the unshuffle, element q must hold KORDER[q]
    # (16 nibbles per uint64 for QPN2, 8 bytes per uint64 = half a group for QPN8).
    for bits, count in ((4, 16), (8, 8)):
        word = np.array([sum(j << (bits * j) for j in range(count))], dtype=_U64)
        _korder_unshuffle(word, bits)
        got = [(int(word[0]) >> (bits * q)) & ((1 << bits) - 1) for q in range(count)]
        if got != [int(k) for k in KORDER[:count]]:
            raise AssertionError(f"{bits}-bit KORDER swaps give {got}, geometry.KORDER is {list(KORDER)}")
        _korder_shuffle(word, bits)
        if int(word[0]) != sum(j << (bits * j) for j in range(count)):
            raise AssertionError(f"{bits}-bit KORDER shuffle does not invert the unshuffle")


_check_korder_swaps()


def _require_buffer(wf: WeightFormat, name: str, value: object, n: int, k: int) -> np.ndarray:
    """Buffer `name` of `wf` for an [n, k] weight: its dtype, and its shape as prepack returns it or flat."""
    buffer = wf.buffer(name)
    value = require_array(name, value, buffer.dtype)
    require_buffer_shape(name, value, buffer.shape(n, k), f"{wf.layout.lower()}_prepack")
    return value


# ----------------------------------------------------------------------------- layout


def qpn2_prepack_dims(weight_packed: np.ndarray, weight_scale: np.ndarray) -> tuple[int, int]:
    """(N, K) of the ModelOpt tensors `qpn2_prepack` takes, from their shapes alone (numpy or CuPy
    arrays, already checked 2-D): the QPN2 multiples and the scale shape [N, K/16]."""
    n, k = weight_packed.shape[0], 2 * weight_packed.shape[1]
    require_multiple("N", n, QPN2.n_multiple, QPN2.label,
                     f"weight_packed has shape {weight_packed.shape}; {QPN2.n_fix}")
    require_multiple("K", k, QPN2.k_multiple, QPN2.label, f"K = 2 * weight_packed.shape[1]; {QPN2.k_fix}")
    require_shape("weight_scale", weight_scale, QPN2.buffer("scales").shape(n, k))
    return n, k


def qpn2_prepack(weight_packed: np.ndarray, weight_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ModelOpt NVFP4 tensors -> QPN2 (codes, scales).

    weight_packed: uint8 [N, K/2] (element 2j in the low nibble); weight_scale: uint8 e4m3 bits
    [N, K/16]. Needs N % 32 == 0 and K % 64 == 0; NaN scale bytes (0x7F/0xFF) are rejected.
    Returns codes uint8 [N, K/2] and scales uint8 [N, K/16], both with their bytes in QPN2 order
    (module docstring). A pure byte permutation; exact inverse: `qpn2_unpack`.
    """
    weight_packed = require_array("weight_packed", weight_packed, np.uint8, ndim=2)
    weight_scale = require_array("weight_scale", weight_scale, np.uint8, ndim=2)
    n, k = qpn2_prepack_dims(weight_packed, weight_scale)
    require_no_nan_e4m3("weight_scale", weight_scale)

    half_k, groups = k // 2, k // GROUP_K
    words = np.ascontiguousarray(weight_packed).view(_U64)  # [N, G]: one uint64 per (row, group)
    codes = _rows_to_lanes(words)  # [T, G, 32] uint64, a fresh array
    _korder_unshuffle(codes, 4)
    scales = _rows_to_lanes(weight_scale)  # [T, G, 32] uint8
    return codes.view(np.uint8).reshape(n, half_k), scales.reshape(n, groups)


def qpn2_unpack(codes: np.ndarray, scales: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """QPN2 (codes, scales) of an [n, k] weight -> ModelOpt (weight_packed, weight_scale).

    codes: uint8 [n, k/2] or flat [n*k/2]; scales: uint8 [n, k/16] or flat [n*k/16].
    Returns weight_packed uint8 [n, k/2] (element 2j in the low nibble) and weight_scale uint8
    [n, k/16]. Exact inverse of `qpn2_prepack`; a pure byte permutation (scale bytes are not
    judged here, `qpn2_dequantize` does that).
    """
    n, k = QPN2.require_int_dims(n, k)
    groups = k // GROUP_K
    codes = _require_buffer(QPN2, "codes", codes, n, k)
    scales = _require_buffer(QPN2, "scales", scales, n, k)

    words = np.ascontiguousarray(codes).reshape(-1).view(_U64)
    rows = _lanes_to_rows(words, n, groups)  # [N, G] uint64, a fresh array
    _korder_shuffle(rows, 4)
    weight_scale = _lanes_to_rows(np.ascontiguousarray(scales).reshape(-1), n, groups)
    return rows.view(np.uint8).reshape(n, k // 2), weight_scale


# ----------------------------------------------------------------------------- weights


def qpn2_dequantize(codes: np.ndarray, scales: np.ndarray, global_scale: float | np.ndarray, n: int, k: int
                    ) -> np.ndarray:
    """QPN2 buffers -> float16 [n, k] under the qpn contract (= nvfp4_dequantize of the originals).

    W16 = RN16(RN32(e2m1 * RN32(e4m3 * g(n)))); global_scale: float32 scalar or one value per
    32-column tile ([n/32]). Rejects NaN scale bytes and blocks that would overflow fp16.
    """
    n, k = QPN2.require_int_dims(n, k)
    global_scale_per_row(global_scale, n)  # fail on a bad global scale before any work
    return nvfp4_dequantize(*qpn2_unpack(codes, scales, n, k), global_scale)


def _variant_inputs(codes: np.ndarray, scales: np.ndarray, global_scale: float | np.ndarray, n: int, k: int
                    ) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    n, k = QPN2.require_int_dims(n, k)
    g_rows = global_scale_per_row(global_scale, n)
    weight_packed, weight_scale = qpn2_unpack(codes, scales, n, k)
    require_no_nan_e4m3("scales", weight_scale)
    e2m1 = decode_e2m1(unpack_nibbles(weight_packed)).astype(np.float64).reshape(n, k // GROUP_K, GROUP_K)
    e4m3 = decode_e4m3(weight_scale).astype(np.float64)  # [N, G]
    return n, k, g_rows, e2m1, e4m3


# What the letters P and E mean wherever qpn reports how often upstream's roundings differ
UPSTREAM_VARIANTS = ("P = the rounding of upstream's Turing-route NVFP4 decode kernels, E = its later kernels' "
                     "(docs/QPN2.md, \"How upstream's decode kernels round\")")


def qpn2_dequantize_variant_p(codes: np.ndarray, scales: np.ndarray, global_scale: float | np.ndarray, n: int,
                              k: int) -> np.ndarray:
    """Upstream's Turing-route decode rounding (variant P), for measurement: float16 [n, k].

    Gs = RN16(g * 2^14) once per tile (or once for a scalar g), S = RN16(e4m3 * Gs),
    weight = RN16(e2m1 * 2^-14 * S). Reading of docs/QPN2.md: e4m3 is the exact decoded scale
    value and e2m1 * 2^-14 the exact fp16 value that the nibble bit trick produces, so
    S = RN16 of e4m3 * g * 2^14 with g first rounded to fp16's 11 significant bits, and S is inf
    exactly when e4m3 * Gs >= 65520 (the spec's "e4m3 * g * 2^14 > 65504"). (A kernel that
    multiplies the bit-trick value e4m3 * 2^-8 by RN16(g * 2^22) gets the same S wherever both
    Gs are normal fp16 numbers.) Every product is exact in float64 (at most 4 x 11 and
    2 x 11 significant bits) and rounded once. Overflow is not rejected: S = inf gives +-inf
    weights, and NaN for code 0 / 8 (0 * inf), as the fp16 multiply does.
    """
    n, k, g_rows, e2m1, e4m3 = _variant_inputs(codes, scales, global_scale, n, k)
    with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN are this variant's answers
        gs16 = (g_rows.astype(np.float64) * 2.0**14).astype(np.float16).astype(np.float64)  # [N]
        s16 = (e4m3 * gs16[:, None]).astype(np.float16).astype(np.float64)  # [N, G]
        weight = (e2m1 * 2.0**-14) * s16[..., None]
        return weight.astype(np.float16).reshape(n, k)


def qpn2_dequantize_variant_e(codes: np.ndarray, scales: np.ndarray, global_scale: float | np.ndarray, n: int,
                              k: int) -> np.ndarray:
    """Upstream's later decode rounding (variant E), for measurement: float16 [n, k].

    E = RN16(RN32(e4m3 * g)), weight = RN16(e2m1 * E). e4m3 * g is exact in float64 (4 x 24
    significant bits) and rounded to fp32 once, then to fp16 once (double rounding, as the
    kernel does); e2m1 * E is exact in float64 and rounded once. Overflow is not rejected:
    E = inf gives +-inf weights and NaN for codes 0 / 8.
    """
    n, k, g_rows, e2m1, e4m3 = _variant_inputs(codes, scales, global_scale, n, k)
    with np.errstate(over="ignore", invalid="ignore"):
        e32 = (e4m3 * g_rows.astype(np.float64)[:, None]).astype(np.float32)  # RN32, [N, G]
        e16 = e32.astype(np.float16).astype(np.float64)  # RN16
        return (e2m1 * e16[..., None]).astype(np.float16).reshape(n, k)
