"""One linear, packed: the QPN2 / QPN8 / QPNMX buffers of a layer (`prepack_layer`) and their exact inverse
(`PackedLayer.unpack`), with the rules that pack, inspect and verify share.

A packed linear X is stored as X.<suffix> tensors, the suffixes the kernel buffers of
qpn.ref.formats (qpn_codes, qpn_scales, qpn_global_scale / qpn_group_scales / qpn_tile_scale) plus FP8's
fp32 scale and the activation scale (the folder and its tensors: qpn.checkpoints.packed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import ref
from ...ref.codecs import E8M0_BIAS
from ...ref.formats import QPN2, QPN8, QPNMX, Buffer, WeightFormat, weight_format
from .. import safetensors_io
from ..checkpoint import FP8Linear, MXFP4Linear, NVFP4Linear, QuantizedLinear


def tensor_suffix(buffer: Buffer) -> str:
    """The suffix a packed file stores a kernel buffer under: X.qpn_<buffer name of qpn.ref.formats>."""
    return f"qpn_{buffer.name}"


# suffixes of a packed linear's tensors: the kernel buffers of qpn.ref.formats, then the two scales
# the kernels do not read (FP8's fp32 scale, which S16 rounds, and the activation scale)
CODES, SCALES, GLOBAL_SCALE = (tensor_suffix(b) for b in QPN2.buffers)
GROUP_SCALES = tensor_suffix(QPN8.buffer("group_scales"))
TILE_SCALE = tensor_suffix(QPNMX.buffer("tile_scale"))  # QPNMX's codes and scales share QPN2's suffixes
WEIGHT_SCALE, INPUT_SCALE = "qpn_weight_scale", "qpn_input_scale"
PACKED_SUFFIXES = (CODES, SCALES, GLOBAL_SCALE, GROUP_SCALES, TILE_SCALE, WEIGHT_SCALE, INPUT_SCALE)

# the e4m3 byte of QPN2's pad scale (+0: every pad weight is +0 whatever its code); pad rows are
# the same bytes QPNLinear writes (tests/test_cli.py compares the two)
NVFP4_PAD_SCALE_BYTE = int(ref.encode_e4m3(np.float32(QPN2.pad_scale)))
# the e8m0 byte of QPNMX's pad scale 2^-127 (byte 0: e8m0 has no zero; +0 codes make the pad weights +0, and
# the byte never raises a tile's 2^T); pack_mxfp4 pads with the same byte
MXFP4_PAD_SCALE_BYTE = int(np.log2(QPNMX.pad_scale)) + E8M0_BIAS


def padded_rows(linear: QuantizedLinear) -> int:
    """N_pad: N rounded up to the layout's N multiple."""
    return linear.weight_format.padded_n(linear.n)


def k_multiple(linear: QuantizedLinear) -> int:
    """The K rule of the layer's layout (qpn.ref.formats)."""
    return linear.weight_format.k_multiple


def unpackable_reason(linear: QuantizedLinear) -> str | None:
    """Why `linear` (a qpn.checkpoints NVFP4Linear / FP8Linear / MXFP4Linear) cannot be packed, or None if it can.

    Reads shapes and scales only (never the codes), so it is cheap enough for `qpn inspect`.
    N never blocks packing (it is padded); K does, and so do scales whose weights overflow fp16
    (MXFP4's never do: its W16 factors each tile's 2^T out, docs/DESIGN.md, "MXFP4 weight").
    """
    wf = linear.weight_format
    if linear.k % wf.k_multiple != 0:
        return (f"K={linear.k} is not a multiple of {wf.k_multiple} ({wf.label}); "
                "pad the input features with zero columns")
    try:
        if isinstance(linear, NVFP4Linear):
            ref.require_nvfp4_fits_fp16(linear.weight_scale, ref.global_scale_per_row(linear.global_scale, linear.n))
        elif isinstance(linear, FP8Linear):
            ref.require_qpn8_fits_fp16(linear.weight_scale)
    except ValueError as exc:
        return str(exc)
    return None


def _pad_rows(a: np.ndarray, rows: int, fill: float) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    pad = np.full((rows - a.shape[0],) + a.shape[1:], fill, dtype=a.dtype)
    return np.concatenate([a, pad], axis=0)


