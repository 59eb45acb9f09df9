"""One declarative definition per operator; everything else is generated here, once.

An operator module declares an `OpDef` and a thin public function (docs/architecture.md has a
worked example):

    OP = opdef.define(opdef.OpDef(
        name="my_op", family="bev", schema="(Tensor x, int[] shape) -> Tensor",
        check=check, reference=my_op_reference, native=forward_native,
        backward=opdef.Backward(inputs=("x",), reference=..., native=...),
        native_dtypes=(torch.float32,), entry_points=("my_op_forward",), samples=samples, ...))

    @OP.export
    def my_op(x, shape, *, backend="auto"):
        '''Formula, shapes, dtypes, upstream API.'''
        return OP(x, list(shape), backend=backend)

From that definition this module makes:
- the `torch.library` custom op `mu_space::my_op(<schema args>, str backend)` with its fake
  (from the shapes `check` returns, or `OpDef.fake` for data-dependent sizes) and, when the op has
  a backward, `register_autograd` with a real op `mu_space::my_op_backward`;
- the eager fast path: calls that need no gradient and are not being compiled skip the torch
  dispatcher and run the implementation directly; calls that need one take the eager autograd
  path (`_autograd_function`), which skips it in forward and backward;
- the backend choice with its recorded reason (`mu_space.runtime.kernel_dispatch`): native when
  the library runs on the tensors' device, has the op's entry points, supports the dtype (bf16 is
  a build fact) and `OpDef.supports` accepts the sizes (limits from the library's build facts);
- for composite ops (native path composed of other ops, no kernel of their own), the choice at
  torch.compile trace time;
- the registry entry that the self-check, the operator matrix, the contract tests
  (tests/test_op_contracts.py) and the `mu_space.ops` exports read.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from mu_space.runtime import kernel_dispatch, native, registry


class Checked:
    """What an operator's `check` returns: the device and dtype that decide the backend, the
    output shapes and dtypes (None for a data-dependent size: then `OpDef.fake` is required), and
    `info` for the op's own implementations (parsed shapes, counts)."""

    __slots__ = ("device", "dtype", "dtype_arg", "outputs", "info")

    def __init__(self, device, dtype=None, outputs=None, info=None, dtype_arg: str = ""):
        self.device = device
        self.dtype = dtype
        self.dtype_arg = dtype_arg  # the argument whose dtype `dtype` is (dispatch messages)
        self.outputs = outputs  # tuple of (shape, dtype), or None
        self.info = info


class Sample(NamedTuple):
    """One set of public-API arguments: run by the self-check (native vs reference) and by the
    contract tests. `grad`: also compare the gradients of the op's differentiable inputs."""

    label: str
    args: tuple
    kwargs: dict = {}
    grad: bool = False


@dataclass(frozen=True)
class Backward:
    """The backward of a kernel op, as a real custom op `mu_space::<name>_backward`.

    inputs     names of the differentiable schema arguments, in order
    reference  (grad_out, *schema_args) -> one gradient per input (None where there is none)
    native     (checked, grad_out, *schema_args, needs=(bool, ...), deterministic=bool) -> the
               same; `needs[i]` says whether input i wants its gradient (others may be None)
    grad_out is the gradient of the op's single output (ops with one differentiable output).
    """

    inputs: tuple[str, ...]
    reference: Callable[..., tuple]
    native: Callable[..., tuple] | None = None


# lets `auto` run kernels marked `unverified` (the GPU sessions that verify them)
TRY_UNVERIFIED = "MUSPACE_TRY_UNVERIFIED"


def step_allowed(unverified: str) -> bool:
    """Whether a native step inside a verified op may run: `unverified` is "" once it has passed
    the GPU suite (else why not, e.g. "not yet run on a GPU"), or MUSPACE_TRY_UNVERIFIED=1."""
    return not unverified or os.environ.get(TRY_UNVERIFIED) == "1"


