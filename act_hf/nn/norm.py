"""Drop-in normalization modules that save a compressed context (see :mod:`act_hf.ops.norm`).

Mixins go in front of the original class (``ActLayerNorm(ActLayerNormMixin, nn.LayerNorm)``) and rely only on
the original's attributes, so the patcher can attach them to transformers/timm classes with
:func:`act_hf.nn._base.act_class_for` without this module importing either library:

- :class:`ActLayerNormMixin`: ``nn.LayerNorm`` and subclasses whose forward is ``F.layer_norm`` (timm
  ``LayerNorm``); ``normalized_shape``, ``weight``, ``bias``, ``eps``.
- :class:`ActLayerNorm2dMixin`: timm ``LayerNorm2d`` (permute to NHWC, LayerNorm over C, permute back).
- :class:`ActRMSNormMixin`: HF ``LlamaRMSNorm``/``Qwen2RMSNorm``/``MistralRMSNorm`` (``"llama"``),
  ``T5LayerNorm`` (``"t5"``), ``GemmaRMSNorm`` (``"gemma"``), ``nn.RMSNorm`` (``"torch"``); reads ``weight`` and
  ``variance_epsilon`` or ``eps``; the style comes from ``act_rms_style``, which the patcher sets to the
  formula that reproduces the class's forward (:func:`matching_rms_style`); unset, :func:`infer_rms_style`
  guesses it from the name.
- :class:`ActBatchNormMixin`: ``nn.BatchNorm1d/2d/3d`` (ActNN input form).
- :class:`ActBatchNormActMixin`: a BatchNorm whose following invertible activation the patcher folds in
  (``act_activation``/``act_activation_param``); In-Place ABN output form.
- :class:`ActBatchNormAct2dMixin`: timm ``BatchNormAct2d`` (reads ``self.drop`` and ``self.act``).
- :class:`ActGRNMixin`: ConvNeXt V2's Global Response Norm (timm ``GlobalResponseNorm``, HF ``ConvNextV2GRN``),
  converted only when :func:`is_global_response_norm` confirms the formula (:mod:`act_hf.ops.grn`).

Knobs (class or instance attributes): ``act_norm_context`` in ``{"output", "input"}`` (default ``"output"`` for
LayerNorm/RMSNorm, measured in :mod:`act_hf.ops.norm`), ``act_gamma_eps`` (small-``|gamma|`` guard) and, for
the BatchNorm input form, ``act_share_bn_relu`` (let a conv after a ReLU read the packed input,
:mod:`act_hf.derived`).
``nn.SyncBatchNorm`` is not supported (its forward all-reduces statistics): a converted one runs its original
forward.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import Tensor, nn

from ..ops.grn import act_grn, grn_reference
from ..ops.norm import (
    DEFAULT_GAMMA_EPS,
    DEFAULT_NORM_CONTEXT,
    RMS_STYLES,
    act_batch_norm,
    act_batch_norm_act,
    act_layer_norm,
    act_rms_norm,
    apply_activation,
    check_activation,
    check_norm_context,
    check_rms_style,
    output_context_safe,
    rms_style_reproducing,
)
from ._base import ActModule, register_act_class
from .activation import _calls_only_forward, foreign_hooks, may_write_through
from .linear import ActConv2dSameMixin, ActConvMixin, ActStandardizedConvMixin

logger = logging.getLogger(__name__)

__all__ = [
    "ActBatchNorm1d",
    "ActBatchNorm2d",
    "ActBatchNorm3d",
    "ActBatchNormAct2dMixin",
    "ActBatchNormActMixin",
    "ActBatchNormMixin",
    "ActGRNMixin",
    "ActLayerNorm",
    "ActLayerNorm2dMixin",
    "ActLayerNormMixin",
    "ActRMSNorm",
    "ActRMSNormMixin",
    "infer_rms_style",
    "is_global_response_norm",
    "matching_rms_style",
    "norm_of_owned",
    "sequential_owning",
]


class _ActNormMixin(ActModule):
    """Shared knobs of the norm mixins."""

    act_norm_context: str = DEFAULT_NORM_CONTEXT
    act_gamma_eps: float = DEFAULT_GAMMA_EPS

    def _act_context(self) -> str:
        return check_norm_context(self.act_norm_context, "act_norm_context")


class ActLayerNormMixin(_ActNormMixin):
    """For ``nn.LayerNorm`` and subclasses computing ``F.layer_norm``: slot ``<path>:output`` or ``<path>:input``.

    timm's ``_fast_norm`` path (apex or forced fp32) keeps the original forward.
    """

    act_channel_scalable = True

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x) or getattr(self, "_fast_norm", False):
            return super().forward(x)
        context = self._act_context()
        return act_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, self.act_settings(context),
                              context=context, gamma_eps=self.act_gamma_eps, cache_guard=True)


class ActLayerNorm2dMixin(_ActNormMixin):
    """For timm ``LayerNorm2d`` (NCHW input, LayerNorm over channels); the saved output is the NCHW view the
    next op receives, so a following convolution at the same bits shares it."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x) or getattr(self, "_fast_norm", False):
            return super().forward(x)
        context = self._act_context()
        return act_layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps,
                              self.act_settings(context), context=context, gamma_eps=self.act_gamma_eps,
                              out_perm=(0, 3, 1, 2), cache_guard=True)


