"""Pure-PyTorch reference of every compression kernel: the specification of the packed format.

The CUDA kernels in ``csrc/*_kernel.cu`` compute exactly the same bits (same hash-based uniforms,
same fp32 operation order, no fused multiply-add that would round otherwise), so tests compare them bit for
bit. This module also runs on the CPU and is the fallback when the extension is missing.

Format of one quantized tensor of ``n`` elements, ``b`` bits, group size ``G``:

* The tensor is read flat in row-major order; group ``g`` is elements ``[g*G, min((g+1)*G, n))``: contiguous
  runs along the last dimension (continuing into the next row when the last dimension is not a multiple of
  ``G``), so the metadata overhead is exactly ``32/G`` bit per element whatever the shape, and a kernel
  needs no shape information. The last group may be partial; nothing is padded.
* Per group two 16-bit numbers, stored as raw ``int16`` bit patterns: ``lo`` (the zero point: the group
  minimum rounded *down* to bf16, or stored exactly as fp16 for fp16 inputs) and ``scale`` (bf16,
  ``(max - lo) / (2**b - 1)`` rounded *up*, and when nonzero at least bf16's smallest normal number ``2**-126``).
  Rounding outward keeps every element inside ``[lo, lo + (2**b - 1) * scale]``, and quantization uses these
  stored values, so the estimator stays unbiased (up to the fp32 rounding of ``(x - lo) / scale`` and the
  draws' 16-bit resolution, below).
* A group holding NaN or Inf stores ``lo = scale = NaN`` and decodes to NaN everywhere: compression never
  hides a divergence. A zero-range group stores ``scale = 0`` and decodes to ``lo`` exactly (exact whenever
  the constant is representable in the metadata dtype: always for fp16/bf16 inputs; for fp32 inputs when
  the value is a bf16 number such as 0, 1 or -10000; otherwise the group is rounded stochastically between
  its two neighbouring bf16 values, unbiased).
* Codes: ``code = clamp(floor((x - lo) * (1 / scale) + u), 0, 2**b - 1)`` in fp32 (each operation rounded, the
  reciprocal once per group: a multiply per element, not a division), ``u`` uniform over the multiples of
  ``2**-16`` in ``[0, 1)`` from :func:`uniform_from_hash`; ``E[lo + code * scale] = x`` to within ``2**-16`` of
  ``scale`` (never above ``x``: the draws' resolution; bf16's own rounding of ``x`` is ``2**-9`` of ``x``).
* Payload: a dense little-endian bit stream, element ``i`` at bits ``[i*b, (i+1)*b)``, stream bit ``k``
  being bit ``k % 8`` of byte ``k // 8``; ``ceil(n * b / 8)`` bytes.
* Decoding: ``lo + code * scale`` in fp32 (a multiply, then an add, each rounded), then cast (round to
  nearest even) to the original dtype.

Few-bit codes of an activation's input (Few-Bit Backward, :mod:`act_hf.fewbit`) use the same bit stream: the code
of ``x`` is the number of a table's sorted bounds ``<= x`` (compared in ``x``'s dtype; NaN counts as above them
all), and backward multiplies the gradient by the table's value for the code, as ``torch.mul`` does.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "BF16_NAN_BITS",
    "CHAIN_TERMS",
    "FP16_NAN_BITS",
    "MIN_NORMAL_SCALE_BITS",
    "channel_absmax",
    "channel_powers",
    "channel_shifts",
    "empty_packed",
    "fewbit_encode_pack",
    "fewbit_encode_pack_chunked",
    "fewbit_grad",
    "fewbit_grad_chunked",
    "lo_dtype_for",
    "masked_scale",
    "metadata_to_float",
    "pack_bits",
    "pack_bits_chunked",
    "place_packed",
    "quantize_pack",
    "quantize_pack_chunked",
    "quantize_pack_normalized",
    "uniform_from_hash",
    "unpack_bits",
    "unpack_bits_chunked",
    "unpack_dequantize",
    "unpack_dequantize_affine",
    "unpack_dequantize_chain",
    "unpack_dequantize_chunked",
    "unpack_dequantize_into",
    "zero_unmasked",
    "zero_unmasked_chunked",
]

BF16_NAN_BITS = 0x7FC0
FP16_NAN_BITS = 0x7E00
MIN_NORMAL_SCALE_BITS = 0x0080
"""bf16's smallest normal number (``2**-126``), the least nonzero scale."""


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _xor_lsr_(z: torch.Tensor, k: int, tmp: torch.Tensor) -> torch.Tensor:
    """``z ^= z >>> k`` in place (a logical shift: torch's ``>>`` on int64 is arithmetic)."""
    torch.bitwise_right_shift(z, k, out=tmp)
    tmp.bitwise_and_((1 << (64 - k)) - 1)
    return z.bitwise_xor_(tmp)


