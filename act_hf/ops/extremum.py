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

Reductions over an index (``max(x, dim)`` / ``min(x, dim)``, values and indices) save no input but ``int64``
indices, 8 bytes an output element (HF's Hiera pools its queries and tokens with ``.max(dim=...)``: a fifth of its
context at 3 bits). :func:`act_indexed_extremum` keeps each index at ``max(1, ceil(log2(size)))`` bits, ``size``
the reduced dimension's (up to 256 positions; longer ones run the original), and scatters the gradient to it as
autograd does: bit-identical.

The elementwise forms compare in backward too: ``maximum`` / ``minimum`` of two tensors (also ``max(a, b)``,
``min(a, b)``) and ``clamp`` / ``clip`` / ``clamp_min`` / ``clamp_max`` with numeric bounds. Autograd saves the
operands; through the hooks each was quantized, and elements near the other operand or a bound compared the wrong
way: Apertus's xIELU activation takes ``min(x, -1e-6)`` in every MLP, at the centre
of its input's distribution, and its 8-bit gradient was 4.7% off the exact one (1.1% with exact comparisons).
These ops keep the comparison's outcome and apply autograd's formula to it, so the gradient is bit-identical:

* :func:`act_elementwise_extremum`: a 2-bit code an output element (less, equal, greater, unordered): each
  operand gets ``where(a == b, grad / 2, grad)`` with the elements where the other operand won set to 0;
* :func:`act_clamp` (numeric bounds): a 1-bit mask of the elements autograd passes the gradient to (strictly
  inside the bounds on torch 2.14.1, at them too where autograd tests ``x >= lo``). Tensor bounds are left to
  autograd: it splits their ties its own way, which not every release has written as ``maximum``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..compress import pack_bits, unpack_bits, unpack_mask
from ..context import store
from ..errors import ActHFValueError

__all__ = ["MAX_INDEXED_SIZE", "ActClampFunction", "ActElementwiseExtremumFunction", "ActExtremumFunction",
           "ActIndexedExtremumFunction", "act_clamp", "act_elementwise_extremum", "act_extremum",
           "act_indexed_extremum", "passes_at_bound"]

#: Longest dimension :func:`act_indexed_extremum` reduces itself (its indices fit a byte); longer run the original.
MAX_INDEXED_SIZE = 256


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
        mask = unpack_mask(payload, shape)
        if dims is None:
            return grad.new_zeros(shape).masked_fill_(mask, grad / mask.sum()), None, None, None, None
        grad = _restore_dims(grad, dims, keepdim)
        return (grad / mask.sum(dims, keepdim=True)) * mask, None, None, None, None


def _index_bits(size: int) -> int:
    """Bits of an index into ``size`` positions: ``max(1, ceil(log2(size)))``."""
    return max(1, math.ceil(math.log2(size)))


class ActIndexedExtremumFunction(torch.autograd.Function):
    """``torch.max(x, dim, keepdim)`` (``largest``) or ``torch.min``: the values and ``int64`` indices torch returns,
    saving the indices packed at :func:`_index_bits` of the reduced size (slot ``<slot>``); the indices are not
    differentiable."""

    @staticmethod
    def forward(ctx, x: Tensor, largest: bool, dim: int, keepdim: bool, slot: str) -> tuple[Tensor, Tensor]:
        values, indices = torch.max(x, dim, keepdim) if largest else torch.min(x, dim, keepdim)
        ctx.mark_non_differentiable(indices)
        ctx.bits = _index_bits(x.shape[dim])
        payload = pack_bits(indices.to(torch.uint8), ctx.bits)
        store.register((payload,), slot=slot, original_nbytes=indices.numel() * indices.element_size())
        ctx.save_for_backward(payload)
        ctx.meta = (x.shape, dim, keepdim, indices.shape)
        return values, indices

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor, _grad_indices):
        (payload,) = ctx.saved_tensors
        shape, dim, keepdim, index_shape = ctx.meta
        indices = unpack_bits(payload, ctx.bits, math.prod(index_shape)).view(index_shape).long()
        if not keepdim:
            indices, grad = indices.unsqueeze(dim), grad.unsqueeze(dim)
        return grad.new_zeros(shape).scatter_(dim, indices, grad), None, None, None, None


def act_indexed_extremum(x: Tensor, dim: int, keepdim: bool = False, *, largest: bool,
                         slot: str = "extremum"):
    """``torch.max(x, dim, keepdim)`` (``largest=True``) or ``torch.min(x, dim, keepdim)``, as torch returns it
    (``torch.return_types.max`` / ``min``: values and indices), saving the indices at a few bits (slot ``slot``)
    instead of ``int64``; values, indices and the gradient are the original ones, bit for bit. Without grad, for a
    0-d input or a reduced dimension longer than :data:`MAX_INDEXED_SIZE`, the original reduction runs.

    Raises:
        ActHFValueError: ``dim`` is not an int in ``[-x.dim(), x.dim())``."""
    reduce = torch.max if largest else torch.min
    rank = max(x.dim(), 1)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -rank <= dim < rank:
        raise ActHFValueError(f"dim must be an int in [-{rank}, {rank}), got {dim!r}")
    if not torch.is_grad_enabled() or not x.requires_grad or x.dim() == 0 or x.shape[dim] > MAX_INDEXED_SIZE:
        return reduce(x, dim, keepdim)
    values, indices = ActIndexedExtremumFunction.apply(x, bool(largest), dim % x.dim(), bool(keepdim), slot)
    result = torch.return_types.max if largest else torch.return_types.min
    return result((values, indices))


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


_LESS, _EQUAL, _GREATER, _UNORDERED = 0, 1, 2, 3


