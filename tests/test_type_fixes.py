"""Bugs that the type check (mypy, pyproject.toml [tool.mypy]) found, each pinned by a test."""

from __future__ import annotations

from qpn.cupy_kernels import compile_check, loader
from qpn.cupy_kernels.variants import KernelVariant


class _UnusedNVRTC:
    """Stands in for the CUDA 13 NVRTC: an sm_72 build must never reach it (CUDA 13 dropped sm_72)."""

    version = (13, 0)

    def compile(self, *args: object) -> loader.CompileResult:
        raise AssertionError("sm_72 must be built by the CUDA 12 NVRTC, not the CUDA 13 one")


def test_sm72_without_a_cuda12_nvrtc_is_skipped_like_sm70(monkeypatch):
    # mypy: check_module(None, ...) for sm_72 when no CUDA 12 NVRTC is installed (only sm_70 was
    # skipped); the check then crashed with AttributeError on None instead of reporting the skip.
    monkeypatch.setattr(loader, "find_cuda12_nvrtc", lambda: None)
    variants = tuple(KernelVariant("qpn2_dequantize.cu", "qpn2_dequantize", archs=(arch,))
                     for arch in ("sm_70", "sm_72"))
    reports, notes = compile_check.check_variants(variants, nvrtc=_UnusedNVRTC(), cuda12=None)
    assert sorted((r.arch, r.note) for r in reports) == [(a, "skipped: no CUDA 12 NVRTC") for a in ("sm_70", "sm_72")]
    assert any("no CUDA 12 NVRTC installed" in note for note in notes)
