"""CUDA kernels == the PyTorch reference, bit for bit (same hash-based draws).

Each comparison runs twice: on a GPU (cuda-marked, skipped without one) and on the CPU, where the same sources
are built with CUDA's built-ins emulated (``emulated_kernels.py``): the kernels' bodies and their launch code
checked on every run, the GPU's own arithmetic and scheduling where one is lent. The emulation runs a block's
threads as fibers, one after another, so its largest shape is smaller."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from act_hf import _ext
from act_hf.compress import reference as R
from tests.compress import emulated_kernels

SHAPES = [1, 7, 8, 255, 256, 257, 1000, 4099]


@dataclass(frozen=True)
class Kernels:
    """The extension's functions (``module``'s), the device its tensors live on and the shapes to try: several
    blocks of every kernel at the largest."""

    module: ModuleType
    device: str
    shapes: tuple[int, ...]

    def __getattr__(self, name: str):
        return getattr(self.module, name)


@pytest.fixture(scope="module")
def gpu_ext():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _ext.require()


@pytest.fixture(scope="module", params=[pytest.param("cuda", marks=pytest.mark.cuda, id="gpu"),
                                        pytest.param("cpu", id="emulated")])
def ext(request) -> Kernels:
    if request.param == "cuda":
        return Kernels(request.getfixturevalue("gpu_ext"), "cuda", (*SHAPES, 65536 + 13))
    module = emulated_kernels.build()
    if module is None:
        pytest.skip("no CUDA toolkit headers (cuda_runtime.h) to build the emulated kernels with")
    return Kernels(module, "cpu", (*SHAPES, 8192 + 13))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("group_size", [8, 24, 32, 64, 256, 1024])  # 24: decoding's group index by division
def test_quantize_pack_matches_reference(ext, bits, dtype, group_size):
    for n in ext.shapes:
        x = (torch.randn(n, device=ext.device) * 4 - 1).to(dtype)
        if n > 300:
            x[100:100 + group_size] = 0.5  # a zero-range group
            x[-1] = float("nan")
        seed = 1234 + n
        got = ext.quantize_pack(x, bits, group_size, seed)
        want = R.quantize_pack(x, bits, group_size, seed)
        for g, w, name in zip(got, want, ("payload", "lo", "scale")):
            assert torch.equal(g, w), f"{name} differs (n={n})"
        out = ext.unpack_dequantize(*got, bits, group_size, n, dtype)
        ref = R.unpack_dequantize(*want, bits, group_size, n, dtype)
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(ref))


@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels", [1, 7, 96, 300, 1024])
def test_quantize_pack_scaled_matches_reference(ext, bits, dtype, channels):
    """Channel scaling inside the kernel: each lane's channel tracked across its octets (channels fewer than,
    not dividing, and more than a warp's 256 elements) and rows that straddle groups."""
    for n in (channels * 3, 4099, 65536 + 13):
        x = (torch.randn(n, device=ext.device) * 4 - 1).to(dtype)
        shifts = torch.randint(0, 16 if dtype == torch.float16 else 25, (channels,), dtype=torch.int32,
                               device=ext.device)
        x = (x.float() / R.channel_powers(shifts, 0, n)).to(dtype)  # no channel carried past the largest value
        for group_size in (64, 96, 256, 1024):  # a lane's channel carried between its octets; 96: a warp a group
            got = ext.quantize_pack_scaled(x, shifts, bits, group_size, 99 + n)
            want = R.quantize_pack(x, bits, group_size, 99 + n, shifts=shifts)
            for g, w, name in zip(got, want, ("payload", "lo", "scale")):
                assert torch.equal(g, w), f"{name} differs (n={n}, group size {group_size})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(64, 1), (100, 7), (4096, 1024), (70000, 3), (3, 70000)])
