"""`qpn quantize` of mixture-of-experts sources: Qwen3-MoE and Mixtral (per-expert 2-D weights) against REAL
ModelOpt's bytes, and gpt-oss (stacked experts) into gpt-oss's own MXFP4 format against its fixture's bytes.

MoE: tests/fixtures/make_modelopt_moe_fixtures.py's seeded models, rebuilt here (their unquantized tensors -
embeddings, lm_head, routers, norms - equal the fixtures' byte for byte, checked first) and saved as the
per-expert float folders Qwen3-MoE and Mixtral ship. ModelOpt's FP8 export quantizes each expert's fused
gate_up_proj whole (one scale for gate and up: `--shared-fused-scales`); its NVFP4 fixtures quantize every
expert linear with its own global scale (qpn's default).

gpt-oss: tests/fixtures/gpt_oss/tiny_bf16_twin holds exactly tiny_mxfp4's values (every MXFP4 value is a bf16
number; make_gpt_oss_fixture.py asserts it), and each block's largest e2m1 code is 4 or 6 (the OCP rule maps
amax / 2^X into [4, 8)), so the OCP rule finds the same exponent again: quantizing the twin must give
tiny_mxfp4's bytes.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import qpn
from qpn.apps import cli
from qpn.checkpoints.quantize import quantize_checkpoint
from qpn.checkpoints.safetensors_io import StoredTensor, read_safetensors, write_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the float models are transformers' (the [test] extra)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, as tests/test_cli.py imports them
from test_modelopt_moe_exports import SAME_W16_FACTOR, float32_of, w16_of  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODELOPT = os.path.join(HERE, "fixtures", "modelopt")
GPT_OSS = os.path.join(HERE, "fixtures", "gpt_oss")
SEED = 20261201  # make_modelopt_moe_fixtures.py's models, step for step
COMMON = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_experts_per_tok=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES = {
    "qwen3moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=256, moe_intermediate_size=64, num_experts=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=128, num_local_experts=8, architectures=["MixtralForCausalLM"])),
}
# per family: an expert's on-disk prefix under a layer and its (gate, up, down) names; the router's on-disk name
EXPERT_NAMES = {"qwen3moe": ("mlp.experts.{e}", ("gate_proj", "up_proj", "down_proj"), ".mlp.gate."),
                "mixtral": ("block_sparse_moe.experts.{e}", ("w1", "w3", "w2"), ".block_sparse_moe.gate.")}
# --format -> (the fixture's format, whether ModelOpt's exporter shared the expert gate / up scale in it)
BYTES_CASES = {"nvfp4": ("nvfp4", False), "fp8": ("fp8", True)}


def _bf16(t) -> StoredTensor:
    return StoredTensor(t.contiguous().view(torch.int16).numpy().view(np.uint16), "BF16")


def _float_state(family: str) -> dict[str, StoredTensor]:
    """The fixture's float model (make_modelopt_moe_fixtures.tiny) as the per-expert tensors a hub folder holds."""
    torch.manual_seed(SEED)
    model = FAMILIES[family]().float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    block, (gate, up, down), router = EXPERT_NAMES[family]
    state = {}
    for name, t in model.to(torch.bfloat16).state_dict().items():
        layer = name.partition(".mlp.")[0]
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up
            for e, (g, u) in enumerate(zip(*t.chunk(2, dim=1), strict=True)):
                state[f"{layer}.{block.format(e=e)}.{gate}.weight"] = _bf16(g)
                state[f"{layer}.{block.format(e=e)}.{up}.weight"] = _bf16(u)
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                state[f"{layer}.{block.format(e=e)}.{down}.weight"] = _bf16(t[e])
        else:
            state[name.replace(".mlp.gate.", router)] = _bf16(t)
    return state


@pytest.fixture(scope="module")
def float_moe(tmp_path_factory) -> dict[str, str]:
    """family -> its float folder (config.json without quantization_config, model.safetensors)."""
    folders = {}
    for family in FAMILIES:
        state = _float_state(family)
        theirs = read_safetensors(os.path.join(MODELOPT, f"{family}_nvfp4", "model.safetensors")).tensors
        unquantized = [n for n, t in theirs.items() if t.dtype == "BF16"]
        assert len(unquantized) >= 7  # embeddings, lm_head, two routers, norms
        for name in unquantized:  # the same float model, or every comparison below is moot
            assert np.array_equal(state[name].array, theirs[name].array), name
        folder = tmp_path_factory.mktemp(family)
        write_safetensors(folder / "model.safetensors", state, {"format": "pt"})
        with open(os.path.join(MODELOPT, f"{family}_fp8", "config.json")) as f:
            config = {k: v for k, v in json.load(f).items() if k != "quantization_config"}
        with open(folder / "config.json", "w") as f:
            json.dump(config, f)
        folders[family] = str(folder)
    return folders


