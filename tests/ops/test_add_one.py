"""add_one: the native build smoke. Reference tests always; native tests need a GPU."""

import pytest
import torch

from mu_space.ops.add_one import add_one, add_one_reference
from mu_space.runtime import native
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
