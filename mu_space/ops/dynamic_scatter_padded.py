"""`dynamic_scatter_padded`: `dynamic_scatter` with upper-bound-size outputs (N rows, one per
input row) and the voxel count as a device tensor: no host synchronisation, so it can be captured
in a CUDA graph (the form issue 10 asks for beside every data-dependent size; `dynamic_scatter`
itself reads the voxel count back). Also traceable by torch.compile without a dynamic size.

It is made of two ops: `voxel_group_padded` (below: the sort grouping's kernels, whose only host
read, the voxel count, is left on the device) and `segment_reduce` (dynamic_scatter.py), whose
kernels take the padded grouping as it is (voxels beyond M hold no rows). Rules and kernels:
docs/operators/dynamic_scatter.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mu_space.ops import _opdef
from mu_space.ops import dynamic_scatter as ds

# Composed of kernels verified on the H200 (voxel_group_keys, the platform's sort,
# voxel_group_from_sorted, segment_reduce_forward / _backward), used here with padded groupings
# (voxels beyond M with no rows). Its GPU tests, memcheck and racecheck passed on the H200
# (2026-12-05); the contract tests there found two outputs aliasing one buffer and a reference
# pad that torch 2.11 could not compile. Both fixed in Python; the contract tests then passed on
# an H100 (2026-12-05, session 19: 161 passed, 4 skipped).
UNVERIFIED = ""

_PAD_ENTRY_POINTS = ("voxel_group_keys", "voxel_group_from_sorted", "voxel_group_workspace_ints")


class PaddedGroups(NamedTuple):
    """`voxel_group_padded`'s outputs: `voxel_group`'s in N rows each, and voxel_num.

    voxel_coors [N, ndim]: rows [0, M) the sorted voxels, then -1 rows
    order [N] int32: positions [0, K) the kept rows grouped by voxel (input order), then -1
    starts, counts [N] int32: voxel v holds order[starts[v]:][:counts[v]]; 0 and 0 beyond M
    point2voxel [N] int32: the voxel of each row, -1 for a dropped row
    voxel_num: 0-d int64, M (-1: the coordinates' key range exceeds the kernels' int32 keys,
        prod(column max + 1) >= 2^31 - 1: no voxels then; `dynamic_scatter` takes such rows)
    """

    voxel_coors: torch.Tensor
    order: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    point2voxel: torch.Tensor
    voxel_num: torch.Tensor


def _group_check(coors) -> _opdef.Checked:
    ndim = ds._check_coors(coors)
    n = coors.shape[0]
    i32 = torch.int32
    outputs = (((n, ndim), coors.dtype), *(((n,), i32),) * 4, ((), torch.int64))
    return _opdef.Checked(coors.device, coors.dtype, outputs, (n, ndim), "coors")


def _pad(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    """t followed by rows - len(t) rows of `value`. A concatenation, not a slice assignment:
    under torch.compile len(t) is data-dependent, and torch 2.11's fullgraph trace could not
    guard the assignment's shapes (H200, 2026-12-05); the concatenation's size is `rows`."""
    torch._check(t.shape[0] <= rows)
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


def voxel_group_padded_reference(coors) -> PaddedGroups:
    """`voxel_group`'s reference grouping, padded to N rows (no int32 key limit here)."""
    ds._check_coors(coors)
    n = coors.shape[0]
    g = ds.voxel_group_reference(coors)
    m = g.starts.shape[0]
    return PaddedGroups(
        _pad(g.voxel_coors, n, -1), _pad(g.order, n, -1), _pad(g.starts, n, 0),
        _pad(g.counts, n, 0), g.point2voxel, torch.tensor(m, dtype=torch.int64, device=coors.device),
    )  # fmt: skip


def _group_precondition(coors) -> str | None:
    valid = coors[(coors >= 0).all(1)].long()
    if valid.numel() == 0:
        return None
    key_range = 1
    for d in valid.max(0).values.tolist():
        key_range *= d + 1
    if key_range >= 2**31 - 1:
        return "the key range prod(column max + 1) >= 2^31 - 1: the native path gives voxel_num -1"
    return None


def _group_native(c, coors) -> PaddedGroups:
    """The sort grouping (voxel_group_keys, the platform's stable sort, voxel_group_from_sorted)
    into padded outputs; voxel_num from its header, on the device."""
    n, ndim = c.info
    if n == 0:
        return voxel_group_padded_reference(coors)
    coors = coors.contiguous()
    dev = coors.device
    # what the kernels leave unwritten is the padding: voxel_coors rows and order positions
    # beyond M / K (-1), starts and counts beyond M (0); point2voxel is written for every row
    voxel_coors = torch.full((n, ndim), -1, dtype=coors.dtype, device=dev)
    order = torch.full((n,), -1, dtype=torch.int32, device=dev)
    # two allocations: views of one buffer would alias (custom ops may not return aliases)
    starts = torch.zeros((n,), dtype=torch.int32, device=dev)
    counts = torch.zeros((n,), dtype=torch.int32, device=dev)
    p2v = _opdef.new_output(coors, (n,), torch.int32)
    header = ds.launch_sort_grouping(coors, (voxel_coors, order, starts, counts, p2v))
    # on an overflow the kernels keep every row out (all keys the sentinel): M = 0
    voxel_num = torch.where(header[2] != 0, -1, header[0])
    return PaddedGroups(voxel_coors, order, starts, counts, p2v, voxel_num)


def _group_samples(device) -> list[_opdef.Sample]:
    return [_opdef.Sample(s.label, s.args) for s in ds._group_samples(device)]


