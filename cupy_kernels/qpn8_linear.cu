// qpn8_linear.cu: y = x @ W16^T for a QPN8 (FP8 e4m3) weight, M <= 32 tokens (the decode path).
//
// Kernel:  qpn8_linear
// Macros:  QPN_NB, QPN_GATED, QPN_WARPS, QPN_UNROLL, QPN_MIN_BLOCKS, QPN_X_BATCH, QPN_X_FRAG   qpn_mma.cuh
//          QPN8_BLOCK_SCALES  0: channel / tensor scales S16[0, n];  1: 128x128 block S16[kb, t]
//          QPN_GEMM, QPN_WS, QPN_WS_RAW   the GEMM builds (gemm.py; qpn_mma.cuh): a warp per tile; warp-
//                             specialised producers and consumers; consumers that exchange (ldmatrix) and decode
//          QPN_TEAM           T warps per K-slice (decode builds) or tile (GEMM builds) share its decode through
//                             shared memory, each multiplying its own 8 * QPN_NB tokens (qpn_mma.cuh)
//          QPN_MOE            1: stacked experts, the block's expert from the route (qpn_moe.cuh, moe.py);
//                             per launch, a bias and the gated activation (qpn_mma.cuh, QpnEpilogue)
//
// Reads   codes   [tile N/32][group G=K/16][lane 32][16 bytes]  QPN8 order (docs/QPN8.md):
//                 lane byte p holds W[32t + col(lane)][16g + KORDER[p]]
//         gs16    fp16 group scales: channel [1, N] (S16[n]) or block [K/128, N/32] (S16[g/8][t])
//         x       fp16 [M][K] row-major, or its fragments (QPN_X_FRAG = 1)
// Writes  y       fp16 [M][N] (gated: [M][N/2], silu_and_mul of gate rows [0,N/2) and up rows [N/2,N))
//         x_factor  null: fp16 x and y. bf16 x: x holds the rows x16 = x * 2^e(row) (x_bf16.cu), x_factor
//                   [row] = 2^-e, and y is bf16: each sum times its row's factor, one RN_bf16 (qpn_mma.cuh)
//
// Numerics: W16 = RN16(e4m3 * 2^-8 * S16) is one mul.rn.f16x2 of the bit-trick value
// (byte b -> fp16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 7) = e4m3 * 2^-8, exact) by S16:
// the contract's own formula, bit for bit (tests/test_decode_math.py models it against qpn.ref).
// fp32 accumulation in the tensor core, split-K partials added in ascending warp order, one RN16.
//
// Work split and k-slot map: as qpn2_linear.cu (qpn_mma.cuh): quad lane t multiplies, for each of
// its quad's 4 columns, the k = 4t..4t+3 of every group.
// Exchange: the owner's 16 bytes (positions p -> k KORDER[p]) give the element for quad lane d
//     E_d = [k 4d, k 4d+2, k 4d+1, k 4d+3]  = bytes (0,1) of word 2(d>>1) and of word 2(d>>1)+1,
// (d odd: bytes (2,3)), one byte permute each; a 4x4 transpose of these 32-bit elements inside
// the quad costs 4 shuffles and 12 selects per 16 weights (QPN8 streams 2x the bytes of QPN2
// per weight, so it has twice QPN2's instruction budget per weight).
// Decode of E: step A pair (k 4t, 4t+1) = bytes 0, 2; step B pair (k 4t+2, 4t+3) = bytes 1, 3.
//
// Measured on the H200 (compute_75 PTX JIT-compiled; benchmarks/results/decode_h200.md), M = 1,
// % of the read ceiling: 28672x8192 62.1 us = 82.9 % (M = 8: 81.3 %), 34816x5120 78.0 %,
// 4096x14336 64.0 %, 5120x17408 54.5 % (160 tiles on 132 SMs: split into 4 parts per tile across
// blocks). Chosen by measurement: batches of 4 groups (59 registers), no L2 prefetch, 8 warps per
// tile on 28672x8192; the alternatives' numbers: benchmarks/NOTES.md, "Decode kernels: history
// moved out of the kernel comments".
#include "qpn_mma.cuh"
#include "qpn_moe.cuh"

