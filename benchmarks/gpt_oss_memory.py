"""gpt-oss-20b's resident memory on a T4 under qpn (issue 23): a calculation from the model's shapes, no GPU.

    python benchmarks/gpt_oss_memory.py [--out benchmarks/results]

Prints, and writes <out>/gpt_oss_memory.md (bench_kernels.write_atomic), the bytes a T4 holds for
gpt-oss-20b served by qpn at batch 1 and contexts 4k, 16k, 32k and 128k, the headroom left, and the longest
context that fits.

The model: openai/gpt-oss-20b's config.json (https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json;
values checked against a copy of it, EchoCog/gpt-oss-20b config.json at 52971a17, and NVIDIA Megatron-Bridge's
GPT-OSS 20B page): hidden 2880, 24 layers, 64 heads of 64, 8 KV heads, 32 local experts, top-4,
expert intermediate 2880, vocab 201088, untied lm_head, sliding window 128 on the even layers
(layer_types alternates sliding_attention, full_attention: 12 of each), max_position_embeddings 131072.

What each part costs under qpn (docs/QPNMX.md; qpn.ref.formats.QPNMX gives the buffer shapes used here):
- experts, MXFP4 as QPNMX: per weight [N, K], codes N * K/2 bytes, scales N * K/32 bytes (one e8m0 byte per
  32), tile_scale 4 bytes per 32-row tile; gate_up [2I, H] and down [H, I] per expert; biases float32
  (gpt-oss stores them bf16; qpn's MoE ops take float32).
- attention (q, k, v, o and their biases, the sinks), router, embeddings, lm_head, norms: fp16 (gpt-oss keeps
  them bf16, modules_to_not_convert; a T4 has no bf16 arithmetic worth using, docs/TURING.md).
- KV cache, fp16, per sequence: K and V of 8 heads x 64 = 2 KiB per token per layer; a full-attention layer
  holds the whole context, a sliding layer at most its 128-token window.

The T4's budget: 16 GiB of GDDR6 with ECC on takes 6.25 % for the ECC bits (CUDA C++ Best Practices Guide,
quoted in https://forums.developer.nvidia.com/t/nvidia-t4-has-only-15g-of-memory/173099), leaving 15.0 GiB
(15360 MiB), the figure used for the headroom. What CUDA reports on real T4s is a little less: 15110 MiB
(15,843,721,216 bytes, 14.76 GiB, a deviceQuery listing) or 15079 MiB (nvidia-smi in that forum thread); the
longest context is given for 14.76 GiB too. Not counted (so the headroom is what these must fit in): the CUDA
context, activations and workspaces, the sampler's logits, vLLM's block rounding and CUDA graphs. docs/TURING.md
states no memory capacity.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from qpn.benchmarks import bench_kernels as bk  # (write_atomic)

GIB = 1 << 30
GPT_OSS_20B = {"hidden": 2880, "layers": 24, "heads": 64, "kv_heads": 8, "head_dim": 64, "experts": 32, "top_k": 4,
               "intermediate": 2880, "vocab": 201088, "sliding_window": 128, "max_context": 131072}
FULL_LAYERS = SLIDING_LAYERS = GPT_OSS_20B["layers"] // 2  # layer_types alternates, sliding first
FP16, FP32 = 2, 4
T4_USABLE_GIB = 15.0  # 16 GiB less ECC's 6.25 % (module docstring)
T4_CUDA_TOTAL_BYTES = 15_843_721_216  # what cudaMemGetInfo / deviceQuery reports on a T4 (module docstring)
CONTEXTS = (4096, 16384, 32768, 131072)


def qpnmx_bytes(n: int, k: int) -> int:
    """The packed bytes of one MXFP4 weight [n, k] in QPNMX (codes, scales, tile_scale)."""
    from qpn.ref.formats import QPNMX

    QPNMX.require_dims(n, k)
    return sum(math.prod(buf.shape(n, k)) * buf.dtype.itemsize for buf in QPNMX.buffers)


def weight_bytes(m: dict) -> dict[str, int]:
    """Resident weight bytes by part (module docstring)."""
    h, inter, e, layers = m["hidden"], m["intermediate"], m["experts"], m["layers"]
    q, kv = m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"]
    attention = (q * h + q) + 2 * (kv * h + kv) + (h * q + h) + m["heads"]  # q, k, v, o with biases; sinks
    return {
        "experts, MXFP4 (QPNMX codes + scales + tile scales)": layers * e * (qpnmx_bytes(2 * inter, h)
                                                                             + qpnmx_bytes(h, inter)),
        "experts' biases (float32)": layers * e * (2 * inter + h) * FP32,
        "attention (fp16)": layers * attention * FP16,
        "router (fp16)": layers * (e * h + e) * FP16,
        "embeddings (fp16)": m["vocab"] * h * FP16,
        "lm_head (fp16)": m["vocab"] * h * FP16,
        "norms (fp16)": (2 * layers + 1) * h * FP16,
    }


def kv_bytes_per_token_per_layer(m: dict) -> int:
    return 2 * m["kv_heads"] * m["head_dim"] * FP16  # K and V


def kv_bytes(m: dict, context: int, batch: int = 1) -> int:
    """fp16 KV cache of `batch` sequences of `context` tokens: full layers hold it all, sliding ones the window."""
    per = kv_bytes_per_token_per_layer(m)
    return batch * per * (FULL_LAYERS * context + SLIDING_LAYERS * min(context, m["sliding_window"]))


def max_context(m: dict, weights: int, budget: int) -> int:
    """The longest context (batch 1) whose weights + KV cache fit `budget` bytes, at most max_context."""
    per_token = kv_bytes_per_token_per_layer(m) * FULL_LAYERS
    sliding = kv_bytes_per_token_per_layer(m) * SLIDING_LAYERS * m["sliding_window"]  # the windows, full
    return max(0, min(m["max_context"], (budget - weights - sliding) // per_token))


def report(m: dict) -> str:
    parts = weight_bytes(m)
    weights = sum(parts.values())
    usable = int(T4_USABLE_GIB * GIB)
    per_token = kv_bytes_per_token_per_layer(m) * FULL_LAYERS
    sliding = kv_bytes_per_token_per_layer(m) * SLIDING_LAYERS * m["sliding_window"]
    lines = ["# gpt-oss-20b on a T4: resident memory under qpn", "",
             "Computed by benchmarks/gpt_oss_memory.py from openai/gpt-oss-20b's shapes (its docstring: sources, what "
             f"each part costs, what is not counted). Usable T4 memory: {T4_USABLE_GIB:.1f} GiB (16 GiB less ECC's "
             f"6.25 %); CUDA reports {T4_CUDA_TOTAL_BYTES / GIB:.2f} GiB on real T4s.", "",
             "| weights | bytes | GiB |", "|---|---|---|"]
    lines += [f"| {name} | {n:,} | {n / GIB:.3f} |" for name, n in parts.items()]
    lines += [f"| **all weights** | {weights:,} | **{weights / GIB:.2f}** |", "",
              f"KV cache (fp16, batch 1): {per_token / 1024:.0f} KiB per token on the {FULL_LAYERS} full-attention "
              f"layers ({per_token * 1024 / (1 << 20):.0f} MiB per 1k = 1024 tokens) + {sliding / (1 << 20):.0f} MiB "
              f"for the {SLIDING_LAYERS} sliding layers' {m['sliding_window']}-token windows.", "",
              f"| context | weights GiB | KV cache GiB | total GiB | headroom on {T4_USABLE_GIB:.1f} GiB |",
              "|---|---|---|---|---|"]
    for context in CONTEXTS:
        kv = kv_bytes(m, context)
        lines.append(f"| {context // 1024}k | {weights / GIB:.2f} | {kv / GIB:.2f} | {(weights + kv) / GIB:.2f} | "
                     f"{(usable - weights - kv) / GIB:+.2f} |")
    fits, fits_cuda = max_context(m, weights, usable), max_context(m, weights, T4_CUDA_TOTAL_BYTES)
    lines += ["", f"Longest context at batch 1: {fits:,} tokens on {T4_USABLE_GIB:.1f} GiB, {fits_cuda:,} on "
                  f"{T4_CUDA_TOTAL_BYTES / GIB:.2f} GiB (before the CUDA context, activations and workspaces).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=bk.DEFAULT_OUT)
    args = parser.parse_args(argv)
    text = report(GPT_OSS_20B)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    bk.write_atomic(args.out / "gpt_oss_memory.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