def infer_rms_style(module: nn.Module | type) -> str:
    """Guess :attr:`ActRMSNormMixin.act_rms_style` from the class (name only; no transformers import).

    ``nn.RMSNorm`` -> ``"torch"``; a class name containing ``T5`` -> ``"t5"``; ``Gemma`` -> ``"gemma"``; else
    ``"llama"``. Patchers should set the style explicitly per family; this is the fallback.
    """
    cls = module if isinstance(module, type) else type(module)
    original = getattr(cls, "act_original_class", None) or cls
    if issubclass(original, nn.RMSNorm):
        return "torch"
    name = original.__name__
    if "T5" in name:
        return "t5"
    if "Gemma" in name:
        return "gemma"
    return "llama"


def matching_rms_style(module: nn.Module, prefer: str | None = None) -> str | None:
    """The style whose formula reproduces ``module``'s own forward bit for bit, or ``None`` when none does.

    Class names mislead: Qwen3-Next's and T5Gemma's RMSNorms scale by ``1 + weight``, gated RMSNorms take two
    inputs, Cohere's subtracts the mean, and a wrong style would change the forward silently. So the original
    forward is run on probe rows (:func:`act_hf.ops.norm.rms_style_reproducing`), trying ``prefer``, then
    :func:`infer_rms_style`, then the other styles. Needs a 1-D ``weight`` tensor and a float
    ``variance_epsilon`` or ``eps``.
    """
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, Tensor) or weight.dim() != 1 or weight.is_meta or not isinstance(eps, float):
        return None
    original = getattr(type(module), "act_original_class", None) or type(module)
    candidates = dict.fromkeys([s for s in (prefer, infer_rms_style(module)) if s is not None] + list(RMS_STYLES))
    return rms_style_reproducing(lambda x: original.forward(module, x), weight, eps, candidates)


class ActRMSNormMixin(_ActNormMixin):
    """For RMSNorm-like modules with ``weight`` and ``variance_epsilon`` or ``eps``.

    Attributes:
        act_rms_style: ``"llama"``, ``"t5"``, ``"torch"`` or ``"gemma"`` (see :func:`act_hf.ops.norm.act_rms_norm`);
            must match the original class's formula, or the forward would change. ``None`` (default): guessed
            by :func:`infer_rms_style`.
    """

    act_rms_style: str | None = None
    act_channel_scalable = True

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        style = self.act_rms_style or infer_rms_style(self)
        check_rms_style(style, "act_rms_style")
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        context = self._act_context()
        return act_rms_norm(x, self.weight, eps, self.act_settings(context), style=style,
                            normalized_shape=getattr(self, "normalized_shape", None), context=context,
                            gamma_eps=self.act_gamma_eps, cache_guard=True)


