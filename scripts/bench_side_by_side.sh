#!/usr/bin/env bash
# Old vs new build, every benchmark, side by side in ONE GPU session, on a GPU machine without a
# package index (as scripts/gpu_validate.sh):
#
#   bash scripts/bench_side_by_side.sh OLD_TREE NEW_TREE OUTDIR [bench ...]
#
#   bench: copy_bandwidth overhead bev_pool_v2 bev_pool_prepare bev_pool bev_pool_v3
#          multi_scale_deformable_attn (the default: all seven, in this order)
#   OLD_TREE: e.g. `git archive a51d718 | tar -x -C old-tree`; NEW_TREE: e.g. `.`
#
# 1. installs the carried wheels (WHEELS, default NEW_TREE/.whl: apache-tvm-ffi, from
#    the README's "GPU validation" download) into /tmp/site;
# 2. builds the native library in both trees at once (`python3 build_utils.py --inplace -j`,
#    CUDA_ARCH=90a unless set; each build compiles its 4 sources in parallel);
# 3. runs each benchmark RUNS times per tree, interleaved (old, new, old, new), so clock and
#    thermal drift hit both, with PYTHONPATH (and the working directory) on that tree; JSON per
#    tree, run and bench under OUTDIR/{old,new}/run<i>/<bench>/, logs under OUTDIR/logs/;
# 4. writes OUTDIR/compare.md: `python3 -m benchmarks.compare` per bench (old / new medians,
#    new/old, noise band from this run's own spread, same / faster / SLOWER; the committed
#    median of NEW_TREE/benchmarks/results/h200/<bench>.json as a last column).
#
# Each tree gets only flags it knows. Trees whose harness has --smoke (this one) run
# `--quick --reps $REPS --warmup 5` (model cases, no size sweeps); older trees (a51d718: --quick
# there means 10 reps and fewer configs) run `--reps $REPS --warmup 5 --cases '^(?!sweep-)'`,
# which selects the same cases. bench_overhead gets `--calls 5000 --trials 5` in both.
#
# Environment: RUNS (runs per tree per bench, default 2), REPS (timed reps per case, default 30),
# CUDA_ARCH (default 90a), SKIP_BUILD=1 (trees already built), OLD_COMMIT / NEW_COMMIT (labels
# stored as git_commit in the JSON; default: the tree's git HEAD, else its folder name), WHEELS,
# BUDGET_S (stop starting runs when the next one, as long as the last, would end past this many
# seconds since the start; compare.md is still written; default: no limit).
#
# Time estimate, H200 with 16 cores, defaults (RUNS=2, REPS=30): from the committed results
# (benchmarks/results/h200/*.json: per case median x (reps + warm-up), reference included, plus
# ~0.6 ms per timed rep for the L2 flush and the GPU spacer) and the file times of the committed
# session (~10-15 s per process for imports, CUDA start, inputs and checks):
#   bench                         one run   4 runs
#   copy_bandwidth                   ~7 s     ~30 s
#   overhead (torch.compile)        ~20 s     ~80 s
#   bev_pool_v2                     ~15 s     ~60 s
#   bev_pool_prepare                ~12 s     ~50 s
#   bev_pool                        ~13 s     ~55 s
#   bev_pool_v3                     ~12 s     ~50 s
#   multi_scale_deformable_attn     ~30 s    ~120 s
#   benchmarks                                ~7.5 min
#   + both builds in parallel ~1.5-2 min + wheels and import checks ~20 s  =>  ~9.5-10 min.
# A machine that allows 10 minutes per command: two calls on the same warm machine (the second
# reuses both builds, which stay in the trees' ignored mu_space/_lib/):
#   BUDGET_S=560 bash scripts/bench_side_by_side.sh OLD NEW OUT/a copy_bandwidth overhead \
#       bev_pool_v2 bev_pool_prepare                                           (~6 min)
#   BUDGET_S=560 SKIP_BUILD=1 bash scripts/bench_side_by_side.sh OLD NEW OUT/b bev_pool \
#       bev_pool_v3 multi_scale_deformable_attn                                (~4 min)
# Over budget: RUNS=1 (~4 min of benchmarks; the band then rests on p10-p90 and the 2% floor),
# or name fewer benches.
set -uo pipefail

