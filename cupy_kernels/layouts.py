"""The CUDA backend of each packed layout: one object per kernel family (QPN2, QPN8) with the launches
the torch ops make, so the op's CUDA side (torch_bridge/_cuda.py) never asks which format it runs.

A layout's buffers travel as a tuple in its description's order (ref/formats.py `buffers`: QPN2 codes,
scales, global_scale; QPN8 codes, group_scales), sources as the checkpoint tensors prepack takes. The
caller validated everything a tensor's metadata shows (dtype, shape, the layout's multiples, device,
contiguity, M and gated rules: torch_bridge/ops.py, once per call); each launch here checks only what
metadata cannot show, the alignment of the device addresses, and launches on the current CuPy stream.
The validating CuPy API (qpn2_linear, qpn8_dequantize, ...) and these launches end in the same launch
functions: one path per operation.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..ref.formats import QPN2, QPN8, QPN8_BLOCK, QPNMX, WeightFormat
from ..ref.qpn8 import qpn8_group_scales_format
from ._validate import CupyArray, global_scale_stride, require_aligned
from .dequantize import (
    launch_qpn2_dequantize,
    launch_qpn8_dequantize,
    qpn8_strides,
    require_qpn2_aligned,
    require_qpn8_aligned,
)
from .gemm import gemm_workspace_size, launch_qpn2_gemm, launch_qpn8_gemm
from .linear import (
    decode_workspace_size,
    launch_qpn2_decode,
    launch_qpn8_decode,
    require_group_scales_aligned,
    require_x_aligned,
)
from .mxfp4 import QPNMX_DEQUANTIZE, launch_qpnmx_decode, launch_qpnmx_gemm, run_qpnmx_prepack
from .prepack import require_qpn2_prepack_aligned, run_qpn2_prepack, run_qpn8_prepack

Buffers = tuple[CupyArray, ...]


class LayoutKernels:
    """The launches of one layout (module docstring). `family` is the layout's kernel family."""

    family: WeightFormat

    def prepack(self, sources: Buffers, granularity: str | None, out: Buffers) -> None:
        """Checkpoint tensors -> the packed buffers `out` (fresh, the description's shapes); raises
        the reference's ValueError on a bad value (one host sync: load time only)."""
        raise NotImplementedError

    def dequantize(self, buffers: Buffers, n: int, k: int, out: CupyArray) -> None:
        """W16 into `out` (fp16 [N, K]); no value check, no sync (values were checked at prepack)."""
        raise NotImplementedError

    def decode(self, x: CupyArray, buffers: Buffers, n: int, out: CupyArray, gated: bool,
               workspace: CupyArray | None) -> None:
        """The decode kernel (M in [1, 32]) into `out`."""
        self._linear(self._decode, x, buffers, n, out, gated, workspace)

    def gemm(self, x: CupyArray, buffers: Buffers, n: int, out: CupyArray, gated: bool,
             workspace: CupyArray | None) -> None:
        """The fused-dequantize GEMM (any M) into `out`."""
        self._linear(self._gemm, x, buffers, n, out, gated, workspace)

    # the layout's launch functions of the two builds (linear.py / gemm.py), same arguments
    _decode: Callable[..., None]
    _gemm: Callable[..., None]

    def _linear(self, launch: Callable[..., None], x: CupyArray, buffers: Buffers, n: int, out: CupyArray,
                gated: bool, workspace: CupyArray | None) -> None:
        raise NotImplementedError

    def expert_weights(self, buffers: Buffers, n: int, k: int) -> tuple[WeightFormat, tuple[object, ...], int]:
        """Stacked experts' buffers ([E, ...], each expert an [N, K] weight of this layout) -> (the layout of
        the build, the decode kernel's leading arguments, the scale buffer's per-expert stride in elements)
        for the MoE builds (moe.py); the codes' and NVFP4 scales' strides follow from N and K."""
        raise NotImplementedError

    def workspace_size(self, path: str, m: int, n: int, k: int, gated: bool, bf16: bool = False) -> int:
        """fp32 elements of the workspace a "decode" or "gemm" call needs (0: none); bf16: x is bf16."""
        size = decode_workspace_size if path == "decode" else gemm_workspace_size
        return size(self.family.format, m, n, k, gated, bf16)


