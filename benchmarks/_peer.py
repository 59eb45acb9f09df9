"""A peer's own kernels (mmcv's, built unmodified with a minimal binding of ours) loaded as torch
ops for side-by-side timing, and the ours-vs-peer ratio table of a results file.

The peer libraries live in the ignored .peers/build/ (scripts/build_mmcv_*_peer.sh); a missing
or unloadable one is reported once and the benchmarks run without its cases.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


class PeerLibrary:
    """torch.ops.<namespace>.* from .peers/build/<namespace>.so (`env` overrides the path)."""

    def __init__(self, namespace: str, env: str, build_script: str):
        self.namespace = namespace
        self.path = Path(os.environ.get(env, REPO / ".peers" / "build" / f"{namespace}.so"))
        self.build_script = build_script
        self._reason: str | None = None
        self._checked = False

    def reason(self) -> str | None:
        """None when the peer's kernels can be timed here, else why not."""
        if not self._checked:
            self._checked = True
            if not torch.cuda.is_available():
                self._reason = "no CUDA GPU"
            elif not self.path.is_file():
                self._reason = f"{self.path} not built (bash {self.build_script})"
            else:
                try:
                    torch.ops.load_library(str(self.path))
                except Exception as exc:  # an ABI mismatch etc.: report, never fail the run
                    self._reason = f"{self.path} does not load: {exc}"
            if self._reason is not None:
                print(
                    f"{self.namespace}: {self._reason}; its kernels are not timed", file=sys.stderr
                )
        return self._reason

    def has(self, op: str) -> bool:
        return self.reason() is None and hasattr(self.ops, op)

    @property
    def ops(self):
        return getattr(torch.ops, self.namespace)


def twin_rows(paths: list[str], peer: str):
    """(case, ours median µs, peer median µs) for every case with a `<case>-<peer>` twin that
    both have a median for, in the given results files."""
    for path in paths:
        by_name = {r["name"]: r for r in json.loads(Path(path).read_text())["results"]}
        for name, r in by_name.items():
            twin = by_name.get(f"{name}-{peer}")
            if twin is None or r.get("median_us") is None or twin.get("median_us") is None:
                continue
            yield name, r["median_us"], twin["median_us"]


def ratio_table(paths: list[str], peer: str = "mmcv") -> str:
    """ours / peer medians of every case with a `<case>-<peer>` twin in the given results files."""
    lines = [
        f"| case | ours (µs) | {peer} (µs) | {peer} / ours |",
        "| --- | --- | --- | --- |",
    ]
    for name, ours, theirs in twin_rows(paths, peer):
        lines.append(f"| {name} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.1f}x |")
    return "\n".join(lines)
