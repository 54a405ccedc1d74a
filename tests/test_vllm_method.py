"""qpn's vLLM linear method, driven through vLLM's call sequence by tests/vllm_standin.py (CPU).

The stand-in runs where vLLM is not installed (the main test environment): it keeps the method's
sharding arithmetic under test there, and covers what real vLLM cannot run on a 2-core machine
without GPUs: tensor-parallel ranks of 2 and 4 side by side in one process (QKV with replicated KV
heads, row-parallel partial sums and the rank-0 bias, shard sizes off the 32-row tile), fused-on-disk
tensors, and bad tensors fed to each loader. Real vLLM's classes, config parsing, plugin discovery
and `LLM()` are tested in tests/test_vllm_real.py. With vLLM installed this module skips: vLLM's own
UnquantizedLinearMethod and parameters need vLLM's distributed state, which the stand-in does not
create.

Reference: the docs/DESIGN.md contract W16 from qpn.ref (vllm_standin.contract_w16) and qpn.ref.linear /
linear_bounds: a correct layer returns, per element, a value inside linear_bounds(x, W16) (fp32-or-
wider accumulation in any order, one RN16; derivation in ref/linear.py). Weights are compared byte
for byte. Row-parallel sums use the bound derived in vllm_standin.all_reduce_bounds.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_standin as st  # noqa: E402

from qpn import ref  # noqa: E402
from qpn.ref.formats import weight_format  # noqa: E402
from qpn.torch_bridge import packed_weight_class  # noqa: E402
from qpn.torch_bridge import vllm as vm  # noqa: E402

if vm.VLLM_AVAILABLE:
    pytest.skip("vLLM is installed: the stand-in stands in for it only where it is absent (module docstring); "
                "tests/test_vllm_real.py runs the real classes", allow_module_level=True)

HIDDEN = 128
HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 32
INTERMEDIATE = 256
M_VALUES = (1, 5, 40)
ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN")
MAIN_ALGOS = ("NVFP4", "FP8")  # the per-tensor-scale formats whose fused shards carry one scale each
ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
# weight ranges per shard: different amax -> different weight_scale_2 / FP8 scales per shard
SHARD_RANGES = {f"{ATTN}.q_proj": 1.0, f"{ATTN}.k_proj": 2.0, f"{ATTN}.v_proj": 0.5, f"{ATTN}.o_proj": 1.5,
                f"{MLP}.gate_proj": 1.0, f"{MLP}.up_proj": 3.0, f"{MLP}.down_proj": 0.75}
SHAPES = {f"{ATTN}.q_proj": (HEADS * HEAD_SIZE, HIDDEN), f"{ATTN}.k_proj": (KV_HEADS * HEAD_SIZE, HIDDEN),
          f"{ATTN}.v_proj": (KV_HEADS * HEAD_SIZE, HIDDEN), f"{ATTN}.o_proj": (HIDDEN, HEADS * HEAD_SIZE),
          f"{MLP}.gate_proj": (INTERMEDIATE, HIDDEN), f"{MLP}.up_proj": (INTERMEDIATE, HIDDEN),
          f"{MLP}.down_proj": (HIDDEN, INTERMEDIATE)}
SHARDS = {f"{ATTN}.qkv_proj": [f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj"],
          f"{ATTN}.o_proj": [f"{ATTN}.o_proj"],
          f"{MLP}.gate_up_proj": [f"{MLP}.gate_proj", f"{MLP}.up_proj"],
          f"{MLP}.down_proj": [f"{MLP}.down_proj"]}
COLUMN_LAYERS = (f"{ATTN}.qkv_proj", f"{MLP}.gate_up_proj")
ROW_LAYERS = (f"{ATTN}.o_proj", f"{MLP}.down_proj")


def block_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (SHARD_RANGES[name] * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in SHAPES.items()}


def build_block(quant_config, tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.nn.Module]:
    """The linear layers of one transformer block, as vLLM's Llama builds them."""
    kw = dict(quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size)
    return {
        f"{ATTN}.qkv_proj": st.QKVParallelLinear(HIDDEN, HEAD_SIZE, HEADS, KV_HEADS, prefix=f"{ATTN}.qkv_proj", **kw),
        f"{ATTN}.o_proj": st.RowParallelLinear(HEADS * HEAD_SIZE, HIDDEN, prefix=f"{ATTN}.o_proj", **kw),
        f"{MLP}.gate_up_proj": st.MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, prefix=f"{MLP}.gate_up_proj",
                                                             **kw),
        f"{MLP}.down_proj": st.RowParallelLinear(INTERMEDIATE, HIDDEN, prefix=f"{MLP}.down_proj", **kw),
    }


