"""What every Hugging Face family shares: HF activation classes, GPT-2's Conv1D, RMSNorm classes found by
name, the task head, switching the model's attention implementation to act_hf's, and the causal-LM loss that
recomputes its logits (:mod:`act_hf.ops.loss`)."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings

import torch
import torch.nn.functional as F
import transformers
from packaging import version
from torch import nn
from transformers import activations as hf_act
from transformers.pytorch_utils import Conv1D, apply_chunking_to_forward

from act_hf.config import ActConfig
from act_hf.errors import ActHFWarning
from act_hf.nn._base import ActModule
from act_hf.nn.activation import (
    ActActivationMixin,
    _calls_only_forward,
    _hooks_could_see,
    activation_of_owned,
    output_is_owned,
)
from act_hf.nn.linear import ActLinearMixin
from act_hf.ops.activation import gelu_inplace, gelu_tanh_inplace, silu_inplace
from act_hf.ops.loss import HeadLossScope, cast_head_input, causal_lm_loss, note_head_output, output_embeddings
from act_hf.ops.product import act_product
from act_hf.patcher import (
    Rule,
    add_cleanup,
    code_fingerprint,
    hf_head_paths,
    is_selected,
    patch_modules,
    remove_handles,
)

__all__ = ["DENSE_ACT_DENSE_FORWARD", "FC_MLP_FORWARD", "FEED_FORWARD_CHUNK", "GATED_ACT_DENSE_FORWARD",
           "GATED_MLP_FORWARD", "HF_ACTIVATIONS", "INTERMEDIATE_FORWARD", "RESIDUAL_OUTPUT_FORWARD",
           "ActDenseActDenseMixin", "ActFcMLPMixin", "ActFeedForwardChunkMixin", "ActGatedActDenseMixin",
           "ActGatedMLPMixin", "ActHFGELUMixin", "ActHFGELUTanhMixin", "ActHFNewGELUMixin", "ActHFSiLUMixin",
           "ActIntermediateMixin", "disable_training_cache", "enable_lm_loss", "hf_rules",
           "new_gelu_with_one_temporary", "patch_hf", "rms_norm_rule"]

logger = logging.getLogger(__name__)

MIN_TRANSFORMERS_VERSION = "4.48"
if version.parse(transformers.__version__) < version.parse(MIN_TRANSFORMERS_VERSION):
    raise ImportError(
        f"act_hf's Hugging Face patches need transformers >= {MIN_TRANSFORMERS_VERSION}, "
        f"found {transformers.__version__}"
    )

#: transformers activation classes -> the few-bit derivative table of the function each computes.
HF_ACTIVATIONS: dict[type, str] = {
    hf_act.GELUActivation: "gelu",  # also with use_gelu_python: the module's own forward runs, same function
    hf_act.NewGELUActivation: "gelu_tanh",
    hf_act.FastGELUActivation: "gelu_tanh",
    hf_act.GELUTanh: "gelu_tanh",
    hf_act.QuickGELUActivation: "quick_gelu",
    hf_act.SiLUActivation: "silu",
    hf_act.MishActivation: "mish",
}


class ActHFGELUMixin(ActActivationMixin):
    """transformers' ``GELUActivation``, whose in-place form is ``aten::gelu_`` when it calls ``F.gelu`` (not with
    ``use_gelu_python``)."""

    def act_inplace_forward(self):
        return gelu_inplace if getattr(self, "act", None) is F.gelu else None


class ActHFGELUTanhMixin(ActActivationMixin):
    """transformers' ``GELUTanh`` (``gelu_pytorch_tanh``: Gemma's gated MLPs), whose in-place form is ``aten::gelu_``
    of the tanh form when it calls ``F.gelu(approximate="tanh")`` (not with ``use_gelu_tanh_python``)."""

    def act_inplace_forward(self):
        act = getattr(self, "act", None)
        calls_gelu = isinstance(act, functools.partial) and act.func is F.gelu and not act.args \
            and act.keywords == {"approximate": "tanh"}
        return gelu_tanh_inplace if calls_gelu else None


class ActHFSiLUMixin(ActActivationMixin):
    """transformers' ``SiLUActivation`` (``F.silu``), whose in-place form is ``F.silu(x, inplace=True)``."""

    def act_inplace_forward(self):
        return silu_inplace


