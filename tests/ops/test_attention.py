"""Attention ops (SDPA and eager), the transformers attention functions and the timm mixins.

Forward must equal the original op bit for bit (fp32 on CPU, dropout included under the same seed); only
gradients may differ, by an SQNR that depends on the bits.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

import act_hf
from act_hf.compress import dequantize, dequantize_items, quantize
from act_hf.context import track_saved
from act_hf.errors import ActHFValueError
from act_hf.ops._saving import OpSettings
from act_hf.ops.attention import (
    _grads_by_chunks,
    act_eager_attention,
    act_sdpa,
    grads_of,
    math_attention,
    math_attention_grads,
    repeat_kv,
)
from tests.utils import assert_grads_match, dispatched, packed_bytes, sqnr_db, tensors_with_history

# Minimum gradient SQNR (dB) of dq, dk, dv per bit width for Gaussian q, k, v (B, H, S, D = 2, 4, 64, 32).
# Measured means (module docstring, larger shape): -7 / 3 / 10 / 35 dB at 2 / 3 / 4 / 8 bits.
SQNR_MIN = {2: -8.0, 3: 1.0, 4: 7.0, 8: 30.0}
B, H, S, D = 2, 4, 64, 32


def _settings(bits: int = 8) -> OpSettings:
    return OpSettings(slot="layer.attn", bits=bits)


def _qkv(b=B, h=H, hkv=None, s=S, d=D, dtype=torch.float32, L=None):
    q = torch.randn(b, h, L or s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv or h, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv or h, s, d, dtype=dtype, requires_grad=True)
    return q, k, v


def _run(fn, inputs, grad_out, seed=5):
    torch.manual_seed(seed)
    out = fn()
    grads = torch.autograd.grad(out, inputs, grad_out)
    return out, grads, torch.rand(1)


def _check_grads(ref_grads, grads, minimum, names=("dq", "dk", "dv", "dmask")):
    values = [sqnr_db(r, g) for r, g in zip(ref_grads, grads)]
    print(" ".join(f"{n}={v:.1f}dB" for n, v in zip(names, values)))
    for n, v in zip(names, values):
        assert v >= minimum, f"{n} SQNR {v:.1f} dB < {minimum} dB"


def _padding_mask(shape):
    mask = torch.ones(shape, dtype=torch.bool)
    mask[0, ..., -7:] = False
    return mask


CASES = {
    "plain": dict,
    "causal": lambda: {"is_causal": True},
    "scale": lambda: {"scale": 0.37},
    "bool_padding": lambda: {"attn_mask": _padding_mask((B, 1, 1, S))},
    "bool_square": lambda: {"attn_mask": torch.rand(B, 1, S, S) > 0.3},
    "additive_padding": lambda: {"attn_mask": torch.zeros(B, 1, 1, S).masked_fill(~_padding_mask((B, 1, 1, S)),
                                                                                 torch.finfo(torch.float32).min)},
    "additive_square": lambda: {"attn_mask": torch.randn(B, 1, S, S)},
    "additive_heads": lambda: {"attn_mask": torch.randn(1, H, S, S)},
}


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_forward_equal_and_8bit_grads(case, dropout_p):
    kwargs = CASES[case]()
    q, k, v = _qkv()
    grad_out = torch.randn(B, H, S, D)
    ref, ref_g, ref_rng = _run(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **kwargs),
                               (q, k, v), grad_out)
    out, g, rng = _run(lambda: act_sdpa(q, k, v, dropout_p=dropout_p, **kwargs, settings=_settings(8)),
                       (q, k, v), grad_out)
    assert torch.equal(ref, out)
    assert torch.equal(ref_rng, rng), "the global RNG must be consumed exactly as SDPA does"
    print(case, dropout_p, end=": ")
    _check_grads(ref_g, g, SQNR_MIN[8])


def test_sdpa_bf16_forward_equal():
    q, k, v = _qkv(dtype=torch.bfloat16)
    mask = _padding_mask((B, 1, 1, S))
    grad_out = torch.randn(B, H, S, D, dtype=torch.bfloat16)
    for dropout_p in (0.0, 0.2):
        ref, ref_g, _ = _run(lambda: F.scaled_dot_product_attention(q, k, v, mask, dropout_p), (q, k, v), grad_out)
        out, g, _ = _run(lambda: act_sdpa(q, k, v, mask, dropout_p, settings=_settings(8)), (q, k, v), grad_out)
        assert torch.equal(ref, out) and out.dtype == torch.bfloat16
        assert all(x.dtype == torch.bfloat16 for x in g)
        _check_grads(ref_g, g, 20.0)  # the bf16 reference gradient itself carries bf16 rounding


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_sdpa_low_bits_sqnr_and_unbiased(bits):
    q, k, v = _qkv()
    grad_out = torch.randn(B, H, S, D)
    ref, ref_g, _ = _run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad_out)
    draws = []
    for _ in range(8):
        out, g, _ = _run(lambda: act_sdpa(q, k, v, is_causal=True, settings=_settings(bits)), (q, k, v), grad_out)
        assert torch.equal(ref, out)
        draws.append(g)
    print(f"bits={bits}", end=": ")
    _check_grads(ref_g, draws[0], SQNR_MIN[bits])
    for i, name in enumerate(("dq", "dk", "dv")):
        single = sum(sqnr_db(ref_g[i], d[i]) for d in draws) / len(draws)
        mean = sqnr_db(ref_g[i], torch.stack([d[i] for d in draws]).mean(0))
        print(f"  {name}: single draw {single:.1f} dB, mean of 8 draws {mean:.1f} dB")
        assert mean > single + 1.0, f"{name}: averaging draws should approach the exact gradient"


def test_sdpa_gqa_enable_gqa_and_repeat_kv():
    q, k, v = _qkv(h=8, hkv=2)
    grad_out = torch.randn(B, 8, S, D)
    ref, ref_g, _ = _run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                         (q, k, v), grad_out)
    out, g, _ = _run(lambda: act_sdpa(q, k, v, is_causal=True, enable_gqa=True, settings=_settings(8)),
                     (q, k, v), grad_out)
    assert torch.equal(ref, out)
    _check_grads(ref_g, g, SQNR_MIN[8])

    mask = _padding_mask((B, 1, 1, S))
    for dropout_p in (0.0, 0.25):
        ref, ref_g, _ = _run(lambda: F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), mask,
                                                                    dropout_p), (q, k, v), grad_out)
        with track_saved() as saved:
            out, g, _ = _run(lambda: act_sdpa(q, k, v, mask, dropout_p, settings=_settings(8), repeat_kv=4),
                             (q, k, v), grad_out)
        assert torch.equal(ref, out)
        _check_grads(ref_g, g, SQNR_MIN[8])
        kv_bytes = saved.by_slot["layer.attn:k"] + saved.by_slot["layer.attn:v"]
        assert kv_bytes == 2 * quantize(k.detach(), 8).nbytes, "k and v are saved before repetition"


def test_sdpa_learned_mask_gets_gradient():
    q, k, v = _qkv()
    bias = torch.randn(1, H, S, S, requires_grad=True)
    grad_out = torch.randn(B, H, S, D)
    for dropout_p in (0.0, 0.2):
        ref, ref_g, _ = _run(lambda: F.scaled_dot_product_attention(q, k, v, bias, dropout_p), (q, k, v, bias),
                             grad_out)
        out, g, _ = _run(lambda: act_sdpa(q, k, v, bias, dropout_p, settings=_settings(8)), (q, k, v, bias),
                         grad_out)
        assert torch.equal(ref, out)
        _check_grads(ref_g, g, SQNR_MIN[8])


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_sdpa_window_mask_saves_its_parts_not_their_sum(autocast, dropout_p):
    """transformers' Swin: SDPA's mask is a learned ``(1, heads, N, N)`` bias plus the ``(windows, N, N)`` shift
    mask of every image. Given the two parts (``window_mask``), the forward is the unpatched call on their sum bit
    for bit (under autocast too), the gradients follow (the bias's included), and the context keeps the parts,
    not the ``(batch * windows, heads, N, N)`` sum."""
    images, windows, n = 3, 4, 16
    q, k, v = _qkv(b=images * windows, s=n, d=8)
    bias = torch.randn(1, H, n, n, requires_grad=True)
    shift = torch.zeros(windows, n, n).masked_fill(torch.rand(windows, n, n) < 0.3, -100.0)
    grad_out = torch.randn(images * windows, H, n, 8)

    def summed():  # transformers' SwinAttention.forward
        per_image = shift.unsqueeze(1).unsqueeze(0).expand(images, -1, -1, -1, -1).reshape(-1, 1, n, n)
        return bias * 1.0 + per_image

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref, ref_g, _ = _run(lambda: F.scaled_dot_product_attention(q, k, v, summed(), dropout_p), (q, k, v, bias),
                             grad_out)
        out, g, _ = _run(lambda: act_sdpa(q, k, v, bias * 1.0, dropout_p, settings=_settings(8), window_mask=shift),
                         (q, k, v, bias), grad_out)
        with track_saved() as saved:
            act_sdpa(q, k, v, bias * 1.0, dropout_p, settings=_settings(8), window_mask=shift)
    assert torch.equal(ref, out)
    _check_grads(ref_g, g, 20.0 if autocast else SQNR_MIN[8])
    masks = saved.by_slot["<uncompressed:torch.float32>"]
    assert masks == bias.nbytes + shift.nbytes, (masks, bias.nbytes, shift.nbytes)
    with pytest.raises(ActHFValueError, match="window_mask"):
        act_sdpa(q, k, v, None, settings=_settings(8), window_mask=shift)
    with pytest.raises(ActHFValueError, match="window_mask"):
        act_sdpa(q, k, v, bias, settings=_settings(8), window_mask=shift[:1].expand(5, n, n))


@pytest.mark.parametrize("qkv_dtype", [torch.bfloat16, torch.float32])
def test_sdpa_learned_mask_under_autocast_runs_the_unpatched_backend(qkv_dtype):
    """T5's case: under CPU bf16 autocast, an fp32 additive mask that requires grad. The unpatched call casts it in
    grad mode (the cast requires grad: math path); an autograd forward casts it without grad (flash attention,
    whose bf16 output differs for transformers' (B, S, H, D) -> (B, H, S, D) views). The mask is made from a
    parameter, as T5's is: autocast caches its cast of a leaf that requires grad, and the forward would reuse
    the reference's cast. Forward must equal the unpatched call bit for bit, and the gradients follow."""
    leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in _qkv(s=12, d=8, dtype=qkv_dtype)]
    weight = torch.randn(1, H, 12, 12, requires_grad=True)
    grad_out = torch.randn(B, H, 12, 8, dtype=torch.bfloat16)

    def inputs():
        return *(t.transpose(1, 2) for t in leaves), weight * 1.0

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_g, _ = _run(lambda: F.scaled_dot_product_attention(*inputs(), scale=1.0), (*leaves, weight),
                             grad_out)
        act_hf.manual_seed(7)
        out, g, _ = _run(lambda: act_sdpa(*inputs(), scale=1.0, settings=_settings(8)), (*leaves, weight),
                         grad_out)
        deq = _dequantized(inputs()[:3], 8)
        _, at_deq, _ = _run(lambda: F.scaled_dot_product_attention(*deq, weight * 1.0, scale=1.0), (*deq, weight),
                            grad_out)
    assert out.dtype == torch.bfloat16 and torch.equal(ref, out)
    assert [x.dtype for x in g] == [x.dtype for x in ref_g]
    _check_grads(ref_g, g, 20.0)  # the bf16 reference gradient itself carries bf16 rounding
    # backward is autograd of the forward's call (autocast's casts included) at Q(q), Q(k), Q(v)
    for name, r, x in zip(("dq", "dk", "dv"), at_deq, g):
        assert torch.equal(r.transpose(1, 2), x), name
    assert torch.equal(at_deq[3], g[3]), "dmask"


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_sdpa_fully_masked_rows_match_pytorch(dropout_p):
    q, k, v = _qkv()
    mask = torch.ones(B, 1, S, S, dtype=torch.bool)
    mask[0, 0, 3] = False
    mask[1, 0, 10] = False
    grad_out = torch.randn(B, H, S, D)
    ref, ref_g, _ = _run(lambda: F.scaled_dot_product_attention(q, k, v, mask, dropout_p), (q, k, v), grad_out)
    out, g, _ = _run(lambda: act_sdpa(q, k, v, mask, dropout_p, settings=_settings(8)), (q, k, v), grad_out)
    assert torch.equal(ref, out)  # PyTorch's choice (NaN or 0) is kept, whatever it is
    for r, x in zip(ref_g, g):
        assert torch.equal(r.isnan(), x.isnan())
        assert torch.equal(r[0, :, 3] == 0, x[0, :, 3] == 0)
    _check_grads(ref_g, g, SQNR_MIN[8])


def _dequantized(tensors, bits: int, seed: int = 7) -> list[torch.Tensor]:
    """``Q(t)`` for each of ``tensors``, drawn as act_hf draws them after ``act_hf.manual_seed(seed)``."""
    act_hf.manual_seed(seed)
    return [dequantize(quantize(t.detach(), bits, 256)).requires_grad_() for t in tensors]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("case", ["plain", "causal", "bool_padding", "additive_heads"])
def test_sdpa_dropout_backward_redraws_the_forward_mask(case, bits):
    """No mask is stored: backward restores the RNG and recomputes SDPA with dropout on Q(q), Q(k), Q(v), so the
    gradient is exactly SDPA's autograd gradient at the dequantized inputs under the same seed."""
    kwargs = CASES[case]()
    q, k, v = _qkv()
    grad_out = torch.randn(B, H, S, D)
    act_hf.manual_seed(7)
    _, g, rng = _run(lambda: act_sdpa(q, k, v, dropout_p=0.3, **kwargs, settings=_settings(bits)), (q, k, v),
                     grad_out)
    deq = _dequantized((q, k, v), bits)
    _, ref_g, ref_rng = _run(lambda: F.scaled_dot_product_attention(*deq, dropout_p=0.3, **kwargs), deq, grad_out)
    assert torch.equal(ref_rng, rng), "backward must leave the global RNG where the caller had it"
    for name, r, x in zip(("dq", "dk", "dv"), ref_g, g):
        assert torch.equal(r, x), f"{name} differs from autograd at the dequantized inputs"
    _, other_g, _ = _run(lambda: F.scaled_dot_product_attention(*deq, dropout_p=0.3, **kwargs), deq, grad_out,
                         seed=6)
    assert not torch.equal(other_g[2], g[2]), "another dropout draw must give another gradient"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_sdpa_dropout_keeps_no_graph_alive(device):
    """The dropout forward runs SDPA itself on stand-ins in grad mode (the unpatched backend and draw; on CUDA a
    fused kernel); that graph is freed with the call, in every call: its outputs saved with their ``grad_fn`` would
    hold their own node alive, a cycle through C++ that gc cannot break. On CUDA the allocated bytes are checked
    too."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (t.detach().to(device, dtype).requires_grad_() for t in _qkv())
    grad_out = torch.randn(B, H, S, D, device=device, dtype=dtype)

    def step() -> None:
        out = act_sdpa(q, k, v, dropout_p=0.3, settings=_settings(4))
        out.backward(grad_out)

    step()  # the inputs' gradients exist from here on
    before = tensors_with_history()
    allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
    for _ in range(3):
        step()
    assert not tensors_with_history() - before
    if device == "cuda":
        assert torch.cuda.memory_allocated() == allocated


def test_sdpa_dropout_with_only_v_needing_grad():
    """Only ``dv`` wanted: ``v`` is not saved (``dv = P^T dO``), and the redrawn mask still matches the forward's."""
    q, k, v = _qkv()
    grad_out = torch.randn(B, H, S, D)
    q_, k_ = q.detach(), k.detach()
    act_hf.manual_seed(7)
    with track_saved() as saved:
        _, (dv,), _ = _run(lambda: act_sdpa(q_, k_, v, dropout_p=0.3, settings=_settings(4)), (v,), grad_out)
    assert "layer.attn:v" not in saved.by_slot
    deq = _dequantized((q_, k_), 4)
    _, (ref_dv,), _ = _run(lambda: F.scaled_dot_product_attention(*(t.detach() for t in deq), v, dropout_p=0.3),
                           (v,), grad_out)
    assert torch.equal(dv, ref_dv)


def test_sdpa_dropout_under_autocast_replays_the_cast():
    """Under bf16 autocast with fp32 q, k, v (autocast casts SDPA's inputs), forward equals SDPA under autocast and
    backward is autograd of that at the dequantized inputs, with the same mask."""
    q, k, v = _qkv()
    mask = torch.randn(B, 1, S, S, requires_grad=True)
    grad_out = torch.randn(B, H, S, D, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _, _ = _run(lambda: F.scaled_dot_product_attention(q, k, v, mask, 0.2), (q, k, v, mask), grad_out)
        act_hf.manual_seed(7)
        out, g, _ = _run(lambda: act_sdpa(q, k, v, mask, 0.2, settings=_settings(4)), (q, k, v, mask), grad_out)
        deq = _dequantized((q, k, v), 4)
        _, ref_g, _ = _run(lambda: F.scaled_dot_product_attention(*deq, mask, 0.2), (*deq, mask), grad_out)
    assert out.dtype == torch.bfloat16 and torch.equal(ref, out)
    for name, r, x in zip(("dq", "dk", "dv", "dmask"), ref_g, g):
        assert x.dtype == torch.float32 and torch.equal(r, x), name


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_sdpa_saved_bytes_formula(bits):
    q, k, v = _qkv(s=48)
    mask = _padding_mask((B, 1, 1, 48))
    with track_saved() as saved:
        out = act_sdpa(q, k, v, mask, 0.1, settings=_settings(bits))
    expected = 3 * packed_bytes(q.numel(), bits) + mask.numel()  # no dropout mask: backward redraws it
    print(f"bits={bits}: saved {saved.bytes} B (expected {expected}); by slot {saved.by_slot}")
    assert saved.bytes == expected
    assert saved.by_slot["layer.attn:q"] == packed_bytes(q.numel(), bits)
    with track_saved() as plain:
        F.scaled_dot_product_attention(q, k, v, mask, 0.1)
    print(f"  unpatched SDPA saves {plain.bytes} B")
    assert saved.bytes < plain.bytes
    out.sum().backward()


def test_sdpa_needs_input_grad():
    q, k, v = _qkv()
    settings = _settings(4)
    q_only_v = q.detach()
    k_only_v = k.detach()
    with track_saved() as saved:
        out = act_sdpa(q_only_v, k_only_v, v, is_causal=True, settings=settings)
    assert set(k for k in saved.by_slot if k.startswith("layer")) == {"layer.attn:q", "layer.attn:k"}
    (dv,) = torch.autograd.grad(out, v, torch.ones_like(out))
    ref = F.scaled_dot_product_attention(q_only_v, k_only_v, v, is_causal=True)
    (ref_dv,) = torch.autograd.grad(ref, v, torch.ones_like(ref))
    assert sqnr_db(ref_dv, dv) > SQNR_MIN[4]
    with track_saved() as saved:
        out = act_sdpa(q, k.detach(), v.detach(), settings=settings)
    assert {"layer.attn:q", "layer.attn:k", "layer.attn:v"} <= set(saved.by_slot)
    (dq,) = torch.autograd.grad(out, q, torch.ones_like(out))
    assert dq.shape == q.shape
    with torch.no_grad(), track_saved() as saved:
        act_sdpa(q, k, v, settings=settings)
    assert saved.bytes == 0


def test_sdpa_rejects_bad_arguments():
    q, k, v = _qkv()
    with pytest.raises(ActHFValueError, match="dropout_p"):
        act_sdpa(q, k, v, dropout_p=1.0, settings=_settings())
    with pytest.raises(ActHFValueError, match="repeat_kv"):
        act_sdpa(q, k, v, settings=_settings(), repeat_kv=0)


@pytest.mark.parametrize("softmax_dtype", [None, torch.float32])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_eager_forward_equal_and_grads(softmax_dtype, dropout_p):
    q, k, v = _qkv(h=4, hkv=2)
    mask = torch.zeros(B, 1, S, S).masked_fill(torch.rand(B, 1, S, S) > 0.7, torch.finfo(torch.float32).min)
    grad_out = torch.randn(B, 4, S, D)

    def hf_eager():  # transformers' eager_attention_forward (llama flavour when softmax_dtype is fp32)
        w = torch.matmul(q, repeat_kv(k, 2).transpose(2, 3)) * 0.2
        w = w + mask
        w = F.softmax(w, dim=-1) if softmax_dtype is None else F.softmax(w, dim=-1, dtype=softmax_dtype).to(q.dtype)
        w = F.dropout(w, p=dropout_p, training=True)
        return torch.matmul(w, repeat_kv(v, 2))

    ref, ref_g, ref_rng = _run(hf_eager, (q, k, v), grad_out)
    out, g, rng = _run(lambda: act_eager_attention(q, k, v, mask, scaling=0.2, settings=_settings(8),
                                                   dropout_p=dropout_p, softmax_dtype=softmax_dtype,
                                                   repeat_kv=2)[0], (q, k, v), grad_out)
    assert torch.equal(ref, out) and torch.equal(ref_rng, rng)
    _check_grads(ref_g, g, SQNR_MIN[8])


@pytest.mark.parametrize("kind", ["eager", "cosine"])
def test_no_zeros_are_made_for_the_attention_weights_gradient(monkeypatch, kind):
    """The attention weights are returned but not differentiable: backward gets None for them, not the
    (B, H, L, S) tensor of zeros autograd makes by default (1.76 MiB a sample, fp32, alive at swin-tiny's
    backward peak at 3 bits), and still the gradients."""
    from act_hf.ops.attention import ActEagerAttentionFunction
    from act_hf.ops.cosine_attention import ActCosineAttentionFunction, act_cosine_attention

    function = ActEagerAttentionFunction if kind == "eager" else ActCosineAttentionFunction
    received = []
    backward = function.backward

    def recording(ctx, grad_out, grad_weights):
        received.append(grad_weights)
        return backward(ctx, grad_out, grad_weights)

    monkeypatch.setattr(function, "backward", staticmethod(recording))
    q, k, v = _qkv(h=4, hkv=4)
    if kind == "eager":
        out, w = act_eager_attention(q, k, v, None, scaling=0.2, settings=_settings(8))
    else:
        out, w = act_cosine_attention(q, k, v, torch.ones(4, 1, 1), settings=_settings(8))
    out.sum().backward()
    assert received == [None] and not w.requires_grad
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("case", ["bias_and_window", "per_item_mask", "bool_mask", "dropout_gqa", "no_mask",
                                  "full_shape_mask", "one_image_one_head_window", "one_window"])
@pytest.mark.parametrize("need", [(True, True, True), (False, False, True), (True, False, False)])
def test_written_out_attention_backward_gives_autograds_gradients(case, need, device):
    """``math_attention_grads``, the eager backward written out (no graph, no ``P @ v``), gives the gradients
    autograd takes through ``math_attention`` on the same inputs: q, k, v (through ``repeat_kv``), a learned
    mask (broadcast over the batch, one per item, or of the scores' own shape, whose gradient is the scores'
    before they are scaled for q and k) and Swin's window mask (of one image and one head too), dropout's keep
    mask applied; no two gradients share memory (a chunked backward sums into the mask's and the window mask's).
    float64: only the order of a sum may differ."""
    torch.manual_seed(0)
    windows, n, d = (1 if case == "one_window" else 3), 7, 5
    heads = 1 if case in ("one_image_one_head_window", "one_window") else 4
    batch = (1 if case in ("one_image_one_head_window", "one_window") else 2) * windows
    n_rep = 2 if case == "dropout_gqa" else 1
    q, k, v = (t.detach() for t in _qkv(b=batch, h=heads, hkv=heads // n_rep, s=n, d=d, dtype=torch.float64))
    mask = window = keep = None
    if case in ("bias_and_window", "one_image_one_head_window", "one_window"):
        mask = torch.randn(1, heads, n, n, dtype=torch.float64)
        window = torch.zeros(windows, n, n, dtype=torch.float64).masked_fill(torch.rand(windows, n, n) < 0.3, -9.0)
    elif case == "full_shape_mask":
        mask = torch.randn(batch, heads, n, n, dtype=torch.float64)
    elif case == "per_item_mask":
        mask = torch.randn(batch, 1, n, n, dtype=torch.float64)
    elif case == "bool_mask":
        mask = torch.rand(batch, 1, 1, n) > 0.2
    elif case == "dropout_gqa":
        keep = torch.rand(batch, heads, n, n) > 0.25
    grad_out = torch.randn(batch, heads, n, d, dtype=torch.float64)
    q, k, v, mask, window, keep, grad_out = (None if t is None else t.to(device)
                                             for t in (q, k, v, mask, window, keep, grad_out))
    wants = (*need, mask is not None and mask.is_floating_point(), window is not None)
    leaves = [t.clone().requires_grad_(w) for t, w in zip((q, k, v), need)]
    learned = [None if t is None else t.clone().requires_grad_(w) for t, w in zip((mask, window), wants[3:])]
    out = math_attention(leaves[0], repeat_kv(leaves[1], n_rep), repeat_kv(leaves[2], n_rep), (learned[0],), keep,
                         0.25 if keep is not None else 0.0, 0.3, window_mask=learned[1])
    expected = grads_of(out, [*leaves, *learned], grad_out)
    got = math_attention_grads(q, k, v, mask, keep, 0.25 if keep is not None else 0.0, 0.3, window, n_rep, grad_out,
                               wants)
    for want, e, g in zip(wants, expected, got):
        if not want:
            assert g is None
            continue
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    storages = [g.untyped_storage().data_ptr() for g in got if g is not None]
    assert len(set(storages)) == len(storages)


def test_written_out_attention_backward_scales_in_its_gemms():
    """The softmax scale goes into the GEMMs of the scores, dq and dk (their alpha): no pass of it over an
    attention matrix (the scores' or their gradient's shape) and the same gradients as scaling them."""
    torch.manual_seed(0)
    q, k, v = (t.detach() for t in _qkv(b=2, h=4, hkv=4, s=7, d=5, dtype=torch.float64))
    mask, grad_out = torch.randn(1, 4, 7, 7, dtype=torch.float64), torch.randn(2, 4, 7, 5, dtype=torch.float64)
    need = (True, True, True, True, False)
    ops = dispatched(lambda: math_attention_grads(q, k, v, mask, None, 0.0, 0.3, None, 1, grad_out, need))
    scalings = [f for f, outs in ops if f.overloadpacket.__name__ in ("mul", "mul_") and outs[0].shape[-2:] == (7, 7)]
    assert scalings == [] and sum(f.overloadpacket.__name__ == "baddbmm_" for f, _ in ops) == 3
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    out = math_attention(*leaves[:3], (leaves[3],), None, 0.0, 0.3)
    expected = grads_of(out, leaves, grad_out)
    got = math_attention_grads(q, k, v, mask, None, 0.0, 0.3, None, 1, grad_out, need)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_written_out_attention_backward_adds_swin_masks_in_one_pass(dtype):
    """Swin's position bias (one for every window) and its window mask are summed first, a (windows, heads, L, S)
    tensor, and added to the scores in one pass over the attention matrices, not two; the gradients are autograd's
    through the two additions (float64: only rounding's order differs)."""
    torch.manual_seed(0)
    windows, n, heads, batch = 3, 7, 4, 6
    q, k, v = (t.detach().to(dtype) for t in _qkv(b=batch, h=heads, hkv=heads, s=n, d=5, dtype=torch.float64))
    bias = torch.randn(1, heads, n, n, dtype=torch.float64)
    shift = torch.zeros(windows, n, n, dtype=torch.float64).masked_fill(torch.rand(windows, n, n) < 0.3, -9.0)
    grad_out = torch.randn(batch, heads, n, 5, dtype=torch.float64).to(dtype)
    need = (True, True, True, True, True)
    ops = dispatched(lambda: math_attention_grads(q, k, v, bias, None, 0.0, 0.3, shift, 1, grad_out, need))
    additions = [f for f, outs in ops if f.overloadpacket.__name__ in ("add", "add_") and outs[0].numel() ==
                 batch * heads * n * n]
    assert len(additions) == 1
    if dtype == torch.float64:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, shift)]
        out = math_attention(*leaves[:3], (leaves[3],), None, 0.0, 0.3, window_mask=leaves[4])
        expected = grads_of(out, leaves, grad_out)
        got = math_attention_grads(q, k, v, bias, None, 0.0, 0.3, shift, 1, grad_out, need)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dropout", [False, True])
def test_written_out_attention_backward_runs_half_gemms_in_half(dropout, device):
    """For bf16 q, k, v (the dtype eager attention's GEMMs ran in under autocast) the written-out backward's five
    GEMMs run in bf16, as the unpatched step's forward and backward run them (on a GPU: tensor cores, half the
    bytes), the softmax and its gradient in fp32. Its gradients are as close to the exact ones (float64 autograd
    on the same values) as those autograd takes through Swin's eager attention under bf16 autocast, the
    unpatched step's; the bias's and the window mask's come in fp32."""
    torch.manual_seed(0)
    windows, n, d, heads, batch = 4, 49, 32, 3, 8
    q, k, v = (t.detach() for t in _qkv(b=batch, h=heads, hkv=heads, s=n, d=d, dtype=torch.bfloat16))
    bias = torch.randn(1, heads, n, n)
    shift = torch.zeros(windows, n, n).masked_fill(torch.rand(windows, n, n) < 0.3, -100.0)
    keep = torch.rand(batch, heads, n, n) > 0.2 if dropout else None
    p = 0.2 if dropout else 0.0
    grad_out = torch.randn(batch, heads, n, d, dtype=torch.bfloat16)
    q, k, v, bias, shift, keep, grad_out = (None if t is None else t.to(device)
                                            for t in (q, k, v, bias, shift, keep, grad_out))
    need = (True, True, True, True, True)
    ops = dispatched(lambda: math_attention_grads(q, k, v, bias, keep, p, 0.3, shift, 1, grad_out, need))
    gemms = [(f.overloadpacket.__name__, outs[0].dtype) for f, outs in ops
             if f.overloadpacket.__name__ in ("bmm", "baddbmm_", "mm", "addmm", "matmul")]
    assert len(gemms) == 5 and all(dtype == torch.bfloat16 for _, dtype in gemms), gemms
    got = math_attention_grads(q, k, v, bias, keep, p, 0.3, shift, 1, grad_out, need)

    wide = [t.double().requires_grad_() for t in (q, k, v, bias, shift)]
    exact = grads_of(math_attention(*wide[:3], (wide[3],), keep, p, 0.3, window_mask=wide[4]), wide,
                     grad_out.double())
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, shift)]
    with torch.autocast(device, torch.bfloat16):  # timm's Swin attention, its dropout's mask replaced by keep
        w = (leaves[0] * 0.3) @ leaves[1].transpose(-2, -1) + leaves[3]
        w = (w.view(-1, windows, heads, n, n) + leaves[4].unsqueeze(1)).view(-1, heads, n, n).softmax(-1)
        if keep is not None:
            w = w * keep / (1 - p)
        unpatched = grads_of(w @ leaves[2], leaves, grad_out)
    for name, g, u, e in zip(("dq", "dk", "dv", "dbias", "dshift"), got, unpatched, exact):
        assert g.dtype == u.dtype, name
        error, unpatched_error = ((t.double() - e).norm() / e.norm() for t in (g, u))
        assert error <= 1.25 * unpatched_error + 1e-6, (name, error, unpatched_error)


