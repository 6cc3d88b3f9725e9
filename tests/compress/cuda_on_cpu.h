// CUDA's device built-ins for the host, so that act_hf's kernels run as written on CPU tensors
// (tests/compress/emulated_kernels.py builds csrc/ with it, each `kernel<<<grid, block, smem, stream>>>(args)`
// rewritten as `act_hf_emulation::launch(grid, block, smem, stream)(kernel, args)`).
//
// A launch runs its blocks one after another on the calling thread; the threads of a block are fibers
// (ucontext), each run until it ends or waits at __syncthreads or a warp shuffle. A wait is released once every
// thread of the block (of the warp, for a shuffle) that has not returned waits there too; a wait nothing can
// release (threads of a warp at different shuffles, a __syncthreads some threads skip) aborts with a message, where
// a GPU would hang or be undefined. `__shared__` variables are statics: one copy, which each block's threads share
// while that block runs. Device arithmetic is the host's in fp32 (the build passes -ffp-contract=off, so nothing is
// fused that the kernels' _rn intrinsics keep apart).
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime.h>  // dim3, uint3, uint4; its host build defines __global__ & co. as attributes

#include <math.h>  // isfinite, fminf, fmaxf, floorf: device functions of the global namespace
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)

inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace act_hf_emulation {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = 64 * 1024;

enum class Wait { kNone, kWarp, kBlock };

struct Fiber {
  ucontext_t context;
  char* stack = nullptr;
  Wait wait = Wait::kNone;
  bool done = false;
};

// The block being run: its fibers, the scheduler's context and the slots a warp shuffle exchanges through.
struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  std::vector<uint64_t> slots;
  const std::function<void()>* body = nullptr;
  int current = -1;
};

inline Block* running = nullptr;

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "act_hf kernel emulation: %s\n", what.c_str());
  std::abort();
}

inline void fiber_entry() {
  (*running->body)();
  running->fibers[running->current].done = true;  // uc_link returns to the scheduler
}

// Suspends the running thread until the block's scheduler releases `kind`'s wait.
inline void wait_at(Wait kind) {
  if (running == nullptr) fail("a __syncthreads or shuffle outside a launch");
  Fiber& self = running->fibers[running->current];
  self.wait = kind;
  swapcontext(&self.context, &running->scheduler);
}

// Releases the waits every live thread of [first, last) has reached, if they are all of `kind`; true if it did.
// A warp's shuffle names all 32 lanes (the kernels' full masks): one that has returned makes it undefined.
inline bool release(Block& block, int first, int last, Wait kind) {
  bool any = false, returned = false;
  for (int t = first; t < last; ++t) {
    const Fiber& f = block.fibers[t];
    returned |= f.done;
    if (f.done) continue;
    if (f.wait != kind) return false;
    any = true;
  }
  if (!any) return false;
  if (kind == Wait::kWarp && returned) {
    fail("block " + std::to_string(blockIdx.x) + ", warp " + std::to_string(first / kWarpSize) +
         ": a shuffle after some of its lanes returned");
  }
  for (int t = first; t < last; ++t) block.fibers[t].wait = Wait::kNone;
  return true;
}

inline void run_block(Block& block, int threads) {
  for (int t = 0; t < threads; ++t) {
    Fiber& f = block.fibers[t];
    f.wait = Wait::kNone;
    f.done = false;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &block.scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  for (;;) {
    bool live = false;
    for (int t = 0; t < threads; ++t) {
      Fiber& f = block.fibers[t];
      if (!f.done && f.wait == Wait::kNone) {
        block.current = t;
        threadIdx = uint3{static_cast<unsigned>(t), 0, 0};
        swapcontext(&block.scheduler, &f.context);
      }
      live |= !f.done;
    }
    if (!live) return;
    bool released = release(block, 0, threads, Wait::kBlock);
    for (int w = 0; w < threads; w += kWarpSize) {
      released |= release(block, w, std::min(w + kWarpSize, threads), Wait::kWarp);
    }
    if (!released) fail("block " + std::to_string(blockIdx.x) + ": its threads wait where nothing releases them");
  }
}

// Thread t's fiber stack, kept from one launch to the next (launches do not nest): allocating and clearing a
// block's stacks took most of a small launch's time.
inline char* fiber_stack(int t) {
  static std::vector<std::unique_ptr<char[]>> pool;
  while (static_cast<int>(pool.size()) <= t) pool.emplace_back(new char[kStackBytes]);
  return pool[t].get();
}

// `launch(grid, block, smem, stream)(kernel, args...)`: kernel(args...) for every thread of a 1-D grid.
struct Launch {
  int64_t grid;
  int64_t threads;

  template <typename Kernel, typename... Args>
  void operator()(Kernel kernel, Args... args) const {
    if (grid <= 0 || threads <= 0 || threads > 1024) {  // CUDA's invalid configurations
      fail("a launch of " + std::to_string(grid) + " blocks of " + std::to_string(threads) + " threads");
    }
    const std::function<void()> body = [&] { kernel(args...); };
    Block block;
    block.fibers.resize(threads);
    for (int t = 0; t < threads; ++t) block.fibers[t].stack = fiber_stack(t);
    block.slots.resize(threads);
    block.body = &body;
    Block* outer = running;
    running = &block;
    blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
    gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
    for (int64_t b = 0; b < grid; ++b) {
      blockIdx = uint3{static_cast<unsigned>(b), 0, 0};
      run_block(block, static_cast<int>(threads));
    }
    running = outer;
  }
};

template <typename Stream>
Launch launch(int64_t grid, int64_t threads, int64_t /*shared_bytes*/, const Stream& /*stream*/) {
  return Launch{grid, threads};
}

}  // namespace act_hf_emulation

template <typename T>
T __shfl_xor_sync(unsigned /*mask*/, T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  using act_hf_emulation::running;
  const int t = static_cast<int>(threadIdx.x), lane = t % act_hf_emulation::kWarpSize;
  std::memcpy(&running->slots[t], &value, sizeof(T));
  act_hf_emulation::wait_at(act_hf_emulation::Wait::kWarp);
  T out;
  std::memcpy(&out, &running->slots[t - lane + (lane ^ lane_mask)], sizeof(T));
  act_hf_emulation::wait_at(act_hf_emulation::Wait::kWarp);  // no lane writes its slot again before all have read
  return out;
}

inline void __syncthreads() { act_hf_emulation::wait_at(act_hf_emulation::Wait::kBlock); }

inline unsigned int atomicMax(unsigned int* address, unsigned int value) {  // one host thread runs every fiber
  const unsigned int old = *address;
  if (value > old) *address = value;
  return old;
}

inline uint32_t max(uint32_t a, uint32_t b) { return a > b ? a : b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }

// The host side's CUDA calls (their headers are dropped from the sources): a device guard that guards nothing, the
// stream a launch ignores and a launch check with nothing to check.
namespace c10::cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
inline int getCurrentCUDAStream() { return 0; }
}  // namespace c10::cuda
#define C10_CUDA_KERNEL_LAUNCH_CHECK() \
  do {                                  \
  } while (0)
