#!/usr/bin/env bash
# The GPU session of issue 13 item 4 (BEVFusion bev_pool: the cells kernel, the radix sort + runs
# step, the row-gather backward in csrc/bev/bev_pool_musa.mu), in steps that each fit one
# 10-minute command on the H200 (in order, on one warm machine; the build stays in the tree):
#
#   bash scripts/bev_pool_gpu_session.sh build     # native library (all sources)
#   bash scripts/bev_pool_gpu_session.sh test      # bev_pool's GPU tests + the BEV contract tests
#   bash scripts/bev_pool_gpu_session.sh sanitize  # compute-sanitizer memcheck + racecheck
#   bash scripts/bev_pool_gpu_session.sh bench     # bench_bev_pool --quick, both sorts
#
# Every step runs with MUSPACE_TRY_UNVERIFIED=1 (the new kernels are behind
# _bev.NATIVE_STEPS_UNVERIFIED until this session passes: then set it to "" and run `test` again).
# Carry `.whl` (apache-tvm-ffi wheels for a machine without an index). Output in $OUT (default
# ./gpu-out/bev_pool). Env: OUT, CUDA_ARCH (default 90a), PYTEST_ARGS, BENCH_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out/bev_pool}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site/tvm_ffi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TESTS=(tests/ops/test_bev_pool.py tests/ops/test_bev_pool_v3.py tests/ops/test_bev_pool_prepare.py)
status=0
case "${1:-}" in
  build)
    nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv | tee "$OUT/gpu.txt"
    CUDA_ARCH=${CUDA_ARCH:-90a} python3 build_utils.py --inplace --if-stale -j "$(nproc)" 2>&1 \
      | tee "$OUT/build.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
    ;;
  test)
    # shellcheck disable=SC2086
    python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} "${TESTS[@]}" \
      --junitxml="$OUT/test.xml" 2>&1 | tee "$OUT/test.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # shellcheck disable=SC2086
    python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} tests/test_op_contracts.py \
      tests/test_selfcheck.py -k "bev_pool" --junitxml="$OUT/contracts.xml" 2>&1 \
      | tee "$OUT/contracts.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    ;;
  sanitize)
    bin=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    for tool in memcheck racecheck; do
      extra=()
      [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
      echo "== compute-sanitizer $tool"
      PYTORCH_NO_CUDA_MEMORY_CACHING=$([ "$tool" = memcheck ] && echo 1 || echo 0) \
        timeout "${SANITIZER_TIMEOUT:-280}" "$bin" --tool "$tool" --error-exitcode 1 \
        --kernel-name kns=muspace ${extra[@]+"${extra[@]}"} python3 -m pytest -q -x \
        -p no:cacheprovider -m gpu tests/ops/test_bev_pool.py \
        -k "edge or tiny or bevdet-r50-2-2" >"$OUT/sanitizer_$tool.log" 2>&1
      rc=$?
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_$tool.log" | tail -n 3
      [ "$rc" -eq 0 ] || { echo "   $tool: exit $rc (log $OUT/sanitizer_$tool.log)"; status=1; }
    done
    ;;
  bench)
    # shellcheck disable=SC2086
    python3 -m benchmarks.bench_bev_pool ${BENCH_ARGS:---quick} 2>&1 | tee "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # the counting sort (sort_by_cell) for comparison, not written to results/
    # shellcheck disable=SC2086
    MUSPACE_BEV_POOL_ROWS_SORT=counting python3 -m benchmarks.bench_bev_pool --quick --no-write \
      --cases "forward" 2>&1 | tee "$OUT/bench_counting.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    ;;
  *)
    echo "usage: $0 build|test|sanitize|bench" >&2
    exit 2
    ;;
esac
exit $status
