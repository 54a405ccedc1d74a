"""qpn pack: a ModelOpt / compressed-tensors checkpoint folder -> a packed folder (qpn.checkpoints.packed)."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import __version__
from .. import safetensors_io
from ..atomic import TargetRules, atomic_folder, recover_interrupted, require_writable_target, write_json
from ..folder import INDEX_FILE, SAFETENSORS_METADATA, OpenCheckpoint, open_checkpoint, weight_files
from ..gpt_oss import is_gpt_oss_mxfp4
from .layers import prepack_layer, unpackable_reason
from .manifest import (
    COPIED_CONFIG_FILES,
    MANIFEST_FILE,
    PACKED_FORMAT,
    PACKED_VERSION,
    PackError,
    Progress,
    is_packed,
    is_weight_file,
    layer_entry,
    no_progress,
    read_json,
    sha256_array,
)


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
    weights = {INDEX_FILE, *weight_files(folder)[0]} if any(map(is_weight_file, entries)) else set()
    for entry in entries:
        if entry.startswith(".") or entry in COPIED_CONFIG_FILES or entry in weights:
            continue
        path = os.path.join(folder, entry)
        if is_weight_file(entry):
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
            for chunk in iter(lambda: f.read(safetensors_io.HASH_CHUNK), b""):
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



def _not_packed_output(folder: str) -> str | None:
    """None if `folder` holds only what `qpn pack` writes (its manifest names the rest), else why not.

    The rule of `--overwrite`: a folder qpn did not write, or one a user has added files to,
    is never replaced.
    """
    manifest_path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.isfile(manifest_path):
        return f"it has no {MANIFEST_FILE}"
    try:
        manifest = read_json(manifest_path)
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


PACK_TARGET_RULES: TargetRules = {"flag": "--overwrite", "ours": _not_packed_output, "what": "packed checkpoint"}


def _check_target(source: str, target: str, overwrite: bool) -> None:
    """The output rule (qpn.checkpoints.atomic): absent, empty, or with overwrite a folder qpn pack wrote;
    never the source, a folder containing it or one inside it. Interrupted writes next to
    `target` are finished or rolled back first, so the rule sees the real state."""
    parent = os.path.dirname(target)
    if os.path.isdir(parent):
        recover_interrupted(parent)
    try:
        require_writable_target(target, overwrite, protected=(source,), **PACK_TARGET_RULES)
    except ValueError as exc:
        raise PackError(target, None, str(exc).removeprefix(f"{target} ")) from None


def pack_checkpoint(source: str | os.PathLike[str], target: str | os.PathLike[str], *, overwrite: bool = False,
                    progress: Progress = no_progress, on_commit: Callable[[], None] | None = None) -> dict[str, Any]:
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
    may never be, contain or lie inside `source`. `on_commit` is atomic_folder's: called once the new
    folder is at `target`. Returns the manifest.
    """
    source = os.path.abspath(os.fspath(source))
    target = os.path.abspath(os.fspath(target))
    if is_packed(source):
        raise PackError(source, None, "is already a qpn packed checkpoint; pack the original checkpoint instead")
    if is_gpt_oss_mxfp4(source):
        raise PackError(source, None, "is a gpt-oss MXFP4 checkpoint: its stacked experts load from the folder as it "
                                      "is (load_quantized; vLLM with quantization='qpn'), and qpn pack does not write "
                                      "stacked experts yet; use the original folder")
    with open_checkpoint(source) as checkpoint:
        return _pack(checkpoint, source, target, overwrite, progress, on_commit)


def _require_packable(checkpoint: OpenCheckpoint, source: str, progress: Progress) -> None:
    """Every quantized layer read once (its codes only if FP8) and checked: all reasons at once, as one PackError."""
    names = checkpoint.layer_names
    if not names:
        raise PackError(source, None, "holds no quantized linear layer; there is nothing to pack")
    problems = [(name, reason) for name in progress(names, desc="check", total=len(names), unit="layer")
                if (reason := unpackable_reason(checkpoint.linear(name, codes=False))) is not None]
    if problems:
        lines = "\n".join(f"  {name}: {reason}" for name, reason in problems)
        raise PackError(source, None, f"{len(problems)} of {len(names)} quantized layers cannot be "
                                      f"packed (nothing was written):\n{lines}")


def _copy_extras(source: str, tmp: str, extras: list[str], progress: Progress
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, safetensors_io.FileStamp]]:
    """Copy the source's other files into `tmp`: ({file: {"sha256", "size"}}, {file: its stamp when copied})."""
    copied: dict[str, dict[str, Any]] = {}
    stamps: dict[str, safetensors_io.FileStamp] = {}
    for name in progress(extras, desc="copy", total=len(extras), unit="file"):
        sha, size, stamps[name] = _copy_chunks(os.path.join(source, name), os.path.join(tmp, name))
        copied[name] = {"sha256": sha, "size": size}
    return copied, stamps


