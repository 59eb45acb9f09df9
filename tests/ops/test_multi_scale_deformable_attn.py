"""multi_scale_deformable_attn: reference tests always; native (GPU) tests need a GPU.

Tolerance policy (native vs a float64 reference computed from the same low-precision inputs):
- float32: the kernel rounds the pixel coordinate `loc * size - 0.5` once in float32 (up to
  0.5 ulp of size, ~4e-6 px for 64-px levels), which moves bilinear weights by as much, and sums
  up to 4 * levels * points terms in float32 (atomics in any order for grad_value). Differences
  are ~1e-6 relative to the largest element; we allow 5e-5 of max|reference| plus 1e-4 relative.
- float16: locations in float16 give exact float32 pixel coordinates, accumulation is float32,
  so the error is the final rounding to float16 (2^-11 relative): 2e-3 of max|ref| + 2e-3 rel.
- bfloat16: same with 8 mantissa bits (2^-8): 1.6e-2 of max|ref| + 1.6e-2 relative.
grad_sampling_locations jumps where a sample crosses a pixel edge, so the tests that compare it
in float32 nudge locations at least 2e-3 px away from pixel edges (msda_inputs.nudge_off_pixel_edges).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mu_space.ops.multi_scale_deformable_attn import (
    MultiScaleDeformableAttnFunction,
    multi_scale_deformable_attn,
    multi_scale_deformable_attn_reference,
    multi_scale_deformable_attn_reference_backward,
)
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle
from mu_space.testing import msda_inputs, tolerances
from mu_space.testing.msda_inputs import MSDAConfig
from tests.helpers import assert_close, native_gpu_device, poisoned, synchronize


def assert_scaled_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str):
    """Native vs reference with the tolerance table's MSDA rows (module docstring: why)."""
    tolerances.assert_close(
        got.detach().double(),
        want.detach().double(),
        tolerances.tolerance("multi_scale_deformable_attn", dtype),
        name=name,
    )


def naive_msda(value, shapes, starts, loc, attn):
    """Independent straightforward loops over every sample, corner and channel (upstream's rule)."""
    bs, _, heads, dim = value.shape
    _, queries, _, levels, points, _ = loc.shape
    out = torch.zeros(bs, queries, heads * dim, dtype=torch.float64)
    v, lc, at = value.double(), loc.double(), attn.double()
    for b in range(bs):
        for q in range(queries):
            for h in range(heads):
                for l in range(levels):
                    hl, wl = int(shapes[l, 0]), int(shapes[l, 1])
                    start = int(starts[l])
                    for p in range(points):
                        x = lc[b, q, h, l, p, 0].item() * wl - 0.5
                        y = lc[b, q, h, l, p, 1].item() * hl - 0.5
                        if not (-1 < y < hl and -1 < x < wl):
                            continue
                        y0, x0 = math.floor(y), math.floor(x)
                        ly, lx = y - y0, x - x0
                        a = at[b, q, h, l, p].item()
                        for cy, cx, wgt in (
                            (y0, x0, (1 - ly) * (1 - lx)),
                            (y0, x0 + 1, (1 - ly) * lx),
                            (y0 + 1, x0, ly * (1 - lx)),
                            (y0 + 1, x0 + 1, ly * lx),
                        ):
                            if 0 <= cy < hl and 0 <= cx < wl:
                                out[b, q, h * dim : (h + 1) * dim] += (
                                    a * wgt * v[b, start + cy * wl + cx, h]
                                )
    return out


def border_inputs(dtype=torch.float64, device="cpu", seed=0):
    """Locations exactly on, just inside and beyond every border; levels of power-of-two size so
    that loc * size - 0.5 is exact (x = -1 and x = w are excluded by the upstream rule)."""
    g = torch.Generator().manual_seed(seed)
    levels = ((8, 16), (4, 4))
    bs, queries, heads, dim, points = 2, 6, 2, 3, 5
    shapes, starts = msda_inputs.level_metadata(levels)
    num_keys = sum(h * w for h, w in levels)
    value = torch.randn(bs, num_keys, heads, dim, generator=g, dtype=torch.float64)
    loc = torch.rand(bs, queries, heads, len(levels), points, 2, generator=g, dtype=torch.float64)
    size = torch.tensor([[w, h] for h, w in levels], dtype=torch.float64).view(1, 1, 1, -1, 1, 2)
    specials = torch.tensor(
        [0.0, 1.0, -0.5, -0.25, 0.25, 1.0 - 1e-3, 1.5, -3.0, 2.0], dtype=torch.float64
    )
    # in pixel units: -1 (excluded), size (excluded), and fractions around the borders
    pix_specials = torch.tensor([-1.0, -0.999, -0.5, -0.001], dtype=torch.float64)
    flat = loc.view(-1, 2)
    n = flat.shape[0]
    pick = torch.randint(0, specials.numel(), (n, 2), generator=g)
    use = torch.rand(n, 2, generator=g) < 0.4
    flat[:] = torch.where(use, specials[pick], flat)
    # exact pixel-space borders on some samples (per level sizes)
    pix = loc * size - 0.5
    choose = torch.randint(0, pix_specials.numel(), pix.shape, generator=g)
    mask = torch.rand(pix.shape, generator=g) < 0.15
    pix = torch.where(mask, pix_specials[choose], pix)
    far = torch.rand(pix.shape, generator=g) < 0.05
    pix = torch.where(far, size.expand_as(pix), pix)  # x == w exactly (excluded)
    loc = (pix + 0.5) / size
    attn = torch.softmax(
        torch.randn(bs, queries, heads, len(levels) * points, generator=g, dtype=torch.float64), -1
    ).view(bs, queries, heads, len(levels), points)
    return tuple(
        t.to(device) for t in (value.to(dtype), shapes, starts, loc.to(dtype), attn.to(dtype))
    )


def random_levels(n_levels: int, generator: torch.Generator, max_side: int = 23):
    return tuple(
        (
            int(torch.randint(1, max_side, (1,), generator=generator)),
            int(torch.randint(1, max_side, (1,), generator=generator)),
        )
        for _ in range(n_levels)
    )


