"""gpt-oss's own MXFP4 checkpoints (issue 23): the fixture tests/fixtures/gpt_oss/tiny_mxfp4 (made by
tests/fixtures/make_gpt_oss_fixture.py) decodes in qpn.ref as transformers decodes it, and qpn.checkpoints.gpt_oss
reads its experts in qpn's order (gate rows, then up), refuses what it cannot read with the file and the tensor,
and gives a MoE block that agrees with transformers' GptOssExperts on the weights transformers dequantizes."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import numpy as np
import pytest

from qpn.checkpoints import (
    CheckpointError,
    StoredTensor,
    gpt_oss_expert_layers,
    is_gpt_oss_mxfp4,
    read_gpt_oss_config,
    read_gpt_oss_experts,
    read_safetensors,
    write_safetensors,
)
from qpn.checkpoints.checkpoint import FieldError
from qpn.checkpoints.gpt_oss import EXPERTS_PREFIX, MXFP4Experts
from qpn.ref.gpt_oss import deinterleave, moe, route
from qpn.ref.mxfp4 import mxfp4_dequantize, mxfp4_quantize, mxfp4_values

torch = pytest.importorskip("torch")
mxfp4_integration = pytest.importorskip("transformers.integrations.mxfp4")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import make_gpt_oss_fixture as fixture  # noqa: E402
from test_gpt_oss_ref import MOE_TOLERANCE, transformers_experts  # noqa: E402

MXFP4, TWIN = fixture.MXFP4_FOLDER, fixture.TWIN_FOLDER
WEIGHTS = "model.safetensors"
PROJS = ("gate_up_proj", "down_proj")
LAYERS = [EXPERTS_PREFIX.format(layer=layer) for layer in range(fixture.LAYERS)]


def stored(folder: str) -> dict[str, StoredTensor]:
    return read_safetensors(os.path.join(folder, WEIGHTS)).tensors


def transformers_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' own MXFP4 decode (what Mxfp4Config(dequantize=True) loads) in float32, [E, K, N] as
    GptOssExperts holds it."""
    blocks, scales = torch.from_numpy(blocks.copy()), torch.from_numpy(scales.copy())
    return mxfp4_integration.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()


# ----------------------------------------------------------------------------- the format, against transformers


@pytest.mark.parametrize("prefix", LAYERS)
@pytest.mark.parametrize("proj", PROJS)
def test_the_fixtures_bytes_decode_as_transformers_decodes_them(prefix, proj):
    tensors = stored(MXFP4)
    blocks, scales = tensors[f"{prefix}.{proj}_blocks"].array, tensors[f"{prefix}.{proj}_scales"].array
    ours = mxfp4_dequantize(blocks, scales)  # [E, N, K]
    theirs = transformers_dequantize(blocks, scales).transpose(0, 2, 1)  # [E, K, N] -> [E, N, K]
    assert ours.shape == theirs.shape and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


CRAFTED_SCALES = (0x00, 0x01, 0x7E, 0x7F, 0x80, 0xFD, 0xFE, 0xFF)  # 2^-127 (float32 subnormal) .. 2^127, NaN


def test_every_byte_under_every_scale_class_decodes_as_transformers_decodes_it():
    """Each row holds all 256 byte values (every nibble pair) under one scale byte. Bit for bit where the scale
    is a number (0x00's float32 subnormals and 0xFE's {2, 3, 4, 6} * 2^127 = inf included). 0xFF is e8m0's NaN
    (OCP v1.0): qpn decodes NaN throughout (as ml_dtypes' e8m0) and its reader refuses the byte (below), while
    transformers reads it as the exponent 128 (2^128: 0.5 gives 2^127, 1 and up inf), a value the format has not."""
    blocks = np.ascontiguousarray(np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16),
                                                  (1, len(CRAFTED_SCALES), 16, 16)))
    scales = np.repeat(np.array(CRAFTED_SCALES, np.uint8)[None, :, None], 16, axis=2)
    ours = mxfp4_dequantize(blocks, scales)[0]
    theirs = transformers_dequantize(blocks, scales)[0].T
    number = np.array(CRAFTED_SCALES) != 0xFF
    assert np.array_equal(ours[number].view(np.uint32), theirs[number].view(np.uint32))
    assert (ours[0] != 0).any() and (np.abs(ours[0]) < 2.0**-126).any()  # 0x00 holds subnormals, not zeros
    assert np.isinf(ours[number][-1]).any()  # 0xFE: {2, 3, 4, 6} * 2^127 exceed float32 in both
    assert np.isnan(ours[~number]).all()
    with np.errstate(over="ignore"):
        two_128 = (mxfp4_values(blocks, np.full_like(scales, 0xFE))[0, ~number] * 2).astype(np.float32)
    assert np.array_equal(theirs[~number].view(np.uint32), two_128.view(np.uint32))


