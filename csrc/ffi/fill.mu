// The library's one fill kernel and its launcher (declared in launch.muh).
#include <cstdint>

#include "gpu_compat.muh"
#include "launch.muh"

namespace muspace {
namespace {

constexpr int kFillBlock = 256;
constexpr int kFillBlocksPerSM = 16;

__device__ __forceinline__ unsigned char byte_of(uint32_t word, uintptr_t address) {
  return static_cast<unsigned char>(word >> (8 * (address % 4)));
}

// 16-byte stores for the aligned body (it starts 16-byte aligned: in phase with `word`), single
// bytes for the head and the tail.
__global__ void __launch_bounds__(kFillBlock)
    fill_kernel(unsigned char* __restrict__ p, int64_t n_bytes, uint32_t word) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const int64_t head = min(n_bytes, static_cast<int64_t>((16 - base % 16) % 16));
  const int64_t n_vec = (n_bytes - head) / 16;
  const int64_t tid = global_thread();
  const int64_t stride = global_threads();
  uint4* body = reinterpret_cast<uint4*>(p + head);
  const uint4 words = make_uint4(word, word, word, word);
  for (int64_t i = tid; i < n_vec; i += stride) body[i] = words;
  if (tid < head) p[tid] = byte_of(word, base + tid);
  for (int64_t i = head + n_vec * 16 + tid; i < n_bytes; i += stride)
    p[i] = byte_of(word, base + i);
}

}  // namespace

void launch_fill(void* p, int64_t n_bytes, uint32_t word, int device_id, gpuStream_t stream,
                 const char* what) {
  if (n_bytes <= 0) return;
  const int grid = grid_for(n_bytes / 16 + 1, kFillBlock, device_id, kFillBlocksPerSM);
  fill_kernel<<<grid, kFillBlock, 0, stream>>>(static_cast<unsigned char*>(p), n_bytes, word);
  check_launch(what);
}

}  // namespace muspace
