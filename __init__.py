"""qpn: NVFP4 and FP8 weight-only linear layers for GPUs without FP4/FP8 hardware.

Parts (see docs/ARCHITECTURE.md): `qpn.ref` (pure-numpy bit-exact reference), `qpn.checkpoints`
(checkpoint I/O and the packed format), `qpn.cupy_kernels` (sm_75 CUDA kernels through CuPy),
`qpn.torch_bridge` (torch custom ops, modules, vLLM), `qpn.apps` (the `qpn` command, the demo).
`qpn.from_pretrained(folder)` (torch_bridge/pretrained.py) loads a quantized folder as a transformers model.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# `import qpn` stays light (the `qpn` command starts from it): torch and transformers load on first use.
_LAZY = {"from_pretrained": "qpn.torch_bridge.pretrained"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'qpn' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
