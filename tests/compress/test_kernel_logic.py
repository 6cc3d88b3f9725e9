"""The kernels' per-octet logic (the few-bit kernels' ``csrc/fewbit_octets.cuh``, the quantize kernel's
``csrc/quantize_octets.cuh``, the affine and chain decodes' ``csrc/decode_octets.cuh``), built for the CPU and
called the way the kernels call it (one call per octet of eight elements, 16-byte accesses where aligned and full;
a group's range over its fp32 values): the reference's bits and values, checked where no GPU is at hand. The
kernels themselves, on a GPU and emulated on the CPU, are ``test_kernels_cuda.py``'s."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import pytest
import torch

from act_hf import _ext
from act_hf.compress import reference as R

HARNESS = r"""
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "decode_octets.cuh"
#include "dispatch.h"
#include "fewbit_octets.cuh"
#include "quantize_octets.cuh"

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
int octet_count(int64_t n, int64_t i) { return static_cast<int>(std::min<int64_t>(8, n - i)); }

template <typename T>
std::vector<act_hf::acc_t<T>> widened(const at::Tensor& t) {
  std::vector<act_hf::acc_t<T>> out(t.numel());
  for (int64_t k = 0; k < t.numel(); ++k) out[k] = static_cast<act_hf::acc_t<T>>(t.data_ptr<T>()[k]);
  return out;
}
}  // namespace

// Unwritten bytes stay 0xAB, so a byte an octet fails to write shows.
at::Tensor encode(const at::Tensor& x, const at::Tensor& bounds, int64_t bits, bool allow_vec) {
  const int64_t n = x.numel();
  auto payload = at::full({act_hf::ceil_div(n * bits, 8)}, 0xAB, x.options().dtype(at::kByte));
  const bool vec = allow_vec && aligned16(x.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "encode", [&] {
    const auto b = widened<scalar_t>(bounds);
    ACT_BITS_SWITCH(bits, B, [&] {
      // the kernel's bounds: up to kUnrolledEncodeBits bits, 2^B - 1 of them, padded with NaN as it pads them
      const int n_bounds = static_cast<int>(b.size());
      std::vector<act_hf::acc_t<scalar_t>> padded(B <= act_hf::kUnrolledEncodeBits ? (1 << B) - 1 : n_bounds);
      for (size_t k = 0; k < padded.size(); ++k) padded[k] = act_hf::padded_bound(b.data(), n_bounds, int(k));
      for (int64_t i = 0; i < n; i += 8) {
        act_hf::encode_octet<scalar_t, B>(x.data_ptr<scalar_t>() + i, octet_count(n, i), vec, padded.data(),
                                          n_bounds, payload.data_ptr<uint8_t>() + i / 8 * B);
      }
    });
  });
  return payload;
}

at::Tensor grad(const at::Tensor& g, const at::Tensor& payload, const at::Tensor& values, int64_t bits,
                bool allow_vec) {
  const int64_t n = g.numel();
  auto out = at::empty({n}, g.options());
  const bool vec = allow_vec && aligned16(g.data_ptr()) && aligned16(out.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "grad", [&] {
    const auto v = widened<scalar_t>(values);
    ACT_BITS_SWITCH(bits, B, [&] {
      for (int64_t i = 0; i < n; i += 8) {
        act_hf::grad_octet<scalar_t, B>(g.data_ptr<scalar_t>() + i, payload.data_ptr<uint8_t>() + i / 8 * B,
                                        octet_count(n, i), vec, v.data(), out.data_ptr<scalar_t>() + i);
      }
    });
  });
  return out;
}

