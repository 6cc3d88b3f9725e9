"""Elementwise activations whose backward context is a few-bit derivative code.

Forward is the original op, called as is (the same torch function, or the original module's own ``forward``),
so the output is bit-identical and in-place activations stay in place (an in-place ReLU on CUDA runs act_hf's kernel,
which writes ``relu``'s bits: see "In place"). The context is not ``x`` but the
``b``-bit index of ``x``'s interval in an optimal piecewise-constant approximation of ``f'``
(:mod:`act_hf.fewbit`, Novikov et al., 2022), packed into a dense stream of ``b`` bits an element with
:func:`act_hf.compress.pack_bits` (no metadata). Backward is ``grad * table.values[code]`` in ``grad``'s dtype.

Bits. At 1..4 bits the context is the few-bit code of the optimal derivative table of that width, and 5 bits
use the 4-bit table. At 6..8 bits the context is the input quantized at that width through the context store
(ActNN style), and backward evaluates the exact derivative at the dequantized input, so ``bits=8`` is close to
exact. The switch point is measured: relative error of ``grad * f'(x)`` for GELU, x ~ N(0, s^2), group 256:

    bits            4      5      6      7      8
    table (s=1)   0.036  0.036  0.036  0.036  0.036     quantized input (s=1)  0.120  0.059  0.029  0.014  0.007
    table (s=2)   0.054  0.054  0.054  0.054  0.054     quantized input (s=2)  0.165  0.081  0.040  0.020  0.010

The ReLU family is piecewise linear, so 1 bit is exact for it whatever ``settings.bits`` says:

=============  ==========================================  ====================================
name           code (1 bit)                                backward (identical to PyTorch's)
=============  ==========================================  ====================================
``relu``       ``not (x <= 0)``                            ``where(code, grad, 0)``
``leaky_relu`` ``x > 0``                                   ``where(code, grad, grad * slope)``
``relu6``      ``not (x <= 0 or x >= 6)``                  ``where(code, grad, 0)``
``hardtanh``   ``not (x <= min_val or x >= max_val)``      ``where(code, grad, 0)``
``hardsigmoid`` ``-3 < x < 3``                             ``where(code, grad * f32(1/6), 0)``
=============  ==========================================  ====================================

Hardsigmoid's derivative is piecewise constant too (1/6 inside, 0 outside): its 1-bit code is exact, where the
quantized input that 6..8 bits would use misplaced the elements near +-3 (7% error at 8 bits, N(0, 9) input).

Derivatives that jump. Hardswish's derivative jumps by 1/2 at -3 and at 3, SELU's by 0.70 at 0. Evaluated at the
quantized input alone, every element whose rounding crosses a jump gets the other branch: at 6 and 8 bits SELU
was worse than its 4-bit table (relative error 0.076 and 0.033 against 0.022, N(0, 1) input), Hardswish 0.090 and
0.041 at N(0, 9). So at 6..8 bits they also save an exact **region code** (:data:`REGION_BITS`: 2 bits, below /
inside / above [-3, 3], for Hardswish; 1 bit, ``x > 0``, for SELU) taken with torch's own branch conditions, and
backward evaluates the branch the code names at the dequantized input, clamped into that branch's interval
(:meth:`ActivationSpec.derivative`). Only the rounding noise inside a branch is left.

In place. The code is computed from ``x`` *before* the forward function runs, so a function that modifies
its input (``nn.ReLU(inplace=True)``, timm's in-place swish, ...) works: the input is marked dirty and
returned, exactly as the original in-place op returns it. An in-place ReLU (:data:`relu_inplace`) of a contiguous
CUDA tensor writes its output and its code in one pass over ``x`` (``act_hf::relu_inplace_code``), where ``relu_``
and the code read it twice: ``relu``'s values, bit for bit, a ``-0`` included (it becomes what the installed
torch's ``relu`` makes of it on that device, ``+0`` or ``-0``: torch's CUDA ``relu`` gave ``+0`` where the CPU's
keeps ``-0``). So do an in-place GELU (either form) and SiLU (:data:`FUSED_IN_PLACE`) of a contiguous bf16 or fp16
CUDA tensor (``act_hf::activation_inplace_code``), on a device where act_hf's kernel was found to give torch's bits
for each of the dtype's 65536 values (:func:`_kernel_matches_torch`; else the in-place op and the encode run).

"Store once". An activation's output is usually the next Linear's input, which that Linear quantizes itself
through the context store; the activation saves only its own codes (never shared, never the output), so the
pair costs ``b`` bits plus the Linear's quantized input per element.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import fewbit
from .._chunks import chunk_elements, spans
from .._constants import reused, zero_scalar
from ..compress import dequantize, pack_bits, reference, unpack_bits, zero_unmasked
from ..context import store
from ..derived import affine_of, note_pending
from ..errors import ActHFRuntimeError, ActHFValueError
from . import _library
from ._saving import OpSettings, load_context, save_context

__all__ = [
    "ACTIVATION_NAMES",
    "EXACT_ACTIVATIONS",
    "FUSED_IN_PLACE",
    "MAX_TABLE_BITS",
    "REGION_BITS",
    "ActActivationFunction",
    "ActivationSpec",
    "act_activation",
    "check_activation_name",
    "fused_activation_checks",
    "gelu_inplace",
    "gelu_tanh_inplace",
    "relu_inplace",
    "silu_inplace",
]

logger = logging.getLogger(__name__)

#: Piecewise-linear activations whose derivative is exact at 1 bit.
EXACT_ACTIVATIONS: tuple[str, ...] = ("relu", "leaky_relu", "relu6", "hardtanh", "hardsigmoid")

#: Every name :class:`ActivationSpec` accepts: the few-bit tables of :mod:`act_hf.fewbit` and the exact ones.
ACTIVATION_NAMES: tuple[str, ...] = tuple(dict.fromkeys((*fewbit.SUPPORTED_ACTIVATIONS, *EXACT_ACTIVATIONS)))
#: torch's hardsigmoid_backward multiplies by 1/6 rounded to float32, in every dtype.
_HARDSIGMOID_SLOPE = float(torch.tensor(1 / 6, dtype=torch.float32))

#: Activations whose output a conv after ``batch_norm`` may read from BatchNorm's packed input and their 1-bit code
#: (:mod:`act_hf.derived`; a clipping one's conv adds a 1-bit code of where it clipped at the top).
_RECTIFIERS = ("relu", "leaky_relu", "relu6", "hardtanh")

#: Activations whose derivative jumps, and the bits of the region code they save beside a quantized input.
REGION_BITS: dict[str, int] = {"hardswish": 2, "selu": 1}

#: Widest derivative table; 5 bits use it too.
MAX_TABLE_BITS = max(fewbit.SUPPORTED_BITS)
#: From this width on, the quantized input beats the widest table (see the module docstring).
QUANTIZED_INPUT_MIN_BITS = 6

_QUICK_GELU_COEF = 1.702

#: ``F.relu(x, inplace=True)``: an in-place ReLU's forward that :class:`ActActivationFunction` runs together with its
#: code where it can (:func:`_fuses_relu`); the ReLU modules and :func:`act_activation` hand this very function.
relu_inplace = functools.partial(F.relu, inplace=True)

#: Activation name -> the in-place forward run as one ``act_hf::activation_inplace_code`` with its code where it can
#: (:func:`_fuses_activation`): ``aten::gelu_`` (GELU's exact, erf form), GELU's tanh form and ``F.silu`` in place,
#: the reference's functions; the activation modules' in-place forms are these very functions.
FUSED_IN_PLACE: dict[str, Callable[[Tensor], Tensor]] = reference.IN_PLACE_ACTIVATIONS
gelu_inplace = FUSED_IN_PLACE["gelu"]
gelu_tanh_inplace = FUSED_IN_PLACE["gelu_tanh"]
silu_inplace = FUSED_IN_PLACE["silu"]

#: The dtypes whose every value :func:`_kernel_matches_torch` checks: the fused activations run for these alone.
_FUSED_DTYPES = (torch.bfloat16, torch.float16)

#: (device, dtype, activation) -> whether the fused activation gives torch's bits there
#: (:func:`_kernel_matches_torch`).
_checked: dict[tuple[torch.device, torch.dtype, str], bool] = {}


def _fuses_relu(x: Tensor) -> bool:
    """Whether :data:`relu_inplace` of ``x`` and its code run as one ``act_hf::relu_inplace_code``: a contiguous
    CUDA tensor (on the CPU the op is the reference's few torch ops, no faster than ``relu_`` and the encode)."""
    return x.is_cuda and x.is_contiguous()


@functools.lru_cache(maxsize=64)
def _relu_of_negative_zero(device: torch.device, dtype: torch.dtype) -> Tensor:
    """``[torch.relu(-0.0)]`` in ``dtype`` on ``device``, as the installed torch computes it there: what the fused
    ReLU writes for a ``-0``. Made on the device (a fill and a relu), so no copy from the host waits for it."""
    return torch.relu(torch.full((1,), -0.0, dtype=dtype, device=device))


def _fuses_activation(x: Tensor, name: str) -> bool:
    """Whether ``FUSED_IN_PLACE[name]`` of ``x`` and its code run as one ``act_hf::activation_inplace_code``: a
    contiguous CUDA tensor of a 16-bit dtype on whose device act_hf's kernel gives torch's bits for every value of
    that dtype (:func:`_kernel_matches_torch`, checked at the first such call; not while a CUDA graph is captured or
    torch.compile traces, which run unfused until a check has run outside them)."""
    return x.is_cuda and x.is_contiguous() and x.dtype in _FUSED_DTYPES and _checked_on(x.device, x.dtype, name)


def _checked_on(device: torch.device, dtype: torch.dtype, name: str) -> bool:
    """:func:`_kernel_matches_torch` on ``device`` in ``dtype`` for activation ``name``, run once and remembered;
    ``False`` without running it while a CUDA graph is captured or torch.compile traces (a comparison
    synchronizes)."""
    key = (device, dtype, name)
    matches = _checked.get(key)
    if matches is None:
        if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return False
        matches = _checked[key] = _kernel_matches_torch(device, dtype, name)
    return matches


def _kernel_matches_torch(device: torch.device, dtype: torch.dtype, name: str) -> bool:
    """Whether ``act_hf::activation_inplace_code`` writes the bits of torch's in-place activation ``name``
    (:data:`FUSED_IN_PLACE`) on ``device`` for each of the 65536 values of the 16-bit ``dtype`` (infinities and
    zeros of either sign included; a NaN where torch gives one, whatever its payload), and so for every tensor of
    it: the activation is elementwise, each output a function of its input alone. The kernel evaluates the
    formula of torch's CUDA kernel, but the bits also depend on the math library and the compiler's contractions,
    which this compares on the device (one synchronizing comparison, once a device, dtype and activation); where
    they differ the activation runs unfused (logged)."""
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device=device).to(torch.int16).view(dtype)
        want = FUSED_IN_PLACE[name](every.clone())
        got = every.clone()
        _library.run(_library.activation_inplace_code, got, torch.zeros(1, dtype=dtype, device=device), 1, name)
        nan = want.isnan()
        matches = torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int16)[~nan],
                                                                want.view(torch.int16)[~nan])
    if not matches:
        logger.info("act_hf's fused %s differs from torch's on %s in %s; it runs unfused there", name, device, dtype)
    return matches


