"""Gradient checkpointing whose kept layer inputs are packed at a few bits (GACT's CB1 combination).

Gradient checkpointing keeps only each checkpointed layer's inputs and recomputes the layer in backward. With
act_hf on top, the recomputed layer's own context is packed already; what is left is the inputs, one hidden
state per layer, kept at full width (fp32 for BERT-style models under autocast, whose LayerNorm outputs are
fp32). :func:`checkpoint` keeps them packed instead, and backward recomputes the layer on the dequantized
input ``Q(x)``::

    y = act_hf.checkpoint.checkpoint(layer, x, bits=8)   # like torch.utils.checkpoint.checkpoint(layer, x)

or, for a Hugging Face model, ``act_hf.patch(model, bits=3, checkpoint_bits=8)`` and HF gradient checkpointing
(``model.activation_checkpointing_enable()``, its older name ``gradient_checkpointing_enable()``, which
transformers 5.2x deprecates, or ``TrainingArguments(gradient_checkpointing=True)``, before or after the patch;
:func:`enable_hf_checkpointing` calls whichever the installed transformers has).

Contract:
    - The forward output is exactly the uncheckpointed one (forward runs on ``x`` itself).
    - The gradient is **not** unbiased: backward differentiates the layer at ``Q(x)``, and ``E[f'(Q(x))]``
      differs from ``f'(x)`` for a nonlinear layer (a second-order effect of the rounding variance). This is
      why it is opt-in (``checkpoint_bits=None`` keeps the inputs exact, the default). GACT used 4 bits and
      reports unchanged BERT-large accuracy; on a short MiniLM SST-2 fine-tune (README) 4 bits cost 2.9 points
      of accuracy against ``bits=3`` alone with plain groups and 0.9 with channel scaling, and 8 bits (plain)
      cost nothing measurable, hence the default of 8 here.
      ``bits=None`` keeps the inputs exact (then this is a reentrant checkpoint, tested equal to an
      uncheckpointed backward).
    - Compressed: every floating positional argument that requires grad (the hidden state, a cross-attention
      source). Kept as they are: tensors that need no grad (masks, rotary tables) and keyword arguments
      (HF passes those inside ``function``, a ``functools.partial``); top-level keyword tensors that require
      grad still receive their gradient.
    - Dropout and other draws replay the forward's (the CPU and device RNG states are restored, as in
      ``torch.utils.checkpoint`` with ``preserve_rng_state=True``); autocast is replayed as it was in forward.
    - Backward must be ``loss.backward()`` (or ``torch.autograd.backward``), not ``torch.autograd.grad``, as
      with torch's reentrant checkpoint: the recomputed layer accumulates its parameters' gradients itself.
      While act_hf's adaptive allocator probes (a few samples), layers run uncheckpointed, since the probe
      uses ``torch.autograd.grad``.
    - The packed inputs go through ``ctx.save_for_backward``: :func:`act_hf.track_saved` counts them and
      ``swap=True`` moves them to host memory like any other packed context.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .compress import check_bits, check_group_size, dequantize
from .compress.packed import PackedTensor
from .context import store
from .errors import ActHFRuntimeError
from .ops._saving import autocast_state, load_context, replayed_rng, rng_state, save_context

__all__ = ["checkpoint", "checkpointing_argument", "enable_hf_checkpoint_compression", "enable_hf_checkpointing"]

_TORCH_CHECKPOINT = torch.utils.checkpoint.checkpoint

logger = logging.getLogger(__name__)


class _Call:
    """How to rebuild ``function(*args, **kwargs)`` from the tensors handed to autograd.

    ``positions[i]`` says where tensor ``i`` goes: ``("arg", j)`` (positional ``j``) or ``("kw", name)``.
    """

    def __init__(self, function: Callable, args: tuple, kwargs: dict) -> None:
        self.function, self.args, self.kwargs = function, list(args), dict(kwargs)
        self.positions: list[tuple[str, Any]] = [("arg", j) for j, a in enumerate(args) if isinstance(a, Tensor)]
        self.positions += [("kw", k) for k, v in kwargs.items() if isinstance(v, Tensor) and v.requires_grad]

    def tensors(self) -> list[Tensor]:
        return [self.args[j] if where == "arg" else self.kwargs[j] for where, j in self.positions]

    def compressible(self) -> list[bool]:
        return [where == "arg" and t.is_floating_point() and t.requires_grad
                for (where, _), t in zip(self.positions, self.tensors())]

    def __call__(self, tensors: list[Tensor], *, owned: bool = False) -> Any:
        """``function`` with ``tensors`` in their places. The list is emptied, so the caller's reference goes with
        it. With ``owned`` (a recomputation, whose inputs nothing else holds), a layer that takes its input handed
        over (:func:`_owned_recompute`) gets it in a one-element list, and frees it once it has read it."""
        args, kwargs = list(self.args), dict(self.kwargs)
        for (where, j), t in zip(self.positions, tensors):
            (args if where == "arg" else kwargs)[j] = t
        t = None  # the loop's last tensor
        tensors.clear()
        found = _owned_recompute(self.function, args, kwargs) if owned else None
        if found is None:
            return self.function(*args, **kwargs)
        recompute, first = found
        box = [args[first]]
        rest = args[first + 1:]
        del args
        return recompute(box, *rest, **kwargs)

    def release(self) -> None:
        """Drop the references to the original tensors (backward rebuilds them from the saved context)."""
        for where, j in self.positions:
            (self.args if where == "arg" else self.kwargs)[j] = None


def _owned_recompute(function: Callable, args: list, kwargs: dict) -> tuple[Callable, int] | None:
    """``(layer.act_recompute_owned, i)`` when ``function(*args, **kwargs)`` runs a layer that takes its input,
    ``args[i]``, handed over in a one-element list (``act_recompute_owned(box, *args[i + 1:], **kwargs)``, the
    same computation, for example a BERT layer's: ``patches/_hf.py``), and the layer says it may
    (``act_takes_input_owned``); else ``None``. transformers checkpoints a layer as its class's ``forward`` with the
    layer first (``forward(layer, x, ...)``, 5.2x) or as ``nn.Module.__call__`` bound to it (5.17), which the
    layer's method replaces only where no hook could see the call."""
    if args and isinstance(args[0], nn.Module):
        layer, first = args[0], 1
        own = function is getattr(getattr(type(layer), "act_original_class", None), "forward", None)
    else:
        layer, first = getattr(function, "__self__", None), 0
        own = getattr(function, "__func__", None) is nn.Module.__call__
    recompute = getattr(layer, "act_recompute_owned", None)
    if not own or recompute is None or len(args) <= first or not isinstance(args[first], Tensor) \
            or not layer.act_takes_input_owned(tuple(args[first + 1:]), kwargs):
        return None
    return recompute, first


#: whether ``torch.autograd.backward`` takes gradient edges as its roots (torch 2.5 on): then a recomputed layer's
#: outputs need not be held through the layer's backward
_BACKWARD_FROM_EDGES = "Edge" in str(inspect.signature(torch.autograd.backward).parameters["tensors"].annotation)


class _InputGradient:
    """Where :class:`_GradientOf` puts the gradient of a recomputed input, laid out as ``AccumulateGrad`` lays out
    a leaf's (the strides of a dense input, else contiguous), so that the layers before get the gradient they got
    when the input was a leaf, bit for bit and stride for stride."""

    def __init__(self, x: Tensor) -> None:
        order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
        self.shape, self.stride = x.shape, x.stride() if x.permute(order).is_contiguous() else None
        self.grad: Tensor | None = None

    def take(self, grad: Tensor) -> None:
        if self.stride is None:
            grad = grad.contiguous()
        elif grad.stride() != self.stride:
            grad = grad.new_empty_strided(self.shape, self.stride).copy_(grad)
        self.grad = grad


class _GradientOf(torch.autograd.Function):
    """A recomputed layer's input: ``x`` itself (a tensor of its own on the same storage), whose gradient goes to
    ``into`` when backward reaches it. Unlike a leaf, which the graph's ``AccumulateGrad`` holds to the end of the
    layer's backward, nothing here keeps ``x``: once the recomputation has run, it lives only in what the layer's
    ops saved of it (act_hf's packed copies, or ``x`` itself where an op saved it so)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, x: Tensor, into: _InputGradient) -> Tensor:
        ctx.into = into
        return x.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:
        ctx.into.take(grad)
        return None, None, None


def _backward_from(outputs: list[Tensor], grads: list[Tensor]) -> None:
    """``torch.autograd.backward(outputs, grads)``, holding ``outputs`` no longer than the graph does: from their
    gradient edges, where torch takes them, so that an output no op saved goes before the backward runs."""
    if not _BACKWARD_FROM_EDGES:
        torch.autograd.backward(outputs, grads)
        return
    edges = [torch.autograd.graph.get_gradient_edge(o) for o in outputs]
    outputs.clear()
    torch.autograd.backward(edges, grads)


class _CompressedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, bits: int | None, group_size: int, swap: bool, channel_scale: bool, slot: str,
                preserve_rng_state: bool, *tensors: Tensor) -> Any:
        ctx.call = call
        ctx.device_type = next((t.device.type for t in tensors if t.device.type not in ("cpu", "meta")), "cpu")
        ctx.autocast = autocast_state(ctx.device_type)
        ctx.cpu_autocast = autocast_state("cpu")
        ctx.rng = rng_state(*tensors) if preserve_rng_state else None
        compress = call.compressible() if bits is not None else [False] * len(tensors)
        ctx.inputs_need_grad = [t.requires_grad for t in tensors]
        ctx.channels_last = [t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
                             for t in tensors]
        items = [store.compress(t, slot=slot, bits=bits, group_size=group_size, swap=swap,
                                channel_scale=channel_scale) if c else t for t, c in zip(tensors, compress)]
        # ``call`` must not keep the originals alive: the packed copies stand for them from here on
        call.release()
        outputs = call(list(tensors))
        save_context(ctx, *items)
        if isinstance(outputs, Tensor):
            return outputs
        if not isinstance(outputs, tuple):
            raise ActHFRuntimeError(f"act_hf.checkpoint: the checkpointed function returned a "
                                    f"{type(outputs).__name__}; it must return a tensor or a tuple (use "
                                    f"checkpoint_bits=None to keep torch's checkpoint)")
        ctx.mark_non_differentiable(*[o for o in outputs if isinstance(o, Tensor) and not o.is_floating_point()])
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor | None) -> tuple:
        is_valid = getattr(torch.autograd, "_is_checkpoint_valid", lambda: True)
        if not is_valid():
            raise ActHFRuntimeError("act_hf.checkpoint does not support torch.autograd.grad or backward(inputs=...); "
                                    "call loss.backward()")
        inputs, holders = [], []
        with torch.enable_grad():
            for item, needs_grad, channels_last in zip(load_context(ctx), ctx.inputs_need_grad, ctx.channels_last):
                if isinstance(item, PackedTensor):
                    item = dequantize(item)
                    if channels_last:
                        item = item.contiguous(memory_format=torch.channels_last)
                holders.append(_InputGradient(item) if needs_grad else None)
                if needs_grad:  # the anchor makes _GradientOf's output require grad
                    anchor = torch.empty(0, device=item.device, requires_grad=True)
                    item = _GradientOf.apply(anchor, item.detach(), holders[-1])
                inputs.append(item if needs_grad else item.detach())
            item = None  # the last input goes with the others once the layer has run
            with replayed_rng(ctx.rng), torch.autocast(ctx.device_type, **ctx.autocast), \
                    torch.autocast("cpu", **ctx.cpu_autocast):
                outputs = ctx.call(inputs, owned=True)  # empties inputs: the layer holds what it needs of them
        outputs = (outputs,) if isinstance(outputs, Tensor) else outputs
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if isinstance(o, Tensor) and o.requires_grad and g is not None]
        if not pairs:
            raise ActHFRuntimeError("act_hf.checkpoint: none of the checkpointed function's outputs requires grad")
        roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        del outputs, pairs
        _backward_from(roots, grads)
        return (None,) * 7 + tuple(None if holder is None else holder.grad for holder in holders)


def _holds_grad_tensor(obj: Any) -> bool:
    """Whether the container ``obj`` (list, tuple, dict, at any depth) holds a tensor that requires grad."""
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return any(isinstance(o, Tensor) and o.requires_grad or _holds_grad_tensor(o) for o in items)


def checkpoint(function: Callable, *args: Any, bits: int | None = 8, group_size: int = 256, swap: bool = False,
               channel_scale: bool = True, slot: str = "checkpoint", preserve_rng_state: bool = True,
               **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs, packed at ``bits``; recompute it in backward.

    Args:
        function: the layer (any callable returning a tensor or a tuple); a ``functools.partial`` has its
            keyword tensors that require grad taken out as inputs, so they receive their gradients.
        *args: positional inputs; the floating ones that require grad are packed.
        bits: code width 1..8 of the packed inputs (8: no accuracy cost measured; 4: GACT's CB1, half the
            bytes, a measured accuracy cost); ``None`` keeps them exact.
        group_size: quantization group size (a positive multiple of 8).
        swap: move the packed inputs to pinned host memory (CUDA inputs only; see :mod:`act_hf.swap`).
        channel_scale: equalize the channels of the inputs' last dimension before quantizing (see
            :func:`act_hf.compress.quantize`): hidden states have outlier channels that otherwise set the
            range of every group they fall in.
        slot: the name :func:`act_hf.track_saved` lists the packed inputs under.
        preserve_rng_state: replay the forward's RNG state in the recomputation (dropout masks stay the same).
        **kwargs: keyword inputs, kept as they are.

    Returns:
        What ``function`` returns (exactly: forward runs on the original inputs).

    With grad mode off or while act_hf's adaptive allocator probes, ``function`` simply runs. When no input
    tensor requires grad (only the layer's parameters do), or a tensor that requires grad is nested inside
    ``args`` or ``kwargs`` (this checkpoint could not hand it its gradient), it falls back to
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with exact inputs.
    """
    if bits is not None:
        check_bits(bits, "bits")
    check_group_size(group_size)
    if isinstance(function, functools.partial):
        function, args, kwargs = function.func, (*function.args, *args), {**function.keywords, **kwargs}
    if not torch.is_grad_enabled() or store.uncheckpointed:
        return function(*args, **kwargs)
    call = _Call(function, args, kwargs)
    tensors = call.tensors()
    if any(map(_holds_grad_tensor, (*args, *kwargs.values()))) or not any(t.requires_grad for t in tensors):
        return _TORCH_CHECKPOINT(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)
    return _CompressedCheckpoint.apply(call, bits, group_size, swap, channel_scale, slot, preserve_rng_state,
                                       *tensors)


def _layer_of(function: Callable) -> nn.Module | None:
    """The module an HF checkpointing call runs: ``partial(forward, self, ...)`` (transformers >= 5) or
    ``partial(module.__call__, ...)`` (earlier)."""
    if isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], nn.Module):
            return function.args[0]
        function = function.func
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _compressing(func: Callable, options: dict) -> Callable:
    """``func`` (torch's checkpoint, possibly a ``functools.partial`` with keywords) as act_hf's packed one with
    ``options`` (:func:`checkpoint`'s keyword arguments); any other function is returned as it is, with a
    warning."""
    if getattr(func, "act_hf_compressed", False):
        return func
    base = func.func if isinstance(func, functools.partial) else func
    if base is not _TORCH_CHECKPOINT:
        logger.warning("act_hf: checkpoint_bits=%d has no effect: the model's checkpoint function is %r, not "
                       "torch.utils.checkpoint.checkpoint; its layer inputs stay exact", options["bits"], func)
        return func
    preserve_rng_state = func.keywords.get("preserve_rng_state", True) if isinstance(func, functools.partial) \
        else True
    # a partial of a module-level function (not a closure), so a patched model still pickles
    compressed = functools.partial(_packed_layer_call, {**options, "preserve_rng_state": preserve_rng_state})
    compressed.act_hf_compressed = True
    compressed.act_hf_original = func
    return compressed


