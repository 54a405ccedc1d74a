"""FP8 (ref/fp8.py): the amax/448 quantizer per tensor, channel and 128x128 block; checkpoint dequant.

Oracles: a torch float32 re-implementation of the quantizer (torch CPU divides float32 exactly;
its float8_e4m3fn cast is RNE), ml_dtypes for e4m3 values, torch's fp32 -> fp16 cast for RN16.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qpn.ref import decode_e4m3, fp8_dequantize, fp8_quantize, fp8_scale_granularity, fp8_scale_map

BLOCK = 128
GRANULARITIES = ("tensor", "channel", "block")
# aligned, ragged in N, ragged in K, ragged in both, smaller than one block, a single element
SHAPES = [(128, 256), (130, 128), (64, 200), (300, 129), (7, 13), (1, 1)]
SEEDS = (0, 1)
DISTRIBUTIONS = ("normal", "heavy_tailed", "row_scaled", "with_zeros")
E4M3_NAN_BYTES = (0x7F, 0xFF)
E4M3_FINITE_BYTES = np.array([b for b in range(256) if b not in E4M3_NAN_BYTES], dtype=np.uint8)


def u16(x) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16)


def u32(x) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint32)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- oracles


def fp8_quantize_torch(w32: np.ndarray, granularity: str) -> tuple[np.ndarray, np.ndarray]:
    """scale = amax / 448 per group (zero groups -> 1.0), codes = fp8(w / scale), in torch float32."""
    t = torch.from_numpy(w32.copy())
    n, k = t.shape
    if granularity == "tensor":
        scale = t.abs().amax() / 448.0
        scale_map = scale
    elif granularity == "channel":
        scale = t.abs().amax(dim=1) / 448.0
        scale_map = scale[:, None]
    else:
        nb, kb = ceil_div(n, BLOCK), ceil_div(k, BLOCK)
        padded = torch.nn.functional.pad(t.abs(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
        scale = padded.view(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3)) / 448.0
        scale_map = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scale_map = torch.where(scale_map == 0, torch.ones_like(scale_map), scale_map)
    codes = (t / scale_map).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.numpy(), scale.numpy()


def checkpoint_float64(weight: np.ndarray, scale_map: np.ndarray) -> np.ndarray:
    """RN16(RN32(e4m3 * s)): e4m3 (4 significant bits) * fp32 s (24 bits) is exact in float64, so
    astype(float32) is one RN32; torch's cast is the RN16."""
    e4m3 = weight.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    w32 = (e4m3 * scale_map.astype(np.float64)).astype(np.float32)
    return torch.from_numpy(w32).to(torch.float16).numpy()


def make_weight(rng: np.random.Generator, n: int, k: int, kind: str, dtype=np.float32) -> np.ndarray:
    if kind == "normal":
        w = rng.standard_normal((n, k)) * 0.02
    elif kind == "heavy_tailed":
        w = rng.standard_t(2, (n, k))
    elif kind == "row_scaled":  # rows over 16 binades: tiny rows land in e4m3 subnormals per tensor
        w = rng.standard_normal((n, k)) * 2.0 ** rng.uniform(-16, 0, (n, 1))
    elif kind == "with_zeros":  # zero rows and a zero 128x128 block (when there is more than one), -0.0
        w = rng.standard_normal((n, k))
        w[rng.random((n, k)) < 0.2] = -0.0
        w[::3] = 0.0
        if n > BLOCK:
            w[:BLOCK, :BLOCK] = 0.0
        w[-1, -1] = 1.0  # never all zero (that case has its own test)
    else:
        raise AssertionError(kind)
    return w.astype(dtype)


def random_scale(rng: np.random.Generator, granularity: str, n: int, k: int) -> np.ndarray:
    """Random fp32 scales, log-uniform in [2^-30, 2^7] (448 * 2^7 = 57344 < 65504: no overflow)."""
    shape = {"tensor": (), "channel": (n,), "block": (ceil_div(n, BLOCK), ceil_div(k, BLOCK))}[granularity]
    return np.asarray(2.0 ** rng.uniform(-30, 7, shape), dtype=np.float32)