def new_gelu_with_one_temporary(x: torch.Tensor) -> torch.Tensor:
    """``NewGELUActivation``'s ``0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3.0))))`` (GPT-2's
    ``gelu_new``), bit for bit: the same ops on the same operands in the same order, each written into the one
    temporary ``torch.pow`` makes (in autocast's dtype: fp32 on CUDA, ``x``'s on the CPU), which is also the result's
    dtype; only the operands of ``+`` and ``*`` are swapped, and both commute. Beside ``x`` a call holds that
    temporary and ``0.5 * x``, where the formula held three temporaries (``0.5 * x`` and two steps of the chain;
    under CUDA autocast the two are fp32). For autocast on the CPU and CUDA (whose policies leave ``mul``, ``add``
    and ``tanh`` alone) and without autocast."""
    t = torch.pow(x, 3.0)
    t.mul_(0.044715).add_(x).mul_(math.sqrt(2.0 / math.pi)).tanh_().add_(1.0)
    return t.mul_(0.5 * x)


class ActHFNewGELUMixin(ActActivationMixin):
    """transformers' ``NewGELUActivation``, its formula computed by :func:`new_gelu_with_one_temporary` where
    autocast's policy is known (off, or on the CPU or CUDA)."""

    def act_output_fn(self, x: torch.Tensor):
        if torch.is_autocast_enabled(x.device.type) and x.device.type not in ("cpu", "cuda"):
            return super().act_output_fn(x)
        return new_gelu_with_one_temporary


