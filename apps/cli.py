"""`qpn`: the command line (console script `qpn`, also `python -m qpn`; both start in apps/entry.py, which
holds the stop signals during the imports of this module).

    qpn pack CHECKPOINT_DIR OUT_DIR [--overwrite]   prepack a ModelOpt / compressed-tensors checkpoint
    qpn verify PATH [--upstream] [--m 1,40]         check every layer on every backend present
    qpn inspect PATH                                per-layer table: format, shape, scales, bytes, packability
    qpn inspect [PATH] --dispatch [--family F]      the kernel path of each call shape, per device family
    qpn quantize SRC OUT --format F [--method M]    quantize a Hugging Face float model (weight-only)
    qpn bench [kernels|decode|model] [ARGS...]      the kernel / model benchmarks (GPU only)
    qpn demo [--device auto|cpu|cuda] [--keep DIR]  all-MiniLM-L6-v2 end to end

PATH is an original checkpoint folder or a packed one (`qpn pack` output, see checkpoints/packed/).
Every command takes -q/--quiet (no progress bars; bars are also off when stderr is not a terminal).

Exit codes: 0 success; 1 a check failed (verify found a mismatch, the demo's parity is off); 2 bad
input (wrong arguments - each checked by the parser, apps/arguments.py -, a missing folder, a folder
that is not a checkpoint or holds no quantized layer, a layer that cannot be packed, an output folder
qpn may not replace) - reported as one clear message, never a traceback; 3 the machine lacks what the
command needs (`qpn bench` without a CUDA GPU, `qpn demo --device cuda` without one, the demo's model
package missing); 128 + the signal when stopped: 130 Ctrl-C (SIGINT), 143 SIGTERM, 129 SIGHUP - each
removes the temporary folder of a write in progress first (during start-up there is none: one line,
and out), except after `qpn pack`'s commit point (the swap that puts the new folder in place): the pack
has succeeded, so a stop signal then is only noted and the pack finishes, exit 0; 141 when the reader
of stdout went away (`qpn verify ... | head`: stops at the next line, quietly, as a CLI killed by SIGPIPE
would).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING

import numpy as np

from .. import __version__, checkpoints, ref
from ..checkpoints import packed as packing
from ..checkpoints.atomic import TargetError
from ..checkpoints.packed import PackError
from ..ref.formats import QPN2, QPN8, QPNMX
from .arguments import Parser, device_family, integer_in, integers_in, path_name
from .output import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_NO_HARDWARE,
    EXIT_OK,
    EXIT_SIGNAL_BASE,
    UsageError,
    format_table,
    plural,
    progress_bars,
    size_text,
)
from .verify import (
    DEFAULT_MS,
    DEFAULT_SEED,
    MAX_M,
    MAX_SEED,
    Backends,
    VerifyTable,
    cuda_status,
    format_name,
    open_source,
    require_quantized_layers,
    verify_report_head,
    verify_report_tail,
    verify_source,
)

if TYPE_CHECKING:  # annotations only: torch is imported where a command needs it (the reference runs without)
    pass

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
# Set at the running command's commit point (qpn pack: the new folder is in place, atomic_folder's on_commit):
# from then on its result is success, and a stop signal is only noted (`_stop_signals_raise`).
_committed = threading.Event()
# `qpn bench [WHICH] [ARGS...]` -> the module of qpn.benchmarks it runs (installed with qpn: any install runs it)
BENCH_MODULES = {"kernels": "bench_kernels", "decode": "bench_decode", "model": "bench_model"}

# what `main` turns into "qpn CMD: error: ..." and exit 2 (bad input, never a traceback)
INPUT_ERRORS = (checkpoints.CheckpointError, checkpoints.SafetensorsError, PackError, TargetError, OSError)


class Stopped(BaseException):
    """SIGTERM / SIGHUP arrived: unwinds like KeyboardInterrupt, so `finally` blocks clean up."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _progress_of(args: argparse.Namespace) -> Callable:
    return progress_bars(not args.quiet and sys.stderr.isatty())


def _scale_summary(values: np.ndarray) -> str:
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    lo, hi = float(values.min()), float(values.max())
    return f"{lo:.6g}" if lo == hi else f"{lo:.4g}..{hi:.4g}"