def test_eager_attention_backward_under_autocast_decodes_and_multiplies_in_half():
    """Under bf16 autocast an eager attention's backward decodes q, k and v in bf16, the dtype its GEMMs ran in
    forward, and runs its GEMMs in it: no fp32 copy of q, k, v or of their gradients."""
    q, k, v = (t.detach().requires_grad_() for t in _qkv(b=4, h=2, hkv=2, s=16, d=8, dtype=torch.bfloat16))
    bias = torch.randn(1, 2, 16, 16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        out, _ = act_eager_attention(q, k, v, bias, scaling=0.3, settings=_settings(4), scale_query=True,
                                     need_weights=False)
    grad_out = torch.randn_like(out)
    ops = dispatched(lambda: torch.autograd.grad(out, (q, k, v, bias), grad_out))
    named = [(f.overloadpacket.__name__, outs[0]) for f, outs in ops]
    decoded = [t.dtype for name, t in named if name == "unpack_dequantize"]
    gemms = [t.dtype for name, t in named if name in ("bmm", "baddbmm_", "mm", "matmul")]
    assert decoded == [torch.bfloat16] * 3 and gemms == [torch.bfloat16] * 5
    assert not any(t.dtype == torch.float32 and t.shape == q.shape for _, t in named)


@pytest.mark.parametrize("op", ["eager", "sdpa"])
@pytest.mark.parametrize("case", ["swin_bias_and_shift", "per_item_mask", "dropout_gqa", "plain_mask"])
def test_backward_over_batch_chunks_gives_the_one_pass_gradients(monkeypatch, op, case):
    """Past ``RECOMPUTE_CHUNK_ELEMENTS`` the backward recomputes attention chunk by chunk over the batch (whole
    images' windows together): the same gradients as one pass, a broadcast bias's summed over the chunks, a
    per-item mask's and eager attention's keep mask sliced with the batch. SDPA with dropout stays one call (its
    mask is drawn for the whole shape). float64, so only summation order may differ. Where the device has room
    for the whole batch (``ACT_HF_SLICING=never``) it is one pass again, bit for bit."""
    from act_hf.ops import attention

    images, windows, n, d = 5, 4, 9, 8
    torch.manual_seed(0)
    n_rep = 2 if case == "dropout_gqa" else 1
    q, k, v = _qkv(b=images * windows, h=4, hkv=4 // n_rep, s=n, d=d, dtype=torch.float64)
    shift = None
    if case == "swin_bias_and_shift":
        mask = torch.randn(1, 4, n, n, dtype=torch.float64, requires_grad=True)
        shift = torch.zeros(windows, n, n, dtype=torch.float64).masked_fill(torch.rand(windows, n, n) < 0.3, -100.0)
    elif case == "per_item_mask":
        mask = torch.randn(images * windows, 4, n, n, dtype=torch.float64, requires_grad=True)
    elif case == "plain_mask":  # HF's padding mask: no gradient, so SDPA builds no full tensor in backward
        mask = torch.zeros(images * windows, 1, 1, n, dtype=torch.float64).masked_fill(torch.rand(n) < 0.2, -1e4)
    else:
        mask = torch.zeros(images * windows, 1, n, n, dtype=torch.float64)
    dropout_p = 0.2 if case == "dropout_gqa" else 0.0
    grad_out = torch.randn(images * windows, 4, n, d, dtype=torch.float64)
    inputs = (q, k, v) + ((mask,) if mask.requires_grad else ())

    def attend():
        if op == "eager":
            return act_eager_attention(q, k, v, mask, scaling=0.3, settings=_settings(4), dropout_p=dropout_p,
                                       window_mask=shift, repeat_kv=n_rep, scale_query=True)[0]
        return act_sdpa(q, k, v, mask * 1.0 if mask.requires_grad else mask, dropout_p, scale=0.3,
                        settings=_settings(4), repeat_kv=n_rep, window_mask=shift)

    def run():
        act_hf.manual_seed(3)  # the same quantization draws in both passes
        return _run(attend, inputs, grad_out)

    out, one_pass, _ = run()
    chunks, decoded = [], []
    monkeypatch.setenv("ACT_HF_SLICING", "always")  # the slices, whatever room a GPU has
    monkeypatch.setattr(attention, "RECOMPUTE_CHUNK_ELEMENTS", 2 * windows * 4 * n * n)  # two images a chunk
    monkeypatch.setattr(attention, "_grads_by_chunks", lambda c, *a: chunks.append(c) or _grads_by_chunks(c, *a))
    monkeypatch.setattr(attention, "dequantize_items",
                        lambda p, a, b, dtype: decoded.append((a, b)) or dequantize_items(p, a, b, dtype))
    chunked_out, chunked, _ = run()
    if op == "sdpa" and case in ("dropout_gqa", "plain_mask"):
        assert chunks == []  # a dropout mask is drawn for the whole shape; a mask without grad builds nothing
        assert decoded == [(0, 20)] * 3
    else:  # three chunks of at most two images' windows: of whole images with Swin's windows, else as even as 20
        expected = [(0, 8), (8, 16), (16, 20)] if shift is not None else [(0, 7), (7, 14), (14, 20)]
        assert chunks == [expected]
        assert decoded == [span for span in expected for _ in range(3)]  # q, k, v one chunk at a time
    assert torch.equal(out, chunked_out)
    for a, b in zip(one_pass, chunked):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("ACT_HF_SLICING", "never")  # room for the whole batch: one pass past the threshold too
    chunks.clear()
    decoded.clear()
    room_out, room, _ = run()
    assert chunks == [] and decoded == [(0, 20)] * 3
    assert torch.equal(room_out, out)
    for a, b in zip(one_pass, room):
        assert torch.equal(b, a)


@pytest.mark.parametrize("case", ["swin_bias_and_shift", "per_item_mask", "dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_forward_without_weights_runs_over_batch_chunks(monkeypatch, case, dtype):
    """``need_weights=False`` past ``RECOMPUTE_CHUNK_ELEMENTS``: the forward runs over chunks of the batch (whole
    images' windows), so no op makes a tensor of the batch's attention matrices, and the output is the one call's
    bit for bit (each item by the same ops), as are the gradients (the same context). With dropout, whose mask is
    drawn for the whole shape, it stays one call; ``need_weights=True`` returns the weights and also stays one
    call."""
    from act_hf.ops import attention

    images, windows, n, d, heads = 5, 4, 9, 8, 4
    torch.manual_seed(0)
    q, k, v = _qkv(b=images * windows, h=heads, hkv=heads, s=n, d=d, dtype=dtype)
    shift = None
    if case == "per_item_mask":
        mask = torch.randn(images * windows, heads, n, n, requires_grad=True)
    else:  # an fp32 position bias beside q, k, v, as Swin's under autocast
        mask = torch.randn(1, heads, n, n, requires_grad=True)
        shift = torch.zeros(windows, n, n).masked_fill(torch.rand(windows, n, n) < 0.3, -100.0)
    dropout_p = 0.2 if case == "dropout" else 0.0
    grad_out = torch.randn(images * windows, heads, n, d, dtype=dtype)
    matrices = images * windows * heads * n * n

    def run(need_weights):
        act_hf.manual_seed(3)
        torch.manual_seed(4)  # the dropout mask
        got = {}
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):  # as Swin runs on a GPU
            ops = dispatched(lambda: got.update(zip(("out", "weights"), act_eager_attention(
                q, k, v, mask, scaling=0.3, settings=_settings(4), dropout_p=dropout_p, window_mask=shift,
                scale_query=True, need_weights=need_weights))))
        grads = torch.autograd.grad(got["out"], (q, k, v, mask), grad_out.to(got["out"].dtype))
        largest = max(t.numel() for _, outs in ops for t in outs if isinstance(t, torch.Tensor))  # in forward
        return got["out"], grads, got["weights"], largest

    out, _, weights, largest = run(True)
    assert weights is not None and weights.shape == (images * windows, heads, n, n) and largest >= matrices
    monkeypatch.setenv("ACT_HF_SLICING", "always")  # the slices, whatever room a GPU has
    monkeypatch.setattr(attention, "RECOMPUTE_CHUNK_ELEMENTS", 2 * windows * heads * n * n)  # two images a chunk
    same_out, same_grads, weights, largest = run(True)
    assert weights is not None and largest >= matrices
    chunked_out, chunked_grads, weights, largest = run(False)
    assert weights is None
    assert (largest < matrices) == (case != "dropout")
    assert torch.equal(out, same_out) and torch.equal(out, chunked_out)
    for i, (a, b) in enumerate(zip(same_grads, chunked_grads)):  # both backward passes over the same chunks
        assert torch.equal(a, b), f"gradient {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_with_a_window_mask_runs_over_batch_chunks(monkeypatch, dtype):
    """transformers' Swin (``act_sdpa`` with ``window_mask``) past ``RECOMPUTE_CHUNK_ELEMENTS``: the forward runs
    over chunks of whole images' windows, each with its part of the summed mask, so no op makes the batch's
    attention matrices; the output is the one call's bit for bit, as are the gradients with the same backward."""
    from act_hf.ops import attention

    images, windows, n, d, heads = 5, 4, 9, 8, 4
    torch.manual_seed(0)
    q, k, v = _qkv(b=images * windows, h=heads, hkv=heads, s=n, d=d, dtype=dtype)
    bias = torch.randn(1, heads, n, n, requires_grad=True)
    shift = torch.zeros(windows, n, n).masked_fill(torch.rand(windows, n, n) < 0.3, -100.0)
    grad_out = torch.randn(images * windows, heads, n, d)
    matrices = images * windows * heads * n * n

    def run():
        act_hf.manual_seed(3)
        got = []
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):  # as Swin runs on a GPU
            ops = dispatched(lambda: got.append(act_sdpa(q, k, v, bias * 1.0, settings=_settings(4),
                                                         window_mask=shift)))
        grads = torch.autograd.grad(got[0], (q, k, v, bias), grad_out.to(got[0].dtype))
        return got[0], grads, max(t.numel() for _, outs in ops for t in outs if isinstance(t, torch.Tensor))

    monkeypatch.setenv("ACT_HF_SLICING", "always")  # the slices, whatever room a GPU has
    monkeypatch.setattr(attention, "RECOMPUTE_CHUNK_ELEMENTS", 2 * windows * heads * n * n)  # two images a chunk
    with monkeypatch.context() as whole:
        whole.setattr(attention, "_windowed_sdpa", _sdpa_whole)
        out, grads, largest = run()
    assert largest >= matrices
    chunked_out, chunked_grads, largest = run()
    assert largest < matrices
    assert torch.equal(out, chunked_out)
    for i, (a, b) in enumerate(zip(grads, chunked_grads)):  # the backward over the same chunks in both
        assert torch.equal(a, b), f"gradient {i}"


def _sdpa_whole(q, k, v, attn_mask, window_mask, *args):
    """One SDPA call on the whole summed mask, as before the chunks."""
    from act_hf.ops import attention

    mask = attention.add_windows_mask(attn_mask, window_mask, q.shape[0]).requires_grad_(attn_mask.requires_grad)
    return attention._sdpa_as_unpatched(q, k, v, mask, *args)


# --------------------------------------------------------------------------------------------------------------
# transformers


transformers = pytest.importorskip("transformers")


def _hf_model(kind: str, impl: str, dropout: float):
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    if kind == "bert":
        config = BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=96, max_position_embeddings=32, hidden_dropout_prob=dropout,
                            attention_probs_dropout_prob=dropout, attn_implementation=impl)
        return BertForSequenceClassification(config)
    if kind == "llama":
        config = LlamaConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=96, max_position_embeddings=32,
                             attention_dropout=dropout, attn_implementation=impl)
        return LlamaForCausalLM(config)
    config = GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=32, attn_pdrop=dropout,
                        resid_pdrop=dropout, embd_pdrop=dropout, bos_token_id=0, eos_token_id=0,
                        attn_implementation=impl)
    return GPT2LMHeadModel(config)