def _packed_layer_call(options: dict, function: Callable, *args: Any) -> Any:
    """HF's ``_gradient_checkpointing_func(function, *args)`` as :func:`checkpoint`, slot named after the layer."""
    layer = _layer_of(function)
    slot = getattr(layer, "act_hf_checkpoint_slot", None) or \
        (f"{type(layer).__name__}:checkpoint_input" if layer is not None else "checkpoint_input")
    return checkpoint(function, *args, slot=slot, **options)


def _convert_modules(model: nn.Module, options: dict) -> None:
    converted: dict[int, Callable] = {}  # HF sets one function on every layer: converted (or warned about) once
    for path, module in model.named_modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None:
            if id(func) not in converted:
                converted[id(func)] = _compressing(func, options)
            module._gradient_checkpointing_func = converted[id(func)]
            module.act_hf_checkpoint_slot = f"{path or 'model'}:checkpoint_input"


def _set_gradient_checkpointing(self: nn.Module, enable: bool = True,
                                gradient_checkpointing_func: Callable = _TORCH_CHECKPOINT, **kwargs: Any) -> None:
    """HF's ``_set_gradient_checkpointing``, then act_hf's packed checkpoint in place of the function it set.

    Set on the model as ``functools.partial(_set_gradient_checkpointing, model)``, which ``copy.deepcopy`` and
    pickling rebind to the copy; the bits come from the model's ``act_hf_checkpoint``."""
    type(self)._set_gradient_checkpointing(self, enable=enable, gradient_checkpointing_func=gradient_checkpointing_func,
                                           **kwargs)
    options = self.__dict__.get("act_hf_checkpoint")
    if options is not None:
        _convert_modules(self, options)