// The quantize kernels' two passes over each group, its lanes in turn (the range's reduction across lanes is a
// loop here), channel scaled by `shifts` when it is not empty, each lane tracking its channel as the kernels do,
// or normalized by channel of dim 1 (`mean`, `invstd`, `inner`) when `mean` is not empty:
// group sizes 32 * 2^k up to 1024 in G / 32 lanes, lane l taking the octets at start + 8 * l + G / 4 * t for
// t < 4 (quantize_pack_lanes_kernel), others in a warp's 32 lanes, lane l taking those at start + 8 * l + 256 * t
// (quantize_pack_kernel).
std::vector<at::Tensor> quantize(const at::Tensor& x, const at::Tensor& shifts, int64_t bits, int64_t group_size,
                                 int64_t seed, const at::Tensor& mean, const at::Tensor& invstd, int64_t inner) {
  constexpr int kLanes = 32;
  const int64_t n = x.numel();
  const int64_t n_groups = act_hf::ceil_div(n, group_size);
  const bool scaled = shifts.numel() > 0;
  const int64_t channels = scaled ? shifts.numel() : 1;
  const bool normalized = mean.numel() > 0;
  const act_hf::ChannelFactors norm{normalized ? mean.data_ptr<float>() : nullptr,
                                    normalized ? invstd.data_ptr<float>() : nullptr,
                                    act_hf::channel_layout(std::max<int64_t>(mean.numel(), 1), inner)};
  const int64_t lanes = group_size / 32;
  const bool by_lanes = group_size % 32 == 0 && lanes <= kLanes && (lanes & (lanes - 1)) == 0;
  const int64_t n_lanes = by_lanes ? lanes : kLanes, lane_step = (8 * n_lanes) % channels;
  auto payload = at::full({act_hf::ceil_div(n * bits, 8)}, 0xAB, x.options().dtype(at::kByte));
  auto lo = at::empty({n_groups}, x.options().dtype(at::kShort));
  auto scale = at::empty({n_groups}, x.options().dtype(at::kShort));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    ACT_BITS_SWITCH(bits, B, [&] {
      // calls f(i, cnt, v) for each octet of the group, lane by lane, with the octet's (scaled) fp32 values
      auto each_octet = [&](int64_t start, int64_t end, auto&& f) {
        for (int lane = 0; lane < n_lanes; ++lane) {
          int64_t c = (start + 8 * lane) % channels;
          for (int64_t i = start + 8 * lane; i < end; i += 8 * n_lanes) {
            const int cnt = octet_count(end, i);
            float v[8] = {};
            for (int j = 0; j < cnt; ++j) v[j] = static_cast<float>(p[i + j]);
            if (scaled) {
              act_hf::scale_octet(v, cnt, shifts.data_ptr<int32_t>(), channels, c);
              c = act_hf::advance_channel(c, lane_step, channels);
            }
            if (normalized) act_hf::normalize_octet(v, norm, i);
            f(i, cnt, v);
          }
        }
      };
      for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t start = g * group_size, end = std::min(n, start + group_size);
        float mn = INFINITY, mx = -INFINITY;
        each_octet(start, end, [&](int64_t, int cnt, const float (&v)[8]) { act_hf::range_octet(v, cnt, mn, mx); });
        uint16_t lo_bits, scale_bits;
        act_hf::group_metadata<scalar_t, B>(mn, mx, act_hf::range_nonfinite(mn, mx), lo_bits, scale_bits);
        lo.data_ptr<int16_t>()[g] = static_cast<int16_t>(lo_bits);
        scale.data_ptr<int16_t>()[g] = static_cast<int16_t>(scale_bits);
        const act_hf::GroupFactors factors = act_hf::group_factors<scalar_t>(lo_bits, scale_bits);
        each_octet(start, end, [&](int64_t i, int cnt, const float (&v)[8]) {
          const uint64_t word = act_hf::quantize_octet<B>(v, cnt, factors, static_cast<uint64_t>(seed), i);
          act_hf::store_octet<B>(payload.data_ptr<uint8_t>() + i / 8 * B, word, (cnt * B + 7) / 8);
        });
      }
    });
  });
  return {payload, lo, scale};
}

