"""`sparse_rulebook`: the rule book of a sparse convolution / max pool (spconv's and mmcv's
`get_indice_pairs`): which input site feeds which output site through which kernel offset, and
the output sites. Layout, order and the duplicate rule: mu_space/ops/_sparse.py and
docs/operators/sparse_conv.md.

Reference path (here): linearised int64 (batch, spatial...) keys; SubM looks every (input,
offset) neighbour up in the sorted input keys (searchsorted); strided / transposed conv
computes every output site an input reaches, takes the sorted unique keys as the outputs
(ascending (b, z, y, x)) and finds each pair's output row by searchsorted; the pairs of each
offset are compacted in ascending input row (a cumulative sum). Vectorised over points and
offsets; no Python loop over points.

Native part (mu_space/ops/_sparse_native.py, csrc/sparse/sparse_rulebook_musa.mu; verified
on an H200: docs/operators/sparse_conv.md): a GPU hash table of the input keys (SubM lookups);
for strided / transposed the output sites as the set bits of a bitmap of the output grid, a
row's rank among them its output row (grids of at most 64 cells per (offset, input) candidate),
or the sorted unique output keys in a second hash table (candidates -> torch.sort -> unique);
then a stable per-offset compaction over tiles of inputs: the same layout and order, so the
native and reference rule books are equal element by element. One host synchronisation (the
error flags, and M for strided / transposed); none for a SubM rule book over sites already
checked for the same grid (_sparse_native.VALID_SITES).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mu_space.ops import _opdef, _sparse, _sparse_native


class RuleBook(NamedTuple):
    """`sparse_rulebook`'s outputs: out_indices [M, ndim + 1] int32, indice_pairs [K, 2, N]
    int32 (-1 padded), indice_pair_num [K] int32."""

    out_indices: torch.Tensor
    indice_pairs: torch.Tensor
    indice_pair_num: torch.Tensor


ENTRY_POINTS = ("sparse_rulebook_subm", "sparse_rulebook_forward")


def _parse(indices, *geometry):
    """The checked arguments: indices' rows and the geometry (batch_size, spatial_shape,
    kernel_size, stride, padding, dilation, output_padding, subm, transposed), whose parse is
    kept per distinct value tuple (_GEOMETRIES): a layer passes the same values on every call,
    and the parse took ~20 us of host time per call (CPU, cProfile, 2026-12-03)."""
    ndim = _sparse.check_indices(indices)
    key = _geometry_key(ndim, geometry)
    info = _GEOMETRIES.get(key) if key is not None else None
    if info is None:
        info = _parse_geometry(ndim, *geometry)
        if key is not None:
            if len(_GEOMETRIES) >= _MAX_GEOMETRIES:
                _GEOMETRIES.clear()
            _GEOMETRIES[key] = info
    return {**info, "n": indices.shape[0]}


_GEOMETRIES: dict = {}
_MAX_GEOMETRIES = 256


def _geometry_key(ndim: int, geometry) -> tuple | None:
    """A hashable key of plain values (ints, bools, lists / tuples of ints), types included so
    that True never stands for 1; None where a value is anything else (parsed every call)."""
    key = [ndim]
    for v in geometry:
        t = type(v)
        if t is int or t is bool:
            key.append((t, v))
        elif (t is list or t is tuple) and all(type(e) is int for e in v):
            key.append(tuple(v))
        else:
            return None
    return tuple(key)


def _parse_geometry(
    ndim, batch_size, spatial_shape, kernel_size, stride, padding, dilation, output_padding,
    subm, transposed,
):  # fmt: skip
    batch_size = _sparse.as_int(batch_size, "batch_size", 1, _sparse.INT32_MAX)
    spatial = _sparse.spatial_shape_arg(spatial_shape, ndim)
    ksize = _sparse.int_list(kernel_size, "kernel_size", ndim, 1, _sparse.MAX_KERNEL_VOLUME)
    k_volume = math.prod(ksize)
    if k_volume > _sparse.MAX_KERNEL_VOLUME:
        raise ValueError(
            f"kernel_size {ksize} has {k_volume} offsets; at most {_sparse.MAX_KERNEL_VOLUME}"
        )
    stride = _sparse.int_list(stride, "stride", ndim, 1, _sparse.INT32_MAX)
    padding = _sparse.int_list(padding, "padding", ndim, 0, _sparse.INT32_MAX)
    dilation = _sparse.int_list(dilation, "dilation", ndim, 1, _sparse.INT32_MAX)
    output_padding = _sparse.int_list(output_padding, "output_padding", ndim, 0, _sparse.INT32_MAX)
    subm = _sparse.as_bool(subm, "subm")
    transposed = _sparse.as_bool(transposed, "transposed")
    if subm and transposed:
        raise ValueError("subm and transposed cannot both be set")
    if subm:
        out_shape = spatial
    elif transposed:
        out_shape = _sparse.deconv_output_size(
            spatial, ksize, stride, padding, dilation, output_padding
        )
    else:
        out_shape = _sparse.conv_output_size(spatial, ksize, stride, padding, dilation)
    if min(out_shape) < 1:
        raise ValueError(
            f"the output spatial shape {out_shape} is empty: kernel_size {ksize} (dilation "
            f"{dilation}) does not fit spatial_shape {spatial} with padding {padding}"
        )
    if max(out_shape) > _sparse.INT32_MAX:
        raise ValueError(f"the output spatial shape {out_shape} exceeds int32 coordinates")
    _sparse.check_key_range(batch_size, spatial, "spatial_shape")
    _sparse.check_key_range(batch_size, out_shape, "the output spatial shape (padding, stride)")
    # tuples: the parse is shared by every call with these values (_GEOMETRIES)
    return dict(
        ndim=ndim, batch_size=batch_size, spatial=tuple(spatial), ksize=tuple(ksize),
        K=k_volume, stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation),
        subm=subm, transposed=transposed, out_shape=tuple(out_shape),
    )  # fmt: skip


def _check(*args) -> _opdef.Checked:
    info = _parse(*args)
    return _opdef.Checked(args[0].device, torch.int32, None, info, "indices")


def sparse_rulebook_reference(
    indices, batch_size, spatial_shape, kernel_size, stride, padding, dilation, output_padding,
    subm, transposed,
):  # fmt: skip
    """Vectorised PyTorch rule book (sorting / searchsorted of int64 keys)."""
    c = _parse(
        indices, batch_size, spatial_shape, kernel_size, stride, padding, dilation,
        output_padding, subm, transposed,
    )  # fmt: skip
    n, K, ndim, dev = c["n"], c["K"], c["ndim"], indices.device
    _sparse.validate_index_values(indices, c["batch_size"], c["spatial"])
    in_keys = _sparse.linear_keys(indices, c["spatial"])
    sorted_keys, order = torch.sort(in_keys, stable=True)
    _sparse.reject_duplicates(sorted_keys, order, indices)

    offs = _sparse.kernel_offsets(c["ksize"], dev)  # [K, ndim]
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    dil, pad, stride = as_t(c["dilation"]), as_t(c["padding"]), as_t(c["stride"])
    out_shape = as_t(c["out_shape"])
    site = indices[:, 1:].long()[None, :, :]  # [1, N, ndim]
    shift = (offs * dil)[:, None, :]  # [K, 1, ndim]
    if c["subm"] or not c["transposed"]:
        num = site + pad - shift  # stride * out = in + pad - k * d
        if c["subm"]:
            q, valid = num, torch.ones(num.shape[:2], dtype=torch.bool, device=dev)
        else:
            valid = (num % stride == 0).all(-1)
            q = torch.div(num, stride, rounding_mode="floor")
    else:
        q = site * stride - pad + shift  # out = in * stride - pad + k * d
        valid = torch.ones(q.shape[:2], dtype=torch.bool, device=dev)
    valid &= ((q >= 0) & (q < out_shape)).all(-1)  # [K, N]
    batch = indices[:, 0].long()[None, :].expand(K, n)
    keys = _sparse.linear_keys(torch.cat((batch[..., None], q), dim=-1), c["out_shape"])
    keys = torch.where(valid, keys, -1)

    if c["subm"]:
        pos = torch.searchsorted(sorted_keys, keys).clamp(max=max(n - 1, 0))
        if n:
            valid &= sorted_keys[pos] == keys
            out_row = order[pos]
        else:
            out_row = pos
        out_indices = indices.clone()
    else:
        uniq = torch.unique(keys[valid])  # sorted: ascending (b, z, y, x)
        out_row = torch.searchsorted(uniq, keys)
        out_indices = _sparse.decode_keys(uniq, c["out_shape"]).reshape(-1, ndim + 1)

    pairs = torch.full((K, 2, n), -1, dtype=torch.int32, device=dev)
    kk, nn = valid.nonzero(as_tuple=True)  # row-major: ascending input row within an offset
    slot = (torch.cumsum(valid, dim=1) - 1)[kk, nn]
    pairs[kk, 0, slot] = nn.to(torch.int32)
    pairs[kk, 1, slot] = out_row[kk, nn].to(torch.int32)
    counts = valid.sum(dim=1).to(torch.int32)
    return RuleBook(out_indices, pairs, counts)


def _fake(indices, batch_size, spatial_shape, kernel_size, *rest):
    n, cols = indices.shape
    K = math.prod(_sparse.int_list(kernel_size, "kernel_size", cols - 1, 1))
    m = torch.library.get_ctx().new_dynamic_size()
    return (
        indices.new_empty((m, cols)),
        indices.new_empty((K, 2, n)),
        indices.new_empty((K,)),
    )


def _samples(device) -> list[_opdef.Sample]:
    idx, shape = _sparse.tiny_indices("cpu")
    idx = idx.to(device)
    one = idx[idx[:, 0] == 0]
    return [
        _opdef.Sample("SubM 3x3x3, 2 frames", (idx, 2, shape, 3, 1, 1, 1, 0, True, False)),
        _opdef.Sample("stride 2 pad 1, 2 frames", (idx, 2, shape, 3, 2, 1, 1, 0, False, False)),
        _opdef.Sample(
            "SECOND down (3, 1, 1) stride (2, 1, 1)",
            (one, 1, shape, [3, 1, 1], [2, 1, 1], 0, 1, 0, False, False),
        ),
        _opdef.Sample("transposed 2, stride 2", (one, 1, shape, 2, 2, 0, 1, 0, False, True)),
        _opdef.Sample("no rows", (idx[:0], 2, shape, 3, 1, 0, 1, 0, True, False)),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="sparse_rulebook",
        family="sparse",
        schema="(Tensor indices, int batch_size, int[] spatial_shape, int[] kernel_size, "
        "int[] stride, int[] padding, int[] dilation, int[] output_padding, bool subm, "
        "bool transposed) -> (Tensor, Tensor, Tensor)",
        check=_check,
        reference=sparse_rulebook_reference,
        native=_sparse_native.rulebook_native,  # hash table + compaction (_sparse_native.py)
        unverified=_sparse_native.UNVERIFIED,
        fake=_fake,
        result=RuleBook,
        native_dtypes=(torch.int32,),
        entry_points=ENTRY_POINTS,
        samples=_samples,
        upstream="spconv 2.x `ops.get_indice_pairs` / mmcv `get_indice_pairs` "
        "(`_ext.get_indice_pairs_{2,3,4}d_forward`)",
        models="SECOND, PointPillars-free voxel backbones: CenterPoint, PV-RCNN, Part-A2 "
        "(SparseEncoder), BEVFusion LiDAR branch",
        # the containers / tensor the swapped layers build their rule books from
        patches=("spconv.SparseConvTensor", "spconv.SparseSequential", "spconv.ToDense"),
        doc="docs/operators/sparse_conv.md",
    )
)


@OP.export
def sparse_rulebook(
    indices: torch.Tensor,
    batch_size: int,
    spatial_shape,
    kernel_size=3,
    stride=1,
    padding=0,
    dilation=1,
    output_padding=0,
    subm: bool = False,
    transposed: bool = False,
    *,
    backend: str = "auto",
) -> RuleBook:
    """The rule book of a sparse conv / pool over the active sites `indices` (spconv's
    `get_indice_pairs`, mmcv's `get_indice_pairs_{2,3,4}d_forward` without the unused grid).

    indices: Tensor[N, ndim + 1] int32 rows (batch, z, y, x) (2-D: (batch, y, x)), each inside
    [0, batch_size) x [0, spatial_shape) and no two equal (a duplicate site is a ValueError).
    kernel_size / stride / padding / dilation / output_padding: an int or ndim ints.

        strided:    output o is fed by input p through offset k  iff  o * stride = p + padding -
                    k * dilation; outputs = every site some input reaches, in the output grid
                    (in + 2 padding - dilation (k - 1) - 1) // stride + 1 (spconv's formula)
        transposed: o = p * stride - padding + k * dilation in the grid (in - 1) stride -
                    2 padding + dilation (k - 1) + output_padding + 1
        subm:       outputs = the inputs (same rows, same order); o = p + padding - k *
                    dilation must be an input site (spconv passes padding = k // 2 * dilation)

    Returns RuleBook(out_indices [M, ndim + 1] int32 (strided / transposed: ascending
    linearised (b, z, y, x); subm: a copy of indices), indice_pairs [K, 2, N] int32 (per offset
    k the (input row, output row) pairs in ascending input row, then -1), indice_pair_num [K]
    int32), K = prod(kernel_size) in row-major kernel order. No gradient."""
    nd = indices.shape[1] - 1 if isinstance(indices, torch.Tensor) and indices.dim() == 2 else 3
    spatial = list(spatial_shape) if isinstance(spatial_shape, tuple) else spatial_shape
    sizes = (_as_list(v, nd) for v in (kernel_size, stride, padding, dilation, output_padding))
    return OP(indices, batch_size, spatial, *sizes, subm, transposed, backend=backend)


def _as_list(value, ndim: int):
    """An int expanded to ndim items (validation happens in the op's check)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * ndim
    if isinstance(value, tuple):
        return list(value)
    return value
