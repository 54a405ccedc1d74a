"""How one rank's parameters map onto the checkpoint tensors: the layer geometry and the weight loaders.

N_part, K_part and S are the parameter sizes of methods.py (its docstring: "Parameters").

Every parameter carries its own `weight_loader(param, loaded_weight, loaded_shard_id=None)` (the
one the layer passes in `extra_weight_attrs` is not used; vLLM's model `load_weights` calls
`param.weight_loader`). It shards exactly as vLLM's linear layers do, from the layer's attributes:
- ColumnParallelLinear: output rows [tp_rank * N_part, +N_part) of the checkpoint tensor.
- RowParallelLinear: input columns [tp_rank * K_part, +K_part) (for packed weight / block scales:
  the same fraction of the packed columns, K_part/2 bytes, K_part/16 NVFP4 scales or K_part/128 FP8
  block scales).
- MergedColumnParallelLinear (gate_up, shard ids 0, 1, ...) and QKVParallelLinear (shard ids
  "q", "k", "v"): shard i lands at row offset sum(partitions[:i]) and takes rows
  [r * partitions[i], +partitions[i]) of its checkpoint tensor, r = tp_rank, except k/v with
  replicated KV heads: r = tp_rank // num_kv_head_replicas. No shard id on a fused layer means the
  tensor is fused on disk (Phi-3): it is split by the unsharded shard sizes; a tuple of
  consecutive ids covers those shards.
- ReplicatedLinear: the whole tensor.
Per-shard scalars (weight_scale_2, FP8 per-tensor weight_scale, input_scale) go to slot i of their
[S] parameter; without a shard id (fused on disk, or a layer of one shard) to every slot.
e4m3 tensors may come as torch.float8_e4m3fn or as uint8 bit patterns; nothing else is cast.

Errors. Shapes, dtypes and, where a parameter has a value rule (`_register`'s `rule`: the methods give
NaN / negative e4m3 scale bytes, scales that are not finite and > 0, FP8 scales that overflow fp16,
NaN FP8 weight codes), the values of each tensor are checked as it is loaded, on the checkpoint
tensor itself: a ValueError that starts with `ShardGeometry.where`, "checkpoint tensor
'model.layers.0.self_attn.q_proj.weight_scale' in /models/llama/model.safetensors (vLLM layer
'model.layers.0.self_attn.qkv_proj', shard 'q')" (the file: `served_folder`, `checkpoint_where`), then the
parameter, the rule, the value (indices into that tensor; a scalar is one
value, not the rows it is broadcast to) and the fix. The checkpoint tensor's layer is the shard's
name in the model's packed_modules_mapping (vLLM's own map from a fused layer to the layers it
loads, e.g. qkv_proj -> q_proj, k_proj, v_proj; DEFAULT_PACKED_MODULES where a model sets none),
or the vLLM layer itself for an unfused layer or a tensor fused on disk. Each loaded slot remembers
its checkpoint tensor and where its rows and columns start in it (`loaded_source`), so rules that
need two tensors (NVFP4's fp16 overflow, methods.py) name and index the file's tensors too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor
from torch.nn import Parameter

from ...checkpoints.folder import file_holding
from ...ref.checks import require_no_nan_e4m3, require_nvfp4_block_scales, require_positive_scale
from ...ref.formats import FP8_BLOCK  # FP8_PB_WO scales one 128x128 block each
from ...ref.fp8 import fp8_block_grid, fp8_block_grid_4d
from ...ref.qpn8 import require_qpn8_fits_fp16

if TYPE_CHECKING:
    from ..packed_weight import PackedWeight

QKV_SHARD_IDS = ("q", "k", "v")
# vLLM models set packed_modules_mapping on the config (fused layer -> the checkpoint layers it loads, in
# shard order); this is the fallback for the usual names
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

_ROWS = "rows"  # parameter role: rows follow the output partition (weight, block scales, channel scales)
_PER_SHARD = "per_shard"  # parameter role: one fp32 value per logical shard

ShardId = int | str  # one logical shard: 0, 1, ... (MergedColumnParallelLinear) or "q"/"k"/"v"
# what vLLM passes as loaded_shard_id: one id, a tuple of consecutive ids, or None (module docstring)
LoadedShardId = ShardId | tuple[ShardId, ...] | None


class WeightLoader(Protocol):
    """`param.weight_loader`, the call vLLM's model load_weights makes for each checkpoint tensor."""

    def __call__(self, param: Parameter, loaded_weight: Tensor, loaded_shard_id: LoadedShardId = None) -> None: ...


