"""`qpn.from_pretrained(folder)` (torch_bridge/pretrained.py, issue 39 part 2): every folder qpn reads becomes a
transformers model in one call, with the very bits of `load_quantized` on a model built the existing way (the
transformers class of the folder's config, on the CPU, filled by load_quantized: what the fixtures' own tests do
and check against their reference logits); a `qpn pack` folder gives the same model; a plain folder is
transformers' own; `import qpn` stays light."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

import qpn
from qpn.apps import cli
from qpn.torch_bridge import QPNLinear, load_quantized
from qpn.torch_bridge.experts import QPNExperts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import run_child  # noqa: E402

transformers = pytest.importorskip("transformers", reason="from_pretrained builds transformers models ([test] extra)")

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
QUANTIZED = ["modelopt/nvfp4", "modelopt/fp8_tensor", "modelopt/fp8_channel", "modelopt/fp8_block",
             "modelopt/qwen3moe_nvfp4", "modelopt/qwen3moe_fp8", "modelopt/mixtral_nvfp4", "modelopt/mixtral_fp8",
             "compressed_tensors/llama_mxfp4", "compressed_tensors/qwen3moe_nvfp4", "gpt_oss/tiny_mxfp4",
             "qwen_gdn/tiny_mixed"]
# The Qwen3-Next GDN fixture has no transformers test of its own (tests/test_vllm_real.py serves it in vLLM), so
# its reference logits (transformers' float32 model holding every W16) are checked here. The count of
# tests/test_vllm_real.py's GDN twin bound, in fp16 instead of bf16: 29 qpn stages (8 per GDN layer, 5 in the
# full-attention layer), each RN16(x) and RN16 of its output, about 3 * 2^-11 of its output (W16 is the
# reference's own value), log_softmax / the gates at most doubling: 2 * 29 * 3 * 2^-11 of max|logit|.
# Measured (2026-12, this fixture, CPU): 0.96 * 2^-11. A swapped or mis-scaled layer moves the logits by >= 10 %.
GDN_LOGIT_FACTOR = 2 * 29 * 3 * 2.0**-11


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, *name.split("/"))


def reference_ids(folder: str) -> torch.Tensor:
    with open(os.path.join(folder, "reference_input_ids.json")) as f:
        return torch.tensor(json.load(f)["input_ids"])


def logits(model: torch.nn.Module, folder: str) -> torch.Tensor:
    with torch.no_grad():
        return model(reference_ids(folder)).logits


def built_the_existing_way(folder: str) -> torch.nn.Module:
    """The fixtures' own tests' route: the config's transformers class without its quantization_config, float32
    on the CPU, load_quantized."""
    config = transformers.AutoConfig.from_pretrained(folder)
    config.quantization_config = None  # transformers must not try the producer's quantizer: qpn loads it
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config).float().eval()
    load_quantized(model, folder, strict=True)
    return model


@pytest.mark.parametrize("name", QUANTIZED)
def test_from_pretrained_gives_the_bits_of_load_quantized(name):
    folder = fixture(name)
    model = qpn.from_pretrained(folder, dtype=torch.float32)
    assert not model.training and model.dtype == torch.float32
    assert any(isinstance(m, (QPNLinear, QPNExperts)) for m in model.modules())
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert torch.equal(logits(model, folder), logits(built_the_existing_way(folder), folder))


def test_the_gdn_model_gives_its_reference_logits():
    folder = fixture("qwen_gdn/tiny_mixed")
    want = np.load(os.path.join(folder, "reference_logits.npy"))
    got = logits(qpn.from_pretrained(folder, dtype=torch.float32), folder).numpy()
    assert float(np.abs(got - want).max()) <= GDN_LOGIT_FACTOR * float(np.abs(want).max())


@pytest.mark.parametrize("name", ["modelopt/nvfp4", "compressed_tensors/llama_mxfp4"])
def test_a_packed_folder_gives_the_same_model(tmp_path, name, capsys):
    assert cli.main(["pack", fixture(name), str(tmp_path / "packed"), "-q"]) == 0
    capsys.readouterr()
    from_packed = qpn.from_pretrained(tmp_path / "packed", dtype=torch.float32)
    assert torch.equal(logits(from_packed, fixture(name)),
                       logits(qpn.from_pretrained(fixture(name), dtype=torch.float32), fixture(name)))


def test_the_default_dtype_is_the_configs_and_generate_runs():
    folder = fixture("modelopt/nvfp4")
    model = qpn.from_pretrained(folder)
    assert model.dtype == torch.bfloat16  # config.json "dtype"
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = reference_ids(folder)[:, :4]
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7) and torch.equal(out[:, :4], ids)


def test_a_plain_folder_is_transformers_own():
    folder = fixture("gpt_oss/tiny_bf16_twin")  # a gpt-oss without quantization_config
    model = qpn.from_pretrained(folder, dtype=torch.float32)
    assert not any(isinstance(m, (QPNLinear, QPNExperts)) for m in model.modules())
    want = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert torch.equal(logits(model, folder), logits(want, folder))


def test_a_folder_without_config_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"has no config\.json; it must be a Hugging Face model folder on disk"):
        qpn.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"nowhere is not a folder; pass a Hugging Face model folder on disk"):
        qpn.from_pretrained(tmp_path / "nowhere")  # never a model hub's name


def test_import_qpn_stays_light():
    code = ("import sys, qpn; heavy = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; assert callable(qpn.from_pretrained); assert 'torch' in sys.modules")
    run_child([sys.executable, "-c", code], check=True)
