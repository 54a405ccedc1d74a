"""The qpn packed checkpoint: a quantized checkpoint whose linears are already in the QPN2 / QPN8 layout.

`qpn pack SRC OUT` writes one; `qpn verify` / `qpn inspect` read both kinds of folder;
`qpn.torch_bridge.load_quantized(model, OUT)` fills a model from one without prepacking again.
Pure numpy and `qpn.ref` (no torch): packing a checkpoint needs neither torch nor a GPU.

Folder OUT (everything is derived from the source folder alone, so packing the same input twice
gives identical bytes; nothing records the time or the source path):

    qpn_manifest.json      what the folder is (below); written last, its presence marks the folder
    config.json            copied byte for byte from the source (if present), and so is
    hf_quant_config.json   the older ModelOpt config (if present)
    model.safetensors      or the source's own shard names + model.safetensors.index.json: every
                           layer and tensor lands in the file that held it in the source
    every other file       of the source's top level, copied byte for byte and listed in the
                           manifest's copied_files (tokenizer.json, tokenizer_config.json,
                           generation_config.json, chat templates, README ...), so the folder
                           serves as it is; not copied: other *.safetensors files and indexes
                           (weights the checkpoint does not list), hidden entries (.git, .cache,
                           .gitattributes), and - reported by `qpn pack` - subfolders, links to
                           nothing, FIFOs and devices (`source_extras`). A link is followed: the
                           copy is a regular file holding the content.

Tensors of a quantized linear X (N output features, K input features; N_pad = N rounded up to 32,
or to 128 for FP8 128x128 block scales; pad rows are exact zeros and are cropped by the readers):

    NVFP4 -> QPN2   X.qpn_codes          U8   [N_pad, K/2]     codes in QPN2 byte order (docs/QPN2.md)
                    X.qpn_scales         U8   [N_pad, K/16]    e4m3 scale bytes in QPN2 order
                    X.qpn_global_scale   F32  [N_pad/32]       multiplier per 32-row tile (ModelOpt's
                                                               weight_scale_2; compressed-tensors'
                                                               reciprocal already inverted)
    FP8   -> QPN8   X.qpn_codes          U8   [N_pad, K]       e4m3 bytes in QPN8 order (docs/QPN8.md)
                    X.qpn_group_scales   F16  [1, N_pad] or [K/128, N_pad/32]   S16 = RN16(256 * s)
                    X.qpn_weight_scale   F32  as in the source: () / [N] / [ceil(N/128), ceil(K/128)]
                                                               (the fp32 scale, kept because S16 is
                                                               rounded and cannot give it back)
    both            X.qpn_input_scale    F32  []               the activation scale, if the source had one

The buffers are exactly `QPNLinear`'s (`codes`, `scales`, `global_scale` / `group_scales`),
padding included: NVFP4 pad rows have code 0 and scale byte 0x00, FP8 pad rows code 0x00 and
scale 1.0 (per channel). Every other source tensor (biases, embeddings, norms, unquantized
weights) is copied through under its own name and dtype tag.

qpn_manifest.json (sorted keys, 2-space indent):

    {"format": "qpn-packed", "version": 1, "producer": {"name": "qpn", "version": ...},
     "source": {"format": "modelopt" | "compressed-tensors", "quant_algo": "NVFP4" | ...,
                "files": {file name: sha256 of the source file}},
     "copied_files": {file name: {"sha256": ..., "size": bytes}} (only if the source had such files:
                     a checkpoint without them packs to the same bytes as before this key existed),
     "layers": {X: {"format": "nvfp4" | "fp8", "layout": "QPN2" | "QPN8", "n": N, "k": K,
                    "n_padded": N_pad, "file": shard, "global_scale": [g] (nvfp4),
                    "granularity": "tensor" | "channel" | "block", "scale_name": ...,
                    "weight_scale": [s] (fp8 per tensor), "input_scale": [s] (if any),
                    "source_tensors": {role: {"dtype": ..., "shape": [...], "sha256": ...}}}},
     "tensors": {name: {"file": ..., "dtype": ..., "shape": [...], "sha256": ...}}}

`source_tensors` hashes the original bytes of the layer's quantized tensors (nvfp4: roles
weight_packed and weight_scale; fp8: weight and weight_scale), so a packed folder verifies on its
own: `PackedLayer.unpack()` is the exact inverse of the prepack and must give those bytes back.

`load_packed` checks that every copied file is there with its recorded size; `qpn verify` also
compares its sha256 (`copied_file_problems`).

Reading the source: `pack_checkpoint` reads it with plain file reads, one layer or tensor at a
time (`open_checkpoint`), never through a memory map, which a truncation by another
process turns into a SIGBUS. Every source file must stay as it was from the moment it is first
read until the output is complete (size and modification time, checked at every read and once
more before the manifest is written); a shard or copied file that changes is a
SafetensorsError / PackError naming it, and nothing is written.

Errors: `PackError` (a ValueError naming the folder, the layer and the rule) for layers that
cannot be packed (K not a multiple of 64 for QPN2 / 16 for QPN8 / 128 for block scales, blocks
whose largest weight overflows fp16) and for packed folders that break this format.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, TypeGuard

import numpy as np
import numpy.typing as npt

from .. import __version__, ref
from ..ref.formats import (
    FORMAT_NAMES,
    FP8_GRANULARITIES,
    QPN2,
    QPN8,
    WEIGHT_FORMATS,
    Buffer,
    Shape,
    WeightFormat,
    weight_format,
)
from ..ref.geometry import GROUP_K, TILE_N
from . import safetensors_io
from .atomic import atomic_folder, recover_interrupted, require_writable_target, write_json
from .checkpoint import CHECKPOINT_FORMATS, Checkpoint, FP8Linear, NVFP4Linear
from .folder import (
    CONFIG_FILE,
    HF_QUANT_CONFIG_FILE,
    INDEX_FILE,
    SAFETENSORS_METADATA,
    SINGLE_FILE,
    OpenCheckpoint,
    open_checkpoint,
)

PACKED_FORMAT = "qpn-packed"
PACKED_VERSION = 1
MANIFEST_FILE = "qpn_manifest.json"
COPIED_CONFIG_FILES = (CONFIG_FILE, HF_QUANT_CONFIG_FILE)


def tensor_suffix(buffer: Buffer) -> str:
    """The suffix a packed file stores a kernel buffer under: X.qpn_<buffer name of qpn.ref.formats>."""
    return f"qpn_{buffer.name}"


# suffixes of a packed linear's tensors: the kernel buffers of qpn.ref.formats, then the two scales
# the kernels do not read (FP8's fp32 scale, which S16 rounds, and the activation scale)
CODES, SCALES, GLOBAL_SCALE = (tensor_suffix(b) for b in QPN2.buffers)
GROUP_SCALES = tensor_suffix(QPN8.buffer("group_scales"))
WEIGHT_SCALE, INPUT_SCALE = "qpn_weight_scale", "qpn_input_scale"
PACKED_SUFFIXES = (CODES, SCALES, GLOBAL_SCALE, GROUP_SCALES, WEIGHT_SCALE, INPUT_SCALE)

# the e4m3 byte of QPN2's pad scale (+0: every pad weight is +0 whatever its code); pad rows are
# the same bytes QPNLinear writes (tests/test_cli.py compares the two)
_NVFP4_PAD_SCALE_BYTE = int(ref.encode_e4m3(np.float32(QPN2.pad_scale)))
_HASH_CHUNK = 16 << 20  # bytes per read when hashing files

Progress = Callable[..., Iterable]  # progress(iterable, desc=..., total=..., unit=...) -> iterable


def _no_progress(iterable: Iterable, **_: object) -> Iterable:
    return iterable


class PackError(ValueError):
    """A checkpoint cannot be packed, or a packed folder breaks the format. Names the path and the layer."""

    def __init__(self, path: str | os.PathLike[str], layer: str | None, message: str) -> None:
        self.path = os.fspath(path)
        self.layer = layer
        where = f"{self.path}: layer {layer!r}: " if layer is not None else f"{self.path}: "
        super().__init__(where + message)


# ----------------------------------------------------------------------------------------------
# rules shared by pack, inspect and verify


def weight_format_of(linear: NVFP4Linear | FP8Linear) -> WeightFormat:
    """The qpn.ref.formats description of a layer: QPN2 for an NVFP4Linear, QPN8 / QPN8_BLOCK for an FP8Linear."""
    if isinstance(linear, NVFP4Linear):
        return QPN2
    return weight_format("fp8", linear.granularity)


def layer_format(linear: NVFP4Linear | FP8Linear) -> str:
    """"nvfp4" for an NVFP4Linear, "fp8" for an FP8Linear."""
    return weight_format_of(linear).format


def padded_rows(linear: NVFP4Linear | FP8Linear) -> int:
    """N_pad: N rounded up to the layout's N multiple."""
    return weight_format_of(linear).padded_n(linear.n)


