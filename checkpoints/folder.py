"""Quantized checkpoint folders (ModelOpt, compressed-tensors) -> a Checkpoint (qpn.checkpoints.checkpoint).

A checkpoint is a folder: `config.json` (its `quantization_config`) and/or the older ModelOpt
`hf_quant_config.json`, plus `model.safetensors` or shards listed in
`model.safetensors.index.json` ("weight_map": tensor -> file). Tensors are read with
`safetensors_io` (memory-mapped: loading a large checkpoint copies nothing). `open_checkpoint`
is the other way in, for a reader that must survive a file changing under it (`qpn pack`):
the same checks, the structure first, then one layer at a time, by file reads.

The data model (`Checkpoint`, `NVFP4Linear`, `FP8Linear`) and its value rules: qpn.checkpoints.checkpoint.

On-disk layouts (per layer X):

- ModelOpt NVFP4 / W4A16_NVFP4: X.weight U8 [N, K/2], X.weight_scale F8_E4M3 [N, K/16],
  X.weight_scale_2 F32 [], X.input_scale F32 [] (optional).
- ModelOpt FP8 (tensor / channel / block): X.weight F8_E4M3 [N, K], X.weight_scale or
  X.weight_scale_inv F32 ([], [N] or [N, 1], or the block grid [N/128, K/128] or
  [N/128, 1, K/128, 1]), X.input_scale F32 [] (optional).
- compressed-tensors nvfp4-pack-quantized: X.weight_packed U8 [N, K/2], X.weight_scale F8_E4M3
  [N, K/16], X.weight_global_scale F32 [1], X.input_global_scale F32 [1] (optional).

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

What the config decides, and what is checked (every error is a CheckpointError, a ValueError
naming the file and the tensor or config entry at fault):

- ModelOpt single algorithm: every stored quantized layer must be of the config's kind (NVFP4
  family <-> NVFP4Linear; FP8 -> granularity tensor, FP8_PER_CHANNEL_PER_TOKEN -> channel,
  FP8_PB_WO -> block) and must not be excluded (`ignore` / `exclude_modules`, exact names or
  fnmatch wildcards). NVFP4 group_size must be 16.
- ModelOpt MIXED_PRECISION: `quantized_layers` maps a layer (exact name, a fused name such as
  `...qkv_proj` / `...gate_up_proj` that covers its q/k/v or gate/up shards, or an ancestor
  prefix) to {"quant_algo", "group_size"}; unlisted layers must be stored unquantized, listed
  ones quantized with the listed algorithm, and every listed entry must match a layer.
- compressed-tensors: `config_groups` (all in format nvfp4-pack-quantized, weights num_bits 4,
  type float, strategy tensor_group, group_size 16), `targets` and `ignore` (exact names or
  "re:" regexes, re.match as compressed-tensors does; a class target such as "Linear" matches
  every non-ignored quantized layer). quantization_status, if present, must be "compressed".
- Exact-name and regex targets / quantized_layers are EXPLICIT: a 2-D X.weight stored
  unquantized that such an entry covers is an error. Class targets and ModelOpt's
  exclude-list form cannot tell a linear from an embedding by its tensors, so there the stored
  tensors decide which layers are quantized.
- Per layer: every companion tensor present (a scale without its weight or a weight without
  its scale is an error), exact dtypes, weight_scale shape [N, K/16] for weight [N, K/2], FP8
  scale shape by granularity, no NaN e4m3 codes (0x7F/0xFF) in block scales or FP8 weights,
  global scales and FP8 weight scales finite and > 0 (as fp8_dequantize requires), NVFP4 block
  scales non-negative (`checks.require_nvfp4_block_scales`: no sign bit).
- Sharded: every file in the weight_map exists, holds exactly the tensors mapped to it, and no
  tensor appears in two files.

Saving (`save_checkpoint`) serializes, then runs the complete load-side validation on the
in-memory result before writing a byte; it writes the whole folder into a temporary sibling
folder and renames it into place (an existing non-empty folder is refused unless
overwrite=True, which moves the old folder aside, renames the new one into place and only then
deletes the old one; recoverably, see qpn.checkpoints.atomic). overwrite=True replaces only a folder
save_checkpoint wrote: nothing but its file names, every safetensors file carrying the metadata
"writer": "qpn" (SAVED_METADATA); a user's own checkpoint folder is refused. On any failure the
temporary folder is removed and the target is untouched. Output bytes are deterministic (sorted
JSON, sorted tensors, fixed shard names).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import numpy as np

from ..ref.formats import FP8_BLOCK, QPN2, QPN8
from ..ref.geometry import GROUP_K
from .atomic import atomic_folder, require_writable_target, write_json
from .checkpoint import (
    FP8_GRANULARITY_OF_ALGO,
    FP8_SCALE_NAMES,
    LAYER_ALGOS,
    NVFP4_ALGOS,
    Checkpoint,
    CheckpointError,
    FieldError,
    FP8Linear,
    NVFP4Linear,
)
from .safetensors_io import (
    SafetensorsFile,
    StoredTensor,
    TensorInfo,
    read_safetensors,
    read_safetensors_header,
    write_safetensors,
)

MODELOPT_ALGOS = LAYER_ALGOS + ("MIXED_PRECISION",)
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"

CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_METADATA = {"format": "pt"}  # what transformers expects in every shard
# save_checkpoint's mark in every file it writes: overwrite=True replaces only a folder that carries it
SAVED_METADATA = {**SAFETENSORS_METADATA, "writer": "qpn"}
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# role -> on-disk suffix, per layout
_MODELOPT_NVFP4 = {"weight_packed": "weight", "weight_scale": "weight_scale", "global_scale": "weight_scale_2",
                   "input_scale": "input_scale"}
_CT_NVFP4 = {"weight_packed": "weight_packed", "weight_scale": "weight_scale", "global_scale": "weight_global_scale",
             "input_scale": "input_global_scale"}
_NVFP4_DTYPES = {**QPN2.source_tags, "global_scale": "F32", "input_scale": "F32"}
_FP8_DTYPES = QPN8.source_tags  # the same at every granularity (QPN8_BLOCK's too)
# every suffix that belongs to some quantized linear (a tensor of another layer with one of
# these names could never be told apart from a linear's, so `tensors` may not use them)
_LINEAR_SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_scale_2", "weight_scale_inv",
                    "weight_global_scale", "input_scale", "input_global_scale")
_FUSED_OF_SHARD = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


_LinearT = TypeVar("_LinearT", NVFP4Linear, FP8Linear)  # one quantized linear of either format

# ----------------------------------------------------------------------------------------------
# quantization config -> plan


def _nvfp4_algo(linear: NVFP4Linear) -> str:
    return "NVFP4" if linear.input_scale is not None else "W4A16_NVFP4"


def _fp8_algo(linear: FP8Linear) -> str:
    return {v: k for k, v in FP8_GRANULARITY_OF_ALGO.items()}[linear.granularity]


class _Plan:
    """What a quantization config says about each layer prefix."""

    def __init__(self, fmt: str, quant_algo: str, source: str):
        self.format, self.quant_algo, self.source = fmt, quant_algo, source
        self.exclude: list[str] = []  # ModelOpt exact names / fnmatch wildcards
        self.layers: dict[str, str] = {}  # ModelOpt MIXED_PRECISION: key -> algo
        self.ct_targets: list[str] = []
        self.ct_ignore: list[str] = []
        self.used: set[str] = set()  # explicit entries that matched some layer

    def _ct_match(self, prefix: str, entry: str) -> bool:
        if entry.startswith("re:"):
            return re.match(entry[3:], prefix) is not None
        return entry == prefix

    @staticmethod
    def _is_class_target(entry: str) -> bool:
        return not entry.startswith("re:") and "." not in entry and entry[:1].isupper()

    def algo_for(self, prefix: str) -> tuple[str | None, bool]:
        """(algo or None for unquantized, explicit?). explicit: an entry names this layer by name/regex."""
        if self.format == "compressed-tensors":
            if any(self._ct_match(prefix, e) for e in self.ct_ignore):
                return None, False
            for entry in self.ct_targets:
                if not self._is_class_target(entry) and self._ct_match(prefix, entry):
                    self.used.add(entry)
                    return "NVFP4", True
            if any(self._is_class_target(e) for e in self.ct_targets):
                return "NVFP4", False
            return None, bool(self.ct_targets)
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
        if self.format == "compressed-tensors":
            return [e for e in self.ct_targets if not e.startswith("re:") and not self._is_class_target(e)]
        return list(self.layers) if self.quant_algo == "MIXED_PRECISION" else []


def _config_error(source: str, entry: str | None, message: str) -> CheckpointError:
    return CheckpointError(source, entry, message, kind="config entry")


def _str_list(value: object, source: str, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _config_error(source, key, f"{key} must be a list of strings, got {value!r}")
    return list(value)


def _check_group_size(value: object, expected: int, source: str, entry: str, what: str) -> None:
    if value is not None and value != expected:
        raise _config_error(source, entry, f"group_size must be {expected} for {what}, got {value!r}; "
                                           "qpn reads NVFP4 with 16-element groups and FP8 blocks of 128x128")


def _modelopt_plan(section: Mapping, source: str) -> _Plan:
    algo = section.get("quant_algo")
    if not isinstance(algo, str) or not algo:
        raise _config_error(source, "quant_algo", f"quant_algo is missing or not a string: {algo!r}")
    algo = algo.upper()
    if algo not in MODELOPT_ALGOS:
        raise _config_error(source, "quant_algo", f"quant_algo {algo!r} is not supported; supported: {MODELOPT_ALGOS}")
    plan = _Plan("modelopt", algo, source)
    key = "ignore" if "ignore" in section else "exclude_modules"
    plan.exclude = _str_list(section.get(key), source, key)
    if algo in NVFP4_ALGOS:
        group_size = section.get("group_size")
        if group_size is None:  # config.json form may only carry it inside config_groups
            groups = section.get("config_groups")
            for gname, group in (groups.items() if isinstance(groups, Mapping) else ()):
                weights = group.get("weights") if isinstance(group, Mapping) else None
                if isinstance(weights, Mapping):
                    _check_group_size(weights.get("group_size"), GROUP_K, source, f"config_groups.{gname}", algo)
        _check_group_size(group_size, GROUP_K, source, "group_size", algo)
    if algo == "MIXED_PRECISION":
        layers = section.get("quantized_layers")
        if not isinstance(layers, Mapping) or not layers:
            raise _config_error(source, "quantized_layers",
                                "MIXED_PRECISION needs a non-empty quantized_layers mapping {layer: {quant_algo, ...}}")
        for name, entry in layers.items():
            layer_algo = entry.get("quant_algo") if isinstance(entry, Mapping) else None
            if not isinstance(layer_algo, str) or layer_algo.upper() not in LAYER_ALGOS:
                raise _config_error(source, name, f"quantized_layers entry must have a quant_algo in {LAYER_ALGOS}, "
                                                  f"got {entry!r}")
            layer_algo = layer_algo.upper()
            if layer_algo in NVFP4_ALGOS:
                _check_group_size(entry.get("group_size"), GROUP_K, source, name, layer_algo)
            elif layer_algo == "FP8_PB_WO":
                _check_group_size(entry.get("group_size"), FP8_BLOCK, source, name, layer_algo)
            plan.layers[name] = layer_algo
    return plan


def _ct_plan(qc: Mapping, source: str) -> _Plan:
    status = qc.get("quantization_status")
    if status is not None and status != "compressed":
        raise _config_error(source, "quantization_status", f"quantization_status must be 'compressed' (packed "
                                                           f"weights on disk), got {status!r}")
    top_format = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _config_error(source, "config_groups", "compressed-tensors config needs a non-empty config_groups")
    plan = _Plan("compressed-tensors", "NVFP4", source)
    for gname, group in groups.items():
        entry = f"config_groups.{gname}"
        if not isinstance(group, Mapping):
            raise _config_error(source, entry, f"must be an object, got {group!r}")
        fmt = group.get("format") or top_format
        if fmt != CT_NVFP4_FORMAT:
            raise _config_error(source, entry, f"format {fmt!r} is not supported; qpn reads compressed-tensors "
                                               f"{CT_NVFP4_FORMAT!r} only")
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            raise _config_error(source, entry, "weights must be an object {num_bits, type, strategy, group_size}")
        rules = {"num_bits": 4, "type": "float", "group_size": GROUP_K}
        for field, expected in rules.items():
            if weights.get(field) != expected:
                raise _config_error(source, f"{entry}.weights.{field}",
                                    f"{field} must be {expected!r} for {CT_NVFP4_FORMAT}, got {weights.get(field)!r}")
        if weights.get("strategy", "tensor_group") != "tensor_group":
            raise _config_error(source, f"{entry}.weights.strategy",
                                f"strategy must be 'tensor_group' for {CT_NVFP4_FORMAT}, "
                                f"got {weights.get('strategy')!r}")
        plan.ct_targets += _str_list(group.get("targets"), source, f"{entry}.targets")
    if top_format not in (None, CT_NVFP4_FORMAT, "mixed-precision"):
        raise _config_error(source, "format", f"format {top_format!r} is not supported; qpn reads {CT_NVFP4_FORMAT!r}")
    plan.ct_ignore = _str_list(qc.get("ignore"), source, "ignore")
    return plan


def _plan_from_configs(config: Mapping | None, config_path: str, hf_quant_config: Mapping | None,
                       hf_path: str, folder: str) -> _Plan:
    qc = config.get("quantization_config") if config is not None else None
    hf_plan = None
    if hf_quant_config is not None:
        section = hf_quant_config.get("quantization")
        if not isinstance(section, Mapping):
            raise _config_error(hf_path, "quantization", "hf_quant_config.json must hold a 'quantization' object "
                                                         "{quant_algo, group_size, exclude_modules, ...}")
        hf_plan = _modelopt_plan(section, hf_path)
    if qc is None:
        if hf_plan is None:
            raise CheckpointError(folder, None, f"no quantization config: neither {CONFIG_FILE} 'quantization_config' "
                                                f"nor {HF_QUANT_CONFIG_FILE}; this is not a quantized checkpoint")
        return hf_plan
    if not isinstance(qc, Mapping):
        raise _config_error(config_path, "quantization_config", f"must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method.startswith("modelopt"):
        plan = _modelopt_plan(qc, config_path)
        if hf_plan is not None and hf_plan.quant_algo != plan.quant_algo:
            raise _config_error(hf_path, "quantization.quant_algo",
                                f"says {hf_plan.quant_algo!r} but {config_path} says {plan.quant_algo!r}; "
                                "the two quantization configs must agree")
        return plan
    if method == "compressed-tensors":
        if hf_plan is not None:
            raise _config_error(hf_path, None, f"a ModelOpt config next to a compressed-tensors {config_path}; "
                                               "remove the one that does not describe the weights")
        return _ct_plan(qc, config_path)
    raise _config_error(config_path, "quantization_config.quant_method",
                        f"quant_method {qc.get('quant_method')!r} is not supported; qpn reads 'modelopt' and "
                        "'compressed-tensors' (nvfp4-pack-quantized)")


# ----------------------------------------------------------------------------------------------
# tensors -> linears (shared by load and save)


class _TensorMeta(Protocol):  # what the structural checks read of a tensor: a StoredTensor or a header entry
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class _Recipe:
    """How one quantized linear is built from its tensors: what `_structure` checked, before any value is read."""

    prefix: str
    nvfp4: bool
    ct: bool  # compressed-tensors: reciprocal global / input scales
    names: dict[str, str]  # role -> tensor name (FP8 also: "granularity" / "scale_name" -> its scale, for errors)
    granularity: str | None = None  # FP8
    scale_name: str | None = None  # FP8

    @property
    def tensors(self) -> list[str]:
        """The names of the layer's tensors."""
        return [name for role, name in self.names.items() if role not in ("granularity", "scale_name")]


