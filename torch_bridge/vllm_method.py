"""vLLM linear method for ModelOpt NVFP4 / FP8 / MIXED_PRECISION checkpoints on cards without FP4/FP8 units.

Use (qpn installed next to vLLM; its `vllm.general_plugins` entry point makes every vLLM process
call `register()`; if VLLM_PLUGINS is set, it must list "qpn"):

    vllm serve ./Llama-3.1-8B-Instruct-NVFP4 --quantization qpn --dtype half
    LLM(model="./Llama-3.1-8B-Instruct-NVFP4", quantization="qpn", dtype="half")

The checkpoint is unchanged: it keeps its own ModelOpt quantization config (config.json
`quantization_config`, or the older `hf_quant_config.json`), which `QPNConfig.from_config` parses.
vLLM would match that config to "modelopt" / "modelopt_fp4" / "modelopt_mixed" and then refuse the
user's "qpn" as a mismatch; `QPNConfig.override_quantization_method` (vLLM asks plugin configs first)
claims a ModelOpt NVFP4 / W4A16_NVFP4 / FP8 / FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO / MIXED_PRECISION
config, but only when the user asked for "qpn", so vLLM's own ModelOpt path stays the default
otherwise; asked for "qpn" on a checkpoint it cannot run (another quant_algo, compressed-tensors), it
raises a ValueError saying why, instead of vLLM's bare "does not match" message.
`dtype="half"`: the kernels take fp16 activations (get_supported_act_dtypes), so a bf16 model must
run in fp16.

Public names:
- `QPNConfig` (a vLLM `QuantizationConfig`): name "qpn", activations fp16, minimum capability 75,
  config files ["hf_quant_config.json"], `from_config`, `get_quant_method(layer, prefix)`.
- `QPNNVFP4LinearMethod`, `QPNFP8LinearMethod` (vLLM `LinearMethodBase`): `create_weights`,
  `process_weights_after_loading`, `apply(layer, x, bias=None)`; qpn extras `apply_gated(layer, x)`
  (fused gate_up + SiLU-and-mul epilogue inside the op) and `dequantized_weight(layer)`.
- `QPNUnquantizedLinearMethod`: the excluded-layer method used only when vLLM is not installed
  (with vLLM, excluded layers get vLLM's own `UnquantizedLinearMethod`).
- `register()`: calls vLLM's `register_quantization_config("qpn")`; idempotent.

Without vLLM this module still imports: minimal local base classes stand in for vLLM's
(`VLLM_AVAILABLE` says which are in use), and tests/vllm_standin.py drives the same call sequence.

Parameters (ModelOpt's checkpoint names and shapes; N_part = sum(output_partition_sizes),
K_part = input_size_per_partition, S = number of logical shards, e.g. 3 for q/k/v):
    NVFP4 (NVFP4, W4A16_NVFP4): weight uint8 [N_part, K_part/2], weight_scale float8_e4m3fn
        [N_part, K_part/16], weight_scale_2 float32 [S], input_scale float32 [S] (loaded, unused)
    FP8 per tensor (FP8): weight float8_e4m3fn [N_part, K_part], weight_scale float32 [S],
        input_scale float32 [S] (loaded, unused)
    FP8 per channel (FP8_PER_CHANNEL_PER_TOKEN): weight as above, weight_scale float32 [N_part]
        ([N, 1] on disk is read as [N])
    FP8 128x128 blocks (FP8_PB_WO): weight as above, weight_scale float32 [sum_i ceil(N_i/128),
        K_part/128]: each shard's own block grid, stacked (ModelOpt 0.47 writes [N/128, 1, K/128, 1],
        or [] for a layer of one block: the same values). K_part % 128 == 0; a fused layer's shards
        must be multiples of 32 rows on this rank and start on a 128-row block (ValueError otherwise):
        each shard is packed with its own grid and the 32-row tiles concatenated

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

process_weights_after_loading (every slot must have been loaded; ValueError otherwise):
- NVFP4: prepack through torch.ops.qpn.nvfp4_prepack (qpn.torch_bridge.pack_nvfp4 validates the
  values: NaN scale bytes, fp16 overflow). Global scale: if every shard's weight_scale_2 is the
  same fp32 value, that scalar (N_part is then padded to 32 inside and the padding cropped in
  apply); otherwise one value per 32-row tile, each shard's tiles carrying its own scale, which
  needs every shard's N_part to be a multiple of 32 (ValueError otherwise). Different shard
  scales are NEVER collapsed with max() (that makes the smaller shards 1.5-3x too large).
- FP8: per-shard scalars become a per-channel scale vector (each row keeps its shard's scale:
  exact), then torch.ops.qpn.fp8_prepack (per-channel QPN8: S16 = RN16(256 * s)); block scales
  prepack as they are (QPN8 block layout).
- The original parameters are deleted; the layer keeps qpn_codes, qpn_scales (and
  qpn_global_scale for NVFP4) as frozen Parameters.

apply(layer, x, bias): x [..., K_part] float16 -> flattened to [M, K_part] -> torch.ops.qpn.nvfp4_linear
/ fp8_linear (fp32 accumulation, one RN16; the decode / dense split is inside the op) -> padding
cropped -> bias added as RN16(y + b) (computed in fp32 and rounded once: exact sum of two fp16
values rounded to fp16, because fp32 holds 24 >= 2 * 11 + 2 bits, so the double rounding is
innocuous) -> [..., N_part].

Embeddings and lm_head (VocabParallelEmbedding, ParallelLMHead) are left to vLLM (get_quant_method
returns None: vLLM's unquantized embedding); vLLM gives them the same `output_partition_sizes` /
`input_size` attributes as its linear layers, so they are recognised by class, never by shape.

KV cache: attention layers get `QPNKVCacheMethod`, vLLM's own BaseKVCacheMethod, as vLLM's ModelOpt
method does: the checkpoint's k_scale / v_scale (ModelOpt `kv_cache_quant_algo: FP8`, stored as
self_attn.k_proj.k_scale / v_proj.v_scale and renamed by vLLM) reach the fp8 KV cache that vLLM picks
from the same config. Activations stay fp16: only the cache is fp8.

Not covered: MoE experts (a quantized FusedMoE layer raises), a quantized lm_head / embedding
(raises: ModelOpt excludes lm_head), MXFP8 / NVFP4_AWQ / W4A8 and other algorithms (refused with the
reason), compressed-tensors checkpoints, pre-sharded (`is_sharded_weight`) loading and
`--load-format dummy` (every shard must be loaded).
"""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from qpn.ref.fp8 import fp8_block_grid, fp8_block_grid_4d
from qpn.ref.geometry import GROUP_K, TILE_N

