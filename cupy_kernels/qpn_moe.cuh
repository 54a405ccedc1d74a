// qpn_moe.cuh: the fused mixture-of-experts decode (cupy_kernels/moe.py): the route the routing kernel
// writes, and how a decode kernel built with QPN_MOE = 1 finds its work.
//
// The route (int32, one per chunk of tokens, written by qpn_moe_route on the call's stream) for E experts
// and S = M * top_k choices (slots):
//   off         [E + 1]       expert e's slots are [off[e], off[e + 1]): the choices of e in ascending
//                             (token, choice) order, so its rows are its tokens in ascending order
//   slot_token  [S]           the token (x row) of each slot
//   slot_of     [S]           the slot of choice (m, j) at m * top_k + j; -1 for an id outside [0, E)
//   class_count [QPN_MOE_CLASSES]            the pieces of each class
//   class_list  [QPN_MOE_CLASSES][list_len]  the pieces of class c, each e | p << 16: expert e's slots
//                                            [off[e] + 32 p, min(off[e + 1], off[e] + 32 p + 32)), by
//                                            expert, then p
// An expert's slots are cut into pieces of QPN_PIECE_ROWS (32, the largest decode build's rows): its full
// pieces are class 3, its remainder of r rows class (r - 1) / 8. Class c runs the decode build of c + 1
// 8-token blocks (QPN_NB), so a block multiplies exactly the 8-token blocks its piece has (or passes of a
// smaller build where that one would spill: moe.py, CLASS_PASSES); the launch's grid is fixed by (E, S,
// c) (moe.py, class_blocks), never by the counts: a block past its class's count exits before any load
// (graph-capturable; the experts nobody hits are never read). Blocks x = piece * passes + pass run
// fastest, the output tile is z: the pieces of one expert read its tile side by side (once from DRAM).
#pragma once

#ifndef QPN_MOE
#define QPN_MOE 0
#endif
// The MoE builds and the route kernels (moe.py defines QPN_ROUTE_THREADS for them); the dense decode
// builds include this file for an empty QPN_MOE_PARAMS only.
#if QPN_MOE || defined(QPN_ROUTE_THREADS)
// QPN_MOE_CLASSES (8-token blocks of the largest decode build) comes from moe.py (MOE_CLASSES) as a
// define, stated once.
#if !defined(QPN_MOE_CLASSES)
#error "build through cupy_kernels/moe.py: it defines QPN_MOE_CLASSES"
#endif
#define QPN_PIECE_ROWS (8 * QPN_MOE_CLASSES)
#define QPN_PIECE_SHIFT 16  // a class-list entry: expert | piece << 16 (E <= 1024, pieces <= 32)

struct QpnRoute {  // int offsets of the route's parts
    int off, slot_token, slot_of, class_count, class_list, list_len;
};

__host__ __device__ __forceinline__ QpnRoute qpn_route_layout(int experts, int slots) {
    QpnRoute r;
    r.off = 0;
    r.slot_token = experts + 1;
    r.slot_of = r.slot_token + slots;
    r.class_count = r.slot_of + slots;
    r.class_list = r.class_count + QPN_MOE_CLASSES;
    r.list_len = (experts < slots ? experts : slots) + slots / QPN_PIECE_ROWS;  // remainders + full pieces
    return r;
}
#endif

#if QPN_MOE
#if QPN_X_FRAG || QPN_GEMM
#error "the MoE builds read x rows through the route (QPN_X_FRAG = 0, QPN_GEMM = 0)"
#endif

// The MoE build's extra kernel parameters: the route; its E and S; the class this launch serves and the
// passes it takes (blocks x = list index * passes + pass, each pass 8 * QPN_NB of the piece's rows);
// map_x = 1: x row r of the expert is token slot_token[off[e] + r] (gate/up reads the tokens),
// 0: row off[e] + r (down reads the slot-ordered hidden rows); the scale buffer's per-expert stride; the
// epilogue's (qpn_mma.cuh, QpnEpilogue): fp32 biases [E][N] (null: none), the gated activation
// (QPN_ACT_SILU / QPN_ACT_SWIGLUOAI) and swigluoai's alpha and limit.
#define QPN_MOE_PARAMS , const int* __restrict__ route, int experts, int slots, int route_class, int passes, \
    int map_x, long long scale_expert_stride, const float* __restrict__ bias, int activation, float swiglu_alpha, \
    float swiglu_limit

