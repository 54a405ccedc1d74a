"""QPNLinear: constructors against qpn.ref, N padding and cropping, dtypes, bias, state_dict."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qpn import ref
from qpn.ref.formats import weight_format
from qpn.torch_bridge import QPN2Weight, QPN8Weight, QPNLinear, pack_fp8, pack_nvfp4

# (out_features N, in_features K): aligned, N needing padding (40 -> 64, 100 -> 128), real MiniLM shapes
NVFP4_LAYERS = [(64, 128), (40, 64), (100, 192), (384, 384), (1536, 384)]
FP8_LAYERS = [(64, 48), (40, 16), (100, 256), (384, 1536)]
FP8_GRANULARITIES = ["tensor", "channel", "block"]
INPUT_DTYPES = [torch.float16, torch.float32, torch.bfloat16]


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def fp16_bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().view(np.uint16)


def random_linear(n, k, seed, bias=True) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():  # a few large outliers, as real weights have
        layer.weight[0, : min(k, 5)] *= 40
    return layer


def x_for(k, m=9, seed=0, lead=()):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((*lead, m, k)).astype(np.float16) / 4)


def assert_linear_within_bound(module: QPNLinear, x16: torch.Tensor, y16: torch.Tensor, w16: np.ndarray, bias=None):
    """y16 (fp16 module output, bias-free) lies in ref.linear_bounds of x16 and the ref weight w16."""
    x = x16.reshape(-1, x16.shape[-1]).cpu().numpy()
    lo, hi = ref.linear_bounds(x, w16)
    y = y16.reshape(-1, y16.shape[-1]).cpu().numpy()
    assert np.all((lo <= y) & (y <= hi))


# ----------------------------------------------------------------------------- from_linear


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n,k", NVFP4_LAYERS)
def test_from_linear_nvfp4_uses_ref_quantizer(n, k, device):
    layer = random_linear(n, k, seed=n + k, bias=False)
    module = QPNLinear.from_linear(layer.to(device), "nvfp4")
    q = ref.nvfp4_quantize(layer.weight.detach().cpu().float().numpy())
    w16 = ref.nvfp4_dequantize(*q)
    assert module.codes.device.type == device
    assert np.array_equal(fp16_bits(module.dequantized_weight()), w16.view(np.uint16))
    x = x_for(k).to(device)
    y = module(x)
    assert y.shape == (9, n) and y.dtype == torch.float16
    assert_linear_within_bound(module, x, y, w16)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("granularity", FP8_GRANULARITIES)
@pytest.mark.parametrize("n,k", FP8_LAYERS)
def test_from_linear_fp8_uses_ref_quantizer(n, k, granularity, device):
    if granularity == "block" and k % 128 != 0:
        with pytest.raises(ValueError, match="multiple of 128.*pad the input features"):
            QPNLinear.from_linear(random_linear(n, k, seed=1), "fp8", fp8_granularity=granularity)
        return
    layer = random_linear(n, k, seed=n * k, bias=False)
    module = QPNLinear.from_linear(layer.to(device), "fp8", fp8_granularity=granularity)
    q = ref.fp8_quantize(layer.weight.detach().cpu().float().numpy(), granularity)
    # the QPN8 contract weight: RN16(e4m3 * 2^-8 * RN16(256 s)) of the padded prepack, cropped
    n_pad = module.codes.shape[0]
    w_pad = np.zeros((n_pad, k), dtype=np.uint8)
    w_pad[:n] = q.weight
    scale = q.weight_scale
    if granularity == "channel":
        scale = np.concatenate([scale, np.ones(n_pad - n, np.float32)])
    w16 = ref.qpn8_dequantize(*ref.qpn8_prepack(w_pad, scale, granularity), n_pad, k)[:n]
    assert np.array_equal(fp16_bits(module.dequantized_weight()), w16.view(np.uint16))
    # and it is the checkpoint semantics up to QPN8's documented 1 ulp
    ckpt = ref.fp8_dequantize(q.weight, q.weight_scale).astype(np.float32)
    assert np.all(np.abs(w16.astype(np.float32) - ckpt) <= np.abs(np.spacing(w16)).astype(np.float32))
    x = x_for(k).to(device)
    assert_linear_within_bound(module, x, module(x), w16)
    assert module.fp8_granularity == granularity  # "tensor" too, though its layout is channel's QPN8


def test_from_packed_keeps_the_granularity_it_is_told_and_refuses_a_foreign_one():
    module = QPNLinear.from_linear(random_linear(64, 64, seed=2), "fp8", fp8_granularity="channel")
    packed = module.packed_weight
    assert QPNLinear.from_packed(packed).fp8_granularity == "channel"  # the layout's default
    assert QPNLinear.from_packed(packed, fp8_granularity="tensor").fp8_granularity == "tensor"
    with pytest.raises(ValueError, match="fp8_granularity must be one of"):
        QPNLinear.from_packed(packed, fp8_granularity="block")


def test_from_linear_rejects_unaligned_k_with_the_fix():
    with pytest.raises(ValueError, match="multiple of 64 for nvfp4, got 96; pad the input features"):
        QPNLinear.from_linear(nn.Linear(96, 64), "nvfp4")
    with pytest.raises(ValueError, match="multiple of 16"):
        QPNLinear.from_linear(nn.Linear(40, 64), "fp8")


# ----------------------------------------------------------------------------- padding, dtypes, bias


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_padded_rows_are_zero_and_cropped(fmt):
    """N = 40 is stored as 64 rows; the 24 pad rows decode to +0 and never reach the output."""
    layer = random_linear(40, 64, seed=3)
    module = QPNLinear.from_linear(layer, fmt)
    assert module.codes.shape[0] == 64
    if fmt == "nvfp4":
        full = torch.ops.qpn.nvfp4_dequantize(module.codes, module.scales, module.global_scale)
    else:
        full = torch.ops.qpn.fp8_dequantize(module.codes, module.group_scales)
    assert np.all(fp16_bits(full[40:]) == 0)
    assert module(x_for(64)).shape == (9, 40)


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_forward_dtype_lead_dims_and_bias_rounding(fmt, dtype):
    """out = cast_to_x_dtype(RN32(y + bias32)) where y = the op on x (fp16, bf16) or on RN16(x) (fp32),
    for any leading shape (module docstring)."""
    n, k = 100, 128
    layer = random_linear(n, k, seed=4)
    module = QPNLinear.from_linear(layer, fmt)
    x = (x_for(k, m=5, lead=(2, 3)).float() * 1.3).to(dtype)
    out = module(x)
    assert out.shape == (2, 3, 5, n) and out.dtype == dtype
    x_op = x.reshape(-1, k).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float16)
    if fmt == "nvfp4":
        y = torch.ops.qpn.nvfp4_linear(x_op, module.codes, module.scales, module.global_scale)[:, :n]
    else:
        y = torch.ops.qpn.fp8_linear(x_op, module.codes, module.group_scales)[:, :n]
    assert y.dtype == x_op.dtype
    expected = (y.float() + layer.bias.detach().float()).to(dtype).reshape(2, 3, 5, n)
    assert torch.equal(out, expected)
    if dtype == torch.bfloat16:
        lo, hi = ref.linear_bounds(x_op.float().numpy(), module.dequantized_weight().numpy(), dtype="bfloat16")
        assert np.all((lo <= y.float().numpy()) & (y.float().numpy() <= hi))
    else:
        assert_linear_within_bound(module, x_op, y, module.dequantized_weight().numpy())


@pytest.mark.parametrize("cast", ["half", "bfloat16", "to_float64"])
def test_model_dtype_casts_keep_buffer_dtypes(cast):
    """model.half() and friends must not round the float32 global scales / bias."""
    model = nn.Sequential(QPNLinear.from_linear(random_linear(64, 128, seed=9), "nvfp4"),
                          QPNLinear.from_linear(random_linear(32, 64, seed=10), "fp8"))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    x = x_for(128)
    y = model(x)
    model = model.half() if cast == "half" else model.bfloat16() if cast == "bfloat16" else model.to(torch.float64)
    for name, t in model.state_dict().items():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    assert torch.equal(model(x), y)


def test_forward_rejects_wrong_feature_count():
    module = QPNLinear.from_linear(nn.Linear(64, 32), "nvfp4")
    with pytest.raises(ValueError, match="64 input features"):
        module(torch.zeros(3, 63, dtype=torch.float16))


# ----------------------------------------------------------------------------- checkpoint constructors


def nvfp4_tensors(n=96, k=128, seed=5):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return ref.nvfp4_quantize(w)


@pytest.mark.parametrize("as_torch", [False, True])
def test_from_modelopt_nvfp4_numpy_or_torch_float8(as_torch):
    q = nvfp4_tensors()
    wp, ws, g = q.weight_packed, q.weight_scale, q.weight_scale_2
    if as_torch:
        wp, ws, g = torch.from_numpy(wp), torch.from_numpy(ws).view(torch.float8_e4m3fn), torch.from_numpy(g)
    module = QPNLinear.from_modelopt_nvfp4(wp, ws, g, bias=torch.arange(96, dtype=torch.float32))
    assert np.array_equal(fp16_bits(module.dequantized_weight()), ref.nvfp4_dequantize(*q).view(np.uint16))
    assert torch.equal(module.bias, torch.arange(96, dtype=torch.float32))


def test_from_modelopt_nvfp4_per_tile_global_scale():
    """Fused shards keep one global scale per 32-row tile (qpn.ref.fuse_nvfp4_shards)."""
    shards = [nvfp4_tensors(64, 128, seed=s) for s in (1, 2, 3)]
    linears = [ref.NVFP4Linear(f"s{i}", *q) for i, q in enumerate(shards)]
    fused = ref.fuse_nvfp4_shards(linears, "qkv")
    module = QPNLinear.from_modelopt_nvfp4(*fused)
    assert module.global_scale.shape == (6,)
    expected = np.concatenate([ref.nvfp4_dequantize(*q) for q in shards])
    assert np.array_equal(fp16_bits(module.dequantized_weight()), expected.view(np.uint16))


def test_from_compressed_tensors_nvfp4_takes_the_reciprocal_global_scale():
    """compressed-tensors stores G = 1 / multiplier: the module must use g = RN32(1/G)."""
    q = nvfp4_tensors()
    big_g = np.float32(1.0) / q.weight_scale_2  # what compressed-tensors writes
    module = QPNLinear.from_compressed_tensors_nvfp4(q.weight_packed, q.weight_scale, np.array([big_g]))
    expected = ref.nvfp4_dequantize(q.weight_packed, q.weight_scale, np.float32(1.0) / big_g)
    assert np.array_equal(fp16_bits(module.dequantized_weight()), expected.view(np.uint16))
    wrong = ref.nvfp4_dequantize(q.weight_packed, q.weight_scale, np.float32(big_g * 1e-6))
    assert not np.array_equal(expected, wrong)
    assert abs(float(module.global_scale[0]) - float(q.weight_scale_2)) <= np.spacing(q.weight_scale_2)


@pytest.mark.parametrize("granularity", FP8_GRANULARITIES)
def test_from_modelopt_fp8_and_from_checkpoint(granularity):
    w = np.random.default_rng(7).standard_normal((128, 256)).astype(np.float32)
    q = ref.fp8_quantize(w, granularity)
    scale = q.weight_scale.reshape(-1, 1) if granularity == "channel" else q.weight_scale  # [N, 1] on disk
    a = QPNLinear.from_modelopt_fp8(torch.from_numpy(q.weight).view(torch.float8_e4m3fn), torch.from_numpy(scale))
    b = QPNLinear.from_checkpoint(ref.FP8Linear("layer", q.weight, q.weight_scale, granularity))
    w16 = ref.qpn8_dequantize(*ref.qpn8_prepack(q.weight, q.weight_scale, granularity), 128, 256)
    for module in (a, b):
        assert np.array_equal(fp16_bits(module.dequantized_weight()), w16.view(np.uint16))


def test_overflowing_or_bad_scales_are_rejected():
    q = nvfp4_tensors(32, 64)
    with pytest.raises(ValueError, match="beyond fp16's 65504"):
        QPNLinear.from_modelopt_nvfp4(q.weight_packed, np.full_like(q.weight_scale, 0x7E), np.float32(100.0))
    with pytest.raises(ValueError, match="finite and > 0"):
        QPNLinear.from_modelopt_nvfp4(q.weight_packed, q.weight_scale, np.float32(0.0))
    bad = q.weight_scale.copy()
    bad[0, 0] = 0xFF
    with pytest.raises(ValueError, match="NaN e4m3"):
        QPNLinear.from_modelopt_nvfp4(q.weight_packed, bad, q.weight_scale_2)
    with pytest.raises(ValueError, match="146.1875"):
        QPNLinear.from_modelopt_fp8(np.zeros((32, 16), np.uint8), np.float32(200.0))
    with pytest.raises(ValueError, match="global_scale must be float32"):
        QPNLinear.from_modelopt_nvfp4(q.weight_packed, q.weight_scale, np.float64(0.5))


# ----------------------------------------------------------------------------- state_dict


@pytest.mark.parametrize("fmt,granularity,n,k", [("nvfp4", None, 100, 128), ("fp8", "channel", 40, 48),
                                                 ("fp8", "block", 200, 256)])
def test_state_dict_round_trips_through_safetensors(tmp_path, fmt, granularity, n, k):
    layer = random_linear(n, k, seed=8)
    module = QPNLinear.from_linear(layer, fmt, fp8_granularity=granularity or "channel")
    path = tmp_path / "layer.safetensors"
    save_file(module.state_dict(), str(path))
    fresh = QPNLinear(k, n, fmt, bias=True, fp8_granularity=granularity or "channel")
    fresh.load_state_dict(load_file(str(path)), strict=True)
    for name, buffer in module.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], buffer), name
    x = x_for(k)
    assert torch.equal(fresh(x), module(x))


@pytest.mark.parametrize("fmt,granularity,n,k", [("nvfp4", None, 100, 128), ("fp8", "channel", 40, 48),
                                                 ("fp8", "block", 200, 256)])
def test_buffers_are_the_descriptions(fmt, granularity, n, k):
    """QPNLinear's buffers are its format description's (qpn.ref.formats): names, dtypes, shapes of N padded."""
    wf = weight_format(fmt, granularity)
    module = QPNLinear(k, n, fmt, fp8_granularity=granularity or "channel")
    assert module.weight_format is wf
    buffers = {name: (b.dtype, tuple(b.shape)) for name, b in module.named_buffers()}
    assert buffers == {b.name: (torch.from_numpy(np.empty(0, b.dtype)).dtype, b.shape(wf.padded_n(n), k))
                       for b in wf.buffers}


@pytest.mark.parametrize("fmt,granularity,n,k", [("nvfp4", None, 100, 128), ("fp8", "block", 200, 256)])
def test_a_copied_or_pickled_layer_runs_the_same(tmp_path, fmt, granularity, n, k):
    """copy.deepcopy and torch.save of the whole module keep the format description the one object
    that forward dispatches on (`weight_format is QPN2`), so the copy computes the same bits."""
    module = QPNLinear.from_linear(random_linear(n, k, seed=3), fmt, fp8_granularity=granularity or "channel")
    path = tmp_path / "layer.pt"
    torch.save(module, path)
    x = x_for(k)
    for copied in (copy.deepcopy(module), torch.load(path, weights_only=False)):
        assert copied.weight_format is module.weight_format
        assert torch.equal(copied(x), module(x))


def test_pack_helpers_return_padded_buffers():
    """The functional building blocks (used by the vLLM method) see the same buffers as the module."""
    q = nvfp4_tensors(40, 64)
    packed = pack_nvfp4(q.weight_packed, q.weight_scale, q.weight_scale_2)
    assert (packed.format, packed.out_features, packed.in_features, packed.padded_out_features) == ("nvfp4", 40, 64, 64)
    assert type(packed) is QPN2Weight and packed.buffers["global_scale"].shape == (2,)
    f = ref.fp8_quantize(np.ones((40, 32), np.float32), "tensor")
    packed8 = pack_fp8(f.weight, f.weight_scale)
    assert type(packed8) is QPN8Weight and list(packed8.buffers) == ["codes", "group_scales"]
    assert packed8.buffers["group_scales"].shape == (1, 64)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_floating_input_is_refused_as_nn_linear_refuses_it(dtype):
    """int64 x used to come back as truncated integers. nn.Linear raises RuntimeError; so does this
    (an InputDtypeError is a RuntimeError and, as every qpn input error, a ValueError)."""
    layer = QPNLinear.from_linear(nn.Linear(64, 32), "fp8")
    x = torch.ones(2, 64, dtype=dtype)
    with pytest.raises(RuntimeError):
        nn.Linear(64, 32)(x)
    with pytest.raises(RuntimeError, match=f"floating-point.*{str(dtype)}"):
        layer(x)
    with pytest.raises(ValueError):
        layer(x)


def test_negative_block_scale_bytes_are_refused():
    q = ref.nvfp4_quantize(np.linspace(-1, 1, 32 * 64, dtype=np.float32).reshape(32, 64))
    bad = q.weight_scale.copy()
    bad[3, 2] |= 0x80  # 1000_0000: the sign bit
    with pytest.raises(ValueError, match=r"negative e4m3 block scales.*\(3, 2\)"):
        QPNLinear.from_modelopt_nvfp4(q.weight_packed, bad, q.weight_scale_2)
    zero = q.weight_scale.copy()
    zero[3, 2] = 0x00  # +0: an all-zero block, still valid
    QPNLinear.from_modelopt_nvfp4(q.weight_packed, zero, q.weight_scale_2)


def test_a_packed_weight_without_one_of_its_buffers_is_a_value_error():
    """A hand-built PackedWeight must hold exactly its layout's buffers (once a nullable global_scale
    failed inside copy_ with a TypeError); bad input is a ValueError naming the buffers."""
    q = nvfp4_tensors(32, 64)
    packed = pack_nvfp4(q.weight_packed, q.weight_scale, q.weight_scale_2)
    with pytest.raises(ValueError, match=r"QPN2 weight holds the buffers \['codes', 'scales', 'global_scale'\]"):
        QPN2Weight({"codes": packed.codes, "scales": packed.buffers["scales"]}, 64, 32)
    with pytest.raises(ValueError, match=r"global_scale must be torch.float32 \(1,\)"):
        QPN2Weight({**packed.buffers, "global_scale": packed.buffers["global_scale"].half()}, 64, 32)
    with pytest.raises(ValueError, match="cannot hold out_features 64"):
        QPN2Weight(packed.buffers, 64, 64)
