"""mmdet3d 1.4's own PointPillars / CenterPoint on mmcv-lite with muSPACE serving `mmcv._ext`:
muSPACE's kernels against the reference backend on the same weights and inputs, a short
training run, and the time per training step and per predict (issue 14, item 3).

    PYTHONPATH=$PWD MUSPACE_TRY_UNVERIFIED=1 python model_examples/_mmdet3d_run.py \\
        --model pointpillars --out gpu-out/mmdet3d            # GPU: the figures
    PYTHONPATH=$PWD python model_examples/_mmdet3d_run.py --model pointpillars --smoke
                                                              # CPU: every stage, tiny counts

(model_examples/PointPillars/scripts/pointpillars_mmdet3d.py and
model_examples/CenterPoint/scripts/centerpoint_mmdet3d.py are this with --model set.)

The model comes from the config inside the installed mmdet3d wheel
(`mu_space.testing.mmdet3d_models`, the building tests/compat uses), weights from one seed; the
batch is fixed: `--frames` synthetic nuScenes-like frames (`mu_space.testing.lidar`, default 4 =
the configs' per-GPU batch, 10 sweeps each) with the scenes' cars and pedestrians as ground
truth. Stages, each from the same initial weights:

1. compare: loss forward + backward with `--backend` (default "auto": on a GPU the native
   kernels; MUSPACE_TRY_UNVERIFIED=1 lets auto run the ones still marked unverified), again
   with `--backend` (the run-to-run floor), and with `--baseline` (default "reference": the
   surrogate's backend, `mu_space.compat.mmcv.install(backend=...)`, sends every served call to
   the PyTorch reference on the same GPU). Every loss term and every parameter gradient
   compared (TOLERANCES, with the reasons). TF32 off and torch's deterministic algorithms on
   (cuDNN, cuBLAS, index_add_) for this stage only, so the differences left are muSPACE's.
2. train: `--steps` optimizer steps (the config's AdamW, lr, weight decay and gradient clip; no
   LR schedule) on the fixed batch with `--backend`; the loss curve must fall (the mean of the
   last 5 steps below the first step's loss) and stay finite. Each step is timed.
3. time: training steps with `--baseline` (`--warmup` + `--reps`), beside stage 2's steps past
   the warm-up; then predict (data preprocessor + forward + post-processing with the NMS, eval
   mode, no_grad) with both backends on the trained weights, whose outputs are compared too
   (reported, not bounded: CenterPoint's heatmap top-k may order near-ties differently).
   Medians; CUDA events on a GPU (each step ends with a synchronisation: mmdet3d's losses and
   post-processing read values on the host anyway), perf_counter on the CPU.

Writes <out>/<model>.json (everything, the loss curve and step times included) and
<out>/<model>.md (the README table). Exit status 0 when the comparison is within the
tolerances, a native kernel ran (when the backend is not "reference") and the loss falls.
--smoke: 1 nus-1sweep frame, 2 steps, 1 timed repetition, no warm-up, no repeat run, at most
100 boxes into the NMS, the reference for both runs (the CPU check of every stage; the
figures are meaningless).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS determinism (stage 1)

import torch  # noqa: E402

import mu_space  # noqa: E402
from mu_space.runtime import kernel_dispatch, native  # noqa: E402
from mu_space.runtime.kernel_dispatch import BACKENDS  # noqa: E402
from mu_space.testing import mmdet3d_models as m3d  # noqa: E402


@dataclass(frozen=True)
class Tolerance:
    """Native vs reference bounds of one model. Loss terms: |a - b| <= loss * |b|. Gradients,
    per parameter tensor p: ||a_p - b_p|| <= grad * ||b_p|| + whole * ||B|| / sqrt(P), and for
    all of them at once ||A - B|| <= whole * ||B|| (A, B: every gradient concatenated, P: the
    number of tensors). The absolute part holds a tensor whose gradient is ~0 (e.g. cancelled by
    a following batch norm) to its share of the whole bound instead of its own rounding noise."""

    loss: float
    grad: float
    whole: float
    reason: str


TOLERANCES = {
    "pointpillars": Tolerance(
        1e-6,
        1e-5,
        1e-6,
        "the only muSPACE op in the loss is hard voxelization, bit-exact on both backends "
        "(mmcv's deterministic voxel order, values copied); the NMS runs in predict only and "
        "the focal loss is the same PyTorch code on both: both runs feed identical tensors to "
        "identical torch code, so with deterministic algorithms the difference is 0 (the bounds "
        "allow for one reordered float32 reduction)",
    ),
    "centerpoint": Tolerance(
        1e-4,
        2e-3,
        1e-4,
        "the sparse convolutions' native path runs the reference's float32 GEMMs on the same "
        "operands and sums the offsets in the same order without atomics, but cuBLAS may pick "
        "another kernel for another slice (tolerance table: 1e-5 of the largest element per "
        "call); ~13 sparse layers with batch norm, ReLU (a sign flip of an activation within "
        "rounding of 0 moves its weights' gradients by ~1/positions), the dense SECOND backbone "
        "and 6 task heads carry that ~1e-6 to ~1e-5 relative in the losses and the gradients",
    ),
}


# --------------------------------------------------------------------------- arguments


def parse(argv: list[str] | None, model: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if model is None:
        p.add_argument("--model", choices=sorted(m3d.MODELS), required=True)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help='the muSPACE run (default "auto" on a GPU, "reference" on the CPU)',
    )
    p.add_argument("--baseline", choices=BACKENDS, default="reference")
    p.add_argument("--cloud", default=None, help="lidar.CLOUDS name (default nus-10sweeps)")
    p.add_argument("--frames", type=int, default=None, help="frames in the batch (default 4)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 50)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny counts (docstring)")
    p.add_argument("--out", default="gpu-out/mmdet3d", help="folder for <model>.json / .md")
    p.add_argument(
        "--frame-cache",
        default=None,
        help="folder keeping the generated LiDAR frames between runs (seconds of CPU each)",
    )
    args = p.parse_args(argv)
    if model is not None:
        args.model = model
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    smoke = args.smoke
    defaults = {
        "cloud": "nus-1sweep" if smoke else "nus-10sweeps",
        "frames": 1 if smoke else 4,
        "steps": 2 if smoke else 50,
        "warmup": 0 if smoke else 3,
        "reps": 1 if smoke else 10,
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.backend is None:
        args.backend = "reference" if smoke or args.device.type == "cpu" else "auto"
    if args.steps < 2 or args.frames < 1 or args.reps < 1 or args.warmup < 0:
        p.error("--steps >= 2, --frames >= 1, --reps >= 1, --warmup >= 0")
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup (the training steps past it are timed)")
    return args


# --------------------------------------------------------------------------- helpers


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Milliseconds of one region: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


class Settings:
    """Stage 1's numerics: TF32 off, deterministic algorithms on (without NaN-filling new
    tensors: the runs stay as in use); restored afterwards."""

    def __enter__(self):
        fill = torch.utils.deterministic
        self.saved = (
            fill.fill_uninitialized_memory,
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
        fill.fill_uninitialized_memory = False
        return self

    def __exit__(self, *exc):
        fill, mm, cd, det, algo, warn = self.saved
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.backends.cuda.matmul.allow_tf32 = mm
        torch.backends.cudnn.allow_tf32 = cd
        torch.backends.cudnn.deterministic = det
        torch.use_deterministic_algorithms(algo, warn_only=warn)


def _use(backend: str) -> None:
    """The surrogate's backend for every served mmcv._ext call from now on."""
    m3d.setup(backend)


