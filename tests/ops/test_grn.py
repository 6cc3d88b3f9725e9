"""Global Response Norm: the module's own forward, gradients against float64 autograd, what is saved, which
modules are converted."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from act_hf.compress import dequantize, manual_seed, quantize
from act_hf.context import track_saved
from act_hf.nn.norm import is_global_response_norm
from act_hf.ops._saving import OpSettings
from act_hf.ops.grn import act_grn, grn_reference

S8, S3 = OpSettings("m.grn:input", 8), OpSettings("m.grn:input", 3)


def _timm(channels_last: bool, c: int = 16) -> nn.Module:
    from timm.layers.grn import GlobalResponseNorm

    return GlobalResponseNorm(c, channels_last=channels_last)


def _hf(c: int = 16) -> nn.Module:
    from transformers.models.convnextv2.modeling_convnextv2 import ConvNextV2GRN

    return ConvNextV2GRN(c)


# (name, module factory, channel dim, input shape)
MODULES = [
    ("timm-nhwc", lambda: _timm(True), -1, (2, 5, 6, 16)),
    ("timm-nchw", lambda: _timm(False), 1, (2, 16, 5, 6)),
    ("hf", _hf, -1, (2, 5, 6, 16)),
]


def _randomized(module: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


def _autograd_reference(x_hat, g, weight, bias, channel_dim, eps, dy):
    """Float64 autograd of GRN at the packed input, with the exact norms ``g``: the norm is replaced by the
    surrogate ``G(x') = g + (sum_s x' * z_hat - sum_s x_hat * z_hat)``, whose value at ``x' = x_hat`` is ``g`` and whose
    gradient is ``z_hat = x_hat / g``: what the op's backward reads."""
    channel_dim = channel_dim % x_hat.dim()
    spatial = tuple(d for d in range(1, x_hat.dim()) if d != channel_dim)
    shape = [1] * x_hat.dim()
    shape[channel_dim] = -1
    z_hat = x_hat / g
    xs = x_hat.clone().requires_grad_()
    w, b = weight.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    big_g = g + ((xs * z_hat).sum(spatial, keepdim=True) - (x_hat * z_hat).sum(spatial, keepdim=True))
    n = big_g / (big_g.mean(channel_dim, keepdim=True) + eps)
    y = xs + w.reshape(shape) * (xs * n) + b.reshape(shape)
    y.backward(dy.double())
    return xs.grad, w.grad, b.grad


@pytest.mark.parametrize(("name", "factory", "channel_dim", "shape"), MODULES, ids=[m[0] for m in MODULES])
def test_the_formula_is_the_modules_and_the_module_is_recognised(name, factory, channel_dim, shape):
    module = _randomized(factory())
    assert is_global_response_norm(module)
    x = torch.randn(shape, dtype=torch.float64)
    expected = module.double()(x)
    torch.testing.assert_close(grn_reference(x, module.weight, module.bias, channel_dim, 1e-6), expected,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("name", "factory", "channel_dim", "shape"), MODULES, ids=[m[0] for m in MODULES])
def test_forward_is_the_modules_and_gradients_are_autograds_at_the_packed_input(name, factory, channel_dim, shape,
                                                                               dtype):
    module = _randomized(factory())
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    xa = x.clone().requires_grad_()
    with torch.no_grad():
        expected = module(x)
    manual_seed(5)
    out = act_grn(xa, module.weight, module.bias, module.forward, S3, channel_dim=channel_dim)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    out.backward(dy)

    spatial = tuple(d for d in range(1, x.dim()) if d != channel_dim % x.dim())
    g = torch.linalg.vector_norm(x.float(), 2, dim=spatial, keepdim=True)
    manual_seed(5)
    z_hat = dequantize(quantize(x.float() / g, 3, 256)).double()
    gx, gw, gb = _autograd_reference(z_hat * g.double(), g.double(), module.weight, module.bias, channel_dim, 1e-6,
                                     dy.float())
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(xa.grad.double(), gx.to(dtype).double(), **tol)
    torch.testing.assert_close(module.weight.grad.double(), gw, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(module.bias.grad.double(), gb, rtol=1e-4, atol=1e-5)


@pytest.fixture
def exact_context(monkeypatch):
    """The op keeps ``x / g`` itself instead of a packed copy: its backward must then be the exact gradient."""
    from act_hf.ops import grn

    monkeypatch.setattr(grn.store, "compress_as", lambda t, settings: t)
    monkeypatch.setattr(grn, "dequantize", lambda t, dtype=None: t if dtype is None else t.to(dtype))


@pytest.mark.parametrize(("name", "factory", "channel_dim", "shape"), MODULES, ids=[m[0] for m in MODULES])
def test_with_an_exact_context_the_gradients_are_the_modules(exact_context, name, factory, channel_dim, shape):
    module = _randomized(factory())
    ref = copy.deepcopy(module).double()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    x.select(channel_dim, 3)[0] = 0  # a zero channel: torch's norm backward gives it no norm term
    xa, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    act_grn(xa, module.weight, module.bias, module.forward, S8, channel_dim=channel_dim).backward(dy)
    ref(xr).backward(dy.double())
    assert torch.isfinite(xa.grad).all()
    torch.testing.assert_close(xa.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.weight.grad.double(), ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.bias.grad.double(), ref.bias.grad, rtol=1e-5, atol=1e-5)


def test_saves_the_packed_input_and_norms_only():
    module = _randomized(_timm(True, c=64))
    x = torch.randn(4, 8, 8, 64)
    with track_saved() as saved:
        act_grn(x.clone().requires_grad_(), module.weight, module.bias, module.forward, S3)
    assert set(saved.by_slot) >= {"m.grn:input"}
    assert saved.bytes < x.numel() * 4 / 8  # fp32 x alone would be 8x this
    module.weight.requires_grad_(False)
    with track_saved() as saved:  # only bias needs a gradient: nothing of x is kept
        act_grn(x, module.weight, module.bias, module.forward, S3)
    assert saved.bytes == 0


def test_backward_makes_at_most_four_full_size_fp32_tensors():
    """Backward's fp32 work at the input's size: the gradient widened, the decoded ``z``, ``dy * z`` (summed over
    the spatial positions at once, for both gradients) and the input gradient, updated in place: at most four
    storages (the formula term by term made nine; two of them were 18.4 MiB a sample each at convnextv2-tiny's
    backward peak on the CPU)."""
    from tests.utils import dispatched

    module = _randomized(_timm(True, c=64))
    x = torch.randn(4, 8, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    y = act_grn(x, module.weight, module.bias, module.forward, S3)
    g = torch.randn_like(y)
    made = {t.untyped_storage().data_ptr() for _, outs in dispatched(lambda: y.backward(g)) for t in outs
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= x.numel()}
    assert len(made) <= 4
    assert x.grad.dtype == torch.bfloat16 and module.weight.grad is not None


def test_a_module_that_computes_something_else_is_not_recognised():
    class SquaredGRN(nn.Module):  # named like one, but squares the norm
        def __init__(self, c):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(c)), nn.Parameter(torch.randn(c))

        def forward(self, x):
            g = x.pow(2).sum((1, 2), keepdim=True)
            return x + self.weight * (x * g / (g.mean(-1, keepdim=True) + 1e-6)) + self.bias

    assert not is_global_response_norm(SquaredGRN(8))
    eps_differs = _timm(True, c=8)
    eps_differs.eps = 1e-3  # the probe runs with the module's own eps: still GRN
    assert is_global_response_norm(eps_differs)
