#!/usr/bin/env bash
# Session 18, the fallback of call_d18.sh for a small device budget: the 90a library of e8107f8
# carried (no build), no spconv. The padded ops' contract tests after the Python fixes, the
# dynamic_scatter tests of the one-call forward and the padded form, the rule-book tests with the
# packed table now the default, and the voxel / channel sweeps (ours only) on the current rule
# book. No MUSPACE_TRY_UNVERIFIED. Carry .whl and .peers/muspace_lib.tar.xz; writes into $OUT.
set -uo pipefail
F=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -c "import json; print('library sources', json.load(open('mu_space/_lib/build_info.json'))['sources_sha256'][:12])"
t() {  # t NAME LIMIT PYTEST-ARGS...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m pytest -q -p no:cacheprovider "$@" > $F/$name.txt 2>&1
  echo "== $name: $(tail -1 $F/$name.txt)"; grep -E "^(FAILED|ERROR)" $F/$name.txt | head -8
}
t contracts_padded 60 tests/test_op_contracts.py -k "padded"
t scatter_padded 60 tests/ops/test_dynamic_scatter.py -k "padded or fused"
t sparse_rulebook 60 tests/ops/test_sparse_native.py tests/ops/test_sparse_rulebook.py -k "rulebook or packed"
echo "tests done $(( $(date +%s) - t0 )) s"
timeout 90 python3 -m benchmarks.bench_sparse_conv --cases sweep --reps 100 > $F/sweep.txt 2>&1; grep -E "^sweep" $F/sweep.txt | cut -c1-120 | head -12
cp benchmarks/results/h200/sparse_conv.json $F/sparse_conv.sweep.json 2>/dev/null
echo "all done $(( $(date +%s) - t0 )) s"
