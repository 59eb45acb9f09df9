"""BEVFormer-base hot path: one encoder layer (temporal self-attention, spatial cross-attention,
FFN; BEVFormer `projects/mmdet3d_plugin/bevformer/modules/{temporal_self_attention,
spatial_cross_attention,encoder}.py`), built from ordinary torch.nn modules, with muSPACE's
`multi_scale_deformable_attn` (mmcv `MultiScaleDeformableAttnFunction` order).

    BEV queries [bs, 200*200, 256], previous BEV [bs, 40000, 256], 6 cameras' 4-level image
    features [bs*6, 116*200 + 58*100 + 29*50 + 15*25, 256]
      -> temporal self-attention: value = value_proj([prev_bev; query]) as 2 BEV queues,
         offsets / weights = Linear([prev_bev, query]) (8 heads, 1 level, 4 points per queue),
         MSDA with batch bs*2 on the 200x200 BEV, mean of the 2 queues, output_proj, residual
      -> LayerNorm
      -> spatial cross-attention: each camera's hit BEV queries re-batched to [bs*6, max_len,
         256] (BEVFormer's bev_mask / queries_rebatch), offsets around 4 pillar anchors
         (8 heads, 4 levels, 8 points = 2 per anchor), MSDA with batch bs*6, scattered back,
         averaged over the cameras that see the query, output_proj, residual
      -> LayerNorm -> FFN (256 -> 512 -> 256) + residual -> LayerNorm

The camera geometry (which BEV pillars each camera sees, and where) is projected through the
six nuScenes-like cameras of mu_space.testing.bev_geometry's rig (bev_geometry.CAMERAS) at 1600x900. The same weights and
inputs run with backend A (default native) and backend B (default reference); outputs and
gradients (query, prev_bev, image features and every parameter) are compared, then forward +
backward is timed for both. Exit status 0 = agree, 1 = mismatch.

    python model_examples/BEVFormer/scripts/bevformer_encoder_layer.py               # GPU, upstream shapes
    python model_examples/BEVFormer/scripts/bevformer_encoder_layer.py --device cpu --small

Checks (see _common):
- module output, max |a - b| <= 2e-5 * max |b|: float32; each MSDA output is a weighted sum of
  4-32 bilinear samples whose terms the native kernel adds in another order (~1e-7 relative),
  then LayerNorm rescales.
- module gradients, ||a - b||_2 <= GRAD_L2_TOL * ||b||_2 (L2, not max): the ~1e-7 forward
  differences move a few of the 20 M FFN pre-activations across ReLU's kink and a few SCA
  sampling locations across a pixel edge (bilinear cell choice), so those elements' gradients
  differ by O(1) between two correct backends. Calibrated with the reference against itself,
  inputs perturbed by ~1 float32 ulp: L2-relative at most 5.5e-4 (the measurements are in
  model_examples/BEVFormer/README.md, "Validation"). GRAD_L2_TOL = 3e-3 leaves a 5x margin; an
  indexing error or a missing term gives O(1).
- every MSDA call of run A (TSA and SCA), re-run with both backends on its recorded inputs
  (sampling locations nudged 2e-3 px off pixel edges) and the gradient it received in the
  module: output max-relative <= 2e-5, gradients of value / sampling_locations /
  attention_weights max-relative <= 2e-4 (float32 atomics in grad_value, sums over up to ~10^5
  samples). This is the tight, per-op native-vs-reference check.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # model_examples/
import _common  # noqa: E402

import mu_space  # noqa: E402
from mu_space.testing import bev_geometry  # noqa: E402
from mu_space.testing.msda_inputs import nudge_off_pixel_edges  # noqa: E402

OUT_TOL = 2e-5
GRAD_OP_TOL = 2e-4  # per-op re-run (max-relative)
GRAD_L2_TOL = 3e-3  # module gradients (L2-relative); calibration in the module docstring


def _nudged(args: tuple) -> tuple:
    value, shapes, starts, loc, weights = args
    return value, shapes, starts, nudge_off_pixel_edges(loc, shapes), weights


OP_CHECKS = {"multi_scale_deformable_attn": _common.OpCheck(OUT_TOL, GRAD_OP_TOL, _nudged)}


@dataclass(frozen=True)
class Config:
    name: str
    embed: int = 256
    heads: int = 8
    ffn: int = 512
    bev_hw: tuple[int, int] = (200, 200)
    levels: tuple[tuple[int, int], ...] = ((116, 200), (58, 100), (29, 50), (15, 25))
    tsa_points: int = 4
    sca_points: int = 8
    z_anchors: int = 4
    cameras: int = 6
    pc_range: tuple[float, ...] = (-51.2, -51.2, -5.0, 51.2, 51.2, 3.0)
    image_hw: tuple[int, int] = (900, 1600)


BASE = Config("bevformer-base")
SMALL = Config(
    "small", embed=32, heads=4, ffn=64, bev_hw=(12, 12), levels=((8, 12), (4, 6), (2, 3), (1, 2))
)


def _levels(cfg: Config, device) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = torch.tensor(cfg.levels, dtype=torch.int64, device=device)
    sizes = shapes[:, 0] * shapes[:, 1]
    return shapes, sizes.cumsum(0) - sizes


def camera_hits(cfg: Config):
    """Project the BEV pillars (z_anchors heights per cell) into the six cameras.

    Returns gather_idx [N, max_len] (query index per re-batched slot, 0 in padding), slot_mask
    [N, max_len] (1 real / 0 padding), ref_cam [N, max_len, Z, 2] (normalised image x, y of each
    anchor; anchors behind the camera get -1, i.e. outside, as BEVFormer masks them) and count
    [Q] (cameras that see each query, at least 1)."""
    bh, bw = cfg.bev_hw
    x0, y0, z0, x1, y1, z1 = cfg.pc_range
    ys = y0 + (torch.arange(bh, dtype=torch.float64) + 0.5) * (y1 - y0) / bh
    xs = x0 + (torch.arange(bw, dtype=torch.float64) + 0.5) * (x1 - x0) / bw
    zs = z0 + (torch.arange(cfg.z_anchors, dtype=torch.float64) + 0.5) * (z1 - z0) / cfg.z_anchors
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    pts = torch.stack(
        [
            xx[..., None].expand(-1, -1, len(zs)),
            yy[..., None].expand(-1, -1, len(zs)),
            zs.expand(bh, bw, -1),
        ],
        -1,
    ).view(bh * bw, len(zs), 3)
    h_img, w_img = cfg.image_hw
    idx, refs = [], []
    for yaw, cx, cy, focal in bev_geometry.CAMERAS[: cfg.cameras]:
        ext = bev_geometry.camera_to_ego(yaw, cx, cy)
        inv = torch.linalg.inv(ext)
        cam = pts @ inv[:3, :3].T + inv[:3, 3]  # camera frame, z forward
        f = 1266.0 * focal
        depth = cam[..., 2]
        front = depth > 0.1
        d = depth.clamp(min=0.1)
        u = (f * cam[..., 0] / d + w_img / 2.0) / w_img
        v = (f * cam[..., 1] / d + h_img / 2.0) / h_img
        inside = front & (u > 0) & (u < 1) & (v > 0) & (v < 1)
        hit = inside.any(dim=1)
        ref = torch.stack([u, v], -1)
        ref[~front] = -1.0
        idx.append(hit.nonzero().flatten())
        refs.append(ref[hit])
    max_len = max(1, max(len(i) for i in idx))
    n = cfg.cameras
    gather_idx = torch.zeros(n, max_len, dtype=torch.int64)
    slot_mask = torch.zeros(n, max_len)
    ref_cam = torch.full((n, max_len, cfg.z_anchors, 2), -1.0, dtype=torch.float64)
    count = torch.zeros(bh * bw)
    for c, (i, r) in enumerate(zip(idx, refs)):
        gather_idx[c, : len(i)] = i
        slot_mask[c, : len(i)] = 1.0
        ref_cam[c, : len(i)] = r
        count[i] += 1.0
    return gather_idx, slot_mask, ref_cam.float(), count.clamp(min=1.0)


def _init_offsets(linear: nn.Linear, heads: int, groups: int, points: int) -> None:
    """Deformable-DETR-style start: head h looks along angle 2*pi*h/heads, point p sits p + 1
    pixels out; small random weights on top (so the offsets depend on the query)."""
    theta = torch.arange(heads, dtype=torch.float32) * (2.0 * math.pi / heads)
    grid = torch.stack([theta.cos(), theta.sin()], -1)
    grid = grid / grid.abs().max(-1, keepdim=True).values
    grid = grid[:, None, None, :].repeat(1, groups, points, 1)
    grid = grid * torch.arange(1, points + 1, dtype=torch.float32)[None, None, :, None]
    with torch.no_grad():
        linear.bias.copy_(grid.flatten().repeat(linear.bias.numel() // grid.numel()))
        linear.weight.mul_(0.5)


class TemporalSelfAttention(nn.Module):
    QUEUE = 2  # previous BEV + current queries

    def __init__(self, cfg: Config, backend: str):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        d, h, p, q = cfg.embed, cfg.heads, cfg.tsa_points, self.QUEUE
        self.sampling_offsets = nn.Linear(d * q, q * h * p * 2)
        self.attention_weights = nn.Linear(d * q, q * h * p)
        self.value_proj = nn.Linear(d, d)
        self.output_proj = nn.Linear(d, d)
        _init_offsets(self.sampling_offsets, h, q, p)
        bh, bw = cfg.bev_hw
        ys, xs = torch.meshgrid(
            (torch.arange(bh) + 0.5) / bh, (torch.arange(bw) + 0.5) / bw, indexing="ij"
        )
        self.register_buffer("ref_2d", torch.stack([xs, ys], -1).view(-1, 2), persistent=False)
        self.register_buffer(
            "shapes", torch.tensor([[bh, bw]], dtype=torch.int64), persistent=False
        )
        self.register_buffer("starts", torch.zeros(1, dtype=torch.int64), persistent=False)
        self.register_buffer(
            "normalizer", torch.tensor([bw, bh], dtype=torch.float32), persistent=False
        )

    def forward(self, query: torch.Tensor, prev_bev: torch.Tensor) -> torch.Tensor:
        bs, nq, d = query.shape
        h, p, q = self.cfg.heads, self.cfg.tsa_points, self.QUEUE
        value = self.value_proj(torch.stack([prev_bev, query], 1).reshape(bs * q, nq, d))
        value = value.view(bs * q, nq, h, d // h)
        qcat = torch.cat([prev_bev, query], -1)
        off = self.sampling_offsets(qcat).view(bs, nq, h, q, 1, p, 2)
        off = off.permute(0, 3, 1, 2, 4, 5, 6).reshape(bs * q, nq, h, 1, p, 2)
        aw = self.attention_weights(qcat).view(bs, nq, h, q, p).softmax(-1)
        aw = aw.permute(0, 3, 1, 2, 4).reshape(bs * q, nq, h, 1, p)
        loc = self.ref_2d[None, :, None, None, None, :] + off / self.normalizer
        out = mu_space.multi_scale_deformable_attn(
            value, self.shapes, self.starts, loc, aw, backend=self.backend
        )  # [bs*2, Q, d]
        out = out.view(bs, q, nq, d).mean(1)
        return self.output_proj(out) + query


class SpatialCrossAttention(nn.Module):
    def __init__(self, cfg: Config, backend: str):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        d, h, lv, p = cfg.embed, cfg.heads, len(cfg.levels), cfg.sca_points
        self.sampling_offsets = nn.Linear(d, h * lv * p * 2)
        self.attention_weights = nn.Linear(d, h * lv * p)
        self.value_proj = nn.Linear(d, d)
        self.output_proj = nn.Linear(d, d)
        _init_offsets(self.sampling_offsets, h, lv, p // cfg.z_anchors)
        gather_idx, slot_mask, ref_cam, count = camera_hits(cfg)
        self.register_buffer("gather_idx", gather_idx, persistent=False)
        self.register_buffer("slot_mask", slot_mask, persistent=False)
        self.register_buffer("ref_cam", ref_cam, persistent=False)
        self.register_buffer("count", count, persistent=False)
        shapes, starts = _levels(cfg, "cpu")
        self.register_buffer("shapes", shapes, persistent=False)
        self.register_buffer("starts", starts, persistent=False)
        self.register_buffer("normalizer", shapes.flip(-1).float(), persistent=False)  # (w, h)

    @property
    def max_len(self) -> int:
        return self.gather_idx.shape[1]

    def forward(self, query: torch.Tensor, img_feats: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bs, nq, d = query.shape
        n, ml, h, lv, p, z = (
            cfg.cameras,
            self.max_len,
            cfg.heads,
            len(cfg.levels),
            cfg.sca_points,
            cfg.z_anchors,
        )
        mask = self.slot_mask[None, :, :, None]
        q = (query[:, self.gather_idx] * mask).view(bs * n, ml, d)  # queries_rebatch
        value = self.value_proj(img_feats).view(bs * n, -1, h, d // h)
        off = self.sampling_offsets(q).view(bs * n, ml, h, lv, p, 2)
        off = off / self.normalizer[None, None, None, :, None, :]
        off = off.view(bs * n, ml, h, lv, p // z, z, 2)
        ref = self.ref_cam.repeat(bs, 1, 1, 1).view(bs * n, ml, 1, 1, 1, z, 2)
        loc = (ref + off).view(bs * n, ml, h, lv, p, 2)
        aw = self.attention_weights(q).view(bs * n, ml, h, lv * p).softmax(-1)
        aw = aw.view(bs * n, ml, h, lv, p)
        out = mu_space.multi_scale_deformable_attn(
            value, self.shapes, self.starts, loc, aw, backend=self.backend
        )  # [bs*N, max_len, d]
        out = out.view(bs, n * ml, d) * self.slot_mask.view(1, n * ml, 1)
        slots = query.new_zeros(bs, nq, d).index_add(1, self.gather_idx.flatten(), out)
        slots = slots / self.count[None, :, None]
        return self.output_proj(slots) + query


class EncoderLayer(nn.Module):
    """('self_attn', 'norm', 'cross_attn', 'norm', 'ffn', 'norm'), as BEVFormer's encoder."""

    def __init__(self, cfg: Config, backend: str = "auto"):
        super().__init__()
        self.tsa = TemporalSelfAttention(cfg, backend)
        self.sca = SpatialCrossAttention(cfg, backend)
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.embed) for _ in range(3))
        self.ffn = nn.Sequential(
            nn.Linear(cfg.embed, cfg.ffn), nn.ReLU(inplace=True), nn.Linear(cfg.ffn, cfg.embed)
        )

    def forward(self, query, prev_bev, img_feats) -> dict[str, torch.Tensor]:
        x = self.norms[0](self.tsa(query, prev_bev))
        x = self.norms[1](self.sca(x, img_feats))
        x = self.norms[2](self.ffn(x) + x)
        return {"bev": x}


