"""Checkpoint I/O: the strict safetensors reader/writer and the ModelOpt / compressed-tensors loader.

The `safetensors` package (numpy and torch front ends) is the independent oracle for the file
format; `nvfp4_quantize` / `fp8_quantize` make the synthetic models. Everything is compared as
bytes: no tolerance appears in this file.
"""

from __future__ import annotations

import json
import os
import zlib

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qpn.checkpoints import folder as checkpoint_module
from qpn.checkpoints import safetensors_io
from qpn.ref import (
    Checkpoint,
    CheckpointError,
    FP8Linear,
    NVFP4Linear,
    SafetensorsError,
    StoredTensor,
    decode_e4m3,
    fp8_dequantize,
    fp8_quantize,
    fuse_fp8_shards,
    fuse_nvfp4_shards,
    load_checkpoint,
    nvfp4_dequantize,
    nvfp4_quantize,
    read_safetensors,
    read_safetensors_header,
    save_checkpoint,
    write_safetensors,
)

SEED = 20240611
ONE = np.float32(1)


def f32_bits(x) -> str:
    return f"0x{int(np.asarray(x, np.float32).reshape(()).view(np.uint32)):08X}"


def assert_same_bytes(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def folder_bytes(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


# ==============================================================================================
# safetensors_io
# ==============================================================================================

# numpy dtype -> the tag safetensors writes for it
NUMPY_CASES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 4), (2, 3, 4)]
# torch dtype -> (tag, torch dtype to view the bits as, numpy carrier)
TORCH_CASES = {
    "BF16": (torch.bfloat16, torch.int16, np.uint16),
    "F8_E4M3": (torch.float8_e4m3fn, torch.uint8, np.uint8),
    "F8_E5M2": (torch.float8_e5m2, torch.uint8, np.uint8),
    "F16": (torch.float16, torch.int16, np.float16),
    "F32": (torch.float32, torch.int32, np.float32),
}


def numpy_tensor(dtype, shape, rng) -> np.ndarray:
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def torch_bits(t: torch.Tensor, view_dtype, carrier) -> np.ndarray:
    return t.contiguous().view(view_dtype).numpy().view(carrier)


@pytest.mark.parametrize("tag", NUMPY_CASES)
def test_reads_files_written_by_safetensors_numpy(tmp_path, tag):
    rng = np.random.default_rng(SEED)
    arrays = {f"t{i}": numpy_tensor(NUMPY_CASES[tag], shape, rng) for i, shape in enumerate(SHAPES)}
    path = tmp_path / "np.safetensors"
    safetensors.numpy.save_file(arrays, path, metadata={"origin": "numpy"})
    for mmap in (True, False):
        contents = read_safetensors(path, mmap=mmap)
        assert contents.metadata == {"origin": "numpy"}
        assert set(contents.tensors) == set(arrays)
        for name, array in arrays.items():
            assert contents.tensors[name].dtype == tag
            assert_same_bytes(contents.tensors[name].array, array)


@pytest.mark.parametrize("tag", TORCH_CASES)
def test_reads_and_writes_torch_dtypes_like_safetensors_torch(tmp_path, tag):
    torch_dtype, view_dtype, carrier = TORCH_CASES[tag]
    generator = torch.Generator().manual_seed(SEED)
    tensors = {
        f"t{i}": (torch.randn(shape, generator=generator) * 40).to(torch_dtype) for i, shape in enumerate(SHAPES)
    }
    theirs = tmp_path / "torch.safetensors"
    safetensors.torch.save_file(tensors, theirs)
    contents = read_safetensors(theirs)
    for name, tensor in tensors.items():
        assert contents.tensors[name].dtype == tag
        assert_same_bytes(contents.tensors[name].array, torch_bits(tensor, view_dtype, carrier))
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, contents.tensors, {"format": "pt"})
    loaded = safetensors.torch.load_file(ours)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == torch_dtype and loaded[name].shape == tensor.shape
        assert_same_bytes(torch_bits(loaded[name], view_dtype, carrier), torch_bits(tensor, view_dtype, carrier))
    with safetensors.safe_open(ours, "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_written_files_load_in_safetensors_numpy_and_are_deterministic(tmp_path):
    rng = np.random.default_rng(SEED)
    tensors = {f"{tag.lower()}.{i}": numpy_tensor(dtype, shape, rng)
               for tag, dtype in NUMPY_CASES.items() for i, shape in enumerate(SHAPES)}
    write_safetensors(tmp_path / "a.safetensors", tensors)
    loaded = safetensors.numpy.load_file(tmp_path / "a.safetensors")
    for name, array in tensors.items():
        assert_same_bytes(loaded[name], array)
    # read -> write reproduces the bytes; the tensor order and header are functions of the content
    write_safetensors(tmp_path / "b.safetensors", read_safetensors(tmp_path / "a.safetensors").tensors)
    write_safetensors(tmp_path / "c.safetensors", dict(reversed(list(tensors.items()))))
    raw = (tmp_path / "a.safetensors").read_bytes()
    assert raw == (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "c.safetensors").read_bytes()
    header = read_safetensors_header(tmp_path / "a.safetensors")
    assert header.data_start % 8 == 0  # header padded with spaces to a multiple of 8
    assert raw[8:header.data_start].rstrip(b" ").endswith(b"}")
    for info in header.tensors.values():  # every tensor aligned to its item size
        assert info.data_offsets[0] % safetensors_io.DTYPE_OF_TAG[info.dtype].itemsize == 0


@settings(max_examples=25, deadline=None)
@given(
    tags=st.lists(st.sampled_from(sorted(safetensors_io.DTYPE_OF_TAG)), min_size=1, max_size=6),
    data=st.data(),
)
def test_any_tagged_tensors_round_trip_through_the_package(tmp_path_factory, tags, data):
    rng = np.random.default_rng(SEED)
    tensors = {}
    for i, tag in enumerate(tags):
        shape = tuple(data.draw(st.lists(st.integers(0, 5), max_size=3)))
        carrier = safetensors_io.DTYPE_OF_TAG[tag]
        bits = rng.integers(0, 256, int(np.prod(shape)) * carrier.itemsize, dtype=np.uint8)
        array = (bits > 127) if tag == "BOOL" else bits.view(carrier)
        tensors[f"x{i}"] = StoredTensor(array.reshape(shape), tag)
    path = tmp_path_factory.mktemp("hyp") / "h.safetensors"
    write_safetensors(path, tensors)
    with safetensors.safe_open(path, "pt") as f:  # the package accepts every file we write
        assert sorted(f.keys()) == sorted(tensors)
    back = read_safetensors(path).tensors
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype
        assert_same_bytes(back[name].array, tensor.array)


def test_read_returns_read_only_views_of_one_memory_map(tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int64)})
    mapped = read_safetensors(path).tensors
    for tensor in mapped.values():
        base = tensor.array
        while not isinstance(base, np.memmap) and base.base is not None:
            base = base.base
        assert isinstance(base, np.memmap)  # zero copy: the file's pages back the array
        assert not tensor.array.flags.writeable
    copied = read_safetensors(path, mmap=False).tensors
    assert not copied["a"].array.flags.writeable
    assert_same_bytes(mapped["a"].array, copied["a"].array)