def load_block(folder, tp_rank: int = 0, tp_size: int = 1, reader: str = "qpn.ref"):
    layers = build_block(st.get_quant_config(folder), tp_rank, tp_size)
    st.load_layers(folder, layers, reader)
    return layers


def layer_w16(quantized, fused_name: str) -> np.ndarray:
    return np.concatenate([st.contract_w16(quantized[s]) for s in SHARDS[fused_name]], axis=0)


def x_of(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed + m).standard_normal((m, k)).astype(np.float16))


assert_within_linear_bounds = st.assert_within_linear_bounds


def same_bits(a: torch.Tensor, b) -> bool:
    b = torch.as_tensor(b)
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(scope="module")
def block_checkpoints(tmp_path_factory):
    """{algo: (folder, {layer: qpn.ref linear})}: one ModelOpt checkpoint per algorithm."""
    weights = block_weights()
    out = {}
    for algo in ALGOS:
        folder = str(tmp_path_factory.mktemp(f"block_{algo.lower()}"))
        quantized = st.write_checkpoint(folder, algo, {name: (algo, w) for name, w in weights.items()})
        out[algo] = (folder, quantized)
    return out


# ----------------------------------------------------------------------------- unsharded


@pytest.mark.parametrize("algo", ALGOS)
def test_unsharded_layers_equal_the_contract(block_checkpoints, algo):
    folder, quantized = block_checkpoints[algo]
    layers = load_block(folder)
    expected_method = vm.QPNNVFP4LinearMethod if "NVFP4" in algo else vm.QPNFP8LinearMethod
    for name, layer in layers.items():
        assert type(layer.quant_method) is expected_method
        w16 = layer_w16(quantized, name)
        assert same_bits(layer.quant_method.dequantized_weight(layer), w16), name
        for m in M_VALUES:
            x = x_of(m, layer.input_size)
            assert_within_linear_bounds(layer(x), x, w16)
        # the checkpoint-layout parameters are gone; only the prepacked buffers stay
        names = {n for n, _ in layer.named_parameters()}
        assert not names & {"weight", "weight_scale", "weight_scale_2", "input_scale"}, names


@pytest.mark.parametrize("algo", ALGOS)
def test_layers_carry_their_format_description(block_checkpoints, algo):
    """process_weights_after_loading leaves the packed weight of the layer's layout (its class is the
    description's: qpn.ref.formats), whose buffers are the layer's qpn_<name> Parameters with its shapes."""
    folder, _ = block_checkpoints[algo]
    kind = vm.config.LAYER_ALGOS[algo]  # "nvfp4", "fp8_tensor", "fp8_channel"
    wf = weight_format("nvfp4") if kind == "nvfp4" else weight_format("fp8", kind.removeprefix("fp8_"))
    for name, layer in load_block(folder).items():
        assert layer.qpn_weight.weight_format is wf and type(layer.qpn_weight) is packed_weight_class(wf), name
        shapes = wf.buffer_shapes(layer.qpn_codes.shape[0], layer.input_size_per_partition)
        assert {b: tuple(t.shape) for b, t in layer.qpn_weight.buffers.items()} == shapes, name
        assert all(t is getattr(layer, f"qpn_{b}") for b, t in layer.qpn_weight.buffers.items()), name


