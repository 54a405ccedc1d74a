"""Where the linears of a decode step spend their time: the kernels of bench_model's LinearsAlone (every decoder
linear of the Llama-3.1-8B-shaped model and lm_head once on [batch, K]) under torch.profiler, per format and
batch (a GPU script; issue 25 part 5).

    python benchmarks/model_linears_profile.py [--batches 1,32] [--layers 32] [--out benchmarks/results]

Per (format, batch): the step's linears captured in one CUDA graph and timed as bench_model times them
(graph ms), then the same calls run eagerly under torch.profiler for PROFILED steps: each kernel name's launches
per step and device us per step, and their sum (kernel ms). graph ms - kernel ms is what the graph spends
between kernels (launch and drain of ~7 x 32 + 1 serial kernels and their helpers), which a faster kernel body
cannot remove. Writes NAME.md / NAME.json (bench_kernels.write_results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from qpn.benchmarks import bench_kernels as bk
from qpn.benchmarks import bench_model as bm

PROFILED = 5  # eager steps under the profiler
TOP = 6  # kernel names listed per row


def new_section() -> bk.Section:
    return bk.Section("linears", "The linears of one decode step alone: graph time and eager kernel time", [
        bk.Column("format", "format"), bk.Column("batch", "batch"), bk.Column("graph_ms", "graph ms", "{:.3f}"),
        bk.Column("kernel_ms", "kernel ms", "{:.3f}"), bk.Column("gap_ms", "graph - kernel ms", "{:.3f}"),
        bk.Column("launches", "kernels / step", "{:.0f}"), bk.Column("top", "kernels by device time (n x us)"),
    ])


def write(env: dict, sec: bk.Section, out: Path, name: str) -> tuple:
    """NAME.json through bench_kernels.write_results; NAME.md with this script's own header."""
    json_path, md_path = bk.write_results(env, [sec], out, name)
    header = (f"# The linears of a decode step: {env['gpu']}\n\n{env['date']}; torch {env['torch']}, CuPy "
              f"{env['cupy']}; kernels built as {env['kernel_build']['built_as']}. {env['model_class']} with "
              f"Llama-3.1-8B's dims, {env['model']['num_hidden_layers']} layers, every layer its own copy of the "
              "weights (a step streams them all: no L2 reuse between steps); benchmarks/model_linears_profile.py.")
    bk.write_atomic(md_path, header + "\n" + bk.render_markdown(env, [sec]).split("\n", 3)[-1])
    return json_path, md_path


def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="model_linears_profile.py", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--out", type=Path, default=bk.DEFAULT_OUT)
    parser.add_argument("--name", default="model_linears_h200")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    shape = bm.MODELS["llama8b"]
    layers = args.layers or shape.dims["num_hidden_layers"]
    env = bm.environment(device, shape.dims, layers, shape)
    model = bm.build_model(shape.dims, layers, device, shape)
    linears = bm.variants(model, shape)
    sec = new_section()
    for batch in (int(b) for b in args.batches.split(",")):
        for fmt in shape.formats:
            bm.install(model, linears[fmt])
            alone = bm.LinearsAlone(model, shape, batch, device)
            run, _, _ = bm.replayable(alone, device)
            graph_ms = statistics.median(bm.time_steps(run, device, bm.STEPS, bm.REPEATS)) * 1e3
            del run
            times = bk.profiled_kernels(alone.step, PROFILED)
            kernel_ms = sum(us for _, us in times.values()) / 1e3
            top = sorted(times.items(), key=lambda kv: -kv[1][1])[:TOP]
            row = {"format": fmt, "batch": batch, "graph_ms": graph_ms, "kernel_ms": kernel_ms,
                   "gap_ms": graph_ms - kernel_ms, "launches": sum(n for n, _ in times.values()),
                   "top": "; ".join(f"{name[:48]} {n:.0f} x {us / n:.1f}" for name, (n, us) in top)}
            sec.rows.append(row)
            print(f"{fmt:6s} batch {batch:3d} graph {graph_ms:.3f} ms kernels {kernel_ms:.3f} ms "
                  f"({row['launches']:.0f} / step): {row['top']}", flush=True)
    sec.notes.append("graph ms: LinearsAlone captured in one CUDA graph, median of bench_model's REPEATS x STEPS "
                     "replays; kernel ms: the sum of the device time of every kernel of an eager step under "
                     f"torch.profiler ({PROFILED} steps averaged); n x us: launches per step x mean us per launch.")
    json_path, md_path = write(env, sec, args.out, args.name)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
