"""`multi_scale_deformable_attn`: multi-scale deformable attention (Deformable DETR, BEVFormer,
MapTR), drop-in for mmcv's `MultiScaleDeformableAttnFunction.apply`. Formula, shapes and the
sampling rule: the public function's docstring; design, tolerances and measured numbers:
docs/operators/multi_scale_deformable_attn.md.

Gradients: value, sampling_locations and attention_weights, natively. The default backward
scatters grad_value with float atomics (order-dependent rounding); under
`torch.use_deterministic_algorithms(True)` a deterministic backward runs instead: no float
atomics, bit-identical results across runs, at the cost of sorting one integer key per sample
(`torch.sort(stable=True)`), a gather pass over the value rows and about 16 extra bytes of
scratch per sample.

Level metadata (value_spatial_shapes, value_level_start_index) is checked against value:
sum(h * w) must equal num_keys and the start index must be the exclusive cumulative sum
(ValueError otherwise). CPU metadata (what models pass) is read on every call and cached by its
values, with its device copies: an in-place change is always seen. Metadata on the GPU is read
(one synchronisation) once per tensor object and in-place version; a change that bypasses the
version counter (through `.data`) is not re-validated, but the kernels read the live tensors and
bounds-check every level, so bad metadata never reads or writes out of bounds (a level that does
not fit inside `value` contributes zero). The reference path reads the metadata on every call.
Under CUDA graph capture the GPU check is skipped.

Profiling knobs (environment, read at import): `MUSPACE_MSDA_CHANNELS_PER_THREAD` (0 = default,
2, 4 or 8), `MUSPACE_MSDA_BLOCK_THREADS` (0 = default 256; a multiple of the warp size <= 512),
`MUSPACE_MSDA_MERGE_ATOMICS` (default 1: the atomic backward merges the corners a sample shares
with the previous sample of its group before issuing their atomics; 0: one atomic per corner) and
`MUSPACE_MSDA_BWD_MERGE` (default 0; 1: merge the atomics of each 4-sample chunk across the
samples and the groups of a warp, one atomic per distinct pixel, instead; 2: the same with the
shuffle-compare key match of builds without a hardware match, as on MUSA).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mu_space.ops import _opdef
from mu_space.ops._checks import dtype_name
from mu_space.runtime import native
from mu_space.runtime.device import stream_capturing, stream_handle

OP = "multi_scale_deformable_attn"
_ENTRY_POINTS = (
    "multi_scale_deformable_attn_forward",
    "multi_scale_deformable_attn_backward",
    "multi_scale_deformable_attn_backward_value_deterministic",
)

_CHANNELS_PER_THREAD = int(os.environ.get("MUSPACE_MSDA_CHANNELS_PER_THREAD", "0") or 0)
_BLOCK_THREADS = int(os.environ.get("MUSPACE_MSDA_BLOCK_THREADS", "0") or 0)
# native backward mode without deterministic algorithms: 2 (default) = a corner shared with the
# previous sample of the group is merged into one atomic; 0 = one atomic per sample and corner
_ATOMIC_MODE = 0 if (os.environ.get("MUSPACE_MSDA_MERGE_ATOMICS", "1") or "1") == "0" else 2
# MUSPACE_MSDA_BWD_MERGE (A/B knob, takes precedence over the one above): 1 = mode 3, the atomics
# of each 4-sample chunk are merged across the samples and the groups of a warp (which then serve
# consecutive queries of one (batch, head)); 2 = mode 4, the same with the shuffle-compare key
# match that MUSA builds (tests that path on CUDA); 0 (default) = the mode above
_BWD_MERGE = (os.environ.get("MUSPACE_MSDA_BWD_MERGE", "0") or "0").strip()
if _BWD_MERGE not in ("0", "1", "2"):
    raise ValueError(f"MUSPACE_MSDA_BWD_MERGE must be 0, 1 or 2, got {_BWD_MERGE!r}")
if _BWD_MERGE != "0":
    _ATOMIC_MODE = 2 + int(_BWD_MERGE)

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
# a normalised location outside every level: its four corners are outside, so it reads no pixel
_OUTSIDE = -4.0


# --------------------------------------------------------------------------- validation


def _check_inputs(
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights
) -> tuple[int, int, int, int, int, int, int]:
    """Types, dtypes, ranks and shape relations (no data reads). Returns bs, K, H, D, Q, L, P."""
    named = (
        ("value", value),
        ("value_spatial_shapes", spatial_shapes),
        ("value_level_start_index", level_start_index),
        ("sampling_locations", sampling_locations),
        ("attention_weights", attention_weights),
    )
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"value must be a floating tensor, got {dtype_name(value.dtype)}")
    for name, t in named[3:]:
        if t.dtype != value.dtype:
            raise TypeError(
                f"{name} must have the dtype of value ({dtype_name(value.dtype)}), "
                f"got {dtype_name(t.dtype)}"
            )
    for name, t in named[1:3]:
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {dtype_name(t.dtype)}")
    for name, t, ndim in (
        ("value", value, 4),
        ("value_spatial_shapes", spatial_shapes, 2),
        ("value_level_start_index", level_start_index, 1),
        ("sampling_locations", sampling_locations, 6),
        ("attention_weights", attention_weights, 5),
    ):
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got {t.dim()}-D of shape {list(t.shape)}")
    bs, num_keys, heads, head_dim = value.shape
    levels = spatial_shapes.shape[0]
    if spatial_shapes.shape[1] != 2:
        raise ValueError(
            f"value_spatial_shapes must have shape [num_levels, 2], got "
            f"{list(spatial_shapes.shape)}"
        )
    if level_start_index.shape[0] != levels:
        raise ValueError(
            f"value_level_start_index must have shape [num_levels] = [{levels}], got "
            f"{list(level_start_index.shape)}"
        )
    _, queries, _, _, points, _ = sampling_locations.shape
    want = (bs, queries, heads, levels, points, 2)
    if tuple(sampling_locations.shape) != want:
        raise ValueError(
            f"sampling_locations must have shape [bs, num_queries, num_heads, "
            f"num_levels, num_points, 2] = {list(want)}, got "
            f"{list(sampling_locations.shape)}"
        )
    if tuple(attention_weights.shape) != want[:5]:
        raise ValueError(
            f"attention_weights must have shape [bs, num_queries, num_heads, "
            f"num_levels, num_points] = {list(want[:5])}, got "
            f"{list(attention_weights.shape)}"
        )
    for name, t in named[3:]:
        if t.device != value.device:
            raise ValueError(f"{name} must be on {value.device}, got {t.device}")
    for name, t in named[1:3]:
        if t.device != value.device and t.device.type != "cpu":
            raise ValueError(f"{name} must be on {value.device} or the cpu, got {t.device}")
    return bs, num_keys, heads, head_dim, queries, levels, points


def _validate_levels(
    spatial_shapes, level_start_index, num_keys
) -> tuple[tuple[int, int, int], ...]:
    """(h, w, start) per level after checking them against value; reads the tensors."""
    shapes = spatial_shapes.tolist()
    starts = level_start_index.tolist()
    for l, (h, w) in enumerate(shapes):
        if h < 1 or w < 1:
            raise ValueError(
                f"value_spatial_shapes: every level needs h >= 1 and w >= 1, got "
                f"level {l} = ({h}, {w})"
            )
    sizes = [h * w for h, w in shapes]
    if sum(sizes) != num_keys:
        raise ValueError(
            f"value_spatial_shapes do not match value: sum(h * w) = {sum(sizes)} "
            f"but value.shape[1] (num_keys) = {num_keys}"
        )
    expected = [sum(sizes[:l]) for l in range(len(sizes))]
    if starts != expected:
        raise ValueError(
            f"value_level_start_index must be the exclusive cumulative sum of "
            f"h * w over value_spatial_shapes ({expected}), got {starts}"
        )
    return tuple((h, w, s) for (h, w), s in zip(shapes, starts))


@dataclass
class _LevelMeta:
    levels: tuple | None  # ((h, w, start), ...); None when unchecked (graph capture)
    device_shapes: torch.Tensor
    device_starts: torch.Tensor
    shapes_ref: weakref.ref | None = None  # GPU metadata: the tensors it was validated for
    starts_ref: weakref.ref | None = None


_LEVEL_CACHE: dict[tuple, _LevelMeta] = {}
_LEVEL_CACHE_MAX = 64


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: cached by identity only
        return None


def _capturing(device: torch.device) -> bool:
    return bool(stream_capturing(device))  # unknown (None): as not capturing


def _cache(key, meta: _LevelMeta) -> _LevelMeta:
    if len(_LEVEL_CACHE) >= _LEVEL_CACHE_MAX:
        _LEVEL_CACHE.clear()
    _LEVEL_CACHE[key] = meta
    return meta


def _level_meta(spatial_shapes, level_start_index, num_keys, device) -> _LevelMeta:
    """Validated level metadata with copies of the index tensors on `device` (module docstring:
    CPU metadata is keyed by its values, GPU metadata by tensor object and version)."""
    if spatial_shapes.device.type == "cpu" and level_start_index.device.type == "cpu":
        key = (
            tuple(spatial_shapes.reshape(-1).tolist()),
            tuple(level_start_index.tolist()),
            spatial_shapes.dtype,
            level_start_index.dtype,
            num_keys,
            device,
        )
        meta = _LEVEL_CACHE.get(key)
        if meta is None:
            levels = _validate_levels(spatial_shapes, level_start_index, num_keys)
            meta = _cache(
                key,
                _LevelMeta(
                    levels,
                    spatial_shapes.to(device).contiguous(),
                    level_start_index.to(device).contiguous(),
                ),
            )
        return meta
    key = (
        id(spatial_shapes),
        id(level_start_index),
        _version(spatial_shapes),
        _version(level_start_index),
        num_keys,
        device,
    )
    meta = _LEVEL_CACHE.get(key)
    if (
        meta is not None
        and meta.shapes_ref() is spatial_shapes
        and meta.starts_ref() is level_start_index
    ):
        return meta
    if _capturing(device) or _capturing(spatial_shapes.device):
        return _LevelMeta(
            None, spatial_shapes.to(device).contiguous(), level_start_index.to(device).contiguous()
        )
    levels = _validate_levels(spatial_shapes, level_start_index, num_keys)
    return _cache(
        key,
        _LevelMeta(
            levels,
            spatial_shapes.to(device).contiguous(),
            level_start_index.to(device).contiguous(),
            weakref.ref(spatial_shapes),
            weakref.ref(level_start_index),
        ),
    )


def _reference_levels(spatial_shapes, level_start_index, num_keys, device) -> tuple:
    """The levels for the reference path, read fresh (it needs them on the host)."""
    if _capturing(device) or _capturing(spatial_shapes.device):
        raise RuntimeError(
            f"{OP}: the reference path reads the level shapes on the host and "
            "cannot run under CUDA graph capture"
        )
    return _validate_levels(spatial_shapes, level_start_index, num_keys)


def _check(
    value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
) -> _opdef.Checked:
    dims = _check_inputs(
        value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
    )
    bs, _, heads, head_dim, queries, _, _ = dims
    out = ((bs, queries, heads * head_dim), value.dtype)
    return _opdef.Checked(value.device, value.dtype, (out,), dims, "value")


def _supports(c: _opdef.Checked) -> str | None:
    _, _, _, head_dim, _, levels, points = c.info
    if head_dim > (limit := native.limit("multi_scale_deformable_attn.max_head_dim")):
        return f"head_dim {head_dim} > {limit} has no native kernel"
    if levels > (limit := native.limit("multi_scale_deformable_attn.max_levels")):
        return f"{levels} levels > {limit} have no native kernel"
    if levels * points > (limit := native.limit("multi_scale_deformable_attn.max_level_points")):
        return f"levels * points = {levels * points} > {limit}"
    return None


# --------------------------------------------------------------------------- reference


def _inside(loc_l: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The sampling rule: -1 < x < w and -1 < y < h for x = loc_x * w - 0.5, y = loc_y * h - 0.5
    (False for NaN, +-inf and locations whose product overflows)."""
    x = loc_l[..., 0] * w - 0.5
    y = loc_l[..., 1] * h - 0.5
    return (y > -1) & (x > -1) & (y < h) & (x < w)


