"""The quantizer's contract (CPU reference, which is the specification)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from act_hf.compress import (
    PackedTensor,
    dequantize,
    dequantize_affine,
    dequantize_chain,
    dequantize_inverse_affine,
    dequantize_items,
    dequantize_mapped,
    pack_bits,
    quantize,
    quantize_by_rows,
    quantize_normalized,
    unpack_bits,
)
from act_hf.compress import reference as R
from tests.utils import dispatched

ALL_BITS = [1, 2, 3, 4, 5, 6, 7, 8]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def group_ranges(x: torch.Tensor, g: int) -> torch.Tensor:
    """Per-element (max - min) of its group, for the error bound."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    out = torch.empty(n)
    for s in range(0, n, g):
        part = flat[s : s + g]
        out[s : s + g] = part.max() - part.min()
    return out.view(x.shape)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1023), (7, 129), (4, 256), (3, 5, 17)])
def test_round_trip_error_within_group_bound(bits, dtype, shape):
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    g = 64
    p = quantize(x, bits, g, seed=123)
    y = dequantize(p)
    assert y.dtype == dtype and y.shape == x.shape
    # One step of the (outward-rounded) grid: range/(2^b-1) widened by bf16 rounding of lo and scale,
    # plus the output dtype's own rounding.
    step = group_ranges(x, g) / (2**bits - 1)
    slack = 2.0**-7 * (x.float().abs() + step) + 2 * torch.finfo(dtype).eps * x.float().abs().clamp_min(1)
    err = (y.float() - x.float()).abs()
    assert bool((err <= step * (1 + 2.0**-7) + slack).all()), f"max excess {(err - step).max()}"


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unbiased_and_variance_matches_stochastic_rounding(bits, dtype):
    torch.manual_seed(1)
    x = torch.randn(2, 256).to(dtype)
    draws = 1500
    ys = torch.stack([dequantize(quantize(x, bits, 256, seed=s)).double() for s in range(draws)])
    mean, var = ys.mean(0), ys.var(0)
    # Variance predicted by the formula scale^2 * f * (1 - f), f = frac((x - lo) / scale), from stored metadata.
    p = quantize(x, bits, 256, seed=0)
    lo = R.metadata_to_float(p.lo, R.lo_dtype_for(dtype)).double().repeat_interleave(256)
    scale = R.metadata_to_float(p.scale, torch.bfloat16).double().repeat_interleave(256)
    v = (x.reshape(-1).double() - lo) / scale
    f = v - v.floor()
    predicted = (scale**2 * f * (1 - f)).view(x.shape)
    # The sample mean has standard error sqrt(var/draws); allow 5 standard errors (plus output-dtype rounding).
    se = (predicted / draws).sqrt()
    tol = 5 * se + torch.finfo(dtype).eps * x.double().abs()
    assert bool(((mean - x.double()).abs() <= tol + 1e-12).all()), f"bias {(mean - x.double()).abs().max()}"
    if dtype == torch.float32:  # bf16 output rounding adds its own variance
        rel = (var.sum() - predicted.sum()).abs() / predicted.sum()
        assert rel < 0.05, f"variance off by {rel:.3f}"


def test_mean_over_draws_converges_for_fp32_metadata_rounding():
    """The ActNN bias (fp32 metadata used for quantizing, bf16 stored) would show up here as ~0.4%."""
    x = torch.full((1, 256), 0.3) + torch.linspace(0, 1.7, 256)
    draws = 5000
    acc = torch.zeros(256, dtype=torch.float64)
    for s in range(draws):
        acc += dequantize(quantize(x, 2, 256, seed=s)).double().view(-1)
    rel_bias = ((acc / draws).sum() - x.double().sum()).abs() / x.double().sum()
    assert rel_bias < 1e-3, rel_bias  # the standard error of this sum is ~2e-4


@pytest.mark.parametrize("bits", ALL_BITS)
def test_packed_size_is_dense(bits):
    for n in [0, 1, 7, 8, 9, 255, 256, 1000]:
        x = torch.randn(n)
        p = quantize(x, bits, 256, seed=0)
        assert p.payload.numel() == math.ceil(n * bits / 8)
        assert p.lo.numel() == p.scale.numel() == math.ceil(n / 256)
        assert p.nbytes == math.ceil(n * bits / 8) + 4 * math.ceil(n / 256)
    # metadata is 0.125 bit per element at group size 256
    x = torch.randn(256 * 64)
    p = quantize(x, 3, 256, seed=0)
    assert (p.nbytes * 8) / x.numel() == 3 + 0.125


def test_top_code_is_clamped_and_values_stay_on_the_stored_grid():
    x = torch.tensor([[0.0, 1.0] * 128])
    for s in range(50):
        p = quantize(x, 8, 256, seed=s)
        y = dequantize(p)
        top = R.metadata_to_float(p.scale, torch.bfloat16) * 255  # lo = 0; the scale is rounded up
        assert y.min() >= 0 and y.max() <= top
        assert top < 1.0 + 2.0**-7


ZERO_RANGE_CASES = [
    (dtype, value)
    for dtype in DTYPES
    for value in (0.0, 1.0, -10240.0, 0.328125, 7.5, -3.3895313892515355e38)
    if not (dtype == torch.float16 and abs(value) > 65504)  # the last one is a bf16/fp32 value only
]


@pytest.mark.parametrize("dtype, value", ZERO_RANGE_CASES)
def test_zero_range_groups_are_exact(dtype, value):
    x = torch.full((3, 256), value, dtype=dtype)
    for bits in [1, 3, 8]:
        y = dequantize(quantize(x, bits, 256, seed=1))
        assert torch.equal(y, x)


def test_fp32_zero_range_off_the_bf16_grid_is_unbiased_within_one_bf16_ulp():
    c = -10000.3  # not a bf16 number: the documented exception, rounded stochastically between neighbours
    x = torch.full((256,), c)
    ys = torch.stack([dequantize(quantize(x, 2, 256, seed=s)).double() for s in range(400)])
    assert (ys - c).abs().max() <= 2.0**-7 * abs(c)
    assert abs(ys.mean().item() - c) < 0.5


