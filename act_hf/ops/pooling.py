"""Max pooling whose backward context is the argmax position inside each window, packed at a few bits.

PyTorch's max pooling saves the input *and* an ``int64`` index per output element. The gradient needs only
where each maximum was, and that is one of ``K = prod(kernel_size)`` positions of its window: act_hf saves
that position, packed at ``b = max(1, ceil(log2(K)))`` bits (2 bits for 2x2 windows, 4 for 3x3, 5 for
3x3x3), and nothing else: ``ceil(n_out * b / 8)`` bytes.

Forward runs ``aten.max_pool{2,3}d_with_indices``, the op ``F.max_pool{1,2,3}d`` itself runs when its input
requires grad (1-d pooling goes through the 2-d op on ``x.unsqueeze(-2)``, as in ATen), so the output is
identical. Backward rebuilds PyTorch's flat indices from the window positions (window start
``o * stride - padding``, tap ``k * dilation``) and calls ``aten.max_pool{2,3}d_with_indices_backward`` with
a stride-0 placeholder of the input's shape: the gradient is bit-identical to the original's, overlapping
windows included (the same kernel accumulates in the same order). Its memory format is the kernel's default
(contiguous) even for a channels-last input.

Any padding, stride, dilation and ``ceil_mode`` are supported. The original op runs unchanged for
``return_indices=True`` (the caller holds the ``int64`` indices anyway) and for windows of more than 256
positions (codes wider than 8 bits).

Average pooling's gradient needs the input's shape alone, but autograd keeps the whole input for
``aten.avg_pool{2,3}d_backward`` (1-d pooling: the 2-d op's on ``x.unsqueeze(-2)``): a ResNet-D's average-pool
shortcuts, PoolFormer's token mixer, DenseNet's transitions. :func:`act_avg_pool` keeps nothing and calls the same
backward with a stride-0 placeholder, so the gradient is bit-identical (its memory format contiguous, as the max
pool's).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._chunks import chunk_elements, row_spans
from ..compress import unpack_bits
from ..errors import ActHFValueError
from ._saving import OpSettings, owned_output
from .activation import _pack_codes

__all__ = ["MAX_WINDOW", "ActAvgPoolFunction", "ActMaxPoolFunction", "act_avg_pool", "act_max_pool", "act_max_pool1d",
           "act_max_pool2d", "act_max_pool3d", "window_bits"]

logger = logging.getLogger(__name__)

#: Largest window (``prod(kernel_size)``) whose positions fit the 8-bit codes.
MAX_WINDOW = 256

_ORIGINAL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def window_bits(kernel_size: Sequence[int]) -> int:
    """Bits of a window-position code: ``max(1, ceil(log2(prod(kernel_size))))``."""
    return max(1, math.ceil(math.log2(math.prod(kernel_size))))


def _tuple(value, nd: int, name: str) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * nd
    try:
        out = tuple(int(v) for v in value)
    except TypeError:
        raise ActHFValueError(f"{name} must be an int or a sequence of {nd} ints, got {value!r}") from None
    if len(out) == 1:
        out = out * nd
    if len(out) != nd:
        raise ActHFValueError(f"{name} must be an int or a sequence of {nd} ints, got {value!r}")
    return out


def _window_starts(out_sizes, stride, padding, device, dtype: torch.dtype) -> list[Tensor]:
    """Per spatial dim, ``o * stride - padding`` (``dtype``) shaped to broadcast against the output's spatial
    dims."""
    nd = len(out_sizes)
    starts = []
    for d in range(nd):
        view = [1] * nd
        view[d] = out_sizes[d]
        starts.append((torch.arange(out_sizes[d], device=device, dtype=dtype) * stride[d] - padding[d]).view(view))
    return starts


def _index_dtype(in_sizes) -> torch.dtype:
    """int32 where every flat index into an input plane fits it, else int64."""
    return torch.int32 if math.prod(in_sizes) < 2**31 else torch.int64


def _recode_by_slices(src: Tensor, out_dtype: torch.dtype, in_sizes, stride, padding, radix,
                      term: Callable[[Tensor, int, Tensor], None]) -> Tensor:
    """A new ``out_dtype`` tensor of ``src``'s shape: each value of ``src`` (below ``prod(radix)``) split into
    mixed-radix digits (``radix``, the last dim's digit fastest), digit ``d`` mapped in place by ``term(digit, d,
    window_starts[d])``, the mapped digits summed. Computed over slices of the first dim, in int32 where a plane's
    indices fit: temporaries of a slice's size, not full-size int64 tensors."""
    nd = len(in_sizes)
    dtype = _index_dtype(in_sizes)
    starts = _window_starts(src.shape[-nd:], stride, padding, src.device, dtype)
    out = torch.empty(src.shape, dtype=out_dtype, device=src.device)
    for start, stop in row_spans(src, chunk_elements(src.device)):
        rest = src[start:stop].to(dtype, copy=True)
        total = None
        for d in reversed(range(nd)):
            digit = rest.remainder(radix[d]) if d else rest  # what is left below the first radix is its digit
            if d:
                rest.div_(radix[d], rounding_mode="floor")
            term(digit, d, starts[d])
            total = digit if total is None else total.add_(digit)
        out[start:stop] = total
    return out


