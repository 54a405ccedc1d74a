"""The fused mixture-of-experts decode (issue 22): E experts of one layout stacked along a leading dimension,
routed tokens in, the weighted top-k sum out, in chunks of ROUTE_LIMIT // top_k tokens (one route each),
2 + 2 * (classes present) launches per chunk on the current stream with no host sync (CUDA-graph
capturable; docs/DESIGN.md, "Mixture of experts"):

1. qpn_moe_route (moe_route.cu): the top-k ids -> the route (qpn_moe.cuh): the choices sorted by expert
   into slots, each expert's slot range cut into pieces of MAX_M = 32 rows, the pieces by class (their
   count of 8-token blocks: full pieces are class 3); it also zeroes the split-K tickets of the launches
   below.
2. gate/up: the decode kernels' MoE build (QPN_MOE = 1), gated, one launch per class c that the chunk can
   hold, with the build of c + 1 token blocks (or passes of a smaller build: CLASS_PASSES), grid
   (class_blocks x passes, parts, output tiles), fixed by (E, M, top_k): a block finds its expert and
   piece in the route, reads that expert's weight tiles once for the piece's tokens (x rows through the
   route) and writes h = silu_and_mul(gate, up) (or swigluoai, below) to their slots; the pieces of one
   expert are neighbours in the grid, so they read each tile at the same time (from DRAM once). Blocks
   without a piece exit before any load: the experts nobody hits are never read.
3. down: the same builds, not gated, on the slot-ordered h -> y per slot (fp16).
4. qpn_moe_combine: y weighted and summed per token in top-k order, one RN16 (qpn.ref.moe.combine).

Epilogue (launch_moe's keyword arguments, kernel arguments of the same builds: docs/DESIGN.md, "gpt-oss
experts"): optional fp32 biases, w13_bias [E, 2I] (gate rows, then up) and w2_bias [E, H], each added to its
output's fp32 sum (MXFP4: after the exact 2^T) with one RN32 before the one RN16; the gated activation
"silu" (silu_and_mul, the default) or "swigluoai" (gpt-oss's clamped SwiGLU, qpn.ref.gpt_oss.swigluoai_and_mul
op for op, alpha and limit as fp32 arguments). Without biases and with "silu" the bits are the bias-free ones.

Numerics: each expert's two linears run the dense decode kernels' own code and split (decode_split: from
N, K and the SM count), so every slot's h and y equal, bit for bit, the dense decode kernels' rows for
that expert and token (tests/test_cupy_moe.py; with a bias or swigluoai, the same fp32 sums through the
epilogue above: tests/test_cupy_moe_bias.py), whatever the counts, the piece or the chunk: a token's
output never depends on the other tokens of the call or on the experts they hit.

Limits (require_routable): E <= ROUTE_LIMIT and MAX_M * top_k <= ROUTE_LIMIT (the route kernel is one
block, a thread per expert and one per choice); ids outside [0, E) add no term (the convention of vLLM's
expert maps, -1 for an expert not held here); a token's ids are a top-k, distinct.
"""

from __future__ import annotations

import functools

import numpy as np

from ..ref.formats import QPN2, QPN8, QPN8_BLOCK, QPNMX, WeightFormat
from ..ref.geometry import TILE_N
from ..ref.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT
from ._validate import CupyArray, require_aligned, require_cupy
from .bf16 import bf16_rows_elements, is_bf16, queue_bf16_rows
from .layouts import Buffers, LayoutKernels
from .linear import FALLBACK_STACK_BYTES, MAX_M, decode_macros, decode_split, require_x_aligned
from .loader import kernel
from .variants import KernelVariant
from .workspace import TOKENS_PER_BLOCK, call_workspace, gated_rows, partial_elements

MOE_CLASSES = MAX_M // TOKENS_PER_BLOCK  # token classes: the 8-token blocks of the largest build
PIECE_ROWS = MAX_M  # an expert's slots are cut into pieces of the largest build's rows
ROUTE_LIMIT = 1024  # the route kernel's threads: most experts, and most choices M * top_k, per chunk
COMBINE_THREADS = 256  # two columns each
ACTIVATIONS = ("silu", "swigluoai")  # the gated epilogues; the kernels' activation argument is the index
                                     # (qpn_mma.cuh: QPN_ACT_SILU 0, QPN_ACT_SWIGLUOAI 1)

