"""timm models: ResNet, ViT/DeiT, Swin, ConvNeXt, EfficientNet (and every timm model built from the same
layers).

timm passes ``norm_layer``/``act_layer`` into constructors, so these rules walk the built modules: timm's
own ``LayerNorm`` (plain F.layer_norm unless fast-norm is on), ``LayerNorm2d`` (channels-first ConvNeXt
norm), ``BatchNormAct2d`` (EfficientNet: BN + activation fused, In-Place ABN form when the activation is
invertible), timm's activation classes (few-bit), and the attention modules of ViT and Swin. The classifier
named by ``pretrained_cfg["classifier"]`` stays exact.
"""

from __future__ import annotations

from torch import nn

from act_hf.patcher import Rule, patch_modules, register_patch

__all__ = ["patch_timm"]

_TIMM_ACTIVATIONS = {  # timm.layers.activations class name -> few-bit table
    "Swish": "silu",
    "Mish": "mish",
    "Sigmoid": "sigmoid",
    "Tanh": "tanh",
    "HardSwish": "hardswish",
    "HardSigmoid": "hardsigmoid",
    "GELU": "gelu",
    "GELUTanh": "gelu_tanh",
    "QuickGELU": "quick_gelu",
}


def _is_timm(m: nn.Module, name: str) -> bool:
    return type(m).__name__ == name and type(m).__module__.startswith("timm.")


def timm_rules() -> list[Rule]:
    """Rules for timm's layers, in front of the generic torch ones."""
    from act_hf.nn import activation, norm

    from . import _timm_attention

    ln_attrs = lambda m, c: {"act_norm_context": c.norm_context}
    return [
        Rule("attention", lambda m: _timm_attention.mixin_for(m) is not None, _timm_attention.mixin_for),
        Rule("norm", lambda m: _is_timm(m, "LayerNorm2d"), lambda m: norm.ActLayerNorm2dMixin, attrs=ln_attrs),
        Rule("norm", lambda m: _is_timm(m, "LayerNorm") and not getattr(m, "_fast_norm", False),
             lambda m: norm.ActLayerNormMixin, attrs=ln_attrs),
        Rule("norm", lambda m: _is_timm(m, "BatchNormAct2d"), lambda m: norm.ActBatchNormAct2dMixin),
        Rule("activation", lambda m: type(m).__module__.startswith("timm.") and type(m).__name__ in _TIMM_ACTIVATIONS,
             lambda m: activation.ActActivationMixin,
             attrs=lambda m, c: {"act_fn_name": _TIMM_ACTIVATIONS[type(m).__name__]}, bits=lambda c: c.derivative_bits),
    ]


def timm_head_paths(model: nn.Module) -> list[str]:
    """The classifier path(s) named by timm's ``pretrained_cfg`` (``head.fc``, ``fc``, ``classifier``...)."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    classifier = cfg.get("classifier", "")
    paths = [classifier] if isinstance(classifier, str) else list(classifier)
    names = dict(model.named_modules())
    return [p for p in paths if p and p in names]


@register_patch("timm:ResNet", "timm:VisionTransformer", "timm:SwinTransformer", "timm:ConvNeXt",
                "timm:EfficientNet")
def patch_timm(model, config) -> list[str]:
    return patch_modules(model, config, rules=timm_rules(), head_paths=timm_head_paths(model))