class ActIntermediateMixin(ActModule):
    """An HF MLP's first half, ``intermediate_act_fn(dense(x))`` (BERT's ``BertIntermediate`` and every copy of
    it), with the activation written into the linear's output (:func:`activation_of_owned`): the widest two
    tensors of a transformer layer's forward are never alive together (also in a packed checkpoint's first pass,
    :meth:`~act_hf.nn._base.ActModule.act_owns_intermediates`). The rule converts a module only when its
    ``forward`` is that code (:data:`INTERMEDIATE_FORWARD`); its submodules are converted by their own rules."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.act_owns_intermediates(hidden_states):
            return super().forward(hidden_states)
        return activation_of_owned(self.intermediate_act_fn, self.dense(hidden_states), self.dense)


#: :func:`code_fingerprint` of ``BertIntermediate.forward`` and its copies (RoBERTa, ELECTRA, ...; transformers 5.x).
INTERMEDIATE_FORWARD = "ac09a89f37fa3cb8"


class ActFeedForwardChunkMixin(ActModule):
    """An HF encoder layer's ``feed_forward_chunk`` (BERT's ``BertLayer`` and its copies: RoBERTa, ELECTRA,
    CamemBERT, ...) computing what it computes, ``output(intermediate(x), x)`` with the output module's
    ``LayerNorm(dropout(dense(h)) + x)``, but with the intermediate tensor ``h``, a layer's widest (4x the hidden
    size), freed once ``output.dense`` has read it. HF's method holds it (its local, and the output module's call
    arguments) until the output's LayerNorm returns, beside the residual sum and the LayerNorm's output: it was
    alive at bert-large's highest point with packed checkpointed layers (see Results). Runs in training mode, with
    autograd on or off (a checkpoint's first pass), while calling the output module is its ``forward`` alone (no
    hooks, no tracing) and that ``forward`` is the code this reproduces (:data:`RESIDUAL_OUTPUT_FORWARD`);
    otherwise, and in eval mode, HF's method runs. The rule converts a layer whose ``feed_forward_chunk`` is that
    code (:data:`FEED_FORWARD_CHUNK`).

    The residual sum is written into ``x`` when nothing else can read ``x`` (:meth:`act_sums_into_input`): HF's
    ``x + h`` is a third tensor of the residual stream's width beside ``x`` and the LayerNorm's output, all three
    alive while the LayerNorm runs (bert-large's highest point of a packed checkpoint's recomputation). In that
    recomputation the layer also takes its decoded input to own (:meth:`act_recompute_owned`), freed once the
    attention has read it."""

    def feed_forward_chunk(self, attention_output: torch.Tensor) -> torch.Tensor:
        out = self.output
        if not (self.training and _is_hf_code(out, ("Output",), RESIDUAL_OUTPUT_FORWARD) and _calls_only_forward(out)):
            return super().feed_forward_chunk(attention_output)
        hidden = self.intermediate(attention_output)
        hidden = out.dense(hidden)  # the intermediate's last reference goes here
        hidden = out.dropout(hidden)
        if not self.act_sums_into_input(attention_output, hidden):
            return out.LayerNorm(hidden + attention_output)
        total = attention_output.add_(hidden)  # x + h, bit for bit: the addition commutes
        del hidden
        return out.LayerNorm(total)

    def act_sums_into_input(self, x: torch.Tensor, h: torch.Tensor) -> bool:
        """Whether ``x + h`` may be written into ``x``, the layer's attention output: the sum has ``x``'s shape and
        dtype, ``x`` is a tensor of its own (not a view: HF's chunked feed-forward passes slices), no module hook
        could have kept it (it is the attention's output and the intermediate's input), and no op saved it for
        backward: while autograd records, the intermediate is act_hf's, whose linear saves a packed copy (or,
        needing no gradient, nothing); the attention's LayerNorm saves its output packed or its input."""
        if type(x) is not torch.Tensor or x._is_view() or x.is_leaf and x.requires_grad or x.shape != h.shape \
                or torch.result_type(x, h) != x.dtype or x.device != h.device:
            return False
        if _hooks_could_see(*self.modules()):
            return False
        inner = self.intermediate
        return not torch.is_grad_enabled() or (isinstance(inner, ActIntermediateMixin)
                                               and isinstance(inner.dense, ActLinearMixin))

    def act_takes_input_owned(self, args: tuple, kwargs: dict) -> bool:
        """Whether a packed checkpoint's recomputation may run this layer as :meth:`act_recompute_owned` with
        ``(hidden_states, *args)`` and ``kwargs``: training, no hook could see the call, the layer's ``forward`` is
        one of the codes that method reproduces (:data:`LAYER_FORWARDS`), called as transformers calls it (at most
        the three positional arguments after ``hidden_states``, its cache under that release's name)."""
        cache = _layer_forward_cache_name(type(self))
        return (cache is not None and self.training and len(args) <= 3 and _calls_only_forward(self)
                and not (set(LAYER_FORWARDS.values()) - {cache}) & kwargs.keys())

    def act_recompute_owned(self, box: list[torch.Tensor], attention_mask=None, encoder_hidden_states=None,
                            encoder_attention_mask=None, **kwargs):
        """The layer's ``forward`` on the one tensor in ``box``, taken out of it, for a packed checkpoint's
        recomputation (:mod:`act_hf.checkpoint`), where nothing else holds it: the attention is the last to read the
        layer's input, which then goes once the attention's LayerNorm has summed it, where transformers' forward
        (and its caller's arguments) held it through the feed-forward, a tensor of the stream's width at the highest
        point of bert-large's recomputation. The cache goes to the attention under the name the call gave it, as
        the forward passes it."""
        self_attention_output, _ = self.attention(box.pop(), attention_mask, **kwargs)
        attention_output = self_attention_output
        if self.is_decoder and encoder_hidden_states is not None:
            if not hasattr(self, "crossattention"):
                raise ValueError(
                    f"If `encoder_hidden_states` are passed, {self} has to be instantiated with cross-attention layers"
                    " by setting `config.add_cross_attention=True`"
                )
            cross_attention_output, _ = self.crossattention(self_attention_output, None, encoder_hidden_states,
                                                            encoder_attention_mask, **kwargs)
            attention_output = cross_attention_output
        return apply_chunking_to_forward(self.feed_forward_chunk, self.chunk_size_feed_forward, self.seq_len_dim,
                                         attention_output)


#: :func:`code_fingerprint` of ``BertLayer.forward`` and its copies (RoBERTa, ELECTRA, ...) that
#: :meth:`ActFeedForwardChunkMixin.act_recompute_owned` reproduces, and the keyword its cache goes by
LAYER_FORWARDS = {"d6bf7d614f3f616e": "past_key_values",  # transformers 5.17
                  "2f279cbeae83595e": "cache"}  # transformers 5.24


@functools.cache
def _layer_forward_cache_name(cls: type) -> str | None:
    """The cache keyword of ``cls``'s original ``forward`` when :data:`LAYER_FORWARDS` knows that code, else
    ``None`` (also for a forward whose source cannot be read)."""
    forward = getattr(getattr(cls, "act_original_class", None), "forward", None)
    try:
        return LAYER_FORWARDS.get(code_fingerprint(forward)) if forward is not None else None
    except (OSError, TypeError):
        return None


