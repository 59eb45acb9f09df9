"""Realistic inputs for multi-scale deformable attention (BEVFormer / Deformable DETR shapes).

Sampling follows the way these models place their points at initialisation (and, roughly, after
training): every query has a reference point on a regular query grid (the BEV grid for
BEVFormer's temporal self-attention, an image-like grid for the others); each head looks in one
direction (angle 2*pi*h / heads, Deformable DETR's `grid_init`), and point p of that head sits
(p + 1) pixels from the reference point in that direction on every level, plus Gaussian noise of
`offset_noise` pixels. A fraction `outside_fraction` of the samples is pushed across the image
border (partly or wholly outside), as real offsets near the borders are. Attention weights are a
softmax over levels x points. Neighbouring queries therefore sample neighbouring pixels, which is
what gives the kernels their cache locality: uniform random locations would not.

    inputs = make("bevformer-base-sca", dtype=torch.float16, device="cuda")
    out = mu_space.ops.multi_scale_deformable_attn(*args(inputs))

Configs (name -> batch, queries, heads, head_dim, levels (h, w), points):
- bevformer-base-tsa: 2, 40000 (200 x 200 BEV), 8, 32, [(200, 200)], 4
- bevformer-base-sca: 6 (cameras), 10000, 8, 32, [(116, 200), (58, 100), (29, 50), (15, 25)], 8
- deformable-detr:    1, 15200 (100 x 152), 8, 32, [(100, 152), (50, 76), (25, 38), (13, 19)], 8
- tiny:               2, 24, 2, 8, [(6, 9), (3, 5)], 4 (CPU tests, gradcheck)
- bevformer-base-tsa-uniform: TSA's shapes, locations uniform in [0, 1)^2 (no locality)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class MSDAConfig:
    name: str
    batch: int
    queries: int
    heads: int
    head_dim: int
    levels: tuple[tuple[int, int], ...]
    points: int
    query_grid: tuple[int, int]  # (rows, cols) of the reference points; rows * cols >= queries
    offset_noise: float = 0.7  # pixels (std) added to the initial offset pattern
    outside_fraction: float = 0.02  # samples pushed across the border
    uniform: bool = False  # locations uniform in [0, 1)^2 instead (no locality: a worst case)

    @property
    def num_keys(self) -> int:
        return sum(h * w for h, w in self.levels)

    def with_(self, **changes) -> MSDAConfig:
        """A copy with fields replaced (the query grid follows a change of `queries`)."""
        cfg = replace(self, **changes)
        if "queries" in changes and "query_grid" not in changes:
            cfg = replace(cfg, query_grid=_grid_for(cfg.queries, self.query_grid))
        return cfg


def _grid_for(queries: int, like: tuple[int, int]) -> tuple[int, int]:
    """rows x cols >= queries with the aspect ratio of `like`."""
    if queries <= 0:
        return (1, 1)
    aspect = like[1] / like[0]
    rows = max(1, round(math.sqrt(queries / aspect)))
    cols = max(1, math.ceil(queries / rows))
    return (rows, cols)


CONFIGS = {
    "bevformer-base-tsa": MSDAConfig(
        "bevformer-base-tsa", 2, 40000, 8, 32, ((200, 200),), 4, (200, 200)
    ),
    "bevformer-base-sca": MSDAConfig(
        "bevformer-base-sca",
        6,
        10000,
        8,
        32,
        ((116, 200), (58, 100), (29, 50), (15, 25)),
        8,
        (100, 100),
    ),
    "deformable-detr": MSDAConfig(
        "deformable-detr",
        1,
        15200,
        8,
        32,
        ((100, 152), (50, 76), (25, 38), (13, 19)),
        8,
        (100, 152),
    ),
    "tiny": MSDAConfig("tiny", 2, 24, 2, 8, ((6, 9), (3, 5)), 4, (4, 6)),
}
# issue 13's "uniform" case: TSA's shapes with uniform random locations (neighbouring queries
# share no pixels: the gather and the grad_value atomics lose their locality)
CONFIGS["bevformer-base-tsa-uniform"] = replace(
    CONFIGS["bevformer-base-tsa"], name="bevformer-base-tsa-uniform", uniform=True
)

BENCHMARK_CONFIGS = ("bevformer-base-tsa", "bevformer-base-sca", "deformable-detr")


def scaled(
    cfg: MSDAConfig | str, *, queries: int | None = None, batch: int | None = None
) -> MSDAConfig:
    """`cfg` with another number of queries (grid of the same aspect) and/or batch, for sweeps."""
    cfg = CONFIGS[cfg] if isinstance(cfg, str) else cfg
    changes = {}
    if queries is not None:
        changes["queries"] = queries
    if batch is not None:
        changes["batch"] = batch
    cfg = cfg.with_(**changes)
    suffix = "".join(f"-{k[0]}{v}" for k, v in changes.items())
    return replace(cfg, name=cfg.name + suffix)


def level_metadata(levels, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(value_spatial_shapes int64 [L, 2], value_level_start_index int64 [L])."""
    shapes = torch.tensor(levels, dtype=torch.int64, device=device).view(-1, 2)
    sizes = shapes[:, 0] * shapes[:, 1]
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    return shapes, starts


