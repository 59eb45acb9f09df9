#!/usr/bin/env bash
# D2: sparse GPU tests, sanitizers over the implicit GEMM, encoder A/B (im2col vs implicit) beside spconv
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/d2.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_rulebook.py tests/sparse tests/test_sparse_encoder_recipe.py tests/test_patcher_sparse.py" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=200 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -20
echo "check done $(( $(date +%s) - t0 )) s"
SANITIZE_JOBS="memcheck:sparse_gemm racecheck:sparse_gemm" SANITIZER_LIMIT=170 OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -8
echo "sanitize done $(( $(date +%s) - t0 )) s"
export PYTHONPATH=/tmp/peers:$PYTHONPATH
for g in implicit im2col; do
  MUSPACE_SPARSE_CONV_GEMM=$g timeout 150 python3 -m benchmarks.bench_sparse_conv --quick --reps 50 --cases "encoder" --no-write > $F/w/enc_$g.log 2>&1
  echo "== GEMM=$g"; grep -E "^encoder" $F/w/enc_$g.log
done
echo "bench done $(( $(date +%s) - t0 )) s"
