"""The `qpn` torch custom ops: prepack, dequantize and linear for NVFP4 (QPN2), FP8 (QPN8) and MXFP4 (QPNMX).

    qpn::nvfp4_prepack(Tensor weight_packed, Tensor weight_scale) -> (Tensor codes, Tensor scales)
    qpn::fp8_prepack(Tensor weight, Tensor weight_scale) -> (Tensor codes, Tensor group_scales)
    qpn::mxfp4_prepack(Tensor blocks, Tensor scales) -> (Tensor codes, Tensor scales, Tensor tile_scale)
    qpn::nvfp4_dequantize(Tensor codes, Tensor scales, Tensor global_scale) -> Tensor   fp16 [N, K]
    qpn::fp8_dequantize(Tensor codes, Tensor group_scales) -> Tensor                    fp16 [N, K]
    qpn::mxfp4_dequantize(Tensor codes, Tensor scales, Tensor tile_scale) -> Tensor     fp16 [N, K]
    qpn::nvfp4_linear(Tensor x, Tensor codes, Tensor scales, Tensor global_scale, bool gated=False) -> Tensor
    qpn::fp8_linear(Tensor x, Tensor codes, Tensor group_scales, bool gated=False) -> Tensor
    qpn::mxfp4_linear(Tensor x, Tensor codes, Tensor scales, Tensor tile_scale, bool gated=False) -> Tensor

Tensors (N output features, K input features; layouts in docs/QPN2.md and docs/QPN8.md):
- weight_packed uint8 [N, K/2] (ModelOpt, element 2j in the low nibble); weight_scale e4m3
  [N, K/16] as torch.float8_e4m3fn or uint8 (read as bits); N % 32 == 0, K % 64 == 0.
- weight e4m3 [N, K] (float8_e4m3fn or uint8); weight_scale float32 () / (1,) / (1, 1) per
  tensor, (N,) / (N, 1) per channel (N % 32, K % 16), or (N/128, K/128) per 128x128 block
  (N % 128, K % 128).
- codes uint8 [N, K/2] (QPN2) or [N, K] (QPN8); scales uint8 [N, K/16] (QPN2);
  group_scales float16 [1, N] or [K/128, N/32] (QPN8).
- global_scale float32, a multiplier (ModelOpt's weight_scale_2): size 1 (shape () or (1,))
  or one value per 32-column tile ([N/32]).
- MXFP4 (gpt-oss): blocks uint8 [N, K/32, 16] (element 2j of a block in the low nibble), scales
  uint8 e8m0 [N, K/32]; packed: codes uint8 [N, K/2], scales uint8 [N, K/32] (lane order),
  tile_scale float32 [N/32] = 2^T. Its dequantize returns the W16 of the reduced weight (2^-T times
  the weight, which fp16 cannot always hold); the linear multiplies each tile's fp32 sums by 2^T
  before the one RN16 (docs/DESIGN.md, "MXFP4 weight").
- x float16 or bfloat16 [M, K], contiguous; M = 0 gives an empty [0, N] result. Output in x's dtype
  [M, N], or [M, N/2] with gated=True (N % 64 == 0: gate rows [0, N/2), up rows [N/2, N)).

Numerics (docs/DESIGN.md, "Numerics contract"): every path sees the same W16;
y = RN16(fp32-accumulated sum of x * W16); gated: out = RN16(RN16(silu32(gate)) * up) on the fp16
linear result. bf16 x: each RN16 an RN_bf16 (docs/DESIGN.md, "bf16 activations"); on CUDA every path
runs it as fp16 rows times a power of two (exact), applied back before the RN_bf16.

Dispatch. Each op has a CPU side (`_cpu_ops.py` over the numba kernels of `_cpu.py`) and a CUDA
side (CuPy over DLPack, `_cuda.py`; CuPy is imported only when a CUDA tensor arrives, so the package imports on
machines without it). The linear ops choose their path (CUDA: decode, GEMM or dense; CPU: fused or
decode-then-BLAS) INSIDE the op, from M and the shape at run time (dispatch.choose, the measured table
of the device family): torch.compile sees one opaque op
whose output shape does not depend on the branch, so a graph traced at one M is correct at
every M (a Python branch in forward would be baked into the graph at the warm-up M).

Validation (ValueError naming the argument, the rule, the value and the fix) runs on metadata
only - dtype, shape, device, contiguity - so it never synchronizes a GPU. Values (NaN scale
bytes, fp16 overflow, global scales <= 0) are checked once, at prepack time and by the packers
(packed_weight.py: pack_nvfp4, pack_fp8), not on every call.
"""

