"""The `qpn` command line (apps/cli.py, apps/verify.py) and the packed checkpoint format (checkpoints/packed/).

Small checkpoints of every kind are written with qpn.ref.save_checkpoint; the commands run
in-process through `cli.main(argv)` (its return value is the exit code), except where the real
entry point matters (`python -m qpn`: no traceback, the exit code the shell sees).
"""

from __future__ import annotations

import hashlib
import os
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

from qpn import ref
from qpn.apps import cli, output, verify
from qpn.checkpoints import packed, safetensors_io
from qpn.ref import Checkpoint, FP8Linear, NVFP4Linear, StoredTensor
from qpn.torch_bridge import QPNLinear, load_quantized

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import run_child  # noqa: E402

SEED = 20260
Q, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"
INPUT_SCALE = np.float32(0.0123)
# kind -> (checkpoint format, quant_algo, [(layer, per-layer format, N, K)]). N = 48 and 200 are
# padded (to 64 / 256); every K fits its layout.
KINDS = {
    "nvfp4": ("modelopt", "NVFP4", [(Q, "nvfp4", 48, 64), (DOWN, "nvfp4", 64, 128)]),
    "ct-nvfp4": ("compressed-tensors", "NVFP4", [(Q, "nvfp4", 48, 64), (DOWN, "nvfp4", 64, 128)]),
    "fp8-tensor": ("modelopt", "FP8", [(Q, "tensor", 48, 32), (DOWN, "tensor", 64, 128)]),
    "fp8-channel": ("modelopt", "FP8_PER_CHANNEL_PER_TOKEN", [(Q, "channel", 48, 32), (DOWN, "channel", 64, 128)]),
    "fp8-block": ("modelopt", "FP8_PB_WO", [(Q, "block", 200, 256), (DOWN, "block", 128, 128)]),
    "mixed": ("modelopt", "MIXED_PRECISION", [(Q, "tensor", 48, 32), (DOWN, "nvfp4", 64, 128)]),
}
SHARDED_BYTES = 6_000  # max_shard_bytes that splits the small checkpoints into several files


def float_weight(name: str, n: int, k: int) -> np.ndarray:
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode()), n, k])
    return (rng.standard_normal((n, k)) * 0.05).astype(np.float32)


def build(kind: str) -> Checkpoint:
    fmt, algo, layers = KINDS[kind]
    linears = {}
    for name, layer_format, n, k in layers:
        w = float_weight(name, n, k)
        input_scale = INPUT_SCALE if name == Q else None
        if layer_format == "nvfp4":
            q = ref.nvfp4_quantize(w)
            linears[name] = NVFP4Linear(name, q.weight_packed, q.weight_scale, q.weight_scale_2, input_scale)
        else:
            q = ref.fp8_quantize(w, layer_format)
            linears[name] = FP8Linear(name, q.weight, q.weight_scale, layer_format, input_scale)
    rng = np.random.default_rng(SEED)
    n_q = layers[0][2]
    tensors = {
        "model.embed_tokens.weight": StoredTensor(
            rng.standard_normal((10, 64)).astype(ml_dtypes.bfloat16).view(np.uint16), "BF16"),
        f"{Q}.bias": rng.standard_normal(n_q).astype(np.float32),
        "model.norm.weight": rng.standard_normal(64).astype(np.float16),
        "model.position_ids": np.arange(8, dtype=np.int64),
    }
    return Checkpoint(fmt, algo, linears, tensors, {"architectures": ["TinyForTest"], "hidden_size": 64})


def write(tmp_path, kind: str, *, sharded: bool = False, name: str = "ckpt") -> str:
    folder = str(tmp_path / f"{name}-{kind}")
    ref.save_checkpoint(folder, build(kind), max_shard_bytes=SHARDED_BYTES if sharded else None)
    return folder


def run(argv, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def file_hashes(folder) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(folder))}


