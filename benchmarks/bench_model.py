"""Model-level decode benchmark: a Llama-3.1-8B-shaped or Qwen3-30B-A3B-shaped decoder in fp16, NVFP4 and FP8,
or a gpt-oss-20b-shaped one in fp16 and MXFP4 (a GPU script).

    python benchmarks/bench_model.py [--model llama8b|qwen3moe|gptoss20b] [--layers N] [--batches 1,8,32]
                                     [--graphs manual,compile] [--tiny] [--out benchmarks/results] [--name NAME]

What it measures: greedy decoding tokens per second, and the model's resident bytes, of transformers'
`LlamaForCausalLM` with Llama-3.1-8B's dims (LLAMA_8B: hidden 4096, intermediate 14336, 32 layers, 32
heads, 8 KV heads, vocabulary 128256) or `Qwen3MoeForCausalLM` with Qwen3-30B-A3B's (QWEN3_30B_A3B: hidden
2048, 48 layers, 32 heads, 4 KV heads, every layer a mixture of 128 experts, top-8, expert intermediate
768, vocabulary 151936), random weights (no download), a static KV cache (transformers StaticCache), one
CUDA graph per decode step, at each batch size, for the same model three ways:
- fp16: the model as built (torch's cuBLAS for every linear; the experts through transformers'
  `batched_mm` experts implementation where it has one: each (token, choice) gathers its expert's weights
  and two bmm run, no host sync, so the step is captured in a CUDA graph; transformers' `grouped_mm`
  copies to the host inside (capture fails: 139-326 ms/step eager at batch 1-32 on the H200) and its
  eager loop syncs per expert);
- nvfp4 / fp8: every decoder linear (q, k, v, o, and Llama's gate, up, down) replaced by a QPNLinear
  made by `qpn.torch_bridge.convert(..., "nvfp4" | "fp8")` (FP8 with per-channel scales), every experts
  module by a QPNExperts (the fused MoE op); the embedding, the norms, the MoE router and lm_head stay
  fp16, as in ModelOpt exports;
- gpt-oss-20b (--model gptoss20b: `GptOssForCausalLM` with GPT_OSS_20B's dims, openai/gpt-oss-20b's
  config.json: hidden 2880, 24 layers, 64 heads of 64, 8 KV heads, 32 experts, top-4, expert intermediate
  2880, vocabulary 201088, a 128-token sliding window on every other layer, attention biases and sinks):
  fp16 and mxfp4, where only the experts change: each a QPNExperts in MXFP4 (QPNMX, float32 biases,
  gpt-oss's clamped SwiGLU), as gpt-oss ships them; attention, sinks, router, embedding, norms and
  lm_head stay fp16 in both (gpt-oss keeps them bf16: its modules_to_not_convert). Attention is
  transformers' eager implementation (its only one with sinks here: no SDPA for gpt-oss). The static
  cache gives every layer the whole session (static_cache: transformers' sliding-window cache layer keeps
  its length in a Python int, which a replayed CUDA graph would never advance); the sliding layers' masks,
  built from the model's own config, still restrict them to 128 tokens, so the function is gpt-oss's.
Ratios ("x fp16") divide times of the same run, method and batch.

Quantizing billions of random weights with the numpy reference would take minutes, and decode speed
depends on shapes, not values: ONE decoder layer's linears are converted (of a mixture, expert 0, its
packed buffers copied to every expert) and every layer gets its own copy of those packed buffers (copies,
not shared tensors: each layer and expert streams its own bytes from DRAM, as a real checkpoint would).
The fp16 model gets the same weights (layer 0's, expert 0's everywhere): the three are one function. The
fp16 model is built directly on the GPU in fp16 with transformers' own (cheap, on-device) random init.

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

Before timing, every model's prefill logits (the same prompt) are compared by cosine with two models:
- its W16 twin ("cos vs W16 twin", the implementation's fidelity): the fp16 model whose linears hold qpn's own
  dequantized weights (QPNLinear.dequantized_weight: the W16 every path computes with), run by torch's fp16
  linears. The two differ only by summation order and fp16 activations' rounding points, so a layout, scale
  or kernel bug shows here (must read >= 0.999: FIDELITY_MIN). Dense models only (a mixture's twin would need
  transformers' experts filled from the packed stacks: "-" there);
- fp16 ("quantization error, cos vs fp16"): the format's own error on random weights (NVFP4 on random
  Gaussian weights reads 0.3-0.5 at 8B depth: random weights have no outliers for the block scales to absorb
  and the error compounds over 32 layers; it is not a kernel check).
Timing: REPEATS runs of STEPS graph replays between two CUDA events; the median is reported. The
static cache attends over its whole length every step (masked), so the cost per step does not
grow as the runs advance through it. Where the step goes (dense shapes): the step's linears alone (each
decoder linear and lm_head once on [batch, K] activations, one graph, timed the same way: LinearsAlone),
and the rest, the step's time minus theirs, which every format shares.

--tiny (TINY dims, CPU or GPU) and --layers N exist so that the script runs end to end in a test
without a GPU (tests/test_bench_model.py, tests/test_bench_gpt_oss.py); there, no CUDA graphs exist and the
eager loop runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import inspect
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qpn.apps.arguments import Parser, integer_in, integers_in
from qpn.benchmarks import bench_kernels as bk  # (Column, Section, render_markdown, write_results)

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=512, rope_theta=500000.0, rms_norm_eps=1e-5)
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY_MOE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=512, rope_theta=1000000.0, rms_norm_eps=1e-6)
# openai/gpt-oss-20b's config.json (benchmarks/gpt_oss_memory.py cites its copies); layer_types default to
# transformers' alternation (sliding_attention first), rope to its YaRN (theta 150000, factor 32), as the config
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   vocab_size=201088, sliding_window=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
                   swiglu_limit=7.0)
# QPNMX needs H and I multiples of 64; a window of 16 < PROMPT_LEN, so the sliding masks matter in the tests
TINY_GPT_OSS = dict(hidden_size=128, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                    sliding_window=16, rms_norm_eps=1e-5, swiglu_limit=7.0)
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS = (*ATTENTION, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # Llama's


@dataclass(frozen=True)
class Shape:
    """A decoder family: transformers' model class, its full and tiny dims, its per-layer linears (those the
    quantized variants convert) and (a mixture of experts) its experts module; the formats compared (fp16
    first), transformers' attention implementation, and the family's name in the tables."""

    model_class: str
    dims: dict
    tiny: dict
    linears: tuple
    experts: str | None = None
    formats: tuple = ("fp16", "nvfp4", "fp8")
    attn_implementation: str = "sdpa"
    family: str = "Llama-3.1-8B"
    short: str = "Llama"  # the tiny tables' name

    @property
    def modules(self) -> tuple:
        return (*self.linears, *((self.experts,) if self.experts else ()))


MODELS = {"llama8b": Shape("LlamaForCausalLM", LLAMA_8B, TINY, LINEARS),
          "qwen3moe": Shape("Qwen3MoeForCausalLM", QWEN3_30B_A3B, TINY_MOE, ATTENTION, "mlp.experts",
                            family="Qwen3-30B-A3B", short="Qwen3"),
          # gpt-oss: the experts only (attention, sinks and router stay fp16), eager attention (sinks: no SDPA)
          "gptoss20b": Shape("GptOssForCausalLM", GPT_OSS_20B, TINY_GPT_OSS, (), "mlp.experts", ("fp16", "mxfp4"),
                             "eager", "gpt-oss-20b", "gpt-oss")}
FORMATS = MODELS["llama8b"].formats
BATCHES = (1, 8, 32, 64, 128)
FIDELITY_MIN = 0.999  # logits cosine against the W16 twin (module docstring)
GRAPH_METHODS = ("manual", "compile")
PROMPT_LEN = 32  # prefill tokens: M = batch * 32 > 32 takes the dense (dequantize + cuBLAS) path
WARMUP_STEPS = 3  # eager steps before capture: cuBLAS heuristics, kernel JIT, inductor compile
STEPS = 32  # graph replays per timing (~0.2 s of 8B decode at batch 1)
REPEATS = 5
TINY_STEPS, TINY_REPEATS = 4, 2
SEED = 0


# ----------------------------------------------------------------------------- the model


def build_model(dims: dict, layers: int, device, shape: Shape = MODELS["llama8b"]):
    """fp16 `shape.model_class` with `dims` and `layers` decoder layers, built on `device` (random init); a
    mixture's experts run transformers' batched_mm implementation where this transformers has it."""
    import torch
    import transformers

    model_class = getattr(transformers, shape.model_class)
    config = model_class.config_class(**{"max_position_embeddings": 4096, **dims, "num_hidden_layers": layers},
                                      tie_word_embeddings=False, attn_implementation=shape.attn_implementation)
    torch.manual_seed(SEED)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # parameters born fp16 on the device: no fp32 copy of the weights
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(saved)
    if any(p.dtype != torch.float16 for p in model.parameters()):  # a transformers that ignored the default dtype
        model = model.half()
    if shape.experts:  # gpt-oss's expert biases: transformers inits them to 0; random ones make the bias path count
        gen = torch.Generator(device=device).manual_seed(SEED)
        with torch.no_grad():
            for layer in model.model.layers:
                for name, p in layer.get_submodule(shape.experts).named_parameters(recurse=False):
                    if name.endswith("_bias"):
                        p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    if shape.experts and device.type == "cuda" and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")
    return model.eval()


@contextlib.contextmanager
def prefill_experts(model):
    """The prefill's fp16 experts through grouped_mm (eager: batched_mm would gather a copy of the chosen
    experts' weights per (token, choice), 48 GB at 1024 prompt tokens); the decode steps keep batched_mm."""
    if experts_label(model) != "batched_mm":
        yield
        return
    model.set_experts_implementation("grouped_mm")
    try:
        yield
    finally:
        model.set_experts_implementation("batched_mm")


