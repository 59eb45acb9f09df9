#!/usr/bin/env bash
# Prepared in session 16 (no device machine was lent that session: NOT RUN yet). The first of
# two calls that verify the native changes not yet run on a GPU: the packed SubM table (d9a1f4e),
# dynamic_scatter's one-call forward (dynamic_scatter_bitmap_forward, session 16), the
# composition dynamic_scatter_padded and pillar_scatter's one-launch forward
# (pillar_scatter_forward_tiled; both session 16). All are
# behind their UNVERIFIED marks, so every stage here runs with MUSPACE_TRY_UNVERIFIED=1:
#   the whole LiDAR GPU suite (every LiDAR op file, contracts, strict self-check);
#   memcheck / racecheck of the rule-book tests, the fused-forward / padded tests and the tiled
#   pillar tests;
#   dynamic_scatter's forward at centerpoint-0075-nus, one-call vs the parts
#   (MUSPACE_DYNAMIC_SCATTER_FUSED=0), each twice, alternating; dynamic_scatter_padded's forward
#   (written in session 16 too) timed as calls and as CUDA graph replays.
# Then call_b.sh (the rule-book probe, the benchmark beside spconv, pillar_scatter's A/B, the
# sweeps). Carry .whl and .peers (spconv kit,
# the 90a library of this commit as muspace_lib.tar.xz, mmcv-lite 2.1.0's csrc tree in
# .peers/mmcv: the sanitize stage builds mmcv's peer kernels meanwhile, so the dynamic_scatter
# forward rows get their -mmcv twins in the same call); kind nvidia-h200, timeout 600.
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=1
trap 'tar -czf $F/a.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
STAGE_LIMIT=260 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -7
echo "check done $(( $(date +%s) - t0 )) s"
SANITIZE_JOBS="memcheck:sparse_rulebook racecheck:sparse_rulebook memcheck:scatter_fused_padded racecheck:scatter_fused_padded memcheck:pillar_tiled racecheck:pillar_tiled_small" \
  SANITIZER_LIMIT=100 OUT=$F/w/san bash scripts/lidar_gpu_session.sh sanitize 2>&1 | tail -6
echo "sanitize done $(( $(date +%s) - t0 )) s"
ds() {  # ds LABEL ARGS...: the forward cases of dynamic_scatter at centerpoint-0075-nus
  local label=$1; shift
  [ $(( $(date +%s) - t0 )) -gt 530 ] && return
  timeout 45 python3 -m benchmarks.bench_dynamic_scatter --quick --reps 100 --no-write "$@" > $F/w/ds_$label.txt 2>&1
  echo "== dynamic_scatter $label"; grep -E "forward" $F/w/ds_$label.txt | cut -c1-150
}
MUSPACE_DYNAMIC_SCATTER_FUSED=1 ds fused_r1 --cases "centerpoint-0075-nus-c.*-forward-float"
MUSPACE_DYNAMIC_SCATTER_FUSED=0 ds parts_r1 --cases "centerpoint-0075-nus-c.*-forward-float"
ds padded --cases "centerpoint-0075-nus-c.*-forward-padded"
ds padded_graph --graph --cases "centerpoint-0075-nus-c.*-forward-padded"
MUSPACE_DYNAMIC_SCATTER_FUSED=1 ds fused_r2 --cases "centerpoint-0075-nus-c.*-forward-float"
MUSPACE_DYNAMIC_SCATTER_FUSED=0 ds parts_r2 --cases "centerpoint-0075-nus-c.*-forward-float"
echo "all done $(( $(date +%s) - t0 )) s"
