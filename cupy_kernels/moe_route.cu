// moe_route.cu: the two small kernels around the fused MoE decode (cupy_kernels/moe.py).
//
// qpn_moe_route    one block of QPN_ROUTE_THREADS: top-k ids [M][top_k] (int32 or int64) -> the route
//                  (qpn_moe.cuh); also zeroes the call's split-K tickets, so the expert launches that
//                  follow on the stream need no memset of their own.
// qpn_moe_combine  out[m] = RN16(acc_k), acc_{j+1} = RN32(acc_j + RN32(w[m][j] * y[slot_of(m, j)])) in
//                  top-k order (docs/DESIGN.md, "Mixture of experts"; qpn.ref.moe.combine): one thread per
//                  two columns of a token, y the slot-ordered outputs of the down projections; bf16 = 1:
//                  y and out are bf16 bits, the one rounding an RN_bf16 (bf16 x).
//
// Nothing here depends on timing or on the order in which threads run: the counts are integer
// atomics (exact in any order) and each slot comes from a rank, the number of earlier choices of the
// same expert, so the route is a function of the ids alone.
#include "qpn_common.cuh"
#include "qpn_moe.cuh"

// QPN_ROUTE_THREADS: the route's E and S limit (one thread per expert, one per choice), moe.py's ROUTE_LIMIT

// Inclusive scan of v over the block (QPN_ROUTE_THREADS threads, 32 warps); every thread gets its
// prefix, `total` the block's sum.
__device__ __forceinline__ qpn_u64 qpn_block_scan(qpn_u64 v, qpn_u64* warp_sums, qpn_u64& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const qpn_u64 u = __shfl_up_sync(0xFFFFFFFFu, v, d);
        if (lane >= d) v += u;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        qpn_u64 w = warp_sums[lane];
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const qpn_u64 u = __shfl_up_sync(0xFFFFFFFFu, w, d);
            if (lane >= d) w += u;
        }
        warp_sums[lane] = w;
    }
    __syncthreads();
    total = warp_sums[31];
    return v + (warp ? warp_sums[warp - 1] : 0);
}

// Packed scan fields: the slot count in bits 0..15 (S <= 1024), one 12-bit piece count per class above it
// (class 3 <= S / 25 <= 40 pieces, the others <= E <= 1024): one scan gives the offsets and every class
// list's positions.
#define QPN_SCAN_CLASS(c) (16 + 12 * (c))

static_assert(QPN_ROUTE_THREADS == 1024, "qpn_block_scan takes 32 full warps");
static_assert(QPN_MOE_CLASSES == 4, "the packed scan holds four class counts");

extern "C" __global__ void __launch_bounds__(QPN_ROUTE_THREADS) qpn_moe_route(
    const void* __restrict__ ids, int ids64, int slots, int top_k, int experts, int* __restrict__ route,
    unsigned* __restrict__ tickets, int n_tickets)
{
    __shared__ int sid[QPN_ROUTE_THREADS];    // the choices' experts (-1: outside [0, E))
    __shared__ int count[QPN_ROUTE_THREADS];  // per expert
    __shared__ int first[QPN_ROUTE_THREADS];  // per expert: its first slot
    __shared__ qpn_u64 warp_sums[32];
    const int t = threadIdx.x;
    const QpnRoute r = qpn_route_layout(experts, slots);

    for (int i = t; i < n_tickets; i += QPN_ROUTE_THREADS) tickets[i] = 0u;
    if (t < slots) {
        const long long e = ids64 ? static_cast<const long long*>(ids)[t] : static_cast<const int*>(ids)[t];
        sid[t] = e >= 0 && e < experts ? (int)e : -1;
    }
    count[t] = 0;
    __syncthreads();
    if (t < slots && sid[t] >= 0) atomicAdd(&count[sid[t]], 1);
    __syncthreads();

    // expert t's pieces: `full` of QPN_PIECE_ROWS (class 3), then a remainder of `rest` rows (class rc)
    const int cnt = t < experts ? count[t] : 0;
    const int full = cnt / QPN_PIECE_ROWS, rest = cnt % QPN_PIECE_ROWS;
    const int rc = rest ? (rest - 1) >> 3 : 0;
    const qpn_u64 own = (qpn_u64)cnt + ((qpn_u64)full << QPN_SCAN_CLASS(QPN_MOE_CLASSES - 1)) +
                        (rest ? 1ull << QPN_SCAN_CLASS(rc) : 0ull);  // + (a class-3 remainder adds to full)
    qpn_u64 total;
    const qpn_u64 before = qpn_block_scan(own, warp_sums, total) - own;  // exclusive
    if (t < experts) {
        first[t] = (int)(before & 0xFFFF);
        route[r.off + t] = (int)(before & 0xFFFF);
        const int top = QPN_MOE_CLASSES - 1;
        const int at_top = (int)((before >> QPN_SCAN_CLASS(top)) & 0xFFF);
        int* const lists = route + r.class_list;
        for (int p = 0; p < full; ++p) lists[top * r.list_len + at_top + p] = t | (p << QPN_PIECE_SHIFT);
        if (rest) {
            const int at = rc == top ? at_top + full : (int)((before >> QPN_SCAN_CLASS(rc)) & 0xFFF);
            lists[rc * r.list_len + at] = t | (full << QPN_PIECE_SHIFT);
        }
    }
    if (t == 0) route[r.off + experts] = (int)(total & 0xFFFF);
    if (t < QPN_MOE_CLASSES) route[r.class_count + t] = (int)((total >> QPN_SCAN_CLASS(t)) & 0xFFF);
    __syncthreads();

    if (t < slots) {
        const int e = sid[t];
        int slot = -1;
        if (e >= 0) {
            int rank = 0;  // earlier choices of the same expert
            for (int i = 0; i < t; ++i) rank += sid[i] == e;
            slot = first[e] + rank;
            route[r.slot_token + slot] = t / top_k;
        }
        route[r.slot_of + t] = slot;
    }
}

extern "C" __global__ void qpn_moe_combine(
    const qpn_u16* __restrict__ y, const float* __restrict__ weights, const int* __restrict__ route,
    int experts, int slots, int top_k, int h, qpn_u16* __restrict__ out, int bf16)
{
    const int m = blockIdx.y;
    const int c = 2 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= h) return;
    const int* slot_of = route + qpn_route_layout(experts, slots).slot_of + m * top_k;
    float acc0 = 0.0f, acc1 = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        const int s = slot_of[j];
        if (s < 0) continue;  // an id outside [0, E): no expert, no term
        const float w = weights[m * top_k + j];
        const qpn_u32 pair = *reinterpret_cast<const qpn_u32*>(y + (long long)s * h + c);
        acc0 = __fadd_rn(acc0, __fmul_rn(w, qpn_value_of((qpn_u16)(pair & 0xFFFFu), bf16)));
        acc1 = __fadd_rn(acc1, __fmul_rn(w, qpn_value_of((qpn_u16)(pair >> 16), bf16)));
    }
    *reinterpret_cast<qpn_u32*>(out + (long long)m * h + c) =
        (qpn_u32)qpn_round_to(acc0, bf16) | ((qpn_u32)qpn_round_to(acc1, bf16) << 16);
}
