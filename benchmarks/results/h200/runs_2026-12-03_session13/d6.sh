#!/usr/bin/env bash
# D6 (session 13): the default path after clearing ROW_ORDER_UNVERIFIED and the rule book's
# geometry-parse cache (no native change since D5): sparse GPU tests, the SubM rule-book host
# split, the benchmark beside spconv (quick, default settings), the voxel / channel sweeps
# beside spconv, the encoder without spconv in the process
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
trap 'tar -czf $F/d6.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
CHECK_TESTS="tests/ops/test_sparse_native.py tests/ops/test_sparse_im2col.py tests/ops/test_sparse_native_calls.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_rulebook.py tests/ops/test_sparse_native_model.py tests/sparse tests/test_sparse_encoder_recipe.py tests/test_patcher_sparse.py" \
  CHECK_FAMILIES=sparse STAGE_LIMIT=150 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -7
echo "check done $(( $(date +%s) - t0 )) s"
export MUSPACE_TRY_UNVERIFIED=0  # the default path from here on
timeout 40 python3 -m benchmarks.bench_sparse_conv --cases encoder --reps 100 --no-write > $F/w/encoder_alone.txt 2>&1; grep encoder $F/w/encoder_alone.txt | grep -v "%|"
echo "encoder alone done $(( $(date +%s) - t0 )) s"
PYTHONPATH=/tmp/peers:$PYTHONPATH timeout 70 python3 .peers/call/rb_probe3.py > $F/w/rb_probe3.txt 2>&1; grep -A8 "^==" $F/w/rb_probe3.txt | grep -v "^    ('" | head -40
echo "probe done $(( $(date +%s) - t0 )) s"
SPCONV=1 BENCH_LIMIT=200 PROFILE_LIMIT=40 BENCH_ARGS="--quick --reps 100" OUT=$F/w/bench bash scripts/lidar_gpu_session.sh bench 2>&1 | tail -21
echo "bench done $(( $(date +%s) - t0 )) s"
left=$(( 560 - ($(date +%s) - t0) ))
[ $left -gt 40 ] && PYTHONPATH=/tmp/peers:$PYTHONPATH timeout $(( left > 150 ? 150 : left )) python3 -m benchmarks.bench_sparse_conv --cases sweep --reps 100 > $F/w/sweep.txt 2>&1; grep -v "%|" $F/w/sweep.txt | tail -24
cp benchmarks/results/h200/sparse_conv.json benchmarks/results/h200/sparse_conv.png $F/w/ 2>/dev/null
echo "all done $(( $(date +%s) - t0 )) s"
