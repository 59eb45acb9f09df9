#!/usr/bin/env bash
# Session 19, call G4: carry .whl, .peers/muspace_lib.tar.xz (the 90a library of e8107f8) and
# .peers/spconv9 (spconv 2.3.8's kit, its two tarballs recompressed with xz -9e so that all three
# fit the 64-MiB carry). (1) The full-size encoders against spconv on the GPU, both measured
# against the float64 reference path; (2) the CenterPoint encoder beside spconv with SubM layers
# in site order (0) and mask order (1), alternating, two rounds, the reference not timed;
# (3) the copy / fill floor at the LiDAR operators' sizes. Writes into $OUT.
set -uo pipefail
F=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv9/install.sh > $F/spconv_install.txt 2>&1
export PYTHONPATH=/tmp/peers:/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import json; print('library sources', json.load(open('mu_space/_lib/build_info.json'))['sources_sha256'][:12])"
timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/sparse/test_against_spconv.py -k gpu \
  > $F/against_spconv_gpu64.txt 2>&1
echo "== against spconv, GPU, float64 truth: $(tail -1 $F/against_spconv_gpu64.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "^(centerpoint|second)|^FAILED|Error" $F/against_spconv_gpu64.txt | cut -c1-700 | head -12
for r in 1 2; do
  for o in 0 1; do
    MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS=$o timeout 60 python3 -m benchmarks.bench_sparse_conv \
      --cases "^encoder" --no-reference-timing --reps 100 --out $F/enc_o${o}_r$r > $F/enc_o${o}_r$r.txt 2>&1
    echo "== encoder, SubM order $o, round $r ($(( $(date +%s) - t0 )) s)"
    grep -E "^encoder" $F/enc_o${o}_r$r.txt | awk '{printf "%-60s %9s\n", $1, $4}'
  done
done
timeout 60 python3 -m benchmarks.bench_copy_bandwidth --reps 100 --out $F/copy > $F/copy.txt 2>&1
grep -E "^(copy|fill)" $F/copy.txt
echo "all done $(( $(date +%s) - t0 )) s"
