#!/usr/bin/env bash
# Session 20, call B (right after A, on the warm machine): Nsight Compute durations of the
# issue-10 bandwidth kernels beside torch's copy / fill of the same bytes (profile_kernels'
# floor- workloads; cold caches), torch.profiler's in-stream split, then the final form of the GPU agreement test with spconv.
# carry: .whl, .peers/muspace_lib.tar.xz, .peers/spconv9. Writes into $OUT.
set -uo pipefail
F=$OUT
[ -d /tmp/site/tvm_ffi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
[ -f mu_space/_lib/libmuspace_native.so ] || tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/peers:/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for k in 1 0; do
  MUSPACE_PILLAR_KEEP_MAP=$k timeout 200 ncu --clock-control none --profile-from-start off \
    --metrics gpu__time_duration.sum,dram__bytes.sum \
    python3 -m benchmarks.profile_kernels --only "dynamic_voxelize|floor-|pillar_scatter-fwd" \
    > $F/ncu_k$k.txt 2>&1
  echo "== ncu keep_map=$k: rc $? ($(( $(date +%s) - t0 )) s)"
  grep -E "^== |^  [a-zA-Z_].*\(|gpu__time_duration|dram__bytes" $F/ncu_k$k.txt | cut -c1-150 | head -80
done
# in-stream split (torch.profiler, warm L2) of the one-call dynamic_scatter forward and the pillar
# forward: which launches the 60-us / 50-% targets are up against
timeout 120 python3 -m benchmarks.profile_kernels --torch-profiler \
  --only "dynamic_scatter-fwd|pillar_scatter-fwd|dynamic_voxelize" > $F/torch_profile.txt 2>&1
echo "== torch profiler: rc $? ($(( $(date +%s) - t0 )) s)"
head -c 6000 $F/torch_profile.txt
bash .peers/spconv9/install.sh > $F/spconv_install.txt 2>&1
timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/sparse/test_against_spconv.py -k gpu \
  > $F/against_spconv_gpu.txt 2>&1
echo "== against spconv, GPU: $(tail -1 $F/against_spconv_gpu.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "^(centerpoint|second)|^FAILED" $F/against_spconv_gpu.txt | cut -c1-600
echo "all done $(( $(date +%s) - t0 )) s"
