"""Run-time patching of upstream model code (mmcv, mmdet3d, BEVDet, BEVFusion) with muSPACE ops.

A `Patch` is data: the dotted path of the upstream object, a function that builds the
replacement from the original, optional aliases (the same object re-exported elsewhere) and an
optional precheck. A `Patcher` applies patches, restores the originals, works as a context
manager and reports what was applied or skipped, and why. Patching an upstream that is not
installed is a clean skip, never an ImportError.

Besides the listed aliases, `apply()` also rebinds module globals that already hold the original
object (`from mmdet3d.ops import bev_pool_v2` executed before patching), so the order of imports
does not matter.
"""

from __future__ import annotations

import fnmatch
import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable


def _check_dotted(what: str, path: Any) -> None:
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a dotted path string, got {type(path).__name__}")
    if len(path.split(".")) < 2 or not all(part.isidentifier() for part in path.split(".")):
        raise ValueError(f"{what} must be a dotted path 'package.module.attribute', got {path!r}")


@dataclass
class Patch:
    """One upstream object to replace. The arguments are checked here, so a mistake is an error
    when the patch is written, not a skip reason at `apply()`."""

    name: str
    target: str  # dotted path: "package.module.Attribute" or "package.module.Class.method"
    make_replacement: Callable[[Any], Any]  # original -> replacement
    aliases: tuple[str, ...] = ()
    precheck: Callable[[Any], str | None] | None = None  # original -> reason to skip, or None
    enabled: bool = True
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Patch name must be a non-empty string, got {self.name!r}")
        _check_dotted(f"Patch {self.name!r}: target", self.target)
        if not callable(self.make_replacement):
            raise TypeError(
                f"Patch {self.name!r}: make_replacement must be callable (original -> "
                f"replacement), got {type(self.make_replacement).__name__}"
            )
        if isinstance(self.aliases, str):  # a bare string would be iterated letter by letter
            raise TypeError(
                f"Patch {self.name!r}: aliases must be a tuple of dotted paths, got the string "
                f"{self.aliases!r} (write aliases=({self.aliases!r},))"
            )
        self.aliases = tuple(self.aliases)
        for alias in self.aliases:
            _check_dotted(f"Patch {self.name!r}: alias", alias)
        if self.precheck is not None and not callable(self.precheck):
            raise TypeError(
                f"Patch {self.name!r}: precheck must be callable or None, "
                f"got {type(self.precheck).__name__}"
            )
        if not isinstance(self.enabled, bool):
            raise TypeError(f"Patch {self.name!r}: enabled must be True or False")
        if not isinstance(self.description, str):
            raise TypeError(f"Patch {self.name!r}: description must be a string")


@dataclass
class PatchResult:
    name: str
    status: str  # "applied" | "skipped" | "disabled"
    reason: str = ""
    targets: list[str] = field(default_factory=list)


class PatchTargetMissing(LookupError):
    pass


