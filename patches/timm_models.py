"""timm models: ResNet, ViT/DeiT, Swin (V1, V2 and V2-CR), ConvNeXt, EfficientNet, EfficientViT (MIT: B and L), and
every timm model built from the same layers.

timm passes ``norm_layer``/``act_layer`` into constructors, so these rules walk the built modules: timm's own
``LayerNorm`` (plain F.layer_norm unless fast-norm is on), ``LayerNorm2d`` (channels-first ConvNeXt norm),
``BatchNormAct2d`` (EfficientNet: BN + activation fused, In-Place ABN form after an identity or ELU; a leaky ReLU
keeps the input form, whose inversion would amplify the noise by 1/slope), timm's activation classes (few-bit), the
attention modules of ViT and Swin (Swin V2's scaled cosine attention through
:func:`act_hf.ops.cosine_attention.act_cosine_attention`), and EfficientViT's ReLU linear attention (``LiteMLA``,
through :func:`act_hf.ops.linear_attention.act_linear_attention`). Layer scale (``LayerScale``, ``LayerScale2d``,
and the ``gamma`` of ``ConvNeXtBlock``) and squeeze-and-excitation (``x * gate``: EfficientNet's ``SqueezeExcite``,
``SEModule``, ``EffectiveSEModule``, ``SqueezeExciteCl``, and ECA's ``EcaModule`` and ``CecaModule``) keep their
input quantized for the scale's gradient, as do the softmax-weighted branch sums of ResNeSt (``SplitAttn``) and
SK-ResNet (``SelectiveKernel``), which read their inputs from what BatchNorm and the ReLU before them saved.
MetaFormer's ``StarReLU`` keeps its ReLU output and its output packed (:mod:`act_hf.ops.star_relu`). Stochastic
depth (``DropPath``) notes its output for residual sharing (:mod:`act_hf.derived`). ResNet's ``Bottleneck`` and
``BasicBlock``, EfficientNet's ``DepthwiseSeparableConv``, ``InvertedResidual``, ``EdgeResidual`` and ``ConvBnAct``,
and the ``ConvNormAct`` unit (their forwards recognised by their code) hand each BatchNorm the conv output it
follows to write into (:func:`act_hf.nn.norm.norm_of_owned`). The classifier named by
``pretrained_cfg["classifier"]`` stays exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from act_hf.context import store
from act_hf.derived import note_scaled
from act_hf.nn._base import ActModule, trains_with_grad
from act_hf.nn.activation import _calls_only_forward, activation_of_owned, output_is_owned
from act_hf.nn.norm import norm_of_owned, sequential_owning
from act_hf.ops.linear import act_channel_scale, act_scale
from act_hf.ops.linear_attention import act_linear_attention
from act_hf.ops.product import act_product
from act_hf.ops.star_relu import act_star_relu
from act_hf.patcher import Rule, callee, code_fingerprint, patch_modules, register_patch, same_forward

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


def _is_timm_code(m: nn.Module, name: str, code: str) -> bool:
    """timm's class ``name`` with the ``forward`` whose :func:`code_fingerprint` is ``code``."""
    return _is_timm(m, name) and code_fingerprint(type(m).forward) == code


