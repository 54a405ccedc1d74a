"""A mixture-of-experts checkpoint written by REAL llm-compressor 0.14 on the CPU (tests/fixtures/
compressed_tensors/qwen3moe_nvfp4, made by tests/fixtures/make_ct_moe_fixtures.py; issue 22 part 2):
compressed-tensors NVFP4A16 with every expert a linear of its own. qpn's reader takes it (the global scales
stored as their reciprocal), `qpn pack` + `verify` pass, and load_quantized gives the logits of a model
holding compressed-tensors' own decompression of every linear."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from qpn import ref
from qpn.apps import cli

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "compressed_tensors", "qwen3moe_nvfp4")
LOGIT_BOUND_FACTOR = 28 * 2.0**-11  # tests/test_modelopt_moe_exports.py's derivation (2 attention + 2 MoE stages)


def test_qpn_reads_every_expert_of_llm_compressors_export():
    checkpoint = ref.load_checkpoint(FOLDER)
    assert checkpoint.format == "compressed-tensors"
    experts = {f"model.layers.{i}.mlp.experts.{e}.{r}" for i in range(2) for e in range(8)
               for r in ("gate_proj", "up_proj", "down_proj")}
    assert experts <= set(checkpoint.linears) and len(checkpoint.linears) == len(experts) + 8
    assert all(isinstance(linear, ref.NVFP4Linear) for linear in checkpoint.linears.values())
    assert {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"} <= set(checkpoint.tensors)


def test_pack_and_verify(tmp_path):
    assert cli.main(["pack", FOLDER, str(tmp_path / "packed"), "-q"]) == 0
    assert cli.main(["verify", str(tmp_path / "packed"), "-q"]) == 0


@pytest.mark.parametrize("packed_first", [False, True])
def test_load_quantized_gives_compressed_tensors_logits(tmp_path, packed_first):
    transformers = pytest.importorskip("transformers")
    from qpn.torch_bridge import load_quantized
    from qpn.torch_bridge.experts import QPNExperts

    source = FOLDER
    if packed_first:
        assert cli.main(["pack", FOLDER, str(tmp_path / "packed"), "-q"]) == 0
        source = str(tmp_path / "packed")
    config = transformers.AutoConfig.from_pretrained(FOLDER)
    config.quantization_config = None  # transformers must not try compressed-tensors itself: qpn loads it
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    load_quantized(model, source)
    assert isinstance(model.model.layers[0].mlp.experts, QPNExperts)
    with open(os.path.join(FOLDER, "reference_input_ids.json")) as f:
        ids = torch.tensor(json.load(f)["input_ids"])
    with torch.no_grad():
        got = model(ids).logits.numpy()
    want = np.load(os.path.join(FOLDER, "reference_logits.npy"))
    assert float(np.abs(got - want).max()) <= LOGIT_BOUND_FACTOR * float(np.abs(want).max())