def fused_activation_checks() -> dict[str, bool]:
    """The fused activations' checks run in this process (:func:`_kernel_matches_torch`), as ``"<name> <dtype>
    on <device>"`` -> passed: where one failed, that activation runs unfused there (a benchmark records these)."""
    return {f"{name} {str(dtype).removeprefix('torch.')} on {device}": passed
            for (device, dtype, name), passed in _checked.items()}


def _in_place_with_code(x: Tensor, op: Callable[..., Tensor], *args) -> Tensor:
    """``op(x.view(-1), *args)``, a custom op writing an activation into ``x`` and returning its packed code; ``x``'s
    version moves on as the in-place activation's would (the kernel writes it through its pointer)."""
    version = x._version
    code = _library.run(op, x.view(-1), *args)
    if x._version == version:
        torch.autograd.graph.increment_version(x)
    return code


def check_activation_name(name: object, argument: str = "act_fn_name") -> str:
    """Validate an activation name.

    Args:
        name: the name to check.
        argument: the argument's name, used in the error message.

    Returns:
        ``name``.

    Raises:
        ActHFValueError: ``name`` is not in :data:`ACTIVATION_NAMES` (the message lists them).
    """
    if not isinstance(name, str) or name not in ACTIVATION_NAMES:
        raise ActHFValueError(
            f"{argument}={name!r} is not a supported activation; supported names: {', '.join(ACTIVATION_NAMES)}"
        )
    return name


