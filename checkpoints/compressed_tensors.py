"""compressed-tensors checkpoints (llm-compressor's nvfp4-pack-quantized): the config, the tensor names,
the reciprocal global scales, a layer's assembly and how it is written.

The config is config.json's `quantization_config` with quant_method "compressed-tensors" (a
ModelOpt hf_quant_config.json beside it is an error). A loaded checkpoint's quant_algo is "NVFP4".

On-disk layout (per layer X): X.weight_packed U8 [N, K/2], X.weight_scale F8_E4M3 [N, K/16],
X.weight_global_scale F32 [1], X.input_global_scale F32 [1] (optional).

compressed-tensors stores RECIPROCAL global scales (weight_global_scale = 2688 / amax).
Loading converts to multipliers, global_scale = RN32(1 / weight_global_scale) (one correctly
rounded fp32 division, as vLLM does), and saving converts back with the same operation.
Exactness caveat: x -> RN32(1/RN32(1/x)) is not the identity in fp32. About 17 % of fp32
values in every binade are never the result of RN32(1/r) for any r, and exactly those fail
the round trip. Consequences: (a) load -> save of a compressed-tensors file can change the
bytes of weight_global_scale (several stored values map to one multiplier), yet load -> save ->
load returns the identical global_scale (a loaded multiplier is always reachable); (b) saving
a multiplier that is not reachable (e.g. a ModelOpt amax / 2688) as compressed-tensors and
loading it back returns the neighbouring reachable value, 1 ulp away. Dequantizing with the
multiplier, RN32(e4m3 * g), can also differ by 1 ulp from compressed-tensors' own
RN32(e4m3 / weight_global_scale). tests/test_checkpoint.py pins both effects on real values.

What the config decides (every error is a CheckpointError naming the file and the tensor or
config entry at fault; the rules both producers share: qpn.checkpoints.producer):
`config_groups` (all in format nvfp4-pack-quantized, weights num_bits 4, type float, strategy
tensor_group, group_size 16), `targets` and `ignore` (exact names or "re:" regexes, re.match as
compressed-tensors does; a class target such as "Linear" matches every non-ignored quantized
layer; exact names and regexes are explicit, classes are not, and an exact name must match a
layer). quantization_status, if present, must be "compressed". FP8 layers cannot be stored here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..ref.geometry import GROUP_K
from .checkpoint import Checkpoint, CheckpointError, FP8Linear, NVFP4Linear
from .producer import NVFP4_DTYPES, LayerTensors, Producer, Recipe, TensorMeta, build_linear, config_error, str_list
from .safetensors_io import StoredTensor

CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
# role -> on-disk suffix of an NVFP4 layer
NVFP4_LAYOUT = {"weight_packed": "weight_packed", "weight_scale": "weight_scale", "global_scale": "weight_global_scale",
                "input_scale": "input_global_scale"}
_MODELOPT_NAMES = ("weight_scale_2", "weight_scale_inv")
_RECIPROCAL_ROLES = ("global_scale", "input_scale")  # stored as 1 / the multiplier


def _group_targets(gname: str, group: object, top_format: object, source: str) -> list[str]:
    """The targets of one config_groups entry, after checking that it is NVFP4 as qpn reads it."""
    entry = f"config_groups.{gname}"
    if not isinstance(group, Mapping):
        raise config_error(source, entry, f"must be an object, got {group!r}")
    fmt = group.get("format") or top_format
    if fmt != CT_NVFP4_FORMAT:
        raise config_error(source, entry, f"format {fmt!r} is not supported; qpn reads compressed-tensors "
                                          f"{CT_NVFP4_FORMAT!r} only")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise config_error(source, entry, "weights must be an object {num_bits, type, strategy, group_size}")
    rules = {"num_bits": 4, "type": "float", "group_size": GROUP_K}
    for field, expected in rules.items():
        if weights.get(field) != expected:
            raise config_error(source, f"{entry}.weights.{field}",
                               f"{field} must be {expected!r} for {CT_NVFP4_FORMAT}, got {weights.get(field)!r}")
    if weights.get("strategy", "tensor_group") != "tensor_group":
        raise config_error(source, f"{entry}.weights.strategy",
                           f"strategy must be 'tensor_group' for {CT_NVFP4_FORMAT}, got {weights.get('strategy')!r}")
    return str_list(group.get("targets"), source, f"{entry}.targets")


def _match(prefix: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], prefix) is not None
    return entry == prefix


def _is_class_target(entry: str) -> bool:
    return not entry.startswith("re:") and "." not in entry and entry[:1].isupper()


class CompressedTensors(Producer):
    """A compressed-tensors checkpoint's quantization config, read (module docstring)."""

    format = "compressed-tensors"

    def __init__(self, qc: Mapping, source: str) -> None:
        """Read `qc`, config.json's quantization_config."""
        status = qc.get("quantization_status")
        if status is not None and status != "compressed":
            raise config_error(source, "quantization_status", f"quantization_status must be 'compressed' (packed "
                                                              f"weights on disk), got {status!r}")
        top_format = qc.get("format")
        groups = qc.get("config_groups")
        if not isinstance(groups, Mapping) or not groups:
            raise config_error(source, "config_groups", "compressed-tensors config needs a non-empty config_groups")
        super().__init__("NVFP4", source)
        self.targets: list[str] = []
        for gname, group in groups.items():
            self.targets += _group_targets(gname, group, top_format, source)
        if top_format not in (None, CT_NVFP4_FORMAT, "mixed-precision"):
            raise config_error(source, "format", f"format {top_format!r} is not supported; qpn reads "
                                                 f"{CT_NVFP4_FORMAT!r}")
        self.ignore = str_list(qc.get("ignore"), source, "ignore")

    def algo_for(self, prefix: str) -> tuple[str | None, bool]:
        if any(_match(prefix, e) for e in self.ignore):
            return None, False
        for entry in self.targets:
            if not _is_class_target(entry) and _match(prefix, entry):
                self.used.add(entry)
                return "NVFP4", True
        if any(_is_class_target(e) for e in self.targets):
            return "NVFP4", False
        return None, bool(self.targets)

    def explicit_entries(self) -> list[str]:
        return [e for e in self.targets if not e.startswith("re:") and not _is_class_target(e)]

    def is_layer_tensor(self, name: str, suffix: str, tensor: TensorMeta, layers: LayerTensors) -> bool:
        if suffix in _MODELOPT_NAMES:
            layers.foreign(name, "ModelOpt")
        if suffix in NVFP4_LAYOUT.values():
            return True
        if suffix == "weight" and tensor.dtype in ("U8", "F8_E4M3"):
            layers.fail(name, f"a {tensor.dtype} weight in a compressed-tensors checkpoint: only {CT_NVFP4_FORMAT!r} "
                              "(weight_packed) is supported")
        return False

    def recipe(self, prefix: str, present: str, layers: LayerTensors) -> Recipe:
        if f"{prefix}.weight" in layers.stored:
            layers.fail(f"{prefix}.weight", f"layer {prefix!r} has both weight and compressed tensors ({present}); "
                                            f"{CT_NVFP4_FORMAT} stores weight_packed only")
        return layers.nvfp4_recipe(prefix, NVFP4_LAYOUT, present)

    def build(self, recipe: Recipe, array_of: Callable[[str], np.ndarray], file_of: Mapping[str, str]
              ) -> NVFP4Linear | FP8Linear:
        names = recipe.names
        arrays = {role: array_of(name) for role, name in names.items()}
        for role in _RECIPROCAL_ROLES:  # reciprocal -> multiplier: one correctly rounded fp32 division
            if role in arrays:
                raw = arrays[role]
                if raw.size != 1 or raw.ndim > 1 or not (np.isfinite(raw).all() and (raw > 0).all()):
                    raise CheckpointError(file_of[names[role]], names[role],
                                          f"must be one finite fp32 value > 0 (compressed-tensors stores the "
                                          f"reciprocal scale, e.g. 2688/amax), got shape {raw.shape}, "
                                          f"values {raw.reshape(-1)[:4]}")
                arrays[role] = np.float32(1) / raw.reshape(())
        return build_linear(NVFP4Linear, recipe, file_of, weight_packed=arrays["weight_packed"],
                            weight_scale=arrays["weight_scale"], global_scale=arrays["global_scale"],
                            input_scale=arrays.get("input_scale"))

    def linear_tensors(self, linear: NVFP4Linear | FP8Linear) -> dict[str, StoredTensor]:
        name = linear.name
        if not isinstance(linear, NVFP4Linear):
            raise ValueError(f"linear {name!r} is FP8, but a compressed-tensors checkpoint here holds "
                             f"{CT_NVFP4_FORMAT} layers only; save it as format='modelopt'")
        stored = {f"{name}.{NVFP4_LAYOUT[role]}": StoredTensor(getattr(linear, role), NVFP4_DTYPES[role])
                  for role in ("weight_packed", "weight_scale")}
        for role in _RECIPROCAL_ROLES:
            value = getattr(linear, role)
            if value is not None:  # back to the reciprocal, RN32(1/x)
                stored[f"{name}.{NVFP4_LAYOUT[role]}"] = StoredTensor(
                    np.asarray(np.float32(1) / value, np.float32).reshape((1,)), "F32")
        return stored

    @staticmethod
    def default_quantization_config(checkpoint: Checkpoint) -> dict[str, Any]:
        """config.json 'quantization_config' for a checkpoint built in memory (explicit layer names)."""
        unquantized = sorted(name.rpartition(".")[0] for name, t in checkpoint.tensors.items()
                             if name.endswith(".weight") and len(t.shape) == 2)
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP_K,
                   "symmetric": True, "dynamic": False}
        groups: dict[str, dict[str, object]] = {}
        for with_input in (True, False):
            targets = sorted(n for n, lin in checkpoint.linears.items() if (lin.input_scale is not None) == with_input)
            if targets:
                groups[f"group_{len(groups)}"] = {
                    "targets": targets, "weights": dict(weights), "format": CT_NVFP4_FORMAT,
                    "input_activations": dict(weights, dynamic="local") if with_input else None,
                }
        return {"quant_method": "compressed-tensors", "format": CT_NVFP4_FORMAT, "quantization_status": "compressed",
                "config_groups": groups, "ignore": unquantized}


__all__ = ["CT_NVFP4_FORMAT", "CompressedTensors"]
