#!/usr/bin/env bash
# Session 19, call G2, right after G1 on the same warm machine (its extracted library stays):
# carry .whl and .peers/spconv. The full-size SparseEncoder against spconv 2.3.8 on the GPU
# (tests/sparse/test_against_spconv.py::test_full_encoder_on_the_gpu_agrees_with_spconv), then
# the channel sweep and the quick benchmark beside spconv with SubM layers in site order (0) and
# in mask order (1). Writes into $OUT.
set -uo pipefail
F=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
bash .peers/spconv/install.sh > $F/spconv_install.txt 2>&1
export PYTHONPATH=/tmp/peers:/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
ls mu_space/_lib/libmuspace_native.so || exit 3
timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/sparse/test_against_spconv.py \
  -k "gpu" > $F/against_spconv_gpu.txt 2>&1
echo "== against spconv, GPU: $(tail -1 $F/against_spconv_gpu.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "float32|float16|FAILED|Error" $F/against_spconv_gpu.txt | head -12
for o in 0 1; do
  MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS=$o timeout 150 python3 -m benchmarks.bench_sparse_conv \
    --cases "^(encoder|subm|strided|inverse|rulebook|sweep-channels)" --reps 100 --out $F/spconv_order$o \
    > $F/spconv_order$o.txt 2>&1
  echo "== order $o ($(( $(date +%s) - t0 )) s)"
  grep -E "^(encoder|subm|strided|inverse|rulebook|sweep)" $F/spconv_order$o.txt | awk '{printf "%-60s %9s\n", $1, $4}'
done
echo "all done $(( $(date +%s) - t0 )) s"