# ----------------------------------------------------------------------------------------------
# qpn inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    if args.dispatch:
        return _inspect_dispatch(args)
    if args.path is None:
        raise UsageError("qpn inspect needs PATH (a checkpoint folder), or --dispatch")
    source = open_source(args.path)
    require_quantized_layers(source)
    c = source.checkpoint
    rows = []
    quantized_bytes = 0
    for name in source.layer_names:
        if isinstance(c, packing.PackedCheckpoint):  # the buffers as stored
            layer = c.layers[name]
            n, k = layer.n, layer.k
            fmt, granularity, n_padded = layer.format, layer.granularity, layer.n_padded
            wf = layer.weight_format
            scale = (layer.nvfp4_global_scale()[:1] if wf is QPN2 else
                     layer.arrays[packing.TILE_SCALE] if wf is QPNMX else layer.fp8_weight_scale())
            nbytes = sum(a.nbytes for a in layer.buffers().values())
            status = f"packed {layer.entry['layout']}"
        else:  # the checkpoint's tensors, and whether `qpn pack` can take them
            linear = c.linears[name]
            n, k = linear.n, linear.k
            fmt, granularity, n_padded = linear.weight_format.format, getattr(linear, "granularity", None), \
                packing.padded_rows(linear)
            scale = (linear.global_scale if isinstance(linear, checkpoints.NVFP4Linear) else
                     linear.tile_scale() if isinstance(linear, checkpoints.MXFP4Linear) else linear.weight_scale)
            nbytes = sum(t.nbytes for t in packing.source_tensors(linear).values())
            reason = packing.unpackable_reason(linear)
            status = f"cannot pack: {reason}" if reason else f"ok ({linear.weight_format.layout})"
        if n_padded != n and not status.startswith("cannot"):
            status += f", N padded to {n_padded}"
        quantized_bytes += nbytes
        rows.append((name, format_name(fmt, granularity), str(n), str(k), _scale_summary(scale),
                     size_text(nbytes), status))
    for name, mx in getattr(c, "experts", {}).items():  # stacked experts (gpt-oss's MXFP4): one row per projection
        for stem, (n, k) in (("w13", (2 * mx.intermediate, mx.hidden)), ("w2", (mx.hidden, mx.intermediate))):
            blocks, scales, bias = (getattr(mx, f"{stem}_{part}") for part in ("blocks", "scales", "bias"))
            nbytes = blocks.nbytes + scales.nbytes + bias.nbytes
            quantized_bytes += nbytes
            top = ref.mxfp4.mxfp4_tile_exponents(scales).astype(np.float64)  # each tile's T: 2^T leaves W16 in fp16
            rows.append((f"{name}.{stem}", f"mxfp4 x{mx.experts}", str(n), str(k), _scale_summary(np.exp2(top)),
                         size_text(nbytes), "ok (QPNMX experts: load_quantized, vLLM; qpn pack: not yet)"))
    print(source.describe())
    print(format_table(("layer", "format", "N", "K", "global scale", "bytes", "status"), rows))
    other = sum(t.nbytes for t in c.tensors.values())
    counts: dict[str, int] = {}
    for row in rows:
        counts[row[1]] = counts.get(row[1], 0) + 1
    blocked = sum(row[6].startswith("cannot pack") for row in rows)
    print(f"{plural(len(rows), 'quantized layer')} ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}), "
          f"{size_text(quantized_bytes)}; {plural(len(c.tensors), 'other tensor')}, {size_text(other)}"
          + (f"; {plural(blocked, 'layer')} cannot be packed" if blocked else ""))
    print("(global scale: NVFP4 weight_scale_2 multiplier; FP8: the weight_scale, min..max over channels/blocks; "
          "MXFP4: the tiles' 2^T)")
    return EXIT_OK