def experts_label(model) -> str:
    """What runs the fp16 experts (the config's experts implementation; '' without experts)."""
    return str(getattr(model.config, "_experts_implementation", None) or "eager")


def quantized_layer(layer, fmt: str, shape: Shape = MODELS["llama8b"]) -> dict:
    """{module name: QPNLinear / QPNExperts} of one decoder layer: its linears converted with
    qpn.torch_bridge.convert; its experts module (if any) expert 0 quantized, copied to every expert."""
    from qpn.torch_bridge import QPNLinear, convert

    twin = copy.deepcopy(layer)
    parents = sorted({name.rpartition(".")[0] for name in shape.linears})
    skipped = [(f"{parent}.{name}", why) for parent in parents
               for name, why in convert(twin.get_submodule(parent), fmt, fp8_granularity="channel")]
    converted = {name: twin.get_submodule(name) for name in shape.linears}
    wrong = [name for name, module in converted.items() if not isinstance(module, QPNLinear)]
    if skipped or wrong:
        raise RuntimeError(f"convert(layer, {fmt!r}) left linears unconverted: {skipped or wrong}")
    if shape.experts:
        converted[shape.experts] = replicated_experts(layer.get_submodule(shape.experts), fmt)
    return converted


def replicated_experts(module, fmt: str):
    """A QPNExperts of `module`'s shape whose every expert holds its own copy of expert 0 quantized (FP8: per
    channel; gpt-oss: MXFP4 with its biases and activation): QPNExperts.from_module on a one-expert view
    (every parameter's expert 0, and gpt-oss's alpha and limit), then each stacked buffer repeated E times."""
    import torch

    from qpn.torch_bridge import PackedExperts
    from qpn.torch_bridge.experts import QPNExperts
    from qpn.torch_bridge.module import format_of

    one = torch.nn.Module()
    for name, p in module.named_parameters(recurse=False):
        setattr(one, name, torch.nn.Parameter(p[:1].detach(), requires_grad=False))
    for name in ("alpha", "limit"):  # gpt-oss's SwiGLU constants (experts_weights checks them)
        if hasattr(module, name):
            setattr(one, name, getattr(module, name))
    wf = format_of(fmt, "channel")
    first = QPNExperts.from_module(one, wf, "channel" if wf.granularities else None).packed_experts
    experts = int(module.gate_up_proj.shape[0])

    def repeated(t):
        return None if t is None else t.repeat(experts, *(1,) * (t.dim() - 1))

    w13, w2 = ({name: repeated(t) for name, t in b.items()} for b in (first.w13, first.w2))
    return QPNExperts(PackedExperts(first.weight_class, w13, w2, first.hidden_size, first.intermediate_size,
                                    repeated(first.w13_bias), repeated(first.w2_bias), first.activation))


