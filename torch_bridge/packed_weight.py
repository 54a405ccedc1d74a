"""One object per packed weight: a layout's buffers and every operation on them (issue 21).

`PackedWeight` is the base; one subclass per layout (QPN2Weight, QPN8Weight for tensor / channel
scales, QPN8BlockWeight for 128x128 block scales, QPNMXWeight for MXFP4). An object holds the buffers its
description names (ref/formats.py: names, dtypes, shapes of the padded weight), N and K, and runs:

    linear(x, gated=False)   x fp16 [M, K] -> fp16 [M, N_pad] (or [M, N_pad/2]): the layout's torch op,
                             whose CPU side is the numba backend and whose CUDA side the CuPy kernels
                             (the path inside the op: dispatch.py)
    dequantize()             fp16 [N, K] W16 (pad rows cropped), the same ops' backends
    reference_dequantize()   numpy float16 [N, K] from qpn.ref (the numpy reference backend)
    to(device)               the same weight on another device

and is built by the layout's `prepack` from checkpoint tensors (`pack_nvfp4` / `pack_fp8`: padding,
the value rules, the prepack op), `from_checkpoint` (a qpn.checkpoints NVFP4Linear / FP8Linear) or
`quantize` (an fp32 weight, qpn.ref's quantizers). QPNLinear, the vLLM method, load_quantized and
`qpn verify` hold one and call it; none of them asks which layout it is: `packed_weight_class(wf)`
(the one table of layouts) turns a description into its class.

Packing (`pack_nvfp4`, `pack_fp8`, `pack_mxfp4`): checkpoint tensors -> a PackedWeight on the device the tensors
are on (torch tensors or numpy arrays; numpy goes to the CPU):

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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, TypeAlias

import numpy as np
import torch
from torch import Tensor

from .. import checkpoints, ref
from ..checkpoints.packed import PackedLayer
from ..checkpoints.packed.layers import NVFP4_PAD_SCALE_BYTE
from ..ref.checks import require_nvfp4_block_scales
from ..ref.codecs import E8M0_BIAS
from ..ref.formats import MX_BLOCK, QPN2, QPN8, QPN8_BLOCK, QPNMX, WeightFormat, weight_format
from ..ref.fp8 import fp8_block_grid
from ..ref.geometry import GROUP_K, TILE_N
from .buffers import buffer_dtype
from .ops import PAD_INPUT_FEATURES_FIX  # importing ops registers the torch.ops.qpn.* ops

# What the packers take: a checkpoint tensor as torch or numpy (qpn.ref's carriers); scales may be a
# Python float too (read as fp32, _float32).
ArrayIn: TypeAlias = Tensor | np.ndarray | np.generic
ScaleIn: TypeAlias = Tensor | np.ndarray | np.generic | float
CheckpointLinear: TypeAlias = "checkpoints.QuantizedLinear"  # NVFP4Linear | FP8Linear | MXFP4Linear
# the e8m0 byte of QPNMX's pad scale 2^-127 (byte 0: e8m0 has no zero; +0 codes make the pad weights +0)
MXFP4_PAD_SCALE_BYTE = int(np.log2(QPNMX.pad_scale)) + E8M0_BIAS




class PackedWeight:
    """One linear's packed buffers and their operations (module docstring). Build one with the
    layout's `prepack` / `from_checkpoint` / `quantize`, or from buffers a packed file or module holds."""

    weight_format: ClassVar[WeightFormat]

    __slots__ = ("buffers", "in_features", "out_features")

    def __init__(self, buffers: Mapping[str, Tensor], in_features: int, out_features: int) -> None:
        """`buffers`: the description's buffers by name, shapes of the padded [N_pad, K] weight; checked
        here on metadata only (names, dtypes, shapes, one device): values are prepack's to check."""
        wf = self.weight_format
        k, n = int(in_features), int(out_features)
        if len(buffers) != len(wf.buffers) or any(b.name not in buffers for b in wf.buffers):
            raise ValueError(f"a {wf.label} weight holds the buffers {[b.name for b in wf.buffers]}, got "
                             f"{sorted(buffers)}; pass what the layout's prepack returned")
        n_pad = int(buffers["codes"].shape[0]) if isinstance(buffers.get("codes"), Tensor) else -1
        # N_pad: N rounded up to whole tiles, at most to the layout's multiple (fused vLLM shards with
        # 128x128 blocks keep each shard's 32-row tiles: N_pad = N there)
        if n <= 0 or n_pad % TILE_N or not n <= n_pad <= wf.padded_n(n):
            raise ValueError(f"codes has {n_pad} rows, which cannot hold out_features {n} for {wf.label} (N padded "
                             f"to whole {TILE_N}-row tiles, at most to {wf.padded_n(n)}); pass the N the buffers "
                             "were packed for")
        for b in wf.buffers:
            t = buffers[b.name]
            dtype = buffer_dtype(b)
            if not isinstance(t, Tensor) or t.dtype != dtype or tuple(t.shape) != b.shape(n_pad, k):
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{wf.label} buffer {b.name} must be {dtype} {b.shape(n_pad, k)} for N_pad={n_pad}, "
                                 f"K={k}, got {got}")
        if len({t.device for t in buffers.values()}) != 1:
            raise ValueError(f"a {wf.label} weight's buffers must share one device, got "
                             f"{ {name: str(t.device) for name, t in buffers.items()} }")
        self.buffers = {b.name: buffers[b.name] for b in wf.buffers}  # the description's order
        self.in_features, self.out_features = k, n

    @classmethod
    def over(cls, buffers: Mapping[str, Tensor], in_features: int, out_features: int) -> PackedWeight:
        """A packed weight over buffers a module already holds in the description's order, without the
        constructor's metadata checks (QPNLinear builds one per forward: 13 us of checks on a CPU core);
        the ops check the same metadata at every call."""
        packed = cls.__new__(cls)
        packed.buffers, packed.in_features, packed.out_features = dict(buffers), in_features, out_features
        return packed

    # ------------------------------------------------------------------ what it is

    @property
    def format(self) -> str:
        """The public format name ("nvfp4" | "fp8"), also the prefix of its ops (torch.ops.qpn.<format>_linear)."""
        return self.weight_format.format

    @property
    def codes(self) -> Tensor:
        return self.buffers["codes"]

    @property
    def padded_out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> tuple[Tensor, ...]:
        """The buffers in the description's order: the op's arguments after x."""
        return tuple(self.buffers.values())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(in_features={self.in_features}, out_features={self.out_features}, "
                f"device={self.device})")

    # ------------------------------------------------------------------ operations

    def linear(self, x: Tensor, gated: bool = False) -> Tensor:
        """x fp16 [M, K] -> fp16 [M, N_pad] ([M, N_pad/2] gated): the layout's op (CPU: numba; CUDA: CuPy)."""
        op: Callable[..., Tensor] = getattr(torch.ops.qpn, f"{self.format}_linear")
        return op(x, *self.tensors(), gated)

    def dequantize(self) -> Tensor:
        """float16 [N, K]: the W16 every path computes with, pad rows cropped (the op's backends)."""
        op: Callable[..., Tensor] = getattr(torch.ops.qpn, f"{self.format}_dequantize")
        return op(*self.tensors())[: self.out_features]

    def reference_dequantize(self) -> np.ndarray:
        """float16 [N, K] from qpn.ref (numpy): the reference backend of the same W16."""
        raise NotImplementedError

    def to(self, device: torch.device | str) -> PackedWeight:
        return type(self)({name: t.to(device) for name, t in self.buffers.items()}, self.in_features,
                          self.out_features)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_checkpoint(cls, linear: CheckpointLinear) -> PackedWeight:
        """A qpn.checkpoints NVFP4Linear / FP8Linear (global scales already multipliers), prepacked on the CPU."""
        return packed_weight_class(linear.weight_format)._from_checkpoint(linear)

    @classmethod
    def _from_checkpoint(cls, linear: CheckpointLinear) -> PackedWeight:
        raise NotImplementedError

    @classmethod
    def stack_rows(cls, parts: Sequence[PackedWeight]) -> PackedWeight:
        """One weight of `parts` stacked along N (fused shards: gate then up, q / k / v), each part's rows
        cropped to whole 32-row tiles first (a block-scaled part of 64 rows keeps its 64: the layouts hold
        one scale per tile and column group, so a tile boundary is a clean cut). Every part must share the
        layout and K, and hold N % 32 == 0 rows of weights."""
        first = parts[0]
        wf = first.weight_format
        for part in parts:
            if part.weight_format is not wf or part.in_features != first.in_features or part.out_features % TILE_N:
                raise ValueError(f"stacked parts must share one layout and K and hold whole {TILE_N}-row tiles, got "
                                 f"{[(p.weight_format.label, p.out_features, p.in_features) for p in parts]}")
        k = first.in_features
        buffers = {}
        for b in wf.buffers:
            axis = next(i for i, (one, two) in enumerate(zip(b.shape(TILE_N, k), b.shape(2 * TILE_N, k), strict=True))
                        if one != two)  # the buffer's N axis
            cuts = [p.buffers[b.name].narrow(axis, 0, b.shape(p.out_features, k)[axis]) for p in parts]
            buffers[b.name] = torch.cat(cuts, dim=axis).contiguous()
        return type(first)(buffers, k, sum(p.out_features for p in parts))

    @classmethod
    def from_packed_layer(cls, layer: PackedLayer, device: torch.device | str = "cpu") -> PackedWeight:
        """A layer of a qpn packed folder (qpn.checkpoints.packed.load_packed), its buffers copied to `device`."""
        wf = layer.weight_format
        arrays = zip(wf.buffers, layer.kernel_buffers(), strict=True)
        # np.array: a writable copy of the (read-only, mapped) bytes
        return packed_weight_class(wf)({b.name: torch.from_numpy(np.array(a)).to(device) for b, a in arrays},
                                       layer.k, layer.n)

    @classmethod
    def quantize(cls, w: np.ndarray, wf: WeightFormat, granularity: str | None = None) -> PackedWeight:
        """An fp32 [N, K] weight quantized with qpn.ref's quantizers for layout `wf` (FP8: at `granularity`,
        one of the layout's; default its widest), then packed."""
        return packed_weight_class(wf)._quantize(w, granularity)

    @classmethod
    def _quantize(cls, w: np.ndarray, granularity: str | None) -> PackedWeight:
        raise NotImplementedError


