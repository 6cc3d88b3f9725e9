"""Scaled cosine attention (Swin V2): forward exact, backward exact without the rounding, close to float64
autograd at 8 bits, the norms kept exact, and what is saved."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from act_hf.compress import manual_seed
from act_hf.context import track_saved
from act_hf.errors import ActHFTypeError, ActHFValueError
from act_hf.ops import cosine_attention
from act_hf.ops._saving import OpSettings
from act_hf.ops.cosine_attention import act_cosine_attention
from tests.utils import dispatched

B, H, N, D = 8, 3, 16, 8
NUM_WINDOWS = 4


def _scores(q, k, log_scale, bias_logits):
    """Swin V2's scores before the masks, as transformers and timm write them."""
    scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    scores = scores * torch.clamp(log_scale, max=math.log(1.0 / 0.01)).exp()
    return scores + 16 * torch.sigmoid(bias_logits).unsqueeze(0)


def _model_attention(q, k, v, log_scale, bias_logits, mask=None, adds=1, dropout_p=0.0):
    """Swin V2's attention as the models write it (``adds=2``: transformers adds the shift mask twice)."""
    scores = _scores(q, k, log_scale, bias_logits)
    if mask is not None:
        scores = scores.view(-1, mask.shape[0], H, N, N) + mask.unsqueeze(1).unsqueeze(0)
        if adds == 2:
            scores = scores + mask.unsqueeze(1).unsqueeze(0)
        scores = scores.view(-1, H, N, N)
    return F.dropout(F.softmax(scores, dim=-1), p=dropout_p, training=True) @ v


def _op(q, k, v, log_scale, bias_logits, mask=None, adds=1, dropout_p=0.0, bits=8):
    scale = torch.clamp(log_scale, max=math.log(1.0 / 0.01)).exp()
    bias = 16 * torch.sigmoid(bias_logits).unsqueeze(0)
    return act_cosine_attention(q, k, v, scale, bias, window_mask=mask, window_mask_adds=adds, dropout_p=dropout_p,
                                settings=OpSettings("m", bits))[0]