# ----------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", DISTRIBUTIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_quantize_matches_torch(granularity, shape, kind, seed):
    w = make_weight(np.random.default_rng(seed), *shape, kind)
    codes, scale = fp8_quantize_torch(w, granularity)
    q = fp8_quantize(w, granularity)
    expected_scale_shape = {"tensor": (), "channel": (shape[0],),
                            "block": (ceil_div(shape[0], BLOCK), ceil_div(shape[1], BLOCK))}
    assert q.weight.dtype == np.uint8 and q.weight.shape == shape
    assert q.weight_scale.dtype == np.float32 and q.weight_scale.shape == expected_scale_shape[granularity]
    assert np.array_equal(q.weight, codes)
    assert np.array_equal(u32(q.weight_scale), u32(scale))


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    granularity=st.sampled_from(GRANULARITIES),
    kind=st.sampled_from(DISTRIBUTIONS),
    seed=st.integers(0, 2**32 - 1),
    half=st.booleans(),
)
def test_quantize_matches_torch_hypothesis(n, k, granularity, kind, seed, half):
    w = make_weight(np.random.default_rng(seed), n, k, kind, np.float16 if half else np.float32)
    codes, scale = fp8_quantize_torch(w.astype(np.float32), granularity)  # fp16 -> fp32 is exact
    q = fp8_quantize(w, granularity)
    assert np.array_equal(q.weight, codes)
    assert np.array_equal(u32(q.weight_scale), u32(scale))


def test_quantize_ragged_blocks_use_only_their_own_elements():
    # 130 x 200 -> 2 x 2 blocks; the edge block (1, 1) covers rows 128..129 and columns 128..199
    n, k = 130, 200
    w = np.full((n, k), 0.5, dtype=np.float32)
    w[129, 199] = 448.0 * 3  # only block (1, 1) sees it
    w[0:128, 128:200] = 0.0  # block (0, 1): all zero -> scale 1.0
    q = fp8_quantize(w, "block")
    half = np.float32(0.5) / np.float32(448)
    expected = np.array([[half, 1.0], [half, 3.0]], dtype=np.float32)  # 1344 / 448 = 3 exactly
    assert np.array_equal(u32(q.weight_scale), u32(expected))
    assert q.weight[129, 199] == 0b0_1111_110  # 448
    assert np.all(q.weight[0:128, 128:200] == 0)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_dequantize_recovers_grid_values_exactly(granularity):
    # Every row holds +-448 * 2^-5 and e4m3 values times 2^-5: scale = 2^-5 exactly in every group,
    # w / scale is the e4m3 value itself, and e4m3 * 2^-5 is exact in fp16 (down to 2^-14).
    rng = np.random.default_rng(0)
    n, k = 160, 288
    codes = rng.choice(E4M3_FINITE_BYTES, (n, k))
    codes[:, ::BLOCK] = rng.choice([0b0_1111_110, 0b1_1111_110], (n, ceil_div(k, BLOCK)))  # +-448 per block
    codes[::BLOCK, :] = np.where(rng.random((ceil_div(n, BLOCK), k)) < 0.5, 0b0_1111_110, 0b1_1111_110)
    w = decode_e4m3(codes) * np.float32(2.0**-5)
    q = fp8_quantize(w, granularity)
    assert np.all(q.weight_scale == np.float32(2.0**-5))
    assert np.array_equal(q.weight, codes)  # -0.0 (0x80) included: the sign follows signbit
    assert np.array_equal(u16(fp8_dequantize(*q)), u16(w.astype(np.float16)))


def test_quantize_negative_zero_is_0x80():
    w = np.array([[1.0, -0.0, 0.0]], dtype=np.float32)
    assert np.array_equal(fp8_quantize(w, "tensor").weight, np.array([[0b0_1111_110, 0b1_0000_000, 0]], np.uint8))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_quantize_all_zero_groups_get_scale_one(granularity):
    w = np.zeros((3, 5), dtype=np.float32)
    q = fp8_quantize(w, granularity)
    assert np.all(q.weight == 0)
    assert np.all(q.weight_scale == np.float32(1.0))
    assert not u16(fp8_dequantize(*q)).any()


