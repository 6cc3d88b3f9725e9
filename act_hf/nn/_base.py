"""The base of every act_hf module: slot naming, bits, when to compress, and in-place class conversion.

act_hf modules are mixins placed in front of the original class (``ActLinear(ActModule, nn.Linear)``), so a
converted module keeps its parameters, buffers, state-dict keys and ``isinstance`` relations; converting back
restores the original class exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from ..context import store
from ..ops._saving import OpSettings

__all__ = ["ActModule", "act_class_for", "convert", "register_act_class", "revert", "trains_with_grad"]

_CLASS_CACHE: dict[tuple[type, type], type] = {}


def trains_with_grad(module: nn.Module) -> bool:
    """Whether ``module`` runs a training forward that autograd records, the first condition of
    :meth:`ActModule.act_enabled`: where a converted block runs act_hf's forward (hands its BatchNorms their conv
    outputs, :func:`act_hf.nn.norm.norm_of_owned`; timm's attention modules their compressed attention); elsewhere
    it runs its original one."""
    return module.training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


class ActModule:
    """Mixin: attributes and helpers shared by every act_hf module.

    Attributes:
        act_slot: the module path used to name its slots (``"<path>:<role>"``); the patcher sets it.
        act_bits: default bits of this module's quantized slots (the allocator may override per slot).
        act_group_size: quantization group size.
        act_swap: swap the packed context to pinned host memory (see :mod:`act_hf.swap`).
        act_channel_scale: equalize the channels of the last dimension before quantizing (ActConfig's
            ``channel_scale``); it takes effect only in classes whose saved tensors gain from it
            (``act_channel_scalable``: LayerNorm and RMSNorm, whose contexts are the hidden states; see the
            README, "Channel scaling").
        act_share_residual: a conv fed by a residual block's ``relu(bn(.) + shortcut)`` reads its input
            from the tensors the ops before it saved (ActConfig's ``share_residual``, :mod:`act_hf.derived`).
    """

    act_slot: str = ""
    act_bits: int = 3
    act_group_size: int = 256
    act_swap: bool = False
    act_channel_scale: bool = False
    act_channel_scalable: bool = False
    act_data_bits: int = 0
    act_slot_bits: dict[str, int] | None = None
    act_share_residual: bool = False
    act_original_class: type | None = None

    def act_configure(self, *, slot: str | None = None, bits: int | None = None, group_size: int | None = None,
                      swap: bool | None = None, channel_scale: bool | None = None, data_bits: int | None = None):
        """Set slot name, bits, group size, swap, channel scaling and the data-bits floor (only the ones given)."""
        if slot is not None:
            self.act_slot = slot
        if bits is not None:
            self.act_bits = bits
        if group_size is not None:
            self.act_group_size = group_size
        if swap is not None:
            self.act_swap = swap
        if channel_scale is not None:
            self.act_channel_scale = channel_scale
        if data_bits is not None:
            self.act_data_bits = data_bits
        return self

    def act_base_settings(self, slot: str | None = None, bits: int | None = None) -> OpSettings:
        """Settings named after the module itself (slot ``<act_slot>``; ``slot`` and ``bits`` replace the name and
        the module's bits); ops derive per-role slots from them."""
        return OpSettings(slot=slot or self.act_slot or type(self).__name__,
                          bits=self.act_bits if bits is None else bits,
                          group_size=self.act_group_size, swap=self.act_swap,
                          channel_scale=self.act_channel_scale and self.act_channel_scalable,
                          data_bits=self.act_data_bits, slot_bits=self.act_slot_bits,
                          share_residual=self.act_share_residual)

    def act_slot_name(self, role: str = "input") -> str:
        """The name of the slot ``<act_slot>:<role>``."""
        return f"{self.act_slot or type(self).__name__}:{role}"

    def act_settings(self, role: str = "input") -> OpSettings:
        """Settings for the slot ``<act_slot>:<role>``, with the bits the allocator gave it."""
        slot = self.act_slot_name(role)
        return self.act_base_settings(slot, store.bits_for(slot, self.act_bits, self.act_slot_bits))

    def __reduce_ex__(self, protocol):
        """Pickling (``torch.save(model)``, ``copy.deepcopy``) names a class made at run time by the pair it was
        made from (:func:`act_class_for`), since it cannot be imported by name."""
        reduced = super().__reduce_ex__(protocol)
        mixin = type(self).__dict__.get("act_mixin")
        if mixin is None or not isinstance(reduced, tuple):  # a predefined class: importable as it is
            return reduced
        return (_new_act_module, (type(self).act_original_class, mixin), *reduced[2:])

    def act_enabled(self, *inputs: torch.Tensor | None) -> bool:
        """Compress only when training with autograd recording something this module must save for."""
        if not trains_with_grad(self):
            return False
        if any(t is not None and t.requires_grad for t in inputs):
            return True
        return any(p.requires_grad for p in self.parameters(recurse=False))  # type: ignore[attr-defined]

    def act_owns_intermediates(self, *inputs: torch.Tensor | None) -> bool:
        """Whether a converted block runs act_hf's forward, whose tensors made inside it are its own to overwrite
        (an activation written into the linear's output): when compressing (:meth:`act_enabled`), and in a training
        forward that autograd does not record (a packed checkpoint's first pass, :mod:`act_hf.checkpoint`), where
        nothing is saved and the unpatched forward would hold two full-size tensors at once for nothing."""
        return self.act_enabled(*inputs) or (self.training and not torch.is_grad_enabled())


def register_act_class(original: type, mixin: type, cls: type) -> type:
    """Use the predefined ``cls`` (e.g. ``ActLinear``) when converting an exact ``original`` with ``mixin``."""
    cls.act_original_class = original
    _CLASS_CACHE[(original, mixin)] = cls
    return cls


def act_class_for(original: type, mixin: type) -> type:
    """The class ``(mixin, original)``, made once per pair; a class already combined with ``mixin`` is kept."""
    if issubclass(original, mixin):
        return original
    key = (original, mixin)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        cls = type(f"Act{original.__name__}", (mixin, original), {"__module__": mixin.__module__,
                                                                   "act_original_class": original, "act_mixin": mixin})
        _CLASS_CACHE[key] = cls
    return cls


def _new_act_module(original: type, mixin: type) -> nn.Module:
    """An uninitialised instance of ``act_class_for(original, mixin)`` (the unpickler sets its state)."""
    cls = act_class_for(original, mixin)
    return cls.__new__(cls)


def convert(module: nn.Module, mixin: type, *, slot: str = "", bits: int = 3, group_size: int = 256,
            swap: bool = False, channel_scale: bool = False, data_bits: int = 0) -> nn.Module:
    """Turn ``module`` into its act_hf version in place (same object, parameters and state dict)."""
    module.__class__ = act_class_for(type(module), mixin)
    module.act_configure(slot=slot, bits=bits, group_size=group_size, swap=swap,  # type: ignore[attr-defined]
                         channel_scale=channel_scale, data_bits=data_bits)
    return module


def revert(module: nn.Module) -> nn.Module:
    """Undo :func:`convert` in place; a module that was not converted is returned unchanged."""
    original = getattr(type(module), "act_original_class", None)
    if original is not None:
        module.__class__ = original
        for attr in [a for a in module.__dict__ if a.startswith("act_")]:
            del module.__dict__[attr]
    return module