from . import ops  # registers torch.ops.qpn.*
from .module import PackedWeight, pack_fp8, pack_nvfp4

try:  # vLLM is optional: subclass its classes when it is installed
    from vllm.model_executor.layers.linear import LinearBase as _VllmLinearBase
    from vllm.model_executor.layers.linear import LinearMethodBase
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod as _VllmUnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod as _VllmKVCacheMethod

    VLLM_AVAILABLE = True
except ImportError:
    VLLM_AVAILABLE = False
    _VllmLinearBase = None
    _VllmUnquantizedLinearMethod = None
    _VllmKVCacheMethod = None

    class QuantizationConfig(ABC):  # the part of vLLM's base class this module relies on
        def __init__(self):
            super().__init__()
            self.packed_modules_mapping: dict[str, list[str]] = {}

        @staticmethod
        def get_from_keys(config: Mapping, keys: list[str]) -> Any:
            for key in keys:
                if key in config:
                    return config[key]
            raise ValueError(f"Cannot find any of {keys} in the model's quantization config.")

        @staticmethod
        def get_from_keys_or(config: Mapping, keys: list[str], default: Any) -> Any:
            try:
                return QuantizationConfig.get_from_keys(config, keys)
            except ValueError:
                return default

    class LinearMethodBase(ABC):  # vLLM's LinearMethodBase / QuantizeMethodBase, minimal
        @abstractmethod
        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                           output_size, params_dtype, **extra_weight_attrs):
            raise NotImplementedError

        @abstractmethod
        def apply(self, layer, x, bias=None):
            raise NotImplementedError

        def process_weights_after_loading(self, layer) -> None:
            return


QUANT_NAME = "qpn"
MIN_CAPABILITY = 75  # Turing (sm_75); newer cards run the compute_75 PTX
CONFIG_FILENAMES = ["hf_quant_config.json"]
NVFP4_GROUP_SIZE = GROUP_K  # 16
NVFP4_K_MULTIPLE = ops.NVFP4_K_MULTIPLE  # 64 (QPN2)
FP8_K_MULTIPLE = ops.FP8_K_MULTIPLE  # 16 (QPN8, channel scales)
FP8_BLOCK = ops.FP8_BLOCK  # 128: FP8_PB_WO scales one 128x128 block each
# ModelOpt per-layer algorithm -> qpn method kind
LAYER_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8_tensor",
               "FP8_PER_CHANNEL_PER_TOKEN": "fp8_channel", "FP8_PB_WO": "fp8_block"}
EMBEDDING_CLASSES = {"VocabParallelEmbedding", "ParallelLMHead"}  # ParallelLMHead subclasses the former
ATTENTION_CLASSES = {"Attention", "MLAAttention"}  # vLLM's attention layers (KV-cache scales)
QUANT_ALGOS = tuple(LAYER_ALGOS) + ("MIXED_PRECISION",)
QKV_SHARD_IDS = ("q", "k", "v")
# vLLM models set packed_modules_mapping on the config; this is the fallback for the usual names
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

_ROWS = "rows"  # parameter role: rows follow the output partition (weight, block scales, channel scales)
_PER_SHARD = "per_shard"  # parameter role: one fp32 value per logical shard
_UNLOADED = float("nan")  # initial value of per-shard slots (the loaded-slot bookkeeping is what counts)


# ----------------------------------------------------------------------------- layer geometry