@pytest.mark.parametrize("algo", MAIN_ALGOS)
@pytest.mark.parametrize("fused", COLUMN_LAYERS)
def test_fused_shards_keep_their_own_scales(block_checkpoints, algo, fused):
    """Each q/k/v (gate/up) shard computes with exactly its own W16; max() over the shard scales would not."""
    folder, quantized = block_checkpoints[algo]
    layer = load_block(folder)[fused]
    shards = SHARDS[fused]
    scales = [float(quantized[s].global_scale if algo == "NVFP4" else quantized[s].weight_scale) for s in shards]
    assert len(set(scales)) == len(scales), "precondition: the shards' scales differ"
    w16 = layer.quant_method.dequantized_weight(layer)
    x = x_of(3, HIDDEN)
    y = layer(x)
    row = 0
    for shard in shards:
        own = st.contract_w16(quantized[shard])
        n = own.shape[0]
        assert same_bits(w16[row:row + n], own), shard
        assert_within_linear_bounds(y[:, row:row + n], x, own)
        if float(quantized[shard].global_scale if algo == "NVFP4" else quantized[shard].weight_scale) < max(scales):
            # what a max()-collapsed scale without requantized blocks would compute: a different weight
            linear = quantized[shard]
            if algo == "NVFP4":
                wrong = ref.nvfp4_dequantize(linear.weight_packed, linear.weight_scale, np.float32(max(scales)))
            else:
                wrong = st.contract_w16(ref.FP8Linear(shard, linear.weight, np.float32(max(scales)), "tensor"))
            assert not same_bits(w16[row:row + n], wrong), shard
        row += n


