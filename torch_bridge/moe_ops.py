"""The `qpn` mixture-of-experts ops: E experts of one layout, routed tokens in, the weighted sum out.

    qpn::nvfp4_moe(Tensor x, Tensor w13_codes, Tensor w13_scales, Tensor w13_global_scale,
                   Tensor w2_codes, Tensor w2_scales, Tensor w2_global_scale,
                   Tensor topk_weights, Tensor topk_ids) -> Tensor
    qpn::fp8_moe(Tensor x, Tensor w13_codes, Tensor w13_group_scales, Tensor w2_codes,
                 Tensor w2_group_scales, Tensor topk_weights, Tensor topk_ids) -> Tensor
    qpn::mxfp4_moe(Tensor x, Tensor w13_codes, Tensor w13_scales, Tensor w13_tile_scale,
                   Tensor w2_codes, Tensor w2_scales, Tensor w2_tile_scale,
                   Tensor topk_weights, Tensor topk_ids) -> Tensor
  each with the keyword arguments (Tensor? w13_bias=None, Tensor? w2_bias=None, str activation="silu")

Tensors: x float16 [M, H] (bfloat16 on the CPU: below); each w13 buffer is the layout's buffer of an
[2I, H] weight (gate rows [0, I), up rows [I, 2I)) and each w2 buffer that of an [H, I] weight, stacked
along a leading expert dimension E (QPN2: codes uint8 [E, 2I, H/2], scales uint8 [E, 2I, H/16], global_scale float32
[E, 2I/32]; QPN8: codes uint8 [E, 2I, H], group_scales float16 [E, 1, 2I] or [E, H/128, 2I/32]);
topk_weights float32 [M, k] (>= 0), topk_ids int32 / int64 [M, k] in [0, E). Output in x's dtype [M, H].
I % 32 == 0 (the gated epilogue's halves are whole tiles) and the layouts' N / K rules hold. QPNMX:
codes uint8 [E, 2I, H/2], scales uint8 [E, 2I, H/32], tile_scale float32 [E, 2I/32].
Biases (gpt-oss): w13_bias float32 [E, 2I] (gate's, then up's) and w2_bias float32 [E, H], added to each
fp32 sum before its RN16; activation "silu" (silu_and_mul) or "swigluoai" (gpt-oss's clamped SwiGLU,
epilogue.ACTIVATIONS; qpn.ref.gpt_oss.moe is the reference).

Numerics: docs/DESIGN.md, "Mixture of experts" (qpn.ref.moe.moe is the reference). Each expert's
linears run on a path whose summation order does not depend on how many tokens chose the expert, and
the combine is one fp32 multiply and add per choice in top-k order: a token's output never depends on
the rest of the batch.
- CUDA: the fused MoE kernels (qpn.cupy_kernels.moe): routing on the GPU in chunks of 1024 // top_k
  tokens, each hit expert's slots cut into pieces of <= 32 rows, one launch per projection and piece
  class, each piece reading its expert's weight tiles (side by side with the expert's other pieces), the
  dense decode kernels' split and order. Every token gets the same bits at every M (no path switch);
  no host sync, capturable in a CUDA graph at every M. Limits: E <= 1024 and top_k <= 32.
- CPU: grouped on the host, the fused numba kernels at every M. They cost speed where many tokens
  share an expert: at M = 32 they take 8.6x the decode-then-BLAS time (4096 x 4096,
  dispatch_tables/cpu.json).

bf16 x (docs/DESIGN.md, "bf16 activations"): every rounding of the activations is an RN_bf16 (the linears'
sums plus bias, the epilogue, the combine) and the output is bf16. On CUDA the fused kernels take each
projection's input as fp16 rows times a power of two (exact; cupy_kernels/bf16.py) and apply it back before
each RN_bf16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..cupy_kernels.moe import require_routable  # host arithmetic: importing it imports no CuPy
from ..ref.formats import QPN2, QPNMX, WeightFormat
from ..ref.geometry import TILE_N
from . import _cpu_ops
from .epilogue import ACTIVATIONS
from .ops import (
    ACTIVATION_DTYPES,
    fp8_dims,
    fp8_layout,
    mxfp4_dims,
    nvfp4_dims,
    require_same_device,
    require_tensor,
)

PER_TILE = ("global_scale", "tile_scale")  # float32 per 32-row tile: [E, tiles] (NVFP4 also [E])


def _stacked(prefix: str, buffers: dict[str, Tensor]) -> int:
    """E of stacked expert buffers: each 3-D (E, ...) with one E >= 1."""
    experts = set()
    for name, t in buffers.items():
        # rank and contiguity here; dtypes and per-expert shapes by the layout's own checks on slice 0 (_check)
        require_tensor(f"{prefix}_{name}", t, (t.dtype,), ndim=(1, 2) if name in PER_TILE else 3)
        experts.add(int(t.shape[0]))
    if len(experts) != 1 or 0 in experts:
        raise ValueError(f"the {prefix} buffers must stack the same number (>= 1) of experts along dim 0, got "
              f"{ {name: tuple(t.shape) for name, t in buffers.items()} }")
    return experts.pop()


def _routing(x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> None:
    require_tensor("topk_weights", topk_weights, (torch.float32,), ndim=2)
    require_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), ndim=2)
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must both be "
              f"[M, top_k] with M = {x.shape[0]} (x's rows); pass the router's top-k as it returns them")


def _dims(h: int, n13: int, k13: int, n2: int, k2: int) -> int:
    """I, from the two projections' per-expert (N, K): w13 [2I, H], w2 [H, I]."""
    if k13 != h or n2 != h or n13 != 2 * k2:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I] for x [M, H = {h}], got per expert "
                         f"w13 [{n13}, {k13}] and w2 [{n2}, {k2}]")
    if k2 % TILE_N:
        raise ValueError(f"the experts' intermediate size I = {k2} must be a multiple of {TILE_N} (the gate and up "
                         "halves of w13 are whole tiles); pad gate, up and down's input features with zeros to a "
                         "multiple of 32")
    return k2


