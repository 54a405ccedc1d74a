"""MXFP4 dense linears as REAL llm-compressor 0.14 writes them on the CPU (tests/fixtures/compressed_tensors/
llama_mxfp4, made by tests/fixtures/make_ct_mxfp4_fixture.py; issue 23, part 2): compressed-tensors
mxfp4-pack-quantized (weight_packed U8 [N, K/2], weight_scale U8 e8m0 [N, K/32], docs/FORMATS.md, "MXFP4, as
compressed-tensors writes it"). qpn reads every layer into an MXFP4Linear whose bytes decode to compressed-tensors'
own decompression bit for bit; `qpn inspect` / `pack` / `verify` take it; load_quantized (from the folder or from
its packed twin) gives the logits of a float32 model holding compressed-tensors' decompressed weights."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch

from qpn import checkpoints, ref
from qpn.apps import cli
from qpn.checkpoints import packed as packing
from qpn.ref.formats import QPNMX

FOLDER = os.path.join(os.path.dirname(__file__), "fixtures", "compressed_tensors", "llama_mxfp4")
LAYERS = [f"model.layers.{i}.{part}" for i in range(2) for part in
          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
# Logit bound: tests/test_modelopt_exports.py's derivation with W16 exact (every scale byte of the fixture lies
# within W16_EXACT_SPAN binades of its tile's largest, asserted below: 2^T * W16 is the value itself), so each
# quantized linear differs from the fp32 reference by RN16 of its input and RN16 of its output, about 2 * 2^-11
# relative; 2 attention + 2 MLP stages in series: 4 * 2 * 2^-11 of max|logit|, doubled for the softmax / SiLU /
# RMSNorm gains: 16 * 2^-11. Log-probs: log_softmax(a) - log_softmax(b) moves by at most 2 max|a - b|.
# Measured (2026-12, this fixture, load_quantized on the CPU): 2.2 * 2^-11 of max|logit| (0.0048, max|logit| 4.4)
# on logits, 0.0046 on log-probs; a swapped layer or a wrong scale byte moves them by >= 10 % of max|logit|.
LOGIT_BOUND_FACTOR = 16 * 2.0**-11


def state(folder: str = FOLDER) -> dict[str, checkpoints.StoredTensor]:
    return checkpoints.read_safetensors(os.path.join(folder, "model.safetensors")).tensors


def test_the_fixture_is_what_llm_compressor_writes():
    with open(os.path.join(FOLDER, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == \
        ("compressed-tensors", "mxfp4-pack-quantized", "compressed")
    (group,) = qc["config_groups"].values()
    assert group["format"] == "mxfp4-pack-quantized" and group["input_activations"] is None
    assert {k: group["weights"][k] for k in ("num_bits", "type", "strategy", "group_size", "scale_dtype")} == \
        {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"}
    tensors = state()
    for name in LAYERS:
        packed, scale = tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"]
        assert (packed.dtype, scale.dtype) == ("U8", "U8")
        n, half_k = packed.shape
        assert scale.shape == (n, 2 * half_k // 32)
        assert not {f"{name}.weight_global_scale", f"{name}.input_global_scale", f"{name}.weight"} & set(tensors)


def test_qpn_reads_every_layer_as_mxfp4():
    checkpoint = checkpoints.load_checkpoint(FOLDER)
    assert (checkpoint.format, checkpoint.quant_algo) == ("compressed-tensors", "MXFP4")
    assert sorted(checkpoint.linears) == sorted(LAYERS)
    tensors = state()
    for name, linear in checkpoint.linears.items():
        assert isinstance(linear, checkpoints.MXFP4Linear) and linear.weight_format is QPNMX
        assert linear.blocks.shape == (linear.n, linear.k // 32, 16)
        assert np.array_equal(linear.weight_packed, tensors[f"{name}.weight_packed"].array)
        assert np.array_equal(linear.scales, tensors[f"{name}.weight_scale"].array)
    assert "lm_head.weight" in checkpoint.tensors


def test_the_bytes_decode_to_compressed_tensors_own_weights_bit_for_bit():
    """ref.mxfp4_dequantize of each layer's bytes, as float32 [N, K], hashes to the sha256 of
    MXFP4PackedCompressor.decompress's weight (bf16, widened to float32 by the fixture script)."""
    with open(os.path.join(FOLDER, "ct_decompressed_sha256.json")) as f:
        digests = json.load(f)["sha256"]
    assert sorted(digests) == sorted(LAYERS)
    for name, linear in checkpoints.load_checkpoint(FOLDER).linears.items():
        w = ref.mxfp4_dequantize(linear.blocks, linear.scales, nan="raise").reshape(linear.n, linear.k)
        assert hashlib.sha256(np.ascontiguousarray(w, np.float32).tobytes()).hexdigest() == digests[name], name