def _structure(stored: Mapping[str, _TensorMeta], file_of: Mapping[str, str], plan: _Plan,
               on_layer: Callable[[_Recipe], None] = lambda _: None) -> tuple[dict[str, _Recipe], list[str]]:
    """Group tensors into linears by names, dtypes and shapes and check them against the plan (no value is read).

    Returns ({layer: recipe}, names of the other tensors in `stored` order); `on_layer(recipe)` runs
    as each layer's structure is checked (the eager loader builds the layer there, so errors come
    in the same order as ever).
    """

    def fail(tensor: str, message: str) -> NoReturn:
        raise CheckpointError(file_of[tensor], tensor, message)

    def require(prefix: str, suffix: str, dtype: str, present: str) -> str:
        name = f"{prefix}.{suffix}"
        if name not in stored:
            fail(present, f"layer {prefix!r} is quantized (this tensor exists) but its companion {name!r} is "
                          "missing; the checkpoint is incomplete (a shard missing from the index?)")
        if stored[name].dtype != dtype:
            fail(name, f"must have dtype {dtype}, got {stored[name].dtype}")
        return name

    def stray(prefix: str, suffix: str, kind: str) -> None:
        name = f"{prefix}.{suffix}"
        if name in stored:
            fail(name, f"does not belong to a {kind} layer in a {plan.format} checkpoint; the layer's tensors "
                       "are inconsistent")

    def expect(prefix: str, kind: str, weight_name: str) -> str:
        algo, _ = plan.algo_for(prefix)
        if algo is None:
            fail(weight_name, f"layer {prefix!r} is stored quantized ({kind}) but {plan.source} says it is "
                              "unquantized (excluded, ignored, or not listed); fix the config or the weights")
        if (algo in NVFP4_ALGOS) != (kind == "NVFP4"):
            fail(weight_name, f"layer {prefix!r} is stored as {kind} but {plan.source} says {algo}")
        return algo

    ct = plan.format == "compressed-tensors"
    foreign = ("weight_scale_2", "weight_scale_inv") if ct else ("weight_packed", "weight_global_scale",
                                                                  "input_global_scale")
    candidates = set()
    for name, tensor in stored.items():
        prefix, _, suffix = name.rpartition(".")
        if not prefix:
            continue
        if suffix in foreign:
            fail(name, f"is a {'ModelOpt' if ct else 'compressed-tensors'} tensor name, but {plan.source} describes "
                       f"a {plan.format} checkpoint")
        if ct:
            if suffix in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
                candidates.add(prefix)
            elif suffix == "weight" and tensor.dtype in ("U8", "F8_E4M3"):
                fail(name, f"a {tensor.dtype} weight in a compressed-tensors checkpoint: only {CT_NVFP4_FORMAT!r} "
                           "(weight_packed) is supported")
        elif suffix in ("weight_scale", "weight_scale_2", "weight_scale_inv") or (
                suffix == "weight" and tensor.dtype in ("U8", "F8_E4M3")):
            candidates.add(prefix)

    recipes: dict[str, _Recipe] = {}
    consumed: set[str] = set()
    for prefix in sorted(candidates):
        present = next(f"{prefix}.{s}" for s in _LINEAR_SUFFIXES if f"{prefix}.{s}" in stored)
        if ct:
            if f"{prefix}.weight" in stored:
                fail(f"{prefix}.weight", f"layer {prefix!r} has both weight and compressed tensors ({present}); "
                                         f"{CT_NVFP4_FORMAT} stores weight_packed only")
            layout: dict[str, str] | None = _CT_NVFP4
        else:
            weight_name = f"{prefix}.weight"
            if weight_name not in stored:
                fail(present, f"layer {prefix!r} has quantization scales but no {weight_name!r}; the checkpoint is "
                              "incomplete")
            weight_dtype = stored[weight_name].dtype
            if weight_dtype not in ("U8", "F8_E4M3"):
                fail(weight_name, f"has dtype {weight_dtype}, but layer {prefix!r} carries quantization scales "
                                  f"({present}); a ModelOpt quantized weight is U8 (NVFP4) or F8_E4M3 (FP8)")
            layout = _MODELOPT_NVFP4 if weight_dtype == "U8" else None

        if layout is not None:  # NVFP4
            if not ct:
                stray(prefix, "weight_scale_inv", "NVFP4")
            names = {role: require(prefix, suffix, _NVFP4_DTYPES[role], present)
                     for role, suffix in layout.items() if role != "input_scale"}
            if f"{prefix}.{layout['input_scale']}" in stored:
                names["input_scale"] = require(prefix, layout["input_scale"], "F32", present)
            expect(prefix, "NVFP4", names["weight_packed"])
            recipe = _Recipe(prefix, True, ct, names)
        else:  # ModelOpt FP8
            stray(prefix, "weight_scale_2", "FP8")
            scale_names = [s for s in FP8_SCALE_NAMES if f"{prefix}.{s}" in stored]
            if not scale_names:
                fail(f"{prefix}.weight", f"is an F8_E4M3 weight but {prefix + '.weight_scale'!r} (or "
                                         "weight_scale_inv) is missing; the checkpoint is incomplete")
            if len(scale_names) == 2:
                fail(f"{prefix}.weight_scale_inv", f"layer {prefix!r} has both weight_scale and weight_scale_inv; "
                                                   "keep the one the exporter wrote")
            names = {"weight": f"{prefix}.weight",
                     "weight_scale": require(prefix, scale_names[0], _FP8_DTYPES["weight_scale"], present)}
            if f"{prefix}.input_scale" in stored:
                names["input_scale"] = require(prefix, "input_scale", "F32", present)
            names["granularity"] = names["scale_name"] = names["weight_scale"]
            algo = expect(prefix, "FP8", names["weight"])
            recipe = _Recipe(prefix, False, ct, names, FP8_GRANULARITY_OF_ALGO[algo], scale_names[0])
        recipes[prefix] = recipe
        on_layer(recipe)
        consumed.update(recipe.tensors)

    rest = [name for name in stored if name not in consumed]
    for name in sorted(rest):
        prefix, _, suffix = name.rpartition(".")
        if prefix and suffix == "weight" and len(stored[name].shape) == 2:
            planned, explicit = plan.algo_for(prefix)
            if planned is not None and explicit:
                fail(name, f"{plan.source} says layer {prefix!r} is quantized ({planned}) but it is stored unquantized "
                           f"({stored[name].dtype}); fix the config or re-export the weights")
    for entry in plan.explicit_entries():
        if entry not in plan.used:
            raise _config_error(plan.source, entry, f"the config lists layer {entry!r} as quantized but the "
                                                    "checkpoint holds no tensors for it (missing shard or wrong name?)")
    return recipes, rest