def config(levels, *, batch=2, queries=37, heads=3, head_dim=8, points=4) -> MSDAConfig:
    rows = max(1, int(math.sqrt(queries)))
    return MSDAConfig(
        "test",
        batch,
        queries,
        heads,
        head_dim,
        tuple(levels),
        points,
        (rows, math.ceil(queries / rows)),
        offset_noise=1.5,
        outside_fraction=0.1,
    )


@contextlib.contextmanager
def deterministic(enabled: bool):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


# ============================================================================ reference (CPU)


def test_reference_matches_straightforward_loops_at_and_beyond_borders():
    args = border_inputs()
    want = naive_msda(*args)
    got = multi_scale_deformable_attn_reference(*args)
    assert_close(got, want, atol=1e-12, rtol=1e-12, name="reference vs loops")
    assert got.abs().sum() > 0


def test_reference_matches_loops_on_realistic_tiny_config():
    inputs = msda_inputs.make("tiny", dtype=torch.float64, seed=4)
    got = multi_scale_deformable_attn_reference(*msda_inputs.args(inputs))
    assert_close(got, naive_msda(*msda_inputs.args(inputs)), atol=1e-12, rtol=1e-12)


def test_loops_would_catch_a_wrong_border_rule():
    """The loop reference must be able to fail: clamping instead of zero padding differs."""
    value, shapes, starts, loc, attn = border_inputs()
    clamped = loc.clamp(0.0, 1.0)
    assert not torch.allclose(
        naive_msda(value, shapes, starts, loc, attn),
        naive_msda(value, shapes, starts, clamped, attn),
    )


def test_reference_gradcheck_float64():
    inputs = msda_inputs.make(
        config(((5, 7), (3, 4)), batch=2, queries=6, heads=2, head_dim=3, points=3),
        dtype=torch.float64,
        seed=5,
    )
    value, shapes, starts, loc, attn = msda_inputs.args(inputs)
    loc = msda_inputs.nudge_off_pixel_edges(loc, shapes, margin=1e-2)
    inputs = [value.requires_grad_(), loc.requires_grad_(), attn.requires_grad_()]
    fn = lambda v, l, a: multi_scale_deformable_attn_reference(v, shapes, starts, l, a)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_backward_matches_autograd(dtype):
    inputs = msda_inputs.make(config(((6, 9), (3, 5), (2, 2)), head_dim=5), dtype=dtype, seed=6)
    value, shapes, starts, loc, attn = msda_inputs.args(inputs)
    loc = msda_inputs.nudge_off_pixel_edges(loc, shapes)
    leaves = [t.clone().requires_grad_() for t in (value, loc, attn)]
    out = multi_scale_deformable_attn_reference(leaves[0], shapes, starts, leaves[1], leaves[2])
    grad = torch.randn_like(out)
    want = torch.autograd.grad(out, leaves, grad)
    got = multi_scale_deformable_attn_reference_backward(grad, value, shapes, starts, loc, attn)
    for g, w, name in zip(got, want, ("grad_value", "grad_loc", "grad_attn")):
        assert_scaled_close(g, w, torch.float64 if dtype == torch.float64 else torch.float32, name)


def test_public_api_gradients_on_reference_backend():
    inputs = msda_inputs.make("tiny", dtype=torch.float64, seed=7)
    value, shapes, starts, loc, attn = msda_inputs.args(inputs)
    a = [t.clone().requires_grad_() for t in (value, loc, attn)]
    b = [t.clone().requires_grad_() for t in (value, loc, attn)]
    out = multi_scale_deformable_attn(a[0], shapes, starts, a[1], a[2])
    ref = multi_scale_deformable_attn_reference(b[0], shapes, starts, b[1], b[2])
    assert_close(out, ref, atol=0, rtol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for x, y in zip(a, b):
        assert_close(x.grad, y.grad, atol=1e-12, rtol=1e-10)


def test_mmcv_style_function_apply_and_im2col_step_ignored():
    inputs = msda_inputs.make("tiny", seed=8, requires_grad=True)
    args = msda_inputs.args(inputs)
    out = MultiScaleDeformableAttnFunction.apply(*args, 64)
    out2 = multi_scale_deformable_attn(*args, 1)
    assert torch.equal(out, out2)
    out.sum().backward()
    assert inputs["value"].grad is not None and inputs["sampling_locations"].grad is not None
    assert inputs["attention_weights"].grad is not None


def test_accepts_int32_level_metadata_and_cpu_metadata():
    inputs = msda_inputs.make("tiny", seed=9)
    value, shapes, starts, loc, attn = msda_inputs.args(inputs)
    want = multi_scale_deformable_attn(value, shapes, starts, loc, attn)
    got = multi_scale_deformable_attn(value, shapes.int(), starts.int(), loc, attn)
    assert torch.equal(got, want)


def test_float16_and_bfloat16_reference_compute_in_float32():
    inputs = msda_inputs.make("tiny", seed=10)
    args = msda_inputs.args(inputs)
    want = multi_scale_deformable_attn_reference(*args)
    for dtype in (torch.float16, torch.bfloat16):
        low = [t.to(dtype) if t.is_floating_point() else t for t in args]
        got = multi_scale_deformable_attn(*low)
        assert got.dtype == dtype
        exact = multi_scale_deformable_attn_reference(
            *[t.float() if t.is_floating_point() else t for t in low]
        )
        assert_scaled_close(got, exact, dtype, str(dtype))
        assert_scaled_close(got, want, torch.bfloat16, "vs float32 inputs")  # input rounding only


def test_mixed_dtypes_raise_type_error_naming_the_argument():
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make("tiny"))
    with pytest.raises(
        TypeError, match=r"sampling_locations must have the dtype of value \(float32\), got float16"
    ):
        multi_scale_deformable_attn(value, shapes, starts, loc.half(), attn)
    with pytest.raises(
        TypeError, match=r"attention_weights must have the dtype of value \(float32\), got float64"
    ):
        multi_scale_deformable_attn(value, shapes, starts, loc, attn.double())
    with pytest.raises(TypeError, match="value_spatial_shapes must be int32 or int64, got float32"):
        multi_scale_deformable_attn(value, shapes.float(), starts, loc, attn)
    with pytest.raises(
        TypeError, match="value_level_start_index must be int32 or int64, got int16"
    ):
        multi_scale_deformable_attn(value, shapes, starts.short(), loc, attn)
    with pytest.raises(TypeError, match="value must be a floating tensor, got int64"):
        multi_scale_deformable_attn(value.long(), shapes, starts, loc, attn)
    with pytest.raises(TypeError, match="value must be a torch.Tensor, got list"):
        multi_scale_deformable_attn([1.0], shapes, starts, loc, attn)


