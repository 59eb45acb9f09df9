#!/usr/bin/env bash
# The GPU session of issue 10 (the voxel operators), in steps that each fit one 10-minute command
# on the H200 (run them in order on one warm machine; the build stays in the tree):
#
#   bash scripts/voxel_gpu_session.sh build     # native library (all sources) + mmcv's peer kernels
#   bash scripts/voxel_gpu_session.sh test      # the voxel ops' GPU tests + their contract tests
#   bash scripts/voxel_gpu_session.sh sanitize  # compute-sanitizer memcheck + racecheck over them
#   bash scripts/voxel_gpu_session.sh bench     # bench_voxelization / _dynamic_scatter / _pillar_scatter
#   bash scripts/voxel_gpu_session.sh recipes   # PointPillars and CenterPoint at the upstream shapes
#
# Carry `.peers` (mmcv's fetched sources, ignored by git) and `.whl` (apache-tvm-ffi wheels for a
# machine without an index, README "GPU validation") to the GPU machine. Output (logs, JSON) in
# $OUT (default ./gpu-out/voxel). Nothing here changes the tree except the in-place build
# (mu_space/_lib/, .peers/build/); removing `unverified` from the OpDefs after a clean `test`
# and `sanitize` is the session's own edit (mu_space/ops/{voxelization,voxelization_batch,
# voxelization_padded,dynamic_voxelize,dynamic_scatter,pillar_scatter}.py, _voxel.UNVERIFIED).
#
# After `test` and `sanitize` pass: remove `unverified` (the ops listed above), then run
# `test` again: the contract tests' fuzz then compares native (`auto`) with the reference too.
#
# A library prebuilt here (CUDA_ARCH=90a python build_utils.py --inplace) and carried
# (`mu_space/_lib`) is kept when it is current (--if-stale: same csrc/ digest and archs).
# Env: OUT, CUDA_ARCH (default 90a), PYTEST_ARGS (e.g. "-n 12"), BENCH_ARGS (e.g. "--quick").
# Estimated times on the H200 (16 cores): build ~3-4 min (the library; the peer ~1 min), test
# ~3-5 min, sanitize ~5-8 min, bench ~5-8 min (--quick: ~2 min), recipes ~2 min.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out/voxel}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site/tvm_ffi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
TESTS=(tests/ops/test_voxelization.py tests/ops/test_dynamic_scatter.py
  tests/ops/test_pillar_scatter.py tests/ops/test_voxel_native_calls.py
  tests/test_patcher_defaults.py)
CONTRACT_K="voxel or scatter or segment"
status=0
case "${1:-}" in
  build)
    nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv | tee "$OUT/gpu.txt"
    CUDA_ARCH=${CUDA_ARCH:-90a} python3 build_utils.py --inplace --if-stale -j "$(nproc)" 2>&1 \
      | tee "$OUT/build.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
    CUDA_ARCH=${CUDA_ARCH:-90a} bash scripts/build_mmcv_voxel_peer.sh 2>&1 | tee "$OUT/peer.log"
    python3 -c "import mu_space; from mu_space.runtime import native; print(native.status())"
    ;;
  test)
    # shellcheck disable=SC2086
    python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} "${TESTS[@]}" --junitxml="$OUT/test.xml" 2>&1 \
      | tee "$OUT/test.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # shellcheck disable=SC2086
    python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} tests/test_op_contracts.py \
      -k "$CONTRACT_K" \
      --junitxml="$OUT/contracts.xml" 2>&1 | tee "$OUT/contracts.log"
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
        -p no:cacheprovider -m gpu tests/ops/test_voxelization.py \
        tests/ops/test_dynamic_scatter.py tests/ops/test_pillar_scatter.py \
        -k "native_safety or tiny or kitti" >"$OUT/sanitizer_$tool.log" 2>&1
      rc=$?
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_$tool.log" | tail -n 3
      [ "$rc" -eq 0 ] || { echo "   $tool: exit $rc (log $OUT/sanitizer_$tool.log)"; status=1; }
    done
    ;;
  bench)
    for b in voxelization dynamic_scatter pillar_scatter; do
      python3 -m benchmarks.bench_$b ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$b.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    python3 -m benchmarks._voxel_peer benchmarks/results/h200/voxelization*.json \
      benchmarks/results/h200/dynamic_scatter*.json 2>&1 | tee "$OUT/mmcv_ratios.txt"
    ;;
  recipes)
    for args in "model_examples/PointPillars/scripts/pointpillars_hot_path.py" \
      "model_examples/PointPillars/scripts/pointpillars_hot_path.py --config pointpillars-kitti" \
      "model_examples/CenterPoint/scripts/centerpoint_hot_path.py" \
      "model_examples/CenterPoint/scripts/centerpoint_hot_path.py --mode dynamic"; do
      echo "== $args" | tee -a "$OUT/recipes.log"
      # shellcheck disable=SC2086
      python3 $args 2>&1 | tee -a "$OUT/recipes.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    ;;
  *)
    sed -n '2,19p' "$0"
    exit 2
    ;;
esac
exit "$status"
