"""The torch side of the packed buffers ref/formats.py describes: the dtype each is held in, an empty one of
its description's shape (the ops' outputs, a module's placeholders), and the output scale some layouts hold."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..ref.formats import Buffer, WeightFormat
from ..ref.geometry import TILE_N

# looked up, not recomputed: a packed weight is built on every QPNLinear forward
_TORCH_DTYPES = {np.dtype(d): torch.from_numpy(np.empty(0, d)).dtype for d in (np.uint8, np.float16, np.float32)}


def buffer_dtype(buffer: Buffer) -> torch.dtype:
    """The torch dtype a packed buffer is held in (its description's numpy dtype)."""
    return _TORCH_DTYPES[buffer.dtype]


def empty_buffer(wf: WeightFormat, name: str, n: int, k: int, device: torch.device | str) -> Tensor:
    """An uninitialized buffer `name` of `wf` for an [n, k] weight (the description's shape and dtype)."""
    buffer = wf.buffer(name)
    return torch.empty(buffer.shape(n, k), dtype=buffer_dtype(buffer), device=device)


def column_scale(wf: WeightFormat, buffers: tuple[Tensor, ...]) -> Tensor | None:
    """float32 [N]: what each output's fp32 sum is multiplied by before its one RN16 (the per-tile values of
    `wf.output_scale`, MXFP4's 2^T, repeated over the tile's 32 columns); None where W16 is the whole weight.
    Every backend's dense and decode-then-matmul paths apply it (the kernels hold it per tile)."""
    if wf.output_scale is None:
        return None
    at = [b.name for b in wf.buffers].index(wf.output_scale)
    return buffers[at].reshape(-1).repeat_interleave(TILE_N)
