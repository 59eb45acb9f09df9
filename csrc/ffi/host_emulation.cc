// The scheduler and runtime of the host emulation (host_emulation.h says what it models).
#include "host_emulation.h"

#include <sys/mman.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

// ------------------------------------------------------------------ fiber contexts
// x86-64: a switch saves the callee-saved registers and the FP control words on the old stack and
// loads them from the new one, with no system call. swapcontext also saves the signal mask
// (a system call each time): measured here, it was half of the time of an emulated
// dynamic_scatter test, and this switch made such tests about twice as fast.
#if defined(__x86_64__)
extern "C" void muspace_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl muspace_emu_switch
  .hidden muspace_emu_switch
  .type muspace_emu_switch, @function
muspace_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  fnstcw (%rsp)
  stmxcsr 8(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size muspace_emu_switch, .-muspace_emu_switch
)");

namespace muspace_emu {
namespace {
struct Context {
  void* sp = nullptr;
};
// A context that starts entry() on the stack [base, base + bytes) when first switched to.
void make_context(Context* c, char* base, std::size_t bytes, void (*entry)()) {
  auto* sp =
      reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(base + bytes) & ~uintptr_t{15});
  *--sp = 0;                                  // entry's return address: it never returns
  *--sp = reinterpret_cast<uint64_t>(entry);  // where the switch's `ret` goes
  for (int r = 0; r < 6; ++r) *--sp = 0;      // rbp rbx r12 r13 r14 r15
  sp -= 2;
  uint16_t control_word;
  uint32_t mxcsr;
  asm volatile("fnstcw %0" : "=m"(control_word));
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  std::memcpy(sp, &control_word, sizeof(control_word));
  std::memcpy(reinterpret_cast<char*>(sp) + 8, &mxcsr, sizeof(mxcsr));
  c->sp = sp;
}
void switch_context(Context* from, Context* to) { muspace_emu_switch(&from->sp, to->sp); }
}  // namespace
}  // namespace muspace_emu
#else
namespace muspace_emu {
namespace {
struct Context {
  ucontext_t uc;
};
void make_context(Context* c, char* base, std::size_t bytes, void (*entry)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = base;
  c->uc.uc_stack.ss_size = bytes;
  c->uc.uc_link = nullptr;  // entry() never returns
  makecontext(&c->uc, entry, 0);
}
void switch_context(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
}  // namespace
}  // namespace muspace_emu
#endif

namespace muspace_emu {
namespace {

// Kernels keep small arrays in registers on a GPU; here they live on the fiber's stack.
constexpr std::size_t kStackBytes = 256 * 1024;
constexpr std::size_t kGuardBytes = 4096;
constexpr int kMaxThreadsPerBlock = 1024;
constexpr std::size_t kSlotBytes = 16;
constexpr unsigned char kPoison = 0xA5;  // fills dynamic shared memory and the warp slots

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  Context context;
  uint3 index;
  State state = State::kRunnable;
};

struct Launch {
  void (*body)(void*) = nullptr;
  void* context = nullptr;
  dim3 block;
  int threads = 0;
  std::vector<Fiber> fibers;
  Context scheduler;
  int current = -1;
  std::vector<unsigned char> slots;  // [threads][kSlotBytes]: the warp collectives' values
  std::vector<char> published;       // [threads]
  bool failed = false;
  std::string failure;
};

Launch* g_launch = nullptr;
Error g_last_error = kSuccess;
std::string g_last_message;
std::vector<unsigned char> g_dynamic_shared;
char* g_stacks = nullptr;  // kMaxThreadsPerBlock stacks, each above a guard page

char* stack_of(int thread) {
  if (g_stacks == nullptr) {
    const std::size_t total = (kStackBytes + kGuardBytes) * kMaxThreadsPerBlock;
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "muspace host emulation: cannot map the fiber stacks\n");
      std::abort();
    }
    g_stacks = static_cast<char*>(p);
    for (int t = 0; t < kMaxThreadsPerBlock; ++t) {
      mprotect(g_stacks + t * (kStackBytes + kGuardBytes), kGuardBytes, PROT_NONE);
    }
  }
  return g_stacks + thread * (kStackBytes + kGuardBytes) + kGuardBytes;
}

