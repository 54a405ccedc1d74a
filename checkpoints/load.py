"""`load_checkpoint`: any quantized checkpoint folder qpn reads, by what its config says: gpt-oss's own MXFP4
(stacked experts: gpt_oss.load_gpt_oss), else ModelOpt / compressed-tensors (per-linear layers:
folder.load_checkpoint, which gpt_oss.py builds on, so the choice is made here, above both)."""

from __future__ import annotations

import os

from .checkpoint import Checkpoint
from .folder import CONFIG_FILE
from .folder import load_checkpoint as load_linears
from .gpt_oss import is_gpt_oss_mxfp4, load_gpt_oss


def load_checkpoint(path: str | os.PathLike[str], *, mmap: bool = True) -> Checkpoint:
    """Load and validate the checkpoint folder `path` (folder.load_checkpoint's rules; gpt-oss's in gpt_oss.py).

    mmap=True (default) keeps arrays as read-only views of memory-mapped files."""
    folder = os.fspath(path)
    if os.path.isfile(os.path.join(folder, CONFIG_FILE)) and is_gpt_oss_mxfp4(folder):
        return load_gpt_oss(folder, mmap=mmap)
    return load_linears(folder, mmap=mmap)