def enable_hf_checkpointing(model: nn.Module) -> None:
    """Switch HF gradient checkpointing on in ``model`` with torch's non-reentrant checkpoint:
    ``activation_checkpointing_enable`` where transformers has it (``gradient_checkpointing_enable`` is its
    deprecated alias there, to be removed in v6), else ``gradient_checkpointing_enable``."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_argument() -> str:
    """The ``TrainingArguments`` field (and ``--flag`` of HF scripts) that switches HF checkpointing on:
    ``activation_checkpointing`` where transformers has it (``gradient_checkpointing`` is its deprecated alias
    there, to be removed in v6), else ``gradient_checkpointing``."""
    from transformers import TrainingArguments

    fields = getattr(TrainingArguments, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def enable_hf_checkpoint_compression(model: nn.Module, *, bits: int, group_size: int = 256,
                                     swap: bool = False, channel_scale: bool = True) -> Callable[[], None]:
    """Make HF gradient checkpointing in ``model`` keep its layer inputs packed at ``bits``.

    Works whether checkpointing is switched on before or after this call: the checkpoint function HF has set
    is replaced now, and ``model._set_gradient_checkpointing`` (which ``activation_checkpointing_enable`` calls)
    is wrapped for later. Only torch's own ``checkpoint`` is replaced (with any keyword arguments); another
    function (HF's ``offload=True`` wrapper, a user's) is left in place, with a warning.

    Returns:
        A function that restores torch's checkpoint and the original ``_set_gradient_checkpointing``.
    """
    options = {"bits": bits, "group_size": group_size, "swap": swap, "channel_scale": channel_scale}
    model.act_hf_checkpoint = options
    _convert_modules(model, options)
    if "gradient_checkpointing_func" in inspect.signature(model._set_gradient_checkpointing).parameters:
        model._set_gradient_checkpointing = functools.partial(_set_gradient_checkpointing, model)
    else:
        logger.warning("act_hf: %s uses the pre-4.35 checkpointing format; checkpoint_bits applies only if "
                       "checkpointing is on when act_hf.patch runs", type(model).__name__)

    return functools.partial(_disable_hf_checkpoint_compression, model)


def _disable_hf_checkpoint_compression(model: nn.Module) -> None:
    model.__dict__.pop("_set_gradient_checkpointing", None)
    model.__dict__.pop("act_hf_checkpoint", None)
    for module in model.modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if getattr(func, "act_hf_compressed", False):
            module._gradient_checkpointing_func = func.act_hf_original
        module.__dict__.pop("act_hf_checkpoint_slot", None)