#: :func:`code_fingerprint` of ``BertLayer.feed_forward_chunk`` and its copies (transformers 5.x).
FEED_FORWARD_CHUNK = "3c43319abef78c8a"
#: :func:`code_fingerprint` of ``BertOutput.forward`` and its copies, ``LayerNorm(dropout(dense(h)) + x)``
#: (transformers 5.x).
RESIDUAL_OUTPUT_FORWARD = "066e5aa2edf9e9d9"


class ActFcMLPMixin(ActModule):
    """An HF MLP ``fc2(activation_fn(fc1(x)))`` (CLIP's ``CLIPMLP``, ``ViTMLP``, BEiT's and every copy) with the
    activation written into ``fc1``'s output (:func:`activation_of_owned`). Converted only when its ``forward`` is
    that code (:data:`FC_MLP_FORWARD`); its submodules are converted by their own rules."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.act_owns_intermediates(hidden_states):
            return super().forward(hidden_states)
        return self.fc2(activation_of_owned(self.activation_fn, self.fc1(hidden_states), self.fc1))


#: :func:`code_fingerprint` of ``CLIPMLP.forward`` and its copies (transformers 5.x).
FC_MLP_FORWARD = "371607dd9de69485"


def _to_wo_dtype(hidden_states: torch.Tensor, wo: nn.Module) -> torch.Tensor:
    """T5's cast of the feed-forward's product to ``wo``'s weight dtype (kept fp32 for 8-bit flan-T5-XXL), unless
    that weight is int8."""
    weight = wo.weight
    if isinstance(weight, torch.Tensor) and hidden_states.dtype != weight.dtype and weight.dtype != torch.int8:
        return hidden_states.to(weight.dtype)
    return hidden_states


class ActGatedMLPMixin(ActModule):
    """A gated MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (LLaMA's, and the same code in Mistral,
    Qwen2/3, Gemma 1/2/3, OLMo 1/2, Granite, Cohere, StableLM, SmolLM3, Helium, Exaone 4, Qwen2-MoE's experts...,
    the families act_hf has and the generic fallback alike) whose product keeps both operands packed (slots
    ``<path>:gate_act`` and ``<path>:up``). The activation writes into ``gate_proj``'s output and the product into
    the activation's (:func:`activation_of_owned`, ``act_product(into_a=True)``) where nothing else can hold them:
    of the four intermediate-width tensors, at most two are alive at once. The rule converts an MLP only when its
    ``forward`` is that code (:data:`GATED_MLP_FORWARD`); the submodules are converted by their own rules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.act_owns_intermediates(x):
            return super().forward(x)
        owned = output_is_owned(self.act_fn)
        gate = activation_of_owned(self.act_fn, self.gate_proj(x), self.gate_proj)
        return self.down_proj(act_product(gate, self.up_proj(x), self.act_settings("gate_act"),
                                          self.act_settings("up"), into_a=owned))


#: :func:`code_fingerprint` of ``LlamaMLP.forward`` and its copies (transformers 5.x).
GATED_MLP_FORWARD = "5b8abf7af12a4b42"


class ActGatedActDenseMixin(ActModule):
    """T5's gated feed-forward, ``wo(dropout(act(wi_0(x)) * wi_1(x)))`` (flan-T5, mT5, UMT5, ...), its product through
    :func:`act_product`: both operands packed (slots ``<path>:gate_act`` and ``<path>:up``), where autograd's ``mul``
    kept both at full width; the activation written into ``wi_0``'s output and the product into the activation's
    where nothing else can hold them (:func:`activation_of_owned`). T5's cast before ``wo`` as in its forward. The
    rule converts a module only when its ``forward`` is that code (:data:`GATED_ACT_DENSE_FORWARD`)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.act_owns_intermediates(hidden_states):
            return super().forward(hidden_states)
        owned = output_is_owned(self.act)
        gate = activation_of_owned(self.act, self.wi_0(hidden_states), self.wi_0)
        hidden_states = act_product(gate, self.wi_1(hidden_states), self.act_settings("gate_act"),
                                    self.act_settings("up"), into_a=owned)
        return self.wo(_to_wo_dtype(self.dropout(hidden_states), self.wo))


#: :func:`code_fingerprint` of ``T5DenseGatedActDense.forward`` and its copies (mT5, UMT5, UDOP, Pix2Struct,
#: Pop2Piano; transformers 5.x).
GATED_ACT_DENSE_FORWARD = "52ee87e30f51f8b9"


class ActDenseActDenseMixin(ActModule):
    """T5's feed-forward, ``wo(dropout(act(wi(x))))`` (T5 v1.0, mT5, UMT5, LongT5, Switch Transformers' dense
    layers, ...), its activation written into ``wi``'s output (:func:`activation_of_owned`; ReLU in place). T5's cast
    before ``wo`` as in its forward. The rule converts a module only when its ``forward`` is that code
    (:data:`DENSE_ACT_DENSE_FORWARD`)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.act_owns_intermediates(hidden_states):
            return super().forward(hidden_states)
        hidden_states = self.dropout(activation_of_owned(self.act, self.wi(hidden_states), self.wi))
        return self.wo(_to_wo_dtype(hidden_states, self.wo))


