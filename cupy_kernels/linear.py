"""The decode path: y = x @ W16^T for M in [1, 32] tokens, straight from QPN2 / QPN8 buffers.

- `qpn2_linear(x, codes, scales, global_scale, out=None, gated=False)`
- `qpn8_linear(x, codes, group_scales, out=None, gated=False)`

x: fp16 [M, K] CuPy (C-contiguous); codes / scales / group_scales as qpn2_prepack / qpn8_prepack
return them; global_scale: float32 scalar or one value per 32-column tile ([N/32]), host or
CuPy. Returns fp16 [M, N] (or `out`); with `gated=True` the weight stacks gate rows [0, N/2) and
up rows [N/2, N) and the result is fp16 [M, N/2] = silu_and_mul(gate, up)
(docs/DESIGN.md, "Gated epilogue").

Numerics (docs/DESIGN.md, "Numerics contract"): the weights are exactly the contract's W16 (the
same values the dequantize kernels write), products are exact, accumulation is fp32 (tensor
cores), one RN16 at the end. Batch invariance: row i of an M-row call equals row i computed
alone, bit for bit, for every M in [1, 32] -- the K split (`split_k`) depends on N, K and the SM
count only, and every output element goes through the same fp32 operations whatever M is.

No validation of the data here (it is the per-token hot path, and a value check would cost a
host sync): validate weights once at load time (prepack, or dequantize with check=True).
Shapes, dtypes, devices, contiguity and alignment are checked on every call. Launches go to the
current CuPy stream. Kernel design and measured numbers: cupy_kernels/qpn2_linear.cu.
"""

from __future__ import annotations

import math

import numpy as np

from ..ref.checks import require_multiple
from ..ref.formats import FORMAT_NAMES, QPN2, QPN8, QPN8_BLOCK, QPNMX, WeightFormat
from ..ref.geometry import GROUP_K, TILE_N
from ._validate import CupyArray, output_array, require_aligned
from .bf16 import bf16_rows_elements, is_bf16, queue_bf16_rows, require_activations
from .dequantize import (
    prepare_qpn2,
    prepare_qpn8,
    qpn8_group_scales_format,
    qpn8_strides,
)
from .loader import RawKernel, kernel
from .variants import KernelVariant
from .workspace import (
    TOKENS_PER_BLOCK,
    call_workspace,
    fragment_elements,
    gated_rows,
    queue_x_fragments,
    rows_of_codes,
    split_k_elements,
    zeroed_tickets,
)

