#!/usr/bin/env bash
# D4 (session 12): input-side row orders only, coalesced row-order masks: sparse GPU tests, the
# benchmark beside spconv + profile, memcheck / racecheck over the offset lists and row orders
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/d4.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_conv.py tests/sparse tests/test_sparse_encoder_recipe.py" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=120 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -7
echo "check done $(( $(date +%s) - t0 )) s"
SPCONV=1 BENCH_LIMIT=190 PROFILE_LIMIT=45 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -21
echo "bench done $(( $(date +%s) - t0 )) s"
left=$(( 345 - ($(date +%s) - t0) ))
[ $left -gt 30 ] && SANITIZE_JOBS="memcheck:sparse_order racecheck:sparse_order_race" SANITIZER_LIMIT=$(( left > 110 ? 110 : left )) OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -6
echo "all done $(( $(date +%s) - t0 )) s"