def _indices_to_codes(indices: Tensor, in_sizes, kernel, stride, padding, dilation) -> Tensor:
    """PyTorch's flat per-plane argmax indices -> the position of the argmax inside its window (``uint8``,
    contiguous). By slices (:func:`_recode_by_slices`): the full-size int64 temporaries of one pass set resnet50's
    peak on an H100 at 3 bits."""
    weights = [math.prod(kernel[d + 1:]) for d in range(len(kernel))]

    def position(coord: Tensor, d: int, start: Tensor) -> None:  # (coord - start) // dilation * weight
        coord.sub_(start)
        if dilation[d] != 1:
            coord.div_(dilation[d], rounding_mode="floor")
        if weights[d] != 1:
            coord.mul_(weights[d])

    return _recode_by_slices(indices, torch.uint8, in_sizes, stride, padding, in_sizes, position)


def _codes_to_indices(code: Tensor, in_sizes, kernel, stride, padding, dilation) -> Tensor:
    """Inverse of :func:`_indices_to_codes`: flat ``int64`` indices into each input plane (the dtype
    ``max_pool*_with_indices_backward`` takes)."""
    planes = [math.prod(in_sizes[d + 1:]) for d in range(len(in_sizes))]

    def index(tap: Tensor, d: int, start: Tensor) -> None:  # (start + tap * dilation) * plane
        if dilation[d] != 1:
            tap.mul_(dilation[d])
        tap.add_(start)
        if planes[d] != 1:
            tap.mul_(planes[d])

    return _recode_by_slices(code, torch.int64, in_sizes, stride, padding, kernel, index)


