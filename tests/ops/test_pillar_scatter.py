"""pillar_scatter (mmdet3d PointPillarsScatter): the reference against the loop of
`_voxel_oracle.pillars` on pillars of generated clouds (exact: a copy), gradients, duplicates
and rows outside the canvas; the PointPillars recipe on the CPU; native (GPU) tests compare
the kernels with the reference (exact).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mu_space
from mu_space.ops import _opdef, _voxel
from mu_space.testing import lidar
from tests.helpers import graph_capture_device, native_gpu_device
from tests.ops import _voxel_oracle as oracle

ROOT = Path(__file__).resolve().parents[2]


def _pillars(config="tiny-pillars", clouds=2, channels=16, dtype=torch.float32):
    vs, pcr, P, V = lidar.layer_args(config)
    grid = _voxel.voxel_grid(vs, pcr)
    pts = lidar.batch(lidar.VOXEL_CONFIGS[config].cloud, clouds)
    voxels, coors, num = mu_space.voxelization_batch(pts, vs, pcr, P, V)
    feats = torch.randn(coors.shape[0], channels, generator=torch.Generator().manual_seed(4))
    gx, gy, _ = grid.cells
    return feats.to(dtype), coors, clouds, (gy, gx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_reference_matches_point_pillars_scatter(dtype):
    feats, coors, B, (ny, nx) = _pillars(dtype=dtype)
    got = mu_space.pillar_scatter(feats, coors, B, (ny, nx))
    want, winner = oracle.pillars(feats, coors, B, ny, nx)
    assert got.shape == (B, feats.shape[1], ny, nx) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got.double(), want)
    assert len(winner) == coors.shape[0]  # voxelization gives unique pillars
    assert (got != 0).any(dim=1).sum() == coors.shape[0]


def test_duplicates_last_wins_and_rows_outside_drop():
    feats, coors, B, (ny, nx) = _pillars()
    coors = coors.clone()
    coors[1::5] = coors[::5][: coors[1::5].shape[0]]
    coors[2::9, 2] = ny  # outside
    coors[3::11, 0] = B  # another batch: outside
    coors[4::13, 3] = -1
    got = mu_space.pillar_scatter(feats, coors, B, (ny, nx))
    want, winner = oracle.pillars(feats, coors, B, ny, nx)
    assert torch.equal(got.double(), want)
    f = feats.clone().requires_grad_(True)
    out = mu_space.pillar_scatter(f, coors, B, (ny, nx))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(g)
    want_g = torch.zeros_like(feats)
    for (b, y, x), i in winner.items():
        want_g[i] = g[b, :, y, x]
    assert torch.equal(f.grad, want_g)  # only the winner of a cell gets its gradient


def test_gradcheck_float64():
    feats, coors, B, shape = _pillars(channels=3, clouds=1)
    feats = feats[:40].double().requires_grad_(True)
    coors = coors[:40]
    assert torch.autograd.gradcheck(lambda x: mu_space.pillar_scatter(x, coors, B, shape), (feats,))


def test_padded_voxelization_rows_are_dropped():
    vs, pcr, P, _ = lidar.layer_args("tiny-pillars")
    pts = lidar.make("tiny")
    voxels, coors, num, m = mu_space.voxelization_padded(pts, vs, pcr, P, 900)
    coors4 = torch.nn.functional.pad(coors, (1, 0), value=0)
    coors4[int(m) :, 0] = -1
    feats = voxels.sum(1)
    gx, gy, _ = _voxel.grid_size(vs, pcr)
    a = mu_space.pillar_scatter(feats, coors4, 1, (gy, gx))
    b = mu_space.pillar_scatter(feats[: int(m)], coors4[: int(m)], 1, (gy, gx))
    assert torch.equal(a, b)


def test_argument_errors_name_the_argument():
    feats, coors, B, shape = _pillars()
    with pytest.raises(ValueError, match=r"coors must be \[M, 4\]"):
        mu_space.pillar_scatter(feats, coors[:, 1:], B, shape)
    with pytest.raises(TypeError, match="coors must be int32 or int64"):
        mu_space.pillar_scatter(feats, coors.float(), B, shape)
    with pytest.raises(ValueError, match="output_shape must be 2 integers"):
        mu_space.pillar_scatter(feats, coors, B, (1, 2, 3))
    with pytest.raises(ValueError, match="batch_size must be in"):
        mu_space.pillar_scatter(feats, coors, -1, shape)
    with pytest.raises(ValueError, match="exceed the int32 range"):
        mu_space.pillar_scatter(feats, coors, 4, (2**16, 2**16))


def _recipe(name):
    path = ROOT / "model_examples" / name / "scripts" / f"{name.lower()}_hot_path.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{name.lower()}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_point_pillars_recipe_runs_on_the_cpu(capsys):
    assert (
        _recipe("PointPillars").main(["--device", "cpu", "--small", "--warmup", "0", "--reps", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "PASS" in out and "speedup A over B" in out and "MISMATCH" not in out


# ---------------------------------------------------------------- native (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config,B", [("pointpillars-kitti", 2), ("pointpillars-nus", 1), ("tiny-pillars", 3)]
)
@pytest.mark.parametrize("channels", [64, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_matches_reference(config, B, channels, dtype):
    device = native_gpu_device()
    feats, coors, B, shape = _pillars(config, B, channels, dtype)
    want = mu_space.pillar_scatter(feats, coors, B, shape, backend="reference")
    f = feats.to(device, copy=True).requires_grad_(True)
    got = mu_space.pillar_scatter(f, coors.to(device), B, shape, backend="native")
    assert torch.equal(got.cpu(), want)
    g = torch.randn(got.shape).to(dtype)
    got.backward(g.to(device))
    fr = feats.clone().requires_grad_(True)
    mu_space.pillar_scatter(fr, coors, B, shape, backend="reference").backward(g)
    assert torch.equal(f.grad.cpu(), fr.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("config,B", [("pointpillars-kitti", 1), ("tiny-pillars", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_duplicates_and_rows_outside(config, B, dtype):
    """The native forward gives the reference's bits (outputs poisoned first) with duplicate
    cells (the highest row wins), rows outside the canvas or of another batch."""
    device = native_gpu_device()
    feats, coors, B, (ny, nx) = _pillars(config, B, 64, dtype)
    dup = coors.clone()
    dup[1::5] = dup[::5][: dup[1::5].shape[0]]
    dup[2::9, 2] = ny
    dup[3::11, 0] = B
    dup[4::13, 3] = -1
    for c in (coors, dup, dup.flip(0)):
        want = mu_space.pillar_scatter(feats, c, B, (ny, nx), backend="reference")
        with _opdef.poisoned_outputs():
            got = mu_space.pillar_scatter(
                feats.to(device), c.to(device), B, (ny, nx), backend="native"
            )
        assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_native_forward_is_cuda_graph_capturable():
    """Captured once, replayed with new features and coordinates in the captured buffers: the
    reference's canvas each replay."""
    device = graph_capture_device()
    feats, coors, B, shape = _pillars("tiny-pillars", 2, 16)
    f, c = feats.to(device), coors.to(device)
    mu_space.pillar_scatter(f, c, B, shape, backend="native")  # warm-up outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mu_space.pillar_scatter(f, c, B, shape, backend="native")
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        new_f = torch.randn(feats.shape, generator=gen)
        new_c = coors[torch.randperm(coors.shape[0], generator=gen)]
        f.copy_(new_f.to(device))
        c.copy_(new_c.to(device))
        graph.replay()
        torch.cuda.synchronize(device)
        want = mu_space.pillar_scatter(new_f, new_c, B, shape, backend="reference")
        assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("ny, nx", [(49, 51), (50, 49), (50, 50), (48, 50)])
