"""transformers attention functions ``"act_hf_sdpa"`` / ``"act_hf_eager"`` and per-model switching.

transformers (v5) attention modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
eager_attention_forward)`` and masks are built by ``ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]``.
:func:`register` adds both entries for both names (the mask entry is required: an implementation missing from
the mask interface gets *no* mask at all); :func:`enable` switches one model instance, by its config objects,
from ``"sdpa"`` to ``"act_hf_sdpa"`` and from ``"eager"`` to ``"act_hf_eager"``; :func:`disable` restores
what was there. ``config._attn_implementation_internal`` is never serialised by ``save_pretrained``, so a
saved config keeps no trace of act_hf.

The functions follow the original ones exactly and compress only when the module is training, grad is on and
the module was marked by the patcher (:func:`mark`: ``act_slot``, ``act_bits``, ``act_group_size``);
otherwise they call the original ``sdpa_attention_forward`` / the family's ``eager_attention_forward``.

Caveat for the patcher: a model whose modeling code compares ``config._attn_implementation == "sdpa"`` (or
``"eager"``) to choose a code path (older mask helpers, GPT-2's ``reorder_and_upcast_attn``) would take the
other branch after :func:`enable`; GPT-2 with ``reorder_and_upcast_attn=True`` is left on eager here.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import sys
import warnings
from collections.abc import Callable

import torch
from torch import nn

from act_hf.errors import ActHFRuntimeError, ActHFWarning
from act_hf.ops._saving import OpSettings
from act_hf.ops.attention import act_eager_attention, act_sdpa

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations import sdpa_attention as _sdpa_mod
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.utils.import_utils import is_torchdynamo_compiling
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(f"act_hf.patches._hf_attention needs transformers >= 5.0: {exc}") from exc

_MIN_TRANSFORMERS = (5, 0)
_found = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
if _found < _MIN_TRANSFORMERS:
    raise ImportError(
        f"act_hf needs transformers >= 5.0 for the attention interface, found {transformers.__version__}"
    )

__all__ = [
    "ACT_EAGER",
    "ACT_SDPA",
    "act_eager_attention_forward",
    "act_sdpa_attention_forward",
    "disable",
    "enable",
    "find_attention_modules",
    "is_enabled",
    "mark",
    "register",
    "unmark",
]

logger = logging.getLogger(__name__)

ACT_SDPA = "act_hf_sdpa"
ACT_EAGER = "act_hf_eager"
_SWITCH = {"sdpa": ACT_SDPA, "eager": ACT_EAGER}
_ORIGINAL_ATTR = "_act_hf_attn_original"
_MARK_ATTRS = ("act_slot", "act_bits", "act_group_size", "act_swap", "act_slot_bits")

sdpa_attention_forward = _sdpa_mod.sdpa_attention_forward
#: transformers < 5.24 updates a paged (continuous-batching) cache inside ``sdpa_attention_forward``; later
#: versions do it before the call and no longer import the class there
_PAGED_CACHE = getattr(_sdpa_mod, "PagedAttentionCache", None)
#: newer transformers (5.23 does, 5.17 does not) run a single query token's heads on the kv heads
#: (``pack_gqa``); older ones repeat k and v for it like for longer queries
_PACK_GQA = getattr(_sdpa_mod, "pack_gqa", None)
#: the helpers of ``transformers.integrations.sdpa_attention`` that :func:`act_sdpa_attention_forward` mirrors;
#: a transformers release without one of them keeps models on its own ``"sdpa"`` (uncompressed, with a warning)
_SDPA_HELPERS = ("use_gqa_in_sdpa", "create_position_bias_mask", "_is_torch_npu_available")
_SDPA_MISSING = tuple(name for name in _SDPA_HELPERS if not hasattr(_sdpa_mod, name))


def _compressing(module: nn.Module, *tensors: torch.Tensor | None) -> bool:
    if not hasattr(module, "act_bits") or not module.training:
        return False
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def _settings(module: nn.Module) -> OpSettings:
    base = getattr(module, "act_slot", "") or type(module).__name__
    bits = int(module.act_bits)
    return OpSettings(slot=base, bits=bits, group_size=int(getattr(module, "act_group_size", 256)),
                      swap=bool(getattr(module, "act_swap", False)),
                      slot_bits=getattr(module, "act_slot_bits", None))


def act_sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` with the attention op replaced by :func:`act_sdpa`.

    Same signature, same decisions (GQA via ``enable_gqa`` / ``pack_gqa`` / ``repeat_kv``, ``is_causal``,
    cache slicing, position bias, NPU mask conversion), same output layout (``transpose(1, 2).contiguous()``).
    ``repeat_kv`` is folded into :func:`act_sdpa` so k and v are saved before repetition.
    """
    position_bias = kwargs.get("position_bias")
    cache = kwargs.get("cache")
    if (
        not _compressing(module, query, key, value, position_bias)
        or (_PAGED_CACHE is not None and isinstance(cache, _PAGED_CACHE))
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kwargs.pop("position_bias", None)
    if kwargs.get("output_attentions", False):
        logger.warning("`sdpa` attention does not support `output_attentions=True`; use eager for attention maps.")

    enable_gqa = False
    n_rep = 1
    q_length = query.shape[2]
    if hasattr(module, "num_key_value_groups") and module.num_key_value_groups > 1:
        if _sdpa_mod.use_gqa_in_sdpa(attention_mask, key, value):
            enable_gqa = True
        elif q_length == 1 and _PACK_GQA is not None and not is_torchdynamo_compiling():
            query = _PACK_GQA(query, module.num_key_value_groups)
            attention_mask = _PACK_GQA(attention_mask, module.num_key_value_groups)
            position_bias = _PACK_GQA(position_bias, module.num_key_value_groups)
        else:
            n_rep = module.num_key_value_groups

    kv_length = key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if torch.jit.is_tracing() and isinstance(is_causal, torch.Tensor):
        is_causal = is_causal.item()
    if _sdpa_mod._is_torch_npu_available and attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = torch.logical_not(attention_mask.bool()).to(query.device)
    if is_causal and attention_mask is None and q_length > 1 and kv_length > q_length:
        key = key[:, :, :q_length, :]
        value = value[:, :, :q_length, :]
        if position_bias is not None:
            position_bias = position_bias[:, :, :, :q_length]
    if position_bias is not None:
        attention_mask = _sdpa_mod.create_position_bias_mask(position_bias, attention_mask, is_causal, query, key)
        is_causal = False

    attn_output = act_sdpa(query, key, value, attention_mask, dropout, is_causal, scaling, enable_gqa,
                           settings=_settings(module), repeat_kv=n_rep)
    attn_output = attn_output.reshape(attn_output.shape[0], -1, q_length, value.shape[-1])
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, None


@functools.cache
def _eager_style(module_cls: type) -> tuple[Callable | None, bool, bool, bool]:
    """The family's ``eager_attention_forward`` and how it computes: (fn, supported, repeats kv, fp32 softmax)."""
    modeling = sys.modules.get(module_cls.__module__)
    fn = getattr(modeling, "eager_attention_forward", None)
    if fn is None:
        return None, False, False, False
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return fn, False, False, False
    # Anything beyond the plain formula (soft-capping, sinks, head masks, biases...) stays on the original.
    unsupported = ("softcap", "sinks", "s_aux", "head_mask", "position_bias", "sliding_window", "tanh")
    supported = not any(word in src for word in unsupported) and "softmax(" in src
    return fn, supported, "repeat_kv(" in src, "dtype=torch.float32" in src


def act_eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's ``eager_attention_forward`` with the block replaced by :func:`act_eager_attention`.

    Matches ``matmul(q, k^T) * scaling (+ mask) -> softmax (fp32 where the family upcasts) -> dropout -> @ v ->
    transpose(1, 2).contiguous()``. The returned attention weights are not differentiable while compressing;
    eager functions with extras (soft-capping, sinks, ...) and ``output_attentions=True`` run the original.
    """
    eager_fn, supported, repeats, fp32_softmax = _eager_style(type(module))
    if eager_fn is None:
        raise ActHFRuntimeError(
            f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}; "
            f"attn_implementation={ACT_EAGER!r} cannot be used for this model"
        )
    if (
        not supported
        or kwargs.get("output_attentions", False)
        or not _compressing(module, query, key, value, attention_mask)
    ):
        return eager_fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    n_rep = getattr(module, "num_key_value_groups", 1) if repeats else 1
    attn_output, attn_weights = act_eager_attention(
        query, key, value, attention_mask, scaling=scaling, settings=_settings(module), dropout_p=dropout,
        training=module.training, softmax_dtype=torch.float32 if fp32_softmax else None, repeat_kv=n_rep,
    )
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


def register() -> None:
    """Register ``"act_hf_sdpa"`` / ``"act_hf_eager"`` in transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ACT_SDPA, act_sdpa_attention_forward)
    AttentionInterface.register(ACT_EAGER, act_eager_attention_forward)
    AttentionMaskInterface.register(ACT_SDPA, sdpa_mask)
    AttentionMaskInterface.register(ACT_EAGER, eager_mask)


