// qpn8_dequantize.cu: QPN8 codes + fp16 group scales -> fp16 W16 [N][K] (the prefill path).
//
// Kernels: qpn8_dequantize, qpn8_check.
// Macros:  QPN_GROUPS_PER_THREAD  groups one lane decodes (default 2; a multiple of
//                                 QPN_STAGE_GROUPS; the host's grid arithmetic uses the same value)
//          QPN_STAGE_GROUPS       groups staged per phase through shared memory (2 or 4, default 2)
//          QPN_WARPS_PER_BLOCK    warps per block (default 8; the host launches 32x this many threads)
//
// Weight semantics (docs/QPN8.md; bit-identical to qpn.ref.qpn8_dequantize):
//     W16 = RN16(e4m3(code) * 2^-8 * S16)     exact product, one rounding
// computed as one `mul.rn.f16x2` of the bit-trick half2 (e4m3 * 2^-8, exact, subnormals
// included) and {S16, S16}: the fp16 multiply rounds the exact product once (4 x 11
// significant bits), keeping subnormal results.
//
// qpn8_dequantize
//   Reads   codes         [tile N/32][group G=K/16][lane 32][16 bytes], position p holds
//                         k = KORDER[p] = (0,2,4,6,1,3,5,7, 8,10,12,14,9,11,13,15)[p]
//           group_scales  fp16 bits; column n of group g uses
//                         group_scales[(g / 8) * scale_kb_stride + t * scale_tile_stride + col * scale_col_stride]
//                         per-channel [1][N]: (0, 32, 1); 128x128 blocks [K/128][N/32]: (N/32, 1, 0)
//   Writes  out           fp16 bits [N][K], row-major
//   Work split: a warp = one tile t x QPN_GROUPS_PER_THREAD consecutive groups; lane = column.
//   A warp loads 512 contiguous bytes per group (all groups' loads issued first: 32 B in flight
//   per lane with 2 groups); the decoded halves of a lane are a piece of one output row, so they go through
//   the warp staging of qpn_common.cuh and leave as 8 rows x 64 B per store instruction
//   (QPN_STAGE_GROUPS = 2; 16 KiB of shared memory per 8-warp block). The last phase may be
//   ragged (K % 16 == 0 only): its missing chunks are neither staged nor stored.
//
//     packet bytes (one lane, one group):   p: 0  1  2  3  4  5  6  7 | 8 ...
//                                           k: 0  2  4  6  1  3  5  7 | 8 ...
//     pair i of an 8-byte half = bytes (i, 4+i) = k (2i, 2i+1): one prmt puts them at bits
//     0..7 and 16..23, two masks and shifts make the half2, one fp16 multiply scales it.
//
// qpn8_check (only when the caller asks for validation)
//   Reads   codes (all N*K bytes) and the fp16 group scales
//   Writes  flags |= 1 NaN code byte (0x7F/0xFF), |= 2 a group scale that is NaN, inf or has
//           its sign bit set, |= 4 a group scale whose largest weight RN16(1.75 * S16) is inf.
#include "qpn_dequant.cuh"

// Byte i of `a` and byte i of `b` (a 4-byte word each) -> fp16 weights of k (2i, 2i+1).
// The permute [a.b_i, a.b_i, b.b_i, b.b_i] puts them at bytes 0 and 2 (bytes 1, 3 are masked off anyway).
#define QPN8_PAIR(a, b, i, s2) \
    qpn_hmul2_rn(qpn_e4m3x2_to_half2_bits(__byte_perm((a), (b), QPN_PRMT((i), (i), 4 + (i), 4 + (i)))), (s2))

// One 8-byte half (words a = positions 0..3, b = positions 4..7) -> 8 consecutive fp16 weights.
__device__ __forceinline__ uint4 qpn8_decode_half(qpn_u32 a, qpn_u32 b, qpn_u32 s2) {
    uint4 r;
    r.x = QPN8_PAIR(a, b, 0u, s2);  // k 0, 1
    r.y = QPN8_PAIR(a, b, 1u, s2);  // k 2, 3
    r.z = QPN8_PAIR(a, b, 2u, s2);  // k 4, 5
    r.w = QPN8_PAIR(a, b, 3u, s2);  // k 6, 7
    return r;
}

extern "C" __global__ void __launch_bounds__(QPN_WARPS_PER_BLOCK * 32) qpn8_dequantize(
    const uint4* __restrict__ codes,
    const qpn_u16* __restrict__ group_scales,
    long long scale_kb_stride,
    int scale_tile_stride,
    int scale_col_stride,
    uint4* __restrict__ out,
    int n_tiles,
    int groups)
{
    const int lane = threadIdx.x & 31;
    int t, g0;
    if (!qpn_dequant_item(n_tiles, groups, t, g0)) return;
    const int col = qpn_column_of_lane(lane);

    // Issue every load before any decoding: GPT x 16 code bytes in flight per lane. The scales
    // are tiny and shared by many threads, so they go through the read-only cache (__ldg).
    const size_t unit = ((size_t)t * groups + g0) * QPN_TILE_N + lane;
    const long long scale_base = (long long)t * scale_tile_stride + (long long)col * scale_col_stride;
    uint4 v[QPN_GROUPS_PER_THREAD];
    qpn_u32 s[QPN_GROUPS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < QPN_GROUPS_PER_THREAD; ++j) {
        if (g0 + j < groups) {
            v[j] = __ldcs(codes + unit + 32 * j);
            s[j] = __ldg(group_scales + scale_base + (long long)((g0 + j) >> 3) * scale_kb_stride);
        }
    }

    qpn_dequant_store(out, t, groups, g0, [&](int j, uint4& lo, uint4& hi) {
        const qpn_u32 s2 = s[j] | (s[j] << 16);  // {S16, S16}
        lo = qpn8_decode_half(v[j].x, v[j].y, s2);  // k 0..7
        hi = qpn8_decode_half(v[j].z, v[j].w, s2);  // k 8..15
    });
}

extern "C" __global__ void qpn8_check(
    const uint4* __restrict__ codes,
    long long code_units,
    const qpn_u16* __restrict__ group_scales,
    long long n_scales,
    int* __restrict__ flags)
{
    int bad = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = first; i < code_units; i += stride) {
        const uint4 v = __ldcs(codes + i);
        if (qpn_e4m3x4_nan_mask(v.x) | qpn_e4m3x4_nan_mask(v.y)
            | qpn_e4m3x4_nan_mask(v.z) | qpn_e4m3x4_nan_mask(v.w)) bad |= 1;
    }
    for (long long i = first; i < n_scales; i += stride) {
        const qpn_u16 s16 = group_scales[i];
        // sign set (negative or -0) or exponent all ones (inf / NaN); +0 is allowed (qpn.ref:
        // "finite and >= 0": an all-zero channel's S16 underflows to 0)
        if ((s16 & 0x8000u) || (s16 & 0x7C00u) == 0x7C00u) {
            bad |= 2;
        } else if (qpn_half_is_inf(qpn_float_to_half_rn(__fmul_rn(1.75f, qpn_half_to_float(s16))))) {
            bad |= 4;
        }
    }
    if (bad) atomicOr(flags, bad);
}
