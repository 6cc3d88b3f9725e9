"""LayerNorm, RMSNorm and BatchNorm (plus fused BatchNorm + invertible activation) with a compressed context.

Forward is the original computation (the same aten calls, or, for RMSNorm, the same expression as the model's
own code), so outputs are bit-identical; only what is saved for backward changes. Two context forms:

- ``"output"`` (In-Place ABN, Rota Bulò et al. 2018; apex ``memory_efficient=True``): save the quantized
  OUTPUT ``y`` (the very tensor object returned, so a following Linear that saves the same tensor at the same
  bits and group size shares one packed copy through the context store), the per-row ``rstd`` (fp32) and the
  parameters; backward recovers ``x_hat = (y - beta) / gamma``. Parameters are never reparametrized.
- ``"input"`` (ActNN appendix B.2): save the quantized INPUT plus ``mean``/``rstd`` (fp32, one per row).

Small ``|gamma|`` amplifies the quantization noise of ``y`` by ``1/|gamma|`` in that feature, and ``gamma == 0``
loses ``x_hat`` entirely. :func:`output_context_safe` therefore accepts the output form only when every
``|gamma_j| >= gamma_eps * max_j |gamma_j|`` (``gamma_eps`` defaults to :data:`DEFAULT_GAMMA_EPS` = 0.05,
relative); otherwise the whole op falls back to the input form (simplest honest choice: no per-column side
channel, no reparametrization). The check costs one device sync; the modules in :mod:`act_hf.nn.norm` cache
it per weight version, and the first miss after an optimizer step answers all their changed weights in that one
sync (:mod:`act_hf.ops._gamma_guard`).

Measured default (CPU, fp32, x: 2x256x768 with a per-feature offset, group size 256, gradients vs fp64
autograd, SQNR in dB as ``grad_x / grad_w``, mean of 4 rounding draws; RMSNorm ("llama") within 0.2 dB of
LayerNorm everywhere). "outliers": 8 features at 20x scale, like a transformer residual stream; "small gamma":
gamma ~ N(1, 0.1) with 5% of the features at 0.1-0.3 (all pass the 0.05 guard)::

    bits   plain               outliers            outliers + small gamma
           output   input      output   input      output   input
    2      26.5/1.8 26.9/2.2   13.4/-4.0 13.5/-3.8  9.0/-11.8 13.4/-7.4
    3      34.9/9.2 35.2/9.6   25.0/3.8  24.9/3.8   21.1/-4.3 24.7/0.1
    4      41.5/15.7 41.9/16.1 32.8/10.3 32.9/10.4  29.7/2.3  32.8/6.8

(``grad_w`` is a sum over rows of products with the rounding noise of each element: the quantizer's
group-wide step, set by the outlier features, dominates it at every width.) At equal bits the two forms are
equal within 0.4 dB except where some ``|gamma|`` are several times smaller than the rest (output form 3-4 dB
worse: noise divided by ``gamma``). Memory decides: a LayerNorm feeding a Linear at the same bits stores one
packed tensor in the output form and two in the input form (2x256x768, 3 bits: 0.154 MB vs 0.300 MB of context
for LN + Linear), so the output form at ``b + 1`` bits costs less than the input form at ``b`` bits and beats
it by 8-12 dB on ``grad_x``. ``"output"`` is therefore the default for LayerNorm and RMSNorm. BatchNorm
defaults to the input form: zero-initialized ``gamma`` (last BN of ResNet blocks) would make the output form
fall back anyway, and a leaky ReLU's small slope amplifies the noise (see :class:`ActBatchNormActFunction`).

Gradients are computed in fp32 from the reconstructed ``x_hat`` and cast to each input's dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .._chunks import in_place, row_spans, scaled_as, sliced_unless_room
from .._constants import zeros_and_ones
from ..compress import (
    PackedTensor,
    dequantize,
    dequantize_inverse_affine,
    dequantize_items,
    dequantize_mapped,
    dequantize_with_factors,
    unpack_mask,
)
from ..context import store
from ..derived import items_decodable, note_pending
from ..errors import ActHFValueError
from ._gamma_guard import output_context_safe
from ._saving import OpSettings, autocast_cast, load_context, owned_output, save_context
from .activation import _pack_codes

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_GAMMA_EPS",
    "DEFAULT_NORM_CONTEXT",
    "NORM_CONTEXTS",
    "RMS_STYLES",
    "ActBatchNormActFunction",
    "ActBatchNormFunction",
    "ActLayerNormFunction",
    "ActRMSNormFunction",
    "act_batch_norm",
    "act_batch_norm_act",
    "act_layer_norm",
    "act_rms_norm",
    "check_activation",
    "check_norm_context",
    "check_rms_style",
    "output_context_safe",
    "rms_style_reproducing",
]

NORM_CONTEXTS = ("output", "input")
DEFAULT_NORM_CONTEXT = "output"
RMS_STYLES = ("llama", "t5", "torch", "gemma")
ACTIVATIONS = ("identity", "leaky_relu", "elu")
DEFAULT_GAMMA_EPS = 0.05

def check_norm_context(context: object, name: str = "context") -> str:
    """Validate a context form: ``"output"`` or ``"input"``."""
    if context not in NORM_CONTEXTS:
        raise ActHFValueError(f"{name} must be one of {NORM_CONTEXTS}, got {context!r}")
    return context  # type: ignore[return-value]


def check_rms_style(style: object, name: str = "style") -> str:
    """Validate an RMSNorm style: ``"llama"``, ``"t5"``, ``"torch"`` or ``"gemma"``."""
    if style not in RMS_STYLES:
        raise ActHFValueError(f"{name} must be one of {RMS_STYLES}, got {style!r}")
    return style  # type: ignore[return-value]


def check_activation(activation: object, param: float, name: str = "activation") -> str:
    """Validate an invertible activation for :func:`act_batch_norm_act` and its parameter."""
    if activation not in ACTIVATIONS:
        raise ActHFValueError(f"{name} must be one of {ACTIVATIONS}, got {activation!r}")
    if activation in ("leaky_relu", "elu") and not (isinstance(param, (int, float)) and param > 0):
        what = "negative_slope" if activation == "leaky_relu" else "alpha"
        raise ActHFValueError(f"{what} of {activation} must be > 0 to be invertible, got {param!r}")
    return activation  # type: ignore[return-value]


def _autocast_on(x: Tensor) -> bool:
    return torch.is_autocast_enabled(x.device.type)


def _autocast_policy(cache: dict[tuple[str, torch.dtype], str], probe: Callable[[Tensor], Tensor],
                     device_type: str) -> str:
    """What autocast on ``device_type``, at its current dtype, does to the op ``probe`` calls: ``"fp32"`` (casts
    the inputs to fp32), ``"none"`` (runs it as called) or ``"other"``; told by the output dtypes of a
    low-precision and an fp32 probe, asked once per device type and dtype (kept in ``cache``)."""
    key = (device_type, torch.get_autocast_dtype(device_type))
    policy = cache.get(key)
    if policy is None:
        low, full = (probe(torch.ones(2, 2, dtype=dtype, device=device_type)).dtype
                     for dtype in (key[1], torch.float32))
        policy = {(torch.float32, torch.float32): "fp32", (key[1], torch.float32): "none"}.get((low, full), "other")
        cache[key] = policy
    return policy


_AUTOCAST_LAYER_NORM: dict[tuple[str, torch.dtype], str] = {}


def _autocast_layer_norm_policy(device_type: str) -> str:
    """:func:`_autocast_policy` of ``F.layer_norm``: ``"none"`` on the CPU, and on CUDA in torch 2.11."""
    return _autocast_policy(_AUTOCAST_LAYER_NORM, lambda t: F.layer_norm(t, (2,)), device_type)


def _rows(shape: torch.Size, k: int) -> tuple[int, int]:
    n = math.prod(shape[len(shape) - k:])
    return math.prod(shape[: len(shape) - k]), n


def _inverse_perm(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def _decoded_and_factors(packed: PackedTensor, fold: bool) -> tuple[Tensor, Tensor | None]:
    """A norm's saved tensor decoded in fp32, and when ``fold`` (the caller divides it per channel anyway) the
    channel factors it left for the caller to fold into that divisor (:func:`dequantize_with_factors`)."""
    if not fold:
        return dequantize(packed, torch.float32), None
    return dequantize_with_factors(packed, torch.float32)


def _undo_affine_(y: Tensor, weight: Tensor | None, bias: Tensor | None, factors: Tensor | None = None,
                  view: tuple[int, ...] = (1, -1)) -> Tensor:
    """``(y * factors - bias) / weight`` into ``y``, in one pass over it as ``y * (factors / weight) - bias /
    weight``: one rounding more than a subtraction and a division, each a pass (far below the noise of a decoded
    ``y``). ``weight``, ``bias`` and ``factors`` (any may be ``None``) broadcast against each other; their
    results are reshaped to ``view``, which broadcasts against ``y``."""
    if weight is not None:
        mult = weight.reciprocal() if factors is None else factors / weight
        shift = None if bias is None else bias / weight
    else:
        mult, shift = factors, bias
    if shift is None:
        return y if mult is None else y.mul_(mult.reshape(view))
    if mult is None:
        return y.sub_(shift.reshape(view))
    return torch.addcmul(shift.neg().reshape(view), y, mult.reshape(view), out=y)


def _inverse_affine(weight: Tensor | None, bias: Tensor | None, channels: int,
                    like: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 ``(mult, shift)`` of one value per channel, on ``like``'s device, with ``y * mult + shift = (y - bias) /
    weight`` as :func:`_undo_affine_` computes it (``mult = 1 / weight``, ``shift = -(bias / weight)``; a missing
    ``weight`` or ``bias`` counts as 1 or 0): the map :func:`~act_hf.compress.dequantize_mapped` applies as it
    decodes."""
    zeros, ones = zeros_and_ones((channels,), like, torch.float32)
    w = None if weight is None else weight.float().reshape(channels)
    b = None if bias is None else bias.float().reshape(channels)
    mult = ones if w is None else w.reciprocal()
    shift = zeros if b is None else (b if w is None else b / w).neg()
    return mult, shift


