"""Patcher mechanics on stand-in upstream modules created by the tests."""

import re
import sys
import types

import pytest

from mu_space.patcher import Patch, Patcher, resolve
from mu_space.patcher.core import PatchTargetMissing


@pytest.fixture
def upstream(monkeypatch):
    """A fake `fakeup` package: fakeup.ops.pool (defines pool), re-exported as fakeup.ops.pool_fn,
    imported by value into fakeup.models.neck, and a class with a static method."""
    pkg, ops, pool_mod, models, neck = (
        types.ModuleType(n)
        for n in ("fakeup", "fakeup.ops", "fakeup.ops.pool", "fakeup.models", "fakeup.models.neck")
    )

    def pool(x, scale=1):
        return ("upstream", x * scale)

    class Transformer:
        @staticmethod
        def prepare(x):
            return ("upstream-prepare", x)

    pool_mod.pool = pool
    ops.pool = pool_mod
    ops.pool_fn = pool
    neck.pool_fn = pool  # `from fakeup.ops import pool_fn` executed before patching
    neck.Transformer = Transformer
    pkg.ops, pkg.models, models.neck = ops, models, neck
    for m in (pkg, ops, pool_mod, models, neck):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    return types.SimpleNamespace(
        pool=pool, neck=neck, ops=ops, pool_mod=pool_mod, Transformer=Transformer
    )


def ours(original):
    def pool(x, scale=1):
        return ("mu_space", x * scale)

    pool.__wrapped_original__ = original
    return pool


def test_resolve_imports_the_longest_module_prefix(upstream):
    owner, attr, value = resolve("fakeup.models.neck.Transformer.prepare")
    assert owner is upstream.Transformer and attr == "prepare"
    with pytest.raises(PatchTargetMissing, match="not importable"):
        resolve("not_installed_pkg.ops.thing")
    with pytest.raises(PatchTargetMissing, match="missing"):
        resolve("fakeup.ops.pool.nope")


def test_apply_restore_with_aliases_and_rebinding(upstream):
    patcher = Patcher(
        [Patch("pool", "fakeup.ops.pool.pool", ours, aliases=("fakeup.ops.pool_fn",))]
    )
    (result,) = patcher.apply()
    assert result.status == "applied"
    assert set(result.targets) == {
        "fakeup.ops.pool.pool",
        "fakeup.ops.pool_fn",
        "fakeup.models.neck.pool_fn",
    }
    assert upstream.pool_mod.pool(2)[0] == "mu_space"
    assert upstream.ops.pool_fn(2) == ("mu_space", 2)
    assert upstream.neck.pool_fn(3, scale=2) == ("mu_space", 6)  # bound before patching
    patcher.restore()
    assert upstream.pool_mod.pool is upstream.pool and upstream.ops.pool_fn is upstream.pool
    assert upstream.neck.pool_fn is upstream.pool


def test_context_manager_restores_on_error(upstream):
    with pytest.raises(RuntimeError, match="boom"):
        with Patcher([Patch("pool", "fakeup.ops.pool.pool", ours)]):
            assert upstream.pool_mod.pool(1)[0] == "mu_space"
            raise RuntimeError("boom")
    assert upstream.pool_mod.pool is upstream.pool


def test_absent_upstream_is_a_clean_skip(upstream):
    patcher = Patcher(
        [
            Patch("missing-module", "not_installed_pkg.ops.thing", ours),
            Patch("missing-attr", "fakeup.ops.pool.gone", ours),
        ]
    )
    results = {r.name: r for r in patcher.apply()}
    assert results["missing-module"].status == "skipped"
    assert "not importable" in results["missing-module"].reason
    assert results["missing-attr"].status == "skipped" and "gone" in results["missing-attr"].reason
    assert "skipped" in patcher.report()


def test_precheck_failure_skips_with_reason(upstream):
    def needs_three_args(fn):
        return (
            None
            if fn.__code__.co_argcount == 3
            else f"expected 3 arguments, got {fn.__code__.co_argcount}"
        )

    patcher = Patcher([Patch("pool", "fakeup.ops.pool.pool", ours, precheck=needs_three_args)])
    (result,) = patcher.apply()
    assert result.status == "skipped" and "expected 3 arguments, got 2" in result.reason
    assert upstream.pool_mod.pool is upstream.pool


