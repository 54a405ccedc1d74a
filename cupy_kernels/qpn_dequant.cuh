// qpn_dequant.cuh: what the QPN2 and QPN8 dequantize kernels share -- the work split (a warp per
// tile x QPN_GROUPS_PER_THREAD groups, a lane per column) and the staged, coalesced store of a
// warp's decoded groups (qpn_common.cuh, "Warp staging").
#pragma once
#include "qpn_common.cuh"

#ifndef QPN_GROUPS_PER_THREAD
#define QPN_GROUPS_PER_THREAD 2
#endif
#ifndef QPN_STAGE_GROUPS
#define QPN_STAGE_GROUPS 2
#endif
#ifndef QPN_WARPS_PER_BLOCK
#define QPN_WARPS_PER_BLOCK 8
#endif
#define QPN_STAGE_CHUNKS (2 * QPN_STAGE_GROUPS)  // 16-byte chunks per staged row (2 per group)
static_assert(QPN_GROUPS_PER_THREAD % QPN_STAGE_GROUPS == 0, "whole staging phases per thread");

// The calling warp's work: tile t, groups [g0, g0 + QPN_GROUPS_PER_THREAD) clipped to `groups`.
// False for the grid's spare warps (whole warps only, so the __syncwarp()s below are safe).
__device__ __forceinline__ bool qpn_dequant_item(int n_tiles, int groups, int& t, int& g0) {
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int chunks = (groups + QPN_GROUPS_PER_THREAD - 1) / QPN_GROUPS_PER_THREAD;
    if (warp >= (long long)n_tiles * chunks) return false;
    t = (int)(warp / chunks);
    g0 = (int)(warp - (long long)t * chunks) * QPN_GROUPS_PER_THREAD;
    return true;
}

// Decode and store the warp's groups, QPN_STAGE_GROUPS per staging phase:
// decode(j, lo, hi) gives group g0 + j of the lane's column as fp16 k 0..7 (lo) and 8..15 (hi).
// out = W16 [N][K] as uint4: row n holds 2 * groups uint4, group g starts at uint4 2g.
template <class Decode>
__device__ __forceinline__ void qpn_dequant_store(uint4* __restrict__ out, int t, int groups, int g0, Decode&& decode) {
    __shared__ uint4 stage_all[QPN_WARPS_PER_BLOCK][QPN_TILE_N][QPN_STAGE_CHUNKS];
    uint4 (*stage)[QPN_STAGE_CHUNKS] = stage_all[threadIdx.x >> 5];
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < QPN_GROUPS_PER_THREAD; p += QPN_STAGE_GROUPS) {
#pragma unroll
        for (int h = 0; h < QPN_STAGE_GROUPS; ++h) {
            const int j = p + h;
            if (g0 + j < groups) {
                uint4 lo, hi;
                decode(j, lo, hi);
                qpn_stage_put<QPN_STAGE_CHUNKS>(stage, lane, 2 * h, lo);
                qpn_stage_put<QPN_STAGE_CHUNKS>(stage, lane, 2 * h + 1, hi);
            }
        }
        __syncwarp();
        const int valid = 2 * min(QPN_STAGE_GROUPS, groups - (g0 + p));  // ragged last phase
        qpn_stage_store_rows<QPN_STAGE_CHUNKS>(stage, out, t, 2LL * groups, 2LL * (g0 + p), valid, lane);
        __syncwarp();
    }
}
