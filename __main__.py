"""`python -m qpn`: the reference parity report on a built-in synthetic layer.

Quantizes one synthetic layer (4096 x 4096, Gaussian with a few outliers, seed 0) the way
ModelOpt does, prepacks it to QPN2 / QPN8, checks that unpacking gives back the checkpoint bytes
and that the kernel-layout dequantization equals the checkpoint-layout one, then measures what the
upstream decode variants and the FP8 scale rounding would change, and runs the reference linear.
Everything here is `qpn.ref` (numpy); it needs no GPU.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from qpn import ref

N, K, M, SEED = 4096, 4096, 8, 0


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def _synthetic_weight(rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((N, K), dtype=np.float32) * np.float32(0.02)
    outliers = rng.integers(0, w.size, 64)
    w.flat[outliers] *= np.float32(30.0)  # a few large weights, as real layers have
    return w


def _share_differing(a16: np.ndarray, b16: np.ndarray) -> float:
    return float(np.mean(a16.view(np.uint16) != b16.view(np.uint16)))


def main() -> int:
    rng = np.random.default_rng(SEED)
    w = _synthetic_weight(rng)
    x = (rng.standard_normal((M, K), dtype=np.float32)).astype(np.float16)
    y_fp32 = x.astype(np.float64) @ w.astype(np.float64).T
    rows = []  # (check, result, detail)

    nv, t_quant = _timed(ref.nvfp4_quantize, w)
    (codes, scales), t_pack = _timed(ref.qpn2_prepack, nv.weight_packed, nv.weight_scale)
    unpacked = ref.qpn2_unpack(codes, scales, N, K)
    roundtrip = np.array_equal(unpacked[0], nv.weight_packed) and np.array_equal(unpacked[1], nv.weight_scale)
    rows.append(("QPN2 unpack(prepack) == checkpoint bytes", roundtrip, f"prepack {t_pack * 1e3:.0f} ms"))
    w16 = ref.nvfp4_dequantize(*nv)
    w16_qpn2 = ref.qpn2_dequantize(codes, scales, nv.weight_scale_2, N, K)
    rows.append(("QPN2 W16 == checkpoint W16 (contract)", np.array_equal(w16.view(np.uint16), w16_qpn2.view(np.uint16)), ""))
    for variant in ("p", "e"):
        other = getattr(ref, f"qpn2_dequantize_variant_{variant}")(codes, scales, nv.weight_scale_2, N, K)
        rows.append((f"upstream variant {variant.upper()} differs from contract", None,
                     f"{100 * _share_differing(w16, other):.1f} % of weights"))
    y = ref.linear(x, w16)
    rel = np.linalg.norm(y - y_fp32) / np.linalg.norm(y_fp32)
    rows.append(("NVFP4 linear vs fp32 weights (rel. L2)", None, f"{rel:.4f}  (quantize {t_quant * 1e3:.0f} ms)"))

    fp8 = ref.fp8_quantize(w, "channel")
    (codes8, gscales8), t_pack8 = _timed(ref.qpn8_prepack, fp8.weight, fp8.weight_scale)
    weight8, _ = ref.qpn8_unpack(codes8, gscales8, N, K)
    rows.append(("QPN8 unpack(prepack) == checkpoint bytes", np.array_equal(weight8, fp8.weight), f"prepack {t_pack8 * 1e3:.0f} ms"))
    w16_8 = ref.qpn8_dequantize(codes8, gscales8, N, K)
    rows.append(("QPN8 W16 vs checkpoint semantics", None,
                 f"{100 * _share_differing(w16_8, ref.fp8_dequantize(*fp8)):.1f} % differ (<= 1 ulp, S16 rounding)"))
    y8 = ref.linear(x, w16_8)
    rel8 = np.linalg.norm(y8 - y_fp32) / np.linalg.norm(y_fp32)
    rows.append(("FP8 linear vs fp32 weights (rel. L2)", None, f"{rel8:.5f}"))

    print(f"qpn reference parity report: synthetic {N}x{K} layer, M={M}, seed {SEED}")
    width = max(len(r[0]) for r in rows)
    for check, ok, detail in rows:
        status = "" if ok is None else ("OK  " if ok else "FAIL")
        print(f"  {check:<{width}}  {status:<4}  {detail}")
    failed = [r for r in rows if r[1] is False]
    print("all exactness checks passed" if not failed else f"{len(failed)} exactness checks FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
