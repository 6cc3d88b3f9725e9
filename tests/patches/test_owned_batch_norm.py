"""timm's ResNet, EfficientNet / MobileNet and ConvNormAct blocks, and torchvision's ResNet blocks, with each
BatchNorm after a conv writing into the conv's output (``norm_of_owned``): the same outputs, running statistics,
gradients and saved bytes as without, fewer full-size tensors in forward, and the out-of-place call wherever a hook
could keep or read the conv's output."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from torch import nn

import act_hf
from act_hf.context import track_saved
from act_hf.ops import norm as norm_ops
from tests.utils import assert_grads_match, dispatched, forward_peak, stub_codec

# model -> the block mixins it is built of (ResNets: conv or average-pool downsamples; EfficientNet: SiLU
# BatchNorms in the input form, the projections' in the fused output form; MobileNetV2: ReLU6, read by the next
# conv from BatchNorm's packed input; EfficientNetV2: fused expansions; RegNet: timm's ConvNormAct)
MODELS = {"resnet18": {"ActResNetBasicBlockMixin"},
          "resnet26d": {"ActResNetBottleneckMixin"},
          "efficientnet_b0": {"ActDepthwiseSeparableMixin", "ActInvertedResidualMixin"},
          "mobilenetv2_100": {"ActDepthwiseSeparableMixin", "ActInvertedResidualMixin"},
          "efficientnetv2_rw_t": {"ActConvBnActMixin", "ActEdgeResidualMixin", "ActInvertedResidualMixin"},
          "mobilenetv3_large_100": {"ActConvBnActMixin", "ActDepthwiseSeparableMixin", "ActInvertedResidualMixin"},
          "regnetx_002": {"ActConvNormActMixin"},  # this one, MobileNetV3 and torchvision's: the fallback's hooks
          "torchvision:resnet18": {"ActTorchvisionBasicBlockMixin"},
          "torchvision:resnet50": {"ActTorchvisionBottleneckMixin"}}


def _model(name: str) -> nn.Module:
    if name.startswith("torchvision:"):
        import torchvision

        return getattr(torchvision.models, name.split(":")[1])(num_classes=3)
    return timm.create_model(name, num_classes=3)


def _count_writes(monkeypatch) -> list[int]:
    calls = [0]
    into = norm_ops._bn_forward_into

    def counted(*args):
        calls[0] += 1
        return into(*args)

    monkeypatch.setattr(norm_ops, "_bn_forward_into", counted)
    return calls


def _block_norms(model: nn.Module, mixins: set[str]) -> int:
    """The BatchNorms inside the converted blocks (each follows a conv)."""
    blocks = [m for m in model.modules() if {c.__name__ for c in type(m).__mro__} & mixins]
    return sum(isinstance(m, nn.BatchNorm2d) for block in blocks for m in block.modules())


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("autocast", [False, True])
def test_blocks_write_batch_norm_into_the_conv_output(monkeypatch, name, autocast):
    """Every BatchNorm inside the blocks writes into its conv's output; the logits and the running statistics are
    the unpatched model's bit for bit over two training steps (fp32, and bf16 autocast), the gradients match it
    (8 bits), and the saved bytes are those of the out-of-place calls (an output the fused In-Place ABN form
    packs as it is written stays the copy the next conv reads)."""
    torch.manual_seed(0)
    ref = _model(name).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    norms = _block_norms(model, MODELS[name])
    assert norms >= 8
    writes = _count_writes(monkeypatch)
    for step in range(2):
        x = torch.randn(4, 3, 64, 64)
        ref.zero_grad()
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y_ref = ref(x)
            with track_saved(model) as saved:
                y = model(x)
        assert torch.equal(y, y_ref)
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))
        y_ref.float().square().sum().backward()
        y.float().square().sum().backward()
        assert_grads_match(ref, model, cos=0.99 if autocast else 0.999, tol=3e-3, name=name)
    assert writes[0] == 2 * norms
    monkeypatch.setattr(norm_ops, "writes_in_place", lambda *args: False)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), track_saved(model) as out_of_place:
        model(x)
    assert saved.bytes == out_of_place.bytes and writes[0] == 2 * norms


def test_a_hook_on_the_conv_keeps_its_output(monkeypatch):
    """A forward hook on a conv could keep its output: that block's BatchNorm writes a new tensor, and what the
    hook kept is still the conv's output; the other BatchNorms write into their conv's."""
    torch.manual_seed(1)
    model = act_hf.patch(timm.create_model("resnet18", num_classes=3), bits=8).train()
    kept = []
    model.layer2[0].conv2.register_forward_hook(lambda mod, args, out: kept.append((out, out.clone())))
    writes = _count_writes(monkeypatch)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert writes[0] == _block_norms(model, MODELS["resnet18"]) - 1
    assert torch.equal(*kept[0])


# model, block, size: a bottleneck's output (its input's size) made by its last conv and BatchNorm; an inverted
# residual's expansion made by its pointwise and depthwise convs and their two BatchNorms
BLOCKS = {"resnet26d-bottleneck": ("resnet26d", lambda m: m.layer1[1], ("conv3",), 1, lambda b: b.conv1.in_channels),
          "mobilenetv2-inverted-residual": ("mobilenetv2_100", lambda m: m.blocks[1][1], ("conv_pw", "conv_dw"), 2,
                                            lambda b: b.conv_pw.out_channels)}


@pytest.mark.parametrize("case", list(BLOCKS))
def test_a_block_makes_fewer_full_size_tensors(case):
    """Each conv's output, then BatchNorm's, were two tensors of that size, alive at once; written into the conv's
    output, BatchNorm's is the conv's: one (hooks on the convs force the out-of-place calls, and the second)."""
    name, get_block, convs, count, channels = BLOCKS[case]
    torch.manual_seed(2)
    block = get_block(act_hf.patch(timm.create_model(name, num_classes=3), bits=3).train())
    in_channels = block.conv1.in_channels if hasattr(block, "conv1") else block.conv_pw.in_channels
    x = torch.randn(2, in_channels, 16, 16).bfloat16().requires_grad_()
    size = 2 * channels(block) * 16 * 16

    def full_size_storages() -> int:
        fresh = x.detach().clone().requires_grad_()  # not a cached copy's input
        with torch.autocast("cpu", torch.bfloat16):
            ops = dispatched(lambda: block(fresh))
        return len({t.untyped_storage().data_ptr() for _, outputs in ops for t in outputs
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == size}
                   - {fresh.untyped_storage().data_ptr()})

    assert full_size_storages() == count
    handles = [getattr(block, conv).register_forward_hook(lambda mod, args, out: None) for conv in convs]
    assert full_size_storages() == 2 * count
    for handle in handles:
        handle.remove()


@pytest.mark.cuda
def test_a_bottleneck_holds_one_conv_output_fewer_on_a_gpu(monkeypatch):
    """On a GPU (cuDNN's convolutions allocate their output and a workspace only), the highest point of a
    bottleneck's forward drops by about one block-output tensor. Codec stubbed: its kernels allocate their
    outputs only too."""
    stub_codec(monkeypatch)
    torch.manual_seed(2)
    block = act_hf.patch(timm.create_model("resnet26d", num_classes=3), bits=3).cuda().train().layer1[1]
    x = torch.randn(32, block.conv1.in_channels, 56, 56, device="cuda").bfloat16().requires_grad_()
    output = x.numel() * x.element_size()
    in_place = forward_peak(block, x.detach().clone().requires_grad_())
    handle = block.conv3.register_forward_hook(lambda mod, args, out: None)
    out_of_place = forward_peak(block, x.detach().clone().requires_grad_())
    handle.remove()
    assert out_of_place - in_place >= 0.9 * output, (in_place, out_of_place, output)


def test_the_fallbacks_scope_hooks_let_a_module_write_through_but_not_be_bypassed():
    """Without a family the fallback hooks act_hf's modules to open and close its saved-tensor scopes; they keep
    no tensor, so BatchNorm may still write into its conv's output (``may_write_through``), but calling a module's
    ``forward`` directly would skip them (``_calls_only_forward`` is strict). A user's hook counts."""
    from act_hf.nn.activation import _calls_only_forward, may_write_through

    model = act_hf.patch(timm.create_model("regnetx_002", num_classes=3), bits=3).train()
    bn = model.stem.bn
    assert bn._forward_pre_hooks and bn._forward_hooks
    assert may_write_through(bn) and not _calls_only_forward(bn)
    handle = bn.register_forward_hook(lambda mod, args, out: None)
    assert not may_write_through(bn)
    handle.remove()


@pytest.mark.parametrize("act_layer", [nn.ELU, nn.Identity])
def test_the_fused_form_writes_its_activation_into_the_conv_output(monkeypatch, act_layer):
    """timm's ``ConvNormAct`` with an ELU or none: the fused In-Place ABN form writes BatchNorm's output and then
    the activation's into the conv's output, returns it, and packs it as written; logits and gradients match the
    unpatched stack's (8 bits), and the next conv reads that packed copy rather than packing its input again."""
    from timm.layers import ConvNormAct

    torch.manual_seed(3)
    ref = nn.Sequential(*[ConvNormAct(3 if i == 0 else 8, 8, 3, act_layer=act_layer) for i in range(3)]).train()
    model = act_hf.patch(copy.deepcopy(ref), bits=8)
    writes = _count_writes(monkeypatch)
    x = torch.randn(4, 3, 16, 16)
    with track_saved(model) as saved:
        y = model(x)
    y_ref = ref(x)
    assert torch.equal(y, y_ref) and writes[0] == 3
    assert {slot for slot in saved.by_slot if slot.endswith("conv:input")} == {"0.conv:input"}, saved.by_slot
    g = torch.randn_like(y)  # not y.square().sum(): a BatchNorm output's is its gamma's alone
    y.backward(g)
    y_ref.backward(g)
    assert_grads_match(ref, model, name=act_layer.__name__)
