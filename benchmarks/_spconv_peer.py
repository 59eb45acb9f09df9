"""spconv 2.3.8 (`spconv.pytorch`), timed side by side with mu_space.sparse (issue 11).

On the GPU machine spconv comes from the packed wheels (../shared/tools/spconv-kit.sh):

    bash .peers/spconv/install.sh && export PYTHONPATH=/tmp/peers:$PYTHONPATH

When `spconv.pytorch` imports and a CUDA GPU is visible, bench_sparse_conv adds a
`<case>-spconv` twin per case: the same inputs, spconv's module holding our weights (the same
KRSC state_dict, loaded unchanged), spconv's default algorithm for the device (implicit GEMM on
a GPU), the harness's timing loop; each twin is checked against our reference first (sites
matched as sets: spconv's strided outputs come in its own order). Without it the benchmark runs
unchanged (the reason is printed once). On the CPU spconv's twins are not run: its CPU path
races under several torch threads (tests/sparse/test_against_spconv.py).

    python -m benchmarks._spconv_peer RESULTS.json ...   # ours / spconv per case + the targets

Targets (issue 11): muSPACE's median <= 1.0x spconv's (goal 0.7x) per case with a twin.
"""

from __future__ import annotations

import sys
import warnings

import torch

from benchmarks._peer import twin_rows

TARGET_RATIO = 1.0  # ours / spconv, per case
GOAL_RATIO = 0.7

_state: dict = {}


def reason() -> str | None:
    """None when spconv's twins can run here, else why not (printed once)."""
    if "reason" not in _state:
        why = None
        if not torch.cuda.is_available():
            why = "no CUDA GPU (spconv's CPU path is not timed)"
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    import spconv
                    import spconv.pytorch as sp
                _state["sp"] = sp
                _state["version"] = spconv.__version__
            except Exception as exc:  # not installed / ABI mismatch: report, never fail
                why = (
                    f"spconv.pytorch does not import ({type(exc).__name__}: {exc}); on the GPU "
                    "machine: bash .peers/spconv/install.sh && export PYTHONPATH=/tmp/peers:"
                    "$PYTHONPATH"
                )
        _state["reason"] = why
        if why is not None:
            print(f"spconv peer: {why}; its twins are not timed", file=sys.stderr)
    return _state["reason"]


def available() -> bool:
    return reason() is None


def lib():
    """The spconv.pytorch module (after available())."""
    return _state["sp"]


def version() -> str | None:
    return _state.get("version")


def twin(module: torch.nn.Module, build) -> torch.nn.Module:
    """build(spconv.pytorch) -> the same layer / network in spconv, with `module`'s state_dict
    loaded unchanged (strict), on module's device and dtype."""
    other = build(lib())
    other.load_state_dict(module.state_dict(), strict=True)
    p = next(module.parameters(), None)
    return other.to(p.device, p.dtype) if p is not None else other


def site_order(indices: torch.Tensor) -> torch.Tensor:
    """Permutation sorting rows (b, z, y, x) ascending (our strided outputs' order)."""
    keys = torch.zeros(indices.shape[0], dtype=torch.int64, device=indices.device)
    for j in range(indices.shape[1]):
        keys = keys * (1 << 15) + indices[:, j].long()
    return torch.argsort(keys)


def matching(sp_indices: torch.Tensor, our_indices: torch.Tensor) -> torch.Tensor:
    """p with sp_indices[p] == our_indices row for row (ValueError when the site sets differ)."""
    ps, po = site_order(sp_indices), site_order(our_indices)
    if sp_indices.shape != our_indices.shape or not torch.equal(
        sp_indices[ps].long(), our_indices[po].long()
    ):
        raise ValueError(
            f"spconv's output sites differ from ours ({sp_indices.shape[0]} vs "
            f"{our_indices.shape[0]} rows)"
        )
    p = torch.empty_like(ps)
    p[po] = ps
    return p


# ------------------------------------------------------------------ results


def ratio_rows(paths: list[str]) -> list[dict]:
    return [
        {"case": name, "ours_us": ours, "spconv_us": theirs, "ratio": ours / theirs}
        for name, ours, theirs in twin_rows(paths, "spconv")
    ]


def table(paths: list[str]) -> str:
    lines = [
        "| case | ours (µs) | spconv (µs) | ours / spconv | <= 1.0x | <= 0.7x (goal) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in ratio_rows(paths):
        lines.append(
            f"| {r['case']} | {r['ours_us']:.1f} | {r['spconv_us']:.1f} | {r['ratio']:.2f}x | "
            f"{'met' if r['ratio'] <= TARGET_RATIO else 'MISSED'} | "
            f"{'met' if r['ratio'] <= GOAL_RATIO else 'no'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