class ActConvNeXtBlockMixin(ActModule):
    """timm's ``ConvNeXtBlock`` with its layer scale ``x * gamma`` through :func:`act_channel_scale` (slot
    ``<path>:layer_scale``): autograd's ``mul`` would keep the MLP output at full width for gamma's gradient,
    about a third of ConvNeXt's saved bytes at 3 bits. The rest is timm's forward step for step, the MLP handed
    the norm's output to own (:func:`_mlp_owning`); the rule converts a block only when its ``forward`` is the
    code this copies (:data:`CONVNEXT_BLOCK_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.gamma is None or not self.act_enabled(x):
            return super().forward(x)
        shortcut = x
        x = self.conv_dw(x)
        box = [self.norm(x) if self.use_conv_mlp else self.norm(x.permute(0, 2, 3, 1))]
        del x  # the depthwise conv's output; the MLP owns the norm's (freed once fc1 has read it)
        x = _mlp_owning(self.mlp, box)
        if not self.use_conv_mlp:
            x = x.permute(0, 3, 1, 2)
        x = act_channel_scale(x, self.gamma, 1, self.act_settings("layer_scale"))
        return self.drop_path(x) + self.shortcut(shortcut)


#: :func:`code_fingerprint` of the ``ConvNeXtBlock.forward`` that :class:`ActConvNeXtBlockMixin` reproduces
#: (timm 1.0.x); a block whose forward differs keeps its own (and its layer scale stays uncompressed).
CONVNEXT_BLOCK_FORWARD = "cdd3c4d3d5b5eefe"


def _is_convnext_block(m: nn.Module) -> bool:
    return _is_timm(m, "ConvNeXtBlock") and code_fingerprint(type(m).forward) == CONVNEXT_BLOCK_FORWARD


def _resnet_block_end(block: nn.Module, x: Tensor, shortcut: Tensor, act: nn.Module) -> Tensor:
    """The end of timm's ResNet blocks' forwards after the last BatchNorm: the squeeze-and-excitation, the
    stochastic depth, the downsample (:func:`sequential_owning`), the residual add in place and the activation."""
    if block.se is not None:
        x = block.se(x)
    if block.drop_path is not None:
        x = block.drop_path(x)
    if block.downsample is not None:
        shortcut = sequential_owning(block.downsample, shortcut)
    x += shortcut
    return act(x)


class ActResNetBottleneckMixin(ActModule):
    """timm's ResNet ``Bottleneck`` (ResNet-50 and deeper, ResNeXt, SE-ResNet, ...) with each BatchNorm after a
    conv writing its output into the conv's (:func:`norm_of_owned`), the downsample's too
    (:func:`sequential_owning`): at a block's highest point of forward, its last BatchNorm, the block's input, the
    conv's output and the BatchNorm's were alive at once (resnet50's first stage, bf16: 1.53 MiB a sample each).
    The rest is timm's forward step for step, bit for bit; the rule converts a block only when its ``forward`` is
    the code this reproduces (:data:`RESNET_BOTTLENECK_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x)
        shortcut = x
        x = self.conv1(x)  # the input's last reference
        x = norm_of_owned(self.bn1, x, self.conv1)
        x = self.act1(x)
        x = self.conv2(x)  # the input's last reference
        x = norm_of_owned(self.bn2, x, self.conv2)
        x = self.drop_block(x)
        x = self.act2(x)
        x = self.aa(x)
        x = self.conv3(x)  # the input's last reference
        x = norm_of_owned(self.bn3, x, self.conv3)
        return _resnet_block_end(self, x, shortcut, self.act3)


#: :func:`code_fingerprint` of the ``Bottleneck.forward`` that :class:`ActResNetBottleneckMixin` reproduces (timm
#: 1.0.x).
RESNET_BOTTLENECK_FORWARD = "45e56d6e40f2a252"


class ActResNetBasicBlockMixin(ActModule):
    """timm's ResNet ``BasicBlock`` (ResNet-18 and -34) as :class:`ActResNetBottleneckMixin` runs a bottleneck:
    each BatchNorm after a conv written into the conv's output; timm's forward step for step otherwise, converted
    only when its ``forward`` is that code (:data:`RESNET_BASIC_BLOCK_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x)
        shortcut = x
        x = self.conv1(x)  # the input's last reference
        x = norm_of_owned(self.bn1, x, self.conv1)
        x = self.drop_block(x)
        x = self.act1(x)
        x = self.aa(x)
        x = self.conv2(x)  # the input's last reference
        x = norm_of_owned(self.bn2, x, self.conv2)
        return _resnet_block_end(self, x, shortcut, self.act2)


#: :func:`code_fingerprint` of the ``BasicBlock.forward`` that :class:`ActResNetBasicBlockMixin` reproduces (timm
#: 1.0.x).
RESNET_BASIC_BLOCK_FORWARD = "24d1455c841b1658"


def _space_to_depth(block: nn.Module, x: Tensor) -> Tensor:
    """timm's EfficientNet blocks' optional space-to-depth conv and its BatchNorm (written into the conv's
    output), or ``x``."""
    if block.conv_s2d is None:
        return x
    x = block.conv_s2d(x)
    return norm_of_owned(block.bn_s2d, x, block.conv_s2d)


def _with_skip(block: nn.Module, x: Tensor, shortcut: Tensor) -> Tensor:
    """timm's EfficientNet blocks' end: ``drop_path(x) + shortcut`` where the block has a skip, else ``x``."""
    return block.drop_path(x) + shortcut if block.has_skip else x


class ActDepthwiseSeparableMixin(ActModule):
    """timm's ``DepthwiseSeparableConv`` (EfficientNet's and MobileNet's first blocks) with each BatchNorm after a
    conv written into the conv's output (:func:`norm_of_owned`); timm's forward step for step otherwise, converted
    only when its ``forward`` is that code (:data:`DEPTHWISE_SEPARABLE_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x)
        shortcut = x
        x = _space_to_depth(self, x)  # the block's input stays the shortcut
        x = self.conv_dw(x)
        x = norm_of_owned(self.bn1, x, self.conv_dw)
        x = self.aa(x)
        x = self.se(x)
        x = self.conv_pw(x)
        x = norm_of_owned(self.bn2, x, self.conv_pw)
        return _with_skip(self, x, shortcut)


#: :func:`code_fingerprint` of the ``DepthwiseSeparableConv.forward`` :class:`ActDepthwiseSeparableMixin`
#: reproduces (timm 1.0.x).
DEPTHWISE_SEPARABLE_FORWARD = "609bd8f81cce01d2"


class ActInvertedResidualMixin(ActModule):
    """timm's ``InvertedResidual`` (EfficientNet, MobileNetV2 / V3, MNASNet...) with each BatchNorm after a conv
    written into the conv's output (:func:`norm_of_owned`): the expansion's output and its BatchNorm's, the widest
    tensors of the block, are never alive together. timm's forward step for step otherwise, converted only when its
    ``forward`` is that code (:data:`INVERTED_RESIDUAL_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x)
        shortcut = x
        x = _space_to_depth(self, x)  # the block's input stays the shortcut
        x = self.conv_pw(x)
        x = norm_of_owned(self.bn1, x, self.conv_pw)
        x = self.conv_dw(x)
        x = norm_of_owned(self.bn2, x, self.conv_dw)
        x = self.aa(x)
        x = self.se(x)
        x = self.conv_pwl(x)
        x = norm_of_owned(self.bn3, x, self.conv_pwl)
        return _with_skip(self, x, shortcut)


#: :func:`code_fingerprint` of the ``InvertedResidual.forward`` :class:`ActInvertedResidualMixin` reproduces
#: (timm 1.0.x).
INVERTED_RESIDUAL_FORWARD = "068ebea3ab570f72"


class ActEdgeResidualMixin(ActModule):
    """timm's ``EdgeResidual`` (EfficientNetV2's and MobileNetV4's fused expansion) as
    :class:`ActInvertedResidualMixin` runs an inverted residual; converted only when its ``forward`` is the code
    (:data:`EDGE_RESIDUAL_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x)
        shortcut = x
        x = self.conv_exp(x)
        x = norm_of_owned(self.bn1, x, self.conv_exp)
        x = self.aa(x)
        x = self.se(x)
        x = self.conv_pwl(x)
        x = norm_of_owned(self.bn2, x, self.conv_pwl)
        return _with_skip(self, x, shortcut)


#: :func:`code_fingerprint` of the ``EdgeResidual.forward`` :class:`ActEdgeResidualMixin` reproduces (timm 1.0.x).
EDGE_RESIDUAL_FORWARD = "239175672d2ade52"


class ActConvNormActMixin(ActModule):
    """timm's ``ConvNormAct`` (the conv + norm + activation unit of RegNet, CSPNet, DarkNet, VoVNet, ByobNet...)
    with its BatchNorm written into the conv's output (:func:`norm_of_owned`); timm's forward step for step
    otherwise, converted only when its ``forward`` is that code (:data:`CONV_NORM_ACT_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x)
        x = self.conv(x)
        x = norm_of_owned(self.bn, x, self.conv)
        aa = getattr(self, "aa", None)
        if aa is not None:
            x = self.aa(x)
        return x


#: :func:`code_fingerprint` of the ``ConvNormAct.forward`` :class:`ActConvNormActMixin` reproduces (timm 1.0.x).
CONV_NORM_ACT_FORWARD = "38e0c4f61f64e381"


class ActConvBnActMixin(ActModule):
    """timm's EfficientNet ``ConvBnAct`` block as :class:`ActConvNormActMixin` runs ``ConvNormAct``; converted only
    when its ``forward`` is the code (:data:`CONV_BN_ACT_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x)
        shortcut = x
        x = self.conv(x)
        x = norm_of_owned(self.bn1, x, self.conv)
        x = self.aa(x)
        return _with_skip(self, x, shortcut)


#: :func:`code_fingerprint` of the ``ConvBnAct.forward`` :class:`ActConvBnActMixin` reproduces (timm 1.0.x).
CONV_BN_ACT_FORWARD = "328119bdf3fa676e"


class ActMlpMixin(ActModule):
    """timm's ``Mlp`` (ViT, Swin, ConvNeXt's channels-last MLP, ...) with its activation written into ``fc1``'s
    output (:func:`activation_of_owned`): the two hidden-width tensors, the widest of the block's forward, are
    never alive together. The rest is timm's forward step for step; the rule converts an MLP only when its
    ``forward`` is that code (:data:`MLP_FORWARD`), and its submodules are converted by their own rules."""

    def forward(self, x: Tensor) -> Tensor:
        return self.act_forward_owned([x])

    def act_forward_owned(self, box: list[Tensor]) -> Tensor:
        """:meth:`forward` of the one tensor in ``box``, taken out of it: when the caller holds no other reference
        (Swin's and ConvNeXt's blocks, through :func:`_mlp_owning`), the MLP's input is freed once ``fc1`` has read
        it instead of living through the MLP in the call's arguments."""
        x = box.pop()
        if not self.act_owns_intermediates(x):
            return super().forward(x)
        x = self.fc1(x)  # the input's last reference, when the caller handed it over, goes here
        x = activation_of_owned(self.act, x, self.fc1)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        return self.drop2(x)


#: :func:`code_fingerprint` of the ``Mlp.forward`` that :class:`ActMlpMixin` reproduces (timm 1.0.x).
MLP_FORWARD = "9c91f9f17692083b"


def _mlp_owning(mlp: nn.Module, box: list[Tensor]) -> Tensor:
    """``mlp(x)`` of the one tensor ``x`` in ``box``: a converted timm ``Mlp`` whose call is its ``forward`` alone
    (no hooks, no tracing) is handed ``x`` to own (:meth:`ActMlpMixin.act_forward_owned`), so a caller that holds
    no other reference has it freed once ``fc1`` has read it; any other MLP is called as usual."""
    if isinstance(mlp, ActMlpMixin) and _calls_only_forward(mlp):
        return mlp.act_forward_owned(box)
    return mlp(box.pop())


class ActSwiGLUMixin(ActModule):
    """timm's ``SwiGLU`` (``fc2(norm(act(fc1_g(x)) * fc1_x(x)))``: EVA-02 and the ``*_swiglu`` ViTs), its product
    through :func:`act_product` (slots ``<path>:gate_act`` and ``<path>:up``), where autograd's ``mul`` kept both
    operands at full width; the activation written into ``fc1_g``'s output and the product into the activation's
    where nothing else can hold them. The rule converts a module only when its ``forward`` is timm's
    (:data:`SWIGLU_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        owned = output_is_owned(self.act)
        gate = activation_of_owned(self.act, self.fc1_g(x), self.fc1_g)
        x = act_product(gate, self.fc1_x(x), self.act_settings("gate_act"), self.act_settings("up"), into_a=owned)
        return self.drop2(self.fc2(self.norm(self.drop1(x))))


#: :func:`code_fingerprint` of the ``SwiGLU.forward`` that :class:`ActSwiGLUMixin` reproduces (timm 1.0.x).
SWIGLU_FORWARD = "3356ff52751a79a3"


class ActGluMlpMixin(ActModule):
    """timm's ``GluMlp`` (``fc1`` then the gated product of its two halves), the product through
    :func:`act_product` (slots ``<path>:gate_act`` and ``<path>:up``): both operands packed, where autograd's ``mul``
    kept them at full width. The rule converts a module only when its ``forward`` is timm's
    (:data:`GLU_MLP_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        x1, x2 = self.fc1(x).chunk(2, dim=self.chunk_dim)
        gate_act, up = self.act_settings("gate_act"), self.act_settings("up")
        x = act_product(x1, self.act(x2), up, gate_act) if self.gate_last else \
            act_product(self.act(x1), x2, gate_act, up)
        return self.drop2(self.fc2(self.norm(self.drop1(x))))


#: :func:`code_fingerprint` of the ``GluMlp.forward`` that :class:`ActGluMlpMixin` reproduces (timm 1.0.x).
GLU_MLP_FORWARD = "86986d5325d331ac"


class ActSwinBlockMixin(ActModule):
    """timm's ``SwinTransformerBlock`` computing what its ``forward`` and ``_attn`` compute, step for step, with the
    attention's input made in a call of its own (:meth:`_act_windows`) whose full-size intermediates are gone when
    attention runs: timm's ``_attn`` holds its argument (the LayerNorm output) and the shifted, padded copy until it
    returns, two block-sized tensors beside the windows (1.15 MiB a sample each at swin-tiny's first stage, fp32
    under autocast); a padding of zero is no copy here. The rule converts a block only when ``forward``, ``_attn``
    and the window helpers are the code this reproduces (:data:`SWIN_BLOCK_CODE`)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.act_forward_owned([x])

    def act_forward_owned(self, box: list[Tensor]) -> Tensor:
        """:meth:`forward` of the one tensor in ``box``, taken out of it: when the caller holds no other reference
        (:class:`ActSwinStageMixin`), the block's input is freed once the attention branch is added to it, before
        the MLP runs, instead of living through the whole block."""
        x = box.pop()
        if not self.act_enabled(x):
            return super().forward(x)
        B, H, W, C = x.shape
        windows, attn_mask, padded = self._act_windows(self.norm1(x))
        attn_windows = self.attn(windows, mask=attn_mask)
        del windows
        x = x + self.drop_path1(self._act_merge(attn_windows, H, W, padded))
        x = x.reshape(B, -1, C)
        x = x + self.drop_path2(_mlp_owning(self.mlp, [self.norm2(x)]))  # the MLP owns the LayerNorm's output
        return x.reshape(B, H, W, C)

    def _act_windows(self, x: Tensor) -> tuple[Tensor, Tensor | None, tuple[int, int]]:
        """``_attn``'s way in: the windows ``(nW*B, window_area, C)`` of ``x`` shifted and padded, the attention
        mask, and the padded height and width."""
        from timm.models.swin_transformer import window_partition

        _, H, W, C = x.shape
        if any(self.shift_size):
            x = torch.roll(x, shifts=(-self.shift_size[0], -self.shift_size[1]), dims=(1, 2))
        pad_h = (self.window_size[0] - H % self.window_size[0]) % self.window_size[0]
        pad_w = (self.window_size[1] - W % self.window_size[1]) % self.window_size[1]
        if pad_h or pad_w:
            x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
        attn_mask = self.get_attn_mask(x) if getattr(self, "dynamic_mask", False) else self.attn_mask
        return window_partition(x, self.window_size).view(-1, self.window_area, C), attn_mask, (x.shape[1], x.shape[2])

    def _act_merge(self, attn_windows: Tensor, H: int, W: int, padded: tuple[int, int]) -> Tensor:
        """``_attn``'s way out: the windows merged, the padding cut and the shift reversed."""
        from timm.models.swin_transformer import window_reverse

        C = attn_windows.shape[-1]
        attn_windows = attn_windows.view(-1, self.window_size[0], self.window_size[1], C)
        x = window_reverse(attn_windows, self.window_size, *padded)[:, :H, :W, :].contiguous()
        return torch.roll(x, shifts=self.shift_size, dims=(1, 2)) if any(self.shift_size) else x


#: :func:`code_fingerprint` of the code :class:`ActSwinBlockMixin` reproduces (timm 1.0.x): the block's ``forward``
#: and ``_attn``, and the ``window_partition`` and ``window_reverse`` they call.
SWIN_BLOCK_CODE = {"forward": "0e33604a75ed1c6b", "_attn": "365aa81776e97561", "window_partition": "f4ed84a36e7231bf",
                   "window_reverse": "b561c3e67a560e67"}


class ActSwinStageMixin(ActModule):
    """timm's ``SwinTransformerStage`` running its blocks as its ``forward`` does (``self.blocks(x)`` after the
    downsampling), but handing each converted block its input to own (:meth:`ActSwinBlockMixin.act_forward_owned`):
    ``nn.Sequential.forward`` holds each block's input until the block returns, so the residual stream was
    alive twice through every MLP (the block's input and input + attention: 1.15 MiB a sample each at
    swin-tiny's first stage, fp32 under autocast). Only while calling a block is its ``forward`` alone (no
    hooks on the blocks or their ``Sequential``, no tracing); otherwise, and with gradient checkpointing, timm's
    ``forward`` runs. Converted when the stage's ``forward`` is the code this reproduces
    (:data:`SWIN_STAGE_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        blocks = list(self.blocks)
        if (self.grad_checkpointing or not self.act_enabled(x)
                or not _calls_only_forward(self, self.blocks, *blocks)):
            return super().forward(x)
        box = [self.downsample(x)]
        del x  # the caller's reference remains: only the blocks' own inputs are handed over
        for block in blocks:
            box.append(block.act_forward_owned(box) if isinstance(block, ActSwinBlockMixin) else block(box.pop()))
        return box.pop()


#: :func:`code_fingerprint` of ``SwinTransformerStage.forward`` (timm 1.0.x) that :class:`ActSwinStageMixin` runs.
SWIN_STAGE_FORWARD = "07b724b7438b4ef0"


def _is_swin_block(m: nn.Module) -> bool:
    if not _is_timm(m, "SwinTransformerBlock"):
        return False
    cls = type(m)
    code = {"forward": cls.forward, "_attn": cls._attn, "window_partition": callee(cls._attn, "window_partition"),
            "window_reverse": callee(cls._attn, "window_reverse")}
    return all(fn is not None and code_fingerprint(fn) == SWIN_BLOCK_CODE[name] for name, fn in code.items())


class ActLiteMLAMixin(ActModule):
    """timm's EfficientViT ``LiteMLA`` with its ReLU linear attention through :func:`act_linear_attention` (slots
    ``<path>:q``, ``:k``, ``:v``, ``:out``), which keeps the normalizer exact: quantized, it divides the rounding
    noise of small query rows by their small denominators. The rule converts a module only when its ``_attn``
    is the code this reproduces (:data:`LITE_MLA_ATTN`)."""

    def _attn(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not self.act_enabled(q, k, v):
            return super()._attn(q, k, v)
        dtype = v.dtype
        q, k, v = q.float(), k.float(), v.float()
        return act_linear_attention(q, k, v, self.eps, self.act_base_settings()).to(dtype)


#: :func:`code_fingerprint` of the ``LiteMLA._attn`` that :class:`ActLiteMLAMixin` computes (timm 1.0.x).
LITE_MLA_ATTN = "310d5e8d3c3642e5"


def _is_lite_mla(m: nn.Module) -> bool:
    return _is_timm(m, "LiteMLA") and code_fingerprint(type(m)._attn) == LITE_MLA_ATTN


class ActDropPathMixin(ActModule):
    """timm's ``DropPath`` (stochastic depth: one keep draw per sample) with the same output and the same use of
    the random generator, its output noted as its input times the per-sample scale
    (:func:`act_hf.derived.note_scaled`). In a ResNet block ``x = drop_path(bn3(.)); x += shortcut`` the next
    block's conv then reads the block output from the tensors BatchNorm and ReLU saved (``share_residual``)
    instead of packing it again; it saves nothing itself. The rule converts it only when timm's code is the code
    this copies (:data:`DROP_PATH_CODE`)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.drop_prob == 0.0 or not self.act_share_residual or not self.act_enabled(x):
            return super().forward(x)
        keep_prob = 1 - self.drop_prob
        scale = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)
        if keep_prob > 0.0 and self.scale_by_keep:
            scale.div_(keep_prob)
        out = x * scale
        note_scaled(out, x, scale, slot=self.act_slot_name("input"))
        return out


