"""Backend choice and dispatch records (docs/architecture.md, "Dispatch").

    backend="auto"       native when the library is built for the tensors' device and the inputs
                         are supported; otherwise the reference path, with the reason recorded
    backend="native"     the device's native kernel, or DispatchError
    backend="cuda"/"musa" the same, and the tensors must be on that device type
    backend="reference"  always the PyTorch path

`MUSPACE_STRICT=1` (or `set_strict(True)`) turns every auto fallback into a DispatchError.
Every call is counted per (op, backend, reason): `report()` prints the table, `reset()` clears
it, `MUSPACE_DISPATCH_LOG=1` (or `set_logging(True)`) also prints each decision to stderr through
the `mu_space.dispatch` logger. Recording is one dict update.
"""

from __future__ import annotations

import logging
import os

import torch

from mu_space.runtime import native

BACKENDS = ("auto", "native", "cuda", "musa", "reference")
REFERENCE = "reference"

_log = logging.getLogger("mu_space.dispatch")
_counts: dict[tuple[str, str, str], int] = {}
# (op, backend) -> [calls] of native decisions that an operator counts itself on its fast path
_native_cells: dict[tuple[str, str], list] = {}
_strict = os.environ.get("MUSPACE_STRICT", "0") not in ("", "0")
_log_enabled = False
_handler: logging.Handler | None = None


class DispatchError(RuntimeError):
    """The requested backend cannot run these inputs (or strict mode forbids a fallback)."""


def set_strict(enabled: bool) -> None:
    global _strict
    _strict = bool(enabled)


def is_strict() -> bool:
    return _strict


def set_logging(enabled: bool) -> None:
    """Log every decision at INFO to the `mu_space.dispatch` logger. Unless the application has
    configured that logger (or the root logger) itself, a stderr handler is attached so the lines
    are seen."""
    global _log_enabled, _handler
    _log_enabled = bool(enabled)
    if _log_enabled and _handler is None and not _log.handlers and not logging.getLogger().handlers:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("mu_space.dispatch: %(message)s"))
        _log.addHandler(_handler)
    if _log_enabled and _log.getEffectiveLevel() > logging.INFO:
        _log.setLevel(logging.INFO)


def record(op: str, backend: str, reason: str) -> None:
    key = (op, backend, reason)
    _counts[key] = _counts.get(key, 0) + 1
    if _log_enabled:
        _log.info("%s -> %s (%s)", op, backend, reason)


def use_native(op: str, backend: str, device: torch.device, unsupported=None) -> bool:
    """Decide native (True) or reference (False) for one call, and record the decision.

    `unsupported`: why these particular inputs cannot take the native path (e.g. a dtype the
    kernel lacks), or None; or a function returning that, asked only where the library runs.
    """
    if backend == REFERENCE:
        return decide(op, backend, device, None)
    reason = native.unavailable_reason(device)
    if reason is None and unsupported is not None:
        reason = unsupported() if callable(unsupported) else unsupported
    return decide(op, backend, device, reason)


def decide(op: str, backend: str, device: torch.device, reason: str | None) -> bool:
    """use_native with the reason already known: None when the native path can run (the library
    runs on `device` and takes these inputs), else why not."""
    if backend == "auto":
        if reason is None:  # the hot path: the record inline (a call costs ~0.1 us)
            key = (op, device.type, "native")
            _counts[key] = _counts.get(key, 0) + 1
            if _log_enabled:
                _log.info("%s -> %s (%s)", op, device.type, "native")
            return True
        if _strict:
            raise DispatchError(f"{op}: strict mode forbids the reference fallback: {reason}")
        record(op, REFERENCE, reason)
        return False
    if backend == REFERENCE:
        record(op, REFERENCE, "requested")
        return False
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "native" and device.type != backend:
        raise DispatchError(f"{op}: backend={backend!r} needs {backend} tensors, got {device}")
    if reason is not None:
        raise DispatchError(f"{op}: backend={backend!r} unavailable: {reason}")
    record(op, device.type, "native")
    return True


def native_counter(op: str, backend: str) -> list:
    """A one-element list counting `op`'s native calls on `backend`: an operator's eager fast path
    adds to it directly (one increment per call) and records() reports it with the rest."""
    cell = _native_cells.get((op, backend))
    if cell is None:
        cell = _native_cells[op, backend] = [0]
    return cell


def records() -> list[dict]:
    counts = dict(_counts)
    for (op, backend), cell in _native_cells.items():
        if cell[0]:
            key = (op, backend, "native")
            counts[key] = counts.get(key, 0) + cell[0]
    return [
        {"op": op, "backend": backend, "reason": reason, "calls": calls}
        for (op, backend, reason), calls in sorted(counts.items())
    ]


def reset() -> None:
    _counts.clear()
    for cell in _native_cells.values():
        cell[0] = 0


def report() -> str:
    """The dispatch records as a text table (a string: `print(kernel_dispatch.report())`)."""
    rows = records()
    if not rows:
        return "dispatch report: no operator calls recorded"
    header = ("op", "backend", "calls", "reason")
    table = [header] + [(r["op"], r["backend"], str(r["calls"]), r["reason"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3]
        for row in table
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "dispatch report:\n" + "\n".join(lines)


if os.environ.get("MUSPACE_DISPATCH_LOG", "0") not in ("", "0"):
    set_logging(True)
