"""Model-level decode benchmark: a Llama-3.1-8B-shaped decoder in fp16, NVFP4 and FP8 (a GPU script).

    python benchmarks/bench_model.py [--layers 32] [--batches 1,8,32] [--graphs manual,compile]
                                     [--tiny] [--out benchmarks/results] [--name model_h200]

What it measures: greedy decoding tokens per second of transformers' `LlamaForCausalLM` with
Llama-3.1-8B's dims (LLAMA_8B: hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads,
vocabulary 128256), random weights (no download), a static KV cache (transformers StaticCache),
one CUDA graph per decode step, at each batch size, for the same model three ways:
- fp16: the model as built (torch's cuBLAS for every linear);
- nvfp4 / fp8: every decoder linear (q, k, v, o, gate, up, down) replaced by a QPNLinear made by
  `qpn.torch_bridge.convert(..., "nvfp4" | "fp8")` (FP8 with per-channel scales); the embedding,
  the norms and lm_head stay fp16, as in ModelOpt exports (lm_head is excluded there).
Ratios ("x fp16") divide times of the same run, method and batch.

Quantizing 7e9 random weights with the numpy reference would take minutes, and decode speed
depends on shapes, not values: ONE decoder layer's linears are converted and every layer gets its
own copy of those packed buffers (copies, not shared tensors: each layer streams its own bytes
from DRAM, as a real checkpoint would). The fp16 model is built directly on the GPU in fp16 with
transformers' own (cheap, on-device) random init.

Graph methods (--graphs, each a separate set of rows; the row's "graphs" column says what ran):
- manual: the eager decode step (forward + greedy argmax + position increments) captured by hand
  with torch.cuda.graph and replayed; nothing runs in Python between steps. If capture fails the
  row falls back to an eager Python loop and says why.
- compile: the same step around `torch.compile(model)` (inductor, default mode: fused norms,
  rotary and SiLU), captured by hand the same way (inductor's own cudagraph trees would refuse
  the step's in-place position updates; the prefill stays eager, so only the step compiles).
  Compiles cost tens of seconds each (one per format and batch, dynamic=False); past
  --compile-budget-s the remaining compile rows are skipped, and a failing compile leaves that
  row to the manual rows (the fallback), saying why.

Before timing, every model's prefill logits (the same prompt) are compared with fp16's by cosine
("logits cos"): a broken kernel shows as cos near 0, quantization error as cos a little below 1.
Timing: REPEATS runs of STEPS graph replays between two CUDA events; the median is reported. The
static cache attends over its whole length every step (masked), so the cost per step does not
grow as the runs advance through it.

--tiny (TINY dims, CPU or GPU) and --layers N exist so that the script runs end to end in a test
without a GPU (tests/test_bench_model.py); there, no CUDA graphs exist and the eager loop runs.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_kernels as bk  # noqa: E402  (Column, Section, render_markdown, write_results)

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=512, rope_theta=500000.0, rms_norm_eps=1e-5)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FORMATS = ("fp16", "nvfp4", "fp8")
BATCHES = (1, 8, 32)
GRAPH_METHODS = ("manual", "compile")
PROMPT_LEN = 32  # prefill tokens: M = batch * 32 > 32 takes the dense (dequantize + cuBLAS) path
WARMUP_STEPS = 3  # eager steps before capture: cuBLAS heuristics, kernel JIT, inductor compile
STEPS = 32  # graph replays per timing (~0.2 s of 8B decode at batch 1)
REPEATS = 5
TINY_STEPS, TINY_REPEATS = 4, 2
SEED = 0


# ----------------------------------------------------------------------------- the model


def build_model(dims: dict, layers: int, device):
    """fp16 LlamaForCausalLM with `dims` and `layers` decoder layers, built on `device` (random init)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**dims, "num_hidden_layers": layers}, tie_word_embeddings=False,
                         max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(SEED)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # parameters born fp16 on the device: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(saved)
    if any(p.dtype != torch.float16 for p in model.parameters()):  # a transformers that ignored the default dtype
        model = model.half()
    return model.eval()


