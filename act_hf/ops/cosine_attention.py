"""Scaled cosine attention (Swin V2) with a quantized saved context.

The op computes, exactly as transformers' ``Swinv2SelfAttention`` and timm's Swin V2 window attentions write it
(same ops, same order: bit-identical, under autocast too)::

    scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1)^T
    scores = scores * logit_scale           # the model's clamp(logit_scale).exp(), per head; learned
    scores = scores + bias                  # 16 * sigmoid(continuous position bias); learned
    scores = scores + window_mask           # Swin's shifted-window mask, per window (transformers adds it twice)
    out = dropout(softmax(scores)) @ v

Why an op and not autograd's saves
----------------------------------
Autograd keeps ``q``, ``k``, their norms, the normalized ``q`` and ``k``, the cosine scores (``S x S`` per head,
for ``logit_scale``'s gradient), the softmax output (``S x S`` again) and ``v``; the fallback's hooks quantize
each. The op keeps three packed tensors and the norms, and recomputes the rest. Saved bytes of one training
forward through the hooks -> the op (``track_saved``; random init, batch 2, mean whole-gradient relative error of
2 draws unchanged within draw noise):

    transformers swinv2-tiny, 224 x 224:   3 bits 28.05 -> 22.80 MiB (error 0.342 -> 0.336), 8 bits 72.41 -> 52.40
    timm swinv2_tiny_window8_256:          3 bits 38.92 -> 31.41 MiB (0.203 -> 0.203),       8 bits 100.09 -> 70.07
    timm swinv2_cr_tiny_ns_224:            3 bits 34.35 -> 27.96 MiB (0.229 -> 0.228),       8 bits 84.83 -> 63.87

The rest of those errors is the nets' linears, norms and activations.

What is kept
------------
* the row norms of ``q`` and ``k`` exact (one value per row and head, ``1 / head_dim`` of ``q``'s size): they are
  the divisors of ``q``'s and ``k``'s gradients (a row of small norm would otherwise divide its group's rounding
  by that norm, as in :mod:`act_hf.ops.linear_attention`);
* the *normalized* ``q`` and ``k`` quantized (slots ``<slot>:q``, ``<slot>:k``): unit rows, so every row of a
  group is rounded on the same scale; ``v`` quantized (``<slot>:v``);
* ``logit_scale``, ``bias`` and the window mask as given (per head or per window, shared by the batch), and the
  1-bit keep mask with dropout.

Backward recomputes the probabilities from the dequantized unit rows, its GEMMs in the forward's dtype and the
softmax in fp32 (:func:`~act_hf.ops.attention.math_attention`, as the models run them under autocast), takes the
gradients of the unit rows, the scale
and the bias by autograd on that recomputation, and maps the unit rows' gradients through ``F.normalize``'s
backward with the exact norms: ``grad_q = (g - u (u . g)) / max(|q|, eps)``, the radial term dropped where
``|q| < eps`` as ``clamp_min`` drops it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compress import dequantize, unpack_mask
from ..errors import ActHFTypeError, ActHFValueError
from ._saving import OpSettings, load_context, save_context
from .attention import add_window_mask, compress_role, grads_of, math_attention, pack_keep_mask

__all__ = ["NORMALIZE_EPS", "ActCosineAttentionFunction", "act_cosine_attention", "swin_v2_scale_and_bias"]

#: ``F.normalize``'s default ``eps``, the one every Swin V2 uses.
NORMALIZE_EPS = 1e-12


def _forward(q: Tensor, k: Tensor, v: Tensor, logit_scale: Tensor, bias: Tensor | None, window_mask: Tensor | None,
             window_mask_adds: int, dropout_p: float, training: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                                Tensor]:
    """``(out, weights, q_unit, k_unit, q_norm, k_norm)``, computed as the models compute them (``F.normalize``
    is ``x / x.norm(2, -1, keepdim=True).clamp_min(eps).expand_as(x)``)."""
    q_norm = q.norm(2.0, -1, keepdim=True)
    k_norm = k.norm(2.0, -1, keepdim=True)
    q_unit = q / q_norm.clamp_min(NORMALIZE_EPS).expand_as(q)
    k_unit = k / k_norm.clamp_min(NORMALIZE_EPS).expand_as(k)
    w = q_unit @ k_unit.transpose(-2, -1)
    w = w * logit_scale
    if bias is not None:
        w = w + bias
    if window_mask is not None:
        for _ in range(window_mask_adds):
            w = add_window_mask(w, window_mask)
    w = F.softmax(w, dim=-1)
    w = F.dropout(w, p=dropout_p, training=training)
    return w @ v, w, q_unit, k_unit, q_norm, k_norm


def _normalize_backward(unit: Tensor, norm: Tensor, grad_unit: Tensor) -> Tensor:
    """``F.normalize``'s backward at ``x = unit * max(norm, eps)`` for the upstream gradient ``grad_unit``."""
    radial = (unit * grad_unit).sum(-1, keepdim=True) * (norm >= NORMALIZE_EPS)
    return (grad_unit - unit * radial) / norm.clamp_min(NORMALIZE_EPS)