class ActMaxPoolFunction(torch.autograd.Function):
    """N-d max pooling (N = 1, 2, 3; without returned indices); saves only the packed window positions.

    Saves (when ``x`` needs a gradient): one ``uint8`` tensor of ``ceil(n_out * b / 8)`` bytes, the argmax
    position within each window packed at ``b = window_bits(kernel_size)`` bits. Shapes and pooling arguments
    are kept as Python attributes.
    """

    @staticmethod
    def forward(ctx, x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                dilation: tuple[int, ...], ceil_mode: bool, slot: str) -> Tensor:
        nd = len(kernel)
        if nd == 1:  # as ATen: 1-d pooling is the 2-d op on a height-1 input
            out, indices = torch.ops.aten.max_pool2d_with_indices(
                x.unsqueeze(-2), [1, kernel[0]], [1, stride[0]], [0, padding[0]], [1, dilation[0]], ceil_mode)
            out, indices = owned_output(out.squeeze(-2)), indices.squeeze(-2)
        elif nd == 2:
            out, indices = torch.ops.aten.max_pool2d_with_indices(
                x, list(kernel), list(stride), list(padding), list(dilation), ceil_mode)
        else:
            out, indices = torch.ops.aten.max_pool3d_with_indices(
                x, list(kernel), list(stride), list(padding), list(dilation), ceil_mode)
        ctx.args = (kernel, stride, padding, dilation, ceil_mode)
        ctx.input_shape = x.shape
        ctx.bits = window_bits(kernel)
        if ctx.needs_input_grad[0]:
            codes = _indices_to_codes(indices, x.shape[-nd:], kernel, stride, padding, dilation)
            del indices
            # PyTorch keeps the input and an int64 index per output element
            payload = _pack_codes(codes, ctx.bits, slot or "max_pool:indices",
                                  x.numel() * x.element_size() + out.numel() * 8)
            ctx.save_for_backward(payload)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        (payload,) = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil_mode = ctx.args
        nd = len(kernel)
        codes = unpack_bits(payload, ctx.bits, grad_out.numel()).view(grad_out.shape)
        indices = _codes_to_indices(codes, ctx.input_shape[-nd:], kernel, stride, padding, dilation)
        placeholder = grad_out.new_zeros(()).expand(ctx.input_shape)
        if nd == 1:
            grad = torch.ops.aten.max_pool2d_with_indices_backward(
                grad_out.unsqueeze(-2), placeholder.unsqueeze(-2), [1, kernel[0]], [1, stride[0]], [0, padding[0]],
                [1, dilation[0]], ceil_mode, indices.unsqueeze(-2)).squeeze(-2)
        elif nd == 2:
            grad = torch.ops.aten.max_pool2d_with_indices_backward(
                grad_out, placeholder, list(kernel), list(stride), list(padding), list(dilation), ceil_mode, indices)
        else:
            grad = torch.ops.aten.max_pool3d_with_indices_backward(
                grad_out, placeholder, list(kernel), list(stride), list(padding), list(dilation), ceil_mode, indices)
        return grad, None, None, None, None, None, None


def act_max_pool(
    x: Tensor,
    nd: int,
    kernel_size,
    stride=None,
    padding=0,
    dilation=1,
    ceil_mode: bool = False,
    return_indices: bool = False,
    *,
    settings: OpSettings | None = None,
):
    """``F.max_pool{nd}d`` with the same arguments and output, saving packed window positions for backward.

    Args:
        x: input of ``nd + 1`` (unbatched) or ``nd + 2`` dims.
        nd: number of spatial dims, 1, 2 or 3.
        kernel_size, stride, padding, dilation: an int or ``nd`` ints each (``stride`` ``None`` or empty:
            ``kernel_size``).
        ceil_mode: ceil instead of floor for the output size.
        return_indices: ``True`` runs the original op (and returns its indices).
        settings: only its ``slot`` is used (to name the saved codes in :func:`act_hf.track_saved`).

    Returns:
        The pooled tensor (with indices when ``return_indices``).

    Raises:
        ActHFValueError: ``nd`` not 1..3 or malformed pooling arguments; PyTorch's own errors for invalid
        combinations (e.g. padding larger than half the kernel).
    """
    if nd not in _ORIGINAL:
        raise ActHFValueError(f"nd must be 1, 2 or 3, got {nd!r}")
    if return_indices or not (torch.is_grad_enabled() and x.requires_grad):
        return _ORIGINAL[nd](x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                             return_indices=return_indices)
    kernel = _tuple(kernel_size, nd, "kernel_size")
    stride_t = kernel if stride is None or (not isinstance(stride, int) and len(stride) == 0) else _tuple(
        stride, nd, "stride")
    padding_t = _tuple(padding, nd, "padding")
    dilation_t = _tuple(dilation, nd, "dilation")
    if math.prod(kernel) > MAX_WINDOW or min(kernel) <= 0:
        return _ORIGINAL[nd](x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode)
    return ActMaxPoolFunction.apply(x, kernel, stride_t, padding_t, dilation_t, bool(ceil_mode),
                                    settings.slot if settings is not None else "")


def act_max_pool1d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
                   return_indices: bool = False, *, settings: OpSettings | None = None):
    """:func:`act_max_pool` for 1 spatial dim (``F.max_pool1d``)."""
    return act_max_pool(x, 1, kernel_size, stride, padding, dilation, ceil_mode, return_indices, settings=settings)


