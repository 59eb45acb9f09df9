#!/usr/bin/env bash
# D7 (session 13): A/B of the float32 forward at 16-256 channels: the implicit GEMM (default)
# against the per-offset gather -> torch.mm -> scatter path (MUSPACE_SPARSE_CONV_IM2COL=0), ours
# only, same call
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
trap 'tar -czf $F/d7.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
C='sweep-channels|encoder-centerpoint-0075-forward-float32|encoder-centerpoint-0075-forward\+backward-float32'
timeout 120 python3 -m benchmarks.bench_sparse_conv --cases "$C" --reps 100 --no-write > $F/w/implicit.txt 2>&1; grep -v "%|" $F/w/implicit.txt | grep "sweep\|encoder"
echo "implicit done $(( $(date +%s) - t0 )) s"
MUSPACE_SPARSE_CONV_IM2COL=0 timeout 150 python3 -m benchmarks.bench_sparse_conv --cases "$C" --reps 100 --no-write > $F/w/per_offset.txt 2>&1; grep -v "%|" $F/w/per_offset.txt | grep "sweep\|encoder"
echo "all done $(( $(date +%s) - t0 )) s"
