// ceiling.cu: memory ceilings for benchmarks/bench_kernels.py (not a qpn kernel; built by the
// same loader, so on the H200 it is compute_75 PTX JIT-compiled like the kernels it judges).
//
// Kernels: stream_read, stream_write, stream_copy.   Macros: none.
//
// Grid-stride loops over 16-byte vectors, 4 independent vectors per thread per iteration
// (64 bytes in flight per thread); loads use __ldcs (evict-first, read once), like the kernels.
//   stream_read   reads n_vec uint4, XOR-folds them; writes only if the fold hits a magic value
//                 (never on real data), so the loads cannot be removed
//   stream_write  writes n_vec uint4 of a pattern
//   stream_copy   dst[i] = src[i]
#define UNROLL 4

extern "C" __global__ void stream_read(const uint4* __restrict__ src, long long n_vec, unsigned* __restrict__ sink) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; i + (UNROLL - 1) * stride < n_vec; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) v[j] = __ldcs(src + i + j * stride);
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < n_vec; i += stride) {
        const uint4 v = __ldcs(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;
}

extern "C" __global__ void stream_write(uint4* __restrict__ dst, long long n_vec, unsigned pattern) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    uint4 v;
    v.x = pattern; v.y = pattern ^ 1u; v.z = pattern ^ 2u; v.w = pattern ^ 3u;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_vec; i += stride) dst[i] = v;
}

extern "C" __global__ void stream_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n_vec) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (UNROLL - 1) * stride < n_vec; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) v[j] = __ldcs(src + i + j * stride);
#pragma unroll
        for (int j = 0; j < UNROLL; ++j) dst[i + j * stride] = v[j];
    }
    for (; i < n_vec; i += stride) dst[i] = __ldcs(src + i);
}