// MUSPACE_EMULATION_SEED: the seed of the block and thread orders (default 0); "none" runs
// blocks and threads in index order.
std::mt19937_64& order_rng(bool* shuffled) {
  static bool initialised = false;
  static bool shuffle = true;
  static std::mt19937_64 rng;
  if (!initialised) {
    const char* seed = std::getenv("MUSPACE_EMULATION_SEED");
    shuffle = !(seed != nullptr && std::string(seed) == "none");
    rng.seed(seed != nullptr && shuffle ? std::strtoull(seed, nullptr, 10) : 0);
    initialised = true;
  }
  *shuffled = shuffle;
  return rng;
}

[[noreturn]] void fiber_main() {
  Launch& l = *g_launch;
  l.body(l.context);
  Fiber& f = l.fibers[l.current];
  f.state = State::kDone;
  switch_context(&f.context, &l.scheduler);  // never resumed
  std::abort();
}

void suspend(State state) {
  Launch& l = *g_launch;
  Fiber& f = l.fibers[l.current];
  f.state = state;
  switch_context(&f.context, &l.scheduler);
  // Resumed: the scheduler set threadIdx for this fiber.
}

int warp_of(int thread) { return thread / warpSize; }

// Releases the fibers waiting at a barrier that every live fiber of its scope reached; false
// when none could be released (a deadlock: some live thread never reaches the barrier).
bool release_barriers(Launch& l) {
  int alive = 0, at_block = 0;
  for (const Fiber& f : l.fibers) {
    alive += f.state != State::kDone;
    at_block += f.state == State::kAtBlockBarrier;
  }
  bool released = false;
  const int warps = (l.threads + warpSize - 1) / warpSize;
  for (int w = 0; w < warps; ++w) {
    const int begin = w * warpSize, end = std::min(l.threads, begin + warpSize);
    int live = 0, waiting = 0;
    for (int t = begin; t < end; ++t) {
      live += l.fibers[t].state != State::kDone;
      waiting += l.fibers[t].state == State::kAtWarpBarrier;
    }
    if (waiting > 0 && waiting == live) {
      for (int t = begin; t < end; ++t) {
        if (l.fibers[t].state == State::kAtWarpBarrier) l.fibers[t].state = State::kRunnable;
      }
      released = true;
    }
  }
  if (!released && at_block > 0 && at_block == alive) {
    for (Fiber& f : l.fibers) {
      if (f.state == State::kAtBlockBarrier) f.state = State::kRunnable;
    }
    released = true;
  }
  return released;
}

void fail(Launch& l, const std::string& why) {
  if (!l.failed) {
    l.failed = true;
    l.failure = why;
  }
}

void run_block(Launch& l, std::mt19937_64& rng, bool shuffled) {
  for (int t = 0; t < l.threads; ++t) {
    Fiber& f = l.fibers[t];
    f.index = uint3{static_cast<unsigned>(t % l.block.x),
                    static_cast<unsigned>(t / l.block.x % l.block.y),
                    static_cast<unsigned>(t / (l.block.x * l.block.y))};
    f.state = State::kRunnable;
    make_context(&f.context, stack_of(t), kStackBytes, fiber_main);
  }
  std::fill(l.published.begin(), l.published.end(), 0);
  std::vector<int> order(l.threads);
  for (;;) {
    order.clear();
    for (int t = 0; t < l.threads; ++t) {
      if (l.fibers[t].state == State::kRunnable) order.push_back(t);
    }
    if (shuffled) std::shuffle(order.begin(), order.end(), rng);
    for (int t : order) {
      l.current = t;
      threadIdx = l.fibers[t].index;
      switch_context(&l.scheduler, &l.fibers[t].context);
      if (l.failed) return;
    }
    bool done = true;
    for (const Fiber& f : l.fibers) done = done && f.state == State::kDone;
    if (done) return;
    if (!release_barriers(l)) {
      fail(l, "a barrier that not every live thread of its block (or warp) reaches");
      return;
    }
  }
}

}  // namespace

