"""The engine: family registry, ``patch`` / ``unpatch``, module rules and target matching.

``patch(model)`` looks up the model's family (HF ``config.model_type``, or the timm model class), and the
family's function decides which module gets which act_hf behaviour, mostly by handing
:func:`patch_modules` a few family-specific :class:`Rule` objects in front of the generic ones. Modules are
converted in place (their class becomes an act_hf subclass of the original class), so parameters, buffers
and state-dict keys never change and ``unpatch`` restores the original classes exactly.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import logging
import re
import textwrap
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .config import ActConfig
from .errors import ActHFTypeError, ActHFValueError, ActHFWarning, NoMatchingModuleError
from .nn._base import ActModule, convert, revert

__all__ = [
    "PATCH_FUNCTIONS",
    "Rule",
    "callee",
    "code_fingerprint",
    "family_of",
    "generic_rules",
    "is_selected",
    "patch",
    "patch_modules",
    "register_patch",
    "same_forward",
    "unpatch",
]

logger = logging.getLogger(__name__)

PatchFunction = Callable[[nn.Module, ActConfig], list[str]]
#: family key -> patch function; HF keys are ``config.model_type``, timm keys ``"timm:<ClassName>"``.
PATCH_FUNCTIONS: dict[str, PatchFunction] = {}


def register_patch(*names: str) -> Callable[[PatchFunction], PatchFunction]:
    """Register a family patch function under one or more keys (lowercase HF model types or ``timm:Class``)."""

    def decorator(fn: PatchFunction) -> PatchFunction:
        for name in names:
            if not isinstance(name, str) or not name:
                raise ActHFValueError(f"family name must be a non-empty string, got {name!r}")
            if not name.startswith("timm:") and name != name.lower():
                raise ActHFValueError(f"HF family names are lowercase model types, got {name!r}")
            if name in PATCH_FUNCTIONS and PATCH_FUNCTIONS[name] is not fn:
                warnings.warn(f"act_hf family {name!r} was registered twice; the later one wins", ActHFWarning,
                              stacklevel=2)
            PATCH_FUNCTIONS[name] = fn
        return fn

    return decorator


def _load_families() -> None:
    from . import patches  # noqa: F401  (importing registers every family)


def family_of(model: nn.Module) -> str | None:
    """The registry key of ``model``: HF ``config.model_type``, or ``timm:<Class>`` for a timm model."""
    _load_families()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str) and model_type in PATCH_FUNCTIONS:
        return model_type
    for cls in type(model).__mro__:
        key = f"timm:{cls.__name__}"
        if cls.__module__.startswith("timm.") and key in PATCH_FUNCTIONS:
            return key
    return None


@dataclass
class Rule:
    """Which act_hf behaviour a kind of module gets.

    Attributes:
        kind: one of ``act_hf.config.ACT_KINDS``; the rule applies only if the config compresses that kind.
        match: ``fn(module) -> bool``.
        mixin: ``fn(module) -> type``, the act_hf mixin put in front of the module's class (imported lazily).
        attrs: ``fn(module, config) -> dict`` of extra attributes to set on the converted module.
        bits: ``fn(config) -> int``, the module's default bits (the allocator may override per slot).
    """

    kind: str
    match: Callable[[nn.Module], bool]
    mixin: Callable[[nn.Module], type]
    attrs: Callable[[nn.Module, ActConfig], dict[str, Any]] = field(default=lambda m, c: {})
    bits: Callable[[ActConfig], int] = field(default=lambda c: c.default_bits)


def same_forward(*bases: type) -> Callable[[nn.Module], bool]:
    """Matches instances of ``bases`` whose class does not override ``forward``.

    A subclass with its own forward (timm's ``LayerNorm2d``, HF's channels-first ``ConvNextLayerNorm``)
    computes something else, and only a family rule that knows it may convert it.
    """
    return lambda m: any(isinstance(m, b) and type(m).forward is b.forward for b in bases)


@functools.lru_cache(maxsize=None)
def code_fingerprint(fn) -> str:
    """A hash of ``fn``'s statements (parsed and unparsed, docstring and comments left out): the same code in any
    formatting gives the same hash."""
    body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return hashlib.sha256("\n".join(ast.unparse(node) for node in body).encode()).hexdigest()[:16]


def callee(fn, name: str):
    """What ``name`` is in the globals of ``fn``'s module (a function or class it calls), or ``None``: the code
    a fingerprinted forward relies on, to fingerprint too."""
    return getattr(fn, "__globals__", {}).get(name)


def generic_rules() -> list[Rule]:
    """Rules shared by every family (family rules go in front of these): torch's own modules, Global Response
    Norm, which any library may define (found by name, confirmed by its formula), and timm's weight-standardized
    and SAME-padding convs (found by their forward's code)."""
    from .nn import activation, dropout, linear, norm, pooling

    residual = lambda m, c: {"act_share_residual": c.share_residual}
    return [
        Rule("linear", same_forward(nn.Linear), lambda m: linear.ActLinearMixin),
        Rule("conv", same_forward(nn.Conv1d, nn.Conv2d, nn.Conv3d), lambda m: linear.ActConvMixin, attrs=residual),
        Rule("conv", linear.is_standardized_conv, lambda m: linear.ActStandardizedConvMixin),
        Rule("conv", linear.is_same_padding_conv, lambda m: linear.ActConv2dSameMixin, attrs=residual),
        Rule("norm", same_forward(nn.LayerNorm), lambda m: norm.ActLayerNormMixin,
             attrs=lambda m, c: {"act_norm_context": c.norm_context}),
        Rule("norm", same_forward(nn.RMSNorm), lambda m: norm.ActRMSNormMixin,
             attrs=lambda m, c: {"act_rms_style": "torch", "act_norm_context": c.norm_context}),
        Rule("norm", same_forward(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), lambda m: norm.ActBatchNormMixin,
             attrs=lambda m, c: {"act_share_bn_relu": c.share_bn_relu}),
        Rule("norm", norm.is_global_response_norm, lambda m: norm.ActGRNMixin),
        Rule("activation", lambda m: type(m) in activation.TORCH_ACTIVATIONS,
             lambda m: activation.TORCH_ACTIVATIONS[type(m)][0], bits=lambda c: c.derivative_bits),
        Rule("dropout", same_forward(nn.Dropout), lambda m: dropout.ActDropoutMixin),
        Rule("pool", same_forward(nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d), lambda m: pooling.ActMaxPoolMixin),
        Rule("pool", same_forward(nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), lambda m: pooling.ActAvgPoolMixin),
    ]


def _matches(path: str, patterns: str | list[str] | None) -> bool:
    if patterns is None:
        return False
    if isinstance(patterns, str):
        return re.fullmatch(patterns, path) is not None
    return any(path == p or path.endswith("." + p) for p in patterns)


def is_selected(module: nn.Module, path: str, config: ActConfig, head_paths: Iterable[str]) -> bool:
    """Whether ``config``'s targeting (target/exclude patterns, head exclusion, filter function) keeps ``path``."""
    if config.target_modules is not None and not _matches(path, config.target_modules):
        return False
    if _matches(path, config.exclude_modules):
        return False
    if config.exclude_head and any(path == h or path.startswith(h + ".") for h in head_paths):
        return False
    return config.module_filter_fn is None or bool(config.module_filter_fn(module, path))


def patch_modules(model: nn.Module, config: ActConfig, *, rules: list[Rule] = (),
                  head_paths: Iterable[str] = ()) -> list[str]:
    """Convert every selected module that a rule matches (``rules`` first, then :func:`generic_rules`).

    Args:
        model: the model, converted in place.
        config: the act_hf config (kinds, bits, targeting).
        rules: family-specific rules tried before the generic ones.
        head_paths: module paths of the task head, skipped when ``config.exclude_head``.

    Returns:
        The paths of the converted modules.
    """
    all_rules = list(rules) + generic_rules()
    head_paths = tuple(head_paths)
    patched = []
    for path, module in model.named_modules():
        if isinstance(module, ActModule) or not is_selected(module, path, config, head_paths):
            continue
        for rule in all_rules:
            if rule.kind in config.kinds and rule.match(module):
                attrs = rule.attrs(module, config)  # read the original module, before its class changes
                convert(module, rule.mixin(module), slot=path, bits=rule.bits(config),
                        group_size=config.group_size, swap=config.swap, channel_scale=config.scales_channels,
                        data_bits=config.data_bits_floor)
                module.act_kind = rule.kind
                for name, value in attrs.items():
                    setattr(module, name, value)
                patched.append(path)
                break
    return patched


def hf_head_paths(model: nn.Module) -> list[str]:
    """Task-head paths of an HF model: every top-level child outside the base model, plus its pooler. A model that
    is its own base model (T5's ``T5ForConditionalGeneration``: shared embedding, encoder, decoder, ``lm_head``) has
    its output embedding as its head, when that is a top-level child."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if base is None or base is model:
        try:
            out = model.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            return []
        return [name for name, child in model.named_children() if out is not None and child is out]
    heads = [name for name, _ in model.named_children() if name != prefix]
    heads += [f"{prefix}.{name}" for name, _ in base.named_children() if name == "pooler"]
    return heads


def _unwrap(model: nn.Module) -> nn.Module:
    """The model to patch: PEFT's ``PeftModel`` wraps the transformers model (whose LoRA layers hold the
    frozen ``base_layer`` and the ``lora_A``/``lora_B`` Linears, all converted like any Linear)."""
    if hasattr(model, "get_base_model") and isinstance(getattr(model, "peft_config", None), dict):
        return model.get_base_model()
    return model


def patch(model: nn.Module, bits: float = 3, config: ActConfig | None = None, *, strict: bool | None = None,
          **overrides: Any) -> nn.Module:
    """Make ``model`` store its backward context compressed. In place; returns the model.

    Args:
        model: an HF transformers model, a timm model, or any ``nn.Module`` (generic fallback).
        bits: an int 1..8, or a float average budget for adaptive bits (e.g. 2.5: the model gets a
            :class:`act_hf.adapt.BitAllocator` as ``model.act_hf_allocator``, which re-allocates the budget over
            the slots from measured sensitivities). Ignored when ``config`` is given (use ``bits=`` inside the
            config or as an override). An :class:`ActConfig` here is taken as ``config``
            (``act_hf.patch(model, ActConfig(...))``).
        config: a full :class:`ActConfig`; ``overrides`` replace single fields of it.
        strict: raise instead of falling back when the family is unknown or nothing could be patched.
        **overrides: any :class:`ActConfig` field (``group_size=128``, ``kinds=("linear",)``, ...).

    Returns:
        The same model object. Patching an already patched model is a no-op.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: an unknown or invalid option (the message names it), or, with ``strict``, an unknown
            family; :class:`act_hf.errors.NoMatchingModuleError` when nothing at all could be patched.
    """
    if not isinstance(model, nn.Module):
        raise ActHFTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    wrapper, model = model, _unwrap(model)
    if getattr(model, "act_hf_config", None) is not None:
        logger.info("model is already patched by act_hf; patch() is a no-op")
        return wrapper
    if isinstance(bits, ActConfig):
        if config is not None:
            raise ActHFTypeError("bits is an ActConfig and config is given too: pass one config")
        config = bits
    if config is None:
        config = ActConfig(bits=bits)
    elif not isinstance(config, ActConfig):
        raise ActHFTypeError(f"config must be an act_hf.ActConfig, got {type(config).__name__}")
    if strict is not None:
        overrides["strict"] = strict
    if overrides:
        config = config.with_overrides(**overrides)
    family = family_of(model)
    if family is None and config.strict:
        raise ActHFValueError(
            f"act_hf has no patch for {type(model).__name__} (model_type="
            f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}); supported families: "
            f"{sorted(PATCH_FUNCTIONS)}. Pass strict=False for the generic fallback."
        )
    # an adaptive model's allocation is its own table (slot -> bits), shared by its converted modules and hooks:
    # a deep copy or a pickle carries it, and it goes with the model
    model.act_hf_slot_bits = {} if config.adaptive else None
    if family is None:
        from .patches import generic

        patched = generic.patch_generic(model, config)
    else:
        patched = PATCH_FUNCTIONS[family](model, config)
        _warn_sync_batch_norm(model, config)
    if not patched:
        del model.act_hf_slot_bits
        raise NoMatchingModuleError(
            f"act_hf found nothing to patch in {type(model).__name__} (kinds={list(config.kinds)}, "
            f"target_modules={config.target_modules!r}, exclude_modules={config.exclude_modules!r})"
        )
    if config.checkpoint_bits is not None:
        _enable_checkpoint_compression(model, config)
    if model.act_hf_slot_bits is not None:
        for module in model.modules():
            if hasattr(module, "act_bits"):  # converted modules and marked attention modules
                module.act_slot_bits = model.act_hf_slot_bits
    allocator = None
    if config.adaptive:
        from .adapt import BitAllocator

        allocator = BitAllocator(model, config)
        add_cleanup(model, allocator.remove)
    for target in {id(model): model, id(wrapper): wrapper}.values():
        target.act_hf_config = config
        target.act_hf_family = family or "generic"
        target.act_hf_patched_modules = patched
        if allocator is not None:
            target.act_hf_allocator = allocator
    return wrapper


def _warn_sync_batch_norm(model: nn.Module, config: ActConfig) -> None:
    """A family leaves ``nn.SyncBatchNorm`` as it is (its statistics are reduced across processes in a kernel of
    torch's): say so, since its input is then saved at full width and no conv after it reads its context."""
    if "norm" not in config.kinds:
        return
    count = sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    if count:
        warnings.warn(f"act_hf does not compress nn.SyncBatchNorm: {count} of them in {type(model).__name__} keep "
                      "their inputs at full width (and the convs after them pack their own). Per-process "
                      "BatchNorm (no nn.SyncBatchNorm.convert_sync_batchnorm) is compressed.", ActHFWarning,
                      stacklevel=3)


def _enable_checkpoint_compression(model: nn.Module, config: ActConfig) -> None:
    """``config.checkpoint_bits`` for a model with HF gradient checkpointing; a warning for any other."""
    if not hasattr(model, "_set_gradient_checkpointing"):
        warnings.warn(f"checkpoint_bits={config.checkpoint_bits} has no effect on {type(model).__name__}: act_hf packs "
                      "the inputs of Hugging Face gradient checkpointing only (for other models call "
                      "act_hf.checkpoint.checkpoint in place of torch.utils.checkpoint.checkpoint)", ActHFWarning,
                      stacklevel=3)
        return
    from .checkpoint import enable_hf_checkpoint_compression

    add_cleanup(model, enable_hf_checkpoint_compression(model, bits=config.checkpoint_bits,
                                                        group_size=config.group_size, swap=config.swap,
                                                        channel_scale=config.scales_channels))


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the original module classes and attention implementation. In place; returns the model."""
    if not isinstance(model, nn.Module):
        raise ActHFTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    wrapper, model = model, _unwrap(model)
    for cleanup in model.__dict__.get("act_hf_cleanups", []):
        cleanup()
    for module in model.modules():
        if isinstance(module, ActModule):
            revert(module)
    for target in (model, wrapper):
        for attr in ("act_hf_config", "act_hf_family", "act_hf_patched_modules", "act_hf_cleanups",
                     "act_hf_allocator", "act_hf_slot_bits"):
            target.__dict__.pop(attr, None)
    return wrapper


def add_cleanup(model: nn.Module, fn: Callable[[], None]) -> None:
    """Run ``fn`` on :func:`unpatch` (restoring an attention implementation, removing hooks, ...).

    ``fn`` must reach the model only through what ``copy.deepcopy`` copies: a ``functools.partial`` of a
    module-level function or a bound method, not a closure. The list of cleanups is copied with the model, and
    a closure would still act on the original (``unpatch`` of a copy would undo the original's patches).
    """
    if getattr(fn, "__closure__", None):
        raise ActHFTypeError(f"add_cleanup: {fn!r} is a closure; pass a functools.partial or a bound method so that "
                             "a deep copy of the model gets cleanups of its own")
    if "act_hf_cleanups" not in model.__dict__:
        model.act_hf_cleanups = []
    model.act_hf_cleanups.append(fn)


def remove_handles(handles: list) -> None:
    """A cleanup: remove hook handles (``add_cleanup(model, functools.partial(remove_handles, handles))``)."""
    for handle in handles:
        handle.remove()