"""Contexts read from tensors other ops already keep: a conv fed by ``relu(batch_norm(x))`` or
``leaky_relu(batch_norm(x))``.

In a ResNet block ``conv2(relu(bn1(x)))`` keeps, per element, BatchNorm's packed normalized input ``x_norm``
(``b`` bits), the ReLU's exact 1-bit mask ``m = (y > 0)`` and the conv's own packed input ``h = relu(y)``
(``b`` bits), where ``y = gamma * x_norm + beta`` per channel. The conv's weight gradient is linear in ``h``
and ``h = m * (gamma * x_norm + beta)``, so

    h_hat = m * (gamma * Q(x_norm) + beta)

is unbiased (``E[Q(x_norm)] = x_norm``; ``m``, ``gamma`` and ``beta`` exact) and needs no new bytes: the conv
saves the tensors BatchNorm and ReLU already saved, and the chain costs ``b + 1`` bits per element instead of
``2b + 1``. Only the weight gradient reads ``h``; the input gradient needs the weight alone.

The price is precision: on the kept elements the error of ``h_hat`` is ``gamma`` times the step of
``x_norm``'s groups, which span both signs, while packing ``h`` itself spends every level on ``[0, max h]``.
Measured (CPU, fp32; BatchNorm2d(64) -> ReLU -> Conv2d(64, 64, 3) on 8x64x28x28, gamma ~ U(0.5, 1.5),
beta ~ N(0, 0.5); SQNR in dB against fp64 autograd, mean of 4 draws; bytes of the chain's whole context)::

    bits   conv weight grad      BN weight grad   chain input grad   context bytes
           own copy  shared      (both)           (both)             own copy  shared
    2      9.0       4.2         3.4              35.4               263936    157312
    3      16.4      11.7        10.2             43.5               364288    207488
    4      23.0      18.3        16.7             50.1               464640    257664

Sharing costs 4.7-4.8 dB on the conv's weight gradient at equal bits and nothing elsewhere; at one bit more
it beats the own copy on every gradient with 29% fewer bytes. ``ActConfig(share_bn_relu=False)`` turns it off.

A leaky ReLU (slope ``s``) works the same way: ``h = where(m, y, s * y)`` is linear in ``y`` given the exact
mask, so ``h_hat = where(m, y_hat, s * y_hat)`` is unbiased too.

Protocol: BatchNorm calls :func:`note_affine` on its output; the (leaky) ReLU asks :func:`affine_of` for its input and
calls :func:`note_rectified` on its output; a conv or linear asks :func:`rectified_input` for its input before
packing it (BatchNorm notes only when its ``act_share_bn_relu`` is set). A note (:func:`remember`) is used only while
the tensor it describes is alive and unmodified (same object and version counter), holds what it reads until
that tensor dies, and is used only at the bits and group size the consumer would have packed at: with adaptive bits the
consumer's slot joins BatchNorm's slot group in a sensitivity probe, so the allocator gives both one width.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .compress import PackedTensor, dequantize, unpack_bits
from .context import store

__all__ = ["RectifiedAffine", "affine_of", "note_affine", "note_rectified", "recall", "rectified_input", "remember"]


@dataclass
class RectifiedAffine:
    """``where(m, y, negative_slope * y)`` with ``y = weight * dequantize(packed) + bias`` along dim 1: a context
    made of other ops' saved tensors.

    Attributes:
        packed: BatchNorm's packed normalized input.
        weight: BatchNorm's ``gamma`` (``None``: 1).
        bias: BatchNorm's ``beta`` (``None``: 0).
        mask: the (leaky) ReLU's packed 1-bit code ``m`` of ``y > 0`` (logical element order).
        dtype: the dtype of the tensor it stands for.
        negative_slope: 0 for a ReLU, the slope of a leaky ReLU.
    """

    packed: PackedTensor
    weight: Tensor | None
    bias: Tensor | None
    mask: Tensor
    dtype: torch.dtype
    negative_slope: float = 0.0

    @property
    def tensors(self) -> list[Tensor]:
        """What an op saves: the packed tensors, the mask, then ``weight`` and ``bias`` where given."""
        return [*self.packed.tensors, self.mask] + [t for t in (self.weight, self.bias) if t is not None]

    @property
    def meta(self) -> tuple:
        """Everything but the tensors (see :meth:`rebuild`)."""
        return self.packed.spec, self.weight is not None, self.bias is not None, self.dtype, self.negative_slope

    @classmethod
    def rebuild(cls, tensors: list[Tensor] | tuple[Tensor, ...], meta: tuple) -> RectifiedAffine:
        spec, has_weight, has_bias, dtype, negative_slope = meta
        n = spec.n_tensors
        rest = list(tensors[n + 1:])
        weight = rest.pop(0) if has_weight else None
        bias = rest.pop(0) if has_bias else None
        return cls(PackedTensor.rebuild(tensors[:n], spec), weight, bias, tensors[n], dtype, negative_slope)

    def dequantize(self) -> Tensor:
        """The estimate ``h_hat`` (a new contiguous tensor of the original shape, in ``dtype``)."""
        shape = self.packed.shape
        channel = (1, -1) + (1,) * (len(shape) - 2)
        values = dequantize(self.packed).float()  # a new tensor: updated in place from here on
        if self.weight is not None:
            values.mul_(self.weight.float().view(channel))
        if self.bias is not None:
            values.add_(self.bias.float().view(channel))
        keep = unpack_bits(self.mask, 1, math.prod(shape)).view(shape).bool()
        if self.negative_slope:
            return torch.where(keep, values, values * self.negative_slope).to(self.dtype)
        return values.masked_fill_(~keep, 0).to(self.dtype)


_local = threading.local()


def _notes() -> dict:
    notes = getattr(_local, "notes", None)
    if notes is None:
        notes = _local.notes = {}
    return notes


def remember(x: Tensor, kind: str, value: Any) -> None:
    """Attach ``value`` (``kind``: what it says of ``x``) to the tensor ``x`` while ``x`` lives.

    The note holds ``value`` strongly and dies with ``x``, so a forward decides the same way when
    ``torch.utils.checkpoint`` recomputes it (its first pass drops every saved tensor at once)."""
    notes, key = _notes(), (kind, id(x))

    def forget(ref: weakref.ref) -> None:
        if key in notes and notes[key][0] is ref:
            del notes[key]

    notes[key] = (weakref.ref(x, forget), x._version, value)


def recall(x: Tensor, kind: str) -> Any:
    """The value :func:`remember` attached to ``x`` under ``kind``, if ``x`` is unmodified since; else ``None``."""
    note = _notes().get((kind, id(x)))
    if note is None or note[0]() is not x or x._version != note[1]:
        return None
    return note[2]


@dataclass(frozen=True)
class _Affine:
    packed: PackedTensor
    weight: Tensor | None
    bias: Tensor | None
    slot: str


def note_affine(y: Tensor, packed: PackedTensor, weight: Tensor | None, bias: Tensor | None, slot: str) -> None:
    """Record that BatchNorm's output ``y`` is ``weight * dequantize(packed) + bias`` per channel (dim 1) in
    expectation, ``packed`` being the normalized input BatchNorm saved under ``slot``."""
    if y.dim() >= 2 and tuple(y.shape) == tuple(packed.shape):
        remember(y, "affine", _Affine(packed, weight, bias, slot))


def affine_of(x: Tensor) -> _Affine | None:
    """What :func:`note_affine` recorded for ``x``, if ``x`` is unmodified since (ask before a ReLU runs: an
    in-place one modifies ``x``)."""
    return recall(x, "affine")


def note_rectified(out: Tensor, affine: _Affine, mask: Tensor, negative_slope: float = 0.0) -> None:
    """Record that ``out = relu(y)`` (or ``leaky_relu(y, negative_slope)``), ``y`` the BatchNorm output
    ``affine`` describes (from :func:`affine_of`) and ``mask`` the packed 1-bit code of ``y > 0``."""
    remember(out, "rectified", (affine, mask, negative_slope))


def rectified_input(x: Tensor, settings) -> RectifiedAffine | None:
    """The derived context of ``x`` when it is ``relu(batch_norm(.))`` (or a leaky ReLU) noted by both ops and
    packed at ``settings.bits`` and ``settings.group_size`` (an op's :class:`~act_hf.ops._saving.OpSettings`);
    else ``None`` (the op packs ``x`` itself)."""
    found = recall(x, "rectified")
    if found is None:
        return None
    affine, mask, negative_slope = found
    if (affine.packed.bits, affine.packed.group_size) != (settings.bits, settings.group_size):
        return None
    if store.swap.is_swapped(affine.packed):  # one more op fetches BatchNorm's host copy in backward
        store.swap.reused(affine.packed)
    probe = store._probe
    if probe is not None:  # the consumer reads BatchNorm's draw: one slot group, one width
        probe._union(settings.slot, affine.slot)
        probe._used(affine.packed)
    return RectifiedAffine(affine.packed, affine.weight, affine.bias, mask, x.dtype, negative_slope)
