"""3D box family helpers: the argument rules the box operators share, and the vectorised
PyTorch geometry their references use.

The geometry is the kernels' (csrc/box3d/box3d.muh), step for step: the same element-wise
operations in the same order, each rounded once (torch's element-wise ops are never contracted
into FMAs, and the kernels use correctly rounded intrinsics), so on one device the reference and
the native result agree to the bit and an NMS decision at its threshold is the same on both
paths. float16 / bfloat16 inputs are computed in float32 (as the kernels), float64 in float64
(reference only).

Conventions (each operator's page in docs/operators/ repeats the ones it uses):
- LiDAR boxes [x, y, z, dx, dy, dz, yaw]: the BEV rectangle is (x, y, dx, dy, yaw), yaw
  counter-clockwise from +x (x right, y up); z is the bottom of the box where mmcv says so.
- rotated boxes [x, y, w, h, theta]: the same rectangle (w = dx, h = dy); mmcv's
  `clockwise=False` negates theta.
- a box with a non-finite value has NaN overlap / IoU with every box; a size <= 0 is an empty
  rectangle (overlap 0).
"""

from __future__ import annotations

import math
import numbers
import operator
import struct
from typing import NamedTuple

import torch

from mu_space.ops._checks import check_same_device, check_tensor, dtype_name

# Every box op's OpDef.unverified, in one place: set to "" once the kernels have passed the GPU
# suite, the sanitizers and the benchmarks (MUSPACE_TRY_UNVERIFIED=1 lets `auto` run them before).
# Verified on an H200 (2026-12-01, kernels of e056a11, unchanged since): the GPU suite (every
# box test file and the box contract tests), compute-sanitizer memcheck clean over the native
# tests of nms3d (the 196608-box case included), points_in_boxes, roiaware / roipoint, overlap
# and circle NMS, racecheck clean over the same except the 196608-box NMS case (its kernels ran
# clean under racecheck on the smaller cases), and the benchmarks.
UNVERIFIED = ""

NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_DTYPES = (*NATIVE_DTYPES, torch.float64)
_FLOAT_NAMES = "float32, float16, bfloat16 or float64"

# box3d::Layout
LIDAR7, XYWHR, XYXYR, CENTER3 = 0, 1, 2, 3
WIDTH = {LIDAR7: 7, XYWHR: 5, XYXYR: 5, CENTER3: 3}
# box3d::Kind
OVERLAP, IOU3D, ROTATED_IOU, ROTATED_IOF, NORMAL, CIRCLE = 0, 1, 2, 3, 4, 5


# --------------------------------------------------------------------------- argument rules


def check_float_tensor(t, name: str, ref: torch.Tensor | None = None, ref_name: str = "") -> None:
    """A float32 / float16 / bfloat16 / float64 tensor (on ref's device, with ref's dtype)."""
    check_tensor(t, name)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be {_FLOAT_NAMES}, got {dtype_name(t.dtype)}")
    if ref is not None:
        check_same_device(t, name, ref, ref_name)
        if t.dtype != ref.dtype:
            raise TypeError(
                f"{name} must have the dtype of {ref_name} ({dtype_name(ref.dtype)}), got "
                f"{dtype_name(t.dtype)}"
            )


def check_shape(t: torch.Tensor, name: str, shape: tuple, what: str) -> None:
    """t.shape == shape, where None entries match any size; `what` names the layout."""
    ok = t.dim() == len(shape) and all(s is None or t.shape[i] == s for i, s in enumerate(shape))
    if not ok:
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must be [{want}] ({what}), got shape {tuple(t.shape)}")


