// Few-bit Backward's codes in one pass each way (act_hf/compress/reference.py: fewbit_encode_pack, fewbit_grad):
//   - encode: code = #{k : bounds[k] <= x} (torch.bucketize(x, bounds, right=True); NaN counts as above every
//     bound), packed at B bits straight from x: no int32 indices, no uint8 codes in memory;
//   - grad: grad * values[code], unpacked and looked up in registers, computed as torch.mul computes it (in fp32 for
//     fp32, fp16 and bf16, in fp64 for fp64) and rounded once to grad's dtype;
// an activation (GELU, its tanh form, SiLU) written in place with its code in the same pass
// (activation_inplace_code: the encode's kernel writing the activation's values back, where the in-place
// activation and the encode read x twice);
// a ReLU written in place with its 1-bit code in the same pass (relu_inplace_code: the forward of a ReLU whose
// backward keeps the code, reading x once where relu_ and the code's encode read it twice; a -0 becomes the value
// given for it, torch's own relu(-0) on that device);
// and a 1-bit mask applied straight from its packed bits (zero_unmasked: torch.where(mask, values, 0), in place or
// into a new tensor): a ReLU's input gradient, a rectified input rebuilt for a conv's weight gradient; and
// dropout's input gradient from its packed keep-mask (masked_scale: aten's native_dropout_backward).
// Comparisons are exact: x and the bounds share a dtype and are widened without rounding. 64-bit element indexing,
// current stream, no host synchronisation; one thread per octet of eight elements (four for the encode from 4 bits).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "dispatch.h"
#include "fewbit_octets.cuh"
#include "octets.cuh"

namespace act_hf {
namespace {

// kEncodeOctets<B> octets a thread (those at kThreads apart), all loaded before any is encoded. The octets' work is
// fewbit_octets.cuh's. Up to kUnrolledEncodeBits bits each thread copies the bounds into registers, which the
// unrolled comparisons of encode_values index by constants. Four octets a thread ran 24% faster than one at 4 bits
// on the H200 (15 comparisons a value), as fast at 3 bits and 11% slower at 2 (measurement log, "Eighth GPU run").
template <int B>
constexpr int kEncodeOctets = B >= 4 ? 4 : 1;

// An activation's codes are those of its derivative tables: up to 4 bits (act_hf.fewbit).
constexpr int kMaxActivationBits = 4;

// With an activation Act, x's values also become its values (store_activation_octet), written back once they are
// encoded.
template <typename T, int B, int Act>
__global__ void __launch_bounds__(kThreads) fewbit_encode_pack_kernel(
    std::conditional_t<Act == kNoActivation, const T, T>* __restrict__ x, int64_t n, const T* __restrict__ bounds,
    int n_bounds, bool vec, uint8_t* __restrict__ payload) {
  constexpr int kBounds = (1 << B) - 1;
  __shared__ acc_t<T> sb[kBounds];
  for (int k = threadIdx.x; k < n_bounds; k += blockDim.x) sb[k] = static_cast<acc_t<T>>(bounds[k]);
  constexpr int kOctets = kEncodeOctets<B>;
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * (kOctets * kThreads) + threadIdx.x;
  acc_t<T> v[kOctets][8];
  int cnt[kOctets];
#pragma unroll
  for (int r = 0; r < kOctets; ++r) {
    const int64_t i = (o0 + r * kThreads) * 8;
    cnt[r] = static_cast<int>(i >= n ? 0 : (n - i < 8 ? n - i : 8));
    if (cnt[r] > 0) load_octet_widened(x + i, cnt[r], vec, v[r]);
  }
  __syncthreads();  // the bounds, after the loads are issued
  auto encode_all = [&](const acc_t<T>* b) {
#pragma unroll
    for (int r = 0; r < kOctets; ++r) {
      if (cnt[r] > 0) {
        const int64_t o = o0 + r * kThreads;
        store_octet<B>(payload + o * B, encode_values<B>(v[r], cnt[r], b, n_bounds), (cnt[r] * B + 7) / 8);
        if constexpr (Act != kNoActivation) store_activation_octet<Act>(v[r], cnt[r], vec, x + o * 8);
      }
    }
  };
  if constexpr (B <= kUnrolledEncodeBits) {
    acc_t<T> rb[kBounds];
#pragma unroll
    for (int k = 0; k < kBounds; ++k) rb[k] = padded_bound(sb, n_bounds, k);
    encode_all(rb);
  } else {
    encode_all(sb);
  }
}

template <typename T, int B>
__global__ void __launch_bounds__(kThreads) fewbit_grad_kernel(
    const T* __restrict__ grad, const uint8_t* __restrict__ payload, const T* __restrict__ values, int64_t n,
    bool vec, T* __restrict__ out) {
  __shared__ acc_t<T> sv[1 << B];
  for (int k = threadIdx.x; k < (1 << B); k += blockDim.x) sv[k] = static_cast<acc_t<T>>(values[k]);
  __syncthreads();
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  grad_octet<T, B>(grad + i, payload + o * B, static_cast<int>(n - i < 8 ? n - i : 8), vec, sv, out + i);
}

// `dst` may be `src` (in place): no __restrict__ on either.
template <typename T>
__global__ void __launch_bounds__(kThreads) zero_unmasked_kernel(const T* src, const uint8_t* __restrict__ mask,
                                                                   int64_t n, bool vec, T* dst) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  zero_unmasked_octet(src + i, mask[o], static_cast<int>(n - i < 8 ? n - i : 8), vec, dst + i);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) relu_inplace_code_kernel(T* __restrict__ x, int64_t n, bool vec,
                                                                       const T* __restrict__ negative_zero_out,
                                                                       uint8_t* __restrict__ code) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  code[o] = static_cast<uint8_t>(relu_octet(x + i, static_cast<int>(n - i < 8 ? n - i : 8), vec, *negative_zero_out));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) masked_scale_kernel(const T* __restrict__ grad,
                                                                  const uint8_t* __restrict__ mask, int64_t n,
                                                                  acc_t<T> scale, bool vec, T* __restrict__ out) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t i = o * 8;
  if (i >= n) return;
  masked_scale_octet(grad + i, mask[o], static_cast<int>(n - i < 8 ? n - i : 8), vec, scale, out + i);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The packed codes of x against bounds; with an activation Act, x's values then written as its values.
