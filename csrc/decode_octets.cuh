// The arithmetic of the decodes (dequantize_kernel.cu) as host and device functions: the affine map of
// unpack_dequantize_affine, and the chain decode (unpack_dequantize_chain_kernel): up to kChainTerms packed tensors
// of one shape decoded, mapped by channel, summed and masked, an octet of eight elements at a time, in fp32
// (act_hf/compress/reference.py: unpack_dequantize_affine, unpack_dequantize_chain). The kernels call them on the
// GPU; tests/compress/test_kernel_logic.py builds them for the CPU and compares them with the reference.
#pragma once

#include <cstdint>

#include "octets.cuh"
#include "quantize_octets.cuh"

namespace act_hf {

constexpr int kChainTerms = 8;  // reference.py: CHAIN_TERMS

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
  bool small;  // channels below 2^32: by_channels holds its divider
  Divider by_channels;
};

inline ChannelAffine channel_affine(const float* mult, const float* shift, int64_t channels, const float* divisor,
                                    int64_t rows) {
  const bool small = channels <= UINT32_MAX;
  const Divider by_channels = small ? make_divider(static_cast<uint32_t>(channels)) : Divider{};
  return {mult, shift, channels, divisor, rows, small, by_channels};
}

// Where element i (a multiple of 8: an octet's first) lies for `affine`: its channel and row.
struct AffinePosition {
  int64_t c;
  int64_t row;
};

ACT_HD AffinePosition affine_position(const ChannelAffine& affine, int64_t i) {
  if (affine.small && i <= UINT32_MAX) {  // a 64-bit division is a long routine
    const uint32_t q = divide(affine.by_channels, static_cast<uint32_t>(i));
    return {static_cast<uint32_t>(i) - q * static_cast<uint32_t>(affine.channels), q};
  }
  const int64_t row = i / affine.channels;
  return {i - row * affine.channels, row};
}

// `affine` applied to v, the decoded values of the octet whose first element lies at `p`. An octet inside one row
// (most of them where rows are long) reads its channels' factors at consecutive offsets and one divisor; otherwise
// past a partial octet's count too: the channels wrap, the row stays the last, and those values are not stored.
ACT_HD void affine_octet_at(float (&v)[8], const ChannelAffine& affine, AffinePosition p) {
  int64_t c = p.c, row = p.row;
  const bool divided = affine.divisor != nullptr;
  float inverse = divided ? rcp_rn(affine.divisor[row]) : 1.f;  // the reciprocal of the row's divisor
  if (c + 8 <= affine.channels) {
    const float* __restrict__ mult = affine.mult + c;
    const float* __restrict__ shift = affine.shift + c;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = sub_rn(mul_rn(v[j], mult[j]), shift[j]);
      if (divided) v[j] = mul_rn(v[j], inverse);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = sub_rn(mul_rn(v[j], affine.mult[c]), affine.shift[c]);
    if (divided) v[j] = mul_rn(v[j], inverse);
    if (++c == affine.channels) {
      c = 0;
      if (divided && ++row < affine.rows) inverse = rcp_rn(affine.divisor[row]);
    }
  }
}

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
  ChannelLayout layout;  // channels: the terms' weights' length
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
  const int64_t e = chain.start + k;
  const int64_t g = chain.group_shift >= 0 ? e >> chain.group_shift : e / chain.group_size;
  const ChannelPosition at = channel_position(chain.layout, k);  // the terms share it
  for (int t = 0; t < chain.count; ++t) {
    const ChainTerm& term = chain.terms[t];
    const uint64_t word = load_octet<B>(term.payload + (e / 8) * B, (cnt * B + 7) / 8);
    const float lo = ZeroPoint<T>::decode(term.lo[g]);
    const float scale = bf16_bits_to_float(term.scale[g]);
    float w[8], b[8];  // each element's channel factors
    octet_factors_at(term.weight, term.bias, chain.layout, at, w, b);
    const unsigned keep = term.mask != nullptr ? term.mask[k / 8] : 0xFFu;
    const bool first = t == 0 && !accumulate;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float code = static_cast<float>(octet_code<B>(word, j));
      const float d = add_rn(mul_rn(add_rn(lo, mul_rn(code, scale)), w[j]), b[j]);
      v[j] = first ? d : add_rn(v[j], d);
      if (!((keep >> j) & 1u)) v[j] = 0.f;
    }
  }
}

}  // namespace act_hf