def _rms_input_grad_(g: Tensor, x_hat: Tensor, rstd: Tensor, w_eff: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``d x`` of ``y = w * x * rstd`` with ``rstd = rsqrt(mean(x^2) + eps)`` over rows (fp32), in ``dtype``,
    overwriting ``x_hat`` (the caller's own tensor) to keep the full-size temporaries to one."""
    d = g if w_eff is None else g * w_eff
    x_hat.mul_((d * x_hat).mean(1, keepdim=True))
    return scaled_as(torch.sub(d, x_hat, out=x_hat), rstd, dtype)


# ----------------------------------------------------------------------------------------------------------------
# LayerNorm
# ----------------------------------------------------------------------------------------------------------------


class ActLayerNormFunction(torch.autograd.Function):
    """``F.layer_norm`` over the last ``len(normalized_shape)`` dims, with a compressed context.

    Saves, when the input or the weight needs a gradient (a bias-only gradient saves nothing):

    - ``context="output"``: ``quantize(y)`` of the returned tensor, ``rstd`` (fp32, one per row; only when the
      input needs a gradient), ``weight`` and ``bias`` (the parameters themselves).
    - ``context="input"``: ``quantize(x)``, ``mean`` and ``rstd`` (fp32, one per row), ``weight``.

    ``out_perm`` (timm ``LayerNorm2d``) returns ``y.permute(out_perm)`` and quantizes that view, the tensor the
    next op receives.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, normalized_shape: tuple[int, ...],
                eps: float, context: str, settings: OpSettings, out_perm: tuple[int, ...] | None) -> Tensor:
        k = len(normalized_shape)
        # the aten call F.layer_norm makes, under the original's autocast policy, with its statistics
        policy = _autocast_layer_norm_policy(x.device.type) if _autocast_on(x) else "none"
        if policy == "fp32":
            with torch.autocast(x.device.type, enabled=False):
                x32, w32, b32 = (autocast_cast(t, torch.float32) for t in (x, weight, bias))  # as autocast casts
                y, mean, rstd = torch.native_layer_norm(x32, normalized_shape, w32, b32, eps)
        elif policy == "none":
            y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        else:  # a policy of another torch release: F.layer_norm itself, the statistics computed aside
            y = F.layer_norm(x, normalized_shape, weight, bias, eps)
            with torch.autocast(x.device.type, enabled=False):
                var, mean = torch.var_mean(x.float(), dim=tuple(range(-k, 0)), unbiased=False, keepdim=True)
                rstd = torch.rsqrt(var + eps)
        out = owned_output(y if out_perm is None else y.permute(out_perm))
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.meta = (x.shape, x.dtype, k, context, out_perm, None if bias is None else bias.dtype)
        if not (need_x or need_w):
            save_context(ctx, None, None, None, None, None)
        elif context == "output":
            packed = store.compress_as(out, settings)
            save_context(ctx, packed, None, rstd if need_x else None, weight, bias)
        else:
            packed = store.compress_as(x, settings)
            save_context(ctx, packed, mean, rstd, weight, None)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, mean, rstd, weight, bias = load_context(ctx)
        shape, dtype, k, context, out_perm, bias_dtype = ctx.meta
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if out_perm is not None:
            grad_out = grad_out.permute(_inverse_perm(out_perm))
        rows, n = _rows(shape, k)
        g = grad_out.float().reshape(rows, n)
        if not (need_x or need_w):
            grad_b = g.sum(0).reshape(shape[-k:]).to(bias_dtype) if need_b else None
            return None, None, grad_b, None, None, None, None, None
        w = None if weight is None else weight.float()
        centred = False  # whether saved is x - mean, x_hat / rstd: aten's backward then takes the real rstd
        if context == "output" and out_perm is None and w is not None and k == 1:
            # x_hat = (y - beta) / gamma as y * (1 / gamma) - beta / gamma, decoded and mapped in one pass; divided
            # by rstd in it when grad_x is wanted, so that aten's backward multiplies by rstd, not a pass after it
            centred = rstd is not None
            saved = dequantize_inverse_affine(packed, w.reshape(n), None if bias is None else bias.float().reshape(n),
                                              divisor=rstd.float().reshape(rows) if centred else None)
            saved = saved.reshape(rows, n)
        else:
            # x_hat = (y - beta) / gamma of the output form takes the channel factors f of a channel-scaled y:
            # (y/f - beta/f) / (gamma/f), the same bits without a pass for them
            fold = context == "output" and out_perm is None and w is not None
            saved, factors = _decoded_and_factors(packed, fold)
            if out_perm is not None and context == "output":  # the saved output is the permuted view
                saved = saved.permute(_inverse_perm(out_perm))
            saved = saved.reshape(rows, n)
            if context == "output":  # x_hat, in place (the decoded tensor is this backward's own)
                _undo_affine_(saved, w, None if bias is None else bias.float(), factors, (1, n))
        unit_rstd = None
        if context == "output":  # x_hat (x - mean: centred) is fed to aten's backward as an input of mean 0
            mean, ones = zeros_and_ones((rows, 1), g)
            unit_rstd = None if centred else ones
        # grad_b, sum(g), comes from the same pass as grad_w; aten reads only the dtype and device of its bias
        beta = (g.new_empty(n) if bias is None else bias.float().reshape(n)) if need_b else None
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            g, saved, (n,), mean.float().reshape(rows, 1),
            rstd.float().reshape(rows, 1) if unit_rstd is None else unit_rstd,
            None if w is None else w.reshape(n), beta, [need_x, need_w, need_b])
        del saved
        if need_x:
            if unit_rstd is not None:  # the bracket of d x, times the real rstd
                grad_x = scaled_as(grad_x, rstd.float().reshape(rows, 1), dtype)
            grad_x = grad_x.reshape(shape).to(dtype)
        grad_w = grad_w.reshape(shape[-k:]).to(weight.dtype) if need_w else None
        grad_b = grad_b.reshape(shape[-k:]).to(bias_dtype) if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


def act_layer_norm(x: Tensor, normalized_shape, weight: Tensor | None, bias: Tensor | None, eps: float,
                   settings: OpSettings, *, context: str = DEFAULT_NORM_CONTEXT,
                   gamma_eps: float = DEFAULT_GAMMA_EPS, out_perm: tuple[int, ...] | None = None,
                   cache_guard: bool = False) -> Tensor:
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)`` saving a compressed context.

    Args:
        x: input, normalized over its last ``len(normalized_shape)`` dims.
        normalized_shape: int or tuple, as for ``F.layer_norm``.
        weight: ``gamma`` or ``None``.
        bias: ``beta`` or ``None``.
        eps: the epsilon of the original module.
        settings: slot, bits and group size of the saved tensor.
        context: ``"output"`` (save ``y``) or ``"input"`` (save ``x``); ``"output"`` falls back to ``"input"``
            when :func:`output_context_safe` rejects ``weight``.
        gamma_eps: relative ``|gamma|`` threshold of that guard.
        out_perm: return ``y.permute(out_perm)`` (channels-first LayerNorm).
        cache_guard: cache the guard per weight version (modules do).

    Returns:
        Exactly what ``F.layer_norm`` returns (permuted when ``out_perm`` is given).

    Raises:
        ValueError: ``context`` is not ``"output"``/``"input"``.
    """
    check_norm_context(context)
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    if context == "output" and not output_context_safe(weight, gamma_eps=gamma_eps, cache=cache_guard):
        context = "input"
    out = ActLayerNormFunction.apply(x, weight, bias, normalized_shape, eps, context, settings, out_perm)
    return out


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------------------------


def _rms_forward(x: Tensor, weight: Tensor | None, eps: float | None, style: str,
                 normalized_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """The original module's forward, plus fp32 ``rstd`` of shape ``(..., 1 * k)``."""
    if style == "llama":  # transformers LlamaRMSNorm / Qwen2RMSNorm / MistralRMSNorm
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + eps)
        h = h * rstd
        return weight * h.to(input_dtype), rstd
    if style == "t5":  # transformers T5LayerNorm
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + eps)
        h = x * rstd
        if weight.dtype in [torch.float16, torch.bfloat16]:
            h = h.to(weight.dtype)
        return weight * h, rstd
    if style == "gemma":  # transformers GemmaRMSNorm: (x * (1 + w)) in fp32, cast back
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = xf * rstd
        out = out * (1.0 + weight.float())
        return out.type_as(x), rstd
    # torch nn.RMSNorm
    y = F.rms_norm(x, normalized_shape, weight, eps)
    k = len(normalized_shape)
    e = torch.finfo(y.dtype if _autocast_on(x) else x.dtype).eps if eps is None else eps
    with torch.autocast(x.device.type, enabled=False):
        rstd = torch.rsqrt(x.float().pow(2).mean(tuple(range(-k, 0)), keepdim=True) + e)
    return y, rstd


def rms_style_reproducing(forward, weight: Tensor, eps: float, candidates=RMS_STYLES) -> str | None:
    """The first style of ``candidates`` whose formula reproduces ``forward`` bit for bit, or ``None``.

    ``forward(x)`` is the original module's forward (with ``weight`` and ``eps`` its own). It is compared on
    probe rows in fp32, bf16 and the weight's dtype, without autocast. A style is accepted only if it returns
    the same dtype and values on every probe. A forward that fails on the probes, or one no style reproduces
    (a mean-subtracting or gated "RMSNorm", a ``1 + weight`` one under another name), gives ``None``.
    """
    g = torch.Generator().manual_seed(0)
    n = weight.shape[-1]
    probes = [(torch.randn(4, n, generator=g) * 3).to(device=weight.device, dtype=dtype)
              for dtype in dict.fromkeys((torch.float32, torch.bfloat16, weight.dtype))]
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the probes' own (F.rms_norm on mixed dtypes has no fused kernel)
        try:
            wanted = [forward(x) for x in probes]
        except Exception:  # noqa: BLE001 - any failure means "not a one-input RMSNorm act_hf can reproduce"
            return None
        for style in candidates:
            got = [_rms_forward(x, weight, eps, style, (n,))[0] for x in probes]
            if all(isinstance(w, Tensor) and w.dtype == o.dtype and w.shape == o.shape and torch.equal(w, o)
                   for w, o in zip(wanted, got)):
                return style
    return None


class ActRMSNormFunction(torch.autograd.Function):
    """RMSNorm ``y = w_eff * x * rsqrt(mean(x^2) + eps)`` in one of :data:`RMS_STYLES`, compressed context.

    ``w_eff`` is ``weight`` (``1 + weight`` for ``"gemma"``; none for a weightless ``nn.RMSNorm``). Saves, when
    the input or the weight needs a gradient:

    - ``context="output"``: ``quantize(y)`` of the returned tensor, ``rstd`` (fp32, one per row; only when the
      input needs a gradient) and ``weight``.
    - ``context="input"``: ``quantize(x)``, ``rstd`` and ``weight``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float | None, style: str,
                normalized_shape: tuple[int, ...], context: str, settings: OpSettings) -> Tensor:
        y, rstd = _rms_forward(x, weight, eps, style, normalized_shape)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.meta = (x.shape, x.dtype, len(normalized_shape), context, style)
        if not (need_x or need_w):
            save_context(ctx, None, None, None)
        elif context == "output":
            packed = store.compress_as(y, settings)
            save_context(ctx, packed, rstd if need_x else None, weight)
        else:
            packed = store.compress_as(x, settings)
            save_context(ctx, packed, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, rstd, weight = load_context(ctx)
        shape, dtype, k, context, style = ctx.meta
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = None
        if need_x or need_w:
            rows, n = _rows(shape, k)
            g = grad_out.float().reshape(rows, n)
            w = None
            if weight is not None:
                w = weight.float().reshape(1, n)
                if style == "gemma":
                    w = 1.0 + w
            if context == "output" and w is not None and k == 1:
                # x_hat = y / w as y * (1 / w), decoded and mapped in one pass (a channel-scaled y's factors f
                # folded in as f / w): one rounding more than a division, a pass less
                x_hat = dequantize_inverse_affine(packed, w.reshape(n), None).reshape(rows, n)
            else:
                # this backward's own, normalized in place; y / w of the output form takes a channel-scaled y's
                # factors f as (y/f) / (w/f)
                x_hat, factors = _decoded_and_factors(packed, context == "output" and w is not None)
                x_hat = x_hat.reshape(rows, n)
                if context == "output":
                    if w is not None:
                        x_hat.div_(w if factors is None else (w.reshape(weight.shape) / factors).reshape(1, n))
                else:
                    x_hat.mul_(rstd.float().reshape(rows, 1))
            if need_w:
                grad_w = (g * x_hat).sum(0).reshape(weight.shape).to(weight.dtype)
            if need_x:
                grad_x = _rms_input_grad_(g, x_hat, rstd.float().reshape(rows, 1), w, dtype).reshape(shape)
        return grad_x, grad_w, None, None, None, None, None


def act_rms_norm(x: Tensor, weight: Tensor | None, eps: float | None, settings: OpSettings, *,
                 style: str = "llama", normalized_shape=None, context: str = DEFAULT_NORM_CONTEXT,
                 gamma_eps: float = DEFAULT_GAMMA_EPS, cache_guard: bool = False) -> Tensor:
    """RMSNorm exactly as the original module computes it, saving a compressed context.

    Args:
        x: input, normalized over the last dim (``normalized_shape`` dims for ``style="torch"``).
        weight: the scale parameter (``None`` only for ``style="torch"`` without affine).
        eps: ``variance_epsilon``/``eps`` of the module (``None`` allowed for ``style="torch"``).
        settings: slot, bits and group size of the saved tensor.
        style: ``"llama"`` (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm: fp32 compute, cast the normalized
            ``x`` back, then ``weight *``), ``"t5"`` (T5LayerNorm: cast to ``weight.dtype`` only when it is
            half), ``"torch"`` (``F.rms_norm``, ``nn.RMSNorm``), ``"gemma"`` (GemmaRMSNorm: ``* (1 + weight)``
            in fp32, cast back).
        normalized_shape: for ``style="torch"``; defaults to ``(x.shape[-1],)``.
        context: ``"output"`` or ``"input"``; see :func:`act_layer_norm`.
        gamma_eps: relative threshold of the small-``|w_eff|`` guard.
        cache_guard: cache the guard per weight version.

    Returns:
        Exactly what the original module returns.

    Raises:
        ValueError: unknown ``style``/``context``, or a missing ``weight``/``eps`` where the style needs them.
    """
    check_rms_style(style)
    check_norm_context(context)
    if normalized_shape is None or style != "torch":
        normalized_shape = (x.shape[-1],)
    elif isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    if style != "torch":
        if weight is None:
            raise ActHFValueError(f"weight must be a tensor for style={style!r}, got None")
        if eps is None:
            raise ActHFValueError(f"eps must be a float for style={style!r}, got None")
    offset = 1.0 if style == "gemma" else 0.0
    if context == "output" and not output_context_safe(weight, offset=offset, gamma_eps=gamma_eps, cache=cache_guard):
        context = "input"
    return ActRMSNormFunction.apply(x, weight, eps, style, normalized_shape, context, settings)


# ----------------------------------------------------------------------------------------------------------------
# BatchNorm
# ----------------------------------------------------------------------------------------------------------------


_AUTOCAST_BATCH_NORM: dict[tuple[str, torch.dtype], str] = {}


def _autocast_batch_norm_policy(device_type: str) -> str:
    """:func:`_autocast_policy` of ``F.batch_norm``: ``"none"`` on the CPU and on CUDA."""
    return _autocast_policy(_AUTOCAST_BATCH_NORM, lambda t: F.batch_norm(t, None, None, training=True), device_type)


def _bn_forward(x: Tensor, weight, bias, running_mean, running_var, momentum: float, eps: float):
    """Training-mode ``F.batch_norm`` (running stats updated in place) plus fp32 per-channel mean and invstd."""
    if _autocast_on(x) and _autocast_batch_norm_policy(x.device.type) != "none":
        # keep the original's autocast behaviour: call the same functional, stats aside
        y = F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
        dims = [0] + list(range(2, x.dim()))
        with torch.autocast(x.device.type, enabled=False):
            var, mean = torch.var_mean(x.float(), dim=dims, unbiased=False)
            invstd = torch.rsqrt(var + eps)
        return y, mean, invstd
    # what torch.batch_norm runs (same backend choice: native / cudnn / miopen)
    y, mean, invstd, _, _ = torch.ops.aten._batch_norm_impl_index(
        x, weight, bias, running_mean, running_var, True, momentum, eps, torch.backends.cudnn.enabled)
    return y, mean, invstd


def writes_in_place(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                    running_var: Tensor | None, eps: float) -> bool:
    """Whether :func:`_bn_forward_into` gives ``x``'s training-mode BatchNorm the same bits as
    :func:`_bn_forward`: aten's native kernels are the ones ``torch.batch_norm`` picks (not cuDNN: a bf16 input
    on CUDA and every CPU input), autocast leaves ``batch_norm`` alone, ``x`` is no view and no leaf that needs a
    gradient, and the parameters have ``x``'s accumulation dtype (fp32, fp64 for fp64), which is then the
    statistics' too."""
    if weight is None or x.dim() < 2 or x._is_view() or (x.is_leaf and x.requires_grad):
        return False
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # no dispatched promote_types
    if weight.dtype != acc or any(t is not None and t.dtype != acc for t in (bias, running_mean, running_var)):
        return False
    if (running_mean is None) != (running_var is None):
        return False
    if _autocast_on(x) and _autocast_batch_norm_policy(x.device.type) != "none":
        return False
    if bias is None:  # cuDNN's BatchNorm needs a bias
        return True
    blank = weight.new_empty(0)  # as defined as a running buffer: cuDNN takes both, or neither in training
    stats = (blank, blank) if running_mean is None else (running_mean, running_var)
    return torch._C._select_batch_norm_backend(x, weight, bias, *stats, True, eps) \
        == torch._C._BatchNormBackend.Native