def test_disable_enable_and_add(upstream):
    patcher = Patcher().add(Patch("pool", "fakeup.ops.pool.pool", ours))
    patcher.disable("pool")
    assert patcher.apply()[0].status == "disabled"
    assert upstream.pool_mod.pool is upstream.pool
    patcher.restore()
    patcher.enable("pool")
    assert patcher.apply()[0].status == "applied"
    patcher.restore()
    with pytest.raises(KeyError, match="no patch named"):
        patcher.disable("nope")
    with pytest.raises(ValueError, match="already registered"):
        patcher.add(Patch("pool", "x.y", ours))


def test_static_method_patch_restores_the_descriptor(upstream):
    patcher = Patcher(
        [
            Patch(
                "prepare",
                "fakeup.models.neck.Transformer.prepare",
                lambda orig: staticmethod(lambda x: ("mu_space-prepare", x)),
            )
        ]
    )
    patcher.apply()
    assert upstream.Transformer().prepare(1) == ("mu_space-prepare", 1)
    patcher.restore()
    assert upstream.Transformer().prepare(1) == ("upstream-prepare", 1)
    assert isinstance(upstream.Transformer.__dict__["prepare"], staticmethod)


def test_double_apply_is_an_error(upstream):
    patcher = Patcher([Patch("pool", "fakeup.ops.pool.pool", ours)])
    patcher.apply()
    with pytest.raises(RuntimeError, match="already applied"):
        patcher.apply()
    patcher.restore()


def test_upstream_that_fails_to_import_is_a_skip(monkeypatch, tmp_path):
    (tmp_path / "brokenup.py").write_text("raise RuntimeError('needs a CUDA build')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (result,) = Patcher([Patch("broken", "brokenup.thing", ours)]).apply()
    assert result.status == "skipped" and "needs a CUDA build" in result.reason


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        ({"name": ""}, ValueError, "name must be a non-empty string"),
        ({"target": "pool"}, ValueError, "target must be a dotted path"),
        ({"target": "fakeup..pool"}, ValueError, "target must be a dotted path"),
        ({"target": None}, TypeError, "target must be a dotted path string"),
        ({"make_replacement": "ours"}, TypeError, "make_replacement must be callable"),
        ({"aliases": "fakeup.ops.pool_fn"}, TypeError, "aliases=('fakeup.ops.pool_fn',)"),
        ({"aliases": ("pool_fn",)}, ValueError, "alias must be a dotted path"),
        ({"precheck": True}, TypeError, "precheck must be callable or None"),
        ({"enabled": "no"}, TypeError, "enabled must be True or False"),
    ],
)
def test_patch_arguments_are_checked_when_built(kwargs, error, needle):
    args = {"name": "pool", "target": "fakeup.ops.pool.pool", "make_replacement": ours, **kwargs}
    with pytest.raises(error, match=re.escape(needle)):
        Patch(**args)


def test_patch_aliases_list_becomes_a_tuple():
    assert Patch("pool", "a.b", ours, aliases=["a.c"]).aliases == ("a.c",)


def test_patcher_arguments_are_checked_when_built():
    patch = Patch("pool", "fakeup.ops.pool.pool", ours)
    with pytest.raises(TypeError, match="wrap the Patch in a list"):
        Patcher(patch)
    with pytest.raises(TypeError, match="add\\(\\) takes a Patch, got str"):
        Patcher(["fakeup.ops.pool.pool"])
    with pytest.raises(TypeError, match="rebind_loaded_modules must be True or False"):
        Patcher([patch], rebind_loaded_modules="yes")


def test_changes_while_applied_are_errors(upstream):
    patcher = Patcher([Patch("pool", "fakeup.ops.pool.pool", ours)])
    with patcher:
        for change in (
            lambda: patcher.disable("pool"),
            lambda: patcher.enable("pool"),
            lambda: patcher.add(Patch("other", "fakeup.ops.pool_fn", ours)),
        ):
            with pytest.raises(RuntimeError, match="restore\\(\\) first"):
                change()
        with pytest.raises(KeyError, match="no patch named"):  # an unknown name stays a KeyError
            patcher.disable("nope")
    patcher.disable("pool")  # fine once restored
