"""Norm ops: forward exact, gradients vs float64 autograd, what is saved, running stats, fallbacks."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import act_hf
import act_hf.compress
from act_hf.context import track_saved
from act_hf.errors import ActHFValueError
from act_hf.nn._base import convert, revert
from act_hf.nn.linear import ActConvMixin, ActLinearMixin
from act_hf.nn.norm import (
    ActBatchNormAct2dMixin,
    ActBatchNormActMixin,
    ActBatchNormMixin,
    ActLayerNorm,
    ActLayerNorm2dMixin,
    ActLayerNormMixin,
    ActRMSNormMixin,
    infer_rms_style,
)
from act_hf.ops import _gamma_guard
from act_hf.ops import norm as norm_ops
from act_hf.ops._saving import OpSettings
from act_hf.ops.norm import act_batch_norm_act, act_layer_norm, act_rms_norm, output_context_safe
from tests.utils import dispatched, packed_bytes, sqnr_db

# Minimum gradient SQNR (dB) vs float64 autograd, per bit width, for Gaussian inputs (fp32 / bf16 inputs). The
# input gradient is mostly exact terms (only its x_hat-weighted term carries noise), the weight gradient is a sum of
# per-element rounding noise: thresholds are for the worse of the two, on the odd shapes below (one row included).
SQNR_MIN = {2: 0.0, 3: 6.0, 4: 12.0, 8: 30.0}
SQNR_MIN_BF16_8 = 22.0  # bf16 rounding of the forward itself limits the match with float64
BITS = 8


def _randomize(module: nn.Module, scale: float = 0.1) -> nn.Module:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_((1.0 if name == "weight" else 0.0) + scale * torch.randn_like(p))
    return module


def _act(module: nn.Module, mixin: type, bits: int = BITS, **attrs) -> nn.Module:
    act = convert(copy.deepcopy(module), mixin, slot="m", bits=bits)
    for k, v in attrs.items():
        setattr(act, k, v)
    return act


def _grads_f64(module: nn.Module, x: torch.Tensor, g: torch.Tensor, fn=None):
    """Input and parameter gradients of ``module`` (deep-copied to float64) at ``x``."""
    ref = copy.deepcopy(module).double()
    xd = x.detach().double().requires_grad_()
    y = ref(xd) if fn is None else fn(ref, xd)
    y.backward(g.double())
    return xd.grad, {n: p.grad for n, p in ref.named_parameters()}


def _check_grads(tag: str, x_grad, p_grads: dict, ref_x, ref_p: dict, min_db: float) -> None:
    pairs = [("x", x_grad, ref_x)] + [(n, p_grads[n], ref_p[n]) for n in ref_p]
    values = {n: sqnr_db(r, a) for n, a, r in pairs}
    print(tag, {n: round(v, 1) for n, v in values.items()})
    for n, v in values.items():
        assert v >= min_db, f"{tag}: {n} gradient SQNR {v:.1f} dB < {min_db}"


def _run(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    xx = x.clone().requires_grad_()
    y = module(xx)
    y.backward(g)
    return y, xx.grad, {n: p.grad for n, p in module.named_parameters()}


def _min_db(dtype, bits=BITS):
    return SQNR_MIN_BF16_8 if dtype == torch.bfloat16 and bits == 8 else SQNR_MIN[bits]


# ---------------------------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1023), (2, 7, 129)])
@pytest.mark.parametrize("affine", ["affine", "nobias", "none"])
@pytest.mark.parametrize("context", ["output", "input"])
def test_layer_norm_forward_exact_and_grads(dtype, shape, affine, context):
    torch.manual_seed(0)
    ln = nn.LayerNorm(shape[-1], elementwise_affine=affine != "none", bias=affine == "affine")
    ln = _randomize(ln).to(dtype)
    act = _act(ln, ActLayerNormMixin, act_norm_context=context)
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    g = torch.randn(shape, dtype=dtype)
    y_ref, *_ = _run(ln, x, g)
    y, gx, gp = _run(act, x, g)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
    rx, rp = _grads_f64(ln, x, g)
    _check_grads(f"LN {dtype} {shape} {affine} {context}", gx, gp, rx, rp, _min_db(dtype))
    assert gx.dtype == dtype and all(gp[n].dtype == p.dtype for n, p in act.named_parameters())


def test_layer_norm_multi_dim_normalized_shape():
    torch.manual_seed(1)
    ln = _randomize(nn.LayerNorm((5, 33)))
    act = _act(ln, ActLayerNormMixin)
    x, g = torch.randn(3, 5, 33), torch.randn(3, 5, 33)
    y, gx, gp = _run(act, x, g)
    assert torch.equal(y, ln(x))
    rx, rp = _grads_f64(ln, x, g)
    _check_grads("LN (5,33)", gx, gp, rx, rp, SQNR_MIN[8])


@pytest.mark.parametrize("context", ["output", "input"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_layer_norm_low_bits_sqnr(context, bits):
    torch.manual_seed(2)
    ln = _randomize(nn.LayerNorm(256))
    act = _act(ln, ActLayerNormMixin, bits=bits, act_norm_context=context)
    x, g = torch.randn(8, 32, 256), torch.randn(8, 32, 256)
    _, gx, gp = _run(act, x, g)
    rx, rp = _grads_f64(ln, x, g)
    _check_grads(f"LN bits={bits} {context}", gx, gp, rx, rp, SQNR_MIN[bits])


@pytest.mark.parametrize("context", ["output", "input"])
def test_layer_norm_unbiased_over_draws(context):
    """The mean of K gradient draws at 2 bits approaches the exact gradient like 1/sqrt(K)."""
    torch.manual_seed(3)
    ln = _randomize(nn.LayerNorm(129))
    act = _act(ln, ActLayerNormMixin, bits=2, act_norm_context=context)
    x, g = torch.randn(2, 7, 129), torch.randn(2, 7, 129)
    rx, rp = _grads_f64(ln, x, g)
    draws_x, draws_w = [], []
    for s in range(64):
        act_hf.compress.manual_seed(s)
        act.zero_grad()
        _, gx, gp = _run(act, x, g)
        draws_x.append(gx.double())
        draws_w.append(gp["weight"].double())

    def err(draws, ref, k):  # mean error of the average of k draws, over 64 / k disjoint batches
        return sum((torch.stack(draws[i:i + k]).mean(0) - ref).norm().item() for i in range(0, 64, k)) / (64 // k)

    for name, draws, ref in (("x", draws_x, rx), ("weight", draws_w, rp["weight"])):
        e1, e16 = err(draws, ref, 1), err(draws, ref, 16)
        print(f"{context} {name}: error of 1 draw {e1:.4g}, of the mean of 16 {e16:.4g} (ratio {e1 / e16:.2f})")
        assert e16 < e1 / 2.5  # 4x for exactly unbiased noise


def test_layer_norm_saved_bytes_output_and_input():
    torch.manual_seed(4)
    rows, n = 14, 129
    ln = _randomize(nn.LayerNorm(n))
    x = torch.randn(2, 7, n, requires_grad=True)
    for context, extra in (("output", rows * 4), ("input", 2 * rows * 4)):
        act = _act(ln, ActLayerNormMixin, bits=3, act_norm_context=context)
        with track_saved(act) as saved:
            act(x)
        expected = packed_bytes(rows * n, 3) + extra
        print(context, saved.bytes, expected, saved.by_slot)
        assert saved.bytes == expected
        assert saved.by_slot[f"m:{context}"] == packed_bytes(rows * n, 3)


def test_layer_norm_needs_input_grad():
    torch.manual_seed(5)
    n = 129
    ln = _randomize(nn.LayerNorm(n))
    x = torch.randn(3, n)
    # frozen weight and bias, input needs grad: context saved, no parameter gradients
    act = _act(ln, ActLayerNormMixin, bits=8)
    act.weight.requires_grad_(False)
    act.bias.requires_grad_(False)
    xx = x.clone().requires_grad_()
    with track_saved(act) as saved:
        y = act(xx)
    y.sum().backward()
    assert act.weight.grad is None and act.bias.grad is None and xx.grad is not None
    assert saved.bytes == packed_bytes(3 * n, 8) + 3 * 4
    # input without grad, weight trainable: the output and no rstd
    act = _act(ln, ActLayerNormMixin, bits=8)
    with track_saved(act) as saved:
        y = act(x)
    y.sum().backward()
    assert act.weight.grad is not None
    assert saved.bytes == packed_bytes(3 * n, 8)
    # only the bias trains: nothing to save
    act.weight.requires_grad_(False)
    act.bias.grad = None
    with track_saved(act) as saved:
        y = act(x)
    g = torch.randn_like(y)
    y.backward(g)
    assert saved.bytes == 0
    torch.testing.assert_close(act.bias.grad, g.sum(0))


def test_layer_norm_feeding_linear_saves_output_once():
    torch.manual_seed(6)
    n, rows = 256, 24
    model = nn.Sequential(_randomize(nn.LayerNorm(n)), nn.Linear(n, 64), nn.Linear(n, 64))
    convert(model[0], ActLayerNormMixin, slot="ln", bits=3)
    convert(model[1], ActLinearMixin, slot="q", bits=3)
    convert(model[2], ActLinearMixin, slot="k", bits=3)
    x = torch.randn(rows, n, requires_grad=True)
    with track_saved(model) as saved:
        h = model[0](x)
        out = model[1](h) + model[2](h)
    print(saved.by_slot)
    assert set(saved.by_slot) == {"ln:output", "<uncompressed:torch.float32>"}
    assert saved.bytes == packed_bytes(rows * n, 3) + rows * 4
    out.sum().backward()
    assert x.grad is not None and model[1].weight.grad is not None


def test_layer_norm_small_gamma_falls_back_to_input():
    torch.manual_seed(7)
    n = 64
    ln = _randomize(nn.LayerNorm(n))
    with torch.no_grad():
        ln.weight[3] = 0.0
    act = _act(ln, ActLayerNormMixin, bits=8)
    x, g = torch.randn(4, n), torch.randn(4, n)
    with track_saved(act) as saved:
        _, gx, gp = _run(act, x, g)
    assert saved.bytes == packed_bytes(4 * n, 8) + 2 * 4 * 4  # the input form
    rx, rp = _grads_f64(ln, x, g)
    _check_grads("LN gamma=0", gx, gp, rx, rp, SQNR_MIN[8])
    # the guard is recomputed after the weight changes
    with torch.no_grad():
        act.weight[3] = 1.0
    with track_saved(act) as saved:
        act(x.requires_grad_())
    assert saved.bytes == packed_bytes(4 * n, 8) + 4 * 4


def _guard_by_definition(weight, offset, gamma_eps):
    g = (weight.detach().double() + offset).abs()
    return bool(torch.isfinite(g.max()) and g.max() > 0 and g.min() >= gamma_eps * g.max())


def test_gamma_guard_answers_each_weight_as_defined():
    """Weights of several sizes, offsets and thresholds answered together match the definition one by one."""
    torch.manual_seed(0)
    cases = [(torch.randn(16) + 3, 0.0, 0.05), (torch.randn(16) + 3, 0.0, 0.5), (torch.zeros(16), 0.0, 0.05),
             (torch.full((16,), -1.0), 1.0, 0.05), (torch.randn(8).abs() + 1, 0.0, 0.05),
             (torch.tensor([1.0, float("nan"), 1.0, 1.0]), 0.0, 0.05),
             (torch.ones(8, dtype=torch.bfloat16), 0.0, 0.05), (torch.tensor([1.0, 0.04, 1.0, 1.0]), 0.0, 0.05),
             (torch.tensor([1.0, 0.06, 1.0, 1.0]), 0.0, 0.05)]
    items = [(w, (off, eps)) for w, off, eps in cases]
    assert _gamma_guard._answers(items) == [_guard_by_definition(*case) for case in cases]
    for w, off, eps in cases:
        assert output_context_safe(w, offset=off, gamma_eps=eps) == _guard_by_definition(w, off, eps)
    assert output_context_safe(None, gamma_eps=0.05)
    w = nn.Parameter(torch.ones(8))
    assert output_context_safe(w, gamma_eps=0.05, cache=True)
    swapped = torch.ones(8)
    swapped[2] = 0.0
    w.data = swapped  # same version counter, new storage (what a move to another device does): answered again
    assert not output_context_safe(w, gamma_eps=0.05, cache=True)


def test_gamma_guard_answers_all_changed_norms_in_one_pass(monkeypatch):
    """After an optimizer step, the first norm that runs answers every changed norm weight: one device sync a step
    (the others hit the cache), and each answer follows its weight's new values."""
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(4)),
                          nn.LayerNorm(16, elementwise_affine=False), nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8)))
    act_hf.patch(model, bits=4)
    calls = []
    real = _gamma_guard._answers
    monkeypatch.setattr(_gamma_guard, "_answers", lambda items: calls.append(len(items)) or real(items))
    x = torch.randn(3, 16)
    model(x).sum().backward()
    assert calls == [1] * 5  # first step: each weight is new
    calls.clear()
    with track_saved(model) as before:
        model(x).sum().backward()  # nothing changed
    assert calls == []
    with torch.no_grad():  # what an optimizer step does: every weight changes in place, one gamma to zero
        for p in model.parameters():
            p.add_(0.01)
        model[2][1].weight[5] = 0.0
    with track_saved(model) as saved:
        model(x).sum().backward()
    assert calls == [5]
    uncompressed = "<uncompressed:torch.float32>"  # the input form saves the per-row mean beside rstd
    assert saved.by_slot[uncompressed] == before.by_slot[uncompressed] + 3 * 4


