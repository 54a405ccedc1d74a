"""The CPU side of the torch ops (ops.py validates, then calls here; _cuda.py is the CUDA side): torch
tensors in, the numba kernels of _cpu.py on numpy views, torch tensors out. Decode for the dequantize
ops; for the linears, the decode fused into the dot products or decode then torch's fp32 matmul
(`decode_then_matmul`), as dispatch.choose picks. A layout's buffers arrive as a tuple in its
description's order (ref/formats.py), its numba kernels and operands come from one table (_FAMILIES)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..ref.formats import QPN2, QPN8, QPNMX, WeightFormat
from ..ref.geometry import TILE_N
from . import _cpu, dispatch
from .buffers import column_scale
from .epilogue import silu_and_mul

# decode_rows(out, row0): W16 rows [row0, row0 + R) into out float32 [R, K] (the numba *_w16_rows kernels)
DecodeRows = Callable[[np.ndarray, int], None]


def dequantize(wf: WeightFormat, buffers: tuple[Tensor, ...], n: int, k: int) -> Tensor:
    kernels, family = _kernels(), _family(wf)
    decode_rows = functools.partial(getattr(kernels, family.w16_rows), *family.operands(buffers, n))
    out = torch.empty((n, k), dtype=torch.float32)
    decode_rows(out.numpy(), 0)
    return out.to(torch.float16)  # exact: values are fp16


def linear(wf: WeightFormat, x: Tensor, buffers: tuple[Tensor, ...], n: int, gated: bool) -> Tensor:
    """RN16(x @ W16^T) -> fp16 [M, n] ([M, n/2] gated: the epilogue) on the path dispatch.choose picks: the
    fused kernels or decode-then-matmul (the CUDA side's _cuda.linear). bf16 x: RN_bf16, a bf16 result."""
    if x.shape[0] == 0:
        return x.new_empty((0, n // 2 if gated else n))
    y = linear_on(dispatch.choose(x.device, wf, x.shape[0], n, x.shape[1], False), wf, x, buffers, n)
    return silu_and_mul(y) if gated else y


def linear_on(path: str, wf: WeightFormat, x: Tensor, buffers: tuple[Tensor, ...], n: int) -> Tensor:
    """`linear` on a given path, "cpu_fused" or "cpu_blas" (benchmarks/bench_dispatch.py times each): the fp32
    sums rounded once to x's dtype (fp16 or bf16)."""
    return sums_on(path, wf, x, buffers, n).to(x.dtype, memory_format=torch.contiguous_format)


def sums_on(path: str, wf: WeightFormat, x: Tensor, buffers: tuple[Tensor, ...], n: int) -> Tensor:
    """float32 [M, n]: the outputs before their one RN16 / RN_bf16 (each sum times the layout's column scale,
    exact), on `path`; the MoE op adds its biases here. x fp16 or bf16: widened to fp32 exactly, so the
    kernels and the matmul are the same for both (docs/DESIGN.md, "bf16 activations")."""
    kernels, family = _kernels(), _family(wf)
    operands = family.operands(buffers, n)
    scale = column_scale(wf, buffers)
    if path == "cpu_fused":
        y = torch.empty((x.shape[0], n), dtype=torch.float32)
        getattr(kernels, family.fused)(*operands, x.float()[:, _x_position_index(x.shape[1])].numpy(), y.numpy())
        return y if scale is None else y * scale
    return decode_then_matmul(x, n, functools.partial(getattr(kernels, family.w16_rows), *operands), scale)


def _qpn2_operands(buffers: tuple[Tensor, ...], n: int) -> tuple[np.ndarray, ...]:
    """numpy views (codes, scales, g_tiles) for the QPN2 kernels; a scalar g is repeated per tile."""
    codes, scales, global_scale = buffers
    g_tiles = global_scale.reshape(-1).expand(n // TILE_N).contiguous() if global_scale.numel() == 1 \
        else global_scale.contiguous()
    return codes.reshape(-1).numpy(), scales.reshape(-1).numpy(), g_tiles.numpy()


def _qpn8_operands(buffers: tuple[Tensor, ...], n: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """numpy (codes, S16 as float32, channel?) for the QPN8 kernels ([1, N] = channel, else block)."""
    codes, group_scales = buffers
    channel = tuple(group_scales.shape) == QPN8.buffer("group_scales").shape(n, codes.shape[1])
    return codes.reshape(-1).numpy(), group_scales.float().numpy(), channel


def _qpnmx_operands(buffers: tuple[Tensor, ...], n: int) -> tuple[np.ndarray, ...]:
    """numpy (codes, scales, the tiles' block constants 2^(s - 127 - T): _cpu.qpnmx_blocks) for the QPNMX
    kernels (32 KiB per 32 tiles, built per call); the tiles' 2^T are the column scale (sums_on)."""
    codes, scales, tile_scale = buffers
    return codes.reshape(-1).numpy(), scales.reshape(-1).numpy(), _cpu.qpnmx_blocks(tile_scale.numpy())


class _Family(NamedTuple):
    """A layout's numba kernels (their names in _cpu.kernels()) and its operands."""

    fused: str
    w16_rows: str
    operands: Callable[[tuple[Tensor, ...], int], tuple]


# by byte layout: both QPN8 descriptions (channel / tensor and block scales) run the QPN8 kernels
_FAMILIES = {QPN2.layout: _Family("qpn2_linear_fused", "qpn2_w16_rows", _qpn2_operands),
             QPN8.layout: _Family("qpn8_linear_fused", "qpn8_w16_rows", _qpn8_operands),
             QPNMX.layout: _Family("qpnmx_linear_fused", "qpnmx_w16_rows", _qpnmx_operands)}


def _family(wf: WeightFormat) -> _Family:
    return _FAMILIES[wf.layout]


def _kernels() -> SimpleNamespace:
    """The numba kernels (built on first use: numba is not imported before), running on as many
    threads as torch uses (torch.get_num_threads()).

    numba's OpenMP threading layer shares torch's OpenMP runtime (one libgomp.so.1 per process)
    and its first launch sets that runtime's thread count to NUMBA_NUM_THREADS: torch's count is
    put back, or a user's (or vLLM's) torch.set_num_threads would be lost on the first CPU op.
    """
    threads = torch.get_num_threads()
    kernels = _cpu.kernels(threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return kernels


def fp32_matmul_exact() -> bool:
    """Whether torch's fp32 CPU matmul accumulates in fp32 now (precision "highest"). torch >= 2.9 raises a
    RuntimeError on reading the legacy setting once a per-backend one (torch.backends.fp32_precision, ...)
    was set: then no, and the callers take float64, exact whatever is set."""
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:
        return False


def decode_then_matmul(x: Tensor, n: int, decode_rows: DecodeRows, scale: Tensor | None = None) -> Tensor:
    """float32 [M, n]: x @ W16^T with fp32 accumulation (under reduced matmul precision settings float64,
    rounded once at the end), each column times `scale` (the layout's column scale, exact) if given.

    W16 is decoded by `decode_rows(out, row0)` in chunks of _cpu.CHUNK_ELEMENTS (sized for the
    last-level cache), each multiplied by torch's fp32 matmul (y^T = W16 @ x^T, chunk by chunk).
    Both operands hold fp16 values exactly, so every product is exact and only the sums round. torch's fp32 CPU matmul
    accumulates in fp32 at the default "highest" matmul precision; at "high"/"medium" it may use
    bf16 internally, so the product is then taken in float64.
    """
    m, k = x.shape
    chunk = min(n, max(TILE_N, _cpu.CHUNK_ELEMENTS // k // TILE_N * TILE_N))
    exact = fp32_matmul_exact()
    w16 = torch.empty((chunk, k), dtype=torch.float32)
    x_t = x.float().t() if exact else x.double().t()
    y_t = torch.empty((n, m), dtype=x_t.dtype)
    for row0 in range(0, n, chunk):
        rows = min(chunk, n - row0)
        decode_rows(w16[:rows].numpy(), row0)
        torch.mm(w16[:rows] if exact else w16[:rows].double(), x_t, out=y_t[row0:row0 + rows])
    if scale is not None:
        y_t *= scale[:, None]
    # contiguous (linear_on): vLLM slices q/k/v out of the rows and its CPU attention requires unit stride
    return y_t.t()


@functools.lru_cache(maxsize=64)
def _x_position_index(k: int) -> Tensor:
    return torch.from_numpy(_cpu.x_position_index(k))
