#!/usr/bin/env bash
# D2 (session 12): sparse GPU tests of c92af79 / 16edfd2 (offset reach, tiled mark), sanitizers
# over the rule book and the tensor-core GEMM, the benchmark beside spconv + profile, the
# rule-book probe and the encoder host probe (syncs, host hot spots)
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/d2.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
timeout 100 python3 .peers/call/enc_probe.py > $F/w/enc_probe.txt 2>&1; grep -A12 "==" $F/w/enc_probe.txt | head -60
echo "probe done $(( $(date +%s) - t0 )) s"
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_native_model.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_rulebook.py tests/ops/test_sparse_maxpool.py tests/sparse tests/test_sparse_encoder_recipe.py tests/test_patcher_sparse.py tests/compat" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=200 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -20
echo "check done $(( $(date +%s) - t0 )) s"
left=$(( 470 - ($(date +%s) - t0) ))
[ $left -gt 60 ] && SPCONV=1 BENCH_LIMIT=$(( left - 60 > 200 ? 200 : left - 60 )) PROFILE_LIMIT=50 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -40
echo "bench done $(( $(date +%s) - t0 )) s"
left=$(( 585 - ($(date +%s) - t0) ))
[ $left -gt 30 ] && MUSPACE_SPARSE_CONV_ROW_ORDER=0 timeout $left python3 -m benchmarks.bench_sparse_conv --quick --reps 100 --cases '^(encoder|subm-k3-c16-16|strided-k3s2-c16-32|inverse-k3-c32-16)-.*(float32|float16)$' --out $F/w/ab_site_order > $F/w/ab_site_order.log 2>&1
tail -30 $F/w/ab_site_order.log
echo "all done $(( $(date +%s) - t0 )) s"
