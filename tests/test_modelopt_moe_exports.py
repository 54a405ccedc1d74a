"""Mixture-of-experts checkpoints written by REAL ModelOpt 0.47 (tests/fixtures/modelopt/{qwen3moe,mixtral}_
{fp8,nvfp4}, made by tests/fixtures/make_modelopt_moe_fixtures.py; issue 22 part 2): each expert is a
linear of its own on disk, which qpn's checkpoint reader, `qpn inspect`, `pack` and `verify` take as they
take any linear; the router stays unquantized. The experts' W16 from qpn.ref, put into transformers'
fused expert parameters, give ModelOpt's reference logits.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from qpn import ref
from qpn.apps import cli

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "modelopt")
MOE = {  # fixture -> (quant_algo, layer kind, on-disk (gate, up, down) of expert e in layer i, router)
    "qwen3moe_fp8": ("FP8", ref.FP8Linear),
    "qwen3moe_nvfp4": ("NVFP4", ref.NVFP4Linear),
    "mixtral_fp8": ("FP8", ref.FP8Linear),
    "mixtral_nvfp4": ("NVFP4", ref.NVFP4Linear),
}
EXPERT_NAMES = {"qwen3moe": ("model.layers.{i}.mlp.experts.{e}", ("gate_proj", "up_proj", "down_proj"),
                             "model.layers.{i}.mlp.gate"),
                "mixtral": ("model.layers.{i}.block_sparse_moe.experts.{e}", ("w1", "w3", "w2"),
                            "model.layers.{i}.block_sparse_moe.gate")}
LAYERS, EXPERTS = 2, 8
# tests/test_modelopt_exports.py's derivation (RN16 of x, of W16 and of each linear's output against ModelOpt's
# fp32 dequantization: 3 * 2^-11 relative per stage, doubled for the softmax / SiLU / RMSNorm gains), with
# one more RN16 in each MoE stage (the expert combine): 2 attention stages x 3 + 2 MoE stages x 4 = 14, x 2:
# 28 * 2^-11 of max|logit|. Measured (2026-12, these fixtures, load_quantized): 1.6 to 3.4 * 2^-11.
LOGIT_BOUND_FACTOR = 28 * 2.0**-11
# The same derivation for the two comparisons that differ in fewer roundings: an fp32 model holding W16
# against ModelOpt's fp32 dequantization (only W's RN16: 4 stages x 1, x 2 = 8; measured 0.8-1.9 * 2^-11),
# and qpn against an fp32 twin holding the same W16 (RN16 of x and of each output per stage, plus the
# combine: 2 attention stages x 2 + 2 MoE stages x 3 = 10, x 2 = 20; measured 0.6 * 2^-11).
W16_ONLY_FACTOR = 8 * 2.0**-11
SAME_W16_FACTOR = 20 * 2.0**-11


def family(name: str) -> str:
    return name.split("_")[0]


@pytest.mark.parametrize("name", sorted(MOE))
def test_the_fixtures_are_what_modelopt_writes(name):
    algo, kind = MOE[name]
    folder = os.path.join(FIXTURES, name)
    hf = json.load(open(os.path.join(folder, "hf_quant_config.json")))
    block, roles, router = EXPERT_NAMES[family(name)]
    assert hf["producer"]["version"].startswith("0.47") and hf["quantization"]["quant_algo"] == algo
    assert {router.format(i=i) for i in range(LAYERS)} <= set(hf["quantization"]["exclude_modules"])
    checkpoint = ref.load_checkpoint(folder)
    experts = {block.format(i=i, e=e) + f".{r}" for i in range(LAYERS) for e in range(EXPERTS) for r in roles}
    assert experts <= set(checkpoint.linears) and all(isinstance(lin, kind) for lin in checkpoint.linears.values())
    assert len(checkpoint.linears) == len(experts) + 4 * LAYERS  # + q, k, v, o
    assert {f"{router.format(i=i)}.weight" for i in range(LAYERS)} <= set(checkpoint.tensors)


@pytest.mark.parametrize("name", sorted(MOE))
def test_pack_and_verify_take_every_expert(tmp_path, capsys, name):
    out = tmp_path / "packed"
    assert cli.main(["pack", os.path.join(FIXTURES, name), str(out), "-q"]) == 0
    assert cli.main(["verify", str(out), "-q"]) == 0
    assert f"{len(ref.load_checkpoint(os.path.join(FIXTURES, name)).linears)} of" in capsys.readouterr().out


def hf_model(name: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(os.path.join(FIXTURES, name))
    cls = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "mixtral": transformers.MixtralForCausalLM}
    torch.manual_seed(0)
    return cls[config.model_type](config).float().eval()


def float32_of(tensor: ref.StoredTensor) -> torch.Tensor:
    """An unquantized checkpoint tensor as float32 (bf16 is stored as its upper 16 bits)."""
    if tensor.dtype == "BF16":
        return torch.from_numpy((np.asarray(tensor.array).view(np.uint16).astype(np.uint32) << 16).view(np.float32))
    return torch.from_numpy(np.asarray(tensor.array, dtype=np.float32))


def w16_of(linear) -> np.ndarray:
    if isinstance(linear, ref.NVFP4Linear):
        return ref.nvfp4_dequantize(linear.weight_packed, linear.weight_scale, linear.global_scale)
    return ref.fp8_dequantize(linear.weight, linear.weight_scale)


@pytest.mark.parametrize("name", sorted(MOE))
def test_the_experts_w16_give_modelopts_logits(name):
    """An fp32 transformers model holding qpn.ref's W16 of every linear (the experts' per-expert linears
    stacked into the fused gate_up_proj / down_proj, gate rows first) reproduces the reference logits."""
    folder = os.path.join(FIXTURES, name)
    checkpoint = ref.load_checkpoint(folder)
    block, (gate, up, down), router = EXPERT_NAMES[family(name)]
    model = hf_model(name)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for prefix, linear in checkpoint.linears.items():
            if f"{prefix}.weight" in params:
                params[f"{prefix}.weight"].copy_(torch.from_numpy(w16_of(linear).astype(np.float32)))
        for i in range(LAYERS):
            experts = model.model.layers[i].mlp.experts
            for e in range(EXPERTS):
                lin = {r: checkpoint.linears[f"{block.format(i=i, e=e)}.{r}"] for r in (gate, up, down)}
                w13 = np.concatenate([w16_of(lin[gate]), w16_of(lin[up])])
                experts.gate_up_proj[e].copy_(torch.from_numpy(w13.astype(np.float32)))
                experts.down_proj[e].copy_(torch.from_numpy(w16_of(lin[down]).astype(np.float32)))
            router_weight = checkpoint.tensors[f"{router.format(i=i)}.weight"]
            model.model.layers[i].mlp.gate.weight.copy_(float32_of(router_weight))
        for name_, tensor in checkpoint.tensors.items():
            if name_ in params:
                params[name_].copy_(float32_of(tensor))
        with open(os.path.join(folder, "reference_input_ids.json")) as f:
            ids = torch.tensor(json.load(f)["input_ids"])
        got = model(ids).logits.numpy()
    want = np.load(os.path.join(folder, "reference_logits.npy"))
    bound = W16_ONLY_FACTOR * float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= bound


@pytest.mark.parametrize("packed_first", [False, True])
@pytest.mark.parametrize("name", sorted(MOE))
def test_load_quantized_puts_qpn_experts_into_the_hf_model(tmp_path, name, packed_first):
    """load_quantized (from the export, or from its `qpn pack` folder) replaces each transformers experts
    module by a QPNExperts (and attention linears by QPNLinear) and the model gives ModelOpt's logits
    within the dense fixtures' bound; both folders load to the same buffers."""
    from qpn.torch_bridge import load_quantized
    from qpn.torch_bridge.experts import QPNExperts

    source = os.path.join(FIXTURES, name)
    if packed_first:
        assert cli.main(["pack", source, str(tmp_path / "packed"), "-q"]) == 0
        source = str(tmp_path / "packed")
    model = hf_model(name)
    report = load_quantized(model, source)
    assert {f"model.layers.{i}.mlp.experts" for i in range(LAYERS)} <= set(report.quantized)
    assert all(isinstance(model.model.layers[i].mlp.experts, QPNExperts) for i in range(LAYERS))
    with open(os.path.join(FIXTURES, name, "reference_input_ids.json")) as f:
        ids = torch.tensor(json.load(f)["input_ids"])
    with torch.no_grad():
        got = model(ids).logits.numpy()
    want = np.load(os.path.join(FIXTURES, name, "reference_logits.npy"))
    assert float(np.abs(got - want).max()) <= LOGIT_BOUND_FACTOR * float(np.abs(want).max())


