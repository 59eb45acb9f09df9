#!/usr/bin/env bash
# Builds mmcv's own 3D box CUDA kernels, unmodified, with a minimal binding of ours
# (scripts/mmcv_box3d_peer.cpp), for the side-by-side benchmarks of issue 12:
#
#   bash scripts/build_mmcv_box3d_peer.sh [OUT_DIR]        (default .peers/build)
#
# Sources: .peers/mmcv/ (MMCV_PEER_SRC overrides), the upstream files laid out as in the mmcv
# repository (mmcv/ops/csrc/common/..., mmcv/ops/csrc/pytorch/cuda/...; .peers/mmcv/MANIFEST.txt
# lists them with their commits). .peers/ is ignored by git (.git/info/exclude): carry it to the
# GPU machine (`carry: [".peers"]`). Needs nvcc and a CUDA build of torch; nothing is downloaded.
#
# Output: OUT_DIR/mmcv_box3d_peer.so, loaded by benchmarks/_box3d_peer.py
# (torch.ops.load_library; ops torch.ops.mmcv_box3d_peer.*). Each mmcv source is compiled on its
# own; one that fails (an API its revision uses and this torch lacks) is reported and left out,
# and the binding registers only the ops whose source compiled.
#
# Compatibility, all outside mmcv's files (which stay byte-for-byte as fetched):
#   - OUT_DIR/shim/pytorch_device_registry.hpp: REGISTER_DEVICE_IMPL as nothing (mmcv's real one
#     includes <torch/extension.h>, i.e. Python.h, and needs mmcv's dispatch .cpp files);
#   - OUT_DIR/shim/THC/THCAtomics.cuh -> <ATen/cuda/Atomic.cuh> when this torch has no THC;
#   - a force-included header: CUDA_2D_KERNEL_LOOP / CUDA_2D_KERNEL_BLOCK_LOOP and the
#     two-argument GET_BLOCKS of newer mmcv (the fetched common_cuda_helper.hpp is older than the
#     iou3d launcher), and at::cuda::ATenCeilDiv when this torch dropped it.
# Env: CUDA_ARCH (default 90a), NVCC (default nvcc), MMCV_PEER_SRC, CUDA_HOME (default
# /usr/local/cuda or nvcc's), PEER_EXTRA_FLAGS (more nvcc flags, e.g. -I of stub headers).
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=${MMCV_PEER_SRC:-.peers/mmcv}
OUT=${1:-.peers/build}
ARCH=${CUDA_ARCH:-90a}
NVCC=${NVCC:-nvcc}
COMMON="$SRC/mmcv/ops/csrc/common"
CUDA_SRC="$SRC/mmcv/ops/csrc/pytorch/cuda"
[ -d "$COMMON/cuda" ] && [ -d "$CUDA_SRC" ] || {
  echo "build_mmcv_box3d_peer: $SRC lacks mmcv's sources (see the issue-12 report)"; exit 1; }
command -v "$NVCC" >/dev/null || { echo "build_mmcv_box3d_peer: $NVCC not found"; exit 1; }
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -d /usr/local/cuda/include ]; then CUDA_HOME=/usr/local/cuda
  else CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")"); fi
fi
export CUDA_HOME
mkdir -p "$OUT/shim/THC" "$OUT/obj"
start=$(date +%s)