def k_multiple(linear: NVFP4Linear | FP8Linear) -> int:
    """The K rule of the layer's layout (qpn.ref.formats)."""
    return weight_format_of(linear).k_multiple


def unpackable_reason(linear: NVFP4Linear | FP8Linear) -> str | None:
    """Why `linear` (a qpn.ref NVFP4Linear / FP8Linear) cannot be packed, or None if it can.

    Reads shapes and scales only (never the codes), so it is cheap enough for `qpn inspect`.
    N never blocks packing (it is padded); K does, and so do scales whose weights overflow fp16.
    """
    wf = weight_format_of(linear)
    if linear.k % wf.k_multiple != 0:
        return (f"K={linear.k} is not a multiple of {wf.k_multiple} ({wf.label}); "
                "pad the input features with zero columns")
    try:
        if isinstance(linear, NVFP4Linear):
            ref.require_nvfp4_fits_fp16(linear.weight_scale, ref.global_scale_per_row(linear.global_scale, linear.n))
        else:
            ref.require_qpn8_fits_fp16(linear.weight_scale)
    except ValueError as exc:
        return str(exc)
    return None


def _pad_rows(a: np.ndarray, rows: int, fill: float) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    pad = np.full((rows - a.shape[0],) + a.shape[1:], fill, dtype=a.dtype)
    return np.concatenate([a, pad], axis=0)


