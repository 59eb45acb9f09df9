"""Builds the native library (see build_utils.py) into the package during install.

`pip install -e .` builds it into mu_space/_lib/ (in place); a wheel build puts it into the
wheel. Without a toolchain, or with MUSPACE_NATIVE=0, the install is pure Python and prints one
line saying why. A failed compile with a toolchain present fails the install.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_utils  # noqa: E402

PLAN = build_utils.detect_toolchain()
PTH_HOOK = "mu_space_mmcv_ext.pth"


def _tvm_ffi_requirement() -> str:
    """The library is ABI-bound to the tvm-ffi it was built against: floor at that version."""
    if PLAN.toolchain is None:
        return "apache-tvm-ffi>=0.1.15,<0.2"
    from tvm_ffi import __version__

    return f"apache-tvm-ffi>={__version__},<0.2"


class BuildPyWithNative(build_py):
    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH_HOOK)]

    def run(self):
        super().run()
        # The opt-in mmcv._ext hook (MUSPACE_MMCV_EXT=1, docs/compat_mmcv.md): a .pth file at the
        # top of site-packages; inert unless the variable is set.
        pth = Path(__file__).resolve().parent / PTH_HOOK
        self.copy_file(str(pth), str(Path(self.build_lib) / PTH_HOOK))
        # Progress reaches the terminal even where pip hides the build's output (no -v).
        progress = build_utils.Progress()
        try:
            progress.say(build_utils.describe(PLAN))
            if self.editable_mode:
                out = Path(__file__).resolve().parent / build_utils.PACKAGE_LIB_DIR
            else:
                out = Path(self.build_lib) / build_utils.PACKAGE_LIB_DIR
                # A development build in the source tree must not leak into the wheel.
                shutil.rmtree(out, ignore_errors=True)
            if PLAN.toolchain is not None:
                jobs = int(os.environ.get("MAX_JOBS", 0)) or None
                build_utils.build(PLAN, out, jobs=jobs, progress=progress)
        finally:
            progress.close()


class NativeDistribution(Distribution):
    """Tag the wheel as platform-specific when it carries the native library."""

    def has_ext_modules(self):
        return PLAN.toolchain is not None


setup(
    cmdclass={"build_py": BuildPyWithNative},
    distclass=NativeDistribution,
    install_requires=["torch>=2.4,<3", "numpy>=1.22", _tvm_ffi_requirement()],
)