MAX_M = 32  # the decode kernels' token limit (4 tensor-core n8 blocks)
# Split-K (split_k): K-slices per tile, one warp each, summed in a fixed order -- in shared memory
# inside a block, across blocks for layers with few tiles -- chosen from N, K and the GPU's SM
# count, never from M. About TARGET_WARPS warps in all (the H200 holds 132 SMs x 32 of these
# warps; a T4, 40 x 32), MIN_WARPS..MAX_WARPS per block, at least MIN_GROUPS_PER_WARP 16-k groups
# per warp (shorter slices spend more of their time in the reduction). Measured on the H200,
# M = 1 (bench_decode.py "variants"): 28672x8192 QPN8 split 2/4/8/16: 67.2 / 79.9 / 86.5 / 81.6 %
# of the read ceiling; 34816x5120 QPN8 4 / 8 warps per tile: 68.1 / 76.6 %.
TARGET_WARPS = 4096
MAX_WARPS = 16
MIN_WARPS = 8
MAX_PARTS = 4  # blocks per tile (split-K across blocks)
MIN_GROUPS_PER_WARP = 8
# The load batches (qpn_mma.cuh, qpn_run_batches) per (format, 8-token blocks, gated): (groups per
# batch, blocks of MAX_WARPS warps per SM the registers must allow: 2 = 64 registers). Measured on
# the H200 (bench_decode.py "variants" and "mid"; results/decode_h200.md, results/decode_m32_explore):
# M <= 8: QPN2 4 groups at 2 blocks/SM 40.1 % of the read ceiling against 35.3 at 1 (111
# registers); QPN8 at 2 blocks/SM (the build needs 64-68 registers otherwise, and 68 leave one
# block): 5120x17408 46.6 -> 36.1 us, 28672x8192 64.6 -> 61.9 us.
# M = 9-16, x fragments, 64 registers: 28672x8192 QPN2 81.3 -> 76.4 us (2 groups: 4 spill on
# sm_75), QPN8 80.7 -> 71.9 (4 groups); 5120x17408 54.2 -> 44.6 / 53.5 -> 42.3.
# M = 17-24: QPN8 2 groups at 64 registers 93.2 -> 85.7 us (28672x8192), 63.6 -> 48.0 (5120x17408);
# QPN2 keeps 4 groups at 1 block (2 groups at 64 registers spill on sm_75).
# M = 25-32: 4 groups at 1 block/SM (108-116 registers); 2 groups at 64 registers spill, and
# 1 group at 64: 100 -> 121 us (QPN2, 28672x8192).
# QPN8 with 128x128 block scales (a scale load per group-tile) spills where the channel build
# does not: one group less per batch at 64 registers (not measured separately).
# Gated builds hold two tiles' accumulators: fewer groups per batch keep them free of spills.
PIPELINE = {
    **{(QPN2.key, nb, False): {1: (4, 2), 2: (2, 2), 3: (4, 1), 4: (4, 1)}[nb] for nb in (1, 2, 3, 4)},
    **{(QPN8.key, nb, False): {1: (4, 2), 2: (4, 2), 3: (2, 2), 4: (4, 1)}[nb] for nb in (1, 2, 3, 4)},
    **{(QPN8_BLOCK.key, nb, False): {1: (4, 2), 2: (2, 2), 3: (1, 2), 4: (4, 1)}[nb] for nb in (1, 2, 3, 4)},
    **{(wf.key, nb, True): (2 if nb <= 2 else 1, 1) for wf in (QPN2, QPN8, QPN8_BLOCK) for nb in (1, 2, 3, 4)},
}


def pipeline_macros(unroll: int, min_blocks: int) -> tuple[tuple[str, str], ...]:
    return (("QPN_MIN_BLOCKS", str(min_blocks)), ("QPN_UNROLL", str(unroll)))


X_BATCH = {QPN2.key: 1, QPN8.key: 0}  # when a batch's x is loaded: qpn_mma.cuh, QPN_X_BATCH (measured)
# Builds that read x as fragments (x_fragments.cu, qpn_mma.cuh QPN_X_FRAG) per (format, 8-token
# blocks): M > 8. Measured on the H200, M = 32 (results/decode_m32_explore): 28672x8192 QPN2
# 130 -> 100 us, QPN8 118 -> 98 us; 34816x5120 103 -> 86 / 97 -> 82. At M <= 8 the rows of x
# are as good (the clamped rows of M = 1 read 32 bytes per group) and need no extra launch.
X_FRAG = {(wf.key, nb): nb >= 2 for wf in (QPN2, QPN8) for nb in (1, 2, 3, 4)}


