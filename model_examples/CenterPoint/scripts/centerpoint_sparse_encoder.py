"""CenterPoint's (and SECOND's) sparse 3-D backbone, mmdet3d's `SparseEncoder`, built from
ordinary torch modules over `mu_space.sparse` (the spconv 2.x API): forward + backward with
backend A and backend B, outputs and gradients compared, then timed.

  --config centerpoint-0075-nus (default)   centerpoint_voxel0075_second_secfpn_head-circlenms
      _8xb4-cyclic-20e_nus-3d: SparseEncoder(in_channels 5, sparse_shape [41, 1440, 1440],
      base_channels 16, output_channels 128, encoder_channels ((16, 16, 32), (32, 32, 64),
      (64, 64, 128), (128, 128)), encoder_paddings ((0, 0, 1), (0, 0, 1), (0, 0, [0, 1, 1]),
      (0, 0)), block_type 'basicblock'); ~118k voxels per nuScenes-like 10-sweep frame
      (mu_space.testing.lidar), voxelised with mu_space.voxelization (0.075 x 0.075 x 0.2 m,
      10 points, 120000 voxels), the mean of each voxel's points as its 5 features.
      Output [B, 256, 180, 180].
  --config second-kitti   hv_second_secfpn_6x8_80e_kitti-3d-3class: SparseEncoder(in_channels
      4, sparse_shape [41, 1600, 1408], defaults: encoder_channels ((16,), (32, 32, 32),
      (64, 64, 64), (64, 64, 64)), encoder_paddings ((1,), (1, 1, 1), (1, 1, 1), ((0, 1, 1),
      1, 1)), block_type 'conv_module'); a KITTI-like 64-beam frame voxelised at 0.05 x 0.05
      x 0.1 m over [0, 70.4] x [-40, 40] x [-3, 1] m, 5 points, 16000 voxels. Output
      [B, 256, 200, 176].

The layer list is mmdet3d's (mmdet3d/models/middle_encoders/sparse_encoder.py,
models/layers/sparse_block.py): conv_input = SubMConv3d(in, 16, 3, padding 1, key 'subm1') +
BN1d(eps 1e-3, momentum 0.01) + ReLU; per stage i: 'conv_module': a SparseConv3d(3, stride 2,
key f'spconv{i+1}') first (not in stage 1), then SubMConv3d(3, key f'subm{i+1}') modules;
'basicblock': SparseBasicBlocks (two SubMConv3d without an indice_key, BN, ReLU, the identity
added before the last ReLU) and, at the end of every stage but the last, SparseConv3d(3,
stride 2, key f'spconv{i+1}'); conv_out = SparseConv3d(128, 128, (3, 1, 1), stride (2, 1, 1),
key 'spconv_down2') + BN + ReLU; then dense() viewed as [N, C * D, H, W]. Convs have no bias.

    python model_examples/CenterPoint/scripts/centerpoint_sparse_encoder.py              # GPU
    python model_examples/CenterPoint/scripts/centerpoint_sparse_encoder.py --config second-kitti
    python model_examples/CenterPoint/scripts/centerpoint_sparse_encoder.py --device cpu --small

--small: the same encoder on a 16-beam, 3-sweep frame at 0.5 x 0.5 x 0.125 m ([41, 64, 64],
~1500 voxels): seconds on the CPU.

Tolerances (max-relative, _common.compare): both backends compute the same per-offset GEMMs
(float32 accumulation); what can differ is the summation order of a GEMM and of the scatter
(rounding, ~1e-7 relative per layer). Over 10-13 layers with training-mode BatchNorm that stays
below 1e-5 relative in the output (tolerance 1e-4); a ReLU whose input rounds across zero moves
single gradient entries, so the gradients are compared in the L2 norm (1e-4). On the CPU both
runs are the reference path and agree exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # model_examples/
import _common  # noqa: E402

import mu_space.sparse as spconv  # noqa: E402
from mu_space.ops.voxelization import voxelization  # noqa: E402
from mu_space.testing import lidar  # noqa: E402

ENCODERS = {
    "centerpoint-0075-nus": dict(
        in_channels=5,
        sparse_shape=[41, 1440, 1440],
        base_channels=16,
        output_channels=128,
        encoder_channels=((16, 16, 32), (32, 32, 64), (64, 64, 128), (128, 128)),
        encoder_paddings=((0, 0, 1), (0, 0, 1), (0, 0, [0, 1, 1]), (0, 0)),
        block_type="basicblock",
    ),
    "second-kitti": dict(
        in_channels=4,
        sparse_shape=[41, 1600, 1408],
        base_channels=16,
        output_channels=128,
        encoder_channels=((16,), (32, 32, 32), (64, 64, 64), (64, 64, 64)),
        encoder_paddings=((1,), (1, 1, 1), (1, 1, 1), ((0, 1, 1), 1, 1)),
        block_type="conv_module",
    ),
}
# The voxel layers (mmdet3d configs); SECOND's is not in mu_space.testing.lidar
VOXELS = {
    "centerpoint-0075-nus": lidar.VOXEL_CONFIGS["centerpoint-0075-nus"],
    "second-kitti": lidar.VoxelConfig(
        "second-kitti",
        "kitti",
        (0.05, 0.05, 0.1),
        (0.0, -40.0, -3.0, 70.4, 40.0, 1.0),
        5,
        (16000, 40000),
    ),  # fmt: skip
    "small": lidar.VoxelConfig(
        "small",
        "tiny-3sweeps",
        (0.5, 0.5, 0.125),
        (-16.0, -16.0, -3.0, 16.0, 16.0, 2.0),
        5,
        (1500, 1500),
    ),  # fmt: skip
}


def _bn(c):
    return nn.BatchNorm1d(c, eps=1e-3, momentum=0.01)


def conv_module(cin, cout, k, conv_type, indice_key, stride=1, padding=0, lib=spconv):
    """mmdet3d make_sparse_convmodule (order conv, norm, act): conv without bias, BN1d, ReLU."""
    conv = getattr(lib, conv_type)(
        cin, cout, k, stride=stride, padding=padding, bias=False, indice_key=indice_key
    )
    return lib.SparseSequential(conv, _bn(cout), nn.ReLU(inplace=True))


_BLOCKS: dict = {}


def basic_block(planes, lib=spconv):
    """mmdet3d SparseBasicBlock: SubM conv1 + BN + ReLU, SubM conv2 + BN, + identity, ReLU
    (conv_cfg SubMConv3d without an indice_key: each conv builds its own rule book). One class
    per library (`lib`: mu_space.sparse, or spconv.pytorch for the benchmark's peer), a
    subclass of that library's SparseModule so its SparseSequential passes it the tensor."""
    if lib not in _BLOCKS:

        class SparseBasicBlock(lib.SparseModule):
            def __init__(self, planes):
                super().__init__()
                self.conv1 = lib.SubMConv3d(planes, planes, 3, padding=1, bias=False)
                self.norm1 = _bn(planes)
                self.conv2 = lib.SubMConv3d(planes, planes, 3, padding=1, bias=False)
                self.norm2 = _bn(planes)
                self.relu = nn.ReLU(inplace=True)

            def forward(self, x):
                identity = x.features
                out = self.conv1(x)
                out = out.replace_feature(self.relu(self.norm1(out.features)))
                out = self.conv2(out)
                out = out.replace_feature(self.norm2(out.features) + identity)
                return out.replace_feature(self.relu(out.features))

        _BLOCKS[lib] = SparseBasicBlock
    return _BLOCKS[lib](planes)


class SparseEncoder(nn.Module):
    """mmdet3d's SparseEncoder (post-activation order) over mu_space.sparse (or `lib`, a module
    with spconv 2.x's API); forward(voxel_features [N, C], coors [N, 4] int32 (b, z, y, x)) ->
    {'spatial_features': [B, C * D, H, W]}. `backend` goes to every muSPACE sparse layer."""

    def __init__(self, cfg: dict, batch_size: int, backend: str = "auto", lib=spconv):
        super().__init__()
        self.lib = lib
        self.sparse_shape = list(cfg["sparse_shape"])
        self.batch_size = batch_size
        base = cfg["base_channels"]
        self.conv_input = conv_module(
            cfg["in_channels"], base, 3, "SubMConv3d", "subm1", padding=1, lib=lib
        )
        self.encoder_layers = lib.SparseSequential()
        cin, stages = base, cfg["encoder_channels"]
        for i, blocks in enumerate(stages):
            layers = []
            for j, cout in enumerate(blocks):
                padding = cfg["encoder_paddings"][i][j]
                strided = dict(stride=2, padding=padding, indice_key=f"spconv{i + 1}", lib=lib)
                if cfg["block_type"] == "conv_module":
                    if i != 0 and j == 0:
                        layers.append(conv_module(cin, cout, 3, "SparseConv3d", **strided))
                    else:
                        layers.append(
                            conv_module(
                                cin, cout, 3, "SubMConv3d", f"subm{i + 1}", padding=padding, lib=lib
                            )
                        )
                elif j == len(blocks) - 1 and i != len(stages) - 1:
                    layers.append(conv_module(cin, cout, 3, "SparseConv3d", **strided))
                else:
                    layers.append(basic_block(cout, lib))
                cin = cout
            self.encoder_layers.add_module(f"encoder_layer{i + 1}", lib.SparseSequential(*layers))
        self.conv_out = conv_module(
            cin,
            cfg["output_channels"],
            (3, 1, 1),
            "SparseConv3d",
            "spconv_down2",
            stride=(2, 1, 1),
            lib=lib,
        )
        for m in self.modules():
            if isinstance(m, (spconv.SparseConvolution, spconv.SparseMaxPool)):
                m.backend = backend

    def forward(self, voxel_features, coors):
        x = self.lib.SparseConvTensor(
            voxel_features, coors.int(), self.sparse_shape, self.batch_size
        )
        x = self.conv_input(x)
        for stage in self.encoder_layers:
            x = stage(x)
        dense = self.conv_out(x).dense()
        n, c, d, h, w = dense.shape
        return {"spatial_features": dense.view(n, c * d, h, w)}


def make_inputs(voxel_cfg, batch: int, device) -> dict:
    """Voxelised frames: mean of each voxel's points (HardSimpleVFE), rows (b, z, y, x)."""
    feats, coors = [], []
    for b, points in enumerate(lidar.batch(voxel_cfg.cloud, batch)):
        voxels, c, num = voxelization(
            points, list(voxel_cfg.voxel_size), list(voxel_cfg.point_cloud_range),
            voxel_cfg.max_num_points, voxel_cfg.max_voxels[0], backend="reference",
        )  # fmt: skip
        feats.append(voxels.sum(1) / num.clamp(min=1)[:, None].to(voxels.dtype))
        coors.append(torch.nn.functional.pad(c, (1, 0), value=b))
    return {
        "voxel_features": torch.cat(feats).to(device),
        "coors": torch.cat(coors).to(torch.int32).to(device),
    }


def small_config(cfg: dict) -> dict:
    """The encoder at the --small grid ([41, 64, 64]), in_channels of the tiny cloud (5)."""
    gx, gy, gz = VOXELS["small"].grid_size
    return dict(cfg, in_channels=5, sparse_shape=[gz + 1, gy, gx])


def main(argv: list[str] | None = None) -> int:
    p = _common.make_parser(__doc__.split("\n\n")[0])
    p.add_argument("--config", default="centerpoint-0075-nus", choices=sorted(ENCODERS))
    args = _common.resolve(p.parse_args(argv))
    cfg = ENCODERS[args.config]
    voxel_cfg = VOXELS["small" if args.small else args.config]
    if args.small:
        cfg = small_config(cfg)
    batch = args.batch or 1
    inputs = make_inputs(voxel_cfg, batch, args.device)
    n = inputs["voxel_features"].shape[0]
    title = (
        f"SparseEncoder ({args.config}{', --small' if args.small else ''}: B {batch}, {n} "
        f"voxels, sparse_shape {cfg['sparse_shape']}, {cfg['block_type']}, voxel "
        f"{voxel_cfg.voxel_size})"
    )
    return _common.run_ab(
        args,
        title,
        lambda backend: SparseEncoder(cfg, batch, backend),
        inputs,
        1e-4,
        1e-4,
        no_grad_inputs=("coors",),
        grad_metric="l2",
    )


if __name__ == "__main__":
    _common.entry(main)
