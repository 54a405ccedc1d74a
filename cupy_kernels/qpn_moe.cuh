// qpn_moe.cuh: the fused mixture-of-experts decode (M <= 32 tokens; cupy_kernels/moe.py): the route
// the routing kernel writes, and how a decode kernel built with QPN_MOE = 1 finds its expert.
//
// The route (int32, one per call, written by qpn_moe_route on the call's stream) for E experts and
// S = M * top_k choices (slots):
//   off         [E + 1]       expert e's slots are [off[e], off[e + 1]): the choices of e in ascending
//                             (token, choice) order, so its rows are its tokens in ascending order
//   slot_token  [S]           the token (x row) of each slot
//   slot_of     [S]           the slot of choice (m, j) at m * top_k + j; -1 for an id outside [0, E)
//   class_count [QPN_MOE_CLASSES]             the hit experts of each class
//   class_list  [QPN_MOE_CLASSES][min(E, S)]  the hit experts of class c (count in [8c + 1, 8c + 8]),
//                                             ascending; class 3 also takes counts > 32 (rows clipped:
//                                             a top-k never chooses an expert twice for one token)
// Class c runs the decode build of c + 1 8-token blocks (QPN_NB), so a block multiplies exactly the
// 8-token blocks its expert has (or passes of a smaller build where that one would spill: moe.py,
// CLASS_PASSES); its grid's z extent is fixed by (E, S, c) (moe.py, class_blocks),
// never by the counts: a block past its class's count exits before any load (graph-capturable; the
// experts nobody hits are never read).
#pragma once

#ifndef QPN_MOE
#define QPN_MOE 0
#endif
// The MoE builds and the route kernels (moe.py defines QPN_ROUTE_THREADS for them); the dense decode
// builds include this file for an empty QPN_MOE_PARAMS only.
#if QPN_MOE || defined(QPN_ROUTE_THREADS)
// QPN_MOE_CLASSES (8-token blocks of the largest decode build) and QPN_MOE_MAX_PASSES (most passes of
// one class: the tickets' stride) come from moe.py (MOE_CLASSES, MAX_PASSES) as defines, stated once.
#if !defined(QPN_MOE_CLASSES) || !defined(QPN_MOE_MAX_PASSES)
#error "build through cupy_kernels/moe.py: it defines QPN_MOE_CLASSES and QPN_MOE_MAX_PASSES"
#endif

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
    r.list_len = experts < slots ? experts : slots;
    return r;
}
#endif

#if QPN_MOE
#if QPN_X_FRAG || QPN_GEMM
#error "the MoE builds read x rows through the route (QPN_X_FRAG = 0, QPN_GEMM = 0)"
#endif

// The MoE build's extra kernel parameters: the route; its E and S; the class this launch serves and the
// passes it takes (blocks z = list index * passes + pass, each pass 8 * QPN_NB of the expert's rows);
// map_x = 1: x row r of the expert is token slot_token[off[e] + r] (gate/up reads the tokens),
// 0: row off[e] + r (down reads the slot-ordered hidden rows); the scale buffer's per-expert stride.
#define QPN_MOE_PARAMS , const int* __restrict__ route, int experts, int slots, int route_class, int passes, \
    int map_x, long long scale_expert_stride

struct QpnExpert {
    int e;               // the expert
    int ticket;          // its split-K ticket row: e * QPN_MOE_MAX_PASSES + pass
    int row0;            // the pass's first slot
    int rows;            // the pass's slots (0: this block has no expert)
    const int* row_map;  // x row of slot row0 + r: row_map[row0 + r], or row0 + r when null
};

// Block z of class `cls`'s launch -> its expert and pass (uniform over the block: read before any barrier).
__device__ __forceinline__ QpnExpert qpn_moe_expert(const int* __restrict__ route, int experts, int slots,
                                                    int cls, int passes, int map_x) {
    const QpnRoute r = qpn_route_layout(experts, slots);
    QpnExpert ex = {0, 0, 0, 0, nullptr};
    const int z = blockIdx.z / passes, pass = blockIdx.z % passes;
    if (z >= route[r.class_count + cls]) return ex;
    ex.e = route[r.class_list + cls * r.list_len + z];
    ex.ticket = ex.e * QPN_MOE_MAX_PASSES + pass;
    ex.row0 = route[r.off + ex.e] + pass * 8 * QPN_NB;
    ex.rows = max(0, min(route[r.off + ex.e + 1] - ex.row0, 8 * QPN_NB));
    ex.row_map = map_x ? route + r.slot_token : nullptr;
    return ex;
}

// The pass's rows of y and its split-K state: y rows [row0, row0 + rows); the partial sums at
// row0 * (parts * QPN_HT * y_cols) (the passes' row ranges tile the call's S rows); tickets at
// ticket * (output tiles).
__device__ __forceinline__ void qpn_moe_rows(const QpnExpert& ex, int y_cols, int& m_rows, qpn_u16* __restrict__& y,
                                             float* __restrict__& partial, unsigned* __restrict__& tickets) {
    m_rows = ex.rows;
    y += (long long)ex.row0 * y_cols;
    if (gridDim.y > 1) {
        partial += (long long)ex.row0 * gridDim.y * QPN_HT * y_cols;
        tickets += (long long)ex.ticket * gridDim.x;
    }
}
#else
#define QPN_MOE_PARAMS
#endif