def _inspect_dispatch(args: argparse.Namespace) -> int:
    """The dispatch policy's choices (torch_bridge/dispatch.py) per device family and layout: at the
    layer shapes of PATH if given, else at five model shapes."""
    from ..torch_bridge import dispatch

    families = [args.family] if args.family else dispatch.families()
    shapes: tuple[tuple[int, int], ...] = dispatch.DESCRIBE_SHAPES
    layouts = [QPN2, QPN8]
    if args.path is not None:
        source = open_source(args.path)
        require_quantized_layers(source)
        c = source.checkpoint
        layers = [c.quantized_layers[name] for name in source.layer_names]
        shapes = tuple(dict.fromkeys((layer.weight_format.padded_n(layer.n), layer.k) for layer in layers))
        layouts = list({layer.weight_format.key: layer.weight_format for layer in layers}.values())
    for family in families:
        for wf in layouts:
            print(dispatch.describe(family, wf, shapes=shapes))
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# qpn pack


def cmd_pack(args: argparse.Namespace) -> int:
    if not os.path.exists(args.checkpoint):  # the words of open_source (inspect, verify): one for a missing source
        raise UsageError(f"{args.checkpoint} does not exist; pass a checkpoint folder")
    if not os.path.isdir(args.checkpoint):
        raise UsageError(f"{args.checkpoint} is not a folder; pass the checkpoint folder "
                         "(config.json + model.safetensors or shards)")
    start = time.perf_counter()
    manifest = packing.pack_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite,
                                       progress=_progress_of(args), on_commit=_committed.set)
    seconds = time.perf_counter() - start
    counts: dict[str, int] = {}
    for entry in manifest["layers"].values():
        key = f"{entry['format'].upper()} -> {entry['layout']}"
        counts[key] = counts.get(key, 0) + 1
    files = sorted(os.listdir(args.out))
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    copied = manifest.get("copied_files", {})
    others = f" and {plural(len(copied), 'other file')}" if copied else ""
    print(f"packed {plural(len(manifest['layers']), 'layer')} "
          f"({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}), "
          f"copied {plural(len(manifest['tensors']), 'tensor')}{others} -> {args.out} ({plural(len(files), 'file')}, "
          f"{size_text(size)}) in {seconds:.1f} s")
    _, skipped = packing.source_extras(args.checkpoint)
    if skipped:  # the packed folder lacks these: say so, once
        print(f"qpn pack: warning: not copied into {args.out}: "
              + "; ".join(f"{entry} ({why})" for entry, why in skipped.items()), file=sys.stderr)
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# qpn verify


def _print_lines(lines: Sequence[str]) -> None:
    """`lines` to stdout in one write, flushed: under PYTHONUNBUFFERED print() writes a text and its newline
    apart, so a reader that leaves between the two (`qpn verify | head -3`) cut the report at a varying point."""
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()


def cmd_verify(args: argparse.Namespace) -> int:
    source = open_source(args.path, check_values=False)  # a bad value is reported as its layer's failure
    require_quantized_layers(source)
    backends = Backends.find()
    table = VerifyTable(source, args.upstream)
    _print_lines(verify_report_head(source, backends, args.m) + table.head())
    results, other = verify_source(source, ms=args.m, seed=args.seed, upstream=args.upstream,
                                   progress=_progress_of(args), backends=backends,
                                   on_result=lambda r: _print_lines([table.row(r)]))  # `| head` stops here
    _print_lines(verify_report_tail(source, results, other, args.upstream))
    return EXIT_OK if all(r.ok for r in results) and not other else EXIT_FAILED


# ----------------------------------------------------------------------------------------------
# qpn bench


def cmd_bench(args: argparse.Namespace) -> int:
    bench_args = list(args.bench_args)
    which = bench_args.pop(0) if bench_args and bench_args[0] in BENCH_MODULES else "kernels"
    module = importlib.import_module(f"..benchmarks.{BENCH_MODULES[which]}", __package__)
    parser = module.build_parser()
    parser.prog = f"qpn bench{'' if which == 'kernels' else ' ' + which}"
    parsed = parser.parse_args(bench_args)  # a mistyped argument is bad input (argparse exits 2) wherever it runs
    # `qpn bench model --device cpu` (with --tiny: the model benchmark's CPU run) needs no GPU; the rest time CUDA
    if getattr(parsed, "device", None) != "cpu":
        ok, detail = cuda_status(need_torch=which == "model")  # the model benchmark runs in torch too
        if not ok:
            print(f"qpn bench: needs a CUDA GPU, and this machine has none usable: {detail}.\n"
                  "The benchmark times the CUDA kernels; run it on a GPU machine (a Colab / Kaggle T4 works). "
                  "Nothing was measured.", file=sys.stderr)
            return EXIT_NO_HARDWARE
    return int(module.main(bench_args) or 0)


