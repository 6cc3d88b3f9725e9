"""timm's Swin block with its attention's input made in a call of its own (``ActSwinBlockMixin``): timm's values
and gradients bit for bit, shifted or not, padded or not, and a lower highest point of the block's forward."""

from __future__ import annotations

import functools

import pytest
import torch

import act_hf
from act_hf.patches.timm_models import ActSwinBlockMixin
from tests.utils import load_benchmark


def _swin(img_size: int, mlp_ratio: float = 4.0):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=img_size,
                              window_size=7, embed_dim=24, depths=(2, 2), num_heads=(1, 2), mlp_ratio=mlp_ratio)
    return act_hf.patch(model, bits=3).train()


def _blocks(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if any(c.__name__ == "ActSwinBlockMixin" for c in type(m).__mro__)]


def _timm_forward(block, x):
    """timm's own ``forward`` of a converted block (its submodules still act_hf's)."""
    return super(ActSwinBlockMixin, block).forward(x)


@pytest.mark.parametrize("img_size", [56, 60], ids=["windows fit", "padded"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_block_is_timms_bit_for_bit(img_size, autocast):
    model = _swin(img_size)
    blocks = _blocks(model)
    assert len(blocks) == 4 and any(any(b.shift_size) for b in blocks)
    for block in blocks:
        x = torch.randn(2, *block.input_resolution, block.norm1.normalized_shape[0], requires_grad=True)
        results = []
        for forward in (block, functools.partial(_timm_forward, block)):
            act_hf.manual_seed(0)
            torch.manual_seed(0)  # stochastic depth
            block.zero_grad(set_to_none=True)
            x.grad = None
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                y = forward(x)
            y.float().square().sum().backward()
            results.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in block.parameters()]))
        (y, gx, gp), (y_ref, gx_ref, gp_ref) = results
        assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
        assert all(torch.equal(a, b) for a, b in zip(gp, gp_ref))


def test_the_attention_input_is_made_without_timms_intermediates_alive(monkeypatch):
    """The highest point of a shifted block's forward is lower than timm's by about the two block-sized
    tensors timm's ``_attn`` holds beside the windows (the codec's CPU reference stubbed, as on a GPU; an MLP
    as wide as the block, so that attention holds the highest point)."""
    from act_hf.compress import reference

    for name, stub in load_benchmark("benchmark_host_overhead").STUBS.items():
        monkeypatch.setattr(reference, name, stub)
    profile_peak = load_benchmark("memory_at_peak").profile_peak
    block = next(b for b in _blocks(_swin(56, mlp_ratio=1.0)) if any(b.shift_size))
    x = torch.randn(8, *block.input_resolution, block.norm1.normalized_shape[0], requires_grad=True)
    size = x.numel() * x.element_size()

    def forward_peak(forward) -> int:
        return profile_peak(lambda: forward(x).square().sum(), x.device)["phases"]["forward"]["peak"]

    torch.manual_seed(0)
    ours = forward_peak(block)
    torch.manual_seed(0)
    timms = forward_peak(functools.partial(_timm_forward, block))
    assert timms - ours >= 1.9 * size, (ours, timms, size)  # two tensors, less small blocks freed between


@pytest.mark.cuda
def test_on_the_gpu_the_attention_input_is_made_without_timms_intermediates_alive():
    """On a GPU under bf16 autocast: a shifted block's forward peaks at least two fp32 block-sized tensors (the
    LayerNorm output and the padded copy) below timm's forward of the same block."""
    block = next(b for b in _blocks(_swin(56, mlp_ratio=1.0)) if any(b.shift_size)).cuda()
    x = torch.randn(64, *block.input_resolution, block.norm1.normalized_shape[0], device="cuda", requires_grad=True)
    size = x.numel() * 4

    def peak(forward) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", torch.bfloat16):
            out = forward(x)
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - start

    torch.manual_seed(0)
    ours = peak(block)
    torch.manual_seed(0)
    timms = peak(functools.partial(_timm_forward, block))
    assert timms - ours >= 1.9 * size, (ours, timms, size)
