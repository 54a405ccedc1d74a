"""Geometry shared by the QPN2 and QPN8 layouts (docs/QPN2.md, "Geometry shared with QPN8").

- Output columns are cut into tiles of 32 (`t = n // 32`); K into groups of 16 (`g = k // 16`).
- A warp lane owns one column of a tile: `col(lane) = 8*((lane>>2)&3) + (lane&3) + 4*((lane>>4)&1)`,
  i.e. lanes 0..31 -> columns 0,1,2,3, 8..11, 16..19, 24..27, 4..7, 12..15, 20..23, 28..31.
  The map comes from the Volta m8n8k4 fragment; for qpn it is only a byte order.
- Inside a group the 16 k of a lane's column are stored in KORDER: position p holds
  k = (p&8) + 2*(p&3) + ((p&7)>>2). Reading a lane's 8 nibble-bytes as two little-endian
  words, nibble i and nibble i+4 of a word then hold the consecutive pair (2i, 2i+1).

Every function here is a pure integer map, vectorized over numpy integer arrays.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

TILE_N = 32  # output columns per tile (one warp, one column per lane)
GROUP_K = 16  # k per group (one NVFP4 block scale, one QPN8 packet)
LANES = 32


def column_of_lane(lane: npt.ArrayLike) -> np.ndarray:
    """Column inside a 32-wide tile owned by `lane` (0..31)."""
    lane = np.asarray(lane)
    return 8 * ((lane >> 2) & 3) + (lane & 3) + 4 * ((lane >> 4) & 1)


def lane_of_column(col: npt.ArrayLike) -> np.ndarray:
    """Inverse of `column_of_lane`: the lane that owns tile column `col` (0..31)."""
    col = np.asarray(col)
    return (col & 3) | (((col >> 3) & 3) << 2) | (((col >> 2) & 1) << 4)


def k_of_position(p: npt.ArrayLike) -> np.ndarray:
    """k (0..15) stored at position p (0..15) of a group: the KORDER table."""
    p = np.asarray(p)
    return (p & 8) + 2 * (p & 3) + ((p & 7) >> 2)


def position_of_k(k: npt.ArrayLike) -> np.ndarray:
    """Inverse of `k_of_position`: the position (0..15) that holds k inside its group."""
    k = np.asarray(k)
    return (k & 8) + ((k & 7) >> 1) + 4 * (k & 1)


COLUMN_OF_LANE = column_of_lane(np.arange(LANES)).astype(np.int64)
LANE_OF_COLUMN = lane_of_column(np.arange(TILE_N)).astype(np.int64)
KORDER = k_of_position(np.arange(GROUP_K)).astype(np.int64)  # (0,2,4,6,1,3,5,7, 8,10,...)