def multi_scale_deformable_attn_reference(
    value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
) -> torch.Tensor:
    """Vectorised PyTorch reference (one `F.grid_sample` per level; CPU and GPU; float64-capable;
    differentiable). float16 / bfloat16 inputs are computed in float32 and the result cast back.
    A sample outside its level (or with a NaN / inf location) adds nothing, whatever its weight,
    and reads no pixel."""
    bs, num_keys, heads, head_dim, queries, num_levels, points = _check_inputs(
        value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
    )
    levels = _reference_levels(
        value_spatial_shapes, value_level_start_index, num_keys, value.device
    )
    if bs * queries * heads * head_dim == 0 or num_levels == 0:
        return value.new_zeros((bs, queries, heads * head_dim)) + value.reshape(-1)[:0].sum()
    compute = value.dtype if value.dtype in (torch.float32, torch.float64) else torch.float32
    v = value.to(compute)
    loc = sampling_locations.to(compute)
    attn = attention_weights.to(compute)
    out = None
    for l, (h, w, start) in enumerate(levels):
        v_l = v[:, start : start + h * w].permute(0, 2, 3, 1).reshape(bs * heads, head_dim, h, w)
        loc_l = loc[:, :, :, l]
        inside = _inside(loc_l, h, w)
        # grid_sample's [-1, 1] (align_corners=False); skipped samples sit outside every pixel
        grid = torch.where(inside[..., None], 2 * loc_l - 1, 2 * _OUTSIDE - 1)
        g_l = grid.transpose(1, 2).reshape(bs * heads, queries, points, 2)
        sampled = F.grid_sample(
            v_l, g_l, mode="bilinear", padding_mode="zeros", align_corners=False
        )  # [bs*heads, head_dim, queries, points]
        a_l = torch.where(inside, attn[:, :, :, l], 0)
        a_l = a_l.transpose(1, 2).reshape(bs * heads, 1, queries, points)
        term = (sampled * a_l).sum(-1)
        out = term if out is None else out + term
    out = out.view(bs, heads, head_dim, queries).permute(0, 3, 1, 2)
    return out.reshape(bs, queries, heads * head_dim).to(value.dtype).contiguous()


