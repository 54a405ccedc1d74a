"""The qpn linear methods: thin per-format create_weights / process_weights_after_loading over the
shared helpers (_begin_create, _finish, _apply), and the KV-cache method.

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

Values are judged as each checkpoint tensor is loaded (sharding.py, "Errors": the error names the
checkpoint tensor and the vLLM layer, indices are the file's): NVFP4 weight_scale bytes neither NaN
nor negative, weight_scale_2 and FP8 weight_scale finite and > 0, FP8 scales inside fp16 (S16 =
RN16(256 * s)), FP8 weight codes not NaN. input_scale is loaded unjudged: weight-only qpn never
reads it.

process_weights_after_loading (every slot must have been loaded; ValueError otherwise):
- NVFP4: each shard's blocks must fit fp16 with that shard's weight_scale_2 (the rule of
  qpn.ref.require_nvfp4_fits_fp16, judged per shard so that the error names the shard's checkpoint
  tensors and indexes them as the file does), then prepack through torch.ops.qpn.nvfp4_prepack
  (qpn.torch_bridge.pack_nvfp4 validates the values again). Global scale: if every shard's
  weight_scale_2 is the same fp32 value, that scalar (N_part is then padded to 32 inside and the
  padding cropped in apply); otherwise one value per 32-row tile, each shard's tiles carrying its
  own scale, when every shard's N_part is a multiple of 32. Different scales with a shard off the tile
  (a GDN in_proj_ba / in_proj_b, in_proj_a of few value heads): each shard is packed alone in its own
  tiles (padded with +0 rows), and apply runs the padded layer and keeps the real rows (qpn_row_index;
  a bias is placed on them first, so y + b is rounded once as elsewhere): exact, for at most 31 pad
  rows per shard. Different shard scales are NEVER collapsed with max() (that makes the smaller shards
  1.5-3x too large). Why two scales cannot share a tile exactly instead: docs/DESIGN.md, "NVFP4 weight".
- FP8: per-shard scalars become a per-channel scale vector (each row keeps its shard's scale:
  exact), then torch.ops.qpn.fp8_prepack (per-channel QPN8: S16 = RN16(256 * s)); block scales
  prepack as they are (QPN8 block layout).
- Any other ValueError of the packing names the vLLM layer.
- The original parameters are deleted; the layer keeps its layout's buffers as frozen Parameters
  qpn_<buffer name> (qpn_codes, qpn_scales, qpn_global_scale for NVFP4; qpn_codes, qpn_group_scales
  for FP8) and the packed weight over them, layer.qpn_weight (torch_bridge/packed_weight.py).

apply(layer, x, bias): module.qpn_linear(x, layer.qpn_weight, bias), the forward QPNLinear runs:
x [..., K_part] float16 -> flattened to [M, K_part] -> the layout's op (fp32 accumulation, one RN16;
the decode / GEMM / dense path is chosen inside the op) -> padding cropped -> bias added as RN16(y + b)
(computed in fp32 and rounded once: exact sum of two fp16 values rounded to fp16, because fp32 holds
24 >= 2 * 11 + 2 bits, so the double rounding is innocuous) -> [..., N_part]. A bfloat16 model
(dtype="bfloat16", QPNConfig.get_supported_act_dtypes) hands apply bf16 x: the result is bf16 too, with
the rounding module.qpn_linear's docstring states for bf16 x (the same W16 bytes either way).

KV cache: attention layers get `QPNKVCacheMethod`, vLLM's own BaseKVCacheMethod, as vLLM's ModelOpt
method does: the checkpoint's k_scale / v_scale (ModelOpt `kv_cache_quant_algo: FP8`, stored as
self_attn.k_proj.k_scale / v_proj.v_scale and renamed by vLLM) reach the fp8 KV cache that vLLM picks
from the same config. Activations stay in the model's dtype (fp16 or bf16): only the cache is fp8.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor
from torch.nn import Parameter

from ...ref.codecs import decode_e4m3
from ...ref.formats import FP8_BLOCK, FP8_GRANULARITIES, QPN2, QPN8, QPN8_BLOCK, WeightFormat, weight_format
from ...ref.geometry import GROUP_K, TILE_N
from ...ref.nvfp4 import nvfp4_block_overflows
from ..module import qpn_linear
from ..packed_weight import PackedWeight, pack_fp8, pack_nvfp4  # registers torch.ops.qpn.*
from ._compat import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethod,
    _VllmKVCacheMethod,
    _VllmUnquantizedLinearMethod,
)
from .sharding import (
    _BLOCK_GRID,
    _PER_SHARD,
    _ROWS,
    QPNLayer,
    ShardGeometry,
    _block_rows,
    _register,
    _require_loaded,
    e4m3_code_rule,
    fp8_scale_rule,
    layer_geometry,
    loaded_source,
    nvfp4_block_scale_rule,
    positive_scale_rule,
)

_Packed = TypeVar("_Packed")  # what a packing step returns (a PackedWeight, or one with its row index)
NVFP4_GROUP_SIZE = GROUP_K  # 16: ModelOpt's NVFP4 group_size, the one qpn runs
_UNLOADED = float("nan")  # initial value of per-shard slots (the loaded-slot bookkeeping is what counts)


def _packed_modules(quant_config: QuantizationConfig | None) -> dict[str, list[str]] | None:
    """The model's packed_modules_mapping, which vLLM sets on the quant config (sharding: checkpoint names)."""
    return getattr(quant_config, "packed_modules_mapping", None)


