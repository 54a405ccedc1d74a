"""The gated epilogue of the torch ops, one definition for every backend: `silu_and_mul` on an
fp16 [M, N] linear result is exactly "linear, then vLLM's silu_and_mul kernel" (docs/DESIGN.md,
"Gated epilogue"; qpn.ref.silu_and_mul is its numpy reference)."""

from __future__ import annotations

import torch
from torch import Tensor


def silu_and_mul(y: Tensor) -> Tensor:
    """Gated epilogue on an fp16 [M, N] linear result: RN16(RN16(silu32(gate)) * up).

    gate = y[:, :N/2], up = y[:, N/2:]. silu32(v) = RN32(v / RN32(1 + expf(-v))). On the CPU,
    expf is float64 exp rounded once to fp32 (qpn.ref's definition, so the CPU matches ref); on
    CUDA it is torch's fp32 exp, i.e. CUDA's expf - the function the decode kernels call, so
    both CUDA paths agree. fp16 * fp16 is exact in fp32 and rounded once.
    """
    half = y.shape[1] // 2
    gate = y[:, :half].float()
    up = y[:, half:].float()
    if y.device.type == "cpu":
        exp_neg = torch.exp(-gate.double()).float()
    else:
        exp_neg = torch.exp(-gate)
    silu16 = (gate / (1.0 + exp_neg)).to(torch.float16)
    return (silu16.float() * up).to(torch.float16)
