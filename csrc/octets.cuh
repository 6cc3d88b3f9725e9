// The packed-code stream shared by act_hf's kernels: `bits` (B) bits a code, codes in element order, little endian.
// Eight codes (an octet) fill exactly B bytes, so each thread of a packing kernel owns whole bytes; a last, partial
// octet writes only the ceil(count * B / 8) bytes the stream has (act_hf/compress/reference.py: pack_bits).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define ACT_HD __host__ __device__ __forceinline__
#else  // a host build of the per-octet logic, for the CPU tests (tests/compress/test_kernel_logic.py)
#include <vector_types.h>
#define ACT_HD inline
#endif

namespace act_hf {

constexpr int kThreads = 256;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Writes the low `nbytes` bytes of `word` at `dst`: a full octet (nbytes == B) in stores of fixed widths, the
// widest its offset's alignment allows (`dst` is payload + octet * B: 2-byte aligned at 2 and 6 bits, 4 at 4, 8
// at 8; bytes at 3, 5 and 7), a partial octet byte by byte.
template <int B>
ACT_HD void store_octet(uint8_t* __restrict__ dst, uint64_t word, int nbytes) {
  if (nbytes == B) {
    if constexpr (B == 8) {
      *reinterpret_cast<uint64_t*>(dst) = word;
    } else if constexpr (B == 4) {
      *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(word);
    } else if constexpr (B % 2 == 0) {
#pragma unroll
      for (int k = 0; k < B / 2; ++k) reinterpret_cast<uint16_t*>(dst)[k] = static_cast<uint16_t>(word >> (16 * k));
    } else {
#pragma unroll
      for (int k = 0; k < B; ++k) dst[k] = static_cast<uint8_t>(word >> (8 * k));
    }
  } else {
    for (int k = 0; k < nbytes; ++k) dst[k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

// Reads the `nbytes` bytes at `src` into the low bytes of a word: a full octet as store_octet writes it.
template <int B>
ACT_HD uint64_t load_octet(const uint8_t* __restrict__ src, int nbytes) {
  uint64_t word = 0;
  if (nbytes == B) {
    if constexpr (B == 8) {
      word = *reinterpret_cast<const uint64_t*>(src);
    } else if constexpr (B == 4) {
      word = *reinterpret_cast<const uint32_t*>(src);
    } else if constexpr (B % 2 == 0) {
#pragma unroll
      for (int k = 0; k < B / 2; ++k) {
        word |= static_cast<uint64_t>(reinterpret_cast<const uint16_t*>(src)[k]) << (16 * k);
      }
    } else {
#pragma unroll
      for (int k = 0; k < B; ++k) word |= static_cast<uint64_t>(src[k]) << (8 * k);
    }
  } else {
    for (int k = 0; k < nbytes; ++k) word |= static_cast<uint64_t>(src[k]) << (8 * k);
  }
  return word;
}

// n / d for a divisor d fixed for a kernel launch, by a multiply-high and two shifts (Granlund and Montgomery's
// round-up method, "Division by invariant integers using multiplication", 1994, figure 4.1): exact for every
// 32-bit n and 1 <= d < 2^32, about 4 instructions where a 32-bit division runs a routine of about 20. Built on the
// host (make_divider).
struct Divider {
  uint32_t m;
  uint32_t s1;  // min(l, 1), l = ceil(log2(d))
  uint32_t s2;  // max(l - 1, 0)
};

inline Divider make_divider(uint32_t d) {
  if (d == 0) return {};  // no divisor: a layout of no elements, never divided by
  uint32_t l = 0;
  while (l < 32 && (uint64_t{1} << l) < d) ++l;
  // 2^32 * (2^l - d) / d + 1 < 2^32 (2^l < 2d); 2^32 * (2^l - d) < 2^63
  const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1;
  return {static_cast<uint32_t>(m), l < 1 ? l : 1u, l > 1 ? l - 1 : 0u};
}

ACT_HD uint32_t divide(const Divider& by, uint32_t n) {
#if defined(__CUDA_ARCH__)
  const uint32_t t = __umulhi(n, by.m);
#else
  const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(n) * by.m) >> 32);
#endif
  return (t + ((n - t) >> by.s1)) >> by.s2;
}

// Code j (0..7) of an octet's word: 32-bit shifts and masks where the octet fits 32 bits (up to 4 bits a code), so
// that a decode converts a 32-bit integer to float; a 64-bit one (I2F.U64 in the SASS) is a much slower instruction.
template <int B>
ACT_HD uint32_t octet_code(uint64_t word, int j) {
  constexpr uint32_t kMask = (1u << B) - 1;
  if constexpr (8 * B <= 32) {
    return (static_cast<uint32_t>(word) >> (j * B)) & kMask;
  } else {
    return static_cast<uint32_t>(word >> (j * B)) & kMask;
  }
}

// A value's bits as a value of another type of its size (a float's as uint32_t, a double's as uint64_t, and
// back). A local array of one type read or written through a pointer to another is undefined: the host compiler's
// strict aliasing (-O2) dropped such stores, so that the emulated kernels read values never written
// (tests/compress/emulated_kernels.py), and on the device an array whose address is taken lives in local memory.
template <typename To, typename From>
ACT_HD To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: a type of the same size");
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<From, float>) {
    return __float_as_uint(v);
  } else if constexpr (std::is_same_v<To, float>) {
    return __uint_as_float(v);
  } else if constexpr (std::is_same_v<From, double>) {
    return static_cast<To>(__double_as_longlong(v));
  } else {
    return __longlong_as_double(static_cast<long long>(v));
  }
#else
  To out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#endif
}

