"""What the readers of the two producers share: the `Producer` interface and the walk over a folder's tensors.

One module per producer implements `Producer`: ModelOpt (qpn.checkpoints.modelopt) and
compressed-tensors (qpn.checkpoints.compressed_tensors). An instance is one checkpoint's
quantization config, read: which layers it quantizes and how (`algo_for`), which tensor names
make a quantized layer (`is_layer_tensor`, `recipe`), how a layer is built from its arrays
(`build`) and written back (`linear_tensors`). qpn.checkpoints.folder picks the producer once,
from the config, and hands it to `structure`, which groups the tensors into layers and checks
what both producers share (every error is a CheckpointError naming the file and the tensor or
config entry at fault):

- Per layer: every companion tensor present (a scale without its weight or a weight without
  its scale is an error) with its exact dtype; a layer the config says is unquantized, or of
  the other format, stored quantized is an error. The values are checked when the layer is
  built (qpn.checkpoints.checkpoint).
- Exact-name and regex targets / quantized_layers are EXPLICIT: a 2-D X.weight stored
  unquantized that such an entry covers is an error, and so is an exact name or a
  quantized_layers entry that matches no layer. Class targets and ModelOpt's exclude-list form
  cannot tell a linear from an embedding by its tensors, so there the stored tensors decide
  which layers are quantized.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, Protocol, TypeVar

import numpy as np

from ..ref.formats import QPN2
from .checkpoint import (
    NVFP4_ALGOS,
    Checkpoint,
    CheckpointError,
    FieldError,
    FP8Linear,
    MXFP4Linear,
    NVFP4Linear,
    QuantizedLinear,
)
from .safetensors_io import StoredTensor

# every suffix that belongs to some quantized linear, of either producer (a tensor of another
# layer with one of these names could never be told apart from a linear's, so `tensors` may not
# use them); in this order, the first present names a layer in the structure errors
LINEAR_SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_scale_2", "weight_scale_inv",
                   "weight_global_scale", "input_scale", "input_global_scale")
NVFP4_DTYPES = {**QPN2.source_tags, "global_scale": "F32", "input_scale": "F32"}  # role -> dtype tag, both producers

_LinearT = TypeVar("_LinearT", NVFP4Linear, FP8Linear, MXFP4Linear)  # one quantized linear of any format
MXFP4_ALGO = "MXFP4"  # compressed-tensors' mxfp4-pack-quantized (its layers: MXFP4Linear)


def layer_kind(algo: str) -> str:
    """How a layer of quantization algorithm `algo` is stored: "NVFP4", "MXFP4" or "FP8"."""
    return "NVFP4" if algo in NVFP4_ALGOS else MXFP4_ALGO if algo == MXFP4_ALGO else "FP8"


def config_error(source: str, entry: str | None, message: str) -> CheckpointError:
    return CheckpointError(source, entry, message, kind="config entry")


def str_list(value: object, source: str, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise config_error(source, key, f"{key} must be a list of strings, got {value!r}")
    return list(value)


class TensorMeta(Protocol):  # what the structural checks read of a tensor: a StoredTensor or a header entry
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Recipe:
    """How one quantized linear is built from its tensors: what `structure` checked, before any value is read."""

    prefix: str
    names: dict[str, str]  # role -> tensor name (FP8 also: "granularity" / "scale_name" -> its scale, for errors)
    granularity: str | None = None  # FP8
    scale_name: str | None = None  # FP8

    @property
    def nvfp4(self) -> bool:
        return "weight_packed" in self.names

    @property
    def codes_role(self) -> str:
        """The role of the layer's codes tensor: "weight_packed" (NVFP4), "blocks" (MXFP4), "weight" (FP8)."""
        return next(role for role in ("weight_packed", "blocks", "weight") if role in self.names)

    @property
    def codes(self) -> str:
        """The name of the layer's codes tensor (NVFP4 and MXFP4 weight_packed, FP8 weight)."""
        return self.names[self.codes_role]

    @property
    def tensors(self) -> list[str]:
        """The names of the layer's tensors."""
        return [name for role, name in self.names.items() if role not in ("granularity", "scale_name")]