// The channel-shift kernels' arithmetic: each channel's largest magnitude bits, then the shifts.
at::Tensor channel_shifts(const at::Tensor& x, int64_t channels, int64_t max_shift) {
  std::vector<uint32_t> absmax(channels, 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "channel_shifts", [&] {
    for (int64_t i = 0; i < x.numel(); ++i) {
      absmax[i % channels] = std::max(absmax[i % channels],
                                      act_hf::magnitude_bits(static_cast<float>(x.data_ptr<scalar_t>()[i])));
    }
  });
  uint32_t top = 0;
  for (uint32_t b : absmax) {
    if (b < act_hf::kInfBits) top = std::max(top, b);
  }
  auto shifts = at::empty({channels}, x.options().dtype(at::kInt));
  for (int64_t c = 0; c < channels; ++c) {
    shifts.data_ptr<int32_t>()[c] = act_hf::channel_shift(top, absmax[c], static_cast<int32_t>(max_shift));
  }
  return shifts;
}

at::Tensor zero_unmasked(const at::Tensor& values, const at::Tensor& mask, bool in_place, bool allow_vec) {
  const int64_t n = values.numel();
  auto out = in_place ? values : at::empty({n}, values.options());
  const bool vec = allow_vec && aligned16(values.data_ptr()) && aligned16(out.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "zero_unmasked", [&] {
    for (int64_t i = 0; i < n; i += 8) {
      act_hf::zero_unmasked_octet(values.data_ptr<scalar_t>() + i, mask.data_ptr<uint8_t>()[i / 8],
                                  octet_count(n, i), vec, out.data_ptr<scalar_t>() + i);
    }
  });
  return out;
}

// The chain decode kernel's octets into `out` (flat, contiguous; updated and returned), masks[t] empty for none.
at::Tensor chain(at::Tensor out, const std::vector<at::Tensor>& payloads, const std::vector<at::Tensor>& los,
                 const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& weights,
                 const std::vector<at::Tensor>& biases, const std::vector<at::Tensor>& masks, int64_t bits,
                 int64_t group_size, int64_t start, int64_t inner, bool accumulate) {
  act_hf::DecodeChain chain{};
  chain.count = static_cast<int>(payloads.size());
  chain.layout = act_hf::channel_layout(weights[0].numel(), inner);
  chain.start = start;
  chain.group_size = group_size;
  chain.group_shift = -1;
  for (int k = 0; k < 20; ++k) {
    if ((int64_t{1} << k) == group_size) chain.group_shift = k;
  }
  for (int t = 0; t < chain.count; ++t) {
    chain.terms[t] = act_hf::ChainTerm{payloads[t].data_ptr<uint8_t>(),
                                       reinterpret_cast<const uint16_t*>(los[t].data_ptr<int16_t>()),
                                       reinterpret_cast<const uint16_t*>(scales[t].data_ptr<int16_t>()),
                                       weights[t].data_ptr<float>(), biases[t].data_ptr<float>(),
                                       masks[t].numel() ? masks[t].data_ptr<uint8_t>() : nullptr};
  }
  const int64_t n = out.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "chain", [&] {
    scalar_t* p = out.data_ptr<scalar_t>();
    ACT_BITS_SWITCH(bits, B, [&] {
      for (int64_t k = 0; k < n; k += 8) {
        const int cnt = octet_count(n, k);
        float v[8] = {};
        for (int j = 0; j < cnt && accumulate; ++j) v[j] = static_cast<float>(p[k + j]);
        act_hf::chain_octet<scalar_t, B>(chain, k, cnt, accumulate, v);
        for (int j = 0; j < cnt; ++j) p[k + j] = static_cast<scalar_t>(v[j]);
      }
    });
  });
  return out;
}

