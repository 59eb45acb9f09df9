"""A seeded generator of bad and edge-case inputs for any registered operator, and the rule every
outcome must follow (tests/test_op_contracts.py runs it over the registry, reference and native):

- a clean error: TypeError / ValueError / IndexError whose message names an argument of the
  public API (or a DispatchError of an explicit native backend that cannot take the inputs);
- or the documented result: on a GPU the native result equals the reference result on the same
  inputs, unless the op's `precondition` says the result is unspecified for them (e.g. unsorted
  ranks), where only "no crash, right shapes" is checked. Where a NaN / inf input reaches an
  output both results must be non-finite there, but which non-finite value (NaN or +-inf) is
  unspecified: an infinite weight times a zero corner weight is NaN in one summation order and
  inf in another (and a sum beyond 1e38 may overflow in one order only);
- and the inputs are never modified.

The mutations start from one of the op's valid samples and change one argument: another type,
dtype, rank, size, an empty or non-contiguous tensor, out-of-range indices, NaN / inf / huge
values, another device; for non-tensor arguments negative, huge, fractional and wrong-length
values.
"""

from __future__ import annotations

import inspect
import os
import random
import re
from dataclasses import dataclass
from typing import Any

import torch

from mu_space.runtime.kernel_dispatch import DispatchError

CLEAN_ERRORS = (TypeError, ValueError, IndexError)
_INT_EDGES = (-1, -7, 2**31 - 1, -(2**31), 10**6)
_FLOAT_EDGES = (float("nan"), float("inf"), -float("inf"), 3e38, -3e38)


@dataclass
class Case:
    description: str
    args: tuple
    kwargs: dict
    # False for values near the float32 maximum: sums of them overflow in some summation orders
    # and not others, so only the outcome (no crash, an error or a result) is compared
    comparable: bool = True


