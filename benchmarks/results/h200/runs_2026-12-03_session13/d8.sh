#!/usr/bin/env bash
# D8 (session 13): float32 forwards of C_in * C_out >= 128 * 128 on the per-offset path: sparse
# GPU tests, A/B (MUSPACE_SPARSE_CONV_PER_OFFSET_CHANNELS=0: the implicit GEMM) of the channel
# sweep and the float32 encoder, ours only, then the benchmark beside spconv (default path)
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
trap 'tar -czf $F/d8.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_native_model.py tests/sparse tests/test_sparse_encoder_recipe.py" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=110 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -7
echo "check done $(( $(date +%s) - t0 )) s"
export MUSPACE_TRY_UNVERIFIED=0
C='sweep-channels|encoder-centerpoint-0075-forward-float32|encoder-centerpoint-0075-forward\+backward-float32'
timeout 90 python3 -m benchmarks.bench_sparse_conv --cases "$C" --reps 100 --no-write > $F/w/default.txt 2>&1; grep -v "%|" $F/w/default.txt | grep "sweep\|encoder"
echo "default done $(( $(date +%s) - t0 )) s"
MUSPACE_SPARSE_CONV_PER_OFFSET_CHANNELS=0 timeout 90 python3 -m benchmarks.bench_sparse_conv --cases "$C" --reps 100 --no-write > $F/w/implicit.txt 2>&1; grep -v "%|" $F/w/implicit.txt | grep "sweep\|encoder"
echo "implicit done $(( $(date +%s) - t0 )) s"
left=$(( 400 - ($(date +%s) - t0) ))
[ $left -gt 60 ] && SPCONV=1 BENCH_LIMIT=$(( left > 190 ? 190 : left - 10 )) PROFILE_LIMIT=1 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -21
echo "all done $(( $(date +%s) - t0 )) s"
