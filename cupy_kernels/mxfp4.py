"""MXFP4 on the GPU (issue 23): the QPN2 kernels' QPNMX builds (QPN_MX = 1).

- `qpnmx_prepack(blocks, scales) -> (codes, scales, tile_scale)`: gpt-oss's tensors -> QPNMX (the same
  bytes as qpn.ref.mxfp4.qpnmx_prepack; a NaN scale byte raises the reference's ValueError)
- `qpnmx_dequantize(codes, scales, tile_scale, n, k, out=None) -> fp16 [n, k]`: the reduced W16 (y needs
  the tiles' 2^T on top: the dense path scales its fp32 sums)
- `qpnmx_linear(x, codes, scales, tile_scale, out=None, gated=False, workspace=None)`: the decode kernels,
  M in [1, 32]; `qpnmx_gemm_linear(...)`: their fused-dequantize GEMM build, any M (built for 33-512)

The buffers are qpn.ref.mxfp4.qpnmx_prepack's (docs/QPNMX.md): codes uint8 [N, K/2] (QPN2's bytes),
scales uint8 [N, K/32] (e8m0, lane order), tile_scale float32 [N/32] (2^T per tile). The kernel is QPN2's
(qpn2_linear.cu with QPN_MX = 1): the same code path, split and x source; the block constant of an e8m0
byte is {2^F, 0}, and each tile's fp32 sums are multiplied by its 2^T before the one RN16 (docs/DESIGN.md,
"MXFP4 weight"). Batch invariance and split-K as the QPN2 decode kernels (linear.py). No value check
here (the per-token path): the values are checked at prepack, where a tile_scale that disagrees with the
scales is rejected (qpn.ref.mxfp4.qpnmx_dequantize).
"""

from __future__ import annotations

import numpy as np

from ..ref.codecs import E8M0_BIAS
from ..ref.formats import QPN2, QPNMX
from ..ref.mxfp4 import W16_TOP_EXP
from ._validate import CupyArray, output_array, require_aligned, require_cupy, require_packed, require_shape
from .dequantize import DEQUANTIZE_MACROS, launch_qpn2_dequantize
from .gemm import gemm_activation, gemm_variant, launch_gemm
from .linear import FALLBACK_STACK_BYTES, MAX_M, X_FRAG, decode_activation, decode_macros, launch_decode
from .loader import kernel
from .prepack import launch_qpn2_prepack
from .variants import KernelVariant
from .workspace import TOKENS_PER_BLOCK, gated_rows, rows_of_codes

_MX = (("QPN_MX", "1"),)