def as_float(value, name: str) -> float:
    """A Python float from a real number or a 0-d tensor (a GPU tensor costs a sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(f"{name} must be a real number, got a tensor of shape {value.shape}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def as_int(value, name: str, minimum: int = 0) -> int:
    """An int >= minimum from an int or a 0-d integer tensor."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def as_optional_int(value, name: str, minimum: int = 0) -> int | None:
    return None if value is None else as_int(value, name, minimum)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the geometry is computed in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def f32_nearest(x: float) -> float:
    """x rounded to float32 (what a C++ `float` parameter receives): mmcv's NMS threshold;
    +-inf from the rounding midpoint above the largest float32 on (struct refuses those)."""
    if not math.isfinite(x):
        return x
    if abs(x) >= 3.4028235677973366e38:
        return math.copysign(math.inf, x)
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_down(x: float) -> float:
    """The largest float32 <= x (NaN stays NaN): `d32 <= x` == `d32 <= f32_down(x)` for every
    float32 d32, so the kernels' float comparison equals mmdet3d's float64 one (circle_nms)."""
    if math.isnan(x) or math.isinf(x):
        return x
    if abs(x) >= 3.4028235677973366e38:
        return 3.4028234663852886e38 if x > 0 else -math.inf
    f = f32_nearest(x)
    if f > x:
        bits = struct.unpack("<I", struct.pack("<f", f))[0]
        bits = bits - 1 if f > 0 else (bits + 1 if f < 0 else 0x80000001)
        f = struct.unpack("<f", struct.pack("<I", bits))[0]
    return f


# --------------------------------------------------------------------------- point in box


class PointBoxes(NamedTuple):
    """LiDAR boxes prepared for point tests (box3d::PointBox): centre, vertical centre
    zc = z + dz/2, half sizes, cos / sin of -yaw, the conservative BEV reach."""

    cx: torch.Tensor
    cy: torch.Tensor
    zc: torch.Tensor
    hz: torch.Tensor
    hx: torch.Tensor
    hy: torch.Tensor
    cosa: torch.Tensor
    sina: torch.Tensor
    reach: torch.Tensor


def point_boxes(boxes: torch.Tensor) -> PointBoxes:
    """boxes [..., 7] (any float dtype) -> PointBoxes of [...] tensors in the compute dtype."""
    b = boxes.to(compute_dtype(boxes.dtype))
    hz = b[..., 5] * 0.5
    hx = b[..., 3] * 0.5
    hy = b[..., 4] * 0.5
    neg = -b[..., 6]
    reach = (hx.abs() + hy.abs()) * 1.001
    return PointBoxes(
        b[..., 0], b[..., 1], b[..., 2] + hz, hz, hx, hy, torch.cos(neg), torch.sin(neg), reach
    )


def local_xy(pb: PointBoxes, x, y):
    """(lx, ly) = R(-yaw) (p - centre) (mmcv's lidar_to_local_coords, broadcast)."""
    sx = x - pb.cx
    sy = y - pb.cy
    return sx * pb.cosa + sy * (-pb.sina), sx * pb.sina + sy * pb.cosa


def point_in_box(pb: PointBoxes, x, y, z) -> torch.Tensor:
    """box3d::point_in_box, broadcast: |z - zc| <= dz/2, |lx| < dx/2, |ly| < dy/2 (strict); a
    point with a NaN coordinate is in no box."""
    sx = x - pb.cx
    sy = y - pb.cy
    near = (sx.abs() <= pb.reach) & (sy.abs() <= pb.reach)  # NaN stays near (kernel: > is false)
    near = near | torch.isnan(sx) | torch.isnan(sy)
    z_ok = (z - pb.zc).abs() <= pb.hz
    lx = sx * pb.cosa + sy * (-pb.sina)
    ly = sx * pb.sina + sy * pb.cosa
    return near & z_ok & (lx > -pb.hx) & (lx < pb.hx) & (ly > -pb.hy) & (ly < pb.hy)


_PAIRS_PER_CHUNK = 1 << 22  # (point, box) pairs evaluated at once by points_in_boxes_mask