def _begin_create(layer: QPNLayer, input_size_per_partition: int, output_partition_sizes: Sequence[int],
                  wf: WeightFormat, quant_config: QuantizationConfig | None) -> ShardGeometry:
    geom = layer_geometry(layer, input_size_per_partition, output_partition_sizes, _packed_modules(quant_config))
    k = geom.k_partition
    if k <= 0 or k % wf.k_multiple != 0:
        input_size = getattr(layer, "input_size", "?")
        raise ValueError(
            f"layer {geom.prefix!r}: {wf.format.upper()} ({wf.layout} layout) needs the input features per "
            f"partition to be a multiple of {wf.k_multiple}, "
            f"got K_part={k} (input_size={input_size}, tp_size={geom.tp_size}, {geom.kind}-parallel); pick a "
            "tensor-parallel size that keeps K_part a multiple of it, or exclude this layer from quantization")
    layer.qpn_geometry = geom
    # the attributes vLLM's own ModelOpt methods set, for code that reads them
    layer.logical_widths = list(geom.partitions)
    layer.input_size_per_partition = k
    layer.output_size_per_partition = geom.n_partition
    return geom


def _packed_named(geom: ShardGeometry, pack: Callable[[], _Packed]) -> _Packed:
    """pack(), its ValueError prefixed with the vLLM layer (the values were judged at load time already;
    this catches what is left, such as a layout rule)."""
    try:
        return pack()
    except ValueError as exc:
        raise ValueError(f"vLLM layer {geom.prefix!r}: {exc}") from exc


def replace_parameters(layer: object, deleted: Sequence[str], buffers: dict[str, Tensor],
                       prefix: str = "") -> dict[str, Parameter]:
    """Delete the checkpoint Parameters `deleted` (those the layer has) and register `buffers` as frozen
    Parameters qpn_<prefix><name> (vLLM moves and shards Parameters, not plain tensors); returns them."""
    for name in deleted:
        if hasattr(layer, name):
            delattr(layer, name)
    params = {name: Parameter(t, requires_grad=False) for name, t in buffers.items()}
    for name, param in params.items():
        setattr(layer, f"qpn_{prefix}{name}", param)
    return params


def _finish(layer: QPNLayer, packed: PackedWeight, deleted: tuple[str, ...]) -> None:
    """Replace the checkpoint Parameters by the packed buffers (qpn_<buffer name>) and the packed weight
    over them, `layer.qpn_weight`, which apply runs."""
    params = replace_parameters(layer, deleted, packed.buffers)
    layer.qpn_weight = type(packed)(params, packed.in_features, packed.out_features)


