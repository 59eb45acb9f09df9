#!/usr/bin/env bash
# D1: build on the device, host profile of the sparse encoder (ours vs spconv)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
bash .peers/spconv/install.sh >/dev/null 2>&1 && export PYTHONPATH=/tmp/peers:$PYTHONPATH
export OMP_NUM_THREADS=1 CUDA_ARCH=90a PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 build_utils.py --inplace --if-stale -j 16 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"; tail -1 $OUT/build.log
tar -cJf $OUT/muspace_lib.tar.xz mu_space/_lib
timeout 300 python3 .peers/call/host_probe.py > $OUT/host_probe.txt 2>&1; echo "probe rc $?"
grep "^==" $OUT/host_probe.txt
