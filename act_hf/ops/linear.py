"""Linear and convolution with a quantized saved input.

Forward is the original op (``F.linear`` / ``torch.convolution``, autocast applying as usual; linears reading one
float32 input in a row under autocast share its cast, :mod:`act_hf.ops._shared_casts`). The context is
the input, quantized through the context store (shared with every other op that saves the same tensor) or,
after BatchNorm and ReLU, read from what they saved (:mod:`act_hf.derived`), and the weight *parameter*
itself (never autocast's copy: backward casts it again). Following
``ctx.needs_input_grad``: the input is saved only when the weight needs a gradient, the weight only when the
input does; a frozen layer fed by a frozen input saves nothing.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from .._chunks import by_items, even_spans, in_place, scaled_as, sliced_unless_room
from .._constants import zero_scalar
from ..compress import PackedTensor, dequantize, dequantize_items, dequantize_with_factors
from ..context import store
from ..derived import (
    DERIVED_CONTEXTS,
    AffineSum,
    AffineTerm,
    Items,
    RectifiedAffine,
    derived_input,
    items_decodable,
    note_packed,
)
from ._saving import (
    OpSettings,
    autocast_casts,
    autocast_dtype,
    autocast_state,
    load_context,
    owned_output,
    save_context,
)
from ._shared_casts import shared_casts
from ._shared_decodes import shared_decodes

__all__ = ["ActConvFunction", "ActLinearFunction", "ActScaleFunction", "ActStandardizedConvFunction",
           "act_channel_scale", "act_conv", "act_linear", "act_scale", "act_standardized_conv", "standardize_weight"]


def saved_input(x: Tensor, settings: OpSettings) -> PackedTensor | RectifiedAffine | AffineTerm | AffineSum:
    """What a linear or conv keeps of its input for the weight gradient: the context the ops before it already
    saved when ``x = relu(batch_norm(.))``, a residual block's ``relu(batch_norm(.) + shortcut)``, BatchNorm's
    output, a squeeze-and-excitation's ``g * x`` or a linear bottleneck's ``bn3(.) + shortcut``
    (:func:`act_hf.derived.derived_input`), else ``x`` packed
    through the store, at no fewer than ``settings.data_bits`` bits when ``x`` has no autograd history (the batch
    the model is fed); a packed ``x`` is noted for a residual add that takes it as its shortcut."""
    if not x.requires_grad and settings.data_bits > settings.bits:
        settings = replace(settings, bits=settings.data_bits)
    derived = derived_input(x, settings)
    if derived is not None:
        return derived
    packed = store.compress_as(x, settings)
    if settings.share_residual:
        note_packed(x, packed, settings.slot)  # a residual add may read x as its shortcut
    return packed


def input_values(saved: PackedTensor | RectifiedAffine | AffineTerm | AffineSum, dtype: torch.dtype,
                 items: Items = None) -> Tensor:
    """The input estimate :func:`saved_input`'s context stands for, in ``dtype``; with ``items``,
    ``(start, stop)``, its batch items ``start:stop`` alone (bit for bit the whole's; decoded from their own bits
    where :func:`~act_hf.derived.items_decodable` says so)."""
    if isinstance(saved, DERIVED_CONTEXTS):
        return saved.add_to(None, dtype, items).to(dtype)
    return dequantize(saved, dtype) if items is None else dequantize_items(saved, *items, dtype)


def _input_values_and_factors(saved: PackedTensor | RectifiedAffine | AffineTerm | AffineSum,
                              dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """:func:`input_values`, or for a channel-scaled packed input its values and per-channel factors
    (:func:`~act_hf.compress.dequantize_with_factors`), which the weight gradient takes on its input-feature
    axis instead of a pass over the decoded input. fp16 gets the values scaled: the unscaled sums could pass its
    largest number."""
    if not isinstance(saved, PackedTensor):
        return input_values(saved, dtype), None
    values, factors = dequantize_with_factors(saved, dtype)
    if factors is not None and values.dtype == torch.float16:
        return in_place(values, torch.Tensor.mul_, factors), None
    return values, factors


def _transposed_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight + bias`` for a weight stored ``(in, out)``, computed exactly as GPT-2's ``Conv1D`` does."""
    x2d = x.reshape(-1, x.shape[-1])
    out = torch.mm(x2d, weight) if bias is None else torch.addmm(bias, x2d, weight)
    return out.view(*x.shape[:-1], weight.shape[1])


