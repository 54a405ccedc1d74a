"""The fused-dequantize GEMM for M = 33-512: the decode kernels built as a tiled GEMM (QPN_GEMM).

The weights are streamed once from their QPN2 / QPN8 bytes and decoded in registers to the
contract's exact W16 by the decode kernels' own code (qpn2_linear.cu, qpn8_linear.cu); what the
GEMM build changes is the work split and where x comes from (qpn_mma.cuh, "QPN_GEMM"):

- a block is GEMM_WARPS warps, each owning one 32-column tile (gated: a gate tile and its up
  tile), for 8 * nb tokens (nb = 8 plain, 4 gated: 64 fp32 accumulators per lane either way);
- the block stages each batch's x fragments (x_fragments.cu order) into shared memory once and
  all its tiles read them there: x crosses L2 -> SM once per 256 columns instead of once per 32;
- K is split across blocks into `parts` only to fill the GPU (gemm_split); the parts are added in
  a fixed order by the last block to arrive, as in the decode kernels;
- QPN8 above M = 64 and gated QPN2 / QPN8 above M = 32: team builds (qpn_mma.cuh, QPN_TEAM): 8 (gated
  M <= 64: 4) warps share each tile's decode through shared memory, each multiplying its own 16 tokens of
  two tiles (gated: gate and up; plain: tiles s and s + N/64), so one pass over the weight serves 128 (64)
  tokens instead of 64 (gated: 32). GEMM_TEAMS says why not QPN2's plain build; MXFP4 (mxfp4.py) has none.

Numerics: the contract's W16, fp32 accumulation in the tensor core (m16n8k8), one RN16 per output.
Batch invariance: each output is the fp32 sum over the part's groups in ascending order, then the
parts in ascending order; the split depends on N, K and the SM count only, and tokens never share
a sum, so a row gives the same bits in every GEMM call whatever M (and whichever build runs it: the
team builds add the same terms in the same order). It may differ from the same row
run through the decode kernels (M <= 32) in the last bits before rounding: those split K between
warps as well (decode_split), a different order of the same fp32 additions, within the contract's
bound (qpn.ref.linear_bounds). Keeping the decode order here would cost a second set of 64
accumulators per lane.
"""

from __future__ import annotations

import numpy as np

from ..ref.formats import QPN2, QPN8, QPN8_BLOCK, QPNMX, WeightFormat, weight_format
from ..ref.geometry import GROUP_K, TILE_N
from ._validate import CupyArray, output_array
from .bf16 import bf16_rows_elements, is_bf16, queue_bf16_rows, require_activations
from .dequantize import (
    prepare_qpn2,
    prepare_qpn8,
    qpn8_group_scales_format,
    qpn8_strides,
)
from .linear import (
    MAX_M,
    SLICE_MULTIPLE,
    decode_threshold,
    require_family,
    require_group_scales_aligned,
    require_x_aligned,
    team_of,
    team_shared_bytes,
    tiles_per_warp,
)
from .loader import kernel
from .variants import KernelVariant
from .workspace import (
    TOKENS_PER_BLOCK,
    call_workspace,
    fragment_elements,
    gated_rows,
    partial_elements,
    queue_x_fragments,
    rows_of_codes,
    zeroed_tickets,
)

GEMM_WARPS = 8  # tiles per block: 256 columns share one staging of x
# groups per load batch, per kernel family: 4 spill at 128 registers on sm_75 (44-92 bytes of stack),
# and so does 2 with 128x128 block scales (a scale load per group-tile: 48 bytes)
GEMM_UNROLL = {QPN2.key: 2, QPNMX.key: 2, QPN8.key: 2, QPN8_BLOCK.key: 1}
GEMM_MIN_BLOCKS = 2  # 2 blocks of 8 warps per SM: <= 128 registers
GEMM_MAX_PARTS = 16
GEMM_MIN_GROUPS_PER_PART = 32  # 512 k: a part's staging start and epilogue stay small next to its loop
GEMM_MIN_FILL = 0.75  # of the resident block slots one wave of parts must fill (gemm_split)