# A parameter's value rule: (parameter name, the checkpoint tensor as loaded, in the parameter's dtype) ->
# ValueError naming the parameter, the rule, the value (indices into that tensor) and the fix.
ValueRule = Callable[[str, Tensor], None]


# ----------------------------------------------------------------------------- layer geometry


class QPNLayer(Protocol):
    """A vLLM linear layer as the qpn methods see it (a torch.nn.Module; vLLM's own attributes, such
    as tp_rank or output_sizes, are read by name in sharding.layer_geometry).

    create_weights registers the checkpoint Parameters (weight, weight_scale, ...) and sets
    qpn_geometry and the three attributes vLLM's ModelOpt methods set; process_weights_after_loading
    replaces the checkpoint Parameters with the layout's buffers (qpn_<buffer name>) and sets
    qpn_weight, the packed weight over them, which apply runs.
    """

    qpn_geometry: ShardGeometry
    logical_widths: list[int]
    input_size_per_partition: int
    output_size_per_partition: int
    weight: Tensor
    weight_scale: Tensor
    weight_scale_2: Tensor
    qpn_weight: PackedWeight

    def register_parameter(self, name: str, param: Parameter | None) -> None: ...


@dataclass(frozen=True)
class ShardGeometry:
    """How one rank's parameters map onto the checkpoint tensors (module docstring).

    kind: "column" | "merged" | "qkv" | "row" | "replicated"; partitions: rows of each logical shard
    on this rank (vLLM's output_partition_sizes); offsets: their first row; disk_rows: rows of each
    shard in the checkpoint; source_ranks: which slice of partitions[i] rows this rank takes;
    checkpoint_layers: the checkpoint layer each shard is loaded from (module docstring, "Errors";
    empty: the vLLM layer's own name).
    """

    prefix: str
    kind: str
    tp_rank: int
    tp_size: int
    partitions: tuple[int, ...]
    offsets: tuple[int, ...]
    disk_rows: tuple[int, ...]
    source_ranks: tuple[int, ...]
    shard_ids: tuple[ShardId | None, ...]  # (None,): a layer of one shard, loaded without an id
    k_partition: int
    checkpoint_layers: tuple[str, ...] = ()
    folder: str | None = None  # the checkpoint folder (served_folder), where an error finds its tensor's file

    @property
    def n_partition(self) -> int:
        return sum(self.partitions)

    def shard_index(self, shard_id: object) -> int:
        """vLLM shard id ("q"/"k"/"v" or 0, 1, ...) -> position in partitions."""
        if self.kind == "qkv":
            if shard_id in QKV_SHARD_IDS:
                return QKV_SHARD_IDS.index(shard_id)
        elif len(self.partitions) > 1 and isinstance(shard_id, int) and not isinstance(shard_id, bool):
            if 0 <= shard_id < len(self.partitions):
                return shard_id
        if len(self.partitions) == 1:
            raise ValueError(f"the layer ({self.kind}) is not fused and takes no shard id, got {shard_id!r}; load "
                             "its tensor without a shard id")
        raise ValueError(f"the layer ({self.kind}) has shard ids {self.shard_ids}, got {shard_id!r}")

    def shard_indices(self, shard_id: object) -> list[int]:
        """None -> every shard; a tuple of consecutive ids -> those; one id -> [its index]."""
        if shard_id is None:
            return list(range(len(self.partitions)))
        if isinstance(shard_id, tuple):
            indices = [self.shard_index(s) for s in shard_id]
            if not indices or any(b - a != 1 for a, b in pairwise(indices)):
                raise ValueError(f"a tuple shard id must list consecutive shards, got {shard_id!r}")
            return indices
        return [self.shard_index(shard_id)]

    def checkpoint_layer(self, shard_id: object) -> str:
        """The checkpoint layer whose tensors vLLM loads with `shard_id` (module docstring, "Errors"):
        one shard's own layer (q_proj), else (no id: unfused, or fused on disk; several ids) this layer."""
        if shard_id is None or isinstance(shard_id, tuple) or len(self.checkpoint_layers) != len(self.partitions):
            return self.prefix
        try:
            return self.checkpoint_layers[self.shard_index(shard_id)]
        except ValueError:  # not one of this layer's ids: the loader says so
            return self.prefix

    def where(self, tensor: str, shard_id: object = None) -> str:
        """"checkpoint tensor 'T' in FILE (vLLM layer 'P', shard 'q')": how every load error of this layer starts."""
        return checkpoint_where(tensor, self.folder, self.prefix, shard_id)


