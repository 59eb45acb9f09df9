"""`sparse_maxpool`: max pooling over a rule book (spconv's `SparseMaxPool3d`, mmcv's
`indice_maxpool`), forward and backward.

    out[o, c] = max over the pairs (i, o) of every offset of features[i, c]   (0 where no pair
                reaches o; NaN propagates)
    grad_features[i, c] = sum over the pairs (i, o) with features[i, c] == out[o, c] of
                grad_out[o, c]       (spconv's / mmcv's rule: every input equal to the maximum
                                      receives the output's gradient)

One deliberate difference: spconv's native path and mmcv start the maximum at 0 (their output
buffer is zeroed), so a window of negative features pools to 0 there; here the maximum is the
true maximum (what a dense max_pool3d over the active sites gives). `mu_space.sparse.mmcv_ext`
applies mmcv's zero floor for the `_ext` contract.

Reference path (here): a loop over the K offsets (never over points): per offset a gather, an
element-wise maximum and a write back (the output rows of one offset are distinct, so the
writes never conflict), then the comparison for the gradient; deterministic.

Native part (csrc/sparse/sparse_maxpool_musa.mu; GPU suite passed on an
H200, sanitizers pending: `unverified`): `sparse_maxpool_forward` / `_backward`, one launch per offset over the rule book
(the output rows of an offset are distinct: no atomics); the backward recomputes the maximum.
"""

from __future__ import annotations

import torch

from mu_space.ops import _opdef, _sparse, _sparse_native

ENTRY_POINTS = ("sparse_maxpool_forward", "sparse_maxpool_backward")


def _check(features, indice_pairs, indice_pair_num, num_out) -> _opdef.Checked:
    _sparse.check_features(features)
    k = _sparse.check_rulebook(indice_pairs, indice_pair_num, features)
    num_out = _sparse.count_arg(num_out, "num_out")
    n, c = features.shape
    return _opdef.Checked(
        features.device,
        features.dtype,
        (((num_out, c), features.dtype),),
        (n, num_out, k, c),
        "features",
    )


def _pool(features, indice_pairs, indice_pair_num, num_out):
    n, m, k, c = _check(features, indice_pairs, indice_pair_num, num_out).info
    pairs = _sparse.pair_lists(indice_pairs, indice_pair_num, n, m, False)
    out = torch.full((m, c), -torch.inf, dtype=features.dtype, device=features.device)
    hit = torch.zeros(m, dtype=torch.bool, device=features.device)
    for _, src, dst in pairs:
        out[dst] = torch.maximum(out[dst], features[src])  # distinct rows within an offset
        hit[dst] = True
    out = torch.where(hit[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out, pairs


def sparse_maxpool_reference(features, indice_pairs, indice_pair_num, num_out):
    """Vectorised PyTorch max per output over its rule-book inputs."""
    return _pool(features, indice_pairs, indice_pair_num, num_out)[0]


def sparse_maxpool_backward_reference(grad_out, features, indice_pairs, indice_pair_num, num_out):
    """(grad_features,): the output's gradient to every input equal to the output's maximum."""
    out, pairs = _pool(features, indice_pairs, indice_pair_num, num_out)
    acc = _sparse.acc_dtype(features.dtype)
    g = grad_out.to(acc)
    grad = torch.zeros(features.shape, dtype=acc, device=features.device)
    for _, src, dst in pairs:
        eq = features[src] == out[dst]
        grad.index_add_(0, src, torch.where(eq, g[dst], torch.zeros((), dtype=acc)))
    return (grad.to(features.dtype),)


def _precondition(features, indice_pairs, indice_pair_num, num_out):
    return _sparse.pairs_consistent(indice_pairs, indice_pair_num)


def _samples(device) -> list[_opdef.Sample]:
    from mu_space.ops.sparse_rulebook import sparse_rulebook

    idx, shape = _sparse.tiny_indices("cpu")
    rb = sparse_rulebook(idx, 2, shape, 2, 2, 0, 1, 0, False, False, backend="reference")
    rb3 = sparse_rulebook(idx, 2, shape, 3, 2, 1, 1, 0, False, False, backend="reference")
    gen = torch.Generator().manual_seed(11)
    feats = torch.randn(idx.shape[0], 16, generator=gen)
    m, m3 = rb.out_indices.shape[0], rb3.out_indices.shape[0]

    def on(*a):
        return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in a)

    return [
        _opdef.Sample(
            "2x2x2 stride 2 (fwd + bwd)",
            on(feats, rb.indice_pairs, rb.indice_pair_num, m),
            grad=True,
        ),
        _opdef.Sample(
            "3x3x3 stride 2 pad 1 (fwd + bwd)",
            on(feats, rb3.indice_pairs, rb3.indice_pair_num, m3),
            grad=True,
        ),
        _opdef.Sample("3x3x3 float16", on(feats.half(), rb3.indice_pairs, rb3.indice_pair_num, m3)),
        _opdef.Sample(
            "2x2x2 bfloat16 (fwd + bwd)",
            on(feats.bfloat16(), rb.indice_pairs, rb.indice_pair_num, m),
            grad=True,
        ),
        _opdef.Sample(
            "no rows",
            on(feats[:0], rb.indice_pairs[:, :, :0], torch.zeros_like(rb.indice_pair_num), 0),
            grad=True,
        ),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="sparse_maxpool",
        family="sparse",
        schema="(Tensor features, Tensor indice_pairs, Tensor indice_pair_num, int num_out) "
        "-> Tensor",
        check=_check,
        reference=sparse_maxpool_reference,
        native=_sparse_native.maxpool_native,  # per-offset max kernels (_sparse_native.py)
        backward=_opdef.Backward(
            inputs=("features",),
            reference=sparse_maxpool_backward_reference,
            native=_sparse_native.maxpool_backward_native,
        ),
        precondition=_precondition,
        native_dtypes=_sparse.NATIVE_FEATURE_DTYPES,
        unverified=_sparse_native.UNVERIFIED,
        entry_points=ENTRY_POINTS,
        samples=_samples,
        upstream="spconv 2.x `SparseMaxPool3d` (`mu_space.sparse`), mmcv "
        "`_ext.indice_maxpool_forward` / `indice_maxpool_backward`",
        models="sparse voxel backbones with max pooling (SparseMaxPool3d)",
        patches=("spconv.SparseMaxPool3d",),
        doc="docs/operators/sparse_conv.md",
    )
)


@OP.export
def sparse_maxpool(
    features: torch.Tensor,
    indice_pairs: torch.Tensor,
    indice_pair_num: torch.Tensor,
    num_out: int,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Max pooling over a rule book (`sparse_rulebook`) -> Tensor[num_out, C]:

        out[o, c] = max of features[i, c] over the pairs (i, o) of all offsets
                    (0 for an output no pair reaches; NaN propagates)

    features: Tensor[N, C] float32 / float16 / bfloat16 (float64 reference path);
    indice_pairs [K, 2, P] / indice_pair_num [K] int32. Differentiable w.r.t. features: each
    output's gradient goes to every input holding its maximum (spconv's and mmcv's tie rule).
    The maximum starts at -inf, not at 0 as in spconv's native path and mmcv (module docstring).
    Deterministic, no atomics."""
    return OP(features, indice_pairs, indice_pair_num, num_out, backend=backend)
