"""HF vision models: ViT, Swin, Swin V2 (and Swin2SR, built from its layers), ConvNeXt (V1 and V2), and, for
models on the generic fallback (:func:`vision_conv_rules`), the TF-padded conv layers of MobileNet V1 / V2 and
BiT's weight-standardized convs and max pool.

ViT and Swin: Linear, LayerNorm, GELU, dropout and attention (Swin's relative position bias and shift mask reach
act_hf's attention as an additive mask; under SDPA as two parts, not their batch-sized sum). Swin V2: the same, its
scaled cosine attention through :func:`act_hf.ops.cosine_attention.act_cosine_attention`. ConvNeXt: its
``ConvNextLayerNorm`` is channels-last (a plain LayerNorm) or channels-first (permuted, the timm LayerNorm2d form);
depthwise convs, pointwise Linears and V1's layer scale save quantized inputs; V2's Global Response Norm keeps its
input packed (:mod:`act_hf.ops.grn`). The classifier stays exact.
"""

from torch import Tensor, nn

from act_hf.nn._base import ActModule
from act_hf.nn.activation import activation_of_owned
from act_hf.nn.linear import same_pad
from act_hf.ops.attention import act_sdpa
from act_hf.ops.cosine_attention import act_cosine_attention, swin_v2_scale_and_bias
from act_hf.ops.linear import act_channel_scale, act_conv, act_standardized_conv
from act_hf.ops.pooling import act_max_pool
from act_hf.patcher import Rule, callee, code_fingerprint, register_patch

from ._hf import patch_hf


class ActSwinAttentionMixin(ActModule):
    """transformers' ``SwinAttention`` in a shifted-window block under act_hf's SDPA: transformers adds the
    relative position bias ``(1, heads, N, N)`` to the shift mask of every image, ``(batch * windows, 1, N, N)``,
    and SDPA's context kept that sum, as large as a batch of attention matrices in fp32; here :func:`act_sdpa`
    gets the two parts (``window_mask``), makes the same sum for SDPA and keeps only the parts. Blocks without a
    shift, other attention functions and ``output_attentions`` run transformers' forward (dispatching to act_hf's
    attention functions as before). The rule converts a module only when its ``forward`` is the code this copies
    (:data:`SWIN_ATTENTION_FORWARD`)."""

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs):
        from ._hf_attention import ACT_SDPA

        if attention_mask is None or self.config._attn_implementation != ACT_SDPA or not self.act_enabled(
                hidden_states) or kwargs.get("output_attentions", False):
            return super().forward(hidden_states, attention_mask, **kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        attn_output = act_sdpa(query_states, key_states, value_states, self.relative_position_bias(),
                               self.attention_dropout if self.training else 0.0, False, self.scaling,
                               settings=self.act_base_settings(), window_mask=attention_mask)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), None


#: :func:`code_fingerprint` of the ``SwinAttention.forward`` that :class:`ActSwinAttentionMixin` reproduces
#: (transformers 5.x).
SWIN_ATTENTION_FORWARD = "8e12eaf56b5c29f7"


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


def _tf_padding(features: Tensor, conv: nn.Conv2d, dilated: bool) -> tuple[int, int, int, int]:
    """The padding transformers' ``apply_tf_padding`` gives ``features`` before ``conv``, in ``F.pad``'s form (the
    odd pixel after): TF's SAME padding without dilation, which MobileNetV2's then multiplies by the dilation
    (``dilated``) and MobileNetV1's does not."""
    left, right, top, bottom = same_pad(features, conv.kernel_size, conv.stride, (1, 1))
    dh, dw = conv.dilation if dilated else (1, 1)
    return left * dw, right * dw, top * dh, bottom * dh


class ActTFPaddedConvLayerMixin(ActModule):
    """transformers' ``MobileNetV1ConvLayer`` / ``MobileNetV2ConvLayer`` (conv, BatchNorm, activation) with
    ``config.tf_padding``: the original pads the input with ``F.pad`` and the conv keeps the padded copy, which
    the ops before cannot describe; here the converted conv pads it inside (:func:`act_conv`'s ``pad``) and keeps
    the input before the padding, where a BatchNorm and ReLU6 before it already describe it (:mod:`act_hf.derived`):
    the same output, bit for bit. The rule converts a layer only when its ``forward`` and the ``apply_tf_padding``
    it calls are the code this reproduces (:data:`TF_PADDED_CONV_LAYER_FORWARD`, :data:`TF_PADDINGS`); with its
    conv left unconverted (excluded), the layer runs its own forward."""

    act_tf_pad_dilated: bool = False

    def forward(self, features: Tensor) -> Tensor:
        conv = self.convolution
        if not (self.config.tf_padding and isinstance(conv, ActModule) and conv.act_enabled(features)) \
                or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            return super().forward(features)
        pad = _tf_padding(features, conv, self.act_tf_pad_dilated)
        features = act_conv(features, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups,
                            conv.act_settings("input"), pad=pad if any(pad) else None)
        if self.normalization is not None:
            features = self.normalization(features)
        if self.activation is not None:
            features = self.activation(features)
        return features


