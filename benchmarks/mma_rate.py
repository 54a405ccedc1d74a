"""Tensor-core issue rate of the Turing-legal mma.sync.m16n8k8 (f16 x f16 + f32) on this GPU, next to
m16n8k16 (sm_80+), in one run: the ceiling a decode kernel at M = 32 (16 m16n8k8 per 512 weights) meets.

    python benchmarks/mma_rate.py      # prints TFLOP/s and SM cycles per mma per SM for each shape

Each warp runs 8 independent accumulator chains (latency hidden inside the warp), 32 warps per SM,
4096 iterations; the operands are constant (the rate of the tensor pipe does not depend on them).
"""
import cupy as cp

SRC = r"""
extern "C" __global__ void mma_k8(float* out, int iters) {
    float c[8][4] = {};
    unsigned a0 = threadIdx.x * 0x00010001u, a1 = a0 ^ 0x3C003C00u, b = 0x3C003C00u;
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                         : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3]) : "r"(a0), "r"(a1), "r"(b));
    }
    float s = 0.f;
    for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void mma_k16(float* out, int iters) {
    float c[8][4] = {};
    unsigned a0 = threadIdx.x * 0x00010001u, a1 = a0 ^ 0x3C003C00u, b = 0x3C003C00u;
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                         : "r"(a0), "r"(a1), "r"(a1), "r"(a0), "r"(b), "r"(b));
    }
    float s = 0.f;
    for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""

if __name__ == "__main__":
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    clock_khz = dev.attributes["ClockRate"]
    arch = "".join(str(v) for v in dev.compute_capability)
    iters, threads = 4096, 1024
    for name, k, opts in (("mma_k8", 8, ("--gpu-architecture=compute_75",)),
                          ("mma_k16", 16, (f"--gpu-architecture=compute_{max(80, int(arch))}",))):
        fn = cp.RawModule(code=SRC, options=opts).get_function(name)
        out = cp.empty(sms * threads, cp.float32)
        fn((sms,), (threads,), (out, cp.int32(iters)))
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn((sms,), (threads,), (out, cp.int32(iters)))
        end.record()
        end.synchronize()
        sec = cp.cuda.get_elapsed_time(start, end) / 1e3
        mmas = sms * threads // 32 * iters * 8
        flops = mmas * 2 * 16 * 8 * k
        cycles_per_mma_per_sm = sec * clock_khz * 1e3 / (mmas / sms)
        print(f"m16n8k{k}: {flops / sec / 1e12:.0f} TFLOP/s, {cycles_per_mma_per_sm:.2f} SM cycles per mma per SM "
              f"(clock {clock_khz / 1e6:.2f} GHz, {sms} SMs)")
