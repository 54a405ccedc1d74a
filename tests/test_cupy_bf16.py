"""x_bf16.cu (the Turing path of bf16 x, docs/DESIGN.md "bf16 activations") against qpn.ref.fp16_rows byte for
byte: each row's fp16 values and its factor 2^-e, on rows from bf16's bottom to its top, rows of zeros, of
infinities and NaN, and rows spanning 60 binades (values rounding in fp16's subnormals). GPU only."""

from __future__ import annotations

import numpy as np
import pytest

from qpn import ref

pytestmark = pytest.mark.gpu


def rows(rng: np.random.Generator, k: int) -> np.ndarray:
    """bf16 rows (float32 of bf16 values): one per scale from 2^-133 to 2^127, wide rows, zeros, non-finite."""
    scales = [2.0**t for t in (-133, -130, -126, -100, -24, -14, 0, 15, 16, 64, 120, 127)]
    out = [rng.uniform(-1.99, 1.99, k) * s for s in scales]
    out += [rng.choice([-1, 1], k) * np.exp2(rng.uniform(-60, 0, k)) * 2.0**e for e in (-40, 0, 40)]
    zeros = np.zeros(k)
    zeros[::3] = -0.0
    special = rng.standard_normal(k)
    special[[0, 1, 3]] = [np.inf, -np.inf, np.nan]
    out += [zeros, special, np.full(k, np.inf), np.full(k, np.nan)]
    return ref.bf16_round(np.stack(out))


def same_fp16(got: np.ndarray, want: np.ndarray) -> bool:
    """Byte for byte, any NaN equal to any NaN (the GPU's cvt gives the canonical 0x7FFF, numpy 0x7E00)."""
    got, want = got.view(np.float16), want.view(np.float16)
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan) and np.array_equal(got.view(np.uint16)[~nan],
                                                                      want.view(np.uint16)[~nan]))


@pytest.mark.parametrize("k", [4, 64, 1028, 8192])
def test_the_kernel_writes_ref_fp16_rows_byte_for_byte_as_rows_and_as_fragments(k):
    """Rows: ref.fp16_rows' bytes. Fragments (the decode / GEMM kernels' x order, for M > 8): exactly what
    qpn_x_fragments makes of those rows (19 and 9 rows: pairs half empty, 1: mostly zeros)."""
    import cupy

    from qpn.cupy_kernels.bf16 import bf16_rows_elements, queue_bf16_rows
    from qpn.cupy_kernels.workspace import fragment_elements, queue_x_fragments

    x = rows(np.random.default_rng(k), k)
    want16, e = ref.fp16_rows(x)
    want_factor = np.ldexp(np.float32(1.0), -e).astype(np.float32)
    for m in (x.shape[0], 9, 1):
        bits = cupy.asarray(ref.bf16_bits(x[:m]).view(np.int16))
        workspace = cupy.full(bf16_rows_elements(m, k), np.nan, dtype=np.float32)
        x16, factor = queue_bf16_rows(bits, workspace)
        assert same_fp16(cupy.asnumpy(x16), want16[:m])
        assert np.array_equal(cupy.asnumpy(factor), want_factor[:m])
        if k % 16:
            continue  # fragments hold whole 16-k groups (the layouts' K is a multiple of 16)
        want_frags = cupy.full(fragment_elements(m, k), np.nan, dtype=np.float32)
        queue_x_fragments(x16, want_frags)
        frags = cupy.full(fragment_elements(m, k), np.nan, dtype=np.float32)
        workspace = cupy.full(bf16_rows_elements(m, k, fragments=True), np.nan, dtype=np.float32)
        got, factor = queue_bf16_rows(bits, workspace, frags)
        assert got is frags and np.array_equal(cupy.asnumpy(frags).view(np.uint32),
                                               cupy.asnumpy(want_frags).view(np.uint32))  # the same NaNs
        assert np.array_equal(cupy.asnumpy(factor), want_factor[:m])
