"""How many grad_value atomics each atomic backward mode of multi_scale_deformable_attn issues on
the benchmark inputs, counted on the CPU (no GPU, no native library): a model of the kernels'
merge rules, not a measurement.

    python -m benchmarks.msda_atomic_counts [--configs NAME ...] [--batch N]

Every atomic of a group covers the group's whole channel slice (head_dim floats), so the ratio
of atomics is the ratio of L2 RED sectors. Modes (csrc/attention/ms_deform_attn_musa.mu):
- 0: one atomic per valid corner;
- 2: a corner that a sample shares with the next sample of its group is carried forward, so
  a group issues the corners of sample s that sample s + 1 does not share;
- 3 / 4: the walk groups of a warp segment (8 groups of 4 lanes for head_dim 32) are
  consecutive queries of one (batch, head); per 4-sample chunk, one atomic per distinct
  (batch, head, pixel) that the segment's samples touch;
- whole-walk: distinct pixels over the segment's whole walk (the bound for any merging inside a
  warp).
"""

from __future__ import annotations

import argparse

import torch

from mu_space.testing import msda_inputs


def corner_keys(cfg: msda_inputs.MSDAConfig, loc: torch.Tensor) -> torch.Tensor:
    """int64 [groups in walk order (b, h, q), levels * points, 4]: (b * heads + h) * K + pixel of
    every valid corner, -1 for corners outside the level or samples not taken. The pixel
    coordinate is rounded to float32 as in the kernels."""
    b, q, nh, nl, npt = cfg.batch, cfg.queries, cfg.heads, len(cfg.levels), cfg.points
    keys = torch.full((b, q, nh, nl, npt, 4), -1, dtype=torch.int64)
    start = 0
    for l, (h, w) in enumerate(cfg.levels):
        x = (loc[:, :, :, l, :, 0].double() * w - 0.5).float()
        y = (loc[:, :, :, l, :, 1].double() * h - 0.5).float()
        inside = (y > -1) & (x > -1) & (y < h) & (x < w)
        y0 = torch.where(inside, y.floor(), torch.full_like(y, -2)).long()
        x0 = torch.where(inside, x.floor(), torch.full_like(x, -2)).long()
        for c in range(4):
            cy, cx = y0 + (c >> 1), x0 + (c & 1)
            ok = (cy >= 0) & (cy < h) & (cx >= 0) & (cx < w)
            keys[:, :, :, l, :, c] = torch.where(ok, start + cy * w + cx, torch.full_like(cy, -1))
        start += h * w
    bh = torch.arange(b)[:, None] * nh + torch.arange(nh)[None, :]
    keys = keys.permute(0, 2, 1, 3, 4, 5).reshape(b, nh, q, nl * npt, 4)
    keys = torch.where(keys >= 0, keys + bh[:, :, None, None, None] * cfg.num_keys, keys)
    return keys.reshape(b * nh * q, nl * npt, 4)


def _distinct(k: torch.Tensor) -> int:
    """Number of distinct values >= 0 along the last dim, summed over the others."""
    s, _ = torch.sort(k, -1)
    new = torch.ones_like(s, dtype=torch.bool)
    new[..., 1:] = s[..., 1:] != s[..., :-1]
    return int((new & (s >= 0)).sum())


def counts(cfg: msda_inputs.MSDAConfig, groups_per_segment: int = 8, seed: int = 0) -> dict:
    keys = corner_keys(cfg, msda_inputs.make(cfg, seed=seed)["sampling_locations"].float())
    nxt = torch.cat([keys[:, 1:], torch.full_like(keys[:, :1], -1)], 1)
    carried = (keys[..., :, None] == nxt[..., None, :]).any(-1) & (keys >= 0)
    ng = groups_per_segment
    n = keys.shape[0] // ng * ng
    lp = keys.shape[1]
    pad = (-lp) % 4  # samples past the last chunk sit outside every level
    seg = torch.cat([keys[:n], torch.full((n, pad, 4), -1, dtype=keys.dtype)], 1)
    seg = seg.view(n // ng, ng, (lp + pad) // 4, 4, 4).permute(0, 2, 1, 3, 4)
    tail = int((keys[n:] >= 0).sum())  # groups of a last partial segment: counted unmerged
    return {
        "mode0": int((keys >= 0).sum()),
        "mode2": int(((keys >= 0) & ~carried).sum()),
        "mode3": _distinct(seg.reshape(n // ng, (lp + pad) // 4, -1)) + tail,
        "whole-walk": _distinct(seg.reshape(n // ng, -1)) + tail,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(msda_inputs.BENCHMARK_CONFIGS))
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1: CPU time)")
    args = parser.parse_args(argv)
    print("config              mode0 atomics  mode2 /mode0  mode3 /mode0  whole-walk  mode2/mode3")
    for name in args.configs:
        c = counts(msda_inputs.scaled(name, batch=args.batch))
        m0 = c["mode0"]
        print(
            f"{name:20s} {m0:13d} {c['mode2'] / m0:12.3f} {c['mode3'] / m0:13.3f}"
            f" {c['whole-walk'] / m0:11.3f} {c['mode2'] / c['mode3']:11.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