def test_writer_tags_ml_dtypes_arrays_and_refuses_casts(tmp_path):
    values = np.array([1.0, -2.5, 3.140625], dtype=np.float32)
    path = tmp_path / "ml.safetensors"
    write_safetensors(path, {"bf": values.astype(ml_dtypes.bfloat16), "e4": values.astype(ml_dtypes.float8_e4m3fn)})
    back = read_safetensors(path).tensors
    assert back["bf"].dtype == "BF16" and back["e4"].dtype == "F8_E4M3"
    assert_same_bytes(back["bf"].array, values.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert_same_bytes(back["e4"].array, values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    with pytest.raises(ValueError, match="BF16 tensor must be carried as numpy uint16"):
        StoredTensor(values, "BF16")
    with pytest.raises(ValueError, match="safetensors tag"):
        StoredTensor(values, "FP32")
    with pytest.raises(SafetensorsError, match=r"'c'.*complex64"):
        write_safetensors(tmp_path / "bad.safetensors", {"c": np.zeros(2, np.complex64)})
    assert sorted(os.listdir(tmp_path)) == ["ml.safetensors"]


# --- corrupt files: each error names the file and, where one is at fault, the tensor ----------

def raw_file(header: dict, buffer: bytes, *, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + buffer


GOOD_HEADER = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
               "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}


def with_entry(name, **changes):
    header = json.loads(json.dumps(GOOD_HEADER))
    header[name].update(changes)
    return header


CORRUPT_FILES = {
    # case: (file bytes, tensor named in the error or None, message fragment)
    "shorter than 8 bytes": (b"\x10\x00\x00", None, "shorter than the 8-byte header length"),
    "header beyond EOF": (raw_file(GOOD_HEADER, bytes(12), length=10_000), None, "beyond the end of the"),
    "header not JSON": (raw_file(GOOD_HEADER, bytes(12)).replace(b'{"a"', b'["a"'), None, "not valid UTF-8 JSON"),
    "header not an object": (raw_file([1, 2], b""), None, "must be a JSON object"),
    "duplicate key": (b"", "a", "holds this key twice"),  # built below
    "unknown dtype": (raw_file(with_entry("b", dtype="U4"), bytes(12)), "b", "unknown dtype 'U4'"),
    "negative shape": (raw_file(with_entry("a", shape=[-2]), bytes(12)), "a", "non-negative integers"),
    "offsets out of order": (raw_file(with_entry("b", data_offsets=[12, 8]), bytes(12)), "b", "out of order"),
    "size mismatch": (raw_file(with_entry("b", shape=[5]), bytes(12)), "b", "need 5"),
    "data beyond EOF": (raw_file(GOOD_HEADER, bytes(11)), "b", "truncated"),
    "overlap": (raw_file(with_entry("b", data_offsets=[4, 8], shape=[4]), bytes(8)), "b", "overlap tensor 'a'"),
    "gap": (raw_file(with_entry("b", data_offsets=[9, 13]), bytes(13)), "b", "gap of 1 bytes"),
    "trailing bytes": (raw_file(GOOD_HEADER, bytes(16)), None, "trailing bytes"),
    "bad metadata": (raw_file(dict(GOOD_HEADER, __metadata__={"k": 1}), bytes(12)), "__metadata__", "strings"),
    "bool byte 2": (raw_file({"m": {"dtype": "BOOL", "shape": [2], "data_offsets": [0, 2]}}, b"\x01\x02"), "m",
                    "0 or 1"),
}
_dup = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
CORRUPT_FILES["duplicate key"] = (len(_dup).to_bytes(8, "little") + _dup + b"\x00", "a", "twice")


@pytest.mark.parametrize("case", CORRUPT_FILES)
def test_corrupt_files_raise_errors_naming_file_and_tensor(tmp_path, case):
    data, tensor, fragment = CORRUPT_FILES[case]
    path = tmp_path / "corrupt.safetensors"
    path.write_bytes(data)
    with pytest.raises(SafetensorsError, match=fragment) as info:
        read_safetensors(path)
    assert info.value.path == str(path) and str(path) in str(info.value)
    assert info.value.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(info.value)


def test_truncating_a_real_file_names_the_last_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"small": np.zeros(3, np.uint8), "big": np.ones((4, 4), np.float32)})
    last = max(read_safetensors_header(path).tensors.items(), key=lambda item: item[1].data_offsets[1])[0]
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(SafetensorsError, match="truncated") as info:
        read_safetensors(path)
    assert info.value.tensor == last


def test_write_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"old": np.arange(4, dtype=np.int32)})
    before = path.read_bytes()
    calls = []

    def fail_on_second_tensor(f, tensor):
        calls.append(tensor)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        f.write(memoryview(np.ascontiguousarray(tensor.array).reshape(-1).view(np.uint8)))

    monkeypatch.setattr(safetensors_io, "_write_tensor_bytes", fail_on_second_tensor)
    tensors = {"a": np.zeros(100, np.float32), "b": np.ones(7, np.uint8), "c": np.ones(3, np.int64)}
    with pytest.raises(OSError, match="injected"):
        write_safetensors(path, tensors)
    calls.clear()
    with pytest.raises(OSError, match="injected"):
        write_safetensors(tmp_path / "new.safetensors", tensors)
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]  # no temp file, no partial file
    assert path.read_bytes() == before


@pytest.mark.slow
def test_a_128_mb_file_is_mapped_not_read(tmp_path):
    """Reading is the header plus a memory map: the tensor is a read-only view of the file's mapping, never
    a copy (the property that made it fast; a wall-time limit would fail on a loaded machine)."""
    path = tmp_path / "big.safetensors"
    big = np.arange(32 * 2**20, dtype=np.float32).reshape(2**12, -1)  # 128 MiB
    write_safetensors(path, {"big": big, "tail": np.ones(3, np.uint8)})
    array = read_safetensors(path).tensors["big"].array
    assert isinstance(array, np.memmap) and not array.flags.owndata and not array.flags.writeable
    assert_same_bytes(array, big)


# ==============================================================================================
# checkpoint: synthetic models
# ==============================================================================================

ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
# (name, N, K, amax): different shapes (ragged 128-blocks in up/down), different global scales
LINEARS = [
    (f"{ATTN}.q_proj", 64, 128, 2.0),
    (f"{ATTN}.k_proj", 32, 128, 0.3125),
    (f"{ATTN}.v_proj", 32, 128, 5.5),
    (f"{ATTN}.o_proj", 128, 64, 1.0),
    (f"{MLP}.gate_proj", 96, 128, 3.0),
    (f"{MLP}.up_proj", 160, 272, 0.75),
    (f"{MLP}.down_proj", 128, 160, 4.25),
]
INPUT_SCALE = np.float32(0.0123)


