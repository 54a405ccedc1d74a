"""Checkpoints written by REAL ModelOpt 0.47 (tests/fixtures/modelopt/, made by
tests/fixtures/make_modelopt_fixtures.py) load everywhere qpn reads checkpoints, and the loaded
tiny Llama gives ModelOpt's own fake-quantized logits.

No ModelOpt is needed here: each fixture folder carries its reference logits.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from qpn import ref
from qpn.apps import cli
from qpn.checkpoints import packed
from qpn.torch_bridge import QPNLinear, load_quantized

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "modelopt")
# fixture -> (quant_algo, layer kind, granularity of the exported scales)
EXPORTS = {
    "fp8_tensor": ("FP8", ref.FP8Linear, "tensor"),
    "fp8_channel": ("FP8_PER_CHANNEL_PER_TOKEN", ref.FP8Linear, "channel"),
    "fp8_block": ("FP8_PB_WO", ref.FP8Linear, "block"),
    "nvfp4": ("NVFP4", ref.NVFP4Linear, None),
}
LAYERS = 2 * 7  # q, k, v, o, gate, up, down per decoder layer; lm_head and embeddings stay unquantized
# Logit bound. qpn's forward differs from the reference (an fp32 Llama holding ModelOpt's own fp32
# dequantization) only in fp16 roundings: each quantized linear sees RN16(x) and RN16 of its weight
# (QPN8's S16 adds at most one more ulp) and rounds its output once, about 3 * 2^-11 relative per
# linear. Two decoder layers put 2 attention + 2 MLP stages (7 linears) in series before lm_head,
# so 4 * 3 * 2^-11 of max|logit|, doubled for the softmax / SiLU / RMSNorm gains: 24 * 2^-11.
# Measured (2026-02, these fixtures): 3.5 to 4.3 * 2^-11. A wrong block scale or a swapped layer
# moves the logits by >= 10 % of max|logit|, i.e. >= 200 * 2^-11.
LOGIT_BOUND_FACTOR = 24 * 2.0**-11


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def reference(name: str) -> tuple[torch.Tensor, np.ndarray]:
    with open(os.path.join(fixture(name), "reference_input_ids.json")) as f:
        ids = torch.tensor(json.load(f)["input_ids"])
    return ids, np.load(os.path.join(fixture(name), "reference_logits.npy"))


def llama_from_config(name: str, device=None):
    """A float32 LlamaForCausalLM built from the fixture's own config.json (random weights)."""
    transformers = pytest.importorskip("transformers", reason="the fixtures are Llama models (the [test] extra has it)")
    config = transformers.AutoConfig.from_pretrained(fixture(name))
    assert config.model_type == "llama"
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return transformers.LlamaForCausalLM(config).float().eval()


def assert_logits_match(model, name: str) -> None:
    ids, want = reference(name)
    with torch.no_grad():
        got = model(ids).logits.float().numpy()
    bound = LOGIT_BOUND_FACTOR * float(np.abs(want).max())
    worst = float(np.abs(got - want).max())
    assert worst <= bound, f"{name}: max |qpn - ModelOpt| = {worst:.4g} > bound {bound:.4g}"


def test_the_fixtures_are_what_modelopt_writes():
    """Pins the export facts qpn relies on (so a regenerated fixture that changed them is noticed)."""
    hf = json.load(open(os.path.join(fixture("fp8_block"), "hf_quant_config.json")))
    assert hf["quantization"]["quant_algo"] == "fp8_pb_wo" and hf["producer"]["version"].startswith("0.47")
    header = ref.read_safetensors_header(os.path.join(fixture("fp8_block"), "model.safetensors"))
    shapes = {name: tuple(info.shape) for name, info in header.tensors.items() if name.endswith("weight_scale")}
    assert shapes["model.layers.0.mlp.gate_proj.weight_scale"] == (2, 1, 1, 1)  # N = 256, K = 128
    assert shapes["model.layers.0.mlp.down_proj.weight_scale"] == (1, 1, 2, 1)  # N = 128, K = 256
    assert shapes["model.layers.0.self_attn.k_proj.weight_scale"] == ()  # one (ragged, N = 64) block: 0-d