#: :func:`code_fingerprint` of ``T5DenseActDense.forward`` and its copies (transformers 5.x).
DENSE_ACT_DENSE_FORWARD = "23f62776ca1b4a78"


def _is_hf_code(m: nn.Module, suffixes: tuple[str, ...], code: str, method: str = "forward") -> bool:
    """A transformers class named ``*<suffix>`` whose ``method`` has :func:`code_fingerprint` ``code``."""
    cls = type(m)
    return cls.__name__.endswith(suffixes) and cls.__module__.startswith("transformers.") \
        and callable(getattr(cls, method, None)) and code_fingerprint(getattr(cls, method)) == code


#: transformers activation classes with an in-place form or a cheaper way to the same output (the others get
#: ``ActActivationMixin``)
_HF_ACTIVATION_MIXINS = {hf_act.GELUActivation: ActHFGELUMixin, hf_act.SiLUActivation: ActHFSiLUMixin,
                         hf_act.NewGELUActivation: ActHFNewGELUMixin, hf_act.GELUTanh: ActHFGELUTanhMixin}


def _activation_rules() -> list[Rule]:
    return [
        Rule("activation", lambda m: type(m) in HF_ACTIVATIONS,
             lambda m: _HF_ACTIVATION_MIXINS.get(type(m), ActActivationMixin),
             attrs=lambda m, c: {"act_fn_name": HF_ACTIVATIONS[type(m)]}, bits=lambda c: c.derivative_bits),
        Rule("activation", lambda m: _is_hf_code(m, ("Intermediate",), INTERMEDIATE_FORWARD),
             lambda m: ActIntermediateMixin),
        Rule("activation", lambda m: _is_hf_code(m, ("MLP", "Mlp"), FC_MLP_FORWARD), lambda m: ActFcMLPMixin),
        Rule("activation", lambda m: _is_hf_code(m, ("GatedActDense",), GATED_ACT_DENSE_FORWARD),
             lambda m: ActGatedActDenseMixin),
        Rule("activation", lambda m: _is_hf_code(m, ("DenseActDense",), DENSE_ACT_DENSE_FORWARD),
             lambda m: ActDenseActDenseMixin),
        Rule("linear", lambda m: _is_hf_code(m, ("MLP",), GATED_MLP_FORWARD), lambda m: ActGatedMLPMixin),
    ]


def rms_norm_rule(prefer=lambda m: None) -> Rule:
    """RMSNorm classes of HF models (``LlamaRMSNorm``, ``GemmaRMSNorm``, ``T5LayerNorm``...), found by name and
    converted only when one of act_hf's formulas reproduces their forward bit for bit
    (:func:`act_hf.nn.norm.matching_rms_style`, tried first with ``prefer(module)``); any other keeps its own
    forward, uncompressed, with a warning."""
    from act_hf.nn import norm

    def match(m: nn.Module) -> bool:
        name = type(m).__name__
        if not ((name.endswith("RMSNorm") or name == "T5LayerNorm") and isinstance(getattr(m, "weight", None),
                                                                                   nn.Parameter)):
            return False
        if norm.matching_rms_style(m, prefer(m)) is not None:
            return True
        _warn_unreproduced(type(m), m.weight.is_meta)
        return False

    return Rule("norm", match, lambda m: norm.ActRMSNormMixin,
                attrs=lambda m, c: {"act_rms_style": norm.matching_rms_style(m, prefer(m)),
                                    "act_norm_context": c.norm_context})


