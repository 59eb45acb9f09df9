"""mmcv's own voxelization and dynamic-scatter kernels, timed side by side with ours (issue 10).

scripts/build_mmcv_voxel_peer.sh builds mmcv's unmodified CUDA sources (from the ignored folder
.peers/mmcv/) with a minimal binding into .peers/build/mmcv_voxel_peer.so (MUSPACE_MMCV_VOXEL_PEER
overrides the path). When it is there and a CUDA GPU is visible, the voxel benchmarks add an
`<case>-mmcv` case per case with mmcv's whole Python-level call (its new_zeros buffers, the
launcher, the slices; the backward's zeros_like), checked against our reference, and
`python -m benchmarks._voxel_peer RESULTS.json ...` prints ours / mmcv per case. Without it the
benchmarks run unchanged (the missing peer is printed once).
"""

from __future__ import annotations

import sys

import torch

from benchmarks._peer import PeerLibrary, ratio_table

PEER = PeerLibrary("mmcv_voxel_peer", "MUSPACE_MMCV_VOXEL_PEER", "scripts/build_mmcv_voxel_peer.sh")
REDUCE = {"sum": 0, "mean": 1, "max": 2}
reason = PEER.reason
has = PEER.has


def _ops():
    return PEER.ops


# ------------------------------------------------------------- mmcv's Python-level calls


def voxelization(points, voxel_size, coors_range, max_points, max_voxels, deterministic=True):
    """mmcv.ops.voxelization (hard): (voxels, coors, num_points_per_voxel)."""
    return _ops().hard_voxelize(
        points, list(map(float, voxel_size)), list(map(float, coors_range)), max_points,
        max_voxels, deterministic,
    )  # fmt: skip


def dynamic_voxelize(points, voxel_size, coors_range):
    """mmcv.ops.voxelization with max_points = -1: coors [N, 3]."""
    return _ops().dynamic_voxelize(
        points, list(map(float, voxel_size)), list(map(float, coors_range))
    )


def scatter_forward(feats, coors, reduce: str):
    """mmcv's _DynamicScatter.forward: (voxel_feats, voxel_coors, point2voxel, counts)."""
    return _ops().scatter_forward(feats, coors, REDUCE[reduce])


def scatter_backward(grad, feats, voxel_feats, point2voxel, counts, reduce: str):
    """mmcv's _DynamicScatter.backward: grad_feats."""
    return _ops().scatter_backward(grad, feats, voxel_feats, point2voxel, counts, REDUCE[reduce])


# ------------------------------------------------------------- checks of mmcv's results


def same_voxel_sets(max_voxels: int):
    """A Case.check for mmcv's non-deterministic voxelization, which orders voxels and their
    points arbitrarily: (coordinate, point count, the sorted rows of the voxel) per voxel
    compared as sets; a voxel with more than max_points points keeps an arbitrary max_points of
    them, so only its coordinate and count are compared; when max_voxels cut the voxels, which
    ones survive is arbitrary too, and only the shapes are compared."""

    def check(out, ref) -> None:
        (v, c, _), (rv, rc, _) = out, ref
        assert v.shape == rv.shape and c.shape == rc.shape, (v.shape, rv.shape)
        if c.shape[0] < max_voxels:
            _same_sets(out, ref)

    return check


def _same_sets(out, ref) -> None:
    (v, c, n), (rv, rc, rn) = out, ref

    def canon(voxels, coors, num):
        key = coors.long()
        order = torch.argsort((key[:, 0] * 2**21 + key[:, 1]) * 2**21 + key[:, 2])
        vs = voxels[order].float()
        vs = torch.sort(vs, dim=1).values  # order inside a voxel is free too
        return coors[order], num[order], vs

    a, b = canon(v.cpu(), c.cpu(), n.cpu()), canon(rv.cpu(), rc.cpu(), rn.cpu())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "voxel coordinates / counts differ"
    not_full = a[1] < v.shape[1]  # a full voxel's kept points are mmcv's arbitrary choice
    assert torch.allclose(a[2][not_full], b[2][not_full]), "voxel contents differ"


def exact(out, ref) -> None:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and torch.equal(o.cpu(), r.cpu()), "mmcv result differs"


def close(out, ref) -> None:
    from mu_space.testing import tolerances

    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    for o, r in zip(outs, refs):
        tolerances.assert_close(o, r, op="dynamic_scatter", name="mmcv")


# ------------------------------------------------------------- ratios


if __name__ == "__main__":
    print(ratio_table(sys.argv[1:]))
