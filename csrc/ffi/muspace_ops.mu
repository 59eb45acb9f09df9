// add_one: the build smoke. Proves that a .mu source compiles for the target, that TVM-FFI
// binds DLPack tensors and that launches honour the caller's stream and the tensor's device.
// Not a public operator.
#include <tvm/ffi/function.h>

#include "checks.muh"
#include "gpu_compat.muh"
#include "launch.muh"

namespace muspace {
namespace {

__global__ void add_one_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) out[i] = x[i] + 1.0f;
}

constexpr int kBlock = 256;
constexpr int kBlocksPerSM = 8;

void add_one_forward(TensorView x, TensorView out, int64_t stream) {
  check_gpu_tensor(x, "x");
  check_input(x, "x", x, kFloat32);
  check_input(out, "out", x, kFloat32);
  check_same_shape(out, "out", x, "x");
  const int64_t n = x.numel();
  if (n == 0) return;
  const int device_id = x.device().device_id;
  DeviceGuard guard(device_id);
  add_one_kernel<<<grid_for(n, kBlock, device_id, kBlocksPerSM), kBlock, 0, as_stream(stream)>>>(
      data_of<const float>(x), data_of<float>(out), n);
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
