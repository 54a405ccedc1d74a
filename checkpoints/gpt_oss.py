"""gpt-oss checkpoints in MXFP4 (issue 23): tell one apart, and read each MoE layer's experts, checked, in qpn's order.

What openai/gpt-oss-20b ships (config.json and model*.safetensors; transformers' integrations/mxfp4.py and vLLM's
models/gpt_oss.py read the same names):

    config.json  quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [...]},
                 num_local_experts E, hidden_size H, intermediate_size I, num_hidden_layers L,
                 num_experts_per_tok (older: experts_per_token), swiglu_limit
    per layer, P = model.layers.{l}.mlp.experts (every gpt-oss layer is a MoE layer):
    P.gate_up_proj_blocks  U8    [E, 2I, H/32, 16]  gate / up interleaved along 2I: row 2i gate i, 2i + 1 up i
    P.gate_up_proj_scales  U8    [E, 2I, H/32]      e8m0; the encoding and nibble order: ref/mxfp4.py
    P.gate_up_proj_bias    BF16  [E, 2I]            interleaved as the rows
    P.down_proj_blocks     U8    [E, H, I/32, 16]
    P.down_proj_scales     U8    [E, H, I/32]
    P.down_proj_bias       BF16  [E, H]

The rest (attention, router, embeddings, norms, lm_head: what modules_to_not_convert names) is bf16 and not read
here. `read_gpt_oss_experts` returns one `MXFP4Experts` per layer: w13 in qpn's order (ref.gpt_oss.deinterleave:
the gate rows, then the up rows; rows of bytes move, nothing is decoded), the biases float32 (bf16 widens
exactly; F32 biases are taken as they are), w2 as stored.

Rules (CheckpointError naming the file and the tensor or config entry; `MXFP4Experts` raises FieldError for an
object built in memory):
- config: quant_method "mxfp4"; E, H, I, L and the top-k positive integers, top-k <= E; H and I multiples of
  32 (one e8m0 scale per 32 values along K); modules_to_not_convert a list of strings, or absent.
- structure, from the headers before any data is read: all six tensors of every layer 0..L-1 present with the
  dtypes above and the config's shapes; no experts tensor of a layer the config does not have.
- values: no scale byte 0xFF (e8m0's NaN: its 32 values have no number); finite biases.

Only the experts' tensors are read, one at a time with plain file reads (SafetensorsFile: no memory map, no
other tensor's bytes); `read_gpt_oss_experts(folder, layers=[...])` reads some layers only (gpt-oss-20b's 24
hold 10 GB).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..ref.checks import require_finite, require_no_nan_e8m0
from ..ref.formats import MX_BLOCK
from ..ref.gpt_oss import SWIGLU_LIMIT, deinterleave
from ..ref.mxfp4 import MXFP4Weight
from .checkpoint import Checkpoint, CheckpointError, FieldError
from .folder import CONFIG_FILE, _gather, _read_json, weight_files
from .producer import config_error, str_list
from .safetensors_io import SafetensorsFile, TensorInfo, read_safetensors, read_safetensors_header

QUANT_METHOD = "mxfp4"
EXPERTS_PREFIX = "model.layers.{layer}.mlp.experts"
BLOCK_BYTES = MX_BLOCK // 2  # 32 e2m1 codes, two a byte
# MXFP4Experts field -> the on-disk suffix under P (the layer's experts prefix)
ON_DISK = {"w13_blocks": "gate_up_proj_blocks", "w13_scales": "gate_up_proj_scales", "w13_bias": "gate_up_proj_bias",
           "w2_blocks": "down_proj_blocks", "w2_scales": "down_proj_scales", "w2_bias": "down_proj_bias"}
_TAGS = {"blocks": ("U8",), "scales": ("U8",), "bias": ("BF16", "F32")}  # by the suffix's last word


@dataclass(frozen=True)
class GptOssMXFP4Config:
    """What config.json says of a gpt-oss MXFP4 checkpoint (module docstring)."""

    experts: int  # E: num_local_experts
    experts_per_token: int  # num_experts_per_tok
    hidden: int  # H: hidden_size
    intermediate: int  # I: intermediate_size
    layers: int  # num_hidden_layers
    swiglu_limit: float
    modules_to_not_convert: tuple[str, ...]


def _require_values(role: str, array: np.ndarray, name: str) -> None:
    """The value rules of one experts tensor (module docstring): no e8m0 NaN scale byte, finite biases."""
    if role.endswith("scales"):
        require_no_nan_e8m0(name, array)
    elif role.endswith("bias"):
        require_finite(name, array, "the checkpoint is corrupt there (re-download or re-export it)")


@dataclass(frozen=True, eq=False)
class MXFP4Experts:
    """One gpt-oss MoE layer's experts in MXFP4, in qpn's order: w13's gate rows [0, I), then its up rows [I, 2I)."""

    name: str  # the layer's experts prefix, "model.layers.{l}.mlp.experts"
    w13_blocks: np.ndarray  # uint8 [E, 2I, H/32, 16]
    w13_scales: np.ndarray  # uint8 [E, 2I, H/32], e8m0
    w13_bias: np.ndarray  # float32 [E, 2I]
    w2_blocks: np.ndarray  # uint8 [E, H, I/32, 16]
    w2_scales: np.ndarray  # uint8 [E, H, I/32], e8m0
    w2_bias: np.ndarray  # float32 [E, H]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FieldError("name", f"MXFP4Experts.name must be the layer's prefix (a non-empty string), got "
                                     f"{self.name!r}")
        owner = f"MXFP4 experts {self.name!r}"
        w13 = self._array("w13_blocks", np.uint8, 4, owner)
        w2 = self._array("w2_blocks", np.uint8, 4, owner)
        e, h_blocks, i_blocks = w13.shape[0], w13.shape[2], w2.shape[2]  # H and I from one, checked on the other
        h, two_i = MX_BLOCK * h_blocks, 2 * MX_BLOCK * i_blocks
        want = {"w13_blocks": (e, two_i, h_blocks, BLOCK_BYTES), "w13_scales": (e, two_i, h_blocks),
                "w13_bias": (e, two_i), "w2_blocks": (e, h, i_blocks, BLOCK_BYTES), "w2_scales": (e, h, i_blocks),
                "w2_bias": (e, h)}
        for role, shape in want.items():
            array = self._array(role, np.float32 if role.endswith("bias") else np.uint8, len(shape), owner)
            if array.shape != shape or 0 in shape:
                raise FieldError(role, f"{owner}: {role} has shape {array.shape}, but w13_blocks {w13.shape} and "
                                       f"w2_blocks {w2.shape} make it {shape}: w13 [E, 2I, H/32, 16], w2 [E, H, "
                                       "I/32, 16], scales without the last dimension, biases [E, 2I] and [E, H]; "
                                       "pass one layer's six tensors, none empty")
            try:
                _require_values(role, array, f"{owner}: {role}")
            except ValueError as exc:
                raise FieldError(role, str(exc)) from None

    def _array(self, role: str, dtype: type, ndim: int, owner: str) -> np.ndarray:
        value = getattr(self, role)
        if not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != ndim:
            got = f"{value.dtype} of {value.ndim} dimensions" if isinstance(value, np.ndarray) else type(value).__name__
            raise FieldError(role, f"{owner}: {role} must be a {np.dtype(dtype)} array of {ndim} dimensions, got "
                                   f"{got}; blocks and scales are the checkpoint's bytes, biases float32")
        return value

    @property
    def experts(self) -> int:
        return int(self.w13_blocks.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.w2_blocks.shape[1])

    @property
    def intermediate(self) -> int:
        return int(self.w13_blocks.shape[1] // 2)

    @property
    def w13(self) -> MXFP4Weight:
        """gate and up, [E, 2I, ...] (gate rows first): ref.mxfp4's (blocks, scales)."""
        return MXFP4Weight(self.w13_blocks, self.w13_scales)

    @property
    def w2(self) -> MXFP4Weight:
        return MXFP4Weight(self.w2_blocks, self.w2_scales)


def _config_of(folder_or_config: str | os.PathLike[str] | Mapping) -> tuple[Mapping, str]:
    """(config.json as a mapping, where it came from); a folder without config.json gives ({}, its path)."""
    if isinstance(folder_or_config, Mapping):
        return folder_or_config, CONFIG_FILE
    folder = os.fspath(folder_or_config)
    if not os.path.isdir(folder):
        raise CheckpointError(folder, None, "is not a folder; pass the checkpoint directory (or its config.json as a "
                                            "dict)")
    path = os.path.join(folder, CONFIG_FILE)
    return (_read_json(path) if os.path.isfile(path) else {}), path


def _quant_method(config: Mapping) -> str | None:
    qc = config.get("quantization_config")
    return str(qc.get("quant_method", "")).lower() if isinstance(qc, Mapping) else None


def is_gpt_oss_mxfp4(folder_or_config: str | os.PathLike[str] | Mapping) -> bool:
    """Whether config.json's quantization_config.quant_method is "mxfp4" (gpt-oss's own format)."""
    return _quant_method(_config_of(folder_or_config)[0]) == QUANT_METHOD


def _positive_int(config: Mapping, key: str, source: str, *fallbacks: str) -> int:
    value = next((config[k] for k in (key, *fallbacks) if k in config), None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise config_error(source, key, f"{key} must be a positive integer, got {value!r}; a gpt-oss config.json "
                                        "holds it")
    return value


def read_gpt_oss_config(folder_or_config: str | os.PathLike[str] | Mapping) -> GptOssMXFP4Config:
    """config.json of a gpt-oss MXFP4 checkpoint (a folder or the dict), checked (module docstring)."""
    config, source = _config_of(folder_or_config)
    method = _quant_method(config)
    if method != QUANT_METHOD:
        raise config_error(source, "quantization_config.quant_method",
                           f"is {method!r}; this reader reads gpt-oss MXFP4 checkpoints (quant_method "
                           f"{QUANT_METHOD!r}); ModelOpt and compressed-tensors ones go through load_checkpoint")
    dims = {key: _positive_int(config, key, source) for key in
            ("num_local_experts", "hidden_size", "intermediate_size", "num_hidden_layers")}
    top_k = _positive_int(config, "num_experts_per_tok", source, "experts_per_token")
    for key in ("hidden_size", "intermediate_size"):
        if dims[key] % MX_BLOCK:
            raise config_error(source, key, f"{key} must be a multiple of {MX_BLOCK} (MXFP4 has one e8m0 scale per "
                                             f"{MX_BLOCK} values along K), got {dims[key]}; this is no MXFP4 layout")
    if top_k > dims["num_local_experts"]:
        raise config_error(source, "num_experts_per_tok", f"num_experts_per_tok must be <= num_local_experts = "
                                                          f"{dims['num_local_experts']}, got {top_k}")
    limit = config.get("swiglu_limit", SWIGLU_LIMIT)
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not math.isfinite(limit) or limit <= 0:
        raise config_error(source, "swiglu_limit", f"swiglu_limit must be a finite number > 0, got {limit!r}")
    qc = config["quantization_config"]
    skip = str_list(qc.get("modules_to_not_convert"), source, "quantization_config.modules_to_not_convert")
    return GptOssMXFP4Config(dims["num_local_experts"], top_k, dims["hidden_size"], dims["intermediate_size"],
                             dims["num_hidden_layers"], float(limit), tuple(skip))


class _Layout(NamedTuple):
    config: GptOssMXFP4Config
    layers: list[str]  # the experts prefixes, layer 0 first
    file_of: dict[str, str]  # tensor -> its file's path


def _shapes(cfg: GptOssMXFP4Config) -> dict[str, tuple[int, ...]]:
    """On-disk suffix -> its shape (module docstring)."""
    e, h, i = cfg.experts, cfg.hidden, cfg.intermediate
    return {"gate_up_proj_blocks": (e, 2 * i, h // MX_BLOCK, BLOCK_BYTES),
            "gate_up_proj_scales": (e, 2 * i, h // MX_BLOCK), "gate_up_proj_bias": (e, 2 * i),
            "down_proj_blocks": (e, h, i // MX_BLOCK, BLOCK_BYTES), "down_proj_scales": (e, h, i // MX_BLOCK),
            "down_proj_bias": (e, h)}


def _layout(folder: str) -> _Layout:
    """The config and the structure checks of the module docstring, from the headers alone."""
    cfg = read_gpt_oss_config(folder)
    files, weight_map, index_path = weight_files(folder)
    header_of, file_of = _gather(folder, files, weight_map, index_path,
                                 lambda path: read_safetensors_header(path).tensors)
    layers = [EXPERTS_PREFIX.format(layer=layer) for layer in range(cfg.layers)]
    shapes = _shapes(cfg)
    where = f"num_local_experts {cfg.experts}, hidden_size {cfg.hidden}, intermediate_size {cfg.intermediate}"
    for name in header_of:
        prefix, _, suffix = name.rpartition(".")
        if suffix in shapes and prefix not in layers:
            raise CheckpointError(file_of[name], name, f"is an MXFP4 experts tensor, but config.json has "
                                                       f"num_hidden_layers {cfg.layers} and its layers are "
                                                       f"{EXPERTS_PREFIX.format(layer='{0..L-1}')}; the tensor or "
                                                       "the config is not this model's")
    for prefix in layers:
        for suffix, shape in shapes.items():
            name = f"{prefix}.{suffix}"
            info: TensorInfo | None = header_of.get(name)
            if info is None:
                raise CheckpointError(index_path or os.path.join(folder, files[0]), name, "is missing: every gpt-oss "
                                      "layer holds six experts tensors (gate_up_proj and down_proj _blocks, _scales, "
                                      "_bias); the checkpoint is incomplete (re-download it)")
            tags = _TAGS[suffix.rpartition("_")[2]]
            if info.dtype not in tags or info.shape != shape:
                raise CheckpointError(file_of[name], name, f"is {info.dtype} {list(info.shape)}, but gpt-oss "
                                                           f"stores it as {' or '.join(tags)} {list(shape)} for "
                                                           f"config.json's {where}; the tensor or the config is not "
                                                           "this model's")
    return _Layout(cfg, layers, file_of)


def gpt_oss_expert_layers(folder: str | os.PathLike[str]) -> list[str]:
    """The MoE layers' experts prefixes of a gpt-oss MXFP4 checkpoint, layer 0 first (config and headers checked)."""
    return _layout(os.fspath(folder)).layers


def _float32_bias(array: np.ndarray, tag: str) -> np.ndarray:
    """A BF16 (bit patterns) or F32 bias as float32, exactly."""
    return (array.astype(np.uint32) << 16).view(np.float32) if tag == "BF16" else array.astype(np.float32)


def read_gpt_oss_experts(folder: str | os.PathLike[str], layers: Iterable[str] | None = None
                         ) -> dict[str, MXFP4Experts]:
    """{experts prefix: MXFP4Experts} of a gpt-oss MXFP4 checkpoint folder, every layer or those in `layers`
    (module docstring: the order, the rules, what is read)."""
    folder = os.fspath(folder)
    layout = _layout(folder)
    chosen = layout.layers if layers is None else list(layers)
    unknown = [prefix for prefix in chosen if prefix not in layout.layers]
    if unknown:
        raise ValueError(f"layers must name MoE layers of {folder} ({layout.layers[0]} .. {layout.layers[-1]}), "
                         f"got {unknown[0]!r}; list them with gpt_oss_expert_layers")
    out = {}
    with ExitStack() as stack:
        opened: dict[str, SafetensorsFile] = {}
        for prefix in chosen:
            fields = {}
            for role, suffix in ON_DISK.items():
                name = f"{prefix}.{suffix}"
                path = layout.file_of[name]
                if path not in opened:
                    opened[path] = stack.enter_context(SafetensorsFile(path))
                stored = opened[path].read(name)
                array = _float32_bias(stored.array, stored.dtype) if role.endswith("bias") else stored.array
                try:  # here, not in MXFP4Experts: the index is the file's (gate / up interleaved, every expert)
                    _require_values(role, array, suffix)
                except ValueError as exc:
                    raise CheckpointError(path, name, str(exc)) from None
                fields[role] = deinterleave(array, 1) if role.startswith("w13") else array  # axis 1: the 2I rows
            try:
                out[prefix] = MXFP4Experts(prefix, **fields)
            except FieldError as exc:
                name = f"{prefix}.{ON_DISK[exc.role]}"
                raise CheckpointError(layout.file_of[name], name, str(exc)) from None
    return out


__all__ = ["EXPERTS_PREFIX", "QUANT_METHOD", "GptOssMXFP4Config", "MXFP4Experts", "gpt_oss_expert_layers",
           "is_gpt_oss_mxfp4", "read_gpt_oss_config", "read_gpt_oss_experts"]


def load_gpt_oss(folder: str | os.PathLike[str], *, mmap: bool = True) -> Checkpoint:
    """A gpt-oss MXFP4 folder as a Checkpoint (format "gpt-oss", quant_algo "MXFP4"): its experts read and checked
    by read_gpt_oss_experts, every other tensor (attention, router, sinks, norms, embeddings, lm_head: bf16) as
    stored, memory-mapped when `mmap`; no per-linear quantized layers."""
    folder = os.fspath(folder)
    experts = read_gpt_oss_experts(folder)
    files, weight_map, index_path = weight_files(folder)
    stored, _ = _gather(folder, files, weight_map, index_path, lambda path: read_safetensors(path, mmap=mmap).tensors)
    taken = {f"{prefix}.{suffix}" for prefix in experts for suffix in ON_DISK.values()}
    config = dict(_config_of(folder)[0])
    return Checkpoint("gpt-oss", QUANT_METHOD.upper(), {}, {n: t for n, t in stored.items() if n not in taken},
                      config, experts=experts)
