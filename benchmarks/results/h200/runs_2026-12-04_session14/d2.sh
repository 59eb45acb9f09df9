#!/usr/bin/env bash
# D2 (session 14): the voxel / channel sweeps beside spconv on the library of D1 (default path)
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
bash .peers/spconv/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/peers:/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUSPACE_TRY_UNVERIFIED=0
trap 'tar -czf $F/d2.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
timeout 300 python3 -m benchmarks.bench_sparse_conv --cases sweep --reps 100 > $F/w/sweep.txt 2>&1; grep -v "%|" $F/w/sweep.txt | tail -24
cp benchmarks/results/h200/sparse_conv.json benchmarks/results/h200/sparse_conv.png $F/w/ 2>/dev/null
echo "all done $(( $(date +%s) - t0 )) s"