def test_layer_norm_eval_and_no_grad_run_original():
    ln = _randomize(nn.LayerNorm(33))
    act = _act(ln, ActLayerNormMixin)
    x = torch.randn(5, 33, requires_grad=True)
    with track_saved(act) as saved:
        with torch.no_grad():
            y1 = act(x)
        act.eval()
        y2 = act(x)
    assert torch.equal(y1, ln(x)) and torch.equal(y2, ln(x))
    assert saved.by_slot.get("m:output", 0) == 0 and y2.grad_fn is not None
    assert type(y2.grad_fn).__name__ == "NativeLayerNormBackward0"


@pytest.mark.parametrize("mixin_kind", ["ln", "rms", "bn"])
def test_checkpoint_same_grads(mixin_kind):
    torch.manual_seed(8)
    if mixin_kind == "ln":
        mod = _act(_randomize(nn.LayerNorm(64)), ActLayerNormMixin, bits=3)
        x = torch.randn(6, 64)
    elif mixin_kind == "rms":
        mod = _act(_randomize(nn.RMSNorm(64)), ActRMSNormMixin, bits=3)
        x = torch.randn(6, 64)
    else:
        mod = _act(_randomize(nn.BatchNorm2d(4)), ActBatchNormMixin, bits=3)
        x = torch.randn(3, 4, 5, 5)
    g = torch.randn_like(x)

    def grads(use_ckpt: bool):
        mod.zero_grad()
        xx = x.clone().requires_grad_()
        act_hf.compress.manual_seed(11)
        y = checkpoint(mod, xx, use_reentrant=False) if use_ckpt else mod(xx)
        act_hf.compress.manual_seed(11)  # the recomputation draws the same rounding as the first forward
        y.backward(g)
        return [xx.grad] + [p.grad.clone() for p in mod.parameters()]

    for a, b in zip(grads(False), grads(True)):
        assert torch.equal(a, b)


def test_layer_norm_autocast_dtypes():
    torch.manual_seed(9)
    ln = _randomize(nn.LayerNorm(64))
    lin = nn.Linear(64, 32)
    act_ln, act_lin = _act(ln, ActLayerNormMixin, bits=8), _act(lin, ActLinearMixin, bits=8)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 64, dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yr = lin(ln(x))
            ya = act_lin(act_ln(x.clone().requires_grad_()))
            assert act_ln(x.requires_grad_()).dtype == ln(x).dtype
        assert ya.dtype == yr.dtype and torch.equal(ya, yr)
        ya.float().sum().backward()


