#!/usr/bin/env bash
# The GPU verification of the three LiDAR families (voxel: issue 10, 3D box: issue 12, sparse
# convolution: issue 11) in the fewest device calls. A machine start costs ~30 s of device time
# and a call may run 10 minutes, so bring everything a stage needs:
#
#   carry: .whl (apache-tvm-ffi wheels), .peers/mmcv (mmcv's sources: ignored by git; not the
#          whole .peers once it holds spconv), mu_space/_lib
#          (prebuilt here: CUDA_ARCH=90a python build_utils.py --inplace; kept when current)
#   bash scripts/lidar_gpu_session.sh check      # ~2 min: build if stale, the strict self-check,
#                                                # every LiDAR test file and the LiDAR contract
#                                                # tests (two pytest runs side by side)
#   bash scripts/lidar_gpu_session.sh sanitize   # ~5 min: memcheck and racecheck (muSPACE's
#                                                # kernels only) over each family's native tests,
#                                                # one process per SANITIZE_JOBS entry (default:
#                                                # six, TOOL:FAMILY), side by side; mmcv's peer kernels
#                                                # build meanwhile (for bench in the same call; the
#                                                # .so files come back in the tarball: unpack them
#                                                # into .peers/build to carry them next time)
#   bash scripts/lidar_gpu_session.sh bench      # ~4 min: the LiDAR benchmarks (--quick --reps
#                                                # 100 unless BENCH_ARGS says otherwise) + the mmcv
#                                                # ratio tables; the results' JSON in the tarball
#   bash scripts/lidar_gpu_session.sh all        # check, sanitize, bench in one call (~10 min)
#
# Measured on the H200 (2026-12-01): the whole LiDAR suite takes ~55 s with the thread settings
# below; without them (every pytest worker's torch starting 16 threads on 16 cores) it did not
# finish in 8 minutes. Each test's outcome and every failure's traceback are appended to
# $OUT/<stage>_tests.txt as they happen (tests/conftest.py, MUSPACE_TEST_LOG), so a stage cut off
# by its time limit still says what failed; --timeout (pytest-timeout) bounds each test.
#
# The prebuilt library (25 MB) packs into 3.7 MB: `tar -cJf .peers/muspace_lib.tar.xz
# mu_space/_lib` here, carry .peers/muspace_lib.tar.xz instead of mu_space/_lib, and the script
# unpacks it where mu_space/_lib is missing. That leaves room in the 64 MiB a call carries for
# spconv's side-by-side timing (benchmarks/bench_sparse_conv.py), which needs .peers/spconv
# (~45 MB, ../shared/tools/spconv-kit.sh): `SPCONV=1 bash scripts/lidar_gpu_session.sh bench`.
#
# Every stage runs with MUSPACE_TRY_UNVERIFIED=1 (auto runs the unverified kernels). After a
# clean `check` and `sanitize`, clear the `unverified` marks and run `check` again without the
# variable (the voxel and sparse marks were cleared on 2026-12-01; mu_space/ops/_box3d.py
# UNVERIFIED is left: SANITIZE_JOBS="racecheck:nms_rest racecheck:pooling" with a longer
# SANITIZER_LIMIT is what it still needs).
# Logs, junit XML, benchmark JSON (results/) and the peers' .so packed into $OUT/lidar_<stage>.tar.gz
# ($OUT default ./gpu-out/lidar); benchmark JSON also in benchmarks/results/.
# Env: OUT, CUDA_ARCH (default 90a), BENCH_ARGS, SPCONV, TEST_TIMEOUT (per test, default 120 s),
# STAGE_LIMIT, SANITIZER_LIMIT, BENCH_LIMIT, PROFILE_LIMIT (s: a pytest stage, a sanitizer, a
# benchmark, the sparse encoder profile), SANITIZE_JOBS (e.g. "memcheck:nms racecheck:scatter"),
# CHECK_TESTS / CHECK_FAMILIES (the check stage's op test files / contract -k instead of all the
# LiDAR ones), BENCHES (the bench stage's benchmark names).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in check | sanitize | bench | all) ;; *) sed -n '2,40p' "$0"; exit 2 ;; esac
# A device call brings back at most 8 files from $OUT: every log, junit XML, JSON and peer .so
# goes to a work folder that is packed into one $OUT/lidar_<stage>.tar.gz on exit.
FINAL=${OUT:-$PWD/gpu-out/lidar}
OUT=$(mktemp -d /tmp/lidar-XXXXXX)
mkdir -p "$FINAL"
STAGE=$1
# STAGE, not $1: a trap that fires inside a function (a stage cut off by `timeout`) sees the
# function's positional parameters, and with set -u an unset $1 lost the whole tarball
# (H200, 2026-12-01)
trap 'tar -czf "$FINAL/lidar_$STAGE.tar.gz" -C "$OUT" . && echo "logs packed: $FINAL/lidar_$STAGE.tar.gz"' EXIT
export PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=${MUSPACE_TRY_UNVERIFIED-1} OMP_NUM_THREADS=1
export CUDA_ARCH=${CUDA_ARCH:-90a}
TEST_TIMEOUT=${TEST_TIMEOUT:-120}
TIMEOUT_ARGS=()  # pytest-timeout is on the GPU image; elsewhere the stage limits alone
python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout "$TEST_TIMEOUT")
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site/tvm_ffi ] \
  && ! python3 -c "import tvm_ffi" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