def prepack_layer(linear: QuantizedLinear) -> dict[str, np.ndarray]:
    """A qpn.checkpoints NVFP4Linear / FP8Linear / MXFP4Linear -> its packed buffers {suffix: array} (module
    docstring).

    Raises ValueError if the layer cannot be packed (see `unpackable_reason`).
    """
    wf = linear.weight_format
    n_pad = wf.padded_n(linear.n)
    out: dict[str, np.ndarray] = {}
    if isinstance(linear, NVFP4Linear):
        wp = _pad_rows(linear.weight_packed, n_pad, wf.pad_code)
        ws = _pad_rows(linear.weight_scale, n_pad, NVFP4_PAD_SCALE_BYTE)
        out[CODES], out[SCALES] = ref.qpn2_prepack(wp, ws)
        out[GLOBAL_SCALE] = np.full(wf.buffer("global_scale").shape(n_pad, linear.k), linear.global_scale,
                                    dtype=np.float32)
    elif isinstance(linear, MXFP4Linear):
        blocks = _pad_rows(linear.blocks, n_pad, wf.pad_code)
        out[CODES], out[SCALES], out[TILE_SCALE] = ref.qpnmx_prepack(
            blocks, _pad_rows(linear.scales, n_pad, MXFP4_PAD_SCALE_BYTE))
    else:
        w = _pad_rows(linear.weight, n_pad, wf.pad_code)
        s = linear.weight_scale
        s_pad = _pad_rows(s, n_pad, wf.pad_scale) if linear.granularity == "channel" else s
        out[CODES], out[GROUP_SCALES] = ref.qpn8_prepack(w, s_pad, linear.granularity)
        out[WEIGHT_SCALE] = np.asarray(s, dtype=np.float32)
    if linear.input_scale is not None:
        out[INPUT_SCALE] = np.asarray(linear.input_scale, dtype=np.float32).reshape(())
    return out


def scale_fields(linear: QuantizedLinear) -> dict[str, str]:
    """The manifest fields that say how an FP8 layer's scale is stored (its granularity and tensor name);
    none for NVFP4 and MXFP4. PackedLayer.unpack reads them back."""
    if isinstance(linear, FP8Linear):
        return {"granularity": linear.granularity, "scale_name": linear.scale_name}
    return {}


def source_tensors(linear: QuantizedLinear) -> dict[str, safetensors_io.StoredTensor]:
    """The layer's quantized tensors by role, with the bytes and dtype tag the checkpoint stores (MXFP4's
    blocks as [N, K/32, 16]: compressed-tensors' weight_packed [N, K/2], the same bytes)."""
    # each role is the layer's attribute of that name (NVFP4Linear.weight_packed, MXFP4Linear.blocks, ...)
    return {role: safetensors_io.StoredTensor(getattr(linear, role), tag)
            for role, tag in linear.weight_format.source_tags.items()}



def prepack_group_scales(weight_scale: np.ndarray, granularity: str, n: int, n_pad: int, k: int) -> np.ndarray:
    """The QPN8 group_scales `prepack_layer` writes for an fp32 scale (pad channels get scale 1.0)."""
    s = np.asarray(weight_scale, np.float32)
    if granularity == "channel":
        s = _pad_rows(s.reshape(n), n_pad, QPN8.pad_scale)
    return ref.qpn8.qpn8_group_scales(s, n_pad, k, granularity)



