"""StarReLU, ``y = s * relu(x) ** 2 + b`` (MetaFormer's CAFormer and ConvFormer, timm's ``StarReLU``), saving two
packed tensors instead of four.

Autograd keeps ``relu(x)`` twice (the ReLU's output for its mask, the square's input) and ``relu(x) ** 2`` for the
scale's gradient; the MLP's next linear then packs ``y`` again. This op computes ``y`` as timm writes it (bit for
bit) and keeps

* ``Q(r)``, ``r = relu(x)`` (slot ``<base>:input``): ``grad_x = 2 s grad r`` is linear in ``r``, so unbiased; the
  zeros of ``r`` are grid points of every group (its minimum), so they stay exact and no mask is needed;
* ``Q(y)`` (slot ``<base>:output``), when the scale needs a gradient: ``grad_s = sum(grad * r ** 2)`` and
  ``r ** 2 = (y - b) / s`` is linear in ``y``, so ``sum(grad * (Q(y) - b) / s)`` is unbiased where ``Q(r) ** 2``
  would not be. The next linear or conv packs the same ``y`` at the same bits and finds this copy
  (:meth:`act_hf.context.ContextStore.compress`), so it costs nothing there. Where ``s`` is exactly 0 (``y`` holds
  no trace of ``r``) the scale's gradient reads ``Q(r) ** 2``.

``grad_b = sum(grad)`` needs no context.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..compress import dequantize
from ..context import store
from ._saving import OpSettings, load_context, save_context
from .attention import role_settings

__all__ = ["ActStarReLUFunction", "act_star_relu"]


class ActStarReLUFunction(torch.autograd.Function):
    """``y = scale * relu(x) ** 2 + bias`` (``scale`` and ``bias`` broadcast to ``x``); see the module docstring
    for what it saves."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: Tensor, bias: Tensor, settings: OpSettings) -> Tensor:
        r = torch.relu(x)
        y = scale * r ** 2 + bias
        need_x, need_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        packed_r = store.compress_as(r, role_settings(settings, "input")) if need_x or need_s else None
        packed_y = store.compress_as(y, role_settings(settings, "output")) if need_s else None
        save_context(ctx, packed_r, packed_y, scale if need_x or need_s else None, bias if need_s else None)
        ctx.dtypes = (x.dtype, scale.dtype, bias.dtype)
        ctx.shapes = (scale.shape, bias.shape)
        return y

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed_r, packed_y, scale, bias = load_context(ctx)
        x_dtype, s_dtype, b_dtype = ctx.dtypes
        s_shape, b_shape = ctx.shapes
        grad_x = grad_s = grad_b = None
        r = dequantize(packed_r) if packed_r is not None else None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out * (2 * scale) * r).to(x_dtype)
        if ctx.needs_input_grad[1]:
            squared = torch.where(scale != 0, (dequantize(packed_y) - bias) / torch.where(scale != 0, scale, 1),
                                  r * r)
            grad_s = (grad_out * squared).sum_to_size(s_shape).to(s_dtype)
        if ctx.needs_input_grad[2]:
            grad_b = grad_out.sum_to_size(b_shape).to(b_dtype)
        return grad_x, grad_s, grad_b, None


def act_star_relu(x: Tensor, scale: Tensor, bias: Tensor, settings: OpSettings) -> Tensor:
    """Functional form of :class:`ActStarReLUFunction`."""
    return ActStarReLUFunction.apply(x, scale, bias, settings)
