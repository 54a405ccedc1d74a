"""A strict reader and an atomic, deterministic writer of the safetensors format, in numpy.

File layout (https://github.com/huggingface/safetensors, "Format"):

    [8 bytes]  N = header length, unsigned 64-bit little-endian
    [N bytes]  UTF-8 JSON: {name: {"dtype": TAG, "shape": [d0, ...], "data_offsets": [begin, end]},
                            optional "__metadata__": {str: str}}
    [rest]     the byte buffer; offsets are relative to its start, little-endian element bytes

Why our own code and not the `safetensors` package: numpy has no bf16 or e4m3 dtype, and a
corrupt checkpoint must fail with an error that names the file and the tensor. The package
remains the independent oracle in the tests (files it writes read identically here, files
written here load there).

Data model: a tensor is a `StoredTensor(array, dtype)`, the numpy array plus the safetensors
dtype TAG it was (or will be) stored as. Tags without a numpy dtype travel as bit patterns:
BF16 as uint16, F8_E4M3 and F8_E5M2 as uint8. Keeping the tag is what makes
read -> write reproduce the file: a uint8 array alone cannot say whether it was U8 or F8_E4M3.

| tag | numpy carrier | | tag | numpy carrier |
|---|---|---|---|---|
| F64 | float64 | | I8 | int8 |
| F32 | float32 | | U8 | uint8 |
| F16 | float16 | | U16 / U32 / U64 | uint16 / uint32 / uint64 |
| BF16 | uint16 (bit pattern) | | BOOL | bool (one byte, 0 or 1) |
| I64 / I32 / I16 | int64 / int32 / int16 | | F8_E4M3, F8_E5M2 | uint8 (bit pattern) |

Reading (`read_safetensors`) validates the whole header before touching data, and raises
`SafetensorsError` (a ValueError) naming the file and, where one is at fault, the tensor:
file shorter than 8 bytes, header length beyond the end of the file (or over 100 MB, the
package's own limit), header that is not UTF-8 JSON / not an object / has duplicate keys,
unknown dtype tag, malformed shape or offsets, begin > end, a byte range whose length is not
itemsize * prod(shape), a byte range beyond the end of the file (truncated), byte ranges that
overlap, leave gaps, or leave trailing bytes (the package rejects all of these too).
Data is returned as read-only views of one `np.memmap` of the file (`mmap=True`, default;
nothing is copied, a 100+ MB file "reads" in microseconds) or read once with `np.fromfile`
(`mmap=False`, no file stays mapped). BOOL bytes other than 0/1 are rejected.

A memory map has one hazard: another process truncating the file kills the reader with SIGBUS
at its first access past the new end (no message, no clean-up). `SafetensorsFile` is the reader
for that case (`qpn pack`): the file opened once, each tensor copied out with file reads, every
read checked against the file's size and modification time at open, so a file that changes
while it is read is a SafetensorsError naming it.

Writing (`write_safetensors`) validates every tensor first, then writes a temporary file in
the destination folder, fsyncs it, and `os.replace`s it onto the destination; on any failure
the temporary file is removed and the destination is untouched (no partial file). The bytes
are a function of the input only: header JSON with sorted keys and no spaces, padded with
spaces to a multiple of 8 bytes (as the package pads); tensors laid out by descending item
size then name, so every tensor starts at a multiple of its item size.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import BinaryIO, NamedTuple

import numpy as np

from ..ref.checks import FileError
from .atomic import fsync_dir, plain_file_mode

# tag -> numpy carrier dtype (little-endian). Order of the table is irrelevant.
DTYPE_OF_TAG: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # bit pattern
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype("u1"),  # bit pattern (e4m3fn: 0x7F/0xFF NaN, no inf)
    "F8_E5M2": np.dtype("u1"),  # bit pattern
}

# numpy dtype -> tag for arrays handed to the writer without a tag. uint16 means U16, never
# BF16, and uint8 means U8, never F8_E4M3: bit-pattern tags must be given explicitly.
_TAG_OF_DTYPE: dict[np.dtype, str] = {
    np.dtype("<f8"): "F64",
    np.dtype("<f4"): "F32",
    np.dtype("<f2"): "F16",
    np.dtype("<i8"): "I64",
    np.dtype("<i4"): "I32",
    np.dtype("<i2"): "I16",
    np.dtype("i1"): "I8",
    np.dtype("<u8"): "U64",
    np.dtype("<u4"): "U32",
    np.dtype("<u2"): "U16",
    np.dtype("u1"): "U8",
    np.dtype("?"): "BOOL",
}
# ml_dtypes arrays are recognised by dtype name (no import): they become bit patterns + tag.
_TAG_OF_EXTENSION_DTYPE_NAME = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}

HEADER_SIZE_LIMIT = 100_000_000  # bytes; the safetensors package refuses larger headers
METADATA_KEY = "__metadata__"
_HEADER_ALIGN = 8
HASH_CHUNK = 16 << 20  # bytes per read when hashing or copying a file


class SafetensorsError(FileError):
    """A safetensors file or tensor breaks the format (`FileError`: path and tensor name the culprit)."""


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """One tensor as safetensors stores it: `array` in its numpy carrier dtype + the `dtype` tag.

    The carrier must match the tag exactly (table in the module docstring); nothing is cast.
    """

    array: np.ndarray
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.array, np.ndarray):
            raise ValueError(
                f"StoredTensor.array must be a numpy.ndarray, got {type(self.array).__name__}; "
                "wrap scalars with np.asarray(value, dtype=...)"
            )
        if self.dtype not in DTYPE_OF_TAG:
            raise ValueError(
                f"StoredTensor.dtype must be a safetensors tag, one of {sorted(DTYPE_OF_TAG)}, got {self.dtype!r}"
            )
        carrier = DTYPE_OF_TAG[self.dtype]
        if self.array.dtype != carrier:
            raise ValueError(
                f"a {self.dtype} tensor must be carried as numpy {carrier} "
                f"({'bit patterns' if self.dtype in ('BF16', 'F8_E4M3', 'F8_E5M2') else 'values'}), "
                f"got {self.array.dtype}; nothing is cast implicitly - convert or view it first"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


class TensorInfo(NamedTuple):
    """One header entry: dtype tag, shape, and [begin, end) byte offsets into the buffer."""

    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]


class SafetensorsHeader(NamedTuple):
    tensors: dict[str, TensorInfo]  # in file (header) order
    metadata: dict[str, str] | None
    data_start: int  # absolute file offset of the byte buffer (8 + N)
    file_size: int


class SafetensorsContents(NamedTuple):
    tensors: dict[str, StoredTensor]  # header order
    metadata: dict[str, str] | None


def as_stored_tensor(value: object, name: str = "tensor") -> StoredTensor:
    """A StoredTensor unchanged, or a numpy array tagged by its dtype (see the docstring table).

    uint8 becomes U8 and uint16 becomes U16: e4m3 / bf16 bit patterns need an explicit
    StoredTensor(array, "F8_E4M3" / "BF16"). ml_dtypes bfloat16 / float8 arrays are accepted
    and stored as their bit patterns. Big-endian arrays are byte-swapped to little-endian.
    """
    if isinstance(value, StoredTensor):
        return value
    if not isinstance(value, np.ndarray):
        raise ValueError(
            f"{name} must be a numpy.ndarray or a StoredTensor, got {type(value).__name__}; "
            "use np.asarray(value, dtype=...) for scalars"
        )
    tag = _TAG_OF_EXTENSION_DTYPE_NAME.get(value.dtype.name)
    if tag is not None:
        return StoredTensor(value.view(DTYPE_OF_TAG[tag]), tag)
    dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
    tag = _TAG_OF_DTYPE.get(dtype)
    if tag is None:
        raise ValueError(
            f"{name} has dtype {value.dtype}, which safetensors cannot store; supported: "
            f"{sorted(str(d) for d in _TAG_OF_DTYPE)} or a StoredTensor with a tag from {sorted(DTYPE_OF_TAG)}"
        )
    return StoredTensor(value.astype(dtype, copy=False), tag)


# ----------------------------------------------------------------------------------------------
# reading


def _nbytes(tag: str, shape: tuple[int, ...]) -> int:
    return DTYPE_OF_TAG[tag].itemsize * math.prod(shape)


def _no_duplicate_keys(path: str, pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsError(path, key, "the header JSON holds this key twice; the file is corrupt")
        out[key] = value
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Parse and fully validate the header of `path` (no tensor data is read)."""
    path = os.fspath(path)
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        return _parse_header(path, f, file_size)


