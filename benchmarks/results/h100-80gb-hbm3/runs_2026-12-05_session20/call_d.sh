#!/usr/bin/env bash
# Session 20, call D: the > 2^31-element canvas test with its count in pieces, once alone and
# once beside the LiDAR op files' pytest workers (where it ran out of memory in calls A and C);
# ncu of dynamic voxelization beside torch.neg moving the same bytes (an elementwise kernel:
# call B's copy_ floor was a memcpy, which ncu does not profile). Into $OUT/d.tar.gz.
set -uo pipefail
F=$(mktemp -d /tmp/d-XXXX)
trap 'tar -czf "$OUT/d.tar.gz" -C "$F" .' EXIT
[ -d /tmp/site/tvm_ffi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 9 tests/ops/test_pillar_scatter.py \
  tests/ops/test_dynamic_scatter.py > $F/pillar_ds_n9.txt 2>&1
echo "== pillar + dynamic_scatter files, 9 workers: $(tail -1 $F/pillar_ds_n9.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "^FAILED" $F/pillar_ds_n9.txt | head -5
timeout 90 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes.sum \
  python3 -m benchmarks.profile_kernels --voxel --only "dynamic_voxelize" > $F/ncu.txt 2>&1
echo "== ncu: rc $? ($(( $(date +%s) - t0 )) s)"
grep -E "^== |^  [a-zA-Z_].*\(|gpu__time_duration|dram__bytes" $F/ncu.txt | cut -c1-110