@dataclass
class OpDef:
    name: str
    family: str
    schema: str  # torch.library schema without the trailing `str backend`
    check: Callable[..., Checked]  # (*schema_args) -> Checked; raises naming the argument
    reference: Callable[..., Any]  # (*schema_args) -> outputs (vectorised PyTorch)
    native: Callable[..., Any] | None = None  # (checked, *schema_args) -> outputs
    samples: Callable[[torch.device], list[Sample]] | None = None
    backward: Backward | None = None
    fake: Callable[..., Any] | None = None  # (*schema_args) -> outputs; data-dependent sizes
    supports: Callable[[Checked], str | None] | None = None  # why native cannot take these sizes
    native_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    entry_points: tuple[str, ...] = ()
    composite: bool = False  # native path composed of other ops: no custom op of its own
    grad_inputs: tuple[str, ...] = ()  # composite ops: inputs differentiable through the parts
    result: Callable[..., Any] | None = None  # wraps a tuple result (e.g. a NamedTuple type)
    precondition: Callable[..., str | None] | None = None  # documented "unspecified result" cases
    upstream: str = ""  # the API it is drop-in compatible with
    models: str = ""
    patches: tuple[str, ...] = ()  # default_patcher() patches that call this op
    recipes: tuple[str, ...] = ()  # model_examples/<Model> directories that run it
    doc: str = ""  # docs/operators/<op>.md
    public: bool = True  # False: internal primitive or build smoke (not in the operator matrix)
    # Set while the native kernels have not run on a GPU (say where they will be verified):
    # `auto` then takes the reference with this reason; `native` / `cuda` / `musa` run them.
    unverified: str = ""
    api: Callable[..., Any] | None = field(default=None, repr=False)


_capturing = False  # capture_schema_args (tests) is running: __call__ hands its args back
_UNKNOWN = object()


class _Captured(Exception):
    def __init__(self, args):
        super().__init__("captured")
        self.args_ = args


def _arg_names(schema: str) -> tuple[str, ...]:
    parsed = torch._C.parse_schema(f"mu_space::_probe{schema}")
    return tuple(a.name for a in parsed.arguments)


def _args_part(schema: str) -> str:
    head = schema.split("->")[0].strip()
    assert head.startswith("(") and head.endswith(")"), f"bad schema {schema!r}"
    return head[1:-1].strip()


def _results(schema: str) -> str:
    return schema.split("->", 1)[1].strip()


