"""timm's ResNet blocks with each BatchNorm after a conv writing into the conv's output (``norm_of_owned``): the
same outputs, running statistics and gradients as the unpatched model, a lower highest point of forward, and the
out-of-place call wherever a hook could keep or read the conv's output."""

from __future__ import annotations

import copy

import pytest
import timm
import torch

import act_hf
from act_hf.ops import norm as norm_ops
from tests.utils import assert_grads_match, dispatched, forward_peak, stub_codec

# (model, block mixin, BatchNorms inside the blocks: bn1..bn3 of each and the downsamples')
MODELS = {"resnet18": ("ActResNetBasicBlockMixin", 2 * 8 + 3),  # conv downsamples
          "resnet26d": ("ActResNetBottleneckMixin", 3 * 8 + 4)}  # average-pool downsamples: pool, conv, BatchNorm


def _count_writes(monkeypatch) -> list[int]:
    calls = [0]
    into = norm_ops._bn_forward_into

    def counted(*args):
        calls[0] += 1
        return into(*args)

    monkeypatch.setattr(norm_ops, "_bn_forward_into", counted)
    return calls


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("autocast", [False, True])
def test_resnet_blocks_write_batch_norm_into_the_conv_output(monkeypatch, name, autocast):
    """Every BatchNorm inside the blocks writes into its conv's output; the logits and the running statistics are
    the unpatched model's bit for bit over two training steps (fp32, and bf16 autocast), and the gradients match
    it (8 bits)."""
    mixin, norms = MODELS[name]
    torch.manual_seed(0)
    ref = timm.create_model(name, num_classes=3).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    assert all(any(c.__name__ == mixin for c in type(block).__mro__) for block in model.layer1)
    writes = _count_writes(monkeypatch)
    for step in range(2):
        x = torch.randn(4, 3, 64, 64)
        ref.zero_grad()
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y_ref, y = ref(x), model(x)
        assert torch.equal(y, y_ref)
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))
        y_ref.float().square().sum().backward()
        y.float().square().sum().backward()
        assert_grads_match(ref, model, cos=0.99 if autocast else 0.999, name=name)
    assert writes[0] == 2 * norms


def test_a_hook_on_the_conv_keeps_its_output(monkeypatch):
    """A forward hook on a conv could keep its output: that block's BatchNorm writes a new tensor, and what the
    hook kept is still the conv's output; the other BatchNorms write into their conv's."""
    torch.manual_seed(1)
    model = act_hf.patch(timm.create_model("resnet18", num_classes=3), bits=8).train()
    kept = []
    model.layer2[0].conv2.register_forward_hook(lambda mod, args, out: kept.append((out, out.clone())))
    writes = _count_writes(monkeypatch)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert writes[0] == MODELS["resnet18"][1] - 1
    assert torch.equal(*kept[0])


def _bottleneck(device: str):
    torch.manual_seed(2)
    model = act_hf.patch(timm.create_model("resnet26d", num_classes=3), bits=3).to(device).train()
    return model.layer1[1]


def test_a_bottleneck_makes_one_block_sized_tensor_fewer():
    """A bottleneck's forward made two tensors of its output's size, the last conv's output and BatchNorm's (alive
    at once, beside the block's input); written into the conv's output, BatchNorm's is the conv's: one such
    tensor (a hook on the last conv forces the out-of-place call, and the second)."""
    block = _bottleneck("cpu")
    x = torch.randn(4, block.conv1.in_channels, 16, 16).bfloat16().requires_grad_()

    def block_sized_storages() -> int:
        fresh = x.detach().clone().requires_grad_()  # not a cached copy's input
        with torch.autocast("cpu", torch.bfloat16):
            ops = dispatched(lambda: block(fresh))
        return len({t.untyped_storage().data_ptr() for _, outputs in ops for t in outputs
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == x.numel()}
                   - {fresh.untyped_storage().data_ptr()})

    assert block_sized_storages() == 1
    handle = block.conv3.register_forward_hook(lambda mod, args, out: None)
    assert block_sized_storages() == 2
    handle.remove()


@pytest.mark.cuda
def test_a_bottleneck_holds_one_conv_output_fewer_on_a_gpu(monkeypatch):
    """On a GPU (cuDNN's convolutions allocate their output and a workspace only), the highest point of a
    bottleneck's forward drops by about one block-output tensor. Codec stubbed: its kernels allocate their
    outputs only too."""
    stub_codec(monkeypatch)
    block = _bottleneck("cuda")
    x = torch.randn(32, block.conv1.in_channels, 56, 56, device="cuda").bfloat16().requires_grad_()
    output = x.numel() * x.element_size()
    in_place = forward_peak(block, x.detach().clone().requires_grad_())
    handle = block.conv3.register_forward_hook(lambda mod, args, out: None)
    out_of_place = forward_peak(block, x.detach().clone().requires_grad_())
    handle.remove()
    assert out_of_place - in_place >= 0.9 * output, (in_place, out_of_place, output)
