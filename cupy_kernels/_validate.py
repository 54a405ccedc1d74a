"""Host-side validation for the CuPy wrappers: ValueErrors that name argument, rule, value and fix.

Wording follows qpn.ref (docs/DESIGN.md, "Bad input"); the GPU-only rules (a CuPy array on the
current device, C-contiguous, aligned for 16-byte vector loads) are added here. Value rules
that need the data (NaN scale bytes, fp16 overflow) run on the GPU; when one fires, the
wrapper re-runs the reference function on host copies so that the error is the reference's own
(`raise_reference_error`): one code path for the message, taken only on bad input.
cupy is imported lazily, inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from ..ref.checks import require_buffer_shape
from ..ref.formats import WeightFormat
from ..ref.geometry import TILE_N

# CuPy ships no type information (mypy reads `cupy` as Any: pyproject.toml, [tool.mypy]), so a
# cupy.ndarray is annotated with this alias: it names what the value is, mypy checks nothing more.
CupyArray: TypeAlias = Any

VECTOR_BYTES = 16  # the kernels move 16-byte vectors


def require_cupy(name: str, value: object, dtype: npt.DTypeLike, ndim: int | None = None) -> CupyArray:
    """`value` is a C-contiguous cupy.ndarray of exactly `dtype` on the current device."""
    import cupy  # noqa: PLC0415

    dtype = np.dtype(dtype)
    if not isinstance(value, cupy.ndarray):
        raise ValueError(
            f"{name} must be a cupy.ndarray of dtype {dtype} on the GPU, got {type(value).__name__}; "
            f"move it there with cupy.asarray(...) (dtype {dtype})"
        )
    if value.dtype != dtype:
        hint = ("e4m3 bytes travel as uint8 bit patterns (view float8 data as uint8)" if dtype == np.uint8
                else "cast it explicitly")
        raise ValueError(f"{name} must have dtype {dtype}, got {value.dtype}; {hint}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {value.shape}")
    if not value.flags.c_contiguous:
        raise ValueError(
            f"{name} must be C-contiguous (the kernels read it as flat memory), got strides {value.strides}; "
            f"pass cupy.ascontiguousarray({name})"
        )
    current = cupy.cuda.runtime.getDevice()
    if value.device.id != current:
        raise ValueError(
            f"{name} lives on GPU {value.device.id} but the current device is GPU {current}; call under "
            f"`with cupy.cuda.Device({value.device.id}):` or move the array"
        )
    return value


def require_aligned(name: str, value: CupyArray, alignment: int = VECTOR_BYTES) -> None:
    if value.data.ptr % alignment:
        raise ValueError(
            f"{name} must start on a {alignment}-byte boundary (the kernels use {alignment}-byte vector accesses), "
            f"got address 0x{value.data.ptr:x}; pass a fresh allocation ({name}.copy()) instead of an offset view"
        )


def require_packed(wf: WeightFormat, name: str, value: CupyArray, n: int, k: int) -> None:
    """Buffer `name` of `wf` for an [n, k] weight on the device: the description's dtype, and its
    shape as the prepack returns it or flat (qpn.ref's rule)."""
    buffer = wf.buffer(name)
    require_cupy(name, value, buffer.dtype)
    require_buffer_shape(name, value, buffer.shape(n, k), f"{wf.layout.lower()}_prepack")


def require_shape(name: str, value: CupyArray, shape: tuple[int, ...]) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")


def output_array(out: CupyArray | None, shape: tuple[int, ...], dtype: npt.DTypeLike, name: str = "out"
                 ) -> CupyArray:
    """`out` validated (fp16, C-contiguous, current device, 16-byte aligned), or a fresh array."""
    import cupy  # noqa: PLC0415

    if out is None:
        return cupy.empty(shape, dtype=dtype)
    require_cupy(name, out, dtype)
    require_shape(name, out, shape)
    require_aligned(name, out)
    return out


def global_scale_on_device(global_scale: float | np.ndarray | CupyArray, n: int, name: str = "global_scale"
                           ) -> tuple[CupyArray, int]:
    """NVFP4 global scale -> (fp32 device array, tile stride): stride 0 for a scalar, 1 per tile.

    Same shape and dtype rules as qpn.ref.global_scale_per_row: float32, a scalar (shape () or
    (1,)) or one value per 32-column tile ([n/32]); Python floats are taken as float32. Host
    values are also checked finite and > 0 here; a CuPy array's values are checked on the GPU
    by the dequantize check kernel (check=True), because reading them here would cost a sync.
    """
    import cupy  # noqa: PLC0415

    on_device = isinstance(global_scale, cupy.ndarray)
    # Python floats (not numpy scalars: np.float64 subclasses float and must be rejected)
    if isinstance(global_scale, (float, int)) and not isinstance(global_scale, (bool, np.generic)):
        global_scale = np.float32(global_scale)
    g: np.ndarray | CupyArray = global_scale if on_device else np.asarray(global_scale)
    if g.dtype != np.float32:
        raise ValueError(
            f"{name} must be float32 (scalar or one value per 32-column tile), got dtype {g.dtype}; "
            "checkpoints store weight_scale_2 as fp32 - pass it unchanged"
        )
    if g.size != 1 and not (g.ndim == 1 and n % TILE_N == 0 and g.shape[0] == n // TILE_N):
        raise ValueError(
            f"{name} must be a scalar or hold one value per 32-column tile (shape ({n // TILE_N},) "
            f"for N={n}), got shape {g.shape}; give each fused shard its own scale per tile of 32 rows"
        )
    stride = global_scale_stride(g)
    if on_device:
        require_cupy(name, g, np.float32)
        return g, stride  # the kernel takes the pointer; no reshape (a view costs host time per call)
    if not (np.all(np.isfinite(g)) and np.all(g > 0)):
        raise ValueError(f"{name} must be finite and > 0, got values {np.unique(g)[:4]}")
    return cupy.asarray(np.ascontiguousarray(g.reshape(-1))), stride


def global_scale_stride(g: np.ndarray | CupyArray) -> int:
    """The kernels' tile stride of a validated global scale: 0 for one value, 1 for one per tile."""
    return 0 if g.size == 1 else 1


def to_host(value: object) -> object:
    """A CuPy array's host copy (numpy arrays and scalars pass through)."""
    return value.get() if hasattr(value, "get") and not isinstance(value, np.ndarray) else value


def raise_reference_error(reference: Callable[..., object], *args: object, flagged: str, **kwargs: object) -> None:
    """The GPU flagged bad data: run the qpn.ref function on host copies so that its ValueError
    (its rule order, its wording, the first bad index) is what the caller sees.

    Only reached on bad input, so the device-to-host copy does not matter. If the reference
    accepts the data, the GPU check and the reference disagree: that is a bug, not bad input.
    """
    host_args = [to_host(a) for a in args]
    reference(*host_args, **kwargs)
    raise RuntimeError(
        f"qpn internal error: the GPU check flagged {flagged}, but {reference.__module__}.{reference.__name__} "
        "accepted the same data; please report this with the inputs"
    )


def launch_blocks(threads: int, block: int) -> int:
    """Blocks of `block` threads that cover `threads` threads."""
    return (threads + block - 1) // block