def variants(model, shape: Shape = MODELS["llama8b"]) -> dict:
    """{format: [per layer {module name: module}]} over shape.formats: fp16 = the model's own modules, each
    layer's weights overwritten with layer 0's (each expert's with layer 0's expert 0); nvfp4 / fp8 / mxfp4 =
    layer 0 converted once, every other layer a deep copy of those packed buffers. So the models differ only by
    quantization (the logits cosine measures that), and every layer still reads its own bytes. (gpt-oss: the
    attention is not among shape.linears: each layer keeps its own random fp16 attention, shared by every
    variant, since only the experts are swapped.)"""
    import torch

    layers = model.model.layers
    out = {"fp16": [{name: layer.get_submodule(name) for name in shape.modules} for layer in layers]}
    with torch.no_grad():  # fp16 gets layer 0's weights everywhere too: the models are one function
        if shape.experts:  # expert 0 of layer 0 in every expert of every layer (every parameter: gpt-oss's biases)
            first = {name: p[:1].clone() for name, p in out["fp16"][0][shape.experts].named_parameters(recurse=False)}
            for modules in out["fp16"]:
                for name, p in modules[shape.experts].named_parameters(recurse=False):
                    p.copy_(first[name].expand_as(p))
        for modules in out["fp16"][1:]:
            for name in shape.linears:
                modules[name].weight.copy_(out["fp16"][0][name].weight)
    for fmt in shape.formats[1:]:
        t0 = time.perf_counter()
        first = quantized_layer(layers[0], fmt, shape)
        out[fmt] = [first] + [{name: copy.deepcopy(m) for name, m in first.items()} for _ in layers[1:]]
        print(f"{fmt}: layer 0 quantized in {time.perf_counter() - t0:.1f} s, copied to {len(layers) - 1} more",
              flush=True)
    return out


