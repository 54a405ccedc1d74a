"""One description per weight format, asked by every layer instead of restating its rules.

A format pairs a checkpoint encoding (NVFP4; FP8 at a scale granularity) with the QPN byte layout
the kernels read (docs/QPN2.md, docs/QPN8.md, docs/QPNMX.md). Four exist:

    format  granularity      layout  N multiple  K multiple  packed buffers (N, K: the padded weight)
    nvfp4   -                QPN2    32          64          codes u8 [N, K/2], scales u8 [N, K/16],
                                                             global_scale f32 [N/32]
    fp8     tensor, channel  QPN8    32          16          codes u8 [N, K], group_scales f16 [1, N]
    fp8     block            QPN8    128         128         codes u8 [N, K], group_scales f16 [K/128, N/32]
    mxfp4   -                QPNMX   32          64          codes u8 [N, K/2], scales u8 [N, K/32],
                                                             tile_scale f32 [N/32]

Why the multiples: a tile is 32 output columns (one warp lane per column) and a group 16 k (one
NVFP4 block scale, one QPN8 packet); QPN2's split-K slices are whole batches of 4 groups (K % 64);
a 128x128 FP8 scale block cannot be split (N % 128, K % 128).

`key` names the kernel family that serves a format (cupy_kernels builds and tunes per key);
`format` / `granularity` are the public names (QPNLinear, the packed manifest, the qpn command).
Adding a format means one new description here plus its kernels (and its PackedWeight class and ops in
torch_bridge). MXFP4 (QPNMX, issue 23) is the last one added: its reference is ref/mxfp4.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from .checks import require_int, require_multiple
from .geometry import GROUP_K, TILE_N

FP8_BLOCK = 128  # DeepSeek / Qwen-FP8 block scales cover 128 x 128 weights
MX_BLOCK = 32  # OCP microscaling: one e8m0 scale per 32 consecutive k
FP8_GRANULARITIES = ("tensor", "channel", "block")
PAD_N_FIX = "pad the output features N to a multiple of 32 (QPNLinear pads and crops)"
PAD_K16_FIX = "pad K with zero columns to a multiple of 16"
PAD_K64_FIX = "pad K with zero columns to a multiple of 64"
PAD_BLOCK_FIX = "QPN8 cannot split a 128x128 scale block; pad the weight (and its scales) to whole blocks"

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Buffer:
    """One packed tensor of a layer: its name (the packed file's tensor suffix), dtype and shape."""

    name: str
    dtype: np.dtype
    tag: str  # the safetensors dtype tag it is stored under
    shape: Callable[[int, int], Shape]  # (N, K) of the padded weight -> shape
    prepacked: bool = True  # written by the layout's prepack (False: a checkpoint value the packer carries over)


@dataclass(frozen=True)
class WeightFormat:
    key: str  # kernel family: "qpn2" | "qpn8" | "qpn8_block" | "qpnmx"
    format: str  # public format name: "nvfp4" | "fp8" | "mxfp4"
    granularities: tuple[str, ...]  # FP8 scale granularities served; () for NVFP4
    layout: str  # byte layout: "QPN2" | "QPN8" | "QPNMX"
    label: str  # how messages and tables name it
    n_multiple: int
    k_multiple: int
    n_fix: str
    k_fix: str
    code_bits: int  # bits per weight code
    buffers: tuple[Buffer, ...]  # what prepack produces and a packed file stores, in that order
    source_tags: Mapping[str, str]  # checkpoint tensor role -> safetensors dtype tag (the prepack inputs)
    pad_code: int  # code byte of a pad weight
    pad_scale: float  # scale of a pad row: e4m3 +0 for NVFP4 (a pad weight is +0 whatever its code), 1.0 for FP8
    # the buffer whose per-tile values multiply each output's fp32 sum before its one RN16 (MXFP4's 2^T: the
    # part of the weight fp16 cannot hold, docs/DESIGN.md "MXFP4 weight"); None: W16 is the whole weight
    output_scale: str | None = None

    def require_dims(self, n: int, k: int, n_where: str = "", k_where: str = "") -> None:
        """N and K are positive multiples of this layout's; `*_where` says where the value came from."""
        require_multiple("N", n, self.n_multiple, self.layout_label(n_where), self.n_fix)
        require_multiple("K", k, self.k_multiple, self.layout_label(k_where), self.k_fix)

    def require_int_dims(self, n: object, k: object) -> tuple[int, int]:
        """n and k as a caller passes them (ints, bool excluded), checked by `require_dims` -> (int n, int k)."""
        n, k = require_int("n", n, self.label), require_int("k", k, self.label)
        self.require_dims(n, k)
        return n, k

    def layout_label(self, where: str = "") -> str:
        return f"{self.label} ({where})" if where else self.label

    def padded_n(self, n: int) -> int:
        """N rounded up to what the kernels take (QPNLinear and qpn pack pad with zero rows, then crop)."""
        return -(-n // self.n_multiple) * self.n_multiple

    def __reduce__(self) -> tuple[Callable[[str], WeightFormat], tuple[str]]:
        """A copy or an unpickled one is the description itself, so `wf is QPN2` survives copy.deepcopy
        and torch.save of a module holding it (and the shape lambdas are never pickled)."""
        return _by_key, (self.key,)

    def k_of_codes(self, code_bytes: int) -> int:
        """K of a weight whose codes rows hold `code_bytes` bytes (8 / code_bits codes per byte)."""
        return code_bytes * 8 // self.code_bits

    def buffer(self, name: str) -> Buffer:
        return next(b for b in self.buffers if b.name == name)

    def prepacked_buffers(self) -> tuple[Buffer, ...]:
        """The buffers the layout's prepack writes, in order (QPN2's global scale is the checkpoint's)."""
        return tuple(b for b in self.buffers if b.prepacked)

    def buffer_shapes(self, n: int, k: int) -> dict[str, Shape]:
        return {b.name: b.shape(n, k) for b in self.buffers}

    def weight_bytes(self, n: int, k: int) -> int:
        """Bytes of the packed buffers of an [n, k] weight: what one decode call streams."""
        return sum(int(np.prod(b.shape(n, k))) * b.dtype.itemsize for b in self.buffers)


_U8, _F16, _F32 = np.dtype(np.uint8), np.dtype(np.float16), np.dtype(np.float32)

QPN2 = WeightFormat(
    key="qpn2", format="nvfp4", granularities=(), layout="QPN2", label="QPN2",
    n_multiple=TILE_N, k_multiple=4 * GROUP_K, n_fix=PAD_N_FIX, k_fix=PAD_K64_FIX, code_bits=4,
    buffers=(
        Buffer("codes", _U8, "U8", lambda n, k: (n, k // 2)),
        Buffer("scales", _U8, "U8", lambda n, k: (n, k // GROUP_K)),
        Buffer("global_scale", _F32, "F32", lambda n, k: (n // TILE_N,), prepacked=False),  # weight_scale_2
    ),
    source_tags={"weight_packed": "U8", "weight_scale": "F8_E4M3"},
    pad_code=0x00, pad_scale=0.0,
)
QPN8 = WeightFormat(
    key="qpn8", format="fp8", granularities=("tensor", "channel"), layout="QPN8", label="QPN8",
    n_multiple=TILE_N, k_multiple=GROUP_K, n_fix=PAD_N_FIX, k_fix=PAD_K16_FIX, code_bits=8,
    buffers=(
        Buffer("codes", _U8, "U8", lambda n, k: (n, k)),
        Buffer("group_scales", _F16, "F16", lambda n, k: (1, n)),
    ),
    source_tags={"weight": "F8_E4M3", "weight_scale": "F32"},
    pad_code=0x00, pad_scale=1.0,
)
QPN8_BLOCK = WeightFormat(
    key="qpn8_block", format="fp8", granularities=("block",), layout="QPN8", label="QPN8 with 128x128 block scales",
    n_multiple=FP8_BLOCK, k_multiple=FP8_BLOCK, n_fix=PAD_BLOCK_FIX, k_fix=PAD_BLOCK_FIX, code_bits=8,
    buffers=(
        Buffer("codes", _U8, "U8", lambda n, k: (n, k)),
        Buffer("group_scales", _F16, "F16", lambda n, k: (k // FP8_BLOCK, n // TILE_N)),
    ),
    source_tags={"weight": "F8_E4M3", "weight_scale": "F32"},
    pad_code=0x00, pad_scale=1.0,
)

QPNMX = WeightFormat(
    key="qpnmx", format="mxfp4", granularities=(), layout="QPNMX", label="QPNMX",
    n_multiple=TILE_N, k_multiple=4 * GROUP_K, n_fix=PAD_N_FIX, k_fix=PAD_K64_FIX, code_bits=4,
    buffers=(
        Buffer("codes", _U8, "U8", lambda n, k: (n, k // 2)),  # QPN2's code bytes
        Buffer("scales", _U8, "U8", lambda n, k: (n, k // MX_BLOCK)),  # e8m0
        Buffer("tile_scale", _F32, "F32", lambda n, k: (n // TILE_N,)),  # 2^T per 32-row tile
    ),
    source_tags={"blocks": "U8", "scales": "U8"},
    pad_code=0x00, pad_scale=2.0**-127,  # e8m0 has no zero: byte 0 (2^-127) under +0 codes
    output_scale="tile_scale",
)

WEIGHT_FORMATS = (QPN2, QPN8, QPN8_BLOCK, QPNMX)  # served by every layer
FORMAT_NAMES = ("nvfp4", "fp8", "mxfp4")  # the public format names, in the order messages list them
BY_KEY = {f.key: f for f in WEIGHT_FORMATS}


def _by_key(key: str) -> WeightFormat:
    return BY_KEY[key]


def weight_format(format: str, granularity: str | None = None) -> WeightFormat:
    """The description of `format` ("nvfp4", "mxfp4", or "fp8" with its scale granularity)."""
    if format == "fp8":
        if granularity not in FP8_GRANULARITIES:
            raise ValueError(f"fp8 needs a scale granularity, one of {FP8_GRANULARITIES}, got {granularity!r}")
        return QPN8_BLOCK if granularity == "block" else QPN8
    one = {wf.format: wf for wf in WEIGHT_FORMATS if not wf.granularities}  # one layout, no granularity
    if format in one:
        if granularity is not None:
            raise ValueError(f"granularity applies to fp8 only, got granularity={granularity!r} for {format}; drop it")
        return one[format]
    raise ValueError(f"format must be one of {FORMAT_NAMES}, got {format!r}")
