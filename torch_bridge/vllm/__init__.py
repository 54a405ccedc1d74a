"""vLLM linear method for ModelOpt NVFP4 / FP8 / MIXED_PRECISION checkpoints on cards without FP4/FP8 units.

Use (qpn installed next to vLLM; its `vllm.general_plugins` entry point makes every vLLM process
call `register()`; if VLLM_PLUGINS is set, it must list "qpn"):

    vllm serve ./Llama-3.1-8B-Instruct-NVFP4 --quantization qpn --dtype half
    LLM(model="./Llama-3.1-8B-Instruct-NVFP4", quantization="qpn", dtype="half")  # or dtype="bfloat16"

Public names:
- `QPNConfig` (a vLLM `QuantizationConfig`): name "qpn", activations fp16 or bf16, minimum capability 75,
  config files [] (vLLM reads config.json's quantization_config or hf_quant_config.json itself; a
  checkpoint with neither is refused: "<path> is not a quantized checkpoint ..."), `from_config`,
  `get_quant_method(layer, prefix)`.
- `QPNNVFP4LinearMethod`, `QPNFP8LinearMethod` (vLLM `LinearMethodBase`): `create_weights`,
  `process_weights_after_loading`, `apply(layer, x, bias=None)`; qpn extras `apply_gated(layer, x)`
  (fused gate_up + SiLU-and-mul epilogue inside the op) and `dequantized_weight(layer)`.
- `QPNUnquantizedLinearMethod`: the excluded-layer method used only when vLLM is not installed
  (with vLLM, excluded layers get vLLM's own `UnquantizedLinearMethod`).
- `register()`: calls vLLM's `register_quantization_config("qpn")`; idempotent.
- `QPNKVCacheMethod`: vLLM's BaseKVCacheMethod for attention layers (None without vLLM).
- `VLLM_AVAILABLE`: whether vLLM's classes are the base classes in use (_compat.py).

Load errors: every error raised while vLLM loads a qpn layer names the checkpoint tensor and the vLLM
layer, e.g. "checkpoint tensor 'model.layers.0.self_attn.q_proj.weight_scale' (vLLM layer
'model.layers.0.self_attn.qkv_proj', shard 'q'): weight_scale must be finite and > 0, got nan; ...", with
values and indices as the checkpoint file holds them (sharding.py, "Errors").

Where each part lives, as in vLLM's ModelOpt method:
- config.py: `QPNConfig` (ModelOpt config parsing, which method each layer gets) and `register()`.
- sharding.py: `ShardGeometry` / `layer_geometry` (how a rank's parameters map onto the checkpoint
  tensors) and the weight loaders every parameter carries.
- methods.py: the linear methods (parameters, prepack after loading, apply) and `QPNKVCacheMethod`.
- _compat.py: vLLM's base classes, or the local stand-ins without vLLM.

Not covered: MoE experts (a quantized FusedMoE layer raises), a quantized lm_head / embedding
(raises: ModelOpt excludes lm_head), MXFP8 / NVFP4_AWQ / W4A8 and other algorithms (refused with the
reason), compressed-tensors checkpoints, pre-sharded (`is_sharded_weight`) loading and
`--load-format dummy` (every shard must be loaded), and `qpn pack` folders: vLLM takes the original
checkpoint (a packed folder is refused with one line saying so: config.py, `refuse_packed_folder`).
"""

from ._compat import VLLM_AVAILABLE
from .config import QPNConfig, register
from .methods import QPNFP8LinearMethod, QPNKVCacheMethod, QPNNVFP4LinearMethod, QPNUnquantizedLinearMethod

__all__ = ["QPNConfig", "QPNFP8LinearMethod", "QPNKVCacheMethod", "QPNNVFP4LinearMethod", "QPNUnquantizedLinearMethod",
           "VLLM_AVAILABLE", "register"]