def public_arg_names(api) -> list[str]:
    return [
        p.name
        for p in inspect.signature(api).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def _other_dtypes(t: torch.Tensor) -> list[torch.dtype]:
    pool = [
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.uint8,
    ]
    return [d for d in pool if d != t.dtype]


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (every other element of a wider buffer)."""
    if t.numel() == 0 or t.dim() == 0:
        return t
    wide = t.new_empty((*t.shape[:-1], t.shape[-1] * 2))
    view = wide[..., ::2]
    view.copy_(t)
    return view


def _with_values(t: torch.Tensor, rng: random.Random) -> tuple[str, torch.Tensor] | None:
    if t.numel() == 0 or t.dtype == torch.bool:
        return None
    out = t.clone()
    flat = out.view(-1)
    k = max(1, min(flat.numel(), rng.choice((1, 3, flat.numel() // 10 + 1))))
    idx = torch.tensor(rng.sample(range(flat.numel()), k), device=t.device)
    if t.is_floating_point():
        value = rng.choice(_FLOAT_EDGES)
        if t.dtype in (torch.float16, torch.bfloat16) and abs(value) == 3e38:
            value = float("inf") if value > 0 else -float("inf")
        flat[idx] = value
        return f"{k} entries set to {value}", out
    info = torch.iinfo(t.dtype)
    value = max(info.min, min(info.max, rng.choice(_INT_EDGES)))
    flat[idx] = value
    return f"{k} entries set to {value}", out


def _tensor_mutations(t: torch.Tensor, rng: random.Random, other_device) -> list:
    muts: list[tuple[str, Any]] = [
        ("a list instead of a tensor", t.tolist() if t.numel() < 64 else [1.0, 2.0]),
        ("a float instead of a tensor", 1.5),
        ("a string instead of a tensor", "tensor"),
        ("non-contiguous (same values)", _noncontiguous(t)),
    ]
    for d in rng.sample(_other_dtypes(t), 2):
        muts.append((f"dtype {str(d).removeprefix('torch.')}", t.to(d)))
    muts.append(("one more dim", t.unsqueeze(0)))
    if t.dim() >= 1:
        muts.append(("one dim less", t.reshape(-1) if t.dim() > 1 else t.sum()))
        dim = rng.randrange(t.dim())
        if t.shape[dim] > 0:
            muts.append((f"dim {dim} one shorter", t.narrow(dim, 0, t.shape[dim] - 1)))
            muts.append((f"dim {dim} empty", t.narrow(dim, 0, 0)))
        muts.append(
            (f"dim {dim} one longer", torch.cat([t, t.narrow(dim, 0, min(1, t.shape[dim]))], dim))
        )
    values = _with_values(t, rng)
    if values is not None:
        muts.append(values)
        values = _with_values(t, rng)
        if values is not None:
            muts.append(values)
    if other_device is not None:
        muts.append((f"on {other_device}", t.to(other_device)))
    return muts


def _scalar_mutations(v) -> list:
    if isinstance(v, bool):
        return [("None", None), ("a string", "x")]
    if isinstance(v, int):
        return [
            ("negative", -v - 1),
            ("huge", 2**40),
            ("fractional", v + 0.5),
            ("None", None),
            ("a string", "x"),
        ]
    if isinstance(v, float):
        return [
            ("NaN", float("nan")),
            ("inf", float("inf")),
            ("negative", -abs(v) - 1.0),
            ("None", None),
        ]
    if isinstance(v, (tuple, list)) and v and all(isinstance(x, (int, float)) for x in v):
        seq = list(v)
        return [
            ("one item short", type(v)(seq[:-1])),
            ("one item more", type(v)(seq + seq[:1])),
            ("a negative item", type(v)([-abs(seq[0]) - 1, *seq[1:]])),
            ("a fractional item", type(v)([seq[0] + 0.5, *seq[1:]])),
            ("a string", "x"),
            ("None", None),
        ]
    return []


def cases(sample, api, seed: int, n: int, other_device=None) -> list[Case]:
    """`n` seeded mutations of `sample` (an opdef.Sample), each changing one argument."""
    rng = random.Random(seed)
    names = public_arg_names(api)
    pool: list[Case] = []
    for i, value in enumerate(sample.args):
        name = names[i] if i < len(names) else f"arg{i}"
        if isinstance(value, torch.Tensor):
            muts = _tensor_mutations(value, rng, other_device)
        elif value is None:
            muts = [("a tensor instead of None", torch.zeros(3))]
        else:
            muts = _scalar_mutations(value)
        for desc, new in muts:
            if any(word and word in desc for word in _skipped()):
                continue
            args = list(sample.args)
            args[i] = new
            pool.append(
                Case(
                    f"{name}: {desc}",
                    tuple(args),
                    dict(sample.kwargs),
                    comparable="e+38" not in desc,
                )
            )
    rng.shuffle(pool)
    return pool[:n]


def _skipped() -> list[str]:
    """MUSPACE_FUZZ_SKIP: comma-separated words; mutations whose description holds one are left
    out (the GPU sanitizer stage skips "huge": a 2**40-cell grid is an allocation failure, which
    compute-sanitizer counts as an error)."""
    return [w.strip() for w in os.environ.get("MUSPACE_FUZZ_SKIP", "").split(",")]


def assert_same_result(got, want, op: str, name: str) -> None:
    """Native vs reference for one case: non-finite in the same places, close elsewhere."""
    from mu_space.testing import tolerances

    gots = got if isinstance(got, tuple) else (got,)
    wants = want if isinstance(want, tuple) else (want,)
    assert len(gots) == len(wants), f"{name}: {len(gots)} results vs {len(wants)}"
    for i, (g, w) in enumerate(zip(gots, wants)):
        if not isinstance(w, torch.Tensor):
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}[{i}]: {g.shape} vs {w.shape}"
        if w.is_floating_point():
            # near the float32 maximum, overflow to inf depends on the summation order too
            g = torch.where(g.abs() > 1e38, g.sign() * float("inf"), g)
            w = torch.where(w.abs() > 1e38, w.sign() * float("inf"), w)
            fin_g, fin_w = torch.isfinite(g), torch.isfinite(w)
            if not torch.equal(fin_g, fin_w):
                where = (fin_g != fin_w).nonzero()[0].tolist()
                raise AssertionError(
                    f"{name}[{i}]: non-finite in one result only, first at "
                    f"{where}: got {g[tuple(where)].item()}, want "
                    f"{w[tuple(where)].item()}"
                )
            g, w = torch.where(fin_g, g, 0), torch.where(fin_w, w, 0)
        tolerances.assert_close(g, w, op=op, name=f"{name}[{i}]")


def names_an_argument(message: str, names: list[str]) -> bool:
    return any(
        re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9])", message) for n in names
    )


def snapshot(args) -> list:
    return [a.detach().clone() if isinstance(a, torch.Tensor) else None for a in args]


def unchanged(args, before) -> str | None:
    """None when every tensor argument still holds its values (NaN-aware), else which changed."""
    for i, (a, b) in enumerate(zip(args, before)):
        if b is None or not isinstance(a, torch.Tensor):
            continue
        same = a.shape == b.shape and (
            torch.equal(a, b)
            or (
                a.is_floating_point()
                and bool(torch.equal(a.isnan(), b.isnan()))
                and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
            )
        )
        if not same:
            return f"argument {i} was modified"
    return None


@dataclass
class Outcome:
    kind: str  # "error" | "result" | "out of memory"
    value: Any  # the exception or the result


def _out_of_memory(exc: BaseException) -> bool:
    # A size argument far beyond memory (a 2**40-cell grid) is legal but cannot be allocated:
    # torch's own out-of-memory error is the documented outcome.
    text = str(exc)
    return (
        isinstance(exc, torch.OutOfMemoryError)
        or "can't allocate memory" in text
        or ("out of memory" in text)
    )  # without torch's caching allocator: an AcceleratorError


def call(api, case: Case, backend: str) -> Outcome:
    """Run one case; an unclean exception propagates (the test reports it with the case)."""
    try:
        return Outcome("result", api(*case.args, **case.kwargs, backend=backend))
    except CLEAN_ERRORS as exc:
        return Outcome("error", exc)
    except DispatchError as exc:
        if backend == "auto":
            raise
        return Outcome("error", exc)
    except RuntimeError as exc:
        if _out_of_memory(exc):
            return Outcome("out of memory", exc)
        raise