def uniform_from_hash(seed: int, numel: int, device: torch.device | str = "cpu", start: int = 0) -> torch.Tensor:
    """The uniforms of stochastic rounding for elements ``i`` in ``[start, start + numel)``: one
    ``z = splitmix64(seed + p * golden)`` for each quad of elements ``(4p, ..., 4p + 3)``, element ``4p + k``
    taking bits ``48 - 16k`` to ``63 - 16k`` of ``z``, scaled by ``2**-16`` to ``[0, 1)``.

    Counter based: element ``i`` of a tensor always gets the same draw for the same seed, on any device, in
    any kernel launch configuration. 16 bits a draw (a code's expectation is off by less than ``2**-16`` of its
    group's scale), every value exactly representable in fp32; one hash serves four elements (splitmix64's
    output bits are all well mixed), which keeps the quantize kernel's hashing to a fraction of its work.
    In-place int64 arithmetic (two buffers) keeps the CPU cost of this reference low.
    """
    first, stop = start // 4, -(-(start + numel) // 4)  # the quads holding the elements
    z = torch.arange(first, stop, dtype=torch.int64, device=device)
    tmp = torch.empty_like(z)
    z.mul_(_GOLDEN).add_(_signed64(seed & ((1 << 64) - 1)))
    _xor_lsr_(z, 30, tmp).mul_(_MIX1)
    _xor_lsr_(z, 27, tmp).mul_(_MIX2)
    _xor_lsr_(z, 31, tmp)
    draws = torch.empty(stop - first, 4, dtype=torch.int64, device=device)
    for k in range(4):
        torch.bitwise_right_shift(z, 48 - 16 * k, out=draws[:, k]).bitwise_and_(0xFFFF)
    offset = start - 4 * first
    return draws.view(-1)[offset:offset + numel].to(torch.float32).mul_(2.0**-16)