def _warn_unreproduced(cls: type, meta: bool) -> None:
    why = ("its weight is on the meta device, so its formula cannot be checked (patch after the weights are "
           "loaded)" if meta else "none of act_hf's RMSNorm formulas reproduces its forward exactly")
    warnings.warn(f"act_hf leaves {cls.__name__} uncompressed: {why}", ActHFWarning, stacklevel=2)


def hf_rules() -> list[Rule]:
    """Rules every HF family uses in front of the generic torch ones (MobileNet V1 / V2's and BiT's conv layers
    among them: those models run on the generic fallback)."""
    from act_hf.nn import linear

    from .vision_hf import vision_conv_rules

    transposed_linear = Rule("linear", lambda m: type(m) is Conv1D, lambda m: linear.ActTransposedLinearMixin)
    feed_forward = Rule("linear", lambda m: _is_hf_code(m, ("Layer",), FEED_FORWARD_CHUNK, "feed_forward_chunk"),
                        lambda m: ActFeedForwardChunkMixin)
    return _activation_rules() + [transposed_linear, feed_forward] + vision_conv_rules()


def _enable_attention(model: nn.Module, config: ActConfig, head_paths: list[str]) -> list[str]:
    """Mark the selected attention modules and switch the model to act_hf's attention functions."""
    from . import _hf_attention

    modules = [(path, m) for path, m in _hf_attention.find_attention_modules(model)
               if is_selected(m, path, config, head_paths)]
    if not modules or not _hf_attention.enable(model):
        return []
    for path, module in modules:
        _hf_attention.mark(module, slot=path, bits=config.default_bits, group_size=config.group_size,
                           swap=config.swap)
        module.act_kind = "attention"

    add_cleanup(model, functools.partial(_disable_attention, model, [module for _, module in modules]))
    return [path for path, _ in modules]


def _disable_attention(model: nn.Module, modules: list[nn.Module]) -> None:
    from . import _hf_attention

    _hf_attention.disable(model)
    for module in modules:
        _hf_attention.unmark(module)
        module.__dict__.pop("act_kind", None)


