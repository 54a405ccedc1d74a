"""The gated epilogues of the torch ops, one definition for every backend: `silu_and_mul` on an
fp16 [M, N] linear result is exactly "linear, then vLLM's silu_and_mul kernel" (docs/DESIGN.md,
"Gated epilogue"; qpn.ref.silu_and_mul is its numpy reference); `swigluoai_and_mul` is gpt-oss's
clamped SwiGLU, vLLM's swigluoai_and_mul kernel op for op (qpn.ref.gpt_oss.swigluoai_and_mul).
ACTIVATIONS names them as the MoE ops take them. Each rounds to its input's dtype: on a bf16 result
every RN16 is an RN_bf16, vLLM's kernels for scalar_t = bf16 (docs/DESIGN.md, "bf16 activations")."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ref.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT


def _expf(v: Tensor) -> Tensor:
    """expf(v) in fp32: on the CPU float64 exp rounded once (qpn.ref's definition), on CUDA torch's fp32
    exp, CUDA's expf, the function the kernels call."""
    return torch.exp(v.double()).float() if v.device.type == "cpu" else torch.exp(v)


def silu_and_mul(y: Tensor) -> Tensor:
    """Gated epilogue on an fp16 [M, N] linear result: RN16(RN16(silu32(gate)) * up); on a bf16 one
    RN_bf16(RN32(RN_bf16(silu32(gate)) * up)).

    gate = y[:, :N/2], up = y[:, N/2:]. silu32(v) = RN32(v / RN32(1 + expf(-v))). On the CPU,
    expf is float64 exp rounded once to fp32 (qpn.ref's definition, so the CPU matches ref); on
    CUDA it is torch's fp32 exp, i.e. CUDA's expf - the function the decode kernels call, so
    both CUDA paths agree. fp16 * fp16 is exact in fp32 and rounded once; bf16 * bf16 too, unless
    below 2^-126 (an fp32 multiply, as c10::BFloat16's in vLLM's kernel).
    """
    half = y.shape[1] // 2
    gate = y[:, :half].float()
    up = y[:, half:].float()
    silu16 = (gate / (1.0 + _expf(-gate))).to(y.dtype)
    return (silu16.float() * up).to(y.dtype)


def swigluoai_and_mul(y: Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> Tensor:
    """gpt-oss's gated epilogue on an fp16 [M, N] result (gate = y[:, :N/2], up = y[:, N/2:]), each fp32
    operation rounded once: g = min(gate, limit), u = clamp(up, -limit, limit) (NaN stays NaN),
    s = 1 / (1 + expf(-(g * alpha))), out = RN16((u + 1) * (g * s)) (bf16 y: RN_bf16)."""
    half = y.shape[1] // 2
    gate, up = y[:, :half].float(), y[:, half:].float()
    a = torch.tensor(alpha, dtype=torch.float32)  # the fp32 constants of the kernels
    g = torch.where(gate > limit, limit, gate)
    u = torch.where(up > limit, limit, torch.where(up < -limit, -limit, up))
    s = 1.0 / (1.0 + _expf(-(g * a.to(y.device))))
    return ((u + 1.0) * (g * s)).to(y.dtype)


ACTIVATIONS = {"silu": silu_and_mul, "swigluoai": swigluoai_and_mul}
