#!/usr/bin/env bash
# D3 (session 14): the whole LiDAR GPU suite (every LiDAR op file, the contracts, the strict
# self-check) and the BEV / MSDA op files on the library of D1
set -uo pipefail
F=$OUT; mkdir -p $F/w
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
trap 'tar -czf $F/d3.tar.gz -C $F/w . ; rm -rf $F/w' EXIT
t0=$(date +%s)
STAGE_LIMIT=330 OUT=$F/w/check bash scripts/lidar_gpu_session.sh check 2>&1 | tail -7
echo "check done $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_bev_pool.py tests/ops/test_bev_pool_v2.py tests/ops/test_bev_pool_v3.py tests/ops/test_bev_pool_prepare.py tests/ops/test_multi_scale_deformable_attn.py > $F/w/bev_msda.txt 2>&1; tail -2 $F/w/bev_msda.txt
echo "all done $(( $(date +%s) - t0 )) s"