# The decode builds over stacked experts, per (layout key, 8-token blocks, gated): the dense builds with x
# read as rows through the route. Row pointers (2 registers per 8-token block) and the route's arguments
# cost registers the fragment builds do not; where a dense pipeline then spills on sm_75 (compile_check),
# the MoE build takes the one below, the first of (2, 2), (1, 2), (4, 1) without a spill (the order of
# every sum is the same; the speed of these is not measured separately; tests/test_turing_compile.py):
MOE_PIPELINE = {
    (QPN2.key, 2, False): (4, 1),  # (2, 2): 40 bytes spilled; (4, 1): 112 registers
    (QPNMX.key, 2, False): (4, 1),  # QPN2's kernel: the same
    (QPN8.key, 2, False): (1, 2),  # (4, 2): 44; (2, 2): 8
    (QPN8.key, 3, False): (4, 1),  # (2, 2): 76; (1, 2): 28
    (QPN8_BLOCK.key, 1, False): (2, 2),  # (4, 2): 12
    (QPN8_BLOCK.key, 2, False): (4, 1),  # (2, 2) and (1, 2): 20
    (QPN8_BLOCK.key, 3, False): (4, 1),  # (1, 2): 48
}
# ... and where no pipeline fits 128 registers (FP8 gated at 32 tokens: 8-16 bytes spilled even at 1
# group per batch), the class runs as passes of a smaller build, each a block reading the expert's tiles
# (per pass rows independent of each other: the same bits): {(layout key, gated): {class: (nb, passes)}}
CLASS_PASSES = {(QPN8.key, True): {3: (2, 2)}, (QPN8_BLOCK.key, True): {3: (2, 2)}}
# the constants the kernels share with this module (qpn_moe.cuh, moe_route.cu), stated here only
_ROUTE_MACROS = (("QPN_MOE_CLASSES", str(MOE_CLASSES)), ("QPN_ROUTE_THREADS", str(ROUTE_LIMIT)))
ROUTE = KernelVariant("moe_route.cu", "qpn_moe_route", _ROUTE_MACROS, archs=("sm_75",))
COMBINE = KernelVariant("moe_route.cu", "qpn_moe_combine", _ROUTE_MACROS, archs=("sm_75",))


def class_build(key: str, gated: bool, cls: int) -> tuple[int, int]:
    """(8-token blocks of the build, passes) that class `cls` runs for layout `key`."""
    return CLASS_PASSES.get((key, gated), {}).get(cls, (cls + 1, 1))


def _expert_decode(wf: WeightFormat, nb: int, gated: bool) -> KernelVariant:
    family = QPN8 if wf in (QPN8, QPN8_BLOCK) else QPN2  # the kernel file: QPN8_BLOCK, QPNMX are builds
    macros = decode_macros(QPNMX.key if wf is QPNMX else family.key, nb, gated, wf is QPN8_BLOCK, moe=True,
                           pipeline=MOE_PIPELINE.get((wf.key, nb, gated)))
    return KernelVariant(f"{family.key}_linear.cu", f"{family.key}_linear", tuple(sorted((*macros, *_ROUTE_MACROS))),
                         archs=("sm_75",), max_stack_bytes=FALLBACK_STACK_BYTES)


EXPERT_DECODE = {
    (wf.key, nb, gated): _expert_decode(wf, nb, gated)
    for wf in (QPN2, QPN8, QPN8_BLOCK, QPNMX) for gated in (False, True)
    for nb in sorted({class_build(wf.key, gated, c)[0] for c in range(MOE_CLASSES)})
}
KERNEL_VARIANTS = (ROUTE, COMBINE, *EXPERT_DECODE.values())


