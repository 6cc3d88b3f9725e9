// Element access shared by the quantize and decode kernels (quantize_kernels.cuh, dequantize_kernel.cu): a value
// to and from fp32, and an octet of eight elements loaded as fp32.
#pragma once

#include <cuda_runtime.h>  // uint4

#include <cstdint>

#include "octets.cuh"

namespace act_hf {
namespace {

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }  // c10 types round to nearest even

// Loads elements [i, i+cnt) (cnt <= 8) as floats; one or more 16-byte loads when aligned and full.
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ p, int cnt, bool vec, float (&v)[8]) {
  if (vec && cnt == 8) {
    T e[8];
    load_octet_values(p, 8, true, e);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = to_float(e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = j < cnt ? to_float(p[j]) : 0.f;
  }
}

}  // namespace
}  // namespace act_hf