// The affine decode kernel's octets (unpack_dequantize_kernel with Affine): fp32 values lo + code * scale, then
// affine_position and affine_octet_at; `divisor` empty for none.
at::Tensor affine(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale, int64_t bits,
                  int64_t group_size, int64_t n, const at::Tensor& mult, const at::Tensor& shift,
                  const at::Tensor& divisor) {
  auto out = at::empty({n}, mult.options());
  const float* rows = divisor.numel() ? divisor.data_ptr<float>() : nullptr;
  const act_hf::ChannelAffine map =
      act_hf::channel_affine(mult.data_ptr<float>(), shift.data_ptr<float>(), mult.numel(), rows, divisor.numel());
  ACT_BITS_SWITCH(bits, B, [&] {
    for (int64_t i = 0; i < n; i += 8) {
      const int cnt = octet_count(n, i);
      const uint64_t word = act_hf::load_octet<B>(payload.data_ptr<uint8_t>() + i / 8 * B, (cnt * B + 7) / 8);
      const int64_t g = i / group_size;
      const float l = act_hf::ZeroPoint<float>::decode(static_cast<uint16_t>(lo.data_ptr<int16_t>()[g]));
      const float s = act_hf::bf16_bits_to_float(static_cast<uint16_t>(scale.data_ptr<int16_t>()[g]));
      float v[8];
      for (int j = 0; j < 8; ++j) {
        v[j] = act_hf::add_rn(l, act_hf::mul_rn(static_cast<float>(act_hf::octet_code<B>(word, j)), s));
      }
      act_hf::affine_octet_at(v, map, act_hf::affine_position(map, i));
      for (int j = 0; j < cnt; ++j) out.data_ptr<float>()[i + j] = v[j];
    }
  });
  return out;
}

// n / d by act_hf::divide for each n of `numerators` (int64 holding 32-bit values) and the divider of d.
at::Tensor divide(const at::Tensor& numerators, int64_t d) {
  const act_hf::Divider by = act_hf::make_divider(static_cast<uint32_t>(d));
  auto out = at::empty_like(numerators);
  for (int64_t k = 0; k < numerators.numel(); ++k) {
    out.data_ptr<int64_t>()[k] = act_hf::divide(by, static_cast<uint32_t>(numerators.data_ptr<int64_t>()[k]));
  }
  return out;
}

