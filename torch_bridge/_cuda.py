"""CUDA backend of the qpn ops: torch tensors -> CuPy views (DLPack, zero copy) -> qpn.cupy_kernels.

Imported by ops.py only when a CUDA tensor reaches an op; CuPy and qpn.cupy_kernels are
imported inside the functions, so `import qpn.torch_bridge` works without them.

Discipline (docs/STYLE.md, item 9), in this order for every call:
1. ops.py has validated dtype, shape, device and contiguity of every tensor (metadata only:
   nothing here synchronizes the GPU);
2. outputs are allocated with torch (the caching allocator: stream-ordered, and taken from the
   graph's private pool under CUDA-graph capture);
3. inside `_on_torch_stream` - torch's and CuPy's current device = the tensors' device, CuPy's
   current stream = torch's current stream, wrapped as `cupy.cuda.ExternalStream` - each tensor
   is converted with `cupy.from_dlpack` (zero copy), and the kernels launch on that stream,
   writing into the torch outputs (`out=`).

   Stream handshake: CuPy hands its current stream to the exporter's `__dlpack__`, and torch
   then compares it with its current stream. The two are the same cudaStream_t, but torch
   gives an ExternalStream a different stream id than its pool stream, so it would record an
   event and make the stream wait on itself - a few microseconds per tensor and extra nodes in
   a captured graph. `_SameStream` therefore exports with `stream=-1` (DLPack's "consumer
   uses the producer's stream, no synchronization"), which is the truth here by construction.

Linear, three tiers by M (thresholds measured, host arithmetic: safe under graph capture):
M <= `qpn.cupy_kernels.decode_threshold(fmt, N, K)` (32, the decode kernels' range) runs the
decode kernel; M <= `gemm_threshold(fmt, N, K)` the fused-dequantize GEMM (cupy_kernels/gemm.py);
larger M dequantizes the whole weight into a per-call fp16 [N, K] torch tensor and multiplies
with torch:

    y = RN16(torch.mm(x, W16^T, out_dtype=float32))

Why torch's cuBLAS and not CuPy's dense wrapper: the fp16 workspace and the GEMM then live on
torch's allocator and torch's cuBLAS handle/workspace for the current stream, which torch
already makes safe under CUDA-graph capture and across streams; and `out_dtype=float32` makes
cuBLAS accumulate AND reduce (split-K included) in fp32 whatever
`torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction` says - a plain fp16
F.linear may reduce split-K partials in fp16 when that flag is on (its default). Without
`mm(out_dtype=)` (torch < 2.8) both operands are upcast to fp32 instead: fp16 values are exact
in fp32 and in TF32 (10 explicit mantissa bits either way), so products stay exact and the sum
is fp32. The gated epilogue is epilogue.silu_and_mul (torch fp32 expf, as the decode kernels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..ref.formats import QPN2, QPN8, WeightFormat
from ..ref.qpn8 import qpn8_scale_granularity
from .epilogue import silu_and_mul

if TYPE_CHECKING:  # annotations only: importing qpn.cupy_kernels at run time waits for the first CUDA call
    from typing import TypeAlias

    from ..cupy_kernels._validate import CupyArray

    # as_cupy: a torch tensor -> its zero-copy CuPy view on torch's current stream (_on_torch_stream)
    AsCupy: TypeAlias = Callable[[Tensor], CupyArray]

_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # aten::mm.dtype (torch >= 2.8)


def _kernels() -> ModuleType:
    from .. import cupy_kernels as kernels  # imports CuPy

    return kernels


def decode_threshold(fmt: str, n: int, k: int) -> int:
    """Largest M that runs the decode kernel for an [N, K] weight of format "nvfp4" | "fp8"
    (qpn.cupy_kernels.decode_threshold, chosen by measurement; host arithmetic only)."""
    return _kernels().decode_threshold(fmt, n, k)


def gemm_threshold(fmt: str, n: int, k: int) -> int:
    """Largest M that runs the fused-dequantize GEMM on the current device (above: dequantize +
    cuBLAS; qpn.cupy_kernels.gemm.gemm_threshold, from the measured crossover)."""
    return _kernels().gemm.gemm_threshold(fmt, n, k)


@contextlib.contextmanager
def _on_torch_stream(device: torch.device) -> Iterator[AsCupy]:
    """torch's and CuPy's current device = `device`; CuPy's current stream = torch's current stream.

    Yields `as_cupy(tensor)`, the zero-copy CuPy view of a torch tensor on that stream.
    """
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):  # torch's __dlpack__ refuses tensors of another current device
        stream = torch.cuda.current_stream(index)
        with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
            yield lambda tensor: cupy.from_dlpack(_SameStream(tensor))


class _SameStream:
    """A torch tensor as a DLPack producer for a consumer on torch's current stream (module
    docstring): `__dlpack__` ignores the consumer's stream argument and exports with stream=-1."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream: object = None, **kwargs: Any) -> Any:
        return self.tensor.__dlpack__(stream=-1, **kwargs)


