"""Drop-in ``nn.Dropout`` that saves its mask at 1 bit an element.

Only ``nn.Dropout`` is converted. ``Dropout1d/2d/3d`` (feature dropout) keep one noise value per channel, which
is already negligible next to the activations, and ``AlphaDropout`` saves an affine noise; both are left as
they are.
"""

from __future__ import annotations

import logging

from torch import Tensor, nn

from ..ops.dropout import act_dropout
from ._base import ActModule, register_act_class

__all__ = ["ActDropout", "ActDropoutMixin"]

logger = logging.getLogger(__name__)


class ActDropoutMixin(ActModule):
    """For ``nn.Dropout``: the same output and RNG use as the original; slot ``<path>:mask``."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        return act_dropout(x, self.p, True, self.inplace, settings=self.act_settings("mask"))


class ActDropout(ActDropoutMixin, nn.Dropout):
    """``nn.Dropout`` whose saved mask takes 1 bit an element."""


register_act_class(nn.Dropout, ActDropoutMixin, ActDropout)