def _configs(model: nn.Module) -> list:
    """Every config object of ``model``: its own, nested sub-configs, and those of sub-models."""
    found: dict[int, object] = {}
    pending = [getattr(model, "config", None)]
    pending += [getattr(m, "config", None) for m in model.modules()
                if m is not model and hasattr(m, "_can_set_attn_implementation")]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not hasattr(config, "_attn_implementation_internal"):
            continue
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            pending.append(getattr(config, key, None))
    return list(found.values())


def _isolate_configs(model: nn.Module) -> None:
    """Give ``model`` private copies of its config objects (models built from one config object share it).

    Every module attribute that refers to one of the configs (or a nested sub-config) is rebound to the copy,
    so only this instance sees the switched implementation.
    """
    configs = _configs(model)
    memo: dict[int, object] = {}
    for config in configs:
        copy.deepcopy(config, memo)
    mapping = {id(c): memo[id(c)] for c in configs}
    for module in model.modules():
        for name, value in list(vars(module).items()):
            new = mapping.get(id(value))
            if new is not None:
                module.__dict__[name] = new


def enable(model: nn.Module, *, isolate_config: bool = True) -> list[str]:
    """Switch this model instance's attention to act_hf (``sdpa`` -> ``act_hf_sdpa``, ``eager`` -> ``act_hf_eager``).

    The original implementations are remembered for :func:`disable`; calling twice is harmless. Attention
    modules compress only once :func:`mark` gave them a slot and bits.

    Args:
        model: a ``transformers.PreTrainedModel`` (or a module holding one).
        isolate_config: first give the model private copies of its config objects (rebinding every module's
            ``config`` attribute), so another model built from the same config object is not switched too.
            The copies stay after :func:`disable`.

    Returns:
        The implementations now in use, one per config switched.
    """
    register()
    originals = model.__dict__.get(_ORIGINAL_ATTR)
    if originals is None:
        if isolate_config:
            _isolate_configs(model)
        originals = []
        model.__dict__[_ORIGINAL_ATTR] = originals
    done = {id(c) for c, _ in originals}
    switched = []
    for config in _configs(model):
        if id(config) in done:
            continue
        current = config._attn_implementation
        target = _SWITCH.get(current)
        if target == ACT_EAGER and getattr(config, "reorder_and_upcast_attn", False):
            target = None  # GPT-2's upcast/reordered eager attention is chosen by `== "eager"`: keep it
        if target == ACT_SDPA and _SDPA_MISSING:
            warnings.warn(f"act_hf: transformers {transformers.__version__}'s sdpa_attention has no "
                          f"{', '.join(_SDPA_MISSING)}, which act_hf's SDPA attention mirrors: the attention of "
                          f"{type(config).__name__} stays on 'sdpa', uncompressed (the rest of the model is "
                          "compressed); attn_implementation='eager' compresses it", ActHFWarning, stacklevel=2)
            continue
        if target is None:
            if current not in (ACT_SDPA, ACT_EAGER):
                warnings.warn(f"act_hf: attention implementation {current!r} of {type(config).__name__} is not "
                              "compressed (only 'sdpa' and 'eager' are)", ActHFWarning, stacklevel=2)
            continue
        originals.append((config, current))
        config._attn_implementation_internal = target
        switched.append(target)
    return switched


def disable(model: nn.Module) -> None:
    """Restore the attention implementations :func:`enable` replaced (no-op if it was not enabled)."""
    for config, original in reversed(model.__dict__.pop(_ORIGINAL_ATTR, [])):
        config._attn_implementation_internal = original


def is_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable` switched some config of ``model``."""
    return bool(model.__dict__.get(_ORIGINAL_ATTR))


@functools.cache
def _uses_attention_interface(cls: type) -> bool:
    cls = getattr(cls, "act_original_class", None) or cls  # a family's mixin may call the original forward
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules whose ``forward`` dispatches through transformers' attention interface."""
    return [(name, m) for name, m in model.named_modules() if _uses_attention_interface(type(m))]


def mark(module: nn.Module, *, slot: str, bits: int, group_size: int = 256, swap: bool = False) -> nn.Module:
    """Give an attention module the slot base, bits, group size and swap the act_hf attention functions read."""
    module.act_slot = slot
    module.act_bits = bits
    module.act_group_size = group_size
    module.act_swap = swap
    return module


def unmark(module: nn.Module) -> nn.Module:
    """Undo :func:`mark`."""
    for attr in _MARK_ATTRS:
        module.__dict__.pop(attr, None)
    return module

