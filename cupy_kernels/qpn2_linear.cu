// qpn2_linear.cu: y = x @ W16^T for a QPN2 (NVFP4) weight, M <= 32 tokens (the decode path).
//
// Kernel:  qpn2_linear
// Macros:  QPN_NB             8-token blocks (the host launches QPN_NB = ceil(M / 8))   qpn_mma.cuh
//          QPN_GATED          0: y [M][N];  1: y [M][N/2] = silu_and_mul(gate rows [0,N/2), up rows [N/2,N))
//          QPN_WARPS          most warps per block (launch bound, shared-memory size)
//          QPN_UNROLL, QPN_MIN_BLOCKS, QPN_X_BATCH   the load batches (qpn_mma.cuh)
//          QPN_X_FRAG         0: x as [M][K] rows;  1: x as fragments (x_fragments.cu, qpn_mma.cuh)
//          QPN_GEMM, QPN_WS   the GEMM builds (gemm.py; qpn_mma.cuh): a warp per tile; warp-specialised
//                             producers (decode) and consumers (mma)
//          QPN_TEAM           T warps per K-slice (decode builds) or tile (GEMM builds) share its decode through
//                             shared memory, each multiplying its own 8 * QPN_NB tokens (qpn_mma.cuh)
//          QPN_MOE            1: stacked experts, the block's expert from the route (qpn_moe.cuh, moe.py);
//                             per launch, a bias and the gated activation (qpn_mma.cuh, QpnEpilogue)
//          QPN_MX             1: MXFP4 in the QPNMX layout (docs/QPNMX.md): e8m0 scale bytes, one per 32 k,
//                             gscale = the tiles' 2^T; the block constant {2^F, 0} (below, "MXFP4")
//
// Reads   codes   [tile N/32][group G=K/16][lane 32][8 bytes]  QPN2 order (docs/QPN2.md)
//         scales  [tile][group][lane]  e4m3 bytes
//         gscale  fp32, g(tile) = gscale[tile * gs_stride]  (stride 0: scalar, 1: per 32-column tile)
//         x       fp16 [M][K] row-major, or its fragments (QPN_X_FRAG = 1)
// Writes  y       fp16 [M][N] (gated: [M][N/2])
//         x_factor  null: fp16 x and y. bf16 x: x holds the rows x16 = x * 2^e(row) (x_bf16.cu), x_factor
//                   [row] = 2^-e, and y is bf16: each sum times its row's factor, one RN_bf16 (qpn_mma.cuh)
// Shared  red + red_sum (split-K rounds: 8 + QPN_HT KiB, qpn_reduce_store) + a 256-entry {X, Y} table
//         per tile (1 KiB): 10.0 KB (gated 12.0 KB) per block, so a 64 KB Turing SM's registers, not
//         its shared memory, set how many blocks it holds
//
// Numerics: the weights are exactly the contract's W16 = RN16(RN32(e2m1 * RN32(e4m3 * g))),
// products W16 * x exact in the tensor core, fp32 accumulation, one RN16 at the end.
//
// Work split. Block (b, p) = tile b (gated: gate tile b and up tile b + N/64), part p; warp w of
// the block = K-slice s = p * split + w, groups [s * groups_per_warp, (s+1) * groups_per_warp) of
// the block's tiles (split-K inside the block, partials added in shared memory in ascending warp order:
// qpn_reduce_store). The host
// chooses the split from N, K and the SM count, never from M (batch invariance); layers with few
// tiles also split K across blocks (gridDim.y parts, added in a fixed order: qpn_reduce_store).
//
// Per lane, per group, per tile (the inner loop):
//  1. load    its own 8 code bytes (the owner's column, 16 k) + 1 scale byte (streaming), and
//             the B fragments (x, one 8-byte load per 8 tokens: qpn_mma.cuh's k-slot map).
//  2. scale   {X, Y} of the owner's block from a 256-entry shared table built per tile at block
//             start (X = 2 (B1 - B0), Y = 3 B0 - 2 B1 with B0 = RN16(S), B1 = RN16(RN32(1.5 S)),
//             S = RN32(e4m3 * g): both exact in fp16 -- Sterbenz, and Y is a few ulp(B0));
//             the quad gathers its four columns' {X, Y} (4 shuffles).
//  3. exchange the A fragment wants, per lane, 4 k of each of the quad's 4 columns; the QPN2
//             bytes give a lane 16 k of one column. The 4x4 transpose of 16-bit "chunks"
//             (4 codes = 2 bytes) inside the quad is done on the raw codes, 4x cheaper than on
//             fp16 values: 2 shuffles + 6 byte permutes per 16 codes (measured: removing it
//             entirely speeds the kernel up by only 2-6 %).
//             Owner chunk for quad lane d: bytes (d, d+2) of word d>>1 = (B_x, B_y) holding
//             k (4d, 4d+2) in the low/high nibble of B_x and (4d+1, 4d+3) of B_y.
//  4. decode  exact W16 pairs (see "Decode"), 4 mma per 8 tokens.
//
// Decode (per fp16 pair of one column, two consecutive k). With e2m1 = p * c, p a power of two
// (0.5, 1, 2, 4, or 0) and c in {1, 1.5}: for every nonzero code W16 = p * B_c where B_1 = B0 and
// B_1.5 = B1 (RN16(2^j v) = 2^j RN16(v) while everything stays in fp16's normal range, and
// RN32(2^j v) = 2^j RN32(v)). Code 1 (0.5) is p = 0.5, c = 1. Writing e = p*c (the exact e2m1
// value, fp16) the contract value is the exact real number
//        W16 = e * X + p * Y        (c = 1: p(X+Y) = p B0;  c = 1.5: p(1.5X + Y) = p B1)
// computed as  W = fma.rn.f16x2(e, X, mul.rn.f16x2(p, Y)):  p*Y is exact (Y is a small
// multiple of ulp(B0)), the fma rounds the exact W16 once, i.e. returns it unchanged.
//   e14 = e * 2^-14 comes from the nibble with two masks (sign -> bit 15, magnitude -> 9..11),
//   e   = e14 * 2^14 (exact), p = e with the mantissa bit 9 cleared (code 1: e = 0.5 has none).
// (A single multiply e * B0 -- upstream's "variant E" -- is wrong by one ulp for c = 1.5 in
// 15-27 % of weights; the family c must enter per element, and e, p are the cheapest pair of
// per-element values that carry it: 2 FMA-pipe ops + 1 LOP3 + the normalising HMUL2 per pair.)
// Fast path valid iff |S| >= 2^-13 (B0 >= 2^-13: every W16, p*Y and 0.5*B0 normal and exact)
// or S == 0; tests/test_decode_math.py proves it exhaustively on the CPU (all 254 non-NaN scale
// bytes x 16 codes x ~3000 global scales). A batch where any lane's block is below that (blocks
// whose weights are all < 7.3e-4: fp16-subnormal territory, never seen in LLM-like weights) takes
// the exact fp32 path for the whole warp:  W16 = cvt.rn.f16(RN32(e2m1 * S)), the contract itself.
// Measured cost of that path: 0.1 % such blocks (3 % of warp-batches of 4 groups) -> +0-1 % time.
// The test is one bit (QPN2_SLOW_FLAG, Y's exponent MSB) of the OR of the batch's table entries:
// the table stores the all-ones marker for those blocks and also for blocks whose own {X, Y} has
// that bit (|Y| >= 2: only blocks with |S| >= 2^10, i.e. weights up to 6 * 1024, never seen in
// practice; they take the exact path, so still exact; tests/test_decode_math.py checks both).
// 2 LOP3 per 4 entries instead of 4 compares, and the vote reads the predicate.
//
// MXFP4 (QPN_MX = 1; docs/DESIGN.md, "MXFP4 weight"): W16 = RN16(e2m1 * 2^F), F = s - 127 - T(tile)
// <= 13. With S = 2^F exact, B0 = 2^F and B1 = 1.5 * 2^F are exact too, so {X, Y} = {2^F, 0} and the
// fast decode is fma(e, 2^F, 0): one rounding, exact while 2^F is an fp16 number (F >= -24: down to
// fp16's subnormals, where the fma's one rounding is the contract's). F < -24 (a block 37+ binades
// below its tile's largest) takes the exact path with S = 2^F in fp32. The sums leave times 2^T
// (qpn_output): exact in fp32. A group's scale byte serves its 32-k block: groups 2j and 2j + 1 share
// one load (QPN_UNROLL even), or load it twice (QPN_UNROLL = 1: the gated builds of 17-32 tokens, which
// spill at 2 groups per batch).
//
// Measured on the H200 (compute_75 PTX JIT-compiled; benchmarks/results/decode_h200.md), 28672x8192:
// M = 1 60.8 us = 47.6 % of the read ceiling (QPN8: 82.9 %); M = 32 1.16x cuBLAS fp16.
// The kernel is issue-bound. sm_75 SASS of the fast path, M <= 8, 64 registers (benchmarks/turing_model.py):
// 80 instructions per group-tile (512 weights) -- 32 decode (4 fp16/logic ops per pair), 22
// nibble fields, 8 exchange, 4 {X, Y} gather, 4 mma, 4 loads (code, scale, x, table), 6 loop and
// slow-path control; ~63 per group-tile is where 132 SMs x 4 schedulers at ~1.9 GHz would issue
// as fast as the 288 bytes per group-tile stream in. How the count came down, the stage ablations
// (benchmarks/ablate) and what was tried and kept off: benchmarks/NOTES.md, "Decode kernels:
// history moved out of the kernel comments".
#include "qpn_mma.cuh"
#include "qpn_moe.cuh"

