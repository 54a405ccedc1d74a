"""m16n8k8 (f16 x f16 + f32) rate by warps per SM and independent accumulator chains per warp: how many warps
must issue mma for the tensor pipe to run at its rate (mma_rate.py measures it at 32 warps x 8 chains).

    python benchmarks/mma_sweep.py      # one line per (chains, warps per SM): TFLOP/s

One block per SM of `warps` warps; operands constant (the pipe's rate does not depend on them). Run on the H200
in issue 25's session: results/gemm_ws_h200/README.md (the 32-chain kernel cannot launch with 32 warps: its
registers).
"""
import cupy as cp

SRC = r"""
template <int CH>
__device__ void body(float* out, int iters) {
    float c[CH][4] = {};
    unsigned a0 = threadIdx.x * 0x00010001u, a1 = a0 ^ 0x3C003C00u, b = 0x3C003C00u;
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < CH; ++j)
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                         : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3]) : "r"(a0), "r"(a1), "r"(b));
    }
    float s = 0.f;
    for (int j = 0; j < CH; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void k4(float* o, int it) { body<4>(o, it); }
extern "C" __global__ void k8(float* o, int it) { body<8>(o, it); }
extern "C" __global__ void k16(float* o, int it) { body<16>(o, it); }
extern "C" __global__ void k32(float* o, int it) { body<32>(o, it); }
"""

if __name__ == "__main__":
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    mod = cp.RawModule(code=SRC, options=("--gpu-architecture=compute_75",))
    for ch in (4, 8, 16, 32):
        fn = mod.get_function(f"k{ch}")
        for warps in (4, 8, 12, 16, 32):
            threads = warps * 32
            iters = 2048 * 8 // ch
            out = cp.empty(sms * threads, cp.float32)
            fn((sms,), (threads,), (out, cp.int32(iters)))
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            fn((sms,), (threads,), (out, cp.int32(iters)))
            e1.record()
            e1.synchronize()
            sec = cp.cuda.get_elapsed_time(e0, e1) / 1e3
            mmas = sms * warps * iters * ch
            print(f"chains {ch:2d} warps/SM {warps:2d}: {mmas * 2048 / sec / 1e12:5.0f} TFLOP/s", flush=True)
