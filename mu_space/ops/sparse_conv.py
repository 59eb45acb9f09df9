"""`sparse_conv`: the gather -> GEMM -> scatter-add of a sparse convolution over a rule book
(spconv's / mmcv's `indice_conv`), forward, input gradient and weight gradient.

    out[o] = sum over offsets k, pairs (i, o) of offset k:  features[i] @ weight[k]

weight is [K, C_in, C_out] (the GEMM layout: mmcv's [*kernel, C_in, C_out] filters flattened;
the spconv 2.x modules hold [C_out, *kernel, C_in] and pass a permuted view). `inverse=True`
runs the rule book backwards (gathers the output side, scatters to the input side): spconv's
inverse convolution.

Reference path (here): a loop over the K kernel offsets (never over points): gather the rows,
one torch.mm, index_add into the output. float32 accumulation for float16 / bfloat16 (float64
for float64), rounded once. Within an offset every output row occurs once (the rule-book
invariant), so the scatter has no conflicts: forward and backward are deterministic, no
atomics needed. The backward is the real op `mu_space::sparse_conv_backward`: grad_features
= the same loop with weight[k]^T, scattered to the gathered side; grad_weight[k] =
features[gathered]^T @ grad_out[scattered].

Native part (mu_space/ops/_sparse_native.py, csrc/sparse/sparse_conv_musa.mu): the rule
book's neighbour maps (`sparse_conv_maps`, once per rule book), then for float32 the implicit
GEMM (`sparse_conv_implicit_gemm`: sum_k features[out_map[:, k]] @ weight[k], the gathered rows
staged in shared memory; the input gradient the same over in_map with weight^T; the weight
gradient `sparse_conv_implicit_wgrad` up to 16 output channels), and for float16 / bfloat16 (and
wider float32 weight gradients) the im2col path: `sparse_conv_im2col` (features[out_map] ->
[rows, K C_in]) and one torch.mm per chunk of rows; backward cols^T @ grad_out and
grad_out[in_map] @ weight^T. No atomics, deterministic. A rule
book listing a row twice in one offset (outside the rule-book invariant) runs the reference.
Kept for empty sizes and A/B timing, the per-offset path: `sparse_pairs_check` (clamped counts
and their starts), `sparse_conv_gather`, torch.mm per offset, `sparse_conv_scatter` (plain adds
per offset, in offset order: conflict-free, deterministic). One host sync per rule book at most.
"""

from __future__ import annotations

import torch

from mu_space.ops import _opdef, _sparse, _sparse_native
from mu_space.ops._checks import check_same_device, check_tensor, dtype_name

# maps, im2col (torch.mm after), the implicit GEMMs; check, gather, scatter (the per-offset path)
ENTRY_POINTS = _sparse_native.IM2COL_ENTRY_POINTS + _sparse_native.PAIR_ENTRY_POINTS


def _check(features, weight, indice_pairs, indice_pair_num, num_out, inverse) -> _opdef.Checked:
    _sparse.check_features(features)
    check_tensor(weight, "weight")
    check_same_device(weight, "weight", features, "features")
    if weight.dtype != features.dtype:
        raise TypeError(
            f"weight must have the dtype of features ({dtype_name(features.dtype)}), got "
            f"{dtype_name(weight.dtype)}"
        )
    if weight.dim() != 3:
        raise ValueError(f"weight must be 3-D [K, C_in, C_out], got shape {tuple(weight.shape)}")
    k, c_in, c_out = weight.shape
    if c_in != features.shape[1]:
        raise ValueError(
            f"weight.shape[1] (C_in) must be {features.shape[1]} (the channels of features), "
            f"got {c_in}"
        )
    _sparse.check_rulebook(indice_pairs, indice_pair_num, features, k)
    num_out = _sparse.count_arg(num_out, "num_out")
    inverse = _sparse.as_bool(inverse, "inverse")
    return _opdef.Checked(
        features.device,
        features.dtype,
        (((num_out, c_out), features.dtype),),
        (features.shape[0], num_out, k, c_in, c_out, inverse),
        "features",
    )


