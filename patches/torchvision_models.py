"""torchvision's ResNet blocks (``Bottleneck``, ``BasicBlock``: ResNet-18 to -152, ResNeXt, Wide ResNet), run on
the generic path: each BatchNorm after a conv, the downsample's too, writes its output into the conv's
(:func:`act_hf.nn.norm.norm_of_owned`), as in timm's blocks. The rules convert a block only when its ``forward`` is
the code the mixin reproduces; everything else in a torchvision model is the generic path's."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from act_hf.nn._base import ActModule
from act_hf.nn.norm import norm_of_owned, sequential_owning
from act_hf.patcher import Rule, code_fingerprint

__all__ = ["torchvision_rules"]


def _is_torchvision_code(m: nn.Module, name: str, code: str) -> bool:
    """torchvision's class ``name`` with the ``forward`` whose :func:`code_fingerprint` is ``code``."""
    cls = type(m)
    return cls.__name__ == name and cls.__module__.startswith("torchvision.") and code_fingerprint(cls.forward) == code


def _compressing(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


class ActTorchvisionBottleneckMixin(ActModule):
    """torchvision's ``Bottleneck`` with each BatchNorm after a conv written into the conv's output; torchvision's
    forward step for step otherwise (:data:`BOTTLENECK_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not _compressing(self):
            return super().forward(x)
        identity = x
        out = self.conv1(x)
        out = norm_of_owned(self.bn1, out, self.conv1)
        out = self.relu(out)
        out = self.conv2(out)
        out = norm_of_owned(self.bn2, out, self.conv2)
        out = self.relu(out)
        out = self.conv3(out)
        out = norm_of_owned(self.bn3, out, self.conv3)
        if self.downsample is not None:
            identity = sequential_owning(self.downsample, x)
        out += identity
        return self.relu(out)


#: :func:`code_fingerprint` of the ``Bottleneck.forward`` :class:`ActTorchvisionBottleneckMixin` reproduces
#: (torchvision 0.2x).
BOTTLENECK_FORWARD = "69ff145d4433fa78"


class ActTorchvisionBasicBlockMixin(ActModule):
    """torchvision's ``BasicBlock`` as :class:`ActTorchvisionBottleneckMixin` runs a bottleneck
    (:data:`BASIC_BLOCK_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not _compressing(self):
            return super().forward(x)
        identity = x
        out = self.conv1(x)
        out = norm_of_owned(self.bn1, out, self.conv1)
        out = self.relu(out)
        out = self.conv2(out)
        out = norm_of_owned(self.bn2, out, self.conv2)
        if self.downsample is not None:
            identity = sequential_owning(self.downsample, x)
        out += identity
        return self.relu(out)


#: :func:`code_fingerprint` of the ``BasicBlock.forward`` :class:`ActTorchvisionBasicBlockMixin` reproduces
#: (torchvision 0.2x).
BASIC_BLOCK_FORWARD = "526c00339e0341fc"


def torchvision_rules() -> list[Rule]:
    """Rules for torchvision's blocks, in front of the generic torch ones."""
    return [
        Rule("norm", lambda m: _is_torchvision_code(m, "Bottleneck", BOTTLENECK_FORWARD),
             lambda m: ActTorchvisionBottleneckMixin),
        Rule("norm", lambda m: _is_torchvision_code(m, "BasicBlock", BASIC_BLOCK_FORWARD),
             lambda m: ActTorchvisionBasicBlockMixin),
    ]
