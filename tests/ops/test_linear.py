"""Linear / conv ops: forward exact, gradients vs exact autograd, what is saved, needs_input_grad."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import act_hf
from act_hf.context import track_saved
from act_hf.nn._base import convert, revert
from act_hf.nn.linear import ActConvMixin, ActLinear, ActLinearMixin, ActTransposedLinearMixin
from tests.utils import dispatched, sqnr_db

# Minimum weight-gradient SQNR (dB) per bit width for Gaussian inputs. A single row's gradient carries one
# draw of stochastic rounding per element: SQNR ~= 10*log10((2^b - 1)^2 / 6) for a +-3 sigma group range,
# i.e. 1.8, 9.1, 15.7 and 40.3 dB at 2, 3, 4, 8 bits; more rows average the noise down.
SQNR_MIN = {2: 0.5, 3: 6.0, 4: 12.0, 8: 34.0}


def _pair(module: nn.Module, mixin: type, bits: int, dtype=torch.float32):
    ref = module.to(dtype)
    return ref, convert(copy.deepcopy(ref), mixin, slot="m", bits=bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1023), (2, 7, 129), (5, 64)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_linear_forward_exact_and_grads(dtype, shape, bits):
    torch.manual_seed(0)
    ref, act = _pair(nn.Linear(shape[-1], 33), ActLinearMixin, bits, dtype)
    x = torch.randn(shape, dtype=dtype)
    xr, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ya = ref(xr), act(xa)
    assert ya.dtype == yr.dtype and torch.equal(ya, yr)
    g = torch.randn_like(yr)
    yr.backward(g)
    ya.backward(g)
    assert torch.equal(xa.grad, xr.grad)  # the input gradient uses the exact weight
    assert torch.equal(act.bias.grad, ref.bias.grad)
    s = sqnr_db(ref.weight.grad, act.weight.grad)
    print(f"bits={bits} dtype={dtype} weight-grad SQNR {s:.1f} dB")
    assert s >= SQNR_MIN[bits]


def test_linear_weight_grad_matches_float64_at_8_bits():
    torch.manual_seed(1)
    lin = nn.Linear(40, 20).double()
    act = convert(copy.deepcopy(lin), ActLinearMixin, bits=8)
    x = torch.randn(16, 40, dtype=torch.float64)
    act(x).sum().backward()
    lin(x).sum().backward()
    torch.testing.assert_close(act.weight.grad, lin.weight.grad, rtol=0, atol=0.02 * lin.weight.grad.abs().max().item())


def test_linear_weight_grad_unbiased_over_draws():
    torch.manual_seed(2)
    lin = nn.Linear(32, 8)
    act = convert(copy.deepcopy(lin), ActLinearMixin, bits=2)
    x = torch.randn(4, 32)
    g = torch.randn(4, 8)
    lin(x).backward(g)
    exact = lin.weight.grad.clone()
    errs = []
    acc = torch.zeros_like(exact)
    for k in range(1, 401):
        act.weight.grad = None
        act(x).backward(g)
        acc += act.weight.grad
        if k in (25, 400):
            errs.append((acc / k - exact).norm().item())
    # the error of the mean shrinks like 1/sqrt(K): 16x more draws -> ~4x smaller
    assert errs[1] < errs[0] / 2.5, errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channel_scaled_linear_weight_grad_is_exact_at_the_dequantized_input(dtype):
    """With channel scaling the weight gradient is ``g^T Q(x)`` for the channel-scaled draw, exactly."""
    from act_hf import manual_seed
    from act_hf.compress import dequantize, quantize
    from act_hf.ops._saving import OpSettings
    from act_hf.ops.linear import act_linear

    torch.manual_seed(3)
    act = nn.Linear(48, 8).to(dtype)
    x = torch.randn(4, 32, 48, dtype=dtype)
    x[..., 7] *= 50
    g = torch.randn(4, 32, 8, dtype=dtype)
    manual_seed(5)
    act_linear(x.requires_grad_(), act.weight, act.bias, OpSettings("lin", 3, channel_scale=True)).backward(g)
    manual_seed(5)
    q = dequantize(quantize(x.detach(), 3, 256, channel_scale=True))
    expected = (g.reshape(-1, 8).t().float() @ q.reshape(-1, 48).float()).to(dtype)
    torch.testing.assert_close(act.weight.grad, expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    # and unbiased: one 3-bit draw is 6-18 dB from the exact gradient with this outlier channel (seed-dependent),
    # the mean of 16 independent draws about 12 dB closer
    exact = g.reshape(-1, 8).t().double() @ x.detach().reshape(-1, 48).double()
    mean = torch.zeros_like(exact)
    for draw in range(16):
        act.weight.grad = None
        manual_seed(draw)
        act_linear(x, act.weight, act.bias, OpSettings("lin", 3, channel_scale=True)).backward(g)
        mean += act.weight.grad.double() / 16
    assert sqnr_db(exact, mean) > 15  # 18-30 dB over seeds 3-10; a biased rounding stays near one draw


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_channel_scaled_weight_grad_folds_the_factors_bit_for_bit(dtype, transposed):
    """The weight gradient takes a channel-scaled input's powers of two on its input-feature axis instead of a
    pass over the decoded input: the same bits as the matmul with the decoded input (fp16 scales the input)."""
    from act_hf import manual_seed
    from act_hf.compress import dequantize, quantize
    from act_hf.ops._saving import OpSettings
    from act_hf.ops.linear import act_linear

    torch.manual_seed(3)
    weight = torch.randn(48, 8) if transposed else torch.randn(8, 48)
    weight = weight.to(dtype).requires_grad_()
    x = torch.randn(4, 32, 48, dtype=dtype)
    x[..., 7] *= 50
    x[..., 9] /= 300
    g = torch.randn(4, 32, 8, dtype=dtype)
    manual_seed(5)
    out = act_linear(x.requires_grad_(), weight, None, OpSettings("lin", 3, channel_scale=True), transposed=transposed)
    ops = dispatched(lambda: out.backward(g))
    full_size_scalings = [f for f, outs in ops if f.overloadpacket.__name__ in ("mul", "mul_", "div", "div_")
                          and outs[0].numel() == x.numel()]
    assert len(full_size_scalings) == (dtype == torch.float16)
    manual_seed(5)
    packed = quantize(x.detach(), 3, 256, channel_scale=True)
    assert packed.spec.channel_scaled and float(packed.channel.min()) <= 2**-8  # a shift of 8 or more
    q, g2d = dequantize(packed).reshape(-1, 48), g.reshape(-1, 8)
    assert torch.equal(weight.grad, q.t() @ g2d if transposed else g2d.t() @ q)


@pytest.mark.parametrize("transposed", [False, True])
def test_channel_scaled_weight_grad_under_autocast_lands_in_the_weights_dtype(transposed):
    """Under bf16 autocast (an fp32 weight, bf16 gradients) the factors scale the bf16 weight gradient straight
    into the weight's fp32, exactly: autograd has no cast of it left to make, and the gradient is the bf16
    matmul's with the decoded input, bit for bit."""
    from act_hf import manual_seed
    from act_hf.compress import dequantize, quantize
    from act_hf.ops._saving import OpSettings
    from act_hf.ops.linear import act_linear

    torch.manual_seed(3)
    weight = (torch.randn(48, 8) if transposed else torch.randn(8, 48)).requires_grad_()
    x = torch.randn(4, 32, 48)
    x[..., 7] *= 50
    x[..., 9] /= 300
    g = torch.randn(4, 32, 8, dtype=torch.bfloat16)
    manual_seed(5)
    with torch.autocast("cpu", torch.bfloat16):
        out = act_linear(x.requires_grad_(), weight, None, OpSettings("lin", 3, channel_scale=True),
                         transposed=transposed)
    assert out.dtype == torch.bfloat16
    ops = dispatched(lambda: out.backward(g))
    weight_sized_fp32 = [f.overloadpacket.__name__ for f, outs in ops
                         if outs and outs[0].dtype == torch.float32 and outs[0].shape == weight.shape]
    # the gradient made in fp32 by the scaling, no cast of it after (AccumulateGrad's copies aside: the dispatch
    # mode that lists the ops holds the gradients it saw, so none is taken as it is)
    assert weight_sized_fp32[:3] == ["empty_like", "detach", "mul"] and "_to_copy" not in weight_sized_fp32
    manual_seed(5)
    q = dequantize(quantize(x.detach(), 3, 256, channel_scale=True), torch.bfloat16).reshape(-1, 48)
    g2d = g.reshape(-1, 8)
    assert weight.grad.dtype == torch.float32
    assert torch.equal(weight.grad, (q.t() @ g2d if transposed else g2d.t() @ q).float())


