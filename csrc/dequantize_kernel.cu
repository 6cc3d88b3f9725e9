// The inverse of act_hf's quantize + pack: a decode into a new tensor (plain, or fp32 with a per-channel affine
// map), a decode into a tensor of a batch's items (mapped by channel of dim 1, added, masked), and bit packing of
// byte codes and its inverse. The format is act_hf/compress/reference.py's; fp32 arithmetic with explicit _rn
// intrinsics, 64-bit element indexing, current stream, no host synchronisation.
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
