"""An act_hf op's output takes in-place ops as the unpatched op's output does.

Some ops compute their output as a view of a tensor made inside ``forward`` (``F.linear`` of a 3-d input in
torch 2.14, a permute, a squeeze); autograd forbids in-place ops on such a view when a custom Function returns
it. ``ReLU(inplace=True)`` after a Linear (Swin V2's position-bias MLP) hit this.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from act_hf.context import track_saved
from act_hf.nn._base import convert
from act_hf.nn.linear import ActLinearMixin, ActTransposedLinearMixin
from act_hf.nn.norm import ActLayerNorm2dMixin
from act_hf.nn.pooling import ActMaxPoolMixin
from tests.utils import relative_error


def _conv1d_gpt2():
    from transformers.pytorch_utils import Conv1D

    return Conv1D(6, 4)


def _layer_norm2d():
    from timm.layers.norm import LayerNorm2d

    return LayerNorm2d(4)


CASES = {
    "linear-3d": (lambda: nn.Linear(4, 6), ActLinearMixin, (2, 5, 4)),
    "linear-4d": (lambda: nn.Linear(4, 6), ActLinearMixin, (1, 3, 3, 4)),
    "linear-no-bias": (lambda: nn.Linear(4, 6, bias=False), ActLinearMixin, (2, 5, 4)),
    "gpt2-conv1d": (_conv1d_gpt2, ActTransposedLinearMixin, (2, 5, 4)),
    "layer-norm2d": (_layer_norm2d, ActLayerNorm2dMixin, (2, 4, 3, 5)),
    "max-pool1d": (lambda: nn.MaxPool1d(3, 2), ActMaxPoolMixin, (2, 4, 9)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_in_place_op_on_the_output_gives_the_unpatched_output_and_grads(name):
    make, mixin, shape = CASES[name]
    torch.manual_seed(0)
    ref = make().double()
    act = convert(copy.deepcopy(ref), mixin, slot="m", bits=8)
    x = torch.randn(shape, dtype=torch.float64)
    xr, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = torch.relu_(ref(xr))
    with track_saved(act) as saved:
        ya = torch.relu_(act(xa))
    assert saved.bytes > 0  # the act_hf op ran, not the original
    assert torch.equal(ya, yr)
    g = torch.randn_like(yr)
    yr.backward(g)
    ya.backward(g)
    assert relative_error([xa.grad], [xr.grad]) < 0.02  # 8-bit rounding of the saved context, nothing more
    for (key, pa), pr in zip(act.named_parameters(), ref.parameters()):
        assert relative_error([pa.grad], [pr.grad]) < 0.02, key
