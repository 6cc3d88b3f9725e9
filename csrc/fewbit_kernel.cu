// Few-bit Backward's codes in one pass each way (act_hf/compress/reference.py: fewbit_encode_pack, fewbit_grad):
//   - encode: code = #{k : bounds[k] <= x} (torch.bucketize(x, bounds, right=True); NaN counts as above every
//     bound), packed at B bits straight from x: no int32 indices, no uint8 codes in memory;
//   - grad: grad * values[code], unpacked and looked up in registers, computed as torch.mul computes it (in fp32 for
//     fp32, fp16 and bf16, in fp64 for fp64) and rounded once to grad's dtype;
// and a 1-bit mask applied straight from its packed bits (zero_unmasked: torch.where(mask, values, 0), in place or
// into a new tensor): a ReLU's input gradient, a rectified input rebuilt for a conv's weight gradient.
// Comparisons are exact: x and the bounds share a dtype and are widened without rounding. 64-bit element indexing,
// current stream, no host synchronisation; one thread per octet of eight elements.
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

#include "dispatch.h"
#include "octets.cuh"

namespace act_hf {
namespace {

// The type x and the bounds are compared in, and grad and its factor multiplied in.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Elements [0, cnt) of `p` (cnt <= 8) widened to acc_t<T>, zeros past cnt.
template <typename T>
__device__ __forceinline__ void load_octet_widened(const T* __restrict__ p, int cnt, bool vec, acc_t<T> (&v)[8]) {
  alignas(16) T raw[8];
  load_octet_values(p, cnt, vec, raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = j < cnt ? static_cast<acc_t<T>>(raw[j]) : acc_t<T>(0);
}

template <typename T, int B>
__global__ void __launch_bounds__(kThreads) fewbit_encode_pack_kernel(
    const T* __restrict__ x, int64_t n, const T* __restrict__ bounds, int n_bounds, bool vec,
    uint8_t* __restrict__ payload) {
  __shared__ acc_t<T> sb[(1 << B) - 1];
  for (int k = threadIdx.x; k < n_bounds; k += blockDim.x) sb[k] = static_cast<acc_t<T>>(bounds[k]);
  __syncthreads();
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  const int cnt = static_cast<int>(n - i < 8 ? n - i : 8);
  acc_t<T> v[8];
  load_octet_widened(x + i, cnt, vec, v);
  uint64_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < cnt) {
      int code = n_bounds;  // NaN: above every bound, as torch.bucketize places it
      if (!isnan(v[j])) {
        code = 0;
        for (int k = 0; k < n_bounds; ++k) code += sb[k] <= v[j];
      }
      word |= static_cast<uint64_t>(code) << (j * B);
    }
  }
  store_octet<B>(payload + o * B, word, (cnt * B + 7) / 8);
}

template <typename T, int B>
__global__ void __launch_bounds__(kThreads) fewbit_grad_kernel(
    const T* __restrict__ grad, const uint8_t* __restrict__ payload, const T* __restrict__ values, int64_t n,
    bool vec, T* __restrict__ out) {
  constexpr uint64_t kMask = (1u << B) - 1;
  __shared__ acc_t<T> sv[1 << B];
  for (int k = threadIdx.x; k < (1 << B); k += blockDim.x) sv[k] = static_cast<acc_t<T>>(values[k]);
  __syncthreads();
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  const int cnt = static_cast<int>(n - i < 8 ? n - i : 8);
  const uint64_t word = load_octet<B>(payload + o * B, (cnt * B + 7) / 8);
  acc_t<T> g[8];
  load_octet_widened(grad + i, cnt, vec, g);
  alignas(16) T vals[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) vals[j] = static_cast<T>(g[j] * sv[(word >> (j * B)) & kMask]);
  store_octet_values(out + i, vals, cnt, vec);
}

// `dst` may be `src` (in place): no __restrict__ on either.
template <typename T>
__global__ void __launch_bounds__(kThreads) zero_unmasked_kernel(const T* src, const uint8_t* __restrict__ mask,
                                                                   int64_t n, bool vec, T* dst) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  const int cnt = static_cast<int>(n - i < 8 ? n - i : 8);
  const unsigned bits = mask[o];  // one byte holds the octet's eight bits
  alignas(16) T vals[8];
  load_octet_values(src + i, cnt, vec, vals);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (!((bits >> j) & 1u)) vals[j] = T(0);
  }
  store_octet_values(dst + i, vals, cnt, vec);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

at::Tensor fewbit_encode_pack_cuda(const at::Tensor& x, const at::Tensor& bounds, int64_t bits) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  auto payload = at::empty({ceil_div(n * bits, 8)}, x.options().dtype(at::kByte));
  if (n == 0) return payload;
  const int64_t blocks = ceil_div(ceil_div(n, 8), kThreads);
  const bool vec = aligned16(x.data_ptr());
  const int n_bounds = static_cast<int>(bounds.numel());
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "act_hf_fewbit_encode_pack", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      fewbit_encode_pack_kernel<scalar_t, B><<<blocks, kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), n, bounds.data_ptr<scalar_t>(), n_bounds, vec, payload.data_ptr<uint8_t>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return payload;
}

at::Tensor fewbit_grad_cuda(const at::Tensor& grad, const at::Tensor& payload, const at::Tensor& values,
                            int64_t bits) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t n = grad.numel();
  auto out = at::empty({n}, grad.options());
  if (n == 0) return out;
  const int64_t blocks = ceil_div(ceil_div(n, 8), kThreads);
  const bool vec = aligned16(grad.data_ptr()) && aligned16(out.data_ptr());
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "act_hf_fewbit_grad", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      fewbit_grad_kernel<scalar_t, B><<<blocks, kThreads, 0, stream>>>(
          grad.data_ptr<scalar_t>(), payload.data_ptr<uint8_t>(), values.data_ptr<scalar_t>(), n, vec,
          out.data_ptr<scalar_t>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor zero_unmasked_cuda(const at::Tensor& values, const at::Tensor& mask, bool in_place) {
  const c10::cuda::CUDAGuard guard(values.device());
  const int64_t n = values.numel();
  auto out = in_place ? values : at::empty({n}, values.options());
  if (n == 0) return out;
  const int64_t blocks = ceil_div(ceil_div(n, 8), kThreads);
  const bool vec = aligned16(values.data_ptr()) && aligned16(out.data_ptr());
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "act_hf_zero_unmasked", [&] {
    zero_unmasked_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        values.data_ptr<scalar_t>(), mask.data_ptr<uint8_t>(), n, vec, out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace act_hf
