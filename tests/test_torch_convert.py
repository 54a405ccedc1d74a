"""convert() and load_quantized() on a small model with every kind of layer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from qpn import ref
from qpn.checkpoints import packed
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
    for name in ("q", "up"):
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


# ----------------------------------------------------------------------------- all or nothing


def model_snapshot(model: nn.Module) -> tuple[dict, dict]:
    """(state_dict copies, module types by name): what a failed load must leave as it was."""
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return state, {name: type(m) for name, m in model.named_modules()}


def assert_unchanged(model: nn.Module, snapshot) -> None:
    state, types = model_snapshot(model)
    assert types == snapshot[1]
    assert state.keys() == snapshot[0].keys()
    assert all(torch.equal(state[name], snapshot[0][name]) for name in state)


class WrongUp(Tiny):
    """`up` is the LAST quantized layer (sorted): a load fails there after `q` was fine."""

    def __init__(self):
        super().__init__(seed=5)
        self.up = nn.Linear(HIDDEN, 96)


class WrongNorm(Tiny):
    def __init__(self):
        super().__init__(seed=5)
        self.norm = nn.LayerNorm(HIDDEN + 1)


FAILING_LOADS = {  # model, strict, message
    "last layer's shape": (WrongUp, False, r"'up' is \[N, K\] = \[100, 64\] but the model's layer is \[96, 64\]"),
    "a copied tensor's shape": (WrongNorm, False, r"'norm\.(weight|bias)' has shape \(64,\)"),
    "strict, a ghost tensor": (Tiny, True, r"ghost.weight"),
}


@pytest.mark.parametrize("case", list(FAILING_LOADS))
def test_a_failing_load_leaves_the_model_unchanged(case):
    make, strict, message = FAILING_LOADS[case]
    ckpt = build_checkpoint("modelopt-mixed", Tiny(seed=1))
    if strict:
        ckpt = ref.Checkpoint("modelopt", "MIXED_PRECISION", ckpt.linears,
                              {**ckpt.tensors, "ghost.weight": np.zeros(3, np.float32)}, {})
    model = make()
    before = model_snapshot(model)
    with pytest.raises(ValueError, match=message):
        load_quantized(model, ckpt, strict=strict)
    assert_unchanged(model, before)


class WithRotary(Tiny):
    """A non-persistent buffer, as transformers' rotary inv_freq: never in state_dict() or a checkpoint."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


def test_strict_ignores_non_persistent_buffers_and_counts_tied_names_once():
    source = WithRotary(seed=1)
    ckpt = build_checkpoint("modelopt-mixed", source)
    model = WithRotary(seed=2)
    model.head.weight = model.embed.weight  # tied: the checkpoint fills both names through one of them
    tensors = {name: t for name, t in ckpt.tensors.items() if name != "head.weight"}
    report = load_quantized(model, ref.Checkpoint("modelopt", "MIXED_PRECISION", ckpt.linears, tensors, {}),
                            strict=True)
    assert report.missing == [] and "inv_freq" not in report.missing
    assert model.head.weight is model.embed.weight and torch.equal(model.head.weight, source.embed.weight)


# ----------------------------------------------------------------------------- packed folders: checked at load


def packed_tiny(tmp_path) -> str:
    """Tiny's q as FP8 per tensor (N = K = 64) and up as NVFP4 with an input scale (N = 100: pad rows 100..127)."""
    ref.save_checkpoint(tmp_path / "ckpt", build_checkpoint("modelopt-mixed", Tiny(seed=1)))
    packed.pack_checkpoint(tmp_path / "ckpt", tmp_path / "packed")
    return str(tmp_path / "packed")


def edit_tensor(name: str, edit):
    def apply(folder: str) -> None:
        path = os.path.join(folder, "model.safetensors")
        tensors = dict(ref.read_safetensors(path, mmap=False).tensors)
        array = np.array(tensors[name].array)
        tag = tensors[name].dtype
        result = edit(array)
        array, tag = result if isinstance(result, tuple) else (array if result is None else result, tag)
        tensors[name] = ref.StoredTensor(array, tag)
        ref.write_safetensors(path, tensors, {"format": "pt"})
    return apply


def edit_manifest(edit):
    def apply(folder: str) -> None:
        path = os.path.join(folder, packed.MANIFEST_FILE)
        with open(path) as f:
            manifest = json.load(f)
        edit(manifest)
        with open(path, "w") as f:
            json.dump(manifest, f)
    return apply


