"""QPNLinear, a drop-in nn.Linear over one packed weight (packed_weight.py), and `qpn_linear`, the
forward both QPNLinear and the vLLM method run.

`qpn_linear(x, ...)` is the forward: x [..., K] -> [..., N]. fp16 and bf16 inputs run the ops in
their own dtype (y = RN16 or RN_bf16 of the fp32-accumulated sums: docs/DESIGN.md, "bf16
activations"); any other float dtype (fp32, fp64) is cast to fp16 first (RN16; |x| > 65504 becomes
inf) because the kernels are fp16-in / fp32-accumulate (Turing has no fp32 tensor-core MMA), and a
drop-in replacement for nn.Linear must run inside fp32 models too. The result comes back in the
input's dtype: out = cast(RN32(y + bias)), i.e. the bias (kept as float32) is added in fp32 to the
linear result y (fp16 or bf16), then one cast to the input dtype: exact for fp32, one more RN16 /
RN_bf16 for fp16 / bf16 (two roundings in all: the op's, then the bias add's; without a bias y is
returned as the op rounded it, once).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from .. import checkpoints
from ..ref.formats import FORMAT_NAMES, FP8_GRANULARITIES, QPN8, WeightFormat, weight_format
from .buffers import buffer_dtype
from .ops import ACTIVATION_DTYPES
from .packed_weight import (
    ArrayIn,
    PackedWeight,
    ScaleIn,
    as_tensor,
    device_moves_only,
    float32,
    pack_fp8,
    pack_mxfp4,
    pack_nvfp4,
    packed_weight_class,
    require_k,
)


def format_of(format: str, fp8_granularity: str) -> WeightFormat:
    """The description QPNLinear(format, fp8_granularity=...) runs; fp8_granularity must be valid
    even for nvfp4 (where it is ignored: it is a keyword with a default)."""
    if format not in FORMAT_NAMES:
        raise ValueError(f"format must be one of {FORMAT_NAMES}, got {format!r}")
    if fp8_granularity not in FP8_GRANULARITIES:
        raise ValueError(f"fp8_granularity must be one of {FP8_GRANULARITIES}, got {fp8_granularity!r}")
    return weight_format(format, fp8_granularity if format == QPN8.format else None)


class InputDtypeError(ValueError, RuntimeError):
    """x is not floating point. A ValueError as every qpn input error, and a RuntimeError as the
    one nn.Linear raises for an int64 / bool / complex input, so a drop-in caller catches it too."""


def qpn_linear(x: Tensor, packed: PackedWeight, bias: Tensor | None = None, gated: bool = False) -> Tensor:
    """x [..., K] (fp16 or bf16: as it is; fp32 / fp64: cast to fp16, module docstring) -> [..., N] ([..., N/2]
    gated) in x's dtype, N = packed.out_features.

    Runs packed.linear (the layout's op) on the flattened [M, K] fp16 / bf16 input, crops the padded columns,
    adds the bias in fp32 and casts to x's dtype. Traceable by torch.compile(fullgraph=True); the
    decode / GEMM / dense choice happens inside the op. Integer, bool and complex x raise
    InputDtypeError: the fp16 cast would silently truncate the output to x's integer dtype (or drop
    the imaginary part).
    """
    if not x.is_floating_point():
        raise InputDtypeError(f"x must be a floating-point tensor (fp16, bf16 or fp32), got {x.dtype}; "
                              "nn.Linear refuses it too - convert token ids with an embedding, or cast x")
    k = packed.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x must have {k} input features in its last dimension, got shape {tuple(x.shape)}")
    lead = x.shape[:-1]
    n_out = packed.out_features // 2 if gated else packed.out_features
    x2 = x.reshape(-1, k)
    x2 = (x2 if x2.dtype in ACTIVATION_DTYPES else x2.to(torch.float16)).contiguous()
    y = packed.linear(x2, gated)
    if y.shape[1] != n_out:
        y = y[:, :n_out]  # pad rows (N padded to the layout's multiple) give exact zeros
    if bias is not None:
        y = y.float() + bias
    return y.to(x.dtype).reshape(*lead, n_out)


class QPNLinear(nn.Module):
    """A linear layer with NVFP4 (QPN2), FP8 (QPN8) or MXFP4 (QPNMX) weights: y = x W^T (+ bias).

    Buffers (saved in state_dict; shapes are fixed by the constructor arguments, so
    `QPNLinear(K, N, format, bias=..., fp8_granularity=...)` followed by `load_state_dict`
    restores a saved layer):
        nvfp4: codes uint8 [N_pad, K/2], scales uint8 [N_pad, K/16], global_scale float32 [N_pad/32]
        fp8:   codes uint8 [N_pad, K],   group_scales float16 [1, N_pad] or [K/128, N_pad/32] (block)
        mxfp4: codes uint8 [N_pad, K/2], scales uint8 [N_pad, K/32], tile_scale float32 [N_pad/32]
        bias:  float32 [N] or absent
    N_pad = N rounded up to 32 (128 for FP8 block scales); forward crops to N. See the module
    docstring for input dtypes and the bias rounding. Build one with the `from_*` constructors.
    Dtype casts of an enclosing model (`.half()`, `.to(torch.bfloat16)`) leave these buffers in
    their dtypes; device moves apply.
    """

    # the buffers register_buffer creates (declared for the type checker only: no class attributes)
    codes: Tensor
    scales: Tensor  # nvfp4
    global_scale: Tensor  # nvfp4
    group_scales: Tensor  # fp8
    tile_scale: Tensor  # mxfp4
    bias: Tensor | None

    def __init__(self, in_features: int, out_features: int, format: str = "nvfp4", bias: bool = False, *,
                 fp8_granularity: str = "channel", device: torch.device | str | None = None) -> None:
        super().__init__()
        wf = format_of(format, fp8_granularity)
        k, n = int(in_features), int(out_features)
        if n <= 0:
            raise ValueError(f"out_features must be >= 1, got {n}")
        require_k("in_features", k, wf)
        self.in_features, self.out_features, self.format, self.weight_format = k, n, format, wf
        self.fp8_granularity = fp8_granularity if wf.granularities else None
        n_pad = wf.padded_n(n)
        for b in wf.buffers:  # codes and scale bytes 0 (+0 weights), float scales 1.0 (a unit multiplier)
            dtype = buffer_dtype(b)
            init = torch.zeros if dtype == torch.uint8 else torch.ones
            self.register_buffer(b.name, init(b.shape(n_pad, k), dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros((n,), dtype=torch.float32, device=device) if bias else None)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_packed(cls, packed: PackedWeight, bias: ArrayIn | None = None,
                    fp8_granularity: str | None = None) -> QPNLinear:
        """A module holding `packed`'s buffers (copied: the module owns its state_dict) on its device.
        fp8_granularity: what the FP8 scales were made per (its layout cannot tell "tensor" from "channel":
        both are QPN8's per-column scales); None: the layout's ("channel" for QPN8, "block")."""
        wf = packed.weight_format
        granularity = fp8_granularity or (wf.granularities or ("channel",))[-1]
        if wf.granularities and granularity not in wf.granularities:
            raise ValueError(f"fp8_granularity must be one of {wf.granularities} for a {wf.label} weight, got "
                             f"{fp8_granularity!r}")
        module = cls(packed.in_features, packed.out_features, wf.format, bias=bias is not None,
                     fp8_granularity=granularity, device=packed.device)
        with torch.no_grad():
            for name, tensor in packed.buffers.items():
                getattr(module, name).copy_(tensor)
            if bias is not None:
                b = as_tensor("bias", bias, packed.device)
                if tuple(b.shape) != (packed.out_features,) or not b.is_floating_point():
                    raise ValueError(f"bias must be a float tensor of shape ({packed.out_features},), got "
                                     f"{b.dtype} of shape {tuple(b.shape)}")
                assert module.bias is not None  # registered above: bias=bias is not None
                module.bias.copy_(b.float())
        return module

    @classmethod
    def from_modelopt_nvfp4(cls, weight_packed: ArrayIn, weight_scale: ArrayIn, weight_scale_2: ScaleIn,
                            bias: ArrayIn | None = None) -> QPNLinear:
        """ModelOpt NVFP4 tensors: weight (uint8 [N, K/2]), weight_scale (e4m3 [N, K/16]),
        weight_scale_2 (float32 multiplier, scalar or per 32-row tile)."""
        return cls.from_packed(pack_nvfp4(weight_packed, weight_scale, weight_scale_2), bias)

    @classmethod
    def from_compressed_tensors_nvfp4(cls, weight_packed: ArrayIn, weight_scale: ArrayIn, weight_global_scale: ScaleIn,
                                      bias: ArrayIn | None = None) -> QPNLinear:
        """compressed-tensors nvfp4-pack-quantized tensors. Their weight_global_scale is the
        RECIPROCAL of the multiplier (2688 / amax); it becomes g = RN32(1 / weight_global_scale),
        one correctly rounded fp32 division, as qpn.ref.load_checkpoint and vLLM do."""
        g = float32("weight_global_scale", weight_global_scale)
        g_host = g.cpu().numpy()
        if not (np.all(np.isfinite(g_host)) and np.all(g_host > 0)):
            raise ValueError(f"weight_global_scale must be finite and > 0, got {g_host.reshape(-1)[:4]}")
        multiplier = (np.float32(1.0) / g_host).astype(np.float32)  # RN32(1 / G)
        return cls.from_modelopt_nvfp4(weight_packed, weight_scale, multiplier, bias)

    @classmethod
    def from_modelopt_fp8(cls, weight: ArrayIn, weight_scale: ScaleIn, bias: ArrayIn | None = None,
                          granularity: str | None = None) -> QPNLinear:
        """ModelOpt / DeepSeek FP8: weight (e4m3 [N, K]) and a float32 multiplier scale per tensor
        (()), channel ((N,) / (N, 1)) or 128x128 block ((ceil(N/128), ceil(K/128)))."""
        return cls.from_packed(pack_fp8(weight, weight_scale, granularity), bias)

    @classmethod
    def from_mxfp4(cls, blocks: ArrayIn, scales: ArrayIn, bias: ArrayIn | None = None) -> QPNLinear:
        """OCP MXFP4 tensors (gpt-oss's *_blocks uint8 [N, K/32, 16] or [N, K/2], *_scales e8m0 uint8
        [N, K/32])."""
        return cls.from_packed(pack_mxfp4(blocks, scales), bias)

    @classmethod
    def from_checkpoint(cls, linear: checkpoints.NVFP4Linear | checkpoints.FP8Linear,
                        bias: ArrayIn | None = None) -> QPNLinear:
        """From a qpn.checkpoints.checkpoint NVFP4Linear / FP8Linear (global scales already multipliers)."""
        if not isinstance(linear, (checkpoints.NVFP4Linear, checkpoints.FP8Linear)):
            raise ValueError(f"linear must be a qpn.ref NVFP4Linear or FP8Linear, got {type(linear).__name__}")
        return cls.from_packed(PackedWeight.from_checkpoint(linear), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str = "nvfp4", *, fp8_granularity: str = "channel") -> QPNLinear:
        """Quantize an nn.Linear with qpn.ref's quantizers (ModelOpt's NVFP4 rules; FP8 amax/448
        per tensor / channel / block) and pack it. The weight is read as float32 (exact for fp16
        / bf16 / fp32). The new module is on linear.weight's device; bias is kept (as float32)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        wf = format_of(format, fp8_granularity)
        require_k("in_features", linear.in_features, wf)  # before quantizing: the constructor would refuse it
        w = linear.weight.detach().to("cpu", torch.float32).numpy()
        packed = PackedWeight.quantize(w, wf, fp8_granularity)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_packed(packed, bias, fp8_granularity if wf.granularities else None).to(linear.weight.device)

    # ------------------------------------------------------------------ use

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QPNLinear:
        """Device moves apply to the buffers; dtype casts do not. `model.half()` or
        `model.to(torch.bfloat16)` would otherwise round the float32 global scales and bias
        (and the ops would refuse them): each buffer keeps its dtype, only its device follows."""
        return super()._apply(device_moves_only(fn), recurse)


    @property
    def packed_weight(self) -> PackedWeight:
        """The layer's packed weight over its buffers (no copy): what forward runs."""
        buffers = self._buffers  # registered in __init__ for every buffer of the description: never None
        return packed_weight_class(self.weight_format).over(
            {b.name: buffers[b.name] for b in self.weight_format.buffers},  # type: ignore[misc]
            self.in_features, self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        return qpn_linear(x, self.packed_weight, self.bias)

    def dequantized_weight(self) -> Tensor:
        """float16 [N, K]: the W16 every path of this layer computes with (pad rows cropped)."""
        return self.packed_weight.dequantize()

    def extra_repr(self) -> str:
        extra = f", fp8_granularity={self.fp8_granularity!r}" if self.fp8_granularity is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format!r}"
                f"{extra}, bias={self.bias is not None}")