class Producer(ABC):
    """One checkpoint's quantization config as its producer's reader sees it (module docstring)."""

    format: ClassVar[str]  # Checkpoint.format: "modelopt" | "compressed-tensors"

    def __init__(self, quant_algo: str, source: str) -> None:
        self.quant_algo, self.source = quant_algo, source  # source: the config file, for errors
        self.used: set[str] = set()  # explicit entries that matched some layer

    @abstractmethod
    def algo_for(self, prefix: str) -> tuple[str | None, bool]:
        """(algo or None for unquantized, explicit?). explicit: an entry names this layer by name/regex."""

    @abstractmethod
    def explicit_entries(self) -> list[str]:
        """The config entries that name layers explicitly (each must match one)."""

    @abstractmethod
    def is_layer_tensor(self, name: str, suffix: str, tensor: TensorMeta, layers: LayerTensors) -> bool:
        """Whether tensor `name` (`prefix.suffix`) makes its prefix a quantized layer; fails on the other
        producer's names."""

    @abstractmethod
    def recipe(self, prefix: str, present: str, layers: LayerTensors) -> Recipe:
        """The checked recipe of the quantized layer `prefix` (`present`: one of its tensors, for errors)."""

    @abstractmethod
    def build(self, recipe: Recipe, array_of: Callable[[str], np.ndarray], file_of: Mapping[str, str]
              ) -> QuantizedLinear:
        """The linear of `recipe`, its arrays from `array_of(tensor name)`; the value checks run here."""

    @abstractmethod
    def linear_tensors(self, linear: QuantizedLinear) -> dict[str, StoredTensor]:
        """The tensors `linear` is stored as in this producer's checkpoints (ValueError if it cannot be)."""

    @staticmethod
    @abstractmethod
    def default_quantization_config(checkpoint: Checkpoint) -> dict[str, Any]:
        """config.json's 'quantization_config' for a checkpoint built in memory (every layer named explicitly)."""


class LayerTensors:
    """A folder's tensors as `structure` checks them against a producer: the checks both producers use."""

    def __init__(self, stored: Mapping[str, TensorMeta], file_of: Mapping[str, str], producer: Producer) -> None:
        self.stored, self.file_of, self.producer = stored, file_of, producer

    def fail(self, tensor: str, message: str) -> NoReturn:
        raise CheckpointError(self.file_of[tensor], tensor, message)

    def foreign(self, name: str, producer: str) -> NoReturn:
        """Fail on a tensor name of the other producer."""
        self.fail(name, f"is a {producer} tensor name, but {self.producer.source} describes a "
                        f"{self.producer.format} checkpoint")

    def require(self, prefix: str, suffix: str, dtype: str, present: str) -> str:
        name = f"{prefix}.{suffix}"
        if name not in self.stored:
            self.fail(present, f"layer {prefix!r} is quantized (this tensor exists) but its companion {name!r} is "
                               "missing; the checkpoint is incomplete (a shard missing from the index?)")
        if self.stored[name].dtype != dtype:
            self.fail(name, f"must have dtype {dtype}, got {self.stored[name].dtype}")
        return name

    def stray(self, prefix: str, suffix: str, kind: str) -> None:
        name = f"{prefix}.{suffix}"
        if name in self.stored:
            self.fail(name, f"does not belong to a {kind} layer in a {self.producer.format} checkpoint; the layer's "
                            "tensors are inconsistent")

    def expect(self, prefix: str, kind: str, weight_name: str) -> str:
        """The config's algorithm for a layer stored as `kind` ("NVFP4" / "MXFP4" / "FP8"); fails where they
        disagree."""
        algo, _ = self.producer.algo_for(prefix)
        if algo is None:
            self.fail(weight_name, f"layer {prefix!r} is stored quantized ({kind}) but {self.producer.source} says it "
                                   "is unquantized (excluded, ignored, or not listed); fix the config or the weights")
        if layer_kind(algo) != kind:
            self.fail(weight_name, f"layer {prefix!r} is stored as {kind} but {self.producer.source} says {algo}")
        return algo

    def nvfp4_recipe(self, prefix: str, layout: Mapping[str, str], present: str) -> Recipe:
        """An NVFP4 layer's recipe; `layout` maps each role to the producer's suffix."""
        names = {role: self.require(prefix, suffix, NVFP4_DTYPES[role], present)
                 for role, suffix in layout.items() if role != "input_scale"}
        if f"{prefix}.{layout['input_scale']}" in self.stored:
            names["input_scale"] = self.require(prefix, layout["input_scale"], "F32", present)
        self.expect(prefix, "NVFP4", names["weight_packed"])
        return Recipe(prefix, names)

    def check_unquantized(self, rest: list[str]) -> None:
        """The explicit entries' rules over the tensors no layer took (module docstring)."""
        producer = self.producer
        for name in sorted(rest):
            prefix, _, suffix = name.rpartition(".")
            if prefix and suffix == "weight" and len(self.stored[name].shape) == 2:
                planned, explicit = producer.algo_for(prefix)
                if planned is not None and explicit:
                    self.fail(name, f"{producer.source} says layer {prefix!r} is quantized ({planned}) but it is "
                                    f"stored unquantized ({self.stored[name].dtype}); fix the config or re-export the "
                                    "weights")
        for entry in producer.explicit_entries():
            if entry not in producer.used:
                raise config_error(producer.source, entry, f"the config lists layer {entry!r} as quantized but the "
                                                           "checkpoint holds no tensors for it (missing shard or "
                                                           "wrong name?)")


