"""MoE layer benchmark (issue 22, part 5; issue 23, part 5): qpn's MoE op against fp16 experts in torch and
against a loop of qpn's own dense linear ops per expert, on a Qwen3-30B-A3B-shaped layer (128 experts,
top-8, hidden 2048, expert intermediate 768), a Mixtral-8x7B-shaped one (8 experts, top-2, 4096, 14336) and,
selected with --layers, gpt-oss's: gptoss20b (32 experts, top-4, hidden 2880, intermediate 2880) and
gptoss120b (128 experts, top-4, 2880, 2880; openai/gpt-oss-120b's config).

    python benchmarks/bench_moe.py [--out DIR] [--ms 1,8,32,64,512,2048] [--layers qwen3,mixtral] [--name NAME]
    python benchmarks/bench_moe.py --layers gptoss20b,gptoss120b --ms 1,8,32,512 --out DIR

Per layer, format (NVFP4 / FP8 per channel; gpt-oss: MXFP4) and M: microseconds per call, the bytes of the
experts actually hit (the packed buffers qpn reads, gpt-oss's float32 biases included; their share of the read
ceiling at the measured time), and ratios measured in the same run. Routing: random router logits, softmax
top-k (renormalized: for gpt-oss the same as its softmax over the top-k logits), the same for every path.

- qpn: the op (the fused MoE kernels, chunks of 1024 // top_k tokens, no host sync) replayed from a CUDA graph of
  10 calls, GPU time between CUDA events (bench_dispatch.time_us; as vLLM replays its graphs);
  qpn_eager: called from Python, host included.
- fp16_bmm: fp16 experts, capturable: the chosen experts' weights gathered per (token, choice), two bmm,
  silu * up, the weighted sum; graph-replayed as qpn; only where the gathered weights fit in GATHER_BYTES.
- fp16_loop: transformers 5's experts loop in fp16 (per hit expert: index the tokens, F.linear for gate_up,
  silu * up, F.linear for down, index_add_ of the weighted result), eager (it syncs on the hit experts).
- gpt-oss: both fp16 formulations do gpt-oss's work: the fp16 biases added to gate_up and down, and gpt-oss's
  clamped SwiGLU (swigluoai_mul: epilogue.swigluoai_and_mul's operations in fp32, one rounding to fp16, as
  transformers' GptOssExperts._apply_gate computes them; the qpn loop uses it too, the op has it fused).
- fp16: the faster of the two, the baseline of the targets. loop: the same loop over qpn's dense ops
  (torch.ops.qpn.*_linear, gated, then down), eager, each call's path chosen by the dispatch policy.
- kernels (M <= KERNEL_MS): the op's kernels one by one, GPU microseconds per call from torch.profiler
  (CUPTI) over PROFILED_CALLS eager calls; their sum against the graph time shows the launch gaps.
Eager timings: the median of REPEATS timings of CALLS calls, a sync at the end of each.
Weights: random packed bytes (valid in any order: QPN2 codes, e4m3 scales 0x28..0x7D with g = 1e-3;
QPN8 codes without the NaN bytes, S16 in [2^-6, 2^2]); fp16 experts random. Values move no time.
gpt-oss's MXFP4 experts: random gpt-oss blocks (any byte) and e8m0 scale bytes in MX_SCALE_BYTES, packed by
qpn's own prepack (pack_mxfp4: QPNMX, each tile's 2^T from its largest scale byte), float32 biases; its fp16
experts are the exact decode of the same blocks (e2m1 * 2^(s - 127) is an fp16 number for these bytes) with the
biases rounded to fp16, so qpn and fp16 compute one function: before timing, each M's qpn result is compared
with the fp16 one (relative error at most MAX_REL_ERR, else the run stops: a broken kernel is not timed).

Results: NAME.json in --out (NAME: moe_h200, or gpt_oss_moe_h200 when a gpt-oss layer runs), rewritten
(bench_kernels.write_atomic) after every layer so a timeout keeps the finished layers; with a gpt-oss layer
also NAME.md (the table and the targets of issue 23: M = 1 >= 40 % of the read ceiling, >= 2x the faster fp16
formulation at M = 1, 8 and 32), whose "- target" lines are printed too, met or missed with the measured numbers.
A CPU-only machine exits 3 (the timings are CUDA graphs); tests/test_bench_gpt_oss.py runs the parts a CPU can.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

import qpn.torch_bridge  # noqa: F401  (registers the ops)
from qpn.benchmarks import bench_dispatch  # (the graph timing of bench_dispatch's table)
from qpn.benchmarks import bench_kernels as bk  # (write_atomic, profiled_kernels)
from qpn.ref.codecs import E8M0_BIAS, decode_e2m1
from qpn.ref.formats import MX_BLOCK, QPN2, QPN8, QPNMX, WeightFormat
from qpn.ref.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT
from qpn.torch_bridge import PackedExperts, pack_mxfp4, packed_weight_class


@dataclass(frozen=True)
class Layer:
    """One MoE layer: its shape, the formats benchmarked, the M swept by default, and what its experts compute
    (gpt-oss: float32 biases w13 [E, 2I], w2 [E, H] and the clamped SwiGLU "swigluoai")."""

    experts: int
    top_k: int
    hidden: int
    inter: int
    formats: tuple[WeightFormat, ...] = (QPN2, QPN8)
    ms: tuple[int, ...] = (1, 8, 32, 64, 512, 2048)
    activation: str = "silu"
    biased: bool = False


GPT_OSS = {"formats": (QPNMX,), "ms": (1, 8, 32, 512), "activation": "swigluoai", "biased": True}
LAYERS = {"qwen3": Layer(128, 8, 2048, 768), "mixtral": Layer(8, 2, 4096, 14336),
          "gptoss20b": Layer(32, 4, 2880, 2880, **GPT_OSS), "gptoss120b": Layer(128, 4, 2880, 2880, **GPT_OSS)}
READ_CEILING_GBPS = 4566.0  # the H200's measured streaming-read ceiling (benchmarks/results/decode_h200.md)
REPEATS, CALLS = 5, 3
GATHER_BYTES = 8e9  # fp16_bmm's gathered weights at most (Mixtral-shaped: M <= 11 at top-2; gpt-oss: M <= 40)
KERNEL_MS = 8  # per-kernel times for M up to this
PROFILED_CALLS = 20
# gpt-oss's random MXFP4 experts: e8m0 bytes 115..125 are scales 2^-12 .. 2^-2, so |weight| <= 6 * 2^-2 and the
# least nonzero one is 0.5 * 2^-12 = 2^-13, an fp16 normal: the fp16 experts hold every weight exactly
MX_SCALE_BYTES = (115, 125)
BIAS_STD = 0.25  # float32 biases, N(0, BIAS_STD^2), beside gate_up's sums (std 3.4 at H = 2880, x ~ N(0, 1/16))
# qpn vs the fp16 formulation on the same weights: both round gate / up, the activation and the down output to
# fp16 (2^-11 relative each) and sum in fp32 in different orders: 5e-4 .. 8e-4 in norm at gpt-oss's shape (the
# CPU op against both formulations, M = 1-32); a wrong nibble, scale byte, bias or epilogue moves it by O(1)
MAX_REL_ERR = 2e-2
TARGET_READ_PCT, TARGET_READ_MS = 40.0, (1,)  # issue 23: M = 1 >= 40 % of the read ceiling
TARGET_FP16_X, TARGET_FP16_MS = 2.0, (1, 8, 32)  # issue 23: >= 2x the faster fp16 formulation at M = 1-32


class Fp16Experts(NamedTuple):
    """fp16 experts in qpn's order: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I], optional fp16 biases."""

    w13: Tensor
    w2: Tensor
    b13: Tensor | None = None
    b2: Tensor | None = None
    activation: str = "silu"


