// The arithmetic of the chain decode (dequantize_kernel.cu: unpack_dequantize_chain_kernel) as host and device
// functions: up to kChainTerms packed tensors of one shape decoded, mapped by channel, summed and masked, an octet
// of eight elements at a time, in fp32 (act_hf/compress/reference.py: unpack_dequantize_chain). The kernel calls it
// on the GPU; tests/compress/test_kernel_logic.py builds it for the CPU and compares it with the reference.
#pragma once

#include <cstdint>

#include "octets.cuh"
#include "quantize_octets.cuh"

namespace act_hf {

constexpr int kChainTerms = 8;  // reference.py: CHAIN_TERMS

// One packed tensor of a chain: its payload, zero points and scales (raw 16-bit patterns), its channel factors
// (fp32, one a channel of dim 1) and the 1-bit mask (bit k for element k of the output; nullptr: none) applied
// after it is added.
struct ChainTerm {
  const uint8_t* payload;
  const uint16_t* lo;
  const uint16_t* scale;
  const float* weight;
  const float* bias;
  const uint8_t* mask;
};

// The terms, in order, and the layout they share: element k of the output is element start + k of each packed
// tensor, of channel (k / inner) % channels.
struct DecodeChain {
  ChainTerm terms[kChainTerms];
  int count;
  int64_t channels;
  int64_t inner;
  int64_t start;  // a multiple of 8: an octet of the output is an octet of each payload, inside one group
  int64_t group_size;
  int group_shift;  // log2(group_size) for a power of two, else -1
};

// The octet of output elements [k, k + cnt) (k a multiple of 8): v holds what the output holds with `accumulate`;
// each term's values lo + code * scale, times weight[c], plus bias[c], are added to it (the first term's taken as
// they are without `accumulate`), and the term's mask zeroes the elements whose bit is 0; every operation rounded,
// no fused multiply-add. T is the output's dtype (its zero points are the terms'). Lanes past cnt are computed
// too, never stored.
template <typename T, int B>
ACT_HD void chain_octet(const DecodeChain& chain, int64_t k, int cnt, bool accumulate, float (&v)[8]) {
  constexpr uint64_t kMask = (1u << B) - 1;
  const int64_t e = chain.start + k;
  const int64_t g = chain.group_shift >= 0 ? e >> chain.group_shift : e / chain.group_size;
  for (int t = 0; t < chain.count; ++t) {
    const ChainTerm& term = chain.terms[t];
    const uint64_t word = load_octet<B>(term.payload + (e / 8) * B, (cnt * B + 7) / 8);
    const float lo = ZeroPoint<T>::decode(term.lo[g]);
    const float scale = bf16_bits_to_float(term.scale[g]);
    float w[8], b[8];  // each element's channel factors
    octet_channel_factors(ChannelFactors{term.weight, term.bias, chain.channels, chain.inner}, k, w, b);
    const unsigned keep = term.mask != nullptr ? term.mask[k / 8] : 0xFFu;
    const bool first = t == 0 && !accumulate;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float code = static_cast<float>((word >> (j * B)) & kMask);
      const float d = add_rn(mul_rn(add_rn(lo, mul_rn(code, scale)), w[j]), b[j]);
      v[j] = first ? d : add_rn(v[j], d);
      if (!((keep >> j) & 1u)) v[j] = 0.f;
    }
  }
}

}  // namespace act_hf
