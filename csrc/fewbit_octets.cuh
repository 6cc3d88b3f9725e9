// What one thread of a few-bit kernel (fewbit_kernel.cu) does with its octet of eight elements, as host and device
// functions: the kernels call them on the GPU, and tests/compress/test_kernel_logic.py builds them for the CPU and
// compares them with the reference (act_hf/compress/reference.py) where no GPU is at hand.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "octets.cuh"

namespace act_hf {

// The type x and the bounds are compared in, and grad and its factor multiplied in.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename A>
ACT_HD bool is_nan(A v) { return v != v; }

// Elements [0, cnt) of `p` (cnt <= 8) widened to acc_t<T>, zeros past cnt.
template <typename T>
ACT_HD void load_octet_widened(const T* __restrict__ p, int cnt, bool vec, acc_t<T> (&v)[8]) {
  alignas(16) T raw[8];
  load_octet_values(p, cnt, vec, raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = j < cnt ? static_cast<acc_t<T>>(raw[j]) : acc_t<T>(0);
}

// Up to this many bits, a code's comparisons are unrolled over 2^B - 1 bounds, those past the n_bounds given NaN
// (padded_bound), so that a kernel's bounds sit in registers (a loop over n_bounds read them from shared memory).
constexpr int kUnrolledEncodeBits = 4;

// bounds[k] for k < n_bounds, else NaN, which no comparison counts: the unrolled bounds of bucket.
template <typename A>
ACT_HD A padded_bound(const A* bounds, int n_bounds, int k) {
  return k < n_bounds ? bounds[k] : std::numeric_limits<A>::quiet_NaN();
}

// The bound a binary search over 2^B - 1 sorted bounds compares with to decide code bit K, once bits B-1..K+1 are
// known (taken[j] for bit j): bounds[high bits + 2^K - 1], chosen by a tree of selects on those bits (J walks them
// down from B-1), so that `bounds` is indexed by constants only and stays in registers.
template <int J, int K, int Prefix, typename A>
ACT_HD A searched_bound(const A* bounds, const bool* taken) {
  if constexpr (J == K) {
    return bounds[Prefix + (1 << K) - 1];
  } else {
    return taken[J] ? searched_bound<J - 1, K, Prefix + (1 << J)>(bounds, taken)
                    : searched_bound<J - 1, K, Prefix>(bounds, taken);
  }
}

// Code bits K..0 of #{k : bounds[k] <= v} by binary search: bit K is whether the bound it splits at is <= v.
template <int B, int K, typename A>
ACT_HD int searched_bits(A v, const A* bounds, bool* taken) {
  taken[K] = searched_bound<B - 1, K, 0>(bounds, taken) <= v;
  const int bit = taken[K] ? 1 << K : 0;
  if constexpr (K == 0) {
    return bit;
  } else {
    return bit | searched_bits<B, K - 1>(v, bounds, taken);
  }
}

// #{k : bounds[k] <= v} over the n_bounds bounds (NaN: n_bounds, above every bound), without a branch. Up to
// kUnrolledEncodeBits bits `bounds` holds 2^B - 1 sorted entries, those past n_bounds NaN (padded_bound), which no
// comparison counts, so that the count is a binary search: B comparisons and 2^B - B - 1 selects where counting took
// 2^B - 1 comparisons, each a compare, an add and a select in the SASS.
template <int B, typename A>
ACT_HD int bucket(A v, const A* bounds, int n_bounds) {
  int code = 0;
  if constexpr (B <= kUnrolledEncodeBits) {
    bool taken[B];
    code = searched_bits<B, B - 1>(v, bounds, taken);
  } else {
    for (int k = 0; k < n_bounds; ++k) code += bounds[k] <= v ? 1 : 0;
  }
  return is_nan(v) ? n_bounds : code;
}

// The codes #{k : bounds[k] <= v[j]} (NaN: n_bounds, above every bound) of v[0..cnt), packed into the low
// cnt * B bits; all eight are computed, without a branch, and those past cnt masked off.
template <int B, typename A>
ACT_HD uint64_t encode_values(const A (&v)[8], int cnt, const A* bounds, int n_bounds) {
  using Word = std::conditional_t<(8 * B <= 32), uint32_t, uint64_t>;  // 32-bit shifts where the octet fits
  Word word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) word |= static_cast<Word>(bucket<B>(v[j], bounds, n_bounds)) << (j * B);
  if (cnt < 8) word &= (static_cast<Word>(1) << (cnt * B)) - 1;  // cnt * B < 8 * B: the shift is in range
  return word;
}

// The codes of x[0..cnt) (encode_values), packed at B bits into the stream's bytes at `dst`.
template <typename T, int B>
ACT_HD void encode_octet(const T* __restrict__ x, int cnt, bool vec, const acc_t<T>* bounds, int n_bounds,
                         uint8_t* __restrict__ dst) {
  acc_t<T> v[8];
  load_octet_widened(x, cnt, vec, v);
  store_octet<B>(dst, encode_values<B>(v, cnt, bounds, n_bounds), (cnt * B + 7) / 8);
}

// out[j] = grad[j] * values[code j] for j < cnt, the codes read from the stream's bytes at `src`.
template <typename T, int B>
ACT_HD void grad_octet(const T* __restrict__ grad, const uint8_t* __restrict__ src, int cnt, bool vec,
                       const acc_t<T>* values, T* __restrict__ out) {
  const uint64_t word = load_octet<B>(src, (cnt * B + 7) / 8);
  acc_t<T> g[8];
  load_octet_widened(grad, cnt, vec, g);
  alignas(16) T vals[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) vals[j] = static_cast<T>(g[j] * values[octet_code<B>(word, j)]);
  store_octet_values(out, vals, cnt, vec);
}

// dst[j] = bit j of `bits` ? src[j] : +0 for j < cnt; `dst` may be `src`.
template <typename T>
ACT_HD void zero_unmasked_octet(const T* src, unsigned bits, int cnt, bool vec, T* dst) {
  alignas(16) T vals[8];
  load_octet_values(src, cnt, vec, vals);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (!((bits >> j) & 1u)) vals[j] = T(0);
  }
  store_octet_values(dst, vals, cnt, vec);
}

