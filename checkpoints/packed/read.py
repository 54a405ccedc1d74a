"""Reading a packed folder: `load_packed` checks it against its manifest (and, by default, the values
`qpn pack` checks) and returns a `PackedCheckpoint`; `copied_file_problems` hashes its copied files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ... import ref
from ...ref.formats import QPN2, weight_format
from ...ref.geometry import TILE_N
from .. import safetensors_io
from ..checkpoint import CHECKPOINT_FORMATS, Checkpoint
from ..folder import CONFIG_FILE, HF_QUANT_CONFIG_FILE
from .layers import (
    CODES,
    GLOBAL_SCALE,
    GROUP_SCALES,
    INPUT_SCALE,
    NVFP4_PAD_SCALE_BYTE,
    PACKED_SUFFIXES,
    SCALES,
    WEIGHT_SCALE,
    PackedLayer,
    prepack_group_scales,
)
from .manifest import (
    COPIED_CONFIG_FILES,
    MANIFEST_FILE,
    PACKED_FORMAT,
    PACKED_VERSION,
    PackError,
    check_layer_entry,
    expected_tensors,
    is_weight_file,
    read_json,
    sha256_file,
)


@dataclass(frozen=True, eq=False)
class PackedCheckpoint:
    """A packed folder: layers {name: PackedLayer}, copied tensors {name: StoredTensor}, configs, manifest."""

    path: str
    manifest: Mapping[str, Any]
    layers: Mapping[str, PackedLayer]
    tensors: Mapping[str, safetensors_io.StoredTensor]
    config: Mapping[str, Any]
    hf_quant_config: Mapping[str, Any] | None

    @property
    def format(self) -> str:
        return self.manifest["source"]["format"]

    @property
    def quant_algo(self) -> str:
        return self.manifest["source"]["quant_algo"]

    @property
    def copied_files(self) -> Mapping[str, Mapping[str, Any]]:
        """{file: {"sha256", "size"}}: the source's other files, copied as they are (empty if it had none)."""
        return self.manifest.get("copied_files", {})

    def to_checkpoint(self) -> Checkpoint:
        """The source checkpoint (qpn.ref.Checkpoint), every layer unpacked: save_checkpoint writes it back."""
        linears = {name: layer.unpack() for name, layer in self.layers.items()}
        return Checkpoint(self.format, self.quant_algo, linears, self.tensors, self.config,
                                    self.hf_quant_config)



