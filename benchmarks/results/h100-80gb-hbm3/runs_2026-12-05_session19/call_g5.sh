#!/usr/bin/env bash
# Session 19, call G5 (G4 got no machine; the lean form for the device time left): carry .whl,
# .peers/muspace_lib.tar.xz and .peers/spconv9. (1) The full-size encoders against spconv on the
# GPU, both measured against the float64 reference path; (2) the copy / fill floor at the LiDAR
# operators' sizes; (3) the CenterPoint encoder beside spconv, SubM in site order (0) and mask
# order (1), one round, the reference not timed. Writes into $OUT.
set -uo pipefail
F=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv9/install.sh > $F/spconv_install.txt 2>&1
export PYTHONPATH=/tmp/peers:/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 100 python3 -m pytest -q -s -p no:cacheprovider tests/sparse/test_against_spconv.py -k gpu \
  > $F/against_spconv_gpu64.txt 2>&1
echo "== against spconv, GPU, float64 truth: $(tail -1 $F/against_spconv_gpu64.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "^(centerpoint|second)|^FAILED|Error" $F/against_spconv_gpu64.txt | cut -c1-900 | head -12
timeout 45 python3 -m benchmarks.bench_copy_bandwidth --reps 100 --cases "copy-(1|2|4|8|16|32|64|2048)MiB|fill" \
  --out $F/copy > $F/copy.txt 2>&1
grep -E "^(copy|fill)" $F/copy.txt; echo "copy done $(( $(date +%s) - t0 )) s"
for o in 0 1; do
  MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS=$o timeout 50 python3 -m benchmarks.bench_sparse_conv \
    --cases "^encoder" --no-reference-timing --reps 100 --out $F/enc_o$o > $F/enc_o$o.txt 2>&1
  echo "== encoder, SubM order $o ($(( $(date +%s) - t0 )) s)"
  grep -E "^encoder" $F/enc_o$o.txt | awk '{printf "%-60s %9s\n", $1, $4}'
done
echo "all done $(( $(date +%s) - t0 )) s"