def _build(recipe: _Recipe, array_of: Callable[[str], np.ndarray], file_of: Mapping[str, str]
           ) -> NVFP4Linear | FP8Linear:
    """The linear of `recipe`, its arrays from `array_of(tensor name)`; the value checks run here (CheckpointError)."""
    names, prefix = recipe.names, recipe.prefix

    def build(cls: type[_LinearT], **fields: Any) -> _LinearT:
        try:
            return cls(name=prefix, **fields)
        except FieldError as exc:
            tensor = names.get(exc.role, next(iter(names.values())))
            raise CheckpointError(file_of[tensor], tensor, str(exc)) from None

    if recipe.nvfp4:
        arrays = {role: array_of(name) for role, name in names.items()}
        if recipe.ct:  # reciprocal -> multiplier: one correctly rounded fp32 division
            for role in ("global_scale", "input_scale"):
                if role in arrays:
                    raw = arrays[role]
                    if raw.size != 1 or raw.ndim > 1 or not (np.isfinite(raw).all() and (raw > 0).all()):
                        raise CheckpointError(file_of[names[role]], names[role],
                                              f"must be one finite fp32 value > 0 (compressed-tensors stores the "
                                              f"reciprocal scale, e.g. 2688/amax), got shape {raw.shape}, "
                                              f"values {raw.reshape(-1)[:4]}")
                    arrays[role] = np.float32(1) / raw.reshape(())
        return build(NVFP4Linear, weight_packed=arrays["weight_packed"], weight_scale=arrays["weight_scale"],
                     global_scale=arrays["global_scale"], input_scale=arrays.get("input_scale"))
    return build(FP8Linear, weight=array_of(names["weight"]), weight_scale=array_of(names["weight_scale"]),
                 granularity=recipe.granularity,
                 input_scale=array_of(names["input_scale"]) if "input_scale" in names else None,
                 scale_name=recipe.scale_name)