def quantized_layer(layer, fmt: str) -> dict:
    """{linear name: QPNLinear} of one decoder layer, converted with qpn.torch_bridge.convert."""
    from qpn.torch_bridge import QPNLinear, convert

    twin = copy.deepcopy(layer)
    skipped = convert(twin, fmt, fp8_granularity="channel")
    converted = {name: twin.get_submodule(name) for name in LINEARS}
    wrong = [name for name, module in converted.items() if not isinstance(module, QPNLinear)]
    if skipped or wrong:
        raise RuntimeError(f"convert(layer, {fmt!r}) left linears unconverted: {skipped or wrong}")
    return converted


def variants(model) -> dict:
    """{format: [per layer {linear name: module}]}: fp16 = the model's own nn.Linear modules, each
    layer's weights overwritten with layer 0's; nvfp4 / fp8 = layer 0 converted once, every other
    layer a deep copy of those packed buffers. So the three models differ only by quantization
    (the logits cosine measures that), and every layer still reads its own bytes."""
    import torch

    layers = model.model.layers
    out = {"fp16": [{name: layer.get_submodule(name) for name in LINEARS} for layer in layers]}
    with torch.no_grad():  # fp16 gets layer 0's weights everywhere too: the three models are one function
        for modules in out["fp16"][1:]:
            for name, module in modules.items():
                module.weight.copy_(out["fp16"][0][name].weight)
    for fmt in FORMATS[1:]:
        t0 = time.perf_counter()
        first = quantized_layer(layers[0], fmt)
        out[fmt] = [first] + [{name: copy.deepcopy(m) for name, m in first.items()} for _ in layers[1:]]
        print(f"{fmt}: layer 0 quantized in {time.perf_counter() - t0:.1f} s, copied to {len(layers) - 1} more",
              flush=True)
    return out


def install(model, linears: list) -> None:
    """Put one variant's linears into the model (module swaps: no copies)."""
    for layer, modules in zip(model.model.layers, linears, strict=True):
        for name, module in modules.items():
            parent, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent), attr, module)


def streamed_bytes(model) -> int:
    """Bytes one decode step must read at least: every decoder layer's tensors plus lm_head (the
    embedding reads only `batch` rows)."""
    tensors = list(model.model.layers.state_dict().values()) + list(model.lm_head.state_dict().values())
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------- one decode session


def _accepted(fn) -> set:
    return set(inspect.signature(fn).parameters)


def static_cache(model, batch: int, max_len: int, device):
    """transformers StaticCache across its versions (4.4x: batch / device / dtype up front; >= 4.56:
    sized at the first update)."""
    import torch
    from transformers import StaticCache

    params = _accepted(StaticCache.__init__)
    kwargs = {"config": model.config, "max_cache_len": max_len}
    # transformers 4.4x: one of the two names is deprecated
    batch_kw = next((name for name in ("max_batch_size", "batch_size") if name in params), None)
    for name, value in ((batch_kw, batch), ("device", device), ("dtype", torch.float16)):
        if name in params:
            kwargs[name] = value
    return StaticCache(**kwargs)


