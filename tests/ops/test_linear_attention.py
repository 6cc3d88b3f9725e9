"""Normalized linear attention (EfficientViT's LiteMLA): forward exact, gradients unbiased and close to float64
autograd, the normalizer kept exact, and what is saved."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import act_hf
from act_hf.compress import manual_seed
from act_hf.context import track_saved
from act_hf.errors import ActHFTypeError
from act_hf.ops._saving import OpSettings
from act_hf.ops.linear_attention import act_linear_attention
from tests.utils import relative_error

EPS = 1e-5


def _timm_attn(q, k, v, eps=EPS):
    """timm's ``LiteMLA._attn`` after its casts, as written there."""
    kv = k.transpose(-1, -2) @ v
    out = q @ kv
    return out[..., :-1] / (out[..., -1:] + eps)


def _qkv(dtype=torch.float64, shape=(2, 3, 64, 8), seed=0, small_rows=False):
    """ReLU-kernel queries and keys, values padded with ones as LiteMLA pads them. ``small_rows``: a quarter of
    the query rows scaled by 1e-3 (most of a row zeroed by the ReLU kernel), so their normalizer is small."""
    g = torch.Generator().manual_seed(seed)
    q = F.relu(torch.randn(shape, generator=g, dtype=dtype))
    k = F.relu(torch.randn(shape, generator=g, dtype=dtype))
    v = F.pad(torch.randn(shape, generator=g, dtype=dtype), (0, 1), value=1.0)
    if small_rows:
        q[..., ::4, :] *= 1e-3
    return q, k, v


