"""HF vision models: ViT, Swin, Swin V2 (and Swin2SR, built from its layers), ConvNeXt (V1 and V2).

ViT and Swin: Linear, LayerNorm, GELU, dropout and attention (Swin's relative position bias and shift mask
reach act_hf's attention as an additive mask). Swin V2: the same, its scaled cosine attention through
:func:`act_hf.ops.cosine_attention.act_cosine_attention`. ConvNeXt: its ``ConvNextLayerNorm`` is channels-last
(a plain LayerNorm) or channels-first (permuted, the timm LayerNorm2d form); depthwise convs and pointwise
Linears save quantized inputs; V2's Global Response Norm keeps its input packed (:mod:`act_hf.ops.grn`). The
classifier stays exact.
"""

from torch import Tensor

from act_hf.nn._base import ActModule
from act_hf.ops.cosine_attention import act_cosine_attention, swin_v2_scale_and_bias
from act_hf.patcher import Rule, code_fingerprint, register_patch

from ._hf import patch_hf


class ActSwinv2SelfAttentionMixin(ActModule):
    """transformers' ``Swinv2SelfAttention`` (and ``Swin2SRSelfAttention``, the same code) with its scaled cosine
    attention through :func:`act_cosine_attention` (slots ``<path>:q``, ``:k``, ``:v``); the shift mask is added
    twice, as transformers adds it. The rest is transformers' forward step for step; the rule converts a module
    only when its ``forward`` is the code this reproduces (:data:`SWINV2_SELF_ATTENTION_FORWARD`)."""

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                output_attentions: bool | None = False) -> tuple[Tensor, ...]:
        if not self.act_enabled(hidden_states):
            return super().forward(hidden_states, attention_mask, output_attentions)
        batch_size = hidden_states.shape[0]
        heads, head_size = self.num_attention_heads, self.attention_head_size
        query_layer = self.query(hidden_states).view(batch_size, -1, heads, head_size).transpose(1, 2)
        key_layer = self.key(hidden_states).view(batch_size, -1, heads, head_size).transpose(1, 2)
        value_layer = self.value(hidden_states).view(batch_size, -1, heads, head_size).transpose(1, 2)

        logit_scale, relative_position_bias = swin_v2_scale_and_bias(
            self.logit_scale, self.continuous_position_bias_mlp, self.relative_coords_table, self.relative_position_index,
            self.window_size, heads)

        context_layer, attention_probs = act_cosine_attention(
            query_layer, key_layer, value_layer, logit_scale, relative_position_bias,
            window_mask=attention_mask, window_mask_adds=2, dropout_p=self.dropout.p,
            training=self.dropout.training, settings=self.act_base_settings())

        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return (context_layer, attention_probs) if output_attentions else (context_layer,)


#: :func:`code_fingerprint` of the ``Swinv2SelfAttention.forward`` that :class:`ActSwinv2SelfAttentionMixin`
#: reproduces (transformers 5.x; ``Swin2SRSelfAttention.forward`` is the same code).
SWINV2_SELF_ATTENTION_FORWARD = "65e8b4260fc5b067"


def _is_swinv2_self_attention(m) -> bool:
    return type(m).__name__ in ("Swinv2SelfAttention", "Swin2SRSelfAttention") \
        and code_fingerprint(type(m).forward) == SWINV2_SELF_ATTENTION_FORWARD


def _convnext_rules() -> list[Rule]:
    from act_hf.nn import norm

    def is_convnext_ln(m):
        return type(m).__name__ in ("ConvNextLayerNorm", "ConvNextV2LayerNorm")

    return [
        Rule("norm", lambda m: is_convnext_ln(m) and m.data_format == "channels_first",
             lambda m: norm.ActLayerNorm2dMixin, attrs=lambda m, c: {"act_norm_context": c.norm_context}),
        Rule("norm", lambda m: is_convnext_ln(m) and m.data_format == "channels_last",
             lambda m: norm.ActLayerNormMixin, attrs=lambda m, c: {"act_norm_context": c.norm_context}),
    ]


@register_patch("vit", "swin")
def patch_vit(model, config) -> list[str]:
    return patch_hf(model, config)


@register_patch("convnext", "convnextv2")
def patch_convnext(model, config) -> list[str]:
    return patch_hf(model, config, rules=_convnext_rules(), attention=False)


@register_patch("swinv2", "swin2sr")
def patch_swinv2(model, config) -> list[str]:
    return patch_hf(model, config, rules=[
        Rule("attention", _is_swinv2_self_attention, lambda m: ActSwinv2SelfAttentionMixin)], attention=False)
