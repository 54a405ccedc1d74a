"""MXFP4 as a served format (issue 23, parts 3 and 4): the torch ops qpn::mxfp4_{prepack, dequantize, linear,
moe} against qpn.ref (bytes, W16, the derived bound of the float64 reference), on the CPU (numba) and on CUDA
(every path: decode, fused GEMM, dense; bit for bit the CuPy kernels), gated, compiled and captured; the
packed weight and QPNLinear("mxfp4"); the MoE op with gpt-oss's biases and clamped SwiGLU against
ref.gpt_oss.moe; convert() on a transformers gpt-oss model. GPU tests skip without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qpn.torch_bridge  # noqa: F401  (registers torch.ops.qpn.*)
from qpn import ref
from qpn.ref import gpt_oss
from qpn.ref import mxfp4 as mx
from qpn.ref.formats import QPNMX
from qpn.torch_bridge import QPNLinear, _cpu_ops
from qpn.torch_bridge.packed_experts import PackedExperts
from qpn.torch_bridge.packed_weight import MXFP4_PAD_SCALE_BYTE, PackedWeight, QPNMXWeight, pack_mxfp4

SHAPES = [(32, 64), (96, 192), (256, 512), (64, 2048)]
MS = [0, 1, 5, 32, 33, 100]


def devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def weight(rng: np.random.Generator, n: int, k: int, low: int = 100, high: int = 130) -> mx.MXFP4Weight:
    """Every code; scale bytes in [low, high] (weights 2^-27 .. 6 * 2^3), one tile 9 binades lower: tiles of
    different 2^T."""
    scales = rng.integers(low, high + 1, (n, k // 32)).astype(np.uint8)
    scales[: min(n, 32)] -= 9
    return mx.MXFP4Weight(rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8), scales)


def on(device: str, *arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


def bits(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy().view(np.uint16)


def inputs(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    return (rng.standard_normal((m, k)) / np.sqrt(k)).astype(np.float16)


def assert_in_bound(y: torch.Tensor, x: np.ndarray, w: mx.MXFP4Weight) -> None:
    w16, tile_scale = mx.mxfp4_w16(*w)
    lo, hi = mx.mxfp4_linear_bounds(x, w16, tile_scale)
    got = y.cpu().numpy()
    bad = ~((lo <= got) & (got <= hi))
    assert not bad.any(), f"{int(bad.sum())} outputs outside the bound, first at {np.argwhere(bad)[0]}"


# ----------------------------------------------------------------------------- prepack, dequantize


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n,k", SHAPES)
def test_prepack_and_dequantize_are_the_references_bytes(n, k, device):
    w = weight(np.random.default_rng(n + k), n, k)
    want = mx.qpnmx_prepack(*w)
    got = torch.ops.qpn.mxfp4_prepack(*on(device, w.blocks, w.scales))
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a.cpu().numpy().view(np.uint8), b.view(np.uint8))
    w16 = torch.ops.qpn.mxfp4_dequantize(*got)
    assert np.array_equal(bits(w16), mx.qpnmx_dequantize(*want, n, k).view(np.uint16))
    assert np.array_equal(bits(w16), mx.mxfp4_w16(*w)[0].view(np.uint16))


@pytest.mark.parametrize("device", devices())
def test_prepack_refuses_an_e8m0_nan_byte(device):
    w = weight(np.random.default_rng(0), 32, 64)
    w.scales[5, 1] = 0xFF
    with pytest.raises(ValueError, match="NaN"):
        torch.ops.qpn.mxfp4_prepack(*on(device, w.blocks, w.scales))


# ----------------------------------------------------------------------------- linear


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_on_every_path_is_inside_the_bound(n, k, device):
    """The op (dispatch's path), and each path forced, inside mxfp4_linear_bounds; the fused CPU kernel's rows
    do not depend on the batch (BLAS's may: its blocking follows M)."""
    rng = np.random.default_rng(3 * n + k)
    w = weight(rng, n, k)
    buffers = tuple(on(device, *mx.qpnmx_prepack(*w)))
    for m in MS:
        x = inputs(rng, m, k)
        xt = on(device, x)[0]
        y = torch.ops.qpn.mxfp4_linear(xt, *buffers)
        assert y.shape == (m, n) and y.dtype == torch.float16
        if not m:
            continue
        assert_in_bound(y, x, w)
        if device == "cpu":
            paths = {p: _cpu_ops.linear_on(p, QPNMX, xt, buffers, n) for p in ("cpu_fused", "cpu_blas")}
        else:
            from qpn.torch_bridge import _cuda

            paths = {p: _cuda.linear_on(p, QPNMX, xt, buffers, n, k, n, False) for p in ("decode", "gemm", "dense")
                     if p != "decode" or m <= 32}
        for path, yp in paths.items():
            assert_in_bound(yp, x, w)
            if path == "cpu_fused":
                assert np.array_equal(bits(_cpu_ops.linear_on(path, QPNMX, xt[:1], buffers, n)), bits(yp[:1]))


@pytest.mark.parametrize("device", devices())
def test_gated_linear_is_linear_then_silu_and_mul(device):
    rng = np.random.default_rng(7)
    n, k = 128, 256
    w = weight(rng, n, k, 118, 128)
    buffers = on(device, *mx.qpnmx_prepack(*w))
    for m in (1, 7, 40):
        xt = on(device, inputs(rng, m, k) * 4)[0]
        y = torch.ops.qpn.mxfp4_linear(xt, *buffers)
        out = torch.ops.qpn.mxfp4_linear(xt, *buffers, gated=True)
        from qpn.torch_bridge.epilogue import silu_and_mul

        assert np.array_equal(bits(out), bits(silu_and_mul(y)))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", [(n, k, g) for n, k in SHAPES[1:] for g in (False, True) if not g or n % 64 == 0])
def test_the_cuda_op_is_the_cupy_kernel_bit_for_bit(n, k, gated):
    import cupy

    from qpn.cupy_kernels import mxfp4 as ck_mx

    rng = np.random.default_rng(n * k)
    w = weight(rng, n, k)
    buffers = on("cuda", *mx.qpnmx_prepack(*w))
    for m in (1, 5, 32):
        x = inputs(rng, m, k)
        got = torch.ops.qpn.mxfp4_linear(on("cuda", x)[0], *buffers, gated=gated)
        want = ck_mx.qpnmx_linear(cupy.asarray(x), *(cupy.asarray(t) for t in (mx.qpnmx_prepack(*w))), gated=gated)
        assert np.array_equal(bits(got), cupy.asnumpy(want).view(np.uint16)), m


@pytest.mark.gpu
def test_the_decode_path_captures_in_a_cuda_graph():
    rng = np.random.default_rng(11)
    n, k = 256, 512
    w = weight(rng, n, k)
    buffers = on("cuda", *mx.qpnmx_prepack(*w))
    x = on("cuda", inputs(rng, 4, k))[0]
    want = torch.ops.qpn.mxfp4_linear(x, *buffers)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.ops.qpn.mxfp4_linear(x, *buffers)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.qpn.mxfp4_linear(x, *buffers)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    rng = np.random.default_rng(5)
    w = weight(rng, 64, 128)
    blocks, scales = on(device, w.blocks, w.scales)
    buffers = tuple(on(device, *mx.qpnmx_prepack(*w)))
    x = on(device, inputs(rng, 3, 128))[0]
    torch.library.opcheck(torch.ops.qpn.mxfp4_prepack, (blocks, scales))
    torch.library.opcheck(torch.ops.qpn.mxfp4_dequantize, buffers)
    torch.library.opcheck(torch.ops.qpn.mxfp4_linear, (x, *buffers))
    torch.library.opcheck(torch.ops.qpn.mxfp4_linear, (x, *buffers), {"gated": True})


@pytest.mark.parametrize("bad,match", [
    (lambda c, s, t: (c, s[:, :-1].contiguous(), t), "scales must have shape"),
    (lambda c, s, t: (c, s, t[:-1]), "tile_scale must have shape"),
    (lambda c, s, t: (c, s, t.double()), "tile_scale must have dtype torch.float32"),
    (lambda c, s, t: (c[:16], s[:16], t[:1]), "N must be a positive multiple of 32"),
])
def test_bad_buffers_are_refused_with_the_rule(bad, match):
    w = weight(np.random.default_rng(1), 64, 128)
    buffers = bad(*on("cpu", *mx.qpnmx_prepack(*w)))
    x = torch.zeros((2, 128), dtype=torch.float16)
    with pytest.raises(ValueError, match=match):
        torch.ops.qpn.mxfp4_linear(x, *buffers)


def test_prepack_refuses_blocks_of_another_shape():
    with pytest.raises(ValueError, match=r"blocks must be \[N, K/32, 16\]"):
        torch.ops.qpn.mxfp4_prepack(torch.zeros((32, 2, 8), dtype=torch.uint8), torch.zeros((32, 2), dtype=torch.uint8))


# ----------------------------------------------------------------------------- packed weight and module


def test_pack_pads_rows_with_plus_zero_and_keeps_every_tiles_scale():
    """N = 80: rows 80..95 are code 0x00 under scale byte 0 (2^-127: +0, never a tile's top), so the last
    tile's 2^T is that of its 16 real rows; W16 and the linear crop to N."""
    rng = np.random.default_rng(2)
    w = weight(rng, 96, 256)
    w.blocks[80:], w.scales[80:] = 0, MXFP4_PAD_SCALE_BYTE
    packed = pack_mxfp4(w.blocks[:80], w.scales[:80])
    assert isinstance(packed, QPNMXWeight) and packed.padded_out_features == 96
    want = mx.qpnmx_prepack(*w)
    for got, b in zip(packed.tensors(), want, strict=True):
        assert np.array_equal(got.numpy().view(np.uint8), b.view(np.uint8))
    assert np.array_equal(bits(packed.dequantize()), packed.reference_dequantize().view(np.uint16))
    assert packed.reference_dequantize().shape == (80, 256)
    # [N, K/2] rows are the same bytes
    again = pack_mxfp4(w.blocks[:80].reshape(80, 128), w.scales[:80])
    assert all(torch.equal(a, b) for a, b in zip(packed.tensors(), again.tensors(), strict=True))


@pytest.mark.parametrize("device", devices())
def test_qpnlinear_mxfp4_from_linear_and_from_mxfp4(device):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 80, bias=True)
    q = QPNLinear.from_linear(lin, "mxfp4").to(device)
    assert q.format == "mxfp4" and q.weight_format is QPNMX
    w = ref.mxfp4_quantize(lin.weight.detach().numpy())
    same = QPNLinear.from_mxfp4(w.blocks, w.scales, lin.bias.detach()).to(device)
    x = torch.randn(3, 256, device=device)
    assert torch.equal(q(x), same(x))
    state = QPNLinear(256, 80, "mxfp4", bias=True)
    state.load_state_dict(q.state_dict())
    assert torch.equal(state.to(device)(x), q(x))
    # the weight it holds: W16 times each row's 2^T is the reference's MXFP4 value, exactly
    rows = q.tile_scale.repeat_interleave(32)[:80, None].cpu()
    assert torch.equal(q.dequantized_weight().cpu().float() * rows, torch.from_numpy(ref.mxfp4_dequantize(*w)))


def test_torch_compile_fullgraph_on_the_cpu():
    torch.manual_seed(1)
    q = QPNLinear.from_linear(torch.nn.Linear(128, 64), "mxfp4")
    f = torch.compile(q, fullgraph=True)
    for m in (1, 9):
        x = torch.randn(m, 128, dtype=torch.float16)
        assert torch.equal(f(x), q(x))


# ----------------------------------------------------------------------------- mixture of experts


def experts(rng: np.random.Generator, e: int, h: int, inter: int) -> tuple:
    """E experts quantized by the reference: their PackedExperts with biases and swigluoai, and the float16
    weights + float32 biases ref.gpt_oss.moe takes (every value exact in fp16 here)."""
    pairs, w13, w2 = [], [], []
    for _ in range(e):
        gate, up, down = ((rng.standard_normal(s) * 0.05).astype(np.float32) for s in ((inter, h), (inter, h),
                                                                                         (h, inter)))
        qs = [ref.mxfp4_quantize(a) for a in (gate, up, down)]
        pairs.append((PackedWeight.stack_rows([pack_mxfp4(*qs[0]), pack_mxfp4(*qs[1])]), pack_mxfp4(*qs[2])))
        w13.append(np.concatenate([mx.mxfp4_dequantize(*q) for q in qs[:2]]).astype(np.float16))
        w2.append(mx.mxfp4_dequantize(*qs[2]).astype(np.float16))
    b13 = (rng.standard_normal((e, 2 * inter)) * 0.1).astype(np.float32)
    b2 = (rng.standard_normal((e, h)) * 0.1).astype(np.float32)
    packed = PackedExperts.stack(pairs, torch.from_numpy(b13), torch.from_numpy(b2), "swigluoai")
    return packed, np.stack(w13), b13, np.stack(w2), b2


@pytest.mark.parametrize("device", devices())
def test_moe_with_biases_and_swigluoai_is_inside_the_reference_bound(device):
    """Inside qpn.ref.gpt_oss.moe_bounds (fp32 sums in any order, the clamped SwiGLU's fp32 chain), and mostly the
    bits of ref.gpt_oss.moe (float64 sums, one rounding each)."""
    rng = np.random.default_rng(4)
    e, h, inter, top_k = 8, 128, 64, 2
    packed, w13, b13, w2, b2 = experts(rng, e, h, inter)
    packed = packed.to(device)
    for m in (1, 5, 33):
        x = (rng.standard_normal((m, h))).astype(np.float16)
        weights, ids = gpt_oss.route(rng.standard_normal((m, e)).astype(np.float32), top_k)
        got = packed.forward(*on(device, x, weights, ids)).cpu().numpy()
        want = gpt_oss.moe(x, w13, b13, w2, b2, weights, ids)
        lo, hi = gpt_oss.moe_bounds(x, w13, b13, w2, b2, weights, ids)
        assert ((lo <= got) & (got <= hi)).all(), m
        assert (got == want).mean() > 0.9  # most outputs are the reference's bits


@pytest.mark.gpu
def test_moe_rows_do_not_depend_on_the_batch_on_cuda():
    rng = np.random.default_rng(6)
    packed = experts(rng, 8, 128, 64)[0].to("cuda")
    m = 40
    x, (weights, ids) = rng.standard_normal((m, 128)).astype(np.float16), gpt_oss.route(
        rng.standard_normal((m, 8)).astype(np.float32), 2)
    full = packed.forward(*on("cuda", x, weights, ids))
    for i in (0, 17, 39):
        one = packed.forward(*on("cuda", x[i:i + 1], weights[i:i + 1], ids[i:i + 1]))
        assert torch.equal(one, full[i:i + 1]), i


@pytest.mark.parametrize("device", devices())
def test_moe_opcheck(device):
    rng = np.random.default_rng(8)
    packed = experts(rng, 4, 64, 64)[0].to(device)
    x = on(device, rng.standard_normal((3, 64)).astype(np.float16))[0]
    weights, ids = on(device, *gpt_oss.route(rng.standard_normal((3, 4)).astype(np.float32), 2))
    args = (x, *packed.w13.values(), *packed.w2.values(), weights, ids)
    torch.library.opcheck(torch.ops.qpn.mxfp4_moe, args, {"w13_bias": packed.w13_bias, "w2_bias": packed.w2_bias,
                                                          "activation": "swigluoai"})


def test_moe_refuses_an_unknown_activation_and_misshapen_biases():
    rng = np.random.default_rng(9)
    packed = experts(rng, 4, 64, 64)[0]
    x = torch.zeros((2, 64), dtype=torch.float16)
    weights, ids = (torch.from_numpy(a) for a in gpt_oss.route(rng.standard_normal((2, 4)).astype(np.float32), 2))
    args = (x, *packed.w13.values(), *packed.w2.values(), weights, ids)
    with pytest.raises(ValueError, match="activation must be one of"):
        torch.ops.qpn.mxfp4_moe(*args, activation="gelu")
    assert packed.w2_bias is not None
    with pytest.raises(ValueError, match=r"w13_bias must be float32 \[4, 128\]"):
        torch.ops.qpn.mxfp4_moe(*args, w13_bias=packed.w2_bias)


def test_convert_turns_gpt_oss_experts_into_mxfp4_experts():
    """transformers' GptOssExperts (transposed, gate and up interleaved, biased) -> QPNExperts in QPNMX with
    swigluoai: the model's output equals that of the same model whose experts hold the MXFP4 values (the
    dequantized weights), within MXFP4-free rounding (fp32 vs the fp16 path)."""
    transformers = pytest.importorskip("transformers")
    from qpn.torch_bridge import convert
    from qpn.torch_bridge.experts import QPNExperts

    config = transformers.GptOssConfig(
        hidden_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, vocab_size=64, max_position_embeddings=32,
        sliding_window=8, layer_types=["full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    experts_module = model.model.layers[0].mlp.experts
    twin = transformers.GptOssForCausalLM(config).float().eval()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():  # the twin's experts hold the MXFP4 values the conversion will hold
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(twin.model.layers[0].mlp.experts, name)
            t = p.transpose(1, 2).numpy()  # [E, N, K] rows of the linear
            values = np.stack([mx.mxfp4_dequantize(*ref.mxfp4_quantize(a)) for a in t])
            p.copy_(torch.from_numpy(values).transpose(1, 2))
    skipped = convert(model, "mxfp4", skip=["lm_head", "*.self_attn.*", "*.router"])
    new = model.model.layers[0].mlp.experts
    assert isinstance(new, QPNExperts) and new is not experts_module and new.activation == "swigluoai"
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        got, want = model(ids).logits, twin(ids).logits
    assert all(reason == "listed in skip" for _, reason in skipped)
    assert (got - want).abs().max() < 2e-3 * want.abs().max()