def test_the_low_nibble_is_the_earlier_element():
    """Byte 0x7A = 0111_1010: element 2j is 0xA (e2m1 -1.0), element 2j + 1 is 0x7 (6.0); scale 0x80 = 2^1."""
    blocks = np.zeros((1, 1, 1, 16), np.uint8)
    blocks[..., 0] = 0x7A
    scales = np.full((1, 1, 1), 0x80, np.uint8)
    assert list(mxfp4_dequantize(blocks, scales)[0, 0, :2]) == [-2.0, 12.0]
    assert list(transformers_dequantize(blocks, scales)[0, :2, 0]) == [-2.0, 12.0]


# ----------------------------------------------------------------------------- the reader


def test_the_config_is_read_and_only_mxfp4_is_claimed():
    cfg = read_gpt_oss_config(MXFP4)
    assert (cfg.experts, cfg.experts_per_token, cfg.hidden, cfg.intermediate, cfg.layers, cfg.swiglu_limit) == \
        (fixture.E, fixture.TOP_K, fixture.H, fixture.INTER, fixture.LAYERS, 7.0)
    assert list(cfg.modules_to_not_convert) == fixture.MODULES_TO_NOT_CONVERT
    assert is_gpt_oss_mxfp4(MXFP4) and is_gpt_oss_mxfp4(fixture.config(quantized=True))
    assert not is_gpt_oss_mxfp4(TWIN) and not is_gpt_oss_mxfp4(os.path.join(HERE, "fixtures", "modelopt", "nvfp4"))
    assert gpt_oss_expert_layers(MXFP4) == LAYERS


def test_the_reader_gives_the_generators_experts_in_qpns_order():
    """The reader's w13 is the generator's gate-then-up weights quantized (rows of bytes moved, nothing decoded),
    its biases the generator's bf16 values in float32, and the twin's bf16 experts are its values exactly."""
    _, generated = fixture.generate()
    read = read_gpt_oss_experts(MXFP4)
    twin = stored(TWIN)
    assert list(read) == LAYERS
    for layer, ex in generated.items():
        got = read[LAYERS[layer]]
        assert (got.experts, got.hidden, got.intermediate) == (fixture.E, fixture.H, fixture.INTER)
        for weight, mine in ((mxfp4_quantize(ex.w13), got.w13), (mxfp4_quantize(ex.w2), got.w2)):
            assert np.array_equal(weight.blocks, mine.blocks) and np.array_equal(weight.scales, mine.scales)
        for bias, mine in ((ex.b13, got.w13_bias), (ex.b2, got.w2_bias)):
            assert mine.dtype == np.float32 and np.array_equal(bias.view(np.uint32), mine.view(np.uint32))
        for proj, weight, axis in (("gate_up_proj", got.w13, -2), ("down_proj", got.w2, None)):
            bits = twin[f"{LAYERS[layer]}.{proj}"].array.astype(np.uint32) << 16  # bf16 [E, K, N]
            values = bits.view(np.float32).transpose(0, 2, 1)
            values = deinterleave(values, axis) if axis is not None else values
            assert np.array_equal(values.view(np.uint32), mxfp4_dequantize(*weight).view(np.uint32))


def test_one_layer_is_read_alone_and_an_unknown_one_is_refused():
    assert list(read_gpt_oss_experts(MXFP4, [LAYERS[1]])) == [LAYERS[1]]
    with pytest.raises(ValueError, match=r"layers must name MoE layers .* got 'model.layers.7.mlp.experts'"):
        read_gpt_oss_experts(MXFP4, ["model.layers.7.mlp.experts"])


