"""GPU prepack: checkpoint tensors (CuPy arrays) -> QPN2 / QPN8 buffers, bytes identical to qpn.ref.

- `qpn2_prepack(weight_packed, weight_scale) -> (codes, scales)`: uint8 [N, K/2] and uint8
  [N, K/16] in QPN2 byte order (docs/QPN2.md). N % 32 == 0, K % 64 == 0. NaN scale bytes
  (0x7F/0xFF) rejected.
- `qpn8_prepack(weight, weight_scale, granularity=None) -> (codes, group_scales)`: uint8 [N, K]
  in QPN8 order and float16 [1, N] (tensor / channel) or [K/128, N/32] (128x128 block)
  S16 = RN16(256 * s) (docs/QPN8.md). Rejects NaN weight bytes, scales that are not finite
  and > 0, and S16 whose largest weight RN16(1.75 * S16) is inf.

Rejection: the kernels OR a flag word in device memory when they meet a bad byte or scale
(free on good data: one predicated atomic that never fires), and the wrapper reads it back
once after the launches. That one host sync is fine here: prepack runs once per weight at
load time, never in a forward pass or inside a CUDA graph. Only on a raised flag, the
reference function runs on host copies to raise its own error (first bad index, same text).

Outputs are fresh arrays on the current device; launches go to the current CuPy stream.
"""

from __future__ import annotations

import numpy as np

from ..ref.formats import FP8_BLOCK, QPN2, QPN8, weight_format
from ..ref.geometry import GROUP_K, TILE_N
from ..ref.qpn2 import qpn2_prepack_dims
from ._validate import (
    CupyArray,
    launch_blocks,
    raise_reference_error,
    require_aligned,
    require_cupy,
)
from .loader import kernel
from .variants import KernelVariant

QPN8_GROUPS_PER_THREAD = 4  # 4 x 16-byte packets per thread: 64 B of loads in flight

QPN2_PREPACK = KernelVariant("qpn2_prepack.cu", "qpn2_prepack")
QPN8_PREPACK = KernelVariant(
    "qpn8_prepack.cu", "qpn8_prepack", (("QPN_GROUPS_PER_THREAD", str(QPN8_GROUPS_PER_THREAD)),)
)
QPN8_GROUP_SCALES = KernelVariant(
    "qpn8_prepack.cu", "qpn8_group_scales", (("QPN_GROUPS_PER_THREAD", str(QPN8_GROUPS_PER_THREAD)),)
)
KERNEL_VARIANTS = (QPN2_PREPACK, QPN8_PREPACK, QPN8_GROUP_SCALES)

THREADS_PER_BLOCK = 256  # 8 warps; the kernels use no shared memory, so this only sets granularity
QPN2_PREPACK_GROUPS_PER_THREAD = 4  # fixed in qpn2_prepack.cu: one 32-byte sector of a row
FLAG_NAN = 1
FLAG_BAD_SCALE = 2
FLAG_OVERFLOW = 4


def qpn2_prepack(weight_packed: CupyArray, weight_scale: CupyArray) -> tuple[CupyArray, CupyArray]:
    """ModelOpt NVFP4 tensors on the GPU -> QPN2 (codes uint8 [N, K/2], scales uint8 [N, K/16]).

    weight_packed: cupy uint8 [N, K/2] (element 2j in the low nibble); weight_scale: cupy uint8
    e4m3 bits [N, K/16]. Same rules and bytes as qpn.ref.qpn2_prepack.
    """
    import cupy  # noqa: PLC0415

    require_cupy("weight_packed", weight_packed, np.uint8, ndim=2)
    require_cupy("weight_scale", weight_scale, np.uint8, ndim=2)
    n, k = qpn2_prepack_dims(weight_packed, weight_scale)
    require_qpn2_prepack_aligned(weight_packed, weight_scale)
    codes = cupy.empty(QPN2.buffer("codes").shape(n, k), dtype=QPN2.buffer("codes").dtype)
    scales = cupy.empty(QPN2.buffer("scales").shape(n, k), dtype=QPN2.buffer("scales").dtype)
    run_qpn2_prepack(weight_packed, weight_scale, codes, scales)
    return codes, scales


def require_qpn2_prepack_aligned(weight_packed: CupyArray, weight_scale: CupyArray) -> None:
    """The GPU's rule on the NVFP4 sources, which a torch op's metadata checks cannot see."""
    require_aligned("weight_packed", weight_packed)  # 16-byte loads
    require_aligned("weight_scale", weight_scale, 4)  # 4 scale bytes per load


def run_qpn2_prepack(weight_packed: CupyArray, weight_scale: CupyArray, codes: CupyArray, scales: CupyArray) -> None:
    """Launch into `codes` / `scales` (validated arguments), then read the value flag back (one sync
    per prepack, at load time) and raise the reference's error if it is set."""
    import cupy  # noqa: PLC0415

    flags = cupy.zeros(1, dtype=cupy.int32)
    launch_qpn2_prepack(weight_packed, weight_scale, codes, scales, flags)
    if int(flags.get()[0]):
        from ..ref.qpn2 import qpn2_prepack as reference  # noqa: PLC0415

        raise_reference_error(reference, weight_packed, weight_scale, flagged="a NaN scale byte")


