#!/usr/bin/env bash
# GPU validation, one command, for a GPU machine without a package index:
#   [PYTEST_ARGS="-n 8"] bash scripts/gpu_validate.sh [--bench] [--bench-args "..."] [--no-sanitizer]
# 1. installs carried wheels from .whl/ (fetch them as the README's "GPU validation" says) into
#    /tmp/site, 2. builds the native library in place with all cores (arch of the visible GPU
#    unless CUDA_ARCH is set), 3. runs the self-check (strict: native must be used), 4. runs
#    the whole test suite including GPU tests, 5. compute-sanitizer memcheck + racecheck over a
#    small subset (the strict self-check, the contract fuzz tests with 20 cases; on by default,
#    --no-sanitizer skips it), 6. optionally the benchmarks.
# A library prebuilt here (CUDA_ARCH=90a python build_utils.py --inplace) and carried
# (`mu_space/_lib`) is kept when it is current (--if-stale: same csrc/ digest and archs).
# Logs and results go to $OUT (default ./gpu-out); sanitizer logs are $OUT/sanitizer_*.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
bench=0
bench_args=""
sanitizer=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1 ;;
    --bench-args) bench_args="$2"; shift ;;
    --no-sanitizer) sanitizer=0 ;;
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
python3 build_utils.py --inplace --if-stale -j "$(nproc)" 2>&1 | tee "$OUT/build.log" || exit 1
echo "build wall time: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"

python3 -m mu_space --strict 2>&1 | tee "$OUT/selfcheck.txt" || status=1

# PYTEST_ARGS: extra pytest arguments, e.g. "-n 8" (pytest-xdist) to spread the suite over cores
python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} tests --junitxml="$OUT/pytest.xml" 2>&1 \
  | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# compute-sanitizer over our kernels only (--kernel-name: torch's kernels run uninstrumented,
# which keeps the stage to a few minutes). memcheck without torch's caching allocator, so an
# out-of-bounds access hits unallocated memory instead of a neighbouring cached block.
sanitize() {  # sanitize TOOL NAME COMMAND...: one run, log $OUT/sanitizer_TOOL_NAME.log
  local tool=$1 name=$2
  shift 2
  local log="$OUT/sanitizer_${tool}_${name}.log" extra=()
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  echo "== compute-sanitizer $tool: $*"
  PYTORCH_NO_CUDA_MEMORY_CACHING=$([ "$tool" = memcheck ] && echo 1 || echo 0) \
    timeout "${SANITIZER_TIMEOUT:-600}" "$sanitizer_bin" --tool "$tool" --error-exitcode 1 \
    --kernel-name kns=muspace ${extra[@]+"${extra[@]}"} "$@" >"$log" 2>&1
  local rc=$?
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1 | sed "s/^/   $tool $name: /"
  if [ "$rc" -eq 5 ] && grep -q "no tests ran\|deselected" "$log"; then
    echo "   $tool $name: no test selected (pytest exit 5): skipped"
  elif [ "$rc" -ne 0 ]; then
    echo "   $tool $name: exit $rc (log: $log)"
    tail -n 20 "$log" | sed 's/^/   | /'
    status=1
  fi
}
if [ "$sanitizer" = 1 ]; then
  sanitizer_bin=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  if [ ! -x "$sanitizer_bin" ]; then
    echo "== compute-sanitizer not found (PATH, \$CUDA_HOME/bin): sanitizer stage skipped"
  else
    start=$(date +%s)
    for tool in memcheck racecheck; do
      sanitize "$tool" selfcheck python3 -m mu_space --strict
      if [ -f tests/test_op_contracts.py ]; then
        # "huge" size arguments are skipped: their allocation failure is an API error to the tool
        sanitize "$tool" fuzz env MUSPACE_FUZZ_CASES=20 MUSPACE_FUZZ_SKIP=huge \
          python3 -m pytest -q -x -p no:cacheprovider tests/test_op_contracts.py -k fuzz
      else
        echo "   $tool fuzz: skipped (tests/test_op_contracts.py does not exist yet)"
      fi
    done
    echo "sanitizer stage: $(( $(date +%s) - start )) s" | tee "$OUT/sanitizer_time.txt"
  fi
fi

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
