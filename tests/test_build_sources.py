"""EXTENSION_SOURCES is the one list of native sources, computed from the tree: every .mu
under csrc/ is in it or explicitly excluded (with a reason), and every listed file exists."""

from pathlib import Path

import build_utils

ROOT = Path(build_utils.__file__).resolve().parent


def test_every_mu_source_is_listed_or_excluded():
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*.mu")}
    accounted = set(build_utils.EXTENSION_SOURCES) | set(build_utils.EXCLUDED_SOURCES)
    missing = sorted(on_disk - accounted)
    assert not missing, f".mu files neither in EXTENSION_SOURCES nor EXCLUDED_SOURCES: {missing}"


def test_listed_sources_exist_and_are_unique():
    listed = build_utils.EXTENSION_SOURCES
    assert len(listed) == len(set(listed)), "duplicate entries in EXTENSION_SOURCES"
    absent = [s for s in listed if not (ROOT / s).is_file()]
    assert not absent, f"EXTENSION_SOURCES names missing files: {absent}"
    assert not set(listed) & set(build_utils.EXCLUDED_SOURCES), "listed and excluded at once"


def test_excluded_sources_give_a_reason():
    for path, reason in build_utils.EXCLUDED_SOURCES.items():
        assert reason.strip(), f"{path} is excluded without a reason"


def test_sources_come_from_the_tree_with_the_smoke_first():
    on_disk = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "csrc").rglob("*.mu")
        if p.relative_to(ROOT).as_posix() not in build_utils.EXCLUDED_SOURCES
    )
    listed = build_utils.EXTENSION_SOURCES
    assert listed[0] == build_utils.SMOKE_SOURCE == "csrc/ffi/muspace_ops.mu"
    assert sorted(listed) == on_disk and listed[1:] == sorted(listed[1:])
