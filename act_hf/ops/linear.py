"""Linear and convolution with a quantized saved input.

Forward is the original op (``F.linear`` / ``torch.convolution``, autocast applying as usual). The context is
the input, quantized through the context store (shared with every other op that saves the same tensor), and
the weight *parameter* itself (never autocast's copy: backward casts it again). Following
``ctx.needs_input_grad``: the input is saved only when the weight needs a gradient, the weight only when the
input does; a frozen layer fed by a frozen input saves nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compress import dequantize
from ..context import store
from ._saving import OpSettings, load_context, save_context

__all__ = ["ActConvFunction", "ActLinearFunction", "act_conv", "act_linear"]


class ActLinearFunction(torch.autograd.Function):
    """``y = x @ weight.T + bias``; saves ``quantize(x)`` (if weight needs grad) and ``weight`` (if x does)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, settings: OpSettings) -> Tensor:
        out = F.linear(x, weight, bias)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        packed = store.compress(x, slot=settings.slot, bits=settings.bits, group_size=settings.group_size) if need_w else None
        save_context(ctx, packed, weight if need_x else None)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, weight = load_context(ctx)
        dtype = grad_out.dtype
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(weight.to(dtype))
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            g2d = grad_out.reshape(-1, grad_out.shape[-1])
            if ctx.needs_input_grad[1]:
                x_hat = dequantize(packed).to(dtype)
                grad_w = g2d.t().matmul(x_hat.reshape(-1, x_hat.shape[-1]))
            if ctx.needs_input_grad[2]:
                grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b, None


def act_linear(x: Tensor, weight: Tensor, bias: Tensor | None, settings: OpSettings) -> Tensor:
    """Functional form of :class:`ActLinearFunction`."""
    return ActLinearFunction.apply(x, weight, bias, settings)


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class ActConvFunction(torch.autograd.Function):
    """N-d convolution (any groups, stride, dilation, zero padding); saves ``quantize(x)`` and ``weight``.

    Non-zero padding modes are applied by the module with ``F.pad`` before this op, as ``nn.ConvNd`` does.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, ...],
                padding: tuple[int, ...], dilation: tuple[int, ...], groups: int, settings: OpSettings) -> Tensor:
        out = _CONV[len(stride)](x, weight, bias, stride, padding, dilation, groups)  # autocast applies as usual
        need_w = ctx.needs_input_grad[1]
        packed = store.compress(x, slot=settings.slot, bits=settings.bits, group_size=settings.group_size) if need_w else None
        save_context(ctx, packed, weight)  # the parameter itself: its shape is needed even for grad_x only
        ctx.conv_args = (stride, padding, dilation, groups)
        ctx.input_shape = x.shape
        ctx.bias_shape = None if bias is None else list(bias.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, weight = load_context(ctx)
        stride, padding, dilation, groups = ctx.conv_args
        dtype = grad_out.dtype
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and ctx.bias_shape is not None]
        if packed is not None:
            x_hat = dequantize(packed).to(dtype)
        else:  # only the input gradient is wanted: the input's values are not needed, only its shape
            x_hat = grad_out.new_zeros(()).expand(ctx.input_shape)
        grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_out, x_hat, weight.to(dtype), ctx.bias_shape, list(stride), list(padding), list(dilation), False,
            [0] * len(stride), groups, mask,
        )
        return grad_x, grad_w, grad_b, None, None, None, None, None


def act_conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation, groups: int,
             settings: OpSettings) -> Tensor:
    """Functional form of :class:`ActConvFunction`."""
    return ActConvFunction.apply(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups, settings)