def _assert_configs_are_modelopts(out, fixture: str) -> None:
    for file, section in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        with open(os.path.join(fixture, file)) as f:
            expected = json.load(f)[section]
        with open(os.path.join(out, file)) as f:
            written = json.load(f)[section]
        for group in expected.get("config_groups", {}).values():
            group["input_activations"] = None  # weight-only: nothing calibrated an activation scale
        expected.pop("producer", None)
        written.pop("producer", None)
        assert written == expected, file


@pytest.mark.parametrize("fmt", sorted(BYTES_CASES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_rtn_bytes_equal_modelopt(float_moe, tmp_path, family, fmt):
    """Every tensor ModelOpt wrote (input scales aside), byte for byte: attention, every expert, the routers
    (kept bf16, listed in exclude_modules)."""
    fixture_format, shared = BYTES_CASES[fmt]
    fixture = os.path.join(MODELOPT, f"{family}_{fixture_format}")
    report = quantize_checkpoint(float_moe[family], tmp_path / "out", fmt, shared_fused_scales=shared)
    ours = read_safetensors(tmp_path / "out" / "model.safetensors").tensors
    theirs = read_safetensors(os.path.join(fixture, "model.safetensors")).tensors
    assert sorted(ours) == sorted(n for n in theirs if not n.endswith(".input_scale"))
    for name, tensor in ours.items():
        assert (tensor.dtype, tensor.shape) == (theirs[name].dtype, theirs[name].shape), name
        assert np.array_equal(tensor.array, theirs[name].array), name
    assert len(report.quantized) == 2 * (4 + 8 * 3)  # per layer: q, k, v, o and 8 experts' gate, up, down
    _assert_configs_are_modelopts(tmp_path / "out", fixture)


def test_moe_default_keeps_each_experts_gate_and_up_scale(float_moe, tmp_path):
    """Without --shared-fused-scales an expert's gate and up keep their own FP8 scales; the shared form gives
    both the larger one (ModelOpt's: its fused gate_up_proj's)."""
    quantize_checkpoint(float_moe["mixtral"], tmp_path / "own", "fp8")
    quantize_checkpoint(float_moe["mixtral"], tmp_path / "shared", "fp8", shared_fused_scales=True)
    own = read_safetensors(tmp_path / "own" / "model.safetensors").tensors
    shared = read_safetensors(tmp_path / "shared" / "model.safetensors").tensors
    differ = 0
    for layer in range(2):
        for e in range(8):
            prefix = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            scales = [float(own[f"{prefix}.{w}.weight_scale"].array) for w in ("w1", "w3")]
            assert [float(shared[f"{prefix}.{w}.weight_scale"].array) for w in ("w1", "w3")] == [max(scales)] * 2
            differ += scales[0] != scales[1]
            assert np.array_equal(own[f"{prefix}.w2.weight"].array, shared[f"{prefix}.w2.weight"].array)
    assert differ == 15  # of 16: layer 1's expert 3 has gate and up of one bf16 amax (the fixture's scales)


def _logits(folder: str, ids: list[int]) -> torch.Tensor:
    model = qpn.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _w16_twin_logits(folder: str, family: str, ids: list[int]) -> torch.Tensor:
    """An fp32 transformers model holding qpn.ref's W16 of every linear of `folder` (the experts stacked into the
    fused parameters, gate rows first), as test_modelopt_moe_exports builds it for the fixtures."""
    from qpn import ref

    checkpoint = ref.load_checkpoint(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    config.quantization_config = None
    model = FAMILIES[family]().__class__(config).float().eval()
    block, (gate, up, down), router = EXPERT_NAMES[family]
    w16 = {prefix: torch.from_numpy(w16_of(linear).astype(np.float32)) for prefix, linear in checkpoint.linears.items()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            layer, _, leaf = name.partition(".mlp.")
            if leaf in ("experts.gate_up_proj", "experts.down_proj"):
                for e in range(param.shape[0]):
                    prefix = f"{layer}.{block.format(e=e)}"
                    param[e].copy_(torch.cat([w16[f"{prefix}.{gate}"], w16[f"{prefix}.{up}"]])
                                   if leaf.endswith("gate_up_proj") else w16[f"{prefix}.{down}"])
            elif name.removesuffix(".weight") in w16:
                param.copy_(w16[name.removesuffix(".weight")])
            else:
                param.copy_(float32_of(checkpoint.tensors[name.replace(".mlp.gate.", router)]))
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8-channel"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_output_loads_and_verifies(float_moe, tmp_path, family, fmt, capsys):
    """The command's output: inspect and verify pass, from_pretrained serves every expert through qpn with the
    logits of an fp32 twin holding the same W16 (test_modelopt_moe_exports' bound), and NVFP4 is the fixture."""
    from qpn.torch_bridge.experts import QPNExperts

    out = str(tmp_path / "q")
    assert cli.main(["quantize", float_moe[family], out, "--format", fmt, "--method", "rtn", "-q"]) == 0
    assert EXPERT_NAMES[family][2].strip(".") in capsys.readouterr().out  # the routers are listed as kept
    assert cli.main(["inspect", out]) == 0 and cli.main(["verify", out, "-q"]) == 0
    fixture = os.path.join(MODELOPT, f"{family}_nvfp4")
    with open(os.path.join(fixture, "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    model = qpn.from_pretrained(out, dtype=torch.float32)
    assert all(isinstance(layer.mlp.experts, QPNExperts) for layer in model.model.layers)
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0]
    twin = _w16_twin_logits(out, family, ids)
    assert float((got - twin).abs().max()) <= SAME_W16_FACTOR * float(twin.abs().max())
    if fmt == "nvfp4":  # the fixture's bytes: the fixture's own model, bit for bit
        assert torch.equal(got, _logits(fixture, ids))


# ----------------------------------------------------------------------------- gpt-oss

TWIN, MXFP4 = os.path.join(GPT_OSS, "tiny_bf16_twin"), os.path.join(GPT_OSS, "tiny_mxfp4")


@pytest.mark.parametrize("method", ["rtn", "mse"])
def test_gpt_oss_twin_quantizes_to_the_mxfp4_fixtures_bytes(tmp_path, monkeypatch, method):
    """Every tensor and config.json of tiny_mxfp4 (module docstring), in slices of 7 rows (ragged against N =
    128 and 64). mse too: the twin's values are exact, RTN's error 0, and the search keeps RTN's on a tie."""
    from qpn.checkpoints import quantize as module

    monkeypatch.setattr(module, "SLICE_VALUES", 1000)  # K = 128: 7 rows a slice; K = 64: 15
    report = quantize_checkpoint(TWIN, tmp_path / "out", "mxfp4", method=method)
    ours = read_safetensors(tmp_path / "out" / "model.safetensors").tensors
    theirs = read_safetensors(os.path.join(MXFP4, "model.safetensors")).tensors
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert (tensor.dtype, tensor.shape) == (theirs[name].dtype, theirs[name].shape), name
        assert np.array_equal(tensor.array, theirs[name].array), name
    for file in (tmp_path / "out" / "config.json", os.path.join(MXFP4, "config.json")):
        with open(file) as f:
            assert json.load(f) == json.load(open(os.path.join(MXFP4, "config.json")))
    assert len(report.quantized) == 4 and "model.layers.1.self_attn.q_proj" in report.excluded


def test_gpt_oss_output_loads_inspects_verifies(tmp_path):
    out = str(tmp_path / "q")
    assert cli.main(["quantize", TWIN, out, "--format", "mxfp4", "-q"]) == 0
    assert cli.main(["inspect", out]) == 0 and cli.main(["verify", out, "-q"]) == 0
    with open(os.path.join(MXFP4, "reference_input_ids.json")) as f:
        ids = json.load(f)["input_ids"][0]
    got = _logits(out, ids)
    assert torch.equal(got, _logits(MXFP4, ids))  # the fixture's model; its own tests bound it by the reference


def _corrupt_twin(tmp_path, index: tuple[int, int, int]) -> str:
    """The twin with a bf16 NaN in layer 1's down_proj [E, I, H] at `index`."""
    src = tmp_path / "nan"
    src.mkdir()
    tensors = dict(read_safetensors(os.path.join(TWIN, "model.safetensors")).tensors)
    bad = tensors["model.layers.1.mlp.experts.down_proj"].array.copy()
    bad[index] = 0x7FC0
    tensors["model.layers.1.mlp.experts.down_proj"] = StoredTensor(bad, "BF16")
    write_safetensors(src / "model.safetensors", tensors, {"format": "pt"})
    with open(src / "config.json", "w") as f, open(os.path.join(TWIN, "config.json")) as g:
        f.write(g.read())
    return str(src)


def test_gpt_oss_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    cases = {  # argv -> words the one line must hold
        (TWIN, str(tmp_path / "o1"), "--format", "nvfp4"): "use --format mxfp4",
        (TWIN, str(tmp_path / "o2"), "--format", "mxfp4", "--exclude", "*.mlp.experts"): "drop it",
        (_corrupt_twin(tmp_path, (5, 40, 100)), str(tmp_path / "o3"), "--format", "mxfp4"):
            "'model.layers.1.mlp.experts.down_proj': cannot be quantized as mxfp4: w must be finite, got 1 NaN/inf "
            "values, first nan at index (5, 40, 100)",
    }
    for argv, words in cases.items():
        assert cli.main(["quantize", *argv, "-q"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, err
    assert not any(os.path.exists(tmp_path / f"o{i}") for i in range(1, 4))