def _dispatch_summary() -> dict:
    """op -> {backend or 'reference (reason)': calls} of the records since the last reset."""
    out: dict[str, dict[str, int]] = {}
    for r in kernel_dispatch.records():
        key = r["backend"] if r["reason"] == "native" else f"{r['backend']} ({r['reason']})"
        out.setdefault(r["op"], {})[key] = out.get(r["op"], {}).get(key, 0) + r["calls"]
    return out


def _ext_calls() -> dict:
    from mu_space.compat import mmcv as compat

    return dict(compat.report().calls)


def _reset_counts() -> None:
    from mu_space.compat import mmcv as compat

    kernel_dispatch.reset()
    compat.report().reset()


def _losses(model, data):
    batch = model.data_preprocessor(data, training=True)
    loss, log = model.parse_losses(model(**batch, mode="loss"))
    return loss, log, batch


def loss_and_grads(model, state, data, backend, seed):
    """One loss forward + backward from `state` with `backend`: the loss terms (floats), the
    gradients (detached copies) and what ran."""
    _use(backend)
    model.load_state_dict(state)
    model.train()
    model.zero_grad(set_to_none=True)
    _reset_counts()
    torch.manual_seed(seed)
    loss, log, batch = _losses(model, data)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    terms = {k: float(v.detach() if torch.is_tensor(v) else v) for k, v in log.items()}
    voxels = batch["inputs"].get("voxels", {})
    counts = {k: int(v.shape[0]) for k, v in voxels.items() if k in ("voxels", "coors")}
    return {
        "loss": float(loss.detach()),
        "terms": terms,
        "grads": grads,
        "dispatch": _dispatch_summary(),
        "ext_calls": _ext_calls(),
        "voxels": counts.get("coors", counts.get("voxels")),
    }


