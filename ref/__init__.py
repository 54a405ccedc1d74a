"""qpn.ref: the pure-numpy, bit-exact reference of NVFP4/FP8/MXFP4 decoding and the QPN2/QPN8/QPNMX layouts.

This package is the executable specification -- codecs, quantizers, the QPN2/QPN8 layouts and
their exact inverses, the linear contract with its error bounds -- that the CUDA kernels and the
CPU backend must match byte for byte. It imports numpy only, never torch or cupy, and nothing of
qpn outside itself. e4m3 values travel as uint8 bit patterns.

Reading and writing checkpoints is not reference: it lives in qpn.checkpoints (docs/ARCHITECTURE.md).
The checkpoint names this package exported before that split (load_checkpoint, Checkpoint,
read_safetensors, ...) still resolve here, lazily (`__getattr__` below), so that importing the
reference never imports file handling.
"""

from .codecs import decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3
from .dtypes import bf16_bits, bf16_from_bits, bf16_round, fp16_rows, is_bf16
from .formats import QPN2, QPN8, QPN8_BLOCK, WeightFormat, weight_format
from .fp8 import FP8Weight, fp8_dequantize, fp8_quantize, fp8_scale_granularity, fp8_scale_map
from .geometry import KORDER, column_of_lane, k_of_position, lane_of_column, position_of_k
from .global_scale import global_scale_per_row
from .linear import (
    linear,
    linear_bounds,
    linear_bounds_fp32,
    linear_bounds_of_fp32_sums,
    linear_error_bound,
    linear_gated,
    silu_and_mul,
)
from .mxfp4 import MXFP4Weight, mxfp4_dequantize, mxfp4_quantize, qpnmx_dequantize, qpnmx_prepack
from .nvfp4 import (
    NVFP4Weight,
    nvfp4_block_overflows,
    nvfp4_dequantize,
    nvfp4_dequantize_fp32,
    nvfp4_quantize,
    nvfp4_value_table,
    pack_nibbles,
    require_nvfp4_fits_fp16,
    unpack_nibbles,
)
from .qpn2 import (
    UPSTREAM_VARIANTS,
    qpn2_dequantize,
    qpn2_dequantize_variant_e,
    qpn2_dequantize_variant_p,
    qpn2_prepack,
    qpn2_unpack,
)
from .qpn8 import qpn8_dequantize, qpn8_prepack, qpn8_scale_granularity, qpn8_unpack, require_qpn8_fits_fp16

# the public checkpoint names of qpn.ref before qpn.checkpoints existed (the package qpn.checkpoints exports each)
_CHECKPOINT_NAMES = frozenset((
    "Checkpoint", "CheckpointError", "FP8Linear", "NVFP4Linear", "fuse_fp8_shards", "fuse_nvfp4_shards",
    "load_checkpoint", "save_checkpoint",
    "SafetensorsError", "StoredTensor", "read_safetensors", "read_safetensors_header", "write_safetensors",
))


def __getattr__(name: str) -> object:
    """qpn.ref.load_checkpoint and the other checkpoint names: qpn.checkpoints', imported on first use."""
    if name not in _CHECKPOINT_NAMES:
        raise AttributeError(f"module 'qpn.ref' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    return getattr(importlib.import_module("..checkpoints", __name__), name)
