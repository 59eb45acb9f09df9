"""add_one: the native build smoke. Reference tests always; native tests need a GPU."""

import pytest
import torch

import mu_space
from mu_space.ops.add_one import add_one, add_one_reference
from mu_space.runtime import kernel_dispatch, native
from tests.helpers import assert_close, native_gpu_device, poisoned


def test_reference_adds_one_for_every_float_dtype():
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(5, 3, dtype=dtype)
        assert torch.equal(add_one(x, backend="reference"), x + torch.ones((), dtype=dtype))


def test_rejects_non_tensor_and_integer_input():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        add_one([1.0, 2.0])
    with pytest.raises(TypeError, match="x must be a floating tensor, got int64"):
        add_one(torch.arange(3))


def test_empty_input():
    assert add_one(torch.empty(0, 7)).shape == (0, 7)


def test_registered_in_registry_but_not_in_operator_matrix():
    spec = mu_space.runtime.registry.get("add_one")
    assert not spec.public
    assert "add_one" not in mu_space.runtime.registry.operator_matrix_markdown()


def test_torch_compile_sees_the_custom_op_without_graph_breaks():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    fn = torch.compile(lambda x: add_one(x) * 2, backend=counter, fullgraph=True)
    x = torch.randn(6)
    assert torch.equal(fn(x), (x + 1) * 2)
    graph = counter.graphs[0]
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "mu_space.add_one" in targets or "mu_space.add_one.default" in targets


def test_opcheck_reference_path():
    torch.library.opcheck(torch.ops.mu_space.add_one.default, (torch.randn(4, 5), "auto"))


# ---------------------------------------------------------------- native (GPU) tests


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1,), (1000,), (3, 257, 5), (0,), (2**20 + 7,)])
def test_native_matches_reference(shape):
    device = native_gpu_device()
    x = torch.randn(shape, device=device)
    out = poisoned(shape, torch.float32, device)
    native.function("add_one_forward")(x, out, torch.cuda.current_stream(device).cuda_stream)
    torch.cuda.synchronize(device)
    assert_close(out, add_one_reference(x), atol=0, rtol=0)  # exact: one float add
    assert torch.equal(add_one(x, backend="native"), out)


@pytest.mark.gpu
def test_native_handles_non_contiguous_input():
    device = native_gpu_device()
    x = torch.randn(64, 33, device=device).t()
    assert torch.equal(add_one(x, backend="cuda"), x + 1)


@pytest.mark.gpu
def test_auto_dispatch_records_native():
    device = native_gpu_device()
    add_one(torch.randn(8, device=device))
    add_one(torch.randn(8, device=device, dtype=torch.float64))
    rows = {(r["backend"], r["reason"]) for r in kernel_dispatch.records()}
    assert ("cuda", "native") in rows
    assert any(b == "reference" and "float64" in r for b, r in rows)


@pytest.mark.gpu
def test_native_entry_point_validates_arguments():
    device = native_gpu_device()
    fn = native.function("add_one_forward")
    stream = torch.cuda.current_stream(device).cuda_stream
    x = torch.randn(10, device=device)
    with pytest.raises(TypeError, match="x must be float32, got int32"):
        fn(x.int(), torch.empty(10, device=device), stream)
    with pytest.raises(ValueError, match=r"out must have the shape of x"):
        fn(x, torch.empty(11, device=device), stream)
    with pytest.raises(ValueError, match="x must be a cuda tensor, got cpu:0"):
        fn(x.cpu(), x.cpu(), stream)
    with pytest.raises(ValueError, match="out must be on cuda:0, got cpu:0"):
        fn(x, torch.empty(10), stream)
    with pytest.raises(ValueError, match="x must be contiguous"):
        fn(torch.randn(4, 4, device=device).t(), torch.empty(4, 4, device=device), stream)


@pytest.mark.gpu
def test_native_runs_on_the_callers_non_default_stream():
    """The kernel must queue behind torch work on the same non-default stream. The torch fill
    waits behind a ~50 ms spin on that stream, so a launch on any other stream would read the
    buffer before the fill lands."""
    device = native_gpu_device()
    stream = torch.cuda.Stream(device)
    x = torch.zeros(1 << 20, device=device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
        x.fill_(41.0)
        out = add_one(x, backend="cuda")
        out2 = add_one(out, backend="cuda")
    stream.synchronize()
    assert torch.all(out == 42.0) and torch.all(out2 == 43.0)


@pytest.mark.gpu
def test_native_opcheck():
    device = native_gpu_device()
    torch.library.opcheck(
        torch.ops.mu_space.add_one.default, (torch.randn(4, 5, device=device), "cuda")
    )


@pytest.mark.gpu
def test_tensor_on_a_device_other_than_the_current_one():
    native_gpu_device()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.set_device(0)
    x = torch.randn(1 << 16, device="cuda:1")
    with torch.cuda.stream(torch.cuda.Stream("cuda:1")):  # current stream of cuda:1 is used
        out = add_one(x, backend="cuda")
    torch.cuda.synchronize("cuda:1")
    assert out.device == x.device and torch.equal(out, x + 1)
    assert torch.cuda.current_device() == 0  # the device guard restored the current device
