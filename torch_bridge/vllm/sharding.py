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
Shapes and dtypes are checked (ValueError naming the layer, the parameter, the rule and the fix);
e4m3 tensors may come as torch.float8_e4m3fn or as uint8 bit patterns; nothing else is cast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor
from torch.nn import Parameter

from ...ref.formats import FP8_BLOCK as FP8_BLOCK  # kept for imports: FP8_PB_WO scales one 128x128 block each
from ...ref.fp8 import fp8_block_grid, fp8_block_grid_4d

if TYPE_CHECKING:
    from ._compat import QPNLayer

QKV_SHARD_IDS = ("q", "k", "v")

_ROWS = "rows"  # parameter role: rows follow the output partition (weight, block scales, channel scales)
_PER_SHARD = "per_shard"  # parameter role: one fp32 value per logical shard

ShardId = int | str  # one logical shard: 0, 1, ... (MergedColumnParallelLinear) or "q"/"k"/"v"
# what vLLM passes as loaded_shard_id: one id, a tuple of consecutive ids, or None (module docstring)
LoadedShardId = ShardId | tuple[ShardId, ...] | None


class WeightLoader(Protocol):
    """`param.weight_loader`, the call vLLM's model load_weights makes for each checkpoint tensor."""

    def __call__(self, param: Parameter, loaded_weight: Tensor, loaded_shard_id: LoadedShardId = None) -> None: ...


# ----------------------------------------------------------------------------- layer geometry


@dataclass(frozen=True)
class ShardGeometry:
    """How one rank's parameters map onto the checkpoint tensors (module docstring).

    kind: "column" | "merged" | "qkv" | "row" | "replicated"; partitions: rows of each logical shard
    on this rank (vLLM's output_partition_sizes); offsets: their first row; disk_rows: rows of each
    shard in the checkpoint; source_ranks: which slice of partitions[i] rows this rank takes.
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
            raise ValueError(f"layer {self.prefix!r} ({self.kind}) is not fused and takes no shard id, got "
                             f"{shard_id!r}; load its tensor without a shard id")
        raise ValueError(f"layer {self.prefix!r} ({self.kind}) has shard ids {self.shard_ids}, got {shard_id!r}")

    def shard_indices(self, shard_id: object) -> list[int]:
        """None -> every shard; a tuple of consecutive ids -> those; one id -> [its index]."""
        if shard_id is None:
            return list(range(len(self.partitions)))
        if isinstance(shard_id, tuple):
            indices = [self.shard_index(s) for s in shard_id]
            if not indices or any(b - a != 1 for a, b in pairwise(indices)):
                raise ValueError(f"layer {self.prefix!r}: a tuple shard id must list consecutive shards, got "
                                 f"{shard_id!r}")
            return indices
        return [self.shard_index(shard_id)]


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


def layer_geometry(layer: object, input_size_per_partition: int,
                   output_partition_sizes: Sequence[int]) -> ShardGeometry:
    """Read the sharding of `layer` from the attributes vLLM's linear layers set before create_weights.

    QKVParallelLinear: num_kv_head_replicas, total_num_heads, total_num_kv_heads, head_size
    (v_head_size); RowParallelLinear: input_is_parallel; MergedColumnParallelLinear: output_sizes +
    gather_output; ColumnParallelLinear: gather_output; anything else is replicated. All but
    replicated read tp_rank / tp_size (vLLM sets them to 0 / 1 with disable_tp).
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
                         k_partition)


# ----------------------------------------------------------------------------- weight loading

_E4M3_PARAM_DTYPES = (torch.float8_e4m3fn,)


def _as_param_dtype(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor) -> Tensor:
    if not isinstance(loaded, Tensor):
        raise ValueError(f"layer {geom.prefix!r}: {name} must be loaded from a torch.Tensor, got "
                         f"{type(loaded).__name__}")
    if param.dtype in _E4M3_PARAM_DTYPES and loaded.dtype == torch.uint8:
        return loaded.view(param.dtype)  # e4m3 bit patterns
    if getattr(param, "qpn_cast_ok", False) and loaded.is_floating_point():
        return loaded  # unquantized weights: vLLM casts the checkpoint dtype to the model dtype
    if loaded.dtype != param.dtype:
        raise ValueError(f"layer {geom.prefix!r}: {name} must be {param.dtype} (ModelOpt stores it so), got "
                         f"{loaded.dtype} of shape {tuple(loaded.shape)}; pass the checkpoint tensor unchanged")
    return loaded