def test_a_sharded_copy_reads_the_same(tmp_path):
    tensors = stored(MXFP4)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        write_safetensors(tmp_path / file, {name: tensors[name] for name in part}, {"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: file for file, part in shards.items() for name in part}}))
    shutil.copy(os.path.join(MXFP4, "config.json"), tmp_path)
    whole, sharded = read_gpt_oss_experts(MXFP4), read_gpt_oss_experts(tmp_path)
    for prefix in LAYERS:
        for role in ("w13_blocks", "w13_scales", "w13_bias", "w2_blocks", "w2_scales", "w2_bias"):
            assert np.array_equal(getattr(whole[prefix], role), getattr(sharded[prefix], role))


def _nan_scale(tensors: dict) -> None:
    scales = tensors["model.layers.1.mlp.experts.gate_up_proj_scales"].array.copy()
    scales[3, 5, 1] = 0xFF
    tensors["model.layers.1.mlp.experts.gate_up_proj_scales"] = StoredTensor(scales, "U8")


def _transposed_down(tensors: dict) -> None:  # [E, I, H/32, 16]: the [E, H, I] / [E, I, H] mix-up
    tensors["model.layers.0.mlp.experts.down_proj_blocks"] = StoredTensor(np.zeros((8, 64, 4, 16), np.uint8), "U8")


def _f16_bias(tensors: dict) -> None:
    tensors["model.layers.0.mlp.experts.down_proj_bias"] = StoredTensor(np.zeros((8, 128), np.float16), "F16")


def _nan_bias(tensors: dict) -> None:
    bias = tensors["model.layers.1.mlp.experts.down_proj_bias"].array.copy()
    bias[2, 7] = 0x7FC0  # bf16 NaN
    tensors["model.layers.1.mlp.experts.down_proj_bias"] = StoredTensor(bias, "BF16")


def _extra_layer(tensors: dict) -> None:
    tensors["model.layers.2.mlp.experts.down_proj_bias"] = tensors["model.layers.1.mlp.experts.down_proj_bias"]


TENSOR_FAULTS = {  # how a tensor is broken -> what the error says (after the file and the tensor's name)
    "nan scale": (_nan_scale, r"'model.layers.1.mlp.experts.gate_up_proj_scales': gate_up_proj_scales holds the "
                              r"e8m0 NaN byte 0xFF at index \(3, 5, 1\) \(1 in all\): an MXFP4 scale byte must be "
                              r"0x00..0xFE"),
    "wrong shape": (_transposed_down, r"'model.layers.0.mlp.experts.down_proj_blocks': is U8 \[8, 64, 4, 16\], but "
                                      r"gpt-oss stores it as U8 \[8, 128, 2, 16\] for config.json's "
                                      r"num_local_experts 8, hidden_size 128, intermediate_size 64;"),
    "missing": (lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_bias"),
                r"'model.layers.0.mlp.experts.gate_up_proj_bias': is missing: every gpt-oss layer holds six"),
    "wrong dtype": (_f16_bias, r"'model.layers.0.mlp.experts.down_proj_bias': is F16 \[8, 128\], but gpt-oss "
                               r"stores it as BF16 or F32 \[8, 128\]"),
    "nan bias": (_nan_bias, r"'model.layers.1.mlp.experts.down_proj_bias': down_proj_bias must be finite, got 1 "
                            r"NaN/inf values, first nan at index \(2, 7\)"),
    "extra layer": (_extra_layer, r"'model.layers.2.mlp.experts.down_proj_bias': is an MXFP4 experts tensor, but "
                                  r"config.json has num_hidden_layers 2"),
}


@pytest.mark.parametrize("fault", sorted(TENSOR_FAULTS))
def test_the_reader_refuses_a_broken_tensor_with_the_file_and_the_tensor(tmp_path, fault):
    mutate, message = TENSOR_FAULTS[fault]
    tensors = dict(stored(MXFP4))
    mutate(tensors)
    write_safetensors(tmp_path / WEIGHTS, tensors, {"format": "pt"})
    shutil.copy(os.path.join(MXFP4, "config.json"), tmp_path)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(tmp_path / WEIGHTS))}: tensor {message}"):
        read_gpt_oss_experts(tmp_path)


