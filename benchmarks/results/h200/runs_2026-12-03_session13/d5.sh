#!/usr/bin/env bash
# D5 (session 13): the 2048-row row-order build (first GPU run): sparse GPU tests, memcheck /
# racecheck of the row orders, the SubM rule-book probe, the benchmark beside spconv (quick +
# the voxel / channel sweeps), ncu of the encoder forward
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/d5.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_conv.py tests/sparse tests/test_sparse_encoder_recipe.py" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=120 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -7
echo "check done $(( $(date +%s) - t0 )) s"
SANITIZE_JOBS="memcheck:sparse_order racecheck:sparse_order_race" SANITIZER_LIMIT=100 OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -6
echo "sanitize done $(( $(date +%s) - t0 )) s"
timeout 60 python3 .peers/call/rb_probe2.py > $F/w/rb_probe2.txt 2>&1; grep "^==" $F/w/rb_probe2.txt
echo "probe done $(( $(date +%s) - t0 )) s"
SPCONV=1 BENCH_LIMIT=170 PROFILE_LIMIT=40 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -21
echo "bench done $(( $(date +%s) - t0 )) s"
left=$(( 540 - ($(date +%s) - t0) ))
[ $left -gt 40 ] && timeout $(( left > 110 ? 110 : left )) python3 -m benchmarks.bench_sparse_conv --cases sweep --reps 100 --no-write > $F/w/sweep.txt 2>&1; tail -22 $F/w/sweep.txt
echo "sweep done $(( $(date +%s) - t0 )) s"
left=$(( 580 - ($(date +%s) - t0) ))
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ $left -gt 25 ] && [ -n "$NCU" ] && timeout $left $NCU --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats python3 -m benchmarks.profile_kernels --only 'sparse-encoder' > $F/w/ncu.txt 2>&1; python3 scripts/ncu_summary.py $F/w/ncu.txt --markdown > $F/w/ncu.md 2>&1; wc -l $F/w/ncu.md
echo "all done $(( $(date +%s) - t0 )) s"
