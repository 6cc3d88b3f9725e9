"""Public quantizer API: validation and dispatch to the ``torch.ops.act_hf`` kernels."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import torch

from .._chunks import in_place
from .._constants import reused
from ..errors import ActHFTypeError, ActHFValueError
from ..ops import _library
from .packed import PackedSpec, PackedTensor
from .reference import CHAIN_TERMS, channel_shifts, empty_packed, lo_dtype_for, place_packed, zero_unmasked
from .rng import resolve_seed

__all__ = ["CHANNEL_SCALE_MIN_ROWS", "DEFAULT_GROUP_SIZE", "SUPPORTED_DTYPES", "check_bits", "check_group_size",
           "dequantize", "dequantize_affine", "dequantize_chain", "dequantize_inverse_affine", "dequantize_items",
           "dequantize_mapped", "dequantize_with_factors", "quantize", "quantize_by_rows", "quantize_normalized"]

DEFAULT_GROUP_SIZE = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
CHANNEL_SCALE_MIN_ROWS = 64
"""Channel scaling applies to tensors with at least this many rows (``numel // shape[-1]``): its four bytes per
channel then cost at most 1/2 bit per element (1/64 at 4096 rows, a batch of 32 x 128 tokens)."""
_MAX_CHANNEL_SHIFT = {torch.float16: 15}  # 2**15 is fp16's largest power of two; other dtypes take 24


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
    channel_scale: bool = False,
) -> PackedTensor:
    """Per-group stochastically rounded quantization of ``x`` into a dense bit stream.

    Groups are contiguous runs of ``group_size`` elements in row-major order (along the last dimension,
    continuing into the next row): constant metadata cost per element whatever the shape, and one flat pass
    per direction in the kernel. A permuted view of a dense tensor (attention's ``(B, H, S, D)`` query over a
    ``(B, S, H * D)`` projection, a channels-last image) is read in the order it lies in memory instead, without a
    contiguous copy, and decodes to its own layout (``spec.memory_order``). Each group stores a zero point and a
    scale (two 16-bit numbers, 32 / ``group_size`` bits per element), both rounded outward, and quantization uses
    the stored values, so ``E[dequantize(quantize(x))] == x``. Full format: ``act_hf.compress.reference``.

    With ``channel_scale``, every channel of the last dimension is first multiplied by a power of two
    ``2**k[c]`` that brings its largest magnitude within a factor 2 of the largest channel's, never above
    it, and decoding divides it back out. Transformer hidden states have a few outlier channels (tens of times
    the typical magnitude) that set the range of every group they fall in; equalized, a group's levels cover all its
    channels (pretrained MiniLM's layer inputs at 4 bits: relative error 0.42 -> 0.18, README). The shift is
    exact (a power of two, never past the largest channel, so nothing overflows), so the estimate stays
    unbiased; decoding's division rounds only results below the dtype's smallest normal number (fp16:
    6.1e-5). It costs four bytes per channel (``k`` is at most 24, 15 for fp16; kept as the ``float32`` factor
    ``2**-k`` that decoding multiplies by, looked up once here rather than by every op that decodes the context),
    and it applies only when ``x`` has at least 2 dimensions and :data:`CHANNEL_SCALE_MIN_ROWS` rows; otherwise
    the result is unscaled (``spec.channel_scaled`` says which). A contiguous fp32, fp16 or bf16 ``x`` is scaled by
    the kernel as it reads it (``quantize_pack_scaled``); other layouts and fp64 are scaled into a copy first. The
    bits are the same.

    Args:
        x: floating tensor (fp32, fp16, bf16; fp64 is accepted and computed in fp32), any shape and layout.
        bits: code width, an integer from 1 to 8.
        group_size: elements per group, a positive multiple of 8.
        seed: ``None`` draws from act_hf's own stream (never the global RNG); an ``int`` or a CPU
            ``torch.Generator`` gives reproducible draws.
        channel_scale: equalize the last dimension's channels by powers of two before grouping (above).

    Returns:
        The :class:`PackedTensor` (``nbytes == ceil(numel*bits/8) + 4*ceil(numel/group_size)``, plus
        ``4 * shape[-1]`` bytes when channel-scaled).

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
    x = x.detach()
    shifts = _channel_shifts(x) if channel_scale and _scalable(x) else None
    # a contiguous x is scaled by the kernel as it reads it (no scaled copy); fp64 is scaled before its cast
    in_kernel = shifts is not None and x.is_contiguous() and x.dtype != torch.float64
    if shifts is not None and not in_kernel:
        x = x * _powers_of_two(shifts, x.dtype)  # keeps x's layout
    order = _memory_order(x)
    spec = PackedSpec(shape=x.shape, dtype=x.dtype, bits=bits, group_size=group_size,
                      channel_scaled=shifts is not None, memory_order=order)
    flat = (x if order is None else x.permute(order)).reshape(-1)  # a view unless x is not dense
    if in_kernel:
        payload, lo, scale = _library.run(_library.quantize_pack_scaled, flat, shifts, bits, group_size,
                                          resolve_seed(seed))
    else:
        payload, lo, scale = _library.run(_library.quantize_pack, flat, bits, group_size, resolve_seed(seed))
    # kept as the factors 2**-k that decoding multiplies by (the same four bytes a channel as the shifts): no
    # consumer of the context looks them up again
    return PackedTensor(payload, lo, scale, spec, None if shifts is None else _powers_of_two(shifts, torch.float32,
                                                                                              negate=True))


def quantize_by_rows(make: Callable[[int, int], torch.Tensor], shape: tuple[int, ...] | torch.Size, bits: int = 3,
                     group_size: int = DEFAULT_GROUP_SIZE, *, chunk: int) -> PackedTensor:
    """``quantize(x, bits, group_size)`` (unscaled) of the ``x`` of ``shape`` whose rows ``start:stop`` along
    dim 0 are ``make(start, stop)``, made and packed slice by slice: no full-size ``x`` is ever alive, only a
    slice of about ``chunk`` elements. A BatchNorm packs its normalized input so (made whole, it was 1.5 of the
    9.1 MiB a sample alive at resnet50's forward peak on the GPU).

    Slices hold whole groups (their element counts are multiples of ``group_size``) and dim 0 is the outermost
    in the order each is packed, so their streams, laid end to end, are the stream of ``x``. Each slice draws
    its own seed: the same distribution as one ``quantize(x)``, not the same draws. When one slice would hold
    all the rows (whole groups may need many), or the slices lie with dim 0 inside (then the first is made
    twice), ``x`` is made whole and quantized at once.

    Args:
        make: ``(start, stop) -> rows start..stop-1 of x``; every slice has one dtype and layout.
        shape: the shape of ``x``.
        bits: code width, an integer from 1 to 8.
        group_size: elements per group, a positive multiple of 8.
        chunk: about how many elements a slice holds.
    """
    check_bits(bits)
    check_group_size(group_size)
    if not len(shape):
        raise ActHFValueError("shape: a 0-dim tensor has no rows to make it by")
    rows = shape[0]
    per_row = math.prod(shape[1:])
    align = group_size // math.gcd(per_row, group_size) if per_row else rows  # rows that make whole groups
    step = max(align, chunk // max(per_row, 1) // align * align)
    if step >= rows:
        return quantize(make(0, rows), bits, group_size)
    parts = (quantize(make(start, min(rows, start + step)), bits, group_size) for start in range(0, rows, step))
    first = next(parts)
    order = first.spec.memory_order
    if order is not None and order[0] != 0:
        return quantize(make(0, rows), bits, group_size)
    spec = PackedSpec(shape=torch.Size(shape), dtype=first.spec.dtype, bits=bits, group_size=group_size,
                      memory_order=order)
    out = empty_packed(spec.numel, bits, group_size, first.payload.device)
    begin = 0
    for part in itertools.chain((first,), parts):
        if part.spec.memory_order != order or part.spec.dtype != spec.dtype:
            raise ActHFValueError(f"make: every slice needs one dtype and layout, got {spec.dtype} laid out as "
                                  f"{order} and {part.spec.dtype} as {part.spec.memory_order}")
        place_packed(out, begin, bits, group_size, (part.payload, part.lo, part.scale))
        begin += part.spec.numel
    return PackedTensor(*out, spec, None)


def quantize_normalized(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, bits: int = 3,
                        group_size: int = DEFAULT_GROUP_SIZE, *, seed: int | torch.Generator | None = None
                        ) -> PackedTensor:
    """``quantize`` of ``x`` normalized per channel of dim 1, ``(x - mean[c]) * invstd[c]``, in fp32 (the
    difference and the product each rounded; never rounded to ``x``'s dtype), without the normalized tensor: the
    kernel normalizes as it reads ``x``. BatchNorm's normalized input. The result decodes like a quantized tensor of
    ``x``'s shape and dtype.

    Args:
        x: a contiguous float32 or bfloat16 tensor of at least 2 dims (batch, channels, ...). fp16 is refused: its
            zero points round to nearest, and a normalized minimum is not an fp16 number.
        mean, invstd: float32, one value per channel of dim 1.
        bits, group_size, seed: as :func:`quantize`.
    """
    if not isinstance(x, torch.Tensor):
        raise ActHFTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() < 2 or not x.is_contiguous():
        raise ActHFValueError(f"x must be a contiguous float32 or bfloat16 tensor of at least 2 dims, got a "
                              f"{'' if x.is_contiguous() else 'non-contiguous '}{x.dtype} tensor of shape "
                              f"{tuple(x.shape)}")
    _check_per_channel(x.shape[1], "x's dim 1", mean=mean, invstd=invstd)
    check_bits(bits)
    check_group_size(group_size)
    x = x.detach()
    spec = PackedSpec(shape=x.shape, dtype=x.dtype, bits=bits, group_size=group_size)
    inner = math.prod(x.shape[2:])
    payload, lo, scale = _library.run(_library.quantize_pack_normalized, x.view(-1), mean.contiguous(),
                                      invstd.contiguous(), max(inner, 1), bits, group_size, resolve_seed(seed))
    return PackedTensor(payload, lo, scale, spec, None)


def _memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The permutation ``order`` for which ``x.permute(order)`` is contiguous, when ``x`` is a non-contiguous
    permuted view of a dense tensor (a transpose, channels-last); ``None`` for a contiguous ``x`` and for one that
    no permutation makes contiguous (a strided slice, an expanded view), which is read in row-major order.
    Also ``None`` while torch.compile traces (the row-major copy): dynamo in torch 2.11 fails on the sort."""
    if x.is_contiguous() or torch.compiler.is_compiling():
        return None
    order = tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))  # stable: ties keep the logical order
    return order if x.permute(order).is_contiguous() else None


def _scalable(x: torch.Tensor) -> bool:
    return x.dim() >= 2 and x.shape[-1] > 0 and x.numel() // x.shape[-1] >= CHANNEL_SCALE_MIN_ROWS


def _channel_shifts(x: torch.Tensor) -> torch.Tensor:
    """The shifts ``k`` (``int32``, one per channel of the last dimension) of :func:`quantize`'s channel scaling,
    :func:`act_hf.compress.reference.channel_shifts`: for a contiguous ``x`` the ``channel_shifts`` op (on a GPU
    one kernel for the channels' largest magnitudes and one for the shifts), else the reference's reductions."""
    max_shift = _MAX_CHANNEL_SHIFT.get(x.dtype, 24)
    if x.is_contiguous():
        return _library.run(_library.channel_shifts, x.view(-1), x.shape[-1], max_shift)
    return channel_shifts(x, max_shift)


def _powers_of_two(shifts: torch.Tensor, dtype: torch.dtype, *, negate: bool = False) -> torch.Tensor:
    """``2**shifts`` (``2**-shifts`` with ``negate``) in ``dtype``, looked up in a table of the exact powers (one
    device op for ``int32`` or ``int64`` shifts, as packed tensors keep them; other integers are cast first)."""
    index = shifts if shifts.dtype in (torch.int32, torch.int64) else shifts.to(torch.int32)
    return reused(_cached_power_table, shifts, shifts.device, dtype, negate).index_select(0, index)


def _power_table(device: torch.device, dtype: torch.dtype, negate: bool) -> torch.Tensor:
    """``2**k`` (``2**-k``) for ``k`` in ``0..24`` in ``dtype`` on ``device`` (fp16 holds the powers it is
    shifted by, up to 15)."""
    powers = torch.tensor([2.0 ** (-k if negate else k) for k in range(25)], dtype=torch.float32)
    return powers.to(dtype).to(device)


#: :func:`_power_table` made once per device and dtype (one host-to-device copy)
_cached_power_table = functools.lru_cache(maxsize=64)(_power_table)


def dequantize(packed: PackedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode a :class:`PackedTensor` into a new tensor of its original shape: contiguous, or laid out like the
    original when that was a permuted view of a dense tensor (``spec.memory_order``).

    ``dtype`` (default: the original's) is the result's: the fp32 decode rounds once, straight to it (an fp32
    context read by a bf16 matmul needs no fp32 copy), except between fp16 and the other dtypes, whose zero
    points are stored differently: those decode to the original's dtype and are then cast."""
    values, factors = dequantize_with_factors(packed, dtype)
    return values if factors is None else in_place(values, torch.Tensor.mul_, factors)


def dequantize_with_factors(packed: PackedTensor,
                            dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, factors)`` with ``values * factors`` equal to ``dequantize(packed, dtype)``, bit for bit:
    a channel-scaled context's values before the division by its powers of two, and ``factors`` (``2**-k``,
    ``float32``, one per channel of the last dimension, broadcasting against ``values``; a product of ``values``
    and them, computed in fp32 and rounded to ``values``' dtype, is exact there as in that dtype). A caller folds
    them into something smaller than the decoded tensor (a weight gradient's columns, a norm's affine
    parameters) and saves a pass over it; powers of two commute with rounding, so the results are the same
    (away from overflow and subnormal numbers). ``factors`` is ``None`` when there is nothing to fold: the
    context is not channel scaled, or it decodes through a cast (fp16 and the other dtypes), whose values come
    scaled."""
    if not isinstance(packed, PackedTensor):
        raise ActHFTypeError(f"packed must be a PackedTensor, got {type(packed).__name__}")
    spec = packed.spec
    dtype = _reader_dtype(spec, dtype)
    direct = lo_dtype_for(dtype) == lo_dtype_for(spec.dtype)
    flat = _library.run(_library.unpack_dequantize, packed.payload, packed.lo, packed.scale, spec.bits,
                        spec.group_size, spec.numel, dtype if direct else spec.dtype)
    return _with_factors(packed, spec.laid_out(flat), dtype, direct)


def dequantize_affine(packed: PackedTensor, mult: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``dequantize(packed, torch.float32) * mult - shift``, bit for bit, ``mult`` and ``shift`` (fp32, one value
    per channel of the last dimension) broadcasting over the rows; the product and the difference each rounded (no
    fused multiply-add). A norm's ``x_hat = (y - beta) / gamma`` from its saved output, as ``y * (1 / gamma) -
    beta / gamma``. In one pass, decoding and mapping together, for a context stored row-major that decodes
    straight to fp32 (every original but fp16), a channel-scaled one's factors folded into ``mult`` (powers of two:
    the same bits); otherwise a decode and two passes over it."""
    _check_affine(packed, mult=mult, shift=shift)
    if not _affine_in_one_pass(packed.spec):
        return dequantize(packed, torch.float32).mul_(mult).sub_(shift)
    return _affine_decode(packed, mult * packed.channel if packed.spec.channel_scaled else mult, shift)


def dequantize_inverse_affine(packed: PackedTensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                              divisor: torch.Tensor | None = None) -> torch.Tensor:
    """``(dequantize(packed, torch.float32) - bias) / weight`` (``bias`` ``None``: zero) over the last dimension's
    channels, a norm's ``x_hat`` from its saved output: :func:`dequantize_affine` with ``mult = 1 / weight`` and
    ``shift = bias / weight``, bit for bit. A channel-scaled context's factors ``f`` go into the reciprocal as ``f /
    weight``, the bits of ``f * (1 / weight)`` (powers of two) in one op less.

    With ``divisor`` (float32, one value a row: ``numel // shape[-1]`` of them), each row of the result then times
    the reciprocal of its divisor, the reciprocal and the product each rounded: a LayerNorm's ``x_hat / rstd``,
    its input less its mean, whose backward then takes the real ``rstd`` and needs no pass for it. In the same one
    pass where that takes the context; otherwise a pass of its own after the decode and the map's passes (one
    without a bias: no zero shift is subtracted)."""
    _check_affine(packed, weight=weight, **({} if bias is None else {"bias": bias}))
    if divisor is not None:
        rows = packed.spec.numel // max(packed.spec.shape[-1] if packed.spec.shape else 1, 1)
        if not isinstance(divisor, torch.Tensor) or divisor.dtype != torch.float32 or divisor.numel() != rows:
            got = (f"{divisor.dtype} of {divisor.numel()} values" if isinstance(divisor, torch.Tensor)
                   else type(divisor).__name__)
            raise ActHFValueError(f"divisor must be a float32 tensor of {rows} values, one per row of the packed "
                                  f"tensor's last dimension, got {got}")
    if not _affine_in_one_pass(packed.spec):  # a decode and a pass or two (and one for the divisor)
        if bias is None:  # v * m - 0 is v * m, bit for bit: no pass for a zero shift
            decoded = dequantize(packed, torch.float32).mul_(weight.reciprocal())
        else:
            decoded = dequantize_affine(packed, weight.reciprocal(), bias / weight)
        if divisor is None:
            return decoded
        return decoded.mul_(torch.reciprocal(divisor).reshape(*packed.spec.shape[:-1], 1))
    shift = torch.zeros_like(weight) if bias is None else bias / weight
    return _affine_decode(packed, packed.channel / weight if packed.spec.channel_scaled else weight.reciprocal(),
                          shift, divisor)


def _check_affine(packed: PackedTensor, **per_channel: torch.Tensor) -> None:
    if not isinstance(packed, PackedTensor):
        raise ActHFTypeError(f"packed must be a PackedTensor, got {type(packed).__name__}")
    channels = packed.spec.shape[-1] if packed.spec.shape else 1
    _check_per_channel(channels, "the packed tensor's last dimension", **per_channel)


def _affine_in_one_pass(spec: PackedSpec) -> bool:
    """Whether the affine decode kernel takes the context: stored row-major, not empty, decoding straight to fp32
    (every original but fp16)."""
    return spec.memory_order is None and spec.numel > 0 and lo_dtype_for(spec.dtype) == lo_dtype_for(torch.float32)


def _affine_decode(packed: PackedTensor, mult: torch.Tensor, shift: torch.Tensor,
                   divisor: torch.Tensor | None = None) -> torch.Tensor:
    """``unpack_dequantize_affine``: each stored value ``v`` (before any channel factors) to ``v * mult - shift``
    (with ``divisor``, that times the reciprocal of its row's), in fp32 and ``packed``'s layout."""
    spec = packed.spec
    flat = _library.run(_library.unpack_dequantize_affine, packed.payload, packed.lo, packed.scale, spec.bits,
                        spec.group_size, spec.numel, mult.contiguous(), shift.contiguous(),
                        None if divisor is None else divisor.reshape(-1).contiguous())
    return spec.laid_out(flat)


def dequantize_mapped(packed: PackedTensor, weight: torch.Tensor, bias: torch.Tensor, *,
                      out: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                      items: tuple[int, int] | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(packed)``'s batch ``items`` (default: all), each value ``v`` of channel ``c`` (dim 1) mapped to
    ``v * weight[c] + bias[c]``, added to ``out`` when given (in place; it is returned), else into a new contiguous
    tensor of ``dtype`` (default: the original's), the elements whose bit of ``mask`` (1-bit, packed, in the
    result's row-major order) is 0 set to ``+0``. The decode, the map and the sum are fp32 (fp64 into an fp64
    result), each operation rounded (no fused multiply-add), and the result is rounded once. A BatchNorm output read
    from its packed normalized input, ``gamma * x_hat + beta``, and the sums and ReLUs of residual blocks built from
    such outputs (:mod:`act_hf.derived`): in one pass over the result for a row-major context without channel scaling
    whose zero points are those of the result's dtype (every original but fp16 into fp32 or bf16); otherwise a decode
    (:func:`dequantize`) and the same operations after it.

    Args:
        weight, bias: fp32, one value per channel of dim 1.
        out: a contiguous tensor of the items' shape (a floating dtype), or ``None``.
        items: ``(start, stop)`` along dim 0, decoding only the groups that hold them.
        mask: ``uint8``, bit ``k`` of byte ``k // 8`` (lowest first) for element ``k`` of the result, or ``None``.
    """
    if not isinstance(packed, PackedTensor):
        raise ActHFTypeError(f"packed must be a PackedTensor, got {type(packed).__name__}")
    spec = packed.spec
    if len(spec.shape) < 2:
        raise ActHFValueError(f"packed: needs a tensor of at least 2 dims (batch, channels, ...), got {spec.shape}")
    channels = spec.shape[1]
    _check_per_channel(channels, "the packed tensor's dim 1", weight=weight, bias=bias)
    start, stop = (0, spec.shape[0]) if items is None else items
    if not 0 <= start <= stop <= spec.shape[0]:
        raise ActHFValueError(f"items: need 0 <= start <= stop <= {spec.shape[0]} (the first dim), got {items}")
    shape = (stop - start, *spec.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=_reader_dtype(spec, dtype), device=packed.payload.device)
        accumulate = False
    elif tuple(out.shape) != shape or not out.is_contiguous() or out.dtype not in SUPPORTED_DTYPES:
        raise ActHFValueError(f"out must be a contiguous float32, float16, bfloat16 or float64 tensor of shape "
                              f"{shape}, got {out.dtype} of shape {tuple(out.shape)}")
    else:
        accumulate = True
    per_item = math.prod(spec.shape[1:])
    if out.numel() and _decodes_into(spec, out.dtype, start * per_item):
        _library.run(_library.unpack_dequantize_chain, out, [packed.payload], [packed.lo], [packed.scale],
                     [weight.contiguous()], [bias.contiguous()], [mask], spec.bits, spec.group_size, spec.numel,
                     start * per_item, per_item // max(channels, 1), accumulate)
        return out
    wide = torch.promote_types(out.dtype, torch.float32)
    decoded = dequantize(packed, wide) if items is None else dequantize_items(packed, start, stop, wide)
    view = (1, -1) + (1,) * (len(shape) - 2)
    values = (decoded * weight.to(wide).view(view) + bias.to(wide).view(view)).contiguous()
    if accumulate:
        values = out.to(wide) + values
    if mask is not None:
        values = zero_unmasked(values.view(-1), mask).view(shape)
    return out.copy_(values)


def _decodes_into(spec: PackedSpec, dtype: torch.dtype, first: int) -> bool:
    """Whether ``unpack_dequantize_chain`` decodes ``spec``'s elements from
    ``first`` on into a tensor of ``dtype`` in one pass: a row-major context without channel scaling, whose zero
    points are those of ``dtype``, not fp64, from an element that starts an octet."""
    return (spec.memory_order is None and not spec.channel_scaled and first % 8 == 0 and dtype != torch.float64
            and lo_dtype_for(dtype) == lo_dtype_for(spec.dtype))


#: a term of :func:`dequantize_chain`: ``(packed, weight, bias, mask)``
ChainTerm = tuple[PackedTensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def dequantize_chain(terms: list[ChainTerm] | tuple[ChainTerm, ...], *, dtype: torch.dtype | None = None,
                     items: tuple[int, int] | None = None) -> torch.Tensor:
    """A sum of :func:`dequantize_mapped` terms with a mask after any of them, as a new contiguous tensor of
    ``dtype`` (default: the first term's original dtype): ``v`` is the first term's map, each next term's is added
    to it, and after each term with a ``mask`` the elements whose bit is 0 are set to ``+0``. A residual chain's
    block input ``relu(bn3(.) + relu(bn3'(.) + ...))`` (:mod:`act_hf.derived`), innermost term first.

    Where every term is decoded into the result in one pass by :func:`dequantize_mapped` and all share the first's
    bits and group size, the result is written once for up to ``CHAIN_TERMS`` (8) terms
    (``act_hf::unpack_dequantize_chain``): ``v`` fp32 from a pass's first term to its last, rounded once at its end;
    otherwise term by term with :func:`dequantize_mapped`, rounded after each.

    Args:
        terms: ``(packed, weight, bias, mask)``, packed tensors of one shape of at least 2 dims, ``weight`` and
            ``bias`` fp32 with one value per channel of dim 1, ``mask`` ``uint8``, bit ``k`` of byte ``k // 8``
            (lowest first) for element ``k`` of the result, or ``None``.
        items: ``(start, stop)`` along dim 0, decoding only the groups that hold them.
    """
    if not terms:
        raise ActHFValueError("terms: needs at least one (packed, weight, bias, mask), got none")
    first = terms[0][0]
    for packed, weight, bias, _ in terms:
        if not isinstance(packed, PackedTensor):
            raise ActHFTypeError(f"terms: each packed must be a PackedTensor, got {type(packed).__name__}")
        if packed.spec.shape != first.spec.shape or len(packed.spec.shape) < 2:
            raise ActHFValueError(f"terms: packed tensors of one shape of at least 2 dims, got "
                                  f"{tuple(packed.spec.shape)} after {tuple(first.spec.shape)}")
        _check_per_channel(first.spec.shape[1], "the packed tensor's dim 1", weight=weight, bias=bias)
    spec = first.spec
    start, stop = (0, spec.shape[0]) if items is None else items
    if not 0 <= start <= stop <= spec.shape[0]:
        raise ActHFValueError(f"items: need 0 <= start <= stop <= {spec.shape[0]} (the first dim), got {items}")
    out_dtype = _reader_dtype(spec, dtype)
    per_item = math.prod(spec.shape[1:])
    if (stop > start and all(_decodes_into(p.spec, out_dtype, start * per_item) and p.spec.bits == spec.bits
                             and p.spec.group_size == spec.group_size for p, *_ in terms)):
        out = torch.empty((stop - start, *spec.shape[1:]), dtype=out_dtype, device=first.payload.device)
        for i in range(0, len(terms), CHAIN_TERMS):
            part = terms[i:i + CHAIN_TERMS]
            packed, weights, biases, masks = zip(*part)
            _library.run(_library.unpack_dequantize_chain, out, [p.payload for p in packed], [p.lo for p in packed],
                         [p.scale for p in packed], [w.contiguous() for w in weights],
                         [b.contiguous() for b in biases], list(masks), spec.bits, spec.group_size, spec.numel,
                         start * per_item, per_item // spec.shape[1], i > 0)
        return out
    values = None
    for packed, weight, bias, mask in terms:
        values = dequantize_mapped(packed, weight, bias, out=values, dtype=out_dtype, items=items, mask=mask)
    return values


def _check_per_channel(channels: int, where: str, **factors: torch.Tensor) -> None:
    """Each of ``factors`` is a float32 tensor of shape ``(channels,)``, one value per channel of ``where``; the
    error names the first that is not."""
    for name, t in factors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (channels,):
            got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ActHFValueError(f"{name} must be a float32 tensor of shape ({channels},), one value per channel "
                                  f"of {where}, got {got}")


def _reader_dtype(spec: PackedSpec, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a decode returns: ``dtype``, or the original's for ``None``."""
    if dtype is None:
        return spec.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ActHFValueError(f"dtype must be one of float32, float16, bfloat16 or float64, got {dtype}")
    return dtype


def dequantize_items(packed: PackedTensor, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dequantize(packed, dtype)[start:stop]``, bit for bit, decoding only the groups that hold items
    ``start..stop-1`` of the first dim (a chunk of the batch) when that dim is the outermost in the order the
    payload stores (row-major, or a ``spec.memory_order`` that starts with it); otherwise the whole tensor is
    decoded and sliced. A backward that works chunk by chunk then never holds the whole decoded tensor."""
    if not isinstance(packed, PackedTensor):
        raise ActHFTypeError(f"packed must be a PackedTensor, got {type(packed).__name__}")
    spec = packed.spec
    if len(spec.shape) == 0:
        raise ActHFValueError("packed: a 0-dim tensor has no items to decode")
    if not 0 <= start <= stop <= spec.shape[0]:
        raise ActHFValueError(f"start, stop: need 0 <= start <= stop <= {spec.shape[0]} (the first dim), got "
                              f"{start}, {stop}")
    order = spec.memory_order
    if (start, stop) == (0, spec.shape[0]) or order is not None and order[0] != 0:
        return dequantize(packed, dtype)[start:stop]
    dtype = _reader_dtype(spec, dtype)
    per_item, size, bits = spec.numel // max(spec.shape[0], 1), spec.group_size, spec.bits
    begin, end = start * per_item, stop * per_item
    first, last = (begin // size, -(-end // size)) if end > begin else (0, 0)  # the groups holding the items
    numel = min(last * size, spec.numel) - first * size
    offset = first * size * bits // 8  # a whole number of bytes: group sizes are multiples of 8
    payload = packed.payload[offset:offset + -(-numel * bits // 8)]
    direct = lo_dtype_for(dtype) == lo_dtype_for(spec.dtype)
    flat = _library.run(_library.unpack_dequantize, payload, packed.lo[first:last], packed.scale[first:last], bits,
                        size, numel, dtype if direct else spec.dtype)
    values = spec.laid_out(flat[begin - first * size:end - first * size], (stop - start, *spec.shape[1:]))
    values, factors = _with_factors(packed, values, dtype, direct)
    return values if factors is None else in_place(values, torch.Tensor.mul_, factors)


def _with_factors(packed: PackedTensor, out: torch.Tensor, dtype: torch.dtype,
                  direct: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`dequantize_with_factors`' pair for decoded values ``out`` in the original's layout: them in
    ``dtype``, and the channel factors still to apply (``None``: none, or the values came through a cast,
    ``direct`` false, and are scaled already)."""
    spec = packed.spec
    factors = packed.channel if spec.channel_scaled else None
    if direct:
        return out, factors
    return (out if factors is None else in_place(out, torch.Tensor.mul_, factors)).to(dtype), None