class QPN2Weight(PackedWeight):
    """NVFP4 in the QPN2 layout: codes u8 [N_pad, K/2], scales u8 [N_pad, K/16], global_scale f32 [N_pad/32]."""

    weight_format = QPN2
    __slots__ = ()

    def reference_dequantize(self) -> np.ndarray:
        codes, scales, g = (t.cpu().numpy() for t in self.tensors())
        return ref.qpn2_dequantize(codes, scales, g, self.padded_out_features, self.in_features)[: self.out_features]

    @classmethod
    def _from_checkpoint(cls, linear: CheckpointLinear) -> PackedWeight:
        assert isinstance(linear, checkpoints.NVFP4Linear)  # the table's choice: its weight_format is QPN2
        return pack_nvfp4(linear.weight_packed, linear.weight_scale, linear.global_scale)

    @classmethod
    def _quantize(cls, w: np.ndarray, granularity: str | None) -> PackedWeight:
        q = ref.nvfp4_quantize(w)
        return pack_nvfp4(q.weight_packed, q.weight_scale, q.weight_scale_2)


class QPN8Weight(PackedWeight):
    """FP8 in the QPN8 layout with tensor / channel scales: codes u8 [N_pad, K], group_scales f16 [1, N_pad]."""

    weight_format = QPN8
    __slots__ = ()

    def reference_dequantize(self) -> np.ndarray:
        codes, group_scales = (t.cpu().numpy() for t in self.tensors())
        return ref.qpn8_dequantize(codes, group_scales, self.padded_out_features, self.in_features)[
            : self.out_features]

    @classmethod
    def _from_checkpoint(cls, linear: CheckpointLinear) -> PackedWeight:
        assert isinstance(linear, checkpoints.FP8Linear)  # the table's choice: its weight_format is QPN8(_BLOCK)
        return pack_fp8(linear.weight, linear.weight_scale, linear.granularity)

    @classmethod
    def _quantize(cls, w: np.ndarray, granularity: str | None) -> PackedWeight:
        granularity = granularity or cls.weight_format.granularities[-1]  # QPN8: "channel"; QPN8_BLOCK: "block"
        if granularity not in cls.weight_format.granularities:
            raise ValueError(f"granularity {granularity!r} is not one of {cls.weight_format.label}'s "
                             f"{cls.weight_format.granularities}")
        q = ref.fp8_quantize(w, granularity)
        return pack_fp8(q.weight, q.weight_scale, granularity)


