// The quantize kernels (per-group stochastic quantization + bit packing) and their launch, for the three files
// that instantiate one variant each. The format and every arithmetic step are specified by
// act_hf/compress/reference.py; these kernels reproduce it bit for bit:
//   - the uniforms are 16-bit fields of splitmix64(seed + p * golden), one hash per quad of elements p (counter
//     based, no state), and a group's codes multiply by the reciprocal of its scale (quantize_octets.cuh);
//   - all arithmetic is fp32 with explicit _rn intrinsics, so nvcc cannot contract a*b+c into an FMA;
//   - 64-bit element indexing, current stream, no host synchronisation, no padded copy of the input.
#pragma once

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
#include "elements.cuh"

namespace act_hf {
namespace {

constexpr int kWarp = 32;

// Channel scaling of the quantize kernels: element i times 2^shifts[i % channels] (Scaled only). lane_step is a
// lane's move from one octet to its next, modulo channels; small_index: indices fit 32 bits.
struct ChannelScaling {
  const int32_t* shifts;
  int64_t channels;
  int64_t lane_step;
  bool small_index;
};

// One warp per group, for the group sizes other than 32, 64, ..., 1024 (those: quantize_pack_lanes_kernel).
// Pass 1: the group's range over its octets (range_octet: NaN-propagating, so it also says whether the group is
// non-finite); pass 2 (re-reading the group from L1/L2): codes, packed one octet (8 elements = B bytes, byte
// aligned since G % 8 == 0) per lane.
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
    range_octet(v, cnt, mn, mx);
  }
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) {
    mn = min_nan(mn, __shfl_xor_sync(0xffffffffu, mn, off));
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  }

  uint16_t lo_bits, scale_bits;
  group_metadata<T, B>(mn, mx, range_nonfinite(mn, mx), lo_bits, scale_bits);
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
#pragma unroll
  for (int k = 0; k < kOctets; ++k) range_octet(v[k], cnt[k], mn, mx);
  for (int off = lanes / 2; off > 0; off /= 2) {  // xor offsets below `lanes` stay inside the sub-warp
    mn = min_nan(mn, __shfl_xor_sync(0xffffffffu, mn, off));
    mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  }
  if (start >= n) return;  // a group past the end (after the shuffles, which every lane takes part in)
  uint16_t lo_bits, scale_bits;
  group_metadata<T, B>(mn, mx, range_nonfinite(mn, mx), lo_bits, scale_bits);
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

// The quantize of one variant, each in a file of its own (quantize_kernel.cu, quantize_scaled_kernel.cu,
// quantize_normalized_kernel.cu) so that they compile in parallel: Scaled by channel (`shifts`: int32, one per
// channel of the last dimension), Normalized by channel of dim 1 (`norm`: BatchNorm's input; not fp16, whose zero
// points round to nearest), or neither (both nullptr).
template <bool kScaled, bool kNormalized>
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
  const ChannelFactors normalizer = norm != nullptr ? *norm : ChannelFactors{nullptr, nullptr, channel_layout(1, 1)};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "act_hf_quantize_pack", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      auto* lo_out = reinterpret_cast<uint16_t*>(lo.data_ptr<int16_t>());
      auto* scale_out = reinterpret_cast<uint16_t*>(scale.data_ptr<int16_t>());
      if constexpr (kNormalized && std::is_same_v<scalar_t, c10::Half>) {
        TORCH_CHECK(false, "a normalized quantize takes float32, bfloat16 or float64, not float16");
      } else if (by_lanes) {
        quantize_pack_lanes_kernel<scalar_t, B, kScaled, kNormalized><<<blocks, kThreads, 0, stream>>>(
            x.data_ptr<scalar_t>(), n, static_cast<int>(lanes), group_shift, static_cast<uint64_t>(seed), vec,
            scaling, normalizer, payload.data_ptr<uint8_t>(), lo_out, scale_out);
      } else {
        quantize_pack_kernel<scalar_t, B, kScaled, kNormalized><<<blocks, kThreads, 0, stream>>>(
            x.data_ptr<scalar_t>(), n, group_size, n_groups, static_cast<uint64_t>(seed), vec, scaling, normalizer,
            payload.data_ptr<uint8_t>(), lo_out, scale_out);
      }
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {payload, lo, scale};
}

}  // namespace
}  // namespace act_hf