# torch's include / library paths and ABI
mapfile -t TORCH < <(python3 - <<'EOF'
import inspect
import os

import torch
import torch.utils.cpp_extension as ce

params = inspect.signature(ce.include_paths).parameters
kw = {"device_type": "cuda"} if "device_type" in params else {"cuda": True}
home = ce.CUDA_HOME or os.environ["CUDA_HOME"]
try:
    inc, lib = ce.include_paths(**kw), ce.library_paths(**kw)
except OSError:  # a CPU build of torch (compile checks only: it has no libtorch_cuda)
    inc = ce.include_paths() + [os.path.join(home, "include")]
    lib = ce.library_paths() + [os.path.join(home, "lib64")]
print(" ".join("-I" + p for p in inc))
print(" ".join("-L" + p for p in lib))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(home)
print(int(any(os.path.exists(os.path.join(p, "THC", "THCAtomics.cuh")) for p in inc)))
EOF
)
[ ${#TORCH[@]} -eq 5 ] || { echo "build_mmcv_box3d_peer: could not read torch's build paths"; exit 1; }
TORCH_INC=${TORCH[0]}
TORCH_LIB=${TORCH[1]}
ABI="-D_GLIBCXX_USE_CXX11_ABI=${TORCH[2]}"
CUDA_HOME_=${TORCH[3]}
HAVE_THC=${TORCH[4]}

cat >"$OUT/shim/pytorch_device_registry.hpp" <<'EOF'
// build_mmcv_box3d_peer.sh: mmcv's device registry is not needed for the direct binding
#pragma once
#define REGISTER_DEVICE_IMPL(key, device, value)
EOF
if [ "$HAVE_THC" != 1 ]; then
  echo '#pragma once
#include <ATen/cuda/Atomic.cuh>' >"$OUT/shim/THC/THCAtomics.cuh"
fi

probe() {  # probe NAME CODE: 1 when CODE compiles against this torch
  printf '%s\n' "$2" >"$OUT/obj/probe_$1.cu"
  # shellcheck disable=SC2086
  "$NVCC" -std=c++17 $ABI -I"$OUT/shim" $TORCH_INC ${PEER_EXTRA_FLAGS:-} -x cu -c \
    "$OUT/obj/probe_$1.cu" -o "$OUT/obj/probe_$1.o" \
    >/dev/null 2>&1 && echo 1 || echo 0
}
HAVE_CEILDIV=$(probe ceildiv '#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAApplyUtils.cuh>
int f() { return at::cuda::ATenCeilDiv(5, 2); }')
# newer common_cuda_helper.hpp (mmcv 2.x) has the two-argument GET_BLOCKS itself
HAVE_GET_BLOCKS2=0
grep -q "GET_BLOCKS(const int N, const int num_threads" "$COMMON/cuda/common_cuda_helper.hpp" \
  && HAVE_GET_BLOCKS2=1
cat >"$OUT/shim/mmcv_peer_compat.h" <<EOF
// build_mmcv_box3d_peer.sh: what newer mmcv helpers / older torch provide (force-included)
#pragma once
#include <algorithm>
#ifndef CUDA_2D_KERNEL_LOOP
#define CUDA_2D_KERNEL_LOOP(i, n, j, m)                             \\
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (n);   \\
       i += blockDim.x * gridDim.x)                                 \\
    for (size_t j = blockIdx.y * blockDim.y + threadIdx.y; j < (m); \\
         j += blockDim.y * gridDim.y)
#endif
#ifndef CUDA_2D_KERNEL_BLOCK_LOOP
#define CUDA_2D_KERNEL_BLOCK_LOOP(i, n, j, m)          \\
  for (size_t i = blockIdx.x; i < (n); i += gridDim.x) \\
    for (size_t j = blockIdx.y; j < (m); j += gridDim.y)
#endif
#if $((1 - HAVE_GET_BLOCKS2))
inline int GET_BLOCKS(const int N, const int num_threads) {
  return std::min((N + num_threads - 1) / num_threads, 4096);
}
#endif
#if $((1 - HAVE_CEILDIV))
namespace at { namespace cuda {
template <typename T> inline T ATenCeilDiv(T a, T b) { return (a + b - 1) / b; }
} }
#endif
EOF

# the half / bfloat16 flags are torch.utils.cpp_extension's (mmcv's setup.py builds with them)
FLAGS=(-std=c++17 -O3 --expt-relaxed-constexpr -Xcompiler -fPIC $ABI
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
       "-gencode=arch=compute_${ARCH},code=sm_${ARCH}"
       -I"$OUT/shim" -I"$COMMON" -I"$COMMON/cuda" $TORCH_INC
       -include "$OUT/shim/mmcv_peer_compat.h" ${PEER_EXTRA_FLAGS:-})
declare -A UNITS=(
  [POINTS_IN_BOXES]=points_in_boxes_cuda.cu
  [IOU3D]=iou3d_cuda.cu
  [BOX_IOU_ROTATED]=box_iou_rotated_cuda.cu
  [NMS_ROTATED]=nms_rotated_cuda.cu
  [ROIAWARE]=roiaware_pool3d_cuda.cu
  [ROIPOINT]=roipoint_pool3d_cuda.cu
)
objs=()
defs=()
pids=()
for key in "${!UNITS[@]}"; do
  f=${UNITS[$key]}
  # shellcheck disable=SC2068
  ( "$NVCC" ${FLAGS[@]} -c "$CUDA_SRC/$f" -o "$OUT/obj/${f%.cu}.o" >"$OUT/obj/${f%.cu}.log" 2>&1
    echo $? >"$OUT/obj/${f%.cu}.rc" ) &
  pids+=($!)
done
wait "${pids[@]}"
for key in "${!UNITS[@]}"; do
  f=${UNITS[$key]}
  if [ "$(cat "$OUT/obj/${f%.cu}.rc")" = 0 ]; then
    objs+=("$OUT/obj/${f%.cu}.o")
    defs+=("-DPEER_HAS_$key=1")
    echo "ok    $f"
  else
    echo "FAIL  $f (left out):"
    grep -m 8 -i error "$OUT/obj/${f%.cu}.log" | sed 's/^/      /'
  fi
done
[ ${#objs[@]} -gt 0 ] || { echo "build_mmcv_box3d_peer: nothing compiled"; exit 1; }
# mmcv 2.x's NMS launchers take (boxes, keep, keep_num, thresh), main's (boxes, mask, n, thresh)
grep -q "IoU3DNMS3DForwardCUDAKernelLauncher(const Tensor boxes, Tensor& keep" \
  "$CUDA_SRC/iou3d_cuda.cu" && defs+=("-DPEER_IOU3D_KEEP_API=1")
# shellcheck disable=SC2086
g++ -std=c++17 -O2 -fPIC $ABI $TORCH_INC "${defs[@]}" -c scripts/mmcv_box3d_peer.cpp \
  -o "$OUT/obj/binding.o" || exit 1
# shellcheck disable=SC2086
g++ -shared -o "$OUT/mmcv_box3d_peer.so" "$OUT/obj/binding.o" "${objs[@]}" $TORCH_LIB \
  -L"$CUDA_HOME_/lib64" -lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -ltorch -lcudart || exit 1
echo "build_mmcv_box3d_peer: $OUT/mmcv_box3d_peer.so (${#objs[@]} of ${#UNITS[@]} mmcv sources," \
  "arch sm_$ARCH) in $(($(date +%s) - start)) s"
