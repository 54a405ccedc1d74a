"""qpn.ref.moe: the MoE block's reference (issue 22, part 1). The contract's order and roundings,
the derived bound holding for other legal implementations (torch fp32 matmuls, another combine
order), batch invariance, and the routing of HF's Qwen3-MoE / Mixtral routers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qpn import ref
from qpn.ref import moe

E, H, INTER, TOP_K = 8, 64, 96, 2


def experts(rng: np.random.Generator, e: int = E, h: int = H, inter: int = INTER) -> tuple[np.ndarray, np.ndarray]:
    """W16 of e experts as NVFP4 weights decode to (the contract's values: ref.nvfp4_dequantize)."""
    def w16(n: int, k: int) -> np.ndarray:
        q = ref.nvfp4_quantize((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
        return ref.nvfp4_dequantize(q.weight_packed, q.weight_scale, q.weight_scale_2)

    return np.stack([w16(2 * inter, h) for _ in range(e)]), np.stack([w16(h, inter) for _ in range(e)])


def routed(rng: np.random.Generator, m: int, e: int = E, top_k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    return moe.route(rng.standard_normal((m, e)).astype(np.float32), top_k, renormalize=True)


def tokens(rng: np.random.Generator, m: int, h: int = H) -> np.ndarray:
    return rng.standard_normal((m, h)).astype(np.float16)


def test_moe_is_the_contract_step_by_step():
    """out[m] = RN16(fp32 sum over j, in top-k order, of RN32(w_j * y_j)),
    y_j = linear(linear_gated(x, w13[e]), w2[e])."""
    rng = np.random.default_rng(1)
    w13, w2 = experts(rng)
    x = tokens(rng, 5)
    weights, ids = routed(rng, 5)
    out = moe.moe(x, w13, w2, weights, ids)
    for m in range(5):
        acc = np.float32(0)
        for j in range(TOP_K):
            y = ref.linear(ref.linear_gated(x[m:m + 1], w13[ids[m, j]]), w2[ids[m, j]])[0]
            acc = (acc + weights[m, j] * y.astype(np.float32)).astype(np.float32)
        assert np.array_equal(out[m].view(np.uint16), acc.astype(np.float16).view(np.uint16)), m


def test_a_tokens_output_does_not_depend_on_the_batch():
    """Batch invariance: each token alone, and the batch in another order, give the same bits."""
    rng = np.random.default_rng(2)
    w13, w2 = experts(rng)
    x = tokens(rng, 12)
    weights, ids = routed(rng, 12)
    full = moe.moe(x, w13, w2, weights, ids)
    perm = rng.permutation(12)
    assert np.array_equal(moe.moe(x[perm], w13, w2, weights[perm], ids[perm]).view(np.uint16),
                          full[perm].view(np.uint16))
    for m in (0, 7):
        alone = moe.moe(x[m:m + 1], w13, w2, weights[m:m + 1], ids[m:m + 1])
        assert np.array_equal(alone.view(np.uint16), full[m:m + 1].view(np.uint16))


def torch_fp32_moe(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, weights: np.ndarray, ids: np.ndarray,
                   reverse: bool) -> np.ndarray:
    """Another implementation of the contract: torch fp32 matmuls (BLAS order), torch's fp32 silu, the
    combine in reversed top-k order."""
    xt, inter = torch.from_numpy(x).float(), w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for j in (reversed(range(ids.shape[1])) if reverse else range(ids.shape[1])):
        for m in range(x.shape[0]):
            e = int(ids[m, j])
            gu = (xt[m] @ torch.from_numpy(w13[e]).float().T).half()
            silu = torch.nn.functional.silu(gu[:inter].float()).half()
            h = (silu.float() * gu[inter:].float()).half()
            y = (h.float() @ torch.from_numpy(w2[e]).float().T).half()
            out[m] += float(weights[m, j]) * y.float()
    return out.half().numpy()


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_other_legal_implementations_lie_inside_the_bound(top_k):
    rng = np.random.default_rng(top_k)
    w13, w2 = experts(rng)
    x = tokens(rng, 6)
    weights, ids = routed(rng, 6, top_k=top_k)
    lo, hi = moe.moe_bounds(x, w13, w2, weights, ids)
    for y in (moe.moe(x, w13, w2, weights, ids), torch_fp32_moe(x, w13, w2, weights, ids, reverse=True)):
        assert ((lo <= y) & (y <= hi)).all()
    # Its width: a legal gate / up may round to either fp16 neighbour (the fp32 order moves the exact
    # sum) and the down projection adds I such interval widths, random in sign: of the order of sqrt(I)
    # ulps of y (measured median 20.5 at I = 96, sqrt(I) = 9.8). Not a tolerance on a result: a check
    # that the bound stays a tight one (4 sqrt(I) = 39), so a derivation gone loose fails here
    width = hi.astype(np.float32) - lo.astype(np.float32)
    ulps = width / np.abs(np.spacing(hi.astype(np.float16))).astype(np.float32)
    assert np.median(ulps) <= 4 * np.sqrt(INTER), np.median(ulps)


def test_the_bound_catches_a_wrong_expert_and_a_wrong_weight():
    rng = np.random.default_rng(5)
    w13, w2 = experts(rng)
    x = tokens(rng, 4)
    weights, ids = routed(rng, 4)
    lo, hi = moe.moe_bounds(x, w13, w2, weights, ids)
    wrong_expert = ids.copy()
    wrong_expert[:, 0] = (wrong_expert[:, 0] + 1) % E
    for y in (moe.moe(x, w13, w2, weights, wrong_expert), moe.moe(x, w13, w2, weights * np.float32(1.01), ids)):
        assert not ((lo <= y) & (y <= hi)).all()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_route_is_the_hf_routers(family):
    """The top-k experts of transformers' routers (Qwen3-MoE with norm_topk_prob, Mixtral), their
    weights within a few fp32 ulps: torch's fp32 softmax (expf, an fp32 sum, a division) against float64
    rounded once, then the renormalization's fp32 sum and division on both sides: a handful of RN32
    steps, each at most 1/2 ulp, on each side (measured: at most 4.6 ulps)."""
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router

        config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=TOP_K, norm_topk_prob=True)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router

        config = MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=TOP_K)
    router = Router(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        x = torch.randn(64, H)
        logits, hf_weights, hf_ids = router(x)
    weights, ids = moe.route(logits.numpy(), TOP_K, renormalize=True)
    assert np.array_equal(ids, hf_ids.numpy())
    np.testing.assert_allclose(weights, hf_weights.float().numpy(), rtol=8 * 2.0**-23, atol=0)


def test_route_without_renormalization_keeps_the_softmax_probabilities():
    logits = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)
    weights, ids = moe.route(logits, 2, renormalize=False)
    p = np.exp([0.0, 1.0, 2.0, 3.0]) / np.exp([0.0, 1.0, 2.0, 3.0]).sum()
    assert ids.tolist() == [[3, 2]] and np.array_equal(weights, p[[3, 2]].astype(np.float32)[None])
    tie = moe.route(np.zeros((1, 4), np.float32), 2, renormalize=True)
    assert tie[1].tolist() == [[0, 1]] and tie[0].tolist() == [[0.5, 0.5]]  # ties: lower index first


@pytest.mark.parametrize("bad, message", [
    (lambda a: {**a, "topk_ids": a["topk_ids"] + E}, r"topk_ids must lie in \[0, 8\)"),
    (lambda a: {**a, "topk_weights": -a["topk_weights"]}, "topk_weights must be finite and >= 0"),
    (lambda a: {**a, "topk_weights": a["topk_weights"].astype(np.float64)}, "topk_weights must have dtype float32"),
    (lambda a: {**a, "w2": a["w2"][:, :, :-1]}, r"w13 must be \[E, 2I, H\]"),
    (lambda a: {**a, "topk_ids": a["topk_ids"][:-1]}, "must both be"),
])
def test_bad_inputs_are_one_clear_error(bad, message):
    rng = np.random.default_rng(7)
    w13, w2 = experts(rng, e=E, h=H, inter=32)
    weights, ids = routed(rng, 3)
    args = {"x": tokens(rng, 3), "w13": w13, "w2": w2, "topk_weights": weights, "topk_ids": ids}
    for fn in (moe.moe, moe.moe_bounds):
        with pytest.raises(ValueError, match=message):
            fn(**bad(args))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_computes_what_the_hf_block_computes(family):
    """transformers' sparse MoE block (fp32, the same W16 as its expert weights: gate_up_proj = w13 with
    gate rows first, down_proj = w2) agrees with route + moe to fp16 precision: the reference models the
    same experts, order of gate / up and routing weights (it rounds where the contract rounds)."""
    rng = np.random.default_rng(11)
    w13, w2 = experts(rng)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER,
                                norm_topk_prob=True)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=TOP_K, intermediate_size=INTER)
    block = Block(config).eval()
    x = tokens(rng, 16)
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(rng.standard_normal((E, H)).astype(np.float32)))
        block.experts.gate_up_proj.copy_(torch.from_numpy(w13.astype(np.float32)))
        block.experts.down_proj.copy_(torch.from_numpy(w2.astype(np.float32)))
        hf = block(torch.from_numpy(x).float()[None])[0].numpy()
        logits = torch.nn.functional.linear(torch.from_numpy(x).float(), block.gate.weight).numpy()
    ours = moe.moe(x, w13, w2, *moe.route(logits, TOP_K, renormalize=True)).astype(np.float32)
    # the reference rounds gate / up, h, y and the sum to fp16 where HF keeps fp32: 4 RN16 of 2^-11 relative,
    # x 2 for the SiLU / product gains (tests/test_modelopt_exports.py's rule): 8 * 2^-11 of max|out|;
    # measured 1.4 * 2^-11
    assert float(np.abs(ours - hf).max()) <= 8 * 2.0**-11 * float(np.abs(hf).max())