def _same_f32(a: npt.ArrayLike, b: npt.ArrayLike) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def _trailing_tile_rows(n: int, n_pad: int) -> int:
    """Rows of the whole 32-row tiles that hold the pad rows (QPN2 / QPN8 keep each tile's bytes in its rows)."""
    return -(-(n_pad - n) // TILE_N) * TILE_N


def _check_layer_values(layer: PackedLayer) -> None:
    """The cheap value checks of `qpn pack` on a packed layer (scales and pad rows, never the hashes); ValueError."""
    name, n, k, n_pad, entry = layer.name, layer.n, layer.k, layer.n_padded, layer.entry
    rows, wf = _trailing_tile_rows(n, n_pad), layer.weight_format
    if wf is QPN2:
        ref.checks.require_nvfp4_block_scales(f"{name}.{SCALES}", layer.scales)
        g = layer.nvfp4_global_scale()
        if not _same_f32(g, np.full(g.shape, g[0], np.float32)) or not _same_f32(g[0], entry["global_scale"][0]):
            raise ValueError(f"{name}.{GLOBAL_SCALE} must repeat the manifest's global scale "
                             f"{entry['global_scale'][0]!r} on every tile (qpn pack writes one value per layer), "
                             f"got {np.unique(g)[:4]}")
        g_rows = ref.global_scale_per_row(g, n_pad, f"{name}.{GLOBAL_SCALE}")
        ref.require_nvfp4_fits_fp16(layer.scales, g_rows, f"{name}.{SCALES}")  # one g per layer: order is moot
        if rows:
            wp, ws = ref.qpn2_unpack(layer.codes[-rows:], layer.scales[-rows:], rows, k)
            pad = slice(rows - (n_pad - n), rows)
            if np.any(wp[pad] != wf.pad_code) or np.any(ws[pad] != NVFP4_PAD_SCALE_BYTE):
                raise ValueError(f"pad rows {n}..{n_pad - 1} are not zero; qpn pack writes zeros there")
    else:
        s = layer.fp8_weight_scale()
        ref.checks.require_positive_scale(f"{name}.{WEIGHT_SCALE}", s)
        ref.require_qpn8_fits_fp16(s, f"{name}.{WEIGHT_SCALE}")
        if entry["granularity"] == "tensor" and not _same_f32(s.reshape(()), entry["weight_scale"][0]):
            raise ValueError(f"{name}.{WEIGHT_SCALE} = {s} but the manifest says {entry['weight_scale'][0]!r}")
        expected = prepack_group_scales(s, entry["granularity"], n, n_pad, k)
        if not np.array_equal(layer.scales.view(np.uint16), expected.view(np.uint16)):
            raise ValueError(f"{name}.{GROUP_SCALES} is not RN16(256 * {WEIGHT_SCALE}) (what qpn pack writes); "
                             "one of the two was altered")
        ref.checks.require_no_nan_e4m3(f"{name}.{CODES}", layer.codes)
        if rows:
            weight, _ = ref.qpn8_unpack(layer.codes[-rows:], np.ones((1, rows), np.float16), rows, k)
            if np.any(weight[rows - (n_pad - n):] != wf.pad_code):
                raise ValueError(f"pad rows {n}..{n_pad - 1} are not zero; qpn pack writes zeros there")
    if layer.input_scale is not None:
        if not _same_f32(layer.input_scale, entry["input_scale"][0]) or not float(layer.input_scale) > 0:
            raise ValueError(f"{name}.{INPUT_SCALE} = {layer.input_scale} but the manifest says "
                             f"{entry['input_scale'][0]!r} (and it must be finite and > 0)")


def _check_copied_files(folder: str, manifest_path: str, manifest: Mapping[str, Any]) -> None:
    """The manifest's copied_files (optional: only a source with such files has them) and their presence and
    sizes in the folder (their sha256 is `qpn verify`'s: copied_file_problems). Raises PackError."""
    copied = manifest.get("copied_files", {})
    if not isinstance(copied, dict):
        raise PackError(manifest_path, None, f"copied_files must be an object, got {type(copied).__name__}; the "
                                             "manifest is damaged")
    for name, entry in copied.items():
        if (os.path.basename(name) != name or name.startswith(".") or is_weight_file(name)
                or name in (MANIFEST_FILE, *COPIED_CONFIG_FILES)):
            raise PackError(manifest_path, None, f"copied_files names {name!r}, a name qpn pack never copies; the "
                                                 "manifest is damaged")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64
                and isinstance(entry.get("size"), int) and not isinstance(entry["size"], bool)
                and entry["size"] >= 0):
            raise PackError(manifest_path, None, f"copied_files[{name!r}] must be {{\"sha256\": hex, \"size\": "
                                                 f"bytes}}, got {entry!r}; the manifest is damaged")
        path = os.path.join(folder, name)
        if os.path.islink(path) or not os.path.isfile(path):
            what = "is missing" if not os.path.lexists(path) else "is not a regular file (qpn pack copies files)"
            raise PackError(folder, None, f"copied file {name} {what}; the folder was edited after packing: "
                                          "re-pack it")
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise PackError(folder, None, f"copied file {name} has {size} bytes but the manifest records "
                                          f"{entry['size']}; the folder was edited after packing: re-pack it")


def copied_file_problems(checkpoint: PackedCheckpoint) -> list[str]:
    """What differs between a packed folder's copied files (configs and copied_files) and the manifest's sha256."""
    problems = []
    sources = checkpoint.manifest["source"]["files"]
    for file in COPIED_CONFIG_FILES:
        path = os.path.join(checkpoint.path, file)
        expected = sources.get(file)
        if (expected is None) != (not os.path.exists(path)) or (expected is not None and sha256_file(path) != expected):
            problems.append(f"{file} is not the source's (sha256 differs from the manifest)")
    for file, entry in checkpoint.copied_files.items():
        if sha256_file(os.path.join(checkpoint.path, file)) != entry["sha256"]:
            problems.append(f"{file} is not the source's (sha256 differs from the manifest's copied_files)")
    return problems