# Largest M the GEMM serves (above it: dequantize + cuBLAS), by compute capability and format.
# sm_80 and newer: measured on the H200 (benchmarks/results/gemm_h200.md), where cuBLAS has wgmma and
# the dense path wins from M ~ 96. Turing: projected by the sm_75 model (benchmarks/results/
# turing_model.md, "GEMM builds": bounds), not measured: there cuBLAS runs the same HMMA, and on a T4
# the dense path's own dequantize pass (2.56 bytes per weight) costs more than the GEMM's extra passes
# up to M = 512 for QPN2 (tensor-bound: 3693 us at M = 512 vs a 5783 us dense floor, 28672x8192, at
# 1.59 GHz; 5578 vs 6787 at the T4's sustained 1.25 GHz) and to M ~ 256 for QPN8 (each pass
# re-streams its 1 byte per weight: 6524 vs 5783 us at M = 512, 3262 vs 3936 at 256; GDDR6 at 0.90), and
# to 512 for QPN8 layers of N % 64 == 0, which from M = 65 run the paired team build (GEMM_TEAMS: one pass per
# 128 tokens; 3699 vs 5783 us at M = 512, 28672x8192; 34816x5120 2807 vs 4389; 4844 / 3677 at 1.25 GHz).
GEMM_MAX_M = {(7, QPN2.format): 512, (7, QPN8.format): 256}
GEMM_MAX_M_PAIRED = {(7, QPN8.format): 512}  # N % 64 == 0
GEMM_MAX_M_OTHER = 64  # the H200's crossover, for every card newer than Turing
# ... except layers of so few column blocks that the GEMM needs more parts than this: there the
# dense path wins already at M = 48-64 on the H200 (4096x14336, 16 parts: QPN2 85.4 / 99.8 us vs
# dense 79.0 / 82.1 at M = 48 / 64; 5120x17408 at 13 parts still wins, 93.7 / 104.2 vs 115.4 / 118.1).
GEMM_MAX_PARTS_OTHER = 13


# Team builds (QPN8; QPN2 gated): T warps share each tile's decode, each multiplying its own 16 tokens and decoding
# every T-th group into a 1 KiB shared-memory slot per tile (qpn_mma.cuh, QPN_TEAM), so one pass over the weight
# serves 16 T tokens: 128 from M = 65, and for gated layers, whose build above holds 32 tokens in its 64
# accumulators per lane, 64 from M = 33. A warp takes two tiles with one x load for both: a gated layer's gate and
# up tile, a plain layer's tiles s and s + N/64 where N % 64 == 0 (QPN_PAIR; else one tile). The same fp32 sums in
# the same order as the build above, with its split (gemm_split): every row keeps its bits whichever build runs
# it. Blocks: 16 warps at <= 128 registers (two tiles per warp), 32 at 64 (one).
# Measured on the H200 (benchmarks/results/team_h200/team7.md), time / the build above at M = 96-256: plain paired
# 0.81-0.85 (28672x8192), 0.85-0.98 (14336x4096), 0.73-0.84 (4096x4096), unpaired 0.60-0.93; gated team of 8
# 0.67-0.81, gated team of 4 at M = 64 0.56-0.85. Pairs, not the faster unpaired teams, because of
# Turing, by the model's bounds (results/turing_model.md; not measured): each 64-token pass of the QPN8 GEMM is
# DRAM-bound (28672x8192: 816 us), and a team reads its tokens' x from L2 for each of its tiles (128 tokens: 8x
# the weight bytes of a group-tile); at M = 128 two passes bound 1631 us, one unpaired pass 1665 (923 if a
# block's 4 teams share x in L1), one paired pass 925, gated 3262 -> 925 us. QPN2's plain passes are bound by the
# HMMA already (923 us either way) and its plain team builds spill at 64 registers; its gated passes (32 tokens)
# are DRAM-bound (M = 128: 1835 us in 4 passes -> ~925), and its gated teams hold 110-124 registers, spill-free.
# QPN2 gated, H200 (results/team_h200/team8_qpn2_gated.md): team of 4 at M = 64 0.83-0.84, of 8 at M = 96-256
# 0.67-0.77 the 32-token build's time.
GEMM_TEAMS = {False: ((65, 8),), True: ((65, 8), (33, 4))}  # by gated: (from M, T), the first that M reaches
GEMM_TEAM_WARPS = {1: 32, 2: 16}  # warps per block (tile slots = warps / T), by tiles per warp
# groups per batch: 2 spills the plain block-scale build (8 bytes on sm_75); teams of 4 measured at 1
GEMM_TEAM_UNROLL = {(QPN8.key, 8): 2, (QPN8.key, 4): 1, (QPN8_BLOCK.key, 8): 1, (QPN8_BLOCK.key, 4): 1,
                    (QPN2.key, 8): 2, (QPN2.key, 4): 1}