FP8_QUANTIZE_REJECTIONS = {
    "unknown granularity": ((np.ones((2, 2), np.float32), "row"), "granularity must be one of"),
    "float64": ((np.ones((2, 2), np.float64), "tensor"), "float32 or float16"),
    "int": ((np.ones((2, 2), np.int32), "channel"), "float32 or float16"),
    "1-D": ((np.ones(4, np.float32), "tensor"), "2-D"),
    "empty": ((np.ones((0, 4), np.float32), "block"), "N, K >= 1"),
    "NaN": ((np.array([[1.0, np.nan]], np.float32), "tensor"), "finite"),
    "inf": ((np.array([[1.0, -np.inf]], np.float32), "block"), "finite"),
    "underflow": ((np.array([[1e-45, 1.0]], np.float32), "channel"), "underflows"),
    "list": (([[1.0]], "tensor"), "numpy.ndarray"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FP8_QUANTIZE_REJECTIONS))
def test_quantize_rejects(case):
    (w, granularity), match = FP8_QUANTIZE_REJECTIONS[case]
    if case == "underflow":
        w = w.T.copy()  # one row with amax 1e-45, one with 1.0: only the first underflows
    before = np.array(w, copy=True)
    with pytest.raises(ValueError, match=match):
        fp8_quantize(w, granularity)
    assert np.asarray(w).tobytes() == before.tobytes()


# ----------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_dequantize_matches_float64(granularity, shape, seed):
    rng = np.random.default_rng(seed)
    weight = rng.choice(E4M3_FINITE_BYTES, shape)
    scale = random_scale(rng, granularity, *shape)
    w16 = fp8_dequantize(weight, scale)
    assert w16.dtype == np.float16 and w16.shape == shape
    assert np.array_equal(u16(w16), u16(checkpoint_float64(weight, fp8_scale_map(scale, *shape))))


