"""gpt-oss's MXFP4 checkpoints in PyTorch and in qpn's tools (issue 23, parts 2 and 4): load_checkpoint reads
the folder as a Checkpoint with stacked experts; load_quantized fills a transformers GptOssForCausalLM built on
the meta device (experts as QPNExperts in QPNMX with biases and swigluoai, attention and router as stored)
whose log-probs follow transformers' own MXFP4 dequantization; `qpn inspect` lists the experts; vLLM's
config reads gpt-oss's quantization_config (the real-vLLM run: tests/test_vllm_real.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from qpn import checkpoints
from qpn.ref import mxfp4 as mx
from qpn.ref.formats import QPNMX

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", "gpt_oss", "tiny_mxfp4")
# tests/test_vllm_real.py's MoE bound (2 MoE layers, the same stages): 88 * 2^-11 * max|logit|
MOE_LOGPROB_FACTOR = 88 * 2.0**-11


def test_load_checkpoint_reads_stacked_experts_and_the_rest_as_stored():
    c = checkpoints.load_checkpoint(FIXTURE)
    assert (c.format, c.quant_algo, dict(c.linears)) == ("gpt-oss", "MXFP4", {})
    assert list(c.experts) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert not any(".experts." in name for name in c.tensors)  # the experts' tensors live in c.experts only
    assert "model.layers.0.self_attn.sinks" in c.tensors and "lm_head.weight" in c.tensors
    experts = c.experts["model.layers.0.mlp.experts"]
    assert experts.w13_blocks.shape == (8, 128, 4, 16) and experts.w13_bias.dtype == np.float32


def _model(meta: bool = True):
    transformers = pytest.importorskip("transformers")
    with open(os.path.join(FIXTURE, "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k != "quantization_config"}
    with torch.device("meta" if meta else "cpu"):
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(**config))


def _logprobs(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return np.array([log_p[i - 1, ids[i]] for i in range(1, len(ids))])


def test_load_quantized_serves_gpt_oss_like_transformers():
    from qpn.torch_bridge import load_quantized
    from qpn.torch_bridge.experts import QPNExperts

    model = _model()
    report = load_quantized(model, FIXTURE)
    assert report.quantized == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert report.missing == [] and report.unexpected == []
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, QPNExperts) and experts.weight_format is QPNMX and experts.activation == "swigluoai"
    # the packed experts hold the checkpoint's MXFP4 values: W16 times each tile's 2^T, gate rows then up
    c = checkpoints.load_checkpoint(FIXTURE)
    w13, _ = experts.packed_experts.expert(3)
    rows = w13.buffers["tile_scale"].repeat_interleave(32)[:, None]
    want = mx.mxfp4_dequantize(c.experts["model.layers.0.mlp.experts"].w13_blocks[3],
                               c.experts["model.layers.0.mlp.experts"].w13_scales[3])
    assert torch.equal(w13.dequantize().float() * rows, torch.from_numpy(want))
    with open(os.path.join(FIXTURE, "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    logits = np.load(os.path.join(FIXTURE, "reference_logits.npy"))[0].astype(np.float64)
    with torch.no_grad():
        got = model.float().eval()(torch.tensor([ids])).logits[0].double().numpy()
    worst = float(np.abs(_logprobs(got, ids) - _logprobs(logits, ids)).max())
    assert worst <= MOE_LOGPROB_FACTOR * float(np.abs(logits).max()), worst


def test_load_quantized_refuses_experts_of_another_shape_and_leaves_the_model():
    from qpn.torch_bridge import load_quantized

    transformers = pytest.importorskip("transformers")
    model = _model(meta=False)
    config = model.config.to_dict()
    config["intermediate_size"] = 128  # the checkpoint's experts have I = 64
    other = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"are \(E, H, I\) = \(8, 128, 64\) but the model's model.layers.0"):
        load_quantized(other, FIXTURE)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_qpn_inspect_lists_the_experts(capsys):
    from qpn.apps.cli import main

    assert main(["inspect", FIXTURE]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.w2" in out and "mxfp4 x8" in out and "4 quantized layers" in out


def test_vllm_config_reads_gpt_oss_quantization_config():
    from qpn.torch_bridge import vllm as vm

    with open(os.path.join(FIXTURE, "config.json")) as f:
        section = json.load(f)["quantization_config"]
    assert vm.QPNConfig.override_quantization_method(section, "qpn") == "qpn"
    assert vm.QPNConfig.override_quantization_method(section, None) is None  # not asked: vLLM's own method
    config = vm.QPNConfig.from_config(section)
    assert config.quant_algo == "MXFP4" and config.exclude_modules == section["modules_to_not_convert"]
    assert config.layer_algo("model.layers.0.mlp.router") is None
    assert config._algo_of("model.layers.0.mlp.experts.3.gate_proj") == "MXFP4"


def test_qpn_pack_says_it_does_not_pack_stacked_experts_and_writes_nothing(tmp_path, capsys):
    from qpn.apps.cli import main

    assert main(["pack", FIXTURE, str(tmp_path / "out")]) == 2
    assert "qpn pack does not write stacked experts yet; use the original folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