def _grads(fn, q, k, v, g):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(fn(*leaves), leaves, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_is_timms_bit_for_bit(dtype):
    q, k, v = _qkv(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = act_linear_attention(*leaves, EPS, OpSettings("m", 3))
    assert out.dtype == dtype and torch.equal(out, _timm_attn(q, k, v))
    assert out.grad_fn is not None


@pytest.mark.parametrize("small_rows", [False, True])
def test_gradients_close_to_float64_autograd_at_8_bits(small_rows):
    q, k, v = _qkv(small_rows=small_rows)
    g = torch.randn(q.shape[:-1] + (v.shape[-1] - 1,), dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    exact = _grads(_timm_attn, q, k, v, g)
    manual_seed(0)
    got = _grads(lambda *t: act_linear_attention(*t, EPS, OpSettings("m", 8)), q, k, v, g)
    for a, b, name in zip(got, exact, "qkv"):
        assert a.dtype == b.dtype
        assert (a - b).norm() <= 0.03 * b.norm(), name


def test_gradients_are_unbiased_over_draws():
    q, k, v = _qkv(shape=(1, 2, 32, 4), small_rows=True)
    g = torch.randn(q.shape[:-1] + (v.shape[-1] - 1,), dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    exact = _grads(_timm_attn, q, k, v, g)
    acc = [torch.zeros_like(t) for t in exact]
    errors = []
    manual_seed(0)
    for n in range(1, 401):
        for a, d in zip(acc, _grads(lambda *t: act_linear_attention(*t, EPS, OpSettings("m", 2)), q, k, v, g)):
            a += d
        if n in (25, 400):
            errors.append(relative_error([a / n for a in acc], exact))
    assert errors[1] < errors[0] / 2.5, errors  # the mean's error shrinks like 1/sqrt(draws): no bias left
    assert errors[1] < 0.1, errors


def test_small_normalizers_do_not_amplify_the_rounding():
    """Rows of small queries have small normalizers. Quantized as the saved-tensor hooks would keep it (the
    normalizer and the numerator quantized with the rest), their rounding is divided by it."""
    from act_hf.fallback import install_fallback_hooks

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return _timm_attn(q, k, v)

    q, k, v = _qkv(torch.float32, shape=(2, 4, 512, 8), small_rows=True)  # every saved tensor >= MIN_NUMEL
    g = torch.randn(q.shape[:-1] + (v.shape[-1] - 1,), generator=torch.Generator().manual_seed(1))
    exact = _grads(_timm_attn, q.double(), k.double(), v.double(), g.double())
    hooked = Attn().train()
    install_fallback_hooks(hooked, bits=4, group_size=256)
    manual_seed(0)
    with_hooks = relative_error(_grads(hooked, q, k, v, g), exact)
    manual_seed(0)
    with_op = relative_error(_grads(lambda *t: act_linear_attention(*t, EPS, OpSettings("m", 4)), q, k, v, g), exact)
    # with_op: 0.151-0.250 over 100 draws of the rounding with either of two hashes; with_hooks: 5.7e7
    assert with_op < 0.3 and with_hooks > 1.0, (with_op, with_hooks)


def test_saves_the_normalizer_exact_and_the_rest_packed():
    q, k, v = _qkv(torch.float32, shape=(2, 4, 256, 16))
    with track_saved() as saved:
        act_linear_attention(*(t.clone().requires_grad_() for t in (q, k, v)), EPS, OpSettings("m", 3))
    den_bytes = q.numel() // q.shape[-1] * 4
    assert set(saved.by_slot) == {"m:q", "m:k", "m:v", "m:out", "<uncompressed:torch.float32>"}
    assert saved.by_slot["<uncompressed:torch.float32>"] == den_bytes  # one value per query row and head
    full = 4 * (3 * q.numel() + v.numel())  # q, k, v and out at fp32
    assert saved.bytes < full * 3.5 / 32 + den_bytes
    with track_saved() as saved:  # only v needs a gradient: k @ grad_kv needs k, q and out; v is not kept
        act_linear_attention(q, k, v.clone().requires_grad_(), EPS, OpSettings("m", 3))
    assert set(saved.by_slot) == {"m:q", "m:k", "m:out", "<uncompressed:torch.float32>"}


def test_without_grad_it_is_the_plain_computation_and_bad_dtypes_are_named():
    q, k, v = _qkv(torch.float32)
    assert act_linear_attention(q, k, v, EPS, OpSettings("m", 3)).grad_fn is None
    with pytest.raises(ActHFTypeError, match="one floating dtype"):
        act_linear_attention(q.requires_grad_(), k.double(), v, EPS, OpSettings("m", 3))


def _lite_mla_grad_error(kinds, bits: int, seed: int) -> float:
    from timm.models.efficientvit_mit import LiteMLA

    torch.manual_seed(0)
    ref = LiteMLA(32, 32, dim=8).train()
    x = torch.randn(4, 32, 8, 8)
    xr = x.clone().requires_grad_()
    ref(xr).square().sum().backward()
    model = act_hf.patch(copy.deepcopy(ref), config=act_hf.ActConfig(bits=bits, kinds=kinds))
    xa = x.clone().requires_grad_()
    manual_seed(seed)
    model(xa).square().sum().backward()
    return relative_error([xa.grad] + [p.grad for p in model.parameters()], [xr.grad] + [p.grad for p in ref.parameters()])


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_timm_lite_mla_patched_against_its_internals_through_the_hooks():
    """timm's LiteMLA module whole (its convs, ReLU kernel and attention): with the op its gradient at 4 bits is
    at 0.31-0.34 of the gradient norm (3 draws); left to the fallback hooks (attention not a compressed kind) at
    10-46x the norm."""
    everything = act_hf.config.ACT_KINDS
    no_attention = tuple(k for k in everything if k != "attention")
    for seed in range(2):
        with_op = _lite_mla_grad_error(everything, 4, seed)
        with_hooks = _lite_mla_grad_error(no_attention, 4, seed)
        assert with_op < 0.5 and with_hooks > 10 * with_op, (with_op, with_hooks)


@pytest.mark.filterwarnings("ignore::act_hf.ActHFWarning")
def test_a_lite_mla_whose_attention_code_differs_keeps_its_own(monkeypatch):
    """The mixin computes timm's ``_attn``; another ``_attn`` (a future timm's, a user's patch) is left alone."""
    from timm.models.efficientvit_mit import LiteMLA

    def other_attn(self, q, k, v):
        kv = k.transpose(-1, -2) @ v
        out = q @ kv
        return out[..., :-1] / (out[..., -1:].abs() + self.eps)

    monkeypatch.setattr(LiteMLA, "_attn", other_attn)
    model = act_hf.patch(torch.nn.Sequential(LiteMLA(16, 16, dim=8)), bits=3, fallback_hooks=False)
    assert type(model[0])._attn is other_attn
    assert "0.qkv.conv" in model.act_hf_patched_modules  # its submodules are patched as usual