CONFIG_FAULTS = {  # config.json entry -> its bad value, what the error says
    "hidden_size": (100, r"hidden_size must be a multiple of 32 \(MXFP4 has one e8m0 scale per 32 values"),
    "quantization_config": ({"quant_method": "modelopt"}, r"is 'modelopt'; this reader reads gpt-oss MXFP4"),
    "num_experts_per_tok": (9, r"num_experts_per_tok must be <= num_local_experts = 8, got 9"),
    "num_local_experts": (None, r"num_local_experts must be a positive integer, got None"),
}


@pytest.mark.parametrize("key", sorted(CONFIG_FAULTS))
def test_the_config_is_refused_with_the_entry_and_the_rule(key):
    value, message = CONFIG_FAULTS[key]
    config = {**fixture.config(quantized=True), key: value}
    with pytest.raises(CheckpointError, match=rf"^config.json: config entry .*{message}"):
        read_gpt_oss_config(config)


def test_experts_built_in_memory_are_checked_too():
    good = read_gpt_oss_experts(MXFP4, [LAYERS[0]])[LAYERS[0]]
    fields = {role: getattr(good, role) for role in ("w13_blocks", "w13_scales", "w13_bias", "w2_blocks",
                                                     "w2_scales", "w2_bias")}
    with pytest.raises(FieldError, match=r"w13_bias must be a float32 array of 2 dimensions, got float16"):
        MXFP4Experts(good.name, **{**fields, "w13_bias": good.w13_bias.astype(np.float16)})
    with pytest.raises(FieldError, match=r"w2_scales has shape \(8, 128, 1\), but .* make it \(8, 128, 2\)"):
        MXFP4Experts(good.name, **{**fields, "w2_scales": good.w2_scales[..., :1]})
    with pytest.raises(FieldError, match=r"w2_scales holds the e8m0 NaN byte 0xFF at index \(0, 0, 0\)"):
        MXFP4Experts(good.name, **{**fields, "w2_scales": np.full_like(good.w2_scales, 0xFF)})


# ----------------------------------------------------------------------------- the MoE block


@pytest.mark.parametrize("prefix", LAYERS)
def test_the_reference_moe_on_the_readers_experts_is_transformers_on_its_own_dequantization(prefix):
    """ref.gpt_oss.moe on the reader's experts (their values, exact in fp16 here: asserted) against transformers'
    GptOssExperts in float64 on the weights convert_moe_packed_tensors gives, routed by the fixture's router:
    within test_gpt_oss_ref.MOE_TOLERANCE (its derivation: an RN16 after each biased linear and the activation;
    measured 0.79 and 1.12 * 2^-11 of the largest output for layers 0 and 1)."""
    got_experts = read_gpt_oss_experts(MXFP4, [prefix])[prefix]
    tensors = stored(MXFP4)
    w13, w2 = (mxfp4_dequantize(*w) for w in (got_experts.w13, got_experts.w2))
    w13_16, w2_16 = w13.astype(np.float16), w2.astype(np.float16)
    assert np.array_equal(w13_16.astype(np.float32), w13) and np.array_equal(w2_16.astype(np.float32), w2)
    rng = np.random.default_rng(23)
    x = rng.standard_normal((16, fixture.H)).astype(np.float16)
    router = {k: fixture.bf16_values(tensors[f"{prefix.rpartition('.')[0]}.router.{k}"].array).astype(np.float64)
              for k in ("weight", "bias")}
    weights, ids = route(x.astype(np.float64) @ router["weight"].T + router["bias"], fixture.TOP_K)
    got = moe(x, w13_16, got_experts.w13_bias, w2_16, got_experts.w2_bias, weights, ids)

    def on_disk(name: str) -> np.ndarray:
        return tensors[f"{prefix}.{name}"].array

    want = transformers_experts(
        transformers_dequantize(on_disk("gate_up_proj_blocks"), on_disk("gate_up_proj_scales")),
        fixture.bf16_values(on_disk("gate_up_proj_bias")),
        transformers_dequantize(on_disk("down_proj_blocks"), on_disk("down_proj_scales")),
        fixture.bf16_values(on_disk("down_proj_bias")), x, ids, weights)
    assert len(np.unique(ids)) > fixture.E // 2 and np.abs(want).max() > 0.1  # the block does something
    assert np.abs(got.astype(np.float64) - want).max() <= MOE_TOLERANCE * np.abs(want).max()
