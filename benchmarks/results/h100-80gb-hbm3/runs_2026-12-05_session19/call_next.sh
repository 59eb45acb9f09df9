#!/usr/bin/env bash
# Prepared in session 19 for the next device call (not run yet): carry .whl,
# .peers/muspace_lib.tar.xz (rebuild and re-pack it after any csrc change) and .peers/spconv9
# (spconv's kit recompressed with xz -9e: the three fit the 64-MiB carry). One machine, so the
# ratios are like for like: (1) the final form of the GPU agreement test (set bound on the
# gradients' distance to float64); (2) the CenterPoint encoder beside spconv with SubM layers in
# site order (0) and mask order (1), alternating, two rounds (SUBM_ORDER_MIN_CHANNEL_PRODUCT's
# default); (3) issue 10's bandwidth rows beside the copy / fill floor of the same run:
# pillar_scatter forward, dynamic voxelization, bench_copy_bandwidth's small copies and fills.
# Writes into $OUT; ~4-5 minutes.
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
echo "== against spconv, GPU: $(tail -1 $F/against_spconv_gpu64.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "^(centerpoint|second)|^FAILED" $F/against_spconv_gpu64.txt | cut -c1-600
timeout 60 python3 -m benchmarks.bench_copy_bandwidth --reps 100 \
  --cases "copy-(1|2|4|8|16|32|64|2048)MiB|fill" --out $F/copy > $F/copy.txt 2>&1
grep -E "^(copy|fill)" $F/copy.txt
timeout 90 python3 -m benchmarks.bench_pillar_scatter --quick --reps 100 --cases forward \
  --no-reference-timing --out $F/pillar > $F/pillar.txt 2>&1
grep -E "forward" $F/pillar.txt | grep -v "^benchmark" | cut -c1-110
timeout 90 python3 -m benchmarks.bench_voxelization --quick --reps 100 --cases dynamic \
  --no-reference-timing --out $F/voxel > $F/voxel.txt 2>&1
grep -E "dynamic" $F/voxel.txt | grep -v "^benchmark" | cut -c1-110
echo "issue 10 rows done $(( $(date +%s) - t0 )) s"
for r in 1 2; do
  for o in 0 1; do
    MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS=$o timeout 90 python3 -m benchmarks.bench_sparse_conv \
      --cases "^encoder" --no-reference-timing --reps 100 --out $F/enc_o${o}_r$r > $F/enc_o${o}_r$r.txt 2>&1
    echo "== encoder, SubM order $o, round $r ($(( $(date +%s) - t0 )) s)"
    grep -E "^encoder" $F/enc_o${o}_r$r.txt | awk '{printf "%-60s %9s\n", $1, $4}'
  done
done
echo "all done $(( $(date +%s) - t0 )) s"
