"""HF vision models: ViT, Swin, ConvNeXt (V1 and V2).

ViT and Swin: Linear, LayerNorm, GELU, dropout and attention (Swin's relative position bias and shift mask
reach act_hf's attention as an additive mask). ConvNeXt: its ``ConvNextLayerNorm`` is channels-last
(a plain LayerNorm) or channels-first (permuted, the timm LayerNorm2d form); depthwise convs and pointwise
Linears save quantized inputs; V2's Global Response Norm keeps its input packed (:mod:`act_hf.ops.grn`). The
classifier stays exact.
"""

from act_hf.patcher import Rule, register_patch

from ._hf import patch_hf


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