@pytest.mark.parametrize("policy", ["fp32", "none", "other"])
@pytest.mark.parametrize("context", ["output", "input"])
def test_layer_norm_under_each_autocast_policy(monkeypatch, policy, context):
    """Forward as autocast would run ``F.layer_norm`` under each policy ("none" is the CPU's; "fp32", CUDA's, and
    "other" are forced here), gradients against float64 from the statistics the forward used."""
    torch.manual_seed(3)
    ln = _randomize(nn.LayerNorm(64))
    act = _act(ln, ActLayerNormMixin, act_norm_context=context)
    monkeypatch.setitem(norm_ops._AUTOCAST_LAYER_NORM, ("cpu", torch.bfloat16), policy)
    x, g = torch.randn(6, 64, dtype=torch.bfloat16), torch.randn(6, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, gx, gp = _run(act, x, g)
    if policy == "fp32":
        expected = F.layer_norm(x.float(), (64,), ln.weight, ln.bias, ln.eps)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = ln(x)
    assert y.dtype == expected.dtype and torch.equal(y, expected)
    rx, rp = _grads_f64(ln, x, g)
    _check_grads(f"LN autocast {policy} {context}", gx, gp, rx, rp, SQNR_MIN_BF16_8)


def test_autocast_layer_norm_policy_of_the_cpu():
    assert norm_ops._autocast_layer_norm_policy("cpu") == "none"  # CPU autocast leaves layer_norm as called


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("context", ["output", "input"])
def test_layer_norm_under_cuda_autocast(dtype, context):
    """Under CUDA autocast the output is F.layer_norm's, bit for bit, by a native path (not the fallback for an
    unknown policy); gradients against float64. torch 2.11 on an H100 runs layer_norm as called there."""
    torch.manual_seed(4)
    ln = _randomize(nn.LayerNorm(256)).cuda()
    _check_under_cuda_autocast(ln, _act(ln, ActLayerNormMixin, act_norm_context=context), (128, 256), dtype,
                               f"LN cuda autocast {dtype} {context}")
    assert norm_ops._autocast_layer_norm_policy("cuda") in ("fp32", "none")


def _check_under_cuda_autocast(module: nn.Module, act: nn.Module, shape: tuple[int, ...], dtype: torch.dtype,
                               tag: str) -> None:
    """Under CUDA autocast at ``dtype``, ``act``'s output is ``module``'s, bit for bit, and its gradients are
    within the 8-bit bound of float64 ones."""
    x, g = torch.randn(shape, dtype=dtype, device="cuda"), torch.randn(shape, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        y, gx, gp = _run(act, x, g)
        expected = module(x)
    assert y.dtype == expected.dtype and torch.equal(y, expected)
    rx, rp = _grads_f64(module, x, g)
    _check_grads(tag, gx, gp, rx, rp, SQNR_MIN_BF16_8)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batch_norm_under_cuda_autocast(dtype):
    """CUDA autocast runs batch_norm as called: the output is the module's, bit for bit, its statistics come from
    that op; gradients against float64."""
    torch.manual_seed(5)
    bn = _randomize(nn.BatchNorm2d(16)).cuda()
    _check_under_cuda_autocast(bn, _act(bn, ActBatchNormMixin), (8, 16, 12, 12), dtype, f"BN cuda autocast {dtype}")
    assert norm_ops._autocast_batch_norm_policy("cuda") == "none"


def test_layer_norm_functional_errors():
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ActHFValueError, match="context"):
        act_layer_norm(x, 8, None, None, 1e-5, OpSettings("s", 3), context="middle")
    with pytest.raises(ActHFValueError, match="style"):
        act_rms_norm(x, torch.ones(8), 1e-6, OpSettings("s", 3), style="mistral")
    with pytest.raises(ActHFValueError, match="activation"):
        act_batch_norm_act(torch.randn(2, 3, 4), None, None, None, None, 0.1, 1e-5, OpSettings("s", 3),
                           activation="relu")
    with pytest.raises(ActHFValueError, match="negative_slope"):
        act_batch_norm_act(torch.randn(2, 3, 4), None, None, None, None, 0.1, 1e-5, OpSettings("s", 3),
                           activation="leaky_relu", param=0.0)
    act = ActLayerNorm(8)
    act.act_norm_context = "both"
    with pytest.raises(ActHFValueError, match="act_norm_context"):
        act(x)


def test_act_layer_norm_class_round_trip():
    ln = _randomize(nn.LayerNorm(16))
    act = convert(ln, ActLayerNormMixin, slot="a")
    assert type(act) is ActLayerNorm and isinstance(act, nn.LayerNorm)
    assert type(revert(act)) is nn.LayerNorm


# ---------------------------------------------------------------------------------------------- RMSNorm


def _rms_modules():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    del transformers
    return {"llama": LlamaRMSNorm, "qwen2": Qwen2RMSNorm, "t5": T5LayerNorm, "gemma": GemmaRMSNorm,
            "torch": lambda n: nn.RMSNorm(n, eps=1e-6)}


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("shape", [(1, 1, 1023), (2, 7, 129)])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "t5", "gemma", "torch"])
@pytest.mark.parametrize("context", ["output", "input"])
def test_rms_norm_forward_exact_and_grads(dtype, wdtype, shape, kind, context):
    torch.manual_seed(10)
    mod = _randomize(_rms_modules()[kind](shape[-1])).to(wdtype)
    if kind == "gemma":
        with torch.no_grad():
            mod.weight.sub_(1.0)  # (1 + weight) ~ 1
    act = _act(mod, ActRMSNormMixin, act_norm_context=context)
    assert infer_rms_style(act) == {"qwen2": "llama"}.get(kind, kind)
    x = (torch.randn(shape) * 2).to(dtype)
    y_ref = mod(x)
    g = torch.randn(shape, dtype=y_ref.dtype)
    y, gx, gp = _run(act, x, g)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
    rx, rp = _grads_f64(mod, x, g)
    _check_grads(f"RMS {kind} {dtype}/{wdtype} {shape} {context}", gx, gp, rx, rp,
                 _min_db(torch.bfloat16 if torch.bfloat16 in (dtype, wdtype) else dtype))


def test_rms_norm_torch_multi_dim_no_affine_and_eps_none():
    torch.manual_seed(11)
    for mod in (nn.RMSNorm((4, 33)), nn.RMSNorm(33, elementwise_affine=False)):
        mod = _randomize(mod)
        act = _act(mod, ActRMSNormMixin, bits=8)
        x = torch.randn(3, 4, 33)
        g = torch.randn_like(x)
        y, gx, gp = _run(act, x, g)
        assert torch.equal(y, mod(x))
        rx, rp = _grads_f64(mod, x, g)
        _check_grads(f"torch RMS {mod}", gx, gp, rx, rp, SQNR_MIN[8])


@pytest.mark.parametrize("context", ["output", "input"])
def test_rms_norm_saved_bytes_and_low_bits(context):
    torch.manual_seed(12)
    mod = _randomize(_rms_modules()["llama"](256))
    for bits in (2, 3, 4):
        act = _act(mod, ActRMSNormMixin, bits=bits, act_norm_context=context)
        x, g = torch.randn(8, 32, 256), torch.randn(8, 32, 256)
        with track_saved(act) as saved:
            _, gx, gp = _run(act, x, g)
        assert saved.bytes == packed_bytes(8 * 32 * 256, bits) + 8 * 32 * 4
        rx, rp = _grads_f64(mod, x, g)
        _check_grads(f"RMS bits={bits} {context}", gx, gp, rx, rp, SQNR_MIN[bits])


# ---------------------------------------------------------------------------------------------- LayerNorm2d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context", ["output", "input"])
def test_timm_layer_norm2d(dtype, context):
    timm_norm = pytest.importorskip("timm.layers.norm")
    torch.manual_seed(13)
    # 16 channels: over 5, the input form's x gradient at 8 bits spread over 25-41 dB from draw to draw
    mod = _randomize(timm_norm.LayerNorm2d(16)).to(dtype)
    act = _act(mod, ActLayerNorm2dMixin, act_norm_context=context)
    x = torch.randn(3, 16, 4, 4, dtype=dtype)
    g = torch.randn_like(x)
    y_ref = mod(x)
    y, gx, gp = _run(act, x, g)
    assert y.dtype == y_ref.dtype and y.stride() == y_ref.stride() and torch.equal(y, y_ref)
    rx, rp = _grads_f64(mod, x, g)
    _check_grads(f"LN2d {dtype} {context}", gx, gp, rx, rp, _min_db(dtype))