def decode_macros(key: str, nb: int, gated: bool, block_scales: bool = False, moe: bool = False,
                  pipeline: tuple[int, int] | None = None) -> tuple[tuple[str, str], ...]:
    """The build of a decode kernel of layout `key` (QPN2.key | QPN8.key | QPNMX.key: QPN2's kernel with
    e8m0 scales), 8 * nb tokens, gated or not; moe: the stacked-experts build (moe.py), which reads x rows
    through the route (no fragments); pipeline: (groups per batch, blocks per SM) in place of PIPELINE's
    (the order of the sums is the same)."""
    mx = key == QPNMX.key
    key = QPN2.key if mx else key  # the kernel family: its pipelines and x source
    family = QPN8_BLOCK.key if block_scales else key
    return tuple(sorted((
        *pipeline_macros(*(pipeline or PIPELINE[family, nb, gated])),
        ("QPN_X_BATCH", str(X_BATCH[key])),
        ("QPN_X_FRAG", str(int(X_FRAG[key, nb] and not moe))),
        *((("QPN_MOE", "1"),) if moe else ()),
        *((("QPN_MX", "1"),) if mx else ()),
        ("QPN_GATED", str(int(gated))),
        ("QPN_NB", str(nb)),
        ("QPN_WARPS", str(MAX_WARPS)),
        *((("QPN8_BLOCK_SCALES", str(int(block_scales))),) if key == QPN8.key else ()),
    )))