def _set_param_attrs(param: Parameter, /, **attrs: object) -> None:
    """vLLM reads a parameter's loading metadata as plain attributes (weight_loader, output_dim,
    input_dim, and whatever the layer passes in extra_weight_attrs), and qpn adds its own (qpn_role,
    qpn_loaded, qpn_cast_ok); torch's Parameter type declares none of them, so they are set by name,
    here only."""
    for key, value in attrs.items():
        setattr(param, key, value)


def _loaded_slots(param: Tensor) -> set[int]:
    """The shard slots of `param` loaded so far: its qpn_loaded set (_register)."""
    slots: set[int] = param.qpn_loaded  # type: ignore[attr-defined]  # set by name (_set_param_attrs)
    return slots


def _load_rows(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor, shard_id: object) -> None:
    indices = geom.shard_indices(shard_id)
    if len(indices) > 1:  # several shards in one tensor (fused on disk): split by unsharded sizes
        expected = sum(geom.disk_rows[i] for i in indices)
        if loaded.dim() == 0 or loaded.shape[0] != expected:
            raise ValueError(f"layer {geom.prefix!r}: {name} for shards {shard_id!r} must have {expected} rows "
                             f"(the unsharded sizes {[geom.disk_rows[i] for i in indices]} stacked), got shape "
                             f"{tuple(loaded.shape)}")
        start = 0
        for i in indices:
            _load_rows(geom, name, param, loaded.narrow(0, start, geom.disk_rows[i]),
                       geom.shard_ids[i] if geom.shard_ids != (None,) else None)
            start += geom.disk_rows[i]
        return
    i = indices[0]
    if param.dim() == 1 and loaded.dim() == 2 and loaded.shape[1] == 1:
        loaded = loaded.reshape(-1)  # per-channel scales stored [N, 1]
    if loaded.dim() != param.dim() or loaded.shape[0] != geom.disk_rows[i]:
        what = f"shard {geom.shard_ids[i]!r}" if geom.shard_ids != (None,) else "the layer"
        raise ValueError(f"layer {geom.prefix!r}: {name} of {what} must have {geom.disk_rows[i]} rows (unsharded) "
                         f"and {param.dim()} dimensions, got shape {tuple(loaded.shape)}; "
                         "is the checkpoint for this model and tensor-parallel layout?")
    rows = geom.partitions[i]
    source = loaded.narrow(0, geom.source_ranks[i] * rows, rows)
    if geom.kind == "row" and param.dim() == 2:  # input columns are split across ranks
        cols = param.shape[1]
        if loaded.shape[1] != cols * geom.tp_size:
            raise ValueError(f"layer {geom.prefix!r}: {name} must have {cols * geom.tp_size} columns (unsharded; "
                             f"{cols} per rank x tp_size {geom.tp_size}), got shape {tuple(loaded.shape)}")
        source = source.narrow(1, geom.tp_rank * cols, cols)
    if tuple(source.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"layer {geom.prefix!r}: {name} must have trailing shape {tuple(param.shape[1:])}, got "
                         f"{tuple(loaded.shape)}")
    param.data.narrow(0, geom.offsets[i], rows).copy_(source)
    _loaded_slots(param).add(i)


def _load_per_shard(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor, shard_id: object) -> None:
    if loaded.numel() != 1 or loaded.dim() > 1:
        raise ValueError(f"layer {geom.prefix!r}: {name} is one float32 per logical shard (shape () or (1,) in "
                         f"the checkpoint), got shape {tuple(loaded.shape)}")
    for i in geom.shard_indices(shard_id):
        param.data[i].copy_(loaded.reshape(()))
        _loaded_slots(param).add(i)


