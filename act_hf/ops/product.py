"""The element-wise product of two activations (the gate of GLU MLPs: ``act(gate) * up``), saving both packed.

Autograd's ``mul`` keeps both operands at full width: each is the other's gradient factor. This op computes the
same product (``a * b``, bit-identical) and keeps ``quantize(b)`` for ``grad_a = grad * b`` and ``quantize(a)``
for ``grad_b = grad * a``; both gradients are unbiased because each reads one independently rounded operand.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..compress import dequantize
from ..context import store
from ._saving import OpSettings, load_context, save_context
from .activation import _inplace_would_fail

__all__ = ["ActProductFunction", "act_product"]


class ActProductFunction(torch.autograd.Function):
    """``y = a * b`` for ``a`` and ``b`` of one shape; saves ``quantize(b)`` if ``a`` needs a gradient and
    ``quantize(a)`` if ``b`` does (with ``settings_b`` and ``settings_a``; ``a`` is quantized first). With
    ``into_a`` the product is written into ``a`` (``a.mul_(b)``, the same values) after both are packed, and ``a``
    is returned, marked dirty."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, settings_a: OpSettings, settings_b: OpSettings,
                into_a: bool = False) -> Tensor:
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        packed_a = store.compress_as(a, settings_a) if need_b else None
        packed_b = store.compress_as(b, settings_b) if need_a else None
        if into_a:
            out = a.mul_(b)
            ctx.mark_dirty(a)
        else:
            out = a * b
        save_context(ctx, packed_a, packed_b)
        ctx.dtypes = (a.dtype, b.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed_a, packed_b = load_context(ctx)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = (grad_out * dequantize(packed_b)).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            grad_b = (grad_out * dequantize(packed_a)).to(ctx.dtypes[1])
        return grad_a, grad_b, None, None, None


def act_product(a: Tensor, b: Tensor, settings_a: OpSettings, settings_b: OpSettings, *,
                into_a: bool = False) -> Tensor:
    """``a * b`` with both operands saved packed (see :class:`ActProductFunction`); operands of different shapes
    (broadcasting) fall back to the plain product.

    ``into_a``: the caller owns ``a`` (nothing reads it afterwards, and autograd saved no op's view of it: a
    few-bit activation's output), so the product is written into it, and ``a``, ``b`` and the product are never
    alive together. Ignored where autograd would refuse it (``a`` a leaf that needs a gradient) or where ``a`` and
    ``b`` share memory."""
    if a.shape != b.shape:
        return a * b
    into_a = into_a and a.dtype == torch.result_type(a, b) and not _inplace_would_fail(a) \
        and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    return ActProductFunction.apply(a, b, settings_a, settings_b, into_a)
