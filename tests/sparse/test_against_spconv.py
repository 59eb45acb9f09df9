"""mu_space.sparse against the real spconv 2.3.8 on the CPU (spconv's CPU build: the Native
gather -> mm -> scatter-add path, the only algorithm a CPU tensor runs there).

Skipped unless spconv.pytorch imports (CI: skipped). To run:

    python -m venv --system-site-packages /tmp/spconv-venv
    /tmp/spconv-venv/bin/pip install spconv==2.3.8      # + cumm, pccm, ccimport from pip
    /tmp/spconv-venv/bin/python -m pytest -q tests/sparse/test_against_spconv.py

Each test builds the layer in spconv and in mu_space.sparse, loads spconv's state_dict into
ours UNCHANGED (strict: the KRSC layout claim), runs the same SparseConvTensor and compares

- output indices as sets (rows sorted by (b, z, y, x)). Orders: SubM: both return the input
  rows in input order (spconv returns the same indices object, so do we); strided conv / pool:
  ours ascending (b, z, y, x), spconv's CPU order is its own (hash-table insertion order), so
  only the sorted rows are compared; inverse: both return the indices of the conv they invert;
- features per site (after matching the rows), and the dense() tensors;
- gradients of the input features and the weight (spconv's CPU path has indice_conv_backward
  and indice_maxpool_backward).

Tolerance (float32): both sides sum the same products (per offset a [n_k, C_in] x [C_in, C_out]
GEMM, then a scatter-add over <= 27 offsets) but in differently blocked GEMMs and offset orders:
rounding only, a few ulp of the largest partial sum. 1e-5 x max |value| (about 80 ulp of
float32) bounds that for K * C_in <= 27 * 64 products of O(1) values; gradients the same way.
The encoder stack (five stages, BatchNorm in training mode) amplifies rounding through the
batch statistics: 1e-4 x max |value|.

Documented differences, checked as such (docs/operators/sparse_conv.md):
- SparseMaxPool: spconv starts each output's maximum at 0 (a window of negative features pools
  to 0); ours is the true maximum. With mixed-sign features spconv == max(ours, 0).
- 1x1 conv (k = 1, stride 1): spconv computes `features @ weight.view(C_in, C_out)` of its
  [C_out, 1, 1, 1, C_in] weight (traveller59/spconv#450), ours `features @ W.T` (the
  convolution the weight describes, and what spconv's own k = 3 path means by the weight).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import mu_space.sparse as ms
from mu_space.ops.voxelization import voxelization
from mu_space.testing import lidar
from tests.ops.test_sparse_rulebook import random_sites

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    sp = pytest.importorskip(
        "spconv.pytorch",
        reason="spconv (2.3.8) is not importable here: the agreement tests run in a venv with "
        "spconv installed (see this file's docstring)",
    )
import spconv  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu_stream(monkeypatch):
    """spconv 2.3.8's indice_conv_backward asks torch.cuda for the current stream before it
    looks at the device (ops.py: `stream = get_current_stream()` ahead of its CPU branch), which
    raises "Torch not compiled with CUDA enabled" on a CPU-only torch; its CPU branch never uses
    the stream. Return 0 (spconv's own CPU stream value) when torch has no CUDA."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(spconv.pytorch.ops, "get_current_stream", lambda: 0)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """spconv 2.3.8's CPU conv gives wrong features at a few rows (2-6 of 1500 per SubM k3 call
    on the LiDAR frame, different rows each call) when torch runs with more than one intra-op
    thread; with torch.set_num_threads(1) it matches a dense conv3d to float32 rounding (and
    so do we, with any thread count: test_threads_spconv_races_ours_does_not). The agreement
    tests therefore run spconv with one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TOL = 1e-5  # x max |value|: float32 rounding of the same sums (module docstring)
STACK_TOL = 1e-4


def test_spconv_version():
    assert spconv.__version__ == "2.3.8", spconv.__version__


# ----------------------------------------------------------------------------- inputs


def _lidar_frame(seed: int = 0, voxel_z: float | None = None):
    """A voxelised synthetic LiDAR frame (tiny-voxels: 3 sweeps of a 16-beam rig, 0.5 m voxels
    over +-16 m x [-3, 2] m): mean of the points per voxel (x, y, z, intensity, time), (b, z, y,
    x) rows."""
    cfg = lidar.VOXEL_CONFIGS["tiny-voxels"]
    vs, pcr, max_pts, max_vox = lidar.layer_args("tiny-voxels")
    if voxel_z is not None:
        vs[2] = voxel_z
    pts = lidar.batch(cfg.cloud, seed + 1)[seed]
    voxels, coors, counts = voxelization(pts, vs, pcr, max_pts, max_vox, backend="reference")
    feats = voxels.sum(1) / counts.clamp(min=1)[:, None].to(voxels.dtype)
    idx = torch.nn.functional.pad(coors, (1, 0), value=0).to(torch.int32)
    gz = round((pcr[5] - pcr[2]) / vs[2])
    gy, gx = round((pcr[4] - pcr[1]) / vs[1]), round((pcr[3] - pcr[0]) / vs[0])
    return feats.contiguous(), idx.contiguous(), [gz + 1, gy, gx]


def _random_frame(n=600, batch=2, shape=(12, 20, 18), c=4, seed=0):
    idx = random_sites(n, batch, list(shape), seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    return torch.randn(n, c, generator=g), idx.contiguous(), list(shape), batch


FRAMES = ["lidar", "random"]


def _frame(name: str, c: int = 4):
    if name == "lidar":
        feats, idx, shape = _lidar_frame()
        assert idx.shape[0] > 500
        return feats[:, :c].contiguous(), idx, shape, 1
    return _random_frame(c=c)


def _pair(feats, idx, shape, batch):
    """The same input for both libraries (separate leaves for the gradients)."""
    a = feats.clone().requires_grad_(True)
    b = feats.clone().requires_grad_(True)
    return (
        a,
        b,
        sp.SparseConvTensor(a, idx, shape, batch),
        ms.SparseConvTensor(b, idx, shape, batch),
    )


# ----------------------------------------------------------------------------- comparison


def _lex(indices):
    """Permutation sorting rows by (b, z, y, x)."""
    keys = torch.zeros(indices.shape[0], dtype=torch.int64)
    for j in range(indices.shape[1]):
        keys = keys * (int(indices[:, j].max()) + 1 if indices.shape[0] else 1) + indices[:, j]
    return torch.argsort(keys)


def _close(got, want, tol, what):
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol * scale + 1e-30, f"{what}: max|a-b| {err:.3g} > {tol:g} x {scale:.3g}"
    if os.environ.get("MUSPACE_AGREEMENT_LOG"):  # -s: the measured errors
        print(f"\n  {what}: max|a-b| / max|b| = {err / max(scale, 1e-30):.3g}", end="")
    return err / max(scale, 1e-30)


def _same_sites(y_sp, y_ms, what):
    """Output sites equal as sets; returns the permutations (spconv rows, our rows) that sort
    both, after checking the sorted rows are identical."""
    assert y_sp.spatial_shape is not None
    assert list(y_sp.spatial_shape) == list(y_ms.spatial_shape), what
    assert y_sp.indices.shape == y_ms.indices.shape, (
        f"{what}: {y_sp.indices.shape[0]} spconv rows vs {y_ms.indices.shape[0]} ours"
    )
    ps, pm = _lex(y_sp.indices.long()), _lex(y_ms.indices.long())
    assert torch.equal(y_sp.indices[ps].long(), y_ms.indices[pm].long()), f"{what}: site sets"
    # our documented order: strided ascending (b, z, y, x)
    return ps, pm


def _compare(y_sp, y_ms, what, tol=TOL):
    ps, pm = _same_sites(y_sp, y_ms, what)
    rel = _close(y_ms.features[pm], y_sp.features[ps], tol, f"{what} features")
    _close(y_ms.dense(), y_sp.dense(), tol, f"{what} dense()")
    return rel


def _backward(y_sp, y_ms, seed=7):
    """The same loss on both: <features at each site, fixed random weights per site>."""
    ps, pm = _lex(y_sp.indices.long()), _lex(y_ms.indices.long())
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(y_ms.features.shape, generator=g)
    (y_sp.features[ps] * w).sum().backward()
    (y_ms.features[pm] * w).sum().backward()


def _load(ours: nn.Module, theirs: nn.Module):
    """spconv's state_dict into ours unchanged (strict)."""
    sd = theirs.state_dict()
    ours.load_state_dict(sd, strict=True)
    for k, v in sd.items():
        assert torch.equal(ours.state_dict()[k], v), k


# ----------------------------------------------------------------------------- single layers

LAYERS = {
    # name: (spconv class, ours, args, kwargs)
    "subm_k3": ("SubMConv3d", (4, 16, 3), {"padding": 1, "bias": False, "indice_key": "s"}),
    "subm_k3_pad0_bias": ("SubMConv3d", (4, 8, 3), {"bias": True}),
    "subm_k3_dil2": ("SubMConv3d", (4, 8, 3), {"dilation": 2, "bias": False}),
    "subm_k5": ("SubMConv3d", (4, 8, 5), {"bias": False}),
    "conv_k3_s2_p1": ("SparseConv3d", (4, 16, 3, 2, 1), {"bias": False, "indice_key": "c"}),
    "conv_k3_s2_p011": ("SparseConv3d", (4, 8, 3, 2, (0, 1, 1)), {"bias": True}),
    "conv_k311_s211": ("SparseConv3d", (4, 8, (3, 1, 1), (2, 1, 1)), {"bias": False}),
    "conv_k2_s2": ("SparseConv3d", (4, 8, 2, 2), {"bias": False}),
    "conv_k3_s1_p0": ("SparseConv3d", (4, 8, 3, 1, 0), {"bias": False}),
    "transpose_k3_s2_p1": ("SparseConvTranspose3d", (4, 8, 3, 2, 1), {"bias": False}),
}


@pytest.mark.parametrize("frame", FRAMES)
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layer_forward_and_backward_agree(layer, frame):
    cls, args, kwargs = LAYERS[layer]
    torch.manual_seed(0)
    theirs = getattr(sp, cls)(*args, **kwargs)
    ours = getattr(ms, cls)(*args, **kwargs)
    assert tuple(ours.weight.shape) == tuple(theirs.weight.shape)  # KRSC both
    _load(ours, theirs)
    feats, idx, shape, batch = _frame(frame)
    a, b, x_sp, x_ms = _pair(feats, idx, shape, batch)
    y_sp, y_ms = theirs(x_sp), ours(x_ms)
    if cls.startswith("SubM"):
        # both: the input rows, in input order (the same object)
        assert y_ms.indices is x_ms.indices
        assert torch.equal(y_sp.indices, idx)
    else:
        keys = _lex(y_ms.indices.long())
        assert torch.equal(keys, torch.arange(keys.numel()))  # ours ascending (b, z, y, x)
    _compare(y_sp, y_ms, layer)
    _backward(y_sp, y_ms)
    _close(b.grad, a.grad, TOL, f"{layer} grad features")
    _close(ours.weight.grad, theirs.weight.grad, TOL, f"{layer} grad weight")
    if theirs.bias is not None:
        _close(ours.bias.grad, theirs.bias.grad, TOL, f"{layer} grad bias")


@pytest.mark.parametrize("frame", FRAMES)
def test_2d_layers_agree(frame):
    feats, idx, shape, batch = _frame(frame)
    idx2 = idx[:, [0, 2, 3]]  # (b, y, x): drop z, keep the distinct sites
    keys = idx2[:, 0].long() * shape[1] * shape[2] + idx2[:, 1].long() * shape[2] + idx2[:, 2]
    _, first = torch.unique(keys, return_inverse=True)
    keep = torch.zeros(int(first.max()) + 1, dtype=torch.long).scatter_(
        0, first.flip(0), torch.arange(first.numel() - 1, -1, -1)
    )
    idx2, feats = idx2[keep].contiguous(), feats[keep].contiguous()
    for cls, args in (("SubMConv2d", (4, 8, 3)), ("SparseConv2d", (4, 8, 3, 2, 1))):
        torch.manual_seed(1)
        theirs, ours = getattr(sp, cls)(*args, bias=False), getattr(ms, cls)(*args, bias=False)
        _load(ours, theirs)
        a, b, x_sp, x_ms = _pair(feats, idx2, shape[1:], batch)
        y_sp, y_ms = theirs(x_sp), ours(x_ms)
        _compare(y_sp, y_ms, cls)
        _backward(y_sp, y_ms)
        _close(b.grad, a.grad, TOL, f"{cls} grad features")
        _close(ours.weight.grad, theirs.weight.grad, TOL, f"{cls} grad weight")


@pytest.mark.parametrize("frame", FRAMES)
def test_inverse_conv_with_indice_key_restores_the_input_sites(frame):
    torch.manual_seed(2)
    down_sp = sp.SparseConv3d(4, 8, 3, 2, 1, bias=False, indice_key="down")
    down_ms = ms.SparseConv3d(4, 8, 3, 2, 1, bias=False, indice_key="down")
    up_sp = sp.SparseInverseConv3d(8, 6, 3, indice_key="down", bias=True)
    up_ms = ms.SparseInverseConv3d(8, 6, 3, indice_key="down", bias=True)
    _load(down_ms, down_sp)
    _load(up_ms, up_sp)
    feats, idx, shape, batch = _frame(frame)
    a, b, x_sp, x_ms = _pair(feats, idx, shape, batch)
    mid_sp, mid_ms = down_sp(x_sp), down_ms(x_ms)
    _compare(mid_sp, mid_ms, "inverse: the strided conv")
    # the intermediate rows differ in order; feed each library its own
    y_sp, y_ms = up_sp(mid_sp), up_ms(mid_ms)
    assert y_ms.indices is x_ms.indices  # ours: the very input indices object
    assert torch.equal(y_sp.indices, idx)  # spconv: the input rows, input order
    assert y_sp.spatial_shape == y_ms.spatial_shape == shape
    _close(y_ms.features, y_sp.features, TOL, "inverse features (input order, both)")
    _close(y_ms.dense(), y_sp.dense(), TOL, "inverse dense()")
    _backward(y_sp, y_ms)
    _close(b.grad, a.grad, TOL, "inverse grad features")
    _close(up_ms.weight.grad, up_sp.weight.grad, TOL, "inverse grad weight")
    _close(down_ms.weight.grad, down_sp.weight.grad, TOL, "inverse: grad of the conv's weight")


@pytest.mark.parametrize("frame", FRAMES)
@pytest.mark.parametrize("geometry", [(3, 2, 1), (2, 2, 0), (3, 1, 1)])
def test_maxpool_agrees_on_nonnegative_features(frame, geometry):
    k, s, p = geometry
    feats, idx, shape, batch = _frame(frame)
    feats = feats.abs() + 0.01  # > 0: spconv's zero floor never matters
    a, b, x_sp, x_ms = _pair(feats, idx, shape, batch)
    y_sp = sp.SparseMaxPool3d(k, s, p, indice_key="pool")(x_sp)
    y_ms = ms.SparseMaxPool3d(k, s, p, indice_key="pool")(x_ms)
    _compare(y_sp, y_ms, f"maxpool {geometry}", tol=0.0)  # a max is exact
    _backward(y_sp, y_ms)
    _close(b.grad, a.grad, 0.0, f"maxpool {geometry} grad features")


def test_maxpool_mixed_signs_spconv_floors_at_zero():
    feats, idx, shape, batch = _random_frame(c=4, seed=3)
    _, _, x_sp, x_ms = _pair(feats, idx, shape, batch)
    y_sp = sp.SparseMaxPool3d(3, 2, 1)(x_sp)
    y_ms = ms.SparseMaxPool3d(3, 2, 1)(x_ms)
    ps, pm = _same_sites(y_sp, y_ms, "maxpool mixed signs")
    ours, theirs = y_ms.features[pm].detach(), y_sp.features[ps].detach()
    assert (ours < 0).any()  # some windows are all-negative in some channel
    assert torch.equal(theirs, ours.clamp(min=0))  # the documented difference, exactly


def test_inverse_of_a_maxpool_agrees():
    torch.manual_seed(3)
    feats, idx, shape, batch = _frame("lidar")
    feats = feats.abs() + 0.01
    up_sp = sp.SparseInverseConv3d(4, 8, 3, indice_key="pool", bias=False)
    up_ms = ms.SparseInverseConv3d(4, 8, 3, indice_key="pool", bias=False)
    _load(up_ms, up_sp)
    a, b, x_sp, x_ms = _pair(feats, idx, shape, batch)
    y_sp = up_sp(sp.SparseMaxPool3d(3, 2, 1, indice_key="pool")(x_sp))
    y_ms = up_ms(ms.SparseMaxPool3d(3, 2, 1, indice_key="pool")(x_ms))
    assert torch.equal(y_sp.indices, idx) and y_ms.indices is x_ms.indices
    _close(y_ms.features, y_sp.features, TOL, "inverse of pool features")
    _backward(y_sp, y_ms)
    _close(b.grad, a.grad, TOL, "inverse of pool grad features")
    _close(up_ms.weight.grad, up_sp.weight.grad, TOL, "inverse of pool grad weight")


def test_subm_indice_key_reuse_agrees():
    torch.manual_seed(4)
    feats, idx, shape, batch = _frame("lidar")
    mods = []
    for lib in (sp, ms):
        mods.append(
            lib.SparseSequential(
                lib.SubMConv3d(4, 8, 3, padding=1, bias=False, indice_key="k"),
                lib.SubMConv3d(8, 8, 3, padding=1, bias=False, indice_key="k"),
            )
        )
    _load(mods[1], mods[0])
    a, b, x_sp, x_ms = _pair(feats, idx, shape, batch)
    y_sp, y_ms = mods[0](x_sp), mods[1](x_ms)
    assert y_ms.indice_dict["k"] is not None and y_sp.indice_dict["k"] is not None
    _compare(y_sp, y_ms, "subm reuse")
    _backward(y_sp, y_ms)
    _close(b.grad, a.grad, TOL, "subm reuse grad features")


def test_1x1_conv_differs_from_spconv_as_documented():
    """spconv's k = 1 path multiplies by weight.view(C_in, C_out) (spconv#450); ours by W^T."""
    torch.manual_seed(5)
    theirs, ours = sp.SubMConv3d(4, 6, 1, bias=False), ms.SubMConv3d(4, 6, 1, bias=False)
    _load(ours, theirs)
    feats, idx, shape, batch = _frame("random")
    _, _, x_sp, x_ms = _pair(feats, idx, shape, batch)
    y_sp, y_ms = theirs(x_sp), ours(x_ms)
    w = theirs.weight.detach()
    _close(y_sp.features, feats @ w.reshape(4, 6), 1e-6, "spconv 1x1 = f @ w.view(C_in, C_out)")
    _close(y_ms.features, feats @ w.reshape(6, 4).T, 1e-6, "ours 1x1 = f @ W.T")
    assert not torch.allclose(y_sp.features, y_ms.features)
    # square + symmetric weight: the two agree
    sq_sp, sq_ms = sp.SubMConv3d(4, 4, 1, bias=False), ms.SubMConv3d(4, 4, 1, bias=False)
    with torch.no_grad():
        m = torch.randn(4, 4)
        sq_sp.weight.copy_((m + m.T).reshape(4, 1, 1, 1, 4))
    _load(sq_ms, sq_sp)
    _close(sq_ms(x_ms).features, sq_sp(x_sp).features, 1e-6, "1x1 symmetric")


# ----------------------------------------------------------------------------- encoder stack


def _encoder(lib, in_channels=4):
    """mmdet3d's SparseEncoder pattern at a small grid: conv_input SubM, four stages (SparseConv3d
    s2 + SubM blocks; the third stage's padding (0, 1, 1)), conv_out (3, 1, 1) s (2, 1, 1);
    BN1d eps 1e-3 momentum 0.01, ReLU."""

    def block(cin, cout, kind, key, **kw):
        conv = {"subm": lib.SubMConv3d, "spconv": lib.SparseConv3d}[kind]
        return lib.SparseSequential(
            conv(cin, cout, 3, bias=False, indice_key=key, **kw),
            nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01),
            nn.ReLU(),
        )

    return lib.SparseSequential(
        block(in_channels, 16, "subm", "subm1", padding=1),
        block(16, 16, "subm", "subm1", padding=1),
        block(16, 32, "spconv", "spconv2", stride=2, padding=1),
        block(32, 32, "subm", "subm2", padding=1),
        block(32, 64, "spconv", "spconv3", stride=2, padding=1),
        block(64, 64, "subm", "subm3", padding=1),
        block(64, 64, "spconv", "spconv4", stride=2, padding=(0, 1, 1)),
        block(64, 64, "subm", "subm4", padding=1),
        lib.SparseSequential(
            lib.SparseConv3d(64, 64, (3, 1, 1), (2, 1, 1), bias=False, indice_key="spconv_down2"),
            nn.BatchNorm1d(64, eps=1e-3, momentum=0.01),
            nn.ReLU(),
        ),
        lib.ToDense(),
    )


def test_sparse_encoder_stack_agrees_forward_and_backward():
    # 0.125 m voxels in z: the [41, 64, 64] grid, so z goes 41 -> 21 -> 11 -> 5 -> 2 as in
    # CenterPoint's [41, 1440, 1440]
    feats, idx, shape = _lidar_frame(voxel_z=0.125)
    feats, batch = feats[:, :4].contiguous(), 1
    assert shape == [41, 64, 64] and idx.shape[0] > 1000
    torch.manual_seed(6)
    theirs, ours = _encoder(sp).train(), _encoder(ms).train()
    _load(ours, theirs)
    a, b, x_sp, x_ms = _pair(feats, idx, shape, batch)
    d_sp, d_ms = theirs(x_sp), ours(x_ms)
    assert d_ms.shape == d_sp.shape and d_ms.dim() == 5
    assert (d_sp != 0).any()
    _close(d_ms, d_sp, STACK_TOL, "encoder dense output")
    g = torch.Generator().manual_seed(8)
    w = torch.randn(d_ms.shape, generator=g)
    (d_sp * w).sum().backward()
    (d_ms * w).sum().backward()
    _close(b.grad, a.grad, STACK_TOL, "encoder grad features")
    sp_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        _close(p.grad, sp_params[name].grad, STACK_TOL, f"encoder grad {name}")
    # running statistics updated identically
    sp_buffers = dict(theirs.named_buffers())
    for name, buf in ours.named_buffers():
        if buf.is_floating_point():
            _close(buf, sp_buffers[name], STACK_TOL, f"encoder buffer {name}")


def test_threads_spconv_races_ours_does_not():
    """With the default torch thread count: ours equals a dense conv3d on every repetition;
    spconv's CPU result is printed (its race, see _one_torch_thread), not asserted."""
    import torch.nn.functional as F

    torch.set_num_threads(max(2, torch.get_num_threads()))
    feats, idx, shape, batch = _frame("lidar")
    spconv_bad = []
    for rep in range(6):
        torch.manual_seed(rep)
        theirs, ours = sp.SubMConv3d(4, 8, 3, bias=False), ms.SubMConv3d(4, 8, 3, bias=False)
        _load(ours, theirs)
        x_ms = ms.SparseConvTensor(feats, idx, shape, batch)
        d = F.conv3d(x_ms.dense(), ours.weight.detach().permute(0, 4, 1, 2, 3), padding=1)
        want = d[idx[:, 0].long(), :, idx[:, 1].long(), idx[:, 2].long(), idx[:, 3].long()]
        _close(ours(x_ms).features, want, TOL, f"ours vs dense conv3d, rep {rep}")
        got = theirs(sp.SparseConvTensor(feats, idx, shape, batch)).features.detach()
        spconv_bad.append(int(((got - want).abs().amax(1) > 1e-4 * want.abs().max()).sum()))
    print(f"spconv 2.3.8 CPU, {torch.get_num_threads()} threads: wrong rows per call {spconv_bad}")


def _recipe():
    """model_examples/CenterPoint/scripts/centerpoint_sparse_encoder.py as a module."""
    import importlib.util
    from pathlib import Path

    path = (
        Path(__file__).resolve().parents[2]
        / "model_examples/CenterPoint/scripts/centerpoint_sparse_encoder.py"
    )
    spec = importlib.util.spec_from_file_location("recipe_vs_spconv", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


@pytest.mark.parametrize("config", ["centerpoint-0075-nus", "second-kitti"])
def test_recipe_encoder_agrees_with_spconv(config):
    """model_examples/CenterPoint/scripts/centerpoint_sparse_encoder.py's SparseEncoder (mmdet3d's
    layer list) built over spconv and over mu_space.sparse at the --small grid: our state_dict
    loaded into spconv's unchanged, the same dense BEV output and gradients."""
    recipe = _recipe()
    cfg = recipe.small_config(recipe.ENCODERS[config])
    inputs = recipe.make_inputs(recipe.VOXELS["small"], 1, "cpu")
    torch.manual_seed(9)
    ours = recipe.SparseEncoder(cfg, 1, "reference").train()
    theirs = recipe.SparseEncoder(cfg, 1, lib=sp).train()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    a = inputs["voxel_features"].clone().requires_grad_(True)
    b = inputs["voxel_features"].clone().requires_grad_(True)
    out_ms = ours(b, inputs["coors"])["spatial_features"]
    out_sp = theirs(a, inputs["coors"])["spatial_features"]
    assert out_ms.shape == out_sp.shape == (1, 256, 8, 8)
    _close(out_ms, out_sp, STACK_TOL, f"{config} encoder output")
    w = torch.randn(out_ms.shape, generator=torch.Generator().manual_seed(10))
    (out_ms * w).sum().backward()
    (out_sp * w).sum().backward()
    _close(b.grad, a.grad, STACK_TOL, f"{config} grad features")
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        _close(p.grad, theirs_params[name].grad, STACK_TOL, f"{config} grad {name}")


def _rel(got, want, metric):
    """max |a - b| / max |b| or ||a - b|| / ||b|| in float64."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape and torch.isfinite(got).all() and torch.isfinite(want).all()
    if metric == "max":
        return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def _encoder_step(model, features, coors):
    """One training-mode forward + backward of <output, w> (w: fixed random weights, float32
    values in the output's dtype): (output, {name: gradient}), the input features' gradient
    under "features"."""
    leaf = features.clone().requires_grad_(True)
    out = model(leaf, coors)["spatial_features"]
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(12))
    (out * w.to(out.device, out.dtype)).sum().backward()
    grads = {"features": leaf.grad}
    grads.update({name: p.grad for name, p in model.named_parameters()})
    return out.detach(), grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: spconv's GPU build vs ours")
@pytest.mark.parametrize("config", ["centerpoint-0075-nus", "second-kitti"])
def test_full_encoder_on_the_gpu_agrees_with_spconv(config):
    """The full-size SparseEncoder (CenterPoint 0.075: [41, 1440, 1440], ~118k voxels; SECOND
    KITTI: ~16k) on the GPU: our native kernels and spconv 2.3.8's CUDA kernels on the same
    weights (ours loaded into spconv unchanged) and input, training-mode BatchNorm, each measured
    against our reference path in float64 (the truth both approximate).

    float32 output: ours within 1e-4 x max |output| of spconv's and of the float64 one (the same
    products summed in other orders: rounding ~1e-7 a layer, amplified by the batch statistics
    over 10-13 layers, as in the recipe's docstring; measured 2.3e-6 / 1.1e-6, H100 2026-12-05).
    float32 gradients (L2 norm per tensor): at CenterPoint's size BOTH libraries' gradients are
    ~1e-3 from float64 (H100, 2026-12-05: medians over the 64 tensors ours 1.35e-3, spconv
    1.25e-3; worst 3.0e-3 / 3.3e-3), the float32 conditioning of a 13-layer training-mode
    network over 118k sites (a ReLU input rounding across zero, batch statistics), not either
    library, and which tensor lands further off varies (per tensor ours was 0.4-2.5x spconv's).
    So the bound is on the whole set: the median and the worst of ours no more than 1.5 x
    spconv's + 1e-4 (a wrong gradient is off by order 1).
    float16 output (L2 against the float64 output): ours <= 1.5 x spconv's error + 1e-3 (16-bit
    rounding alone is ~5e-4 a layer; measured ours 2.0e-3, spconv 6.3e-3 on SECOND)."""
    recipe = _recipe()
    cfg = recipe.ENCODERS[config]
    inputs = recipe.make_inputs(recipe.VOXELS[config], 1, "cuda")
    x, coors = inputs["voxel_features"], inputs["coors"]
    torch.manual_seed(11)
    ours = recipe.SparseEncoder(cfg, 1, "native").cuda().train()
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    theirs = recipe.SparseEncoder(cfg, 1, lib=sp).cuda().train()
    theirs.load_state_dict(state, strict=True)
    truth = recipe.SparseEncoder(cfg, 1, "reference").cuda().double().train()
    truth.load_state_dict(state, strict=True)
    out_64, g_64 = _encoder_step(truth, x.double(), coors)
    out_ms, g_ms = _encoder_step(ours, x, coors)
    out_sp, g_sp = _encoder_step(theirs, x, coors)
    assert out_ms.shape == out_sp.shape == out_64.shape and (out_64 != 0).any()
    out_err = {"ours vs spconv": _rel(out_ms, out_sp, "max"), "ours": _rel(out_ms, out_64, "max"),
               "spconv": _rel(out_sp, out_64, "max")}  # fmt: skip
    ours_err = {k: _rel(g, g_64[k], "l2") for k, g in g_ms.items()}
    spconv_err = {k: _rel(g, g_64[k], "l2") for k, g in g_sp.items()}
    stats = {}
    for side, err in (("ours", ours_err), ("spconv", spconv_err)):
        stats[side + " median"] = sorted(err.values())[len(err) // 2]
        stats[side + " worst"] = max(err.values())
    print(
        f"\n{config} float32, {coors.shape[0]} voxels: output max-rel {out_err}; gradients vs "
        f"float64 (l2) {stats}, features: ours {ours_err['features']:.3g} spconv "
        f"{spconv_err['features']:.3g}"
    )
    assert out_err["ours vs spconv"] <= 1e-4 and out_err["ours"] <= 1e-4, out_err
    for stat in ("median", "worst"):
        assert stats["ours " + stat] <= 1.5 * stats["spconv " + stat] + 1e-4, (config, stats)

    # float16 forward from the same starting state
    ours.load_state_dict(state)
    theirs.load_state_dict(state)
    ours.half(), theirs.half()
    with torch.no_grad():
        err_sp = _rel(theirs(x.half(), coors)["spatial_features"], out_64, "l2")
        err_ms = _rel(ours(x.half(), coors)["spatial_features"], out_64, "l2")
    print(f"{config} float16 output vs float64 (l2): ours {err_ms:.3g}, spconv {err_sp:.3g}")
    assert err_ms <= 1.5 * err_sp + 1e-3, (config, err_ms, err_sp)