def _queue_projection(launch: tuple, i: int, rows: int, slots: int, route: CupyArray, experts: int) -> None:
    """One projection of chunk [i, i + rows) (launch_moe's `launches` entry): bf16 x's fp16 rows first, then
    one launch per piece class the chunk can hold."""
    wf, n, k, gated, (parts, split, groups_per_warp), weights, src, dst, state, map_x, scale_stride, epilogue, \
        rows_space = launch
    source = src[i:i + rows] if map_x else src[:slots]  # gate/up: the chunk's tokens; down: its slots
    x_factor: object = np.uint64(0)  # null: fp16 x
    if rows_space is not None:
        source, x_factor = queue_bf16_rows(source, rows_space)
    for cls in range(MOE_CLASSES):
        z = class_blocks(cls, rows, experts, slots)
        if z == 0:
            continue
        nb, passes = class_build(wf.key, gated, cls)
        blocks = (z * passes, parts, gated_rows(n, gated) // TILE_N)
        kernel(EXPERT_DECODE[wf.key, nb, gated])(blocks, (32 * split,), (
            *weights, source, dst, np.int32(0), np.int32(n), np.int32(k), np.int32(groups_per_warp), *state,
            x_factor, route, np.int32(experts), np.int32(slots), np.int32(cls), np.int32(passes),
            np.int32(map_x), np.int64(scale_stride), *epilogue))


def require_routable(experts: int, top_k: int) -> None:
    """The route kernel's limits: one thread per expert and one per choice of a block of ROUTE_LIMIT
    threads, for chunks of at least MAX_M tokens."""
    if experts > ROUTE_LIMIT or MAX_M * top_k > ROUTE_LIMIT:
        raise ValueError(f"the fused MoE kernels route at most {ROUTE_LIMIT} experts and {ROUTE_LIMIT} choices per "
                         f"{MAX_M} tokens (top_k <= {ROUTE_LIMIT // MAX_M}), got E = {experts}, top_k = {top_k}; "
                         "split the experts across devices (expert parallelism) or run this layer on the CPU")


def route_size(experts: int, slots: int) -> int:
    """int32 elements of a chunk's route (qpn_moe.cuh, qpn_route_layout): offsets, slot tokens, choice
    slots, class counts, class lists (each: a remainder piece per expert, and the full pieces)."""
    return experts + 1 + 2 * slots + MOE_CLASSES * (1 + min(experts, slots) + slots // PIECE_ROWS)


@functools.lru_cache(maxsize=1024)
def class_blocks(cls: int, m: int, experts: int, slots: int) -> int:
    """The grid's piece extent for class `cls` (pieces of 8 cls + 1 .. 8 cls + 8 rows): the most such pieces
    M tokens with `slots` choices can make, never how many there are (0: the class cannot occur). An expert
    (at most M of the slots: a top-k never repeats an expert) has one remainder piece, so the classes below
    the top hold at most one piece per expert; the top class also holds the full pieces: with r experts
    holding a remainder (>= `lowest` slots each), the rest of the slots and each expert's M bound the full
    pieces."""
    lowest = TOKENS_PER_BLOCK * cls + 1
    if m < lowest:
        return 0
    remainders = min(experts, slots // lowest)
    if cls < MOE_CLASSES - 1:
        return remainders
    with_rest, without = (m - lowest) // PIECE_ROWS, m // PIECE_ROWS  # full pieces an expert can hold
    return max(r + min(r * with_rest + (experts - r) * without, (slots - lowest * r) // PIECE_ROWS)
               for r in range(remainders + 1))


def _projections(family_format: str, slots: int, h: int, inter: int, experts: int
                 ) -> tuple[tuple[int, int, bool, tuple[int, int, int], int, int], ...]:
    """(N, K, gated, split, partial sums, tickets) of gate/up and of down: the dense decode kernels' split
    (decode_split: parts, warps, groups per warp) and, where it splits K across blocks, the split-K state's
    sizes: the partial sums of every slot (workspace.partial_elements), one ticket per slot (a pass's first)
    and output tile (0, 0 for one part)."""
    out = []
    for n, k, gated in ((2 * inter, h, True), (h, inter, False)):
        split = decode_split(family_format, n, k)
        parts = split[0]
        state = (partial_elements(parts, slots, n, gated), slots * gated_rows(n, gated) // TILE_N)
        out.append((n, k, gated, split, *(state if parts > 1 else (0, 0))))
    return tuple(out)


def chunk_rows(m: int, top_k: int) -> int:
    """Tokens per route (launch sequence) of an M-token call: the most whose choices fill the route kernel's
    ROUTE_LIMIT threads; the route, hidden and y buffers hold this many tokens' choices. Larger chunks read
    each hit expert's weights fewer times (once per piece per chunk)."""
    return min(m, ROUTE_LIMIT // top_k)


def moe_workspace_size(family_format: str, m: int, top_k: int, h: int, inter: int, experts: int,
                       bf16: bool = False) -> int:
    """fp32 elements of an M-token call's workspace (one chunk's, reused by the next): both projections'
    partial sums, then their tickets (the route kernel zeroes them), then for bf16 x the fp16 rows of the
    chunk's x and of its hidden rows (bf16.py); 0 where neither splits K across blocks and x is fp16.
    Allocate it with the route (torch's allocator under graph capture)."""
    chunk = chunk_rows(m, top_k)
    rows = sum(_bf16_rows(chunk, top_k, h, inter)) if bf16 else 0
    return rows + sum(p + t for *_, p, t in _projections(family_format, chunk * top_k, h, inter, experts))


def _bf16_rows(chunk: int, top_k: int, h: int, inter: int) -> tuple[int, int]:
    """bf16 x: the workspace slots of each projection's fp16 rows (bf16.py): the chunk's x, its hidden rows."""
    return bf16_rows_elements(chunk, h), bf16_rows_elements(chunk * top_k, inter)


def require_epilogue(experts: int, h: int, inter: int, w13_bias: CupyArray | None, w2_bias: CupyArray | None,
                     activation: str, swiglu_alpha: float, swiglu_limit: float) -> tuple[int, np.float32, np.float32]:
    """The expert epilogue's arguments (module docstring, "Epilogue") -> (activation index, alpha, limit): the
    biases float32 C-contiguous [E, 2I] / [E, H] on the current device (or None), a known activation, finite
    swigluoai constants."""
    for name, bias, shape, rows in (("w13_bias", w13_bias, (experts, 2 * inter), "[E, 2I] (gate rows, then up)"),
                                    ("w2_bias", w2_bias, (experts, h), "[E, H]")):
        if bias is None:
            continue
        require_cupy(name, bias, np.float32, ndim=2)
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} must have shape {rows} = {shape}, one fp32 bias per expert and output row, got "
                             f"{tuple(bias.shape)}; stack the experts' biases along a leading E (gpt-oss's gate_up "
                             "bias de-interleaved first: qpn.ref.gpt_oss.deinterleave)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}; gpt-oss's experts use "
                         "'swigluoai', Mixtral's and Qwen3-MoE's 'silu'")
    alpha, limit = np.float32(swiglu_alpha), np.float32(swiglu_limit)
    if not (np.isfinite(alpha) and np.isfinite(limit) and limit >= 0):
        raise ValueError(f"swiglu_alpha must be finite and swiglu_limit finite and >= 0 (as fp32), got "
                         f"swiglu_alpha = {swiglu_alpha}, swiglu_limit = {swiglu_limit}; pass the model config's "
                         "swiglu_alpha / swiglu_limit (gpt-oss: 1.702, 7.0)")
    return ACTIVATIONS.index(activation), alpha, limit


def launch_moe(kernels: LayoutKernels, x: CupyArray, w13: Buffers, w2: Buffers, inter: int,
               topk_weights: CupyArray, topk_ids: CupyArray, route: CupyArray, workspace: CupyArray | None,
               hidden: CupyArray, y: CupyArray, out: CupyArray, *, w13_bias: CupyArray | None = None,
               w2_bias: CupyArray | None = None, activation: str = "silu", swiglu_alpha: float = SWIGLU_ALPHA,
               swiglu_limit: float = SWIGLU_LIMIT) -> None:
    """Queue the fused MoE decode (module docstring) over an M-token call in chunks of chunk_rows tokens (a
    token's bits do not depend on its chunk: rows never share a sum). The caller validated the metadata
    (torch_bridge/moe_ops.py): x fp16 or bf16 bits (int16: bf16.py) [M, H], M >= 1, w13 / w2 the layout's
    buffers stacked [E, ...] for [2I, H] / [H, I] weights, topk_weights fp32 and topk_ids int32 / int64
    [M, top_k], out [M, H] of x's dtype; one chunk's buffers, reused in stream order: route int32
    [route_size(E, S)], hidden [S, I] and y [S, H] of x's dtype with S = chunk_rows(M) * top_k, workspace
    fp32 [moe_workspace_size] (None: allocated here). bf16 x: each projection's input rows (the chunk's x,
    then its hidden rows) go through bf16.py's fp16 rows first, its epilogue and the combine round to bf16.
    The epilogue (module docstring, "Epilogue"; checked here, require_epilogue): w13_bias fp32 [E, 2I] (gate
    rows, then up) and w2_bias fp32 [E, H], None for no bias; activation "silu" | "swigluoai" with
    swiglu_alpha / swiglu_limit (default gpt-oss's, qpn.ref.gpt_oss)."""
    m, h = x.shape
    top_k = int(topk_ids.shape[1])
    chunk = chunk_rows(m, top_k)
    slots_max, experts = chunk * top_k, int(w13[0].shape[0])
    require_routable(experts, top_k)
    act, alpha, limit = require_epilogue(experts, h, inter, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit)
    require_x_aligned(x)
    require_aligned("hidden", hidden, 8)
    family = kernels.family
    projections = _projections(family.format, slots_max, h, inter, experts)
    partials, ticket_count = sum(p for *_, p, _ in projections), sum(t for *_, t in projections)
    bf16 = is_bf16(x)
    rows_sizes = _bf16_rows(chunk, top_k, h, inter) if bf16 else (0, 0)
    size = partials + ticket_count + sum(rows_sizes)
    space: CupyArray = call_workspace(workspace, size, "moe_workspace_size") if size else None
    tickets = np.uint64(0) if not ticket_count else space[partials:partials + ticket_count].view(np.uint32)
    launches = []  # per projection: its build's leading arguments, x source, output, split-K state, ...
    partial_at, ticket_at, rows_at = 0, 0, partials + ticket_count
    for (n, k, gated, splits, p_size, t_size), (buffers, src, dst, map_x, bias), rows_size in zip(
            projections, ((w13, x, hidden, 1, w13_bias), (w2, hidden, y, 0, w2_bias)), rows_sizes, strict=True):
        wf, weights, scale_stride = kernels.expert_weights(buffers, n, k)
        state: tuple[object, object] = (np.uint64(0), np.uint64(0))  # one part: no split-K state
        if t_size:  # t_size > 0 only where ticket_count gave a workspace
            state = (space[partial_at:partial_at + p_size], tickets[ticket_at:ticket_at + t_size])
        partial_at, ticket_at = partial_at + p_size, ticket_at + t_size
        rows_space = space[rows_at:rows_at + rows_size] if bf16 else None  # its input's fp16 rows
        rows_at += rows_size
        epilogue = (np.uint64(0) if bias is None else bias, np.int32(act), alpha, limit)  # null: no bias
        launches.append((wf, n, k, gated, splits, weights, src, dst, state, map_x, scale_stride, epilogue, rows_space))
    for i in range(0, m, chunk):
        rows = min(chunk, m - i)
        slots = rows * top_k
        kernel(ROUTE)((1,), (ROUTE_LIMIT,), (topk_ids[i:i + rows], np.int32(topk_ids.dtype == np.int64),
                                              np.int32(slots), np.int32(top_k), np.int32(experts), route, tickets,
                                              np.int32(ticket_count)))
        for launch in launches:
            _queue_projection(launch, i, rows, slots, route, experts)
        kernel(COMBINE)((-(-h // (2 * COMBINE_THREADS)), rows), (COMBINE_THREADS,), (
            y, topk_weights[i:i + rows], route, np.int32(experts), np.int32(slots), np.int32(top_k), np.int32(h),
            out[i:i + rows], np.int32(bf16)))
