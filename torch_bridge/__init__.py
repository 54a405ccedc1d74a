"""qpn.torch_bridge: NVFP4 / FP8 / MXFP4 weight-only linears and mixtures of experts for PyTorch (and, in the
vllm/ package, vLLM).

Importing this package registers the `torch.ops.qpn.*` custom ops (ops.py): prepack,
dequantize and linear for NVFP4 (QPN2 layout), FP8 (QPN8 layout) and MXFP4 (QPNMX), each with a CPU kernel
(numba) and a CUDA kernel (CuPy over DLPack, imported lazily), and a fake kernel for
torch.compile. On top of them: one object per packed weight (packed_weight.py: `PackedWeight`,
one class per layout, built by `pack_nvfp4` / `pack_fp8` / `pack_mxfp4` / `PackedWeight.from_checkpoint`), which
`QPNLinear` (module.py), `qpn_linear`, `convert` / `load_quantized` (convert.py) and the vLLM
method hold and call; the path each call takes is dispatch.py's. The MoE ops
`torch.ops.qpn.{nvfp4,fp8,mxfp4}_moe` (moe_ops.py) run stacked experts (`PackedExperts`, packed_experts.py;
gpt-oss's with biases and its clamped SwiGLU), which `QPNExperts` (experts.py) puts into transformers' MoE
blocks and the vLLM MoE methods hold.
"""

from .convert import LoadReport, convert, load_quantized
from .epilogue import silu_and_mul
from .module import QPNLinear, qpn_linear
from .moe_ops import fp8_moe, mxfp4_moe, nvfp4_moe
from .ops import (
    fp8_dequantize,
    fp8_linear,
    fp8_prepack,
    mxfp4_dequantize,
    mxfp4_linear,
    mxfp4_prepack,
    nvfp4_dequantize,
    nvfp4_linear,
    nvfp4_prepack,
)
from .packed_experts import PackedExperts
from .packed_weight import (
    PackedWeight,
    QPN2Weight,
    QPN8BlockWeight,
    QPN8Weight,
    QPNMXWeight,
    pack_fp8,
    pack_mxfp4,
    pack_nvfp4,
    packed_weight_class,
)