def _apply(layer: QPNLayer, x: Tensor, bias: Tensor | None, gated: bool = False) -> Tensor:
    """module.qpn_linear on the layer's packed weight; an error names the vLLM layer. A layer packed shard by
    shard in whole tiles (qpn_row_index, _pack_nvfp4_shards_in_own_tiles) runs on the padded rows, its bias
    placed on them (zeros on the pad rows: the same one rounding of y + b), and keeps its real rows."""
    rows = getattr(layer, "qpn_row_index", None)
    try:
        if rows is None:
            return qpn_linear(x, layer.qpn_weight, bias, gated)
        if bias is not None:
            bias = bias.new_zeros(layer.qpn_weight.out_features).index_copy(0, rows, bias)
        return qpn_linear(x, layer.qpn_weight, bias, gated).index_select(-1, rows)
    except ValueError as exc:
        raise ValueError(f"layer {layer.qpn_geometry.prefix!r}: {exc}") from exc


class _QPNLinearMethodBase(LinearMethodBase):
    """Shared apply / apply_gated / dequantized_weight of the two qpn methods."""

    weight_format: WeightFormat

    def __init__(self, quant_config: QuantizationConfig | None = None):
        self.quant_config = quant_config

    def apply(self, layer: QPNLayer, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return _apply(layer, x, bias)

    def apply_gated(self, layer: QPNLayer, x: Tensor) -> Tensor:
        """Fused gate_up (MergedColumnParallelLinear with two equal shards) + SiLU-and-mul inside the op:
        equals vLLM's silu_and_mul applied to apply(layer, x). x [..., K_part] -> [..., N_part/2]."""
        geom = layer.qpn_geometry
        parts = geom.partitions
        if len(parts) != 2 or parts[0] != parts[1] or parts[0] % TILE_N != 0 or \
                layer.qpn_weight.padded_out_features != sum(parts):
            raise ValueError(f"layer {geom.prefix!r}: apply_gated needs a gate_up layer of two equal shards, each a "
                             f"multiple of {TILE_N} rows on this rank, got partitions {list(parts)}; use apply() "
                             "and a separate silu_and_mul")
        if getattr(layer, "bias", None) is not None:
            raise ValueError(f"layer {geom.prefix!r}: apply_gated does not add a bias (the epilogue follows the "
                             "linear directly); use apply() and a separate silu_and_mul")
        return _apply(layer, x, None, gated=True)

    def dequantized_weight(self, layer: QPNLayer) -> Tensor:
        """float16 [N_part, K_part]: the W16 this rank computes with (padding cropped)."""
        rows = getattr(layer, "qpn_row_index", None)
        w16 = layer.qpn_weight.dequantize()
        return w16 if rows is None else w16.index_select(0, rows)


class QPNNVFP4LinearMethod(_QPNLinearMethodBase):
    """ModelOpt NVFP4 / W4A16_NVFP4 weights, run weight-only through the QPN2 ops (module docstring)."""

    weight_format = QPN2

    def create_weights(self, layer: QPNLayer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        del input_size, output_size, params_dtype
        geom = _begin_create(layer, input_size_per_partition, output_partition_sizes, self.weight_format,
                             self.quant_config)
        n, k, s = geom.n_partition, geom.k_partition, len(geom.partitions)
        _register(layer, geom, "weight", torch.empty((n, k // 2), dtype=torch.uint8), _ROWS, extra_weight_attrs)
        _register(layer, geom, "weight_scale", torch.empty((n, k // NVFP4_GROUP_SIZE), dtype=torch.float8_e4m3fn),
                  _ROWS, extra_weight_attrs, rule=nvfp4_block_scale_rule)
        _register(layer, geom, "weight_scale_2", torch.full((s,), _UNLOADED, dtype=torch.float32), _PER_SHARD,
                  extra_weight_attrs, rule=positive_scale_rule)
        _register(layer, geom, "input_scale", torch.full((s,), _UNLOADED, dtype=torch.float32), _PER_SHARD,
                  extra_weight_attrs)

    def process_weights_after_loading(self, layer: QPNLayer) -> None:
        geom: ShardGeometry = layer.qpn_geometry
        _require_loaded(layer, geom, ("weight", "weight_scale", "weight_scale_2"))
        _require_shards_fit_fp16(layer, geom)
        g = layer.weight_scale_2.data
        if _needs_own_tiles(geom, g):
            packed, rows = _packed_named(geom, lambda: _pack_nvfp4_shards_in_own_tiles(layer, geom))
            _finish(layer, packed, ("weight", "weight_scale", "weight_scale_2", "input_scale"))
            replace_parameters(layer, (), {"row_index": rows})
            return
        global_scale = _nvfp4_global_scale(geom, g)
        packed = _packed_named(geom, lambda: pack_nvfp4(layer.weight.data, layer.weight_scale.data, global_scale))
        _finish(layer, packed, ("weight", "weight_scale", "weight_scale_2", "input_scale"))


class QPNFP8LinearMethod(_QPNLinearMethodBase):
    """ModelOpt FP8 (per-tensor, per shard), FP8_PER_CHANNEL_PER_TOKEN or FP8_PB_WO (128x128 blocks)
    weights, run weight-only through the QPN8 ops (module docstring)."""


    def __init__(self, quant_config: QuantizationConfig | None = None, granularity: str = "tensor"):
        super().__init__(quant_config)
        if granularity not in FP8_GRANULARITIES:
            raise ValueError(f"granularity must be 'tensor', 'channel' or 'block' (ModelOpt FP8 / "
                             f"FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO), got {granularity!r}")
        self.granularity = granularity
        self.weight_format = weight_format(QPN8.format, granularity)

    def create_weights(self, layer: QPNLayer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        del input_size, output_size, params_dtype
        geom = _begin_create(layer, input_size_per_partition, output_partition_sizes, self.weight_format,
                             self.quant_config)
        n, k, s = geom.n_partition, geom.k_partition, len(geom.partitions)
        _register(layer, geom, "weight", torch.empty((n, k), dtype=torch.float8_e4m3fn), _ROWS, extra_weight_attrs,
                  rule=e4m3_code_rule)
        if self.granularity == "tensor":
            _register(layer, geom, "weight_scale", torch.full((s,), _UNLOADED, dtype=torch.float32), _PER_SHARD,
                      extra_weight_attrs, rule=fp8_scale_rule)
        elif self.granularity == "channel":
            _register(layer, geom, "weight_scale", torch.full((n,), _UNLOADED, dtype=torch.float32), _ROWS,
                      extra_weight_attrs, rule=fp8_scale_rule)
        else:
            _register(layer, geom, "weight_scale", torch.full(_block_scale_grid(geom), _UNLOADED, dtype=torch.float32),
                      _BLOCK_GRID, extra_weight_attrs, rule=fp8_scale_rule)
        _register(layer, geom, "input_scale", torch.full((s,), _UNLOADED, dtype=torch.float32), _PER_SHARD,
                  extra_weight_attrs)

    def process_weights_after_loading(self, layer: QPNLayer) -> None:
        geom: ShardGeometry = layer.qpn_geometry
        _require_loaded(layer, geom, ("weight", "weight_scale"))
        s = layer.weight_scale.data
        if self.weight_format is QPN8_BLOCK:
            packed = _packed_named(geom, lambda: _pack_fp8_block_shards(layer.weight.data, s, geom))
        else:
            if self.granularity == "tensor":  # each row keeps its own shard's multiplier: exact
                rows = torch.tensor(list(geom.partitions), device=s.device)
                s = torch.repeat_interleave(s, rows)
            packed = _packed_named(geom, lambda: pack_fp8(layer.weight.data, s.contiguous(), "channel"))
        _finish(layer, packed, ("weight", "weight_scale", "input_scale"))


def _require_shards_fit_fp16(layer: QPNLayer, geom: ShardGeometry) -> None:
    """Each shard's NVFP4 blocks, with that shard's weight_scale_2, must fit fp16 (the rule of
    qpn.ref.require_nvfp4_fits_fp16); the error names the shard's checkpoint tensors and the first
    overflowing block as the file indexes it (loaded_source: this rank's and the fused-on-disk offsets)."""
    scales = layer.weight_scale.data.view(torch.uint8).cpu().numpy()
    g = layer.weight_scale_2.data.cpu().numpy()
    for i, (offset, rows) in enumerate(zip(geom.offsets, geom.partitions, strict=True)):
        part = scales[offset:offset + rows]
        over = nvfp4_block_overflows(part, np.full(rows, g[i], dtype=np.float32))
        if not over.any():
            continue
        row, block = (int(j) for j in np.argwhere(over)[0])
        source, g_source = loaded_source(layer.weight_scale, i), loaded_source(layer.weight_scale_2, i)
        byte = int(part[row, block])
        s = float(decode_e4m3(np.uint8(byte)))
        shard = geom.shard_ids[i] if geom.shard_ids != (None,) else None
        raise ValueError(
            f"{geom.where(source.tensor, shard)}: weight_scale[{source.row + row}, {source.col + block}] = "
            f"0x{byte:02X} (e4m3 {s:g}) with weight_scale_2 = {float(g[i]):g} ({g_source.tensor!r}) lets the block "
            f"reach 6 * {s:g} * {float(g[i]):g} = {6 * s * float(g[i]):.6g}, beyond fp16's 65504 ({int(over.sum())} "
            "blocks overflow on this rank); the fp16 contract cannot represent this layer: re-quantize it at a "
            "smaller scale, or keep it unquantized (exclude_modules)")


def _needs_own_tiles(geom: ShardGeometry, g: Tensor) -> bool:
    """Shards with different weight_scale_2 of which one is off the 32-row tile (module docstring)."""
    return not bool(torch.all(g == g[0])) and any(p % TILE_N for p in geom.partitions)


def _nvfp4_global_scale(geom: ShardGeometry, g: Tensor) -> Tensor:
    """The shards' weight_scale_2 [S] -> one scalar, or one value per 32-row tile (module docstring); shards off
    the tile with different scales are _pack_nvfp4_shards_in_own_tiles' (ValueError here)."""
    if bool(torch.all(g == g[0])):
        return g[:1].clone()  # one value for the whole layer
    if _needs_own_tiles(geom, g):
        raise ValueError(f"layer {geom.prefix!r}: shards {list(geom.partitions)} with different weight_scale_2 are "
                         "packed shard by shard (_pack_nvfp4_shards_in_own_tiles), not with one scale per tile")
    tiles = torch.tensor([p // TILE_N for p in geom.partitions], device=g.device)
    return torch.repeat_interleave(g, tiles)  # tile t: the scale of the shard holding its rows


def _pack_nvfp4_shards_in_own_tiles(layer: QPNLayer, geom: ShardGeometry) -> tuple[PackedWeight, Tensor]:
    """Shards with different weight_scale_2, one of them off the 32-row tile (a GDN in_proj_ba / in_proj_b,
    in_proj_a of few value heads): each shard packed alone with its own scalar global scale, padded to whole
    tiles (+0 codes), the padded parts stacked; returns (the packed weight of sum(padded) rows, the int64
    index of the real rows in it, which apply keeps). Exact: every real row has its shard's W16 (module
    docstring: why no re-expression inside a shared tile is)."""
    w, s, g = layer.weight.data, layer.weight_scale.data, layer.weight_scale_2.data
    parts, rows, start = [], [], 0
    for i, (offset, n) in enumerate(zip(geom.offsets, geom.partitions, strict=True)):
        part = pack_nvfp4(w.narrow(0, offset, n), s.narrow(0, offset, n), g[i:i + 1].clone())
        parts.append(type(part).over(part.buffers, part.in_features, part.padded_out_features))
        rows.append(torch.arange(start, start + n, device=w.device))
        start += part.padded_out_features
    return PackedWeight.stack_rows(parts), torch.cat(rows)


def _block_scale_grid(geom: ShardGeometry) -> tuple[int, int]:
    """FP8_PB_WO weight_scale shape: the shards' block rows stacked x K_part/128 (module docstring)."""
    off_tile = {geom.shard_ids[i]: p for i, p in enumerate(geom.partitions) if p % TILE_N != 0}
    if len(geom.partitions) > 1 and off_tile:
        raise ValueError(
            f"layer {geom.prefix!r}: fused FP8_PB_WO shards are packed one by one into {TILE_N}-row tiles, so "
            f"every shard's rows on this rank must be a multiple of {TILE_N}, got {off_tile} (partitions "
            f"{list(geom.partitions)}, tp_size {geom.tp_size}); use a tensor-parallel size that keeps them aligned")
    counts, _ = _block_rows(geom.partitions)
    return sum(counts), geom.k_partition // FP8_BLOCK


def _pack_fp8_block_shards(weight: Tensor, grid: Tensor, geom: ShardGeometry) -> PackedWeight:
    """FP8_PB_WO: each shard packed with its own block grid (pack_fp8 validates and pads it to whole
    128-row blocks), the pad cropped, the shards' 32-row tiles concatenated. QPN8's block layout keeps
    one scale per (128 columns, 32-row tile), so a shard of 64 rows with its own block scale is exact."""
    if len(geom.partitions) == 1:
        return pack_fp8(weight, grid.contiguous(), "block")
    counts, starts = _block_rows(geom.partitions)
    return PackedWeight.stack_rows([
        pack_fp8(weight.narrow(0, offset, rows), grid.narrow(0, start, count).contiguous(), "block")
        for rows, offset, count, start in zip(geom.partitions, geom.offsets, counts, starts, strict=True)])


class QPNUnquantizedLinearMethod(LinearMethodBase):
    """Excluded layers when vLLM is not installed: params_dtype weight [N_part, K_part] with the same
    sharding loader; y = RN16(x @ W^T) with fp32 accumulation (+ bias as in apply above)."""

    def __init__(self, quant_config: QuantizationConfig | None = None):
        self.quant_config = quant_config

    def create_weights(self, layer: QPNLayer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        del input_size, output_size
        geom = layer_geometry(layer, input_size_per_partition, output_partition_sizes,
                              _packed_modules(self.quant_config))
        layer.qpn_geometry = geom
        _register(layer, geom, "weight", torch.empty((geom.n_partition, geom.k_partition), dtype=params_dtype),
                  _ROWS, extra_weight_attrs, cast_ok=True)

    def process_weights_after_loading(self, layer: QPNLayer) -> None:
        _require_loaded(layer, layer.qpn_geometry, ("weight",))

    def apply(self, layer: QPNLayer, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y = torch.matmul(x.float(), layer.weight.float().t()).to(x.dtype)
        if bias is not None:
            y = (y.float() + bias.float()).to(y.dtype)
        return y


def _kv_cache_method_class(base: type[Any]) -> type[Any]:
    """QPNKVCacheMethod: `base` (vLLM's BaseKVCacheMethod) under qpn's name. Built by types.new_class,
    which a class statement equals (same name, module, metaclass), so that the one public name can
    be this class or None: mypy refuses a class statement's name set to None in the other branch."""
    doc = """vLLM's BaseKVCacheMethod for attention layers: creates k_scale / v_scale (and q / prob scales) so
        the checkpoint's ModelOpt FP8 KV-cache scales load, and hands them to vLLM's fp8 KV cache after
        loading (module docstring). qpn adds nothing: the name only says which config made it."""
    return types.new_class("QPNKVCacheMethod", (base,),
                           exec_body=lambda ns: ns.update(__doc__=doc, __module__=__name__))


# None without vLLM: KV-cache scales need vLLM's attention layers, so there is nothing to do
QPNKVCacheMethod: type[Any] | None = None
if _VllmKVCacheMethod is not None:
    QPNKVCacheMethod = _kv_cache_method_class(_VllmKVCacheMethod)


def _unquantized_method(config: QuantizationConfig) -> QuantizeMethod:
    if _VllmUnquantizedLinearMethod is not None:
        return _VllmUnquantizedLinearMethod()
    return QPNUnquantizedLinearMethod(config)
