"""Device-to-device copy bandwidth: the roofline every other benchmark quotes.

    python -m benchmarks.bench_copy_bandwidth [--quick] [--out DIR]

Times dst.copy_(src) at 64 MiB .. 4 GiB (bytes read + bytes written) and writes
copy_bandwidth.json; "copy_bandwidth_gbps" in that file (and in every other results file) is
the 2 GiB figure measured at the start of the run.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.harness import Case, MiB, common_argparser, default_device, run_benchmark

SIZES_MIB = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_SIZES_MIB = (64, 256)


def _copy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    return dst.copy_(src)


def _clone(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    return src.clone()


def _check_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(out, ref), "copy differs from source"


def copy_case(mib: int, device: torch.device) -> Case:
    nbytes = mib * MiB

    def make_args():
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        return src, torch.empty_like(src)

    return Case(
        name=f"copy-{mib}MiB",
        op="copy",
        direction="forward",
        dtype=torch.uint8,
        params={"sweep": "nbytes", "nbytes": nbytes},
        compulsory_bytes=2 * nbytes,
        fn=_copy,
        make_args=make_args,
        reference=_clone,
        check=_check_equal,
        time_reference=False,
    )


def main(argv: list[str] | None = None) -> int:
    args = common_argparser(__doc__.splitlines()[0]).parse_args(argv)
    device = default_device()
    cases = [copy_case(mib, device) for mib in (QUICK_SIZES_MIB if args.quick else SIZES_MIB)]
    return run_benchmark("copy_bandwidth", cases, args)


if __name__ == "__main__":
    sys.exit(main())
