"""StarReLU (``s * relu(x) ** 2 + b``): the op against exact autograd (float64), its unbiasedness at 3 bits, and
what it saves."""

from __future__ import annotations

import pytest
import torch

from act_hf.context import track_saved
from act_hf.ops._saving import OpSettings
from act_hf.ops.star_relu import act_star_relu
from tests.utils import relative_error


def _inputs(dtype=torch.float64, scale=0.9):
    torch.manual_seed(0)
    x = torch.randn(4, 32, 8, 8, dtype=dtype, requires_grad=True)
    s = torch.tensor([scale], dtype=dtype, requires_grad=True)
    b = torch.tensor([-0.4], dtype=dtype, requires_grad=True)
    return x, s, b


def _exact(x, s, b):
    return s * torch.relu(x) ** 2 + b  # timm's StarReLU.forward


def test_star_relu_forward_is_timms_and_gradients_match_at_8_bits():
    x, s, b = _inputs()
    g = torch.randn(x.shape, dtype=x.dtype)
    y = act_star_relu(x, s, b, OpSettings(slot="act", bits=8))
    ref = _exact(x, s, b)
    assert torch.equal(y, ref)
    got, exact = torch.autograd.grad(y, (x, s, b), g), torch.autograd.grad(ref, (x, s, b), g)
    assert relative_error([got[0]], [exact[0]]) < 0.01
    assert relative_error([got[1]], [exact[1]]) < 0.2  # one sum over 8192 products that largely cancel
    assert torch.allclose(got[2], exact[2])  # reads no context


def test_star_relu_under_bf16_autocast_is_timms_bit_for_bit():
    x, s, b = (t.detach().float().requires_grad_() for t in _inputs())
    h = x.to(torch.bfloat16)  # a bf16 activation, as a conv under autocast makes it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = act_star_relu(h, s, b, OpSettings(slot="act", bits=8))
        ref = _exact(h, s, b)
    assert y.dtype == ref.dtype == torch.float32 and torch.equal(y, ref)
    y.sum().backward()
    assert x.grad.dtype == torch.float32 and s.grad.dtype == b.grad.dtype == torch.float32


@pytest.mark.parametrize("scale", [0.9, 0.0])
def test_star_relu_gradients_are_unbiased_at_3_bits(scale):
    """Averaged over independent draws the 3-bit gradients converge to the exact ones (the error falls about as
    ``1 / sqrt(draws)``); with the scale exactly 0 the scale's gradient reads ``Q(r) ** 2``, biased by the
    rounding's variance but finite."""
    x, s, b = _inputs(scale=scale)
    g = torch.randn(x.shape, dtype=x.dtype)
    exact = torch.autograd.grad(_exact(x, s, b), (x, s, b), g)
    draws = 64
    mean = [torch.zeros_like(t) for t in exact]
    single = [0.0] * 3  # the mean error of one draw
    for _ in range(draws):
        got = torch.autograd.grad(act_star_relu(x, s, b, OpSettings(slot="act", bits=3)), (x, s, b), g)
        for i, (m, a, e) in enumerate(zip(mean, got, exact)):
            m += a / draws
            single[i] += relative_error([a], [e]) / draws
    assert all(torch.isfinite(t).all() for t in mean)
    averaged = [relative_error([m], [e]) for m, e in zip(mean, exact)]
    if scale == 0.0:
        assert averaged[0] == 0.0  # grad_x = 2 s grad r is 0
        return
    assert averaged[0] < 0.3 * single[0] and averaged[1] < 0.3 * single[1], (single, averaged)


def test_star_relu_saves_two_packed_tensors_and_the_next_linear_shares_the_output():
    """Saved: the packed ReLU output and the packed output (slots ``<base>:input``, ``<base>:output``); a conv
    reading the output packs nothing of its own at the same bits."""
    from act_hf.ops.linear import act_conv

    x, s, b = (t.detach().float().requires_grad_() for t in _inputs())
    weight = torch.randn(16, 32, 1, 1, requires_grad=True)
    with track_saved() as saved:
        y = act_star_relu(x, s, b, OpSettings(slot="act", bits=3))
        act_conv(y, weight, None, (1, 1), (0, 0), (1, 1), 1, OpSettings(slot="fc2", bits=3))
    assert set(saved.by_slot) == {"act:input", "act:output", "<uncompressed:torch.float32>"}, saved.by_slot
    assert saved.by_slot["<uncompressed:torch.float32>"] == s.nbytes + b.nbytes + weight.nbytes
    assert saved.by_slot["act:input"] == saved.by_slot["act:output"] < x.nbytes * 4 // 32 + 1024
