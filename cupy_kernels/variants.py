"""The registry of kernel variants that qpn actually launches (read by the compile check).

Format (the contract for every wrapper module of this package):

- A wrapper module declares each kernel build it launches as a module-level `KernelVariant`
  constant and lists them all in a module-level tuple named `KERNEL_VARIANTS`, e.g.

      QPN2_DEQUANTIZE = KernelVariant("qpn2_dequantize.cu", "qpn2_dequantize",
                                      (("QPN_GROUPS_PER_THREAD", "4"),))
      KERNEL_VARIANTS = (QPN2_DEQUANTIZE, ...)

  and launches exactly those constants (`loader.kernel(QPN2_DEQUANTIZE)`), so that what the
  compile check compiles is what runs. Macros are (name, value) string pairs; kernels of one
  file that share the same macros are compiled as one module.
- The module's name goes into `WRAPPER_MODULES` below (one line). `all_variants()` imports
  each listed module (none of them may import cupy at import time) and concatenates their
  `KERNEL_VARIANTS`; a listed module that does not exist yet is skipped.
- `archs`: the real architectures the variant must build for. "sm_75" always; add "sm_70"
  only for code that Volta can run (no `mma.m16n8k8`, no `ldmatrix`: those are sm_75+);
  the sm_70 build needs a CUDA 12 NVRTC and is skipped, with a note, where none is installed.
- `max_stack_bytes`: the local-memory stack frame allowed (0: no local arrays at all).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# Wrapper modules whose KERNEL_VARIANTS the compile check collects (package-relative names).
WRAPPER_MODULES = ("prepack", "dequantize", "workspace", "bf16", "linear", "gemm", "moe", "mxfp4")


@dataclass(frozen=True)
class KernelVariant:
    """One launched kernel build: file (in cupy_kernels/), extern "C" name, macro defines."""

    source: str
    kernel: str
    defines: tuple[tuple[str, str], ...] = ()
    archs: tuple[str, ...] = ("sm_75", "sm_70")
    max_stack_bytes: int = 0

    @property
    def label(self) -> str:
        macros = ",".join(f"{k}={v}" for k, v in self.defines)
        return f"{self.kernel}[{macros}]" if macros else self.kernel


def all_variants() -> tuple[KernelVariant, ...]:
    """Every registered variant of every wrapper module in WRAPPER_MODULES, without duplicates."""
    found: list[KernelVariant] = []
    for module_name in WRAPPER_MODULES:
        qualified = f"{__package__}.{module_name}"
        try:
            module = importlib.import_module(qualified)
        except ModuleNotFoundError as exc:
            if exc.name == qualified:  # that wrapper is not written yet
                continue
            raise
        for variant in getattr(module, "KERNEL_VARIANTS", ()):
            if not isinstance(variant, KernelVariant):
                raise TypeError(f"{qualified}.KERNEL_VARIANTS holds {variant!r}, not a KernelVariant")
            if variant not in found:
                found.append(variant)
    return tuple(found)
