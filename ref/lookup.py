"""Dequantization by table lookup: out[n, k] = tables[n // block_rows, k // block_cols, codes[n, k]].

An e4m3 weight's dequantized value depends only on its code byte and its block's scale, so for
each scale of a layer the formula is evaluated once on all 256 codes (a table row, with exactly
the formula's roundings), and every weight is then looked up in its block's row. Same inputs,
same roundings, same bytes out - and no full-size fp32 temporaries: numpy's float32 -> float16
cast alone costs 5-9 ns per weight on the 2-core benchmark machine, the whole lookup 3-5 ns
(index built per 16 rows of 4096, then np.take).
"""

from __future__ import annotations

import numpy as np

# Codes per np.take call: 64 Ki uint8 codes become a 512 KiB intp index inside np.take, which
# stays in L2; one call on a whole 58 M-weight layer would allocate a 470 MB index instead.
_LOOKUP_ELEMENTS = 1 << 16


def lookup_blocks(codes: np.ndarray, tables: np.ndarray, block_rows: int, block_cols: int) -> np.ndarray:
    """uint8 codes [N, K], tables [ceil(N/block_rows), ceil(K/block_cols), 256] -> [N, K] of tables.dtype.

    out[n, k] = tables[n // block_rows, k // block_cols, codes[n, k]]; ragged edge blocks are
    cropped. Per-tensor scales: one block of N x K; per-channel: 1 x K; 128x128 blocks: 128 x 128.
    """
    n, k = codes.shape
    flat = tables.reshape(-1)
    table_cols = tables.shape[1]
    # index of element (n, k) in `flat`: (table row of n * table_cols + table column of k) * 256 + code
    column_base = (np.arange(k) // block_cols) * 256  # intp [K]
    out = np.empty((n, k), tables.dtype)
    rows_per_take = max(1, _LOOKUP_ELEMENTS // k)
    for start in range(0, n, rows_per_take):
        rows = np.arange(start, min(start + rows_per_take, n))
        index = ((rows // block_rows) * (table_cols * 256))[:, None] + column_base
        index += codes[rows[0]:rows[-1] + 1]
        np.take(flat, index, out=out[rows[0]:rows[-1] + 1], mode="clip")  # every index < flat.size
    return out