class Operator:
    """The generated operator: call it with schema arguments and `backend=`."""

    def __init__(self, d: OpDef):
        self.d = d
        self.name = d.name
        self.backward_name = f"{d.name}_backward"
        self.arg_names = _arg_names(d.schema)
        self._reason_cache: dict = {}  # (device, dtype, dtype arg) -> native_reason's first part
        self._native_cells: dict = {}  # (device, dtype) -> the dispatch counter of the hot path
        self._reason_status = None  # the native.status() object the caches were filled under
        self._supports = self._supports_or_reason if d.supports is not None else None
        if d.backward is not None:
            self.grad_index = tuple(self.arg_names.index(n) for n in d.backward.inputs)
        else:
            self.grad_index = tuple(self.arg_names.index(n) for n in d.grad_inputs)
        self.composite = d.composite
        # hot-path copies of the definition's functions (attribute lookups cost per call)
        self._check, self._native, self._reference, self._result = (
            d.check,
            d.native,
            d.reference,
            d.result,
        )
        # inputs that send a call through the custom op's autograd (composite ops differentiate
        # through their parts)
        self._autograd_index = () if d.composite else self.grad_index
        self.custom_op = None
        self.backward_op = None
        self._function = None  # the eager autograd path (a torch.autograd.Function)
        if not d.composite:
            self._define_custom_ops()
            if d.backward is not None:
                self._function = _autograd_function(self)

    # ------------------------------------------------------------------ calling

    def __call__(self, *args, backend: str = "auto"):
        if _capturing:
            raise _Captured(args)
        if self.composite:
            return self._wrap(self._run_composite(args, backend))
        if torch.compiler.is_compiling():
            return self._wrap(self.custom_op(*args, backend))
        if self._autograd_index and torch.is_grad_enabled():
            for i in self._autograd_index:
                if getattr(args[i], "requires_grad", False):
                    if self._function is None or _dispatcher_needed():
                        return self._wrap(self.custom_op(*args, backend))
                    # the eager autograd path: no dispatcher in forward or backward
                    out = self._function.fast_apply(backend, *args)
                    return out if self._result is None else self._result(*out)
        # the eager path: no dispatcher
        return self._eager(self._check(*args), args, backend)

    def _eager(self, c: Checked, args: tuple, backend: str, wrap: bool = True):
        """Choose, record and run the forward of checked arguments (the eager paths)."""
        # (logged calls take the recording path; the flag is read directly, not through a call)
        if (
            backend == "auto"
            and native._status is self._reason_status
            and not kernel_dispatch._log_enabled
        ):
            # the hot path: native already chosen for this device and dtype, counted in place
            cell = self._native_cells.get((c.device, c.dtype))
            if cell is not None and (self._supports is None or self._supports(c) is None):
                cell[0] += 1
                out = self._native(c, *args)
                return out if self._result is None or not wrap else self._result(*out)
        reason = self._reason_for(backend, c)
        if kernel_dispatch.decide(self.name, backend, c.device, reason):
            if backend == "auto" and not kernel_dispatch._log_enabled:
                self._native_cells[c.device, c.dtype] = kernel_dispatch.native_counter(
                    self.name, c.device.type
                )
            out = self._native(c, *args)
        else:
            out = self._reference(*args)
        return out if self._result is None or not wrap else self._result(*out)

    def _wrap(self, out):
        return out if self._result is None else self._result(*out)

    def run(self, args: tuple, backend: str):
        """The forward implementation: check, choose, run (the custom op's body too)."""
        c = self._check(*args)
        reason = self._reason_for(backend, c)
        if kernel_dispatch.decide(self.name, backend, c.device, reason):
            return self._native(c, *args)
        return self._reference(*args)

    def _reason_for(self, backend: str, c: Checked) -> str | None:
        if backend == "reference":
            return None
        return self.native_reason(c) or self.unverified_reason(backend)

    def unverified_reason(self, backend: str) -> str | None:
        """Why `auto` does not run kernels not yet through the GPU validation (None otherwise).
        MUSPACE_TRY_UNVERIFIED=1 lets `auto` run them: the GPU sessions that verify them."""
        if backend == "auto" and self.d.unverified and os.environ.get(TRY_UNVERIFIED) != "1":
            return f"the native kernels are not fully verified yet ({self.d.unverified})"
        return None

    def native_reason(self, c: Checked) -> str | None:
        """None when the native path can take these inputs, else why not: the library on the
        device, the op's entry points, the dtype and bf16 (cached per loaded library, device,
        dtype: asked on every call), then the op's size limits (`supports`)."""
        if native._status is not self._reason_status:
            self.forget_native_reasons()
        key = (c.device, c.dtype, c.dtype_arg)
        reason = self._reason_cache.get(key, _UNKNOWN)
        if reason is _UNKNOWN:
            reason = native.unavailable_reason(c.device) or self._capability_reason(
                c.dtype, c.dtype_arg
            )
            if native._status is not self._reason_status:  # loaded just now
                self.forget_native_reasons()
            self._reason_cache[key] = reason
        if reason is not None or self._supports is None:
            return reason
        return self._supports(c)

    def forget_native_reasons(self) -> None:
        self._reason_cache.clear()
        self._native_cells.clear()
        self._reason_status = native._status

    def _supports_or_reason(self, c: Checked) -> str | None:
        try:
            return self.d.supports(c)
        except native.NativeUnavailable as exc:  # a library older than the op's limits
            return str(exc)

    def _capability_reason(self, dtype, dtype_arg: str) -> str | None:
        """The op's needs against the loaded library: its entry points, the dtype, bf16."""
        missing = tuple(e for e in self.d.entry_points if not native.has_function(e))
        if missing:
            return (
                f"the native library has no {', '.join(missing)} (it predates this operator: "
                "rebuild it with `python build_utils.py --inplace`)"
            )
        if dtype is not None and dtype not in self.d.native_dtypes:
            dtypes = ", ".join(_dtype_name(t) for t in self.d.native_dtypes)
            return f"{dtype_arg} dtype {_dtype_name(dtype)} has no native kernel ({dtypes})"
        if dtype == torch.bfloat16 and not native.build_facts().get("bf16", False):
            return "this native build has no bfloat16 kernels (MUSA arch < mp_22)"
        return None

    # ------------------------------------------------------------------ composite ops

    def _run_composite(self, args, backend):
        """Composite ops: the native path calls other ops (whose autograd gives the backward).
        Under torch.compile the choice is made once at trace time from the device and dtype and
        baked into the graph (dynamo does not trace the library loader); the parts are custom
        ops in the graph that check their own sizes when they run."""
        c = self._check(*args)
        if torch.compiler.is_compiling():
            dtype = _dtype_name(c.dtype) if c.dtype is not None else ""
            use = _traced_choice(self.name, backend, str(c.device), dtype, c.dtype_arg)
        else:
            reason = self._reason_for(backend, c)
            use = kernel_dispatch.decide(self.name, backend, c.device, reason)
        if use:
            return self._native(c, *args, backend=backend)
        return self._reference(*args)

    # ------------------------------------------------------------------ custom ops

    def _define_custom_ops(self):
        d = self.d
        qualname = f"mu_space::{d.name}"
        args = _args_part(d.schema)
        lib_schema = f"({args}, str backend) -> {_results(d.schema)}"
        self.custom_op = torch.library.custom_op(qualname, mutates_args=(), schema=lib_schema)(
            self._custom_op_body
        )
        self.custom_op.register_fake(self._fake)
        if d.backward is None:
            return
        back_schema = (
            f"(Tensor?[] grads, {args}, bool[] needs, bool deterministic, str backend) -> Tensor[]"
        )
        self.backward_op = torch.library.custom_op(
            f"mu_space::{self.backward_name}", mutates_args=(), schema=back_schema
        )(self._backward_body)
        self.backward_op.register_fake(self._backward_fake)
        self.custom_op.register_autograd(self._autograd_backward, setup_context=self._setup)

    def _custom_op_body(self, *args):
        out = self.run(args[:-1], args[-1])
        return tuple(out) if isinstance(out, tuple) else out

    def _fake(self, *args):
        args = args[:-1]
        if self.d.fake is not None:
            return self.d.fake(*args)
        c = self.d.check(*args)
        ref = next(a for a in args if isinstance(a, torch.Tensor))
        outs = tuple(ref.new_empty(shape, dtype=dtype) for shape, dtype in c.outputs)
        return outs[0] if len(outs) == 1 and "(" not in _results(self.d.schema) else outs

    def _setup(self, ctx, inputs, output):
        args, ctx.backend = inputs[:-1], inputs[-1]
        positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        ctx.save_for_backward(*(args[i] for i in positions))
        ctx.positions = positions
        ctx.others = tuple(None if isinstance(a, torch.Tensor) else a for a in args)

    def _autograd_backward(self, ctx, *grads):
        args = list(ctx.others)
        for i, t in zip(ctx.positions, ctx.saved_tensors):
            args[i] = t
        needs = [bool(ctx.needs_input_grad[i]) for i in self.grad_index]
        got = self.backward_op(
            list(grads), *args, needs, torch.are_deterministic_algorithms_enabled(), ctx.backend
        )
        result = [None] * (len(args) + 1)
        for k, i in enumerate(self.grad_index):
            if needs[k]:
                result[i] = got[k]
        return tuple(result)

    def run_backward(
        self, grads, args, needs, deterministic: bool, backend: str, checked: Checked | None = None
    ) -> list:
        """One gradient per differentiable input (None where not needed). `checked`: the
        forward's check of these same arguments (the eager autograd path), else checked here."""
        grad_out = grads[0] if len(grads) == 1 else grads
        c = self.d.check(*args) if checked is None else checked
        reason = self._reason_for(backend, c)
        use = kernel_dispatch.decide(self.backward_name, backend, c.device, reason)
        b = self.d.backward
        if use and b.native is not None:
            got = b.native(c, grad_out, *args, needs=tuple(needs), deterministic=deterministic)
        else:
            got = b.reference(grad_out, *args)
        return [g if need else None for g, need in zip(got, needs)]

    def _backward_body(self, grads, *rest):
        *args, needs, deterministic, backend = rest
        got = self.run_backward(grads, tuple(args), needs, deterministic, backend)
        ref = next(a for a in args if isinstance(a, torch.Tensor))
        # custom ops return no None: a gradient not asked for comes back as an empty tensor
        return [g if g is not None else ref.new_empty(0) for g in got]

    def _backward_fake(self, grads, *rest):
        *args, needs, _deterministic, _backend = rest
        ref = next(a for a in args if isinstance(a, torch.Tensor))
        out = []
        for k, i in enumerate(self.grad_index):
            x = args[i]
            want = needs[k] and x is not None
            out.append(
                torch.empty_like(x, memory_format=torch.contiguous_format)
                if want
                else ref.new_empty(0)
            )
        return out

    # ------------------------------------------------------------------ registration helpers

    def export(self, fn: Callable) -> Callable:
        """Decorator of the op's public function: the registry's `api`, exported by mu_space.ops
        (and by `mu_space` itself for public operators)."""
        self.d.api = fn
        return fn

    @property
    def api(self):
        return self.d.api

    def capture_schema_args(self, *args, **kwargs) -> tuple:
        """The schema arguments the public API passes for these public arguments (tests)."""
        global _capturing
        _capturing = True
        try:
            self.d.api(*args, **kwargs)
        except _Captured as cap:
            return cap.args_
        finally:
            _capturing = False
        raise AssertionError(f"{self.name}: the public API did not call the operator")

    def __getattr__(self, item):  # definition fields (family, upstream, ...) read through
        if item == "d":
            raise AttributeError(item)
        return getattr(self.d, item)