class Session:
    """One model at one batch size: a static cache, the prefill, and `step()`, one greedy decode
    step whose inputs live in fixed tensors that the step itself advances (so it can be replayed
    as a CUDA graph with no host work between steps)."""

    def __init__(self, model, forward, batch: int, max_len: int, device):
        import torch

        self.model, self.forward, self.batch = model, forward, batch  # prefill runs eagerly: one compile per row
        params = _accepted(type(model).forward)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self.with_cache_position = "cache_position" in params  # transformers 5 tracks it inside the cache
        self.cache = static_cache(model, batch, max_len, device)
        gen = torch.Generator(device="cpu").manual_seed(SEED)
        self.prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT_LEN), generator=gen).to(device)
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.position_ids = torch.full((batch, 1), PROMPT_LEN, dtype=torch.long, device=device)
        self.cache_position = torch.full((1,), PROMPT_LEN, dtype=torch.long, device=device)

    def _call(self, forward, ids, position_ids, cache_position):
        kwargs = {self.cache_kw: self.cache, "use_cache": True, "position_ids": position_ids}
        if self.with_cache_position:
            kwargs["cache_position"] = cache_position
        return forward(input_ids=ids, **kwargs).logits[:, -1, :]

    def prefill(self):
        """The prompt through the model (eager); returns its last logits (float32) and sets the first token."""
        import torch

        device = self.prompt.device
        positions = torch.arange(PROMPT_LEN, device=device)
        with torch.no_grad():
            logits = self._call(self.model, self.prompt, positions.expand(self.batch, -1), positions)
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        return logits.float()

    def step(self):
        """One decode step; returns the step's logits [batch, vocab]."""
        import torch

        with torch.no_grad():
            logits = self._call(self.forward, self.ids, self.position_ids, self.cache_position)
            self.ids.copy_(logits.argmax(-1, keepdim=True))
            self.position_ids.add_(1)
            self.cache_position.add_(1)
        return logits


def replayable(session, device) -> tuple:
    """(run one step, logits tensor of the last step, label): a hand-captured CUDA graph of
    session.step on CUDA, else (or if capture fails) the eager step in a Python loop."""
    import torch

    logits = None
    for _ in range(WARMUP_STEPS):  # on a side stream (CUDA), as torch.cuda.graph requires
        if device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = session.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            logits = session.step()
    if device.type != "cuda":
        return session.step, logits, "eager loop (no CUDA)"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            captured = session.step()
    except Exception as exc:  # noqa: BLE001 - a step that cannot be captured is timed eagerly, and says why
        torch.cuda.synchronize()
        return session.step, logits, f"eager loop (capture failed: {type(exc).__name__}: {str(exc)[:80]})"
    return graph.replay, captured, "CUDA graph"


def time_steps(run, device, steps: int, repeats: int) -> list:
    """Seconds per step of `steps` calls of run(), `repeats` times."""
    import torch

    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0 / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            times.append((time.perf_counter() - t0) / steps)
    return times