void block_barrier() { suspend(State::kAtBlockBarrier); }
void warp_barrier() { suspend(State::kAtWarpBarrier); }

void trap() {
  Launch& l = *g_launch;
  fail(l, "__trap() in thread " + std::to_string(l.current) + " of block (" +
              std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ")");
  // Never resumed: the launch ends at the scheduler.
  Fiber& f = l.fibers[l.current];
  switch_context(&f.context, &l.scheduler);
  std::abort();
}

int lane_id() { return g_launch->current % warpSize; }

void warp_publish(const void* value, std::size_t bytes) {
  Launch& l = *g_launch;
  std::memcpy(&l.slots[l.current * kSlotBytes], value, std::min(bytes, kSlotBytes));
  l.published[l.current] = 1;
  warp_barrier();
}

const void* lane_value(int lane) {
  Launch& l = *g_launch;
  const int t = warp_of(l.current) * warpSize + lane;
  if (lane < 0 || lane >= warpSize || t >= l.threads || !l.published[t]) return nullptr;
  return &l.slots[t * kSlotBytes];
}

void warp_release() {
  Launch& l = *g_launch;
  warp_barrier();
  // Every lane has read: clear this lane's mark (a lane that exits later is then not read).
  l.published[l.current] = 0;
}

void* dynamic_shared_memory() { return g_dynamic_shared.data(); }

void run_grid(const char* kernel, dim3 grid, dim3 block, std::size_t dynamic_shared,
              void (*body)(void*), void* context) {
  const long long threads = static_cast<long long>(block.x) * block.y * block.z;
  const long long blocks = static_cast<long long>(grid.x) * grid.y * grid.z;
  if (threads <= 0 || threads > kMaxThreadsPerBlock || blocks <= 0 || dynamic_shared > (1u << 20)) {
    g_last_error = kInvalidValue;
    g_last_message = std::string(kernel) + ": invalid launch configuration (block of " +
                     std::to_string(threads) + " threads, " + std::to_string(blocks) + " blocks)";
    return;
  }
  Launch l;
  l.body = body;
  l.context = context;
  l.block = block;
  l.threads = static_cast<int>(threads);
  l.fibers.resize(l.threads);
  l.slots.assign(l.threads * kSlotBytes, kPoison);
  l.published.assign(l.threads, 0);
  g_launch = &l;
  blockDim = block;
  gridDim = grid;
  bool shuffled = false;
  std::mt19937_64& rng = order_rng(&shuffled);
  std::vector<long long> order(blocks);
  for (long long b = 0; b < blocks; ++b) order[b] = b;
  if (shuffled) std::shuffle(order.begin(), order.end(), rng);
  for (long long b : order) {
    blockIdx = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                     static_cast<unsigned>(b / (static_cast<long long>(grid.x) * grid.y))};
    g_dynamic_shared.assign(dynamic_shared + 16, kPoison);
    run_block(l, rng, shuffled);
    if (l.failed) break;
  }
  g_launch = nullptr;
  if (l.failed) {
    g_last_error = kLaunchFailure;
    g_last_message = std::string(kernel) + ": " + l.failure;
  }
}

Error get_last_error() {
  const Error e = g_last_error;
  g_last_error = kSuccess;
  return e;
}

const char* error_string(Error e) {
  if (e == kSuccess) return "no error";
  return g_last_message.empty() ? "host emulation error" : g_last_message.c_str();
}

