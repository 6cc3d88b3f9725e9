"""Drop-in activation modules that save a few-bit derivative code instead of their input.

Each mixin goes in front of the original class; the forward is the original module's own ``forward`` (so the
output and in-place behaviour are unchanged) wrapped in :class:`act_hf.ops.activation.ActActivationFunction`,
which decides what is saved. Slot: ``<path>:input``.

* Torch modules: :data:`TORCH_ACTIVATIONS` maps each supported ``torch.nn`` class to its mixin and derivative
  name; the concrete classes (``ActGELU``, ``ActReLU``, ...) are registered with
  :func:`act_hf.nn._base.register_act_class`.
* transformers / timm activation classes: :class:`ActActivationMixin`, parametrised by ``act_fn_name`` (one of
  :data:`act_hf.ops.activation.ACTIVATION_NAMES`), which the patcher sets, e.g.
  ``convert(module, ActActivationMixin, ...)`` then ``module.act_configure(act_fn_name="gelu_tanh")`` for
  ``NewGELUActivation``. This module imports neither transformers nor timm.

Configurations without a matching derivative table run the original op unchanged (and save what it saves):
``nn.ELU``/``CELU`` with ``alpha != 1``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from ..errors import ActHFValueError
from ..ops.activation import (
    ACTIVATION_NAMES,
    ActivationSpec,
    act_activation,
    check_activation_name,
    gelu_inplace,
    gelu_tanh_inplace,
    relu_inplace,
    silu_inplace,
)
from ._base import ActModule, register_act_class

__all__ = [
    "TORCH_ACTIVATIONS",
    "ActActivationMixin",
    "ActELU",
    "ActELUMixin",
    "ActGELU",
    "ActGELUMixin",
    "ActHardsigmoid",
    "ActHardsigmoidMixin",
    "ActHardswish",
    "ActHardswishMixin",
    "ActHardtanh",
    "ActHardtanhMixin",
    "ActLeakyReLU",
    "ActLeakyReLUMixin",
    "ActMish",
    "ActMishMixin",
    "ActReLU",
    "ActReLU6",
    "ActReLU6Mixin",
    "ActReLUMixin",
    "ActSELU",
    "ActSELUMixin",
    "ActSiLU",
    "ActSiLUMixin",
    "ActSigmoid",
    "ActSigmoidMixin",
    "ActSoftplus",
    "ActSoftplusMixin",
    "ActTanh",
    "ActTanhMixin",
    "activation_of_owned",
    "output_is_owned",
]

logger = logging.getLogger(__name__)
_logged_fallbacks: set[tuple[str, str]] = set()


def _spec_from_module(name: str, module: nn.Module) -> ActivationSpec | None:
    """The derivative of activation ``name`` with the parameters ``module`` holds; ``None`` if no table fits."""
    if name == "leaky_relu":
        return ActivationSpec(name, negative_slope=float(getattr(module, "negative_slope", 0.01)))
    if name == "hardtanh":
        return ActivationSpec(name, min_val=float(getattr(module, "min_val", -1.0)),
                              max_val=float(getattr(module, "max_val", 1.0)))
    if name == "softplus":
        return ActivationSpec(name, beta=float(getattr(module, "beta", 1.0)),
                              threshold=float(getattr(module, "threshold", 20.0)))
    if name == "elu" and float(getattr(module, "alpha", 1.0)) != 1.0:
        key = (type(module).__name__, "alpha")
        if key not in _logged_fallbacks:
            _logged_fallbacks.add(key)
            logger.info("%s with alpha != 1 has no few-bit table; it runs the original op", key[0])
        return None
    return ActivationSpec(name)


class ActActivationMixin(ActModule):
    """Generic few-bit activation for any elementwise activation module whose derivative is ``act_fn_name``.

    The module's own ``forward`` computes the output; only the backward context changes.

    Attributes:
        act_fn_name: the derivative to use, one of :data:`act_hf.ops.activation.ACTIVATION_NAMES`
            (e.g. ``"gelu_tanh"`` for transformers' ``NewGELUActivation``/``FastGELUActivation``/``GELUTanh``,
            ``"quick_gelu"`` for ``QuickGELUActivation``). Parameters (``negative_slope``, ``min_val``/``max_val``,
            ``beta``/``threshold``, ``alpha``) are read from the module's attributes of those names when present.
    """

    act_fn_name: str | None = None

    def act_configure(self, *, act_fn_name: str | None = None, **kwargs):
        """Set ``act_fn_name`` (validated) and the :class:`ActModule` settings given."""
        if act_fn_name is not None:
            self.act_fn_name = check_activation_name(act_fn_name)
        return super().act_configure(**kwargs)

    def act_activation_spec(self) -> ActivationSpec | None:
        """The derivative this module's backward uses, or ``None`` to run the original op."""
        name = self.act_fn_name
        if name is None:
            raise ActHFValueError(
                f"{type(self).__name__}.act_fn_name is not set; set it to one of: {', '.join(ACTIVATION_NAMES)}"
            )
        return _spec_from_module(check_activation_name(name), self)  # type: ignore[arg-type]

    def act_inplace_forward(self) -> Callable[[Tensor], Tensor] | None:
        """A function that computes this module's ``forward`` bit for bit into its input and returns it, for a
        caller that owns the input (:func:`activation_of_owned`); ``None`` where there is none (the default)."""
        return None

    def forward(self, x: Tensor, *args, act_input_owned: bool = False, **kwargs) -> Tensor:
        """The module's own forward, saving few-bit codes; with ``act_input_owned`` (:func:`activation_of_owned`)
        written into ``x`` by :meth:`act_inplace_forward` where there is one, also when nothing is saved and
        autograd does not need ``x``."""
        if args or kwargs or not isinstance(x, Tensor) or not self.act_enabled(x):
            if act_input_owned and isinstance(x, Tensor) and not (args or kwargs) \
                    and not (torch.is_grad_enabled() and x.requires_grad):
                in_place = self.act_inplace_forward()
                if in_place is not None:
                    return in_place(x)
            return super().forward(x, *args, **kwargs)
        spec = self.act_activation_spec()
        if spec is None:
            return super().forward(x)
        in_place = self.act_inplace_forward() if act_input_owned else None
        if in_place is not None:
            return act_activation(x, spec, self.act_settings("input"), fn=in_place, inplace=True)
        return act_activation(x, spec, self.act_settings("input"), fn=self.act_output_fn(x),
                              inplace=bool(getattr(self, "inplace", False)))

    def act_output_fn(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        """The function that computes the output of ``x`` on act_hf's path: the module's own ``forward`` (the
        default), or one that gives the same bits with fewer temporaries."""
        return super().forward


def keeps_no_tensor(hook: Callable) -> Callable:
    """Mark ``hook``, one of act_hf's own module hooks, as keeping and reading no tensor after the call (the
    fallback's saved-tensor scopes, :class:`act_hf.fallback._HookScopes`): it does not stop a caller from writing
    into a module's input or output (:func:`_hooks_could_see`)."""
    hook.act_hf_keeps_no_tensor = True
    return hook


def foreign_hooks(hooks: dict) -> bool:
    """Whether a module's dict of forward or forward-pre hooks holds one not marked :func:`keeps_no_tensor`."""
    return any(not getattr(hook, "act_hf_keeps_no_tensor", False) for hook in hooks.values())


def _hooks_could_see(*modules: nn.Module) -> bool:
    """Whether a module hook (of ``modules``, or a global one) could keep a tensor or read it after the call;
    act_hf's own scope hooks (:func:`keeps_no_tensor`) do not."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or any(foreign_hooks(m._forward_hooks) or foreign_hooks(m._forward_pre_hooks) for m in modules))


def _traced() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_scripting() or torch._C._get_tracing_state() is not None


def _no_backward_hooks(*modules: nn.Module) -> bool:
    return not (_module._global_backward_hooks or _module._global_backward_pre_hooks
                or any(m._backward_hooks or m._backward_pre_hooks for m in modules))


def _calls_only_forward(*modules: nn.Module) -> bool:
    """Whether ``m(x)`` is ``m.forward(x)`` for each of ``modules``: no forward hook at all, module or global
    (act_hf's own scope hooks must run too), no backward hook, no tracing or compiling (which see the call)."""
    if (_module._global_forward_hooks or _module._global_forward_pre_hooks or _traced()
            or any(m._forward_hooks or m._forward_pre_hooks for m in modules)):
        return False
    return _no_backward_hooks(*modules)


def may_write_through(*modules: nn.Module) -> bool:
    """Whether a caller that owns the tensor it hands to ``m(x)`` (each of ``modules``, called as usual) may let
    ``m`` write into it: no forward hook that could keep or read ``x`` or the output (:func:`_hooks_could_see`),
    no backward hook (which wraps inputs and outputs in a Function of its own), no tracing or compiling."""
    return not _hooks_could_see(*modules) and _no_backward_hooks(*modules) and not _traced()


def output_is_owned(act: nn.Module) -> bool:
    """Whether ``act(x)``'s output, for a caller that owns it, may be overwritten: ``act`` is an act_hf activation
    whose backward keeps codes (never its output) and no hook could hold the output."""
    return isinstance(act, ActActivationMixin) and act.act_activation_spec() is not None and not _hooks_could_see(act)


def activation_of_owned(act: nn.Module, x: Tensor, producer: nn.Module) -> Tensor:
    """``act(x)`` for a caller that owns ``x``, the fresh output of its submodule ``producer`` (an MLP's first
    linear) that nothing reads after this call: an act_hf activation with an in-place form
    (:meth:`ActActivationMixin.act_inplace_forward`) writes its output into ``x``, so the two full-size tensors,
    an MLP's widest, are never alive together, and saves its codes as usual (or nothing, where autograd records
    nothing: a packed checkpoint's first pass). The values and gradients are
    ``act(x)``'s. Hooks that could keep ``x`` or read it after the call (forward hooks of ``producer``, any
    hook of ``act``, global module hooks) keep the out-of-place call."""
    if isinstance(act, ActActivationMixin) and act.act_inplace_forward() is not None \
            and not (foreign_hooks(producer._forward_hooks) or _hooks_could_see(act)):
        return act(x, act_input_owned=True)
    return act(x)


class ActGELUMixin(ActActivationMixin):
    """``nn.GELU``: ``gelu`` or, with ``approximate="tanh"``, ``gelu_tanh``."""

    def act_activation_spec(self) -> ActivationSpec | None:
        return ActivationSpec("gelu_tanh" if self.approximate == "tanh" else "gelu")

    def act_inplace_forward(self) -> Callable[[Tensor], Tensor] | None:
        """``aten::gelu_``: ``F.gelu``'s kernel writing into its input (autocast casts neither), as
        :data:`~act_hf.ops.activation.gelu_inplace` or ``gelu_tanh_inplace``, which the activation runs together
        with its code where it can."""
        return gelu_tanh_inplace if self.approximate == "tanh" else gelu_inplace


class ActSiLUMixin(ActActivationMixin):
    """``nn.SiLU``."""

    act_fn_name = "silu"

    def act_inplace_forward(self) -> Callable[[Tensor], Tensor] | None:
        """``F.silu(x, inplace=True)``: ``F.silu``'s kernel writing into its input
        (:data:`~act_hf.ops.activation.silu_inplace`, which the activation runs together with its code where it
        can)."""
        return silu_inplace


class ActTanhMixin(ActActivationMixin):
    """``nn.Tanh``."""

    act_fn_name = "tanh"


class ActSigmoidMixin(ActActivationMixin):
    """``nn.Sigmoid``."""

    act_fn_name = "sigmoid"


class ActMishMixin(ActActivationMixin):
    """``nn.Mish``."""

    act_fn_name = "mish"


class ActHardswishMixin(ActActivationMixin):
    """``nn.Hardswish``."""

    act_fn_name = "hardswish"


class ActHardsigmoidMixin(ActActivationMixin):
    """``nn.Hardsigmoid``."""

    act_fn_name = "hardsigmoid"


class ActELUMixin(ActActivationMixin):
    """``nn.ELU`` (``alpha == 1`` only; other values run the original op)."""

    act_fn_name = "elu"


class ActSELUMixin(ActActivationMixin):
    """``nn.SELU``."""

    act_fn_name = "selu"


class ActSoftplusMixin(ActActivationMixin):
    """``nn.Softplus`` (any ``beta``: the table is evaluated at ``beta * x``)."""

    act_fn_name = "softplus"


class ActReLUMixin(ActActivationMixin):
    """``nn.ReLU``: exact 1-bit derivative."""

    act_fn_name = "relu"

    def act_inplace_forward(self) -> Callable[[Tensor], Tensor] | None:
        """``F.relu(x, inplace=True)``: ``F.relu``'s kernel writing into its input (:data:`relu_inplace`, which
        the activation runs together with its code where it can)."""
        return relu_inplace

    def act_output_fn(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        """``nn.ReLU(inplace=True)``'s forward as :data:`relu_inplace`, the same call; the module's own otherwise."""
        return relu_inplace if getattr(self, "inplace", False) else super().act_output_fn(x)


class ActLeakyReLUMixin(ActActivationMixin):
    """``nn.LeakyReLU``: exact 1-bit derivative."""

    act_fn_name = "leaky_relu"


class ActReLU6Mixin(ActActivationMixin):
    """``nn.ReLU6``: exact 1-bit derivative."""

    act_fn_name = "relu6"


class ActHardtanhMixin(ActActivationMixin):
    """``nn.Hardtanh`` (any ``min_val < max_val``): exact 1-bit derivative."""

    act_fn_name = "hardtanh"


class ActGELU(ActGELUMixin, nn.GELU):
    """``nn.GELU`` saving a few-bit derivative code."""


class ActSiLU(ActSiLUMixin, nn.SiLU):
    """``nn.SiLU`` saving a few-bit derivative code."""


class ActTanh(ActTanhMixin, nn.Tanh):
    """``nn.Tanh`` saving a few-bit derivative code."""


class ActSigmoid(ActSigmoidMixin, nn.Sigmoid):
    """``nn.Sigmoid`` saving a few-bit derivative code."""


class ActMish(ActMishMixin, nn.Mish):
    """``nn.Mish`` saving a few-bit derivative code."""


class ActHardswish(ActHardswishMixin, nn.Hardswish):
    """``nn.Hardswish`` saving a few-bit derivative code."""


class ActHardsigmoid(ActHardsigmoidMixin, nn.Hardsigmoid):
    """``nn.Hardsigmoid`` saving a few-bit derivative code."""


class ActELU(ActELUMixin, nn.ELU):
    """``nn.ELU`` saving a few-bit derivative code (``alpha == 1``)."""


class ActSELU(ActSELUMixin, nn.SELU):
    """``nn.SELU`` saving a few-bit derivative code."""


class ActSoftplus(ActSoftplusMixin, nn.Softplus):
    """``nn.Softplus`` saving a few-bit derivative code."""


class ActReLU(ActReLUMixin, nn.ReLU):
    """``nn.ReLU`` saving a 1-bit mask (exact gradient)."""


class ActLeakyReLU(ActLeakyReLUMixin, nn.LeakyReLU):
    """``nn.LeakyReLU`` saving a 1-bit mask (exact gradient)."""


class ActReLU6(ActReLU6Mixin, nn.ReLU6):
    """``nn.ReLU6`` saving a 1-bit mask (exact gradient)."""


class ActHardtanh(ActHardtanhMixin, nn.Hardtanh):
    """``nn.Hardtanh`` saving a 1-bit mask (exact gradient)."""


def _gelu_name(module: nn.Module) -> str:
    return "gelu_tanh" if getattr(module, "approximate", "none") == "tanh" else "gelu"


#: ``torch.nn`` activation class -> ``(mixin, derivative)``; the derivative is a name from
#: :data:`act_hf.ops.activation.ACTIVATION_NAMES` or a callable ``module -> name`` (``nn.GELU``). Look up the
#: exact ``type(module)``; convert with ``act_hf.nn._base.convert(module, mixin, ...)``.
TORCH_ACTIVATIONS: dict[type, tuple[type, str | Callable[[nn.Module], str]]] = {}

for _original, _mixin, _cls, _name in (
    (nn.GELU, ActGELUMixin, ActGELU, _gelu_name),
    (nn.SiLU, ActSiLUMixin, ActSiLU, "silu"),
    (nn.Tanh, ActTanhMixin, ActTanh, "tanh"),
    (nn.Sigmoid, ActSigmoidMixin, ActSigmoid, "sigmoid"),
    (nn.Mish, ActMishMixin, ActMish, "mish"),
    (nn.Hardswish, ActHardswishMixin, ActHardswish, "hardswish"),
    (nn.Hardsigmoid, ActHardsigmoidMixin, ActHardsigmoid, "hardsigmoid"),
    (nn.ELU, ActELUMixin, ActELU, "elu"),
    (nn.SELU, ActSELUMixin, ActSELU, "selu"),
    (nn.Softplus, ActSoftplusMixin, ActSoftplus, "softplus"),
    (nn.ReLU, ActReLUMixin, ActReLU, "relu"),
    (nn.LeakyReLU, ActLeakyReLUMixin, ActLeakyReLU, "leaky_relu"),
    (nn.ReLU6, ActReLU6Mixin, ActReLU6, "relu6"),
    (nn.Hardtanh, ActHardtanhMixin, ActHardtanh, "hardtanh"),
):
    register_act_class(_original, _mixin, _cls)
    TORCH_ACTIVATIONS[_original] = (_mixin, _name)
del _original, _mixin, _cls, _name
