"""Backend resolution, strict mode, dispatch records and the native loader's reasons."""

import pytest
import torch

import mu_space
from mu_space.runtime import kernel_dispatch, native
from mu_space.runtime.kernel_dispatch import DispatchError

CPU = torch.device("cpu")


def test_reference_backend_is_always_recorded_as_requested():
    assert kernel_dispatch.use_native("op_a", "reference", CPU) is False
    assert kernel_dispatch.records() == [
        {"op": "op_a", "backend": "reference", "reason": "requested", "calls": 1}
    ]


def test_auto_on_cpu_falls_back_with_the_reason():
    assert kernel_dispatch.use_native("op_a", "auto", CPU) is False
    (row,) = kernel_dispatch.records()
    assert row["backend"] == "reference" and row["reason"] == native.unavailable_reason(CPU)
    assert row["reason"]  # a reason is always given


def test_unsupported_inputs_fall_back_with_their_reason(monkeypatch):
    monkeypatch.setattr(native, "unavailable_reason", lambda device: None)
    assert kernel_dispatch.use_native("op_a", "auto", CPU, "x dtype int8 unsupported") is False
    assert kernel_dispatch.use_native("op_a", "auto", CPU) is True
    reasons = {r["reason"]: r["backend"] for r in kernel_dispatch.records()}
    assert reasons == {"x dtype int8 unsupported": "reference", "native": "cpu"}


def test_counts_accumulate_and_reset():
    for _ in range(3):
        kernel_dispatch.use_native("op_b", "reference", CPU)
    assert kernel_dispatch.records()[0]["calls"] == 3
    kernel_dispatch.reset()
    assert kernel_dispatch.records() == []
    assert "no operator calls" in kernel_dispatch.report()


def test_report_is_a_table_with_every_record():
    kernel_dispatch.use_native("op_b", "reference", CPU)
    kernel_dispatch.use_native("op_c", "auto", CPU)
    text = kernel_dispatch.report()
    assert "op_b" in text and "op_c" in text and "requested" in text
    assert text.splitlines()[1].startswith("op")


@pytest.mark.parametrize("backend", ["native", "cuda", "musa"])
def test_explicit_native_backends_never_fall_back(backend):
    with pytest.raises(DispatchError, match=backend):
        kernel_dispatch.use_native("op_a", backend, CPU)
    assert kernel_dispatch.records() == []


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        kernel_dispatch.use_native("op_a", "triton", CPU)


def test_strict_mode_turns_fallback_into_error():
    kernel_dispatch.set_strict(True)
    with pytest.raises(DispatchError, match="strict"):
        kernel_dispatch.use_native("op_a", "auto", CPU)
    assert kernel_dispatch.use_native("op_a", "reference", CPU) is False  # explicit is allowed


def test_logging(caplog):
    kernel_dispatch.set_logging(True)
    try:
        with caplog.at_level("INFO", logger="mu_space.dispatch"):
            kernel_dispatch.use_native("op_log", "reference", CPU)
    finally:
        kernel_dispatch.set_logging(False)
    assert "op_log -> reference (requested)" in caplog.text


def test_public_op_records_dispatch():
    mu_space.ops.add_one(torch.zeros(4))
    (row,) = kernel_dispatch.records()
    assert row["op"] == "add_one" and row["backend"] == "reference"


@pytest.fixture
def library_at(monkeypatch):
    def point(path):
        monkeypatch.setenv("MUSPACE_LIBRARY", str(path))
        native.reset()

    yield point
    monkeypatch.delenv("MUSPACE_LIBRARY", raising=False)
    native.reset()


def test_missing_library_says_not_built(library_at, tmp_path):
    library_at(tmp_path / "libmuspace_native.so")
    st = native.status()
    assert not st.built and not st.loaded and "not built" in st.reason
    assert "not built" in native.unavailable_reason(CPU)
    with pytest.raises(native.NativeUnavailable, match="not built"):
        native.function("add_one_forward")


