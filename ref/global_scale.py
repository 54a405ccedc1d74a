"""The NVFP4 global scale g(n): a scalar, or one fp32 value per 32-column output tile.

Per-tile scales exist for fused shards (q/k/v, gate/up) whose `weight_scale_2` differ:
collapsing them with max() (vLLM's choice) mis-scales the smaller shards 1.5-3x unless the
block scales are requantized, so qpn keeps one value per tile instead (docs/DESIGN.md, "NVFP4 weight").
A shard boundary must therefore fall on a multiple of 32 rows.
"""

from __future__ import annotations

import numpy as np

from .geometry import TILE_N


def global_scale_per_row(global_scale: float | np.ndarray, n: int, name: str = "global_scale") -> np.ndarray:
    """Expand a scalar or per-tile global scale to float32 [n], one value per output row.

    global_scale: float32 scalar (shape () or (1,)) or float32 [n // 32]. Python floats are
    accepted and taken as float32 (the checkpoint stores fp32).
    """
    # Python floats (not numpy scalars: np.float64 subclasses float and must be rejected)
    if isinstance(global_scale, (float, int)) and not isinstance(global_scale, (bool, np.generic)):
        global_scale = np.float32(global_scale)
    g = np.asarray(global_scale)
    if g.dtype != np.float32:
        raise ValueError(
            f"{name} must be float32 (scalar or one value per 32-column tile), got dtype {g.dtype}; "
            "checkpoints store weight_scale_2 as fp32 - pass it unchanged"
        )
    if g.size == 1:
        g = np.full(n, g.reshape(()), dtype=np.float32)
    else:
        if g.ndim != 1 or n % TILE_N != 0 or g.shape[0] != n // TILE_N:
            raise ValueError(
                f"{name} must be a scalar or hold one value per 32-column tile (shape ({n // TILE_N},) "
                f"for N={n}), got shape {g.shape}; give each fused shard its own scale per tile of 32 rows"
            )
        g = np.repeat(g, TILE_N)
    if not (np.all(np.isfinite(g)) and np.all(g > 0)):
        raise ValueError(f"{name} must be finite and > 0, got values {np.unique(g)[:4]}")
    return g