def float_weight(name: str, n: int, k: int, amax: float) -> np.ndarray:
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode()), n, k])
    w = rng.uniform(-1, 1, (n, k)).astype(np.float32)
    w.flat[0] = 1.0  # amax(|w|) is exactly `amax`
    return w * np.float32(amax)


def nvfp4_linear(name, n, k, amax, *, input_scale=True) -> NVFP4Linear:
    q = nvfp4_quantize(float_weight(name, n, k, amax))
    return NVFP4Linear(name, q.weight_packed, q.weight_scale, q.weight_scale_2,
                       INPUT_SCALE if input_scale else None)


def fp8_linear(name, n, k, amax, granularity, scale_name="weight_scale") -> FP8Linear:
    q = fp8_quantize(float_weight(name, n, k, amax), granularity)
    return FP8Linear(name, q.weight, q.weight_scale, granularity, INPUT_SCALE, scale_name)


def bf16(x: np.ndarray) -> StoredTensor:
    return StoredTensor(x.astype(ml_dtypes.bfloat16).view(np.uint16), "BF16")


def other_tensors(unquantized: list[tuple[str, int, int]]) -> dict:
    rng = np.random.default_rng(SEED)
    tensors = {
        "model.embed_tokens.weight": bf16(rng.standard_normal((50, 128)).astype(np.float32)),
        "lm_head.weight": rng.standard_normal((50, 128)).astype(np.float16),
        f"{ATTN}.q_proj.bias": rng.standard_normal(64).astype(np.float32),
        f"{MLP}.down_proj.bias": bf16(rng.standard_normal(128).astype(np.float32)),
        "model.norm.weight": rng.standard_normal(128).astype(np.float32),
        f"{ATTN}.k_proj.k_scale": np.asarray(0.5, np.float32),
        "model.position_ids": np.arange(8, dtype=np.int64)[None],
    }
    for name, n, k in unquantized:
        tensors[f"{name}.weight"] = bf16(rng.standard_normal((n, k)).astype(np.float32))
    return tensors


MIXED_CONFIG = {
    "quant_method": "modelopt",
    "quant_algo": "MIXED_PRECISION",
    "kv_cache_quant_algo": None,
    # a fused name covering q/k/v, and an ancestor prefix covering every mlp projection
    "quantized_layers": {f"{ATTN}.qkv_proj": {"quant_algo": "FP8"},
                         MLP: {"quant_algo": "NVFP4", "group_size": 16}},
    "ignore": ["lm_head"],
}


def build_model(layout: str) -> Checkpoint:
    unquantized = []
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128}
    fmt = "compressed-tensors" if layout.startswith("ct-") else "modelopt"
    linears = {}
    for name, n, k, amax in LINEARS:
        if layout in ("modelopt-nvfp4", "ct-nvfp4"):
            linears[name] = nvfp4_linear(name, n, k, amax)
        elif layout == "modelopt-w4a16":
            linears[name] = nvfp4_linear(name, n, k, amax, input_scale=False)
        elif layout.startswith("modelopt-fp8-"):
            granularity = layout.split("-")[2]
            scale_name = "weight_scale_inv" if layout.endswith("-inv") else "weight_scale"
            linears[name] = fp8_linear(name, n, k, amax, granularity, scale_name)
        elif layout == "modelopt-mixed":
            if name.endswith("o_proj"):
                unquantized.append((name, n, k))
            elif name.startswith(ATTN):
                linears[name] = fp8_linear(name, n, k, amax, "tensor")
            else:
                linears[name] = nvfp4_linear(name, n, k, amax)
    algo = {"modelopt-nvfp4": "NVFP4", "ct-nvfp4": "NVFP4", "modelopt-w4a16": "W4A16_NVFP4",
            "modelopt-fp8-tensor": "FP8", "modelopt-fp8-channel": "FP8_PER_CHANNEL_PER_TOKEN",
            "modelopt-fp8-block": "FP8_PB_WO", "modelopt-fp8-block-inv": "FP8_PB_WO",
            "modelopt-mixed": "MIXED_PRECISION"}[layout]
    if layout == "modelopt-mixed":
        config["quantization_config"] = MIXED_CONFIG
    return Checkpoint(fmt, algo, linears, other_tensors(unquantized), config)


LAYOUTS = ["modelopt-nvfp4", "modelopt-w4a16", "modelopt-fp8-tensor", "modelopt-fp8-channel",
           "modelopt-fp8-block", "modelopt-fp8-block-inv", "modelopt-mixed", "ct-nvfp4"]
SHARDINGS = {"single": None, "one-shard": 1 << 40, "sharded": 24_000}  # one-shard: a limit nothing reaches


def reciprocal_round_trip(x):
    """What a compressed-tensors save + load does to a multiplier: RN32(1 / RN32(1 / x))."""
    return None if x is None else ONE / (ONE / x)


def assert_same_linear(got, want, *, compressed_tensors: bool) -> None:
    assert type(got) is type(want) and got.name == want.name
    if isinstance(want, NVFP4Linear):
        assert_same_bytes(got.weight_packed, want.weight_packed)
        assert_same_bytes(got.weight_scale, want.weight_scale)
        for role in ("global_scale", "input_scale"):
            expected = getattr(want, role)
            if compressed_tensors:
                expected = reciprocal_round_trip(expected)
            if expected is None:
                assert getattr(got, role) is None
            else:
                assert_same_bytes(getattr(got, role), np.asarray(expected, np.float32))
    else:
        assert (got.granularity, got.scale_name) == (want.granularity, want.scale_name)
        assert_same_bytes(got.weight, want.weight)
        assert_same_bytes(got.weight_scale, want.weight_scale)
        assert_same_bytes(got.input_scale, want.input_scale)


def assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert_same_bytes(got[name].array, tensor.array)


@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_every_layout(tmp_path, layout, sharding):
    model = build_model(layout)
    save_checkpoint(tmp_path / "a", model, max_shard_bytes=SHARDINGS[sharding])
    files = os.listdir(tmp_path / "a")
    if sharding == "sharded":
        assert checkpoint_module.INDEX_FILE in files and sum(f.endswith(".safetensors") for f in files) > 2
    else:  # one shard is model.safetensors without an index, as transformers' save_pretrained writes it
        assert sorted(files) == ["config.json", "model.safetensors"]
    loaded = load_checkpoint(tmp_path / "a")
    assert (loaded.format, loaded.quant_algo) == (model.format, model.quant_algo)
    assert list(loaded.linears) == list(model.linears)
    for name, linear in model.linears.items():
        assert_same_linear(loaded.linears[name], linear, compressed_tensors=model.format == "compressed-tensors")
    assert_same_tensors(loaded.tensors, model.tensors)
    assert loaded.config["hidden_size"] == 128
    # saving the loaded checkpoint reproduces every byte of every file
    save_checkpoint(tmp_path / "b", loaded, max_shard_bytes=SHARDINGS[sharding])
    assert folder_bytes(tmp_path / "a") == folder_bytes(tmp_path / "b")