def test_channel_shifts_match_reference(ext, dtype, shape):
    """The channel-shift kernels against the reference: channels that divide the threads and do not, fewer rows
    than a thread's stride and more, a NaN channel, an Inf channel and a channel of zeros."""
    x = (torch.randn(shape, device=ext.device, dtype=torch.float64) * torch.logspace(-3, 3, shape[1], device=ext.device,
                                                                               dtype=torch.float64)).to(dtype)
    if shape[1] >= 7:
        x[:, 0] = 0.0
        x[1, 1] = float("nan")
        x[2, 2] = float("-inf")
    max_shift = 15 if dtype == torch.float16 else 24
    got = ext.channel_shifts(x.reshape(-1), shape[1], max_shift)
    assert torch.equal(got, R.channel_shifts(x, max_shift))


@pytest.mark.parametrize("packed_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float64)])
def test_unpack_dequantize_into_another_dtype_matches_reference(ext, packed_dtype, dtype):
    """``dequantize(packed, dtype)``'s direct decode (metadata of the packed dtype, results in ``dtype``)."""
    x = (torch.randn(4099, device=ext.device) * 4 - 1).to(packed_dtype)
    packed = ext.quantize_pack(x, 3, 256, 77)
    out = ext.unpack_dequantize(*packed, 3, 256, x.numel(), dtype)
    assert out.dtype == dtype and torch.equal(out, R.unpack_dequantize(*packed, 3, 256, x.numel(), dtype))


@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize("group_size", [24, 256])
@pytest.mark.parametrize("channels", [1, 7, 1024])
def test_unpack_dequantize_affine_matches_reference(ext, bits, group_size, channels):
    """The decode's per-channel ``v * mult - shift`` (each rounded, no fused multiply-add), and that times the
    reciprocal of a per-row divisor (each rounded): rows that straddle groups and octets, channels fewer than and
    more than an octet (several rows an octet)."""
    for rows in (1, 3, 70):
        n = rows * channels
        x = torch.randn(n, device=ext.device) * 3
        packed = ext.quantize_pack(x, bits, group_size, 5)
        mult = torch.rand(channels, device=ext.device) + 0.3
        shift = torch.randn(channels, device=ext.device)
        divisor = torch.rand(rows, device=ext.device) * 3 + 0.1
        for d in (None, divisor):
            out = ext.unpack_dequantize_affine(*packed, bits, group_size, n, mult, shift, d)
            ref = R.unpack_dequantize_affine(*packed, bits, group_size, n, mult, shift, d)
            assert out.dtype == torch.float32 and torch.equal(out, ref), f"rows={rows}, divisor={d is not None}"


@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize("group_size", [24, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["new masked", "accumulate", "accumulate masked"])
def test_unpack_dequantize_into_matches_reference(ext, bits, group_size, dtype, form):
    """A decode mapped by channel (dim 1 of (items, channels, inner)), added to what ``out`` holds and masked, from
    the first item and from one that starts inside a group, into an aligned ``out`` and one that is not (a view one
    element in), channels and planes fewer than and more than an octet."""
    accumulate, masked = "accumulate" in form, "masked" in form
    for items, channels, inner in [(5, 3, 7), (3, 16, 49), (2, 1, 1000), (70, 9, 1)]:
        n = items * channels * inner
        x = (torch.randn(n, device=ext.device) * 3).to(dtype)
        packed = ext.quantize_pack(x, bits, group_size, 5)
        weight = torch.rand(channels, device=ext.device) + 0.3
        bias = torch.randn(channels, device=ext.device)
        for first in (0, 1):
            start = first * channels * inner
            if start % 8:
                continue
            count = n - start
            mask = torch.randint(0, 256, (math.ceil(count / 8),), dtype=torch.uint8, device=ext.device) if masked else None
            for offset in (0, 1):
                base = torch.randn(count + offset, device=ext.device).to(dtype)
                out, ref = base.clone()[offset:], base.clone()[offset:]
                ext.unpack_dequantize_into(out, *packed, bits, group_size, n, start, weight, bias, inner, mask,
                                           accumulate)
                R.unpack_dequantize_into(ref, *packed, bits, group_size, n, start, weight, bias, inner, mask,
                                         accumulate)
                assert torch.equal(out, ref), f"items={items} channels={channels} start={start} offset={offset}"


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
@pytest.mark.parametrize("group_size", [24, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("accumulate", [False, True])
def test_unpack_dequantize_chain_matches_reference(ext, bits, group_size, dtype, accumulate):
    """Two to eight packed tensors decoded by channel, summed in fp32 with masks after some, into a batch's items
    (from the first and from one inside a group), an aligned ``out`` and one that is not, rounded once: the
    reference's bits, a NaN group's too."""
    for items, channels, inner, terms in [(5, 3, 7, 3), (3, 16, 49, 8), (70, 9, 1, 2), (4, 64, 56, 4)]:
        n = items * channels * inner
        packed, weights, biases = [], [], []
        for t in range(terms):
            x = (torch.randn(n, device=ext.device) * 3 * 2.0 ** -t).to(dtype)
            x[n // 3] = float("nan") if t == 1 else x[n // 3]
            packed.append(ext.quantize_pack(x, bits, group_size, 5 + t))
            weights.append(torch.rand(channels, device=ext.device) + 0.3)
            biases.append(torch.randn(channels, device=ext.device))
        for first in (0, 1):
            start = first * channels * inner
            if start % 8:
                continue
            count = n - start
            masks = [torch.randint(0, 256, (math.ceil(count / 8),), dtype=torch.uint8, device=ext.device) if t % 2 else
                     None for t in range(terms)]
            args = ([p[0] for p in packed], [p[1] for p in packed], [p[2] for p in packed], weights, biases, masks,
                    bits, group_size, n, start, inner, accumulate)
            for offset in (0, 1):
                base = torch.randn(count + offset, device=ext.device).to(dtype)
                out, ref = base.clone()[offset:], base.clone()[offset:]
                ext.unpack_dequantize_chain(out, *args)
                R.unpack_dequantize_chain(ref, *args)
                assert torch.equal(out.isnan(), ref.isnan()), f"items={items} start={start} offset={offset}"
                assert torch.equal(out.nan_to_num(), ref.nan_to_num()), f"items={items} start={start} offset={offset}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bits, group_size", [(1, 8), (2, 256), (3, 24), (3, 1024), (8, 256)])
def test_quantize_pack_normalized_matches_reference(ext, dtype, bits, group_size):
    """BatchNorm's normalized input packed as the kernel reads the input (both quantize kernels: groups of 32 * 2^k
    and others), channels of dim 1 from each element's index: the reference's bits, an unaligned input too."""
    for shape in [(3, 5, 7), (70, 9), (4, 16, 49), (2, 3, 1000)]:
        channels, inner = shape[1], math.prod(shape[2:])
        base = (torch.randn(math.prod(shape) + 1, device=ext.device) * 3 + 1).to(dtype)
        mean = torch.randn(channels, device=ext.device)
        invstd = torch.rand(channels, device=ext.device) + 0.2
        for x in (base[:-1], base[1:]):
            got = ext.quantize_pack_normalized(x, mean, invstd, inner, bits, group_size, 11)
            want = R.quantize_pack_normalized(x, mean, invstd, inner, bits, group_size, 11)
            for g, w, name in zip(got, want, ("payload", "lo", "scale")):
                assert torch.equal(g, w), f"{name} differs (shape {shape})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_masked_scale_matches_native_dropout_backward(ext, dtype):
    """Dropout's input gradient from the packed keep-mask: ``native_dropout_backward``'s bits on the GPU (the
    dropped elements ``0 * grad``: -0, NaN for inf and NaN), aligned or not."""
    for n in ext.shapes:
        grad = (torch.randn(n + 1, device=ext.device) * 3).to(dtype)
        grad[:2] = torch.tensor([math.nan, math.inf], dtype=dtype)
        keep = torch.rand(n + 1, device=ext.device) < 0.7
        for start in (0, 1):
            g, k = grad[start:start + n], keep[start:start + n]
            mask = R.pack_bits(k.to(torch.uint8), 1)
            out = ext.masked_scale(g, mask, 1 / 0.7)
            want = torch.ops.aten.native_dropout_backward(g, k, 1 / 0.7)
            assert torch.equal(out.isnan(), want.isnan()), f"n={n}"
            assert torch.equal(out.nan_to_num().view(torch.uint8), want.nan_to_num().view(torch.uint8)), f"n={n}"


def test_unaligned_input_view(ext):
    base = torch.randn(10_000, device=ext.device, dtype=torch.bfloat16)
    x = base[3:]  # storage offset breaks 16-byte alignment
    got = ext.quantize_pack(x, 3, 256, 9)
    want = R.quantize_pack(x, 3, 256, 9)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_pack_unpack_bits_match_reference(ext, bits):
    for n in ext.shapes:
        codes = torch.randint(0, 2**bits, (n,), device=ext.device, dtype=torch.uint8)
        payload = ext.pack_bits(codes, bits)
        assert torch.equal(payload, R.pack_bits(codes, bits))
        assert torch.equal(ext.unpack_bits(payload, bits, n), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_fewbit_encode_pack_and_grad_match_reference(ext, bits, dtype):
    """The few-bit kernels == the reference on the same GPU tensors: codes against sorted bounds (ties, a
    duplicate bound as rounding makes them, NaN, +-inf), packed; the gradient times the looked-up values (NaN and
    inf gradients too); aligned and unaligned views."""
    gen = torch.Generator().manual_seed(bits)
    bounds = (torch.randn((1 << bits) - 1, generator=gen, dtype=torch.float64) * 2).to(dtype).sort().values
    if bounds.numel() > 2:
        bounds[1] = bounds[2]
    bounds, values = bounds.to(ext.device), torch.randn(1 << bits, generator=gen, dtype=torch.float64).to(dtype).to(ext.device)
    for n in ext.shapes:
        x = (torch.randn(n + 5, generator=gen, dtype=torch.float64) * 3).to(dtype).to(ext.device)
        head = torch.cat([torch.tensor([math.nan, math.inf, -math.inf, 0.0], dtype=dtype).to(ext.device), bounds])
        x[:min(n, head.numel())] = head[:n]
        grad = torch.randn(n + 5, generator=gen, dtype=torch.float64).to(dtype).to(ext.device)
        grad[n // 2] = math.inf
        for start in (0, 3):  # a view that breaks 16-byte alignment
            xs, gs = x[start:start + n], grad[start:start + n]
            payload = ext.fewbit_encode_pack(xs, bounds, bits)
            assert torch.equal(payload, R.fewbit_encode_pack(xs, bounds, bits)), f"codes differ (n={n})"
            got, want = ext.fewbit_grad(gs, payload, values, bits), R.fewbit_grad(gs, payload, values, bits)
            assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan()), f"NaNs differ (n={n})"
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"gradients differ (n={n})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_zero_unmasked_matches_reference(ext, dtype):
    """``torch.where(mask, values, 0)`` from the packed mask: the kernel's bits are the reference's, into a new
    tensor and in place, aligned and not (dropped NaN and inf become +0)."""
    gen = torch.Generator().manual_seed(5)
    for n in ext.shapes:
        values = (torch.randn(n + 3, generator=gen, dtype=torch.float64)).to(dtype).to(ext.device)
        values[:min(n, 3)] = torch.tensor([math.nan, math.inf, -1.0], dtype=dtype).to(ext.device)[:min(n, 3)]
        mask = torch.randint(0, 256, (-(-(n + 3) // 8),), generator=gen, dtype=torch.uint8).to(ext.device)
        for start in (0, 3):
            v = values[start:start + n]
            m = mask if start == 0 else R.pack_bits(R.unpack_bits(mask, 1, n + 3)[start:start + n], 1)
            want = R.zero_unmasked(v, m)
            got = ext.zero_unmasked(v, m, False)
            assert got.data_ptr() != v.data_ptr() and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            inplace = v.clone()
            assert ext.zero_unmasked(inplace, m, True).data_ptr() == inplace.data_ptr()
            assert torch.equal(inplace.view(torch.uint8), want.view(torch.uint8)), f"in place differs (n={n})"


def _activation_formula(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activation as torch's CUDA kernel writes it, in ``x``'s dtype with torch's ``erf``, ``tanh``, ``exp``."""
    if name == "gelu":
        return x * 0.5 * (1 + torch.erf(x * math.sqrt(0.5)))
    if name == "gelu_tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * (x * x * x))))
    return x / (1 + torch.exp(-x))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_activation_inplace_code_matches_reference(ext, activation, bits, dtype):
    """An activation written in place with its few-bit code: the codes are the reference's (the encode's) bit for
    bit, aligned and not, NaN and +-inf and ties with the bounds included, and the values the formula's in float32
    (float64 for float64) with torch's ``erf``, ``tanh`` and ``exp``, to 2 units of the last place of the value
    and of the function near the value's cancellation (the emulated build's host ``erff`` is not CUDA's, nor
    torch's), and on a GPU the bits of torch's activation for the 16-bit dtypes (every value of them:
    ``test_fused_activation_gives_torchs_bits_for_every_16_bit_value``)."""
    gen = torch.Generator().manual_seed(bits)
    bounds = (torch.randn((1 << bits) - 1, generator=gen, dtype=torch.float64) * 2).to(dtype).sort().values
    bounds = bounds.to(ext.device)
    for n in ext.shapes:
        values = (torch.randn(n + 5, generator=gen, dtype=torch.float64) * 3).to(dtype)
        head = torch.cat([torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0], dtype=dtype), bounds.cpu()])
        values[:min(n, head.numel())] = head[:n]
        for start in (0, 3):  # a view that breaks 16-byte alignment
            x = values.to(ext.device, copy=True)[start:start + n]
            want_x = x.cpu().clone()
            want_code = R.activation_inplace_code(want_x, bounds.cpu(), bits, activation)
            code = ext.activation_inplace_code(x, bounds, bits, activation)
            assert torch.equal(code.cpu(), want_code), f"codes differ (n={n}, start={start})"
            wide = values[start:start + n].to(torch.float64 if dtype == torch.float64 else torch.float32)
            formula = _activation_formula(activation, wide)  # gelu(-inf) = -inf * 0: NaN; silu(-inf) = -inf / inf
            got, nan = x.cpu(), formula.isnan()
            assert torch.equal(got.isnan(), nan), f"NaNs differ (n={n})"
            assert torch.equal(got[formula.isinf()], formula[formula.isinf()].to(dtype)), f"infinities differ (n={n})"
            finite = formula.isfinite()
            # a function one unit off near its cancellation (1 + erf or 1 + tanh near -1; exp's relative error
            # scaled by x) moves the value by |x| times that unit
            bound = 2 * torch.finfo(dtype).eps * formula.abs() + 2 * torch.finfo(wide.dtype).eps * wide.abs()
            error = (got.to(wide.dtype) - formula).abs()
            assert bool((error <= bound)[finite].all()), f"values differ (n={n}, worst {float(error[finite].max())})"
            if ext.device == "cuda" and dtype.itemsize == 2:  # a NaN's payload aside, as act_hf's check
                torchs = R.IN_PLACE_ACTIVATIONS[activation](values.to(ext.device, copy=True)[start:start + n])
                kept = ~torchs.isnan()
                assert torch.equal(x.view(torch.int16)[kept], torchs.view(torch.int16)[kept]), f"not torch's (n={n})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_relu_inplace_code_matches_reference(ext, dtype):
    """A ReLU written in place with its 1-bit code: the kernel's values and code are the reference's bit for bit,
    aligned and not, at the edges too (NaN stays, +-inf, +-0 and +-the smallest subnormal), a -0 written as the
    value given for it (+0 or -0); given ``torch.relu(-0.0)`` on the device, the values are ``torch.relu``'s to the
    bit, NaNs aside (the emulated build: the CPU's, which keeps -0)."""
    gen = torch.Generator().manual_seed(7)
    tiny = torch.ones(1, dtype={8: torch.int64, 4: torch.int32, 2: torch.int16}[dtype.itemsize]).view(dtype)[0]
    edges = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, tiny, -tiny], dtype=dtype)
    torchs = torch.relu(torch.full((1,), -0.0, dtype=dtype, device=ext.device))
    for n in ext.shapes:
        values = torch.randn(n + 3, generator=gen, dtype=torch.float64).to(dtype)
        values[:min(n, 9)] = edges[:min(n, 9)]
        for start in (0, 3):
            for negative_zero_out in (torchs, torch.zeros(1, dtype=dtype, device=ext.device), -torchs.abs()):
                x = values.to(ext.device)[start:start + n]
                want_x = x.cpu().clone()
                want_code = R.relu_inplace_code(want_x, negative_zero_out.cpu())
                code = ext.relu_inplace_code(x, negative_zero_out)
                assert torch.equal(code.cpu(), want_code), f"codes differ (n={n}, start={start})"
                assert torch.equal(x.cpu().view(torch.uint8), want_x.view(torch.uint8)), f"values differ (n={n})"
            x = values.to(ext.device)[start:start + n]
            ext.relu_inplace_code(x, torchs)
            relu = torch.relu(values.to(ext.device)[start:start + n])
            nan = relu.isnan()  # a NaN's payload is the kernel's own (the CPU's vectorized relu rewrites bf16 NaNs)
            assert torch.equal(x.isnan(), nan), f"NaNs differ (n={n})"
            assert torch.equal(x[~nan].view(torch.uint8), relu[~nan].view(torch.uint8)), f"not relu's bits (n={n})"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gelu", "silu", "tanh", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fewbit_activation_on_gpu_equals_the_cpu(gpu_ext, name, dtype):
    """An activation's packed codes and its input gradient from them: the GPU's kernels give the CPU's bytes
    and values."""
    from act_hf.ops.activation import ActivationSpec

    spec = ActivationSpec(name)
    x = (torch.randn(3, 5, 4099, dtype=torch.float64) * 3).to(dtype)
    x[0, 0, :5] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0], dtype=dtype)
    grad = torch.randn(x.shape, dtype=torch.float64).to(dtype)
    for bits in sorted({spec.code_bits(b) for b in (1, 2, 3, 4)}):
        payload = spec.encode_packed(x, bits)
        gpu = spec.encode_packed(x.cuda(), bits)
        assert torch.equal(gpu.cpu(), payload)
        grad_x = spec.grad_input_packed(grad, payload, bits)
        assert torch.equal(spec.grad_input_packed(grad.cuda(), gpu, bits).cpu(), grad_x)


@pytest.mark.cuda
def test_custom_ops_dispatch_to_kernel_and_unbiased_on_gpu(gpu_ext):
    """The mean over draws is x within 5 standard errors, each from the variance stochastic rounding predicts
    from the stored metadata (a flat tolerance would be crossed by chance: 1024 elements, 2000 draws)."""
    from act_hf.compress import dequantize, quantize

    torch.manual_seed(0)
    x = torch.randn(4, 256, device=ext.device)
    draws = 2000
    acc = torch.zeros_like(x, dtype=torch.float64)
    for s in range(draws):
        acc += dequantize(quantize(x, 2, 256, seed=s)).double()
    packed = quantize(x, 2, 256, seed=0)
    assert packed.payload.is_cuda
    lo = R.metadata_to_float(packed.lo, torch.bfloat16).double().repeat_interleave(256).view(x.shape)
    scale = R.metadata_to_float(packed.scale, torch.bfloat16).double().repeat_interleave(256).view(x.shape)
    v = (x.double() - lo) / scale
    f = v - v.floor()
    standard_error = (scale**2 * f * (1 - f) / draws).sqrt()
    assert bool(((acc / draws - x.double()).abs() <= 5 * standard_error + 1e-9).all())


@pytest.mark.cuda
def test_reference_gives_the_same_bits_on_the_gpu_and_the_cpu():
    """The format is device independent: CUDA's division by a Python scalar (a multiply by the reciprocal)
    must not leak into the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for bits in (2, 3, 4, 6, 8):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = (torch.randn(70_000) * 4 - 1).to(dtype)
            cpu = R.quantize_pack(x, bits, 64, 99)
            gpu = R.quantize_pack(x.cuda(), bits, 64, 99)
            for c, g, name in zip(cpu, gpu, ("payload", "lo", "scale")):
                assert torch.equal(c, g.cpu()), f"{name} differs ({bits} bits, {dtype})"


@pytest.mark.cuda
def test_kernel_errors_name_arguments(gpu_ext):
    """Bad arguments raise RuntimeErrors that name them. Asked in a subprocess, so that a crash is this test's
    failure and not the end of the file: on the H100 machine (torch 2.11, Python 3.12, gcc 13.3) streaming an
    integer into a message inside the extension crashed with SIGSEGV (see csrc/bindings.cpp)."""
    code = """if True:
        import torch
        from act_hf import _ext
        ext = _ext.require()
        x = torch.randn(10, device=ext.device)
        for args in [(x, 9, 256, 0), (x, 3, 12, 0), (x.cpu(), 3, 256, 0)]:
            try:
                ext.quantize_pack(*args)
                print("no error")
            except RuntimeError as e:
                print(str(e).splitlines()[0], flush=True)
        bounds, payload = torch.zeros(3, device=ext.device), torch.zeros(4, device=ext.device, dtype=torch.uint8)
        calls = [(ext.fewbit_encode_pack, (x, bounds, 1)), (ext.fewbit_encode_pack, (x, bounds.double(), 2)),
                 (ext.fewbit_grad, (x, payload, torch.zeros(3, device=ext.device), 2)),
                 (ext.fewbit_grad, (x, payload[:2], torch.zeros(4, device=ext.device), 2)),
                 (ext.zero_unmasked, (x, payload[:1], False)),
                 (ext.unpack_dequantize_affine, (*ext.quantize_pack(x, 3, 8, 0), 3, 8, 10, bounds, bounds[:2])),
                 (ext.unpack_dequantize_affine, (*ext.quantize_pack(x, 3, 8, 0), 3, 8, 10, bounds, bounds)),
                 (ext.masked_scale, (x, payload[:1], 1.25)),
                 (ext.unpack_dequantize_into, (x[:8], *ext.quantize_pack(x, 3, 8, 0), 3, 8, 10, 4, bounds, bounds, 1,
                                               None, False)),
                 (ext.unpack_dequantize_into, (x[:6], *ext.quantize_pack(x, 3, 8, 0), 3, 8, 10, 0, bounds, bounds, 1,
                                               payload[:0], True)),
                 (ext.quantize_pack_normalized, (x.half(), bounds[:2], bounds[:2], 5, 3, 8, 0)),
                 (ext.quantize_pack_normalized, (x, bounds, bounds, 2, 3, 8, 0)),
                 (ext.unpack_dequantize_affine, (*ext.quantize_pack(x, 3, 8, 0), 3, 8, 10, bounds[:2], bounds[:2],
                                                 bounds[:2])),
                 (ext.unpack_dequantize_chain, (x[:8], *([t] * 9 for t in ext.quantize_pack(x, 3, 8, 0)),
                                                [bounds[:1]] * 9, [bounds[:1]] * 9, [None] * 9, 3, 8, 10, 0, 1,
                                                False)),
                 (ext.unpack_dequantize_chain, (x[:8], *([t] * 2 for t in ext.quantize_pack(x, 3, 8, 0)),
                                                [bounds[:1], bounds[:2]], [bounds[:1], bounds[:2]], [None, None], 3,
                                                8, 10, 0, 1, False)),
                 (ext.activation_inplace_code, (x, bounds[:1], 5, "gelu")),
                 (ext.activation_inplace_code, (x, bounds[:1], 1, "relu")),
                 (ext.activation_inplace_code, (x[::2], bounds[:1], 1, "silu")),
                 (ext.relu_inplace_code, (x[::2], x[:1])),
                 (ext.relu_inplace_code, (x.int(), x[:1].int())),
                 (ext.relu_inplace_code, (x, x[:1].double()))]
        for fn, args in calls:
            try:
                fn(*args)
                print("no error")
            except RuntimeError as e:
                print(str(e).splitlines()[0], flush=True)
    """
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, f"exit {proc.returncode} after {proc.stdout!r}: {proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert "bits must be an integer from 1 to 8, got 9" in lines[0]
    assert "group_size must be a positive multiple of 8, got 12" in lines[1]
    assert "x must be a CUDA tensor" in lines[2]
    assert "bounds must be flat with fewer than 2**bits = 2 elements" in lines[3]
    assert "bounds must have dtype Float, got Double" in lines[4]
    assert "values must be flat with 2**bits = 4 elements, got shape (3)" in lines[5]
    assert "payload holds 2 bytes, fewer than ceil(grad.numel() * bits / 8) = 3" in lines[6]
    assert "mask holds 1 bytes, fewer than ceil(values.numel() / 8) = 2" in lines[7]
    assert "mult and shift must be flat, one value a channel (at least one), got shapes (3) and (2)" in lines[8]
    assert "numel must be a whole number of rows of 3 channels, got 10" in lines[9]
    assert "mask holds 1 bytes, fewer than ceil(grad.numel() / 8) = 2" in lines[10]
    assert "start must be a multiple of 8 from 0 with start + out.numel() <= numel (10), got start 4" in lines[11]
    assert "mask holds 0 bytes, fewer than ceil(out.numel() / 8) = 1" in lines[12]
    assert "x must be float32, bfloat16 or float64 for a normalized quantize" in lines[13]
    assert "x must hold whole rows of inner * len(mean) = 6 elements, got 10" in lines[14]
    assert "divisor must hold one value a row of 2 channels, 5 values, got 2" in lines[15]
    assert "payloads, los, scales, weights, biases and masks must hold 1 to 8 terms each" in lines[16]
    assert "weights[t] must hold one value a channel, as weights[0] (1), got 2 for term 1" in lines[17]
    assert "bits must be 1..4 (the activations' derivative tables), got 5" in lines[18]
    assert "activation must be 'gelu', 'gelu_tanh' or 'silu', got 'relu'" in lines[19]
    assert "x must be contiguous" in lines[20]
    assert "x must be contiguous" in lines[21]
    assert "x must be float32, float16, bfloat16 or float64, got Int" in lines[22]
    assert "negative_zero_out must have dtype Float, got Double" in lines[23]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_channel_scaled_quantize_on_gpu_equals_the_cpu(gpu_ext, dtype):
    """The channel shifts (torch ops) and the kernel on the shifted tensor give the CPU's bits and decode."""
    from act_hf.compress import dequantize, quantize

    x = (torch.randn(300, 96) * 0.3).to(dtype)
    x[:, 5] *= 40
    gpu = quantize(x.cuda(), 3, 256, seed=4, channel_scale=True)
    cpu = quantize(x, 3, 256, seed=4, channel_scale=True)
    assert gpu.spec == cpu.spec and gpu.spec.channel_scaled
    for g, c in zip(gpu.tensors, cpu.tensors):
        assert torch.equal(g.cpu(), c)
    assert torch.equal(dequantize(gpu).cpu(), dequantize(cpu))
