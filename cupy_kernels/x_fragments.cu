// x_fragments.cu: x rearranged into the decode kernels' B-fragment order (qpn_mma.cuh, QPN_X_FRAG = 1).
//
// Kernel:  qpn_x_fragments
// Reads    x   fp16 [M][K] row-major, M <= 8 * nb
// Writes   xf  [K/16 groups][nb2 = ceil(nb / 2)][32 lanes] x 16 bytes: lane 4 * gid + t of pair jp
//              holds x[8j + gid][16g + 4t .. 16g + 4t + 3] for j = 2jp (bytes 0..7) and 2jp + 1
//              (bytes 8..15); rows >= M are zeros (they feed only output columns never stored).
//
// Why: a decode kernel's warp then loads the fragments of two 8-token blocks with one coalesced
// 512-byte load (4 L1 wavefronts) instead of two loads that each touch 8 rows (16 wavefronts).
// The copy is M x K x 2 bytes each way (0.5 MiB at M = 32, K = 8192), a few microseconds next to
// the weights. The values are x's bits: nothing about the numerics changes.
#include "qpn_common.cuh"

extern "C" __global__ void qpn_x_fragments(
    const qpn_u16* __restrict__ x, uint4* __restrict__ xf, int m_rows, int k, int nb2)
{
    const long long total = (long long)(k / QPN_GROUP_K) * nb2 * 32;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const int lane = (int)(i & 31);
        const int jp = (int)((i >> 5) % nb2);
        const long long g = (i >> 5) / nb2;
        uint2 half[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 8 * (2 * jp + h) + (lane >> 2);
            half[h] = row < m_rows ? *reinterpret_cast<const uint2*>(x + (long long)row * k + 16 * g + 4 * (lane & 3))
                                   : make_uint2(0u, 0u);
        }
        xf[i] = make_uint4(half[0].x, half[0].y, half[1].x, half[1].y);
    }
}