def _check(x: Tensor, w13: dict[str, Tensor], w2: dict[str, Tensor], topk_weights: Tensor, topk_ids: Tensor,
           dims: Callable[..., tuple[int, int]], w13_bias: Tensor | None = None, w2_bias: Tensor | None = None,
           activation: str = "silu") -> int:
    """Metadata only (never a value: no sync): dtypes, shapes, one device, the activation. Returns I."""
    require_tensor("x", x, ACTIVATION_DTYPES, ndim=2)
    require_same_device(x=x, topk_weights=topk_weights, topk_ids=topk_ids,
                        **{f"w13_{n}": t for n, t in w13.items()}, **{f"w2_{n}": t for n, t in w2.items()})
    experts = _stacked("w13", w13)
    if _stacked("w2", w2) != experts:
        raise ValueError(f"w13 and w2 must stack the same experts, got {experts} and "
                         f"{next(iter(w2.values())).shape[0]}")
    n13, k13 = dims(*(t[0] for t in w13.values()))
    n2, k2 = dims(*(t[0] for t in w2.values()))
    inter = _dims(int(x.shape[1]), n13, k13, n2, k2)
    _routing(x, topk_weights, topk_ids)
    for name, bias, shape in (("w13_bias", w13_bias, (experts, n13)), ("w2_bias", w2_bias, (experts, n2))):
        if bias is None:
            continue
        require_tensor(name, bias, (torch.float32,), ndim=2)
        require_same_device(x=x, **{name: bias})
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} must be float32 {list(shape)} (one value per expert and output row), got "
                             f"{list(bias.shape)}; pass the checkpoint's bias as float32 (w13: gate's, then up's)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}; gpt-oss's experts "
                         "use 'swigluoai', Qwen3-MoE and Mixtral 'silu'")
    if x.device.type == "cuda":
        require_routable(experts, int(topk_ids.shape[1]))
    return inter


