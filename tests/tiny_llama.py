"""A tiny Llama written as a real ModelOpt export, and its dense fp16 twin, for the real-vLLM tests.

`write_tiny_llama(folder, algo)` builds a 2-layer `LlamaForCausalLM` (hidden 256, GQA 4/2 heads of
64, intermediate 512, vocabulary 512) from a fixed seed, quantizes its seven linears per layer with
`qpn.ref`'s ModelOpt quantizers (vllm_standin.quantize_linear) and writes the folder exactly as
ModelOpt's `export_hf_checkpoint` lays it out: the full Hugging Face `config.json` (model_type
"llama", so vLLM accepts it) with a `quantization_config` {"quant_method": "modelopt", "quant_algo",
"kv_cache_quant_algo", "group_size", "exclude_modules": ["lm_head"], "producer"} (plus
`quantized_layers` for MIXED_PRECISION), the older `hf_quant_config.json` {"producer",
"quantization": {...}} beside it when asked, and one `model.safetensors` holding, per quantized layer X:
- NVFP4: X.weight U8 [N, K/2], X.weight_scale F8_E4M3 [N, K/16], X.weight_scale_2 F32 [], X.input_scale F32 []
  (not for W4A16_NVFP4);
- FP8: X.weight F8_E4M3 [N, K], X.weight_scale F32 [] (per tensor) or [N, 1] (per channel) or
  [N/128, 1, K/128, 1] (FP8_PB_WO, 128x128 blocks: ModelOpt 0.47's 4-D shape), X.input_scale F32 [] (per tensor);
- with kv_cache_quant_algo "FP8": self_attn.k_proj.k_scale and self_attn.v_proj.v_scale F32 [].
Embeddings, norms and lm_head stay float16 (ModelOpt excludes lm_head).

`write_dense_twin(folder, linears)` writes the same model unquantized: every quantized
linear replaced by its contract W16 (vllm_standin.contract_w16), so vLLM's own fp16 path and
qpn compute with bit-identical weights and differ only in accumulation order and rounding.

The weights are random (std 0.08 instead of Llama's 0.02, so that the next-token distribution is
peaked enough for greedy decoding to be meaningful); no download, a few MB per folder.
"""

from __future__ import annotations

import json
import os

import numpy as np
import vllm_standin as st

from qpn import ref
from qpn.apps import tiny_llama as tiny_example
from qpn.ref.fp8 import fp8_block_grid_4d
from qpn.ref.geometry import GROUP_K

# the shape of qpn.apps.tiny_llama (the README's served example): one model, two vocabularies
HIDDEN, INTERMEDIATE, LAYERS = tiny_example.HIDDEN, tiny_example.INTERMEDIATE, tiny_example.LAYERS
HEADS, KV_HEADS, HEAD_DIM = tiny_example.HEADS, tiny_example.KV_HEADS, tiny_example.HEAD_DIM
VOCAB = 512
INIT_STD = tiny_example.INIT_STD

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# MIXED_PRECISION: attention in FP8 (per tensor), the MLP in NVFP4 - as ModelOpt's auto-quantize mixes them
MIXED = {"self_attn": "FP8", "mlp": "NVFP4"}
ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MIXED_PRECISION")
KV_SCALE = np.float32(0.0625)  # a recognisable value, not 1.0: the test checks vLLM received it


def hf_config() -> dict:
    """A complete Hugging Face LlamaConfig dict (what transformers' save_pretrained writes)."""
    return {**tiny_example.hf_llama_config(VOCAB, 256), "transformers_version": "4.56.0"}