def _assemble(stored: Mapping[str, StoredTensor], file_of: Mapping[str, str], plan: _Plan,
              config: Mapping, hf_quant_config: Mapping | None) -> Checkpoint:
    """Group tensors into linears, validate everything against the plan, return the Checkpoint."""
    linears: dict[str, NVFP4Linear | FP8Linear] = {}

    def build(recipe: _Recipe) -> None:
        linears[recipe.prefix] = _build(recipe, lambda name: stored[name].array, file_of)

    _, rest = _structure(stored, file_of, plan, build)
    return Checkpoint(plan.format, plan.quant_algo, linears, {name: stored[name] for name in rest},
                      dict(config or {}), dict(hf_quant_config) if hf_quant_config is not None else None)


# ----------------------------------------------------------------------------------------------
# load


def _read_json(path: str, raw: dict[str, bytes] | None = None) -> dict[str, Any]:
    """The JSON object in `path`; `raw`, if given, also receives the bytes read, under the file's name."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        value = json.loads(data.decode("utf-8"))
        if raw is not None:
            raw[os.path.basename(path)] = data
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, None, f"is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(path, None, f"must hold a JSON object, got {type(value).__name__}")
    return value


def _weight_files(folder: str, raw: dict[str, bytes] | None = None
                  ) -> tuple[list[str], dict[str, str] | None, str | None]:
    """(files to read, weight_map or None, index path or None)."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index_path):
        index = _read_json(index_path, raw)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(index_path, "weight_map", "must be a non-empty object {tensor name: file name}")
        for tensor, file in weight_map.items():
            if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
                raise CheckpointError(index_path, tensor, f"maps to {file!r}; expected a file name in the folder")
            if not os.path.isfile(os.path.join(folder, file)):
                raise CheckpointError(index_path, tensor, f"maps to {file!r}, which does not exist in {folder}")
        return sorted(set(weight_map.values())), weight_map, index_path
    if os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        return [SINGLE_FILE], None, None
    raise CheckpointError(folder, None, f"holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def _configs(folder: str, raw: dict[str, bytes] | None = None) -> tuple[dict | None, dict | None, _Plan]:
    """(config.json, hf_quant_config.json, the plan they give) of a checkpoint folder."""
    if not os.path.isdir(folder):
        raise CheckpointError(folder, None, "is not a folder; pass the checkpoint directory")
    config_path = os.path.join(folder, CONFIG_FILE)
    hf_path = os.path.join(folder, HF_QUANT_CONFIG_FILE)
    config = _read_json(config_path, raw) if os.path.exists(config_path) else None
    hf_quant_config = _read_json(hf_path, raw) if os.path.exists(hf_path) else None
    return config, hf_quant_config, _plan_from_configs(config, config_path, hf_quant_config, hf_path, folder)


_T = TypeVar("_T")


def _gather(folder: str, files: Sequence[str], weight_map: Mapping[str, str] | None, index_path: str | None,
            entries: Callable[[str], Mapping[str, _T]]) -> tuple[dict[str, _T], dict[str, str]]:
    """({tensor: entries(file path)[tensor]}, {tensor: file path}) over `files`: each tensor in one file, the
    one the index maps it to, and every tensor of the index present."""
    stored: dict[str, _T] = {}
    file_of: dict[str, str] = {}
    for file in files:
        file_path = os.path.join(folder, file)
        for name, tensor in entries(file_path).items():
            if name in stored:
                raise CheckpointError(file_path, name, f"also stored in {file_of[name]}; a tensor may live in one file")
            if weight_map is not None and weight_map.get(name) != file:
                raise CheckpointError(file_path, name, f"is in this file but {index_path} maps it to "
                                                       f"{weight_map.get(name)!r}; the index is stale")
            stored[name] = tensor
            file_of[name] = file_path
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in stored:
                raise CheckpointError(os.path.join(folder, file), name, f"is listed in {index_path} but missing "
                                                                        "from this file; the shard is incomplete")
    return stored, file_of


def load_checkpoint(path: str | os.PathLike[str], *, mmap: bool = True) -> Checkpoint:
    """Load and validate the checkpoint folder `path` (see the module docstring for the rules).

    mmap=True (default) keeps arrays as read-only views of memory-mapped files. (A reader that
    must survive a file being truncated under it opens the folder with `open_checkpoint`.)
    """
    folder = os.fspath(path)
    config, hf_quant_config, plan = _configs(folder)
    files, weight_map, index_path = _weight_files(folder)
    stored, file_of = _gather(folder, files, weight_map, index_path,
                              lambda file_path: read_safetensors(file_path, mmap=mmap).tensors)
    return _assemble(stored, file_of, plan, config or {}, hf_quant_config)


class OpenCheckpoint:
    """A checkpoint folder opened by `open_checkpoint`: checked for structure, read one layer or tensor at a time.

    `linear(name)` and `tensor(name)` read with plain file reads (`SafetensorsFile`), never a
    memory map, so memory holds what the caller keeps, and a file truncated or rewritten while it
    is read is a SafetensorsError naming it (`require_unchanged()` checks every file at once);
    never a SIGBUS. `linear(name)` runs the value checks of `load_checkpoint` on that layer.
    `json_bytes` holds the bytes of the JSON files read (config.json, hf_quant_config.json, the
    index), so a caller can copy and hash exactly what was validated. Close it (context manager).
    """

    def __init__(self, path: str, config: dict | None, hf_quant_config: dict | None, plan: _Plan,
                 files: dict[str, SafetensorsFile], weight_map: dict[str, str] | None, json_bytes: dict[str, bytes],
                 header_of: dict[str, TensorInfo], file_of: dict[str, str]) -> None:
        self.path = path
        self.format, self.quant_algo = plan.format, plan.quant_algo
        self.config = dict(config or {})
        self.hf_quant_config = dict(hf_quant_config) if hf_quant_config is not None else None
        self.files = files  # file name -> the open file
        self.weight_map = weight_map
        self.json_bytes = json_bytes
        self._header_of, self._file_of = header_of, file_of  # tensor -> header entry, file path
        self._recipes, self.tensor_names = _structure(header_of, file_of, plan)
        self.layer_names = sorted(self._recipes)

    def file_of(self, tensor: str) -> str:
        """The name of the file holding `tensor` (a layer's tensor or another one)."""
        return os.path.basename(self._file_of[tensor])

    def layer_file(self, layer: str) -> str:
        """The name of the file holding the layer's weight."""
        recipe = self._recipes[layer]
        return self.file_of(recipe.names["weight_packed" if recipe.nvfp4 else "weight"])

    def info(self, tensor: str) -> TensorInfo:
        """Dtype tag, shape and offsets of `tensor` (from the header: nothing is read)."""
        return self._header_of[tensor]

    def tensor(self, name: str) -> StoredTensor:
        """The tensor `name`, read now (a read-only array of its own)."""
        return self.files[self.file_of(name)].read(name)

    def linear(self, name: str, *, codes: bool = True) -> NVFP4Linear | FP8Linear:
        """The quantized linear `name`, read now and checked as `load_checkpoint` checks it (CheckpointError).

        codes=False skips an NVFP4 layer's codes (weight_packed), which no rule reads: it is then a
        read-only zero-stride placeholder of the right shape - for checks only (unpackable_reason),
        never for packing. An FP8 layer's codes are always read (NaN codes are an error).
        """
        recipe = self._recipes[name]
        placeholder = recipe.names["weight_packed"] if recipe.nvfp4 and not codes else None

        def array_of(tensor: str) -> np.ndarray:
            if tensor == placeholder:
                return np.broadcast_to(np.zeros((), np.uint8), self._header_of[tensor].shape)
            return self.tensor(tensor).array

        return _build(recipe, array_of, self._file_of)

    def require_unchanged(self) -> None:
        """Raise SafetensorsError naming the first file whose size or modification time changed since it was opened."""
        for file in self.files.values():
            file.require_unchanged()

    def close(self) -> None:
        for file in self.files.values():
            file.close()

    def __enter__(self) -> OpenCheckpoint:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike[str]) -> OpenCheckpoint:
    """Open the checkpoint folder `path` for reading layer by layer (`OpenCheckpoint`).

    Checks now what needs no tensor value: the configs, the index, every header, and the
    structure `load_checkpoint` checks (names, dtypes, which tensors form which layer, the
    config's agreement); the value checks run per layer, in `linear(name)`.
    """
    folder = os.fspath(path)
    json_bytes: dict[str, bytes] = {}
    config, hf_quant_config, plan = _configs(folder, json_bytes)
    names, weight_map, index_path = _weight_files(folder, json_bytes)
    files: dict[str, SafetensorsFile] = {}
    try:
        for file in names:
            files[file] = SafetensorsFile(os.path.join(folder, file))
        header_of, file_of = _gather(folder, names, weight_map, index_path,
                                     lambda file_path: files[os.path.basename(file_path)].header.tensors)
        return OpenCheckpoint(folder, config, hf_quant_config, plan, files, weight_map, json_bytes, header_of,
                              file_of)
    except BaseException:
        for opened in files.values():
            opened.close()
        raise


