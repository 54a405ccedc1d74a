"""Does a named barrier wait for the warp's outstanding global loads? clock64 around bar.sync / bar.arrive /
membar.cta right after a cold global load whose value is used only later (the scratch probe as run in issue 25's
session; results in README.md). Read the first column only: the second ("to the load's value") does not wait
for the load (nothing orders the clock read after a use of v), so it is not the load's latency."""
import cupy as cp

SRC = r"""
extern "C" __global__ void probe(const unsigned* __restrict__ p, unsigned long long* out, int mode, int stride,
                                 int off) {
    const int w = threadIdx.x >> 5;
    unsigned v = 0;
    if (w == 0) {
        const unsigned* q = p + (long long)blockIdx.x * stride + off + (threadIdx.x & 31);
        long long t0 = clock64();
        if (mode & 1) asm volatile("ld.global.cs.u32 %0, [%1];" : "=r"(v) : "l"(q));
        if (mode & 2) asm volatile("bar.sync 1, 64;" ::: "memory");
        if (mode & 4) asm volatile("bar.arrive 1, 64;" ::: "memory");
        if (mode & 8) asm volatile("membar.cta;" ::: "memory");
        long long t1 = clock64();
        asm volatile("" :: "r"(v));
        long long t2 = clock64();
        v += (unsigned)(t2 - t1);   // forces the load done now
        long long t3 = clock64();
        if ((threadIdx.x & 31) == 0) {
            out[3 * blockIdx.x] = t1 - t0; out[3 * blockIdx.x + 1] = t3 - t0; out[3 * blockIdx.x + 2] = v;
        }
    } else {
        if (mode & 6) asm volatile("bar.sync 1, 64;" ::: "memory");
    }
}
"""
fn = cp.RawModule(code=SRC, options=("--gpu-architecture=compute_75",)).get_function("probe")
blocks, stride = 1024, 1 << 16
buf = cp.ones(blocks * stride, cp.uint32)
out = cp.zeros(3 * blocks, cp.uint64)
for mode, label in ((0, "nothing"), (1, "load only"), (2, "bar.sync only"), (3, "load + bar.sync"),
                    (4, "bar.arrive only"), (5, "load + bar.arrive"), (8, "membar.cta only"), (9, "load + membar.cta")):
    for rep in range(2):
        cp.cuda.runtime.deviceSynchronize()
        fn((blocks,), (64,), (buf, out, cp.int32(mode), cp.int32(stride), cp.int32(32 * (2 * mode + rep))))
    o = out.get().reshape(-1, 3)
    print(f"{label:20s} cycles to after the barrier: median {int(sorted(o[:, 0])[blocks // 2]):6d}   "
          f"to the load's value: {int(sorted(o[:, 1])[blocks // 2]):6d}")
