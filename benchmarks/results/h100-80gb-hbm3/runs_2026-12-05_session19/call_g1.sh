#!/usr/bin/env bash
# Session 19, call G1: carry .whl and .peers/muspace_lib.tar.xz (the 90a library of e8107f8;
# the native source is unchanged since, this call's changes are Python). (1) The GPU tests of
# the sparse-conv paths with every SubM layer's out_map in mask order
# (MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS=1); (2) ours-only A/B of that order on the channel
# sweep and the encoder: site order (0), mask order for every SubM layer (1), and mask order
# without the per-offset path for the widest layers, two rounds; (3) the copy / fill floor at
# the LiDAR operators' sizes (bench_copy_bandwidth). Writes into $OUT.
set -uo pipefail
F=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import json; print('library sources', json.load(open('mu_space/_lib/build_info.json'))['sources_sha256'][:12])"
MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/ops/test_sparse_native.py tests/ops/test_sparse_conv.py tests/ops/test_sparse_im2col.py \
  > $F/subm_order_tests.txt 2>&1
echo "== subm order GPU tests: $(tail -1 $F/subm_order_tests.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "^(FAILED|ERROR)" $F/subm_order_tests.txt | head -5
ab() {  # ab NAME ENV...
  local name=$1; shift
  env "$@" timeout 100 python3 -m benchmarks.bench_sparse_conv --cases "^(encoder|sweep-channels)" \
    --reps 100 --out $F/$name > $F/$name.txt 2>&1
  echo "== $name ($(( $(date +%s) - t0 )) s)"
  grep -E "^(encoder|sweep)" $F/$name.txt | awk '{printf "%-52s %9s\n", $1, $4}'
}
for r in 1 2; do
  ab site_r$r MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS=0
  ab mask_r$r MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS=1
done
ab mask_noper MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS=1 MUSPACE_SPARSE_CONV_PER_OFFSET_CHANNELS=0
timeout 60 python3 -m benchmarks.bench_copy_bandwidth --reps 100 --out $F/copy > $F/copy.txt 2>&1
grep -E "^(copy|fill)" $F/copy.txt
echo "all done $(( $(date +%s) - t0 )) s"