at::Tensor masked_scale(const at::Tensor& grad, const at::Tensor& mask, double scale, bool allow_vec) {
  const int64_t n = grad.numel();
  auto out = at::empty({n}, grad.options());
  const bool vec = allow_vec && aligned16(grad.data_ptr()) && aligned16(out.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "masked_scale", [&] {
    for (int64_t i = 0; i < n; i += 8) {
      act_hf::masked_scale_octet(grad.data_ptr<scalar_t>() + i, mask.data_ptr<uint8_t>()[i / 8], octet_count(n, i),
                                 vec, static_cast<act_hf::acc_t<scalar_t>>(scale), out.data_ptr<scalar_t>() + i);
    }
  });
  return out;
}
"""

LENGTHS = [1, 7, 8, 9, 255, 1000, 4099]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.fixture(scope="module")
def octets():
    """The harness, built once per version of the headers (``$ACT_HF_CACHE``), with the CUDA toolkit's vector
    types; skipped where no toolkit or compiler is found."""
    from torch.utils import cpp_extension

    cuda_home = _ext._find_cuda_home()
    if cuda_home is None or not (Path(cuda_home) / "include" / "vector_types.h").is_file():
        pytest.skip("no CUDA toolkit headers (vector_types.h) to build the per-octet logic with")
    digest = hashlib.sha256(HARNESS.encode())
    for name in ("dispatch.h", "octets.cuh", "fewbit_octets.cuh", "quantize_octets.cuh", "decode_octets.cuh"):
        digest.update((_ext.CSRC_DIR / name).read_bytes())
    name = f"act_hf_octets_cpu_{digest.hexdigest()[:12]}"
    build = Path(os.environ.get("ACT_HF_CACHE", Path.home() / ".cache" / "act_hf")) / "octets_cpu" / name
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load_inline(name=name, cpp_sources=HARNESS,
                                     functions=["encode", "grad", "quantize", "channel_shifts", "zero_unmasked",
                                                "masked_scale", "chain", "affine", "divide"],
                                     extra_include_paths=[str(_ext.CSRC_DIR), str(Path(cuda_home) / "include")],
                                     extra_cflags=["-O1", "-ffp-contract=off"], build_directory=str(build))


def _views(t: torch.Tensor, n: int):
    """``t[0:n]`` (16-byte aligned) and ``t[3:3 + n]`` (not)."""
    return [(0, t[:n]), (3, t[3:3 + n])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_encode_and_grad_octets_give_the_reference(octets, dtype, bits):
    """Codes against sorted bounds (a duplicate bound, ties, NaN, +-inf) packed at ``bits``, and the gradient times
    each code's value (inf gradients too), with and without 16-byte accesses."""
    gen = torch.Generator().manual_seed(bits)
    bounds = (torch.randn((1 << bits) - 1, generator=gen, dtype=torch.float64) * 2).to(dtype).sort().values
    if bounds.numel() > 2:
        bounds[1] = bounds[2]
    values = torch.randn(1 << bits, generator=gen, dtype=torch.float64).to(dtype)
    for n in LENGTHS:
        x = (torch.randn(n + 3, generator=gen, dtype=torch.float64) * 3).to(dtype)
        head = torch.cat([torch.tensor([math.nan, math.inf, -math.inf, 0.0], dtype=dtype), bounds])
        x[:min(n, head.numel())] = head[:n]
        g = torch.randn(n + 3, generator=gen, dtype=torch.float64).to(dtype)
        g[n // 2] = math.inf
        for (start, xs), (_, gs) in zip(_views(x, n), _views(g, n)):
            want = R.fewbit_encode_pack(xs, bounds, bits)
            for allow_vec in (True, False):
                payload = octets.encode(xs, bounds, bits, allow_vec)
                assert torch.equal(payload, want), f"codes differ (n={n}, start={start}, vec={allow_vec})"
                got, ref = octets.grad(gs, payload, values, bits, allow_vec), R.fewbit_grad(gs, payload, values, bits)
                assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num()), (
                    f"gradients differ (n={n}, start={start}, vec={allow_vec})")


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_encode_octets_with_fewer_bounds_than_codes(octets, bits):
    """Fewer sorted bounds than the ``2^bits - 1`` a code can have: the comparisons past them count nothing (the
    kernel's unrolled ones up to 4 bits included) and NaN takes the number of bounds, as ``bucketize`` does."""
    gen = torch.Generator().manual_seed(bits)
    bounds = torch.randn((1 << bits) - 3, generator=gen).sort().values
    x = torch.cat([torch.tensor([math.nan, math.inf, -math.inf]), bounds, torch.randn(61, generator=gen) * 3])
    for allow_vec in (True, False):
        assert torch.equal(octets.encode(x, bounds, bits, allow_vec), R.fewbit_encode_pack(x, bounds, bits))