def test_mixed_precision_resolves_each_layer(tmp_path):
    save_checkpoint(tmp_path / "m", build_model("modelopt-mixed"))
    loaded = load_checkpoint(tmp_path / "m")
    kinds = {name: (type(lin).__name__, getattr(lin, "granularity", None)) for name, lin in loaded.linears.items()}
    assert kinds == {
        f"{ATTN}.q_proj": ("FP8Linear", "tensor"),  # through the fused name qkv_proj
        f"{ATTN}.k_proj": ("FP8Linear", "tensor"),
        f"{ATTN}.v_proj": ("FP8Linear", "tensor"),
        f"{MLP}.gate_proj": ("NVFP4Linear", None),  # through the ancestor prefix model.layers.0.mlp
        f"{MLP}.up_proj": ("NVFP4Linear", None),
        f"{MLP}.down_proj": ("NVFP4Linear", None),
    }
    assert loaded.tensors[f"{ATTN}.o_proj.weight"].dtype == "BF16"  # unlisted: unquantized


def test_generated_configs_name_every_layer(tmp_path):
    linears = {name: lin for name, lin in [
        ("a.nv", nvfp4_linear("a.nv", 32, 32, 1.0)),
        ("a.w4a16", nvfp4_linear("a.w4a16", 32, 32, 1.0, input_scale=False)),
        ("a.fp8", fp8_linear("a.fp8", 32, 32, 1.0, "tensor")),
        ("a.ch", fp8_linear("a.ch", 32, 32, 1.0, "channel")),
        ("a.blk", fp8_linear("a.blk", 32, 32, 1.0, "block", "weight_scale_inv")),
    ]}
    tensors = {"a.dense.weight": np.zeros((4, 4), np.float32)}
    save_checkpoint(tmp_path / "m", Checkpoint("modelopt", "MIXED_PRECISION", linears, tensors, {}))
    config = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert config["quantized_layers"] == {
        "a.nv": {"quant_algo": "NVFP4", "group_size": 16},
        "a.w4a16": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
        "a.fp8": {"quant_algo": "FP8"},
        "a.ch": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
        "a.blk": {"quant_algo": "FP8_PB_WO", "group_size": 128},
    }
    assert config["ignore"] == ["a.dense"]
    nv = {k: v for k, v in linears.items() if isinstance(v, NVFP4Linear)}
    save_checkpoint(tmp_path / "c", Checkpoint("compressed-tensors", "NVFP4", nv, tensors, {}))
    groups = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [g["targets"] for g in groups.values()] == [["a.nv"], ["a.w4a16"]]
    assert groups["group_1"]["input_activations"] is None


# --- files written by the safetensors package ----------------------------------------------------

def torch_e4m3(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn)


def test_loads_modelopt_nvfp4_written_by_safetensors_torch_with_hf_quant_config(tmp_path):
    # the legacy ModelOpt layout: hf_quant_config.json, config.json without quantization_config
    q = nvfp4_quantize(float_weight("x", 64, 64, 2.0))
    # torch casts the e4m3 *values* itself: an independent encoder for the scale bytes
    scales_from_torch = torch.from_numpy(decode_e4m3(q.weight_scale)).to(torch.float8_e4m3fn)
    tensors = {
        "layer.weight": torch.from_numpy(q.weight_packed.copy()),
        "layer.weight_scale": scales_from_torch,
        "layer.weight_scale_2": torch.tensor(float(q.weight_scale_2), dtype=torch.float32),
        "layer.input_scale": torch.tensor(0.25, dtype=torch.float32),
        "layer.bias": torch.linspace(-1, 1, 64, dtype=torch.bfloat16),
        "embed.weight": torch.ones(8, 64, dtype=torch.bfloat16),
    }
    folder = tmp_path / "legacy"
    folder.mkdir()
    safetensors.torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (folder / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["embed"]},
    }))
    loaded = load_checkpoint(folder)
    assert (loaded.format, loaded.quant_algo) == ("modelopt", "NVFP4")
    layer = loaded.linears["layer"]
    assert_same_bytes(layer.weight_packed, q.weight_packed)
    assert_same_bytes(layer.weight_scale, scales_from_torch.view(torch.uint8).numpy())
    assert_same_bytes(layer.weight_scale, q.weight_scale)
    assert_same_bytes(layer.global_scale, np.asarray(q.weight_scale_2))
    assert float(layer.input_scale) == 0.25
    bias_bits = tensors["layer.bias"].view(torch.int16).numpy().view(np.uint16)
    assert_same_bytes(loaded.tensors["layer.bias"].array, bias_bits)
    # saved by us (hf_quant_config.json kept), it loads in safetensors.torch with the same dtypes and bits
    save_checkpoint(tmp_path / "ours", loaded)
    assert sorted(os.listdir(tmp_path / "ours")) == ["config.json", "hf_quant_config.json", "model.safetensors"]
    ours = safetensors.torch.load_file(tmp_path / "ours" / "model.safetensors")
    assert {name: t.dtype for name, t in ours.items()} == {name: t.dtype for name, t in tensors.items()}
    for name, tensor in tensors.items():
        assert torch.equal(ours[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_loads_fp8_channel_and_block_written_by_safetensors_torch(tmp_path):
    channel = fp8_quantize(float_weight("c", 48, 64, 3.0), "channel")
    block = fp8_quantize(float_weight("b", 200, 136, 3.0), "block")
    tensors = {
        "c.weight": torch_e4m3(channel.weight),
        "c.weight_scale": torch.from_numpy(channel.weight_scale.reshape(-1, 1).copy()),  # ModelOpt's [N, 1]
        "b.weight": torch_e4m3(block.weight),
        "b.weight_scale_inv": torch.from_numpy(block.weight_scale.copy()),
    }
    folder = tmp_path / "fp8"
    folder.mkdir()
    safetensors.torch.save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
        "quantized_layers": {"c": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
                             "b": {"quant_algo": "FP8_PB_WO", "group_size": 128}}}}))
    loaded = load_checkpoint(folder)
    c, b = loaded.linears["c"], loaded.linears["b"]
    assert (c.granularity, c.weight_scale.shape) == ("channel", (48,))
    assert (b.granularity, b.scale_name, b.weight_scale.shape) == ("block", "weight_scale_inv", (2, 2))
    assert_same_bytes(c.weight, channel.weight)
    assert_same_bytes(c.weight_scale, channel.weight_scale)
    assert_same_bytes(b.weight, block.weight)
    assert_same_bytes(fp8_dequantize(b.weight, b.weight_scale), fp8_dequantize(*block))


