"""Tensor parallelism across two real processes: torch.distributed with gloo on CPU (issue 7, CPU part).

Two ranks (torch.multiprocessing spawn, 127.0.0.1, a free port, bounded timeouts) each load their
shards of a ModelOpt NVFP4 and a ModelOpt FP8 checkpoint of a transformer MLP block through vLLM's
sequence (tests/vllm_standin.py: create_weights -> weight_loader per shard ->
process_weights_after_loading -> apply): fused gate_up column-parallel with a different global scale
per shard + the gated SiLU-and-mul epilogue, down row-parallel + all_reduce. The parent runs the same
block unsharded in one process and compares: column-parallel outputs bit for bit, the all-reduced
output within the bound derived in vllm_standin.all_reduce_bounds. benchmarks/tp_nccl.py is the same
on two GPUs with NCCL.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_standin as st  # noqa: E402
from conftest import HANG_GUARD_S  # noqa: E402

from qpn import ref  # noqa: E402

if st.vm.VLLM_AVAILABLE:
    pytest.skip("vLLM is installed: the stand-in runs only where it is absent; tests/test_vllm_real.py runs "
                "tensor parallelism 2 inside vLLM's own LLM()", allow_module_level=True)

WORLD_SIZE = 2
HIDDEN, INTERMEDIATE = 128, 256
M = 5
ALGOS = ("NVFP4", "FP8")
# hang guards, not time limits: a rank may wait at a collective while the other still imports torch under load
PROCESS_GROUP_TIMEOUT_S = float(HANG_GUARD_S)  # every collective of a rank gives up after this
JOIN_TIMEOUT_S = float(HANG_GUARD_S)  # the whole two-process run


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(folders: dict[str, str], out_dir: str) -> None:
    context = mp.start_processes(
        st.tp_worker,
        args=(WORLD_SIZE, "gloo", free_port(), folders, out_dir, HIDDEN, INTERMEDIATE, M, PROCESS_GROUP_TIMEOUT_S),
        nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {WORLD_SIZE} gloo ranks did not finish within {JOIN_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """{algo: (unsharded results, [rank results], checkpoint linears)}."""
    folders, linears = {}, {}
    for algo in ALGOS:
        folder = str(tmp_path_factory.mktemp(f"mlp_{algo.lower()}"))
        linears[algo] = st.write_mlp_checkpoint(folder, algo, HIDDEN, INTERMEDIATE)
        folders[algo] = folder
    out_dir = str(tmp_path_factory.mktemp("ranks"))
    run_ranks(folders, out_dir)
    x = st.mlp_input(M, HIDDEN, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran single-threaded; so does the unsharded run
    try:
        results = {}
        for algo in ALGOS:
            unsharded = st.run_mlp(folders[algo], HIDDEN, INTERMEDIATE, x)
            ranks = [torch.load(os.path.join(out_dir, f"{algo}_rank{r}.pt")) for r in range(WORLD_SIZE)]
            results[algo] = (unsharded, ranks, linears[algo])
    finally:
        torch.set_num_threads(threads)
    return results


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("algo", ALGOS)
def test_gate_up_shards_have_different_global_scales(tp_results, algo):
    _, _, linears = tp_results[algo]
    gate, up = (linears[f"{st.MLP_PREFIX}.{s}_proj"] for s in ("gate", "up"))
    scale = (lambda lin: float(lin.global_scale)) if algo == "NVFP4" else (lambda lin: float(lin.weight_scale))
    assert scale(up) > 2 * scale(gate)  # a max() collapse would mis-scale gate 3x


@pytest.mark.parametrize("algo", ALGOS)
def test_column_parallel_outputs_are_bit_identical(tp_results, algo):
    unsharded, ranks, _ = tp_results[algo]
    part = INTERMEDIATE // WORLD_SIZE
    for r, rank in enumerate(ranks):
        cols = slice(r * part, (r + 1) * part)
        # raw gate_up: rank r holds [gate rows of r | up rows of r]
        expected = torch.cat([unsharded["gate_up"][:, cols], unsharded["gate_up"][:, INTERMEDIATE:][:, cols]], dim=1)
        assert same_bits(rank["gate_up"], expected)
        assert same_bits(rank["act"], unsharded["act"][:, cols])  # gated epilogue inside the op
        assert same_bits(rank["act"], rank["act_separate"])  # = linear, then silu_and_mul
        assert same_bits(rank["down_w16"], unsharded["down_w16"][:, cols])  # each rank's input columns


@pytest.mark.parametrize("algo", ALGOS)
def test_all_reduced_output_within_the_derived_bound(tp_results, algo):
    unsharded, ranks, linears = tp_results[algo]
    part = INTERMEDIATE // WORLD_SIZE
    w16 = st.contract_w16(linears[f"{st.MLP_PREFIX}.down_proj"])
    assert same_bits(unsharded["down_w16"], torch.from_numpy(w16))
    act = unsharded["act"].numpy()
    x_parts = [act[:, r * part:(r + 1) * part] for r in range(WORLD_SIZE)]
    w_parts = [w16[:, r * part:(r + 1) * part] for r in range(WORLD_SIZE)]
    low, high, bound = st.all_reduce_bounds(x_parts, w_parts, act, w16)
    for rank in ranks:
        out = rank["out"].numpy()
        assert same_bits(rank["out"], ranks[0]["out"])  # every rank holds the same reduced result
        assert ((low <= out) & (out <= high)).all()
        assert (np.abs(out.astype(np.float64) - ref.linear(act, w16)) <= bound).all()
        full_error = ref.linear_error_bound(act, w16)
        assert (np.abs(out.astype(np.float64) - unsharded["out"].numpy().astype(np.float64))
                <= bound + full_error).all()
    # the reduced output is the sum of the two partials, rounded once
    total = (ranks[0]["partial"].double() + ranks[1]["partial"].double()).half()
    assert same_bits(ranks[0]["out"], total)