def test_bad_shapes_raise_value_error():
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make("tiny"))
    with pytest.raises(ValueError, match="sampling_locations must be 6-D"):
        multi_scale_deformable_attn(value, shapes, starts, loc[..., 0], attn)
    with pytest.raises(ValueError, match=r"attention_weights must have shape \[bs, num_queries"):
        multi_scale_deformable_attn(value, shapes, starts, loc, attn[:, :, :, :, :2])
    with pytest.raises(ValueError, match=r"sampling_locations must have shape"):
        multi_scale_deformable_attn(value, shapes, starts, loc[:, :, :1], attn[:, :, :1])
    with pytest.raises(ValueError, match=r"value_spatial_shapes must have shape \[num_levels, 2\]"):
        multi_scale_deformable_attn(value, shapes[:, :1], starts, loc, attn)
    with pytest.raises(ValueError, match=r"value_level_start_index must have shape \[num_levels\]"):
        multi_scale_deformable_attn(value, shapes, starts[:1], loc, attn)


def test_inconsistent_level_metadata_raises_value_error():
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make("tiny"))
    bigger = shapes.clone()
    bigger[0, 0] += 1
    with pytest.raises(
        ValueError, match=r"sum\(h \* w\) = 78 but value.shape\[1\] \(num_keys\) = 69"
    ):
        multi_scale_deformable_attn(value, bigger, starts, loc, attn)
    with pytest.raises(ValueError, match="exclusive cumulative sum"):
        multi_scale_deformable_attn(value, shapes, starts + 1, loc, attn)
    with pytest.raises(ValueError, match="exclusive cumulative sum"):
        multi_scale_deformable_attn(value, shapes, starts.flip(0), loc, attn)
    zero = shapes.clone()
    zero[1] = torch.tensor([0, 15])
    with pytest.raises(ValueError, match=r"h >= 1 and w >= 1, got level 1 = \(0, 15\)"):
        multi_scale_deformable_attn(value, zero, starts, loc, attn)


def test_level_metadata_is_rechecked_after_in_place_change():
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make("tiny"))
    shapes, starts = shapes.clone(), starts.clone()
    multi_scale_deformable_attn(value, shapes, starts, loc, attn)  # validated and cached
    starts[1] += 3
    with pytest.raises(ValueError, match="exclusive cumulative sum"):
        multi_scale_deformable_attn(value, shapes, starts, loc, attn)


def test_empty_queries_and_batch():
    for changes in ({"queries": 0}, {"batch": 0}):
        inputs = msda_inputs.make(msda_inputs.CONFIGS["tiny"].with_(**changes), requires_grad=True)
        out = multi_scale_deformable_attn(*msda_inputs.args(inputs))
        cfg = inputs["config"]
        assert out.shape == (cfg.batch, cfg.queries, cfg.heads * cfg.head_dim)
        out.sum().backward()
        assert inputs["value"].grad is not None and not inputs["value"].grad.any()
        assert inputs["sampling_locations"].grad.shape == inputs["sampling_locations"].shape


# ---------------------------------------------------------------------------- input generator


def test_generator_configs_have_the_issue_shapes():
    c = msda_inputs.CONFIGS
    assert (
        c["bevformer-base-tsa"].batch,
        c["bevformer-base-tsa"].queries,
        c["bevformer-base-tsa"].levels,
        c["bevformer-base-tsa"].points,
    ) == (2, 40000, ((200, 200),), 4)
    assert c["bevformer-base-sca"].levels == ((116, 200), (58, 100), (29, 50), (15, 25))
    assert (
        c["bevformer-base-sca"].batch,
        c["bevformer-base-sca"].queries,
        c["bevformer-base-sca"].points,
    ) == (6, 10000, 8)
    assert c["deformable-detr"].levels == ((100, 152), (50, 76), (25, 38), (13, 19))
    assert (c["deformable-detr"].batch, c["deformable-detr"].queries) == (1, 15200)
    for name in msda_inputs.BENCHMARK_CONFIGS:
        assert (c[name].heads, c[name].head_dim) == (8, 32)


def test_generator_inputs_are_realistic():
    cfg = msda_inputs.scaled("bevformer-base-sca", queries=2000, batch=2)
    inputs = msda_inputs.make(cfg, seed=3)
    value, shapes, starts, loc, attn = msda_inputs.args(inputs)
    assert value.shape == (2, cfg.num_keys, 8, 32)
    assert loc.shape == (2, 2000, 8, 4, 8, 2) and attn.shape == (2, 2000, 8, 4, 8)
    assert torch.allclose(attn.sum((-1, -2)), torch.ones(2, 2000, 8))
    outside = ((loc < 0) | (loc > 1)).any(-1).float().mean().item()
    assert 0.005 < outside < 0.2, outside
    # points of one head line up along one direction: offsets grow with the point index
    spread = (loc[0, :, 0, 0] - loc[0, :, 0, 0, :1]).norm(dim=-1).median(0).values  # [points]
    assert torch.all(spread[2:] > spread[1:-1]), spread
    assert starts.tolist() == [0, 23200, 29000, 30450]
    again = msda_inputs.make(cfg, seed=3)
    assert torch.equal(again["sampling_locations"], loc)
    assert (
        msda_inputs.scaled("deformable-detr", queries=1000).query_grid[0]
        * msda_inputs.scaled("deformable-detr", queries=1000).query_grid[1]
        >= 1000
    )


def test_nudge_moves_samples_off_pixel_edges():
    shapes = torch.tensor([[8, 16]])
    loc = torch.tensor([0.5 / 16, 1.5 / 8], dtype=torch.float64).view(
        1, 1, 1, 1, 1, 2
    )  # pixel (0, 1)
    nudged = msda_inputs.nudge_off_pixel_edges(loc, shapes)
    pix = nudged * torch.tensor([16.0, 8.0], dtype=torch.float64) - 0.5
    frac = (pix - pix.floor()).flatten()
    assert torch.all((frac > 1e-3) & (frac < 1 - 1e-3))