def served_folder() -> str | None:
    """The local checkpoint folder vLLM is building the model from (its current config's model), or None (a hub
    name, or no vLLM config set: the stand-in): where an error looks up the file of its tensor. vLLM sets the
    config around the model's construction, so create_weights reads it and the loaders keep it."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    model = getattr(getattr(get_current_vllm_config_or_none(), "model_config", None), "model", None)
    return model if isinstance(model, str) and os.path.isdir(model) else None


def checkpoint_where(tensor: str, folder: str | None, vllm_layer: str, shard_id: object = None) -> str:
    """"checkpoint tensor 'T' in FILE (vLLM layer 'P', shard 'q')": how every load error of a vLLM layer starts
    (module docstring, "Errors"); the file is looked up in `folder` only now, when an error is raised."""
    file = file_holding(folder, tensor) if folder is not None else None
    shard = f", shard {shard_id!r}" if shard_id is not None else ""
    return f"checkpoint tensor {tensor!r}{f' in {file}' if file else ''} (vLLM layer {vllm_layer!r}{shard})"


def _int_attr(layer: object, name: str, default: int | None = None) -> int:
    value = getattr(layer, name, default)
    if value is None:
        raise ValueError(f"layer {getattr(layer, 'prefix', '?')!r} ({type(layer).__name__}) has no attribute "
                         f"{name!r}, which vLLM's parallel linear layers set; qpn cannot tell how it is sharded")
    return int(value)


def _layer_kind(layer: object) -> str:
    """Which of vLLM's linear layers `layer` is, from the attributes each sets (layer_geometry)."""
    if hasattr(layer, "num_kv_head_replicas") and hasattr(layer, "total_num_heads"):
        return "qkv"
    if hasattr(layer, "input_is_parallel"):
        return "row"
    if hasattr(layer, "gather_output"):
        return "merged" if hasattr(layer, "output_sizes") else "column"
    return "replicated"


