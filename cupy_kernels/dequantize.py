"""GPU dequantization: QPN2 / QPN8 buffers -> fp16 W16 [N, K], bytes identical to qpn.ref.

- `qpn2_dequantize(codes, scales, global_scale, n, k, out=None, check=True)`:
  W16 = RN16(RN32(e2m1 * RN32(e4m3 * g(n)))), g a scalar or one fp32 per 32-column tile.
- `qpn8_dequantize(codes, group_scales, n, k, out=None, check=True)`:
  W16 = RN16(e4m3 * 2^-8 * S16).

Global scale (QPN2): a Python float / numpy float32 scalar / numpy float32 [N/32] is validated
on the host and uploaded (one tiny copy per call); a CuPy float32 array of size 1 or [N/32]
is used in place (stride 0 or 1 in the kernel), which is what a module should hold.

`check=True` (the default) rejects what qpn.ref rejects before writing anything: a small check
kernel reads only the scales (QPN2: N*K/16 bytes; QPN8: the codes too, for NaN bytes), ORs a
flag, and the host reads the flag back (one sync), then raises the reference's own error.
`check=False` skips both the kernel and the sync: use it in hot paths (forward passes, CUDA
graphs) for weights validated once at load time; bad scales then give inf/garbage, not an error.

`out`: an fp16 C-contiguous [N, K] CuPy array (16-byte aligned) to write into, or None.
Launches go to the current CuPy stream.
"""

from __future__ import annotations

import numpy as np

from ..ref.geometry import GROUP_K, TILE_N
from ..ref.qpn2 import PAD_K_FIX, PAD_N_FIX, QPN2_K_MULTIPLE
from ._validate import (
    CupyArray,
    global_scale_on_device,
    launch_blocks,
    output_array,
    raise_reference_error,
    require_aligned,
    require_buffer_shape,
    require_cupy,
    require_int,
    require_multiple,
)
from .loader import kernel
from .variants import KernelVariant

# Groups one lane decodes (all their loads in flight at once: QPN2 2 x 9 B, QPN8 2 x 16 B)
# and groups staged per shared-memory phase (2: each store instruction writes 8 rows x 64 B).
# Measured on the H200 (benchmarks/results/h200.md, section "sweep"; 28672x8192, % of the
# streaming-read ceiling): QPN2 (2,2) 86.7, (4,2) 81.7, (8,2) 79.1, (4,4) 85.0, (8,4) 81.4;
# QPN8 (2,2) 84.2, (4,2) 81.9, (4,4) 85.0. (2,2) is best or within noise everywhere and keeps
# 16 KiB of staging per block (32 KiB would halve Turing's resident warps).
GROUPS_PER_THREAD = 2
STAGE_GROUPS = 2
WARPS_PER_BLOCK = 8  # 16 KiB of staging per block: 4 blocks (32 warps) fit a Turing SM
THREADS_PER_BLOCK = 32 * WARPS_PER_BLOCK
_MACROS = (
    ("QPN_GROUPS_PER_THREAD", str(GROUPS_PER_THREAD)),
    ("QPN_STAGE_GROUPS", str(STAGE_GROUPS)),
    ("QPN_WARPS_PER_BLOCK", str(WARPS_PER_BLOCK)),
)

QPN2_DEQUANTIZE = KernelVariant("qpn2_dequantize.cu", "qpn2_dequantize", _MACROS)
QPN2_CHECK_SCALES = KernelVariant("qpn2_dequantize.cu", "qpn2_check_scales", _MACROS)
QPN8_DEQUANTIZE = KernelVariant("qpn8_dequantize.cu", "qpn8_dequantize", _MACROS)
QPN8_CHECK = KernelVariant("qpn8_dequantize.cu", "qpn8_check", _MACROS)
KERNEL_VARIANTS = (QPN2_DEQUANTIZE, QPN2_CHECK_SCALES, QPN8_DEQUANTIZE, QPN8_CHECK)

CHECK_MAX_BLOCKS = 1024  # the check kernels are grid-stride loops; 1024 x 256 threads fill any GPU
QPN8_BLOCK = 128
QPN8_K_MULTIPLE = GROUP_K
PAD_K16_FIX = "pad K with zero columns to a multiple of 16"  # == qpn.ref.qpn8.PAD_K16_FIX


