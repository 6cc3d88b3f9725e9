// Fused per-group stochastic quantization + bit packing, and the inverse. The format and every arithmetic
// step are specified by act_hf/compress/reference.py; these kernels reproduce it bit for bit:
//   - the uniforms are splitmix64(seed + i * golden) >> 40, scaled by 2^-24 (counter based, no state);
//   - all arithmetic is fp32 with explicit _rn intrinsics, so nvcc cannot contract a*b+c into an FMA;
//   - 64-bit element indexing, current stream, no host synchronisation, no padded copy of the input.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "dispatch.h"
#include "octets.cuh"

namespace act_hf {
namespace {

constexpr int kWarp = 32;
constexpr uint16_t kBf16Nan = 0x7FC0;
constexpr uint16_t kFp16Nan = 0x7E00;

__device__ __forceinline__ float uniform_from_hash(uint64_t seed, uint64_t idx) {
  uint64_t z = seed + idx * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 5.9604644775390625e-8f;  // 2^-24
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

__device__ __forceinline__ uint16_t bf16_bits_round_down(float t) {
  const uint32_t b = __float_as_uint(t);
  uint32_t hi = b >> 16;
  if ((b & 0xFFFFu) && (b >> 31)) hi += 1;  // negative and inexact: one more step of magnitude
  return static_cast<uint16_t>(hi);
}

__device__ __forceinline__ uint16_t bf16_bits_round_up(float t) {  // t >= 0 or +inf
  const uint32_t b = __float_as_uint(t);
  return static_cast<uint16_t>((b >> 16) + ((b & 0xFFFFu) ? 1u : 0u));
}

// Zero-point storage: fp16 for fp16 inputs (the group minimum is exact), bf16 (rounded down) otherwise.
template <typename T>
struct ZeroPoint {
  static constexpr uint16_t kNan = kBf16Nan;
  __device__ static uint16_t encode(float m) { return bf16_bits_round_down(m); }
  __device__ static float decode(uint16_t b) { return bf16_bits_to_float(b); }
};
template <>
struct ZeroPoint<at::Half> {
  static constexpr uint16_t kNan = kFp16Nan;
  __device__ static uint16_t encode(float m) { return __half_as_ushort(__float2half_rn(m)); }
  __device__ static float decode(uint16_t b) { return __half2float(__ushort_as_half(b)); }
};

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }  // c10 types round to nearest even

// Loads elements [i, i+cnt) (cnt <= 8) as floats; one or more 16-byte loads when aligned and full.
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ p, int cnt, bool vec, float (&v)[8]) {
  if (vec && cnt == 8) {
    constexpr int kVec = sizeof(T) * 8 / 16;
    uint4 raw[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) raw[k] = reinterpret_cast<const uint4*>(p)[k];
    const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_float(e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = j < cnt ? to_float(p[j]) : 0.f;
  }
}

// One warp per group. Pass 1: min, max and a non-finite flag over the group's octets; pass 2 (re-reading the
// group from L1/L2): codes, packed one octet (8 elements = B bytes, byte aligned since G % 8 == 0) per lane.
template <typename T, int B>
__global__ void __launch_bounds__(kThreads) quantize_pack_kernel(
    const T* __restrict__ x, int64_t n, int64_t group_size, int64_t n_groups, uint64_t seed, bool vec,
    uint8_t* __restrict__ payload, uint16_t* __restrict__ lo_out, uint16_t* __restrict__ scale_out) {
  constexpr int kLevels = (1 << B) - 1;
  const int lane = threadIdx.x % kWarp;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
  if (g >= n_groups) return;  // uniform across the warp
  const int64_t start = g * group_size;
  const int64_t end = start + group_size < n ? start + group_size : n;

  float mn = INFINITY, mx = -INFINITY;
  int nonfinite = 0;
  for (int64_t i = start + 8 * lane; i < end; i += 8 * kWarp) {
    const int cnt = static_cast<int>(end - i < 8 ? end - i : 8);
    float v[8];
    load8(x + i, cnt, vec, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) {
        nonfinite |= !isfinite(v[j]);
        mn = fminf(mn, v[j]);
        mx = fmaxf(mx, v[j]);
      }
    }
  }
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) {
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    nonfinite |= __shfl_xor_sync(0xffffffffu, nonfinite, off);
  }

  uint16_t lo_bits = ZeroPoint<T>::encode(mn);
  uint16_t scale_bits = bf16_bits_round_up(__fdiv_rn(__fsub_rn(mx, ZeroPoint<T>::decode(lo_bits)), float(kLevels)));
  if (nonfinite) {
    lo_bits = ZeroPoint<T>::kNan;
    scale_bits = kBf16Nan;
  }
  if (lane == 0) {
    lo_out[g] = lo_bits;
    scale_out[g] = scale_bits;
  }
  const float lo = ZeroPoint<T>::decode(lo_bits);
  const float scale = bf16_bits_to_float(scale_bits);
  const bool has_scale = scale > 0.f;  // false for zero range and NaN: codes are 0

  for (int64_t i = start + 8 * lane; i < end; i += 8 * kWarp) {
    const int cnt = static_cast<int>(end - i < 8 ? end - i : 8);
    float v[8];
    load8(x + i, cnt, vec, v);
    uint64_t word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) {
        const float q = has_scale ? __fdiv_rn(__fsub_rn(v[j], lo), scale) : 0.f;
        float c = floorf(__fadd_rn(q, uniform_from_hash(seed, static_cast<uint64_t>(i + j))));
        c = fminf(fmaxf(c, 0.f), static_cast<float>(kLevels));
        word |= static_cast<uint64_t>(c) << (j * B);
      }
    }
    store_octet<B>(payload + (i / 8) * B, word, (cnt * B + 7) / 8);
  }
}