class _QPN2Kernels(LayoutKernels):
    family = QPN2

    def prepack(self, sources: Buffers, granularity: str | None, out: Buffers) -> None:
        weight_packed, weight_scale = sources
        require_qpn2_prepack_aligned(weight_packed, weight_scale)
        run_qpn2_prepack(weight_packed, weight_scale, *out)

    def dequantize(self, buffers: Buffers, n: int, k: int, out: CupyArray) -> None:
        codes, scales, g = buffers
        require_qpn2_aligned(codes, scales)
        launch_qpn2_dequantize(codes, scales, g, global_scale_stride(g), out, n, k)

    def expert_weights(self, buffers: Buffers, n: int, k: int) -> tuple[WeightFormat, tuple[object, ...], int]:
        codes, scales, g = buffers
        require_qpn2_aligned(codes, scales)
        return QPN2, (codes, scales, g, np.int32(global_scale_stride(g[0]))), int(g[0].size)

    _decode, _gemm = staticmethod(launch_qpn2_decode), staticmethod(launch_qpn2_gemm)

    def _linear(self, launch: Callable[..., None], x: CupyArray, buffers: Buffers, n: int, out: CupyArray,
                gated: bool, workspace: CupyArray | None) -> None:
        codes, scales, g = buffers
        require_x_aligned(x)
        require_qpn2_aligned(codes, scales)
        launch(x, codes, scales, g, global_scale_stride(g), n, out, gated, workspace)


class _QPN8Kernels(LayoutKernels):
    """Channel / tensor and 128x128 block scales: the group scales' shape says which (host arithmetic)."""

    family = QPN8

    def prepack(self, sources: Buffers, granularity: str | None, out: Buffers) -> None:
        weight, weight_scale = sources
        require_aligned("weight", weight)  # 16-byte loads
        run_qpn8_prepack(weight, weight_scale, granularity or "channel", *out)

    def _aligned(self, codes: CupyArray, group_scales: CupyArray, n: int, k: int) -> WeightFormat:
        wf = qpn8_group_scales_format(group_scales.shape, n, k)
        require_qpn8_aligned(codes)
        require_group_scales_aligned(group_scales, wf)
        return wf

    def dequantize(self, buffers: Buffers, n: int, k: int, out: CupyArray) -> None:
        codes, group_scales = buffers
        wf = self._aligned(codes, group_scales, n, k)
        launch_qpn8_dequantize(codes, group_scales, qpn8_strides(wf, n), out, n, k)

    def expert_weights(self, buffers: Buffers, n: int, k: int) -> tuple[WeightFormat, tuple[object, ...], int]:
        codes, group_scales = buffers
        wf = self._aligned(codes, group_scales[0], n, k)
        return wf, (codes, group_scales, np.int32(qpn8_strides(wf, n)[0])), int(group_scales[0].size)

    _decode, _gemm = staticmethod(launch_qpn8_decode), staticmethod(launch_qpn8_gemm)

    def _linear(self, launch: Callable[..., None], x: CupyArray, buffers: Buffers, n: int, out: CupyArray,
                gated: bool, workspace: CupyArray | None) -> None:
        codes, group_scales = buffers
        require_x_aligned(x)
        wf = self._aligned(codes, group_scales, n, x.shape[1])
        launch(x, codes, group_scales, wf, n, out, gated, workspace)


class _QPNMXKernels(LayoutKernels):
    """MXFP4: QPN2's kernels built with QPN_MX (cupy_kernels/mxfp4.py); the tiles' 2^T are the third buffer."""

    family = QPNMX

    def prepack(self, sources: Buffers, granularity: str | None, out: Buffers) -> None:
        blocks, scales = sources
        require_aligned("blocks", blocks)  # 16-byte loads
        run_qpnmx_prepack(blocks, scales, *out)

    def dequantize(self, buffers: Buffers, n: int, k: int, out: CupyArray) -> None:
        codes, scales, tile_scale = buffers
        require_aligned("codes", codes, 8)
        launch_qpn2_dequantize(codes, scales, tile_scale, 1, out, n, k, QPNMX_DEQUANTIZE)

    def expert_weights(self, buffers: Buffers, n: int, k: int) -> tuple[WeightFormat, tuple[object, ...], int]:
        codes, scales, tile_scale = buffers
        require_aligned("codes", codes, 8)
        return QPNMX, (codes, scales, tile_scale, np.int32(1)), int(tile_scale[0].size)

    _decode, _gemm = staticmethod(launch_qpnmx_decode), staticmethod(launch_qpnmx_gemm)

    def _linear(self, launch: Callable[..., None], x: CupyArray, buffers: Buffers, n: int, out: CupyArray,
                gated: bool, workspace: CupyArray | None) -> None:
        codes, scales, tile_scale = buffers
        require_x_aligned(x)
        require_aligned("codes", codes, 8)
        launch(x, codes, scales, tile_scale, n, out, gated, workspace)


_QPN2_KERNELS, _QPN8_KERNELS, _QPNMX_KERNELS = _QPN2Kernels(), _QPN8Kernels(), _QPNMXKernels()
LAYOUT_KERNELS = {QPN2.key: _QPN2_KERNELS, QPN8.key: _QPN8_KERNELS, QPN8_BLOCK.key: _QPN8_KERNELS,
                  QPNMX.key: _QPNMX_KERNELS}


def layout_kernels(wf: WeightFormat) -> LayoutKernels:
    """The CUDA launches of layout `wf`."""
    return LAYOUT_KERNELS[wf.key]
