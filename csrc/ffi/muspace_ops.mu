// add_one: the build smoke. Proves that a .mu source compiles for the target, that TVM-FFI
// binds DLPack tensors and that launches honour the caller's stream and the tensor's device.
// Not a public operator. Also the library's build facts (build_facts.muh).
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <map>
#include <sstream>
#include <string>

#include "build_facts.muh"
#include "checks.muh"
#include "gpu_compat.muh"
#include "launch.muh"

namespace muspace {
namespace {

std::map<std::string, int64_t>& limits() {
  static std::map<std::string, int64_t> registry;  // sorted keys
  return registry;
}

}  // namespace

bool register_limit(const char* key, int64_t value) {
  limits()[key] = value;
  return true;
}

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

// {"backend", "bf16", "compiler", "limits": {"<op>.<name>": int}, "musa_arch", "warp_size"}:
// keys sorted, one line.
tvm::ffi::String muspace_build_facts() {
  std::ostringstream json;
  json << "{\"backend\": \"" << kGpuBackendName
       << "\", \"bf16\": " << (MUSPACE_HAS_BF16 ? "true" : "false") << ", \"compiler\": \""
       << kCompiler << "\", \"limits\": {";
  const char* sep = "";
  for (const auto& [key, value] : limits()) {
    json << sep << "\"" << key << "\": " << value;
    sep = ", ";
  }
  json << "}, \"musa_arch\": ";
  if (kMusaArch > 0) {
    json << kMusaArch;
  } else {
    json << "null";
  }
  json << ", \"warp_size\": " << kWarpSize << "}";
  return json.str();
}

}  // namespace
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one_forward, muspace::add_one_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(build_warp_size, muspace::build_warp_size);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(build_backend, muspace::build_backend);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(muspace_build_facts, muspace::muspace_build_facts);
