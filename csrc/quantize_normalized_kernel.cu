// act_hf's quantize + pack (quantize_kernels.cuh) of BatchNorm's normalized input:
// quantize_pack_normalized_cuda.
#include "quantize_kernels.cuh"

namespace act_hf {

std::vector<at::Tensor> quantize_pack_normalized_cuda(const at::Tensor& x, const at::Tensor& mean,
                                                      const at::Tensor& invstd, int64_t inner, int64_t bits,
                                                      int64_t group_size, int64_t seed) {
  const ChannelFactors norm{mean.data_ptr<float>(), invstd.data_ptr<float>(), channel_layout(mean.numel(), inner)};
  return launch_quantize_pack<false, true>(x, nullptr, &norm, bits, group_size, seed);
}

}  // namespace act_hf