def w16_twins(linears: dict, shape: Shape) -> dict:
    """{format: [per layer {module name: nn.Linear}]} for each quantized format of a dense shape: the fp16 model's
    linears holding qpn's W16 of that format (layer 0's, as every layer's packed buffers are its copies), each
    layer its own tensor; {} for a mixture (module docstring)."""

    if shape.experts:
        return {}
    out = {}
    for fmt in shape.formats[1:]:
        first = {name: module.dequantized_weight() for name, module in linears[fmt][0].items()}
        out[fmt] = [{name: _fp16_linear(w16, linears["fp16"][0][name]) for name, w16 in first.items()}
                    for _ in linears[fmt]]
    return out


def _fp16_linear(w16, like):
    """An fp16 nn.Linear of `like`'s shape and device holding a copy of w16 (no bias: the decoder's linears)."""
    import torch

    linear = torch.nn.Linear(w16.shape[1], w16.shape[0], bias=False, dtype=torch.float16, device=w16.device)
    with torch.no_grad():
        linear.weight.copy_(w16)
    return linear.requires_grad_(False)


def install(model, modules: list) -> None:
    """Put one variant's modules into the model (module swaps: no copies)."""
    for layer, named in zip(model.model.layers, modules, strict=True):
        for name, module in named.items():
            parent, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(parent), attr, module)