#: :func:`code_fingerprint` of the ``forward`` of transformers' ``MobileNetV1ConvLayer`` and
#: ``MobileNetV2ConvLayer`` (the same code, transformers 5.x) that :class:`ActTFPaddedConvLayerMixin` reproduces
TF_PADDED_CONV_LAYER_FORWARD = "9d7e48ef81291039"
#: :func:`code_fingerprint` of the ``apply_tf_padding`` that forward calls -> whether it multiplies the padding by
#: the dilation (MobileNetV2's does, MobileNetV1's does not)
TF_PADDINGS = {"2466309a32df1703": False, "97fd8e87e4d6c80f": True}


def _tf_padding_dilated(m: nn.Module) -> bool | None:
    """For a layer :class:`ActTFPaddedConvLayerMixin` reproduces, whether its padding is times the dilation;
    else ``None``."""
    if type(m).__name__ not in ("MobileNetV1ConvLayer", "MobileNetV2ConvLayer") \
            or not isinstance(getattr(m, "convolution", None), nn.Conv2d):
        return None
    forward = type(m).forward
    try:
        if code_fingerprint(forward) != TF_PADDED_CONV_LAYER_FORWARD:
            return None
        return TF_PADDINGS.get(code_fingerprint(callee(forward, "apply_tf_padding")))
    except (OSError, TypeError):  # the callee missing or without source
        return None


class ActWeightStandardizedConvMixin(ActModule):
    """transformers' ``WeightStandardizedConv2d`` (BiT, and the BiT backbones of ViT-hybrid and DPT-hybrid): timm's
    ``StdConv2d`` / ``StdConv2dSame`` in one class, TF's SAME padding in a ``DynamicPad2d`` module. Through
    :func:`act_standardized_conv`, as timm's: the input packed before the padding (slot ``<path>:input``) and the
    standardized weight made again in backward; unconverted, the fallback kept that weight exact, a weight-sized
    tensor per conv (BiT-50, bf16: 48.6 MiB a step). The rule converts a conv only when its ``forward`` and its pad
    module's code are the code this reproduces (:data:`WEIGHT_STANDARDIZED_CONV_CODE`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x) or self.padding_mode != "zeros" or isinstance(self.padding, str) \
                or (self.pad is not None and self.pad.value != 0):
            return super().forward(x)
        pad = None if self.pad is None else same_pad(x, self.pad.kernel_size, self.pad.stride, self.pad.dilation)
        return act_standardized_conv(x, self.weight, None, self.bias, 1.0, self.eps, self.stride, self.padding,
                                     self.dilation, self.groups, self.act_settings("input"),
                                     pad=pad if pad is not None and any(pad) else None)


#: :func:`code_fingerprint` of the ``forward`` of transformers' ``WeightStandardizedConv2d`` and of the
#: ``forward`` and ``__init__`` (its padding arithmetic) of its ``DynamicPad2d`` (transformers 5.x)
WEIGHT_STANDARDIZED_CONV_CODE = ("3873f837b9532198", "055128a899ec4f4b", "0ce3fb0f67bfa15b")


def _is_weight_standardized_conv(m: nn.Module) -> bool:
    if type(m).__name__ != "WeightStandardizedConv2d" or not isinstance(m, nn.Conv2d):
        return False
    pad_class = callee(type(m).forward, "DynamicPad2d")
    if not isinstance(pad_class, type) or (m.pad is not None and type(m.pad) is not pad_class):
        return False
    try:
        code = (code_fingerprint(type(m).forward), code_fingerprint(pad_class.forward),
                code_fingerprint(pad_class.__init__))
    except (OSError, TypeError):  # without source
        return False
    return code == WEIGHT_STANDARDIZED_CONV_CODE


class ActBitMaxPoolMixin(ActModule):
    """transformers' ``BitMaxPool2d`` (its ``pad`` module, then ``F.max_pool2d``) through :func:`act_max_pool`:
    the argmax position in each window at a few bits (slot ``<path>:indices``) instead of the int64 indices the
    original saves (BiT-50 at 224 x 224: 1.5 MiB a sample). Converted only when its ``forward`` is the code this
    reproduces (:data:`BIT_MAX_POOL_FORWARD`)."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.return_indices or not self.act_enabled(hidden_states):
            return super().forward(hidden_states)
        return act_max_pool(self.pad(hidden_states), 2, self.kernel_size, self.stride, self.padding, self.dilation,
                            self.ceil_mode, settings=self.act_settings("indices"))


#: :func:`code_fingerprint` of ``BitMaxPool2d.forward`` (transformers 5.x)
BIT_MAX_POOL_FORWARD = "3ee417f144ff4845"


def _is_bit_max_pool(m: nn.Module) -> bool:
    if type(m).__name__ != "BitMaxPool2d" or not isinstance(m, nn.MaxPool2d):
        return False
    try:
        return code_fingerprint(type(m).forward) == BIT_MAX_POOL_FORWARD
    except (OSError, TypeError):  # without source
        return False


