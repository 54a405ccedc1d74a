"""qpn.cupy_kernels: sm_75 CUDA kernels (real .cu files, NVRTC through CuPy) and their launch wrappers.

Importing this package needs neither CuPy nor a GPU (CI imports it); CuPy is imported inside
the functions. Build pipeline: `loader` (options, arch, caches), `variants` (the registry of
launched kernels), `compile_check` (CPU-only Turing check, `python -m qpn.cupy_kernels.compile_check`).

Public functions (CuPy arrays in and out, launched on the current CuPy stream):
- `qpn2_prepack(weight_packed, weight_scale) -> (codes, scales)`
- `qpn8_prepack(weight, weight_scale, granularity=None) -> (codes, group_scales)`
- `qpn2_dequantize(codes, scales, global_scale, n, k, out=None, check=True) -> fp16 [n, k]`
- `qpn8_dequantize(codes, group_scales, n, k, out=None, check=True) -> fp16 [n, k]`
- `qpn2_dense_linear(x, codes, scales, global_scale, out=None, workspace=None, check=False)`
- `qpn8_dense_linear(x, codes, group_scales, out=None, workspace=None, check=False)`
- `qpn2_linear(x, codes, scales, global_scale, out=None, gated=False, workspace=None)`,
  `qpn8_linear(...)`: the decode kernels, M in [1, 32]; `decode_threshold(format, n, k)`: the largest
  M they take (which path serves an M is torch_bridge/dispatch.py's); `decode_workspace_size(format, m,
  n, k, gated)`: fp32 elements of the split-K workspace a call needs (0: none), for callers that
  allocate it themselves
- `qpn2_gemm_linear(...)`, `qpn8_gemm_linear(...)`: the fused-dequantize GEMM (the decode kernels'
  GEMM build), any M, built for 33-512; `gemm_threshold(format, n, k)`: the largest M it serves on the
  current device where no measured dispatch table covers the shape; `gemm_workspace_size(format, m, n,
  k, gated)` (format: "nvfp4" | "fp8", as everywhere)
- MXFP4 (QPN2's kernels built for QPNMX buffers: docs/QPNMX.md): `qpnmx_prepack(blocks, scales)`,
  `qpnmx_dequantize(codes, scales, tile_scale, n, k, out=None)` (the reduced W16), `qpnmx_linear(x, codes,
  scales, tile_scale, out=None, gated=False, workspace=None)` (M in [1, 32]), `qpnmx_gemm_linear(...)`
"""

from .dense import qpn2_dense_linear, qpn8_dense_linear
from .dequantize import qpn2_dequantize, qpn8_dequantize
from .gemm import gemm_threshold, gemm_workspace_size, qpn2_gemm_linear, qpn8_gemm_linear
from .linear import decode_threshold, decode_workspace_size, qpn2_linear, qpn8_linear
from .loader import get_function
from .mxfp4 import qpnmx_dequantize, qpnmx_gemm_linear, qpnmx_linear, qpnmx_prepack
from .prepack import qpn2_prepack, qpn8_prepack
