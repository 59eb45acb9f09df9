"""`bev_pool_prepare` (BEVDet's `voxel_pooling_prepare_v2` on the GPU) and `sort_by_cell`, the
deterministic counting sort the BEV pooling operators share. Formula, shapes and differences
from upstream: the public functions' docstrings and docs/operators/bev_pool_prepare.md.

Native path (O(n + cells), deterministic, no float atomics): stage COUNT = per point its cell
and an integer histogram, then a single-pass scan over the cells (segment starts, intervals,
the two counts); stage ORDER = a scatter, then each cell's segment put in index order (counting
for short segments, a block sort for long ones). Output sizes depend on the data, so the call
reads two integers back to the host: ONE host synchronisation per call (the only one). Both
stages are queued first; on CUDA the COUNT stage writes the counts straight into a pinned host
buffer that the host polls (bounded spin, then a blocking event wait), so the host reads them
while the GPU still runs the ORDER stage, and the outputs come back stream-ordered behind it.
A workspace is kept per (device, stream, thread) and left clean by every call, so the zeroing
launch runs only on first use. The op is not CUDA-graph capturable; prepare the ranks outside a
captured region (as BEVDet's `init_acceleration_v2` does for a fixed rig), or use
`bev_pool_prepare_padded`.

`bev_pool_prepare_padded`: the same two stages with no read-back, into outputs of upper-bound
sizes (n points, min(n, cells) intervals) whose tails are padding the pooling skips, and the two
counts as a device tensor: no host synchronisation, so prepare + bev_pool_v2 of a view transform
can be captured in one CUDA graph. The padding is written by torch fills before the kernels
(which write only the first n_kept / n_intervals entries), and each call has a workspace of its
own (zeroed by the COUNT stage: one launch more than bev_pool_prepare; nothing is shared with
other calls, streams or captured graphs).
"""

from __future__ import annotations

import functools
import math
import operator
import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mu_space.ops import _opdef
from mu_space.ops._bev import FRUSTUM_RANKS, INT32_MAX
from mu_space.ops._checks import dtype_name
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

OP = "bev_pool_prepare"
SORT_OP = "sort_by_cell"
_COOR_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_NATIVE_COOR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CELL_DTYPES = (torch.int32, torch.int64)


class BEVPoolRanks(NamedTuple):
    """`voxel_pooling_prepare_v2`'s outputs, in its order (int32 1-D tensors)."""

    ranks_bev: torch.Tensor
    ranks_depth: torch.Tensor
    ranks_feat: torch.Tensor
    interval_starts: torch.Tensor
    interval_lengths: torch.Tensor

    def bev_pool_v2_args(self, bev_feat_shape: Sequence[int]) -> tuple:
        """The arguments of BEVDet's `bev_pool_v2` after `depth, feat`:
        `(ranks_depth, ranks_feat, ranks_bev, bev_feat_shape, interval_starts, interval_lengths)`."""
        return (
            self.ranks_depth,
            self.ranks_feat,
            self.ranks_bev,
            tuple(bev_feat_shape),
            self.interval_starts,
            self.interval_lengths,
        )


class BEVPoolRanksPadded(NamedTuple):
    """`bev_pool_prepare_padded`'s outputs: BEVPoolRanks in upper-bound sizes (int32 1-D; the
    first counts[0] / counts[1] entries are bev_pool_prepare's, the rest padding) and counts,
    int32 [2] = (n_kept, n_intervals) on the device."""

    ranks_bev: torch.Tensor
    ranks_depth: torch.Tensor
    ranks_feat: torch.Tensor
    interval_starts: torch.Tensor
    interval_lengths: torch.Tensor
    counts: torch.Tensor

    bev_pool_v2_args = BEVPoolRanks.bev_pool_v2_args


class CellSort(NamedTuple):
    """`sort_by_cell`'s outputs (int32 1-D tensors)."""

    order: torch.Tensor
    interval_starts: torch.Tensor
    interval_lengths: torch.Tensor


# --------------------------------------------------------------------------- validation


