"""vLLM's base classes, or local stand-ins where vLLM is not installed.

Without vLLM this package still imports: minimal local base classes stand in for vLLM's
(`VLLM_AVAILABLE` says which are in use), and tests/vllm_standin.py drives the same call sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

try:  # vLLM is optional: subclass its classes when it is installed
    from vllm.model_executor.layers.linear import LinearBase as _VllmLinearBase
    from vllm.model_executor.layers.linear import LinearMethodBase
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod as _VllmUnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod as _VllmKVCacheMethod

    VLLM_AVAILABLE = True
except ImportError:
    VLLM_AVAILABLE = False
    _VllmLinearBase = None
    _VllmUnquantizedLinearMethod = None
    _VllmKVCacheMethod = None

    class QuantizationConfig(ABC):  # the part of vLLM's base class this module relies on
        def __init__(self):
            super().__init__()
            self.packed_modules_mapping: dict[str, list[str]] = {}

        @staticmethod
        def get_from_keys(config: Mapping, keys: list[str]) -> Any:
            for key in keys:
                if key in config:
                    return config[key]
            raise ValueError(f"Cannot find any of {keys} in the model's quantization config.")

        @staticmethod
        def get_from_keys_or(config: Mapping, keys: list[str], default: Any) -> Any:
            try:
                return QuantizationConfig.get_from_keys(config, keys)
            except ValueError:
                return default

    class LinearMethodBase(ABC):  # vLLM's LinearMethodBase / QuantizeMethodBase, minimal
        @abstractmethod
        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                           output_size, params_dtype, **extra_weight_attrs):
            raise NotImplementedError

        @abstractmethod
        def apply(self, layer, x, bias=None):
            raise NotImplementedError

        def process_weights_after_loading(self, layer) -> None:
            return
