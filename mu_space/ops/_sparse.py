"""Sparse-convolution family helpers (docs/operators/sparse_conv.md): the argument rules that
sparse_rulebook, sparse_conv and sparse_maxpool share (one rule, one message), the output-size
formulas, the linearised coordinate keys, and the rule-book validation of the reference paths.

The rule book (one layout, shared by every op of the family and by mmcv's `_ext` contract):

    indice_pairs     Tensor[K, 2, P] int32: for kernel offset k, indice_pairs[k, 0, :n_k] are
                     input rows and indice_pairs[k, 1, :n_k] the output rows they feed; the rest
                     of the row is -1. P = the input row count (each input meets each offset at
                     most once). Pairs of one offset are in ascending input row.
    indice_pair_num  Tensor[K] int32: n_k
    out_indices      Tensor[M, ndim + 1] int32 (batch, spatial...): ascending linearised
                     (b, z, y, x) for strided / transposed conv, the input rows for SubM.

K = prod(kernel_size), offsets in row-major order of the kernel window (the last spatial axis
fastest), which is also the order of the weight's kernel axes. Within one offset every input row
and every output row occurs at most once: the per-offset scatter has no conflicts, so the
reference (and the native kernels) accumulate without atomics, deterministically.
"""

from __future__ import annotations

import functools
import math
import operator

import torch

from mu_space.ops._checks import check_same_device, check_tensor, dtype_name

INT32_MAX = 2**31 - 1
MAX_NDIM = 4
MAX_KERNEL_VOLUME = 4096  # mmcv's and spconv 1.x's limit (kernelVolume <= 4096)
KEY_LIMIT = 2**62  # linearised (batch, spatial) keys are int64
FEATURE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
NATIVE_FEATURE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- scalar arguments


