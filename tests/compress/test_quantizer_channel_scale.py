"""Channel scaling (``quantize(..., channel_scale=True)``): an exact power-of-two shift per last-dim channel."""

from __future__ import annotations

import pytest
import torch

from act_hf.compress import CHANNEL_SCALE_MIN_ROWS, PackedTensor, dequantize, dequantize_with_factors, quantize
from act_hf.compress import reference as R
from tests.utils import host_syncs

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def outlier_hidden_states(rows: int = 256, channels: int = 96, dtype=torch.float32) -> torch.Tensor:
    """Hidden-state-like data: most channels ~N(0, 0.3^2), three outlier channels 20-40x larger."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, channels, generator=g) * 0.3
    x[:, 5] *= 40
    x[:, 17] *= 25
    x[:, 60] *= -20
    return x.to(dtype)


def powers(shifts: torch.Tensor, sign: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (sign * int(k)) for k in shifts], dtype=torch.float64)


def shifts(p: PackedTensor) -> torch.Tensor:
    """The shifts ``k`` of a channel-scaled ``p``, read back from the factors ``2**-k`` it keeps (exact powers of
    two: ``frexp`` gives them as ``0.5 * 2**(1 - k)``)."""
    mantissa, exponent = torch.frexp(p.channel)
    assert torch.all(mantissa == 0.5)
    return (1 - exponent).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_it_is_the_plain_quantizer_on_exactly_shifted_channels(dtype, bits):
    """Same codes and metadata as quantizing ``x * 2**k`` plainly, and a decode that is that decode times
    ``2**-k``, bit for bit: the shift adds no rounding of its own."""
    x = outlier_hidden_states(dtype=dtype)
    p = quantize(x, bits, 64, seed=11, channel_scale=True)
    assert p.spec.channel_scaled and p.channel.dtype == torch.float32 and p.channel.shape == (x.shape[-1],)
    assert torch.equal(p.channel.double(), powers(shifts(p), -1))  # the factors that decoding multiplies by
    shifted = (x.double() * powers(shifts(p), +1)).to(dtype)
    assert torch.equal(shifted.double() * powers(shifts(p), -1), x.double())  # the shift is exact
    plain = quantize(shifted, bits, 64, seed=11)
    assert torch.equal(p.payload, plain.payload) and torch.equal(p.lo, plain.lo) and torch.equal(p.scale, plain.scale)
    expected = (dequantize(plain).double() * powers(shifts(p), -1)).to(dtype)
    assert torch.equal(dequantize(p), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shifts_equalize_channels_and_never_overflow(dtype):
    x = outlier_hidden_states(dtype=dtype)
    x[:, 30] = 0  # an all-zero channel
    if dtype == torch.float16:
        x[:, 40] = 60000.0  # near fp16's largest value
        x[:, 41] *= 1e-3
    p = quantize(x, 3, 64, seed=0, channel_scale=True)
    k = shifts(p).long()
    limit = 15 if dtype == torch.float16 else 24
    assert int(k.min()) >= 0 and int(k.max()) <= limit
    before = x.double().abs().amax(0)
    top = before.max()
    assert int(k[before.argmax()]) == 0  # the largest channel is not shifted
    after = before * powers(shifts(p), +1)
    live = (after > 0) & (k < limit)
    # every unclamped channel's largest magnitude is now within a factor 2 of the largest channel's, never above
    assert bool((after[live] > top / 2).all())
    assert bool((after <= top).all())
    assert torch.isfinite(dequantize(p)).all()


def test_shift_is_the_floor_of_log2_of_the_ratio_to_the_top_channel():
    """Exactly ``clamp(floor(log2(top / amax)), 0, 24)`` in float64, also at and beside exact powers of two (where
    the mantissas tie or differ by one ulp) and for magnitudes from 2**-120 to 2**100."""
    top = 1.7 * 2.0**100
    torch.manual_seed(0)
    ratios = torch.cat([torch.tensor([1.0, 2.0, 4.0, 2.0**23, 2.0**24, 2.0**25, 2.0**200]),
                        torch.tensor([2.0, 8.0, 2.0**20]) * (1 + 2.0**-22), torch.tensor([2.0, 8.0]) * (1 - 2.0**-22),
                        2.0 ** (torch.rand(200) * 220)]).double()
    amax = (top / ratios).float()
    x = torch.zeros(64, amax.numel())
    x[5] = amax
    x[9] = -amax / 3  # smaller magnitudes elsewhere in the channel leave its maximum alone
    k = shifts(quantize(x, 3, 64, seed=0, channel_scale=True)).long()
    exact = torch.floor(torch.log2(amax.double().max() / amax.double())).clamp(0, 24).long()
    assert torch.equal(k, exact), (k[k != exact], exact[k != exact])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_outlier_channels_no_longer_set_the_groups_range(bits):
    x = outlier_hidden_states()
    plain = [(dequantize(quantize(x, bits, 256, seed=s)) - x).norm() / x.norm() for s in range(4)]
    scaled = [(dequantize(quantize(x, bits, 256, seed=s, channel_scale=True)) - x).norm() / x.norm()
              for s in range(4)]
    assert sum(scaled) < sum(plain) / 2, (plain, scaled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unbiased_and_variance_is_the_shifted_one(dtype):
    x = outlier_hidden_states(rows=64, channels=64, dtype=dtype)
    draws = 1500
    ys = torch.stack([dequantize(quantize(x, 2, 256, seed=s, channel_scale=True)).double() for s in range(draws)])
    mean = ys.mean(0)
    # predicted variance: stochastic rounding of x * 2**k on the stored grid, shifted back by 2**-2k
    p = quantize(x, 2, 256, seed=0, channel_scale=True)
    lo = R.metadata_to_float(p.lo, R.lo_dtype_for(dtype)).double().repeat_interleave(256)
    scale = R.metadata_to_float(p.scale, torch.bfloat16).double().repeat_interleave(256)
    shifted = x.double() * powers(shifts(p), +1)
    v = (shifted.reshape(-1) - lo) / scale
    f = v - v.floor()
    predicted = (scale**2 * f * (1 - f)).view(x.shape) * powers(shifts(p), -2)
    se = (predicted / draws).sqrt()
    tol = 5 * se + torch.finfo(dtype).eps * x.double().abs()
    assert bool(((mean - x.double()).abs() <= tol + 1e-12).all()), f"bias {(mean - x.double()).abs().max()}"


def test_small_and_one_dimensional_tensors_stay_plain():
    for x in (torch.randn(4096), torch.randn(CHANNEL_SCALE_MIN_ROWS - 1, 32), torch.randn(2, 3, 0)):
        p = quantize(x, 3, 64, seed=0, channel_scale=True)
        plain = quantize(x, 3, 64, seed=0)
        assert not p.spec.channel_scaled and p.channel is None and len(p.tensors) == 3
        assert p.nbytes == plain.nbytes and torch.equal(p.payload, plain.payload)
    assert quantize(torch.randn(CHANNEL_SCALE_MIN_ROWS, 32), 3, 64, channel_scale=True).spec.channel_scaled


def test_four_bytes_per_channel_and_rebuild():
    x = outlier_hidden_states()
    p = quantize(x, 3, 64, seed=0, channel_scale=True)
    assert p.nbytes == quantize(x, 3, 64, seed=0).nbytes + 4 * x.shape[-1]
    assert len(p.tensors) == p.spec.n_tensors == 4
    q = PackedTensor.rebuild(p.tensors, p.spec)
    assert torch.equal(dequantize(q), dequantize(p))
    assert "channel_scaled=True" in repr(p)
    with pytest.raises(ValueError, match="has 4 tensors, got 3"):
        PackedTensor.rebuild(p.tensors[:3], p.spec)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_channel_marks_its_groups_and_leaves_the_others(bad):
    x = outlier_hidden_states(rows=64, channels=64)
    clean = quantize(x, 3, 64, seed=0, channel_scale=True)
    x[3, 9] = bad
    p = quantize(x, 3, 64, seed=0, channel_scale=True)
    assert int(shifts(p)[9]) == 0
    others = torch.arange(64) != 9
    assert torch.equal(p.channel[others], clean.channel[others])  # the other channels' shifts are undisturbed
    y = dequantize(p)
    assert not torch.isfinite(y[3]).any()  # row 3 is group 3: marked NaN, as without scaling
    assert torch.isfinite(y[torch.arange(64) != 3]).all()


def test_non_contiguous_input_keeps_its_channels_and_layout():
    """A column-major input: shifts per channel of its last logical dim, as for the contiguous copy; the scaled
    tensor is packed as it lies in memory and decodes to the input's layout, as accurate as the contiguous copy's."""
    x = outlier_hidden_states(rows=96, channels=128).t().contiguous().t()  # (96, 128), column-major
    assert not x.is_contiguous()
    a = quantize(x, 4, 64, seed=3, channel_scale=True)
    b = quantize(x.contiguous(), 4, 64, seed=3, channel_scale=True)
    assert torch.equal(a.channel, b.channel) and a.spec.memory_order == (1, 0)
    y = dequantize(a)
    assert y.stride() == x.stride()
    errors = [float((dequantize(p) - x).norm() / x.norm()) for p in (a, b)]
    assert errors[0] < 1.5 * errors[1], errors


def test_a_contiguous_input_is_scaled_as_it_is_read_without_a_scaled_copy():
    """The scaling happens inside the codec (``quantize_pack_scaled``, by chunks on the CPU): no allocation as
    large as the input, where multiplying first made a full-size scaled copy."""
    from torch.profiler import ProfilerActivity, profile

    x = outlier_hidden_states(rows=4096, channels=1024)  # 16 MiB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        quantize(x, 3, channel_scale=True)
    largest = max(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert largest < x.numel() * x.element_size() // 2, largest


def test_channel_shifts_never_read_a_value_back():
    """The shift of each channel is computed on the device: a host read per quantize would stall a GPU's queue."""
    x = outlier_hidden_states()
    assert host_syncs(lambda: dequantize(quantize(x, 3, channel_scale=True))) == {}