def multi_scale_deformable_attn_reference_backward(
    grad_output,
    value,
    value_spatial_shapes,
    value_level_start_index,
    sampling_locations,
    attention_weights,
):
    """Gradients (grad_value, grad_sampling_locations, grad_attention_weights) in closed form,
    vectorised per level (the reference path's backward; autograd cannot run inside a custom
    op). Same rule as the forward: corner weights of the bilinear sample, d(bilinear)/d(pixel
    coordinate) from the four corners, zero outside. float16 / bfloat16 compute in float32."""
    bs, num_keys, heads, head_dim, queries, num_levels, points = _check_inputs(
        value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
    )
    levels = _reference_levels(
        value_spatial_shapes, value_level_start_index, num_keys, value.device
    )
    compute = value.dtype if value.dtype in (torch.float32, torch.float64) else torch.float32
    v = value.to(compute)
    loc = sampling_locations.to(compute)
    attn = attention_weights.to(compute)
    go = grad_output.to(compute).reshape(bs, queries, heads, head_dim).permute(0, 2, 1, 3)
    grad_value = torch.zeros_like(v)
    grad_loc = torch.zeros_like(loc)
    grad_attn = torch.zeros_like(attn)
    if bs * queries * heads * head_dim == 0 or num_levels == 0:
        return (grad_value.to(value.dtype), grad_loc.to(value.dtype), grad_attn.to(value.dtype))
    go = go[:, :, :, None, :]  # [bs, heads, queries, 1, head_dim]
    for l, (h, w, start) in enumerate(levels):
        v_l = v[:, start : start + h * w].permute(0, 2, 1, 3)  # [bs, heads, h*w, head_dim]
        x = loc[:, :, :, l, :, 0].transpose(1, 2) * w - 0.5  # [bs, heads, queries, points]
        y = loc[:, :, :, l, :, 1].transpose(1, 2) * h - 0.5
        inside = (y > -1) & (x > -1) & (y < h) & (x < w)  # the forward's rule (_inside)
        # a skipped sample's weight (NaN included) and an unread corner's value stay out
        a = torch.where(inside, attn[:, :, :, l].transpose(1, 2), 0)
        x = torch.where(inside, x, torch.zeros_like(x))
        y = torch.where(inside, y, torch.zeros_like(y))
        x0, y0 = x.floor(), y.floor()
        lx, ly = x - x0, y - y0
        hx, hy = 1 - lx, 1 - ly
        dots = []
        g_v = torch.zeros_like(v_l)
        for dy, dx, cw in ((0, 0, hy * hx), (0, 1, hy * lx), (1, 0, ly * hx), (1, 1, ly * lx)):
            cy, cx = y0.long() + dy, x0.long() + dx
            valid = inside & (cy >= 0) & (cy < h) & (cx >= 0) & (cx < w)
            idx = torch.where(valid, cy * w + cx, torch.zeros_like(cy)).reshape(bs, heads, -1)
            idx = idx[..., None].expand(-1, -1, -1, head_dim)
            corner = torch.gather(v_l, 2, idx).view(bs, heads, queries, points, head_dim)
            corner = torch.where(valid[..., None], corner, 0)
            dots.append((corner * go).sum(-1))
            cw = cw * valid
            contrib = (a * cw)[..., None] * go  # [bs, heads, queries, points, head_dim]
            g_v.scatter_add_(2, idx, contrib.reshape(bs, heads, -1, head_dim))
        d0, d1, d2, d3 = dots
        g_a = hy * hx * d0 + hy * lx * d1 + ly * hx * d2 + ly * lx * d3
        g_x = w * a * (hy * (d1 - d0) + ly * (d3 - d2))
        g_y = h * a * (hx * (d2 - d0) + lx * (d3 - d1))
        zero = torch.zeros_like(g_a)
        grad_attn[:, :, :, l] = torch.where(inside, g_a, zero).transpose(1, 2)
        grad_loc[:, :, :, l, :, 0] = torch.where(inside, g_x, zero).transpose(1, 2)
        grad_loc[:, :, :, l, :, 1] = torch.where(inside, g_y, zero).transpose(1, 2)
        grad_value[:, start : start + h * w] = g_v.permute(0, 2, 1, 3)
    return grad_value.to(value.dtype), grad_loc.to(value.dtype), grad_attn.to(value.dtype)


