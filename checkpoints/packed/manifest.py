"""qpn_manifest.json: what a packed folder records (the source's hashes, one entry per layer and
tensor) and the rules an entry must follow (the schema: qpn.checkpoints.packed)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeGuard

import numpy as np

from ... import ref
from ...ref.formats import (
    FORMAT_NAMES,
    FP8_GRANULARITIES,
    MX_BLOCK,
    QPN2,
    QPN8,
    WEIGHT_FORMATS,
    Shape,
    WeightFormat,
    weight_format,
)
from ...ref.geometry import GROUP_K
from ..checkpoint import CHECKPOINT_FORMATS, FP8Linear, NVFP4Linear, QuantizedLinear
from ..folder import CONFIG_FILE, HF_QUANT_CONFIG_FILE
from ..safetensors_io import sha256_stream
from .layers import WEIGHT_SCALE, scale_fields, source_tensors, tensor_suffix

PACKED_FORMAT = "qpn-packed"
PACKED_VERSION = 1
MANIFEST_FILE = "qpn_manifest.json"
COPIED_CONFIG_FILES = (CONFIG_FILE, HF_QUANT_CONFIG_FILE)
Progress = Callable[..., Iterable]  # progress(iterable, desc=..., total=..., unit=...) -> iterable


def no_progress(iterable: Iterable, **_: object) -> Iterable:
    return iterable


class PackError(ValueError):
    """A checkpoint cannot be packed, or a packed folder breaks the format. Names the path and the layer."""

    def __init__(self, path: str | os.PathLike[str], layer: str | None, message: str) -> None:
        self.path = os.fspath(path)
        self.layer = layer
        where = f"{self.path}: layer {layer!r}: " if layer is not None else f"{self.path}: "
        super().__init__(where + message)



def sha256_array(a: np.ndarray) -> str:
    """sha256 of an array's bytes in C order (no copy for contiguous arrays)."""
    return hashlib.sha256(np.ascontiguousarray(a).data.cast("B")).hexdigest()


def sha256_file(path: str | os.PathLike[str], progress: Progress = no_progress) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f, os.fspath(path), os.path.getsize(path), progress)[0]