def test_apply_flattens_leading_dims_and_adds_bias_rounded_once(tmp_path):
    """apply: x [B, T, K] -> [B, T, N]; bias: RN16(y + b) (exact sum, one rounding); M = 0 is empty."""
    w = (np.random.default_rng(3).standard_normal((96, 128))).astype(np.float32)  # N = 96: 3 tiles
    st.write_checkpoint(str(tmp_path), "NVFP4", {"proj": ("NVFP4", w)},
                        unquantized={"proj.bias": np.linspace(-2, 2, 96).astype(np.float16)})
    quant_config = st.get_quant_config(str(tmp_path))
    layer = st.ColumnParallelLinear(128, 96, bias=True, quant_config=quant_config, prefix="proj")
    st.load_layers(str(tmp_path), {"proj": layer})
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((2, 3, 128)).astype(np.float16))
    y = layer(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.float16
    y_nobias = layer.quant_method.apply(layer, x.reshape(6, 128))
    expected = (y_nobias.double() + layer.bias.double()).half()  # exact sum, one RN16
    assert same_bits(y.reshape(6, 96), expected)
    assert layer.quant_method.apply(layer, x[:0, 0]).shape == (0, 96)


@pytest.mark.parametrize("algo", MAIN_ALGOS)
def test_gated_epilogue_equals_linear_then_silu_and_mul(block_checkpoints, algo):
    folder, _ = block_checkpoints[algo]
    layer = load_block(folder)[f"{MLP}.gate_up_proj"]
    for m in M_VALUES:
        x = x_of(m, HIDDEN)
        gated = layer.quant_method.apply_gated(layer, x)
        assert gated.shape == (m, INTERMEDIATE)
        assert same_bits(gated, st.silu_and_mul(layer(x)))


# ----------------------------------------------------------------------------- tensor parallel (simulated)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("fused", COLUMN_LAYERS)
def test_column_parallel_ranks_concatenate_bit_identically(block_checkpoints, algo, fused):
    folder, _ = block_checkpoints[algo]
    full = load_block(folder)[fused]
    ranks = [load_block(folder, r, 2)[fused] for r in range(2)]
    for m in M_VALUES:
        x = x_of(m, HIDDEN)
        assert same_bits(st.unshard_columns(ranks, [layer(x) for layer in ranks]), full(x))
    weights = [layer.quant_method.dequantized_weight(layer).T.contiguous() for layer in ranks]
    assert same_bits(st.unshard_columns(ranks, weights).T.contiguous(), full.quant_method.dequantized_weight(full))


@pytest.mark.parametrize("algo", MAIN_ALGOS)
def test_qkv_with_replicated_kv_heads(block_checkpoints, algo):
    """tp_size 4 > 2 KV heads: each rank holds one KV head, two ranks share it (num_kv_head_replicas 2)."""
    folder, _ = block_checkpoints[algo]
    quant_config = st.get_quant_config(folder)
    name = f"{ATTN}.qkv_proj"
    full = load_block(folder)[name]
    ranks = []
    for r in range(4):
        layer = st.QKVParallelLinear(HIDDEN, HEAD_SIZE, HEADS, KV_HEADS, quant_config=quant_config, prefix=name,
                                     tp_rank=r, tp_size=4)
        st.load_layers(folder, {name: layer})
        assert layer.qpn_geometry.source_ranks == (r, r // 2, r // 2)
        ranks.append(layer)
    x = x_of(5, HIDDEN)
    assert same_bits(st.unshard_columns(ranks, [layer(x) for layer in ranks]), full(x))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("name", ROW_LAYERS)
def test_row_parallel_partials_sum_to_the_unsharded_within_the_bound(block_checkpoints, algo, name):
    folder, quantized = block_checkpoints[algo]
    full = load_block(folder)[name]
    ranks = [load_block(folder, r, 2)[name] for r in range(2)]
    w16 = layer_w16(quantized, name)
    k_part = w16.shape[1] // 2
    for r, layer in enumerate(ranks):  # each rank holds exactly its input columns of the contract W16
        assert same_bits(layer.quant_method.dequantized_weight(layer), w16[:, r * k_part:(r + 1) * k_part])
    for m in M_VALUES:
        x = x_of(m, w16.shape[1])
        x_parts = [x[:, r * k_part:(r + 1) * k_part].contiguous() for r in range(2)]
        partials = [layer.quant_method.apply(layer, xp) for layer, xp in zip(ranks, x_parts, strict=True)]
        out = (partials[0].double() + partials[1].double()).half()  # the 2-rank all-reduce: RN16(y0 + y1)
        low, high, bound = st.all_reduce_bounds([p.numpy() for p in x_parts],
                                                [w16[:, r * k_part:(r + 1) * k_part] for r in range(2)],
                                                x.numpy(), w16)
        outn = out.numpy()
        assert ((low <= outn) & (outn <= high)).all()
        assert (np.abs(outn.astype(np.float64) - ref.linear(x.numpy(), w16)) <= bound).all()
        unsharded = full(x).numpy().astype(np.float64)
        full_error = ref.linear_error_bound(x.numpy(), w16)
        assert (np.abs(outn.astype(np.float64) - unsharded) <= bound + full_error).all()


def test_row_parallel_adds_the_bias_on_rank_zero_only(tmp_path):
    w = np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32)
    bias = np.linspace(-1, 1, 64).astype(np.float16)
    st.write_checkpoint(str(tmp_path), "FP8", {"down": ("FP8", w)}, unquantized={"down.bias": bias})
    quant_config = st.get_quant_config(str(tmp_path))
    ranks = []
    for r in range(2):
        layer = st.RowParallelLinear(128, 64, bias=True, quant_config=quant_config, prefix="down", tp_rank=r,
                                     tp_size=2, all_reduce=lambda t: t)
        st.load_layers(str(tmp_path), {"down": layer})
        ranks.append(layer)
    x = x_of(3, 64, seed=9)
    assert same_bits(ranks[1](x), ranks[1].quant_method.apply(ranks[1], x))
    plain = ranks[0].quant_method.apply(ranks[0], x)
    assert same_bits(ranks[0](x), (plain.double() + torch.from_numpy(bias).double()).half())


# ----------------------------------------------------------------------------- fused on disk, readers


@pytest.mark.parametrize("algo", MAIN_ALGOS)
@pytest.mark.parametrize("tp_size", (1, 2))
def test_fused_on_disk_tensor_without_shard_id(tmp_path, algo, tp_size):
    """A gate_up_proj stored fused (Phi-3 style, one scale): no shard id; split by the unsharded sizes."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((2 * INTERMEDIATE, HIDDEN)).astype(np.float32)
    quantized = st.write_checkpoint(str(tmp_path), algo, {f"{MLP}.gate_up_proj": (algo, w)})
    w16 = st.contract_w16(quantized[f"{MLP}.gate_up_proj"])
    quant_config = st.get_quant_config(str(tmp_path), packed_modules_mapping={})
    ranks = []
    for r in range(tp_size):
        layer = st.MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, quant_config=quant_config,
                                              prefix=f"{MLP}.gate_up_proj", tp_rank=r, tp_size=tp_size)
        st.load_layers(str(tmp_path), {f"{MLP}.gate_up_proj": layer})
        ranks.append(layer)
    weights = [layer.quant_method.dequantized_weight(layer).T.contiguous() for layer in ranks]
    assert same_bits(st.unshard_columns(ranks, weights).T.contiguous(), w16)


def test_safetensors_reader_gives_the_same_layers(block_checkpoints):
    """vLLM reads safetensors with safe_open(framework="pt"); the result equals qpn.ref's reader."""
    folder, _ = block_checkpoints["NVFP4"]
    a, b = load_block(folder, 1, 2), load_block(folder, 1, 2, reader="safetensors")
    x = x_of(4, HIDDEN)
    for name in COLUMN_LAYERS:
        assert same_bits(a[name](x), b[name](x))


def test_hf_quant_config_json_checkpoint(tmp_path):
    """Older ModelOpt checkpoints: no quantization_config in config.json, hf_quant_config.json instead."""
    weights = block_weights(seed=2)
    hf = {"producer": {"name": "modelopt", "version": "0.19.0"},
          "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                           "exclude_modules": ["lm_head"]}}
    quantized = st.write_checkpoint(str(tmp_path), "NVFP4", {n: ("NVFP4", w) for n, w in weights.items()},
                                    hf_quant_config=hf)
    assert "quantization_config" not in json.load(open(os.path.join(tmp_path, "config.json")))
    layers = load_block(str(tmp_path))
    name = f"{MLP}.gate_up_proj"
    assert same_bits(layers[name].quant_method.dequantized_weight(layers[name]), layer_w16(quantized, name))


# ----------------------------------------------------------------------------- excluded and mixed precision


def test_excluded_layers_run_unquantized_and_shard(tmp_path):
    weights = block_weights(seed=4)
    o_proj = f"{ATTN}.o_proj"
    w_o = weights.pop(o_proj).astype(np.float16)
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head", "*.o_proj"]}
    st.write_checkpoint(str(tmp_path), "NVFP4", {n: ("NVFP4", w) for n, w in weights.items()},
                        unquantized={f"{o_proj}.weight": w_o}, quantization_config=qc)
    full = load_block(str(tmp_path))
    ranks = [load_block(str(tmp_path), r, 2) for r in range(2)]
    assert type(full[o_proj].quant_method) is vm.QPNUnquantizedLinearMethod
    assert type(full[f"{ATTN}.qkv_proj"].quant_method) is vm.QPNNVFP4LinearMethod
    x = x_of(3, HEADS * HEAD_SIZE)
    assert_within_linear_bounds(full[o_proj](x), x, w_o)
    for r in range(2):  # row-parallel: each rank holds its input columns of the fp16 weight
        k = HEADS * HEAD_SIZE // 2
        assert same_bits(ranks[r][o_proj].weight.data, w_o[:, r * k:(r + 1) * k])


def test_fused_layer_with_partly_excluded_shards_is_an_error():
    config = vm.QPNConfig.from_config({"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["*.q_proj"]})
    with pytest.raises(ValueError, match="qkv_proj.*quantized differently"):
        st.QKVParallelLinear(HIDDEN, HEAD_SIZE, HEADS, KV_HEADS, quant_config=config, prefix=f"{ATTN}.qkv_proj")


def test_mixed_precision_checkpoint(tmp_path):
    """MIXED_PRECISION: attention in per-tensor FP8, gate_up NVFP4, down per-channel FP8, o_proj unquantized."""
    weights = block_weights(seed=6)
    o_proj = f"{ATTN}.o_proj"
    w_o = weights.pop(o_proj).astype(np.float16)
    algo_of = {f"{ATTN}.q_proj": "FP8", f"{ATTN}.k_proj": "FP8", f"{ATTN}.v_proj": "FP8",
               f"{MLP}.gate_proj": "NVFP4", f"{MLP}.up_proj": "NVFP4", f"{MLP}.down_proj": "FP8_PER_CHANNEL_PER_TOKEN"}
    quantized = st.write_checkpoint(str(tmp_path), "MIXED_PRECISION",
                                    {n: (algo_of[n], w) for n, w in weights.items()},
                                    unquantized={f"{o_proj}.weight": w_o})
    layers = load_block(str(tmp_path))
    methods = {name: (type(layer.quant_method).__name__, getattr(layer.quant_method, "granularity", None))
               for name, layer in layers.items()}
    assert methods == {f"{ATTN}.qkv_proj": ("QPNFP8LinearMethod", "tensor"),
                       o_proj: ("QPNUnquantizedLinearMethod", None),
                       f"{MLP}.gate_up_proj": ("QPNNVFP4LinearMethod", None),
                       f"{MLP}.down_proj": ("QPNFP8LinearMethod", "channel")}
    for name, layer in layers.items():
        w16 = w_o if name == o_proj else layer_w16(quantized, name)
        x = x_of(4, layer.input_size)
        assert_within_linear_bounds(layer(x), x, w16)


def test_mixed_precision_shards_must_agree():
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
    config = vm.QPNConfig.from_config({**mixed, "quantized_layers": {
        f"{MLP}.gate_proj": {"quant_algo": "NVFP4", "group_size": 16}, f"{MLP}.up_proj": {"quant_algo": "FP8"}}})
    with pytest.raises(ValueError, match="gate_up_proj.*quantized differently"):
        st.MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, quant_config=config, prefix=f"{MLP}.gate_up_proj")
    # a layer listed under its fused name, and an ancestor entry covering a whole subtree
    config = vm.QPNConfig.from_config({**mixed, "quantized_layers": {
        f"{MLP}.gate_up_proj": {"quant_algo": "NVFP4"}, ATTN: {"quant_algo": "FP8"}}})
    assert config.layer_algo(f"{MLP}.gate_up_proj") == "NVFP4"
    assert config.layer_algo(f"{ATTN}.qkv_proj") == "FP8"
    assert config.layer_algo(f"{MLP}.down_proj") is None


# ----------------------------------------------------------------------------- errors


def test_misaligned_input_partition_is_a_clear_error():
    nvfp4 = vm.QPNConfig("NVFP4")
    with pytest.raises(ValueError, match=r"multiple of 64, got K_part=96 .*tp_size=2"):
        st.RowParallelLinear(192, 64, quant_config=nvfp4, prefix="down", tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"multiple of 16, got K_part=40"):
        st.RowParallelLinear(80, 64, quant_config=vm.QPNConfig("FP8"), prefix="down", tp_rank=0, tp_size=2)


@pytest.mark.parametrize("same_scale", (True, False))
def test_shard_partitions_off_the_32_row_tile(tmp_path, same_scale):
    """gate/up of 40 rows each: equal global scales run (N padded to 96 and cropped); different ones cannot
    share a 32-row tile (one global scale per tile; max() is never taken), so each shard is packed in its own
    tiles (40 -> 64 rows each, 128 in all) and apply keeps the real rows: every W16 the contract's, exactly."""
    rng = np.random.default_rng(8)
    gate = rng.standard_normal((40, HIDDEN)).astype(np.float32)
    up = gate[::-1].copy() if same_scale else 3 * gate  # same amax -> same weight_scale_2
    quantized = st.write_checkpoint(str(tmp_path), "NVFP4", {f"{MLP}.gate_proj": ("NVFP4", gate),
                                                             f"{MLP}.up_proj": ("NVFP4", up)})
    layer = st.MergedColumnParallelLinear(HIDDEN, [40, 40], quant_config=st.get_quant_config(str(tmp_path)),
                                          prefix=f"{MLP}.gate_up_proj")
    st.load_weights({f"{MLP}.gate_up_proj": layer}, st.checkpoint_weights(str(tmp_path)))
    g = layer.weight_scale_2.data.clone()
    assert bool(g[0] == g[1]) == same_scale
    layer.quant_method.process_weights_after_loading(layer)
    # equal scales: one layer padded inside (96 rows), cropped in apply; different: each shard in its own tiles
    assert layer.qpn_codes.shape[0] == (96 if same_scale else 128)
    assert hasattr(layer, "qpn_row_index") != same_scale
    w16 = np.concatenate([st.contract_w16(quantized[f"{MLP}.{s}_proj"]) for s in ("gate", "up")])
    got = layer.quant_method.dequantized_weight(layer).numpy()
    assert np.array_equal(got.view(np.uint16), w16.view(np.uint16))
    x = x_of(3, HIDDEN)
    y = layer(x)
    assert y.shape == (3, 80)
    assert_within_linear_bounds(y, x, w16)
    bias = torch.arange(80, dtype=torch.float16) / 8  # lands on the real rows: one rounding of y + b
    with_bias = layer.quant_method.apply(layer, x, bias)
    assert torch.equal(with_bias, (y.float() + bias.float()).half())


def test_loader_rejects_wrong_tensors(block_checkpoints):
    folder, quantized = block_checkpoints["NVFP4"]
    layers = build_block(st.get_quant_config(folder))
    qkv = layers[f"{ATTN}.qkv_proj"]
    q = quantized[f"{ATTN}.q_proj"]
    weight = torch.from_numpy(np.array(q.weight_packed))
    with pytest.raises(ValueError, match="weight must be torch.uint8"):
        qkv.weight.weight_loader(qkv.weight, weight.to(torch.float16), "q")
    with pytest.raises(ValueError, match="shard 'k' must have 64 rows"):
        qkv.weight.weight_loader(qkv.weight, weight, "k")
    with pytest.raises(ValueError, match="shard ids"):
        qkv.weight.weight_loader(qkv.weight, weight, 0)
    with pytest.raises(ValueError, match="takes no shard id"):
        o = layers[f"{ATTN}.o_proj"]
        o.weight.weight_loader(o.weight, torch.zeros(HIDDEN, HEADS * HEAD_SIZE // 2, dtype=torch.uint8), "q")
    with pytest.raises(ValueError, match="one float32 per logical shard"):
        qkv.weight_scale_2.weight_loader(qkv.weight_scale_2, torch.ones(2), "v")
    # everything but v_proj's tensors: process names what is missing
    weights = [(n, t) for n, t in st.checkpoint_weights(folder) if n.startswith(ATTN) and ".v_proj." not in n]
    st.load_weights({f"{ATTN}.qkv_proj": qkv}, [(n, t) for n, t in weights if "o_proj" not in n])
    with pytest.raises(ValueError, match=r"never loaded weight \['v'\], weight_scale \['v'\], weight_scale_2 \['v'\]"):
        qkv.quant_method.process_weights_after_loading(qkv)


# ----------------------------------------------------------------------------- config and plugin


def test_config_reads_both_modelopt_config_forms():
    flat = vm.QPNConfig.from_config({"quant_method": "modelopt", "quant_algo": "nvfp4", "group_size": 16,
                                     "ignore": ["lm_head", "model.layers.0.*"], "producer": {"name": "modelopt"}})
    nested = vm.QPNConfig.from_config({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8",
        "exclude_modules": ["lm_head", "model.layers.0.*"]}})
    for config in (flat, nested):
        assert (config.quant_algo, config.exclude_modules) == ("NVFP4", ["lm_head", "model.layers.0.*"])
        assert config.layer_algo("model.layers.0.mlp.down_proj") is None
        assert config.layer_algo("model.layers.1.mlp.gate_up_proj") == "NVFP4"
    assert nested.kv_cache_quant_algo == "FP8"
    assert (vm.QPNConfig.get_name(), vm.QPNConfig.get_min_capability()) == ("qpn", 75)
    assert vm.QPNConfig.get_supported_act_dtypes() == [torch.float16, torch.bfloat16]
    assert vm.QPNConfig.get_config_filenames() == []  # vLLM reads both forms itself (config.py docstring)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, "not supported by qpn"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "reads ModelOpt checkpoints"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size must be 16"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "non-empty quantized_layers"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"a.b": {"quant_algo": "MXFP8"}}}, "algorithms qpn does not run"),
    ({"quant_method": "modelopt"}, "quant_algo is missing"),
])
def test_config_errors(config, message):
    with pytest.raises(ValueError, match=message):
        vm.QPNConfig.from_config(config)


def test_override_claims_modelopt_only_when_asked():
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    hf_form = {"quant_method": "modelopt_fp4", "producer": {"name": "modelopt"},
               "quantization": {"quant_algo": "MIXED_PRECISION"}}
    assert vm.QPNConfig.override_quantization_method(nvfp4, "qpn") == "qpn"
    assert vm.QPNConfig.override_quantization_method(hf_form, "qpn", hf_config=None) == "qpn"
    assert vm.QPNConfig.override_quantization_method(nvfp4, None) is None  # vLLM's own ModelOpt path stays default
    assert vm.QPNConfig.override_quantization_method(nvfp4, "modelopt_fp4") is None
    assert vm.QPNConfig.override_quantization_method({"quant_method": "gptq"}, None) is None
    assert vm.QPNConfig.override_quantization_method({**nvfp4, "quant_algo": "FP8_PB_WO"}, "qpn") == "qpn"


@pytest.mark.parametrize("config, reason", [
    ({"quant_method": "gptq", "bits": 4}, "runs ModelOpt checkpoints"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "load_quantized"),
    ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, "does not run ModelOpt quant_algo 'MXFP8'"),
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A8_AWQ"}}, "'W4A8_AWQ'"),
])
def test_override_refuses_what_qpn_cannot_run_with_the_reason(config, reason):
    """Asked for quantization="qpn" on a checkpoint it cannot run, say why (vLLM would only say that the
    checkpoint's method does not match "qpn"); not asked, stay silent."""
    with pytest.raises(ValueError, match=reason):
        vm.QPNConfig.override_quantization_method(config, "qpn")
    assert vm.QPNConfig.override_quantization_method(config, None) is None


def test_non_linear_layers():
    config = vm.QPNConfig("NVFP4", exclude_modules=["lm_head"])

    class Attention(torch.nn.Module):
        pass

    class ParallelLMHead(torch.nn.Module):
        pass

    class FusedMoE(torch.nn.Module):
        global_num_experts = 2
        ckpt_gate_proj_name, ckpt_up_proj_name, ckpt_down_proj_name = "gate_proj", "up_proj", "down_proj"

    assert config.get_quant_method(Attention(), "model.layers.0.self_attn.attn") is None
    assert config.get_quant_method(ParallelLMHead(), "lm_head") is None  # excluded
    with pytest.raises(ValueError, match="lm_head"):
        vm.QPNConfig("NVFP4").get_quant_method(ParallelLMHead(), "lm_head")
    with pytest.raises(ValueError, match="'model.layers.0.mlp.experts': qpn's FusedMoE method .* vLLM is not"):
        config.get_quant_method(FusedMoE(), "model.layers.0.mlp.experts")  # quantized experts: vLLM's seam
    assert vm.QPNConfig("NVFP4", exclude_modules=["*.experts.*"]).get_quant_method(
        FusedMoE(), "model.layers.0.mlp.experts") is None  # unquantized experts: vLLM's own method
    mixed = vm.QPNConfig("MIXED_PRECISION", quantized_layers={"model.layers.0.mlp.experts.0.gate_proj": "NVFP4"})
    with pytest.raises(ValueError, match="quantized differently"):
        mixed.get_quant_method(FusedMoE(), "model.layers.0.mlp.experts")


def test_module_imports_without_vllm_and_register_says_why():
    with pytest.raises(RuntimeError, match="needs vLLM"):
        vm.register()


# the names the adapter's documentation promises (torch_bridge/vllm/__init__.py)
PUBLIC_NAMES = ("QPNConfig", "QPNNVFP4LinearMethod", "QPNFP8LinearMethod", "QPNUnquantizedLinearMethod",
                "QPNKVCacheMethod", "register", "VLLM_AVAILABLE")


def test_packaging_ships_the_adapter_and_its_entry_point_names_register():
    """`pip install .` ships only the packages pyproject.toml lists (no discovery), so every package folder
    (an __init__.py) under a listed one must be listed too, the adapter's torch_bridge/vllm/ among them; the
    vllm.general_plugins entry point resolves to register()."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    setuptools = project["tool"]["setuptools"]
    folders = {os.path.normpath(os.path.join(repo, d)): name for name, d in setuptools["package-dir"].items()}
    listed, unlisted = set(setuptools["packages"]), []
    todo = list(folders.items())
    while todo:  # package folders only: a folder without __init__.py (tests/, docs/) is not descended into
        folder, name = todo.pop()
        for sub in sorted(os.listdir(folder)):
            path = os.path.join(folder, sub)
            if os.path.isfile(os.path.join(path, "__init__.py")) and path not in folders:
                todo.append((path, f"{name}.{sub}"))
                unlisted += [] if f"{name}.{sub}" in listed else [f"{name}.{sub}"]
    assert not unlisted, f"package folders missing from [tool.setuptools] packages: {unlisted}"

    module, _, attr = project["project"]["entry-points"]["vllm.general_plugins"]["qpn"].partition(":")
    assert getattr(importlib.import_module(module), attr) is vm.register
    assert [name for name in PUBLIC_NAMES if not hasattr(vm, name)] == []
