"""CPU proof that the decode kernels' fp16 arithmetic yields exactly the contract's W16.

The QPN2 decode kernel (cupy_kernels/qpn2_linear.cu, "Decode") never computes
RN16(RN32(e2m1 * S)) element by element. Per block (one column, 16 k) the owner lane computes
    S  = RN32(e4m3 * g)          B0 = RN16(S)          B1 = RN16(RN32(1.5 * S))
    X  = fma16(B1, 2, RN16(-2 * B0))        Y = fma16(B0, 3, RN16(-2 * B1))
and every weight pair is then, with e14 = the nibble bit trick (e2m1 * 2^-14, exact),
    e  = RN16(e14 * 2^14)        p = bits(e) & 0xFDFF        W = fma16(e, X, RN16(p * Y))
This "fast path" serves the blocks with |S| >= 2^-13 or S == 0 whose Y has its exponent MSB (bit 14)
clear; every other block uses the contract formula itself. Bit 14 of Y is QPN2_SLOW_FLAG (0x40000000)
of the {X, Y} table word: the table holds an all-ones marker for every other block, and the kernel
tests the OR of a batch's entries for that bit. This module models each step with numpy (fp16
products: exact in float32 and rounded once by the cast; fma16: exact in float64, rounded once) and
compares the result with `qpn.ref.nvfp4_dequantize` for all 254 non-NaN scale bytes x all 16 codes
x a few thousand global scales, including ones that push blocks into fp16 subnormals and to the overflow limit.

Zeros: for codes 0 and 8 the fast path returns a zero whose sign may differ from the
contract's (-0 for code 8); the decode kernels only feed the tensor-core dot product, where a
signed zero product changes nothing (the fp32 accumulator starts at +0), so zeros are compared
as values and every nonzero weight as bits.

The QPN8 decode (one fp16 multiply of the bit-trick value by S16) is the contract's own
formula; `test_qpn8_decode_model_is_the_contract` checks the model against qpn.ref as well.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import qpn
from qpn.ref import decode_e4m3, nvfp4_block_overflows, nvfp4_dequantize, pack_nibbles, qpn8_dequantize, qpn8_prepack

FAST_PATH_MIN_SCALE = np.float32(2.0**-13)  # the kernel's threshold on |S|
SLOW_FLAG_Y = 0x4000  # 0100_0000_0000_0000: Y's exponent MSB = bit 30 of the {X (low), Y (high)} word
KERNEL_SOURCE = Path(qpn.__file__).parent / "cupy_kernels" / "qpn2_linear.cu"
SEED = 20261129
N_RANDOM_SCALES = 3000
ALL_BYTES = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=np.uint8)  # 254 non-NaN
ALL_CODES = np.arange(16, dtype=np.uint8)
ROWS_PER_SCALE = 256  # 254 bytes padded to 8 tiles of 32 rows (one global scale per tile)


def _f16(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16)


def _bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float16).view(np.uint16)


def _mul16(a, b) -> np.ndarray:
    """mul.rn.f16x2: the exact product (<= 22 significant bits, exact in float32) rounded once."""
    return (a.astype(np.float32) * b.astype(np.float32)).astype(np.float16)


def _fma16(a, b, c) -> np.ndarray:
    """fma.rn.f16x2: a*b + c exact in float64 (fp16 operands), rounded once to fp16."""
    with np.errstate(over="ignore"):  # blocks the contract rejects (masked out) may overflow
        return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float16)


def global_scales() -> np.ndarray:
    """float32 global scales: log-uniform random over the useful range plus edge values."""
    rng = np.random.default_rng(SEED)
    # |S| = |e4m3| * g with |e4m3| in [2^-9, 448]: g from 2^-30 (every block subnormal or zero)
    # to 24 (blocks of 448 overflow, small ones stay legal).
    random = np.exp2(rng.uniform(-30.0, 4.6, N_RANDOM_SCALES)).astype(np.float32)
    # edges: powers of two; the fast-path threshold for every scale byte (|S| = 2^-13 exactly and
    # one fp32 ulp on either side); the overflow limit 6 * |S| -> 65520 for the largest bytes;
    # ModelOpt's typical g = amax / 2688
    e4m3 = np.abs(decode_e4m3(ALL_BYTES))
    e4m3 = e4m3[e4m3 > 0].astype(np.float64)
    at_threshold = (2.0**-13 / e4m3).astype(np.float32)
    near_overflow = (65519.0 / 6.0 / e4m3[-8:]).astype(np.float32)
    edges = np.concatenate(
        [
            np.exp2(np.arange(-30, 5)).astype(np.float32),
            at_threshold,
            np.nextafter(at_threshold, np.float32(0)),
            np.nextafter(at_threshold, np.float32(np.inf)),
            near_overflow,
            np.nextafter(near_overflow, np.float32(np.inf)),
            (np.array([0.5, 1.0, 3.0, 100.0]) / 2688.0).astype(np.float32),
        ]
    )
    return np.unique(np.concatenate([random, edges]).astype(np.float32))


def kernel_block_constants(scale_bytes, g_rows):
    """The owner lane's per-block values: S (fp32), X, Y (fp16), fast-path flag (the table
    entry is {X, Y} itself, not the marker)."""
    s = decode_e4m3(scale_bytes) * g_rows  # RN32(e4m3 * g), float32
    with np.errstate(over="ignore"):
        b0 = s.astype(np.float16)  # cvt.rn.f16.f32
        b1 = (s * np.float32(1.5)).astype(np.float16)  # cvt.rn.f16.f32(RN32(1.5 S))
    minus2 = np.float16(-2.0)
    x = _fma16(b1, np.float16(2.0), _mul16(b0, minus2))  # 2 B1 - 2 B0
    y = _fma16(b0, np.float16(3.0), _mul16(b1, minus2))  # 3 B0 - 2 B1
    fast = ((np.abs(s) >= FAST_PATH_MIN_SCALE) | (s == 0)) & ((_bits(y) & SLOW_FLAG_Y) == 0)
    return s, x, y, fast


def kernel_fast_decode(codes, x, y) -> np.ndarray:
    """codes uint8 (0..15) broadcast against x, y -> the fast path's fp16 weights."""
    codes = codes.astype(np.uint16)
    e14 = _f16(((codes & 0x8) << 12) | ((codes & 0x7) << 9))  # sign -> 15, magnitude -> 9..11
    e = _mul16(e14, np.float16(16384.0))  # * 2^14, exact
    p = _f16(_bits(e) & 0xFDFF)  # clear the mantissa bit: 1.5 * 2^j -> 2^j, 0.5 stays 0.5
    return _fma16(e, x, _mul16(p, y))


