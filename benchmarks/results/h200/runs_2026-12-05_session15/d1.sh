#!/usr/bin/env bash
# D1 (session 15): SubM rule book with mirror lookups + the staged (coalesced) pair emit: the
# sparse GPU tests, memcheck / racecheck of the rule-book tests, the rule-book probe (mirror on /
# off, spconv beside), the benchmark beside spconv (quick, default path)
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
trap 'tar -czf $F/d1.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
python3 -c "from mu_space.runtime import native; print(native.status())" 2>&1 | tail -2
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_rulebook.py tests/ops/test_sparse_native_model.py tests/sparse tests/test_sparse_encoder_recipe.py tests/test_patcher_sparse.py" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=150 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -7
echo "check done $(( $(date +%s) - t0 )) s"
SANITIZE_JOBS="memcheck:sparse_rulebook racecheck:sparse_rulebook" SANITIZER_LIMIT=90 OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -4
echo "sanitize done $(( $(date +%s) - t0 )) s"
export MUSPACE_TRY_UNVERIFIED=0
PYTHONPATH=/tmp/peers:$PYTHONPATH timeout 90 python3 .peers/call/rb_probe5.py > $F/w/rb_probe5.txt 2>&1; grep -E "^(==|--|native|voxels)|Error|error" $F/w/rb_probe5.txt | head -40
echo "probe done $(( $(date +%s) - t0 )) s"
left=$(( 555 - ($(date +%s) - t0) ))
SPCONV=1 BENCH_LIMIT=$(( left > 220 ? 220 : left )) PROFILE_LIMIT=1 BENCHES=sparse_conv BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -30
echo "all done $(( $(date +%s) - t0 )) s"
