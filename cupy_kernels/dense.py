"""The dense (prefill) path: dequantize the whole weight into fp16, then one cuBLAS GEMM.

    y[M, N] = x[M, K] @ W16[N, K]^T     W16 from qpn2_dequantize / qpn8_dequantize

The GEMM is `cupy.matmul(x, w.T)`: for 2-D fp16 operands CuPy calls cublasGemmEx with
CUBLAS_COMPUTE_32F (fp32 accumulation, docs/DESIGN.md, "Linear": never fp16 accumulation), and `w.T` is an
F-contiguous view, so cuBLAS reads W16 transposed in place (no copy). Because W16 is
byte-identical to qpn.ref's and the GEMM call is the same one a caller would make on the
reference W16, the result is bit-identical to cuBLAS on the reference weights.

`workspace`: an fp16 [N, K] CuPy array reused for W16 (else one is taken from CuPy's pool
per call). `out`: an fp16 [M, N] C-contiguous array for y. `check` defaults to False here:
this is the per-forward hot path, and a validating dequantize costs a host sync that CUDA
graphs cannot capture; validate weights once at load (prepack, or dequantize with check=True).
"""

from __future__ import annotations

import numpy as np

from ..ref.formats import QPN2, QPN8
from ._validate import CupyArray, output_array, require_cupy
from .dequantize import (
    check_qpn2,
    check_qpn8,
    launch_qpn2_dequantize,
    launch_qpn8_dequantize,
    prepare_qpn2,
    prepare_qpn8,
)


def _activation(x: CupyArray) -> CupyArray:
    require_cupy("x", x, np.float16, ndim=2)
    m, k = x.shape
    if m < 1:
        raise ValueError(f"x must have at least one row (M >= 1), got shape {tuple(x.shape)}")
    return m, k


def _weight_rows(codes: CupyArray, k: int, bytes_per_row: float, name: str = "codes") -> int:
    """N from a prepacked code buffer: its first dim when 2-D, else its size / (K * bytes per k)."""
    require_cupy(name, codes, np.uint8)
    if codes.ndim == 2:
        if codes.shape[1] != int(k * bytes_per_row):
            raise ValueError(
                f"{name} has shape {tuple(codes.shape)}, which holds rows of "
                f"{codes.shape[1] / bytes_per_row:g} inputs, "
                f"but x has K={k}; pass the buffers prepacked for this layer"
            )
        return codes.shape[0]
    n = codes.size / (k * bytes_per_row)
    if n != int(n):
        raise ValueError(f"{name} holds {codes.size} bytes, not a whole number of rows of K={k} inputs")
    return int(n)


def _buffers(out: CupyArray | None, workspace: CupyArray | None, m: int, n: int, k: int) -> tuple[CupyArray, CupyArray]:
    """The caller's buffers validated (or a fresh W16 workspace), before any launch."""
    if out is not None:
        require_cupy("out", out, np.float16, ndim=2)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out must have shape {(m, n)}, got {tuple(out.shape)}")
    return output_array(workspace, (n, k), np.float16, name="workspace")


def _matmul(x: CupyArray, w: CupyArray, out: CupyArray) -> CupyArray:
    import cupy  # noqa: PLC0415

    return cupy.matmul(x, w.T, out=out)  # cublasGemmEx, CUBLAS_COMPUTE_32F; w.T read in place


def qpn2_dense_linear(x: CupyArray, codes: CupyArray, scales: CupyArray, global_scale: float | np.ndarray | CupyArray,
                      out: CupyArray | None = None, workspace: CupyArray | None = None,
                      check: bool = False) -> CupyArray:
    """y = x @ W16^T for a QPN2 weight: dequantize to fp16, then cuBLAS (fp32 accumulate).

    x: fp16 [M, K] CuPy; codes, scales as qpn2_prepack returns them; global_scale: float32
    scalar or [N/32]. Returns fp16 [M, N] (or `out`).
    """
    # validate everything once, then launch (this is the per-forward path: no second validation)
    m, k = _activation(x)
    n = _weight_rows(codes, k, QPN2.code_bits / 8)
    n, k, g, g_stride = prepare_qpn2(codes, scales, global_scale, n, k)
    w = _buffers(out, workspace, m, n, k)
    if check:
        check_qpn2(codes, scales, g, g_stride, n, k, global_scale)
    launch_qpn2_dequantize(codes, scales, g, g_stride, w, n, k)
    return _matmul(x, w, out)


def qpn8_dense_linear(x: CupyArray, codes: CupyArray, group_scales: CupyArray, out: CupyArray | None = None,
                      workspace: CupyArray | None = None, check: bool = False) -> CupyArray:
    """y = x @ W16^T for a QPN8 weight: dequantize to fp16, then cuBLAS (fp32 accumulate).

    x: fp16 [M, K] CuPy; codes, group_scales as qpn8_prepack returns them. Returns fp16 [M, N].
    """
    m, k = _activation(x)
    n = _weight_rows(codes, k, QPN8.code_bits / 8)
    n, k, strides = prepare_qpn8(codes, group_scales, n, k)
    w = _buffers(out, workspace, m, n, k)
    if check:
        check_qpn8(codes, group_scales, n, k)
    launch_qpn8_dequantize(codes, group_scales, strides, w, n, k)
    return _matmul(x, w, out)