def compare_runs(a: dict, b: dict, tol: Tolerance) -> dict:
    """Run a against run b (loss_and_grads results): rows per loss term and per gradient
    tensor, the worst of each, the whole-gradient figure and whether all are within `tol`."""
    rows, ok = [], True
    terms = sorted(set(a["terms"]) | set(b["terms"]))
    worst_loss = 0.0
    for k in terms:
        if k not in a["terms"] or k not in b["terms"]:
            rows.append({"what": f"loss {k}", "ok": False, "note": "missing in one run"})
            ok = False
            continue
        va, vb = a["terms"][k], b["terms"][k]
        rel = abs(va - vb) / max(abs(vb), 1e-30)
        good = math.isfinite(va) and math.isfinite(vb) and abs(va - vb) <= tol.loss * abs(vb)
        worst_loss = max(worst_loss, rel if math.isfinite(rel) else math.inf)
        rows.append({"what": f"loss {k}", "a": va, "b": vb, "rel": rel, "ok": good})
        ok &= good
    names = sorted(set(a["grads"]) | set(b["grads"]))
    missing = [n for n in names if n not in a["grads"] or n not in b["grads"]]
    if missing:
        ok = False
        rows.append({"what": "gradients", "ok": False, "note": f"missing: {missing[:8]}"})
    common = [n for n in names if n not in missing]
    diff2 = ref2 = 0.0
    per = []
    for n in common:
        ga, gb = a["grads"][n].double(), b["grads"][n].double()
        if ga.shape != gb.shape or not (ga.isfinite().all() and gb.isfinite().all()):
            per.append((n, math.inf, gb.norm().item(), False))
            continue
        d, r = (ga - gb).norm().item(), gb.norm().item()
        diff2, ref2 = diff2 + d * d, ref2 + r * r
        per.append((n, d, r, True))
    whole_ref = math.sqrt(ref2)
    share = tol.whole * whole_ref / math.sqrt(max(len(common), 1))
    worst = (None, 0.0)
    bad = []
    for n, d, r, finite in per:
        good = finite and d <= tol.grad * r + share
        rel = d / max(r, 1e-30) if finite else math.inf
        if not good:
            bad.append({"param": n, "diff": d, "norm": r, "rel": rel})
        if rel > worst[1] or worst[0] is None:
            worst = (n, rel)
        ok &= good
    whole_rel = math.sqrt(diff2) / max(whole_ref, 1e-30)
    ok &= math.sqrt(diff2) <= tol.whole * whole_ref and not bad
    return {
        "ok": bool(ok),
        "loss_rows": rows,
        "worst_loss_rel": worst_loss,
        "grad_tensors": len(common),
        "worst_grad": {"param": worst[0], "rel": worst[1]},
        "whole_grad_rel": whole_rel,
        "grad_failures": bad[:20],
        "tolerance": asdict(tol),
    }