def test_w16_is_exact_for_every_layer():
    """The premise of LOGIT_BOUND_FACTOR: 2^T * W16 equals every value (no fp16 underflow)."""
    for linear in checkpoints.load_checkpoint(FOLDER).linears.values():
        w16, tile_scale = ref.mxfp4.mxfp4_w16(linear.blocks, linear.scales)
        values = ref.mxfp4.mxfp4_values(linear.blocks, linear.scales).reshape(linear.n, linear.k)
        assert np.array_equal(w16.astype(np.float64) * np.repeat(tile_scale, 32)[:, None], values)


@pytest.mark.parametrize("packed_first", [False, True])
def test_load_quantized_gives_compressed_tensors_logits(tmp_path, packed_first):
    transformers = pytest.importorskip("transformers")
    from qpn.torch_bridge import QPNLinear, load_quantized

    source = FOLDER
    if packed_first:
        assert cli.main(["pack", FOLDER, str(tmp_path / "packed"), "-q"]) == 0
        source = str(tmp_path / "packed")
    config = transformers.AutoConfig.from_pretrained(FOLDER)
    config.quantization_config = None  # transformers must not try compressed-tensors itself: qpn loads it
    with torch.device("meta"):  # every value comes from the checkpoint
        model = transformers.LlamaForCausalLM(config)
    report = load_quantized(model, source)
    assert sorted(report.quantized) == sorted(LAYERS) and not report.missing and not report.unexpected
    assert all(isinstance(model.get_submodule(name), QPNLinear) for name in LAYERS)
    with open(os.path.join(FOLDER, "reference_input_ids.json")) as f:
        ids = torch.tensor(json.load(f)["input_ids"])
    with torch.no_grad():
        got = model.eval()(ids).logits.float()
    want = torch.from_numpy(np.load(os.path.join(FOLDER, "reference_logits.npy")))
    bound = LOGIT_BOUND_FACTOR * float(want.abs().max())
    assert float((got - want).abs().max()) <= bound
    log_probs = torch.log_softmax(got, -1) - torch.log_softmax(want, -1)
    assert float(log_probs.abs().max()) <= 2 * bound


def test_inspect_lists_the_layers(capsys):
    assert cli.main(["inspect", FOLDER]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("model.layers.")]
    assert sorted(row[0] for row in rows) == sorted(LAYERS)
    assert all(row[1] == "MXFP4" and row[-2:] == ["ok", "(QPNMX)"] for row in rows)
    assert "compressed-tensors MXFP4 checkpoint" in out and "14 quantized layers (14 MXFP4)" in out
    k_proj = next(row for row in rows if row[0] == "model.layers.1.self_attn.k_proj")
    linear = checkpoints.load_checkpoint(FOLDER).linears[k_proj[0]]
    lo, hi = linear.tile_scale().min(), linear.tile_scale().max()  # the scale column: the tiles' 2^T
    assert k_proj[4] == (f"{lo:.6g}" if lo == hi else f"{lo:.4g}..{hi:.4g}")


def test_pack_verify_and_unpack_round_trip(tmp_path):
    out = str(tmp_path / "packed")
    assert cli.main(["pack", FOLDER, out, "-q"]) == 0
    assert cli.main(["verify", out, "-q"]) == 0
    assert cli.main(["verify", FOLDER, "-q"]) == 0
    packed = packing.load_packed(out)
    source = checkpoints.load_checkpoint(FOLDER)
    tensors = state()
    for name, layer in packed.layers.items():
        entry = layer.entry
        assert (entry["format"], entry["layout"], entry["n_padded"]) == ("mxfp4", "QPNMX", layer.n)
        for role, suffix in (("blocks", "weight_packed"), ("scales", "weight_scale")):
            assert entry["source_tensors"][role]["sha256"] == packing.sha256_array(tensors[f"{name}.{suffix}"].array)
        codes, scales, tile_scale = ref.qpnmx_prepack(source.linears[name].blocks, source.linears[name].scales)
        assert [layer.arrays[s].tobytes() for s in (packing.CODES, packing.SCALES, packing.TILE_SCALE)] == \
            [codes.tobytes(), scales.tobytes(), tile_scale.tobytes()]
        back = layer.unpack()
        assert np.array_equal(back.weight_packed, tensors[f"{name}.weight_packed"].array)
        assert np.array_equal(back.scales, tensors[f"{name}.weight_scale"].array)
    # the packed folder gives the checkpoint back: saved as compressed-tensors, it holds the source's bytes
    checkpoints.save_checkpoint(tmp_path / "again", packed.to_checkpoint())
    again = state(str(tmp_path / "again"))
    assert all(np.array_equal(again[name].array, t.array) for name, t in tensors.items())