class ActElementwiseExtremumFunction(torch.autograd.Function):
    """``maximum(a, b)`` (``largest``) or ``minimum(a, b)``, broadcast, saving a 2-bit code of ``a`` against ``b``
    per output element (slot ``<slot>``). Gradients come out at the output's shape; autograd sums them to each
    operand's shape and casts them to its dtype, as for its own ``maximum``."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, largest: bool, slot: str) -> Tensor:
        out = torch.maximum(a, b) if largest else torch.minimum(a, b)
        less, equal, greater = a < b, a == b, a > b
        code = (equal.to(torch.uint8) * _EQUAL + greater.to(torch.uint8) * _GREATER).masked_fill_(
            ~(less | equal | greater), _UNORDERED)
        payload = pack_bits(code, 2)
        saved = a.numel() * a.element_size() + b.numel() * b.element_size()  # autograd keeps both operands
        store.register((payload,), slot=slot, original_nbytes=saved)
        ctx.save_for_backward(payload)
        ctx.meta = (out.shape, largest)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (payload,) = ctx.saved_tensors
        shape, largest = ctx.meta
        code = unpack_bits(payload, 2, math.prod(shape)).view(shape)
        tied = torch.where(code == _EQUAL, grad / 2, grad)
        a_lost, b_lost = (code == _LESS, code == _GREATER) if largest else (code == _GREATER, code == _LESS)
        grad_a = tied.masked_fill(a_lost, 0) if ctx.needs_input_grad[0] else None
        grad_b = tied.masked_fill(b_lost, 0) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None


def act_elementwise_extremum(a: Tensor, b: Tensor, *, largest: bool, slot: str = "extremum") -> Tensor:
    """``torch.maximum(a, b)`` (``largest=True``) or ``torch.minimum(a, b)`` saving a 2-bit code of the comparison
    per output element (slot ``slot``) instead of both operands. Result and gradients are the original ones, bit
    for bit (ties split the gradient in half, NaN passes it to both, as autograd does). Without grad, the
    original op runs."""
    if not torch.is_grad_enabled() or not (a.requires_grad or b.requires_grad):
        return torch.maximum(a, b) if largest else torch.minimum(a, b)
    return ActElementwiseExtremumFunction.apply(a, b, bool(largest), slot)


_AT_BOUND: dict[str, bool] = {}  # clamp's form -> whether this torch's autograd passes the gradient at the bound


def passes_at_bound(form: str) -> bool:
    """Whether autograd's ``clamp`` with numeric bounds (``form``: ``"clamp"``, ``"clamp_min"``, ``"clamp_max"``)
    passes the gradient to an element equal to a bound. torch 2.14.1 does not (``x > lo``); a release whose
    autograd tests ``x >= lo`` does. Asked of autograd once per form, under hooks of its own: the saved-tensor
    hooks around the caller (a patched model's, ``track_saved``'s) never see the probe."""
    hit = _AT_BOUND.get(form)
    if hit is None:
        x = torch.zeros(1, requires_grad=True)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = torch.clamp(x, 0.0, 1.0) if form == "clamp" else getattr(torch, form)(x, 0.0)
            (grad,) = torch.autograd.grad(y.sum(), x)
        hit = _AT_BOUND[form] = bool(grad.item() == 1.0)
    return hit


class ActClampFunction(torch.autograd.Function):
    """``clamp(x, lo, hi)`` with numeric bounds (either may be None) saving the 1-bit mask of the elements where
    autograd passes the gradient (slot ``<slot>``): inside the bounds, and at them where :func:`passes_at_bound`."""

    @staticmethod
    def forward(ctx, x: Tensor, lo, hi, slot: str) -> Tensor:
        if hi is None:
            out, passed = torch.clamp_min(x, lo), (x >= lo if passes_at_bound("clamp_min") else x > lo)
        elif lo is None:
            out, passed = torch.clamp_max(x, hi), (x <= hi if passes_at_bound("clamp_max") else x < hi)
        else:
            out = torch.clamp(x, lo, hi)
            passed = (x >= lo).logical_and_(x <= hi) if passes_at_bound("clamp") else (x > lo).logical_and_(x < hi)
        payload = pack_bits(passed, 1)
        store.register((payload,), slot=slot, original_nbytes=x.numel() * x.element_size())
        ctx.save_for_backward(payload)
        ctx.shape = out.shape
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (payload,) = ctx.saved_tensors
        passed = unpack_mask(payload, ctx.shape)
        return torch.where(passed, grad, grad.new_zeros(())), None, None, None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def act_clamp(x: Tensor, lo: float | None = None, hi: float | None = None, *, slot: str = "extremum") -> Tensor:
    """``torch.clamp(x, lo, hi)`` with numeric bounds (``clamp_min`` / ``clamp_max`` when one is None), saving a
    1-bit mask of the elements autograd passes the gradient to (slot ``slot``) instead of ``x``: those inside the
    bounds, and on torch before 2.14 those at a bound (:func:`passes_at_bound`); NaN gets none. Result and
    gradient are the original ones, bit for bit.

    Raises:
        ActHFValueError: a bound that is not an int, a float or None, or both None.
    """
    for name, v in (("lo", lo), ("hi", hi)):
        if v is not None and not _is_number(v):
            raise ActHFValueError(f"act_clamp's {name} must be an int, a float or None, got {type(v).__name__}")
    if lo is None and hi is None:
        raise ActHFValueError("act_clamp needs at least one bound: lo or hi, got both None")
    if not torch.is_grad_enabled() or not x.requires_grad:
        if hi is None or lo is None:
            return torch.clamp_min(x, lo) if hi is None else torch.clamp_max(x, hi)
        return torch.clamp(x, lo, hi)
    return ActClampFunction.apply(x, lo, hi, slot)