@pytest.mark.parametrize("autocast", [False, True])
def test_linears_reading_one_input_decode_it_once(monkeypatch, autocast):
    """Q, K and V projections of one hidden state (a LayerNorm's output, packed once): their backwards decode it
    once between them, the first keeping the decode for the next two and the last letting it go, and their
    gradients are those of three decodes bit for bit (under autocast: the channel-scaled fp32 input, decoded in
    bf16 with its factors). A fourth linear on another input decodes its own."""
    from act_hf.ops import _shared_decodes
    from act_hf.ops._shared_decodes import shared_decodes

    torch.manual_seed(3)
    norm, other = nn.LayerNorm(64), nn.Linear(64, 64)
    projections = [nn.Linear(64, 32) for _ in range(3)]
    act = [convert(copy.deepcopy(m), ActLinearMixin, slot=f"m{i}", bits=3) for i, m in enumerate(projections)]
    act_other = convert(copy.deepcopy(other), ActLinearMixin, slot="o", bits=3)
    x = torch.randn(4, 16, 64)
    runs = []
    for shared in (True, False):
        if not shared:  # each reader decodes for itself
            monkeypatch.setattr(_shared_decodes.SharedDecodes, "decode", lambda self, packed, dtype, decode: decode())
        for m in act:
            m.zero_grad()
        act_hf.manual_seed(0)
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h = norm(xx)
            y = sum(m(h).float().sum() for m in act) + act_other(h.detach().sin()).float().sum()
        decodes = [func for func, _ in dispatched(y.backward) if func.overloadpacket.__name__ == "unpack_dequantize"]
        runs.append((len(decodes), xx.grad, [p.grad.clone() for m in act for p in m.parameters()]))
        del h, y
        assert not any(r.decoded for r in shared_decodes._readers.values())  # no decode outlives its readers
    (shared_count, gx, gp), (alone_count, gx_alone, gp_alone) = runs
    assert (shared_count, alone_count) == (2, 4)
    assert torch.equal(gx, gx_alone) and all(torch.equal(a, b) for a, b in zip(gp, gp_alone))


def test_linears_reading_one_input_cast_it_once():
    """Under autocast, Q, K and V projections of one float32 hidden state (a LayerNorm's output) cast it to bf16
    once between them from the second forward on (the first learns which readers share): one ``_to_copy`` of the
    hidden state where there were three; the outputs and the input's gradient are the unpatched ones bit for bit,
    the weights' gradients those of the first forward's three casts, and no cast is kept past the last reader
    (V). A cast kept for a next reader that never comes is let go of with its source."""
    from act_hf.ops._shared_casts import SharedCasts, shared_casts

    torch.manual_seed(3)
    norm = nn.LayerNorm(64)
    projections = [nn.Linear(64, 32) for _ in range(3)]
    act = [convert(copy.deepcopy(m), ActLinearMixin, slot=f"m{i}", bits=3) for i, m in enumerate(projections)]
    x = torch.randn(4, 16, 64)
    g = torch.randn(3, 4, 16, 32)

    def step(modules):
        xx = x.clone().requires_grad_()
        for m in modules:
            m.zero_grad()
        act_hf.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = norm(xx)
            assert h.dtype == torch.float32
            outs = []
            casts = [f for f, outs_ in dispatched(lambda: outs.extend(m(h) for m in modules))
                     if f.overloadpacket.__name__ == "_to_copy" and outs_[0].shape == h.shape]
        torch.autograd.backward(outs, list(g.to(outs[0].dtype)))
        return (len(casts), [o.detach() for o in outs], xx.grad,
                [p.grad.clone() for m in modules for p in m.parameters()])

    shared_casts.clear()
    learning = step(act)
    shared = step(act)
    assert shared_casts._last.cast is None  # V, the last reader, keeps none
    ref = step(projections)
    assert (learning[0], shared[0], ref[0]) == (3, 1, 3)
    for run in (learning, shared):  # the outputs and the input's gradient are the unpatched ones
        assert all(torch.equal(a, b) for a, b in zip(run[1], ref[1])) and torch.equal(run[2], ref[2])
    assert all(torch.equal(a, b) for a, b in zip(shared[3], learning[3]))  # the weights' too, unshared ones

    casts = SharedCasts()  # one tensor's cast is never another's, nor an older version's
    h, other = torch.randn(8, 4), torch.randn(8, 4)

    def learn():  # "b" reads what "a" read: "a" keeps its casts from then on
        casts.cast(h, torch.bfloat16, "a")
        casts.cast(h, torch.bfloat16, "b")

    learn()
    casts.cast(h, torch.bfloat16, "a")  # kept for "b"
    assert torch.equal(casts.cast(other, torch.bfloat16, "b"), other.to(torch.bfloat16))  # not h's
    learn()
    casts.cast(h, torch.bfloat16, "a")
    h.mul_(2)  # a new version of h: cast again
    assert torch.equal(casts.cast(h, torch.bfloat16, "b"), h.to(torch.bfloat16))
    learn()  # a cast kept for a next reader that never comes is freed with its source
    source = torch.randn(8, 4)
    kept = casts.cast(source, torch.bfloat16, "a")
    assert casts._last.cast is kept
    del source
    assert casts._last.cast is None


