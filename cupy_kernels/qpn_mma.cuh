// qpn_mma.cuh: the pieces the QPN2 / QPN8 decode linear kernels share (M <= 32 tokens).
//
// Operand roles of `mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32` (the sm_75 tensor-core
// instruction; never m16n8k16 (sm_80+) nor m8n8k4 (emulated off Volta: 18.7 vs 434 TFLOP/s)):
//   A (16 x 8, row-major)  = 16 output columns n of a 32-column tile  x  8 k-slots   (weights)
//   B ( 8 x 8, col-major)  = 8 k-slots  x  8 tokens                                  (activations)
//   C (16 x 8, fp32)       = 16 output columns x 8 tokens; M <= 32 tokens = QPN_NB B/C blocks.
// Fragment registers of lane = 4*gid + t (gid = lane>>2 "group", t = lane&3 "thread in quad"):
//   a0 = A[gid][2t, 2t+1]   a1 = A[gid+8][2t, 2t+1]        (fp16 pairs)
//   b  = B[2t, 2t+1][gid]                                   (fp16 pair: token gid)
//   c0, c1 = C[gid][2t, 2t+1]   c2, c3 = C[gid+8][2t, 2t+1] (fp32: tokens 2t, 2t+1)
//
// k-slot map (one 16-k group = two mma k-steps "A" and "B"): quad lane t holds, for EVERY column
// it works on, the four consecutive k = 4t .. 4t+3 of the group:
//   step A: slots (2t, 2t+1) = k (4t, 4t+1)      step B: slots (2t, 2t+1) = k (4t+2, 4t+3)
// so a lane's two B registers of a group are ONE 8-byte load of x[m][16g+4t .. 16g+4t+3]
// (qpn_load_x_group), straight from x's natural [M][K] layout: no staging, no permutation.
// The weight side gets the same k's from the QPN2 / QPN8 byte order with a 4x4 transpose
// inside each quad (see the kernels).
//
// Row assignment (any order is legal; this one makes the exchange a quad-local transpose):
// the quad of lanes 4q..4q+3 owns tile columns col(4q+j), j = 0..3 (qpn_column_of_lane); the
// quad's mma rows are exactly those four columns:
//   rowblock 0: row gid <- col(4q+0), row gid+8 <- col(4q+1)
//   rowblock 1: row gid <- col(4q+2), row gid+8 <- col(4q+3)
#pragma once
#include "qpn_common.cuh"

#ifndef QPN_NB
#define QPN_NB 1  // 8-token blocks: M <= 8 * QPN_NB
#endif
#ifndef QPN_GATED
#define QPN_GATED 0
#endif
#ifndef QPN_WARPS
#define QPN_WARPS 16  // most warps (K-slices) per block; the host launches split <= QPN_WARPS
#endif
#ifndef QPN_X_BATCH
#define QPN_X_BATCH 0  // 1: a batch's x loaded when it starts computing; 0: each group's before it
#endif
#ifndef QPN_MIN_BLOCKS
#define QPN_MIN_BLOCKS 1  // blocks of QPN_WARPS warps per SM the registers must allow (launch bound)
#endif
#ifndef QPN_UNROLL
#define QPN_UNROLL 4  // groups per load batch (qpn_run_batches)
#endif

// QPN_PAIR = 1 (the QPN8 GEMM's plain team builds, gemm.py): a plain layer's tiles s and s + N/64 go through one
// warp as a gated build's gate and up tiles do (one x load for the two), each stored as its own output columns
#ifndef QPN_PAIR
#define QPN_PAIR 0
#endif
#if QPN_PAIR && (QPN_GATED || !QPN_GEMM || QPN_MX || QPN_MOE)
#error "QPN_PAIR: the plain NVFP4 / FP8 GEMM builds only"
#endif
#define QPN_HT (QPN_GATED || QPN_PAIR ? 2 : 1)  // tiles per block and warp: gated, the gate tile and the up tile

// QPN_GEMM = 1: the same kernels as a tiled GEMM for M = 33-512 (cupy_kernels/gemm.py). What changes:
//   work split  warp w of block (b, part, z) owns tile slot QPN_WARPS * b + w and the part's whole K range
//               (groups [part * gpp, (part + 1) * gpp)), for the 8 * QPN_NB tokens [8 QPN_NB z, ...);
//               no split-K inside the block, parts across blocks as the decode kernels (gridDim.y);
//   x           the block stages each batch's x fragments (x_fragments.cu order, all M rows) into
//               shared memory once, and its QPN_WARPS tiles read them from there (qpn_x_batch_start);
//   store       each warp rounds and stores its own tile (qpn_gemm_store).
// The weight loads, the decode and the mma of a group-tile are the decode kernels' own code.
#ifndef QPN_GEMM
#define QPN_GEMM 0
#endif
// QPN_WS = 1 (with QPN_GEMM): warp-specialised. The QPN_WARPS warps above are producers: each runs the
// decode kernels' K loop for its tile as before, but stores each group-tile's decoded A fragments into a
// shared-memory ring instead of multiplying them, and stages the batch's x there too. QPN_WS_CZ consumer
// warps per tile (warps QPN_WARPS ..) each multiply the tile by their own 8 * QPN_NB tokens, reading both
// operands from the ring: a group-tile is decoded once for 8 * QPN_NB * QPN_WS_CZ tokens, and the ALU work
// (decode, producers) and the tensor work (mma, consumers) run in different warps at the same time instead
// of one after the other in every warp. The ring holds QPN_WS_STAGES batches; named barriers hand each
// stage over (FULL: producers arrive, consumers wait; EMPTY: the reverse), so no block-wide barrier runs
// in the K loop. Each consumer's sums are the plain GEMM build's for its tokens, op for op (the same
// group order and mma sequence), so the two builds give the same bits for the same parts.
// Not shipped: measured on the H200 (benchmarks/NOTES.md, "The warp-specialised GEMM"), no faster than the
// plain build for QPN2 (28672 x 8192, M = 64: 248 vs 202 us); QPN8 with QPN_WS_RAW 0-15 % faster at M = 64-256
// (190 vs 204 us there; 131 vs 131 at 14336 x 4096, M = 128); bench_decode.py's gemm_ws section builds and
// times it.
#ifndef QPN_WS
#define QPN_WS 0
#endif
#if QPN_WS
#if !QPN_GEMM
#error "QPN_WS is a QPN_GEMM build"
#endif
#ifndef QPN_WS_CZ
#define QPN_WS_CZ 1  // consumer warps per tile (token chunks of 8 * QPN_NB)
#endif
#ifndef QPN_WS_STAGES
#define QPN_WS_STAGES 2  // batches the shared-memory ring holds
#endif
#define QPN_BLOCK_THREADS (QPN_WARPS * (1 + QPN_WS_CZ) * 32)
#define QPN_BLOCK_NB2 (((QPN_NB + 1) / 2) * QPN_WS_CZ)  // x fragment pairs of the block's tokens
#endif
// QPN_TEAM = T > 1: teams of T warps share one tile's decode through shared memory. Each warp of a team
// multiplies its own 8 * QPN_NB tokens (the team's are 8 * QPN_NB * T); the team walks its K range in rounds
// of T groups: in round v warp r (its rank) loads and decodes group T v + r only, stores its A fragments into
// its shared-memory slot, and after a team barrier every warp multiplies the round's T group-tiles, in
// ascending group order, by its own tokens (qpn_take_group; a second barrier before the slots are refilled;
// two tiles per warp, gated or QPN_PAIR: both tiles' group-tiles of the round, one x load per group for the two).
// Each output is the same fp32 sum as in the build without teams (the same groups in the same order through
// the same mma: 8-token blocks never share a sum), so the bits are that build's. What changes: a warp decodes
// 1/T of the groups and holds 1/T of the accumulators, so more warps fit per SM (the M = 25-32 decode build:
// 32 warps at 64 registers instead of 16 at 108-116) and the GEMM decodes each group-tile once per 8 * QPN_NB
// * T tokens. A team is a K-slice in the decode builds (the block holds split x T warps) and a tile slot in
// the GEMM builds (QPN_WARPS slots x T warps). The slots: dynamic shared memory, QPN_HT KiB per warp.
// Shipped: the QPN8 GEMM's teams (gemm.py, GEMM_TEAMS: 128 tokens per pass from M = 65, gated 64 from M = 33,
// plain ones paired as QPN_PAIR where N % 64 == 0; 0.56-0.98x the time of the build they replace on the H200).
// Not shipped: the decode teams, 1.2-1.9x slower at M = 24-32 (the exchange and x loads cost more instructions
// than the doubled occupancy wins back), and QPN2's (they spill at 64 registers). benchmarks/NOTES.md, "Team
// builds"; bench_decode.py's team section times them.
#ifndef QPN_TEAM
#define QPN_TEAM 1
#endif
#if QPN_TEAM > 1 && (QPN_WS || QPN_MOE || QPN_MX || QPN_NB > 2)
#error "QPN_TEAM: the dense NVFP4 / FP8 decode and GEMM builds of 8-16 tokens per warp only"
#endif
#if !QPN_WS
#define QPN_BLOCK_THREADS (QPN_WARPS * QPN_TEAM * 32)
#define QPN_BLOCK_NB2 (((QPN_NB + 1) / 2) * QPN_TEAM)  // x fragment pairs of the block's (team's) tokens
#endif
#if QPN_GEMM
#define QPN_WARP_TILES QPN_WARPS  // tile slots per block (each warp its own)
#else
#define QPN_WARP_TILES 1  // every warp of a block works on the block's one slot
#endif
// The block's tile slot and the launch's count of them: grid x in the dense builds; z in the MoE builds,
// whose x are the pieces of the hit experts (qpn_moe.cuh: one expert's pieces run side by side).
#ifndef QPN_MOE
#define QPN_MOE 0
#endif
#if QPN_MOE
#define QPN_BLOCK_TILE ((int)blockIdx.z)
#define QPN_BLOCK_TILES ((int)gridDim.z)
#else
#define QPN_BLOCK_TILE ((int)blockIdx.x)
#define QPN_BLOCK_TILES ((int)gridDim.x)
#endif