// The activations an encode may write back into its input (fewbit_kernel.cu: activation_inplace_code), each
// evaluated as torch's CUDA kernel evaluates it: in A (float for the 16-bit types), the same operations in the same
// order, constants rounded to A as torch rounds them, CUDA's erff, tanhf and expf (erf, tanh, exp for double).
// Whether the results round to torch's bits on a device is checked there, for every 16-bit value, before act_hf
// uses them (act_hf/ops/activation.py: _kernel_matches_torch).
enum ActivationKind : int { kNoActivation = 0, kGelu = 1, kGeluTanh = 2, kSilu = 3 };

enum MathFunction : int { kErf, kTanh, kExp };

// erf, tanh or exp of v: the float function (erff, tanhf, expf) for a float, the double one for a double.
template <int F, typename A>
ACT_HD A math_of(A v) {
  if constexpr (std::is_same_v<A, double>) {
    if constexpr (F == kErf) return erf(v);
    if constexpr (F == kTanh) return tanh(v);
    if constexpr (F == kExp) return exp(v);
  } else {
    if constexpr (F == kErf) return erff(v);
    if constexpr (F == kTanh) return tanhf(v);
    if constexpr (F == kExp) return expf(v);
  }
}

// gelu: x * 0.5 * (1 + erf(x / sqrt(2))); gelu_tanh: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)));
// silu: x / (1 + exp(-x)).
template <int Act, typename A>
ACT_HD A activation_of(A v) {
  static_assert(Act == kGelu || Act == kGeluTanh || Act == kSilu, "an activation to write");
  if constexpr (Act == kGelu) {
    constexpr A kSqrtHalf = static_cast<A>(0.70710678118654752440);
    return v * A(0.5) * (A(1) + math_of<kErf>(v * kSqrtHalf));
  } else if constexpr (Act == kGeluTanh) {
    constexpr A kBeta = static_cast<A>(1.41421356237309504880 * 1.12837916709551257390 * 0.5);  // sqrt(2 / pi)
    constexpr A kKappa = static_cast<A>(0.044715);
    const A cube = v * v * v;
    return A(0.5) * v * (A(1) + math_of<kTanh>(kBeta * (v + kKappa * cube)));
  } else {
    return v / (A(1) + math_of<kExp>(-v));
  }
}

// x[j] = activation_of<Act>(v[j]) rounded to T, for j < cnt: the activation of an octet whose values, widened, are v.
template <int Act, typename T>
ACT_HD void store_activation_octet(const acc_t<T> (&v)[8], int cnt, bool vec, T* __restrict__ x) {
  alignas(16) T vals[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) vals[j] = static_cast<T>(activation_of<Act>(v[j]));
  store_octet_values(x, vals, cnt, vec);
}

// Whether a is -0 (its sign bit set, the rest zero).
template <typename A>
ACT_HD bool is_negative_zero(A a) {
  if constexpr (std::is_same_v<A, double>) {
    return bits_as<uint64_t>(a) == (uint64_t{1} << 63);
  } else {
    return float_bits(a) == 0x80000000u;
  }
}

// A ReLU written into x[0..cnt) and its 1-bit code: bit j of the returned byte is !(x[j] <= 0) (NaN: 1), and where
// it is 0, x[j] becomes +0, or `negative_zero_out` for a -0 (torch's relu(-0) on the device: +0 from torch 2.11's
// CUDA relu, -0 from the CPU's); NaN and the positives stay as they are.
template <typename T>
ACT_HD unsigned relu_octet(T* x, int cnt, bool vec, T negative_zero_out) {
  alignas(16) T vals[8];
  load_octet_values(x, cnt, vec, vals);
  unsigned bits = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j >= cnt) break;  // vals past cnt were never loaded
    const acc_t<T> v = static_cast<acc_t<T>>(vals[j]);
    if (!(v <= acc_t<T>(0))) {
      bits |= 1u << j;
    } else {
      vals[j] = is_negative_zero(v) ? negative_zero_out : T(0);
    }
  }
  store_octet_values(x, vals, cnt, vec);
  return bits;
}

// dst[j] = (bit j of `bits`) * grad[j] * scale for j < cnt, in acc_t<T> and rounded once to T: aten's
// native_dropout_backward of a mask read packed, bit for bit (its masked_scale_kernel computes
// (float)mask * grad * scale, left to right), so a dropped element is 0 * grad: -0 for a negative grad, NaN for a
// non-finite one. `dst` may be `grad`.
template <typename T>
ACT_HD void masked_scale_octet(const T* grad, unsigned bits, int cnt, bool vec, acc_t<T> scale, T* dst) {
  alignas(16) T vals[8];
  load_octet_values(grad, cnt, vec, vals);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const acc_t<T> kept = static_cast<acc_t<T>>((bits >> j) & 1u);
    vals[j] = static_cast<T>(kept * static_cast<acc_t<T>>(vals[j]) * scale);
  }
  store_octet_values(dst, vals, cnt, vec);
}

}  // namespace act_hf
