#!/usr/bin/env bash
# Session 20, call A: the GPU suite after pillar_scatter's kept cell map (the last native
# change), the sanitizers over its new tests, then issue 10's bandwidth rows on one machine:
# pillar_scatter forward with the kept map and without it (MUSPACE_PILLAR_KEEP_MAP=0,
# alternating, two rounds), the canvas kernel's channel chunk (MUSPACE_PILLAR_CHANNEL_CHUNK),
# dynamic voxelization, and the copy / fill floor of the same run.
# carry: .whl, .peers/muspace_lib.tar.xz (90a build of this tree). Writes into $OUT.
set -uo pipefail
F=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import json; print('library sources', json.load(open('mu_space/_lib/build_info.json'))['sources_sha256'][:12])"
OUT=$F/check STAGE_LIMIT=240 bash scripts/lidar_gpu_session.sh check 2>&1 | tail -n 30
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_multi_scale_deformable_attn.py \
  -k "graph or captur" > $F/msda_graph.txt 2>&1
echo "== msda graph tests: $(tail -1 $F/msda_graph.txt) ($(( $(date +%s) - t0 )) s)"
OUT=$F/sanitize SANITIZER_LIMIT=150 SANITIZE_JOBS="memcheck:pillar_kept racecheck:pillar_kept" \
  bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -n 8
echo "tests done $(( $(date +%s) - t0 )) s"
timeout 60 python3 -m benchmarks.bench_copy_bandwidth --reps 100 \
  --cases "copy-(1|2|4|8|16|32|64|2048)MiB|fill" --out $F/copy > $F/copy.txt 2>&1
grep -E "^(copy|fill)" $F/copy.txt
for r in 1 2; do
  for k in 1 0; do
    MUSPACE_PILLAR_KEEP_MAP=$k timeout 90 python3 -m benchmarks.bench_pillar_scatter --quick --reps 100 \
      --cases forward --no-reference-timing --out $F/pillar_k${k}_r$r > $F/pillar_k${k}_r$r.txt 2>&1
    echo "== pillar keep_map=$k round $r ($(( $(date +%s) - t0 )) s)"
    grep -E "forward" $F/pillar_k${k}_r$r.txt | grep -v "^benchmark" | cut -c1-110
  done
done
for ch in 4 16 64; do
  MUSPACE_PILLAR_CHANNEL_CHUNK=$ch timeout 90 python3 -m benchmarks.bench_pillar_scatter --quick --reps 100 \
    --cases forward --no-reference-timing --out $F/pillar_c$ch > $F/pillar_c$ch.txt 2>&1
  echo "== pillar channel chunk $ch ($(( $(date +%s) - t0 )) s)"
  grep -E "forward" $F/pillar_c$ch.txt | grep -v "^benchmark" | cut -c1-110
done
timeout 90 python3 -m benchmarks.bench_voxelization --quick --reps 100 --cases dynamic \
  --no-reference-timing --out $F/voxel > $F/voxel.txt 2>&1
grep -E "dynamic" $F/voxel.txt | grep -v "^benchmark" | cut -c1-110
echo "all done $(( $(date +%s) - t0 )) s"
