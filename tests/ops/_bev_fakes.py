"""CPU stand-ins for the two native primitives `bev_pool` / `bev_pool_v3` are composed from,
written from their contracts alone, so the composition (permutation, cell gather, argument
order, dtypes) is tested on machines without a GPU. They also assert the contract's
preconditions on what the composition passes them.

- sort_by_cell(cell, n_cells) -> (order, interval_starts, interval_lengths): stable ascending sort
  of the points whose cell is in [0, n_cells), ties by index; int32.
- bev_pool_v2(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape, interval_starts,
  interval_lengths): BEVDet semantics, ranks sorted by ranks_bev; depth=None -> weight 1.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

_LIMITS = {
    "bev_pool_v2.max_cells": 2**31 - 1,
    "bev_pool_v2.max_points": 2**30,
    "bev_pool_v2.max_channels": 2**20,
    "sort_by_cell.max_cells": 2**31 - 1,
}


class SortResult(NamedTuple):
    order: torch.Tensor
    interval_starts: torch.Tensor
    interval_lengths: torch.Tensor


class Calls:
    """What the fakes were called with (the last call of each)."""

    sort: dict | None = None
    pool: dict | None = None


def fake_sort_by_cell(cell, n_cells, *, backend="auto"):
    assert cell.dtype in (torch.int32, torch.int64) and cell.dim() == 1
    Calls.sort = {"cell": cell, "n_cells": n_cells, "backend": backend}
    c = cell.long()
    kept = ((c >= 0) & (c < n_cells)).nonzero().squeeze(1)
    order = kept[torch.sort(c[kept], stable=True).indices]
    _, lengths = torch.unique_consecutive(c[order], return_counts=True)
    starts = torch.cumsum(lengths, 0) - lengths
    return SortResult(order.int(), starts.int(), lengths.int())


def fake_bev_pool_v2(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
    *,
    backend="auto",
    validate=False,
):
    B, Z, Y, X, C = bev_feat_shape
    Calls.pool = {
        "depth": depth,
        "feat": feat,
        "ranks_depth": ranks_depth,
        "ranks_feat": ranks_feat,
        "ranks_bev": ranks_bev,
        "bev_feat_shape": bev_feat_shape,
        "backend": backend,
    }
    for name, t in (
        ("ranks_feat", ranks_feat),
        ("ranks_bev", ranks_bev),
        ("interval_starts", interval_starts),
        ("interval_lengths", interval_lengths),
    ):
        assert t.dtype == torch.int32, f"{name} passed as {t.dtype}"
    assert (depth is None) == (ranks_depth is None)
    assert isinstance(bev_feat_shape, tuple) and len(bev_feat_shape) == 5
    rb = ranks_bev.long()
    assert bool((rb[1:] >= rb[:-1]).all()), "ranks_bev must be sorted"
    assert int(interval_lengths.sum()) == rb.numel()
    # per-point cell taken from the interval starts: wrong intervals give wrong results
    seg = torch.repeat_interleave(torch.arange(interval_starts.numel()), interval_lengths.long())
    target = rb[interval_starts.long()][seg]
    vals = feat.reshape(-1, C)[ranks_feat.long()].double()
    if depth is not None:
        vals = vals * depth.reshape(-1)[ranks_depth.long()].double().unsqueeze(1)
    out = torch.zeros(B * Z * Y * X, C, dtype=torch.float64).index_add(0, target, vals)
    return out.view(B, Z, Y, X, C).permute(0, 4, 1, 2, 3).to(feat.dtype).contiguous()


def _real(module: str, name: str, record: str):
    """The real primitive's reference path (when its module exists), recording its arguments."""
    try:
        fn = getattr(importlib.import_module(f"mu_space.ops.{module}"), name)
    except (ImportError, AttributeError):
        return None

    def call(*args, backend="auto", **kwargs):
        setattr(Calls, record, {"args": args, "backend": backend})
        return fn(*args, backend="reference", **kwargs)

    return call


def install(monkeypatch, real: bool = False):
    """Route `bev_pool` / `bev_pool_v3` through the native composition on CPU, with the fakes
    above, or (`real=True`) with the real primitives' reference paths where they exist."""
    sort, pool = fake_sort_by_cell, fake_bev_pool_v2
    if real:
        sort = _real("bev_pool_prepare", "sort_by_cell", "sort") or sort
        pool = _real("bev_pool_v2", "bev_pool_v2", "pool") or pool
    _route_native_composition(monkeypatch, sort, pool)
    Calls.sort = Calls.pool = None
    return Calls


def _route_native_composition(monkeypatch, sort, pool):
    """The composite ops take their native path on the CPU, with `sort` / `pool` as primitives
    (a library with the entry points and limits of the real one is assumed)."""
    from mu_space.ops import _bev
    from mu_space.runtime import native, registry

    monkeypatch.setattr(_bev, "primitives", lambda: (sort, pool))

    # bev_pool's own kernels: their PyTorch versions (same arguments and results)
    def sort_runs(cells, n_cells):  # the radix sort + runs step, through `sort`
        s = sort(cells, n_cells, backend="native")
        ranks_bev = cells[s.order.long()].to(torch.int32)
        return _bev.SortedRuns(s.order, ranks_bev, s.interval_starts, s.interval_lengths)

    monkeypatch.setattr(
        _bev, "native_steps", lambda: (_bev.coords_to_cells, _bev.row_gather_grad, sort_runs)
    )
    monkeypatch.setattr(native, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(native, "has_function", lambda name: True)
    monkeypatch.setattr(native, "build_facts", lambda: {"bf16": True, "limits": _LIMITS})
    for op in registry.operators():
        op.forget_native_reasons()


def install_reference_primitives(monkeypatch):
    """The native composition on CPU through the real primitives (their public functions, so
    their custom ops under torch.compile) running their reference paths."""
    from mu_space.ops.bev_pool_prepare import sort_by_cell
    from mu_space.ops.bev_pool_v2 import bev_pool_v2

    def sort(cell, n_cells, *, backend="auto"):
        return sort_by_cell(cell, n_cells, backend="reference")

    def pool(*args, backend="auto", **kwargs):
        return bev_pool_v2(*args, backend="reference", **kwargs)

    _route_native_composition(monkeypatch, sort, pool)
