"""`circle_nms`: CenterPoint's circle NMS (mmdet3d `circle_nms`, numba on the host upstream).
Formula, order and tie rule: the public function's docstring and docs/operators/circle_nms.md.

Native path: the family's GPU NMS (csrc/box3d/nms_musa.mu, kind kCircle: squared centre
distance <= threshold suppresses), so CenterPoint's post-processing no longer copies the
detections to the host; one synchronisation for the kept count.
"""

from __future__ import annotations

import torch

from mu_space.ops import _box3d, _opdef
from mu_space.ops.iou3d import nms_fake, nms_supports, run_nms

_UNVERIFIED = _box3d.UNVERIFIED


def _check(dets, thresh, post_max_size) -> _opdef.Checked:
    _box3d.check_float_tensor(dets, "dets")
    _box3d.check_shape(dets, "dets", (None, 3), "N, (x, y, score)")
    return _opdef.Checked(dets.device, dets.dtype, None, dets.shape[0], "dets")


def _order(dets: torch.Tensor) -> torch.Tensor:
    """mmdet3d's `scores.argsort()[::-1]`: highest score first, ties later index first (the
    reversed stable ascending sort; NaN scores first, as numpy sorts NaN last)."""
    return torch.sort(dets[:, 2], stable=True)[1].flip(0)


def circle_nms_reference(dets, thresh, post_max_size):
    _check(dets, thresh, post_max_size)
    return run_nms(dets, _order(dets), _box3d.CENTER3, _box3d.CIRCLE, thresh, post_max_size, False)


def _native(c, dets, thresh, post_max_size):
    return run_nms(dets, _order(dets), _box3d.CENTER3, _box3d.CIRCLE, thresh, post_max_size, True)


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import boxes as box_inputs

    b, s = box_inputs.detections(500, seed=9, extent=30.0)
    dets = torch.cat([b[:, :2], s[:, None]], 1).to(device)
    tied = torch.cat([b[:200, :2], box_inputs.tied_scores(200)[:, None]], 1).to(device)
    return [
        _opdef.Sample("500 centres, radius^2 4, CenterPoint's cap 83", (dets, 4.0, 83)),
        _opdef.Sample("float16, no cap", (dets.half(), 1.0, None)),
        _opdef.Sample("bfloat16, tied scores", (tied.bfloat16(), 0.5, 500)),
        _opdef.Sample("no detections", (dets[:0], 4.0, 83)),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="circle_nms",
        family="box3d",
        schema="(Tensor dets, float thresh, int? post_max_size) -> Tensor",
        check=_check,
        reference=circle_nms_reference,
        native=_native,
        fake=nms_fake,
        supports=nms_supports,
        native_dtypes=_box3d.NATIVE_DTYPES,
        entry_points=("box3d_nms",),
        samples=_samples,
        unverified=_UNVERIFIED,
        upstream="mmdet3d / CenterPoint `circle_nms`",
        patches=("mmdet3d.circle_nms", "mmdet3d.core.circle_nms"),
        models="CenterPoint (nms_type='circle', nuScenes)",
        doc="docs/operators/circle_nms.md",
    )
)


@OP.export
def circle_nms(dets, thresh, post_max_size=83, *, backend: str = "auto"):
    """mmdet3d's `circle_nms(dets, thresh, post_max_size=83)` -> Tensor[K] int64 (or a numpy
    int64 array for a numpy `dets`): CenterPoint's circle NMS.

        order = dets[:, 2] by descending score (ties: the later index first, as
                mmdet3d's `scores.argsort()[::-1]`)
        visit i in order: keep i unless a kept k has
                (x_k - x_i)^2 + (y_k - y_i)^2 <= thresh        (thresh: a SQUARED distance,
                                                               CenterPoint passes min_radius)
        return the first post_max_size kept indices

    Args:
        dets: Tensor[N, 3] (x, y, score) float32 / float16 / bfloat16 (float64: reference
            path), or a numpy array (mmdet3d passes `boxes.detach().cpu().numpy()`; computed on
            the CPU, returned as numpy).
        thresh: float; squared distances are float32 and compared exactly with the float64
            threshold (rounded down to float32 once).
        post_max_size: int >= 0 or None (no cap); default 83 as mmdet3d.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    NaN coordinates never suppress or get suppressed. mmdet3d's numba quicksort may order more
    than 16 equal scores differently from the stable rule used here.
    """
    as_numpy = False
    try:
        import numpy as np

        if isinstance(dets, np.ndarray):
            dets, as_numpy = torch.from_numpy(dets), True
    except ImportError:  # pragma: no cover
        pass
    out = OP(
        dets,
        _box3d.as_float(thresh, "thresh"),
        _box3d.as_optional_int(post_max_size, "post_max_size"),
        backend=backend,
    )
    return out.numpy() if as_numpy else out
