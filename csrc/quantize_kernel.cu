// act_hf's quantize + pack (quantize_kernels.cuh), unscaled: quantize_pack_cuda.
#include "quantize_kernels.cuh"

namespace act_hf {

std::vector<at::Tensor> quantize_pack_cuda(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t seed) {
  return launch_quantize_pack<false, false>(x, nullptr, nullptr, bits, group_size, seed);
}

}  // namespace act_hf