def _shard_sources(layer: object, kind: str, partitions: tuple[int, ...], tp_rank: int,
                   tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[ShardId | None, ...]]:
    """(disk_rows, source_ranks, shard_ids) of the logical shards of `layer` (ShardGeometry)."""
    prefix = str(getattr(layer, "prefix", ""))
    shard_ids: tuple[ShardId | None, ...] = (None,)
    disk_rows: tuple[int, ...]
    source_ranks: tuple[int, ...] = (tp_rank,) * len(partitions)
    if kind == "qkv":
        if len(partitions) != 3:
            raise ValueError(f"layer {prefix!r}: a QKV layer must have 3 output partitions (q, k, v), got "
                             f"{list(partitions)}; this QKV variant is not supported by qpn")
        head_size = _int_attr(layer, "head_size")
        v_head_size = int(getattr(layer, "v_head_size", None) or head_size)
        heads, kv_heads = _int_attr(layer, "total_num_heads"), _int_attr(layer, "total_num_kv_heads")
        replicas = _int_attr(layer, "num_kv_head_replicas")
        disk_rows = (heads * head_size, kv_heads * head_size, kv_heads * v_head_size)
        source_ranks = (tp_rank, tp_rank // replicas, tp_rank // replicas)
        shard_ids = QKV_SHARD_IDS
    elif kind in ("merged", "replicated") and hasattr(layer, "output_sizes"):  # merged has it (_layer_kind)
        disk_rows = tuple(int(s) for s in layer.output_sizes)
        shard_ids = tuple(range(len(disk_rows)))
    elif kind == "row":
        disk_rows = partitions
    else:
        disk_rows = tuple(p * tp_size for p in partitions)
    if kind in ("row", "replicated"):  # every rank holds all output rows
        source_ranks = (0,) * len(partitions)
    return disk_rows, source_ranks, shard_ids


def shard_layer_names(prefix: str, packed_modules: Mapping[str, Sequence[str]] | None) -> list[str]:
    """The checkpoint layers a fused vLLM layer `prefix` loads, in shard order (model.layers.0.self_attn.qkv_proj
    -> its q_proj, k_proj, v_proj), from the model's packed_modules_mapping or the usual names; [] when unfused."""
    parent, _, leaf = prefix.rpartition(".")
    names = (packed_modules or {}).get(leaf) or DEFAULT_PACKED_MODULES.get(leaf) or []
    return [f"{parent}.{name}" if parent else str(name) for name in names]


def _checkpoint_layers(prefix: str, shards: int, packed_modules: Mapping[str, Sequence[str]] | None
                       ) -> tuple[str, ...]:
    """The checkpoint layer of each shard of the vLLM layer `prefix` (ShardGeometry.checkpoint_layers)."""
    names = shard_layer_names(prefix, packed_modules)
    return tuple(names) if shards > 1 and len(names) == shards else (prefix,) * shards


def layer_geometry(layer: object, input_size_per_partition: int, output_partition_sizes: Sequence[int],
                   packed_modules: Mapping[str, Sequence[str]] | None = None) -> ShardGeometry:
    """Read the sharding of `layer` from the attributes vLLM's linear layers set before create_weights.

    QKVParallelLinear: num_kv_head_replicas, total_num_heads, total_num_kv_heads, head_size
    (v_head_size); RowParallelLinear: input_is_parallel; MergedColumnParallelLinear: output_sizes +
    gather_output; ColumnParallelLinear: gather_output; anything else is replicated. All but
    replicated read tp_rank / tp_size (vLLM sets them to 0 / 1 with disable_tp). packed_modules:
    the model's packed_modules_mapping (the quant config's), which names each shard's checkpoint layer.
    """
    prefix = str(getattr(layer, "prefix", ""))
    partitions = tuple(int(p) for p in output_partition_sizes)
    if not partitions or any(p <= 0 for p in partitions):
        raise ValueError(f"layer {prefix!r}: output_partition_sizes must be positive, got {list(partitions)}")
    k_partition = int(input_size_per_partition)
    kind = _layer_kind(layer)
    if kind == "replicated":
        tp_rank, tp_size = 0, 1
    else:
        tp_rank, tp_size = _int_attr(layer, "tp_rank"), _int_attr(layer, "tp_size")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"layer {prefix!r}: tp_rank must be in [0, tp_size), got {tp_rank} / {tp_size}")
    disk_rows, source_ranks, shard_ids = _shard_sources(layer, kind, partitions, tp_rank, tp_size)
    if len(disk_rows) != len(partitions) or any(
            (r + 1) * p > d for r, p, d in zip(source_ranks, partitions, disk_rows, strict=True)):
        raise ValueError(f"layer {prefix!r} ({kind}, tp_rank {tp_rank} of {tp_size}): output partitions "
                         f"{list(partitions)} do not fit the unsharded shard sizes {list(disk_rows)}")
    offsets = tuple(sum(partitions[:i]) for i in range(len(partitions)))
    return ShardGeometry(prefix, kind, tp_rank, tp_size, partitions, offsets, disk_rows, source_ranks, shard_ids,
                         k_partition, _checkpoint_layers(prefix, len(partitions), packed_modules), served_folder())


# ----------------------------------------------------------------------------- weight loading

_E4M3_PARAM_DTYPES = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class LoadedSource:
    """Where one loaded slot of a parameter came from: the checkpoint tensor, and the row and column of
    that tensor where the slot's part starts (this rank's slice, a shard's place in a tensor fused on disk)."""

    tensor: str
    row: int = 0
    col: int = 0


def _as_param_dtype(name: str, param: Tensor, loaded: Tensor) -> Tensor:
    if not isinstance(loaded, Tensor):
        raise ValueError(f"{name} must be loaded from a torch.Tensor, got {type(loaded).__name__}")
    if param.dtype in _E4M3_PARAM_DTYPES and loaded.dtype == torch.uint8:
        return loaded.view(param.dtype)  # e4m3 bit patterns
    if getattr(param, "qpn_cast_ok", False) and loaded.is_floating_point():
        return loaded  # unquantized weights: vLLM casts the checkpoint dtype to the model dtype
    if loaded.dtype != param.dtype:
        raise ValueError(f"{name} must be {param.dtype} (ModelOpt stores it so), got {loaded.dtype} of shape "
                         f"{tuple(loaded.shape)}; pass the checkpoint tensor unchanged")
    return loaded