@dataclass(frozen=True, eq=False)
class PackedLayer:
    """One packed linear: its stored tensors by suffix, as `prepack_layer` returns them (the kernel
    buffers of its layout in the description's order, then FP8's fp32 weight_scale, then the input
    scale if any), plus what the manifest says about it.

    nvfp4: qpn_codes uint8 [N_pad, K/2], qpn_scales uint8 [N_pad, K/16], qpn_global_scale float32 [N_pad/32];
    fp8: qpn_codes uint8 [N_pad, K], qpn_group_scales float16, qpn_weight_scale float32 (the source's);
    mxfp4: qpn_codes uint8 [N_pad, K/2], qpn_scales uint8 [N_pad, K/32] (e8m0), qpn_tile_scale float32 [N_pad/32].
    """

    name: str
    format: str
    n: int
    k: int
    arrays: Mapping[str, np.ndarray]  # suffix -> array
    entry: Mapping[str, Any]  # the manifest's layer entry

    @property
    def n_padded(self) -> int:
        return int(self.codes.shape[0])

    @property
    def granularity(self) -> str | None:
        return self.entry.get("granularity")

    @property
    def weight_format(self) -> WeightFormat:
        """The qpn.ref.formats description of the layer (ValueError for a granularity its format has not)."""
        return weight_format(self.format, self.granularity)

    @property
    def codes(self) -> np.ndarray:
        return self.arrays[CODES]

    @property
    def scales(self) -> np.ndarray:
        """The layout's scale buffer: QPN2's e4m3 scales, QPN8's fp16 group scales, QPNMX's e8m0 scales."""
        return self.arrays[tensor_suffix(self.weight_format.buffers[1])]

    @property
    def input_scale(self) -> np.ndarray | None:
        return self.arrays.get(INPUT_SCALE)

    def buffers(self) -> dict[str, np.ndarray]:
        """{suffix: array} as `prepack_layer` returns them (for byte comparisons)."""
        return dict(self.arrays)

    def nvfp4_global_scale(self) -> np.ndarray:
        """global_scale of an nvfp4 layer (absent only for fp8; load_packed always reads it for nvfp4)."""
        if GLOBAL_SCALE not in self.arrays:
            raise ValueError(f"layer {self.name!r}: an nvfp4 PackedLayer needs global_scale float32 [N_pad/32], got "
                             "none; read the layer with load_packed")
        return self.arrays[GLOBAL_SCALE]

    def kernel_buffers(self) -> tuple[np.ndarray, ...]:
        """The buffers the decode kernels take, in the description's order (qpn.ref.formats)."""
        return tuple(self.arrays[tensor_suffix(b)] for b in self.weight_format.buffers)

    def fp8_weight_scale(self) -> np.ndarray:
        """weight_scale of an fp8 layer (absent only for nvfp4; load_packed always reads it for fp8)."""
        if WEIGHT_SCALE not in self.arrays:
            raise ValueError(f"layer {self.name!r}: an fp8 PackedLayer needs its float32 weight_scale, got none; "
                             "read the layer with load_packed")
        return self.arrays[WEIGHT_SCALE]

    def unpack(self) -> QuantizedLinear:
        """The source layer (NVFP4Linear / FP8Linear / MXFP4Linear): exact inverse of the prepack, pad rows cropped.

        Raises ValueError if the pad rows are not the padding qpn writes or the per-tile global
        scales differ (neither can come out of `qpn pack`: the folder is corrupt).
        """
        n, k, n_pad, wf = self.n, self.k, self.n_padded, self.weight_format
        if wf is QPN2:
            wp, ws = ref.qpn2_unpack(self.codes, self.scales, n_pad, k)
            if np.any(wp[n:] != wf.pad_code) or np.any(ws[n:] != NVFP4_PAD_SCALE_BYTE):
                raise ValueError(f"layer {self.name!r}: pad rows {n}..{n_pad - 1} are not zero; the packed file is "
                                 "corrupt")
            g = self.nvfp4_global_scale()
            if np.any(g.view(np.uint32) != g[:1].view(np.uint32)):
                raise ValueError(f"layer {self.name!r}: the per-tile global scales differ, but qpn pack writes one "
                                 "value per layer; the packed file is corrupt")
            return NVFP4Linear(self.name, wp[:n], ws[:n], g[0].copy(), self.input_scale)
        if wf is QPNMX:  # tile_scale follows from the scales: the fresh prepack of qpn verify compares it
            blocks, scales = ref.mxfp4.qpnmx_unpack(self.codes, self.scales, n_pad, k)
            if np.any(blocks[n:] != wf.pad_code) or np.any(scales[n:] != MXFP4_PAD_SCALE_BYTE):
                raise ValueError(f"layer {self.name!r}: pad rows {n}..{n_pad - 1} are not zero; the packed file is "
                                 "corrupt")
            return MXFP4Linear(self.name, blocks[:n], scales[:n], self.input_scale)
        weight, _ = ref.qpn8_unpack(self.codes, self.scales, n_pad, k)
        if np.any(weight[n:] != wf.pad_code):
            raise ValueError(f"layer {self.name!r}: pad rows {n}..{n_pad - 1} are not zero; the packed file is corrupt")
        return FP8Linear(self.name, weight[:n], self.fp8_weight_scale(), self.entry["granularity"],
                                   self.input_scale, self.entry["scale_name"])

