// Compile-time dispatch helpers shared by act_hf's kernels (flash-attn / apex static_switch.h style).
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

namespace act_hf {
// Error messages as whole strings: see bindings.cpp for why nothing is streamed into them.
inline std::string bits_error(int64_t bits) {
  return "bits must be an integer from 1 to 8, got " + std::to_string(bits);
}

inline std::string shape_str(c10::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + ")";
}
}  // namespace act_hf

// Turns a runtime bit width 1..8 into a constexpr `CONST_NAME` inside the lambda body.
#define ACT_BITS_SWITCH(BITS, CONST_NAME, ...)                                      \
  [&] {                                                                             \
    switch (BITS) {                                                                 \
      case 1: { constexpr int CONST_NAME = 1; return __VA_ARGS__(); }              \
      case 2: { constexpr int CONST_NAME = 2; return __VA_ARGS__(); }              \
      case 3: { constexpr int CONST_NAME = 3; return __VA_ARGS__(); }              \
      case 4: { constexpr int CONST_NAME = 4; return __VA_ARGS__(); }              \
      case 5: { constexpr int CONST_NAME = 5; return __VA_ARGS__(); }              \
      case 6: { constexpr int CONST_NAME = 6; return __VA_ARGS__(); }              \
      case 7: { constexpr int CONST_NAME = 7; return __VA_ARGS__(); }              \
      case 8: { constexpr int CONST_NAME = 8; return __VA_ARGS__(); }              \
      default: TORCH_CHECK(false, act_hf::bits_error(BITS));                         \
    }                                                                               \
  }()
