#!/usr/bin/env bash
# The GPU verification of the three LiDAR families (voxel: issue 10, 3D box: issue 12, sparse
# convolution: issue 11) in the fewest device calls: three stages, each inside one 10-minute
# command on the H200 (16 cores). A machine start costs minutes of device time, so run a stage
# per call and bring everything a stage needs:
#
#   carry: .whl (apache-tvm-ffi wheels), .peers/mmcv (mmcv's sources: ignored by git; not the
#          whole .peers once it holds spconv), mu_space/_lib
#          (prebuilt here: CUDA_ARCH=90a python build_utils.py --inplace; kept when current)
#   bash scripts/lidar_gpu_session.sh check      # ~8 min: build if stale, mmcv peers (background),
#                                                # every LiDAR test + contracts with -n 12, the
#                                                # strict self-check (every op native vs reference)
#   bash scripts/lidar_gpu_session.sh sanitize   # ~8 min: memcheck + racecheck (muSPACE's kernels
#                                                # only) over the three families' op tests
#   bash scripts/lidar_gpu_session.sh bench      # ~8 min: the LiDAR benchmarks (--quick unless
#                                                # BENCH_ARGS says otherwise) + the mmcv ratio tables
#
# spconv's side-by-side timing (benchmarks/bench_sparse_conv.py) needs .peers/spconv (~45 MB,
# ../shared/tools/spconv-kit.sh), which with the prebuilt library exceeds the 64 MiB a call
# carries: run it in a call that carries .peers/spconv and .whl but not mu_space/_lib (the
# library is then built there, ~3 min): `SPCONV=1 bash scripts/lidar_gpu_session.sh bench`.
#
# Every stage runs with MUSPACE_TRY_UNVERIFIED=1 (auto runs the unverified kernels). After a
# clean `check` and `sanitize`, clear the `unverified` marks (mu_space/ops/_voxel.py UNVERIFIED,
# _box3d.py UNVERIFIED, the three sparse OpDefs) and run `check` again without the variable.
# Logs and junit XML in $OUT (default ./gpu-out/lidar); benchmark JSON in benchmarks/results/.
# Env: OUT, CUDA_ARCH (default 90a), WORKERS (pytest-xdist, default 12), BENCH_ARGS, SPCONV.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in check | sanitize | bench) ;; *) sed -n '2,25p' "$0"; exit 2 ;; esac
OUT=${OUT:-$PWD/gpu-out/lidar}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=${MUSPACE_TRY_UNVERIFIED-1}
export CUDA_ARCH=${CUDA_ARCH:-90a}
WORKERS=${WORKERS:-12}
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site/tvm_ffi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

OP_TESTS=(tests/ops/test_voxelization.py tests/ops/test_dynamic_scatter.py
  tests/ops/test_pillar_scatter.py tests/ops/test_voxel_native_calls.py
  tests/ops/test_points_in_boxes.py tests/ops/test_boxes_overlap_bev.py tests/ops/test_nms3d.py
  tests/ops/test_circle_nms.py tests/ops/test_pcdet.py tests/ops/test_roiaware_pool3d.py
  tests/ops/test_roipoint_pool3d.py tests/ops/test_box3d_benchmarks.py
  tests/ops/test_sparse_rulebook.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_maxpool.py
  tests/ops/test_sparse_native.py tests/ops/test_sparse_native_calls.py
  tests/ops/test_sparse_native_model.py tests/sparse tests/compat tests/test_patcher_defaults.py
  tests/test_patcher_box3d.py tests/test_patcher_sparse.py tests/test_centerpoint_postprocess.py
  tests/test_sparse_encoder_recipe.py)
# the contract tests of the LiDAR ops (test ids carry the op name)
FAMILIES="voxel or scatter or segment or points_in_boxes or boxes_overlap_bev or boxes_iou_bev"
FAMILIES="$FAMILIES or box_iou_rotated or nms3d or nms_bev or circle_nms or box3d_nms_ordered"
FAMILIES="$FAMILIES or roiaware or roipoint or pcdet or sparse"
status=0
start=$(date +%s)

pytest_stage() {  # pytest_stage NAME ARGS...: one pytest run, log + junit in $OUT
  local name=$1
  shift
  python3 -m pytest -q -rfEs -p no:cacheprovider -n "$WORKERS" "$@" \
    --junitxml="$OUT/$name.xml" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$name.log" | cut -c1-240 | tail -n 25
  [ "$rc" -eq 0 ] || { echo "   $name: exit $rc (log $OUT/$name.log)"; status=1; }
}

