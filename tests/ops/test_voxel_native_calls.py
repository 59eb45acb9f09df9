"""The voxel ops' Python native paths against the built library, without a GPU: every entry point
call they make is handed to the real library with the tensors relabelled as cuda:0 DLPack
tensors (scripts/native_messages.py's method), so the library's argument checks run on exactly
the arguments the Python layer passes (order, dtypes, shapes, the Shape of sample offsets, the
workspace size) and stop at the first runtime call ("get current device failed"). A wrong
argument shows up as the library's TypeError / ValueError instead. Skips without a library
that has the voxel entry points.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mu_space.ops import _opdef
from mu_space.testing import lidar
from tests.native_calls import ReachedRuntime, load_library, relabelling

ENTRY_POINTS = (
    "voxel_hard_forward_hashed",
    "voxel_hashed_workspace_ints",
    "voxel_hard_keys",
    "voxel_hard_forward",
    "voxel_dynamic_forward",
    "voxel_group_bitmap",
    "voxel_group_keys",
    "voxel_group_from_sorted",
    "segment_reduce_forward",
    "segment_reduce_backward",
    "dynamic_scatter_bitmap_forward",
    "pillar_scatter_forward",
    "pillar_scatter_backward",
    "pillar_scatter_forward_tiled",
)


@pytest.fixture(scope="module")
def library():
    return load_library(ENTRY_POINTS)


@pytest.fixture
def calls(library, monkeypatch):
    """The entry points the Python layer called, each stopped at the runtime."""
    # the keys calls return so that the second entry point after the sort is checked too
    reached = relabelling(
        library, monkeypatch, continue_after=("voxel_group_keys", "voxel_hard_keys")
    )
    for mod in ("_voxel", "dynamic_scatter", "pillar_scatter"):
        monkeypatch.setattr(sys.modules[f"mu_space.ops.{mod}"], "stream_handle", lambda t: 0)
    return reached


def _native(op_name, *args, **kwargs):
    """Run an op's native implementation (the function OpDef.native names) on CPU tensors."""
    from mu_space.runtime import registry

    op = registry.get(op_name)
    schema = op.capture_schema_args(*args, **kwargs)
    c = op.d.check(*schema)
    if op.composite:
        return op.d.native(c, *schema, backend="native")
    return op.d.native(c, *schema)


