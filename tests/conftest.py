"""Shared pytest set-up: the `gpu` marker skips cleanly, with the reason, without CUDA."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def cuda_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device; otherwise why GPU tests cannot run here."""
    try:
        import cupy
    except ImportError as exc:  # CPU-only machine (CI): CuPy is an extra, not a core dependency
        return f"CuPy is not installed ({exc}); GPU tests need a CUDA device and qpn[cuda12|cuda13]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # driver missing or no device
        return f"no CUDA device visible to CuPy ({type(exc).__name__}: {exc})"
    if count == 0:
        return "no CUDA device visible to CuPy"
    return None


def pytest_collection_modifyitems(config, items):
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
