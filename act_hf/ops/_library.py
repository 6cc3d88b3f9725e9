"""The only place that turns kernels into ``torch.ops.act_hf.*`` custom ops.

Every op has a default implementation (the pure-PyTorch reference in ``act_hf.compress.reference``, used on
the CPU), a CUDA implementation (the extension's kernel, or the reference with one warning when the
extension is unavailable) and a fake implementation for ``torch.compile``.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import Tensor

from .. import _ext
from ..compress import reference
from ..errors import ActHFWarning

__all__ = ["pack_bits", "quantize_pack", "unpack_bits", "unpack_dequantize"]

logger = logging.getLogger(__name__)
_warned = False


def _cuda_ext():
    """The extension for a CUDA call, or ``None`` after warning once that the reference is used instead."""
    global _warned
    module = _ext.load()
    if module is None and not _warned:
        _warned = True
        warnings.warn(
            "act_hf's CUDA extension is unavailable, so compression on the GPU runs the slower pure-PyTorch "
            f"reference ({_ext.load_error()}). Build it with: {_ext.BUILD_COMMAND}",
            ActHFWarning,
            stacklevel=3,
        )
    return module


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@torch.library.custom_op("act_hf::quantize_pack", mutates_args=())
def quantize_pack(x: Tensor, bits: int, group_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Flat ``x`` -> ``(payload uint8, lo int16, scale int16)``; see ``act_hf.compress.reference``.

    Without the CUDA extension (on the CPU, say) this is the reference run chunk by chunk, so its temporaries
    stay small instead of about 30 bytes per element of ``x``."""
    payload, lo, scale = reference.quantize_pack_chunked(x, bits, group_size, seed)
    return payload, lo, scale


@quantize_pack.register_kernel("cuda")
def _(x: Tensor, bits: int, group_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    module = _cuda_ext()
    if module is None:
        return reference.quantize_pack_chunked(x, bits, group_size, seed)
    payload, lo, scale = module.quantize_pack(x, bits, group_size, seed)
    return payload, lo, scale


@quantize_pack.register_fake
def _(x: Tensor, bits: int, group_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(x.dim() == 1, lambda: f"quantize_pack expects a flat tensor, got {x.dim()} dims")
    n = x.numel()
    n_groups = _ceil_div(n, group_size)
    return (
        x.new_empty(_ceil_div(n * bits, 8), dtype=torch.uint8),
        x.new_empty(n_groups, dtype=torch.int16),
        x.new_empty(n_groups, dtype=torch.int16),
    )


@torch.library.custom_op("act_hf::unpack_dequantize", mutates_args=())
def unpack_dequantize(
    payload: Tensor, lo: Tensor, scale: Tensor, bits: int, group_size: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Inverse of ``quantize_pack``: a flat tensor of ``numel`` elements of ``dtype`` (chunked like it)."""
    return reference.unpack_dequantize_chunked(payload, lo, scale, bits, group_size, numel, dtype)


@unpack_dequantize.register_kernel("cuda")
def _(payload, lo, scale, bits, group_size, numel, dtype):
    module = _cuda_ext()
    if module is None:
        return reference.unpack_dequantize_chunked(payload, lo, scale, bits, group_size, numel, dtype)
    return module.unpack_dequantize(payload, lo, scale, bits, group_size, numel, dtype)


@unpack_dequantize.register_fake
def _(payload, lo, scale, bits, group_size, numel, dtype):
    torch._check(lo.numel() == _ceil_div(numel, group_size), lambda: "lo has the wrong number of groups")
    return payload.new_empty(numel, dtype=dtype)


@torch.library.custom_op("act_hf::pack_bits", mutates_args=())
def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """``uint8`` codes (< 2**bits) -> dense bit stream of ``ceil(n*bits/8)`` bytes (chunked without the
    extension)."""
    return reference.pack_bits_chunked(codes, bits)


@pack_bits.register_kernel("cuda")
def _(codes: Tensor, bits: int) -> Tensor:
    module = _cuda_ext()
    if module is None:
        return reference.pack_bits_chunked(codes, bits)
    return module.pack_bits(codes, bits)


@pack_bits.register_fake
def _(codes: Tensor, bits: int) -> Tensor:
    return codes.new_empty(_ceil_div(codes.numel() * bits, 8), dtype=torch.uint8)


@torch.library.custom_op("act_hf::unpack_bits", mutates_args=())
def unpack_bits(payload: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of ``pack_bits``: ``numel`` ``uint8`` codes (chunked without the extension)."""
    return reference.unpack_bits_chunked(payload, bits, numel)


@unpack_bits.register_kernel("cuda")
def _(payload: Tensor, bits: int, numel: int) -> Tensor:
    module = _cuda_ext()
    if module is None:
        return reference.unpack_bits_chunked(payload, bits, numel)
    return module.unpack_bits(payload, bits, numel)


@unpack_bits.register_fake
def _(payload: Tensor, bits: int, numel: int) -> Tensor:
    return payload.new_empty(numel, dtype=torch.uint8)
