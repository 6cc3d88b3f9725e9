"""``ActConfig.data_bits``: a linear's or conv's input without autograd history (the batch the model is fed) is
packed at no fewer than ``data_bits`` bits."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F

import act_hf
from act_hf import ActConfig
from act_hf.context import track_saved
from act_hf.errors import ActHFTypeError, ActHFValueError
from tests.utils import packed_bytes, relative_error


def _resnet():
    torch.manual_seed(0)
    return timm.create_model("resnet18", num_classes=3).train()


def _stem_bytes(model, x) -> int:
    with track_saved(model) as saved:
        model(x)
    return saved.by_slot["conv1:input"]


@pytest.mark.parametrize("value", [0, 9, 2.5, True, "8"])
def test_config_rejects_bad_data_bits(value):
    with pytest.raises((ActHFValueError, ActHFTypeError), match="data_bits"):
        ActConfig(data_bits=value)


def test_the_floor_applies_to_fixed_bits_only():
    assert ActConfig().data_bits == 8 and ActConfig(bits=3).data_bits_floor == 8
    assert ActConfig(bits=3, data_bits=None).data_bits_floor == 0
    assert ActConfig(bits=2.5).data_bits_floor == 0  # the allocator weighs every slot
    model = act_hf.patch(_resnet(), bits=2.5)
    assert {m.act_data_bits for m in model.modules() if hasattr(m, "act_data_bits")} == {0}
    assert "without history" not in act_hf.report(model, file=False)
    assert "inputs without history at 8 bits" in act_hf.report(act_hf.patch(_resnet(), bits=3), file=False)
    assert "without history" not in act_hf.report(act_hf.patch(_resnet(), bits=8), file=False)


def test_the_image_a_stem_conv_reads_is_packed_at_data_bits():
    x = torch.randn(2, 3, 32, 32)
    n = x.numel()
    assert _stem_bytes(act_hf.patch(_resnet(), bits=3), x) == packed_bytes(n, 8)
    assert _stem_bytes(act_hf.patch(_resnet(), bits=3, data_bits=4), x) == packed_bytes(n, 4)
    assert _stem_bytes(act_hf.patch(_resnet(), bits=3, data_bits=None), x) == packed_bytes(n, 3)
    assert _stem_bytes(act_hf.patch(_resnet(), bits=8, data_bits=4), x) == packed_bytes(n, 8)  # never fewer
    # an input with autograd history is an activation like any other
    assert _stem_bytes(act_hf.patch(_resnet(), bits=3), x.clone().requires_grad_()) == packed_bytes(n, 3)


def test_a_floored_stem_makes_the_weight_gradient_closer_to_exact():
    """The stem's weight gradient comes from the image alone; at 3 bits its rounding was the largest error of
    resnet's whole gradient."""
    base = _resnet()
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([0, 1, 2, 0])

    def grads(model, seed=0):
        act_hf.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        return [p.grad for p in model.parameters()]

    exact = grads(base)
    errors = {}
    for data_bits in (8, None):
        model = act_hf.patch(copy.deepcopy(base), bits=3, data_bits=data_bits)
        errors[data_bits] = [relative_error(grads(model, seed), exact) for seed in range(2)]
    assert max(errors[8]) < 0.5 * min(errors[None]), errors