#: :func:`code_fingerprint` of ``DropPath.forward`` and of the ``drop_path`` it calls, which
#: :class:`ActDropPathMixin` reproduces (timm 1.0.x).
DROP_PATH_CODE = ("1270979aad2e9889", "4f5afd298e74d5b3")


def _is_drop_path(m: nn.Module) -> bool:
    from timm.layers import DropPath, drop

    return same_forward(DropPath)(m) \
        and (code_fingerprint(DropPath.forward), code_fingerprint(drop.drop_path)) == DROP_PATH_CODE


def _efficientnet_gate(m: nn.Module, x: Tensor) -> Tensor:
    """``timm.models._efficientnet_blocks.SqueezeExcite`` (EfficientNet, MobileNet V2 / V3, MixNet...)."""
    return m.gate(m.conv_expand(m.act1(m.conv_reduce(x.mean((2, 3), keepdim=True)))))


def _se_module_gate(m: nn.Module, x: Tensor) -> Tensor:
    """``timm.layers.SEModule`` (SE-ResNet, RegNetY, ...) without its ``add_maxpool``."""
    return m.gate(m.fc2(m.act(m.bn(m.fc1(x.mean((2, 3), keepdim=True))))))


def _effective_se_gate(m: nn.Module, x: Tensor) -> Tensor:
    """``timm.layers.EffectiveSEModule`` (VoVNet's eSE, CSPNeXt, RDNet) without its ``add_maxpool``."""
    return m.gate(m.fc(x.mean((2, 3), keepdim=True)))


