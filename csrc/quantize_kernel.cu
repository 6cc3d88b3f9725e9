// Fused per-group stochastic quantization + bit packing, and the inverse. The format and every arithmetic
// step are specified by act_hf/compress/reference.py; these kernels reproduce it bit for bit:
//   - the uniforms are 24-bit fields of splitmix64(seed + p * golden), one hash per pair of elements p (counter
//     based, no state), and a group's codes multiply by the reciprocal of its scale (quantize_octets.cuh);
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
#include "quantize_octets.cuh"

namespace act_hf {
namespace {

constexpr int kWarp = 32;

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

// Channel scaling of the quantize kernels: element i times 2^shifts[i % channels] (Scaled only). lane_step is a
// lane's move from one octet to its next, modulo channels; small_index: indices fit 32 bits.
struct ChannelScaling {
  const int32_t* shifts;
  int64_t channels;
  int64_t lane_step;
  bool small_index;
};

// One warp per group, for the group sizes other than 32, 64, ..., 1024 (those: quantize_pack_lanes_kernel).
// Pass 1: min, max and a non-finite flag over the group's octets; pass 2 (re-reading the group from L1/L2): codes,
// packed one octet (8 elements = B bytes, byte aligned since G % 8 == 0) per lane.
// Scaled: each value is first multiplied by its channel's power of two (quantize_octets.cuh: scale_octet);
// Normalized: each value is first normalized by its channel of dim 1 (normalize_octet).
template <typename T, int B, bool Scaled, bool Normalized>
__global__ void __launch_bounds__(kThreads) quantize_pack_kernel(
    const T* __restrict__ x, int64_t n, int64_t group_size, int64_t n_groups, uint64_t seed, bool vec,
    ChannelScaling scaling, ChannelFactors norm, uint8_t* __restrict__ payload, uint16_t* __restrict__ lo_out,
    uint16_t* __restrict__ scale_out) {
  const int lane = threadIdx.x % kWarp;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
  if (g >= n_groups) return;  // uniform across the warp
  const int64_t start = g * group_size;
  const int64_t end = start + group_size < n ? start + group_size : n;
  int64_t c0 = 0;  // the channel of the lane's first element (Scaled)
  if constexpr (Scaled) {
    const int64_t first = start + 8 * lane;
    c0 = scaling.small_index
             ? static_cast<int64_t>(static_cast<uint32_t>(first) % static_cast<uint32_t>(scaling.channels))
             : first % scaling.channels;  // a 64-bit remainder is a long routine: once per lane and group
  }

  float mn = INFINITY, mx = -INFINITY;
  int nonfinite = 0;
  int64_t c = c0;
  for (int64_t i = start + 8 * lane; i < end; i += 8 * kWarp) {
    const int cnt = static_cast<int>(end - i < 8 ? end - i : 8);
    float v[8];
    load8(x + i, cnt, vec, v);
    if constexpr (Scaled) {
      scale_octet(v, cnt, scaling.shifts, scaling.channels, c);
      c = advance_channel(c, scaling.lane_step, scaling.channels);
    }
    if constexpr (Normalized) normalize_octet(v, norm, i);
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

  uint16_t lo_bits, scale_bits;
  group_metadata<T, B>(mn, mx, nonfinite, lo_bits, scale_bits);
  if (lane == 0) {
    lo_out[g] = lo_bits;
    scale_out[g] = scale_bits;
  }
  const GroupFactors factors = group_factors<T>(lo_bits, scale_bits);

  c = c0;
  for (int64_t i = start + 8 * lane; i < end; i += 8 * kWarp) {
    const int cnt = static_cast<int>(end - i < 8 ? end - i : 8);
    float v[8];
    load8(x + i, cnt, vec, v);
    if constexpr (Scaled) {
      scale_octet(v, cnt, scaling.shifts, scaling.channels, c);
      c = advance_channel(c, scaling.lane_step, scaling.channels);
    }
    if constexpr (Normalized) normalize_octet(v, norm, i);
    const uint64_t word = quantize_octet<B>(v, cnt, factors, seed, i);
    store_octet<B>(payload + (i / 8) * B, word, (cnt * B + 7) / 8);
  }
}

// Groups of kOctets * `lanes` octets, `lanes` a power of two up to kWarp (group sizes 32, 64, ..., 1024): a group is a
// sub-warp of `lanes` lanes, and lane s of it takes the group's octets s, s + lanes, ... (kOctets of them, loaded
// before any is used and kept in registers for the second pass). A lane's min/max runs over its 8 * kOctets
// values, the shuffles over log2(lanes) steps and the group's zero point and scale are computed once for them all
// (quantize_pack_kernel does them for each lane's 8 values at group size 256; on the H200 this kernel is 4-7%
// faster: neither was what bounds it). The arithmetic is quantize_pack_kernel's, octet for octet.
constexpr int kOctets = 4;

template <typename T, int B, bool Scaled, bool Normalized>
__global__ void __launch_bounds__(kThreads, 3) quantize_pack_lanes_kernel(  // 3 blocks an SM: at most 80 registers
    const T* __restrict__ x, int64_t n, int lanes, int group_shift, uint64_t seed, bool vec, ChannelScaling scaling,
    ChannelFactors norm, uint8_t* __restrict__ payload, uint16_t* __restrict__ lo_out,
    uint16_t* __restrict__ scale_out) {
  const int lane = threadIdx.x % kWarp;
  const int sub = lane & (lanes - 1);  // the lane within its group's sub-warp
  const int64_t base = (static_cast<int64_t>(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp) *
                       (kOctets * 8 * kWarp);
  if (base >= n) return;  // uniform across the warp
  // the group's first element (a group holds 8 * kOctets elements a lane)
  const int64_t start = base + (lane - sub) * (8 * kOctets);
  const int64_t first = start + 8 * sub;  // the lane's first octet; octet k is at first + 8 * lanes * k
  float v[kOctets][8];
  int cnt[kOctets];
#pragma unroll
  for (int k = 0; k < kOctets; ++k) {
    const int64_t i = first + 8 * lanes * k;
    cnt[k] = static_cast<int>(i >= n ? 0 : (n - i < 8 ? n - i : 8));
    if (cnt[k] > 0) {
      load8(x + i, cnt[k], vec, v[k]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[k][j] = 0.f;
    }
  }
  if constexpr (Scaled) {
    int64_t c = scaling.small_index
                    ? static_cast<int64_t>(static_cast<uint32_t>(first) % static_cast<uint32_t>(scaling.channels))
                    : first % scaling.channels;
#pragma unroll
    for (int k = 0; k < kOctets; ++k) {
      scale_octet(v[k], cnt[k], scaling.shifts, scaling.channels, c);
      c = advance_channel(c, scaling.lane_step, scaling.channels);
    }
  }
  if constexpr (Normalized) {
#pragma unroll
    for (int k = 0; k < kOctets; ++k) normalize_octet(v[k], norm, first + 8 * lanes * k);
  }
  float mn = INFINITY, mx = -INFINITY;
  int nonfinite = 0;
#pragma unroll
  for (int k = 0; k < kOctets; ++k) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt[k]) {
        nonfinite |= !isfinite(v[k][j]);
        mn = fminf(mn, v[k][j]);
        mx = fmaxf(mx, v[k][j]);
      }
    }
  }
  for (int off = lanes / 2; off > 0; off /= 2) {  // xor offsets below `lanes` stay inside the sub-warp
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    nonfinite |= __shfl_xor_sync(0xffffffffu, nonfinite, off);
  }
  if (start >= n) return;  // a group past the end (after the shuffles, which every lane takes part in)
  uint16_t lo_bits, scale_bits;
  group_metadata<T, B>(mn, mx, nonfinite, lo_bits, scale_bits);
  if (sub == 0) {
    lo_out[start >> group_shift] = lo_bits;
    scale_out[start >> group_shift] = scale_bits;
  }
  const GroupFactors factors = group_factors<T>(lo_bits, scale_bits);
#pragma unroll
  for (int k = 0; k < kOctets; ++k) {
    if (cnt[k] == 0) continue;
    const int64_t i = first + 8 * lanes * k;
    store_octet<B>(payload + (i / 8) * B, quantize_octet<B>(v[k], cnt[k], factors, seed, i), (cnt[k] * B + 7) / 8);
  }
}

// A per-channel affine map of a decode (unpack_dequantize_affine; fp32 only): element i, of channel i % channels
// of a row-major tensor, becomes v * mult[c] - shift[c], each operation rounded (no fused multiply-add); with a
// `divisor` (one value a row of `channels` elements, `rows` of them; nullptr: none) that times the reciprocal of its
// row's, the reciprocal and the product each rounded.
struct ChannelAffine {
  const float* mult;
  const float* shift;
  int64_t channels;
  const float* divisor;
  int64_t rows;
};

// One thread per octet; with Affine, each value then mapped by `affine`.
template <typename T, int B, bool Affine>
__global__ void __launch_bounds__(kThreads) unpack_dequantize_kernel(
    const uint8_t* __restrict__ payload, const uint16_t* __restrict__ lo_in, const uint16_t* __restrict__ scale_in,
    int64_t n, int64_t group_size, int group_shift, ChannelAffine affine, T* __restrict__ out) {
  constexpr uint64_t kMask = (1u << B) - 1;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  const int cnt = static_cast<int>(n - i < 8 ? n - i : 8);
  const uint64_t word = load_octet<B>(payload + o * B, (cnt * B + 7) / 8);
  const int64_t g = group_shift >= 0 ? i >> group_shift : i / group_size;  // a 64-bit division is a long routine
  const float lo = ZeroPoint<T>::decode(lo_in[g]);
  const float scale = bf16_bits_to_float(scale_in[g]);
  int64_t c = 0, row = 0;
  float inverse = 1.f;  // the reciprocal of the row's divisor
  if constexpr (Affine) {
    if (i <= UINT32_MAX && affine.channels <= UINT32_MAX) {
      const uint32_t q = static_cast<uint32_t>(i) / static_cast<uint32_t>(affine.channels);
      row = q;
      c = static_cast<uint32_t>(i) - q * static_cast<uint32_t>(affine.channels);
    } else {
      row = i / affine.channels;
      c = i - row * affine.channels;
    }
    if (affine.divisor != nullptr) inverse = __frcp_rn(affine.divisor[row]);
  }
  alignas(16) T vals[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float code = static_cast<float>((word >> (j * B)) & kMask);
    float v = __fadd_rn(lo, __fmul_rn(code, scale));
    if constexpr (Affine) {  // past cnt too: c stays a channel, the row the last; those values are not stored
      v = __fsub_rn(__fmul_rn(v, affine.mult[c]), affine.shift[c]);
      if (affine.divisor != nullptr) v = __fmul_rn(v, inverse);
      if (++c == affine.channels) {
        c = 0;
        if (affine.divisor != nullptr && ++row < affine.rows) inverse = __frcp_rn(affine.divisor[row]);
      }
    }
    vals[j] = from_float<T>(v);
  }
  store_octet_values(out + i, vals, cnt, true);  // `out` is a new tensor: aligned
}

// One thread per octet of `out`: elements start + k of the packed tensor (start a multiple of 8, so an octet of out
// is an octet of the payload, inside one group) decoded, mapped by their channel c of out's dim 1 to
// v * weight[c] + bias[c] (`map`: a = weight, b = bias), with Accumulate added to what out
// holds, with Masked zeroed where their bit of `mask` (bit k for out's element k) is 0, and rounded once into T.
template <typename T, int B, bool Accumulate, bool Masked>
__global__ void __launch_bounds__(kThreads) unpack_dequantize_into_kernel(
    const uint8_t* __restrict__ payload, const uint16_t* __restrict__ lo_in, const uint16_t* __restrict__ scale_in,
    int64_t n, int64_t start, int64_t group_size, int group_shift, ChannelFactors map,
    const uint8_t* __restrict__ mask, bool vec, T* __restrict__ out) {
  constexpr uint64_t kMask = (1u << B) - 1;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t k = o * 8;
  if (k >= n) return;
  const int cnt = static_cast<int>(n - k < 8 ? n - k : 8);
  const int64_t e = start + k;
  const uint64_t word = load_octet<B>(payload + (e / 8) * B, (cnt * B + 7) / 8);
  const int64_t g = group_shift >= 0 ? e >> group_shift : e / group_size;  // a 64-bit division is a long routine
  const float lo = ZeroPoint<T>::decode(lo_in[g]);
  const float scale = bf16_bits_to_float(scale_in[g]);
  float w[8], b[8];  // each element's channel factors
  octet_channel_factors(map, k, w, b);
  alignas(16) T old[8];
  if constexpr (Accumulate) load_octet_values(out + k, cnt, vec, old);
  const unsigned keep = Masked ? mask[k / 8] : 0xFFu;
  alignas(16) T vals[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float code = static_cast<float>((word >> (j * B)) & kMask);
    float v = __fadd_rn(__fmul_rn(__fadd_rn(lo, __fmul_rn(code, scale)), w[j]), b[j]);
    if constexpr (Accumulate) v = __fadd_rn(to_float(old[j]), v);
    if constexpr (Masked) v = (keep >> j) & 1u ? v : 0.f;
    vals[j] = from_float<T>(v);
  }
  store_octet_values(out + k, vals, cnt, vec);
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

// quantize_pack_cuda, scaled by channel when `shifts` is given (int32, one per channel of the last dimension), or
// normalized by channel of dim 1 when `norm` is (BatchNorm's input; not fp16, whose zero points round to nearest).
std::vector<at::Tensor> launch_quantize_pack(const at::Tensor& x, const at::Tensor* shifts, const ChannelFactors* norm,
                                             int64_t bits, int64_t group_size, int64_t seed) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const int64_t n_groups = ceil_div(n, group_size);
  auto payload = at::empty({ceil_div(n * bits, 8)}, x.options().dtype(at::kByte));
  auto lo = at::empty({n_groups}, x.options().dtype(at::kShort));
  auto scale = at::empty({n_groups}, x.options().dtype(at::kShort));
  if (n == 0) return {payload, lo, scale};
  const bool vec = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  const int64_t lanes = group_size / (8 * kOctets);  // quantize_pack_lanes_kernel's lanes a group, where it applies
  const bool by_lanes = group_size % (8 * kOctets) == 0 && lanes <= kWarp && (lanes & (lanes - 1)) == 0;
  const int64_t blocks = by_lanes ? ceil_div(n, kOctets * 8 * kThreads) : ceil_div(n_groups, kThreads / kWarp);
  int group_shift = 0;
  while ((int64_t{1} << group_shift) < group_size) ++group_shift;  // log2(group_size) where `by_lanes`
  ChannelScaling scaling{nullptr, 1, 0, true};
  if (shifts != nullptr) {
    scaling.shifts = shifts->data_ptr<int32_t>();
    scaling.channels = shifts->numel();
    scaling.lane_step = (8 * (by_lanes ? lanes : kWarp)) % scaling.channels;  // from a lane's octet to its next
    scaling.small_index = n + kOctets * 8 * kWarp <= (int64_t{1} << 32);  // every lane's first element too
  }
  const ChannelFactors normalizer = norm != nullptr ? *norm : ChannelFactors{nullptr, nullptr, 1, 1};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "act_hf_quantize_pack", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      auto launch = [&](auto scaled, auto normalized) {  // std::true_type or std::false_type each
        constexpr bool kScaled = decltype(scaled)::value;
        constexpr bool kNormalized = decltype(normalized)::value;
        auto* lo_out = reinterpret_cast<uint16_t*>(lo.data_ptr<int16_t>());
        auto* scale_out = reinterpret_cast<uint16_t*>(scale.data_ptr<int16_t>());
        if (by_lanes) {
          quantize_pack_lanes_kernel<scalar_t, B, kScaled, kNormalized><<<blocks, kThreads, 0, stream>>>(
              x.data_ptr<scalar_t>(), n, static_cast<int>(lanes), group_shift, static_cast<uint64_t>(seed),
              vec, scaling, normalizer, payload.data_ptr<uint8_t>(), lo_out, scale_out);
        } else {
          quantize_pack_kernel<scalar_t, B, kScaled, kNormalized><<<blocks, kThreads, 0, stream>>>(
              x.data_ptr<scalar_t>(), n, group_size, n_groups, static_cast<uint64_t>(seed), vec, scaling,
              normalizer, payload.data_ptr<uint8_t>(), lo_out, scale_out);
        }
      };
      if (shifts != nullptr) {
        launch(std::true_type{}, std::false_type{});
      } else if (norm != nullptr) {
        if constexpr (std::is_same_v<scalar_t, c10::Half>) {
          TORCH_CHECK(false, "a normalized quantize takes float32, bfloat16 or float64, not float16");
        } else {
          launch(std::false_type{}, std::true_type{});
        }
      } else {
        launch(std::false_type{}, std::false_type{});
      }
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {payload, lo, scale};
}

}  // namespace

std::vector<at::Tensor> quantize_pack_cuda(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t seed) {
  return launch_quantize_pack(x, nullptr, nullptr, bits, group_size, seed);
}

std::vector<at::Tensor> quantize_pack_scaled_cuda(const at::Tensor& x, const at::Tensor& shifts, int64_t bits,
                                                  int64_t group_size, int64_t seed) {
  return launch_quantize_pack(x, &shifts, nullptr, bits, group_size, seed);
}

std::vector<at::Tensor> quantize_pack_normalized_cuda(const at::Tensor& x, const at::Tensor& mean,
                                                      const at::Tensor& invstd, int64_t inner, int64_t bits,
                                                      int64_t group_size, int64_t seed) {
  const ChannelFactors norm{mean.data_ptr<float>(), invstd.data_ptr<float>(), mean.numel(), inner};
  return launch_quantize_pack(x, nullptr, &norm, bits, group_size, seed);
}

namespace {

int log2_or_minus_one(int64_t group_size) {  // log2(group_size) for a power of two, else -1
  for (int k = 0; k < 63; ++k) {
    if ((int64_t{1} << k) == group_size) return k;
  }
  return -1;
}

}  // namespace

at::Tensor unpack_dequantize_cuda(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale,
                                  int64_t bits, int64_t group_size, int64_t numel, at::ScalarType dtype) {
  const c10::cuda::CUDAGuard guard(payload.device());
  auto out = at::empty({numel}, payload.options().dtype(dtype));
  if (numel == 0) return out;
  const int64_t blocks = ceil_div(ceil_div(numel, 8), kThreads);
  const int group_shift = log2_or_minus_one(group_size);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "act_hf_unpack_dequantize", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      unpack_dequantize_kernel<scalar_t, B, false><<<blocks, kThreads, 0, stream>>>(
          payload.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(lo.data_ptr<int16_t>()),
          reinterpret_cast<const uint16_t*>(scale.data_ptr<int16_t>()), numel, group_size, group_shift,
          ChannelAffine{nullptr, nullptr, 1, nullptr, 0}, out.data_ptr<scalar_t>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor unpack_dequantize_affine_cuda(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale,
                                         int64_t bits, int64_t group_size, int64_t numel, const at::Tensor& mult,
                                         const at::Tensor& shift, const c10::optional<at::Tensor>& divisor) {
  const c10::cuda::CUDAGuard guard(payload.device());
  auto out = at::empty({numel}, payload.options().dtype(at::kFloat));
  if (numel == 0) return out;
  const int64_t blocks = ceil_div(ceil_div(numel, 8), kThreads);
  const int group_shift = log2_or_minus_one(group_size);
  const ChannelAffine affine{mult.data_ptr<float>(), shift.data_ptr<float>(), mult.numel(),
                             divisor.has_value() ? divisor->data_ptr<float>() : nullptr, numel / mult.numel()};
  auto stream = c10::cuda::getCurrentCUDAStream();
  ACT_BITS_SWITCH(bits, B, [&] {
    unpack_dequantize_kernel<float, B, true><<<blocks, kThreads, 0, stream>>>(
        payload.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(lo.data_ptr<int16_t>()),
        reinterpret_cast<const uint16_t*>(scale.data_ptr<int16_t>()), numel, group_size, group_shift, affine,
        out.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void unpack_dequantize_into_cuda(const at::Tensor& out, const at::Tensor& payload, const at::Tensor& lo,
                                 const at::Tensor& scale, int64_t bits, int64_t group_size, int64_t start,
                                 const at::Tensor& weight, const at::Tensor& bias, int64_t inner,
                                 const c10::optional<at::Tensor>& mask, bool accumulate) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t n = out.numel();
  if (n == 0) return;
  const int64_t blocks = ceil_div(ceil_div(n, 8), kThreads);
  const int group_shift = log2_or_minus_one(group_size);
  const ChannelFactors map{weight.data_ptr<float>(), bias.data_ptr<float>(), weight.numel(), inner};
  const uint8_t* mask_ptr = mask.has_value() ? mask->data_ptr<uint8_t>() : nullptr;
  const bool vec = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "act_hf_unpack_dequantize_into", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      const auto launch = [&](auto kernel) {
        kernel<<<blocks, kThreads, 0, stream>>>(payload.data_ptr<uint8_t>(),
                                                reinterpret_cast<const uint16_t*>(lo.data_ptr<int16_t>()),
                                                reinterpret_cast<const uint16_t*>(scale.data_ptr<int16_t>()), n, start,
                                                group_size, group_shift, map, mask_ptr, vec,
                                                out.data_ptr<scalar_t>());
      };
      if (accumulate) {
        mask_ptr ? launch(unpack_dequantize_into_kernel<scalar_t, B, true, true>)
                 : launch(unpack_dequantize_into_kernel<scalar_t, B, true, false>);
      } else {
        mask_ptr ? launch(unpack_dequantize_into_kernel<scalar_t, B, false, true>)
                 : launch(unpack_dequantize_into_kernel<scalar_t, B, false, false>);
      }
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