def _set_param_attrs(param: Parameter, /, **attrs: object) -> None:
    """vLLM reads a parameter's loading metadata as plain attributes (weight_loader, output_dim,
    input_dim, and whatever the layer passes in extra_weight_attrs), and qpn adds its own (qpn_role,
    qpn_sources, qpn_cast_ok); torch's Parameter type declares none of them, so they are set
    by name, here only."""
    for key, value in attrs.items():
        setattr(param, key, value)


def _sources(param: Tensor) -> dict[int, LoadedSource]:
    """{shard slot: the checkpoint tensor it was loaded from} of `param`, for the slots loaded so far (_register)."""
    sources: dict[int, LoadedSource] = param.qpn_sources  # type: ignore[attr-defined]  # set by _set_param_attrs
    return sources


def loaded_source(param: Tensor, slot: int) -> LoadedSource:
    """The checkpoint tensor (and offsets into it) that slot `slot` of `param` was loaded from."""
    return _sources(param)[slot]


def _mark_loaded(param: Tensor, slot: int, source: LoadedSource) -> None:
    _sources(param)[slot] = source


def _load_rows(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor, shard_id: object, tensor: str,
               tensor_row: int = 0) -> None:
    """Rows of one shard (or of consecutive shards fused on disk, split here); tensor_row: where
    `loaded` starts in the checkpoint tensor `tensor`."""
    indices = geom.shard_indices(shard_id)
    if len(indices) > 1:  # several shards in one tensor (fused on disk): split by unsharded sizes
        expected = sum(geom.disk_rows[i] for i in indices)
        if loaded.dim() == 0 or loaded.shape[0] != expected:
            raise ValueError(f"{name} for shards {shard_id!r} must have {expected} rows (the unsharded sizes "
                             f"{[geom.disk_rows[i] for i in indices]} stacked), got shape {tuple(loaded.shape)}")
        start = 0
        for i in indices:
            _load_rows(geom, name, param, loaded.narrow(0, start, geom.disk_rows[i]),
                       geom.shard_ids[i] if geom.shard_ids != (None,) else None, tensor, tensor_row + start)
            start += geom.disk_rows[i]
        return
    i = indices[0]
    if param.dim() == 1 and loaded.dim() == 2 and loaded.shape[1] == 1:
        loaded = loaded.reshape(-1)  # per-channel scales stored [N, 1]
    if loaded.dim() != param.dim() or loaded.shape[0] != geom.disk_rows[i]:
        what = f"shard {geom.shard_ids[i]!r}" if geom.shard_ids != (None,) else "the layer"
        raise ValueError(f"{name} of {what} must have {geom.disk_rows[i]} rows (unsharded) and {param.dim()} "
                         f"dimensions, got shape {tuple(loaded.shape)}; "
                         "is the checkpoint for this model and tensor-parallel layout?")
    rows = geom.partitions[i]
    first_row, first_col = geom.source_ranks[i] * rows, 0
    source = loaded.narrow(0, first_row, rows)
    if geom.kind == "row" and param.dim() == 2:  # input columns are split across ranks
        cols = param.shape[1]
        if loaded.shape[1] != cols * geom.tp_size:
            raise ValueError(f"{name} must have {cols * geom.tp_size} columns (unsharded; {cols} per rank x "
                             f"tp_size {geom.tp_size}), got shape {tuple(loaded.shape)}")
        first_col = geom.tp_rank * cols
        source = source.narrow(1, first_col, cols)
    if tuple(source.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"{name} must have trailing shape {tuple(param.shape[1:])}, got {tuple(loaded.shape)}")
    param.data.narrow(0, geom.offsets[i], rows).copy_(source)
    _mark_loaded(param, i, LoadedSource(tensor, tensor_row + first_row, first_col))


def _load_per_shard(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor, shard_id: object,
                    tensor: str) -> None:
    if loaded.numel() != 1 or loaded.dim() > 1:
        raise ValueError(f"{name} is one float32 per logical shard (shape () or (1,) in the checkpoint), got "
                         f"shape {tuple(loaded.shape)}")
    for i in geom.shard_indices(shard_id):
        param.data[i].copy_(loaded.reshape(()))
        _mark_loaded(param, i, LoadedSource(tensor))


