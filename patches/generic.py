"""The generic fallback for models without a family: known leaf modules, plus saved-tensor hooks."""

from __future__ import annotations

import functools
import warnings

from torch import nn

from act_hf.config import ActConfig
from act_hf.errors import ActHFWarning
from act_hf.fallback import install_fallback_hooks
from act_hf.nn._base import ActModule
from act_hf.patcher import Rule, add_cleanup, patch_modules, remove_handles

__all__ = ["patch_generic"]

# Leaf modules that keep no activation context of their own (or only integer indices; adaptive-average pooling
# nothing at output size 1, its input at others, which the hooks then pack).
_CONTEXT_FREE = (nn.Identity, nn.Embedding, nn.Flatten, nn.Unflatten, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                 nn.AdaptiveAvgPool3d, nn.ReLU)


def _known_rules() -> list[Rule]:
    rules: list[Rule] = []
    try:
        from ._hf import hf_rules, rms_norm_rule

        rules += hf_rules() + [rms_norm_rule()]
    except ImportError:
        pass
    try:
        from .timm_models import timm_rules

        rules += timm_rules()
    except ImportError:
        pass
    try:
        from .torchvision_models import torchvision_rules

        rules += torchvision_rules()
    except ImportError:
        pass
    return rules


def _hf_model_hooks(model: nn.Module, config: ActConfig) -> None:
    """What the HF families do for a whole model. An HF causal LM's loss recomputes its logits
    (:mod:`act_hf.ops.loss`): its fp32 log-softmax is ``4 * V`` bytes a token, more than all the packed context of a
    small model. So does a cross-entropy on an ``lm_head``'s output rows that the model computes itself (BART,
    Marian, Pegasus), which the hooks' function mode routes. Training forwards build no KV cache unless asked
    (:func:`~act_hf.patches._hf.disable_training_cache`)."""
    try:
        from ._hf import disable_training_cache, enable_lm_loss
    except ImportError:
        return
    enable_lm_loss(model, config, cross_entropy_routed=config.fallback_hooks)
    disable_training_cache(model)


def _head_paths(model: nn.Module) -> list[str]:
    """The task head as the families find it: an HF model's modules outside its base model, a timm model's
    ``pretrained_cfg`` classifier."""
    from act_hf.patcher import hf_head_paths

    paths = hf_head_paths(model)
    try:
        from .timm_models import timm_head_paths

        paths += timm_head_paths(model)
    except ImportError:
        pass
    return list(dict.fromkeys(paths))


def patch_generic(model: nn.Module, config: ActConfig) -> list[str]:
    """Convert every known leaf module outside the task head (with ``config.exclude_head``); warn with the module
    types left uncompressed; hook the rest, the head and the loss after it excepted, and run the model's own
    ``F.scaled_dot_product_attention`` calls as act_hf's attention and its functional dropouts as act_hf's (when
    ``"attention"``, ``"dropout"`` are compressed kinds)."""
    heads = _head_paths(model) if config.exclude_head else []
    patched = patch_modules(model, config, rules=_known_rules(), head_paths=heads)
    _hf_model_hooks(model, config)
    kept = {id(m) for p in heads for m in model.get_submodule(p).modules()}  # exact by choice
    left = sorted({
        type(m).__name__
        for m in model.modules()
        if not isinstance(m, ActModule) and not list(m.children()) and not isinstance(m, _CONTEXT_FREE)
        and id(m) not in kept
    })
    hooks = config.fallback_hooks
    warnings.warn(
        f"act_hf has no family for {type(model).__name__}; patched {len(patched)} known modules. Module types it "
        f"could not compress: {left or 'none'}. "
        + ("The other tensors its forward saves are compressed through saved-tensor hooks." if hooks
           else "The other tensors its forward saves stay uncompressed (fallback_hooks=False)."),
        ActHFWarning,
        stacklevel=3,
    )
    if hooks:
        handles = install_fallback_hooks(model, bits=config.default_bits, group_size=config.group_size,
                                         swap=config.swap, heads=[model.get_submodule(p) for p in heads],
                                         route_sdpa="attention" in config.kinds,
                                         route_dropout="dropout" in config.kinds,
                                         route_loss=config.lm_loss_recompute,
                                         slot_bits=getattr(model, "act_hf_slot_bits", None))
        add_cleanup(model, functools.partial(remove_handles, handles))
        patched.append("<saved-tensor hooks>")
    return patched