def points_in_boxes_mask(points: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """bool [B, M, T]: box t of batch b holds point m (point_in_box), in chunks of points;
    points [B, M, 3], boxes [B, T, 7]."""
    B, M, T = points.shape[0], points.shape[1], boxes.shape[1]
    out = torch.zeros(B, M, T, dtype=torch.bool, device=points.device)
    if B * M * T == 0:
        return out
    pb = point_boxes(boxes)
    pb = PointBoxes(*(t[:, None, :] for t in pb))  # [B, 1, T]
    p = points.to(compute_dtype(points.dtype))
    step = max(1, _PAIRS_PER_CHUNK // max(B * T, 1))
    for m0 in range(0, M, step):
        q = p[:, m0 : m0 + step, :, None]  # [B, m, 3, 1]
        out[:, m0 : m0 + step] = point_in_box(pb, q[:, :, 0], q[:, :, 1], q[:, :, 2])
    return out


# --------------------------------------------------------------------------- BEV rectangles


class Rects(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor
    h: torch.Tensor
    a: torch.Tensor

    def index(self, idx) -> Rects:
        return Rects(*(t[idx] for t in self))


def rects(boxes: torch.Tensor, layout: int, flip_angle: bool = False) -> Rects:
    """boxes [..., W] in `layout` (LIDAR7, XYWHR, XYXYR, CENTER3) -> Rects of [...] tensors in
    the compute dtype (box3d::load_rect)."""
    b = boxes.to(compute_dtype(boxes.dtype))
    if layout == LIDAR7:
        r = Rects(b[..., 0], b[..., 1], b[..., 3], b[..., 4], b[..., 6])
    elif layout == XYWHR:
        r = Rects(b[..., 0], b[..., 1], b[..., 2], b[..., 3], b[..., 4])
    elif layout == XYXYR:
        x1, y1, x2, y2 = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
        r = Rects((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1, b[..., 4])
    else:
        z = torch.zeros_like(b[..., 0])
        r = Rects(b[..., 0], b[..., 1], z, z, z)
    return r._replace(a=-r.a) if flip_angle else r


def _finite(r: Rects) -> torch.Tensor:
    ok = torch.isfinite(r.x)
    for t in r[1:]:
        ok = ok & torch.isfinite(t)
    return ok


def _clip(X, Y, n, use_x: bool, sign: float, h):
    """Sutherland-Hodgman step of box3d::clip_half_plane for polygons X, Y [P, 8] with n [P]
    vertices: keep sign * coord <= h; returns the new polygons (at most n + 1 vertices)."""
    P, slots = X.shape
    ar = torch.arange(slots, device=X.device)
    valid = ar < n[:, None]
    nxt = torch.where(ar + 1 < n[:, None], ar + 1, 0)
    C = X if use_x else Y
    Xj, Yj, Cj = X.gather(1, nxt), Y.gather(1, nxt), C.gather(1, nxt)
    di = C * sign - h[:, None]
    dj = Cj * sign - h[:, None]
    in_i = di <= 0
    cross = valid & (in_i != (dj <= 0))
    emit = valid & in_i
    t = di / (di - dj)
    IX = X + t * (Xj - X)
    IY = Y + t * (Yj - Y)
    cnt = emit.long() + cross.long()
    pos = torch.cumsum(cnt, 1) - cnt
    dump = torch.full_like(pos, slots)
    vpos = torch.where(emit, pos, dump)
    ipos = torch.where(cross, pos + emit.long(), dump)
    NX = X.new_zeros(P, slots + 1)
    NY = Y.new_zeros(P, slots + 1)
    NX.scatter_(1, vpos, X)
    NY.scatter_(1, vpos, Y)
    NX.scatter_(1, ipos, IX)
    NY.scatter_(1, ipos, IY)
    return NX[:, :slots], NY[:, :slots], cnt.sum(1)


def intersection_area(a: Rects, b: Rects) -> torch.Tensor:
    """box3d::intersection_area for 1-D Rects of finite rectangles with positive sizes: a in the
    frame of b, clipped by b's four sides, shoelace area."""
    dx = a.x - b.x
    dy = a.y - b.y
    cb, sb = torch.cos(b.a), torch.sin(b.a)
    cx = dx * cb + dy * sb
    cy = dy * cb - dx * sb
    phi = a.a - b.a
    cp, sp = torch.cos(phi), torch.sin(phi)
    hxa, hya = a.w * 0.5, a.h * 0.5
    ux, uy = hxa * cp, hxa * sp
    vx, vy = -(hya * sp), hya * cp
    P = dx.shape[0]
    X = dx.new_zeros(P, 8)
    Y = dx.new_zeros(P, 8)
    X[:, 0], Y[:, 0] = (cx - ux) - vx, (cy - uy) - vy
    X[:, 1], Y[:, 1] = (cx + ux) - vx, (cy + uy) - vy
    X[:, 2], Y[:, 2] = (cx + ux) + vx, (cy + uy) + vy
    X[:, 3], Y[:, 3] = (cx - ux) + vx, (cy - uy) + vy
    n = torch.full((P,), 4, dtype=torch.long, device=dx.device)
    hxb, hyb = b.w * 0.5, b.h * 0.5
    X, Y, n = _clip(X, Y, n, True, 1.0, hxb)
    X, Y, n = _clip(X, Y, n, True, -1.0, hxb)
    X, Y, n = _clip(X, Y, n, False, 1.0, hyb)
    X, Y, n = _clip(X, Y, n, False, -1.0, hyb)
    twice = torch.zeros_like(dx)
    for i in range(8):
        j = torch.where(i + 1 < n, i + 1, 0)[:, None]
        term = X[:, i] * Y.gather(1, j)[:, 0] - X.gather(1, j)[:, 0] * Y[:, i]
        twice = torch.where(i < n, twice + term, twice)
    return torch.fmax(twice * 0.5, torch.zeros_like(twice))


def _broadcast(a: Rects, b: Rects) -> tuple[Rects, Rects, torch.Size]:
    parts = torch.broadcast_tensors(*a, *b)
    shape = parts[0].shape
    flat = [p.reshape(-1) for p in parts]
    return Rects(*flat[:5]), Rects(*flat[5:]), shape


def overlap_area(a: Rects, b: Rects) -> torch.Tensor:
    """box3d::overlap_area, broadcast: NaN for a non-finite box, 0 for a size <= 0 or far-apart
    rectangles (the kernels' cull), else the exact intersection area."""
    a, b, shape = _broadcast(a, b)
    ok = _finite(a) & _finite(b)
    positive = (a.w > 0) & (a.h > 0) & (b.w > 0) & (b.h > 0)
    reach_a = (a.w * 0.5).abs() + (a.h * 0.5).abs()
    reach_b = (b.w * 0.5).abs() + (b.h * 0.5).abs()
    reach = reach_a + reach_b
    far = ((a.x - b.x).abs() > reach) | ((a.y - b.y).abs() > reach)
    out = torch.where(ok, 0.0, math.nan).to(a.x.dtype)
    idx = torch.nonzero(ok & positive & ~far).squeeze(1)
    if idx.numel():
        out[idx] = intersection_area(a.index(idx), b.index(idx))
    return out.reshape(shape)


def pair_values(a: Rects, b: Rects, kind: int) -> torch.Tensor:
    """box3d::pair_value, broadcast over a and b."""
    if kind == CIRCLE:
        dx, dy = a.x - b.x, a.y - b.y
        return dx * dx + dy * dy
    if kind == NORMAL:
        return _iou_normal(a, b)
    ov = overlap_area(a, b)
    if kind == OVERLAP:
        return ov
    sa, sb = a.w * a.h, b.w * b.h
    if kind == IOU3D:
        return ov / torch.fmax((sa + sb) - ov, torch.full_like(ov, 1e-8))
    a2, b2, shape = _broadcast(a, b)
    ok = (_finite(a2) & _finite(b2)).reshape(shape)
    tiny = (sa <= 1e-14) | (sb <= 1e-14)  # mmcv: area < 1e-14 in double
    base = (sa + sb) - ov if kind == ROTATED_IOU else sa.expand_as(ov)
    return torch.where(ok, torch.where(tiny, 0.0, ov / base), math.nan).to(ov.dtype)


def _iou_normal(a: Rects, b: Rects) -> torch.Tensor:
    """mmcv's iou_normal (box3d::iou_normal): axis-aligned, yaw ignored; NaN when not finite."""
    ahx, ahy, bhx, bhy = a.w * 0.5, a.h * 0.5, b.w * 0.5, b.h * 0.5
    left = torch.fmax(a.x - ahx, b.x - bhx)
    right = torch.fmin(a.x + ahx, b.x + bhx)
    top = torch.fmax(a.y - ahy, b.y - bhy)
    bottom = torch.fmin(a.y + ahy, b.y + bhy)
    zero = torch.zeros((), dtype=left.dtype, device=left.device)
    width = torch.fmax(right - left, zero)
    height = torch.fmax(bottom - top, zero)
    inter = width * height
    sa, sb = a.w * a.h, b.w * b.h
    iou = inter / torch.fmax((sa + sb) - inter, torch.full_like(inter, 1e-8))
    a2, b2, _ = _broadcast(a, b)
    ok = (_finite(a2) & _finite(b2)).reshape(iou.shape)
    return torch.where(ok, iou, math.nan).to(iou.dtype)


# --------------------------------------------------------------------------- greedy NMS


def suppress(values: torch.Tensor, threshold: float, kind: int) -> torch.Tensor:
    """box3d::suppresses: value > threshold (IoU kinds), value <= threshold (circle); NaN never."""
    return values <= threshold if kind == CIRCLE else values > threshold


def nms_reference(
    boxes: torch.Tensor,
    order: torch.Tensor,
    layout: int,
    kind: int,
    threshold: float,
    max_keep: int | None,
) -> torch.Tensor:
    """The greedy NMS of box3d_nms: visit boxes[order] in order, keep a box unless a kept box
    suppresses it, stop after max_keep; returns order[kept] (int64, on boxes' device).

    threshold is the float32 value the kernel compares with (f32_nearest / f32_down applied by
    the caller; float64 inputs compare in float64 with the same value). The suppression rows are
    built in blocks of rows (N^2 / 8 bytes of bits in all) and the greedy walk runs over Python
    integers as bit sets."""
    n = order.shape[0]
    if n == 0:
        return order.new_zeros(0)
    if boxes.shape[0] == 0:  # every entry of order is out of range: NaN boxes
        nan = torch.full((n,), math.nan, dtype=compute_dtype(boxes.dtype), device=boxes.device)
        return _greedy(Rects(nan, nan, nan, nan, nan), order, kind, threshold, max_keep)
    rows_all = order.clamp(0, boxes.shape[0] - 1)
    r = rects(boxes.index_select(0, rows_all), layout)
    bad = (order < 0) | (order >= boxes.shape[0])
    if bool(bad.any()):
        r = Rects(*(torch.where(bad, math.nan, t) for t in r))
    return _greedy(r, order, kind, threshold, max_keep)


def _greedy(r: Rects, order, kind: int, threshold: float, max_keep) -> torch.Tensor:
    n = order.shape[0]
    thr = torch.tensor(threshold, dtype=r.x.dtype, device=r.x.device)
    rows: list[int] = []
    block = max(1, min(n, (1 << 22) // max(n, 1)))
    cols = torch.arange(n, device=r.x.device)
    for i0 in range(0, n, block):
        i1 = min(n, i0 + block)
        a = Rects(*(t[i0:i1, None] for t in r))
        b = Rects(*(t[None, :] for t in r))
        sup = suppress(pair_values(a, b, kind), thr, kind)
        sup &= cols[None, :] > torch.arange(i0, i1, device=cols.device)[:, None]
        packed = _pack_rows(sup.cpu())
        rows.extend(packed)
    keep: list[int] = []
    removed = 0
    limit = n if max_keep is None or max_keep <= 0 else max_keep
    for i in range(n):
        if not (removed >> i) & 1:
            keep.append(i)
            if len(keep) >= limit:
                break
            removed |= rows[i]
    idx = torch.tensor(keep, dtype=torch.long, device=order.device)
    return order.index_select(0, idx)


def _pack_rows(bits: torch.Tensor) -> list[int]:
    """Rows of a bool matrix as Python ints (bit j = column j)."""
    import numpy as np

    packed = np.packbits(bits.numpy(), axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]
