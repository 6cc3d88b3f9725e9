"""Elementwise passes over full-size tensors: how large a slice each works on, to keep its temporaries bounded, and
how one with operands of another dtype runs in a single pass."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from .errors import ActHFValueError

__all__ = ["SLICING_MODES", "by_items", "chunk_elements", "device_headroom", "even_spans", "has_room", "in_place",
           "room_for", "row_spans", "scaled_as", "sliced_unless_room", "slicing_mode", "spans"]

_T = TypeVar("_T")

#: ``ACT_HF_SLICING``'s values: when a convolution, BatchNorm's backward or attention's recomputation, past its
#: threshold of elements, works on slices of the batch (:func:`sliced_unless_room`). ``auto`` (the default): on a
#: CUDA device only when the whole batch's temporaries would not fit twice over in what the process may still
#: allocate (:func:`has_room`), elsewhere always; ``always``: past the thresholds whatever the room (what a memory
#: measurement of a large batch's regime wants on a device with room to spare); ``never``: the whole batch at once
#: while it fits, the slices only after an out-of-memory error.
SLICING_MODES = ("auto", "always", "never")


def chunk_elements(device: torch.device) -> int:
    """Elements an elementwise pass handles at once (a multiple of 8, so over packed codes every chunk starts on a
    byte of the packed stream at any width): on the CPU the size of its kernels' chunks, on an accelerator large
    enough that launches stay few while the full-width temporaries (fp32 copy, int32 indices, decoded values,
    up to 13 bytes per element) stay bounded at tens of MiB whatever the batch."""
    return 1 << 22 if device.type != "cpu" else 1 << 18


def spans(numel: int, step: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` element ranges of at most ``step`` elements covering ``range(numel)``."""
    return ((start, min(numel, start + step)) for start in range(0, numel, step))


def even_spans(count: int, most: int, multiple: int = 1) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` ranges covering ``range(count)``: as few as ranges of at most ``most`` items make (at least
    ``multiple`` items each, whole multiples of it but the last), of one size as near as ``multiple`` allows. A
    batch of 256 images in ranges of at most 72 runs as 64 + 64 + 64 + 64, not 72 + 72 + 72 + 40: the same number
    of calls, the largest one's temporaries smaller, and blocks of one size for the allocator to reuse."""
    most = max(multiple, most // multiple * multiple)
    pieces = max(1, -(-count // most))
    step = -(-count // pieces)
    return spans(count, -(-step // multiple) * multiple)


def row_spans(t: torch.Tensor, elements: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` ranges of ``t``'s first dim whose slices hold at most about ``elements`` elements, at
    least one row each, as few as that allows and of one size (:func:`even_spans`; a slice of the first dim is a
    view in any memory layout)."""
    per_row = max(1, t[0].numel()) if t.shape[0] else 1
    return even_spans(t.shape[0], max(1, elements // per_row))


def in_place(values: torch.Tensor, op: Callable[..., torch.Tensor], *operands: torch.Tensor) -> torch.Tensor:
    """``op(values, *operands)``, an in-place elementwise op, over slices of dim 0 on the CPU when an operand's
    dtype is not ``values``': there TensorIterator computes it through full-size temporaries of the common dtype
    (bf16 values and fp32 BatchNorm parameters: three fp32 copies of resnet50's block input, 77 of the 145 MB
    alive at its backward peak at batch 8). CUDA kernels cast as they go and get the whole tensor at once.
    Operands of ``values``' rank and batch are sliced with it; the others broadcast whole."""
    rows = values.shape[0] if values.dim() > 1 else 1
    if values.device.type != "cpu" or rows < 2 or all(o.dtype == values.dtype for o in operands):
        return op(values, *operands)
    for start, stop in row_spans(values, chunk_elements(values.device)):
        op(values[start:stop], *(o[start:stop] if o.dim() == values.dim() and o.shape[0] == rows else o
                                 for o in operands))
    return values