def launch_qpn2_prepack(weight_packed: CupyArray, weight_scale: CupyArray, codes: CupyArray, scales: CupyArray,
                        flags: CupyArray, variant: KernelVariant = QPN2_PREPACK) -> None:
    """grid -> launch for validated arguments (no sync; the benchmark times this directly); `variant`: the
    NVFP4 build, or MXFP4's (cupy_kernels/mxfp4.py: the same codes, e8m0 scales)."""
    n, half_k = weight_packed.shape
    n_tiles, groups = n // TILE_N, 2 * half_k // GROUP_K
    # grid: one thread per (column, 4 groups)
    threads = n * (groups // QPN2_PREPACK_GROUPS_PER_THREAD)
    grid = (launch_blocks(threads, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    args = (weight_packed, weight_scale, codes, scales, np.int32(n_tiles), np.int32(groups), flags)
    kernel(variant)(grid, block, args)


def qpn8_prepack(weight: CupyArray, weight_scale: CupyArray,
                 granularity: str | None = None) -> tuple[CupyArray, CupyArray]:
    """FP8 tensors on the GPU -> QPN8 (codes uint8 [N, K], group_scales float16).

    weight: cupy uint8 e4m3 bits [N, K]; weight_scale: float32 (cupy or numpy) per tensor
    (size 1), per channel ((N,) or (N, 1)) or 128x128 block ((N/128, K/128)); `granularity` as
    in qpn.ref.qpn8_prepack. Returns group_scales [1, N] or [K/128, N/32]. Same rules and bytes
    as qpn.ref.qpn8_prepack.
    """
    import cupy  # noqa: PLC0415

    from ..ref.qpn8 import qpn8_scale_granularity  # noqa: PLC0415  (the shape rule, metadata only)

    require_cupy("weight", weight, np.uint8, ndim=2)
    if isinstance(weight_scale, (np.ndarray, np.float32)):
        if np.asarray(weight_scale).dtype != np.float32:
            raise ValueError(f"weight_scale must have dtype float32, got {np.asarray(weight_scale).dtype}; "
                             "cast it explicitly")
        weight_scale = cupy.asarray(np.ascontiguousarray(weight_scale))
    require_cupy("weight_scale", weight_scale, np.float32)
    n, k = weight.shape
    granularity = qpn8_scale_granularity(weight_scale, n, k, granularity)  # also N / K alignment
    require_aligned("weight", weight)  # 16-byte loads
    group_scales_buffer = weight_format(QPN8.format, granularity).buffer("group_scales")
    codes = cupy.empty(QPN8.buffer("codes").shape(n, k), dtype=QPN8.buffer("codes").dtype)
    group_scales = cupy.empty(group_scales_buffer.shape(n, k), dtype=group_scales_buffer.dtype)
    run_qpn8_prepack(weight, weight_scale, granularity, codes, group_scales)
    return codes, group_scales


def run_qpn8_prepack(weight: CupyArray, weight_scale: CupyArray, granularity: str, codes: CupyArray,
                     group_scales: CupyArray) -> None:
    """Launch into `codes` / `group_scales` (validated arguments), then read the value flag back (one
    sync per prepack, at load time) and raise the reference's error if it is set."""
    import cupy  # noqa: PLC0415

    flags = cupy.zeros(1, dtype=cupy.int32)
    launch_qpn8_prepack(weight, weight_scale, granularity, codes, group_scales, flags)
    bad = int(flags.get()[0])
    if bad:
        from ..ref.qpn8 import qpn8_prepack as reference  # noqa: PLC0415

        what = {FLAG_NAN: "a NaN weight byte",
                FLAG_BAD_SCALE: "a non-finite or non-positive scale"}.get(bad, "an overflowing scale")
        raise_reference_error(reference, weight, weight_scale, granularity=granularity, flagged=what)


def launch_qpn8_prepack(weight: CupyArray, weight_scale: CupyArray, granularity: str, codes: CupyArray,
                        group_scales: CupyArray, flags: CupyArray) -> None:
    """grid -> launch for validated arguments (no sync; the benchmark times this directly)."""
    n, k = weight.shape
    groups = k // GROUP_K
    rows, cols = group_scales.shape
    if granularity == "block":  # S16[kb, t] <- s[t // 4, kb]
        col_div, s_col_stride, s_row_stride = FP8_BLOCK // TILE_N, k // FP8_BLOCK, 1
    else:  # S16[0, n] <- s[n] (channel) or s[0] (tensor)
        col_div, s_col_stride, s_row_stride = 1, (0 if granularity == "tensor" else 1), 0

    # grid: one thread per output scale; one thread per (column, QPN8_GROUPS_PER_THREAD groups)
    chunks = -(-groups // QPN8_GROUPS_PER_THREAD)
    code_grid = (launch_blocks(n * chunks, THREADS_PER_BLOCK),)
    scale_grid = (launch_blocks(rows * cols, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)

    kernel(QPN8_GROUP_SCALES)(
        scale_grid,
        block,
        (weight_scale, group_scales, np.int32(rows), np.int32(cols), np.int32(col_div),
         np.int64(s_col_stride), np.int64(s_row_stride), flags),
    )
    kernel(QPN8_PREPACK)(code_grid, block, (weight, codes, np.int32(n // TILE_N), np.int32(groups), flags))
