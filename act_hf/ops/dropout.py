"""Dropout whose backward context is the keep-mask packed at 1 bit an element.

PyTorch saves dropout's mask as a ``bool`` byte an element (CUDA, ``native_dropout``) or as the full scaled
noise tensor in the input's dtype (CPU, where ``input * noise`` saves ``noise``). act_hf saves the mask at 1
bit: ``ceil(numel / 8)`` bytes.

Masks are drawn exactly as PyTorch draws them (the same ATen calls on the same generator), so a patched
model's training forward equals the unpatched one's for the same seed. ``at::dropout`` picks one of two paths:

* **fused** (``F.dropout`` on CUDA/XPU/lazy/privateuse1 tensors with ``0 < p < 1``, not in place):
  ``aten.native_dropout(x, p, True)`` returns ``(out, mask)``; its backward is
  ``aten.native_dropout_backward(grad, mask, 1 / (1 - p))``. act_hf calls exactly these two ops (the second as
  ``act_hf::masked_scale``, which reads the mask packed, bit for bit the same).
* **composite** (CPU, and in-place dropout everywhere): ``noise = empty_like(x).bernoulli_(1 - p)``,
  ``noise.div_(1 - p)``, ``out = x * noise`` (``x.mul_(noise)`` in place); the gradient is
  ``grad * noise``. act_hf runs the same four ops, keeps ``noise != 0`` packed, and rebuilds ``noise`` in
  backward as ``where(mask, s, 0)`` with ``s = ones((), dtype).div_(1 - p)`` (the very value each kept
  element of ``noise`` holds: for bf16/fp16 that is ``1/(1-p)`` rounded to the dtype, which is why
  ``native_dropout_backward``'s double scale would not match on CPU).

``p == 0``, ``p == 1``, evaluation, no autograd, an input that needs no gradient, an empty or a nested
tensor: the original ``F.dropout`` runs unchanged.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._constants import zero_scalar
from ..compress import masked_scale, unpack_mask
from ..errors import ActHFValueError
from ._saving import OpSettings
from .activation import _inplace_would_fail, _pack_codes

__all__ = ["ActDropoutFunction", "act_dropout", "uses_fused_dropout"]

logger = logging.getLogger(__name__)

_FUSED_DEVICE_TYPES = ("cuda", "xpu", "lazy", "privateuseone")


def uses_fused_dropout(x: Tensor, p: float, inplace: bool = False) -> bool:
    """Whether ``F.dropout(x, p, True, inplace)`` runs ``aten.native_dropout`` (``is_fused_kernel_acceptable``)."""
    device_type = x.device.type
    fused_device = device_type in _FUSED_DEVICE_TYPES or device_type == torch._C._get_privateuse1_backend_name()
    return not inplace and fused_device and 0.0 < p < 1.0 and x.numel() > 0


class ActDropoutFunction(torch.autograd.Function):
    """``y = dropout(x, p)`` in training mode (``0 < p < 1``), the mask drawn exactly as ``F.dropout`` does.

    Saves (when ``x`` needs a gradient): one ``uint8`` tensor of ``ceil(numel / 8)`` bytes, the keep-mask
    packed at 1 bit an element. ``p`` and the path taken are kept as Python attributes.
    """

    @staticmethod
    def forward(ctx, x: Tensor, p: float, inplace: bool, slot: str) -> Tensor:
        fused = uses_fused_dropout(x, p, inplace)
        if fused:
            out, mask = torch.ops.aten.native_dropout(x, p, True)
        else:
            noise = torch.empty_like(x)
            noise.bernoulli_(1 - p)
            noise.div_(1 - p)
            if inplace:
                out = x.mul_(noise)
                ctx.mark_dirty(x)
            else:
                out = x * noise
            mask = noise != 0
            del noise
        if ctx.needs_input_grad[0]:
            # PyTorch keeps the bool mask (fused) or the noise in x's dtype (composite)
            payload = _pack_codes(mask, 1, slot or "dropout:mask", x.numel() * (1 if fused else x.element_size()))
            ctx.save_for_backward(payload)
        ctx.p, ctx.fused, ctx.shape = p, fused, x.shape
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        (payload,) = ctx.saved_tensors
        p = ctx.p
        if ctx.fused:  # native_dropout_backward with the mask read packed
            grad = masked_scale(grad_out, payload, 1.0 / (1.0 - p))
        else:
            mask = unpack_mask(payload, ctx.shape)
            kept = torch.ones((), dtype=grad_out.dtype, device=grad_out.device).div_(1 - p)
            grad = grad_out * torch.where(mask, kept, zero_scalar(kept))
        return grad, None, None, None


def act_dropout(
    x: Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    *,
    settings: OpSettings | None = None,
) -> Tensor:
    """``F.dropout`` (same arguments, same output and RNG use) saving a 1-bit mask for backward.

    Args:
        x: input tensor.
        p: probability of an element being zeroed, in ``[0, 1]``.
        training: apply dropout (``False``: returns ``x`` as ``F.dropout`` does).
        inplace: modify ``x`` in place.
        settings: only its ``slot`` is used (to name the saved mask in :func:`act_hf.track_saved`).

    Returns:
        The dropout output, bit-identical to ``F.dropout(x, p, training, inplace)`` under the same RNG state.

    Raises:
        ActHFValueError: ``p`` outside ``[0, 1]``.
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ActHFValueError(f"dropout probability p has to be between 0 and 1, but got {p!r}")
    p = float(p)
    if (
        not training
        or p == 0.0
        or p == 1.0
        or x.numel() == 0
        or x.is_nested
        or not (torch.is_grad_enabled() and x.requires_grad)
        or (inplace and _inplace_would_fail(x))
    ):
        return F.dropout(x, p, training, inplace)
    return ActDropoutFunction.apply(x, p, inplace, settings.slot if settings is not None else "")
