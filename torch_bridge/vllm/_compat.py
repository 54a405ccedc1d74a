"""vLLM's base classes, or local stand-ins where vLLM is not installed (the layer type the adapter sees,
QPNLayer, is sharding.py's, beside the ShardGeometry it carries).

Without vLLM this package still imports: minimal local base classes stand in for vLLM's
(`VLLM_AVAILABLE` says which are in use), and tests/vllm_standin.py drives the same call sequence.
To mypy, vLLM is untyped (pyproject's ignore_missing_imports), so its classes are `Any` and the
stand-ins are the checked definitions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

# What QuantizationConfig.get_quant_method returns: a vLLM QuantizeMethodBase (qpn's linear methods, vLLM's
# UnquantizedLinearMethod, QPNKVCacheMethod). vLLM is untyped to mypy, so its classes are Any.
QuantizeMethod = Any


class _QuantizationConfigStandIn:  # the part of vLLM's QuantizationConfig this package relies on
    def __init__(self) -> None:
        super().__init__()
        self.packed_modules_mapping: dict[str, list[str]] = {}

    @staticmethod
    def get_from_keys(config: Mapping[str, Any], keys: list[str]) -> Any:
        for key in keys:
            if key in config:
                return config[key]
        raise ValueError(f"Cannot find any of {keys} in the model's quantization config.")

    @staticmethod
    def get_from_keys_or(config: Mapping[str, Any], keys: list[str], default: Any) -> Any:
        try:
            return _QuantizationConfigStandIn.get_from_keys(config, keys)
        except ValueError:
            return default


class _LinearMethodBaseStandIn(ABC):  # vLLM's LinearMethodBase / QuantizeMethodBase, minimal
    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return


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
    QuantizationConfig = _QuantizationConfigStandIn
    LinearMethodBase = _LinearMethodBaseStandIn