def _split_kernels(t: Tensor) -> bool:
    """Whether aten's split BatchNorm kernels serve ``t`` (a CUDA tensor): ``batch_norm_update_stats`` with running
    statistics, ``batch_norm_elemt``, ``batch_norm_backward_reduce`` and ``batch_norm_backward_elemt``, the kernels
    ``native_batch_norm`` and its backward run inside (the last three exist for CUDA alone)."""
    return t.is_cuda


def _bn_statistics(x: Tensor, eps: float, dtype: torch.dtype, running_mean: Tensor | None = None,
                   running_var: Tensor | None = None, momentum: float = 0.0) -> tuple[Tensor, Tensor]:
    """The per-channel ``(mean, invstd)`` of training-mode BatchNorm over ``x``, in ``dtype`` (the accumulation
    dtype), from aten's own statistics kernels, without the output: one read of ``x``. On CUDA they are
    ``native_batch_norm``'s, bit for bit, and the running statistics are updated as it updates them
    (``batch_norm_update_stats`` runs its statistics kernel and its update; ``invstd`` is its ``rsqrt(var + eps)``),
    so that :func:`_bn_forward_into` writes the output from them, with no second statistics pass over ``x``. On the
    CPU the running statistics are left alone: :func:`_bn_forward_into` takes its own statistics and updates them."""
    if _split_kernels(x):
        mean, var = torch.ops.aten.batch_norm_update_stats(x, running_mean, running_var, momentum)
        return mean, torch.rsqrt(var + eps)
    c = x.shape[1]
    scratch = torch.zeros(c, dtype=dtype, device=x.device), torch.ones(c, dtype=dtype, device=x.device)
    mean, var = torch.ops.aten.batch_norm_update_stats(x, *scratch, 0.0)  # the scratch buffers set the dtype
    return mean, torch.rsqrt(var + eps)


