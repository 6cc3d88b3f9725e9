"""Public quantizer API: validation and dispatch to the ``torch.ops.act_hf`` kernels."""

from __future__ import annotations

import torch

from ..errors import ActHFTypeError, ActHFValueError
from ..ops import _library  # noqa: F401  (registers torch.ops.act_hf.*)
from .packed import PackedSpec, PackedTensor
from .rng import resolve_seed

__all__ = ["DEFAULT_GROUP_SIZE", "SUPPORTED_DTYPES", "check_bits", "check_group_size", "dequantize", "quantize"]

DEFAULT_GROUP_SIZE = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_bits(bits: object, name: str = "bits") -> int:
    """Validate an integer bit width 1..8."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise ActHFTypeError(f"{name} must be an integer from 1 to 8, got {bits!r} ({type(bits).__name__})")
    if not 1 <= bits <= 8:
        raise ActHFValueError(f"{name} must be an integer from 1 to 8, got {bits}")
    return bits


def check_group_size(group_size: object) -> int:
    """Validate a group size: a positive multiple of 8 (groups then start on byte boundaries)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ActHFTypeError(f"group_size must be a positive multiple of 8, got {group_size!r}")
    if group_size <= 0 or group_size % 8:
        raise ActHFValueError(f"group_size must be a positive multiple of 8 (e.g. 64, 128, 256), got {group_size}")
    return group_size


def quantize(
    x: torch.Tensor,
    bits: int = 3,
    group_size: int = DEFAULT_GROUP_SIZE,
    *,
    seed: int | torch.Generator | None = None,
) -> PackedTensor:
    """Per-group stochastically rounded quantization of ``x`` into a dense bit stream.

    Groups are contiguous runs of ``group_size`` elements in row-major order (along the last dimension,
    continuing into the next row): constant metadata cost per element whatever the shape, and one flat pass
    per direction in the kernel. Each group stores a zero point and a scale (two 16-bit numbers, 32 /
    ``group_size`` bits per element), both rounded outward, and quantization uses the stored values, so
    ``E[dequantize(quantize(x))] == x``. Full format: ``act_hf.compress.reference``.

    Args:
        x: floating tensor (fp32, fp16, bf16; fp64 is accepted and computed in fp32), any shape and layout.
        bits: code width, an integer from 1 to 8.
        group_size: elements per group, a positive multiple of 8.
        seed: ``None`` draws from act_hf's own stream (never the global RNG); an ``int`` or a CPU
            ``torch.Generator`` gives reproducible draws.

    Returns:
        The :class:`PackedTensor` (``nbytes == ceil(numel*bits/8) + 4*ceil(numel/group_size)``).

    Raises:
        TypeError: ``x`` is not a tensor or ``bits``/``group_size`` are not integers.
        ValueError: integer/bool/complex ``x``, ``bits`` outside 1..8, bad ``group_size``.
    """
    if not isinstance(x, torch.Tensor):
        raise ActHFTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ActHFValueError(
            f"x must be a floating tensor (float32, float16, bfloat16 or float64), got dtype {x.dtype}"
        )
    check_bits(bits)
    check_group_size(group_size)
    spec = PackedSpec(shape=x.shape, dtype=x.dtype, bits=bits, group_size=group_size)
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    payload, lo, scale = torch.ops.act_hf.quantize_pack(flat, bits, group_size, resolve_seed(seed))
    return PackedTensor(payload, lo, scale, spec)


def dequantize(packed: PackedTensor) -> torch.Tensor:
    """Decode a :class:`PackedTensor` into a new contiguous tensor of its original shape and dtype."""
    if not isinstance(packed, PackedTensor):
        raise ActHFTypeError(f"packed must be a PackedTensor, got {type(packed).__name__}")
    spec = packed.spec
    flat = torch.ops.act_hf.unpack_dequantize(
        packed.payload, packed.lo, packed.scale, spec.bits, spec.group_size, spec.numel, spec.dtype
    )
    return flat.view(spec.shape)