# --- compressed-tensors: the reciprocal global scale ---------------------------------------------

def test_compressed_tensors_global_scale_is_a_reciprocal_pinned_on_real_values(tmp_path):
    # (1) A compressed-tensors file written by safetensors.torch. llm-compressor's weight_global_scale
    # is 2688 / amax; for amax = 0.1875 that is exactly 14336.0 (0x46600000).
    q = nvfp4_quantize(float_weight("ct", 32, 32, 0.1875))
    stored_reciprocal = np.float32(2688) / np.float32(0.1875)
    assert f32_bits(stored_reciprocal) == "0x46600000"
    folder = tmp_path / "ct"
    folder.mkdir()
    safetensors.torch.save_file({
        "ct.weight_packed": torch.from_numpy(q.weight_packed.copy()),
        "ct.weight_scale": torch_e4m3(q.weight_scale),
        "ct.weight_global_scale": torch.tensor([14336.0], dtype=torch.float32),
        "ct.input_global_scale": torch.tensor([448.0], dtype=torch.float32),
    }, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
            "dynamic": False}}},
        "ignore": ["lm_head"]}}))
    layer = load_checkpoint(folder).linears["ct"]
    assert f32_bits(layer.global_scale) == f32_bits(ONE / np.float32(14336.0)) == "0x38924925"  # RN32(1/14336)
    assert f32_bits(layer.input_scale) == f32_bits(ONE / np.float32(448.0))
    # loaded as a multiplier it dequantizes like the ModelOpt weight_scale_2 of the same weight
    assert f32_bits(layer.global_scale) == f32_bits(q.weight_scale_2)
    # Saving converts back with RN32(1/g): 1/(1/14336) is 14335.999 (0x465FFFFF) in fp32, so the
    # file's bytes change; loading that file gives the identical multiplier again.
    save_checkpoint(tmp_path / "resaved", load_checkpoint(folder))
    resaved = read_safetensors(tmp_path / "resaved" / "model.safetensors").tensors
    assert resaved["ct.weight_global_scale"].shape == (1,)
    assert f32_bits(resaved["ct.weight_global_scale"].array) == "0x465FFFFF"
    assert f32_bits(load_checkpoint(tmp_path / "resaved").linears["ct"].global_scale) == "0x38924925"

    # (2) The other direction: ModelOpt's amax / 2688 for amax = 0.3125 is 0x38F3CF3D, a value
    # no fp32 reciprocal reaches; saved as compressed-tensors (8601.6, 0x46066666) it comes back
    # 1 ulp larger.
    modelopt = nvfp4_linear("m", 32, 32, 0.3125)
    assert f32_bits(modelopt.global_scale) == "0x38F3CF3D"
    save_checkpoint(tmp_path / "m", Checkpoint("compressed-tensors", "NVFP4", {"m": modelopt}, {}, {}))
    on_disk = read_safetensors(tmp_path / "m" / "model.safetensors").tensors["m.weight_global_scale"].array
    assert f32_bits(on_disk) == "0x46066666"
    assert f32_bits(load_checkpoint(tmp_path / "m").linears["m"].global_scale) == "0x38F3CF3E"


# ==============================================================================================
# checkpoint: validation errors name the file and the tensor
# ==============================================================================================

def rewrite_weights(folder, edit) -> str:
    path = folder / "model.safetensors"
    tensors = {name: StoredTensor(t.array.copy(), t.dtype)
               for name, t in read_safetensors(path, mmap=False).tensors.items()}
    edit(tensors)
    write_safetensors(path, tensors, {"format": "pt"})
    return str(path)


def retag(name, tag):
    def edit(tensors):
        tensors[name] = StoredTensor(tensors[name].array, tag)
    return edit


def replace(name, fn, tag=None):
    def edit(tensors):
        old = tensors[name]
        tensors[name] = StoredTensor(fn(old.array.copy()), tag or old.dtype)
    return edit


def delete(name):
    def edit(tensors):
        del tensors[name]
    return edit


def set_first(value):
    def fn(a):
        a.reshape(-1)[0] = value
        return a
    return fn


Q = f"{ATTN}.q_proj"
TENSOR_CORRUPTIONS = {
    # case: (layout, edit, tensor the error names, message fragment)
    "weight_scale deleted": ("modelopt-nvfp4", delete(f"{Q}.weight_scale"), f"{Q}.weight", "companion"),
    "weight_scale_2 deleted": ("modelopt-nvfp4", delete(f"{Q}.weight_scale_2"), f"{Q}.weight", "weight_scale_2"),
    "weight deleted": ("modelopt-nvfp4", delete(f"{Q}.weight"), f"{Q}.weight_scale", "no 'model.layers.0.self_attn"),
    "fp8 scale deleted": ("modelopt-fp8-tensor", delete(f"{Q}.weight_scale"), f"{Q}.weight", "missing"),
    "ct global scale deleted": ("ct-nvfp4", delete(f"{Q}.weight_global_scale"), f"{Q}.weight_packed", "companion"),
    "weight_scale stored as U8": ("modelopt-nvfp4", retag(f"{Q}.weight_scale", "U8"), f"{Q}.weight_scale",
                                  "dtype F8_E4M3"),
    "weight stored as I8": ("modelopt-nvfp4", replace(f"{Q}.weight", lambda a: a.view(np.int8), "I8"), f"{Q}.weight",
                            "U8 \\(NVFP4\\) or F8_E4M3"),
    "weight_scale_2 stored as F16": ("modelopt-nvfp4",
                                     replace(f"{Q}.weight_scale_2", lambda a: a.astype(np.float16), "F16"),
                                     f"{Q}.weight_scale_2", "dtype F32"),
    "weight_scale for group 32": ("modelopt-nvfp4", replace(f"{Q}.weight_scale", lambda a: a[:, ::2]),
                                  f"{Q}.weight_scale", r"shape \(N, K/16\) = \(64, 8\)"),
    "weight rows != scale rows": ("ct-nvfp4", replace(f"{Q}.weight_packed", lambda a: a[:32]),
                                  f"{Q}.weight_scale", r"\(32, 8\)"),
    "NaN scale byte": ("modelopt-nvfp4", replace(f"{Q}.weight_scale", set_first(0x7F)), f"{Q}.weight_scale",
                       "NaN e4m3"),
    # the sign bit: exporters write amax/6/g >= 0 (ModelOpt clamps to [2^-9, 448]), so 0xB8 = -1.0 is corruption
    "negative scale byte": ("modelopt-nvfp4", replace(f"{Q}.weight_scale", set_first(0xB8)), f"{Q}.weight_scale",
                            "negative e4m3 block scales"),
    "ct negative scale byte": ("ct-nvfp4", replace(f"{Q}.weight_scale", set_first(0x80)), f"{Q}.weight_scale",
                               r"negative e4m3 block scales.*0x80"),
    "NaN fp8 weight byte": ("modelopt-fp8-tensor", replace(f"{Q}.weight", set_first(0xFF)), f"{Q}.weight",
                            "NaN e4m3"),
    "zero global scale": ("modelopt-nvfp4", replace(f"{Q}.weight_scale_2", np.zeros_like), f"{Q}.weight_scale_2",
                          "finite and > 0"),
    "ct zero reciprocal": ("ct-nvfp4", replace(f"{Q}.weight_global_scale", np.zeros_like),
                           f"{Q}.weight_global_scale", "reciprocal"),
    "fp8 channel scale in a per-tensor checkpoint": (
        "modelopt-fp8-tensor", replace(f"{Q}.weight_scale", lambda a: np.full(64, a, np.float32)),
        f"{Q}.weight_scale", "scalar"),
    "block grid of the wrong size": ("modelopt-fp8-block",
                                     replace(f"{Q}.weight_scale", lambda a: np.ones((2, 2), a.dtype)),
                                     f"{Q}.weight_scale", r"\(1, 1\)"),
    "both scale names": ("modelopt-fp8-block-inv",
                         lambda t: t.__setitem__(f"{Q}.weight_scale", t[f"{Q}.weight_scale_inv"]),
                         f"{Q}.weight_scale_inv", "both"),
    "compressed-tensors name in a ModelOpt file": ("modelopt-nvfp4", lambda t: t.__setitem__(
        f"{Q}.weight_packed", t[f"{Q}.weight"]), f"{Q}.weight_packed", "compressed-tensors tensor name"),
}