def test_fp16_zero_range_exact_where_bf16_cannot_represent():
    x = torch.full((256,), 0.1, dtype=torch.float16)  # not a bf16 number: the fp16 zero point keeps it exact
    assert torch.equal(dequantize(quantize(x, 2, 256, seed=0)), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_stays_non_finite(dtype, bad):
    x = torch.randn(4, 256).to(dtype)
    x[1, 17] = bad
    y = dequantize(quantize(x, 3, 256, seed=0))
    assert not torch.isfinite(y[1]).any()  # the whole group is marked
    assert torch.isfinite(y[[0, 2, 3]]).all()  # other groups are untouched


def test_empty_and_non_contiguous_and_partial_groups():
    assert dequantize(quantize(torch.empty(0, 5), 3)).shape == (0, 5)
    x = torch.randn(64, 48).t()  # non-contiguous
    assert not x.is_contiguous()
    p = quantize(x, 8, 64, seed=0)
    torch.testing.assert_close(dequantize(p), x, atol=0.05, rtol=0)
    x = torch.randn(1000)  # 1000 = 3 * 256 + 232
    torch.testing.assert_close(dequantize(quantize(x, 8, 256, seed=0)), x, atol=0.05, rtol=0)


def _copies(fn) -> list[str]:
    """The copying aten ops ``fn()`` dispatches."""
    names = (func.overloadpacket.__name__ for func, _ in dispatched(fn))
    return [name for name in names if name in ("clone", "copy_", "_to_copy", "contiguous")]


@pytest.mark.parametrize("perm", [(0, 2, 1, 3), (0, 2, 3, 1), (3, 1, 0, 2)])
def test_permuted_dense_input_is_read_as_it_lies_in_memory(perm):
    """A permuted view of a contiguous tensor (attention's (B, H, S, D) query over (B, S, H, D); channels-last) is
    packed as its storage lies, without a copy, the same bits as the contiguous tensor, and decodes to its
    layout."""
    base = torch.randn(2, 6, 4, 40)
    x = base.permute(perm)
    assert not x.is_contiguous()
    p = quantize(x, 3, 64, seed=5)
    q = quantize(base, 3, 64, seed=5)
    assert p.spec.memory_order is not None and x.permute(p.spec.memory_order).is_contiguous()
    assert torch.equal(p.payload, q.payload) and torch.equal(p.lo, q.lo) and torch.equal(p.scale, q.scale)
    y = dequantize(p)
    assert y.shape == x.shape and y.stride() == x.stride()
    assert torch.equal(y, dequantize(q).permute(perm))
    assert _copies(lambda: quantize(x, 3, 64, seed=5)) == []
    rebuilt = PackedTensor.rebuild(p.tensors, p.spec)
    assert torch.equal(dequantize(rebuilt), y)


def test_input_no_permutation_makes_dense_is_read_in_row_major_order():
    base = torch.randn(8, 64, 48)
    for x in (base[:, ::2], base[:, :, :40].transpose(1, 2), torch.randn(1, 64).expand(16, 64)):
        p = quantize(x, 4, 64, seed=1)
        assert p.spec.memory_order is None
        assert torch.equal(p.payload, quantize(x.contiguous(), 4, 64, seed=1).payload)
        y = dequantize(p)
        assert y.is_contiguous() and y.shape == x.shape


def _item_layouts():
    base = torch.randn(6, 40, 12)
    return {"contiguous": base, "batch outermost (0, 2, 1)": base.transpose(1, 2),
            "batch not outermost": base.permute(1, 0, 2), "not dense": torch.randn(5, 3, 16, 16)[:, :, 1::2],
            "2-d, channel scalable": torch.randn(96, 96), "fp16": torch.randn(7, 33).half()}


@pytest.mark.parametrize("layout", list(_item_layouts()))
@pytest.mark.parametrize("bits,group_size", [(1, 8), (3, 256), (8, 64)])
@pytest.mark.parametrize("channel_scale", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_dequantize_items_is_the_whole_decode_sliced(layout, bits, group_size, channel_scale, dtype):
    """Items ``[start, stop)`` of the first dim, decoded from the groups that hold them alone, are the whole
    decode's slice bit for bit, in its layout: any width, group size, channel scaling, reader dtype (fp16 decodes
    through a cast) and layout (a first dim that is not outermost in memory decodes whole and slices)."""
    torch.manual_seed(0)
    x = _item_layouts()[layout]
    packed = quantize(x, bits, group_size, seed=1, channel_scale=channel_scale)
    whole = dequantize(packed, dtype)
    n = x.shape[0]
    for start, stop in [(0, n), (0, 1), (1, 3), (n - 1, n), (2, 2)]:
        got = dequantize_items(packed, start, stop, dtype)
        assert got.dtype == whole.dtype and torch.equal(got, whole[start:stop])
        if stop - start > 1:
            assert got.stride() == whole[start:stop].stride()


def test_dequantize_items_decodes_only_the_groups_of_the_items_and_checks_its_range():
    x = torch.randn(8, 100)  # 800 elements: items 2..3 are elements 200..399, groups 0..1 of 256
    packed = quantize(x, 3, 256, seed=0)
    ops = dispatched(lambda: dequantize_items(packed, 2, 4))
    (decode,) = [out for func, out in ops if "unpack_dequantize" in str(func)]
    assert decode[0].numel() == 512
    with pytest.raises(ValueError, match=r"start, stop: need 0 <= start <= stop <= 8 \(the first dim\), got 3, 9"):
        dequantize_items(packed, 3, 9)
    with pytest.raises(ValueError, match="0-dim"):
        dequantize_items(quantize(torch.tensor(1.0), 3, 256), 0, 0)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_by_rows_lays_the_slices_end_to_end(layout, dtype):
    """Slices of whole groups (240 elements a row, groups of 64: 4 rows), each packed with its own draw: the
    groups' zero points and scales are those of the whole tensor packed in the slices' order (they draw nothing),
    and so is the spec, and every value decodes to one of its group's two levels around it. Slices of a
    transposed view are not dense: they are read, like the view's copy, in row-major order."""
    torch.manual_seed(0)
    x = torch.randn(10, 6, 5, 8).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    calls = []

    def make(start, stop):
        calls.append((start, stop))
        return x[start:stop]

    packed = quantize_by_rows(make, x.shape, 3, 64, chunk=1000)
    whole = quantize(x.contiguous() if layout == "transposed" else x, 3, 64, seed=0)
    assert calls == [(0, 4), (4, 8), (8, 10)]
    assert packed.spec == whole.spec
    assert torch.equal(packed.lo, whole.lo) and torch.equal(packed.scale, whole.scale)
    assert packed.payload.shape == whole.payload.shape
    decoded = dequantize(packed, torch.float32)
    assert decoded.stride() == dequantize(whole, torch.float32).stride()
    order = whole.spec.memory_order or tuple(range(4))
    error = (decoded - x.float()).permute(order).reshape(-1).abs()
    level = whole.scale.view(torch.bfloat16).float().repeat_interleave(64)[:x.numel()]
    assert (error <= level * 1.001).all()


def test_quantize_by_rows_makes_the_whole_when_a_slice_would_not_be_a_stretch_of_the_stream():
    """One slice holding every row, or slices stored with dim 0 inside (their streams would interleave, not
    follow each other): ``x`` is made whole and quantized at once. A 0-dim shape has no rows."""
    torch.manual_seed(1)
    x = torch.randn(10, 6, 40)
    calls = []

    def make(start, stop):  # dense, but stored as (6, rows, 40)
        calls.append((start, stop))
        return x[start:stop].transpose(0, 1).contiguous().transpose(0, 1)

    packed = quantize_by_rows(make, x.shape, 4, 64, chunk=128)
    assert calls == [(0, 4), (0, 10)] and packed.spec == quantize(make(0, 10), 4, 64).spec
    calls.clear()
    packed = quantize_by_rows(make, x.shape, 4, 64, chunk=10**6)
    assert calls == [(0, 10)] and torch.equal(packed.lo, quantize(make(0, 10), 4, 64).lo)
    with pytest.raises(ValueError, match="0-dim"):
        quantize_by_rows(make, (), 4, 64, chunk=8)


@pytest.mark.parametrize("channel_scale", [False, True])
@pytest.mark.parametrize("packed_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float64),
                                                 (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
                                                 (torch.float16, torch.float32), (torch.bfloat16, torch.float16)])
def test_dequantize_into_another_dtype(packed_dtype, dtype, channel_scale):
    """Straight into ``dtype``: the fp32 decode rounded once to it (what decoding to fp32 and casting gives); from or
    to fp16, whose zero points are stored as fp16, the original dtype's decode cast."""
    x = (torch.randn(96, 64) * torch.logspace(-2, 2, 64)).to(packed_dtype)
    p = quantize(x, 4, 64, seed=2, channel_scale=channel_scale)
    y = dequantize(p, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    if torch.float16 in (packed_dtype, dtype):
        expected = dequantize(p).to(dtype)
    else:
        expected = dequantize(PackedTensor.rebuild(p.tensors, replace(p.spec, dtype=torch.float32))).to(dtype)
    assert torch.equal(y, expected)


@pytest.mark.parametrize("layout", ["contiguous", "channel scaled", "bf16", "fp16", "fp64", "transposed"])
def test_dequantize_affine_is_the_decode_times_mult_minus_shift(layout):
    """``dequantize(packed, fp32) * mult - shift`` per channel of the last dimension, bit for bit, in one op where
    the context decodes straight to fp32 row-major (a channel-scaled one's factors folded into ``mult``); an fp16
    original (fp16 zero points) and a permuted layout decode first and map in two passes."""
    torch.manual_seed(0)
    x = torch.randn(96, 48) * torch.logspace(-2, 2, 48)
    x = {"bf16": x.bfloat16(), "fp16": x.half(), "fp64": x.double(),
         "transposed": x.t().contiguous().t()}.get(layout, x)
    packed = quantize(x, 3, 64, seed=4, channel_scale=layout == "channel scaled")
    mult, shift = torch.rand(48) + 0.5, torch.randn(48)
    ops = dispatched(lambda: dequantize_affine(packed, mult, shift))
    got = dequantize_affine(packed, mult, shift)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got, dequantize(packed, torch.float32).mul_(mult).sub_(shift))
    one_op = layout not in ("fp16", "transposed")
    assert [str(f) for f, _ in ops if "act_hf" in str(f)] == (["act_hf.unpack_dequantize_affine.default"] if one_op
                                                              else ["act_hf.unpack_dequantize.default"])
    if layout in ("contiguous", "bf16", "fp64"):  # no channel factors: the reference op alone, in 64-element chunks
        assert torch.equal(R.unpack_dequantize_affine(packed.payload, packed.lo, packed.scale, 3, 64, x.numel(),
                                                      mult, shift, chunk=64), got.reshape(-1))


@pytest.mark.parametrize("layout", ["contiguous", "channel scaled", "fp16 channel scaled", "transposed"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_dequantize_inverse_affine_is_the_affine_decode_of_the_inverse_map(layout, with_bias):
    """``(dequantize(packed, fp32) - bias) / weight`` is ``dequantize_affine(packed, 1 / weight, bias / weight)`` bit
    for bit (a zero shift without a bias), the channel factors of a channel-scaled context taken into the
    reciprocal in one op: the ops on the per-channel vectors are one fewer there. Without a bias, a context that
    does not decode in one pass gets no zero shift to subtract: two ops fewer (its zeros and their pass)."""
    torch.manual_seed(0)
    x = torch.randn(96, 48) * torch.logspace(-2, 2, 48)
    x = {"fp16 channel scaled": x.half(), "transposed": x.t().contiguous().t()}.get(layout, x)
    packed = quantize(x, 3, 64, seed=4, channel_scale=layout.endswith("channel scaled"))
    weight, bias = torch.rand(48) + 0.5, (torch.randn(48) if with_bias else None)
    shift = bias / weight if with_bias else torch.zeros(48)
    got = dequantize_inverse_affine(packed, weight, bias)
    assert torch.equal(got, dequantize_affine(packed, weight.reciprocal(), shift))
    def vector_ops(decode) -> int:  # the aten ops on the per-channel vectors, around the decode
        return len([f for f, _ in dispatched(decode) if "act_hf" not in str(f) and "detach" not in str(f)])

    shift_of = (lambda: bias / weight) if with_bias else (lambda: torch.zeros(48))
    inverse = vector_ops(lambda: dequantize_inverse_affine(packed, weight, bias))
    fewer = (layout == "channel scaled") + (2 if not with_bias and layout in ("fp16 channel scaled", "transposed")
                                            else 0)
    assert inverse == vector_ops(lambda: dequantize_affine(packed, weight.reciprocal(), shift_of())) - fewer
    with pytest.raises(ValueError, match=r"bias must be a float32 tensor of shape \(48,\)"):
        dequantize_inverse_affine(packed, weight, torch.zeros(47))


@pytest.mark.parametrize("layout", ["contiguous", "channel scaled", "fp16 channel scaled", "transposed"])
def test_dequantize_inverse_affine_divides_rows_by_a_divisor_in_the_same_pass(layout):
    """With ``divisor`` (one value a row), each row of the inverse map then times the reciprocal of its divisor, the
    bits of a pass of its own after it, and still in one op where the context decodes in one; its errors name it."""
    torch.manual_seed(0)
    x = torch.randn(96, 48) * torch.logspace(-2, 2, 48)
    x = {"fp16 channel scaled": x.half(), "transposed": x.t().contiguous().t()}.get(layout, x)
    packed = quantize(x, 3, 64, seed=4, channel_scale=layout.endswith("channel scaled"))
    weight, bias, divisor = torch.rand(48) + 0.5, torch.randn(48), torch.rand(96) * 2 + 0.1
    ops = dispatched(lambda: dequantize_inverse_affine(packed, weight, bias, divisor=divisor))
    got = dequantize_inverse_affine(packed, weight, bias, divisor=divisor)
    expected = dequantize_inverse_affine(packed, weight, bias).mul_(divisor.reciprocal().unsqueeze(1))
    assert got.shape == x.shape and torch.equal(got, expected)
    one_op = layout in ("contiguous", "channel scaled")
    assert [str(f) for f, _ in ops if "act_hf" in str(f)] == (["act_hf.unpack_dequantize_affine.default"] if one_op
                                                              else ["act_hf.unpack_dequantize.default"])
    for bad, message in [(torch.rand(95), "float32 tensor of 96 values, one per row .* got torch.float32 of 95"),
                         (divisor.double(), "got torch.float64 of 96 values"), ([1.0] * 96, "got list")]:
        with pytest.raises(ValueError, match=message):
            dequantize_inverse_affine(packed, weight, bias, divisor=bad)


def test_dequantize_affine_names_its_arguments():
    packed = quantize(torch.randn(8, 16), 3)
    with pytest.raises(ValueError, match=r"mult must be a float32 tensor of shape \(16,\), one value per channel "
                                         r"of the packed tensor's last dimension, got torch.float32 of shape \(8,\)"):
        dequantize_affine(packed, torch.ones(8), torch.zeros(16))
    with pytest.raises(ValueError, match=r"shift must be a float32 tensor .* got torch.float64 of shape \(16,\)"):
        dequantize_affine(packed, torch.ones(16), torch.zeros(16, dtype=torch.float64))


def _fp32_decode(packed, result_dtype):
    """The decode in fp32, never rounded to the original's dtype, with the zero points of ``result_dtype``'s kind
    (the one-pass decode's), for a row-major context without channel scaling; otherwise
    ``dequantize(packed, torch.float32)`` (what a decode first gives)."""
    spec = packed.spec
    if spec.memory_order is not None or spec.channel_scaled or result_dtype == torch.float64:
        return dequantize(packed, torch.promote_types(result_dtype, torch.float32))
    codes = unpack_bits(packed.payload, spec.bits, spec.numel).float()
    codes = torch.cat([codes, codes.new_zeros(packed.lo.numel() * spec.group_size - spec.numel)])
    lo = R.metadata_to_float(packed.lo, R.lo_dtype_for(result_dtype))[:, None]
    scale = R.metadata_to_float(packed.scale, torch.bfloat16)[:, None]
    return (lo + codes.view(-1, spec.group_size) * scale).view(-1)[:spec.numel].view(spec.shape)


def _mapped_by_hand(packed, weight, bias, out, items, keep, result_dtype):
    """What ``dequantize_mapped`` computes, an operation at a time in fp32 (torch's fp32 ops round each)."""
    start, stop = items
    x = _fp32_decode(packed, result_dtype)[start:stop]
    view = (1, -1) + (1,) * (x.dim() - 2)
    values = x * weight.to(x.dtype).view(view) + bias.to(x.dtype).view(view)
    if out is not None:
        values = out.to(x.dtype) + values
    return values if keep is None else torch.where(keep, values, torch.zeros((), dtype=x.dtype))


@pytest.mark.parametrize("layout", ["fp32", "bf16", "fp16", "bf16 into fp32", "fp64", "channel scaled",
                                    "channels last"])
@pytest.mark.parametrize("form", ["new", "accumulate", "masked", "items, accumulate, masked"])
def test_dequantize_mapped_is_the_decode_mapped_by_channel(layout, form):
    """``where(keep, out + (decode[items] * weight + bias), 0)`` per channel of dim 1, rounded once into the result's
    dtype: in one ``act_hf::unpack_dequantize_chain`` (of one term) where the context is row-major, not channel
    scaled and has the result's kind of zero points (bf16 into fp32 too), the decode fp32 (an fp16 original's never
    rounded to fp16); otherwise ``dequantize`` first, to fp32 (fp64 for an fp64 result)."""
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16 into fp32": torch.bfloat16,
             "fp64": torch.float64}.get(layout, torch.float32)
    x = (torch.randn(6, 12, 5, 7) * torch.logspace(-1, 1, 12).view(1, -1, 1, 1)).to(dtype)
    if layout == "channels last":
        x = x.contiguous(memory_format=torch.channels_last)
    packed = quantize(x, 3, 64, seed=4, channel_scale=layout == "channel scaled")
    result_dtype = torch.float32 if layout == "bf16 into fp32" else dtype
    weight, bias = torch.rand(12) + 0.5, torch.randn(12)
    items = (2, 5) if form.startswith("items") else (0, 6)
    shape = (items[1] - items[0], 12, 5, 7)
    out = torch.randn(shape).to(result_dtype) if "accumulate" in form else None
    keep = torch.rand(shape) > 0.4 if "masked" in form else None
    mask = None if keep is None else pack_bits(keep.reshape(-1).to(torch.uint8), 1)
    expected = _mapped_by_hand(packed, weight, bias, out, items, keep, result_dtype).to(result_dtype)
    call = lambda: dequantize_mapped(packed, weight, bias, out=None if out is None else out.clone(),
                                     dtype=result_dtype, items=None if items == (0, 6) else items, mask=mask)
    ops = [str(f) for f, _ in dispatched(call) if "act_hf" in str(f)]
    got = call()
    assert got.dtype == result_dtype and got.shape == shape and got.is_contiguous()
    assert torch.equal(got, expected)
    one_op = layout not in ("channel scaled", "channels last", "fp64")
    assert (ops == ["act_hf.unpack_dequantize_chain.default"]) == one_op, ops


def test_dequantize_mapped_adds_into_out_in_place():
    packed = quantize(torch.randn(4, 8, 3), 4)
    out = torch.randn(4, 8, 3)
    before = out.clone()
    got = dequantize_mapped(packed, torch.ones(8), torch.zeros(8), out=out)
    assert got is out
    assert torch.equal(out, before + dequantize(packed))


def test_dequantize_mapped_reference_runs_give_the_same_bits():
    """The CPU kernel's runs of rows (here one item of 3 x 7 elements, a partial octet at each run's end) give
    the whole tensor's bits, the mask read from the middle of its bytes."""
    torch.manual_seed(1)
    packed = quantize(torch.randn(8, 3, 7), 2, 24)
    weight, bias = torch.rand(3) + 0.5, torch.randn(3)
    keep = torch.rand(6 * 21) > 0.5
    mask = pack_bits(keep.to(torch.uint8), 1)
    args = (packed.payload, packed.lo, packed.scale, 2, 24, packed.spec.numel, 2 * 21, weight, bias, 7, mask, True)
    whole, runs = torch.randn(6 * 21), None
    runs = whole.clone()
    R.unpack_dequantize_into(whole, *args)
    R.unpack_dequantize_into(runs, *args, chunk=1)
    assert torch.equal(whole, runs)


def test_dequantize_mapped_names_its_arguments():
    packed = quantize(torch.randn(4, 16, 3), 3)
    with pytest.raises(ValueError, match=r"weight must be a float32 tensor of shape \(16,\), one value per channel "
                                         r"of the packed tensor's dim 1, got torch.float32 of shape \(3,\)"):
        dequantize_mapped(packed, torch.ones(3), torch.zeros(16))
    with pytest.raises(ValueError, match=r"out must be a contiguous .* tensor of shape \(4, 16, 3\), got "
                                         r"torch.float32 of shape \(4, 16, 2\)"):
        dequantize_mapped(packed, torch.ones(16), torch.zeros(16), out=torch.zeros(4, 16, 2))
    with pytest.raises(ValueError, match=r"items: need 0 <= start <= stop <= 4"):
        dequantize_mapped(packed, torch.ones(16), torch.zeros(16), items=(3, 5))
    with pytest.raises(ValueError, match=r"packed: needs a tensor of at least 2 dims"):
        dequantize_mapped(quantize(torch.randn(64), 3), torch.ones(1), torch.zeros(1))


def _chain_terms(count, dtype, shape=(6, 12, 5, 7), masked=(1, 3), layout="row major"):
    """``count`` terms ``(packed, weight, bias, mask)`` of ``shape``, a mask (items 2..5) after the terms in
    ``masked``; the last term channels last or channel scaled for another ``layout``."""
    terms = []
    for t in range(count):
        x = (torch.randn(shape) * 2.0 ** -t).to(dtype)
        if layout == "channels last" and t == count - 1:
            x = x.contiguous(memory_format=torch.channels_last)
        packed = quantize(x, 3, 64, seed=t, channel_scale=layout == "channel scaled" and t == count - 1)
        keep = torch.rand(3 * math.prod(shape[1:])) > 0.3
        terms.append((packed, torch.rand(shape[1]) + 0.5, torch.randn(shape[1]),
                      pack_bits(keep.to(torch.uint8), 1) if t in masked else None))
    return terms


@pytest.mark.parametrize("count", [1, 3, 8, 11])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_chain_sums_in_fp32_and_rounds_once_a_pass(count, dtype):
    """``dequantize_chain`` of ``count`` terms (items 2..5, masks after the second and fourth) is the terms' mapped
    decodes summed and masked in fp32, each operation rounded, rounded into the result once per pass of up to 8
    terms (``act_hf::unpack_dequantize_chain``, one op a pass), where term by term it would be once a term."""
    torch.manual_seed(count)
    terms = _chain_terms(count, dtype)
    values = None
    for t, (packed, weight, bias, mask) in enumerate(terms):
        if t and t % 8 == 0:  # a pass ends
            values = values.to(dtype).float()
        keep = None if mask is None else unpack_bits(mask, 1, 3 * 12 * 5 * 7).bool().view(3, 12, 5, 7)
        values = _mapped_by_hand(packed, weight, bias, values, (2, 5), keep, dtype)
    call = lambda: dequantize_chain(terms, items=(2, 5))
    ops = [str(f) for f, _ in dispatched(call) if "act_hf" in str(f)]
    got = call()
    assert got.dtype == dtype and got.shape == (3, 12, 5, 7) and got.is_contiguous()
    assert torch.equal(got, values.to(dtype))
    assert ops == ["act_hf.unpack_dequantize_chain.default"] * -(-count // 8)
    if count > 1 and dtype != torch.float32:  # rounded once a term, the sum would differ
        by_terms = None
        for packed, weight, bias, mask in terms:
            by_terms = dequantize_mapped(packed, weight, bias, out=by_terms, items=(2, 5), mask=mask)
        assert not torch.equal(got, by_terms)


@pytest.mark.parametrize("layout", ["channels last", "channel scaled"])
def test_dequantize_chain_of_a_term_that_decodes_apart_goes_term_by_term(layout):
    """A term ``unpack_dequantize_chain`` cannot read (channels last, channel scaled): ``dequantize_mapped`` a term
    at a time, rounded after each."""
    torch.manual_seed(0)
    terms = _chain_terms(3, torch.bfloat16, layout=layout)
    values = None
    for packed, weight, bias, mask in terms:
        values = dequantize_mapped(packed, weight, bias, out=values, items=(2, 5), mask=mask)
    assert torch.equal(dequantize_chain(terms, items=(2, 5)), values)


def test_dequantize_chain_names_its_arguments():
    terms = _chain_terms(2, torch.float32, shape=(4, 16, 3), masked=())
    with pytest.raises(ValueError, match=r"terms: needs at least one \(packed, weight, bias, mask\), got none"):
        dequantize_chain([])
    with pytest.raises(ValueError, match=r"terms: packed tensors of one shape of at least 2 dims, got \(4, 16, 2\) "
                                         r"after \(4, 16, 3\)"):
        dequantize_chain([terms[0], (quantize(torch.randn(4, 16, 2), 3), *terms[1][1:])])
    with pytest.raises(ValueError, match=r"bias must be a float32 tensor of shape \(16,\)"):
        dequantize_chain([terms[0], (terms[1][0], terms[1][1], torch.zeros(3), None)])
    with pytest.raises(ValueError, match=r"items: need 0 <= start <= stop <= 4"):
        dequantize_chain(terms, items=(3, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 5, 7, 3), (40, 12), (2, 3, 100)])
def test_quantize_normalized_packs_the_fp32_normalized_tensor(dtype, shape):
    """``quantize_normalized(x, mean, invstd)`` is ``quantize`` of ``(x - mean) * invstd`` per channel of dim 1 in
    fp32, bit for bit (one ``act_hf::quantize_pack_normalized``; the CPU kernel in runs of 64 elements too), and
    decodes as a tensor of ``x``'s shape and dtype."""
    torch.manual_seed(0)
    x = (torch.randn(shape) * 2 + 1).to(dtype)
    mean, invstd = torch.randn(shape[1]), torch.rand(shape[1]) + 0.5
    view = (1, -1) + (1,) * (len(shape) - 2)
    ops = [str(f) for f, _ in dispatched(lambda: quantize_normalized(x, mean, invstd, 3, 64, seed=9))
           if "act_hf" in str(f)]
    got = quantize_normalized(x, mean, invstd, 3, 64, seed=9)
    want = quantize((x.float() - mean.view(view)) * invstd.view(view), 3, 64, seed=9)
    assert ops == ["act_hf.quantize_pack_normalized.default"]
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors))
    runs = R.quantize_pack_normalized(x.reshape(-1), mean, invstd, math.prod(shape[2:]), 3, 64, 9, chunk=64)
    assert all(torch.equal(a, b) for a, b in zip(runs, got.tensors))
    assert got.spec.dtype == dtype and got.spec.shape == x.shape and dequantize(got).dtype == dtype


def test_quantize_normalized_names_its_arguments():
    x = torch.randn(4, 6, 5)
    with pytest.raises(ValueError, match=r"x must be a contiguous float32 or bfloat16 tensor of at least 2 dims, "
                                         r"got a torch.float16 tensor of shape \(4, 6, 5\)"):
        quantize_normalized(x.half(), torch.zeros(6), torch.ones(6))
    with pytest.raises(ValueError, match=r"got a non-contiguous torch.float32 tensor"):
        quantize_normalized(x.transpose(1, 2), torch.zeros(5), torch.ones(5))
    with pytest.raises(ValueError, match=r"invstd must be a float32 tensor of shape \(6,\), one value per channel "
                                         r"of x's dim 1, got torch.float64 of shape \(6,\)"):
        quantize_normalized(x, torch.zeros(6), torch.ones(6, dtype=torch.float64))


def test_dequantize_refuses_a_non_floating_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        dequantize(quantize(torch.randn(64), 3), torch.int32)


def test_reproducible_with_seed_and_generator():
    x = torch.randn(10, 100)
    a, b = quantize(x, 2, seed=7), quantize(x, 2, seed=7)
    assert torch.equal(a.payload, b.payload)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(quantize(x, 2, seed=g1).payload, quantize(x, 2, seed=g2).payload)
    assert not torch.equal(quantize(x, 2, seed=1).payload, quantize(x, 2, seed=2).payload)


def test_seed_stream_is_one_draw_at_a_time_and_restarts_on_reseeding():
    """Seeds are drawn ahead in batches; the stream is still the generator's one-at-a-time sequence, and a new
    seed (act_hf's or, when following it, torch's) drops what was drawn ahead."""
    import act_hf
    from act_hf.compress import rng

    saved = rng._pinned, rng._followed_torch_seed, rng._generator.get_state(), list(rng._ahead)

    def one_at_a_time(seed: int, count: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [int(torch.randint(0, (1 << 63) - 1, (1,), generator=g).item()) for _ in range(count)]

    try:
        _check_seed_stream(act_hf, rng, one_at_a_time)
    finally:  # leave the stream as other tests found it
        rng._pinned, rng._followed_torch_seed = saved[0], saved[1]
        rng._generator.set_state(saved[2])
        rng._ahead[:] = saved[3]


def _check_seed_stream(act_hf, rng, one_at_a_time) -> None:
    act_hf.manual_seed(7)
    first = [rng.next_seed() for _ in range(300)]  # past one batch of 256
    assert first == one_at_a_time(7, 300)
    act_hf.manual_seed(7)
    assert [rng.next_seed() for _ in range(5)] == first[:5]
    act_hf.manual_seed(8)
    assert rng.next_seed() == one_at_a_time(8, 1)[0]
    rng._pinned = False  # follow torch's seed again, as a fresh process does
    torch.manual_seed(11)
    a = [rng.next_seed() for _ in range(3)]
    torch.manual_seed(12)
    rng.next_seed()
    torch.manual_seed(11)
    assert [rng.next_seed() for _ in range(3)] == a


def test_does_not_touch_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    quantize(torch.randn(1000), 2)  # default stream: act_hf's own generator
    # randn above consumed the global RNG; redo the same consumption without quantize to compare
    torch.manual_seed(5)
    torch.randn(1000)
    after_plain = torch.rand(3)
    torch.manual_seed(5)
    torch.randn(1000)
    quantize(torch.ones(1000), 2)
    assert torch.equal(torch.rand(3), after_plain)
    assert expected.shape == after_plain.shape


@pytest.mark.parametrize("dtype", [torch.float64])
def test_float64_round_trip(dtype):
    x = torch.randn(300, dtype=dtype)
    y = dequantize(quantize(x, 8, 64, seed=0))
    assert y.dtype == dtype
    torch.testing.assert_close(y, x, atol=0.05, rtol=0)


def test_packed_tensor_rebuild_and_repr():
    x = torch.randn(5, 40)
    p = quantize(x, 3, 64, seed=0)
    q = PackedTensor.rebuild(p.tensors, p.spec)
    assert torch.equal(dequantize(q), dequantize(p))
    assert "bits=3" in repr(p) and p.shape == x.shape and p.dtype == x.dtype


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_bits_round_trip(bits):
    for n in [0, 1, 5, 8, 13, 1001]:
        codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
        payload = pack_bits(codes, bits)
        assert payload.numel() == math.ceil(n * bits / 8)
        assert torch.equal(unpack_bits(payload, bits, n), codes)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpack_bits_reads_a_prefix_of_a_longer_payload(bits):
    """A payload packed for more codes than are read (a dropout mask of the whole tensor, read for its first
    elements): the first ``n`` codes, the bytes after them ignored."""
    codes = torch.randint(0, 2**bits, (21,), dtype=torch.uint8)
    payload = pack_bits(codes, bits)
    for n in [1, 7, 8, 9, 20]:
        assert torch.equal(unpack_bits(payload, bits, n), codes[:n])


def test_bit_stream_layout_is_little_endian():
    # element i at bits [i*b, (i+1)*b); stream bit k is bit k%8 of byte k//8
    codes = torch.tensor([1, 0, 3, 2, 7], dtype=torch.uint8)
    payload = pack_bits(codes, 3)
    stream = 0
    for i, c in enumerate(codes.tolist()):
        stream |= c << (3 * i)
    assert payload.tolist() == [(stream >> (8 * k)) & 0xFF for k in range(math.ceil(15 / 8))]
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0b10001101, 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=0), "bits must be an integer from 1 to 8, got 0"),
        (dict(bits=9), "bits must be an integer from 1 to 8, got 9"),
        (dict(bits=2.5), "bits must be an integer"),
        (dict(bits=True), "bits must be an integer"),
        (dict(group_size=0), "group_size must be a positive multiple of 8"),
        (dict(group_size=-8), "group_size must be a positive multiple of 8"),
        (dict(group_size=100), "group_size must be a positive multiple of 8"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    args = dict(bits=3, group_size=256) | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        quantize(torch.randn(10), **args)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_integer_bool_complex_tensors_refused(dtype):
    with pytest.raises(ValueError, match="x must be a floating tensor"):
        quantize(torch.zeros(10, dtype=dtype), 3)


def test_non_tensor_refused():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize([1.0, 2.0], 3)
    with pytest.raises(TypeError, match="packed must be a PackedTensor"):
        dequantize(torch.zeros(3))
    with pytest.raises(ValueError, match="codes must be a uint8 or bool"):
        pack_bits(torch.zeros(3, dtype=torch.int32), 2)


def test_metadata_rounded_outward():
    x = torch.randn(64, 256) * 10 + 3
    p = quantize(x, 3, 256, seed=0)
    lo = R.metadata_to_float(p.lo, torch.bfloat16)
    scale = R.metadata_to_float(p.scale, torch.bfloat16)
    groups = x.view(-1, 256)
    assert bool((lo <= groups.amin(1)).all())
    assert bool((lo + 7 * scale >= groups.amax(1)).all())


@pytest.mark.parametrize("bits", [3, 4, 6, 8])
def test_scale_is_the_correctly_rounded_quotient_rounded_up_to_bf16(bits):
    """scale = bf16 round-up of the correctly rounded fp32 (max - lo) / (2**b - 1), as the kernel's __fdiv_rn.
    bf16 groups of 8 have spans that are exact multiples of 2**b - 1, where a multiply by the reciprocal (CUDA's
    way with a Python-scalar divisor) lands one fp32 ulp off and rounds up to the next bf16 scale."""
    torch.manual_seed(3)
    x = (torch.randn(20000, 8) * 4 - 1).to(torch.bfloat16)
    _, lo_bits, scale_bits = R.quantize_pack(x.view(-1), bits, 8, 5)
    span = x.float().amax(1) - R.metadata_to_float(lo_bits, torch.bfloat16)  # fp32, correctly rounded
    levels = (1 << bits) - 1
    quotient = (span.double() / levels).float()  # double then float: still correctly rounded
    assert torch.equal(scale_bits, R._bf16_bits_round_up(quotient))
    by_reciprocal = R._bf16_bits_round_up(span * torch.tensor(1 / levels, dtype=torch.float32))
    assert not torch.equal(scale_bits, by_reciprocal)  # the data tells the two apart


def test_rounding_uniforms_are_splitmix64_of_quads():
    """The hash the CUDA kernel reproduces: z = splitmix64(seed + p * golden) for the quad (4p, ..., 4p + 3),
    whose element 4p + k takes bits 48 - 16k .. 63 - 16k of z, scaled by 2^-16; from any start, ones inside a
    quad included."""

    def splitmix(seed: int, i: int) -> float:
        m = (1 << 64) - 1
        z = (seed + (i // 4) * 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        z ^= z >> 31
        return ((z >> (48 - 16 * (i % 4))) & 0xFFFF) / 2**16

    for seed in (0, 12345, (1 << 63) - 1):
        for start, numel in ((0, 50), (7, 20), (8, 1), (3, 0), (5, 2), (2, 11)):
            got = R.uniform_from_hash(seed, numel, start=start).tolist()
            assert got == [splitmix(seed, i) for i in range(start, start + numel)]


def test_rounding_uniforms_of_a_quad_are_uncorrelated():
    """The four fields of one hash are draws of their own: each pair's correlation over 2^18 quads is within a few
    standard errors of 0, and each field is uniform (mean 1/2, variance 1/12, every 16-bit value about equally
    often)."""
    u = R.uniform_from_hash(2024, 1 << 20).double().view(-1, 4)
    n = u.shape[0]
    corr = torch.corrcoef(u.T)
    assert (corr - torch.eye(4, dtype=torch.float64)).abs().max().item() < 5 / n**0.5
    for k in range(4):
        field = u[:, k]
        assert abs(field.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
        assert abs(field.var().item() - 1 / 12) < 0.002
        counts = torch.bincount((field * 2**16).long(), minlength=1 << 16).double()  # 4 expected per value
        chi2 = ((counts - 4) ** 2 / 4).sum().item()  # about 65535 +- 362 for uniform draws
        assert abs(chi2 - 65535) < 5 * (2 * 65535) ** 0.5


@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunked_kernels_give_the_reference_bits(bits, dtype):
    """The CPU kernels run the reference over runs of whole groups: every payload byte, zero point, scale and
    decoded value equals the one-pass reference, partial last group and non-finite groups included."""
    n, group_size = 3 * 4096 + 1000, 64
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits)).to(dtype)
    x[5000] = float("inf")
    whole = R.quantize_pack(x, bits, group_size, 99)
    chunked = R.quantize_pack_chunked(x, bits, group_size, 99, chunk=4096 + 8)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    ref = R.unpack_dequantize(*whole, bits, group_size, n, dtype)
    got = R.unpack_dequantize_chunked(*whole, bits, group_size, n, dtype, chunk=4096 + 8)
    assert torch.equal(ref.isnan(), got.isnan()) and torch.equal(ref.nan_to_num(), got.nan_to_num())
    # the registered CPU op is the chunked one, at its default chunk
    big = torch.randn((1 << 18) + 333)
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.act_hf.quantize_pack(big, bits, 256, 7),
                                                 R.quantize_pack(big, bits, 256, 7)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_zero_unmasked_is_where_of_the_unpacked_mask(dtype):
    """``zero_unmasked(values, pack_bits(keep, 1))`` is ``torch.where(keep, values, 0)`` (``+0``, also for
    dropped NaN and inf), as a new tensor and in place, chunk by chunk (a chunk of 1000 elements ends inside no
    byte), through the registered ops, and for a non-contiguous ``values`` (its logical order)."""
    from act_hf.compress import pack_bits, zero_unmasked

    gen = torch.Generator().manual_seed(3)
    values = torch.randn(5, 1003, generator=gen, dtype=torch.float64).to(dtype)
    values[0, :4] = torch.tensor([math.nan, math.inf, -math.inf, -1.0], dtype=dtype)
    keep = torch.rand(values.shape, generator=gen) < 0.5
    keep[0, :4] = False
    mask = pack_bits(keep, 1)
    want = torch.where(keep, values, torch.zeros((), dtype=dtype))
    assert not want[0, :4].signbit().any()

    def same(got):
        return got.shape == want.shape and torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(
            got.isnan(), want.isnan()) and torch.equal(got.signbit(), want.signbit())

    flat = values.reshape(-1)
    assert same(zero_unmasked(values, mask)) and same(R.zero_unmasked(flat, mask).view(values.shape))
    assert same(R.zero_unmasked_chunked(flat, mask, chunk=1000).view(values.shape))
    assert same(R.zero_unmasked_chunked(flat.clone(), mask, in_place=True, chunk=1000).view(values.shape))
    assert same(torch.ops.act_hf.zero_unmasked(flat, mask).view(values.shape))
    inplace = values.clone()
    assert zero_unmasked(inplace, mask, in_place=True) is inplace and same(inplace)
    inplace = flat.clone()
    torch.ops.act_hf.zero_unmasked_inplace(inplace, mask)
    assert same(inplace.view(values.shape))
    transposed = values.t()  # not contiguous: the mask in its logical order
    mask_t = pack_bits(keep.t(), 1)
    assert torch.equal(zero_unmasked(transposed, mask_t).nan_to_num(), want.t().nan_to_num())
    assert torch.equal(zero_unmasked(transposed.clone(), mask_t, in_place=True).nan_to_num(),
                       want.t().nan_to_num())
    with pytest.raises(ValueError, match="mask must be a uint8 tensor, got dtype torch.bool"):
        zero_unmasked(values, keep)


@pytest.mark.parametrize("bits", [1, 2, 5, 8])
def test_chunked_bit_packing_gives_the_reference_stream(bits):
    n = 5 * 1024 + 3
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    stream = R.pack_bits(codes, bits)
    assert torch.equal(R.pack_bits_chunked(codes, bits, chunk=1000), stream)
    assert torch.equal(R.unpack_bits_chunked(stream, bits, n, chunk=1000), codes)
    big = torch.randint(0, 1 << bits, ((1 << 18) + 5,), dtype=torch.uint8)
    assert torch.equal(torch.ops.act_hf.pack_bits(big, bits), R.pack_bits(big, bits))
