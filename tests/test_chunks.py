"""act_hf._chunks: slices of elementwise passes, in-place ops of mixed dtypes by slices on the CPU, and when an op
works on slices of the batch (``ACT_HF_SLICING``)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from act_hf._chunks import (
    by_items,
    chunk_elements,
    device_headroom,
    even_spans,
    has_room,
    in_place,
    room_for,
    row_spans,
    sliced_unless_room,
    slicing_mode,
    spans,
)
from act_hf.errors import ActHFValueError


def test_spans_cover_the_range_and_rows_hold_about_the_asked_elements():
    assert list(spans(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    t = torch.empty(7, 3, 5)
    assert list(row_spans(t, 30)) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert list(row_spans(t, 45)) == [(0, 3), (3, 6), (6, 7)]
    assert list(row_spans(t, 60)) == [(0, 4), (4, 7)]  # two spans of at most 4 rows: 4 + 3, not 4 + 4
    assert list(row_spans(t, 1)) == [(i, i + 1) for i in range(7)]  # at least a row


@pytest.mark.parametrize("count", [1, 7, 20, 40, 255, 256, 257])
@pytest.mark.parametrize("most", [1, 4, 8, 72, 83, 1000])
@pytest.mark.parametrize("multiple", [1, 4, 64])
def test_even_spans_are_as_few_as_the_plain_ones_and_of_one_size(count, most, multiple):
    """``even_spans`` covers the range in as many spans as ``spans`` at the largest step allowed (``most`` rounded
    down to a multiple, at least one): all but the last of one size, a whole multiple no larger than that step,
    the last no larger than they are."""
    got = list(even_spans(count, most, multiple))
    step = max(multiple, most // multiple * multiple)
    assert got[0][0] == 0 and got[-1][1] == count and all(a[1] == b[0] for a, b in itertools.pairwise(got))
    assert len(got) == len(list(spans(count, step)))
    sizes = [b - a for a, b in got]
    assert sizes[0] <= max(step, count) and set(sizes[:-1]) <= {sizes[0]} and sizes[-1] <= sizes[0]
    assert len(sizes) == 1 or (sizes[0] <= step and sizes[0] % multiple == 0)


def test_even_spans_split_a_batch_evenly():
    assert list(even_spans(256, 72)) == [(0, 64), (64, 128), (128, 192), (192, 256)]  # not 72, 72, 72, 40
    assert list(even_spans(256, 83)) == [(0, 64), (64, 128), (128, 192), (192, 256)]  # not 83, 83, 83, 7
    assert list(even_spans(20, 8, 4)) == [(0, 8), (8, 16), (16, 20)]  # whole multiples: 8, 8, 4, not 7, 7, 6
    assert list(even_spans(10, 3, 4)) == [(0, 4), (4, 8), (8, 10)]  # at least a multiple


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


def test_room_for_takes_the_tighter_of_the_process_share_and_the_device():
    """Temporaries fit when twice their bytes fit both in the process's share less what it holds, and in the
    device's free bytes plus the process's cached ones."""
    gib = 1 << 30
    assert room_for(4 * gib, allocated=2 * gib, reserved=3 * gib, free=20 * gib, limit=16 * gib)
    assert not room_for(8 * gib, allocated=2 * gib, reserved=3 * gib, free=20 * gib, limit=16 * gib)  # the share
    assert not room_for(4 * gib, allocated=2 * gib, reserved=3 * gib, free=6 * gib, limit=80 * gib)  # the device
    assert room_for(3 * gib, allocated=2 * gib, reserved=3 * gib, free=6 * gib, limit=80 * gib)  # 6 + 1 cached


def test_slicing_mode_reads_act_hf_slicing_and_names_the_allowed_values(monkeypatch):
    monkeypatch.delenv("ACT_HF_SLICING", raising=False)
    assert slicing_mode() == "auto"
    cpu = torch.device("cpu")
    assert device_headroom(cpu) is None and not has_room(cpu, 1)  # auto: no room accounting off CUDA
    for mode, room in (("always", False), ("never", True), ("auto", False)):
        monkeypatch.setenv("ACT_HF_SLICING", mode)
        assert slicing_mode() == mode and has_room(cpu, 1) is room
    monkeypatch.setenv("ACT_HF_SLICING", "sometimes")
    with pytest.raises(ActHFValueError, match=r"ACT_HF_SLICING must be one of auto, always, never, got 'sometimes'"):
        slicing_mode()


def test_sliced_unless_room_runs_the_whole_batch_where_it_fits_and_the_slices_after_an_out_of_memory(monkeypatch):
    chunks = [(0, 3), (3, 6), (6, 8)]
    asked = []

    def run(spans):
        asked.append(spans)
        return len(spans)

    monkeypatch.setenv("ACT_HF_SLICING", "always")
    assert sliced_unless_room(chunks, 8, torch.device("cpu"), 1, run) == 3 and asked == [chunks]
    monkeypatch.setenv("ACT_HF_SLICING", "never")
    asked.clear()
    assert sliced_unless_room(chunks, 8, torch.device("cpu"), 1, run) == 1 and asked == [[(0, 8)]]
    asked.clear()
    assert sliced_unless_room([(0, 8)], 8, torch.device("cpu"), 1, run) == 1 and asked == [[(0, 8)]]  # one call

    def short_of_memory(spans):
        asked.append(spans)
        if len(spans) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (the whole batch)")
        return len(spans)

    asked.clear()
    assert sliced_unless_room(chunks, 8, torch.device("cpu"), 1, short_of_memory) == 3
    assert asked == [[(0, 8)], chunks]


@pytest.mark.cuda
def test_cuda_room_follows_the_allocator_and_the_process_share(monkeypatch):
    """On CUDA ``auto`` weighs the caching allocator's counters, the driver's free bytes and the per-process
    memory fraction: a tensor held counts against the room, and a smaller share leaves less of it."""
    monkeypatch.setenv("ACT_HF_SLICING", "auto")
    device = torch.device("cuda")
    allocated, reserved, free, limit = device_headroom(device)
    assert 0 <= allocated <= reserved and free > 0 and limit > allocated
    assert has_room(device, 1 << 20) and not has_room(device, limit)
    held = torch.empty(1 << 26, dtype=torch.uint8, device=device)
    assert device_headroom(device)[0] >= allocated + held.numel()
    if not hasattr(torch.cuda, "get_per_process_memory_fraction"):  # an older torch: the device's total is the limit
        return
    share = torch.cuda.get_per_process_memory_fraction(device)
    torch.cuda.set_per_process_memory_fraction(0.05, device)
    try:
        small = device_headroom(device)[3]
        assert small <= 0.051 * torch.cuda.get_device_properties(device).total_memory
        assert not has_room(device, small // 2)
    finally:
        torch.cuda.set_per_process_memory_fraction(share, device)
