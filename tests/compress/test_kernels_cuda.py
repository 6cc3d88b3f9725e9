"""CUDA kernels == the PyTorch reference, bit for bit (same hash-based draws)."""

from __future__ import annotations

import pytest
import torch

from act_hf import _ext
from act_hf.compress import reference as R

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _ext.require()


SHAPES = [1, 7, 8, 255, 256, 257, 1000, 4099, 65536 + 13]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("group_size", [8, 64, 256, 1024])
def test_quantize_pack_matches_reference(ext, bits, dtype, group_size):
    for n in SHAPES:
        x = (torch.randn(n, device="cuda") * 4 - 1).to(dtype)
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


def test_unaligned_input_view(ext):
    base = torch.randn(10_000, device="cuda", dtype=torch.bfloat16)
    x = base[3:]  # storage offset breaks 16-byte alignment
    got = ext.quantize_pack(x, 3, 256, 9)
    want = R.quantize_pack(x, 3, 256, 9)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_pack_unpack_bits_match_reference(ext, bits):
    for n in SHAPES:
        codes = torch.randint(0, 2**bits, (n,), device="cuda", dtype=torch.uint8)
        payload = ext.pack_bits(codes, bits)
        assert torch.equal(payload, R.pack_bits(codes, bits))
        assert torch.equal(ext.unpack_bits(payload, bits, n), codes)


def test_custom_ops_dispatch_to_kernel_and_unbiased_on_gpu(ext):
    from act_hf.compress import dequantize, quantize

    x = torch.randn(4, 256, device="cuda")
    acc = torch.zeros_like(x, dtype=torch.float64)
    for s in range(2000):
        acc += dequantize(quantize(x, 2, 256, seed=s)).double()
    assert (acc / 2000 - x.double()).abs().max() < 0.05


def test_kernel_errors_name_arguments(ext):
    x = torch.randn(10, device="cuda")
    with pytest.raises(RuntimeError, match="bits must be an integer from 1 to 8, got 9"):
        ext.quantize_pack(x, 9, 256, 0)
    with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 8"):
        ext.quantize_pack(x, 3, 12, 0)
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
        ext.quantize_pack(x.cpu(), 3, 256, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_channel_scaled_quantize_on_gpu_equals_the_cpu(ext, dtype):
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