def test_backward_merge_knob_selects_the_native_atomic_mode():
    """MUSPACE_MSDA_BWD_MERGE (read at import) picks the native backward's atomic mode: unset / 0
    = MUSPACE_MSDA_MERGE_ATOMICS's choice (2, or 0 when that is 0), 1 = mode 3, 2 = mode 4;
    anything else fails the import naming the variable."""
    name = "mu_space.ops.multi_scale_deformable_attn"  # (the package attribute is the function)
    code = f"import sys, {name}; print(sys.modules['{name}']._ATOMIC_MODE)"
    root = Path(__file__).resolve().parents[2]
    for knobs, want in (
        ({"MUSPACE_MSDA_BWD_MERGE": "1"}, "3"),
        ({"MUSPACE_MSDA_BWD_MERGE": "2", "MUSPACE_MSDA_MERGE_ATOMICS": "0"}, "4"),
        ({"MUSPACE_MSDA_BWD_MERGE": "0", "MUSPACE_MSDA_MERGE_ATOMICS": "0"}, "0"),
        ({"MUSPACE_MSDA_BWD_MERGE": "yes"}, None),
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MUSPACE_MSDA_")}
        run = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, **knobs},
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if want is None:
            assert run.returncode != 0 and "MUSPACE_MSDA_BWD_MERGE must be 0, 1 or 2" in run.stderr
        else:
            assert run.returncode == 0, run.stderr
            assert run.stdout.split()[-1] == want, (knobs, run.stdout)


def test_a_bilinear_footprint_has_one_pixel_of_each_parity_class():
    """What the warp-merged backward (modes 3 / 4) relies on to find every pair of contributions
    that hit one pixel with four key matches: the 2 x 2 corners of a cell (y0, x0) lie on pixels
    of four different parity classes (y & 1, x & 1), and corner c = (dy, dx) is in class
    ((y0 & 1) * 2 + (x0 & 1)) ^ c; two contributions to one pixel are in one class."""
    y0 = torch.arange(-1, 7).repeat_interleave(8)
    x0 = torch.arange(-1, 7).repeat(8)
    parity = (y0 & 1) * 2 + (x0 & 1)  # the kernel's cell_parity (two's complement for -1)
    classes = []
    for c in range(4):
        py, px = y0 + (c >> 1), x0 + (c & 1)
        cls = (py & 1) * 2 + (px & 1)
        assert torch.equal(cls, parity ^ c)
        classes.append(cls)
    assert torch.equal(torch.stack(classes, 1).sort(1).values, torch.arange(4).expand(64, 4))


# ============================================================================ native (GPU)


def _to(args, device, dtype=None):
    return tuple(
        t.to(device=device, dtype=dtype if (dtype and t.is_floating_point()) else t.dtype)
        for t in args
    )


def _reference64(args):
    """float64 reference output from the exact values of (possibly low-precision) inputs."""
    v, s, st, l, a = args
    return multi_scale_deformable_attn_reference(v.double(), s, st, l.double(), a.double())


def _reference_grads64(grad, args):
    v, s, st, l, a = args
    return multi_scale_deformable_attn_reference_backward(
        grad.double(), v.double(), s, st, l.double(), a.double()
    )


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [1, 3, 8, 32, 67, 256])
@pytest.mark.parametrize("n_levels", [1, 4])
@pytest.mark.parametrize("points", [1, 4, 8, 16])
def test_native_forward_matches_reference(dtype, head_dim, n_levels, points):
    device = native_gpu_device()
    g = torch.Generator().manual_seed(head_dim * 100 + n_levels * 10 + points)
    levels = random_levels(n_levels, g)
    cfg = config(levels, batch=2, queries=29, heads=3, head_dim=head_dim, points=points)
    args = _to(msda_inputs.args(msda_inputs.make(cfg, seed=points)), device, dtype)
    out = multi_scale_deformable_attn(*args, backend="native")
    assert out.dtype == dtype and out.shape == (2, 29, 3 * head_dim)
    assert_scaled_close(out, _reference64(args), dtype, "out")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", msda_inputs.BENCHMARK_CONFIGS)
def test_native_forward_matches_reference_on_model_shapes(dtype, name):
    device = native_gpu_device()
    cfg = msda_inputs.scaled(name, queries=3000)
    args = _to(msda_inputs.args(msda_inputs.make(cfg, seed=1)), device, dtype)
    assert_scaled_close(
        multi_scale_deformable_attn(*args, backend="native"), _reference64(args), dtype, name
    )


_OP_MODULE = sys.modules[multi_scale_deformable_attn_reference.__module__]
# backward variants of the public API: (deterministic algorithms, native atomic mode); "warp" and
# "warp-shuffle" are what MUSPACE_MSDA_BWD_MERGE=1 / 2 select
BACKWARD_MODES = {
    "atomic": (False, None),
    "warp": (False, 3),
    "warp-shuffle": (False, 4),
    "deterministic": (True, None),
}


def _native_grads(args, grad, det: bool, atomic_mode: int | None = None):
    leaves = [t.detach().clone().requires_grad_() for t in (args[0], args[3], args[4])]
    saved = _OP_MODULE._ATOMIC_MODE
    if atomic_mode is not None:
        _OP_MODULE._ATOMIC_MODE = atomic_mode
    try:
        with deterministic(det):
            out = multi_scale_deformable_attn(
                leaves[0], args[1], args[2], leaves[1], leaves[2], backend="native"
            )
            out.backward(grad)
    finally:
        _OP_MODULE._ATOMIC_MODE = saved
    return tuple(t.grad for t in leaves)


