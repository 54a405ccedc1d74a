"""What a new user runs into first (issue 20, items 2 and 3).

- A load that finds no quantized layer, or leaves parameters of the model unfilled, is an error:
  `qpn inspect` / `qpn verify` exit 2 with one line, `load_quantized` raises ValueError and leaves
  the model as it was (unless `allow_partial=True`).
- One rule for a single 128x128 FP8 block: a scale stated as block stays block (QPN8's block layout,
  N padded to 128) in `qpn pack`, `pack_fp8`, `QPNLinear.from_linear`, `convert` and qpn.ref; an
  unstated size-1 scale is per tensor. `convert` builds every new layer before it replaces one.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from qpn import ref
from qpn.checkpoints import packed
from qpn.ref.fp8 import fp8_block_grid_4d
from qpn.torch_bridge import QPNLinear, convert, load_quantized, pack_fp8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cli import build, run, tiny_model, write  # noqa: E402  (the small checkpoints of every kind)
from test_torch_convert import (  # noqa: E402  (the Tiny model and its checkpoints)
    Tiny,
    WithRotary,
    assert_unchanged,
    build_checkpoint,
    model_snapshot,
)

# ----------------------------------------------------------------------------------------------
# item 2: a load that loads nothing says so


@pytest.fixture()
def manifestless(tmp_path):
    """A `qpn pack` folder whose qpn_manifest.json was removed: a ModelOpt config, qpn_* tensors, no layer."""
    out = tmp_path / "packed"
    packed.pack_checkpoint(write(tmp_path, "nvfp4"), out)
    os.remove(out / packed.MANIFEST_FILE)
    return out


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_refuse_a_folder_without_a_quantized_layer(manifestless, command, capsys):
    code, out, err = run([command, manifestless], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    # what was looked for, what was found, the fix
    assert "no quantized layer" in err and "config.json quantization_config (modelopt NVFP4)" in err
    assert "11 tensors, none quantized" in err and "qpn_manifest.json" in err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_refuse_an_unquantized_checkpoint_with_a_config(tmp_path, command, capsys):
    c = build("fp8-tensor")
    ref.save_checkpoint(tmp_path / "plain", ref.Checkpoint(c.format, c.quant_algo, {}, c.tensors, c.config))
    code, out, err = run([command, tmp_path / "plain"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "no quantized layer" in err and "4 tensors, none quantized" in err and "modelopt FP8" in err


def test_load_quantized_refuses_a_checkpoint_without_a_quantized_layer(manifestless):
    model = tiny_model("nvfp4")
    before = model_snapshot(model)
    with pytest.raises(ValueError, match=r"no quantized layer.*11 tensors, none quantized.*allow_partial=True"):
        load_quantized(model, manifestless)
    assert_unchanged(model, before)
    report = load_quantized(model, manifestless, allow_partial=True)  # asked for: loads what fits
    assert report.quantized == [] and not any(isinstance(m, QPNLinear) for m in model.modules())


def test_load_quantized_refuses_unfilled_parameters():
    ckpt = build_checkpoint("modelopt-mixed", Tiny(seed=1))
    partial = ref.Checkpoint("modelopt", "MIXED_PRECISION", ckpt.linears,
                             {n: t for n, t in ckpt.tensors.items() if n not in ("embed.weight", "head.weight")}, {})
    model = Tiny(seed=2)
    before = model_snapshot(model)
    with pytest.raises(ValueError, match=r"2 model tensors.*\['embed\.weight', 'head\.weight'\].*allow_partial=True"):
        load_quantized(model, partial)
    assert_unchanged(model, before)
    report = load_quantized(model, partial, allow_partial=True)
    assert report.quantized == ["q", "up"] and report.missing == ["embed.weight", "head.weight"]


def test_tied_weights_and_non_persistent_buffers_count_as_loaded():
    ckpt = build_checkpoint("modelopt-mixed", WithRotary(seed=1))
    model = WithRotary(seed=2)
    model.head.weight = model.embed.weight  # tied: filled through embed.weight
    tensors = {n: t for n, t in ckpt.tensors.items() if n != "head.weight"}
    report = load_quantized(model, ref.Checkpoint("modelopt", "MIXED_PRECISION", ckpt.linears, tensors, {}))
    assert report.missing == [] and report.quantized == ["q", "up"]


def test_strict_and_allow_partial_contradict():
    with pytest.raises(ValueError, match="strict=True.*allow_partial=True"):
        load_quantized(Tiny(), build_checkpoint("modelopt-nvfp4", Tiny()), strict=True, allow_partial=True)


# ----------------------------------------------------------------------------------------------
# item 3: one rule for a single 128x128 block; convert is all or nothing


def block_reference_w16(w: np.ndarray) -> np.ndarray:
    """qpn.ref's contract W16 of `w` quantized with 128x128 block scales (rows padded to 128 as QPN8 block wants)."""
    q = ref.fp8_quantize(w, "block")
    n, k = w.shape
    rows = -(-n // 128) * 128
    codes = np.zeros((rows, k), np.uint8)
    codes[:n] = q.weight
    packed_codes, group_scales = ref.qpn8_prepack(codes, q.weight_scale, granularity="block")
    return ref.qpn8_dequantize(packed_codes, group_scales, rows, k)[:n]


def test_convert_fp8_block_converts_single_block_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128), nn.Linear(128, 128), nn.Linear(128, 64))
    weights = [layer.weight.detach().numpy().copy() for layer in model]
    assert convert(model, "fp8", fp8_granularity="block") == []
    for layer, w in zip(model, weights, strict=True):
        assert isinstance(layer, QPNLinear) and layer.fp8_granularity == "block"
        assert tuple(layer.group_scales.shape) == (layer.in_features // 128, -(-layer.out_features // 128) * 4)
        expected = block_reference_w16(w)
        assert np.array_equal(layer.dequantized_weight().numpy().view(np.uint16), expected.view(np.uint16))


class BoomOnThird(Exception):
    pass


def test_convert_replaces_nothing_when_a_layer_fails(monkeypatch):
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128), nn.Linear(128, 128))
    before = model_snapshot(model)
    built = []
    real = QPNLinear.from_linear.__func__

    def from_linear(cls, linear, *args, **kwargs):
        built.append(linear)
        if len(built) == 3:
            raise BoomOnThird("an unexpected failure in the third layer")
        return real(cls, linear, *args, **kwargs)

    monkeypatch.setattr(QPNLinear, "from_linear", classmethod(from_linear))
    with pytest.raises(BoomOnThird):
        convert(model, "fp8")
    assert [type(m) for m in model] == [nn.Linear] * 3
    assert_unchanged(model, before)


