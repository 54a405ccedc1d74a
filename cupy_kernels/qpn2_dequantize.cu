// qpn2_dequantize.cu: QPN2 codes + scales + global scale -> fp16 W16 [N][K] (the prefill path).
//
// Kernels: qpn2_dequantize, qpn2_check_scales.
// Macros:  QPN_GROUPS_PER_THREAD  groups one lane decodes (default 2; a multiple of
//                                 QPN_STAGE_GROUPS; the host's grid arithmetic uses the same value)
//          QPN_STAGE_GROUPS       groups staged per phase through shared memory (2 or 4, default 2)
//          QPN_WARPS_PER_BLOCK    warps per block (default 8; the host launches 32x this many threads)
//          QPN_MX                 1: MXFP4 in the QPNMX layout (docs/QPNMX.md): e8m0 scale bytes, one per
//                                 32 k; global_scale = the tiles' 2^T; E = 2^(s - 127 - T), so W16 =
//                                 RN16(e2m1 * 2^F), the reduced weight (docs/DESIGN.md, "MXFP4 weight")
//
// Weight semantics (docs/DESIGN.md, "NVFP4 weight"; bit-identical to qpn.ref.qpn2_dequantize):
//     W16[n,k] = RN16(RN32(e2m1(code) * RN32(e4m3(scale) * g(n))))      code 8 -> -0.0 (0x8000)
// computed as  E = __fmul_rn(e4m3, g)                        (RN32, once per lane and group)
//              w = __fmul_rn(e2m1 * 2^-14, E * 2^14)         (same real product, one RN32)
//              W16 = cvt.rn.f16.f32(w)                       (one RN16)
// where e2m1 * 2^-14 is the exact fp16 value of the nibble bit trick
// (docs/QPN2.md, "Why this order") and E * 2^14 is exact (power-of-two scale; it could only
// overflow for scales that the overflow rule rejects: 6 * E >= 65520 long before E * 2^14
// reaches fp32's 3.4e38).
//
// qpn2_dequantize
//   Reads   codes         [tile N/32][group G=K/16][lane 32][8 bytes]  (QPN2 order)
//           scales        [tile][group][lane] e4m3 bytes
//           global_scale  fp32; g(n) = global_scale[(n / 32) * global_scale_tile_stride]
//                         (stride 0: one scalar; stride 1: one value per 32-column tile)
//   Writes  out           fp16 bits [N][K], row-major
//   Work split: a warp = one tile t x QPN_GROUPS_PER_THREAD consecutive groups; lane = column.
//
//     loads   codes[t][g][lane] (8 B) + scales[t][g][lane] (1 B) per group: a warp reads 256
//             contiguous code bytes and 32 scale bytes per group (coalesced, read once: __ldcs),
//             all groups' loads issued before any decoding (18 B in flight per lane with 2 groups)
//     decode  each lane's 8 code bytes already hold its column's 16 k in pairs (nibble i and
//             i+4 of a 32-bit word = k 2i, 2i+1): one word -> one uint4 of 8 consecutive halves
//     stores  the lane's halves form a piece of ONE output row, so they are staged in shared
//             memory and written back row-contiguously (qpn_common.cuh, "Warp staging"):
//             QPN_STAGE_GROUPS = 2 gives 8 rows x 64 B per store instruction.
//   Shared memory: QPN_WARPS_PER_BLOCK x 32 rows x 32*QPN_STAGE_GROUPS B = 16 KiB (8 warps,
//   2 groups): 4 blocks = 32 warps fit Turing's 64 KiB per SM.
//
// qpn2_check_scales (only when the caller asks for validation)
//   Reads   scales, global_scale as above (N*K/16 bytes: 1/40 of the dequantize traffic)
//   Writes  flags |= 1 NaN scale byte, |= 2 a block whose largest weight
//           RN16(RN32(6 * RN32(|e4m3| * g))) is inf (RN32(...) >= 65520), |= 4 a global scale
//           that is NaN, inf or <= 0.
#include "qpn_dequant.cuh"

#ifndef QPN_MX
#define QPN_MX 0
#endif