if [ ! -f mu_space/_lib/libmuspace_native.so ] && [ -f .peers/muspace_lib.tar.xz ]; then
  tar -xJf .peers/muspace_lib.tar.xz || exit 1
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
  tests/ops/test_sparse_native_model.py tests/ops/test_sparse_im2col.py tests/sparse tests/compat
  tests/test_patcher_defaults.py
  tests/test_patcher_box3d.py tests/test_patcher_sparse.py tests/test_centerpoint_postprocess.py
  tests/test_sparse_encoder_recipe.py)
# the contract tests of the LiDAR ops (test ids carry the op name)
FAMILIES="voxel or scatter or segment or points_in_boxes or boxes_overlap_bev or boxes_iou_bev"
FAMILIES="$FAMILIES or box_iou_rotated or nms3d or nms_bev or circle_nms or box3d_nms_ordered"
FAMILIES="$FAMILIES or roiaware or roipoint or pcdet or sparse"
[ -n "${CHECK_TESTS:-}" ] && read -ra OP_TESTS <<<"$CHECK_TESTS"
FAMILIES=${CHECK_FAMILIES:-$FAMILIES}
status=0
start=$(date +%s)

pytest_stage() {  # pytest_stage NAME WORKERS ARGS...: one pytest run in the background
  local name=$1 workers=$2
  shift 2
  MUSPACE_TEST_LOG="$OUT/${name}_tests.txt" timeout -s INT -k 20 "${STAGE_LIMIT:-300}" \
    python3 -m pytest -q -rfE -p no:cacheprovider -n "$workers" ${TIMEOUT_ARGS[@]+"${TIMEOUT_ARGS[@]}"} "$@" \
    --junitxml="$OUT/$name.xml" >"$OUT/$name.log" 2>&1
}

summary() {  # summary NAME...: counts and failures of finished pytest stages
  local name
  for name in "$@"; do
    echo "== $name: $(tail -n 1 "$OUT/$name.log" | cut -c1-200)"
    grep -E "^failed" "$OUT/${name}_tests.txt" 2>/dev/null | head -n 25
    grep -qE "^failed" "$OUT/${name}_tests.txt" 2>/dev/null && status=1
    grep -qE " (passed|failed)" "$OUT/$name.log" || status=1  # cut off or crashed
  done
}

build() {
  python3 build_utils.py --inplace --if-stale -j "$(nproc)" >"$OUT/build.log" 2>&1 \
    || { tail -n 40 "$OUT/build.log"; exit 1; }
  tail -n 1 "$OUT/build.log"
}

stage_check() {
  nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv | tee "$OUT/gpu.txt"
  build
  timeout 120 python3 -m mu_space --strict >"$OUT/selfcheck.txt" 2>&1 \
    || { echo "strict self-check failed (log $OUT/selfcheck.txt)"; status=1; }
  grep -E "native_sources_current|FAIL|self-check:" "$OUT/selfcheck.txt" | head -n 10
  pytest_stage ops 9 "${OP_TESTS[@]}" &
  pytest_stage contracts 6 tests/test_op_contracts.py -k "$FAMILIES" &
  wait
  summary ops contracts
}

