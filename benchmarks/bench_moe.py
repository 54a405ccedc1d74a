"""MoE layer benchmark (issue 22, part 5): qpn's MoE op against fp16 experts in torch and against a loop
of qpn's own dense linear ops per expert, on a Qwen3-30B-A3B-shaped layer (128 experts, top-8, hidden
2048, expert intermediate 768) and a Mixtral-8x7B-shaped one (8 experts, top-2, 4096, 14336).

    python benchmarks/bench_moe.py [--out DIR] [--ms 1,8,32,64,512,2048] [--layers qwen3,mixtral]

Per layer, format (NVFP4 / FP8 per channel) and M: microseconds per call (eager: qpn's MoE op groups the
tokens on the host today, so it cannot be graph-captured; every path is timed the same way, the median of
REPEATS timings of CALLS calls, a sync at the end of each), the bytes of the experts actually hit (the
packed buffers qpn reads, their share of the read ceiling at the measured time), and ratios measured in
the same run: fp16 / qpn (> 1: qpn faster) and loop / qpn. Routing: random router logits, softmax top-k
(renormalized), the same for every path.

- fp16: transformers 5's experts loop in fp16 (per hit expert: index the tokens, F.linear for gate_up,
  silu * up, F.linear for down, index_add_ of the weighted result); a gather + bmm formulation was not
  tried, so this is a baseline, not the fastest fp16 layer one can build.
- loop: the same loop over qpn's dense ops (torch.ops.qpn.*_linear, gated, then down), the path each
  call takes chosen by the dispatch policy (not batch invariant: a reference for speed only).
Weights: random packed bytes (valid in any order: QPN2 codes, e4m3 scales 0x28..0x7D with g = 1e-3;
QPN8 codes without the NaN bytes, S16 in [2^-6, 2^2]); fp16 experts random. Values move no time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import qpn.torch_bridge  # noqa: F401  (registers the ops)
from qpn.ref.formats import QPN2, QPN8, WeightFormat
from qpn.torch_bridge import PackedExperts, packed_weight_class

LAYERS = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336)}  # experts, top-k, hidden, intermediate
READ_CEILING_GBPS = 4566.0  # the H200's measured streaming-read ceiling (benchmarks/results/decode_h200.md)
REPEATS, CALLS = 5, 3


def random_buffers(wf: WeightFormat, e: int, n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Stacked [E, ...] buffers of layout `wf` for [N, K] weights (module docstring's values)."""
    out = {}
    for b in wf.buffers:
        shape = (e, *b.shape(n, k))
        if b.name == "codes":
            t = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)
            out[b.name] = t if wf is QPN2 else torch.where((t & 0x7F) == 0x7F, t - 1, t)
        elif b.name == "scales":
            out[b.name] = torch.randint(0x28, 0x7E, shape, dtype=torch.uint8, device="cuda", generator=gen)
        elif b.name == "global_scale":
            out[b.name] = torch.full(shape, 1e-3, dtype=torch.float32, device="cuda")
        else:
            out[b.name] = torch.exp2(torch.rand(shape, device="cuda", generator=gen) * 8 - 6).half()
    return out


def timed_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6 / CALLS)
    return statistics.median(samples)


def fp16_moe(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        rows, choices = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, rows, y * weights[rows, choices, None].to(y.dtype))
    return out


def loop_moe(packed: PackedExperts, x, weights, ids):
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, choices = (ids == e).nonzero(as_tuple=True)
        w13, w2 = packed.expert(e)
        y = w2.linear(w13.linear(x[rows].contiguous(), gated=True))
        acc.index_add_(0, rows, y.float() * weights[rows, choices, None])
    return acc.half()


def hit_bytes(packed: PackedExperts, ids: torch.Tensor) -> int:
    per_expert = sum(t[0].numel() * t.element_size() for t in (*packed.w13.values(), *packed.w2.values()))
    return per_expert * int(torch.unique(ids).numel())


def bench_layer(name: str, ms: list[int], gen: torch.Generator) -> list[dict]:
    experts, top_k, hidden, inter = LAYERS[name]
    rows = []
    w13_16 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).half()
    w2_16 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).half()
    for wf in (QPN2, QPN8):
        packed = PackedExperts(packed_weight_class(wf), random_buffers(wf, experts, 2 * inter, hidden, gen),
                               random_buffers(wf, experts, hidden, inter, gen), hidden, inter)
        for m in ms:
            x = (torch.randn(m, hidden, device="cuda", generator=gen) / 4).half()
            probs = torch.softmax(torch.randn(m, experts, device="cuda", generator=gen), dim=-1)
            weights, ids = torch.topk(probs, top_k, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).float().contiguous()
            us = {"qpn": timed_us(lambda: packed.forward(x, weights, ids)),
                  "fp16": timed_us(lambda: fp16_moe(x, w13_16, w2_16, weights, ids)),
                  "loop": timed_us(lambda: loop_moe(packed, x, weights, ids))}
            nbytes = hit_bytes(packed, ids)
            row = {"layer": name, "format": wf.format, "m": m, "experts_hit": int(torch.unique(ids).numel()),
                   "hit_mb": nbytes / 1e6, **{f"{k}_us": round(v, 1) for k, v in us.items()},
                   "pct_read_ceiling": round(100 * nbytes / (us["qpn"] * 1e-6) / (READ_CEILING_GBPS * 1e9), 2),
                   "fp16_over_qpn": round(us["fp16"] / us["qpn"], 3),
                   "loop_over_qpn": round(us["loop"] / us["qpn"], 3)}
            rows.append(row)
            print(f"{name:8s} {wf.format:5s} M={m:<5d} hit {row['experts_hit']:3d} ({row['hit_mb']:.0f} MB): qpn "
                  f"{us['qpn']:9.1f} us ({row['pct_read_ceiling']:5.2f} % of read ceiling), fp16 {us['fp16']:9.1f}, "
                  f"loop {us['loop']:9.1f}; fp16/qpn {row['fp16_over_qpn']:.2f}, loop/qpn {row['loop_over_qpn']:.2f}",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--ms", default="1,8,32,64,512,2048")
    parser.add_argument("--layers", default="qwen3,mixtral")
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    ms = [int(m) for m in args.ms.split(",")]
    rows = [r for layer in args.layers.split(",") for r in bench_layer(layer, ms, gen)]
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    (args.out / "moe_h200.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
