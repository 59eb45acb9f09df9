// Probe kernels of the host emulation's own tests (tests/test_host_emulation.py): the warp
// collectives against their definitions, the 16-bit conversions against PyTorch's, the order
// shuffling, and the launch failures (a barrier that not every thread reaches, __trap). Built
// only into the emulated library, next to csrc/ (scripts/build_host_emulation.py --probe).
#include <tvm/ffi/function.h>

#include <cstdint>

#include "checks.muh"
#include "gpu_compat.muh"
#include "launch.muh"

namespace muspace {
namespace {

// out[t] for every thread t of one block: the warp collectives of `op` over in[t].
//   0: __shfl_sync(v, lane + 3, width)   1: __shfl_xor_sync(v, 5, width)
//   2: __shfl_up_sync(v, 2, width)       3: __any_sync(v > 0)   4: __all_sync(v > 0)
__global__ void warp_probe_kernel(const int* in, int* out, int op, int width) {
  const int t = threadIdx.x;
  const int lane = t % kWarpSize;
  const int v = in[t];
  int r = 0;
  switch (op) {
    case 0:
      r = __shfl_sync(kFullMask, v, lane + 3, width);
      break;
    case 1:
      r = __shfl_xor_sync(kFullMask, v, 5, width);
      break;
    case 2:
      r = __shfl_up_sync(kFullMask, v, 2, width);
      break;
    case 3:
      r = __any_sync(kFullMask, v > 0);
      break;
    default:
      r = __all_sync(kFullMask, v > 0);
      break;
  }
  out[t] = r;
}

void warp_probe(TensorView in, TensorView out, int64_t op, int64_t width) {
  const int threads = static_cast<int>(in.numel());
  warp_probe_kernel<<<1, threads, 0, nullptr>>>(data_of<const int>(in), data_of<int>(out),
                                                static_cast<int>(op), static_cast<int>(width));
  check_launch("warp_probe_kernel");
}

// bits -> float of every 16-bit pattern (half if bf16 == 0), and float -> bits of `f`.
__global__ void convert_kernel(const float* f, int64_t n, int bf16, float* widened,
                               int32_t* narrowed) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const unsigned short bits = static_cast<unsigned short>(i & 0xFFFF);
    if (bf16) {
      widened[i] = __uint_as_float(static_cast<unsigned>(bits) << 16);
      narrowed[i] = __float2bfloat16_rn(f[i]).x;
    } else {
      widened[i] = __half2float(__ushort_as_half(bits));
      narrowed[i] = __half_as_ushort(__float2half_rn(f[i]));
    }
  }
}

void convert_probe(TensorView f, TensorView widened, TensorView narrowed, int64_t bf16) {
  convert_kernel<<<64, 256, 0, nullptr>>>(data_of<const float>(f), f.numel(),
                                          static_cast<int>(bf16), data_of<float>(widened),
                                          data_of<int32_t>(narrowed));
  check_launch("convert_kernel");
}

// order[k]: the k-th (block, thread) to run its first step, as block * blockDim + thread.
__global__ void order_kernel(int* order, int* next) {
  const int k = atomicAdd(next, 1);
  order[k] = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
}

void order_probe(TensorView order, TensorView next) {
  order_kernel<<<4, 64, 0, nullptr>>>(data_of<int>(order), data_of<int>(next));
  check_launch("order_kernel");
}

// mode 0: the even threads of a block return, the rest meet at __syncthreads (allowed: exited
// threads do not hold a barrier). mode 1: lane 0 of each warp waits at __syncthreads while the
// other lanes wait at __syncwarp (a deadlock on a GPU). mode 2: thread 7 traps.
__global__ void failure_kernel(int* out, int mode) {
  const int t = threadIdx.x;
  if (mode == 0) {
    if (t % 2 == 0) return;
    __syncthreads();
    out[t] = 1;
  } else if (mode == 1) {
    if (t % kWarpSize == 0) {
      __syncthreads();
    } else {
      __syncwarp(kFullMask);
    }
    out[t] = 1;
  } else {
    if (t == 7) __trap();
    out[t] = 1;
  }
}

void failure_probe(TensorView out, int64_t mode) {
  failure_kernel<<<2, static_cast<int>(out.numel()), 0, nullptr>>>(data_of<int>(out),
                                                                   static_cast<int>(mode));
  check_launch("failure_kernel");
}

}  // namespace
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(emulation_warp_probe, muspace::warp_probe);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(emulation_convert_probe, muspace::convert_probe);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(emulation_order_probe, muspace::order_probe);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(emulation_failure_probe, muspace::failure_probe);