def act_max_pool2d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
                   return_indices: bool = False, *, settings: OpSettings | None = None):
    """:func:`act_max_pool` for 2 spatial dims (``F.max_pool2d``)."""
    return act_max_pool(x, 2, kernel_size, stride, padding, dilation, ceil_mode, return_indices, settings=settings)


def act_max_pool3d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
                   return_indices: bool = False, *, settings: OpSettings | None = None):
    """:func:`act_max_pool` for 3 spatial dims (``F.max_pool3d``)."""
    return act_max_pool(x, 3, kernel_size, stride, padding, dilation, ceil_mode, return_indices, settings=settings)


_AVG_ORIGINAL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _original_avg_pool(x: Tensor, nd: int, kernel_size, stride, padding, ceil_mode: bool, count_include_pad: bool,
                       divisor_override: int | None) -> Tensor:
    """``F.avg_pool{nd}d`` (1-d pooling takes no ``divisor_override``)."""
    extra = () if nd == 1 else (divisor_override,)
    return _AVG_ORIGINAL[nd](x, kernel_size, stride, padding, ceil_mode, count_include_pad, *extra)


class ActAvgPoolFunction(torch.autograd.Function):
    """N-d average pooling (N = 1, 2, 3) that saves nothing: backward needs the input's shape alone."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                ceil_mode: bool, count_include_pad: bool, divisor_override: int | None) -> Tensor:
        ctx.args = (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
        ctx.input_shape = x.shape
        return _original_avg_pool(x, len(kernel), kernel, stride, padding, ceil_mode, count_include_pad,
                                  divisor_override)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        kernel, stride, padding, ceil_mode, count_include_pad, divisor_override = ctx.args
        placeholder = grad_out.new_zeros(()).expand(ctx.input_shape)
        nd = len(kernel)
        if nd == 1:
            grad = torch.ops.aten.avg_pool2d_backward(
                grad_out.unsqueeze(-2), placeholder.unsqueeze(-2), [1, kernel[0]], [1, stride[0]], [0, padding[0]],
                ceil_mode, count_include_pad, None).squeeze(-2)
        elif nd == 2:
            grad = torch.ops.aten.avg_pool2d_backward(grad_out, placeholder, list(kernel), list(stride),
                                                      list(padding), ceil_mode, count_include_pad, divisor_override)
        else:
            grad = torch.ops.aten.avg_pool3d_backward(grad_out, placeholder, list(kernel), list(stride),
                                                      list(padding), ceil_mode, count_include_pad, divisor_override)
        return grad, None, None, None, None, None, None


def act_avg_pool(x: Tensor, nd: int, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    """``F.avg_pool{nd}d`` with the same arguments and output, saving nothing for backward (autograd keeps the
    input); the gradient is bit-identical.

    Args:
        x: input of ``nd + 1`` (unbatched) or ``nd + 2`` dims.
        nd: number of spatial dims, 1, 2 or 3.
        kernel_size, stride, padding: an int or ``nd`` ints each (``stride`` ``None`` or empty: ``kernel_size``).
        ceil_mode, count_include_pad, divisor_override: as ``F.avg_pool{nd}d`` takes them (no
            ``divisor_override`` for 1-d).

    Raises:
        ActHFValueError: ``nd`` not 1..3, malformed pooling arguments, or a ``divisor_override`` for 1-d pooling;
        PyTorch's own errors for invalid combinations.
    """
    if nd not in _AVG_ORIGINAL:
        raise ActHFValueError(f"nd must be 1, 2 or 3, got {nd!r}")
    if nd == 1 and divisor_override is not None:
        raise ActHFValueError("divisor_override is not an argument of 1-d average pooling; pass None")
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _original_avg_pool(x, nd, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                  divisor_override)
    kernel = _tuple(kernel_size, nd, "kernel_size")
    stride_t = kernel if stride is None or (not isinstance(stride, int) and len(stride) == 0) else _tuple(
        stride, nd, "stride")
    return ActAvgPoolFunction.apply(x, kernel, stride_t, _tuple(padding, nd, "padding"), bool(ceil_mode),
                                    bool(count_include_pad), divisor_override)
