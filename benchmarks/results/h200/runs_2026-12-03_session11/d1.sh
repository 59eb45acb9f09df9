#!/usr/bin/env bash
# D1 (session 11): sparse GPU tests, sanitizers over the bitmap rule book and the tensor-core
# GEMM, the sparse benchmark beside spconv + profile, and an A/B of the rule-book paths
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/d1.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_native_model.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_rulebook.py tests/ops/test_sparse_maxpool.py tests/sparse tests/test_sparse_encoder_recipe.py tests/test_patcher_sparse.py tests/compat" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=200 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -20
echo "check done $(( $(date +%s) - t0 )) s"
SANITIZE_JOBS="memcheck:sparse_rulebook racecheck:sparse_rulebook memcheck:sparse_gemm_tc racecheck:sparse_gemm_tc racecheck:sparse_gemm_tc_exact" SANITIZER_LIMIT=130 OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -10
echo "sanitize done $(( $(date +%s) - t0 )) s"
SPCONV=1 BENCH_LIMIT=200 PROFILE_LIMIT=80 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -40
echo "bench done $(( $(date +%s) - t0 )) s"
timeout 70 python3 .peers/call/rb_probe.py > $F/w/rb_probe.txt 2>&1; grep "==" $F/w/rb_probe.txt
left=$(( 570 - ($(date +%s) - t0) ))
[ $left -gt 20 ] && MUSPACE_SPARSE_RULEBOOK_BITMAP=0 timeout $left python3 -m benchmarks.bench_sparse_conv --quick --reps 100 --cases '(encoder|strided|inverse).*-(float32|float16)$' --out $F/w/ab_sort > $F/w/ab_sort.log 2>&1
tail -30 $F/w/ab_sort.log
echo "all done $(( $(date +%s) - t0 )) s"