# --------------------------------------------------------------------------- native


def _forward_native(
    c, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
) -> torch.Tensor:
    bs, num_keys, heads, head_dim, queries, levels, points = c.info
    meta = _level_meta(value_spatial_shapes, value_level_start_index, num_keys, value.device)
    out = _opdef.new_output(value, (bs, queries, heads * head_dim))
    if out.numel() == 0:
        return out
    if levels * points == 0:  # nothing is sampled: no launch
        return out.zero_()
    # a non-contiguous input costs one copy
    native.function("multi_scale_deformable_attn_forward")(
        value.contiguous(),
        meta.device_shapes,
        meta.device_starts,
        sampling_locations.contiguous(),
        attention_weights.contiguous(),
        out,
        _CHANNELS_PER_THREAD,
        _BLOCK_THREADS,
        stream_handle(value),
    )
    return out


def _key_space(bs: int, heads: int, num_keys: int, levels: int) -> int:
    return bs * heads * (3 * num_keys + 2 * levels)


def _backward_native(
    c,
    grad_output,
    value,
    value_spatial_shapes,
    value_level_start_index,
    sampling_locations,
    attention_weights,
    *,
    needs,
    deterministic,
):
    bs, num_keys, heads, head_dim, queries, levels, points = c.info
    meta = _level_meta(value_spatial_shapes, value_level_start_index, num_keys, value.device)
    if bs * queries * heads * head_dim * levels * points == 0:  # nothing sampled: no launch
        return (
            torch.zeros_like(value, memory_format=torch.contiguous_format),
            torch.zeros_like(sampling_locations, memory_format=torch.contiguous_format),
            torch.zeros_like(attention_weights, memory_format=torch.contiguous_format),
        )
    value = value.contiguous()
    sampling_locations = sampling_locations.contiguous()
    attention_weights = attention_weights.contiguous()
    grad_output = grad_output.to(value.dtype).contiguous()  # autograd may hand an expanded view
    # written in full by the native backward (grad_value zero-filled there)
    grad_value = _opdef.new_output(value)
    grad_loc = _opdef.new_output(sampling_locations)
    grad_attn = _opdef.new_output(attention_weights)
    stream = stream_handle(value)
    device = value.device
    backward = native.function("multi_scale_deformable_attn_backward")
    inputs = (
        grad_output,
        value,
        meta.device_shapes,
        meta.device_starts,
        sampling_locations,
        attention_weights,
    )
    outputs = (grad_value, grad_loc, grad_attn)
    policy = (_CHANNELS_PER_THREAD, _BLOCK_THREADS, stream)
    if deterministic:
        space = _key_space(bs, heads, num_keys, levels)
        key_dtype = torch.int32 if space < 2**31 - 1 else torch.int64
        with _opdef.no_fill():  # every element of these is written by the kernels / the sort
            keys = torch.empty(sampling_locations.numel() // 2, dtype=key_dtype, device=device)
            cell_start = torch.empty(space + 1, dtype=torch.int64, device=device)
        no_workspace = torch.empty(0, dtype=torch.float32, device=device)
        backward(*inputs, *outputs, no_workspace, keys, 1, *policy)
        with _opdef.no_fill():
            sorted_keys, perm = torch.sort(keys, stable=True)
        native.function("multi_scale_deformable_attn_backward_value_deterministic")(
            *inputs, sorted_keys, perm, cell_start, grad_value, *policy
        )
    else:
        workspace = (
            torch.empty(0, dtype=torch.float32, device=device)
            if value.dtype == torch.float32
            else torch.empty(value.shape, dtype=torch.float32, device=device)
        )
        no_keys = torch.empty(0, dtype=torch.int32, device=device)
        backward(*inputs, *outputs, workspace, no_keys, _ATOMIC_MODE, *policy)
    return grad_value, grad_loc, grad_attn


# --------------------------------------------------------------------------- definition


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import msda_inputs

    def nudged(inputs):  # grad_sampling_locations jumps at pixel edges: keep samples off them
        value, shapes, starts, loc, attn = msda_inputs.args(inputs)
        return value, shapes, starts, msda_inputs.nudge_off_pixel_edges(loc, shapes), attn

    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        inputs = msda_inputs.make("tiny", dtype=dtype, device=device, seed=1)
        cases.append(
            _opdef.Sample(f"tiny {dtype_name(dtype)}", nudged(inputs), grad=dtype == torch.float32)
        )
    tiny = msda_inputs.CONFIGS["tiny"]
    odd = msda_inputs.make(tiny.with_(head_dim=3), device=device, seed=2)
    cases.append(_opdef.Sample("tiny head_dim 3", nudged(odd), grad=True))
    empty = msda_inputs.make(tiny.with_(queries=0), device=device)
    cases.append(_opdef.Sample("no queries", msda_inputs.args(empty)))
    return cases


OP_DEF = _opdef.define(
    _opdef.OpDef(
        name=OP,
        family="attention",
        schema="(Tensor value, Tensor value_spatial_shapes, Tensor value_level_start_index, "
        "Tensor sampling_locations, Tensor attention_weights) -> Tensor",
        check=_check,
        reference=multi_scale_deformable_attn_reference,
        native=_forward_native,
        backward=_opdef.Backward(
            inputs=("value", "sampling_locations", "attention_weights"),
            reference=multi_scale_deformable_attn_reference_backward,
            native=_backward_native,
        ),
        supports=_supports,
        native_dtypes=_NATIVE_DTYPES,
        entry_points=_ENTRY_POINTS,
        samples=_samples,
        upstream="mmcv MultiScaleDeformableAttnFunction",
        models="BEVFormer, Deformable DETR, MapTR",
        patches=(
            "mmcv.MultiScaleDeformableAttnFunction",
            "mmcv.multi_scale_deformable_attn_pytorch",
        ),
        recipes=("model_examples/BEVFormer",),
        doc="docs/operators/multi_scale_deformable_attn.md",
    )
)


@OP_DEF.export
def multi_scale_deformable_attn(
    value,
    value_spatial_shapes,
    value_level_start_index,
    sampling_locations,
    attention_weights,
    im2col_step=64,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Multi-scale deformable attention, mmcv's `MultiScaleDeformableAttnFunction.apply` argument
    order (Deformable DETR, BEVFormer, MapTR).

        value                    Tensor[bs, num_keys, num_heads, head_dim]
        value_spatial_shapes     Tensor[num_levels, 2]  int64 or int32, (h_l, w_l) per level
        value_level_start_index  Tensor[num_levels]     int64 or int32, exclusive cumsum of h_l * w_l
        sampling_locations       Tensor[bs, num_queries, num_heads, num_levels, num_points, 2] (x, y)
        attention_weights        Tensor[bs, num_queries, num_heads, num_levels, num_points]
        ->                       Tensor[bs, num_queries, num_heads * head_dim] in value's dtype

        out[b, q, h*D + c] = sum_{l, p} attention_weights[b, q, h, l, p] *
            bilinear(value[b, start_l : start_l + h_l*w_l, h, c] as an h_l x w_l image,
                     y = loc_y * h_l - 0.5, x = loc_x * w_l - 0.5)

    Locations are normalised to [0, 1] (x by width, y by height). The bilinear rule is upstream's
    (mmcv / Deformable DETR): a sample is taken only when -1 < y < h_l and -1 < x < w_l (never for
    a NaN or infinite location), a sample not taken adds nothing whatever its weight, and corners
    outside the level contribute zero (`F.grid_sample(align_corners=False, padding_mode="zeros")`
    computes the same).

    dtypes: float32, float16, bfloat16 natively (all three float tensors of one dtype; float32
    accumulation); float64 runs the reference. Mixed float dtypes raise TypeError naming the
    argument. Native limits (head_dim, levels, levels * points) come from the library's build
    facts; larger inputs run the reference, with the reason in the dispatch report.
    `im2col_step` is accepted (mmcv's argument order) and ignored. Non-contiguous inputs cost one
    copy each. Empty queries, batch, levels or points give zeros without a launch.
    Differentiable w.r.t. value, sampling_locations and attention_weights (determinism and the
    metadata check: the module docstring).
    """
    return OP_DEF(
        value,
        value_spatial_shapes,
        value_level_start_index,
        sampling_locations,
        attention_weights,
        backend=backend,
    )


class MultiScaleDeformableAttnFunction:
    """Stand-in for mmcv's `MultiScaleDeformableAttnFunction` (an autograd.Function): patch it
    in and `apply(...)` runs muSPACE's kernels with autograd through the custom op."""

    @staticmethod
    def apply(
        value,
        value_spatial_shapes,
        value_level_start_index,
        sampling_locations,
        attention_weights,
        im2col_step=64,
    ):
        return multi_scale_deformable_attn(
            value,
            value_spatial_shapes,
            value_level_start_index,
            sampling_locations,
            attention_weights,
            im2col_step,
        )