def test_scale_map_places_each_scale():
    n, k = 130, 260  # 2 x 3 blocks, ragged both ways
    block = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    m = fp8_scale_map(block, n, k)
    rows, cols = np.meshgrid(np.arange(n), np.arange(k), indexing="ij")
    assert np.array_equal(m, block[rows // BLOCK, cols // BLOCK])
    channel = np.arange(1, n + 1, dtype=np.float32)
    assert np.array_equal(fp8_scale_map(channel, n, k), np.repeat(channel[:, None], k, axis=1))
    assert np.array_equal(fp8_scale_map(channel[:, None], n, k), fp8_scale_map(channel, n, k))
    assert np.array_equal(fp8_scale_map(np.float32(3.0), n, k), np.full((n, k), 3.0, np.float32))


SCALE_GRANULARITY_CASES = [
    ((), 4, 8, "tensor"),
    ((1,), 4, 8, "tensor"),
    ((4,), 4, 8, "channel"),
    ((4, 1), 4, 8, "channel"),
    ((1, 1), 4, 8, "tensor"),  # one value: per tensor unless a granularity is stated (the single-value rule)
    ((3, 2), 300, 129, "block"),
]


@pytest.mark.parametrize("shape, n, k, expected", SCALE_GRANULARITY_CASES)
def test_scale_granularity_from_shape(shape, n, k, expected):
    assert fp8_scale_granularity(np.ones(shape, np.float32), n, k) == expected


@pytest.mark.parametrize("shape", [(), (1,), (1, 1), (1, 1, 1, 1)])
def test_a_stated_single_block_stays_block(shape):
    assert fp8_scale_granularity(np.ones(shape, np.float32), 4, 8, "block") == "block"
    with pytest.raises(ValueError, match="does not fit granularity 'block'"):
        fp8_scale_granularity(np.ones((1, 1), np.float32), 200, 8, "block")  # two blocks: one value cannot be a grid


def test_dequantize_channel_n_by_1_equals_n():
    rng = np.random.default_rng(0)
    weight = rng.choice(E4M3_FINITE_BYTES, (33, 40))
    scale = random_scale(rng, "channel", 33, 40)
    assert np.array_equal(u16(fp8_dequantize(weight, scale[:, None])), u16(fp8_dequantize(weight, scale)))


def test_dequantize_negative_zero_and_overflow_boundary():
    weight = np.array([[0b1_0000_000, 0b0_1111_110]], np.uint8)  # -0.0, 448
    # 448 * s = 65520 exactly for s = 146.25: RN16 -> inf, rejected; one fp32 ulp less -> 65504
    below = np.nextafter(np.float32(146.25), np.float32(0))
    assert np.array_equal(u16(fp8_dequantize(weight, below.reshape(()))), np.array([[0x8000, 0x7BFF]], np.uint16))
    with pytest.raises(ValueError, match="beyond fp16"):
        fp8_dequantize(weight, np.array(146.25, np.float32))


N_, K_ = 40, 24
GOOD_WEIGHT = np.full((N_, K_), 0b0_0111_000, np.uint8)


def with_value(a: np.ndarray, index, value) -> np.ndarray:
    a = a.copy()
    a[index] = value
    return a


FP8_DEQUANTIZE_REJECTIONS = {
    "weight dtype int8": ((GOOD_WEIGHT.view(np.int8), np.float32(1.0)), "weight must have dtype uint8"),
    "weight dtype float8": ((GOOD_WEIGHT.view(ml_dtypes.float8_e4m3fn), np.float32(1.0)),
                            "weight must have dtype uint8"),
    "weight 1-D": ((GOOD_WEIGHT.reshape(-1), np.float32(1.0)), "weight must be 2-D"),
    "weight empty": ((GOOD_WEIGHT[:0], np.float32(1.0)), "N, K >= 1"),
    "scale float64": ((GOOD_WEIGHT, np.array(1.0)), "weight_scale must have dtype float32"),
    "scale python float": ((GOOD_WEIGHT, 1.0), "numpy.ndarray"),
    "scale shape N+1": ((GOOD_WEIGHT, np.ones(N_ + 1, np.float32)), "fits no FP8 granularity"),
    "scale shape N x 2": ((GOOD_WEIGHT, np.ones((N_, 2), np.float32)), "fits no FP8 granularity"),
    "scale shape transposed blocks": ((np.zeros((300, 129), np.uint8), np.ones((2, 3), np.float32)),
                                      r"expected .*\(3, 2\)"),
    "NaN byte 0x7F": ((with_value(GOOD_WEIGHT, (2, 3), 0x7F), np.float32(1.0)), r"weight holds NaN e4m3.*\(2, 3\)"),
    "NaN byte 0xFF": ((with_value(GOOD_WEIGHT, (0, 0), 0xFF), np.float32(1.0)), "NaN e4m3"),
    "scale NaN": ((GOOD_WEIGHT, with_value(np.ones(N_, np.float32), 5, np.nan)), r"finite and > 0.*index \(5,\)"),
    "scale inf": ((GOOD_WEIGHT, np.array(np.inf, np.float32)), "finite and > 0"),
    "scale zero": ((GOOD_WEIGHT, np.array(0.0, np.float32)), "finite and > 0"),
    "scale negative": ((GOOD_WEIGHT, np.array(-1.0, np.float32)), "finite and > 0"),
    "overflow": ((GOOD_WEIGHT, with_value(np.ones(N_, np.float32), 7, 147.0)), r"weight_scale\[7\] = 147.*beyond fp16"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FP8_DEQUANTIZE_REJECTIONS))
def test_dequantize_rejects(case):
    args, match = FP8_DEQUANTIZE_REJECTIONS[case]
    before = [np.array(a, copy=True) for a in args]
    with pytest.raises(ValueError, match=match):
        fp8_dequantize(*args)
    for a, b in zip(args, before, strict=True):  # a rejected call leaves its inputs alone, byte for byte
        assert np.asarray(a).tobytes() == b.tobytes()


def test_dequantize_accepts_good_inputs():
    assert np.all(fp8_dequantize(GOOD_WEIGHT, np.float32(2.0)) == 2.0)
