"""Public operators. Importing this package imports every operator module (`mu_space/ops/*.py`
whose name does not start with `_`), which registers its definition; the operators' public
functions are exported here from the registry (no hand-kept list)."""

import importlib as _importlib
import pkgutil as _pkgutil

from mu_space.runtime import registry as _registry

for _module in sorted(
    m.name for m in _pkgutil.iter_modules(__path__) if not m.name.startswith("_")
):
    _importlib.import_module(f"{__name__}.{_module}")

__all__ = sorted(op.api.__name__ for op in _registry.operators())
for _op in _registry.operators():
    globals()[_op.api.__name__] = _op.api