def test_saved_bytes_formula_and_needs_input_grad():
    act = ActLinear(256, 64).act_configure(slot="lin", bits=3)
    x = torch.randn(8, 100, 256)
    n = x.numel()
    with track_saved(act) as saved:
        act(x.requires_grad_())
    assert saved.bytes == math.ceil(n * 3 / 8) + 4 * math.ceil(n / 256)
    assert saved.by_slot == {"lin:input": saved.bytes}

    act.weight.requires_grad_(False)
    act.bias.requires_grad_(False)
    with track_saved(act) as saved:  # frozen layer: nothing of x is needed
        y = act(x)
    assert saved.bytes == 0
    y.sum().backward()
    assert x.grad is not None


def test_frozen_input_and_weight_saves_nothing_and_runs_original():
    act = ActLinear(16, 4)
    act.requires_grad_(False)
    x = torch.randn(3, 16)
    with track_saved() as saved:
        y = act(x)
    assert saved.bytes == 0 and not y.requires_grad


@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_eval_no_grad_inference_run_the_original(mode):
    act = ActLinear(16, 4).act_configure(bits=2)
    x = torch.randn(3, 16, requires_grad=True)
    if mode == "eval":
        act.eval()
        with track_saved() as saved:
            y = act(x)
        assert saved.by_slot.keys() <= {"<uncompressed:torch.float32>"}  # the plain F.linear context
        assert y.grad_fn.name() == "AddmmBackward0"
    else:
        ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
        with ctx:
            y = act(x)
        assert y.grad_fn is None


def test_transposed_linear_gpt2_style():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    ref = Conv1D(12, 20)
    act = convert(copy.deepcopy(ref), ActTransposedLinearMixin, bits=8)
    x = torch.randn(2, 5, 20, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ya, yr = act(x), ref(x2)
    assert torch.equal(ya, yr)  # the same addmm as Conv1D
    ya.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert sqnr_db(ref.weight.grad, act.weight.grad) > 35
    assert list(act.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize("autocast", [False, True])
def test_linear_with_a_permuted_gradient_broadcasts_no_weight(autocast):
    """ConvNeXt's MLP: a linear over channels-last rows whose output is permuted back to NCHW, so the gradient
    reaches backward as a permuted view. Both GEMMs run on the gradient's rows (as autograd runs the forward's
    folded GEMM): no batched matmul, which for a weight cast to the gradient's dtype (autocast) copied the weight
    once a batch index (convnext-tiny's backward peak on the CPU: 41.2 MiB a sample, 33 of them such copies; 9.2
    without); the input's gradient is autograd's bit for bit."""
    torch.manual_seed(0)
    ref = nn.Linear(16, 24)
    act = convert(copy.deepcopy(ref), ActLinearMixin, bits=8)
    x = torch.randn(2, 5, 7, 16)
    xa, xr = (x.clone().requires_grad_() for _ in range(2))
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        ya, yr = act(xa).permute(0, 3, 1, 2), ref(xr).permute(0, 3, 1, 2)
    assert torch.equal(ya, yr)
    g = torch.randn(ya.shape, dtype=ya.dtype)  # NCHW: the rows' gradient is a permuted view
    ops = [f.overloadpacket.__name__ for f, _ in dispatched(lambda: ya.backward(g))]
    yr.backward(g)
    assert not {"bmm", "expand"} & set(ops), ops
    assert torch.equal(xa.grad, xr.grad)
    assert sqnr_db(ref.weight.grad, act.weight.grad) > (20 if autocast else 35)


CONV_CASES = [
    (nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=1), (2, 4, 17)),
    (nn.Conv2d, dict(in_channels=3, out_channels=8, kernel_size=3, stride=2, padding=1), (2, 3, 15, 13)),
    (nn.Conv2d, dict(in_channels=8, out_channels=8, kernel_size=3, groups=8, padding=2, dilation=2), (1, 8, 9, 9)),
    (nn.Conv2d, dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, padding_mode="reflect"), (2, 4, 8, 8)),
    (nn.Conv2d, dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, padding_mode="circular", bias=False),
     (2, 4, 8, 8)),
    (nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=(1, 3, 3), padding=(0, 1, 1)), (1, 2, 3, 6, 6)),
]