# ----------------------------------------------------------------------------------------------
# save


def _serialize(checkpoint: Checkpoint) -> dict[str, StoredTensor]:
    stored: dict[str, StoredTensor] = {}
    ct = checkpoint.format == "compressed-tensors"
    one = np.float32(1)
    for name, linear in checkpoint.linears.items():
        if isinstance(linear, NVFP4Linear):
            layout = _CT_NVFP4 if ct else _MODELOPT_NVFP4
            shape = (1,) if ct else ()
            for role in ("weight_packed", "weight_scale"):
                stored[f"{name}.{layout[role]}"] = StoredTensor(getattr(linear, role), _NVFP4_DTYPES[role])
            for role in ("global_scale", "input_scale"):
                value = getattr(linear, role)
                if value is not None:  # compressed-tensors: back to the reciprocal, RN32(1/x)
                    value = (one / value) if ct else value
                    stored[f"{name}.{layout[role]}"] = StoredTensor(np.asarray(value, np.float32).reshape(shape), "F32")
        else:
            if ct:
                raise ValueError(f"linear {name!r} is FP8, but a compressed-tensors checkpoint here holds "
                                 f"{CT_NVFP4_FORMAT} layers only; save it as format='modelopt'")
            stored[f"{name}.weight"] = StoredTensor(linear.weight, _FP8_DTYPES["weight"])
            stored[f"{name}.{linear.scale_name}"] = StoredTensor(linear.weight_scale, _FP8_DTYPES["weight_scale"])
            if linear.input_scale is not None:
                stored[f"{name}.input_scale"] = StoredTensor(linear.input_scale, "F32")
    linear_names = set(checkpoint.linears)
    for name, tensor in checkpoint.tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if name in stored or (prefix in linear_names and suffix in _LINEAR_SUFFIXES):
            raise ValueError(f"tensors[{name!r}] collides with the tensors of quantized linear {prefix!r}; "
                             "a linear's weight and scales live in Checkpoint.linears only")
        stored[name] = tensor
    return stored


