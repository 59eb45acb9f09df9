import pytest
import torch

from mu_space.ops import _opdef
from mu_space.runtime import kernel_dispatch


@pytest.fixture(autouse=True)
def _fresh_dispatch_state():
    """Each test starts with empty dispatch records, non-strict mode and a fixed seed, and leaves
    no cached native reasons behind (tests may stand in for the library)."""
    kernel_dispatch.reset()
    strict = kernel_dispatch.is_strict()
    kernel_dispatch.set_strict(False)
    torch.manual_seed(1234)
    yield
    kernel_dispatch.set_strict(strict)
    _opdef.forget_native_reasons()
