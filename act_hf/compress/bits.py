"""Bit packing of small integer codes (few-bit activation codes, 1-bit dropout masks, pooling indices)."""

from __future__ import annotations

import math

import torch

from ..errors import ActHFValueError
from ..ops import _library
from .quantizer import check_bits

__all__ = ["masked_scale", "pack_bits", "unpack_bits", "unpack_mask", "zero_unmasked"]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8`` codes, each below ``2**bits``, into a dense bit stream of ``ceil(numel*bits/8)`` bytes.

    Same stream layout as the quantizer's payload (``act_hf.compress.reference``). The shape is not kept:
    pass ``codes.numel()`` to :func:`unpack_bits`.
    """
    check_bits(bits)
    if codes.dtype not in (torch.uint8, torch.bool):
        raise ActHFValueError(f"codes must be a uint8 or bool tensor, got dtype {codes.dtype}")
    flat = codes.reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return _library.run(_library.pack_bits, flat, bits)


def unpack_bits(payload: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a flat ``uint8`` tensor of ``numel`` codes."""
    check_bits(bits)
    if payload.dtype != torch.uint8:
        raise ActHFValueError(f"payload must be a uint8 tensor, got dtype {payload.dtype}")
    return _library.run(_library.unpack_bits, payload, bits, numel)


def unpack_mask(payload: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The boolean mask of ``shape`` that ``pack_bits(mask, 1)`` packed: a view of the unpacked 0/1 bytes as
    ``bool`` (no copy)."""
    return unpack_bits(payload, 1, math.prod(shape)).view(torch.bool).view(shape)


def zero_unmasked(values: torch.Tensor, mask: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """``torch.where(unpack_mask(mask, values.shape), values, 0)``: ``values`` with the elements whose bit in
    ``mask`` (a 1-bit mask packed in ``values``' logical order) is 0 set to ``+0``, as a new tensor or, with
    ``in_place``, in ``values`` itself (returned). For a contiguous ``values`` one ``act_hf::zero_unmasked`` /
    ``zero_unmasked_inplace``: on the GPU the mask is read packed, never unpacked into memory."""
    if mask.dtype != torch.uint8:
        raise ActHFValueError(f"mask must be a uint8 tensor, got dtype {mask.dtype}")
    if not values.is_contiguous():
        keep = unpack_mask(mask, values.shape)
        return values.masked_fill_(~keep, 0) if in_place else torch.where(keep, values, values.new_zeros(()))
    if in_place:
        _library.run(_library.zero_unmasked_inplace, values.view(-1), mask)
        return values
    return _library.run(_library.zero_unmasked, values.view(-1), mask).view(values.shape)


def masked_scale(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``aten.native_dropout_backward(grad, unpack_mask(mask, grad.shape), scale)``, bit for bit: dropout's input
    gradient from its keep-mask packed at 1 bit in ``grad``'s logical order. For a contiguous ``grad`` one
    ``act_hf::masked_scale``: on the GPU the mask is read packed, never unpacked into memory."""
    if mask.dtype != torch.uint8:
        raise ActHFValueError(f"mask must be a uint8 tensor, got dtype {mask.dtype}")
    if not grad.is_contiguous():
        return torch.ops.aten.native_dropout_backward(grad, unpack_mask(mask, grad.shape), scale)
    return _library.run(_library.masked_scale, grad.view(-1), mask, scale).view(grad.shape)
