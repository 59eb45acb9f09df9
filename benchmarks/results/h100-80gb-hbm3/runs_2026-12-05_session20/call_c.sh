#!/usr/bin/env bash
# Session 20, call C: the LiDAR GPU suite and its contract tests on the final build (channel
# chunk 4), the > 2^31-element canvas test alone (its 13 + 8.6 GB beside 8 other pytest
# workers on an 80-GB card), then the copy floor at dynamic voxelization's bytes (copy-1.6MiB /
# copy-5MiB move 3.4 / 10.5 MB) beside dynamic voxelization and the pillar forward, one run each.
# carry: .whl, .peers/muspace_lib.tar.xz. Everything into $OUT/c.tar.gz.
set -uo pipefail
F=$(mktemp -d /tmp/c-XXXX)
trap 'tar -czf "$OUT/c.tar.gz" -C "$F" .' EXIT
[ -d /tmp/site/tvm_ffi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import json; print('library sources', json.load(open('mu_space/_lib/build_info.json'))['sources_sha256'][:12])"
OUT=$F/check STAGE_LIMIT=240 bash scripts/lidar_gpu_session.sh check 2>&1 | tail -n 12
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/ops/test_pillar_scatter.py -k int32_elements \
  > $F/pillar_int32.txt 2>&1
echo "== pillar > 2^31 elements alone: $(tail -1 $F/pillar_int32.txt) ($(( $(date +%s) - t0 )) s)"
timeout 60 python3 -m benchmarks.bench_copy_bandwidth --reps 100 \
  --cases "copy-(1|1.6|2|4|5|8|16|32|64|2048)MiB|fill" --out $F/copy > $F/copy.txt 2>&1
grep -E "^(copy|fill)" $F/copy.txt
timeout 90 python3 -m benchmarks.bench_voxelization --quick --reps 100 --cases dynamic \
  --no-reference-timing --out $F/voxel > $F/voxel.txt 2>&1
grep -E "dynamic" $F/voxel.txt | grep -v "^benchmark" | cut -c1-100
timeout 60 python3 -m benchmarks.bench_pillar_scatter --quick --reps 100 --cases forward \
  --no-reference-timing --out $F/pillar > $F/pillar.txt 2>&1
grep -E "forward" $F/pillar.txt | grep -v "^benchmark" | cut -c1-100
echo "all done $(( $(date +%s) - t0 )) s"
