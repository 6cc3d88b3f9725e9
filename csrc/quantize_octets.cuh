// The arithmetic of the quantize kernel (quantize_kernel.cu) as host and device functions: a group's stored zero
// point and scale from its minimum and maximum, the rounding uniforms, and the codes of an octet of eight elements.
// The kernel calls them on the GPU; tests/compress/test_kernel_logic.py builds them for the CPU (with
// -ffp-contract=off, so that no a*b+c becomes a fused multiply-add there either) and compares a whole quantization
// made of them with the reference (act_hf/compress/reference.py) where no GPU is at hand.
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "octets.cuh"

namespace act_hf {

constexpr uint16_t kBf16Nan = 0x7FC0;
constexpr uint16_t kFp16Nan = 0x7E00;
constexpr uint16_t kBf16MinNormal = 0x0080;  // 2^-126: a nonzero scale is at least this, so 1/scale is finite

// Correctly rounded fp32 operations, never contracted into a fused multiply-add.
ACT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ACT_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

ACT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

ACT_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

ACT_HD float rcp_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

ACT_HD float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

ACT_HD uint16_t bf16_bits_round_down(float t) {
  const uint32_t b = float_bits(t);
  uint32_t hi = b >> 16;
  if ((b & 0xFFFFu) && (b >> 31)) hi += 1;  // negative and inexact: one more step of magnitude
  return static_cast<uint16_t>(hi);
}

ACT_HD uint16_t bf16_bits_round_up(float t) {  // t >= 0 or +inf
  const uint32_t b = float_bits(t);
  return static_cast<uint16_t>((b >> 16) + ((b & 0xFFFFu) ? 1u : 0u));
}

// Zero-point storage: fp16 for fp16 inputs (the group minimum is exact), bf16 (rounded down) otherwise.
template <typename T>
struct ZeroPoint {
  static constexpr uint16_t kNan = kBf16Nan;
  ACT_HD static uint16_t encode(float m) { return bf16_bits_round_down(m); }
  ACT_HD static float decode(uint16_t b) { return bf16_bits_to_float(b); }
};
template <>
struct ZeroPoint<c10::Half> {
  static constexpr uint16_t kNan = kFp16Nan;
  ACT_HD static uint16_t encode(float m) { return c10::Half(m).x; }  // round to nearest even
  ACT_HD static float decode(uint16_t b) { return static_cast<float>(c10::Half(b, c10::Half::from_bits())); }
};

// A group's stored (zero point, scale) from its minimum and maximum (fp32) and whether it holds NaN or Inf.
template <typename T, int B>
ACT_HD void group_metadata(float mn, float mx, bool nonfinite, uint16_t& lo_bits, uint16_t& scale_bits) {
  constexpr int kLevels = (1 << B) - 1;
  lo_bits = ZeroPoint<T>::encode(mn);
  scale_bits = bf16_bits_round_up(div_rn(sub_rn(mx, ZeroPoint<T>::decode(lo_bits)), float(kLevels)));
  if (scale_bits != 0 && scale_bits < kBf16MinNormal) scale_bits = kBf16MinNormal;
  if (nonfinite) {
    lo_bits = ZeroPoint<T>::kNan;
    scale_bits = kBf16Nan;
  }
}

// A group's range, NaN-propagating: a NaN among its values makes both ends NaN, so that the range alone says
// whether the group is non-finite (a NaN, +inf as its maximum or -inf as its minimum). On the GPU one instruction
// each (min.NaN / max.NaN, sm_80 and later); fminf and fmaxf would pass over a NaN.
template <bool kMax>
ACT_HD float extremum_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  if constexpr (kMax) {
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  } else {
    asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  }
  return r;
#else
  return (a != a || b != b) ? a + b : (kMax ? fmaxf(a, b) : fminf(a, b));  // a + b: NaN
#endif
}

ACT_HD float min_nan(float a, float b) { return extremum_nan<false>(a, b); }
ACT_HD float max_nan(float a, float b) { return extremum_nan<true>(a, b); }

// Widens the running range [mn, mx] by an octet's first cnt values; a full octet (most of them) without a test
// per value.
ACT_HD void range_octet(const float (&v)[8], int cnt, float& mn, float& mx) {
  if (cnt == 8) {
#pragma unroll
    for (int j = 0; j < 8; ++j) mn = min_nan(mn, v[j]), mx = max_nan(mx, v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) mn = min_nan(mn, v[j]), mx = max_nan(mx, v[j]);
    }
  }
}

// Whether a group whose range is [mn, mx] holds a NaN or an infinity.
ACT_HD bool range_nonfinite(float mn, float mx) { return !(isfinite(mn) && isfinite(mx)); }

