"""The one way the compat surrogates (`mmcv._ext`, BEVFusion's extensions) make a stand-in for a
compiled extension function: pybind11's argument binding, a call count, the backend."""

from __future__ import annotations

import inspect
from typing import Any, Callable


def surrogate_function(
    name: str,
    params: tuple[str, ...],
    impl: Callable[..., Any],
    state: Any,
    *,
    module: str,
    counted_as: str,
    shown_as: str | None = None,
    positional_only: bool = False,
    what: str = "",
) -> Callable[..., Any]:
    """`module.name(*params)`: the arguments bound as the binding declares them (by keyword too
    unless `positional_only`: bindings without py::arg), the call counted in
    `state.calls[counted_as]`, then `impl(state.backend, *args)`; binding errors name the function
    as `shown_as` (default `counted_as`)."""
    kind = (
        inspect.Parameter.POSITIONAL_ONLY
        if positional_only
        else (inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )
    signature = inspect.Signature([inspect.Parameter(p, kind) for p in params])
    calls, n_params = state.calls, len(params)
    shown_as = shown_as or counted_as

    def function(*args, **kwargs):
        if kwargs or len(args) != n_params:
            try:
                args = signature.bind(*args, **kwargs).args
            except TypeError as exc:
                raise TypeError(f"{shown_as}(): {exc}") from None
        calls[counted_as] += 1
        return impl(state.backend, *args)

    function.__name__ = function.__qualname__ = name
    function.__module__ = module
    function.__signature__ = signature
    function.__doc__ = (
        f"{name}({', '.join(params)})\n\nmuSPACE surrogate of {module}.{name}. {what}"
    )
    return function
