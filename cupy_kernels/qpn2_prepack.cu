// qpn2_prepack.cu: ModelOpt NVFP4 tensors -> QPN2 codes and scales (docs/QPN2.md), on the GPU.
//
// Kernels: qpn2_prepack.   Macros: QPN_MX = 1: MXFP4 (docs/QPNMX.md): the same codes; the e8m0 scales
//          [N][K/32] -> [tile][block][lane], flags |= 1 for the e8m0 NaN byte 0xFF.
//
// Reads   weight_packed  uint8 [N][K/2]  row-major; byte j of row n: k=2j low nibble, 2j+1 high
//         weight_scale   uint8 [N][K/16] e4m3 bits, row-major
// Writes  codes          uint8, [tile N/32][group G=K/16][lane 32][8 bytes]
//         scales         uint8, [tile][group][lane]: scales[(t*G+g)*32+lane] = weight_scale[32t+col(lane)][g]
//         flags          int, |= 1 when a scale byte is a NaN code (0x7F/0xFF)
// Needs   N % 32 == 0, K % 64 == 0 (so every row segment below is whole and 16-byte aligned).
//
// Work split: one thread = one column n (lane of tile t) x 4 consecutive groups g0..g0+3.
//
//   source row n:   | g0: 8 B | g0+1: 8 B | g0+2: 8 B | g0+3: 8 B |  = 32 B = two 16-byte loads,
//                                                                     one full 32-byte sector
//   destination:    codes[t][g0+j][lane] (8 B each), j = 0..3: the 32 lanes of a warp write one
//                   contiguous 256-byte run per j (lane order), so every store is coalesced.
//
// A warp is one (tile, 4-group chunk); consecutive warps take consecutive chunks of a tile, so
// the warps of a block stream through neighbouring 32-byte row segments and neighbouring
// 256-byte output runs. A byte permutation only: no arithmetic on values.
#include "qpn_common.cuh"

#define QPN2_PREPACK_GROUPS_PER_THREAD 4  // 4 groups x 8 B = one 32-byte sector per row
#ifndef QPN_MX
#define QPN_MX 0
#endif

// In each 32-bit word: nibble q of the result <- nibble KORDER[q] = (0,2,4,6,1,3,5,7)[q] of x,
// i.e. even nibbles to the low half-word, odd nibbles to the high half-word.
__device__ __forceinline__ qpn_u32 qpn2_unshuffle_nibbles(qpn_u32 x) {
    qpn_u32 even = x & 0x0F0F0F0Fu;         // n0, n2, n4, n6 in the low nibble of bytes 0..3
    qpn_u32 odd = (x >> 4) & 0x0F0F0F0Fu;   // n1, n3, n5, n7
    even |= even >> 4;                      // byte 0 = n0 | n2<<4, byte 2 = n4 | n6<<4
    odd |= odd >> 4;                        // byte 0 = n1 | n3<<4, byte 2 = n5 | n7<<4
    return __byte_perm(even, odd, QPN_PRMT_EVEN_BYTES);  // bytes: even.b0, even.b2, odd.b0, odd.b2
}

extern "C" __global__ void qpn2_prepack(
    const uint4* __restrict__ weight_packed,
    const qpn_u32* __restrict__ weight_scale,
    uint2* __restrict__ codes,
    qpn_u8* __restrict__ scales,
    int n_tiles,
    int groups,
    int* __restrict__ flags)
{
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int chunks = groups / QPN2_PREPACK_GROUPS_PER_THREAD;
    if (warp >= (long long)n_tiles * chunks) return;
    const int t = (int)(warp / chunks);
    const int g0 = (int)(warp - (long long)t * chunks) * QPN2_PREPACK_GROUPS_PER_THREAD;
    const long long n = (long long)QPN_TILE_N * t + qpn_column_of_lane(lane);

    // Row n is 8*groups bytes = groups/2 uint4; group g starts at byte 8g = uint4 g/2.
    const uint4* src = weight_packed + n * (groups / 2) + g0 / 2;
    const uint4 lo = __ldcs(src);      // groups g0, g0+1 (read once: evict-first)
    const uint4 hi = __ldcs(src + 1);  // groups g0+2, g0+3
#if QPN_MX  // the 4 groups' two 32-k blocks: two e8m0 bytes (K % 64: an even, 2-byte aligned offset)
    const qpn_u32 s2 = __ldcs(reinterpret_cast<const unsigned short*>(weight_scale) + (n * groups / 2 + g0 / 2) / 2);
#else
    const qpn_u32 s4 = __ldcs(weight_scale + (n * groups + g0) / 4);  // 4 scale bytes, g0..g0+3
#endif

    // Unit index of (t, g0, lane); group g0+j sits 32*j units further.
    const size_t unit = ((size_t)t * groups + g0) * QPN_TILE_N + lane;
    uint2 o;
    o.x = qpn2_unshuffle_nibbles(lo.x); o.y = qpn2_unshuffle_nibbles(lo.y); codes[unit] = o;
    o.x = qpn2_unshuffle_nibbles(lo.z); o.y = qpn2_unshuffle_nibbles(lo.w); codes[unit + 32] = o;
    o.x = qpn2_unshuffle_nibbles(hi.x); o.y = qpn2_unshuffle_nibbles(hi.y); codes[unit + 64] = o;
    o.x = qpn2_unshuffle_nibbles(hi.z); o.y = qpn2_unshuffle_nibbles(hi.w); codes[unit + 96] = o;

    // The host reads the flag once after the launch (one sync per prepack, a load-time call)
    // and, only then, finds the first bad byte on the CPU for the error message.
#if QPN_MX
    const size_t block_unit = ((size_t)t * (groups / 2) + g0 / 2) * QPN_TILE_N + lane;
    scales[block_unit] = (qpn_u8)s2;
    scales[block_unit + 32] = (qpn_u8)(s2 >> 8);
    if ((s2 & 0xFFu) == 0xFFu || (s2 >> 8) == 0xFFu) atomicOr(flags, 1);
#else
#pragma unroll
    for (int j = 0; j < QPN2_PREPACK_GROUPS_PER_THREAD; ++j) {
        scales[unit + 32 * j] = (qpn_u8)(s4 >> (8 * j));
    }
    if (qpn_e4m3x4_nan_mask(s4)) atomicOr(flags, 1);
#endif
}