class QPN8BlockWeight(QPN8Weight):
    """FP8 in the QPN8 layout with 128x128 block scales: codes u8 [N_pad, K], group_scales f16 [K/128, N_pad/32]."""

    weight_format = QPN8_BLOCK
    __slots__ = ()


class QPNMXWeight(PackedWeight):
    """MXFP4 in the QPNMX layout: codes u8 [N_pad, K/2], scales u8 [N_pad, K/32], tile_scale f32 [N_pad/32]."""

    weight_format = QPNMX
    __slots__ = ()

    def reference_dequantize(self) -> np.ndarray:
        codes, scales, tile_scale = (t.cpu().numpy() for t in self.tensors())
        return ref.qpnmx_dequantize(codes, scales, tile_scale, self.padded_out_features, self.in_features)[
            : self.out_features]

    @classmethod
    def _from_checkpoint(cls, linear: CheckpointLinear) -> PackedWeight:
        assert isinstance(linear, checkpoints.MXFP4Linear)  # the table's choice: its weight_format is QPNMX
        return pack_mxfp4(linear.blocks, linear.scales)

    @classmethod
    def _quantize(cls, w: np.ndarray, granularity: str | None) -> PackedWeight:
        return pack_mxfp4(*ref.mxfp4_quantize(w))


_CLASSES: dict[str, type[PackedWeight]] = {c.weight_format.key: c for c in (QPN2Weight, QPN8Weight, QPN8BlockWeight,
                                                                            QPNMXWeight)}


