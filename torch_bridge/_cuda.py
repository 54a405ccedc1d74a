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

Every function takes the layout's description and its buffers as a tuple in the description's
order; the launches are the layout's (qpn.cupy_kernels.layouts), so nothing here asks which format
it runs. Linear: the path (decode kernel, fused-dequantize GEMM, or dense) is dispatch.choose's,
from the measured table of the device family (host arithmetic: safe under graph capture). Dense
dequantizes the whole weight into a per-call fp16 [N, K] torch tensor and multiplies with torch:

    y = RN16(torch.mm(x, W16^T, out_dtype=float32))      (MXFP4: each column times its tile's 2^T first)

Why torch's cuBLAS and not CuPy's dense wrapper: the fp16 workspace and the GEMM then live on
torch's allocator and torch's cuBLAS handle/workspace for the current stream, which torch
already makes safe under CUDA-graph capture and across streams; and `out_dtype=float32` makes
cuBLAS accumulate AND reduce (split-K included) in fp32 whatever
`torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction` says - a plain fp16
F.linear may reduce split-K partials in fp16 when that flag is on (its default). Without
`mm(out_dtype=)` (torch < 2.8) both operands are upcast to fp32 instead: fp16 values are exact
in fp32 and in TF32 (10 explicit mantissa bits either way), so products stay exact and the sum
is fp32. The gated epilogue is epilogue.silu_and_mul (torch fp32 expf, as the decode kernels).

bf16 x (docs/DESIGN.md, "bf16 activations", the Turing path) runs every path through fp16: one kernel
(cupy_kernels/x_bf16.cu) writes x16 = x * 2^e per row, exact wherever |x16| >= 2^-14, and the row's 2^-e;
the decode, GEMM and MoE kernels take x16 and multiply each fp32 sum by its row's 2^-e before one RN_bf16,
and the dense path does the same around torch's fp16 GEMM:

    y = RN_bf16(RN32(torch.mm(x16, W16^T, out_dtype=float32)) * 2^-e)   (MXFP4: times the tile's 2^T first)

bf16 tensors reach CuPy as their int16 bits (CuPy has no bfloat16: cupy_kernels/bf16.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..ref.formats import WeightFormat
from . import dispatch
from .buffers import column_scale, empty_buffer
from .epilogue import silu_and_mul

if TYPE_CHECKING:  # annotations only: importing qpn.cupy_kernels at run time waits for the first CUDA call
    from typing import TypeAlias

    from ..cupy_kernels._validate import CupyArray
    from ..cupy_kernels.layouts import LayoutKernels

    # as_cupy: a torch tensor -> its zero-copy CuPy view on torch's current stream (_on_torch_stream)
    AsCupy: TypeAlias = Callable[[Tensor], CupyArray]

_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # aten::mm.dtype (torch >= 2.8)


def _layout_kernels(wf: WeightFormat) -> LayoutKernels:
    from ..cupy_kernels.layouts import layout_kernels  # imports CuPy on the first launch

    return layout_kernels(wf)


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


def _mm_round(x: Tensor, w16: Tensor, scale: Tensor | None = None) -> Tensor:
    """RN16(x @ w16^T) with fp32 accumulation and reduction (module docstring); each column's sum times
    `scale` first where the layout has a column scale (buffers.column_scale: exact, a power of two).
    bf16 x: the sums of its fp16 rows times each row's 2^-e, RN_bf16 (module docstring)."""
    x16, factor = _fp16_rows(x) if x.dtype == torch.bfloat16 else (x, None)
    if _HAS_MM_OUT_DTYPE:
        y = torch.mm(x16, w16.t(), out_dtype=torch.float32)
    else:
        y = torch.mm(x16.float(), w16.float().t())
    if scale is not None:
        y = y * scale
    return (y if factor is None else y * factor[:, None]).to(x.dtype)


def _fp16_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """bf16 x [M, K] -> (x16 fp16 [M, K], factor fp32 [M]): x_bf16.cu's rows, on torch's allocator and stream."""
    from ..cupy_kernels.bf16 import bf16_rows_elements, bf16_rows_slices, queue_bf16_rows  # noqa: PLC0415

    m, k = x.shape
    workspace = torch.empty(bf16_rows_elements(m, k), dtype=torch.float32, device=x.device)
    with _on_torch_stream(x.device) as as_cupy:
        queue_bf16_rows(as_cupy(_bits(x)), as_cupy(workspace))
    rows, factors = bf16_rows_slices(m, k)
    return workspace[rows].view(torch.float16).view(m, k), workspace[factors]


def _bits(t: Tensor) -> Tensor:
    """The tensor CuPy gets: fp16 as it is, bf16 as its int16 bits (cupy_kernels/bf16.py)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# ----------------------------------------------------------------------------- prepack


def prepack(wf: WeightFormat, sources: tuple[Tensor, ...], granularity: str | None, n: int, k: int
            ) -> tuple[Tensor, ...]:
    """Checkpoint tensors (validated by ops.py; e4m3 as uint8) -> the packed buffers, torch-owned, written
    in place by the layout's kernels on torch's stream (a bad value: the reference's ValueError)."""
    out = tuple(empty_buffer(wf, b.name, n, k, sources[0].device) for b in wf.prepacked_buffers())
    with _on_torch_stream(sources[0].device) as as_cupy:
        _layout_kernels(wf).prepack(tuple(as_cupy(t) for t in sources), granularity,
                                    tuple(as_cupy(t) for t in out))
    return out


# ----------------------------------------------------------------------------- dequantize
# No value check and no host sync (values were validated once at pack time, packed_weight.py); a
# checked call would read a flag back and could not run under graph capture.


def dequantize(wf: WeightFormat, buffers: tuple[Tensor, ...], n: int, k: int) -> Tensor:
    w16 = torch.empty((n, k), dtype=torch.float16, device=buffers[0].device)
    with _on_torch_stream(buffers[0].device) as as_cupy:
        _layout_kernels(wf).dequantize(tuple(as_cupy(t) for t in buffers), n, k, as_cupy(w16))
    return w16


# ----------------------------------------------------------------------------- linear


def linear(wf: WeightFormat, x: Tensor, buffers: tuple[Tensor, ...], n: int, k: int, n_out: int,
           gated: bool) -> Tensor:
    """x fp16 / bf16 [M, K] times the weight -> x's dtype [M, n_out], on the path dispatch.choose picks."""
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, n_out))
    return linear_on(dispatch.choose(x.device, wf, m, n, k, gated), wf, x, buffers, n, k, n_out, gated)


def linear_on(path: str, wf: WeightFormat, x: Tensor, buffers: tuple[Tensor, ...], n: int, k: int, n_out: int,
              gated: bool) -> Tensor:
    """`linear` on a given path ("decode", "gemm" or "dense"; benchmarks/bench_dispatch.py times each)."""
    if path == "dense":
        y = _mm_round(x, dequantize(wf, buffers, n, k), column_scale(wf, buffers))
        return silu_and_mul(y) if gated else y
    kernels = _layout_kernels(wf)
    launch = kernels.decode if path == "decode" else kernels.gemm
    out = torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    with _on_torch_stream(x.device) as as_cupy:
        # the workspace (bf16 x's fp16 rows, x fragments, split-K state) from torch's allocator: graph-safe; the
        # split depends on x's device, current here
        size = kernels.workspace_size(path, x.shape[0], n, k, gated, x.dtype == torch.bfloat16)
        workspace = as_cupy(torch.empty(size, dtype=torch.float32, device=x.device)) if size else None
        launch(as_cupy(_bits(x)), tuple(as_cupy(t) for t in buffers), n, as_cupy(_bits(out)), gated, workspace)
    return out


# ----------------------------------------------------------------------------- mixture of experts


def moe(wf: WeightFormat, x: Tensor, w13: tuple[Tensor, ...], w2: tuple[Tensor, ...], inter: int,
        topk_weights: Tensor, topk_ids: Tensor, w13_bias: Tensor | None = None, w2_bias: Tensor | None = None,
        activation: str = "silu") -> Tensor:
    """The fused MoE decode (qpn.cupy_kernels.moe, chunks of 1024 // top_k tokens): x fp16 or bf16 [M, H], the
    experts' stacked buffers, the routing (and gpt-oss's biases and activation, added in the kernels' epilogue)
    -> x's dtype [M, H]. Every token's bits are its bits in any other call (rows never share a sum); the route, the
    slot-ordered h and y and the split-K state come from torch's allocator (one chunk's, reused in stream
    order): no host sync, capturable in a CUDA graph at every M."""
    from ..cupy_kernels.moe import chunk_rows, launch_moe, moe_workspace_size, route_size  # noqa: PLC0415

    (m, h), top_k, experts = x.shape, int(topk_ids.shape[1]), int(w13[0].shape[0])
    out = torch.empty_like(x)
    if m == 0:
        return out
    slots = chunk_rows(m, top_k) * top_k
    kernels = _layout_kernels(wf)
    route = torch.empty(route_size(experts, slots), dtype=torch.int32, device=x.device)
    hidden = torch.empty((slots, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((slots, h), dtype=x.dtype, device=x.device)
    with _on_torch_stream(x.device) as as_cupy:
        size = moe_workspace_size(kernels.family.format, m, top_k, h, inter, experts,  # x's device's split
                                  x.dtype == torch.bfloat16)
        workspace = as_cupy(torch.empty(size, dtype=torch.float32, device=x.device)) if size else None
        launch_moe(kernels, as_cupy(_bits(x)), tuple(as_cupy(t) for t in w13), tuple(as_cupy(t) for t in w2), inter,
                   as_cupy(topk_weights), as_cupy(topk_ids), as_cupy(route), workspace, as_cupy(_bits(hidden)),
                   as_cupy(_bits(y)), as_cupy(_bits(out)), w13_bias=None if w13_bias is None else as_cupy(w13_bias),
                   w2_bias=None if w2_bias is None else as_cupy(w2_bias), activation=activation)
    return out
