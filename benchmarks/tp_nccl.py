"""Tensor parallelism of qpn's vLLM linear method on two GPUs with NCCL (issue 7; a script, not a test).

    python benchmarks/tp_nccl.py [--hidden 2048] [--intermediate 5632] [--m 1,8,32,128] [--iters 50]

Two processes, one GPU each (torch.distributed, NCCL, 127.0.0.1, a free port, bounded timeouts),
shard a ModelOpt NVFP4 and a ModelOpt FP8 checkpoint of a transformer MLP block through vLLM's
sequence as tests/vllm_standin.py drives it (create_weights -> weight_loader per shard ->
process_weights_after_loading -> apply): fused gate_up column-parallel with a different global
scale per shard + the gated SiLU-and-mul epilogue inside the op, down row-parallel + NCCL
all-reduce. The same block unsharded on GPU 0 is the reference:
- column-parallel outputs (raw gate_up, gated activation) and each rank's down_proj W16 must be
  bit-identical to the matching slices of the unsharded run;
- the all-reduced output must lie in the interval and the bound of
  vllm_standin.all_reduce_bounds (derived there), against qpn.ref.linear on the same activation.
Then it times the MLP forward (gated gate_up + down + all-reduce) per M on 2 GPUs and unsharded on
1 GPU (CUDA events around ITERS calls after WARMUP calls; median of REPEATS).

With fewer than two GPUs (or without CuPy, which the CUDA ops need) it prints
"skipped: needs 2 GPUs ..." and exits 0. Exit status 1 when a correctness check fails.
NVLink multicast stays off in every process: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set here, before anything starts, and inherited by both ranks.
"""

from __future__ import annotations

import os

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)  # before torch / NCCL initialize, in this process and every child

import argparse  # noqa: E402
import datetime  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # tests/vllm_standin.py

WORLD_SIZE = 2
ALGOS = ("NVFP4", "FP8")
WARMUP = 5
REPEATS = 5
PROCESS_GROUP_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 540.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_reason() -> str | None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < WORLD_SIZE:
        return f"skipped: needs {WORLD_SIZE} GPUs, found {count}"
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        return f"skipped: needs {WORLD_SIZE} GPUs and CuPy for the CUDA ops ({exc})"
    return None


def time_forward(fn, iters: int, sync) -> float:
    """Median microseconds per call: REPEATS timings of `iters` calls between two CUDA events."""
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(REPEATS):
        sync()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1000.0 / iters)
    return statistics.median(samples)


def forward(mlp, x):
    act = mlp.gate_up_proj.quant_method.apply_gated(mlp.gate_up_proj, x)
    return mlp.down_proj(act)


def _sync_ranks(dist) -> None:
    torch.cuda.synchronize()
    dist.barrier()


