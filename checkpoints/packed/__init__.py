"""The qpn packed checkpoint: a quantized checkpoint whose linears are already in the QPN2 / QPN8 / QPNMX layout.

`qpn pack SRC OUT` writes one; `qpn verify` / `qpn inspect` read both kinds of folder;
`qpn.torch_bridge.load_quantized(model, OUT)` fills a model from one without prepacking again.
Pure numpy and `qpn.ref` (no torch): packing a checkpoint needs neither torch nor a GPU.

Folder OUT (everything is derived from the source folder alone, so packing the same input twice
gives identical bytes; nothing records the time or the source path):

    qpn_manifest.json      what the folder is (below); written last, its presence marks the folder
    config.json            copied byte for byte from the source (if present), and so is
    hf_quant_config.json   the older ModelOpt config (if present)
    model.safetensors      or the source's own shard names + model.safetensors.index.json: every
                           layer and tensor lands in the file that held it in the source
    every other file       of the source's top level, copied byte for byte and listed in the
                           manifest's copied_files (tokenizer.json, tokenizer_config.json,
                           generation_config.json, chat templates, README ...), so the folder
                           serves as it is; not copied: other *.safetensors files and indexes
                           (weights the checkpoint does not list), hidden entries (.git, .cache,
                           .gitattributes), and - reported by `qpn pack` - subfolders, links to
                           nothing, FIFOs and devices (`source_extras`). A link is followed: the
                           copy is a regular file holding the content.

Tensors of a quantized linear X (N output features, K input features; N_pad = N rounded up to 32,
or to 128 for FP8 128x128 block scales; pad rows are exact zeros and are cropped by the readers):

    NVFP4 -> QPN2   X.qpn_codes          U8   [N_pad, K/2]     codes in QPN2 byte order (docs/QPN2.md)
                    X.qpn_scales         U8   [N_pad, K/16]    e4m3 scale bytes in QPN2 order
                    X.qpn_global_scale   F32  [N_pad/32]       multiplier per 32-row tile (ModelOpt's
                                                               weight_scale_2; compressed-tensors'
                                                               reciprocal already inverted)
    FP8   -> QPN8   X.qpn_codes          U8   [N_pad, K]       e4m3 bytes in QPN8 order (docs/QPN8.md)
                    X.qpn_group_scales   F16  [1, N_pad] or [K/128, N_pad/32]   S16 = RN16(256 * s)
                    X.qpn_weight_scale   F32  as in the source: () / [N] / [ceil(N/128), ceil(K/128)]
                                                               (the fp32 scale, kept because S16 is
                                                               rounded and cannot give it back)
    MXFP4 -> QPNMX  X.qpn_codes          U8   [N_pad, K/2]     codes in QPN2 byte order (docs/QPNMX.md)
                    X.qpn_scales         U8   [N_pad, K/32]    e8m0 bytes in QPNMX order
                    X.qpn_tile_scale     F32  [N_pad/32]       2^T per 32-row tile (follows from the scales)
    all             X.qpn_input_scale    F32  []               the activation scale, if the source had one

The buffers are exactly `QPNLinear`'s (`codes`, `scales`, `global_scale` / `group_scales`),
padding included: NVFP4 pad rows have code 0 and scale byte 0x00, FP8 pad rows code 0x00 and
scale 1.0 (per channel), MXFP4 pad rows code 0 and e8m0 byte 0x00 (2^-127: +0 weights that never raise a
tile's 2^T). Every other source tensor (biases, embeddings, norms, unquantized
weights) is copied through under its own name and dtype tag.

qpn_manifest.json (sorted keys, 2-space indent):

    {"format": "qpn-packed", "version": 1, "producer": {"name": "qpn", "version": ...},
     "source": {"format": "modelopt" | "compressed-tensors", "quant_algo": "NVFP4" | ...,
                "files": {file name: sha256 of the source file}},
     "copied_files": {file name: {"sha256": ..., "size": bytes}} (only if the source had such files:
                     a checkpoint without them packs to the same bytes as before this key existed),
     "layers": {X: {"format": "nvfp4" | "fp8" | "mxfp4", "layout": "QPN2" | "QPN8" | "QPNMX", "n": N, "k": K,
                    "n_padded": N_pad, "file": shard, "global_scale": [g] (nvfp4),
                    "granularity": "tensor" | "channel" | "block", "scale_name": ...,
                    "weight_scale": [s] (fp8 per tensor), "input_scale": [s] (if any),
                    "source_tensors": {role: {"dtype": ..., "shape": [...], "sha256": ...}}}},
     "tensors": {name: {"file": ..., "dtype": ..., "shape": [...], "sha256": ...}}}

`source_tensors` hashes the original bytes of the layer's quantized tensors (nvfp4: roles
weight_packed and weight_scale; fp8: weight and weight_scale; mxfp4: blocks [N, K/32, 16] and scales, the
bytes of compressed-tensors' weight_packed and weight_scale), so a packed folder verifies on its
own: `PackedLayer.unpack()` is the exact inverse of the prepack and must give those bytes back.

`load_packed` checks that every copied file is there with its recorded size; `qpn verify` also
compares its sha256 (`copied_file_problems`).

Reading the source: `pack_checkpoint` reads it with plain file reads, one layer or tensor at a
time (`qpn.checkpoints.folder.open_checkpoint`), never through a memory map, which a truncation by another
process turns into a SIGBUS. Every source file must stay as it was from the moment it is first
read until the output is complete (size and modification time, checked at every read and once
more before the manifest is written); a shard or copied file that changes is a
SafetensorsError / PackError naming it, and nothing is written.

Errors: `PackError` (a ValueError naming the folder, the layer and the rule) for layers that
cannot be packed (K not a multiple of 64 for QPN2 / 16 for QPN8 / 128 for block scales, blocks
whose largest weight overflows fp16) and for packed folders that break this format.

Modules: layers.py (one linear: prepack_layer and its inverse PackedLayer.unpack), manifest.py
(qpn_manifest.json: entries, hashes, rules), write.py (pack_checkpoint), read.py (load_packed).
"""

from .layers import (
    CODES,
    GLOBAL_SCALE,
    GROUP_SCALES,
    INPUT_SCALE,
    PACKED_SUFFIXES,
    SCALES,
    TILE_SCALE,
    WEIGHT_SCALE,
    PackedLayer,
    k_multiple,
    padded_rows,
    prepack_group_scales,
    prepack_layer,
    scale_fields,
    source_tensors,
    tensor_suffix,
    unpackable_reason,
)
from .manifest import (
    COPIED_CONFIG_FILES,
    MANIFEST_FILE,
    PACKED_FORMAT,
    PACKED_VERSION,
    PackError,
    Progress,
    is_packed,
    sha256_array,
    sha256_file,
)
from .read import PackedCheckpoint, copied_file_problems, load_packed, no_quantized_layer
from .write import pack_checkpoint, source_extras

__all__ = [
    "CODES", "COPIED_CONFIG_FILES", "GLOBAL_SCALE", "GROUP_SCALES", "INPUT_SCALE", "MANIFEST_FILE", "PACKED_FORMAT",
    "PACKED_SUFFIXES", "PACKED_VERSION", "SCALES", "TILE_SCALE", "WEIGHT_SCALE", "PackError", "PackedCheckpoint",
    "PackedLayer", "Progress", "copied_file_problems", "is_packed", "k_multiple", "load_packed",
    "no_quantized_layer", "pack_checkpoint", "padded_rows", "prepack_group_scales", "prepack_layer", "scale_fields",
    "sha256_array", "sha256_file", "source_extras", "source_tensors", "tensor_suffix", "unpackable_reason",
]