case "${1:-}" in
  check)
    nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv | tee "$OUT/gpu.txt"
    python3 build_utils.py --inplace --if-stale -j "$(nproc)" >"$OUT/build.log" 2>&1 \
      || { tail -n 40 "$OUT/build.log"; exit 1; }
    tail -n 1 "$OUT/build.log"
    if [ -d .peers/mmcv ]; then  # mmcv's kernels for the bench stage, built while tests run
      (bash scripts/build_mmcv_voxel_peer.sh >"$OUT/peer_voxel.log" 2>&1
       bash scripts/build_mmcv_box3d_peer.sh >"$OUT/peer_box3d.log" 2>&1) &
    fi
    python3 -m mu_space --strict >"$OUT/selfcheck.txt" 2>&1 \
      || { echo "strict self-check failed (log $OUT/selfcheck.txt)"; status=1; }
    grep -E "native_sources_current|FAIL" "$OUT/selfcheck.txt" | head -n 10
    pytest_stage ops "${OP_TESTS[@]}"
    pytest_stage contracts tests/test_op_contracts.py -k "$FAMILIES"
    wait
    ls -la .peers/build/*.so 2>/dev/null
    cp .peers/build/*.so "$OUT/" 2>/dev/null || true  # carry them back next time: no rebuild
    ;;
  sanitize)
    bin=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
    for tool in memcheck racecheck; do
      extra=()
      [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
      echo "== compute-sanitizer $tool"
      PYTORCH_NO_CUDA_MEMORY_CACHING=$([ "$tool" = memcheck ] && echo 1 || echo 0) \
        MUSPACE_FUZZ_CASES=8 MUSPACE_FUZZ_SKIP=huge timeout "${SANITIZER_TIMEOUT:-220}" "$bin" \
        --tool "$tool" --error-exitcode 1 --kernel-name kns=muspace \
        ${extra[@]+"${extra[@]}"} python3 -m pytest -q -p no:cacheprovider \
        tests/ops/test_voxelization.py tests/ops/test_dynamic_scatter.py \
        tests/ops/test_pillar_scatter.py tests/ops/test_points_in_boxes.py \
        tests/ops/test_boxes_overlap_bev.py tests/ops/test_nms3d.py tests/ops/test_circle_nms.py \
        tests/ops/test_roiaware_pool3d.py tests/ops/test_roipoint_pool3d.py \
        tests/ops/test_sparse_native.py >"$OUT/sanitizer_$tool.log" 2>&1
      rc=$?
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/sanitizer_$tool.log" | tail -n 3
      [ "$rc" -eq 0 ] || { echo "   $tool: exit $rc (log $OUT/sanitizer_$tool.log)"; status=1; }
    done
    ;;
  bench)
    python3 build_utils.py --inplace --if-stale -j "$(nproc)" >"$OUT/build.log" 2>&1 \
      || { tail -n 40 "$OUT/build.log"; exit 1; }
    if [ "${SPCONV:-0}" = 1 ]; then
      bash .peers/spconv/install.sh && export PYTHONPATH=/tmp/peers:$PYTHONPATH
      benches=(sparse_conv)
    else
      benches=(voxelization dynamic_scatter pillar_scatter points_in_boxes boxes_overlap_bev nms3d
        roiaware_pool3d roipoint_pool3d)
    fi
    for b in "${benches[@]}"; do
      echo "== bench_$b"
      # shellcheck disable=SC2086
      python3 -m "benchmarks.bench_$b" ${BENCH_ARGS:---quick} >"$OUT/bench_$b.log" 2>&1 \
        || { echo "   bench_$b failed (log $OUT/bench_$b.log)"; status=1; }
      tail -n 4 "$OUT/bench_$b.log"
    done
    slug=$(python3 -c "from benchmarks import harness; print(harness.gpu_slug())")
    results() { for b in "$@"; do ls benchmarks/results/"$slug"/"$b"*.json 2>/dev/null; done; }
    if [ "${SPCONV:-0}" = 1 ]; then
      # shellcheck disable=SC2046
      python3 -m benchmarks._spconv_peer $(results sparse_conv) | tee "$OUT/spconv_ratios.md"
    else
      # shellcheck disable=SC2046
      python3 -m benchmarks._voxel_peer $(results voxelization dynamic_scatter) \
        | tee "$OUT/mmcv_voxel_ratios.md"
      # shellcheck disable=SC2046
      python3 -m benchmarks._box3d_peer $(results points_in_boxes boxes_overlap_bev nms3d \
        roiaware_pool3d roipoint_pool3d) | tee "$OUT/mmcv_box3d_ratios.md"
    fi
    ;;
esac
echo "lidar_gpu_session ${1}: exit $status in $(($(date +%s) - start)) s (logs in $OUT)"
exit "$status"