def _block_rows(partitions: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """FP8 block scales: (block rows of each shard on this rank, their first row in the parameter)."""
    counts = tuple(fp8_block_grid(p, FP8_BLOCK)[0] for p in partitions)  # block rows only: any k will do
    return counts, tuple(sum(counts[:i]) for i in range(len(counts)))


def _load_block_grid(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor, shard_id: object,
                     tensor: str) -> None:
    """One shard's 128x128 block-scale grid: its rank's block rows (and, row-parallel, block columns).

    ModelOpt 0.47 writes the grid [ceil(N/128), 1, ceil(K/128), 1], or [] for a layer of one block; both
    hold the values of the 2-D grid. A shard's grid is kept whole per shard (fused q/k/v of 64 rows each
    have one partial block row each), so a rank's rows must start on a block boundary.
    """
    indices = geom.shard_indices(shard_id)
    if len(indices) != 1:
        raise ValueError(f"{name} holds the block scales of shards {shard_id!r} fused on disk; qpn splits FP8_PB_WO "
                         "block scales per shard only - store the shards separately")
    i = indices[0]
    counts, starts = _block_rows(geom.partitions)
    k_blocks = param.shape[1] * (geom.tp_size if geom.kind == "row" else 1)
    disk_rows, disk_k = geom.disk_rows[i], k_blocks * FP8_BLOCK  # a whole block per k_block: same grid
    disk_blocks, modelopt = fp8_block_grid(disk_rows, disk_k), fp8_block_grid_4d(disk_rows, disk_k)
    what = f"shard {geom.shard_ids[i]!r}" if geom.shard_ids != (None,) else "the layer"
    if tuple(loaded.shape) == modelopt or (loaded.dim() == 0 and disk_blocks == (1, 1)):
        loaded = loaded.reshape(disk_blocks)
    if tuple(loaded.shape) != disk_blocks:
        raise ValueError(f"{name} of {what} must be the 128x128 block grid {list(disk_blocks)} (or ModelOpt's "
                         f"{list(modelopt)}), got shape {tuple(loaded.shape)}")
    first_row = geom.source_ranks[i] * geom.partitions[i]
    if first_row % FP8_BLOCK != 0:
        raise ValueError(f"{what} starts at row {first_row} on tp_rank {geom.tp_rank}, inside a {FP8_BLOCK}-row "
                         "scale block; use a tensor-parallel size that keeps whole blocks on each rank")
    source = loaded.narrow(0, first_row // FP8_BLOCK, counts[i])
    first_col = geom.tp_rank * param.shape[1] if geom.kind == "row" else 0
    if geom.kind == "row":
        source = source.narrow(1, first_col, param.shape[1])
    param.data.narrow(0, starts[i], counts[i]).copy_(source)
    _mark_loaded(param, i, LoadedSource(tensor, first_row // FP8_BLOCK, first_col))


_BLOCK_GRID = "block_grid"  # parameter role: per-shard FP8 128x128 block-scale grids (_load_block_grid)


# ----------------------------------------------------------------------------- value rules (ValueRule)
# Each judges the whole checkpoint tensor as loaded (indices are the file's), with qpn.ref's rule and
# wording; the methods give each parameter its rule (_register).


def _host_bits(loaded: Tensor) -> np.ndarray:
    bits = loaded.view(torch.uint8) if loaded.dtype != torch.uint8 else loaded
    return bits.detach().cpu().numpy()


def nvfp4_block_scale_rule(name: str, loaded: Tensor) -> None:
    """NVFP4 e4m3 block scales: no NaN byte (0x7F / 0xFF), no sign bit (ref.checks.require_nvfp4_block_scales)."""
    require_nvfp4_block_scales(name, _host_bits(loaded))


def e4m3_code_rule(name: str, loaded: Tensor) -> None:
    """FP8 e4m3 weight codes: no NaN byte (ref.checks.require_no_nan_e4m3), judged on the whole weight
    where it lies: numpy's max of the masked bytes on the CPU (15 ms for 59 MB on this 2-core machine;
    torch's CPU compare took 400 ms), torch's on a GPU; the error's wording is made for a bad tensor only."""
    bits = loaded.view(torch.uint8) if loaded.dtype != torch.uint8 else loaded
    if bits.numel() == 0:
        return
    if bits.device.type == "cpu":
        largest = int(np.max(bits.detach().numpy() & 0x7F))
    else:
        largest = int(torch.amax(bits & 0x7F))
    if largest == 0x7F:  # 0x7F = 0111_1111: exponent and mantissa all ones, NaN
        require_no_nan_e4m3(name, _host_bits(loaded))


def positive_scale_rule(name: str, loaded: Tensor) -> None:
    """float32 scales finite and > 0 (ref.checks.require_positive_scale); a one-value tensor is reported
    as the one value it is."""
    values = loaded.detach().cpu().numpy()
    if values.size == 1:
        value = values.reshape(())
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be finite and > 0, got {float(value)}; the checkpoint's scale is corrupt "
                             "- re-export it")
        return
    require_positive_scale(name, values)


def fp8_scale_rule(name: str, loaded: Tensor) -> None:
    """FP8 weight scales: finite and > 0, and S16 = RN16(256 * s) inside fp16 (ref.qpn8.require_qpn8_fits_fp16)."""
    positive_scale_rule(name, loaded)
    require_qpn8_fits_fp16(loaded.detach().cpu().numpy(), name)


def _make_loader(geom: ShardGeometry, name: str, role: str, rule: ValueRule | None) -> WeightLoader:
    def weight_loader(param: Parameter, loaded_weight: Tensor, loaded_shard_id: LoadedShardId = None) -> None:
        tensor = f"{geom.checkpoint_layer(loaded_shard_id)}.{name}"
        try:
            loaded = _as_param_dtype(name, param, loaded_weight)
            if rule is not None:
                rule(name, loaded)
            if role == _BLOCK_GRID:
                _load_block_grid(geom, name, param, loaded, loaded_shard_id, tensor)
            elif role == _ROWS:
                _load_rows(geom, name, param, loaded, loaded_shard_id, tensor)
            else:
                _load_per_shard(geom, name, param, loaded, loaded_shard_id, tensor)
        except ValueError as exc:  # every load error names the checkpoint tensor and the vLLM layer
            raise ValueError(f"{geom.where(tensor, loaded_shard_id)}: {exc}") from None

    weight_loader.__qualname__ = f"qpn_weight_loader[{geom.prefix}.{name}]"
    return weight_loader


def _register(layer: QPNLayer, geom: ShardGeometry, name: str, data: Tensor, role: str,
              extra_weight_attrs: dict[str, object], cast_ok: bool = False, rule: ValueRule | None = None
              ) -> Parameter:
    param = Parameter(data, requires_grad=False)
    # the layer's attributes first; its weight_loader is replaced by ours
    _set_param_attrs(param, **{key: value for key, value in extra_weight_attrs.items() if key != "weight_loader"})
    sources: dict[int, LoadedSource] = {}  # the slots loaded so far, and from what
    _set_param_attrs(param, weight_loader=_make_loader(geom, name, role, rule), qpn_role=role, qpn_sources=sources,
                     qpn_cast_ok=cast_ok)
    if role == _ROWS:
        _set_param_attrs(param, output_dim=0)
        if data.dim() == 2:
            _set_param_attrs(param, input_dim=1)
    layer.register_parameter(name, param)
    return param


def _require_loaded(layer: QPNLayer, geom: ShardGeometry, names: tuple[str, ...]) -> None:
    missing, tensors = [], []
    for name in names:
        param = getattr(layer, name)
        slots = set(range(len(geom.partitions)))
        absent = sorted(slots - set(_sources(param)))
        if absent:
            ids = [geom.shard_ids[i] for i in absent] if geom.shard_ids != (None,) else ["(whole layer)"]
            missing.append(f"{name} {ids}")
            tensors += [f"{geom.checkpoint_layer(geom.shard_ids[i])}.{name}" for i in absent]
    if missing:
        raise ValueError(f"vLLM layer {geom.prefix!r}: the checkpoint never loaded {', '.join(missing)} (checkpoint "
                         f"tensors {tensors}); every shard's weight and scales must be present (is this a ModelOpt "
                         "checkpoint of this model?)")
