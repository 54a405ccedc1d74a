"""Input validation shared by every `qpn.ref` entry point.

Every failure is a `ValueError` that names the argument, the rule, the value and the fix
(docs/DESIGN.md, "Bad input"). Checks run before any work, so a rejected call changes nothing.

Where a value is. A value rule reports the first bad place as an index into the array it was given, so the
caller gives it the array as the checkpoint file holds it (the whole tensor, every expert, gate / up rows
interleaved as stored) and names the file and the tensor in front (`FileError`, vLLM's `ShardGeometry.where`);
a rule that needs two tensors (fp16 overflow) is the one place that adds the offsets of a slice.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from .codecs import E8M0_NAN


class FileError(ValueError):
    """A file breaks a rule. `path` is the file at fault, `tensor` the tensor or config entry (or None),
    `kind` what that is ("tensor", "config entry"); the message starts with both, so the user sees
    where to look."""

    def __init__(self, path: str | os.PathLike[str], tensor: str | None, message: str, *, kind: str = "tensor") -> None:
        self.path = os.fspath(path)
        self.tensor = tensor
        where = f"{self.path}: {kind} {tensor!r}: " if tensor is not None else f"{self.path}: "
        super().__init__(where + message)


class ValueAtIndex(ValueError):
    """A value rule broken first at `index`, an index into the array the rule was given (module docstring,
    "Where a value is"). A caller that gave the rule a slice of the file's tensor re-raises `shifted(offset)`:
    the same message at the index the file holds."""

    def __init__(self, render: Callable[[tuple[int, ...]], str], index: tuple[int, ...]) -> None:
        self.index = index
        self._render = render
        super().__init__(render(index))

    def shifted(self, offset: Sequence[int]) -> ValueAtIndex:
        return ValueAtIndex(self._render, tuple(i + int(o) for i, o in zip(self.index, offset, strict=True)))


def _first(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


def require_array(name: str, value: object, dtype: npt.DTypeLike, ndim: int | None = None) -> np.ndarray:
    """`value` must be a numpy array of exactly `dtype` (no silent casts) and `ndim` dims."""
    if not isinstance(value, np.ndarray):
        raise ValueError(
            f"{name} must be a numpy.ndarray of dtype {np.dtype(dtype)}, got {type(value).__name__}; "
            f"convert it with np.asarray(..., dtype=np.{np.dtype(dtype).name})"
        )
    if value.dtype != np.dtype(dtype):
        raise ValueError(
            f"{name} must have dtype {np.dtype(dtype)}, got {value.dtype}; "
            f"e4m3 scales travel as their uint8 bit patterns (view float8 data as uint8)"
            if np.dtype(dtype) == np.uint8
            else f"{name} must have dtype {np.dtype(dtype)}, got {value.dtype}; cast it explicitly"
        )
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {value.shape}")
    return value


def require_int(name: str, value: object, layout: str) -> int:
    """`value` (a dimension a caller passes) is an int, bool excluded -> int(value)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int (the {layout} weight's dimension), got {type(value).__name__}")
    return int(value)


def require_multiple(name: str, value: int, multiple: int, layout: str, fix: str) -> None:
    """`value` (a dimension) must be a positive multiple of `multiple`."""
    if value <= 0 or value % multiple != 0:
        raise ValueError(
            f"{name} must be a positive multiple of {multiple} for {layout}, got {name}={value}; {fix}"
        )


def require_buffer_shape(name: str, value: np.ndarray, shape: tuple[int, ...], producer: str) -> None:
    """A prepacked buffer (numpy or CuPy: only its shape is read): `shape` [rows, cols], as `producer`
    returns it, or flat [rows * cols]."""
    rows, cols = shape
    if tuple(value.shape) not in ((rows, cols), (rows * cols,)):
        raise ValueError(
            f"{name} must have shape ({rows}, {cols}) (as the prepack returns it) or ({rows * cols},), "
            f"got {tuple(value.shape)}; pass the buffer {producer} produced, with the same n and k"
        )


def require_shape(name: str, value: np.ndarray, shape: tuple) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")


def require_no_nan_e4m3(name: str, bits: np.ndarray) -> None:
    """e4m3 bit patterns 0x7F and 0xFF are NaN; a NaN scale would decode as +-480/256."""
    bad = (bits & 0x7F) == 0x7F  # 0x7F = 0111_1111: exponent and mantissa all ones
    if bad.any():
        idx, count, byte = _first(bad), int(bad.sum()), int(bits[_first(bad)])
        raise ValueAtIndex(lambda at: f"{name} holds NaN e4m3 codes (0x7F/0xFF) at {count} places, first at index "
                                      f"{at} (byte 0x{byte:02X}); the checkpoint is corrupt or not e4m3 - re-export it",
                           idx)


def require_nvfp4_block_scales(name: str, bits: np.ndarray) -> None:
    """The one rule for an NVFP4 checkpoint's e4m3 block scales: no NaN byte and no sign bit.

    Every exporter writes e4m3(amax / 6 / g) with amax >= 0 (ModelOpt's NVFP4QTensor, and
    compressed-tensors' amax / 6 * global_scale), so a byte 0x80..0xFE is corruption; it would
    flip the sign of the whole block. 0x00 (+0) stays valid: it is the scale of an all-zero
    block, and qpn's own pad rows. The layout and kernel functions (qpn2_prepack, the ops)
    accept any non-NaN byte; this rule guards the boundary where checkpoints come in.
    """
    require_no_nan_e4m3(name, bits)
    negative = (bits & 0x80) != 0  # 0x80 = 1000_0000: the e4m3 sign bit
    if negative.any():
        idx, count, byte = _first(negative), int(negative.sum()), int(bits[_first(negative)])
        raise ValueAtIndex(lambda at: f"{name} holds negative e4m3 block scales (sign bit set) at {count} places, "
                                      f"first at index {at} (byte 0x{byte:02X}); NVFP4 block scales are amax/6/g >= 0, "
                                      "so the checkpoint is corrupt - re-export it", idx)


def require_no_nan_e8m0(name: str, bits: np.ndarray) -> None:
    """MXFP4 e8m0 scale bytes: 0xFF is NaN (its 32 values have no number); 0x00..0xFE are 2^-127 .. 2^127."""
    bad = bits == E8M0_NAN
    if bad.any():
        count = int(bad.sum())
        raise ValueAtIndex(lambda at: f"{name} holds the e8m0 NaN byte 0xFF at index {at} ({count} in all): an MXFP4 "
                                      "scale byte must be 0x00..0xFE (2^-127 .. 2^127), and a NaN scale gives its 32 "
                                      "values no number; the checkpoint is corrupt there (re-download or re-export it)",
                           _first(bad))


def require_positive_scale(name: str, scale: np.ndarray) -> None:
    """Every value of a float scale must be finite and > 0 (a zero, negative or NaN scale is corruption)."""
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        count, value = int(bad.sum()), scale[_first(bad)]
        raise ValueAtIndex(lambda at: f"{name} must be finite and > 0, got {count} bad values, first {value} at index "
                                      f"{at}; the checkpoint's scale is corrupt", _first(bad))


def require_finite(name: str, value: np.ndarray, fix: str = "clean it first") -> None:
    bad = ~np.isfinite(value)
    if bad.any():
        count, first = int(bad.sum()), value[_first(bad)]
        raise ValueAtIndex(lambda at: f"{name} must be finite, got {count} NaN/inf values, first {first} at index "
                                      f"{at}; {fix}", _first(bad))


QUANTIZE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))


def require_weight_to_quantize(w: np.ndarray) -> np.ndarray:
    """A weight to quantize: numpy float32/float16 [N, K] (N, K >= 1), finite -> a float32 copy.

    float16 converts to float32 exactly; the copy means the caller's array is never touched.
    """
    if not isinstance(w, np.ndarray):
        raise ValueError(
            f"w must be a numpy.ndarray of dtype float32 or float16, got {type(w).__name__}; "
            "convert it with np.asarray(w, dtype=np.float32)"
        )
    if w.dtype not in QUANTIZE_DTYPES:
        raise ValueError(
            f"w must have dtype float32 or float16 (converted to float32 exactly), got {w.dtype}; "
            "cast bf16 weights to float32 first (exact), never quantize from float64 or integers"
        )
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"w must be 2-D [N, K] with N, K >= 1, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        bad = ~np.isfinite(w)
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"w must be finite, got {int(bad.sum())} NaN/inf values, first at index {first} "
            f"(value {w[first]}); clean the weight before quantizing"
        )
    return w.astype(np.float32)