def _bn_forward_into(x: Tensor, weight: Tensor, bias, running_mean, running_var, momentum: float,
                     eps: float, statistics: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Training-mode BatchNorm written into ``x`` (running stats updated in place) by aten's native kernels, the
    ones :func:`writes_in_place` confirmed ``torch.batch_norm`` runs: the same statistics and the same bits, the
    output's per-element formula reading each element before it writes it. Returns ``save_invstd``. With
    ``statistics`` (CUDA only: :func:`_bn_statistics`'s, which updated the running statistics) only the output is
    written, by the elementwise kernel ``native_batch_norm`` ends with (``batch_norm_elemt``)."""
    if statistics is not None:
        torch.batch_norm_elemt(x, weight, bias, *statistics, eps, out=x)
        return statistics[1]
    out = weight.new_empty(0), weight.new_empty(0)
    torch.ops.aten.native_batch_norm.out(x, weight, bias, running_mean, running_var, True, momentum, eps,
                                         out=x, save_mean=out[0], save_invstd=out[1])
    return out[1]


def _normalizer(mean: Tensor, invstd: Tensor) -> Callable[[Tensor], Tensor]:
    """``x -> (x - mean) * invstd`` per channel (dim 1) in ``x``'s dtype, in one pass and no op on the statistics:
    an inference-mode batch norm with ``invstd`` as its weight, ``mean`` as its running mean and a running variance
    of 0 beside an epsilon of 1, so that the variance's own factor, ``1 / sqrt(0 + 1)``, is exactly 1."""
    zeros = zeros_and_ones(tuple(mean.shape), mean)[0]
    return lambda x: torch.batch_norm(x, invstd, None, mean, zeros, False, 0.0, 1.0, torch.backends.cudnn.enabled)


def _dense_layout(t: Tensor) -> torch.memory_format:
    """The memory format ``t`` is dense in: row-major, else channels last (4-D) or channels last 3d (5-D) where it
    is that, else row-major."""
    if not t.is_contiguous():
        for ndim, layout in ((4, torch.channels_last), (5, torch.channels_last_3d)):
            if t.dim() == ndim and t.is_contiguous(memory_format=layout):
                return layout
    return torch.contiguous_format


def _bn_backward_from_x_hat(grad_out: Tensor, x_hat: Tensor, weight: Tensor | None, invstd: Tensor,
                            mask: list[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Training BatchNorm's ``(grad_x, grad_weight, grad_bias)`` (``mask`` says which) from the normalized input
    ``x_hat`` (``grad_out``'s dtype) and the per-channel ``invstd`` (the forward's statistics dtype): aten's
    backward of an input whose mean is 0 and invstd 1 (statistics of ``invstd``'s dtype, as aten's forward hands its
    backward), with ``weight * invstd`` as the weight, which scales only the input gradient: no pass over it
    afterwards. A weight of another dtype than the statistics (a bf16 model's, on a GPU) is passed as it is, and the
    input gradient scaled by ``invstd`` in place. No full-size fp32 copy is made (aten accumulates in fp32 inside its
    kernels), and ``grad_out`` is copied only where it is not dense in ``x_hat``'s layout (a channels-last model's
    gradient is, as aten's backward reads it)."""
    c = x_hat.shape[1]
    layout = _dense_layout(x_hat)
    if not grad_out.is_contiguous(memory_format=layout):
        grad_out = grad_out.contiguous(memory_format=layout)
    zeros, ones = zeros_and_ones((c,), invstd)
    folded = weight is None or weight.dtype == invstd.dtype
    scale = invstd if weight is None else weight * invstd if folded else weight
    grad_x, grad_w, grad_b = torch.ops.aten.native_batch_norm_backward(
        grad_out, x_hat, scale, None, None, zeros, ones, True, 0.0, mask)
    if grad_x is not None and not folded:
        in_place(grad_x, Tensor.mul_, invstd.view((1, c) + (1,) * (x_hat.dim() - 2)))
    return grad_x, grad_w, grad_b


#: Past this many input elements, BatchNorm's backward decodes its normalized input a slice of the batch at a time,
#: twice (for the per-channel sums, then for the input gradient; :func:`_bn_backward_by_items`), and never whole: at
#: resnet50's stage 1 the decoded input is one of the input-sized tensors its backward's highest point holds. Whole
#: all the same when the device has room for it (``ACT_HF_SLICING``, :func:`~act_hf._chunks.sliced_unless_room`).
BATCH_NORM_CHUNK_ELEMENTS = 1 << 26


def _bn_backward_by_items(grad_out: Tensor, packed: PackedTensor, weight: Tensor | None, invstd: Tensor,
                          mask: list[bool], chunks: list[tuple[int, int]]
                          ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`_bn_backward_from_x_hat` with the normalized input decoded a slice of the batch (``chunks``) at a
    time (:func:`~act_hf.compress.dequantize_items`): first the per-channel sums of ``grad_out`` and of
    ``grad_out * x_hat`` (the bias and weight gradients), in fp32 (fp64 for fp64), then each slice's input gradient
    ``weight * invstd * (grad_out - mean(grad_out) - x_hat * mean(grad_out * x_hat))``, laid into one tensor of
    ``grad_out``'s dtype and layout. On CUDA each slice is decoded in the gradient's dtype and runs aten's two
    kernels that ``native_batch_norm_backward`` splits into for SyncBatchNorm (``batch_norm_backward_reduce`` for
    the sums, ``batch_norm_backward_elemt`` for the input gradient; both accumulate in fp32 inside); elsewhere
    (aten has them for CUDA alone) the slice is decoded in fp32 and the formula runs as fp32 ops."""
    c, n = grad_out.shape[1], grad_out.numel() // max(grad_out.shape[1], 1)
    acc = torch.promote_types(grad_out.dtype, torch.float32)
    scale = invstd.to(acc) if weight is None else invstd.to(acc) * weight.to(acc)
    sum_dy = torch.zeros(c, dtype=acc, device=grad_out.device)
    sum_dy_xhat = torch.zeros_like(sum_dy)
    grad_x = torch.empty_like(grad_out) if mask[0] else None
    if _split_kernels(grad_out):
        zeros, ones = zeros_and_ones((c,), scale)  # x_hat's statistics: mean 0, invstd 1
        for start, stop in chunks:
            x_hat = dequantize_items(packed, start, stop, grad_out.dtype)
            dy, dy_xhat, _, _ = torch.batch_norm_backward_reduce(grad_out[start:stop], x_hat, zeros, ones, scale,
                                                                 True, False, False)
            sum_dy += dy
            sum_dy_xhat += dy_xhat
            del x_hat  # one slice decoded at a time
        if grad_x is not None:
            count = torch.full((1,), n, dtype=torch.int32, device=grad_out.device)
            for start, stop in chunks:
                x_hat = dequantize_items(packed, start, stop, grad_out.dtype)
                grad_x[start:stop] = torch.batch_norm_backward_elemt(grad_out[start:stop], x_hat, zeros, ones,
                                                                     scale, sum_dy, sum_dy_xhat, count)
                del x_hat
    else:
        dims = [0, *range(2, grad_out.dim())]
        channel = (1, c) + (1,) * (grad_out.dim() - 2)
        for start, stop in chunks:
            g = grad_out[start:stop]
            sum_dy += g.sum(dims, dtype=acc)
            sum_dy_xhat += dequantize_items(packed, start, stop, acc).mul_(g).sum(dims)
        if grad_x is not None:
            mean_dy, mean_dy_xhat = (sum_dy / n).view(channel), (sum_dy_xhat / n).view(channel)
            for start, stop in chunks:
                part = dequantize_items(packed, start, stop, acc).mul_(mean_dy_xhat).neg_()
                part.add_(grad_out[start:stop]).sub_(mean_dy).mul_(scale.view(channel))
                grad_x[start:stop] = part
                del part
    with_params = weight is not None
    return (grad_x, sum_dy_xhat if mask[1] and with_params else None, sum_dy if mask[2] and with_params else None)


#: Below this many values per channel, BatchNorm keeps its (small) normalized input exact.
MIN_VALUES_PER_CHANNEL = 32


def _bn_backward_whole(grad_out: Tensor, packed: PackedTensor | Tensor, weight: Tensor | None, invstd: Tensor,
                       mask: list[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`_bn_backward_from_x_hat` with the normalized input decoded whole, in the gradient's dtype."""
    x_norm = packed.to(grad_out.dtype) if isinstance(packed, Tensor) else dequantize(packed, grad_out.dtype)
    return _bn_backward_from_x_hat(grad_out, x_norm, weight, invstd, mask)


class ActBatchNormFunction(torch.autograd.Function):
    """Training-mode BatchNorm (any ``(N, C, *)``; running stats updated exactly as ``F.batch_norm``).

    Saves, when the input or the weight needs a gradient: ``quantize((x - mean) * invstd)``, the input
    normalized per channel (by the quantize kernel as it reads ``x``, in fp32, for a contiguous fp32 or bf16 input;
    otherwise made and packed a slice of the batch at a time, never whole:
    :meth:`~act_hf.context.ContextStore.compress_normalized`), with ``save_invstd`` (fp32, one per channel) and
    ``weight``. Backward decodes ``x_norm`` in the gradient's dtype and runs ``aten.native_batch_norm_backward`` on
    it as an input of mean 0 and invstd 1, then scales the input gradient by ``invstd``
    (:func:`_bn_backward_from_x_hat`). Quantizing the normalized input keeps the error relative to each channel's
    own spread: a quantization group spans many channels, and with the raw input a channel of small variance next to
    large ones got an error of the order of its whole spread, which the BN backward then amplifies by ``invstd``
    (seen at 8 bits: a ResNet downsample BN over 2 values per channel gave a gradient cosine of -0.87 with the raw
    input, 1.0 now). With fewer than ``MIN_VALUES_PER_CHANNEL`` values per channel (a 1x1 feature map at batch 2,
    say) the normalized input is kept exact: that tensor is small, and its statistics amplify any error. A bias-only
    gradient saves nothing. With ``note_output`` the output is noted as ``weight * x_norm + bias``
    (:func:`act_hf.derived.note_affine`), so a ReLU and a conv after it can read the packed ``x_norm``.
    With ``in_place`` (a caller that owns ``x``: nothing reads it after this call; :func:`writes_in_place`
    holds) the statistics are taken first, ``x_norm`` packed from ``x``, and the output written into ``x``
    (:func:`_bn_forward_into`; on CUDA from those statistics, so that ``x`` is read for them once, as the
    unpatched module reads it), which is returned: a conv's output and BatchNorm's are never alive together.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                running_var: Tensor | None, momentum: float, eps: float, settings: OpSettings,
                note_output: bool = False, in_place: bool = False) -> Tensor:
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not in_place:
            y, mean, invstd = _bn_forward(x, weight, bias, running_mean, running_var, momentum, eps)
        elif need_x or need_w:  # statistics to pack with, read first (on CUDA also the output's)
            mean, invstd = _bn_statistics(x, eps, weight.dtype, running_mean, running_var, momentum)
        ctx.shape = x.shape
        if need_x or need_w:
            normalized = _normalizer(mean, invstd)
            if x.numel() < MIN_VALUES_PER_CHANNEL * x.shape[1]:
                # statistics over a handful of values amplify any error: keep this small tensor exact
                packed = normalized(x)
            else:  # never made whole, a full-size temporary at the widest layers (contiguous fp32, bf16: not a slice)
                packed = store.compress_normalized(x, mean, invstd, settings,
                                                   lambda start, stop: normalized(x[start:stop]))
                if note_output:  # noted by act_batch_norm once y has its autograd node (note_pending)
                    ctx.act_affine = (packed, weight, bias, settings.slot)
        else:
            packed = None
        if in_place:
            statistics = (mean, invstd) if _split_kernels(x) and (need_x or need_w) else None
            invstd = _bn_forward_into(x, weight, bias, running_mean, running_var, momentum, eps, statistics)
            ctx.mark_dirty(x)
            y = x
        if packed is None:
            save_context(ctx, None, None, None)
        else:
            save_context(ctx, packed, invstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, invstd, weight = load_context(ctx)
        shape = ctx.shape
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if packed is None:
            if need_b:
                grad_b = grad_out.reshape(shape[0], shape[1], -1).float().sum((0, 2))
            return grad_x, grad_w, grad_b, None, None, None, None, None, None, None
        mask = [need_x, need_w and weight is not None, need_b and weight is not None]
        sliceable = (isinstance(packed, PackedTensor) and grad_out.numel() > BATCH_NORM_CHUNK_ELEMENTS
                     and items_decodable(packed))
        chunks = list(row_spans(grad_out, BATCH_NORM_CHUNK_ELEMENTS)) if sliceable else [(0, shape[0])]
        # whole: the decoded input, the input gradient and aten's temporaries beside them
        grad_x, grad_w, grad_b = sliced_unless_room(
            chunks, shape[0], grad_out.device, 3 * grad_out.numel() * grad_out.element_size(),
            lambda spans: _bn_backward_by_items(grad_out, packed, weight, invstd, mask, spans) if len(spans) > 1
            else _bn_backward_whole(grad_out, packed, weight, invstd, mask))
        if grad_b is None and need_b:
            grad_b = grad_out.reshape(shape[0], shape[1], -1).float().sum((0, 2))
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def act_batch_norm(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None,
                   bias: Tensor | None, momentum: float, eps: float, settings: OpSettings, *,
                   note_output: bool = False, input_owned: bool = False) -> Tensor:
    """Training-mode ``F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)`` with a
    quantized saved input (ActNN form). Same argument order as ``F.batch_norm`` minus ``training``; with
    ``note_output`` a conv after a ReLU after it reads that input (see :mod:`act_hf.derived`). With
    ``input_owned`` (the caller's promise that nothing reads ``x`` after this call) the output is written into
    ``x`` where :func:`writes_in_place` allows, and ``x`` returned."""
    in_place = input_owned and writes_in_place(x, weight, bias, running_mean, running_var, eps)
    y = ActBatchNormFunction.apply(x, weight, bias, running_mean, running_var, momentum, eps, settings, note_output,
                                   in_place)
    note_pending(y)
    return y


def apply_activation(y: Tensor, activation: str, param: float, inplace: bool = False) -> Tensor:
    """The fused op's activation (``identity``, ``leaky_relu`` or ``elu``) applied to a BatchNorm output (written
    into it with ``inplace``: the same kernel, the same bits)."""
    if activation == "leaky_relu":
        return F.leaky_relu(y, param, inplace=inplace)
    if activation == "elu":
        return F.elu(y, param, inplace=inplace)
    return y


class ActBatchNormActFunction(torch.autograd.Function):
    """Training-mode BatchNorm followed by an invertible activation (In-Place ABN), compressed context.

    ``z = act(batch_norm(x))`` with ``act`` in :data:`ACTIVATIONS` (``leaky_relu`` with slope > 0, ``elu``
    with alpha > 0, or ``identity``). Saves, when the input or the weight needs a gradient: ``quantize(z)`` of
    the returned tensor, ``save_invstd`` (fp32, one per channel), ``weight`` and ``bias``; for ``leaky_relu``
    and ``elu`` also the sign of ``z`` packed at 1 bit per element (stochastic rounding flips small ``z`` across
    0, where the derivative jumps: without the exact sign the 8-bit input gradient was at 14 dB instead of 30+).
    A bias-only gradient saves just the sign bits. With ``note_output`` the output is noted as
    ``dequantize(packed z)`` (:func:`act_hf.derived.note_affine`, no weight, no bias), so a residual add of it
    (timm's downsample ``BatchNormAct2d``) can be read from that packed copy. With ``in_place`` (a caller that
    owns ``x``; :func:`writes_in_place` holds) BatchNorm's output is written into ``x``
    (:func:`_bn_forward_into`), then the activation's (in place: the same kernel, the same bits), and ``x``
    returned; the store's copy of it is restamped once autograd has bumped its version
    (:meth:`~act_hf.context.ContextStore.follow_dirty_bump`, in :func:`act_batch_norm_act`).
    Backward inverts the activation (``bn = z`` / ``z / slope`` / ``alpha * log1p(z / alpha)``), takes its
    derivative from ``z`` and recovers ``x_hat = (bn - beta) / gamma``.

    Note: the negative branch of ``leaky_relu`` divides the quantization noise of ``z`` by the slope. Measured at
    8 bits (3x5x4x4): input-gradient SQNR 45.6 dB for slope 0.1 but 26.1 dB for 0.01 (In-Place ABN was designed
    for an exact ``z``). timm's ``BatchNormAct2d`` therefore never fuses a leaky ReLU (see
    :func:`act_hf.nn.norm._fusable_activation` for the measured whole-model figures).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                running_var: Tensor | None, momentum: float, eps: float, activation: str, param: float,
                settings: OpSettings, note_output: bool = False, in_place: bool = False) -> Tensor:
        if in_place:
            invstd = _bn_forward_into(x, weight, bias, running_mean, running_var, momentum, eps)
            ctx.mark_dirty(x)
            y = x
        else:
            y, _, invstd = _bn_forward(x, weight, bias, running_mean, running_var, momentum, eps)
        z = apply_activation(y, activation, param, inplace=in_place)  # the sign of z is y's: both activations
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.meta = (x.shape, x.dtype, activation, param)
        # the sign of z, exactly: rounding can flip small z across 0, where the derivative jumps
        mask = None
        if activation != "identity" and (need_x or need_w or need_b):
            mask = _pack_codes(y > 0, 1, settings.slot, original_nbytes=0)
        if need_x or need_w:
            packed = store.compress_as(z, settings)
            save_context(ctx, packed, mask, invstd, weight, bias)
            if note_output:  # noted by act_batch_norm_act once z has its autograd node
                ctx.act_affine = (packed, None, None, settings.slot)
        else:
            save_context(ctx, None, mask, None, None, None)
        return z

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        packed, mask, invstd, weight, bias = load_context(ctx)
        shape, dtype, activation, param = ctx.meta
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        c = shape[1]
        stats = (1, c) + (1,) * (len(shape) - 2)
        g = grad_out
        if mask is not None:
            pos = unpack_mask(mask, shape)
        if activation == "leaky_relu":
            g = torch.where(pos, g, g * param)
        if packed is None:  # bias gradient only
            grad_b = g.float().sum([d for d in range(len(shape)) if d != 1]).to(bias.dtype) if need_b else None
            return (None, None, grad_b) + (None,) * 9
        if activation == "identity" and packed.spec.memory_order is None:
            # x_hat = z * (1 / gamma) - beta / gamma, decoded, mapped and rounded to g's dtype in one pass
            x_hat = dequantize_mapped(packed, *_inverse_affine(weight, bias, c, g), dtype=g.dtype)
        else:
            z = dequantize(packed, torch.float32)  # this backward's own tensor: inverted in place into x_hat
            if activation == "leaky_relu":
                z.div_(torch.where(pos, 1.0, param))
            elif activation == "elu":
                z = torch.where(pos, z.clamp_min(0), z.clamp_max(0))
                g = torch.where(pos, g, g * (z + param).clamp_min(0).to(g.dtype))
                z = torch.where(pos, z, param * torch.log1p((z / param).clamp_min(-1 + 1e-6)))
            _undo_affine_(z, None if weight is None else weight.float(), None if bias is None else bias.float(),
                          view=stats)
            x_hat = z.to(g.dtype)
            del z
        grad_x, grad_w, grad_b = _bn_backward_from_x_hat(g, x_hat, weight, invstd,
                                                         [need_x, need_w, need_b and weight is not None])
        if grad_b is None and need_b:
            grad_b = g.float().sum([d for d in range(len(shape)) if d != 1])
        grad_x = grad_x.to(dtype) if need_x else None
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None


def act_batch_norm_act(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None,
                       bias: Tensor | None, momentum: float, eps: float, settings: OpSettings, *,
                       activation: str = "identity", param: float = 0.0,
                       gamma_eps: float = DEFAULT_GAMMA_EPS, cache_guard: bool = False,
                       note_output: bool = False, input_owned: bool = False) -> Tensor:
    """Training-mode ``act(F.batch_norm(...))`` saving only the quantized activation output (In-Place ABN).

    Args:
        x: ``(N, C, *)`` input.
        running_mean: running mean buffer (updated in place) or ``None``.
        running_var: running variance buffer or ``None``.
        weight: ``gamma`` or ``None``.
        bias: ``beta`` or ``None``.
        momentum: exponential average factor, as passed to ``F.batch_norm``.
        eps: epsilon.
        settings: slot, bits and group size of the saved tensor.
        activation: ``"identity"``, ``"leaky_relu"`` (``param`` = negative slope) or ``"elu"`` (``param`` =
            alpha).
        param: the activation's parameter.
        gamma_eps: relative ``|gamma|`` threshold; below it the op falls back to :func:`act_batch_norm` and the
            activation applied after it (the activation then saves its own context through autograd).
        cache_guard: cache the guard per weight version.
        note_output: note the output for residual sharing (:mod:`act_hf.derived`); with the fallback, BatchNorm's
            output.
        input_owned: the caller's promise that nothing reads ``x`` after this call: BatchNorm's output is then
            written into it where :func:`writes_in_place` allows.

    Returns:
        Exactly ``act(F.batch_norm(x, ...))``.

    Raises:
        ValueError: unknown ``activation`` or a non-positive slope/alpha.
    """
    check_activation(activation, param)
    if not output_context_safe(weight, gamma_eps=gamma_eps, cache=cache_guard):
        y = act_batch_norm(x, running_mean, running_var, weight, bias, momentum, eps, settings,
                           note_output=note_output, input_owned=input_owned)
        return apply_activation(y, activation, param)
    in_place = input_owned and writes_in_place(x, weight, bias, running_mean, running_var, eps)
    z = ActBatchNormActFunction.apply(x, weight, bias, running_mean, running_var, momentum, eps, activation,
                                      float(param), settings, note_output, in_place)
    if in_place:  # its output, packed as written inside the Function: the next op's input
        store.follow_dirty_bump(z, settings)
    note_pending(z)
    return z