def load_packed(path: str | os.PathLike[str], *, mmap: bool = True, check_values: bool = True) -> PackedCheckpoint:
    """Read and check a packed folder. Always: the manifest's own rules and its agreement with the
    files (each layer's entry, N_pad, K, source shapes; every tensor in the file the manifest
    names, with the dtype and shape it records). With check_values, also the cheap value checks
    that `qpn pack` applies (NaN and negative NVFP4 scale bytes, global scales finite, > 0, one
    per layer and equal to the manifest's, fp16 overflow, FP8 scales and their S16, NaN FP8
    codes, zero pad rows, input scales). Values are not compared with the manifest's hashes here:
    that is `qpn verify`'s job (which reads with check_values=False and reports a bad value as a
    failure of its layer). Raises PackError."""
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise PackError(folder, None, "is not a folder; pass the packed checkpoint directory")
    manifest_path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.isfile(manifest_path):
        raise PackError(folder, None, f"has no {MANIFEST_FILE}; it is not a qpn packed checkpoint "
                                      "(qpn pack writes one)")
    manifest = read_json(manifest_path)
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
    _check_copied_files(folder, manifest_path, manifest)

    files = sorted({e["file"] for e in manifest["layers"].values()} | {e["file"] for e in manifest["tensors"].values()})
    stored: dict[str, safetensors_io.StoredTensor] = {}
    file_of: dict[str, str] = {}
    for file in files:
        file_path = os.path.join(folder, file)
        if os.path.basename(file) != file or not os.path.isfile(file_path):
            raise PackError(manifest_path, None, f"names the file {file!r}, which is not in {folder}")
        for tensor_name, tensor in safetensors_io.read_safetensors(file_path, mmap=mmap).tensors.items():
            if tensor_name in stored:
                raise PackError(file_path, None, f"tensor {tensor_name!r} is also in {file_of[tensor_name]}; "
                                                 "qpn pack writes each tensor once")
            stored[tensor_name], file_of[tensor_name] = tensor, file

    def in_file(tensor_name: str, file: str, layer: str | None) -> safetensors_io.StoredTensor:
        if tensor_name not in stored:
            raise PackError(os.path.join(folder, file), layer, f"tensor {tensor_name!r} is missing")
        if file_of[tensor_name] != file:
            raise PackError(manifest_path, layer, f"says tensor {tensor_name!r} is in {file!r}, but it is in "
                                                  f"{file_of[tensor_name]!r}")
        return stored[tensor_name]

    layers: dict[str, PackedLayer] = {}
    for name, entry in manifest["layers"].items():
        fmt, n, k, n_pad, file = entry["format"], entry["n"], entry["k"], entry["n_padded"], entry["file"]
        wf = weight_format(fmt, entry.get("granularity"))
        arrays: dict[str, np.ndarray] = {}
        for suffix, (tag, shape) in expected_tensors(wf, n_pad, k, entry).items():
            tensor_name = f"{name}.{suffix}"
            tensor = in_file(tensor_name, file, name)
            if tensor.dtype != tag or tensor.shape != shape:
                raise PackError(os.path.join(folder, file), name,
                                f"tensor {tensor_name!r} must be {tag} {list(shape)}, got {tensor.dtype} "
                                f"{list(tensor.shape)}")
            arrays[suffix] = tensor.array
        input_scale = None
        if f"{name}.{INPUT_SCALE}" in stored or "input_scale" in entry:
            tensor = in_file(f"{name}.{INPUT_SCALE}", file, name)
            if tensor.dtype != "F32" or tensor.shape != () or "input_scale" not in entry:
                raise PackError(os.path.join(folder, file), name,
                                f"tensor {name + '.' + INPUT_SCALE!r} must be F32 [] and recorded in the manifest, "
                                f"got {tensor.dtype} {list(tensor.shape)}, manifest {entry.get('input_scale')!r}")
            input_scale = tensor.array
        if wf is QPN2:
            scales, global_scale, weight_scale = arrays[SCALES], arrays[GLOBAL_SCALE], None
        else:
            scales, global_scale, weight_scale = arrays[GROUP_SCALES], None, arrays[WEIGHT_SCALE]
        layer = PackedLayer(name, fmt, n, k, arrays[CODES], scales, global_scale, weight_scale, input_scale, entry)
        if check_values:
            try:
                _check_layer_values(layer)
            except ValueError as exc:
                raise PackError(os.path.join(folder, file), name, str(exc)) from None
        layers[name] = layer

    tensors: dict[str, safetensors_io.StoredTensor] = {}
    for name, entry in manifest["tensors"].items():
        tensor = in_file(name, entry["file"], None)
        if tensor.dtype != entry.get("dtype") or list(tensor.shape) != entry.get("shape"):
            raise PackError(os.path.join(folder, entry["file"]), None,
                            f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)} but the manifest records "
                            f"{entry.get('dtype')} {entry.get('shape')}; the folder was edited after packing")
        tensors[name] = tensor
    known = set(tensors) | {f"{layer}.{suffix}" for layer in layers for suffix in PACKED_SUFFIXES}
    stray = sorted(set(stored) - known)
    if stray:
        raise PackError(folder, None, f"holds tensors the manifest does not list: {stray[:5]}; the folder was edited "
                                      "after packing: re-pack it")
    config_path, hf_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, HF_QUANT_CONFIG_FILE)
    config = read_json(config_path) if os.path.exists(config_path) else {}
    hf_quant_config = read_json(hf_path) if os.path.exists(hf_path) else None
    return PackedCheckpoint(folder, manifest, layers, tensors, config, hf_quant_config)