def is_global_response_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a Global Response Norm (ConvNeXt V2) that :class:`ActGRNMixin` reproduces.

    Found by class name (``...GlobalResponseNorm``, ``...GRN``) with ``C``-element ``weight`` and ``bias``
    parameters, and confirmed by running a copy with random parameters on a float64 probe against
    :func:`act_hf.ops.grn.grn_reference` with the module's ``channel_dim`` (default -1) and ``eps`` (default
    1e-6): a class that computes anything else keeps its own forward.
    """
    name = type(module).__name__
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not (name.endswith(("GlobalResponseNorm", "GRN")) and isinstance(weight, nn.Parameter)
            and isinstance(bias, nn.Parameter) and weight.numel() == bias.numel() and not weight.is_meta):
        return False
    channel_dim, eps = getattr(module, "channel_dim", -1), getattr(module, "eps", 1e-6)
    if channel_dim not in (-1, 1, 3) or not isinstance(eps, float):
        return False
    probe = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (probe.weight, probe.bias):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        c = weight.numel()
        x = torch.randn((2, 3, 5, c) if channel_dim in (-1, 3) else (2, c, 3, 5), generator=g, dtype=torch.float64)
        try:
            out = type(probe).forward(probe, x)
        except Exception:  # noqa: BLE001 - not a one-input GRN
            return False
        expected = grn_reference(x, probe.weight, probe.bias, channel_dim, eps)
    return isinstance(out, Tensor) and out.shape == x.shape and torch.allclose(out, expected, rtol=1e-10, atol=1e-12)


class ActGRNMixin(ActModule):
    """For Global Response Norm modules (timm ``GlobalResponseNorm``, HF ``ConvNextV2GRN``): slot
    ``<path>:input`` (:func:`act_hf.ops.grn.act_grn`). Reads ``weight``, ``bias``, ``channel_dim`` (default
    -1) and ``eps`` (default 1e-6); the output is the original forward's."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_enabled(x):
            return super().forward(x)
        return act_grn(x, self.weight, self.bias, super().forward, self.act_settings("input"),
                       channel_dim=getattr(self, "channel_dim", -1), eps=getattr(self, "eps", 1e-6))


def _bn_args(bn: nn.Module):
    """The running buffers and averaging factor ``_BatchNorm.forward`` passes to ``F.batch_norm`` in training
    (updates ``num_batches_tracked`` exactly as it does)."""
    eaf = 0.0 if bn.momentum is None else bn.momentum
    if bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        eaf = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    track = bn.track_running_stats
    return (bn.running_mean if track else None), (bn.running_var if track else None), eaf


def _bn_supported(bn: nn.Module, x: Tensor) -> bool:
    if isinstance(bn, nn.SyncBatchNorm):
        return False
    if hasattr(bn, "_check_input_dim"):
        bn._check_input_dim(x)
    return True


class ActBatchNormMixin(_ActNormMixin):
    """For ``nn.BatchNorm1d/2d/3d`` in training mode: slot ``<path>:input`` (ActNN form; eval and no-grad run the
    original)."""

    act_norm_context: str = "input"
    act_share_bn_relu: bool = True

    def forward(self, x: Tensor, *, act_input_owned: bool = False) -> Tensor:
        """The module's own forward, saving the packed normalized input; with ``act_input_owned``
        (:func:`norm_of_owned`) the output is written into ``x`` where the op allows it."""
        if not self.act_enabled(x) or not _bn_supported(self, x):
            return super().forward(x)
        running_mean, running_var, eaf = _bn_args(self)
        return act_batch_norm(x, running_mean, running_var, self.weight, self.bias, eaf, self.eps,
                              self.act_settings("input"), note_output=self.act_share_bn_relu,
                              input_owned=act_input_owned)