@pytest.mark.parametrize("cls, kwargs, shape", CONV_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_forward_exact_and_grads(cls, kwargs, shape, dtype):
    torch.manual_seed(0)
    ref = cls(**kwargs).to(dtype)
    act = convert(copy.deepcopy(ref), ActConvMixin, bits=8)
    x = torch.randn(shape, dtype=dtype)
    xr, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ya = ref(xr), act(xa)
    assert torch.equal(ya, yr)
    g = torch.randn_like(yr)
    yr.backward(g)
    ya.backward(g)
    torch.testing.assert_close(xa.grad, xr.grad)
    s = sqnr_db(ref.weight.grad, act.weight.grad)
    print(f"{cls.__name__} {kwargs} {dtype}: weight-grad SQNR {s:.1f} dB")
    assert s > (30 if dtype == torch.float32 else 20)
    if ref.bias is not None:
        torch.testing.assert_close(act.bias.grad, ref.bias.grad)


#: every conv case in its default layout, and the 2-d ones channels last as well (a 4-d layout)
SLICED_CONV_CASES = ([(*case, False) for case in CONV_CASES]
                     + [(*case, True) for case in CONV_CASES if len(case[2]) == 4])


@pytest.mark.parametrize("sliced_forward", [False, True], ids=["cpu_forward_whole", "forward_sliced"])
@pytest.mark.parametrize("cls, kwargs, shape, channels_last", SLICED_CONV_CASES)
def test_conv_past_the_chunk_size_runs_a_slice_of_the_batch_at_a_time(monkeypatch, cls, kwargs, shape, channels_last,
                                                                       sliced_forward):
    """With ``CONV_CHUNK_ELEMENTS`` below one item, every item's weight and input gradients are calls of their
    own, and, where the forward is sliced (not on the CPU, unless told), every item's output: the gradients equal
    the unsliced op's up to rounding (the weight's and bias's summed in another order), the output is the module's
    (bit for bit when the CPU runs it whole) in its memory layout, and so is the input gradient."""
    from act_hf.ops import linear as linear_ops

    if sliced_forward:
        monkeypatch.setattr(linear_ops, "WHOLE_FORWARD_DEVICES", ())
    torch.manual_seed(0)
    ref = cls(**kwargs)
    act = convert(copy.deepcopy(ref), ActConvMixin, bits=4)
    x = torch.randn((5, *shape[1:]))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    calls = []

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution_backward.default:
                calls.append(list(args[-1]))
            elif func is torch.ops.aten.convolution.default and args[6]:  # transposed: an input gradient's pass
                calls.append([True, False, False])
            return func(*args, **(kwargs or {}))

    runs = []
    monkeypatch.setenv("ACT_HF_SLICING", "always")  # the slices, whatever room a GPU has
    for chunk in (linear_ops.CONV_CHUNK_ELEMENTS, 1):
        monkeypatch.setattr(linear_ops, "CONV_CHUNK_ELEMENTS", chunk)
        act_hf.manual_seed(0)
        xa = x.clone(memory_format=torch.preserve_format).requires_grad_()
        y = act(xa)
        with _Watch():
            y.backward(torch.ones_like(y))
        runs.append((y, xa.grad, {name: p.grad for name, p in act.named_parameters()}))
        act.zero_grad()
    decodable = math.prod(shape[1:]) % 8 == 0
    weight_pass = [False, True, act.bias is not None]
    input_pass = [True, False, False]
    assert calls == [weight_pass, input_pass] + [weight_pass] * (5 if decodable else 1) + [input_pass] * 5
    expected = ref(x)
    (y_whole, gx_whole, grads_whole), (y_items, gx_items, grads_items) = runs
    assert torch.equal(y_whole, expected)
    if sliced_forward:
        torch.testing.assert_close(y_items, expected)
    else:
        assert torch.equal(y_items, expected)
    assert y_items.stride() == expected.stride()
    torch.testing.assert_close(gx_items, gx_whole)
    assert gx_items.stride() == gx_whole.stride()
    for name, grad in grads_whole.items():
        torch.testing.assert_close(grads_items[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())


@pytest.mark.cuda
def test_conv_slices_on_the_gpu_under_autocast_give_the_whole_calls_values(monkeypatch):
    """On a GPU the forward is sliced too (cuDNN's allocations grow with the batch): under bf16 autocast the output,
    the input gradient and the weight gradient of a conv run a slice at a time match the whole call's."""
    from act_hf.ops import linear as linear_ops

    torch.manual_seed(0)
    act = convert(nn.Conv2d(16, 32, 3, padding=1), ActConvMixin, bits=8).cuda()
    x = torch.randn(6, 16, 20, 20, device="cuda")
    g = torch.randn(6, 32, 20, 20, device="cuda")
    runs = []
    monkeypatch.setenv("ACT_HF_SLICING", "always")  # the slices, whatever room a GPU has
    for chunk in (linear_ops.CONV_CHUNK_ELEMENTS, 16 * 20 * 20 * 2):  # slices of 1 item (the output's 32 channels)
        monkeypatch.setattr(linear_ops, "CONV_CHUNK_ELEMENTS", chunk)
        act_hf.manual_seed(0)
        xa = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            y = act(xa)
        y.backward(g.to(y.dtype))
        runs.append((y.float(), xa.grad, act.weight.grad.float(), act.bias.grad.float()))
        act.zero_grad()
    for whole, sliced in zip(*runs):
        torch.testing.assert_close(sliced, whole, rtol=2e-2, atol=2e-2 * whole.abs().max().item())


def test_a_conv_past_the_chunk_size_runs_whole_where_the_device_has_room(monkeypatch):
    """Where the device has room for the whole batch (``ACT_HF_SLICING=never``: room whatever the device), a conv
    past ``CONV_CHUNK_ELEMENTS`` makes one call a pass, forward (where it would be sliced) and backward, and its
    output and gradients are those of a batch below the threshold, bit for bit."""
    from act_hf.ops import linear as linear_ops

    monkeypatch.setattr(linear_ops, "WHOLE_FORWARD_DEVICES", ())
    torch.manual_seed(0)
    act = convert(nn.Conv2d(4, 6, 3, padding=1), ActConvMixin, bits=4)
    x = torch.randn(5, 4, 8, 8)
    runs = []
    for chunk, mode in ((linear_ops.CONV_CHUNK_ELEMENTS, "always"), (1, "never")):
        monkeypatch.setattr(linear_ops, "CONV_CHUNK_ELEMENTS", chunk)
        monkeypatch.setenv("ACT_HF_SLICING", mode)
        act_hf.manual_seed(0)
        xa = x.clone().requires_grad_()
        ops = dispatched(lambda xa=xa: act(xa).backward(torch.ones(5, 6, 8, 8)))
        convs = [func for func, _ in ops if func in (torch.ops.aten.convolution.default,
                                                     torch.ops.aten.convolution_backward.default)]
        runs.append((convs, xa.grad, act.weight.grad.clone(), act.bias.grad.clone()))
        act.zero_grad()
    (convs_small, *grads_small), (convs_room, *grads_room) = runs
    assert convs_room == convs_small and len(convs_room) == 3  # forward, weight gradient, input gradient
    for small, room in zip(grads_small, grads_room):
        assert torch.equal(room, small)


@pytest.mark.cuda
def test_a_conv_on_cuda_slices_only_when_its_process_is_short_of_memory(monkeypatch):
    """``ACT_HF_SLICING=auto`` on CUDA: a conv past ``CONV_CHUNK_ELEMENTS`` runs whole (one forward call, one of each
    backward pass) with the device's memory to spare, and an item at a time once the process's share
    (``torch.cuda.set_per_process_memory_fraction``) leaves no room for twice its estimated temporaries (3 x 51 MB
    of fp32 input) though enough for the step; the same values either way, up to the slices' rounding."""
    from act_hf.ops import linear as linear_ops

    monkeypatch.setenv("ACT_HF_SLICING", "auto")
    monkeypatch.setattr(linear_ops, "CONV_CHUNK_ELEMENTS", 64 * 112 * 112)  # an item a slice
    torch.manual_seed(0)
    act = convert(nn.Conv2d(64, 64, 3, padding=1), ActConvMixin, bits=8).cuda()
    x = torch.randn(16, 64, 112, 112, device="cuda")  # 51 MB
    device = torch.device("cuda")
    share = torch.cuda.get_per_process_memory_fraction(device)
    runs = []
    for short in (False, True):
        torch.cuda.empty_cache()
        if short:  # 288 MiB past what is held: the step needs about 230 MB, twice the whole conv's 308 MB
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + (288 << 20)) / total,
                                                       device)
        try:
            act_hf.manual_seed(0)
            xa = x.clone().requires_grad_()
            ops = dispatched(lambda xa=xa: act(xa).backward(torch.ones_like(xa)))
        finally:
            torch.cuda.set_per_process_memory_fraction(share, device)
        convs = [func for func, _ in ops if func in (torch.ops.aten.convolution.default,
                                                     torch.ops.aten.convolution_backward.default)]
        runs.append((len(convs), xa.grad, act.weight.grad.clone()))
        act.zero_grad()
    (calls_room, gx_room, gw_room), (calls_short, gx_short, gw_short) = runs
    assert calls_room == 3 and calls_short == 3 * 16  # forward, weight gradient, input gradient: whole or by item
    torch.testing.assert_close(gx_short, gx_room)
    torch.testing.assert_close(gw_short, gw_room, rtol=1e-4, atol=1e-4 * gw_room.abs().max().item())