def activation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the MoE ops take for activations of `dtype`: fp16 and bf16 stay; anything else (fp32, ...)
    goes through fp16 (module docstring)."""
    return dtype if dtype in ACTIVATION_DTYPES else torch.float16


def cpu_moe(wf13: WeightFormat, wf2: WeightFormat, x: Tensor, w13: tuple[Tensor, ...], w2: tuple[Tensor, ...],
            topk_weights: Tensor, topk_ids: Tensor, w13_bias: Tensor | None = None, w2_bias: Tensor | None = None,
            activation: str = "silu") -> Tensor:
    """The MoE block on the CPU: each hit expert's gated up-projection and down-projection through the
    fused numba kernels (every M: batch invariant) on its tokens, each sum plus its bias then one RN16,
    then the combine in top-k order. bf16 x: every RN16 an RN_bf16, a bf16 result."""
    m, top_k = topk_ids.shape
    h = x.shape[1]
    n13 = int(w13[0].shape[1])
    y = torch.zeros((m, top_k, h), dtype=x.dtype)

    def linear(wf: WeightFormat, rows: Tensor, buffers: tuple[Tensor, ...], n: int, bias: Tensor | None) -> Tensor:
        sums = _cpu_ops.sums_on("cpu_fused", wf, rows, buffers, n)
        return (sums if bias is None else sums + bias).to(x.dtype)

    for e in torch.unique(topk_ids).tolist():
        rows, choices = (topk_ids == e).nonzero(as_tuple=True)
        b13, b2 = (None if b is None else b[e] for b in (w13_bias, w2_bias))
        hidden = ACTIVATIONS[activation](linear(wf13, x[rows].contiguous(), tuple(t[e] for t in w13), n13, b13))
        y[rows, choices] = linear(wf2, hidden, tuple(t[e] for t in w2), h, b2)
    acc = torch.zeros((m, h), dtype=torch.float32)
    for j in range(top_k):  # RN32 product, RN32 add, in top-k order: qpn.ref.moe.combine
        acc += topk_weights[:, j:j + 1] * y[:, j].float()
    return acc.to(x.dtype)


def _run(wf13: WeightFormat, wf2: WeightFormat, x: Tensor, w13: tuple[Tensor, ...], w2: tuple[Tensor, ...],
         topk_weights: Tensor, topk_ids: Tensor, inter: int, w13_bias: Tensor | None, w2_bias: Tensor | None,
         activation: str) -> Tensor:
    """The op's backend for this call (module docstring)."""
    if x.device.type == "cuda":
        from . import _cuda  # noqa: PLC0415  (imports no CuPy until a kernel launches)

        return _cuda.moe(wf13, x, w13, w2, inter, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    return cpu_moe(wf13, wf2, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)


def _qpn8_layouts(w13_group_scales: Tensor, w2_group_scales: Tensor, h: int, inter: int
                  ) -> tuple[WeightFormat, WeightFormat]:
    return fp8_layout(w13_group_scales[0], 2 * inter, h), fp8_layout(w2_group_scales[0], h, inter)


# ----------------------------------------------------------------------------- the ops
# Each op: its layout's buffer names, the check, the backend; the fake returns x's shape (the check first).


@torch.library.custom_op("qpn::nvfp4_moe", mutates_args=(), device_types=("cpu", "cuda"))
def nvfp4_moe(x: Tensor, w13_codes: Tensor, w13_scales: Tensor, w13_global_scale: Tensor, w2_codes: Tensor,
              w2_scales: Tensor, w2_global_scale: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              w13_bias: Tensor | None = None, w2_bias: Tensor | None = None, activation: str = "silu") -> Tensor:
    """x float16 or bfloat16 [M, H], NVFP4 experts in QPN2 (module docstring) -> x's dtype [M, H]."""
    w13 = {"codes": w13_codes, "scales": w13_scales, "global_scale": w13_global_scale}
    w2 = {"codes": w2_codes, "scales": w2_scales, "global_scale": w2_global_scale}
    inter = _check(x, w13, w2, topk_weights, topk_ids, nvfp4_dims, w13_bias, w2_bias, activation)
    return _run(QPN2, QPN2, x, tuple(w13.values()), tuple(w2.values()), topk_weights, topk_ids, inter, w13_bias,
                w2_bias, activation)


@nvfp4_moe.register_fake
def _nvfp4_moe_fake(x: Tensor, w13_codes: Tensor, w13_scales: Tensor, w13_global_scale: Tensor, w2_codes: Tensor,
                    w2_scales: Tensor, w2_global_scale: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                    w13_bias: Tensor | None = None, w2_bias: Tensor | None = None, activation: str = "silu") -> Tensor:
    w13 = {"codes": w13_codes, "scales": w13_scales, "global_scale": w13_global_scale}
    w2 = {"codes": w2_codes, "scales": w2_scales, "global_scale": w2_global_scale}
    _check(x, w13, w2, topk_weights, topk_ids, nvfp4_dims, w13_bias, w2_bias, activation)
    return torch.empty_like(x)


@torch.library.custom_op("qpn::fp8_moe", mutates_args=(), device_types=("cpu", "cuda"))
def fp8_moe(x: Tensor, w13_codes: Tensor, w13_group_scales: Tensor, w2_codes: Tensor, w2_group_scales: Tensor,
            topk_weights: Tensor, topk_ids: Tensor, w13_bias: Tensor | None = None, w2_bias: Tensor | None = None,
            activation: str = "silu") -> Tensor:
    """x float16 or bfloat16 [M, H], FP8 experts in QPN8 (module docstring) -> x's dtype [M, H]."""
    w13 = {"codes": w13_codes, "group_scales": w13_group_scales}
    w2 = {"codes": w2_codes, "group_scales": w2_group_scales}
    inter = _check(x, w13, w2, topk_weights, topk_ids, fp8_dims, w13_bias, w2_bias, activation)
    wf13, wf2 = _qpn8_layouts(w13_group_scales, w2_group_scales, int(x.shape[1]), inter)
    return _run(wf13, wf2, x, tuple(w13.values()), tuple(w2.values()), topk_weights, topk_ids, inter, w13_bias,
                w2_bias, activation)


@fp8_moe.register_fake
def _fp8_moe_fake(x: Tensor, w13_codes: Tensor, w13_group_scales: Tensor, w2_codes: Tensor,
                  w2_group_scales: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13_bias: Tensor | None = None,
                  w2_bias: Tensor | None = None, activation: str = "silu") -> Tensor:
    w13 = {"codes": w13_codes, "group_scales": w13_group_scales}
    w2 = {"codes": w2_codes, "group_scales": w2_group_scales}
    _check(x, w13, w2, topk_weights, topk_ids, fp8_dims, w13_bias, w2_bias, activation)
    return torch.empty_like(x)


@torch.library.custom_op("qpn::mxfp4_moe", mutates_args=(), device_types=("cpu", "cuda"))
def mxfp4_moe(x: Tensor, w13_codes: Tensor, w13_scales: Tensor, w13_tile_scale: Tensor, w2_codes: Tensor,
              w2_scales: Tensor, w2_tile_scale: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              w13_bias: Tensor | None = None, w2_bias: Tensor | None = None, activation: str = "silu") -> Tensor:
    """x float16 or bfloat16 [M, H], MXFP4 experts in QPNMX (module docstring) -> x's dtype [M, H]."""
    w13 = {"codes": w13_codes, "scales": w13_scales, "tile_scale": w13_tile_scale}
    w2 = {"codes": w2_codes, "scales": w2_scales, "tile_scale": w2_tile_scale}
    inter = _check(x, w13, w2, topk_weights, topk_ids, mxfp4_dims, w13_bias, w2_bias, activation)
    return _run(QPNMX, QPNMX, x, tuple(w13.values()), tuple(w2.values()), topk_weights, topk_ids, inter, w13_bias,
                w2_bias, activation)


@mxfp4_moe.register_fake
def _mxfp4_moe_fake(x: Tensor, w13_codes: Tensor, w13_scales: Tensor, w13_tile_scale: Tensor, w2_codes: Tensor,
                    w2_scales: Tensor, w2_tile_scale: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                    w13_bias: Tensor | None = None, w2_bias: Tensor | None = None, activation: str = "silu") -> Tensor:
    w13 = {"codes": w13_codes, "scales": w13_scales, "tile_scale": w13_tile_scale}
    w2 = {"codes": w2_codes, "scales": w2_scales, "tile_scale": w2_tile_scale}
    _check(x, w13, w2, topk_weights, topk_ids, mxfp4_dims, w13_bias, w2_bias, activation)
    return torch.empty_like(x)
