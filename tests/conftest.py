import os

import pytest
import torch

from mu_space.ops import _opdef
from mu_space.runtime import kernel_dispatch

# pytest-xdist: one share of the cores per worker. Each worker's torch otherwise starts a thread
# per core: with 15 workers on the H200 machine's 16 cores, CPU-side tests that take 2.5 s here
# passed a 45 s timeout there (oversubscription is the likely cause).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )


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


def pytest_runtest_logreport(report):
    """MUSPACE_TEST_LOG=PATH: each test's outcome and duration, and each failure's traceback,
    appended as it happens (in the xdist controller), so a GPU run cut off by its time limit still
    says what failed and what was slow."""
    path = os.environ.get("MUSPACE_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when != "call" and not report.failed:
        return
    with open(path, "a") as log:
        log.write(f"{report.outcome:7s} {report.duration:8.2f}s {report.nodeid}\n")
        if report.failed:
            log.write(report.longreprtext[-4000:] + "\n----\n")