class ActCosineAttentionFunction(torch.autograd.Function):
    """Swin V2's scaled cosine attention; see the module docstring for what it keeps. Returns the output and the
    (non-differentiable) attention weights after dropout."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, logit_scale: Tensor, bias: Tensor | None,
                window_mask: Tensor | None, window_mask_adds: int, dropout_p: float, training: bool,
                settings: OpSettings) -> tuple[Tensor, Tensor]:
        out, w, q_unit, k_unit, q_norm, k_norm = _forward(q, k, v, logit_scale, bias, window_mask, window_mask_adds,
                                                          dropout_p, training)
        need_q, need_k, _, need_s, need_b, need_m = ctx.needs_input_grad[:6]
        need_scores = need_q or need_k or need_s or need_b or need_m
        dropped = training and dropout_p > 0.0
        save_context(
            ctx,
            compress_role(q_unit, settings, "q"),
            compress_role(k_unit, settings, "k"),
            compress_role(v, settings, "v") if need_scores else None,
            q_norm if need_q else None,
            k_norm if need_k else None,
            logit_scale,
            bias,
            window_mask,
            pack_keep_mask(w, settings) if dropped else None,
        )
        ctx.shapes = (v.shape, w.shape)
        ctx.dtype = q.dtype
        ctx.args = (window_mask_adds, dropout_p if dropped else 0.0)
        ctx.mark_non_differentiable(w)
        # no zeros for the weights' gradient: autograd would fill an (B, H, L, S) tensor for every backward
        ctx.set_materialize_grads(False)
        return out, w

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor | None, _grad_weights: Tensor | None):
        if grad_out is None:  # the output took no part in the loss
            return (None,) * 10
        packed_q, packed_k, packed_v, q_norm, k_norm, scale, bias, mask, keep_payload = load_context(ctx)
        window_mask_adds, dropout_p = ctx.args
        v_shape, w_shape = ctx.shapes
        need = ctx.needs_input_grad
        # the unit rows and v decoded in the dtype the forward's GEMMs ran in (bf16 under autocast), as the
        # recomputation runs them (math_attention); the normalize backward in fp32 for half ones
        compute = torch.float32 if packed_q.dtype in (torch.float16, torch.bfloat16) else packed_q.dtype
        q_unit, k_unit = dequantize(packed_q), dequantize(packed_k)
        # only dv wanted: v's values do not enter it, only its shape
        v = dequantize(packed_v, q_unit.dtype) if packed_v is not None else q_unit.new_zeros(v_shape)
        keep = unpack_mask(keep_payload, w_shape) if keep_payload is not None else None
        leaf = lambda t, wanted: t.detach().requires_grad_(True) if t is not None and wanted else t
        with torch.enable_grad():
            leaves = [leaf(q_unit, need[0]), leaf(k_unit, need[1]), leaf(v, need[2]), leaf(scale, need[3]),
                      leaf(bias, need[4]), leaf(mask, need[5])]
            out = math_attention(leaves[0], leaves[1], leaves[2], (leaves[4],), keep, dropout_p, leaves[3],
                                 window_mask=leaves[5], window_mask_adds=window_mask_adds)
            g_qu, g_ku, dv, ds, db, dm = grads_of(out, leaves, grad_out)
        cast = lambda t: t.to(ctx.dtype) if t is not None else None
        wide = lambda *tensors: [t.to(compute) for t in tensors]
        dq = _normalize_backward(*wide(q_unit, q_norm, g_qu)) if g_qu is not None else None
        dk = _normalize_backward(*wide(k_unit, k_norm, g_ku)) if g_ku is not None else None
        return cast(dq), cast(dk), cast(dv), ds, db, dm, None, None, None, None


def act_cosine_attention(q: Tensor, k: Tensor, v: Tensor, logit_scale: Tensor, bias: Tensor | None = None, *,
                         settings: OpSettings, window_mask: Tensor | None = None, window_mask_adds: int = 1,
                         dropout_p: float = 0.0, training: bool = True) -> tuple[Tensor, Tensor]:
    """Swin V2's scaled cosine attention, saving the normalized ``q`` and ``k`` and ``v`` quantized.

    Args:
        q, k, v: ``(B, H, N, D)``, ``(B, H, N, D)``, ``(B, H, N, Dv)``, one floating dtype.
        logit_scale: the multiplier of the cosines as the model computes it (``clamp(logit_scale, max).exp()``),
            broadcastable to ``(B, H, N, N)``; may require grad.
        bias: additive, broadcastable to ``(B, H, N, N)`` (Swin V2's ``16 * sigmoid`` position bias), or ``None``.
        settings: base slot, default bits and group size (roles ``:q``, ``:k``, ``:v``).
        window_mask: Swin's shifted-window mask ``(num_windows, N, N)``, added to the scores viewed
            ``(-1, num_windows, H, N, N)`` (batch index = image * num_windows + window), or ``None``.
        window_mask_adds: how many times the window mask is added (transformers' ``Swinv2SelfAttention`` adds
            it twice; timm once).
        dropout_p: dropout on the probabilities (``F.dropout(p, training)``).
        training: passed to ``F.dropout``.

    Returns:
        ``(out, weights)``: ``(B, H, N, Dv)`` and the probabilities after dropout, not differentiable.

    Raises:
        ActHFTypeError: ``q``, ``k``, ``v`` of different or non-floating dtypes.
        ActHFValueError: ``dropout_p`` outside ``[0, 1)``, ``window_mask_adds`` below 1.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ActHFValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if isinstance(window_mask_adds, bool) or not isinstance(window_mask_adds, int) or window_mask_adds < 1:
        raise ActHFValueError(f"window_mask_adds must be a positive integer, got {window_mask_adds!r}")
    if not (q.dtype == k.dtype == v.dtype and q.is_floating_point()):
        raise ActHFTypeError(f"act_cosine_attention: q, k, v must share one floating dtype, got {q.dtype}, "
                             f"{k.dtype}, {v.dtype}")
    inputs = (q, k, v, logit_scale, bias, window_mask)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
        return _forward(*inputs, window_mask_adds, float(dropout_p), bool(training))[:2]
    return ActCosineAttentionFunction.apply(*inputs, window_mask_adds, float(dropout_p), bool(training), settings)


def swin_v2_scale_and_bias(logit_scale: Tensor, cpb_mlp: torch.nn.Module, coords_table: Tensor,
                           position_index: Tensor, window_size: tuple[int, int],
                           heads: int) -> tuple[Tensor, Tensor]:
    """Swin V2's multiplier of the cosines, ``clamp(logit_scale, max=log 100).exp()``, and its continuous position
    bias ``16 * sigmoid(cpb_mlp(coords_table)[position_index])`` as ``(1, heads, area, area)``: the ``logit_scale``
    and ``bias`` arguments of :func:`act_cosine_attention`, computed as transformers' ``Swinv2SelfAttention`` and
    timm's Swin V2 ``WindowAttention`` compute them (same ops, same order)."""
    scale = torch.clamp(logit_scale, max=math.log(1.0 / 0.01)).exp()
    table = cpb_mlp(coords_table).view(-1, heads)
    area = window_size[0] * window_size[1]
    bias = table[position_index.view(-1)].view(area, area, -1).permute(2, 0, 1).contiguous()
    return scale, (16 * torch.sigmoid(bias)).unsqueeze(0)
