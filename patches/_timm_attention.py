"""Mixins for timm attention modules: the same forward, with the attention op saving q, k, v quantized.

Attach with ``act_hf.nn._base.convert(module, ActTimmAttentionMixin, slot=..., bits=...)`` (ViT-style
``timm.layers.Attention``) or ``convert(module, ActWindowAttentionMixin, ...)`` (Swin's ``WindowAttention``);
:func:`mixin_for` picks the mixin for a module. Each ``forward`` reproduces timm's (1.0.x) line by line and
replaces only the attention itself: ``F.scaled_dot_product_attention`` by :func:`act_sdpa` when
``self.fused_attn`` (ViT's default), the unfused block by :func:`act_eager_attention` otherwise (Swin's default:
timm marks its fused path experimental). Swin V2's scaled cosine attention (``swin_transformer_v2.WindowAttention``
and V2-CR's ``WindowMultiHeadAttention``) runs as :func:`act_cosine_attention`, which saves the normalized q and k
quantized with their norms exact; those two mixins apply only while the module's ``forward`` is the code they
reproduce (:data:`COSINE_ATTENTION_FORWARDS`). Out of training, without grad or under inference mode the original
``forward`` runs. Slots: ``<act_slot>:q``, ``:k``, ``:v``.

Swin's relative position bias is passed as the attention mask (it requires grad and gets its gradient); the
shift mask is passed as the per-window mask, so the eager scores are built with exactly timm's two additions
and the ``(num_windows, N, N)`` buffer is saved, not a per-image copy. On the fused Swin path timm itself adds
bias and shift mask into one ``(B*num_windows, heads, N, N)`` tensor, which is saved as given.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from act_hf.nn._base import ActModule, trains_with_grad
from act_hf.ops.attention import act_eager_attention, act_sdpa
from act_hf.ops.cosine_attention import act_cosine_attention, swin_v2_scale_and_bias
from act_hf.ops.linear import act_linear
from act_hf.patcher import code_fingerprint

try:
    import timm
    from timm.layers.attention import Attention, resolve_self_attn_mask
    from timm.models.swin_transformer import WindowAttention
    from timm.models.swin_transformer_v2 import WindowAttention as WindowAttentionV2
    from timm.models.swin_transformer_v2_cr import WindowMultiHeadAttention
except ImportError as exc:  # pragma: no cover - exercised only without timm
    raise ImportError(f"act_hf.patches._timm_attention needs timm >= 1.0: {exc}") from exc

if int(timm.__version__.split(".")[0]) < 1:
    raise ImportError(f"act_hf needs timm >= 1.0 for its attention mixins, found {timm.__version__}")

__all__ = ["COSINE_ATTENTION_FORWARDS", "ActTimmAttentionMixin", "ActWindowAttentionMixin", "ActWindowAttentionV2Mixin",
           "ActWindowMultiHeadAttentionMixin", "mixin_for"]

logger = logging.getLogger(__name__)


def _heads_first(qkv: Tensor, *, fused: bool) -> Tensor:
    """timm's ``qkv.permute(2, 0, 3, 1, 4)`` of a fused projection's ``(B, N, 3, heads, head_dim)``, a view of one
    dense copy of it (the projection's output, which nothing else holds, is freed), so that q, k and v are each
    quantized without a copy of their own (three copies a call before, one now). For eager attention
    (``fused`` false) the copy is contiguous in that order: its matmuls, in every chunk of the batch, then read q,
    k and v without copies of their own too. For SDPA (``fused``) it is laid out ``(3, B, N, heads, head_dim)``:
    SDPA's output takes q's layout, so the caller's ``transpose(1, 2).reshape(B, N, -1)`` of it stays a view, as
    in timm. The same values as timm's views."""
    if fused:
        return qkv.permute(2, 0, 1, 3, 4).contiguous().transpose(2, 3)
    return qkv.permute(2, 0, 3, 1, 4).contiguous()


class ActTimmAttentionMixin(ActModule):
    """For ``timm.layers.Attention`` (ViT, DeiT, ...): q, k, v saved quantized."""

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x, attn_mask=attn_mask, is_causal=is_causal)
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = _heads_first(self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim), fused=self.fused_attn)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)

        settings = self.act_base_settings()
        if self.fused_attn:
            x = act_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.,
                         is_causal=is_causal, settings=settings)
        else:
            # timm builds the bias from the scores tensor; q has the same dtype and device
            attn_bias = resolve_self_attn_mask(N, q, attn_mask, is_causal)
            x, _ = act_eager_attention(q, k, v, attn_bias, scaling=self.scale, scale_query=True,
                                       dropout_p=self.attn_drop.p, training=self.attn_drop.training,
                                       settings=settings, need_weights=False)

        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class ActWindowAttentionMixin(ActModule):
    """For Swin's ``WindowAttention``: q, k, v saved quantized; relative position bias still learns."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x, mask)
        B_, N, C = x.shape
        qkv = _heads_first(self.qkv(x).reshape(B_, N, 3, self.num_heads, -1), fused=self.fused_attn)
        q, k, v = qkv.unbind(0)

        settings = self.act_base_settings()
        if self.fused_attn:
            attn_mask = self._get_rel_pos_bias()
            if mask is not None:
                num_win = mask.shape[0]
                mask = mask.view(1, num_win, 1, N, N).expand(B_ // num_win, -1, self.num_heads, -1, -1)
                attn_mask = attn_mask + mask.reshape(-1, self.num_heads, N, N)
            x = act_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.,
                         settings=settings)
        else:
            x, _ = act_eager_attention(q, k, v, self._get_rel_pos_bias(), scaling=self.scale, scale_query=True,
                                       window_mask=mask, dropout_p=self.attn_drop.p,
                                       training=self.attn_drop.training, settings=settings, need_weights=False)

        x = x.transpose(1, 2).reshape(B_, N, -1)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class ActWindowAttentionV2Mixin(ActModule):
    """For Swin V2's ``WindowAttention``: scaled cosine attention through :func:`act_cosine_attention`; the
    ``F.linear`` that adds the q/v biases saves its input quantized through the ``qkv`` Linear's slot."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x, mask)
        B_, N, C = x.shape
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
            if self.qkv_bias_separate:
                qkv = self.qkv(x)
                qkv += qkv_bias
            elif isinstance(self.qkv, ActModule) and self.qkv.act_enabled(x):
                qkv = act_linear(x, self.qkv.weight, qkv_bias, self.qkv.act_settings("input"))
            else:
                qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        qkv = qkv.reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)

        logit_scale, relative_position_bias = swin_v2_scale_and_bias(
            self.logit_scale, self.cpb_mlp, self.relative_coords_table, self.relative_position_index, self.window_size,
            self.num_heads)
        x, _ = act_cosine_attention(q, k, v, logit_scale, relative_position_bias, window_mask=mask,
                                    dropout_p=self.attn_drop.p, training=self.attn_drop.training,
                                    settings=self.act_base_settings())

        x = x.transpose(1, 2).reshape(B_, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class ActWindowMultiHeadAttentionMixin(ActModule):
    """For Swin V2-CR's ``WindowMultiHeadAttention``: scaled cosine attention through :func:`act_cosine_attention`
    (the meta-MLP's positional encodings are computed before it, as timm does, so dropout draws keep their
    order)."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x, mask)
        Bw, L, C = x.shape
        qkv = self.qkv(x).view(Bw, L, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)

        logit_scale = torch.clamp(self.logit_scale.reshape(1, self.num_heads, 1, 1), max=math.log(1. / 0.01)).exp()
        x, _ = act_cosine_attention(query, key, value, logit_scale, self._relative_positional_encodings(),
                                    window_mask=mask, dropout_p=self.attn_drop.p, training=self.attn_drop.training,
                                    settings=self.act_base_settings())

        x = x.transpose(1, 2).reshape(Bw, L, -1)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


#: :func:`code_fingerprint` of the ``forward`` each cosine-attention mixin reproduces (timm 1.0.x); a module whose
#: forward differs keeps its own.
COSINE_ATTENTION_FORWARDS = {
    WindowAttentionV2: ("3c2c55bc64155095", ActWindowAttentionV2Mixin),
    WindowMultiHeadAttention: ("2272de5d5686212c", ActWindowMultiHeadAttentionMixin),
}


def mixin_for(module: nn.Module) -> type | None:
    """The act_hf mixin for a timm attention module, or ``None`` if it is not one this file handles.

    Exact classes only: subclasses may override ``forward`` (timm's ``AttentionRope`` etc. are different).
    """
    cls = getattr(type(module), "act_original_class", None) or type(module)
    if cls is Attention:
        return ActTimmAttentionMixin
    if cls is WindowAttention:
        return ActWindowAttentionMixin
    fingerprint, mixin = COSINE_ATTENTION_FORWARDS.get(cls, (None, None))
    if mixin is not None and code_fingerprint(cls.forward) == fingerprint:
        return mixin
    return None
