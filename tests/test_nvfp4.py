"""NVFP4 (ref/nvfp4.py): nibble order, ModelOpt's quantizer bit for bit, the fp16 contract, rejections.

Oracles: a torch float32 re-implementation of ModelOpt's quantizer (written here from the
algorithm in docs/FORMATS.md, "ModelOpt's quantizer"), ml_dtypes for element values, torch's
fp32 -> fp16 cast for RN16.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qpn.ref import (
    decode_e4m3,
    nvfp4_block_overflows,
    nvfp4_dequantize,
    nvfp4_dequantize_fp32,
    nvfp4_quantize,
    pack_nibbles,
    unpack_nibbles,
)

BLOCK = 16
TILE = 32
# (N, K): single block, odd N, one tile, several tiles, a wider real-ish slice
SHAPES = [(1, 16), (3, 32), (32, 64), (64, 256), (96, 128), (7, 512)]
SEEDS = (0, 1, 2)
DISTRIBUTIONS = ("normal", "heavy_tailed", "block_scaled", "ties", "with_zeros", "tiny_blocks")
E4M3_NAN_BYTES = (0x7F, 0xFF)
E4M3_FINITE_BYTES = np.array([b for b in range(256) if b not in E4M3_NAN_BYTES], dtype=np.uint8)
E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def u16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16)


def u32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


# ----------------------------------------------------------------------------- oracles


def modelopt_quantize_torch(w32: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ModelOpt's NVFP4 weight quantizer, step by step with torch float32 CPU ops.

    torch CPU divides float32 by a Python scalar exactly (one RN32); the e4m3 cast is torch's own.
    """
    t = torch.from_numpy(w32.copy())
    n, k = t.shape
    weight_scale_2 = t.abs().amax().float() / (6.0 * 448.0)
    blocks = t.view(n, k // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(dim=-1).float()
    block_scale = block_amax / (6.0 * weight_scale_2)
    block_scale[block_scale == 0] = 1.0
    block_scale = block_scale.clamp(min=2.0**-9, max=448.0).to(torch.float8_e4m3fn)
    scaled = (blocks / (block_scale.to(torch.float32) * weight_scale_2).unsqueeze(-1)).view(n, k)
    # e2m1: sign only for x < 0; magnitude = number of midpoints below |x|, plus one at the
    # midpoints whose upper neighbour has the even code (0.75, 1.75, 3.5)
    sign = (scaled < 0).to(torch.uint8)
    magnitude = scaled.abs()
    midpoints = torch.from_numpy(E2M1_MIDPOINTS)
    code = torch.searchsorted(midpoints, magnitude, out_int32=True).to(torch.uint8)
    code += (magnitude.unsqueeze(-1) == midpoints[[1, 3, 5]]).any(dim=-1).to(torch.uint8)
    codes = (sign << 3) | code
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
    return packed.numpy(), block_scale.view(torch.uint8).numpy(), weight_scale_2.numpy()


def contract_float64(weight_packed, weight_scale, g_rows, rn16: bool = True) -> np.ndarray:
    """W16 = RN16(RN32(e2m1 * RN32(e4m3 * g))) recomputed in float64 with independent decoders.

    e4m3 (4 significant bits) * fp32 g (24 bits) and e2m1 (2 bits) * fp32 (24 bits) are exact in
    float64 (53 bits), so each float64 product followed by astype(float32) is exactly one RN32.
    """
    n = weight_packed.shape[0]
    low = weight_packed & 0x0F  # 0000_1111
    high = weight_packed >> 4
    codes = np.stack([low, high], axis=-1).reshape(n, -1)
    e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    e4m3 = weight_scale.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    block_multiplier = (e4m3 * g_rows.astype(np.float64)[:, None]).astype(np.float32)  # RN32
    w32 = (e2m1 * np.repeat(block_multiplier.astype(np.float64), BLOCK, axis=1)).astype(np.float32)  # RN32
    if not rn16:
        return w32
    return torch.from_numpy(w32).to(torch.float16).numpy()  # RN16 by torch


def make_weight(rng: np.random.Generator, n: int, k: int, kind: str, dtype=np.float32) -> np.ndarray:
    """Random weights of several shapes of difficulty for the quantizer."""
    if kind == "normal":
        w = rng.standard_normal((n, k)) * 0.02
    elif kind == "heavy_tailed":
        w = rng.standard_t(2, (n, k))
    elif kind == "block_scaled":  # block amax spread over 12 binades: many subnormal e4m3 scales
        w = rng.standard_normal((n, k)) * np.repeat(2.0 ** rng.uniform(-12, 0, (n, k // BLOCK)), BLOCK, axis=1)
    elif kind == "ties":  # values landing on e2m1 midpoints after scaling by a power-of-two block scale
        w = rng.choice(np.concatenate([E2M1_MIDPOINTS, -E2M1_MIDPOINTS, [6.0, -6.0]]), (n, k))
        w = w * np.repeat(2.0 ** rng.integers(-3, 3, (n, k // BLOCK)), BLOCK, axis=1)
    elif kind == "with_zeros":  # whole zero blocks, -0.0 entries and tiny negatives that round to -0
        w = rng.standard_normal((n, k))
        w[rng.random((n, k)) < 0.3] = -0.0
        w[:, : BLOCK if k > BLOCK else BLOCK // 2] = 0.0  # a whole zero block, unless that is all of w
        w[rng.random((n, k)) < 0.05] = -1e-6
    elif kind == "tiny_blocks":  # block amax far below amax * 2^-9 / 448: the 2^-9 clamp is active
        w = rng.standard_normal((n, k))
        w[:, BLOCK:] *= 1e-7
    else:
        raise AssertionError(kind)
    return w.astype(dtype)


# ----------------------------------------------------------------------------- nibbles


def test_pack_nibbles_golden_row():
    # Row [1.0, -0.5, 6, 0, -6, 1.5, 2, -3, 4, -1, 0.5, -2, 3, -4, -1.5, 0]: amax 6 makes the block
    # scale 448 and every value a grid point. e2m1 codes (s mmm):
    #   k:     0     1     2     3     4     5     6     7     8     9    10    11    12    13    14    15
    #   code: 0010  1001  0111  0000  1111  0011  0100  1101  0110  1010  0001  1100  0101  1110  1011  0000
    # byte j = (code of k=2j+1) << 4 | (code of k=2j):
    #   byte:   0: [1001|0010]  1: [0000|0111]  2: [0011|1111]  3: [1101|0100] ...
    row = np.array([1.0, -0.5, 6, 0, -6, 1.5, 2, -3, 4, -1, 0.5, -2, 3, -4, -1.5, 0], dtype=np.float32)
    golden = np.array(
        [[0b1001_0010, 0b0000_0111, 0b0011_1111, 0b1101_0100, 0b1010_0110, 0b1100_0001, 0b1110_0101, 0b0000_1011]],
        dtype=np.uint8,
    )
    q = nvfp4_quantize(row[None, :])
    assert np.array_equal(q.weight_packed, golden)
    assert np.array_equal(q.weight_scale, np.array([[0b0_1111_110]], dtype=np.uint8))  # 448
    assert u32(q.weight_scale_2) == u32(np.float32(6.0) / np.float32(2688.0))
    assert np.array_equal(u16(nvfp4_dequantize(*q)), u16(row[None, :].astype(np.float16)))


def test_pack_nibbles_low_nibble_first():
    codes = np.arange(16, dtype=np.uint8).reshape(1, 16)
    # element 2j -> low nibble, 2j+1 -> high nibble: (0,1) -> 0x10, (2,3) -> 0x32, ...
    golden = np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], dtype=np.uint8)
    assert np.array_equal(pack_nibbles(codes), golden)
    assert np.array_equal(unpack_nibbles(golden), codes)


def test_unpack_nibbles_inverts_pack_on_every_byte():
    every_byte = np.arange(256, dtype=np.uint8).reshape(16, 16)
    codes = unpack_nibbles(every_byte)
    assert codes.shape == (16, 32) and codes.max() <= 0xF
    assert np.array_equal(pack_nibbles(codes), every_byte)


@pytest.mark.parametrize(
    "codes, match",
    [
        (np.zeros((2, 3), np.uint8), "even last dimension"),
        (np.full((2, 4), 16, np.uint8), "0..15"),
        (np.zeros((2, 4), np.int32), "dtype uint8"),
    ],
)
def test_pack_nibbles_rejects(codes, match):
    with pytest.raises(ValueError, match=match):
        pack_nibbles(codes)


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", DISTRIBUTIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_quantize_matches_torch_modelopt(shape, kind, seed):
    w = make_weight(np.random.default_rng(seed), *shape, kind)
    packed, scale, scale_2 = modelopt_quantize_torch(w)
    q = nvfp4_quantize(w)
    assert q.weight_packed.dtype == np.uint8 and q.weight_packed.shape == (shape[0], shape[1] // 2)
    assert q.weight_scale.dtype == np.uint8 and q.weight_scale.shape == (shape[0], shape[1] // BLOCK)
    assert q.weight_scale_2.dtype == np.float32 and q.weight_scale_2.shape == ()
    assert np.array_equal(q.weight_packed, packed)
    assert np.array_equal(q.weight_scale, scale)
    assert u32(q.weight_scale_2) == u32(scale_2)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 70),
    blocks=st.integers(1, 6),
    kind=st.sampled_from(DISTRIBUTIONS),
    seed=st.integers(0, 2**32 - 1),
    half=st.booleans(),
)
def test_quantize_matches_torch_modelopt_hypothesis(n, blocks, kind, seed, half):
    w = make_weight(np.random.default_rng(seed), n, blocks * BLOCK, kind, np.float16 if half else np.float32)
    packed, scale, scale_2 = modelopt_quantize_torch(w.astype(np.float32))  # ModelOpt computes fp16 in fp32
    q = nvfp4_quantize(w)
    assert np.array_equal(q.weight_packed, packed)
    assert np.array_equal(q.weight_scale, scale)
    assert u32(q.weight_scale_2) == u32(scale_2)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantize_dequantize_recovers_grid_values_exactly(seed, dtype):
    # W = v * s_b * G with v on the e2m1 grid, s_b an e4m3 value (subnormals included), G = 2^-4, and
    # a +-6 in every block plus one block with s_b = 448: amax = 2688 G, so weight_scale_2 = G,
    # block_scale = s_b and scaled = v, all exact; every product fits fp16 exactly.
    rng = np.random.default_rng(seed)
    n, k = 64, 128
    g = np.float32(2.0**-4)
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    codes[:, ::BLOCK] = rng.choice([0b0111, 0b1111], (n, k // BLOCK))  # +-6 opens each block
    scale_bytes = rng.choice(np.arange(0x01, 0x7F, dtype=np.uint8), (n, k // BLOCK))  # positive finite
    scale_bytes[0, 0] = 0b0_1111_110  # 448
    v = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    w = v * np.repeat(scale_bytes.view(ml_dtypes.float8_e4m3fn).astype(np.float64), BLOCK, axis=1) * g
    w = w.astype(dtype)
    assert np.array_equal(w.astype(np.float64), v * np.repeat(decode_e4m3(scale_bytes), BLOCK, axis=1) * g)

    q = nvfp4_quantize(w)
    expected_codes = np.where(codes == 0b1000, 0, codes).astype(np.uint8)  # -0.0 quantizes to +0
    assert np.array_equal(unpack_nibbles(q.weight_packed), expected_codes)
    assert np.array_equal(q.weight_scale, scale_bytes)
    assert u32(q.weight_scale_2) == u32(g)
    w16 = nvfp4_dequantize(*q)
    assert np.array_equal(u16(w16), u16((w + 0.0).astype(np.float16)))  # + 0.0 turns -0.0 into +0.0


def test_quantize_block_scale_ties_go_to_even():
    # Row r has one block whose exact block_scale is the r-th midpoint between consecutive e4m3
    # values (block amax = 6 * mid * G), next to a block of amax 6 * 448 * G that fixes
    # weight_scale_2 = G = 2^-4; all of it is exact in fp32, so the e4m3 cast sees the tie itself.
    low = np.arange(0x00, 0x7E, dtype=np.uint8)
    mid = (decode_e4m3(low).astype(np.float64) + decode_e4m3(low + 1)) / 2
    g = 2.0**-4
    w = np.zeros((mid.size, 2 * BLOCK), dtype=np.float32)
    w[:, 0] = 6 * 448 * g
    w[:, BLOCK] = 6 * mid * g
    q = nvfp4_quantize(w)
    even = np.where(low % 2 == 0, low, low + 1).astype(np.uint8)
    even[0] = 0b0_0000_001  # the tie 2^-10 between 0 and 2^-9 is clamped up to 2^-9 first
    assert np.array_equal(q.weight_scale[:, 1], even)
    _, torch_scale, _ = modelopt_quantize_torch(w)
    assert np.array_equal(q.weight_scale, torch_scale)


def test_quantize_negative_zero_gives_code_0_but_tiny_negatives_keep_the_sign():
    w = np.zeros((1, 16), dtype=np.float32)
    w[0, 0] = 1.0
    w[0, 1] = -0.0
    w[0, 2] = -1e-4  # scaled to about -1e-4 * 6: rounds to zero, ModelOpt sets the sign: code 8
    codes = unpack_nibbles(nvfp4_quantize(w).weight_packed)[0]
    assert codes[1] == 0b0000 and codes[2] == 0b1000


def test_quantize_all_zero_weight():
    # ModelOpt's torch path divides 0/0 here and writes NaN scale bytes; qpn uses weight_scale_2 = 1
    w = np.zeros((4, 32), dtype=np.float32)
    _, torch_scale, _ = modelopt_quantize_torch(w)
    assert np.all((torch_scale & 0x7F) == 0x7F)  # NaN bytes: why qpn does not copy this path
    q = nvfp4_quantize(w)
    assert np.array_equal(q.weight_packed, np.zeros((4, 16), np.uint8))
    assert np.array_equal(q.weight_scale, np.full((4, 2), 0b0_0111_000, np.uint8))  # 1.0
    assert u32(q.weight_scale_2) == u32(np.float32(1.0))
    assert np.array_equal(u16(nvfp4_dequantize(*q)), np.zeros((4, 32), np.uint16))


def test_quantize_does_not_modify_input():
    w = make_weight(np.random.default_rng(0), 8, 64, "with_zeros")
    before = w.copy()
    nvfp4_quantize(w)
    assert np.array_equal(u32(w), u32(before))


@pytest.mark.parametrize(
    "w, match",
    [
        (np.ones((4, 24), np.float32), "K must be a positive multiple of 16"),
        (np.ones((4, 32), np.float64), "float32 or float16"),
        (np.ones((4, 32), np.int32), "float32 or float16"),
        (np.ones(32, np.float32), "2-D"),
        (np.ones((0, 32), np.float32), r"w must be 2-D \[N, K\] with N, K >= 1"),
        (np.array([[np.nan] + [1.0] * 15], np.float32), "finite"),
        (np.array([[np.inf] + [1.0] * 15], np.float32), "finite"),
        (np.full((1, 16), 1e-45, np.float32), "underflows"),  # subnormal amax: amax/2688 == 0
        # amax/2688 is a tiny fp32 subnormal; the second block's scale (about 2^-8) times it is 0
        (np.array([[1e-40] * 16 + [1e-45] * 16], np.float32), "underflows"),
        ([[1.0] * 16], "numpy.ndarray"),
    ],
)
def test_quantize_rejects(w, match):
    before = np.array(w, copy=True)
    with pytest.raises(ValueError, match=match):
        nvfp4_quantize(w)
    assert np.array_equal(np.asarray(w), before, equal_nan=True)


# ----------------------------------------------------------------------------- dequantize


def random_checkpoint(rng: np.random.Generator, n: int, k: int):
    """Random bytes: every nibble code, every finite scale byte, g log-uniform in [2^-30, 2^4]
    (6 * 448 * 2^4 = 43008 < 65504, so nothing overflows; small g reaches fp16 subnormals)."""
    weight_packed = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    weight_scale = rng.choice(E4M3_FINITE_BYTES, (n, k // BLOCK))
    g = np.float32(2.0 ** rng.uniform(-30, 4))
    return weight_packed, weight_scale, g


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_dequantize_matches_float64_contract(shape, seed):
    weight_packed, weight_scale, g = random_checkpoint(np.random.default_rng(seed), *shape)
    g_rows = np.full(shape[0], g, np.float32)
    w16 = nvfp4_dequantize(weight_packed, weight_scale, g)
    assert w16.dtype == np.float16 and w16.shape == shape
    assert np.array_equal(u16(w16), u16(contract_float64(weight_packed, weight_scale, g_rows)))
    w32 = nvfp4_dequantize_fp32(weight_packed, weight_scale, g)
    assert w32.dtype == np.float32
    assert np.array_equal(u32(w32), u32(contract_float64(weight_packed, weight_scale, g_rows, rn16=False)))


def test_dequantize_code_8_is_negative_zero():
    weight_packed = np.array([[0b1000_1000] * 8, [0b0000_0000] * 8], dtype=np.uint8)  # codes 8 / codes 0
    weight_scale = np.array([[0b0_0111_000], [0b0_0111_000]], dtype=np.uint8)
    w16 = nvfp4_dequantize(weight_packed, weight_scale, np.float32(0.5))
    assert np.all(u16(w16[0]) == 0x8000)
    assert np.all(u16(w16[1]) == 0x0000)
    assert np.all(u32(nvfp4_dequantize_fp32(weight_packed, weight_scale, np.float32(0.5))[0]) == 0x8000_0000)


def test_dequantize_per_tile_global_scale():
    rng = np.random.default_rng(0)
    n, k = 96, 64
    weight_packed, weight_scale, _ = random_checkpoint(rng, n, k)
    g_tiles = np.array([2.0**-10, 3.0 * 2.0**-12, 1.0], dtype=np.float32)
    w16 = nvfp4_dequantize(weight_packed, weight_scale, g_tiles)
    for t, g in enumerate(g_tiles):
        rows = slice(t * TILE, (t + 1) * TILE)
        alone = nvfp4_dequantize(weight_packed[rows], weight_scale[rows], g)
        assert np.array_equal(u16(w16[rows]), u16(alone))
    assert np.array_equal(u16(w16), u16(contract_float64(weight_packed, weight_scale, np.repeat(g_tiles, TILE))))
    scalar = nvfp4_dequantize(weight_packed, weight_scale, g_tiles[0])
    assert np.array_equal(u16(w16[:TILE]), u16(scalar[:TILE]))
    assert not np.array_equal(u16(w16[TILE:]), u16(scalar[TILE:]))


def test_dequantize_accepts_quantize_output_per_argument():
    w = make_weight(np.random.default_rng(3), 32, 64, "normal")
    q = nvfp4_quantize(w)
    a = nvfp4_dequantize(q.weight_packed, q.weight_scale, q.weight_scale_2)
    b = nvfp4_dequantize(*q)
    c = nvfp4_dequantize(q.weight_packed, q.weight_scale, float(q.weight_scale_2))
    assert np.array_equal(u16(a), u16(b)) and np.array_equal(u16(a), u16(c))


# ----------------------------------------------------------------------------- overflow rule

OVERFLOW_G = (np.float32(1.0), np.float32(10920.0), np.float32(24.375), np.float32(2.0**20))


@pytest.mark.parametrize("g", OVERFLOW_G)
def test_block_overflows_agrees_with_the_fp16_cast_for_every_scale_byte(g):
    weight_scale = E4M3_FINITE_BYTES.reshape(-1, 1)
    g_rows = np.full(weight_scale.shape[0], g, np.float32)
    with np.errstate(over="ignore"):
        largest = (np.float32(6.0) * (np.abs(decode_e4m3(weight_scale)) * g)).astype(np.float16)
    assert np.array_equal(nvfp4_block_overflows(weight_scale, g_rows), np.isinf(largest))


def test_overflow_boundary_65504_passes_65520_fails():
    # scale 1.0 (0x38), code 7 (6.0): 6 * g. g = 10920 gives exactly 65520, which RN16 rounds to inf;
    # the fp32 value just below gives 6 * g < 65520, which RN16 rounds to 65504 (0x7BFF).
    weight_packed = np.full((1, 8), 0b0111_0111, np.uint8)
    weight_scale = np.array([[0b0_0111_000]], np.uint8)
    below = np.nextafter(np.float32(10920.0), np.float32(0))
    assert np.all(u16(nvfp4_dequantize(weight_packed, weight_scale, below)) == 0x7BFF)
    with pytest.raises(ValueError, match=r"weight_scale\[0, 0\].*beyond fp16"):
        nvfp4_dequantize(weight_packed, weight_scale, np.float32(10920.0))
    w32 = nvfp4_dequantize_fp32(weight_packed, weight_scale, np.float32(10920.0))
    assert np.all(w32 == 65520.0)  # the fp32 variant has no fp16 rule; RN16 of 65520 is inf


def test_overflow_rule_ignores_codes():
    # all codes 0, so no weight would overflow, but the scale allows 6 * 448 * 25 = 67200: rejected
    weight_packed = np.zeros((1, 8), np.uint8)
    weight_scale = np.array([[0b1_1111_110]], np.uint8)  # -448: the rule uses |e4m3|
    with pytest.raises(ValueError, match="beyond fp16"):
        nvfp4_dequantize(weight_packed, weight_scale, np.float32(25.0))


# ----------------------------------------------------------------------------- rejections

N_, K_ = 32, 64
GOOD_PACKED = np.zeros((N_, K_ // 2), np.uint8)
GOOD_SCALE = np.full((N_, K_ // BLOCK), 0b0_0111_000, np.uint8)
GOOD_G = np.float32(0.5)


def with_byte(a: np.ndarray, index, value) -> np.ndarray:
    a = a.copy()
    a[index] = value
    return a


DEQUANTIZE_REJECTIONS = {
    "K not multiple of 16": ((np.zeros((N_, 4), np.uint8), np.zeros((N_, 0), np.uint8), GOOD_G),
                             "K must be a positive multiple of 16"),
    "packed dtype": ((GOOD_PACKED.astype(np.int8), GOOD_SCALE, GOOD_G), "weight_packed must have dtype uint8"),
    "scale dtype float8": ((GOOD_PACKED, GOOD_SCALE.view(ml_dtypes.float8_e4m3fn), GOOD_G),
                           "weight_scale must have dtype uint8"),
    "scale dtype float32": ((GOOD_PACKED, GOOD_SCALE.astype(np.float32), GOOD_G), "weight_scale must have dtype uint8"),
    "packed 1-D": ((GOOD_PACKED.reshape(-1), GOOD_SCALE, GOOD_G), "weight_packed must be 2-D"),
    "no rows": ((GOOD_PACKED[:0], GOOD_SCALE[:0], GOOD_G), "at least one row"),
    "scale too many blocks": ((GOOD_PACKED, np.ones((N_, K_ // BLOCK + 1), np.uint8), GOOD_G),
                              r"weight_scale must have shape \(32, 4\)"),
    "scale too many rows": ((GOOD_PACKED, np.ones((N_ + 1, K_ // BLOCK), np.uint8), GOOD_G),
                            r"weight_scale must have shape \(32, 4\)"),
    "NaN scale 0x7F": ((GOOD_PACKED, with_byte(GOOD_SCALE, (3, 2), 0x7F), GOOD_G), r"NaN e4m3.*\(3, 2\).*0x7F"),
    "NaN scale 0xFF": ((GOOD_PACKED, with_byte(GOOD_SCALE, (0, 1), 0xFF), GOOD_G), r"NaN e4m3.*0xFF"),
    "overflow": ((GOOD_PACKED, with_byte(GOOD_SCALE, (5, 3), 0b0_1111_110), np.float32(30.0)),
                 r"weight_scale\[5, 3\] = 0x7E.*beyond fp16"),
    "global scale per-tile shape": ((GOOD_PACKED, GOOD_SCALE, np.ones(3, np.float32)), "one value per 32-column tile"),
    "global scale 2-D": ((GOOD_PACKED, GOOD_SCALE, np.ones((1, 2), np.float32)), "one value per 32-column tile"),
    "global scale float64": ((GOOD_PACKED, GOOD_SCALE, np.array(0.5)), "global_scale must be float32"),
    "global scale np.float64 scalar": ((GOOD_PACKED, GOOD_SCALE, np.float64(0.5)), "global_scale must be float32"),
    "global scale zero": ((GOOD_PACKED, GOOD_SCALE, np.float32(0.0)), "finite and > 0"),
    "global scale NaN": ((GOOD_PACKED, GOOD_SCALE, np.float32(np.nan)), "finite and > 0"),
}  # fmt: skip


@pytest.mark.parametrize("dequantize", [nvfp4_dequantize, nvfp4_dequantize_fp32])
@pytest.mark.parametrize("case", list(DEQUANTIZE_REJECTIONS))
def test_dequantize_rejects(dequantize, case):
    args, match = DEQUANTIZE_REJECTIONS[case]
    if case == "overflow" and dequantize is nvfp4_dequantize_fp32:
        assert np.isfinite(dequantize(*args)).all()  # no fp16 rule for the fp32 result
        return
    before = [np.array(a, copy=True) for a in args]
    with pytest.raises(ValueError, match=match):
        dequantize(*args)
    for a, b in zip(args, before, strict=True):  # a rejected call leaves its inputs alone, byte for byte
        assert np.asarray(a).tobytes() == b.tobytes()


def test_dequantize_accepts_good_inputs():
    w16 = nvfp4_dequantize(GOOD_PACKED, GOOD_SCALE, GOOD_G)
    assert w16.shape == (N_, K_) and not u16(w16).any()


def test_block_overflows_validates_g_rows():
    with pytest.raises(ValueError, match=r"g_rows must have shape \(32,\)"):
        nvfp4_block_overflows(GOOD_SCALE, np.ones(31, np.float32))
    with pytest.raises(ValueError, match="g_rows must have dtype float32"):
        nvfp4_block_overflows(GOOD_SCALE, np.ones(32))