def _se_channels_last_gate(m: nn.Module, x: Tensor) -> Tensor:
    """``timm.layers.SqueezeExciteCl`` (channels last)."""
    return m.gate(m.fc2(m.act(m.fc1(x.mean((1, 2), keepdims=True)))))


def _eca_gate(m: nn.Module, x: Tensor) -> Tensor:
    """``timm.layers.EcaModule`` (efficient channel attention: ECA-ResNet, ECA-NFNet...), its gate before the
    ``expand_as``."""
    y = m.conv(x.mean((2, 3)).view(x.shape[0], 1, -1))
    if m.conv2 is not None:
        y = m.conv2(m.act(y))
    return m.gate(y).view(x.shape[0], -1, 1, 1)


def _circular_eca_gate(m: nn.Module, x: Tensor) -> Tensor:
    """``timm.layers.CecaModule`` (ECA with circular padding), its gate before the ``expand_as``."""
    y = F.pad(x.mean((2, 3)).view(x.shape[0], 1, -1), (m.padding, m.padding), mode="circular")
    return m.gate(m.conv(y)).view(x.shape[0], -1, 1, 1)


#: :func:`code_fingerprint` of timm 1.0's squeeze-and-excitation ``forward`` -> the gate it computes, step for step
SQUEEZE_EXCITE_GATES = {"64153abbcd9505af": _efficientnet_gate, "6aaa21d048fe112d": _se_module_gate,
                        "7b4c5f0d0248200e": _effective_se_gate, "55fcc9cc2165def3": _se_channels_last_gate,
                        "b62b77c018e3e07d": _eca_gate, "771800f5bb1ce7a6": _circular_eca_gate}


