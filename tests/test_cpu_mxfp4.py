"""The CPU backend's MXFP4 kernels (qpn.torch_bridge._cpu; issue 23): the reduced W16 rows bit for bit the
reference's (qpn.ref.mxfp4.mxfp4_w16), blocks 60+ binades below their tile's top included; the fused kernel
times the tiles' 2^T inside mxfp4_linear_bounds, and its rows independent of the batch."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from qpn.ref import mxfp4 as mx  # noqa: E402
from qpn.torch_bridge import _cpu  # noqa: E402


def weight(rng: np.random.Generator, n: int, k: int) -> mx.MXFP4Weight:
    scales = rng.integers(60, 141, (n, k // 32)).astype(np.uint8)  # F from -80 to 13
    scales[::32, 0] = 140
    scales[32:64] -= 5  # a tile with another T
    return mx.MXFP4Weight(rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8), scales)


def buffers(w: mx.MXFP4Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    codes, scales, tile_scale = mx.qpnmx_prepack(*w)
    return codes.reshape(-1), scales.reshape(-1), _cpu.qpnmx_blocks(tile_scale), tile_scale


def test_w16_rows_are_the_references_bytes():
    rng = np.random.default_rng(0)
    n, k = 128, 512
    w = weight(rng, n, k)
    codes, scales, blocks, _ = buffers(w)
    want = mx.mxfp4_w16(*w)[0]
    out = np.empty((64, k), np.float32)
    for row0 in (0, 64):  # chunks of rows, as the decode-then-matmul path runs them
        _cpu.kernels(2).qpnmx_w16_rows(codes, scales, blocks, out, row0)
        assert np.array_equal(out.astype(np.float16).view(np.uint16), want[row0:row0 + 64].view(np.uint16))
        assert np.array_equal(out, want[row0:row0 + 64].astype(np.float32))  # W16 exactly: fp32 holds it


def test_the_fused_kernel_is_in_the_bound_and_batch_invariant():
    rng = np.random.default_rng(1)
    n, k = 96, 256
    w = weight(rng, n, k)
    codes, scales, blocks, tile_scale = buffers(w)
    w16 = mx.mxfp4_w16(*w)[0]
    x = (rng.standard_normal((_cpu.FUSED_MAX_M, k)) * 1e-3).astype(np.float16)
    xp = np.ascontiguousarray(x.astype(np.float32)[:, _cpu.x_position_index(k)])

    def run(rows: np.ndarray) -> np.ndarray:
        y = np.empty((rows.shape[0], n), np.float32)
        _cpu.kernels(2).qpnmx_linear_fused(codes, scales, blocks, rows, y)
        return (y * np.repeat(tile_scale, 32)).astype(np.float16)  # 2^T exact, then the one RN16

    got = run(xp)
    lo, hi = mx.mxfp4_linear_bounds(x, w16, tile_scale)
    assert ((lo <= got) & (got <= hi)).all() and np.isfinite(got).mean() > 0.9
    for i in range(x.shape[0]):
        assert np.array_equal(run(xp[i:i + 1]).view(np.uint16), got[i:i + 1].view(np.uint16))