def test_broken_library_reports_the_loader_error(library_at, tmp_path):
    lib = tmp_path / "libmuspace_native.so"
    lib.write_bytes(b"not an ELF file")
    library_at(lib)
    st = native.status()
    assert st.built and not st.loaded and "failed to load" in st.reason


def test_arch_mismatch_is_explained(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    reason = native._arch_reason("cuda", ["90a"], torch.device("cuda", 0))
    assert "sm_90a" in reason and "sm_80" in reason and "CUDA_ARCH=80" in reason
    assert native._arch_reason("cuda", ["80", "90a"], torch.device("cuda", 0)) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (10, 0))
    assert native._arch_reason("cuda", ["80", "90a"], torch.device("cuda", 0)) is None  # PTX JIT


def test_library_for_other_backend_is_explained(monkeypatch):
    st = native.NativeStatus(built=True, loaded=True, backend="musa", archs=["31"])
    monkeypatch.setattr(native, "status", lambda: st)
    assert (
        native._compute_reason(torch.device("cuda", 0))
        == "native library built for musa, tensors are on cuda"
    )


def test_native_calls_on_the_hot_path_are_counted(monkeypatch):
    """After the first native decision for a (device, dtype), an op counts its native calls in
    place; records() and reset() see those counts like any other."""
    from mu_space.ops import _opdef

    op = mu_space.runtime.registry.get("add_one")
    monkeypatch.setattr(native, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(native, "has_function", lambda name: True)
    monkeypatch.setattr(op, "_native", lambda c, x: x + 1)
    _opdef.forget_native_reasons()
    for _ in range(3):
        mu_space.ops.add_one(torch.zeros(2))
    assert op._native_cells, "the hot path was not taken"
    assert kernel_dispatch.records() == [
        {"op": "add_one", "backend": "cpu", "reason": "native", "calls": 3}
    ]
    kernel_dispatch.reset()
    assert kernel_dispatch.records() == []
    mu_space.ops.add_one(torch.zeros(2))
    assert kernel_dispatch.records()[0]["calls"] == 1
    kernel_dispatch.set_strict(True)  # strict changes nothing for a native call
    mu_space.ops.add_one(torch.zeros(2))
    assert kernel_dispatch.records()[0]["calls"] == 2


def test_logging_turned_on_later_logs_hot_path_calls_too(monkeypatch, caplog):
    from mu_space.ops import _opdef

    op = mu_space.runtime.registry.get("add_one")
    monkeypatch.setattr(native, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(native, "has_function", lambda name: True)
    monkeypatch.setattr(op, "_native", lambda c, x: x + 1)
    _opdef.forget_native_reasons()
    mu_space.ops.add_one(torch.zeros(2))
    kernel_dispatch.set_logging(True)
    try:
        with caplog.at_level("INFO", logger="mu_space.dispatch"):
            mu_space.ops.add_one(torch.zeros(2))
    finally:
        kernel_dispatch.set_logging(False)
    assert "add_one -> cpu (native)" in caplog.text


def test_unverified_native_kernels_run_only_when_asked_for(monkeypatch):
    """An op whose kernels have not run on a GPU yet: auto takes the reference with that reason;
    an explicit native backend runs the kernels (how they get verified)."""
    from mu_space.ops import _opdef

    op = mu_space.runtime.registry.get("add_one")
    monkeypatch.setattr(native, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(native, "has_function", lambda name: True)
    monkeypatch.setattr(op, "_native", lambda c, x: x + 2)
    monkeypatch.setattr(op.d, "unverified", "issue 99")
    _opdef.forget_native_reasons()
    assert mu_space.ops.add_one(torch.zeros(1)).item() == 1.0  # the reference
    (row,) = kernel_dispatch.records()
    assert row["reason"] == "the native kernels are not fully verified yet (issue 99)"
    assert mu_space.ops.add_one(torch.zeros(1), backend="native").item() == 2.0
    # MUSPACE_TRY_UNVERIFIED=1 (the verifying GPU sessions) lets auto run them too
    monkeypatch.setenv(_opdef.TRY_UNVERIFIED, "1")
    _opdef.forget_native_reasons()
    assert mu_space.ops.add_one(torch.zeros(1)).item() == 2.0
