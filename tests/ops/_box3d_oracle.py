"""Independent statements of the 3D box definitions, in plain Python float64 (no torch in the
geometry): the tests of the box operators compare the vectorised references and the kernels
against these.

- point in a LiDAR box (mmcv's check_pt_in_box3d, z at the bottom);
- the intersection area of two rotated rectangles by Sutherland-Hodgman clipping of one
  rectangle's corner polygon by the other's four edges, in world coordinates (the operators
  clip in the frame of the second rectangle; this one does not transform anything);
- greedy NMS as the textbook loop over a score-ordered list.
"""

from __future__ import annotations

import math


def point_in_lidar_box(p, box) -> bool:
    x, y, z = (float(v) for v in p)
    cx, cy, cz, dx, dy, dz, yaw = (float(v) for v in box)
    if any(math.isnan(v) for v in (x, y, z)):
        return False
    zc = cz + dz / 2
    if not abs(z - zc) <= dz / 2:
        return False
    c, s = math.cos(-yaw), math.sin(-yaw)
    sx, sy = x - cx, y - cy
    lx = sx * c - sy * s
    ly = sx * s + sy * c
    return -dx / 2 < lx < dx / 2 and -dy / 2 < ly < dy / 2


def corners(x, y, w, h, a):
    """Counter-clockwise corners of the rectangle centred at (x, y), sizes (w, h), angle a."""
    c, s = math.cos(a), math.sin(a)
    out = []
    for ux, uy in ((-1, -1), (1, -1), (1, 1), (-1, 1)):
        px, py = ux * w / 2, uy * h / 2
        out.append((x + px * c - py * s, y + px * s + py * c))
    return out


def _clip(poly, p, q):
    """Keep the part of poly left of the directed edge p -> q (inside of a CCW polygon)."""

    def side(v):
        return (q[0] - p[0]) * (v[1] - p[1]) - (q[1] - p[1]) * (v[0] - p[0])

    out = []
    for i, cur in enumerate(poly):
        nxt = poly[(i + 1) % len(poly)]
        sc, sn = side(cur), side(nxt)
        if sc >= 0:
            out.append(cur)
        if (sc >= 0) != (sn >= 0):
            t = sc / (sc - sn)
            out.append((cur[0] + t * (nxt[0] - cur[0]), cur[1] + t * (nxt[1] - cur[1])))
    return out


def polygon_area(poly) -> float:
    s = 0.0
    for i, (x0, y0) in enumerate(poly):
        x1, y1 = poly[(i + 1) % len(poly)]
        s += x0 * y1 - x1 * y0
    return abs(s) / 2


def rect_intersection(a, b) -> float:
    """Area of rectangle a ∩ rectangle b, each (x, y, w, h, angle); sizes <= 0 are empty."""
    if a[2] <= 0 or a[3] <= 0 or b[2] <= 0 or b[3] <= 0:
        return 0.0
    poly = corners(*a)
    cb = corners(*b)
    for i in range(4):
        if not poly:
            return 0.0
        poly = _clip(poly, cb[i], cb[(i + 1) % 4])
    return polygon_area(poly) if len(poly) >= 3 else 0.0


def finite(*boxes) -> bool:
    return all(math.isfinite(float(v)) for b in boxes for v in b)


def iou3d_bev(a7, b7) -> float:
    """mmcv iou3d's IoU of LiDAR boxes (exact overlap): ov / max(sa + sb - ov, 1e-8)."""
    a = (a7[0], a7[1], a7[3], a7[4], a7[6])
    b = (b7[0], b7[1], b7[3], b7[4], b7[6])
    if not finite(a, b):
        return math.nan
    ov = rect_intersection(a, b)
    return ov / max(a[2] * a[3] + b[2] * b[3] - ov, 1e-8)


def rotated_iou(a, b, iof: bool = False) -> float:
    """box_iou_rotated of (x, y, w, h, theta): 0 when an area is < 1e-14, else ov / union
    (iof: ov / area_a)."""
    if not finite(a, b):
        return math.nan
    sa, sb = a[2] * a[3], b[2] * b[3]
    if sa < 1e-14 or sb < 1e-14:
        return 0.0
    ov = rect_intersection(a, b)
    return ov / (sa if iof else sa + sb - ov)


def iou_normal(a7, b7) -> float:
    """mmcv's nms3d_normal IoU: axis-aligned (yaw ignored), floor 1e-8."""
    if not finite(a7, b7):
        return math.nan
    w = max(
        min(a7[0] + a7[3] / 2, b7[0] + b7[3] / 2) - max(a7[0] - a7[3] / 2, b7[0] - b7[3] / 2), 0
    )
    h = max(
        min(a7[1] + a7[4] / 2, b7[1] + b7[4] / 2) - max(a7[1] - a7[4] / 2, b7[1] - b7[4] / 2), 0
    )
    inter = w * h
    return inter / max(a7[3] * a7[4] + b7[3] * b7[4] - inter, 1e-8)


def greedy_nms(order, suppresses, max_keep=None) -> list[int]:
    """The textbook greedy loop: visit `order`; keep a box unless a kept box suppresses it."""
    kept: list[int] = []
    for i in order:
        if any(suppresses(k, i) for k in kept):
            continue
        kept.append(i)
        if max_keep is not None and len(kept) >= max_keep:
            break
    return kept
