"""MoE layer benchmark (issue 22, part 5): qpn's MoE op against fp16 experts in torch and against a loop
of qpn's own dense linear ops per expert, on a Qwen3-30B-A3B-shaped layer (128 experts, top-8, hidden
2048, expert intermediate 768) and a Mixtral-8x7B-shaped one (8 experts, top-2, 4096, 14336).

    python benchmarks/bench_moe.py [--out DIR] [--ms 1,8,32,64,512,2048] [--layers qwen3,mixtral]

Per layer, format (NVFP4 / FP8 per channel) and M: microseconds per call, the bytes of the experts actually
hit (the packed buffers qpn reads, their share of the read ceiling at the measured time), and ratios
measured in the same run. Routing: random router logits, softmax top-k (renormalized), the same for every
path.

- qpn: the op (the fused MoE kernels, chunks of 1024 // top_k tokens, no host sync) replayed from a CUDA graph of
  10 calls, GPU time between CUDA events (bench_dispatch.time_us; as vLLM replays its graphs);
  qpn_eager: called from Python, host included.
- fp16_bmm: fp16 experts, capturable: the chosen experts' weights gathered per (token, choice), two bmm,
  silu * up, the weighted sum; graph-replayed as qpn; only where the gathered weights fit in GATHER_BYTES.
- fp16_loop: transformers 5's experts loop in fp16 (per hit expert: index the tokens, F.linear for gate_up,
  silu * up, F.linear for down, index_add_ of the weighted result), eager (it syncs on the hit experts).
- fp16: the faster of the two, the baseline of the targets. loop: the same loop over qpn's dense ops
  (torch.ops.qpn.*_linear, gated, then down), eager, each call's path chosen by the dispatch policy.
- kernels (M <= KERNEL_MS): the op's kernels one by one, GPU microseconds per call from torch.profiler
  (CUPTI) over PROFILED_CALLS eager calls; their sum against the graph time shows the launch gaps.
Eager timings: the median of REPEATS timings of CALLS calls, a sync at the end of each.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dispatch  # noqa: E402  (the graph timing of bench_dispatch's table)
import bench_kernels as bk  # noqa: E402  (write_atomic)

LAYERS = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336)}  # experts, top-k, hidden, intermediate
READ_CEILING_GBPS = 4566.0  # the H200's measured streaming-read ceiling (benchmarks/results/decode_h200.md)
REPEATS, CALLS = 5, 3
GATHER_BYTES = 8e9  # fp16_bmm's gathered weights at most (Mixtral-shaped: M <= 11 at top-2)
KERNEL_MS = 8  # per-kernel times for M up to this
PROFILED_CALLS = 20


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


def graph_us(fn) -> float:
    """GPU microseconds per call of `fn` replayed from a CUDA graph (bench_dispatch.time_us: CALLS calls per
    graph, CUDA events, the median of its REPEATS)."""
    return bench_dispatch.time_us(fn, "cuda")


def fp16_bmm_moe(x, w13, w2, weights, ids):
    """fp16 experts without a host sync: each (token, choice) multiplies its expert's gathered weights."""
    m, top_k = ids.shape
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [S, H, 1]
    gate, up = torch.bmm(w13[flat], xs).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(w2[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [S, H]
    return (y.view(m, top_k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)


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


def kernel_us(fn) -> dict[str, float]:
    """{kernel name: GPU microseconds per call} of `fn`'s kernels (torch.profiler, CUPTI), in launch order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            out[event.name] = out.get(event.name, 0.0) + event.device_time / PROFILED_CALLS
    return {k: round(v, 2) for k, v in out.items()}


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
            ids = ids.to(torch.int32)  # as vLLM's routers return them
            qpn = lambda: packed.forward(x, weights, ids)  # noqa: E731
            us = {"qpn": graph_us(qpn), "qpn_eager": timed_us(qpn),
                  "fp16_bmm": graph_us(lambda: fp16_bmm_moe(x, w13_16, w2_16, weights, ids))
                  if m * top_k * 3 * inter * hidden * 2 <= GATHER_BYTES else None,
                  "fp16_loop": timed_us(lambda: fp16_moe(x, w13_16, w2_16, weights, ids)),
                  "loop": timed_us(lambda: loop_moe(packed, x, weights, ids))}
            us["fp16"] = min(v for k, v in us.items() if k.startswith("fp16_") and v is not None)
            nbytes = hit_bytes(packed, ids)
            row = {"layer": name, "format": wf.format, "m": m, "experts_hit": int(torch.unique(ids).numel()),
                   "hit_mb": nbytes / 1e6,
                   **{f"{k}_us": None if v is None else round(v, 1) for k, v in us.items()},
                   "pct_read_ceiling": round(100 * nbytes / (us["qpn"] * 1e-6) / (READ_CEILING_GBPS * 1e9), 2),
                   "fp16_over_qpn": round(us["fp16"] / us["qpn"], 3),
                   "loop_over_qpn": round(us["loop"] / us["qpn"], 3)}
            if m <= KERNEL_MS:
                row["kernels_us"] = kernel_us(qpn)
                print(f"  kernels (GPU us per call, sum {sum(row['kernels_us'].values()):.1f}): "
                      + "; ".join(f"{k[:60]} {v:.1f}" for k, v in row["kernels_us"].items()), flush=True)
            rows.append(row)
            show = {k: "-" if v is None else f"{v:.1f}" for k, v in us.items()}
            print(f"{name:8s} {wf.format:5s} M={m:<5d} hit {row['experts_hit']:3d} ({row['hit_mb']:.0f} MB): qpn "
                  f"{show['qpn']} us (graph; {row['pct_read_ceiling']:5.2f} % of read ceiling), eager "
                  f"{show['qpn_eager']}, fp16 bmm {show['fp16_bmm']} loop {show['fp16_loop']}, "
                  f"qpn loop {show['loop']}; "
                  f"fp16/qpn {row['fp16_over_qpn']:.2f}, loop/qpn {row['loop_over_qpn']:.2f}", flush=True)
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
    bk.write_atomic(args.out / "moe_h200.json", json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
