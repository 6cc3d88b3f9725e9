"""Elementwise passes over full-size tensors: how large a slice each works on, to keep its temporaries bounded, and
how one with operands of another dtype runs in a single pass."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

__all__ = ["by_items", "chunk_elements", "even_spans", "in_place", "row_spans", "scaled_as", "spans"]


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