Error device_attribute(int* value, DeviceAttr attribute, int device) {
  if (device != 0) return kInvalidValue;
  switch (attribute) {
    // Few multiprocessors keep grid-stride launches small (fewer fibers); the kernels' results
    // do not depend on it. MUSPACE_EMULATION_SMS overrides it.
    case kMultiProcessorCount: {
      const char* sms = std::getenv("MUSPACE_EMULATION_SMS");
      *value = sms != nullptr ? std::max(1, std::atoi(sms)) : 4;
      return kSuccess;
    }
    case kComputeCapabilityMajor:
      *value = 0;  // no tensor-core paths (MUSPACE_HAS_WMMA is 0 here)
      return kSuccess;
    case kMaxSharedMemoryPerBlock:
      *value = MUSPACE_EMULATED_WARP_SIZE == 128 ? 28 * 1024 : 48 * 1024;
      return kSuccess;
  }
  return kInvalidValue;
}

Error memcpy_async(void* dst, const void* src, std::size_t bytes, MemcpyKind, Stream*) {
  std::memcpy(dst, src, bytes);
  return kSuccess;
}

Error host_alloc(void** p, std::size_t bytes, unsigned) {
  *p = std::malloc(bytes);
  return *p != nullptr ? kSuccess : kInvalidValue;
}

Error event_create(Event** event, unsigned) {
  *event = nullptr;
  return kSuccess;
}

}  // namespace muspace_emu

namespace {
// A vote of the warp's live lanes: (any, all) of their predicates.
std::pair<int, int> vote(int predicate) {
  const int p = predicate != 0;
  muspace_emu::warp_publish(&p, sizeof(p));
  int any = 0, all = 1;
  for (int lane = 0; lane < warpSize; ++lane) {
    if (const void* v = muspace_emu::lane_value(lane)) {
      any |= *static_cast<const int*>(v);
      all &= *static_cast<const int*>(v);
    }
  }
  muspace_emu::warp_release();
  return {any, all};
}
}  // namespace

int __any_sync(unsigned, int predicate) { return vote(predicate).first; }
int __all_sync(unsigned, int predicate) { return vote(predicate).second; }

// ------------------------------------------------------------------ 16-bit floats
float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.x & 0x8000u) << 16;
  const uint32_t exponent = (h.x >> 10) & 0x1Fu;
  uint32_t mantissa = h.x & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    bits = sign | (static_cast<uint32_t>(e) << 23) | ((mantissa & 0x3FFu) << 13);
  }
  return emu_bits<float>(bits);
}

__half __float2half_rn(float f) {
  const uint32_t bits = emu_bits<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return __half{static_cast<unsigned short>(sign | 0x7E00u)};   // NaN
  if (magnitude >= 0x477FF000u) return __half{static_cast<unsigned short>(sign | 0x7C00u)};  // inf
  if (magnitude < 0x33000001u) return __half{sign};  // rounds to zero (2^-25 ties to even: 0)
  const int exponent = static_cast<int>(magnitude >> 23) - 127;
  uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
  int shift;  // bits of the 24-bit significand dropped
  uint32_t base;
  if (exponent < -14) {  // subnormal half
    shift = 13 + (-14 - exponent);
    base = 0;
  } else {
    shift = 13;
    base = static_cast<uint32_t>(exponent + 15) << 10;
    mantissa &= 0x7FFFFFu;
  }
  const uint32_t kept = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t half_way = 1u << (shift - 1);
  uint32_t result = base + kept;  // a carry out of the mantissa bumps the exponent, as it should
  if (rest > half_way || (rest == half_way && (kept & 1u))) ++result;
  return __half{static_cast<unsigned short>(sign | result)};
}

float __bfloat162float(__emu_bfloat16 b) {
  return emu_bits<float>(static_cast<uint32_t>(b.x) << 16);
}

__emu_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t bits = emu_bits<uint32_t>(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    return __emu_bfloat16{static_cast<unsigned short>((bits >> 16) | 0x40u)};  // quiet NaN
  }
  const uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
  return __emu_bfloat16{static_cast<unsigned short>(rounded >> 16)};
}