def structure(stored: Mapping[str, TensorMeta], file_of: Mapping[str, str], producer: Producer,
              on_layer: Callable[[Recipe], None] = lambda _: None) -> tuple[dict[str, Recipe], list[str]]:
    """Group tensors into linears by names, dtypes and shapes and check them against the config (no value is read).

    Returns ({layer: recipe}, names of the other tensors in `stored` order); `on_layer(recipe)` runs
    as each layer's structure is checked (the eager loader builds the layer there, so errors come
    in the same order as ever).
    """
    layers = LayerTensors(stored, file_of, producer)
    candidates = set()
    for name, tensor in stored.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix and producer.is_layer_tensor(name, suffix, tensor, layers):
            candidates.add(prefix)
    recipes: dict[str, Recipe] = {}
    consumed: set[str] = set()
    for prefix in sorted(candidates):
        present = next(f"{prefix}.{s}" for s in LINEAR_SUFFIXES if f"{prefix}.{s}" in stored)
        recipe = producer.recipe(prefix, present, layers)
        recipes[prefix] = recipe
        on_layer(recipe)
        consumed.update(recipe.tensors)
    rest = [name for name in stored if name not in consumed]
    layers.check_unquantized(rest)
    return recipes, rest


def build_linear(cls: type[_LinearT], recipe: Recipe, file_of: Mapping[str, str], **fields: Any) -> _LinearT:
    """cls(name=recipe.prefix, **fields), a field's error naming the tensor and file behind it (CheckpointError)."""
    try:
        return cls(name=recipe.prefix, **fields)
    except FieldError as exc:
        tensor = recipe.names.get(exc.role, next(iter(recipe.names.values())))
        raise CheckpointError(file_of[tensor], tensor, str(exc)) from None


def serialize(producer: Producer, checkpoint: Checkpoint) -> dict[str, StoredTensor]:
    """Every tensor of `checkpoint` by its on-disk name in `producer`'s checkpoints (ValueError on a collision)."""
    stored: dict[str, StoredTensor] = {}
    for linear in checkpoint.linears.values():
        stored.update(producer.linear_tensors(linear))
    linear_names = set(checkpoint.linears)
    for name, tensor in checkpoint.tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if name in stored or (prefix in linear_names and suffix in LINEAR_SUFFIXES):
            raise ValueError(f"tensors[{name!r}] collides with the tensors of quantized linear {prefix!r}; "
                             "a linear's weight and scales live in Checkpoint.linears only")
        stored[name] = tensor
    return stored


__all__ = ["LINEAR_SUFFIXES", "MXFP4_ALGO", "LayerTensors", "Producer", "Recipe", "build_linear", "layer_kind",
           "serialize", "structure"]