def test_ragged_n_pads_and_crops(tmp_path):
    """A layer of N = 40 (not whole 32-row tiles), saved by qpn as compressed-tensors MXFP4: pack pads it to 64 with
    zero codes and scale byte 0, unpack crops it back, verify passes; load_packed refuses a non-zero pad row."""
    rng = np.random.default_rng(23)
    blocks, scales = ref.mxfp4_quantize(rng.standard_normal((40, 128)).astype(np.float32) * 0.1)
    linear = checkpoints.MXFP4Linear("model.proj", blocks.reshape(40, 64), scales)
    embed = checkpoints.StoredTensor(rng.standard_normal((8, 4)).astype(np.float32), "F32")
    checkpoints.save_checkpoint(tmp_path / "src", checkpoints.Checkpoint(
        "compressed-tensors", "MXFP4", {"model.proj": linear}, {"model.embed.weight": embed}, {}))
    assert cli.main(["pack", str(tmp_path / "src"), str(tmp_path / "packed"), "-q"]) == 0
    assert cli.main(["verify", str(tmp_path / "packed"), "-q"]) == 0
    layer = packing.load_packed(tmp_path / "packed").layers["model.proj"]
    assert (layer.n, layer.n_padded) == (40, 64)
    back = layer.unpack()
    assert np.array_equal(back.blocks, blocks) and np.array_equal(back.scales, scales)
    file = tmp_path / "packed" / "model.safetensors"
    stored = dict(checkpoints.read_safetensors(file, mmap=False).tensors)
    codes = stored[f"model.proj.{packing.CODES}"].array.copy()
    codes[-1, 0] = 0x11  # a pad row's code
    stored[f"model.proj.{packing.CODES}"] = checkpoints.StoredTensor(codes, "U8")
    checkpoints.write_safetensors(file, stored, {"format": "pt"})
    with pytest.raises(packing.PackError, match="pad rows 40..63 are not zero"):
        packing.load_packed(tmp_path / "packed")
    assert cli.main(["verify", str(tmp_path / "packed"), "-q"]) == 1


def test_a_corrupt_tile_scale_is_refused(tmp_path):
    out = tmp_path / "packed"
    assert cli.main(["pack", FOLDER, str(out), "-q"]) == 0
    stored = dict(checkpoints.read_safetensors(out / "model.safetensors", mmap=False).tensors)
    name = f"model.layers.0.mlp.up_proj.{packing.TILE_SCALE}"
    stored[name] = checkpoints.StoredTensor(stored[name].array * np.float32(2), "F32")
    checkpoints.write_safetensors(out / "model.safetensors", stored, {"format": "pt"})
    with pytest.raises(packing.PackError, match="qpn_tile_scale is not 2\\^T"):
        packing.load_packed(out)
    assert cli.main(["verify", str(out), "-q"]) == 1


def test_a_nan_scale_byte_is_refused_naming_the_file_and_tensor(tmp_path, capsys):
    folder = tmp_path / "nan"
    shutil.copytree(FOLDER, folder)
    file = folder / "model.safetensors"
    stored = dict(checkpoints.read_safetensors(file, mmap=False).tensors)
    name = "model.layers.1.self_attn.q_proj.weight_scale"
    scales = stored[name].array.copy()
    scales[5, 2] = 0xFF  # e8m0 NaN
    stored[name] = checkpoints.StoredTensor(scales, "U8")
    checkpoints.write_safetensors(file, stored, {"format": "pt"})
    with pytest.raises(checkpoints.CheckpointError) as info:
        checkpoints.load_checkpoint(folder)
    message = str(info.value)
    assert str(file) in message and name in message and "0xFF at index (5, 2)" in message
    for command in (["inspect", str(folder)], ["pack", str(folder), str(tmp_path / "out")],
                    ["verify", str(folder)]):
        assert cli.main(command) == 2
        assert "0xFF" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("blocks, scales, match", [
    (np.zeros((32, 17), np.uint8), np.zeros((32, 1), np.uint8), "blocks must be uint8"),
    (np.zeros((32, 2, 16), np.int8), np.zeros((32, 2), np.uint8), "blocks must be uint8"),
    (np.zeros((32, 2, 16), np.uint8), np.zeros((32, 1), np.uint8), r"scales must have shape \(N, K/32\) = \(32, 2\)"),
    (np.zeros((32, 32), np.uint8), np.zeros((32, 2), np.float32), "scales must be a 2-D uint8 array"),
])
def test_mxfp4_linear_refuses_bad_fields(blocks, scales, match):
    with pytest.raises(ValueError, match=match):
        checkpoints.MXFP4Linear("x", blocks, scales)


def test_a_config_mixing_nvfp4_and_mxfp4_groups_is_refused(tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(FOLDER, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    group = config["quantization_config"]["config_groups"]["group_0"]
    config["quantization_config"]["config_groups"]["group_1"] = dict(
        group, format="nvfp4-pack-quantized", targets=["re:.*never$"],
        weights=dict(group["weights"], strategy="tensor_group", group_size=16))
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(checkpoints.CheckpointError, match="config groups mix mxfp4-pack-quantized and "
                                                          "nvfp4-pack-quantized"):
        checkpoints.load_checkpoint(folder)