def _regnet_se_gate(m: nn.Module, x: Tensor) -> Tensor:
    """transformers' ``RegNetSELayer``: its pooler, then its conv - ReLU - conv - sigmoid attention."""
    return m.attention(m.pooler(x))


#: :func:`code_fingerprint` of the ``RegNetSELayer.forward`` whose gate :func:`_regnet_se_gate` computes
#: (transformers 5.x).
REGNET_SE_FORWARD = "11d2ba8c1c564c45"


def vision_conv_rules() -> list[Rule]:
    """Rules for HF vision conv nets on the generic fallback: MobileNet V1 / V2's TF-padded conv layers
    (:class:`ActTFPaddedConvLayerMixin`), BiT's weight-standardized convs (:class:`ActWeightStandardizedConvMixin`)
    and its max pool (:class:`ActBitMaxPoolMixin`), and RegNet's squeeze-and-excitation (``x * gate`` through
    timm's :class:`~act_hf.patches.timm_models.ActSqueezeExciteMixin`, with the layer's own gate)."""
    from .timm_models import ActSqueezeExciteMixin

    return [Rule("conv", lambda m: _tf_padding_dilated(m) is not None, lambda m: ActTFPaddedConvLayerMixin,
                 attrs=lambda m, c: {"act_tf_pad_dilated": _tf_padding_dilated(m)}),
            Rule("conv", _is_weight_standardized_conv, lambda m: ActWeightStandardizedConvMixin),
            Rule("pool", _is_bit_max_pool, lambda m: ActBitMaxPoolMixin),
            Rule("linear", lambda m: type(m).__name__ == "RegNetSELayer"
                 and code_fingerprint(type(m).forward) == REGNET_SE_FORWARD, lambda m: ActSqueezeExciteMixin,
                 attrs=lambda m, c: {"act_se_gate": _regnet_se_gate, "act_share_residual": c.share_residual})]


class ActConvNextLayerMixin(ActModule):
    """transformers' ``ConvNextLayer`` with its layer scale ``gamma * x`` through
    :func:`act_hf.ops.linear.act_channel_scale` (slot ``<path>:layer_scale``): autograd's ``mul`` kept the MLP
    output at full width for gamma's gradient, as in timm's ConvNeXt; the activation written into ``pwconv1``'s
    output (:func:`activation_of_owned`). The rest is transformers' forward step for step (the product is the same,
    type promotion included); the rule converts a layer only when its ``forward`` is the code this copies
    (:data:`CONVNEXT_LAYER_FORWARD`)."""

    def forward(self, features: Tensor) -> Tensor:
        if self.layer_scale_parameter is None or not self.act_enabled(features):
            return super().forward(features)
        residual = features
        features = self.dwconv(features).permute(0, 2, 3, 1)
        features = self.pwconv2(activation_of_owned(self.act, self.pwconv1(self.layernorm(features)), self.pwconv1))
        features = act_channel_scale(features, self.layer_scale_parameter, -1, self.act_settings("layer_scale"))
        return residual + self.drop_path(features.permute(0, 3, 1, 2))


#: :func:`code_fingerprint` of the ``ConvNextLayer.forward`` that :class:`ActConvNextLayerMixin` reproduces
#: (transformers 5.x).
CONVNEXT_LAYER_FORWARD = "ad7fa3044707bfee"


def _convnext_rules() -> list[Rule]:
    from act_hf.nn import norm

    def is_convnext_ln(m):
        return type(m).__name__ in ("ConvNextLayerNorm", "ConvNextV2LayerNorm")

    return [
        Rule("linear", lambda m: type(m).__name__ == "ConvNextLayer"
             and code_fingerprint(type(m).forward) == CONVNEXT_LAYER_FORWARD, lambda m: ActConvNextLayerMixin),
        Rule("norm", lambda m: is_convnext_ln(m) and m.data_format == "channels_first",
             lambda m: norm.ActLayerNorm2dMixin, attrs=lambda m, c: {"act_norm_context": c.norm_context}),
        Rule("norm", lambda m: is_convnext_ln(m) and m.data_format == "channels_last",
             lambda m: norm.ActLayerNormMixin, attrs=lambda m, c: {"act_norm_context": c.norm_context}),
    ]


@register_patch("vit")
def patch_vit(model, config) -> list[str]:
    return patch_hf(model, config)


@register_patch("swin")
def patch_swin(model, config) -> list[str]:
    return patch_hf(model, config, rules=[Rule(
        "attention", lambda m: type(m).__name__ == "SwinAttention"
        and code_fingerprint(type(m).forward) == SWIN_ATTENTION_FORWARD, lambda m: ActSwinAttentionMixin)])


@register_patch("convnext", "convnextv2")
def patch_convnext(model, config) -> list[str]:
    return patch_hf(model, config, rules=_convnext_rules(), attention=False)


@register_patch("swinv2", "swin2sr")
def patch_swinv2(model, config) -> list[str]:
    return patch_hf(model, config, rules=[
        Rule("attention", _is_swinv2_self_attention, lambda m: ActSwinv2SelfAttentionMixin)], attention=False)