def _grad_case(dtype, head_dim, n_levels, points, seed, batch=2, queries=23, heads=2):
    device = native_gpu_device()
    g = torch.Generator().manual_seed(seed)
    cfg = config(
        random_levels(n_levels, g),
        batch=batch,
        queries=queries,
        heads=heads,
        head_dim=head_dim,
        points=points,
    )
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make(cfg, seed=seed))
    loc = msda_inputs.nudge_off_pixel_edges(loc, shapes)
    args = _to((value, shapes, starts, loc, attn), device, dtype)
    grad = torch.randn(batch, queries, heads * head_dim, generator=g).to(device=device, dtype=dtype)
    return args, grad


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(BACKWARD_MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [1, 3, 8, 32, 67, 256])
@pytest.mark.parametrize("n_levels,points", [(1, 4), (4, 8), (4, 1), (2, 16)])
def test_native_backward_matches_reference(mode, dtype, head_dim, n_levels, points):
    args, grad = _grad_case(dtype, head_dim, n_levels, points, seed=head_dim + 7 * points)
    got = _native_grads(args, grad, *BACKWARD_MODES[mode])
    want = _reference_grads64(grad, args)
    for gt, wt, name in zip(
        got, want, ("grad_value", "grad_sampling_locations", "grad_attention_weights")
    ):
        assert gt.dtype == dtype
        assert_scaled_close(gt, wt, dtype, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", msda_inputs.BENCHMARK_CONFIGS)
def test_native_backward_matches_reference_on_model_shapes(dtype, name):
    # bevformer-base-sca: 47M value elements, warp-merged modes ~2 min each when emulated
    device = native_gpu_device(too_large_to_emulate=name == "bevformer-base-sca")
    cfg = msda_inputs.scaled(name, queries=2000)
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make(cfg, seed=2))
    loc = msda_inputs.nudge_off_pixel_edges(loc, shapes)
    args = _to((value, shapes, starts, loc, attn), device, dtype)
    grad = torch.randn(cfg.batch, cfg.queries, cfg.heads * cfg.head_dim, device=device).to(dtype)
    want = _reference_grads64(grad, args)
    for mode, (det, atomic_mode) in BACKWARD_MODES.items():
        got = _native_grads(args, grad, det, atomic_mode)
        for gt, wt, n in zip(got, want, ("value", "loc", "attn")):
            assert_scaled_close(gt, wt, dtype, f"{name} {mode} grad_{n}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cpt", [2, 4, 8])
@pytest.mark.parametrize("block", [64, 128, 512])
@pytest.mark.parametrize("mode", [0, 3])
def test_launch_policy_knobs_give_the_same_result(dtype, cpt, block, mode):
    """Every (vector width, vectors per lane) instantiation and block size the knobs reach, with
    the atomic backward per corner (mode 0) and merged across the warp (mode 3: its shared
    grad_out slices are laid out by block size and channels per lane)."""
    device = native_gpu_device()
    args, grad = _grad_case(dtype, 32 if cpt != 2 else 6, 2, 4, seed=41, queries=70, heads=3)
    value, shapes, starts, loc, attn = args
    out = poisoned((2, 70, 3 * value.shape[3]), dtype, device)
    warp = native.build_facts()["warp_size"]
    if block < warp:  # narrower than one warp (128-lane builds): refused, nothing launched
        with pytest.raises(ValueError, match=f"block_threads must be a multiple of {warp}"):
            native.function("multi_scale_deformable_attn_forward")(
                value, shapes, starts, loc, attn, out, cpt, block, stream_handle(value)
            )
        return
    native.function("multi_scale_deformable_attn_forward")(
        value, shapes, starts, loc, attn, out, cpt, block, stream_handle(value)
    )
    assert_scaled_close(out, _reference64(args), dtype, "out")
    gv, gl, ga = (poisoned(t.shape, dtype, device) for t in (value, loc, attn))
    workspace = torch.empty(value.shape, dtype=torch.float32, device=device)
    native.function("multi_scale_deformable_attn_backward")(
        grad,
        value,
        shapes,
        starts,
        loc,
        attn,
        gv,
        gl,
        ga,
        workspace,
        torch.empty(0, dtype=torch.int32, device=device),
        mode,
        cpt,
        block,
        stream_handle(value),
    )
    for got, w, name in zip((gv, gl, ga), _reference_grads64(grad, args), ("gv", "gl", "ga")):
        assert_scaled_close(got, w, dtype, name)


