"""QPNLinear and the packing helpers behind it (also the building blocks of the vLLM method).

Packing (`pack_nvfp4`, `pack_fp8`): checkpoint tensors -> the buffers the ops read, on the
device the tensors are on (torch tensors or numpy arrays; numpy goes to the CPU):

- N is padded up to the layout's multiple (32; 128 for FP8 128x128 block scales) with zero
  weight rows. NVFP4 pad rows get scale byte 0x00 (e4m3 +0, so every pad weight is +0 whatever
  the code) and global scale 1.0; FP8 pad rows get code 0x00 (+0) and scale 1.0. Outputs of pad
  rows are exact zeros and are cropped away. K is never padded (it would change x): a K that
  breaks the layout rule is a ValueError that says to pad the input features.
- Values are validated once here, with qpn.ref's rules (the ops check metadata only): NaN
  scale bytes, global scales that are not finite and > 0, blocks whose largest weight would
  overflow fp16 (NVFP4), non-positive or overflowing FP8 scales. The NVFP4 overflow rule reads
  the scales on the host (N*K/16 bytes: one copy per layer, at load time).
- The NVFP4 global scale is stored as float32 [N_pad/32], one multiplier per 32-row tile
  (a scalar is repeated; fused shards keep their own values, see qpn.ref.fuse_nvfp4_shards).

`qpn_linear(x, ...)` is the forward: x [..., K] -> [..., N]. It computes in fp16 whatever the
input dtype: fp32 / bf16 inputs are cast to fp16 (RN16; |x| > 65504 becomes inf) because the
kernels are fp16-in / fp32-accumulate (Turing has no bf16 or fp32 tensor-core MMA), and a
drop-in replacement for nn.Linear must run inside fp32 and bf16 models too. The result comes
back in the input's dtype: out = cast(RN32(y16 + bias)), i.e. the bias (kept as float32) is
added in fp32 to the fp16 linear result, then one cast to the input dtype (exact for fp32,
one more RN16 / RN-bf16 otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch
from torch import Tensor, nn

from .. import checkpoints, ref
from ..ref.checks import require_nvfp4_block_scales
from ..ref.formats import FORMAT_NAMES, FP8_GRANULARITIES, QPN2, QPN8, QPN8_BLOCK, WeightFormat, weight_format
from ..ref.fp8 import fp8_block_grid
from ..ref.geometry import GROUP_K
from .ops import PAD_INPUT_FEATURES_FIX  # importing ops registers the torch.ops.qpn.* ops

_NVFP4_PAD_SCALE_BYTE = int(ref.encode_e4m3(QPN2.pad_scale))  # QPN2.pad_scale is e4m3 +0, byte 0x00

# What the packers take: a checkpoint tensor as torch or numpy (qpn.ref's carriers); scales may be a
# Python float too (read as fp32, _float32).
ArrayIn: TypeAlias = Tensor | np.ndarray | np.generic
ScaleIn: TypeAlias = Tensor | np.ndarray | np.generic | float


def _format_of(format: str, fp8_granularity: str) -> WeightFormat:
    """The description QPNLinear(format, fp8_granularity=...) runs; fp8_granularity must be valid
    even for nvfp4 (where it is ignored: it is a keyword with a default)."""
    if format not in FORMAT_NAMES:
        raise ValueError(f"format must be one of {FORMAT_NAMES}, got {format!r}")
    if fp8_granularity not in FP8_GRANULARITIES:
        raise ValueError(f"fp8_granularity must be one of {FP8_GRANULARITIES}, got {fp8_granularity!r}")
    return weight_format(format, fp8_granularity if format == QPN8.format else None)


def _require_k(name: str, k: int, wf: WeightFormat) -> None:
    """K is never padded (it would change x): a K off the layout's multiple is refused with the fix."""
    if k <= 0 or k % wf.k_multiple != 0:
        block = wf is QPN8_BLOCK
        fix = "pad the input features (and the scale grid) to whole 128x128 blocks" if block else \
            PAD_INPUT_FEATURES_FIX
        raise ValueError(f"{name} must be a positive multiple of {wf.k_multiple} for {wf.format}"
                         f"{' with block scales' if block else ''}, got {k}; {fix}")


def _as_tensor(name: str, value: object, device: torch.device | None = None) -> Tensor:
    """torch.Tensor or numpy array (numpy carriers as qpn.ref uses them) -> torch.Tensor, no casts."""
    if isinstance(value, Tensor):
        tensor = value.detach()
    elif isinstance(value, (np.ndarray, np.generic)):
        tensor = torch.from_numpy(np.array(value))  # a writable copy (checkpoint arrays are read-only memmaps)
    else:
        raise ValueError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")
    return tensor if device is None else tensor.to(device)