def _output_is_fresh(producer: nn.Module) -> bool:
    """Whether ``producer(x)`` returns a tensor that nothing else holds: a conv running torch's own forward or a
    converted one (whose fallback is the original's), with no forward hook that could keep its output."""
    fresh = isinstance(producer, (ActConvMixin, ActConv2dSameMixin, ActStandardizedConvMixin)) \
        or type(producer).forward in (nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward)
    return fresh and not foreign_hooks(producer._forward_hooks)


def norm_of_owned(norm: nn.Module, x: Tensor, producer: nn.Module) -> Tensor:
    """``norm(x)`` for a caller that owns ``x``, the output of its submodule ``producer`` that the caller never
    reads again: a converted BatchNorm (:class:`ActBatchNormMixin`, :class:`ActBatchNormAct2dMixin`) writes
    its output into ``x`` (:func:`act_hf.ops.norm.writes_in_place` says where it can), so a conv's output and
    the BatchNorm's, a block's largest tensors, are never alive together; the values and gradients are
    ``norm(x)``'s. A producer whose output may be held elsewhere (:func:`_output_is_fresh`) or a hook that
    could see ``x`` or the output keeps the out-of-place call."""
    if isinstance(norm, (ActBatchNormMixin, ActBatchNormAct2dMixin)) and _output_is_fresh(producer) \
            and may_write_through(norm):
        return norm(x, act_input_owned=True)
    return norm(x)


def sequential_owning(seq: nn.Module, x: Tensor) -> Tensor:
    """``seq(x)``; for a plain ``nn.Sequential`` called as its ``forward`` alone (a ResNet's conv + BatchNorm
    downsample, timm's average-pool one), each module after the first handed its input to own
    (:func:`norm_of_owned`), as ``Sequential.forward`` never reads it again."""
    if type(seq) is not nn.Sequential or not _calls_only_forward(seq):
        return seq(x)
    producer = None
    for module in seq:
        x = module(x) if producer is None else norm_of_owned(module, x, producer)
        producer = module
    return x


class ActBatchNormActMixin(_ActNormMixin):
    """A BatchNorm with its following invertible activation folded in (In-Place ABN): slot ``<path>:output``.

    The patcher sets ``act_activation`` (``"identity"``, ``"leaky_relu"``, ``"elu"``) and
    ``act_activation_param`` (slope / alpha) and makes the original activation module an identity; forward is
    then ``act(batch_norm(x))`` exactly. ``act_norm_context="input"`` saves the BN input instead.
    """

    act_activation: str = "identity"
    act_activation_param: float = 0.0
    act_norm_context: str = "output"

    def forward(self, x: Tensor) -> Tensor:
        activation = check_activation(self.act_activation, self.act_activation_param, "act_activation")
        if not self.act_enabled(x) or not _bn_supported(self, x):
            return apply_activation(super().forward(x), activation, self.act_activation_param)
        running_mean, running_var, eaf = _bn_args(self)
        if self._act_context() == "input":
            y = act_batch_norm(x, running_mean, running_var, self.weight, self.bias, eaf, self.eps,
                               self.act_settings("input"))
            return apply_activation(y, activation, self.act_activation_param)
        return act_batch_norm_act(x, running_mean, running_var, self.weight, self.bias, eaf, self.eps,
                                  self.act_settings("output"), activation=activation,
                                  param=self.act_activation_param, gamma_eps=self.act_gamma_eps, cache_guard=True)


def _fusable_activation(module: nn.Module) -> tuple[str, float] | None:
    """``(activation, param)`` when ``module`` is an invertible activation the fused op handles well: identity and
    ELU. Not a leaky ReLU: inverting it divides the rounding noise of the negative outputs by the slope, and
    the input form loses little memory there (the conv after it reads BatchNorm's packed input,
    :mod:`act_hf.derived`). timm ``cspdarknet53`` (slope 0.01), 4 x 3 x 64 x 64, relative error of the whole
    gradient, output / input form: 8 bits 0.156 / 0.011, 3 bits 29.3 / 0.41 (3.02 / 3.40 MiB saved); with
    slope 0.1 at 3 bits 0.92 / 0.40. ELU stays fused: 3 bits 0.63 / 0.30 but 3.22 / 5.21 MiB, and 4 bits
    fused (0.29, 4.05 MiB) beat 3 bits unfused on both."""
    if isinstance(module, nn.Identity):
        return "identity", 0.0
    if isinstance(module, nn.ELU) and module.alpha > 0:
        return "elu", float(module.alpha)
    return None