// Nibble pair (i, i+4) of a code word, already shifted down to bits 0..3 and 16..19 of x,
// -> two fp16 weights (bits 0..15 = k 2i, bits 16..31 = k 2i+1).
__device__ __forceinline__ qpn_u32 qpn2_decode_pair(qpn_u32 x, float e_scaled) {
    // e2m1 magnitude bits 0..2 -> fp16 bits 9..11, sign bit 3 -> bit 15: value e2m1 * 2^-14.
    const qpn_u32 h2 = ((x & 0x00070007u) << 9)    // 0x7 = 0111: magnitude
                     | ((x & 0x00080008u) << 12);  // 0x8 = 1000: sign
    const float lo = __fmul_rn(qpn_half_to_float((qpn_u16)h2), e_scaled);
    const float hi = __fmul_rn(qpn_half_to_float((qpn_u16)(h2 >> 16)), e_scaled);
    return (qpn_u32)qpn_float_to_half_rn(lo) | ((qpn_u32)qpn_float_to_half_rn(hi) << 16);
}

// One 32-bit code word (8 k of one column) -> 8 consecutive fp16 weights.
__device__ __forceinline__ uint4 qpn2_decode_word(qpn_u32 w, float e_scaled) {
    uint4 r;
    r.x = qpn2_decode_pair(w, e_scaled);        // k 0, 1
    r.y = qpn2_decode_pair(w >> 4, e_scaled);   // k 2, 3
    r.z = qpn2_decode_pair(w >> 8, e_scaled);   // k 4, 5
    r.w = qpn2_decode_pair(w >> 12, e_scaled);  // k 6, 7
    return r;
}

extern "C" __global__ void __launch_bounds__(QPN_WARPS_PER_BLOCK * 32) qpn2_dequantize(
    const uint2* __restrict__ codes,
    const qpn_u8* __restrict__ scales,
    const float* __restrict__ global_scale,
    int global_scale_tile_stride,
    uint4* __restrict__ out,
    int n_tiles,
    int groups)
{
    const int lane = threadIdx.x & 31;
    int t, g0;
    if (!qpn_dequant_item(n_tiles, groups, t, g0)) return;

    // Issue every load before any decoding: GPT x (8 + 1) bytes in flight per lane. More groups
    // per lane (more bytes in flight, fewer warps) measured slower: benchmarks, section sweep.
    const size_t unit = ((size_t)t * groups + g0) * QPN_TILE_N + lane;
    uint2 c[QPN_GROUPS_PER_THREAD];
    qpn_u32 sb[QPN_GROUPS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < QPN_GROUPS_PER_THREAD; ++j) {
        if (g0 + j < groups) {
            c[j] = __ldcs(codes + unit + 32 * j);
#if QPN_MX  // the group's 32-k block: [tile][block][lane]
            sb[j] = __ldcs(scales + ((size_t)t * (groups / 2) + (g0 + j) / 2) * QPN_TILE_N + lane);
#else
            sb[j] = __ldcs(scales + unit + 32 * j);
#endif
        }
    }
    const float g = __ldg(global_scale + (long long)t * global_scale_tile_stride);

    qpn_dequant_store(out, t, groups, g0, [&](int j, uint4& lo, uint4& hi) {
#if QPN_MX
        const float e = ldexpf(1.0f, (int)sb[j] - 127 - ilogbf(g));  // E = 2^F, exact (0 below fp32's range)
#else
        const float e = __fmul_rn(qpn_e4m3_to_float(sb[j]), g);  // E = RN32(e4m3 * g)
#endif
        const float e_scaled = __fmul_rn(e, 16384.0f);            // E * 2^14, exact
        lo = qpn2_decode_word(c[j].x, e_scaled);                  // k 0..7
        hi = qpn2_decode_word(c[j].y, e_scaled);                  // k 8..15
    });
}

extern "C" __global__ void qpn2_check_scales(
    const qpn_u32* __restrict__ scales,
    const float* __restrict__ global_scale,
    int global_scale_tile_stride,
    int n_tiles,
    int groups,
    int* __restrict__ flags)
{
    // 4 scale bytes per word; a tile holds 32*groups bytes = 8*groups words (K % 64 == 0
    // makes groups a multiple of 4, but a tile is a whole number of words for any groups).
    const long long words = (long long)n_tiles * groups * 8;
    int bad = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (long long)gridDim.x * blockDim.x) {
        const qpn_u32 w = scales[i];
        const int t = (int)(i / ((long long)groups * 8));
        const float g = global_scale[(long long)t * global_scale_tile_stride];
        if (!(g > 0.0f && g <= 3.402823466e38f)) bad |= 4;
        if (qpn_e4m3x4_nan_mask(w)) bad |= 1;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const float e = __fmul_rn(qpn_e4m3_to_float((w >> (8 * b)) & 0x7Fu), g);  // |e4m3| * g
            if (__fmul_rn(6.0f, e) >= 65520.0f) bad |= 2;  // RN16 of it would be inf
        }
    }
    if (bad) atomicOr(flags, bad);
}
