"""ModelOpt checkpoints: the quantization config, the tensor names, a layer's assembly and how it is written.

The config is config.json's `quantization_config` (quant_method "modelopt") and/or the older
`hf_quant_config.json` ({"quantization": {...}}); when both are present their quant_algo must agree.
quant_algo (upper-cased): "NVFP4", "W4A16_NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"
or "MIXED_PRECISION".

On-disk layouts (per layer X):

- NVFP4 / W4A16_NVFP4: X.weight U8 [N, K/2], X.weight_scale F8_E4M3 [N, K/16],
  X.weight_scale_2 F32 [], X.input_scale F32 [] (optional).
- FP8 (tensor / channel / block): X.weight F8_E4M3 [N, K], X.weight_scale or
  X.weight_scale_inv F32 ([], [N] or [N, 1], or the block grid [N/128, K/128] or
  [N/128, 1, K/128, 1]), X.input_scale F32 [] (optional).

What the config decides (every error is a CheckpointError naming the file and the tensor or
config entry at fault; the rules both producers share: qpn.checkpoints.producer):

- Single algorithm: every stored quantized layer must be of the config's kind (NVFP4 family <->
  NVFP4Linear; FP8 -> granularity tensor, FP8_PER_CHANNEL_PER_TOKEN -> channel, FP8_PB_WO ->
  block) and must not be excluded (`ignore` / `exclude_modules`, exact names or fnmatch
  wildcards). NVFP4 group_size must be 16.
- MIXED_PRECISION: `quantized_layers` maps a layer (exact name, a fused name such as
  `...qkv_proj` / `...gate_up_proj` that covers its q/k/v or gate/up shards, or an ancestor
  prefix) to {"quant_algo", "group_size"}; unlisted layers must be stored unquantized, listed
  ones quantized with the listed algorithm, and every listed entry must match a layer (these
  entries are explicit; the exclude-list form is not).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..ref.formats import FP8_BLOCK, QPN8
from ..ref.geometry import GROUP_K
from .checkpoint import (
    FP8_GRANULARITY_OF_ALGO,
    FP8_SCALE_NAMES,
    LAYER_ALGOS,
    NVFP4_ALGOS,
    Checkpoint,
    FP8Linear,
    MXFP4Linear,
    NVFP4Linear,
    QuantizedLinear,
)
from .producer import NVFP4_DTYPES, LayerTensors, Producer, Recipe, TensorMeta, build_linear, config_error, str_list
from .safetensors_io import StoredTensor

MODELOPT_ALGOS = LAYER_ALGOS + ("MIXED_PRECISION",)
# role -> on-disk suffix of an NVFP4 layer
NVFP4_LAYOUT = {"weight_packed": "weight", "weight_scale": "weight_scale", "global_scale": "weight_scale_2",
                "input_scale": "input_scale"}
FP8_DTYPES = QPN8.source_tags  # the same at every granularity (QPN8_BLOCK's too)
_COMPRESSED_TENSORS_NAMES = ("weight_packed", "weight_global_scale", "input_global_scale")
_FUSED_OF_SHARD = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _check_group_size(value: object, expected: int, source: str, entry: str, what: str) -> None:
    if value is not None and value != expected:
        raise config_error(source, entry, f"group_size must be {expected} for {what}, got {value!r}; "
                                          "qpn reads NVFP4 with 16-element groups and FP8 blocks of 128x128")


def _check_nvfp4_group_size(section: Mapping, source: str, algo: str) -> None:
    group_size = section.get("group_size")
    if group_size is None:  # config.json form may only carry it inside config_groups
        groups = section.get("config_groups")
        for gname, group in (groups.items() if isinstance(groups, Mapping) else ()):
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping):
                _check_group_size(weights.get("group_size"), GROUP_K, source, f"config_groups.{gname}", algo)
    _check_group_size(group_size, GROUP_K, source, "group_size", algo)


def _quantized_layers(section: Mapping, source: str) -> dict[str, str]:
    """MIXED_PRECISION's quantized_layers: {layer key: its algorithm}."""
    layers = section.get("quantized_layers")
    if not isinstance(layers, Mapping) or not layers:
        raise config_error(source, "quantized_layers",
                           "MIXED_PRECISION needs a non-empty quantized_layers mapping {layer: {quant_algo, ...}}")
    algos = {}
    for name, entry in layers.items():
        layer_algo = entry.get("quant_algo") if isinstance(entry, Mapping) else None
        if not isinstance(layer_algo, str) or layer_algo.upper() not in LAYER_ALGOS:
            raise config_error(source, name, f"quantized_layers entry must have a quant_algo in {LAYER_ALGOS}, "
                                             f"got {entry!r}")
        layer_algo = layer_algo.upper()
        if layer_algo in NVFP4_ALGOS:
            _check_group_size(entry.get("group_size"), GROUP_K, source, name, layer_algo)
        elif layer_algo == "FP8_PB_WO":
            _check_group_size(entry.get("group_size"), FP8_BLOCK, source, name, layer_algo)
        algos[name] = layer_algo
    return algos