#if QPN_WS_RAW
#error "QPN_WS_RAW (consumers decode the codes) is built for QPN8 only (qpn8_linear.cu)"
#endif

#define QPN2_SLOW_XY 0xFFFFFFFFu  // scale-table marker: this (byte, g) block takes the exact path
#define QPN2_SLOW_FLAG 0x40000000u  // 0100 0000 ... : Y's exponent MSB (|Y| >= 2), set in the marker

#if QPN_MX  // (qpn_mma.cuh defaults it to 0)
#define QPN2_SCALE_K 32  // k per scale byte: one e8m0 per 32 k
static_assert(QPN_UNROLL == 1 || QPN_UNROLL % 2 == 0, "an MXFP4 batch holds whole 32-k blocks, or one group");
#else
#define QPN2_SCALE_K QPN_GROUP_K  // one e4m3 per 16 k
#endif

struct Qpn2Batch {  // one load batch: QPN_UNROLL groups of the warp's tiles
    uint2 code[QPN_UNROLL][QPN_HT];
    qpn_u32 scale[QPN_UNROLL][QPN_HT];
};

// One byte, zero-extended by the load itself (ld.u8 into a 32-bit register): indexes the {X, Y}
// table as is. `__ldcs` on a u8 pointer returns an 8-bit value whose widening ptxas re-masks
// (an IMAD.SHL + LOP3 `& 0x3FC` per table index instead of one IMAD.SHL).
__device__ __forceinline__ qpn_u32 qpn_ldcs_u8(const qpn_u8* p) {
    qpn_u32 v;
    asm volatile("ld.global.cs.u8 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Group u of the batch into slot u; pc / ps point at the batch's first group (the K loop
// advances them, so every address is a pointer plus the immediate u * 256 / u * 32).
__device__ __forceinline__ void qpn2_load_slot(
    Qpn2Batch& sl, int u, const qpn_u8* const (&pc)[QPN_HT], const qpn_u8* const (&ps)[QPN_HT])
{
#pragma unroll
    for (int h = 0; h < QPN_HT; ++h) {
        sl.code[u][h] = qpn_ldcs_u2(pc[h] + 256 * u);  // 32 lanes x 8 bytes per group
#if QPN_MX
        sl.scale[u][h] = (u & 1) ? sl.scale[u - 1][h] : qpn_ldcs_u8(ps[h] + 32 * (u / 2));  // one per 32 k
#else
        sl.scale[u][h] = qpn_ldcs_u8(ps[h] + 32 * u);
#endif
    }
}

// Whether any lane of the warp has flag != 0: the vote's predicate straight from the value
// (`__any_sync(flag != 0)` costs an extra compare, and a bool cast a shift, mask and compare).
__device__ __forceinline__ bool qpn2_warp_any_flag(qpn_u32 flag) {
    qpn_u32 any;
    asm("{.reg .pred p;\n\t"
        "setp.ne.u32 p, %1, 0;\n\t"
        "vote.sync.any.pred p, p, 0xFFFFFFFF;\n\t"
        "selp.u32 %0, 1, 0, p;}"
        : "=r"(any) : "r"(flag));
    return any != 0;
}

// Owner's block constants: xy = {X, Y} (fp16 pair), s = S = RN32(e4m3 * g).
__device__ __forceinline__ qpn_u32 qpn2_block_xy(qpn_u32 scale_byte, float g, float& s) {
    s = __fmul_rn(qpn_e4m3_to_float(scale_byte), g);                       // RN32(e4m3 * g)
    const qpn_u32 b0 = qpn_float_to_half_rn(s);                            // B0 = RN16(S)
    const qpn_u32 b1 = qpn_float_to_half_rn(__fmul_rn(s, 1.5f));          // B1 = RN16(RN32(1.5 S))
    const qpn_u32 p = b0 | (b1 << 16);                                     // {B0, B1}
    const qpn_u32 q = b1 | (b0 << 16);                                     // {B1, B0}
    const qpn_u32 r = qpn_hmul2_rn(p, 0xC000C000u);                        // {-2 B0, -2 B1}, exact
    return qpn_hfma2_rn(q, 0x42004000u, r);                                // {2 B1 - 2 B0, 3 B0 - 2 B1}
}

// MXFP4: the block constant of e8m0 byte `s` in a tile of 2^T (t_exp = T): {2^F, 0}, F = s - 127 - T, or
// the exact-path marker where 2^F is no fp16 number (F < -24; F > 15 never occurs in a valid tile).
__device__ __forceinline__ qpn_u32 qpnmx_block_xy(qpn_u32 s, int t_exp) {
    const int f = (int)s - 127 - t_exp;
    if (f < -24 || f > 15) return QPN2_SLOW_XY;
    return f >= -14 ? (qpn_u32)(f + 15) << 10 : 1u << (f + 24);  // fp16 bits of 2^F (normal / subnormal)
}

// Exact W16 pair from an e14 pair (e2m1 * 2^-14 in both halves) and the column's {X, Y}.
// The {X, X} / {Y, Y} broadcasts are written as PTX half moves, which ptxas folds into the
// .H0_H0 / .H1_H1 operand swizzles of HFMA2 / HMUL2 (checked in the SASS: no PRMT).
__device__ __forceinline__ qpn_u32 qpn2_decode_fast(qpn_u32 e14, qpn_u32 xy) {
    const qpn_u32 e = qpn_hmul2_rn(e14, 0x74007400u);  // * 2^14 (0x7400 = 16384.0), exact
    const qpn_u32 p = e & 0xFDFFFDFFu;                  // clear mantissa bit 9: 1.5 * 2^j -> 2^j
    qpn_u32 w;
    asm("{.reg .b16 x, y; .reg .b32 xx, yy, py;\n\t"
        "mov.b32 {x, y}, %3;\n\t"
        "mov.b32 xx, {x, x};\n\t"
        "mov.b32 yy, {y, y};\n\t"
        "mul.rn.f16x2 py, %2, yy;\n\t"
        "fma.rn.f16x2 %0, %1, xx, py;}"
        : "=r"(w) : "r"(e), "r"(p), "r"(xy));
    return w;
}

// The contract formula itself, for blocks outside the fast path's range.
__device__ __forceinline__ qpn_u32 qpn2_decode_exact(qpn_u32 e14, float s) {
    const qpn_u32 e = qpn_hmul2_rn(e14, 0x74007400u);
    const qpn_u32 lo = qpn_float_to_half_rn(__fmul_rn(qpn_half_to_float((qpn_u16)(e & 0xFFFFu)), s));
    const qpn_u32 hi = qpn_float_to_half_rn(__fmul_rn(qpn_half_to_float((qpn_u16)(e >> 16)), s));
    return lo | (hi << 16);
}

// One exchanged word w = [c.x, c'.x, c.y, c'.y] (columns c = quad lane 2rb, c' = 2rb+1) ->
// the four e14 pairs: e[0] = c step A, e[1] = c' step A, e[2] = c step B, e[3] = c' step B.
//   nibbles of w: 0 c k0 | 1 c k2 | 2 c' k0 | 3 c' k2 | 4 c k1 | 5 c k3 | 6 c' k1 | 7 c' k3
//   (k relative to 4t). Pair (i, i+4) -> one fp16 pair; the split keeps odd nibbles only, so
//   (r | r >> 3) has the sign of nibble 3 (7) at bit 15 (31) and its magnitude at 9..11
//   (25..27), and nibble 1 (5) at bit 7 / 1..3 (23 / 17..19).
__device__ __forceinline__ void qpn2_e14_pairs(qpn_u32 w, qpn_u32 (&e)[4]) {
    // odd nibbles (step B): sign bits from w, magnitudes from w >> 3; the bits outside the final
    // masks are don't-care, so one LOP3 (c ? a : b with c = 0x80808080) builds both fields
    const qpn_u32 ta = qpn_select_bits(w, w >> 3, 0x80808080u);
    // even nibbles (step A): the same on w << 4 ((w << 4) >> 3 equals w << 1 on every kept bit)
    const qpn_u32 tb = qpn_select_bits(w << 4, w << 1, 0x80808080u);
    e[0] = (tb & 0x008E008Eu) << 8;  // 0x8E = 1000_1110: sign bit, 3 magnitude bits
    e[1] = tb & 0x8E008E00u;
    e[2] = (ta & 0x008E008Eu) << 8;
    e[3] = ta & 0x8E008E00u;
}

extern "C" __global__ void __launch_bounds__(QPN_BLOCK_THREADS, QPN_MIN_BLOCKS) qpn2_linear(
    const qpn_u8* __restrict__ codes, const qpn_u8* __restrict__ scales, const float* __restrict__ gscale,
    int gs_stride, const void* __restrict__ x, qpn_u16* __restrict__ y, int m_rows, int n, int k,
    int groups_per_warp, float* __restrict__ partial, unsigned* __restrict__ tickets,
    const float* __restrict__ x_factor QPN_MOE_PARAMS)
{
#if QPN_MOE  // stacked experts: this block's expert, or nothing to do (before any load or barrier)
    const QpnExpert ex = qpn_moe_expert(route, experts, slots, route_class, passes, map_x);
    if (ex.rows == 0) return;
    codes += (long long)ex.e * n * (k / 2);
    scales += (long long)ex.e * n * (k / QPN2_SCALE_K);
    gscale += ex.e * scale_expert_stride;
    qpn_moe_rows(ex, QPN_GATED ? n / 2 : n, m_rows, y, partial, tickets);
#endif
#if !QPN_GEMM
    __shared__ float red[QPN_RED_WARPS][QPN_HT][2][4][32];  // split-K rounds (qpn_reduce_store)
    __shared__ float red_sum[QPN_HT][256];
#endif
    __shared__ qpn_u32 xy_table[QPN_WARP_TILES * QPN_HT][256];  // {X, Y} of every scale byte for each tile's g
    const int lane = threadIdx.x & 31;
    const QpnSlice sl = qpn_block_slice(n, k, groups_per_warp);
    const int n_local = sl.n_local;

    float gval[QPN_HT];  // g(tile); MXFP4: the tile's 2^T
#pragma unroll
    for (int h = 0; h < QPN_HT; ++h) gval[h] = gscale[(long long)sl.tile[h] * gs_stride];
#if QPN_MX
    // T for the exact path's S = 2^F (2^T is exact, T >= -140, so ilogbf reads it back): held by the decode
    // builds (read back on that path it grew their loops by 0.5-4 instructions per group-tile), re-read by
    // the GEMM builds (held, it spilled the gated one)
#if QPN_GEMM
#define QPNMX_T_EXP(h) ilogbf(gval[h])
#else
    int t_exp[QPN_HT];
#pragma unroll
    for (int h = 0; h < QPN_HT; ++h) t_exp[h] = ilogbf(gval[h]);
#define QPNMX_T_EXP(h) t_exp[h]
#endif
#endif

    // The block constants depend only on (scale byte, g): a 256-entry table per tile replaces
    // ~15 instructions per lane and group (2 cvt, 3 fmul, packs, 2 fp16 ops) by one LDS.
#if QPN_GEMM
    // One table per distinct g among the block's tiles (one, where the layer has one global scale):
    // table e = w * QPN_HT + h (warp w's tile h) is built only if no earlier tile has the same g,
    // else the warp reads that one. A table per tile costs 256 entries x ~30 instructions per warp,
    // as many as the K loop of a 64-group part (64 x ~120).
    __shared__ float table_g[QPN_WARP_TILES * QPN_HT];
    __shared__ int table_of[QPN_WARP_TILES * QPN_HT];
    if (threadIdx.x < QPN_WARP_TILES * QPN_HT) {
        const int e = threadIdx.x;
        table_g[e] = gscale[(long long)qpn_tile_of_slot(n, qpn_slot_of_tile(n, e / QPN_HT), e % QPN_HT) * gs_stride];
    }
    __syncthreads();
    if (threadIdx.x < QPN_WARP_TILES * QPN_HT) {
        int first = threadIdx.x;
        for (int e = 0; e < first; ++e)
            if (__float_as_uint(table_g[e]) == __float_as_uint(table_g[threadIdx.x])) first = e;  // the earliest
        table_of[threadIdx.x] = first;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < QPN_WARP_TILES * QPN_HT * 256; i += blockDim.x) {
        if (table_of[i >> 8] != (i >> 8)) continue;  // shares an earlier table
        const float g = table_g[i >> 8];
#else
    for (int i = threadIdx.x; i < QPN_HT * 256; i += blockDim.x) {
        const float g = i < 256 ? gval[0] : gval[QPN_HT - 1];
#endif
#if QPN_MX
        xy_table[i >> 8][i & 255] = qpnmx_block_xy(i & 255, ilogbf(g));
#else
        float s;
        const qpn_u32 xy = qpn2_block_xy(i & 255, g, s);
        xy_table[i >> 8][i & 255] = ((fabsf(s) < 0x1p-13f && s != 0.0f) || (xy & QPN2_SLOW_FLAG)) ? QPN2_SLOW_XY : xy;
#endif
    }
    __syncthreads();
#if QPN_WS
    if (qpn_ws_consumer()) {  // the tile's tokens: multiply what its producer decodes, then store
        QpnAcc cacc[QPN_HT] = {};
        qpn_ws_consume(cacc, sl.g_begin, n_local, 0);
        qpn_gemm_store(cacc, sl, y, m_rows, QPN_HT == 2 ? n / 2 : n, partial, tickets, x_factor QPN_OUT_SCALE_ARG(gval));
        return;
    }
#endif
#if QPN_GEMM
    const qpn_u32* tables[QPN_HT];  // this warp's tiles' tables
#pragma unroll
    for (int h = 0; h < QPN_HT; ++h) tables[h] = xy_table[table_of[qpn_warp_tile(threadIdx.x >> 5) * QPN_HT + h]];
#else
    qpn_u32 (*const tables)[256] = xy_table;
#endif

    // per-tile / per-token-block base pointers at the warp's first group (see qpn2_load_slot; QPN_TEAM: the
    // slice's group `rank`)
    const qpn_u8* pc[QPN_HT];
    const qpn_u8* ps[QPN_HT];
#pragma unroll
    for (int h = 0; h < QPN_HT; ++h) {
        const long long unit = ((long long)sl.tile[h] * (k / QPN_GROUP_K) + sl.g_begin + sl.rank) * 32 + lane;
        pc[h] = codes + unit * 8;
        // the slice starts on a whole 32-k block (g_begin: a multiple of 4 groups, linear.SLICE_MULTIPLE)
        ps[h] = scales + ((long long)sl.tile[h] * (k / QPN2_SCALE_K) + (sl.g_begin + sl.rank) * QPN_GROUP_K / QPN2_SCALE_K)
                * 32 + lane;
    }
#if QPN_MOE
    QpnX xs = qpn_x_source(x, m_rows, k, sl.g_begin, ex.row_map, ex.row0);
#else
    QpnX xs = qpn_x_source(x, m_rows, k, sl.g_begin);
#endif

    // lane-dependent byte-permute selectors of the quad transpose (see header comment)
    const int q0 = lane & 1, q1 = (lane >> 1) & 1;
    qpn_u32 sel_keep1 = q0 ? QPN_PRMT_ODD_BYTES : QPN_PRMT_EVEN_BYTES;
    qpn_u32 sel_send1 = q0 ? QPN_PRMT_EVEN_BYTES : QPN_PRMT_ODD_BYTES;
    qpn_u32 sel_keep2 = q0 ? (q1 ? QPN_PRMT_HIGH_HALVES_BA : QPN_PRMT_LOW_HALVES_BA)
                           : (q1 ? QPN_PRMT_HIGH_HALVES : QPN_PRMT_LOW_HALVES);
    qpn_u32 sel_send2 = q0 ? (q1 ? QPN_PRMT_LOW_HALVES_BA : QPN_PRMT_HIGH_HALVES_BA)
                           : (q1 ? QPN_PRMT_LOW_HALVES : QPN_PRMT_HIGH_HALVES);
    qpn_u32 sel_fin0 = q1 ? QPN_PRMT_B_EVEN_ODD : QPN_PRMT_A_EVEN_ODD;
    qpn_u32 sel_fin1 = q1 ? QPN_PRMT_A_EVEN_ODD : QPN_PRMT_B_EVEN_ODD;
    // opaque to the compiler: without this it rebuilds all six from SR_TID in every iteration of the
    // K loop (15-19 SASS instructions per 4 group-tiles; not register pressure: it did so at 87
    // registers too); held, they take 6 of the 64 registers and no instruction in the loop
    asm volatile("" : "+r"(sel_keep1), "+r"(sel_send1), "+r"(sel_keep2), "+r"(sel_send2), "+r"(sel_fin0), "+r"(sel_fin1));

    QpnAcc acc[QPN_HT] = {};

    // one group x tile: exchange, decode (fast or exact), 4 mma per 8 tokens
    auto group_tile = [&](const Qpn2Batch& b, const QpnFragB& xf, int u, int tt, qpn_u32 xy, bool exact) {
        const qpn_u32 w0 = b.code[u][tt].x, w1 = b.code[u][tt].y;
        const qpn_u32 keep = qpn_prmt(w0, w1, sel_keep1);
        const qpn_u32 recv = __shfl_xor_sync(0xFFFFFFFFu, qpn_prmt(w0, w1, sel_send1), 1);
        const qpn_u32 keep2 = qpn_prmt(keep, recv, sel_keep2);
        const qpn_u32 recv2 = __shfl_xor_sync(0xFFFFFFFFu, qpn_prmt(keep, recv, sel_send2), 2);
        const qpn_u32 wq[2] = {qpn_prmt(keep2, recv2, sel_fin0), qpn_prmt(keep2, recv2, sel_fin1)};
        QpnFragA a;
        // the owner column's decode constant -- {X, Y}, or S = RN32(e4m3 * g) on the exact path --
        // gathered for the quad's four columns (`exact` is a constant at both call sites)
#if QPN_MX
        const qpn_u32 own = exact ? __float_as_uint(ldexpf(1.0f, (int)b.scale[u][tt] - 127 - QPNMX_T_EXP(tt))) : xy;
#else
        const qpn_u32 own = exact ? __float_as_uint(__fmul_rn(qpn_e4m3_to_float(b.scale[u][tt]), gval[tt])) : xy;
#endif
        qpn_u32 col[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) col[c] = __shfl_sync(0xFFFFFFFFu, own, c, 4);  // width 4: source lane quad | c, an immediate
#pragma unroll
        for (int rb = 0; rb < 2; ++rb) {
            qpn_u32 e[4];
            qpn2_e14_pairs(wq[rb], e);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const qpn_u32 c = col[2 * rb + (i & 1)];
                a[rb][i] = exact ? qpn2_decode_exact(e[i], __uint_as_float(c)) : qpn2_decode_fast(e[i], c);
            }
        }
        qpn_take_group(acc, a, xf, xs, u, tt);
    };

    // One batch: look the U groups' block constants up, vote once whether any block needs the
    // exact path, then run the batch branch-free (lets the compiler interleave its groups).
    auto compute = [&](const Qpn2Batch& b, int i, bool full, const QpnStageX& sx) {
        QpnBatchX xb;
        qpn_x_batch_start(xb, xs, i, full, n_local, sx);
        qpn_u32 xy[QPN_UNROLL][QPN_HT];
        qpn_u32 any_xy = 0;
#pragma unroll
        for (int u = 0; u < QPN_UNROLL; ++u)
#pragma unroll
            for (int tt = 0; tt < QPN_HT; ++tt) {
                xy[u][tt] = tables[tt][b.scale[u][tt]];
                any_xy |= xy[u][tt];
            }
        auto run = [&](bool exact_path) {
#pragma unroll
            for (int u = 0; u < QPN_UNROLL; ++u) {
                const QpnFragB& xf = qpn_x_group(xb, xs, i, u, full, n_local);
#pragma unroll
                for (int tt = 0; tt < QPN_HT; ++tt) group_tile(b, xf, u, tt, xy[u][tt], exact_path);
            }
        };
        if (qpn2_warp_any_flag(any_xy & QPN2_SLOW_FLAG))
            run(true);
        else
            run(false);
        qpn_batch_end(xs);
    };
    // The K loop (qpn_run_batches without its partial batch): a QPN2 slice is whole batches (K % 64 == 0
    // and groups_per_warp a multiple of 4: linear.SLICE_MULTIPLE), and the pointers advance by one
    // batch per iteration, so every load is a pointer plus an immediate (no per-batch address math).
    auto advance = [&](int i) {
#pragma unroll
        for (int h = 0; h < QPN_HT; ++h) {
            pc[h] += 256 * QPN_UNROLL;
#if QPN_MX && QPN_UNROLL == 1
            if (i & 1) ps[h] += 32;  // one group per batch: the next 32-k block after each odd group
#else
            ps[h] += 32 * QPN_UNROLL * QPN_GROUP_K / QPN2_SCALE_K;
#endif
        }
    };
#if QPN_TEAM > 1  // the warp's groups T v + rank of rounds v (a pad round past the slice: code 0, scale byte 0)
    qpn_run_batches<Qpn2Batch>(qpn_team_rounds(n_local, groups_per_warp), [&](Qpn2Batch& b, int u, int i, bool valid) {
        const bool own = valid && qpn_team_owns(sl, i + u);
#pragma unroll
        for (int h = 0; h < QPN_HT; ++h) {
            b.code[u][h] = own ? qpn_ldcs_u2(pc[h] + 256 * QPN_TEAM * (long long)(i + u)) : make_uint2(0u, 0u);
            b.scale[u][h] = own ? qpn_ldcs_u8(ps[h] + 32 * QPN_TEAM * (long long)(i + u)) : 0u;
        }
    }, [&](const Qpn2Batch& b, int i, bool full) { compute(b, i, full, QpnStageX{}); });
#elif QPN_WS  // producers: a ring of batches in flight (qpn_ws_batches), loaded in order
    qpn_ws_batches<Qpn2Batch>(n_local, xs, [&](Qpn2Batch& b, int i) {
#pragma unroll
        for (int u = 0; u < QPN_UNROLL; ++u) qpn2_load_slot(b, u, pc, ps);
        advance(i);
    }, [&](const Qpn2Batch& b, int i, const QpnStageX& sx) { compute(b, i, true, sx); });
#else
    for (int i = 0; i + QPN_UNROLL <= n_local; i += QPN_UNROLL) {  // never reads past the slice
        Qpn2Batch b;
#pragma unroll
        for (int u = 0; u < QPN_UNROLL; ++u) qpn2_load_slot(b, u, pc, ps);
        compute(b, 0, true, QpnStageX{});
        advance(i);
        qpn_x_advance(xs, QPN_UNROLL);
    }
#endif

#if QPN_WS
    (void)acc;  // producers: the consumers hold the sums
#elif QPN_GEMM
    qpn_gemm_store(acc, sl, y, m_rows, QPN_HT == 2 ? n / 2 : n, partial, tickets, x_factor QPN_OUT_SCALE_ARG(gval));
#else
#if QPN_MOE
    const QpnEpilogue ep = qpn_moe_epilogue(route, experts, slots, route_class, passes, map_x, bias, x_factor, n,
                                            activation, swiglu_alpha, swiglu_limit);  // bias, swigluoai: qpn_mma.cuh
#endif
    qpn_reduce_store(red, red_sum, acc, y, m_rows, QPN_GATED ? n / 2 : n, partial, tickets, x_factor QPN_OUT_SCALE_ARG(gval)
                     QPN_EPILOGUE_ARG(ep));
#endif
}
