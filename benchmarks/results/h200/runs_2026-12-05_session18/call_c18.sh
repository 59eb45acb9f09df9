#!/usr/bin/env bash
# Session 18: session 16's call_b.sh less what does not fit one call. Carry .whl and .peers/spconv
# (the whole .peers with the library tarball is over the 64-MiB tree limit). On the machine that
# call_a.sh left warm the library it unpacked is still there; on a fresh one it is built here.
# The SubM rule-book probe (both tables, spconv beside), the benchmark beside spconv (the packed
# table on through MUSPACE_TRY_UNVERIFIED=1), the encoder profile, then pillar_scatter's tiled
# forward against its map path (alternating, twice) in the time left. kind nvidia-h200, timeout 600.
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/c.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
if [ ! -f mu_space/_lib/libmuspace_native.so ]; then
  if [ -f .peers/muspace_lib.tar.xz ]; then tar -xJf .peers/muspace_lib.tar.xz
  else CUDA_ARCH=90a python3 build_utils.py --inplace > $F/w/build.txt 2>&1; tail -2 $F/w/build.txt; fi
fi
python3 -c "import json; print('library sources', json.load(open('mu_space/_lib/build_info.json'))['sources_sha256'][:12])"
echo "library ready $(( $(date +%s) - t0 )) s"
bash .peers/spconv/install.sh >/dev/null 2>&1
PYTHONPATH=/tmp/peers:$PYTHONPATH timeout 90 python3 benchmarks/results/h200/runs_2026-12-05_session15/rb_probe6.py > $F/w/rb_probe6.txt 2>&1; grep -E "^(==|--|native|voxels)|Error|error" $F/w/rb_probe6.txt | head -40
echo "probe done $(( $(date +%s) - t0 )) s"
SPCONV=1 BENCH_LIMIT=200 PROFILE_LIMIT=70 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | grep -v "^| sweep" | tail -22
echo "bench done $(( $(date +%s) - t0 )) s"
for round in 1 2; do  # pillar_scatter: the tiled forward (TILED) against the map path
  for tiled in 1 0; do
    [ $(( $(date +%s) - t0 )) -gt 530 ] && break 2
    MUSPACE_PILLAR_TILED=$tiled timeout 45 python3 -m benchmarks.bench_pillar_scatter --quick --reps 100 --no-write \
      > $F/w/pillar_tiled${tiled}_r$round.txt 2>&1
    echo "== pillar_scatter, tiled=$tiled, round $round"; grep -E "forward-float(32|16) " $F/w/pillar_tiled${tiled}_r$round.txt | cut -c1-150
  done
done
echo "all done $(( $(date +%s) - t0 )) s"
