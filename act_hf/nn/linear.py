"""Drop-in Linear and convolution modules that save their input quantized."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.linear import act_channel_scale, act_conv, act_linear, act_standardized_conv
from ._base import ActModule, register_act_class

__all__ = ["CONV2D_SAME_CODE", "STANDARDIZED_CONV_FORWARDS", "ActConv1d", "ActConv2d", "ActConv2dSameMixin",
           "ActConv3d", "ActConvMixin", "ActLayerScaleMixin", "ActLinear", "ActLinearMixin",
           "ActStandardizedConvMixin", "ActTransposedLinearMixin", "is_same_padding_conv", "is_standardized_conv",
           "same_pad"]


class ActLinearMixin(ActModule):
    """For ``nn.Linear`` and its subclasses: slot ``<path>:input``."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        return act_linear(x, self.weight, self.bias, self.act_settings("input"))


class ActTransposedLinearMixin(ActModule):
    """For linear layers whose weight is stored ``(in, out)`` and compute ``addmm(bias, x, weight)`` (GPT-2's
    ``Conv1D`` in transformers): the same arithmetic, so the output is bit-identical."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        return act_linear(x, self.weight, self.bias, self.act_settings("input"), transposed=True)


def _torch_same_padding(kernel_size: tuple[int, ...], dilation: tuple[int, ...]
                        ) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``(padding, pad)`` computing a stride-1 conv's ``padding="same"`` as PyTorch does: the smaller side's
    padding on both sides of every dim, and, where a dim's total is odd (an even kernel), an ``F.pad`` of one more
    zero after it (``None`` when every dim is even)."""
    totals = [d * (k - 1) for k, d in zip(kernel_size, dilation)]
    padding = tuple(t // 2 for t in totals)
    extra = [t - t // 2 - t // 2 for t in totals]
    if not any(extra):
        return padding, None
    pad = []
    for e in reversed(extra):  # F.pad's order: the last dim first
        pad += [0, e]
    return padding, tuple(pad)


class ActConvMixin(ActModule):
    """For ``nn.Conv1d/2d/3d`` (any groups, stride, dilation, padding mode, numeric or string padding): slot
    ``<path>:input``. ``padding="same"`` is computed as PyTorch computes it, so the output is the same bit for
    bit; an even kernel's extra zero is padded inside the op, which keeps the input unpadded."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        padding, pad = self.padding, None
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0,) * len(self.kernel_size)
        elif padding == "valid":
            padding = (0,) * len(self.kernel_size)
        elif padding == "same":
            padding, pad = _torch_same_padding(self.kernel_size, self.dilation)
        return act_conv(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups,
                        self.act_settings("input"), pad=pad)


#: :func:`act_hf.patcher.code_fingerprint` of the forwards of timm's weight-standardized convs (timm 1.0) ->
#: (scaled: ``ScaledStdConv2d``'s ``gain * scale``, same: SAME padding computed from the input's size)
STANDARDIZED_CONV_FORWARDS = {
    "79f2d3e02e2db04d": (False, False),  # StdConv2d (BiT ResNetV2)
    "017f1a6be8d6bb5b": (False, True),  # StdConv2dSame (ViT hybrids)
    "b32fb791ee11f7c1": (True, False),  # ScaledStdConv2d (NFNets, NF-ResNets)
    "29e8d6489eacea30": (True, True),  # ScaledStdConv2dSame (DeepMind's NFNets)
}


def _standardized_form(cls: type) -> tuple[bool, bool] | None:
    """``(scaled, same)`` of a class whose forward is one of :data:`STANDARDIZED_CONV_FORWARDS`, else ``None``."""
    from ..patcher import code_fingerprint

    try:
        return STANDARDIZED_CONV_FORWARDS.get(code_fingerprint(cls.forward))
    except (OSError, TypeError):  # no source to read
        return None


def is_standardized_conv(module: nn.Module) -> bool:
    """A ``Conv2d`` whose class's forward is one of :data:`STANDARDIZED_CONV_FORWARDS`, statement for statement
    (any library's copy of timm's code qualifies; changed code does not and keeps its forward)."""
    return isinstance(module, nn.Conv2d) and type(module).forward is not nn.Conv2d.forward \
        and _standardized_form(type(module)) is not None


def _same_padding(size: int, kernel: int, stride: int, dilation: int) -> int:
    return max((math.ceil(size / stride) - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)


def same_pad(x: Tensor, kernel_size, stride, dilation) -> tuple[int, int, int, int]:
    """TF's SAME padding of ``x``'s last two dims as timm's ``pad_same`` computes it, in ``F.pad``'s form (the odd
    pixel after)."""
    (ih, iw), (kh, kw), (sh, sw), (dh, dw) = x.shape[-2:], kernel_size, stride, dilation
    pad_h, pad_w = _same_padding(ih, kh, sh, dh), _same_padding(iw, kw, sw, dw)
    return pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2


#: :func:`act_hf.patcher.code_fingerprint` of timm's ``Conv2dSame.forward`` and of the ``conv2d_same``,
#: ``pad_same`` and ``get_same_padding`` it calls (timm 1.0), which :class:`ActConv2dSameMixin` reproduces
CONV2D_SAME_CODE = ("b315082c088fc4c2", "8cfe33c5ce2e7093", "77a1f0249229f57f", "2185fef1df64e425")


def is_same_padding_conv(module: nn.Module) -> bool:
    """A ``Conv2d`` computing timm's ``Conv2dSame`` forward (TF's SAME padding from the input's size, then the
    conv), statement for statement down to the padding arithmetic (:data:`CONV2D_SAME_CODE`)."""
    from ..patcher import callee, code_fingerprint

    if not isinstance(module, nn.Conv2d) or module.padding_mode != "zeros":
        return False
    forward = type(module).forward
    conv2d_same = callee(forward, "conv2d_same")
    pad_same = callee(conv2d_same, "pad_same")
    get_same_padding = callee(pad_same, "get_same_padding")
    try:
        return tuple(code_fingerprint(f) for f in (forward, conv2d_same, pad_same, get_same_padding)) \
            == CONV2D_SAME_CODE
    except (OSError, TypeError):  # a callee missing or without source
        return False


class ActStandardizedConvMixin(ActModule):
    """For timm's weight-standardized convs (:func:`is_standardized_conv`): slot ``<path>:input``, saved before
    the SAME forms' padding; the standardized weight is made again in backward instead of being kept (see
    :class:`act_hf.ops.linear.ActStandardizedConvFunction`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x) or self.padding_mode != "zeros" or isinstance(self.padding, str):
            return super().forward(x)  # timm pads with zeros; a string padding stays on the original op
        scaled, same = _standardized_form(self.act_original_class)
        pad = same_pad(x, self.kernel_size, self.stride, self.dilation) if same and self.same_pad else None
        return act_standardized_conv(x, self.weight, self.gain if scaled else None, self.bias,
                                     self.scale if scaled else 1.0, self.eps, self.stride, self.padding,
                                     self.dilation, self.groups, self.act_settings("input"), pad=pad)