def _squeeze_excite_gate(m: nn.Module):
    if not type(m).__module__.startswith("timm.") or getattr(m, "add_maxpool", False):
        return None  # the max pool's backward reads x exactly
    return SQUEEZE_EXCITE_GATES.get(code_fingerprint(type(m).forward))


class ActSqueezeExciteMixin(ActModule):
    """timm's squeeze-and-excitation modules, ``x * gate(x)`` with a gate of one value per sample and channel,
    through :func:`act_hf.ops.linear.act_scale` (slot ``<path>:input``): autograd's ``mul`` kept ``x`` at full
    width for the gate's gradient, and nothing else keeps it (the squeeze's mean saves nothing); an
    EfficientNet-B0 kept 4.4 of its 11.7 MiB a sample so at 3 bits. The gate is the module's own computation
    (``act_se_gate``, one of :data:`SQUEEZE_EXCITE_GATES`, chosen by the code of the class's ``forward``), so the
    output is the original's bit for bit."""

    act_se_gate = None

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        gate = self.act_se_gate(self, x)  # a function held by the instance: not bound
        if not gate.requires_grad:
            return x * gate
        settings = self.act_settings("input")
        out = act_scale(x, gate, settings)
        if self.act_share_residual:  # a residual add after it may read out as g * x_hat (act_hf.derived)
            note_scaled(out, x, gate, packed=lambda: store.compress_as(x, settings), slot=settings.slot)
        return out