// The group's fp32 factors: codes are floor((x - lo) * inv_scale + u); inv_scale is 0 where there is no scale
// (a zero-range or non-finite group, whose codes are 0).
struct GroupFactors {
  float lo;
  float inv_scale;
};

template <typename T>
ACT_HD GroupFactors group_factors(uint16_t lo_bits, uint16_t scale_bits) {
  const float scale = bf16_bits_to_float(scale_bits);
  return {ZeroPoint<T>::decode(lo_bits), scale > 0.f ? rcp_rn(scale) : 0.f};  // no scale: zero range and NaN
}

// splitmix64's finalizer: the rounding noise of a quad of elements (4p, ..., 4p + 3) is splitmix64(seed + p *
// golden), element 4p + k drawing its bits 48 - 16k .. 63 - 16k as a 16-bit integer r (uniform_field).
ACT_HD uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

ACT_HD uint32_t uniform_field(uint64_t h, int k) { return static_cast<uint32_t>(h >> (48 - 16 * k)) & 0xFFFFu; }

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr float kUniformStep = 1.52587890625e-5f;  // 2^-16: a draw r is the uniform r * 2^-16, exact in fp32

// q + r * 2^-16, rounded once. The product is exact, so on the GPU one fused multiply-add gives the sum's rounding.
ACT_HD float add_uniform(float q, uint32_t r) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(static_cast<float>(r), kUniformStep, q);
#else
  return add_rn(q, static_cast<float>(r) * kUniformStep);
#endif
}

// 2^k for a channel shift k in 0..24: the exponent field alone, exact.
ACT_HD float pow2(int32_t k) { return bits_float(static_cast<uint32_t>(k + 127) << 23); }

// Channel scaling: v[j], the value of element i + j of a row-major tensor whose last dimension has `channels`
// channels, times 2^shifts[(i + j) % channels] (exact: a power of two, and the shifts never carry a finite value
// past the largest channel). `c` is (i % channels). An octet inside one row (most of them where rows are long)
// reads its eight shifts at consecutive channels; past a partial octet's count its values are scaled too, which
// no caller reads.
ACT_HD void scale_octet(float (&v)[8], int cnt, const int32_t* __restrict__ shifts, int64_t channels, int64_t c) {
  if (c + 8 <= channels) {
    const int32_t* __restrict__ row = shifts + c;
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = mul_rn(v[j], pow2(row[j]));
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < cnt) v[j] = mul_rn(v[j], pow2(shifts[c]));
    if (++c == channels) c = 0;
  }
}

// The layout of a row-major (batch, channels, inner) tensor whose element i is of channel (i / inner) % channels,
// with the divisions by inner and channels made multiplications where indices fit 32 bits (`small`).
struct ChannelLayout {
  int64_t channels;
  int64_t inner;
  bool small;  // channels and inner below 2^32: by_inner and by_channels hold their dividers
  Divider by_inner;
  Divider by_channels;
};

inline ChannelLayout channel_layout(int64_t channels, int64_t inner) {
  const bool small = channels <= UINT32_MAX && inner <= UINT32_MAX;
  return {channels, inner, small, small ? make_divider(static_cast<uint32_t>(inner)) : Divider{},
          small ? make_divider(static_cast<uint32_t>(channels)) : Divider{}};
}

// Two factors a[c] and b[c] for each channel c of dim 1 of a tensor of `layout`: BatchNorm's mean and invstd
// (normalize_octet), a decode's weight and bias (chain_octet).
struct ChannelFactors {
  const float* a;
  const float* b;
  ChannelLayout layout;
};

// Where element i of a tensor of `layout` lies: its channel c = (i / inner) % channels and its offset r = i % inner
// in that channel's plane (by the layout's dividers where i fits 32 bits: a 64-bit division is a long routine).
struct ChannelPosition {
  int64_t c;
  int64_t r;
};

ACT_HD ChannelPosition channel_position(const ChannelLayout& layout, int64_t i) {
  if (layout.small && i <= UINT32_MAX) {
    const uint32_t n = static_cast<uint32_t>(i), inner = static_cast<uint32_t>(layout.inner);
    const uint32_t row = divide(layout.by_inner, n);
    const uint32_t c = row - divide(layout.by_channels, row) * static_cast<uint32_t>(layout.channels);
    return {static_cast<int64_t>(c), static_cast<int64_t>(n - row * inner)};
  }
  const int64_t row = i / layout.inner;
  return {row % layout.channels, i - row * layout.inner};
}

