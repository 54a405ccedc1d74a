"""torch.ops.qpn.{nvfp4,fp8}_moe and PackedExperts (issue 22, part 4): inside qpn.ref.moe's derived bound,
batch invariant bit for bit, equal to a loop of qpn's own linear ops per expert where those run the same
path, every expert hit / none hit / one hot expert, top-k 1 to 8; the experts built from checkpoint
linears (gate and up with their own scales) and from stacked packed weights; clear errors. CPU here;
the CUDA backend runs the same tests on the device (gpu-marked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qpn import ref
from qpn.ref import moe as ref_moe
from qpn.torch_bridge import PackedExperts, PackedWeight

H, INTER = 128, 128  # 128x128 FP8 blocks need K % 128 on both projections
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def device_or_skip(device: str) -> None:
    """The gpu marker skips without a CUDA device (conftest); where CuPy sees one, torch must too."""
    assert device == "cpu" or torch.cuda.is_available(), "CuPy sees a CUDA device that torch does not"


def checkpoint_experts(rng: np.random.Generator, experts: int, fmt: str, h: int = H, inter: int = INTER
                       ) -> list[tuple]:
    """(gate, up, down) checkpoint linears per expert; gate and up with different global scales."""
    def linear(name: str, n: int, k: int, scale: float):
        w = (rng.standard_normal((n, k)) * scale / np.sqrt(k)).astype(np.float32)
        if fmt == "nvfp4":
            q = ref.nvfp4_quantize(w)
            return ref.NVFP4Linear(name, q.weight_packed, q.weight_scale, q.weight_scale_2)
        q = ref.fp8_quantize(w, fmt)
        return ref.FP8Linear(name, q.weight, q.weight_scale, fmt)

    return [(linear(f"e{e}.gate", inter, h, 1.0), linear(f"e{e}.up", inter, h, 3.0),
             linear(f"e{e}.down", h, inter, 1.0)) for e in range(experts)]


def w16_stacks(packed: PackedExperts) -> tuple[np.ndarray, np.ndarray]:
    pairs = [packed.expert(e) for e in range(packed.num_experts)]
    return tuple(np.stack([w.reference_dequantize() for w in ws]) for ws in zip(*pairs, strict=True))


def routing(rng: np.random.Generator, m: int, experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The HF routers' top-k (renormalized) of random router logits."""
    return ref_moe.route(rng.standard_normal((m, experts)).astype(np.float32), top_k, renormalize=True)


def hot_expert(ids: np.ndarray, hot: int) -> np.ndarray:
    """Top-2 ids where every token's first choice is expert `hot` (its second stays distinct)."""
    out = ids.copy()
    out[:, 0] = hot
    out[:, 1] = np.where(ids[:, 1] == hot, ids[:, 0], ids[:, 1])
    out[out[:, 1] == hot, 1] = hot + 1
    return out


def case(fmt: str, experts: int, m: int, top_k: int, seed: int = 0, device: str = "cpu"):
    rng = np.random.default_rng(seed)
    packed = PackedExperts.from_checkpoint(checkpoint_experts(rng, experts, fmt)).to(device)
    x = rng.standard_normal((m, H)).astype(np.float16)
    return packed, x, *routing(rng, m, experts, top_k)