def _inputs(dtype=torch.float64, seed=0, small_rows=False):
    """q, k, v, the log logit scale (near log 10, timm's and transformers' init), position-bias logits and a
    shift mask with -100 where windows do not attend."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(3))
    if small_rows:
        q[:, :, ::4] *= 1e-3
        k[:, :, 1::5] *= 1e-3
    log_scale = math.log(10) + 0.3 * torch.randn(H, 1, 1, generator=g, dtype=dtype)
    bias_logits = torch.randn(H, N, N, generator=g, dtype=dtype)
    mask = torch.where(torch.rand(NUM_WINDOWS, N, N, generator=g) < 0.3, -100.0, 0.0).to(dtype)
    return q, k, v, log_scale, bias_logits, mask


def _grads(fn, tensors, grad_out, **kwargs):
    leaves = [t.clone().requires_grad_() for t in tensors[:5]]
    torch.manual_seed(7)  # the same dropout draw on both sides
    out = fn(*leaves, **kwargs)
    return out, torch.autograd.grad(out, leaves, grad_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masked,adds", [(False, 1), (True, 1), (True, 2)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_forward_is_the_models_bit_for_bit(dtype, masked, adds, dropout_p):
    tensors = _inputs(dtype)
    mask = tensors[5] if masked else None
    grad_out = torch.ones(B, H, N, D, dtype=dtype)
    ref, _ = _grads(_model_attention, tensors, grad_out, mask=mask, adds=adds, dropout_p=dropout_p)
    got, _ = _grads(_op, tensors, grad_out, mask=mask, adds=adds, dropout_p=dropout_p)
    assert got.dtype == dtype and torch.equal(got, ref)
    after = torch.rand(3)  # the caller's random stream is where the model leaves it
    torch.manual_seed(7)
    _model_attention(*(t.clone() for t in tensors[:5]), mask=mask, adds=adds, dropout_p=dropout_p)
    assert torch.equal(after, torch.rand(3))


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_backward_is_exact_without_the_rounding(monkeypatch, dropout_p):
    """With packing turned into the identity, every gradient is float64 autograd's: the recomputation, the
    normalize backward through the exact norms (rows of small norm, and one below ``eps``, where ``clamp_min``
    drops the radial term) and the dropout mask are right."""
    monkeypatch.setattr(cosine_attention, "compress_role", lambda t, settings, role: t)
    monkeypatch.setattr(cosine_attention, "dequantize", lambda t, dtype=None: t if dtype is None else t.to(dtype))
    tensors = _inputs(small_rows=True)
    tensors[0][0, 0, 3] *= 1e-13 / tensors[0][0, 0, 3].norm()  # norm 1e-13 < eps
    grad_out = torch.randn(B, H, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _, exact = _grads(_model_attention, tensors, grad_out, mask=tensors[5], adds=2, dropout_p=dropout_p)
    _, got = _grads(_op, tensors, grad_out, mask=tensors[5], adds=2, dropout_p=dropout_p)
    assert exact[0][0, 0, 3].abs().max() > 1e6  # below eps, autograd's gradient is the unit row's / eps
    for a, b, name in zip(got, exact, ["q", "k", "v", "logit_scale", "bias"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0, msg=name)


@pytest.mark.parametrize("small_rows", [False, True])
def test_gradients_close_to_float64_autograd_at_8_bits(small_rows):
    tensors = _inputs(small_rows=small_rows)
    grad_out = torch.randn(B, H, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _, exact = _grads(_model_attention, tensors, grad_out, mask=tensors[5])
    manual_seed(0)
    _, got = _grads(_op, [t.float() for t in tensors], grad_out.float(), mask=tensors[5].float())
    for a, b, name in zip(got, exact, ["q", "k", "v", "logit_scale", "bias"]):
        assert a.dtype == torch.float32
        assert (a.double() - b).norm() <= 0.05 * b.norm(), name  # measured 0.012-0.033


def test_bf16_autocast_forward_and_gradient_dtypes():
    q, k, v, log_scale, bias_logits, mask = (t.float() for t in _inputs())
    leaves = [t.clone().requires_grad_() for t in (q, k, v, log_scale, bias_logits)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _model_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_scale, bias_logits, mask=mask)
        q16, k16, v16 = (t.bfloat16() for t in leaves[:3])
        got = _op(q16, k16, v16, *leaves[3:], mask=mask)
    assert got.dtype == ref.dtype == torch.bfloat16 and torch.equal(got, ref)
    got.float().square().sum().backward()
    assert [t.grad.dtype for t in leaves] == [torch.float32] * 5
    assert all(t.grad.abs().sum() > 0 for t in leaves)


def test_bf16_backward_multiplies_in_bf16_as_the_model_does(monkeypatch):
    """Under bf16 autocast the backward recomputes the scores and the output with bf16 GEMMs, the dtype the
    forward's ran in (no fp32 copy of the unit rows or of v), the softmax in fp32: with packing turned into the
    identity its gradients are as close to float64 autograd's as the model's own under autocast."""
    monkeypatch.setattr(cosine_attention, "compress_role", lambda t, settings, role: t)
    monkeypatch.setattr(cosine_attention, "dequantize", lambda t, dtype=None: t if dtype is None else t.to(dtype))
    tensors = _inputs()
    grad_out = torch.randn(B, H, N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _, exact = _grads(_model_attention, tensors, grad_out, mask=tensors[5])
    q, k, v, log_scale, bias_logits, mask = (t.float() for t in tensors)

    def under_autocast(fn):
        leaves = [t.clone().requires_grad_() for t in (q.bfloat16(), k.bfloat16(), v.bfloat16(), log_scale,
                                                         bias_logits)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(*leaves, mask=mask)
        found = []
        ops = dispatched(lambda: found.extend(torch.autograd.grad(out, leaves, grad_out.to(out.dtype))))
        return found, [outs[0].dtype for f, outs in ops if f.overloadpacket.__name__ in ("bmm", "mm", "matmul")]

    got, gemms = under_autocast(_op)
    model, _ = under_autocast(_model_attention)
    assert gemms and set(gemms) == {torch.bfloat16}
    for g, m, e, name in zip(got, model, exact, ["q", "k", "v", "logit_scale", "bias"]):
        error, model_error = ((t.double() - e).norm() / e.norm() for t in (g, m))
        assert error <= 1.25 * model_error + 1e-6, (name, error, model_error)


def test_saves_the_unit_rows_packed_and_their_norms_exact():
    q, k, v, log_scale, bias_logits, mask = (t.float() for t in _inputs())
    scale = log_scale.exp().requires_grad_()
    bias = bias_logits.unsqueeze(0).requires_grad_()
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    with track_saved() as saved:
        act_cosine_attention(*qkv, scale, bias, window_mask=mask, settings=OpSettings("m", 3))
    norms = 2 * B * H * N * 4  # one value per row of q and of k
    assert set(saved.by_slot) == {"m:q", "m:k", "m:v", "<uncompressed:torch.float32>"}
    assert saved.by_slot["<uncompressed:torch.float32>"] == norms + 4 * (scale.numel() + bias.numel() + mask.numel())
    packed = saved.by_slot["m:q"] + saved.by_slot["m:k"] + saved.by_slot["m:v"]
    assert packed < 3 * q.numel() * 4 * 3.5 / 32  # 3 bits plus group metadata
    with track_saved() as saved:  # only v needs a gradient: P^T g needs the unit rows, not v nor the norms
        act_cosine_attention(q, k, v.clone().requires_grad_(), scale.detach(), bias.detach(),
                             settings=OpSettings("m", 3))
    assert set(saved.by_slot) == {"m:q", "m:k", "<uncompressed:torch.float32>"}
    assert saved.by_slot["<uncompressed:torch.float32>"] == 4 * (scale.numel() + bias.numel())


def test_without_grad_it_is_the_plain_computation_and_bad_arguments_are_named():
    q, k, v, log_scale, bias_logits, mask = _inputs(torch.float32)
    out, weights = act_cosine_attention(q, k, v, log_scale.exp(), bias_logits, settings=OpSettings("m", 3))
    assert out.grad_fn is None and weights.shape == (B, H, N, N)
    with pytest.raises(ActHFValueError, match="dropout_p"):
        act_cosine_attention(q, k, v, log_scale, settings=OpSettings("m", 3), dropout_p=1.0)
    with pytest.raises(ActHFValueError, match="window_mask_adds"):
        act_cosine_attention(q, k, v, log_scale, settings=OpSettings("m", 3), window_mask=mask, window_mask_adds=0)
    with pytest.raises(ActHFTypeError, match="one floating dtype"):
        act_cosine_attention(q.requires_grad_(), k.double(), v, log_scale, settings=OpSettings("m", 3))


def _swin_v2_attentions():
    """(name, module, mixin, call) for transformers' and timm's Swin V2 attentions at width 16, 2 heads, 4 x 4
    windows; ``call(module, x, mask)`` returns the attention output."""
    import transformers as tf
    from timm.models.swin_transformer_v2 import WindowAttention
    from timm.models.swin_transformer_v2_cr import WindowMultiHeadAttention
    from transformers.models.swinv2.modeling_swinv2 import Swinv2SelfAttention

    from act_hf.patches._timm_attention import ActWindowAttentionV2Mixin, ActWindowMultiHeadAttentionMixin
    from act_hf.patches.vision_hf import ActSwinv2SelfAttentionMixin

    torch.manual_seed(0)
    return [
        ("transformers", Swinv2SelfAttention(tf.Swinv2Config(), 16, 2, 4), ActSwinv2SelfAttentionMixin,
         lambda m, x, mask: m(x, mask)[0]),
        ("timm", WindowAttention(16, (4, 4), 2), ActWindowAttentionV2Mixin, lambda m, x, mask: m(x, mask)),
        ("timm-cr", WindowMultiHeadAttention(16, 2, (4, 4), drop_attn=0.0), ActWindowMultiHeadAttentionMixin,
         lambda m, x, mask: m(x, mask)),
    ]


@pytest.mark.parametrize("index", range(3), ids=["transformers", "timm", "timm-cr"])
def test_the_mixins_reproduce_the_modules_with_any_window_mask(index):
    """A mask of arbitrary values (Swin's are 0 and -100, where adding it once or twice leaves the same softmax
    in fp32) tells whether each mixin adds it as its module does: twice in transformers, once in timm."""
    from act_hf.nn._base import convert
    from tests.utils import assert_grads_match

    _, ref, mixin, call = _swin_v2_attentions()[index]
    ref.train()
    model = convert(copy.deepcopy(ref), mixin, slot="attn", bits=8)
    x = torch.randn(2 * NUM_WINDOWS, 16, 16)
    mask = torch.randn(NUM_WINDOWS, 16, 16)
    xr, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(1)  # V2-CR's position-bias MLP has dropout
    out = call(model, xa, mask)
    torch.manual_seed(1)
    expected = call(ref, xr, mask)
    assert torch.equal(out, expected)
    manual_seed(0)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_match(ref, model, name=type(ref).__name__)
    assert (xa.grad - xr.grad).norm() < 0.05 * xr.grad.norm()