def packed_weight_class(wf: WeightFormat) -> type[PackedWeight]:
    """The class of layout `wf` (the one table of layouts)."""
    return _CLASSES[wf.key]


def replacement_device(device: torch.device | str | None, old_device: torch.device) -> torch.device:
    """Where a module that replaces one on `old_device` goes (convert, load_quantized): the caller's
    `device`, else the old module's, else the CPU for a module on the meta device (no values there)."""
    if device is not None:
        return torch.device(device)
    return old_device if old_device.type != "meta" else torch.device("cpu")


def device_moves_only(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """`fn` as nn.Module._apply passes it, kept to device moves: the modules that hold packed buffers
    (QPNLinear, QPNExperts) let `model.half()` / `.to(torch.bfloat16)` change no buffer's dtype (they
    would round float32 global scales and the bias, and the ops would refuse them); the device follows."""

    def move_only(t: Tensor) -> Tensor:
        probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
        return fn(t) if probe.dtype == t.dtype else t.to(probe.device)

    return move_only


# ----------------------------------------------------------------------------- packing


def require_k(name: str, k: int, wf: WeightFormat) -> None:
    """K is never padded (it would change x): a K off the layout's multiple is refused with the fix."""
    if k <= 0 or k % wf.k_multiple != 0:
        block = wf is QPN8_BLOCK
        fix = "pad the input features (and the scale grid) to whole 128x128 blocks" if block else \
            PAD_INPUT_FEATURES_FIX
        raise ValueError(f"{name} must be a positive multiple of {wf.k_multiple} for {wf.format}"
                         f"{' with block scales' if block else ''}, got {k}; {fix}")


def as_tensor(name: str, value: object, device: torch.device | None = None) -> Tensor:
    """torch.Tensor or numpy array (numpy carriers as qpn.ref uses them) -> torch.Tensor, no casts."""
    if isinstance(value, Tensor):
        tensor = value.detach()
    elif isinstance(value, (np.ndarray, np.generic)):
        tensor = torch.from_numpy(np.array(value))  # a writable copy (checkpoint arrays are read-only memmaps)
    else:
        raise ValueError(f"{name} must be a torch.Tensor or numpy array, got {type(value).__name__}")
    return tensor if device is None else tensor.to(device)


def _e4m3_bits(name: str, value: object, device: torch.device | None = None) -> Tensor:
    tensor = as_tensor(name, value, device)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8)
    if tensor.dtype != torch.uint8:
        raise ValueError(f"{name} must be torch.float8_e4m3fn or uint8 e4m3 bit patterns, got {tensor.dtype}; "
                         "pass the checkpoint tensor unchanged")
    return tensor


def float32(name: str, value: object, device: torch.device | None = None) -> Tensor:
    if type(value) is float:  # a Python float is taken as fp32; numpy float64 is refused below
        value = np.float32(value)
    tensor = as_tensor(name, value, device)
    if tensor.dtype != torch.float32:
        raise ValueError(f"{name} must be float32 (checkpoints store fp32 scales), got {tensor.dtype}; "
                         "pass it unchanged (np.float32(x) for a Python float)")
    return tensor


def _pad_rows(t: Tensor, rows: int, fill: float) -> Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=0).contiguous()