# ----------------------------------------------------------------------------------------------
# qpn demo


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    if args.keep:  # bad input before the model loads, in the command line's words (TargetError: exit 2)
        demo.check_keep(args.keep, "--keep")
    try:
        return demo.run(device=args.device, keep=args.keep, progress=_progress_of(args))
    except demo.DemoError as exc:  # the model package or the asked-for GPU is missing
        print(f"qpn demo: error: {exc}", file=sys.stderr)
        return EXIT_NO_HARDWARE


# ----------------------------------------------------------------------------------------------
# entry point


def _add_inspect(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("inspect", parents=[common], help="per-layer table of a checkpoint; --dispatch: the kernel "
                                                         "path each call takes",
                       description="Name, format, N, K, global scale(s), bytes and packability of every quantized "
                                   "layer of an original or packed checkpoint. With --dispatch: the path (decode, "
                                   "GEMM, dense; CPU fused or decode-then-BLAS) the linear ops take per layer shape "
                                   "and M, from the measured table of each device family (at PATH's layer shapes "
                                   "if given).")
    p.add_argument("path", metavar="PATH", nargs="?", type=path_name)
    p.add_argument("--dispatch", action="store_true", help="print the dispatch policy's choices")
    p.add_argument("--family", type=device_family,
                   help="with --dispatch: one device family (cpu, sm_90, ...; default: this machine's and every "
                        "measured one)")
    p.set_defaults(func=cmd_inspect)


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser = Parser(
        prog="qpn",
        description="NVFP4 / FP8 weight-only linears for GPUs without FP4/FP8 units: pack, verify and inspect "
                    "quantized checkpoints, quantize float models, benchmark the kernels, run the MiniLM demo.",
        epilog="Exit codes: 0 success, 1 a check failed, 2 bad input, 3 missing hardware (bench without a GPU); "
               "stopped: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (the temporary folder of a write is removed first; "
               "after qpn pack's swap, its commit point, a stop signal is only noted: exit 0), "
               "141 stdout closed (`qpn verify | head`).",
    )
    parser.add_argument("--version", action="version", version=f"qpn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("pack", parents=[common], help="prepack a checkpoint into the QPN2 / QPN8 layouts",
                       description="Read a ModelOpt (NVFP4 / FP8 / mixed) or compressed-tensors NVFP4 checkpoint, "
                                   "validate and prepack every quantized linear, and write a packed folder "
                                   "(safetensors + qpn_manifest.json) atomically. Same input, same bytes.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", type=path_name)
    p.add_argument("out", metavar="OUT_DIR", type=path_name)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR (atomically)")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("verify", parents=[common], help="check every layer on every backend present",
                       description="For an original or packed checkpoint: unpack every layer and compare it with "
                                   "the checkpoint's bytes, dequantize it on every backend present (numpy "
                                   "reference, numba CPU, CUDA) and require identical fp16 bytes, and run its "
                                   "linear on random activations against the exact reference. Stacked MXFP4 "
                                   "experts (gpt-oss) are one row per projection (w13, w2), each check run on "
                                   "every expert. Exit 1 on any mismatch.")
    p.add_argument("path", metavar="PATH", type=path_name)
    p.add_argument("--m", type=integers_in(1, MAX_M, "M", example="1,40"), default=DEFAULT_MS, metavar="M1,M2",
                   help=f"activation rows for the linear check (default {','.join(map(str, DEFAULT_MS))})")
    p.add_argument("--seed", type=integer_in(0, MAX_SEED, "the seed"), default=DEFAULT_SEED,
                   help=f"seed of the random activations, 0 to 2**64 - 1 (default {DEFAULT_SEED})")
    p.add_argument("--upstream", action="store_true",
                   help="also report how many weights upstream's decode roundings would change (NVFP4: "
                        f"{ref.UPSTREAM_VARIANTS.replace('%', '%%')}")
    p.set_defaults(func=cmd_verify)

    _add_inspect(sub, common)
    importlib.import_module(f"{__package__}.quantize_cmd").add_parser(sub, common)  # qpn quantize

    p = sub.add_parser("bench", parents=[common], help="kernel benchmark (needs a CUDA GPU)",
                       usage="qpn bench [-h] [kernels | decode | model] [SCRIPT ARGS...]",
                       description="Run benchmarks/bench_kernels.py (prepack, dequantize, dense path; the default) "
                                   "or benchmarks/bench_decode.py (the M <= 32 decode kernels) or "
                                   "benchmarks/bench_model.py (Llama-3.1-8B-shaped decode, tokens/s vs fp16). "
                                   "Every other argument goes to the script, e.g. `qpn bench --quick`, "
                                   "`qpn bench decode --quick --out results`.")
    p.set_defaults(func=cmd_bench, bench_args=[])  # the script's own arguments are taken as they come

    p = sub.add_parser("demo", parents=[common], help="all-MiniLM-L6-v2 end to end (the main job)",
                       description="Write all-MiniLM-L6-v2 as ModelOpt NVFP4 and FP8 checkpoints, pack and verify "
                                   "them, load them through qpn.torch_bridge, embed sentences and print parity "
                                   "(cosine vs fp32) and the total wall time: under a minute on a 2-core CPU, "
                                   "the first run included (numba compiles the CPU kernels once). No per-step "
                                   "timings: each step is too short to time stably; `qpn bench` times the kernels.")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs (auto: cuda when a usable GPU is present)")
    p.add_argument("--keep", metavar="DIR", type=path_name,
                   help="write the checkpoints into DIR (kept) instead of a temporary folder")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line, after apps/entry.py's start-up: parse (every argument checked there), run, and turn
    each way a command ends into its exit code and at most one line on stderr."""
    prog = "qpn"  # until the parser has read the command: a Ctrl-C while parsing is reported too
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "bench":
            parser.parse_args(argv)  # the usage error for the stray arguments, as argparse words it
        args.bench_args = extra
        prog = f"qpn {args.command}"
        with _stop_signals_raise():
            return args.func(args)
    except SystemExit as exc:  # argparse: --help / --version (0), a usage error (2, printed); `qpn bench`'s script's
        return int(exc.code or 0)
    except BrokenPipeError:  # the reader of stdout is gone (`| head`): stop quietly, as SIGPIPE would
        _stdout_to_devnull()
        return EXIT_SIGNAL_BASE + getattr(signal, "SIGPIPE", 13)
    except (UsageError, *INPUT_ERRORS) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_SIGNAL_BASE + signal.SIGINT
    except Stopped as exc:
        print(f"{prog}: stopped by {exc}", file=sys.stderr)
        return EXIT_SIGNAL_BASE + exc.signum


@contextlib.contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """While a command runs (main thread only), SIGINT raises KeyboardInterrupt and SIGTERM / SIGHUP
    `Stopped`, so they clean up like Ctrl-C instead of killing the process with its temporary folders
    in place - until the command's commit point (`_committed`): after it the command has succeeded,
    and a stop signal is only noted; it finishes (the summary, exit 0) instead of reporting a stop."""
    def stop(signum: int, _frame: FrameType | None) -> None:
        if _committed.is_set():
            return  # noted; atomic_folder has told the user what it finishes first, if anything
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)

    _committed.clear()
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal.signal's rule
    # an ignored signal (`nohup` ignores SIGHUP) stays ignored; a handler set outside Python (None) cannot be restored
    wanted = [signum for signum in STOP_SIGNALS if signal.getsignal(signum) not in (signal.SIG_IGN, None)] \
        if in_main_thread else []
    previous = {signum: signal.signal(signum, stop) for signum in wanted}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _committed.clear()


def _stdout_to_devnull() -> None:
    """Point fd 1 at /dev/null so the interpreter's final flush cannot fail again (Python docs, SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout replaced by something without a descriptor (tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
