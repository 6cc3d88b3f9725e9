"""Contexts read from tensors other ops already keep: a conv fed by ``relu(batch_norm(x))`` or
``leaky_relu(batch_norm(x))``, or by a residual block's ``relu(batch_norm(x) + shortcut)``.

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
mask, so ``h_hat = where(m, y_hat, s * y_hat)`` is unbiased too. So does a clipping one, ReLU6 or
``hardtanh(y, lo, hi)`` (MobileNetV2's and EfficientNet-Lite's expansions): its mask ``m`` is the code of
``lo < y < hi``, and with ``u``, the code of ``h >= hi`` that the conv packs from its input (1 bit an element;
the first conv to read ``h`` packs it, the others share it), ``h = where(m, y, where(u, hi, lo))`` is linear in
``y``: the chain costs ``b + 2`` bits an element instead of ``2b + 1``. timm mobilenetv2_100 (bf16 autocast,
2 x 3 x 224 x 224, 3 bits): 5.68 -> 4.15 MiB a sample; whole-gradient error against fp64 (4 x 3 x 128 x 128,
BatchNorm gamma ~ U(0.2, 1), beta ~ N(0, 0.2), fp32, mean of 3 draws) 0.383 -> 0.385 at 3 bits, 0.0169 ->
0.0170 at 8; efficientnet_lite0 5.74 -> 4.20, 0.419 -> 0.415 and 0.0143 -> 0.0141.

A residual block ``h = relu(bn3(z) + shortcut)`` (timm's and torchvision's ResNet and RegNet blocks, timm's CSPNet)
is the same with a sum: ``h = m * (gamma * x_norm + beta + shortcut)`` is linear in ``x_norm`` and in the shortcut,
and the shortcut is itself such a derived tensor (the previous block's ``h``), a downsample BatchNorm's output or a
tensor a conv packed for itself (the stage's first input). So the next block's conv reads

    h_hat = m * (gamma * Q(x_norm) + beta + shortcut_hat)

which is unbiased and again needs no new bytes: a stage's block inputs cost nothing of their own, and a ResNet's
saved context shrinks by about a quarter (timm resnet50, bf16, 2 bits: 5.73 -> 4.36 MiB a sample). The add is read
from autograd's graph: the ReLU's input was made by an ``AddBackward0`` (``alpha`` 1) whose two operands are noted
tensors, unmodified but for that add (in place, as ResNets add), or dead since the add unmodified (out of place,
``y = y + shortcut``, as RegNets add: the note outlives ``y`` until the next note or query, see :func:`remember`).
Stochastic depth before the add (timm's ``DropPath``: ``drop_path(bn3(z))`` is ``s * bn3(z)``, ``s`` 0 or
``1 / keep_prob`` per sample) keeps this: the converted ``DropPath`` notes its output (:func:`note_scaled`), and the
term is ``s * (gamma * Q(x_norm) + beta)``, ``s`` exact. Squeeze-and-excitation before the add (SE-ResNet:
``se(bn3(z)) = g * bn3(z)``, ``g`` one gate value per sample and channel) is the same with ``s = g``: timm's SE
modules note their output so (:func:`note_scaled`; from their own packed input when it is not BatchNorm's
output). The estimate's error adds up along the chain of shortcuts,
but so does the block output's range that an own copy's groups span; measured (timm resnet50, 8 x 3 x 64 x 64, fp32,
BatchNorm gamma ~ U(0.2, 1), beta ~ N(0, 0.2); SQNR in dB against fp64 autograd, mean of 3 draws)::

    bits   block conv1 weight grads    whole gradient
           own copy  shared            own copy  shared
    8      35.81     34.72             34.69     34.59
    3      9.34      6.82              11.02     10.95
    2      1.47      -1.02             3.06      2.86

The block convs lose 2.5 dB, the same for every block of a stage (no build-up with depth), and the whole
gradient 0.1-0.2 dB. Backward rebuilds each block input from the whole chain (a stage of ``n`` blocks
dequantizes ``n (n + 1) / 2`` tensors instead of ``n``), each BatchNorm term mapped by its ``gamma`` and ``beta``
and each block's ReLU mask applied after its term, all of a block input's terms decoded in one pass that writes the
sum once, fp32 until then (:func:`~act_hf.compress.dequantize_chain`: up to 8 terms a pass; a pass a term reads and
writes the whole sum once a term). ``ActConfig(share_residual=False)`` turns it off. With
adaptive bits a stage's chain (its BatchNorm inputs the shortcuts read, and the convs that read them) is one slot
group, given one width.

The same holds wherever a gradient is linear in a tensor the ops before it describe, without an add: a conv reading
BatchNorm's output directly, ``gamma * Q(x_norm) + beta`` (a MobileNet block's output, the next block's first conv
input), and a conv reading a squeeze-and-excitation's output ``g * h``, read as ``g`` (exact) times what describes
``h``: BatchNorm's packed input and the ReLU's mask (RegNetY's ``conv3(se(relu(bn2(.))))``; the SE reads its own
input, for the gate's gradient, from them too), or the SE's own packed copy of ``h`` (EfficientNet's
``conv_pwl(se(silu(bn(.))))``, a SiLU's output described by nothing else), and a conv reading a linear
bottleneck's block output ``drop_path(bn3(.)) + shortcut`` with no ReLU after the add (MobileNetV2 / V3,
EfficientNet: :func:`sum_input` reads the add from autograd's graph and notes the output as the sum, so the next
block's add finds its shortcut; mobilenetv2_100 5.76 -> 5.68 MiB a sample at 3 bits, efficientnet_b0 7.31 -> 7.23,
mobilenetv3_large_100 3.36 -> 3.28; whole-gradient error at 3 bits 0.434 -> 0.437 and 0.511 -> 0.512).
Measured (timm, random init, 2 x 3 x 224 x 224 under bf16 autocast, 3 bits; MiB a sample saved, before -> after,
for the squeeze-and-excitation and BatchNorm reads): regnety_016 5.72 -> 4.18, efficientnet_b0
8.17 -> 7.31, mobilenetv3_large_100 3.67 -> 3.36; the whole gradient's relative error against fp64 autograd (4 x 3 x
128 x 128, BatchNorm gamma ~ U(0.2, 1), beta ~ N(0, 0.2), mean of 3 draws) 0.353 -> 0.364, 0.509 -> 0.511 and
0.526 -> 0.521 at 3 bits, 0.0117 -> 0.0119, 0.0233 -> 0.0231 and 0.0186 -> 0.0179 at 8.

Protocol: BatchNorm calls :func:`note_affine` on its output (stochastic depth and squeeze-and-excitation
:func:`note_scaled` on their own); the
(leaky) ReLU asks :func:`affine_of` for its input and calls :func:`note_rectified` on its output; a conv or linear
asks :func:`derived_input` for its input before packing it, and a conv that packs its input itself notes it with
:func:`note_packed` (BatchNorm notes only when its ``act_share_bn_relu`` is set). A note (:func:`remember`) is used
only while the tensor it describes is alive and unmodified (same object and version counter), holds what it reads
until that tensor dies, and is used only at the bits and group size the consumer would have packed at: with adaptive
bits the consumer's slot joins BatchNorm's slot group in a sensitivity probe, so the allocator gives both one width.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ._chunks import in_place
from ._constants import zeros_and_ones
from .compress import (
    PackedTensor,
    dequantize,
    dequantize_chain,
    dequantize_items,
    dequantize_mapped,
    pack_bits,
    unpack_mask,
    zero_unmasked,
)
from .context import store
from .regions import current_region, region_is_open

__all__ = ["DERIVED_CONTEXTS", "AffineSum", "AffineTerm", "Items", "RectifiedAffine", "affine_input", "affine_of",
           "derived_input", "drop_dead_notes", "items_decodable",
           "note_affine", "note_made_by", "note_packed", "note_pending", "note_rectified", "note_scaled",
           "rebuild_derived", "recall", "rectified_input", "remember", "sum_input"]


@dataclass
class AffineTerm:
    """``sample_scale * (weight * dequantize(packed) + bias)``, ``weight`` and ``bias`` along dim 1 and
    ``sample_scale`` ``(batch, 1)`` or ``(batch, channels)`` along dims 0 and 1 (``None``: 1, 0 and 1): BatchNorm's
    output read from its packed normalized input, or (no weight, no bias) a tensor an op packed for itself; with a
    ``sample_scale``, after squeeze-and-excitation (one gate value per sample and channel) or stochastic
    depth (timm's ``DropPath``: 0 or ``1 / keep_prob`` per sample)."""

    packed: PackedTensor
    weight: Tensor | None
    bias: Tensor | None
    sample_scale: Tensor | None = None

    @property
    def tensors(self) -> list[Tensor]:
        return [*self.packed.tensors] + [t for t in (self.weight, self.bias, self.sample_scale) if t is not None]

    @property
    def meta(self) -> tuple:
        return ("affine", self.packed.spec, self.weight is not None, self.bias is not None,
                self.sample_scale is not None)

    def leaves(self) -> list[PackedTensor]:
        return [self.packed]

    @property
    def one_pass(self) -> bool:
        """Whether the term is mapped into a sum in one pass over it (``dequantize_mapped``, and
        ``dequantize_chain``'s terms): no sample scale, a row-major context of at least 2 dims."""
        return self.sample_scale is None and self.packed.spec.memory_order is None and len(self.packed.shape) >= 2

    def channel_map(self) -> tuple[Tensor, Tensor]:
        """``(weight, bias)`` in fp32, one value a channel of dim 1 (1 and 0 where the term has none)."""
        zeros, ones = zeros_and_ones((self.packed.shape[1],), self.packed.payload, torch.float32)
        return (ones if self.weight is None else self.weight.float(),
                zeros if self.bias is None else self.bias.float())

    def add_to(self, values: Tensor | None, dtype: torch.dtype, items: Items = None,
               mask: Tensor | None = None) -> Tensor:
        """``values + term``, in place in ``values``; the term as a new tensor of ``dtype`` when ``values`` is
        ``None``. With ``items``, ``(start, stop)``, only the term's batch items ``start:stop`` (bit for bit those
        of the whole, decoding only them: :func:`~act_hf.compress.dequantize_items`). With ``mask`` (a ReLU's
        packed 1-bit code, of the result's elements) the result is ``+0`` where its bit is 0. A row-major context
        without a sample scale is added in one pass over the result (:func:`~act_hf.compress.dequantize_mapped`), its
        values kept in fp32 from the decode to the one rounding at the end."""
        if self.one_pass and (values is None or values.is_contiguous()):
            return dequantize_mapped(self.packed, *self.channel_map(), out=values, dtype=dtype, items=items, mask=mask)
        return _masked(self._add_to(values, dtype, items), mask)

    def _add_to(self, values: Tensor | None, dtype: torch.dtype, items: Items) -> Tensor:
        """:meth:`add_to` without a mask, a pass for each operation."""
        # a new tensor of dtype, updated in place from here on, when there are no values yet
        reader = dtype if values is None else None
        decoded = dequantize(self.packed, reader) if items is None else dequantize_items(self.packed, *items, reader)
        channel = (1, -1) + (1,) * (decoded.dim() - 2)
        weight = None if self.weight is None else self.weight.float().view(channel)
        bias = None if self.bias is None else self.bias.float().view(channel)
        if self.sample_scale is not None:  # s * (w * x + b) = (s w) * x + s b: factors of (batch, channels)
            scale = _sample_view(_of_items(self.sample_scale, items).float(), decoded.dim())
            weight = scale if weight is None else scale * weight
            bias = None if bias is None else scale * bias
        if values is None:
            values = decoded
            if weight is not None and bias is not None:  # w * x + b in one pass, rounded once
                return in_place(values, _scale_shift_, weight, bias)
            if weight is not None:
                in_place(values, Tensor.mul_, weight)
        elif weight is not None:
            in_place(values, Tensor.addcmul_, decoded, weight)
        else:
            in_place(values, Tensor.add_, decoded)
        if bias is not None:
            in_place(values, Tensor.add_, bias)
        return values


def _scale_shift_(values: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``values = weight * values + bias`` in place (``torch.addcmul`` into ``values``)."""
    return torch.addcmul(bias, values, weight, out=values)


#: batch items ``(start, stop)`` of a context to decode, or ``None``: all of them
Items = tuple[int, int] | None


def _of_items(t: Tensor | None, items: Items) -> Tensor | None:
    """``t``'s batch items ``start:stop`` (``t`` itself for ``None``)."""
    return t if t is None or items is None else t[items[0]:items[1]]


def _mask_of_items(mask: Tensor | None, per_item: int, items: Items) -> Tensor | None:
    """The bytes of a 1-bit ``mask`` packed in the whole tensor's logical order that hold batch items
    ``start:stop``, of ``per_item`` elements each (their first bit starts a byte: see :func:`items_decodable`)."""
    if mask is None or items is None:
        return mask
    start = items[0] * per_item
    if start % 8:
        raise ValueError(f"items: batch item {items[0]} does not start a byte of the packed mask "
                         f"({per_item} elements an item)")
    return mask[start // 8:-(-(items[1] * per_item) // 8)]


def _sum_of(terms, dtype: torch.dtype, items: Items = None, mask: Tensor | None = None) -> Tensor:
    """The sum of derived ``terms`` (their batch ``items``) as a new tensor of ``dtype``, ``+0`` where the bit of
    ``mask`` is 0: where the sum is a chain (:func:`_chain_of`), one :func:`~act_hf.compress.dequantize_chain`
    (the result written once for up to 8 terms); otherwise term by term, nested contexts first (their new tensor is
    the sum's: one decoded term more alive at a time, however long a chain of shortcuts), the mask applied with the
    last term (:meth:`AffineTerm.add_to`)."""
    chain = _chain_of(terms, dtype, items, mask)
    if chain is not None:
        return dequantize_chain(chain, dtype=dtype, items=items)
    values = None
    ordered = _nested_first(terms)
    for i, term in enumerate(ordered):
        values = term.add_to(values, dtype, items, mask if i == len(ordered) - 1 else None)
    return values


def _nested_first(terms) -> list:
    """``terms`` with the nested contexts first, the order a sum adds them in."""
    return sorted(terms, key=lambda t: not isinstance(t, (RectifiedAffine, AffineSum)))


def _chain_of(terms, dtype: torch.dtype, items: Items, mask: Tensor | None) -> list | None:
    """The sum of ``terms``, masked by ``mask`` after the last, as :func:`~act_hf.compress.dequantize_chain`'s
    ``(packed, weight, bias, mask)`` terms, innermost first: a residual stage's block input ``relu(bn3(.) +
    relu(bn3'(.) + ...))`` is one term a block, each with its ReLU's mask (their ``items`` bytes). ``None`` where
    the sum is not such a chain: a term with a sample scale or stored in another memory order than row-major (decoded
    to its own layout, a pass of its own), a leaky or clipping ReLU, a nested context that is not the first term or
    of another dtype, or two masks after one term."""
    ordered = _nested_first(terms)
    chain = []
    for i, term in enumerate(ordered):
        last = mask if i == len(ordered) - 1 else None
        if isinstance(term, AffineTerm):
            if not term.one_pass:
                return None
            chain.append((term.packed, *term.channel_map(), last))
            continue
        if i > 0 or term.dtype != dtype:
            return None
        if isinstance(term, RectifiedAffine):
            if term.negative_slope or term.clamp is not None or term.sample_scale is not None:
                return None
            per_item = math.prod(term.leaves()[0].shape[1:])
            nested = _chain_of(term.terms, dtype, items, _mask_of_items(term.mask, per_item, items))
        else:
            nested = _chain_of(term.terms, dtype, items, None)
        if nested is None or (last is not None and nested[-1][3] is not None):
            return None
        if last is not None:  # a sum of one nested context: the mask after its last term
            nested[-1] = (*nested[-1][:3], last)
        chain += nested
    return chain


def _masked(values: Tensor, mask: Tensor | None) -> Tensor:
    """``values`` (contiguous), ``+0`` in place where the bit of ``mask`` is 0 (``None``: as they are)."""
    return values if mask is None else zero_unmasked(values, mask, in_place=True)


def _sample_view(scale: Tensor, ndim: int) -> Tensor:
    """A ``(batch, 1)`` or ``(batch, channels)`` sample scale viewed to broadcast along dims 0 and 1 of ``ndim``."""
    return scale.view(tuple(scale.shape) + (1,) * (ndim - 2))


@dataclass
class RectifiedAffine:
    """``where(m, y, negative_slope * y)``, ``y`` the sum of ``terms``: a context made of other ops' saved
    tensors. One term is ``relu(batch_norm(.))``; more are a residual block's output ``relu(bn(.) + shortcut)``,
    the shortcut itself such a context or an :class:`AffineTerm`.

    Attributes:
        terms: :class:`AffineTerm` or nested :class:`RectifiedAffine`, all of the shape of the tensor it stands for.
        mask: the (leaky) ReLU's packed 1-bit code ``m`` of ``y > 0`` (logical element order).
        dtype: the dtype of the tensor it stands for.
        negative_slope: 0 for a ReLU, the slope of a leaky ReLU.
        sample_scale: ``(batch, 1)`` or ``(batch, channels)`` factors the whole is multiplied by along dims 0 and 1
            (a squeeze-and-excitation gate after the ReLU: RegNetY's ``se(relu(bn2(.)))``), or ``None``.
        clamp: ``(lo, hi)`` for a ReLU6 (``(0, 6)``) or a hardtanh: the whole is ``where(m, y, where(u, hi, lo))``,
            ``m`` then the code of ``lo < y < hi``; ``None`` for a (leaky) ReLU.
        upper: with ``clamp``, the packed 1-bit code ``u`` of ``y >= hi`` (logical element order).
    """

    terms: tuple[AffineTerm | RectifiedAffine, ...]
    mask: Tensor
    dtype: torch.dtype
    negative_slope: float = 0.0
    sample_scale: Tensor | None = None
    clamp: tuple[float, float] | None = None
    upper: Tensor | None = None

    @property
    def tensors(self) -> list[Tensor]:
        """What an op saves: the mask, the upper mask and the sample scale if any, then each term's tensors."""
        head = [t for t in (self.mask, self.upper, self.sample_scale) if t is not None]
        return head + [t for term in self.terms for t in term.tensors]

    @property
    def meta(self) -> tuple:
        """Everything but the tensors (see :meth:`rebuild`)."""
        return ("rectified", self.dtype, self.negative_slope, tuple(term.meta for term in self.terms),
                self.sample_scale is not None, self.clamp)

    @classmethod
    def rebuild(cls, tensors: list[Tensor] | tuple[Tensor, ...], meta: tuple,
                resolve: Callable[[PackedTensor], PackedTensor] = lambda packed: packed) -> RectifiedAffine:
        """The context :attr:`tensors` and :attr:`meta` came from (:func:`rebuild_derived`)."""
        return rebuild_derived(tensors, meta, resolve)

    def leaves(self) -> list[PackedTensor]:
        """Every packed tensor it reads."""
        return [leaf for term in self.terms for leaf in term.leaves()]

    def add_to(self, values: Tensor | None, dtype: torch.dtype, items: Items = None,
               mask: Tensor | None = None) -> Tensor:
        """Like :meth:`AffineTerm.add_to` (its own :attr:`dtype` is the one it was made with)."""
        return _masked(self.dequantize(items) if values is None else values.add_(self.dequantize(items)), mask)

    def dequantize(self, items: Items = None) -> Tensor:
        """The estimate ``h_hat`` (a new contiguous tensor of the original shape, in ``dtype``), or of its batch
        ``items`` only. A chain of shortcuts is summed into the innermost one's tensor, so besides it only one
        decoded term is alive at a time, however long the chain; a plain or clipping ReLU's mask zeroes what it
        drops straight from its packed bits as the last term is added (:meth:`AffineTerm.add_to`), a leaky one's is
        unpacked whole."""
        per_item = math.prod(self.leaves()[0].shape[1:])
        mask, upper = _mask_of_items(self.mask, per_item, items), _mask_of_items(self.upper, per_item, items)
        if self.negative_slope:
            values = _sum_of(self.terms, self.dtype, items)
            values = torch.where(unpack_mask(mask, values.shape), values, values * self.negative_slope)
        else:
            values = _sum_of(self.terms, self.dtype, items, mask)
        if self.clamp is not None:  # the clipped elements: hi where u, else lo (0 already where lo is 0)
            lo, hi = self.clamp
            upper = unpack_mask(upper, values.shape)
            if lo:
                values.masked_fill_(~(unpack_mask(mask, values.shape) | upper), lo)
            values.masked_fill_(upper, hi)
        if self.sample_scale is not None:
            values.mul_(_sample_view(_of_items(self.sample_scale, items), values.dim()))
        return values


@dataclass
class AffineSum:
    """``sum(terms)`` without a ReLU after it: a linear bottleneck's block output ``bn3(.) + shortcut``
    (MobileNetV2 / V3, EfficientNet), read by the next block's first conv; the shortcut an :class:`AffineTerm`
    (BatchNorm's output, possibly scaled, or a tensor a conv packed) or a nested context.

    Attributes:
        terms: :class:`AffineTerm`, :class:`RectifiedAffine` or :class:`AffineSum`, of the shape it stands for.
        dtype: the dtype of the tensor it stands for.
    """

    terms: tuple[AffineTerm | RectifiedAffine | AffineSum, ...]
    dtype: torch.dtype

    @property
    def tensors(self) -> list[Tensor]:
        return [t for term in self.terms for t in term.tensors]

    @property
    def meta(self) -> tuple:
        return "sum", self.dtype, tuple(term.meta for term in self.terms)

    def leaves(self) -> list[PackedTensor]:
        return [leaf for term in self.terms for leaf in term.leaves()]

    def add_to(self, values: Tensor | None, dtype: torch.dtype, items: Items = None,
               mask: Tensor | None = None) -> Tensor:
        """Like :meth:`AffineTerm.add_to` (its own :attr:`dtype` is the one it was made with)."""
        if values is None:
            return _sum_of(self.terms, self.dtype, items, mask)
        return _masked(values.add_(self.dequantize(items)), mask)

    def dequantize(self, items: Items = None) -> Tensor:
        """The estimate (a new contiguous tensor of the original shape, in ``dtype``), or of its batch ``items``."""
        return _sum_of(self.terms, self.dtype, items)


#: the derived contexts an op may save instead of a packed tensor of its own (:func:`rebuild_derived`)
DERIVED_CONTEXTS = (RectifiedAffine, AffineTerm, AffineSum)


def items_decodable(saved: PackedTensor | RectifiedAffine | AffineTerm | AffineSum) -> bool:
    """Whether ``saved`` decodes batch items ``start:stop`` for any ``start`` and ``stop`` from their own bits
    alone (``add_to(..., items=...)``, :func:`~act_hf.compress.dequantize_items`): every packed tensor it reads
    stores the batch dim outermost, and an item holds a whole number of bytes of a 1-bit mask."""
    leaves = saved.leaves() if isinstance(saved, DERIVED_CONTEXTS) else [saved]
    shape = leaves[0].shape
    per_item = math.prod(shape[1:])
    return (len(shape) > 1 and per_item % 8 == 0
            and all(leaf.spec.memory_order is None or leaf.spec.memory_order[0] == 0 for leaf in leaves))


def rebuild_derived(tensors: list[Tensor] | tuple[Tensor, ...], meta: tuple,
                    resolve: Callable[[PackedTensor], PackedTensor] = lambda packed: packed
                    ) -> AffineTerm | RectifiedAffine | AffineSum:
    """The derived context (one of :data:`DERIVED_CONTEXTS`) whose ``tensors`` and ``meta`` these are, each packed
    tensor passed through ``resolve`` (e.g. :meth:`act_hf.context.ContextStore.resolve`)."""
    rebuilt, used = _rebuild(list(tensors), 0, meta, resolve)
    if used != len(tensors):
        raise ValueError(f"a derived context with meta {meta} takes {used} tensors, got {len(tensors)}")
    return rebuilt


def _rebuild(tensors: list[Tensor], i: int, meta: tuple, resolve
             ) -> tuple[AffineTerm | RectifiedAffine | AffineSum, int]:
    """The term ``meta`` describes, from ``tensors[i:]``, and the index after its last tensor."""
    if meta[0] == "affine":
        _, spec, *present = meta
        packed = resolve(PackedTensor.rebuild(tensors[i:i + spec.n_tensors], spec))
        i += spec.n_tensors
        optional = []  # weight, bias, sample_scale
        for has in present:
            optional.append(tensors[i] if has else None)
            i += has
        return AffineTerm(packed, *optional), i
    if meta[0] == "sum":
        _, dtype, term_metas = meta
        terms, i = _rebuild_terms(tensors, i, term_metas, resolve)
        return AffineSum(terms, dtype), i
    _, dtype, negative_slope, term_metas, scaled, clamp = meta
    mask, i = tensors[i], i + 1
    upper, i = (tensors[i], i + 1) if clamp is not None else (None, i)
    sample_scale, i = (tensors[i], i + 1) if scaled else (None, i)
    terms, i = _rebuild_terms(tensors, i, term_metas, resolve)
    return RectifiedAffine(terms, mask, dtype, negative_slope, sample_scale, clamp, upper), i


def _rebuild_terms(tensors: list[Tensor], i: int, term_metas: tuple, resolve) -> tuple[tuple, int]:
    """The terms ``term_metas`` describe, in order from ``tensors[i:]``, and the index after the last one's."""
    terms = []
    for term_meta in term_metas:
        term, i = _rebuild(tensors, i, term_meta, resolve)
        terms.append(term)
    return tuple(terms), i


_local = threading.local()
#: whether any note was ever made (:func:`remember`): until one is, no tensor has one, and the queries of a model
#: that makes none (a transformer's linears ask for each input) answer at once instead of finding their region
_noted = False


class _RegionNotes:
    """The notes of one checkpoint region (:mod:`act_hf.regions`): live ones by (kind, tensor id), and those that
    outlive their tensor (:func:`remember`)."""

    __slots__ = ("dead", "notes")

    def __init__(self) -> None:
        self.notes: dict = {}
        self.dead: list = []


def _region_notes() -> _RegionNotes:
    """The notes of the region the running code is in; a region's notes are seen nowhere else. The notes of
    checkpoint passes torch has left are dropped here: they can be read no more, and would hold what they read
    (packed contexts the checkpoint dropped) while their tensors live, e.g. a block's output kept as the next
    block's checkpoint input (timm resnet50 checkpointed per block, 4 x 3 x 128 x 128, 3 bits: 4.4 MiB)."""
    region = current_region()
    regions = getattr(_local, "regions", None)
    if regions is None:
        regions = _local.regions = weakref.WeakKeyDictionary()
    for closed in [r for r in regions if not region_is_open(r)]:
        del regions[closed]
    try:
        weakref.ref(region)
    except TypeError:  # a user's pack hook that takes no weak reference (a builtin): not a checkpoint's
        region = None
    if region is None:
        state = getattr(_local, "outside", None)
        if state is None:
            state = _local.outside = _RegionNotes()
        return state
    state = regions.get(region)
    if state is None:
        state = regions[region] = _RegionNotes()
    return state


def _notes() -> dict:
    return _region_notes().notes


#: the kinds of note that outlive a tensor dying unmodified (:func:`remember`)
_REVIVED_KINDS = ("affine", "sum", "lm_head", "lm_logits")


def _dead() -> list:
    return _region_notes().dead


def remember(x: Tensor, kind: str, value: Any) -> None:
    """Attach ``value`` (``kind``: what it says of ``x``) to the tensor ``x`` while ``x`` lives.

    The note holds ``value`` strongly and dies with ``x``, so a forward decides the same way when
    ``torch.utils.checkpoint`` recomputes it (its first pass drops every saved tensor at once); it is seen only in
    the checkpoint region that made it (:mod:`act_hf.regions`), and dropped once torch leaves that region. An
    ``"affine"`` or ``"lm_head"`` note on a tensor made by an autograd node, dying unmodified, outlives it until
    the next note or the next query (:func:`affine_of`, :func:`note_made_by`), keyed by that node and output
    number: ``y = bn(.) + shortcut`` frees ``y`` before a ReLU asks what the sum is, and ``logits / scale`` frees
    the LM head's output before the loss asks what the logits are."""
    global _noted
    _noted = True
    state = _region_notes()
    notes, key, dead = state.notes, (kind, id(x)), state.dead
    dead.clear()  # a new note: the forward has moved past the tensors that died before it
    version = x._version
    # a detached alias shares x's version counter, so the check at x's death sees every in-place edit since now
    revival = (x.detach(), x.grad_fn, x.output_nr) if kind in _REVIVED_KINDS and x.grad_fn is not None else None

    def forget(ref: weakref.ref) -> None:
        if key in notes and notes[key][0] is ref:
            del notes[key]
            if revival is not None and revival[0]._version == version:
                dead.append((kind, revival[1], revival[2], value))

    notes[key] = (weakref.ref(x, forget), version, value)


def recall(x: Tensor, kind: str, *, consume: bool = False) -> Any:
    """The value :func:`remember` attached to ``x`` under ``kind``, if ``x`` is unmodified since; else ``None``.
    With ``consume`` (the note's last read) the note is forgotten: it then cannot outlive ``x``
    (:func:`note_made_by`)."""
    if not _noted:
        return None
    notes = _notes()
    note = notes.get((kind, id(x)))
    if note is None or note[0]() is not x or x._version != note[1]:
        return None
    if consume:
        del notes[(kind, id(x))]
    return note[2]


@dataclass(frozen=True)
class _Affine:
    """Note on BatchNorm's output: ``weight * x_norm + bias``, ``x_norm`` packed under ``slot`` (or on a tensor a
    linear or conv packed itself: no weight, no bias); with ``sample_scale`` (``(batch, 1)``: one value per sample;
    ``(batch, channels)``: one per sample and channel), on that output times it (:func:`note_scaled`)."""

    packed: PackedTensor
    weight: Tensor | None
    bias: Tensor | None
    slot: str
    sample_scale: Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.packed.shape)

    def sources(self) -> list[tuple[str, PackedTensor]]:
        """The (slot, packed tensor) pairs it reads."""
        return [(self.slot, self.packed)]

    def context(self, dtype: torch.dtype) -> AffineTerm:
        return AffineTerm(self.packed, self.weight, self.bias, self.sample_scale)


@dataclass(frozen=True)
class _Sum:
    """Note on a residual add ``a + b`` whose operands are noted (BatchNorm's output, a rectified tensor, another
    such sum: its terms are spliced in)."""

    terms: tuple[_Affine | _Rectified, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.terms[0].shape

    def sources(self) -> list[tuple[str, PackedTensor]]:
        return [source for term in self.terms for source in term.sources()]

    def context(self, dtype: torch.dtype) -> AffineSum:
        return AffineSum(tuple(term.context(dtype) for term in self.terms), dtype)


@dataclass(frozen=True)
class _Rectified:
    """Note on a (leaky) ReLU's output ``where(m, y, slope * y)``, or a ReLU6's or hardtanh's (``clamp``, with
    ``upper`` once a consumer has packed it: see :class:`RectifiedAffine`), ``y`` described by ``source``; with
    ``sample_scale`` (as :class:`_Affine`'s), on that output times it (:func:`note_scaled`)."""

    source: _Affine | _Sum
    mask: Tensor
    negative_slope: float
    sample_scale: Tensor | None = None
    clamp: tuple[float, float] | None = None
    upper: Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    def sources(self) -> list[tuple[str, PackedTensor]]:
        return self.source.sources()

    def context(self, dtype: torch.dtype) -> RectifiedAffine:
        terms = self.source.terms if isinstance(self.source, _Sum) else (self.source,)
        return RectifiedAffine(tuple(term.context(dtype) for term in terms), self.mask, dtype, self.negative_slope,
                               self.sample_scale, self.clamp, self.upper)


def note_affine(y: Tensor, packed: PackedTensor, weight: Tensor | None, bias: Tensor | None, slot: str) -> None:
    """Record that BatchNorm's output ``y`` is ``weight * dequantize(packed) + bias`` per channel (dim 1) in
    expectation, ``packed`` being the normalized input BatchNorm saved under ``slot``."""
    if y.dim() >= 2 and tuple(y.shape) == tuple(packed.shape):
        remember(y, "affine", _Affine(packed, weight, bias, slot))


def note_packed(x: Tensor, packed: PackedTensor, slot: str) -> None:
    """Record that a linear or conv packed its input ``x`` itself under ``slot``, so a residual add that reads
    ``x`` as its shortcut can name it (``x`` already noted as another op's output keeps that note)."""
    if x.requires_grad and x.dim() >= 2 and tuple(x.shape) == tuple(packed.shape) and _live_note(x) is None:
        remember(x, "affine", _Affine(packed, None, None, slot))


def note_scaled(out: Tensor, x: Tensor, scale: Tensor, packed: Callable[[], PackedTensor] | None = None,
                slot: str = "") -> None:
    """Record that ``out = x * scale``, ``scale`` one value per sample (shape ``(batch, 1, ..., 1)``: stochastic
    depth) or per sample and channel (``(batch, channels, 1, ..., 1)``: a squeeze-and-excitation gate), when ``x``
    is noted as BatchNorm's output or a tensor an op packed itself, or as a rectified one (RegNetY's
    ``se(relu(bn2(.)))``), or else when ``packed`` gives the copy of ``x`` the caller packed under ``slot``: a
    residual add may read ``out`` as its operand, a conv as its input; nothing otherwise. Of a clipped ``x`` (ReLU6)
    this packs where it clipped at the top (:class:`RectifiedAffine`'s ``upper``), under ``slot``."""
    if out.shape != x.shape or x.dim() < 2 or scale.dim() != x.dim() or scale.shape[0] != x.shape[0] \
            or scale.shape[1] not in (1, x.shape[1]) or any(n != 1 for n in scale.shape[2:]):
        return
    kind, source = "affine", recall(x, "affine")
    if source is None:
        kind, source = "rectified", recall(x, "rectified")
    if source is None and packed is not None:
        own = packed()
        kind, source = "affine", (_Affine(own, None, None, slot) if tuple(own.shape) == tuple(x.shape) else None)
    if not isinstance(source, (_Affine, _Rectified)):
        return
    if isinstance(source, _Rectified) and source.clamp is not None and source.upper is None:
        source = _with_upper(x, source, slot)  # from x, the clipped tensor: out's clipped values are scaled
    scale = scale.detach().reshape(x.shape[0], -1)
    if source.sample_scale is not None:
        scale = scale * source.sample_scale
    remember(out, kind, replace(source, sample_scale=scale))


def note_pending(out: Tensor) -> None:
    """Make the note an op's forward left on its autograd node (``ctx.act_affine`` for :func:`note_affine`,
    ``ctx.act_rectified`` for :func:`note_rectified`), once ``out`` has that node: a note on a tensor that dies is
    found by it (:func:`remember`), and the node must not keep what the note holds."""
    node = out.grad_fn
    for attr, note in (("act_affine", note_affine), ("act_rectified", note_rectified)):
        pending = getattr(node, attr, None)
        if pending is not None:
            delattr(node, attr)
            note(out, *pending)


def affine_of(x: Tensor) -> _Affine | _Sum | None:
    """What ``x`` is, if noted and unmodified since (ask before a ReLU runs: an in-place one modifies ``x``):
    BatchNorm's output (:func:`note_affine`), or a residual add of two such tensors, either of them
    BatchNorm's output or a rectified one (:func:`note_rectified`); else ``None``."""
    try:
        return recall(x, "affine") or _residual_sum(x)
    finally:
        _dead().clear()  # read once: the forward has moved past them


def _residual_sum(x: Tensor) -> _Sum | None:
    """The sum ``x = a + b`` (no ``alpha``, no broadcasting) read from autograd's graph when both operands are
    noted: an operand's note is found by the node that made it, on a tensor still alive and unmodified; for
    ``a += b`` (what timm's and torchvision's residual blocks do) the note on ``a`` itself, which that add alone
    has modified since. An operand that died since the add (``y = y + b`` frees BatchNorm's output ``y``) is
    found by its note's node among the notes that outlive their tensors (:func:`remember`)."""
    node = x.grad_fn
    if not _noted or node is None or type(node).__name__ != "AddBackward0" or getattr(node, "_saved_alpha", None) != 1:
        return None
    first, second = node.next_functions
    own = _live_note(x)
    if own is not None:  # in place: x was the first operand, noted before the add
        version, value = own
        if x._version != version + 1:
            return None
        terms = (value, _operand(*second, x))
    elif x._version == 0:  # a new tensor, unmodified since the add
        terms = (_operand(*first, x), _operand(*second, x))
    else:
        return None
    if any(term is None or term.shape != tuple(x.shape) for term in terms):
        return None
    return _Sum(tuple(t for term in terms for t in (term.terms if isinstance(term, _Sum) else (term,))))


#: the kinds of note a residual add's operand may carry ("sum": a linear bottleneck's output, see :func:`sum_input`)
_OPERAND_KINDS = ("affine", "rectified", "sum")


def _live_note(t: Tensor) -> tuple[int, _Affine | _Rectified | _Sum] | None:
    """The (version, value) of the note :func:`remember` attached to ``t`` as an operand kind, if any."""
    notes = _notes()
    for kind in _OPERAND_KINDS:
        note = notes.get((kind, id(t)))
        if note is not None and note[0]() is t:
            return note[1], note[2]
    return None


def _operand(node: Any, output_nr: int, x: Tensor) -> _Affine | _Rectified | None:
    """The note on the live, unmodified tensor (other than ``x``) that is output ``output_nr`` of autograd
    ``node``, or on such a tensor that died unmodified since the last note (:func:`remember`), if any."""
    return _made_by(node, output_nr, _OPERAND_KINDS, x)


def _made_by(node: Any, output_nr: int, kinds: tuple[str, ...], x: Tensor | None = None, *,
             consume: bool = False) -> Any:
    if node is None:
        return None
    notes = _notes()
    for key, (ref, version, value) in list(notes.items()):
        t = ref()
        if key[0] in kinds and t is not None and t is not x and t._version == version \
                and t.grad_fn is node and t.output_nr == output_nr:
            if consume:
                del notes[key]
            return value
    for kind, dead_node, dead_output_nr, value in _dead():
        if kind in kinds and dead_node is node and dead_output_nr == output_nr:
            return value
    return None


def note_made_by(node: Any, output_nr: int, kind: str, *, drop: bool = True, consume: bool = False) -> Any:
    """The value of the ``kind`` note on output ``output_nr`` of autograd ``node``: on a live tensor unmodified
    since, or on one that died unmodified since the last note (:func:`remember`); else ``None``. With ``drop``
    (a final read), the notes that outlive their tensors are dropped. With ``consume`` (the last read of this
    note) a live tensor's note is forgotten too: else, dying after it was read (an LM's logits, returned in its
    output), it would outlive it with the value it holds (the LM head's input) into the next forward."""
    try:
        return _made_by(node, output_nr, (kind,), consume=consume)
    finally:
        if drop:
            drop_dead_notes()


def drop_dead_notes() -> None:
    """Forget the notes that outlive their tensors (:func:`remember`): a final read has asked for them."""
    _dead().clear()


def note_rectified(out: Tensor, source: _Affine | _Sum, mask: Tensor, negative_slope: float = 0.0,
                   clamp: tuple[float, float] | None = None) -> None:
    """Record that ``out = relu(y)`` (or ``leaky_relu(y, negative_slope)``, or with ``clamp = (lo, hi)``
    ``hardtanh(y, lo, hi)``: ReLU6 is ``(0, 6)``), ``y`` the tensor ``source`` describes (from :func:`affine_of`)
    and ``mask`` the packed 1-bit code of ``y > 0`` (with ``clamp``, of ``lo < y < hi``)."""
    remember(out, "rectified", _Rectified(source, mask, negative_slope, clamp=clamp))


def affine_input(x: Tensor, settings) -> AffineTerm | None:
    """The derived context of ``x`` when it is BatchNorm's output (:func:`note_affine`, possibly scaled) or a
    scaled tensor another op packed (:func:`note_scaled`: EfficientNet's ``se(x) = g * x``, ``x`` packed by the
    SE), noted and unmodified since, its packed tensor at ``settings.bits`` and ``settings.group_size``:
    ``s * (weight * Q(x_norm) + bias)``, unbiased, for an op whose gradient is linear in ``x`` (a conv's or
    linear's weight gradient, a squeeze-and-excitation gate's); else ``None`` (the op packs ``x`` itself). A tensor
    an op packed, unscaled, is not one: packing it again finds that copy (:meth:`ContextStore.compress`)."""
    found = recall(x, "affine")
    if not isinstance(found, _Affine) or (found.weight is None and found.sample_scale is None):
        return None
    return found.context(x.dtype) if _use_sources(found, settings) else None


def sum_input(x: Tensor, settings) -> AffineSum | None:
    """The derived context of ``x`` when it is a residual add of noted operands with no ReLU after it (a linear
    bottleneck's ``x = drop_path(bn3(.)) + shortcut``: MobileNetV2 / V3, EfficientNet), read from autograd's
    graph as a ReLU reads its input's (:func:`affine_of`), with ``settings.share_residual``, at its bits and
    group size; ``x`` is then noted as that sum, so the next block's add finds it as its shortcut. Else
    ``None``."""
    if not settings.share_residual:
        return None
    found = recall(x, "sum")
    if found is None:
        found = _residual_sum(x)
        if found is None:
            return None
        if _live_note(x) is None:
            remember(x, "sum", found)  # which also drops the dead notes the sum was read from
    return found.context(x.dtype) if _use_sources(found, settings) else None


def derived_input(x: Tensor, settings) -> RectifiedAffine | AffineTerm | AffineSum | None:
    """:func:`rectified_input`, else :func:`affine_input`, else :func:`sum_input`: the context of ``x`` other ops
    already saved, for an op whose gradient is linear in ``x``."""
    return rectified_input(x, settings) or affine_input(x, settings) or sum_input(x, settings)


def _use_sources(found: _Affine | _Rectified, settings) -> bool:
    """Whether a consumer with ``settings`` may read ``found``'s packed tensors (its bits and group size), and if
    so, register the extra read with the host swap and the sensitivity probe (one slot group, one width)."""
    sources = found.sources()
    if any((packed.bits, packed.group_size) != (settings.bits, settings.group_size) for _, packed in sources):
        return False
    probe = store._probe
    for slot, packed in sources:
        if store.swap.is_swapped(packed):  # one more op fetches this host copy in backward
            store.swap.reused(packed)
        if probe is not None:  # the consumer reads BatchNorm's draw: one slot group, one width
            probe._union(settings.slot, slot)
            probe._used(packed)
    return True


def rectified_input(x: Tensor, settings) -> RectifiedAffine | None:
    """The derived context of ``x`` when it is ``relu(batch_norm(.))`` (or a leaky ReLU), or a residual block's
    ``relu(batch_norm(.) + shortcut)`` (with ``settings.share_residual``), either possibly scaled
    (:func:`note_scaled`), noted by the ops that made it, every packed tensor it reads at ``settings.bits`` and
    ``settings.group_size`` (an op's
    :class:`~act_hf.ops._saving.OpSettings`); else ``None`` (the op packs ``x`` itself)."""
    found = recall(x, "rectified")
    if found is None:
        return None
    if isinstance(found.source, _Sum) and not settings.share_residual:
        return None
    if not _use_sources(found, settings):
        return None
    if found.clamp is not None and found.upper is None:
        found = _with_upper(x, found, settings.slot)
    return found.context(x.dtype)


def _with_upper(x: Tensor, found: _Rectified, slot: str) -> _Rectified:
    """``found`` with the packed code of ``x >= hi`` (which elements a ReLU6 or hardtanh clipped at the top: those
    of ``x`` equal to ``hi`` that its mask does not keep), made by the first consumer that reads ``x`` (saved
    under its ``slot``, 1 bit an element) and kept in ``x``'s note for the others."""
    upper = pack_bits(x >= found.clamp[1], 1)
    store.register((upper,), slot=slot, original_nbytes=0)
    found = replace(found, upper=upper)
    notes, key = _notes(), ("rectified", id(x))
    ref, version, _ = notes[key]
    notes[key] = (ref, version, found)  # the same weak reference: the note still dies with x
    return found