def test_timm_layer_norm2d_feeding_conv_saves_output_once():
    timm_norm = pytest.importorskip("timm.layers.norm")
    torch.manual_seed(14)
    norm = convert(_randomize(timm_norm.LayerNorm2d(8)), ActLayerNorm2dMixin, slot="ln", bits=4)
    conv = convert(nn.Conv2d(8, 8, 3, padding=1), ActConvMixin, slot="conv", bits=4)
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    with track_saved(nn.ModuleList([norm, conv])) as saved:
        out = conv(norm(x))
    print(saved.by_slot)
    assert "conv:input" not in saved.by_slot
    assert saved.bytes == packed_bytes(2 * 8 * 25, 4) + 2 * 25 * 4
    out.sum().backward()
    assert norm.weight.grad is not None


# ---------------------------------------------------------------------------------------------- BatchNorm


_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_BN_SHAPES = {1: [(5, 3), (4, 3, 7)], 2: [(3, 5, 4, 4)], 3: [(2, 5, 3, 4, 5)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims,shape", [(d, s) for d, ss in _BN_SHAPES.items() for s in ss])
@pytest.mark.parametrize("momentum,track", [(0.1, True), (None, True), (0.1, False)])
def test_batch_norm_forward_stats_and_grads(dtype, dims, shape, momentum, track):
    torch.manual_seed(15)
    bn = _randomize(_BN[dims](shape[1], momentum=momentum, track_running_stats=track))
    act = _act(bn, ActBatchNormMixin)
    for step in range(2):
        x = (torch.randn(shape) * 2 + 0.5).to(dtype)
        g = torch.randn(shape, dtype=dtype)
        y_ref, *_ = _run(bn, x, g)
        y, gx, gp = _run(act, x, g)
        assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
        for name, buf in bn.named_buffers():
            assert torch.equal(dict(act.named_buffers())[name], buf), name
    rx, rp = _grads_f64(bn.train(), x, g)
    act.zero_grad()
    _, gx, gp = _run(act, x, g)
    _check_grads(f"BN{dims}d {dtype} {shape} m={momentum} track={track}", gx, gp, rx, rp, _min_db(dtype))


@pytest.mark.parametrize("mixin", [ActBatchNormMixin, ActBatchNormActMixin])
@pytest.mark.parametrize("dtype,min_db", [(torch.float64, SQNR_MIN[8]), (torch.float16, SQNR_MIN[8]),
                                          (torch.bfloat16, SQNR_MIN_BF16_8)])
def test_batch_norm_cast_with_its_model_trains(mixin, dtype, min_db):
    """A BatchNorm cast with its model (``model.double()``, ``.half()``, ``.bfloat16()``: parameters, statistics
    and input of one dtype, no autocast) trains: aten's backward gets unit statistics of the dtype its forward made
    (fp32 ones failed with "expected scalar type BFloat16 but found Float"), and its gradients match float64's."""
    torch.manual_seed(19)
    bn = _randomize(nn.BatchNorm2d(5)).to(dtype)
    act = _act(bn, mixin)
    x = (torch.randn(3, 5, 4, 4, dtype=torch.float64) * 2 + 0.3).to(dtype)
    g = torch.randn(3, 5, 4, 4, dtype=torch.float64).to(dtype)
    y_ref, *_ = _run(bn, x, g)
    y, gx, gp = _run(act, x, g)
    assert torch.equal(y, y_ref)
    assert gx.dtype == dtype and all(p.dtype == dtype for p in gp.values())
    rx, rp = _grads_f64(bn, x, g)
    _check_grads(f"{mixin.__name__} cast to {dtype}", gx, gp, rx, rp, min_db)


def _full_size_fp32_made(fn, numel: int) -> int:
    """How many float32 storages of at least ``numel`` elements the ops ``fn()`` dispatches return."""
    return len({t.untyped_storage().data_ptr() for _, outputs in dispatched(fn) for t in outputs
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= numel})


@pytest.mark.parametrize("mixin", [ActBatchNormMixin, ActBatchNormActMixin])
def test_batch_norm_backward_of_a_bf16_input_makes_no_full_size_fp32_copy(mixin):
    """Backward of a bf16 BatchNorm works from the bf16 estimate (aten accumulates in fp32 inside its kernels): an fp32
    copy of the input's size would double the transient memory of the largest layers. The output form's inversion
    (x_hat = (z - beta) / gamma, identity activation) is decoded, mapped and rounded to bf16 in one pass
    (``dequantize_mapped``): no fp32 tensor either (it made one before)."""
    torch.manual_seed(17)
    bn = _randomize(nn.BatchNorm2d(8))
    act = _act(bn, mixin, bits=4)
    x = torch.randn(4, 8, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    y = act(x)
    made = _full_size_fp32_made(lambda: y.backward(torch.randn_like(y)), x.numel())
    assert made == 0
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("layout", [torch.channels_last, torch.channels_last_3d])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_backward_of_a_channels_last_model_copies_no_gradient(layout, dtype):
    """A channels-last model's BatchNorm: its output's gradient comes channels last, as its decoded normalized input
    lies, and backward hands both to aten as they are (it made the gradient row-major first: a copy of the input's
    size each BatchNorm); the gradients are those of row-major tensors, the input's in the input's layout."""
    torch.manual_seed(19)
    shape = (4, 8, 6, 6) if layout == torch.channels_last else (4, 8, 3, 4, 4)
    g, x_hat = (torch.randn(shape).to(dtype).contiguous(memory_format=layout) for _ in range(2))
    weight, invstd = torch.rand(8) + 0.5, torch.rand(8) + 0.5
    mask = [True, True, True]
    ops = dispatched(lambda: norm_ops._bn_backward_from_x_hat(g, x_hat, weight, invstd, mask))
    assert not [f for f, _ in ops if f.overloadpacket.__name__ in ("clone", "copy_", "contiguous")], ops
    got = norm_ops._bn_backward_from_x_hat(g, x_hat, weight, invstd, mask)
    want = norm_ops._bn_backward_from_x_hat(g.contiguous(), x_hat.contiguous(), weight, invstd, mask)
    assert got[0].is_contiguous(memory_format=layout)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("autocast", [False, True])
def test_batch_norm_forward_of_a_bf16_input_makes_no_full_size_fp32_tensor(autocast):
    """Forward of a bf16 BatchNorm takes its statistics from the op that normalizes (CPU and CUDA autocast run
    batch_norm as called) and the normalized input it packs from one inference-mode pass: no fp32 tensor of the
    input's size (before: an fp32 copy for the statistics and two fp32 passes for x_norm)."""
    torch.manual_seed(18)
    bn = _randomize(nn.BatchNorm2d(8))
    act = _act(bn, ActBatchNormMixin, bits=4)
    x = torch.randn(4, 8, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        made = _full_size_fp32_made(lambda: act(x), x.numel())
        y = act(x)
    assert made == 0
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        assert torch.equal(y, bn(x))  # the module's own output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_packs_its_normalized_input_as_it_reads_it(monkeypatch, dtype):
    """A contiguous fp32 or bf16 input's normalized form is never made: one ``act_hf::quantize_pack_normalized``
    reads the input and the per-channel statistics and packs ``(x - mean) * invstd`` (fp32), bit for bit the
    packing of that tensor, made by hand; the forward's one full-size tensor is its output, and the gradients are
    at 30+ dB from float64's (8 bits)."""
    import act_hf.context
    from act_hf.compress import quantize
    from act_hf.ops import norm as norm_ops

    made = []
    packer = act_hf.context.quantize_normalized
    monkeypatch.setattr(act_hf.context, "quantize_normalized", lambda *args: made.append(packer(*args)) or made[-1])
    torch.manual_seed(19)
    bn = _randomize(nn.BatchNorm2d(4)).to(dtype)
    act = _act(bn, ActBatchNormMixin, bits=8)
    x = (torch.randn(16, 4, 8, 8) * 2 + 0.3).to(dtype).requires_grad_()
    ops = dispatched(lambda: act(x))
    full = {t.untyped_storage().data_ptr() for _, outputs in ops for t in outputs
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == x.numel()}
    names = [str(func) for func, _ in ops]
    assert len(full - {x.untyped_storage().data_ptr()}) == 1 and names.count("aten.native_batch_norm.default") == 1
    assert names.count("act_hf.quantize_pack_normalized.default") == 1
    with track_saved(act) as saved:
        act_hf.manual_seed(3)
        y = act(x)
    assert saved.bytes == packed_bytes(x.numel(), 8) + 4 * x.element_size()  # and invstd (a bf16 model's is bf16)
    _, mean, invstd = norm_ops._bn_forward(x.detach(), None, None, None, None, 0.1, bn.eps)
    act_hf.manual_seed(3)
    expected = quantize((x.detach().float() - mean.view(1, -1, 1, 1)) * invstd.view(1, -1, 1, 1), 8)
    got = made[-1]
    assert got.spec.dtype == dtype and got.spec.shape == x.shape
    assert all(torch.equal(a, b) for a, b in zip((got.payload, got.lo, got.scale),
                                                 (expected.payload, expected.lo, expected.scale)))
    g = torch.randn_like(y)
    y.backward(g)
    _check_grads("BN normalized as read", x.grad.float(), {n: p.grad.float() for n, p in act.named_parameters()},
                 *_grads_f64(bn, x.detach().float().requires_grad_(), g.float()), 30 if dtype == torch.float32 else 20)


def test_batch_norm_packs_a_channels_last_normalized_input_slice_by_slice(monkeypatch):
    """A channels-last input's normalized form is made a slice of the batch at a time (here 4 slices of 4 rows: the
    chunk is cut to 1024 elements), never whole: the forward's one full-size tensor is its output, and the context
    is as large and as close as one packed at once (8 bits: gradients at 30+ dB from float64's)."""
    import act_hf.context

    monkeypatch.setattr(act_hf.context, "chunk_elements", lambda device: 256)
    torch.manual_seed(19)
    bn = _randomize(nn.BatchNorm2d(4))
    act = _act(bn, ActBatchNormMixin, bits=8)
    x = torch.randn(16, 4, 8, 8).contiguous(memory_format=torch.channels_last).requires_grad_()
    ops = dispatched(lambda: act(x))
    full = {t.untyped_storage().data_ptr() for _, outputs in ops for t in outputs
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == x.numel()}
    batch_norms = [out[0].shape[0] for func, out in ops if func is torch.ops.aten.native_batch_norm.default]
    assert len(full) == 1 and batch_norms == [16, 4, 4, 4, 4]  # the training pass, then the slices' normalizing
    with track_saved(act) as saved:
        y = act(x)
    assert saved.bytes == packed_bytes(x.numel(), 8) + 4 * 4
    g = torch.randn_like(y)
    y.backward(g)
    _check_grads("BN by slices", x.grad, {n: p.grad for n, p in act.named_parameters()}, *_grads_f64(bn, x, g), 30)


def test_batch_norm_backward_past_the_chunk_size_decodes_whole_where_the_device_has_room(monkeypatch):
    """Where the device has room (``ACT_HF_SLICING=never``: room whatever the device), BatchNorm's backward past
    ``BATCH_NORM_CHUNK_ELEMENTS`` decodes its normalized input once, whole, and its gradients are those below the
    threshold, bit for bit."""
    from act_hf.ops import norm as norm_ops

    torch.manual_seed(20)
    act = _act(_randomize(nn.BatchNorm2d(8)), ActBatchNormMixin, bits=8)
    x, g = torch.randn(6, 8, 8, 8) * 2 + 0.3, torch.randn(6, 8, 8, 8)
    runs = []
    for chunk, mode in ((norm_ops.BATCH_NORM_CHUNK_ELEMENTS, "always"), (2 * 8 * 8 * 8, "never")):
        monkeypatch.setattr(norm_ops, "BATCH_NORM_CHUNK_ELEMENTS", chunk)
        monkeypatch.setenv("ACT_HF_SLICING", mode)
        act_hf.manual_seed(0)
        xx = x.clone().requires_grad_()
        y = act(xx)
        ops = dispatched(functools.partial(y.backward, g))
        decoded = [out[0].numel() for func, out in ops if func is torch.ops.act_hf.unpack_dequantize.default]
        runs.append((decoded, xx.grad, act.weight.grad.clone(), act.bias.grad.clone()))
        act.zero_grad()
    (decoded_small, *grads_small), (decoded_room, *grads_room) = runs
    assert decoded_room == decoded_small == [x.numel()]
    for small, room in zip(grads_small, grads_room):
        assert torch.equal(room, small)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_batch_norm_backward_decodes_its_normalized_input_a_slice_at_a_time(monkeypatch, dtype, channels_last,
                                                                            device):
    """Past ``BATCH_NORM_CHUNK_ELEMENTS`` BatchNorm's backward decodes its normalized input a slice of the batch at a
    time, twice (the sums, then the input gradient), and never whole; its gradients are the whole decode's up to
    rounding (sums in another order, one rounding of the input gradient from fp32, or fp64 for fp64), the input
    gradient in the gradient's layout, 30+ dB from float64's at 8 bits. On CUDA each slice runs aten's own
    BatchNorm backward kernels, the reduction and the elementwise one, and no other op over the slice."""
    from act_hf.ops import norm as norm_ops

    torch.manual_seed(20)
    bn = _randomize(nn.BatchNorm2d(8)).to(device, dtype)
    act = _act(bn, ActBatchNormMixin, bits=8)
    x = (torch.randn(6, 8, 8, 8, dtype=torch.float64) * 2 + 0.3).to(device, dtype)
    g = torch.randn(6, 8, 8, 8, dtype=torch.float64).to(device, dtype)
    if channels_last:
        x, g = (t.contiguous(memory_format=torch.channels_last) for t in (x, g))
    runs = []
    monkeypatch.setenv("ACT_HF_SLICING", "always")  # the slices, whatever room a GPU has
    for chunk in (norm_ops.BATCH_NORM_CHUNK_ELEMENTS, 2 * 8 * 8 * 8):  # slices of 2 items
        monkeypatch.setattr(norm_ops, "BATCH_NORM_CHUNK_ELEMENTS", chunk)
        act_hf.manual_seed(0)
        xx = x.clone(memory_format=torch.preserve_format).requires_grad_()
        y = act(xx)
        ops = dispatched(functools.partial(y.backward, g))
        decoded = [out[0].numel() for func, out in ops if func is torch.ops.act_hf.unpack_dequantize.default]
        runs.append((decoded, xx.grad, {n: p.grad for n, p in act.named_parameters()}))
        act.zero_grad()
    (decoded_whole, gx_whole, gp_whole), (decoded_sliced, gx_sliced, gp_sliced) = runs
    assert decoded_whole == [x.numel()] and decoded_sliced == [x.numel() // 3] * 6
    if device == "cuda":  # the sliced run's ops that write a slice-sized tensor, views aside; the reductions
        names = [func.overloadpacket.__name__ for func, _ in ops]
        slice_ops = [func.overloadpacket.__name__ for func, out in ops if not func.is_view
                     and any(isinstance(t, torch.Tensor) and t.numel() == x.numel() // 3 for t in out)]
        assert slice_ops == ["unpack_dequantize"] * 3 \
            + ["unpack_dequantize", "batch_norm_backward_elemt", "copy_"] * 3, slice_ops
        assert names.count("batch_norm_backward_reduce") == 3, names
    assert gx_sliced.dtype == dtype and gx_sliced.stride() == gx_whole.stride()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(gx_sliced, gx_whole, rtol=tol, atol=tol * gx_whole.abs().max().item())
    for name, grad in gp_whole.items():
        torch.testing.assert_close(gp_sliced[name], grad, rtol=tol, atol=tol * grad.abs().max().item(), msg=name)
    _check_grads(f"BN sliced backward {dtype}", gx_sliced, gp_sliced, *_grads_f64(bn, x, g),
                 SQNR_MIN_BF16_8 if dtype == torch.bfloat16 else 30)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("x_dtype,bn_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float64, torch.float64)])
def test_batch_norm_writes_into_an_input_its_caller_owns(x_dtype, bn_dtype, channels_last, device):
    """Handed its input to own (a ResNet block's conv output), BatchNorm writes its output into it and returns
    it: the output is the module's own bit for bit (aten's native kernels, the ones ``torch.batch_norm`` runs for
    these inputs: on CUDA for bf16 only, cuDNN taking fp32 and fp64, which stay out of place), the running
    statistics too, and the gradients are the out-of-place path's up to the last rounding of the statistics it
    packs with (30+ dB from float64's at 8 bits; bf16: 22+)."""
    torch.manual_seed(23)
    bn = _randomize(nn.BatchNorm2d(6)).to(device, bn_dtype)
    act, out_of_place = _act(bn, ActBatchNormMixin), _act(bn, ActBatchNormMixin)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    base = (torch.randn(8, 6, 5, 5, device=device) * 2 + 0.3).to(x_dtype).contiguous(memory_format=layout)
    g = torch.randn_like(base)
    for step in range(2):
        leaf = base.clone().requires_grad_()
        owned = leaf * 1.0  # a fresh non-leaf tensor, as a conv's output
        in_place = device == "cpu" or x_dtype == torch.bfloat16
        assert norm_ops.writes_in_place(owned, act.weight, act.bias, act.running_mean, act.running_var,
                                        act.eps) == in_place
        act_hf.manual_seed(step)
        y = act(owned, act_input_owned=True)
        assert (y is owned) == in_place and y.is_contiguous(memory_format=layout)
        with torch.no_grad():
            expected = bn(base)
        assert torch.equal(y, expected)
        assert all(torch.equal(a, b) for a, b in zip(act.buffers(), bn.buffers()))
        y.backward(g)
        act_hf.manual_seed(step)
        y_out, gx, gp = _run(out_of_place, base, g)
        assert y_out.data_ptr() != base.data_ptr() and torch.equal(y_out, expected)
        grads = {n: p.grad.cpu() for n, p in act.named_parameters()}
        for name, grad in grads.items():
            assert sqnr_db(gp[name].double().cpu(), grad.double()) > 60, name
        assert sqnr_db(gx.double(), leaf.grad.double()) > 60
        act.zero_grad()
        out_of_place.zero_grad()
    rx, rp = _grads_f64(bn.cpu(), base.cpu(), g.cpu())
    _check_grads(f"BN in place {x_dtype}/{bn_dtype}", leaf.grad.cpu(), grads, rx, rp, _min_db(x_dtype))


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _by_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (like.dim() - 2)).to(_acc(like))


def _elemt(x, weight, bias, mean, invstd, eps):
    y = (x.to(_acc(x)) - _by_channel(mean, x)) * _by_channel(invstd, x)
    if weight is not None:
        y = y * _by_channel(weight, x)
    if bias is not None:
        y = y + _by_channel(bias, x)
    return y.to(x.dtype)


def _elemt_out(x, weight, bias, mean, invstd, eps, *, out):
    return out.copy_(_elemt(x, weight, bias, mean, invstd, eps))


def _backward_reduce(grad_out, x, mean, invstd, weight, input_g, weight_g, bias_g):
    dims = [0, *range(2, x.dim())]
    g = grad_out.to(_acc(x))
    sum_dy, sum_dy_xmu = g.sum(dims), (g * (x.to(_acc(x)) - _by_channel(mean, x))).sum(dims)
    empty = mean.new_empty(0)
    return (sum_dy if input_g else empty, sum_dy_xmu if input_g else empty,
            sum_dy_xmu * invstd if weight_g else empty, sum_dy if bias_g else empty)


def _backward_elemt(grad_out, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    n = count.sum().to(_acc(x))
    factor = _by_channel(invstd, x) if weight is None else _by_channel(invstd * weight, x)
    centred = x.to(_acc(x)) - _by_channel(mean, x)
    grad = grad_out.to(_acc(x)) - _by_channel(sum_dy / n, x) \
        - centred * _by_channel(invstd * invstd * sum_dy_xmu / n, x)
    return (grad * factor).to(grad_out.dtype)


@pytest.fixture
def split_kernels_on_cpu(monkeypatch):
    """act_hf's CUDA BatchNorm paths on CPU tensors: aten's split kernels, CUDA-only, stood in for by their formulas
    (aten/src/ATen/native/cuda/Normalization.cuh, accumulated in fp32, fp64 for fp64), so that what act_hf passes
    them and how it joins their results is checked where no GPU is; their own bits are the GPU tests'."""
    lib = torch.library.Library("aten", "IMPL")
    for name, kernel in (("batch_norm_elemt", _elemt), ("batch_norm_elemt.out", _elemt_out),
                         ("batch_norm_backward_reduce", _backward_reduce),
                         ("batch_norm_backward_elemt", _backward_elemt)):
        lib.impl(name, kernel, "CPU")
    monkeypatch.setattr(norm_ops, "_split_kernels", lambda t: True)
    yield
    lib._destroy()


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype,bn_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.float64, torch.float64)])
def test_batch_norm_cuda_paths_on_cpu_stand_ins(split_kernels_on_cpu, monkeypatch, dtype, bn_dtype, channels_last):
    """The CUDA paths of BatchNorm, run on the CPU with aten's split kernels stood in for: writing into an owned
    input, the statistics are read once (``batch_norm_update_stats``, which updates the running statistics) and
    the output written by ``batch_norm_elemt`` from them, the module's output and running statistics to rounding
    (the CPU's packing normalizes by inference-mode BatchNorms, which the GPU's kernel does as it reads);
    past ``BATCH_NORM_CHUNK_ELEMENTS`` the backward runs ``batch_norm_backward_reduce`` and then
    ``batch_norm_backward_elemt`` over each slice of the normalized input, decoded in the gradient's dtype, and its
    gradients are the CPU path's to rounding."""
    torch.manual_seed(25)
    bn = _randomize(nn.BatchNorm2d(8)).to(bn_dtype)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    base = (torch.randn(6, 8, 8, 8, dtype=torch.float64) * 2 + 0.3).to(dtype).contiguous(memory_format=layout)
    g = torch.randn(6, 8, 8, 8, dtype=torch.float64).to(dtype).contiguous(memory_format=layout)
    monkeypatch.setenv("ACT_HF_SLICING", "always")
    monkeypatch.setattr(norm_ops, "BATCH_NORM_CHUNK_ELEMENTS", 2 * 8 * 8 * 8)  # slices of 2 items
    runs = []
    for split in (True, False):
        monkeypatch.setattr(norm_ops, "_split_kernels", lambda t, split=split: split)
        act = _act(bn, ActBatchNormMixin)
        leaf = base.clone(memory_format=torch.preserve_format).requires_grad_()
        owned = leaf * 1.0
        act_hf.manual_seed(0)
        out: list[torch.Tensor] = []
        forward = [func.overloadpacket.__name__ for func, _ in dispatched(
            lambda act=act, owned=owned, out=out: out.append(act(owned, act_input_owned=True)))]
        assert out[0] is owned
        backward = dispatched(functools.partial(out[0].backward, g))
        runs.append((forward, backward, out[0].detach(), leaf.grad, {n: p.grad for n, p in act.named_parameters()},
                     dict(act.named_buffers())))
    (forward, backward, y, gx, gp, buffers), (_, _, y_cpu, gx_cpu, gp_cpu, buffers_cpu) = runs
    assert forward.count("batch_norm_update_stats") == 1 and forward.count("batch_norm_elemt") == 1, forward
    assert "batch_norm_stats" not in forward, forward
    slice_ops = [func.overloadpacket.__name__ for func, out in backward if not func.is_view
                 and any(isinstance(t, torch.Tensor) and t.numel() == base.numel() // 3 for t in out)]
    assert slice_ops == ["unpack_dequantize"] * 3 + ["unpack_dequantize", "batch_norm_backward_elemt", "copy_"] * 3
    names = [func.overloadpacket.__name__ for func, _ in backward]
    assert names.count("batch_norm_backward_reduce") == 3, names
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    with torch.no_grad():
        expected = bn(base)
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(y, y_cpu, rtol=tol, atol=tol)
    for name, buffer in buffers_cpu.items():
        torch.testing.assert_close(buffers[name], buffer, rtol=tol, atol=tol, msg=name)
    assert gx.dtype == dtype and gx.stride() == gx_cpu.stride()
    torch.testing.assert_close(gx, gx_cpu, rtol=tol, atol=tol * gx_cpu.abs().max().item())
    for name, grad in gp_cpu.items():
        torch.testing.assert_close(gp[name], grad, rtol=tol, atol=tol * grad.abs().max().item(), msg=name)


@pytest.mark.cuda
@pytest.mark.parametrize("bias", [True, False])
def test_batch_norm_in_place_on_cuda_takes_its_statistics_once(bias):
    """On CUDA, BatchNorm writing into an input it owns reads it once for the statistics, as the module does:
    aten's ``batch_norm_update_stats`` (``native_batch_norm``'s statistics kernel and running-statistics update)
    gives the statistics the packing uses, and ``batch_norm_elemt`` (its elementwise kernel) writes the output
    from them: no second statistics pass, and no other BatchNorm op (a contiguous input: one packed as it is read;
    a channels-last one is normalized a slice at a time by inference-mode BatchNorms, and keeps the module's bits
    too in :func:`test_batch_norm_writes_into_an_input_its_caller_owns`, which runs steps of both layouts). The
    output and the running statistics are the module's bit for bit; here for a bias-free BatchNorm too, whose
    backend choice differs."""
    torch.manual_seed(24)
    bn = _randomize(nn.BatchNorm2d(6)).cuda()
    if not bias:
        bn.bias = None
    act = _act(bn, ActBatchNormMixin)
    base = (torch.randn(8, 6, 5, 5, device="cuda") * 2 + 0.3).bfloat16()
    owned = base.clone().requires_grad_() * 1.0
    out: list[torch.Tensor] = []
    names = [func.overloadpacket.__name__
             for func, _ in dispatched(lambda: out.append(act(owned, act_input_owned=True)))]
    assert out[0] is owned
    assert names.count("batch_norm_update_stats") == 1 and names.count("batch_norm_elemt") == 1, names
    assert not {"native_batch_norm", "batch_norm_stats", "_batch_norm_impl_index"} & set(names), names
    with torch.no_grad():
        expected = bn(base)
    assert torch.equal(out[0], expected)
    assert all(torch.equal(a, b) for a, b in zip(act.buffers(), bn.buffers()))


def test_batch_norm_keeps_an_input_it_cannot_write_into():
    """The output is a new tensor where writing into the input would change what the module computes or what
    autograd needs: a leaf that needs a gradient, a view, no affine weight, parameters of the input's own reduced
    dtype (a bf16 model: aten's statistics would be bf16) or a running mean without a running variance."""
    torch.manual_seed(24)
    bn = _randomize(nn.BatchNorm2d(6))
    act = _act(bn, ActBatchNormMixin)
    base = torch.randn(8, 6, 5, 5)
    stats = (act.running_mean, act.running_var)

    def writes(x, weight=act.weight, bias=act.bias, running=stats):
        return norm_ops.writes_in_place(x, weight, bias, *running, act.eps)

    owned = base.clone().requires_grad_() * 1.0
    assert writes(owned) and writes(owned, bias=None) and writes(owned, running=(None, None))
    assert not writes(base.clone().requires_grad_())
    assert not writes((base.clone().requires_grad_() * 1.0)[:, :4])
    assert not writes(owned, weight=None)
    assert not writes(owned.bfloat16(), weight=act.weight.bfloat16(), bias=act.bias.bfloat16(),
                      running=(act.running_mean.bfloat16(), act.running_var.bfloat16()))
    assert not writes(owned, running=(act.running_mean, None))
    leaf = base.clone().requires_grad_()
    y = act(leaf, act_input_owned=True)
    assert y is not leaf and torch.equal(leaf, base)


def test_batch_norm_saved_bytes_eval_and_frozen():
    torch.manual_seed(16)
    bn = _randomize(nn.BatchNorm2d(5))
    act = _act(bn, ActBatchNormMixin, bits=4)
    x = torch.randn(3, 5, 4, 4, requires_grad=True)
    with track_saved(act) as saved:
        act(x)
    assert saved.bytes == packed_bytes(x.numel(), 4) + 5 * 4  # x_norm and invstd
    act.eval()
    with track_saved(act) as saved:
        y = act(x)
    expected = F.batch_norm(x, act.running_mean, act.running_var, act.weight, act.bias, False, 0.1, act.eps)
    assert torch.equal(y, expected) and "m:input" not in saved.by_slot
    act.train()
    with torch.no_grad():
        assert torch.equal(act(x), bn.train()(x))
    # frozen affine, input needs grad
    act.weight.requires_grad_(False)
    act.bias.requires_grad_(False)
    x.grad = None
    act(x).sum().backward()
    assert act.weight.grad is None and x.grad is not None


def test_sync_batch_norm_runs_original():
    sbn = nn.SyncBatchNorm(4)
    act = convert(copy.deepcopy(sbn), ActBatchNormMixin, slot="m")
    act.eval()
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    assert torch.equal(act(x), sbn.eval()(x))


# ---------------------------------------------------------------------------------------------- In-Place ABN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_layer,min_db", [(nn.Identity, None), (lambda: nn.LeakyReLU(0.1), None),
                                              (lambda: nn.LeakyReLU(0.01), None), (nn.ELU, None),
                                              (nn.ReLU, None)])
def test_timm_batch_norm_act(dtype, act_layer, min_db):
    norm_act = pytest.importorskip("timm.layers.norm_act")
    torch.manual_seed(17)
    mod = _randomize(norm_act.BatchNormAct2d(5, act_layer=act_layer, inplace=True))
    act = _act(mod, ActBatchNormAct2dMixin)
    x = (torch.randn(3, 5, 4, 4) * 2 + 0.3).to(dtype)
    g = torch.randn(3, 5, 4, 4, dtype=dtype)
    with track_saved(act) as saved:
        y, gx, gp = _run(act, x, g)
    y_ref, *_ = _run(mod, x, g)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)
    for name, buf in mod.named_buffers():
        assert torch.equal(dict(act.named_buffers())[name], buf), name
    fused = isinstance(mod.act, (nn.Identity, nn.ELU))  # never a leaky ReLU: see the test below
    assert (f"m:{'output' if fused else 'input'}") in saved.by_slot
    act.zero_grad()
    _, gx, gp = _run(act, x, g)
    rx, rp = _grads_f64(mod, x, g)
    _check_grads(f"BNAct {mod.act} {dtype}", gx, gp, rx, rp, min_db or _min_db(dtype))


def _conv_norm_act_stack(act_layer, depth=6, channels=16):
    layers = pytest.importorskip("timm.layers")
    torch.manual_seed(23)
    net = nn.Sequential(*[layers.ConvNormAct(3 if i == 0 else channels, channels, 3, act_layer=act_layer)
                          for i in range(depth)])
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            _randomize(m)
    return net


def _whole_gradient_error(ref: nn.Module, model: nn.Module, x: torch.Tensor, draws: int = 2) -> float:
    """Relative error of the concatenated parameter and input gradients, mean over rounding draws."""
    def grads(m, dtype=torch.float32):
        m.zero_grad()
        xx = x.to(dtype).requires_grad_()
        m(xx).pow(2).mean().backward()
        return torch.cat([xx.grad.flatten()] + [p.grad.flatten() for p in m.parameters()]).double()

    exact = grads(copy.deepcopy(ref).double(), torch.float64)
    errs = []
    for d in range(draws):
        act_hf.compress.manual_seed(d)
        errs.append(((grads(model) - exact).norm() / exact.norm()).item())
    return sum(errs) / draws


@pytest.mark.parametrize("slope", [0.01, 0.1])
def test_leaky_relu_after_batch_norm_is_not_inverted(slope):
    """timm BatchNormAct2d + LeakyReLU keeps BatchNorm's quantized input, a 1-bit leaky code, and the conv after it
    reads BatchNorm's packed input: 0.7% more bytes than the fused output form, whose inversion divided the
    rounding noise of the negative branch by the slope. Six ConvNormAct layers at 4 bits, whole-gradient
    relative error over 4 draws: 0.234 / 0.225 for slopes 0.01 / 0.1; the fused form had 5.14 / 0.69."""
    ref = _conv_norm_act_stack(lambda: nn.LeakyReLU(slope))
    model = act_hf.patch(copy.deepcopy(ref), bits=4)
    bna = model[2].bn
    assert isinstance(bna, ActBatchNormAct2dMixin)
    x = torch.randn(4, 3, 16, 16)
    with track_saved(model) as saved:
        model(x.clone().requires_grad_())
    assert "2.bn:output" not in saved.by_slot and "2.bn:input" in saved.by_slot and "2.bn.act:input" in saved.by_slot
    assert "3.conv:input" not in saved.by_slot  # read from 2.bn's packed input (act_hf.derived)
    assert not any(k.startswith("<uncompressed") and v > 4096 for k, v in saved.by_slot.items()), saved.by_slot
    assert _whole_gradient_error(ref, model, x) < 0.35


def test_batch_norm_act_whose_gamma_the_output_form_rejects_compresses_its_activation():
    """A zero-initialised gamma makes the fused form fall back to the input form; the activation module after it
    must then save its own few-bit code, not an fp32 input (it had: 4 bytes an element)."""
    ref = _conv_norm_act_stack(nn.ELU, depth=2)
    with torch.no_grad():
        ref[1].bn.weight.zero_()
    model = act_hf.patch(copy.deepcopy(ref), bits=3)
    x = torch.randn(2, 3, 8, 8)
    with track_saved(model) as saved:
        y = model(x.clone().requires_grad_())
    assert torch.equal(y, ref(x))
    assert "0.bn:output" in saved.by_slot and "1.bn:input" in saved.by_slot and "1.bn.act:input" in saved.by_slot
    assert not any(k.startswith("<uncompressed") and v > 1024 for k, v in saved.by_slot.items()), saved.by_slot
    n = x.numel() // 3 * 16  # elements of one 16-channel layer's output
    assert saved.by_slot["0.bn:output"] == packed_bytes(n, 3) + n // 8  # the quantized output and its sign bits


@pytest.mark.parametrize("activation,param", [("identity", 0.0), ("leaky_relu", 0.2), ("elu", 1.0)])
def test_batch_norm_act_mixin_on_plain_bn(activation, param):
    torch.manual_seed(18)
    bn = _randomize(nn.BatchNorm1d(6))
    act = _act(bn, ActBatchNormActMixin, act_activation=activation, act_activation_param=param)
    ref_act = {"identity": nn.Identity(), "leaky_relu": nn.LeakyReLU(param), "elu": nn.ELU(param)}[activation]
    ref = nn.Sequential(bn, ref_act)
    x, g = torch.randn(7, 6, 9), torch.randn(7, 6, 9)
    with track_saved(act) as saved:
        y, gx, gp = _run(act, x, g)
    assert torch.equal(y, ref(x))
    mask = 0 if activation == "identity" else math.ceil(x.numel() / 8)
    assert saved.bytes == packed_bytes(x.numel(), BITS) + mask + 6 * 4  # z, its sign bits, save_invstd
    rx, rp = _grads_f64(ref, x, g)
    _check_grads(f"BN+{activation}", gx, gp, rx, {n.split(".", 1)[1]: v for n, v in rp.items()}, SQNR_MIN[8])
    act.eval()
    assert torch.equal(act(x), ref.eval()(x))


def test_batch_norm_act_zero_gamma_falls_back():
    torch.manual_seed(19)
    bn = _randomize(nn.BatchNorm2d(4))
    with torch.no_grad():
        bn.weight.zero_()
    act = _act(bn, ActBatchNormActMixin, act_activation="leaky_relu", act_activation_param=0.1)
    x = torch.randn(2, 4, 5, 5)  # 50 values per channel: above MIN_VALUES_PER_CHANNEL
    with track_saved(act) as saved:
        y, gx, gp = _run(act, x, torch.randn_like(x))
    assert torch.equal(y, F.leaky_relu(bn(x), 0.1))
    # the input form (x_norm, invstd), then F.leaky_relu saving its own fp32 input
    assert saved.bytes == packed_bytes(x.numel(), BITS) + 4 * 4 + x.numel() * 4
    assert torch.isfinite(gx).all() and torch.isfinite(gp["weight"]).all()


@pytest.mark.parametrize("case", ["layer", "layer_no_bias", "layer_2d", "rms_llama", "rms_gemma", "rms_torch_2d"])
def test_output_form_folds_the_channel_factors_bit_for_bit(monkeypatch, case):
    """A channel-scaled output context's powers of two go into the per-channel divisor (LayerNorm: bias and
    gamma, RMSNorm: its weight) instead of a pass over the decoded output: the same gradients, bit for bit, as
    decoding them out first, and no full-size scaling op. A norm over the last dimension decodes ``x_hat`` in one
    op (``dequantize_inverse_affine``), against a decode, a scaling and a pass or two for its affine map."""
    torch.manual_seed(0)
    shape = (4, 32, 3, 16) if case.endswith("_2d") else (4, 32, 48)
    normalized = shape[-2:] if case.endswith("_2d") else shape[-1:]
    x = torch.randn(shape)
    x[..., 5] *= 40
    x[..., 7] /= 100
    weight = (1 + 0.1 * torch.randn(normalized)).requires_grad_()
    bias = None if case == "layer_no_bias" else torch.randn(normalized).requires_grad_()
    g = torch.randn(shape)
    settings = OpSettings("norm", 3, channel_scale=True)

    def grads():
        act_hf.manual_seed(1)
        xr = x.clone().requires_grad_()
        params = [weight] if case.startswith("rms") else [p for p in (weight, bias) if p is not None]
        if case.startswith("rms"):
            style = case.split("_")[1]
            out = act_rms_norm(xr, weight, 1e-6, settings, style=style, normalized_shape=normalized, context="output")
        else:
            out = act_layer_norm(xr, normalized, weight, bias, 1e-5, settings, context="output")
        ops = dispatched(lambda: out.backward(g))
        scalings = sum(f.overloadpacket.__name__ in ("mul", "mul_") and outs[0].numel() == x.numel()
                       for f, outs in ops)
        found = [xr.grad] + [p.grad for p in params]
        for p in params:
            p.grad = None
        return found, scalings

    folded, folded_scalings = grads()
    monkeypatch.setattr(norm_ops, "_decoded_and_factors",
                        lambda packed, fold: (act_hf.compress.dequantize(packed, torch.float32), None))
    def decoded_inverse_affine(packed, w, b, divisor=None):  # a decode, then each operation a pass of its own
        x_hat = act_hf.compress.dequantize(packed, torch.float32).mul_(w.reciprocal())
        x_hat = x_hat.sub_(torch.zeros_like(w) if b is None else b / w)
        return x_hat if divisor is None else x_hat.mul_(divisor.reciprocal().reshape(*x_hat.shape[:-1], 1))

    monkeypatch.setattr(norm_ops, "dequantize_inverse_affine", decoded_inverse_affine)
    decoded, decoded_scalings = grads()
    assert all(torch.equal(a, b) for a, b in zip(folded, decoded))
    # over the last dim the decode maps in one pass (LayerNorm's also takes the rows' 1 / rstd, a third pass apart)
    passes = {"layer": 3, "layer_no_bias": 3, "rms_llama": 2, "rms_gemma": 2}
    assert decoded_scalings - folded_scalings == passes.get(case, 1)


@pytest.mark.parametrize("channel_scale", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_layer_norm_output_form_takes_rstd_in_its_decode(channel_scale, autocast):
    """A LayerNorm's output-form backward decodes ``x_hat / rstd`` (its input less its mean) in the one pass that
    maps the packed output back, so that aten's backward multiplies by the real ``rstd`` itself: no full-size
    scaling op is left (an fp32 pass over the input gradient before). The gradients are the LayerNorm backward's
    at the decoded ``x_hat`` (float64, from the same packed output) to fp32's rounding."""
    torch.manual_seed(0)
    x = (torch.randn(4, 24, 48) * torch.logspace(-1, 1, 48) + 3).requires_grad_()
    weight, bias = (1 + 0.1 * torch.randn(48)).requires_grad_(), torch.randn(48).requires_grad_()
    g = torch.randn(4, 24, 48)
    settings = OpSettings("norm", 3, channel_scale=channel_scale)
    act_hf.manual_seed(1)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = act_layer_norm(x, (48,), weight, bias, 1e-5, settings, context="output")
    ops = dispatched(lambda: out.backward(g.to(out.dtype)))
    scalings = [f for f, outs in ops if f.overloadpacket.__name__ in ("mul", "mul_") and outs[0].numel() == x.numel()]
    assert scalings == []
    act_hf.manual_seed(1)
    packed = act_hf.compress.quantize(out.detach(), 3, channel_scale=channel_scale)  # the context, drawn again
    x_hat = (act_hf.compress.dequantize(packed, torch.float64) - bias.double()) / weight.double()
    x64 = x.detach().double()
    rstd = 1 / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    gw = g.to(out.dtype).double() * weight.double()
    exact_x = rstd * (gw - gw.mean(-1, keepdim=True) - x_hat * (gw * x_hat).mean(-1, keepdim=True))
    torch.testing.assert_close(x.grad.double(), exact_x, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), (g.to(out.dtype).double() * x_hat).sum((0, 1)), rtol=1e-4,
                               atol=1e-4)