def resident_bytes(model) -> int:
    """Bytes of every parameter and buffer of the model as installed (each storage once)."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


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
    sized at the first update).

    A model with sliding-window layers (gpt-oss) gets full-length static layers everywhere: transformers'
    StaticSlidingWindowLayer keeps its length in a Python int (its update's branch, the sliding mask's query
    offset), which a replayed CUDA graph never advances (its tensor write position would run past the window,
    out of bounds); a StaticLayer keeps it in a tensor. The masks keep the model's config (the prefill's are the
    model's own, the decode step's Session._step_masks), so the sliding layers attend to their last
    `sliding_window` tokens only: the same function (checked against
    transformers' DynamicCache in tests/test_bench_gpt_oss.py), over max_len masked slots instead of a
    window-sized ring."""
    import torch
    from transformers import StaticCache

    config = model.config
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        config = copy.deepcopy(config)
        config.layer_types = ["full_attention"] * len(layer_types)
    params = _accepted(StaticCache.__init__)
    kwargs = {"config": config, "max_cache_len": max_len}
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
        # sliding-window models (gpt-oss): the step's masks built here, on the device, from cache_position;
        # transformers' eager_mask makes its 0.0 with torch.tensor(0.0, device=...), a host-to-device copy a
        # CUDA graph cannot capture (transformers on the H200 image, 2026-12-02)
        self.window = getattr(model.config, "sliding_window", None) if any(
            kind == "sliding_attention" for kind in getattr(model.config, "layer_types", None) or ()) else None
        if self.window is not None:
            dtype = next(model.parameters()).dtype
            self.kv_index = torch.arange(max_len, device=device)
            self.zero = torch.zeros((), dtype=dtype, device=device)
            self.masked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)

    def _step_masks(self) -> dict:
        """{"full_attention", "sliding_attention"}: additive [1, 1, 1, max_len] masks of the step's query at
        cache_position (transformers' causal and sliding-window mask functions: kv <= q, and q - window < kv)."""
        seen = self.kv_index <= self.cache_position
        window = seen & (self.kv_index > self.cache_position - self.window)
        return {kind: self.zero.where(allowed, self.masked).view(1, 1, 1, -1)
                for kind, allowed in (("full_attention", seen), ("sliding_attention", window))}

    def _call(self, forward, ids, position_ids, cache_position, masks=None):
        kwargs = {self.cache_kw: self.cache, "use_cache": True, "position_ids": position_ids}
        if masks is not None:
            kwargs["attention_mask"] = masks
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
            masks = self._step_masks() if self.window is not None else None
            logits = self._call(self.forward, self.ids, self.position_ids, self.cache_position, masks)
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


class LinearsAlone:
    """A decode step's linears and nothing else, as a session whose step() replayable() captures: every decoder
    layer's converted linears as installed (Shape.linears) and lm_head, each once, in the model's order, on fixed
    fp16 activations of [batch, in_features] (values move no time). Its time against the step's splits the step
    into the linears and the rest (attention, norms, rotary, residuals, SiLU, embedding, argmax), which the
    formats share. Dense shapes only: a mixture's experts route per token."""

    def __init__(self, model, shape: Shape, batch: int, device):
        import torch

        modules = [layer.get_submodule(name) for layer in model.model.layers for name in shape.linears]
        modules.append(model.lm_head)
        gen = torch.Generator(device=device).manual_seed(0)
        xs = {k: torch.randn(batch, k, generator=gen, device=device, dtype=torch.float16)
              for k in sorted({m.in_features for m in modules})}
        self.calls = [(m, xs[m.in_features]) for m in modules]

    def step(self):
        import torch

        with torch.no_grad():
            y = None
            for module, x in self.calls:
                y = module(x)
            return y


def linears_ms(model, shape: Shape, batch: int, device, steps: int, repeats: int) -> float:
    """Median ms of the step's linears alone (LinearsAlone), captured and timed as the step is."""
    run, _, _ = replayable(LinearsAlone(model, shape, batch, device), device)
    return statistics.median(time_steps(run, device, steps, repeats)) * 1e3