# The sanitizer jobs, TOOL:GROUP each, one compute-sanitizer process per job, all side by side.
# A group is a family's native test files or a part of them (a family too slow for one process's
# limit splits: on the H200, 2026-12-01, memcheck of all box3d files passed 25 of 37 tests in
# 290 s, racecheck of the voxel files 42 of 114).
SANITIZE_JOBS=${SANITIZE_JOBS:-memcheck:voxel racecheck:voxel memcheck:box3d racecheck:box3d memcheck:sparse racecheck:sparse}
group_files() {  # group_files GROUP: the test files of a sanitizer group
  local t=tests/ops/test_
  case $1 in
    voxel) echo "${t}voxelization.py ${t}dynamic_scatter.py ${t}pillar_scatter.py" ;;
    voxelization) echo "${t}voxelization.py" ;;
    scatter | scatter_a | scatter_b | scatter_small | scatter_fused_padded)
      echo "${t}dynamic_scatter.py ${t}pillar_scatter.py" ;;
    box3d) echo "${t}points_in_boxes.py ${t}boxes_overlap_bev.py ${t}nms3d.py ${t}circle_nms.py" \
      "${t}roiaware_pool3d.py ${t}roipoint_pool3d.py" ;;
    nms | nms_rest | nms_quick) echo "${t}nms3d.py" ;;
    pairs) echo "${t}boxes_overlap_bev.py ${t}circle_nms.py" ;;
    pooling) echo "${t}points_in_boxes.py ${t}roiaware_pool3d.py ${t}roipoint_pool3d.py" ;;
    pib) echo "${t}points_in_boxes.py" ;;
    roi) echo "${t}roiaware_pool3d.py ${t}roipoint_pool3d.py" ;;
    sparse | sparse_gemm* | sparse_rulebook | sparse_order*) echo "${t}sparse_native.py" ;;
    pillar | pillar_tiled | pillar_tiled_small | pillar_kept) echo "${t}pillar_scatter.py" ;;
    # the BEV family's kernels (issue 13), outside the LiDAR suite but on the same sanitizer run
    bev | bev_mem | bev_race) echo "${t}bev_pool_v2.py ${t}bev_pool.py" ;;
    msda_mem | msda_race) echo "${t}multi_scale_deformable_attn.py" ;;  # MSDA backward modes
    *) echo "unknown sanitizer group $1" >&2; return 1 ;;
  esac
}
# a group's -k clause (with "native and not int32"): dynamic_scatter's 55 native cases split by
# dtype for memcheck (228 s in one process on the H200, 2026-12-01); scatter_small, for
# racecheck, leaves out the two 300k-point configs (racecheck looks for shared-memory hazards
# inside a block, which the small clouds reach as well; 10-17 s per large case there)
group_k() {
  case $1 in
    scatter_a) echo "dtype0 or dtype1" ;;
    scatter_b) echo "not dtype0 and not dtype1" ;;
    scatter_small) echo "not centerpoint and not pointpillars-nus" ;;
    # dynamic_scatter's one-call forward and dynamic_scatter_padded (small-cloud tests)
    scatter_fused_padded) echo "(fused or padded) and not centerpoint and not graph" ;;
    # pillar_scatter's one-launch forward; _small (racecheck) on the tiny canvas only
    pillar_tiled) echo "tiled" ;;
    pillar_tiled_small) echo "tiled and not pointpillars" ;;
    # the cell map kept between calls (tags, the wrap) and the entry point's map_tag
    pillar_kept) echo "kept or tags" ;;
    # the nms3d cases a 240-s racecheck run had not reached (H200, 2026-12-01)
    nms_rest) echo "box_limit or workspace or visits" ;;
    nms_quick) echo "not box_limit" ;;  # racecheck of the 196608-box case alone exceeded 150 s
    # the BEV kernels of issue 13 (bev_pool_v2's forward staging and frustum backward,
    # bev_pool's cells / runs / row gradient) without the full config x dtype x channel matrix
    # and the 1.8M-point BEVFusion cases, which a sanitizer cannot finish in one call's time
    bev_mem) echo "(frustum or lane_layouts or padded or aligned or out_of_range or edge or cells" \
      "or row_grad or sort_runs or prepared) and not bevfusion" ;;
    bev_race) echo "(lane_layouts or frustum_backward_writes or out_of_range or row_grad" \
      "or sort_runs or prepared) and not bevfusion" ;;
  esac
}