class ActConv2dSameMixin(ActModule):
    """For timm's ``Conv2dSame`` (:func:`is_same_padding_conv`: TF-ported EfficientNets, MobileNets, MixNets):
    slot ``<path>:input``. The input is saved before the padding (:class:`~act_hf.ops.linear.ActConvFunction`'s
    ``pad``), where the ops before may already describe it (:mod:`act_hf.derived`); the unpatched module kept
    the padded copy at full width."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        pad = same_pad(x, self.weight.shape[-2:], self.stride, self.dilation)
        return act_conv(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups,
                        self.act_settings("input"), pad=pad)


class ActLayerScaleMixin(ActModule):
    """For layer-scale modules ``y = x * gamma`` (timm's ``LayerScale``: ``gamma`` along the last dim;
    ``LayerScale2d``: along dim 1, set ``act_scale_dim = 1``): slot ``<path>:input``. An in-place original
    (``inplace=True``) returns a new tensor here, with the same values."""

    act_scale_dim: int = -1

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        return act_channel_scale(x, self.gamma, self.act_scale_dim, self.act_settings("input"))


class ActLinear(ActLinearMixin, nn.Linear):
    """``nn.Linear`` whose saved input is quantized to ``act_bits``."""


class ActConv1d(ActConvMixin, nn.Conv1d):
    """``nn.Conv1d`` whose saved input is quantized."""


class ActConv2d(ActConvMixin, nn.Conv2d):
    """``nn.Conv2d`` whose saved input is quantized."""


class ActConv3d(ActConvMixin, nn.Conv3d):
    """``nn.Conv3d`` whose saved input is quantized."""


register_act_class(nn.Linear, ActLinearMixin, ActLinear)
register_act_class(nn.Conv1d, ActConvMixin, ActConv1d)
register_act_class(nn.Conv2d, ActConvMixin, ActConv2d)
register_act_class(nn.Conv3d, ActConvMixin, ActConv3d)
