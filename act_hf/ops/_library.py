"""The only place that turns kernels into ``torch.ops.act_hf.*`` custom ops.

Every op has a default implementation (the pure-PyTorch reference in ``act_hf.compress.reference``, used on
the CPU), a CUDA implementation (the extension's kernel, or the reference with one warning when the
extension is unavailable) and a fake implementation for ``torch.compile``. Callers go through :func:`run`,
which in plain eager execution calls the implementation for the tensor's device directly: the same code
without the dispatcher's Python round trip (50-100 us a call on the CPUs measured, and a patched training step
makes hundreds of calls).
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import _ext
from ..compress import reference
from ..errors import ActHFWarning

__all__ = ["activation_inplace_code", "channel_shifts", "fewbit_encode_pack", "fewbit_grad", "masked_scale",
           "pack_bits", "quantize_pack", "quantize_pack_normalized", "quantize_pack_scaled", "relu_inplace_code",
           "run", "unpack_bits", "unpack_dequantize", "unpack_dequantize_affine", "unpack_dequantize_chain",
           "zero_unmasked", "zero_unmasked_inplace"]

logger = logging.getLogger(__name__)
_warned = False


def _cuda_ext():
    """The extension for a CUDA call, or ``None`` after warning once that the reference is used instead: each op's
    CUDA implementation then runs its CPU one, the chunked reference, on the GPU's tensors."""
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


