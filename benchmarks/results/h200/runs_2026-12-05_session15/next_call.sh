#!/usr/bin/env bash
# Prepared in session 15 for the next device call (its D2 was refused, so NOT RUN yet), for the
# packed SubM table (key and row in one 64-bit slot, one init launch; d9a1f4e) and the kernels
# of ae20452:
# the whole LiDAR GPU suite (every LiDAR op file, contracts, strict self-check), memcheck /
# racecheck of the rule-book tests (the packed table included: the check and sanitize stages
# run with MUSPACE_TRY_UNVERIFIED=1), the rule-book probe (both tables, mirror on / off), the
# benchmark beside spconv (quick; packed table on), then the voxel / channel sweeps beside
# spconv. Carry .whl and .peers (spconv kit, the 90a library as muspace_lib.tar.xz).
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
trap 'tar -czf $F/next.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
STAGE_LIMIT=200 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -7
echo "check done $(( $(date +%s) - t0 )) s"
SANITIZE_JOBS="memcheck:sparse_rulebook racecheck:sparse_rulebook" SANITIZER_LIMIT=90 OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -4
echo "sanitize done $(( $(date +%s) - t0 )) s"
export MUSPACE_TRY_UNVERIFIED=1  # the packed table in the bench (PACKED_TABLE_UNVERIFIED until this passes)
PYTHONPATH=/tmp/peers:$PYTHONPATH timeout 90 python3 benchmarks/results/h200/runs_2026-12-05_session15/rb_probe6.py > $F/w/rb_probe6.txt 2>&1; grep -E "^(==|--|native|voxels)|Error|error" $F/w/rb_probe6.txt | head -40
echo "probe done $(( $(date +%s) - t0 )) s"
left=$(( 520 - ($(date +%s) - t0) ))
SPCONV=1 BENCH_LIMIT=$(( left > 200 ? 200 : left )) PROFILE_LIMIT=1 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | grep -v "^| sweep" | tail -22
echo "bench done $(( $(date +%s) - t0 )) s"
left=$(( 585 - ($(date +%s) - t0) ))
if [ $left -gt 30 ]; then
  PYTHONPATH=/tmp/peers:$PYTHONPATH timeout $left python3 -m benchmarks.bench_sparse_conv --cases sweep --reps 100 > $F/w/sweep.txt 2>&1; grep -v "%|" $F/w/sweep.txt | tail -14
  cp benchmarks/results/h200/sparse_conv.json $F/w/ 2>/dev/null
fi
echo "all done $(( $(date +%s) - t0 )) s"
