#!/usr/bin/env bash
# Compiles every native source (csrc/**/*.mu) with clang in CUDA mode, the closest stand-in for
# MUSA's clang-based mcc that runs here (docs/architecture.md, MUSA portability rules). For each source and GPU arch:
#   1. syntax   clang -fsyntax-only: host and device front ends, -Werror
#   2. ptx      clang --cuda-device-only -S -O3: LLVM's NVPTX back end generates the device code
#   3. sass     ptxas -v assembles that PTX; static shared memory per kernel must stay < 28 KB
# and once per source (first arch) syntax with -DMUSPACE_HAS_BF16=0: the build without bfloat16
# (MUSA before mp_22) still compiles, i.e. every bfloat16 use is guarded.
# The -D / -I flags are build_utils.source_flags("cuda", ...), as in the nvcc build (TVM-FFI's
# headers as -isystem: their own warnings are not ours).
# CUDA 12.6 headers, libdevice and ptxas come from NVIDIA's PyPI packages, installed into a temp
# dir laid out as the CUDA root clang expects (include/, bin/, nvvm/libdevice/, lib64/) and
# removed at exit: nothing is cached.
#   bash scripts/clang_cuda_check.sh [-j N] [--arch "sm_90a sm_80"] [--keep DIR]
# Env: CLANG (default clang++-19). Exit status 1 when any source fails a step.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
archs="sm_90a sm_80"
keep=""
while [ $# -gt 0 ]; do
  case "$1" in
    -j) jobs="$2"; shift ;;
    --arch) archs="$2"; shift ;;
    --keep) keep="$2"; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
CLANG=${CLANG:-clang++-19}
command -v "$CLANG" >/dev/null || { echo "clang_cuda_check: $CLANG not found"; exit 1; }

# Exact releases of one CUDA 12.6 toolkit (curand: clang's CUDA wrapper headers include
# curand_mtgp32_kernel.h).
PACKAGES=(
  nvidia-cuda-runtime-cu12==12.6.77
  nvidia-cuda-nvcc-cu12==12.6.77
  nvidia-cuda-cccl-cu12==12.6.77
  nvidia-curand-cu12==10.3.7.77
)
# Disabled warnings, each with its reason:
#   unknown-cuda-version: clang 19 knows CUDA up to 12.5; the 12.6 headers work unchanged.
#   unused-parameter: TVM_FFI_DLL_EXPORT_TYPED_FUNC defines a wrapper with an unused `self`.
WARNINGS=(-Wall -Wextra -Werror -Wno-unknown-cuda-version -Wno-unused-parameter)
SMEM_LIMIT=28672

work=${keep:-$(mktemp -d "${TMPDIR:-/tmp}/muspace-clang-cuda.XXXXXX")}
mkdir -p "$work"
[ -n "$keep" ] || trap 'rm -rf "$work"' EXIT
start=$(date +%s)

# (grep: this machine's pip config names local indexes that may be absent; pip warns per package)
python -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps \
  --no-compile --target "$work/pkgs" "${PACKAGES[@]}" 2> >(grep -v 'is ignored: it is neither' >&2)
nv="$work/pkgs/nvidia"
root="$work/cuda"
mkdir -p "$root/include"
for pkg in cuda_runtime cuda_cccl curand cuda_nvcc; do
  for f in "$nv/$pkg/include/"*; do
    [ "$(basename "$f")" = __init__.py ] || ln -sfn "$f" "$root/include/$(basename "$f")"
  done
done
ln -sfn "$nv/cuda_nvcc/bin" "$root/bin"
ln -sfn "$nv/cuda_nvcc/nvvm" "$root/nvvm"
ln -sfn "$nv/cuda_runtime/lib" "$root/lib64"
for need in include/cuda.h include/cuda_runtime.h bin/ptxas nvvm/libdevice/libdevice.10.bc; do
  [ -e "$root/$need" ] || { echo "clang_cuda_check: CUDA root lacks $need"; exit 1; }
done

mapfile -t FLAGS < <(python - <<'EOF'
import build_utils

includes, _, _ = build_utils._tvm_ffi_paths()
for flag in build_utils.source_flags("cuda", []):
    print(flag)
for path in dict.fromkeys(includes):
    print("-isystem")
    print(path)
EOF
)
mapfile -t SOURCES < <(find csrc -name '*.mu' | sort)
export CLANG root work SMEM_LIMIT
export FLAGS_STR="${FLAGS[*]} ${WARNINGS[*]}"

check_one() {  # "$source $arch [nobf16]": the steps -> $tag.result (status; log on failure)
  local src=$1 arch=$2 variant=${3:-}
  local tag
  tag="$(echo "$src" | tr '/' '_')-$arch${variant:+-$variant}"
  local log="$work/$tag.log" ptx="$work/$tag.ptx"
  exec >"$work/$tag.result"
  local common=(-x cuda -std=c++17 --cuda-path="$root" --cuda-gpu-arch="$arch")
  if [ "$variant" = nobf16 ]; then
    # shellcheck disable=SC2086
    if "$CLANG" "${common[@]}" $FLAGS_STR -DMUSPACE_HAS_BF16=0 -fsyntax-only "$src" >"$log" 2>&1
    then
      echo "ok    $src $arch without bfloat16 (syntax)"
      return 0
    fi
    echo "FAIL  $src $arch without bfloat16 (MUSPACE_HAS_BF16=0: an unguarded bfloat16 use?)"
    sed 's/^/      /' "$log" | head -60
    return 1
  fi
  local step=syntax
  # shellcheck disable=SC2086
  if "$CLANG" "${common[@]}" $FLAGS_STR -fsyntax-only "$src" >"$log" 2>&1; then
    step=ptx
    # shellcheck disable=SC2086
    if "$CLANG" "${common[@]}" $FLAGS_STR -O3 --cuda-device-only -S -o "$ptx" "$src" \
      >>"$log" 2>&1; then
      step=sass
      if "$root/bin/ptxas" -v -arch="$arch" -o "$work/$tag.cubin" "$ptx" >>"$log" 2>&1; then
        local smem
        smem=$(grep -o '[0-9]* bytes smem' "$log" | awk '$1 > m { m = $1 } END { print m + 0 }')
        if [ "$smem" -lt "$SMEM_LIMIT" ]; then
          echo "ok    $src $arch (max static smem $smem bytes)"
          return 0
        fi
        echo "static shared memory $smem bytes >= $SMEM_LIMIT (docs/architecture.md, MUSA portability rules)" >>"$log"
      fi
    fi
  fi
  echo "FAIL  $src $arch at step $step"
  sed 's/^/      /' "$log" | head -60
  return 1
}
export -f check_one

echo "== clang CUDA check: $("$CLANG" --version | head -1); CUDA root from ${PACKAGES[*]}"
status=0
for src in "${SOURCES[@]}"; do
  for arch in $archs; do echo "$src $arch"; done
  echo "$src ${archs%% *} nobf16"
done | xargs -P "$jobs" -L 1 bash -c 'check_one "$0" "$1" "${2:-}"' || status=1
cat "$work"/*.result
n_ok=$(cat "$work"/*.result | grep -c '^ok' || true)
n_fail=$(cat "$work"/*.result | grep -c '^FAIL' || true)
echo "clang CUDA check: $n_ok passed, $n_fail failed (${#SOURCES[@]} sources x ($archs, no-bf16))" \
  "in $(($(date +%s) - start)) s"
[ "$status" -eq 0 ] && [ "$n_fail" -eq 0 ]