class ActBatchNormAct2dMixin(_ActNormMixin):
    """For timm ``BatchNormAct2d`` (BatchNorm2d, then ``self.drop``, then ``self.act``).

    With ``drop`` an identity, ``act`` an ``nn.Identity``/``nn.ELU`` (see :func:`_fusable_activation`),
    ``act_norm_context="output"`` (default) and a ``gamma`` the output form accepts, the fused In-Place ABN op
    saves only the activation output (slot ``<path>:output``). Otherwise the BatchNorm saves its quantized input
    (slot ``<path>:input``) and ``drop``/``act`` run as modules (the patcher may convert ``act`` itself; a
    ReLU or leaky ReLU after it then saves a 1-bit code and the next conv reads BatchNorm's packed input).
    """

    act_norm_context: str = "output"
    act_share_bn_relu: bool = True

    def forward(self, x: Tensor, *, act_input_owned: bool = False) -> Tensor:
        """The module's own forward, saving a packed context; with ``act_input_owned`` (:func:`norm_of_owned`)
        BatchNorm's output is written into ``x`` where the op allows it."""
        if not self.act_enabled(x) or not _bn_supported(self, x):
            return super().forward(x)
        if x.ndim != 4:
            return super().forward(x)  # let the original raise its own error
        running_mean, running_var, eaf = _bn_args(self)
        fused = _fusable_activation(self.act) if isinstance(self.drop, nn.Identity) else None
        # the guard here, not only inside act_batch_norm_act: where it rejects gamma (zero-initialised last BN of a
        # residual block), self.act is the converted activation and saves its own code, not an fp32 input
        if (fused is not None and self._act_context() == "output"
                and output_context_safe(self.weight, gamma_eps=self.act_gamma_eps, cache=True)):
            return act_batch_norm_act(x, running_mean, running_var, self.weight, self.bias, eaf, self.eps,
                                      self.act_settings("output"), activation=fused[0], param=fused[1],
                                      gamma_eps=self.act_gamma_eps, cache_guard=True,
                                      note_output=self.act_share_bn_relu, input_owned=act_input_owned)
        y = act_batch_norm(x, running_mean, running_var, self.weight, self.bias, eaf, self.eps,
                           self.act_settings("input"), note_output=self.act_share_bn_relu,
                           input_owned=act_input_owned)
        return self.act(self.drop(y))


class ActLayerNorm(ActLayerNormMixin, nn.LayerNorm):
    """``nn.LayerNorm`` saving its quantized output (or input) for backward."""


class ActRMSNorm(ActRMSNormMixin, nn.RMSNorm):
    """``nn.RMSNorm`` saving its quantized output (or input) for backward."""

    act_rms_style = "torch"


class ActBatchNorm1d(ActBatchNormMixin, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` saving its quantized input for backward."""


class ActBatchNorm2d(ActBatchNormMixin, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` saving its quantized input for backward."""


class ActBatchNorm3d(ActBatchNormMixin, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` saving its quantized input for backward."""


register_act_class(nn.LayerNorm, ActLayerNormMixin, ActLayerNorm)
register_act_class(nn.RMSNorm, ActRMSNormMixin, ActRMSNorm)
register_act_class(nn.BatchNorm1d, ActBatchNormMixin, ActBatchNorm1d)
register_act_class(nn.BatchNorm2d, ActBatchNormMixin, ActBatchNorm2d)
register_act_class(nn.BatchNorm3d, ActBatchNormMixin, ActBatchNorm3d)
