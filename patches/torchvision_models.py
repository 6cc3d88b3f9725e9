"""torchvision's ResNet blocks (``Bottleneck``, ``BasicBlock``: ResNet-18 to -152, ResNeXt, Wide ResNet), run on
the generic path: each BatchNorm after a conv, the downsample's too, writes its output into the conv's
(:func:`act_hf.nn.norm.norm_of_owned`), as in timm's blocks. The rules convert a block only when its ``forward`` is
the code the mixin reproduces; everything else in a torchvision model is the generic path's."""

from __future__ import annotations

from torch import Tensor, nn

from act_hf.nn._base import ActModule, trains_with_grad
from act_hf.nn.norm import norm_of_owned, sequential_owning
from act_hf.patcher import Rule, code_fingerprint

__all__ = ["torchvision_rules"]


def _is_torchvision_code(m: nn.Module, name: str, code: str) -> bool:
    """torchvision's class ``name`` with the ``forward`` whose :func:`code_fingerprint` is ``code``."""
    cls = type(m)
    return cls.__name__ == name and cls.__module__.startswith("torchvision.") and code_fingerprint(cls.forward) == code


def _first_two(block: nn.Module, x: Tensor) -> Tensor:
    """``bn2(conv2(relu(bn1(conv1(x)))))`` as torchvision's blocks begin, each BatchNorm written into its conv's
    output (:func:`norm_of_owned`)."""
    out = block.conv1(x)
    out = norm_of_owned(block.bn1, out, block.conv1)
    out = block.relu(out)
    out = block.conv2(out)
    return norm_of_owned(block.bn2, out, block.conv2)


def _block_end(block: nn.Module, out: Tensor, x: Tensor) -> Tensor:
    """The shortcut (the downsample's BatchNorm written into its conv's output: :func:`sequential_owning`), the
    residual add in place and the ReLU, as torchvision's blocks end."""
    identity = x if block.downsample is None else sequential_owning(block.downsample, x)
    out += identity
    return block.relu(out)


class ActTorchvisionBottleneckMixin(ActModule):
    """torchvision's ``Bottleneck`` with each BatchNorm after a conv written into the conv's output; torchvision's
    forward step for step otherwise (:data:`BOTTLENECK_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x)
        out = self.relu(_first_two(self, x))
        out = self.conv3(out)
        out = norm_of_owned(self.bn3, out, self.conv3)
        return _block_end(self, out, x)


#: :func:`code_fingerprint` of the ``Bottleneck.forward`` :class:`ActTorchvisionBottleneckMixin` reproduces
#: (torchvision 0.2x).
BOTTLENECK_FORWARD = "69ff145d4433fa78"


class ActTorchvisionBasicBlockMixin(ActModule):
    """torchvision's ``BasicBlock`` as :class:`ActTorchvisionBottleneckMixin` runs a bottleneck
    (:data:`BASIC_BLOCK_FORWARD`)."""

    def forward(self, x: Tensor) -> Tensor:
        if not trains_with_grad(self):
            return super().forward(x)
        return _block_end(self, _first_two(self, x), x)


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
