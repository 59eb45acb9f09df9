#!/usr/bin/env bash
# D3 (session 12): the per-tile offset lists + windowed row order: sparse GPU tests, the
# benchmark beside spconv + profile, an A/B against site order, sanitizers over the new paths
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/d3.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
python3 -c "from mu_space import selfcheck" && python3 - <<'PY'
import json, mu_space.selfcheck as s
from mu_space.runtime import native
print("sources current:", s._sources_current(native.status().build_info))
PY
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_conv.py tests/sparse tests/test_sparse_encoder_recipe.py" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=150 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -8
echo "check done $(( $(date +%s) - t0 )) s"
SPCONV=1 BENCH_LIMIT=210 PROFILE_LIMIT=50 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -22
echo "bench done $(( $(date +%s) - t0 )) s"
left=$(( 520 - ($(date +%s) - t0) ))
[ $left -gt 40 ] && SANITIZE_JOBS="memcheck:sparse_order racecheck:sparse_order_race" SANITIZER_LIMIT=$(( left > 120 ? 120 : left )) OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -6
echo "sanitize done $(( $(date +%s) - t0 )) s"
left=$(( 585 - ($(date +%s) - t0) ))
[ $left -gt 30 ] && timeout $left python3 -m benchmarks.bench_sparse_conv --quick --reps 100 --cases "^(encoder|subm-k3-c16-16|strided-k3s2-c16-32|inverse-k3-c32-16)-.*(float32|float16)$" --out $F/w/ab_no_spconv > $F/w/ab_no_spconv.log 2>&1
tail -20 $F/w/ab_no_spconv.log
echo "all done $(( $(date +%s) - t0 )) s"