def nccl_worker(rank: int, folders: dict, out_dir: str, hidden: int, intermediate: int, ms: list, iters: int):
    """One rank: correctness results to out_dir/{algo}_rank{rank}.pt, timings to out_dir/times_rank{rank}.pt."""
    os.environ.update(MULTICAST_OFF)
    import torch.distributed as dist
    import vllm_standin as st

    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['QPN_TP_PORT']}", rank=rank,
                            world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
                            device_id=torch.device(device))
    try:
        def all_reduce(t):
            dist.all_reduce(t)
            return t

        times = {}
        for algo, folder in folders.items():
            mlp = st.build_mlp(folder, hidden, intermediate, tp_rank=rank, tp_size=WORLD_SIZE,
                               all_reduce=all_reduce, device=device)
            x = st.mlp_input(ms[0], hidden, seed=0).to(device)
            results = mlp(x)
            results["down_w16"] = mlp.down_proj.quant_method.dequantized_weight(mlp.down_proj)
            torch.save({k: v.cpu() for k, v in results.items()}, os.path.join(out_dir, f"{algo}_rank{rank}.pt"))
            for m in ms:
                xm = st.mlp_input(m, hidden, seed=m).to(device)
                times[(algo, m)] = time_forward(lambda: forward(mlp, xm), iters, lambda: _sync_ranks(dist))
            del mlp
            torch.cuda.empty_cache()
        torch.save(times, os.path.join(out_dir, f"times_rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(args, folders, out_dir) -> None:
    import torch.multiprocessing as mp

    os.environ["QPN_TP_PORT"] = str(free_port())
    context = mp.start_processes(nccl_worker, args=(folders, out_dir, args.hidden, args.intermediate, args.m,
                                                    args.iters),
                                 nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {WORLD_SIZE} NCCL ranks did not finish within {JOIN_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def check(algo, unsharded, ranks, linears, intermediate) -> list[str]:
    """Correctness figures for one checkpoint; returns the failed checks (printed as they go)."""
    import vllm_standin as st

    from qpn import ref

    failures = []
    part = intermediate // WORLD_SIZE

    def report(name, ok, detail=""):
        print(f"  {algo:6s} {name:58s} {'ok' if ok else 'FAILED'} {detail}")
        if not ok:
            failures.append(f"{algo}: {name}")

    for r, rank in enumerate(ranks):
        cols = slice(r * part, (r + 1) * part)
        gate_up = torch.cat([unsharded["gate_up"][:, cols], unsharded["gate_up"][:, intermediate:][:, cols]], dim=1)
        differ = int((rank["gate_up"].view(torch.int16) != gate_up.view(torch.int16)).sum())
        report(f"rank {r}: gate_up columns bit-identical", differ == 0, f"({differ} of {gate_up.numel()} differ)")
        differ = int((rank["act"].view(torch.int16) != unsharded["act"][:, cols].view(torch.int16)).sum())
        report(f"rank {r}: gated activation bit-identical", differ == 0, f"({differ} differ)")
        report(f"rank {r}: down_proj W16 = its input columns of the unsharded W16",
               same_bits(rank["down_w16"], unsharded["down_w16"][:, cols]))
    w16 = st.contract_w16(linears[f"{st.MLP_PREFIX}.down_proj"])
    report("unsharded down_proj W16 = qpn.ref contract W16", same_bits(unsharded["down_w16"], torch.from_numpy(w16)))
    act = unsharded["act"].numpy()
    low, high, bound = st.all_reduce_bounds([act[:, r * part:(r + 1) * part] for r in range(WORLD_SIZE)],
                                            [w16[:, r * part:(r + 1) * part] for r in range(WORLD_SIZE)], act, w16)
    reference = ref.linear(act, w16).astype(np.float64)
    out = ranks[0]["out"].numpy()
    inside = (low <= out) & (out <= high)
    error = np.abs(out.astype(np.float64) - reference)
    report("all-reduced output inside [RN16(lo0+lo1), RN16(hi0+hi1)]", bool(inside.all()),
           f"({int((~inside).sum())} outside)")
    report("|out - qpn.ref.linear| <= derived bound B", bool((error <= bound).all()),
           f"(max error {error.max():.3g}, max B {bound.max():.3g}, max error/B {np.max(error / bound):.3g})")
    report("both ranks hold the same reduced output", same_bits(ranks[0]["out"], ranks[1]["out"]))
    single = np.abs(out.astype(np.float64) - unsharded["out"].numpy().astype(np.float64))
    print(f"  {algo:6s} max |TP=2 - 1 GPU| = {single.max():.3g}; outputs equal bit for bit: "
          f"{int((single == 0).sum())} of {single.size}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--m", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32, 128])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    reason = skip_reason()
    if reason is not None:
        print(reason)
        return 0

    import vllm_standin as st

    print(f"GPUs: {[torch.cuda.get_device_name(i) for i in range(WORLD_SIZE)]}; torch {torch.__version__}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; "
          + ", ".join(f"{k}={os.environ[k]}" for k in MULTICAST_OFF))
    print(f"MLP block: hidden {args.hidden}, intermediate {args.intermediate} (gate_up [{2 * args.intermediate}, "
          f"{args.hidden}], down [{args.hidden}, {args.intermediate}]); correctness at M={args.m[0]}")
    failures = []
    with tempfile.TemporaryDirectory(prefix="qpn_tp_nccl_") as tmp:
        folders, linears = {}, {}
        for algo in ALGOS:
            folders[algo] = os.path.join(tmp, algo.lower())
            os.makedirs(folders[algo])
            t0 = time.perf_counter()
            linears[algo] = st.write_mlp_checkpoint(folders[algo], algo, args.hidden, args.intermediate)
            print(f"  wrote the {algo} checkpoint in {time.perf_counter() - t0:.1f} s")
        out_dir = os.path.join(tmp, "ranks")
        os.makedirs(out_dir)
        t0 = time.perf_counter()
        run_ranks(args, folders, out_dir)
        print(f"  two NCCL ranks finished in {time.perf_counter() - t0:.1f} s")
        times_tp = torch.load(os.path.join(out_dir, "times_rank0.pt"))
        times_1 = {}
        print("correctness (TP=2 vs the unsharded block on cuda:0):")
        for algo in ALGOS:
            mlp = st.build_mlp(folders[algo], args.hidden, args.intermediate, device="cuda:0")
            x = st.mlp_input(args.m[0], args.hidden, seed=0).to("cuda:0")
            unsharded = mlp(x)
            unsharded["down_w16"] = mlp.down_proj.quant_method.dequantized_weight(mlp.down_proj)
            unsharded = {k: v.cpu() for k, v in unsharded.items()}
            ranks = [torch.load(os.path.join(out_dir, f"{algo}_rank{r}.pt")) for r in range(WORLD_SIZE)]
            failures += check(algo, unsharded, ranks, linears[algo], args.intermediate)
            for m in args.m:
                xm = st.mlp_input(m, args.hidden, seed=m).to("cuda:0")
                times_1[(algo, m)] = time_forward(lambda: forward(mlp, xm), args.iters, torch.cuda.synchronize)
            del mlp
    weight_bytes = {"NVFP4": 3 * args.hidden * args.intermediate * (0.5 + 1 / 16), "FP8": 3 * args.hidden
                    * args.intermediate}
    print("\nMLP forward (gated gate_up + down [+ all-reduce]), median us per call:")
    print(f"  {'format':6s} {'M':>5s} {'1 GPU us':>10s} {'TP=2 us':>10s} {'speed-up':>9s} {'1 GPU GB/s':>11s}")
    for algo in ALGOS:
        for m in args.m:
            one, two = times_1[(algo, m)], times_tp[(algo, m)]
            print(f"  {algo:6s} {m:5d} {one:10.1f} {two:10.1f} {one / two:9.2f} "
                  f"{weight_bytes[algo] / one / 1e3:11.1f}")
    if failures:
        print(f"\nFAILED: {failures}")
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