@pytest.mark.parametrize("grouping", ["hashed", "sort"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_voxelization_entry_points_accept_the_python_arguments(calls, dtype, grouping, monkeypatch):
    import mu_space  # noqa: F401

    monkeypatch.setattr(sys.modules["mu_space.ops._voxel"], "GROUPING", grouping)
    vs, pcr, P, V = lidar.layer_args("tiny-voxels")
    pts = lidar.make("tiny-3sweeps").to(dtype)
    clouds = [pts, pts[:100]]
    for op, args, kwargs in (
        ("voxelization", (pts, vs, pcr, P, V, True), {}),
        ("voxelization_padded", (pts, vs, pcr, P, V), {}),
        (
            "voxelization_batch",
            (torch.cat(clouds), vs, pcr, P, V, True),
            {"sample_sizes": [len(c) for c in clouds]},
        ),
        ("dynamic_voxelize", (pts, vs, pcr), {}),
        (
            "dynamic_voxelize_batch",
            (torch.cat(clouds), vs, pcr),
            {"sample_sizes": [len(c) for c in clouds]},
        ),
    ):
        with pytest.raises(ReachedRuntime):
            _native(op, *args, **kwargs)
    hard = (
        ["voxel_hard_forward_hashed"]
        if grouping == "hashed"
        else ["voxel_hard_keys", "voxel_hard_forward"]
    )
    assert calls == hard * 3 + ["voxel_dynamic_forward"] * 2


@pytest.mark.parametrize("grouping", ["bitmap", "sort"])
@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_scatter_entry_points_accept_the_python_arguments(calls, reduce, grouping, monkeypatch):
    import mu_space

    ds = sys.modules["mu_space.ops.dynamic_scatter"]
    monkeypatch.setattr(ds, "GROUPING", grouping)
    pts, coors = ds._dynamic_coors("cpu")
    with pytest.raises(ReachedRuntime):
        _native("voxel_group", coors)
    with pytest.raises(ReachedRuntime):
        _native("voxel_group", coors.long())
    g = mu_space.ops.voxel_group(coors, backend="reference")
    pts = pts.requires_grad_(reduce == "max")  # max: the forward passes its argmax buffer too
    args = (pts, g.order, g.starts, g.counts, g.point2voxel, reduce)
    with pytest.raises(ReachedRuntime):
        _native("segment_reduce", *args)
    op = ds.REDUCE
    schema = op.capture_schema_args(*args)
    c = op.d.check(*schema)
    grad = torch.ones(g.starts.shape[0], pts.shape[1])
    with pytest.raises(ReachedRuntime):
        op.d.backward.native(c, grad, *schema, needs=(True,), deterministic=False)
    group = (
        ["voxel_group_bitmap"]
        if grouping == "bitmap"
        else ["voxel_group_keys", "voxel_group_from_sorted"]
    )
    assert calls == group * 2 + [
        "segment_reduce_forward",
        "segment_reduce_backward",
    ]


@pytest.mark.parametrize("coors_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_scatter_forward_accepts_the_python_arguments(calls, dtype, coors_dtype, monkeypatch):
    """dynamic_scatter's one-call forward (dynamic_scatter_bitmap_forward) for feats that need no
    gradient once allowed (FUSED_FORWARD_UNVERIFIED, MUSPACE_TRY_UNVERIFIED=1); the parts for
    feats that need one, for the sort grouping, with MUSPACE_DYNAMIC_SCATTER_FUSED=0 and while
    unverified without MUSPACE_TRY_UNVERIFIED."""
    ds = sys.modules["mu_space.ops.dynamic_scatter"]
    monkeypatch.setattr(ds, "FUSED_FORWARD_UNVERIFIED", "not run on a GPU yet")
    monkeypatch.setenv("MUSPACE_TRY_UNVERIFIED", "1")
    pts, coors = ds._dynamic_coors("cpu")
    pts, coors = pts.to(dtype), coors.to(coors_dtype)
    for reduce in ("max", "sum", "mean"):
        with pytest.raises(ReachedRuntime):
            _native("dynamic_scatter", pts, coors, reduce)
    assert calls == ["dynamic_scatter_bitmap_forward"] * 3
    calls.clear()
    with pytest.raises(ReachedRuntime), torch.no_grad():
        _native("dynamic_scatter", pts.requires_grad_(True), coors, "max")
    assert calls == ["dynamic_scatter_bitmap_forward"]

    class Parts(Exception):
        pass

    def parts(*args):
        raise Parts

    for case in ("grad", "sort", "off", "unverified"):
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(ds, "_scatter", parts)  # voxel_group + segment_reduce (their own tests)
            if case == "sort":
                m.setattr(ds, "GROUPING", "sort")
            if case == "off":
                m.setattr(ds, "FUSED_FORWARD", False)
            if case == "unverified":
                m.delenv("MUSPACE_TRY_UNVERIFIED")
            with pytest.raises(Parts):
                _native("dynamic_scatter", pts.detach().requires_grad_(case == "grad"), coors)
        assert calls == [], case
    monkeypatch.delenv("MUSPACE_TRY_UNVERIFIED")
    monkeypatch.setattr(ds, "FUSED_FORWARD_UNVERIFIED", "")  # verified: auto takes it
    calls.clear()
    with pytest.raises(ReachedRuntime):
        _native("dynamic_scatter", pts.detach(), coors, "mean")
    assert calls == ["dynamic_scatter_bitmap_forward"]


@pytest.mark.parametrize("coors_dtype", [torch.int32, torch.int64])
def test_padded_grouping_accepts_the_python_arguments(calls, coors_dtype):
    """voxel_group_padded (dynamic_scatter_padded's grouping): the sort grouping's two entry
    points on its padded outputs, and no other call."""
    ds = sys.modules["mu_space.ops.dynamic_scatter"]
    _, coors = ds._dynamic_coors("cpu", with_batch=coors_dtype == torch.int64)
    with pytest.raises(ReachedRuntime):
        _native("voxel_group_padded", coors.to(coors_dtype))
    assert calls == ["voxel_group_keys", "voxel_group_from_sorted"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pillar_entry_points_accept_the_python_arguments(calls, dtype):
    ps = sys.modules["mu_space.ops.pillar_scatter"]
    s = ps._samples(torch.device("cpu"))[0]
    feats, coors, B, shape = s.args
    feats = feats.to(dtype)
    with pytest.raises(ReachedRuntime):
        _native("pillar_scatter", feats, coors, B, shape)
    op = ps.OP
    schema = op.capture_schema_args(feats, coors, B, shape)
    c = op.d.check(*schema)
    grad = torch.ones(B, feats.shape[1], *shape, dtype=dtype)
    with pytest.raises(ReachedRuntime):
        op.d.backward.native(c, grad, *schema, needs=(True,), deterministic=False)
    assert calls == ["pillar_scatter_forward", "pillar_scatter_backward"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiled_pillar_forward_accepts_the_python_arguments(calls, dtype, monkeypatch):
    """Once allowed (TILED_UNVERIFIED, MUSPACE_TRY_UNVERIFIED=1) the forward calls the tiled
    entry point (no cell map) with the arguments its checks accept; MUSPACE_PILLAR_TILED=0 or an
    unverified mark without the variable keep pillar_scatter_forward."""
    ps = sys.modules["mu_space.ops.pillar_scatter"]
    monkeypatch.setattr(ps, "TILED_UNVERIFIED", "not run on a GPU yet")
    s = ps._samples(torch.device("cpu"))[0]
    feats, coors, B, shape = s.args
    for env, tiled, want in (
        ("1", True, "pillar_scatter_forward_tiled"),
        ("1", False, "pillar_scatter_forward"),
        (None, True, "pillar_scatter_forward"),
    ):
        calls.clear()
        with monkeypatch.context() as m:
            if env is None:
                m.delenv("MUSPACE_TRY_UNVERIFIED", raising=False)
            else:
                m.setenv("MUSPACE_TRY_UNVERIFIED", env)
            m.setattr(ps, "TILED", tiled)
            with pytest.raises(ReachedRuntime):
                _native("pillar_scatter", feats.to(dtype), coors, B, shape)
        assert calls == [want]


def test_new_outputs_are_what_the_kernels_fill(calls, monkeypatch):
    """The outputs the native paths allocate are new_output's (poisoned in the GPU tests)."""
    seen = []
    real = _opdef.new_output

    def spy(like, shape=None, dtype=None):
        t = real(like, shape, dtype)
        seen.append((tuple(t.shape), t.dtype))
        return t

    monkeypatch.setattr(_opdef, "new_output", spy)
    vs, pcr, P, V = lidar.layer_args("tiny-voxels")
    pts = lidar.make("tiny-3sweeps")
    with pytest.raises(ReachedRuntime):
        _native("voxelization", pts, vs, pcr, P, V, True)
    rows = min(pts.shape[0], V)
    assert seen == [
        ((rows, P, 5), torch.float32),
        ((rows, 3), torch.int32),
        ((rows,), torch.int32),
        ((2,), torch.int64),
    ]
