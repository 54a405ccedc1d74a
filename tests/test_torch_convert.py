"""convert() and load_quantized() on a small model with every kind of layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from qpn import ref
from qpn.torch_bridge import QPNLinear, convert, load_quantized

HIDDEN, WIDE, VOCAB = 64, 100, 50
CONVERT_FORMATS = ["nvfp4", "fp8"]
# checkpoint layout -> (format, quant_algo, how each quantized layer is stored)
CHECKPOINT_LAYOUTS = {
    "modelopt-nvfp4": ("modelopt", "NVFP4", "nvfp4"),
    "modelopt-fp8-tensor": ("modelopt", "FP8", "tensor"),
    "modelopt-fp8-channel": ("modelopt", "FP8_PER_CHANNEL_PER_TOKEN", "channel"),
    "modelopt-mixed": ("modelopt", "MIXED_PRECISION", "mixed"),
    "compressed-tensors-nvfp4": ("compressed-tensors", "NVFP4", "nvfp4"),
}


class Tiny(nn.Module):
    """Embedding, norm, attention-like linears, an MLP whose down projection has K = 100
    (unaligned for both formats), a head, and a MultiheadAttention (its out_proj subclass)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.up = nn.Linear(HIDDEN, WIDE)  # N = 100: padded to 128 inside QPNLinear
        self.down = nn.Linear(WIDE, HIDDEN)  # K = 100: stays
        self.mha = nn.MultiheadAttention(HIDDEN, 4, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.norm(self.embed(tokens))
        h = h + self.q(h)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.head(h)


TOKENS = torch.arange(24).reshape(2, 12) % VOCAB


@pytest.mark.parametrize("fmt", CONVERT_FORMATS)
def test_convert_replaces_eligible_layers_and_reports_the_rest(fmt):
    model = Tiny()
    reference = model(TOKENS)
    skipped = dict(convert(model, fmt, skip=("he*",)))
    assert isinstance(model.q, QPNLinear) and isinstance(model.up, QPNLinear)
    assert type(model.down) is nn.Linear and type(model.head) is nn.Linear
    assert set(skipped) == {"down", "head", "mha.out_proj"}
    assert "pad the input features" in skipped["down"]
    assert skipped["head"] == "listed in skip"
    assert "subclass of nn.Linear" in skipped["mha.out_proj"]
    out = model(TOKENS)
    assert out.dtype == torch.float32 and out.shape == reference.shape
    cosine = torch.nn.functional.cosine_similarity(out.flatten(), reference.flatten(), dim=0)
    assert cosine > 0.98  # a 4-bit / 8-bit model stays close to its fp32 original


def test_convert_reports_a_weight_the_quantizer_rejects():
    model = Tiny()
    with torch.no_grad():
        model.q.weight[0, 0] = float("nan")
    skipped = dict(convert(model, "nvfp4"))
    assert "finite" in skipped["q"] and type(model.q) is nn.Linear


def build_checkpoint(layout: str, model: Tiny) -> ref.Checkpoint:
    fmt, algo, kind = CHECKPOINT_LAYOUTS[layout]
    linears = {}
    for i, name in enumerate(("q", "up")):
        w = getattr(model, name).weight.detach().numpy()
        if kind == "nvfp4" or (kind == "mixed" and name == "up"):
            linears[name] = ref.NVFP4Linear(name, *ref.nvfp4_quantize(w), input_scale=np.float32(1.0))
        else:
            granularity = "tensor" if kind == "mixed" else kind
            q = ref.fp8_quantize(w, granularity)
            linears[name] = ref.FP8Linear(name, q.weight, q.weight_scale, granularity)
    tensors = {name: p.detach().numpy().copy() for name, p in model.state_dict().items()
               if name.rpartition(".")[0] not in linears}
    # keep the norm in bf16 on disk: load_quantized must cast it into the fp32 parameter
    tensors["norm.weight"] = ref.StoredTensor(
        torch.from_numpy(tensors["norm.weight"]).bfloat16().view(torch.uint16).numpy(), "BF16")
    for name in linears:
        tensors[f"{name}.bias"] = getattr(model, name).bias.detach().numpy().copy()
    return ref.Checkpoint(fmt, algo, linears, tensors, {})


@pytest.mark.parametrize("layout", list(CHECKPOINT_LAYOUTS))
def test_load_quantized_fills_a_fresh_model(tmp_path, layout):
    source = Tiny(seed=1)
    ref.save_checkpoint(tmp_path / "ckpt", build_checkpoint(layout, source))
    loaded = ref.load_checkpoint(tmp_path / "ckpt")
    model = Tiny(seed=2)  # different random weights: everything must come from the checkpoint
    report = load_quantized(model, tmp_path / "ckpt", strict=True)
    assert report.quantized == ["q", "up"]
    assert report.unexpected == [] and report.missing == []
    assert "norm.weight" in report.copied and "q.bias" not in report.copied
    for name in ("q", "up"):
        module = getattr(model, name)
        assert isinstance(module, QPNLinear)
        expected = QPNLinear.from_checkpoint(loaded.linears[name], bias=getattr(source, name).bias.detach())
        assert torch.equal(module.dequantized_weight(), expected.dequantized_weight())
        assert torch.equal(module.bias, getattr(source, name).bias.detach())
    assert torch.equal(model.norm.weight, source.norm.weight.detach().bfloat16().float())
    assert torch.equal(model.down.weight, source.down.weight)
    assert torch.equal(model.embed.weight, source.embed.weight)
    out = model(TOKENS)
    cosine = torch.nn.functional.cosine_similarity(out.flatten(), source(TOKENS).flatten(), dim=0)
    assert cosine > 0.98


def test_load_quantized_compressed_tensors_global_scale_is_the_multiplier(tmp_path):
    """The checkpoint stores 1/g; the loaded layer decodes with g = RN32(1/stored)."""
    source = Tiny(seed=3)
    ckpt = build_checkpoint("compressed-tensors-nvfp4", source)
    ref.save_checkpoint(tmp_path / "ct", ckpt)
    model = Tiny(seed=4)
    load_quantized(model, tmp_path / "ct")
    lin = ref.load_checkpoint(tmp_path / "ct").linears["q"]
    expected = ref.nvfp4_dequantize(lin.weight_packed, lin.weight_scale, lin.global_scale)
    assert np.array_equal(model.q.dequantized_weight().numpy().view(np.uint16), expected.view(np.uint16))


def test_load_quantized_errors_name_the_layer(tmp_path):
    source = Tiny()
    ckpt = build_checkpoint("modelopt-nvfp4", source)

    class Other(Tiny):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(HIDDEN, 32)

    with pytest.raises(ValueError, match=r"'q' is \[N, K\] = \[64, 64\] but the model's layer is \[32, 64\]"):
        load_quantized(Other(), ckpt)
    ghost = {**ckpt.tensors, "ghost.weight": np.zeros(3, np.float32)}
    extra = ref.Checkpoint("modelopt", "NVFP4", ckpt.linears, ghost, {})
    with pytest.raises(ValueError, match="ghost.weight"):
        load_quantized(Tiny(), extra, strict=True)
    assert load_quantized(Tiny(), extra).unexpected == ["ghost.weight"]
