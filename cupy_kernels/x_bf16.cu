// x_bf16.cu: bf16 activations into the fp16 kernels (docs/DESIGN.md, "bf16 activations", the Turing path:
// sm_75's m16n8k8 multiplies fp16 only).
//
// Kernel:  qpn_x_bf16_rows   one block per row of x (nb2 > 0: per row of the fragments' 16 * nb2)
// Reads    x       bf16 bits [M][K] (K % 4 == 0, 8-byte aligned; nb2 > 0: K % 16 == 0)
// Writes   x16     nb2 = 0: fp16 [M][K], x16 = RN16(x * 2^e), e the row's exponent (below);
//                  nb2 > 0: the same values in the decode / GEMM kernels' fragment order (x_fragments.cu:
//                  [K/16][nb2][32 lanes][16 bytes], rows >= M zeros), so a call that reads fragments needs
//                  no launch more than its fp16 twin
//          factor  fp32 [M]: 2^-e (the decode, GEMM and MoE epilogues multiply each fp32 sum by its row's)
//
// e = min(15 - floor(log2 max|x|), 127) over the row's finite values (0 for a row of zeros and infinities)
// brings the largest into fp16's top binade [2^15, 2^16) (the cap: a row below 2^-111 gets 2^127, which
// already puts bf16's least value, 2^-133, at 2^-6, inside fp16's normal range). A bf16 value has 8
// significant bits and fp16 11, so every x with |x * 2^e| >= 2^-14 (fp16's least normal: the 29 binades
// below the top) converts exactly; a smaller one rounds once in fp16's subnormals, by at most 2^-25 * 2^-e
// (qpn.ref.dtypes.fp16_rows is this rule; its term in the bound: ref/linear.py). inf and NaN keep their
// class (inf * 2^e = inf). e lies in [-112, 127]: 2^e and 2^-e are fp32 values (2^-127 a subnormal, exact),
// and x * 2^e is one exact fp32 multiply before the one RN16.
// Cost: the row is read twice (max, then convert: L1 hits) and written once. Measured on the H200
// (benchmarks/results/bf16_h200.md): with its launch, 1.6-2.2 us at M <= 8, where the fp16 decode takes no
// launch before its kernel; at M > 8 it replaces the fp16 fragments' launch (+2-8 %). Tried instead at
// M <= 8: each decode warp converting its own loads (14 more sm_75 instructions per group-tile: 320 -> 376
// for QPN2) ran 14336x4096 at 1.26x fp16 against this launch's 1.07x (4096x4096: 1.19x either way).
#include "qpn_common.cuh"

#define QPN_BF16_THREADS 256
#define QPN_BF16_MAX_EXP 127  // the cap on e (qpn.ref.dtypes.FP16_ROWS_MAX_EXP): 2^e stays an fp32 value

__device__ __forceinline__ float qpn_pow2(int e) {  // 2^e, e in [-149, 127]: exact
    return __uint_as_float(e >= -126 ? (qpn_u32)(127 + e) << 23 : 1u << (149 + e));
}

// The largest finite |x| of four bf16 values (two words) as bits, folded into `big`: bf16 magnitudes order as
// integers; 0x7F80 and above (inf, NaN) count 0.
__device__ __forceinline__ qpn_u32 qpn_bf16x4_max_bits(uint2 v, qpn_u32 big) {
    const qpn_u32 h[4] = {v.x & 0x7FFFu, (v.x >> 16) & 0x7FFFu, v.y & 0x7FFFu, (v.y >> 16) & 0x7FFFu};
#pragma unroll
    for (int j = 0; j < 4; ++j) big = max(big, h[j] < 0x7F80u ? h[j] : 0u);
    return big;
}

// e of a row whose largest finite |x| has the bits `big`: floor(log2 max) is a normal's exponent field less
// 127, a subnormal's m * 2^-133 (m its 7-bit field).
__device__ __forceinline__ int qpn_bf16_row_exponent(qpn_u32 big) {
    const int biased = (int)(big >> 7);
    const int e = big == 0 ? 0 : 15 - (biased ? biased - 127 : 31 - __clz((int)(big & 0x7Fu)) - 133);
    return min(e, QPN_BF16_MAX_EXP);
}

// Four bf16 values (two words) times 2^e (`scale`: one exact fp32 multiply), each rounded once to fp16.
__device__ __forceinline__ uint2 qpn_bf16x4_to_f16(uint2 v, float scale) {
    const qpn_u32 in[4] = {v.x << 16, v.x & 0xFFFF0000u, v.y << 16, v.y & 0xFFFF0000u};  // exact fp32
    qpn_u32 out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = qpn_float_to_half_rn(__fmul_rn(__uint_as_float(in[j]), scale));
    return make_uint2(out[0] | (out[1] << 16), out[2] | (out[3] << 16));
}

// The block's row: the exponent e of its largest finite |x| (every thread gets it).
__device__ __forceinline__ int qpn_row_exponent(const uint2* __restrict__ src, int k) {
    __shared__ qpn_u32 warp_max[QPN_BF16_THREADS / 32];
    qpn_u32 big = 0;
    for (int i = threadIdx.x; i < k / 4; i += QPN_BF16_THREADS) big = qpn_bf16x4_max_bits(src[i], big);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) big = max(big, __shfl_xor_sync(0xFFFFFFFFu, big, d));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = big;
    __syncthreads();
    big = 0;
#pragma unroll
    for (int w = 0; w < QPN_BF16_THREADS / 32; ++w) big = max(big, warp_max[w]);
    return qpn_bf16_row_exponent(big);
}

extern "C" __global__ void __launch_bounds__(QPN_BF16_THREADS) qpn_x_bf16_rows(
    const qpn_u16* __restrict__ x, void* __restrict__ x16, float* __restrict__ factor, int m_rows, int k, int nb2)
{
    const int row = blockIdx.x;
    const uint2* src = reinterpret_cast<const uint2*>(x + (long long)row * k);
    const bool real = row < m_rows;  // uniform; nb2 > 0: rows [M, 16 nb2) write the fragments' zeros
    const int e = real ? qpn_row_exponent(src, k) : 0;
    if (real && threadIdx.x == 0) factor[row] = qpn_pow2(-e);
    const float scale = qpn_pow2(e);
    if (nb2 == 0) {
        uint2* dst = reinterpret_cast<uint2*>(static_cast<qpn_u16*>(x16) + (long long)row * k);
        for (int i = threadIdx.x; i < k / 4; i += QPN_BF16_THREADS) dst[i] = qpn_bf16x4_to_f16(src[i], scale);
        return;
    }
    // fragment order (x_fragments.cu): the 8 bytes x[row][16 g + 4 t .. + 3] go to pair jp = row / 16, half
    // (row / 8) % 2, lane 4 (row % 8) + t of group g
    uint2* dst = reinterpret_cast<uint2*>(x16) + 2 * ((row >> 4) * 32 + 4 * (row & 7)) + ((row >> 3) & 1);
    for (int i = threadIdx.x; i < k / 4; i += QPN_BF16_THREADS)  // i = 4 g + t
        dst[2 * (((long long)(i >> 2) * nb2) * 32 + (i & 3))] = real ? qpn_bf16x4_to_f16(src[i], scale)
                                                                     : make_uint2(0u, 0u);
}