def _dispatcher_needed() -> bool:
    """Whether a call must go through the custom op although eager: torch.func transforms and
    dispatch modes (FakeTensorMode, make_fx, ...) act in the dispatcher."""
    return torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack() > 0


def _autograd_function(op: Operator) -> type:
    """The eager autograd path of a kernel op with a backward: a torch.autograd.Function whose
    forward and backward call the implementations directly. The custom op's autograd (what
    torch.compile and torch.ops callers get) costs ~2.7x its host time (docs/architecture.md):
    dispatcher round trips for the forward and the backward op, their autograd kernels and
    schema handling. Same choice, records, check (done once: the saved inputs cannot change
    without autograd's version check raising) and gradients as `register_autograd`'s."""
    parsed = torch._C.parse_schema(f"mu_space::_probe{op.d.schema}")
    saved = tuple(
        i for i, a in enumerate(parsed.arguments) if str(a.type) in ("Tensor", "Optional[Tensor]")
    )
    n_args = len(op.arg_names)
    grad_index = op.grad_index

    def forward(ctx, backend, *args):
        c = op._check(*args)
        out = op._eager(c, args, backend, wrap=False)
        ctx.save_for_backward(*(args[i] for i in saved))
        others = list(args)
        for i in saved:
            others[i] = None
        ctx.others, ctx.checked, ctx.backend = others, c, backend
        return tuple(out) if isinstance(out, tuple) else out

    def backward(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: the native backward is not differentiable
            return once(ctx, *grads)
        args = list(ctx.others)  # (a copy: ctx must not keep the saved tensors alive)
        for i, t in zip(saved, ctx.saved_tensors):
            args[i] = t
        needs = ctx.needs_input_grad
        needs = [bool(needs[i + 1]) for i in grad_index]
        got = op.run_backward(
            grads,
            tuple(args),
            needs,
            torch.are_deterministic_algorithms_enabled(),
            ctx.backend,
            ctx.checked,
        )
        result = [None] * (n_args + 1)
        for k, i in enumerate(grad_index):
            result[i + 1] = got[k]
        return tuple(result)

    once = torch.autograd.function.once_differentiable(backward)
    fn = type(
        f"{op.name}_autograd",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
    # Function.apply without its Python wrapper (argument binding for setup_context, which this
    # Function has none of; unwrapping dead torch.func wrappers): the C++ apply, ~1 us less
    fn.fast_apply = super(torch.autograd.Function, fn).apply
    return fn


def _traced_choice(op: str, backend: str, device: str, dtype: str, dtype_arg: str) -> bool:
    """A composite op's backend choice under torch.compile, made once at trace time."""
    dt = getattr(torch, dtype) if dtype else None
    operator = registry.get(op)

    return kernel_dispatch.use_native(
        op,
        backend,
        torch.device(device),
        lambda: operator._capability_reason(dt, dtype_arg) or operator.unverified_reason(backend),
    )


# What torch.compiler.assume_constant_result sets; written here because calling it imports
# torch._dynamo (~0.5 s at `import mu_space`).
_traced_choice._dynamo_marked_constant = True


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def forget_native_reasons() -> None:
    """Drop every op's cached native reasons (tests that stand in for the library call this)."""
    for op in registry.operators():
        op.forget_native_reasons()


def define(d: OpDef) -> Operator:
    """Generate the operator from its definition and register it."""
    op = Operator(d)
    registry.register(op)
    return op


_OUTPUT_FILL: list = []  # tests' poisoning hook: a fill value for every new output


def new_output(like: torch.Tensor, shape=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output that the native kernel writes in full (no fill of any kind), on like's device:
    like's shape and dtype unless given (then like must be contiguous). The contract tests poison
    these allocations (NaN / -1) to catch elements a kernel never writes."""
    if _OUTPUT_FILL or torch.are_deterministic_algorithms_enabled():
        with no_fill():
            t = _allocate(like, shape, dtype)
        return t.fill_(_OUTPUT_FILL[-1](t.dtype)) if _OUTPUT_FILL else t
    if shape is None and dtype is None:  # the common case, without a call
        return torch.empty_like(like)
    return _allocate(like, shape, dtype)


def _allocate(like, shape, dtype):
    if shape is not None:
        return like.new_empty(shape, dtype=dtype or like.dtype)
    # like is contiguous here (the native paths make their inputs contiguous first), so the
    # plain empty_like (the fastest to parse: ~0.3 us less per call) is contiguous too
    if dtype is not None:
        return torch.empty_like(like, dtype=dtype)
    return torch.empty_like(like)


@contextlib.contextmanager
def no_fill():
    """With deterministic algorithms on, PyTorch fills every new uninitialised tensor (NaN /
    max int) as a safety net; buffers a native kernel writes in full skip that fill."""
    det = getattr(torch.utils, "deterministic", None)
    if (
        det is None
        or not torch.are_deterministic_algorithms_enabled()
        or not det.fill_uninitialized_memory
    ):
        yield
        return
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        det.fill_uninitialized_memory = True


@contextlib.contextmanager
def poisoned_outputs():
    """Within the block, `new_output` fills with NaN (floating) or -1 (integer)."""
    _OUTPUT_FILL.append(lambda dtype: float("nan") if dtype.is_floating_point else -1)
    try:
        yield
    finally:
        _OUTPUT_FILL.pop()
