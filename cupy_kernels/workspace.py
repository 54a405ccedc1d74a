"""A decode, GEMM or MoE call's workspace (cupy_kernels/linear.py, gemm.py, moe.py share it): the x
fragments, the split-K partial sums and arrival tickets, and the rules of their sizes. One fp32 array per call, from
the caller (torch's allocator under CUDA-graph capture: decode_workspace_size / gemm_workspace_size
give its size) or allocated here.
"""

from __future__ import annotations

import numpy as np

from ..ref.geometry import GROUP_K, TILE_N
from ._validate import CupyArray, require_cupy
from .loader import kernel
from .variants import KernelVariant

TOKENS_PER_BLOCK = 8  # tokens per mma n8 block
X_FRAGMENTS = KernelVariant("x_fragments.cu", "qpn_x_fragments", archs=("sm_75",))
KERNEL_VARIANTS = (X_FRAGMENTS,)


def rows_of_codes(codes: CupyArray, k: int, bytes_per_k: float) -> int:
    """N from a prepacked code buffer ([N, K*bytes_per_k] as prepack returns it, or flat)."""
    require_cupy("codes", codes, np.uint8)
    row = int(k * bytes_per_k)
    if codes.ndim == 2:
        return codes.shape[0]
    if codes.ndim != 1 or codes.size % row:
        raise ValueError(
            f"codes must be [N, {row}] (as the prepack returns it for K={k}) or flat with a multiple of "
            f"{row} bytes, got shape {tuple(codes.shape)}; pass the buffers prepacked for this layer"
        )
    return codes.size // row


def gated_rows(n: int, gated: bool) -> int:
    if not isinstance(gated, (bool, np.bool_)):
        raise ValueError(f"gated must be a bool, got {type(gated).__name__}")
    if gated and n % (2 * TILE_N):
        raise ValueError(
            f"gated=True needs N/2 % 32 == 0 (gate rows [0, N/2) and up rows [N/2, N) in whole tiles), "
            f"got N={n}; pad each half to a multiple of 32 rows"
        )
    return n // 2 if gated else n


# Split-K state lives in the call's workspace, nothing outlives a call: the fp32 partial sums
# [parts][gated ? 2 : 1][M][columns], then one uint32 arrival counter ("ticket") per output tile, zeroed
# by a memset on the call's stream just before the launch (the MoE call: by its route kernel). Stream
# order makes a workspace safe to reuse as soon as the launch is queued (the caching allocator hands it
# out again only in stream order), so any number of streams, concurrent or not, and CUDA-graph capture
# (the memset becomes a graph node) need no shared table. Cost: one memset of N/32 * 4 bytes per split-K
# call, measured on the H200 at +2 us on 5120x17408 (M=1: QPN2 33.8 -> 35.8 us, QPN8 34.0 -> 35.8 us;
# benchmarks/results/splitk_streams_h200.md), +0.1 us on 4096x14336; split-K itself saved 7-11 us.


def partial_elements(parts: int, m: int, n: int, gated: bool) -> int:
    return parts * (2 if gated else 1) * m * gated_rows(n, gated)


def fragment_elements(m: int, k: int) -> int:
    """fp32 slots of the x fragments (x_fragments.cu) of an [M, K] x: 16 bytes per lane, group and
    pair of 8-token blocks."""
    return k // GROUP_K * -(-m // (2 * TOKENS_PER_BLOCK)) * 32 * 4


def split_k_elements(parts: int, m: int, n: int, gated: bool) -> tuple[int, int]:
    """fp32 slots of a call's split-K state: (partial sums, N/32 arrival tickets); none for one part."""
    return (partial_elements(parts, m, n, gated), n // TILE_N) if parts > 1 else (0, 0)


def zeroed_tickets(tickets: CupyArray) -> CupyArray:
    """The split-K arrival tickets, zeroed on the call's stream (module comment above)."""
    import cupy  # noqa: PLC0415

    tickets = tickets.view(np.uint32)
    cupy.cuda.runtime.memsetAsync(tickets.data.ptr, 0, tickets.nbytes, cupy.cuda.get_current_stream().ptr)
    return tickets


def queue_x_fragments(x: CupyArray, out: CupyArray) -> None:
    """Queue qpn_x_fragments: x [M, K] -> out, the decode kernels' fragment order (x_fragments.cu)."""
    m, k = x.shape
    nb2 = -(-m // (2 * TOKENS_PER_BLOCK))
    threads = k // GROUP_K * nb2 * 32
    kernel(X_FRAGMENTS)((min(-(-threads // 256), 1024),), (256,), (x, out, np.int32(m), np.int32(k), np.int32(nb2)))


def call_workspace(workspace: CupyArray | None, size: int, sizer: str) -> CupyArray:
    """The call's fp32 workspace of `size` elements: the caller's (checked; `sizer` names the function
    that gives the size) or a fresh one."""
    import cupy  # noqa: PLC0415

    if workspace is None:
        return cupy.empty(size, dtype=np.float32)
    require_cupy("workspace", workspace, np.float32)
    if workspace.size < size or not workspace.flags.c_contiguous:
        raise ValueError(
            f"workspace must be a C-contiguous float32 array of >= {size} elements for this call "
            f"({sizer}), got shape {tuple(workspace.shape)}; allocate a larger one"
        )
    return workspace
