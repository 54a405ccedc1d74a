"""MXFP4 on the GPU (issue 23): the decode kernels' QPNMX build, y = x @ (2^T W16)^T for M in [1, 32].

- `qpnmx_linear(x, codes, scales, tile_scale, out=None, gated=False, workspace=None)`

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

from ..ref.formats import QPNMX
from ._validate import CupyArray, output_array, require_aligned, require_cupy, require_packed, require_shape
from .linear import FALLBACK_STACK_BYTES, MAX_M, X_FRAG, _activation, _launch, decode_macros
from .loader import kernel
from .variants import KernelVariant
from .workspace import TOKENS_PER_BLOCK, gated_rows, rows_of_codes

QPNMX_LINEAR = {
    (nb, gated): KernelVariant("qpn2_linear.cu", "qpn2_linear", decode_macros(QPNMX.key, nb, gated),
                               archs=("sm_75",), max_stack_bytes=FALLBACK_STACK_BYTES)
    for gated in (False, True)
    for nb in range(1, MAX_M // TOKENS_PER_BLOCK + 1)
}
KERNEL_VARIANTS = tuple(QPNMX_LINEAR.values())


def qpnmx_linear(x: CupyArray, codes: CupyArray, scales: CupyArray, tile_scale: CupyArray,
                 out: CupyArray | None = None, gated: bool = False, workspace: CupyArray | None = None) -> CupyArray:
    """y = x @ (2^T W16)^T for a QPNMX (MXFP4) weight, M in [1, 32] (module docstring): x fp16 [M, K],
    K % 64 == 0; returns fp16 [M, N] ([M, N/2] = silu_and_mul(gate, up) when gated). workspace: optional
    float32 CuPy array for split-K layers (linear.decode_workspace_size("mxfp4", ...))."""
    m, k = _activation(x, QPNMX, "dequantize + cuBLAS")
    n = rows_of_codes(codes, k, QPNMX.code_bits / 8)
    n, k = QPNMX.require_int_dims(n, k)
    require_packed(QPNMX, "codes", codes, n, k)
    require_packed(QPNMX, "scales", scales, n, k)
    require_cupy("tile_scale", tile_scale, np.float32, ndim=1)
    require_shape("tile_scale", tile_scale, QPNMX.buffer("tile_scale").shape(n, k))
    require_aligned("codes", codes, 8)  # 8-byte loads (the scale bytes load one at a time)
    y = output_array(out, (m, gated_rows(n, gated)), np.float16)
    launch_qpnmx_decode(x, codes, scales, tile_scale, n, y, gated, workspace)
    return y


def launch_qpnmx_decode(x: CupyArray, codes: CupyArray, scales: CupyArray, tile_scale: CupyArray, n: int,
                        y: CupyArray, gated: bool, workspace: CupyArray | None) -> None:
    nb = -(-x.shape[0] // TOKENS_PER_BLOCK)
    fn = kernel(QPNMX_LINEAR[nb, bool(gated)])
    _launch(QPNMX, fn, (codes, scales, tile_scale, np.int32(1)), x, y, n, gated, workspace, X_FRAG["qpn2", nb])