def lo_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the stored zero point: fp16 for fp16 inputs (exact), bf16 otherwise (fp32's range)."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def metadata_to_float(bits16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret raw 16-bit patterns (``int16``) as ``dtype`` (bf16 or fp16) and widen to fp32."""
    return bits16.view(dtype).to(torch.float32)


def _bf16_bits_round_down(t: torch.Tensor) -> torch.Tensor:
    bits = t.view(torch.int32)
    hi = bits >> 16  # arithmetic: keeps the sign, low 16 bits are the truncated bf16 pattern
    inexact_negative = ((bits & 0xFFFF) != 0) & (bits < 0)
    return (hi + inexact_negative.to(torch.int32)).to(torch.int16)


def _bf16_bits_round_up(t: torch.Tensor) -> torch.Tensor:
    """For t >= 0 (or +inf): the smallest bf16 not below t."""
    bits = t.view(torch.int32)
    return ((bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)).to(torch.int16)


def channel_shifts(x: torch.Tensor, max_shift: int) -> torch.Tensor:
    """The shifts of channel scaling (``act_hf.compress.quantize``), ``int32``, one per channel of ``x``'s last
    dimension (any layout): ``k[c] = clamp(floor(log2(top / amax[c])), 0, max_shift)``, where ``amax[c]`` is
    channel ``c``'s largest magnitude and ``top`` the largest over finite channels: ``amax[c] * 2**k[c]`` lands in
    ``(top / 2, top]``, so no group's range grows past the largest channel's own. Non-finite channels get 0 (they
    decode to NaN anyway); a channel whose ``amax`` is below fp32's smallest normal number (1.2e-38) may get less
    than the floor, never more. ``max_shift`` is 24 (15 for fp16, whose largest power of two is ``2**15``).

    In integers, with no host read: non-negative floats order like their bit patterns read as integers, and for
    normal numbers ``(bits(top) - bits(amax)) >> 23`` is the floor of ``log2(top / amax)`` (the exponent fields'
    difference, less one where the mantissa field of ``amax`` exceeds ``top``'s). A non-finite channel's pattern
    lies above every finite one (``bits(amax) & 0x7FFFFFFF``: a NaN may carry the sign bit), so its difference is
    negative and clamps to 0; ``top`` is 0 when no channel is finite.

    The largest magnitudes come from the largest and smallest values (reductions only: the inf-norm of the GPU
    run at b56e4f9 allocated a full-size temporary, 1 MiB a sample at bert-large's highest point with CB1)."""
    amax = channel_absmax(x).float()
    top = torch.nan_to_num(amax, nan=0.0, posinf=0.0).amax().view(torch.int32)  # the largest finite channel's
    bits = amax.view(torch.int32).bitwise_and_(0x7FFFFFFF)  # a NaN may carry the sign bit
    shift = (top - bits).bitwise_right_shift_(23)
    return shift.clamp_(0, max_shift)


def channel_absmax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over all dims but the last (NaN where a channel holds one; -0.0 for a channel of zeros, a sign
    :func:`channel_shifts` drops), as ``max(amax, -amin)``: one ``aminmax`` over the rows of a contiguous ``x``,
    two reductions otherwise; no full-size temporary."""
    if x.is_contiguous():
        low, high = torch.aminmax(x.view(-1, x.shape[-1]), dim=0)
    else:
        dims = tuple(range(x.dim() - 1))
        low, high = x.amin(dims), x.amax(dims)
    return torch.maximum(high, low.neg_())


def channel_powers(shifts: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """``2**shifts[i % C]`` (fp32, exact; ``C = len(shifts)``, shifts in 0..24) for the elements ``i`` in
    ``[start, start + numel)`` of a row-major tensor whose last dimension has ``C`` channels."""
    powers = ((shifts.to(torch.int32) + 127) << 23).view(torch.float32)  # the exponent field alone
    channels = powers.numel()
    offset = start % channels
    return powers.repeat(-(-(offset + numel) // channels))[offset:offset + numel]


def quantize_pack(x: torch.Tensor, bits: int, group_size: int, seed: int, *, start: int = 0,
                  shifts: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Quantize a flat tensor and pack it (see the module docstring for the format).

    Args:
        x: 1-D floating tensor (fp32, fp16, bf16 or fp64; fp64 is computed in fp32).
        bits: 1..8.
        group_size: positive multiple of 8.
        seed: 63-bit seed of the rounding stream.
        start: index of ``x``'s first element in the whole tensor (the uniforms are drawn for the whole
            tensor's indices: :func:`quantize_pack_chunked` passes the chunk's offset).
        shifts: channel scaling: ``x`` is a row-major tensor flattened whose last dimension has ``len(shifts)``
            channels, and each element is first multiplied (in fp32, after the cast) by its channel's
            ``2**shift`` (:func:`channel_powers`; shifts in 0..24, int32).

    Returns:
        ``(payload uint8[ceil(n*bits/8)], lo int16[n_groups], scale int16[n_groups])``.
    """
    n = x.numel()
    n_groups = -(-n // group_size)
    levels = (1 << bits) - 1
    if n == 0:
        empty16 = torch.empty(0, dtype=torch.int16, device=x.device)
        return torch.empty(0, dtype=torch.uint8, device=x.device), empty16, empty16.clone()
    xf = x.reshape(-1).to(torch.float32)
    if shifts is not None:
        xf = xf * channel_powers(shifts, start, n)
    pad = n_groups * group_size - n
    if pad:  # replicate the last element: the partial group's min and max are unchanged
        xf = torch.cat([xf, xf[-1:].expand(pad)])
    groups = xf.view(n_groups, group_size)
    group_min = groups.amin(dim=1)
    group_max = groups.amax(dim=1)
    finite = torch.isfinite(groups).all(dim=1)

    lo_dtype = lo_dtype_for(x.dtype)
    if lo_dtype == torch.float16:
        lo_bits = group_min.to(torch.float16).view(torch.int16)  # the min of fp16 values is exact in fp16
        nan_lo = FP16_NAN_BITS
    else:
        lo_bits = _bf16_bits_round_down(group_min)
        nan_lo = BF16_NAN_BITS
    lo = metadata_to_float(lo_bits, lo_dtype)
    # a tensor divisor: CUDA turns division by a Python scalar into a multiply by its reciprocal (not the kernel's
    # correctly rounded division); the CPU divides either way
    scale_bits = _bf16_bits_round_up((group_max - lo) / torch.full_like(group_max, float(levels)))
    # a nonzero scale is at least bf16's smallest normal number, so its reciprocal is finite
    scale_bits = torch.where((scale_bits > 0) & (scale_bits < MIN_NORMAL_SCALE_BITS),
                             torch.tensor(MIN_NORMAL_SCALE_BITS, dtype=torch.int16, device=x.device), scale_bits)
    lo_bits = torch.where(finite, lo_bits, torch.tensor(nan_lo, dtype=torch.int16, device=x.device))
    scale_bits = torch.where(finite, scale_bits, torch.tensor(BF16_NAN_BITS, dtype=torch.int16, device=x.device))
    lo = metadata_to_float(lo_bits, lo_dtype)
    scale = metadata_to_float(scale_bits, torch.bfloat16)

    has_scale = scale > 0  # False for zero-range and NaN groups: their codes are 0
    # the reciprocal correctly rounded on every device (a tensor divisor, above), 0 for the groups without a scale
    inv_scale = torch.ones_like(scale) / torch.where(has_scale, scale, torch.ones_like(scale))
    v = (groups - lo[:, None]).mul_(torch.where(has_scale, inv_scale, torch.zeros_like(scale))[:, None])
    v.nan_to_num_(nan=0.0)  # a non-finite group's products with 0
    u = uniform_from_hash(seed, n_groups * group_size, x.device, start).view(n_groups, group_size)
    codes = torch.floor(v + u).clamp_(0, levels).to(torch.uint8).view(-1)[:n]
    return pack_bits(codes, bits), lo_bits, scale_bits


def unpack_dequantize(
    payload: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of :func:`quantize_pack`: a flat tensor of ``numel`` elements in ``dtype``."""
    if numel == 0:
        return torch.empty(0, dtype=dtype, device=payload.device)
    return _groups_fp32(payload, lo, scale, bits, group_size, numel, lo_dtype_for(dtype))[:numel].to(dtype)


def _groups_fp32(payload: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
                 numel: int, lo_dtype: torch.dtype) -> torch.Tensor:
    """The fp32 values ``lo + code * scale`` of the groups ``lo`` and ``scale`` describe, whose codes are the first
    ``numel`` of ``payload`` (the last group's missing codes 0), zero points read as ``lo_dtype``: flat, whole
    groups."""
    n_groups = lo.numel()
    codes = unpack_bits(payload, bits, numel).to(torch.float32)
    pad = n_groups * group_size - numel
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    lo_f = metadata_to_float(lo, lo_dtype)[:, None]
    scale_f = metadata_to_float(scale, torch.bfloat16)[:, None]
    return (lo_f + codes.view(n_groups, group_size) * scale_f).view(-1)


def unpack_dequantize_affine(payload: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int,
                             group_size: int, numel: int, mult: torch.Tensor, shift: torch.Tensor,
                             divisor: torch.Tensor | None = None, chunk: int = 1 << 18) -> torch.Tensor:
    """:func:`unpack_dequantize` to fp32 of a row-major tensor of ``len(mult)`` channels, each value ``v`` then
    ``v * mult[c] - shift[c]`` for its channel ``c`` (``mult``, ``shift``: fp32), the product and the difference each
    rounded; with ``divisor`` (fp32, one value a row of ``len(mult)`` elements) that times the reciprocal of its
    row's divisor, the reciprocal and the product each rounded. Decoded a chunk at a time like
    :func:`unpack_dequantize_chunked`."""
    out = unpack_dequantize_chunked(payload, lo, scale, bits, group_size, numel, torch.float32, chunk)
    rows = out.view(-1, mult.numel()).mul_(mult).sub_(shift)
    if divisor is not None:
        rows.mul_(torch.reciprocal(divisor).unsqueeze(1))
    return rows.view(-1)


def unpack_dequantize_into(out: torch.Tensor, payload: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor,
                           bits: int, group_size: int, numel: int, start: int, weight: torch.Tensor,
                           bias: torch.Tensor, inner: int, mask: torch.Tensor | None, accumulate: bool,
                           chunk: int = 1 << 18) -> None:
    """Decode elements ``start .. start + out.numel()`` of a packed tensor of ``numel`` elements into the flat,
    contiguous ``out`` (fp32, fp16 or bf16, whose zero points the original's are), each value ``v`` mapped by its
    channel to ``v * weight[c] + bias[c]``, ``c = (k // inner) % len(weight)`` for element ``k`` of ``out``; with
    ``accumulate`` that added to what ``out`` holds; with ``mask`` (1-bit, packed, bit ``k`` for element ``k`` of
    ``out``) the elements whose bit is 0 set to ``+0``. Every operation is fp32 and rounded (no fused multiply-add),
    the result rounded once into ``out``'s dtype. ``start`` and ``out.numel()`` are whole rows of ``inner *
    len(weight)`` elements (a batch's items), ``start`` a multiple of 8. Decoded a run of rows at a time (about
    ``chunk`` elements, at least one row): fp32 temporaries bounded by the run. :func:`unpack_dequantize_chain`
    of one term."""
    unpack_dequantize_chain(out, [payload], [lo], [scale], [weight], [bias], [mask], bits, group_size, numel, start,
                            inner, accumulate, chunk=chunk)


#: the most terms one :func:`unpack_dequantize_chain` call (one kernel launch) takes
CHAIN_TERMS = 8


def unpack_dequantize_chain(out: torch.Tensor, payloads: list[torch.Tensor], los: list[torch.Tensor],
                            scales: list[torch.Tensor], weights: list[torch.Tensor], biases: list[torch.Tensor],
                            masks: list[torch.Tensor | None], bits: int, group_size: int, numel: int, start: int,
                            inner: int, accumulate: bool, chunk: int = 1 << 18) -> None:
    """:func:`unpack_dequantize_into` of up to :data:`CHAIN_TERMS` packed tensors of the same shape, bits and group
    size at once, in order: ``v`` starts as what ``out`` holds (``accumulate``) or as the first term; each term
    ``t`` (elements ``start ..`` of ``payloads[t]``, ``los[t]``, ``scales[t]``) is decoded, mapped by channel with
    ``weights[t]`` and ``biases[t]`` and added to ``v``, and then, with ``masks[t]``, the elements whose bit is 0
    are set to ``+0``. ``v`` stays fp32 from the first term to the last (each operation rounded, no fused
    multiply-add) and is rounded once into ``out``: a residual chain's block input (:mod:`act_hf.derived`) written
    once instead of read and written once a term."""
    terms = len(payloads)
    if not 1 <= terms <= CHAIN_TERMS or not terms == len(los) == len(scales) == len(weights) == len(biases) == len(
            masks):
        raise ValueError(f"payloads, los, scales, weights, biases and masks: 1 to {CHAIN_TERMS} terms each, "
                         f"the same number, got {[len(t) for t in (payloads, los, scales, weights, biases, masks)]}")
    channels = weights[0].numel()
    row = inner * channels
    step = max(1, chunk // row) * row
    flat = out.view(-1)
    lo_dtype = lo_dtype_for(out.dtype)
    for a in range(0, flat.numel(), step):
        b = min(flat.numel(), a + step)
        first, last = (start + a) // group_size, -(-(start + b) // group_size)  # the groups holding the run
        seg_end = min(last * group_size, numel)
        offset = start + a - first * group_size
        values = flat[a:b].float() if accumulate else None
        for payload, lo, scale, weight, bias, mask in zip(payloads, los, scales, weights, biases, masks):
            term = _groups_fp32(payload[first * group_size * bits // 8:-(-seg_end * bits // 8)], lo[first:last],
                                scale[first:last], bits, group_size, seg_end - first * group_size, lo_dtype)
            term = term[offset:offset + b - a].view(-1, channels, inner)
            term = (term * weight.view(1, -1, 1) + bias.view(1, -1, 1)).view(-1)
            values = term if values is None else values + term
            if mask is not None:
                keep = unpack_bits(mask[a // 8:-(-b // 8)], 1, -(-b // 8) * 8 - a // 8 * 8)[a % 8:a % 8 + b - a]
                values = torch.where(keep.view(torch.bool), values, values.new_zeros(()))
        flat[a:b].copy_(values)


def _chunk_elements(group_size: int, chunk: int) -> int:
    return max(1, chunk // group_size) * group_size  # whole groups, hence a multiple of 8 elements: whole bytes


def quantize_pack_chunked(x: torch.Tensor, bits: int, group_size: int, seed: int, chunk: int = 1 << 18,
                          shifts: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`quantize_pack` run over runs of about ``chunk`` elements (whole groups): the same bits, with
    temporaries (about 30 bytes an element: fp32 copies, the int64 hash buffers, the packing words) bounded
    by the chunk instead of the tensor, the channel-scaled copy of ``shifts`` included. The CPU kernel."""
    n = x.numel()
    step = _chunk_elements(group_size, chunk)
    if n <= step:
        return quantize_pack(x, bits, group_size, seed, shifts=shifts)
    out = empty_packed(n, bits, group_size, x.device)
    for start in range(0, n, step):
        place_packed(out, start, bits, group_size, quantize_pack(x[start : start + step], bits, group_size, seed,
                                                                 start=start, shifts=shifts))
    return out


def empty_packed(n: int, bits: int, group_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Uninitialised ``(payload, lo, scale)`` for ``n`` elements, filled part by part with :func:`place_packed`."""
    lo = torch.empty(-(-n // group_size), dtype=torch.int16, device=device)
    return torch.empty(math.ceil(n * bits / 8), dtype=torch.uint8, device=device), lo, torch.empty_like(lo)


def place_packed(out: tuple[torch.Tensor, ...], start: int, bits: int, group_size: int,
                 part: tuple[torch.Tensor, ...]) -> None:
    """Write ``part``, the ``(payload, lo, scale)`` of the elements from ``start`` on (a group's first), into
    ``out``, the whole tensor's (a whole group is a whole number of bytes: group sizes are multiples of 8)."""
    first_byte, first_group = start * bits // 8, start // group_size
    for whole, piece, at in zip(out, part, (first_byte, first_group, first_group)):
        whole[at : at + piece.numel()] = piece


def quantize_pack_normalized(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, inner: int, bits: int,
                             group_size: int, seed: int, chunk: int = 1 << 18) -> tuple[torch.Tensor, ...]:
    """:func:`quantize_pack` of a flat row-major ``x`` (fp32, bf16 or fp64) whose element ``k`` of channel ``c = (k //
    inner) % len(mean)`` is first normalized to ``(x - mean[c]) * invstd[c]`` in fp32, the difference and the product
    each rounded: BatchNorm's normalized input, packed as its input is read (bf16 zero points, which round down, for
    every such ``x``). Run over runs of about ``chunk`` elements (whole groups), like :func:`quantize_pack_chunked`:
    the normalized values exist a run at a time. The CPU kernel."""
    n = x.numel()
    step = _chunk_elements(group_size, chunk)
    out = empty_packed(n, bits, group_size, x.device)
    for start in range(0, n, step):
        stop = min(n, start + step)
        channel = torch.arange(start, stop, device=x.device).div_(inner, rounding_mode="floor")
        channel.remainder_(mean.numel())
        values = (x[start:stop].float() - mean[channel]) * invstd[channel]
        place_packed(out, start, bits, group_size, quantize_pack(values, bits, group_size, seed, start=start))
    return out


def unpack_dequantize_chunked(payload: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int,
                              group_size: int, numel: int, dtype: torch.dtype, chunk: int = 1 << 18) -> torch.Tensor:
    """:func:`unpack_dequantize` over runs of whole groups (same values, temporaries bounded by the chunk)."""
    step = _chunk_elements(group_size, chunk)
    if numel <= step:
        return unpack_dequantize(payload, lo, scale, bits, group_size, numel, dtype)
    out = torch.empty(numel, dtype=dtype, device=payload.device)
    for start in range(0, numel, step):
        count = min(step, numel - start)
        first_byte, first_group = start * bits // 8, start // group_size
        groups = -(-count // group_size)
        out[start : start + count] = unpack_dequantize(
            payload[first_byte : first_byte + math.ceil(count * bits / 8)], lo[first_group : first_group + groups],
            scale[first_group : first_group + groups], bits, group_size, count, dtype)
    return out


def pack_bits_chunked(codes: torch.Tensor, bits: int, chunk: int = 1 << 18) -> torch.Tensor:
    """:func:`pack_bits` over runs of ``chunk`` codes (a multiple of 8: whole bytes); the same stream, with the
    int64 temporaries bounded by the chunk. The CPU kernel."""
    n = codes.numel()
    step = max(8, chunk // 8 * 8)
    if n <= step or bits == 8:
        return pack_bits(codes, bits)
    codes = codes.reshape(-1)
    out = torch.empty(math.ceil(n * bits / 8), dtype=torch.uint8, device=codes.device)
    for start in range(0, n, step):
        part = pack_bits(codes[start : start + step], bits)
        out[start * bits // 8 : start * bits // 8 + part.numel()] = part
    return out


def unpack_bits_chunked(payload: torch.Tensor, bits: int, numel: int, chunk: int = 1 << 18) -> torch.Tensor:
    """:func:`unpack_bits` over runs of ``chunk`` codes (same codes, temporaries bounded by the chunk)."""
    step = max(8, chunk // 8 * 8)
    if numel <= step or bits == 8:
        return unpack_bits(payload, bits, numel)
    out = torch.empty(numel, dtype=torch.uint8, device=payload.device)
    for start in range(0, numel, step):
        count = min(step, numel - start)
        first = start * bits // 8
        out[start : start + count] = unpack_bits(payload[first : first + math.ceil(count * bits / 8)], bits, count)
    return out


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``uint8`` codes (each < 2**bits; higher bits are masked off) into a dense bit stream."""
    n = codes.numel()
    codes = codes.reshape(-1)
    if bits == 8:
        return codes.clone()
    n_octets = -(-n // 8)
    pad = n_octets * 8 - n
    c = codes.to(torch.int64) & ((1 << bits) - 1)
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (c.view(n_octets, 8) << shifts).sum(dim=1)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    stream = ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).view(-1)
    nbytes = math.ceil(n * bits / 8)
    return stream if stream.numel() == nbytes else stream[:nbytes].clone()  # a storage of exactly nbytes


def unpack_bits(payload: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` codes as ``uint8``. Bytes of ``payload`` past the codes are
    ignored (a mask packed for more elements than are read, say)."""
    if bits == 8:
        return payload[:numel].clone()
    n_octets = -(-numel // 8)
    need = n_octets * bits
    p = payload[:need].to(torch.int64)
    if need > p.numel():
        p = torch.cat([p, p.new_zeros(need - p.numel())])
    byte_shifts = torch.arange(bits, device=payload.device, dtype=torch.int64) * 8
    words = (p.view(n_octets, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=payload.device, dtype=torch.int64) * bits
    codes = (words[:, None] >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.uint8).view(-1)[:numel]


def fewbit_encode_pack(x: torch.Tensor, bounds: torch.Tensor, bits: int) -> torch.Tensor:
    """Few-bit codes of a flat ``x``, packed at ``bits`` each: ``code = #{k : bounds[k] <= x}``
    (``torch.bucketize(x, bounds, right=True)``; NaN above every bound), compared in ``x``'s dtype, which
    ``bounds`` (sorted, fewer than ``2**bits``) shares. ``pack_bits`` of those codes, ``ceil(n * bits / 8)`` bytes."""
    codes = torch.bucketize(x, bounds, right=True, out_int32=True).to(torch.uint8)
    return pack_bits(codes, bits)


def fewbit_encode_pack_chunked(x: torch.Tensor, bounds: torch.Tensor, bits: int,
                               chunk: int = 1 << 18) -> torch.Tensor:
    """:func:`fewbit_encode_pack` over runs of ``chunk`` elements (a multiple of 8: whole bytes); the same stream,
    with the int32 and int64 temporaries bounded by the chunk. The CPU kernel."""
    n = x.numel()
    step = max(8, chunk // 8 * 8)
    if n <= step:
        return fewbit_encode_pack(x, bounds, bits)
    out = torch.empty(math.ceil(n * bits / 8), dtype=torch.uint8, device=x.device)
    for start in range(0, n, step):
        part = fewbit_encode_pack(x[start : start + step], bounds, bits)
        out[start * bits // 8 : start * bits // 8 + part.numel()] = part
    return out


def fewbit_grad(grad: torch.Tensor, payload: torch.Tensor, values: torch.Tensor, bits: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``grad * values[code]`` for a flat ``grad`` and the packed codes of its elements (:func:`fewbit_encode_pack`),
    ``values`` (``2**bits`` of them) in ``grad``'s dtype: ``torch.mul``'s result, in a new tensor or in ``out``."""
    factors = values.index_select(0, unpack_bits(payload, bits, grad.numel()).to(torch.int32))
    return torch.mul(grad, factors) if out is None else torch.mul(grad, factors, out=out)


def fewbit_grad_chunked(grad: torch.Tensor, payload: torch.Tensor, values: torch.Tensor, bits: int,
                        chunk: int = 1 << 18) -> torch.Tensor:
    """:func:`fewbit_grad` over runs of ``chunk`` elements (same values, temporaries bounded by the chunk)."""
    n = grad.numel()
    step = max(8, chunk // 8 * 8)
    if n <= step:
        return fewbit_grad(grad, payload, values, bits)
    out = torch.empty_like(grad)
    for start in range(0, n, step):
        stop = min(n, start + step)
        part = payload[start * bits // 8 : math.ceil(stop * bits / 8)]
        fewbit_grad(grad[start:stop], part, values, bits, out=out[start:stop])
    return out


def zero_unmasked(values: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.where(keep, values, 0)`` for a flat ``values`` and ``mask``, its 1-bit ``keep`` packed
    (:func:`pack_bits` at 1 bit): the dropped elements ``+0``, in a new tensor or in ``out`` (which may be
    ``values`` itself)."""
    keep = unpack_bits(mask, 1, values.numel()).view(torch.bool)
    zero = values.new_zeros(())
    return torch.where(keep, values, zero) if out is None else torch.where(keep, values, zero, out=out)


#: The activations :func:`activation_inplace_code` writes, by name: torch's in-place form of each (the very functions
#: act_hf's activation modules hand as their in-place forward, :data:`act_hf.ops.activation.FUSED_IN_PLACE`).
IN_PLACE_ACTIVATIONS = {
    "gelu": torch._C._nn.gelu_,
    "gelu_tanh": functools.partial(torch._C._nn.gelu_, approximate="tanh"),
    "silu": functools.partial(torch.nn.functional.silu, inplace=True),
}


def activation_inplace_code(x: torch.Tensor, bounds: torch.Tensor, bits: int, activation: str,
                            chunk: int = 1 << 18) -> torch.Tensor:
    """The packed codes of a flat ``x`` against ``bounds`` (:func:`fewbit_encode_pack`), ``x`` then written as the
    activation named (``"gelu"``, the exact form; ``"gelu_tanh"``; ``"silu"``: :data:`IN_PLACE_ACTIVATIONS`) in
    place: an activation's forward and its few-bit code, where the kernel evaluates the activation as torch's CUDA
    kernel does. Over runs of ``chunk`` elements (:func:`fewbit_encode_pack_chunked`)."""
    payload = fewbit_encode_pack_chunked(x, bounds, bits, chunk)
    IN_PLACE_ACTIVATIONS[activation](x)
    return payload


def relu_inplace_code(x: torch.Tensor, negative_zero_out: torch.Tensor, chunk: int = 1 << 18) -> torch.Tensor:
    """A ReLU written into a flat ``x`` and its 1-bit code, ``not (x <= 0)`` of the values before (NaN: 1), packed
    (:func:`pack_bits` at 1 bit): where the code is 0 the element becomes ``+0``, or ``negative_zero_out[0]`` for a
    ``-0`` (``torch.relu(-0.0)`` on ``x``'s device: ``+0`` from CUDA's ``relu`` before torch kept the sign there,
    ``-0`` from the CPU's), NaN and the positives stay. Over runs of ``chunk`` elements (a multiple of 8: whole
    bytes of the code), its temporaries bounded by the chunk."""
    n = x.numel()
    out = torch.empty(math.ceil(n / 8), dtype=torch.uint8, device=x.device)
    step = max(8, chunk // 8 * 8)
    for start in range(0, n, step):
        part = x[start : start + step]
        dropped = part <= 0
        negative_zero = (part == 0) & torch.signbit(part)
        out[start // 8 : start // 8 + math.ceil(part.numel() / 8)] = pack_bits(~dropped, 1)
        part.masked_fill_(dropped & ~negative_zero, 0)
        part.copy_(torch.where(negative_zero, negative_zero_out, part))
    return out


def masked_scale(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``aten.native_dropout_backward(grad, keep, scale)`` for a flat ``grad`` and its 1-bit ``keep`` packed in
    ``mask``: dropout's input gradient, the kept elements ``grad * scale``, the dropped ``0 * grad``."""
    keep = unpack_bits(mask, 1, grad.numel()).view(torch.bool)
    return torch.ops.aten.native_dropout_backward(grad, keep, scale)


def zero_unmasked_chunked(values: torch.Tensor, mask: torch.Tensor, *, in_place: bool = False,
                          chunk: int = 1 << 18) -> torch.Tensor:
    """:func:`zero_unmasked` over runs of ``chunk`` elements (a multiple of 8: whole bytes of the mask), into
    ``values`` itself with ``in_place``; the unpacked mask's temporaries are bounded by the chunk."""
    out = values if in_place else torch.empty_like(values)
    step = max(8, chunk // 8 * 8)
    for start in range(0, values.numel(), step):
        stop = min(values.numel(), start + step)
        zero_unmasked(values[start:stop], mask[start // 8 : -(-stop // 8)], out=out[start:stop])
    return out