def _qpn2_dims(n: int, k: int) -> tuple[int, int]:
    n, k = require_int("n", n, "QPN2"), require_int("k", k, "QPN2")
    require_multiple("N", n, TILE_N, "QPN2", PAD_N_FIX)
    require_multiple("K", k, QPN2_K_MULTIPLE, "QPN2", PAD_K_FIX)
    return n, k


def prepare_qpn2(codes: CupyArray, scales: CupyArray, global_scale: float | np.ndarray | CupyArray, n: int, k: int
                 ) -> tuple[int, int, CupyArray, int]:
    """Validate QPN2 dequantize inputs; returns (n, k, device global scale, its tile stride)."""
    n, k = _qpn2_dims(n, k)
    require_cupy("codes", codes, np.uint8)
    require_buffer_shape("codes", codes, n, k // 2, "qpn2_prepack")
    require_cupy("scales", scales, np.uint8)
    require_buffer_shape("scales", scales, n, k // GROUP_K, "qpn2_prepack")
    require_aligned("codes", codes, 8)  # 8-byte loads
    require_aligned("scales", scales, 4)  # the check kernel reads 4 bytes at a time
    g, g_stride = global_scale_on_device(global_scale, n)
    return n, k, g, g_stride


def check_qpn2(codes: CupyArray, scales: CupyArray, g: CupyArray, g_stride: int, n: int, k: int, global_scale: float | np.ndarray | CupyArray) -> None:
    """The reference's value rules on the GPU; raises the reference's ValueError (one host sync)."""
    import cupy  # noqa: PLC0415

    n_tiles, groups = n // TILE_N, k // GROUP_K
    flags = cupy.zeros(1, dtype=cupy.int32)
    check_grid = (min(launch_blocks(n_tiles * groups * 8, THREADS_PER_BLOCK), CHECK_MAX_BLOCKS),)
    kernel(QPN2_CHECK_SCALES)(
        check_grid, (THREADS_PER_BLOCK,), (scales, g, np.int32(g_stride), np.int32(n_tiles), np.int32(groups), flags)
    )
    if int(flags.get()[0]):  # the one sync of a checked call
        from ..ref.qpn2 import qpn2_dequantize as reference  # noqa: PLC0415

        raise_reference_error(
            reference, codes, scales, global_scale, n, k, flagged="a NaN scale byte, an overflowing block or a bad global scale"
        )


def launch_qpn2_dequantize(codes: CupyArray, scales: CupyArray, g: CupyArray, g_stride: int, out: CupyArray, n: int, k: int) -> None:
    """grid -> launch for validated arguments (no checks, no sync)."""
    n_tiles, groups = n // TILE_N, k // GROUP_K
    # grid: one warp per (tile, GROUPS_PER_THREAD groups)
    chunks = -(-groups // GROUPS_PER_THREAD)
    grid = (launch_blocks(n_tiles * chunks * 32, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    kernel(QPN2_DEQUANTIZE)(grid, block, (codes, scales, g, np.int32(g_stride), out, np.int32(n_tiles), np.int32(groups)))


def qpn2_dequantize(codes: CupyArray, scales: CupyArray, global_scale: float | np.ndarray | CupyArray, n: int, k: int, out: CupyArray | None = None,
                    check: bool = True) -> CupyArray:
    """QPN2 buffers (CuPy) -> fp16 [n, k] under the qpn contract (= qpn.ref.qpn2_dequantize).

    codes: uint8 [n, k/2] or flat; scales: uint8 [n, k/16] or flat (as qpn2_prepack returns);
    global_scale: float32 scalar or [n/32] (host or CuPy). See the module docstring for `check`.
    """
    # validate; allocate (or validate the caller's buffer) before any launch
    n, k, g, g_stride = prepare_qpn2(codes, scales, global_scale, n, k)
    out = output_array(out, (n, k), np.float16)
    if check:
        check_qpn2(codes, scales, g, g_stride, n, k, global_scale)
    launch_qpn2_dequantize(codes, scales, g, g_stride, out, n, k)
    return out


def _qpn8_layout(group_scales: CupyArray, n: int, k: int) -> tuple[str, int, int, int]:
    """(granularity, kb stride, tile stride, column stride) of the fp16 group scales; qpn.ref's shape rule."""
    shape = tuple(group_scales.shape)
    if shape == (1, n):
        require_multiple("N", n, TILE_N, "QPN8", PAD_N_FIX)
        require_multiple("K", k, QPN8_K_MULTIPLE, "QPN8", PAD_K16_FIX)
        return "channel", 0, TILE_N, 1  # S16[0, n]: n = 32 t + col
    if k % QPN8_BLOCK == 0 and n % TILE_N == 0 and shape == (k // QPN8_BLOCK, n // TILE_N):
        return "block", n // TILE_N, 1, 0  # S16[g // 8, t]
    raise ValueError(
        f"group_scales must be float16 [1, {n}] (channel / tensor) or [K/128, N/32] = "
        f"[{k // QPN8_BLOCK}, {n // TILE_N}] (128x128 block, needs K % 128 == 0 and N % 32 == 0) for a "
        f"[{n}, {k}] weight, got shape {shape}; pass what qpn8_prepack returned"
    )


def prepare_qpn8(codes: CupyArray, group_scales: CupyArray, n: int, k: int) -> tuple[int, int, tuple[int, int, int]]:
    """Validate QPN8 dequantize inputs; returns (n, k, (kb stride, tile stride, column stride))."""
    n, k = require_int("n", n, "QPN8"), require_int("k", k, "QPN8")
    require_multiple("N", n, TILE_N, "QPN8", PAD_N_FIX)
    require_multiple("K", k, QPN8_K_MULTIPLE, "QPN8", PAD_K16_FIX)
    require_cupy("codes", codes, np.uint8)
    require_buffer_shape("codes", codes, n, k, "qpn8_prepack")
    require_cupy("group_scales", group_scales, np.float16, ndim=2)
    strides = _qpn8_layout(group_scales, n, k)[1:]
    require_aligned("codes", codes)  # 16-byte loads
    return n, k, strides


def check_qpn8(codes: CupyArray, group_scales: CupyArray, n: int, k: int) -> None:
    """The reference's value rules on the GPU; raises the reference's ValueError (one host sync)."""
    import cupy  # noqa: PLC0415

    flags = cupy.zeros(1, dtype=cupy.int32)
    units = n * k // 16
    check_grid = (min(launch_blocks(units, THREADS_PER_BLOCK), CHECK_MAX_BLOCKS),)
    kernel(QPN8_CHECK)(
        check_grid, (THREADS_PER_BLOCK,), (codes, np.int64(units), group_scales, np.int64(group_scales.size), flags)
    )
    if int(flags.get()[0]):  # the one sync of a checked call
        from ..ref.qpn8 import qpn8_dequantize as reference  # noqa: PLC0415

        raise_reference_error(reference, codes, group_scales, n, k, flagged="a NaN code byte or a bad / overflowing group scale")


def launch_qpn8_dequantize(codes: CupyArray, group_scales: CupyArray, strides: tuple[int, int, int], out: CupyArray, n: int, k: int
                           ) -> None:
    """grid -> launch for validated arguments (no checks, no sync)."""
    kb_stride, tile_stride, col_stride = strides
    n_tiles, groups = n // TILE_N, k // GROUP_K
    # grid: one warp per (tile, GROUPS_PER_THREAD groups)
    chunks = -(-groups // GROUPS_PER_THREAD)
    grid = (launch_blocks(n_tiles * chunks * 32, THREADS_PER_BLOCK),)
    block = (THREADS_PER_BLOCK,)
    kernel(QPN8_DEQUANTIZE)(
        grid,
        block,
        (codes, group_scales, np.int64(kb_stride), np.int32(tile_stride), np.int32(col_stride), out,
         np.int32(n_tiles), np.int32(groups)),
    )


def qpn8_dequantize(codes: CupyArray, group_scales: CupyArray, n: int, k: int, out: CupyArray | None = None, check: bool = True
                    ) -> CupyArray:
    """QPN8 buffers (CuPy) -> fp16 [n, k], W16 = RN16(e4m3 * 2^-8 * S16) (= qpn.ref.qpn8_dequantize).

    codes: uint8 [n, k] or flat; group_scales: float16 [1, n] or [k/128, n/32] (as
    qpn8_prepack returns). See the module docstring for `check`.
    """
    # validate; allocate (or validate the caller's buffer) before any launch
    n, k, strides = prepare_qpn8(codes, group_scales, n, k)
    out = output_array(out, (n, k), np.float16)
    if check:
        check_qpn8(codes, group_scales, n, k)
    launch_qpn8_dequantize(codes, group_scales, strides, out, n, k)
    return out
