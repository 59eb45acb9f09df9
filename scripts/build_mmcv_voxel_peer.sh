#!/usr/bin/env bash
# Builds mmcv's own voxelization and dynamic-scatter CUDA kernels, unmodified, with a minimal
# binding of ours (scripts/mmcv_voxel_peer.cpp), for the side-by-side benchmarks of issue 10:
#
#   bash scripts/build_mmcv_voxel_peer.sh [OUT_DIR]        (default .peers/build)
#   bash scripts/build_mmcv_voxel_peer.sh --check-only [OUT_DIR]
#                                          (compile only, no link: any machine with nvcc and
#                                           torch's headers, e.g. a CPU build of torch)
#
# Sources: .peers/mmcv/ (MMCV_PEER_SRC overrides), laid out as in the mmcv repository
# (mmcv/ops/csrc/common/..., mmcv/ops/csrc/pytorch/cuda/...); .peers/mmcv/MANIFEST.voxel.txt lists
# the voxel files with their store ids / commits and sha256 (MANIFEST.txt the shared helpers).
# .peers/ is ignored by git (.git/info/exclude): carry it to the GPU machine (`carry:
# [".peers"]`). Needs nvcc and a CUDA build of torch to link; nothing is downloaded.
#
# Output: OUT_DIR/mmcv_voxel_peer.so, loaded by benchmarks/_voxel_peer.py (torch.ops.load_library;
# ops torch.ops.mmcv_voxel_peer.*). Each mmcv source is compiled on its own; one that fails is
# reported and left out, and the binding registers only the ops whose source compiled.
#
# Compatibility, all outside mmcv's files (which stay byte-for-byte as fetched), in
# OUT_DIR/shim-voxel/: THC/THCAtomics.cuh -> <ATen/cuda/Atomic.cuh> when this torch has no THC,
# and a force-included header defining at::cuda::ATenCeilDiv when this torch dropped it.
# --check-only on a machine without a full CUDA toolkit (no cusparse.h etc.) or with a CPU build
# of torch: the mmcv units fail to compile there (they include ATen/cuda); the binding is then
# still compiled with every PEER_HAS_* set, which checks our part.
# Env: CUDA_ARCH (default 90a), NVCC (default nvcc), MMCV_PEER_SRC, CUDA_HOME, PEER_EXTRA_FLAGS
# (more compiler flags), PEER_CXX_STD (default c++17).
set -uo pipefail
cd "$(dirname "$0")/.."
check_only=0
if [ "${1:-}" = --check-only ]; then
  check_only=1
  shift
fi
SRC=${MMCV_PEER_SRC:-.peers/mmcv}
OUT=${1:-.peers/build}
ARCH=${CUDA_ARCH:-90a}
NVCC=${NVCC:-nvcc}
COMMON="$SRC/mmcv/ops/csrc/common"
CUDA_SRC="$SRC/mmcv/ops/csrc/pytorch/cuda"
if [ ! -f "$CUDA_SRC/voxelization_cuda.cu" ] || [ ! -f "$COMMON/pytorch_cuda_helper.hpp" ]; then
  echo "build_mmcv_voxel_peer: $SRC lacks mmcv's voxel sources (.peers/mmcv/MANIFEST.voxel.txt)"
  exit 1
fi
command -v "$NVCC" >/dev/null || { echo "build_mmcv_voxel_peer: $NVCC not found"; exit 1; }
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -d /usr/local/cuda/include ]; then
    CUDA_HOME=/usr/local/cuda
  else
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")
  fi
fi
export CUDA_HOME
SHIM="$OUT/shim-voxel"
OBJ="$OUT/obj-voxel"
mkdir -p "$SHIM/THC" "$OBJ" || exit 1
start=$(date +%s)

# torch's include / library paths, its C++ ABI, CUDA home, whether it still ships THC
TORCH_PY='
import inspect, os
import torch
import torch.utils.cpp_extension as ce
params = inspect.signature(ce.include_paths).parameters
kw = {"device_type": "cuda"} if "device_type" in params else {"cuda": True}
home = ce.CUDA_HOME or os.environ["CUDA_HOME"]
try:
    inc, lib = ce.include_paths(**kw), ce.library_paths(**kw)
except OSError:  # a CPU build of torch: compile checks only (it has no libtorch_cuda)
    inc = ce.include_paths() + [os.path.join(home, "include")]
    lib = ce.library_paths() + [os.path.join(home, "lib64")]
