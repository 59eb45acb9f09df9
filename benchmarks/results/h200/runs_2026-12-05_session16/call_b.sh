#!/usr/bin/env bash
# Prepared in session 16 (NOT RUN yet): the second call after call_a.sh, on the same library.
# The SubM rule-book probe (rb_probe6.py: both tables, mirror on / off, spconv beside), the
# benchmark beside spconv (quick, the packed table on through MUSPACE_TRY_UNVERIFIED=1, or
# by default once call A cleared PACKED_TABLE_UNVERIFIED), the sparse encoder profile,
# pillar_scatter's tiled forward against its map path (alternating, twice), then the voxel /
# channel sweeps beside spconv in the time left. Carry .whl and .peers; kind nvidia-h200, timeout 600.
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/b.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
PYTHONPATH=/tmp/peers:$PYTHONPATH timeout 90 python3 benchmarks/results/h200/runs_2026-12-05_session15/rb_probe6.py > $F/w/rb_probe6.txt 2>&1; grep -E "^(==|--|native|voxels)|Error|error" $F/w/rb_probe6.txt | head -40
echo "probe done $(( $(date +%s) - t0 )) s"
SPCONV=1 BENCH_LIMIT=220 PROFILE_LIMIT=80 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | grep -v "^| sweep" | tail -22
echo "bench done $(( $(date +%s) - t0 )) s"
for round in 1 2; do  # pillar_scatter: the tiled forward (TILED) against the map path
  for tiled in 1 0; do
    [ $(( $(date +%s) - t0 )) -gt 520 ] && break 2
    MUSPACE_PILLAR_TILED=$tiled timeout 45 python3 -m benchmarks.bench_pillar_scatter --quick --reps 100 --no-write \
      > $F/w/pillar_tiled${tiled}_r$round.txt 2>&1
    echo "== pillar_scatter, tiled=$tiled, round $round"; grep -E "forward-float(32|16) " $F/w/pillar_tiled${tiled}_r$round.txt | cut -c1-150
  done
done
echo "pillar done $(( $(date +%s) - t0 )) s"
left=$(( 585 - ($(date +%s) - t0) ))
if [ $left -gt 30 ]; then
  PYTHONPATH=/tmp/peers:$PYTHONPATH timeout $left python3 -m benchmarks.bench_sparse_conv --cases sweep --reps 100 > $F/w/sweep.txt 2>&1; grep -v "%|" $F/w/sweep.txt | tail -14
  cp benchmarks/results/h200/sparse_conv.json $F/w/ 2>/dev/null
fi
echo "all done $(( $(date +%s) - t0 )) s"
