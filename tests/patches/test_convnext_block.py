"""timm's ConvNeXt block (``ActConvNeXtBlockMixin``) hands its channels-last MLP the LayerNorm's output to own:
timm's values and gradients bit for bit, and the MLP's input freed once ``fc1`` has read it."""

from __future__ import annotations

import weakref

import pytest
import torch

import act_hf
from act_hf.patches.timm_models import ActConvNeXtBlockMixin


def _blocks(conv_mlp: bool):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=3, conv_mlp=conv_mlp)
    act_hf.patch(model, bits=3).train()
    blocks = [m for m in model.modules() if isinstance(m, ActConvNeXtBlockMixin)]
    assert blocks and all(b.use_conv_mlp == conv_mlp for b in blocks)
    return blocks


def _norm_alive_at_fc2(block, x) -> bool:
    seen: dict[str, object] = {}
    handles = [block.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("ref", weakref.ref(out))),
               block.mlp.fc2.register_forward_pre_hook(lambda m, a: seen.__setitem__("alive", seen["ref"]() is not None))]
    try:
        block(x).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return seen["alive"]


@pytest.mark.parametrize("conv_mlp", [False, True], ids=["channels-last", "conv-mlp"])
def test_the_mlps_input_is_gone_once_fc1_has_read_it_unless_a_hook_could_see_the_mlp(conv_mlp):
    block = _blocks(conv_mlp)[0]
    x = torch.randn(2, block.conv_dw.in_channels, 8, 8, requires_grad=True)
    assert not _norm_alive_at_fc2(block, x)
    handle = block.mlp.register_forward_hook(lambda m, a, out: None)
    try:
        assert _norm_alive_at_fc2(block, x)
    finally:
        handle.remove()


@pytest.mark.parametrize("conv_mlp", [False, True], ids=["channels-last", "conv-mlp"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_block_is_timms_bit_for_bit(autocast, conv_mlp):
    """The MLP handed its input, against the MLP called as timm calls it (forced by a hook on it). A first step
    runs before: it packs the block's input, whose packed copy a residual note then keeps while that tensor lives
    (:func:`act_hf.derived.note_packed`), so the later steps draw one seed fewer than the first."""
    block = _blocks(conv_mlp)[1]
    x = torch.randn(2, block.conv_dw.in_channels, 8, 8, requires_grad=True)
    block(x).sum().backward()
    results = []
    for hooked in (False, True):
        handle = block.mlp.register_forward_hook(lambda m, a, out: None) if hooked else None
        act_hf.manual_seed(0)
        block.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = block(x)
        y.float().square().sum().backward()
        results.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in block.parameters()]))
        if handle is not None:
            handle.remove()
    (y, gx, gp), (y_ref, gx_ref, gp_ref) = results
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert all(torch.equal(a, b) for a, b in zip(gp, gp_ref))
