"""The operator registry: every operator module registers one `OperatorSpec` on import, and the
self-check, the docs generator and the tests read this registry (no hand-kept lists)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class SelfCheckCase:
    """One self-check: `spec.api(*args, **kwargs, backend=...)` native vs reference."""

    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    atol: float = 0.0
    rtol: float = 0.0
    backward: bool = False  # also compare gradients of the floating inputs that require grad


@dataclass
class OperatorSpec:
    name: str
    family: str
    api: Callable[..., Any]  # public function taking backend=...
    reference: Callable[..., Any]
    native_entry_points: tuple[str, ...]
    self_check_cases: Callable[[torch.device], list[SelfCheckCase]]
    dtypes: tuple[str, ...] = ("float32",)
    backward: str = "no"  # "native", "reference", "no"
    upstream: str = ""  # API it is drop-in compatible with
    models: str = ""
    patches: tuple[str, ...] = ()  # names of the default_patcher() patches that call this op
    recipes: tuple[str, ...] = ()  # model_examples/<Model> directories that run it
    doc: str = ""  # docs/operators/<op>.md
    public: bool = True  # False for build smokes (add_one): not in the operator matrix


_REGISTRY: dict[str, OperatorSpec] = {}


def register(spec: OperatorSpec) -> OperatorSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"operator {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def operators(public_only: bool = False) -> list[OperatorSpec]:
    specs = list(_REGISTRY.values())
    return [s for s in specs if s.public] if public_only else specs


def get(name: str) -> OperatorSpec:
    return _REGISTRY[name]


def operator_matrix_markdown() -> str:
    """docs/operator_matrix.md, generated (tests/test_docs.py keeps the file in sync)."""
    lines = [
        "# Operator matrix",
        "",
        "Generated from the operator registry by `python -m mu_space --operator-matrix`; a test",
        "fails when this file and the registry disagree. Verification status per backend is in",
        "the README (CUDA kernels verified on NVIDIA H200; MUSA build path not verified on hardware).",
        "",
        "| operator | family | dtypes | native entry points | backward | upstream API | models "
        "(default patches; recipes) | doc |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in operators(public_only=True):
        doc = f"[{s.doc}]({s.doc.removeprefix('docs/')})" if s.doc else ""
        adoption = "; ".join(
            part
            for part in (
                ", ".join(f"`{p}`" for p in s.patches),
                ", ".join(f"[{r.rsplit('/', 1)[-1]}](../{r}/README.md)" for r in s.recipes),
            )
            if part
        )
        models = f"{s.models} ({adoption})" if adoption else s.models
        lines.append(
            f"| `{s.name}` | {s.family} | {', '.join(s.dtypes)} | "
            f"{', '.join(f'`{e}`' for e in s.native_entry_points)} | {s.backward} | "
            f"{s.upstream} | {models} | {doc} |"
        )
    if not operators(public_only=True):
        lines.append("| (none yet) | | | | | | | |")
    return "\n".join(lines) + "\n"