# a group's whole -k, for test files whose GPU tests are not all named "native": the MSDA
# backward modes 3 / 4 (issue 13) on the bad-metadata cases and the merged-atomic layouts with
# the most sharing (memcheck), and the warp-merge cases of head dim 32 (racecheck)
group_full_k() {
  case $1 in
    msda_mem) echo "bad_level or (merged and (half-outside or same-query) and (32-0 or 24-0" \
      "or 128-0))" ;;
    msda_race) echo "merged and 32-0 and (float32-3 or float16-3 or float32-4)" ;;
    # sparse_conv_implicit_gemm / _wgrad's tests (issue 11); racecheck split: on the H200
    # (2026-12-02) it stopped with "Internal Sanitizer Error: failed to handle a hardware
    # exception" at the bfloat16 bit-exactness case (memcheck of the same tests: 0 errors)
    sparse_gemm) echo "implicit" ;;
    sparse_gemm_rest) echo "implicit and not (bit_exact and dtype1)" ;;
    sparse_gemm_bf16) echo "bit_exact and dtype1 and implicit" ;;
    sparse_gemm_bf16_im2col) echo "bit_exact and dtype1 and im2col" ;;
    # the implicit GEMM tests the 170-s racecheck of sparse_gemm_rest had not reached
    sparse_gemm_gentry) echo "implicit_gemm_entry" ;;
    sparse_gemm_wentry) echo "implicit_wgrad_entry" ;;
    sparse_gemm_wide) echo "implicit_gemm_conv_matches and (64-128 or 20-70 or 3-1)" ;;
    # the tensor-core kernel (16-bit sparse_conv_implicit_gemm on CUDA sm_80+): its entry-point
    # cases (dtype0 there is float32), the default-choice conv cases and the bit-exact one
    # (memcheck; racecheck of the default-choice cases, whose weight gradient is cuBLAS's 16-bit
    # GEMM, stopped at the first with "Internal Sanitizer Error: The Sanitizer failed to handle a
    # hardware exception" on the H200, 2026-12-03, as the im2col bfloat16 case did on 2026-12-02)
    sparse_gemm_tc) echo "(implicit_gemm_entry and (dtype1 or dtype2)) or tensor_core_gemm" ;;
    # racecheck of the tensor-core kernel without cuBLAS: its entry-point cases, the conv cases
    # with every GEMM implicit (16-bit forward and input gradient on the tensor cores, the SIMT
    # weight gradient) and the bfloat16 bit-exactness case of that path
    sparse_gemm_tc_entry) echo "implicit_gemm_entry and (dtype1 or dtype2)" ;;
    sparse_gemm_tc_conv) echo "implicit_gemm_conv_matches and (dtype1 or dtype2)" ;;
    sparse_gemm_tc_exact) echo "bit_exact and dtype1 and implicit" ;;
    # the rule-book kernels on both output-site paths (bitmap, sort), errors and empty inputs
    sparse_rulebook) echo "rulebook or empty_inputs or raises_the_reference" ;;
    # the implicit GEMMs' per-tile offset lists and row orders (2026-12-03): the row-order entry
    # point, the entry points with and without an order, the conv cases in both orders
    sparse_order) echo "row_order or (implicit_gemm_entry and True)" ;;
    sparse_order_race) echo "row_order_entry or (implicit_gemm_entry and True)" ;;
  esac
}

# the native tests under the sanitizers, less the > 2^31-element canvas (~25 GB, minutes there)
sanitize_one() {  # sanitize_one TOOL FAMILY TESTS...: one compute-sanitizer process
  local tool=$1 family=$2 bin extra=() k="native and not int32"
  shift 2
  [ -n "$(group_k "$family")" ] && k="$k and ($(group_k "$family"))"
  [ -n "$(group_full_k "$family")" ] && k=$(group_full_k "$family")
  bin=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  MUSPACE_TEST_LOG="$OUT/sanitize_${tool}_${family}_tests.txt" \
    PYTORCH_NO_CUDA_MEMORY_CACHING=$([ "$tool" = memcheck ] && echo 1 || echo 0) \
    MUSPACE_FUZZ_CASES=8 MUSPACE_FUZZ_SKIP=huge timeout -s INT -k 20 "${SANITIZER_LIMIT:-270}" \
    "$bin" --tool "$tool" --error-exitcode 1 --kernel-name kns=muspace \
    ${extra[@]+"${extra[@]}"} python3 -m pytest -q -p no:cacheprovider -k "$k" \
    ${TIMEOUT_ARGS[@]+"${TIMEOUT_ARGS[@]}"} "$@" >"$OUT/sanitizer_${tool}_${family}.log" 2>&1
  local rc=$?
  echo "$rc" >"$OUT/sanitizer_${tool}_${family}.rc"
  echo "   $tool $family: exit $rc ($(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" \
    "$OUT/sanitizer_${tool}_${family}.log" | tail -n 1); $(grep -E " passed| failed" \
    "$OUT/sanitizer_${tool}_${family}.log" | tail -n 1))"
}

