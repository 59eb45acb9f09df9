"""The contract every registered operator keeps, run over the registry: a new operator gets these
tests by being defined (mu_space/ops/_opdef.py). The op's own test file holds its semantics.

CPU (always): registry / export / docs, reference samples against the declared output shapes,
opcheck of the custom ops, fullgraph torch.compile, strict mode and fallback records, capability
fallbacks (missing entry points, no bf16), inputs never modified, non-contiguous inputs, empty
inputs, and the seeded bad-input fuzz (mu_space.testing.fuzz) on the reference path.
GPU (native library usable): native vs reference on poisoned outputs (forward and gradients),
the caller's non-default stream, bit-exact reruns (forward; backward under deterministic
algorithms), opcheck on the native path, the fuzz with native vs reference. Under the host
emulation (docs/host_emulation.md) the GPU tests (`-m gpu`) run on CPU tensors, less the stream
test; the CPU tests there do not hold (they expect no native library on the CPU).

MUSPACE_FUZZ_CASES sets the fuzz cases per op and sample (default 24 on the CPU, 60 on a GPU).
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest
import torch

import mu_space
from mu_space.ops import _opdef
from mu_space.runtime import kernel_dispatch, native, registry
from mu_space.runtime.kernel_dispatch import DispatchError
from mu_space.testing import fuzz, tolerances
from tests.helpers import emulated, synchronize

ROOT = Path(__file__).resolve().parent.parent
OPS = registry.operators()
KERNEL_OPS = [op for op in OPS if not op.composite]
# the device of the native tests: the GPU, or the CPU under the host emulation
GPU = torch.device("cpu") if emulated() else torch.device("cuda", 0)


def _gpu_ok() -> bool:
    return emulated() or (torch.cuda.is_available() and native.unavailable_reason(GPU) is None)


needs_gpu = pytest.mark.skipif(not _gpu_ok(), reason="needs a GPU where the native library runs")

_SAMPLES: dict = {}


def samples(op, device: torch.device) -> list[_opdef.Sample]:
    key = (op.name, str(device))
    if key not in _SAMPLES:
        torch.manual_seed(0)
        _SAMPLES[key] = op.samples(device)
    return _SAMPLES[key]


def _ids(op):
    return op.name


def _op_samples(ops):
    return [
        pytest.param(op, i, id=f"{op.name}-{i}")
        for op in ops
        for i in range(len(samples(op, torch.device("cpu"))))
    ]


def _is_empty(sample) -> bool:
    return any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in sample.args)


def _tensors(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value,)
    return tuple(v for v in value if isinstance(v, torch.Tensor))


def _grad_names(op) -> tuple:
    return op.backward.inputs if op.backward is not None else op.grad_inputs


def _leaves(op, sample):
    """The sample's args with the differentiable floating inputs as fresh leaves."""
    params = fuzz.public_arg_names(op.api)
    wanted = {params.index(n) for n in _grad_names(op) if n in params}
    return [
        a.detach().clone().requires_grad_(True)
        if i in wanted and isinstance(a, torch.Tensor) and a.is_floating_point()
        else a
        for i, a in enumerate(sample.args)
    ]


def _forward_backward(op, sample, backend, through_custom_op=False):
    """The sample's output and gradients through the public call (its eager autograd path), or
    through the custom op's `register_autograd` (what compiled graphs and torch.ops run)."""
    args = _leaves(op, sample)
    if through_custom_op:
        schema_args = op.capture_schema_args(*args, **sample.kwargs)
        out = op._wrap(op.custom_op(*schema_args, backend))
    else:
        out = op.api(*args, **sample.kwargs, backend=backend)
    outs = _tensors(out)
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(o.shape, generator=gen).to(o) for o in outs]
    torch.autograd.backward(outs, weights)
    grads = tuple(a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad)
    return out, grads


