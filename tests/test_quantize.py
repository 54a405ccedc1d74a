"""`qpn quantize` (checkpoints/quantize.py, apps/quantize_cmd.py): ModelOpt's bytes, loadable output, mse.

The float model is the one tests/fixtures/make_modelopt_fixtures.py gave REAL ModelOpt 0.47: its
seeded bf16 Llama, rebuilt here (its unquantized tensors - embeddings, lm_head, norms - equal the
fixtures' byte for byte, checked first) and saved as a Hugging Face folder. `qpn quantize --method rtn`
of it must then write every tensor ModelOpt wrote, byte for byte (input_scale aside: qpn writes
weight-only checkpoints).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import qpn
from qpn.apps import cli
from qpn.checkpoints import load_checkpoint
from qpn.checkpoints.quantize import FORMATS, quantize_checkpoint
from qpn.checkpoints.safetensors_io import StoredTensor, read_safetensors, write_safetensors
from qpn.ref.codecs import decode_e4m3
from qpn.ref.fp8 import fp8_scale_map
from qpn.ref.mxfp4 import mxfp4_dequantize
from qpn.ref.nvfp4 import nvfp4_dequantize_fp32

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the float model is a Llama (the [test] extra has it)")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "modelopt")
SEED = 20260211  # make_modelopt_fixtures.py's model
# --format -> (fixture, whether ModelOpt's exporter shared the fused groups' scales in it)
BYTES_CASES = {"nvfp4": ("nvfp4", False), "fp8": ("fp8_tensor", False), "fp8-channel": ("fp8_channel", False),
               "fp8-block": ("fp8_block", True)}
UNQUANTIZED = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
SIDE = {"tokenizer_config.json": '{"model_max_length": 64}', "generation_config.json": '{"do_sample": false}',
        "chat_template.jinja": "{{ messages }}"}


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def fixture_tensors(name: str) -> dict[str, StoredTensor]:
    return read_safetensors(os.path.join(fixture(name), "model.safetensors")).tensors


@pytest.fixture(scope="module")
def float_model(tmp_path_factory) -> str:
    """The fixtures' seeded bf16 Llama as a Hugging Face folder (config.json, model.safetensors, side files)."""
    with open(os.path.join(fixture("nvfp4"), "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    torch.manual_seed(SEED)  # make_modelopt_fixtures.tiny_llama, step for step
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    state = {name: StoredTensor(t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), "BF16")
             for name, t in model.state_dict().items()}
    theirs = fixture_tensors("nvfp4")
    for name in UNQUANTIZED:  # the same float model, or every comparison below is moot
        assert np.array_equal(state[name].array, theirs[name].array), name
    folder = tmp_path_factory.mktemp("float") / "tiny-llama"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", state, {"format": "pt"})
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    for name, text in SIDE.items():
        (folder / name).write_text(text)
    return str(folder)


@pytest.mark.parametrize("fmt", sorted(BYTES_CASES))
def test_rtn_bytes_equal_modelopt(float_model, tmp_path, fmt):
    fixture_name, shared = BYTES_CASES[fmt]
    out = tmp_path / "out"
    report = quantize_checkpoint(float_model, out, fmt, shared_fused_scales=shared)
    ours = read_safetensors(out / "model.safetensors").tensors
    theirs = fixture_tensors(fixture_name)
    assert sorted(ours) == sorted(n for n in theirs if not n.endswith(".input_scale"))
    for name, tensor in ours.items():
        assert (tensor.dtype, tensor.shape) == (theirs[name].dtype, theirs[name].shape), name
        assert np.array_equal(tensor.array, theirs[name].array), name
    assert len(report.quantized) == 14 and sorted(report.excluded) == ["lm_head", "model.embed_tokens"]
    for file, section in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        with open(os.path.join(fixture(fixture_name), file)) as f:
            expected = json.load(f)
        with open(out / file) as f:
            written = json.load(f)
        for group in expected[section].get("config_groups", {}).values():
            group["input_activations"] = None  # weight-only: nothing calibrated an activation scale
        for config in (expected, expected[section]):  # the producer's name: ModelOpt's, qpn's
            config.pop("producer", None)
        assert (written.pop("producer", None) or written[section].pop("producer")) == \
            {"name": "qpn", "version": qpn.__version__}
        assert written[section] == expected[section], file
    for name, text in SIDE.items():
        assert (out / name).read_text() == text


def test_shared_fused_scales_nvfp4(float_model, tmp_path):
    """ModelOpt's exporter form: q/k/v share one global scale (the largest), gate/up another, each member
    re-quantized with it; the default keeps each projection's own (the fixture's per-layer quantizer)."""
    quantize_checkpoint(float_model, tmp_path / "shared", "nvfp4", shared_fused_scales=True)
    shared = read_safetensors(tmp_path / "shared" / "model.safetensors").tensors
    own = fixture_tensors("nvfp4")
    for layer in range(2):
        for group in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            names = [f"model.layers.{layer}.{group[0]}.{p}.weight_scale_2" for p in group[1]]
            assert len({float(shared[n].array) for n in names}) == 1
            assert float(shared[names[0]].array) == max(float(own[n].array) for n in names)
            changed = [n for n in names if not np.array_equal(shared[n.replace("_scale_2", "")].array,
                                                              own[n.replace("_scale_2", "")].array)]
            assert changed  # the members below the max were re-quantized
        o_proj = f"model.layers.{layer}.self_attn.o_proj.weight"
        assert np.array_equal(shared[o_proj].array, own[o_proj].array)


def _layer_errors(folder: str, float_folder: str) -> dict[str, float]:
    """Squared error of every quantized layer's fp32 decode against the float weights (float64 sums)."""
    floats = read_safetensors(os.path.join(float_folder, "model.safetensors")).tensors
    checkpoint = load_checkpoint(folder)
    errors = {}
    for name, linear in checkpoint.linears.items():
        w = (floats[f"{name}.weight"].array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if hasattr(linear, "weight_packed") and hasattr(linear, "global_scale"):
            values = nvfp4_dequantize_fp32(linear.weight_packed, linear.weight_scale, linear.global_scale)
        elif hasattr(linear, "blocks"):
            values = mxfp4_dequantize(linear.blocks, linear.scales).reshape(w.shape)
        else:
            values = decode_e4m3(linear.weight) * fp8_scale_map(linear.weight_scale, *w.shape)
        errors[name] = float(((w - values) ** 2).sum())
    return errors


@pytest.mark.parametrize("fmt", [f for f in sorted(FORMATS) if "mse" in FORMATS[f].methods])
def test_mse_error_at_most_rtn_on_every_layer(float_model, tmp_path, fmt):
    quantize_checkpoint(float_model, tmp_path / "rtn", fmt)
    quantize_checkpoint(float_model, tmp_path / "mse", fmt, method="mse")
    rtn, mse = _layer_errors(str(tmp_path / "rtn"), float_model), _layer_errors(str(tmp_path / "mse"), float_model)
    assert sorted(rtn) == sorted(mse) and len(rtn) == 14
    assert all(mse[name] <= rtn[name] for name in rtn), {n: mse[n] / rtn[n] for n in rtn}
    if fmt == "nvfp4":  # the search must find something on NVFP4's coarse grid, not merely tie
        assert sum(mse.values()) < 0.9 * sum(rtn.values())


@pytest.mark.parametrize("method", ["rtn", "mse"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_output_loads_packs_verifies(float_model, tmp_path, fmt, method, capsys):
    if method not in FORMATS[fmt].methods:
        pytest.skip(f"{fmt} has no {method} search")
    out = tmp_path / "q"
    assert cli.main(["quantize", float_model, str(out), "--format", fmt, "--method", method, "-q"]) == 0
    printed = capsys.readouterr().out
    assert "lm_head" in printed and "model.embed_tokens" in printed  # the unquantized modules are listed
    assert cli.main(["inspect", str(out)]) == 0
    assert cli.main(["verify", str(out), "-q"]) == 0
    assert cli.main(["pack", str(out), str(tmp_path / "packed"), "-q"]) == 0
    from qpn.torch_bridge import QPNLinear, load_quantized

    config = transformers.AutoConfig.from_pretrained(str(out))
    model = transformers.LlamaForCausalLM(config).float().eval()
    load_quantized(model, str(out))
    assert sum(isinstance(m, QPNLinear) for m in model.modules()) == 14
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_sharded_source_and_output(float_model, tmp_path):
    """A sharded SRC (index + two files) and small output shards give the same tensors as one file."""
    tensors = read_safetensors(os.path.join(float_model, "model.safetensors")).tensors
    src = tmp_path / "sharded"
    src.mkdir()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        write_safetensors(src / file, {n: tensors[n] for n in part}, {"format": "pt"})
    with open(src / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {n: file for file, part in halves.items() for n in part}}, f)
    with open(src / "config.json", "w") as f, open(os.path.join(float_model, "config.json")) as g:
        f.write(g.read())
    report = quantize_checkpoint(src, tmp_path / "out", "nvfp4", shard_bytes=100_000)
    assert len(report.files) > 2 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    quantize_checkpoint(float_model, tmp_path / "one", "nvfp4")
    split, one = load_checkpoint(str(tmp_path / "out")), load_checkpoint(str(tmp_path / "one"))
    assert sorted(split.tensors) == sorted(one.tensors) and sorted(split.linears) == sorted(one.linears)
    for name in one.linears:
        assert np.array_equal(split.linears[name].weight_packed, one.linears[name].weight_packed)


def _nan_model(float_model: str, tmp_path) -> str:
    src = tmp_path / "nan"
    src.mkdir()
    tensors = dict(read_safetensors(os.path.join(float_model, "model.safetensors")).tensors)
    bad = tensors["model.layers.1.mlp.up_proj.weight"].array.copy()
    bad[3, 5] = 0x7FC0  # bf16 NaN
    tensors["model.layers.1.mlp.up_proj.weight"] = StoredTensor(bad, "BF16")
    write_safetensors(src / "model.safetensors", tensors, {"format": "pt"})
    with open(src / "config.json", "w") as f, open(os.path.join(float_model, "config.json")) as g:
        f.write(g.read())
    return str(src)


def test_bad_input_is_one_line_and_exit_2(float_model, tmp_path, capsys):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    cases = {  # argv -> words the one line must hold
        (str(tmp_path / "missing"), str(tmp_path / "o1"), "--format", "nvfp4"): "is not a folder",
        (fixture("nvfp4"), str(tmp_path / "o2"), "--format", "nvfp4"): "already quantized",
        (_nan_model(float_model, tmp_path), str(tmp_path / "o3"), "--format", "fp8"):
            "model.layers.1.mlp.up_proj.weight",
        (float_model, str(user), "--format", "nvfp4", "--overwrite"): "notes.txt",
        (float_model, str(tmp_path / "o4"), "--format", "mxfp4", "--exclude", "*"): "check --exclude",
        (float_model, str(tmp_path / "o5"), "--format", "nvfp4", "--shard-mib", "0"): "at least 1",
    }
    for argv, words in cases.items():
        assert cli.main(["quantize", *argv, "-q"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, err
    assert (user / "notes.txt").read_text() == "mine" and sorted(os.listdir(user)) == ["notes.txt"]
    assert not any(os.path.exists(tmp_path / f"o{i}") for i in range(1, 6))


def test_overwrite_replaces_only_its_own_output(float_model, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["quantize", float_model, str(out), "--format", "fp8", "-q"]) == 0
    assert cli.main(["quantize", float_model, str(out), "--format", "nvfp4", "-q"]) == 2  # no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["quantize", float_model, str(out), "--format", "nvfp4", "-q", "--overwrite"]) == 0
    assert load_checkpoint(str(out)).quant_algo == "NVFP4"


def test_interrupt_leaves_nothing_behind(float_model, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of the tensors: exit 130, no OUT, no temporary folder."""
    from qpn.checkpoints import quantize as module

    real, calls = module._quantize_one, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_quantize_one", interrupted)
    parent = tmp_path / "parent"
    parent.mkdir()
    assert cli.main(["quantize", float_model, str(parent / "out"), "--format", "nvfp4", "-q"]) == 130
    assert os.listdir(parent) == [] and len(calls) == 5


# ----------------------------------------------------------------------------- the sliced quantizer

# (rows, K) chosen against SLICE_VALUES = 1000 below: rows not a multiple of the slice's rows, ragged 128x128
# FP8 blocks in both directions (300 = 2 * 128 + 44 rows, K = 96 or 288 = 2 * 128 + 32), one row
SLICED_SHAPES = ((300, 96), (131, 288), (1, 32))
SOURCE_TAGS = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def _awkward_weight(shape: tuple[int, int], tag: str) -> StoredTensor:
    """Normal weights with the cases the rules treat apart: outliers, an all-zero row and 16-block, -0.0."""
    rng = np.random.default_rng(sum(shape))
    w = rng.standard_normal(shape).astype(np.float32) * np.float32(0.02)
    w.flat[:: 97] *= np.float32(40)  # outliers, so blocks' scales differ from the tensor's
    w[-1] = 0.0
    w[0, :16] = -0.0
    if tag == "BF16":
        return StoredTensor((w.view(np.uint32) >> 16).astype(np.uint16), "BF16")  # truncation: bf16 values
    return StoredTensor(w.astype(SOURCE_TAGS[tag]), tag)


def _whole_tensor_ref(fmt: str, method: str, w32: np.ndarray, tag: str) -> tuple[np.ndarray, ...]:
    """The ref quantizer on the whole weight: what the sliced path must write."""
    from qpn.ref.fp8 import fp8_quantize
    from qpn.ref.mxfp4 import mxfp4_quantize
    from qpn.ref.nvfp4 import nvfp4_quantize
    from qpn.ref.scale_search import fp8_quantize_mse, mxfp4_quantize_mse, nvfp4_quantize_mse

    if fmt == "nvfp4":
        return tuple((nvfp4_quantize_mse if method == "mse" else nvfp4_quantize)(w32))
    if fmt == "mxfp4":
        return tuple((mxfp4_quantize_mse if method == "mse" else mxfp4_quantize)(w32))
    granularity = FORMATS[fmt].granularity
    quotient = {"BF16": "bfloat16", "F16": "float16", "F32": None}[tag] if granularity == "tensor" else None
    if method == "mse":
        return tuple(fp8_quantize_mse(w32, granularity, quotient))
    return tuple(fp8_quantize(w32, granularity, quotient_dtype=quotient))


@pytest.mark.parametrize("tag", sorted(SOURCE_TAGS))
@pytest.mark.parametrize("shape", SLICED_SHAPES)
@pytest.mark.parametrize("fmt_method", [(f, m) for f in sorted(FORMATS) for m in FORMATS[f].methods])
def test_sliced_quantizer_writes_the_whole_tensor_bytes(monkeypatch, fmt_method, shape, tag):
    from concurrent.futures import ThreadPoolExecutor

    from qpn.checkpoints import quantize as module

    fmt, method = fmt_method
    if shape[1] % FORMATS[fmt].k_multiple:
        pytest.skip(f"{fmt} does not group K = {shape[1]}")
    monkeypatch.setattr(module, "SLICE_VALUES", 1000)  # many slices: 10 rows of K = 96, 3 of K = 288, 128 for blocks
    stored = _awkward_weight(shape, tag)
    with ThreadPoolExecutor(2) as pool:
        linear = module._quantize_one(FORMATS[fmt], method, "layer", stored, None, pool)
    expected = _whole_tensor_ref(fmt, method, module._float32(stored), tag)
    got = {"nvfp4": ("weight_packed", "weight_scale", "global_scale"), "mxfp4": ("blocks", "scales")}.get(
        fmt, ("weight", "weight_scale"))
    for field_name, want in zip(got, expected, strict=True):
        have = np.asarray(getattr(linear, field_name))
        assert have.dtype == want.dtype and np.array_equal(have.reshape(want.shape), want), field_name


def test_nan_in_a_later_slice_names_the_files_index(monkeypatch):
    """Finiteness is judged on the whole tensor first: the index is the tensor's, not the slice's."""
    from concurrent.futures import ThreadPoolExecutor

    from qpn.checkpoints import quantize as module

    monkeypatch.setattr(module, "SLICE_VALUES", 1000)
    stored = _awkward_weight((300, 96), "BF16")
    bits = stored.array.copy()
    bits[250, 7] = 0x7F80  # +inf, in the 26th slice of 10 rows
    with ThreadPoolExecutor(2) as pool, pytest.raises(ValueError, match=r"first at index \(250, 7\)"):
        module._quantize_one(FORMATS["nvfp4"], "rtn", "layer", StoredTensor(bits, "BF16"), None, pool)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_quantizer_memory_is_slices_not_the_tensor(fmt):
    """Peak numpy memory while one [2048, 4096] bf16 weight (16 MiB) is quantized: its output (4 MiB NVFP4,
    8 MiB FP8), the checkpoint data model's check of it (FP8Linear's NaN-byte mask: twice the codes) and a few
    slices per worker, below twice the source's size. The whole-tensor ref quantizers the path ran before
    needed 190 MiB (NVFP4) and 568 MiB (FP8) for this weight (tracemalloc, before the check)."""
    import tracemalloc
    from concurrent.futures import ThreadPoolExecutor

    from qpn.checkpoints import quantize as module

    stored = _awkward_weight((2048, 4096), "BF16")
    with ThreadPoolExecutor(2) as pool:
        module._quantize_one(FORMATS[fmt], "rtn", "warm", _awkward_weight((16, 4096), "BF16"), None, pool)
        tracemalloc.start()
        try:
            module._quantize_one(FORMATS[fmt], "rtn", "layer", stored, None, pool)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 2 * stored.nbytes, f"{peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", ["e2m1", "e4m3", "e4m3 of the bf16 quotient"])
def test_class_tables_equal_their_rules_on_every_float32(name):
    """ref/float_classes.py: each table entry equals its rule at both ends of its class's interval; the rules
    are monotone in |x| per sign, so they then equal the table on every float32 but NaN (2^32 values)."""
    from qpn.ref.codecs import encode_e2m1, encode_e4m3
    from qpn.ref.dtypes import round_to
    from qpn.ref.float_classes import class_points, e2m1_table, e4m3_table, lookup_classes

    table, rule = {"e2m1": (e2m1_table(), encode_e2m1), "e4m3": (e4m3_table(), encode_e4m3),
                   "e4m3 of the bf16 quotient": (e4m3_table(True), lambda x: encode_e4m3(round_to("bfloat16", x)))
                   }[name]
    for low_bits in (1, 0x7FFF):  # the smallest and largest magnitude of each class
        points = class_points(low_bits)
        points = points[~np.isnan(points)]
        assert np.array_equal(lookup_classes(points, table), rule(points)), low_bits


def test_mxfp4_float32_path_equals_the_float64_rule():
    """mxfp4_quantize works in float32 for float32 / float16 input: the same bytes as its float64 path on
    random float32 bit patterns (subnormals to 2^128), blocks 2^-140 .. 2^120 wide, and float16 weights."""
    from qpn.ref.mxfp4 import mxfp4_quantize

    rng = np.random.default_rng(3)
    any_bits = rng.integers(0, 1 << 32, size=(1024, 256), dtype=np.uint64).astype(np.uint32).view(np.float32)
    scaled = rng.standard_normal((1024, 256)) * np.exp2(rng.integers(-140, 120, size=(1024, 1)))
    half = (rng.standard_normal((1024, 256)) * 1000).astype(np.float16)
    for w in (np.where(np.isfinite(any_bits), any_bits, np.float32(1.5)), scaled.astype(np.float32), half):
        fast, wide = mxfp4_quantize(w), mxfp4_quantize(w.astype(np.float64))
        assert np.array_equal(fast.blocks, wide.blocks) and np.array_equal(fast.scales, wide.scales)
