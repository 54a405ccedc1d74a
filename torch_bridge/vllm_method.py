"""Compatibility module: the vLLM adapter lives in qpn.torch_bridge.vllm (its docstring is the user
documentation). Installs made before the split name `qpn.torch_bridge.vllm_method:register` as their
`vllm.general_plugins` entry point, so this module keeps every public name it had."""

from .vllm import (
    VLLM_AVAILABLE,
    QPNConfig,
    QPNFP8LinearMethod,
    QPNKVCacheMethod,
    QPNNVFP4LinearMethod,
    QPNUnquantizedLinearMethod,
    register,
)
from .vllm._compat import LinearMethodBase, QuantizationConfig
from .vllm.config import (
    ATTENTION_CLASSES,
    CONFIG_FILENAMES,
    DEFAULT_PACKED_MODULES,
    EMBEDDING_CLASSES,
    LAYER_ALGOS,
    MIN_CAPABILITY,
    QUANT_ALGOS,
    QUANT_NAME,
    is_linear_layer,
)
from .vllm.methods import FP8_K_MULTIPLE, NVFP4_GROUP_SIZE, NVFP4_K_MULTIPLE
from .vllm.sharding import FP8_BLOCK, QKV_SHARD_IDS, ShardGeometry, layer_geometry

__all__ = ["ATTENTION_CLASSES", "CONFIG_FILENAMES", "DEFAULT_PACKED_MODULES", "EMBEDDING_CLASSES", "FP8_BLOCK",
           "FP8_K_MULTIPLE", "LAYER_ALGOS", "MIN_CAPABILITY", "NVFP4_GROUP_SIZE", "NVFP4_K_MULTIPLE", "QKV_SHARD_IDS",
           "QUANT_ALGOS", "QUANT_NAME", "VLLM_AVAILABLE", "LinearMethodBase", "QPNConfig", "QPNFP8LinearMethod",
           "QPNKVCacheMethod", "QPNNVFP4LinearMethod", "QPNUnquantizedLinearMethod", "QuantizationConfig",
           "ShardGeometry", "is_linear_layer", "layer_geometry", "register"]
