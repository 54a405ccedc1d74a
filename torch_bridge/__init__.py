"""qpn.torch_bridge: NVFP4 / FP8 weight-only linears and mixtures of experts for PyTorch (and, in the
vllm/ package, vLLM).

Importing this package registers the `torch.ops.qpn.*` custom ops (ops.py): prepack,
dequantize and linear for NVFP4 (QPN2 layout) and FP8 (QPN8 layout), each with a CPU kernel
(numba) and a CUDA kernel (CuPy over DLPack, imported lazily), and a fake kernel for
torch.compile. On top of them: one object per packed weight (packed_weight.py: `PackedWeight`,
one class per layout, built by `pack_nvfp4` / `pack_fp8` / `PackedWeight.from_checkpoint`), which
`QPNLinear` (module.py), `qpn_linear`, `convert` / `load_quantized` (convert.py) and the vLLM
method hold and call; the path each call takes is dispatch.py's. The MoE ops
`torch.ops.qpn.{nvfp4,fp8}_moe` (moe_ops.py) run stacked experts (`PackedExperts`, packed_experts.py),
which `QPNExperts` (experts.py) puts into transformers' MoE blocks and the vLLM MoE method holds.
"""

from .convert import LoadReport, convert, load_quantized
from .epilogue import silu_and_mul
from .module import QPNLinear, qpn_linear
from .moe_ops import fp8_moe, nvfp4_moe
from .ops import fp8_dequantize, fp8_linear, fp8_prepack, nvfp4_dequantize, nvfp4_linear, nvfp4_prepack
from .packed_experts import PackedExperts
from .packed_weight import (
    PackedWeight,
    QPN2Weight,
    QPN8BlockWeight,
    QPN8Weight,
    pack_fp8,
    pack_nvfp4,
    packed_weight_class,
)