// The factors a[c] and b[c] of the elements of the octet whose first element lies at `p` (p.c, p.r: its
// channel_position), c each one's channel: one read of each for an octet inside one channel's plane (most of them,
// past 8 elements a plane). Past a partial octet's count too: the channels wrap.
ACT_HD void octet_factors_at(const float* __restrict__ a, const float* __restrict__ b, const ChannelLayout& layout,
                             ChannelPosition p, float (&fa)[8], float (&fb)[8]) {
  int64_t c = p.c, r = p.r;
  if (r + 8 <= layout.inner) {
    const float ca = a[c], cb = b[c];
#pragma unroll
    for (int j = 0; j < 8; ++j) fa[j] = ca, fb[j] = cb;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    fa[j] = a[c];
    fb[j] = b[c];
    if (++r == layout.inner) {
      r = 0;
      if (++c == layout.channels) c = 0;
    }
  }
}

// The factors f.a[c] and f.b[c] of element i + j (j in 0..7), c its channel (octet_factors_at).
ACT_HD void octet_channel_factors(const ChannelFactors& f, int64_t i, float (&fa)[8], float (&fb)[8]) {
  octet_factors_at(f.a, f.b, f.layout, channel_position(f.layout, i), fa, fb);
}

// BatchNorm's normalized input, packed as it is read (reference.py: quantize_pack_normalized): v[j], the value of
// element i + j, for j in 0..7 (past a partial octet's count too; those values are masked off after), becomes
// (v - mean[c]) * invstd[c] for its channel c (`norm`: a = mean, b = invstd), the difference and the product each
// rounded (no fused multiply-add).
ACT_HD void normalize_octet(float (&v)[8], const ChannelFactors& norm, int64_t i) {
  float mean[8], invstd[8];
  octet_channel_factors(norm, i, mean, invstd);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = mul_rn(sub_rn(v[j], mean[j]), invstd[j]);
}

// Channel shifts (act_hf/compress/reference.py: channel_shifts): a value's magnitude as the bits of a
// non-negative float, which order like the numbers (a NaN lies above +inf, 0x7F800000)...
ACT_HD uint32_t magnitude_bits(float v) { return float_bits(v) & 0x7FFFFFFFu; }

constexpr uint32_t kInfBits = 0x7F800000u;

// ...and a channel's shift from its largest magnitude and the largest finite channel's, `top`:
// clamp((top - amax) >> 23, 0, max_shift), negative (so 0) for a non-finite channel.
ACT_HD int32_t channel_shift(uint32_t top, uint32_t amax, int32_t max_shift) {
  const int32_t s = (static_cast<int32_t>(top) - static_cast<int32_t>(amax)) >> 23;  // arithmetic shift
  return s < 0 ? 0 : (s > max_shift ? max_shift : s);
}

// (i + step) % channels from c = i % channels, given step_mod = step % channels.
ACT_HD int64_t advance_channel(int64_t c, int64_t step_mod, int64_t channels) {
  c += step_mod;
  return c >= channels ? c - channels : c;
}

// floor(t) clamped to the codes 0..levels, as an integer; NaN (the codes of a non-finite group) gives 0. On the GPU
// one conversion that rounds down (cvt.rmi saturates, and takes NaN to 0) and integer clamps, in place of a floor,
// two float clamps and a conversion: the same integer for every t.
ACT_HD uint32_t clamped_floor(float t, int levels) {
#if defined(__CUDA_ARCH__)
  const int c = __float2int_rd(t);
  return static_cast<uint32_t>(c < 0 ? 0 : (c > levels ? levels : c));
#else
  return static_cast<uint32_t>(fminf(fmaxf(floorf(t), 0.f), static_cast<float>(levels)));  // fmaxf(NaN, 0) is 0
#endif
}

// The B-bit codes of the octet of elements [i, i + cnt) (i a multiple of 8, cnt <= 8) whose fp32 values are v,
// packed into the low cnt * B bits of the result. All eight lanes of the octet are computed without a branch and
// the codes past cnt masked off (v must hold numbers there, any). A group without a scale has inv_scale 0, so its
// q is 0, or NaN for a non-finite value (its group is non-finite): its codes are 0 either way.
template <int B>
ACT_HD uint64_t quantize_octet(const float (&v)[8], int cnt, const GroupFactors& f, uint64_t seed, int64_t i) {
  constexpr int kLevels = (1 << B) - 1;
  using Word = std::conditional_t<(8 * B <= 32), uint32_t, uint64_t>;  // 32-bit shifts where the octet fits
  const uint64_t z = seed + static_cast<uint64_t>(i / 4) * kGolden;  // the octet's first quad
  const uint64_t h[2] = {splitmix64(z), splitmix64(z + kGolden)};
  Word word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float q = mul_rn(sub_rn(v[j], f.lo), f.inv_scale);
    const float t = add_uniform(q, uniform_field(h[j / 4], j % 4));
    word |= static_cast<Word>(clamped_floor(t, kLevels)) << (j * B);  // a code < 256: exact
  }
  if (cnt < 8) word &= (static_cast<Word>(1) << (cnt * B)) - 1;  // cnt * B < 8 * B: the shift is in range
  return word;
}

}  // namespace act_hf
