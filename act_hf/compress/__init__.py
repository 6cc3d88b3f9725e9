"""Tensor -> packed context -> tensor: per-group stochastic quantization and bit packing."""

from .bits import masked_scale, pack_bits, unpack_bits, unpack_mask, zero_unmasked
from .packed import PackedSpec, PackedTensor
from .quantizer import (
    CHANNEL_SCALE_MIN_ROWS,
    DEFAULT_GROUP_SIZE,
    SUPPORTED_DTYPES,
    check_bits,
    check_group_size,
    dequantize,
    dequantize_affine,
    dequantize_chain,
    dequantize_inverse_affine,
    dequantize_items,
    dequantize_mapped,
    dequantize_with_factors,
    quantize,
    quantize_by_rows,
    quantize_normalized,
)
from .rng import manual_seed

__all__ = [
    "CHANNEL_SCALE_MIN_ROWS",
    "DEFAULT_GROUP_SIZE",
    "SUPPORTED_DTYPES",
    "PackedSpec",
    "PackedTensor",
    "check_bits",
    "check_group_size",
    "dequantize",
    "dequantize_affine",
    "dequantize_chain",
    "dequantize_inverse_affine",
    "dequantize_items",
    "dequantize_mapped",
    "dequantize_with_factors",
    "manual_seed",
    "masked_scale",
    "pack_bits",
    "quantize",
    "quantize_by_rows",
    "quantize_normalized",
    "unpack_bits",
    "unpack_mask",
    "zero_unmasked",
]