@functools.lru_cache(maxsize=64)
def _smallest_positive(device: torch.device, dtype: torch.dtype) -> Tensor:
    """``[s]``, ``s`` the smallest positive number of ``dtype`` (a subnormal: the bit pattern 1), on ``device``."""
    pattern = {8: torch.int64, 4: torch.int32, 2: torch.int16}[dtype.itemsize]
    return torch.ones(1, dtype=pattern).view(dtype).to(device)


def _pack_codes(codes: Tensor, bits: int, slot: str, original_nbytes: int) -> Tensor:
    """``pack_bits(codes, bits)`` (a storage of exactly ``ceil(numel * bits / 8)`` bytes), labelled for
    :func:`act_hf.track_saved` with its slot and the bytes PyTorch would have saved instead."""
    payload = pack_bits(codes, bits)
    store.register((payload,), slot=slot, original_nbytes=original_nbytes)
    return payload


def _pack_chunked(encode: Callable[[Tensor], Tensor], x: Tensor, bits: int) -> Tensor:
    """``pack_bits(encode(x), bits)`` for an elementwise ``encode``, ``x`` in its logical (row-major) order,
    computed chunk by chunk (:func:`chunk_elements`) when ``x`` is contiguous: the same bytes, without the
    full-width temporaries ``encode`` makes on the way."""
    numel, step = x.numel(), chunk_elements(x.device)
    if numel <= step or not x.is_contiguous():
        return pack_bits(encode(x), bits)
    flat = x.view(-1)
    payload = torch.empty(math.ceil(numel * bits / 8), dtype=torch.uint8, device=x.device)
    for start, stop in spans(numel, step):
        payload[start * bits // 8:math.ceil(stop * bits / 8)] = pack_bits(encode(flat[start:stop]), bits)
    return payload


@dataclass(frozen=True)
class ActivationSpec:
    """Which derivative an activation's backward needs, and how its reference forward is called.

    Attributes:
        name: one of :data:`ACTIVATION_NAMES` (``"gelu_tanh"`` for every tanh approximation of GELU).
        negative_slope: ``leaky_relu`` only.
        min_val: ``hardtanh`` only.
        max_val: ``hardtanh`` only.
        beta: ``softplus`` only: ``f'(x) = sigmoid(beta * x)``, so ``beta * x`` is encoded with the table.
        threshold: ``softplus`` forward only (above it torch's derivative is exactly 1, the table's top piece
            about 1).
    """

    name: str
    negative_slope: float = 0.01
    min_val: float = -1.0
    max_val: float = 1.0
    beta: float = 1.0
    threshold: float = 20.0

    def __post_init__(self) -> None:
        check_activation_name(self.name, "name")
        if self.name == "hardtanh" and not self.min_val < self.max_val:
            raise ActHFValueError(f"hardtanh needs min_val < max_val, got {self.min_val} and {self.max_val}")

    @property
    def exact(self) -> bool:
        """Whether the 1-bit code gives the exact derivative (the ReLU family and hardsigmoid)."""
        return self.name in EXACT_ACTIVATIONS

    def code_bits(self, bits: int) -> int:
        """Bits per element of the saved code: 1 for the exact ones, else ``bits`` clipped to 1..4."""
        return 1 if self.exact else min(max(int(bits), 1), MAX_TABLE_BITS)

    def uses_quantized_input(self, bits: int) -> bool:
        """Whether the context at ``bits`` is the quantized input (6..8 bits) instead of a table code."""
        return not self.exact and bits >= QUANTIZED_INPUT_MIN_BITS

    @property
    def clamp(self) -> tuple[float, float] | None:
        """``(lo, hi)`` of the clipping activations (``relu6``: ``(0, 6)``, ``hardtanh``), else ``None``."""
        if self.name == "relu6":
            return 0.0, 6.0
        return (self.min_val, self.max_val) if self.name == "hardtanh" else None

    @property
    def region_bits(self) -> int:
        """Bits of the region code saved beside a quantized input (0: the derivative has no jump)."""
        return REGION_BITS.get(self.name, 0)

    def region(self, x: Tensor) -> Tensor:
        """Which branch of ``f'`` torch's backward takes at each element of ``x`` (``uint8``; activations of
        :data:`REGION_BITS` only). Hardswish: 0 for ``x < -3``, 1 for ``-3 <= x <= 3``, 2 above (and NaN); SELU:
        0 for ``x <= 0``, 1 above (and NaN)."""
        if self.name == "hardswish":
            return 2 - (x <= 3.0).to(torch.uint8) - (x < -3.0).to(torch.uint8)
        if self.name == "selu":
            return (~(x <= 0)).to(torch.uint8)
        raise ActHFValueError(f"activation {self.name!r} has no region code; those that do: {', '.join(REGION_BITS)}")

    def derivative(self, x: Tensor, region: Tensor | None = None) -> Tensor:
        """The exact ``f'(x)`` in ``x``'s dtype (for the quantized-input context). With ``region`` (the codes of
        :meth:`region` at the original input), the branch it names, evaluated at ``x`` clamped into that branch's
        interval: a rounded ``x`` that crossed a jump of ``f'`` keeps its own branch."""
        if region is not None:
            if self.name == "hardswish":  # 0 below, x / 3 + 1/2 inside, 1 above
                inside = fewbit.derivative("hardswish", x.clamp(-3.0, 3.0))
                return torch.where(region == 1, inside, (region == 2).to(x.dtype))
            negative = fewbit.derivative("selu", x.clamp(max=0.0))  # selu: scale * alpha * exp(x), then scale
            return torch.where(region == 1, fewbit.derivative("selu", x.new_ones(())), negative)
        if self.name == "softplus" and self.beta != 1.0:
            return fewbit.derivative(self.name, x * self.beta)
        return fewbit.derivative(self.name, x)

    def table(self, bits: int) -> fewbit.DerivativeTable:
        """The derivative table used at ``bits`` (few-bit activations only)."""
        return fewbit.get_table(self.name, self.code_bits(bits))

    def forward(self, x: Tensor, inplace: bool = False) -> Tensor:
        """The original op: the same torch call as the corresponding ``nn`` module / transformers formula."""
        n = self.name
        if n == "gelu":
            return F.gelu(x)
        if n == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        if n == "quick_gelu":
            return x * torch.sigmoid(_QUICK_GELU_COEF * x)
        if n == "silu":
            return F.silu(x, inplace=inplace)
        if n == "tanh":
            return x.tanh_() if inplace else torch.tanh(x)
        if n == "sigmoid":
            return x.sigmoid_() if inplace else torch.sigmoid(x)
        if n == "softplus":
            return F.softplus(x, self.beta, self.threshold)
        if n == "mish":
            return F.mish(x, inplace=inplace)
        if n == "elu":
            return F.elu(x, 1.0, inplace=inplace)
        if n == "hardswish":
            return F.hardswish(x, inplace=inplace)
        if n == "hardsigmoid":
            return F.hardsigmoid(x, inplace=inplace)
        if n == "selu":
            return F.selu(x, inplace=inplace)
        if n == "relu":
            return F.relu(x, inplace=inplace)
        if n == "leaky_relu":
            return F.leaky_relu(x, self.negative_slope, inplace=inplace)
        if n == "relu6":
            return F.relu6(x, inplace=inplace)
        return F.hardtanh(x, self.min_val, self.max_val, inplace=inplace)

    def encode(self, x: Tensor, bits: int) -> Tensor:
        """The code of every element of ``x`` (``bool`` for the ReLU family, ``uint8`` table indices else)."""
        n = self.name
        if n == "relu":
            return ~(x <= 0)
        if n == "leaky_relu":
            return x > 0
        if self.clamp is not None:
            lo, hi = self.clamp
            return ~((x <= lo) | (x >= hi))
        if n == "hardsigmoid":
            return (x > -3.0) & (x < 3.0)
        if n == "softplus" and self.beta != 1.0:
            x = x * self.beta
        return fewbit.encode(x, self.table(bits))

    def grad_input(self, grad: Tensor, codes: Tensor, bits: int, *, out: Tensor | None = None) -> Tensor:
        """``grad * f'(x)`` from the codes, in ``grad``'s dtype (exact for the ReLU family); into ``out`` if given."""
        if self.exact:  # 1-bit codes: unpacked ones are 0/1 bytes, a bool tensor already (a view, no copy)
            mask = codes.view(torch.bool) if codes.dtype == torch.uint8 else codes.bool()
            inside = grad * _HARDSIGMOID_SLOPE if self.name == "hardsigmoid" else grad
            other = grad * self.negative_slope if self.name == "leaky_relu" else zero_scalar(grad)
            return torch.where(mask, inside, other, out=out) if out is not None else torch.where(mask, inside, other)
        return torch.mul(grad, fewbit.decode(codes, self.table(bits), grad.dtype), out=out)

    def encode_packed(self, x: Tensor, bits: int) -> Tensor:
        """``pack_bits(self.encode(x, bits), code_bits)``, ``x`` in its logical (row-major) order: for a table's or
        ReLU's codes of a contiguous ``x``, one ``act_hf::fewbit_encode_pack`` (on the GPU one pass over ``x``,
        nothing else in memory); else computed chunk by chunk (:func:`chunk_elements`) when ``x`` is contiguous. The
        same bytes either way, without the full-width fp32 copy and int32 indices ``encode`` makes on the way."""
        bounds = self._code_bounds(x, bits) if x.is_contiguous() else None
        if bounds is not None:
            return _library.run(_library.fewbit_encode_pack, x.view(-1), bounds, bits)
        return _pack_chunked(lambda t: self.encode(t, bits), x, bits)

    def _code_bounds(self, x: Tensor, bits: int) -> Tensor | None:
        """Sorted bounds in ``x``'s dtype whose count ``<= x`` (NaN: all of them) is :meth:`encode`'s code of
        ``x``, where there are such: a table's (:func:`fewbit.encode_bounds`; not for a softplus with
        ``beta != 1``, whose code is of ``beta * x``) and ReLU's, the dtype's smallest positive number (``x >= it``
        exactly when ``not x <= 0``). ``None`` for the others (NaN gets leaky ReLU's code 0)."""
        if self.name == "relu":
            return reused(_smallest_positive, x, x.device, x.dtype)
        if self.exact or (self.name == "softplus" and self.beta != 1.0):
            return None
        return fewbit.encode_bounds(self.table(bits), x)

    def fuses_in_place(self, fn: Callable[[Tensor], Tensor], x: Tensor) -> bool:
        """Whether ``fn(x)`` and the code of ``x`` run as one kernel (:meth:`in_place_with_code`): ``fn`` is
        :data:`relu_inplace` (:func:`_fuses_relu`) or this spec's entry of :data:`FUSED_IN_PLACE`
        (:func:`_fuses_activation`)."""
        if self.name == "relu":
            return fn is relu_inplace and _fuses_relu(x)
        fused = FUSED_IN_PLACE.get(self.name)
        return fused is not None and fn is fused and _fuses_activation(x, self.name)

    def in_place_with_code(self, x: Tensor, bits: int) -> Tensor:
        """The in-place activation written into ``x`` and ``encode_packed(x, bits)`` of its values before, in one
        pass (where :meth:`fuses_in_place`)."""
        if self.name == "relu":
            return _in_place_with_code(x, _library.relu_inplace_code,
                                       reused(_relu_of_negative_zero, x, x.device, x.dtype))
        return _in_place_with_code(x, _library.activation_inplace_code, self._code_bounds(x, bits), bits, self.name)

    def region_packed(self, x: Tensor) -> Tensor:
        """``pack_bits(self.region(x), self.region_bits)``, chunk by chunk as :meth:`encode_packed`."""
        return _pack_chunked(self.region, x, self.region_bits)

    def grad_input_packed(self, grad: Tensor, payload: Tensor, bits: int) -> Tensor:
        """:meth:`grad_input` from the packed codes of ``grad.numel()`` elements (logical order): the same values.
        A table's codes with a contiguous ``grad`` take one ``act_hf::fewbit_grad`` (on the GPU the codes are
        unpacked and looked up in registers), ReLU's mask one ``act_hf::zero_unmasked``; the others are unpacked
        and decoded one chunk at a time when ``grad`` is contiguous, with only a chunk's codes, indices and
        derivative values alive."""
        if self.name == "relu":  # torch.where(mask, grad, 0), the mask read packed
            return zero_unmasked(grad, payload)
        if not self.exact and grad.is_contiguous():
            values = fewbit.decode_values(self.table(bits), grad.dtype, grad)
            return _library.run(_library.fewbit_grad, grad.view(-1), payload, values, bits).view(grad.shape)
        numel, step = grad.numel(), chunk_elements(grad.device)
        if numel <= step or not grad.is_contiguous():
            return self.grad_input(grad, unpack_bits(payload, bits, numel).view(grad.shape), bits)
        out = torch.empty_like(grad)
        flat_grad, flat_out = grad.view(-1), out.view(-1)
        for start, stop in spans(numel, step):
            codes = unpack_bits(payload[start * bits // 8:math.ceil(stop * bits / 8)], bits, stop - start)
            self.grad_input(flat_grad[start:stop], codes, bits, out=flat_out[start:stop])
        return out


class ActActivationFunction(torch.autograd.Function):
    """``y = fn(x)`` for an elementwise activation; saves only the packed derivative code of ``x``.

    Saves (when ``x`` needs a gradient): at 1..5 bits (always for the ReLU family) one ``uint8`` tensor of
    ``ceil(numel * b / 8)`` bytes, the codes of :meth:`ActivationSpec.encode` packed at
    ``b = spec.code_bits(settings.bits)`` bits; at 6..8 bits ``quantize(x)`` at that width, shared through the
    context store, and for the activations of :data:`REGION_BITS` the packed region codes
    (``ceil(numel * region_bits / 8)`` bytes). Nothing else: neither ``x`` nor ``y``.

    ``fn`` must compute the activation ``spec`` describes; it may modify ``x`` in place (it then has to return
    ``x``, which is marked dirty). Codes are taken before ``fn`` runs.
    """

    @staticmethod
    def forward(ctx, x: Tensor, spec: ActivationSpec, fn: Callable[[Tensor], Tensor], settings: OpSettings) -> Tensor:
        need = ctx.needs_input_grad[0]
        ctx.quantized_input = spec.uses_quantized_input(settings.bits)
        bits = settings.bits if ctx.quantized_input else spec.code_bits(settings.bits)
        payload = packed = region = None
        fused = need and not ctx.quantized_input and spec.fuses_in_place(fn, x)
        if need and ctx.quantized_input:  # before fn: fn may overwrite x
            packed = store.compress_as(x, settings)  # bits is settings.bits here
            if spec.region_bits:
                region = spec.region_packed(x)
        elif need and not fused:
            payload = spec.encode_packed(x, bits)
        rectifier = need and spec.name in _RECTIFIERS
        affine = affine_of(x) if rectifier else None  # x = batch_norm(.): see act_hf.derived
        version = x._version
        if fused:
            payload, out = spec.in_place_with_code(x, bits), x
        else:
            out = fn(x)
        if x._version != version:
            if out is not x:
                raise ActHFRuntimeError(
                    f"activation {spec.name!r} modified its input in place but returned another tensor; "
                    "an in-place activation must return its input"
                )
            ctx.mark_dirty(x)
        if packed is not None:
            if region is not None:
                store.register((region,), slot=settings.slot, original_nbytes=0)
            save_context(ctx, packed, region)
        elif need:
            store.register((payload,), slot=settings.slot, original_nbytes=x.numel() * x.element_size())
            save_context(ctx, payload)
            if affine is not None:  # noted by act_activation once autograd has wrapped (and versioned) out
                ctx.act_rectified = (affine, payload, spec.negative_slope if spec.name == "leaky_relu" else 0.0,
                                     spec.clamp)
        ctx.spec, ctx.bits, ctx.shape = spec, bits, x.shape
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        if ctx.quantized_input:
            packed, region_payload = load_context(ctx)
            x_hat = dequantize(packed)
            region = None
            if region_payload is not None:
                region = unpack_bits(region_payload, ctx.spec.region_bits, x_hat.numel()).view(x_hat.shape)
            return grad_out * ctx.spec.derivative(x_hat, region).to(grad_out.dtype), None, None, None
        (saved,) = load_context(ctx)
        return ctx.spec.grad_input_packed(grad_out, saved, ctx.bits), None, None, None


def _inplace_would_fail(x: Tensor) -> bool:
    """Whether autograd refuses an in-place op on ``x`` (a leaf, or a view of a leaf, that requires grad)."""
    if not x.requires_grad or not torch.is_grad_enabled():
        return False
    base = x._base if x._is_view() else None
    return x.is_leaf or (base is not None and base.is_leaf and base.requires_grad)


def act_activation(
    x: Tensor,
    spec: ActivationSpec | str,
    settings: OpSettings,
    *,
    fn: Callable[[Tensor], Tensor] | None = None,
    inplace: bool = False,
) -> Tensor:
    """Apply an activation, saving its few-bit derivative code for backward.

    Args:
        x: input tensor (any floating dtype and shape).
        spec: an :class:`ActivationSpec`, or a name from :data:`ACTIVATION_NAMES` with default parameters.
        settings: slot name and bits (``settings.bits`` clipped to 1..4; ignored for the ReLU family).
        fn: the original forward (e.g. a module's own ``forward``); defaults to :meth:`ActivationSpec.forward`.
        inplace: whether ``fn`` (or the default forward) modifies ``x`` in place.

    Returns:
        The original op's output (``x`` itself when in place).

    Raises:
        ActHFValueError: unknown activation name (the message lists the supported ones).
    """
    if isinstance(spec, str):
        spec = ActivationSpec(spec)
    elif not isinstance(spec, ActivationSpec):
        raise ActHFValueError(f"spec must be an ActivationSpec or a name, got {type(spec).__name__}")
    if fn is None and inplace and (spec.name == "relu" or spec.name in FUSED_IN_PLACE):
        fn = relu_inplace if spec.name == "relu" else FUSED_IN_PLACE[spec.name]
    elif fn is None:
        fn = spec.forward if not inplace else (lambda t: spec.forward(t, inplace=True))
    if not (torch.is_grad_enabled() and x.requires_grad) or (inplace and _inplace_would_fail(x)):
        return fn(x)  # nothing to save, or the original op raises autograd's in-place error itself
    out = ActActivationFunction.apply(x, spec, fn, settings)
    note_pending(out)
    return out