def _as_float32(value: float) -> float:
    """The float32 value nearest to `value` (what BEVDet's float32 grid tensors hold)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _three(value, name: str) -> list:
    if isinstance(value, torch.Tensor):
        if value.numel() != 3:
            raise ValueError(
                f"{name} must have 3 values (x, y, z), got a tensor of {value.numel()}"
            )
        return value.detach().reshape(-1).tolist()  # a GPU tensor costs a sync here
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be 3 numbers (x, y, z), got {type(value).__name__}")
    try:
        values = list(value)
    except TypeError:
        raise TypeError(f"{name} must be 3 numbers (x, y, z), got {type(value).__name__}") from None
    if len(values) != 3:
        raise ValueError(f"{name} must have 3 values (x, y, z), got {len(values)}")
    return values


@functools.lru_cache(maxsize=256)
def _grid_from_tuples(lower: tuple, interval: tuple, size: tuple):
    try:
        lo = tuple(_as_float32(float(v)) for v in lower)
    except (TypeError, ValueError):
        raise TypeError(f"grid_lower_bound must be 3 numbers, got {lower}") from None
    try:
        iv = tuple(_as_float32(float(v)) for v in interval)
    except (TypeError, ValueError):
        raise TypeError(f"grid_interval must be 3 numbers, got {interval}") from None
    if not all(math.isfinite(v) for v in lo):
        raise ValueError(f"grid_lower_bound must be finite, got {lower}")
    if not all(math.isfinite(v) and v > 0 for v in iv):
        raise ValueError(f"grid_interval must be positive and finite (as float32), got {interval}")
    sz = []
    for v in size:
        try:
            s = operator.index(v)
        except TypeError:
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise TypeError(f"grid_size must be 3 integers (X, Y, Z), got {size}") from None
            if not f.is_integer():
                raise ValueError(
                    f"grid_size must be 3 integers (X, Y, Z), got {size}; BEVDet's "
                    "float grid_size must be integral (round it)"
                ) from None
            s = int(f)
        if s <= 0:
            raise ValueError(f"grid_size must be positive, got {size}")
        sz.append(s)
    return lo, iv, tuple(sz)


def _grid(grid_lower_bound, grid_interval, grid_size, *, cached: bool = True):
    """Validated ((lx, ly, lz) float32 values, (ix, iy, iz) float32 values, (X, Y, Z) ints)."""
    lower = tuple(_three(grid_lower_bound, "grid_lower_bound"))
    interval = tuple(_three(grid_interval, "grid_interval"))
    size = tuple(_three(grid_size, "grid_size"))
    if cached:  # eager calls: the parse costs ~10 us, a cache hit well under 1 us
        try:
            return _grid_from_tuples(lower, interval, size)
        except TypeError as exc:
            if "unhashable" not in str(exc):
                raise
    return _grid_from_tuples.__wrapped__(lower, interval, size)


def _check_coor(coor) -> None:
    if not isinstance(coor, torch.Tensor):
        raise TypeError(f"coor must be a torch.Tensor, got {type(coor).__name__}")
    if coor.dtype not in _COOR_DTYPES:
        raise TypeError(
            f"coor must be float32, float16, bfloat16 or float64, got {dtype_name(coor.dtype)}"
        )
    if coor.dim() != 6 or coor.shape[-1] != 3:
        raise ValueError(f"coor must be [B, N, D, H, W, 3], got {list(coor.shape)}")
    n = coor.numel() // 3
    if n > INT32_MAX:
        raise ValueError(f"coor has {n} points; int32 ranks allow at most {INT32_MAX}")


def _n_cells(batch: int, size: tuple) -> int:
    x, y, z = size
    n_cells = batch * x * y * z
    if n_cells > INT32_MAX:
        raise ValueError(
            f"B*X*Y*Z = {batch}*{x}*{y}*{z} = {n_cells} cells exceeds the int32 range "
            f"of ranks_bev ({INT32_MAX})"
        )
    return n_cells


def _check_cell(cell, n_cells) -> int:
    if not isinstance(cell, torch.Tensor):
        raise TypeError(f"cell must be a torch.Tensor, got {type(cell).__name__}")
    if cell.dtype not in _CELL_DTYPES:
        raise TypeError(f"cell must be int32 or int64, got {dtype_name(cell.dtype)}")
    if cell.dim() != 1:
        raise ValueError(f"cell must be 1-D, got {cell.dim()}-D")
    if cell.numel() > INT32_MAX:
        raise ValueError(f"cell has {cell.numel()} entries; int32 order allows at most {INT32_MAX}")
    try:
        n_cells = operator.index(n_cells)
    except TypeError:
        raise TypeError(f"n_cells must be an int, got {type(n_cells).__name__}") from None
    if not 0 <= n_cells <= INT32_MAX:
        raise ValueError(f"n_cells must be in [0, {INT32_MAX}], got {n_cells}")
    return n_cells


# --------------------------------------------------------------------------- reference


def _empty_int32(device, k: int = 0) -> torch.Tensor:
    return torch.empty(k, dtype=torch.int32, device=device)


def _intervals(sorted_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if sorted_keys.numel() == 0:
        return _empty_int32(sorted_keys.device), _empty_int32(sorted_keys.device)
    _, lengths = torch.unique_consecutive(sorted_keys, return_counts=True)
    starts = torch.cumsum(lengths, 0) - lengths
    return starts.to(torch.int32), lengths.to(torch.int32)


def _grid_cells(q: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, cell) of one axis: cell = trunc(q), kept = 0 <= cell < size (NaN/inf dropped)."""
    if q.dtype in (torch.float16, torch.bfloat16):
        q = q.float()  # exact; avoids comparing against bounds rounded to half
    kept = (q > -1) & (q < 2.0**31)  # trunc(q) >= 0 <=> q > -1; NaN fails both tests
    cell = torch.where(kept, q, torch.zeros((), dtype=q.dtype, device=q.device)).long()
    return kept & (cell < size), cell