def _quantize_pack(x: Tensor, bits: int, group_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Flat ``x`` -> ``(payload uint8, lo int16, scale int16)``; see ``act_hf.compress.reference``.

    Without the CUDA extension (on the CPU, say) this is the reference run chunk by chunk, so its temporaries
    stay small instead of about 30 bytes per element of ``x``."""
    payload, lo, scale = reference.quantize_pack_chunked(x, bits, group_size, seed)
    return payload, lo, scale


def _quantize_pack_cuda(x: Tensor, bits: int, group_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    module = _cuda_ext()
    payload, lo, scale = (_quantize_pack if module is None else module.quantize_pack)(x, bits, group_size, seed)
    return payload, lo, scale  # the extension returns a list


quantize_pack = torch.library.custom_op("act_hf::quantize_pack", _quantize_pack, mutates_args=())
quantize_pack.register_kernel("cuda", _quantize_pack_cuda)


@quantize_pack.register_fake
def _quantize_pack_fake(x: Tensor, bits: int, group_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(x.dim() == 1, lambda: f"quantize_pack expects a flat tensor, got {x.dim()} dims")
    n = x.numel()
    n_groups = _ceil_div(n, group_size)
    return (
        x.new_empty(_ceil_div(n * bits, 8), dtype=torch.uint8),
        x.new_empty(n_groups, dtype=torch.int16),
        x.new_empty(n_groups, dtype=torch.int16),
    )


def _quantize_pack_normalized(x: Tensor, mean: Tensor, invstd: Tensor, inner: int, bits: int, group_size: int,
                              seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_quantize_pack` of a flat row-major ``x`` whose element ``k`` is first normalized by its channel of
    dim 1, ``(x - mean[c]) * invstd[c]``, ``c = (k // inner) % len(mean)`` (BatchNorm's normalized input, never
    made)."""
    payload, lo, scale = reference.quantize_pack_normalized(x, mean, invstd, inner, bits, group_size, seed)
    return payload, lo, scale


def _quantize_pack_normalized_cuda(x: Tensor, mean: Tensor, invstd: Tensor, inner: int, bits: int, group_size: int,
                                   seed: int) -> tuple[Tensor, Tensor, Tensor]:
    module = _cuda_ext()
    kernel = _quantize_pack_normalized if module is None else module.quantize_pack_normalized
    payload, lo, scale = kernel(x, mean, invstd, inner, bits, group_size, seed)
    return payload, lo, scale


quantize_pack_normalized = torch.library.custom_op("act_hf::quantize_pack_normalized", _quantize_pack_normalized,
                                                   mutates_args=())
quantize_pack_normalized.register_kernel("cuda", _quantize_pack_normalized_cuda)


@quantize_pack_normalized.register_fake
def _(x: Tensor, mean: Tensor, invstd: Tensor, inner: int, bits: int, group_size: int,
      seed: int) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(mean.shape == invstd.shape and x.numel() % (inner * mean.numel()) == 0,
                 lambda: "mean and invstd need one value a channel of whole rows")
    return _quantize_pack_fake(x, bits, group_size, seed)


def _quantize_pack_scaled(x: Tensor, shifts: Tensor, bits: int, group_size: int,
                          seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_quantize_pack` of a flat row-major ``x`` whose element ``i`` is first multiplied by
    ``2**shifts[i % len(shifts)]`` (channel scaling, int32 shifts in 0..24): no scaled copy of ``x`` is made."""
    payload, lo, scale = reference.quantize_pack_chunked(x, bits, group_size, seed, shifts=shifts)
    return payload, lo, scale


def _quantize_pack_scaled_cuda(x: Tensor, shifts: Tensor, bits: int, group_size: int,
                               seed: int) -> tuple[Tensor, Tensor, Tensor]:
    module = _cuda_ext()
    kernel = _quantize_pack_scaled if module is None else module.quantize_pack_scaled
    payload, lo, scale = kernel(x, shifts, bits, group_size, seed)
    return payload, lo, scale


quantize_pack_scaled = torch.library.custom_op("act_hf::quantize_pack_scaled", _quantize_pack_scaled,
                                               mutates_args=())
quantize_pack_scaled.register_kernel("cuda", _quantize_pack_scaled_cuda)


@quantize_pack_scaled.register_fake
def _(x: Tensor, shifts: Tensor, bits: int, group_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(shifts.dim() == 1, lambda: f"quantize_pack_scaled expects flat shifts, got {shifts.dim()} dims")
    return _quantize_pack_fake(x, bits, group_size, seed)


def _channel_shifts(x: Tensor, channels: int, max_shift: int) -> Tensor:
    """The channel-scaling shifts (``int32``, ``channels`` of them) of a flat row-major ``x`` whose last dimension
    has ``channels`` channels: ``act_hf.compress.reference.channel_shifts``."""
    return reference.channel_shifts(x.view(-1, channels), max_shift)


def _channel_shifts_cuda(x: Tensor, channels: int, max_shift: int) -> Tensor:
    module = _cuda_ext()
    return (_channel_shifts if module is None else module.channel_shifts)(x, channels, max_shift)


channel_shifts = torch.library.custom_op("act_hf::channel_shifts", _channel_shifts, mutates_args=())
channel_shifts.register_kernel("cuda", _channel_shifts_cuda)


@channel_shifts.register_fake
def _(x: Tensor, channels: int, max_shift: int) -> Tensor:
    torch._check(x.dim() == 1, lambda: f"channel_shifts expects a flat tensor, got {x.dim()} dims")
    return x.new_empty(channels, dtype=torch.int32)


def _unpack_dequantize(
    payload: Tensor, lo: Tensor, scale: Tensor, bits: int, group_size: int, numel: int, dtype: torch.dtype
) -> Tensor:
    """Inverse of ``quantize_pack``: a flat tensor of ``numel`` elements of ``dtype`` (chunked like it)."""
    return reference.unpack_dequantize_chunked(payload, lo, scale, bits, group_size, numel, dtype)


def _unpack_dequantize_cuda(payload, lo, scale, bits, group_size, numel, dtype):
    module = _cuda_ext()
    return (_unpack_dequantize if module is None else module.unpack_dequantize)(payload, lo, scale, bits, group_size,
                                                                                numel, dtype)


unpack_dequantize = torch.library.custom_op("act_hf::unpack_dequantize", _unpack_dequantize, mutates_args=())
unpack_dequantize.register_kernel("cuda", _unpack_dequantize_cuda)


@unpack_dequantize.register_fake
def _(payload, lo, scale, bits, group_size, numel, dtype):
    torch._check(lo.numel() == _ceil_div(numel, group_size), lambda: "lo has the wrong number of groups")
    return payload.new_empty(numel, dtype=dtype)


def _unpack_dequantize_affine(payload: Tensor, lo: Tensor, scale: Tensor, bits: int, group_size: int, numel: int,
                              mult: Tensor, shift: Tensor, divisor: Tensor | None = None) -> Tensor:
    """``unpack_dequantize`` to fp32 of a row-major tensor of ``len(mult)`` channels, each value then times its
    channel's ``mult`` minus its ``shift``, and with ``divisor`` times the reciprocal of its row's
    (``act_hf.compress.reference.unpack_dequantize_affine``)."""
    return reference.unpack_dequantize_affine(payload, lo, scale, bits, group_size, numel, mult, shift, divisor)


def _unpack_dequantize_affine_cuda(payload, lo, scale, bits, group_size, numel, mult, shift, divisor=None):
    module = _cuda_ext()
    kernel = _unpack_dequantize_affine if module is None else module.unpack_dequantize_affine
    return kernel(payload, lo, scale, bits, group_size, numel, mult, shift, divisor)


unpack_dequantize_affine = torch.library.custom_op("act_hf::unpack_dequantize_affine", _unpack_dequantize_affine,
                                                   mutates_args=())
unpack_dequantize_affine.register_kernel("cuda", _unpack_dequantize_affine_cuda)


@unpack_dequantize_affine.register_fake
def _(payload, lo, scale, bits, group_size, numel, mult, shift, divisor=None):
    torch._check(lo.numel() == _ceil_div(numel, group_size), lambda: "lo has the wrong number of groups")
    torch._check(mult.shape == shift.shape and numel % mult.numel() == 0,
                 lambda: "mult and shift need one value a channel of whole rows")
    torch._check(divisor is None or divisor.numel() * mult.numel() == numel, lambda: "divisor needs one value a row")
    return payload.new_empty(numel, dtype=torch.float32)


def _unpack_dequantize_chain(out: Tensor, payloads: list[Tensor], los: list[Tensor], scales: list[Tensor],
                             weights: list[Tensor], biases: list[Tensor], masks: list[Tensor | None], bits: int,
                             group_size: int, numel: int, start: int, inner: int, accumulate: bool) -> None:
    """Elements ``start ..`` of up to ``reference.CHAIN_TERMS`` packed tensors decoded into ``out``, each mapped by
    its channel's ``weights[t]`` and ``biases[t]`` and summed in fp32, added to ``out`` (``accumulate``) or not,
    masked by ``masks[t]`` after term ``t``, rounded into ``out`` once
    (``act_hf.compress.reference.unpack_dequantize_chain``; one term: ``unpack_dequantize_into``)."""
    reference.unpack_dequantize_chain(out, payloads, los, scales, weights, biases, masks, bits, group_size, numel,
                                      start, inner, accumulate)


def _unpack_dequantize_chain_cuda(out, payloads, los, scales, weights, biases, masks, bits, group_size, numel, start,
                                  inner, accumulate):
    module = _cuda_ext()
    kernel = _unpack_dequantize_chain if module is None else module.unpack_dequantize_chain
    kernel(out, payloads, los, scales, weights, biases, masks, bits, group_size, numel, start, inner, accumulate)


unpack_dequantize_chain = torch.library.custom_op("act_hf::unpack_dequantize_chain", _unpack_dequantize_chain,
                                                  mutates_args=("out",))
unpack_dequantize_chain.register_kernel("cuda", _unpack_dequantize_chain_cuda)


@unpack_dequantize_chain.register_fake
def _(out, payloads, los, scales, weights, biases, masks, bits, group_size, numel, start, inner, accumulate):
    torch._check(1 <= len(payloads) <= reference.CHAIN_TERMS, lambda: "1 to CHAIN_TERMS terms")
    torch._check(all(lo.numel() == _ceil_div(numel, group_size) for lo in los),
                 lambda: "lo has the wrong number of groups")
    torch._check(start + out.numel() <= numel, lambda: "out runs past the packed tensors")


def _pack_bits(codes: Tensor, bits: int) -> Tensor:
    """``uint8`` codes (< 2**bits) -> dense bit stream of ``ceil(n*bits/8)`` bytes (chunked without the
    extension)."""
    return reference.pack_bits_chunked(codes, bits)


def _pack_bits_cuda(codes: Tensor, bits: int) -> Tensor:
    module = _cuda_ext()
    return (_pack_bits if module is None else module.pack_bits)(codes, bits)


pack_bits = torch.library.custom_op("act_hf::pack_bits", _pack_bits, mutates_args=())
pack_bits.register_kernel("cuda", _pack_bits_cuda)


@pack_bits.register_fake
def _(codes: Tensor, bits: int) -> Tensor:
    return codes.new_empty(_ceil_div(codes.numel() * bits, 8), dtype=torch.uint8)


def _unpack_bits(payload: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of ``pack_bits``: ``numel`` ``uint8`` codes (chunked without the extension)."""
    return reference.unpack_bits_chunked(payload, bits, numel)


def _unpack_bits_cuda(payload: Tensor, bits: int, numel: int) -> Tensor:
    module = _cuda_ext()
    return (_unpack_bits if module is None else module.unpack_bits)(payload, bits, numel)


unpack_bits = torch.library.custom_op("act_hf::unpack_bits", _unpack_bits, mutates_args=())
unpack_bits.register_kernel("cuda", _unpack_bits_cuda)


@unpack_bits.register_fake
def _(payload: Tensor, bits: int, numel: int) -> Tensor:
    return payload.new_empty(numel, dtype=torch.uint8)


def _fewbit_encode_pack(x: Tensor, bounds: Tensor, bits: int) -> Tensor:
    """Flat ``x`` -> its few-bit codes against ``bounds`` (``x``'s dtype), packed at ``bits`` (chunked without the
    extension)."""
    return reference.fewbit_encode_pack_chunked(x, bounds, bits)


def _fewbit_encode_pack_cuda(x: Tensor, bounds: Tensor, bits: int) -> Tensor:
    module = _cuda_ext()
    return (_fewbit_encode_pack if module is None else module.fewbit_encode_pack)(x, bounds, bits)


fewbit_encode_pack = torch.library.custom_op("act_hf::fewbit_encode_pack", _fewbit_encode_pack, mutates_args=())
fewbit_encode_pack.register_kernel("cuda", _fewbit_encode_pack_cuda)


@fewbit_encode_pack.register_fake
def _(x: Tensor, bounds: Tensor, bits: int) -> Tensor:
    return x.new_empty(_ceil_div(x.numel() * bits, 8), dtype=torch.uint8)


def _fewbit_grad(grad: Tensor, payload: Tensor, values: Tensor, bits: int) -> Tensor:
    """Flat ``grad`` times ``values[code]`` for the packed codes of its elements (chunked without the extension)."""
    return reference.fewbit_grad_chunked(grad, payload, values, bits)


def _fewbit_grad_cuda(grad: Tensor, payload: Tensor, values: Tensor, bits: int) -> Tensor:
    module = _cuda_ext()
    return (_fewbit_grad if module is None else module.fewbit_grad)(grad, payload, values, bits)


fewbit_grad = torch.library.custom_op("act_hf::fewbit_grad", _fewbit_grad, mutates_args=())
fewbit_grad.register_kernel("cuda", _fewbit_grad_cuda)


@fewbit_grad.register_fake
def _(grad: Tensor, payload: Tensor, values: Tensor, bits: int) -> Tensor:
    return torch.empty_like(grad)


def _zero_unmasked(values: Tensor, mask: Tensor) -> Tensor:
    """Flat ``values`` with the elements whose bit in the packed 1-bit ``mask`` is 0 set to 0, as a new tensor
    (chunked without the extension)."""
    return reference.zero_unmasked_chunked(values, mask)


def _zero_unmasked_cuda(values: Tensor, mask: Tensor) -> Tensor:
    module = _cuda_ext()
    return _zero_unmasked(values, mask) if module is None else module.zero_unmasked(values, mask, False)


zero_unmasked = torch.library.custom_op("act_hf::zero_unmasked", _zero_unmasked, mutates_args=())
zero_unmasked.register_kernel("cuda", _zero_unmasked_cuda)


@zero_unmasked.register_fake
def _(values: Tensor, mask: Tensor) -> Tensor:
    return torch.empty_like(values)


def _zero_unmasked_inplace(values: Tensor, mask: Tensor) -> None:
    """:func:`_zero_unmasked` into ``values`` itself."""
    reference.zero_unmasked_chunked(values, mask, in_place=True)


def _zero_unmasked_inplace_cuda(values: Tensor, mask: Tensor) -> None:
    module = _cuda_ext()
    if module is None:
        _zero_unmasked_inplace(values, mask)
    else:
        module.zero_unmasked(values, mask, True)


zero_unmasked_inplace = torch.library.custom_op("act_hf::zero_unmasked_inplace", _zero_unmasked_inplace,
                                                mutates_args=("values",))
zero_unmasked_inplace.register_kernel("cuda", _zero_unmasked_inplace_cuda)


@zero_unmasked_inplace.register_fake
def _(values: Tensor, mask: Tensor) -> None:
    return None


def _activation_inplace_code(x: Tensor, bounds: Tensor, bits: int, activation: str) -> Tensor:
    """The packed few-bit codes of a flat ``x`` against ``bounds`` (:func:`fewbit_encode_pack`), ``x`` then written
    as the activation named (``"gelu"``, ``"gelu_tanh"``, ``"silu"``) in place (the reference: the encode, then
    torch's in-place activation)."""
    return reference.activation_inplace_code(x, bounds, bits, activation)


def _activation_inplace_code_cuda(x: Tensor, bounds: Tensor, bits: int, activation: str) -> Tensor:
    module = _cuda_ext()
    return (_activation_inplace_code if module is None else module.activation_inplace_code)(x, bounds, bits,
                                                                                            activation)


activation_inplace_code = torch.library.custom_op("act_hf::activation_inplace_code", _activation_inplace_code,
                                                  mutates_args=("x",))
activation_inplace_code.register_kernel("cuda", _activation_inplace_code_cuda)


@activation_inplace_code.register_fake
def _(x: Tensor, bounds: Tensor, bits: int, activation: str) -> Tensor:
    return x.new_empty(_ceil_div(x.numel() * bits, 8), dtype=torch.uint8)


def _relu_inplace_code(x: Tensor, negative_zero_out: Tensor) -> Tensor:
    """A ReLU written into a flat ``x`` (a ``-0`` becomes ``negative_zero_out[0]``, NaN stays), returning the 1-bit
    codes ``not (x <= 0)`` of its values before, packed (chunked without the extension)."""
    return reference.relu_inplace_code(x, negative_zero_out)


def _relu_inplace_code_cuda(x: Tensor, negative_zero_out: Tensor) -> Tensor:
    module = _cuda_ext()
    return (_relu_inplace_code if module is None else module.relu_inplace_code)(x, negative_zero_out)


relu_inplace_code = torch.library.custom_op("act_hf::relu_inplace_code", _relu_inplace_code, mutates_args=("x",))
relu_inplace_code.register_kernel("cuda", _relu_inplace_code_cuda)


@relu_inplace_code.register_fake
def _(x: Tensor, negative_zero_out: Tensor) -> Tensor:
    return x.new_empty(_ceil_div(x.numel(), 8), dtype=torch.uint8)


def _masked_scale(grad: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``aten.native_dropout_backward`` of a flat ``grad`` and its packed 1-bit keep-mask (the reference's
    ``masked_scale``)."""
    return reference.masked_scale(grad, mask, scale)


def _masked_scale_cuda(grad: Tensor, mask: Tensor, scale: float) -> Tensor:
    module = _cuda_ext()
    return (_masked_scale if module is None else module.masked_scale)(grad, mask, scale)


masked_scale = torch.library.custom_op("act_hf::masked_scale", _masked_scale, mutates_args=())
masked_scale.register_kernel("cuda", _masked_scale_cuda)


@masked_scale.register_fake
def _(grad: Tensor, mask: Tensor, scale: float) -> Tensor:
    return torch.empty_like(grad)


#: each op's implementations by device type, for :func:`run`
_IMPLEMENTATIONS = {
    quantize_pack: {"cpu": _quantize_pack, "cuda": _quantize_pack_cuda},
    quantize_pack_scaled: {"cpu": _quantize_pack_scaled, "cuda": _quantize_pack_scaled_cuda},
    quantize_pack_normalized: {"cpu": _quantize_pack_normalized, "cuda": _quantize_pack_normalized_cuda},
    channel_shifts: {"cpu": _channel_shifts, "cuda": _channel_shifts_cuda},
    unpack_dequantize: {"cpu": _unpack_dequantize, "cuda": _unpack_dequantize_cuda},
    unpack_dequantize_affine: {"cpu": _unpack_dequantize_affine, "cuda": _unpack_dequantize_affine_cuda},
    unpack_dequantize_chain: {"cpu": _unpack_dequantize_chain, "cuda": _unpack_dequantize_chain_cuda},
    pack_bits: {"cpu": _pack_bits, "cuda": _pack_bits_cuda},
    unpack_bits: {"cpu": _unpack_bits, "cuda": _unpack_bits_cuda},
    fewbit_encode_pack: {"cpu": _fewbit_encode_pack, "cuda": _fewbit_encode_pack_cuda},
    fewbit_grad: {"cpu": _fewbit_grad, "cuda": _fewbit_grad_cuda},
    zero_unmasked: {"cpu": _zero_unmasked, "cuda": _zero_unmasked_cuda},
    zero_unmasked_inplace: {"cpu": _zero_unmasked_inplace, "cuda": _zero_unmasked_inplace_cuda},
    activation_inplace_code: {"cpu": _activation_inplace_code, "cuda": _activation_inplace_code_cuda},
    relu_inplace_code: {"cpu": _relu_inplace_code, "cuda": _relu_inplace_code_cuda},
    masked_scale: {"cpu": _masked_scale, "cuda": _masked_scale_cuda},
}


def _plain_eager(t: Tensor) -> bool:
    """Whether nothing would see the op but its kernel: a plain CPU or CUDA tensor, outside torch.compile's
    tracing, fake tensors, functorch transforms and Python dispatch or function modes."""
    return (type(t) is Tensor and (t.is_cuda or t.is_cpu) and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def run(op, first: Tensor, *args):
    """``op(first, *args)`` for one of this module's ops: in plain eager execution its implementation for
    ``first``'s device, called directly (the same results); otherwise through ``torch.ops``, so that tracing
    and modes see the op itself."""
    if _plain_eager(first):
        return _IMPLEMENTATIONS[op]["cuda" if first.is_cuda else "cpu"](first, *args)
    return op(first, *args)
