#!/usr/bin/env bash
# D1 (session 14): sparse_rulebook_subm (a SubM rule book in one entry point, its flags read
# back inside it): the sparse GPU tests, memcheck / racecheck of the rule-book tests, the SubM
# rule-book and layer probe, the benchmark beside spconv (quick, default path)
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
trap 'tar -czf $F/d1.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_rulebook.py tests/ops/test_sparse_native_model.py tests/sparse tests/test_sparse_encoder_recipe.py tests/test_patcher_sparse.py" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=150 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -7
echo "check done $(( $(date +%s) - t0 )) s"
SANITIZE_JOBS="memcheck:sparse_rulebook racecheck:sparse_rulebook" SANITIZER_LIMIT=80 OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -4
echo "sanitize done $(( $(date +%s) - t0 )) s"
export MUSPACE_TRY_UNVERIFIED=0  # the default path from here on
PYTHONPATH=/tmp/peers:$PYTHONPATH timeout 80 python3 .peers/call/rb_probe4.py > $F/w/rb_probe4.txt 2>&1; grep -A8 "^==" $F/w/rb_probe4.txt | grep -v "^    ('" | head -60
echo "probe done $(( $(date +%s) - t0 )) s"
left=$(( 540 - ($(date +%s) - t0) ))
SPCONV=1 BENCH_LIMIT=$(( left > 200 ? 200 : left )) PROFILE_LIMIT=1 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -21
echo "all done $(( $(date +%s) - t0 )) s"