def test_the_bf16_bound_holds_the_bf16_reference_stays_tight_and_catches_a_wrong_expert():
    """dtype="bfloat16": the same interval argument with RN_bf16 and the fp16 rows' term (ref.moe docstring)."""
    from qpn.ref.dtypes import BF16, bf16_round

    rng = np.random.default_rng(11)
    w13, w2 = experts(rng)
    x = bf16_round(tokens(rng, 6).astype(np.float32))
    weights, ids = routed(rng, 6)
    lo, hi = moe.moe_bounds(x, w13, w2, weights, ids, dtype=BF16)
    assert lo.dtype == hi.dtype == np.float32
    assert ((lo <= moe.moe(x, w13, w2, weights, ids, dtype=BF16)) & (moe.moe(x, w13, w2, weights, ids, dtype=BF16)
                                                                     <= hi)).all()
    # bf16's grid is 8x coarser than fp16's, so the same argument gives about as many (bf16) ulps as fp16's
    ulps = (hi - lo) / np.abs(np.spacing(hi.astype(np.float32)) * 2.0**16)
    assert np.median(ulps) <= 4 * np.sqrt(INTER), np.median(ulps)
    wrong = ids.copy()
    wrong[:, 0] = (wrong[:, 0] + 1) % E
    y = moe.moe(x, w13, w2, weights, wrong, dtype=BF16)
    assert not ((lo <= y) & (y <= hi)).all()
