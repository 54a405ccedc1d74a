"""The fused MoE decode (qpn.cupy_kernels.moe; issue 22, part 3): the route the GPU builds from the ids,
bit for bit against its definition; every slot's expert rows equal to the dense decode kernels' rows of
that expert (the same split and order), so the op equals a loop of dense decode calls plus the reference
combine, bit for bit, at every M (chunks of 1024 // top_k tokens, experts cut into 32-row pieces) and
top-k, with every expert hit, a single one hit, one hot expert taking every token (full pieces and a
class-3 remainder; FP8 gated as two passes), and ids outside [0, E) adding no term; a CUDA graph replays
it; memcheck and racecheck clean. The launch geometry's host rules run everywhere."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from qpn.cupy_kernels import moe as ck_moe

sys.path.insert(0, os.path.dirname(__file__))
from test_moe_ops import checkpoint_experts, hot_expert, routing  # noqa: E402  (the CPU op tests' experts)

FORMATS = ["nvfp4", "tensor", "channel", "block"]
H, INTER = 256, 128  # 128x128 FP8 blocks need K % 128 on both projections


# ----------------------------------------------------------------------------- host rules (CPU)


def class_counts(ids: np.ndarray, experts: int) -> np.ndarray:
    """Pieces per class of a routing (qpn_moe.cuh): each hit expert's full 32-row pieces are the top class,
    its remainder of r rows class (r - 1) // 8; -1 ids are no expert."""
    counts = np.bincount(ids[ids >= 0], minlength=experts)
    rest = counts % ck_moe.PIECE_ROWS
    out = np.bincount((rest[rest > 0] - 1) // 8, minlength=ck_moe.MOE_CLASSES)[:ck_moe.MOE_CLASSES]
    out[-1] += (counts // ck_moe.PIECE_ROWS).sum()
    return out


def reaching(cls: int, m: int, top_k: int, experts: int) -> np.ndarray:
    """A routing with class_blocks(cls) pieces in class `cls`: as many remainders as the best trade allows,
    each with the class's fewest rows, and (top class) as many full pieces as the slots and each expert's M
    allow; each expert's choices one run of slots placed token-major (slot i -> token i % m, choice
    i // m), so no token chooses an expert twice; the slots left over hold -1."""
    slots, lowest, piece = m * top_k, 8 * cls + 1, ck_moe.PIECE_ROWS
    counts = np.zeros(experts, np.int64)
    if lowest <= m:
        best = ck_moe.class_blocks(cls, m, experts, slots)
        for r in range(min(experts, slots // lowest) + 1):
            caps = np.where(np.arange(experts) < r, (m - lowest) // piece, m // piece)
            if cls < ck_moe.MOE_CLASSES - 1:
                caps[:] = 0
            full = min(caps.sum(), (slots - lowest * r) // piece)
            if r + full == best:
                counts[:r] = lowest
                for e in range(experts):
                    take = min(caps[e], full)
                    counts[e], full = counts[e] + piece * take, full - take
                break
    assert counts.max(initial=0) <= m and counts.sum() <= slots
    ids = np.full(slots, -1)
    ids[:counts.sum()] = np.repeat(np.arange(experts), counts)
    ids = ids.reshape(top_k, m).T
    assert all(len(set(row[row >= 0])) == (row >= 0).sum() for row in ids)
    return ids


def test_class_blocks_bounds_every_routing_and_is_reached():
    """The grid's piece extent per class: no routing has more pieces in a class (random top-k routings,
    and routings packed onto few experts), and one routing reaches it, so no smaller fixed grid would do.
    M runs past 32 up to a whole chunk (full pieces)."""
    rng = np.random.default_rng(0)
    for top_k in (1, 2, 8):
        for m in (*range(1, 33), 40, 64, 100, ck_moe.chunk_rows(10 ** 6, top_k)):
            for experts in (top_k, 8, 128):
                slots = m * top_k
                bound = [ck_moe.class_blocks(c, m, experts, slots) for c in range(ck_moe.MOE_CLASSES)]
                for few in (top_k, experts):  # random routings over `few` of the experts
                    for _ in range(4):
                        ids = np.stack([rng.permutation(few)[:top_k] for _ in range(m)])
                        assert (class_counts(ids, experts) <= bound).all(), (m, top_k, experts, ids)
                for cls in range(ck_moe.MOE_CLASSES):
                    ids = reaching(cls, m, top_k, experts)
                    assert class_counts(ids, experts)[cls] == bound[cls], (m, top_k, experts, cls)


def test_every_class_has_a_build_and_its_passes_cover_the_class():
    for key in ("qpn2", "qpn8", "qpn8_block"):
        for gated in (False, True):
            for cls in range(ck_moe.MOE_CLASSES):
                nb, passes = ck_moe.class_build(key, gated, cls)
                assert (key, nb, gated) in ck_moe.EXPERT_DECODE, (key, gated, cls)
                assert 8 * nb * passes >= 8 * (cls + 1) and passes >= 1


# ----------------------------------------------------------------------------- GPU


def gpu():
    import torch

    assert torch.cuda.is_available(), "the gpu marker found a CUDA device (CuPy), torch must see it too"
    return torch


def packed_on_gpu(fmt: str, experts: int, seed: int):
    from qpn.torch_bridge import PackedExperts

    rng = np.random.default_rng(seed)
    return PackedExperts.from_checkpoint(checkpoint_experts(rng, experts, fmt, H, INTER)).to("cuda")


def dense_loop(torch, packed, x, weights, ids):
    """Each hit expert through the dense decode kernels (torch_bridge._cuda.linear_on("decode")), then
    the reference combine: what the fused kernels must equal bit for bit."""
    from qpn.ref import moe as ref_moe
    from qpn.torch_bridge import _cuda

    m, top_k = ids.shape
    y = np.zeros((m, top_k, H), np.float16)
    xt = torch.from_numpy(x).cuda()
    for e in np.unique(ids[ids >= 0]):
        rows, choices = np.nonzero(ids == e)
        w13, w2 = packed.expert(int(e))
        for i in range(0, len(rows), 32):  # the decode kernels' M range; rows never share a sum
            r, c = rows[i:i + 32], choices[i:i + 32]
            hidden = _cuda.linear_on("decode", w13.weight_format, xt[torch.from_numpy(r).cuda()].contiguous(),
                                     tuple(w13.buffers.values()), 2 * INTER, H, INTER, True)
            y[r, c] = _cuda.linear_on("decode", w2.weight_format, hidden, tuple(w2.buffers.values()), H, INTER, H,
                                      False).cpu().numpy()
    weights = np.where(ids >= 0, weights, 0).astype(np.float32)  # an id outside [0, E) adds nothing
    return ref_moe.combine(y, weights)


def fused(torch, packed, x, weights, ids):
    return packed.forward(torch.from_numpy(x).cuda(), torch.from_numpy(weights).cuda(),
                          torch.from_numpy(ids).cuda()).cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,top_k", [(1, 1), (1, 8), (5, 2), (8, 8), (9, 2), (17, 4), (32, 2), (32, 8), (41, 2),
                                     (100, 8), (200, 8), (300, 2), (1100, 1)])
def test_the_fused_op_is_the_dense_decode_loop_bit_for_bit(fmt, m, top_k):
    torch = gpu()
    packed = packed_on_gpu(fmt, 8, seed=m * 10 + top_k)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, H)).astype(np.float16)
    weights, ids = routing(rng, m, 8, top_k)
    want = dense_loop(torch, packed, x, weights, ids)
    assert np.array_equal(fused(torch, packed, x, weights, ids).view(np.uint16), want.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_hot_expert_every_expert_and_a_single_one(fmt):
    """90 tokens on one expert (two full pieces and a remainder of 26, all class 3: FP8 gated runs them as
    two passes of 16), every expert of 8 hit, and a batch where every choice is one expert; int32 ids as
    vLLM passes them."""
    torch = gpu()
    packed = packed_on_gpu(fmt, 8, seed=1)
    rng = np.random.default_rng(2)
    m = 90
    x = rng.standard_normal((m, H)).astype(np.float16)
    weights, ids = routing(rng, m, 8, 2)
    hot = hot_expert(ids, 3)
    every = np.stack([np.arange(m) % 8, (np.arange(m) + 1) % 8], axis=1)
    single = np.full((m, 1), 6, np.int64)
    for case_ids, case_weights in ((hot, weights), (every, weights), (single, weights[:, :1])):
        case_ids = case_ids.astype(np.int32)
        want = dense_loop(torch, packed, x, case_weights, case_ids)
        assert np.array_equal(fused(torch, packed, x, case_weights, case_ids).view(np.uint16), want.view(np.uint16))


@pytest.mark.gpu
def test_ids_outside_the_experts_add_no_term_and_unhit_experts_are_not_used():
    """vLLM's expert maps mark experts held elsewhere -1: those choices add nothing. Experts nobody hits
    are filled with NaN-decoding bytes: the output stays finite and equal to the loop's."""
    torch = gpu()
    packed = packed_on_gpu("channel", 8, seed=5)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, H)).astype(np.float16)
    weights, ids = routing(rng, 4, 8, 2)
    ids = np.where(ids % 2 == 0, ids, -1)  # odd experts held elsewhere
    ids[0, 1] = 99
    for e in range(1, 8, 2):  # e4m3 0x7F is NaN: any read-and-use of an odd expert shows
        packed.w13["codes"][e].fill_(0x7F)
        packed.w2["codes"][e].fill_(0x7F)
    got = fused(torch, packed, x, weights, ids)
    ids_for_loop = np.where((ids >= 0) & (ids < 8), ids, -1)
    assert np.isfinite(got.astype(np.float32)).all()
    assert np.array_equal(got.view(np.uint16), dense_loop(torch, packed, x, weights, ids_for_loop).view(np.uint16))


@pytest.mark.gpu
def test_the_route_is_its_definition():
    """The route of qpn_moe.cuh, read back: offsets, slots in ascending (token, choice) order per expert,
    each choice's slot, the classes' expert lists."""
    torch = gpu()
    import cupy

    from qpn.cupy_kernels.loader import kernel

    rng = np.random.default_rng(7)
    m, top_k, experts = 230, 4, 16  # one chunk of 256 tokens
    _, ids = routing(rng, m, experts, top_k)
    hot = ids[:, 0].copy()
    ids[:150] = np.where(ids[:150] == 11, hot[:150, None], ids[:150])  # expert 11: >= 150 tokens, 4 full
    ids[:150, 0] = 11                                                    # pieces and a remainder
    slots = m * top_k
    route = cupy.full(ck_moe.route_size(experts, slots), -7, np.int32)
    kernel(ck_moe.ROUTE)((1,), (ck_moe.ROUTE_LIMIT,), (cupy.asarray(ids), np.int32(1), np.int32(slots),
                                                      np.int32(top_k), np.int32(experts), route, np.uint64(0),
                                                      np.int32(0)))
    got = route.get()
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=experts)
    assert counts[11] >= 150
    off = np.concatenate([[0], np.cumsum(counts)])
    order = np.argsort(flat, kind="stable")  # slots: by expert, then (token, choice)
    slot_of = np.empty(slots, np.int64)
    slot_of[order] = np.arange(slots)
    at = experts + 1
    assert np.array_equal(got[:at], off)
    assert np.array_equal(got[at:at + slots], order // top_k)
    assert np.array_equal(got[at + slots:at + 2 * slots], slot_of)
    pieces: list[list[int]] = [[] for _ in range(4)]  # by expert, then piece: e | p << 16
    for e in range(experts):
        for p in range(-(-counts[e] // 32)):
            rows = min(32, counts[e] - 32 * p)
            pieces[(rows - 1) // 8].append(e | p << 16)
    list_len = min(experts, slots) + slots // 32
    lists = got[at + 2 * slots + 4:].reshape(4, list_len)
    for c in range(4):
        assert got[at + 2 * slots + c] == len(pieces[c])
        assert np.array_equal(lists[c, :len(pieces[c])], pieces[c])
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 40])
def test_a_cuda_graph_replays_the_fused_op(m):
    torch = gpu()
    packed = packed_on_gpu("nvfp4", 8, seed=8)
    rng = np.random.default_rng(8)
    x = torch.from_numpy(rng.standard_normal((m, H)).astype(np.float16)).cuda()
    w, ids = (torch.from_numpy(a).cuda() for a in routing(rng, m, 8, 2))
    packed.forward(x, w, ids)  # compile the kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = packed.forward(x, w, ids)
    for seed in (9, 10):
        r = np.random.default_rng(seed)
        x.copy_(torch.from_numpy(r.standard_normal((m, H)).astype(np.float16)))
        new_w, new_ids = routing(r, m, 8, 2)
        w.copy_(torch.from_numpy(new_w))
        ids.copy_(torch.from_numpy(new_ids))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, packed.forward(x, w, ids))


# ----------------------------------------------------------------------------- sanitizer


def drive() -> None:
    """Exact-size CuPy allocations (no pool): the fused MoE at the classes' edges, both layouts, K split
    across blocks (Mixtral-like down: few tiles, long K) included."""
    import cupy

    from qpn.cupy_kernels.layouts import layout_kernels
    from qpn.ref.formats import QPN2, QPN8

    cupy.cuda.set_allocator(None)
    rng = np.random.default_rng(0)

    def buffers(wf, experts: int, n: int, k: int) -> tuple:
        if wf is QPN2:
            return (cupy.asarray(rng.integers(0, 256, (experts, n, k // 2), dtype=np.uint8)),
                    cupy.asarray(rng.integers(0x28, 0x50, (experts, n, k // 16), dtype=np.uint8)),
                    cupy.full((experts, n // 32), 1e-3, np.float32))
        return (cupy.asarray(rng.integers(0, 0x70, (experts, n, k), dtype=np.uint8)),
                cupy.full((experts, 1, n), 0.01, np.float16))

    for wf, (h, inter, experts) in ((QPN2, (256, 128, 8)), (QPN8, (128, 2048, 4)), (QPN2, (128, 2048, 4))):
        kernels = layout_kernels(wf)
        w13, w2 = buffers(wf, experts, 2 * inter, h), buffers(wf, experts, h, inter)
        cases = [(c, np.float16) for c in ((1, 1), (8, 2), (9, 4), (32, 2), (45, 2), (150, 2), (300, 4))]
        cases += [(c, np.int16) for c in ((1, 1), (9, 4), (150, 2))]  # int16: bf16 bits (fp16 rows first)
        for (m, top_k), act in cases:
            slots = ck_moe.chunk_rows(m, top_k) * top_k
            x = cupy.asarray(rng.standard_normal((m, h)).astype(np.float16))
            if act == np.int16:
                x = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
            ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(m)]).astype(np.int64)
            if top_k == 2 and m in (32, 150):
                ids[:, 0] = 0  # one expert with every token (150: 4 full pieces and a remainder)
                ids[:, 1] = 1 + np.arange(m) % (experts - 1)
            size = ck_moe.moe_workspace_size(wf.format, m, top_k, h, inter, experts, act == np.int16)
            out = cupy.empty((m, h), act)
            ck_moe.launch_moe(kernels, x, w13, w2, inter, cupy.full((m, top_k), 0.5, np.float32),
                              cupy.asarray(ids), cupy.empty(ck_moe.route_size(experts, slots), np.int32),
                              cupy.empty(size, np.float32) if size else None,
                              cupy.empty((slots, inter), act), cupy.empty((slots, h), act), out)
    cupy.cuda.runtime.deviceSynchronize()
    print("driver done")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_clean(compute_sanitizer, tool):
    compute_sanitizer(tool, __file__)


if __name__ == "__main__" and "--drive" in sys.argv:
    drive()
