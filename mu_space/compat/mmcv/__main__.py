"""python -m mu_space.compat.mmcv [--report | --install-pth | --remove-pth]

--report       install the surrogate and print its report (what is served)
--install-pth  write the MUSPACE_MMCV_EXT hook (mu_space_mmcv_ext.pth) into site-packages;
               wheels install it themselves, editable installs (pip install -e) need this once
--remove-pth   remove it again
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

PTH = "mu_space_mmcv_ext.pth"


def _source() -> str:
    here = Path(__file__).resolve()
    for candidate in (here.parents[3] / PTH, Path(sysconfig.get_paths()["purelib"]) / PTH):
        if candidate.is_file():
            return candidate.read_text()
    raise SystemExit(f"{PTH} not found next to the mu_space sources")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mu_space.compat.mmcv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--report", action="store_true")
    group.add_argument("--install-pth", action="store_true")
    group.add_argument("--remove-pth", action="store_true")
    args = parser.parse_args(argv)
    target = Path(sysconfig.get_paths()["purelib"]) / PTH
    if args.install_pth:
        text = _source()
        target.write_text(text)
        print(f"wrote {target} (active when MUSPACE_MMCV_EXT=1)")
    elif args.remove_pth:
        target.unlink(missing_ok=True)
        print(f"removed {target}")
    else:
        from mu_space.compat import mmcv

        print(mmcv.install().report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