# ------------------------------------------------------------------ the definition itself


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_registered_exported_and_documented(op):
    assert getattr(mu_space.ops, op.api.__name__) is op.api
    if op.public:
        assert getattr(mu_space, op.api.__name__) is op.api
        assert op.doc and (ROOT / op.doc).is_file(), f"{op.name}: doc page {op.doc!r} missing"
        assert op.upstream, f"{op.name}: no upstream API named"
    doc = inspect.getdoc(op.api) or ""
    assert len(doc) > 200, f"{op.name}: help() shows no formula / shapes"
    params = inspect.signature(op.api).parameters
    assert (
        params["backend"].default == "auto"
        and params["backend"].kind == params["backend"].KEYWORD_ONLY
    )
    for name in _grad_names(op):
        assert name in op.arg_names, f"{op.name}: differentiable input {name!r} not in the schema"
    assert op.entry_points, f"{op.name}: no native entry points declared"


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_samples_cover_dtypes_and_empty_inputs(op):
    # built in strict mode, as `python -m mu_space --strict` builds them: a sample made with
    # another op's default backend would fail there (it did on the H200 for the sparse ops)
    kernel_dispatch.set_strict(True)
    got = op.samples(torch.device("cpu"))
    kernel_dispatch.set_strict(False)
    assert got, f"{op.name}: no samples"
    assert any(_is_empty(s) for s in got), f"{op.name}: no sample with an empty input"
    if _grad_names(op):
        assert any(s.grad for s in got), f"{op.name}: no sample compares gradients"


def test_operator_matrix_lists_every_public_op():
    doc = (ROOT / "docs" / "operator_matrix.md").read_text()
    assert doc == registry.operator_matrix_markdown()
    for op in registry.operators(public_only=True):
        assert f"| `{op.name}` |" in doc


def test_schema_args_are_what_the_public_api_passes():
    op = registry.get("bev_pool_v2")
    s = samples(op, torch.device("cpu"))[0]
    args = op.capture_schema_args(*s.args)
    assert len(args) == len(op.arg_names) and isinstance(args[5], list)


def _grad_samples(ops):
    return [
        pytest.param(op, i, id=f"{op.name}-{i}")
        for op in ops
        for i, s in enumerate(samples(op, torch.device("cpu")))
        if s.grad
    ]


KERNEL_OPS_WITH_BACKWARD = [op for op in KERNEL_OPS if op.backward is not None]


@pytest.mark.parametrize(("op", "index"), _grad_samples(KERNEL_OPS_WITH_BACKWARD))
def test_eager_autograd_path_matches_the_custom_ops_autograd(op, index, monkeypatch):
    """The public call with inputs that require grad skips the dispatcher (_opdef's eager
    autograd path) and gives what the custom op's register_autograd gives, bit for bit, with
    the same dispatch records (forward and backward)."""
    s = samples(op, torch.device("cpu"))[index]
    kernel_dispatch.reset()
    want, want_g = _forward_backward(op, s, "reference", through_custom_op=True)
    want_records = kernel_dispatch.records()
    custom_op = op.custom_op
    calls = []
    monkeypatch.setattr(op, "custom_op", lambda *a: calls.append(a) or custom_op(*a))
    kernel_dispatch.reset()
    got, got_g = _forward_backward(op, s, "reference")
    assert not calls, f"{op.name}: the public call went through the dispatcher"
    assert kernel_dispatch.records() == want_records
    assert any(r["op"] == op.backward_name for r in want_records), want_records
    for a, b in zip((*_tensors(got), *got_g), (*_tensors(want), *want_g)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), op.name