if [ $# -lt 3 ]; then
  sed -n '2,12p' "$0"
  exit 2
fi
OLD=$(cd "$1" && pwd) || exit 2
NEW=$(cd "$2" && pwd) || exit 2
mkdir -p "$3" || exit 2
OUTDIR=$(cd "$3" && pwd)
shift 3
BENCHES=("$@")
[ ${#BENCHES[@]} -gt 0 ] || BENCHES=(copy_bandwidth overhead bev_pool_v2 bev_pool_prepare bev_pool
  bev_pool_v3 multi_scale_deformable_attn)
RUNS=${RUNS:-2}
REPS=${REPS:-30}
export CUDA_ARCH=${CUDA_ARCH:-90a}
export PYTHONUNBUFFERED=1
WHEELS=${WHEELS:-$NEW/.whl}
SITE=/tmp/site
mkdir -p "$OUTDIR/logs"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUTDIR/side_by_side.log"; }

label() {  # $1 tree, $2 explicit label
  if [ -n "$2" ]; then echo "$2"
  elif [ -e "$1/.git" ]; then git -C "$1" rev-parse --short HEAD 2>/dev/null || basename "$1"
  else basename "$1"
  fi
}
OLD_LABEL=$(label "$OLD" "${OLD_COMMIT:-}")
NEW_LABEL=$(label "$NEW" "${NEW_COMMIT:-}")

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv | tee "$OUTDIR/gpu.txt"
say "old: $OLD ($OLD_LABEL); new: $NEW ($NEW_LABEL); benches: ${BENCHES[*]}; runs $RUNS, reps $REPS"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  for side in old new; do
    tree=$OLD; [ "$side" = new ] && tree=$NEW
    (cd "$tree" && PYTHONPATH="$tree:$SITE" python3 build_utils.py --inplace -j "$(nproc)") \
      >"$OUTDIR/logs/build-$side.log" 2>&1 &
    eval "build_$side=$!"
  done
  status=0
  wait "$build_old" || { say "old build failed: $OUTDIR/logs/build-old.log"; status=1; }
  wait "$build_new" || { say "new build failed: $OUTDIR/logs/build-new.log"; status=1; }
  [ $status = 0 ] || { tail -20 "$OUTDIR"/logs/build-*.log; exit 1; }
  say "both builds done"
fi

for side in old new; do  # each tree must import its own mu_space, with its native library
  tree=$OLD; [ "$side" = new ] && tree=$NEW
  (cd "$tree" && PYTHONPATH="$tree:$SITE" python3 -c "
import os, sys, torch, mu_space
from mu_space.runtime import native
where = os.path.realpath(mu_space.__file__)
assert where.startswith(os.path.realpath('$tree') + os.sep), f'mu_space from {where}'
reason = native.unavailable_reason(torch.device('cuda', 0))
assert reason is None, reason
print('$side: mu_space', where)") || exit 1
done

flags() {  # $1 tree, $2 bench -> the flags that tree's script knows
  if [ "$2" = overhead ]; then
    echo "--calls 5000 --trials 5"
  elif grep -q -- '"--smoke"' "$1/benchmarks/harness.py"; then
    echo "--quick --reps $REPS --warmup 5"
  else
    echo "--reps $REPS --warmup 5 --cases ^(?!sweep-)"
  fi
}

failed=()
skipped=()
last=60
for bench in "${BENCHES[@]}"; do
  for run in $(seq 1 "$RUNS"); do
    for side in old new; do
      if [ "${BUDGET_S:-0}" -gt 0 ] && [ $(( $(date +%s) - t0 + last )) -gt "$BUDGET_S" ]; then
        skipped+=("$bench/$side/run$run")
        continue
      fi
      tree=$OLD; lab=$OLD_LABEL
      [ "$side" = new ] && { tree=$NEW; lab=$NEW_LABEL; }
      dir="$OUTDIR/$side/run$run/$bench"
      rm -rf "$dir"
      mkdir -p "$dir"
      read -r -a extra <<<"$(flags "$tree" "$bench")"
      start=$(date +%s)
      (cd "$tree" && PYTHONPATH="$tree:$SITE" MUSPACE_GIT_COMMIT="$lab" timeout 600 \
        python3 -m "benchmarks.bench_$bench" "${extra[@]}" --out "$dir") \
        >"$OUTDIR/logs/$bench.$side.run$run.log" 2>&1
      rc=$?
      last=$(( $(date +%s) - start ))
      [ $rc = 0 ] || failed+=("$bench/$side/run$run (exit $rc)")
      say "$bench $side run $run: exit $rc, $last s"
    done
  done
done

: >"$OUTDIR/compare.md"
for bench in "${BENCHES[@]}"; do
  old_files=("$OUTDIR"/old/run*/"$bench"/*.json)
  new_files=("$OUTDIR"/new/run*/"$bench"/*.json)
  if [ ! -e "${old_files[0]}" ] || [ ! -e "${new_files[0]}" ]; then
    printf '### %s\n\nno results on one side (see logs/%s.*.log)\n\n' "$bench" "$bench" \
      >>"$OUTDIR/compare.md"
    continue
  fi
  committed=()
  [ -f "$NEW/benchmarks/results/h200/$bench.json" ] &&
    committed=(--committed "$NEW/benchmarks/results/h200/$bench.json")
  (cd "$NEW" && python3 -m benchmarks.compare --old "${old_files[@]}" --new "${new_files[@]}" \
    "${committed[@]}" --title "$bench") >>"$OUTDIR/compare.md"
done
cat "$OUTDIR/compare.md"
say "done; tables in $OUTDIR/compare.md"
[ ${#skipped[@]} -eq 0 ] || say "not run (BUDGET_S=$BUDGET_S): ${skipped[*]}"
if [ ${#failed[@]} -gt 0 ]; then
  say "runs that exited non-zero: ${failed[*]}"
  exit 1
fi