@pytest.mark.parametrize("source, target", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.float32, torch.bfloat16), (torch.float16, torch.float16),
                                            (torch.float16, torch.float32), (torch.float32, torch.float16)])
def test_values_times_factors_is_the_decode_bit_for_bit(source, target):
    """``dequantize_with_factors``: values and per-channel powers of two whose product is ``dequantize``'s
    result; factors only where the decode does not go through a cast (fp16 and the other dtypes), and never
    for a plain context."""
    x = outlier_hidden_states(dtype=source)
    packed = quantize(x, 3, 256, seed=1, channel_scale=True)
    values, factors = dequantize_with_factors(packed, target)
    direct = (source == torch.float16) == (target == torch.float16)
    assert (factors is not None) == direct and values.dtype == target
    if factors is not None:
        assert factors.shape == (x.shape[-1],) and factors.dtype == torch.float32
        assert torch.equal(factors, packed.channel)
        assert torch.equal(values.clone().mul_(factors), (values * factors).to(target))
        values = (values * factors).to(target)  # computed in fp32, rounded to the values' dtype
    assert torch.equal(values, dequantize(packed, target))
    plain = quantize(x, 3, 256, seed=1)
    assert dequantize_with_factors(plain, target)[1] is None
    assert torch.equal(dequantize_with_factors(plain, target)[0], dequantize(plain, target))


@pytest.mark.parametrize("dtype", DTYPES)
def test_channel_largest_magnitudes_are_the_inf_norms(dtype):
    """The per-channel ``max |x|`` behind the shifts equals ``torch.linalg.vector_norm(x, inf)`` over the rows, bit
    for bit, with NaN, +-inf and signed zeros in some channels, contiguous and permuted."""
    from act_hf.compress.reference import channel_absmax

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 20, 9, generator=g, dtype=torch.float64) * 10).to(dtype)
    x[2, 3, 1], x[4, 0, 2], x[1, 1, 3], x[:, :, 4] = float("nan"), float("inf"), -float("inf"), 0.0
    x[0, 0, 4] = -0.0
    x[:, :, 5] = -x[:, :, 5].abs()  # a channel whose largest magnitude is its smallest value
    assert torch.equal(channel_absmax(x).isnan(), torch.arange(9) == 1)
    for t in (x, x.transpose(0, 1), x.permute(1, 0, 2)[::2]):
        want = torch.linalg.vector_norm(t, float("inf"), dim=tuple(range(t.dim() - 1)))
        got = channel_absmax(t)
        nan = want.isnan()
        assert got.dtype == want.dtype and torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].abs(), want[~nan])  # a channel of zeros may give -0.0
