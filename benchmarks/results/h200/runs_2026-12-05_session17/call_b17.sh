#!/usr/bin/env bash
# Session 17: call_b.sh of session 16 cannot travel with spconv's kit next to the carried library
# (the working tree would exceed 64 MiB). This call carries .whl and .peers/muspace_lib.tar.xz
# only: pillar_scatter's tiled forward against its map path (alternating, twice), then the SubM
# rule book and SubM layers with the packed table (MUSPACE_TRY_UNVERIFIED=1) against the
# int64-key table (alternating, twice). No spconv: these are A/B timings of muSPACE's own paths.
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
trap 'tar -czf $F/b17.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
for round in 1 2; do
  for tiled in 1 0; do
    [ $(( $(date +%s) - t0 )) -gt 300 ] && break 2
    MUSPACE_TRY_UNVERIFIED=1 MUSPACE_PILLAR_TILED=$tiled timeout 60 python3 -m benchmarks.bench_pillar_scatter --quick --reps 100 --no-write \
      > $F/w/pillar_tiled${tiled}_r$round.txt 2>&1
    echo "== pillar_scatter, tiled=$tiled, round $round"; grep -E "forward-float(32|16) " $F/w/pillar_tiled${tiled}_r$round.txt | cut -c1-150
  done
done
echo "pillar done $(( $(date +%s) - t0 )) s"
for round in 1 2; do
  for packed in 1 0; do
    [ $(( $(date +%s) - t0 )) -gt 540 ] && break 2
    MUSPACE_TRY_UNVERIFIED=$packed timeout 90 python3 -m benchmarks.bench_sparse_conv --quick --reps 100 --no-write --cases "rulebook|subm" \
      > $F/w/sparse_packed${packed}_r$round.txt 2>&1
    echo "== sparse, packed=$packed, round $round"; grep -E "rulebook|subm" $F/w/sparse_packed${packed}_r$round.txt | grep -v "^#" | cut -c1-150 | head -12
  done
done
echo "all done $(( $(date +%s) - t0 )) s"
