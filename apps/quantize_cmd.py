"""`qpn quantize SRC OUT --format F [--method rtn|mse] [--exclude PATTERN ...] [--shared-fused-scales]
[--overwrite]`: a Hugging Face float model -> a weight-only quantized checkpoint (checkpoints/quantize.py).

Registered by apps/cli.py's build_parser (`add_parser`); exit codes, signals and the one-line errors are
cli.main's: a CheckpointError / SafetensorsError / TargetError is bad input (exit 2), Ctrl-C removes the
temporary folder (exit 130).
"""

from __future__ import annotations

import argparse
import sys
import time

from ..checkpoints.quantize import DEFAULT_EXCLUDE, FORMATS, METHODS, SHARD_BYTES, quantize_checkpoint
from .output import EXIT_OK, UsageError, plural, progress_bars, size_text

# --method's default per --format: the method whose model scored the lower perplexity on SmolLM2-135M
# (tests/real_model.py) over tests/data/alice_ch1_2.txt, 6099 tokens, fp16 24.346 (README, "Quantize your own
# model"): nvfp4 mse 29.852 vs rtn 31.334 (the gap to fp16 0.79x rtn's); mxfp4 mse 37.849 vs rtn 41.594
# (0.78x); fp8 mse 24.906 vs rtn 24.576 (mse loses: its smaller scales clip the largest weights, which FP8's
# fine grid rounds well anyway). fp8-channel / fp8-block follow fp8; a format not listed takes rtn (the
# producers' own bytes).
DEFAULT_METHODS = {"nvfp4": "mse", "fp8": "rtn", "fp8-channel": "rtn", "fp8-block": "rtn", "mxfp4": "mse"}


def _positive_mib(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of MiB such as 1024, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (MiB), got {value}")
    return value


def cmd_quantize(args: argparse.Namespace) -> int:
    fmt = FORMATS[args.format]
    if args.method is None:
        args.method = DEFAULT_METHODS.get(args.format, "rtn")
    if args.method not in fmt.methods:
        raise UsageError(f"--method {args.method} is not available for --format {args.format} (its methods: "
                         f"{', '.join(fmt.methods)}); use --method {fmt.methods[0]}")
    start = time.perf_counter()
    report = quantize_checkpoint(args.src, args.out, args.format, method=args.method, exclude=args.exclude,
                                 shared_fused_scales=args.shared_fused_scales, overwrite=args.overwrite,
                                 progress=progress_bars(not args.quiet and sys.stderr.isatty()),
                                 shard_bytes=args.shard_mib << 20)
    seconds = time.perf_counter() - start
    copied = f"; copied {', '.join(report.copied)}" if report.copied else ""
    # "weights": a linear's each, or a gpt-oss layer's stacked experts tensors (gate_up_proj, down_proj)
    print(f"quantized {plural(len(report.quantized), 'weight')} as {args.format} ({args.method}) -> {args.out} "
          f"({plural(len(report.files), 'weight file')}, {size_text(report.output_bytes)} from "
          f"{size_text(report.source_bytes)}) in {seconds:.1f} s{copied}")
    print(f"kept unquantized ({len(report.excluded)}):")
    for module, why in sorted(report.excluded.items()):
        print(f"  {module}  ({why})")
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("quantize", parents=[common], help="quantize a Hugging Face float model (weight-only)",
                       description="Quantize every linear weight of a Hugging Face folder (fp32 / bf16 / fp16 "
                                   "safetensors, sharded or not), one tensor at a time, into ModelOpt's export "
                                   "layout (nvfp4, fp8, fp8-channel, fp8-block) or compressed-tensors' (mxfp4), "
                                   "weight-only; the folder appears atomically with the tokenizer, chat template "
                                   "and generation config copied. Unquantized: embeddings, lm_head, MoE routers "
                                   f"({', '.join(DEFAULT_EXCLUDE)}), norms and every other non-linear tensor.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--format", required=True, choices=sorted(FORMATS))
    p.add_argument("--method", choices=METHODS, default=None,
                   help="rtn: round to nearest, the producers' own bytes; mse: each block's scale chosen to "
                        "minimise its squared error (same format, any reader). Default: the one that scored "
                        "the lower perplexity on a real model (SmolLM2-135M): "
                        + ", ".join(f"{f} {m}" for f, m in sorted(DEFAULT_METHODS.items())))
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="also keep modules matching this glob unquantized (fnmatch on the module name, e.g. "
                        "'*.mlp.down_proj'); repeatable")
    p.add_argument("--shared-fused-scales", action="store_true",
                   help="ModelOpt's exporter form: q/k/v share one NVFP4 global scale and gate/up another (the "
                        "largest, each re-quantized), for upstream loaders that take one scale per fused layer; "
                        "default: each projection keeps its own, which qpn serves exactly")
    p.add_argument("--shard-mib", type=_positive_mib, default=SHARD_BYTES >> 20, metavar="MIB",
                   help=f"write an output shard each time this many MiB are ready (default {SHARD_BYTES >> 20}); "
                        "bounds the memory the output takes")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if `qpn quantize` wrote it (atomically); never a folder qpn did not write")
    p.set_defaults(func=cmd_quantize)