_BLOCKS = range(1, MAX_M // TOKENS_PER_BLOCK + 1)
# ptxas gives every shfl.sync a fallback subroutine for divergent warps (never taken here: all
# shuffles sit in warp-uniform control flow); in some builds that subroutine saves one register
# in an 8-byte stack slot. That is the only local memory these kernels may have.
FALLBACK_STACK_BYTES = 16
QPN2_LINEAR = {
    (nb, gated): KernelVariant("qpn2_linear.cu", "qpn2_linear", decode_macros(QPN2.key, nb, gated), archs=("sm_75",),
                               max_stack_bytes=FALLBACK_STACK_BYTES)
    for gated in (False, True)
    for nb in _BLOCKS
}
QPN8_LINEAR = {
    (nb, gated, block): KernelVariant(
        "qpn8_linear.cu", "qpn8_linear", decode_macros(QPN8.key, nb, gated, block), archs=("sm_75",),
        max_stack_bytes=FALLBACK_STACK_BYTES,
    )
    for block in (False, True)
    for gated in (False, True)
    for nb in _BLOCKS
}
DECODE_VARIANTS = (*QPN2_LINEAR.values(), *QPN8_LINEAR.values())
KERNEL_VARIANTS = DECODE_VARIANTS


def split_k(n_tiles: int, groups: int, multiple: int, sms: int) -> tuple[int, int, int]:
    """(blocks per tile, warps per block, groups per warp) for N/32 tiles and K/16 groups on a GPU
    of `sms` SMs (0: one block per tile). Never depends on M (batch invariance).

    Warps per block: about TARGET_WARPS K-slices in all (a power of two per tile), at least
    MIN_WARPS and at most MAX_WARPS, each slice >= MIN_GROUPS_PER_WARP groups. Blocks per tile
    ("parts", summed across blocks in a fixed order: qpn_reduce_store) only for layers of fewer
    than 2 tiles per SM, where the block scheduler cannot balance the SMs: the parts that minimise
    ceil(parts * tiles / SMs) / parts, the busiest SM's share of the layer with one block per SM
    at a time (16 warps saturate an H200 SM on these loops: 4096x4096, 128 tiles on 132 SMs, ran
    8.1 us with 1 part, 9.4 us with 2); the fewest parts on ties. Measured on the H200 (M = 1,
    5120x17408, 160 tiles): QPN2 44.3 / 38.6 / 34.9 us with 1 / 2 / 4 parts, QPN8 39.7 / 33.9 /
    33.8. groups_per_warp is rounded up to a multiple of `multiple` (the load batch): when
    `groups` is a multiple of it too (QPN2), no warp loads a partial batch.
    """
    want = 1 << math.ceil(math.log2(-(-TARGET_WARPS // max(1, n_tiles))))  # K-slices per tile
    split = max(1, min(MAX_WARPS, max(MIN_WARPS, want), groups // MIN_GROUPS_PER_WARP))
    parts = 1
    if 0 < n_tiles < 2 * sms:
        fits = [p for p in range(1, MAX_PARTS + 1) if p == 1 or p * split * MIN_GROUPS_PER_WARP <= groups]
        parts = min(fits, key=lambda p: (-(-p * n_tiles // sms) / p, p))
    return split_in_parts(groups, parts, split, multiple)


def split_in_parts(groups: int, parts: int, split: int, multiple: int) -> tuple[int, int, int]:
    """split_k's (parts, warps per block, groups per warp) for `parts` blocks of `split` K-slices: the groups per
    warp rounded up to whole load batches (`multiple`), and the parts and warps that then hold groups."""
    groups_per_warp = -(-groups // (parts * split))
    groups_per_warp = -(-groups_per_warp // multiple) * multiple
    slices = -(-groups // groups_per_warp)  # the slices that hold groups
    split = -(-slices // parts)
    return -(-slices // split), split, groups_per_warp


_SMS: dict = {}  # device id -> multiprocessor count


def decode_split(format: str, n: int, k: int) -> tuple[int, int, int]:
    """split_k for an [N, K] weight of format "nvfp4" | "fp8" on the current CuPy device."""
    import cupy  # noqa: PLC0415

    family = require_family(format)
    device = cupy.cuda.Device()
    if device.id not in _SMS:
        _SMS[device.id] = device.attributes["MultiProcessorCount"]
    return split_k(n // TILE_N, k // GROUP_K, SLICE_MULTIPLE[family.key], _SMS[device.id])


def decode_threshold(format: str, n: int, k: int) -> int:
    """Largest M the decode kernels take for an [N, K] weight of format "nvfp4" | "fp8": MAX_M.

    Which path serves an M is the dispatch policy's choice (torch_bridge/dispatch.py, from the
    measured table of the device family); this is only the kernels' range. Measured on the H200
    (benchmarks/results/decode_h200.md): at every M <= 32 and on every benchmark shape the decode
    kernel beats dequantize-then-cuBLAS, by 1.6x to 11x. Pure host arithmetic.
    """
    require_family(format)
    if n <= 0 or k <= 0:
        raise ValueError(f"n and k must be positive, got n={n}, k={k}")
    return MAX_M


def decode_activation(x: CupyArray, wf: WeightFormat, dense: str) -> tuple[int, int]:
    require_activations("x", x)
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(
            f"x has M={m} rows; the {wf.label} decode kernel handles M in [1, {MAX_M}]: "
            f"use {dense} (the prefill path) for larger M"
        )
    require_multiple("K", k, wf.k_multiple, wf.label, wf.k_fix)
    require_x_aligned(x)
    return m, k


def require_x_aligned(x: CupyArray) -> None:
    require_aligned("x", x, 8)  # 8-byte loads of 4 consecutive k


# groups_per_warp multiple per format, the same for every M and gated or not (batch invariance):
# QPN2's K % 64 == 0 makes every K-slice whole batches of up to 4 groups (no pad groups; every
# QPN2 build's batch divides it: tests/test_decode_split.py).
SLICE_MULTIPLE = {QPN2.key: QPN2.k_multiple // GROUP_K, QPN8.key: 1}


def decode_workspace_size(format: str, m: int, n: int, k: int, gated: bool = False, bf16: bool = False) -> int:
    """fp32 elements of the workspace qpn2_linear / qpn8_linear need for this call (0: none); bf16: x is bf16.

    Pass a workspace of at least this size (`workspace=`) where allocations must come from the
    caller (torch's allocator under CUDA-graph capture); without one the wrappers allocate it. It
    holds bf16 x's fp16 rows (cupy_kernels/bf16.py), the call's x fragments (M > 8), split-K partial sums and
    arrival counters; it may be
    reused by the next call on the same stream (or freed to the caching allocator) once this one
    is queued.
    """
    family = require_family(format)
    x_frag = X_FRAG[family.key, -(-m // TOKENS_PER_BLOCK)]
    frag = fragment_elements(m, k) if x_frag else 0
    rows = bf16_rows_elements(m, k, x_frag) if bf16 else 0
    return rows + frag + sum(split_k_elements(decode_split(format, n, k)[0], m, n, gated))


def require_family(format: str) -> WeightFormat:
    """The kernel family (QPN2 or QPN8: its split and x source) of the public format name "nvfp4" | "fp8" |
    "mxfp4" (QPN2's kernel with e8m0 scales)."""
    family = {QPN2.format: QPN2, QPN8.format: QPN8, QPNMX.format: QPN2}.get(format)
    if family is None:
        raise ValueError(f"format must be one of {FORMAT_NAMES}, got {format!r}")
    return family


def team_of(defines: tuple[tuple[str, str], ...]) -> int:
    """QPN_TEAM of a build's macros (qpn_mma.cuh): the warps that share a K-slice's (GEMM: a tile's) decode."""
    return int(dict(defines).get("QPN_TEAM", "1"))


def tiles_per_warp(defines: tuple[tuple[str, str], ...]) -> int:
    """Tiles each warp of a build multiplies (qpn_mma.cuh, QPN_HT): 2 gated or paired (QPN_PAIR), else 1."""
    d = dict(defines)
    return 2 if d.get("QPN_GATED") == "1" or d.get("QPN_PAIR") == "1" else 1


def team_shared_bytes(defines: tuple[tuple[str, str], ...], warps: int) -> int:
    """Dynamic shared memory of a launch of `warps` warps of the build of `defines` (decode or GEMM): its team
    slots (QPN_TEAM > 1; qpn_team_a), 1 KiB per warp and tile it multiplies (tiles_per_warp); 0 without teams."""
    return warps * tiles_per_warp(defines) * 1024 if team_of(defines) > 1 else 0


def launch_decode(family: WeightFormat, fn: RawKernel, weights: tuple[CupyArray, ...], x: CupyArray, y: CupyArray,
                  n: int, gated: bool, workspace: CupyArray | None, x_frag: bool,
                  defines: tuple[tuple[str, str], ...]) -> None:
    """Queue one decode call: bf16 x's fp16 rows (cupy_kernels/bf16.py), the x fragments (x_frag: the build
    reads them), the split-K tickets' reset, and the kernel `fn` with the split (decode_split) and its grid;
    `weights` are the format's leading kernel arguments; defines: the build's macros (a QPN_TEAM build,
    team_of: split x team warps per block and its team slots).

    The split follows the weight's tile count, gated or not: the gated kernel then sums every tile
    exactly as the plain kernel does (its gate / up values equal the plain call's, bit for bit).
    """

    m, k = x.shape
    parts, split, groups_per_warp = decode_split(family.format, n, k)
    partial_size, ticket_count = split_k_elements(parts, m, n, gated)
    rows = bf16_rows_elements(m, k, x_frag) if is_bf16(x) else 0
    frag = fragment_elements(m, k) if x_frag else 0
    size = rows + frag + partial_size + ticket_count
    x_arg, partial, tickets, x_factor = x, np.uint64(0), np.uint64(0), np.uint64(0)
    if size:
        workspace = call_workspace(workspace, size, "decode_workspace_size")
        frags = workspace[rows:rows + frag] if frag else None
        if rows:  # bf16: its fp16 rows, or straight into the fragments
            x_arg, x_factor = queue_bf16_rows(x, workspace[:rows], frags)
        elif frag:
            x_arg = frags
            queue_x_fragments(x, frags)
        if parts > 1:
            partial = workspace[rows + frag:rows + frag + partial_size]
            tickets = zeroed_tickets(workspace[rows + frag + partial_size:size])
    grid = (n // TILE_N // (2 if gated else 1), parts)
    tail = (np.int32(m), np.int32(n), np.int32(k), np.int32(groups_per_warp), partial, tickets, x_factor)
    warps = split * team_of(defines)
    fn(grid, (32 * warps,), (*weights, x_arg, y, *tail), shared_mem=team_shared_bytes(defines, warps))


def qpn2_linear(x: CupyArray, codes: CupyArray, scales: CupyArray, global_scale: float | np.ndarray | CupyArray,
                out: CupyArray | None = None, gated: bool = False, workspace: CupyArray | None = None) -> CupyArray:
    """y = x @ W16^T for a QPN2 (NVFP4) weight, M in [1, 32] (module docstring).

    x: fp16 [M, K], K % 64 == 0; codes uint8 [N, K/2] or flat; scales uint8 [N, K/16] or flat;
    global_scale float32 scalar or [N/32]. Returns fp16 [M, N] ([M, N/2] when gated).
    workspace: optional float32 CuPy array for split-K layers (decode_workspace_size).
    """
    # validate (shapes, dtypes, devices, alignment) -> allocate -> grid/block -> launch
    m, k = decode_activation(x, QPN2, "qpn2_dense_linear")
    n = rows_of_codes(codes, k, QPN2.code_bits / 8)
    n, k, g, g_stride = prepare_qpn2(codes, scales, global_scale, n, k)  # N's rule first
    y = output_array(out, (m, gated_rows(n, gated)), x.dtype)
    launch_qpn2_decode(x, codes, scales, g, g_stride, n, y, gated, workspace)
    return y


def launch_qpn2_decode(x: CupyArray, codes: CupyArray, scales: CupyArray, g: CupyArray, g_stride: int, n: int,
                       y: CupyArray, gated: bool, workspace: CupyArray | None) -> None:
    nb = -(-x.shape[0] // TOKENS_PER_BLOCK)
    variant = QPN2_LINEAR[nb, bool(gated)]
    launch_decode(QPN2, kernel(variant), (codes, scales, g, np.int32(g_stride)), x, y, n, gated, workspace,
                  X_FRAG[QPN2.key, nb], variant.defines)


def qpn8_linear(x: CupyArray, codes: CupyArray, group_scales: CupyArray, out: CupyArray | None = None,
                gated: bool = False, workspace: CupyArray | None = None) -> CupyArray:
    """y = x @ W16^T for a QPN8 (FP8) weight, M in [1, 32] (module docstring).

    x: fp16 [M, K], K % 16 == 0 (128x128 block scales: K % 128 == 0); codes uint8 [N, K] or flat;
    group_scales fp16 [1, N] (channel / tensor) or [K/128, N/32] (block). Returns fp16 [M, N]
    ([M, N/2] when gated). workspace: as qpn2_linear.
    """
    m, k = decode_activation(x, QPN8, "qpn8_dense_linear")
    n = rows_of_codes(codes, k, QPN8.code_bits / 8)
    n, k, _ = prepare_qpn8(codes, group_scales, n, k)  # N's rule first
    wf = qpn8_group_scales_format(group_scales.shape, n, k)
    require_group_scales_aligned(group_scales, wf)
    y = output_array(out, (m, gated_rows(n, gated)), x.dtype)
    launch_qpn8_decode(x, codes, group_scales, wf, n, y, gated, workspace)
    return y


def require_group_scales_aligned(group_scales: CupyArray, wf: WeightFormat) -> None:
    if wf is QPN8:
        require_aligned("group_scales", group_scales, 8)  # 8-byte loads of a quad's 4 scales


def launch_qpn8_decode(x: CupyArray, codes: CupyArray, group_scales: CupyArray, wf: WeightFormat, n: int,
                       y: CupyArray, gated: bool, workspace: CupyArray | None) -> None:
    kb_stride = qpn8_strides(wf, n)[0]
    nb = -(-x.shape[0] // TOKENS_PER_BLOCK)
    variant = QPN8_LINEAR[nb, bool(gated), wf is QPN8_BLOCK]
    launch_decode(QPN8, kernel(variant), (codes, group_scales, np.int32(kb_stride)), x, y, n, gated, workspace,
                  X_FRAG[QPN8.key, nb], variant.defines)
