"""`multi_scale_deformable_attn`: multi-scale deformable attention (Deformable DETR, BEVFormer,
MapTR), drop-in for mmcv's `MultiScaleDeformableAttnFunction.apply`.

    value                    Tensor[bs, num_keys, num_heads, head_dim]
    value_spatial_shapes     Tensor[num_levels, 2]  int64 or int32, (h_l, w_l) per level
    value_level_start_index  Tensor[num_levels]     int64 or int32, exclusive cumsum of h_l * w_l
    sampling_locations       Tensor[bs, num_queries, num_heads, num_levels, num_points, 2]  (x, y)
    attention_weights        Tensor[bs, num_queries, num_heads, num_levels, num_points]
    ->                       Tensor[bs, num_queries, num_heads * head_dim]

    out[b, q, h*D + c] = sum_{l, p} attention_weights[b, q, h, l, p] *
        bilinear(value[b, start_l : start_l + h_l*w_l, h, c] as an h_l x w_l image,
                 y = loc_y * h_l - 0.5, x = loc_x * w_l - 0.5)

Locations are normalised to [0, 1] (x by width, y by height). The bilinear rule is upstream's
(mmcv / Deformable DETR): a sample is taken only when -1 < y < h_l and -1 < x < w_l, and corners
outside the level contribute zero; `F.grid_sample(align_corners=False, padding_mode="zeros")`
computes the same thing, which is what the reference uses.

dtypes: float32, float16, bfloat16 natively (all three float tensors of one dtype; float32
accumulation; outputs in the input dtype); float64 and anything else run the reference. Mixed
float dtypes raise TypeError naming the argument. Native limits: head_dim <= 256, num_levels <=
16 (larger falls back to the reference, with the reason recorded in the dispatch report).

Gradients: value, sampling_locations and attention_weights, natively. The default backward
scatters grad_value with float atomics (order-dependent rounding); under
`torch.use_deterministic_algorithms(True)` a deterministic backward runs instead: no float
atomics, bit-identical results across runs, at the cost of sorting one integer key per sample
(`torch.sort(stable=True)`), a gather pass over the value rows and about 16 extra bytes of
scratch per sample (see docs/operators/multi_scale_deformable_attn.md for measured costs).

Compatibility notes:
- `im2col_step` is accepted (mmcv's argument order) and ignored: the kernels do not batch by it.
- Non-contiguous inputs are made contiguous (one copy each).
- The level metadata is checked once per (value_spatial_shapes, value_level_start_index) pair:
  sum(h * w) must equal num_keys and the start index must be the exclusive cumulative sum
  (ValueError otherwise). For tensors on the GPU the first check reads them to the host (one
  synchronisation); later calls with the same, unmodified tensor objects are free. Under CUDA
  graph capture the check is skipped; the kernels still bounds-check every level, so bad metadata
  never reads or writes out of bounds (a level that does not fit inside `value` contributes zero).
- Empty queries (or batch) return an empty output without a kernel launch.

Eager calls without autograd skip the torch dispatcher; calls that need gradients, and every call
under `torch.compile`, go through the custom ops `mu_space::multi_scale_deformable_attn` (with
`register_autograd`) and `mu_space::multi_scale_deformable_attn_backward`.

Profiling knobs (environment, read at import): `MUSPACE_MSDA_CHANNELS_PER_THREAD` (0 = default,
2, 4 or 8), `MUSPACE_MSDA_BLOCK_THREADS` (0 = default 256; a multiple of the warp size <= 512) and
`MUSPACE_MSDA_MERGE_ATOMICS` (default 1: the atomic backward merges the corners a sample shares
with the previous sample of its group before issuing their atomics; 0: one atomic per corner).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mu_space.ops._checks import dtype_name
from mu_space.runtime import kernel_dispatch, native, registry
from mu_space.runtime.device import stream_handle

OP = "multi_scale_deformable_attn"
OP_BACKWARD = "multi_scale_deformable_attn_backward"
MAX_NATIVE_HEAD_DIM = 256
MAX_NATIVE_LEVELS = 16
MAX_NATIVE_LEVEL_POINTS = 1 << 20  # levels * points
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

_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


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
    shapes_ref: weakref.ref
    starts_ref: weakref.ref
    versions: tuple
    levels: tuple | None  # None when unchecked (graph capture)
    device_shapes: torch.Tensor
    device_starts: torch.Tensor


_LEVEL_CACHE: dict[tuple, _LevelMeta] = {}
_LEVEL_CACHE_MAX = 64


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: cached by identity only
        return None


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _level_meta(
    spatial_shapes, level_start_index, num_keys, device, *, need_levels=False
) -> _LevelMeta:
    """Validated level metadata, with copies of the index tensors on `device`, cached per
    (tensor objects, in-place versions)."""
    key = (id(spatial_shapes), id(level_start_index), num_keys, device)
    versions = (_version(spatial_shapes), _version(level_start_index))
    meta = _LEVEL_CACHE.get(key)
    if (
        meta is not None
        and meta.shapes_ref() is spatial_shapes
        and meta.starts_ref() is level_start_index
        and meta.versions == versions
        and (meta.levels is not None or not need_levels)
    ):
        return meta
    capturing = _capturing(device) or _capturing(spatial_shapes.device)
    if capturing and need_levels:
        raise RuntimeError(
            f"{OP}: the reference path reads the level shapes on the host and "
            "cannot run under CUDA graph capture"
        )
    levels = None if capturing else _validate_levels(spatial_shapes, level_start_index, num_keys)
    meta = _LevelMeta(
        weakref.ref(spatial_shapes),
        weakref.ref(level_start_index),
        versions,
        levels,
        spatial_shapes.to(device).contiguous(),
        level_start_index.to(device).contiguous(),
    )
    if not capturing:
        if len(_LEVEL_CACHE) >= _LEVEL_CACHE_MAX:
            _LEVEL_CACHE.clear()
        _LEVEL_CACHE[key] = meta
    return meta


_native_state: dict[str, object] = {}


def _native_has_entry_points() -> bool:
    ok = _native_state.get("entry_points")
    if ok is None:
        ok = _native_state["entry_points"] = all(native.has_function(e) for e in _ENTRY_POINTS)
    return bool(ok)


def _native_has_bf16() -> bool:
    ok = _native_state.get("bf16")
    if ok is None:
        fn = "multi_scale_deformable_attn_has_bf16"
        ok = _native_state["bf16"] = native.has_function(fn) and bool(native.function(fn)())
    return bool(ok)


def _native_unsupported(value: torch.Tensor, head_dim: int, levels: int, points: int) -> str | None:
    if value.device.type not in ("cuda", "musa"):
        return None  # use_native reports the device itself
    if native.unavailable_reason(value.device) is not None:
        return None
    if not _native_has_entry_points():
        return "the native library has no multi_scale_deformable_attn kernels (rebuild it)"
    if value.dtype not in _NATIVE_DTYPES:
        return f"dtype {dtype_name(value.dtype)} has no native kernel (float32, float16, bfloat16)"
    if value.dtype == torch.bfloat16 and not _native_has_bf16():
        return "this native build has no bfloat16 kernels (MUSA arch < mp_22)"
    if head_dim > MAX_NATIVE_HEAD_DIM:
        return f"head_dim {head_dim} > {MAX_NATIVE_HEAD_DIM} has no native kernel"
    if levels > MAX_NATIVE_LEVELS:
        return f"{levels} levels > {MAX_NATIVE_LEVELS} have no native kernel"
    if levels * points > MAX_NATIVE_LEVEL_POINTS:
        return f"levels * points = {levels * points} > {MAX_NATIVE_LEVEL_POINTS}"
    return None


# --------------------------------------------------------------------------- reference


def multi_scale_deformable_attn_reference(
    value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
) -> torch.Tensor:
    """Vectorised PyTorch reference (one `F.grid_sample` per level; CPU and GPU; float64-capable;
    differentiable). float16 / bfloat16 inputs are computed in float32 and the result cast back."""
    bs, num_keys, heads, head_dim, queries, num_levels, points = _check_inputs(
        value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
    )
    levels = _level_meta(
        value_spatial_shapes, value_level_start_index, num_keys, value.device, need_levels=True
    ).levels
    if bs * queries * heads * head_dim == 0:
        return value.new_zeros((bs, queries, heads * head_dim))
    compute = value.dtype if value.dtype in (torch.float32, torch.float64) else torch.float32
    v = value.to(compute)
    grid = 2 * sampling_locations.to(compute) - 1  # grid_sample's [-1, 1], align_corners=False
    attn = attention_weights.to(compute)
    out = None
    for l, (h, w, start) in enumerate(levels):
        v_l = v[:, start : start + h * w].permute(0, 2, 3, 1).reshape(bs * heads, head_dim, h, w)
        g_l = grid[:, :, :, l].transpose(1, 2).reshape(bs * heads, queries, points, 2)
        sampled = F.grid_sample(
            v_l, g_l, mode="bilinear", padding_mode="zeros", align_corners=False
        )  # [bs*heads, head_dim, queries, points]
        a_l = attn[:, :, :, l].transpose(1, 2).reshape(bs * heads, 1, queries, points)
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
    levels = _level_meta(
        value_spatial_shapes, value_level_start_index, num_keys, value.device, need_levels=True
    ).levels
    compute = value.dtype if value.dtype in (torch.float32, torch.float64) else torch.float32
    v = value.to(compute)
    loc = sampling_locations.to(compute)
    attn = attention_weights.to(compute)
    go = grad_output.to(compute).reshape(bs, queries, heads, head_dim).permute(0, 2, 1, 3)
    grad_value = torch.zeros_like(v)
    grad_loc = torch.zeros_like(loc)
    grad_attn = torch.zeros_like(attn)
    if bs * queries * heads * head_dim == 0:
        return (grad_value.to(value.dtype), grad_loc.to(value.dtype), grad_attn.to(value.dtype))
    go = go[:, :, :, None, :]  # [bs, heads, queries, 1, head_dim]
    for l, (h, w, start) in enumerate(levels):
        v_l = v[:, start : start + h * w].permute(0, 2, 1, 3)  # [bs, heads, h*w, head_dim]
        x = loc[:, :, :, l, :, 0].transpose(1, 2) * w - 0.5  # [bs, heads, queries, points]
        y = loc[:, :, :, l, :, 1].transpose(1, 2) * h - 0.5
        a = attn[:, :, :, l].transpose(1, 2)
        inside = (y > -1) & (x > -1) & (y < h) & (x < w)
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
            corner = corner * valid[..., None]
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


# --------------------------------------------------------------------------- native paths


def _forward(
    value,
    value_spatial_shapes,
    value_level_start_index,
    sampling_locations,
    attention_weights,
    backend: str,
) -> torch.Tensor:
    bs, num_keys, heads, head_dim, queries, levels, points = _check_inputs(
        value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
    )
    if not kernel_dispatch.use_native(
        OP, backend, value.device, _native_unsupported(value, head_dim, levels, points)
    ):
        return multi_scale_deformable_attn_reference(
            value,
            value_spatial_shapes,
            value_level_start_index,
            sampling_locations,
            attention_weights,
        )
    meta = _level_meta(value_spatial_shapes, value_level_start_index, num_keys, value.device)
    with _no_fill():  # every element is written by the kernel
        out = torch.empty((bs, queries, heads * head_dim), dtype=value.dtype, device=value.device)
    if out.numel() == 0:
        return out
    # documented: a non-contiguous input costs one copy
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


@contextlib.contextmanager
def _no_fill():
    """With deterministic algorithms on, PyTorch fills every new uninitialised tensor (NaN /
    max int) as a safety net. Buffers that the native kernels write in full skip that fill."""
    det_utils = getattr(torch.utils, "deterministic", None)
    if (
        det_utils is None
        or not torch.are_deterministic_algorithms_enabled()
        or not det_utils.fill_uninitialized_memory
    ):
        yield
        return
    det_utils.fill_uninitialized_memory = False
    try:
        yield
    finally:
        det_utils.fill_uninitialized_memory = True


def _key_space(bs: int, heads: int, num_keys: int, levels: int) -> int:
    return bs * heads * (3 * num_keys + 2 * levels)


def _backward(
    grad_output,
    value,
    value_spatial_shapes,
    value_level_start_index,
    sampling_locations,
    attention_weights,
    backend: str,
):
    bs, num_keys, heads, head_dim, queries, levels, points = _check_inputs(
        value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights
    )
    if not kernel_dispatch.use_native(
        OP_BACKWARD, backend, value.device, _native_unsupported(value, head_dim, levels, points)
    ):
        return multi_scale_deformable_attn_reference_backward(
            grad_output,
            value,
            value_spatial_shapes,
            value_level_start_index,
            sampling_locations,
            attention_weights,
        )
    meta = _level_meta(value_spatial_shapes, value_level_start_index, num_keys, value.device)
    if bs * queries * heads * head_dim == 0:  # nothing sampled: no launch
        return (
            torch.zeros_like(value, memory_format=torch.contiguous_format),
            torch.zeros_like(sampling_locations, memory_format=torch.contiguous_format),
            torch.zeros_like(attention_weights, memory_format=torch.contiguous_format),
        )
    value = value.contiguous()
    sampling_locations = sampling_locations.contiguous()
    attention_weights = attention_weights.contiguous()
    grad_output = grad_output.to(value.dtype).contiguous()  # autograd may hand an expanded view
    with _no_fill():  # written in full by the native backward (grad_value zero-filled there)
        grad_value = torch.empty_like(value)
        grad_loc = torch.empty_like(sampling_locations)
        grad_attn = torch.empty_like(attention_weights)
    stream = stream_handle(value)
    device = value.device
    backward = native.function("multi_scale_deformable_attn_backward")
    if torch.are_deterministic_algorithms_enabled():
        space = _key_space(bs, heads, num_keys, levels)
        key_dtype = torch.int32 if space < 2**31 - 1 else torch.int64
        with _no_fill():  # every element of these is written by the kernels / the sort
            keys = torch.empty(sampling_locations.numel() // 2, dtype=key_dtype, device=device)
            cell_start = torch.empty(space + 1, dtype=torch.int64, device=device)
        backward(
            grad_output,
            value,
            meta.device_shapes,
            meta.device_starts,
            sampling_locations,
            attention_weights,
            grad_value,
            grad_loc,
            grad_attn,
            torch.empty(0, dtype=torch.float32, device=device),
            keys,
            1,
            _CHANNELS_PER_THREAD,
            _BLOCK_THREADS,
            stream,
        )
        with _no_fill():
            sorted_keys, perm = torch.sort(keys, stable=True)
        native.function("multi_scale_deformable_attn_backward_value_deterministic")(
            grad_output,
            value,
            meta.device_shapes,
            meta.device_starts,
            sampling_locations,
            attention_weights,
            sorted_keys,
            perm,
            cell_start,
            grad_value,
            _CHANNELS_PER_THREAD,
            _BLOCK_THREADS,
            stream,
        )
    else:
        workspace = (
            torch.empty(0, dtype=torch.float32, device=device)
            if value.dtype == torch.float32
            else torch.empty(value.shape, dtype=torch.float32, device=device)
        )
        backward(
            grad_output,
            value,
            meta.device_shapes,
            meta.device_starts,
            sampling_locations,
            attention_weights,
            grad_value,
            grad_loc,
            grad_attn,
            workspace,
            torch.empty(0, dtype=torch.int32, device=device),
            _ATOMIC_MODE,
            _CHANNELS_PER_THREAD,
            _BLOCK_THREADS,
            stream,
        )
    return grad_value, grad_loc, grad_attn


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("mu_space::multi_scale_deformable_attn", mutates_args=())
def _msda_op(
    value: torch.Tensor,
    value_spatial_shapes: torch.Tensor,
    value_level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    return _forward(
        value,
        value_spatial_shapes,
        value_level_start_index,
        sampling_locations,
        attention_weights,
        backend,
    )


@_msda_op.register_fake
def _(
    value,
    value_spatial_shapes,
    value_level_start_index,
    sampling_locations,
    attention_weights,
    backend,
):
    bs, _, heads, head_dim = value.shape
    return value.new_empty((bs, sampling_locations.shape[1], heads * head_dim))


@torch.library.custom_op("mu_space::multi_scale_deformable_attn_backward", mutates_args=())
def _msda_backward_op(
    grad_output: torch.Tensor,
    value: torch.Tensor,
    value_spatial_shapes: torch.Tensor,
    value_level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(
        grad_output,
        value,
        value_spatial_shapes,
        value_level_start_index,
        sampling_locations,
        attention_weights,
        backend,
    )


@_msda_backward_op.register_fake
def _(
    grad_output,
    value,
    value_spatial_shapes,
    value_level_start_index,
    sampling_locations,
    attention_weights,
    backend,
):
    return (
        value.new_empty(value.shape),
        sampling_locations.new_empty(sampling_locations.shape),
        attention_weights.new_empty(attention_weights.shape),
    )


def _setup_context(ctx, inputs, output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend = (
        inputs
    )
    ctx.save_for_backward(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights
    )
    ctx.backend = backend


def _backward_fn(ctx, grad_output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = (
        ctx.saved_tensors
    )
    grad_value, grad_loc, grad_attn = torch.ops.mu_space.multi_scale_deformable_attn_backward(
        grad_output,
        value,
        spatial_shapes,
        level_start_index,
        sampling_locations,
        attention_weights,
        ctx.backend,
    )
    needs = ctx.needs_input_grad
    return (
        grad_value if needs[0] else None,
        None,
        None,
        grad_loc if needs[3] else None,
        grad_attn if needs[4] else None,
        None,
    )


_msda_op.register_autograd(_backward_fn, setup_context=_setup_context)


# --------------------------------------------------------------------------- public API


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
    """Multi-scale deformable attention; mmcv `MultiScaleDeformableAttnFunction.apply` order.

    Shapes and semantics in the module docstring. `im2col_step` is accepted and ignored.
    Returns Tensor[bs, num_queries, num_heads * head_dim] in value's dtype.
    """
    if torch.compiler.is_compiling() or (
        torch.is_grad_enabled()
        and any(
            getattr(t, "requires_grad", False)
            for t in (value, sampling_locations, attention_weights)
        )
    ):
        return torch.ops.mu_space.multi_scale_deformable_attn(
            value,
            value_spatial_shapes,
            value_level_start_index,
            sampling_locations,
            attention_weights,
            backend,
        )
    return _forward(
        value,
        value_spatial_shapes,
        value_level_start_index,
        sampling_locations,
        attention_weights,
        backend,
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


# --------------------------------------------------------------------------- registry


def _self_check_cases(device: torch.device) -> list[registry.SelfCheckCase]:
    from mu_space.testing import msda_inputs

    def nudged(inputs):  # grad_sampling_locations jumps at pixel edges: keep samples off them
        value, shapes, starts, loc, attn = msda_inputs.args(inputs)
        return value, shapes, starts, msda_inputs.nudge_off_pixel_edges(loc, shapes), attn

    cases = []
    for dtype, atol, rtol in (
        (torch.float32, 1e-4, 1e-4),
        (torch.float16, 2e-2, 1e-2),
        (torch.bfloat16, 1e-1, 5e-2),
    ):
        inputs = msda_inputs.make("tiny", dtype=dtype, device=device, seed=1)
        cases.append(
            registry.SelfCheckCase(
                f"tiny {dtype_name(dtype)}",
                nudged(inputs),
                atol=atol,
                rtol=rtol,
                backward=dtype == torch.float32,
            )
        )
    odd = msda_inputs.make(msda_inputs.CONFIGS["tiny"].with_(head_dim=3), device=device, seed=2)
    cases.append(
        registry.SelfCheckCase("tiny head_dim 3", nudged(odd), atol=1e-4, rtol=1e-4, backward=True)
    )
    empty = msda_inputs.make(msda_inputs.CONFIGS["tiny"].with_(queries=0), device=device)
    cases.append(registry.SelfCheckCase("no queries", msda_inputs.args(empty)))
    return cases


registry.register(
    registry.OperatorSpec(
        name=OP,
        family="attention",
        api=multi_scale_deformable_attn,
        reference=multi_scale_deformable_attn_reference,
        native_entry_points=_ENTRY_POINTS,
        self_check_cases=_self_check_cases,
        dtypes=("float32", "float16", "bfloat16"),
        backward="native",
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