def _hf_step(model, ids, mask):
    torch.manual_seed(11)
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["bert", "llama", "gpt2"])
def test_hf_attention_function(kind, impl, dropout):
    from act_hf.patches import _hf_attention as hf_attn

    ids = torch.randint(0, 97, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, -5:] = 0
    ref = _hf_model(kind, impl, dropout).train()
    model = _hf_model(kind, impl, dropout).train()
    assert hf_attn.enable(model) and model.config._attn_implementation == f"act_hf_{impl}"
    marked = hf_attn.find_attention_modules(model)
    assert len(marked) == 2
    for name, module in marked:
        hf_attn.mark(module, slot=name, bits=8)

    ref_logits, ref_grads = _hf_step(ref, ids, mask)
    with track_saved(model) as saved:
        logits, grads = _hf_step(model, ids, mask)
    assert torch.equal(ref_logits, logits)
    assert any(slot.endswith(":q") for slot in saved.by_slot), "the act_hf attention function did not run"
    worst = 1.0
    for name, g in ref_grads.items():
        # the key bias gets a zero gradient (softmax is shift invariant): only rounding noise, no direction
        if g.norm() == 0 or name.endswith(("key.bias", "k_proj.bias")):
            continue
        worst = min(worst, F.cosine_similarity(g.flatten(), grads[name].flatten(), dim=0).item())
    print(f"{kind}/{impl}/dropout={dropout}: worst gradient cosine {worst:.5f}")
    assert worst >= 0.99

    # eval and no-grad run the original function; disable() restores the implementation
    model.eval()
    ref.eval()
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(expected, model(input_ids=ids, attention_mask=mask).logits)
    hf_attn.disable(model)
    assert model.config._attn_implementation == impl and not hf_attn.is_enabled(model)
    for _, module in marked:
        hf_attn.unmark(module)
        assert not hasattr(module, "act_bits")


