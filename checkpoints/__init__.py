"""qpn.checkpoints: reading, writing and packing checkpoints (numpy and qpn.ref only).

- checkpoint.py: the in-memory checkpoint, one validated object per linear layer (`Checkpoint`,
  `NVFP4Linear`, `FP8Linear`, `MXFP4Linear`); fused.py: q/k/v and gate/up shards stacked into one layer.
- folder.py: checkpoint folders (`load_checkpoint`, `open_checkpoint`, `save_checkpoint`), read
  by the reader of the producer their config names: modelopt.py (ModelOpt) or
  compressed_tensors.py (compressed-tensors), each a `Producer` of producer.py, which also holds
  what the two share (grouping tensors into layers, the explicit-entry rules).
- gpt_oss.py: gpt-oss's own MXFP4 checkpoints (quant_method "mxfp4"): `is_gpt_oss_mxfp4`,
  `read_gpt_oss_config`, `gpt_oss_expert_layers`, `read_gpt_oss_experts` (one `MXFP4Experts` per layer,
  gate / up in qpn's order), `load_gpt_oss` (the folder as a Checkpoint with stacked experts).
- load.py: `load_checkpoint`, the one entry for every folder kind above (gpt-oss's, or folder.py's).
- packed/: the packed checkpoint format that `qpn pack` writes (docs/FORMATS.md).
- safetensors_io.py: a strict, memory-mapped safetensors reader and an atomic writer.
- atomic.py: atomic folder writes that survive SIGTERM and never replace what qpn did not write.

The reference (qpn.ref) is the executable spec; this part moves bytes between it and the disk.
"""

from .checkpoint import (
    QUANTIZED_LINEARS,
    Checkpoint,
    CheckpointError,
    FP8Linear,
    MXFP4Linear,
    NVFP4Linear,
    QuantizedLinear,
)
from .folder import save_checkpoint
from .fused import fuse_fp8_shards, fuse_nvfp4_shards
from .gpt_oss import (
    GptOssMXFP4Config,
    MXFP4Experts,
    gpt_oss_expert_layers,
    is_gpt_oss_mxfp4,
    read_gpt_oss_config,
    read_gpt_oss_experts,
)
from .load import load_checkpoint
from .safetensors_io import SafetensorsError, StoredTensor, read_safetensors, read_safetensors_header, write_safetensors

__all__ = ["QUANTIZED_LINEARS", "Checkpoint", "CheckpointError", "FP8Linear", "GptOssMXFP4Config", "MXFP4Experts",
           "MXFP4Linear", "NVFP4Linear", "QuantizedLinear", "SafetensorsError", "StoredTensor", "fuse_fp8_shards",
           "fuse_nvfp4_shards", "gpt_oss_expert_layers", "is_gpt_oss_mxfp4", "load_checkpoint", "read_gpt_oss_config",
           "read_gpt_oss_experts", "read_safetensors", "read_safetensors_header", "save_checkpoint",
           "write_safetensors"]