def _empty(wf: WeightFormat, name: str, n: int, k: int, device: torch.device) -> Tensor:
    """A torch tensor for packed buffer `name` of `wf` (shape and dtype: the description's)."""
    buffer = wf.buffer(name)
    return torch.empty(buffer.shape(n, k), dtype=getattr(torch, buffer.dtype.name), device=device)


def _mm_rn16(x: Tensor, w16: Tensor) -> Tensor:
    """RN16(x @ w16^T) with fp32 accumulation and reduction (module docstring)."""
    if _HAS_MM_OUT_DTYPE:
        return torch.mm(x, w16.t(), out_dtype=torch.float32).to(torch.float16)
    return torch.mm(x.float(), w16.float().t()).to(torch.float16)


# ----------------------------------------------------------------------------- prepack


def nvfp4_prepack(weight_packed: Tensor, weight_scale_u8: Tensor, n: int, k: int) -> tuple[Tensor, Tensor]:
    """QPN2 prepack on the device. The CuPy wrapper allocates its results; they are copied into
    torch-owned tensors on the same stream (prepack runs once per layer, the copy is cheap).
    ops.py validated the tensors: the CuPy wrappers' *_trusted entries do not validate them again."""
    kernels = _kernels()
    codes = _empty(QPN2, "codes", n, k, weight_packed.device)
    scales = _empty(QPN2, "scales", n, k, weight_packed.device)
    with _on_torch_stream(weight_packed.device) as as_cupy:
        codes_cp, scales_cp = kernels.prepack.qpn2_prepack_trusted(as_cupy(weight_packed), as_cupy(weight_scale_u8))
        as_cupy(codes).reshape(-1)[...] = codes_cp.reshape(-1)
        as_cupy(scales).reshape(-1)[...] = scales_cp.reshape(-1)
        del codes_cp, scales_cp
    return codes, scales