def _class_names(obj) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def is_linear_layer(layer) -> bool:
    """vLLM's LinearBase, or anything shaped like it (the stand-in): `output_partition_sizes` is set
    by every vLLM linear layer before it asks the config for a method. vLLM's embeddings and lm_head
    set the same two attributes, so they are excluded by class first: claiming one made vLLM call
    the linear method's `embedding()`, which a linear method does not have."""
    if _class_names(layer) & EMBEDDING_CLASSES:
        return False
    if _VllmLinearBase is not None and isinstance(layer, _VllmLinearBase):
        return True
    return hasattr(layer, "output_partition_sizes") and hasattr(layer, "input_size")


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
    shard_ids: tuple
    k_partition: int

    @property
    def n_partition(self) -> int:
        return sum(self.partitions)

    def shard_index(self, shard_id) -> int:
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

    def shard_indices(self, shard_id) -> list[int]:
        """None -> every shard; a tuple of consecutive ids -> those; one id -> [its index]."""
        if shard_id is None:
            return list(range(len(self.partitions)))
        if isinstance(shard_id, tuple):
            indices = [self.shard_index(s) for s in shard_id]
            if not indices or any(b - a != 1 for a, b in zip(indices, indices[1:])):
                raise ValueError(f"layer {self.prefix!r}: a tuple shard id must list consecutive shards, got "
                                 f"{shard_id!r}")
            return indices
        return [self.shard_index(shard_id)]


def _int_attr(layer, name: str, default=None) -> int:
    value = getattr(layer, name, default)
    if value is None:
        raise ValueError(f"layer {getattr(layer, 'prefix', '?')!r} ({type(layer).__name__}) has no attribute "
                         f"{name!r}, which vLLM's parallel linear layers set; qpn cannot tell how it is sharded")
    return int(value)


def layer_geometry(layer, input_size_per_partition: int, output_partition_sizes) -> ShardGeometry:
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
    if hasattr(layer, "num_kv_head_replicas") and hasattr(layer, "total_num_heads"):
        kind = "qkv"
    elif hasattr(layer, "input_is_parallel"):
        kind = "row"
    elif hasattr(layer, "gather_output"):
        kind = "merged" if hasattr(layer, "output_sizes") else "column"
    else:
        kind = "replicated"
    if kind == "replicated":
        tp_rank, tp_size = 0, 1
    else:
        tp_rank, tp_size = _int_attr(layer, "tp_rank"), _int_attr(layer, "tp_size")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"layer {prefix!r}: tp_rank must be in [0, tp_size), got {tp_rank} / {tp_size}")

    shard_ids: tuple = (None,)
    source_ranks = (tp_rank,) * len(partitions)
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
    elif kind == "merged" or (kind == "replicated" and hasattr(layer, "output_sizes")):
        disk_rows = tuple(int(s) for s in layer.output_sizes)
        shard_ids = tuple(range(len(disk_rows)))
    elif kind == "row":
        disk_rows = partitions
        source_ranks = (0,)
    else:
        disk_rows = tuple(p * tp_size for p in partitions)
    if kind == "replicated":
        source_ranks = (0,) * len(partitions)
    if len(disk_rows) != len(partitions) or any(
            (r + 1) * p > d for r, p, d in zip(source_ranks, partitions, disk_rows)):
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


def _load_rows(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor, shard_id) -> None:
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
    param.qpn_loaded.add(i)


def _load_per_shard(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor, shard_id) -> None:
    if loaded.numel() != 1 or loaded.dim() > 1:
        raise ValueError(f"layer {geom.prefix!r}: {name} is one float32 per logical shard (shape () or (1,) in "
                         f"the checkpoint), got shape {tuple(loaded.shape)}")
    for i in geom.shard_indices(shard_id):
        param.data[i].copy_(loaded.reshape(()))
        param.qpn_loaded.add(i)


def _block_rows(partitions) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """FP8 block scales: (block rows of each shard on this rank, their first row in the parameter)."""
    counts = tuple(fp8_block_grid(p, FP8_BLOCK)[0] for p in partitions)  # block rows only: any k will do
    return counts, tuple(sum(counts[:i]) for i in range(len(counts)))