def is_packed(path: str | os.PathLike[str]) -> bool:
    """True if `path` is a folder holding a qpn packed checkpoint (its manifest)."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST_FILE))


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackError(path, None, f"is not valid UTF-8 JSON ({exc})") from None


def check_manifest(manifest_path: str, manifest: object) -> None:
    """The manifest's own rules: format, version, source, every layer entry, every tensor entry (PackError)."""
    if not isinstance(manifest, dict) or manifest.get("format") != PACKED_FORMAT:
        raise PackError(manifest_path, None, f"is not a qpn packed manifest (format must be {PACKED_FORMAT!r})")
    if manifest.get("version") != PACKED_VERSION:
        raise PackError(manifest_path, None, f"has version {manifest.get('version')!r}; this qpn reads version "
                                             f"{PACKED_VERSION}: re-pack the source checkpoint")
    for key in ("source", "layers", "tensors"):
        if not isinstance(manifest.get(key), dict):
            raise PackError(manifest_path, None, f"has no {key!r} object; the manifest is damaged")
    source = manifest["source"]
    if source.get("format") not in CHECKPOINT_FORMATS or not isinstance(source.get("quant_algo"), str):
        raise PackError(manifest_path, None, f"source must name a format in {CHECKPOINT_FORMATS} and "
                                             f"a quant_algo, got {source!r}; the manifest is damaged")
    for name, entry in manifest["layers"].items():
        try:
            check_layer_entry(name, entry)
        except ValueError as exc:
            raise PackError(manifest_path, name, f"{exc}; the manifest is damaged: re-pack the source") from None
    for name, entry in manifest["tensors"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise PackError(manifest_path, None, f"tensor {name!r}: the entry must be an object with a file name")


def is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def layer_entry(name: str, linear: QuantizedLinear, file: str,
                 buffers: Mapping[str, np.ndarray]) -> dict[str, Any]:
    wf = linear.weight_format
    entry: dict[str, Any] = {
        "format": wf.format,
        "layout": wf.layout,
        "n": linear.n,
        "k": linear.k,
        "n_padded": wf.padded_n(linear.n),
        "file": file,
        "source_tensors": {
            role: {"dtype": t.dtype, "shape": list(t.shape), "sha256": sha256_array(t.array)}
            for role, t in source_tensors(linear).items()
        },
    }
    entry |= scale_fields(linear)
    if isinstance(linear, NVFP4Linear):
        entry["global_scale"] = [float(linear.global_scale)]  # float32 -> float64 is exact; JSON keeps it
    elif isinstance(linear, FP8Linear) and linear.granularity == "tensor":
        entry["weight_scale"] = [float(linear.weight_scale)]
    if linear.input_scale is not None:
        entry["input_scale"] = [float(linear.input_scale)]
    return entry



def expected_tensors(wf: WeightFormat, n_pad: int, k: int, entry: Mapping[str, Any]) -> dict[str, tuple[str, Shape]]:
    """suffix -> (dtype tag, shape) of a checked manifest entry's packed tensors (the input scale aside)."""
    expected = {tensor_suffix(b): (b.tag, b.shape(n_pad, k)) for b in wf.buffers}
    if wf.format == QPN8.format:  # FP8 also keeps the source's fp32 scale as it was (S16 is rounded)
        source_shape = tuple(entry["source_tensors"]["weight_scale"]["shape"])
        expected[WEIGHT_SCALE] = (wf.source_tags["weight_scale"], source_shape)
    return expected


_LAYOUT_OF_FORMAT = {wf.format: wf.layout for wf in WEIGHT_FORMATS}  # one layout per format, whatever the granularity


def _positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_layer_entry(name: str, entry: object) -> None:
    """The manifest's own rules for one layer (types, N_pad, K, granularity, source shapes); raises ValueError."""
    if not isinstance(entry, dict):
        raise ValueError(f"the manifest entry must be an object, got {type(entry).__name__}")
    fmt = entry.get("format")
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"has format {fmt!r}; expected {' or '.join(map(repr, FORMAT_NAMES))}")
    if entry.get("layout") != _LAYOUT_OF_FORMAT[fmt]:
        raise ValueError(f"has layout {entry.get('layout')!r}; an {fmt} layer is {_LAYOUT_OF_FORMAT[fmt]}")
    n, k, n_pad = entry.get("n"), entry.get("k"), entry.get("n_padded")
    if not (_positive_int(n) and _positive_int(k) and _positive_int(n_pad)):
        raise ValueError(f"n, k and n_padded must be positive integers, got {n!r}, {k!r}, {n_pad!r}")
    if not isinstance(entry.get("file"), str):
        raise ValueError(f"file must be a file name, got {entry.get('file')!r}")
    if fmt == "fp8":
        if entry.get("granularity") not in FP8_GRANULARITIES:
            raise ValueError(f"granularity must be one of {FP8_GRANULARITIES}, got "
                             f"{entry.get('granularity')!r}")
        if entry.get("scale_name") not in ("weight_scale", "weight_scale_inv"):
            raise ValueError("scale_name must be 'weight_scale' or 'weight_scale_inv', "
                             f"got {entry.get('scale_name')!r}")
    wf = weight_format(fmt, entry.get("granularity"))  # an nvfp4 entry naming a granularity is damaged too
    if k % wf.k_multiple != 0:
        raise ValueError(f"k = {k} is not a multiple of {wf.k_multiple}, which qpn pack never writes")
    if n_pad != wf.padded_n(n):
        raise ValueError(f"n_padded = {n_pad} but n = {n} pads to {wf.padded_n(n)}")
    for key in ("global_scale", "weight_scale", "input_scale"):
        _manifest_scalar(entry, key)
    if wf is QPN2 and "global_scale" not in entry:
        raise ValueError("an nvfp4 entry must record its global_scale")
    if wf is QPN8 and entry["granularity"] == "tensor" and "weight_scale" not in entry:
        raise ValueError("a per-tensor fp8 entry must record its weight_scale")
    sources = entry.get("source_tensors")
    if not isinstance(sources, dict) or set(sources) != set(wf.source_tags):
        raise ValueError(f"source_tensors must describe exactly {sorted(wf.source_tags)}, got "
                         f"{sorted(sources) if isinstance(sources, dict) else sources!r}")
    shapes: dict[str, list[tuple[int, ...]]] = {
        "weight_packed": [(n, k // 2)], "weight_scale": [(n, k // GROUP_K)], "weight": [(n, k)],
        "blocks": [(n, k // MX_BLOCK, MX_BLOCK // 2)], "scales": [(n, k // MX_BLOCK)]}
    if wf.format == QPN8.format:
        fp8_scale_shapes: dict[str, list[tuple[int, ...]]] = {"tensor": [(), (1,)], "channel": [(n,), (n, 1)],
                                                              "block": [ref.fp8.fp8_block_grid(n, k)]}
        shapes["weight_scale"] = fp8_scale_shapes[entry["granularity"]]
    for role, dtype in wf.source_tags.items():
        info = sources[role]
        shape = tuple(info.get("shape", ())) if isinstance(info, dict) else None
        if not isinstance(info, dict) or info.get("dtype") != dtype or shape not in shapes[role]:
            raise ValueError(f"source_tensors[{role!r}] must be {dtype} with shape {list(shapes[role][0])} for "
                             f"n = {n}, k = {k}, got {info!r}")


def _manifest_scalar(entry: Mapping[str, Any], key: str) -> None:
    value = entry.get(key)
    if key in entry and not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], (int, float))
                             and not isinstance(value[0], bool)):
        raise ValueError(f"{key} must be a one-number list, got {value!r}")