def _block_rows(partitions: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """FP8 block scales: (block rows of each shard on this rank, their first row in the parameter)."""
    counts = tuple(fp8_block_grid(p, FP8_BLOCK)[0] for p in partitions)  # block rows only: any k will do
    return counts, tuple(sum(counts[:i]) for i in range(len(counts)))


def _load_block_grid(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor, shard_id: object) -> None:
    """One shard's 128x128 block-scale grid: its rank's block rows (and, row-parallel, block columns).

    ModelOpt 0.47 writes the grid [ceil(N/128), 1, ceil(K/128), 1], or [] for a layer of one block; both
    hold the values of the 2-D grid. A shard's grid is kept whole per shard (fused q/k/v of 64 rows each
    have one partial block row each), so a rank's rows must start on a block boundary.
    """
    indices = geom.shard_indices(shard_id)
    if len(indices) != 1:
        raise ValueError(f"layer {geom.prefix!r}: {name} holds the block scales of shards {shard_id!r} fused on disk; "
                         "qpn splits FP8_PB_WO block scales per shard only - store the shards separately")
    i = indices[0]
    counts, starts = _block_rows(geom.partitions)
    k_blocks = param.shape[1] * (geom.tp_size if geom.kind == "row" else 1)
    disk_rows, disk_k = geom.disk_rows[i], k_blocks * FP8_BLOCK  # a whole block per k_block: same grid
    disk_blocks, modelopt = fp8_block_grid(disk_rows, disk_k), fp8_block_grid_4d(disk_rows, disk_k)
    what = f"shard {geom.shard_ids[i]!r}" if geom.shard_ids != (None,) else "the layer"
    if tuple(loaded.shape) == modelopt or (loaded.dim() == 0 and disk_blocks == (1, 1)):
        loaded = loaded.reshape(disk_blocks)
    if tuple(loaded.shape) != disk_blocks:
        raise ValueError(f"layer {geom.prefix!r}: {name} of {what} must be the 128x128 block grid {list(disk_blocks)} "
                         f"(or ModelOpt's {list(modelopt)}), got shape {tuple(loaded.shape)}")
    first_row = geom.source_ranks[i] * geom.partitions[i]
    if first_row % FP8_BLOCK != 0:
        raise ValueError(f"layer {geom.prefix!r}: {what} starts at row {first_row} on tp_rank {geom.tp_rank}, "
                         f"inside a {FP8_BLOCK}-row scale block; "
                         "use a tensor-parallel size that keeps whole blocks on each rank")
    source = loaded.narrow(0, first_row // FP8_BLOCK, counts[i])
    if geom.kind == "row":
        source = source.narrow(1, geom.tp_rank * param.shape[1], param.shape[1])
    param.data.narrow(0, starts[i], counts[i]).copy_(source)
    _loaded_slots(param).add(i)


_BLOCK_GRID = "block_grid"  # parameter role: per-shard FP8 128x128 block-scale grids (_load_block_grid)


def _make_loader(geom: ShardGeometry, name: str, role: str) -> WeightLoader:
    def weight_loader(param: Parameter, loaded_weight: Tensor, loaded_shard_id: LoadedShardId = None) -> None:
        loaded = _as_param_dtype(geom, name, param, loaded_weight)
        if role == _BLOCK_GRID:
            _load_block_grid(geom, name, param, loaded, loaded_shard_id)
        elif role == _ROWS:
            _load_rows(geom, name, param, loaded, loaded_shard_id)
        else:
            _load_per_shard(geom, name, param, loaded, loaded_shard_id)

    weight_loader.__qualname__ = f"qpn_weight_loader[{geom.prefix}.{name}]"
    return weight_loader


def _register(layer: QPNLayer, geom: ShardGeometry, name: str, data: Tensor, role: str,
              extra_weight_attrs: dict[str, object], cast_ok: bool = False) -> Parameter:
    param = Parameter(data, requires_grad=False)
    # the layer's attributes first; its weight_loader is replaced by ours
    _set_param_attrs(param, **{key: value for key, value in extra_weight_attrs.items() if key != "weight_loader"})
    loaded: set[int] = set()
    _set_param_attrs(param, weight_loader=_make_loader(geom, name, role), qpn_role=role, qpn_loaded=loaded,
                     qpn_cast_ok=cast_ok)
    if role == _ROWS:
        _set_param_attrs(param, output_dim=0)
        if data.dim() == 2:
            _set_param_attrs(param, input_dim=1)
    layer.register_parameter(name, param)
    return param


def _require_loaded(layer: QPNLayer, geom: ShardGeometry, names: tuple[str, ...]) -> None:
    missing = []
    for name in names:
        param = getattr(layer, name)
        slots = set(range(len(geom.partitions)))
        absent = sorted(slots - _loaded_slots(param))
        if absent:
            ids = [geom.shard_ids[i] for i in absent] if geom.shard_ids != (None,) else ["(whole layer)"]
            missing.append(f"{name} {ids}")
    if missing:
        raise ValueError(f"layer {geom.prefix!r}: the checkpoint never loaded {', '.join(missing)}; every shard's "
                         "weight and scales must be present (is this a ModelOpt checkpoint of this model?)")
