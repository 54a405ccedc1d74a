"""qpn.torch_bridge: NVFP4 / FP8 weight-only linears for PyTorch (and, in vllm*.py, vLLM).

Importing this package registers the `torch.ops.qpn.*` custom ops (ops.py): prepack,
dequantize and linear for NVFP4 (QPN2 layout) and FP8 (QPN8 layout), each with a CPU kernel
(numba) and a CUDA kernel (CuPy over DLPack, imported lazily), and a fake kernel for
torch.compile. On top of them: `QPNLinear` (module.py), `convert` / `load_quantized`
(convert.py), and the packing helpers `pack_nvfp4` / `pack_fp8` / `qpn_linear` that the vLLM
linear method builds on.
"""

from .convert import LoadReport, convert, load_quantized
from .epilogue import silu_and_mul
from .module import PackedWeight, QPNLinear, pack_fp8, pack_nvfp4, qpn_linear
from .ops import fp8_dequantize, fp8_linear, fp8_prepack, nvfp4_dequantize, nvfp4_linear, nvfp4_prepack