def _masked_cases(dtype: torch.dtype, seed: int):
    """``(n, values, keep, mask)`` for each of ``LENGTHS``, aligned and not (:func:`_views`): values with NaN, inf
    and -1 first, a random keep-mask and it packed at 1 bit."""
    gen = torch.Generator().manual_seed(seed)
    for n in LENGTHS:
        values = torch.randn(n + 3, generator=gen, dtype=torch.float64).to(dtype)
        values[:min(n, 3)] = torch.tensor([math.nan, math.inf, -1.0], dtype=dtype)[:min(n, 3)]
        keep = torch.rand(n + 3, generator=gen) < 0.5
        for start, v in _views(values, n):
            yield n, v, keep[start:start + n], R.pack_bits(keep[start:start + n].to(torch.uint8), 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_unmasked_octets_give_the_reference(octets, dtype):
    """``where(mask, values, 0)`` from the packed mask, bit for bit (dropped NaN and inf become +0), into a new
    tensor and in place, with and without 16-byte accesses."""
    for n, v, _, mask in _masked_cases(dtype, 7):
        want = R.zero_unmasked(v, mask).view(torch.uint8)
        for allow_vec in (True, False):
            assert torch.equal(octets.zero_unmasked(v, mask, False, allow_vec).view(torch.uint8), want)
            inplace = v.clone()
            octets.zero_unmasked(inplace, mask, True, allow_vec)
            assert torch.equal(inplace.view(torch.uint8), want), f"in place differs (n={n}, vec={allow_vec})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_scale_octets_give_aten_dropout_backward(octets, dtype):
    """Dropout's input gradient from the packed keep-mask is ``native_dropout_backward``'s, bit for bit: the kept
    elements times the scale rounded once, the dropped ``0 * grad`` (-0, NaN for inf and NaN), with and without
    16-byte accesses. NaNs compare by place (their payloads are the converting code's: aten's vectorized bf16
    rounding keeps all mantissa bits, c10's scalar one gives the quiet NaN)."""
    for n, g, keep, mask in _masked_cases(dtype, 8):
        for p in (0.1, 0.3):
            want = torch.ops.aten.native_dropout_backward(g, keep, 1 / (1 - p))
            found = [R.masked_scale(g, mask, 1 / (1 - p))]
            found += [octets.masked_scale(g, mask, 1 / (1 - p), allow_vec) for allow_vec in (True, False)]
            for got in found:
                assert torch.equal(got.isnan(), want.isnan()), f"n={n}"
                assert torch.equal(got.nan_to_num().view(torch.uint8), want.nan_to_num().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("group_size", [8, 24, 32, 256, 1024])  # 32 to 1024: quantize_pack_lanes_kernel's
def test_quantize_octets_give_the_reference(octets, dtype, bits, group_size):
    """Zero points, scales and codes of the quantize kernel's arithmetic, bit for bit with the reference: groups
    of mixed magnitudes, a zero-range group, a group whose range is below bf16's smallest normal number (its
    scale raised to 2^-126), groups with a NaN, +inf or -inf, and a partial last group."""
    gen = torch.Generator().manual_seed(bits * 1000 + group_size)
    for n in LENGTHS:
        x = (torch.randn(n, generator=gen, dtype=torch.float64) * torch.logspace(-3, 3, n, dtype=torch.float64)
             - 1).to(dtype)
        if n > 3 * group_size:
            x[group_size:2 * group_size] = 0.5  # zero range
            if dtype != torch.float16:  # fp16 has no numbers this small
                x[2 * group_size:3 * group_size] = torch.linspace(1e-38, 1.0001e-38, group_size,
                                                                  dtype=torch.float64).to(dtype)
        if n > 8:
            x[n // 2] = math.nan
            x[n // 4] = -math.inf
            x[-1] = math.inf
        for seed in (0, 1234 + n, (1 << 63) - 1):
            got = octets.quantize(x, NO_SHIFTS, bits, group_size, seed, NO_STATS, NO_STATS, 1)
            want = R.quantize_pack(x, bits, group_size, seed)
            for g, w, name in zip(got, want, ("payload", "lo", "scale")):
                assert torch.equal(g, w), f"{name} differs (n={n}, seed={seed})"


NO_SHIFTS = torch.empty(0, dtype=torch.int32)
NO_STATS = torch.empty(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels", [1, 3, 8, 96, 300, 1024])
def test_channel_scaled_quantize_octets_give_the_reference(octets, dtype, channels):
    """The kernel's channel scaling: each lane's channel tracked across its octets (fewer channels than a warp's
    256 elements, a number that does not divide it, more), rows that straddle octets and groups: the reference's
    bits, which are those of the plain quantizer on the scaled tensor."""
    gen = torch.Generator().manual_seed(channels)
    top = 15 if dtype == torch.float16 else 24
    shifts = torch.randint(0, top + 1, (channels,), generator=gen, dtype=torch.int32)
    for n in (channels, 7 * channels + 5, 4099):
        scaled = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        x = (scaled.float() / R.channel_powers(shifts, 0, n)).to(dtype)  # exact: powers of two
        for bits, group_size in ((1, 8), (3, 64), (8, 256), (3, 1024), (2, 96)):  # 96: one warp a group
            got = octets.quantize(x, shifts, bits, group_size, 5, NO_STATS, NO_STATS, 1)
            want = R.quantize_pack(x, bits, group_size, 5, shifts=shifts)
            for g, w, name in zip(got, want, ("payload", "lo", "scale")):
                assert torch.equal(g, w), f"{name} differs (n={n}, {bits} bits, group size {group_size})"
            plain = R.quantize_pack((x.float() * R.channel_powers(shifts, 0, n)).to(dtype), bits, group_size, 5)
            assert all(torch.equal(a, b) for a, b in zip(want, plain))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 5, 7), (70, 9), (2, 300, 1), (4, 16, 49)])
def test_normalized_quantize_octets_give_the_reference(octets, dtype, shape):
    """BatchNorm's normalized input packed as it is read (``normalize_octet``): each element's channel of dim 1
    from its index, planes and channel counts that do not divide an octet or a warp's 256 elements, a non-finite
    value: the reference's bits, which are those of the plain quantizer on the fp32 normalized tensor."""
    gen = torch.Generator().manual_seed(math.prod(shape))
    channels, inner = shape[1], math.prod(shape[2:])
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1).to(dtype).reshape(-1)
    x[len(x) // 3] = math.inf
    mean, invstd = torch.randn(channels, generator=gen), torch.rand(channels, generator=gen) + 0.2
    for bits, group_size in ((1, 8), (3, 64), (8, 256), (3, 1024), (2, 96)):
        got = octets.quantize(x, NO_SHIFTS, bits, group_size, 5, mean, invstd, inner)
        want = R.quantize_pack_normalized(x, mean, invstd, inner, bits, group_size, 5)
        for g, w, name in zip(got, want, ("payload", "lo", "scale")):
            assert torch.equal(g, w), f"{name} differs ({bits} bits, group size {group_size})"
        normalized = (x.float().view(-1, channels, inner) - mean.view(1, -1, 1)) * invstd.view(1, -1, 1)
        plain = R.quantize_pack(normalized.reshape(-1), bits, group_size, 5)
        assert all(torch.equal(a, b) for a, b in zip(want, plain))


@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize("channels", [3, 8, 12, 96, 1000])
def test_affine_decode_octets_give_the_reference(octets, bits, channels):
    """The affine decode (``unpack_dequantize_affine``'s kernel): each value times its channel's ``mult`` less its
    ``shift``, then times the reciprocal of its row's divisor, for octets inside a row and octets across rows
    (channels that do not divide 8, rows shorter than an octet), a partial last octet, a NaN group: the
    reference's bits, with and without a divisor."""
    gen = torch.Generator().manual_seed(channels * 10 + bits)
    for rows in (1, 5, 33):
        n = rows * channels
        x = torch.randn(n, generator=gen) * 3
        if n > 40:
            x[n // 2] = math.nan
        for group_size in (24, 256):
            packed = R.quantize_pack(x, bits, group_size, 11)
            mult, shift = torch.randn(channels, generator=gen), torch.randn(channels, generator=gen)
            divisor = torch.rand(rows, generator=gen) + 0.5
            for div in (None, divisor):
                want = R.unpack_dequantize_affine(*packed, bits, group_size, n, mult, shift, div)
                got = octets.affine(*packed, bits, group_size, n, mult, shift,
                                    torch.empty(0) if div is None else div)
                assert torch.equal(got.isnan(), want.isnan()), (rows, group_size, div is None)
                assert torch.equal(got.nan_to_num().view(torch.int32), want.nan_to_num().view(torch.int32)), (
                    rows, group_size, div is None)


def test_divider_divides_every_32_bit_numerator(octets):
    """``act_hf::divide`` (a multiply-high and two shifts in place of a division routine: channel positions, the
    affine decode's rows): ``n // d`` exactly for divisors 1 to 3000, powers of two and their neighbours, the
    largest ones, and numerators at both ends of the 32-bit range, at and around multiples of d, and random."""
    gen = torch.Generator().manual_seed(0)
    top = (1 << 32) - 1
    divisors = list(range(1, 3001)) + [d + e for k in range(12, 33) for d in [1 << k] for e in (-1, 0, 1)
                                        if 1 <= d + e <= top] + [top, top - 1, 3 * (1 << 30), 641 * 6700417 // 7]
    random = torch.randint(0, 1 << 32, (2000,), generator=gen, dtype=torch.int64)
    for d in divisors:
        ends = [0, 1, d - 1, d, d + 1, top, top - 1, top - top % d, top - top % d - 1, (1 << 31), (1 << 31) - 1]
        multiples = [q * d + e for q in (1, 2, 3, top // d - 1, top // d) for e in (-1, 0, 1)]
        n = torch.cat([torch.tensor([v for v in ends + multiples if 0 <= v <= top], dtype=torch.int64), random])
        assert torch.equal(octets.divide(n, d), n // d), d


@pytest.mark.parametrize("dtype", DTYPES)
def test_channel_shift_arithmetic_gives_the_reference(octets, dtype):
    """Shifts from magnitude bits: outlier channels, a channel of zeros (and of -0.0), a NaN, an Inf and a
    subnormal channel, every channel non-finite, and no channel above the rest."""
    gen = torch.Generator().manual_seed(3)
    max_shift = 15 if dtype == torch.float16 else 24
    x = torch.randn(70, 12, generator=gen, dtype=torch.float64) * torch.logspace(-4, 3, 12, dtype=torch.float64)
    x[:, 2] = 0.0
    x[:, 3] = -0.0
    x[5, 4] = math.nan
    x[9, 5] = -math.inf
    if dtype != torch.float16:
        x[:, 6] = 1e-39
    cases = [x, torch.full((70, 12), math.nan, dtype=torch.float64), torch.ones(70, 12, dtype=torch.float64)]
    for t in cases:
        t = t.to(dtype)
        want = R.channel_shifts(t, max_shift)
        assert torch.equal(octets.channel_shifts(t.reshape(-1), 12, max_shift), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_chain_decode_octets_give_the_reference(octets, dtype, bits):
    """Up to eight packed tensors of one shape decoded by channel, summed and masked into a batch's items (a start
    past the first item, a partial last octet, channels and planes that do not divide an octet, a NaN group),
    added to what the output holds or not: the reference's values bit for bit."""
    gen = torch.Generator().manual_seed(bits)
    for shape, group_size, terms in [((5, 3, 7), 24, 3), ((4, 16, 2, 2), 256, 8), ((3, 2, 9), 8, 1),
                                     ((6, 5, 40), 64, 2)]:
        numel, per_item, channels = math.prod(shape), math.prod(shape[1:]), shape[1]
        packed, weights, biases, masks = [], [], [], []
        for t in range(terms):
            x = torch.randn(numel, generator=gen, dtype=torch.float64).mul_(2 ** t).to(dtype)
            if t == 1:
                x[numel // 2] = math.nan
            packed.append(R.quantize_pack(x, bits, group_size, seed=t))
            weights.append(torch.randn(channels, generator=gen))
            biases.append(torch.randn(channels, generator=gen))
        items = next((i for i in range(1, shape[0]) if i * per_item % 8 == 0), 0), shape[0]
        count = (items[1] - items[0]) * per_item
        for t in range(terms):
            masks.append(R.pack_bits((torch.rand(count, generator=gen) > 0.3).to(torch.uint8), 1) if t % 2 else None)
        for accumulate in (False, True):
            old = torch.randn(count, generator=gen, dtype=torch.float64).to(dtype)
            want, got = old.clone(), old.clone()
            args = ([p[0] for p in packed], [p[1] for p in packed], [p[2] for p in packed], weights, biases)
            R.unpack_dequantize_chain(want, *args, masks, bits, group_size, numel, items[0] * per_item,
                                      per_item // channels, accumulate)
            octets.chain(got, *args, [torch.empty(0, dtype=torch.uint8) if m is None else m for m in masks], bits,
                         group_size, items[0] * per_item, per_item // channels, accumulate)
            assert torch.equal(got.isnan(), want.isnan()), f"NaNs differ ({shape}, accumulate={accumulate})"
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"values differ ({shape}, {accumulate})"