def test_eager_autograd_path_leaves_transforms_and_modes_to_the_dispatcher():
    """FakeTensorMode (like make_fx and torch.func) acts in the dispatcher: there the public
    call takes the custom op (its fake), not the eager path (which would run the reference on
    fake tensors). A second derivative is refused clearly, as the custom op refuses it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = registry.get("bev_pool_v2")
    s = samples(op, torch.device("cpu"))[0]
    leaves = _leaves(op, s)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in leaves]
        out = op.api(*fake)
        out.sum().backward()
        assert fake[0].grad.shape == fake[0].shape and fake[1].grad.shape == fake[1].shape
    out = op.api(*leaves)
    (g,) = torch.autograd.grad(out.square().sum(), leaves[1], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


# ------------------------------------------------------------------ reference path (CPU)


@pytest.mark.parametrize(("op", "index"), _op_samples(OPS))
def test_reference_result_has_the_checked_shapes(op, index):
    s = samples(op, torch.device("cpu"))[index]
    out = op.api(*s.args, **s.kwargs, backend="reference")
    c = op.d.check(*op.capture_schema_args(*s.args, **s.kwargs))
    if c.outputs is not None:
        outs = _tensors(out)
        assert [(tuple(o.shape), o.dtype) for o in outs] == [
            (tuple(shape), dtype) for shape, dtype in c.outputs
        ]


@pytest.mark.parametrize(("op", "index"), _op_samples(OPS))
def test_inputs_are_never_modified(op, index):
    s = samples(op, torch.device("cpu"))[index]
    before = fuzz.snapshot(s.args)
    op.api(*s.args, **s.kwargs, backend="reference")
    if s.grad:
        _forward_backward(op, s, "reference")
    assert fuzz.unchanged(s.args, before) is None


@pytest.mark.parametrize(("op", "index"), _op_samples(OPS))
def test_non_contiguous_inputs_give_the_same_result(op, index):
    s = samples(op, torch.device("cpu"))[index]
    want = op.api(*s.args, **s.kwargs, backend="reference")
    args = tuple(fuzz._noncontiguous(a) if isinstance(a, torch.Tensor) else a for a in s.args)
    got = op.api(*args, **s.kwargs, backend="reference")
    tolerances.assert_close(_tensors(got), _tensors(want), op=op.name)


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_auto_on_cpu_falls_back_with_the_reason_and_strict_forbids_it(op):
    s = samples(op, torch.device("cpu"))[0]
    kernel_dispatch.reset()
    op.api(*s.args, **s.kwargs)
    rows = [r for r in kernel_dispatch.records() if r["op"] == op.name]
    assert rows and rows[0]["backend"] == "reference"
    assert rows[0]["reason"] == native.unavailable_reason(torch.device("cpu"))
    kernel_dispatch.set_strict(True)
    with pytest.raises(DispatchError, match="strict mode forbids"):
        op.api(*s.args, **s.kwargs)
    kernel_dispatch.set_strict(False)
    with pytest.raises(DispatchError, match=rf"{op.name}: backend='native' unavailable"):
        op.api(*s.args, **s.kwargs, backend="native")
    with pytest.raises(ValueError, match="backend must be one of"):
        op.api(*s.args, **s.kwargs, backend="bogus")


@pytest.fixture
def fresh_entry_points():
    """Ops cache what the library can do: forget what a monkeypatched library said."""
    yield
    _opdef.forget_native_reasons()


@pytest.mark.parametrize("op", [op for op in OPS if op.entry_points], ids=_ids)
def test_capabilities_come_from_the_library(op, monkeypatch, fresh_entry_points):
    """A library without the op's entry points, or without bf16, makes `auto` fall back with
    that reason (and `native` fail), never a TypeError from C++."""
    s = samples(op, torch.device("cpu"))[0]
    monkeypatch.setattr(native, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(native, "has_function", lambda name: False)
    _opdef.forget_native_reasons()
    kernel_dispatch.reset()
    op.api(*s.args, **s.kwargs)
    reasons = {r["reason"] for r in kernel_dispatch.records() if r["op"] == op.name}
    assert any("has no" in r and op.entry_points[0] in r for r in reasons), reasons
    with pytest.raises(DispatchError, match="rebuild"):
        op.api(*s.args, **s.kwargs, backend="native")
    monkeypatch.setattr(native, "has_function", lambda name: True)
    monkeypatch.setattr(native, "build_facts", lambda: {"bf16": False, "limits": {}})
    _opdef.forget_native_reasons()
    if torch.bfloat16 in op.native_dtypes:
        assert "bfloat16" in op._capability_reason(torch.bfloat16, "x")
    assert op._capability_reason(torch.float64, "x") == (
        f"x dtype float64 has no native kernel "
        f"({', '.join(str(d).removeprefix('torch.') for d in op.native_dtypes)})"
    )


@pytest.mark.parametrize("op", KERNEL_OPS, ids=_ids)
def test_opcheck_reference_path(op):
    for s in [s for s in samples(op, torch.device("cpu")) if not _is_empty(s)][:1]:
        args = op.capture_schema_args(*s.args, **s.kwargs)
        torch.library.opcheck(op.custom_op, (*args, "auto"))
        if op.backward is not None:
            leaves = tuple(op.capture_schema_args(*_leaves(op, s), **s.kwargs))
            torch.library.opcheck(op.custom_op, (*leaves, "auto"))


@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_torch_compile_fullgraph_matches_eager(op):
    from torch._dynamo.testing import CompileCounterWithBackend

    s = [s for s in samples(op, torch.device("cpu")) if not _is_empty(s)][0]
    counter = CompileCounterWithBackend("eager")
    fn = torch.compile(lambda *a: op.api(*a, **s.kwargs), backend=counter, fullgraph=True)
    torch._dynamo.reset()
    got = fn(*s.args)
    want = op.api(*s.args, **s.kwargs)
    tolerances.assert_close(_tensors(got), _tensors(want), op=op.name)
    if not op.composite:
        targets = {str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"}
        assert any(f"mu_space.{op.name}" in t for t in targets), targets


# ------------------------------------------------------------------ the bad-input fuzz


def _fuzz_cases_per_sample(default: int) -> int:
    return int(os.environ.get("MUSPACE_FUZZ_CASES", default))


def _check_outcome(op, case, outcome, names):
    if outcome.kind == "error":
        exc = outcome.value
        assert isinstance(exc, DispatchError) or fuzz.names_an_argument(str(exc), names), (
            f"{op.name} [{case.description}]: {type(exc).__name__} does not name an argument: {exc}"
        )


@pytest.mark.parametrize(("op", "index"), _op_samples(OPS))
def test_fuzz_reference_errors_are_clean_and_inputs_untouched(op, index):
    s = samples(op, torch.device("cpu"))[index]
    names = fuzz.public_arg_names(op.api)
    for case in fuzz.cases(s, op.api, seed=index, n=_fuzz_cases_per_sample(24)):
        before = fuzz.snapshot(case.args)
        try:
            outcome = fuzz.call(op.api, case, "reference")
        except Exception as exc:
            raise AssertionError(f"{op.name} [{case.description}]: unclean {exc!r}") from exc
        _check_outcome(op, case, outcome, names)
        assert fuzz.unchanged(case.args, before) is None, f"{op.name} [{case.description}]"


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("op", "index"), _op_samples(OPS))
def test_fuzz_native_matches_reference(op, index):
    s = samples(op, GPU)[index]
    names = fuzz.public_arg_names(op.api)
    other = None if emulated() else torch.device("cpu")
    for case in fuzz.cases(
        s, op.api, seed=100 + index, n=_fuzz_cases_per_sample(60), other_device=other
    ):
        before = fuzz.snapshot(case.args)
        try:
            ref = fuzz.call(op.api, case, "reference")
            got = fuzz.call(op.api, case, "auto")
            synchronize(GPU)
        except Exception as exc:
            raise AssertionError(f"{op.name} [{case.description}]: unclean {exc!r}") from exc
        _check_outcome(op, case, got, names)
        assert fuzz.unchanged(case.args, before) is None, f"{op.name} [{case.description}]"
        if "out of memory" in (ref.kind, got.kind):
            continue
        assert ref.kind == got.kind, (
            f"{op.name} [{case.description}]: reference {ref.kind} ({ref.value!r:.200}) but "
            f"auto {got.kind} ({got.value!r:.200})"
        )
        if got.kind == "result" and case.comparable and not _unspecified(op, case):
            fuzz.assert_same_result(
                _tensors(got.value), _tensors(ref.value), op.name, f"{op.name} [{case.description}]"
            )


def _unspecified(op, case) -> bool:
    if op.precondition is None:
        return False
    return op.precondition(*op.capture_schema_args(*case.args, **case.kwargs)) is not None


# ------------------------------------------------------------------ native (GPU)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("op", "index"), _op_samples(OPS))
def test_native_matches_reference_on_poisoned_outputs(op, index):
    s = samples(op, GPU)[index]
    want = op.api(*s.args, **s.kwargs, backend="reference")
    kernel_dispatch.reset()
    with _opdef.poisoned_outputs():
        got = op.api(*s.args, **s.kwargs, backend="native")
    tolerances.assert_close(_tensors(got), _tensors(want), op=op.name)
    assert {r["backend"] for r in kernel_dispatch.records() if r["op"] == op.name} == {GPU.type}
    if s.grad:
        _, want_g = _forward_backward(op, s, "reference")
        with _opdef.poisoned_outputs():
            _, got_g = _forward_backward(op, s, "native")
        tolerances.assert_close(got_g, want_g, op=op.name, name="grad")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("op", "index"), _op_samples(OPS))
def test_native_inputs_never_modified(op, index):
    s = samples(op, GPU)[index]
    before = fuzz.snapshot(s.args)
    op.api(*s.args, **s.kwargs, backend="native")
    if s.grad:
        _forward_backward(op, s, "native")
    synchronize(GPU)
    assert fuzz.unchanged(s.args, before) is None


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("op", "index"), _op_samples(OPS))
def test_native_reruns_are_bit_exact(op, index):
    s = samples(op, GPU)[index]
    first = _tensors(op.api(*s.args, **s.kwargs, backend="native"))
    second = _tensors(op.api(*s.args, **s.kwargs, backend="native"))
    for a, b in zip(first, second):
        assert torch.equal(a, b) or (
            a.is_floating_point() and torch.equal(a.nan_to_num(), b.nan_to_num())
        )
    if s.grad:
        torch.use_deterministic_algorithms(True)
        try:
            _, g1 = _forward_backward(op, s, "native")
            _, g2 = _forward_backward(op, s, "native")
        finally:
            torch.use_deterministic_algorithms(False)
        for a, b in zip(g1, g2):
            assert torch.equal(a, b), f"{op.name}: deterministic backward differs between runs"


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("op", "index"), _op_samples(OPS))
def test_native_runs_on_the_callers_stream(op, index):
    """The kernels queue behind torch work on the same non-default stream: the inputs are
    written by a copy that waits behind a ~50 ms spin on that stream, so a launch on any other
    stream would read them before the copy lands."""
    if emulated():
        pytest.skip("CUDA streams: a GPU test only")
    s = samples(op, GPU)[index]
    want = op.api(*s.args, **s.kwargs, backend="native")
    torch.cuda.synchronize()
    blank = [torch.zeros_like(a) if isinstance(a, torch.Tensor) else a for a in s.args]
    stream = torch.cuda.Stream(GPU)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        for b, a in zip(blank, s.args):
            if isinstance(a, torch.Tensor):
                b.copy_(a)
        got = op.api(*blank, **s.kwargs, backend="native")
    stream.synchronize()
    tolerances.assert_close(_tensors(got), _tensors(want), op=op.name)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", KERNEL_OPS, ids=_ids)
def test_native_opcheck(op):
    for s in [s for s in samples(op, GPU) if not _is_empty(s)][:1]:
        args = op.capture_schema_args(*s.args, **s.kwargs)
        torch.library.opcheck(op.custom_op, (*args, "native"))
        if op.backward is not None:
            leaves = tuple(op.capture_schema_args(*_leaves(op, s), **s.kwargs))
            torch.library.opcheck(op.custom_op, (*leaves, "native"))


def test_fuzz_rules_catch_violations():
    """The outcome rule itself: an error that names no argument fails, one that does passes."""
    assert fuzz.names_an_argument("feat must be int32, got float32", ["feat"])
    assert not fuzz.names_an_argument("index out of range in self", ["feat", "ranks_bev"])
    assert not fuzz.names_an_argument("Bad input", ["B"])
    assert fuzz.names_an_argument("B must be >= 0, got -1", ["B"])
    t = torch.arange(4.0)
    before = fuzz.snapshot((t,))
    t[0] = 5
    assert fuzz.unchanged((t,), before) is not None
    assert re.search("modified", fuzz.unchanged((t,), before))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_native_on_a_device_other_than_the_current_one(op):
    """The device guard: tensors on cuda:1 while cuda:0 is current run there, on cuda:1's
    current stream, and leave cuda:0 current."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (only one-GPU machines were lent)")
    second = torch.device("cuda", 1)
    s = [s for s in samples(op, second) if not _is_empty(s)][0]
    torch.cuda.set_device(0)
    with torch.cuda.device(1):
        want = op.api(*s.args, **s.kwargs, backend="reference")
    with torch.cuda.stream(torch.cuda.Stream(second)):
        got = op.api(*s.args, **s.kwargs, backend="native")
    torch.cuda.synchronize(second)
    assert all(t.device == second for t in _tensors(got))
    tolerances.assert_close(_tensors(got), _tensors(want), op=op.name)
    assert torch.cuda.current_device() == 0


