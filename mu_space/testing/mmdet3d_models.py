"""mmdet3d 1.4's own PointPillars (nuScenes, SECFPN) and CenterPoint (voxel 0.075, nuScenes),
built from the configs shipped in the installed mmdet3d wheel, on mmcv-lite with muSPACE serving
`mmcv._ext`, and fed synthetic spinning-LiDAR frames (`mu_space.testing.lidar`) with the scene's
cars and pedestrians as ground truth. Shared by tests/compat/test_mmdet3d_models.py and the
model-example runner model_examples/_mmdet3d_run.py.

    from mu_space.testing import mmdet3d_models as m3d

    m3d.setup()                                  # the surrogate, then mmdet3d's registries
    model = m3d.build("pointpillars")            # seeded weights, score_thr 0
    data = m3d.batch("pointpillars", "nus-1sweep", frames=1)
    batch = model.data_preprocessor(data, training=True)
    loss, log = model.parse_losses(model(**batch, mode="loss"))

Needs `pip install -e ".[mmdet3d]"` and the four OpenMMLab packages (README); `missing()` says
what is absent.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import torch

from mu_space.testing import lidar

NUS_CLASSES = 10  # car = 0, pedestrian = 8


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One upstream model: its config inside the wheel (`mmdet3d/.mim/configs/...`) and the
    point features its data preprocessor takes (PointPillars nuScenes: x, y, z, intensity;
    CenterPoint: + the sweep's time lag)."""

    name: str
    config: str
    features: int


MODELS = {
    "pointpillars": ModelSpec(
        "pointpillars", "pointpillars/pointpillars_hv_secfpn_sbn-all_8xb4-2x_nus-3d.py", 4
    ),
    "centerpoint": ModelSpec(
        "centerpoint",
        "centerpoint/centerpoint_voxel0075_second_secfpn_8xb4-cyclic-20e_nus-3d.py",
        5,
    ),
}
POINTPILLARS = MODELS["pointpillars"].config
CENTERPOINT = MODELS["centerpoint"].config


def missing() -> str | None:
    """Why these models cannot be built here (None: they can)."""
    for name in ("mmengine", "mmcv", "mmdet", "mmdet3d"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed: pip install -e '.[mmdet3d]' (README, mmdet3d)"
    return None


def setup(backend: str = "auto"):
    """Install the mmcv._ext surrogate with `backend` (before mmcv.ops is imported), import
    mmdet3d.models (registers the models) and make mmdet3d the default scope. Not through
    register_all_modules(), which also imports the nuScenes / Lyft dataset SDKs the models do
    not need. Returns the surrogate's report; call again to change the backend."""
    from mu_space.compat import mmcv as compat

    report = compat.install(backend=backend)
    import mmdet3d.models  # noqa: F401  (imports mmcv.ops: served by the surrogate)
    from mmengine.registry import init_default_scope

    init_default_scope("mmdet3d")
    return report


def config(path: str):
    """An mmengine Config from the configs inside the installed mmdet3d wheel."""
    import mmdet3d
    from mmengine.config import Config

    return Config.fromfile(str(Path(mmdet3d.__file__).parent / ".mim" / "configs" / path))


def _spec(model: str | ModelSpec) -> ModelSpec:
    return MODELS[model] if isinstance(model, str) else model


def build(model: str | ModelSpec, seed: int = 0, score_thr: float = 0.0, nms_pre: int = 0):
    """(model, cfg): MODELS.build of the config with weights from `seed` (init_weights). An
    untrained head scores every anchor ~0.01 (PointPillars) or ~0.1 (CenterPoint): the score
    threshold (`score_thr`, CenterPoint's `score_threshold`) set to `score_thr` keeps them, so
    predict runs the NMS. nms_pre > 0: at most that many boxes enter the NMS (`nms_pre`,
    CenterPoint's `pre_max_size`; the configs' 1000 makes the CPU reference NMS slow)."""
    from mmdet3d.registry import MODELS as REGISTRY

    cfg = config(_spec(model).config)
    test_cfg = cfg.model.test_cfg.get("pts", cfg.model.test_cfg)
    test_cfg["score_thr"] = score_thr
    if "score_threshold" in test_cfg:  # CenterPoint's bbox coder reads this name
        test_cfg["score_threshold"] = score_thr
    if nms_pre > 0:
        test_cfg["pre_max_size" if "pre_max_size" in test_cfg else "nms_pre"] = nms_pre
    torch.manual_seed(seed)
    net = REGISTRY.build(cfg.model)
    net.init_weights()
    return net, cfg


def _cloud(cfg, cache: Path | None) -> torch.Tensor:
    """lidar.make(cfg), through a file in `cache` when given: a 10-sweep frame takes seconds of
    ray casting on the CPU, and the two models' processes use the same frames."""
    if cache is None:
        return lidar.make(cfg)
    path = Path(cache) / f"{cfg.name}-seed{cfg.seed}.pt"
    if path.exists():
        return torch.load(path)
    cloud = lidar.make(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(cloud, tmp)
    os.replace(tmp, path)
    return cloud


def frame(cloud: str, features: int, seed: int = 0, cache: Path | None = None):
    """(points [N, features], Det3DDataSample with the scene's cars and pedestrians as ground
    truth: 9-value nuScenes boxes, z at the bottom, in the sensor frame). `cache`: a folder
    keeping the generated clouds between processes."""
    from mmdet3d.structures import Det3DDataSample, LiDARInstance3DBoxes
    from mmengine.structures import InstanceData

    cfg = dataclasses.replace(lidar.CLOUDS[cloud], seed=seed)
    points = _cloud(cfg, cache)[:, :features].clone()
    scene = lidar._scene(cfg).boxes.float()
    height = lidar.RIGS[cfg.rig].height
    objects = scene[(scene[:, 3] < 6) & (scene[:, 5] < 2.5) & (scene[:, :2].abs() < 45).all(1)]
    bottom = objects[:, 2] - objects[:, 5] / 2 - height
    boxes = torch.cat(
        [objects[:, :2], bottom[:, None], objects[:, 3:7], torch.zeros(len(objects), 2)], 1
    )
    sample = Det3DDataSample()
    gt = InstanceData()
    gt.bboxes_3d = LiDARInstance3DBoxes(boxes, box_dim=9)
    gt.labels_3d = torch.where(objects[:, 3] > 2, 0, 8)
    sample.gt_instances_3d = gt
    sample.set_metainfo({"box_type_3d": LiDARInstance3DBoxes, "sample_idx": seed})
    return points, sample


def batch(
    model: str | ModelSpec, cloud: str, frames: int = 1, device=None, cache: Path | None = None
) -> dict:
    """The data dict a dataloader gives the model's data preprocessor: `frames` frames of
    `cloud` (seeds 0..frames-1, different scenes), on `device` when given (the preprocessor
    then has nothing to copy); `cache` as for `frame`."""
    spec = _spec(model)
    points, samples = [], []
    for seed in range(frames):
        p, s = frame(cloud, spec.features, seed, cache)
        if device is not None:
            p, s = p.to(device), s.to(device)
        points.append(p)
        samples.append(s)
    return {"inputs": {"points": points}, "data_samples": samples}
