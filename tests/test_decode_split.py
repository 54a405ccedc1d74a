"""The decode kernels' K split (cupy_kernels.linear.split_k): host arithmetic, checked on the CPU.

The kernels trust it: block (tile, part) runs warps w < split, warp slice s = part * split + w
holds groups [s * gpw, (s+1) * gpw) clipped to K. So every group must lie in exactly one slice,
no part may be empty (its block would store zeros over the others' sums), QPN2 slices must be
whole load batches, and the bounds the kernels were compiled for must hold.
"""

from __future__ import annotations

import itertools

import pytest

from qpn.cupy_kernels import linear as L

SMS = (1, 40, 132)  # a degenerate GPU, a T4, an H200


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("multiple", (1, 4))
def test_split_covers_every_group_once(sms, multiple):
    for tiles, groups in itertools.product((1, 2, 3, 31, 64, 128, 160, 263, 1024, 4096), range(1, 600, 7)):
        groups = -(-groups // multiple) * multiple  # QPN2: K % 64 == 0
        parts, split, gpw = L.split_k(tiles, groups, multiple, sms)
        where = f"tiles={tiles} groups={groups} multiple={multiple} sms={sms}: ({parts}, {split}, {gpw})"
        assert 1 <= parts <= L.MAX_PARTS and 1 <= split <= L.MAX_WARPS, where
        assert gpw % multiple == 0, where
        assert parts * split * gpw >= groups, where  # every group has a slice
        assert (parts - 1) * split * gpw < groups, where  # the last part holds groups
        assert gpw >= min(groups, L.MIN_GROUPS_PER_WARP) or parts == split == 1, where
        if tiles >= 2 * sms:
            assert parts == 1, where  # enough tiles for the block scheduler to balance the SMs


def test_parts_follow_the_busiest_sm():
    # 160 tiles on 132 SMs: 1 part leaves 28 SMs with 2 tiles; 4 parts: 5 quarter tiles per SM
    assert L.split_k(160, 1088, 1, 132)[0] == 4
    assert L.split_k(128, 256, 1, 132)[0] == 1  # 128 tiles already fill 132 SMs one each
    assert L.split_k(160, 1088, 1, 40)[0] == 1  # a T4: 4 tiles per SM, balanced by the scheduler


def test_every_qpn2_build_runs_whole_batches():
    """qpn2_linear's K loop has no partial batch (it would skip the slice's last groups): every
    QPN2 build's groups per batch must divide the slice multiple that split_k rounds to."""
    for (family, nb, gated), (unroll, _) in L.PIPELINE.items():
        if family == "qpn2":
            assert L.SLICE_MULTIPLE["qpn2"] % unroll == 0, (nb, gated, unroll)
