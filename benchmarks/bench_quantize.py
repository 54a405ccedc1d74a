"""`qpn quantize` speed and memory on a synthetic Llama-3.1-8B-shaped bf16 checkpoint (CPU).

Writes the checkpoint (random bf16 weights, one shard per decoder layer, the embeddings and lm_head in
their own shard; --layers / --vocab scale it down), then runs `qpn quantize` for each format and method in a
child process and reports MB of source per second and the child's peak RSS (its own
resource.getrusage(RUSAGE_SELF).ru_maxrss, read at its end). Targets (issue 39): rtn >= 100 MB/s on a
2-core machine, peak RSS <= 2 GB, mse within 10x rtn's time.

    python benchmarks/bench_quantize.py --layers 2 --vocab 32000 --out benchmarks/results/quantize_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from qpn.checkpoints.safetensors_io import StoredTensor, write_safetensors

HIDDEN, INTERMEDIATE, KV = 4096, 14336, 1024  # Llama-3.1-8B: 32 heads of 128, 8 KV heads
LAYER_SHAPES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN),
                "self_attn.v_proj": (KV, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
                "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
                "mlp.up_proj": (INTERMEDIATE, HIDDEN), "mlp.down_proj": (HIDDEN, INTERMEDIATE)}
# The child's peak RSS is its address space's high-water mark (VmHWM, reset by exec), not getrusage's
# ru_maxrss: Linux carries ru_maxrss across fork + exec, so it would report this parent's peak (writing the
# model) whenever that is higher.
CHILD = ("import sys; from qpn.apps.cli import main; rc = main(sys.argv[1:]); "
         "print('peak_kib', [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0]); "
         "sys.exit(rc)")


def bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> StoredTensor:
    """Random bf16 bit patterns: sign, exponents 2^-8 .. 2^-5, a random 7-bit mantissa (finite, fast to make)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return StoredTensor((bits & 0x80FF) | 0x3B00, "BF16")  # 0x80FF: sign, 1 exponent bit, mantissa


def write_model(folder: str, layers: int, vocab: int) -> int:
    rng = np.random.default_rng(0)
    weight_map: dict[str, str] = {}
    total = 0
    files = layers + 1
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        if i == layers:
            tensors = {"model.embed_tokens.weight": bf16(rng, (vocab, HIDDEN)),
                       "lm_head.weight": bf16(rng, (vocab, HIDDEN)),
                       "model.norm.weight": StoredTensor(np.full(HIDDEN, 0x3F80, np.uint16), "BF16")}
        else:
            tensors = {f"model.layers.{i}.{name}.weight": bf16(rng, shape) for name, shape in LAYER_SHAPES.items()}
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"model.layers.{i}.{norm}.weight"] = StoredTensor(np.full(HIDDEN, 0x3F80, np.uint16), "BF16")
        write_safetensors(os.path.join(folder, file), tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.nbytes for t in tensors.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": vocab, "torch_dtype": "bfloat16"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return total


def run(src: str, out: str, fmt: str, method: str, qpn_parent: str | None) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of `qpn quantize` in a child; qpn_parent: a folder whose `qpn` the child
    imports instead of this one (--baseline)."""
    env = dict(os.environ, PYTHONPATH=qpn_parent) if qpn_parent else None
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, "quantize", src, out, "--format", fmt, "--method", method,
                           "-q", "--overwrite"], capture_output=True, text=True, check=False, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"qpn quantize {fmt} {method} failed ({done.returncode}): {done.stderr.strip()}")
    rss = int(done.stdout.split("peak_kib")[-1].split()[0]) * 1024
    shutil.rmtree(out)  # the next run's disk space
    return seconds, rss


def baseline_parent(work: str, commit: str) -> str:
    """A folder holding `qpn` as it was at `commit` (git archive of this repository)."""
    parent = os.path.join(work, "baseline")
    os.makedirs(os.path.join(parent, "qpn"))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", repo, "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", os.path.join(parent, "qpn")], input=archive, check=True)
    return parent


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32, help="decoder layers (8B: 32)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary (8B: 128256)")
    p.add_argument("--runs", default="nvfp4:rtn,nvfp4:mse,fp8:rtn", help="FORMAT:METHOD,...")
    p.add_argument("--work", help="folder for the checkpoints (default: a temporary one)")
    p.add_argument("--out", help="append the markdown table to this file")
    p.add_argument("--baseline", metavar="COMMIT", help="also time qpn as it was at this commit, same source")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        src = os.path.join(work, "src")
        os.makedirs(src)
        size = write_model(src, args.layers, args.vocab)
        load = os.getloadavg()[0]
        lines = [f"`qpn quantize`, {args.layers} Llama-3.1-8B layers + vocab {args.vocab}: {size / 1e6:.0f} MB of bf16 "
                 f"source; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
                 f"{load:.1f} at the start; python {platform.python_version()}, numpy {np.__version__}", "",
                 "| qpn | format | method | seconds | MB/s of source | peak RSS (MB) |", "|---|---|---|---|---|---|"]
        versions = [("this tree", None)]
        if args.baseline:
            versions.insert(0, (args.baseline, baseline_parent(work, args.baseline)))
        for item in args.runs.split(","):
            fmt, method = item.split(":")
            for label, parent in versions:
                seconds, rss = run(src, os.path.join(work, f"out-{fmt}-{method}"), fmt, method, parent)
                lines.append(f"| {label} | {fmt} | {method} | {seconds:.1f} | {size / 1e6 / seconds:.1f} | "
                             f"{rss / 1e6:.0f} |")
                print(lines[-1], flush=True)
        lines.append(f"load average at the end {os.getloadavg()[0]:.1f}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