def test_fuzz_same_result_rule():
    """Non-finite in the same places (NaN and inf interchangeable), close elsewhere."""
    want = torch.tensor([1.0, float("inf"), float("nan")])
    fuzz.assert_same_result((torch.tensor([1.0, float("nan"), -float("inf")]),), (want,), None, "x")
    with pytest.raises(AssertionError, match="non-finite in one result only"):
        fuzz.assert_same_result((torch.tensor([float("nan"), 1.0, 1.0]),), (want,), None, "x")
    with pytest.raises(AssertionError, match="out of tolerance"):
        fuzz.assert_same_result(
            (torch.tensor([2.0, float("inf"), float("nan")]),), (want,), None, "x"
        )


def test_fuzz_skips_and_marks_cases(monkeypatch):
    op = registry.get("add_one")
    s = samples(op, torch.device("cpu"))[0]
    every = fuzz.cases(s, op.api, seed=0, n=1000)
    assert any("e+38" in c.description and not c.comparable for c in every) or all(
        c.comparable for c in every
    )
    monkeypatch.setenv("MUSPACE_FUZZ_SKIP", "string,float")
    kept = fuzz.cases(s, op.api, seed=0, n=1000)
    assert kept and not any("string" in c.description or "float" in c.description for c in kept)
    assert fuzz._out_of_memory(RuntimeError("CUDA error: out of memory"))