class ActLinearFunction(torch.autograd.Function):
    """``y = x @ weight.T + bias`` (or ``x @ weight + bias`` with ``transposed``, a weight stored ``(in, out)``).

    Saves ``quantize(x)`` (if the weight needs a gradient) and ``weight`` (if ``x`` does).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, settings: OpSettings,
                transposed: bool = False) -> Tensor:
        cast = autocast_dtype(x.device.type)
        # autocast's cast of x, made once for Q, K and V (gate and up): the same bits as each making its own
        x_in = shared_casts.cast(x, cast, settings.slot) if autocast_casts(x, cast) else x
        out = owned_output(_transposed_linear(x_in, weight, bias) if transposed else F.linear(x_in, weight, bias))
        del x_in
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        packed = saved_input(x, settings) if need_w else None
        shared_decodes.expect(packed)  # Q, K and V decode their one input once
        save_context(ctx, packed, weight if need_x else None)
        ctx.transposed, ctx.weight_dtype = transposed, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, weight = load_context(ctx)
        dtype = grad_out.dtype
        grad_x = grad_w = grad_b = None
        # both GEMMs on the rows of the gradient, as the forward's GEMM ran on those of its input: a batched
        # matmul of a gradient whose rows are no view (a permuted one: ConvNeXt's MLP) would broadcast the weight
        # to every batch index, a copy of it each (convnext-tiny's last stage: 33 MiB a sample on the CPU)
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        # the weight gradient first: the dequantized input is freed before the input gradient is allocated,
        # so the two full-size buffers are never alive together (but for readers of a shared decode before the last)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            if ctx.needs_input_grad[1]:
                x2d, factors = shared_decodes.decode(packed, dtype, lambda: _input_values_and_factors(packed, dtype))
                x2d = x2d.reshape(-1, x2d.shape[-1])
                grad_w = x2d.t().matmul(g2d) if ctx.transposed else g2d.t().matmul(x2d)
                del x2d
                if factors is not None:  # the input's channels are grad_w's columns (rows when transposed)
                    # rounded once into the weight's dtype (powers of two: exact), so autograd has no cast left to
                    # make; fp32 factors cost the CPU a temporary of the weight's size, not the activation's
                    grad_w = scaled_as(grad_w, factors.reshape(-1, 1) if ctx.transposed else factors,
                                       ctx.weight_dtype)
            if ctx.needs_input_grad[2]:
                grad_b = g2d.sum(0)
        if ctx.needs_input_grad[0]:
            w = weight.to(dtype)
            grad_x = g2d.matmul(w.t() if ctx.transposed else w).view(*grad_out.shape[:-1], -1)
        return grad_x, grad_w, grad_b, None, None


def act_linear(x: Tensor, weight: Tensor, bias: Tensor | None, settings: OpSettings, *,
               transposed: bool = False) -> Tensor:
    """Functional form of :class:`ActLinearFunction`."""
    return ActLinearFunction.apply(x, weight, bias, settings, transposed)


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}

#: The most elements the input or the output of one convolution call holds: a larger batch runs a slice at a time,
#: in the weight and input gradients' passes and (off ``WHOLE_FORWARD_DEVICES``) the forward. Their working memory
#: grows with the batch: on the H200 resnet50's highest points at 2 bits held, per sample, a forward
#: convolution's 3.05 MiB (its output and cuDNN's allocations beside it) and a weight gradient's decoded input
#: (1.53 MiB) beside 2.34 MiB that ``convolution_backward`` allocated, of 7.8 MiB in all. At or below it, one call;
#: above it too when the device has room for the whole batch's temporaries (``ACT_HF_SLICING``,
#: :func:`~act_hf._chunks.sliced_unless_room`).
CONV_CHUNK_ELEMENTS = 1 << 26

#: Devices whose forward convolution runs whole at any batch: the CPU's oneDNN can round a slice of the batch
#: differently in the last bit, and the patched forward is the unpatched one's bit for bit there; its forward
#: convolutions hold no temporaries that grow with the batch (``benchmarks/memory_at_peak.py`` on resnet50).
WHOLE_FORWARD_DEVICES = ("cpu",)


def _conv_item_elements(padded_shape, weight_shape, stride, padding, dilation) -> int:
    """The larger of a convolution's input and output elements a batch item (at least 1), for an ``(N, C, *)``
    input of ``padded_shape``."""
    out_size = [(n + 2 * p - d * (k - 1) - 1) // s + 1
                for n, k, s, p, d in zip(padded_shape[2:], weight_shape[2:], stride, padding, dilation)]
    return max(math.prod(padded_shape[1:]), weight_shape[0] * math.prod(out_size), 1)


def _conv_item_spans(padded_shape, weight_shape, stride, padding, dilation) -> list[tuple[int, int]]:
    """Batch slices of a convolution over an ``(N, C, *)`` input of ``padded_shape`` whose input and output each
    hold at most ``CONV_CHUNK_ELEMENTS`` elements a slice (at least one item); one slice for a smaller batch."""
    per_item = _conv_item_elements(padded_shape, weight_shape, stride, padding, dilation)
    if padded_shape[0] * per_item <= CONV_CHUNK_ELEMENTS:
        return [(0, padded_shape[0])]
    return list(even_spans(padded_shape[0], max(1, CONV_CHUNK_ELEMENTS // per_item)))


def _whole_conv_bytes(padded_shape, weight_shape, itemsize: int, stride, padding, dilation) -> int:
    """The temporaries of a convolution pass over the whole batch, as :func:`~act_hf._chunks.sliced_unless_room`
    weighs them: three times the larger of its input and output (the tensor it makes, cuDNN's buffers beside it,
    which on the H200 came to about as much, and the decoded input of a weight gradient), ``itemsize`` bytes an
    element."""
    return 3 * padded_shape[0] * _conv_item_elements(padded_shape, weight_shape, stride, padding, dilation) * itemsize


def _conv_forward(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, ...], padding: tuple[int, ...],
                  dilation: tuple[int, ...], groups: int) -> Tensor:
    """``F.convNd(x, weight, ...)`` (autocast as usual) on a batched ``x``; on a device not in
    ``WHOLE_FORWARD_DEVICES``, over slices of a batch whose input or output passes ``CONV_CHUNK_ELEMENTS``, laid
    into one output in the layout the whole call gives, unless the device has room for the whole batch's
    temporaries (:func:`~act_hf._chunks.sliced_unless_room`)."""
    conv = _CONV[len(stride)]
    if x.device.type in WHOLE_FORWARD_DEVICES:
        return conv(x, weight, bias, stride, padding, dilation, groups)
    chunks = _conv_item_spans(x.shape, weight.shape, stride, padding, dilation)
    return sliced_unless_room(chunks, x.shape[0], x.device, _whole_conv_bytes(x.shape, weight.shape, x.element_size(),
                                                                               stride, padding, dilation),
                              lambda spans: by_items(spans, x.shape[0], lambda start, stop: conv(
                                  x if len(spans) == 1 else x[start:stop], weight, bias, stride, padding, dilation,
                                  groups)))


def _conv_input(packed: PackedTensor | RectifiedAffine | AffineTerm | AffineSum | None, grad_out: Tensor, padded_shape,
                pad: tuple[int, ...] | None = None, items: Items = None) -> Tensor:
    """What ``convolution_backward`` reads as the input: the saved input's values (its batch ``items`` alone,
    if given) in the gradient's dtype, padded with ``pad`` (``F.pad``'s form) where the op padded it, or, when
    the weight's gradient is not wanted (a bias's alone), a zero-stride stand-in of ``padded_shape`` (only its
    shape is read)."""
    if packed is None:
        return zero_scalar(grad_out).expand(padded_shape)
    values = input_values(packed, grad_out.dtype, items)
    return values if pad is None else F.pad(values, pad)


def _conv_param_grads(grad_out: Tensor, saved: PackedTensor | RectifiedAffine | AffineTerm | AffineSum | None,
                      weight: Tensor, bias_shape: list[int] | None, args: tuple, padded_shape,
                      pad: tuple[int, ...] | None, need_w: bool, need_b: bool,
                      chunks: list[tuple[int, int]]) -> tuple[Tensor | None, Tensor | None]:
    """The weight and bias gradients of a convolution from its saved input's values (``convolution_backward``'s
    ``args`` after the bias sizes). Over ``chunks`` of the batch (:func:`_conv_item_spans`), each slice's input
    decoded alone (:func:`~act_hf.derived.items_decodable`), the gradients summed in fp32 (or the wider dtype of
    the gradient); in one call for one chunk, a bias gradient alone, or a context that decodes only whole."""
    if len(chunks) == 1 or not need_w or not items_decodable(saved):
        x_hat = _conv_input(saved if need_w else None, grad_out, padded_shape, pad)
        return torch.ops.aten.convolution_backward(grad_out, x_hat, weight, bias_shape, *args,
                                                   [False, need_w, need_b])[1:]
    grad_w = grad_b = None
    for start, stop in chunks:
        x_hat = _conv_input(saved, grad_out, padded_shape, pad, (start, stop))
        _, part_w, part_b = torch.ops.aten.convolution_backward(grad_out[start:stop], x_hat, weight, bias_shape,
                                                                *args, [False, True, need_b])
        del x_hat
        grad_w = _widened(part_w) if grad_w is None else grad_w.add_(part_w)
        if need_b:
            grad_b = _widened(part_b) if grad_b is None else grad_b.add_(part_b)
    return grad_w, grad_b


def _widened(t: Tensor) -> Tensor:
    """``t`` as a new tensor of at least fp32's width, to sum partial gradients in."""
    return t.to(torch.promote_types(t.dtype, torch.float32), copy=True)


