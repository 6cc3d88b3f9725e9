"""Normalized linear attention (EfficientViT's ReLU linear attention) with a quantized saved context.

The op computes, exactly as timm's ``LiteMLA._attn`` writes it (same matmuls, same order: bit-identical)::

    kv = k^T @ v                  # (..., d, e + 1): v's last column feeds the normalizer (EfficientViT pads ones)
    full = q @ kv                 # (..., N, e + 1)
    out = full[..., :-1] / (full[..., -1:] + eps)

Why an op and not the fallback's saved-tensor hooks
----------------------------------------------------
Autograd keeps ``q``, ``k``, ``v``, the numerator and the denominator ``den = full[..., -1:] + eps``; the hooks
quantize each per group. ``out`` does not change when a query row is scaled, so rows of small ``q`` (most of
the ReLU kernel zeroed) have a small ``den``, and every gradient through them is divided by it: the rounding
error of a group, set by its largest row, is divided by the small row's denominator. Whole-gradient relative
error (``act_hf.patch(timm.create_model(name), bits=b)``, batch 2, mean of the draws), the hooks -> this op:

    efficientvit_b0, 128 x 128, 3 draws: 8 bits 0.029 -> 0.017, 4 bits 0.54 -> 0.27, 3 bits 1.79 -> 0.56
    efficientvit_b0, 224 x 224, 2 draws: 8 bits 0.049 -> 0.015, 4 bits 0.51 -> 0.25, 3 bits 3.18 -> 0.47
    efficientvit_l1, 224 x 224, 2 draws: 8 bits 0.024 -> 0.023, 4 bits 0.28 -> 0.23, 3 bits 0.65 -> 0.47

with slightly fewer saved bytes in every row (5.41 -> 5.40 MiB for b0 at 224 and 3 bits; 26.17 -> 26.02 for
l1). The rest of those errors is the nets' convolutions, norms and activations.

What is kept
------------
* ``den`` exact: one value per query row and head, ``1 / e`` of ``out``'s size;
* quantized through the context store, each rounded independently: the row-normalized queries ``a = q / den``
  (slot ``<slot>:q``; bounded, as ``a . kv[..., -1] <= 1``, where ``q`` itself spans the small rows and the
  large ones in a group), ``k`` (``:k``), ``v`` (``:v``) and ``out`` (``:out``).
  ``kv = k^T v`` is recomputed from the packed ``k`` and ``v``: kept exact, its ``d x (e + 1)`` per head is larger
  than the packed queries at EfficientViT's resolutions.

With ``W = kv[..., :-1]``, ``c = kv[..., -1:]`` and ``s = (g * out).sum(-1)`` for the upstream gradient ``g``::

    grad_q  = (g @ W^T - s c^T) / den
    grad_W  = a^T @ g                  grad_c = -a^T @ s
    grad_k  = v @ grad_kv^T            grad_v = k @ grad_kv

Each term is linear in each packed tensor and no two factors of a product share a rounding, so every gradient
is unbiased; ``den`` enters only as the exact divisor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..compress import dequantize
from ..errors import ActHFTypeError
from ._saving import OpSettings, load_context, save_context
from .attention import compress_role

__all__ = ["ActLinearAttentionFunction", "act_linear_attention"]


def _forward(q: Tensor, k: Tensor, v: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(out, den)``, computed as timm computes them."""
    kv = k.transpose(-1, -2) @ v
    full = q @ kv
    den = full[..., -1:] + eps
    return full[..., :-1] / den, den


class ActLinearAttentionFunction(torch.autograd.Function):
    """``out = (q @ (k^T v))[..., :-1] / ((q @ (k^T v))[..., -1:] + eps)``; see the module docstring for what it
    keeps. ``q, k: (..., N, d)``, ``v: (..., N, e + 1)``, one floating dtype."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, eps: float, settings: OpSettings) -> Tensor:
        out, den = _forward(q, k, v, eps)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        save_context(
            ctx,
            compress_role(q / den, settings, "q") if need_k or need_v else None,
            compress_role(k, settings, "k") if need_q or need_v else None,
            compress_role(v, settings, "v") if need_q or need_k else None,
            compress_role(out, settings, "out"),
            den,
        )
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed_q, packed_k, packed_v, packed_out, den = load_context(ctx)
        dtype = den.dtype
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        unpack = lambda p: dequantize(p, compute) if p is not None else None
        k, v = unpack(packed_k), unpack(packed_v)
        g, den = grad_out.to(compute), den.to(compute)
        s = (g * unpack(packed_out)).sum(-1, keepdim=True)
        grad_q = grad_k = grad_v = None
        if ctx.needs_input_grad[0]:
            kv = k.transpose(-1, -2) @ v
            W, c = kv[..., :-1], kv[..., -1:]
            grad_q = ((g @ W.transpose(-1, -2) - s * c.transpose(-1, -2)) / den).to(dtype)
        if packed_q is not None:
            a = unpack(packed_q)
            grad_kv = torch.cat([a.transpose(-1, -2) @ g, -(a.transpose(-1, -2) @ s)], dim=-1)
            if ctx.needs_input_grad[1]:
                grad_k = (v @ grad_kv.transpose(-1, -2)).to(dtype)
            if ctx.needs_input_grad[2]:
                grad_v = (k @ grad_kv).to(dtype)
        return grad_q, grad_k, grad_v, None, None


def act_linear_attention(q: Tensor, k: Tensor, v: Tensor, eps: float, settings: OpSettings) -> Tensor:
    """Normalized linear attention with a packed context (:class:`ActLinearAttentionFunction`); without anything
    to save for (no input needs a gradient, or grad mode off) the plain computation."""
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        return _forward(q, k, v, eps)[0]
    if not (q.dtype == k.dtype == v.dtype and q.is_floating_point()):
        raise ActHFTypeError(f"act_linear_attention: q, k, v must share one floating dtype, got {q.dtype}, "
                             f"{k.dtype}, {v.dtype}")
    return ActLinearAttentionFunction.apply(q, k, v, eps, settings)
