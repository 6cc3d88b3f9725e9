// act_hf's quantize + pack (quantize_kernels.cuh) with channel scaling: quantize_pack_scaled_cuda.
#include "quantize_kernels.cuh"

namespace act_hf {

std::vector<at::Tensor> quantize_pack_scaled_cuda(const at::Tensor& x, const at::Tensor& shifts, int64_t bits,
                                                  int64_t group_size, int64_t seed) {
  return launch_quantize_pack<true, false>(x, &shifts, nullptr, bits, group_size, seed);
}

}  // namespace act_hf