def _conv_backward(grad_out: Tensor, saved: PackedTensor | RectifiedAffine | AffineTerm | AffineSum | None,
                   weight: Tensor, bias_shape: list[int] | None, conv_args: tuple, padded_shape, input_shape,
                   need: tuple[bool, bool, bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(grad_x, grad_w, grad_b)`` of a convolution (``weight`` in the gradient's dtype; ``need``: which are
    wanted, the bias's only with a ``bias_shape``) in two passes: ``convolution_backward`` of the weight and bias
    gradients from the saved input's values, which are freed then, and the input gradient from the weight alone
    (:func:`_conv_input_grad`). One call would hold the decoded input and the input gradient, each as large as the
    input, at once: at a network's widest layer that is one of the few full-size tensors its backward peak is made
    of. Past ``CONV_CHUNK_ELEMENTS`` each pass works on a slice of the batch at a time (:func:`_conv_param_grads`;
    the input gradient's slices laid into one tensor), unless the device has room for the whole batch's
    (:func:`~act_hf._chunks.sliced_unless_room`)."""
    stride, padding, dilation, groups, pad = conv_args
    args = (list(stride), list(padding), list(dilation), False, [0] * len(stride), groups)
    need_x, need_w, need_b = need
    grad_x = grad_w = grad_b = None
    chunks = _conv_item_spans(padded_shape, weight.shape, stride, padding, dilation)
    batch, device = padded_shape[0], grad_out.device
    whole = _whole_conv_bytes(padded_shape, weight.shape, grad_out.element_size(), stride, padding, dilation)
    if need_w or need_b:
        grad_w, grad_b = sliced_unless_room(chunks, batch, device, whole, lambda spans: _conv_param_grads(
            grad_out, saved, weight, bias_shape, args, padded_shape, pad, need_w, need_b, spans))
    if need_x:
        grad_x = sliced_unless_room(chunks, batch, device, whole, lambda spans: by_items(
            spans, batch, lambda start, stop: _conv_input_grad(
                grad_out if len(spans) == 1 else grad_out[start:stop], weight, (stop - start, *padded_shape[1:]),
                args)))
        if pad is not None:
            grad_x = _unpad(grad_x, pad, input_shape)
    return grad_x, grad_w, grad_b


#: Devices where a depthwise convolution's input gradient (one input and one output channel a group) is the
#: transposed convolution too: the CPU, whose ``convolution_backward`` backends (oneDNN, the slow ones) make their
#: input (a zero-stride stand-in here) contiguous, an input-sized copy (efficientnet-b0's depthwise convs: 6.9 of the
#: 12.2 MiB a sample at its CPU backward peak), and where it gives a depthwise conv's bits (not always a conv's of
#: more channels a group: fp32 channels last). On CUDA, cuDNN and the depthwise kernels take the stand-in as it is
#: when no weight gradient is asked for (aten's ``convolution_backward``), and a grouped transposed convolution is
#: not known to match the depthwise kernels' speed (not measured).
TRANSPOSED_DEPTHWISE_DEVICES = ("cpu",)


def _conv_input_grad(grad_out: Tensor, weight: Tensor, padded_shape, args: tuple) -> Tensor:
    """The input gradient of a convolution over an input of ``padded_shape`` (``convolution_backward``'s ``args``
    after the bias sizes), from ``grad_out`` and ``weight`` alone. Ungrouped, and depthwise on
    ``TRANSPOSED_DEPTHWISE_DEVICES``, as the transposed convolution of ``grad_out`` (the backward-data kernel
    ``convolution_backward`` runs, the same values bit for bit): given an input, even a zero-stride stand-in,
    ``convolution_backward`` makes it contiguous first on the CPU, and for a 1-d convolution (viewed as 2-d) on
    any device, an input-sized copy written for nothing (``test_conv_input_gradient_makes_no_input_sized_copy``;
    cuDNN's 2-d and 3-d backward takes it as it is). Other grouped convolutions keep ``convolution_backward`` and
    the stand-in."""
    stride, padding, dilation, _, _, groups = args
    depthwise = groups == padded_shape[1] == weight.shape[0]
    if groups != 1 and not (depthwise and grad_out.device.type in TRANSPOSED_DEPTHWISE_DEVICES):
        return torch.ops.aten.convolution_backward(grad_out, _conv_input(None, grad_out, padded_shape), weight, None,
                                                   *args, [True, False, False])[0]
    # the input's trailing rows and columns no output reads (a stride past the last window): output_padding
    extra = [n - ((o - 1) * s - 2 * p + d * (k - 1) + 1) for n, o, s, p, d, k in
             zip(padded_shape[2:], grad_out.shape[2:], stride, padding, dilation, weight.shape[2:])]
    return _CONV_TRANSPOSE[len(stride)](grad_out, weight, None, stride, padding, extra, groups, dilation)


def _unpad(grad: Tensor, pad: tuple[int, ...], shape: torch.Size) -> Tensor:
    """The part of ``grad`` (the gradient of ``F.pad(x, pad)``) that belongs to ``x`` of ``shape``: what
    ``F.pad``'s own backward returns."""
    for i in range(len(pad) // 2):
        dim = grad.dim() - 1 - i
        grad = grad.narrow(dim, pad[2 * i], shape[dim])
    return grad


class ActConvFunction(torch.autograd.Function):
    """N-d convolution (any groups, stride, dilation, zero padding); saves ``quantize(x)`` and ``weight``.

    Non-zero padding modes are applied by the module with ``F.pad`` before this op, as ``nn.ConvNd`` does. With
    ``pad`` (``F.pad``'s form: the last dim's two sides first), the op convolves ``F.pad(x, pad)``, zeros, as timm's
    ``Conv2dSame`` does for TF's uneven SAME padding, and saves ``x`` itself: backward pads the estimate again.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, ...],
                padding: tuple[int, ...], dilation: tuple[int, ...], groups: int, settings: OpSettings,
                pad: tuple[int, ...] | None = None) -> Tensor:
        padded = x if pad is None else F.pad(x, pad)
        out = _conv_forward(padded, weight, bias, stride, padding, dilation, groups)  # autocast as usual
        need_w = ctx.needs_input_grad[1]
        packed = saved_input(x, settings) if need_w else None
        save_context(ctx, packed, weight)  # the parameter itself: its shape is needed even for grad_x only
        ctx.conv_args = (stride, padding, dilation, groups, pad)
        ctx.input_shape, ctx.padded_shape = x.shape, padded.shape
        ctx.bias_shape = None if bias is None else list(bias.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, weight = load_context(ctx)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                ctx.needs_input_grad[2] and ctx.bias_shape is not None)
        grad_x, grad_w, grad_b = _conv_backward(grad_out, packed, weight.to(grad_out.dtype), ctx.bias_shape,
                                                ctx.conv_args, ctx.padded_shape, ctx.input_shape, need)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def act_conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation, groups: int,
             settings: OpSettings, pad: tuple[int, ...] | None = None) -> Tensor:
    """Functional form of :class:`ActConvFunction`; an unbatched ``(C, *)`` input (which ``nn.ConvNd`` takes)
    convolves as a batch of one."""
    if x.dim() == len(stride) + 1:
        return act_conv(x.unsqueeze(0), weight, bias, stride, padding, dilation, groups, settings, pad).squeeze(0)
    return ActConvFunction.apply(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups, settings,
                                 None if pad is None else tuple(pad))


def standardize_weight(weight: Tensor, gain: Tensor | None, scale: float, eps: float) -> Tensor:
    """Weight standardization as timm's ``StdConv2d`` (``gain=None``) and ``ScaledStdConv2d`` compute it: each
    output channel's weights to zero mean and unit variance, times ``gain * scale``."""
    affine = None if gain is None else (gain * scale).view(-1)
    return F.batch_norm(weight.reshape(1, weight.shape[0], -1), None, None, weight=affine, training=True,
                        momentum=0., eps=eps).reshape_as(weight)


class ActStandardizedConvFunction(torch.autograd.Function):
    """2-d convolution with a standardized weight (:func:`standardize_weight`), zero padding (``pad`` as
    :class:`ActConvFunction`'s: the SAME forms' uneven padding, with the input saved before it).

    Saves ``quantize(x)`` (if the weight or gain needs a gradient), the ``weight`` and ``gain`` parameters, and
    no standardized weight: backward standardizes again, a weight-sized op, and maps the standardized weight's
    gradient through it. Kept, the standardized weight is one more weight-sized tensor per conv (``nfnet_f0``:
    160 MiB), and quantized like an activation it rounds every sample's gradient the same way.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, gain: Tensor | None, bias: Tensor | None, scale: float, eps: float,
                stride: tuple[int, ...], padding: tuple[int, ...], dilation: tuple[int, ...], groups: int,
                settings: OpSettings, pad: tuple[int, ...] | None = None) -> Tensor:
        padded = x if pad is None else F.pad(x, pad)
        out = _conv_forward(padded, standardize_weight(weight, gain, scale, eps), bias, stride, padding, dilation,
                            groups)
        need_params = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        save_context(ctx, saved_input(x, settings) if need_params else None, weight, gain)
        ctx.meta = (scale, eps, (stride, padding, dilation, groups, pad), x.shape, padded.shape,
                    None if bias is None else list(bias.shape), x.device.type, autocast_state(x.device.type))
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, weight, gain = load_context(ctx)
        scale, eps, (stride, padding, dilation, groups, pad), input_shape, padded_shape, bias_shape, device_type, \
            autocast = ctx.meta
        need_x, need_w, need_gain, need_b = ctx.needs_input_grad[:4]
        with torch.enable_grad(), torch.autocast(device_type, **autocast):
            w_leaf = weight.detach().requires_grad_(need_w)
            gain_leaf = None if gain is None else gain.detach().requires_grad_(need_gain)
            standardized = standardize_weight(w_leaf, gain_leaf, scale, eps)
        grad_x, grad_std, grad_b = _conv_backward(
            grad_out, packed, standardized.detach().to(grad_out.dtype), bias_shape,
            (stride, padding, dilation, groups, pad), padded_shape, input_shape,
            (need_x, need_w or need_gain, need_b and bias_shape is not None))
        grad_w = grad_gain = None
        if need_w or need_gain:
            leaves = [t for t in (w_leaf, gain_leaf) if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(standardized, leaves, grad_std.to(standardized.dtype)))
            grad_w = next(grads) if need_w else None
            grad_gain = next(grads) if need_gain else None
        return grad_x, grad_w, grad_gain, grad_b, None, None, None, None, None, None, None, None


def act_standardized_conv(x: Tensor, weight: Tensor, gain: Tensor | None, bias: Tensor | None, scale: float,
                          eps: float, stride, padding, dilation, groups: int, settings: OpSettings,
                          pad: tuple[int, ...] | None = None) -> Tensor:
    """Functional form of :class:`ActStandardizedConvFunction`; an unbatched ``(C, H, W)`` input convolves as a
    batch of one."""
    if x.dim() == 3:
        return act_standardized_conv(x.unsqueeze(0), weight, gain, bias, scale, eps, stride, padding, dilation, groups,
                                     settings, pad).squeeze(0)
    return ActStandardizedConvFunction.apply(x, weight, gain, bias, scale, eps, tuple(stride), tuple(padding),
                                             tuple(dilation), groups, settings, None if pad is None else tuple(pad))


def _channel_view(gamma: Tensor, ndim: int, dim: int) -> Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return gamma.view(shape)


class ActScaleFunction(torch.autograd.Function):
    """``y = x * s`` with ``s`` broadcast to ``x``'s shape (a diagonal linear map: layer scale's ``gamma`` along
    one dim; a squeeze-and-excitation gate, one value per sample and channel).

    The product is computed as ``x.mul(s)`` (type promotion included, as the originals compute it). Saves
    ``quantize(x)`` if ``s`` needs a gradient (``grad_s = sum(grad * x)`` over the dims ``s`` is broadcast
    along) and ``s`` if ``x`` does (``grad_x = grad * s``, exact). When ``x`` is BatchNorm's output (SE-ResNet's
    ``se(bn3(.))``) or a rectified one (RegNetY's ``se(relu(bn2(.)))``), ``grad_s`` reads it from what BatchNorm
    and the ReLU saved instead (:func:`act_hf.derived.derived_input`: ``weight * Q(x_norm) + bias``, times the
    ReLU's exact mask, unbiased), and nothing of ``x`` is packed again.
    """

    @staticmethod
    def forward(ctx, x: Tensor, s: Tensor, settings: OpSettings) -> Tensor:
        out = x.mul(s)
        need_x, need_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        packed = (derived_input(x, settings) or store.compress_as(x, settings)) if need_s else None
        save_context(ctx, packed, s if need_x else None)
        ctx.meta = (x.dtype, s.dtype, tuple(s.shape))
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, s = load_context(ctx)
        x_dtype, s_dtype, s_shape = ctx.meta
        grad_x = grad_s = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.mul(s).to(x_dtype)
        if ctx.needs_input_grad[1]:
            prod = grad_out * input_values(packed, x_dtype)
            dims = [d for d, n in enumerate(s_shape) if n == 1 and prod.shape[d] != 1]
            grad_s = (prod.sum(dim=dims, keepdim=True) if dims else prod).to(s_dtype)
        return grad_x, grad_s, None


def act_scale(x: Tensor, s: Tensor, settings: OpSettings) -> Tensor:
    """Functional form of :class:`ActScaleFunction`: ``x * s`` for ``s`` with ``x``'s number of dims, each of
    its sizes ``x``'s or 1."""
    if s.dim() != x.dim() or any(n not in (1, m) for n, m in zip(s.shape, x.shape)):
        raise ValueError(f"s: expected a shape that broadcasts to x's {tuple(x.shape)} with as many dims "
                         f"(each size 1 or x's), got {tuple(s.shape)}")
    return ActScaleFunction.apply(x, s, settings)


def act_channel_scale(x: Tensor, gamma: Tensor, dim: int, settings: OpSettings) -> Tensor:
    """:func:`act_scale` by ``gamma``, a vector along ``dim`` of ``x`` (layer scale)."""
    if gamma.dim() != 1 or gamma.shape[0] != x.shape[dim]:
        raise ValueError(f"gamma: expected a vector of x.shape[{dim}] = {x.shape[dim]} values, "
                         f"got {tuple(gamma.shape)}")
    return ActScaleFunction.apply(x, _channel_view(gamma, x.dim(), dim % x.dim()), settings)

