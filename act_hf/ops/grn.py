"""Global Response Normalization (ConvNeXt V2's GRN) with a quantized saved input.

GRN, per sample ``b`` and channel ``c`` over the spatial positions ``s``::

    g[b, c] = ||x[b, :, c]||_2,    n = g / (mean_c g + eps),    y = x + weight * (x * n) + bias

Autograd keeps ``x`` at full width for the norm, and ``x * n`` for ``weight``'s gradient: two full-width
tensors a layer. This op runs the module's own forward (bit-identical output, whatever the formulation: timm's
``addcmul`` or HF's sum) and keeps the exact per-channel norms ``g`` (``B x C`` floats) and
``quantize(z)``, ``z = x / g``: the input normalized per sample and channel, as BatchNorm keeps its normalized
input. Quantizing ``x`` itself would put one group's step on every channel, and the norm's gradient direction
``x / g`` of a channel with a small ``g`` would carry that step divided by ``g`` (measured: 8-bit gradients at
cosine 0.9989 on a 1 x 1 map). Backward is the exact gradient with ``z`` read from the packed copy, in fp32::

    u = dy * weight,    t = g * sum_s u * z = g * weight * sum_s dy * z,    d = mean_c g + eps
    dL/dg = t / d - sum_c(t * g) / (C * d^2)
    dx = dy + u * n + z * dL/dg = dy * (1 + weight * n) + z * dL/dg      (z = 0 where g == 0, as torch's norm
    backward)
    dweight = sum_{b,s} dy * g * z * n = sum_b g * n * sum_s dy * z,     dbias = sum_{b,s} dy

``dweight`` and ``u * n`` are linear in the packed ``z`` and unbiased. The last term of ``dx`` multiplies ``z``
by ``t``, which reads ``z`` too: the same second-order bias as BatchNorm's ``x_hat * sum(dy * x_hat)`` term
(ActNN's BatchNorm has it as well), of order ``1 / S`` of the noise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..compress import dequantize
from ..context import store
from ._saving import OpSettings, load_context, save_context

__all__ = ["ActGRNFunction", "act_grn", "grn_reference"]


def _layout(ndim: int, channel_dim: int) -> tuple[int, tuple[int, ...], list[int]]:
    """``channel_dim`` made non-negative, the spatial dims (all but batch and channels), and the broadcast shape
    of a per-channel vector."""
    channel_dim %= ndim
    shape = [1] * ndim
    shape[channel_dim] = -1
    return channel_dim, tuple(d for d in range(1, ndim) if d != channel_dim), shape


def grn_reference(x: Tensor, weight: Tensor, bias: Tensor, channel_dim: int, eps: float) -> Tensor:
    """GRN by its formula (any float dtype; ``weight`` and ``bias`` of ``C`` elements in any shape)."""
    channel_dim, spatial, shape = _layout(x.dim(), channel_dim)
    g = torch.linalg.vector_norm(x, 2, dim=spatial, keepdim=True)
    n = g / (g.mean(dim=channel_dim, keepdim=True) + eps)
    return x + weight.reshape(shape) * (x * n) + bias.reshape(shape)


class ActGRNFunction(torch.autograd.Function):
    """``y = forward(x)``, the module's GRN; saves ``quantize(x / g)`` and the fp32 norms ``g`` (when ``x`` or
    ``weight`` needs a gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, forward: Callable[[Tensor], Tensor], channel_dim: int,
                eps: float, settings: OpSettings) -> Tensor:
        out = forward(x)
        channel_dim, spatial, _ = _layout(x.dim(), channel_dim)
        packed = g = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            z = x.to(torch.float32, copy=True)  # the one full-width temporary: normalized in place below
            g = torch.linalg.vector_norm(z, 2, dim=spatial, keepdim=True)
            z.div_(torch.where(g > 0, g, torch.ones_like(g)))
            packed = store.compress_as(z, settings)
        save_context(ctx, packed, g, weight if ctx.needs_input_grad[0] else None)
        ctx.args = (channel_dim, spatial, eps, x.dtype, weight.dtype, weight.shape, bias.dtype, bias.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, g, weight = load_context(ctx)
        channel_dim, spatial, eps, x_dtype, w_dtype, w_shape, b_dtype, b_shape = ctx.args
        dy = grad_out.float()
        reduce = tuple(d for d in range(dy.dim()) if d != channel_dim)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[2]:
            grad_b = dy.sum(reduce).reshape(b_shape).to(b_dtype)
        if packed is None:
            return grad_x, grad_w, grad_b, None, None, None, None
        z = dequantize(packed, torch.float32)
        d = g.mean(dim=channel_dim, keepdim=True) + eps
        n = g / d
        # sum_s dy * z, per sample and channel: what both gradients read of the full-size tensors (the weight is
        # constant over s, so sum_s u * z = weight * sum_s dy * z); one full-size product, freed at once
        dyz = (dy * z).sum(spatial, keepdim=True)
        if ctx.needs_input_grad[1]:
            grad_w = (dyz * (g * n)).sum(reduce).reshape(w_shape).to(w_dtype)
        if ctx.needs_input_grad[0]:
            w = weight.float().reshape(_layout(dy.dim(), channel_dim)[2])
            t = g * w * dyz
            dg = t / d - (t * g).sum(channel_dim, keepdim=True) / (g.shape[channel_dim] * d * d)
            grad_x = (dy * (w * n + 1)).addcmul_(z, dg).to(x_dtype)  # dy + u * n + z * dg, u = dy * weight
        return grad_x, grad_w, grad_b, None, None, None, None


def act_grn(x: Tensor, weight: Tensor, bias: Tensor, forward: Callable[[Tensor], Tensor], settings: OpSettings, *,
            channel_dim: int = -1, eps: float = 1e-6) -> Tensor:
    """GRN with a packed saved normalized input (see :class:`ActGRNFunction`).

    Args:
        x: the input, batch first, channels at ``channel_dim``, every other dim spatial.
        weight, bias: the module's ``C``-element affine parameters (any shape, e.g. HF's ``(1, 1, 1, C)``).
        forward: the module's own forward, run for the output (so it is the original's bit for bit); it must
            compute :func:`grn_reference` with the same ``channel_dim`` and ``eps``.
        settings: slot, bits and group size of the packed ``x / g``.
    """
    return ActGRNFunction.apply(x, weight, bias, forward, channel_dim, eps, settings)