// The fragments of one lane (the register map above), per group-tile (16 k x 32 columns):
//   QpnFragA  the weights, two rowblocks of the quad's columns: [rb][0] = a0 and [rb][1] = a1 of
//             mma step A (k 4t, 4t+1), [rb][2] = a0 and [rb][3] = a1 of step B (k 4t+2, 4t+3);
//             a0 = row gid = column col(4q + 2rb), a1 = row gid+8 = col(4q + 2rb + 1)
//   QpnFragB  the activations of one group, per 8-token block j: .x = b of step A, .y = b of step B
//   QpnFragC  c0..c3 of one mma (fp32);  QpnAcc: a tile's accumulators [8-token block][rowblock]
typedef qpn_u32 QpnFragA[2][4];
typedef uint2 QpnFragB[QPN_NB];
typedef float QpnFragC[4];
typedef QpnFragC QpnAcc[QPN_NB][2];

__device__ __forceinline__ qpn_u32 qpn_prmt(qpn_u32 a, qpn_u32 b, qpn_u32 sel) {
    qpn_u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ qpn_u32 qpn_hfma2_rn(qpn_u32 a, qpn_u32 b, qpn_u32 c) {
    qpn_u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// (a & c) | (b & ~c) in one LOP3 (ptxas splits the C++ form into two on sm_90: measured)
__device__ __forceinline__ qpn_u32 qpn_select_bits(qpn_u32 a, qpn_u32 b, qpn_u32 c) {
    qpn_u32 d;
    asm("lop3.b32 %0, %1, %2, %3, " QPN_STR(QPN_LOP3_SELECT) ";" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// fp32 accumulate += A (16x8 fp16) * B (8x8 fp16)
__device__ __forceinline__ void qpn_mma(QpnFragC& c, qpn_u32 a0, qpn_u32 a1, qpn_u32 b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(b));
}

// One group-tile into the accumulators of its tile: 4 mma per 8-token block (the host launches
// QPN_NB = ceil(M / 8): no block is empty).
__device__ __forceinline__ void qpn_mma_group(QpnAcc& acc, const QpnFragA& a, const QpnFragB& xf) {
#pragma unroll
    for (int j = 0; j < QPN_NB; ++j)
#pragma unroll
        for (int rb = 0; rb < 2; ++rb) {
            qpn_mma(acc[j][rb], a[rb][0], a[rb][1], xf[j].x);  // step A
            qpn_mma(acc[j][rb], a[rb][2], a[rb][3], xf[j].y);  // step B
        }
}

// The block's share of the layer and this warp's K-slice (both decode kernels).
// Block (b, part) = slot b (its QPN_HT tiles) x `split` = blockDim / 32 K-slices, one warp each.
//   tile[h]:              the slot's tiles (gated: h = 0 gate tile, 1 up tile)
//   g_begin, n_local:     the K-slice s = part * split + warp, groups [s * gpw, (s+1) * gpw)
//                         clipped to K (n_local <= 0: a trailing warp with nothing to do)
// One tile per slot: tiles sharing x through L1 measured slower at every M (benchmarks/NOTES.md,
// "Decode kernels: history moved out of the kernel comments").
struct QpnSlice {
    int tile[QPN_HT];
    int g_begin;
    int n_local;
    int slot;   // the tile slot (gated: the gate tile's index = the output tile's)
    bool live;  // QPN_GEMM: the warp's slot exists (a last block may have more warps than slots left)
    int tok0;   // QPN_GEMM: the warp's first token (its 8 * QPN_NB tokens are its outputs' rows)
    int rank;   // QPN_TEAM: the warp's rank in its team (its own groups: g_begin + rank + T v); else 0
};

// The K loop's count of batches' steps (rounds) and whether the warp loads a group in round v. Without teams:
// the slice's groups, all of them. QPN_TEAM: rounds of T groups, the same count for every team of a block
// (two teams share a named barrier where a block has more than 15: the decode builds of split 16), so in the
// decode builds from groups_per_warp, the slice every team but a trailing one has; the warp of rank r loads
// group T v + r where it lies in the slice (a pad round loads nothing and adds +0).
__device__ __forceinline__ int qpn_team_rounds(int n_local, int groups_per_warp) {
#if QPN_TEAM > 1 && QPN_GEMM
    (void)groups_per_warp;  // every warp of a GEMM block shares the part
    return (n_local + QPN_TEAM - 1) / QPN_TEAM;
#elif QPN_TEAM > 1
    (void)n_local;
    return (groups_per_warp + QPN_TEAM - 1) / QPN_TEAM;
#else
    (void)groups_per_warp;
    return n_local;
#endif
}
__device__ __forceinline__ bool qpn_team_owns(const QpnSlice& sl, int v) {
#if QPN_TEAM > 1
    return QPN_TEAM * v + sl.rank < sl.n_local;
#else
    (void)sl, (void)v;
    return true;
#endif
}

// Tile h of slot `slot` (gated: the gate tile, then the up tile N/64 tiles further).
__device__ __forceinline__ int qpn_tile_of_slot(int n, int slot, int h) {
    return slot + h * (n / QPN_TILE_N / 2);
}

// Warp w's tile (its K-slice in the decode builds) and token chunk: QPN_WS, producer w or consumer; QPN_TEAM,
// team w / T and rank w % T; otherwise w and 0.
#if QPN_WS
__device__ __forceinline__ bool qpn_ws_consumer() { return (int)(threadIdx.x >> 5) >= QPN_WARPS; }
__device__ __forceinline__ int qpn_warp_tile(int w) { return w < QPN_WARPS ? w : (w - QPN_WARPS) % QPN_WARPS; }
__device__ __forceinline__ int qpn_warp_chunk(int w) { return w < QPN_WARPS ? 0 : (w - QPN_WARPS) / QPN_WARPS; }
#else
__device__ __forceinline__ int qpn_warp_tile(int w) { return w / QPN_TEAM; }
__device__ __forceinline__ int qpn_warp_chunk(int w) { return w % QPN_TEAM; }
#endif

// The block's tile slot `tile` (QPN_GEMM: clamped to the last slot, whose work a warp then repeats
// without storing it: every warp must take part in the block's x staging).
__device__ __forceinline__ int qpn_slot_of_tile(int n, int tile) {
#if QPN_GEMM
    return min((int)blockIdx.x * QPN_WARPS + tile, n / QPN_TILE_N / QPN_HT - 1);
#else
    (void)n, (void)tile;
    return QPN_BLOCK_TILE;
#endif
}
__device__ __forceinline__ int qpn_slot_of_warp(int n, int w) { return qpn_slot_of_tile(n, qpn_warp_tile(w)); }

__device__ __forceinline__ QpnSlice qpn_block_slice(int n, int k, int groups_per_warp) {
    QpnSlice sl;
    const int warp = threadIdx.x >> 5;
    const int slot = qpn_slot_of_warp(n, warp);
    sl.slot = slot;
#pragma unroll
    for (int h = 0; h < QPN_HT; ++h) sl.tile[h] = qpn_tile_of_slot(n, slot, h);
#if QPN_GEMM
    sl.live = (int)blockIdx.x * QPN_WARPS + qpn_warp_tile(warp) < n / QPN_TILE_N / QPN_HT;
    sl.g_begin = blockIdx.y * groups_per_warp;  // the part's groups: every warp of the block the same
    sl.tok0 = 16 * (QPN_BLOCK_NB2 * (int)blockIdx.z + (QPN_NB + 1) / 2 * qpn_warp_chunk(warp));
#else
    sl.live = true;
    sl.tok0 = 0;
    sl.g_begin = (blockIdx.y * ((blockDim.x >> 5) / QPN_TEAM) + qpn_warp_tile(warp)) * groups_per_warp;
#endif
    sl.rank = QPN_TEAM > 1 ? qpn_warp_chunk(warp) : 0;
    sl.n_local = min(k / QPN_GROUP_K, sl.g_begin + groups_per_warp) - sl.g_begin;
    return sl;
}

// Streaming loads of the weights (read once: evict-first, do not pollute L1/L2 for x).
__device__ __forceinline__ uint2 qpn_ldcs_u2(const void* p) {
    uint2 v;
    asm volatile("ld.global.cs.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 qpn_ldcs_u4(const void* p) {
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Where a lane's B fragments come from (QPN_X_FRAG, per build; x_fragments.cu):
//   0: x itself, fp16 [M][K]: the fragment of group g, 8-token block j is x[row][16g + 4t .. 4t + 3]
//      (8 bytes, one load), row = 8j + gid clamped to M-1 (rows >= M only feed output columns that
//      are never stored; clamping keeps the loads in bounds and on the same cache lines, so M = 1
//      reads 32 bytes of x per group). A warp's load touches one 32-byte sector in each of 8 rows:
//      8 L1 wavefronts per 8 tokens.
//   1: x rearranged once per call by qpn_x_fragments into fragment order, [K/16][NB2][32 lanes][16 bytes]
//      (NB2 = ceil(NB / 2); lane's 16 bytes = its fragments of blocks 2jp and 2jp + 1): one
//      coalesced 16-byte load per lane feeds two 8-token blocks, 4 L1 wavefronts per 16 tokens
//      instead of 16. Measured on the H200 at M = 32 (28672x8192, ncu): with layout 0 the L1/TEX
//      pipe was 78 % busy and the kernel 2.1x its M = 1 time.
// x is re-read by every tile of a block and by the other blocks of the SM: the .nc (read-only,
// L1-allocating) path keeps it on chip, so it is loaded when its batch computes (QPN_X_BATCH
// below), not with the weights: L1 hits, and no registers held across the DRAM latency.
// A pad group past the slice (valid = false) gets x = 0: its mma add exactly +0.
// Fragment .x = step A register (k 4t, 4t+1), .y = step B register (k 4t+2, 4t+3).
#ifndef QPN_X_FRAG
#define QPN_X_FRAG 0
#endif
#define QPN_NB2 ((QPN_NB + 1) / 2)  // 16-byte fragment pairs per group (QPN_X_FRAG = 1)

// QPN_GEMM: x from shared memory. The block's tokens are pairs [QPN_NB2 z, QPN_NB2 (z + 1)) of the
// call's nb2_all = ceil(M / 16) fragment pairs; each batch (QPN_UNROLL groups) is staged by the
// whole block into one of two buffers (QPN_UNROLL x QPN_NB2 x 32 x 16 bytes: 8 KiB at 4 groups and
// 64 tokens), so one __syncthreads per batch orders it (qpn_x_batch_start). Pairs past M are zeros.
#if QPN_GEMM
#undef QPN_X_BATCH
#define QPN_X_BATCH 0  // the batch's x is in shared memory: each group's fragments are read right before it
#define QPN_X_STAGE (QPN_UNROLL * QPN_BLOCK_NB2 * 32)  // 16-byte units per staged batch
#endif

#if QPN_WS
// The ring (file scope: producers write it, consumers read it). Stage s: the batch's x fragments
// ([group u][pair][lane], the plain GEMM's staging order for the block's QPN_BLOCK_NB2 pairs) and each
// producer's decoded A fragments ([warp][tile h][group u][rowblock][lane]: a lane's 8 registers of a
// group-tile as two 16-byte words, so both sides move 512 contiguous bytes per instruction, no bank
// conflicts). NT = 4 tiles, 2 groups, 64 tokens, 2 stages: 8 KiB of x and 16 KiB of A.
__shared__ uint4 qpn_ws_x[QPN_WS_STAGES * QPN_X_STAGE];
// QPN_WS_RAW = 1: the ring holds each group-tile's codes, not its decoded fragments (producers copy,
// consumers decode): 512 bytes in the ldmatrix row order below instead of 1 KiB.
#ifndef QPN_WS_RAW
#define QPN_WS_RAW 0
#endif
__shared__ uint4 qpn_ws_a[QPN_WS_STAGES][QPN_WARPS][QPN_HT][QPN_UNROLL][QPN_WS_RAW ? 1 : 2][32];
// named barriers (0 is __syncthreads'): FULL(s), EMPTY(s), and the consumers' epilogue hand-off
#define QPN_WS_FULL(s) (1 + (s))
#define QPN_WS_EMPTY(s) (1 + QPN_WS_STAGES + (s))
#define QPN_WS_STORE_BARRIER (1 + 2 * QPN_WS_STAGES)
static_assert(QPN_WS_STORE_BARRIER < 16, "16 named barriers per block");
// a producer lane's share of a staged batch (QPN_WARPS * 32 producer threads)
#define QPN_WS_X_UNITS ((QPN_X_STAGE + QPN_WARPS * 32 - 1) / (QPN_WARPS * 32))
#endif

// named barriers (QPN_WS, QPN_TEAM)
__device__ __forceinline__ void qpn_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void qpn_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

#if QPN_TEAM > 1
// The team slots: warp w's decoded group-tile of tile h as [w][h][rowblock][lane] 16-byte words (QPN_HT KiB
// per warp, sized by the launch): 512 contiguous bytes per store and load, no bank conflicts.
extern __shared__ uint4 qpn_team_a[];
#endif

struct QpnX {  // the warp's x at its slice's first group; loads add the group as an immediate
#if QPN_TEAM > 1
    const char* p;    // x fragments (x_fragments.cu) of the slice's first group: the warp's pair, this lane
    unsigned stride;  // bytes per group: 512 per fragment pair of the call
    int round;        // the first round of the batch being computed (qpn_x_batch_start)
    int left;         // groups of the slice (a group past it gets x = 0)
    int bar_id, bar_threads;  // the team's named barrier
#elif QPN_GEMM
    const uint4* g;  // global fragments of the slice's first group, the block's first pair
    uint4* s;        // shared memory: two staging buffers of QPN_X_STAGE units
    int nb2_all;     // fragment pairs per group in the call (ceil(M / 16))
    int pairs;       // of them, this block's (<= QPN_NB2)
    int buf;         // the buffer the next batch goes to
    int stage;       // QPN_WS: batches handed to the consumers so far (the ring slot is stage % stages)
#elif QPN_X_FRAG
    const uint4* p;
#else
    const qpn_u16* p[QPN_NB];
#endif
};

// QPN_MOE builds (qpn_moe.cuh): the call's row r is x row row_map[row0 + r] (row0 + r without a map). The
// dense builds keep the plain form (with the map as a defaulted argument their K loops grew by 2 SASS
// instructions: tests/test_turing_model.py).
__device__ __forceinline__ QpnX qpn_x_source(const void* __restrict__ x, int m_rows, int k, int g_begin
#if QPN_MOE
                                             , const int* __restrict__ row_map, int row0
#endif
) {
    QpnX xs;
    const int lane = threadIdx.x & 31;
#if QPN_TEAM > 1
    (void)k;
    const int w = threadIdx.x >> 5;
#if QPN_GEMM
    const int teams = QPN_WARPS;  // a team per tile slot (a compile-time barrier size: one register less)
    const int nb2_all = (m_rows + 15) / 16;  // the call's fragment pairs
    const int pair0 = QPN_BLOCK_NB2 * blockIdx.z + QPN_NB2 * qpn_warp_chunk(w);
#else
    (void)m_rows;
    const int teams = (blockDim.x >> 5) / QPN_TEAM;  // the launch's K-slices
    const int nb2_all = QPN_BLOCK_NB2;  // ceil(M / 16): the decode builds' team holds all of the call's tokens
    const int pair0 = QPN_NB2 * qpn_warp_chunk(w);
#endif
    xs.stride = 512u * nb2_all;
    // a GEMM warp whose tokens all lie past M reads the last pair instead: its sums are never stored
    xs.p = reinterpret_cast<const char*>(static_cast<const uint4*>(x) + (long long)g_begin * nb2_all * 32 +
                                         min(pair0, nb2_all - 1) * 32 + lane);
    xs.round = 0;
    xs.left = 0;
    const int share = teams > 15 ? 2 : 1;  // 16 named barriers per block, 0 is __syncthreads'
    xs.bar_id = 1 + qpn_warp_tile(w) / share;
    xs.bar_threads = 32 * QPN_TEAM * share;
#elif QPN_GEMM
#if QPN_WS
    uint4* const x_stage = qpn_ws_x;
#else
    __shared__ uint4 x_stage[2 * QPN_X_STAGE];
#endif
    (void)k, (void)lane;
    xs.nb2_all = (m_rows + 15) / 16;
    const int pair0 = QPN_BLOCK_NB2 * blockIdx.z;
    xs.pairs = min(QPN_BLOCK_NB2, xs.nb2_all - pair0);
    xs.g = static_cast<const uint4*>(x) + (long long)g_begin * xs.nb2_all * 32 + pair0 * 32;
    xs.s = x_stage;
    xs.buf = 0;
    xs.stage = 0;
#elif QPN_X_FRAG
    xs.p = static_cast<const uint4*>(x) + (long long)g_begin * QPN_NB2 * 32 + lane;
#else
#pragma unroll
    for (int j = 0; j < QPN_NB; ++j) {
#if QPN_MOE
        const int r = row0 + min(8 * j + (lane >> 2), m_rows - 1);
        const int row = row_map ? row_map[r] : r;
#else
        const int row = min(8 * j + (lane >> 2), m_rows - 1);
#endif
        xs.p[j] = static_cast<const qpn_u16*>(x) + (long long)row * k + 16 * g_begin + 4 * (lane & 3);
    }
#endif
    return xs;
}

#if QPN_TEAM == 1  // team builds index their rounds from the slice's start (qpn_run_batches)
// advance by `groups` groups (the QPN2 K loop moves its pointers one batch at a time)
__device__ __forceinline__ void qpn_x_advance(QpnX& xs, int groups) {
#if QPN_GEMM
    xs.g += (long long)groups * xs.nb2_all * 32;
#elif QPN_X_FRAG
    xs.p += groups * QPN_NB2 * 32;
#else
#pragma unroll
    for (int j = 0; j < QPN_NB; ++j) xs.p[j] += QPN_GROUP_K * groups;
#endif
}
#endif

// A lane's 16 bytes of fragment pair jp (x_fragments.cu order): the B fragments of 8-token block 2 jp (bytes
// 0-7) and, where the build has it, 2 jp + 1 (bytes 8-15).
__device__ __forceinline__ void qpn_split_pair(QpnFragB& xf, int jp, const uint4& v) {
    xf[2 * jp] = make_uint2(v.x, v.y);
    if (2 * jp + 1 < QPN_NB) xf[2 * jp + 1] = make_uint2(v.z, v.w);
}

// 16 bytes of x fragments through the read-only path (L1-allocating: the other tiles of the SM re-read them)
__device__ __forceinline__ void qpn_ldg_nc_u4(uint4& v, const void* p) {
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
}

// The B fragments of group g0 + u of the slice (from the source's current position) for every
// 8-token block j; g0 is a per-batch base, u an immediate.
__device__ __forceinline__ void qpn_load_x_group(QpnFragB& xf, const QpnX& xs, int g0, int u, bool valid)
{
#if QPN_WS || QPN_TEAM > 1
    // QPN_WS producers do not multiply: the consumers read x from the ring; QPN_TEAM: qpn_take_group loads
    // the x of each of the round's groups (qpn_team_x)
    (void)xs, (void)g0, (void)u, (void)valid;
#pragma unroll
    for (int j = 0; j < QPN_NB; ++j) xf[j] = make_uint2(0u, 0u);
#elif QPN_GEMM
    (void)g0;  // the staged batch starts at group g0: u indexes it
    const uint4* p = xs.s + (1 - xs.buf) * QPN_X_STAGE + u * QPN_NB2 * 32 + (threadIdx.x & 31);
#pragma unroll
    for (int jp = 0; jp < QPN_NB2; ++jp) {
        qpn_split_pair(xf, jp, valid ? p[jp * 32] : make_uint4(0u, 0u, 0u, 0u));
    }
#elif QPN_X_FRAG
#pragma unroll
    for (int jp = 0; jp < QPN_NB2; ++jp) {
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (valid) {
            qpn_ldg_nc_u4(v, xs.p + (long long)g0 * (QPN_NB2 * 32) + (u * QPN_NB2 + jp) * 32);
        }
        qpn_split_pair(xf, jp, v);
    }
#else
#pragma unroll
    for (int j = 0; j < QPN_NB; ++j) {
        if (valid) {
            const qpn_u16* p = xs.p[j] + 16 * (long long)g0 + 16 * u;
            asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(xf[j].x), "=r"(xf[j].y) : "l"(p));
        } else {
            xf[j] = make_uint2(0u, 0u);
        }
    }
#endif
}

#if QPN_TEAM > 1
// The warp's B fragments of group g of the slice (relative to xs.p; QPN_NB <= 2: one 16-byte load); guarded:
// x = 0 past the slice (a pad group's A is +0, and an x of another slice might be inf). The address is one
// 32 x 32 -> 64-bit multiply-add.
__device__ __forceinline__ void qpn_team_x(QpnFragB& xf, const QpnX& xs, int g, bool guarded) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (!guarded || g < xs.left) qpn_ldg_nc_u4(v, xs.p + (unsigned long long)(unsigned)g * xs.stride);
    qpn_split_pair(xf, 0, v);
}
#endif

// When a batch's x is loaded (QPN_X_BATCH, per format by measurement on the H200, bench_decode.py):
// 1 = all U groups' fragments as the batch starts computing, 0 = each group's right before it.
// QPN2 (the longer decode per byte) gains from the early loads (28672x8192 M = 32: 12 % faster),
// QPN8 loses (5120x17408 M = 1: 28 % slower); the runs: benchmarks/NOTES.md, "Decode kernels:
// history moved out of the kernel comments".
struct QpnBatchX {
    QpnFragB f[QPN_X_BATCH ? QPN_UNROLL : 1];
};

// QPN_WS: a producer lane's share of a batch's x, loaded two batches ahead of its use (qpn_ws_batches)
// and stored into the ring when the batch is computed. Empty in the other builds.
struct QpnStageX {
#if QPN_WS
    uint4 v[QPN_WS_X_UNITS];
#endif
};

__device__ __forceinline__ void qpn_x_prefetch(QpnStageX& sx, const QpnX& xs, int i, int n_local) {
#if QPN_WS
#pragma unroll
    for (int r = 0; r < QPN_WS_X_UNITS; ++r) {
        const int v = threadIdx.x + r * QPN_WARPS * 32;
        const int u = v / (QPN_BLOCK_NB2 * 32), jp = (v / 32) % QPN_BLOCK_NB2;
        sx.v[r] = make_uint4(0u, 0u, 0u, 0u);
        if (v < QPN_X_STAGE && i + u < n_local && jp < xs.pairs)
            sx.v[r] = __ldcg(xs.g + (long long)(i + u) * xs.nb2_all * 32 + jp * 32 + (v & 31));  // L2: other blocks' x
    }
#else
    (void)sx, (void)xs, (void)i, (void)n_local;
#endif
}

// QPN_GEMM: stage batch i (groups i .. i + U - 1 of the slice) into the next buffer, then one barrier:
// every warp has finished the batch before the previous one, the last reader of that buffer.
// QPN_WS (producers): wait until the consumers have emptied the batch's ring slot (its previous batch),
// then store the prefetched x; the slot is handed over by qpn_batch_end.
__device__ __forceinline__ void qpn_x_batch_start(QpnBatchX& xb, QpnX& xs, int i, bool full, int n_local,
                                                  const QpnStageX& sx)
{
#if QPN_TEAM > 1  // the round the batch starts at; each group's x is loaded by qpn_take_group
    (void)xb, (void)full, (void)sx;
    xs.round = i;
    xs.left = n_local;
#elif QPN_WS
    (void)xb, (void)i, (void)full, (void)n_local;
    const int slot = xs.stage % QPN_WS_STAGES;
    if (xs.stage >= QPN_WS_STAGES) qpn_bar_sync(QPN_WS_EMPTY(slot), QPN_BLOCK_THREADS);
#pragma unroll
    for (int r = 0; r < QPN_WS_X_UNITS; ++r) {
        const int v = threadIdx.x + r * QPN_WARPS * 32;
        if (v < QPN_X_STAGE) xs.s[slot * QPN_X_STAGE + v] = sx.v[r];
    }
#elif QPN_GEMM
    (void)xb, (void)full, (void)sx;
    uint4* dst = xs.s + xs.buf * QPN_X_STAGE;
    for (int v = threadIdx.x; v < QPN_X_STAGE; v += QPN_WARPS * 32) {
        const int u = v / (QPN_NB2 * 32), jp = (v / 32) % QPN_NB2;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (i + u < n_local && jp < xs.pairs)
            val = __ldcg(xs.g + (long long)(i + u) * xs.nb2_all * 32 + jp * 32 + (v & 31));  // L2: other blocks' x
        dst[v] = val;
    }
    xs.buf ^= 1;
    __syncthreads();
#elif QPN_X_BATCH
    (void)sx;
#pragma unroll
    for (int u = 0; u < QPN_UNROLL; ++u) qpn_load_x_group(xb.f[u], xs, i, u, full || i + u < n_local);
#else
    (void)xb, (void)xs, (void)i, (void)full, (void)n_local, (void)sx;
#endif
}

// The end of a batch: QPN_WS producers hand its ring slot to the consumers (bar.arrive orders the
// producer's shared-memory stores before the consumers' reads); nothing in the other builds.
__device__ __forceinline__ void qpn_batch_end(QpnX& xs) {
#if QPN_WS
    qpn_bar_arrive(QPN_WS_FULL(xs.stage % QPN_WS_STAGES), QPN_BLOCK_THREADS);
    ++xs.stage;
#else
    (void)xs;
#endif
}

// A decoded group-tile (tile h, group u of the batch): multiplied into the warp's accumulators of tile h, or
// (QPN_WS producers) stored into the ring for the tile's consumers. (QPN_WS_RAW producers store codes.)
#if !QPN_WS_RAW
__device__ __forceinline__ void qpn_take_group(QpnAcc (&acc)[QPN_HT], const QpnFragA& a, const QpnFragB& xf,
                                               const QpnX& xs, int u, int h) {
#if QPN_TEAM > 1
    // into the warp's slot of tile h; after the last tile's, the round's T group-tiles of every tile (the team's
    // slots) by the warp's tokens: one barrier pair and one x load per group for all QPN_HT tiles
    (void)xf;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    uint4* mine = qpn_team_a + (w * QPN_HT + h) * 64 + lane;
    mine[0] = make_uint4(a[0][0], a[0][1], a[0][2], a[0][3]);
    mine[32] = make_uint4(a[1][0], a[1][1], a[1][2], a[1][3]);
    if (h < QPN_HT - 1) return;
    qpn_bar_sync(xs.bar_id, xs.bar_threads);
    const uint4* team = qpn_team_a + (w - qpn_warp_chunk(w)) * QPN_HT * 64 + lane;
    const int g0 = QPN_TEAM * (xs.round + u);
    auto multiply = [&](bool guarded) {
#pragma unroll
        for (int q = 0; q < QPN_TEAM; ++q) {
            QpnFragB xq;
#pragma unroll
            for (int t = 0; t < QPN_HT; ++t) {
                const uint4 a0 = team[(q * QPN_HT + t) * 64], a1 = team[(q * QPN_HT + t) * 64 + 32];
                const QpnFragA aq = {{a0.x, a0.y, a0.z, a0.w}, {a1.x, a1.y, a1.z, a1.w}};
                if (t == 0) qpn_team_x(xq, xs, g0 + q, guarded);  // after tile 0's A: the plain build's order
                qpn_mma_group(acc[t], aq, xq);
            }
        }
    };
    if (g0 + QPN_TEAM <= xs.left)  // uniform: the round lies in the slice (all but a last, partial one)
        multiply(false);
    else
        multiply(true);
    qpn_bar_sync(xs.bar_id, xs.bar_threads);  // every warp has read the slots before they are refilled
#elif QPN_WS
    (void)acc, (void)xf;
    uint4* p = &qpn_ws_a[xs.stage % QPN_WS_STAGES][threadIdx.x >> 5][h][u][0][threadIdx.x & 31];
    p[0] = make_uint4(a[0][0], a[0][1], a[0][2], a[0][3]);
    p[32] = make_uint4(a[1][0], a[1][1], a[1][2], a[1][3]);
#else
    (void)xs, (void)u;
    qpn_mma_group(acc[h], a, xf);
#endif
}
#endif

#if QPN_WS && QPN_WS_RAW
// QPN_WS_RAW producers: the lane's 16 bytes of its column, as the four 32-bit elements E_0 .. E_3 that
// quad lanes 0 .. 3 multiply (the format's order: qpn8_linear.cu), stored as row 8 (lane & 3) + (lane >> 2)
// of the group-tile: ldmatrix's matrix j = lane & 3, row gid = lane >> 2. Consumer lane (gid, t) then reads
// with one ldmatrix.x4 E_t of the columns of lanes 4 gid + j, j = 0 .. 3: the quad exchange, done by the
// shared-memory crossbar instead of 4 shuffles and 12 selects.
__device__ __forceinline__ void qpn_ws_store_codes(const uint4& e, const QpnX& xs, int u, int h) {
    const int lane = threadIdx.x & 31;
    qpn_ws_a[xs.stage % QPN_WS_STAGES][threadIdx.x >> 5][h][u][0][8 * (lane & 3) + (lane >> 2)] = e;
}

// consumer: r[j] = E_t of the column of quad lane j of this lane's quad (the exchange's f[j])
__device__ __forceinline__ void qpn_ws_load_codes(qpn_u32 (&r)[4], int slot, int tile, int h, int u) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(&qpn_ws_a[slot][tile][h][u][0][threadIdx.x & 31]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
#endif

// group u's fragments (loaded here when QPN_X_BATCH = 0)
__device__ __forceinline__ const QpnFragB& qpn_x_group(QpnBatchX& xb, const QpnX& xs, int i, int u, bool full, int n_local)
{
#if QPN_X_BATCH
    return xb.f[u];
#else
    qpn_load_x_group(xb.f[0], xs, i, u, full || i + u < n_local);
    return xb.f[0];
#endif
}

// ---------------------------------------------------------------------------------------------
// The main loop of both decode kernels: the warp's K-slice of n_local groups in batches of
// QPN_UNROLL groups (batch i = groups [i, i + U) of the slice): issue all of a batch's weight
// loads back to back, then compute it. Latency is hidden by the other warps of the SM (the
// registers allow 2 blocks of 16 warps where QPN_MIN_BLOCKS = 2), not inside the warp.
//   load(batch, u, i, valid)  issue group i + u's weight loads into slot u; valid = the group lies
//                             in the slice (uniform); a pad slot gets code 0 (decodes to zeros).
//   compute(batch, i, full)   decode and multiply groups i .. i+U-1; full = all lie in the slice
//                             (pad groups get x = 0: their mma add exactly +0).
// Chosen by measurement on the H200 (bench_decode.py "variants", results/decode_h200.md): single
// batches (M = 1, 28672 x 8192: QPN2 47.7 %, QPN8 83.3 % of the read ceiling) beat double-buffered
// and rolling pipelines; per-batch guards and base + immediate addresses keep the address math
// out of the loop. The pipelines' and the per-group guards' numbers: benchmarks/NOTES.md,
// "Decode kernels: history moved out of the kernel comments".
template <class Batch, class Load, class Compute>
__device__ __forceinline__ void qpn_run_batches(int n_local, Load&& load, Compute&& compute) {
    for (int i = 0; i < n_local; i += QPN_UNROLL) {
        Batch b;
        if (i + QPN_UNROLL <= n_local) {  // uniform: the steady state, no per-group guard
#pragma unroll
            for (int u = 0; u < QPN_UNROLL; ++u) load(b, u, i, true);
            compute(b, i, true);
        } else {  // the slice's last, partial batch (never for QPN2: K % 64 == 0, slices of 4k groups)
#pragma unroll
            for (int u = 0; u < QPN_UNROLL; ++u) load(b, u, i, i + u < n_local);
            compute(b, i, false);
        }
    }
}

#if QPN_WS
// The producers' K loop: a ring of QPN_WS_DEPTH batches of weight loads in registers (load(batch, i):
// groups i .. i + U - 1), refilled right after each batch is decoded, and the batches' x two ahead, so that
// a producer's loads are in flight while it waits for a ring slot and decodes. Measured (benchmarks/NOTES.md,
// "The warp-specialised GEMM"): depths 2, 4 and 6 time the same, and the producers still wait for loads
// issued 4 batches earlier. The ring is unrolled (registers cannot be indexed): the loop body is
// QPN_WS_DEPTH batches.
#ifndef QPN_WS_DEPTH
#define QPN_WS_DEPTH 4  // even: the x stages alternate between two registers sets
#endif
static_assert(QPN_WS_DEPTH % 2 == 0, "QPN_WS_DEPTH must be even");
template <class Batch, class Load, class Compute>
__device__ __forceinline__ void qpn_ws_batches(int n_local, const QpnX& xs, Load&& load, Compute&& compute) {
    Batch b[QPN_WS_DEPTH];
    QpnStageX sx[2];
#pragma unroll
    for (int d = 0; d < QPN_WS_DEPTH; ++d)
        if (d * QPN_UNROLL < n_local) load(b[d], d * QPN_UNROLL);
#pragma unroll
    for (int d = 0; d < 2; ++d) qpn_x_prefetch(sx[d], xs, d * QPN_UNROLL, n_local);
    for (int i = 0; i < n_local; i += QPN_WS_DEPTH * QPN_UNROLL) {
#pragma unroll
        for (int d = 0; d < QPN_WS_DEPTH; ++d) {
            const int at = i + d * QPN_UNROLL;
            if (at < n_local) {
                compute(b[d], at, sx[d % 2]);
                if (at + QPN_WS_DEPTH * QPN_UNROLL < n_local) load(b[d], at + QPN_WS_DEPTH * QPN_UNROLL);
                qpn_x_prefetch(sx[d % 2], xs, at + 2 * QPN_UNROLL, n_local);
            }
        }
    }
}

// A consumer's K loop: for each of the part's batches, wait for its ring slot, multiply the tile's A
// fragments (its producer's) by the warp's 8 * QPN_NB tokens of x, group by group in ascending order
// (qpn_mma_group: the plain build's sequence), and hand the slot back where a producer will refill it.
//   decode(r, h, g, a): QPN_WS_RAW only, the A fragments of tile h, group g of the layer, from its codes r.
template <class Decode>
__device__ __forceinline__ void qpn_ws_consume(QpnAcc (&acc)[QPN_HT], int g_begin, int n_local, Decode&& decode) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int tile = qpn_warp_tile(w), chunk = qpn_warp_chunk(w);
    const int stages = (n_local + QPN_UNROLL - 1) / QPN_UNROLL;
    for (int t = 0; t < stages; ++t) {
        const int slot = t % QPN_WS_STAGES;
        qpn_bar_sync(QPN_WS_FULL(slot), QPN_BLOCK_THREADS);
        const uint4* xp = qpn_ws_x + slot * QPN_X_STAGE + chunk * QPN_NB2 * 32 + lane;
#pragma unroll
        for (int u = 0; u < QPN_UNROLL; ++u) {
            QpnFragB xf;
#pragma unroll
            for (int jp = 0; jp < QPN_NB2; ++jp) {
                qpn_split_pair(xf, jp, xp[(u * QPN_BLOCK_NB2 + jp) * 32]);
            }
#pragma unroll
            for (int h = 0; h < QPN_HT; ++h) {
#if QPN_WS_RAW
                QpnFragA a;
                qpn_u32 r[4];
                qpn_ws_load_codes(r, slot, tile, h, u);
                decode(r, h, g_begin + t * QPN_UNROLL + u, a);
                const uint4 a0 = make_uint4(a[0][0], a[0][1], a[0][2], a[0][3]);
                const uint4 a1 = make_uint4(a[1][0], a[1][1], a[1][2], a[1][3]);
#else
                (void)decode;
                const uint4 a0 = qpn_ws_a[slot][tile][h][u][0][lane], a1 = qpn_ws_a[slot][tile][h][u][1][lane];
                const QpnFragA a = {{a0.x, a0.y, a0.z, a0.w}, {a1.x, a1.y, a1.z, a1.w}};
#endif
                qpn_mma_group(acc[h], a, xf);
            }
        }
        if (t + QPN_WS_STAGES < stages) qpn_bar_arrive(QPN_WS_EMPTY(slot), QPN_BLOCK_THREADS);
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// Split-K reduction and epilogue.
//
// Each warp of a block summed its own contiguous range of k-groups (in ascending group order)
// into acc; the block adds the warps' partial sums in shared memory in ascending warp order,
// always, then rounds once to fp16 (RN16). Nothing here depends on M: a row computed alone and
// the same row inside an M-row call go through identical fp32 operations (batch invariance).
//
// Shared memory: the warps pass through the buffer QPN_RED_WARPS at a time (rounds), one 8-token
// block at a time: red = QPN_RED_WARPS x QPN_HT x 1 KiB = 8 KiB in every build, plus the running
// sums between rounds (QPN_HT x 1 KiB). Round r adds warps [r R, r R + R) to the sum of the rounds
// before it (stored exactly in fp32), so every output is still ((w0 + w1) + w2) + ... in ascending
// warp order: the same bits as one round over all warps. Why not one slot per warp: a 16-warp
// buffer (17.4 KB, 34.8 KB gated) let a 64 KB Turing SM hold only 3 blocks of 8 warps (1 gated),
// 24 (8) of its 32 warps; with <= 12.3 KB per block the registers, not shared memory, set the
// occupancy of every decode build (tests/test_turing_compile.py, compile_check.occupancy_sm75).
#ifndef QPN_RED_WARPS
#define QPN_RED_WARPS (8 / QPN_HT)  // warps per reduction round: an 8 KiB partial buffer
#endif
//
// Gated epilogue (vLLM silu_and_mul on the rounded linear outputs):
//   out = RN16( RN16(silu32(RN16(gate))) * RN16(up) ),  silu32(v) = v / (1 + expf(-v)) in fp32;
// bf16 (bf16 = true): each RN16 an RN_bf16, the values bf16 bits (vLLM's act_and_mul for scalar_t = bf16).
__device__ __forceinline__ qpn_u16 qpn_silu_mul(qpn_u16 gate16, qpn_u16 up16, bool bf16) {
    const float v = qpn_value_of(gate16, bf16);
    const float silu = __fdiv_rn(v, __fadd_rn(1.0f, expf(-v)));  // IEEE division (--prec-div=true)
    const qpn_u16 silu16 = qpn_round_to(silu, bf16);
    // half * half: the exact product (22 significant bits) in fp32, rounded once to fp16 (bf16 * bf16: 16
    // bits, exact unless below 2^-126, then RN32 first, as c10::BFloat16's multiply)
    return qpn_round_to(__fmul_rn(qpn_value_of(silu16, bf16), qpn_value_of(up16, bf16)), bf16);
}

// The dtype and factor of an output row (bf16 x: docs/DESIGN.md, "bf16 activations", the Turing path). The
// kernels take fp16 x; for bf16 x the host first writes x16 = x * 2^e(row), exact, and factor[row] = 2^-e
// (x_bf16.cu), so an output's fp32 sum times its x row's factor is the bf16 row's sum (exact unless it lands
// below 2^-126), rounded once to bf16. x_factor = null: fp16 x, factor 1, RN16 (the fp16 bits, unchanged).
struct QpnOutRow {
    float factor;
    bool bf16;
};

// QPN_MX = 1 (MXFP4, qpn2_linear.cu): each tile's fp32 sums times its 2^T, exact, before the one RN16
// (docs/DESIGN.md, "MXFP4 weight"); the stores take the tiles' 2^T as one more argument.
#ifndef QPN_MX
#define QPN_MX 0
#endif
#if QPN_MX
#define QPN_OUT_SCALE_PARAM , const float (&out_scale)[QPN_HT]
#define QPN_OUT_SCALE_ARG(v) , v
#else
#define QPN_OUT_SCALE_PARAM
#define QPN_OUT_SCALE_ARG(v)
#endif

// The MoE builds' epilogue (QPN_MOE = 1; gpt-oss's experts, docs/DESIGN.md "gpt-oss experts"), chosen per
// launch by kernel arguments, not builds (moe.py, launch_moe): an optional fp32 bias per output row added
// to the (2^T-scaled) fp32 sum with one RN32 before the one RN16, and, gated, silu_and_mul or gpt-oss's
// clamped SwiGLU. A null bias and QPN_ACT_SILU are the bias-free MoE epilogue, bit for bit. The dense
// builds take none of it (the macros below are empty there).
#define QPN_ACT_SILU 0       // moe.py ACTIVATIONS lists the activations in this order
#define QPN_ACT_SWIGLUOAI 1
#if QPN_MOE
struct QpnEpilogue {
    const float* __restrict__ bias;  // the expert's N biases (gated: gate rows [0, N/2), up [N/2, N)), or null
    int up;                          // gated: the up rows' offset in bias (N/2 = y_cols)
    int act;                         // QPN_ACT_SILU / QPN_ACT_SWIGLUOAI (gated builds)
    float alpha, limit;              // swigluoai's constants (qpn.ref.gpt_oss SWIGLU_ALPHA / SWIGLU_LIMIT)
    const int* row_map;              // bf16 x: output row m's x row is row_map[row0 + m] (or row0 + m: null)
    int row0;
};
#define QPN_EPILOGUE_PARAM , const QpnEpilogue& ep
#define QPN_EPILOGUE_ARG(ep) , ep
#define QPN_EPILOGUE_COL_PARAM , const QpnEpilogue& ep, int col
#define QPN_EPILOGUE_COL_ARG(ep, col) , ep, col
#else
#define QPN_EPILOGUE_PARAM
#define QPN_EPILOGUE_ARG(ep)
#define QPN_EPILOGUE_COL_PARAM
#define QPN_EPILOGUE_COL_ARG(ep, col)
#endif

// gpt-oss's clamped SwiGLU on the rounded gate / up (vLLM's swigluoai_and_mul, qpn.ref.gpt_oss op for op,
// each fp32 operation rounded once): g = min(gate, limit), u = clamp(up, -limit, limit) (the ternaries keep
// a NaN a NaN, as the reference's np.minimum / np.clip), s = 1 / (1 + expf(-(g * alpha))), glu = g * s,
// out = RN16((u + 1) * glu).
__device__ __forceinline__ qpn_u16 qpn_swigluoai_mul(qpn_u16 gate16, qpn_u16 up16, float alpha, float limit, bool bf16) {
    const float gate = qpn_value_of(gate16, bf16), up = qpn_value_of(up16, bf16);
    const float g = gate > limit ? limit : gate;
    const float u = up > limit ? limit : (up < -limit ? -limit : up);
    const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fmul_rn(g, alpha))));  // IEEE division
    const float glu = __fmul_rn(g, s);
    return qpn_round_to(__fmul_rn(__fadd_rn(u, 1.0f), glu), bf16);
}

// Output row m's QpnOutRow (m: the launch's row; MoE builds: the pass's, its x row through the route).
__device__ __forceinline__ QpnOutRow qpn_out_row(const float* __restrict__ x_factor, int m QPN_EPILOGUE_PARAM) {
    QpnOutRow r = {1.0f, x_factor != nullptr};
    if (r.bf16) {
#if QPN_MOE
        r.factor = x_factor[ep.row_map ? ep.row_map[ep.row0 + m] : ep.row0 + m];
#else
        r.factor = x_factor[m];
#endif
    }
    return r;
}

// The slot's outputs from their fp32 sums s[h] (gate, up when gated): one RN16 (bf16: times the row's factor,
// one RN_bf16), the epilogue. MoE builds: `col` is the output's y column (its gate / down bias row; gated, the
// up row is col + ep.up).
__device__ __forceinline__ qpn_u16 qpn_output(const float (&s)[QPN_HT], const QpnOutRow& row
                                              QPN_OUT_SCALE_PARAM QPN_EPILOGUE_COL_PARAM) {
    float t[QPN_HT];
#pragma unroll
    for (int h = 0; h < QPN_HT; ++h) {
#if QPN_MX
        t[h] = __fmul_rn(s[h], out_scale[h]);  // exact: a power of two
#else
        t[h] = s[h];
#endif
        // exact too (powers of two) unless the product lands below 2^-126; then one more fp32 rounding of at
        // most 2^-149: with MXFP4's 2^T the two the bf16 bound allows after the sum (qpn.ref.linear FP16_ROWS_POST)
        if (row.bf16) t[h] = __fmul_rn(t[h], row.factor);
    }
#if QPN_MOE
    if (ep.bias != nullptr) {  // uniform: one RN32 before the RN16
#pragma unroll
        for (int h = 0; h < QPN_HT; ++h) t[h] = __fadd_rn(t[h], ep.bias[col + h * ep.up]);
    }
#endif
#if QPN_GATED
#if QPN_MOE
    if (ep.act == QPN_ACT_SWIGLUOAI)
        return qpn_swigluoai_mul(qpn_round_to(t[0], row.bf16), qpn_round_to(t[1], row.bf16), ep.alpha, ep.limit,
                                 row.bf16);
#endif
    return qpn_silu_mul(qpn_round_to(t[0], row.bf16), qpn_round_to(t[1], row.bf16), row.bf16);
#else
    return qpn_round_to(t[0], row.bf16);
#endif
}

#if QPN_PAIR
// QPN_PAIR: tile h's own output from its fp32 sum: qpn_output's plain form, which reads the first sum only
__device__ __forceinline__ qpn_u16 qpn_output_tile(float s, const QpnOutRow& row) {
    const float t[QPN_HT] = {s, s};
    return qpn_output(t, row);
}
#endif

// Every warp's acc[h][j][rb][i] (the block's QPN_HT tiles) -> y.
//   non-gated: y [M][N], tile = QPN_BLOCK_TILE      gated: gate tile, up tile -> y [M][N/2]
// y_cols = row length of y; the block's outputs are y columns [32 b, 32 b + 32), b = QPN_BLOCK_TILE.
//
// Split-K across blocks (gridDim.y = parts > 1, for layers with too few tiles to fill the GPU):
// block (b, part) holds the K-slices [part * split, (part + 1) * split) and writes its block
// sum to partial[part][h][m][y_cols] (fp32); the last of the column's blocks to arrive (ticket
// counter per block column b, in the call's workspace, zeroed by the wrapper on the call's stream
// before the launch: no state outlives a call) adds the parts in ascending
// order -- fixed whatever the arrival order, so the result is deterministic and, as the split
// depends on N, K and the SM count, never on M, batch-invariant -- and stores the outputs.
__device__ __forceinline__ void qpn_reduce_store(
    float (*red)[QPN_HT][2][4][32], float (*red_sum)[256], const QpnAcc (&acc)[QPN_HT],
    qpn_u16* __restrict__ y, int m_rows, int y_cols, float* __restrict__ partial, unsigned* __restrict__ tickets,
    const float* __restrict__ x_factor QPN_OUT_SCALE_PARAM QPN_EPILOGUE_PARAM)
{
    __shared__ unsigned last_part;
    const int lane = threadIdx.x & 31;
    // the warp's K-slice and token chunk (QPN_TEAM: the team's warps hold its 8-token blocks QPN_NB at a time)
    const int warp = qpn_warp_tile(threadIdx.x >> 5), chunk = qpn_warp_chunk(threadIdx.x >> 5);
    const int split = (blockDim.x >> 5) / QPN_TEAM;
    const int parts = gridDim.y, part = blockIdx.y;
    const int col0 = 32 * QPN_BLOCK_TILE;
#pragma unroll
    for (int j = 0; j < QPN_NB * QPN_TEAM; ++j) {
        if (8 * j >= m_rows) break;  // uniform
        for (int w0 = 0; w0 < split; w0 += QPN_RED_WARPS) {  // rounds (uniform)
            const int round_warps = min(QPN_RED_WARPS, split - w0);
            const bool last_round = w0 + QPN_RED_WARPS >= split;
            __syncthreads();  // the previous round's (or block's) slots and sums are consumed
            if (warp >= w0 && warp < w0 + QPN_RED_WARPS && chunk == j / QPN_NB) {
#pragma unroll
                for (int h = 0; h < QPN_HT; ++h)
#pragma unroll
                    for (int rb = 0; rb < 2; ++rb)
#pragma unroll
                        for (int i = 0; i < 4; ++i) red[warp - w0][h][rb][i][lane] = acc[h][j % QPN_NB][rb][i];
            }
            __syncthreads();
            // 256 outputs of this 8-token block: v = 32 * token + column (consecutive threads store
            // consecutive columns of one token row: 64-byte segments); v's thread is the same in
            // every round, so its running sum red_sum[h][v] needs no barrier of its own
            for (int v = threadIdx.x; v < 256; v += blockDim.x) {
                const int mt = v >> 5, c = v & 31;
                const int m = 8 * j + mt;
                if (m >= m_rows) continue;
                const int owner = (c & 3) | (((c >> 3) & 3) << 2) | (((c >> 2) & 1) << 4);  // lane_of_column
                const int qp = owner & 3;                      // position in the owner's quad
                const int rb = qp >> 1;                        // rowblock 0: quad lanes 0,1; 1: 2,3
                const int i = 2 * (qp & 1) + (mt & 1);         // row gid (i=0,1) or gid+8 (i=2,3)
                const int src = 4 * (owner >> 2) + (mt >> 1);  // lane holding (that row, token mt)
                float s[QPN_HT];
#pragma unroll
                for (int h = 0; h < QPN_HT; ++h) {
                    s[h] = w0 == 0 ? red[0][h][rb][i][src] : __fadd_rn(red_sum[h][v], red[0][h][rb][i][src]);
                    for (int w = 1; w < round_warps; ++w) s[h] = __fadd_rn(s[h], red[w][h][rb][i][src]);
                }
                if (!last_round) {
#pragma unroll
                    for (int h = 0; h < QPN_HT; ++h) red_sum[h][v] = s[h];  // exact: the fp32 sum so far
                    continue;
                }
                const long long at = (long long)m * y_cols + col0 + c;
                if (parts == 1) {
                    y[at] = qpn_output(s, qpn_out_row(x_factor, m QPN_EPILOGUE_ARG(ep)) QPN_OUT_SCALE_ARG(out_scale)
                                       QPN_EPILOGUE_COL_ARG(ep, col0 + c));
                } else {
#pragma unroll
                    for (int h = 0; h < QPN_HT; ++h)
                        partial[((long long)part * QPN_HT + h) * m_rows * y_cols + at] = s[h];
                }
            }
        }
    }
    if (parts == 1) return;
    __threadfence();  // this block's partials are visible device-wide before its ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        last_part = atomicAdd(&tickets[QPN_BLOCK_TILE], 1u) == (unsigned)(parts - 1);
    }
    __syncthreads();
    if (!last_part) return;
    __threadfence();
    for (int v = threadIdx.x; v < 32 * m_rows; v += blockDim.x) {
        const long long at = (long long)(v >> 5) * y_cols + col0 + (v & 31);
        float s[QPN_HT];
#pragma unroll
        for (int h = 0; h < QPN_HT; ++h) {
            s[h] = __ldcg(partial + (long long)h * m_rows * y_cols + at);  // L2: written by other SMs
            for (int p = 1; p < parts; ++p)
                s[h] = __fadd_rn(s[h], __ldcg(partial + ((long long)p * QPN_HT + h) * m_rows * y_cols + at));
        }
        y[at] = qpn_output(s, qpn_out_row(x_factor, v >> 5 QPN_EPILOGUE_ARG(ep)) QPN_OUT_SCALE_ARG(out_scale)
                           QPN_EPILOGUE_COL_ARG(ep, col0 + (v & 31)));
    }
}

// ---------------------------------------------------------------------------------------------
// QPN_GEMM epilogue: each warp holds whole sums of its own tile(s) for the part's K range, so it
// rounds and stores them itself. Lane (gid, t) holds, per 8-token block j and rowblock rb, the
// columns col(4 gid + 2 rb) (acc [0], [1]) and col(4 gid + 2 rb) + 1 (acc [2], [3]) -- adjacent,
// stored as one 32-bit pair -- for tokens 8 j + 2 t (acc [0], [2]) and 8 j + 2 t + 1 ([1], [3]).
// Parts (gridDim.y > 1): every block writes its fp32 sums to partial[part][h][m][y_cols]; the last
// block of a (slot block, token block) to arrive (ticket) adds the parts in ascending order, the
// same order whatever the arrival order. The parts depend on N, K and the SM count, never on M, and
// a token's sums never meet another token's: a row gives the same bits in every GEMM call.
#if QPN_GEMM
// visit(j, rb, tok, m, at) for every output pair the lane holds inside the call: 8-token block j,
// rowblock rb, token 2 t + tok of the block (row m of y), `at` = the pair's first element in y [M][y_cols].
template <class Visit>
__device__ __forceinline__ void qpn_gemm_each_pair(const QpnSlice& sl, int m_rows, int y_cols, Visit&& visit) {
    const int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
#if QPN_TEAM > 1
    // the warp's slot (a live warp's: unclamped) re-read here: held through the K loop, it spilled the
    // 64-register team builds (the other builds keep sl.slot: re-read, it spilled the gated MXFP4 GEMM)
    unsigned bx, tid;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bx));
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    const int slot = (int)bx * QPN_WARPS + qpn_warp_tile((int)(tid >> 5));
#else
    const int slot = sl.slot;
