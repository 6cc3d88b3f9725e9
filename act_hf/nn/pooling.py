"""Drop-in ``nn.MaxPool1d/2d/3d`` that save the argmax position inside each window at a few bits, and
``nn.AvgPool1d/2d/3d`` that save nothing (autograd keeps their input, though backward reads only its shape).

For max pooling, ``return_indices=True`` and windows of more than 256 positions run the original op. Global
adaptive-average pooling (output size 1) keeps nothing in PyTorch; other adaptive sizes keep the input and are
left to the fallback's hooks.
"""

from __future__ import annotations

import logging

from torch import Tensor, nn

from ..ops.pooling import act_avg_pool, act_max_pool
from ._base import ActModule, register_act_class

__all__ = ["ActAvgPool1d", "ActAvgPool2d", "ActAvgPool3d", "ActAvgPoolMixin", "ActMaxPool1d", "ActMaxPool2d",
           "ActMaxPool3d", "ActMaxPoolMixin"]

logger = logging.getLogger(__name__)

_ND = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3}


def _spatial_dims(module: nn.Module) -> int:
    for cls in type(module).__mro__:
        if cls in _ND:
            return _ND[cls]
    raise TypeError(f"{type(module).__name__} is not a subclass of nn.MaxPool1d/2d/3d or nn.AvgPool1d/2d/3d")


class ActMaxPoolMixin(ActModule):
    """For ``nn.MaxPool1d/2d/3d`` and subclasses: slot ``<path>:indices``."""

    def forward(self, x: Tensor):
        if self.return_indices or not self.act_enabled(x):
            return super().forward(x)
        return act_max_pool(x, _spatial_dims(self), self.kernel_size, self.stride, self.padding, self.dilation,
                            self.ceil_mode, settings=self.act_settings("indices"))


class ActMaxPool1d(ActMaxPoolMixin, nn.MaxPool1d):
    """``nn.MaxPool1d`` saving packed window positions."""


class ActMaxPool2d(ActMaxPoolMixin, nn.MaxPool2d):
    """``nn.MaxPool2d`` saving packed window positions."""


class ActMaxPool3d(ActMaxPoolMixin, nn.MaxPool3d):
    """``nn.MaxPool3d`` saving packed window positions."""


register_act_class(nn.MaxPool1d, ActMaxPoolMixin, ActMaxPool1d)
register_act_class(nn.MaxPool2d, ActMaxPoolMixin, ActMaxPool2d)
register_act_class(nn.MaxPool3d, ActMaxPoolMixin, ActMaxPool3d)


class ActAvgPoolMixin(ActModule):
    """For ``nn.AvgPool1d/2d/3d`` and subclasses that keep their forward: saves nothing (no slot)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        return act_avg_pool(x, _spatial_dims(self), self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, getattr(self, "divisor_override", None))


class ActAvgPool1d(ActAvgPoolMixin, nn.AvgPool1d):
    """``nn.AvgPool1d`` saving nothing for backward."""


class ActAvgPool2d(ActAvgPoolMixin, nn.AvgPool2d):
    """``nn.AvgPool2d`` saving nothing for backward."""


class ActAvgPool3d(ActAvgPoolMixin, nn.AvgPool3d):
    """``nn.AvgPool3d`` saving nothing for backward."""


register_act_class(nn.AvgPool1d, ActAvgPoolMixin, ActAvgPool1d)
register_act_class(nn.AvgPool2d, ActAvgPoolMixin, ActAvgPool2d)
register_act_class(nn.AvgPool3d, ActAvgPoolMixin, ActAvgPool3d)