def _default_quantization_config(checkpoint: Checkpoint) -> dict:
    """config.json 'quantization_config' for a checkpoint built in memory (explicit layer names)."""
    unquantized = sorted(name.rpartition(".")[0] for name, t in checkpoint.tensors.items()
                         if name.endswith(".weight") and len(t.shape) == 2)
    producer = {"name": "qpn", "version": "0.1.0"}
    if checkpoint.format == "compressed-tensors":
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
    config: dict[str, object] = {"quant_method": "modelopt", "quant_algo": checkpoint.quant_algo, "ignore": unquantized,
              "producer": producer}
    if checkpoint.quant_algo in NVFP4_ALGOS:
        config["group_size"] = GROUP_K
    if checkpoint.quant_algo == "MIXED_PRECISION":
        layers = {}
        for name, linear in checkpoint.linears.items():
            if isinstance(linear, NVFP4Linear):
                layers[name] = {"quant_algo": _nvfp4_algo(linear), "group_size": GROUP_K}
            elif linear.granularity == "block":
                layers[name] = {"quant_algo": _fp8_algo(linear), "group_size": FP8_BLOCK}
            else:
                layers[name] = {"quant_algo": _fp8_algo(linear)}
        config["quantized_layers"] = layers
    return config


def _shards(stored: Mapping[str, StoredTensor], max_shard_bytes: int | None) -> list[tuple[str, list[str]]]:
    names = sorted(stored)
    if max_shard_bytes is None:
        return [(SINGLE_FILE, names)]
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int or None (one file), got {max_shard_bytes!r}")
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = stored[name].nbytes
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    count = len(groups)
    if count == 1:  # as transformers writes one shard: model.safetensors, no index (which load needs)
        return [(SINGLE_FILE, groups[0])]
    return [(f"model-{i + 1:05d}-of-{count:05d}.safetensors", group) for i, group in enumerate(groups)]


