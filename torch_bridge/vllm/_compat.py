"""vLLM's base classes, or local stand-ins where vLLM is not installed; the layer type the adapter sees.

Without vLLM this package still imports: minimal local base classes stand in for vLLM's
(`VLLM_AVAILABLE` says which are in use), and tests/vllm_standin.py drives the same call sequence.
To mypy, vLLM is untyped (pyproject's ignore_missing_imports), so its classes are `Any` and the
stand-ins are the checked definitions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor
from torch.nn import Parameter

if TYPE_CHECKING:
    from ...ref.formats import WeightFormat
    from .sharding import ShardGeometry


class QPNLayer(Protocol):
    """A vLLM linear layer as the qpn methods see it (a torch.nn.Module; vLLM's own attributes, such
    as tp_rank or output_sizes, are read by name in sharding.layer_geometry).

    create_weights registers the checkpoint Parameters (weight, weight_scale, ...) and sets
    qpn_geometry and the three attributes vLLM's ModelOpt methods set; process_weights_after_loading
    replaces the checkpoint Parameters with qpn_codes / qpn_scales (/ qpn_global_scale) and sets
    qpn_weight_format (ref.formats' description; qpn_format its public name) and qpn_out_features,
    which apply reads.
    """

    qpn_geometry: ShardGeometry
    logical_widths: list[int]
    input_size_per_partition: int
    output_size_per_partition: int
    weight: Tensor
    weight_scale: Tensor
    weight_scale_2: Tensor
    qpn_format: str  # qpn_weight_format.format, kept for code that reads the public name
    qpn_weight_format: WeightFormat
    qpn_codes: Tensor
    qpn_scales: Tensor
    qpn_global_scale: Tensor  # NVFP4 only
    qpn_out_features: int

    def register_parameter(self, name: str, param: Parameter | None) -> None: ...


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
    def create_weights(self, layer: QPNLayer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, layer: QPNLayer, x: Tensor, bias: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: QPNLayer) -> None:
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