class ActSplitAttnMixin(ActModule):
    """timm's ``SplitAttn`` (ResNeSt's split attention): ``radix`` conv outputs ``x``, weighted by a softmax over
    the radix (a sigmoid when ``radix`` is 1), one weight per sample and channel, and summed. Autograd's ``mul``
    kept ``x`` at full width for the weights' gradient; here the product goes through
    :func:`act_hf.ops.linear.act_scale` on the 4-d ``x`` (slot ``<path>:input``), which reads ``x`` from what the
    BatchNorm and the ReLU before it saved, or packs it. The output is the original's bit for bit: the same
    products, summed over the radix in the same layout. The rule converts it only when timm's code is the code
    this copies (:data:`SPLIT_ATTN_CODE`)."""

    def forward(self, x: Tensor) -> Tensor:
        x = self.act0(self.drop(self.bn0(self.conv(x))))
        B, RC, H, W = x.shape
        x_gap = x.reshape((B, self.radix, RC // self.radix, H, W)).sum(dim=1) if self.radix > 1 else x
        x_gap = self.act1(self.bn1(self.fc1(x_gap.mean((2, 3), keepdim=True))))
        x_attn = self.rsoftmax(self.fc2(x_gap)).view(B, -1, 1, 1)
        if self.act_enabled(x) and x_attn.requires_grad:
            out = act_scale(x, x_attn, self.act_settings("input"))
        else:
            out = x * x_attn
        if self.radix > 1:
            out = out.reshape((B, self.radix, RC // self.radix, H, W)).sum(dim=1)
        return out.contiguous()


#: :func:`code_fingerprint` of the ``SplitAttn.forward`` that :class:`ActSplitAttnMixin` computes (timm 1.0.x).
SPLIT_ATTN_CODE = "68c2465a63fc2e55"


class ActSelectiveKernelMixin(ActModule):
    """timm's ``SelectiveKernel`` (SK-ResNet): ``num_paths`` conv outputs, stacked, weighted by a softmax over the
    paths (one weight per sample and channel) and summed. Autograd's ``mul`` kept the stack at full width for the
    weights' gradient; here each path's product goes through :func:`act_hf.ops.linear.act_scale` (slots
    ``<path>:path0``, ``<path>:path1``...), which reads the path's output from what its BatchNorm and ReLU saved,
    or packs it. The products are stacked and summed as the original sums them, so the output is the original's
    bit for bit. The rule converts it only when timm's code is the code this copies
    (:data:`SELECTIVE_KERNEL_CODE`)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.split_input:
            x_split = torch.split(x, self.in_channels // self.num_paths, 1)
            x_paths = [op(x_split[i]) for i, op in enumerate(self.paths)]
        else:
            x_paths = [op(x) for op in self.paths]
        stacked = torch.stack(x_paths, dim=1)
        x_attn = self.attn(stacked)
        if not (self.act_enabled(*x_paths) and x_attn.requires_grad):
            return torch.sum(stacked * x_attn, dim=1)
        del stacked  # read by the attention alone: the products are stacked anew
        x = torch.stack([act_scale(path, x_attn[:, i], self.act_settings(f"path{i}"))
                         for i, path in enumerate(x_paths)], dim=1)
        return torch.sum(x, dim=1)


#: :func:`code_fingerprint` of the ``SelectiveKernel.forward`` that :class:`ActSelectiveKernelMixin` computes
#: (timm 1.0.x).
SELECTIVE_KERNEL_CODE = "bac43caf962331f5"


class ActStarReLUMixin(ActModule):
    """timm's ``StarReLU`` (MetaFormer: ``scale * relu(x) ** 2 + bias``) through
    :func:`act_hf.ops.star_relu.act_star_relu` (slots ``<path>:input`` and ``<path>:output``, the second shared
    with the linear or conv after it): autograd kept ``relu(x)`` and ``relu(x) ** 2``, and the ReLU its mask. The
    output is the original's bit for bit; the rule converts it only when timm's code is the code this computes
    (:data:`STAR_RELU_CODE`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        return act_star_relu(x, self.scale, self.bias, self.act_base_settings())


#: :func:`code_fingerprint` of the ``StarReLU.forward`` that :class:`ActStarReLUMixin` computes (timm 1.0.x).
STAR_RELU_CODE = "adbd85d58fb2be0b"


def timm_rules() -> list[Rule]:
    """Rules for timm's layers, in front of the generic torch ones."""
    from timm import layers

    from act_hf.nn import activation, linear, norm

    from . import _timm_attention

    ln_attrs = lambda m, c: {"act_norm_context": c.norm_context}
    return [
        Rule("attention", lambda m: _timm_attention.mixin_for(m) is not None, _timm_attention.mixin_for),
        Rule("attention", _is_lite_mla, lambda m: ActLiteMLAMixin),
        Rule("norm", lambda m: _is_timm(m, "LayerNorm2d"), lambda m: norm.ActLayerNorm2dMixin, attrs=ln_attrs),
        Rule("norm", lambda m: _is_timm(m, "LayerNorm") and not getattr(m, "_fast_norm", False),
             lambda m: norm.ActLayerNormMixin, attrs=ln_attrs),
        Rule("norm", lambda m: _is_timm(m, "BatchNormAct2d"), lambda m: norm.ActBatchNormAct2dMixin,
             attrs=lambda m, c: {"act_share_bn_relu": c.share_bn_relu}),
        Rule("linear", _is_convnext_block, lambda m: ActConvNeXtBlockMixin),
        Rule("norm", lambda m: _is_timm_code(m, "Bottleneck", RESNET_BOTTLENECK_FORWARD),
             lambda m: ActResNetBottleneckMixin),
        Rule("norm", lambda m: _is_timm_code(m, "BasicBlock", RESNET_BASIC_BLOCK_FORWARD),
             lambda m: ActResNetBasicBlockMixin),
        Rule("norm", lambda m: _is_timm_code(m, "DepthwiseSeparableConv", DEPTHWISE_SEPARABLE_FORWARD),
             lambda m: ActDepthwiseSeparableMixin),
        Rule("norm", lambda m: _is_timm_code(m, "InvertedResidual", INVERTED_RESIDUAL_FORWARD),
             lambda m: ActInvertedResidualMixin),
        Rule("norm", lambda m: _is_timm_code(m, "EdgeResidual", EDGE_RESIDUAL_FORWARD),
             lambda m: ActEdgeResidualMixin),
        Rule("norm", lambda m: _is_timm_code(m, "ConvNormAct", CONV_NORM_ACT_FORWARD), lambda m: ActConvNormActMixin),
        Rule("norm", lambda m: _is_timm_code(m, "ConvBnAct", CONV_BN_ACT_FORWARD), lambda m: ActConvBnActMixin),
        Rule("activation", lambda m: _is_timm_code(m, "Mlp", MLP_FORWARD), lambda m: ActMlpMixin),
        Rule("activation", lambda m: _is_timm_code(m, "SwiGLU", SWIGLU_FORWARD), lambda m: ActSwiGLUMixin),
        Rule("activation", lambda m: _is_timm_code(m, "GluMlp", GLU_MLP_FORWARD), lambda m: ActGluMlpMixin),
        Rule("attention", _is_swin_block, lambda m: ActSwinBlockMixin),
        Rule("attention", lambda m: _is_timm_code(m, "SwinTransformerStage", SWIN_STAGE_FORWARD),
             lambda m: ActSwinStageMixin),
        Rule("linear", lambda m: _squeeze_excite_gate(m) is not None, lambda m: ActSqueezeExciteMixin,
             attrs=lambda m, c: {"act_se_gate": _squeeze_excite_gate(m), "act_share_residual": c.share_residual}),
        Rule("linear", lambda m: _is_timm_code(m, "SplitAttn", SPLIT_ATTN_CODE), lambda m: ActSplitAttnMixin),
        Rule("linear", lambda m: _is_timm_code(m, "SelectiveKernel", SELECTIVE_KERNEL_CODE),
             lambda m: ActSelectiveKernelMixin),
        Rule("activation", lambda m: _is_timm_code(m, "StarReLU", STAR_RELU_CODE), lambda m: ActStarReLUMixin),
        Rule("dropout", _is_drop_path, lambda m: ActDropPathMixin,
             attrs=lambda m, c: {"act_share_residual": c.share_residual}),
        Rule("linear", same_forward(layers.LayerScale), lambda m: linear.ActLayerScaleMixin),
        Rule("linear", same_forward(layers.LayerScale2d), lambda m: linear.ActLayerScaleMixin,
             attrs=lambda m, c: {"act_scale_dim": 1}),
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


@register_patch("timm:ResNet", "timm:VisionTransformer", "timm:SwinTransformer", "timm:SwinTransformerV2",
                "timm:SwinTransformerV2Cr", "timm:ConvNeXt", "timm:EfficientNet", "timm:EfficientVit",
                "timm:EfficientVitLarge")
def patch_timm(model, config) -> list[str]:
    return patch_modules(model, config, rules=timm_rules(), head_paths=timm_head_paths(model))