def scaled_as(t: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(t * factor).to(dtype)`` in one pass: ``t`` (the caller's own) scaled in place when it has ``dtype``, else
    the product rounded once into a new tensor of ``dtype`` (the same bits as the two steps)."""
    if t.dtype == dtype:
        return t.mul_(factor)
    return torch.mul(t, factor, out=torch.empty_like(t, dtype=dtype))

def by_items(chunks: list[tuple[int, int]], batch: int, make: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """The output of a computation whose batch items are independent: ``make(start, end)``, the output of items
    ``[start, end)``, for each chunk, laid into one tensor of ``batch`` items, in the memory layout of the first
    chunk's output (a channels-last conv output stays channels last); ``make(0, batch)`` itself for a single
    chunk."""
    if len(chunks) == 1:
        return make(*chunks[0])
    out = None
    for start, end in chunks:
        part = make(start, end)
        if out is None:  # dims from outermost to innermost in memory, the batch first
            inner = sorted(range(1, part.dim()), key=lambda d: (-part.stride(d), d))
            out = torch.empty_permuted((batch, *part.shape[1:]), (0, *inner), dtype=part.dtype, device=part.device)
        out[start:end] = part
    return out


def slicing_mode() -> str:
    """``ACT_HF_SLICING`` (one of :data:`SLICING_MODES`; ``auto`` when unset), read at each call."""
    mode = os.environ.get("ACT_HF_SLICING", "auto") or "auto"
    if mode not in SLICING_MODES:
        raise ActHFValueError(f"ACT_HF_SLICING must be one of {', '.join(SLICING_MODES)}, got {mode!r}")
    return mode


def room_for(nbytes: int, allocated: int, reserved: int, free: int, limit: int) -> bool:
    """Whether temporaries of ``nbytes`` fit twice over (the estimates are a model, not a measurement) in what a
    process holding ``allocated`` bytes of ``reserved`` may still allocate: ``limit`` (its share of the device)
    less ``allocated``, and no more than the device's ``free`` bytes plus the process's cached ones."""
    return 2 * nbytes <= min(limit - allocated, free + reserved - allocated)


def device_headroom(device: torch.device) -> tuple[int, int, int, int] | None:
    """``(allocated, reserved, free, limit)`` of this process on a CUDA ``device`` for :func:`room_for`: the
    caching allocator's counters, the driver's free bytes, and the per-process memory fraction
    (``torch.cuda.set_per_process_memory_fraction``) of the device's total; ``None`` on other devices."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    fraction = torch.cuda.get_per_process_memory_fraction(index) \
        if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    return (torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index), free, int(fraction * total))


def has_room(device: torch.device, nbytes: int) -> bool:
    """Whether an op may run on the whole batch at once, its temporaries estimated at ``nbytes``
    (:data:`SLICING_MODES`): ``never`` always, ``always`` never, ``auto`` when :func:`room_for` says so on a CUDA
    device."""
    mode = slicing_mode()
    if mode != "auto":
        return mode == "never"
    counters = device_headroom(device)
    return counters is not None and room_for(nbytes, *counters)


def sliced_unless_room(chunks: list[tuple[int, int]], batch: int, device: torch.device, whole_bytes: int,
                       run: Callable[[list[tuple[int, int]]], _T]) -> _T:
    """``run(chunks)``, the op over slices of the batch, or ``run([(0, batch)])``, the whole batch at once, when
    the device has room for the whole batch's temporaries, estimated at ``whole_bytes`` (:func:`has_room`): the
    slices bound an op's memory at a large batch, at the price of more launches, copies into one output and, in
    BatchNorm's backward, a second decode; where memory is not short they buy nothing. An out-of-memory error of
    the whole batch (an estimate that fell short) runs the slices after all."""
    if len(chunks) > 1 and has_room(device, whole_bytes):
        try:
            return run([(0, batch)])
        except torch.OutOfMemoryError:
            pass  # the allocator has released its cached blocks; the slices need less
    return run(chunks)
