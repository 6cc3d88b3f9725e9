"""The packed element-wise product: forward exact, gradients against autograd with the packed operands, unbiased."""

from __future__ import annotations

import pytest
import torch

from act_hf.compress import dequantize, manual_seed, quantize
from act_hf.context import track_saved
from act_hf.ops._saving import OpSettings
from act_hf.ops.product import act_product

A, B = OpSettings(slot="m:gate_act", bits=3), OpSettings(slot="m:up", bits=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_exact_and_grads_are_autograds_with_packed_operands(dtype):
    torch.manual_seed(0)
    a, b = torch.randn(3, 7, 64, dtype=dtype), torch.randn(3, 7, 64, dtype=dtype)
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    aa, ba = a.clone().requires_grad_(), b.clone().requires_grad_()
    yr = ar * br
    manual_seed(3)
    ya = act_product(aa, ba, A, B)
    assert ya.dtype == yr.dtype and torch.equal(ya, yr)
    g = torch.randn_like(yr)
    ya.backward(g)
    manual_seed(3)  # the op's draws, in its order: a first, then b
    a_hat, b_hat = dequantize(quantize(a, 3, 256)), dequantize(quantize(b, 3, 256))
    torch.testing.assert_close(aa.grad, (g * b_hat).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(ba.grad, (g * a_hat).to(dtype), rtol=0, atol=0)


def test_gradients_are_unbiased_over_draws():
    torch.manual_seed(1)
    a, b, g = torch.randn(4, 256), torch.randn(4, 256), torch.randn(4, 256)
    exact_a, exact_b = g * b, g * a
    acc_a, acc_b = torch.zeros_like(a), torch.zeros_like(b)
    errors = []
    for k in range(1, 401):
        aa, ba = a.clone().requires_grad_(), b.clone().requires_grad_()
        act_product(aa, ba, OpSettings("m:a", 2), OpSettings("m:b", 2)).backward(g)
        acc_a += aa.grad
        acc_b += ba.grad
        if k in (25, 400):
            errors.append(((acc_a / k - exact_a).norm() + (acc_b / k - exact_b).norm()).item())
    assert errors[1] < errors[0] / 2.5, errors  # the mean's error shrinks like 1/sqrt(draws)


def test_saves_only_what_the_gradients_need():
    a, b = torch.randn(8, 512), torch.randn(8, 512)
    with track_saved() as saved:
        act_product(a.clone().requires_grad_(), b, A, B)  # only a needs a gradient: b is kept, a is not
    assert set(saved.by_slot) == {"m:up"}
    with track_saved() as saved:
        act_product(a.clone().requires_grad_(), b.clone().requires_grad_(), A, B)
    assert set(saved.by_slot) == {"m:gate_act", "m:up"} and saved.bytes < 2 * a.numel() * 4 / 8
    broadcast = act_product(a, b[:1], A, B)  # different shapes: the plain product
    assert torch.equal(broadcast, a * b[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_into_a_is_the_product_and_its_gradients(dtype):
    """``into_a``: the product written into ``a`` (returned, the same storage) after both operands are packed: the
    values and both gradients of the out-of-place product, bit for bit, with ``a`` made by an op upstream."""
    torch.manual_seed(0)
    leaf_a, b = torch.randn(3, 7, 64, dtype=dtype), torch.randn(3, 7, 64, dtype=dtype)
    results = []
    for into_a in (False, True):
        la, lb = leaf_a.clone().requires_grad_(), b.clone().requires_grad_()
        a = la * 2  # not a leaf: an activation's output, say
        manual_seed(3)
        y = act_product(a, lb, A, B, into_a=into_a)
        assert (y.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()) == into_a
        y.backward(torch.ones_like(y))
        results.append((y.detach(), la.grad, lb.grad))
    assert all(torch.equal(p, q) for p, q in zip(*results))


def test_the_product_into_a_steps_aside_where_it_cannot_write_into_a():
    """A leaf that needs a gradient, an operand sharing ``a``'s memory, or a product of a wider dtype than ``a``'s:
    the out-of-place product, as without ``into_a``."""
    a, b = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64)
    for x, y in ((a, b), (a * 1, None), (torch.randn(4, 64, dtype=torch.bfloat16), b)):
        y = x if y is None else y
        before = x.detach().clone()
        out = act_product(x, y, A, B, into_a=True)
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        assert torch.equal(x.detach(), before) and torch.equal(out, before * y.detach())
