"""The host emulation itself (docs/host_emulation.md): the launch rewrite of
scripts/build_host_emulation.py, and, on a library built with the probe kernels
(tests/emulation/probe_kernels.mu), the warp collectives against their definitions, the 16-bit
conversions against PyTorch's, the shuffled order and the launch failures. For 32- and 128-lane
warps. The operators under the emulation are tested by the GPU tests themselves (`-m gpu` with
MUSPACE_LIBRARY set; .ci/run runs them)."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "build_host_emulation", ROOT / "scripts" / "build_host_emulation.py"
)
emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emu)


# ---------------------------------------------------------------- the launch rewrite (Python)


def test_rewrite_plain_launch_with_defaults():
    got = emu.rewrite_launches("  k<<<g, 256>>>(a, b);\n")
    assert got == (
        '  ::muspace_emu::launch("k", g, 256, 0, nullptr, [&](auto&... args) { k(args...); }, a, b);\n'
    )


def test_rewrite_template_kernel_nested_arguments_and_multiline():
    src = (
        "ns::kern<T, Vec<int, 4>, (K > 2)> <<<grid_for(n, kBlock, dev, 8),\n"
        "    kBlock, bytes, as_stream(st)>>>(data_of<const T>(x),\n    f(a, b), n);"
    )
    got = emu.rewrite_launches(src)
    assert got.startswith(
        '::muspace_emu::launch("ns::kern<T, Vec<int, 4>, (K > 2)>", grid_for(n, kBlock, dev, 8), '
        "kBlock, bytes, as_stream(st), [&](auto&... args) { ns::kern<T, Vec<int, 4>, (K > 2)>(args...); }"
    )
    assert got.endswith(", data_of<const T>(x),\n    f(a, b), n);")


def test_rewrite_launch_without_arguments_and_several_launches():
    got = emu.rewrite_launches("a<<<1, 2, 0, s>>>(); b<<<3, 4>>>(x);")
    assert got.count("::muspace_emu::launch(") == 2
    assert '"a", 1, 2, 0, s, [&](auto&... args) { a(args...); })' in got
    assert '"b", 3, 4, 0, nullptr, [&](auto&... args) { b(args...); }, x)' in got


def test_rewrite_dynamic_shared_memory():
    got = emu.rewrite_launches("  extern __shared__ float4 s_dynamic[];\n")
    assert got == (
        "  float4* s_dynamic = static_cast<float4*>(::muspace_emu::dynamic_shared_memory());\n"
    )


def test_rewrite_rejects_a_malformed_launch():
    with pytest.raises(ValueError, match="configuration"):
        emu.rewrite_launches("k<<<1>>>(x);")


def test_every_native_source_rewrites():
    """Every launch in csrc/ has a form the rewrite understands (the build compiles them)."""
    for path in sorted((ROOT / "csrc").rglob("*.mu*")):
        text = path.read_text()
        rewritten = emu.rewrite_launches(text)
        assert "<<<" not in rewritten, path
        assert rewritten.count("::muspace_emu::launch(") == text.count("<<<"), path


# ---------------------------------------------------------------- the probe kernels


def _can_build() -> str | None:
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no host C++ compiler"
    if importlib.util.find_spec("tvm_ffi") is None:
        return "apache-tvm-ffi is not installed"
    return None


@pytest.fixture(scope="module", params=[32, 128], ids=["warp32", "warp128"])
def probe(request):
    reason = _can_build()
    if reason:
        pytest.skip(reason)
    import tvm_ffi

    warp = request.param
    out = ROOT / "build" / "host_emulation" / f"probe-w{warp}"
    lib = emu.build(out, warp, [*emu.core_sources(), emu.PROBE_SOURCE], jobs=os.cpu_count() or 1)
    module = tvm_ffi.load_module(str(lib))
    assert int(module["build_warp_size"]()) == warp
    assert str(module["build_backend"]()) == "host-emulation"
    return module, warp, lib


def _expected_warp_op(values: np.ndarray, op: int, width: int, warp: int) -> np.ndarray:
    out = np.empty_like(values)
    for t in range(values.size):
        lane, base = t % warp, t - t % warp
        seg = lane - lane % width
        if op == 0:
            src = seg + (lane + 3) % width
        elif op == 1:
            src = lane ^ 5 if (lane ^ 5) // width == lane // width else lane
        elif op == 2:
            src = lane - 2 if lane % width >= 2 else lane
        if op <= 2:
            out[t] = values[base + src]
        else:
            group = values[base : base + warp] > 0
            out[t] = int(group.any()) if op == 3 else int(group.all())
    return out


@pytest.mark.parametrize("op", range(5), ids=["shfl", "shfl_xor", "shfl_up", "any", "all"])
@pytest.mark.parametrize("width_div", [1, 4], ids=["full", "quarter"])
def test_warp_collectives_follow_their_definitions(probe, op, width_div):
    module, warp, _ = probe
    width = warp // width_div
    values = torch.randint(-3, 100, (2 * warp,), dtype=torch.int32)
    if op == 4:
        values[warp:] = values[warp:].abs() + 1  # one warp all positive, one mixed
    out = torch.full_like(values, -7)
    module["emulation_warp_probe"](values, out, op, width)
    want = _expected_warp_op(values.numpy(), op, width, warp)
    np.testing.assert_array_equal(out.numpy(), want)


def _same_bits_or_both_nan(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    got_f = got.to(torch.int16).view(dtype).float()
    want_f = want.float()
    both_nan = torch.isnan(got_f) & torch.isnan(want_f)
    bad = ~both_nan & (got.to(torch.int16) != want.view(torch.int16))
    assert not bad.any(), f"{int(bad.sum())} values differ, first at {bad.nonzero()[:5].flatten()}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_conversions_match_pytorch(probe, dtype):
    """Every 16-bit pattern widened; floats narrowed with round-to-nearest-even: halfway cases,
    subnormals, the overflow edge, infinities and NaN, plus random floats of every magnitude."""
    module, _, _ = probe
    n = 1 << 16
    g = torch.Generator().manual_seed(3)
    mantissa = torch.rand(n, generator=g) + 1.0
    exponent = torch.randint(-40, 20, (n,), generator=g).float()
    f = mantissa * torch.pow(2.0, exponent) * torch.where(torch.rand(n, generator=g) < 0.5, -1, 1)
    tiny = torch.finfo(torch.float16).tiny
    special = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.0, 65520.0, 1e10]
        + [tiny, tiny / 2, tiny / 1024, tiny / 2048, tiny / 2048 * 1.01, 1.0 + 2**-11]
        + [1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38, 1e-45]
    )
    f[: special.numel()] = special
    # exact halfway cases of both formats
    f[100:200] = 1.0 + (2 * torch.arange(100) + 1).float() * 2**-11
    f[200:300] = 1.0 + (2 * torch.arange(100) + 1).float() * 2**-8
    widened = torch.full((n,), -1.0)
    narrowed = torch.full((n,), -1, dtype=torch.int32)
    module["emulation_convert_probe"](f, widened, narrowed, int(dtype == torch.bfloat16))
    bits = torch.arange(n, dtype=torch.int32).to(torch.int16)
    want_wide = bits.view(dtype).float()
    same = (widened == want_wide) | (torch.isnan(widened) & torch.isnan(want_wide))
    assert same.all(), f"widening differs at {(~same).nonzero()[:5].flatten()}"
    _same_bits_or_both_nan(narrowed, f.to(dtype), dtype)


def test_block_and_thread_order_is_shuffled(probe):
    module, _, _ = probe
    order = torch.full((256,), -1, dtype=torch.int32)
    nxt = torch.zeros(1, dtype=torch.int32)
    module["emulation_order_probe"](order, nxt)
    assert int(nxt) == 256
    assert sorted(order.tolist()) == list(range(256))
    assert order.tolist() != list(range(256))  # not index order
    blocks = [v // 64 for v in order.tolist()]
    assert blocks != sorted(blocks)  # blocks in a shuffled order too
    assert all(blocks[i] == blocks[i + 1] for i in range(255) if (i + 1) % 64)  # one at a time


def test_unshuffled_order_and_seeds_in_a_fresh_process(probe):
    _, _, lib = probe
    code = (
        "import sys, torch, tvm_ffi\n"
        f"m = tvm_ffi.load_module({str(lib)!r})\n"
        "o = torch.zeros(256, dtype=torch.int32); n = torch.zeros(1, dtype=torch.int32)\n"
        "m['emulation_order_probe'](o, n); print(','.join(map(str, o.tolist())))\n"
    )

    def order(seed):
        env = dict(os.environ, MUSPACE_EMULATION_SEED=seed)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert order("none") == ",".join(map(str, range(256)))
    assert order("1") == order("1") != order("2")


def test_threads_that_exit_do_not_hold_a_barrier(probe):
    module, _, _ = probe
    out = torch.zeros(64, dtype=torch.int32)
    module["emulation_failure_probe"](out, 0)
    assert out.tolist() == [i % 2 for i in range(64)]


@pytest.mark.parametrize(
    "mode, message", [(1, "a barrier that not every live thread"), (2, r"__trap\(\) in thread 7")]
)
def test_deadlock_and_trap_fail_the_launch_naming_the_kernel(probe, mode, message):
    module, warp, _ = probe
    out = torch.zeros(2 * warp, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=f"failure_kernel: {message}"):
        module["emulation_failure_probe"](out, mode)
    # the error is not sticky: the next launch works
    module["emulation_failure_probe"](out, 0)