def cosine(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


# ----------------------------------------------------------------------------- the run


def prefill_logits(model, batch: int, device):
    """The prompt's last logits (float32) through the installed model, eagerly: a fidelity check, not timed."""
    session = Session(model, model, batch, PROMPT_LEN + 1, device)
    with prefill_experts(model):
        return session.prefill()


def measure(model, forward, batch: int, device, steps: int, repeats: int, reference) -> tuple:
    """(row, prefill logits): prefill (compared with `reference` logits, if given), capture, time."""
    import torch

    max_len = PROMPT_LEN + WARMUP_STEPS + steps * repeats + 8  # every step of the session fits
    session = Session(model, forward, batch, max_len, device)
    t0 = time.perf_counter()
    with prefill_experts(model):
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


def run_method(method: str, model, linears: dict, batches, device, args, sec, budget, shape: Shape,
               twins: dict | None = None) -> None:
    """Rows of one graph method: for each batch, each format (so a batch's ratios come from
    neighbouring measurements); a format with a W16 twin (w16_twins) also gets its prefill's cosine with the
    twin's."""
    import torch

    steps, repeats = (TINY_STEPS, TINY_REPEATS) if args.tiny else (STEPS, REPEATS)
    for batch in batches:
        reference, base, base_bytes = None, None, None
        for fmt in shape.formats:
            install(model, linears[fmt])
            resident = resident_bytes(model)
            base_bytes = resident if fmt == "fp16" else base_bytes
            row = {"method": method, "batch": batch, "format": fmt, "gb": streamed_bytes(model) / 1e9,
                   "resident_gb": resident / 1e9, "mem_x_fp16": resident / base_bytes}
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
            if fmt == "fp16" and shape.experts:
                row["graphs"] = f"{row['graphs']}; experts: transformers {experts_label(model)}"
            row["gbps"] = "" if shape.experts else row["gb"] / (row["ms"] / 1e3)  # a mixture reads the hit experts
            row["linears_ms"] = "" if shape.experts else linears_ms(model, shape, batch, device, steps, repeats)
            row["rest_ms"] = "" if shape.experts else row["ms"] - row["linears_ms"]
            if fmt == "fp16":
                reference, base = prefill, row["ms"]
            row["x_fp16"] = base / row["ms"] if base else ""
            row["cos_w16"] = ""
            if twins and fmt in twins:
                install(model, twins[fmt])
                row["cos_w16"] = cosine(prefill, prefill_logits(model, batch, device))
            sec.rows.append(row)
            print(f"{method:8s} batch {batch:3d} {fmt:6s} {row['ms']:8.3f} ms/step {row['tok_s']:9.1f} tok/s "
                  f"x fp16 {row['x_fp16'] if row['x_fp16'] == '' else format(row['x_fp16'], '.2f')}  "
                  f"cos {row['cos']:.4f} vs W16 twin {_or_blank(row['cos_w16'], '.6f')}  [{row['graphs']}]",
                  flush=True)


def _or_blank(value, spec: str) -> str:
    return "" if value == "" else format(value, spec)


def environment(device, dims: dict, layers: int, shape: Shape) -> dict:
    """What render_markdown's header reads, plus torch / transformers and the model."""
    import numpy as np
    import torch
    import transformers

    env = {"gpu": "CPU", "sm_count": 0, "l2_bytes": 0, "driver_version": "", "runtime_version": torch.version.cuda,
           "cupy": "", "kernel_build": {"nvrtc_version": "", "built_as": "CPU (numba)"},
           "torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
           "python": platform.python_version(), "repeats": REPEATS, "l2_defeat_factor": "",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": {**dims, "num_hidden_layers": layers}, "model_class": shape.model_class, "prompt_len": PROMPT_LEN,
           "steps": STEPS}
    if device.type == "cuda":
        import cupy

        from qpn.cupy_kernels import loader

        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count, l2_bytes=getattr(props, "L2_cache_size", 0),
                   driver_version=cupy.cuda.runtime.driverGetVersion(), cupy=cupy.__version__,
                   kernel_build=loader.describe())
    return env


