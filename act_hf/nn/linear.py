"""Drop-in Linear and convolution modules that save their input quantized."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.linear import act_channel_scale, act_conv, act_linear
from ._base import ActModule, register_act_class

__all__ = ["ActConv1d", "ActConv2d", "ActConv3d", "ActConvMixin", "ActLayerScaleMixin", "ActLinear",
           "ActLinearMixin", "ActTransposedLinearMixin"]


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


class ActConvMixin(ActModule):
    """For ``nn.Conv1d/2d/3d`` (any groups, stride, dilation, padding mode): slot ``<path>:input``."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x) or isinstance(self.padding, str) and self.padding != "valid":
            return super().forward(x)  # string padding "same" stays on the original op
        padding = (0,) * len(self.kernel_size) if isinstance(self.padding, str) else self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0,) * len(self.kernel_size)
        return act_conv(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups,
                        self.act_settings("input"))


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