print(" ".join("-I" + p for p in inc))
print(" ".join("-L" + p for p in lib))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(home)
print(int(any(os.path.exists(os.path.join(p, "THC", "THCAtomics.cuh")) for p in inc)))
'
mapfile -t TORCH < <(python3 -c "$TORCH_PY")
if [ ${#TORCH[@]} -ne 5 ]; then
  echo "build_mmcv_voxel_peer: could not read torch's build paths"
  exit 1
fi
TORCH_INC=${TORCH[0]}
TORCH_LIB=${TORCH[1]}
ABI="-D_GLIBCXX_USE_CXX11_ABI=${TORCH[2]}"
CUDA_HOME_=${TORCH[3]}
if [ "${TORCH[4]}" != 1 ]; then
  printf '#pragma once\n#include <ATen/cuda/Atomic.cuh>\n' >"$SHIM/THC/THCAtomics.cuh"
fi
read -r -a EXTRA_ARGS <<<"${PEER_EXTRA_FLAGS:-}"
printf '%s\n' '#include <ATen/cuda/CUDAContext.h>' '#include <ATen/cuda/CUDAApplyUtils.cuh>' \
  'int f() { return at::cuda::ATenCeilDiv(5, 2); }' >"$OBJ/probe.cu"
# shellcheck disable=SC2086
if "$NVCC" -std=c++17 $ABI -I"$SHIM" $TORCH_INC "${EXTRA_ARGS[@]}" -x cu -c \
  "$OBJ/probe.cu" -o "$OBJ/probe.o" >"$OBJ/probe.log" 2>&1; then
  printf '%s\n' '#pragma once' >"$SHIM/voxel_peer_compat.h"
else
  printf '%s\n' '#pragma once' '#include <ATen/cuda/CUDAContext.h>' \
    'namespace at { namespace cuda {' \
    'template <typename T> inline T ATenCeilDiv(T a, T b) { return (a + b - 1) / b; }' \
    '} }' >"$SHIM/voxel_peer_compat.h"
fi

# the half / bfloat16 flags are torch.utils.cpp_extension's (mmcv's setup.py builds with them)
FLAGS=(-std=${PEER_CXX_STD:-c++17} -O3 --expt-relaxed-constexpr -Xcompiler -fPIC "$ABI"
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
  "-gencode=arch=compute_${ARCH},code=sm_${ARCH}"
  -I"$SHIM" -I"$COMMON" -I"$COMMON/cuda" -include "$SHIM/voxel_peer_compat.h"
  "${EXTRA_ARGS[@]}")
read -r -a TORCH_INC_ARGS <<<"$TORCH_INC"
objs=()
defs=()
for unit in VOXELIZATION:voxelization_cuda.cu SCATTER_POINTS:scatter_points_cuda.cu; do
  key=${unit%%:*}
  f=${unit#*:}
  if "$NVCC" "${FLAGS[@]}" "${TORCH_INC_ARGS[@]}" -c "$CUDA_SRC/$f" -o "$OBJ/${f%.cu}.o" \
    >"$OBJ/${f%.cu}.log" 2>&1; then
    objs+=("$OBJ/${f%.cu}.o")
    defs+=("-DPEER_HAS_$key=1")
    echo "ok    $f"
  else
    echo "FAIL  $f (left out; log $OBJ/${f%.cu}.log):"
    grep -m 8 -i error "$OBJ/${f%.cu}.log" | sed 's/^/      /'
  fi
done
if [ ${#objs[@]} -eq 0 ]; then
  if [ "$check_only" != 1 ]; then
    echo "build_mmcv_voxel_peer: nothing compiled"
    exit 1
  fi
  defs=(-DPEER_HAS_VOXELIZATION=1 -DPEER_HAS_SCATTER_POINTS=1)  # check the whole binding
fi
g++ -std=${PEER_CXX_STD:-c++17} -O2 -fPIC "$ABI" "${TORCH_INC_ARGS[@]}" "${EXTRA_ARGS[@]}" \
  "${defs[@]}" -c scripts/mmcv_voxel_peer.cpp -o "$OBJ/binding.o" || exit 1
echo "ok    scripts/mmcv_voxel_peer.cpp (${defs[*]})"
if [ "$check_only" = 1 ]; then
  echo "build_mmcv_voxel_peer: compiled (--check-only: not linked) in $(($(date +%s) - start)) s"
  exit 0
fi
read -r -a TORCH_LIB_ARGS <<<"$TORCH_LIB"
g++ -shared -o "$OUT/mmcv_voxel_peer.so" "$OBJ/binding.o" "${objs[@]}" "${TORCH_LIB_ARGS[@]}" \
  -L"$CUDA_HOME_/lib64" -lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -ltorch -lcudart || exit 1
echo "build_mmcv_voxel_peer: $OUT/mmcv_voxel_peer.so (${#objs[@]} of 2 mmcv sources," \
  "arch sm_$ARCH) in $(($(date +%s) - start)) s"
