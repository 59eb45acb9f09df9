#!/usr/bin/env bash
# Issue 14's H200 figures in ONE device call (<= 8 min wall): mmdet3d 1.4's own PointPillars and
# CenterPoint on mmcv-lite with muSPACE serving mmcv._ext, each through
# model_examples/_mmdet3d_run.py (native vs reference losses and gradients, 50 training steps,
# training-step and predict times) under its own time limit.
#
#   carry: .whl                  apache-tvm-ffi wheels (../shared/tools/gpu-wheels.sh), ~3.3 MB
#          .peers/mmdet3d-wheels the OpenMMLab kit (bash scripts/mmdet3d_wheels.sh), ~7.2 MB
#          mu_space/_lib         prebuilt here, ~24 MB: CUDA_ARCH=90a python build_utils.py
#                                --inplace -j 2 (rebuilt there when stale, ~3 min, which the
#                                time limits below then take from the models); or, 3.7 MB,
#                                .peers/muspace_lib.tar.xz (tar -cJf .peers/muspace_lib.tar.xz
#                                mu_space/_lib), unpacked here where mu_space/_lib is missing
#   command: bash scripts/mmdet3d_gpu_session.sh
#
# Writes to $OUT (default ./gpu-out/mmdet3d): session.log (everything printed), build.log,
# pointpillars.{json,md}, centerpoint.{json,md}: 6 files (a device call returns at most 8).
# A model cut short by its limit leaves the JSON of the stages it finished ("complete": false).
# Then paste the .md tables into model_examples/PointPillars/README.md and
# model_examples/CenterPoint/README.md ("On the H200") and commit the JSON under
# model_examples/results/h200/.
# Env: OUT, BUDGET (s for the whole script, default 450), PP_SHARE (% of what is left after the
# install and build check that PointPillars gets, default 35), RUN_ARGS (extra runner arguments,
# e.g. "--steps 60"), MUSPACE_TRY_UNVERIFIED (default 1: auto runs the kernels still marked
# unverified), OMP_NUM_THREADS (default 8), CUDA_ARCH (default 90a).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
OUT=${OUT:-$PWD/gpu-out/mmdet3d}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
tee_pid=$!
finish() { # session.log complete before the call returns
  exec >&- 2>&-
  wait "$tee_pid"
}
trap finish EXIT
export PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=${MUSPACE_TRY_UNVERIFIED-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} CUDA_ARCH=${CUDA_ARCH:-90a}
BUDGET=${BUDGET:-450}
PP_SHARE=${PP_SHARE:-35}
status=0

wheels=(.whl/*.whl .peers/mmdet3d-wheels/*.whl)
for w in "${wheels[@]}"; do
  [ -f "$w" ] || { echo "missing $w: carry .whl and .peers/mmdet3d-wheels (header)"; exit 1; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "${wheels[@]}" || exit 1
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ ! -f mu_space/_lib/libmuspace_native.so ] && [ -f .peers/muspace_lib.tar.xz ]; then
  tar -xJf .peers/muspace_lib.tar.xz || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, numpy, mmdet3d, mmcv, mmdet, mmengine, tvm_ffi; \
print('torch', torch.__version__, 'numpy', numpy.__version__, 'mmdet3d', mmdet3d.__version__, \
'mmcv', mmcv.__version__, 'mmdet', mmdet.__version__, 'mmengine', mmengine.__version__)" || exit 1

python3 build_utils.py --inplace --if-stale -j "$(nproc)" >"$OUT/build.log" 2>&1 \
  || { tail -n 40 "$OUT/build.log"; exit 1; }
tail -n 1 "$OUT/build.log"
python3 -c "import torch, mu_space.runtime.native as n; \
r = n.unavailable_reason(torch.device('cuda')); print('native library:', r or 'loaded'); \
raise SystemExit(1 if r else 0)" || exit 1

left=$((BUDGET - ($(date +%s) - start)))
pp=$((left * PP_SHARE / 100))
echo "== $left s left: pointpillars gets $pp s, centerpoint the rest"
run_model() { # run_model NAME LIMIT_S
  local name=$1 limit=$2 t0 rc
  t0=$(date +%s)
  echo "== $name (limit $limit s)"
  # shellcheck disable=SC2086
  timeout --signal=TERM --kill-after=10 "$limit" python3 model_examples/_mmdet3d_run.py \
    --model "$name" --out "$OUT" --frame-cache /tmp/mmdet3d-frames ${RUN_ARGS:-}
  rc=$?
  [ "$rc" -eq 124 ] && echo "   $name: cut at its $limit s limit (partial JSON in $OUT)"
  [ "$rc" -eq 0 ] || { echo "   $name: exit $rc"; status=1; }
  echo "   $name: $(($(date +%s) - t0)) s"
}
run_model pointpillars "$pp"
cp_limit=$((BUDGET - ($(date +%s) - start)))
run_model centerpoint $((cp_limit > 60 ? cp_limit : 60))
ls -la "$OUT"
echo "mmdet3d_gpu_session: exit $status in $(($(date +%s) - start)) s (files in $OUT)"
exit "$status"
