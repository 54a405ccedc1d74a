"""Checkpoint folders: `load_checkpoint`, `open_checkpoint` and `save_checkpoint`, the producer picked once.

A checkpoint is a folder: `config.json` (its `quantization_config`) and/or the older ModelOpt
`hf_quant_config.json`, plus `model.safetensors` or shards listed in
`model.safetensors.index.json` ("weight_map": tensor -> file). The configs say which producer
wrote it (`_producer_of`, the one dispatch); that producer's reader (qpn.checkpoints.modelopt,
qpn.checkpoints.compressed_tensors) names, checks and builds each layer (qpn.checkpoints.producer)
into the data model of qpn.checkpoints.checkpoint. Every error is a CheckpointError, a ValueError
naming the file and the tensor or config entry at fault.

Two ways in, one walk through the data: the configs, the index, every header, the structure
(qpn.checkpoints.producer.structure), then each layer built by the producer with the same value
checks. They differ only in where the bytes come from:

- `load_checkpoint` memory-maps every file (`read_safetensors`): the arrays are read-only views,
  loading copies nothing, and only what a check reads is paged in (scales, FP8 weights, never an
  NVFP4 layer's codes). mmap=False reads each file once instead.
- `open_checkpoint` reads with plain file reads, one layer or tensor at a time
  (`SafetensorsFile`), for a reader that must survive a file changing under it (`qpn pack`): a
  truncated or rewritten file is a SafetensorsError naming it, where a memory map dies of SIGBUS.

Neither byte source can serve both: reading a whole checkpoint with file reads copies it into
private memory, and a memory map cannot survive a truncation. Measured on a 1.2 GB NVFP4
checkpoint (64 layers of 4096 x 8192, 4 shards): load_checkpoint 0.2 s warm / 0.8 s cold, 17 MB
of private memory (what the checks read stays file cache: 150-270 MB, evictable); every layer
through open_checkpoint, kept as load_checkpoint keeps them: 0.6-2.5 s warm / 2.4-3.5 s cold and
1.23 GB of private memory. (qpn pack keeps one file's layers at a time.)

Sharded: every file in the weight_map exists, holds exactly the tensors mapped to it, and no
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
import json
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .atomic import TargetRules, atomic_folder, require_writable_target, write_json
from .checkpoint import Checkpoint, CheckpointError, QuantizedLinear
from .compressed_tensors import CompressedTensors
from .modelopt import ModelOpt
from .producer import Producer, Recipe, config_error, serialize, structure
from .safetensors_io import (
    SafetensorsFile,
    StoredTensor,
    TensorInfo,
    read_safetensors,
    read_safetensors_header,
    write_safetensors,
)

CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_METADATA = {"format": "pt"}  # what transformers expects in every shard
# save_checkpoint's mark in every file it writes: overwrite=True replaces only a folder that carries it
SAVED_METADATA = {**SAFETENSORS_METADATA, "writer": "qpn"}
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_PRODUCERS: dict[str, type[Producer]] = {producer.format: producer for producer in (ModelOpt, CompressedTensors)}


def _producer_of(config: Mapping | None, config_path: str, hf_quant_config: Mapping | None,
                 hf_path: str, folder: str) -> Producer:
    """The reader of the producer the configs name, with the config read (the one dispatch on the producer)."""
    qc = config.get("quantization_config") if config is not None else None
    hf = ModelOpt.from_hf_quant_config(hf_quant_config, hf_path) if hf_quant_config is not None else None
    if qc is None:
        if hf is None:
            raise CheckpointError(folder, None, f"no quantization config: neither {CONFIG_FILE} 'quantization_config' "
                                                f"nor {HF_QUANT_CONFIG_FILE}; this is not a quantized checkpoint")
        return hf
    if not isinstance(qc, Mapping):
        raise config_error(config_path, "quantization_config", f"must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method.startswith("modelopt"):
        producer = ModelOpt(qc, config_path)
        if hf is not None and hf.quant_algo != producer.quant_algo:
            raise config_error(hf_path, "quantization.quant_algo",
                               f"says {hf.quant_algo!r} but {config_path} says {producer.quant_algo!r}; "
                               "the two quantization configs must agree")
        return producer
    if method == "compressed-tensors":
        if hf is not None:
            raise config_error(hf_path, None, f"a ModelOpt config next to a compressed-tensors {config_path}; "
                                              "remove the one that does not describe the weights")
        return CompressedTensors(qc, config_path)
    raise config_error(config_path, "quantization_config.quant_method",
                       f"quant_method {qc.get('quant_method')!r} is not supported; qpn reads 'modelopt' and "
                       "'compressed-tensors' (nvfp4-pack-quantized)")


def _assemble(stored: Mapping[str, StoredTensor], file_of: Mapping[str, str], producer: Producer,
              config: Mapping, hf_quant_config: Mapping | None) -> Checkpoint:
    """Group tensors into linears, validate everything against the config, return the Checkpoint."""
    linears: dict[str, QuantizedLinear] = {}

    def build(recipe: Recipe) -> None:
        linears[recipe.prefix] = producer.build(recipe, lambda name: stored[name].array, file_of)

    _, rest = structure(stored, file_of, producer, build)
    return Checkpoint(producer.format, producer.quant_algo, linears, {name: stored[name] for name in rest},
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


def weight_files(folder: str, raw: dict[str, bytes] | None = None
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


def file_holding(folder: str | os.PathLike[str], tensor: str) -> str | None:
    """The .safetensors file of the checkpoint `folder` that holds `tensor` (its index's weight_map, else the
    headers of the folder's .safetensors files), or None where the folder does not tell (no such tensor, no
    readable file). For errors found outside qpn's readers: vLLM's loaders get a tensor without its file."""
    folder = os.fspath(folder)
    try:
        files, weight_map, _ = weight_files(folder)
        if weight_map is not None:
            return os.path.join(folder, weight_map[tensor]) if tensor in weight_map else None
        for file in sorted({*files, *(f for f in os.listdir(folder) if f.endswith(".safetensors"))}):
            path = os.path.join(folder, file)
            if tensor in read_safetensors_header(path).tensors:
                return path
    except (OSError, ValueError):  # CheckpointError / SafetensorsError are ValueErrors: the file stays unnamed
        return None
    return None


def _configs(folder: str, raw: dict[str, bytes] | None = None) -> tuple[dict | None, dict | None, Producer]:
    """(config.json, hf_quant_config.json, the reader of the producer they name) of a checkpoint folder."""
    if not os.path.isdir(folder):
        raise CheckpointError(folder, None, "is not a folder; pass the checkpoint directory")
    config_path = os.path.join(folder, CONFIG_FILE)
    hf_path = os.path.join(folder, HF_QUANT_CONFIG_FILE)
    config = _read_json(config_path, raw) if os.path.exists(config_path) else None
    hf_quant_config = _read_json(hf_path, raw) if os.path.exists(hf_path) else None
    return config, hf_quant_config, _producer_of(config, config_path, hf_quant_config, hf_path, folder)


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
    config, hf_quant_config, producer = _configs(folder)
    files, weight_map, index_path = weight_files(folder)
    stored, file_of = _gather(folder, files, weight_map, index_path,
                              lambda file_path: read_safetensors(file_path, mmap=mmap).tensors)
    return _assemble(stored, file_of, producer, config or {}, hf_quant_config)


class OpenCheckpoint:
    """A checkpoint folder opened by `open_checkpoint`: checked for structure, read one layer or tensor at a time.

    `linear(name)` and `tensor(name)` read with plain file reads (`SafetensorsFile`), never a
    memory map, so memory holds what the caller keeps, and a file truncated or rewritten while it
    is read is a SafetensorsError naming it (`require_unchanged()` checks every file at once);
    never a SIGBUS. `linear(name)` runs the value checks of `load_checkpoint` on that layer.
    `json_bytes` holds the bytes of the JSON files read (config.json, hf_quant_config.json, the
    index), so a caller can copy and hash exactly what was validated. Close it (context manager).
    """

    def __init__(self, path: str, config: dict | None, hf_quant_config: dict | None, producer: Producer,
                 files: dict[str, SafetensorsFile], weight_map: dict[str, str] | None, json_bytes: dict[str, bytes],
                 header_of: dict[str, TensorInfo], file_of: dict[str, str]) -> None:
        self.path = path
        self.format, self.quant_algo = producer.format, producer.quant_algo
        self.config = dict(config or {})
        self.hf_quant_config = dict(hf_quant_config) if hf_quant_config is not None else None
        self.files = files  # file name -> the open file
        self.weight_map = weight_map
        self.json_bytes = json_bytes
        self._header_of, self._file_of = header_of, file_of  # tensor -> header entry, file path
        self._producer = producer
        self._recipes, self.tensor_names = structure(header_of, file_of, producer)
        self.layer_names = sorted(self._recipes)

    def file_of(self, tensor: str) -> str:
        """The name of the file holding `tensor` (a layer's tensor or another one)."""
        return os.path.basename(self._file_of[tensor])

    def layer_file(self, layer: str) -> str:
        """The name of the file holding the layer's weight."""
        return self.file_of(self._recipes[layer].codes)

    def info(self, tensor: str) -> TensorInfo:
        """Dtype tag, shape and offsets of `tensor` (from the header: nothing is read)."""
        return self._header_of[tensor]

    def tensor(self, name: str) -> StoredTensor:
        """The tensor `name`, read now (a read-only array of its own)."""
        return self.files[self.file_of(name)].read(name)

    def linear(self, name: str, *, codes: bool = True) -> QuantizedLinear:
        """The quantized linear `name`, read now and checked as `load_checkpoint` checks it (CheckpointError).

        codes=False skips an NVFP4 or MXFP4 layer's codes (weight_packed), which no rule reads: it is then a
        read-only zero-stride placeholder of the right shape - for checks only (unpackable_reason),
        never for packing. An FP8 layer's codes are always read (NaN codes are an error).
        """
        recipe = self._recipes[name]
        placeholder = recipe.codes if recipe.codes_role != "weight" and not codes else None

        def array_of(tensor: str) -> np.ndarray:
            if tensor == placeholder:
                return np.broadcast_to(np.zeros((), np.uint8), self._header_of[tensor].shape)
            return self.tensor(tensor).array

        return self._producer.build(recipe, array_of, self._file_of)

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
    config, hf_quant_config, producer = _configs(folder, json_bytes)
    names, weight_map, index_path = weight_files(folder, json_bytes)
    files: dict[str, SafetensorsFile] = {}
    try:
        for file in names:
            files[file] = SafetensorsFile(os.path.join(folder, file))
        header_of, file_of = _gather(folder, names, weight_map, index_path,
                                     lambda file_path: files[os.path.basename(file_path)].header.tensors)
        return OpenCheckpoint(folder, config, hf_quant_config, producer, files, weight_map, json_bytes, header_of,
                              file_of)
    except BaseException:
        for opened in files.values():
            opened.close()
        raise


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


def not_written_by(folder: str, writer: str, side_files: Collection[str] = ()) -> str | None:
    """None if `folder` holds only what `writer` (save_checkpoint, qpn quantize) writes - the configs, the
    weights as model.safetensors or model-NNNNN-of-NNNNN.safetensors shards each marked with SAVED_METADATA,
    and `side_files` - else why not (an overwrite never replaces a user's own checkpoint)."""
    written = {CONFIG_FILE, HF_QUANT_CONFIG_FILE, SINGLE_FILE, INDEX_FILE, *side_files}
    entries = sorted(os.listdir(folder))
    foreign = [e for e in entries if not (e in written or _SHARD_FILE.match(e))
               or os.path.islink(os.path.join(folder, e)) or not os.path.isfile(os.path.join(folder, e))]
    if foreign:
        more = " ..." if len(foreign) > 5 else ""
        return f"it holds {', '.join(foreign[:5])}{more}, which {writer} does not write"
    weights = [e for e in entries if e.endswith(".safetensors")]
    for entry in weights:
        try:
            metadata = read_safetensors_header(os.path.join(folder, entry)).metadata or {}
        except (OSError, ValueError):
            metadata = {}
        if metadata.get("writer") != SAVED_METADATA["writer"]:
            return f"{entry} lacks {writer}'s mark (safetensors metadata writer={SAVED_METADATA['writer']!r})"
    return None if weights else "it holds no safetensors file"


def _not_saved_by_qpn(folder: str) -> str | None:
    return not_written_by(folder, "save_checkpoint")


SAVE_TARGET_RULES: TargetRules = {"ours": _not_saved_by_qpn, "what": "checkpoint"}


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
    require_writable_target(target, overwrite, **SAVE_TARGET_RULES)

    config = copy.deepcopy(dict(checkpoint.config))
    hf_quant_config = None
    if checkpoint.hf_quant_config is not None:
        hf_quant_config = copy.deepcopy(dict(checkpoint.hf_quant_config))
    if "quantization_config" not in config and hf_quant_config is None:
        config["quantization_config"] = _PRODUCERS[checkpoint.format].default_quantization_config(checkpoint)
    config_path = os.path.join(target, CONFIG_FILE)
    hf_path = os.path.join(target, HF_QUANT_CONFIG_FILE)
    producer = _producer_of(config, config_path, hf_quant_config, hf_path, target)
    if (producer.format, producer.quant_algo) != (checkpoint.format, checkpoint.quant_algo.upper()):
        raise CheckpointError(producer.source, None, f"describes a {producer.format} {producer.quant_algo} checkpoint "
                                                     f"but the Checkpoint says {checkpoint.format} "
                                                     f"{checkpoint.quant_algo}")
    stored = serialize(producer, checkpoint)
    shards = _shards(stored, max_shard_bytes)
    file_of = {name: os.path.join(target, file) for file, names in shards for name in names}
    _assemble(stored, file_of, producer, config, hf_quant_config)  # the whole load-side validation, in memory

    with atomic_folder(target, overwrite=overwrite, **SAVE_TARGET_RULES) as tmp:
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
