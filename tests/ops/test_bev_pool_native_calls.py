"""bev_pool's own entry points (bev_pool_cells_forward, bev_pool_rows_backward) against the built
library, without a GPU (tests/native_calls.py): the library's argument checks run on exactly the
arguments the Python layer passes and stop at the first runtime call. Skips without a library
that has them."""

from __future__ import annotations

import pytest
import torch

from mu_space.ops import _bev
from tests.native_calls import ReachedRuntime, as_cuda, load_library, relabelling

ENTRY_POINTS = (
    "bev_pool_cells_forward",
    "bev_pool_rows_backward",
    "bev_pool_runs_workspace_ints",
    "bev_pool_runs_from_sorted",
)


@pytest.fixture(scope="module")
def library():
    return load_library(ENTRY_POINTS)


@pytest.fixture
def calls(library, monkeypatch):
    reached = relabelling(library, monkeypatch)
    monkeypatch.setattr(_bev, "stream_handle", lambda t: 0)
    return reached


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cells_arguments_reach_the_runtime(calls, dtype):
    coords = torch.randint(-1, 5, (100, 4), dtype=dtype)
    cells, _, _ = _bev.native_steps()
    with pytest.raises(ReachedRuntime):
        cells(coords, (2, 1, 4, 4))
    assert calls == ["bev_pool_cells_forward"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cell_dtype", [torch.int32, torch.int64])
def test_row_grad_arguments_reach_the_runtime(calls, dtype, cell_dtype):
    grid = _bev.Grid(2, 1, 3, 5, 7)
    grad_out = torch.randn(2, 7, 1, 3, 5).to(dtype)
    cells = torch.randint(-1, grid.n_cells + 1, (50,), dtype=cell_dtype)
    _, row_grad, _ = _bev.native_steps()
    with pytest.raises(ReachedRuntime):
        row_grad(grad_out, cells, grid)
    assert calls == ["bev_pool_rows_backward"]


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: {**a, "coords": a["coords"][:, :3].contiguous()}, ValueError, "coords.shape"),
        (lambda a: {**a, "coords": a["coords"].float()}, TypeError, "coords must be int32"),
        (lambda a: {**a, "cells": a["cells"].long()}, TypeError, "cells must be int32"),
        (lambda a: {**a, "cells": a["cells"][:5]}, ValueError, "cells.shape"),
        (lambda a: {**a, "dims": (-1, 1, 4, 4)}, ValueError, "B must be"),
        (lambda a: {**a, "dims": (2**16, 2**16, 1, 1)}, ValueError, "B\\*D\\*H\\*W"),
    ],
)
def test_cells_bad_arguments_name_them(library, change, error, message):
    a = change(
        {
            "coords": torch.zeros(10, 4, dtype=torch.int32),
            "cells": torch.zeros(10, dtype=torch.int32),
            "dims": (2, 1, 4, 4),
        }
    )
    with pytest.raises(error, match=message):
        library["bev_pool_cells_forward"](as_cuda(a["coords"]), as_cuda(a["cells"]), *a["dims"], 0)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: {**a, "grad_out": a["grad_out"].int()}, TypeError, "grad_out must be float32"),
        (lambda a: {**a, "cells": a["cells"].float()}, TypeError, "cells must be int32 or int64"),
        (lambda a: {**a, "rows": a["rows"][:3].contiguous()}, ValueError, "rows.shape"),
        (lambda a: {**a, "rows": a["rows"].half()}, TypeError, "rows"),
        (
            lambda a: {**a, "grad_feat": a["grad_feat"][:, :2].contiguous()},
            ValueError,
            "grad_feat.shape",
        ),
        (lambda a: {**a, "grad_out": a["grad_out"][0]}, ValueError, "grad_out must be 5-D"),
    ],
)
def test_row_grad_bad_arguments_name_them(library, change, error, message):
    a = change(
        {
            "grad_out": torch.zeros(2, 7, 1, 3, 5),
            "cells": torch.zeros(10, dtype=torch.int32),
            "rows": torch.zeros(30, 7),
            "grad_feat": torch.zeros(10, 7),
        }
    )
    with pytest.raises(error, match=message):
        library["bev_pool_rows_backward"](
            *(as_cuda(a[k]) for k in ("grad_out", "cells", "rows", "grad_feat")), 0
        )


@pytest.mark.parametrize("pad", [True, False])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sort_runs_arguments_reach_the_runtime(calls, dtype, pad):
    cells = torch.randint(-1, 40, (500,), dtype=dtype)
    _, _, sort_runs = _bev.native_steps()
    with pytest.raises(ReachedRuntime):
        sort_runs(cells, 30, pad=pad)
    assert calls == ["bev_pool_runs_from_sorted"]