@pytest.mark.parametrize("offset", [0, 1, 8])
@pytest.mark.parametrize(
    "channels, feats_offset", [(5, 0), (12, 0), (16, 0), (16, 1), (16, 4), (19, 0)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_canvas_vectors_and_fallback(ny, nx, offset, channels, feats_offset, dtype):
    """canvas_kernel's paths on the entry point: 16-byte vectors of K = 16 / element-size cells
    when the plane is a multiple of K and the canvas 16-byte aligned (float32: 50 x 50 and
    48 x 50 at offsets 0 and 8; 16-bit: 48 x 50 at offsets 0 and 8), else one cell per thread
    (odd planes, a plane of 2 mod 4, offset 1). 19 channels: two full 8-channel chunks and a
    partial one. Each pillar's chunk (8 float32 / 4 16-bit channels) is read with vector loads
    when C is a multiple of the chunk and the features aligned to it: 16 channels at offset 0
    (both), 12 channels (16-bit only), offset 4 elements (16-bit: 8 bytes, aligned; float32:
    16 bytes, not); offset 1: one load per channel. Pillars
    beyond a smaller canvas fall outside. The canvas starts poisoned (NaN): every element must
    be written, nothing before it."""
    from mu_space.runtime import native
    from mu_space.runtime.device import stream_handle

    device = native_gpu_device()
    feats, coors, B, _ = _pillars("tiny-pillars", 2, channels, dtype)
    want = mu_space.pillar_scatter(feats, coors, B, (ny, nx), backend="reference")
    C = feats.shape[1]
    f_buf = torch.full((feats.numel() + feats_offset,), float("nan"), dtype=dtype, device=device)
    f = f_buf[feats_offset:].view_as(feats).copy_(feats)
    c = coors.to(device)
    buf = torch.full((B * C * ny * nx + offset,), float("nan"), dtype=dtype, device=device)
    canvas = buf[offset:].view(B, C, ny, nx)
    cell_map = torch.empty(B * ny * nx, dtype=torch.int32, device=device)
    native.function("pillar_scatter_forward")(f, c, cell_map, 0, canvas, stream_handle(f))
    assert torch.equal(canvas.cpu(), want)
    assert torch.isnan(buf[:offset]).all()  # nothing before the canvas


@pytest.mark.gpu
@pytest.mark.parametrize(
    "env",
    [
        {"MUSPACE_PILLAR_VECTOR_ROWS": "0"},
        {"MUSPACE_PILLAR_CHANNEL_CHUNK": "4"},
        {"MUSPACE_PILLAR_CHANNEL_CHUNK": "18"},  # rounded down to 16
        {"MUSPACE_PILLAR_CHANNEL_CHUNK": "64", "MUSPACE_PILLAR_KEEP_MAP": "0"},
    ],
)
def test_native_canvas_knobs_keep_results(env):
    """The profiling / tuning knobs read once per process (MUSPACE_PILLAR_VECTOR_ROWS=0: one
    feature load per channel; MUSPACE_PILLAR_CHANNEL_CHUNK: channels per canvas thread;
    MUSPACE_PILLAR_KEEP_MAP=0: a fresh map each call) run in a child process: the KITTI canvas
    at C = 64 and a tiny one at C = 20 in both dtypes, bit-exact against the reference."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    device = native_gpu_device()
    code = (
        "import sys, torch, mu_space\n"
        "from tests.ops.test_pillar_scatter import _pillars\n"
        "for dt in (torch.float32, torch.float16):\n"
        "    for cfg, C in (('pointpillars-kitti', 64), ('tiny-pillars', 20)):\n"
        "        f, c, B, shape = _pillars(cfg, 1, C, dt)\n"
        "        want = mu_space.pillar_scatter(f, c, B, shape, backend='reference')\n"
        f"        got = mu_space.pillar_scatter(f.to('{device}'), c.to('{device}'), B, shape,"
        " backend='native')\n"
        "        if not torch.equal(got.cpu(), want): sys.exit(1)\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, **env), cwd=root, check=True, timeout=300
    )


@pytest.mark.gpu
@pytest.mark.parametrize("ny, nx, C", [(46341, 46339, 3), (46340, 46340, 2)])
def test_native_canvas_beyond_int32_elements(ny, nx, C):
    """Planes of ~INT32_MAX cells (the cell map's limit) and B * C * ny * nx > 2**32 canvas
    elements: the 64-bit store offsets (b * C * plane + c * plane + yx) of one cell per thread
    (odd plane) and of the 16-byte vectors (46340^2, a multiple of 8 cells). float16 canvas
    poisoned with NaN (13 / 8.6 GB)
    plus an 8.6 GB cell map; pillars at both ends of the plane and in between."""
    from mu_space.runtime import native
    from mu_space.runtime.device import stream_handle

    device = native_gpu_device(too_large_to_emulate=True)
    plane = ny * nx
    cells = torch.tensor([0, 1, nx, plane // 2, plane - 270337, plane - 2, plane - 1])
    zeros = torch.zeros_like(cells)
    coors = torch.stack([zeros, zeros, cells // nx, cells % nx], dim=1).to(device)
    feats = torch.arange(1, cells.numel() * C + 1, dtype=torch.float16).view(-1, C).to(device)
    canvas = torch.full((1, C, ny, nx), float("nan"), dtype=torch.float16, device=device)
    cell_map = torch.empty(plane, dtype=torch.int32, device=device)
    native.function("pillar_scatter_forward")(
        feats, coors, cell_map, 0, canvas, stream_handle(feats)
    )
    flat = canvas.view(C, plane)
    assert torch.equal(flat[:, cells.to(device)], feats.t())
    # the rest written 0; counted in pieces: count_nonzero of the whole 13-GB canvas allocates
    # 48 GiB (out of memory beside other pytest workers on an 80-GB H100, 2026-12-05)
    nonzero = sum(int(torch.count_nonzero(p)) for p in flat.view(-1).split(1 << 28))
    assert nonzero == cells.numel() * C
    del canvas, cell_map, flat
    torch.cuda.empty_cache()


def test_point_pillars_recipe_detects_a_wrong_backend(monkeypatch, capsys):
    original = mu_space.pillar_scatter

    def off(*args, backend="auto", **kwargs):
        out = original(*args, backend="reference", **kwargs)
        return out * (1.0 + 1e-3) if backend == "auto" else out

    monkeypatch.setattr(mu_space, "pillar_scatter", off)
    args = ["--device", "cpu", "--small", "--warmup", "0", "--reps", "1", "--backend-a", "auto"]
    assert _recipe("PointPillars").main(args) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_benchmark_smoke_run(tmp_path, capsys):
    """benchmarks/bench_pillar_scatter.py end to end on tiny inputs (CPU: reference path)."""
    from benchmarks import bench_pillar_scatter

    args = ["--smoke", "--out", str(tmp_path), "--cases", "float32"]
    assert bench_pillar_scatter.main(args) == 0, capsys.readouterr().out
    assert (tmp_path / "pillar_scatter.smoke.json").is_file()


def _model_pillars(B, m, C, ny, nx, dtype, *, seed, lowest_batch):
    """Random pillars for the kernel models: batch ids from lowest_batch to B (B, and -1 when
    lowest_batch is -1: outside), y / x from -1 to the size (outside at both ends), the rows
    m/4 .. m/2 repeating the first ones (duplicates: the later row wins); (feats, coors, the
    features' raw words as numpy uint16 / uint32)."""
    g = torch.Generator().manual_seed(seed)
    coors = torch.stack(
        [
            torch.randint(lowest_batch, B + 1, (m,), generator=g),
            torch.zeros(m, dtype=torch.int64),
            torch.randint(-1, ny + 1, (m,), generator=g),
            torch.randint(-1, nx + 1, (m,), generator=g),
        ],
        dim=1,
    )
    q = m // 4
    coors[q : 2 * q] = coors[:q]
    feats = torch.randn(m, C, generator=g).to(dtype)
    bits = feats.view(torch.int16 if dtype == torch.float16 else torch.int32).numpy()
    return feats, coors, bits.view(np.uint16 if dtype == torch.float16 else np.uint32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "ny, nx, base, C",
    [
        (4, 5, 0, 3),  # plane 20: 4-cell vectors (float32; across x rows), float16 one cell
        (6, 8, 0, 11),  # plane 48: vectors for both; 11 channels = a full and a partial chunk
        (3, 5, 0, 3),  # odd plane: a vector would straddle two planes
        (6, 8, 1, 3),  # canvas base not 16-byte aligned
        (6, 8, 4, 11),  # base 16 bytes past aligned in float32, 8 bytes in float16
    ],
)
def test_kernel_model_canvas_vectors_equal_the_oracle(dtype, ny, nx, base, C):
    """canvas_vector_kernel (16-byte stores of K cells, channel chunks) and its one-cell
    fallback on B * C planes with duplicate cells (last wins) and rows outside: the oracle's
    canvas, every element stored exactly once, every vector store aligned and inside one plane,
    for grid strides below and above the group / chunk / sample counts."""
    from tests.ops import _voxel_model as model

    k_vec = 16 // torch.empty((), dtype=dtype).element_size()
    want_k = k_vec if (ny * nx) % k_vec == 0 and base % k_vec == 0 else 1
    B = 2
    feats, coors, bits = _model_pillars(B, 40, C, ny, nx, dtype, seed=11, lowest_batch=0)
    want, _ = oracle.pillars(feats, coors, B, ny, nx)
    for threads, grid_y, grid_z in ((1, 1, 1), (7, 2, 1), (64, 1, 2), (10**4, 65535, 65535)):
        got, writes, k = model.pillar_canvas(
            bits, coors.numpy(), B, ny, nx, threads=threads, base_elems=base, grid_y=grid_y,
            grid_z=grid_z,
        )  # fmt: skip
        assert k == want_k
        assert (writes == 1).all(), f"threads={threads}: stores per element {np.unique(writes)}"
        signed = np.int16 if dtype == torch.float16 else np.int32
        canvas = torch.from_numpy(got.view(signed).copy()).view(dtype)
        assert torch.equal(canvas.double(), want), f"threads={threads}"


# ---------------------------------------------------------------- the tiled forward


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("vector_rows", [True, False])
@pytest.mark.parametrize(
    "ny, nx, sms, threads, grid",
    [
        (8, 16, 2, 32, 2),  # two tiles per plane, a block per tile
        (6, 8, 1, 7, 1),  # one block walks every tile of both samples; 7 threads (partial rows)
        (40, 40, 3, 64, 2),  # 1600 cells: partial last tile, more tiles than blocks
        (4, 4, 4, 256, 4),  # a plane smaller than the granule: one short tile
    ],
)
def test_kernel_model_tiled_canvas_equals_the_oracle(
    dtype, vector_rows, ny, nx, sms, threads, grid
):
    """canvas_tile_kernel (a tile's shared map from a pass over every pillar, then its planes'
    16-byte stores) under the launcher's tile plan: the oracle's canvas (duplicates: the later
    row wins; rows of another sample, outside the plane, negative), every element stored once,
    whatever order the shared-memory atomics run in."""
    from tests.ops import _voxel_model as model

    K = 16 // torch.empty((), dtype=dtype).element_size()
    B, m, C = 2, 90, 8
    feats, coors, bits = _model_pillars(B, m, C, ny, nx, dtype, seed=12, lowest_batch=-1)
    want, _ = oracle.pillars(feats, coors, B, ny, nx)
    tile, per_image = model.pillar_tile_plan(m, B, ny * nx, K, sms)
    assert tile > 0 and tile % (32 * K) == 0
    signed = np.int16 if dtype == torch.float16 else np.int32
    for order in (None, "random"):
        got, writes = model.pillar_canvas_tiled(
            bits, coors.numpy(), B, ny, nx, tile_cells=tile, tiles_per_image=per_image,
            grid=grid, threads=threads, vector_rows=vector_rows, order=order,
        )  # fmt: skip
        assert (writes == 1).all(), np.unique(writes)
        canvas = torch.from_numpy(got.view(signed).copy()).view(dtype)
        assert torch.equal(canvas.double(), want)


def test_kernel_model_tile_plan():
    """The launcher's plan: about one tile per multiprocessor in whole warps of K-cell groups,
    at most 4096 cells; none for a plane not a multiple of K or too many pillar visits."""
    from tests.ops import _voxel_model as model

    assert model.pillar_tile_plan(10351, 1, 496 * 432, 4, 132) == (1664, 129)  # KITTI float32
    assert model.pillar_tile_plan(10351, 1, 496 * 432, 8, 132) == (1792, 120)  # KITTI 16-bit
    assert model.pillar_tile_plan(21723, 1, 400 * 400, 4, 132) == (1280, 125)  # nuScenes
    assert model.pillar_tile_plan(100, 1, 50 * 49, 4, 132) == (0, 0)  # 2450 % 4 != 0
    assert model.pillar_tile_plan(200_000, 8, 400 * 400, 4, 132) == (0, 0)  # 313 tiles x 200k
    cells, per = model.pillar_tile_plan(40_000, 4, 496 * 432, 8, 132)
    assert cells == 4096 and per * 4 * 40_001 <= model.PILLAR_MAX_VISITS


def _tiled(feats, coors, canvas):
    from mu_space.runtime import native
    from mu_space.runtime.device import stream_handle

    fn = native.function("pillar_scatter_forward_tiled")
    return fn(feats, coors, canvas, stream_handle(feats))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config,B", [("pointpillars-kitti", 1), ("pointpillars-nus", 1), ("tiny-pillars", 3)]
)
@pytest.mark.parametrize("channels", [64, 16, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_tiled_forward_equals_the_map_path(config, B, channels, dtype):
    """pillar_scatter_forward_tiled writes the map path's canvas bit for bit (canvas poisoned
    first) with duplicates, rows outside the canvas, of another sample or negative; 4-channel
    vector rows (C = 64 / 16) and one load per channel (C = 6); int32 and int64 coordinates."""
    device = native_gpu_device()
    feats, coors, B, (ny, nx) = _pillars(config, B, channels, dtype)
    if config == "tiny-pillars":  # 50 x 50 is not a multiple of 8 cells: a smaller canvas
        ny, nx = 48, 50  # (pillars beyond it fall outside)
    dup = coors.clone()
    dup[1::5] = dup[::5][: dup[1::5].shape[0]]
    dup[2::9, 2] = ny
    dup[3::11, 0] = B
    dup[4::13, 3] = -1
    f = feats.to(device)
    for c in (dup, coors.long()):
        want = mu_space.pillar_scatter(feats, c, B, (ny, nx), backend="reference")
        canvas = torch.full((B, channels, ny, nx), float("nan"), dtype=dtype, device=device)
        assert _tiled(f, c.to(device), canvas) is True
        assert torch.equal(canvas.cpu(), want)


@pytest.mark.gpu
def test_native_tiled_forward_hands_back_and_the_op_takes_it(monkeypatch):
    """The tiled entry point returns False without writing where its plan does not apply (a
    plane not a multiple of K, a canvas not 16-byte aligned, too many pillar visits); the op
    takes it with MUSPACE_PILLAR_TILED=1 (TILED) and its result is the reference's; without it
    the op keeps the map path."""
    from tests.helpers import recording_entry_points

    ps = sys.modules["mu_space.ops.pillar_scatter"]
    device = native_gpu_device()
    feats, coors, B, (ny, nx) = _pillars("tiny-pillars", 2, 16)
    f, c = feats.to(device), coors.to(device)
    odd = torch.full((B, 16, 49, 51), float("nan"), device=device)
    assert _tiled(f, c, odd) is False and odd.isnan().all()
    buf = torch.full((B * 16 * ny * nx + 1,), float("nan"), device=device)
    unaligned = buf[1:].view(B, 16, ny, nx)
    assert _tiled(f, c, unaligned) is False and unaligned.isnan().all()
    many = torch.zeros((2**24 // 8, 4), dtype=torch.int32, device=device)  # 2M rows, 9+ tiles
    big = torch.full((1, 2, 512, 512), float("nan"), device=device)
    assert _tiled(torch.zeros(many.shape[0], 2, device=device), many, big) is False
    monkeypatch.setattr(ps, "TILED_UNVERIFIED", "")
    monkeypatch.setattr(ps, "TILED", True)
    names = recording_entry_points(monkeypatch)
    want = mu_space.pillar_scatter(feats, coors, B, (ny, nx), backend="reference")
    with _opdef.poisoned_outputs():
        got = mu_space.pillar_scatter(f, c, B, (ny, nx), backend="native")
    launched = [n for n in names if n != "muspace_build_facts"]  # (read once per library)
    assert launched == ["pillar_scatter_forward_tiled"] and torch.equal(got.cpu(), want)
    names.clear()
    monkeypatch.setattr(ps, "TILED", False)
    with _opdef.poisoned_outputs():
        got = mu_space.pillar_scatter(f, c, B, (ny, nx), backend="native")
    assert names == ["pillar_scatter_forward"] and torch.equal(got.cpu(), want)


def _kept_map_cases():
    """Calls in a row on one stream: other clouds, batch sizes and channels, so cells of an
    earlier call are empty in a later one (a stale entry must read as empty) and the map
    grows, then serves a smaller canvas from its first cells."""
    kitti = _pillars("pointpillars-kitti", 1, 64)
    tiny2 = _pillars("tiny-pillars", 2, 16)
    tiny3 = _pillars("tiny-pillars", 3, 5, torch.float16)
    f, c, B, shape = tiny2
    half = (f[::2].contiguous(), c[::2].contiguous(), B, shape)  # half of the same cells
    return [tiny2, half, kitti, tiny3, tiny2, half]


@pytest.mark.gpu
@pytest.mark.parametrize("near_wrap", [False, True])
def test_native_kept_cell_map_across_calls(monkeypatch, near_wrap):
    """The cell map kept between calls (KEEP_MAP: one map per device and stream, a new tag each
    call, no fill): forward and backward give the reference's bits in every call of a row whose
    clouds leave cells of earlier calls empty; with near_wrap the tag passes max_map_tag (the
    map is zeroed there and the tag restarts at 1) in the middle of the row."""
    from mu_space.runtime import native

    ps = sys.modules["mu_space.ops.pillar_scatter"]
    device = native_gpu_device()
    monkeypatch.setattr(ps, "KEEP_MAP", True)
    monkeypatch.setattr(ps, "_kept_maps", {})
    limit = native.limit("pillar_scatter.max_map_tag")
    tags = []
    for step, (feats, coors, B, shape) in enumerate(_kept_map_cases()):
        if near_wrap and step == 3:
            (kept,) = ps._kept_maps.values()
            kept[1] = limit - 1  # this forward: limit; its backward: wrapped, zeroed, 1
        f = feats.to(device, copy=True).requires_grad_(True)
        c = coors.to(device)
        want = mu_space.pillar_scatter(feats, coors, B, shape, backend="reference")
        with _opdef.poisoned_outputs():
            got = mu_space.pillar_scatter(f, c, B, shape, backend="native")
        assert torch.equal(got.cpu(), want), f"forward, call {step}"
        g = torch.randn(got.shape, generator=torch.Generator().manual_seed(step)).to(feats.dtype)
        got.backward(g.to(device))
        fr = feats.clone().requires_grad_(True)
        mu_space.pillar_scatter(fr, coors, B, shape, backend="reference").backward(g)
        assert torch.equal(f.grad.cpu(), fr.grad), f"backward, call {step}"
        (kept,) = ps._kept_maps.values()
        tags.append(kept[1])
    # two tags a step (forward, backward); a new map (tags from 1) for kitti's larger canvas,
    # kept for the smaller ones after it
    assert tags == ([2, 4, 2, 1, 3, 5] if near_wrap else [2, 4, 2, 4, 6, 8])
    assert ps._kept_maps[next(iter(ps._kept_maps))][0].numel() == max(
        B * shape[0] * shape[1] for _, _, B, shape in _kept_map_cases()
    )


@pytest.mark.gpu
def test_native_cell_map_tags_and_their_errors():
    """The entry point's map_tag: 0 zeroes any map first; a tag above every entry of the map
    needs no fill; entries of an older tag read as empty cells, and a map_tag outside
    0 .. max_map_tag is a ValueError naming it (nothing launched)."""
    from mu_space.runtime import native
    from mu_space.runtime.device import stream_handle

    device = native_gpu_device()
    feats, coors, B, (ny, nx) = _pillars("tiny-pillars", 2, 16)
    f, c = feats.to(device), coors.to(device)
    want = mu_space.pillar_scatter(feats, coors, B, (ny, nx), backend="reference")
    forward = native.function("pillar_scatter_forward")
    canvas = torch.full((B, 16, ny, nx), float("nan"), device=device)
    garbage = torch.randint(-(2**31), 2**31 - 1, (B * ny * nx,), dtype=torch.int32)
    cell_map = garbage.to(device)
    forward(f, c, cell_map, 0, canvas, stream_handle(f))  # any content: zeroed first
    assert torch.equal(canvas.cpu(), want)
    limit = native.limit("pillar_scatter.max_map_tag")
    # entries of tag 1 (the call above) and below: tags 2 and limit read them as empty
    for tag in (2, limit):
        canvas.fill_(float("nan"))
        half_f, half_c = f[1::2].contiguous(), c[1::2].contiguous()
        forward(half_f, half_c, cell_map, tag, canvas, stream_handle(f))
        half = mu_space.pillar_scatter(feats[1::2], coors[1::2], B, (ny, nx), backend="reference")
        assert torch.equal(canvas.cpu(), half)
    for bad in (-1, limit + 1):
        canvas.fill_(float("nan"))
        with pytest.raises(ValueError, match="map_tag"):
            forward(f, c, cell_map, bad, canvas, stream_handle(f))
        assert canvas.isnan().all()


@pytest.mark.gpu
def test_native_fresh_cell_map_where_none_is_kept(monkeypatch):
    """A fresh map zeroed by the entry point (map_tag 0) and nothing kept: canvases beyond
    KEPT_MAP_MAX_CELLS and MUSPACE_PILLAR_KEEP_MAP=0 (KEEP_MAP); the reference's bits either way."""
    from mu_space.runtime import native

    ps = sys.modules["mu_space.ops.pillar_scatter"]
    device = native_gpu_device()
    feats, coors, B, shape = _pillars("tiny-pillars", 2, 16)
    want = mu_space.pillar_scatter(feats, coors, B, shape, backend="reference")
    monkeypatch.setattr(ps, "_kept_maps", {})
    tags, real = [], native.function

    def function(name):
        fn = real(name)
        if name != "pillar_scatter_forward":
            return fn
        return lambda *args: (tags.append(args[3]), fn(*args))[1]

    monkeypatch.setattr(native, "function", function)
    for cap, keep in ((B * shape[0] * shape[1] - 1, True), (1 << 24, False)):
        monkeypatch.setattr(ps, "KEPT_MAP_MAX_CELLS", cap)
        monkeypatch.setattr(ps, "KEEP_MAP", keep)
        with _opdef.poisoned_outputs():
            got = mu_space.pillar_scatter(feats.to(device), coors.to(device), B, shape)
        assert torch.equal(got.cpu(), want)
        assert ps._kept_maps == {}
    assert tags == [0, 0]