def same_bytes(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def packed_pair(tmp_path_factory, kind):
    """(original folder, packed folder) of one kind, written once per module."""
    tmp = tmp_path_factory.mktemp(kind)
    original = write(tmp, kind)
    out = str(tmp / "packed")
    assert cli.main(["pack", original, out, "-q"]) == 0
    return original, out


# ----------------------------------------------------------------------------------------------
# pack


def test_pack_writes_the_documented_format(packed_pair, kind):
    original, out = packed_pair
    source = ref.load_checkpoint(original)
    manifest = packed.load_packed(out).manifest
    assert manifest["format"] == "qpn-packed" and manifest["version"] == packed.PACKED_VERSION
    assert manifest["source"]["format"] == source.format and manifest["source"]["quant_algo"] == source.quant_algo
    assert manifest["source"]["files"] == file_hashes(original)  # config.json + model.safetensors
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "qpn_manifest.json"]
    assert file_hashes(out)["config.json"] == file_hashes(original)["config.json"]  # copied byte for byte

    stored = ref.read_safetensors(os.path.join(out, "model.safetensors")).tensors
    for name, linear in source.linears.items():
        entry = manifest["layers"][name]
        assert (entry["n"], entry["k"], entry["n_padded"]) == (linear.n, linear.k, packed.padded_rows(linear))
        buffers = packed.prepack_layer(linear)
        for suffix, array in buffers.items():
            assert same_bytes(stored[f"{name}.{suffix}"].array, array), suffix
        if isinstance(linear, NVFP4Linear):
            assert entry["layout"] == "QPN2" and np.float32(entry["global_scale"][0]) == linear.global_scale
            assert stored[f"{name}.qpn_codes"].shape == (entry["n_padded"], linear.k // 2)
            assert stored[f"{name}.qpn_global_scale"].shape == (entry["n_padded"] // 32,)
        else:
            assert entry["layout"] == "QPN8" and entry["granularity"] == linear.granularity
            assert stored[f"{name}.qpn_group_scales"].dtype == "F16"
        for role, tensor in packed.source_tensors(linear).items():
            assert entry["source_tensors"][role]["sha256"] == hashlib.sha256(tensor.array.tobytes()).hexdigest()
        assert (f"{name}.qpn_input_scale" in stored) == (linear.input_scale is not None)
    for name, tensor in source.tensors.items():  # copied through: same bytes, same dtype tag
        assert stored[name].dtype == tensor.dtype and same_bytes(stored[name].array, tensor.array)
    assert set(stored) == set(source.tensors) | {f"{n}.{s}" for n in source.linears
                                                 for s in packed.prepack_layer(source.linears[n])}


def test_unpacking_a_packed_folder_gives_back_the_checkpoint(packed_pair, tmp_path):
    original, out = packed_pair
    source = ref.load_checkpoint(original)
    round_trip = packed.load_packed(out).to_checkpoint()
    for name, linear in source.linears.items():
        back = round_trip.linears[name]
        assert type(back) is type(linear)
        for role, tensor in packed.source_tensors(linear).items():
            assert same_bytes(packed.source_tensors(back)[role].array, tensor.array), (name, role)
        assert same_bytes(np.asarray(back.input_scale), np.asarray(linear.input_scale))
    ref.save_checkpoint(tmp_path / "again", round_trip)  # passes the full load-side validation
    assert file_hashes(tmp_path / "again")["model.safetensors"] == file_hashes(original)["model.safetensors"]


def test_pack_is_deterministic(tmp_path, capsys):
    original = write(tmp_path, "mixed")
    first, second = tmp_path / "first", tmp_path / "second"
    assert run(["pack", original, first], capsys)[0] == 0
    assert run(["pack", original, second], capsys)[0] == 0
    assert file_hashes(first) == file_hashes(second)
    before = file_hashes(first)
    assert run(["pack", original, first, "--overwrite"], capsys)[0] == 0
    assert file_hashes(first) == before


def test_pack_keeps_the_source_sharding(tmp_path, capsys):
    original = write(tmp_path, "nvfp4", sharded=True)
    shards = sorted(f for f in os.listdir(original) if f.endswith(".safetensors"))
    assert len(shards) > 1
    out = tmp_path / "packed"
    assert run(["pack", original, out], capsys)[0] == 0
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
    assert "model.safetensors.index.json" in os.listdir(out)
    code, text, _ = run(["verify", out], capsys)
    assert code == 0, text


def test_a_layer_that_cannot_be_packed_stops_pack_before_anything_is_written(tmp_path, capsys):
    bad = ref.nvfp4_quantize(float_weight("odd", 32, 80))  # K = 80: a valid NVFP4 checkpoint, but QPN2 needs K % 64
    linear = NVFP4Linear("model.odd_proj", bad.weight_packed, bad.weight_scale, bad.weight_scale_2)
    good = build("nvfp4").linears
    folder = tmp_path / "ckpt"
    ref.save_checkpoint(folder, Checkpoint("modelopt", "NVFP4", {**good, linear.name: linear}, {}, {}))
    out = tmp_path / "out"
    code, text, err = run(["pack", folder, out], capsys)
    assert code == 2 and "model.odd_proj" in err and "K=80 is not a multiple of 64" in err and "Traceback" not in err
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary folder left either
    code, text, _ = run(["inspect", folder], capsys)
    assert code == 0 and "cannot pack: K=80" in text
    code, text, _ = run(["verify", folder], capsys)
    assert code == 1 and "FAIL model.odd_proj" in text


def test_a_failed_write_leaves_no_partial_folder_and_keeps_the_old_one(tmp_path, capsys, monkeypatch):
    original = write(tmp_path, "nvfp4", sharded=True)
    out = tmp_path / "out"
    assert run(["pack", original, out], capsys)[0] == 0
    before = file_hashes(out)
    calls = []

    def fail_on_second_file(path, tensors, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (simulated)")
        return real_write(path, tensors, metadata)

    real_write = safetensors_io.write_safetensors
    monkeypatch.setattr(safetensors_io, "write_safetensors", fail_on_second_file)  # the writer qpn pack calls
    code, _, err = run(["pack", original, out, "--overwrite"], capsys)
    assert code == 2 and "No space left" in err and "Traceback" not in err
    assert file_hashes(out) == before
    calls.clear()
    code, _, _ = run(["pack", original, tmp_path / "fresh"], capsys)
    assert code == 2 and not (tmp_path / "fresh").exists()
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(original), "out"])


def test_pack_refuses_a_non_empty_folder_and_an_already_packed_source(packed_pair, tmp_path, capsys):
    original, out = packed_pair
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    code, _, err = run(["pack", original, tmp_path / "full"], capsys)
    assert code == 2 and "--overwrite" in err and (tmp_path / "full" / "notes.txt").read_text() == "keep me"
    code, _, err = run(["pack", out, tmp_path / "again"], capsys)
    assert code == 2 and "already a qpn packed checkpoint" in err


# ----------------------------------------------------------------------------------------------
# verify and inspect


@pytest.mark.parametrize("which", ["original", "packed"])
def test_verify_passes_on_original_and_packed_folders(packed_pair, kind, which, capsys):
    folder = packed_pair[0] if which == "original" else packed_pair[1]
    code, text, _ = run(["verify", folder, "--upstream", "-q"], capsys)
    assert code == 0, text
    assert "numba CPU (torch.ops.qpn on cpu): present" in text and "CUDA" in text
    for _, _, n, k in KINDS[kind][2]:
        assert any(f" {n}" in line and f" {k}" in line for line in text.splitlines())
    rows = [line for line in text.splitlines() if line.startswith(("model.layers",))]
    assert len(rows) == len(KINDS[kind][2]) and all(" FAIL" not in row for row in rows)
    assert f"{len(rows)} of {len(rows)} layers ok" in text


def flip_one_byte(folder: str, tensor: str, xor: int = 0x10, index: int = 0) -> None:
    """XOR one byte of `tensor` in the packed folder's model.safetensors (in place)."""
    path = os.path.join(folder, "model.safetensors")
    header = ref.read_safetensors_header(path)
    begin = header.data_start + header.tensors[tensor].data_offsets[0] + index
    with open(path, "r+b") as f:
        f.seek(begin)
        byte = f.read(1)[0]
        f.seek(begin)
        f.write(bytes([byte ^ xor]))


CORRUPTIONS = [  # (kind, tensor suffix or copied tensor, byte index, what verify names)
    ("nvfp4", f"{DOWN}.qpn_codes", 100, DOWN),
    ("nvfp4", f"{DOWN}.qpn_scales", 3, DOWN),
    ("nvfp4", f"{Q}.qpn_global_scale", 1, Q),  # tile 0 of the padded layer
    ("nvfp4", f"{Q}.qpn_codes", 48 * 32 + 5, Q),  # a pad row
    ("nvfp4", f"{Q}.qpn_input_scale", 0, Q),
    ("fp8-channel", f"{Q}.qpn_codes", 7, Q),
    ("fp8-channel", f"{Q}.qpn_group_scales", 0, Q),
    ("fp8-block", f"{DOWN}.qpn_weight_scale", 2, DOWN),
    ("nvfp4", "model.norm.weight", 0, "model.norm.weight"),
]


@pytest.mark.parametrize("kind_, tensor, index, named", CORRUPTIONS)
def test_verify_finds_one_corrupt_byte_and_names_the_layer(tmp_path, capsys, kind_, tensor, index, named):
    original = write(tmp_path, kind_)
    out = str(tmp_path / "packed")
    assert run(["pack", original, out, "-q"], capsys)[0] == 0
    flip_one_byte(out, tensor, index=index)
    code, text, err = run(["verify", out, "-q"], capsys)
    assert code == 1, text + err
    assert any(line.startswith("FAIL") and named in line for line in text.splitlines()), text
    assert "Traceback" not in text + err


CONFIG_EDITS = [  # (what is done to the packed folder's config files, the line verify prints)
    ("delete config.json", "FAIL config.json is missing"),
    ("edit config.json", "FAIL config.json is not the source's (sha256 differs from the manifest)"),
    ("add hf_quant_config.json", "FAIL hf_quant_config.json is not the source's: the source had none"),
]


@pytest.mark.parametrize("edit, line", CONFIG_EDITS)
def test_verify_says_how_a_copied_config_file_differs(tmp_path, capsys, edit, line):
    original = write(tmp_path, "fp8-tensor")  # config.json's quantization_config, no hf_quant_config.json
    out = tmp_path / "packed"
    assert run(["pack", original, out, "-q"], capsys)[0] == 0
    action, file = edit.split()
    if action == "delete":
        (out / file).unlink()
    else:
        (out / file).write_text('{"edited": true}')
    code, text, err = run(["verify", out, "-q"], capsys)
    assert code == 1 and any(row.startswith(line) for row in text.splitlines()) and "Traceback" not in text + err, \
        text + err


def test_verify_ref_rederives_the_nvfp4_values_it_looks_up(tmp_path, capsys, monkeypatch):
    """The NVFP4 ref column recomputes in float64 every (scale byte, code) value the decode looked up,
    so a reference whose arithmetic is off by one fp16 ulp fails there. (It used to compare
    qpn2_dequantize with nvfp4_dequantize: the same function on the same bytes, which cannot fail.)"""
    original = write(tmp_path, "nvfp4")
    exact = ref.nvfp4.nvfp4_value_table

    def one_ulp_off(g, dtype=np.float16):
        table = exact(g, dtype).copy()
        table.view(np.uint16)[:, 1] += 1  # code 1 (+0.5 * scale) one fp16 ulp up, for every scale byte
        return table

    monkeypatch.setattr(ref.nvfp4, "nvfp4_value_table", one_ulp_off)
    monkeypatch.setattr(ref, "nvfp4_value_table", one_ulp_off)
    for folder in (original, tmp_path / "packed"):
        if folder != original:
            assert run(["pack", original, folder, "-q"], capsys)[0] == 0
        code, text, err = run(["verify", folder, "-q"], capsys)
        assert code == 1, text + err
        ref_failures = [line for line in text.splitlines() if line.startswith("FAIL") and ": ref: " in line]
        assert len(ref_failures) == len(KINDS["nvfp4"][2]) and "evaluated in float64" in ref_failures[0], text


@pytest.mark.parametrize("kind_", ["fp8-channel", "fp8-block"])
def test_verify_permutes_qpn8_bytes_once_each_way(tmp_path, capsys, monkeypatch, kind_):
    """A packed FP8 layer's bytes are permuted once to unpack them and once to re-prepack them; the
    "ref" decode reuses the unpacked bytes (it used to run qpn8_unpack a second time, 12 % of verify)."""
    original = write(tmp_path, kind_)
    folder = tmp_path / "packed"
    assert run(["pack", original, folder, "-q"], capsys)[0] == 0
    calls = []
    for name in ("_korder_shuffle", "_korder_unshuffle"):
        real = getattr(ref.qpn8, name)
        monkeypatch.setattr(ref.qpn8, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    code, text, err = run(["verify", folder, "-q"], capsys)
    assert code == 0, text + err
    layers = len(KINDS[kind_][2])
    assert sorted(calls) == ["_korder_shuffle"] * layers + ["_korder_unshuffle"] * layers


def test_worst_ulp_distance_compares_bits_first_and_is_exact(monkeypatch):
    """verify._worst_ulp_distance against the distance on the ordered line, computed in int64, on the
    cases where bit differences and ulps part ways (signs, zeros, subnormals, the largest values);
    the common case (every pair within 1 ulp and of one sign) never builds the ordered line."""
    def slow(a, b):
        def ordered(v):
            bits = v.view(np.uint16).astype(np.int64)
            return np.where(bits >= 0x8000, -(bits - 0x8000), bits)
        return int(np.abs(ordered(a) - ordered(b)).max())

    bits = [0x0000, 0x8000, 0x0001, 0x8001, 0x0002, 0x03FF, 0x0400, 0x3C00, 0x3C01, 0x3BFF, 0x7BFF, 0x7BFE,
            0xFBFF, 0xFBFE, 0xBC00, 0xBC01, 0x8002]
    values = np.array(bits, np.uint16).view(np.float16)
    for a in values:
        for b in values:
            pair = (np.array([a, np.float16(1)]), np.array([b, np.float16(1)]))
            assert verify._worst_ulp_distance(*pair) == slow(*pair), (a, b)
    rng = np.random.default_rng(SEED)
    a = rng.standard_normal(1000).astype(np.float16)
    b = a.copy()
    b.view(np.uint16)[::7] += 1  # one ulp away from zero, same sign
    b.view(np.uint16)[3::7] -= 1
    assert verify._worst_ulp_distance(a, a) == 0 and verify._worst_ulp_distance(a, b) == 1 == slow(a, b)
    assert verify._worst_ulp_distance(a[:0], b[:0]) == 0

    def no_ordered_line(_):
        raise AssertionError("the ordered line was built for pairs within 1 ulp")

    monkeypatch.setattr(verify, "_ordered16", no_ordered_line)
    assert verify._worst_ulp_distance(a, b) == 1


def test_inspect_tables_for_original_and_packed(packed_pair, kind, capsys):
    original, out = packed_pair
    for folder, status in ((original, "ok (QPN"), (out, "packed QPN")):
        code, text, _ = run(["inspect", folder], capsys)
        assert code == 0
        rows = [line for line in text.splitlines() if line.startswith("model.layers")]
        assert len(rows) == len(KINDS[kind][2]) and all(status in row for row in rows)
        for (name, layer_format, n, k), row in zip(sorted(KINDS[kind][2]), rows, strict=True):
            assert row.split()[:4] == [name, "NVFP4" if layer_format == "nvfp4" else f"FP8/{layer_format}", str(n),
                                       str(k)]
            assert ("N padded to" in row) == (n % 32 != 0 or (layer_format == "block" and n % 128 != 0))


# ----------------------------------------------------------------------------------------------
# loading a packed folder into a model


def tiny_model(kind: str) -> nn.Module:
    model = nn.Module()
    for name, _, n, k in KINDS[kind][2]:
        parent = model
        *path, attr = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(attr, nn.Linear(k, n, bias=(name == Q)))
    model.model.norm = nn.Module()
    model.model.norm.register_buffer("weight", torch.zeros(64, dtype=torch.float16))
    return model


def test_load_quantized_reads_a_packed_folder_as_the_original(packed_pair, kind):
    original, out = packed_pair
    from_original, from_packed = tiny_model(kind), tiny_model(kind)
    report_original = load_quantized(from_original, original)
    report_packed = load_quantized(from_packed, out)
    assert report_packed == report_original and len(report_packed.quantized) == len(KINDS[kind][2])
    for name, _, _, k in KINDS[kind][2]:
        a, b = from_original.get_submodule(name), from_packed.get_submodule(name)
        assert isinstance(b, QPNLinear)
        assert torch.equal(a.codes, b.codes)  # pad rows included: pack pads as QPNLinear does
        assert torch.equal(a.dequantized_weight().view(torch.int16), b.dequantized_weight().view(torch.int16))
        assert a.state_dict().keys() == b.state_dict().keys()  # a single 128x128 block too: block layout both ways
        for key, value in a.state_dict().items():
            assert torch.equal(value, b.state_dict()[key]), key
        x = torch.randn(3, k, dtype=torch.float16, generator=torch.Generator().manual_seed(1))
        assert torch.equal(a(x), b(x))
    assert torch.equal(from_packed.model.norm.weight, from_original.model.norm.weight)


# ----------------------------------------------------------------------------------------------
# bad input, progress bars, the entry point


BAD_INPUTS = [  # (argv with {tmp} for the temporary folder, text expected on stderr)
    (["verify", "{tmp}/missing"], "does not exist"),
    (["inspect", "{tmp}/file.txt"], "is not a folder"),
    (["inspect", "{tmp}/empty"], "this is not a quantized checkpoint"),
    (["inspect", "{tmp}/no-weights"], "holds neither model.safetensors"),
    (["verify", "{tmp}/garbage"], "garbage/model.safetensors: file is"),
    (["pack", "{tmp}/missing", "{tmp}/out"], "does not exist"),  # the same words as verify / inspect
    (["pack", "{tmp}/file.txt", "{tmp}/out"], "is not a folder"),
    (["verify", "{tmp}/empty", "--m", "0"], "every M must be an integer in [1, 4096]"),
    (["frobnicate"], "invalid choice"),
    (["pack", "{tmp}/empty"], "the following arguments are required: OUT_DIR"),
    ([], "the following arguments are required: COMMAND"),
]


@pytest.fixture
def bad_folders(tmp_path):
    (tmp_path / "file.txt").write_text("not a checkpoint")
    (tmp_path / "empty").mkdir()
    config = '{"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}'
    for folder in ("garbage", "no-weights"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(config)
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\x00" * 5)
    return tmp_path


@pytest.mark.parametrize("argv, message", BAD_INPUTS)
def test_bad_input_exits_2_with_a_message(bad_folders, capsys, argv, message):
    code, out, err = run([a.format(tmp=bad_folders) for a in argv], capsys)
    assert code == 2 and message in err and "Traceback" not in out + err, err


def test_python_m_qpn_is_the_cli_and_never_prints_a_traceback(tmp_path):
    def qpn(*args):
        return run_child([sys.executable, "-m", "qpn", *args], capture_output=True, text=True,
                              cwd=tmp_path)

    result = qpn("--help")
    assert result.returncode == 0
    for command in ("pack", "verify", "inspect", "bench", "demo"):
        assert command in result.stdout
    result = qpn("inspect", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_progress_bars_only_on_a_terminal_and_without_quiet(capsys, tmp_path):
    items = [1, 2, 3]
    assert output.progress_bars(False)(items, desc="x") is items
    assert list(output.progress_bars(True)(items, desc="pack", total=3)) == items  # a tqdm bar
    assert "pack:   0%" in capsys.readouterr().err  # (leave=False: the finished bar is erased)
    original = write(tmp_path, "nvfp4")
    code, _, err = run(["pack", original, tmp_path / "out"], capsys)  # stderr is captured: not a TTY
    assert code == 0 and err == ""


@pytest.mark.skipif(verify.cuda_status(need_torch=False)[0], reason="a CUDA GPU is present: bench would run")
def test_bench_without_a_gpu_says_so_and_exits_3(capsys):
    code, out, err = run(["bench", "--quick"], capsys)
    assert code == 3 and "needs a CUDA GPU" in err and "Nothing was measured" in err


@pytest.mark.skipif(verify.cuda_status(need_torch=True)[0], reason="a CUDA GPU is present")
def test_demo_on_cuda_without_a_gpu_says_so_and_exits_3(capsys):
    code, out, err = run(["demo", "--device", "cuda"], capsys)
    assert code == 3 and "--device cuda" in err


def test_verify_bound_from_torch_sums_is_refs_bound():
    """verify's bound: ref's formula (linear_bounds_of_fp32_sums) over fp32 sums from torch's matmul.
    It must admit the exact result and every fp32 accumulation (here: torch's, numpy's, a sequential
    fp32 loop in reverse order), fall back to ref.linear_bounds_fp32 when torch's fp32 matmul may use
    bf16 ("high"), and refuse non-finite weights as ref does."""
    rng = np.random.default_rng(11)
    w16 = (rng.standard_normal((96, 256)) * 0.05).astype(np.float16)
    x16 = rng.standard_normal((41, 256)).astype(np.float16)
    lo, hi = verify._linear_bounds(x16, w16)
    reverse = np.zeros((41, 96), np.float32)
    for k in reversed(range(256)):
        reverse += x16[:, k:k + 1].astype(np.float32) * w16[:, k].astype(np.float32)
    for y in (ref.linear(x16, w16), reverse.astype(np.float16),
              (torch.from_numpy(x16).float() @ torch.from_numpy(w16).float().T).half().numpy(),
              (x16.astype(np.float32) @ w16.astype(np.float32).T).astype(np.float16)):
        assert np.all((lo <= y) & (y <= hi))
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        for a, b in zip(verify._linear_bounds(x16, w16), ref.linear_bounds_fp32(x16, w16), strict=True):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    finally:
        torch.set_float32_matmul_precision(previous)
    w16[7, 3] = np.inf
    with pytest.raises(ValueError, match="w16"):
        verify._linear_bounds(x16, w16)
