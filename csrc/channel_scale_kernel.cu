// The shifts of channel scaling (act_hf/compress/reference.py: channel_shifts) in two kernels: each channel's
// largest magnitude, reduced by atomicMax on its bits, then one block finds the largest finite channel and
// writes every shift. No host synchronisation; integers throughout, so the results are the reference's exactly.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "octets.cuh"
#include "quantize_octets.cuh"

namespace act_hf {
namespace {

constexpr int kShiftThreads = 1024;
constexpr int64_t kAbsmaxThreads = int64_t{1} << 18;  // about this many threads read the tensor (a full GPU)

// Thread t reads elements t, t + stride, ... of a row-major (rows, channels) tensor: stride is a multiple of
// `channels`, so all of them lie in channel t % channels, and a warp's reads are consecutive.
template <typename T>
__global__ void __launch_bounds__(kThreads) channel_absmax_kernel(const T* __restrict__ x, int64_t n,
                                                                  int64_t channels, int64_t stride,
                                                                  unsigned int* __restrict__ absmax) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= stride) return;
  uint32_t m = 0;
#pragma unroll 4
  for (int64_t i = t; i < n; i += stride) m = max(m, magnitude_bits(static_cast<float>(x[i])));  // loads in flight
  atomicMax(absmax + t % channels, m);
}

__global__ void __launch_bounds__(kShiftThreads) channel_shifts_kernel(const unsigned int* __restrict__ absmax,
                                                                       int64_t channels, int32_t max_shift,
                                                                       int32_t* __restrict__ shifts) {
  __shared__ uint32_t tops[kShiftThreads / 32];
  uint32_t top = 0;
  for (int64_t c = threadIdx.x; c < channels; c += blockDim.x) {
    const uint32_t b = absmax[c];
    if (b < kInfBits) top = max(top, b);
  }
  for (int off = 16; off > 0; off /= 2) top = max(top, __shfl_xor_sync(0xffffffffu, top, off));
  if (threadIdx.x % 32 == 0) tops[threadIdx.x / 32] = top;
  __syncthreads();
  top = 0;
  for (int w = 0; w < kShiftThreads / 32; ++w) top = max(top, tops[w]);
  for (int64_t c = threadIdx.x; c < channels; c += blockDim.x) shifts[c] = channel_shift(top, absmax[c], max_shift);
}

}  // namespace

at::Tensor channel_shifts_cuda(const at::Tensor& x, int64_t channels, int64_t max_shift) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  auto absmax = at::zeros({channels}, x.options().dtype(at::kInt));
  auto shifts = at::empty({channels}, x.options().dtype(at::kInt));
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (n > 0) {
    const int64_t rows = n / channels;
    const int64_t stride = channels * std::max<int64_t>(1, std::min(rows, kAbsmaxThreads / channels));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "act_hf_channel_absmax", [&] {
      channel_absmax_kernel<scalar_t><<<ceil_div(stride, kThreads), kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), n, channels, stride, reinterpret_cast<unsigned int*>(absmax.data_ptr<int32_t>()));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  channel_shifts_kernel<<<1, kShiftThreads, 0, stream>>>(reinterpret_cast<unsigned int*>(absmax.data_ptr<int32_t>()),
                                                          channels, static_cast<int32_t>(max_shift),
                                                          shifts.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return shifts;
}

}  // namespace act_hf