def enable_lm_loss(model: nn.Module, config: ActConfig, *, cross_entropy_routed: bool = False) -> None:
    """Have an LM's loss recompute its logits from the head's input in backward (:mod:`act_hf.ops.loss`) when its
    logits come from an ``nn.Linear`` (:func:`_output_head`: ``lm_head``, a masked LM's decoder): the loss of a
    causal LM whose forward calls ``self.loss_function``, transformers' ``ForCausalLMLoss``, through
    :func:`act_hf.ops.loss.causal_lm_loss`; otherwise (T5, BART, BERT's masked LM compute their own)
    ``F.cross_entropy`` on the head's output rows, which a function mode routes: the generic fallback's
    (``cross_entropy_routed``) or a :class:`act_hf.ops.loss.HeadLossScope`'s. A head act_hf compresses
    (``exclude_head=False``) keeps its input packed; only ``ForCausalLMLoss`` is replaced then."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    head = _output_head(model)
    if not config.lm_loss_recompute or head is None:
        return
    if "loss_function" in inspect.unwrap(type(model).forward).__code__.co_names \
            and getattr(model, "loss_function", None) is ForCausalLMLoss:
        handles = [head.register_forward_hook(note_head_output)]
        model.loss_function = functools.partial(causal_lm_loss, ForCausalLMLoss)
    elif isinstance(head, ActModule):
        return  # the routed loss would keep the head's input whole beside its packed copy
    elif cross_entropy_routed:
        handles = [head.register_forward_hook(note_head_output)]
    else:
        scope = HeadLossScope()
        handles = [head.register_forward_hook(scope.enter),
                   model.register_forward_hook(scope.leave, always_call=True)]
    handles.append(head.register_forward_pre_hook(cast_head_input))
    add_cleanup(model, functools.partial(_restore_lm_loss, model, handles))


#: the keyword arguments that hand a model a cache of its own (transformers 5 calls it ``cache``)
_CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


def _no_training_cache(module: nn.Module, args: tuple, kwargs: dict, *, position: int) -> tuple[tuple, dict] | None:
    """A forward pre-hook: a training forward (the model in training mode, autograd recording) that does not ask
    for a cache (no ``use_cache``, no cache given) runs with ``use_cache=False``. ``position``: the first place
    among ``forward``'s arguments after ``self`` of ``use_cache`` or a cache; a call with more positional arguments
    than that (which may give one of them by position) is left alone."""
    if module.training and torch.is_grad_enabled() and len(args) <= position and kwargs.get("use_cache") is None \
            and all(kwargs.get(name) is None for name in _CACHE_ARGUMENTS):
        return args, {**kwargs, "use_cache": False}
    return None


def disable_training_cache(model: nn.Module) -> None:
    """Have a patched HF model build no KV cache in its training forwards unless the caller asks for one
    (``use_cache=True`` or a cache passed in). With ``config.use_cache`` on, transformers builds one in training
    too: it holds every layer's keys and values, full width, to the end of the forward and as long as the
    output is kept (``out = model(...); out.loss.backward()`` keeps it through backward), beside the packed
    copies act_hf saves (a LLaMA-style model of 8 layers, 256 wide, seq 256: forward's highest point 12.3 against
    9.1 MiB a sample on the CPU). The logits and the loss are the same bits; only the output's cache is then
    ``None``, as with transformers' own gradient checkpointing. One difference: where SDPA's backend follows the
    keys' layout, which the cache changes, its attention dropout draws other masks (GPT-2 with ``attn_pdrop > 0``,
    as the unpatched model does with ``use_cache=False``). Evaluation, ``torch.no_grad`` and ``generate`` are left
    alone. Models whose ``forward`` takes no ``use_cache``, or that have no config turning it on, get no hook."""
    parameters = list(inspect.signature(inspect.unwrap(type(model).forward)).parameters)
    if "use_cache" not in parameters or not getattr(getattr(model, "config", None), "use_cache", False):
        return
    earliest = min(parameters.index(name) for name in ("use_cache", *_CACHE_ARGUMENTS) if name in parameters)
    hook = functools.partial(_no_training_cache, position=earliest - 1)  # less ``self``
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    add_cleanup(model, functools.partial(remove_handles, [handle]))


def _output_head(model: nn.Module) -> nn.Linear | None:
    """The ``nn.Linear`` that makes the model's logits: its output embedding (``lm_head``; a masked LM's
    ``cls.predictions.decoder``), else an ``lm_head`` attribute; ``None`` if neither is an ``nn.Linear``."""
    head = output_embeddings(model)
    head = head if isinstance(head, nn.Linear) else getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Linear) else None


def _restore_lm_loss(model: nn.Module, handles: list) -> None:
    remove_handles(handles)
    model.__dict__.pop("_loss_function", None)


def _copy_of_view(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.requires_grad \
            and x.untyped_storage().nbytes() > 2 * x.numel() * x.element_size():
        return (x.clone(), *args[1:])
    return None


def _compact_head_inputs(model: nn.Module, head_paths: list[str]) -> None:
    """The uncompressed head's Linears save a copy of an input that is a small view of a larger tensor.

    BERT's pooler reads ``hidden_states[:, 0]``: the view its Linear saves keeps the whole last hidden state
    alive until backward (``seq`` times the bytes the Linear needs; with checkpointing and packed layer inputs
    it was a quarter of BERT-large's saved memory). The copy has the same values, so the gradient is unchanged.
    """
    handles = [m.register_forward_pre_hook(_copy_of_view) for path, m in model.named_modules()
               if isinstance(m, nn.Linear) and any(path == h or path.startswith(h + ".") for h in head_paths)]
    if handles:
        add_cleanup(model, functools.partial(remove_handles, handles))


def patch_hf(model: nn.Module, config: ActConfig, *, rules: list[Rule] = (), attention: bool = True,
             head_paths: list[str] | None = None) -> list[str]:
    """Patch an HF model: family ``rules``, then the HF and generic rules, then attention.

    Args:
        model: the HF model (any head).
        config: act_hf config.
        rules: the family's own rules, tried first.
        attention: switch the model to act_hf's attention function (models that dispatch on
            ``config._attn_implementation``).
        head_paths: modules left uncompressed with ``exclude_head``; default: everything outside the base model.
    """
    heads = hf_head_paths(model) if head_paths is None else head_paths
    patched = patch_modules(model, config, rules=list(rules) + hf_rules() + [rms_norm_rule()], head_paths=heads)
    if attention and "attention" in config.kinds:
        patched += [path for path in _enable_attention(model, config, heads) if path not in patched]
    enable_lm_loss(model, config)
    disable_training_cache(model)
    if config.exclude_head:
        _compact_head_inputs(model, heads)
    return patched