def random_buffers(wf: WeightFormat, e: int, n: int, k: int, gen: torch.Generator,
                   device: str = "cuda") -> dict[str, torch.Tensor]:
    """Stacked [E, ...] buffers of layout `wf` for [N, K] weights (module docstring's values)."""
    out = {}
    for b in wf.buffers:
        shape = (e, *b.shape(n, k))
        if b.name == "codes":
            t = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
            out[b.name] = t if wf is QPN2 else torch.where((t & 0x7F) == 0x7F, t - 1, t)
        elif b.name == "scales":
            out[b.name] = torch.randint(0x28, 0x7E, shape, dtype=torch.uint8, device=device, generator=gen)
        elif b.name == "global_scale":
            out[b.name] = torch.full(shape, 1e-3, dtype=torch.float32, device=device)
        else:
            out[b.name] = torch.exp2(torch.rand(shape, device=device, generator=gen) * 8 - 6).half()
    return out


def random_mxfp4(n: int, k: int, gen: torch.Generator, device: str) -> tuple[Tensor, Tensor]:
    """One random gpt-oss MXFP4 weight [N, K]: blocks uint8 [N, K/2] (any byte: element 2j in the low nibble),
    e8m0 scales uint8 [N, K/32] in MX_SCALE_BYTES."""
    blocks = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    low, high = MX_SCALE_BYTES
    scales = torch.randint(low, high + 1, (n, k // MX_BLOCK), dtype=torch.uint8, device=device, generator=gen)
    return blocks, scales


def mxfp4_fp16(blocks: Tensor, scales: Tensor) -> Tensor:
    """gpt-oss MXFP4 (blocks [N, K/2], scales [N, K/32]) -> its values, float16 [N, K]: e2m1(code) * 2^(s - 127)
    from qpn.ref's e2m1 table, exact in float32 and (MX_SCALE_BYTES) in fp16; independent of qpn's decode."""
    table = torch.from_numpy(decode_e2m1(np.arange(16, dtype=np.uint8))).to(blocks.device)
    n = blocks.shape[0]
    # byte j: element 2j in the low nibble (0xF  # 1111), element 2j + 1 in the high one
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).reshape(n, -1)
    scale = torch.exp2(scales.float() - E8M0_BIAS).repeat_interleave(MX_BLOCK, dim=1)
    return (table[codes.long()] * scale).half()


def mxfp4_experts(layer: Layer, gen: torch.Generator, device: str = "cuda") -> tuple[PackedExperts, Fp16Experts]:
    """Random gpt-oss experts of `layer`'s shape: QPNMX packed by pack_mxfp4 (qpn's prepack on `device`), float32
    biases, and the fp16 experts of the same weights (mxfp4_fp16) with the biases rounded to fp16."""
    e, h, i = layer.experts, layer.hidden, layer.inter
    w13 = torch.empty((e, 2 * i, h), dtype=torch.float16, device=device)
    w2 = torch.empty((e, h, i), dtype=torch.float16, device=device)
    pairs = []
    for expert in range(e):
        pair = []
        for n, k, fp16 in ((2 * i, h, w13), (h, i, w2)):
            blocks, scales = random_mxfp4(n, k, gen, device)
            fp16[expert] = mxfp4_fp16(blocks, scales)
            pair.append(pack_mxfp4(blocks, scales))
        pairs.append(tuple(pair))
    b13 = torch.randn((e, 2 * i), device=device, generator=gen) * BIAS_STD
    b2 = torch.randn((e, h), device=device, generator=gen) * BIAS_STD
    packed = PackedExperts.stack(pairs, b13, b2, layer.activation)
    return packed, Fp16Experts(w13, w2, b13.half(), b2.half(), layer.activation)


def silu_mul(y: Tensor) -> Tensor:
    """silu(gate) * up on [S, 2I] (gate, then up), in y's dtype."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def swigluoai_mul(y: Tensor) -> Tensor:
    """gpt-oss's clamped SwiGLU on fp16 [S, 2I] (gate, then up) -> fp16 [S, I]: epilogue.swigluoai_and_mul's
    operations in fp32, one rounding (sigmoid for its 1 / (1 + expf(-v))), with no host tensor: capturable."""
    gate, up = y.float().chunk(2, dim=-1)
    g = gate.clamp(max=SWIGLU_LIMIT)
    u = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return ((u + 1.0) * (g * torch.sigmoid(g * SWIGLU_ALPHA))).half()


ACTIVATIONS = {"silu": silu_mul, "swigluoai": swigluoai_mul}


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


def fp16_bmm_moe(x, w13, w2, weights, ids, b13=None, b2=None, activation="silu"):
    """fp16 experts without a host sync: each (token, choice) multiplies its expert's gathered weights."""
    m, top_k = ids.shape
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [S, H, 1]
    gate_up = torch.bmm(w13[flat], xs).squeeze(-1)  # [S, 2I]
    if b13 is not None:
        gate_up = gate_up + b13[flat]
    y = torch.bmm(w2[flat], ACTIVATIONS[activation](gate_up).unsqueeze(-1)).squeeze(-1)  # [S, H]
    if b2 is not None:
        y = y + b2[flat]
    return (y.view(m, top_k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)


def fp16_moe(x, w13, w2, weights, ids, b13=None, b2=None, activation="silu"):
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        rows, choices = (ids == e).nonzero(as_tuple=True)
        gate_up = F.linear(x[rows], w13[e], None if b13 is None else b13[e])
        y = F.linear(ACTIVATIONS[activation](gate_up), w2[e], None if b2 is None else b2[e])
        out.index_add_(0, rows, y * weights[rows, choices, None].to(y.dtype))
    return out


def loop_moe(packed: PackedExperts, x, weights, ids):
    plain = packed.activation == "silu" and packed.w13_bias is None  # the gated op does silu * up itself
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, choices = (ids == e).nonzero(as_tuple=True)
        w13, w2 = packed.expert(e)
        if plain:
            y = w2.linear(w13.linear(x[rows].contiguous(), gated=True)).float()
        else:  # gpt-oss: the bias and the clamped SwiGLU in torch between qpn's two linears
            gate_up = w13.linear(x[rows].contiguous()).float()
            if packed.w13_bias is not None:
                gate_up = gate_up + packed.w13_bias[e]
            y = w2.linear(ACTIVATIONS[packed.activation](gate_up.half())).float()
            if packed.w2_bias is not None:
                y = y + packed.w2_bias[e]
        acc.index_add_(0, rows, y * weights[rows, choices, None])
    return acc.half()


def kernel_us(fn) -> dict[str, float]:
    """{kernel name: GPU microseconds per call} of `fn`'s kernels (torch.profiler, CUPTI), in launch order."""
    return {name: round(us, 2) for name, (_, us) in bk.profiled_kernels(fn, PROFILED_CALLS).items()}


def hit_bytes(packed: PackedExperts, ids: torch.Tensor) -> int:
    """Bytes of the hit experts: their packed buffers and (gpt-oss) their float32 biases."""
    biases = [b for b in (packed.w13_bias, packed.w2_bias) if b is not None]
    per_expert = sum(t[0].numel() * t.element_size() for t in (*packed.w13.values(), *packed.w2.values(), *biases))
    return per_expert * int(torch.unique(ids).numel())


def routing(m: int, layer: Layer, gen: torch.Generator, device: str = "cuda") -> tuple[Tensor, Tensor, Tensor]:
    """(x fp16 [M, H], topk_weights float32 [M, k], topk_ids int32 [M, k]): random logits, softmax top-k."""
    x = (torch.randn(m, layer.hidden, device=device, generator=gen) / 4).half()
    probs = torch.softmax(torch.randn(m, layer.experts, device=device, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, layer.top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).float().contiguous()
    return x, weights, ids.to(torch.int32)  # int32 ids, as vLLM's routers return them


def rel_err(y: Tensor, ref: Tensor) -> float:
    """||y - ref|| / ||ref|| in float64 (inf where y is not finite)."""
    y, ref = y.double(), ref.double()
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y - ref).norm() / ref.norm().clamp_min(1e-300))


def check(name: str, wf: WeightFormat, m: int, qpn: Tensor, fp16: Tensor) -> float:
    """qpn's result against the fp16 formulation on the same weights; refuses (AssertionError) past MAX_REL_ERR."""
    err = rel_err(qpn, fp16)
    print(f"  check {name} {wf.format} M={m}: qpn vs fp16 relative error {err:.2e} (limit {MAX_REL_ERR:g})", flush=True)
    if not err <= MAX_REL_ERR:
        raise AssertionError(f"{name} {wf.format} M={m}: qpn's MoE op differs from the fp16 experts on the same "
                             f"weights by {err:.3g} (norm-relative, limit {MAX_REL_ERR:g}); refusing to time it")
    return err


def bench_layer(name: str, ms: list[int], gen: torch.Generator) -> list[dict]:
    layer = LAYERS[name]
    experts, top_k, hidden, inter = layer.experts, layer.top_k, layer.hidden, layer.inter
    rows = []
    shared = None if layer.biased else Fp16Experts(  # random fp16 experts, shared by the random packed formats
        (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).half(),
        (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).half())
    for wf in layer.formats:
        if wf is QPNMX:
            t0 = time.perf_counter()
            packed, fp16 = mxfp4_experts(layer, gen)
            print(f"{name}: {experts} MXFP4 experts packed in {time.perf_counter() - t0:.1f} s", flush=True)
        else:
            packed, fp16 = PackedExperts(packed_weight_class(wf), random_buffers(wf, experts, 2 * inter, hidden, gen),
                                         random_buffers(wf, experts, hidden, inter, gen), hidden, inter), shared
        for m in ms:
            x, weights, ids = routing(m, layer, gen)
            qpn = lambda: packed.forward(x, weights, ids)  # noqa: E731
            bmm = lambda: fp16_bmm_moe(x, *fp16[:2], weights, ids, *fp16[2:])  # noqa: E731
            loop16 = lambda: fp16_moe(x, *fp16[:2], weights, ids, *fp16[2:])  # noqa: E731
            gathers = m * top_k * 3 * inter * hidden * 2 <= GATHER_BYTES
            # MXFP4's fp16 experts are its exact decode: one function, checked before timing (module docstring)
            err = check(name, wf, m, qpn(), bmm() if gathers else loop16()) if wf is QPNMX else None
            us = {"qpn": graph_us(qpn), "qpn_eager": timed_us(qpn), "fp16_bmm": graph_us(bmm) if gathers else None,
                  "fp16_loop": timed_us(loop16), "loop": timed_us(lambda: loop_moe(packed, x, weights, ids))}
            us["fp16"] = min(v for k, v in us.items() if k.startswith("fp16_") and v is not None)
            nbytes = hit_bytes(packed, ids)
            row = {"layer": name, "format": wf.format, "m": m, "experts_hit": int(torch.unique(ids).numel()),
                   "hit_mb": nbytes / 1e6,
                   **{f"{k}_us": None if v is None else round(v, 1) for k, v in us.items()},
                   "pct_read_ceiling": round(100 * nbytes / (us["qpn"] * 1e-6) / (READ_CEILING_GBPS * 1e9), 2),
                   "fp16_over_qpn": round(us["fp16"] / us["qpn"], 3),
                   "loop_over_qpn": round(us["loop"] / us["qpn"], 3)}
            if err is not None:
                row["rel_err_vs_fp16"] = float(f"{err:.3g}")
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
        del packed, fp16
        torch.cuda.empty_cache()
    return rows


def targets(rows: list[dict]) -> list[str]:
    """The "- target" lines of issue 23 for every gpt-oss layer in `rows`: met or missed, with the numbers."""
    lines = []
    for name in dict.fromkeys(r["layer"] for r in rows if LAYERS[r["layer"]].biased):
        mine = {r["m"]: r for r in rows if r["layer"] == name}
        for what, want, ms, key, unit in (
                (f"M = 1 >= {TARGET_READ_PCT:g} % of the read ceiling over the hit experts' bytes", TARGET_READ_PCT,
                 TARGET_READ_MS, "pct_read_ceiling", " %"),
                (f"M = 1-32 >= {TARGET_FP16_X:g}x the faster fp16 formulation", TARGET_FP16_X, TARGET_FP16_MS,
                 "fp16_over_qpn", "x")):
            got = {m: mine[m][key] for m in ms if m in mine}
            if not got:
                lines.append(f"- target {name} {what}: not measured (M = {', '.join(map(str, ms))} not in --ms)")
                continue
            missed = [m for m, v in got.items() if v < want]
            verdict = "met" if not missed else f"missed at M = {', '.join(map(str, missed))}"
            absent = [m for m in ms if m not in got]
            lines.append(f"- target {name} {what}: " + ", ".join(f"M={m} {v:.2f}{unit}" for m, v in got.items())
                         + f": {verdict}" + (f" (M = {', '.join(map(str, absent))} not measured)" if absent else ""))
    return lines


COLUMNS = (("layer", "layer", "{}"), ("format", "format", "{}"), ("m", "M", "{}"),
           ("experts_hit", "experts hit", "{}"), ("hit_mb", "hit MB", "{:.0f}"), ("qpn_us", "qpn us", "{:.1f}"),
           ("pct_read_ceiling", "% read ceiling", "{:.1f}"),
           ("qpn_eager_us", "qpn eager us", "{:.1f}"), ("fp16_bmm_us", "fp16 bmm us", "{:.1f}"),
           ("fp16_loop_us", "fp16 loop us", "{:.1f}"), ("loop_us", "loop of qpn dense ops us", "{:.1f}"),
           ("fp16_over_qpn", "fp16 / qpn", "{:.2f}"), ("loop_over_qpn", "loop / qpn", "{:.2f}"),
           ("rel_err_vs_fp16", "qpn vs fp16 rel. err", "{:.1e}"))


def render_markdown(result: dict) -> str:
    """The run as markdown: what ran, the rows, the per-kernel times, the targets."""
    lines = [f"# MoE layers on the {result['device']}: qpn's fused MoE op vs fp16 experts", "",
             f"Run: `python benchmarks/bench_moe.py {' '.join(result['argv'])}`; torch {result['torch']}. qpn: the op "
             "replayed from a CUDA graph of 10 calls (GPU time per call between CUDA events); qpn eager: called from "
             "Python. fp16 bmm: fp16 experts gathered per (token, choice), two bmm, graph-replayed (only where the "
             f"gathered weights fit in {GATHER_BYTES / 1e9:g} GB); fp16 loop: transformers' experts loop, eager; "
             "fp16 / qpn uses the faster of the two. loop: qpn's dense ops per hit expert, eager. gpt-oss layers: "
             "MXFP4 experts (QPNMX) with float32 biases and the clamped SwiGLU; both fp16 formulations add the biases "
             "and apply the same SwiGLU, on the exact fp16 decode of the same weights (qpn vs fp16 rel. err: the "
             "check before timing). % read ceiling: the hit experts' packed bytes (biases included) over qpn's time, "
             f"against {READ_CEILING_GBPS:g} GB/s.", "",
             "| " + " | ".join(header for _, header, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in result["rows"]:
        lines.append("| " + " | ".join("-" if row.get(key) is None else fmt.format(row[key])
                                       for key, _, fmt in COLUMNS) + " |")
    kernels = [r for r in result["rows"] if "kernels_us" in r]
    if kernels:
        lines += ["", f"Per kernel (torch.profiler, GPU us per eager call, {PROFILED_CALLS} calls):", ""]
        for r in kernels:
            each = "; ".join(f"{k[:60]} {v:.1f}" for k, v in r["kernels_us"].items())
            lines.append(f"- {r['layer']} {r['format']} M={r['m']}: sum {sum(r['kernels_us'].values()):.1f} "
                         f"(graph {r['qpn_us']:.1f}): {each}")
    if result.get("targets"):
        lines += ["", "Targets of issue 23 (measured in this run):", "", *result["targets"]]
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path, name: str, markdown: bool) -> None:
    """NAME.json (and NAME.md) in `out`, each through bench_kernels.write_atomic."""
    out.mkdir(parents=True, exist_ok=True)
    bk.write_atomic(out / f"{name}.json", json.dumps(result, indent=1))
    if markdown:
        bk.write_atomic(out / f"{name}.md", render_markdown(result))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--ms", default=None,
                        help="comma-separated M (default: each layer's, 1,8,32,64,512,2048; gpt-oss 1,8,32,512)")
    parser.add_argument("--layers", default="qwen3,mixtral", help="comma-separated of " + ",".join(LAYERS))
    parser.add_argument("--name", default=None,
                        help="results NAME.json / NAME.md (default moe_h200; gpt_oss_moe_h200 with a gpt-oss layer)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    layers = [layer.strip() for layer in args.layers.split(",") if layer.strip()]
    unknown = [layer for layer in layers if layer not in LAYERS]
    if unknown or not layers:
        print(f"bench_moe.py: --layers must name some of {','.join(LAYERS)}, got {args.layers!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_moe.py needs a CUDA GPU (its timings are CUDA graphs and events); on a CPU, "
              "tests/test_bench_gpt_oss.py runs its layers, baselines and the op at tiny shapes", file=sys.stderr)
        return 3
    gpt_oss = any(LAYERS[layer].biased for layer in layers)
    name = args.name or ("gpt_oss_moe_h200" if gpt_oss else "moe_h200")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    if gpt_oss:
        result["argv"] = sys.argv[1:] if argv is None else list(argv)
    for layer in layers:
        ms = [int(m) for m in args.ms.split(",")] if args.ms else list(LAYERS[layer].ms)
        result["rows"] += bench_layer(layer, ms, gen)
        if gpt_oss:
            result["targets"] = targets(result["rows"])
        write(result, args.out, name, gpt_oss)  # after every layer: a timeout keeps the finished ones
    for line in result.get("targets", []):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