QPNMX_LINEAR = {
    (nb, gated): KernelVariant("qpn2_linear.cu", "qpn2_linear", decode_macros(QPNMX.key, nb, gated),
                               archs=("sm_75",), max_stack_bytes=FALLBACK_STACK_BYTES)
    for gated in (False, True)
    for nb in range(1, MAX_M // TOKENS_PER_BLOCK + 1)
}
QPNMX_PREPACK = KernelVariant("qpn2_prepack.cu", "qpn2_prepack", _MX)
QPNMX_DEQUANTIZE = KernelVariant("qpn2_dequantize.cu", "qpn2_dequantize", tuple(sorted((*DEQUANTIZE_MACROS, *_MX))))
KERNEL_VARIANTS = (*QPNMX_LINEAR.values(), QPNMX_PREPACK, QPNMX_DEQUANTIZE)  # its GEMM builds: gemm.QPNMX_GEMM


def qpnmx_prepack(blocks: CupyArray, scales: CupyArray) -> tuple[CupyArray, CupyArray, CupyArray]:
    """gpt-oss's (blocks uint8 [N, K/32, 16], scales uint8 [N, K/32]) on the GPU -> QPNMX (codes, scales,
    tile_scale), qpn.ref.mxfp4.qpnmx_prepack's bytes; one host sync (the NaN flag: load time only)."""
    import cupy  # noqa: PLC0415

    require_cupy("blocks", blocks, np.uint8, ndim=3)
    require_cupy("scales", scales, np.uint8, ndim=2)
    n, k = blocks.shape[0], 32 * blocks.shape[1]
    QPNMX.require_dims(n, k, f"blocks has shape {tuple(blocks.shape)}", f"K = 32 * blocks.shape[1] = {k}")
    require_shape("scales", scales, (n, k // 32))
    require_aligned("blocks", blocks)  # 16-byte loads
    out = tuple(cupy.empty(b.shape(n, k), dtype=b.dtype) for b in QPNMX.buffers)
    run_qpnmx_prepack(blocks, scales, *out)
    return out


def run_qpnmx_prepack(blocks: CupyArray, scales: CupyArray, codes: CupyArray, packed_scales: CupyArray,
                      tile_scale: CupyArray) -> None:
    """Launch into the QPNMX buffers (validated arguments), then read the NaN flag back (one sync per
    prepack, at load time) and raise the reference's error if it is set."""
    import cupy  # noqa: PLC0415

    n, k = blocks.shape[0], 32 * blocks.shape[1]
    flags = cupy.zeros(1, dtype=cupy.int32)
    launch_qpn2_prepack(blocks.reshape(n, k // 2), scales, codes, packed_scales, flags, QPNMX_PREPACK)
    if int(flags.get()[0]):
        from ..ref.mxfp4 import qpnmx_prepack as reference  # noqa: PLC0415

        reference(blocks.get(), scales.get())  # raises the reference's ValueError for the first 0xFF byte
        raise RuntimeError("qpn internal error: the GPU flagged an e8m0 NaN byte the reference did not find")
    # tile_scale = 2^T, T = the tile's largest e8m0 exponent - W16_TOP_EXP (qpn.ref.mxfp4.mxfp4_tile_exponents)
    top = scales.reshape(n // 32, -1).max(axis=1).astype(np.int32) - E8M0_BIAS - W16_TOP_EXP
    tile_scale[...] = cupy.ldexp(cupy.float32(1.0), top).astype(np.float32)


def _require_buffers(codes: CupyArray, scales: CupyArray, tile_scale: CupyArray, n: int, k: int) -> None:
    require_packed(QPNMX, "codes", codes, n, k)
    require_packed(QPNMX, "scales", scales, n, k)
    require_cupy("tile_scale", tile_scale, np.float32, ndim=1)
    require_shape("tile_scale", tile_scale, QPNMX.buffer("tile_scale").shape(n, k))
    require_aligned("codes", codes, 8)  # 8-byte loads (the scale bytes load one at a time)


def qpnmx_dequantize(codes: CupyArray, scales: CupyArray, tile_scale: CupyArray, n: int, k: int,
                     out: CupyArray | None = None) -> CupyArray:
    """QPNMX buffers -> the reduced W16 fp16 [n, k] = RN16(e2m1 * 2^F) (= qpn.ref.mxfp4.mxfp4_w16's W16;
    the tiles' 2^T are tile_scale's). No value check (values are checked at prepack)."""
    n, k = QPNMX.require_int_dims(n, k)
    _require_buffers(codes, scales, tile_scale, n, k)
    out = output_array(out, (n, k), np.float16)
    launch_qpn2_dequantize(codes, scales, tile_scale, 1, out, n, k, QPNMX_DEQUANTIZE)
    return out


def qpnmx_linear(x: CupyArray, codes: CupyArray, scales: CupyArray, tile_scale: CupyArray,
                 out: CupyArray | None = None, gated: bool = False, workspace: CupyArray | None = None) -> CupyArray:
    """y = x @ (2^T W16)^T for a QPNMX (MXFP4) weight, M in [1, 32] (module docstring): x fp16 [M, K],
    K % 64 == 0; returns fp16 [M, N] ([M, N/2] = silu_and_mul(gate, up) when gated). workspace: optional
    float32 CuPy array for split-K layers (linear.decode_workspace_size("mxfp4", ...))."""
    decode_activation(x, QPNMX, "qpnmx_gemm_linear")
    n, y = _weight_and_output(codes, scales, tile_scale, x, out, gated)
    launch_qpnmx_decode(x, codes, scales, tile_scale, n, y, gated, workspace)
    return y


def qpnmx_gemm_linear(x: CupyArray, codes: CupyArray, scales: CupyArray, tile_scale: CupyArray,
                      out: CupyArray | None = None, gated: bool = False, workspace: CupyArray | None = None
                      ) -> CupyArray:
    """As qpnmx_linear, any M >= 1 (the GEMM build: gemm.py), workspace by gemm_workspace_size("mxfp4", ...)."""
    gemm_activation(x, QPNMX)
    n, y = _weight_and_output(codes, scales, tile_scale, x, out, gated)
    launch_qpnmx_gemm(x, codes, scales, tile_scale, n, y, gated, workspace)
    return y


def _weight_and_output(codes: CupyArray, scales: CupyArray, tile_scale: CupyArray, x: CupyArray,
                       out: CupyArray | None, gated: bool) -> tuple[int, CupyArray]:
    """N of the validated buffers, and the output of x's dtype (`out` validated, or a fresh one)."""
    m, k = x.shape
    n = rows_of_codes(codes, k, QPNMX.code_bits / 8)
    n, k = QPNMX.require_int_dims(n, k)
    _require_buffers(codes, scales, tile_scale, n, k)
    return n, output_array(out, (m, gated_rows(n, gated)), x.dtype)


def launch_qpnmx_gemm(x: CupyArray, codes: CupyArray, scales: CupyArray, tile_scale: CupyArray, n: int,
                      y: CupyArray, gated: bool, workspace: CupyArray | None) -> None:
    launch_gemm(QPN2, gemm_variant(QPNMX, gated, x.shape[0], n), (codes, scales, tile_scale, np.int32(1)), x, y,
                n, gated, workspace)


def launch_qpnmx_decode(x: CupyArray, codes: CupyArray, scales: CupyArray, tile_scale: CupyArray, n: int,
                        y: CupyArray, gated: bool, workspace: CupyArray | None) -> None:
    nb = -(-x.shape[0] // TOKENS_PER_BLOCK)
    variant = QPNMX_LINEAR[nb, bool(gated)]
    launch_decode(QPNMX, kernel(variant), (codes, scales, tile_scale, np.int32(1)), x, y, n, gated, workspace,
                  X_FRAG[QPN2.key, nb], variant.defines)
