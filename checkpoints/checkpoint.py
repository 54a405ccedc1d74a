"""The in-memory form of a quantized checkpoint: one validated object per linear layer.

Both producers' readers (qpn.checkpoints.modelopt, qpn.checkpoints.compressed_tensors) build these
and `save_checkpoint` writes them; every field is checked when the object is made, so a linear
that exists is a valid one.

Data model (frozen dataclasses; arrays are numpy, e4m3 travels as uint8 bit patterns):

- `NVFP4Linear(name, weight_packed, weight_scale, global_scale, input_scale=None)`:
  weight_packed uint8 [N, K/2] (element 2j in the LOW nibble), weight_scale uint8 e4m3 bits
  [N, K/16], global_scale float32 0-d, input_scale float32 0-d or None.
  Convention: global_scale and input_scale are MULTIPLIERS, i.e. ModelOpt's `weight_scale_2`
  and `input_scale`; value = e2m1 * e4m3(scale) * global_scale (docs/FORMATS.md).
- `FP8Linear(name, weight, weight_scale, granularity, input_scale=None, scale_name="weight_scale")`:
  weight uint8 e4m3 bits [N, K]; weight_scale float32, a multiplier: 0-d ("tensor"), [N]
  ("channel"; [N, 1] on disk is accepted and flattened) or [ceil(N/128), ceil(K/128)]
  ("block"; ModelOpt 0.47's FP8_PB_WO export writes [ceil(N/128), 1, ceil(K/128), 1], and a 0-d
  scale for a weight of one block: both accepted and reshaped, same values, same order).
  `scale_name` is the on-disk name, "weight_scale" or "weight_scale_inv" (block checkpoints in
  the DeepSeek style; a multiplier despite the name), kept so saving writes it back.
- `MXFP4Linear(name, blocks, scales, input_scale=None)`: OCP MXFP4 (compressed-tensors'
  mxfp4-pack-quantized): blocks uint8 [N, K/32, 16] as gpt-oss's `*_blocks` (element 2j of a
  block in the LOW nibble; compressed-tensors' weight_packed [N, K/2] is accepted and viewed so,
  `weight_packed` gives it back), scales uint8 e8m0 [N, K/32] (value = e2m1 * 2^(s - 127)); no
  global scale. The e8m0 NaN byte 0xFF is refused.
- `Checkpoint(format, quant_algo, linears, tensors, config, hf_quant_config=None, experts={})`:
  format "modelopt" | "compressed-tensors" | "gpt-oss"; quant_algo as the config says it, upper-cased
  ("NVFP4", "W4A16_NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MIXED_PRECISION";
  "NVFP4" or "MXFP4" for compressed-tensors); linears {layer name: QuantizedLinear, i.e.
  NVFP4Linear | FP8Linear | MXFP4Linear};
  tensors {name: StoredTensor} = everything else (biases, embeddings, norms, unquantized
  weights, kv-cache scales), kept with their dtype tags; config = config.json as a dict ({} if
  absent); hf_quant_config = hf_quant_config.json as a dict, or None; experts {experts path:
  MXFP4Experts} = stacked experts stored as such (gpt-oss's MXFP4, quant_algo "MXFP4": gpt_oss.py;
  their tensors are not in `tensors`), empty for the per-linear producers.

The value rules each linear checks: exact dtypes, weight_scale shape [N, K/16] for weight [N, K/2],
MXFP4 scales [N, K/32] without the e8m0 NaN byte 0xFF, FP8 scale shape by granularity, no NaN e4m3
codes (0x7F/0xFF) in block scales or FP8 weights, global scales and FP8 weight scales finite and > 0
(as fp8_dequantize requires), NVFP4 block scales non-negative (`checks.require_nvfp4_block_scales`: no
sign bit). A field that breaks one raises `FieldError`, whose `role` lets a reader name the tensor and
file behind it (`CheckpointError`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, overload

import numpy as np

from ..ref.checks import (
    FileError,
    require_no_nan_e4m3,
    require_no_nan_e8m0,
    require_nvfp4_block_scales,
    require_positive_scale,
)
from ..ref.formats import FP8_BLOCK, FP8_GRANULARITIES, MX_BLOCK, QPN2, QPN8, QPNMX, WeightFormat, weight_format
from ..ref.fp8 import fp8_block_grid, fp8_block_grid_4d
from ..ref.geometry import GROUP_K
from ..ref.mxfp4 import mxfp4_tile_exponents
from .safetensors_io import StoredTensor, as_stored_tensor

CHECKPOINT_FORMATS = ("modelopt", "compressed-tensors", "gpt-oss")
# the quant_algo names of a Checkpoint (ModelOpt's; a compressed-tensors checkpoint is "NVFP4")
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
FP8_GRANULARITY_OF_ALGO = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel", "FP8_PB_WO": "block"}
LAYER_ALGOS = NVFP4_ALGOS + tuple(FP8_GRANULARITY_OF_ALGO)
FP8_SCALE_NAMES = ("weight_scale", "weight_scale_inv")


class CheckpointError(FileError):
    """A checkpoint breaks a rule (`FileError`: path is the file at fault, tensor the tensor or config entry)."""


class FieldError(ValueError):
    """A dataclass field is invalid; `role` lets the loader name the tensor and file behind it."""

    def __init__(self, role: str, message: str):
        self.role = role
        super().__init__(message)


@overload
def _scalar_f32(value: object, owner: str, role: str, *, positive: bool, optional: Literal[False] = False
                ) -> np.ndarray: ...
@overload
def _scalar_f32(value: object, owner: str, role: str, *, positive: bool, optional: bool) -> np.ndarray | None: ...
def _scalar_f32(value: object, owner: str, role: str, *, positive: bool, optional: bool = False
                ) -> np.ndarray | None:
    """0-d float32 from a float32 array / numpy scalar of size 1 (nothing is cast)."""
    if value is None:
        if optional:
            return None
        raise FieldError(role, f"{owner}: {role} is required (a float32 scalar), got None")
    array = np.asarray(value) if isinstance(value, (np.ndarray, np.generic)) else None
    if array is None or array.dtype != np.float32 or array.size != 1 or array.ndim > 1:
        got = f"dtype {array.dtype}, shape {array.shape}" if array is not None else type(value).__name__
        raise FieldError(
            role,
            f"{owner}: {role} must be a float32 scalar (shape () or (1,)), got {got}; "
            "checkpoints store it as fp32 - pass it unchanged (np.float32(x) for a Python float)",
        )
    array = array.reshape(())
    ok = np.isfinite(array) and (array > 0 if positive else array >= 0)
    if not ok:
        raise FieldError(role, f"{owner}: {role} must be finite and {'> 0' if positive else '>= 0'}, got {array}")
    return array


def _uint8_matrix(value: object, owner: str, role: str, what: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype != np.uint8 or value.ndim != 2:
        got = f"dtype {value.dtype}, shape {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
        raise FieldError(role, f"{owner}: {role} must be a 2-D uint8 array ({what}), got {got}; "
                                "view float8 data as uint8")
    if value.shape[0] == 0 or value.shape[1] == 0:
        raise FieldError(role, f"{owner}: {role} must not be empty, got shape {value.shape}")
    return value


def _checked_values(rule: Callable[[str, np.ndarray], None], values: np.ndarray, owner: str, role: str) -> None:
    """A ref.checks value rule on a field as the file holds it (its index is the file's), as a FieldError."""
    try:
        rule(f"{owner}: {role}", values)
    except ValueError as exc:
        raise FieldError(role, str(exc)) from None


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise FieldError("name", f"a linear's name must be a non-empty string (its module prefix), got {name!r}")


@dataclass(frozen=True, eq=False)
class NVFP4Linear:
    """One NVFP4 linear: uint8 [N, K/2] codes (low nibble first), e4m3 [N, K/16] scales, fp32 multipliers."""

    name: str
    weight_packed: np.ndarray
    weight_scale: np.ndarray
    global_scale: np.ndarray
    input_scale: np.ndarray | None = None

    def __post_init__(self) -> None:
        _check_name(self.name)
        owner = f"NVFP4 layer {self.name!r}"
        wp = _uint8_matrix(self.weight_packed, owner, "weight_packed", "[N, K/2], two e2m1 codes per byte")
        n, half_k = wp.shape
        ws = _uint8_matrix(self.weight_scale, owner, "weight_scale", "[N, K/16] e4m3 bit patterns")
        if half_k % (GROUP_K // 2) != 0 or ws.shape != (n, half_k * 2 // GROUP_K):
            raise FieldError(
                "weight_scale",
                f"{owner}: weight_scale must have shape (N, K/16) = ({n}, {half_k * 2 / GROUP_K:g}) for weight_packed "
                f"shape ({n}, {half_k}) (K = {half_k * 2}), got {ws.shape}; NVFP4 has one e4m3 scale per "
                f"{GROUP_K} weights (group_size 16) and K must be a multiple of 16",
            )
        _checked_values(require_nvfp4_block_scales, ws, owner, "weight_scale")
        object.__setattr__(self, "global_scale", _scalar_f32(self.global_scale, owner, "global_scale", positive=True))
        object.__setattr__(self, "input_scale",
                           _scalar_f32(self.input_scale, owner, "input_scale", positive=True, optional=True))

    @property
    def n(self) -> int:
        return int(self.weight_packed.shape[0])

    @property
    def k(self) -> int:
        return int(self.weight_packed.shape[1] * 2)

    @property
    def weight_format(self) -> WeightFormat:
        """The layout it packs into (qpn.ref.formats): QPN2."""
        return QPN2


@dataclass(frozen=True, eq=False)
class FP8Linear:
    """One FP8 linear: e4m3 uint8 [N, K] and an fp32 multiplier per tensor / channel / 128x128 block."""

    name: str
    weight: np.ndarray
    weight_scale: np.ndarray
    granularity: str
    input_scale: np.ndarray | None = None
    scale_name: str = "weight_scale"

    def __post_init__(self) -> None:
        _check_name(self.name)
        owner = f"FP8 layer {self.name!r}"
        w = _uint8_matrix(self.weight, owner, "weight", "[N, K] e4m3 bit patterns")
        n, k = w.shape
        if self.granularity not in FP8_GRANULARITIES:
            raise FieldError("granularity", f"{owner}: granularity must be one of {FP8_GRANULARITIES}, "
                                             f"got {self.granularity!r}")
        if self.scale_name not in FP8_SCALE_NAMES:
            raise FieldError("scale_name", f"{owner}: scale_name must be one of {FP8_SCALE_NAMES}, "
                                            f"got {self.scale_name!r}")
        s = self.weight_scale
        if not isinstance(s, (np.ndarray, np.generic)) or np.asarray(s).dtype != np.float32:
            got = np.asarray(s).dtype if isinstance(s, (np.ndarray, np.generic)) else type(s).__name__
            raise FieldError("weight_scale", f"{owner}: weight_scale must be float32, got {got}; "
                                              "checkpoints store fp32 scales - pass them unchanged")
        s = np.asarray(s)
        if self.granularity == "tensor":
            s = _scalar_f32(s, owner, "weight_scale", positive=True)
        else:
            if self.granularity == "channel":
                expected: tuple[int, ...] = (n,)
                accepted: tuple[tuple[int, ...], ...] = ((n,), (n, 1))
                rule = "one scale per output channel, shape (N,) or (N, 1)"
            else:
                expected = fp8_block_grid(n, k)
                accepted = (expected, fp8_block_grid_4d(n, k))
                if expected == (1, 1):  # ModelOpt 0.47 writes a one-block grid as a 0-d scale
                    accepted += ((),)
                rule = (f"one scale per {FP8_BLOCK}x{FP8_BLOCK} block, shape (ceil(N/128), ceil(K/128)) or "
                        "ModelOpt's (ceil(N/128), 1, ceil(K/128), 1)")
            if s.shape not in accepted:
                raise FieldError(
                    "weight_scale",
                    f"{owner}: a {self.granularity} weight_scale must have shape {expected} for weight shape {w.shape} "
                    f"({rule}), got {s.shape}",
                )
            _checked_values(require_positive_scale, s, owner, "weight_scale")  # in the file's shape: its index
            s = s.reshape(expected)
        if self.scale_name == "weight_scale_inv" and self.granularity != "block":
            raise FieldError("scale_name", f"{owner}: weight_scale_inv is the block-checkpoint name; a "
                                            f"{self.granularity} scale is stored as weight_scale")
        _checked_values(require_no_nan_e4m3, w, owner, "weight")
        object.__setattr__(self, "weight_scale", s)
        object.__setattr__(self, "input_scale",
                           _scalar_f32(self.input_scale, owner, "input_scale", positive=True, optional=True))

    @property
    def n(self) -> int:
        return int(self.weight.shape[0])

    @property
    def k(self) -> int:
        return int(self.weight.shape[1])

    @property
    def weight_format(self) -> WeightFormat:
        """The layout it packs into (qpn.ref.formats): QPN8, or QPN8_BLOCK for 128x128 block scales."""
        return weight_format(QPN8.format, self.granularity)



@dataclass(frozen=True, eq=False)
class MXFP4Linear:
    """One MXFP4 linear: e2m1 codes as blocks uint8 [N, K/32, 16] (low nibble first), e8m0 scales [N, K/32]."""

    name: str
    blocks: np.ndarray
    scales: np.ndarray
    input_scale: np.ndarray | None = None

    def __post_init__(self) -> None:
        _check_name(self.name)
        owner = f"MXFP4 layer {self.name!r}"
        b = self.blocks
        if isinstance(b, np.ndarray) and b.ndim == 2 and b.dtype == np.uint8 and b.shape[1] % (MX_BLOCK // 2) == 0:
            b = b.reshape(b.shape[0], -1, MX_BLOCK // 2)  # compressed-tensors' weight_packed [N, K/2]: a view
        if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.ndim != 3 or b.shape[2] != MX_BLOCK // 2 \
                or 0 in b.shape:
            got = f"dtype {b.dtype}, shape {b.shape}" if isinstance(b, np.ndarray) else type(b).__name__
            raise FieldError("blocks", f"{owner}: blocks must be uint8 [N, K/32, 16] or weight_packed [N, K/2] with "
                                       f"K % {MX_BLOCK} == 0 (two e2m1 codes per byte), got {got}")
        n, k_blocks = b.shape[:2]
        s = _uint8_matrix(self.scales, owner, "scales", "[N, K/32] e8m0 bytes")
        if s.shape != (n, k_blocks):
            raise FieldError("scales", f"{owner}: scales must have shape (N, K/32) = ({n}, {k_blocks}) for K = "
                                       f"{MX_BLOCK * k_blocks}, got {s.shape}; MXFP4 has one e8m0 scale per "
                                       f"{MX_BLOCK} weights (group_size 32)")
        _checked_values(require_no_nan_e8m0, s, owner, "scales")
        object.__setattr__(self, "blocks", b)
        object.__setattr__(self, "input_scale",
                           _scalar_f32(self.input_scale, owner, "input_scale", positive=True, optional=True))

    @property
    def n(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def k(self) -> int:
        return int(self.blocks.shape[1] * MX_BLOCK)

    @property
    def weight_packed(self) -> np.ndarray:
        """The codes as compressed-tensors stores them, uint8 [N, K/2] (a view of blocks)."""
        return self.blocks.reshape(self.n, self.k // 2)

    @property
    def weight_format(self) -> WeightFormat:
        """The layout it packs into (qpn.ref.formats): QPNMX."""
        return QPNMX

    def tile_scale(self) -> np.ndarray:
        """float64 2^T per 32-row tile of the padded weight (ref/mxfp4.py, "W16"): what the kernels multiply
        each tile's sums by (pad rows hold byte 0, which never raises a tile's T)."""
        n_pad = QPNMX.padded_n(self.n)
        padded = np.zeros((n_pad, self.scales.shape[1]), np.uint8)
        padded[: self.n] = self.scales
        return np.exp2(mxfp4_tile_exponents(padded).astype(np.float64))


QuantizedLinear: TypeAlias = NVFP4Linear | FP8Linear | MXFP4Linear  # one quantized linear of any format
QUANTIZED_LINEARS = (NVFP4Linear, FP8Linear, MXFP4Linear)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A loaded (or to-be-saved) checkpoint; see the module docstring. Treat the dicts as read-only."""

    format: str
    quant_algo: str
    linears: Mapping[str, QuantizedLinear]
    tensors: Mapping[str, StoredTensor]
    config: Mapping
    hf_quant_config: Mapping | None = None
    experts: Mapping[str, Any] = field(default_factory=dict)  # {path: gpt_oss.MXFP4Experts} (gpt_oss imports this)

    @property
    def quantized_layers(self) -> Mapping[str, QuantizedLinear]:
        """The quantized layers by name: its linears (a PackedCheckpoint's are its packed layers), what a
        consumer of either kind of checkpoint iterates."""
        return self.linears

    def __post_init__(self) -> None:
        if self.format not in CHECKPOINT_FORMATS:
            raise ValueError(f"format must be one of {CHECKPOINT_FORMATS}, got {self.format!r}")
        if not isinstance(self.quant_algo, str) or not self.quant_algo:
            raise ValueError(f"quant_algo must be a non-empty string such as 'NVFP4', got {self.quant_algo!r}")
        linears = {}
        for key, linear in dict(self.linears).items():
            if not isinstance(linear, QUANTIZED_LINEARS):
                raise ValueError(f"linears[{key!r}] must be an NVFP4Linear, FP8Linear or MXFP4Linear, got "
                                 f"{type(linear).__name__}")
            if key != linear.name:
                raise ValueError(f"linears[{key!r}] holds a layer named {linear.name!r}; key by the layer's name")
            linears[key] = linear
        tensors = {name: as_stored_tensor(value, name=f"tensors[{name!r}]")
                   for name, value in dict(self.tensors).items()}
        if not isinstance(self.config, Mapping):
            raise ValueError(f"config must be a mapping (config.json), got {type(self.config).__name__}")
        if self.hf_quant_config is not None and not isinstance(self.hf_quant_config, Mapping):
            raise ValueError(f"hf_quant_config must be a mapping or None, got {type(self.hf_quant_config).__name__}")
        object.__setattr__(self, "linears", dict(sorted(linears.items())))
        object.__setattr__(self, "tensors", dict(sorted(tensors.items())))
        object.__setattr__(self, "experts", dict(sorted(dict(self.experts).items())))



__all__ = ["CHECKPOINT_FORMATS", "QUANTIZED_LINEARS", "Checkpoint", "CheckpointError", "FP8Linear", "MXFP4Linear",
           "NVFP4Linear", "QuantizedLinear"]