def gemm_nb(gated: bool) -> int:
    """8-token blocks per GEMM block: 64 fp32 accumulators per lane (gated holds two tiles)."""
    return 4 if gated else 8


def gemm_macros(wf: WeightFormat, gated: bool) -> tuple[tuple[str, str], ...]:
    """The GEMM build of the decode kernel of `wf` (x always from the staged fragments: qpn_mma.cuh); QPNMX is
    QPN2's kernel with e8m0 scales (QPN_MX)."""
    return tuple(sorted((
        ("QPN_GEMM", "1"),
        ("QPN_GATED", str(int(gated))),
        ("QPN_NB", str(gemm_nb(gated))),
        ("QPN_WARPS", str(GEMM_WARPS)),
        ("QPN_UNROLL", str(GEMM_UNROLL[wf.key])),
        ("QPN_MIN_BLOCKS", str(GEMM_MIN_BLOCKS)),
        *((("QPN_MX", "1"),) if wf is QPNMX else ()),
        *((("QPN8_BLOCK_SCALES", str(int(wf is QPN8_BLOCK))),) if wf in (QPN8, QPN8_BLOCK) else ()),
    )))


def team_macros(wf: WeightFormat, gated: bool, team: int, pair: bool = False) -> tuple[tuple[str, str], ...]:
    """The team build of family `wf` (QPN8's; QPN2 gated only) with teams of `team` warps (the constants above),
    over gemm_macros; pair: a plain build whose warps take two tiles (QPN_PAIR)."""
    macros = dict(gemm_macros(wf, gated))
    macros.update(QPN_TEAM=str(team), QPN_NB="2", QPN_WARPS=str(GEMM_TEAM_WARPS[2 if gated or pair else 1] // team),
                  QPN_UNROLL=str(GEMM_TEAM_UNROLL[wf.key, team]), QPN_MIN_BLOCKS="1")
    if pair:
        macros["QPN_PAIR"] = "1"
    return tuple(sorted(macros.items()))


QPN2_GEMM = {gated: KernelVariant("qpn2_linear.cu", "qpn2_linear", gemm_macros(QPN2, gated), archs=("sm_75",))
             for gated in (False, True)}
QPN8_GEMM = {(gated, block): KernelVariant("qpn8_linear.cu", "qpn8_linear",
                                           gemm_macros(QPN8_BLOCK if block else QPN8, gated), archs=("sm_75",))
             for gated in (False, True) for block in (False, True)}
QPN8_TEAM = {(gated, block, team, pair): KernelVariant("qpn8_linear.cu", "qpn8_linear",
                                                       team_macros(QPN8_BLOCK if block else QPN8, gated, team, pair),
                                                       archs=("sm_75",))
             for gated in (False, True) for block in (False, True) for _, team in GEMM_TEAMS[gated]
             for pair in ((False,) if gated else (False, True))}
QPN2_TEAM = {team: KernelVariant("qpn2_linear.cu", "qpn2_linear", team_macros(QPN2, True, team), archs=("sm_75",))
             for _, team in GEMM_TEAMS[True]}  # gated only
QPNMX_GEMM = {gated: KernelVariant("qpn2_linear.cu", "qpn2_linear", gemm_macros(QPNMX, gated), archs=("sm_75",))
              for gated in (False, True)}  # no team builds (mxfp4.py: its other builds)
KERNEL_VARIANTS = (*QPN2_GEMM.values(), *QPN8_GEMM.values(), *QPN8_TEAM.values(), *QPN2_TEAM.values(),
                   *QPNMX_GEMM.values())


def gemm_variant(wf: WeightFormat, gated: bool, m: int, n: int) -> KernelVariant:
    """The GEMM build a call of layout `wf`, M rows and N weight rows runs: the team build of the largest team M
    reaches (GEMM_TEAMS: QPN8 plain, paired where N % 64 == 0, and gated; QPN2 gated), else the build of
    gemm_macros (QPNMX at every M)."""
    gated, block = bool(gated), wf is QPN8_BLOCK
    if wf is QPNMX:
        return QPNMX_GEMM[gated]
    team = next((t for from_m, t in GEMM_TEAMS[gated] if m >= from_m), None)
    if wf is QPN2:
        return QPN2_TEAM[team] if gated and team else QPN2_GEMM[gated]
    if team is None:
        return QPN8_GEMM[gated, block]
    return QPN8_TEAM[gated, block, team, not gated and n % (2 * TILE_N) == 0]


_DEVICE: dict[int, tuple[int, int]] = {}  # device id -> (multiprocessors, compute capability major)


def _device() -> tuple[int, int]:
    import cupy  # noqa: PLC0415

    device = cupy.cuda.Device()
    if device.id not in _DEVICE:
        _DEVICE[device.id] = (int(device.attributes["MultiProcessorCount"]), int(device.compute_capability[:-1]))
    return _DEVICE[device.id]


def gemm_threshold(format: str, n: int, k: int) -> int:
    """The largest M the GEMM serves on the current device when no measured dispatch table covers it
    (GEMM_MAX_M; torch_bridge/dispatch.py reads the measured tables first). Host arithmetic only."""
    decode_threshold(format, n, k)  # the same argument rules
    sms, major = _device()
    if n % (2 * TILE_N) == 0 and (major, format) in GEMM_MAX_M_PAIRED:
        return max(MAX_M, GEMM_MAX_M_PAIRED[major, format])
    if (major, format) in GEMM_MAX_M:
        return max(MAX_M, GEMM_MAX_M[major, format])
    parts, _ = gemm_split(n // TILE_N, k // GROUP_K, SLICE_MULTIPLE[require_family(format).key], sms)
    return GEMM_MAX_M_OTHER if parts <= GEMM_MAX_PARTS_OTHER else MAX_M


def gemm_split(n_tiles: int, groups: int, multiple: int, sms: int) -> tuple[int, int]:
    """(parts, groups per part) for N/32 tiles and K/16 groups on `sms` SMs; never depends on M, nor
    on gated (the gated build then sums each tile exactly as the plain one).

    Parts fill the GPU's resident block slots (slots = GEMM_MIN_BLOCKS per SM): the most parts whose
    blocks fit one wave of slots, if that fills >= GEMM_MIN_FILL of them; else (a wave would stay
    half empty, each SM running one block of 8 warps) the fewest parts that give >= 1.5 waves.
    Each part >= GEMM_MIN_GROUPS_PER_PART groups, rounded up to whole load batches (`multiple`).
    Measured on the H200 (132 SMs, 264 slots), M = 64, QPN8 us by parts: 28672x8192 (112 column
    blocks) 1: 305, 2: 206, 3: 252, 4: 221, 7: 226, 8: 247; 14336x4096 (56) 1: 155, 2: 100, 4: 81,
    8: 99; 5120x17408 (20) 4: 190, 8: 144, 12: 117, 13: 107, 16: 147; 4096x14336 (16) 8: 116,
    13: 96, 16: 100; 34816x5120 (136) 1: 226, 2: 229, 3: 186.
    """
    blocks = -(-n_tiles // GEMM_WARPS)
    slots = max(1, GEMM_MIN_BLOCKS * sms)
    fits = [p for p in range(1, GEMM_MAX_PARTS + 1) if p == 1 or p * GEMM_MIN_GROUPS_PER_PART <= groups]
    one_wave = max(p for p in fits if p == 1 or p * blocks <= slots)
    if one_wave * blocks >= GEMM_MIN_FILL * slots:
        parts = one_wave
    else:
        parts = next((p for p in fits if 2 * p * blocks >= 3 * slots), fits[-1])
    per_part = -(-groups // parts)
    per_part = -(-per_part // multiple) * multiple
    return -(-groups // per_part), per_part


def build_geometry(defines: tuple[tuple[str, str], ...]) -> tuple[int, int, int]:
    """(tile slots, tokens, threads) per block of a GEMM build, read from its macros (qpn_mma.cuh: QPN_WARPS
    tiles; 8 * QPN_NB tokens, times QPN_WS_CZ consumer warps per tile in a warp-specialised build, whose
    blocks hold the QPN_WARPS producers and the consumers, or times the QPN_TEAM warps of a tile's team)."""
    d = dict(defines)
    tiles, nb = int(d["QPN_WARPS"]), int(d["QPN_NB"])
    if d.get("QPN_WS") == "1":
        chunks = int(d.get("QPN_WS_CZ", "1"))
        return tiles, TOKENS_PER_BLOCK * nb * chunks, 32 * tiles * (1 + chunks)
    team = team_of(defines)
    return tiles, TOKENS_PER_BLOCK * nb * team, 32 * tiles * team


def _grid(n: int, m: int, parts: int, variant: KernelVariant) -> tuple[int, int, int]:
    tiles, tokens, _ = build_geometry(variant.defines)
    slots = n // TILE_N // tiles_per_warp(variant.defines)
    return -(-slots // tiles), parts, -(-m // tokens)


def _workspace_ends(wf: WeightFormat, m: int, n: int, k: int, gated: bool, bf16: bool, variant: KernelVariant
                    ) -> tuple[int, int, int, int, int, int]:
    """(parts, groups per part, bf16 rows end, fragment end, partial end, ticket end): the call's split and
    its workspace layout in fp32 elements -- bf16 x's fp16 rows (bf16.py), x fragments, then split-K
    partials and tickets (parts > 1)."""
    parts, per_part = gemm_split(n // TILE_N, k // GROUP_K, SLICE_MULTIPLE[wf.key], _device()[0])
    rows = bf16_rows_elements(m, k, fragments=True) if bf16 else 0
    frag = rows + fragment_elements(m, k)
    if parts == 1:
        return parts, per_part, rows, frag, frag, frag
    bx, _, bz = _grid(n, m, parts, variant)
    partial = frag + partial_elements(parts, m, n, gated)
    return parts, per_part, rows, frag, partial, partial + bx * bz


def gemm_workspace_size(format: str, m: int, n: int, k: int, gated: bool = False, bf16: bool = False) -> int:
    """fp32 elements of the workspace a GEMM call needs (bf16 x's fp16 rows, x fragments, split-K partials,
    tickets): pass one of at least this size where allocations must come from the caller (graph capture)."""
    family = require_family(format)  # its split; QPN8's channel- and block-scale builds have one geometry
    variant = gemm_variant(weight_format(format, "channel" if family is QPN8 else None), gated, m, n)
    return _workspace_ends(family, m, n, k, gated, bf16, variant)[-1]


def launch_gemm(wf: WeightFormat, variant: KernelVariant, weights: tuple, x: CupyArray, y: CupyArray, n: int,
                gated: bool, workspace: CupyArray | None) -> None:
    """Queue one GEMM call: bf16 x's fp16 rows, x fragments, the tickets' reset (parts > 1), the kernel."""
    m, k = x.shape
    parts, per_part, rows_end, frag_end, partial_end, size = _workspace_ends(wf, m, n, k, gated, is_bf16(x), variant)
    workspace = call_workspace(workspace, size, "gemm_workspace_size")
    x_factor = np.uint64(0)
    x_frag = workspace[rows_end:frag_end]
    if rows_end:  # bf16: its fp16 rows straight into the fragments
        x_frag, x_factor = queue_bf16_rows(x, workspace[:rows_end], x_frag)
    else:
        queue_x_fragments(x, x_frag)
    partial, tickets = np.uint64(0), np.uint64(0)
    if parts > 1:
        partial = workspace[frag_end:partial_end]
        tickets = zeroed_tickets(workspace[partial_end:size])
    tail = (np.int32(m), np.int32(n), np.int32(k), np.int32(per_part), partial, tickets, x_factor)
    threads = build_geometry(variant.defines)[2]
    kernel(variant)(_grid(n, m, parts, variant), (threads,), (*weights, x_frag, y, *tail),
                    shared_mem=team_shared_bytes(variant.defines, threads // 32))


def gemm_activation(x: CupyArray, wf: WeightFormat) -> tuple[int, int]:
    require_activations("x", x)
    m, k = x.shape
    if m < 1:
        raise ValueError(f"x must have M >= 1 rows, got shape {tuple(x.shape)}; an empty batch needs no call")
    wf.require_dims(TILE_N, k)  # K's rule (N is checked on the weights)
    require_x_aligned(x)
    return m, k


def qpn2_gemm_linear(x: CupyArray, codes: CupyArray, scales: CupyArray, global_scale: float | np.ndarray | CupyArray,
                     out: CupyArray | None = None, gated: bool = False,
                     workspace: CupyArray | None = None) -> CupyArray:
    """y = x @ W16^T for a QPN2 (NVFP4) weight, any M >= 1 (built for 33-512; module docstring);
    arguments as qpn2_linear, workspace sized by gemm_workspace_size."""
    m, k = gemm_activation(x, QPN2)
    n = rows_of_codes(codes, k, QPN2.code_bits / 8)
    n, k, g, g_stride = prepare_qpn2(codes, scales, global_scale, n, k)
    y = output_array(out, (m, gated_rows(n, gated)), x.dtype)
    launch_qpn2_gemm(x, codes, scales, g, g_stride, n, y, gated, workspace)
    return y


def qpn8_gemm_linear(x: CupyArray, codes: CupyArray, group_scales: CupyArray, out: CupyArray | None = None,
                     gated: bool = False, workspace: CupyArray | None = None) -> CupyArray:
    """y = x @ W16^T for a QPN8 (FP8) weight, any M >= 1 (built for 33-512); arguments as qpn8_linear."""
    m, k = gemm_activation(x, QPN8)
    n = rows_of_codes(codes, k, QPN8.code_bits / 8)
    n, k, _ = prepare_qpn8(codes, group_scales, n, k)
    wf = qpn8_group_scales_format(group_scales.shape, n, k)
    require_group_scales_aligned(group_scales, wf)
    y = output_array(out, (m, gated_rows(n, gated)), x.dtype)
    launch_qpn8_gemm(x, codes, group_scales, wf, n, y, gated, workspace)
    return y


def launch_qpn2_gemm(x: CupyArray, codes: CupyArray, scales: CupyArray, g: CupyArray, g_stride: int, n: int,
                     y: CupyArray, gated: bool, workspace: CupyArray | None) -> None:
    launch_gemm(QPN2, gemm_variant(QPN2, gated, x.shape[0], n), (codes, scales, g, np.int32(g_stride)), x, y, n, gated,
                workspace)


def launch_qpn8_gemm(x: CupyArray, codes: CupyArray, group_scales: CupyArray, wf: WeightFormat, n: int,
                     y: CupyArray, gated: bool, workspace: CupyArray | None) -> None:
    weights = (codes, group_scales, np.int32(qpn8_strides(wf, n)[0]))
    launch_gemm(QPN8, gemm_variant(wf, gated, x.shape[0], n), weights, x, y, n, gated, workspace)
