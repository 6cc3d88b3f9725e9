"""act_hf._chunks: slices of elementwise passes, and in-place ops of mixed dtypes by slices on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from act_hf._chunks import by_items, chunk_elements, in_place, row_spans, spans


def test_spans_cover_the_range_and_rows_hold_about_the_asked_elements():
    assert list(spans(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    t = torch.empty(7, 3, 5)
    assert list(row_spans(t, 30)) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert list(row_spans(t, 1)) == [(i, i + 1) for i in range(7)]  # at least a row


def _largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


@pytest.mark.parametrize("op", ["mul_", "add_", "addcmul_"])
@pytest.mark.parametrize("per_sample", [False, True])
def test_in_place_of_mixed_dtypes_is_the_plain_op_bit_for_bit_without_full_size_temporaries(op, per_sample):
    """bf16 values, fp32 per-channel (or per-sample-and-channel) factors: the same bits as the op on the whole
    tensor, and no temporary larger than a slice (the whole op makes full-size fp32 copies on the CPU)."""
    torch.manual_seed(0)
    values = torch.randn(16, 64, 32, 32).to(torch.bfloat16)
    factor = torch.rand(16 if per_sample else 1, 64, 1, 1) + 0.5
    operands = (values.clone(), factor) if op == "addcmul_" else (factor,)
    expected = getattr(values.clone(), op)(*operands)
    got = values.clone()
    assert in_place(got, getattr(Tensor, op), *operands) is got
    assert torch.equal(got, expected)
    full = values.numel() * 4
    assert _largest_allocation(lambda: getattr(values.clone(), op)(*operands)) >= full  # what it avoids
    assert _largest_allocation(lambda: in_place(values, getattr(Tensor, op), *operands)) <= 4 * chunk_elements(
        values.device) <= full // 4  # one slice's fp32 copy


def test_in_place_of_one_dtype_is_the_op_itself():
    values, other = torch.randn(4, 8), torch.randn(4, 8)
    expected = values.clone().add_(other)
    assert torch.equal(in_place(values, Tensor.add_, other), expected)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_by_items_lays_the_slices_into_one_tensor_of_the_first_slices_layout(layout):
    x = torch.randn(7, 3, 4, 5).contiguous(memory_format=layout)

    def make(start: int, stop: int) -> Tensor:
        return (x[start:stop] * 2).contiguous(memory_format=layout)

    whole = by_items([(0, 7)], 7, make)
    sliced = by_items([(0, 3), (3, 6), (6, 7)], 7, make)
    assert torch.equal(sliced, whole) and sliced.stride() == whole.stride() == x.stride()