// One thread per octet.
template <typename T, int B>
__global__ void __launch_bounds__(kThreads) unpack_dequantize_kernel(
    const uint8_t* __restrict__ payload, const uint16_t* __restrict__ lo_in, const uint16_t* __restrict__ scale_in,
    int64_t n, int64_t group_size, T* __restrict__ out) {
  constexpr uint64_t kMask = (1u << B) - 1;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  const int cnt = static_cast<int>(n - i < 8 ? n - i : 8);
  const uint64_t word = load_octet<B>(payload + o * B, (cnt * B + 7) / 8);
  const int64_t g = i / group_size;
  const float lo = ZeroPoint<T>::decode(lo_in[g]);
  const float scale = bf16_bits_to_float(scale_in[g]);
  alignas(16) T vals[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float code = static_cast<float>((word >> (j * B)) & kMask);
    vals[j] = from_float<T>(__fadd_rn(lo, __fmul_rn(code, scale)));
  }
  store_octet_values(out + i, vals, cnt, true);  // `out` is a new tensor: aligned
}

template <int B>
__global__ void __launch_bounds__(kThreads) pack_bits_kernel(const uint8_t* __restrict__ codes, int64_t n,
                                                               uint8_t* __restrict__ payload) {
  constexpr uint64_t kMask = (1u << B) - 1;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  const int cnt = static_cast<int>(n - i < 8 ? n - i : 8);
  uint64_t word = 0;
  for (int j = 0; j < cnt; ++j) word |= (static_cast<uint64_t>(codes[i + j]) & kMask) << (j * B);
  store_octet<B>(payload + o * B, word, (cnt * B + 7) / 8);
}

template <int B>
__global__ void __launch_bounds__(kThreads) unpack_bits_kernel(const uint8_t* __restrict__ payload, int64_t n,
                                                                 uint8_t* __restrict__ codes) {
  constexpr uint64_t kMask = (1u << B) - 1;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  const int cnt = static_cast<int>(n - i < 8 ? n - i : 8);
  const uint64_t word = load_octet<B>(payload + o * B, (cnt * B + 7) / 8);
  for (int j = 0; j < cnt; ++j) codes[i + j] = static_cast<uint8_t>((word >> (j * B)) & kMask);
}

}  // namespace

std::vector<at::Tensor> quantize_pack_cuda(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t seed) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const int64_t n_groups = ceil_div(n, group_size);
  auto payload = at::empty({ceil_div(n * bits, 8)}, x.options().dtype(at::kByte));
  auto lo = at::empty({n_groups}, x.options().dtype(at::kShort));
  auto scale = at::empty({n_groups}, x.options().dtype(at::kShort));
  if (n == 0) return {payload, lo, scale};
  const bool vec = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const int64_t blocks = ceil_div(n_groups, kThreads / kWarp);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "act_hf_quantize_pack", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      quantize_pack_kernel<scalar_t, B><<<blocks, kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), n, group_size, n_groups, static_cast<uint64_t>(seed), vec,
          payload.data_ptr<uint8_t>(), reinterpret_cast<uint16_t*>(lo.data_ptr<int16_t>()),
          reinterpret_cast<uint16_t*>(scale.data_ptr<int16_t>()));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {payload, lo, scale};
}

at::Tensor unpack_dequantize_cuda(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale,
                                  int64_t bits, int64_t group_size, int64_t numel, at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(payload.device());
  auto out = at::empty({numel}, payload.options().dtype(dtype));
  if (numel == 0) return out;
  const int64_t blocks = ceil_div(ceil_div(numel, 8), kThreads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "act_hf_unpack_dequantize", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      unpack_dequantize_kernel<scalar_t, B><<<blocks, kThreads, 0, stream>>>(
          payload.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(lo.data_ptr<int16_t>()),
          reinterpret_cast<const uint16_t*>(scale.data_ptr<int16_t>()), numel, group_size, out.data_ptr<scalar_t>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor pack_bits_cuda(const at::Tensor& codes, int64_t bits) {
  const c10::cuda::CUDAGuard guard(codes.device());
  const int64_t n = codes.numel();
  auto payload = at::empty({ceil_div(n * bits, 8)}, codes.options().dtype(at::kByte));
  if (n == 0) return payload;
  const int64_t blocks = ceil_div(ceil_div(n, 8), kThreads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  ACT_BITS_SWITCH(bits, B, [&] {
    pack_bits_kernel<B><<<blocks, kThreads, 0, stream>>>(codes.data_ptr<uint8_t>(), n, payload.data_ptr<uint8_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return payload;
}

at::Tensor unpack_bits_cuda(const at::Tensor& payload, int64_t bits, int64_t numel) {
  const c10::cuda::CUDAGuard guard(payload.device());
  auto codes = at::empty({numel}, payload.options().dtype(at::kByte));
  if (numel == 0) return codes;
  const int64_t blocks = ceil_div(ceil_div(numel, 8), kThreads);
  auto stream = c10::cuda::getCurrentCUDAStream();
  ACT_BITS_SWITCH(bits, B, [&] {
    unpack_bits_kernel<B><<<blocks, kThreads, 0, stream>>>(payload.data_ptr<uint8_t>(), numel,
                                                          codes.data_ptr<uint8_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return codes;
}

}  // namespace act_hf