GROUP = _opdef.define(
    _opdef.OpDef(
        name="voxel_group_padded",
        family="voxel",
        schema="(Tensor coors) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        check=_group_check,
        reference=voxel_group_padded_reference,
        native=_group_native,
        supports=ds.group_supports,
        precondition=_group_precondition,
        result=PaddedGroups,
        native_dtypes=(torch.int32, torch.int64),
        entry_points=_PAD_ENTRY_POINTS,
        samples=_group_samples,
        public=False,
        unverified=UNVERIFIED,
    )
)


@GROUP.export
def voxel_group_padded(coors: torch.Tensor, *, backend: str = "auto") -> PaddedGroups:
    """`voxel_group` in upper-bound sizes with the voxel count on the device (no host
    synchronisation: CUDA-graph capturable). For coors Tensor[N, ndim] int32 / int64:

        voxel_coors [N, ndim]  rows [0, M): the distinct rows without a negative entry, sorted
                               lexicographically; then -1 rows
        order [N] int32        positions [0, K): the kept rows grouped by voxel, input order
                               inside each; then -1
        starts, counts [N]     voxel v holds order[starts[v]:][:counts[v]]; 0 and 0 beyond M
        point2voxel [N] int32  the voxel of each row, -1 for a dropped row
        voxel_num              0-d int64 M (-1 when prod(column max + 1) >= 2^31 - 1)

    No gradient."""
    return GROUP(coors, backend=backend)


# --------------------------------------------------------------------------- dynamic_scatter_padded


def _check(feats, coors, reduce_type) -> _opdef.Checked:
    c = ds._check(feats, coors, reduce_type)
    n, C, ndim = c.info
    outputs = (((n, C), feats.dtype), ((n, ndim), coors.dtype), ((), torch.int64))
    return _opdef.Checked(c.device, c.dtype, outputs, c.info, "feats")


def _padded(out, voxel_coors, voxel_num, n: int):
    """voxel_feats with the rows beyond voxel_num zeroed (no host read of the count)."""
    beyond = torch.arange(n, device=out.device) >= voxel_num
    return out.masked_fill(beyond[:, None], 0), voxel_coors, voxel_num


def dynamic_scatter_padded_reference(feats, coors, reduce_type):
    """`dynamic_scatter`'s reference, padded to N rows (zeros, -1 coordinates)."""
    _check(feats, coors, reduce_type)
    n = feats.shape[0]
    out, voxel_coors = ds.dynamic_scatter_reference(feats, coors, reduce_type)
    m = out.shape[0]
    num = torch.tensor(m, dtype=torch.int64, device=feats.device)
    return _pad(out, n, 0), _pad(voxel_coors, n, -1), num


def _precondition(feats, coors, reduce_type) -> str | None:
    return _group_precondition(coors)


def _forward_native(c, feats, coors, reduce_type, *, backend):
    g = voxel_group_padded(coors, backend=backend)
    out = ds.segment_reduce(
        feats, g.order, g.starts, g.counts, g.point2voxel, reduce_type, backend=backend
    )
    return _padded(out, g.voxel_coors, g.voxel_num, feats.shape[0])


def _samples(device) -> list[_opdef.Sample]:
    return [_opdef.Sample(s.label, s.args, s.kwargs, s.grad) for s in ds._samples(device)]


OP = _opdef.define(
    _opdef.OpDef(
        name="dynamic_scatter_padded",
        family="voxel",
        schema="(Tensor feats, Tensor coors, str reduce_type) -> (Tensor, Tensor, Tensor)",
        check=_check,
        reference=dynamic_scatter_padded_reference,
        native=_forward_native,
        composite=True,
        # differentiable w.r.t. feats through segment_reduce's autograd (as dynamic_scatter)
        grad_inputs=(),
        supports=ds._supports,
        precondition=_precondition,
        native_dtypes=ds.NATIVE_FEAT_DTYPES,
        entry_points=_PAD_ENTRY_POINTS + ds.REDUCE_ENTRY_POINTS,
        samples=_samples,
        upstream="mmcv `dynamic_scatter` (fixed-size outputs + voxel count)",
        models="DynamicVFE encoders under CUDA graphs or torch.compile",
        doc="docs/operators/dynamic_scatter.md",
        unverified=UNVERIFIED,
    )
)


@OP.export
def dynamic_scatter_padded(
    feats: torch.Tensor, coors: torch.Tensor, reduce_type: str = "max", *, backend: str = "auto"
):
    """`dynamic_scatter` with upper-bound-size outputs (CUDA-graph capturable):

        voxel_feats, voxel_coors, voxel_num = dynamic_scatter_padded(feats, coors, reduce_type)

    voxel_feats[:voxel_num] and voxel_coors[:voxel_num] equal `dynamic_scatter(feats, coors,
    reduce_type)` (the same kernels and bits); rows beyond voxel_num are padding: voxel_feats 0,
    voxel_coors -1 (so `pillar_scatter` drops them).

    Args: as `dynamic_scatter`.

    Returns (voxel_feats [N, C] in feats' dtype, voxel_coors [N, ndim] in coors' dtype,
    voxel_num: 0-d int64 tensor on feats' device). No host synchronisation. Differentiable
    w.r.t. feats. voxel_num is -1 (and every row padding) when the coordinates' key range
    prod(column max + 1) reaches 2^31 - 1, which `dynamic_scatter` handles (its reference
    grouping); real voxel grids are far below it.
    """
    return OP(feats, coors, reduce_type, backend=backend)