def _not_saved_by_qpn(folder: str) -> str | None:
    """None if `folder` holds only files save_checkpoint writes, each safetensors file marked with
    SAVED_METADATA; else why not (overwrite=True never replaces a user's own checkpoint)."""
    written = (CONFIG_FILE, HF_QUANT_CONFIG_FILE, SINGLE_FILE, INDEX_FILE)
    entries = sorted(os.listdir(folder))
    foreign = [e for e in entries if not (e in written or _SHARD_FILE.match(e))
               or os.path.islink(os.path.join(folder, e)) or not os.path.isfile(os.path.join(folder, e))]
    if foreign:
        more = " ..." if len(foreign) > 5 else ""
        return f"it holds {', '.join(foreign[:5])}{more}, which save_checkpoint does not write"
    weights = [e for e in entries if e.endswith(".safetensors")]
    for entry in weights:
        try:
            metadata = read_safetensors_header(os.path.join(folder, entry)).metadata or {}
        except (OSError, ValueError):
            metadata = {}
        if metadata.get("writer") != SAVED_METADATA["writer"]:
            return f"{entry} lacks save_checkpoint's mark (safetensors metadata writer={SAVED_METADATA['writer']!r})"
    return None if weights else "it holds no safetensors file"


def save_checkpoint(path: str | os.PathLike[str], checkpoint: Checkpoint, *, overwrite: bool = False,
                    max_shard_bytes: int | None = None) -> None:
    """Write `checkpoint` as a folder at `path` in its own format (ModelOpt or compressed-tensors).

    Writes config.json (checkpoint.config; when it has no quantization_config and there is no
    hf_quant_config, one is generated that names every linear explicitly), hf_quant_config.json
    if checkpoint.hf_quant_config is set, and model.safetensors, or shards of at most
    max_shard_bytes (a single larger tensor gets its own shard) plus model.safetensors.index.json
    (when everything fits in one shard: model.safetensors alone, as transformers writes it).
    Compressed-tensors global/input scales are written as RN32(1/x) (see the module docstring).
    Everything is validated as load_checkpoint would before anything is written; the folder
    appears atomically; an existing non-empty folder needs overwrite=True and must be one
    save_checkpoint wrote (`_not_saved_by_qpn`).
    """
    if not isinstance(checkpoint, Checkpoint):
        raise ValueError(f"checkpoint must be a Checkpoint, got {type(checkpoint).__name__}")
    target = os.path.abspath(os.fspath(path))
    require_writable_target(target, overwrite, ours=_not_saved_by_qpn, what="checkpoint")

    config = copy.deepcopy(dict(checkpoint.config))
    hf_quant_config = None
    if checkpoint.hf_quant_config is not None:
        hf_quant_config = copy.deepcopy(dict(checkpoint.hf_quant_config))
    if "quantization_config" not in config and hf_quant_config is None:
        config["quantization_config"] = _default_quantization_config(checkpoint)
    config_path = os.path.join(target, CONFIG_FILE)
    hf_path = os.path.join(target, HF_QUANT_CONFIG_FILE)
    plan = _plan_from_configs(config, config_path, hf_quant_config, hf_path, target)
    if (plan.format, plan.quant_algo) != (checkpoint.format, checkpoint.quant_algo.upper()):
        raise CheckpointError(plan.source, None, f"describes a {plan.format} {plan.quant_algo} checkpoint but the "
                                                 f"Checkpoint says {checkpoint.format} {checkpoint.quant_algo}")
    stored = _serialize(checkpoint)
    shards = _shards(stored, max_shard_bytes)
    file_of = {name: os.path.join(target, file) for file, names in shards for name in names}
    _assemble(stored, file_of, plan, config, hf_quant_config)  # the whole load-side validation, in memory

    with atomic_folder(target, overwrite=overwrite, ours=_not_saved_by_qpn, what="checkpoint") as tmp:
        write_json(os.path.join(tmp, CONFIG_FILE), config)
        if hf_quant_config is not None:
            write_json(os.path.join(tmp, HF_QUANT_CONFIG_FILE), hf_quant_config)
        for file, names in shards:
            write_safetensors(os.path.join(tmp, file), {name: stored[name] for name in names}, SAVED_METADATA)
        if len(shards) > 1:
            total = sum(t.nbytes for t in stored.values())
            write_json(os.path.join(tmp, INDEX_FILE), {
                "metadata": {"total_size": total},
                "weight_map": {name: file for file, names in shards for name in names},
            })


__all__ = [
    "CONFIG_FILE", "HF_QUANT_CONFIG_FILE", "INDEX_FILE", "SAFETENSORS_METADATA", "SINGLE_FILE", "OpenCheckpoint",
    "load_checkpoint", "open_checkpoint", "save_checkpoint",
]