def test_convert_quantizes_a_float_moe_models_experts():
    """convert() puts QPNExperts (and QPNLinear) into a float Qwen3-MoE; the converted model gives the logits
    of an fp32 twin holding the W16 it quantized to (the experts' per-expert dequantization stacked into the
    fused parameters), within SAME_W16_FACTOR."""
    import copy

    from qpn.torch_bridge import QPNLinear, convert
    from qpn.torch_bridge.experts import QPNExperts

    model = hf_model("qwen3moe_fp8")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    twin = copy.deepcopy(model)
    skipped = convert(model, "fp8", fp8_granularity="channel", skip=["lm_head"])
    assert [n for n, _ in skipped] == ["lm_head"]
    twin_modules = dict(twin.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, QPNLinear):
                twin_modules[name].weight.copy_(module.dequantized_weight().float())
            elif isinstance(module, QPNExperts):
                packed = module.packed_experts
                for e in range(packed.num_experts):
                    w13, w2 = packed.expert(e)
                    twin_modules[name].gate_up_proj[e].copy_(w13.dequantize().float())
                    twin_modules[name].down_proj[e].copy_(w2.dequantize().float())
        assert all(isinstance(model.model.layers[i].mlp.experts, QPNExperts) for i in range(LAYERS))
        ids = torch.tensor([[1, 5, 9, 200, 17, 3]])
        got, want = model(ids).logits.numpy(), twin(ids).logits.numpy()
    assert float(np.abs(got - want).max()) <= SAME_W16_FACTOR * float(np.abs(want).max())


def test_a_model_cast_leaves_the_experts_buffers_as_they_are():
    """model.half() / .to(torch.bfloat16) change no packed buffer (QPNLinear's rule): the model still runs."""
    from qpn.torch_bridge import load_quantized

    model = hf_model("qwen3moe_nvfp4")
    load_quantized(model, os.path.join(FIXTURES, "qwen3moe_nvfp4"))
    experts = model.model.layers[0].mlp.experts
    before = {name: t.dtype for name, t in experts.named_buffers()}
    model.to(torch.bfloat16)
    assert {name: t.dtype for name, t in experts.named_buffers()} == before
    assert before["w13_global_scale"] == torch.float32
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits.float()).all()