def test_conv_input_gradient_makes_no_input_sized_copy():
    """The input gradient's pass allocates its result and nothing else as large: given an input, even a zero-stride
    stand-in, ``convolution_backward`` copies it contiguous first (twice the input's bytes in all), which the
    transposed convolution act_hf runs instead does not; the values are the same bit for bit."""
    from torch.profiler import ProfilerActivity, profile

    from act_hf._constants import zero_scalar
    from act_hf.ops.linear import _conv_input_grad

    torch.manual_seed(0)
    x, w = torch.randn(8, 64, 28, 28, dtype=torch.bfloat16), torch.randn(64, 64, 3, 3, dtype=torch.bfloat16)
    g = torch.nn.functional.conv2d(x, w, None, 1, 1)
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)

    def allocated(fn):
        fn()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
        return out, sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)

    ours, ours_bytes = allocated(lambda: _conv_input_grad(g, w, x.shape, args))
    aten, aten_bytes = allocated(lambda: torch.ops.aten.convolution_backward(
        g, zero_scalar(g).expand(x.shape), w, None, *args, [True, False, False])[0])
    nbytes = x.numel() * x.element_size()
    assert ours_bytes < 1.5 * nbytes and aten_bytes >= 2 * nbytes
    assert torch.equal(ours, aten) and ours.stride() == aten.stride()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, out_channels, kernel, stride, padding, dilation", [
    ((2, 3, 15, 13), 8, 3, 2, 1, 1),  # the stride leaves a row and a column no window reads: output_padding
    ((2, 16, 23, 19), 32, 5, 3, 2, 1),
    ((4, 64, 14, 14), 128, 1, 2, 0, 1),  # a ResNet downsample
    ((2, 8, 9, 9), 16, 3, 1, 2, 2),
])
def test_conv_input_gradient_is_convolution_backwards_bit_for_bit(device, dtype, shape, out_channels, kernel,
                                                                  stride, padding, dilation):
    """An ungrouped conv's input gradient, a transposed convolution of the output's gradient, is the one
    ``convolution_backward`` computes, bit for bit, in its layout (channels last too)."""
    from act_hf.ops.linear import _conv_input_grad

    torch.manual_seed(0)
    for channels_last in (False, True):
        x = torch.randn(shape, device=device, dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(out_channels, shape[1], kernel, kernel, device=device, dtype=dtype)
        g = torch.randn_like(torch.nn.functional.conv2d(x, w, None, stride, padding, dilation))
        args = ([stride] * 2, [padding] * 2, [dilation] * 2, False, [0, 0], 1)
        expected = torch.ops.aten.convolution_backward(g, x, w, None, *args, [True, False, False])[0]
        got = _conv_input_grad(g, w, x.shape, args)
        assert torch.equal(got, expected) and got.stride() == expected.stride()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, kernel, stride, padding, dilation", [
    ((2, 32, 28, 28), 3, 1, 1, 1),
    ((2, 96, 15, 13), 3, 2, 1, 1),  # output_padding
    ((2, 64, 14, 14), 7, 1, 3, 1),  # ConvNeXt's
    ((2, 16, 9, 9), 3, 1, 2, 2),
])
def test_depthwise_conv_input_gradient_is_convolution_backwards_bit_for_bit(device, dtype, shape, kernel, stride,
                                                                            padding, dilation):
    """A depthwise conv's input gradient (a transposed convolution on the CPU, ``convolution_backward`` of a
    stand-in on CUDA) is the one ``convolution_backward`` computes from the input, bit for bit, in its layout; on
    the CPU without the stand-in's input-sized copy."""
    from act_hf.ops.linear import _conv_input_grad

    torch.manual_seed(0)
    channels = shape[1]
    args = ([stride] * 2, [padding] * 2, [dilation] * 2, False, [0, 0], channels)
    for channels_last in (False, True):
        x = torch.randn(shape, device=device, dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(channels, 1, kernel, kernel, device=device, dtype=dtype)
        g = torch.randn_like(torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, channels))
        expected = torch.ops.aten.convolution_backward(g, x, w, None, *args, [True, False, False])[0]
        def input_grad(g=g, w=w, shape=x.shape):
            return _conv_input_grad(g, w, shape, args)

        ops = [f.overloadpacket.__name__ for f, _ in dispatched(input_grad)]
        got = input_grad()
        assert torch.equal(got, expected) and got.stride() == expected.stride()
        assert device != "cpu" or ops == ["convolution"], ops


def test_an_unbatched_conv_input_convolves_as_a_batch_of_one():
    """``nn.Conv2d`` takes a ``(C, H, W)`` input; so does its converted form, forward and backward."""
    torch.manual_seed(0)
    ref = nn.Conv2d(4, 6, 3, padding=1)
    act = convert(copy.deepcopy(ref), ActConvMixin, bits=8)
    x = torch.randn(4, 7, 7)
    xr, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ya = ref(xr), act(xa)
    assert torch.equal(ya, yr)
    ya.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(xa.grad, xr.grad)
    assert sqnr_db(ref.weight.grad, act.weight.grad) > 30


