"""The packed checkpoint asks qpn.ref.formats for its rules (issue 14, item 1): what `qpn pack` writes
matches each format's description (layout, N padding, buffer names, tags and shapes, source tags),
and a manifest entry that no description fits is a damaged manifest (PackError), never a crash.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from qpn import ref
from qpn.checkpoints import packed, safetensors_io
from qpn.ref.formats import QPN2, WEIGHT_FORMATS, weight_format

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cli import KINDS, Q, build, write  # noqa: E402  (the small checkpoints of every kind)


@pytest.fixture(scope="module")
def packed_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-formats")
    out = {}
    for kind in KINDS:
        out[kind] = str(root / f"{kind}-qpn")
        packed.pack_checkpoint(write(root, kind), out[kind])
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_what_pack_writes_is_the_format_description(packed_folders, kind):
    folder = packed_folders[kind]
    checkpoint = packed.load_packed(folder)
    stored = safetensors_io.read_safetensors(os.path.join(folder, "model.safetensors")).tensors
    for name, layer in checkpoint.layers.items():
        entry = layer.entry
        wf = weight_format(entry["format"], entry.get("granularity"))
        assert wf in WEIGHT_FORMATS and layer.weight_format is wf
        assert entry["layout"] == wf.layout and entry["n_padded"] == wf.padded_n(layer.n)
        assert {role: t["dtype"] for role, t in entry["source_tensors"].items()} == dict(wf.source_tags)
        kernel_bytes = 0
        for buffer, array in zip(wf.buffers, layer.kernel_buffers(), strict=True):
            tensor = stored[f"{name}.qpn_{buffer.name}"]
            assert (tensor.dtype, tensor.shape) == (buffer.tag, buffer.shape(layer.n_padded, layer.k)), buffer.name
            assert array.dtype == buffer.dtype and array.shape == tensor.shape
            kernel_bytes += tensor.nbytes
        assert kernel_bytes == wf.weight_bytes(layer.n_padded, layer.k)


def test_a_k_that_breaks_the_layout_names_the_description_rule():
    for kind in ("nvfp4", "fp8-tensor", "fp8-block"):
        linear = build(kind).linears[Q]
        wf = linear.weight_format
        assert packed.k_multiple(linear) == wf.k_multiple and packed.padded_rows(linear) == wf.padded_n(linear.n)
        short = linear.k - wf.k_multiple // 2  # half a multiple short: never a multiple
        if wf is QPN2:
            bad = ref.NVFP4Linear(Q, linear.weight_packed[:, : short // 2], linear.weight_scale[:, : short // 16],
                                  linear.global_scale)
        else:
            bad = ref.FP8Linear(Q, linear.weight[:, :short], linear.weight_scale, linear.granularity)
        assert packed.unpackable_reason(bad) == (f"K={short} is not a multiple of {wf.k_multiple} ({wf.label}); pad "
                                                 "the input features with zero columns")


def _edit_manifest(folder: str, name: str, key: str, value) -> str:
    path = os.path.join(folder, packed.MANIFEST_FILE)
    with open(path) as f:
        manifest = json.load(f)
    manifest["layers"][name][key] = value
    with open(path, "w") as f:
        json.dump(manifest, f)
    return path


@pytest.mark.parametrize("value", [[], {}, ["nvfp4"]])
def test_a_format_that_is_not_a_name_is_a_damaged_manifest(tmp_path, value):
    """Before: `fmt not in {...}` raised TypeError (unhashable) out of load_packed for a list or object."""
    folder = str(tmp_path / "qpn")
    packed.pack_checkpoint(write(tmp_path, "nvfp4"), folder)
    _edit_manifest(folder, Q, "format", value)
    with pytest.raises(packed.PackError,
                       match=r"has format .*; expected 'nvfp4' or 'fp8' or 'mxfp4'; the manifest is damaged"):
        packed.load_packed(folder)


def test_an_nvfp4_entry_naming_a_granularity_is_a_damaged_manifest(tmp_path):
    """qpn pack writes a granularity for fp8 layers only; before, an nvfp4 entry carrying one loaded silently."""
    folder = str(tmp_path / "qpn")
    packed.pack_checkpoint(write(tmp_path, "nvfp4"), folder)
    _edit_manifest(folder, Q, "granularity", "block")
    with pytest.raises(packed.PackError, match=r"granularity applies to fp8 only.*the manifest is damaged"):
        packed.load_packed(folder)
