"""compressed-tensors checkpoints (llm-compressor's nvfp4-pack-quantized and mxfp4-pack-quantized): the config,
the tensor names, the reciprocal global scales, a layer's assembly and how it is written.

The config is config.json's `quantization_config` with quant_method "compressed-tensors" (a
ModelOpt hf_quant_config.json beside it is an error). A loaded checkpoint's quant_algo is "NVFP4", or
"MXFP4" when its config groups are mxfp4-pack-quantized (one of the two formats per checkpoint).

On-disk layout (per layer X): X.weight_packed U8 [N, K/2], X.weight_scale F8_E4M3 [N, K/16],
X.weight_global_scale F32 [1], X.input_global_scale F32 [1] (optional). MXFP4 (docs/FORMATS.md, "MXFP4, as
compressed-tensors writes it"): X.weight_packed U8 [N, K/2], X.weight_scale U8 e8m0 [N, K/32], nothing
else; read into an MXFP4Linear.

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
tensor_group, group_size 16; or all mxfp4-pack-quantized: num_bits 4, type float, strategy group,
group_size 32), `targets` and `ignore` (exact names or "re:" regexes, re.match as
compressed-tensors does; a class target such as "Linear" matches every non-ignored quantized
layer; exact names and regexes are explicit, classes are not, and an exact name must match a
layer). quantization_status, if present, must be "compressed". FP8 layers cannot be stored here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..ref.formats import MX_BLOCK, QPNMX
from ..ref.geometry import GROUP_K
from .checkpoint import Checkpoint, CheckpointError, MXFP4Linear, NVFP4Linear, QuantizedLinear
from .producer import (
    MXFP4_ALGO,
    NVFP4_DTYPES,
    LayerTensors,
    Producer,
    Recipe,
    TensorMeta,
    build_linear,
    config_error,
    str_list,
)
from .safetensors_io import StoredTensor

CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
CT_MXFP4_FORMAT = "mxfp4-pack-quantized"
# format -> (the checkpoint's quant_algo, the weights fields it must have; a missing strategy is the format's)
_FORMAT_RULES: dict[str, tuple[str, dict[str, object]]] = {
    CT_NVFP4_FORMAT: ("NVFP4", {"num_bits": 4, "type": "float", "group_size": GROUP_K, "strategy": "tensor_group"}),
    CT_MXFP4_FORMAT: (MXFP4_ALGO, {"num_bits": 4, "type": "float", "group_size": MX_BLOCK, "strategy": "group"}),
}
# role of an MXFP4Linear -> on-disk suffix (no global scale: e8m0 scales are the whole scale)
MXFP4_LAYOUT = {"blocks": "weight_packed", "scales": "weight_scale"}
# role -> on-disk suffix of an NVFP4 layer
NVFP4_LAYOUT = {"weight_packed": "weight_packed", "weight_scale": "weight_scale", "global_scale": "weight_global_scale",
                "input_scale": "input_global_scale"}
_MODELOPT_NAMES = ("weight_scale_2", "weight_scale_inv")
_RECIPROCAL_ROLES = ("global_scale", "input_scale")  # stored as 1 / the multiplier


def _group_targets(gname: str, group: object, top_format: object, source: str) -> tuple[str, list[str]]:
    """(the format, the targets) of one config_groups entry, after checking that it is NVFP4 or MXFP4 as qpn
    reads it."""
    entry = f"config_groups.{gname}"
    if not isinstance(group, Mapping):
        raise config_error(source, entry, f"must be an object, got {group!r}")
    fmt = group.get("format") or top_format
    if fmt not in _FORMAT_RULES:
        raise config_error(source, entry, f"format {fmt!r} is not supported; qpn reads compressed-tensors "
                                          f"{CT_NVFP4_FORMAT!r} and {CT_MXFP4_FORMAT!r} only")
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise config_error(source, entry, "weights must be an object {num_bits, type, strategy, group_size}")
    for field, expected in _FORMAT_RULES[fmt][1].items():
        got = weights.get(field, expected) if field == "strategy" else weights.get(field)
        if got != expected:
            raise config_error(source, f"{entry}.weights.{field}",
                               f"{field} must be {expected!r} for {fmt}, got {got!r}")
    return fmt, str_list(group.get("targets"), source, f"{entry}.targets")


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
        self.targets: list[str] = []
        formats = set()
        for gname, group in groups.items():
            fmt, targets = _group_targets(gname, group, top_format, source)
            formats.add(fmt)
            self.targets += targets
        if len(formats) > 1:
            raise config_error(source, "config_groups", f"config groups mix {' and '.join(sorted(formats))}; qpn "
                                                        "reads one of the two formats per checkpoint")
        self.layer_format = formats.pop()
        super().__init__(_FORMAT_RULES[self.layer_format][0], source)
        if top_format not in (None, CT_NVFP4_FORMAT, CT_MXFP4_FORMAT, "mixed-precision"):
            raise config_error(source, "format", f"format {top_format!r} is not supported; qpn reads "
                                                 f"{CT_NVFP4_FORMAT!r} and {CT_MXFP4_FORMAT!r}")
        self.ignore = str_list(qc.get("ignore"), source, "ignore")

    def algo_for(self, prefix: str) -> tuple[str | None, bool]:
        if any(_match(prefix, e) for e in self.ignore):
            return None, False
        for entry in self.targets:
            if not _is_class_target(entry) and _match(prefix, entry):
                self.used.add(entry)
                return self.quant_algo, True
        if any(_is_class_target(e) for e in self.targets):
            return self.quant_algo, False
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
                              f"and {CT_MXFP4_FORMAT!r} (weight_packed) are supported")
        return False

    def recipe(self, prefix: str, present: str, layers: LayerTensors) -> Recipe:
        if f"{prefix}.weight" in layers.stored:
            layers.fail(f"{prefix}.weight", f"layer {prefix!r} has both weight and compressed tensors ({present}); "
                                            f"{self.layer_format} stores weight_packed only")
        if self.quant_algo != MXFP4_ALGO:
            return layers.nvfp4_recipe(prefix, NVFP4_LAYOUT, present)
        for role in ("global_scale", "input_scale"):  # e8m0 scales are the whole scale; MXFP4A16 has no input scale
            layers.stray(prefix, NVFP4_LAYOUT[role], f"{CT_MXFP4_FORMAT} (weight_packed and e8m0 weight_scale only)")
        names = {role: layers.require(prefix, suffix, QPNMX.source_tags[role], present)
                 for role, suffix in MXFP4_LAYOUT.items()}
        layers.expect(prefix, MXFP4_ALGO, names["blocks"])
        return Recipe(prefix, names)

    def build(self, recipe: Recipe, array_of: Callable[[str], np.ndarray], file_of: Mapping[str, str]
              ) -> QuantizedLinear:
        names = recipe.names
        if "blocks" in names:  # MXFP4: the bytes as they are
            return build_linear(MXFP4Linear, recipe, file_of, blocks=array_of(names["blocks"]),
                                scales=array_of(names["scales"]))
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

    def linear_tensors(self, linear: QuantizedLinear) -> dict[str, StoredTensor]:
        name = linear.name
        if isinstance(linear, MXFP4Linear):
            if linear.input_scale is not None:
                raise ValueError(f"linear {name!r}: qpn writes {CT_MXFP4_FORMAT} layers without an input scale "
                                 "(MXFP4A16); drop it")
            return {f"{name}.weight_packed": StoredTensor(linear.weight_packed, "U8"),
                    f"{name}.weight_scale": StoredTensor(linear.scales, "U8")}
        if not isinstance(linear, NVFP4Linear):
            raise ValueError(f"linear {name!r} is FP8, but a compressed-tensors checkpoint here holds "
                             f"{CT_NVFP4_FORMAT} or {CT_MXFP4_FORMAT} layers only; save it as format='modelopt'")
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
        if checkpoint.quant_algo.upper() == MXFP4_ALGO:
            weights_mx = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": MX_BLOCK,
                          "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}
            group = {"targets": sorted(checkpoint.linears), "weights": weights_mx, "format": CT_MXFP4_FORMAT,
                     "input_activations": None}
            return {"quant_method": "compressed-tensors", "format": CT_MXFP4_FORMAT,
                    "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": unquantized}
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


__all__ = ["CT_MXFP4_FORMAT", "CT_NVFP4_FORMAT", "CompressedTensors"]