def _read_header_json(path: str, f: BinaryIO, file_size: int) -> tuple[dict, int]:
    """(the header JSON object, its length N) of the open file `f` of `file_size` bytes."""
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise SafetensorsError(
            path, None, f"file is {file_size} bytes, shorter than the 8-byte header length; it is truncated"
        )
    n = int.from_bytes(prefix, "little")
    if n > HEADER_SIZE_LIMIT:
        raise SafetensorsError(
            path, None, f"header length {n} exceeds the {HEADER_SIZE_LIMIT}-byte limit; the file is corrupt"
        )
    if 8 + n > file_size:
        raise SafetensorsError(
            path,
            None,
            f"header length {n} reaches byte {8 + n}, beyond the end of the {file_size}-byte file; "
            "the file is truncated (re-download or re-export it)",
        )
    raw = f.read(n)
    if len(raw) < n:  # the file shrank since its size was taken
        raise SafetensorsError(path, None, f"read {len(raw)} of the header's {n} bytes; the file is truncated")
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=lambda pairs: _no_duplicate_keys(path, pairs))
    except SafetensorsError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(path, None, f"header is not valid UTF-8 JSON ({exc}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise SafetensorsError(path, None, f"header must be a JSON object, got {type(header).__name__}")
    return header, n


def _tensor_info(path: str, name: str, entry: object, data_size: int, file_size: int, n: int) -> TensorInfo:
    """One header entry, checked on its own (its byte range against the buffer of `data_size` bytes)."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise SafetensorsError(
            path, name, f"header entry must have exactly the keys dtype, shape, data_offsets; got {got}"
        )
    tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if tag not in DTYPE_OF_TAG:
        raise SafetensorsError(
            path, name, f"unknown dtype {tag!r}; this reader supports {sorted(DTYPE_OF_TAG)}"
        )
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise SafetensorsError(path, name, f"shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        raise SafetensorsError(
            path, name, f"data_offsets must be [begin, end] with non-negative integers, got {offsets!r}"
        )
    begin, end = offsets
    if begin > end:
        raise SafetensorsError(path, name, f"data_offsets [{begin}, {end}] are out of order (begin > end)")
    expected = _nbytes(tag, tuple(shape))
    if end - begin != expected:
        raise SafetensorsError(
            path,
            name,
            f"data_offsets [{begin}, {end}] span {end - begin} bytes but dtype {tag} and shape {shape} "
            f"need {expected}; the header is corrupt",
        )
    if end > data_size:
        raise SafetensorsError(
            path,
            name,
            f"data_offsets [{begin}, {end}] end beyond the {data_size}-byte buffer "
            f"(file {file_size} bytes, header {n}); the file is truncated",
        )
    return TensorInfo(tag, tuple(shape), (begin, end))


def _require_tiling(path: str, tensors: Mapping[str, TensorInfo], data_size: int) -> None:
    """The byte ranges, sorted by begin, must tile [0, data_size) exactly: no overlap, no gap."""
    position, previous = 0, None
    for name, info in sorted(tensors.items(), key=lambda item: item[1].data_offsets):
        begin, end = info.data_offsets
        if begin < position:
            raise SafetensorsError(
                path, name, f"data_offsets [{begin}, {end}] overlap tensor {previous!r} (which ends at {position})"
            )
        if begin > position:
            raise SafetensorsError(
                path, name, f"data_offsets [{begin}, {end}] leave a gap of {begin - position} bytes before it"
            )
        position, previous = end, name
    if position != data_size:
        raise SafetensorsError(
            path, None, f"the buffer holds {data_size} bytes but the tensors cover {position}; trailing bytes"
        )


def _parse_header(path: str, f: BinaryIO, file_size: int) -> SafetensorsHeader:
    """The validated header of the open file `f` (read from its start) of `file_size` bytes."""
    header, n = _read_header_json(path, f, file_size)
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise SafetensorsError(path, METADATA_KEY, "__metadata__ must map strings to strings")
    data_size = file_size - 8 - n
    tensors = {name: _tensor_info(path, name, entry, data_size, file_size, n) for name, entry in header.items()}
    _require_tiling(path, tensors, data_size)
    return SafetensorsHeader(tensors, metadata, 8 + n, file_size)


def read_safetensors(path: str | os.PathLike[str], *, mmap: bool = True) -> SafetensorsContents:
    """Read every tensor of `path` -> SafetensorsContents(tensors: {name: StoredTensor}, metadata).

    mmap=True: arrays are read-only views of one np.memmap (zero copy, lazy paging).
    mmap=False: the buffer is read once with np.fromfile; arrays are read-only views of it.
    """
    path = os.fspath(path)
    header = read_safetensors_header(path)
    data_size = header.file_size - header.data_start
    if data_size == 0:
        buffer = np.zeros(0, dtype=np.uint8)
    elif mmap:
        buffer = np.memmap(path, dtype=np.uint8, mode="r", offset=header.data_start, shape=(data_size,))
    else:
        with open(path, "rb") as f:
            f.seek(header.data_start)
            buffer = np.fromfile(f, dtype=np.uint8, count=data_size)
        if buffer.size != data_size:  # the file shrank between the header check and the read
            raise SafetensorsError(path, None, f"read {buffer.size} of {data_size} buffer bytes; truncated")
        buffer.flags.writeable = False
    tensors: dict[str, StoredTensor] = {}
    for name, info in header.tensors.items():
        begin, end = info.data_offsets
        array = buffer[begin:end].view(DTYPE_OF_TAG[info.dtype]).reshape(info.shape)
        if info.dtype == "BOOL" and array.size and (buffer[begin:end] > 1).any():
            raise SafetensorsError(path, name, "BOOL bytes must be 0 or 1; the data is corrupt")
        tensors[name] = StoredTensor(array, info.dtype)
    return SafetensorsContents(tensors, header.metadata)


def sha256_stream(f: BinaryIO, path: str, size: int, progress: Callable[..., Iterable] | None = None,
                  ) -> tuple[str, int]:
    """(sha256 hex, bytes read) of the open file `f` from where it stands, `size` bytes expected (the
    progress bar's total); progress(iterable, desc=, total=, unit=) shows the chunks."""
    digest, read = hashlib.sha256(), 0
    chunks: Iterable[bytes] = iter(lambda: f.read(HASH_CHUNK), b"")
    if progress is not None:
        chunks = progress(chunks, desc=f"hash {os.path.basename(path)}", total=-(-size // HASH_CHUNK) or None,
                          unit="chunk")
    for chunk in chunks:
        digest.update(chunk)
        read += len(chunk)
    return digest.hexdigest(), read


class FileStamp(NamedTuple):
    """What a read compares to notice that a file changed under it: size and modification time."""

    size: int
    mtime_ns: int


def file_stamp(st: os.stat_result) -> FileStamp:
    return FileStamp(st.st_size, st.st_mtime_ns)


def changed_message(stamp: FileStamp, now: FileStamp) -> str:
    """The words of a FileError for a file whose stamp moved from `stamp` to `now` while qpn read it."""
    how = (f"its size went from {stamp.size} to {now.size} bytes" if now.size != stamp.size
           else "it was modified (same size, new modification time)")
    return (f"the file changed while qpn was reading it ({how}); a file that changes under qpn is bad input and "
            "nothing was written: let whatever writes it finish (or copy / download it again), then rerun")


class SafetensorsFile:
    """One safetensors file opened once and read tensor by tensor with plain file reads (no memory map).

    For readers that must survive a file changing under them (`qpn pack`): a memory-mapped file
    that another process truncates kills the reader with SIGBUS at its first access past the new
    end - no message, no clean-up. Here every read is a copy (`read(name)` -> a read-only
    StoredTensor of its own, so memory holds one tensor at a time, not the file), checks its byte
    count, and compares the file's size and modification time with those seen at open; a
    truncated or rewritten file is a SafetensorsError naming it. `sha256()` hashes the same open
    file. The header is validated as `read_safetensors_header` does. Use as a context manager.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO would block a plain open
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SafetensorsError(self.path, None, "is not a regular file; the checkpoint's weights are files")
        except BaseException:
            os.close(fd)
            raise
        self._file = os.fdopen(fd, "rb")
        try:
            self.stamp = file_stamp(st)
            self.header = _parse_header(self.path, self._file, st.st_size)
            self.require_unchanged()
        except BaseException:
            self._file.close()
            raise

    def require_unchanged(self, tensor: str | None = None) -> None:
        """Raise SafetensorsError if the file's size or modification time differ from those seen at open."""
        now = file_stamp(os.fstat(self._file.fileno()))
        if now != self.stamp:
            raise SafetensorsError(self.path, tensor, changed_message(self.stamp, now))

    def read(self, name: str) -> StoredTensor:
        """Tensor `name` of the header, read now into its own read-only array."""
        info = self.header.tensors[name]
        begin, end = info.data_offsets
        buffer = np.empty(end - begin, dtype=np.uint8)
        self._file.seek(self.header.data_start + begin)
        got = self._file.readinto(buffer.data) if buffer.size else 0  # buffered: loops to the end or EOF
        if got != buffer.size:
            now = file_stamp(os.fstat(self._file.fileno()))
            raise SafetensorsError(self.path, name, changed_message(self.stamp, now) if now != self.stamp else
                                   f"read {got} of its {buffer.size} bytes; the file is truncated")
        self.require_unchanged(name)
        if info.dtype == "BOOL" and (buffer > 1).any():
            raise SafetensorsError(self.path, name, "BOOL bytes must be 0 or 1; the data is corrupt")
        buffer.flags.writeable = False
        return StoredTensor(buffer.view(DTYPE_OF_TAG[info.dtype]).reshape(info.shape), info.dtype)

    def sha256(self, progress: Callable[..., Iterable] | None = None) -> str:
        """sha256 of the whole file as it is open (progress(iterable, desc=, total=, unit=) shows the chunks)."""
        self._file.seek(0)
        digest, size = sha256_stream(self._file, self.path, self.stamp.size, progress)
        if size != self.stamp.size:
            self.require_unchanged()
            raise SafetensorsError(self.path, None, f"read {size} of its {self.stamp.size} bytes; the file is "
                                                    "truncated")
        self.require_unchanged()
        return digest

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# writing


def serialize_header(tensors: Mapping[str, StoredTensor], metadata: Mapping[str, str] | None) -> tuple[bytes, list]:
    """Header bytes (length prefix + padded JSON) and the tensor write order [(name, StoredTensor)]."""
    order = sorted(tensors.items(), key=lambda item: (-item[1].array.dtype.itemsize, item[0]))
    header: dict = {}
    offset = 0
    for name, tensor in order:
        end = offset + tensor.nbytes
        header[name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset += tensor.nbytes
    if metadata is not None:
        header[METADATA_KEY] = dict(metadata)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % _HEADER_ALIGN)
    return len(text).to_bytes(8, "little") + text, order


def _write_tensor_bytes(f: BinaryIO, tensor: StoredTensor) -> None:
    """Write one tensor's little-endian bytes without an extra copy when it is C-contiguous."""
    array = np.ascontiguousarray(tensor.array).reshape(-1)
    if array.size:
        f.write(array.view(np.uint8).data)  # a memoryview of the bytes: no copy


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, object],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Atomically write `tensors` ({name: StoredTensor | np.ndarray}) to `path`.

    Validates everything first (names, dtypes, metadata), then tmp file -> fsync -> os.replace.
    On failure nothing is left behind and an existing `path` is unchanged.
    """
    path = os.fspath(path)
    if not isinstance(tensors, Mapping):
        raise ValueError(f"tensors must be a mapping name -> StoredTensor | np.ndarray, got {type(tensors).__name__}")
    stored: dict[str, StoredTensor] = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == METADATA_KEY:
            raise ValueError(f"tensor names must be non-empty strings other than {METADATA_KEY!r}, got {name!r}")
        try:
            stored[name] = as_stored_tensor(value, name=f"tensor {name!r}")
        except ValueError as exc:
            raise SafetensorsError(path, name, str(exc)) from None
    if metadata is not None and not (
        isinstance(metadata, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise SafetensorsError(path, METADATA_KEY, "metadata must map strings to strings")
    header, order = serialize_header(stored, metadata)

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for _, tensor in order:
                _write_tensor_bytes(f, tensor)
            f.flush()
            os.fsync(f.fileno())
        plain_file_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(folder)
