// add_one: the build smoke. Proves that a .mu source compiles for the target, that TVM-FFI
// binds DLPack tensors and that launches honour the caller's stream and the tensor's device.
// Not a public operator.
#include <tvm/ffi/function.h>

#include "checks.muh"
#include "gpu_compat.muh"

namespace muspace {
namespace {

__global__ void add_one_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = x[i] + 1.0f;
  }
}

constexpr int kBlock = 256;

void add_one_forward(TensorView x, TensorView out, int64_t stream) {
  check_gpu_tensor(x, "x");
  check_input(x, "x", x, kFloat32);
  check_input(out, "out", x, kFloat32);
  check_same_shape(out, "out", x, "x");
  const int64_t n = x.numel();
  if (n == 0) return;
  DeviceGuard guard(x.device().device_id);
  const int64_t max_blocks = static_cast<int64_t>(multiprocessor_count(x.device().device_id)) * 8;
  const int64_t wanted = (n + kBlock - 1) / kBlock;
  const int blocks = static_cast<int>(wanted < max_blocks ? wanted : max_blocks);
  add_one_kernel<<<blocks, kBlock, 0, as_stream(stream)>>>(static_cast<const float*>(x.data_ptr()),
                                                           static_cast<float*>(out.data_ptr()), n);
  check_launch("add_one_kernel");
}

// Build facts the Python loader compares with the running device.
int64_t build_warp_size() { return kWarpSize; }
tvm::ffi::String build_backend() { return kGpuBackendName; }

}  // namespace
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one_forward, muspace::add_one_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(build_warp_size, muspace::build_warp_size);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(build_backend, muspace::build_backend);
