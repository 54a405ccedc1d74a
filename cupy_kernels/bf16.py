"""bf16 activations into the fp16 kernels (docs/DESIGN.md, "bf16 activations", the Turing path): every decode,
GEMM and MoE launch takes x as fp16 or as bf16. CuPy has no bfloat16 dtype, so bf16 tensors travel as their
bits in int16 arrays (torch's `tensor.view(torch.int16)`, zero copy); the output then is bf16 bits too.

For bf16 x the launch first queues qpn_x_bf16_rows (x_bf16.cu): x16 = RN16(x * 2^e(row)), exact wherever
|x * 2^e| >= 2^-14, and factor[row] = 2^-e, into the call's workspace; the kernels then run on x16 exactly as
on fp16 x, and their epilogues multiply each fp32 sum by its row's factor and round once to bf16. Where the
kernel reads x as fragments (x_fragments.cu: the GEMM, the decode at M > 8) the same launch writes them, in
place of qpn_x_fragments: no launch more than fp16.
"""

from __future__ import annotations

import numpy as np

from ._validate import CupyArray, require_cupy
from .loader import kernel
from .variants import KernelVariant
from .workspace import TOKENS_PER_BLOCK

BF16_BITS = np.dtype(np.int16)  # how a bf16 array travels (module docstring)
ACTIVATIONS = (np.dtype(np.float16), BF16_BITS)
X_BF16_ROWS = KernelVariant("x_bf16.cu", "qpn_x_bf16_rows")
KERNEL_VARIANTS = (X_BF16_ROWS,)
_THREADS = 256  # x_bf16.cu, QPN_BF16_THREADS


def require_activations(name: str, x: object, ndim: int = 2) -> CupyArray:
    """`x` is fp16, or bf16 bits (int16), C-contiguous on the current device."""
    import cupy  # noqa: PLC0415

    if not isinstance(x, cupy.ndarray):
        return require_cupy(name, x, np.float16, ndim=ndim)  # raises: not a CuPy array
    if x.dtype not in ACTIVATIONS:
        raise ValueError(f"{name} must be float16, or bfloat16 as its bits in an int16 array (CuPy has no bfloat16: "
                         f"torch's tensor.view(torch.int16)), got dtype {x.dtype}; cast it to one of them")
    return require_cupy(name, x, x.dtype, ndim=ndim)


def is_bf16(x: CupyArray) -> bool:
    return bool(x.dtype == BF16_BITS)


def bf16_rows_elements(m: int, k: int, fragments: bool = False) -> int:
    """fp32 workspace slots of an [M, K] bf16 x's fp16 rows (not `fragments`) and factors (bf16_rows_slices),
    whole 16-byte units: what follows in the workspace (x fragments) stays 16-byte aligned."""
    return -(-bf16_rows_slices(m, k, fragments)[1].stop // 4) * 4


def bf16_rows_slices(m: int, k: int, fragments: bool = False) -> tuple[slice, slice]:
    """Where the fp16 rows (empty with `fragments`) and the factors lie in the fp32 workspace: the rows first,
    8-byte aligned as the kernels load them."""
    rows = 0 if fragments else m * k // 2
    return slice(0, rows), slice(rows, rows + m)


def queue_bf16_rows(x: CupyArray, workspace: CupyArray, fragments: CupyArray | None = None
                    ) -> tuple[CupyArray, CupyArray]:
    """Queue qpn_x_bf16_rows on bf16 bits x [M, K] (K % 4 == 0, 8-byte aligned) into the first
    bf16_rows_elements(M, K, fragments is not None) slots of the fp32 `workspace` -> (x16, factor fp32 [M]),
    views of it: x16 fp16 [M, K], or with `fragments` (workspace.fragment_elements(M, K) fp32 slots) the
    values in the fragment order there, and x16 is `fragments`."""
    m, k = x.shape
    rows, factors = bf16_rows_slices(m, k, fragments is not None)
    factor = workspace[factors]
    if fragments is None:
        x16 = workspace[rows].view(np.float16).reshape(m, k)
        blocks, nb2 = m, 0
    else:
        x16, nb2 = fragments, -(-m // (2 * TOKENS_PER_BLOCK))
        blocks = 2 * TOKENS_PER_BLOCK * nb2
    kernel(X_BF16_ROWS)((blocks,), (_THREADS,), (x, x16, factor, np.int32(m), np.int32(k), np.int32(nb2)))
    return x16, factor
