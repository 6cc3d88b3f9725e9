"""Max pooling: exact output and gradient, window positions saved at ceil(log2(K)) bits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from act_hf.context import track_saved
from act_hf.errors import ActHFValueError
from act_hf.nn._base import convert, revert
from act_hf.nn.pooling import ActAvgPool2d, ActAvgPoolMixin, ActMaxPool2d, ActMaxPoolMixin
from act_hf.ops.pooling import act_avg_pool, act_max_pool, window_bits

DTYPES = [torch.float32, torch.bfloat16]

# (nd, input shape, kernel_size, stride, padding, dilation, ceil_mode)
CONFIGS = [
    (2, (2, 3, 8, 8), 2, 2, 0, 1, False),
    (2, (2, 3, 11, 12), 3, 2, 1, 1, False),
    (2, (2, 3, 11, 12), 3, 2, 1, 1, True),
    (2, (1, 2, 9, 10), 3, 1, 1, 1, False),  # overlapping windows: accumulated gradients
    (2, (1, 2, 13, 11), 2, 1, 0, 2, True),  # dilation
    (2, (2, 2, 10, 13), (2, 3), (1, 2), (1, 0), (2, 1), True),
    (2, (1, 3, 17, 16), 5, 3, 2, 1, True),
    (2, (3, 9, 7), 3, 2, 1, 1, False),  # unbatched
    (2, (1, 1, 5, 5), 1, 1, 0, 1, False),  # 1x1 window: 1 bit
    (1, (2, 3, 19), 3, 2, 1, 1, True),
    (1, (2, 3, 20), 4, None, 0, 2, False),
    (1, (4, 21), 2, 1, 0, 1, False),  # unbatched
    (3, (1, 2, 6, 7, 8), 2, 2, 0, 1, False),
    (3, (1, 2, 7, 9, 8), 3, 2, 1, 1, True),
    (3, (1, 2, 5, 9, 10), (1, 2, 3), (1, 2, 2), (0, 1, 1), (1, 2, 1), False),
]
ORIGINAL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
MODULES = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}


def _kernel(nd, k):
    return (k,) * nd if isinstance(k, int) else tuple(k)


def _check(cfg, x, g=None):
    nd, _shape, k, s, p, d, ceil = cfg
    ref = ORIGINAL[nd](x, k, s, p, d, ceil_mode=ceil)
    g = torch.randn_like(ref) if g is None else g
    (g_ref,) = torch.autograd.grad(ref, x, g)
    module = convert(MODULES[nd](k, s, p, d, ceil_mode=ceil), ActMaxPoolMixin, slot="pool")
    with track_saved() as saved:
        y = module(x)
    assert type(y.grad_fn).__name__ == "ActMaxPoolFunctionBackward"
    (gx,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True)  # bit-exact, NaN where PyTorch has NaN
    assert torch.equal(gx, g_ref)
    bits = window_bits(_kernel(nd, k))
    assert saved.bytes == math.ceil(ref.numel() * bits / 8) and saved.num_tensors == 1
    assert saved.by_slot == {"pool:indices": saved.bytes}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"{c[0]}d-{i}" for i, c in enumerate(CONFIGS)])
def test_forward_and_grad_exact(cfg, dtype):
    _check(cfg, torch.randn(cfg[1]).to(dtype).requires_grad_())


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"{c[0]}d-{i}" for i, c in enumerate(CONFIGS)])
def test_ties_nan_inf(cfg):
    """Ties (first maximum wins), NaN (propagates) and -inf windows pick the same element as PyTorch."""
    x = torch.randint(-2, 3, cfg[1]).float()
    flat = x.view(-1)
    flat[::7] = float("nan")
    flat[3::11] = float("-inf")
    _check(cfg, x.requires_grad_())


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"{c[0]}d-{i}" for i, c in enumerate(CONFIGS)])
def test_positions_converted_slice_by_slice(cfg, monkeypatch):
    """With slices of one row (and of part of the first dim), the window positions and the gradient are those
    of a single pass: exact."""
    shape = cfg[1]
    monkeypatch.setattr("act_hf.ops.pooling.chunk_elements", lambda device: math.prod(shape[1:]) * 2 - 1)
    _check(cfg, torch.randn(shape).requires_grad_())
    monkeypatch.setattr("act_hf.ops.pooling.chunk_elements", lambda device: 1)
    _check(cfg, torch.randn(shape).requires_grad_())


def test_channels_last():
    x = torch.randn(2, 8, 10, 9).to(memory_format=torch.channels_last).requires_grad_()
    _check((2, x.shape, 3, 2, 1, 1, True), x)


def test_window_bits():
    assert window_bits((2, 2)) == 2 and window_bits((3, 3)) == 4 and window_bits((3, 3, 3)) == 5
    assert window_bits((1,)) == 1 and window_bits((16, 16)) == 8


def test_fallbacks_run_original():
    x = torch.randn(1, 2, 9, 9, 9, requires_grad=True)
    y = act_max_pool(x, 3, 7, 1, 3)  # 343-position window: wider than 8-bit codes
    assert type(y.grad_fn).__name__ == "MaxPool3DWithIndicesBackward0"
    x2 = torch.randn(1, 2, 8, 8, requires_grad=True)
    module = convert(nn.MaxPool2d(2, return_indices=True), ActMaxPoolMixin)
    out, idx = module(x2)
    ref, ref_idx = F.max_pool2d(x2, 2, return_indices=True)
    assert torch.equal(out, ref) and torch.equal(idx, ref_idx)


@pytest.mark.parametrize("mode", ["eval", "no_grad", "no_input_grad"])
def test_eval_no_grad_save_nothing_of_act_hf(mode):
    x = torch.randn(2, 3, 8, 8, requires_grad=mode != "no_input_grad")
    module = convert(nn.MaxPool2d(2), ActMaxPoolMixin, slot="pool")
    if mode == "eval":
        module.eval()
    with track_saved() as saved, torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        y = module(x)
    assert torch.equal(y, F.max_pool2d(x, 2))
    assert "pool:indices" not in saved.by_slot
    if mode != "eval":
        assert saved.bytes == 0


def test_checkpoint_gradients_equal():
    conv = nn.Conv2d(3, 4, 3, padding=1)
    pool = convert(nn.MaxPool2d(3, 2, 1), ActMaxPoolMixin)
    x = torch.randn(2, 3, 12, 12, requires_grad=True)

    def block(t):
        return pool(conv(t)).sum((1, 2, 3))

    g = torch.randn(2)
    (g_plain,) = torch.autograd.grad(block(x), x, g)
    (g_ckpt,) = torch.autograd.grad(checkpoint(block, x, use_reentrant=False), x, g)
    assert torch.equal(g_plain, g_ckpt)


def test_module_convert_revert():
    module = nn.MaxPool2d(3, 2, 1, ceil_mode=True)
    convert(module, ActMaxPoolMixin)
    assert type(module) is ActMaxPool2d and "ceil_mode=True" in repr(module)
    assert revert(module).__class__ is nn.MaxPool2d


def test_bad_arguments():
    x = torch.randn(1, 1, 8, 8, requires_grad=True)
    with pytest.raises(ActHFValueError, match="nd must be 1, 2 or 3"):
        act_max_pool(x, 4, 2)
    with pytest.raises(ActHFValueError, match="kernel_size must be an int or a sequence of 2 ints"):
        act_max_pool(x, 2, (2, 2, 2))
    with pytest.raises(RuntimeError, match="pad should be"):  # PyTorch's own check
        act_max_pool(x, 2, 2, 2, 3)


# (nd, input shape, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
AVG_CONFIGS = [
    (2, (2, 3, 11, 12), 3, 1, 1, False, False, None),  # PoolFormer's token mixer: overlapping, pad excluded
    (2, (2, 3, 11, 12), 2, 2, 0, True, False, None),  # ResNet-D's shortcut: ceil mode, a partial last window
    (2, (2, 3, 9, 10), (2, 3), (1, 2), (1, 1), True, True, 5),
    (2, (3, 9, 7), 3, 2, 1, False, True, None),  # unbatched
    (1, (2, 3, 19), 3, 2, 1, True, False, None),
    (1, (4, 21), 2, None, 0, False, True, None),  # unbatched
    (3, (1, 2, 6, 7, 8), 2, 2, 0, False, True, None),
    (3, (1, 2, 7, 9, 8), (1, 2, 3), (1, 2, 2), (0, 1, 1), True, False, 4),
]
AVG_MODULES = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}


AVG_CASES = [(c, d) for c in AVG_CONFIGS for d in (torch.float32, torch.bfloat16, torch.float64)
             if c[0] < 3 or d != torch.bfloat16]  # avg_pool3d has no bfloat16 CPU kernel


@pytest.mark.parametrize("cfg,dtype", AVG_CASES,
                         ids=lambda v: f"{v[0]}d-{AVG_CONFIGS.index(v)}" if isinstance(v, tuple) else str(v)[6:])
def test_avg_pool_saves_nothing_and_is_exact(cfg, dtype):
    """Autograd keeps average pooling's whole input though backward reads its shape alone; act_hf's keeps
    nothing, with the same output and gradient, bit for bit."""
    nd, shape, k, s, p, ceil, include, divisor = cfg
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    extra = {} if nd == 1 else {"divisor_override": divisor}
    module = AVG_MODULES[nd](k, s, p, ceil_mode=ceil, count_include_pad=include, **extra)
    with track_saved() as plain:
        ref = module(x)
    assert plain.bytes >= x.numel() * x.element_size()  # autograd keeps the input
    g = torch.randn_like(ref)
    (g_ref,) = torch.autograd.grad(ref, x, g)
    convert(module, ActAvgPoolMixin)
    with track_saved() as saved:
        y = module(x)
    assert saved.bytes == 0 and type(y.grad_fn).__name__ == "ActAvgPoolFunctionBackward"
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(y, ref) and torch.equal(gx, g_ref)
    assert torch.equal(act_avg_pool(x.detach(), nd, k, s, p, ceil, include, *extra.values()), ref.detach())


def test_avg_pool_module_convert_revert_and_bad_arguments():
    module = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
    convert(module, ActAvgPoolMixin)
    assert type(module) is ActAvgPool2d and module.ceil_mode and not module.count_include_pad
    assert revert(module).__class__ is nn.AvgPool2d
    x = torch.randn(1, 2, 8, requires_grad=True)
    with pytest.raises(ActHFValueError, match="nd must be 1, 2 or 3"):
        act_avg_pool(x, 4, 2)
    with pytest.raises(ActHFValueError, match="divisor_override is not an argument of 1-d"):
        act_avg_pool(x, 1, 2, divisor_override=2)
    with pytest.raises(ActHFValueError, match="kernel_size must be an int or a sequence of 1 ints"):
        act_avg_pool(x, 1, (2, 2))