from __future__ import annotations

from types import ModuleType
from typing import NoReturn

import torch
from torch import Tensor

from .. import ref
from ..ref.checks import require_multiple
from ..ref.formats import MX_BLOCK, QPN2, QPN8, QPN8_BLOCK, QPNMX, WeightFormat, weight_format
from ..ref.geometry import GROUP_K, TILE_N
from . import _cpu_ops

_E4M3_DTYPES = (torch.uint8, torch.float8_e4m3fn)
# the activations' dtypes of the linear and MoE ops; the output has x's (docs/DESIGN.md, "bf16 activations")
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- validation


def _fail(message: str) -> NoReturn:
    raise ValueError(message)


def require_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], ndim: int | tuple[int, ...] | None = None,
                    contiguous: bool = True) -> None:
    if not isinstance(t, Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        _fail(f"{name} must have dtype {want}, got {t.dtype}; {_dtype_fix(name, dtypes)}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        _fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        _fail(f"{name} must be contiguous (row-major), got strides {t.stride()} for shape {tuple(t.shape)}; "
              f"call .contiguous() on it")


def _dtype_fix(name: str, dtypes: tuple[torch.dtype, ...]) -> str:
    if torch.float16 in dtypes and name == "x":
        return ("cast the activations with x.to(torch.float16) or x.to(torch.bfloat16) (QPNLinear casts other "
                "float dtypes to float16 for you)")
    if torch.uint8 in dtypes:
        return "pass the e4m3 / packed bytes as uint8 (or float8_e4m3fn), never as converted values"
    return "pass the tensor the prepack / checkpoint produced, unchanged"


def require_same_device(**tensors: Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            _fail(f"{name} is on {device} but {first_name} is on {first}; move every tensor of the op to one "
                  f"device (module.to(device) moves the QPNLinear buffers)")
    return first


# K is the input features here: the fix says so (ref's k_fix says "pad K"); a padded K changes x
PAD_INPUT_FEATURES_FIX = "pad the input features with zero columns"


def _require_dims(wf: WeightFormat, n: int, k: int, n_where: str, k_where: str) -> None:
    """wf.require_dims, with the K fix in the words of a torch user."""
    require_multiple("N", n, wf.n_multiple, wf.layout_label(n_where), wf.n_fix)
    require_multiple("K", k, wf.k_multiple, wf.layout_label(k_where), PAD_INPUT_FEATURES_FIX)


def _nvfp4_dims_of_checkpoint(weight_packed: Tensor, weight_scale: Tensor) -> tuple[int, int]:
    require_tensor("weight_packed", weight_packed, (torch.uint8,), ndim=2)
    require_tensor("weight_scale", weight_scale, _E4M3_DTYPES, ndim=2)
    require_same_device(weight_packed=weight_packed, weight_scale=weight_scale)
    n, k = weight_packed.shape[0], QPN2.k_of_codes(weight_packed.shape[1])
    _require_dims(QPN2, n, k, "weight_packed.shape[0]", "K = 2 * weight_packed.shape[1]")
    if tuple(weight_scale.shape) != (n, k // GROUP_K):  # the checkpoint's: one e4m3 scale per 16 weights
        _fail(f"weight_scale must have shape (N, K/16) = ({n}, {k // GROUP_K}) for weight_packed of shape "
              f"{tuple(weight_packed.shape)}, got {tuple(weight_scale.shape)}; NVFP4 has one scale per 16 weights")
    return n, k


def nvfp4_dims(codes: Tensor, scales: Tensor, global_scale: Tensor) -> tuple[int, int]:
    """Validate QPN2 buffers; returns (N, K)."""
    require_tensor("codes", codes, (torch.uint8,), ndim=2)
    require_tensor("scales", scales, (torch.uint8,), ndim=2)
    require_tensor("global_scale", global_scale, (torch.float32,), ndim=(0, 1))
    n, k = codes.shape[0], QPN2.k_of_codes(codes.shape[1])
    _require_dims(QPN2, n, k, "codes.shape[0]", "K = 2 * codes.shape[1]")
    shapes = QPN2.buffer_shapes(n, k)
    if tuple(scales.shape) != shapes["scales"]:
        _fail(f"scales must have shape (N, K/16) = {shapes['scales']} for codes of shape {tuple(codes.shape)}, "
              f"got {tuple(scales.shape)}; pass the pair that nvfp4_prepack returned")
    if global_scale.numel() != 1 and tuple(global_scale.shape) != shapes["global_scale"]:
        _fail(f"global_scale must hold one float32 (shape () or (1,)) or one per 32-column tile (shape "
              f"{shapes['global_scale']} for N={n}), got shape {tuple(global_scale.shape)}; give each fused shard "
              "its own value per tile of 32 rows")
    return n, k


def _fp8_dims_of_checkpoint(weight: Tensor, weight_scale: Tensor) -> tuple[int, int, str]:
    require_tensor("weight", weight, _E4M3_DTYPES, ndim=2)
    require_tensor("weight_scale", weight_scale, (torch.float32,), ndim=(0, 1, 2))
    require_same_device(weight=weight, weight_scale=weight_scale)
    n, k = int(weight.shape[0]), int(weight.shape[1])
    # The shape rule (and the alignment rule that goes with it) is ref's; it reads only the
    # shape, never the (possibly device or fake) data.
    granularity = ref.qpn8_scale_granularity(weight_scale, n, k)
    return n, k, granularity


def _fp8_group_scales_shape(n: int, k: int, granularity: str) -> tuple[int, ...]:
    return weight_format("fp8", granularity).buffer("group_scales").shape(n, k)


def fp8_dims(codes: Tensor, group_scales: Tensor) -> tuple[int, int]:
    """Validate QPN8 buffers; returns (N, K). Their layout (QPN8 or QPN8_BLOCK) is `fp8_layout`'s."""
    require_tensor("codes", codes, (torch.uint8,), ndim=2)
    require_tensor("group_scales", group_scales, (torch.float16,), ndim=2)
    n, k = codes.shape[0], QPN8.k_of_codes(codes.shape[1])
    # QPN8's N / K rule for every granularity: a fused layer of 64-row block-scaled shards keeps
    # N % 32 (QPN8_BLOCK's N % 128 is the packer's, per shard); block scales add K % 128
    _require_dims(QPN8, n, k, "codes.shape[0]", "codes.shape[1]")
    shape = tuple(group_scales.shape)
    channel, block = (wf.buffer("group_scales").shape(n, k) for wf in (QPN8, QPN8_BLOCK))
    if shape != channel and not (k % QPN8_BLOCK.k_multiple == 0 and shape == block):
        _fail(f"group_scales must be float16 [1, N] = {list(channel)} (channel / tensor scales) or [K/128, N/32] = "
              f"{list(block)} (128x128 block scales, K % 128 == 0) for codes of shape "
              f"{tuple(codes.shape)}, got {list(shape)}; pass what fp8_prepack returned")
    return n, k


def fp8_layout(group_scales: Tensor, n: int, k: int) -> WeightFormat:
    """QPN8 (channel / tensor scales [1, N]) or QPN8_BLOCK ([K/128, N/32]), from the validated shape."""
    return QPN8 if tuple(group_scales.shape) == QPN8.buffer("group_scales").shape(n, k) else QPN8_BLOCK


def _mxfp4_dims_of_checkpoint(blocks: Tensor, scales: Tensor) -> tuple[int, int]:
    require_tensor("blocks", blocks, (torch.uint8,), ndim=3)
    require_tensor("scales", scales, (torch.uint8,), ndim=2)
    require_same_device(blocks=blocks, scales=scales)
    n, k = int(blocks.shape[0]), MX_BLOCK * int(blocks.shape[1])
    if blocks.shape[2] != MX_BLOCK // 2:
        _fail(f"blocks must be [N, K/32, 16] (16 bytes: one block's 32 codes), got shape {tuple(blocks.shape)}; "
              "pass gpt-oss's *_blocks tensor of one weight (a checkpoint's [N, K/2] codes: reshape(N, K // 32, 16))")
    _require_dims(QPNMX, n, k, "blocks.shape[0]", "K = 32 * blocks.shape[1]")
    if tuple(scales.shape) != (n, k // MX_BLOCK):
        _fail(f"scales must have shape (N, K/32) = ({n}, {k // MX_BLOCK}) for blocks of shape {tuple(blocks.shape)}, "
              f"got {tuple(scales.shape)}; MXFP4 has one e8m0 scale per 32 weights")
    return n, k


def mxfp4_dims(codes: Tensor, scales: Tensor, tile_scale: Tensor) -> tuple[int, int]:
    """Validate QPNMX buffers; returns (N, K)."""
    require_tensor("codes", codes, (torch.uint8,), ndim=2)
    require_tensor("scales", scales, (torch.uint8,), ndim=2)
    require_tensor("tile_scale", tile_scale, (torch.float32,), ndim=1)
    n, k = codes.shape[0], QPNMX.k_of_codes(codes.shape[1])
    _require_dims(QPNMX, n, k, "codes.shape[0]", "K = 2 * codes.shape[1]")
    shapes = QPNMX.buffer_shapes(n, k)
    for name, t in (("scales", scales), ("tile_scale", tile_scale)):
        if tuple(t.shape) != shapes[name]:
            _fail(f"{name} must have shape {shapes[name]} for codes of shape {tuple(codes.shape)}, got "
                  f"{tuple(t.shape)}; pass the buffers mxfp4_prepack returned")
    return n, k


def _linear_out_features(x: Tensor, n: int, k: int, gated: bool) -> int:
    require_tensor("x", x, ACTIVATION_DTYPES, ndim=2)
    if x.shape[1] != k:
        _fail(f"x must be [M, K] with K = {k} (the weight's input features), got shape {tuple(x.shape)}; "
              "flatten leading dimensions into M (QPNLinear does this)")
    if gated:
        require_multiple("N", n, 2 * TILE_N, "gated=True (gate rows [0, N/2) and up rows [N/2, N) each "
                         "whole 32-column tiles)", "pad gate and up to a multiple of 32 rows each")
        return n // 2
    return n


def _cuda() -> ModuleType:
    from . import _cuda as cuda_backend  # imports no CuPy until a function there is called

    return cuda_backend


# ----------------------------------------------------------------------------- prepack


@torch.library.custom_op("qpn::nvfp4_prepack", mutates_args=(), device_types="cpu")
def nvfp4_prepack(weight_packed: Tensor, weight_scale: Tensor) -> tuple[Tensor, Tensor]:
    """ModelOpt NVFP4 (weight_packed uint8 [N, K/2], weight_scale e4m3 [N, K/16]) -> QPN2 (codes, scales).

    CPU: qpn.ref.qpn2_prepack (a byte permutation; rejects NaN scale bytes).
    """
    _nvfp4_dims_of_checkpoint(weight_packed, weight_scale)
    codes, scales = ref.qpn2_prepack(weight_packed.numpy(), weight_scale.view(torch.uint8).numpy())
    return torch.from_numpy(codes), torch.from_numpy(scales)


@nvfp4_prepack.register_kernel("cuda")
def _nvfp4_prepack_cuda(weight_packed: Tensor, weight_scale: Tensor) -> tuple[Tensor, Tensor]:
    n, k = _nvfp4_dims_of_checkpoint(weight_packed, weight_scale)
    codes, scales = _cuda().prepack(QPN2, (weight_packed, weight_scale.view(torch.uint8)), None, n, k)
    return codes, scales


@nvfp4_prepack.register_fake
def _nvfp4_prepack_fake(weight_packed: Tensor, weight_scale: Tensor) -> tuple[Tensor, Tensor]:
    n, k = _nvfp4_dims_of_checkpoint(weight_packed, weight_scale)
    shapes = QPN2.buffer_shapes(n, k)
    return (weight_packed.new_empty(shapes["codes"], dtype=torch.uint8),
            weight_packed.new_empty(shapes["scales"], dtype=torch.uint8))


@torch.library.custom_op("qpn::fp8_prepack", mutates_args=(), device_types="cpu")
def fp8_prepack(weight: Tensor, weight_scale: Tensor) -> tuple[Tensor, Tensor]:
    """FP8 (weight e4m3 [N, K], weight_scale float32 per tensor / channel / 128x128 block) -> QPN8
    (codes uint8 [N, K], group_scales float16 [1, N] or [K/128, N/32]).

    CPU: qpn.ref.qpn8_prepack (rejects NaN weight bytes, non-positive and overflowing scales).
    A size-1 scale is per tensor (a (1, 1) block grid of a 128x128 weight gives the same weights).
    """
    _fp8_dims_of_checkpoint(weight, weight_scale)
    codes, group_scales = ref.qpn8_prepack(weight.view(torch.uint8).numpy(), weight_scale.numpy())
    return torch.from_numpy(codes), torch.from_numpy(group_scales)


@fp8_prepack.register_kernel("cuda")
def _fp8_prepack_cuda(weight: Tensor, weight_scale: Tensor) -> tuple[Tensor, Tensor]:
    n, k, granularity = _fp8_dims_of_checkpoint(weight, weight_scale)
    codes, group_scales = _cuda().prepack(weight_format(QPN8.format, granularity),
                                          (weight.view(torch.uint8), weight_scale), granularity, n, k)
    return codes, group_scales


@fp8_prepack.register_fake
def _fp8_prepack_fake(weight: Tensor, weight_scale: Tensor) -> tuple[Tensor, Tensor]:
    n, k, granularity = _fp8_dims_of_checkpoint(weight, weight_scale)
    return (weight.new_empty(QPN8.buffer("codes").shape(n, k), dtype=torch.uint8),
            weight.new_empty(_fp8_group_scales_shape(n, k, granularity), dtype=torch.float16))


# ----------------------------------------------------------------------------- dequantize


@torch.library.custom_op("qpn::nvfp4_dequantize", mutates_args=(), device_types="cpu")
def nvfp4_dequantize(codes: Tensor, scales: Tensor, global_scale: Tensor) -> Tensor:
    """QPN2 buffers -> float16 [N, K] = RN16(RN32(e2m1 * RN32(e4m3 * g(n)))), byte-identical to
    qpn.ref.qpn2_dequantize."""
    require_same_device(codes=codes, scales=scales, global_scale=global_scale)
    n, k = nvfp4_dims(codes, scales, global_scale)
    return _cpu_ops.dequantize(QPN2, (codes, scales, global_scale), n, k)


@nvfp4_dequantize.register_kernel("cuda")
def _nvfp4_dequantize_cuda(codes: Tensor, scales: Tensor, global_scale: Tensor) -> Tensor:
    require_same_device(codes=codes, scales=scales, global_scale=global_scale)
    n, k = nvfp4_dims(codes, scales, global_scale)
    return _cuda().dequantize(QPN2, (codes, scales, global_scale.reshape(-1)), n, k)


@nvfp4_dequantize.register_fake
def _nvfp4_dequantize_fake(codes: Tensor, scales: Tensor, global_scale: Tensor) -> Tensor:
    n, k = nvfp4_dims(codes, scales, global_scale)
    return codes.new_empty((n, k), dtype=torch.float16)


@torch.library.custom_op("qpn::fp8_dequantize", mutates_args=(), device_types="cpu")
def fp8_dequantize(codes: Tensor, group_scales: Tensor) -> Tensor:
    """QPN8 buffers -> float16 [N, K] = RN16(e4m3 * 2^-8 * S16), byte-identical to qpn.ref.qpn8_dequantize."""
    require_same_device(codes=codes, group_scales=group_scales)
    n, k = fp8_dims(codes, group_scales)
    return _cpu_ops.dequantize(fp8_layout(group_scales, n, k), (codes, group_scales), n, k)


@fp8_dequantize.register_kernel("cuda")
def _fp8_dequantize_cuda(codes: Tensor, group_scales: Tensor) -> Tensor:
    require_same_device(codes=codes, group_scales=group_scales)
    n, k = fp8_dims(codes, group_scales)
    return _cuda().dequantize(fp8_layout(group_scales, n, k), (codes, group_scales), n, k)


@fp8_dequantize.register_fake
def _fp8_dequantize_fake(codes: Tensor, group_scales: Tensor) -> Tensor:
    n, k = fp8_dims(codes, group_scales)
    return codes.new_empty((n, k), dtype=torch.float16)


# ----------------------------------------------------------------------------- linear


@torch.library.custom_op("qpn::nvfp4_linear", mutates_args=(), device_types="cpu")
def nvfp4_linear(x: Tensor, codes: Tensor, scales: Tensor, global_scale: Tensor, gated: bool = False) -> Tensor:
    """x float16 / bfloat16 [M, K] times the QPN2 weight -> x's dtype [M, N] (or [M, N/2] gated).

    CPU: the numba kernels, fused or decode-then-fp32-matmul (_cpu_ops.linear, as dispatch.choose picks).
    """
    require_same_device(x=x, codes=codes, scales=scales, global_scale=global_scale)
    n, k = nvfp4_dims(codes, scales, global_scale)
    _linear_out_features(x, n, k, gated)
    return _cpu_ops.linear(QPN2, x, (codes, scales, global_scale), n, gated)


@nvfp4_linear.register_kernel("cuda")
def _nvfp4_linear_cuda(x: Tensor, codes: Tensor, scales: Tensor, global_scale: Tensor, gated: bool = False) -> Tensor:
    require_same_device(x=x, codes=codes, scales=scales, global_scale=global_scale)
    n, k = nvfp4_dims(codes, scales, global_scale)
    n_out = _linear_out_features(x, n, k, gated)
    return _cuda().linear(QPN2, x, (codes, scales, global_scale.reshape(-1)), n, k, n_out, gated)


@nvfp4_linear.register_fake
def _nvfp4_linear_fake(x: Tensor, codes: Tensor, scales: Tensor, global_scale: Tensor, gated: bool = False) -> Tensor:
    n, k = nvfp4_dims(codes, scales, global_scale)
    n_out = _linear_out_features(x, n, k, gated)
    return x.new_empty((x.shape[0], n_out))


@torch.library.custom_op("qpn::fp8_linear", mutates_args=(), device_types="cpu")
def fp8_linear(x: Tensor, codes: Tensor, group_scales: Tensor, gated: bool = False) -> Tensor:
    """x float16 / bfloat16 [M, K] times the QPN8 weight -> x's dtype [M, N] (or [M, N/2] gated)."""
    require_same_device(x=x, codes=codes, group_scales=group_scales)
    n, k = fp8_dims(codes, group_scales)
    _linear_out_features(x, n, k, gated)
    return _cpu_ops.linear(fp8_layout(group_scales, n, k), x, (codes, group_scales), n, gated)


@fp8_linear.register_kernel("cuda")
def _fp8_linear_cuda(x: Tensor, codes: Tensor, group_scales: Tensor, gated: bool = False) -> Tensor:
    require_same_device(x=x, codes=codes, group_scales=group_scales)
    n, k = fp8_dims(codes, group_scales)
    n_out = _linear_out_features(x, n, k, gated)
    return _cuda().linear(fp8_layout(group_scales, n, k), x, (codes, group_scales), n, k, n_out, gated)


@fp8_linear.register_fake
def _fp8_linear_fake(x: Tensor, codes: Tensor, group_scales: Tensor, gated: bool = False) -> Tensor:
    n, k = fp8_dims(codes, group_scales)
    n_out = _linear_out_features(x, n, k, gated)
    return x.new_empty((x.shape[0], n_out))


# ----------------------------------------------------------------------------- MXFP4


@torch.library.custom_op("qpn::mxfp4_prepack", mutates_args=(), device_types="cpu")
def mxfp4_prepack(blocks: Tensor, scales: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """gpt-oss MXFP4 (blocks uint8 [N, K/32, 16], scales e8m0 uint8 [N, K/32]) -> QPNMX (codes, scales,
    tile_scale). CPU: qpn.ref.mxfp4.qpnmx_prepack (byte permutations; rejects e8m0 NaN bytes 0xFF)."""
    _mxfp4_dims_of_checkpoint(blocks, scales)
    return tuple(torch.from_numpy(a) for a in ref.qpnmx_prepack(blocks.numpy(), scales.numpy()))  # type: ignore[return-value]


@mxfp4_prepack.register_kernel("cuda")
def _mxfp4_prepack_cuda(blocks: Tensor, scales: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    n, k = _mxfp4_dims_of_checkpoint(blocks, scales)
    codes, packed_scales, tile_scale = _cuda().prepack(QPNMX, (blocks, scales), None, n, k)
    return codes, packed_scales, tile_scale


@mxfp4_prepack.register_fake
def _mxfp4_prepack_fake(blocks: Tensor, scales: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    n, k = _mxfp4_dims_of_checkpoint(blocks, scales)
    shapes = QPNMX.buffer_shapes(n, k)
    return (blocks.new_empty(shapes["codes"]), blocks.new_empty(shapes["scales"]),
            blocks.new_empty(shapes["tile_scale"], dtype=torch.float32))


@torch.library.custom_op("qpn::mxfp4_dequantize", mutates_args=(), device_types="cpu")
def mxfp4_dequantize(codes: Tensor, scales: Tensor, tile_scale: Tensor) -> Tensor:
    """QPNMX buffers -> float16 [N, K]: the reduced W16 (times each tile's 2^T: the weight), byte-identical to
    qpn.ref.mxfp4.qpnmx_dequantize."""
    require_same_device(codes=codes, scales=scales, tile_scale=tile_scale)
    n, k = mxfp4_dims(codes, scales, tile_scale)
    return _cpu_ops.dequantize(QPNMX, (codes, scales, tile_scale), n, k)


@mxfp4_dequantize.register_kernel("cuda")
def _mxfp4_dequantize_cuda(codes: Tensor, scales: Tensor, tile_scale: Tensor) -> Tensor:
    require_same_device(codes=codes, scales=scales, tile_scale=tile_scale)
    n, k = mxfp4_dims(codes, scales, tile_scale)
    return _cuda().dequantize(QPNMX, (codes, scales, tile_scale), n, k)


@mxfp4_dequantize.register_fake
def _mxfp4_dequantize_fake(codes: Tensor, scales: Tensor, tile_scale: Tensor) -> Tensor:
    n, k = mxfp4_dims(codes, scales, tile_scale)
    return codes.new_empty((n, k), dtype=torch.float16)


@torch.library.custom_op("qpn::mxfp4_linear", mutates_args=(), device_types="cpu")
def mxfp4_linear(x: Tensor, codes: Tensor, scales: Tensor, tile_scale: Tensor, gated: bool = False) -> Tensor:
    """x float16 / bfloat16 [M, K] times the QPNMX weight -> x's dtype [M, N] (or [M, N/2] gated)."""
    require_same_device(x=x, codes=codes, scales=scales, tile_scale=tile_scale)
    n, k = mxfp4_dims(codes, scales, tile_scale)
    _linear_out_features(x, n, k, gated)
    return _cpu_ops.linear(QPNMX, x, (codes, scales, tile_scale), n, gated)


@mxfp4_linear.register_kernel("cuda")
def _mxfp4_linear_cuda(x: Tensor, codes: Tensor, scales: Tensor, tile_scale: Tensor, gated: bool = False) -> Tensor:
    require_same_device(x=x, codes=codes, scales=scales, tile_scale=tile_scale)
    n, k = mxfp4_dims(codes, scales, tile_scale)
    n_out = _linear_out_features(x, n, k, gated)
    return _cuda().linear(QPNMX, x, (codes, scales, tile_scale), n, k, n_out, gated)


@mxfp4_linear.register_fake
def _mxfp4_linear_fake(x: Tensor, codes: Tensor, scales: Tensor, tile_scale: Tensor, gated: bool = False) -> Tensor:
    n, k = mxfp4_dims(codes, scales, tile_scale)
    n_out = _linear_out_features(x, n, k, gated)
    return x.new_empty((x.shape[0], n_out))
