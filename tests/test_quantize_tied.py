"""`qpn quantize` on a model whose lm_head is tied to its embedding (SmolLM2, Llama-3.2-1B, Qwen2.5-0.5B, ...):
the source holds no lm_head tensor, but vLLM builds a ParallelLMHead all the same and takes it for quantized
unless the config's exclude list names it ("layer 'lm_head' (ParallelLMHead) is quantized in this checkpoint").
ModelOpt lists lm_head whatever the model; so must qpn quantize, in every output form. Checked through the same
QPNConfig.layer_algo that vLLM's get_quant_method asks (importable without vLLM)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qpn.checkpoints.quantize import quantize_checkpoint
from qpn.checkpoints.safetensors_io import write_safetensors
from qpn.torch_bridge.vllm.config import QPNConfig

HIDDEN, INTER, VOCAB = 32, 64, 48
LAYER = "model.layers.0"
LINEARS = {f"{LAYER}.self_attn.{p}_proj": (HIDDEN, HIDDEN) for p in "qkvo"} | {
    f"{LAYER}.mlp.gate_proj": (INTER, HIDDEN), f"{LAYER}.mlp.up_proj": (INTER, HIDDEN),
    f"{LAYER}.mlp.down_proj": (HIDDEN, INTER)}


def write_float_llama(folder, tied: bool) -> None:
    """A one-layer fp16 Llama folder; tied: no lm_head tensor (as save_pretrained writes a tied model)."""
    rng = np.random.default_rng(0)
    shapes = dict(LINEARS, **{"model.embed_tokens": (VOCAB, HIDDEN)}, **({} if tied else {"lm_head": (VOCAB, HIDDEN)}))
    tensors = {f"{m}.weight": rng.normal(0, 0.1, s).astype(np.float16) for m, s in shapes.items()}
    for norm in (f"{LAYER}.input_layernorm", f"{LAYER}.post_attention_layernorm", "model.norm"):
        tensors[f"{norm}.weight"] = np.ones(HIDDEN, np.float16)
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": VOCAB, "tie_word_embeddings": tied, "torch_dtype": "float16"}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "mxfp4"])
def test_lm_head_is_listed_unquantized_tied_or_not(tmp_path, fmt, tied):
    write_float_llama(tmp_path / "src", tied)
    report = quantize_checkpoint(tmp_path / "src", tmp_path / "out", fmt)
    assert sorted(report.quantized) == sorted(LINEARS)
    assert sorted(report.excluded) == ["lm_head", "model.embed_tokens"]
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    listed = qc.get("ignore", qc.get("exclude_modules"))
    assert sorted(listed) == ["lm_head", "model.embed_tokens"], qc
    if fmt != "mxfp4":  # compressed-tensors: vLLM's qpn method does not claim it (tests/test_vllm_real_model.py)
        hf_quant = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
        assert sorted(hf_quant["exclude_modules"]) == ["lm_head", "model.embed_tokens"]
        config = QPNConfig.from_config(qc)
        assert config.layer_algo("lm_head", fused=False) is None
        assert config.layer_algo(f"{LAYER}.self_attn.q_proj", fused=False) is not None