def test_hf_sdpa_without_a_mirrored_helper_stays_on_sdpa_and_warns(monkeypatch):
    """A transformers release that drops a helper act_hf's SDPA route mirrors (5.24 dropped the paged-cache
    import it used): patch warns, naming it, keeps that attention on transformers' own SDPA, and trains."""
    from act_hf.errors import ActHFWarning
    from act_hf.patches import _hf_attention as hf_attn

    monkeypatch.setattr(hf_attn, "_SDPA_MISSING", ("use_gqa_in_sdpa",))
    ids = torch.randint(0, 97, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    ref = _hf_model("bert", "sdpa", 0.0).train()
    model = _hf_model("bert", "sdpa", 0.0).train()
    with pytest.warns(ActHFWarning, match="use_gqa_in_sdpa.*stays on 'sdpa'"):
        act_hf.patch(model, bits=8)
    assert model.config._attn_implementation == "sdpa"
    ref_logits, _ = _hf_step(ref, ids, mask)
    with track_saved(model) as saved:
        logits, _ = _hf_step(model, ids, mask)
    assert torch.equal(ref_logits, logits)
    assert not any(slot.endswith(":q") for slot in saved.by_slot)
    assert any(slot.endswith("intermediate.intermediate_act_fn:input") for slot in saved.by_slot)
    assert_grads_match(ref, model, name="bert, sdpa kept")


def test_hf_enable_is_per_instance_and_not_saved(tmp_path):
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

    from act_hf.patches import _hf_attention as hf_attn

    config = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    model = BertForSequenceClassification(config)
    hf_attn.enable(model)
    other = BertForSequenceClassification(config)  # built from the same config object, before or after
    assert model.config._attn_implementation == "act_hf_sdpa"
    assert other.config._attn_implementation == "sdpa" and config._attn_implementation == "sdpa"
    assert all(m.config is model.config for m in model.modules() if hasattr(m, "config"))
    model.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert "act_hf" not in text and "attn_implementation" not in json.loads(text)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert loaded.config._attn_implementation == "sdpa"
    hf_attn.disable(model)
    hf_attn.disable(model)  # a second call is a no-op
    assert model.config._attn_implementation == "sdpa"
    assert os.path.exists(tmp_path / "config.json")


# --------------------------------------------------------------------------------------------------------------
# timm


timm = pytest.importorskip("timm")

TIMM_CASES = {
    "vit": (dict(model_name="vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, attn_drop_rate=0.1), 32),
    "swin": (dict(model_name="swin_tiny_patch4_window7_224", img_size=56, window_size=7, embed_dim=24,
                  depths=(2, 2), num_heads=(1, 2), attn_drop_rate=0.1), 56),
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", list(TIMM_CASES))
def test_timm_attention_mixins(name, fused):
    from act_hf.nn._base import convert, revert
    from act_hf.patches._timm_attention import mixin_for

    kwargs, size = TIMM_CASES[name]
    torch.manual_seed(0)
    ref = timm.create_model(pretrained=False, **kwargs).train()
    model = copy.deepcopy(ref)
    converted = []
    for module_name, module in model.named_modules():
        mixin = mixin_for(module)
        if mixin is not None:
            converted.append(convert(module, mixin, slot=module_name, bits=8))
    assert len(converted) == (2 if name == "vit" else 4)
    for module in list(ref.modules()) + list(model.modules()):
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused

    x = torch.randn(2, 3, size, size)
    torch.manual_seed(3)
    ref_out = ref(x)
    ref_out.pow(2).mean().backward()
    with track_saved(model) as saved:
        torch.manual_seed(3)
        out = model(x)
    out.pow(2).mean().backward()
    assert torch.equal(ref_out, out)
    assert any(slot.endswith(":k") for slot in saved.by_slot)
    worst = min(sqnr_db(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()) if p.grad.norm() > 0)
    print(f"{name} fused={fused}: worst parameter-gradient SQNR {worst:.1f} dB")
    assert worst >= SQNR_MIN[8]

    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(ref(x), model(x))
    for module in converted:
        revert(module)
    assert mixin_for(converted[0]) is not None and not hasattr(type(converted[0]), "act_original_class")


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", list(TIMM_CASES))
def test_timm_fused_qkv_is_copied_once(monkeypatch, name, fused, chunks):
    """timm's fused qkv projection is copied once, into a dense tensor of q, k and v: none of them is copied again
    to be quantized, and eager attention's matmuls copy none of them in any chunk of the batch (timm's own forward
    copies q, k and v for its matmuls; before, act_hf's did that in every chunk and copied each to quantize it).
    For SDPA the copy lies tokens first, so the output's ``transpose(1, 2).reshape`` stays a view, as in timm."""
    from act_hf.nn._base import convert
    from act_hf.ops import attention
    from act_hf.patches._timm_attention import mixin_for

    kwargs, _ = TIMM_CASES[name]
    torch.manual_seed(0)
    model = timm.create_model(pretrained=False, **{**kwargs, "attn_drop_rate": 0.0}).train()
    module = next(m for m in model.modules() if mixin_for(m) is not None and m.num_heads > 1)
    module.fused_attn = fused
    original_forward = type(module).forward
    module = convert(module, mixin_for(module), slot="attn", bits=3)
    tokens = 49 if name == "swin" else 17
    x = torch.randn(16 if name == "swin" else 4, tokens, module.qkv.in_features, requires_grad=True)
    args = (torch.zeros(4, 49, 49),) if name == "swin" else ()  # Swin's shift mask: 4 windows an image
    monkeypatch.setenv("ACT_HF_SLICING", "always")  # the slices, whatever room a GPU has
    monkeypatch.setattr(attention, "RECOMPUTE_CHUNK_ELEMENTS", x.shape[0] * module.num_heads * tokens**2 // chunks)

    def copies(forward) -> tuple[list[int], int]:
        ops = [(f.overloadpacket.__name__, outs[0].numel()) for f, outs in dispatched(forward)]
        return [n for op, n in ops if op == "clone"], sum(op == "bmm" for op, _ in ops)

    q_numel = x.shape[0] * tokens * module.qkv.out_features // 3
    ours, matmuls = copies(lambda: module(x, *args))
    timms, _ = copies(lambda: original_forward(module, x, *args))  # timm's code (its qkv linear act_hf's)
    assert fused or matmuls == 2 * chunks  # eager attention's two a chunk (SDPA may run its math path's)
    assert ours.count(3 * q_numel) == 1  # the one copy of q, k and v
    if fused:  # timm's SDPA copies none of them (act_hf's copied each to quantize it); the output stays a view
        assert sorted(ours) == sorted([*timms, 3 * q_numel])
    else:  # timm's matmuls copy q, k and v (three copies of q's size); act_hf's copy none, in every chunk
        for _ in range(3):
            timms.remove(q_numel)
        assert sorted(ours) == sorted([*timms, 3 * q_numel])


# --------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)


@pytest.mark.cuda
def test_sdpa_cuda_forward_equal():
    q, k, v = (t.detach().cuda().half().requires_grad_() for t in _qkv())
    mask = _padding_mask((B, 1, 1, S)).cuda()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = act_sdpa(q, k, v, is_causal=True, settings=_settings(8))
    assert torch.equal(ref, out)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.float().sum(), (q, k, v))
    _check_grads(ref_grads, grads, 25.0)
    out = act_sdpa(q, k, v, mask, settings=_settings(8))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, mask), out)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_cuda_dropout_runs_the_fused_kernel_and_redraws_its_mask(dtype):
    """With dropout on CUDA the forward is SDPA's own fused kernel (same output, same draw from the CUDA
    generator), and backward redraws that kernel's mask: the gradient is autograd's at the dequantized inputs."""
    q, k, v = (t.detach().cuda().to(dtype).requires_grad_() for t in _qkv())
    grad_out = torch.randn(B, H, S, D, device="cuda", dtype=dtype)
    for kwargs in ({}, {"is_causal": True}):
        assert torch.ops.aten._fused_sdp_choice(q, k, v, None, 0.2, **kwargs) != 0, "expected a fused kernel"
        torch.manual_seed(3)
        ref = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, **kwargs)
        ref_rng = torch.cuda.get_rng_state()
        ref_g = torch.autograd.grad(ref, (q, k, v), grad_out)
        torch.manual_seed(3)
        act_hf.manual_seed(7)
        out = act_sdpa(q, k, v, dropout_p=0.2, **kwargs, settings=_settings(8))
        assert torch.equal(ref, out)
        assert torch.equal(ref_rng, torch.cuda.get_rng_state()), "forward must draw from the CUDA generator as SDPA"
        g = torch.autograd.grad(out, (q, k, v), grad_out)
        assert torch.equal(ref_rng, torch.cuda.get_rng_state()), "backward must leave the CUDA generator where it was"
        _check_grads(ref_g, g, 25.0)
        deq = _dequantized((q, k, v), 8)
        torch.manual_seed(3)
        exact = torch.autograd.grad(F.scaled_dot_product_attention(*deq, dropout_p=0.2, **kwargs), deq, grad_out)
        for r, x in zip(exact, g):
            torch.testing.assert_close(x, r, rtol=2e-2, atol=2e-3)