def make_inputs(cfg: Config, batch: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    nq = cfg.bev_hw[0] * cfg.bev_hw[1]
    keys = sum(h * w for h, w in cfg.levels)
    return {
        "query": torch.randn(batch, nq, cfg.embed, generator=g).to(device),
        "prev_bev": torch.randn(batch, nq, cfg.embed, generator=g).to(device),
        "img_feats": torch.randn(batch * cfg.cameras, keys, cfg.embed, generator=g).to(device),
    }


def main(argv: list[str] | None = None) -> int:
    p = _common.make_parser(__doc__.split("\n\n")[0])
    args = _common.resolve(p.parse_args(argv))
    cfg = SMALL if args.small else BASE
    batch = args.batch or 1
    inputs = make_inputs(cfg, batch, args.device, args.seed)
    hits = camera_hits(cfg)[1].sum(1).long().tolist()
    title = (
        f"BEVFormer encoder layer ({cfg.name}: bs {batch}, BEV {cfg.bev_hw}, embed "
        f"{cfg.embed}, heads {cfg.heads}, levels {list(cfg.levels)}, TSA points "
        f"{cfg.tsa_points} x 2 queues, SCA points {cfg.sca_points} over {cfg.z_anchors} "
        f"anchors)\nBEV queries seen per camera: {hits} (max_len {max(hits)})"
    )
    return _common.run_ab(
        args,
        title,
        lambda backend: EncoderLayer(cfg, backend),
        inputs,
        OUT_TOL,
        GRAD_L2_TOL,
        grad_metric="l2",
        op_checks=OP_CHECKS,
    )


if __name__ == "__main__":
    _common.entry(main)