def make_optimizer(model, cfg):
    """The config's optimizer (AdamW: lr, weight decay, betas) and gradient clip; no schedule."""
    o = cfg.optim_wrapper.optimizer
    if o.type != "AdamW":
        raise ValueError(f"expected the configs' AdamW, got {o.type}")
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=o.lr,
        weight_decay=o.get("weight_decay", 0.01),
        betas=tuple(o.get("betas", (0.9, 0.999))),
    )
    clip = cfg.optim_wrapper.get("clip_grad") or {}
    return opt, clip


def train_step(model, data, opt, clip):
    opt.zero_grad(set_to_none=True)
    loss, _, _ = _losses(model, data)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(
            model.parameters(), clip["max_norm"], clip.get("norm_type", 2)
        )
    opt.step()
    return loss.detach()


def train(model, state, cfg, data, backend, steps, device):
    """`steps` optimizer steps from `state`: the loss before each update and each step's ms."""
    _use(backend)
    model.load_state_dict(state)
    model.train()
    opt, clip = make_optimizer(model, cfg)
    losses, ms = [], []
    for _ in range(steps):
        with Timer(device) as t:
            loss = train_step(model, data, opt, clip)
        losses.append(float(loss))
        ms.append(t.ms)
    return losses, ms


def predict(model, data, backend):
    _use(backend)
    model.eval()
    with torch.no_grad():
        batch = model.data_preprocessor(data, training=False)
        return model(**batch, mode="predict")


def time_predict(model, data, backend, device, warmup, reps):
    for _ in range(warmup):
        predict(model, data, backend)
    ms = []
    for _ in range(reps):
        with Timer(device) as t:
            results = predict(model, data, backend)
        ms.append(t.ms)
    return ms, results


def compare_predictions(ra, rb) -> dict:
    """Per frame: box counts and, when they agree, the largest |difference| of the boxes and
    scores and whether the labels are equal."""
    frames = []
    for a, b in zip(ra, rb):
        pa, pb = a.pred_instances_3d, b.pred_instances_3d
        row = {"boxes_a": int(len(pa.scores_3d)), "boxes_b": int(len(pb.scores_3d))}
        if row["boxes_a"] == row["boxes_b"] and row["boxes_a"]:
            row["max_box_diff"] = float((pa.bboxes_3d.tensor - pb.bboxes_3d.tensor).abs().max())
            row["max_score_diff"] = float((pa.scores_3d - pb.scores_3d).abs().max())
            row["labels_equal"] = bool(torch.equal(pa.labels_3d, pb.labels_3d))
        frames.append(row)
    return {"frames": frames}