def bev_pool_prepare_reference(
    coor: torch.Tensor, grid_lower_bound, grid_interval, grid_size
) -> BEVPoolRanks:
    """Vectorised PyTorch path (any device, float64 too); stable sort, so equal to native."""
    _check_coor(coor)
    lower, interval, size = _grid(grid_lower_bound, grid_interval, grid_size)
    B, N, D, H, W, _ = coor.shape
    _n_cells(B, size)  # validates the int32 range, as the native path does
    n = B * N * D * H * W
    device = coor.device
    if n == 0:
        return BEVPoolRanks(*(_empty_int32(device) for _ in range(5)))
    lo = torch.tensor(lower, dtype=torch.float32, device=device).to(coor.dtype)
    iv = torch.tensor(interval, dtype=torch.float32, device=device).to(coor.dtype)
    q = (coor.reshape(n, 3) - lo) / iv  # BEVDet: ((coor - lower.to(coor)) / interval.to(coor))
    X, Y, Z = size
    kx, cx = _grid_cells(q[:, 0], X)
    ky, cy = _grid_cells(q[:, 1], Y)
    kz, cz = _grid_cells(q[:, 2], Z)
    idx = torch.nonzero(kx & ky & kz).squeeze(1)  # ascending point index
    batch = idx // (N * D * H * W)
    rank = ((batch * Z + cz[idx]) * Y + cy[idx]) * X + cx[idx]
    ranks_bev, perm = torch.sort(rank, stable=True)
    ranks_depth = idx[perm]
    hw = H * W
    ranks_feat = (ranks_depth // (D * hw)) * hw + ranks_depth % hw
    starts, lengths = _intervals(ranks_bev)
    return _frustum(
        BEVPoolRanks(
            ranks_bev.to(torch.int32),
            ranks_depth.to(torch.int32),
            ranks_feat.to(torch.int32),
            starts,
            lengths,
        ),
        coor,
    )


def _frustum(ranks, coor):
    """`ranks` (BEVPoolRanks or BEVPoolRanksPadded, built from coor [B, N, D, H, W, 3]),
    recorded as frustum-layout ranks of a depth [B, N, D, H, W] (_bev.FRUSTUM_RANKS)."""
    FRUSTUM_RANKS.add(ranks.ranks_depth, ranks.ranks_feat, tuple(coor.shape[:5]))
    return ranks


def sort_by_cell_reference(cell: torch.Tensor, n_cells: int) -> CellSort:
    """Vectorised PyTorch path: a stable sort of the in-range entries by cell."""
    n_cells = _check_cell(cell, n_cells)
    kept = (cell >= 0) & (cell < n_cells)
    idx = torch.nonzero(kept).squeeze(1)
    keys, perm = torch.sort(cell[idx], stable=True)
    starts, lengths = _intervals(keys)
    return CellSort(idx[perm].to(torch.int32), starts, lengths)


def _check_pad_keys(n: int, n_cells: int) -> None:
    if n + n_cells > INT32_MAX + 1:
        raise ValueError(
            f"coor: {n} points + {n_cells} cells exceed 2**31: the padded ranks_bev needs "
            f"a distinct int32 key >= the cell count for every point (use bev_pool_prepare)"
        )


def _padding(device, n: int, cap: int) -> tuple:
    """Outputs that hold only padding: ranks_bev[p] = 2**31 - n + p (distinct, ascending, not
    a cell: a sorted run of length 1 each, dropped by the pooling, with no long run to walk),
    ranks_depth = ranks_feat = -1 (a bad point: nothing gathered, nothing added in the
    backward), interval_starts = interval_lengths = 0 (an empty interval: skipped)."""
    base = INT32_MAX + 1 - n
    return (
        torch.arange(base, base + n, dtype=torch.int32, device=device),
        torch.full((n,), -1, dtype=torch.int32, device=device),
        torch.full((n,), -1, dtype=torch.int32, device=device),
        torch.zeros(cap, dtype=torch.int32, device=device),
        torch.zeros(cap, dtype=torch.int32, device=device),
    )


def bev_pool_prepare_padded_reference(
    coor: torch.Tensor, grid_lower_bound, grid_interval, grid_size
) -> BEVPoolRanksPadded:
    """bev_pool_prepare_reference's result in the padded layout (synchronises: reference only)."""
    r = bev_pool_prepare_reference(coor, grid_lower_bound, grid_interval, grid_size)
    _, _, size = _grid(grid_lower_bound, grid_interval, grid_size)
    n = coor.numel() // 3
    n_cells = _n_cells(coor.shape[0], size)
    _check_pad_keys(n, n_cells)
    outs = _padding(coor.device, n, min(n, n_cells))
    for t, src in zip(outs, r):
        t[: src.shape[0]] = src
    counts = [r.ranks_bev.shape[0], r.interval_starts.shape[0]]
    counts = torch.tensor(counts, dtype=torch.int32, device=coor.device)
    return _frustum(BEVPoolRanksPadded(*outs, counts), coor)


# --------------------------------------------------------------------------- native

# flags of the native entry points (csrc/bev/bev_pool_prepare_musa.mu)
_STAGE_COUNT = 1  # zero (unless clean) + cells + scan: the counts are final after it
_STAGE_ORDER = 2  # scatter + emit
_WORKSPACE_CLEAN = 4  # the workspace's zero region is zero (true after any completed COUNT)
_POLICY_AGGREGATE = 8  # block-aggregated histogram atomics


def _policy_from_env() -> int:
    """Profiling knob MUSPACE_BEV_POOL_PREPARE_AGGREGATE=0/1 (block-aggregated histogram)."""
    value = os.environ.get("MUSPACE_BEV_POOL_PREPARE_AGGREGATE", "").strip().lower()
    return _POLICY_AGGREGATE if value in ("1", "true", "yes", "on") else 0


_POLICY = _policy_from_env()  # read once; tests and benchmarks may assign it

# How the two counts reach the host (profiling knob MUSPACE_BEV_POOL_PREPARE_READBACK):
#   "zerocopy" (CUDA default): the COUNT stage writes them into a pinned host buffer that the host
#              polls, with no copy and no driver wait on the critical path;
#   "event":   a non-blocking copy into pinned memory after the COUNT stage, then an event;
#   "sync":    both stages, then `workspace[:2].tolist()` (the only mode off CUDA).
# In the first two the ORDER stage is queued before the host waits, so the host reads the counts
# while the GPU still orders the points.
_READBACK = os.environ.get("MUSPACE_BEV_POOL_PREPARE_READBACK", "zerocopy").strip().lower()
# The host polls for the counts for at most this long, then blocks on the event (releasing the
# GIL): bounded CPU use when the stream has a long queue ahead of the call.
_SPIN_LIMIT_S = 2e-3


@functools.lru_cache(maxsize=64)
def _workspace_ints(n: int, n_cells: int) -> int:
    return int(native.function("bev_pool_sort_workspace_ints")(n, n_cells))


class _NativeState:
    """What one (op, device, stream, thread) keeps between calls: the workspace, whether its
    zero region is known zero (every COUNT stage leaves it so: the zeroing launch runs once),
    and on CUDA a pinned host buffer and an event for reading the two counts back early."""

    __slots__ = (
        "workspace",
        "n_cells",
        "clean",
        "head",
        "host",
        "host_head",
        "host_np",
        "host_ptr",
        "sequence",
        "event",
        "stream",
    )

    def __init__(self, device: torch.device, ints: int):
        self.workspace = torch.empty(ints, dtype=torch.int32, device=device)
        self.n_cells = -1
        self.clean = False
        self.event = None
        if device.type == "cuda":
            self.head = self.workspace[:2]
            self.host = torch.zeros(4, dtype=torch.int32, pin_memory=True)
            self.host_head = self.host[:2]
            self.host_np = self.host.numpy()
            self.host_ptr = self.host.data_ptr()
            self.sequence = 0
            self.event = torch.cuda.Event()
            self.stream = torch.cuda.current_stream(device)


_STATES: dict = {}
_MAX_STATES = 16  # distinct (op, device, stream, thread) keys kept; the oldest goes first


def _native_state(
    op: str, device: torch.device, stream: int, n_cells: int, ints: int
) -> _NativeState:
    key = (op, device.type, device.index, stream, threading.get_ident())
    st = _STATES.get(key)
    if st is None or st.workspace.numel() < ints:
        if st is None and len(_STATES) >= _MAX_STATES:
            _STATES.pop(next(iter(_STATES)))
        # grow with headroom: sort_by_cell's n (bev_pool_v2's n_kept) changes every step
        st = _STATES[key] = _NativeState(device, ints if st is None else ints + ints // 4)
    if st.n_cells != n_cells:  # the zero region depends on n_cells only
        st.n_cells = n_cells
        st.clean = False
    return st


def _wait(st: _NativeState, ready) -> None:
    """Poll `ready()` for up to _SPIN_LIMIT_S, then block on the event."""
    if ready():
        return
    limit = time.perf_counter() + _SPIN_LIMIT_S
    while not ready():
        if time.perf_counter() > limit:
            st.event.synchronize()
            return


def _run_native(
    entry, args: tuple, st: _NativeState, stream: int, n: int, cap: int
) -> tuple[int, int]:
    """Queue both stages and return (n_kept, n_intervals): the one host synchronisation."""
    global _READBACK
    clean = _WORKSPACE_CLEAN if st.clean else 0
    mode = _READBACK if st.event is not None else "sync"
    st.clean = False  # until the COUNT stage is queued without error
    if mode == "zerocopy":
        h = st.host_np
        sequence = st.sequence = st.sequence % 0x3FFFFFFF + 1
        h[2] = 0
        entry(*args, _STAGE_COUNT | clean | _POLICY, st.host_ptr, sequence, stream)
        st.clean = True
        st.event.record(st.stream)
        entry(*args, _STAGE_ORDER | _POLICY, 0, 0, stream)
        _wait(st, lambda: h[2] == sequence)
        if h[2] != sequence:  # the event completed without the write: never seen; stay safe
            st.event.synchronize()
            if h[2] != sequence:
                _READBACK = "event"
                n_kept, n_intervals = st.workspace[:2].tolist()
            else:
                n_kept, n_intervals = int(h[0]), int(h[1])
        else:
            n_kept, n_intervals = int(h[0]), int(h[1])
    elif mode == "event":
        entry(*args, _STAGE_COUNT | clean | _POLICY, 0, 0, stream)
        st.clean = True
        st.host_head.copy_(st.head, non_blocking=True)
        st.event.record(st.stream)
        entry(*args, _STAGE_ORDER | _POLICY, 0, 0, stream)
        _wait(st, st.event.query)
        n_kept, n_intervals = int(st.host_np[0]), int(st.host_np[1])
    else:
        entry(*args, _STAGE_COUNT | _STAGE_ORDER | clean | _POLICY, 0, 0, stream)
        st.clean = True
        n_kept, n_intervals = st.workspace[:2].tolist()
    if not (0 <= n_kept <= n and 0 <= n_intervals <= min(cap, n_kept)):
        raise RuntimeError(
            f"{OP}: native counts out of range (n_kept={n_kept}, "
            f"n_intervals={n_intervals}, n={n}); please report this"
        )
    return n_kept, n_intervals


def _prepare_native(coor, lower, interval, size, n, n_cells) -> BEVPoolRanks:
    coor = coor.detach().contiguous()  # documented: a non-contiguous coor costs one copy
    device = coor.device
    cap = min(n, n_cells)
    stream = stream_handle(coor)
    st = _native_state(OP, device, stream, n_cells, _workspace_ints(n, n_cells))
    outs = tuple(_opdef.new_output(coor, (k,), torch.int32) for k in (n, n, n, cap, cap))
    k, m = _run_native(
        native.function("bev_pool_prepare_forward"),
        (coor, st.workspace, *outs, *lower, *interval, *size),
        st,
        stream,
        n,
        cap,
    )
    # shrink in place (metadata only; the ORDER stage may still be writing them)
    outs[0].resize_(k)
    outs[1].resize_(k)
    outs[2].resize_(k)
    outs[3].resize_(m)
    outs[4].resize_(m)
    return _frustum(BEVPoolRanks(*outs), coor)


def _prepare_padded_native(coor, lower, interval, size, n, n_cells) -> BEVPoolRanksPadded:
    coor = coor.detach().contiguous()  # documented: a non-contiguous coor costs one copy
    outs = _padding(coor.device, n, min(n, n_cells))
    # a workspace of its own: a captured graph keeps it (its pool), no other call touches it
    workspace = torch.empty(_workspace_ints(n, n_cells), dtype=torch.int32, device=coor.device)
    native.function("bev_pool_prepare_forward")(
        coor,
        workspace,
        *outs,
        *lower,
        *interval,
        *size,
        _STAGE_COUNT | _STAGE_ORDER | _POLICY,
        0,
        0,
        stream_handle(coor),
    )
    return _frustum(BEVPoolRanksPadded(*outs, workspace[:2].clone()), coor)


def _sort_native(cell, n_cells) -> CellSort:
    cell = cell.contiguous()  # a non-contiguous cell costs one copy
    n = cell.numel()
    device = cell.device
    cap = min(n, n_cells)
    stream = stream_handle(cell)
    st = _native_state(SORT_OP, device, stream, n_cells, _workspace_ints(n, n_cells))
    order, starts, lengths = (_opdef.new_output(cell, (k,), torch.int32) for k in (n, cap, cap))
    k, m = _run_native(
        native.function("sort_by_cell_forward"),
        (cell, st.workspace, order, starts, lengths, n_cells),
        st,
        stream,
        n,
        cap,
    )
    order.resize_(k)
    starts.resize_(m)
    lengths.resize_(m)
    return CellSort(order, starts, lengths)


# --------------------------------------------------------------------------- definitions


def _check_prepare(coor, grid_lower_bound, grid_interval, grid_size) -> _opdef.Checked:
    _check_coor(coor)
    lower, interval, size = _grid(grid_lower_bound, grid_interval, grid_size)
    n_cells = _n_cells(coor.shape[0], size)
    return _opdef.Checked(
        coor.device, coor.dtype, None, (lower, interval, size, coor.numel() // 3, n_cells), "coor"
    )


def _prepare_supports(c: _opdef.Checked) -> str | None:
    *_, n, n_cells = c.info
    if n > native.limit("bev_pool_prepare.max_points"):
        return (
            f"{n} points exceed the native limit of {native.limit('bev_pool_prepare.max_points')}"
        )
    if n_cells > native.limit("bev_pool_prepare.max_cells"):
        return f"{n_cells} cells exceed the native limit of {native.limit('bev_pool_prepare.max_cells')}"
    return None


def _prepare_forward(c: _opdef.Checked, coor, grid_lower_bound, grid_interval, grid_size):
    lower, interval, size, n, n_cells = c.info
    if n == 0:
        return BEVPoolRanks(*(_empty_int32(coor.device) for _ in range(5)))
    return _prepare_native(coor, lower, interval, size, n, n_cells)


def _prepare_fake(coor, grid_lower_bound, grid_interval, grid_size):
    ctx = torch.library.get_ctx()
    n_kept, n_intervals = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    ranks = [coor.new_empty(n_kept, dtype=torch.int32) for _ in range(3)]
    return (*ranks, *(coor.new_empty(n_intervals, dtype=torch.int32) for _ in range(2)))


def _small_bevdet_config():
    from mu_space.testing import bev_geometry

    return bev_geometry.BEVConfig(
        "bevdet-small", batch=2, feature_hw=(8, 22), depth=(1.0, 60.0, 2.0), channels=8
    )


def _prepare_samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import bev_geometry

    def case(label, cfg, dtype=torch.float32):
        g = bev_geometry.make(cfg)
        coor = g["coor"].to(device=device, dtype=dtype)
        return _opdef.Sample(
            label, (coor, g["grid_lower_bound"], g["grid_interval"], g["grid_size"])
        )

    tiny = bev_geometry.make("tiny")
    empty = tiny["coor"][:, :, :0].to(device)
    return [
        case("tiny", "tiny"),
        case("tiny float16", "tiny", torch.float16),
        case("bevdet-like B=2 [2,6,30,8,22]", _small_bevdet_config()),
        _opdef.Sample(
            "no points", (empty, tiny["grid_lower_bound"], tiny["grid_interval"], tiny["grid_size"])
        ),
    ]


PREPARE = _opdef.define(
    _opdef.OpDef(
        name=OP,
        family="bev",
        schema="(Tensor coor, float[] grid_lower_bound, float[] grid_interval, int[] grid_size) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        check=_check_prepare,
        reference=lambda coor, lower, interval, size: bev_pool_prepare_reference(
            coor, lower, interval, size
        ),
        native=_prepare_forward,
        fake=_prepare_fake,
        supports=_prepare_supports,
        result=BEVPoolRanks,
        native_dtypes=_NATIVE_COOR_DTYPES,
        entry_points=("bev_pool_prepare_forward", "bev_pool_sort_workspace_ints"),
        samples=_prepare_samples,
        upstream="BEVDet `voxel_pooling_prepare_v2`",
        models="BEVDet, BEVDepth, FlashOCC",
        patches=(
            "bevdet.voxel_pooling_prepare_v2",
            "bevfusion.factored_lss.bev_pool",
            "bevfusion.factored_lss.LSSTransform",
            "bevfusion.factored_lss.DepthLSSTransform",
            "bevfusion.factored_lss.mit.bev_pool",
            "bevfusion.factored_lss.mit.LSSTransform",
            "bevfusion.factored_lss.mit.DepthLSSTransform",
        ),
        recipes=("model_examples/BEVDet", "model_examples/BEVFusion"),
        doc="docs/operators/bev_pool_prepare.md",
    )
)


@PREPARE.export
def bev_pool_prepare(
    coor: torch.Tensor, grid_lower_bound, grid_interval, grid_size, *, backend: str = "auto"
) -> BEVPoolRanks:
    """Ranks and intervals for `bev_pool_v2` from frustum coordinates: BEVDet's
    `LSSViewTransformer.voxel_pooling_prepare_v2`, on the GPU.

        coor  Tensor[B, N, D, H, W, 3]   ego-frame (x, y, z) of every lifted frustum point
        q     = (coor - lower) / interval            per axis, in coor's dtype (BEVDet's formula)
        cell  = q.long()                             truncation toward zero (see "quirk" below)
        kept  = 0 <= cell_x < X  and  0 <= cell_y < Y  and  0 <= cell_z < Z
        for each kept point p = ((((b*N + n)*D + d)*H + h)*W + w), sorted by ranks_bev:
            ranks_bev   = b*Z*Y*X + cell_z*Y*X + cell_y*X + cell_x   (flat index into [B, Z, Y, X])
            ranks_depth = p                                           (flat index into [B, N, D, H, W])
            ranks_feat  = ((b*N + n)*H + h)*W + w                     (flat index into [B, N, H, W])
        interval_starts, interval_lengths: the runs of equal ranks_bev in that order.

    Returns BEVPoolRanks(ranks_bev, ranks_depth, ranks_feat, interval_starts, interval_lengths):
    int32 1-D tensors on coor's device, three of length n_kept and two of length n_intervals, in
    `voxel_pooling_prepare_v2`'s order, so it unpacks where that call was;
    `ranks.bev_pool_v2_args(bev_feat_shape)` puts them in BEVDet's `bev_pool_v2` order:

        ranks = mu_space.ops.bev_pool_prepare(coor, lower, interval, size)
        bev = mu_space.ops.bev_pool_v2(depth, feat, *ranks.bev_pool_v2_args(bev_feat_shape))

    Args:
        coor: float32 (native), float16 / bfloat16 (native, each operation rounded to that dtype
            exactly as upstream's `(coor - lower.to(coor)) / interval.to(coor)`: the cells equal
            upstream's bit for bit), float64 (reference path: no FP64 in kernels).
        grid_lower_bound, grid_interval: (x, y, z) numbers or 3-element tensors, used as float32
            (BEVDet keeps them in float32 tensors); intervals must be positive.
        grid_size: (X, Y, Z) integers (integral floats and tensors, like BEVDet's float grid_size,
            are accepted). Tensors on a GPU are read back to the host (a sync): pass numbers.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Differences from upstream (docs/operators/bev_pool_prepare.md):
    - order inside an interval: ascending point index (a stable sort, deterministic); upstream's
      `argsort` is not stable, so its order inside an interval is unspecified. The sets are equal.
    - no point in the grid: five empty int32 tensors (upstream returns None).
    - NaN / inf coordinates are dropped (upstream's `.long()` of NaN is platform-dependent).
    - quirk kept from upstream: `.long()` truncates toward zero, so q in (-1, 0) lands in cell 0:
      points just below the lower bound (by less than one cell) are kept in the first cell.

    One host synchronisation per call (the output sizes depend on the data); not CUDA-graph
    capturable.
    """
    cached = not torch.compiler.is_compiling()
    lower, interval, size = _grid(grid_lower_bound, grid_interval, grid_size, cached=cached)
    return PREPARE(coor, list(lower), list(interval), list(size), backend=backend)


def _check_prepare_padded(coor, grid_lower_bound, grid_interval, grid_size) -> _opdef.Checked:
    c = _check_prepare(coor, grid_lower_bound, grid_interval, grid_size)
    *_, n, n_cells = c.info
    _check_pad_keys(n, n_cells)
    cap = min(n, n_cells)
    i32 = torch.int32
    c.outputs = (((n,), i32), ((n,), i32), ((n,), i32), ((cap,), i32), ((cap,), i32), ((2,), i32))
    return c


def _prepare_padded_forward(c: _opdef.Checked, coor, grid_lower_bound, grid_interval, grid_size):
    lower, interval, size, n, n_cells = c.info
    if n == 0:
        outs = _padding(coor.device, 0, 0)
        return BEVPoolRanksPadded(*outs, torch.zeros(2, dtype=torch.int32, device=coor.device))
    return _prepare_padded_native(coor, lower, interval, size, n, n_cells)


PREPARE_PADDED = _opdef.define(
    _opdef.OpDef(
        name="bev_pool_prepare_padded",
        family="bev",
        schema="(Tensor coor, float[] grid_lower_bound, float[] grid_interval, int[] grid_size) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        check=_check_prepare_padded,
        reference=lambda coor, lower, interval, size: bev_pool_prepare_padded_reference(
            coor, lower, interval, size
        ),
        native=_prepare_padded_forward,
        supports=_prepare_supports,
        result=BEVPoolRanksPadded,
        native_dtypes=_NATIVE_COOR_DTYPES,
        entry_points=("bev_pool_prepare_forward", "bev_pool_sort_workspace_ints"),
        samples=_prepare_samples,
        upstream="BEVDet `voxel_pooling_prepare_v2` (upper-bound sizes, no host sync)",
        models="BEVDet, BEVDepth, FlashOCC: CUDA-graph captured view transform",
        recipes=(),
        doc="docs/operators/bev_pool_prepare.md",
        unverified="issue 13: its GPU tests passed on an H200 (2026-12-01); compute-sanitizer not run yet",
    )
)


@PREPARE_PADDED.export
def bev_pool_prepare_padded(
    coor: torch.Tensor, grid_lower_bound, grid_interval, grid_size, *, backend: str = "auto"
) -> BEVPoolRanksPadded:
    """`bev_pool_prepare` with upper-bound output sizes and no host synchronisation, so that
    prepare + `bev_pool_v2` of a view transform can be captured in one CUDA graph:

        r = bev_pool_prepare_padded(coor, lower, interval, size)     # coor [B, N, D, H, W, 3]
        bev = bev_pool_v2(depth, feat, *r.bev_pool_v2_args(bev_feat_shape))

    gives bev_pool_prepare + bev_pool_v2's output (the reference: bit for bit; the kernel to
    float32 rounding, as its partition of the points into blocks depends on their number).

    Returns BEVPoolRanksPadded(ranks_bev, ranks_depth, ranks_feat [n], interval_starts,
    interval_lengths [min(n, B*X*Y*Z)], counts), int32 on coor's device, n = B*N*D*H*W: the
    first counts[0] = n_kept (three arrays) and counts[1] = n_intervals (two) entries equal
    `bev_pool_prepare`'s outputs; the rest is padding that bev_pool_v2 (native and reference,
    forward and backward) skips: ranks_bev[p] = 2**31 - n + p (ascending, above every cell, so
    the array stays sorted), ranks_depth = ranks_feat = -1, interval_starts = interval_lengths
    = 0. Needs n + B*X*Y*Z <= 2**31 (ValueError otherwise).

    Args: as `bev_pool_prepare` (grid parameters as numbers: tensors on a GPU would be read back,
    a synchronisation, illegal inside a capture).

    Costs against bev_pool_prepare: the pooling walks all n points (the padding's indices are
    read, no feature rows), four fills of the outputs, and a fresh workspace per call (one
    zeroing launch more). `validate=True` of bev_pool_v2 rejects the padded intervals (they are
    not exactly the runs of ranks_bev): validate the unpadded `bev_pool_prepare` result instead.
    """
    cached = not torch.compiler.is_compiling()
    lower, interval, size = _grid(grid_lower_bound, grid_interval, grid_size, cached=cached)
    return PREPARE_PADDED(coor, list(lower), list(interval), list(size), backend=backend)


def _check_sort(cell, n_cells) -> _opdef.Checked:
    n_cells = _check_cell(cell, n_cells)
    return _opdef.Checked(cell.device, cell.dtype, None, n_cells, "cell")


def _sort_supports(c: _opdef.Checked) -> str | None:
    if c.info > native.limit("sort_by_cell.max_cells"):
        return f"{c.info} cells exceed the native limit of {native.limit('sort_by_cell.max_cells')}"
    return None


def _sort_forward(c: _opdef.Checked, cell, n_cells):
    if cell.numel() == 0 or c.info == 0:
        return CellSort(*(_empty_int32(cell.device) for _ in range(3)))
    return _sort_native(cell, c.info)


def _sort_fake(cell, n_cells):
    ctx = torch.library.get_ctx()
    n_kept, n_intervals = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return (
        cell.new_empty(n_kept, dtype=torch.int32),
        cell.new_empty(n_intervals, dtype=torch.int32),
        cell.new_empty(n_intervals, dtype=torch.int32),
    )


def _sort_samples(device: torch.device) -> list[_opdef.Sample]:
    g = torch.Generator().manual_seed(0)
    cell = torch.randint(-50, 1100, (20000,), generator=g)
    return [
        _opdef.Sample("int64 [20000], 1000 cells", (cell.to(device), 1000)),
        _opdef.Sample("int32 [20000], 7 cells", (cell.int().to(device) % 9 - 1, 7)),
        _opdef.Sample("empty", (cell[:0].to(device), 10)),
    ]


SORT = _opdef.define(
    _opdef.OpDef(
        name=SORT_OP,
        family="bev",
        schema="(Tensor cell, int n_cells) -> (Tensor, Tensor, Tensor)",
        check=_check_sort,
        reference=sort_by_cell_reference,
        native=_sort_forward,
        fake=_sort_fake,
        supports=_sort_supports,
        result=CellSort,
        native_dtypes=_CELL_DTYPES,
        entry_points=("sort_by_cell_forward", "bev_pool_sort_workspace_ints"),
        samples=_sort_samples,
        public=False,
    )
)


@SORT.export
def sort_by_cell(cell: torch.Tensor, n_cells: int, *, backend: str = "auto") -> CellSort:
    """Stable, deterministic counting sort of `cell` (Tensor[n] int32 / int64) over [0, n_cells).

    Entries outside [0, n_cells) are dropped. Returns CellSort(order, interval_starts,
    interval_lengths), int32 1-D: `order` = the indices of the kept entries sorted by cell, ties
    by ascending index; the intervals = the runs of equal cell in `order`. The primitive behind
    bev_pool_prepare, bev_pool, bev_pool_v3 and bev_pool_v2's deterministic backward:
    O(n + n_cells) time and memory, one host synchronisation (the output sizes depend on the data).
    """
    return SORT(cell, n_cells, backend=backend)