def _e4m3_bits(name: str, value: object, device: torch.device | None = None) -> Tensor:
    tensor = _as_tensor(name, value, device)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8)
    if tensor.dtype != torch.uint8:
        raise ValueError(f"{name} must be torch.float8_e4m3fn or uint8 e4m3 bit patterns, got {tensor.dtype}; "
                         "pass the checkpoint tensor unchanged")
    return tensor


def _float32(name: str, value: object, device: torch.device | None = None) -> Tensor:
    if type(value) is float:  # a Python float is taken as fp32; numpy float64 is refused below
        value = np.float32(value)
    tensor = _as_tensor(name, value, device)
    if tensor.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 (checkpoints store fp32 scales), got {tensor.dtype}; "
                         "pass it unchanged (np.float32(x) for a Python float)")
    return tensor


def _pad_rows(t: Tensor, rows: int, fill: float) -> Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=0).contiguous()


@dataclass(frozen=True)
class PackedWeight:
    """The buffers one QPN linear needs. `scales` is QPN2 uint8 scales (nvfp4) or QPN8 fp16
    group_scales (fp8); `global_scale` is float32 [N_pad/32] (nvfp4) or None (fp8)."""

    format: str
    codes: Tensor
    scales: Tensor
    global_scale: Tensor | None
    in_features: int  # K
    out_features: int  # N before padding

    @property
    def padded_out_features(self) -> int:
        return int(self.codes.shape[0])


def pack_nvfp4(weight_packed: ArrayIn, weight_scale: ArrayIn, global_scale: ScaleIn) -> PackedWeight:
    """ModelOpt-semantics NVFP4 -> PackedWeight on weight_packed's device.

    weight_packed uint8 [N, K/2] (element 2j low nibble); weight_scale e4m3 [N, K/16]
    (float8_e4m3fn or uint8); global_scale float32 MULTIPLIER (ModelOpt weight_scale_2): a
    scalar, or [N/32] per 32-row tile (then N % 32 == 0). K % 64 == 0 (QPN2).
    """
    wp = _as_tensor("weight_packed", weight_packed)
    device = wp.device
    ws = _e4m3_bits("weight_scale", weight_scale, device)
    g = _float32("global_scale", global_scale, device)
    if wp.dtype != torch.uint8 or wp.dim() != 2:
        raise ValueError(f"weight_packed must be uint8 [N, K/2], got {wp.dtype} of shape {tuple(wp.shape)}")
    n, k = int(wp.shape[0]), QPN2.k_of_codes(int(wp.shape[1]))
    _require_k("K (2 * weight_packed.shape[1])", k, QPN2)
    if tuple(ws.shape) != (n, k // GROUP_K):
        raise ValueError(f"weight_scale must have shape (N, K/16) = ({n}, {k // GROUP_K}), got {tuple(ws.shape)}")
    # Values, with ref's rules (host copies of the small tensors): global scale finite and > 0,
    # no NaN or negative scale bytes, no block whose largest weight overflows fp16.
    g_host = g.cpu().numpy()
    g_rows = ref.global_scale_per_row(g_host, n)
    ws_host = ws.cpu().numpy()
    require_nvfp4_block_scales("weight_scale", ws_host)
    ref.require_nvfp4_fits_fp16(ws_host, g_rows)

    n_pad = QPN2.padded_n(n)
    tiles = QPN2.buffer("global_scale").shape(n_pad, k)
    g_tiles = g.reshape(1).expand(tiles) if g.numel() == 1 else g.reshape(-1)
    codes, scales = torch.ops.qpn.nvfp4_prepack(_pad_rows(wp, n_pad, QPN2.pad_code),
                                                _pad_rows(ws, n_pad, _NVFP4_PAD_SCALE_BYTE))
    return PackedWeight(QPN2.format, codes, scales, g_tiles.contiguous().clone(), k, n)


def pack_fp8(weight: ArrayIn, weight_scale: ScaleIn, granularity: str | None = None) -> PackedWeight:
    """FP8 (e4m3 weight [N, K], float32 MULTIPLIER scale per tensor / channel / 128x128 block)
    -> PackedWeight on weight's device. granularity: None reads it from the scale's shape. The
    rule is qpn.ref.fp8_scale_granularity's, for one-value scales too: unstated, a size-1 scale is
    per tensor; a stated "block" of a one-block weight stays block (N padded to 128, group_scales
    [1, N_pad/32]), the buffers `qpn pack` writes for it."""
    w = _e4m3_bits("weight", weight)
    device = w.device
    s = _float32("weight_scale", weight_scale, device)
    if w.dim() != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"weight must be 2-D [N, K] with N, K >= 1, got shape {tuple(w.shape)}")
    n, k = int(w.shape[0]), int(w.shape[1])
    granularity = ref.fp8_scale_granularity(s, n, k, granularity)  # the shape only; N is padded below
    wf = weight_format(QPN8.format, granularity)
    _require_k("K", k, wf)
    n_pad = wf.padded_n(n)  # block scales: the scale grid already has ceil(N/128) rows
    if wf is QPN8_BLOCK:
        s_pad = s.reshape(fp8_block_grid(n, k))  # ModelOpt's [N/128, 1, K/128, 1] (or 0-d) holds the same values
    elif granularity == "tensor":
        s_pad = s.reshape(())
    else:
        s_pad = _pad_rows(s.reshape(n), n_pad, wf.pad_scale)
    codes, group_scales = torch.ops.qpn.fp8_prepack(_pad_rows(w, n_pad, wf.pad_code), s_pad.contiguous())
    block_shape = wf.buffer("group_scales").shape(n_pad, k)
    if wf is QPN8_BLOCK and tuple(group_scales.shape) != block_shape:
        # One block: the op reads a (1, 1) grid by its shape, per tensor ([1, N_pad]); the codes do not
        # depend on the granularity, and the block layout holds that same S16 in each of its cells.
        group_scales = group_scales[:, :1].expand(block_shape).contiguous()
    return PackedWeight(wf.format, codes, group_scales, None, k, n)