struct QpnExpert {
    int e;               // the expert
    int row0;            // the pass's first slot (also its split-K ticket row: passes never share a slot)
    int rows;            // the pass's slots (0: this block has no work)
    const int* row_map;  // x row of slot row0 + r: row_map[row0 + r], or row0 + r when null
};

// Block x of class `cls`'s launch -> its expert, piece and pass (uniform over the block: read before any
// barrier).
__device__ __forceinline__ QpnExpert qpn_moe_expert(const int* __restrict__ route, int experts, int slots,
                                                    int cls, int passes, int map_x) {
    const QpnRoute r = qpn_route_layout(experts, slots);
    QpnExpert ex = {0, 0, 0, nullptr};
    const int item = blockIdx.x / passes, pass = blockIdx.x % passes;
    if (item >= route[r.class_count + cls]) return ex;
    const int entry = route[r.class_list + cls * r.list_len + item];
    ex.e = entry & ((1 << QPN_PIECE_SHIFT) - 1);
    const int piece0 = route[r.off + ex.e] + QPN_PIECE_ROWS * (entry >> QPN_PIECE_SHIFT);
    const int piece_end = min(route[r.off + ex.e + 1], piece0 + QPN_PIECE_ROWS);
    ex.row0 = piece0 + pass * 8 * QPN_NB;
    ex.rows = max(0, min(piece_end - ex.row0, 8 * QPN_NB));
    ex.row_map = map_x ? route + r.slot_token : nullptr;
    return ex;
}

// The pass's rows of y and its split-K state: y rows [row0, row0 + rows); the partial sums at
// row0 * (parts * QPN_HT * y_cols) and the tickets at row0 * (output tiles): the passes' row ranges
// tile the chunk's S rows.
__device__ __forceinline__ void qpn_moe_rows(const QpnExpert& ex, int y_cols, int& m_rows, qpn_u16* __restrict__& y,
                                             float* __restrict__& partial, unsigned* __restrict__& tickets) {
    m_rows = ex.rows;
    y += (long long)ex.row0 * y_cols;
    if (gridDim.y > 1) {
        partial += (long long)ex.row0 * gridDim.y * QPN_HT * y_cols;
        tickets += (long long)ex.row0 * QPN_BLOCK_TILES;
    }
}

// The epilogue of the block's [N, K] projection: its expert's row of the [E][N] biases, the activation and its
// constants, and for bf16 x (x_factor non-null) the pass's rows of x (qpn_out_row). The expert and the pass
// are read from the route again here (uniform, L1 hits), from inputs made opaque: held through the K loop (or
// re-derived from the prologue's values, which the compiler then keeps), they grew the K loops of 12 of the
// 28 MoE builds by 2-33 sm_75 SASS instructions; re-read, only one loop moved, by 3 (qpn8 block scales,
// gated, 8 tokens: 311; tests/fixtures/turing_loop_counts.json).
__device__ __forceinline__ QpnEpilogue qpn_moe_epilogue(const int* __restrict__ route, int experts, int slots, int cls,
                                                        int passes, int map_x, const float* __restrict__ bias,
                                                        const float* __restrict__ x_factor, int n, int activation,
                                                        float alpha, float limit) {
    QpnEpilogue ep;
    ep.bias = nullptr;
    ep.row_map = nullptr;
    ep.row0 = 0;
    if (bias != nullptr || x_factor != nullptr) {
        int block;
        asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(block));
        asm volatile("" : "+r"(experts), "+r"(slots), "+r"(cls), "+r"(passes), "+r"(map_x));
        const QpnRoute r = qpn_route_layout(experts, slots);
        const int entry = route[r.class_list + cls * r.list_len + block / passes];
        const int e = entry & ((1 << QPN_PIECE_SHIFT) - 1);
        if (bias != nullptr) ep.bias = bias + (long long)e * n;
        // the pass's first slot, as qpn_moe_expert: the piece's, plus the passes before it
        ep.row0 = route[r.off + e] + QPN_PIECE_ROWS * (entry >> QPN_PIECE_SHIFT) + (block % passes) * 8 * QPN_NB;
        ep.row_map = map_x ? route + r.slot_token : nullptr;
    }
    ep.up = n / 2;
    ep.act = activation;
    ep.alpha = alpha;
    ep.limit = limit;
    return ep;
}
#else
#define QPN_MOE_PARAMS
#endif