@pytest.mark.parametrize("name", list(EXPORTS))
def test_every_export_loads_in_ref(name):
    algo, kind, granularity = EXPORTS[name]
    checkpoint = ref.load_checkpoint(fixture(name))
    assert checkpoint.quant_algo == algo and len(checkpoint.linears) == LAYERS
    assert all(isinstance(linear, kind) for linear in checkpoint.linears.values())
    if granularity is not None:
        assert {linear.granularity for linear in checkpoint.linears.values()} == {granularity}
    assert "lm_head.weight" in checkpoint.tensors and "model.embed_tokens.weight" in checkpoint.tensors


def test_block_scales_keep_modelopts_values_in_order():
    """[N/128, 1, K/128, 1] on disk -> [N/128, K/128] with the same values in the same order."""
    checkpoint = ref.load_checkpoint(fixture("fp8_block"))
    stored = ref.read_safetensors(os.path.join(fixture("fp8_block"), "model.safetensors")).tensors
    for layer in ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.v_proj"):
        linear = checkpoint.linears[layer]
        on_disk = stored[f"{layer}.weight_scale"].array
        assert linear.weight_scale.shape == ref.fp8.fp8_block_grid(linear.n, linear.k)
        assert np.array_equal(linear.weight_scale.reshape(-1).view(np.uint32), on_disk.reshape(-1).view(np.uint32))


@pytest.mark.parametrize("name", list(EXPORTS))
def test_inspect_pack_verify_accept_every_export(tmp_path, name, capsys):
    out = tmp_path / "packed"
    assert cli.main(["inspect", fixture(name), "-q"]) == 0
    assert cli.main(["pack", fixture(name), str(out), "-q"]) == 0
    assert cli.main(["verify", str(out), "-q"]) == 0
    assert cli.main(["verify", fixture(name), "-q"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("name", list(EXPORTS))
def test_load_quantized_gives_modelopts_logits(name):
    model = llama_from_config(name)
    report = load_quantized(model, fixture(name), strict=True)  # strict: rotary inv_freq is not "missing"
    assert len(report.quantized) == LAYERS and report.unexpected == [] and report.missing == []
    assert isinstance(model.model.layers[1].mlp.down_proj, QPNLinear)
    assert_logits_match(model, name)


@pytest.mark.parametrize("name", ["fp8_block", "nvfp4"])
def test_load_quantized_from_the_packed_folder_gives_the_same_logits(tmp_path, name):
    packed.pack_checkpoint(fixture(name), tmp_path / "packed")
    from_source, from_packed = llama_from_config(name), llama_from_config(name)
    load_quantized(from_source, fixture(name), strict=True)
    load_quantized(from_packed, tmp_path / "packed", strict=True)
    ids, _ = reference(name)
    with torch.no_grad():
        assert torch.equal(from_source(ids).logits, from_packed(ids).logits)  # same W16, same ops: same bits
    assert_logits_match(from_packed, name)


# ----------------------------------------------------------------------------- meta-device models


def test_a_meta_device_model_loads_and_gives_the_same_logits():
    """Built under torch.device("meta") (no weight memory), filled from the checkpoint: the same forward."""
    on_cpu = llama_from_config("nvfp4")
    load_quantized(on_cpu, fixture("nvfp4"), strict=True)
    on_meta = llama_from_config("nvfp4", device="meta")
    assert on_meta.model.rotary_emb.inv_freq.is_meta  # non-persistent: no checkpoint has it
    load_quantized(on_meta, fixture("nvfp4"), strict=True)
    tensors = dict(on_meta.named_parameters()) | dict(on_meta.named_buffers())
    assert not [name for name, t in tensors.items() if t.is_meta]
    assert torch.equal(on_meta.model.rotary_emb.inv_freq, on_cpu.model.rotary_emb.inv_freq)
    ids, _ = reference("nvfp4")
    with torch.no_grad():
        assert torch.equal(on_meta(ids).logits, on_cpu(ids).logits)


def test_a_meta_tensor_the_checkpoint_lacks_is_named_and_nothing_changes():
    model = llama_from_config("fp8_channel", device="meta")
    checkpoint = ref.load_checkpoint(fixture("fp8_channel"))
    tensors = {name: t for name, t in checkpoint.tensors.items() if name != "model.norm.weight"}
    partial = ref.Checkpoint(checkpoint.format, checkpoint.quant_algo, checkpoint.linears, tensors,
                             checkpoint.config, checkpoint.hf_quant_config)
    with pytest.raises(ValueError, match=r"meta device.*'model\.norm\.weight'"):
        load_quantized(model, partial)
    assert model.model.embed_tokens.weight.is_meta and not isinstance(model.model.layers[0].mlp.up_proj, QPNLinear)
