// The inverse of act_hf's quantize + pack: a decode into a new tensor (plain, or fp32 with a per-channel affine
// map), a decode of one or more packed tensors into a tensor of a batch's items (each mapped by channel of dim 1,
// summed, masked: decode_octets.cuh), and bit packing of byte codes and its inverse. The format is
// act_hf/compress/reference.py's; fp32 arithmetic with explicit _rn intrinsics, 64-bit element indexing, current
// stream, no host synchronisation.
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

#include "decode_octets.cuh"
#include "dispatch.h"
#include "octets.cuh"
#include "quantize_octets.cuh"
#include "elements.cuh"

namespace act_hf {
namespace {

// One thread per octet; with Affine, each value then mapped by `affine` (affine_octet_at).
template <typename T, int B, bool Affine>
__global__ void __launch_bounds__(kThreads) unpack_dequantize_kernel(
    const uint8_t* __restrict__ payload, const uint16_t* __restrict__ lo_in, const uint16_t* __restrict__ scale_in,
    int64_t n, int64_t group_size, int group_shift, ChannelAffine affine, T* __restrict__ out) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  // the position first: its slow path (indices past 2^32) calls a division routine, across which nothing else lives
  const AffinePosition at = Affine ? affine_position(affine, i) : AffinePosition{0, 0};
  const int cnt = static_cast<int>(n - i < 8 ? n - i : 8);
  const uint64_t word = load_octet<B>(payload + o * B, (cnt * B + 7) / 8);
  const int64_t g = group_shift >= 0 ? i >> group_shift : i / group_size;  // a 64-bit division is a long routine
  const float lo = ZeroPoint<T>::decode(lo_in[g]);
  const float scale = bf16_bits_to_float(scale_in[g]);
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __fadd_rn(lo, __fmul_rn(static_cast<float>(octet_code<B>(word, j)), scale));
  if constexpr (Affine) affine_octet_at(v, affine, at);
  alignas(16) T vals[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) vals[j] = from_float<T>(v[j]);
  store_octet_values(out + i, vals, cnt, true);  // `out` is a new tensor: aligned
}

// One thread per octet of `out`: the chain's terms decoded, mapped, summed and masked (chain_octet) from what out
// holds (Accumulate) or from the first term, rounded once into T.
template <typename T, int B, bool Accumulate>
__global__ void __launch_bounds__(kThreads) unpack_dequantize_chain_kernel(int64_t n, DecodeChain chain, bool vec,
                                                                           T* __restrict__ out) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t k = o * 8;
  if (k >= n) return;
  const int cnt = static_cast<int>(n - k < 8 ? n - k : 8);
  float v[8];
  if constexpr (Accumulate) {
    alignas(16) T old[8];
    load_octet_values(out + k, cnt, vec, old);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_float(old[j]);  // past cnt: whatever old holds, never stored
  }
  chain_octet<T, B>(chain, k, cnt, Accumulate, v);
  alignas(16) T vals[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) vals[j] = from_float<T>(v[j]);
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
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  const int cnt = static_cast<int>(n - i < 8 ? n - i : 8);
  const uint64_t word = load_octet<B>(payload + o * B, (cnt * B + 7) / 8);
  for (int j = 0; j < cnt; ++j) codes[i + j] = static_cast<uint8_t>(octet_code<B>(word, j));
}

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
          channel_affine(nullptr, nullptr, 1, nullptr, 0), out.data_ptr<scalar_t>());
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
  const ChannelAffine affine = channel_affine(mult.data_ptr<float>(), shift.data_ptr<float>(), mult.numel(),
                                              divisor.has_value() ? divisor->data_ptr<float>() : nullptr,
                                              numel / mult.numel());
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

void unpack_dequantize_chain_cuda(const at::Tensor& out, const std::vector<at::Tensor>& payloads,
                                  const std::vector<at::Tensor>& los, const std::vector<at::Tensor>& scales,
                                  const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& biases,
                                  const std::vector<c10::optional<at::Tensor>>& masks, int64_t bits,
                                  int64_t group_size, int64_t start, int64_t inner, bool accumulate) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t n = out.numel();
  if (n == 0) return;
  DecodeChain chain{};
  chain.count = static_cast<int>(payloads.size());
  chain.layout = channel_layout(weights[0].numel(), inner);
  chain.start = start;
  chain.group_size = group_size;
  chain.group_shift = log2_or_minus_one(group_size);
  for (int t = 0; t < chain.count; ++t) {
    chain.terms[t] = ChainTerm{payloads[t].data_ptr<uint8_t>(),
                               reinterpret_cast<const uint16_t*>(los[t].data_ptr<int16_t>()),
                               reinterpret_cast<const uint16_t*>(scales[t].data_ptr<int16_t>()),
                               weights[t].data_ptr<float>(), biases[t].data_ptr<float>(),
                               masks[t].has_value() ? masks[t]->data_ptr<uint8_t>() : nullptr};
  }
  const int64_t blocks = ceil_div(ceil_div(n, 8), kThreads);
  const bool vec = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "act_hf_unpack_dequantize_chain", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      const auto kernel = accumulate ? unpack_dequantize_chain_kernel<scalar_t, B, true>
                                     : unpack_dequantize_chain_kernel<scalar_t, B, false>;
      kernel<<<blocks, kThreads, 0, stream>>>(n, chain, vec, out.data_ptr<scalar_t>());
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
