"""timm's ConvNeXt block (``ActConvNeXtBlockMixin``) hands its MLP (channels-last or 1x1 convs) the norm's output
to own: timm's values and gradients bit for bit, and the MLP's input freed once ``fc1`` has read it."""

from __future__ import annotations

import functools

import pytest
import torch

import act_hf
from act_hf.patches.timm_models import ActConvNeXtBlockMixin
from tests.utils import alive_unhooked_and_hooked, assert_same_steps


def _blocks(conv_mlp: bool):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=3, conv_mlp=conv_mlp)
    act_hf.patch(model, bits=3).train()
    blocks = [m for m in model.modules() if isinstance(m, ActConvNeXtBlockMixin)]
    assert blocks and all(b.use_conv_mlp == conv_mlp for b in blocks)
    return blocks


@pytest.mark.parametrize("conv_mlp", [False, True], ids=["channels-last", "conv-mlp"])
def test_the_mlps_input_is_gone_once_fc1_has_read_it_unless_a_hook_could_see_the_mlp(conv_mlp):
    block = _blocks(conv_mlp)[0]
    x = torch.randn(2, block.conv_dw.in_channels, 8, 8, requires_grad=True)
    run = lambda: block(x).sum().backward()
    assert alive_unhooked_and_hooked(block.norm, block.mlp.fc2, block.mlp, run) == (False, True)


@pytest.mark.parametrize("conv_mlp", [False, True], ids=["channels-last", "conv-mlp"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_block_is_timms_bit_for_bit(autocast, conv_mlp):
    """The MLP handed its input, against the MLP called as timm calls it (forced by a hook on it). A first step
    runs before: it packs the block's input, whose packed copy a residual note then keeps while that tensor lives
    (:func:`act_hf.derived.note_packed`), so the later steps draw one seed fewer than the first."""
    block = _blocks(conv_mlp)[1]
    x = torch.randn(2, block.conv_dw.in_channels, 8, 8, requires_grad=True)
    block(x).sum().backward()
    assert_same_steps(block, x, (block, functools.partial(_mlp_called_as_timm_calls_it, block)), autocast=autocast)


def _mlp_called_as_timm_calls_it(block, x):
    """The block's forward with its MLP called through ``__call__`` (a hook on it sees the call)."""
    handle = block.mlp.register_forward_hook(lambda m, args, out: None)
    try:
        return block(x)
    finally:
        handle.remove()