def resolve(path: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, current value) for a dotted path; imports the longest module
    prefix. Raises PatchTargetMissing with the reason when the module or attribute is absent."""
    parts = path.split(".")
    owner, error = None, None
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            owner = importlib.import_module(module_name)
        except ImportError as exc:
            error = error or exc
            continue
        except Exception as exc:  # noqa: BLE001 - a broken upstream install is a skip, not a crash
            raise PatchTargetMissing(
                f"importing {module_name} failed: {type(exc).__name__}: {exc}"
            ) from exc
        for attr in parts[split:-1]:
            if not hasattr(owner, attr):
                raise PatchTargetMissing(
                    f"{module_name} has no attribute path {'.'.join(parts[split:])}"
                )
            owner = getattr(owner, attr)
        break
    if owner is None:
        raise PatchTargetMissing(f"module for {path} not importable: {error}")
    if not hasattr(owner, parts[-1]):
        raise PatchTargetMissing(f"{path} does not exist (attribute {parts[-1]!r} missing)")
    return owner, parts[-1], getattr(owner, parts[-1])


class Patcher:
    def __init__(self, patches=(), *, rebind_loaded_modules: bool = True):
        if isinstance(patches, Patch):
            raise TypeError(
                "patches must be an iterable of Patch objects: wrap the Patch in a list"
            )
        if not isinstance(rebind_loaded_modules, bool):
            raise TypeError(
                f"rebind_loaded_modules must be True or False, got {rebind_loaded_modules!r}"
            )
        self._patches: dict[str, Patch] = {}
        self._saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) in apply order
        self._results: list[PatchResult] = []
        self.rebind_loaded_modules = rebind_loaded_modules
        for patch in patches:
            self.add(patch)

    # ------------------------------------------------------------------ configuration
    def _check_not_applied(self, action: str) -> None:
        # The patch set is read by apply(); a change now would silently do nothing until then.
        if self._saved:
            raise RuntimeError(f"cannot {action} while the patches are applied; restore() first")

    def add(self, patch: Patch) -> Patcher:
        if not isinstance(patch, Patch):
            raise TypeError(f"add() takes a Patch, got {type(patch).__name__}")
        self._check_not_applied("add a patch")
        if patch.name in self._patches:
            raise ValueError(f"a patch named {patch.name!r} is already registered")
        self._patches[patch.name] = patch
        return self

    def _named(self, name: str) -> list[Patch]:
        """The patch `name`, or every patch a `*` pattern matches ("bevfusion.factored_lss.*")."""
        if "*" in name:
            found = [p for n, p in self._patches.items() if fnmatch.fnmatchcase(n, name)]
        else:
            found = [self._patches[name]] if name in self._patches else []
        if not found:
            raise KeyError(f"no patch named {name!r}; known: {sorted(self._patches)}")
        return found

    def disable(self, name: str) -> Patcher:
        """Leave out the patch `name` (or all that a `*` pattern matches) at apply()."""
        patches = self._named(name)
        self._check_not_applied(f"disable {name!r}")
        for patch in patches:
            patch.enabled = False
        return self

    def enable(self, name: str) -> Patcher:
        """Apply the patch `name` (or all that a `*` pattern matches), e.g. an off-by-default one."""
        patches = self._named(name)
        self._check_not_applied(f"enable {name!r}")
        for patch in patches:
            patch.enabled = True
        return self

    @property
    def patches(self) -> list[Patch]:
        return list(self._patches.values())

    @property
    def applied(self) -> bool:
        return bool(self._saved)

    # ------------------------------------------------------------------ apply / restore
    def apply(self) -> list[PatchResult]:
        if self._saved:
            raise RuntimeError("patches already applied; restore() first")
        self._results = [self._apply_one(p) for p in self._patches.values()]
        return list(self._results)

    def _set(self, owner: Any, attr: str, value: Any, original: Any) -> None:
        if isinstance(owner, type):  # keep staticmethod/classmethod wrappers for restore()
            original = owner.__dict__.get(attr, original)
        self._saved.append((owner, attr, original))
        setattr(owner, attr, value)

    def _apply_one(self, patch: Patch) -> PatchResult:
        if not patch.enabled:
            return PatchResult(patch.name, "disabled", "disabled (by default or by disable())")
        try:
            owner, attr, original = resolve(patch.target)
        except PatchTargetMissing as exc:
            return PatchResult(patch.name, "skipped", str(exc))
        if patch.precheck is not None:
            reason = patch.precheck(original)
            if reason:
                return PatchResult(patch.name, "skipped", f"precheck failed: {reason}")
        replacement = patch.make_replacement(original)
        targets = [patch.target]
        self._set(owner, attr, replacement, original)
        for alias in patch.aliases:
            try:
                a_owner, a_attr, current = resolve(alias)
            except PatchTargetMissing:
                continue  # an alias of an optional submodule may be absent
            if current is original:
                self._set(a_owner, a_attr, replacement, original)
                targets.append(alias)
        if self.rebind_loaded_modules:
            targets += self._rebind_module_globals(original, replacement)
        return PatchResult(patch.name, "applied", "", targets)

    def _rebind_module_globals(self, original: Any, replacement: Any) -> list[str]:
        rebound = []
        for module_name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict) or module_name.startswith("mu_space"):
                continue
            for attr, value in list(namespace.items()):
                if value is original:
                    self._set(module, attr, replacement, original)
                    rebound.append(f"{module_name}.{attr}")
        return rebound

    def restore(self) -> None:
        """Put every original back (in reverse order of patching)."""
        while self._saved:
            owner, attr, original = self._saved.pop()
            setattr(owner, attr, original)

    def __enter__(self) -> Patcher:
        self.apply()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    # ------------------------------------------------------------------ reporting
    def results(self) -> list[PatchResult]:
        return list(self._results)

    def report(self) -> str:
        if not self._results:
            return "patcher: nothing applied yet"
        width = max(len(r.name) for r in self._results)
        lines = ["patcher report:"]
        for r in self._results:
            detail = ", ".join(r.targets) if r.status == "applied" else r.reason
            lines.append(f"  {r.name.ljust(width)}  {r.status:8s} {detail}")
        return "\n".join(lines)