@pytest.mark.parametrize("case", TENSOR_CORRUPTIONS)
def test_bad_tensors_raise_errors_naming_file_and_tensor(tmp_path, case):
    layout, edit, tensor, fragment = TENSOR_CORRUPTIONS[case]
    save_checkpoint(tmp_path / "c", build_model(layout))
    path = rewrite_weights(tmp_path / "c", edit)
    with pytest.raises(CheckpointError, match=fragment) as info:
        load_checkpoint(tmp_path / "c")
    assert (info.value.path, info.value.tensor) == (path, tensor)
    assert path in str(info.value) and repr(tensor) in str(info.value)


def edit_quant_config(folder, edit) -> str:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))
    return str(path)


CONFIG_CORRUPTIONS = {
    # case: (layout, edit, (file, tensor) the error names; "weights" = model.safetensors), fragment
    "group_size 32": ("modelopt-nvfp4", lambda c: c.update(group_size=32), ("config", "group_size"), "16"),
    "ct group_size 32": ("ct-nvfp4", lambda c: c["config_groups"]["group_0"]["weights"].update(group_size=32),
                         ("config", "config_groups.group_0.weights.group_size"), "must be 16"),
    "ct int4 format": ("ct-nvfp4", lambda c: c.update(format="pack-quantized"), ("config", "format"), "not supported"),
    "ct int4 group format": ("ct-nvfp4", lambda c: c["config_groups"]["group_0"].update(format="pack-quantized"),
                             ("config", "config_groups.group_0"), "not supported"),
    "ct frozen status": ("ct-nvfp4", lambda c: c.update(quantization_status="frozen"),
                         ("config", "quantization_status"), "compressed"),
    "unknown algo": ("modelopt-nvfp4", lambda c: c.update(quant_algo="W4A8_AWQ"), ("config", "quant_algo"),
                     "not supported"),
    "unknown method": ("modelopt-nvfp4", lambda c: c.update(quant_method="gptq"),
                       ("config", "quantization_config.quant_method"), "not supported"),
    "config says FP8, weights are NVFP4": ("modelopt-nvfp4", lambda c: c.update(quant_algo="FP8"),
                                           ("weights", f"{MLP}.down_proj.weight"), "says FP8"),
    "config says channel, weights per-tensor": ("modelopt-fp8-tensor",
                                                lambda c: c.update(quant_algo="FP8_PER_CHANNEL_PER_TOKEN"),
                                                ("weights", f"{MLP}.down_proj.weight_scale"), "channel"),
    "excluded layer stored quantized": ("modelopt-nvfp4", lambda c: c["ignore"].append("model.layers.0.mlp.*"),
                                        ("weights", f"{MLP}.down_proj.weight"), "unquantized"),
    "mixed: listed layer stored unquantized": (
        "modelopt-mixed", lambda c: c["quantized_layers"].update({f"{ATTN}.o_proj": {"quant_algo": "FP8"}}),
        ("weights", f"{ATTN}.o_proj.weight"), "stored unquantized"),
    "mixed: quantized layer not listed": ("modelopt-mixed", lambda c: c["quantized_layers"].pop(MLP),
                                          ("weights", f"{MLP}.down_proj.weight"), "unquantized"),
    "mixed: listed layer has no tensors": (
        "modelopt-mixed", lambda c: c["quantized_layers"].update({"model.layers.1.mlp": {"quant_algo": "NVFP4"}}),
        ("config", "model.layers.1.mlp"), "no tensors"),
    "mixed: NVFP4 entry with group 32": (
        "modelopt-mixed", lambda c: c["quantized_layers"][MLP].update(group_size=32), ("config", MLP), "16"),
    "mixed: kind mismatch": ("modelopt-mixed", lambda c: c["quantized_layers"][MLP].update(quant_algo="FP8"),
                             ("weights", f"{MLP}.down_proj.weight"), "says FP8"),
    "ct: explicit target stored unquantized": (
        "ct-nvfp4",
        lambda c: (c["config_groups"]["group_0"]["targets"].append("lm_head"), c["ignore"].remove("lm_head")),
        ("weights", "lm_head.weight"), "stored unquantized"),
    "ct: quantized layer not targeted": ("ct-nvfp4", lambda c: c["config_groups"]["group_0"]["targets"].remove(Q),
                                         ("weights", f"{Q}.weight_packed"), "unquantized"),
}


@pytest.mark.parametrize("case", CONFIG_CORRUPTIONS)
def test_config_and_weights_must_agree(tmp_path, case):
    layout, edit, (kind, tensor), fragment = CONFIG_CORRUPTIONS[case]
    save_checkpoint(tmp_path / "c", build_model(layout))
    config_path = edit_quant_config(tmp_path / "c", edit)
    path = config_path if kind == "config" else str(tmp_path / "c" / "model.safetensors")
    with pytest.raises(CheckpointError, match=fragment) as info:
        load_checkpoint(tmp_path / "c")
    assert (info.value.path, info.value.tensor) == (path, tensor)


