#!/usr/bin/env bash
# Session 20, call E: MUSPACE_PILLAR_ZERO_FIRST (the canvas kernel stores a group's zeros before
# its map entries arrive): pillar_scatter's GPU tests (its knob case among them), memcheck of the
# knob cases, then the forward with and without it, alternating, two rounds; ncu of the canvas
# kernel both ways. carry: .whl, .peers/muspace_lib.tar.xz. Into $OUT/e.tar.gz.
set -uo pipefail
F=$(mktemp -d /tmp/e-XXXX)
trap 'tar -czf "$OUT/e.tar.gz" -C "$F" .' EXIT
[ -d /tmp/site/tvm_ffi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import json; print('library sources', json.load(open('mu_space/_lib/build_info.json'))['sources_sha256'][:12])"
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_pillar_scatter.py > $F/pillar_tests.txt 2>&1
echo "== pillar tests: $(tail -1 $F/pillar_tests.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "^FAILED" $F/pillar_tests.txt | head -5
MUSPACE_PILLAR_ZERO_FIRST=1 timeout 90 compute-sanitizer --tool memcheck --error-exitcode 1 --kernel-name kns=muspace \
  python3 -m pytest -q -p no:cacheprovider tests/ops/test_pillar_scatter.py -k "native_matches_reference and tiny" \
  > $F/memcheck_zero_first.txt 2>&1
echo "== memcheck, zero first: rc $? $(grep -E "ERROR SUMMARY" $F/memcheck_zero_first.txt | tail -1) $(tail -1 $F/memcheck_zero_first.txt) ($(( $(date +%s) - t0 )) s)"
for r in 1 2; do
  for z in 1 0; do
    MUSPACE_PILLAR_ZERO_FIRST=$z timeout 60 python3 -m benchmarks.bench_pillar_scatter --quick --reps 100 \
      --cases forward --no-reference-timing --out $F/z${z}_r$r > $F/z${z}_r$r.txt 2>&1
    echo "== pillar zero_first=$z round $r ($(( $(date +%s) - t0 )) s)"
    grep -E "^pointpillars.*forward-float(32|16) " $F/z${z}_r$r.txt | awk '{print $1, $4, $6}'
  done
done
for z in 1 0; do
  MUSPACE_PILLAR_ZERO_FIRST=$z timeout 60 ncu --clock-control none --profile-from-start off \
    --metrics gpu__time_duration.sum --kernel-name regex:canvas \
    python3 -m benchmarks.profile_kernels --voxel --only "pillar_scatter-fwd" > $F/ncu_z$z.txt 2>&1
  echo "== ncu zero_first=$z: $(grep -E "gpu__time_duration" $F/ncu_z$z.txt | awk '{print $3}' | tr '\n' ' ')"
done
echo "all done $(( $(date +%s) - t0 )) s"
