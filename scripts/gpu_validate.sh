#!/usr/bin/env bash
# GPU validation, one command, for a GPU machine without a package index:
#   bash scripts/gpu_validate.sh [--bench] [--bench-args "..."]
# 1. installs carried wheels from .whl/ (fetch them with ../shared/tools/gpu-wheels.sh) into
#    /tmp/site, 2. builds the native library in place with all cores (arch of the visible GPU
#    unless CUDA_ARCH is set), 3. runs the self-check (strict: native must be used), 4. runs
#    the whole test suite including GPU tests, 5. optionally the benchmarks.
# Logs and results go to $OUT (default ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
bench=0
bench_args=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1 ;;
    --bench-args) bench_args="$2"; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0

nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
python3 build_utils.py --inplace -j "$(nproc)" 2>&1 | tee "$OUT/build.log" || exit 1
echo "build wall time: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"

python3 -m mu_space --strict 2>&1 | tee "$OUT/selfcheck.txt" || status=1

python3 -m pytest -q -rs -p no:cacheprovider tests --junitxml="$OUT/pytest.xml" 2>&1 \
  | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "$bench" = 1 ]; then
  for b in benchmarks/bench_*.py; do
    name=$(basename "$b" .py)
    echo "== $name"
    python3 -m "benchmarks.$name" --out "$OUT/results" $bench_args 2>&1 | tee "$OUT/$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
echo "gpu_validate: exit $status"
exit $status