def sampling_locations(cfg: MSDAConfig, generator: torch.Generator) -> torch.Tensor:
    """float64 [batch, queries, heads, levels, points, 2] (x, y), see the module docstring."""
    b, q, nh, nl, npt = cfg.batch, cfg.queries, cfg.heads, len(cfg.levels), cfg.points
    if cfg.uniform:
        return torch.rand(b, q, nh, nl, npt, 2, generator=generator, dtype=torch.float64)
    rows, cols = cfg.query_grid
    idx = torch.arange(q, dtype=torch.float64)
    ref = torch.stack(
        [(idx % cols + 0.5) / cols, (torch.div(idx, cols, rounding_mode="floor") + 0.5) / rows], -1
    )
    theta = torch.arange(nh, dtype=torch.float64) * (2.0 * math.pi / nh)
    direction = torch.stack([theta.cos(), theta.sin()], -1)
    direction = (
        direction / direction.abs().max(-1, keepdim=True).values
    )  # Deformable DETR grid_init
    scale = torch.arange(1, npt + 1, dtype=torch.float64)
    offsets = direction[:, None, :] * scale[None, :, None]  # pixels, [heads, points, 2]
    offsets = offsets[None, None, :, None].expand(b, q, nh, nl, npt, 2)
    offsets = offsets + cfg.offset_noise * torch.randn(
        b, q, nh, nl, npt, 2, generator=generator, dtype=torch.float64
    )
    size = torch.tensor([[w, h] for h, w in cfg.levels], dtype=torch.float64)  # (x, y) normaliser
    loc = ref[None, :, None, None, None, :] + offsets / size[None, None, None, :, None, :]
    if cfg.outside_fraction > 0 and loc.numel():
        pick = (
            torch.rand(loc.shape[:-1], generator=generator, dtype=torch.float64)
            < cfg.outside_fraction
        )
        axis = torch.rand(loc.shape[:-1], generator=generator) < 0.5  # push x or y
        side = torch.rand(loc.shape[:-1], generator=generator) < 0.5  # before 0 or after 1
        depth = 0.08 * torch.rand(loc.shape[:-1], generator=generator, dtype=torch.float64)
        pushed = torch.where(side, -depth, 1.0 + depth)
        loc[..., 0] = torch.where(pick & axis, pushed, loc[..., 0])
        loc[..., 1] = torch.where(pick & ~axis, pushed, loc[..., 1])
    return loc


def make(
    cfg_or_name: MSDAConfig | str,
    *,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
    requires_grad: bool = False,
) -> dict:
    """Everything one call needs: value, value_spatial_shapes, value_level_start_index,
    sampling_locations, attention_weights (float tensors in `dtype`, index tensors int64, all on
    `device`), plus the config."""
    cfg = CONFIGS[cfg_or_name] if isinstance(cfg_or_name, str) else cfg_or_name
    g = torch.Generator().manual_seed(seed)
    b, q, nh, nl, npt = cfg.batch, cfg.queries, cfg.heads, len(cfg.levels), cfg.points
    value = torch.randn(b, cfg.num_keys, nh, cfg.head_dim, generator=g)
    loc = sampling_locations(cfg, g)
    logits = torch.randn(b, q, nh, nl * npt, generator=g)
    attn = torch.softmax(logits, -1).view(b, q, nh, nl, npt)
    shapes, starts = level_metadata(cfg.levels, device)
    out = {
        "config": cfg,
        "value": value.to(device=device, dtype=dtype),
        "value_spatial_shapes": shapes,
        "value_level_start_index": starts,
        "sampling_locations": loc.to(device=device, dtype=dtype),
        "attention_weights": attn.to(device=device, dtype=dtype),
    }
    if requires_grad:
        for k in ("value", "sampling_locations", "attention_weights"):
            out[k].requires_grad_(True)
    return out


def args(inputs: dict) -> tuple:
    """The five tensors in mmcv's argument order."""
    return (
        inputs["value"],
        inputs["value_spatial_shapes"],
        inputs["value_level_start_index"],
        inputs["sampling_locations"],
        inputs["attention_weights"],
    )


def nudge_off_pixel_edges(
    sampling_locations: torch.Tensor, spatial_shapes, margin: float = 2e-3
) -> torch.Tensor:
    """Moves every sample whose pixel coordinate (loc * size - 0.5) lies within `margin` of an
    integer by 2 * margin pixels. grad_sampling_locations jumps across pixel edges, so two correct
    implementations that round the coordinate differently by one ulp can disagree there; tests
    that compare that gradient use nudged locations."""
    levels = [tuple(int(v) for v in hw) for hw in torch.as_tensor(spatial_shapes).tolist()]
    loc = sampling_locations.detach().clone()
    size = torch.tensor([[w, h] for h, w in levels], dtype=torch.float64, device=loc.device)
    size = size.view(1, 1, 1, -1, 1, 2)
    pix = loc.double() * size - 0.5
    frac = pix - pix.floor()
    near = (frac < margin) | (frac > 1.0 - margin)
    pix = torch.where(near, pix + 2.0 * margin, pix)
    return ((pix + 0.5) / size).to(loc.dtype)