def _load_block_grid(geom: ShardGeometry, name: str, param: Tensor, loaded: Tensor, shard_id) -> None:
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
        raise ValueError(f"layer {geom.prefix!r}: {what} starts at row {first_row} on tp_rank {geom.tp_rank}, inside a "
                         f"{FP8_BLOCK}-row scale block; use a tensor-parallel size that keeps whole blocks on each rank")
    source = loaded.narrow(0, first_row // FP8_BLOCK, counts[i])
    if geom.kind == "row":
        source = source.narrow(1, geom.tp_rank * param.shape[1], param.shape[1])
    param.data.narrow(0, starts[i], counts[i]).copy_(source)
    param.qpn_loaded.add(i)


_BLOCK_GRID = "block_grid"  # parameter role: per-shard FP8 128x128 block-scale grids (_load_block_grid)


def _make_loader(geom: ShardGeometry, name: str, role: str):
    def weight_loader(param: Parameter, loaded_weight: Tensor, loaded_shard_id=None) -> None:
        loaded = _as_param_dtype(geom, name, param, loaded_weight)
        if role == _BLOCK_GRID:
            _load_block_grid(geom, name, param, loaded, loaded_shard_id)
        elif role == _ROWS:
            _load_rows(geom, name, param, loaded, loaded_shard_id)
        else:
            _load_per_shard(geom, name, param, loaded, loaded_shard_id)

    weight_loader.__qualname__ = f"qpn_weight_loader[{geom.prefix}.{name}]"
    return weight_loader


def _register(layer, geom: ShardGeometry, name: str, data: Tensor, role: str, extra_weight_attrs: dict,
              cast_ok: bool = False) -> Parameter:
    param = Parameter(data, requires_grad=False)
    for key, value in extra_weight_attrs.items():
        if key != "weight_loader":  # ours replaces the layer's
            setattr(param, key, value)
    param.weight_loader = _make_loader(geom, name, role)
    param.qpn_role = role
    param.qpn_loaded = set()
    param.qpn_cast_ok = cast_ok
    if role == _ROWS:
        param.output_dim = 0
        if data.dim() == 2:
            param.input_dim = 1
    layer.register_parameter(name, param)
    return param


def _require_loaded(layer, geom: ShardGeometry, names: tuple[str, ...]) -> None:
    missing = []
    for name in names:
        param = getattr(layer, name)
        slots = set(range(len(geom.partitions)))
        absent = sorted(slots - param.qpn_loaded)
        if absent:
            ids = [geom.shard_ids[i] for i in absent] if geom.shard_ids != (None,) else ["(whole layer)"]
            missing.append(f"{name} {ids}")
    if missing:
        raise ValueError(f"layer {geom.prefix!r}: the checkpoint never loaded {', '.join(missing)}; every shard's "
                         "weight and scales must be present (is this a ModelOpt checkpoint of this model?)")


def _begin_create(layer, input_size_per_partition, output_partition_sizes, k_multiple: int, fmt: str):
    geom = layer_geometry(layer, input_size_per_partition, output_partition_sizes)
    k = geom.k_partition
    if k <= 0 or k % k_multiple != 0:
        input_size = getattr(layer, "input_size", "?")
        raise ValueError(
            f"layer {geom.prefix!r}: {fmt} needs the input features per partition to be a multiple of {k_multiple}, "
            f"got K_part={k} (input_size={input_size}, tp_size={geom.tp_size}, {geom.kind}-parallel); pick a "
            "tensor-parallel size that keeps K_part a multiple of it, or exclude this layer from quantization")
    layer.qpn_geometry = geom
    # the attributes vLLM's own ModelOpt methods set, for code that reads them
    layer.logical_widths = list(geom.partitions)
    layer.input_size_per_partition = k
    layer.output_size_per_partition = geom.n_partition
    return geom


def _finish(layer, fmt: str, packed, deleted: tuple[str, ...]) -> None:
    for name in deleted:
        if hasattr(layer, name):
            delattr(layer, name)
    layer.qpn_format = fmt
    layer.qpn_codes = Parameter(packed.codes, requires_grad=False)
    layer.qpn_scales = Parameter(packed.scales, requires_grad=False)
    if packed.global_scale is not None:
        layer.qpn_global_scale = Parameter(packed.global_scale, requires_grad=False)
    layer.qpn_out_features = packed.out_features


def _apply(layer, x: Tensor, bias: Tensor | None, gated: bool = False) -> Tensor:
    k = layer.input_size_per_partition
    n = layer.qpn_out_features
    if x.shape[-1] != k:
        raise ValueError(f"layer {layer.qpn_geometry.prefix!r}: x must have {k} input features in its last "
                         f"dimension, got shape {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if layer.qpn_format == "nvfp4":
        y = torch.ops.qpn.nvfp4_linear(x2, layer.qpn_codes, layer.qpn_scales, layer.qpn_global_scale, gated)
    else:
        y = torch.ops.qpn.fp8_linear(x2, layer.qpn_codes, layer.qpn_scales, gated)
    n_out = n // 2 if gated else n
    if y.shape[1] != n_out:
        y = y[:, :n_out]  # pad rows (N_part padded to 32) produce exact zeros; crop them
    if bias is not None:
        y = (y.float() + bias.float()).to(y.dtype)  # RN16(y + b): module docstring
    return y.reshape(*lead, n_out)


class _QPNLinearMethodBase(LinearMethodBase):
    """Shared apply / apply_gated / dequantized_weight of the two qpn methods."""

    fmt = ""

    def __init__(self, quant_config: QPNConfig | None = None):
        self.quant_config = quant_config

    def apply(self, layer, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return _apply(layer, x, bias)

    def apply_gated(self, layer, x: Tensor) -> Tensor:
        """Fused gate_up (MergedColumnParallelLinear with two equal shards) + SiLU-and-mul inside the op:
        equals vLLM's silu_and_mul applied to apply(layer, x). x [..., K_part] -> [..., N_part/2]."""
        geom = layer.qpn_geometry
        parts = geom.partitions
        if len(parts) != 2 or parts[0] != parts[1] or parts[0] % TILE_N != 0 or layer.qpn_codes.shape[0] != sum(parts):
            raise ValueError(f"layer {geom.prefix!r}: apply_gated needs a gate_up layer of two equal shards, each a "
                             f"multiple of {TILE_N} rows on this rank, got partitions {list(parts)}; use apply() "
                             "and a separate silu_and_mul")
        if getattr(layer, "bias", None) is not None:
            raise ValueError(f"layer {geom.prefix!r}: apply_gated does not add a bias (the epilogue follows the "
                             "linear directly); use apply() and a separate silu_and_mul")
        return _apply(layer, x, None, gated=True)

    def dequantized_weight(self, layer) -> Tensor:
        """float16 [N_part, K_part]: the W16 this rank computes with (padding cropped)."""
        if layer.qpn_format == "nvfp4":
            w16 = torch.ops.qpn.nvfp4_dequantize(layer.qpn_codes, layer.qpn_scales, layer.qpn_global_scale)
        else:
            w16 = torch.ops.qpn.fp8_dequantize(layer.qpn_codes, layer.qpn_scales)
        return w16[: layer.qpn_out_features]


class QPNNVFP4LinearMethod(_QPNLinearMethodBase):
    """ModelOpt NVFP4 / W4A16_NVFP4 weights, run weight-only through the QPN2 ops (module docstring)."""

    fmt = "nvfp4"

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        del input_size, output_size, params_dtype
        geom = _begin_create(layer, input_size_per_partition, output_partition_sizes, NVFP4_K_MULTIPLE,
                             "NVFP4 (QPN2 layout)")
        n, k, s = geom.n_partition, geom.k_partition, len(geom.partitions)
        _register(layer, geom, "weight", torch.empty((n, k // 2), dtype=torch.uint8), _ROWS, extra_weight_attrs)
        _register(layer, geom, "weight_scale", torch.empty((n, k // NVFP4_GROUP_SIZE), dtype=torch.float8_e4m3fn),
                  _ROWS, extra_weight_attrs)
        _register(layer, geom, "weight_scale_2", torch.full((s,), _UNLOADED, dtype=torch.float32), _PER_SHARD,
                  extra_weight_attrs)
        _register(layer, geom, "input_scale", torch.full((s,), _UNLOADED, dtype=torch.float32), _PER_SHARD,
                  extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        geom: ShardGeometry = layer.qpn_geometry
        _require_loaded(layer, geom, ("weight", "weight_scale", "weight_scale_2"))
        g = layer.weight_scale_2.data
        if bool(torch.all(g == g[0])):
            global_scale = g[:1].clone()  # one value for the whole layer
        else:
            misaligned = {geom.shard_ids[i]: p for i, p in enumerate(geom.partitions) if p % TILE_N != 0}
            if misaligned:
                raise ValueError(
                    f"layer {geom.prefix!r}: its shards {list(geom.shard_ids)} carry different weight_scale_2 "
                    f"{[float(v) for v in g.cpu()]}; qpn keeps one global scale per {TILE_N}-row tile (never the "
                    f"max(), which mis-scales the smaller shards), so every shard's rows on this rank must be a "
                    f"multiple of {TILE_N}, got {misaligned} (partitions {list(geom.partitions)}, tp_size "
                    f"{geom.tp_size}); use a tensor-parallel size that keeps them aligned, or requantize the shards "
                    "to one weight_scale_2")
            tiles = torch.tensor([p // TILE_N for p in geom.partitions], device=g.device)
            global_scale = torch.repeat_interleave(g, tiles)  # tile t: the scale of the shard holding its rows
        packed = pack_nvfp4(layer.weight.data, layer.weight_scale.data, global_scale)
        _finish(layer, self.fmt, packed, ("weight", "weight_scale", "weight_scale_2", "input_scale"))


class QPNFP8LinearMethod(_QPNLinearMethodBase):
    """ModelOpt FP8 (per-tensor, per shard), FP8_PER_CHANNEL_PER_TOKEN or FP8_PB_WO (128x128 blocks)
    weights, run weight-only through the QPN8 ops (module docstring)."""

    fmt = "fp8"

    def __init__(self, quant_config: QPNConfig | None = None, granularity: str = "tensor"):
        super().__init__(quant_config)
        if granularity not in ("tensor", "channel", "block"):
            raise ValueError(f"granularity must be 'tensor', 'channel' or 'block' (ModelOpt FP8 / "
                             f"FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO), got {granularity!r}")
        self.granularity = granularity

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        del input_size, output_size, params_dtype
        block = self.granularity == "block"
        geom = _begin_create(layer, input_size_per_partition, output_partition_sizes,
                             FP8_BLOCK if block else FP8_K_MULTIPLE, "FP8 (QPN8 layout)")
        n, k, s = geom.n_partition, geom.k_partition, len(geom.partitions)
        _register(layer, geom, "weight", torch.empty((n, k), dtype=torch.float8_e4m3fn), _ROWS, extra_weight_attrs)
        if self.granularity == "tensor":
            _register(layer, geom, "weight_scale", torch.full((s,), _UNLOADED, dtype=torch.float32), _PER_SHARD,
                      extra_weight_attrs)
        elif self.granularity == "channel":
            _register(layer, geom, "weight_scale", torch.full((n,), _UNLOADED, dtype=torch.float32), _ROWS,
                      extra_weight_attrs)
        else:
            off_tile = {geom.shard_ids[i]: p for i, p in enumerate(geom.partitions) if p % TILE_N != 0}
            if len(geom.partitions) > 1 and off_tile:
                raise ValueError(
                    f"layer {geom.prefix!r}: fused FP8_PB_WO shards are packed one by one into {TILE_N}-row tiles, so "
                    f"every shard's rows on this rank must be a multiple of {TILE_N}, got {off_tile} (partitions "
                    f"{list(geom.partitions)}, tp_size {geom.tp_size}); use a tensor-parallel size that keeps them aligned")
            counts, _ = _block_rows(geom.partitions)
            grid = (sum(counts), k // FP8_BLOCK)
            _register(layer, geom, "weight_scale", torch.full(grid, _UNLOADED, dtype=torch.float32), _BLOCK_GRID,
                      extra_weight_attrs)
        _register(layer, geom, "input_scale", torch.full((s,), _UNLOADED, dtype=torch.float32), _PER_SHARD,
                  extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        geom: ShardGeometry = layer.qpn_geometry
        _require_loaded(layer, geom, ("weight", "weight_scale"))
        s = layer.weight_scale.data
        if self.granularity == "block":
            packed = _pack_fp8_block_shards(layer.weight.data, s, geom)
        else:
            if self.granularity == "tensor":  # each row keeps its own shard's multiplier: exact
                rows = torch.tensor(list(geom.partitions), device=s.device)
                s = torch.repeat_interleave(s, rows)
            packed = pack_fp8(layer.weight.data, s.contiguous(), "channel")
        _finish(layer, self.fmt, packed, ("weight", "weight_scale", "input_scale"))


def _pack_fp8_block_shards(weight: Tensor, grid: Tensor, geom: ShardGeometry) -> PackedWeight:
    """FP8_PB_WO: each shard packed with its own block grid (pack_fp8 validates and pads it to whole
    128-row blocks), the pad cropped, the shards' 32-row tiles concatenated. QPN8's block layout keeps
    one scale per (128 columns, 32-row tile), so a shard of 64 rows with its own block scale is exact."""
    if len(geom.partitions) == 1:
        return pack_fp8(weight, grid.contiguous(), "block")
    counts, starts = _block_rows(geom.partitions)
    codes, scales = [], []
    for rows, offset, count, start in zip(geom.partitions, geom.offsets, counts, starts):
        part = pack_fp8(weight.narrow(0, offset, rows), grid.narrow(0, start, count).contiguous(), "block")
        codes.append(part.codes[:rows])
        scales.append(part.scales[:, : rows // TILE_N])
    return PackedWeight("fp8", torch.cat(codes).contiguous(), torch.cat(scales, dim=1).contiguous(), None,
                        int(weight.shape[1]), geom.n_partition)


class QPNUnquantizedLinearMethod(LinearMethodBase):
    """Excluded layers when vLLM is not installed: params_dtype weight [N_part, K_part] with the same
    sharding loader; y = RN16(x @ W^T) with fp32 accumulation (+ bias as in apply above)."""

    def __init__(self, quant_config: QPNConfig | None = None):
        self.quant_config = quant_config

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        del input_size, output_size
        geom = layer_geometry(layer, input_size_per_partition, output_partition_sizes)
        layer.qpn_geometry = geom
        _register(layer, geom, "weight", torch.empty((geom.n_partition, geom.k_partition), dtype=params_dtype),
                  _ROWS, extra_weight_attrs, cast_ok=True)

    def process_weights_after_loading(self, layer) -> None:
        _require_loaded(layer, layer.qpn_geometry, ("weight",))

    def apply(self, layer, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y = torch.matmul(x.float(), layer.weight.float().t()).to(x.dtype)
        if bias is not None:
            y = (y.float() + bias.float()).to(y.dtype)
        return y


if _VllmKVCacheMethod is not None:
    class QPNKVCacheMethod(_VllmKVCacheMethod):
        """vLLM's BaseKVCacheMethod for attention layers: creates k_scale / v_scale (and q / prob scales) so
        the checkpoint's ModelOpt FP8 KV-cache scales load, and hands them to vLLM's fp8 KV cache after
        loading (module docstring). qpn adds nothing: the name only says which config made it."""
else:
    QPNKVCacheMethod = None  # KV-cache scales need vLLM's attention layers; nothing to do without vLLM


def _unquantized_method(config):
    if _VllmUnquantizedLinearMethod is not None:
        return _VllmUnquantizedLinearMethod()
    return QPNUnquantizedLinearMethod(config)


# ----------------------------------------------------------------------------- config


def _modelopt_section(config: Mapping) -> tuple[Mapping, str]:
    """(section holding quant_algo, form): hf_quant_config.json {"quantization": {...}} or config.json
    quantization_config {"quant_method": "modelopt", "quant_algo": ...}."""
    if not isinstance(config, Mapping):
        raise ValueError(f"the quantization config must be a dict, got {type(config).__name__}")
    if "quantization" in config:
        section = config["quantization"]
        if not isinstance(section, Mapping):
            raise ValueError(f"'quantization' in hf_quant_config.json must be an object, got {section!r}")
        return section, "hf_quant_config.json"
    method = str(config.get("quant_method", "")).lower()
    if method and not method.startswith("modelopt"):
        raise ValueError(f"qpn's vLLM plugin reads ModelOpt checkpoints (quant_method 'modelopt'), got quant_method "
                         f"{config.get('quant_method')!r}; run this checkpoint without quantization='qpn'")
    return config, "quantization_config"


class QPNConfig(QuantizationConfig):
    """ModelOpt NVFP4 / W4A16_NVFP4 / FP8 / FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO / MIXED_PRECISION via qpn.

    quant_algo: the checkpoint's quant_algo (upper case); exclude_modules: ModelOpt's `ignore` /
    `exclude_modules` (exact names or fnmatch wildcards); quantized_layers: MIXED_PRECISION's
    {layer name: per-layer algo}; kv_cache_quant_algo is recorded (vLLM reads it from the
    checkpoint config itself to pick the fp8 KV cache; QPNKVCacheMethod loads the scales).
    """

    def __init__(self, quant_algo: str, exclude_modules=None, quantized_layers: Mapping[str, str] | None = None,
                 group_size: int | None = None, kv_cache_quant_algo: str | None = None):
        super().__init__()
        algo = str(quant_algo).upper()
        if algo not in QUANT_ALGOS:
            raise ValueError(f"quant_algo {quant_algo!r} is not supported by qpn; supported: {QUANT_ALGOS} "
                             "(MXFP8, NVFP4_AWQ, W4A8_AWQ and other algorithms need vLLM's own methods)")
        self.quant_algo = algo
        self.exclude_modules = list(exclude_modules or [])
        if not all(isinstance(e, str) for e in self.exclude_modules):
            raise ValueError(f"exclude_modules must be a list of strings, got {exclude_modules!r}")
        self.group_size = NVFP4_GROUP_SIZE if group_size is None else int(group_size)
        if self.group_size != NVFP4_GROUP_SIZE and any(
                LAYER_ALGOS.get(a) == "nvfp4" for a in [algo, *(quantized_layers or {}).values()]):
            raise ValueError(f"group_size must be {NVFP4_GROUP_SIZE} for NVFP4, got {group_size!r}")
        self.kv_cache_quant_algo = kv_cache_quant_algo
        self.quantized_layers: dict[str, str] = {}
        if algo == "MIXED_PRECISION":
            if not quantized_layers:
                raise ValueError("MIXED_PRECISION needs a non-empty quantized_layers mapping {layer: {quant_algo}}")
            bad = {}
            for name, layer_algo in quantized_layers.items():
                layer_algo = str(layer_algo).upper()
                if layer_algo not in LAYER_ALGOS:
                    bad[name] = layer_algo
                self.quantized_layers[name] = layer_algo
            if bad:
                raise ValueError(f"quantized_layers has algorithms qpn does not run: {bad}; supported per layer: "
                                 f"{tuple(LAYER_ALGOS)}")

    def __repr__(self) -> str:
        return (f"QPNConfig(quant_algo={self.quant_algo!r}, exclude_modules={self.exclude_modules!r}, "
                f"quantized_layers={len(self.quantized_layers)} entries)")

    # --- vLLM's QuantizationConfig interface

    @classmethod
    def get_name(cls) -> str:
        return QUANT_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16]  # fp16-in / fp32-accumulate kernels; Turing has no bf16 MMA

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        return list(CONFIG_FILENAMES)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> QPNConfig:
        """hf_quant_config.json ({"quantization": {quant_algo, group_size, exclude_modules,
        kv_cache_quant_algo, quantized_layers}}) or config.json's quantization_config
        ({quant_method: "modelopt", quant_algo, group_size, ignore, quantized_layers, kv_cache_scheme})."""
        section, form = _modelopt_section(config)
        algo = section.get("quant_algo")
        if not isinstance(algo, str) or not algo:
            raise ValueError(f"{form}: quant_algo is missing or not a string: {algo!r}")
        key = "exclude_modules" if "exclude_modules" in section else "ignore"
        exclude = section.get(key) or []
        if not isinstance(exclude, list):
            raise ValueError(f"{form}: {key} must be a list of layer names / wildcards, got {exclude!r}")
        layers = section.get("quantized_layers") or {}
        if not isinstance(layers, Mapping):
            raise ValueError(f"{form}: quantized_layers must map layer names to {{quant_algo, ...}}, got {layers!r}")
        per_layer = {}
        for name, entry in layers.items():
            layer_algo = entry.get("quant_algo") if isinstance(entry, Mapping) else entry
            if not isinstance(layer_algo, str):
                raise ValueError(f"{form}: quantized_layers[{name!r}] needs a quant_algo string, got {entry!r}")
            per_layer[name] = layer_algo
            if isinstance(entry, Mapping) and LAYER_ALGOS.get(layer_algo.upper()) == "nvfp4" and \
                    entry.get("group_size", NVFP4_GROUP_SIZE) != NVFP4_GROUP_SIZE:
                raise ValueError(f"{form}: quantized_layers[{name!r}] has group_size {entry.get('group_size')!r}; "
                                 f"NVFP4 needs {NVFP4_GROUP_SIZE}")
        kv = section.get("kv_cache_quant_algo")
        return cls(algo, exclude, per_layer, section.get("group_size"), kv)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        """Claim a ModelOpt checkpoint only when the user asked for quantization="qpn".

        Asked for "qpn" on a checkpoint qpn cannot run, raise a ValueError that says why (vLLM would
        otherwise only say that "modelopt" does not match "qpn"); not asked, never claim or raise.
        """
        if user_quant != QUANT_NAME or not isinstance(hf_quant_cfg, Mapping):
            return None
        method = str(hf_quant_cfg.get("quant_method", "modelopt"))
        if not method.lower().startswith("modelopt"):
            raise ValueError(f"quantization='qpn' runs ModelOpt checkpoints (quant_method 'modelopt'); this one has "
                             f"quant_method {method!r}. Serve it without quantization='qpn' (vLLM's own method), or "
                             "load it in PyTorch with qpn.torch_bridge.load_quantized (compressed-tensors NVFP4)")
        section = hf_quant_cfg.get("quantization", hf_quant_cfg)
        algo = str(section.get("quant_algo", "")).upper() if isinstance(section, Mapping) else ""
        if algo not in QUANT_ALGOS:
            raise ValueError(f"quantization='qpn' does not run ModelOpt quant_algo {algo or None!r}; it runs "
                             f"{QUANT_ALGOS}. Serve this checkpoint without quantization='qpn' (vLLM's own ModelOpt "
                             "path)")
        return QUANT_NAME

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """Rename checkpoint layer names to the vLLM model's (models with an hf_to_vllm_mapper)."""
        if self.exclude_modules and hasattr(hf_to_vllm_mapper, "apply_list"):
            self.exclude_modules = list(hf_to_vllm_mapper.apply_list(self.exclude_modules))
        if self.quantized_layers and hasattr(hf_to_vllm_mapper, "apply_dict"):
            self.quantized_layers = dict(hf_to_vllm_mapper.apply_dict(self.quantized_layers))

    def get_quant_method(self, layer, prefix: str):
        names = _class_names(layer)
        if is_linear_layer(layer):
            algo = self.layer_algo(prefix)
            if algo is None:
                return _unquantized_method(self)
            kind = LAYER_ALGOS[algo]
            if kind == "nvfp4":
                return QPNNVFP4LinearMethod(self)
            return QPNFP8LinearMethod(self, kind.removeprefix("fp8_"))
        if names & {"FusedMoE", "RoutedExperts"}:
            if self.layer_algo(prefix, fused=False) is not None or self._has_quantized_descendant(prefix):
                raise ValueError(f"layer {prefix!r} is a quantized MoE layer; qpn's vLLM plugin runs dense linear "
                                 "layers only - serve this checkpoint with vLLM's ModelOpt path")
            return None
        if names & EMBEDDING_CLASSES:
            # ModelOpt quantizes nn.Linear modules only: an input embedding is quantized only if a
            # MIXED_PRECISION config lists it; lm_head is a Linear in HF, quantized unless excluded.
            lm_head = "ParallelLMHead" in names
            quantized = self.layer_algo(prefix, fused=False) is not None if lm_head else \
                self.quant_algo == "MIXED_PRECISION" and self._listed_algo(prefix) is not None
            if quantized:
                raise ValueError(f"layer {prefix!r} ({type(layer).__name__}) is quantized in this checkpoint; qpn "
                                 "runs linear layers only - add it to exclude_modules or use vLLM's ModelOpt path")
            return None
        if names & ATTENTION_CLASSES and QPNKVCacheMethod is not None:
            return QPNKVCacheMethod(self)
        return None

    # --- which layers are quantized, and how

    def _shard_names(self, prefix: str) -> list[str]:
        parent, _, leaf = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(leaf) or DEFAULT_PACKED_MODULES.get(leaf)
        if not shards:
            return []
        return [f"{parent}.{s}" if parent else s for s in shards]

    def _excluded(self, name: str) -> bool:
        return any(name == e or fnmatch.fnmatchcase(name, e) for e in self.exclude_modules)

    def _listed_algo(self, name: str) -> str | None:
        """MIXED_PRECISION: the entry for `name` or its nearest listed ancestor."""
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            algo = self.quantized_layers.get(".".join(parts[:i]))
            if algo is not None:
                return algo
        return None

    def _algo_of(self, name: str) -> str | None:
        if self._excluded(name):
            return None
        if self.quant_algo != "MIXED_PRECISION":
            return self.quant_algo
        return self._listed_algo(name)

    def _has_quantized_descendant(self, prefix: str) -> bool:
        return any(name.startswith(prefix + ".") and self._algo_of(name) is not None for name in self.quantized_layers)

    def layer_algo(self, prefix: str, fused: bool = True) -> str | None:
        """The ModelOpt algorithm of the vLLM layer `prefix` (None: unquantized).

        A fused layer (qkv_proj, gate_up_proj, or anything in packed_modules_mapping) is decided by
        its own name when the config names it, else by its shards (q_proj, k_proj, v_proj / gate_proj,
        up_proj), which must agree.
        """
        if self._excluded(prefix):
            return None
        if self.quant_algo == "MIXED_PRECISION" and prefix in self.quantized_layers:
            return self.quantized_layers[prefix]
        shards = self._shard_names(prefix) if fused else []
        if not shards:
            return self._algo_of(prefix)
        algos = {s: self._algo_of(s) for s in shards}
        if len(set(algos.values())) != 1:
            raise ValueError(f"fused layer {prefix!r}: its shards are quantized differently {algos} "
                             "(None = unquantized); vLLM runs a fused layer with one method, so its shards must agree")
        return algos[shards[0]]


# ----------------------------------------------------------------------------- plugin entry point

_REGISTERED = False


def register() -> None:
    """vLLM `vllm.general_plugins` entry point: register QPNConfig as quantization "qpn" (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    if not VLLM_AVAILABLE:
        raise RuntimeError("qpn.torch_bridge.vllm_method.register() needs vLLM, which is not importable here")
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    if QUANT_NAME not in QUANTIZATION_METHODS:
        register_quantization_config(QUANT_NAME)(QPNConfig)
    _REGISTERED = True
