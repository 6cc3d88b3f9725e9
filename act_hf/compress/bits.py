"""Bit packing of small integer codes (few-bit activation codes, 1-bit dropout masks, pooling indices)."""

from __future__ import annotations

import math

import torch

from ..errors import ActHFValueError
from ..ops import _library
from .quantizer import check_bits

__all__ = ["pack_bits", "unpack_bits", "unpack_mask"]


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