def test_file_corruption_inside_a_checkpoint_names_the_file(tmp_path):
    save_checkpoint(tmp_path / "c", build_model("modelopt-nvfp4"))
    weights = tmp_path / "c" / "model.safetensors"
    raw = weights.read_bytes()
    last = max(read_safetensors_header(weights).tensors.items(), key=lambda item: item[1].data_offsets[1])[0]
    weights.write_bytes(raw[:-3])  # truncated by a few bytes
    with pytest.raises(SafetensorsError, match="truncated") as info:
        load_checkpoint(tmp_path / "c")
    assert (info.value.path, info.value.tensor) == (str(weights), last)
    weights.write_bytes(raw[:8] + raw[8:].replace(b'"dtype"', b'"dtype\'', 1))  # flip the header JSON
    with pytest.raises(SafetensorsError, match="not valid UTF-8 JSON") as info:
        load_checkpoint(tmp_path / "c")
    assert info.value.path == str(weights)
    (tmp_path / "c" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid UTF-8 JSON") as info:
        load_checkpoint(tmp_path / "c")
    assert info.value.path == str(tmp_path / "c" / "config.json")


def test_sharded_index_must_match_the_files(tmp_path):
    save_checkpoint(tmp_path / "s", build_model("modelopt-nvfp4"), max_shard_bytes=SHARDINGS["sharded"])
    index_path = tmp_path / "s" / checkpoint_module.INDEX_FILE
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    # a tensor whose shard holds other tensors too, so the shard stays in the index after the edit
    name, file = next((n, f) for n, f in sorted(index["weight_map"].items())
                      if list(index["weight_map"].values()).count(f) > 1)
    other = next(s for s in shards if s != file)

    stale = dict(index, weight_map=dict(index["weight_map"], **{name: other}))
    index_path.write_text(json.dumps(stale))
    with pytest.raises(CheckpointError, match="the index is stale") as info:
        load_checkpoint(tmp_path / "s")
    assert (info.value.path, info.value.tensor) == (str(tmp_path / "s" / file), name)

    missing = dict(index, weight_map=dict(index["weight_map"], **{"ghost.weight": other}))
    index_path.write_text(json.dumps(missing))
    with pytest.raises(CheckpointError, match="missing from this file") as info:
        load_checkpoint(tmp_path / "s")
    assert (info.value.path, info.value.tensor) == (str(tmp_path / "s" / other), "ghost.weight")

    index_path.write_text(json.dumps(index))
    (tmp_path / "s" / other).unlink()
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_checkpoint(tmp_path / "s")
    assert info.value.path == str(index_path)


def test_a_folder_without_quantization_config_or_weights_is_rejected(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(CheckpointError, match="not a quantized checkpoint"):
        load_checkpoint(tmp_path / "plain")
    save_checkpoint(tmp_path / "nofile", build_model("modelopt-nvfp4"))
    (tmp_path / "nofile" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="holds neither"):
        load_checkpoint(tmp_path / "nofile")


# ==============================================================================================
# data model and fused shards
# ==============================================================================================

BAD_LINEARS = {
    "packed not uint8": (lambda: NVFP4Linear("x", np.zeros((32, 8), np.int8), np.zeros((32, 1), np.uint8),
                                             np.float32(1)), "weight_packed must be a 2-D uint8"),
    "K not a multiple of 16": (lambda: NVFP4Linear("x", np.zeros((32, 4), np.uint8), np.zeros((32, 1), np.uint8),
                                                   np.float32(1)), "multiple of 16"),
    "float64 global scale": (lambda: NVFP4Linear("x", np.zeros((32, 8), np.uint8), np.zeros((32, 1), np.uint8),
                                                 np.float64(1)), "float32 scalar"),
    "negative global scale": (lambda: NVFP4Linear("x", np.zeros((32, 8), np.uint8), np.zeros((32, 1), np.uint8),
                                                  np.float32(-1)), "finite and > 0"),
    "unknown granularity": (lambda: FP8Linear("x", np.zeros((4, 4), np.uint8), np.float32(1), "row"), "granularity"),
    "channel scale of wrong length": (lambda: FP8Linear("x", np.zeros((4, 4), np.uint8), np.ones(3, np.float32),
                                                        "channel"), r"shape \(4,\)"),
    "weight_scale_inv on a tensor scale": (lambda: FP8Linear("x", np.zeros((4, 4), np.uint8), np.float32(1), "tensor",
                                                             None, "weight_scale_inv"), "block-checkpoint name"),
    "zero fp8 scale": (lambda: FP8Linear("x", np.zeros((4, 4), np.uint8), np.zeros(4, np.float32), "channel"),
                       "finite and > 0"),
    "empty name": (lambda: FP8Linear("", np.zeros((4, 4), np.uint8), np.float32(1), "tensor"), "non-empty string"),
}


@pytest.mark.parametrize("case", BAD_LINEARS)
def test_linears_validate_on_construction(case):
    make, fragment = BAD_LINEARS[case]
    with pytest.raises(ValueError, match=fragment):
        make()


def test_fp8_channel_scale_n_by_1_is_flattened_and_scalars_become_0d():
    linear = FP8Linear("x", np.zeros((4, 4), np.uint8), np.ones((4, 1), np.float32), "channel",
                       np.ones(1, np.float32))
    assert linear.weight_scale.shape == (4,) and linear.input_scale.shape == ()
    nv = NVFP4Linear("y", np.zeros((32, 8), np.uint8), np.zeros((32, 1), np.uint8), np.ones(1, np.float32))
    assert nv.global_scale.shape == () and (nv.n, nv.k) == (32, 16)


def test_fuse_nvfp4_shards_keeps_each_global_scale_per_tile():
    shards = [nvfp4_linear(name, n, k, amax) for name, n, k, amax in LINEARS[:3]]  # q/k/v, different g
    assert len({f32_bits(s.global_scale) for s in shards}) == 3
    fused = fuse_nvfp4_shards(shards, f"{ATTN}.qkv_proj")
    assert fused.global_scale.dtype == np.float32 and fused.global_scale.shape == (128 // 32,)
    assert [f32_bits(g) for g in fused.global_scale] == [f32_bits(s.global_scale) for s in shards for _ in
                                                         range(s.n // 32)]
    assert_same_bytes(fused.weight_packed, np.concatenate([s.weight_packed for s in shards]))
    # the fused layer dequantizes, row for row, exactly like its shards
    assert_same_bytes(nvfp4_dequantize(*fused),
                      np.concatenate([nvfp4_dequantize(s.weight_packed, s.weight_scale, s.global_scale)
                                      for s in shards]))


def test_fuse_fp8_shards_builds_an_exact_channel_vector():
    shards = [fp8_linear(name, n, k, amax, "tensor") for name, n, k, amax in LINEARS[:3]]
    fused = fuse_fp8_shards(shards, f"{ATTN}.qkv_proj")
    assert fused.granularity == "channel" and fused.weight_scale.shape == (128,)
    assert_same_bytes(fp8_dequantize(fused.weight, fused.weight_scale),
                      np.concatenate([fp8_dequantize(s.weight, s.weight_scale) for s in shards]))
    blocks = [fp8_linear(f"b{i}", n, 64, 1.0 + i, "block") for i, n in enumerate((128, 96))]
    fused_blocks = fuse_fp8_shards(blocks, "b")
    assert fused_blocks.granularity == "block" and fused_blocks.weight_scale.shape == (2, 1)
    assert_same_bytes(fp8_dequantize(fused_blocks.weight, fused_blocks.weight_scale),
                      np.concatenate([fp8_dequantize(s.weight, s.weight_scale) for s in blocks]))


FUSE_ERRORS = {
    "N not a multiple of 32": (fuse_nvfp4_shards,
                               lambda: [nvfp4_linear("a", 48, 32, 1.0), nvfp4_linear("b", 32, 32, 1.0)],
                               "shard 'a' has N=48, not a multiple of 32"),
    "K differs": (fuse_nvfp4_shards, lambda: [nvfp4_linear("a", 32, 32, 1.0), nvfp4_linear("b", 32, 64, 1.0)],
                  "share K"),
    "mixed formats": (fuse_nvfp4_shards,
                      lambda: [nvfp4_linear("a", 32, 32, 1.0), fp8_linear("b", 32, 32, 1.0, "tensor")],
                      "one quantization format"),
    "empty": (fuse_nvfp4_shards, lambda: [], "non-empty list"),
    "block with tensor": (fuse_fp8_shards, lambda: [fp8_linear("a", 32, 32, 1.0, "block"),
                                                    fp8_linear("b", 32, 32, 1.0, "tensor")], "one granularity"),
    "ragged block shard": (fuse_fp8_shards, lambda: [fp8_linear("a", 96, 32, 1.0, "block"),
                                                     fp8_linear("b", 32, 32, 1.0, "block")], "straddle"),
}


@pytest.mark.parametrize("case", FUSE_ERRORS)
def test_fuse_rejects_incompatible_shards(case):
    fuse, make, fragment = FUSE_ERRORS[case]
    with pytest.raises(ValueError, match=fragment):
        fuse(make(), "fused")


# ==============================================================================================
# atomic save
# ==============================================================================================

def fail_after(count: int):
    calls = []

    def write(f, tensor):
        calls.append(tensor)
        if len(calls) > count:
            raise OSError("injected write failure")
        f.write(memoryview(np.ascontiguousarray(tensor.array).reshape(-1).view(np.uint8)))
    return write


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_failed_save_leaves_no_file_or_folder(tmp_path, monkeypatch, sharding):
    monkeypatch.setattr(safetensors_io, "_write_tensor_bytes", fail_after(5))
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(tmp_path / "new", build_model("modelopt-nvfp4"), max_shard_bytes=SHARDINGS[sharding])
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_whole_folder_and_failure_keeps_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    save_checkpoint(target, build_model("modelopt-fp8-tensor"), max_shard_bytes=SHARDINGS["sharded"])
    old = folder_bytes(target)
    with pytest.raises(ValueError, match="overwrite=True"):
        save_checkpoint(target, build_model("modelopt-nvfp4"))
    with monkeypatch.context() as patch:
        patch.setattr(safetensors_io, "_write_tensor_bytes", fail_after(3))
        with pytest.raises(OSError, match="injected"):
            save_checkpoint(target, build_model("modelopt-nvfp4"), overwrite=True)
    assert folder_bytes(target) == old and os.listdir(tmp_path) == ["ckpt"]
    save_checkpoint(target, build_model("modelopt-nvfp4"), overwrite=True)
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]  # old shards are gone
    assert load_checkpoint(target).quant_algo == "NVFP4" and os.listdir(tmp_path) == ["ckpt"]


def test_save_fills_an_empty_folder_and_refuses_invalid_checkpoints_before_writing(tmp_path):
    (tmp_path / "empty").mkdir()
    save_checkpoint(tmp_path / "empty", build_model("ct-nvfp4"))
    assert load_checkpoint(tmp_path / "empty").format == "compressed-tensors"
    fp8 = build_model("modelopt-fp8-tensor")
    bad = {
        "algo disagrees with the layers": Checkpoint("modelopt", "NVFP4", fp8.linears, fp8.tensors, {}),
        "FP8 in compressed-tensors": Checkpoint("compressed-tensors", "NVFP4", fp8.linears, {}, {}),
        "tensor collides with a linear": Checkpoint("modelopt", "FP8", fp8.linears,
                                                    {f"{Q}.weight_scale": np.float32([1])}, {}),
    }
    for case, checkpoint in bad.items():
        with pytest.raises(ValueError):
            save_checkpoint(tmp_path / "bad", checkpoint)
        assert not (tmp_path / "bad").exists(), case
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_saved_folder_and_files_get_plain_modes_not_temporary_ones(tmp_path):
    """mkdtemp / mkstemp create 0700 / 0600; a saved checkpoint must be readable like any folder."""
    umask = os.umask(0o022)
    try:
        save_checkpoint(tmp_path / "ckpt", build_model("modelopt-nvfp4"))
    finally:
        os.umask(umask)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ckpt").iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644}


def test_a_zero_block_scale_is_an_all_zero_block_and_stays_valid():
    """0x00 (+0) is what an all-zero block (and qpn's pad rows) carry; only the sign bit is refused."""
    linear = nvfp4_linear(Q, 64, 64, 1.0)
    scale = linear.weight_scale.copy()
    scale[0, :] = 0x00
    zeroed = NVFP4Linear(Q, linear.weight_packed, scale, linear.global_scale)
    w16 = nvfp4_dequantize(zeroed.weight_packed, zeroed.weight_scale, zeroed.global_scale)
    assert not np.any(w16[0])


def test_modelopt_4d_block_scales_read_as_the_2d_grid():
    """ModelOpt 0.47 FP8_PB_WO writes [N/128, 1, K/128, 1] (and 0-d for one block): same values, same order."""
    weight = np.zeros((200, 256), np.uint8)
    grid = np.arange(1, 5, dtype=np.float32).reshape(2, 2) / 64
    four_d = FP8Linear(Q, weight, grid.reshape(2, 1, 2, 1), "block")
    assert four_d.weight_scale.shape == (2, 2) and np.array_equal(four_d.weight_scale, grid)
    one_block = FP8Linear(Q, weight[:64, :128], np.float32(0.25).reshape(()), "block")
    assert one_block.weight_scale.shape == (1, 1)
    with pytest.raises(ValueError, match="ModelOpt's"):
        FP8Linear(Q, weight, grid.reshape(1, 2, 2, 1), "block")
