"""Max / min reductions (``amax``, ``amin``, and the whole-tensor ``max()`` / ``min()``) whose backward context is a
1-bit mask of the elements that attain the extremum.

Autograd saves the input and the result of these reductions and finds the maxima again in backward as
``input == result``, splitting the gradient evenly among ties. Quantized separately (the fallback's saved-tensor
hooks), the two no longer compare equal: a reduced slice with no match divides by a count of zero, and the
gradient is NaN (timm's Hiera pools its queries with ``amax``: every gradient of the model was NaN at 8 bits).
This op keeps the comparison's result instead, at one bit per input element, and its backward is autograd's
formula on it, so the gradient is bit-identical:

* ``amax`` / ``amin``: ``(grad / mask.sum(dims, keepdim=True)) * mask`` (a slice whose result is NaN has no
  match and a NaN gradient, as in autograd);
* whole-tensor ``max()`` / ``min()``: ``zeros.masked_fill(mask, grad / mask.sum())`` with the NaN elements as the
  mask when the result is NaN (autograd's ``evenly_distribute_backward``).

Reductions over an index (``max(x, dim)``) save ``int64`` indices, not the input, and are not this op's concern.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..compress import pack_bits, unpack_bits
from ..context import store
from ..errors import ActHFValueError

__all__ = ["ActExtremumFunction", "act_extremum"]


def _reduce(x: Tensor, largest: bool, dims: tuple[int, ...] | None, keepdim: bool) -> Tensor:
    if dims is None:
        return x.max() if largest else x.min()
    return torch.amax(x, dims, keepdim) if largest else torch.amin(x, dims, keepdim)


def _restore_dims(t: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor:
    """``t`` with the reduced ``dims`` (sorted, non-negative) back as size-1 dimensions."""
    if not keepdim:
        for d in dims:
            t = t.unsqueeze(d)
    return t


class ActExtremumFunction(torch.autograd.Function):
    """``amax`` / ``amin`` over ``dims`` (``None``: the whole-tensor ``max()`` / ``min()``) saving the 1-bit mask
    of the extremal elements (slot ``<slot>``)."""

    @staticmethod
    def forward(ctx, x: Tensor, largest: bool, dims: tuple[int, ...] | None, keepdim: bool, slot: str) -> Tensor:
        out = _reduce(x, largest, dims, keepdim)
        if dims is None:
            mask = (x == out) | (x.isnan() & out.isnan())
        else:
            mask = x == _restore_dims(out, dims, keepdim)
        payload = pack_bits(mask, 1)
        store.register((payload,), slot=slot, original_nbytes=2 * x.numel() * x.element_size())
        ctx.save_for_backward(payload)
        ctx.meta = (x.shape, dims, keepdim)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (payload,) = ctx.saved_tensors
        shape, dims, keepdim = ctx.meta
        mask = unpack_bits(payload, 1, math.prod(shape)).view(shape).bool()
        if dims is None:
            return grad.new_zeros(shape).masked_fill_(mask, grad / mask.sum()), None, None, None, None
        grad = _restore_dims(grad, dims, keepdim)
        return (grad / mask.sum(dims, keepdim=True)) * mask, None, None, None, None


def _dims(dim: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:  # amax's default: every dimension
        return tuple(range(ndim))
    rank = max(ndim, 1)
    if any(isinstance(d, bool) or not isinstance(d, int) or not -rank <= d < rank for d in dims):
        raise ActHFValueError(f"dim must be ints in [-{rank}, {rank}), got {dim!r}")
    out = tuple(sorted({d % rank for d in dims}))
    if len(out) != len(dims):
        raise ActHFValueError(f"dim must not repeat a dimension, got {dim!r}")
    return out


def act_extremum(x: Tensor, *, largest: bool, dim: int | Sequence[int] | None = None, keepdim: bool = False,
                 slot: str = "extremum") -> Tensor:
    """``torch.amax`` (``largest=True``) or ``torch.amin`` over ``dim`` (``()`` or a sequence: as those take it),
    or with ``dim=None`` the whole-tensor ``x.max()`` / ``x.min()``, saving a 1-bit mask of the extremal elements
    (slot ``slot``) instead of input and result. The result and the gradient are the original ones, bit for bit.
    Without grad, or for a 0-d input, the original reduction runs."""
    if not torch.is_grad_enabled() or not x.requires_grad or x.dim() == 0:
        if dim is None:
            return _reduce(x, largest, None, keepdim)
        return torch.amax(x, dim, keepdim) if largest else torch.amin(x, dim, keepdim)
    dims = None if dim is None else _dims(dim, x.dim())
    return ActExtremumFunction.apply(x, bool(largest), dims, bool(keepdim), slot)
