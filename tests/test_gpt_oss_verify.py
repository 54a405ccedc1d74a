"""`qpn verify` on gpt-oss's stacked MXFP4 experts (apps/verify.py's verify_experts, apps/mxfp4_checks.py): one row
per projection of a stack, every check run on every expert; and each check fails, naming the row and the expert,
when its side is corrupted in memory.

An original folder is its own truth (verify compares everything with the checkpoint's bytes), so a byte flipped in
its *_blocks on disk is a different valid checkpoint that verifies clean; the corruptions below go where verify's
checks look: the reference's QPNMX prepack, a backend's packed weight, the reference W16.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from qpn import checkpoints, torch_bridge
from qpn.apps import cli, mxfp4_checks
from qpn.apps.verify import VERIFY_CHECKS
from qpn.ref import mxfp4 as mx

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", "gpt_oss", "tiny_mxfp4")
ROWS = [f"model.layers.{layer}.mlp.experts.{stem}" for layer in (0, 1) for stem in ("w13", "w2")]
SHAPES = {"w13": ("128", "128"), "w2": ("128", "64")}  # N, K: 2I x H and H x I (H 128, I 64)
EXPERTS = 8
TARGET_STACK, TARGET_STEM, TARGET_EXPERT = "model.layers.1.mlp.experts", "w2", 5  # the expert corrupted below
TARGET_ROW = f"{TARGET_STACK}.{TARGET_STEM}"


def run_verify(capsys, folder: str = FIXTURE) -> tuple[int, str, dict[str, dict[str, str]]]:
    """(exit code, stdout, row -> {check: cell}) of `qpn verify FOLDER -q`, in-process."""
    code = cli.main(["verify", folder, "-q"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    rows = {}
    for line in out.splitlines():
        if line.startswith("model.layers."):
            cells = line.split()  # name, "MXFP4", "x8", N, K, then one cell per check
            assert cells[1:5] == ["MXFP4", f"x{EXPERTS}", *SHAPES[cells[0].rpartition(".")[2]]], line
            rows[cells[0]] = dict(zip(VERIFY_CHECKS, cells[-len(VERIFY_CHECKS):], strict=True))
    return code, out, rows


def _digest(blocks: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(blocks).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def experts_of_fixture() -> dict[str, list[str]]:
    """row -> the digest of each expert's blocks, expert 0 first."""
    stacks = checkpoints.load_checkpoint(FIXTURE).experts
    return {f"{path}.{stem}": [_digest(b) for b in getattr(stack, stem).blocks]
            for path, stack in stacks.items() for stem in ("w13", "w2")}


@pytest.fixture(scope="module")
def is_target(experts_of_fixture):
    """blocks -> whether they are the target expert's; its bytes are no other expert's (else the patches below
    would corrupt more than one)."""
    target = experts_of_fixture[TARGET_ROW][TARGET_EXPERT]
    assert sum(d == target for digests in experts_of_fixture.values() for d in digests) == 1
    return lambda blocks: _digest(np.asarray(blocks)) == target


def test_verify_checks_every_expert_of_every_projection(capsys, monkeypatch, experts_of_fixture):
    calls: dict[str, list[str]] = {"round trip": [], "linear bound": []}
    real_round_trip, real_bounds = mxfp4_checks.qpnmx_round_trip, mx.mxfp4_linear_bounds

    def round_trip(blocks, scales):
        calls["round trip"].append(_digest(blocks))
        return real_round_trip(blocks, scales)

    def bounds(x, w16, tile_scale):
        calls["linear bound"].append(w16.shape)
        return real_bounds(x, w16, tile_scale)

    monkeypatch.setattr(mxfp4_checks, "qpnmx_round_trip", round_trip)
    monkeypatch.setattr(mx, "mxfp4_linear_bounds", bounds)
    code, out, rows = run_verify(capsys)
    assert code == 0, out
    assert list(rows) == ROWS
    for row, cells in rows.items():
        assert cells["cuda"] in ("ok", "-") and all(cells[c] == "ok" for c in VERIFY_CHECKS if c != "cuda"), row
    assert f"{len(ROWS)} of {len(ROWS)} layers ok" in out and "FAIL" not in out
    assert "4 quantized layers (w13 and w2 of 2 stacks of 8 MXFP4 experts)" in out
    assert f"the linear on all {EXPERTS} experts" in out
    # every expert went through the round trip, in row order, and the linear (E = 8 <= LINEAR_EXPERTS: all)
    assert calls["round trip"] == [d for row in ROWS for d in experts_of_fixture[row]]
    assert len(calls["linear bound"]) == len(ROWS) * EXPERTS


def _corrupt_reference_prepack(monkeypatch, is_target):
    """The reference's QPNMX codes of the target expert get one byte flipped (0x77: both nibbles' magnitudes)."""
    real = mx.qpnmx_prepack

    def prepack(blocks, scales):
        codes, packed_scales, tile_scale = real(blocks, scales)
        if is_target(blocks):
            codes = codes.copy()
            codes.reshape(-1)[0] ^= 0x77
        return codes, packed_scales, tile_scale

    monkeypatch.setattr(mx, "qpnmx_prepack", prepack)