def _falls(losses: list[float]) -> tuple[bool, float]:
    k = min(5, max(1, len(losses) // 5))
    tail = statistics.fmean(losses[-k:])
    finite = all(math.isfinite(v) for v in losses)
    return finite and tail < losses[0], tail / losses[0] if losses[0] else math.nan


def _environment(device) -> dict:
    import importlib.metadata as md

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mu_space": getattr(mu_space, "__version__", "?"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "MUSPACE_TRY_UNVERIFIED": os.environ.get("MUSPACE_TRY_UNVERIFIED", ""),
        "native_library": native.unavailable_reason(device) or "loaded",
    }
    for name in ("mmengine", "mmcv-lite", "mmdet", "mmdet3d", "apache-tvm-ffi"):
        try:
            env[name] = md.version(name)
        except md.PackageNotFoundError:
            env[name] = None
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["commit"] = os.environ.get("MUSPACE_COMMIT", "unknown")
    # the kernels that ran, whatever git says: a copied checkout's git metadata can be older
    # than its files (the H200 run of 2026-12-01 printed the session's first commit)
    try:
        info = json.loads((native.library_path().parent / "build_info.json").read_text())
        env["native_sources_sha256"] = str(info.get("sources_sha256", ""))[:12]
    except (OSError, ValueError):
        env["native_sources_sha256"] = None
    return env


def _save(out: Path, model: str, result: dict) -> None:
    (out / f"{model}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


def _median(values):
    return statistics.median(values) if values else math.nan


# --------------------------------------------------------------------------- report


def markdown(r: dict) -> str:
    a, b = r["backend"], r["baseline"]
    t = r["timing"]
    cmp_, rep = r["compare"]["vs_baseline"], r["compare"]["repeat"]
    tr = r["train"]
    env = r["environment"]
    title = {"pointpillars": "PointPillars", "centerpoint": "CenterPoint"}[r["model"]]
    lines = [
        f"### {title}: mmdet3d {env['mmdet3d']} `{Path(r['config']).stem}`",
        "",
        f"{env['device']}, torch {env['torch']}, muSPACE {env['mu_space']} (commit "
        f"{env['commit']}, native sources {env.get('native_sources_sha256')}), mmcv-lite "
        f"{env['mmcv-lite']}, mmdet {env['mmdet']}; batch "
        f"{r['frames']} x `{r['cloud']}` (~{r['points_per_frame']} points per frame, "
        f"{r['voxels']} voxels in the batch); {env['date']}."
        + (
            " **Smoke run: reference vs reference on tiny counts, not figures.**"
            if r["smoke"]
            else ""
        ),
        "",
        f"| per call (median) | muSPACE (`{a}`) | reference (`{b}`) | speedup |",
        "| --- | --- | --- | --- |",
    ]
    for what, key in (("training step", "train_ms"), ("predict", "predict_ms")):
        na, nb = t[key][a if a != b else "a"], t[key][b if a != b else "b"]
        lines.append(f"| {what} (ms; {t['reps'][key]}) | {na:.1f} | {nb:.1f} | {nb / na:.2f}x |")
    lines += [
        "",
        f"Training step: data preprocessor (voxelization) + loss forward + backward + gradient "
        f"clip + AdamW step; predict: data preprocessor + forward + post-processing (NMS), "
        f"eval, no_grad. {t['clock']}; peak GPU memory of a training step "
        f"{t.get('peak_mem_gib', {}).get(a, float('nan')):.1f} GiB (muSPACE), "
        f"{t.get('peak_mem_gib', {}).get(b, float('nan')):.1f} GiB (reference).",
        "",
        f"Losses and gradients, `{a}` vs `{b}` on the same weights and batch (TF32 off, "
        f"deterministic algorithms): worst loss term rel. {cmp_['worst_loss_rel']:.2e} (bound "
        f"{cmp_['tolerance']['loss']:g}); worst of {cmp_['grad_tensors']} gradient tensors "
        f"||a-b||/||b|| {cmp_['worst_grad']['rel']:.2e} (`{cmp_['worst_grad']['param']}`; "
        f"bound {cmp_['tolerance']['grad']:g} + share of {cmp_['tolerance']['whole']:g}), all "
        f"gradients {cmp_['whole_grad_rel']:.2e} (bound {cmp_['tolerance']['whole']:g}): "
        f"**{'within' if cmp_['ok'] else 'OUTSIDE'} the bounds**. "
        + (
            f"`{a}` run twice: worst loss rel. {rep['worst_loss_rel']:.2e}, all gradients "
            f"{rep['whole_grad_rel']:.2e}."
            if rep
            else "(No repeat run in the smoke mode.)"
        ),
        "",
        f"Training, `{a}`: {tr['steps']} steps of the config's AdamW (lr {tr['lr']:g}, weight "
        f"decay {tr['weight_decay']:g}, clip {tr['clip']}) on the fixed batch: loss "
        f"{tr['losses'][0]:.4f} -> {tr['losses'][-1]:.4f} (mean of the last steps / first "
        f"{tr['ratio']:.3f}): **{'falls' if tr['falls'] else 'DOES NOT FALL'}**. Every 10th: "
        + ", ".join(f"{v:.3f}" for v in tr["losses"][::10])
        + ".",
        "",
        "Predictions on the trained weights, per frame (boxes muSPACE / reference, max |diff| "
        "of boxes, scores): "
        + "; ".join(
            f"{f['boxes_a']} / {f['boxes_b']}"
            + (
                f", {f['max_box_diff']:.2e}, {f['max_score_diff']:.2e}"
                if "max_box_diff" in f
                else ""
            )
            for f in r["predict_compare"]["frames"]
        )
        + ".",
    ]
    fallbacks = {
        op: {k: v for k, v in d.items() if k.startswith("reference")}
        for op, d in r["compare"]["dispatch_backend"].items()
    }
    fallbacks = {op: d for op, d in fallbacks.items() if d}
    ran = ", ".join(
        f"{op} {'/'.join(f'{k}: {v}' for k, v in d.items())}"
        for op, d in sorted(r["compare"]["dispatch_backend"].items())
    )
    lines += ["", f"muSPACE ops in one `{a}` loss + backward: {ran or 'none'}."]
    if fallbacks and a != "reference":
        lines.append(f"**Reference fallbacks in the `{a}` run**: {fallbacks}.")
    lines.append("")
    lines.append(
        f"Result: **{'PASS' if r['ok'] else 'FAIL'}** ({'; '.join(r['problems']) or 'all checks'})."
    )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None, model: str | None = None) -> int:
    args = parse(argv, model)
    reason = m3d.missing()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    dev = args.device
    a, b = args.backend, args.baseline
    spec = m3d.MODELS[args.model]
    tol = TOLERANCES[args.model]
    print(
        f"{args.model}: {spec.config} on {dev}, backend {a!r} vs {b!r}, batch {args.frames} x "
        f"{args.cloud}, {args.steps} steps, warmup {args.warmup}, reps {args.reps}",
        flush=True,
    )
    m3d.setup(a)
    from mmengine.logging import MMLogger

    MMLogger.get_current_instance().setLevel(logging.WARNING)  # init_weights' per-layer lines
    net, cfg = m3d.build(args.model, seed=args.seed, nms_pre=100 if args.smoke else 0)
    net = net.to(dev)
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    cache = Path(args.frame_cache) if args.frame_cache else None
    data = m3d.batch(args.model, args.cloud, args.frames, device=dev, cache=cache)
    points = [int(p.shape[0]) for p in data["inputs"]["points"]]
    t0 = time.perf_counter()

    # 1. compare
    with Settings():
        run_a = loss_and_grads(net, state, data, a, args.seed)
        run_a2 = None if args.smoke else loss_and_grads(net, state, data, a, args.seed)
        run_b = loss_and_grads(net, state, data, b, args.seed)
    vs = compare_runs(run_a, run_b, tol)
    repeat = compare_runs(run_a2, run_a, tol) if run_a2 is not None else None
    print(
        f"[{time.perf_counter() - t0:6.1f} s] compare: loss {run_a['loss']:.6f} vs "
        f"{run_b['loss']:.6f}; worst loss rel {vs['worst_loss_rel']:.2e}, worst grad rel "
        f"{vs['worst_grad']['rel']:.2e} ({vs['worst_grad']['param']}), all grads "
        f"{vs['whole_grad_rel']:.2e}: {'ok' if vs['ok'] else 'MISMATCH'}; repeat all grads "
        f"{repeat['whole_grad_rel'] if repeat else float('nan'):.2e}",
        flush=True,
    )
    for row in vs["grad_failures"][:5]:
        print(f"   MISMATCH {row}")
    native_calls = sum(
        v for d in run_a["dispatch"].values() for k, v in d.items() if not k.startswith("reference")
    )
    del run_a2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = {"model": args.model, "complete": False, "backend": a, "baseline": b}
    partial["compare"] = {
        "vs_baseline": vs,
        "repeat": repeat,
        "dispatch_backend": run_a["dispatch"],
    }
    _save(out, args.model, partial)  # a run cut short by a time limit keeps what it measured

    # 2. train with the muSPACE backend
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    losses, step_ms = train(net, state, cfg, data, a, args.steps, dev)
    peak = {}
    if dev.type == "cuda":
        peak[a] = torch.cuda.max_memory_allocated(dev) / 2**30
    trained = {k: v.detach().clone() for k, v in net.state_dict().items()}
    falls, ratio = _falls(losses)
    partial["train"] = {"losses": losses, "steps_ms": step_ms, "falls": falls, "ratio": ratio}
    _save(out, args.model, partial)
    print(
        f"[{time.perf_counter() - t0:6.1f} s] train: {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"(ratio {ratio:.3f}) {'falls' if falls else 'DOES NOT FALL'}; step "
        f"{_median(step_ms[args.warmup :]):.1f} ms",
        flush=True,
    )

    # 3. time: the baseline's training steps, then predict with both on the trained weights
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    b_losses, b_ms = train(net, state, cfg, data, b, args.warmup + args.reps, dev)
    if dev.type == "cuda":
        peak[b] = torch.cuda.max_memory_allocated(dev) / 2**30
    net.load_state_dict(trained)
    pa_ms, pred_a = time_predict(net, data, a, dev, args.warmup, args.reps)
    pb_ms, pred_b = time_predict(net, data, b, dev, args.warmup, args.reps)
    label_a, label_b = (a, b) if a != b else ("a", "b")
    timing = {
        "clock": "CUDA events" if dev.type == "cuda" else "perf_counter",
        "train_ms": {
            label_a: _median(step_ms[args.warmup :]),
            label_b: _median(b_ms[args.warmup :]),
        },
        "predict_ms": {label_a: _median(pa_ms), label_b: _median(pb_ms)},
        "reps": {
            "train_ms": f"{args.steps - args.warmup} / {args.reps} steps",
            "predict_ms": f"{args.reps} calls",
        },
        "train_steps_ms": {label_a: step_ms, label_b: b_ms},
        "predict_calls_ms": {label_a: pa_ms, label_b: pb_ms},
        "peak_mem_gib": peak,
        "warmup": args.warmup,
    }
    print(
        f"[{time.perf_counter() - t0:6.1f} s] time: train {timing['train_ms']}, predict "
        f"{timing['predict_ms']} ms",
        flush=True,
    )

    problems = []
    if not vs["ok"]:
        problems.append(f"{a} vs {b} outside the tolerances")
    if a != "reference" and native_calls == 0:
        problems.append(f"no native kernel ran in the {a} run")
    if not falls:
        problems.append("the training loss does not fall")
    o = cfg.optim_wrapper.optimizer
    result = {
        "model": args.model,
        "config": spec.config,
        "backend": a,
        "baseline": b,
        "smoke": args.smoke,
        "device": str(dev),
        "cloud": args.cloud,
        "frames": args.frames,
        "points": points,
        "points_per_frame": round(statistics.fmean(points)),
        "voxels": run_a["voxels"],
        "environment": _environment(dev),
        "compare": {
            "vs_baseline": vs,
            "repeat": repeat,
            "loss": {a if a != b else "a": run_a["loss"], b if a != b else "b": run_b["loss"]},
            "dispatch_backend": run_a["dispatch"],
            "dispatch_baseline": run_b["dispatch"],
            "ext_calls": run_a["ext_calls"],
            "native_calls": native_calls,
        },
        "train": {
            "backend": a,
            "steps": args.steps,
            "losses": losses,
            "falls": falls,
            "ratio": ratio,
            "lr": o.lr,
            "weight_decay": o.get("weight_decay", 0.01),
            "clip": dict(cfg.optim_wrapper.get("clip_grad") or {}),
            "baseline_losses": b_losses,
        },
        "timing": timing,
        "predict_compare": compare_predictions(pred_a, pred_b),
        "complete": True,
        "ok": not problems,
        "problems": problems,
        "seconds": time.perf_counter() - t0,
    }
    _save(out, args.model, result)
    (out / f"{args.model}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / args.model}.json and .md; {'PASS' if result['ok'] else 'FAIL'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
