#!/usr/bin/env bash
# The issue-12 GPU session in stages that each fit a 10-minute command (H200, 16 cores):
#
#   bash scripts/box3d_gpu_session.sh build        # ~2-3 min: library (CUDA_ARCH=90a) + mmcv peer
#   bash scripts/box3d_gpu_session.sh test         # ~3-5 min: box tests + contract tests on the GPU
#   bash scripts/box3d_gpu_session.sh sanitize     # ~3-6 min: memcheck + racecheck of the box kernels
#   bash scripts/box3d_gpu_session.sh bench [NAME ...]   # points_in_boxes boxes_overlap_bev nms3d
#                                                        # roiaware_pool3d roipoint_pool3d (default all)
#   bash scripts/box3d_gpu_session.sh profile [REGEX]    # ~1-2 min: host vs kernel time per case
#
# Carry the ignored .peers/ folder (mmcv's sources) to the GPU machine for the peer build. The
# tests and benchmarks run with MUSPACE_TRY_UNVERIFIED=1, so `auto` uses the (still unverified)
# kernels too; after a clean run set mu_space/ops/_box3d.py's UNVERIFIED to "".
# Logs go to $OUT (default ./gpu-out-box3d); benchmark JSON to benchmarks/results/<gpu>/ (the
# harness's default: commit it), and $OUT/mmcv_ratios.md holds ours vs mmcv per case.
# A library prebuilt here (CUDA_ARCH=90a python build_utils.py --inplace) and carried
# (`mu_space/_lib`) is kept when it is current (--if-stale: same csrc/ digest and archs).
# Env: OUT, CUDA_ARCH (default 90a), PYTEST_ARGS (e.g. "-n 8"), BENCH_ARGS (e.g. "--quick").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out-box3d}
mkdir -p "$OUT"
case "${1:-}" in build | test | sanitize | bench | profile) ;; *) sed -n '2,18p' "$0"; exit 2 ;; esac
export PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
export CUDA_ARCH=${CUDA_ARCH:-90a}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OPS="points_in_boxes or boxes_overlap_bev or boxes_iou_bev or box_iou_rotated or nms3d or nms_bev"
OPS="$OPS or circle_nms or box3d_nms_ordered or roiaware or roipoint"
TESTS=(tests/ops/test_points_in_boxes.py tests/ops/test_boxes_overlap_bev.py tests/ops/test_nms3d.py
       tests/ops/test_circle_nms.py tests/ops/test_pcdet.py tests/ops/test_roiaware_pool3d.py
       tests/ops/test_roipoint_pool3d.py tests/ops/test_box3d_benchmarks.py)
status=0
stage=${1:-}
shift || true
start=$(date +%s)

case "$stage" in
  build)
    nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv | tee "$OUT/gpu.txt"
    python3 build_utils.py --inplace --if-stale -j "$(nproc)" 2>&1 | tee "$OUT/build.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
    python3 -m mu_space 2>&1 | tee "$OUT/selfcheck.txt" | grep -E "box3d|FAIL" | head -40
    if [ -d .peers/mmcv ]; then
      bash scripts/build_mmcv_box3d_peer.sh 2>&1 | tee "$OUT/peer_build.log" || true
    else
      echo "no .peers/mmcv: mmcv's kernels will not be timed (carry .peers)" | tee "$OUT/peer_build.log"
    fi
    ;;
  test)
    # shellcheck disable=SC2086
    python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} "${TESTS[@]}" \
      --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    # -k only on the contract tests (their ids carry the op name; the op files run whole)
    # shellcheck disable=SC2086
    python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} tests/test_op_contracts.py \
      -k "$OPS or pcdet" --junitxml="$OUT/contracts.xml" 2>&1 | tee "$OUT/contracts.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    ;;
  sanitize)
    tool_bin=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    for tool in memcheck racecheck; do
      extra=()
      [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
      log="$OUT/sanitizer_$tool.log"
      echo "== compute-sanitizer $tool (box kernels)"
      PYTORCH_NO_CUDA_MEMORY_CACHING=$([ "$tool" = memcheck ] && echo 1 || echo 0) \
        MUSPACE_FUZZ_CASES=20 MUSPACE_FUZZ_SKIP=huge timeout 280 "$tool_bin" --tool "$tool" \
        --error-exitcode 1 --kernel-name kns=box3d ${extra[@]+"${extra[@]}"} \
        python3 -m pytest -q -x -p no:cacheprovider "${TESTS[@]:0:7}" tests/test_op_contracts.py \
        -k "($OPS) and (native or fuzz)" >"$log" 2>&1 || status=1
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$log" | tail -n 3
    done
    ;;
  bench)
    benches=("$@")
    [ ${#benches[@]} -gt 0 ] || benches=(points_in_boxes boxes_overlap_bev nms3d roiaware_pool3d roipoint_pool3d)
    for b in "${benches[@]}"; do
      echo "== bench_$b"
      # shellcheck disable=SC2086
      python3 -m "benchmarks.bench_$b" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$b.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    done
    slug=$(python3 -c "from benchmarks import harness; print(harness.gpu_slug())")
    python3 -m benchmarks._box3d_peer $(for b in "${benches[@]}"; do
      ls benchmarks/results/"$slug"/"$b"*.json 2>/dev/null; done) | tee "$OUT/mmcv_ratios.md"
    ;;
  profile)
    python3 -m benchmarks.profile_box3d --cases "${1:-.*}" 2>&1 | grep -v "^USDT" |
      tee "$OUT/profile_box3d.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    ;;
  *)
    sed -n '2,18p' "$0"
    exit 2
    ;;
esac
echo "box3d_gpu_session $stage: exit $status in $(($(date +%s) - start)) s (logs in $OUT)"
exit $status
