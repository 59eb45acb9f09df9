#!/usr/bin/env bash
# Session 20, call B (after A, same kind of machine): the canvas kernel's channel chunk now 4
# (call A's sweep): pillar_scatter's GPU tests again (and the > 2^31-element canvas test alone,
# which failed in A's parallel run), the MSDA level-metadata tests (stream_capturing); the
# pillar forward with the new default, the old chunk 8, and the pre-session path (chunk 8, no
# kept map), alternating; Nsight Compute durations of the issue-10 bandwidth kernels beside
# torch's copy / fill of the same bytes (cold caches); torch.profiler's in-stream split of the
# one-call dynamic_scatter forward; the final form of the GPU agreement test with spconv.
# carry: .whl, .peers/muspace_lib.tar.xz, .peers/spconv9. Everything into $OUT/b.tar.gz.
set -uo pipefail
F=$(mktemp -d /tmp/b-XXXX)
trap 'tar -czf "$OUT/b.tar.gz" -C "$F" .' EXIT
[ -d /tmp/site/tvm_ffi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
tar -xJf .peers/muspace_lib.tar.xz
export PYTHONPATH=/tmp/peers:/tmp/site:$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import json; print('library sources', json.load(open('mu_space/_lib/build_info.json'))['sources_sha256'][:12])"
timeout 100 python3 -m pytest -q -p no:cacheprovider -x tests/ops/test_pillar_scatter.py -k int32_elements \
  > $F/pillar_int32.txt 2>&1
echo "== pillar > 2^31 elements alone: $(tail -1 $F/pillar_int32.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "Error|error" $F/pillar_int32.txt | head -5 | cut -c1-300
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 6 tests/ops/test_pillar_scatter.py -k "not int32_elements" \
  > $F/pillar_tests.txt 2>&1
echo "== pillar tests: $(tail -1 $F/pillar_tests.txt) ($(( $(date +%s) - t0 )) s)"
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 6 tests/ops/test_multi_scale_deformable_attn.py \
  -k "level or model_shapes" > $F/msda.txt 2>&1
echo "== msda level / model-shape tests: $(tail -1 $F/msda.txt) ($(( $(date +%s) - t0 )) s)"
run_pillar() {  # run_pillar NAME ENV...
  local name=$1; shift
  env "$@" timeout 60 python3 -m benchmarks.bench_pillar_scatter --quick --reps 100 --cases forward \
    --no-reference-timing --out $F/$name > $F/$name.txt 2>&1
  echo "== pillar $name ($(( $(date +%s) - t0 )) s)"
  grep -E "^target" $F/$name.txt | sed 's/(target.*//' | cut -c1-100
}
for r in 1 2; do
  run_pillar new_r$r MUSPACE_PILLAR_CHANNEL_CHUNK=4
  run_pillar chunk8_r$r MUSPACE_PILLAR_CHANNEL_CHUNK=8
done
run_pillar before_r1 MUSPACE_PILLAR_CHANNEL_CHUNK=8 MUSPACE_PILLAR_KEEP_MAP=0
timeout 150 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes.sum \
  python3 -m benchmarks.profile_kernels --voxel --only "dynamic_voxelize|floor-|pillar_scatter-fwd" \
  > $F/ncu.txt 2>&1
echo "== ncu: rc $? ($(( $(date +%s) - t0 )) s)"
grep -E "^== |^  [a-zA-Z_].*\(|gpu__time_duration|dram__bytes" $F/ncu.txt | cut -c1-120 | head -70
timeout 90 python3 -m benchmarks.profile_kernels --voxel --torch-profiler --only "dynamic_scatter-fwd" \
  > $F/torch_profile.txt 2>&1
echo "== torch profiler: rc $? ($(( $(date +%s) - t0 )) s)"
head -c 4000 $F/torch_profile.txt
bash .peers/spconv9/install.sh > $F/spconv_install.txt 2>&1
timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/sparse/test_against_spconv.py -k gpu \
  > $F/against_spconv_gpu.txt 2>&1
echo "== against spconv, GPU: $(tail -1 $F/against_spconv_gpu.txt) ($(( $(date +%s) - t0 )) s)"
grep -E "^(centerpoint|second)|^FAILED" $F/against_spconv_gpu.txt | cut -c1-400
echo "all done $(( $(date +%s) - t0 )) s"