class _PackedFiles:
    """The packed folder's safetensors files, one per source file, each written as soon as its layers are
    prepacked (so memory holds one file's buffers), its copied tensors read just before it is written."""

    def __init__(self, checkpoint: OpenCheckpoint, tmp: str, manifest: dict[str, Any]) -> None:
        self.checkpoint, self.tmp, self.manifest = checkpoint, tmp, manifest
        self.files = sorted(checkpoint.files)
        self.layers_of: dict[str, list[str]] = {file: [] for file in self.files}
        for name in checkpoint.layer_names:
            self.layers_of[checkpoint.layer_file(name)].append(name)
        self.tensors_of: dict[str, list[str]] = {file: [] for file in self.files}
        for name in sorted(checkpoint.tensor_names):
            self.tensors_of[checkpoint.file_of(name)].append(name)
        self.stored: dict[str, dict[str, safetensors_io.StoredTensor]] = {file: {} for file in self.files}
        self.out_map: dict[str, str] = {}  # tensor -> file, for the index
        self.total_size = 0  # tensor bytes, as transformers' index files count them

    def write_all(self, progress: Progress) -> None:
        """Every layer prepacked and every file written, then the index if the source had one."""
        steps = progress(((file, name) for file in self.files for name in self.layers_of[file]), desc="pack",
                         total=len(self.checkpoint.layer_names), unit="layer")
        pending = {file: len(self.layers_of[file]) for file in self.files}
        written: set[str] = set()
        for file, name in steps:
            self._add_layer(file, name)
            pending[file] -= 1
            if pending[file] == 0:  # write each file as soon as its layers are done: one shard in memory
                self._write(file)
                written.add(file)
        for file in self.files:
            if file not in written:
                self._write(file)
        if self.checkpoint.weight_map is not None:
            write_json(os.path.join(self.tmp, INDEX_FILE), {"metadata": {"total_size": self.total_size},
                                                            "weight_map": dict(sorted(self.out_map.items()))})

    def _add_layer(self, file: str, name: str) -> None:
        linear = self.checkpoint.linear(name)
        buffers = prepack_layer(linear)
        for suffix, array in buffers.items():
            tag = "F16" if array.dtype == np.float16 else ("F32" if array.dtype == np.float32 else "U8")
            array = array if array.flags.c_contiguous else array.copy()  # (ascontiguousarray makes 0-d 1-d)
            self.stored[file][f"{name}.{suffix}"] = safetensors_io.StoredTensor(array, tag)
        self.manifest["layers"][name] = layer_entry(name, linear, file, buffers)

    def _write(self, file: str) -> None:
        stored = self.stored[file]
        for name in self.tensors_of[file]:
            tensor = self.checkpoint.tensor(name)
            stored[name] = tensor
            self.manifest["tensors"][name] = {"file": file, "dtype": tensor.dtype, "shape": list(tensor.shape),
                                              "sha256": sha256_array(tensor.array)}
        safetensors_io.write_safetensors(os.path.join(self.tmp, file), stored, SAFETENSORS_METADATA)
        self.out_map.update(dict.fromkeys(stored, file))
        self.total_size += sum(t.nbytes for t in stored.values())
        self.stored[file] = {}


def _pack(checkpoint: OpenCheckpoint, source: str, target: str, overwrite: bool,
          progress: Progress, on_commit: Callable[[], None] | None) -> dict[str, Any]:
    _require_packable(checkpoint, source, progress)
    _check_target(source, target, overwrite)

    extras, _ = source_extras(source)
    # sha256 of the JSON bytes that were validated, and of each shard through the file it is read from
    file_hashes = {f: hashlib.sha256(data).hexdigest() for f, data in checkpoint.json_bytes.items()}
    file_hashes.update({f: checkpoint.files[f].sha256(progress) for f in sorted(checkpoint.files)})
    manifest: dict[str, Any] = {
        "format": PACKED_FORMAT,
        "version": PACKED_VERSION,
        "producer": {"name": "qpn", "version": __version__},
        "source": {"format": checkpoint.format, "quant_algo": checkpoint.quant_algo, "files": file_hashes},
        "layers": {},
        "tensors": {},
    }
    with atomic_folder(target, overwrite=overwrite, protected=(source,), on_commit=on_commit,
                       **PACK_TARGET_RULES) as tmp:
        for config_file in COPIED_CONFIG_FILES:
            if config_file in checkpoint.json_bytes:
                _write_bytes(os.path.join(tmp, config_file), checkpoint.json_bytes[config_file])
        copied, stamps = _copy_extras(source, tmp, extras, progress)
        file_hashes.update({name: entry["sha256"] for name, entry in copied.items()})
        if copied:  # only then: a checkpoint without such files packs to the same bytes as before
            manifest["copied_files"] = copied
        _PackedFiles(checkpoint, tmp, manifest).write_all(progress)
        # every source file is as it was when first read, or nothing appears at `target`
        checkpoint.require_unchanged()
        for name, stamp in stamps.items():
            _require_unchanged(os.path.join(source, name), stamp)
        write_json(os.path.join(tmp, MANIFEST_FILE), manifest)
    return manifest
