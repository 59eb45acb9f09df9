// Host emulation of the GPU dialect: the kernels of csrc/ run unchanged on the CPU, for tests
// of the kernel source on machines without a GPU (CI), and for MUSA's 128-lane warps, which no
// machine here has. gpu_compat.muh includes this file instead of a vendor runtime when
// MUSPACE_BUILD_HOST_EMULATION is defined; scripts/build_host_emulation.py builds the library
// (g++, with every `kernel<<<grid, block, shared, stream>>>(args)` rewritten into
// `muspace_emu::launch(...)`). docs/host_emulation.md says what it checks and what it cannot.
//
// Model: a launch runs its blocks one after another, in a shuffled order. The threads of a block
// are fibers (ucontext) on the calling thread, run one at a time, each until it reaches a
// barrier (__syncthreads, or a warp collective: __syncwarp, shuffles, votes) or returns; the
// order of the threads between two barriers is shuffled too. So the emulation finds logic
// errors, results that depend on the order of threads or blocks, and barriers that not every
// thread reaches (reported as an error of the launch), but not data races, memory-model or
// timing problems: those need compute-sanitizer on a GPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#ifndef MUSPACE_EMULATED_WARP_SIZE
#define MUSPACE_EMULATED_WARP_SIZE 32
#endif

// ------------------------------------------------------------------ qualifiers and built-ins
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Blocks run one at a time, so a function-local static is the block's shared memory.
#define __shared__ static
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
// Set by the scheduler before it resumes a fiber; defined in host_emulation.cc (opaque to the
// kernels' translation units, so every read after a barrier call is a fresh load).
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;
constexpr int warpSize = MUSPACE_EMULATED_WARP_SIZE;

struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// 16-bit floats as raw bits; conversions round to nearest even (host_emulation.cc).
struct alignas(2) __half {
  unsigned short x;
};
struct alignas(2) __emu_bfloat16 {
  unsigned short x;
};
float __half2float(__half h);
__half __float2half_rn(float f);
inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
float __bfloat162float(__emu_bfloat16 b);
__emu_bfloat16 __float2bfloat16_rn(float f);

