"""The torch side of the packed buffers ref/formats.py describes: the dtype each is held in, and an empty
one of its description's shape (the ops' outputs, a module's placeholders)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..ref.formats import Buffer, WeightFormat

# looked up, not recomputed: a packed weight is built on every QPNLinear forward
_TORCH_DTYPES = {np.dtype(d): torch.from_numpy(np.empty(0, d)).dtype for d in (np.uint8, np.float16, np.float32)}


def buffer_dtype(buffer: Buffer) -> torch.dtype:
    """The torch dtype a packed buffer is held in (its description's numpy dtype)."""
    return _TORCH_DTYPES[buffer.dtype]


def empty_buffer(wf: WeightFormat, name: str, n: int, k: int, device: torch.device | str) -> Tensor:
    """An uninitialized buffer `name` of `wf` for an [n, k] weight (the description's shape and dtype)."""
    buffer = wf.buffer(name)
    return torch.empty(buffer.shape(n, k), dtype=buffer_dtype(buffer), device=device)