@pytest.mark.parametrize("cls, kwargs, shape", [CONV_CASES[1], CONV_CASES[2], CONV_CASES[5]])
def test_conv_backward_frees_the_decoded_input_before_the_input_gradient(cls, kwargs, shape):
    """Two passes: ``convolution_backward`` of the weight and bias gradients from the decoded input, then the input
    gradient from the weight alone (a transposed convolution, a depthwise one's too on the CPU; for another grouped
    one ``convolution_backward`` of a zero-stride stand-in of the input's shape), so the decoded input and the input
    gradient, each as large as the input, are never alive together. The input gradient is the single call's, bit
    for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    act = convert(cls(**kwargs), ActConvMixin, bits=8)
    x = torch.randn(shape, requires_grad=True)
    y = act(x)
    g = torch.randn_like(y)
    calls = []

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution_backward.default:
                calls.append((args[1].stride(), list(args[-1])))
            elif func is torch.ops.aten.convolution.default and args[6]:  # transposed: the input gradient
                calls.append(("transposed", list(args[1].shape)))
            return func(*args, **(kwargs or {}))

    with _Watch():
        y.backward(g)
    has_bias = act.bias is not None
    depthwise = act.groups == act.in_channels == act.out_channels
    input_pass = (((0,) * x.dim(), [True, False, False]) if act.groups > 1 and not depthwise
                  else ("transposed", list(act.weight.shape)))
    assert calls == [(x.stride(), [False, True, has_bias]), input_pass]
    single = torch.ops.aten.convolution_backward(
        g, x.detach(), act.weight, None, list(act.stride), list(act.padding), list(act.dilation), False,
        [0] * (x.dim() - 2), act.groups, [True, True, False])[0]
    assert torch.equal(x.grad, single)

def test_conv_input_grad_only_when_weight_frozen():
    torch.manual_seed(0)
    ref = nn.Conv2d(3, 4, 3, padding=1)
    act = convert(copy.deepcopy(ref), ActConvMixin, bits=3)
    for m in (ref, act):
        m.requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    xr, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    with track_saved(act) as saved:
        ya = act(xa)
    assert saved.bytes == 0
    ref(xr).sum().backward()
    ya.sum().backward()
    torch.testing.assert_close(xa.grad, xr.grad)


def test_autocast_bf16_saves_the_original_input_and_never_the_weight_copy():
    torch.manual_seed(0)
    ref = nn.Linear(64, 32)
    act = convert(copy.deepcopy(ref), ActLinearMixin, slot="l", bits=8)
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with track_saved(act) as saved:
            ya = act(x)
        yr = ref(x)
    assert ya.dtype == yr.dtype == torch.bfloat16 and torch.equal(ya, yr)
    assert set(saved.by_slot) == {"l:input"}
    ya.float().sum().backward()
    assert act.weight.grad.dtype == torch.float32


def test_revert_restores_class_and_state_dict():
    lin = nn.Linear(4, 2)
    sd = {k: v.clone() for k, v in lin.state_dict().items()}
    convert(lin, ActLinearMixin, slot="x", bits=2)
    assert type(lin).__name__ == "ActLinear" and isinstance(lin, nn.Linear)
    revert(lin)
    assert type(lin) is nn.Linear and not hasattr(lin, "act_slot") or lin.act_slot == ""
    assert all(torch.equal(sd[k], v) for k, v in lin.state_dict().items())


def test_inside_checkpoint_grads_match_exact():
    torch.manual_seed(0)
    ref = nn.Linear(32, 16)
    act = convert(copy.deepcopy(ref), ActLinearMixin, bits=8)
    x = torch.randn(5, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(act, x, use_reentrant=False).sum().backward()
    ref(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert sqnr_db(ref.weight.grad, act.weight.grad) > 35


# ------------------------------------------------------------------------------------------------ layer scale


@pytest.mark.parametrize("dim, shape", [(-1, (3, 5, 64)), (1, (2, 48, 7, 7))])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_channel_scale_forward_exact_and_grads_against_autograd(dim, shape, x_dtype):
    """Forward is the original ``x.mul(gamma)`` (dtype promotion included); grad_x is exact; grad_gamma is
    autograd's with the dequantized input, and at 8 bits close to the exact one (float64)."""
    from act_hf.compress import dequantize, manual_seed, quantize
    from act_hf.ops._saving import OpSettings
    from act_hf.ops.linear import act_channel_scale

    torch.manual_seed(0)
    x = torch.randn(shape).to(x_dtype)
    gamma = torch.rand(shape[dim], dtype=torch.float32) + 0.5
    view = [1] * len(shape)
    view[dim] = -1
    xr, gr = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    xa, ga = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    yr = xr.mul(gr.view(view))
    manual_seed(5)
    ya = act_channel_scale(xa, ga, dim, OpSettings(slot="ls", bits=3))
    assert ya.dtype == yr.dtype and torch.equal(ya, yr)
    g = torch.randn_like(yr)
    yr.backward(g)
    ya.backward(g)
    assert xa.grad.dtype == x_dtype and torch.equal(xa.grad, xr.grad)
    manual_seed(5)  # the same draw as the op's: the reference is autograd through the dequantized input
    x_hat = dequantize(quantize(x, 3, 256)).requires_grad_(False)
    gh = gamma.clone().requires_grad_()
    x_hat.mul(gh.view(view)).backward(g)
    torch.testing.assert_close(ga.grad, gh.grad, rtol=1e-5, atol=1e-5)

    x64, g64 = x.double(), g.double()
    exact = (g64 * x64).sum(dim=[d for d in range(len(shape)) if d != dim % len(shape)])
    ga8 = gamma.double().clone().requires_grad_()
    act_channel_scale(x64, ga8, dim, OpSettings(slot="ls", bits=8)).backward(g64)
    assert sqnr_db(exact, ga8.grad) >= 30