def cosine(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


# ----------------------------------------------------------------------------- the run


def measure(model, forward, batch: int, device, steps: int, repeats: int, reference) -> tuple:
    """(row, prefill logits): prefill (compared with `reference` logits, if given), capture, time."""
    import torch

    max_len = PROMPT_LEN + WARMUP_STEPS + steps * repeats + 8  # every step of the session fits
    session = Session(model, forward, batch, max_len, device)
    t0 = time.perf_counter()
    prefill = session.prefill()
    if not torch.isfinite(prefill).all():
        raise AssertionError(f"batch {batch}: prefill logits are not finite; refusing to time a broken model")
    run, logits, label = replayable(session, device)
    setup_s = time.perf_counter() - t0
    per_step = statistics.median(time_steps(run, device, steps, repeats))
    finite = bool(torch.isfinite(logits).all())
    row = {"batch": batch, "ms": per_step * 1e3, "tok_s": batch / per_step, "graphs": label, "setup_s": setup_s,
           "finite": finite, "cos": cosine(prefill, reference) if reference is not None else 1.0}
    del session, run, logits
    if device.type == "cuda":
        torch.cuda.synchronize()
    return row, prefill


def run_method(method: str, model, linears: dict, batches, device, args, sec, budget) -> None:
    """Rows of one graph method: for each batch, each format (so a batch's ratios come from
    neighbouring measurements)."""
    import torch

    steps, repeats = (TINY_STEPS, TINY_REPEATS) if args.tiny else (STEPS, REPEATS)
    for batch in batches:
        reference, base = None, None
        for fmt in FORMATS:
            install(model, linears[fmt])
            row = {"method": method, "batch": batch, "format": fmt, "gb": streamed_bytes(model) / 1e9}
            if method == "compile" and time.perf_counter() > budget:
                row["graphs"] = f"skipped: past --compile-budget-s {args.compile_budget_s:g}"
                sec.rows.append(row)
                continue
            try:
                forward = model if method == "manual" else torch.compile(model, dynamic=False)
                measured, prefill = measure(model, forward, batch, device, steps, repeats, reference)
            except Exception as exc:  # noqa: BLE001 - a failed compile is a row; the manual rows are the fallback
                if method == "manual":
                    raise
                row["graphs"] = f"failed, see the manual rows: {type(exc).__name__}: {str(exc)[:100]}"
                sec.rows.append(row)
                continue
            finally:
                if method == "compile":
                    torch._dynamo.reset()  # drop this model's compiled code before the next swap
            if method == "compile":
                measured["graphs"] = f"torch.compile + {measured['graphs']}"
            row.update(measured)
            row["gbps"] = row["gb"] / (row["ms"] / 1e3)
            if fmt == "fp16":
                reference, base = prefill, row["ms"]
            row["x_fp16"] = base / row["ms"] if base else ""
            sec.rows.append(row)
            print(f"{method:8s} batch {batch:3d} {fmt:6s} {row['ms']:8.3f} ms/step {row['tok_s']:9.1f} tok/s "
                  f"x fp16 {row['x_fp16'] if row['x_fp16'] == '' else format(row['x_fp16'], '.2f')}  "
                  f"cos {row['cos']:.4f}  [{row['graphs']}]", flush=True)


def environment(device, dims: dict, layers: int) -> dict:
    """What render_markdown's header reads, plus torch / transformers and the model."""
    import numpy as np
    import torch
    import transformers

    env = {"gpu": "CPU", "sm_count": 0, "l2_bytes": 0, "driver_version": "", "runtime_version": torch.version.cuda,
           "cupy": "", "kernel_build": {"nvrtc_version": "", "built_as": "CPU (numba)"},
           "torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
           "python": platform.python_version(), "repeats": REPEATS, "l2_defeat_factor": "",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": {**dims, "num_hidden_layers": layers}, "prompt_len": PROMPT_LEN, "steps": STEPS}
    if device.type == "cuda":
        import cupy

        from qpn.cupy_kernels import loader

        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count, l2_bytes=getattr(props, "L2_cache_size", 0),
                   driver_version=cupy.cuda.runtime.driverGetVersion(), cupy=cupy.__version__,
                   kernel_build=loader.describe())
    return env


def new_section(tiny: bool) -> bk.Section:
    shapes = "tiny Llama shapes (--tiny)" if tiny else "Llama-3.1-8B shapes"
    return bk.Section("model", f"Decode tokens per second, {shapes} (random weights), static KV cache", [
        bk.Column("method", "method"), bk.Column("batch", "batch"), bk.Column("format", "format"),
        bk.Column("ms", "ms / step", "{:.3f}"), bk.Column("tok_s", "tokens / s", "{:.1f}"),
        bk.Column("x_fp16", "x fp16", "{:.2f}"), bk.Column("gb", "weights GB / step", "{:.2f}"),
        bk.Column("gbps", "weight GB/s", "{:.0f}"), bk.Column("cos", "logits cos vs fp16", "{:.4f}"),
        bk.Column("setup_s", "set-up s", "{:.1f}"), bk.Column("graphs", "graphs"),
    ])


def write(env: dict, sec: bk.Section, out: Path, name: str) -> tuple:
    """NAME.json through bench_kernels.write_results; NAME.md with this benchmark's own header."""
    json_path, md_path = bk.write_results(env, [sec], out, name)
    model = env["model"]
    header = [
        f"# qpn model benchmark: {env['gpu']}",
        "",
        f"{env['date']}; torch {env['torch']}, transformers {env['transformers']}, CuPy {env['cupy'] or '-'}; "
        f"kernels built as {env['kernel_build']['built_as']}. LlamaForCausalLM, hidden {model['hidden_size']}, "
        f"intermediate {model['intermediate_size']}, {model['num_hidden_layers']} layers, "
        f"{model['num_attention_heads']} / {model['num_key_value_heads']} heads, vocabulary {model['vocab_size']}; "
        f"prompt {env['prompt_len']} tokens, then greedy decode steps (median of {env['repeats']} runs of "
        f"{env['steps']} steps).",
    ]
    body = bk.render_markdown(env, [sec]).split("\n", 3)[-1]
    tmp = md_path.with_name(f".{md_path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(header) + "\n" + body)
    os.replace(tmp, md_path)
    return json_path, md_path


NOTES = (
    "Weights are random: ONE decoder layer's linears are quantized with qpn (convert) and every layer gets its "
    "own copy of those packed buffers; speed depends on shapes, not values.",
    "nvfp4 / fp8 = every decoder linear a QPNLinear (FP8 per-channel scales); embedding, norms and lm_head fp16 "
    "(ModelOpt excludes lm_head). weights GB / step = decoder layers + lm_head as stored; weight GB/s = that / "
    "step time (attention and activations not counted).",
    "x fp16 = fp16's ms / step over this row's, same method, batch and run. logits cos = cosine of the prefill's "
    "last logits with fp16's (same prompt): quantization error, not a kernel check against a reference. "
    "set-up s = prefill + warm-up steps (torch.compile's compile included) + capture.",
)


def build_parser() -> argparse.ArgumentParser:
    """The arguments (`qpn bench model` checks them before it looks for a GPU: a typo exits 2, not 3)."""
    parser = argparse.ArgumentParser(prog="bench_model.py", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=_positive, default=None,
                        help=f"decoder layers (default {LLAMA_8B['num_hidden_layers']}; "
                             f"--tiny: {TINY['num_hidden_layers']})")
    parser.add_argument("--batches", type=_batches, default=BATCHES,
                        help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--graphs", type=_methods, default=GRAPH_METHODS, help="comma-separated: manual,compile")
    parser.add_argument("--compile-budget-s", type=float, default=180.0,
                        help="skip the remaining compile rows once the run has spent this long on them")
    parser.add_argument("--tiny", action="store_true", help="small dims, a few layers (runs on a CPU; for the test)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--name", default="model_h200")
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _batches(text: str) -> tuple:
    return tuple(_positive(v) for v in text.split(",") if v.strip())


def _methods(text: str) -> tuple:
    methods = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [m for m in methods if m not in GRAPH_METHODS]
    if bad or not methods:
        raise argparse.ArgumentTypeError(f"choose from {','.join(GRAPH_METHODS)}, got {text!r}")
    return methods


def main(argv=None) -> int:
    import torch

    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dims = TINY if args.tiny else LLAMA_8B
    layers = args.layers or dims["num_hidden_layers"]
    env = environment(device, dims, layers)
    print(f"{env['gpu']}: torch {env['torch']}, transformers {env['transformers']}; {layers} layers", flush=True)

    t0 = time.perf_counter()
    model = build_model(dims, layers, device)
    print(f"fp16 model built on {device} in {time.perf_counter() - t0:.1f} s", flush=True)
    linears = variants(model)
    sec = new_section(args.tiny)
    sec.notes.extend(NOTES)
    json_path = md_path = None
    for method in args.graphs:
        budget = time.perf_counter() + args.compile_budget_s
        run_method(method, model, linears, args.batches, device, args, sec, budget)
        json_path, md_path = write(env, sec, args.out, args.name)  # after every method: a timeout keeps the rest
    print(bk.render_markdown(env, [sec]).split("\n", 3)[-1], flush=True)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
