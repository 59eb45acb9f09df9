#!/usr/bin/env bash
# D3: sparse GPU tests, sanitizers over the implicit GEMMs, the sparse benchmark beside spconv, profile, host probe
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/d3.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_rulebook.py tests/ops/test_sparse_maxpool.py tests/sparse tests/test_sparse_encoder_recipe.py tests/test_patcher_sparse.py tests/compat" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=200 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -20
echo "check done $(( $(date +%s) - t0 )) s"
SANITIZE_JOBS="memcheck:sparse_gemm racecheck:sparse_gemm_rest racecheck:sparse_gemm_bf16 racecheck:sparse_gemm_bf16_im2col" SANITIZER_LIMIT=170 OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -8
echo "sanitize done $(( $(date +%s) - t0 )) s"
SPCONV=1 BENCH_LIMIT=260 PROFILE_LIMIT=90 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -40
echo "bench done $(( $(date +%s) - t0 )) s"
export PYTHONPATH=/tmp/peers:$PYTHONPATH
timeout $(( 570 - ($(date +%s) - t0) )) python3 .peers/call/host_probe2.py > $F/w/host_probe2.txt 2>&1; grep -E "wall" $F/w/host_probe2.txt
echo "all done $(( $(date +%s) - t0 )) s"