@pytest.mark.parametrize("x_dtype, s_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)])
def test_scale_by_a_per_sample_channel_gate_against_autograd(x_dtype, s_dtype):
    """A squeeze-and-excitation gate (one value per sample and channel, (B, C, 1, 1)): forward is ``x.mul(s)``
    (promotion included), grad_x exact, grad_s autograd's at the dequantized x (the same draw), summed over the
    broadcast dims, and at 8 bits close to the float64 gradient."""
    from act_hf.compress import dequantize, manual_seed, quantize
    from act_hf.ops._saving import OpSettings
    from act_hf.ops.linear import act_scale

    torch.manual_seed(0)
    x = torch.randn(3, 24, 7, 5).to(x_dtype)
    s = torch.rand(3, 24, 1, 1).to(s_dtype)
    xr, sr = x.clone().requires_grad_(), s.clone().requires_grad_()
    xa, sa = x.clone().requires_grad_(), s.clone().requires_grad_()
    yr = xr.mul(sr)
    manual_seed(5)
    ya = act_scale(xa, sa, OpSettings(slot="se", bits=3))
    assert ya.dtype == yr.dtype and torch.equal(ya, yr)
    g = torch.randn_like(yr)
    yr.backward(g)
    ya.backward(g)
    assert xa.grad.dtype == x_dtype and torch.equal(xa.grad, xr.grad)
    manual_seed(5)
    x_hat = dequantize(quantize(x, 3, 256))
    sh = s.clone().requires_grad_()
    x_hat.mul(sh).backward(g)
    assert sa.grad.dtype == s_dtype and sa.grad.shape == s.shape
    torch.testing.assert_close(sa.grad, sh.grad, rtol=1e-5, atol=1e-5)

    x64, s64, g64 = x.double(), s.double().requires_grad_(), g.double()
    act_scale(x64, s64, OpSettings(slot="se", bits=8)).backward(g64)
    assert sqnr_db((g64 * x64).sum((2, 3), keepdim=True), s64.grad) >= 30
    with pytest.raises(ValueError, match="s: expected a shape"):
        act_scale(x, torch.ones(3, 24, 2, 1), OpSettings(slot="se", bits=3))
    with pytest.raises(ValueError, match="s: expected a shape"):
        act_scale(x, torch.ones(24, 1, 1), OpSettings(slot="se", bits=3))


def test_channel_scale_needs_input_grad_and_bad_gamma():
    from act_hf.ops._saving import OpSettings
    from act_hf.ops.linear import act_channel_scale

    x = torch.randn(4, 16, 32)
    frozen = torch.ones(32)  # a frozen gamma: nothing of x is saved
    with track_saved() as saved:
        act_channel_scale(x.requires_grad_(), frozen, -1, OpSettings(slot="ls", bits=3))
    assert saved.by_slot.get("ls", 0) == 0
    with track_saved() as saved:
        act_channel_scale(torch.randn(4, 16, 32), torch.ones(32, requires_grad=True), -1, OpSettings(slot="ls", bits=3))
    assert saved.by_slot["ls"] < 4 * 16 * 32 * 4 / 8  # 3 bits + metadata, far below fp32
    with pytest.raises(ValueError, match="gamma"):
        act_channel_scale(x, torch.ones(16), -1, OpSettings(slot="ls", bits=3))


# ------------------------------------------------------------------------------------ weight-standardized conv


def _standardized_convs():
    """timm's four weight-standardized conv classes, small, with odd input sizes for the SAME forms."""
    layers = pytest.importorskip("timm.layers")
    return [("StdConv2d", lambda: layers.StdConv2d(4, 6, 3, stride=2, eps=1e-8)),
            ("StdConv2dSame", lambda: layers.StdConv2dSame(4, 6, 3, stride=2, bias=True)),
            ("ScaledStdConv2d", lambda: layers.ScaledStdConv2d(4, 6, 3, gamma=1.7)),
            ("ScaledStdConv2dSame", lambda: layers.ScaledStdConv2dSame(4, 6, (3, 2), stride=2, groups=2))]


def _random_gain(module):
    if hasattr(module, "gain"):
        with torch.no_grad():
            module.gain.uniform_(0.5, 1.5)
    return module


def _assert_exact_without_rounding(monkeypatch, ref: nn.Module, act: nn.Module, x: torch.Tensor, name: str = ""):
    """``act``'s forward is ``ref``'s bit for bit, and with packing turned into the identity every gradient (the
    input's and the parameters') is ``ref``'s float64 autograd's."""
    from act_hf.ops import linear as linear_ops

    monkeypatch.setattr(linear_ops, "saved_input", lambda x, settings: x)
    monkeypatch.setattr(linear_ops, "input_values", lambda saved, dtype, items=None: (
        saved if items is None else saved[items[0]:items[1]]).to(dtype))
    xr, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, ya = ref(xr), act(xa)
    assert torch.equal(ya, yr), name
    g = torch.randn_like(yr)
    yr.backward(g)
    ya.backward(g)
    torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-10, atol=0)
    for (pname, p), q in zip(ref.named_parameters(), act.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-14, msg=pname)


@pytest.mark.parametrize("index", range(4), ids=["StdConv2d", "StdConv2dSame", "ScaledStdConv2d", "ScaledStdConv2dSame"])
def test_standardized_conv_is_the_module_forward_and_backward_without_rounding(monkeypatch, index):
    """Forward is timm's own, bit for bit. With packing turned into the identity, every gradient (input, weight,
    gain, bias) is float64 autograd's through the module's forward: the standardization made again in backward
    and the map of the standardized weight's gradient through it are right."""
    from act_hf.nn.linear import ActStandardizedConvMixin, is_standardized_conv

    name, make = _standardized_convs()[index]
    torch.manual_seed(0)
    ref = _random_gain(make()).double()
    assert is_standardized_conv(ref)
    act = convert(copy.deepcopy(ref), ActStandardizedConvMixin, slot="m", bits=3)
    _assert_exact_without_rounding(monkeypatch, ref, act, torch.randn(2, 4, 9, 11, dtype=torch.float64), name)


def test_standardized_conv_saves_its_input_packed_and_no_weight_and_follows_needs_input_grad():
    from act_hf.nn.linear import ActStandardizedConvMixin

    _, make = _standardized_convs()[2]  # ScaledStdConv2d: weight, gain and bias
    torch.manual_seed(0)
    ref = _random_gain(make())
    act = convert(copy.deepcopy(ref), ActStandardizedConvMixin, slot="m", bits=8)
    x = torch.randn(2, 4, 16, 16)
    with track_saved(act) as saved:
        ya = act(x)
    assert set(saved.by_slot) == {"m:input"}  # the parameters are not counted; no standardized weight is kept
    packed = x.numel() + x.numel() // 256 * 4  # 8-bit codes and the per-group scales
    assert saved.bytes <= packed + 64
    ref(x).square().sum().backward()
    ya.square().sum().backward()
    for p, q in zip(ref.parameters(), act.parameters()):
        assert sqnr_db(p.grad, q.grad) > 30
    # frozen weight and gain: only the input gradient, and nothing but the parameters saved
    act.weight.requires_grad_(False)
    act.gain.requires_grad_(False)
    xa = x.clone().requires_grad_()
    with track_saved(act) as saved:
        ya = act(xa)
    assert saved.bytes == 0
    ya.sum().backward()
    assert act.bias.grad is not None


def test_standardized_conv_same_form_saves_its_input_before_the_padding():
    from act_hf.nn.linear import ActStandardizedConvMixin

    _, make = _standardized_convs()[1]  # StdConv2dSame, stride 2: one more row and column after the input
    torch.manual_seed(0)
    act = convert(make(), ActStandardizedConvMixin, slot="m", bits=8)
    x = torch.randn(2, 4, 15, 15)
    with track_saved(act) as saved:
        act(x)
    assert set(saved.by_slot) == {"m:input"}
    assert saved.bytes <= x.numel() + math.ceil(x.numel() / 256) * 4 + 64 < 2 * 4 * 16 * 16


