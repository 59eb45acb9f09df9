"""model_examples/CenterPoint/scripts/centerpoint_sparse_encoder.py: mmdet3d's SparseEncoder over
mu_space.sparse. Its main() runs in-process at --small on the CPU for both configs (reference vs
reference), a deliberately wrong backend A is caught, and the layer lists are mmdet3d's
(CenterPoint 0.075 basicblock, SECOND conv_module) with the upstream output shapes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import mu_space.sparse as spconv
from mu_space.sparse import conv as sparse_conv_module

SCRIPT = (
    Path(__file__).resolve().parents[1]
    / "model_examples"
    / "CenterPoint"
    / "scripts"
    / "centerpoint_sparse_encoder.py"
)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread: the reference path's per-offset index_add_ runs in ~2 s at --small
    with one thread, but with torch's OpenMP threads competing for the cores with other
    processes (pytest -n, CI neighbours) the same run took 80 s here."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _load():
    spec = importlib.util.spec_from_file_location("model_example_sparse_encoder", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config", ["centerpoint-0075-nus", "second-kitti"])
def test_small_cpu_passes(config, capsys):
    argv = ["--device", "cpu", "--small", "--config", config, "--warmup", "0", "--reps", "1"]
    assert _load().main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "speedup A over B" in out and "MISMATCH" not in out
    assert "output spatial_features: (1, 256, 8, 8)" in out  # 128 channels x 2 z, 64 / 8


def test_wrong_backend_is_caught(monkeypatch, capsys):
    """Backend A ('auto', the reference on the CPU) gets a sparse conv that is off by 1e-3."""
    original = sparse_conv_module.sparse_conv

    def off_by_a_little(*args, backend="auto", **kwargs):
        out = original(*args, backend="reference", **kwargs)
        return out * (1.0 + 1e-3) if backend == "auto" else out

    monkeypatch.setattr(sparse_conv_module, "sparse_conv", off_by_a_little)
    argv = ["--device", "cpu", "--small", "--backend-a", "auto", "--warmup", "0", "--reps", "1"]
    assert _load().main(argv) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "FAIL" in out


def _count(module, cls):
    return sum(type(m) is cls for m in module.modules())


@pytest.mark.parametrize(
    "config, subm, strided, out_shape",
    [
        # conv_input + 4 stages x 2 SparseBasicBlocks x 2; 3 stage convs + conv_out
        ("centerpoint-0075-nus", 17, 4, (41, 1440, 1440)),
        # conv_input + 1 + 3 x 2; 3 stage convs + conv_out
        ("second-kitti", 8, 4, (41, 1600, 1408)),
    ],
)  # fmt: skip
def test_layer_list_is_mmdet3d(config, subm, strided, out_shape):
    m = _load()
    enc = m.SparseEncoder(m.ENCODERS[config], 1, backend="reference")
    assert _count(enc, spconv.SubMConv3d) == subm
    assert _count(enc, spconv.SparseConv3d) == strided
    assert enc.sparse_shape == list(out_shape)
    convs = [x for x in enc.modules() if isinstance(x, spconv.SparseConvolution)]
    assert all(c.bias is None and c.backend == "reference" for c in convs)
    assert convs[-1].kernel_size == [3, 1, 1] and convs[-1].stride == [2, 1, 1]
    assert convs[-1].indice_key == "spconv_down2"
    bns = [x for x in enc.modules() if isinstance(x, torch.nn.BatchNorm1d)]
    assert bns and all(b.eps == 1e-3 and b.momentum == 0.01 for b in bns)
    # the output grid: z 41 -> 21 -> 11 -> 5 -> 2, x / y / 8
    shape = list(out_shape)
    for c in convs:
        if not c.subm:
            shape = [
                (s + 2 * p - k) // st + 1
                for s, p, k, st in zip(shape, c.padding, c.kernel_size, c.stride)
            ]
    assert shape == [2, out_shape[1] // 8, out_shape[2] // 8]


def test_benchmark_smoke_run(tmp_path, capsys):
    """benchmarks/bench_sparse_conv.py end to end on the --small frame (CPU: reference path, no
    spconv twins): every case checked against its reference and timed, the JSON written."""
    import json

    from benchmarks import bench_sparse_conv

    assert bench_sparse_conv.main(["--smoke", "--out", str(tmp_path)]) == 0, capsys.readouterr()
    doc = json.loads((tmp_path / "sparse_conv.smoke.json").read_text())
    names = [r["name"] for r in doc["results"]]
    assert all(r["status"] == "ok" for r in doc["results"])
    for want in (
        "encoder-centerpoint-0075-forward+backward-float16",
        "subm-k3-c16-16-backward-float32",
        "strided-k3s2-c16-32-forward-float32",
        "inverse-k3-c32-16-backward-float16",
        "rulebook-subm-k3",
        "sweep-n500-subm-k3-c16-16-forward-float32",
    ):
        assert want in names, names


def test_spconv_ratio_table(tmp_path):
    """benchmarks/_spconv_peer.py: ours / spconv per twin, against the 1.0x target and 0.7x goal."""
    import json

    from benchmarks import _spconv_peer

    results = [
        {"name": "a", "median_us": 60.0},
        {"name": "a-spconv", "median_us": 100.0},
        {"name": "b", "median_us": 120.0},
        {"name": "b-spconv", "median_us": 100.0},
        {"name": "c", "median_us": 5.0},
    ]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": results}))
    rows = _spconv_peer.ratio_rows([str(path)])
    assert [(r["case"], round(r["ratio"], 2)) for r in rows] == [("a", 0.6), ("b", 1.2)]
    table = _spconv_peer.table([str(path)])
    assert "| a | 60.0 | 100.0 | 0.60x | met | met |" in table
    assert "| b | 120.0 | 100.0 | 1.20x | MISSED | no |" in table


def test_time_breakdown_categories_and_smoke_run(tmp_path):
    """benchmarks/profile_sparse_encoder.py: kernel names land in the right category, and the
    smoke run (CPU: the reference's aten ops) writes a breakdown whose shares add up."""
    import json

    from benchmarks import profile_sparse_encoder as prof

    names = {
        "void muspace::sparse::(anonymous namespace)::gather_kernel<float>(...)": "gather",
        "void muspace::sparse::(anonymous namespace)::im2col_kernel<float, 4>(...)": "gather",
        "muspace::sparse::(anonymous namespace)::neighbour_maps_kernel(...)": "neighbour maps",
        "void muspace::sparse::(anonymous namespace)::implicit_gemm_kernel<float, float, 16, "
        "true>(...)": "implicit GEMM",
        "void muspace::sparse::(anonymous namespace)::wgrad_partial_kernel<float, 64, true>(...)": (
            "implicit GEMM"
        ),
        "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4>(...)": "GEMM",
        "void muspace::sparse::(anonymous namespace)::pair_emit_kernel(...)": "rule book",
        "void muspace::sparse::(anonymous namespace)::pair_counts_kernel(...)": "pair counts",
        "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32": "GEMM",
        "void muspace::sparse::(anonymous namespace)::scatter_kernel<float>(...)": "scatter",
        "void at::native::batch_norm_collect_statistics_kernel<float>(...)": "BatchNorm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::relu>(...)": "other",
        "aten::index_add_": "scatter",
        "aten::mm": "GEMM",
    }
    assert {n: prof.category(n) for n in names} == names
    assert (
        prof.main(
            ["--smoke", "--steps", "1", "--dtype", "float32", "--direction", "forward"]
            + ["--out", str(tmp_path)]
        )
        == 0
    )
    (res,) = json.loads((tmp_path / "profile_sparse_encoder.json").read_text())
    total = sum(res["us_per_step_by_category"].values())
    assert total > 0 and res["backend"] in ("reference", "native")
    categories = set(res["us_per_step_by_category"])
    # the float32 native forward gathers inside its GEMM kernels
    fused = "implicit GEMM" in categories
    assert {"gather", "GEMM"} <= categories or fused, res["top_kernels_us_per_step"]