def _corrupt_backend_pack(monkeypatch, is_target):
    """pack_mxfp4 (the backends' packed weight) gives the target expert's codes with one byte flipped."""
    real = torch_bridge.pack_mxfp4

    def pack(blocks, scales):
        packed = real(blocks, scales)
        if is_target(blocks.cpu().numpy()):
            packed.buffers["codes"].view(-1)[:1].bitwise_xor_(0x77)
        return packed

    monkeypatch.setattr(torch_bridge, "pack_mxfp4", pack)


def _corrupt_reference_w16(monkeypatch, is_target):
    """mxfp4_w16 (the reference W16, also under qpnmx_dequantize) gives one weight of the target one ulp up."""
    real = mx.mxfp4_w16

    def w16_of(blocks, scales):
        w16, tile_scale = real(blocks, scales)
        if is_target(blocks):
            w16 = w16.copy()
            w16.view(np.uint16)[0, 0] += 1
        return w16, tile_scale

    monkeypatch.setattr(mx, "mxfp4_w16", w16_of)


CORRUPTIONS = {  # name -> (patch, {check: a message its FAIL line holds}); the other checks stay ok. "cpu": every
    # backend present (with a GPU, cuda fails alike)
    "reference prepack": (_corrupt_reference_prepack, {
        "unpack": "qpnmx_unpack(qpnmx_prepack(x)) != x for blocks",
        "ref": "qpnmx_dequantize of the packed buffers differs from mxfp4_w16",
        "cpu": "pack_mxfp4 gives other codes bytes than ref.qpnmx_prepack"}),
    "backend pack": (_corrupt_backend_pack, {
        "cpu": "dequantize differs from the reference",
        "linear": "outside the fp32-accumulation bound of ref.mxfp4_linear_bounds"}),
    "reference W16": (_corrupt_reference_w16, {  # one ulp of one weight moves some outputs out of the bound too
        "ref": "mxfp4_w16 differs from the contract RN16(value / 2^T) evaluated in float64 from mxfp4_values in 1 "
               "weight",
        "cpu": "dequantize differs from the reference",
        "linear": "outside the fp32-accumulation bound of ref.mxfp4_linear_bounds"}),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupted_expert_fails_its_checks_and_is_named(capsys, monkeypatch, is_target, corruption):
    patch, failing = CORRUPTIONS[corruption]
    patch(monkeypatch, is_target)
    code, out, rows = run_verify(capsys)
    assert code == 1, out
    assert list(rows) == ROWS
    if "cpu" in failing and rows[ROWS[0]]["cuda"] != "-":  # a CUDA backend is present
        failing = {**failing, "cuda": failing["cpu"]}
    for row, cells in rows.items():
        bad = {c for c, cell in cells.items() if cell == "FAIL"}
        assert bad == (set(failing) if row == TARGET_ROW else set()), (row, cells)
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    for check, message in failing.items():
        assert any(line.startswith(f"FAIL {TARGET_ROW}: {check}: expert {TARGET_EXPERT}: ") and message in line
                   for line in fails), (check, out)
    assert all(f": expert {TARGET_EXPERT}: " in line for line in fails), out  # no other expert is blamed
    assert f"{len(ROWS) - 1} of {len(ROWS)} layers ok; 29 other tensors not checked; 1 FAILED" in out


def test_the_backend_pack_corruption_reaches_the_linear(is_target):
    """The 'backend pack' case's premise: the flipped byte changes the target's W16 (so its dequantize and linear
    can fail), not only bytes that decode alike."""
    c = checkpoints.load_checkpoint(FIXTURE).experts[TARGET_STACK]
    weight = getattr(c, TARGET_STEM)
    blocks, scales = weight.blocks[TARGET_EXPERT], weight.scales[TARGET_EXPERT]
    codes, packed_scales, tile_scale = mx.qpnmx_prepack(blocks, scales)
    flipped = codes.copy()
    flipped.reshape(-1)[0] ^= 0x77
    n, k = blocks.shape[0], 32 * blocks.shape[1]
    good = mx.qpnmx_dequantize(codes, packed_scales, tile_scale, n, k).astype(np.float32)
    bad = mx.qpnmx_dequantize(flipped, packed_scales, tile_scale, n, k).astype(np.float32)
    assert np.count_nonzero(good != bad) == 2  # the byte's two weights, both changed in value


@pytest.mark.parametrize("experts, chosen", [
    (1, [0]), (8, list(range(8))), (9, [0, 1, 2, 3, 5, 6, 7, 8]), (32, [0, 4, 9, 13, 18, 22, 27, 31]),
    (128, [0, 18, 36, 54, 73, 91, 109, 127]),
])
def test_linear_experts_are_all_or_spread_from_first_to_last(experts, chosen):
    assert mxfp4_checks.linear_experts(experts) == chosen


def test_expert_problems_name_the_first_failing_experts_of_each_check_and_count_the_rest():
    per_expert = [["cpu: a", "linear: b"], [], ["cpu: c"], ["cpu: d"], ["cpu: e", "cpu: f"], ["cpu: g"]]
    assert mxfp4_checks.expert_problems(per_expert) == [
        "cpu: expert 0: a", "linear: expert 0: b", "cpu: expert 2: c", "cpu: expert 3: d",
        "cpu: fails for 2 more experts too: 4, 5"]
    assert mxfp4_checks.expert_problems([[], ["ref: x"], ["ref: y"], [], ["ref: z"], ["ref: w"]])[-1] == \
        "ref: fails for 1 more expert too: 5"
