"""Fused layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj): shards stacked along N, no value changed.

Shards of one fused layer may carry different scales (ModelOpt writes one weight_scale_2 per
shard); collapsing them with max(), as vLLM does, makes the smaller shards 1.5-3x too large.
Here each shard keeps its own: one NVFP4 global scale per 32-row tile, one FP8 scale per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..ref.formats import FP8_BLOCK
from ..ref.geometry import TILE_N
from .checkpoint import FP8Linear, NVFP4Linear


class FusedNVFP4(NamedTuple):
    weight_packed: np.ndarray  # uint8 [sum N, K/2]
    weight_scale: np.ndarray  # uint8 [sum N, K/16]
    global_scale: np.ndarray  # float32 [sum N / 32], one multiplier per 32-row tile


class FusedFP8(NamedTuple):
    weight: np.ndarray  # uint8 [sum N, K]
    weight_scale: np.ndarray  # float32 [sum N] ("channel") or block grid ("block")
    granularity: str  # "channel" or "block"


def _same_k(linears: Sequence[NVFP4Linear | FP8Linear], cls: type, name: str) -> int:
    if isinstance(linears, (str, bytes)) or not isinstance(linears, Sequence) or len(linears) == 0:
        raise ValueError(f"linears for fused layer {name!r} must be a non-empty list of {cls.__name__}")
    for shard in linears:
        if not isinstance(shard, cls):
            raise ValueError(f"fused layer {name!r}: every shard must be a {cls.__name__}, got "
                             f"{type(shard).__name__} ({getattr(shard, 'name', '?')!r}); shards of one fused "
                             "layer must share one quantization format")
    ks = {shard.k for shard in linears}
    if len(ks) != 1:
        raise ValueError(f"fused layer {name!r}: shards must share K (input features), got "
                         f"{ {shard.name: shard.k for shard in linears} }")
    return ks.pop()


def fuse_nvfp4_shards(linears: Sequence[NVFP4Linear], name: str) -> FusedNVFP4:
    """Stack NVFP4 shards (q/k/v, gate/up) along N, keeping each shard's global scale per 32-row tile.

    Returns FusedNVFP4(weight_packed uint8 [N, K/2], weight_scale uint8 [N, K/16],
    global_scale float32 [N/32]), N = sum of shard N; tile t takes the global scale of the
    shard holding rows [32t, 32t+32). Each shard's N must be a multiple of 32, so no tile
    straddles two global scales. No value changes (block scales are not requantized).
    """
    _same_k(linears, NVFP4Linear, name)
    for shard in linears:
        if shard.n % TILE_N != 0:
            raise ValueError(
                f"fused layer {name!r}: shard {shard.name!r} has N={shard.n}, not a multiple of {TILE_N}; "
                f"per-tile global scales need every shard boundary on a {TILE_N}-row tile - keep this shard "
                "as its own linear or pad its rows to a multiple of 32"
            )
    return FusedNVFP4(
        np.concatenate([s.weight_packed for s in linears], axis=0),
        np.concatenate([s.weight_scale for s in linears], axis=0),
        np.concatenate([np.full(s.n // TILE_N, s.global_scale, dtype=np.float32) for s in linears]),
    )


def fuse_fp8_shards(linears: Sequence[FP8Linear], name: str) -> FusedFP8:
    """Stack FP8 shards along N. Per-tensor and per-channel shards give a per-channel [N] scale.

    A per-tensor shard's scalar is repeated over its rows, which is exact (each row keeps its
    multiplier). Block shards give the stacked block grid; every shard but the last must then
    have N a multiple of 128. Mixing block with non-block shards is an error.
    """
    _same_k(linears, FP8Linear, name)
    blocks = {s.granularity == "block" for s in linears}
    if len(blocks) != 1:
        raise ValueError(f"fused layer {name!r}: cannot fuse block-scaled with per-tensor/per-channel shards "
                         f"({ {s.name: s.granularity for s in linears} }); requantize them to one granularity")
    weight = np.concatenate([s.weight for s in linears], axis=0)
    if blocks.pop():
        for shard in linears[:-1]:
            if shard.n % FP8_BLOCK != 0:
                raise ValueError(f"fused layer {name!r}: block-scaled shard {shard.name!r} has N={shard.n}, not a "
                                 f"multiple of {FP8_BLOCK}, so its last block row would straddle the next shard")
        return FusedFP8(weight, np.concatenate([s.weight_scale for s in linears], axis=0), "block")
    scale = np.concatenate([np.broadcast_to(s.weight_scale, (s.n,)) for s in linears]).astype(np.float32)
    return FusedFP8(weight, scale, "channel")


__all__ = ["FusedFP8", "FusedNVFP4", "fuse_fp8_shards", "fuse_nvfp4_shards"]
