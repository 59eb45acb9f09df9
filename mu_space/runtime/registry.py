"""The operator registry: every operator definition (`mu_space.ops._opdef.define`) registers its
generated operator here on import; the self-check, the operator matrix, the contract tests
(tests/test_op_contracts.py) and the `mu_space.ops` exports read this registry (no hand-kept
lists)."""

from __future__ import annotations

from typing import Any

_REGISTRY: dict[str, Any] = {}


def register(op) -> None:
    if op.name in _REGISTRY:
        raise ValueError(f"operator {op.name!r} is already registered")
    _REGISTRY[op.name] = op


def operators(public_only: bool = False) -> list:
    ops = list(_REGISTRY.values())
    return [op for op in ops if op.public] if public_only else ops


def get(name: str):
    return _REGISTRY[name]


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def backward_kind(op) -> str:
    """ "native" (a native backward, or autograd through native parts), "reference" or "no"."""
    if op.composite:
        return "native" if op.grad_inputs else "no"
    if op.backward is None:
        return "no"
    return "native" if op.backward.native is not None else "reference"


def operator_matrix_markdown() -> str:
    """docs/operator_matrix.md, generated (tests/test_selfcheck.py keeps the file in sync)."""
    lines = [
        "# Operator matrix",
        "",
        "Generated from the operator definitions by `python -m mu_space --operator-matrix`; a test",
        "fails when this file and the definitions disagree. Verification status per backend is in",
        "the README (CUDA kernels verified on NVIDIA H200; MUSA build path not verified on hardware).",
        "",
        "| operator | family | dtypes | native entry points | backward | upstream API | models "
        "(default patches; recipes) | doc |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for op in operators(public_only=True):
        doc = f"[{op.doc}]({op.doc.removeprefix('docs/')})" if op.doc else ""
        adoption = "; ".join(
            part
            for part in (
                ", ".join(f"`{p}`" for p in op.patches),
                ", ".join(f"[{r.rsplit('/', 1)[-1]}](../{r}/README.md)" for r in op.recipes),
            )
            if part
        )
        models = f"{op.models} ({adoption})" if adoption else op.models
        entries = ", ".join(f"`{e}`" for e in op.entry_points)
        if op.unverified:
            entries += f" (`auto` takes the reference until verified: {op.unverified})"
        lines.append(
            f"| `{op.name}` | {op.family} | {_dtype_names(op.native_dtypes)} | {entries} | "
            f"{backward_kind(op)} | {op.upstream} | {models} | {doc} |"
        )
    if not operators(public_only=True):
        lines.append("| (none yet) | | | | | | | |")
    return "\n".join(lines) + "\n"