class InputDtypeError(ValueError, RuntimeError):
    """x is not floating point. A ValueError as every qpn input error, and a RuntimeError as the
    one nn.Linear raises for an int64 / bool / complex input, so a drop-in caller catches it too."""


def qpn_linear(x: Tensor, fmt: str, codes: Tensor, scales: Tensor, global_scale: Tensor | None,
               out_features: int, bias: Tensor | None = None) -> Tensor:
    """x [..., K] (fp16, or fp32 / bf16: cast to fp16, module docstring) -> [..., out_features] in x's dtype.

    Calls torch.ops.qpn.nvfp4_linear / fp8_linear on the flattened [M, K] fp16 input, crops the
    padded columns, adds the float32 bias in fp32 and casts to x's dtype. Traceable by
    torch.compile(fullgraph=True); the decode / dense choice happens inside the op.
    Integer, bool and complex x raise InputDtypeError: the fp16 cast would silently truncate
    the output to x's integer dtype (or drop the imaginary part).
    """
    if not x.is_floating_point():
        raise InputDtypeError(f"x must be a floating-point tensor (fp16, bf16 or fp32), got {x.dtype}; "
                              "nn.Linear refuses it too - convert token ids with an embedding, or cast x")
    nvfp4 = fmt == QPN2.format  # fmt is the public name; every FP8 granularity runs fp8_linear
    k = (QPN2 if nvfp4 else QPN8).k_of_codes(codes.shape[1])
    if x.shape[-1] != k:
        raise ValueError(f"x must have {k} input features in its last dimension, got shape {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).to(torch.float16).contiguous()
    if nvfp4:
        y = torch.ops.qpn.nvfp4_linear(x2, codes, scales, global_scale)
    else:
        y = torch.ops.qpn.fp8_linear(x2, codes, scales)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    if bias is not None:
        y = y.float() + bias
    return y.to(x.dtype).reshape(*lead, out_features)


class QPNLinear(nn.Module):
    """A linear layer with NVFP4 (QPN2) or FP8 (QPN8) weights: y = x W^T (+ bias).

    Buffers (saved in state_dict; shapes are fixed by the constructor arguments, so
    `QPNLinear(K, N, format, bias=..., fp8_granularity=...)` followed by `load_state_dict`
    restores a saved layer):
        nvfp4: codes uint8 [N_pad, K/2], scales uint8 [N_pad, K/16], global_scale float32 [N_pad/32]
        fp8:   codes uint8 [N_pad, K],   group_scales float16 [1, N_pad] or [K/128, N_pad/32] (block)
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
    bias: Tensor | None

    def __init__(self, in_features: int, out_features: int, format: str = "nvfp4", bias: bool = False, *,
                 fp8_granularity: str = "channel", device: torch.device | str | None = None) -> None:
        super().__init__()
        wf = _format_of(format, fp8_granularity)
        k, n = int(in_features), int(out_features)
        if n <= 0:
            raise ValueError(f"out_features must be >= 1, got {n}")
        _require_k("in_features", k, wf)
        self.in_features, self.out_features, self.format, self.weight_format = k, n, format, wf
        self.fp8_granularity = fp8_granularity if wf.granularities else None
        n_pad = wf.padded_n(n)
        for b in wf.buffers:  # codes and scale bytes 0 (+0 weights), float scales 1.0 (a unit multiplier)
            dtype = torch.from_numpy(np.empty(0, b.dtype)).dtype
            init = torch.zeros if dtype == torch.uint8 else torch.ones
            self.register_buffer(b.name, init(b.shape(n_pad, k), dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros((n,), dtype=torch.float32, device=device) if bias else None)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_packed(cls, packed: PackedWeight, bias: ArrayIn | None = None, *,
                    fp8_granularity: str = "channel") -> QPNLinear:
        device = packed.codes.device
        module = cls(packed.in_features, packed.out_features, packed.format, bias=bias is not None,
                     fp8_granularity=fp8_granularity, device=device)
        with torch.no_grad():
            module.codes.copy_(packed.codes)
            if module.weight_format is QPN2:
                if packed.global_scale is None:
                    raise ValueError("packed.global_scale must be float32 [N_pad/32] for an nvfp4 PackedWeight, got "
                                     "None; build the PackedWeight with pack_nvfp4")
                module.scales.copy_(packed.scales)
                module.global_scale.copy_(packed.global_scale)
            else:
                module.group_scales.copy_(packed.scales)
            if bias is not None:
                b = _as_tensor("bias", bias, device)
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
        g = _float32("weight_global_scale", weight_global_scale)
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
        packed = pack_fp8(weight, weight_scale, granularity)
        channel = QPN8.buffer("group_scales").shape(packed.padded_out_features, packed.in_features)
        block = tuple(packed.scales.shape) != channel
        return cls.from_packed(packed, bias, fp8_granularity="block" if block else "channel")

    @classmethod
    def from_checkpoint(cls, linear: checkpoints.NVFP4Linear | checkpoints.FP8Linear,
                        bias: ArrayIn | None = None) -> QPNLinear:
        """From a qpn.checkpoints.checkpoint NVFP4Linear / FP8Linear (global scales already multipliers)."""
        if isinstance(linear, checkpoints.NVFP4Linear):
            return cls.from_modelopt_nvfp4(linear.weight_packed, linear.weight_scale, linear.global_scale, bias)
        if isinstance(linear, checkpoints.FP8Linear):
            return cls.from_modelopt_fp8(linear.weight, linear.weight_scale, bias, granularity=linear.granularity)
        raise ValueError(f"linear must be a qpn.ref NVFP4Linear or FP8Linear, got {type(linear).__name__}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str = "nvfp4", *, fp8_granularity: str = "channel") -> QPNLinear:
        """Quantize an nn.Linear with qpn.ref's quantizers (ModelOpt's NVFP4 rules; FP8 amax/448
        per tensor / channel / block) and pack it. The weight is read as float32 (exact for fp16
        / bf16 / fp32). The new module is on linear.weight's device; bias is kept (as float32)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        wf = _format_of(format, fp8_granularity)
        _require_k("in_features", linear.in_features, wf)  # before quantizing: the constructor would refuse it
        device = linear.weight.device
        w = linear.weight.detach().to("cpu", torch.float32).numpy()
        if wf is QPN2:
            q4 = ref.nvfp4_quantize(w)
            packed = pack_nvfp4(q4.weight_packed, q4.weight_scale, q4.weight_scale_2)
        else:
            q8 = ref.fp8_quantize(w, fp8_granularity)
            packed = pack_fp8(q8.weight, q8.weight_scale, fp8_granularity)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_packed(packed, bias, fp8_granularity=fp8_granularity).to(device)

    # ------------------------------------------------------------------ use

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QPNLinear:
        """Device moves apply to the buffers; dtype casts do not. `model.half()` or
        `model.to(torch.bfloat16)` would otherwise round the float32 global scales and bias
        (and the ops would refuse them): each buffer keeps its dtype, only its device follows."""

        def move_only(t: Tensor) -> Tensor:
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            return fn(t) if probe.dtype == t.dtype else t.to(probe.device)

        return super()._apply(move_only, recurse)


    def forward(self, x: Tensor) -> Tensor:
        if self.weight_format is QPN2:
            return qpn_linear(x, QPN2.format, self.codes, self.scales, self.global_scale, self.out_features, self.bias)
        return qpn_linear(x, QPN8.format, self.codes, self.group_scales, None, self.out_features, self.bias)

    def dequantized_weight(self) -> Tensor:
        """float16 [N, K]: the W16 every path of this layer computes with (pad rows cropped)."""
        if self.weight_format is QPN2:
            w16 = torch.ops.qpn.nvfp4_dequantize(self.codes, self.scales, self.global_scale)
        else:
            w16 = torch.ops.qpn.fp8_dequantize(self.codes, self.group_scales)
        return w16[: self.out_features]

    def extra_repr(self) -> str:
        extra = f", fp8_granularity={self.fp8_granularity!r}" if self.fp8_granularity is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format!r}"
                f"{extra}, bias={self.bias is not None}")