def sparse_conv_reference(features, weight, indice_pairs, indice_pair_num, num_out, inverse):
    """Vectorised PyTorch gather -> mm -> index_add per kernel offset."""
    n, m, k, c_in, c_out, inverse = _check(
        features, weight, indice_pairs, indice_pair_num, num_out, inverse
    ).info
    acc = _sparse.acc_dtype(features.dtype)
    out = torch.zeros((m, c_out), dtype=acc, device=features.device)
    for kk, src, dst in _sparse.pair_lists(indice_pairs, indice_pair_num, n, m, inverse):
        out.index_add_(0, dst, torch.mm(features[src].to(acc), weight[kk].to(acc)))
    return out.to(features.dtype)


def sparse_conv_backward_reference(
    grad_out, features, weight, indice_pairs, indice_pair_num, num_out, inverse
):
    """(grad_features [N, C_in], grad_weight [K, C_in, C_out]) in the inputs' dtype."""
    n, m, k, c_in, c_out, inverse = _check(
        features, weight, indice_pairs, indice_pair_num, num_out, inverse
    ).info
    acc = _sparse.acc_dtype(features.dtype)
    g = grad_out.to(acc)
    grad_x = torch.zeros((n, c_in), dtype=acc, device=features.device)
    grad_w = torch.zeros((k, c_in, c_out), dtype=acc, device=features.device)
    for kk, src, dst in _sparse.pair_lists(indice_pairs, indice_pair_num, n, m, inverse):
        g_k = g[dst]
        grad_w[kk] = torch.mm(features[src].to(acc).t(), g_k)
        grad_x.index_add_(0, src, torch.mm(g_k, weight[kk].to(acc).t()))
    return grad_x.to(features.dtype), grad_w.to(weight.dtype)


def _precondition(features, weight, indice_pairs, indice_pair_num, num_out, inverse):
    reason = _sparse.pairs_consistent(indice_pairs, indice_pair_num)
    if reason is None and weight.numel() and not bool(torch.isfinite(weight).all()):
        # the native GEMMs (im2col, implicit) multiply every (output, offset) slot, 0 for a missing
        # neighbour, so 0 x inf = NaN reaches outputs the reference's pair products never form
        # (as spconv's implicit GEMM does); finite weights: the same results
        reason = "weight has a non-finite entry: which outputs become NaN / inf is unspecified"
    return reason


def sample_case(device, *, subm=True, stride=2, c_in=4, c_out=8, inverse=False, seed=3):
    """(features, weight [K, C_in, C_out], indice_pairs, indice_pair_num, num_out, inverse) on
    the tiny generated LiDAR voxels (the op's samples and tests)."""
    from mu_space.ops.sparse_rulebook import sparse_rulebook

    idx, shape = _sparse.tiny_indices("cpu")
    if subm:
        rb = sparse_rulebook(idx, 2, shape, 3, 1, 1, 1, 0, True, False, backend="reference")
    else:
        rb = sparse_rulebook(idx, 2, shape, 3, stride, 1, 1, 0, False, False, backend="reference")
    gen = torch.Generator().manual_seed(seed)
    n_in = rb.out_indices.shape[0] if inverse else idx.shape[0]
    n_out = idx.shape[0] if inverse else rb.out_indices.shape[0]
    feats = torch.randn(n_in, c_in, generator=gen)
    weight = torch.randn(27, c_in, c_out, generator=gen) / 27**0.5
    return tuple(
        a.to(device) if isinstance(a, torch.Tensor) else a
        for a in (feats, weight, rb.indice_pairs, rb.indice_pair_num, n_out, inverse)
    )