def prepack_layer(linear: NVFP4Linear | FP8Linear) -> dict[str, np.ndarray]:
    """A qpn.ref NVFP4Linear / FP8Linear -> its packed buffers {suffix: array} (module docstring).

    Raises ValueError if the layer cannot be packed (see `unpackable_reason`).
    """
    wf = weight_format_of(linear)
    n_pad = wf.padded_n(linear.n)
    out: dict[str, np.ndarray] = {}
    if isinstance(linear, NVFP4Linear):
        wp = _pad_rows(linear.weight_packed, n_pad, wf.pad_code)
        ws = _pad_rows(linear.weight_scale, n_pad, _NVFP4_PAD_SCALE_BYTE)
        out[CODES], out[SCALES] = ref.qpn2_prepack(wp, ws)
        out[GLOBAL_SCALE] = np.full(wf.buffer("global_scale").shape(n_pad, linear.k), linear.global_scale,
                                    dtype=np.float32)
    else:
        w = _pad_rows(linear.weight, n_pad, wf.pad_code)
        s = linear.weight_scale
        s_pad = _pad_rows(s, n_pad, wf.pad_scale) if linear.granularity == "channel" else s
        out[CODES], out[GROUP_SCALES] = ref.qpn8_prepack(w, s_pad, linear.granularity)
        out[WEIGHT_SCALE] = np.asarray(s, dtype=np.float32)
    if linear.input_scale is not None:
        out[INPUT_SCALE] = np.asarray(linear.input_scale, dtype=np.float32).reshape(())
    return out


def sha256_array(a: np.ndarray) -> str:
    """sha256 of an array's bytes in C order (no copy for contiguous arrays)."""
    return hashlib.sha256(np.ascontiguousarray(a).data.cast("B")).hexdigest()