#ifndef QPN8_BLOCK_SCALES
#define QPN8_BLOCK_SCALES 0
#endif

struct Qpn8Batch {  // one load batch (qpn_run_batches): QPN_UNROLL groups of the warp's tiles
    uint4 code[QPN_UNROLL][QPN_HT];
};

// The warp's group of step g0 + u into slot u (pc: its first group; per-batch base g0 plus an immediate;
// QPN_TEAM: every T-th group of the slice); a pad group past the slice gets code 0 (decodes to +0).
__device__ __forceinline__ void qpn8_load_slot(Qpn8Batch& sl, int u, int g0, bool valid, const qpn_u8* const (&pc)[QPN_HT])
{
#pragma unroll
    for (int h = 0; h < QPN_HT; ++h)  // 32 lanes x 16 bytes per group
        sl.code[u][h] = valid ? qpn_ldcs_u4(pc[h] + 512 * QPN_TEAM * (long long)g0 + 512 * QPN_TEAM * u)
                              : make_uint4(0u, 0u, 0u, 0u);
}

// e4m3 bytes 0 and 2 of e -> fp16 pair (exact e4m3 * 2^-8); bytes 1 and 3 -> the other pair.
__device__ __forceinline__ qpn_u32 qpn8_pair_bytes02(qpn_u32 e) {
    return ((e & 0x00800080u) << 8) | ((e & 0x007F007Fu) << 7);  // sign -> 15, 0111_1111 -> 7..13
}
__device__ __forceinline__ qpn_u32 qpn8_pair_bytes13(qpn_u32 e) {
    return (e & 0x80008000u) | ((e >> 1) & 0x3F803F80u);
}

// W16 pair = RN16(bits * S16), S16 = the low (col_hi = 0) or high half of s2.
template <int HI>
__device__ __forceinline__ qpn_u32 qpn8_scale_pair(qpn_u32 bits, qpn_u32 s2) {
    qpn_u32 w;
    if (HI)
        asm("{.reg .b16 l, h; .reg .b32 ss; mov.b32 {l, h}, %2; mov.b32 ss, {h, h}; mul.rn.f16x2 %0, %1, ss;}"
            : "=r"(w) : "r"(bits), "r"(s2));
    else
        asm("{.reg .b16 l, h; .reg .b32 ss; mov.b32 {l, h}, %2; mov.b32 ss, {l, l}; mul.rn.f16x2 %0, %1, ss;}"
            : "=r"(w) : "r"(bits), "r"(s2));
    return w;
}

