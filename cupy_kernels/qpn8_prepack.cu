// qpn8_prepack.cu: FP8 (e4m3) weights and fp32 scales -> QPN8 codes and fp16 group scales
// (docs/QPN8.md), on the GPU.
//
// Kernels: qpn8_prepack, qpn8_group_scales.
// Macros:  QPN_GROUPS_PER_THREAD  groups (16-byte packets) one thread moves (default 4).
//
// qpn8_prepack
//   Reads   weight  uint8 [N][K] e4m3 bits, row-major
//   Writes  codes   uint8 [tile N/32][group G=K/16][lane 32][16 bytes]: position p of a packet
//                   holds W[32t + col(lane)][16g + KORDER[p]], KORDER = (0,2,4,6,1,3,5,7, 8,10,...)
//           flags   |= 1 when a weight byte is a NaN code (0x7F/0xFF)
//   Needs   N % 32 == 0, K % 16 == 0 (rows of whole 16-byte groups; a ragged last chunk of
//           fewer than QPN_GROUPS_PER_THREAD groups is guarded).
//   Work split: one thread = column n x QPN_GROUPS_PER_THREAD consecutive groups: 16-byte loads
//   from row n, 16-byte stores into codes[t][g][lane]; a warp writes 512 contiguous bytes per
//   group, so stores are fully coalesced and every loaded 32-byte sector is used whole by
//   the thread pair (g, g+1).
//
// qpn8_group_scales
//   Reads   s      fp32, element (r, c) of the output reads s[(c / col_div) * s_col_stride + r * s_row_stride]
//   Writes  out    fp16 bits [rows][cols]: S16 = RN16(256 * s) (256 * s is exact in fp32, one rounding)
//           flags  |= 2 when s is NaN, inf or <= 0; |= 4 when the largest weight of the group,
//                  RN16(448 * 2^-8 * S16) = RN16(1.75 * S16), is inf (S16 > 37424)
//   Shapes  per-channel / per-tensor: rows = 1, cols = N, col_div = 1, s_col_stride = 1 (0 for a
//           scalar), s_row_stride = 0; 128x128 blocks: rows = K/128, cols = N/32, col_div = 4
//           (4 tiles of 32 per 128 rows), s_col_stride = K/128, s_row_stride = 1, giving
//           S16[kb][t] = RN16(256 * s[t / 4][kb]).
#include "qpn_common.cuh"

#ifndef QPN_GROUPS_PER_THREAD
#define QPN_GROUPS_PER_THREAD 4
#endif

extern "C" __global__ void qpn8_prepack(
    const uint4* __restrict__ weight,
    uint4* __restrict__ codes,
    int n_tiles,
    int groups,
    int* __restrict__ flags)
{
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int chunks = (groups + QPN_GROUPS_PER_THREAD - 1) / QPN_GROUPS_PER_THREAD;
    if (warp >= (long long)n_tiles * chunks) return;
    const int t = (int)(warp / chunks);
    const int g0 = (int)(warp - (long long)t * chunks) * QPN_GROUPS_PER_THREAD;
    const long long n = (long long)QPN_TILE_N * t + qpn_column_of_lane(lane);

    // All loads first (QPN_GROUPS_PER_THREAD x 16 B in flight per thread), then the stores.
    const uint4* src = weight + n * groups + g0;  // a row is `groups` uint4
    uint4 v[QPN_GROUPS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < QPN_GROUPS_PER_THREAD; ++j) {
        if (g0 + j < groups) v[j] = __ldcs(src + j);
    }
    const size_t unit = ((size_t)t * groups + g0) * QPN_TILE_N + lane;
    qpn_u32 nan = 0;
#pragma unroll
    for (int j = 0; j < QPN_GROUPS_PER_THREAD; ++j) {
        if (g0 + j < groups) {
            // Each 8-byte half (a = k0..3, b = k4..7) becomes [k0 k2 k4 k6 | k1 k3 k5 k7].
            uint4 o;
            o.x = __byte_perm(v[j].x, v[j].y, QPN_PRMT_EVEN_BYTES);  // a.b0 a.b2 b.b0 b.b2
            o.y = __byte_perm(v[j].x, v[j].y, QPN_PRMT_ODD_BYTES);   // a.b1 a.b3 b.b1 b.b3
            o.z = __byte_perm(v[j].z, v[j].w, QPN_PRMT_EVEN_BYTES);
            o.w = __byte_perm(v[j].z, v[j].w, QPN_PRMT_ODD_BYTES);
            codes[unit + 32 * j] = o;
            nan |= qpn_e4m3x4_nan_mask(v[j].x) | qpn_e4m3x4_nan_mask(v[j].y)
                 | qpn_e4m3x4_nan_mask(v[j].z) | qpn_e4m3x4_nan_mask(v[j].w);
        }
    }
    // Read back once by the host after the launch (prepack is a load-time call); the CPU then
    // locates the first bad byte for the error message.
    if (nan) atomicOr(flags, 1);
}

extern "C" __global__ void qpn8_group_scales(
    const float* __restrict__ s,
    qpn_u16* __restrict__ out,
    int rows,
    int cols,
    int col_div,
    long long s_col_stride,
    long long s_row_stride,
    int* __restrict__ flags)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    const int r = (int)(i / cols);
    const int c = (int)(i - (long long)r * cols);
    const float v = s[(long long)(c / col_div) * s_col_stride + (long long)r * s_row_stride];
    const qpn_u16 s16 = qpn_float_to_half_rn(__fmul_rn(256.0f, v));  // 256 * v exact: one rounding
    out[i] = s16;
    // 1.75 * S16 is exact in fp32 (3 x 11 significant bits), so this is RN16(1.75 * S16).
    const qpn_u16 largest = qpn_float_to_half_rn(__fmul_rn(1.75f, qpn_half_to_float(s16)));
    int bad = 0;
    if (!(v > 0.0f && v <= 3.402823466e38f)) bad |= 2;  // NaN, inf, zero or negative
    else if (qpn_half_is_inf(largest)) bad |= 4;
    if (bad) atomicOr(flags, bad);
}