ONE_BLOCK_SHAPES = [(128, 128), (64, 128), (32, 128), (96, 128)]
SIZE_ONE_SCALES = [(), (1,), (1, 1), (1, 1, 1, 1)]


def one_block_layer(n: int, k: int, scale_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([n, k, len(scale_shape)])
    q = ref.fp8_quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), "tensor")
    return q.weight, q.weight_scale.reshape(scale_shape)


@pytest.mark.parametrize("scale_shape", SIZE_ONE_SCALES)
@pytest.mark.parametrize("n, k", ONE_BLOCK_SHAPES)
def test_a_stated_single_block_is_a_block_everywhere(n, k, scale_shape):
    weight, scale = one_block_layer(n, k, scale_shape)
    layer = ref.FP8Linear("x", weight, scale.reshape(1, 1), "block")  # as the checkpoint reader gives it
    by_pack = packed.prepack_layer(layer)  # what `qpn pack` writes
    by_torch = pack_fp8(weight, scale, "block")
    padded = np.zeros((128, k), np.uint8)
    padded[:n] = weight
    by_ref = ref.qpn8_prepack(padded, scale, granularity="block")
    assert by_pack["qpn_group_scales"].shape == (1, 4) and by_torch.padded_out_features == 128
    for codes, group_scales in [(by_torch.codes.numpy(), by_torch.buffers["group_scales"].numpy()), by_ref]:
        assert np.array_equal(codes, by_pack["qpn_codes"])
        assert np.array_equal(group_scales.view(np.uint16), by_pack["qpn_group_scales"].view(np.uint16))
    module = QPNLinear.from_modelopt_fp8(weight, scale, granularity="block")
    assert module.fp8_granularity == "block" and torch.equal(module.group_scales, by_torch.buffers["group_scales"])


@pytest.mark.parametrize("scale_shape", SIZE_ONE_SCALES)
def test_an_unstated_size_one_scale_is_per_tensor_everywhere(scale_shape):
    weight, scale = one_block_layer(64, 128, scale_shape)
    by_torch = pack_fp8(weight, scale)
    by_ref = ref.qpn8_prepack(weight, scale)
    assert ref.qpn8_scale_granularity(scale, 64, 128) == "tensor"
    assert ref.fp8_scale_granularity(scale, 64, 128) == "tensor"
    assert by_torch.buffers["group_scales"].shape == (1, 64) and by_ref[1].shape == (1, 64)
    assert np.array_equal(by_torch.codes.numpy(), by_ref[0])
    assert np.array_equal(by_torch.buffers["group_scales"].numpy().view(np.uint16), by_ref[1].view(np.uint16))
    assert QPNLinear.from_modelopt_fp8(weight, scale).fp8_granularity == "channel"  # the [1, N] layout


def test_load_quantized_gives_the_same_buffers_from_the_original_and_the_packed_folder(tmp_path):
    original = write(tmp_path, "fp8-block")  # its down_proj is one 128x128 block
    packed.pack_checkpoint(original, tmp_path / "packed")
    a, b = tiny_model("fp8-block"), tiny_model("fp8-block")
    load_quantized(a, original)
    load_quantized(b, tmp_path / "packed")
    assert a.state_dict().keys() == b.state_dict().keys()
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


def test_modelopt_writes_a_single_block_4d_or_0d_and_both_load_as_block():
    """ModelOpt 0.47 writes a one-block grid as (1, 1, 1, 1) or as a 0-d scale: an FP8_PB_WO layer (block stated)
    holding either is read and packed in the block layout ([K/128, N_pad/32], N padded to 128)."""
    from qpn.checkpoints import FP8Linear

    weight, scale = one_block_layer(64, 128, ())
    for shape in [(), fp8_block_grid_4d(64, 128)]:
        layer = FP8Linear("down", weight, scale.reshape(shape), "block")
        buffers = packed.prepack_layer(layer)
        assert layer.granularity == "block" and buffers[packed.GROUP_SCALES].shape == (1, 4)
        assert buffers[packed.CODES].shape == (128, 128)