ACT_HD uint32_t float_bits(float v) { return bits_as<uint32_t>(v); }
ACT_HD float bits_float(uint32_t b) { return bits_as<float>(b); }

// The 16-byte words an octet of T fills: one for 2-byte values, two for float, four for double.
template <typename T>
constexpr int kOctetWords = static_cast<int>(sizeof(T)) / 2;

// An octet of values from its 16-byte words and back, by shifts, masks and the bit conversions above: 2-byte
// values (c10::Half, c10::BFloat16) by their bits in `.x`, float and double by bits_as.
template <typename T>
ACT_HD void octet_from_words(const uint4 (&w)[kOctetWords<T>], T (&vals)[8]) {
  uint32_t words[4 * kOctetWords<T>];
#pragma unroll
  for (int k = 0; k < kOctetWords<T>; ++k) {
    words[4 * k] = w[k].x, words[4 * k + 1] = w[k].y, words[4 * k + 2] = w[k].z, words[4 * k + 3] = w[k].w;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      vals[j] = bits_float(words[j]);
    } else if constexpr (std::is_same_v<T, double>) {
      vals[j] = bits_as<double>(words[2 * j] | (static_cast<uint64_t>(words[2 * j + 1]) << 32));
    } else {
      static_assert(sizeof(T) == 2, "an octet of 2-, 4- or 8-byte floating values");
      vals[j] = T(static_cast<uint16_t>(j % 2 ? words[j / 2] >> 16 : words[j / 2] & 0xFFFFu), T::from_bits());
    }
  }
}

template <typename T>
ACT_HD void words_from_octet(const T (&vals)[8], uint4 (&w)[kOctetWords<T>]) {
  uint32_t words[4 * kOctetWords<T>];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      words[j] = float_bits(vals[j]);
    } else if constexpr (std::is_same_v<T, double>) {
      const uint64_t b = bits_as<uint64_t>(vals[j]);
      words[2 * j] = static_cast<uint32_t>(b), words[2 * j + 1] = static_cast<uint32_t>(b >> 32);
    } else {
      static_assert(sizeof(T) == 2, "an octet of 2-, 4- or 8-byte floating values");
      if (j % 2 == 0) words[j / 2] = static_cast<uint32_t>(vals[j].x) | (static_cast<uint32_t>(vals[j + 1].x) << 16);
    }
  }
#pragma unroll
  for (int k = 0; k < kOctetWords<T>; ++k) {
    w[k].x = words[4 * k], w[k].y = words[4 * k + 1], w[k].z = words[4 * k + 2], w[k].w = words[4 * k + 3];
  }
}

// Reads src[0..cnt) into vals (the rest left as they are); 16-byte loads when `vec` (src 16-byte aligned) and the
// octet is full.
template <typename T>
ACT_HD void load_octet_values(const T* src, int cnt, bool vec, T (&vals)[8]) {
  if (vec && cnt == 8) {
    uint4 w[kOctetWords<T>];
#pragma unroll
    for (int k = 0; k < kOctetWords<T>; ++k) w[k] = reinterpret_cast<const uint4*>(src)[k];
    octet_from_words(w, vals);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // constant indices keep vals in registers
      if (j < cnt) vals[j] = src[j];
    }
  }
}

// Writes vals[0..cnt) at `dst`; 16-byte stores when `vec` (dst 16-byte aligned) and the octet is full.
template <typename T>
ACT_HD void store_octet_values(T* dst, const T (&vals)[8], int cnt, bool vec) {
  if (vec && cnt == 8) {
    uint4 w[kOctetWords<T>];
    words_from_octet(vals, w);
#pragma unroll
    for (int k = 0; k < kOctetWords<T>; ++k) reinterpret_cast<uint4*>(dst)[k] = w[k];
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < cnt) dst[j] = vals[j];
    }
  }
}

}  // namespace act_hf