def as_int(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """A Python / numpy integer (not a bool) within [lo, hi], else TypeError / ValueError."""
    if type(value) is int and (lo is None or value >= lo) and (hi is None or value <= hi):
        return value  # the common case, checked first (bool is a subclass, not this type)
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def as_bool(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # mmcv passes int(subm)
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def int_list(value, name: str, ndim: int, lo: int | None = None, hi: int | None = None):
    """An int (repeated ndim times) or a sequence of ndim ints, each within [lo, hi]."""
    if (
        type(value) in (list, tuple)
        and len(value) == ndim
        and all(type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi)
                for v in value)
    ):  # fmt: skip
        return list(value)  # the common case: a layer's own lists (~180 per encoder forward)
    if isinstance(value, torch.Tensor):
        value = value.tolist() if value.dim() else int(value)
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays
        items = list(value.tolist())
    else:
        items = [as_int(value, name, lo, hi)] * ndim
    if len(items) != ndim:
        raise ValueError(f"{name} must have {ndim} values (one per spatial axis), got {len(items)}")
    return [as_int(v, f"{name}[{i}]", lo, hi) for i, v in enumerate(items)]


def expand_nd(ndim: int, value, name: str = "value"):
    """spconv's expand_nd: an int repeated, or a sequence of ndim ints, as a list."""
    return int_list(value, name, ndim)


# --------------------------------------------------------------------------- shapes


def conv_output_size(spatial_shape, kernel_size, stride, padding, dilation) -> list[int]:
    """spconv / mmcv's strided-conv output shape: (in + 2p - d(k - 1) - 1) // s + 1 per axis."""
    return [
        (i + 2 * p - d * (k - 1) - 1) // s + 1
        for i, k, s, p, d in zip(spatial_shape, kernel_size, stride, padding, dilation)
    ]


def deconv_output_size(spatial_shape, kernel_size, stride, padding, dilation, output_padding):
    """Transposed-conv output shape (spconv 2.x): (in - 1) s - 2p + d(k - 1) + output_padding + 1
    (mmcv's formula (in - 1) s - 2p + k + output_padding is the same for dilation 1)."""
    return [
        (i - 1) * s - 2 * p + d * (k - 1) + op + 1
        for i, k, s, p, d, op in zip(
            spatial_shape, kernel_size, stride, padding, dilation, output_padding
        )
    ]


def check_indices(indices, name: str = "indices") -> int:
    """indices: Tensor[N, ndim + 1] int32 (batch, spatial...), 1 <= ndim <= 4. Returns ndim."""
    check_tensor(indices, name)
    if indices.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {dtype_name(indices.dtype)}")
    if indices.dim() != 2 or not 2 <= indices.shape[1] <= MAX_NDIM + 1:
        raise ValueError(
            f"{name} must be [N, ndim + 1] (batch, spatial...) with 1 <= ndim <= {MAX_NDIM}, "
            f"got shape {tuple(indices.shape)}"
        )
    if indices.shape[0] > INT32_MAX:
        raise ValueError(f"{name} has {indices.shape[0]} rows; int32 rows allow {INT32_MAX}")
    return indices.shape[1] - 1


def spatial_shape_arg(spatial_shape, ndim: int, name: str = "spatial_shape") -> list[int]:
    if isinstance(spatial_shape, int) and not isinstance(spatial_shape, bool):
        raise TypeError(f"{name} must be a sequence of {ndim} integers, got int")
    return int_list(spatial_shape, name, ndim, lo=1, hi=INT32_MAX)


def check_key_range(batch_size: int, shape, what: str) -> None:
    volume = math.prod(shape) * batch_size
    if volume >= KEY_LIMIT:
        raise ValueError(
            f"batch_size * prod({what}) = {volume} exceeds the int64 key range (< 2**62)"
        )


# --------------------------------------------------------------------------- coordinate keys


def linear_keys(coords: torch.Tensor, shape) -> torch.Tensor:
    """int64 row-major keys of (batch, spatial...) rows [..., ndim + 1] in a grid of `shape`."""
    key = coords[..., 0].long()
    for axis, size in enumerate(shape):
        key = key * size + coords[..., axis + 1].long()
    return key


def decode_keys(keys: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of linear_keys: [M] int64 -> [M, ndim + 1] int32."""
    cols = []
    rest = keys
    for size in reversed(list(shape)):
        cols.append(rest % size)
        rest = rest // size
    cols.append(rest)
    return torch.stack(cols[::-1], dim=1).to(torch.int32)


def kernel_offsets(kernel_size, device) -> torch.Tensor:
    """[K, ndim] int64 kernel-window positions in row-major order (last axis fastest)."""
    axes = [torch.arange(k, dtype=torch.int64, device=device) for k in kernel_size]
    grids = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], dim=1)


def validate_index_values(indices, batch_size: int, spatial_shape, name="indices") -> None:
    """Every row inside [0, batch_size) x [0, spatial_shape): one reduction (one sync)."""
    if indices.shape[0] == 0:
        return
    bounds = torch.tensor([batch_size, *spatial_shape], dtype=torch.int64, device=indices.device)
    bad = ((indices < 0) | (indices.long() >= bounds)).any(dim=1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name} row {row} = {indices[row].tolist()} is outside [0, batch_size = "
            f"{batch_size}) x [0, spatial_shape = {list(spatial_shape)}) (negative entries, "
            "batch ids >= batch_size and coordinates >= spatial_shape are rejected)"
        )


def reject_duplicates(sorted_keys, order, indices, name="indices") -> None:
    """The duplicate rule: two rows of the same (batch, spatial...) site are an error (their
    features would have no single output)."""
    if sorted_keys.numel() < 2:
        return
    dup = sorted_keys[1:] == sorted_keys[:-1]
    if bool(dup.any()):
        i = int(dup.nonzero()[0, 0])
        a, b = sorted((int(order[i]), int(order[i + 1])))
        raise ValueError(
            f"{name} rows {a} and {b} are the same site {indices[a].tolist()}: duplicate "
            "coordinates are rejected (merge them first, e.g. with dynamic_scatter)"
        )


# --------------------------------------------------------------------------- rule books


def check_features(features, name: str = "features") -> None:
    check_tensor(features, name)
    if features.dtype not in FEATURE_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16, bfloat16 or float64, got "
            f"{dtype_name(features.dtype)}"
        )
    if features.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, C], got shape {tuple(features.shape)}")


def check_rulebook(indice_pairs, indice_pair_num, features, kernel_volume: int | None = None):
    """Shapes and dtypes of (indice_pairs [K, 2, P] int32, indice_pair_num [K] int32). -> K."""
    check_tensor(indice_pairs, "indice_pairs")
    check_same_device(indice_pairs, "indice_pairs", features, "features")
    if indice_pairs.dtype != torch.int32:
        raise TypeError(f"indice_pairs must be int32, got {dtype_name(indice_pairs.dtype)}")
    if indice_pairs.dim() != 3 or indice_pairs.shape[1] != 2:
        raise ValueError(
            f"indice_pairs must be [K, 2, P] (input rows, output rows), got shape "
            f"{tuple(indice_pairs.shape)}"
        )
    k = indice_pairs.shape[0]
    if not 1 <= k <= MAX_KERNEL_VOLUME:
        raise ValueError(f"indice_pairs.shape[0] (K) must be in [1, {MAX_KERNEL_VOLUME}], got {k}")
    if kernel_volume is not None and k != kernel_volume:
        raise ValueError(
            f"indice_pairs.shape[0] must be {kernel_volume} (the weight's kernel volume), got {k}"
        )
    check_tensor(indice_pair_num, "indice_pair_num")
    check_same_device(indice_pair_num, "indice_pair_num", features, "features")
    if indice_pair_num.dtype != torch.int32:
        raise TypeError(f"indice_pair_num must be int32, got {dtype_name(indice_pair_num.dtype)}")
    if indice_pair_num.dim() != 1 or indice_pair_num.shape[0] != k:
        raise ValueError(
            f"indice_pair_num must be [K] = [{k}] (one count per kernel offset), got shape "
            f"{tuple(indice_pair_num.shape)}"
        )
    return k


def pair_lists(indice_pairs, indice_pair_num, n_in: int, n_out: int, inverse: bool):
    """[(k, gather rows int64, scatter rows int64)] of the offsets with pairs, after checking
    the counts (0 <= n_k <= P) and the rows (gather rows in [0, n_in), scatter rows in
    [0, n_out)): one host copy of the K counts and one reduction. inverse: gather from the
    output side (indice_pairs[k, 1]) and scatter to the input side (spconv's inverse conv)."""
    p = indice_pairs.shape[2]
    nums = indice_pair_num.tolist()
    for k, n in enumerate(nums):
        if not 0 <= n <= p:
            raise ValueError(
                f"indice_pair_num[{k}] = {n} is outside [0, {p}] (P, the pair capacity of "
                "indice_pairs)"
            )
    src_side, dst_side = (1, 0) if inverse else (0, 1)
    lists = [
        (k, indice_pairs[k, src_side, :n], indice_pairs[k, dst_side, :n])
        for k, n in enumerate(nums)
        if n
    ]
    if not lists:
        return []
    src = torch.cat([s for _, s, _ in lists])
    dst = torch.cat([d for _, _, d in lists])
    bad = (src < 0) | (src >= n_in) | (dst < 0) | (dst >= n_out)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        side = "output" if inverse else "input"
        if src[i] < 0 or src[i] >= n_in:
            raise ValueError(
                f"indice_pairs holds a gathered row {int(src[i])} outside [0, {n_in}) (the "
                f"rows of features; inverse={inverse} gathers the {side} side)"
            )
        raise ValueError(
            f"indice_pairs holds a scattered row {int(dst[i])} outside [0, {n_out}) (num_out)"
        )
    return [(k, s.long(), d.long()) for k, s, d in lists]


def pairs_consistent(indice_pairs, indice_pair_num) -> str | None:
    """None when every offset's first n_k pairs have distinct input rows and distinct output
    rows (what sparse_rulebook returns), else why not: the result is then unspecified (native
    and reference may differ in rounding; both stay in bounds)."""
    p = indice_pairs.shape[2]
    nums = indice_pair_num.long().clamp(0, p)
    active = torch.arange(p, device=nums.device)[None, :] < nums[:, None]
    ks = torch.arange(indice_pairs.shape[0], device=nums.device)[:, None].expand_as(active)
    for side in (0, 1):
        rows = indice_pairs[:, side, :].long()
        key = ks[active] * (2**32) + rows[active]
        if key.numel() != torch.unique(key).numel():
            return f"an offset repeats an {'input' if side == 0 else 'output'} row"
    return None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 accumulation for float16 / bfloat16 / float32, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def count_arg(value, name: str) -> int:
    return as_int(value, name, lo=0, hi=INT32_MAX)


def tiny_indices(device, *, clouds: int = 2, keep: int = 300):
    """Unique (batch, z, y, x) int32 voxel rows of tiny generated LiDAR frames (mmcv hard
    voxelization of mu_space.testing.lidar's tiny rig, the samples and tests of the family),
    the first `keep` voxels of each frame, and the grid shape [Z, Y, X]."""
    idx, shape = _tiny_indices(clouds, keep)
    return idx.clone().to(device), list(shape)


@functools.lru_cache(maxsize=4)
def _tiny_indices(clouds: int, keep: int):
    from mu_space.ops.voxelization import voxelization
    from mu_space.testing import lidar

    vs, pcr, max_pts, max_vox = lidar.layer_args("tiny-voxels")
    rows = []
    for b, pts in enumerate(lidar.batch(lidar.VOXEL_CONFIGS["tiny-voxels"].cloud, clouds)):
        _, coors, _ = voxelization(pts, vs, pcr, max_pts, max_vox, backend="reference")
        coors = coors[:keep]
        rows.append(torch.nn.functional.pad(coors, (1, 0), value=b))
    gx, gy, gz = lidar.VOXEL_CONFIGS["tiny-voxels"].grid_size
    return torch.cat(rows).to(torch.int32), (gz, gy, gx)