def run(packed: PackedExperts, x: np.ndarray, weights: np.ndarray, ids: np.ndarray) -> np.ndarray:
    device = packed.device
    return packed.forward(torch.from_numpy(x).to(device), torch.from_numpy(weights).to(device),
                          torch.from_numpy(ids).to(device)).cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["nvfp4", "tensor", "channel", "block"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_the_op_lies_inside_the_reference_bound(device, fmt, top_k):
    device_or_skip(device)
    packed, x, weights, ids = case(fmt, 8, 24, top_k, seed=top_k, device=device)
    w13, w2 = w16_stacks(packed)
    lo, hi = ref_moe.moe_bounds(x, w13, w2, weights, ids)
    y = run(packed, x, weights, ids)
    assert ((lo <= y) & (y <= hi)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["nvfp4", "channel"])
@pytest.mark.parametrize("m", [32, 40])
def test_a_tokens_output_does_not_depend_on_the_batch(device, fmt, m):
    """Bit for bit: a permuted batch, each token alone, and a batch where every token picks one hot expert
    (32 or 40 tokens on it: past one 32-row piece of the CUDA kernels at 40)."""
    device_or_skip(device)
    packed, x, weights, ids = case(fmt, 8, m, 2, seed=3, device=device)

    def alone(routed_ids: np.ndarray, full: np.ndarray, row: int) -> None:
        got = run(packed, x[row:row + 1], weights[row:row + 1], routed_ids[row:row + 1])
        assert np.array_equal(got.view(np.uint16), full[row:row + 1].view(np.uint16)), row

    full = run(packed, x, weights, ids)
    perm = np.random.default_rng(0).permutation(m)
    assert np.array_equal(run(packed, x[perm], weights[perm], ids[perm]).view(np.uint16), full[perm].view(np.uint16))
    for row in (0, 17, m - 1):
        alone(ids, full, row)
    hot = hot_expert(ids, 5)
    all_hot = run(packed, x, weights, hot)
    for row in (3, m - 2):
        alone(hot, all_hot, row)


def test_the_op_is_a_loop_of_qpns_linear_ops_on_the_same_path():
    """At M <= 8 tokens per expert the ops' own dispatch runs the fused CPU kernels too: the MoE op equals
    gated linear + linear per expert through PackedWeight.linear, then the reference combine, bit for bit."""
    packed, x, weights, ids = case("nvfp4", 4, 6, 2, seed=9)
    y = np.zeros((6, 2, H), np.float16)
    for e in np.unique(ids):
        rows, choices = np.nonzero(ids == e)
        w13, w2 = packed.expert(int(e))
        hidden = w13.linear(torch.from_numpy(x[rows]), gated=True)
        y[rows, choices] = w2.linear(hidden).numpy()
    assert np.array_equal(run(packed, x, weights, ids).view(np.uint16), ref_moe.combine(y, weights).view(np.uint16))


@pytest.mark.parametrize("device", DEVICES)
def test_experts_nobody_hits_are_never_needed_and_an_empty_batch_is_empty(device):
    """Experts 2..7 hold NaN-decoding codes (e4m3 0x7F) after the bound is taken: any use of them shows."""
    device_or_skip(device)
    packed, x, weights, ids = case("channel", 8, 5, 2, device=device)
    hit_once = np.zeros_like(ids)
    hit_once[:, 1] = 1
    lo, hi = ref_moe.moe_bounds(x, *w16_stacks(packed), weights, hit_once)
    for buffers in (packed.w13, packed.w2):
        buffers["codes"][2:].fill_(0x7F)
    y = run(packed, x, weights, hit_once)
    assert ((lo <= y) & (y <= hi)).all()
    empty = run(packed, x[:0], weights[:0], ids[:0])
    assert empty.shape == (0, H) and empty.dtype == np.float16


def test_gate_and_up_keep_their_own_nvfp4_global_scales():
    """NVFP4 gate and up of one expert carry different weight_scale_2; w13's per-tile global scales keep
    both (never one max() for the pair), so each half dequantizes to its own checkpoint's W16."""
    rng = np.random.default_rng(4)
    experts = checkpoint_experts(rng, 2, "nvfp4")
    gate, up, _ = experts[0]
    assert gate.global_scale != up.global_scale
    w13, _ = PackedExperts.from_checkpoint(experts).expert(0)
    got = w13.reference_dequantize()
    want = np.concatenate([ref.nvfp4_dequantize(lin.weight_packed, lin.weight_scale, lin.global_scale)
                           for lin in (gate, up)])
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_stack_and_its_errors():
    rng = np.random.default_rng(6)
    (g, u, d), = checkpoint_experts(rng, 1, "nvfp4")
    w13 = PackedWeight.stack_rows([PackedWeight.from_checkpoint(g), PackedWeight.from_checkpoint(u)])
    w2 = PackedWeight.from_checkpoint(d)
    packed = PackedExperts.stack([(w13, w2), (w13, w2)])
    assert packed.num_experts == 2 and packed.w13["global_scale"].shape == (2, 2 * INTER // 32)
    with pytest.raises(ValueError, match=r"w13 \[2I, H\], w2 \[H, I\]"):
        PackedExperts.stack([(w2, w13)])
    fp8_down = PackedWeight.from_checkpoint(checkpoint_experts(rng, 1, "channel")[0][2])
    with pytest.raises(ValueError, match="one layout"):
        PackedExperts.stack([(w13, fp8_down)])


def test_the_op_refuses_bad_input_with_one_clear_message():
    packed, x, weights, ids = case("nvfp4", 4, 3, 2)
    xt, wt, it = torch.from_numpy(x), torch.from_numpy(weights), torch.from_numpy(ids)
    with pytest.raises(ValueError, match="topk_weights must have dtype torch.float32"):
        packed.forward(xt, wt.double(), it)
    with pytest.raises(ValueError, match=r"must both be \[M, top_k\] with M = 3"):
        packed.forward(xt, wt[:2], it[:2])
    with pytest.raises(ValueError, match="x must have dtype torch.float16"):
        packed.forward(xt.float(), wt, it)
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2I, H\] and w2 \[E, H, I\]"):
        packed.forward(xt[:, :64].contiguous(), wt, it)


def test_torch_compile_traces_the_op():
    packed, x, weights, ids = case("channel", 4, 5, 2)
    args = (torch.from_numpy(x), torch.from_numpy(weights), torch.from_numpy(ids))
    compiled = torch.compile(packed.forward, fullgraph=True, backend="aot_eager")  # traces the fake op too
    assert torch.equal(compiled(*args), packed.forward(*args))
