"""`qpn verify` speed on the CPU: seconds per GB of checkpoint, per format, and where the time goes.

    python benchmarks/bench_verify.py [--blocks 2] [--formats nvfp4,fp8] [--profile] [--keep DIR]

Builds synthetic ModelOpt checkpoints of Llama-3-8B decoder blocks (per block: q/o 4096x4096,
k/v 1024x4096, gate/up 14336x4096, down 4096x14336; 218 M weights: 123 MB NVFP4, 219 MB FP8 per
channel), packs each with `qpn pack`, then times `qpn verify` on the packed folder, exactly as the
command runs it (every backend present: numpy reference, numba CPU; CUDA if there is one), and
checks that every layer verified before reporting a time. --profile adds the top functions by
cumulative time. Target (issue 12): <= 30 s per GB on 2 cores.

Weights: random codes (NVFP4 nibbles; FP8 e4m3 bytes without the NaN codes 0x7F / 0xFF), NVFP4
block scales 0x28..0x5F (2^-2..30) times g = 1e-3, FP8 per-channel scales 1e-3..2e-3: every
value finite and inside fp16, as a real export's are.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import shutil
import sys
import tempfile
import time

import numpy as np

LLAMA_BLOCK = {  # module -> (N, K) of one Llama-3-8B decoder block
    "self_attn.q_proj": (4096, 4096), "self_attn.k_proj": (1024, 4096), "self_attn.v_proj": (1024, 4096),
    "self_attn.o_proj": (4096, 4096), "mlp.gate_proj": (14336, 4096), "mlp.up_proj": (14336, 4096),
    "mlp.down_proj": (4096, 14336),
}
E4M3_NAN = (0x7F, 0xFF)


def synthetic_checkpoint(fmt: str, blocks: int, seed: int = 0):
    """A qpn.ref.Checkpoint (ModelOpt NVFP4 or FP8 per channel) of `blocks` Llama-3-8B decoder blocks."""
    from qpn import ref

    rng = np.random.default_rng(seed)
    linears = {}
    for b in range(blocks):
        for module, (n, k) in LLAMA_BLOCK.items():
            name = f"model.layers.{b}.{module}"
            if fmt == "nvfp4":
                codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
                scales = rng.integers(0x28, 0x60, (n, k // 16), dtype=np.uint8)
                linears[name] = ref.NVFP4Linear(name, codes, scales, np.float32(1e-3))
            else:
                codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
                codes[np.isin(codes, E4M3_NAN)] = 0x00
                scale = rng.uniform(1e-3, 2e-3, n).astype(np.float32)
                linears[name] = ref.FP8Linear(name, codes, scale, "channel")
    algo = "NVFP4" if fmt == "nvfp4" else "FP8_PER_CHANNEL_PER_TOKEN"
    return ref.Checkpoint("modelopt", algo, linears, {}, {"architectures": ["LlamaForCausalLM"]})


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def measure(fmt: str, blocks: int, root: str, profile: bool) -> dict:
    from qpn import ref
    from qpn.apps import verify
    from qpn.checkpoints import packed as packing

    original, packed_dir = os.path.join(root, f"{fmt}"), os.path.join(root, f"{fmt}-qpn")
    ref.save_checkpoint(original, synthetic_checkpoint(fmt, blocks))
    packing.pack_checkpoint(original, packed_dir)
    shutil.rmtree(original)
    backends = verify.Backends.find()
    source = verify.open_source(packed_dir, check_values=False)
    warm = verify.Source(packed_dir, True, source.checkpoint)  # compile the numba kernels outside the timing
    first = source.layer_names[:1]
    verify.verify_layer(first[0], warm, backends, verify.DEFAULT_MS, verify.DEFAULT_SEED, False)

    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    source = verify.open_source(packed_dir, check_values=False)
    results, other = verify.verify_source(source, backends=backends)
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - start
    failed = [r.name for r in results if not r.ok] + other
    if failed:
        raise SystemExit(f"verify failed on the synthetic {fmt} checkpoint: {failed[:3]}; not timing a broken run")
    gb = folder_bytes(packed_dir) / 1e9
    row = {"format": fmt, "layers": len(results), "GB": gb, "s": seconds, "s/GB": seconds / gb,
           "backends": sorted(backends.devices)}
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(18)
        row["profile"] = out.getvalue()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=2, help="Llama-3-8B decoder blocks per checkpoint")
    parser.add_argument("--formats", default="nvfp4,fp8", help="comma-separated: nvfp4, fp8")
    parser.add_argument("--profile", action="store_true", help="print the top functions by cumulative time")
    parser.add_argument("--keep", metavar="DIR", help="build the checkpoints in DIR (default: a temporary folder)")
    args = parser.parse_args(argv)

    import numba
    import torch

    import qpn

    print(f"qpn {qpn.__version__}, numpy {np.__version__}, torch {torch.__version__}, numba {numba.__version__}, "
          f"python {platform.python_version()}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores (torch threads {torch.get_num_threads()})")
    shapes = ", ".join(f"{n}x{k}" for n, k in LLAMA_BLOCK.values())
    print(f"checkpoint: {args.blocks} Llama-3-8B decoder block(s) of {shapes} (N x K)")
    root = args.keep or tempfile.mkdtemp(prefix="qpn-bench-verify-")
    os.makedirs(root, exist_ok=True)
    try:
        rows = [measure(fmt, args.blocks, root, args.profile) for fmt in args.formats.split(",")]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("| format | layers | packed GB | verify s | s per GB | backends |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['layers']} | {r['GB']:.3f} | {r['s']:.1f} | {r['s/GB']:.1f} | "
              f"{', '.join(r['backends'])} |")
    for r in rows:
        if "profile" in r:
            print(f"\n{r['format']}:\n{r['profile']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