def test_standardized_conv_under_bf16_autocast_is_the_module_and_grads_stay_fp32():
    from act_hf.nn.linear import ActStandardizedConvMixin

    _, make = _standardized_convs()[0]
    torch.manual_seed(0)
    ref = make()
    act = convert(copy.deepcopy(ref), ActStandardizedConvMixin, slot="m", bits=8)
    x = torch.randn(2, 4, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yr = act(x), ref(x)
    assert ya.dtype == yr.dtype == torch.bfloat16 and torch.equal(ya, yr)
    ya.float().square().sum().backward()
    yr.float().square().sum().backward()
    assert act.weight.grad.dtype == torch.float32
    assert sqnr_db(ref.weight.grad, act.weight.grad) > 20


def test_a_changed_standardized_conv_keeps_its_own_forward():
    """Recognised by its forward's code: a subclass that computes anything else is not converted."""
    layers = pytest.importorskip("timm.layers")
    from act_hf.nn.linear import is_standardized_conv

    class Centered(layers.StdConv2d):
        def forward(self, x):
            return torch.nn.functional.conv2d(x, self.weight - self.weight.mean(), self.bias, self.stride,
                                              self.padding)

    assert is_standardized_conv(layers.StdConv2d(3, 4, 3))
    assert not is_standardized_conv(Centered(3, 4, 3))
    assert not is_standardized_conv(nn.Conv2d(3, 4, 3))


def test_a_standardized_conv_with_string_padding_runs_its_own_forward():
    layers = pytest.importorskip("timm.layers")
    from act_hf.nn.linear import ActStandardizedConvMixin

    ref = layers.ScaledStdConv2d(3, 4, 3, padding="same")
    act = convert(copy.deepcopy(ref), ActStandardizedConvMixin, slot="m", bits=3)
    x = torch.randn(2, 3, 8, 8)
    with track_saved(act) as saved:
        y = act(x)
    assert torch.equal(y, ref(x)) and "m:input" not in saved.by_slot


# ------------------------------------------------------------------------------------ SAME-padding conv


def _same_padding_convs():
    """timm's ``Conv2dSame`` (TF's SAME padding from the input's size: uneven at stride 2 or an even kernel)."""
    layers = pytest.importorskip("timm.layers")
    return [("stride_2", lambda: layers.Conv2dSame(4, 6, 3, stride=2)),
            ("even_kernel_depthwise", lambda: layers.Conv2dSame(4, 4, (4, 2), stride=(2, 1), groups=4, bias=False)),
            ("dilated", lambda: layers.Conv2dSame(4, 6, 3, dilation=2))]


@pytest.mark.parametrize("index", range(3), ids=["stride_2", "even_kernel_depthwise", "dilated"])
def test_same_padding_conv_is_the_module_forward_and_backward_without_rounding(monkeypatch, index):
    """Forward is timm's own, bit for bit; with packing turned into the identity, the input, weight and bias
    gradients are float64 autograd's through the padding (the estimate padded again, the gradient cut back)."""
    from act_hf.nn.linear import ActConv2dSameMixin, is_same_padding_conv

    name, make = _same_padding_convs()[index]
    torch.manual_seed(0)
    ref = make().double()
    assert is_same_padding_conv(ref)
    act = convert(copy.deepcopy(ref), ActConv2dSameMixin, slot="m", bits=3)
    _assert_exact_without_rounding(monkeypatch, ref, act, torch.randn(2, 4, 9, 11, dtype=torch.float64), name)


def test_same_padding_conv_saves_its_input_packed_before_the_padding():
    """The unpatched module keeps the padded input at full width; converted, it keeps the input itself packed
    (no padded copy), and a frozen weight saves nothing."""
    from act_hf.nn.linear import ActConv2dSameMixin

    _, make = _same_padding_convs()[0]
    torch.manual_seed(0)
    ref = make()
    act = convert(copy.deepcopy(ref), ActConv2dSameMixin, slot="m", bits=8)
    x = torch.randn(2, 4, 15, 15)  # padded to 16 x 16
    with track_saved(act) as saved:
        ya = act(x)
    assert set(saved.by_slot) == {"m:input"}
    assert saved.bytes <= x.numel() + math.ceil(x.numel() / 256) * 4 + 64 < 2 * 4 * 16 * 16
    xr, xa = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).square().sum().backward()
    act(xa).square().sum().backward()
    for p, q in [(xr, xa), *zip(ref.parameters(), act.parameters())]:
        assert sqnr_db(p.grad, q.grad) > 30
    act.weight.requires_grad_(False)
    act.bias.requires_grad_(False)
    xa = x.clone().requires_grad_()
    with track_saved(act) as saved:
        ya = act(xa)
    assert saved.bytes == 0
    ya.sum().backward()
    assert xa.grad.shape == x.shape


def test_a_changed_same_padding_conv_keeps_its_own_forward():
    """Recognised by the code of its forward and of the padding functions it calls."""
    layers = pytest.importorskip("timm.layers")
    from act_hf.nn.linear import is_same_padding_conv

    class Reflected(layers.Conv2dSame):
        def forward(self, x):
            return super().forward(torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect"))

    assert is_same_padding_conv(layers.Conv2dSame(3, 4, 3, stride=2))
    assert not is_same_padding_conv(Reflected(3, 4, 3, stride=2))
    assert not is_same_padding_conv(nn.Conv2d(3, 4, 3))


@pytest.mark.parametrize("make", [lambda: nn.Conv2d(4, 6, 3, padding="same"),
                                  lambda: nn.Conv2d(4, 6, (4, 3), padding="same", dilation=(1, 2), bias=False),
                                  lambda: nn.Conv1d(4, 4, 2, padding="same", groups=4),
                                  lambda: nn.Conv2d(4, 6, 2, padding="valid"),
                                  lambda: nn.Conv2d(4, 6, 4, padding="same", padding_mode="reflect")],
                         ids=["odd", "even_kernel_dilated", "even_1d_depthwise", "valid", "same_reflect"])
def test_conv_with_string_padding_is_the_module_forward_and_backward_without_rounding(monkeypatch, make):
    """``padding="same"`` (HF's EfficientNet, timm's ConvMixer) runs converted: the forward is PyTorch's own bit for
    bit (an even kernel's extra zero after the input, as ATen pads it), and with packing turned into the identity
    the gradients are float64 autograd's."""
    torch.manual_seed(0)
    ref = make().double()
    act = convert(copy.deepcopy(ref), ActConvMixin, slot="m", bits=3)
    shape = (2, 4, 9) if isinstance(ref, nn.Conv1d) else (2, 4, 9, 11)
    _assert_exact_without_rounding(monkeypatch, ref, act, torch.randn(shape, dtype=torch.float64))


def test_conv_with_same_padding_saves_its_input_packed():
    torch.manual_seed(0)
    _, act = _pair(nn.Conv2d(4, 6, 4, padding="same"), ActConvMixin, bits=8)
    x = torch.randn(2, 4, 15, 15)
    with track_saved(act) as saved:
        act(x)
    assert set(saved.by_slot) == {"m:input"}
    assert saved.bytes <= x.numel() + math.ceil(x.numel() / 256) * 4 + 64  # unpadded, 8 bits and group scales