#endif
    const int col_base = 32 * slot + 8 * (gid & 3) + 4 * (gid >> 2);  // col(4 gid + 2 rb) - 2 rb
    const int m_base = sl.tok0 + 2 * t;
#pragma unroll
    for (int j = 0; j < QPN_NB; ++j)
#pragma unroll
        for (int tok = 0; tok < 2; ++tok) {
            const int m = m_base + 8 * j + tok;
            if (m >= m_rows) continue;
#pragma unroll
            for (int rb = 0; rb < 2; ++rb) visit(j, rb, tok, m, (long long)m * y_cols + col_base + 2 * rb);
        }
}

// The block's warps that store (QPN_WS: the consumers), their barrier and the one that takes the ticket.
#if QPN_WS
#define QPN_GEMM_STORE_SYNC() qpn_bar_sync(QPN_WS_STORE_BARRIER, QPN_WARPS * QPN_WS_CZ * 32)
#define QPN_GEMM_STORE_LEADER (QPN_WARPS * 32)
#else
#define QPN_GEMM_STORE_SYNC() __syncthreads()
#define QPN_GEMM_STORE_LEADER 0
#endif

__device__ __forceinline__ void qpn_gemm_store(
    const QpnAcc (&acc)[QPN_HT], const QpnSlice& sl, qpn_u16* __restrict__ y, int m_rows, int y_cols,
    float* __restrict__ partial, unsigned* __restrict__ tickets, const float* __restrict__ x_factor
    QPN_OUT_SCALE_PARAM)
{
    __shared__ unsigned last_part;
    const int parts = gridDim.y, part = blockIdx.y;
    const long long plane = (long long)m_rows * y_cols;
    if (parts > 1) {
        if (sl.live)
            qpn_gemm_each_pair(sl, m_rows, y_cols, [&](int j, int rb, int tok, int, long long at) {
#pragma unroll
                for (int h = 0; h < QPN_HT; ++h) {
                    float* p = partial + ((long long)part * QPN_HT + h) * plane + at;
                    *reinterpret_cast<float2*>(p) = make_float2(acc[h][j][rb][tok], acc[h][j][rb][2 + tok]);
                }
            });
        __threadfence();  // this block's partials are visible device-wide before its ticket
        QPN_GEMM_STORE_SYNC();
        if (threadIdx.x == QPN_GEMM_STORE_LEADER)
            last_part = atomicAdd(&tickets[blockIdx.z * gridDim.x + blockIdx.x], 1u) == (unsigned)(parts - 1);
        QPN_GEMM_STORE_SYNC();
        if (!last_part) return;
        __threadfence();
    }
    if (!sl.live) return;
    qpn_gemm_each_pair(sl, m_rows, y_cols, [&](int j, int rb, int tok, int m, long long at) {
        float s0[QPN_HT], s1[QPN_HT];
#pragma unroll
        for (int h = 0; h < QPN_HT; ++h) {
            if (parts == 1) {
                s0[h] = acc[h][j][rb][tok];
                s1[h] = acc[h][j][rb][2 + tok];
            } else {
                const float* p = partial + (long long)h * plane + at;
                float2 v = __ldcg(reinterpret_cast<const float2*>(p));  // L2: written by other SMs
                for (int q = 1; q < parts; ++q) {
                    const float2 w = __ldcg(reinterpret_cast<const float2*>(p + (long long)q * QPN_HT * plane));
                    v = make_float2(__fadd_rn(v.x, w.x), __fadd_rn(v.y, w.y));
                }
                s0[h] = v.x;
                s1[h] = v.y;
            }
        }
        const QpnOutRow row = qpn_out_row(x_factor, m);
#if QPN_PAIR  // y [M][2 y_cols]: tile h's columns are y_cols h further (`at` indexes the planes of y_cols)
#pragma unroll
        for (int h = 0; h < QPN_HT; ++h)
            *reinterpret_cast<qpn_u32*>(y + at + (long long)m * y_cols + h * y_cols) =
                (qpn_u32)qpn_output_tile(s0[h], row) | ((qpn_u32)qpn_output_tile(s1[h], row) << 16);
#else
        *reinterpret_cast<qpn_u32*>(y + at) = (qpn_u32)qpn_output(s0, row QPN_OUT_SCALE_ARG(out_scale)) |
                                              ((qpn_u32)qpn_output(s1, row QPN_OUT_SCALE_ARG(out_scale)) << 16);
#endif
    });
}
#endif