def _shape(name: str) -> tuple[int, int]:
    leaf = name.rpartition(".")[2]
    return {"q_proj": (HIDDEN, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
            "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HIDDEN),
            "gate_proj": (INTERMEDIATE, HIDDEN), "up_proj": (INTERMEDIATE, HIDDEN),
            "down_proj": (HIDDEN, INTERMEDIATE)}[leaf]


def dense_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The float32 model: {HF tensor name: array}."""
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.normal(0, 1.0, (VOCAB, HIDDEN)),
         "model.norm.weight": 1 + rng.normal(0, 0.05, HIDDEN),
         "lm_head.weight": rng.normal(0, INIT_STD, (VOCAB, HIDDEN))}
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"model.layers.{i}.{norm}.weight"] = 1 + rng.normal(0, 0.05, HIDDEN)
        for leaf in LINEARS:
            w[f"model.layers.{i}.{leaf}.weight"] = rng.normal(0, INIT_STD, _shape(leaf))
    return {k: v.astype(np.float32) for k, v in w.items()}


# bf16_exact (write_tiny_llama): each quantized weight scaled so that its amax is this value exactly, which
# makes ModelOpt's per-tensor scale a power of two (NVFP4 weight_scale_2 = amax / 2688 = 2^-13, FP8
# weight_scale = amax / 448 = 2^-10): every W16 (e2m1 x e4m3 x 2^-13, or e4m3 x 2^-10: at most 6 significant
# bits on fp16's grid) is then a bf16 value, so a bf16 twin holds the very W16 qpn computes with
BF16_EXACT_AMAX = {"NVFP4": 2688 * 2.0**-13, "W4A16_NVFP4": 2688 * 2.0**-13, "FP8": 448 * 2.0**-10}


def _bf16_exact(w: np.ndarray, algo: str) -> np.ndarray:
    """w scaled so that max|w| is BF16_EXACT_AMAX[algo] exactly (the largest element set to it)."""
    if algo not in BF16_EXACT_AMAX:
        raise ValueError(f"bf16_exact needs one scale per tensor (NVFP4, W4A16_NVFP4, FP8), got {algo!r}")
    amax = np.float32(BF16_EXACT_AMAX[algo])
    out = (w * (amax / np.abs(w).max())).astype(np.float32)
    i = np.unravel_index(np.argmax(np.abs(out)), out.shape)
    out[i] = np.copysign(amax, out[i])
    return np.clip(out, -amax, amax)


def layer_algo(algo: str, name: str) -> str:
    if algo != "MIXED_PRECISION":
        return algo
    return MIXED[name.split(".")[3]]


def _stored(linear) -> dict[str, ref.StoredTensor]:
    """The tensors ModelOpt's export writes for one quantized linear (module docstring)."""
    n = linear.name
    if isinstance(linear, ref.NVFP4Linear):
        out = {f"{n}.weight": ref.StoredTensor(linear.weight_packed, "U8"),
               f"{n}.weight_scale": ref.StoredTensor(linear.weight_scale, "F8_E4M3"),
               f"{n}.weight_scale_2": ref.StoredTensor(np.asarray(linear.global_scale, np.float32), "F32")}
    else:
        scale = np.asarray(linear.weight_scale, np.float32)
        if linear.granularity == "channel":
            scale = scale.reshape(-1, 1)
        elif linear.granularity == "block":
            scale = scale.reshape(fp8_block_grid_4d(*linear.weight.shape))
        out = {f"{n}.weight": ref.StoredTensor(linear.weight, "F8_E4M3"),
               f"{n}.weight_scale": ref.StoredTensor(scale, "F32")}
    if linear.input_scale is not None:
        out[f"{n}.input_scale"] = ref.StoredTensor(np.asarray(linear.input_scale, np.float32), "F32")
    return out


def quantization_section(algo: str, kv_cache: bool) -> dict:
    """The ModelOpt quantization description (config.json form; hf_quant_config.json nests it)."""
    section = {"quant_algo": algo, "kv_cache_quant_algo": "FP8" if kv_cache else None,
               "exclude_modules": ["lm_head"]}
    if algo in ("NVFP4", "W4A16_NVFP4"):
        section["group_size"] = GROUP_K
    if algo == "MIXED_PRECISION":
        layers = {}
        for i in range(LAYERS):
            for leaf in LINEARS:
                name = f"model.layers.{i}.{leaf}"
                entry = {"quant_algo": layer_algo(algo, name)}
                if entry["quant_algo"] == "NVFP4":
                    entry["group_size"] = GROUP_K
                layers[name] = entry
        section["quantized_layers"] = layers
    return section


def _write_folder(folder, config: dict, stored: dict, hf_quant_config: dict | None = None) -> None:
    os.makedirs(folder, exist_ok=False)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if hf_quant_config is not None:
        with open(os.path.join(folder, "hf_quant_config.json"), "w") as f:
            json.dump(hf_quant_config, f, indent=2)
    ref.write_safetensors(os.path.join(folder, "model.safetensors"), stored, {"format": "pt"})


def write_tiny_llama(folder, algo: str, *, kv_cache: bool = False, form: str = "config.json",
                     seed: int = 0, bf16_exact: bool = False) -> dict:
    """Write the quantized tiny Llama; returns {layer name: NVFP4Linear | FP8Linear}.

    form: "config.json" (quantization_config inside config.json, ModelOpt >= 0.29) or
    "hf_quant_config.json" (the older form: config.json without quantization_config).
    bf16_exact: every quantized weight rescaled to BF16_EXACT_AMAX first, so that its W16 are bf16 values.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    weights = dense_weights(seed)
    stored, linears = {}, {}
    for name, w in weights.items():
        layer = name.removesuffix(".weight")
        if layer.rpartition(".")[0].endswith(("self_attn", "mlp")):
            layer_algo_ = layer_algo(algo, layer)
            linears[layer] = st.quantize_linear(layer, _bf16_exact(w, layer_algo_) if bf16_exact else w, layer_algo_)
            stored.update(_stored(linears[layer]))
        else:
            stored[name] = ref.StoredTensor(w.astype(np.float16), "F16")
    if kv_cache:
        for i in range(LAYERS):
            for kv in ("k", "v"):
                stored[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"] = ref.StoredTensor(
                    np.asarray(KV_SCALE, np.float32), "F32")
    section = quantization_section(algo, kv_cache)
    producer = {"name": "modelopt", "version": "0.47.0"}
    config = hf_config()
    hf_quant = None
    if form == "config.json":
        config["quantization_config"] = {"quant_method": "modelopt", **section, "producer": producer}
    elif form == "hf_quant_config.json":
        hf_quant = {"producer": producer, "quantization": section}
    else:
        raise ValueError(f"form must be 'config.json' or 'hf_quant_config.json', got {form!r}")
    _write_folder(folder, config, stored, hf_quant)
    return linears


def write_dense_twin(folder, linears: dict, seed: int = 0) -> None:
    """The same model in float16 with every quantized linear replaced by its contract W16."""
    stored = {}
    for name, w in dense_weights(seed).items():
        layer = name.removesuffix(".weight")
        if layer in linears:
            stored[name] = ref.StoredTensor(st.contract_w16(linears[layer]), "F16")
        else:
            stored[name] = ref.StoredTensor(w.astype(np.float16), "F16")
    _write_folder(folder, hf_config(), stored)
