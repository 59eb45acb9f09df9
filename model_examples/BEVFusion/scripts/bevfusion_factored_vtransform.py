"""BEVFusion camera vtransform without the depth x context product: the same LSS pooling as
BEVFusion's `BaseTransform.bev_pool`, computed from the factors (`bev_pool_v2`'s formulation)
instead of the materialised `[B, N, D, H, W, C]` tensor.

Upstream (`projects/BEVFusion/bevfusion/depth_lss.py`) lifts `x = depth (outer) context`
(6 x 118 x 32 x 88 x 80 values = 638 MB in float32 at the nuScenes shapes, plus the same again
for its gradient) and then sums its rows per BEV cell. The sum factors:

    bev[b, c, z, x, y] = sum over frustum points p in cell (b, z, x, y) of depth[p] * context[ray(p), c]

so `mu_space.bev_pool_prepare` (the cells, truncation `((geom - lower) / interval).long()` and
the in-grid filter exactly as BEVFusion writes them) + `mu_space.bev_pool_v2` (depth [B, N, D,
H, W], context channels-last [B, N, H, W, C]) give the same output without the product. BEVFusion's
output is x-major ([B, C, Z, X, Y]) and bev_pool_v2's is y-major ([B, C, Z, Y, X]): the x and y
columns of the geometry and grid are swapped before `bev_pool_prepare`, which makes bev_pool_v2
write BEVFusion's layout directly.

Both variants run with the same weights, inputs and muSPACE backend: "materialised" is the
upstream formulation (`bevfusion_vtransform.LSSVTransform`: product, filter, `mu_space.bev_pool`),
"factored" this one. Outputs and gradients (img_feat and the depthnet) are compared, then forward
+ backward is timed and, on a GPU, the peak memory of one step is measured for each.

    python model_examples/BEVFusion/scripts/bevfusion_factored_vtransform.py            # GPU, nuScenes shapes
    python model_examples/BEVFusion/scripts/bevfusion_factored_vtransform.py --device cpu --small

Tolerances (max |a - b| <= tol * max |b| per tensor, _common.compare): output 1e-5 (float32;
each cell sums the same products, formed in another order: depth * context rounded once in both,
summed in ascending point order by both kernels but over differently ordered point lists);
gradients 1e-4 (as in bevfusion_vtransform.py: the softmax backward and the 1x1 conv's sums
amplify the forward's rounding; a wrong index gives O(1) errors).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # model_examples/
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import bevfusion_vtransform as upstream_form  # noqa: E402

from mu_space.patcher.patches import factored_lss_pool  # noqa: E402

OUT_TOL = 1e-5
GRAD_TOL = 1e-4


class FactoredLSSVTransform(upstream_form.LSSVTransform):
    """The same depthnet and grid; pools depth and context with bev_pool_v2, never their product."""

    def forward(self, img_feat: torch.Tensor, geom: torch.Tensor) -> dict[str, torch.Tensor]:
        b, n = geom.shape[:2]
        h, w = img_feat.shape[-2:]
        x = self.depthnet(img_feat)
        depth = x[:, : self.D].softmax(dim=1).view(b, n, self.D, h, w)
        context = x[:, self.D : self.D + self.C].permute(0, 2, 3, 1).reshape(b, n, h, w, self.C)
        bev = factored_lss_pool(  # what the bevfusion.factored_lss.* patches run in the model
            depth,
            context,
            geom,
            self.lower,
            self.interval,
            self.cfg.grid_size,
            backend=self.backend,
        )
        return {"bev": bev}


def peak_step_bytes(module, inputs, weights, device) -> int | None:
    """Peak GPU memory of one forward + backward above what was allocated before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _common.forward_backward(module, inputs, weights, False, ("geom",))
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def main(argv: list[str] | None = None) -> int:
    p = _common.make_parser(__doc__.split("\n\n")[0])
    args = _common.resolve(p.parse_args(argv))
    dev = args.device
    backend = args.backend_a
    cfg = upstream_form.config(args.small, args.batch or 1)
    in_ch = upstream_form.SMALL_IN_CHANNELS if args.small else upstream_form.IN_CHANNELS
    inputs = upstream_form.make_inputs(cfg, in_ch, dev, args.seed)
    print(
        f"BEVFusion LSS vtransform, factored vs materialised ({cfg.name}: B {cfg.batch}, "
        f"N {cfg.cameras}, D {cfg.n_depth}, C {cfg.channels}, features {cfg.feature_hw}, grid "
        f"{cfg.grid_size}); device {dev}, muSPACE backend {backend}, torch {torch.__version__}"
    )
    modules = {}
    for label, cls in (
        ("factored", FactoredLSSVTransform),
        ("materialised", upstream_form.LSSVTransform),
    ):
        torch.manual_seed(args.seed)  # identical weights
        modules[label] = cls(cfg, in_ch, backend).to(dev)
    with torch.no_grad():
        probe = modules["materialised"](**inputs)
    g = torch.Generator().manual_seed(args.seed + 1)
    weights = {k: torch.randn(v.shape, generator=g).to(dev) for k, v in probe.items()}
    del probe
    results = {
        k: _common.forward_backward(m, inputs, weights, True, ("geom",)) for k, m in modules.items()
    }
    print("factored vs materialised (bound: max|a-b| <= tol * max|b|):")
    ok = _common.check(results["factored"], results["materialised"], OUT_TOL, GRAD_TOL)
    del results

    h, w = cfg.feature_hw
    rays = cfg.batch * cfg.cameras * h * w
    product = rays * cfg.n_depth * cfg.channels * 4
    factors = rays * (cfg.n_depth + cfg.channels) * 4
    print(
        f"lifted tensor: product {product / 2**20:.1f} MiB vs factors {factors / 2**20:.1f} MiB "
        f"(float32, forward; the backward holds a gradient of each)"
    )
    ms, peak = {}, {}
    for label, m in modules.items():
        peak[label] = peak_step_bytes(m, inputs, weights, dev)
        ms[label] = _common.time_step(
            lambda m=m: _common.forward_backward(m, inputs, weights, False, ("geom",)),
            dev,
            args.warmup,
            args.reps,
        )
    clock = "CUDA events" if dev.type == "cuda" else "perf_counter"
    print(f"forward + backward, median of {args.reps} ({clock}):")
    for label in modules:
        mem = "" if peak[label] is None else f", peak {peak[label] / 2**20:.1f} MiB above inputs"
        print(f"  {label:13s} {ms[label]:9.3f} ms{mem}")
    print(f"  factored speedup: {ms['materialised'] / ms['factored']:.2f}x", end="")
    if peak["factored"]:
        print(f", peak memory {peak['materialised'] / peak['factored']:.2f}x less", end="")
    print()
    print("PASS" if ok else "FAIL: factored and materialised disagree beyond the tolerances")
    return 0 if ok else 1


if __name__ == "__main__":
    _common.entry(main)