def _samples(device) -> list[_opdef.Sample]:
    subm = sample_case(device)
    down = sample_case(device, subm=False)
    inv = sample_case(device, subm=False, inverse=True, c_in=8, c_out=4)
    f, w, p, n, m, i = subm
    empty_pairs = torch.full((27, 2, 0), -1, dtype=torch.int32, device=p.device)
    return [
        _opdef.Sample("SubM 3x3x3 C 4 -> 8 (fwd + bwd)", subm, grad=True),
        _opdef.Sample("stride 2 (fwd + bwd)", down, grad=True),
        _opdef.Sample("inverse of stride 2 (fwd + bwd)", inv, grad=True),
        _opdef.Sample("SubM float16", (f.half(), w.half(), p, n, m, i)),
        _opdef.Sample(
            "SubM bfloat16 (fwd + bwd)", (f.bfloat16(), w.bfloat16(), p, n, m, i), grad=True
        ),
        _opdef.Sample("no rows", (f[:0], w, empty_pairs, torch.zeros_like(n), 0, False), grad=True),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="sparse_conv",
        family="sparse",
        schema="(Tensor features, Tensor weight, Tensor indice_pairs, Tensor indice_pair_num, "
        "int num_out, bool inverse) -> Tensor",
        check=_check,
        reference=sparse_conv_reference,
        native=_sparse_native.conv_native,  # implicit GEMM or im2col (_sparse_native.py)
        backward=_opdef.Backward(
            inputs=("features", "weight"),
            reference=sparse_conv_backward_reference,
            native=_sparse_native.conv_backward_native,
        ),
        precondition=_precondition,
        native_dtypes=_sparse.NATIVE_FEATURE_DTYPES,
        unverified=_sparse_native.CONV_UNVERIFIED,
        entry_points=ENTRY_POINTS,
        samples=_samples,
        upstream="spconv 2.x `SubMConv3d` / `SparseConv3d` / `SparseInverseConv3d` "
        "(`mu_space.sparse`), mmcv `_ext.indice_conv_forward` / `indice_conv_backward`",
        models="SECOND, CenterPoint, PV-RCNN, Part-A2 (SparseEncoder), BEVFusion LiDAR branch",
        patches=(
            "spconv.SubMConv3d",
            "spconv.SparseConv3d",
            "spconv.SparseInverseConv3d",
            "spconv.SubMConv2d",
            "spconv.SparseConv2d",
        ),
        recipes=("model_examples/CenterPoint",),
        doc="docs/operators/sparse_conv.md",
    )
)


@OP.export
def sparse_conv(
    features: torch.Tensor,
    weight: torch.Tensor,
    indice_pairs: torch.Tensor,
    indice_pair_num: torch.Tensor,
    num_out: int,
    inverse: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Sparse convolution over a rule book (spconv / mmcv `indice_conv`) -> Tensor[num_out,
    C_out]:

        out[o] = sum_k sum_{(i, o) in pairs[k]} features[i] @ weight[k]
        pairs[k] = (indice_pairs[k, 0, j], indice_pairs[k, 1, j]) for j < indice_pair_num[k]
                   (inverse=True: (indice_pairs[k, 1, j] -> indice_pairs[k, 0, j]))

    Args:
        features: Tensor[N, C_in] float32 / float16 / bfloat16 (float64 reference path).
        weight: Tensor[K, C_in, C_out], features' dtype (spconv's [C_out, *k, C_in] weight is
            `w.reshape(C_out, K, C_in).permute(1, 2, 0)`; mmcv's [*k, C_in, C_out] filters are
            `f.reshape(K, C_in, C_out)`).
        indice_pairs / indice_pair_num: the rule book (`sparse_rulebook`), int32.
        num_out: output rows M (the rule book's output count; the forward input count for
            inverse=True).
        inverse: run the rule book from its output side to its input side.

    float32 accumulation (float64 for float64), one rounding. Differentiable w.r.t. features and
    weight (the backward is the op `sparse_conv_backward`); deterministic, no atomics. Rows of
    indice_pairs outside [0, N) / [0, num_out) or counts outside [0, P] are a ValueError."""
    return OP(features, weight, indice_pairs, indice_pair_num, num_out, inverse, backend=backend)
