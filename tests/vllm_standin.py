"""A small in-repo stand-in of vLLM's linear layers and weight loading (vLLM is not installable here).

It drives qpn's vLLM linear method through exactly vLLM's call sequence:

    layer.__init__ -> quant_config.get_quant_method(layer, prefix)   (inside LinearBase.__init__)
                   -> quant_method.create_weights(layer, input_size_per_partition,
                          output_partition_sizes, input_size, output_size, params_dtype,
                          weight_loader=layer.weight_loader)
    model.load_weights(checkpoint tensors)  -> param.weight_loader(param, tensor[, shard_id])
    quant_method.process_weights_after_loading(layer)   (for every layer, after all tensors)
    layer.forward(x) -> quant_method.apply(layer, x, bias)

Facts mirrored from vllm/model_executor/layers/linear.py (read, not copied):
- ColumnParallelLinear sets tp_rank, tp_size, input_size_per_partition = input_size,
  output_partition_sizes = [output_size / tp_size] (or [s / tp_size for s in output_sizes] for the
  merged / QKV subclasses) BEFORE LinearBase.__init__ (which sets input_size, output_size and asks
  the config for the method), then gather_output, then create_weights.
- MergedColumnParallelLinear sets output_sizes first; QKVParallelLinear sets head_size, v_head_size,
  total_num_heads, total_num_kv_heads, num_heads = total / tp, num_kv_heads and
  num_kv_head_replicas (tp >= kv heads: 1 head per rank, tp / kv_heads replicas), output_sizes.
- RowParallelLinear: input_size_per_partition = input_size / tp_size, output_partition_sizes =
  [output_size]; input_is_parallel and reduce_results are set before create_weights; forward adds
  the bias on rank 0 only, then all-reduces when reduce_results and tp_size > 1.
- ReplicatedLinear: no sharding.
- A model's load_weights (Llama's) maps checkpoint names through stacked_params_mapping
  (q/k/v_proj -> qkv_proj with shard id "q"/"k"/"v"; gate/up_proj -> gate_up_proj with 0/1) and
  calls param.weight_loader(param, tensor, shard_id); other names call
  param.weight_loader(param, tensor).

Checkpoints are real folders written by qpn.ref.save_checkpoint; `checkpoint_weights` reads them
back with qpn.ref.load_checkpoint (validated) or, like vLLM's safetensors iterator, with
safetensors' safe_open(framework="pt"). The file also holds the reference helpers the tests share
(contract W16, reassembling column-parallel outputs, the all-reduce error bound) and the
tensor-parallel worker used by tests/test_tp_gloo.py and benchmarks/tp_nccl.py.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import Parameter

from qpn import ref
from qpn.ref.geometry import TILE_N
from qpn.torch_bridge import vllm as vm
from qpn.torch_bridge.epilogue import silu_and_mul

STACKED_PARAMS = (  # (fused name, checkpoint name, shard id), as in vLLM's Llama load_weights
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _divide(a: int, b: int) -> int:
    if a % b != 0:
        raise ValueError(f"{a} is not divisible by {b}")
    return a // b


# ----------------------------------------------------------------------------- layers


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, params_dtype, quant_config, prefix: str):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.has_bias = bias
        self.params_dtype = params_dtype or torch.float16
        self.quant_config = quant_config
        self.prefix = prefix
        if quant_config is None:
            self.quant_method = vm.QPNUnquantizedLinearMethod()
        else:
            self.quant_method = quant_config.get_quant_method(self, prefix=prefix)
            if self.quant_method is None:
                raise ValueError("All linear layers should support quant method.")

    def _create(self):
        self.quant_method.create_weights(
            layer=self,
            input_size_per_partition=self.input_size_per_partition,
            output_partition_sizes=self.output_partition_sizes,
            input_size=self.input_size,
            output_size=self.output_size,
            params_dtype=self.params_dtype,
            weight_loader=self.weight_loader,
        )

    def _add_bias(self, rows: int, shard_rows: bool):
        if self.has_bias:
            self.bias = Parameter(torch.empty(rows, dtype=self.params_dtype), requires_grad=False)
            self.bias.output_dim = 0 if shard_rows else None
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        """The layer's own loader (vLLM passes it to create_weights); here it loads biases only."""
        if loaded_shard_id is not None:
            raise ValueError("the stand-in loads biases of unfused layers only")
        if getattr(param, "output_dim", None) is not None:
            rows = param.shape[0]
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * rows, rows)
        param.data.copy_(loaded_weight)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=False, params_dtype=None, quant_config=None, prefix=""):
        self.output_partition_sizes = [output_size]
        super().__init__(input_size, output_size, bias, params_dtype, quant_config, prefix)
        self.tp_rank, self.tp_size = 0, 1
        self.input_size_per_partition = input_size
        self._create()
        self._add_bias(output_size, shard_rows=False)

    def forward(self, x):
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=False, gather_output=False, params_dtype=None,
                 quant_config=None, prefix="", *, tp_rank=0, tp_size=1):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size_per_partition = input_size
        self.output_size_per_partition = _divide(output_size, tp_size)
        self.output_partition_sizes = [self.output_size_per_partition]
        if hasattr(self, "output_sizes"):
            self.output_partition_sizes = [_divide(s, tp_size) for s in self.output_sizes]
        super().__init__(input_size, output_size, bias, params_dtype, quant_config, prefix)
        self.gather_output = gather_output
        self._create()
        self._add_bias(self.output_size_per_partition, shard_rows=True)

    def forward(self, x):
        return self.quant_method.apply(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size, output_sizes, bias=False, params_dtype=None, quant_config=None, prefix="", *,
                 tp_rank=0, tp_size=1):
        if bias:
            raise ValueError("the stand-in's merged layers have no bias")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), False, False, params_dtype, quant_config, prefix,
                         tp_rank=tp_rank, tp_size=tp_size)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=False,
                 params_dtype=None, quant_config=None, prefix="", *, tp_rank=0, tp_size=1):
        if bias:
            raise ValueError("the stand-in's QKV layer has no bias")
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.v_head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = _divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = _divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = _divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        self.output_sizes = [self.num_heads * head_size * tp_size, self.num_kv_heads * head_size * tp_size,
                             self.num_kv_heads * head_size * tp_size]
        super().__init__(hidden_size, sum(self.output_sizes), False, False, params_dtype, quant_config, prefix,
                         tp_rank=tp_rank, tp_size=tp_size)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=False, input_is_parallel=True, params_dtype=None,
                 reduce_results=True, quant_config=None, prefix="", *, tp_rank=0, tp_size=1, all_reduce=None):
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size_per_partition = _divide(input_size, tp_size)
        self.output_size_per_partition = output_size
        self.output_partition_sizes = [output_size]
        super().__init__(input_size, output_size, bias, params_dtype, quant_config, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.all_reduce = all_reduce
        self._create()
        self._add_bias(output_size, shard_rows=False)

    def forward(self, x):
        if not self.input_is_parallel:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        bias = None if self.tp_rank > 0 else self.bias  # the bias is added once, on rank 0
        y = self.quant_method.apply(self, x, bias)
        if self.reduce_results and self.tp_size > 1:
            if self.all_reduce is None:
                raise ValueError("a row-parallel layer with tp_size > 1 needs an all_reduce callable")
            y = self.all_reduce(y)
        return y


# ----------------------------------------------------------------------------- checkpoints


def quantize_linear(name: str, w, algo: str):
    """float32 [N, K] -> a qpn.ref NVFP4Linear / FP8Linear with ModelOpt's rules for `algo`."""
    w = np.asarray(w, dtype=np.float32)
    one = np.array(1.0, dtype=np.float32)
    if algo in ("NVFP4", "W4A16_NVFP4"):
        q = ref.nvfp4_quantize(w)
        return ref.NVFP4Linear(name, q.weight_packed, q.weight_scale, q.weight_scale_2,
                               input_scale=one if algo == "NVFP4" else None)
    granularity = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel", "FP8_PB_WO": "block"}[algo]
    q = ref.fp8_quantize(w, granularity)
    return ref.FP8Linear(name, q.weight, q.weight_scale, granularity, input_scale=one if algo == "FP8" else None)


def write_checkpoint(folder, quant_algo: str, linears: Mapping[str, tuple], unquantized: Mapping | None = None,
                     quantization_config: Mapping | None = None, hf_quant_config: Mapping | None = None):
    """Quantize and save a ModelOpt checkpoint; returns {name: NVFP4Linear | FP8Linear}.

    linears: {layer name: (per-layer algo, float32 weight [N, K])}; unquantized: {tensor name:
    float16 array}; quantization_config (config.json) / hf_quant_config: written as given, else
    save_checkpoint generates an explicit config.
    """
    quantized = {name: quantize_linear(name, w, algo) for name, (algo, w) in linears.items()}
    config = {"architectures": ["StandinForCausalLM"]}
    if quantization_config is not None:
        config["quantization_config"] = dict(quantization_config)
    checkpoint = ref.Checkpoint("modelopt", quant_algo, quantized, dict(unquantized or {}), config, hf_quant_config)
    ref.save_checkpoint(folder, checkpoint)
    return quantized


def _torch_of_stored(tensor) -> torch.Tensor:
    array = np.array(tensor.array)  # a writable copy of the memory-mapped data
    t = torch.from_numpy(array)
    if tensor.dtype == "F8_E4M3":
        return t.view(torch.float8_e4m3fn)
    if tensor.dtype == "BF16":
        return t.view(torch.bfloat16)
    return t


def checkpoint_weights(folder, reader: str = "qpn.ref") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with ModelOpt's names and dtypes, in file order, as vLLM's iterator yields.

    reader "qpn.ref": qpn.ref.load_checkpoint (validated); "safetensors": safe_open(framework="pt").
    """
    if reader == "safetensors":
        from safetensors import safe_open

        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        for file in files:
            with safe_open(os.path.join(folder, file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no items()
                    yield name, f.get_tensor(name)
        return
    ckpt = ref.load_checkpoint(folder)
    for name, linear in ckpt.linears.items():
        if isinstance(linear, ref.NVFP4Linear):
            yield f"{name}.weight", torch.from_numpy(np.array(linear.weight_packed))
            yield f"{name}.weight_scale", torch.from_numpy(np.array(linear.weight_scale)).view(torch.float8_e4m3fn)
            yield f"{name}.weight_scale_2", torch.from_numpy(np.array(linear.global_scale))
        else:
            yield f"{name}.weight", torch.from_numpy(np.array(linear.weight)).view(torch.float8_e4m3fn)
            yield f"{name}.{linear.scale_name}", torch.from_numpy(np.array(linear.weight_scale))
        if linear.input_scale is not None:
            yield f"{name}.input_scale", torch.from_numpy(np.array(linear.input_scale))
    for name, tensor in ckpt.tensors.items():
        yield name, _torch_of_stored(tensor)


def get_quant_config(folder, packed_modules_mapping: Mapping | None = PACKED_MODULES) -> vm.QPNConfig:
    """vLLM's get_quant_config: config.json's quantization_config, else hf_quant_config.json."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    qc = config.get("quantization_config")
    if qc is None:
        with open(os.path.join(folder, "hf_quant_config.json")) as f:
            qc = json.load(f)
    quant_config = vm.QPNConfig.from_config(qc)
    quant_config.packed_modules_mapping = dict(packed_modules_mapping or {})  # the model sets it (vLLM)
    return quant_config


def load_weights(modules: Mapping[str, nn.Module], weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """vLLM's Llama load_weights over {module prefix: layer}; returns the parameter names loaded.

    Tensors of modules not in `modules` are skipped (as vLLM skips another pipeline stage's);
    a tensor of a listed module without a matching parameter is a KeyError, as in vLLM.
    """
    params = {f"{prefix}.{name}": p for prefix, module in modules.items() for name, p in module.named_parameters()}
    loaded = set()
    for name, tensor in weights:
        for fused, shard, shard_id in STACKED_PARAMS:
            if shard in name:
                target, args = name.replace(shard, fused), (shard_id,)
                break
        else:
            target, args = name, ()
        if target.rpartition(".")[0] not in modules:
            continue
        params[target].weight_loader(params[target], tensor, *args)
        loaded.add(target)
    return loaded


def process_weights_after_loading(modules: Mapping[str, nn.Module]) -> None:
    for module in modules.values():
        module.quant_method.process_weights_after_loading(module)


def load_layers(folder, modules: Mapping[str, nn.Module], reader: str = "qpn.ref") -> set[str]:
    loaded = load_weights(modules, checkpoint_weights(folder, reader))
    process_weights_after_loading(modules)
    return loaded


# ----------------------------------------------------------------------------- references


def contract_w16(linear) -> np.ndarray:
    """The docs/DESIGN.md contract weights of a checkpoint layer, float16 [N, K], from qpn.ref.

    NVFP4: RN16(RN32(e2m1 * RN32(e4m3 * g))); FP8: the QPN8 contract RN16(e4m3 * 2^-8 * RN16(256 * s))
    with each row's scale (tensor / channel) or each 128x128 block's (block). A tensor / channel FP8 layer
    of N rows off QPN8's 32-row multiple (a GDN in_proj_ba of 4 rows) is padded with +0 codes of scale 1.0,
    as pack_fp8 pads it, and the pad rows cropped.
    """
    if isinstance(linear, ref.NVFP4Linear):
        return ref.nvfp4_dequantize(linear.weight_packed, linear.weight_scale, linear.global_scale)
    n, k = linear.weight.shape
    if linear.granularity == "block":
        codes, group_scales = ref.qpn8_prepack(linear.weight, linear.weight_scale, "block")
        return ref.qpn8_dequantize(codes, group_scales, n, k)
    n_pad = -(-n // TILE_N) * TILE_N
    rows = np.ones(n_pad, dtype=np.float32)
    rows[:n] = np.broadcast_to(linear.weight_scale, (n,))
    weight = np.zeros((n_pad, k), dtype=linear.weight.dtype)
    weight[:n] = linear.weight
    codes, group_scales = ref.qpn8_prepack(weight, rows, "channel")
    return ref.qpn8_dequantize(codes, group_scales, n_pad, k)[:n]


def assert_within_linear_bounds(y: torch.Tensor, x: torch.Tensor, w16: np.ndarray) -> None:
    """Every output inside ref.linear_bounds(x, W16): fp32-or-wider accumulation, any order, one RN16."""
    lo, hi = ref.linear_bounds(x.numpy(), w16)
    y = y.numpy()
    inside = (lo <= y) & (y <= hi)
    assert inside.all(), f"{int((~inside).sum())} of {y.size} outputs outside the derived bound"


def unshard_columns(layers: list, outputs: list[torch.Tensor]) -> torch.Tensor:
    """Reassemble column-parallel outputs [M, N_part] of all ranks into the unsharded [M, N] layout.

    Each logical shard i (q/k/v, gate/up) is rebuilt from the ranks' slices ordered by the checkpoint
    slice they hold (qpn_geometry.source_ranks; replicated KV heads appear once), then the shards
    are concatenated, as the unsharded layer stacks them.
    """
    geoms = [layer.qpn_geometry for layer in layers]
    shards = []
    for i in range(len(geoms[0].partitions)):
        pieces = {}
        for geom, out in zip(geoms, outputs, strict=True):
            piece = out[:, geom.offsets[i]: geom.offsets[i] + geom.partitions[i]]
            source = geom.source_ranks[i]
            if source in pieces and not torch.equal(pieces[source].view(torch.int16), piece.view(torch.int16)):
                raise AssertionError(f"ranks holding the same slice {source} of shard {i} disagree")
            pieces[source] = piece
        shards.append(torch.cat([pieces[s] for s in sorted(pieces)], dim=1))
    return torch.cat(shards, dim=1)


def _ulp16(values: np.ndarray) -> np.ndarray:
    """float64: the fp16 spacing at |value| (the distance to the next larger fp16 magnitude)."""
    return np.spacing(np.abs(np.asarray(values, dtype=np.float64)).astype(np.float16)).astype(np.float64)


def all_reduce_bounds(x_parts, w16_parts, x_full=None, w16_full=None):
    """Bounds for a two-rank row-parallel result out = RN16(y_0 + y_1).

    x_parts[r]: float16 [M, K_r] (rank r's input columns), w16_parts[r]: float16 [N, K_r] (its weight
    columns); y_r is any fp32-or-wider accumulation of x_r @ w16_r^T rounded once to fp16, so
    y_r in [lo_r, hi_r] = qpn.ref.linear_bounds(x_r, w16_r). The all-reduce of two fp16 values is one
    addition rounded to fp16 (gloo and NCCL alike: a half add, or an fp32 add rounded to fp16, which
    is the same RN16(y_0 + y_1) since fp32 has 24 >= 2 * 11 + 2 bits), and RN16 is monotone, so
        out in [L, H] = [RN16(lo_0 + lo_1), RN16(hi_0 + hi_1)]      (float64 sums are exact).
    Against the unsharded reference ref = qpn.ref.linear(x_full, w16_full) = RN16(S64), S the exact sum:
    |out - ref| <= |out - z| + |z - S| + |S - ref|, z = y_0 + y_1.  |out - z| <= ulp(H,L)/2;
    y_r and S_r both lie in [lo_r - ulp_r/2, hi_r + ulp_r/2] (lo_r = RN16(S64_r - d_r) with d_r >=
    |S64_r - S_r|, qpn/ref/linear.py), so |z - S| <= sum_r (hi_r - lo_r + ulp_r/2);  |S - ref| <=
    ulp(ref)/2 + |S - S64| (the last term is far below one fp16 ulp at these sizes). Rounding every
    half ulp up to a whole one covers that remainder:
        B = sum_r (hi_r - lo_r + ulp_r) + ulp(max(|L|, |H|)) + ulp(ref).
    Returns (L, H, B) as float16, float16, float64 arrays [M, N] (B needs x_full and w16_full).
    """
    lo_sum, hi_sum, spread = 0.0, 0.0, 0.0
    for x, w in zip(x_parts, w16_parts, strict=True):
        lo, hi = ref.linear_bounds(np.asarray(x), np.asarray(w))
        lo64, hi64 = lo.astype(np.float64), hi.astype(np.float64)
        lo_sum, hi_sum = lo_sum + lo64, hi_sum + hi64
        spread = spread + (hi64 - lo64) + _ulp16(np.maximum(np.abs(lo64), np.abs(hi64)))
    with np.errstate(over="ignore"):
        low, high = lo_sum.astype(np.float16), hi_sum.astype(np.float16)
    bound = None
    if x_full is not None:
        reference = ref.linear(np.asarray(x_full), np.asarray(w16_full))
        edge = np.maximum(np.abs(low.astype(np.float64)), np.abs(high.astype(np.float64)))
        bound = spread + _ulp16(edge) + _ulp16(reference)
    return low, high, bound


# ----------------------------------------------------------------------------- a transformer MLP block


class StandinMLP(nn.Module):
    """gate_up_proj (merged column-parallel) -> gated SiLU-and-mul -> down_proj (row-parallel + all-reduce)."""

    def __init__(self, hidden: int, intermediate: int, quant_config, prefix: str, *, tp_rank=0, tp_size=1,
                 all_reduce=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate],
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
                                                       tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = RowParallelLinear(intermediate, hidden, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj", tp_rank=tp_rank, tp_size=tp_size,
                                           all_reduce=all_reduce)
        self.prefix = prefix

    def modules_by_prefix(self) -> dict[str, nn.Module]:
        return {f"{self.prefix}.gate_up_proj": self.gate_up_proj, f"{self.prefix}.down_proj": self.down_proj}

    def forward(self, x) -> dict[str, torch.Tensor]:
        """Every intermediate the tests compare: the raw gate_up output, the gated activation (op epilogue),
        the same from a separate silu_and_mul, this rank's down_proj partial and the reduced output."""
        gate_up = self.gate_up_proj(x)
        act = self.gate_up_proj.quant_method.apply_gated(self.gate_up_proj, x)
        partial = self.down_proj.quant_method.apply(self.down_proj, act, None)
        out = self.down_proj(act)
        return {"gate_up": gate_up, "act": act, "act_separate": silu_and_mul(gate_up), "partial": partial,
                "out": out}


MLP_PREFIX = "model.layers.0.mlp"


def mlp_weights(hidden: int, intermediate: int, seed: int) -> dict[str, np.ndarray]:
    """float32 gate / up / down weights ~ N(0, 1/fan_in) (outputs of order 1 for N(0, 1) inputs, as in a
    trained model, far from fp16 overflow at any size) whose shards differ in range (up 3x gate, down
    0.5x): their ModelOpt global scales differ, so collapsing them with max() would show."""
    rng = np.random.default_rng(seed)
    return {
        f"{MLP_PREFIX}.gate_proj": (rng.standard_normal((intermediate, hidden)) / np.sqrt(hidden)).astype(np.float32),
        f"{MLP_PREFIX}.up_proj": (3.0 * rng.standard_normal((intermediate, hidden)) / np.sqrt(hidden)).astype(
            np.float32),
        f"{MLP_PREFIX}.down_proj": (0.5 * rng.standard_normal((hidden, intermediate)) / np.sqrt(intermediate)).astype(
            np.float32),
    }


def write_mlp_checkpoint(folder, algo: str, hidden: int, intermediate: int, seed: int = 0):
    weights = mlp_weights(hidden, intermediate, seed)
    return write_checkpoint(folder, algo, {name: (algo, w) for name, w in weights.items()})


def mlp_input(m: int, hidden: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed + 1000)
    return torch.from_numpy(rng.standard_normal((m, hidden)).astype(np.float16))


def build_mlp(folder, hidden: int, intermediate: int, *, tp_rank=0, tp_size=1, all_reduce=None,
              device="cpu") -> StandinMLP:
    """The stand-in MLP with its parameters on `device`, loaded from `folder` through the vLLM sequence."""
    quant_config = get_quant_config(folder)
    with torch.device(device):
        mlp = StandinMLP(hidden, intermediate, quant_config, MLP_PREFIX, tp_rank=tp_rank, tp_size=tp_size,
                         all_reduce=all_reduce)
    load_layers(folder, mlp.modules_by_prefix())
    return mlp


def run_mlp(folder, hidden: int, intermediate: int, x: torch.Tensor, *, tp_rank=0, tp_size=1, all_reduce=None,
            device="cpu") -> dict[str, torch.Tensor]:
    """build_mlp, then run x; every result (and this rank's down_proj W16) copied to the CPU."""
    mlp = build_mlp(folder, hidden, intermediate, tp_rank=tp_rank, tp_size=tp_size, all_reduce=all_reduce,
                    device=device)
    results = mlp(x.to(device))
    results["down_w16"] = mlp.down_proj.quant_method.dequantized_weight(mlp.down_proj)
    return {name: t.cpu() for name, t in results.items()}


def tp_worker(rank: int, world_size: int, backend: str, port: int, folders: Mapping[str, str], out_dir: str,
              hidden: int, intermediate: int, m: int, timeout_s: float) -> None:
    """One tensor-parallel rank (torch.multiprocessing.spawn target): for each checkpoint folder, run
    the MLP sharded over `world_size` ranks (gloo on CPU, or NCCL with one GPU per rank) and save the
    results to out_dir/{fmt}_rank{rank}.pt."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a 2-core CI machine
    try:
        import numba

        numba.set_num_threads(1)
    except (ImportError, ValueError):
        pass
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        def all_reduce(t):
            dist.all_reduce(t)
            return t

        for fmt, folder in folders.items():
            x = mlp_input(m, hidden, seed=0)
            results = run_mlp(folder, hidden, intermediate, x, tp_rank=rank, tp_size=world_size,
                              all_reduce=all_reduce, device=device)
            torch.save(results, os.path.join(out_dir, f"{fmt}_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