def fp8_prepack(weight_u8: Tensor, weight_scale: Tensor, n: int, k: int,
                group_scales_shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    kernels = _kernels()
    codes = _empty(QPN8, "codes", n, k, weight_u8.device)
    group_scales = torch.empty(group_scales_shape, dtype=torch.float16, device=weight_u8.device)
    granularity = qpn8_scale_granularity(weight_scale, n, k)  # the shape rule ops.py applied (metadata only)
    with _on_torch_stream(weight_u8.device) as as_cupy:
        codes_cp, group_scales_cp = kernels.prepack.qpn8_prepack_trusted(as_cupy(weight_u8), as_cupy(weight_scale),
                                                                         granularity)
        as_cupy(codes).reshape(-1)[...] = codes_cp.reshape(-1)
        as_cupy(group_scales)[...] = group_scales_cp.reshape(group_scales_shape)
        del codes_cp, group_scales_cp
    return codes, group_scales


# ----------------------------------------------------------------------------- dequantize
# check=False: no validation kernel, no host sync (values were validated once at pack time,
# see module.py); a checked call would read a flag back and could not run under graph capture.


def nvfp4_dequantize(codes: Tensor, scales: Tensor, global_scale: Tensor, n: int, k: int) -> Tensor:
    kernels = _kernels()
    w16 = torch.empty((n, k), dtype=torch.float16, device=codes.device)
    with _on_torch_stream(codes.device) as as_cupy:
        kernels.dequantize.qpn2_dequantize_trusted(as_cupy(codes), as_cupy(scales),
                                                   as_cupy(global_scale.reshape(-1)), n, k, as_cupy(w16))
    return w16


def fp8_dequantize(codes: Tensor, group_scales: Tensor, n: int, k: int) -> Tensor:
    kernels = _kernels()
    w16 = torch.empty((n, k), dtype=torch.float16, device=codes.device)
    with _on_torch_stream(codes.device) as as_cupy:
        kernels.dequantize.qpn8_dequantize_trusted(as_cupy(codes), as_cupy(group_scales), n, k, as_cupy(w16))
    return w16


# ----------------------------------------------------------------------------- linear


def _fused(wf: WeightFormat, x: Tensor, n: int, k: int, n_out: int, gated: bool, gemm: bool,
           launch: Callable[..., None]) -> Tensor:
    """A decode kernel's or the GEMM's call: output and workspace (x fragments, split-K state) from
    torch's allocator (graph-safe). `launch` calls the CuPy wrapper's *_trusted entry: ops.py
    validated the arguments."""
    kernels = _kernels()
    m = x.shape[0]
    out = torch.empty((m, n_out), dtype=torch.float16, device=x.device)
    workspace_size = kernels.gemm.gemm_workspace_size if gemm else kernels.decode_workspace_size
    with _on_torch_stream(x.device) as as_cupy:
        size = workspace_size(wf.key, m, n, k, gated)  # the split depends on x's device
        workspace = as_cupy(torch.empty(size, dtype=torch.float32, device=x.device)) if size else None
        launch(kernels, as_cupy, out=as_cupy(out), gated=gated, workspace=workspace)
    return out


def nvfp4_linear(x: Tensor, codes: Tensor, scales: Tensor, global_scale: Tensor,
                 n: int, k: int, n_out: int, gated: bool) -> Tensor:
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, n_out))
    if m <= gemm_threshold(QPN2.format, n, k):
        gemm = m > decode_threshold(QPN2.format, n, k)

        def launch(kernels: ModuleType, as_cupy: AsCupy, **kw: Any) -> None:
            entry = kernels.gemm.qpn2_gemm_trusted if gemm else kernels.linear.qpn2_linear_trusted
            entry(as_cupy(x), as_cupy(codes), as_cupy(scales), as_cupy(global_scale.reshape(-1)), n, **kw)

        return _fused(QPN2, x, n, k, n_out, gated, gemm, launch)
    y = _mm_rn16(x, nvfp4_dequantize(codes, scales, global_scale, n, k))
    return silu_and_mul(y) if gated else y


def fp8_linear(x: Tensor, codes: Tensor, group_scales: Tensor, n: int, k: int, n_out: int, gated: bool) -> Tensor:
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, n_out))
    if m <= gemm_threshold(QPN8.format, n, k):
        gemm = m > decode_threshold(QPN8.format, n, k)

        def launch(kernels: ModuleType, as_cupy: AsCupy, **kw: Any) -> None:
            entry = kernels.gemm.qpn8_gemm_trusted if gemm else kernels.linear.qpn8_linear_trusted
            entry(as_cupy(x), as_cupy(codes), as_cupy(group_scales), n, **kw)

        return _fused(QPN8, x, n, k, n_out, gated, gemm, launch)
    y = _mm_rn16(x, fp8_dequantize(codes, group_scales, n, k))
    return silu_and_mul(y) if gated else y