def at(index, value):
    def edit(a):
        a.reshape(-1)[index] = value
    return edit


def scaled(factor, where=slice(None)):
    def edit(a):
        a.reshape(-1)[where] *= factor
    return edit


def layer(name: str, key: str, value):
    def edit(m):
        m["layers"][name][key] = value
    return edit


# (alteration, message): every one loaded silently or half-checked before load_packed checked values
PACKED_ALTERATIONS = {
    "NaN NVFP4 scale byte": (edit_tensor("up.qpn_scales", at(5, 0x7F)), "NaN e4m3"),
    "negative NVFP4 scale byte": (edit_tensor("up.qpn_scales", at(5, 0xB8)), "negative e4m3 block scales"),
    "NaN global scale tile": (edit_tensor("up.qpn_global_scale", at(1, np.nan)), "global"),
    "one global scale tile doubled": (edit_tensor("up.qpn_global_scale", scaled(2, slice(0, 1))),
                                      "repeat the manifest's global scale"),
    "every global scale tile doubled": (edit_tensor("up.qpn_global_scale", scaled(2)),
                                        "repeat the manifest's global scale"),
    "global scale overflowing fp16 (tensor and manifest)": (
        lambda f: (edit_tensor("up.qpn_global_scale", at(slice(None), 1e30))(f),
                   edit_manifest(layer("up", "global_scale", [float(np.float32(1e30))]))(f)), "beyond fp16"),
    "NVFP4 pad row code": (edit_tensor("up.qpn_codes", at(-1, 0x11)), "pad rows 100..127 are not zero"),
    "NVFP4 pad row scale": (edit_tensor("up.qpn_scales", at(-1, 0x38)), "pad rows 100..127 are not zero"),
    "input scale altered": (edit_tensor("up.qpn_input_scale", scaled(2)), "up.qpn_input_scale"),
    "NaN FP8 code": (edit_tensor("q.qpn_codes", at(7, 0xFF)), "NaN e4m3"),
    "NaN FP8 group scale": (edit_tensor("q.qpn_group_scales", at(3, np.nan)), "is not RN16"),
    "FP8 group scale doubled": (edit_tensor("q.qpn_group_scales", scaled(2, slice(0, 1))), "is not RN16"),
    "negative FP8 weight scale": (edit_tensor("q.qpn_weight_scale", scaled(-1)), "finite and > 0"),
    "FP8 weight scale differs from the manifest": (edit_tensor("q.qpn_weight_scale", scaled(0.5)), "manifest says"),
    "global scale retagged F16": (edit_tensor("up.qpn_global_scale", lambda a: (a.astype(np.float16), "F16")),
                                  "must be F32"),
    "codes cut to fewer rows": (edit_tensor("up.qpn_codes", lambda a: a[:96].copy()), "must be U8 \\[128, 32\\]"),
    "manifest n": (edit_manifest(layer("up", "n", 99)), "source_tensors"),
    "manifest n_padded": (edit_manifest(layer("up", "n_padded", 100)), "n_padded = 100"),
    "manifest k": (edit_manifest(layer("q", "k", 48)), "source_tensors"),
    "manifest format": (edit_manifest(layer("q", "format", "nvfp4")), "layout"),
    "manifest granularity": (edit_manifest(layer("q", "granularity", "channel")), "source_tensors"),
    "manifest global scale": (edit_manifest(layer("up", "global_scale", [0.5])), "repeat the manifest's global scale"),
    "manifest input scale dropped": (edit_manifest(lambda m: m["layers"]["up"].pop("input_scale")),
                                     "recorded in the manifest"),
    "manifest copied tensor shape": (edit_manifest(lambda m: m["tensors"]["norm.weight"].update(shape=[32])),
                                     "manifest records"),
    "manifest names another file": (edit_manifest(layer("q", "file", "other.safetensors")), "other.safetensors"),
}


@pytest.mark.parametrize("case", list(PACKED_ALTERATIONS))
def test_load_quantized_refuses_an_altered_packed_folder(tmp_path, case):
    alter, message = PACKED_ALTERATIONS[case]
    folder = packed_tiny(tmp_path)
    load_quantized(Tiny(), folder, strict=True)  # the unaltered folder loads
    alter(folder)
    model = Tiny(seed=7)
    before = model_snapshot(model)
    with pytest.raises(packed.PackError, match=message):
        load_quantized(model, folder)
    assert_unchanged(model, before)