def pack_nvfp4(weight_packed: ArrayIn, weight_scale: ArrayIn, global_scale: ScaleIn) -> QPN2Weight:
    """ModelOpt-semantics NVFP4 -> QPN2Weight on weight_packed's device.

    weight_packed uint8 [N, K/2] (element 2j low nibble); weight_scale e4m3 [N, K/16]
    (float8_e4m3fn or uint8); global_scale float32 MULTIPLIER (ModelOpt weight_scale_2): a
    scalar, or [N/32] per 32-row tile (then N % 32 == 0). K % 64 == 0 (QPN2).
    """
    wp = as_tensor("weight_packed", weight_packed)
    device = wp.device
    ws = _e4m3_bits("weight_scale", weight_scale, device)
    g = float32("global_scale", global_scale, device)
    if wp.dtype != torch.uint8 or wp.dim() != 2:
        raise ValueError(f"weight_packed must be uint8 [N, K/2], got {wp.dtype} of shape {tuple(wp.shape)}")
    n, k = int(wp.shape[0]), QPN2.k_of_codes(int(wp.shape[1]))
    require_k("K (2 * weight_packed.shape[1])", k, QPN2)
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
                                                _pad_rows(ws, n_pad, NVFP4_PAD_SCALE_BYTE))
    return QPN2Weight({"codes": codes, "scales": scales, "global_scale": g_tiles.contiguous().clone()}, k, n)


def pack_fp8(weight: ArrayIn, weight_scale: ScaleIn, granularity: str | None = None) -> QPN8Weight:
    """FP8 (e4m3 weight [N, K], float32 MULTIPLIER scale per tensor / channel / 128x128 block)
    -> QPN8Weight (QPN8BlockWeight for block scales) on weight's device. granularity: None reads
    it from the scale's shape. The rule is qpn.ref.fp8_scale_granularity's, for one-value scales
    too: unstated, a size-1 scale is per tensor; a stated "block" of a one-block weight stays block
    (N padded to 128, group_scales [1, N_pad/32]), the buffers `qpn pack` writes for it."""
    w = _e4m3_bits("weight", weight)
    device = w.device
    s = float32("weight_scale", weight_scale, device)
    if w.dim() != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(f"weight must be 2-D [N, K] with N, K >= 1, got shape {tuple(w.shape)}")
    n, k = int(w.shape[0]), int(w.shape[1])
    granularity = ref.fp8_scale_granularity(s, n, k, granularity)  # the shape only; N is padded below
    wf = weight_format(QPN8.format, granularity)
    require_k("K", k, wf)
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
    packed = packed_weight_class(wf)({"codes": codes, "group_scales": group_scales}, k, n)
    assert isinstance(packed, QPN8Weight)  # the table's FP8 classes (QPN8BlockWeight is one)
    return packed


def pack_mxfp4(blocks: ArrayIn, scales: ArrayIn) -> QPNMXWeight:
    """OCP MXFP4 -> QPNMXWeight on blocks' device.

    blocks uint8 [N, K/32, 16] (gpt-oss's *_blocks of one weight; element 2j of a block in the low
    nibble) or [N, K/2] (the same bytes row by row); scales e8m0 uint8 [N, K/32]. K % 64 == 0 (QPNMX).
    Pad rows get code 0x00 and scale byte 0x00 (2^-127: +0 weights that never raise a tile's 2^T).
    The prepack refuses e8m0 NaN bytes (0xFF); no value overflows (docs/DESIGN.md, "MXFP4 weight").
    """
    b = as_tensor("blocks", blocks)
    device = b.device
    s = as_tensor("scales", scales, device)
    if b.dtype != torch.uint8 or s.dtype != torch.uint8 or b.dim() not in (2, 3) or b.shape[0] == 0:
        raise ValueError(f"blocks must be uint8 [N, K/32, 16] or [N, K/2] and scales uint8 [N, K/32], got blocks "
                         f"{b.dtype} {tuple(b.shape)} and scales {s.dtype} {tuple(s.shape)}; pass the checkpoint's "
                         "tensors unchanged")
    n, k = int(b.shape[0]), QPNMX.k_of_codes(int(b[0].numel()))
    require_k("K (2 * bytes per row of blocks)", k, QPNMX)
    b = b.reshape(n, k // MX_BLOCK, MX_BLOCK // 2)
    n_pad = QPNMX.padded_n(n)
    codes, packed_scales, tile_scale = torch.ops.qpn.mxfp4_prepack(_pad_rows(b, n_pad, QPNMX.pad_code),
                                                                   _pad_rows(s, n_pad, MXFP4_PAD_SCALE_BYTE))
    packed = QPNMXWeight({"codes": codes, "scales": packed_scales, "tile_scale": tile_scale}, k, n)
    return packed
