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
from ...ref.formats import QPN2, QPNMX, weight_format
from ...ref.geometry import TILE_N
from .. import safetensors_io
from ..checkpoint import Checkpoint
from ..folder import CONFIG_FILE, HF_QUANT_CONFIG_FILE
from .layers import (
    CODES,
    GLOBAL_SCALE,
    GROUP_SCALES,
    INPUT_SCALE,
    MXFP4_PAD_SCALE_BYTE,
    NVFP4_PAD_SCALE_BYTE,
    PACKED_SUFFIXES,
    SCALES,
    TILE_SCALE,
    WEIGHT_SCALE,
    PackedLayer,
    prepack_group_scales,
)
from .manifest import (
    COPIED_CONFIG_FILES,
    MANIFEST_FILE,
    PackError,
    check_manifest,
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
    def quantized_layers(self) -> Mapping[str, PackedLayer]:
        """The quantized layers by name: its packed layers (a Checkpoint's are its linears)."""
        return self.layers

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
    elif wf is QPNMX:
        _check_mxfp4_values(layer, rows)
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


def _check_mxfp4_values(layer: PackedLayer, rows: int) -> None:
    """An mxfp4 layer's share of `_check_layer_values`: no e8m0 NaN byte, each tile's 2^T the one its scales give
    (the bytes are permutations, so the rules hold in packed order), zero pad rows; ValueError."""
    name, n, k, n_pad = layer.name, layer.n, layer.k, layer.n_padded
    tile_scale = layer.arrays[TILE_SCALE]
    try:  # QPNMX permutes the scales within each 32-row tile: the packed rows of a tile hold its bytes
        want = np.exp2(ref.mxfp4.mxfp4_tile_exponents(np.ascontiguousarray(layer.scales)).astype(np.float64))
    except ValueError as exc:  # the e8m0 NaN byte
        raise ValueError(f"{name}.{SCALES}: {exc}") from None
    if not np.array_equal(tile_scale.astype(np.float64), want):
        raise ValueError(f"{name}.{TILE_SCALE} is not 2^T of its tiles' scales (T = the tile's largest e8m0 exponent "
                         f"- {ref.mxfp4.W16_TOP_EXP}), which qpn pack writes")
    if rows:
        blocks, raw = ref.mxfp4.qpnmx_unpack(layer.codes[-rows:], layer.scales[-rows:], rows, k)
        pad = slice(rows - (n_pad - n), rows)
        if np.any(blocks[pad] != QPNMX.pad_code) or np.any(raw[pad] != MXFP4_PAD_SCALE_BYTE):
            raise ValueError(f"pad rows {n}..{n_pad - 1} are not zero; qpn pack writes zeros there")


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


def no_quantized_layer(checkpoint: Checkpoint | PackedCheckpoint) -> str | None:
    """Why a folder read as `checkpoint` is no usable quantized checkpoint - "no quantized layer: looked for
    ..., found ...; FIX" - or None when it has a quantized layer. One wording for qpn inspect / verify and
    load_quantized, which refuse such a folder (nothing would be quantized)."""
    if isinstance(checkpoint, PackedCheckpoint):
        if checkpoint.layers:
            return None
        return (f"no quantized layer: looked for the layers its {MANIFEST_FILE} lists, found none listed; pack the "
                "original checkpoint again")
    if checkpoint.linears or checkpoint.experts:
        return None
    config = "config.json quantization_config" if "quantization_config" in checkpoint.config else \
        "hf_quant_config.json"
    fix = "point qpn at the quantized export (ModelOpt / compressed-tensors weights next to their config)"
    if any(name.endswith(f".{CODES}") for name in checkpoint.tensors):
        fix = (f"its *.{CODES} tensors are qpn pack's: this is a packed folder whose {MANIFEST_FILE} is missing - "
               "pack the original checkpoint again")
    count = len(checkpoint.tensors)
    return (f"no quantized layer: looked for quantized linears as {config} ({checkpoint.format} "
            f"{checkpoint.quant_algo}) describes them, found {count} tensor{'' if count == 1 else 's'}, none "
            f"quantized; {fix}")


def copied_file_problems(checkpoint: PackedCheckpoint) -> list[str]:
    """What differs between a packed folder's copied files (configs and copied_files) and the manifest's sha256."""
    problems = []
    sources = checkpoint.manifest["source"]["files"]
    for file in COPIED_CONFIG_FILES:
        path = os.path.join(checkpoint.path, file)
        expected, present = sources.get(file), os.path.exists(path)
        if expected is not None and not present:
            problems.append(f"{file} is missing (the source has one, sha256 in the manifest); copy the source's "
                            "back or pack again")
        elif expected is None and present:
            problems.append(f"{file} is not the source's: the source had none; remove it or pack again")
        elif present and sha256_file(path) != expected:
            problems.append(f"{file} is not the source's (sha256 differs from the manifest)")
    for file, entry in checkpoint.copied_files.items():
        if sha256_file(os.path.join(checkpoint.path, file)) != entry["sha256"]:
            problems.append(f"{file} is not the source's (sha256 differs from the manifest's copied_files)")
    return problems


class _PackedTensors:
    """Every tensor of a packed folder's files, each from the file the manifest names (PackError otherwise)."""

    def __init__(self, folder: str, manifest_path: str, manifest: Mapping[str, Any], mmap: bool) -> None:
        self.folder, self.manifest_path = folder, manifest_path
        files = sorted({entry["file"] for key in ("layers", "tensors") for entry in manifest[key].values()})
        self.stored: dict[str, safetensors_io.StoredTensor] = {}
        self.file_of: dict[str, str] = {}
        for file in files:
            file_path = os.path.join(folder, file)
            if os.path.basename(file) != file or not os.path.isfile(file_path):
                raise PackError(manifest_path, None, f"names the file {file!r}, which is not in {folder}")
            for tensor_name, tensor in safetensors_io.read_safetensors(file_path, mmap=mmap).tensors.items():
                if tensor_name in self.stored:
                    raise PackError(file_path, None, f"tensor {tensor_name!r} is also in {self.file_of[tensor_name]}; "
                                                     "qpn pack writes each tensor once")
                self.stored[tensor_name], self.file_of[tensor_name] = tensor, file

    def in_file(self, tensor_name: str, file: str, layer: str | None) -> safetensors_io.StoredTensor:
        if tensor_name not in self.stored:
            raise PackError(os.path.join(self.folder, file), layer, f"tensor {tensor_name!r} is missing")
        if self.file_of[tensor_name] != file:
            raise PackError(self.manifest_path, layer, f"says tensor {tensor_name!r} is in {file!r}, but it is in "
                                                       f"{self.file_of[tensor_name]!r}")
        return self.stored[tensor_name]

    def layer(self, name: str, entry: Mapping[str, Any], check_values: bool) -> PackedLayer:
        """The layer of a checked manifest entry: its tensors' dtypes and shapes (and values, if asked)."""
        fmt, n, k, n_pad, file = entry["format"], entry["n"], entry["k"], entry["n_padded"], entry["file"]
        where = os.path.join(self.folder, file)
        wf = weight_format(fmt, entry.get("granularity"))
        arrays: dict[str, np.ndarray] = {}
        for suffix, (tag, shape) in expected_tensors(wf, n_pad, k, entry).items():
            tensor_name = f"{name}.{suffix}"
            tensor = self.in_file(tensor_name, file, name)
            if tensor.dtype != tag or tensor.shape != shape:
                raise PackError(where, name, f"tensor {tensor_name!r} must be {tag} {list(shape)}, got {tensor.dtype} "
                                             f"{list(tensor.shape)}")
            arrays[suffix] = tensor.array
        if f"{name}.{INPUT_SCALE}" in self.stored or "input_scale" in entry:
            tensor = self.in_file(f"{name}.{INPUT_SCALE}", file, name)
            if tensor.dtype != "F32" or tensor.shape != () or "input_scale" not in entry:
                raise PackError(where, name,
                                f"tensor {name + '.' + INPUT_SCALE!r} must be F32 [] and recorded in the manifest, "
                                f"got {tensor.dtype} {list(tensor.shape)}, manifest {entry.get('input_scale')!r}")
            arrays[INPUT_SCALE] = tensor.array
        layer = PackedLayer(name, fmt, n, k, arrays, entry)
        if check_values:
            try:
                _check_layer_values(layer)
            except ValueError as exc:
                raise PackError(where, name, str(exc)) from None
        return layer

    def tensor(self, name: str, entry: Mapping[str, Any]) -> safetensors_io.StoredTensor:
        """A copied tensor, with the dtype and shape the manifest records."""
        tensor = self.in_file(name, entry["file"], None)
        if tensor.dtype != entry.get("dtype") or list(tensor.shape) != entry.get("shape"):
            raise PackError(os.path.join(self.folder, entry["file"]), None,
                            f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)} but the manifest records "
                            f"{entry.get('dtype')} {entry.get('shape')}; the folder was edited after packing")
        return tensor


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
    check_manifest(manifest_path, manifest)
    _check_copied_files(folder, manifest_path, manifest)

    files = _PackedTensors(folder, manifest_path, manifest, mmap)
    layers = {name: files.layer(name, entry, check_values) for name, entry in manifest["layers"].items()}
    tensors = {name: files.tensor(name, entry) for name, entry in manifest["tensors"].items()}
    known = set(tensors) | {f"{layer}.{suffix}" for layer in layers for suffix in PACKED_SUFFIXES}
    stray = sorted(set(files.stored) - known)
    if stray:
        raise PackError(folder, None, f"holds tensors the manifest does not list: {stray[:5]}; the folder was edited "
                                      "after packing: re-pack it")
    config_path, hf_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, HF_QUANT_CONFIG_FILE)
    config = read_json(config_path) if os.path.exists(config_path) else {}
    hf_quant_config = read_json(hf_path) if os.path.exists(hf_path) else None
    return PackedCheckpoint(folder, manifest, layers, tensors, config, hf_quant_config)