def sha256_file(path: str | os.PathLike[str], progress: Progress = _no_progress) -> str:
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        chunks = iter(lambda: f.read(_HASH_CHUNK), b"")
        for chunk in progress(chunks, desc=f"hash {os.path.basename(path)}", total=-(-size // _HASH_CHUNK) or None,
                              unit="chunk"):
            digest.update(chunk)
    return digest.hexdigest()


def source_tensors(linear: NVFP4Linear | FP8Linear) -> dict[str, safetensors_io.StoredTensor]:
    """The layer's quantized tensors by role, with the bytes and dtype tag the checkpoint stores."""
    # each role is the layer's attribute of that name (NVFP4Linear.weight_packed, FP8Linear.weight, ...)
    return {role: safetensors_io.StoredTensor(getattr(linear, role), tag)
            for role, tag in weight_format_of(linear).source_tags.items()}


# ----------------------------------------------------------------------------------------------
# pack


def is_packed(path: str | os.PathLike[str]) -> bool:
    """True if `path` is a folder holding a qpn packed checkpoint (its manifest)."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST_FILE))


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackError(path, None, f"is not valid UTF-8 JSON ({exc})") from None


def _source_files(folder: str) -> tuple[list[str], dict[str, str] | None]:
    """(safetensors files, weight_map or None) of a checkpoint folder load_checkpoint accepted."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        weight_map = _read_json(index)["weight_map"]
        return sorted(set(weight_map.values())), weight_map
    return [SINGLE_FILE], None


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def source_extras(folder: str | os.PathLike[str]) -> tuple[list[str], dict[str, str]]:
    """(files `qpn pack` copies as they are, {entry: why it is not copied}) of a checkpoint folder.

    Copied: every entry at the top of the folder that is (or links to) a regular file, except
    the weights (`*.safetensors`, `*.safetensors.index.json`: qpn pack writes its own), the
    config files (copied as configs) and hidden entries (`.git`, `.cache`, `.gitattributes`:
    version-control and download metadata, not part of the model; left out silently). Not copied,
    and reported: folders, links to nothing, FIFOs / sockets / devices (never opened). A link is
    followed (an HF cache snapshot is all links): the copy holds the content, as a regular file.
    """
    folder = os.fspath(folder)
    copy, skipped = [], {}
    entries = sorted(os.listdir(folder))
    weights = {INDEX_FILE, *_source_files(folder)[0]} if any(map(_is_weight_file, entries)) else set()
    for entry in entries:
        if entry.startswith(".") or entry in COPIED_CONFIG_FILES or entry in weights:
            continue
        path = os.path.join(folder, entry)
        if _is_weight_file(entry):
            skipped[entry] = "a weight file the checkpoint does not list"
            continue
        try:
            mode = os.stat(path).st_mode
        except OSError:
            skipped[entry] = "a symbolic link to nothing" if os.path.islink(path) else "cannot be read"
            continue
        if stat.S_ISDIR(mode):
            skipped[entry] = "a folder: qpn pack copies the files at the top of the checkpoint only"
        elif not stat.S_ISREG(mode):
            skipped[entry] = "not a regular file"
        else:
            copy.append(entry)
    return copy, skipped


def _copy_chunks(source: str, target: str) -> tuple[str, int, safetensors_io.FileStamp]:
    """Copy the regular file `source` to `target` in chunks, fsynced: (sha256, size, stamp of the source).

    The source must not change while it is copied (size and modification time compared before and
    after): a PackError naming it otherwise, as for the weights.
    """
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PackError(source, None, "is no longer a regular file; it changed while qpn was reading it")
        stamp = safetensors_io.file_stamp(st)
        digest, size = hashlib.sha256(), 0
        with open(target, "xb") as out:
            for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        now = safetensors_io.file_stamp(os.fstat(f.fileno()))
    if now != stamp or size != stamp.size:
        raise PackError(source, None, safetensors_io.changed_message(stamp, now))
    return digest.hexdigest(), size, stamp


def _require_unchanged(path: str, stamp: safetensors_io.FileStamp) -> None:
    try:
        now = safetensors_io.file_stamp(os.stat(path))
    except OSError:
        now = safetensors_io.FileStamp(-1, -1)
    if now != stamp:
        raise PackError(path, None, safetensors_io.changed_message(stamp, now))


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _layer_entry(name: str, linear: NVFP4Linear | FP8Linear, file: str,
                 buffers: Mapping[str, np.ndarray]) -> dict[str, Any]:
    wf = weight_format_of(linear)
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
    if isinstance(linear, NVFP4Linear):
        entry["global_scale"] = [float(linear.global_scale)]  # float32 -> float64 is exact; JSON keeps it
    else:
        entry["granularity"] = linear.granularity
        entry["scale_name"] = linear.scale_name
        if linear.granularity == "tensor":
            entry["weight_scale"] = [float(linear.weight_scale)]
    if linear.input_scale is not None:
        entry["input_scale"] = [float(linear.input_scale)]
    return entry


def _not_packed_output(folder: str) -> str | None:
    """None if `folder` holds only what `qpn pack` writes (its manifest names the rest), else why not.

    The rule of `--overwrite`: a folder qpn did not write, or one a user has added files to,
    is never replaced.
    """
    manifest_path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.isfile(manifest_path):
        return f"it has no {MANIFEST_FILE}"
    try:
        manifest = _read_json(manifest_path)
        written = {MANIFEST_FILE, INDEX_FILE, *COPIED_CONFIG_FILES, *manifest.get("copied_files", {})}
        written |= {entry["file"] for key in ("layers", "tensors") for entry in manifest[key].values()}
    except (PackError, OSError, TypeError, KeyError, AttributeError):
        return f"its {MANIFEST_FILE} is not a qpn packed manifest"
    if manifest.get("format") != PACKED_FORMAT:
        return f"its {MANIFEST_FILE} is not a qpn packed manifest"
    foreign = sorted(entry for entry in os.listdir(folder)
                     if entry not in written or os.path.islink(os.path.join(folder, entry))
                     or not os.path.isfile(os.path.join(folder, entry)))
    if foreign:
        more = " ..." if len(foreign) > 5 else ""
        return f"it also holds {', '.join(foreign[:5])}{more}, which qpn pack does not write"
    return None


class _TargetRules(TypedDict):  # the keyword arguments of require_writable_target / atomic_folder
    flag: str
    ours: Callable[[str], str | None]
    what: str


_TARGET_RULES: _TargetRules = {"flag": "--overwrite", "ours": _not_packed_output, "what": "packed checkpoint"}


def _check_target(source: str, target: str, overwrite: bool) -> None:
    """The output rule (qpn.checkpoints.atomic): absent, empty, or with overwrite a folder qpn pack wrote;
    never the source, a folder containing it or one inside it. Interrupted writes next to
    `target` are finished or rolled back first, so the rule sees the real state."""
    parent = os.path.dirname(target)
    if os.path.isdir(parent):
        recover_interrupted(parent)
    try:
        require_writable_target(target, overwrite, protected=(source,), **_TARGET_RULES)
    except ValueError as exc:
        raise PackError(target, None, str(exc).removeprefix(f"{target} ")) from None


def pack_checkpoint(source: str | os.PathLike[str], target: str | os.PathLike[str], *, overwrite: bool = False,
                    progress: Progress = _no_progress) -> dict[str, Any]:
    """Pack the checkpoint folder `source` (ModelOpt / compressed-tensors) into the folder `target`.

    Opens and checks `source` with open_checkpoint, then reads every quantized linear
    once to run the checks of load_checkpoint and to see that it can be packed (all reasons are
    reported at once, before anything is written), prepacks each one with qpn.ref, and writes the
    folder described in the module docstring into a temporary sibling folder that is renamed
    into place: a failure leaves no partial `target`. Sources are read with plain file reads, one
    layer or tensor at a time (no memory map), and a source file that changes while the pack
    runs (truncated, rewritten, a copied file edited) is a SafetensorsError / PackError naming it;
    nothing is written then. An existing non-empty `target` needs overwrite=True, and is replaced
    (swapped atomically, recoverably: qpn.checkpoints.atomic) only if qpn pack wrote it; `target`
    may never be, contain or lie inside `source`. Returns the manifest.
    """
    source = os.path.abspath(os.fspath(source))
    target = os.path.abspath(os.fspath(target))
    if is_packed(source):
        raise PackError(source, None, "is already a qpn packed checkpoint; pack the original checkpoint instead")
    with open_checkpoint(source) as checkpoint:
        return _pack(checkpoint, source, target, overwrite, progress)


def _pack(checkpoint: OpenCheckpoint, source: str, target: str, overwrite: bool,
          progress: Progress) -> dict[str, Any]:
    names = checkpoint.layer_names
    if not names:
        raise PackError(source, None, "holds no quantized linear layer; there is nothing to pack")
    problems = [(name, reason) for name in progress(names, desc="check", total=len(names), unit="layer")
                if (reason := unpackable_reason(checkpoint.linear(name, codes=False))) is not None]
    if problems:
        lines = "\n".join(f"  {name}: {reason}" for name, reason in problems)
        raise PackError(source, None, f"{len(problems)} of {len(names)} quantized layers cannot be "
                                      f"packed (nothing was written):\n{lines}")
    _check_target(source, target, overwrite)

    files = sorted(checkpoint.files)
    extras, _ = source_extras(source)
    # sha256 of the JSON bytes that were validated, and of each shard through the file it is read from
    file_hashes = {f: hashlib.sha256(data).hexdigest() for f, data in checkpoint.json_bytes.items()}
    file_hashes.update({f: checkpoint.files[f].sha256(progress) for f in files})

    layers_of: dict[str, list[str]] = {file: [] for file in files}
    for name in names:
        layers_of[checkpoint.layer_file(name)].append(name)
    tensors_of: dict[str, list[str]] = {file: [] for file in files}
    for name in sorted(checkpoint.tensor_names):
        tensors_of[checkpoint.file_of(name)].append(name)

    manifest: dict[str, Any] = {
        "format": PACKED_FORMAT,
        "version": PACKED_VERSION,
        "producer": {"name": "qpn", "version": __version__},
        "source": {"format": checkpoint.format, "quant_algo": checkpoint.quant_algo, "files": file_hashes},
        "layers": {},
        "tensors": {},
    }
    out_map: dict[str, str] = {}
    total_size = 0  # tensor bytes, as transformers' index files count them
    with atomic_folder(target, overwrite=overwrite, protected=(source,), **_TARGET_RULES) as tmp:
        for config_file in COPIED_CONFIG_FILES:
            if config_file in checkpoint.json_bytes:
                _write_bytes(os.path.join(tmp, config_file), checkpoint.json_bytes[config_file])
        stamps: dict[str, safetensors_io.FileStamp] = {}
        copied: dict[str, dict[str, Any]] = {}
        for name in progress(extras, desc="copy", total=len(extras), unit="file"):
            sha, size, stamps[name] = _copy_chunks(os.path.join(source, name), os.path.join(tmp, name))
            copied[name] = {"sha256": sha, "size": size}
            file_hashes[name] = sha
        if copied:  # only then: a checkpoint without such files packs to the same bytes as before
            manifest["copied_files"] = copied

        steps = progress(((file, name) for file in files for name in layers_of[file]), desc="pack",
                         total=len(names), unit="layer")
        stored: dict[str, dict[str, safetensors_io.StoredTensor]] = {file: {} for file in files}
        pending = {file: len(layers_of[file]) for file in files}
        written: set[str] = set()

        def write(file: str) -> None:
            for name in tensors_of[file]:
                tensor = checkpoint.tensor(name)
                stored[file][name] = tensor
                manifest["tensors"][name] = {"file": file, "dtype": tensor.dtype, "shape": list(tensor.shape),
                                             "sha256": sha256_array(tensor.array)}
            nonlocal total_size
            safetensors_io.write_safetensors(os.path.join(tmp, file), stored[file], SAFETENSORS_METADATA)
            out_map.update(dict.fromkeys(stored[file], file))
            total_size += sum(t.nbytes for t in stored[file].values())
            stored[file] = {}
            written.add(file)

        for file, name in steps:
            linear = checkpoint.linear(name)
            buffers = prepack_layer(linear)
            for suffix, array in buffers.items():
                tag = "F16" if array.dtype == np.float16 else ("F32" if array.dtype == np.float32 else "U8")
                array = array if array.flags.c_contiguous else array.copy()  # (ascontiguousarray makes 0-d 1-d)
                stored[file][f"{name}.{suffix}"] = safetensors_io.StoredTensor(array, tag)
            manifest["layers"][name] = _layer_entry(name, linear, file, buffers)
            del linear, buffers
            pending[file] -= 1
            if pending[file] == 0:  # write each file as soon as its layers are done: one shard in memory
                write(file)
        for file in files:
            if file not in written:
                write(file)
        if checkpoint.weight_map is not None:
            write_json(os.path.join(tmp, INDEX_FILE), {"metadata": {"total_size": total_size},
                                                       "weight_map": dict(sorted(out_map.items()))})
        # every source file is as it was when first read, or nothing appears at `target`
        checkpoint.require_unchanged()
        for name, stamp in stamps.items():
            _require_unchanged(os.path.join(source, name), stamp)
        write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
    return manifest


# ----------------------------------------------------------------------------------------------
# read


@dataclass(frozen=True, eq=False)
class PackedLayer:
    """One packed linear: the QPNLinear buffers (numpy) plus what the manifest says about it.

    nvfp4: codes uint8 [N_pad, K/2], scales uint8 [N_pad, K/16], global_scale float32 [N_pad/32];
    fp8: codes uint8 [N_pad, K], scales = group_scales float16, weight_scale float32 (the source's).
    """

    name: str
    format: str
    n: int
    k: int
    codes: np.ndarray
    scales: np.ndarray
    global_scale: np.ndarray | None
    weight_scale: np.ndarray | None
    input_scale: np.ndarray | None
    entry: Mapping[str, Any]  # the manifest's layer entry

    @property
    def n_padded(self) -> int:
        return int(self.codes.shape[0])

    @property
    def granularity(self) -> str | None:
        return self.entry.get("granularity")

    @property
    def weight_format(self) -> WeightFormat:
        """The qpn.ref.formats description of the layer (ValueError for a granularity its format has not)."""
        return weight_format(self.format, self.granularity)

    def buffers(self) -> dict[str, np.ndarray]:
        """{suffix: array} as `prepack_layer` returns them (for byte comparisons)."""
        out = {CODES: self.codes}
        if self.weight_format is QPN2:
            out[SCALES], out[GLOBAL_SCALE] = self.scales, self.nvfp4_global_scale()
        else:
            out[GROUP_SCALES], out[WEIGHT_SCALE] = self.scales, self.fp8_weight_scale()
        if self.input_scale is not None:
            out[INPUT_SCALE] = self.input_scale
        return out

    def nvfp4_global_scale(self) -> np.ndarray:
        """global_scale of an nvfp4 layer (None only for fp8; load_packed always sets it for nvfp4)."""
        if self.global_scale is None:
            raise ValueError(f"layer {self.name!r}: an nvfp4 PackedLayer needs global_scale float32 [N_pad/32], got "
                             "None; read the layer with load_packed")
        return self.global_scale

    def kernel_buffers(self) -> tuple[np.ndarray, ...]:
        """The buffers the decode kernels take, in the description's order (qpn.ref.formats)."""
        buffers = self.buffers()
        return tuple(buffers[tensor_suffix(b)] for b in self.weight_format.buffers)

    def fp8_weight_scale(self) -> np.ndarray:
        """weight_scale of an fp8 layer (None only for nvfp4; load_packed always sets it for fp8)."""
        if self.weight_scale is None:
            raise ValueError(f"layer {self.name!r}: an fp8 PackedLayer needs its float32 weight_scale, got None; "
                             "read the layer with load_packed")
        return self.weight_scale

    def unpack(self) -> NVFP4Linear | FP8Linear:
        """The source layer (qpn.ref NVFP4Linear / FP8Linear): exact inverse of the prepack, pad rows cropped.

        Raises ValueError if the pad rows are not the padding qpn writes or the per-tile global
        scales differ (neither can come out of `qpn pack`: the folder is corrupt).
        """
        n, k, n_pad, wf = self.n, self.k, self.n_padded, self.weight_format
        if wf is QPN2:
            wp, ws = ref.qpn2_unpack(self.codes, self.scales, n_pad, k)
            if np.any(wp[n:] != wf.pad_code) or np.any(ws[n:] != _NVFP4_PAD_SCALE_BYTE):
                raise ValueError(f"layer {self.name!r}: pad rows {n}..{n_pad - 1} are not zero; the packed file is "
                                 "corrupt")
            g = self.nvfp4_global_scale()
            if np.any(g.view(np.uint32) != g[:1].view(np.uint32)):
                raise ValueError(f"layer {self.name!r}: the per-tile global scales differ, but qpn pack writes one "
                                 "value per layer; the packed file is corrupt")
            return NVFP4Linear(self.name, wp[:n], ws[:n], g[0].copy(), self.input_scale)
        weight, _ = ref.qpn8_unpack(self.codes, self.scales, n_pad, k)
        if np.any(weight[n:] != wf.pad_code):
            raise ValueError(f"layer {self.name!r}: pad rows {n}..{n_pad - 1} are not zero; the packed file is corrupt")
        return FP8Linear(self.name, weight[:n], self.fp8_weight_scale(), self.entry["granularity"],
                                   self.input_scale, self.entry["scale_name"])


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


def _expected_tensors(wf: WeightFormat, n_pad: int, k: int, entry: Mapping[str, Any]) -> dict[str, tuple[str, Shape]]:
    """suffix -> (dtype tag, shape) of a checked manifest entry's packed tensors (the input scale aside)."""
    expected = {tensor_suffix(b): (b.tag, b.shape(n_pad, k)) for b in wf.buffers}
    if wf is not QPN2:  # FP8 also keeps the source's fp32 scale as it was (S16 is rounded)
        source_shape = tuple(entry["source_tensors"]["weight_scale"]["shape"])
        expected[WEIGHT_SCALE] = (wf.source_tags["weight_scale"], source_shape)
    return expected


_LAYOUT_OF_FORMAT = {wf.format: wf.layout for wf in WEIGHT_FORMATS}  # one layout per format, whatever the granularity


def _positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_layer_entry(name: str, entry: object) -> None:
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
        "weight_packed": [(n, k // 2)], "weight_scale": [(n, k // GROUP_K)], "weight": [(n, k)]}
    if wf is not QPN2:
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
            if np.any(wp[pad] != wf.pad_code) or np.any(ws[pad] != _NVFP4_PAD_SCALE_BYTE):
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
        if (os.path.basename(name) != name or name.startswith(".") or _is_weight_file(name)
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


def prepack_group_scales(weight_scale: np.ndarray, granularity: str, n: int, n_pad: int, k: int) -> np.ndarray:
    """The QPN8 group_scales `prepack_layer` writes for an fp32 scale (pad channels get scale 1.0)."""
    s = np.asarray(weight_scale, np.float32)
    if granularity == "channel":
        s = _pad_rows(s.reshape(n), n_pad, QPN8.pad_scale)
    return ref.qpn8.qpn8_group_scales(s, n_pad, k, granularity)


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
    manifest = _read_json(manifest_path)
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
            _check_layer_entry(name, entry)
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
        for suffix, (tag, shape) in _expected_tensors(wf, n_pad, k, entry).items():
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
    config = _read_json(config_path) if os.path.exists(config_path) else {}
    hf_quant_config = _read_json(hf_path) if os.path.exists(hf_path) else None
    return PackedCheckpoint(folder, manifest, layers, tensors, config, hf_quant_config)


__all__ = [
    "MANIFEST_FILE", "PACKED_FORMAT", "PACKED_VERSION", "PackError", "PackedCheckpoint", "PackedLayer",
    "copied_file_problems", "is_packed", "k_multiple", "layer_format", "load_packed", "pack_checkpoint",
    "padded_rows", "prepack_layer", "sha256_array", "sha256_file", "source_extras", "source_tensors",
    "unpackable_reason",
]