def kernel_exact_decode(codes, s) -> np.ndarray:
    """The slow path: cvt.rn.f16(RN32(e2m1 * S)) with e2m1 = float(e14 * 2^14)."""
    codes = codes.astype(np.uint16)
    e = _mul16(_f16(((codes & 0x8) << 12) | ((codes & 0x7) << 9)), np.float16(16384.0))
    with np.errstate(over="ignore"):
        return (e.astype(np.float32) * s).astype(np.float16)


def _reference_table(scales: np.ndarray):
    """qpn.ref W16 for rows (scale byte b, global scale g) x the 16 codes, overflowing blocks masked.

    Rows: for each g, ROWS_PER_SCALE rows = 8 tiles of 32 (per-tile global scales), bytes
    ALL_BYTES padded with 0x38 (1.0). A block that the contract rejects (fp16 overflow) gets
    byte 0x00 in the reference call and is masked out of the comparison.
    """
    reps = len(scales)
    bytes_row = np.full(ROWS_PER_SCALE, 0x38, dtype=np.uint8)
    bytes_row[: len(ALL_BYTES)] = ALL_BYTES
    scale_bytes = np.tile(bytes_row, reps)
    g_tile = np.repeat(scales, ROWS_PER_SCALE // 32)
    g_rows = np.repeat(g_tile, 32)
    legal = ~nvfp4_block_overflows(scale_bytes[:, None], g_rows)[:, 0]
    safe_bytes = np.where(legal, scale_bytes, np.uint8(0))
    packed = np.tile(pack_nibbles(ALL_CODES[None, :]), (len(scale_bytes), 1))  # row: codes 0..15
    w16 = nvfp4_dequantize(packed, safe_bytes[:, None], g_tile)
    return scale_bytes, g_rows, legal, w16


def _assert_same_weights(got, want, where):
    nonzero = want != 0
    bad = (got.astype(np.float32) != want.astype(np.float32)) | (nonzero & (_bits(got) != _bits(want)))
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(
            f"{int(bad.sum())} weights differ, first at {i}: got {got[i]!r} (0x{int(_bits(got)[i]):04X}), "
            f"want {want[i]!r} (0x{int(_bits(want)[i]):04X}); {where(i)}"
        )


def test_qpn2_fast_path_is_exact_everywhere_it_is_taken():
    scales = global_scales()
    scale_bytes, g_rows, legal, want = _reference_table(scales)
    s, x, y, fast = kernel_block_constants(scale_bytes, g_rows)
    got = kernel_fast_decode(ALL_CODES[None, :], x[:, None], y[:, None])
    use = legal & fast
    assert use.sum() > 0.5 * len(use)  # the fast path is the common case
    _assert_same_weights(
        np.where(use[:, None], got, np.float16(0)),
        np.where(use[:, None], want, np.float16(0)),
        lambda i: (f"scale byte 0x{int(scale_bytes[i[0]]):02X}, g = {float(g_rows[i[0]])!r}, "
                   f"S = {float(s[i[0]])!r}, code {i[1]}"),
    )


def test_qpn2_exact_path_is_the_contract():
    scales = global_scales()
    scale_bytes, g_rows, legal, want = _reference_table(scales)
    s, _, _, _ = kernel_block_constants(scale_bytes, g_rows)
    got = kernel_exact_decode(ALL_CODES[None, :], s[:, None])
    _assert_same_weights(
        np.where(legal[:, None], got, np.float16(0)),
        np.where(legal[:, None], want, np.float16(0)),
        lambda i: f"scale byte 0x{int(scale_bytes[i[0]]):02X}, g = {float(g_rows[i[0]])!r}",
    )


def test_qpn2_fast_path_threshold_is_needed():
    """Below |S| = 2^-13 the fast path does go wrong (subnormal weights): the exact path is not dead code."""
    scales = global_scales()
    scale_bytes, g_rows, legal, want = _reference_table(scales)
    s, x, y, fast = kernel_block_constants(scale_bytes, g_rows)
    got = kernel_fast_decode(ALL_CODES[None, :], x[:, None], y[:, None])
    slow = legal & ~fast
    assert slow.any()
    differs = (got.astype(np.float32) != want.astype(np.float32)) & slow[:, None]
    assert differs.any()


def test_model_constants_are_the_kernels():
    """The proof models the kernel's own table rule: the |S| threshold and the flag bit."""
    src = KERNEL_SOURCE.read_text()
    flag = re.search(r"#define QPN2_SLOW_FLAG (0x[0-9A-Fa-f]+)u", src)
    marker = re.search(r"#define QPN2_SLOW_XY (0x[0-9A-Fa-f]+)u", src)
    assert flag and marker, f"QPN2_SLOW_FLAG / QPN2_SLOW_XY not defined in {KERNEL_SOURCE}"
    assert int(flag.group(1), 16) == SLOW_FLAG_Y << 16  # Y is the high half of the table word
    assert int(marker.group(1), 16) & int(flag.group(1), 16)  # the marker takes the exact path
    rule = "((fabsf(s) < 0x1p-13f && s != 0.0f) || (xy & QPN2_SLOW_FLAG)) ? QPN2_SLOW_XY : xy"
    assert rule in src and float.fromhex("0x1p-13") == FAST_PATH_MIN_SCALE
    assert "any_xy & QPN2_SLOW_FLAG" in src  # the batch's test: the flag of the OR of its entries


def test_qpn2_slow_flag_only_excludes_huge_blocks():
    """The flag bit (|Y| >= 2) sends a block with |S| >= 2^-13 to the exact path only when
    |S| >= 2^10 (its weights reach 6 * 1024): never in practice, and exact either way."""
    scales = global_scales()
    scale_bytes, g_rows, legal, _ = _reference_table(scales)
    s, _, y, _ = kernel_block_constants(scale_bytes, g_rows)
    flagged = legal & ((_bits(y) & SLOW_FLAG_Y) != 0)
    assert flagged.any()  # the rule is not vacuous: such legal blocks exist
    assert float(np.abs(s[flagged]).min()) >= 2.0**10


def test_qpn2_fast_path_covers_realistic_weights():
    """The exact path is for blocks whose weights are all below 6 * 2^-13 ~ 7.3e-4 (fp16
    subnormal territory). LLM-like weights (normal, std 0.02, quantized the ModelOpt way) never
    produce such a block, so the fast path is the only one taken in practice."""
    from qpn.ref import nvfp4_quantize

    rng = np.random.default_rng(SEED)
    w = (rng.standard_normal((512, 1024)) * 0.02).astype(np.float32)
    q = nvfp4_quantize(w)
    s = decode_e4m3(q.weight_scale) * q.weight_scale_2
    g = np.full(q.weight_scale.size, q.weight_scale_2, np.float32)
    _, _, _, fast = kernel_block_constants(q.weight_scale.ravel(), g)
    assert fast.all(), f"{int((~fast).sum())} slow blocks, smallest |S| = {float(np.abs(s).min())!r}"


def test_qpn8_decode_model_is_the_contract():
    """QPN8: W16 = mul.rn.f16(bit-trick(byte), S16) for all 254 non-NaN bytes and many S16."""
    rng = np.random.default_rng(SEED)
    s = np.unique(np.exp2(rng.uniform(-20.0, 6.9, 512)).astype(np.float32))  # fp32 channel scales
    n = 32 * ((len(s) + 31) // 32)
    s = np.resize(s, n).astype(np.float32)
    weight = np.tile(np.resize(ALL_BYTES, 256).astype(np.uint8), (n, 1))  # [n, 256], K = 256
    codes, group_scales = qpn8_prepack(weight, s)
    want = qpn8_dequantize(codes, group_scales, n, 256)
    b = weight.astype(np.uint16)
    trick = _f16(((b & 0x80) << 8) | ((b & 0x7F) << 7))  # e4m3 * 2^-8, exact
    got = _mul16(trick, group_scales.reshape(n, 1))
    assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("code", list(range(16)))
def test_e14_bit_trick_is_e2m1_times_2_to_minus_14(code):
    from qpn.ref import decode_e2m1

    e14 = _f16(np.uint16(((code & 0x8) << 12) | ((code & 0x7) << 9)))
    assert np.float64(e14) * 2.0**14 == np.float64(decode_e2m1(np.uint8(code)))
    assert np.signbit(e14) == bool(code & 0x8)
