"""`qpn quantize` output of a MoE model served by real vLLM with quantization="qpn" (issue 39 part 1): FP8 with each
expert projection's own scale (the default, a form ModelOpt's fixtures do not hold) and NVFP4, against
vLLM's own unquantized run of the same W16 (test_vllm_real's dense twin and its MOE_TWIN_FACTOR bound)."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/run runs these tests in its own environment")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, as tests/test_cli.py imports them

import numpy as np  # noqa: E402
from test_quantize_moe import float_moe as float_moe  # noqa: E402 - the fixture, re-exported for pytest
from test_vllm_real import (  # noqa: E402
    MOE_TWIN_FACTOR,
    _assert_logprobs_close,
    _vllm_run,
    _write_dense_twin,
)

from qpn.checkpoints.quantize import quantize_checkpoint  # noqa: E402

pytestmark = pytest.mark.vllm
IDS = [1, 17, 42, 99, 7, 250, 3, 128, 64, 5, 200, 11]  # the MoE fixtures' reference prompt


# fp8-channel: ModelOpt stores an expert's channel scales as [N], vLLM's per-channel loader copies [N, 1] (it failed
# with "output with shape [128, 1] doesn't match the broadcast shape [128, 128]" until qpn's loader reshaped them);
# no ModelOpt fixture holds per-channel experts, so this is the test that serves them.
@pytest.mark.parametrize("fmt", ["fp8", "fp8-channel", "nvfp4"])
def test_vllm_serves_a_quantized_moe_like_its_dense_twin(float_moe, tmp_path, fmt):
    out = tmp_path / "q"
    quantize_checkpoint(float_moe["qwen3moe"], out, fmt)
    got = _vllm_run(out, tmp_path / "q.json", "--quantization", "qpn", "--prompts", json.dumps([IDS]))
    experts = {k: v for k, v in got["quant_methods"].items() if ".experts" in k}
    assert experts and set(experts.values()) == {"QPNFusedMoEMethod"}, got["quant_methods"]
    _write_dense_twin(str(out), tmp_path / "dense")
    dense = _vllm_run(tmp_path / "dense", tmp_path / "dense.json", "--prompts", json.dumps([IDS]))
    reference = np.load(os.path.join(os.path.dirname(__file__), "fixtures", "modelopt", "qwen3moe_fp8",
                                     "reference_logits.npy"))
    _assert_logprobs_close(got, dense, MOE_TWIN_FACTOR * float(np.abs(reference).max()))