def new_section(tiny: bool, shape: Shape) -> bk.Section:
    shapes = f"tiny {shape.short} shapes (--tiny)" if tiny else f"{shape.family} shapes"
    return bk.Section("model", f"Decode tokens per second, {shapes} (random weights), static KV cache", [
        bk.Column("method", "method"), bk.Column("batch", "batch"), bk.Column("format", "format"),
        bk.Column("ms", "ms / step", "{:.3f}"), bk.Column("tok_s", "tokens / s", "{:.1f}"),
        bk.Column("x_fp16", "x fp16", "{:.2f}"), bk.Column("gb", "weights GB / step", "{:.2f}"),
        bk.Column("gbps", "weight GB/s", "{:.0f}"), bk.Column("linears_ms", "linears alone ms", "{:.3f}"),
        bk.Column("rest_ms", "rest ms", "{:.3f}"), bk.Column("resident_gb", "resident GB", "{:.2f}"),
        bk.Column("mem_x_fp16", "memory x fp16", "{:.3f}"), bk.Column("cos_w16", "logits cos vs W16 twin", "{:.6f}"),
        bk.Column("cos", "quantization error: logits cos vs fp16", "{:.4f}"),
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
        f"kernels built as {env['kernel_build']['built_as']}. {env['model_class']}, hidden {model['hidden_size']}, "
        + (f"{model['num_experts']} experts, top-{model['num_experts_per_tok']}, expert intermediate "
           f"{model['moe_intermediate_size']}, " if "num_experts" in model else
           f"{model['num_local_experts']} experts, top-{model['num_experts_per_tok']}, expert intermediate "
           f"{model['intermediate_size']}, sliding window {model['sliding_window']} on every other layer, "
           if "num_local_experts" in model else f"intermediate {model['intermediate_size']}, ")
        + f"{model['num_hidden_layers']} layers, "
        f"{model['num_attention_heads']} / {model['num_key_value_heads']} heads, vocabulary {model['vocab_size']}; "
        f"prompt {env['prompt_len']} tokens, then greedy decode steps (median of {env['repeats']} runs of "
        f"{env['steps']} steps).",
    ]
    body = bk.render_markdown(env, [sec]).split("\n", 3)[-1]
    bk.write_atomic(md_path, "\n".join(header) + "\n" + body)
    return json_path, md_path


NOTES = (
    "Weights are random: ONE decoder layer's linears are quantized with qpn (convert) and every layer gets its "
    "own copy of those packed buffers; speed depends on shapes, not values.",
    "nvfp4 / fp8 = every decoder linear a QPNLinear (FP8 per-channel scales), every experts module a QPNExperts; "
    "embedding, norms, MoE routers and lm_head fp16 (ModelOpt excludes lm_head and the routers). weights GB / "
    "step = decoder layers + lm_head as stored; weight GB/s = that / step time (attention and activations not "
    "counted; not given for a mixture, whose step reads the hit experts only). resident GB = every parameter and "
    "buffer of the model as loaded (embedding included); memory x fp16 = that over fp16's.",
    "linears alone ms = every decoder linear (as installed) and lm_head once on fixed [batch, K] activations, one "
    "CUDA graph, timed as the step is (LinearsAlone); rest ms = ms / step minus that: attention, norms, rotary, "
    "residuals, SiLU, embedding and argmax, shared by the formats (the same kernels, the same run).",
    "x fp16 = fp16's ms / step over this row's, same method, batch and run. logits cos vs W16 twin = cosine of the "
    "prefill's last logits (same prompt) with the fp16 model holding qpn's dequantized weights: the "
    "implementation's fidelity (>= 0.999 expected). quantization error = the same cosine against the fp16 model: "
    "the format's error on random weights, not a kernel check. "
    "set-up s = prefill + warm-up steps (torch.compile's compile included) + capture.",
)
GPT_OSS_NOTES = (
    "Weights are random: layer 0's expert 0 is quantized with qpn (QPNExperts.from_module, MXFP4) and every "
    "expert of every layer gets its own copy of those packed buffers (the fp16 model holds that expert's weights "
    "in every expert); speed depends on shapes, not values.",
    "mxfp4 = every experts module a QPNExperts in MXFP4 (QPNMX, float32 biases, gpt-oss's clamped SwiGLU fused in "
    "the MoE op); attention (q, k, v, o with their biases, the sinks), routers, embedding, norms and lm_head fp16 "
    "in both rows (gpt-oss ships them bf16: modules_to_not_convert). fp16 experts: transformers' GptOssExperts "
    "through its batched_mm implementation (biases and the clamped SwiGLU included). Attention: transformers' "
    "eager implementation (sinks; transformers has no SDPA path for gpt-oss). KV cache: a full-length static "
    "layer per decoder layer (a replayed CUDA graph cannot advance transformers' sliding-window cache layer); "
    "the sliding layers' masks keep their 128-token window. resident GB = every parameter and buffer of the "
    "model as loaded (embedding and lm_head included); memory x fp16 = that over fp16's. weights GB / step = "
    "decoder layers + lm_head as stored (a mixture's step reads the hit experts only).",
    NOTES[2],
)


def build_parser() -> argparse.ArgumentParser:
    """The arguments (`qpn bench model` checks them before it looks for a GPU: a typo exits 2, not 3)."""
    parser = Parser(prog="bench_model.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama8b",
                        help="llama8b (Llama-3.1-8B shapes, default), qwen3moe (Qwen3-30B-A3B shapes) or gptoss20b "
                        "(gpt-oss-20b shapes: fp16 vs MXFP4 experts)")
    parser.add_argument("--layers", type=integer_in(1, MAX_LAYERS, "--layers"), default=None,
                        help="decoder layers (default: the model's, 32 / 48 / 24; --tiny: 2)")
    parser.add_argument("--batches", type=integers_in(1, MAX_BATCH, "batch size", "1,8,32"), default=BATCHES,
                        help="comma-separated batch sizes (default 1,8,32,64,128)")
    parser.add_argument("--graphs", type=_methods, default=GRAPH_METHODS, help="comma-separated: manual,compile")
    parser.add_argument("--compile-budget-s", type=_seconds, default=180.0,
                        help="skip the remaining compile rows once the run has spent this long on them (inf: never)")
    parser.add_argument("--tiny", action="store_true", help="small dims, a few layers (runs on a CPU; for the test)")
    parser.add_argument("--device", choices=DEVICES, default=None, help="cuda (default when available) or cpu")
    bk.add_output_args(parser, None, f"{FULL_NAME}; --tiny: {TINY_NAME}")
    return parser


# the bounds of the numeric arguments: past them a run only fails later (out of memory) or never ends
MAX_LAYERS = 256  # the deepest decoder of the families here has 48; Llama-3.1-405B has 126
MAX_BATCH = 4096  # the static cache holds batch x (PROMPT_LEN + steps) tokens per layer
DEVICES = ("cuda", "cpu")
# --name's defaults: a --tiny run (a test, a CPU) never replaces the committed results/model_h200.*
FULL_NAME, TINY_NAME = "model_h200", "model_tiny"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0:  # NaN included
        raise argparse.ArgumentTypeError(f"must be >= 0 (inf: no budget), got {text!r}")
    return value


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
    shape = MODELS[args.model]
    dims = shape.tiny if args.tiny else shape.dims
    layers = args.layers or dims["num_hidden_layers"]
    env = environment(device, dims, layers, shape)
    print(f"{env['gpu']}: torch {env['torch']}, transformers {env['transformers']}; {layers} layers", flush=True)

    t0 = time.perf_counter()
    model = build_model(dims, layers, device, shape)
    print(f"fp16 model built on {device} in {time.perf_counter() - t0:.1f} s", flush=True)
    linears = variants(model, shape)
    twins = w16_twins(linears, shape)
    sec = new_section(args.tiny, shape)
    sec.notes.extend(GPT_OSS_NOTES if args.model == "gptoss20b" else NOTES)
    json_path = md_path = None
    for method in args.graphs:
        budget = time.perf_counter() + args.compile_budget_s
        run_method(method, model, linears, args.batches, device, args, sec, budget, shape, twins)
        # after every method: a timeout keeps the rest
        json_path, md_path = write(env, sec, args.out, args.name or (TINY_NAME if args.tiny else FULL_NAME))
    print(bk.render_markdown(env, [sec]).split("\n", 3)[-1], flush=True)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
