"""Dropout: the same masks as PyTorch for the same seed, the exact gradient, a 1-bit saved mask."""

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
from act_hf.nn.dropout import ActDropout, ActDropoutMixin
from act_hf.ops._saving import OpSettings
from act_hf.ops.dropout import ActDropoutFunction, act_dropout, uses_fused_dropout

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(7,), (3, 5, 11), (1, 1, 1023), (64, 129), (2, 3, 4097)]
PS = [0.1, 0.5, 0.9]


def _next_draw() -> int:
    return int(torch.randint(1 << 30, ()))


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_seed_same_output_and_grad(dtype, shape, p):
    x = torch.randn(shape).to(dtype).requires_grad_()
    g = torch.randn(shape).to(dtype)
    torch.manual_seed(7)
    ref = F.dropout(x, p, True)
    after_ref = _next_draw()
    (g_ref,) = torch.autograd.grad(ref, x, g)

    torch.manual_seed(7)
    with track_saved() as saved:
        y = act_dropout(x, p, True, settings=OpSettings("drop:mask", 1))
    after = _next_draw()
    (gx,) = torch.autograd.grad(y, x, g)
    assert type(y.grad_fn).__name__ == "ActDropoutFunctionBackward"
    assert torch.equal(y, ref)
    assert after == after_ref  # the generator advanced exactly as much
    assert torch.equal(gx, g_ref) and gx.dtype == dtype
    assert saved.bytes == math.ceil(x.numel() / 8) and saved.num_tensors == 1
    assert saved.by_slot == {"drop:mask": saved.bytes}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_matches_nn_dropout(dtype):
    x = torch.randn(16, 333).to(dtype).requires_grad_()
    module = nn.Dropout(0.3)
    torch.manual_seed(3)
    refs = [module(x) for _ in range(3)]  # consecutive draws
    convert(module, ActDropoutMixin, slot="layer.dropout")
    assert type(module) is ActDropout
    torch.manual_seed(3)
    with track_saved() as saved:
        ys = [module(x) for _ in range(3)]
    for y, ref in zip(ys, refs):
        assert torch.equal(y, ref)
        g = torch.randn_like(y)
        assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0])
    assert saved.bytes == 3 * math.ceil(x.numel() / 8)
    assert set(saved.by_slot) == {"layer.dropout:mask"}
    assert revert(module).__class__ is nn.Dropout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace(dtype):
    leaf = torch.randn(9, 101).to(dtype).requires_grad_()
    g = torch.randn(9, 101).to(dtype)
    torch.manual_seed(5)
    ref_in = leaf * 1.0
    ref = nn.Dropout(0.4, inplace=True)(ref_in)
    assert ref is ref_in
    (g_ref,) = torch.autograd.grad(ref, leaf, g)
    torch.manual_seed(5)
    x = leaf * 1.0
    module = convert(nn.Dropout(0.4, inplace=True), ActDropoutMixin)
    with track_saved() as saved:
        y = module(x)
    assert y is x and torch.equal(y, ref)
    assert torch.equal(torch.autograd.grad(y, leaf, g)[0], g_ref)
    assert saved.bytes == math.ceil(x.numel() / 8)


def test_inplace_on_leaf_raises_like_original():
    leaf = torch.randn(10, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        F.dropout(leaf, 0.5, True, inplace=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        act_dropout(leaf, 0.5, True, inplace=True)


def test_non_contiguous_input():
    x = torch.randn(300, 200).t().requires_grad_()
    torch.manual_seed(1)
    ref = F.dropout(x, 0.25, True)
    torch.manual_seed(1)
    y = act_dropout(x, 0.25, True)
    g = torch.randn(200, 300)
    assert torch.equal(y, ref)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0])


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_p_edge_cases_run_original(p):
    x = torch.randn(5, 7, requires_grad=True)
    torch.manual_seed(2)
    ref = F.dropout(x, p, True)
    after_ref = _next_draw()
    torch.manual_seed(2)
    y = act_dropout(x, p, True)
    assert _next_draw() == after_ref
    assert torch.equal(y, ref)
    assert type(y.grad_fn).__name__ != "ActDropoutFunctionBackward"
    g = torch.randn(5, 7)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0])


@pytest.mark.parametrize("mode", ["eval", "no_grad", "no_input_grad"])
def test_eval_no_grad_run_original(mode):
    x = torch.randn(20, 30, requires_grad=mode != "no_input_grad")
    module = convert(nn.Dropout(0.5), ActDropoutMixin)
    ref_module = nn.Dropout(0.5)
    if mode == "eval":
        module.eval()
        ref_module.eval()
    torch.manual_seed(4)
    with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        ref = ref_module(x)
    torch.manual_seed(4)
    with track_saved() as saved, torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        y = module(x)
    assert torch.equal(y, ref)
    assert saved.bytes == 0
    if mode == "no_input_grad":  # the Function itself saves nothing either
        torch.manual_seed(4)
        with track_saved() as saved:
            z = ActDropoutFunction.apply(x, 0.5, False, "s")
        assert saved.bytes == 0 and torch.equal(z, ref)


def test_checkpoint_gradients_equal():
    lin = nn.Linear(16, 16)
    drop = convert(nn.Dropout(0.3), ActDropoutMixin)
    x = torch.randn(8, 16, requires_grad=True)

    def block(t):
        return drop(lin(t)).sum(-1)

    g = torch.randn(8)
    torch.manual_seed(11)
    (g_plain,) = torch.autograd.grad(block(x), x, g)
    torch.manual_seed(11)
    (g_ckpt,) = torch.autograd.grad(checkpoint(block, x, use_reentrant=False), x, g)
    assert torch.equal(g_plain, g_ckpt)


def test_fused_path_selection():
    x = torch.randn(4)
    assert not uses_fused_dropout(x, 0.5)  # CPU: bernoulli_ + div_ + mul, as at::dropout
    assert uses_fused_dropout(torch.empty(4, device="meta"), 0.5) is False


@pytest.mark.parametrize("p", [-0.1, 1.5, "0.5", True])
def test_bad_p(p):
    with pytest.raises(ActHFValueError, match="between 0 and 1"):
        act_dropout(torch.randn(3, requires_grad=True), p)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_native_dropout(dtype):
    x = torch.randn(33, 1025, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    for inplace in (False, True):
        torch.manual_seed(9)
        xin = x * 1.0
        ref = F.dropout(xin, 0.2, True, inplace=inplace)
        (g_ref,) = torch.autograd.grad(ref, x, g)
        torch.manual_seed(9)
        xin = x * 1.0
        y = act_dropout(xin, 0.2, True, inplace=inplace)
        assert torch.equal(y, ref)
        assert torch.equal(torch.autograd.grad(y, x, g)[0], g_ref)
