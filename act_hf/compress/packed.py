"""``PackedTensor``: a quantized tensor as plain tensors plus a small, tensor-free description."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedSpec", "PackedTensor"]


@dataclass(frozen=True)
class PackedSpec:
    """Everything but the tensors: enough to rebuild a :class:`PackedTensor` from its three tensors."""

    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int
    channel_scaled: bool = False
    memory_order: tuple[int, ...] | None = None
    """The dims of ``shape``, outermost first, in the order the payload stores the elements, when the original was
    a permuted view of a dense tensor (a transpose, channels-last) packed as it lay in memory; ``None``: the
    row-major order of ``shape``."""

    def laid_out(self, flat: torch.Tensor, shape: tuple[int, ...] | torch.Size | None = None) -> torch.Tensor:
        """``flat``, the elements of a tensor of ``shape`` (default: ``self.shape``; a chunk of its first dim when
        that is outermost in memory) in the order the payload stores them, viewed in the original's layout."""
        shape = self.shape if shape is None else shape
        order = self.memory_order
        if order is None:
            return flat.view(*shape) if shape else flat.view(shape)  # ints parse faster than a torch.Size
        inverse = [0] * len(order)
        for position, dim in enumerate(order):
            inverse[dim] = position
        return flat.view([shape[d] for d in order]).permute(inverse)

    @property
    def n_tensors(self) -> int:
        """How many tensors the packed form has: payload, lo, scale, and the channel factors if scaled."""
        return 4 if self.channel_scaled else 3

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class PackedTensor:
    """A tensor quantized by :func:`act_hf.compress.quantize`.

    Holds only tensors (``payload``, ``lo``, ``scale``, and ``channel`` when channel-scaled) besides its
    :class:`PackedSpec`, so an autograd Function saves it with ``ctx.save_for_backward(*packed.tensors)`` and
    rebuilds it in backward with :meth:`rebuild`; saved-tensor hooks and ``torch.utils.checkpoint`` then see
    the packed bytes.

    Attributes:
        payload: ``uint8[ceil(numel * bits / 8)]``, the dense bit stream of codes.
        lo: ``int16[n_groups]``, raw bf16 (fp16 for fp16 inputs) bit patterns of each group's zero point.
        scale: ``int16[n_groups]``, raw bf16 bit patterns of each group's step.
        spec: shape, dtype, bits, group size and channel scaling of the original tensor.
        channel: ``float32[shape[-1]]``, the factors ``2**-k[c]`` decoding multiplies channel ``c`` by when
            ``spec.channel_scaled`` (it was multiplied by ``2**k[c]`` before grouping), else ``None``; see
            :func:`act_hf.compress.quantize`.
    """

    payload: torch.Tensor
    lo: torch.Tensor
    scale: torch.Tensor
    spec: PackedSpec
    channel: torch.Tensor | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors to save, ``spec.n_tensors`` of them (:meth:`rebuild` takes them back)."""
        if self.channel is None:
            return self.payload, self.lo, self.scale
        return self.payload, self.lo, self.scale, self.channel

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], spec: PackedSpec) -> PackedTensor:
        if len(tensors) != spec.n_tensors:
            raise ValueError(f"a packed tensor with {spec} has {spec.n_tensors} tensors, got {len(tensors)}")
        payload, lo, scale = tensors[:3]
        return cls(payload, lo, scale, spec, tensors[3] if spec.channel_scaled else None)

    @property
    def shape(self) -> torch.Size:
        return self.spec.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def group_size(self) -> int:
        return self.spec.group_size

    @property
    def device(self) -> torch.device:
        return self.payload.device

    @property
    def nbytes(self) -> int:
        """Payload plus metadata bytes."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __repr__(self) -> str:
        return (
            f"PackedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bits={self.bits}, "
            f"group_size={self.group_size}, channel_scaled={self.spec.channel_scaled}, nbytes={self.nbytes})"
        )
