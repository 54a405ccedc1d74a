"""`qpn quantize --method mse`'s NVFP4 search (ref/scale_search.py) and `--method`'s default per format
(apps/quantize_cmd.py's DEFAULT_METHODS, chosen by perplexity on a real model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qpn.apps import cli
from qpn.apps.quantize_cmd import DEFAULT_METHODS
from qpn.checkpoints.quantize import FORMATS, quantize_checkpoint
from qpn.checkpoints.safetensors_io import StoredTensor, read_safetensors, write_safetensors
from qpn.ref.nvfp4 import nvfp4_dequantize_fp32, nvfp4_quantize
from qpn.ref.scale_search import NVFP4_BYTE_OFFSETS, nvfp4_quantize_mse

# (rows, K): a ragged last chunk of the search (_SEARCH_BLOCKS = 1024 blocks) and a one-row weight
SHAPES = ((70, 256), (1, 64))


def _brute_force_scales(w: np.ndarray) -> np.ndarray:
    """Each block's byte among RTN's + NVFP4_BYTE_OFFSETS (clipped to 0x01..0x7E) of least squared error, the
    first on a tie, each candidate quantized and decoded by the reference itself (ref/nvfp4.py)."""
    rtn = nvfp4_quantize(w)
    errors, bytes_ = [], []
    for offset in NVFP4_BYTE_OFFSETS:
        scale = np.clip(rtn.weight_scale.astype(np.int16) + offset, 1, 0x7E).astype(np.uint8)
        q = nvfp4_quantize(w, rtn.weight_scale_2, scale)
        diff = w.astype(np.float64) - nvfp4_dequantize_fp32(*q)
        errors.append((diff * diff).reshape(*scale.shape, -1).sum(axis=-1))
        bytes_.append(scale)
    return np.take_along_axis(np.stack(bytes_), np.argmin(np.stack(errors), axis=0)[None], axis=0)[0]


@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_search_picks_the_reference_decoders_least_error(shape):
    """The search judges candidates without packing or the pair-table decode (ref/scale_search.py); its bytes
    must be those that the reference quantizer + decoder rank first, and its codes nvfp4_quantize's own."""
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_t(5, size=shape) * 0.02).astype(np.float32)
    w[0, :3] = (0.0, -0.0, -1e-9)  # signed zeros and a weight that rounds to -0
    got = nvfp4_quantize_mse(w)
    expected = _brute_force_scales(w)
    assert np.array_equal(got.weight_scale, expected)
    assert np.array_equal(got.weight_packed, nvfp4_quantize(w, got.weight_scale_2, expected).weight_packed)
    assert (got.weight_scale != nvfp4_quantize(w).weight_scale).any()  # the search moved some block


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("float")
    rng = np.random.default_rng(39)
    tensors = {f"model.layers.0.mlp.{name}.weight": StoredTensor((rng.standard_normal((64, 128)) * 0.02)
                                                                 .astype(np.float32), "F32")
               for name in ("gate_proj", "down_proj")}
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(folder)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_method_defaults_to_the_measured_winner(float_folder, tmp_path, fmt):
    """`qpn quantize` without --method writes what --method DEFAULT_METHODS[fmt] writes, byte for byte; on these
    weights nvfp4's mse and rtn differ, so the default is seen, not assumed."""
    assert cli.main(["quantize", float_folder, str(tmp_path / "default"), "--format", fmt, "-q"]) == 0
    default = read_safetensors(tmp_path / "default" / "model.safetensors").tensors
    outputs = {}
    for method in FORMATS[fmt].methods:
        quantize_checkpoint(float_folder, tmp_path / method, fmt, method=method)
        outputs[method] = read_safetensors(tmp_path / method / "model.safetensors").tensors
    same = {m: all(np.array_equal(t.array, default[n].array) for n, t in out.items()) for m, out in outputs.items()}
    assert same[DEFAULT_METHODS[fmt]], same
    if fmt == "nvfp4":
        assert DEFAULT_METHODS[fmt] == "mse" and not same["rtn"]