extern "C" __global__ void __launch_bounds__(QPN_BLOCK_THREADS, QPN_MIN_BLOCKS) qpn8_linear(
    const qpn_u8* __restrict__ codes, const qpn_u16* __restrict__ gs16, int kb_stride,
    const void* __restrict__ x, qpn_u16* __restrict__ y, int m_rows, int n, int k,
    int groups_per_warp, float* __restrict__ partial, unsigned* __restrict__ tickets,
    const float* __restrict__ x_factor QPN_MOE_PARAMS)
{
#if QPN_MOE  // stacked experts: this block's expert, or nothing to do (before any load or barrier)
    const QpnExpert ex = qpn_moe_expert(route, experts, slots, route_class, passes, map_x);
    if (ex.rows == 0) return;
    codes += (long long)ex.e * n * k;
    gs16 += ex.e * scale_expert_stride;
    qpn_moe_rows(ex, QPN_GATED ? n / 2 : n, m_rows, y, partial, tickets);
#endif
    const int lane = threadIdx.x & 31;
    const int quad = lane >> 2;
    const QpnSlice sl = qpn_block_slice(n, k, groups_per_warp);
    const int n_local = sl.n_local;
#if !QPN8_BLOCK_SCALES
    // channel scales of the quad's 4 columns col(4q+j) = 8(q&3) + 4(q>>2) + j: 8 contiguous bytes
    uint2 s16[QPN_HT];
#pragma unroll
    for (int tt = 0; tt < QPN_HT; ++tt) {
        const qpn_u16* p = gs16 + 32 * sl.tile[tt] + 8 * (quad & 3) + 4 * (quad >> 2);
        asm("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(s16[tt].x), "=r"(s16[tt].y) : "l"(p));
    }
#endif

    // The decode of one group-tile from its exchanged elements f[j] (from quad lane j's column), g the
    // layer's group: the decode kernels' formula (producers) and QPN_WS_RAW consumers' (from ldmatrix).
    auto decode = [&](const qpn_u32 (&f)[4], int tt, int g, QpnFragA& a) {
        (void)g;
#if QPN8_BLOCK_SCALES
        const qpn_u32 sb = gs16[(long long)(g >> 3) * kb_stride + sl.tile[tt]];
        const qpn_u32 s01 = sb | (sb << 16), s23 = s01;
#else
        const qpn_u32 s01 = s16[tt].x, s23 = s16[tt].y;
#endif
        a[0][0] = qpn8_scale_pair<0>(qpn8_pair_bytes02(f[0]), s01);
        a[0][1] = qpn8_scale_pair<1>(qpn8_pair_bytes02(f[1]), s01);
        a[0][2] = qpn8_scale_pair<0>(qpn8_pair_bytes13(f[0]), s01);
        a[0][3] = qpn8_scale_pair<1>(qpn8_pair_bytes13(f[1]), s01);
        a[1][0] = qpn8_scale_pair<0>(qpn8_pair_bytes02(f[2]), s23);
        a[1][1] = qpn8_scale_pair<1>(qpn8_pair_bytes02(f[3]), s23);
        a[1][2] = qpn8_scale_pair<0>(qpn8_pair_bytes13(f[2]), s23);
        a[1][3] = qpn8_scale_pair<1>(qpn8_pair_bytes13(f[3]), s23);
    };
#if QPN_WS
    if (qpn_ws_consumer()) {  // the tile's tokens: multiply what its producer decodes, then store
        QpnAcc cacc[QPN_HT] = {};
        qpn_ws_consume(cacc, sl.g_begin, n_local, decode);
        qpn_gemm_store(cacc, sl, y, m_rows, QPN_HT == 2 ? n / 2 : n, partial, tickets, x_factor);
        return;
    }
#endif

    const qpn_u8* pc[QPN_HT];
#pragma unroll
    for (int tt = 0; tt < QPN_HT; ++tt)
        pc[tt] = codes + (((long long)sl.tile[tt] * (k / QPN_GROUP_K) + sl.g_begin + sl.rank) * 32 + lane) * 16;
#if QPN_MOE
    QpnX xs = qpn_x_source(x, m_rows, k, sl.g_begin, ex.row_map, ex.row0);
#else
    QpnX xs = qpn_x_source(x, m_rows, k, sl.g_begin);
#endif

    const int q0 = lane & 1, q1 = (lane >> 1) & 1;
    const qpn_u32 sel_keep = q0 ? QPN_PRMT_HIGH_HALVES : QPN_PRMT_LOW_HALVES;
    const qpn_u32 sel_send = q0 ? QPN_PRMT_LOW_HALVES : QPN_PRMT_HIGH_HALVES;

    QpnAcc acc[QPN_HT] = {};

    // One batch: groups i .. i+U-1 of the slice (QPN_TEAM: the warp's groups of rounds i .. i+U-1).
    auto compute = [&](const Qpn8Batch& b, int i, bool full, const QpnStageX& sx) {
        const int g0 = sl.g_begin + sl.rank + QPN_TEAM * i;  // (block scales only)
        QpnBatchX xb;
        qpn_x_batch_start(xb, xs, i, full, n_local, sx);
#pragma unroll
        for (int u = 0; u < QPN_UNROLL; ++u) {
            const QpnFragB& xf = qpn_x_group(xb, xs, i, u, full, n_local);
#pragma unroll
            for (int tt = 0; tt < QPN_HT; ++tt) {
                const uint4 c = b.code[u][tt];
#if QPN_WS_RAW  // the consumers exchange (ldmatrix) and decode
                qpn_ws_store_codes(make_uint4(qpn_prmt(c.x, c.y, QPN_PRMT_LOW_HALVES), qpn_prmt(c.x, c.y, QPN_PRMT_HIGH_HALVES),
                                              qpn_prmt(c.z, c.w, QPN_PRMT_LOW_HALVES), qpn_prmt(c.z, c.w, QPN_PRMT_HIGH_HALVES)),
                                   xs, u, tt);
                (void)xf;
#else
                // round 1 (partner lane ^ 1): keep the elements for receivers of my parity
                const qpn_u32 keep_a = qpn_prmt(c.x, c.y, sel_keep), keep_b = qpn_prmt(c.z, c.w, sel_keep);
                const qpn_u32 recv_a = __shfl_xor_sync(0xFFFFFFFFu, qpn_prmt(c.x, c.y, sel_send), 1);
                const qpn_u32 recv_b = __shfl_xor_sync(0xFFFFFFFFu, qpn_prmt(c.z, c.w, sel_send), 1);
                // source order (lane & ~1 first) for receiver parity d (a) and d + 2 (b)
                const qpn_u32 pa0 = q0 ? recv_a : keep_a, pa1 = q0 ? keep_a : recv_a;
                const qpn_u32 pb0 = q0 ? recv_b : keep_b, pb1 = q0 ? keep_b : recv_b;
                // round 2 (partner lane ^ 2)
                const qpn_u32 k0 = q1 ? pb0 : pa0, k1 = q1 ? pb1 : pa1;
                const qpn_u32 r0 = __shfl_xor_sync(0xFFFFFFFFu, q1 ? pa0 : pb0, 2);
                const qpn_u32 r1 = __shfl_xor_sync(0xFFFFFFFFu, q1 ? pa1 : pb1, 2);
                const qpn_u32 f[4] = {q1 ? r0 : k0, q1 ? r1 : k1, q1 ? k0 : r0, q1 ? k1 : r1};  // from quad lane 0..3

                QpnFragA a;
                decode(f, tt, g0 + QPN_TEAM * u, a);

                qpn_take_group(acc, a, xf, xs, u, tt);
#endif
            }
        }
        qpn_batch_end(xs);
    };
#if QPN_WS  // producers: a ring of batches in flight (qpn_ws_batches)
    qpn_ws_batches<Qpn8Batch>(n_local, xs, [&](Qpn8Batch& b, int i) {
#pragma unroll
        for (int u = 0; u < QPN_UNROLL; ++u) qpn8_load_slot(b, u, i, i + u < n_local, pc);
    }, [&](const Qpn8Batch& b, int i, const QpnStageX& sx) { compute(b, i, i + QPN_UNROLL <= n_local, sx); });
#else
    qpn_run_batches<Qpn8Batch>(
        qpn_team_rounds(n_local, groups_per_warp),
        [&](Qpn8Batch& b, int u, int i, bool valid) { qpn8_load_slot(b, u, i, valid && qpn_team_owns(sl, i + u), pc); },
        [&](const Qpn8Batch& b, int i, bool full) { compute(b, i, full, QpnStageX{}); });
#endif

#if QPN_WS
    (void)acc;  // producers: the consumers hold the sums
#elif QPN_GEMM
    qpn_gemm_store(acc, sl, y, m_rows, QPN_HT == 2 ? n / 2 : n, partial, tickets, x_factor);  // QPN_PAIR: planes
#else
    __shared__ float red[QPN_RED_WARPS][QPN_HT][2][4][32];  // split-K rounds (qpn_reduce_store)
    __shared__ float red_sum[QPN_HT][256];
#if QPN_MOE
    const QpnEpilogue ep = qpn_moe_epilogue(route, experts, slots, route_class, passes, map_x, bias, x_factor, n,
                                            activation, swiglu_alpha, swiglu_limit);  // bias, swigluoai: qpn_mma.cuh
#endif
    qpn_reduce_store(red, red_sum, acc, y, m_rows, QPN_GATED ? n / 2 : n, partial, tickets, x_factor QPN_EPILOGUE_ARG(ep));
#endif
}