def _nvfp4_algo(linear: NVFP4Linear) -> str:
    return "NVFP4" if linear.input_scale is not None else "W4A16_NVFP4"


def _fp8_algo(linear: FP8Linear) -> str:
    return {v: k for k, v in FP8_GRANULARITY_OF_ALGO.items()}[linear.granularity]


class ModelOpt(Producer):
    """A ModelOpt checkpoint's quantization config, read (module docstring)."""

    format = "modelopt"

    def __init__(self, section: Mapping, source: str) -> None:
        """Read `section` (config.json's quantization_config or hf_quant_config.json's "quantization")."""
        algo = section.get("quant_algo")
        if not isinstance(algo, str) or not algo:
            raise config_error(source, "quant_algo", f"quant_algo is missing or not a string: {algo!r}")
        algo = algo.upper()
        if algo not in MODELOPT_ALGOS:
            raise config_error(source, "quant_algo", f"quant_algo {algo!r} is not supported; supported: "
                                                     f"{MODELOPT_ALGOS}")
        super().__init__(algo, source)
        key = "ignore" if "ignore" in section else "exclude_modules"
        self.exclude = str_list(section.get(key), source, key)  # exact names / fnmatch wildcards
        if algo in NVFP4_ALGOS:
            _check_nvfp4_group_size(section, source, algo)
        self.layers = _quantized_layers(section, source) if algo == "MIXED_PRECISION" else {}  # key -> algo

    @classmethod
    def from_hf_quant_config(cls, hf_quant_config: Mapping, source: str) -> ModelOpt:
        """Read hf_quant_config.json (its "quantization" object)."""
        section = hf_quant_config.get("quantization")
        if not isinstance(section, Mapping):
            raise config_error(source, "quantization", "hf_quant_config.json must hold a 'quantization' object "
                                                       "{quant_algo, group_size, exclude_modules, ...}")
        return cls(section, source)

    def algo_for(self, prefix: str) -> tuple[str | None, bool]:
        if any(prefix == e or fnmatch.fnmatchcase(prefix, e) for e in self.exclude):
            return None, False
        if self.quant_algo != "MIXED_PRECISION":
            return self.quant_algo, False
        parent, _, leaf = prefix.rpartition(".")
        keys = [prefix]
        if leaf in _FUSED_OF_SHARD:
            keys.append(f"{parent}.{_FUSED_OF_SHARD[leaf]}" if parent else _FUSED_OF_SHARD[leaf])
        parts = prefix.split(".")
        keys += [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]  # ancestors, nearest first
        for key in keys:
            if key in self.layers:
                self.used.add(key)
                return self.layers[key], True
        return None, True

    def explicit_entries(self) -> list[str]:
        return list(self.layers) if self.quant_algo == "MIXED_PRECISION" else []

    def is_layer_tensor(self, name: str, suffix: str, tensor: TensorMeta, layers: LayerTensors) -> bool:
        if suffix in _COMPRESSED_TENSORS_NAMES:
            layers.foreign(name, "compressed-tensors")
        return suffix in ("weight_scale", "weight_scale_2", "weight_scale_inv") or (
            suffix == "weight" and tensor.dtype in ("U8", "F8_E4M3"))

    def recipe(self, prefix: str, present: str, layers: LayerTensors) -> Recipe:
        weight_name = f"{prefix}.weight"
        if weight_name not in layers.stored:
            layers.fail(present, f"layer {prefix!r} has quantization scales but no {weight_name!r}; the checkpoint is "
                                 "incomplete")
        weight_dtype = layers.stored[weight_name].dtype
        if weight_dtype not in ("U8", "F8_E4M3"):
            layers.fail(weight_name, f"has dtype {weight_dtype}, but layer {prefix!r} carries quantization scales "
                                     f"({present}); a ModelOpt quantized weight is U8 (NVFP4) or F8_E4M3 (FP8)")
        if weight_dtype == "U8":
            layers.stray(prefix, "weight_scale_inv", "NVFP4")
            return layers.nvfp4_recipe(prefix, NVFP4_LAYOUT, present)
        return self._fp8_recipe(prefix, present, layers)

    def _fp8_recipe(self, prefix: str, present: str, layers: LayerTensors) -> Recipe:
        layers.stray(prefix, "weight_scale_2", "FP8")
        scale_names = [s for s in FP8_SCALE_NAMES if f"{prefix}.{s}" in layers.stored]
        if not scale_names:
            layers.fail(f"{prefix}.weight", f"is an F8_E4M3 weight but {prefix + '.weight_scale'!r} (or "
                                            "weight_scale_inv) is missing; the checkpoint is incomplete")
        if len(scale_names) == 2:
            layers.fail(f"{prefix}.weight_scale_inv", f"layer {prefix!r} has both weight_scale and weight_scale_inv; "
                                                      "keep the one the exporter wrote")
        names = {"weight": f"{prefix}.weight",
                 "weight_scale": layers.require(prefix, scale_names[0], FP8_DTYPES["weight_scale"], present)}
        if f"{prefix}.input_scale" in layers.stored:
            names["input_scale"] = layers.require(prefix, "input_scale", "F32", present)
        names["granularity"] = names["scale_name"] = names["weight_scale"]
        algo = layers.expect(prefix, "FP8", names["weight"])
        return Recipe(prefix, names, FP8_GRANULARITY_OF_ALGO[algo], scale_names[0])

    def build(self, recipe: Recipe, array_of: Callable[[str], np.ndarray], file_of: Mapping[str, str]
              ) -> QuantizedLinear:
        names = recipe.names
        if recipe.nvfp4:
            arrays = {role: array_of(name) for role, name in names.items()}
            return build_linear(NVFP4Linear, recipe, file_of, weight_packed=arrays["weight_packed"],
                                weight_scale=arrays["weight_scale"], global_scale=arrays["global_scale"],
                                input_scale=arrays.get("input_scale"))
        return build_linear(FP8Linear, recipe, file_of, weight=array_of(names["weight"]),
                            weight_scale=array_of(names["weight_scale"]), granularity=recipe.granularity,
                            input_scale=array_of(names["input_scale"]) if "input_scale" in names else None,
                            scale_name=recipe.scale_name)

    def linear_tensors(self, linear: QuantizedLinear) -> dict[str, StoredTensor]:
        name = linear.name
        stored: dict[str, StoredTensor] = {}
        if isinstance(linear, MXFP4Linear):
            raise ValueError(f"linear {name!r} is MXFP4, which qpn writes as compressed-tensors "
                             "mxfp4-pack-quantized only; save it as format='compressed-tensors'")
        if isinstance(linear, NVFP4Linear):
            for role in ("weight_packed", "weight_scale"):
                stored[f"{name}.{NVFP4_LAYOUT[role]}"] = StoredTensor(getattr(linear, role), NVFP4_DTYPES[role])
            for role in ("global_scale", "input_scale"):
                value = getattr(linear, role)
                if value is not None:
                    stored[f"{name}.{NVFP4_LAYOUT[role]}"] = StoredTensor(np.asarray(value, np.float32).reshape(()),
                                                                          "F32")
            return stored
        stored[f"{name}.weight"] = StoredTensor(linear.weight, FP8_DTYPES["weight"])
        stored[f"{name}.{linear.scale_name}"] = StoredTensor(linear.weight_scale, FP8_DTYPES["weight_scale"])
        if linear.input_scale is not None:
            stored[f"{name}.input_scale"] = StoredTensor(linear.input_scale, "F32")
        return stored

    @staticmethod
    def default_quantization_config(checkpoint: Checkpoint) -> dict[str, Any]:
        """config.json 'quantization_config' for a checkpoint built in memory (explicit layer names)."""
        unquantized = sorted(name.rpartition(".")[0] for name, t in checkpoint.tensors.items()
                             if name.endswith(".weight") and len(t.shape) == 2)
        config: dict[str, Any] = {"quant_method": "modelopt", "quant_algo": checkpoint.quant_algo,
                                  "ignore": unquantized, "producer": {"name": "qpn", "version": "0.1.0"}}
        if checkpoint.quant_algo in NVFP4_ALGOS:
            config["group_size"] = GROUP_K
        if checkpoint.quant_algo == "MIXED_PRECISION":
            layers = {}
            for name, linear in checkpoint.linears.items():
                if isinstance(linear, NVFP4Linear):
                    layers[name] = {"quant_algo": _nvfp4_algo(linear), "group_size": GROUP_K}
                elif not isinstance(linear, FP8Linear):
                    continue  # MXFP4: linear_tensors refuses it with the fix
                elif linear.granularity == "block":
                    layers[name] = {"quant_algo": _fp8_algo(linear), "group_size": FP8_BLOCK}
                else:
                    layers[name] = {"quant_algo": _fp8_algo(linear)}
            config["quantized_layers"] = layers
        return config


__all__ = ["MODELOPT_ALGOS", "ModelOpt"]