template <int Act>
at::Tensor encode_pack(const at::Tensor& x, const at::Tensor& bounds, int64_t bits) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  auto payload = at::empty({ceil_div(n * bits, 8)}, x.options().dtype(at::kByte));
  if (n == 0) return payload;
  const bool vec = aligned16(x.data_ptr());
  const int n_bounds = static_cast<int>(bounds.numel());
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "act_hf_fewbit_encode_pack", [&] {
    ACT_BITS_SWITCH(bits, B, [&] {
      if constexpr (Act != kNoActivation && B > kMaxActivationBits) {
        TORCH_CHECK(false, "activation_inplace_code takes bits 1..", kMaxActivationBits, ", got ", B);
      } else {
        const int64_t blocks = ceil_div(ceil_div(n, 8), kEncodeOctets<B> * kThreads);
        fewbit_encode_pack_kernel<scalar_t, B, Act><<<blocks, kThreads, 0, stream>>>(
            x.data_ptr<scalar_t>(), n, bounds.data_ptr<scalar_t>(), n_bounds, vec, payload.data_ptr<uint8_t>());
      }
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return payload;
}

}  // namespace

at::Tensor fewbit_encode_pack_cuda(const at::Tensor& x, const at::Tensor& bounds, int64_t bits) {
  return encode_pack<kNoActivation>(x, bounds, bits);
}

at::Tensor activation_inplace_code_cuda(const at::Tensor& x, const at::Tensor& bounds, int64_t bits,
                                        const std::string& activation) {
  TORCH_CHECK(activation == "gelu" || activation == "gelu_tanh" || activation == "silu",
              "activation must be 'gelu', 'gelu_tanh' or 'silu', got '", activation, "'");
  if (activation == "gelu") return encode_pack<kGelu>(x, bounds, bits);
  if (activation == "gelu_tanh") return encode_pack<kGeluTanh>(x, bounds, bits);
  return encode_pack<kSilu>(x, bounds, bits);
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

at::Tensor relu_inplace_code_cuda(const at::Tensor& x, const at::Tensor& negative_zero_out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  auto code = at::empty({ceil_div(n, 8)}, x.options().dtype(at::kByte));
  if (n == 0) return code;
  const int64_t blocks = ceil_div(ceil_div(n, 8), kThreads);
  const bool vec = aligned16(x.data_ptr());
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "act_hf_relu_inplace_code", [&] {
    relu_inplace_code_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), n, vec, negative_zero_out.data_ptr<scalar_t>(), code.data_ptr<uint8_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return code;
}

at::Tensor masked_scale_cuda(const at::Tensor& grad, const at::Tensor& mask, double scale) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t n = grad.numel();
  auto out = at::empty({n}, grad.options());
  if (n == 0) return out;
  const int64_t blocks = ceil_div(ceil_div(n, 8), kThreads);
  const bool vec = aligned16(grad.data_ptr()) && aligned16(out.data_ptr());
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "act_hf_masked_scale", [&] {
    masked_scale_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        grad.data_ptr<scalar_t>(), mask.data_ptr<uint8_t>(), n, static_cast<acc_t<scalar_t>>(scale), vec,
        out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace act_hf