def _place(loc: torch.Tensor, layout: str) -> torch.Tensor:
    """Sampling locations that exercise the merged-atomic backward modes:
    - realistic: as generated (points ~1 px apart, neighbouring queries ~1 px apart, 2 % of the
      samples across the border);
    - stacked: every point of a level at one location (all four corners shared along the walk);
    - same-query: every query of a (batch, head) samples where query 0 does (every group of a
      warp hits the same pixels: the largest merge sets);
    - half-outside: every other sample outside its level (alternating sides, NaN among them), the
      rest stacked, so merge sets mix valid corners with presenters of nothing."""
    if layout == "stacked":
        return loc[:, :, :, :, :1].expand_as(loc).contiguous()
    if layout == "same-query":
        return loc[:, :1].expand_as(loc).contiguous()
    if layout == "half-outside":
        loc = loc[:, :, :, :, :1].expand_as(loc).clone()
        flat = loc.view(-1, 2)
        bad = torch.tensor([[-0.3, 0.5], [1.4, 0.5], [0.5, -2.0], [float("nan"), 0.5]])
        idx = torch.arange(1, flat.shape[0], 2, device=loc.device)
        flat[idx] = bad.to(loc)[idx % 4]
        return loc
    return loc


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# (24: groups of 4 lanes whose last lane has no channels; 128: 16 lanes, 2 groups per warp)
@pytest.mark.parametrize(
    "head_dim,cpt",
    [(32, 0), (32, 4), (32, 2), (24, 0), (128, 0), (8, 0), (67, 0), (3, 0)],
)
@pytest.mark.parametrize(
    "n_levels,points,layout",
    [
        (1, 4, "realistic"),
        (4, 8, "realistic"),
        (2, 16, "realistic"),
        (2, 8, "stacked"),
        (2, 4, "same-query"),
        (1, 8, "half-outside"),
    ],
)
def test_merged_corner_atomics_match_reference(
    mode, dtype, head_dim, cpt, n_levels, points, layout
):
    """Backward mode 2: a corner that a sample shares with the previous sample of its group gets
    one atomic carrying both weights. Modes 3 / 4: the atomics of each 4-sample chunk are merged
    across the samples and the groups of a warp (consecutive queries of one (batch, head);
    23 queries x 2 heads, so warps straddle (batch, head) boundaries, whose contributions must
    not merge). Layouts: _place. Outputs and the float32 workspace are poisoned: every element
    must be written / zero-filled."""
    device = native_gpu_device()
    args, grad = _grad_case(dtype, head_dim, n_levels, points, seed=head_dim + 3 * points + cpt)
    value, shapes, starts, loc, attn = args
    if layout != "realistic":
        loc = _place(loc, layout)
        args = (value, shapes, starts, loc, attn)
    gv, gl, ga = (poisoned(t.shape, dtype, device) for t in (value, loc, attn))
    workspace = (
        poisoned(value.shape, torch.float32, device)
        if dtype != torch.float32
        else torch.empty(0, device=device)
    )
    native.function("multi_scale_deformable_attn_backward")(
        grad,
        value,
        shapes,
        starts,
        loc,
        attn,
        gv,
        gl,
        ga,
        workspace,
        torch.empty(0, dtype=torch.int32, device=device),
        mode,
        cpt,
        0,
        stream_handle(value),
    )
    for got, w, name in zip((gv, gl, ga), _reference_grads64(grad, args), ("gv", "gl", "ga")):
        assert_scaled_close(got, w, dtype, f"merged (mode {mode}) {name}")
    with pytest.raises(ValueError, match="mode must be 0"):
        native.function("multi_scale_deformable_attn_backward")(
            grad,
            value,
            shapes,
            starts,
            loc,
            attn,
            gv,
            gl,
            ga,
            workspace,
            torch.empty(0, dtype=torch.int32, device=device),
            5,
            cpt,
            0,
            stream_handle(value),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_at_and_beyond_borders(dtype):
    device = native_gpu_device()
    args = _to(border_inputs(seed=3), device, dtype)
    assert_scaled_close(
        multi_scale_deformable_attn(*args, backend="native"), _reference64(args), dtype, "out"
    )
    # grad_value and grad_attention_weights are continuous in the locations: compare them even
    # on exact borders (grad_sampling_locations is compared on nudged inputs elsewhere)
    grad = torch.randn(2, 6, 6, device=device).to(dtype)
    for mode, (det, atomic_mode) in BACKWARD_MODES.items():
        gv, _, ga = _native_grads(args, grad, det, atomic_mode)
        wv, _, wa = _reference_grads64(grad, args)
        assert_scaled_close(gv, wv, dtype, f"{mode} grad_value")
        assert_scaled_close(ga, wa, dtype, f"{mode} grad_attn")


@pytest.mark.gpu
def test_nan_locations_contribute_nothing():
    """Upstream's comparisons are false for NaN: such a sample is skipped (weight 0)."""
    native_gpu_device()
    args, grad = _grad_case(torch.float32, 8, 2, 4, seed=51)
    value, shapes, starts, loc, attn = args
    nan_loc = loc.clone()
    nan_loc[0, 3, 1, 0, 2, 0] = float("nan")
    zero_attn = attn.clone()
    zero_attn[0, 3, 1, 0, 2] = 0
    got = multi_scale_deformable_attn(value, shapes, starts, nan_loc, attn, backend="native")
    want = multi_scale_deformable_attn(value, shapes, starts, loc, zero_attn, backend="native")
    assert torch.equal(got, want)
    gv, gl, ga = _native_grads((value, shapes, starts, nan_loc, attn), grad, False)
    assert torch.isfinite(gv).all() and torch.isfinite(gl).all() and torch.isfinite(ga).all()
    assert gl[0, 3, 1, 0, 2].eq(0).all() and ga[0, 3, 1, 0, 2] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_non_contiguous_and_misaligned_inputs(dtype):
    """Non-contiguous inputs are copied; inputs at odd element offsets (not 16-byte aligned)
    take the scalar path. Both must match the reference."""
    device = native_gpu_device()
    args, grad = _grad_case(dtype, 32, 2, 4, seed=61)
    value, shapes, starts, loc, attn = args
    want = _reference64(args)
    value_nc = value.transpose(1, 2).contiguous().transpose(1, 2)
    attn_nc = attn.transpose(0, 1).contiguous().transpose(0, 1)
    assert_scaled_close(
        multi_scale_deformable_attn(value_nc, shapes, starts, loc, attn_nc, backend="native"),
        want,
        dtype,
        "non-contiguous",
    )

    def misaligned(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        return view

    value_m, loc_m, attn_m = misaligned(value), misaligned(loc), misaligned(attn)
    assert value_m.data_ptr() % 16 != 0 and value_m.is_contiguous()
    assert_scaled_close(
        multi_scale_deformable_attn(value_m, shapes, starts, loc_m, attn_m, backend="native"),
        want,
        dtype,
        "misaligned",
    )
    for det in (False, True):
        got = _native_grads((value_m, shapes, starts, loc_m, attn_m), grad, det)
        for gt, wt, n in zip(got, _reference_grads64(grad, args), ("gv", "gl", "ga")):
            assert_scaled_close(gt, wt, dtype, f"misaligned det={det} {n}")


@pytest.mark.gpu
def test_native_empty_queries():
    device = native_gpu_device()
    inputs = msda_inputs.make(
        msda_inputs.CONFIGS["tiny"].with_(queries=0), device=device, requires_grad=True
    )
    out = multi_scale_deformable_attn(*msda_inputs.args(inputs), backend="native")
    assert out.shape == (2, 0, 16)
    out.sum().backward()
    assert not inputs["value"].grad.any()
    with deterministic(True):
        v = inputs["value"].detach().clone().requires_grad_()
        multi_scale_deformable_attn(
            v, *msda_inputs.args(inputs)[1:], backend="native"
        ).sum().backward()
    assert not v.grad.any()
    # the native entries themselves: no queries still zero-fills grad_value (both dtypes paths)
    for dtype in (torch.float32, torch.float16):
        value, shapes, starts, loc, attn = _to(
            tuple(t.detach() for t in msda_inputs.args(inputs)), device, dtype
        )
        gv = poisoned(value.shape, dtype, device)
        workspace = poisoned(value.shape, torch.float32, device)
        native.function("multi_scale_deformable_attn_backward")(
            torch.empty(2, 0, 16, device=device, dtype=dtype),
            value,
            shapes,
            starts,
            loc,
            attn,
            gv,
            torch.empty_like(loc),
            torch.empty_like(attn),
            workspace,
            torch.empty(0, dtype=torch.int32, device=device),
            0,
            0,
            0,
            stream_handle(value),
        )
        assert torch.equal(gv, torch.zeros_like(gv))


@pytest.mark.gpu
def test_native_entry_point_validates_arguments():
    device = native_gpu_device()
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make("tiny", device=device))
    fn = native.function("multi_scale_deformable_attn_forward")
    out = torch.empty(2, 24, 16, device=device)
    s = stream_handle(value)
    with pytest.raises(TypeError, match=r"sampling_locations must be float32, got float16"):
        fn(value, shapes, starts, loc.half(), attn, out, 0, 0, s)
    with pytest.raises(TypeError, match="value_spatial_shapes must be int32 or int64, got float32"):
        fn(value, shapes.float(), starts, loc, attn, out, 0, 0, s)
    if device.type == "cuda":  # the host emulation's device is the CPU itself
        with pytest.raises(ValueError, match="value_spatial_shapes must be on cuda:0, got cpu:0"):
            fn(value, shapes.cpu(), starts, loc, attn, out, 0, 0, s)
    with pytest.raises(ValueError, match=r"out.shape\[2\] must be 16, got 15"):
        fn(value, shapes, starts, loc, attn, out[..., :15].contiguous(), 0, 0, s)
    with pytest.raises(ValueError, match="attention_weights must be contiguous"):
        fn(value, shapes, starts, loc, attn.transpose(0, 1), out, 0, 0, s)
    with pytest.raises(ValueError, match="channels_per_thread must be"):
        fn(value, shapes, starts, loc, attn, out, 3, 0, s)
    with pytest.raises(ValueError, match="block_threads must be a multiple"):
        fn(value, shapes, starts, loc, attn, out, 0, 100, s)


def _bad_metadata_cases(shapes, starts, num_keys):
    big = torch.iinfo(torch.int32).max
    yield "levels overflow num_keys", shapes * 2, starts
    yield "start beyond num_keys", shapes, starts + num_keys
    yield "negative start", shapes, starts - 5
    yield "huge shape", torch.full_like(shapes, big), starts
    yield "zero and negative sides", -shapes, starts
    yield "last level runs past the end", shapes, starts + 1


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("head_dim", [8, 32])
def test_bad_level_metadata_never_crashes(index_dtype, head_dim):
    """Straight into the native entries (no Python validation): levels that do not fit inside
    value are skipped, nothing reads or writes out of bounds, the context stays usable, and the
    levels that do fit still give the reference result. Every atomic mode; head_dim 32 gives
    groups of 4 lanes, where modes 3 / 4 merge across groups (with 8 they run mode 2)."""
    device = native_gpu_device()
    args, grad = _grad_case(torch.float32, head_dim, 2, 4, seed=71, queries=40)
    value, shapes, starts, loc, attn = args
    num_keys = value.shape[1]
    s = stream_handle(value)
    for label, bad_shapes, bad_starts in _bad_metadata_cases(shapes, starts, num_keys):
        bad_shapes, bad_starts = bad_shapes.to(index_dtype), bad_starts.to(index_dtype)
        out = poisoned((2, 40, 2 * head_dim), torch.float32, device)
        native.function("multi_scale_deformable_attn_forward")(
            value, bad_shapes, bad_starts, loc, attn, out, 0, 0, s
        )
        # the result equals the reference with the skipped levels' weights zeroed
        h, w, st = bad_shapes[:, 0].long(), bad_shapes[:, 1].long(), bad_starts.long()
        fits = (h >= 1) & (w >= 1) & (st >= 0) & (h * w <= num_keys - st)
        masked = attn * fits.view(1, 1, 1, -1, 1).to(attn.dtype)
        comparable = (
            bool(fits.any())
            and torch.equal(bad_shapes[fits].long(), shapes[fits])
            and torch.equal(bad_starts[fits].long(), starts[fits])
        )
        masked_args = (value, shapes, starts, loc, masked)
        want_gv = _reference_grads64(grad, masked_args)[0] if comparable else None
        for mode in (0, 2, 3, 4):
            gv, gl, ga = (poisoned(t.shape, torch.float32, device) for t in (value, loc, attn))
            native.function("multi_scale_deformable_attn_backward")(
                grad,
                value,
                bad_shapes,
                bad_starts,
                loc,
                attn,
                gv,
                gl,
                ga,
                torch.empty(0, device=device),
                torch.empty(0, dtype=torch.int32, device=device),
                mode,
                0,
                0,
                s,
            )
            synchronize(device)  # raises if the kernel faulted
            for t, name in ((gv, "grad_value"), (gl, "grad_loc"), (ga, "grad_attn")):
                assert torch.isfinite(t).all(), (
                    f"{label}: mode {mode} {name} has non-finite elements"
                )
            if want_gv is not None:
                assert_scaled_close(gv, want_gv, torch.float32, f"{label}: mode {mode} grad_value")
        keys = torch.empty(loc.numel() // 2, dtype=torch.int32, device=device)
        gv2 = poisoned(value.shape, torch.float32, device)
        native.function("multi_scale_deformable_attn_backward")(
            grad,
            value,
            bad_shapes,
            bad_starts,
            loc,
            attn,
            gv2,
            gl,
            ga,
            torch.empty(0, device=device),
            keys,
            1,
            0,
            0,
            s,
        )
        sorted_keys, perm = torch.sort(keys, stable=True)
        cell_start = torch.empty(2 * 2 * (3 * num_keys + 4) + 1, dtype=torch.int64, device=device)
        native.function("multi_scale_deformable_attn_backward_value_deterministic")(
            grad,
            value,
            bad_shapes,
            bad_starts,
            loc,
            attn,
            sorted_keys,
            perm,
            cell_start,
            gv2,
            0,
            0,
            s,
        )
        synchronize(device)  # raises if any kernel faulted
        for t, name in (
            (out, "out"),
            (gv, "grad_value"),
            (gl, "grad_loc"),
            (ga, "grad_attn"),
            (gv2, "det grad_value"),
        ):
            assert torch.isfinite(t).all(), f"{label}: {name} has non-finite elements"
        if comparable:
            assert_scaled_close(out, _reference64(masked_args), torch.float32, label)
    with pytest.raises(ValueError):
        multi_scale_deformable_attn(value, shapes * 2, starts, loc, attn)
    # the context is still healthy
    assert torch.equal(torch.ones(3, device=device).cumsum(0).cpu(), torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.gpu
def test_int64_indexing_beyond_2_to_the_31_output_elements():
    """bs * queries * heads * head_dim > 2^31 (4 GiB of float16 output): rows past the int32
    range must be the same as the reference on a slice of the queries."""
    device = native_gpu_device(too_large_to_emulate=True)
    if torch.cuda.get_device_properties(device).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GiB of GPU memory")
    queries = (1 << 31) // (8 * 128) + 4096
    cfg = MSDAConfig(
        "huge",
        1,
        queries,
        8,
        128,
        ((16, 24),),
        1,
        (1024, queries // 1024 + 1),
        outside_fraction=0.0,
    )
    g = torch.Generator(device=device).manual_seed(0)
    value = torch.randn(1, 16 * 24, 8, 128, device=device, generator=g, dtype=torch.float16)
    shapes, starts = msda_inputs.level_metadata(cfg.levels, device)
    loc = torch.rand(1, queries, 8, 1, 1, 2, device=device, generator=g, dtype=torch.float16)
    attn = torch.ones(1, queries, 8, 1, 1, device=device, dtype=torch.float16)
    out = multi_scale_deformable_attn(value, shapes, starts, loc, attn, backend="native")
    tail = slice(queries - 2048, queries)
    want = _reference64(
        (value, shapes, starts, loc[:, tail].contiguous(), attn[:, tail].contiguous())
    )
    assert_scaled_close(out[:, tail], want, torch.float16, "tail rows")
    del out


# ---------------------------------------------------------------- the sampling rule on the reference path


def _skipped_sample_case(location_value, weight=None):
    """The tiny config with sample [0, 3, 1, level 0, point 2] given `location_value` in x (and
    `weight` when set), against the same inputs with that sample's weight 0 instead."""
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make("tiny", seed=5))
    bad_loc, bad_attn = loc.clone(), attn.clone()
    bad_loc[0, 3, 1, 0, 2, 0] = location_value
    if weight is not None:
        bad_attn[0, 3, 1, 0, 2] = weight
    zero_attn = attn.clone()
    zero_attn[0, 3, 1, 0, 2] = 0
    return (value, shapes, starts, bad_loc, bad_attn), (value, shapes, starts, loc, zero_attn)


@pytest.mark.parametrize(
    ("location", "weight"),
    [
        (float("nan"), None),
        (float("inf"), None),
        (-float("inf"), None),
        (3e38, None),
        (-3e38, None),
        (-0.75, float("nan")),
        (2.5, float("inf")),
    ],
    ids=["nan", "inf", "-inf", "3e38", "-3e38", "outside-nan-weight", "outside-inf-weight"],
)
def test_reference_skips_a_sample_it_does_not_take(location, weight):
    """A NaN / infinite location, one whose `2 * loc - 1` overflows, or a location outside its
    level adds nothing whatever its weight (the rule the native kernel follows), and its
    gradients are 0."""
    bad, masked = _skipped_sample_case(location, weight)
    got = multi_scale_deformable_attn_reference(*bad)
    want = multi_scale_deformable_attn_reference(*masked)
    assert torch.isfinite(got).all()
    assert_close(got, want, atol=1e-6, rtol=1e-6)
    grad = torch.randn_like(got)
    gv, gl, ga = multi_scale_deformable_attn_reference_backward(grad, *bad)
    for g in (gv, gl, ga):
        assert torch.isfinite(g).all()
    assert gl[0, 3, 1, 0, 2].eq(0).all() and ga[0, 3, 1, 0, 2] == 0
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in bad]
    multi_scale_deformable_attn_reference(*leaves).backward(grad)
    assert_close(leaves[0].grad, gv, atol=1e-5, rtol=1e-5, name="autograd vs closed form")
    assert leaves[3].grad[0, 3, 1, 0, 2].eq(0).all()


def test_reference_nan_in_value_stays_in_the_samples_that_read_it():
    """A NaN pixel reaches only the outputs and gradients of samples whose corners read it; the
    closed-form backward does not gather it into samples near other borders."""
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make("tiny", seed=6))
    value = value.clone()
    value[:, 0] = float("nan")  # pixel (0, 0) of level 0, every batch, head and channel
    out = multi_scale_deformable_attn_reference(value, shapes, starts, loc, attn)
    h0, w0 = shapes[0].tolist()
    x = loc[..., 0, :, 0] * w0 - 0.5
    y = loc[..., 0, :, 1] * h0 - 0.5
    reads = ((x < 1) & (y < 1) & (x > -1) & (y > -1)).any(-1)  # [bs, q, heads]: reads pixel 0
    nan_out = out.view(*reads.shape, -1).isnan().any(-1)
    assert torch.equal(nan_out, reads)
    grad = torch.randn_like(out)
    _, gl, ga = multi_scale_deformable_attn_reference_backward(
        grad, value, shapes, starts, loc, attn
    )
    assert torch.equal(gl.isnan().flatten(3).any(-1), reads)
    assert torch.equal(ga.isnan().flatten(3).any(-1), reads)


def test_zero_levels_give_zeros():
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make("tiny", seed=7))
    bs, _, heads, dim = value.shape
    empty_value = value[:, :0]
    out = multi_scale_deformable_attn(
        empty_value, shapes[:0], starts[:0], loc[:, :, :, :0], attn[:, :, :, :0]
    )
    assert out.shape == (bs, loc.shape[1], heads * dim) and not out.any()
    grads = multi_scale_deformable_attn_reference_backward(
        torch.ones_like(out),
        empty_value,
        shapes[:0],
        starts[:0],
        loc[:, :, :, :0],
        attn[:, :, :, :0],
    )
    assert [g.shape for g in grads] == [
        empty_value.shape,
        loc[:, :, :, :0].shape,
        attn[:, :, :, :0].shape,
    ]


def test_level_metadata_change_through_data_is_seen():
    """`.data` writes bypass the version counter: CPU metadata is keyed by its values."""
    value, shapes, starts, loc, attn = msda_inputs.args(msda_inputs.make("tiny"))
    shapes, starts = shapes.clone(), starts.clone()
    multi_scale_deformable_attn(value, shapes, starts, loc, attn)  # validated and cached
    starts.data[1] += 3
    with pytest.raises(ValueError, match="exclusive cumulative sum"):
        multi_scale_deformable_attn(value, shapes, starts, loc, attn)