// ------------------------------------------------------------------ device intrinsics
template <typename To, typename From>
inline To emu_bits(From x) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To to;
  std::memcpy(&to, &x, sizeof(To));
  return to;
}
inline float __uint_as_float(unsigned x) { return emu_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return emu_bits<unsigned>(x); }
inline float __int_as_float(int x) { return emu_bits<float>(x); }
inline int __float_as_int(float x) { return emu_bits<int>(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
// One thread runs at a time: a fence orders nothing further.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}

// The math functions that CUDA declares at global scope.
using std::isfinite;
using std::isinf;
using std::isnan;

// CUDA's overloads of min / max for mixed integer and float arguments.
#define MUSPACE_EMU_MINMAX(T)                      \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
MUSPACE_EMU_MINMAX(int)
MUSPACE_EMU_MINMAX(unsigned)
MUSPACE_EMU_MINMAX(long)
MUSPACE_EMU_MINMAX(unsigned long)
MUSPACE_EMU_MINMAX(long long)
MUSPACE_EMU_MINMAX(unsigned long long)
MUSPACE_EMU_MINMAX(float)
#undef MUSPACE_EMU_MINMAX

// Atomics: one thread runs at a time, so a read-modify-write is atomic as written.
// Scalars only, as on a GPU of before sm_90 (vector_atomics.muh then takes its scalar path).
#define MUSPACE_EMU_ATOMIC(NAME, EXPR)                                                    \
  template <typename T, typename V, typename = std::enable_if_t<std::is_arithmetic_v<T>>> \
  inline T NAME(T* p, V value) {                                                          \
    const T old = *p;                                                                     \
    const T v = static_cast<T>(value);                                                    \
    *p = (EXPR);                                                                          \
    return old;                                                                           \
  }
MUSPACE_EMU_ATOMIC(atomicAdd, old + v)
MUSPACE_EMU_ATOMIC(atomicSub, old - v)
MUSPACE_EMU_ATOMIC(atomicOr, old | v)
MUSPACE_EMU_ATOMIC(atomicAnd, old& v)
MUSPACE_EMU_ATOMIC(atomicXor, old ^ v)
MUSPACE_EMU_ATOMIC(atomicMin, v < old ? v : old)
MUSPACE_EMU_ATOMIC(atomicMax, old < v ? v : old)
MUSPACE_EMU_ATOMIC(atomicExch, v)
#undef MUSPACE_EMU_ATOMIC
template <typename T, typename C, typename V>
inline T atomicCAS(T* p, C compare, V value) {
  const T old = *p;
  if (old == static_cast<T>(compare)) *p = static_cast<T>(value);
  return old;
}

namespace muspace_emu {

// Barriers: they suspend the calling fiber until every live thread of its block (warp) arrived.
void block_barrier();
void warp_barrier();
[[noreturn]] void trap();

// A warp collective: every live lane of the warp publishes `bytes` (<= 16) of its value; the
// call returns when all have. The lanes' values are then readable through lane_value() until
// warp_release(), which every lane calls after reading.
void warp_publish(const void* value, std::size_t bytes);
const void* lane_value(int lane);  // nullptr for a lane that has exited
void warp_release();
int lane_id();

template <typename T>
inline T shuffle_from(T value, int source_lane) {
  static_assert(sizeof(T) <= 16, "shuffled values are at most 16 bytes");
  warp_publish(&value, sizeof(T));
  const void* p = lane_value(source_lane);
  T out = value;
  // A lane that has exited leaves nothing to read: the result is then unspecified (as on a GPU);
  // the emulation gives the reader its own value.
  if (p != nullptr) std::memcpy(&out, p, sizeof(T));
  warp_release();
  return out;
}

}  // namespace muspace_emu

inline void __syncthreads() { muspace_emu::block_barrier(); }
inline void __syncwarp(unsigned = ~0u) { muspace_emu::warp_barrier(); }
[[noreturn]] inline void __trap() { muspace_emu::trap(); }

template <typename T>
inline T __shfl_sync(unsigned, T value, int source, int width = warpSize) {
  const int lane = muspace_emu::lane_id();
  return muspace_emu::shuffle_from(value, (lane & ~(width - 1)) + (source & (width - 1)));
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask, int width = warpSize) {
  const int lane = muspace_emu::lane_id();
  const int source = lane ^ lane_mask;
  const bool inside = (source & ~(width - 1)) == (lane & ~(width - 1));
  return muspace_emu::shuffle_from(value, inside ? source : lane);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T value, unsigned delta, int width = warpSize) {
  const int lane = muspace_emu::lane_id();
  const bool inside = (lane & (width - 1)) >= static_cast<int>(delta);
  return muspace_emu::shuffle_from(value, inside ? lane - static_cast<int>(delta) : lane);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T value, unsigned delta, int width = warpSize) {
  const int lane = muspace_emu::lane_id();
  const bool inside = (lane & (width - 1)) + static_cast<int>(delta) < width;
  return muspace_emu::shuffle_from(value, inside ? lane + static_cast<int>(delta) : lane);
}
int __any_sync(unsigned mask, int predicate);
int __all_sync(unsigned mask, int predicate);

// ------------------------------------------------------------------ runtime
namespace muspace_emu {

struct Stream;  // streams are only handles: every launch and copy completes before it returns
struct Event;
enum Error : int {
  kSuccess = 0,
  kLaunchFailure = 719,  // a kernel trapped or its threads could not all reach a barrier
  kInvalidValue = 1,
  kNotReady = 600,
};
enum DeviceAttr : int {
  kMultiProcessorCount,
  kComputeCapabilityMajor,
  kMaxSharedMemoryPerBlock,
};
enum MemcpyKind : int { kDeviceToHost = 2 };
constexpr unsigned kEventDisableTiming = 2;
constexpr unsigned kHostAllocPortable = 1;

Error get_last_error();
const char* error_string(Error e);
inline Error get_device(int* device) {
  *device = 0;
  return kSuccess;
}
inline Error set_device(int device) { return device == 0 ? kSuccess : kInvalidValue; }
Error device_attribute(int* value, DeviceAttr attribute, int device);
Error memcpy_async(void* dst, const void* src, std::size_t bytes, MemcpyKind, Stream*);
Error host_alloc(void** p, std::size_t bytes, unsigned flags);
Error event_create(Event** event, unsigned flags);
inline Error event_record(Event*, Stream*) { return kSuccess; }
inline Error event_query(Event*) { return kSuccess; }

// The launch: run `body` for every thread of grid x block.
void run_grid(const char* kernel, dim3 grid, dim3 block, std::size_t dynamic_shared,
              void (*body)(void*), void* context);
void* dynamic_shared_memory();

// `kernel` is a generic lambda that calls the kernel (the rewrite of a `<<<>>>` launch), so the
// kernel's template arguments are deduced from the arguments as in a launch.
template <typename Kernel, typename... Args>
void launch(const char* name, dim3 grid, dim3 block, std::size_t dynamic_shared, Stream*,
            Kernel kernel, Args&&... args) {
  // The arguments are evaluated once; each thread's call copies them into its parameters.
  std::tuple<std::decay_t<Args>...> params(std::forward<Args>(args)...);
  auto call = [&]() { std::apply(kernel, params); };
  run_grid(
      name, grid, block, dynamic_shared, [](void* c) { (*static_cast<decltype(call)*>(c))(); },
      &call);
}

}  // namespace muspace_emu