stage_sanitize() {
  if [ -d .peers/mmcv ] && [ ! -f .peers/build/mmcv_box3d_peer.so ]; then
    (bash scripts/build_mmcv_voxel_peer.sh >"$OUT/peer_voxel.log" 2>&1
     bash scripts/build_mmcv_box3d_peer.sh >"$OUT/peer_box3d.log" 2>&1) &
    peers=$!
  fi
  local job files pids=()
  for job in $SANITIZE_JOBS; do
    files=$(group_files "${job#*:}") || { status=1; continue; }
    # shellcheck disable=SC2086
    sanitize_one "${job%%:*}" "${job#*:}" $files & pids+=($!)
  done
  wait "${pids[@]}"
  grep -LE "ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards" "$OUT"/sanitizer_*.log \
    | sed 's/^/   not clean: /' | grep . && status=1
  grep -lv "^0$" "$OUT"/sanitizer_*.rc 2>/dev/null | sed 's/^/   exit != 0: /' | grep . && status=1
  ls -la .peers/build/*.so 2>/dev/null
  cp .peers/build/*.so "$OUT/" 2>/dev/null || true  # carry them back next time: no rebuild
}

bench_limit() {  # bench_limit NAME: its time limit (s); BENCH_LIMIT overrides every one
  [ -n "${BENCH_LIMIT:-}" ] && { echo "$BENCH_LIMIT"; return; }
  case $1 in
    # with mmcv's peer built, its deterministic hard voxelization takes ~107 ms a call: 105 calls
    # x 3 configs ~ 35 s on top of ours (40 s was too short on the H200, 2026-12-01)
    voxelization) echo 180 ;;
    dynamic_scatter | sparse_conv) echo 120 ;;
    *) echo 90 ;;
  esac
}

stage_bench() {
  build
  local b benches slug
  if [ "${SPCONV:-0}" = 1 ]; then
    bash .peers/spconv/install.sh && export PYTHONPATH=/tmp/peers:$PYTHONPATH
    benches=(sparse_conv)
  else
    benches=(voxelization dynamic_scatter pillar_scatter points_in_boxes boxes_overlap_bev nms3d
      roiaware_pool3d roipoint_pool3d)
    [ -n "${BENCHES:-}" ] && read -ra benches <<<"$BENCHES"
  fi
  for b in "${benches[@]}"; do
    # shellcheck disable=SC2086
    timeout "$(bench_limit "$b")" python3 -m "benchmarks.bench_$b" ${BENCH_ARGS:---quick --reps 100} \
      >"$OUT/bench_$b.log" 2>&1 || { echo "   bench_$b failed (log $OUT/bench_$b.log)"; status=1; }
    grep -E "MISSED|MET|FAILED" "$OUT/bench_$b.log" | cut -c1-160
  done
  slug=$(python3 -c "from benchmarks import harness; print(harness.gpu_slug())")
  mkdir -p "$OUT/results"
  results() { for b in "$@"; do ls benchmarks/results/"$slug"/"$b"*.json 2>/dev/null; done; }
  # shellcheck disable=SC2046
  cp $(results "${benches[@]}") "$OUT/results/" 2>/dev/null
  if [ "${SPCONV:-0}" = 1 ]; then
    # shellcheck disable=SC2046
    python3 -m benchmarks._spconv_peer $(results sparse_conv) | tee "$OUT/spconv_ratios.md"
    timeout "${PROFILE_LIMIT:-120}" python3 -m benchmarks.profile_sparse_encoder --out "$OUT" \
      >"$OUT/profile_sparse_encoder.md" 2>&1 || status=1  # where the encoder's time goes
  else
    # shellcheck disable=SC2046
    python3 -m benchmarks._voxel_peer $(results voxelization dynamic_scatter) \
      | tee "$OUT/mmcv_voxel_ratios.md"
    # shellcheck disable=SC2046
    python3 -m benchmarks._box3d_peer $(results points_in_boxes boxes_overlap_bev nms3d \
      roiaware_pool3d roipoint_pool3d) | tee "$OUT/mmcv_box3d_ratios.md"
  fi
}

case "${1:-}" in
  check) stage_check ;;
  sanitize)
    stage_sanitize
    [ -n "${peers:-}" ] && wait "$peers"
    ;;
  bench) stage_bench ;;
  all)
    stage_check
    stage_sanitize
    [ -n "${peers:-}" ] && wait "$peers"
    stage_bench
    ;;
esac
echo "lidar_gpu_session ${1}: exit $status in $(($(date +%s) - start)) s"
exit "$status"
